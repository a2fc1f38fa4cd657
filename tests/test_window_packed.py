"""Graph tests of window_attention on packed documents (pos): the packed tiny model rewritten on
every layer with the pos node handed to the op, parity of outputs and gradients with the eager
packed model, the mask checked on probe positions (accepted forms, near misses refused with the
graph unchanged), and the probes themselves."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, row

import nsa_compile
from nsa_compile.models import build_model, check_positions, positions_from_cu_seqlens
from nsa_compile.parity import check_parity
from nsa_compile.passes import window_attention as window_pass

PASS = "window_attention"
S = 90
# shorter than l (8), l' (16) and w (32), not multiples of d (4), longer than n * l' (48); one
# row of one document
PACKING = [[13, 40, 1, 6, 30], [90]]
ISOLATED = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=("gqa_grouped_matmul",))
# This pass alone: in bf16 the gate-bias gradients of the tiny model are sums with heavy
# cancellation, and the errors of all passes together can cross the 2x bar where each alone does
# not (NOTES.md); the low-precision parity here is this pass's.
WINDOW_ONLY = nsa_compile.OptimizeConfig(
    compiler="aot_eager", disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != PASS))


def positions(*rows):
    """pos [len(rows), S]: each row packed with documents of the given lengths."""
    return torch.stack([positions_from_cu_seqlens(torch.tensor([0, *itertools.accumulate(r)]), sum(r)) for r in rows])


def square_float_tensors(gm, size):
    return [n for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
            and v.is_floating_point() and tuple(v.shape[-2:]) == (size, size)]


def test_packed_model_fires_on_every_layer_with_pos_and_matches_eager():
    """One compile: the pass on both layers, the op reading l_pos_, no [S, S] float tensor left
    forward or backward, outputs and every gradient within the fp32 parity bar."""
    torch.manual_seed(0)
    eager = build_model("tiny")
    tokens = torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(1))
    pos = positions(*PACKING)
    compiled = []

    def optimize(model):
        compiled.append(optimize_fresh(model))
        return compiled[-1]

    report = check_parity(eager, optimize, (tokens, pos), torch.float32, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = compiled[0]
    r = row(model, PASS)
    assert (r["matches"], r["where"]) == (2, ["blocks.0.attn", "blocks.1.attn"])
    assert r["kernels"] == ["nsa.window_attention[reference] (w=32, per document (pos), GQA-native, no S x S "
                            "tensor; not triton: the Triton kernels run on CUDA (tensors on cpu); "
                            "not flash: FA-2 runs on CUDA only (tensors on cpu))"]
    record = only_graph(model)
    calls = [ln for ln in record.code_after.splitlines() if "torch.ops.nsa.window_attention(" in ln]
    assert len(calls) == 2 and all("'reference', l_pos_)" in ln for ln in calls), calls
    assert "torch.softmax" in record.code_before  # the dense window was there
    assert square_float_tensors(record.aten["forward"], S) == []
    assert square_float_tensors(record.aten["backward"], S) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_model_low_precision_parity(dtype):
    torch.manual_seed(2)
    eager = build_model("tiny")
    tokens = torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(3))
    compiled = []

    def optimize(model):
        compiled.append(optimize_fresh(model, WINDOW_ONLY))
        return compiled[-1]

    report = check_parity(eager, optimize, (tokens, positions([45, 45], [7, 83])), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert row(compiled[0], PASS)["matches"] == 2


# --- mask forms on a packed attention module -----------------------------------------------------


class PackedAttention(nn.Module):
    """Eager window attention over q [B, H, S, D], k/v [B, G, S, D] with positions pos [B, S];
    `mask(pos, S, device)` gives the kept entries ([B, 1, S, S] or as written)."""

    def __init__(self, mask, h=2):
        super().__init__()
        self.mask, self.h = mask, h

    def forward(self, q, k, v, pos):
        k = k.repeat_interleave(self.h, dim=1)
        v = v.repeat_interleave(self.h, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * 0.3
        keep = self.mask(pos, q.shape[2], q.device)
        p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        return p.to(v.dtype) @ v


def grid(S, device):
    return torch.arange(S, device=device)[:, None], torch.arange(S, device=device)[None, :]


def model_form(w):  # models/nsa.py, word for word
    def mask(pos, S, device):
        t, s = grid(S, device)
        return ((s <= t) & (t - s < w) & (s >= t - pos[:, :, None]))[:, None]
    return mask


def document_ids(w):  # the same mask through document ids: equal for valid positions
    def mask(pos, S, device):
        t, s = grid(S, device)
        doc = (pos == 0).cumsum(-1)  # [B, S]
        return ((s <= t) & (t - s < w))[None, None] & (doc[:, :, None] == doc[:, None, :])[:, None]
    return mask


def off_by_one_late(pos, S, device):  # a query does not see its document's first token
    t, s = grid(S, device)
    return ((s <= t) & (t - s < 5) & (s > t - pos[:, :, None]))[:, None]


def off_by_one_early(pos, S, device):  # a query sees the previous document's last token
    t, s = grid(S, device)
    return ((s <= t) & (t - s < 5) & (s >= t - pos[:, :, None] - 1))[:, None]


def first_row_only(pos, S, device):  # every row masked by row 0's documents
    t, s = grid(S, device)
    return ((s <= t) & (t - s < 5) & (s >= t - pos[:1, :, None]))[:, None]


def per_head(pos, S, device):  # [B, H, S, S]: not one pattern for all heads
    return model_form(5)(pos, S, device).expand(-1, 4, -1, -1)


def qkv_pos(B=2, G=2, h=2, S=37, D=8):
    g = torch.Generator().manual_seed(0)
    pos = positions([1, 2, 4, 5, 6, 19], [37]) if B == 2 else positions(*[[37]] * B)
    return (torch.randn(B, G * h, S, D, generator=g), torch.randn(B, G, S, D, generator=g),
            torch.randn(B, G, S, D, generator=g), pos)


@pytest.mark.parametrize("mask, window", [(model_form(5), 5), (document_ids(4), 4), (model_form(100), 37)],
                         ids=["model-form", "document-ids", "causal"])
def test_accepted_packed_mask_forms(mask, window):
    q, k, v, pos = qkv_pos()
    inputs = [x.requires_grad_() for x in (q, k, v)]
    expected = PackedAttention(mask)(*inputs, pos)
    grads = torch.autograd.grad(expected.square().sum(), inputs)
    optimized = optimize_fresh(PackedAttention(mask), ISOLATED)
    got = optimized(*inputs, pos)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), inputs), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    assert r["matches"] == 1 and r["kernels"][0].startswith(f"nsa.window_attention[reference] (w={window}, "
                                                            "per document (pos), ")
    assert "'reference', l_pos_)" in only_graph(optimized).code_after


NEAR_MISSES = [
    (off_by_one_late, "the document term is off by one: a query does not see its document's first token"),
    (off_by_one_early, "the document term is off by one: a query sees the last token of the previous document"),
    (first_row_only, "the mask hides a key of the query's own document inside the window (first at batch row 1, "),
    (per_head, "with positions it must be [B, 1, S, S]"),
]


@pytest.mark.parametrize("mask, reason", NEAR_MISSES, ids=["late", "early", "first-row-only", "per-head"])
def test_packed_near_misses_refused_with_the_graph_unchanged(monkeypatch, mask, reason):
    # one probe at a time (the chunks of a row at a time too): the reason names the first difference
    monkeypatch.setattr(window_pass, "CHUNK_ELEMENTS", 2 * 37 * 3)
    q, k, v, pos = qkv_pos()
    expected = PackedAttention(mask)(q, k, v, pos)
    optimized = optimize_fresh(PackedAttention(mask), ISOLATED)
    got = optimized(q, k, v, pos)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)  # NaN: rows that see nothing
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]


def test_other_data_besides_the_positions_is_refused():
    class PaddedToo(nn.Module):  # the window and a keep mask from the caller
        def forward(self, q, k, v, pos, keep):
            scores = (q @ k.transpose(-1, -2)) * 0.3
            mask = model_form(5)(pos, q.shape[2], q.device) & keep
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    q, k, v, pos = qkv_pos(h=1)
    keep = torch.ones(2, 1, 37, 37, dtype=torch.bool)
    optimized = optimize_fresh(PaddedToo(), ISOLATED)
    optimized(q, k, v, pos, keep)
    r = row(optimized, PASS)
    assert r["matches"] == 0
    assert r["reasons"] == ["the mask depends on placeholder l_keep_ (data other than the positions, an int64 "
                            "[B, S] tensor)"]


def test_unpacked_data_mask_keeps_its_reason():
    """An int64 tensor that is not [B, S] is data as before (the unpacked path's reason)."""
    class TableMask(nn.Module):
        def forward(self, q, k, v, table):
            scores = (q @ k.transpose(-1, -2)) * 0.3
            return torch.softmax(scores.masked_fill(table > 0, float("-inf")), dim=-1) @ v

    q, k, v, _ = qkv_pos(h=1)
    optimized = optimize_fresh(TableMask(), ISOLATED)
    optimized(q, k, v, torch.ones(37, 37, dtype=torch.int64).triu(1))
    assert row(optimized, PASS)["reasons"] == ["the mask depends on placeholder l_table_ (data, not positions)"]


def test_packed_mask_checked_in_row_chunks(monkeypatch):
    """Chunks of 3 rows for the whole batch: the same w accepted, and the rows stitched right."""
    monkeypatch.setattr(window_pass, "CHUNK_ELEMENTS", 2 * 37 * 3)
    q, k, v, pos = qkv_pos()
    optimized = optimize_fresh(PackedAttention(model_form(6)), ISOLATED)
    torch.testing.assert_close(optimized(q, k, v, pos), PackedAttention(model_form(6))(q, k, v, pos),
                               rtol=1e-5, atol=1e-5)
    assert row(optimized, PASS)["kernels"][0].startswith("nsa.window_attention[reference] (w=6, per document")


def test_the_layers_share_one_check(monkeypatch):
    """Two layers with the same mask code: probed once, both rewritten."""
    calls = []
    probes = window_pass.document_probes
    monkeypatch.setattr(window_pass, "document_probes", lambda *a: calls.append(a) or probes(*a))

    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = PackedAttention(model_form(5), h=1), PackedAttention(model_form(5), h=1)

        def forward(self, q, k, v, pos):
            return self.b(self.a(q, k, v, pos), k, v, pos)

    q, k, v, pos = qkv_pos(h=1)
    optimized = optimize_fresh(TwoLayers(), ISOLATED)
    torch.testing.assert_close(optimized(q, k, v, pos), TwoLayers()(q, k, v, pos), rtol=1e-5, atol=1e-5)
    assert row(optimized, PASS)["matches"] == 2 and len(calls) == 1


def test_probes_are_valid_positions_that_differ_per_row():
    B, S, w = 3, 200, 32
    probes = dict(window_pass.document_probes(B, S, w, "cpu"))
    assert len(probes) == 3
    for pos in probes.values():
        check_positions(pos, S)  # what the model accepts: 0 at a start, then +1
    one, structured, random = probes.values()
    assert torch.equal(one, torch.arange(S).expand(B, S))
    for pos in (structured, random):
        assert all(not torch.equal(pos[a], pos[b]) for a, b in itertools.combinations(range(B), 2))
    # documents of each listed length (the last in a row may be cut by the row end)
    starts = (structured[0] == 0).nonzero().flatten().tolist() + [S]
    lengths = {b - a for a, b in itertools.pairwise(starts)}
    assert {1, 2, 3, w - 1, w, w + 1, 2 * w + 1, 5} <= lengths
    # random: some rows dense, some sparse
    counts = (random == 0).sum(-1).tolist()
    assert max(counts) > 5 * min(counts)


@pytest.mark.gpu
def test_packed_model_on_cuda_takes_triton():
    """bf16 on the GPU: the pass writes triton with pos (the document mask in the kernels, no
    host sync; before flash's FA-2 varlen by document); parity holds."""
    torch.manual_seed(0)
    eager = build_model("tiny").cuda()
    tokens = torch.randint(0, 256, (3, 200), generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.cat([positions([1, 2, 60, 129, 8]), positions([200]), positions([33] * 6 + [2])]).cuda()
    report = check_parity(eager, lambda m: optimize_fresh(m, WINDOW_ONLY), (tokens, pos), torch.bfloat16,
                          is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = optimize_fresh(copy.deepcopy(eager).to(torch.bfloat16), WINDOW_ONLY)
    model(tokens, pos).float().square().mean().backward()
    r = row(model, PASS)
    assert r["matches"] == 2
    # auto takes the Triton kernels first, with pos as without
    assert r["kernels"] == ["nsa.window_attention[triton] (w=32, per document (pos), GQA-native, no S x S tensor)"]
