"""nsa::window_attention (+ its backward op) against the eager formula of models/nsa.py."""

import itertools

import pytest
import torch
from oracles import (
    FLOORS, AllocationSpy, assert_close_all, assert_compiles_like_eager, assert_fakes_promise_the_layout,
    assert_graphs_hold_the_ops, assert_raises_eager_and_fake, assert_within_twice_eager, attention_inputs,
    opcheck_forward_and_backward, qkv_argument_errors, rel_rms, upcast,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile.ops
import nsa_compile.ops.flash
from nsa_compile.ops import window as window_mod
from nsa_compile.ops import window_attention, window_attention_backward

B, G, DK, DV = 2, 2, 16, 24
SEQ_LENS = (1, 7, 63, 100, 300)  # 300 > REFERENCE_CHUNK: chunk boundaries inside the sequence
WINDOWS = (1, 5, 32, 512)  # 512 > every S: full causal attention
GROUP_SIZES = (1, 3, 4)


def eager_window(q, k, v, window, scale):
    """NSAAttention.window_attention with heads before sequence: q [B,H,S,Dk], k/v [B,G,S,D]."""
    h = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(h, dim=1)  # [B, H, S, Dk]
    v = v.repeat_interleave(h, dim=1)  # [B, H, S, Dv]
    scores = upcast(q @ k.transpose(-1, -2)) * scale  # [B, H, S, S]
    S = q.shape[2]
    t = torch.arange(S)[:, None]
    s = torch.arange(S)[None, :]
    in_window = (s <= t) & (t - s < window)
    p = torch.softmax(scores.masked_fill(~in_window, float("-inf")), dim=-1)
    return p.to(v.dtype) @ v  # [B, H, S, Dv]


def make_inputs(S, h, dtype, seed=0, b=B, g=G, dk=DK, dv=DV):
    """q, k, v in the model's layout ([B, S, heads, D]) transposed to heads-first (non-contiguous),
    plus a fixed output gradient."""
    return attention_inputs(b, S, h, g, dk, dv, dtype, seed)


def run(fn, q, k, v, grad_o, window, scale):
    """Output and (dq, dk, dv) of fn on leaf copies of q, k, v."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, window, scale)
    grads = torch.autograd.grad(o, leaves, grad_o)
    return (o.detach(), *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_fp32_fp64(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for S, window, h in itertools.product(SEQ_LENS, WINDOWS, GROUP_SIZES):
        q, k, v, grad_o = make_inputs(S, h, dtype, seed=S * 7 + window + h)
        scale = DK**-0.5
        ours = run(window_attention, q, k, v, grad_o, window, scale)
        ref = run(eager_window, q, k, v, grad_o, window, scale)
        assert ours[0].shape == (B, G * h, S, DV) and ours[0].dtype == dtype
        assert_close_all(ours, ref, f"S={S} w={window} h={h}", **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_vs_fp64_oracle(dtype):
    worst = 0.0
    for S, window, h in itertools.product((7, 100, 300), WINDOWS, (1, 4)):
        q, k, v, grad_o = make_inputs(S, h, dtype, seed=S + window + h)
        scale = DK**-0.5
        oracle = run(eager_window, *(x.double() for x in (q, k, v, grad_o)), window, scale)
        ours = run(window_attention, q, k, v, grad_o, window, scale)
        eager = run(eager_window, q, k, v, grad_o, window, scale)
        worst = max(worst, assert_within_twice_eager(ours, eager, oracle, dtype, f"S={S} w={window} h={h}"))
    assert worst > 0  # the comparison saw rounding at all


def test_chunk_boundaries(monkeypatch):
    """Small chunks: windows span several chunks, S is not a multiple of the chunk."""
    monkeypatch.setattr(window_mod, "REFERENCE_CHUNK", 16)
    for S, window in itertools.product((17, 100), WINDOWS):
        q, k, v, grad_o = make_inputs(S, 3, torch.float64, seed=S + window)
        ours = run(window_attention, q, k, v, grad_o, window, 0.3)
        ref = run(eager_window, q, k, v, grad_o, window, 0.3)
        assert_close_all(ours, ref, f"S={S} w={window}", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("b,S,dk", [(2, 0, 8), (0, 5, 8), (1, 5, 0)])
def test_empty_sizes(b, S, dk):
    q, k, v, grad_o = make_inputs(S, 2, torch.float32, b=b, dk=dk, dv=3)
    ours = run(window_attention, q, k, v, grad_o, 3, 0.5)
    ref = run(eager_window, q, k, v, grad_o, 3, 0.5)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r)


def test_mixed_dtypes_follow_eager():
    """q, k in bf16 and v in fp32: p is cast to v's dtype, the output is fp32, grads keep dtypes."""
    q, k, _, _ = make_inputs(100, 3, torch.bfloat16, seed=1)
    _, _, v, grad_o = make_inputs(100, 3, torch.float32, seed=2)
    ours = run(window_attention, q, k, v, grad_o, 32, 0.25)
    ref = run(eager_window, q, k, v, grad_o, 32, 0.25)
    for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert a.dtype == r.dtype, name
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
        assert rel_rms(a, r) < 5e-3, name


def test_low_precision_dk_dv_accumulate_over_many_chunks(monkeypatch):
    """64 chunks each add to every key's dk/dv: the sum must not round to bf16 per chunk."""
    monkeypatch.setattr(window_mod, "REFERENCE_CHUNK", 8)
    S = 512
    q, k, v, grad_o = make_inputs(S, 1, torch.bfloat16, seed=3, b=1, g=1, dk=8, dv=8)
    oracle = run(eager_window, *(x.double() for x in (q, k, v, grad_o)), S, 0.3)
    eager = run(eager_window, q, k, v, grad_o, S, 0.3)
    ours = run(window_attention, q, k, v, grad_o, S, 0.3)
    for name, a, e, r in list(zip(("o", "dq", "dk", "dv"), ours, eager, oracle)):
        err, eager_err = rel_rms(a, r), rel_rms(e, r)
        assert err <= min(FLOORS[torch.bfloat16], 1.5 * eager_err), f"{name}: ours {err:.2e}, eager {eager_err:.2e}"


def test_memory_bounded_gqa_native_and_fully_written():
    S, h, window, chunk = 1024, 4, 32, 128
    q, k, v, grad_o = make_inputs(S, h, torch.float32, b=1)
    H = G * h
    spy = AllocationSpy()
    with spy:
        o, _ = window_mod._reference_forward(q, k, v, window, 0.25, chunk)
        dq, dk, dv = window_mod._reference_backward(grad_o, q, k, v, window, 0.25, chunk)
    # the largest intermediate is one chunk's scores [1, G, h*chunk, chunk + window - 1]
    assert spy.max_numel <= H * chunk * (chunk + window - 1) < H * S * S // 8
    # every matmul is grouped over (batch, KV group): K and V are never repeated per head
    assert {a[0] for a, _ in spy.bmm_shapes} == {G}
    ref = run(eager_window, q, k, v, grad_o, window, 0.25)
    assert_close_all((o, dq, dk, dv), ref, "spy", rtol=1e-5, atol=1e-5)


def test_opcheck_forward_and_backward_ops():
    for S, h, window, v_dtype in ((7, 3, 2, torch.float32), (20, 1, 5, torch.float32), (9, 2, 4, torch.float64)):
        q, k, v, grad_o = make_inputs(S, h, torch.float32, dk=8, dv=5)
        v, grad_o = v.to(v_dtype), grad_o.to(v_dtype)  # the output takes v's dtype, not q's
        opcheck_forward_and_backward(torch.ops.nsa.window_attention, torch.ops.nsa.window_attention_backward,
                                     q, k, v, grad_o, window, 0.5)


def model_loss(x_q, x_k, x_v, window):
    """How a rewritten model calls the op: projections in [B, S, heads, D], transposed in."""
    o = window_attention(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), window, 0.3)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def eager_loss(x_q, x_k, x_v, window):
    o = eager_window(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), window, 0.3)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def model_inputs(S, h=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, S, G * h, DK), (B, S, G, DK), (B, S, G, DV))
    return [torch.randn(*s, generator=gen, requires_grad=True) for s in shapes]


def test_compile_fullgraph_aot_eager_forward_backward():
    assert_compiles_like_eager(model_loss, eager_loss, model_inputs(150), 5)


def test_compiled_graphs_hold_the_ops_and_fakes_take_dynamic_shapes():
    cases = [(model_inputs(S, seed=S), 9) for S in (40, 77)]
    assert_graphs_hold_the_ops(model_loss, eager_loss, cases, torch.ops.nsa.window_attention.default,
                               torch.ops.nsa.window_attention_backward.default)


def bad_args(**change):
    q, k, v, _ = make_inputs(8, 2, torch.float32)
    args = dict(q=q, k=k, v=v, window=4, scale=0.5)
    args.update(change)
    return args


BAD = [
    *qkv_argument_errors(B, 2 * G, G, 8, DK, DV),  # the inputs of bad_args: S = 8, h = 2
    (dict(window=0), "window must be >= 1"),
    (dict(window=-3), "window must be >= 1"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m for _, m in BAD])
def test_argument_validation(change, match):
    assert_raises_eager_and_fake(window_attention, bad_args(**change), match)


def test_backward_op_validates_grad_shape():
    q, k, v, grad_o = make_inputs(8, 2, torch.float32)
    o, lse = torch.ops.nsa.window_attention(q, k, v, 4, 0.5)
    window_attention_backward(grad_o, q, k, v, o, lse, 4, 0.5)
    with pytest.raises(ValueError, match="grad_o must have shape"):
        window_attention_backward(grad_o[:, :, :7], q, k, v, o, lse, 4, 0.5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        window_attention_backward(grad_o[:, :3], q[:, :3], k, v, o, lse, 4, 0.5)


def test_log_sum_exp_is_the_rows_of_the_eager_scores():
    for S, window, h in ((1, 3, 2), (63, 5, 3), (300, 32, 1), (200, 512, 4)):
        q, k, v, _ = make_inputs(S, h, torch.float64, seed=S)
        _, lse = torch.ops.nsa.window_attention(q, k, v, window, 0.3)
        kr = k.repeat_interleave(h, dim=1)
        t, s = torch.arange(S)[:, None], torch.arange(S)[None, :]
        scores = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~((s <= t) & (t - s < window)), float("-inf"))
        assert lse.dtype == torch.float32 and lse.shape == (B, G * h, S)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), rtol=1e-6, atol=1e-6)


def test_backend_choice_gives_reasons():
    q, k, v, _ = make_inputs(8, 2, torch.bfloat16)
    assert window_mod.choose_backend(q, k, v) == "reference"  # the CPU
    assert window_mod.choose_backend(q, k, v, "reference") == "reference"
    with pytest.raises(ValueError, match="backend 'flash' cannot run these inputs: FA-2 runs on CUDA only"):
        window_attention(q, k, v, 4, 0.5, "flash")
    with pytest.raises(ValueError, match="unknown backend 'fast'; valid: auto, flash, reference"):
        window_attention(q, k, v, 4, 0.5, "fast")
    # what flash cannot take, named whatever the device (fake CUDA tensors: no GPU needed)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        def cuda(shape, dtype):
            return torch.empty(shape, dtype=dtype, device="cuda")

        reasons = {
            "float32": (torch.float32, 16, 16), "equal head dims": (torch.bfloat16, 16, 24),
            "multiple of 8": (torch.bfloat16, 12, 12), "at most 256": (torch.float16, 512, 512),
        }
        for phrase, (dtype, dk, dv) in reasons.items():
            qf, kf, vf = cuda((1, 4, 8, dk), dtype), cuda((1, 2, 8, dk), dtype), cuda((1, 2, 8, dv), dtype)
            assert phrase in nsa_compile.ops.flash.unsupported_reason(qf, kf, vf), phrase


def test_outputs_keep_the_layout_the_fakes_promise():
    """Inductor trusts a custom op's fake strides: the real outputs must have the same ones."""
    q, k, v, grad_o = make_inputs(50, 3, torch.float32)
    assert_fakes_promise_the_layout(torch.ops.nsa.window_attention, window_attention_backward, grad_o, q, k, v, 7, 0.5)


def test_public_surface():
    assert sorted(nsa_compile.ops.__all__) == sorted([
        "compressed_attention", "compressed_attention_backward", "gated_combine_backward", "gated_sum",
        "projection_rope", "projection_rope_backward", "select_blocks", "selected_attention",
        "selected_attention_backward", "window_attention", "window_attention_backward"])
    assert nsa_compile.ops.window_attention is window_attention
    schema = torch.ops.nsa.window_attention.default._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "window", "scale", "backend"]
    assert len(schema.returns) == 2  # o and the log-sum-exp
