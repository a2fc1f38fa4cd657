"""nsa::window_attention (+ its backward op) against the eager formula of models/nsa.py."""

import itertools

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

import nsa_compile.ops
import nsa_compile.ops.flash
from nsa_compile.ops import window as window_mod
from nsa_compile.ops import window_attention, window_attention_backward

B, G, DK, DV = 2, 2, 16, 24
SEQ_LENS = (1, 7, 63, 100, 300)  # 300 > REFERENCE_CHUNK: chunk boundaries inside the sequence
WINDOWS = (1, 5, 32, 512)  # 512 > every S: full causal attention
GROUP_SIZES = (1, 3, 4)
FLOORS = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: one intra-op thread is as fast, and on a shared 2-core box two threads spinning
    against other processes made this file ~8x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def upcast(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


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
    gen = torch.Generator().manual_seed(seed)
    H = g * h
    q = torch.randn(b, S, H, dk, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, S, g, dk, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, S, g, dv, generator=gen).to(dtype).transpose(1, 2)
    grad_o = torch.randn(b, H, S, dv, generator=gen).to(dtype)
    return q, k, v, grad_o


def run(fn, q, k, v, grad_o, window, scale):
    """Output and (dq, dk, dv) of fn on leaf copies of q, k, v."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, window, scale)
    grads = torch.autograd.grad(o, leaves, grad_o)
    return (o.detach(), *grads)


def rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_fp32_fp64(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for S, window, h in itertools.product(SEQ_LENS, WINDOWS, GROUP_SIZES):
        q, k, v, grad_o = make_inputs(S, h, dtype, seed=S * 7 + window + h)
        scale = DK**-0.5
        ours = run(window_attention, q, k, v, grad_o, window, scale)
        ref = run(eager_window, q, k, v, grad_o, window, scale)
        assert ours[0].shape == (B, G * h, S, DV) and ours[0].dtype == dtype
        for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref):
            assert a.shape == r.shape and a.dtype == r.dtype, name
            torch.testing.assert_close(a, r, **tol, msg=lambda m: f"{name} S={S} w={window} h={h}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_vs_fp64_oracle(dtype):
    worst = 0.0
    for S, window, h in itertools.product((7, 100, 300), WINDOWS, (1, 4)):
        q, k, v, grad_o = make_inputs(S, h, dtype, seed=S + window + h)
        scale = DK**-0.5
        oracle = run(eager_window, *(x.double() for x in (q, k, v, grad_o)), window, scale)
        ours = run(window_attention, q, k, v, grad_o, window, scale)
        eager = run(eager_window, q, k, v, grad_o, window, scale)
        for name, a, e, r in zip(("o", "dq", "dk", "dv"), ours, eager, oracle):
            assert a.dtype == dtype, name
            err, eager_err = rel_rms(a, r), rel_rms(e, r)
            where = f"{name} S={S} w={window} h={h}: ours {err:.2e}, eager {eager_err:.2e}"
            assert err <= FLOORS[dtype], where
            # 1e-6 absolute slack: where eager is exact (window 1: o == v, dq == 0), so must we be.
            assert err <= 2 * eager_err + 1e-6, where
            worst = max(worst, err)
    assert worst > 0  # the comparison saw rounding at all


def test_chunk_boundaries(monkeypatch):
    """Small chunks: windows span several chunks, S is not a multiple of the chunk."""
    monkeypatch.setattr(window_mod, "REFERENCE_CHUNK", 16)
    for S, window in itertools.product((17, 100), WINDOWS):
        q, k, v, grad_o = make_inputs(S, 3, torch.float64, seed=S + window)
        ours = run(window_attention, q, k, v, grad_o, window, 0.3)
        ref = run(eager_window, q, k, v, grad_o, window, 0.3)
        for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} S={S} w={window}: {m}")


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


class Spy(TorchDispatchMode):
    """Fills every fresh allocation with NaN (unwritten elements then fail), records the largest
    computed intermediate (views and in-place writes excluded) and the batch size of every bmm."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.bmm_batches = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("empty", "empty_like", "new_empty", "empty_strided"):
            out.fill_(float("nan"))
        elif isinstance(out, torch.Tensor) and func._schema.returns[0].alias_info is None:
            self.max_numel = max(self.max_numel, out.numel())
        if name == "bmm":
            self.bmm_batches.add(args[0].shape[0])
        return out


def test_memory_bounded_gqa_native_and_fully_written():
    S, h, window, chunk = 1024, 4, 32, 128
    q, k, v, grad_o = make_inputs(S, h, torch.float32, b=1)
    H = G * h
    spy = Spy()
    with spy:
        o, _ = window_mod._reference_forward(q, k, v, window, 0.25, chunk)
        dq, dk, dv = window_mod._reference_backward(grad_o, q, k, v, window, 0.25, chunk)
    # the largest intermediate is one chunk's scores [1, G, h*chunk, chunk + window - 1]
    assert spy.max_numel <= H * chunk * (chunk + window - 1) < H * S * S // 8
    # every matmul is grouped over (batch, KV group): K and V are never repeated per head
    assert spy.bmm_batches == {G}
    ref = run(eager_window, q, k, v, grad_o, window, 0.25)
    for name, a, r in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_opcheck_forward_and_backward_ops():
    for S, h, window, v_dtype in ((7, 3, 2, torch.float32), (20, 1, 5, torch.float32), (9, 2, 4, torch.float64)):
        q, k, v, grad_o = make_inputs(S, h, torch.float32, dk=8, dv=5)
        v, grad_o = v.to(v_dtype), grad_o.to(v_dtype)  # the output takes v's dtype, not q's
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        torch.library.opcheck(torch.ops.nsa.window_attention.default, (q, k, v, window, 0.5, "reference"))
        o, lse = torch.ops.nsa.window_attention(q, k, v, window, 0.5)
        torch.library.opcheck(
            torch.ops.nsa.window_attention_backward.default,
            (grad_o, *(x.detach() for x in (q, k, v, o, lse)), window, 0.5, "reference"),
        )


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


def loss_and_grads(fn, inputs, window):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    loss = fn(*inputs, window)
    return (loss.detach(), *torch.autograd.grad(loss, inputs))


def test_compile_fullgraph_aot_eager_forward_backward():
    torch._dynamo.reset()
    inputs = model_inputs(150)
    compiled = torch.compile(model_loss, fullgraph=True, backend="aot_eager")
    for got, want in zip(loss_and_grads(compiled, inputs, 5), loss_and_grads(eager_loss, inputs, 5)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_graphs_hold_the_ops_and_fakes_take_dynamic_shapes():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    compiled = torch.compile(model_loss, fullgraph=True, backend=backend, dynamic=True)
    for S in (40, 77):
        inputs = model_inputs(S, seed=S)
        for got, want in zip(loss_and_grads(compiled, inputs, 9), loss_and_grads(eager_loss, inputs, 9)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 2  # one forward and one backward graph serve both lengths
    fw, bw = (set(n.target for n in gm.graph.nodes if n.op == "call_function") for gm in graphs)
    assert torch.ops.nsa.window_attention.default in fw
    assert torch.ops.nsa.window_attention_backward.default in bw
    assert torch.ops.nsa.window_attention.default not in bw  # the backward does not recompute via the forward op


def bad_args(**change):
    q, k, v, _ = make_inputs(8, 2, torch.float32)
    args = dict(q=q, k=k, v=v, window=4, scale=0.5)
    args.update(change)
    return args


BAD = [
    (dict(q=torch.randn(2, 4, 8)), "q must be 4-D"),
    (dict(k=torch.randn(2, 2, 8, 16, 1)), "k must be 4-D"),
    (dict(v=torch.randn(2, 2, 8)), "v must be 4-D"),
    (dict(q=torch.ones(2, 4, 8, 16, dtype=torch.int64)), "floating-point"),
    (dict(k=torch.randn(2, 2, 8, 16, dtype=torch.float64)), "share a dtype"),
    (dict(q=torch.randn(3, 4, 8, 16)), "batch sizes differ"),
    (dict(v=torch.randn(2, 2, 9, 24)), "sequence lengths differ"),
    (dict(k=torch.randn(2, 2, 8, 12)), "head dims differ"),
    (dict(v=torch.randn(2, 4, 8, 24)), "same number of KV heads"),
    (dict(q=torch.randn(2, 5, 8, 16)), "H=5 must be a multiple of KV heads G=2"),
    (dict(k=torch.randn(2, 0, 8, 16), v=torch.randn(2, 0, 8, 24)), "at least one KV head"),
    (dict(window=0), "window must be >= 1"),
    (dict(window=-3), "window must be >= 1"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m for _, m in BAD])
def test_argument_validation(change, match):
    args = bad_args(**change)
    with pytest.raises(ValueError, match=match):
        window_attention(**args)
    # the fake raises the same error at trace time
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        fake = {n: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
        window_attention(**fake)


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
    o, lse = torch.ops.nsa.window_attention(q, k, v, 7, 0.5)
    grads = window_attention_backward(grad_o, q, k, v, o, lse, 7, 0.5)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv, fg = (mode.from_tensor(x) for x in (q, k, v, grad_o))
        fo, flse = torch.ops.nsa.window_attention(fq, fk, fv, 7, 0.5)
        fgrads = window_attention_backward(fg, fq, fk, fv, fo, flse, 7, 0.5)
    for real, fake in zip((o, lse, *grads), (fo, flse, *fgrads)):
        assert real.shape == fake.shape and real.stride() == fake.stride() and real.dtype == fake.dtype


def test_public_surface():
    assert sorted(nsa_compile.ops.__all__) == sorted([
        "compressed_attention", "compressed_attention_backward", "gated_combine_backward", "gated_sum",
        "projection_rope", "projection_rope_backward", "select_blocks", "selected_attention",
        "selected_attention_backward", "window_attention", "window_attention_backward"])
    assert nsa_compile.ops.window_attention is window_attention
    schema = torch.ops.nsa.window_attention.default._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "window", "scale", "backend"]
    assert len(schema.returns) == 2  # o and the log-sum-exp
