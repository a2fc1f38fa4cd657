"""nsa::window_attention (+ its backward op) against the eager formula of models/nsa.py, unpacked and
with packed documents (pos); flash's document sequences (the builder on the CPU, the kernel on the GPU)."""

import functools
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
from nsa_compile.models import positions_from_cu_seqlens
from nsa_compile.ops import window_attention, window_attention_backward
from nsa_compile.ops.flash import document_seqlens

B, G, DK, DV = 2, 2, 16, 24
SEQ_LENS = (1, 7, 63, 100, 300)  # 300 > REFERENCE_CHUNK: chunk boundaries inside the sequence
WINDOWS = (1, 5, 32, 512)  # 512 > every S: full causal attention
GROUP_SIZES = (1, 3, 4)


def eager_window(q, k, v, window, scale, pos=None):
    """NSAAttention.window_attention with heads before sequence: q [B,H,S,Dk], k/v [B,G,S,D]
    (pos [B, S]: packed documents, the mask [B, 1, S, S])."""
    h = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(h, dim=1)  # [B, H, S, Dk]
    v = v.repeat_interleave(h, dim=1)  # [B, H, S, Dv]
    scores = upcast(q @ k.transpose(-1, -2)) * scale  # [B, H, S, S]
    S = q.shape[2]
    t = torch.arange(S)[:, None]
    s = torch.arange(S)[None, :]
    in_window = (s <= t) & (t - s < window)
    if pos is not None:
        in_window = (in_window & (s >= t - pos[:, :, None]))[:, None]  # [B, 1, S, S]
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
    with pytest.raises(ValueError, match="unknown backend 'fast'; valid: auto, triton, flash, reference"):
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
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "window", "scale", "backend", "pos", "q_offset"]
    assert len(schema.returns) == 2  # o and the log-sum-exp
    backward = torch.ops.nsa.window_attention_backward.default._schema
    assert [a.name for a in backward.arguments][-3:] == ["backend", "pos", "q_offset"]


# --- packed documents (pos) ---------------------------------------------------------------------


def positions(*rows):
    """pos [len(rows), S]: each row packed with documents of the given lengths (each summing to S)."""
    return torch.stack([positions_from_cu_seqlens(torch.tensor([0, *itertools.accumulate(r)]), sum(r)) for r in rows])


# S = 70: documents of 1 and 2 tokens, shorter and longer than the windows, a row of one document;
# with REFERENCE_CHUNK = 16 documents start inside and at the edges of chunks
PACKED = [positions([1, 2, 13, 6, 33, 15], [70]), positions([35, 35], [7, 1, 1, 61])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_matches_eager(monkeypatch, dtype):
    monkeypatch.setattr(window_mod, "REFERENCE_CHUNK", 16)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for (i, pos), window, h in itertools.product(enumerate(PACKED), WINDOWS, GROUP_SIZES):
        q, k, v, grad_o = make_inputs(70, h, dtype, seed=100 * i + window + h)
        ours = run(functools.partial(window_attention, pos=pos), q, k, v, grad_o, window, 0.3)
        ref = run(functools.partial(eager_window, pos=pos), q, k, v, grad_o, window, 0.3)
        assert_close_all(ours, ref, f"packing {i} w={window} h={h}", **tol)


def test_packed_row_equals_its_documents_alone():
    """The oracle that does not share the formula: each document run alone, unpacked."""
    lengths = [1, 2, 13, 6, 33, 15]
    pos = positions(lengths, [70])
    q, k, v, grad_o = make_inputs(70, 3, torch.float64, seed=5)
    packed = run(functools.partial(window_attention, pos=pos), q, k, v, grad_o, 8, 0.3)
    for a, b in itertools.pairwise([0, *itertools.accumulate(lengths)]):
        rows = [x[:1, :, a:b] for x in (q, k, v, grad_o)]
        alone = run(window_attention, *rows, 8, 0.3)
        assert_close_all([x[:1, :, a:b] for x in packed], alone, f"document [{a}, {b})", rtol=1e-12, atol=1e-12)
    # and row 1, one document, is the unpacked op
    alone = run(window_attention, *(x[1:] for x in (q, k, v, grad_o)), 8, 0.3)
    assert_close_all([x[1:] for x in packed], alone, "row 1", rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_low_precision_error_vs_fp64_oracle(dtype):
    worst = 0.0
    for (i, pos), window, h in itertools.product(enumerate(PACKED), (5, 32), (1, 4)):
        q, k, v, grad_o = make_inputs(70, h, dtype, seed=10 * i + window + h)
        oracle = run(functools.partial(eager_window, pos=pos), *(x.double() for x in (q, k, v, grad_o)), window, 0.3)
        ours = run(functools.partial(window_attention, pos=pos), q, k, v, grad_o, window, 0.3)
        eager = run(functools.partial(eager_window, pos=pos), q, k, v, grad_o, window, 0.3)
        worst = max(worst, assert_within_twice_eager(ours, eager, oracle, dtype, f"packing {i} w={window} h={h}"))
    assert worst > 0


def test_packed_log_sum_exp_is_the_rows_of_the_eager_scores():
    pos = PACKED[1]
    q, k, v, _ = make_inputs(70, 2, torch.float64, seed=7)
    _, lse = torch.ops.nsa.window_attention(q, k, v, 5, 0.3, "auto", pos)
    t, s = torch.arange(70)[:, None], torch.arange(70)[None, :]
    keep = ((s <= t) & (t - s < 5) & (s >= t - pos[:, :, None]))[:, None]
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), rtol=1e-6, atol=1e-6)


def test_one_document_per_row_is_the_unpacked_op():
    q, k, v, grad_o = make_inputs(70, 3, torch.float32, seed=8)
    pos = torch.arange(70).expand(B, 70)
    packed = run(functools.partial(window_attention, pos=pos), q, k, v, grad_o, 9, 0.3)
    plain = run(window_attention, q, k, v, grad_o, 9, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(packed, plain))


def test_packed_memory_bounded():
    """The document mask is made per chunk too: nothing [S, S], nothing beyond one chunk."""
    S, h, window, chunk = 512, 2, 32, 64
    q, k, v, grad_o = make_inputs(S, h, torch.float32)
    pos = positions([100, 1, 300, 111], [512])
    spy = AllocationSpy()
    with spy:
        o, _ = window_mod._reference_forward(q, k, v, window, 0.25, chunk, pos=pos)
        dq, dk, dv = window_mod._reference_backward(grad_o, q, k, v, window, 0.25, chunk, pos=pos)
    assert spy.max_numel <= G * h * B * chunk * (chunk + window - 1) < B * S * S // 4
    ref = run(functools.partial(eager_window, pos=pos), q, k, v, grad_o, window, 0.25)
    assert_close_all((o, dq, dk, dv), ref, "spy", rtol=1e-5, atol=1e-5)


def test_packed_opcheck_forward_and_backward_ops():
    for S, h, window, pos in ((7, 3, 2, positions([3, 4], [1, 1, 5])), (20, 1, 5, positions([20], [9, 11]))):
        q, k, v, grad_o = make_inputs(S, h, torch.float32, dk=8, dv=5)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        torch.library.opcheck(torch.ops.nsa.window_attention.default, (q, k, v, window, 0.5, "reference", pos))
        o, lse = torch.ops.nsa.window_attention(q, k, v, window, 0.5, "reference", pos)
        torch.library.opcheck(torch.ops.nsa.window_attention_backward.default,
                              (grad_o, *(x.detach() for x in (q, k, v, o, lse)), window, 0.5, "reference", pos))


def test_packed_outputs_keep_the_layout_the_fakes_promise():
    q, k, v, grad_o = make_inputs(70, 3, torch.float32)
    assert_fakes_promise_the_layout(torch.ops.nsa.window_attention, window_attention_backward, grad_o, q, k, v,
                                    7, 0.5, "auto", PACKED[0])


def packed_model_loss(x_q, x_k, x_v, window, pos):
    o = window_attention(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), window, 0.3, pos=pos)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def packed_eager_loss(x_q, x_k, x_v, window, pos):
    o = eager_window(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), window, 0.3, pos)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def test_packed_compiles_and_graphs_hold_the_ops_with_dynamic_shapes():
    assert_compiles_like_eager(packed_model_loss, packed_eager_loss, model_inputs(70), 5, PACKED[0])
    cases = [(model_inputs(40, seed=1), 9, positions([1, 39], [20, 20])),
             (model_inputs(77, seed=2), 9, positions([30, 2, 45], [77]))]
    assert_graphs_hold_the_ops(packed_model_loss, packed_eager_loss, cases, torch.ops.nsa.window_attention.default,
                               torch.ops.nsa.window_attention_backward.default)


BAD_POS = [
    (dict(pos=torch.zeros(B, 8, dtype=torch.int32)), "pos must be an int64 tensor of shape"),
    (dict(pos=torch.zeros(B, 9, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\] = \[2, 8\]"),
    (dict(pos=torch.zeros(8, dtype=torch.int64)), "pos must be an int64 tensor of shape"),
    (dict(pos=torch.zeros(B, 8, dtype=torch.int64, device="meta")), "q, k, v, pos must be on one device"),
]


@pytest.mark.parametrize("change,match", BAD_POS, ids=["int32", "longer", "1-D", "device"])
def test_pos_validation(change, match):
    assert_raises_eager_and_fake(window_attention, bad_args(**change), match)
    q, k, v, grad_o = make_inputs(8, 2, torch.float32)
    o, lse = torch.ops.nsa.window_attention(q, k, v, 4, 0.5)
    with pytest.raises(ValueError, match=match):
        window_attention_backward(grad_o, q, k, v, o, lse, 4, 0.5, "auto", change["pos"])


def test_auto_takes_triton_on_cuda_in_half_precision_with_or_without_pos(monkeypatch):
    """auto on (fake) CUDA tensors: triton in fp16/bf16, with packed documents too (before flash,
    which needs a host sync for them), reference in fp32; every choice says why where it passes on."""
    half = (torch.float16, torch.bfloat16)  # flash as on a GPU (no GPU needed)
    monkeypatch.setattr(nsa_compile.ops.flash, "unsupported_reason", lambda q, k, v: None if q.dtype in half else "fp32")
    with torch._subclasses.fake_tensor.FakeTensorMode():
        def cuda(shape, dtype):
            return torch.empty(shape, dtype=dtype, device="cuda")

        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = cuda((1, 4, 8, 16), dtype), cuda((1, 2, 8, 16), dtype), cuda((1, 2, 8, 16), dtype)
            assert window_mod.choose_backend(q, k, v) == "triton"
            assert window_mod.why_not_triton(q, k, v) is None
            pos = cuda((1, 8), torch.int64)
            assert window_mod.choose_backend(q, k, v, "auto", pos) == "triton"
            assert window_mod.why_not_triton(q, k, v, pos) is None
        q, k, v = (x.float() for x in (q, k, v))
        assert window_mod.choose_backend(q, k, v) == "reference"
        assert "fp16/bf16 only (float32: reference)" in window_mod.why_not_triton(q, k, v)
    q, k, v, _ = make_inputs(8, 2, torch.bfloat16)  # the CPU: auto never takes Triton's interpreter
    assert "on CUDA (tensors on cpu)" in window_mod.why_not_triton(q, k, v)


def test_packed_backend_choice():
    """pos takes neither triton nor flash off the table: on the CPU the reason stays the device."""
    q, k, v, _ = make_inputs(8, 2, torch.bfloat16)
    pos = positions([3, 5], [8])
    assert window_mod.choose_backend(q, k, v, "auto", pos) == "reference"
    with pytest.raises(ValueError, match="backend 'flash' cannot run these inputs: FA-2 runs on CUDA only"):
        window_attention(q, k, v, 4, 0.5, "flash", pos=pos)
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: device cpu"):
        window_attention(q, k, v, 4, 0.5, "triton", pos=pos)


# --- flash's sequences from pos (the builder runs on the CPU too) --------------------------------


def test_document_seqlens_cuts_at_row_starts_and_document_starts():
    cu, longest = document_seqlens(positions([1, 2, 13, 6, 33, 15], [70]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 1, 3, 16, 22, 55, 70, 140] and longest == 70
    cu, longest = document_seqlens(positions([35, 35], [7, 1, 1, 61]))
    assert cu.tolist() == [0, 35, 70, 77, 78, 79, 140] and longest == 61
    # a row that begins inside a document (a stream cut into rows): the row start cuts it
    cu, longest = document_seqlens(torch.tensor([[3, 4, 5, 0, 1], [0, 1, 0, 1, 2]]))
    assert cu.tolist() == [0, 3, 5, 7, 10] and longest == 3
    cu, longest = document_seqlens(torch.tensor([[7], [0]]))
    assert cu.tolist() == [0, 1, 2] and longest == 1
    cu, longest = document_seqlens(torch.zeros(0, 5, dtype=torch.int64))
    assert cu.tolist() == [0] and longest == 0


def test_document_seqlens_sequences_are_the_eager_document_term():
    """For random packings, 'key s and query t in one sequence, s <= t' is exactly the eager
    term s >= t - pos[t] (with s <= t, within the row)."""
    gen = torch.Generator().manual_seed(0)
    for density in (0.02, 0.2, 0.7):
        starts = torch.rand(3, 50, generator=gen) < density
        starts[:, 0] = True
        t = torch.arange(50)
        pos = t - torch.where(starts, t, 0).cummax(dim=1).values
        cu, longest = document_seqlens(pos)
        flat = torch.arange(150)
        seq = torch.searchsorted(cu.long(), flat, right=True) - 1  # sequence of each token
        same = (seq[:, None] == seq[None, :]) & (flat[None, :] <= flat[:, None])  # [150, 150]
        for b in range(3):
            rows = slice(50 * b, 50 * (b + 1))
            eager = (t[None, :] <= t[:, None]) & (t[None, :] >= (t - pos[b])[:, None])
            assert torch.equal(same[rows, rows], eager), density
        assert longest == int(cu.diff().max())
        assert not same[:50, 50:].any() and not same[50:100, 100:].any()  # nothing across rows


@pytest.mark.parametrize("bad", [[[0, 2, 3]], [[0, 1, 1]], [[-1, 0, 1]], [[0, 1, 2], [0, 1, -5]]])
def test_document_seqlens_refuses_what_is_not_positions(bad):
    with pytest.raises(ValueError, match="pos must count up by one within each document"):
        document_seqlens(torch.tensor(bad))


# --- on the GPU: flash with pos against the reference backend ------------------------------------


def _gpu_packings(S: int, B: int) -> torch.Tensor:
    """Odd packings for the GPU tests: documents of 1 and 2 tokens, lengths around FA-2's block
    sizes (127, 129), one document per row, a row cut inside a document, many tiny documents."""
    def fill(lengths):  # the first documents that fit, then one to the row's end
        kept = [n for n, end in zip(lengths, itertools.accumulate(lengths)) if end < S]
        return positions([*kept, S - sum(kept)])[0]

    tiny = torch.randint(1, 20, (S,), generator=torch.Generator().manual_seed(S)).tolist()
    cut = torch.cat([torch.arange(37, 37 + S // 3), torch.arange(S - S // 3)])  # begins inside a document
    return torch.stack([fill([1, 2, 127, 129, 256, 5]), fill([S]), fill(tiny), cut])[:B].cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h", [1, 4, 6])
def test_flash_with_pos_matches_the_reference_on_cuda(dtype, h):
    """FA-2 varlen with one sequence per document against the float64 reference backend: o and
    every gradient within the parity bar (twice the reference backend's own error in dtype, or
    the dtype's floor), lse close; the layouts the fakes promise."""
    if nsa_compile.ops.flash.unsupported_reason(*(torch.empty(1, 1, 1, 64, device="cuda", dtype=dtype),) * 3):
        pytest.skip("FA-2 cannot run on this GPU")
    S, Bt, g, D = 1000, 4, 2, 64
    pos = _gpu_packings(S, Bt)
    # (not w = 1: there dq and dk are exactly 0 in the oracle, so their relative error means nothing)
    for window in (2, 33, 512, S):
        q, k, v, grad_o = (x.cuda() for x in attention_inputs(Bt, S, h, g, D, D, dtype, seed=window + h))
        assert window_mod.choose_backend(q, k, v, "auto", pos) == "triton"  # flash only where named
        flash_run = _backend_run("flash", q, k, v, grad_o, window, pos)
        oracle = _backend_run("reference", *(x.double() for x in (q, k, v, grad_o)), window, pos)
        in_dtype = _backend_run("reference", q, k, v, grad_o, window, pos)
        what = f"{dtype} h={h} w={window}"
        for name, i in (("o", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
            err, base = rel_rms(flash_run[i], oracle[i]), rel_rms(in_dtype[i], oracle[i])
            assert flash_run[i].dtype == dtype and err <= max(2 * base, FLOORS[dtype]), (what, name, err, base)
        assert (flash_run[1].double() - oracle[1]).abs().max().item() < 0.05, what  # lse, inputs in dtype
    assert_fakes_promise_the_layout(torch.ops.nsa.window_attention, window_attention_backward, grad_o, q, k, v,
                                    32, 0.125, "flash", pos)


def _backend_run(backend, q, k, v, grad_o, window, pos):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = torch.ops.nsa.window_attention(*leaves, window, 0.125, backend, pos)
    return (o.detach(), lse, *torch.autograd.grad(o, leaves, grad_o))


def _host_syncs(fn) -> int:
    """How many synchronizing CUDA operations fn() runs (torch.cuda's sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
def test_flash_with_pos_syncs_once_per_call_and_refuses_bad_positions():
    if nsa_compile.ops.flash.unsupported_reason(*(torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16),) * 3):
        pytest.skip("FA-2 cannot run on this GPU")
    pos = _gpu_packings(1000, 4)
    q, k, v, grad_o = (x.cuda() for x in attention_inputs(4, 1000, 4, 2, 64, 64, torch.bfloat16, seed=0))
    o, lse = torch.ops.nsa.window_attention(q, k, v, 32, 0.125, "flash", pos)
    # one more than without pos, forward and backward alike: the document count and longest
    for packed, plain in (
        (lambda: torch.ops.nsa.window_attention(q, k, v, 32, 0.125, "flash", pos),
         lambda: torch.ops.nsa.window_attention(q, k, v, 32, 0.125, "flash")),
        (lambda: window_attention_backward(grad_o, q, k, v, o, lse, 32, 0.125, "flash", pos),
         lambda: window_attention_backward(grad_o, q, k, v, o, lse, 32, 0.125, "flash")),
    ):
        assert _host_syncs(packed) == _host_syncs(plain) + 1
    bad = pos.clone()
    bad[0, 10] += 1
    with pytest.raises(ValueError, match="pos must count up by one within each document"):
        torch.ops.nsa.window_attention(q, k, v, 32, 0.125, "flash", bad)
