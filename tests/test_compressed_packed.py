"""Graph tests of compressed_attention on packed documents (models/nsa.py with `pos`): the pass
fires on every layer of the packed tiny model (exact count) and gives the op the positions, the
p @ v product is gone, outputs and gradients match the eager packed model; the branch on its own
in accepted forms (d read from the mask); near misses refused with the graph unchanged and a
reason; and the probes the pass checks on.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
from helpers import FAST, optimize_fresh, only_graph, row, tokens
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile.passes.compressed_attention as compressed
from nsa_compile.models import build_model, check_positions, positions_from_cu_seqlens
from nsa_compile.models.nsa import upcast
from nsa_compile.parity import check_parity

CMP = "compressed_attention"
LAYERS = ["blocks.0.attn", "blocks.1.attn"]
NOT_TRITON = "; not triton: the Triton kernels run on CUDA (tensors on cpu)"
NO_GQA = FAST.replace(disabled_passes=("gqa_grouped_matmul",))


def positions(rows: list[list[int]], S: int) -> torch.Tensor:
    """pos [len(rows), S] from document lengths per row (summing to S)."""
    out = []
    for lengths in rows:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        out.append(positions_from_cu_seqlens(cu, S))
    return torch.stack(out)


def aten_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


# --- the packed tiny model: counts, the op with pos, parity ------------------------------------------


@pytest.mark.parametrize(
    "changes, dtype",
    [({}, torch.float32), ({"compression": "mlp", "gate": "head", "shared_kv": True}, torch.bfloat16)],
    ids=["fp32", "mlp-head-gate-shared-kv-bf16"],
)
def test_packed_model_fires_on_every_layer_with_the_positions_and_parity(changes, dtype):
    """Documents of 13, 40, 1, 6, 30 tokens (shorter than l = 8, not multiples of d = 4) and one of
    90: the op replaces p @ v on both layers, takes l_pos_, and the model matches eager (float64
    oracle, check_parity's bars) in its outputs and every parameter's gradient."""
    torch.manual_seed(1)
    eager = build_model("tiny", **changes)
    S = 90
    pos = positions([[13, 40, 1, 6, 30], [90]], S)
    kept = []

    def optimize(m):
        kept.append(optimize_fresh(m))
        return kept[-1]

    report = check_parity(eager, optimize, (tokens(2, S, seed=4)[:, :-1], pos), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = kept[0]
    r = row(model, CMP)
    assert (r["matches"], r["where"]) == (2, LAYERS), r
    assert r["kernels"] == [f"nsa.compressed_attention[reference] (l=8, d=4, packed documents (pos), GQA-native, "
                            f"no repeated K/V{NOT_TRITON})"]
    record = only_graph(model)
    assert record.code_after.count("torch.ops.nsa.compressed_attention(") == 2
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.compressed_attention(" in line]
    assert len(calls) == 2 and all(", 8, 4, 0.25, 'reference', l_pos_)" in line for line in calls), calls
    assert record.code_before.count("unfold(1, 8, 1)") == record.code_after.count("unfold(1, 8, 1)") > 0
    fwd, bwd = record.aten["forward"], record.aten["backward"]
    ops = aten_nodes(fwd, torch.ops.nsa.compressed_attention.default)
    assert len(ops) == 2 and all(op.args[7].op == "placeholder" for op in ops)
    assert all(tuple(op.args[7].meta["val"].shape) == (2, S) for op in ops)
    assert len(aten_nodes(bwd, torch.ops.nsa.compressed_attention_backward.default)) == 2
    # p @ v is gone: no product of [.., S, Tc] probabilities with [.., Tc, Dv] values is left
    Tc = S - 8 + 1
    for gm in (fwd, bwd):
        for node in aten_nodes(gm, torch.ops.aten.bmm.default) + aten_nodes(gm, torch.ops.aten.mm.default):
            a, b = (x.meta["val"] for x in node.args[:2])
            assert not (a.shape[-1] == Tc and b.shape[-2] == Tc and b.is_floating_point()), node.format_node()


def test_unpacked_model_keeps_the_unpacked_call():
    """Without pos the graph is the unpacked one: the op gets no positions and d from the pooling."""
    torch.manual_seed(0)
    model = optimize_fresh(build_model("tiny"))
    model(tokens(1, 40)[:, :-1])
    r = row(model, CMP)
    assert r["matches"] == 2 and "packed" not in r["kernels"][0] and "(l=8, d=4, GQA-native" in r["kernels"][0]
    record = only_graph(model)
    assert record.code_after.count("torch.ops.nsa.compressed_attention(") == 2 and "l_pos_" not in record.code_after
    ops = aten_nodes(record.aten["forward"], torch.ops.nsa.compressed_attention.default)
    assert len(ops) == 2 and all(len(op.args) == 7 for op in ops)


# --- the branch on its own: accepted forms, near misses -------------------------------------------

L, D = 4, 2  # l, d of the branch tests


class PackedBranch(nn.Module):
    """NSAAttention.compressed_attention with pos (models/nsa.py) on q [B, S, H, Dk], k, v [B, S, G, D]
    and pos [B, S] -> o_cmp [B, S, H, Dv], written the model's way except for `change`."""

    def __init__(self, change=None, h=2, l=L, d=D):
        super().__init__()
        self.change, self.h, self.l, self.d = change, h, l, d

    def forward(self, q, k, v, pos, extra=None):
        change, h, l, d = self.change, self.h, self.l, self.d
        S, Dk = q.shape[1], q.shape[3]
        step = d if change == "stride-d-pooling" else 1
        k_cmp, v_cmp = k.unfold(1, l, step).mean(-1), v.unfold(1, l, step).mean(-1)  # [B, Tc, G, D]
        Tc = k_cmp.shape[1]
        k_rep = k_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
        v_rep = v_cmp.transpose(1, 2).repeat_interleave(h, dim=1)
        scores = upcast(q.transpose(1, 2) @ k_rep.transpose(-1, -2)) * Dk**-0.5  # [B, H, S, Tc]
        t = torch.arange(S, device=q.device)[:, None]
        i = torch.arange(Tc, device=q.device)[None, :]
        first = i * step  # the first token of slot i
        slot_pos = pos[:, : (Tc - 1) * step + 1 : step]  # [B, Tc]
        end_pos = pos[:, l - 1 :: step][:, :Tc]
        at_stride = {"no-stride-term": slot_pos >= 0,
                     "stride-from-row-start": first % d == 0}.get(change, slot_pos % d == 0)
        in_one_document = end_pos == slot_pos + l - 1
        if change == "crossing-blocks":
            in_one_document = torch.ones_like(in_one_document)
        is_block = at_stride & in_one_document  # [B, Tc]
        doc_start = t - pos[:, :, None]  # [B, S, 1]
        same_doc = {"doc-start-hidden": first > doc_start, "crossing-blocks": first + l - 1 >= doc_start,
                    "previous-document": first >= doc_start - l}.get(change, first >= doc_start)
        staircase = first + l - 1 <= t
        visible = (staircase & same_doc & is_block[:, None, :])[:, None]  # [B, 1, S, Tc]
        if change == "extra-data":
            visible = visible & extra[:, None, None, :]
        if change == "where":
            scores = torch.where(visible, scores, float("-inf"))
        else:
            scores = scores.masked_fill(~visible, float("-inf"))
        has_block = visible.any(dim=-1, keepdim=True)
        if change == "zeroing-ignores-pos":
            has_block = staircase.any(dim=-1, keepdim=True)
        p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1)
        p = p * (staircase if change == "final-mask-ignores-pos" else visible)
        return (p.to(v_rep.dtype) @ v_rep).transpose(1, 2)  # [B, S, H, Dv]


def branch_inputs(S=29, B=2, G=2, h=2, Dk=8, Dv=6, dtype=torch.float32):
    """q, k, v and positions: row 0 documents of 1, 3, 7, 2, 9, 7 tokens, row 1 of 12 and 17."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, G * h, Dk, generator=g).to(dtype)
    k = torch.randn(B, S, G, Dk, generator=g).to(dtype)
    v = torch.randn(B, S, G, Dv, generator=g).to(dtype)
    rows = [[1, 3, 7, 2, 9, 7], [12, 17]] if S == 29 else [[S]] * B
    return q, k, v, positions(rows[:B], S)


def run_both(module, args, config=FAST):
    """(eager output and float leaves, optimized output and float leaves, the optimized module)."""
    def leaves():
        return [x.clone().requires_grad_() if x.is_floating_point() else x for x in args]

    eager_args, opt_args = leaves(), leaves()
    expected = module(*eager_args)
    optimized = optimize_fresh(copy.deepcopy(module), config)
    return (expected, eager_args), (optimized(*opt_args), opt_args), optimized


def kernel(d, l=L):
    """What explain shows for the packed branch's rewrite."""
    return (f"nsa.compressed_attention[reference] (l={l}, d={d}, packed documents (pos), GQA-native, no repeated "
            f"K/V{NOT_TRITON})")


@pytest.mark.parametrize(
    "change, h, l, d, S, dtype, want_d",
    [(None, 2, L, D, 29, torch.float32, D), ("where", 1, L, D, 29, torch.float32, D),
     (None, 3, L, D, 29, torch.bfloat16, D), (None, 2, 4, 4, 29, torch.float32, 4),
     ("no-stride-term", 2, L, D, 29, torch.float32, 1), (None, 2, 4, 4, 6, torch.float32, 3)],
    ids=["model", "where-h1", "bf16-h3", "l-eq-d", "no-stride-term-is-d1", "one-slot-per-document-S6"],
)
def test_packed_branch_forms_fire_with_the_d_of_the_mask(change, h, l, d, S, dtype, want_d):
    """The pass reads d from the mask: without the `pos[s] % d` term the mask is the packed one for
    d = 1 (and the op with d = 1 gives eager's numbers); with S - l < d only one slot per document
    fits, and d = S - l + 1 gives the same mask."""
    args = branch_inputs(S=S, h=h, dtype=dtype)
    (expected, eager_args), (got, opt_args), optimized = run_both(PackedBranch(change, h, l, d), args)
    r = row(optimized, CMP)
    assert (r["matches"], r["kernels"]) == (1, [kernel(want_d, l=l)]), r
    record = only_graph(optimized)
    assert "torch.ops.nsa.compressed_attention(" in record.code_after and "torch.softmax(" not in record.code_after
    (call,) = [line for line in record.code_after.splitlines() if "torch.ops.nsa.compressed_attention(" in line]
    assert f", {l}, {want_d}, {8**-0.5}, 'reference', l_pos_)" in call, call
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tol)
    floats = [x for x in eager_args if x.is_floating_point()]
    grads = torch.autograd.grad(expected.float().square().sum(), floats)
    got_grads = torch.autograd.grad(got.float().square().sum(), [x for x in opt_args if x.is_floating_point()])
    for a, b in zip(got_grads, grads):
        torch.testing.assert_close(a, b, **tol)


NEAR_MISSES = [
    # s > t - pos[t]: caught on one document already, where d is read
    ("doc-start-hidden", "on one document (pos = 0..S-1) the last query does not see slot 0, the document's first "
                         "block (it sees slots [2, 4, 6, 8, 10, 12]...): not the packed visibility mask"),
    ("previous-document", "the visibility mask is not the packed one for (l=4, d=2) on probe positions 'short "
                          "documents' (documents: 1, 2, 3, 4, 5, 3, 3, 8): query t=10 of batch row 0 sees slot s=6, "
                          "but it lies in an earlier document (t's document starts at token 10)"),
    ("stride-from-row-start", "query t=25 of batch row 0 sees slot s=22, but it starts at position 1 of its document, "
                              "not a multiple of d = 2 (blocks counted from the row start, not the document start?)"),
    ("crossing-blocks", "query t=3 of batch row 0 sees slot s=0, but its l tokens cross a document boundary"),
    ("zeroing-ignores-pos", "the zeroing before the softmax misses rows without a visible block (eager gives NaN "
                            "there) (on probe positions 'short documents')"),
    ("final-mask-ignores-pos", "the mask after the softmax keeps rows without a visible block (eager gives them 1/Tc "
                               "each, the op 0) (on probe positions 'short documents')"),
    ("stride-d-pooling", "the masks read positions within documents (l_pos_), but the keys are pooled at stride 2: "
                         "the packed form pools a slot at every token (x.unfold(1, l, 1))"),
    ("extra-data", "the visibility masks read placeholder l_extra_ besides the positions (data other than one int64 "
                   "[B, S] tensor of positions within documents)"),
]


@pytest.mark.parametrize("change, reason", NEAR_MISSES, ids=[c for c, _ in NEAR_MISSES])
def test_packed_near_misses_are_refused_with_the_graph_unchanged(change, reason):
    q, k, v, pos = branch_inputs()
    args = [q, k, v, pos]
    if change == "extra-data":
        args.append(torch.ones(2, 29 - L + 1, dtype=torch.bool))
    (expected, _), (got, _), optimized = run_both(PackedBranch(change), args, NO_GQA)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)  # the same eager code ran
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, CMP)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]


CHUNKED = [("model", None), ("where", None), *NEAR_MISSES]


@pytest.mark.parametrize("change, reason", CHUNKED, ids=[c for c, _ in CHUNKED])
def test_row_chunks_give_the_verdicts_of_the_whole_masks(monkeypatch, change, reason):
    """The packed masks are evaluated in row chunks (nsa_compile/mask_rows.py): with chunks of 3
    rows the accepted forms fire with the same d and match eager, and every near miss is refused
    with the reason the whole masks give (the first query, batch row first, that shows it)."""
    monkeypatch.setattr(compressed, "CHUNK_ELEMENTS", 2 * (29 - L + 1) * 3)  # 3 rows of [B, Tc] per chunk
    q, k, v, pos = branch_inputs()
    args = [q, k, v, pos] + ([torch.ones(2, 29 - L + 1, dtype=torch.bool)] if change == "extra-data" else [])
    (expected, _), (got, _), optimized = run_both(PackedBranch(None if change == "model" else change), args, NO_GQA)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    r = row(optimized, CMP)
    if reason is None:
        assert (r["matches"], r["kernels"]) == (1, [kernel(D)]), r
    else:
        assert r["matches"] == 0 and only_graph(optimized).code_before == only_graph(optimized).code_after
        assert any(reason in text for text in r["reasons"]), r["reasons"]


# --- the probes and the packed visibility -------------------------------------------------------------


def test_probes_are_valid_varied_packings():
    """Every probe is valid positions; rows of a probe are packed differently; together they hold
    documents of 1, 2, < l, l, l + 1 tokens, lengths off multiples of d, starts on multiples of d and
    of l and just off them, and a document longer than half the row."""
    B, S, l, d = 3, 70, 8, 4
    probes = compressed.position_probes(B, S, l, d, "cpu")
    assert probes[0][0] == "one document" and len(probes) == 8
    lengths, starts = set(), set()
    for name, pos in probes:
        check_positions(pos, S)
        if name not in ("one document", "a document per token"):
            assert not torch.equal(pos[0], pos[1]) and not torch.equal(pos[1], pos[2]), name
        for b in range(B):
            at = (pos[b] == 0).nonzero().flatten().tolist()
            starts.update(at)
            lengths.update(y - x for x, y in itertools.pairwise(at))  # whole documents only
    assert {1, 2, 3, l - 1, l, l + 1, d + 1, 2 * l + 3} <= lengths and max(lengths) > S // 2
    assert {d, l, 2 * l} <= starts and {d + 1, l - 1, l + 1} <= starts


def test_packed_visibility_is_the_models():
    """The pass's predicate is models/nsa.py's mask, on every probe."""
    B, S, l, d = 2, 41, 6, 3
    Tc = S - l + 1
    t, i = torch.arange(S)[:, None], torch.arange(Tc)[None, :]
    for _, pos in compressed.position_probes(B, S, l, d, "cpu"):
        slot_pos = pos[:, :Tc]
        is_block = (slot_pos % d == 0) & (pos[:, l - 1 :] == slot_pos + l - 1)
        model = (i + l - 1 <= t) & (i >= (t - pos[:, :, None])) & is_block[:, None, :]
        assert torch.equal(compressed.packed_visibility(pos, Tc, l, d), model)


def test_stride_is_read_from_one_document():
    S, l = 30, 4
    one = torch.arange(S)[None]
    for d in (1, 2, 3, 4, 8):
        keep = compressed.packed_visibility(one, S - l + 1, l, d)
        assert compressed.stride_from_one_document(keep, l) == d
    keep = compressed.packed_visibility(one, S - l + 1, l, 3)
    keep[0, S - 1, 6] = False  # a gap: 0, 3, 9, ...
    with pytest.raises(compressed.Refused, match=r"sees slots \[0, 3, 9, 12, 15, 18\]...: not every d-th slot"):
        compressed.stride_from_one_document(keep, l)
    with pytest.raises(compressed.Refused, match="does not see slot 0"):
        compressed.stride_from_one_document(torch.zeros_like(keep), l)


class ArangeRowMask(nn.Module):
    """The unpacked branch at batch 1 with t built as a [1, S] int64 arange first: an int64 [B, S]
    tensor in the mask that reads no input, so not positions (the unpacked proof applies)."""

    def forward(self, q, k, v):
        S = q.shape[1]
        k_rep = k.unfold(1, L, D).mean(-1).transpose(1, 2).repeat_interleave(2, dim=1)  # [1, H, Tc, Dk]
        v_rep = v.unfold(1, L, D).mean(-1).transpose(1, 2).repeat_interleave(2, dim=1)
        scores = (q.transpose(1, 2) @ k_rep.transpose(-1, -2)) * 0.5
        t = torch.arange(S)[None].transpose(0, 1)  # [S, 1], from a [1, S] = [B, S] int64 arange
        visible = torch.arange(k_rep.shape[2])[None] * D + L - 1 <= t
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~visible.any(-1, keepdim=True), 0.0)
        return (torch.softmax(scores, dim=-1) * visible) @ v_rep


def test_an_int64_row_of_positions_computed_in_the_graph_is_not_an_input():
    q, k, v, _ = branch_inputs(B=1)
    (expected, _), (got, _), optimized = run_both(ArangeRowMask(), [q, k, v])
    r = row(optimized, CMP)
    assert r["matches"] == 1 and "packed" not in r["kernels"][0] and "l_pos_" not in only_graph(optimized).code_after
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_reason_names_a_hidden_slot():
    """A mask that hides a block of the query's own document (here: the second block of a document
    of 7 tokens, l = 4, d = 2) is reported as such."""
    pos = positions([[7, 22]], 29)
    want = compressed.packed_visibility(pos, 26, L, D)
    keep = want.clone()
    keep[0, 6, 2] = False
    assert want[0, 6, 2]
    assert compressed.packed_reason(keep, want, pos, L, D, "p").endswith(
        "query t=6 of batch row 0 hides slot s=2, a block of its own document (position 2) that lies in its past")


# --- GPU (tools/gpu_check.sh runs these on the H100) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_packed_seed_layers_fire_with_parity(dtype):
    """Two seed-config layers (l 32, d 16) at S = 1100 packed with documents of odd lengths (one of
    them longer than n * l' = 1024): the pass fires on both layers with the positions, and the
    model matches eager (check_parity against float64; its eager selection gathers [B, H, S,
    n*l', D] K/V in float64, 2 x 7 GB here)."""
    torch.manual_seed(0)
    eager = build_model("seed", n_layers=2).cuda()
    S = 1100
    pos = positions([[700, 5, 31, 33, 1, 330], [1070, 17, 13]], S).cuda()
    kept = []

    def optimize(m):
        kept.append(optimize_fresh(m))
        return kept[-1]

    report = check_parity(eager, optimize, (tokens(2, S, seed=4)[:, :-1].cuda(), pos), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    r = row(kept[0], CMP)
    print(r["kernels"], f"{r['time_ms']} ms")
    assert (r["matches"], r["where"]) == (2, LAYERS), r
    assert r["kernels"] == ["nsa.compressed_attention[triton] (l=32, d=16, packed documents (pos), GQA-native, "
                            "no repeated K/V)"]  # auto takes the kernels with pos on CUDA
