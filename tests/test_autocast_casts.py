"""canonicalize's autocast rule (passes/autocast_casts.py): autocast's casts written into the graph.

On the CPU, autocast runs matmuls in bf16 (so the rule fires on them here); its float32 softmax is
CUDA's policy, so that branch is tested on a captured graph whose softmax value is set to what
CUDA autocast records (float32 from bf16 scores), and on the GPU by tests/test_corpus.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from helpers import FAST, optimize_fresh, row

import nsa_compile
from nsa_compile.fx import op_name, value
from nsa_compile.passes.autocast_casts import ExplicitAutocast

B, H, S, D, W = 2, 4, 24, 8, 5


class MixedWindow(nn.Module):
    """Sliding-window attention whose q comes from a Linear (bf16 under autocast) and whose k, v are
    the input itself (float32): eager autocast casts k to bf16 in `q @ k^T`, and p (float32) and v
    in `p @ v`. Without the casts in the graph the window pass sees q and k of two dtypes."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)

    def forward(self, x):  # x [B, H, S, D]
        q = self.q(x)
        scores = (q @ x.transpose(-1, -2)).float() * D**-0.5
        t = torch.arange(S, device=x.device)
        keep = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < W)
        p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        return p @ x


def autocast_run(module, x, config):
    """(eager output, optimized output, their input gradients) under CPU bf16 autocast."""
    xs = [x.clone().requires_grad_() for _ in range(2)]
    optimized = optimize_fresh(copy.deepcopy(module), config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = module(xs[0]), optimized(xs[1])
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(want.dtype)
    return want, got, torch.autograd.grad(want, xs[0], grad)[0], torch.autograd.grad(got, xs[1], grad)[0], optimized


def test_autocast_matmul_casts_are_written_and_the_window_pass_then_fires():
    x = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(0))
    want, got, gwant, ggot, optimized = autocast_run(MixedWindow(), x, FAST)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ggot, gwant, rtol=2e-2, atol=2e-2)
    canon = row(optimized, "canonicalize")
    autocast = [m for m in canon["kernels"] if m.startswith("autocast:")]
    assert len(autocast) == 2, canon["kernels"]  # q @ k^T (k cast) and p @ v (p and v cast)
    assert "of transpose float32 written" in autocast[0]  # k^T; q is the Linear's bf16
    assert "of p float32, l_x_ float32 written" in autocast[1]
    assert row(optimized, "window_attention")["matches"] == 1


def test_without_autocast_the_rule_leaves_the_graph_alone():
    x = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1))
    module = MixedWindow()
    optimized = optimize_fresh(copy.deepcopy(module), FAST)
    torch.testing.assert_close(optimized(x), module(x), rtol=1e-5, atol=1e-5)
    kernels = row(optimized, "canonicalize")["kernels"]
    assert not any(k.startswith("autocast:") for k in kernels), kernels
    assert row(optimized, "window_attention")["matches"] == 1


def captured(fn, *inputs) -> fx.GraphModule:
    """The Dynamo graph of fn (with its fake values), under CPU bf16 autocast."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm


def softmax_node(gm: fx.GraphModule) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if op_name(n) == "softmax"]
    return node


@pytest.mark.parametrize("spelling", ["function", "method"])
def test_a_softmax_that_autocast_runs_in_float32_gets_its_cast_up(spelling):
    def fn(q, k):
        s = q @ k.transpose(-1, -2)
        return torch.softmax(s, dim=-1) if spelling == "function" else s.softmax(-1)

    q, k = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    gm = captured(fn, q, k)
    node = softmax_node(gm)
    scores = node.args[0]
    assert value(scores).dtype == torch.bfloat16 and value(node).dtype == torch.bfloat16  # the CPU's policy
    with value(node).fake_mode:  # what CUDA autocast records: float32 probabilities from bf16 scores
        node.meta["example_value"] = value(node).float()
    assert ExplicitAutocast()(gm.graph, node) is None  # compiled without autocast: not autocast's cast
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the state the passes run under inside the compile
        what = ExplicitAutocast()(gm.graph, node)
    assert what is not None and what.startswith("autocast: softmax computes in float32")
    cast = node.args[0]
    assert op_name(cast) == "to" and cast.args == (scores, torch.float32) and value(cast).dtype == torch.float32
    gm.graph.lint()
    gm.recompile()
    inputs = {"L_q_": q, "L_k_": k}
    (got,) = gm(*(inputs[n.target] for n in gm.graph.nodes if n.op == "placeholder"))
    torch.testing.assert_close(got, torch.softmax((q @ k.transpose(-1, -2)).float(), dim=-1))


def test_a_softmax_with_a_dtype_argument_or_no_dtype_change_is_left_alone():
    def with_dtype(q, k):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1, dtype=torch.float32)

    q, k = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    gm = captured(with_dtype, q, k)
    before = str(gm.graph)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ExplicitAutocast()(gm.graph, softmax_node(gm)) is None
    assert str(gm.graph) == before
    gm = captured(lambda q, k: torch.softmax(q @ k.transpose(-1, -2), dim=-1), q, k)  # bf16 -> bf16
    before = str(gm.graph)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ExplicitAutocast()(gm.graph, softmax_node(gm)) is None
    assert str(gm.graph) == before


def test_an_einsum_that_promotes_two_dtypes_without_autocast_is_not_autocasts_doing():
    """An outer-product einsum of bf16 and float32 operands (a mul) promotes to float32 in eager
    PyTorch: outside autocast the rule writes no cast (canonicalize's einsum rule then refuses the
    two dtypes, as before)."""
    a, b = torch.randn(5).bfloat16(), torch.randn(3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda a, b: torch.einsum("i,j->ij", a, b), backend=backend, fullgraph=True)(a, b)
    (gm,) = graphs
    (node,) = [n for n in gm.graph.nodes if op_name(n) == "einsum"]
    assert value(node).dtype == torch.float32
    before = str(gm.graph)
    assert ExplicitAutocast()(gm.graph, node) is None
    assert str(gm.graph) == before


class SdpaWindow(nn.Module):
    """A sliding window through F.scaled_dot_product_attention with a band mask, q and k rotated by
    float32 tables (float32 by type promotion from the bf16 Linear), v from the Linear in bf16:
    eager autocast casts q and k back to bf16 for SDPA (chunked_queries' window)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):  # x [B, H, S, D]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        angle = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * 0.1  # [S, 1] float32
        q, k = q * angle.cos() + q.flip(-1) * angle.sin(), k * angle.cos() + k.flip(-1) * angle.sin()
        t = torch.arange(S, device=x.device)
        band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < W)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)


def test_autocast_sdpa_casts_are_written_and_the_window_op_gets_bf16():
    """SDPA runs in bf16 under autocast (CPU and CUDA): the rule writes the casts of the float32
    q and k, so the window op computes in bf16 as eager did (it computed in float32 before);
    without autocast (everything float32) nothing is cast."""
    x = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(4))
    want, got, gwant, ggot, optimized = autocast_run(SdpaWindow(), x, FAST)
    assert want.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ggot, gwant, rtol=5e-2, atol=5e-2)
    autocast = [m for m in row(optimized, "canonicalize")["kernels"] if m.startswith("autocast:")]
    assert len(autocast) == 1 and autocast[0].startswith(
        "autocast: scaled_dot_product_attention computes in bfloat16 under autocast; its cast of "), autocast
    assert autocast[0].count("float32") == 2, autocast  # q and k; v is the Linear's bf16, the band bool
    assert row(optimized, "window_attention")["matches"] == 1
    (record,) = nsa_compile.api.state_of(optimized).graphs
    (window,) = [n for n in record.aten["forward"].graph.nodes if n.target == torch.ops.nsa.window_attention.default]
    assert {a.meta["val"].dtype for a in window.args[:3]} == {torch.bfloat16}
    # near miss: no autocast
    module = SdpaWindow()
    plain = optimize_fresh(copy.deepcopy(module), FAST)
    torch.testing.assert_close(plain(x), module(x), rtol=1e-5, atol=1e-5)
    assert not any(k.startswith("autocast:") for k in row(plain, "canonicalize")["kernels"])


def test_chunked_sdpa_windows_keep_their_key_slices_under_autocast():
    """chunked_queries (tests/corpus): each chunk's window is SDPA over `k_win[:, :, k0:s1]` with
    float32 k (its float32 RoPE tables). autocast's cast goes above the slice (a cast commutes with
    it), so the window pass still reads each chunk's offset from a slice of K: all 4 windows
    rewritten, each op on bf16 q, k, v; output and gradients as eager's under autocast."""
    from corpus import chunked_queries

    model, x = chunked_queries.make()
    want, got, gwant, ggot, optimized = autocast_run(model, x, FAST)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ggot, gwant, rtol=5e-2, atol=5e-2)
    assert row(optimized, "window_attention")["matches"] == 4
    for record in nsa_compile.api.state_of(optimized).graphs:
        for node in record.aten["forward"].graph.nodes:
            if node.target == torch.ops.nsa.window_attention.default:
                assert {a.meta["val"].dtype for a in node.args[:3]} == {torch.bfloat16}


def test_a_cast_moves_above_basic_slices_only():
    """basic_slice: reorderings, narrow and x[..] with ints, slices, None, Ellipsis move the cast
    above them; a tensor index (a gather) does not."""
    from nsa_compile.passes.canonicalize import basic_slice

    def views(x, i):
        return x[:, 1:3, None, ...] * 2 + x[i].sum() + x.narrow(1, 0, 2).sum() + x.transpose(0, 1).sum()

    graphs = []
    torch._dynamo.reset()
    torch.compile(views, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(
        torch.randn(3, 4), torch.tensor([0, 2]))
    found = {n.name: basic_slice(n) for n in graphs[0].graph.nodes if op_name(n) in ("getitem", "narrow", "transpose")}
    assert sorted(found.values()) == [False, True, True, True], found
    (tensor_index,) = [n for n in graphs[0].graph.nodes if op_name(n) == "getitem" and not basic_slice(n)]
    assert any(isinstance(value(a), torch.Tensor) for a in tensor_index.args[1:] if isinstance(a, fx.Node))


def test_a_cast_moves_above_reshapes_and_copies_but_not_a_bit_view_or_tensor_repeats():
    """moves_cast_above: the GQA reshapes and copies (unsqueeze, repeat, flatten, expand,
    repeat_interleave with int repeats, reshape) move the cast above them; `x.view(dtype)`
    (it reinterprets bits) and repeat_interleave with a tensor of repeats (a gather) do not."""
    from nsa_compile.passes.canonicalize import moves_cast_above

    def calls(x, r):
        a = x.unsqueeze(1).repeat(1, 2, 1).flatten(0, 1).reshape(-1).sum()
        b = x.unsqueeze(0).expand(2, -1, -1).sum() + torch.repeat_interleave(x, 2, dim=0).sum()
        return a + b + x.view(torch.int32).sum() + x.repeat_interleave(r, dim=0).sum()

    graphs = []
    torch._dynamo.reset()
    torch.compile(calls, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(
        torch.randn(3, 4), torch.tensor([1, 2, 0]))
    nodes = [n for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    moved = sorted(op_name(n) for n in nodes if moves_cast_above(n))
    assert moved == ["expand", "flatten", "repeat", "repeat_interleave", "reshape", "unsqueeze", "unsqueeze"], moved
    kept = sorted(op_name(n) for n in nodes if op_name(n) in ("view", "repeat_interleave") and not moves_cast_above(n))
    assert kept == ["repeat_interleave", "view"], kept
