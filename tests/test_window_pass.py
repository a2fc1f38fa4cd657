"""Graph tests of window_attention: fired (exact count), the S x S scores gone and the op present,
parity of outputs and gradients, the accepted mask forms, and near misses refused unchanged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, row, tokens

import nsa_compile
from nsa_compile.models import build_model, preset
from nsa_compile.parity import check_parity
from nsa_compile.passes import window_attention as window_pass

PASS = "window_attention"
S = 100


def square_float_tensors(gm, size):
    """Nodes of an ATen graph whose value is a float tensor ending in [size, size]."""
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and tuple(val.shape[-2:]) == (size, size):
            out.append(node)
    return out


def test_fires_once_per_layer_and_the_dense_scores_are_gone():
    torch.manual_seed(0)
    model = optimize_fresh(build_model("tiny"))
    model.loss(tokens(2, S)).backward()
    r = row(model, PASS)
    assert (r["matches"], r["where"]) == (2, ["blocks.0.attn", "blocks.1.attn"])
    assert r["kernels"] == ["nsa.window_attention[reference] (w=32, GQA-native, no S x S tensor; "
                            "not triton: the Triton kernels run on CUDA (tensors on cpu); "
                            "not flash: FA-2 runs on CUDA only (tensors on cpu))"]
    record = only_graph(model)
    assert record.code_after.count("torch.ops.nsa.window_attention") == 2
    assert square_float_tensors(record.aten["forward"], S) == []
    assert square_float_tensors(record.aten["backward"], S) == []
    # the window branch's K/V copies went with it (and the other branches' with their passes):
    # none is left for the GQA pass
    assert row(model, "gqa_grouped_matmul")["matches"] == 0


def test_disabled_keeps_the_dense_window():
    model = optimize_fresh(build_model("tiny"), nsa_compile.OptimizeConfig(
        compiler="aot_eager", disabled_passes=(PASS,)))
    model.loss(tokens(2, S)).backward()
    assert len(square_float_tensors(only_graph(model).aten["forward"], S)) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_parity_outputs_and_every_gradient(dtype):
    torch.manual_seed(1)
    eager = build_model(preset("tiny", gate="head", rope="interleaved", head_dim_v=8))
    report = check_parity(eager, optimize_fresh, tokens(2, S, seed=4), dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]


# --- mask forms, accepted and refused -----------------------------------------------------------


class Attention(nn.Module):
    """Eager masked attention over q [B, H, S, D], k/v [B, G, S, D]; `mask(S, device)` keeps True."""

    def __init__(self, mask, h=2, scores_also_returned=False):
        super().__init__()
        self.mask, self.h, self.leak = mask, h, scores_also_returned

    def forward(self, q, k, v):
        k = k.repeat_interleave(self.h, dim=1)
        v = torch.repeat_interleave(v, self.h, dim=1)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
        keep = self.mask(q.shape[2], q.device)
        p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        out = p.to(v.dtype) @ v
        return (out, scores) if self.leak else out


def positions(S, device):
    return torch.arange(S, device=device)[:, None], torch.arange(S, device=device)[None, :]


def window_lt(w):
    def mask(S, device):
        t, s = positions(S, device)
        return (s <= t) & (t - s < w)
    return mask


def window_le(w):  # the same window written with <=
    def mask(S, device):
        t, s = positions(S, device)
        return (t >= s) & (t - s <= w - 1)
    return mask


def band_tril(w):  # ones().tril() & ~ones().tril(-w): the band form
    def mask(S, device):
        ones = torch.ones(S, S, dtype=torch.bool, device=device)
        return ones.tril() & ~ones.tril(-w)
    return mask


def causal(S, device):
    return torch.ones(S, S, dtype=torch.bool, device=device).tril()


def no_diagonal(S, device):  # off by one: a query does not see itself
    t, s = positions(S, device)
    return (s < t) & (t - s < 4)


def two_sided(S, device):  # non-causal band
    t, s = positions(S, device)
    return (t - s).abs() < 4


def qkv(B=2, G=2, h=2, S=37, D=8, Dv=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, G * h, S, D, generator=g), torch.randn(B, G, S, D, generator=g),
            torch.randn(B, G, S, Dv, generator=g))


@pytest.mark.parametrize(
    "mask, window, h",
    [(window_lt(5), 5, 2), (window_le(5), 5, 3), (band_tril(7), 7, 1), (causal, 37, 2), (window_lt(1), 1, 2)],
    ids=["lt", "le", "band-tril", "causal", "w1"],
)
def test_accepted_mask_forms(mask, window, h):
    inputs = [x.requires_grad_() for x in qkv(h=h, Dv=6)]
    module = Attention(mask, h=h)
    expected = module(*inputs)
    grads = torch.autograd.grad(expected.square().sum(), inputs)
    optimized = optimize_fresh(Attention(mask, h=h))
    got = optimized(*inputs)
    got_grads = torch.autograd.grad(got.square().sum(), inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    assert r["matches"] == 1 and r["kernels"][0].startswith(f"nsa.window_attention[reference] (w={window}, ")


@pytest.mark.parametrize(
    "module, reason",
    [
        (Attention(no_diagonal), "the mask is causal but not a sliding window"),
        (Attention(two_sided), "the mask is non-causal: a query sees a later key"),
        (Attention(window_lt(5), scores_also_returned=True), "the score tensor is used by 2 nodes"),
    ],
    ids=["off-by-one", "non-causal", "scores-used-elsewhere"],
)
def test_near_misses_refused_with_the_graph_unchanged(module, reason):
    inputs = qkv()
    expected = module(*inputs)
    optimized = optimize_fresh(copy.deepcopy(module), nsa_compile.OptimizeConfig(
        compiler="aot_eager", disabled_passes=("gqa_grouped_matmul",)))
    got = optimized(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all()
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]


def test_mask_from_data_is_refused():
    class DataMask(nn.Module):
        def forward(self, q, k, v, keep):
            scores = (q @ k.transpose(-1, -2)) * 0.5
            return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v

    q, k, v = qkv(h=1)
    keep = torch.ones(37, 37, dtype=torch.bool).tril()
    optimized = optimize_fresh(DataMask())
    optimized(q, k, v, keep)
    r = row(optimized, PASS)
    assert r["matches"] == 0 and r["reasons"] == ["the mask depends on placeholder l_keep_ (data, not positions)"]


@pytest.mark.inductor
def test_inductor_smoke_window():
    torch.manual_seed(3)
    eager = build_model("tiny")

    def with_inductor(m):
        torch._dynamo.reset()
        return nsa_compile.optimize(m)

    report = check_parity(eager, with_inductor, tokens(2, S, seed=6), torch.float32)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = with_inductor(copy.deepcopy(eager))
    model.loss(tokens(2, S, seed=6)).backward()
    assert row(model, PASS)["matches"] == 2


def test_half_precision_softmax_is_refused():
    """Without the upcast, eager runs softmax in bf16; the op would compute it in fp32."""

    class HalfSoftmax(Attention):
        def forward(self, q, k, v):
            scores = q @ k.transpose(-2, -1) * 0.25
            keep = self.mask(q.shape[2], q.device)
            return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v

    inputs = [x.bfloat16() for x in qkv(h=1)]
    optimized = optimize_fresh(HalfSoftmax(causal, h=1))
    optimized(*inputs)
    r = row(optimized, PASS)
    assert r["matches"] == 0
    assert r["reasons"] == ["the softmax runs in torch.bfloat16 on torch.bfloat16 scores; the op computes it in torch.float32"]


def test_backend_named_in_the_config_is_used_or_the_window_refused():
    """OptimizeConfig(window_attention_backend=...): 'reference' is written into the graph; 'flash', which
    cannot run on the CPU, leaves the dense window in place with the reason (no fallback)."""
    torch.manual_seed(0)
    batch = tokens(2, S)
    ref = optimize_fresh(build_model("tiny"), nsa_compile.OptimizeConfig(compiler="aot_eager",
                                                                         window_attention_backend="reference"))
    ref.loss(batch).backward()
    r = row(ref, PASS)
    assert r["matches"] == 2
    assert r["kernels"] == ["nsa.window_attention[reference] (w=32, GQA-native, no S x S tensor; "
                            "not triton or flash: window_attention_backend='reference' in OptimizeConfig)"]
    calls = [ln for ln in only_graph(ref).code_after.splitlines() if "nsa.window_attention" in ln]
    assert len(calls) == 2 and all("'reference'" in ln for ln in calls)

    flash = optimize_fresh(build_model("tiny"), nsa_compile.OptimizeConfig(compiler="aot_eager",
                                                                             window_attention_backend="flash"))
    flash.loss(batch).backward()
    r = row(flash, PASS)
    assert r["matches"] == 0
    reasons = {m["reason"] for m in near_misses_of(flash) if m["pass"] == PASS}
    assert ("OptimizeConfig(window_attention_backend='flash'): window_attention: backend 'flash' cannot run these inputs: "
            "FA-2 runs on CUDA only (tensors on cpu)") in reasons
    assert "torch.ops.nsa.window_attention" not in only_graph(flash).code_after


def near_misses_of(model):
    from nsa_compile.cli import near_misses

    return near_misses(model)


def leading_view(S, device):  # the window, viewed as [1, 1, S, S] (a shape-only view of the mask)
    return window_lt(6)(S, device)[None, None]


def reversed_rows(S, device):  # not shape-only: rows reversed (anti-causal), must not pass as a view
    t, s = positions(S, device)
    return ((s <= t) & (t - s < 6)).flip(0)


@pytest.mark.parametrize(
    "mask, expected",
    [(window_lt(5), "w=5"), (band_tril(7), "w=7"), (causal, "w=37"), (leading_view, "w=6"),
     (no_diagonal, "the mask is causal but not a sliding window"),
     (two_sided, "the mask is non-causal"),
     (reversed_rows, "only element-wise ops, fills, tril/triu and views are verified in chunks")],
    ids=["lt", "band-tril", "causal", "leading-view", "off-by-one", "non-causal", "flip"],
)
def test_the_mask_is_verified_in_row_chunks(monkeypatch, mask, expected):
    """Long sequences verify the mask chunk by chunk (every element, O(rows * S) memory); with a
    tiny chunk the same forms are accepted with the same w and the same near misses refused."""
    from nsa_compile.passes import window_attention

    monkeypatch.setattr(window_attention, "CHUNK_ELEMENTS", 37 * 5)  # 5 rows per chunk at S = 37
    inputs = qkv()
    optimized = optimize_fresh(Attention(mask), nsa_compile.OptimizeConfig(
        compiler="aot_eager", disabled_passes=("gqa_grouped_matmul",)))
    torch.testing.assert_close(optimized(*inputs), Attention(mask)(*inputs), rtol=1e-5, atol=1e-5, equal_nan=True)
    r = row(optimized, PASS)
    if expected.startswith("w="):
        assert r["matches"] == 1 and f"({expected}, " in r["kernels"][0], r
    else:
        assert r["matches"] == 0 and any(expected in text for text in r["reasons"]), r["reasons"]


# --- symbolic sizes (dynamic shapes): the mask checked at probe sizes ----------------------------


def odd_window(S, device):  # a window of 4, or 5 at odd S: right at some sizes only
    t, s = positions(S, device)
    return (s <= t) & (t - s < 4 + S % 2)


def run_lengths(module, lengths, config, h=2):
    """(optimized module, its record list) after forward and backward at each length, checked
    against eager there: outputs and every input gradient."""
    optimized = optimize_fresh(copy.deepcopy(module), config)
    for S in lengths:
        inputs = [x.requires_grad_() for x in qkv(h=h, S=S, Dv=6)]
        expected = module(*inputs)
        grads = torch.autograd.grad(expected.square().sum(), inputs)
        got = optimized(*inputs)
        got_grads = torch.autograd.grad(got.square().sum(), inputs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return optimized, nsa_compile.api.state_of(optimized).graphs


# dynamic=None (the default): the first length static, one graph with S a symbol from the first
# change on (dynamic=True would make every size a symbol, the head dim in the scale too)
DYNAMIC = nsa_compile.OptimizeConfig(compiler="aot_eager", dynamic=None, disabled_passes=("gqa_grouped_matmul",))


@pytest.mark.parametrize("mask, window", [(window_lt(5), 5), (band_tril(3), 3)], ids=["lt", "band-tril"])
def test_symbolic_sizes_keep_the_window_in_one_graph(mask, window):
    """One graph with S a symbol serves 38, 53 and 64 (after a static one at 37); the mask was
    checked at the probe sizes (38, 39, 57) and the op took w."""
    optimized, graphs = run_lengths(Attention(mask), (37, 38, 53, 64), DYNAMIC)
    static, record = graphs
    assert "torch.SymInt" in record.code_before and "torch.SymInt" not in static.code_before
    assert record.code_before.count("torch.softmax") == 1 and "torch.softmax" not in record.code_after
    assert "torch.ops.nsa.window_attention" in record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 2 and len(r["kernels"]) == 1  # the same kernel, static and symbolic
    assert r["kernels"][0].startswith(f"nsa.window_attention[reference] (w={window}, GQA-native, no S x S tensor")


def test_symbolic_causal_mask_is_guarded_to_the_longest_probe(monkeypatch):
    """A mask causal at every probe has not shown a window: w = the longest probe S with a guard
    S <= it; a longer S compiles again (here with the doubling cap lowered to 64: after a static
    graph at 30, probes 37, 38, 56, then 74, 76, 112: w = 112)."""
    monkeypatch.setattr(window_pass, "CAUSAL_UP_TO", 64)
    optimized, graphs = run_lengths(Attention(causal), (30, 37, 50, 112, 113), DYNAMIC)
    assert len(graphs) == 3  # 30 static; 37..112 in one graph; 113 past its guard
    kernels = row(optimized, PASS)["kernels"]
    assert [k.split(",")[0] for k in kernels] == [f"nsa.window_attention[reference] (w={w}" for w in (30, 112, 132)]
    assert [len(log.matches) for g in graphs for log in g.logs if log.pass_name == PASS] == [1, 1, 1]


def test_symbolic_sizes_refuse_a_window_that_changes_with_s():
    """A near miss only a second size shows: w = 4 + S % 2 is a window at every static S, but not
    one w for all S; refused at symbolic sizes with the sizes named, the graph unchanged."""
    optimized, graphs = run_lengths(Attention(odd_window), (36, 37, 40), DYNAMIC)
    static, record = graphs
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 1  # the static graph at 36 (w = 4 there)
    assert "at symbolic sizes the mask is a different window at different S: w=5 at S=37, w=4 at S=38, w=4 at S=56" \
        in r["reasons"]
