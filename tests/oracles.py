"""What the op tests share: inputs in the model's layout, the bars against the float64 oracle and
against the reference backend, and the checks of what every attention custom op promises (its
fakes' layouts, opcheck, torch.compile fullgraph with the ops in the graphs, errors raised by the
op and its fake alike).

The test files keep their own oracles (the eager formulas) and cases; these helpers only compare.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# Relative RMS error against the float64 oracle that an op's result may reach, per dtype.
FLOORS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
NAMES = ("o", "dq", "dk", "dv")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: one intra-op thread is as fast, and on a shared 2-core box two threads spinning
    against other processes made the op tests ~8x slower. (A test module imports it: autouse.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def triton_interpreter(on: bool):
    """While the block runs: where `on` (no CUDA), TRITON_INTERPRET=1, so the kernels launched
    run on Triton's CPU interpreter (each kernel module's @jit functions are built for the mode
    Triton is in at launch: triton_support.jit); after it, the variable as it was, so the rest of
    the session sees the CPU as it is."""
    before = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if on:
            if before is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = before


def run_without_triton(code: str) -> str:
    """The standard output of `code`, run by a fresh interpreter in which `import triton` fails."""
    code = "import sys; sys.modules['triton'] = None\n" + code
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- inputs ---------------------------------------------------------------------------------------


def upcast(x):
    """The eager model's upcast: fp16/bf16 -> fp32, fp32 and fp64 stay."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def attention_inputs(b, S, h, g, dk, dv, dtype, seed, kv_len=None):
    """q [b, g * h, S, dk], k [b, g, T, dk], v [b, g, T, dv] (T = kv_len, or S) as transposed views
    of [b, S or T, heads, D] memory (the model's layout, non-contiguous), and a contiguous output
    gradient [b, g * h, S, dv]: drawn in that order from one generator seeded `seed`."""
    gen = torch.Generator().manual_seed(seed)
    T = S if kv_len is None else kv_len
    q = torch.randn(b, S, g * h, dk, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, T, g, dk, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, T, g, dv, generator=gen).to(dtype).transpose(1, 2)
    grad_o = torch.randn(b, g * h, S, dv, generator=gen).to(dtype)
    return q, k, v, grad_o


def random_block_idx(b, g, S, n, block_size, seed, device="cpu"):
    """A valid selection [b, g, S, n] int64: the current block forced, the rest distinct random
    earlier blocks, ascending, -1 padded where fewer than n candidates exist."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-S // block_size), n)
    j = torch.arange(width)
    cur = (torch.arange(S) // block_size)[:, None]  # [S, 1]
    key = torch.rand(b, g, S, width, generator=gen)
    key = torch.where(j == cur, 2.0, key).masked_fill(j > cur, float("-inf"))
    val, idx = key.topk(n, dim=-1)
    idx = torch.where(val > float("-inf"), idx, width).sort(dim=-1).values  # padding sorts last
    return torch.where(idx == width, -1, idx).to(device)


# --- comparisons ----------------------------------------------------------------------------------


def rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close_all(ours, ref, what, **tol):
    """o, dq, dk, dv: each of `ours` has its `ref`'s shape and dtype and is close to it within `tol`."""
    for name, a, r in zip(NAMES, ours, ref):
        assert a.shape == r.shape and a.dtype == r.dtype, f"{what} {name}"
        torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name: f"{what} {name}: {m}")


def assert_within_twice_eager(ours, eager, oracle, dtype, what) -> float:
    """o, dq, dk, dv of the op (`ours`, in `dtype`) against the float64 `oracle`: within the
    floor of `dtype` and within twice the eager formula's own error (relative RMS). Returns the
    largest error seen."""
    worst = 0.0
    for name, a, e, r in zip(NAMES, ours, eager, oracle):
        assert a.dtype == dtype, f"{name} {what}"
        err, eager_err = rel_rms(a, r), rel_rms(e, r)
        where = f"{name} {what}: ours {err:.2e}, eager {eager_err:.2e}"
        assert err <= FLOORS[dtype], where
        # 1e-6 absolute slack: where eager is exact (a window of 1: o == v, dq == 0), so must we be
        assert err <= 2 * eager_err + 1e-6, where
        worst = max(worst, err)
    return worst


def assert_kernel_matches_reference(ours, ref, dtype, what):
    """A kernel's o, dq, dk, dv (in `dtype`) against the reference backend's in float32: shapes,
    dtypes, no NaN; fp32 within 1e-4, fp16/bf16 within 1e-2 relative RMS."""
    for name, a, r in zip(NAMES, ours, ref):
        assert a.dtype == dtype and a.shape == r.shape, f"{what} {name}"
        assert not a.isnan().any(), f"{what} {name}: NaN"
        if dtype == torch.float32:
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{what} {name}: {m}")
        else:
            assert rel_rms(a, r) <= 1e-2, f"{what} {name}: rel rms {rel_rms(a, r):.2e}"


def assert_lse_close(lse, want, tol, what):
    """lse float32 with -inf exactly on the rows where `want` has it, within `tol` elsewhere."""
    assert lse.dtype == torch.float32, f"{what}: lse dtype {lse.dtype}"
    assert torch.equal(lse.isneginf(), want.isneginf()), f"{what}: lse -inf rows differ"
    fin = want.isfinite()
    torch.testing.assert_close(lse[fin].double(), want[fin].double(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what} lse: {m}")


class AllocationSpy(TorchDispatchMode):
    """Fills every fresh allocation with NaN (unwritten elements then fail), records the largest
    computed intermediate (views and in-place writes excluded), the operand shapes of every bmm
    and every op name."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.names, self.bmm_shapes = 0, set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.names.add(name)
        if name in ("empty", "empty_like", "new_empty", "empty_strided"):
            out.fill_(float("nan"))
        elif isinstance(out, torch.Tensor) and func._schema.returns[0].alias_info is None:
            self.max_numel = max(self.max_numel, out.numel())
        if name == "bmm":
            self.bmm_shapes.add((tuple(args[0].shape), tuple(args[1].shape)))
        return out


# --- what every attention op promises -------------------------------------------------------------


def _fake(mode, args):
    return [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args]


def assert_raises_eager_and_fake(fn, args: dict, match: str):
    """fn(**args) raises ValueError matching `match`, and so does its fake at trace time."""
    with pytest.raises(ValueError, match=match):
        fn(**args)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=match):
        fn(**dict(zip(args, _fake(mode, args.values()))))


def gqa_argument_errors(B, H, G, S, T, Dk, Dv) -> list[tuple[dict, str]]:
    """(change, message) pairs for `assert_raises_eager_and_fake`: each change makes one of q
    [B, H, S, Dk], k [B, G, T, Dk], v [B, G, T, Dv] wrong in one way that the argument checks
    every q/k/v op shares (common.check_gqa) refuse with `message`."""
    return [
        (dict(q=torch.randn(B, H, S)), "q must be 4-D"),
        (dict(k=torch.randn(B, G, T, Dk, 1)), "k must be 4-D"),
        (dict(v=torch.randn(B, G, T)), "v must be 4-D"),
        (dict(q=torch.ones(B, H, S, Dk, dtype=torch.int64)), "floating-point"),
        (dict(k=torch.randn(B, G, T, Dk, dtype=torch.float64)), "share a dtype"),
        (dict(q=torch.randn(B + 1, H, S, Dk)), "batch sizes differ"),
        (dict(k=torch.randn(B, G, T, Dk - 4)), "head dims differ"),
        (dict(v=torch.randn(B, 2 * G, T, Dv)), "same number of KV heads"),
        (dict(q=torch.randn(B, H + 1, S, Dk)), f"H={H + 1} must be a multiple of KV heads G={G}"),
        (dict(k=torch.randn(B, 0, T, Dk), v=torch.randn(B, 0, T, Dv)), "at least one KV head"),
    ]


def qkv_argument_errors(B, H, G, S, Dk, Dv) -> list[tuple[dict, str]]:
    """`gqa_argument_errors` for ops over the sequence itself (common.check_qkv): k and v hold
    q's S tokens, and v with S + 1 is refused."""
    return [*gqa_argument_errors(B, H, G, S, S, Dk, Dv),
            (dict(v=torch.randn(B, G, S + 1, Dv)), "sequence lengths differ")]


def opcheck_forward_and_backward(forward, backward, q, k, v, grad_o, *args):
    """torch.library.opcheck of an attention op `forward(q, k, v, *args, backend) -> (o, lse)` and
    of its `backward(grad_o, q, k, v, o, lse, *args, backend)`, backend 'reference'."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    torch.library.opcheck(forward.default, (q, k, v, *args, "reference"))
    o, lse = forward(q, k, v, *args)
    torch.library.opcheck(backward.default, (grad_o, *(x.detach() for x in (q, k, v, o, lse)), *args, "reference"))


def _forward_and_backward(forward, backward, grad_o, q, k, v, *args):
    o, lse = forward(q, k, v, *args)
    return (o, lse, *backward(grad_o, q, k, v, o, lse, *args))


def assert_fakes_promise_the_layout(forward, backward, grad_o, q, k, v, *args):
    """The real outputs of `forward` (o, lse) and `backward` (dq, dk, dv) have the shapes, strides
    and dtypes of the fakes' (Inductor trusts a custom op's fake strides). Returns the real ones."""
    real = _forward_and_backward(forward, backward, grad_o, q, k, v, *args)
    with FakeTensorMode() as mode:
        fake = _forward_and_backward(forward, backward, *_fake(mode, (grad_o, q, k, v, *args)))
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.stride() == f.stride() and r.dtype == f.dtype
    return real


def _through_autograd(op, backend, q, k, v, grad_o, *args):
    """op(q, k, v, *args, backend) -> (o, lse) on leaf copies of q, k, v and its gradients:
    (o, lse, dq, dk, dv). Asserts the plumbing: o and lse have the strides of the op's fake, each
    gradient the shape, dtype and strides of its input."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = op(*leaves, *args, backend)
    grads = torch.autograd.grad(o, leaves, grad_o)
    with FakeTensorMode() as mode:
        fake_o, fake_lse = op(*_fake(mode, (*leaves, *args)), backend)
    assert o.stride() == fake_o.stride() and lse.stride() == fake_lse.stride(), backend
    for grad, leaf in zip(grads, leaves):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype and grad.stride() == leaf.stride(), backend
    return (o, lse, *grads)


def assert_backend_matches_reference(op, backend, q, k, v, grad_o, *args, rtol, atol):
    """The attention op `op(q, k, v, *args, backend) -> (o, lse)` through autograd, with `backend`
    and with 'reference' on the same inputs: the plumbing of each (the strides its fake promises,
    gradients like their inputs), and o, lse, dq, dk, dv of the two in the same dtypes and close."""
    ours = _through_autograd(op, backend, q, k, v, grad_o, *args)
    ref = _through_autograd(op, "reference", q, k, v, grad_o, *args)
    for name, a, r in zip(("o", "lse", *NAMES[1:]), ours, ref):
        assert a.dtype == r.dtype, name
        torch.testing.assert_close(a.float(), r.float(), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def loss_and_grads(fn, inputs, *args):
    """fn(*inputs, *args) -> a scalar loss, on leaf copies of `inputs`: the loss and its gradients."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    loss = fn(*inputs, *args)
    return (loss.detach(), *torch.autograd.grad(loss, inputs))


def assert_compiles_like_eager(model_loss, eager_loss, inputs, *args):
    """torch.compile(model_loss, fullgraph=True, backend='aot_eager'): the loss and gradients of
    eager_loss, to 1e-5."""
    torch._dynamo.reset()
    compiled = torch.compile(model_loss, fullgraph=True, backend="aot_eager")
    for got, want in zip(loss_and_grads(compiled, inputs, *args), loss_and_grads(eager_loss, inputs, *args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def assert_graphs_hold_the_ops(model_loss, eager_loss, cases, forward, backward):
    """torch.compile(model_loss, fullgraph=True, dynamic=True) through AOTAutograd on each case
    (inputs, *args): the loss and gradients of eager_loss (1e-5); one forward and one backward
    graph serve every case (the fakes take dynamic shapes); `forward` (an op overload) is in the
    forward graph, `backward` in the backward one, and the backward does not recompute through
    the forward op."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    compiled = torch.compile(model_loss, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture),
                             dynamic=True)
    for inputs, *args in cases:
        for got, want in zip(loss_and_grads(compiled, inputs, *args), loss_and_grads(eager_loss, inputs, *args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 2
    fw, bw = (set(n.target for n in gm.graph.nodes if n.op == "call_function") for gm in graphs)
    assert forward in fw
    assert backward in bw
    assert forward not in bw


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op computes (views of their inputs excluded)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.returns and func._schema.returns[0].alias_info is None:
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor):
                    self.max_numel = max(self.max_numel, x.numel())
        return out
