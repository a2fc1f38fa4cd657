"""Graph tests of the varlen [T, H, D] branches (issue 17; tests/corpus/xunhaolai_varlen.py): the
batch rows' documents packed into T tokens, 3-D scores [H, T, ..], per-document Python loops over
cu_seqlens unrolled in the graph. compressed_attention reads the per-document compressed keys as
slots of the op's packed form (key j of a document in the slot where its window starts, positions
from the documents), select_blocks the block choice as a computation (probes against the op),
selected_attention the block mask on probe choices; canonicalize writes an in-place masked_fill_
that nothing else reads as the out-of-place one. Each: the exact count, the source softmax / topk
gone and the op (with pos) there, outputs and gradients as eager's, near misses refused with the
graph unchanged and their reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from corpus import spec
from helpers import FAST, optimize_fresh, only_graph, row
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile
from nsa_compile.workload import load_workload, loss_of

PASSES = ("compressed_attention", "select_blocks", "selected_attention")
NOT_TRITON = "; not triton: the Triton kernels run on CUDA (tensors on cpu)"


def counts(model) -> dict[str, int]:
    return {r["name"]: r["matches"] for r in nsa_compile.report(model)}


def pass_code(model, name: str) -> tuple[str, str]:
    """The graph's code before and after the pass `name`."""
    record = only_graph(model)
    before = record.code_before
    for log in record.logs:
        if log.pass_name == name:
            return before, log.code_after
        before = log.code_after
    raise KeyError(name)


def forward_backward(model, inputs):
    """(output, {name: grad} of every parameter and float input) of one mean-square step."""
    model.zero_grad(set_to_none=True)
    leaves = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = model(*leaves)
    out.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input {i}": x.grad for i, x in enumerate(leaves) if x.is_floating_point()})
    return out.detach(), grads


def assert_parity(eager, optimized, inputs, dtype):
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    (want, want_grads), (got, got_grads) = (forward_backward(m, inputs) for m in (eager, optimized))
    torch.testing.assert_close(got, want, **tol)
    assert sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name].float(), grad.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")


# --- the corpus model: 5/5 branches -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_corpus_varlen_model_rewrites_its_three_branches_with_parity(dtype):
    """xunhaolai_varlen at make()'s size (two rows of documents of 45 and 51 tokens: T = 192):
    one match of each branch pass, the model's softmaxes and top-k gone, the three ops in the graph
    with the documents' positions [1, T] (the window's constant, shared), and the output and every
    gradient as eager's (fp32; bf16 and fp16 at their precision)."""
    wl = load_workload(spec("xunhaolai_varlen.py"))
    eager = copy.deepcopy(wl.model).to(dtype)
    x = wl.inputs[0].to(dtype)
    optimized = optimize_fresh(copy.deepcopy(eager))
    assert_parity(eager, optimized, (x,), dtype)
    assert {name: counts(optimized)[name] for name in PASSES} == dict.fromkeys(PASSES, 1)
    code = only_graph(optimized).code_after
    assert "softmax" not in code and "topk" not in code and ".sort(" not in code
    calls = {name: [line for line in code.splitlines() if f"torch.ops.nsa.{name}(" in line]
             for name in ("window_attention", *PASSES)}
    assert all(len(lines) == 1 for lines in calls.values()), calls
    # the selection ends with q_offset 0 and the longest document (51 tokens), its kernels' tile hint
    assert calls["selected_attention"][0].split(";")[0].endswith(", 0, 51)"), calls
    last = {name: -3 if name == "selected_attention" else -1 for name in calls}
    positions = {line.split(")")[0].split(", ")[last[name]] for name, lines in calls.items() for line in lines}
    assert len(positions) == 1, calls  # one constant pos [1, T] for all four ops
    assert ", 8, 4, 0.25, 'reference', " in calls["compressed_attention"][0]
    assert ", 8, 4, 8, 4, 0.25, 'reference', " in calls["select_blocks"][0]
    assert ", 8, 0.25, 'reference', " in calls["selected_attention"][0]
    assert "documents of at most 51 tokens (the kernels' tiles)" in row(optimized, "selected_attention")["kernels"][0]
    assert row(optimized, "compressed_attention")["kernels"] == [
        "nsa.compressed_attention[reference] (l=8, d=4, packed [T, H, D] tokens (3-D scores, 42 per-document keys "
        f"in slots of 185, 4 documents with a block), GQA-native, no repeated K/V{NOT_TRITON})"]
    fwd = only_graph(optimized).aten["forward"]
    ops = [n for n in fwd.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.nsa.compressed_attention.default, torch.ops.nsa.select_blocks.default,
        torch.ops.nsa.selected_attention.default)]
    assert len(ops) == 3
    index = {torch.ops.nsa.compressed_attention.default: 7, torch.ops.nsa.select_blocks.default: -1,
             torch.ops.nsa.selected_attention.default: 7}
    pos = [op.args[index[op.target]] for op in ops]
    assert [op.args[8:] for op in ops if op.target is torch.ops.nsa.selected_attention.default] == [(0, 51)]
    assert all(tuple(p.meta["val"].shape) == (1, 192) and p.meta["val"].dtype == torch.int64 for p in pos)


def test_corpus_varlen_model_at_other_documents_keeps_parity():
    """Documents of 8 (one block, the model's avg_pool needs l tokens), 13 and 19 tokens per row of
    40: three documents a row, six in all, every branch rewritten with eager's numbers."""
    wl = load_workload(spec("xunhaolai_varlen.py"))
    eager = copy.deepcopy(wl.model)
    eager.doc_lens = (8, 13, 19)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3))
    optimized = optimize_fresh(copy.deepcopy(eager))
    assert_parity(eager, optimized, (x,), torch.float32)
    assert {name: counts(optimized)[name] for name in PASSES} == dict.fromkeys(PASSES, 1)


# --- a small compressed branch over packed tokens, and its near misses ----------------------------

L, STRIDE, H, G, DK, DV = 4, 2, 4, 2, 8, 6
DOCS = (9, 2, 13)  # the 2-token document has no complete block


class PackedCompressed(nn.Module):
    """The compressed branch over packed tokens q [T, H, Dk], k [T, G, Dk], v [T, G, Dv]: each
    document's keys mean-pooled in windows of L tokens at stride STRIDE and concatenated
    ([N, G, D]), 3-D scores [H, T, N] by einsum over K repeated per head, a mask of per-document
    staircases written in place, `masked_fill_`, a float32 softmax, `nan_to_num` for the rows
    before a document's first block. `variant`: 'offset-keys' pools the last document from its
    second token (its keys one slot late: each reads a token after the query that first sees it),
    'cross-documents' lets the last document's queries see the first document's keys, 'late-mask'
    shows each block one token after its last."""

    def __init__(self, variant=None):
        super().__init__()
        self.variant = variant

    def forward(self, q, k, v):
        cu, cu_c, keys, values = [0], [0], [], []
        for n in DOCS:
            cu.append(cu[-1] + n)
        for b in range(len(DOCS)):
            start = cu[b] + (1 if self.variant == "offset-keys" and b == len(DOCS) - 1 else 0)
            if cu[b + 1] - start < L:  # no complete block
                keys.append(k.new_zeros(0, G, DK))
                values.append(v.new_zeros(0, G, DV))
                cu_c.append(cu_c[-1])
                continue
            keys.append(k[start : cu[b + 1]].unfold(0, L, STRIDE).mean(-1))  # [n_c, G, Dk]
            values.append(v[start : cu[b + 1]].unfold(0, L, STRIDE).mean(-1))
            cu_c.append(cu_c[-1] + keys[-1].shape[0])
        kc, vc = torch.cat(keys), torch.cat(values)  # [N, G, D]
        mask = torch.zeros(cu[-1], cu_c[-1], dtype=torch.bool, device=q.device)
        for b in range(len(DOCS)):
            ends = torch.arange(cu_c[b + 1] - cu_c[b], device=q.device) * STRIDE + L - 1
            ends = ends + 1 if self.variant == "late-mask" else ends
            rows = torch.arange(cu[b + 1] - cu[b], device=q.device)
            mask[cu[b] : cu[b + 1], cu_c[b] : cu_c[b + 1]] = rows[:, None] >= ends[None, :]
        if self.variant == "cross-documents":
            mask[cu[2] :, cu_c[0] : cu_c[1]] = True
        s = torch.einsum("qhd,khd->hqk", q, kc.repeat_interleave(H // G, 1)) * DK**-0.5
        s.masked_fill_(~mask[None], float("-inf"))
        p = s.softmax(dim=-1, dtype=torch.float32).nan_to_num(0)
        return torch.einsum("hqk,khd->qhd", p.to(v.dtype), vc.repeat_interleave(H // G, 1))  # [T, H, Dv]


def packed_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    T = sum(DOCS)
    return (torch.randn(T, H, DK, generator=g).to(dtype), torch.randn(T, G, DK, generator=g).to(dtype),
            torch.randn(T, G, DV, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_compressed_branch_fires_with_slots_and_positions(dtype):
    """One match; the softmax and its p @ v gone; the op gets K/V with each key in its slot (0, 2,
    4 for the first document, 11 + 0, 2, .., 8 for the last: the window starts) and positions
    that restart at every document (the 2-token document's tokens at 0, seeing nothing); outputs
    and gradients of q, k, v as eager's."""
    module, inputs = PackedCompressed(), packed_inputs(dtype)
    optimized = optimize_fresh(copy.deepcopy(module))
    assert_parity(module, optimized, inputs, dtype)
    r = row(optimized, "compressed_attention")
    assert r["kernels"] == [
        "nsa.compressed_attention[reference] (l=4, d=2, packed [T, H, D] tokens (3-D scores, 8 per-document keys in "
        f"slots of 21, 2 documents with a block), GQA-native, no repeated K/V{NOT_TRITON})"], r
    _, after = pass_code(optimized, "compressed_attention")
    assert "torch.softmax(" not in after and "torch.ops.nsa.compressed_attention(" in after
    assert "torch.tensor([0, 2, 4, 11, 13, 15, 17, 19]" in after  # the slots of the 8 keys
    # positions: the first document 0..8, the short one 0 (a document per token: no block), the last 0..12
    assert f"torch.tensor([{[*range(9), 0, 0, *range(13)]}]".replace(" ", "") in after.replace(" ", "")


NEAR_MISSES = [
    ("offset-keys", "the compressed mask of the packed tokens is not NSA's per-document visibility (l=4, d=2): query "
                    "t=14 sees compressed key 3 (pooled from tokens [12, 16)), but its last token 15 comes after t "
                    "(a later token leaks in)"),
    ("cross-documents", "compressed key 0 (pooled from tokens [0, 4)) is seen by queries 3..8, hidden from 9 and "
                        "seen again later: not the queries of one document (a mask that crosses documents)"),
    ("late-mask", "the compressed mask of the packed tokens is not NSA's per-document visibility (l=4, d=2): query "
                  "t=3 misses compressed key 0 (pooled from tokens [0, 4)), a block of its own document in its past"),
]


@pytest.mark.parametrize("variant, reason", NEAR_MISSES, ids=[v for v, _ in NEAR_MISSES])
def test_packed_compressed_near_misses_are_refused_with_the_graph_unchanged(variant, reason):
    module, inputs = PackedCompressed(variant), packed_inputs()
    optimized = optimize_fresh(copy.deepcopy(module))
    assert_parity(module, optimized, inputs, torch.float32)  # the same eager code ran
    before, after = pass_code(optimized, "compressed_attention")
    assert before == after
    r = row(optimized, "compressed_attention")
    assert r["matches"] == 0 and r["reasons"] == [reason], r["reasons"]


# --- the block choice and the selected branch: near misses on the corpus model --------------------


def corpus_variant(method: str, replacement):
    """The corpus model (make()'s weights and input) with `method` wrapped by replacement(original,
    self, *args)."""
    wl = load_workload(spec("xunhaolai_varlen.py"))
    model = copy.deepcopy(wl.model)
    original = getattr(type(model), method)
    setattr(model, method, lambda *args: replacement(original, model, *args))
    return model, wl.inputs


def importance_one_key_late(original, self, score, cu_seqlens_q, cu_seqlens_k):
    """The model's block choice on the compressed probabilities moved one key on (key j's credited
    to key j + 1: an overlap map off by one compression block)."""
    return original(self, score.roll(1, dims=-1), cu_seqlens_q, cu_seqlens_k)


def blocks_one_later(original, self, q, k, v, topk_idx, cu_seqlens):
    """The model's selected branch reading each chosen block one later (id + 1)."""
    return original(self, q, k, v, torch.where(topk_idx >= 0, topk_idx + 1, topk_idx), cu_seqlens)


def test_a_block_choice_off_by_one_key_is_refused():
    """select_blocks reads the varlen choice on probes against nsa.select_blocks: with each key's
    importance credited to the next it chooses other blocks, and the first probe query that
    differs is named; the selected branch then reads ids that are no select_blocks op's and stays
    eager too (the compressed branch is rewritten)."""
    model, inputs = corpus_variant("select_blocks", importance_one_key_late)
    optimized = optimize_fresh(copy.deepcopy(model))
    assert_parity(model, optimized, inputs, torch.float32)
    got = counts(optimized)
    assert (got["compressed_attention"], got["select_blocks"], got["selected_attention"]) == (1, 0, 0), got
    before, after = pass_code(optimized, "select_blocks")
    assert before == after
    (reason,) = row(optimized, "select_blocks")["reasons"]
    assert ("read as a varlen choice: the varlen block choice differs from nsa.select_blocks (l=8, d=4, n=4, per "
            "document) for every l' that gives its 7 blocks (l'=8: on probe 0, group 0, token 39 (position 39): "
            "[0, 1, 3, 4], the op's [0, 2, 3, 4])") in reason, reason
    reasons = row(optimized, "selected_attention")["reasons"]  # (and the compressed softmax, left for the choice)
    assert ("3-D scores over packed tokens: no nsa.select_blocks ids are in the graph for the mask of the 3-D scores "
            "over packed tokens to read (select_blocks did not rewrite a block choice: its reason is in explain)"
            ) in reasons, reasons


def test_a_selected_branch_that_reads_other_blocks_is_refused():
    """The selected branch's mask evaluated on probe choices of nsa.select_blocks must be the op's
    visibility: ids read one block later are not (block 0 hidden where 4 blocks are chosen; the
    model's clamp of -1 to block 0 keeps it for the first queries), named at the first query.
    The block choice itself is rewritten (the + 1 reads the op's ids)."""
    model, inputs = corpus_variant("topk_sparse_attention", blocks_one_later)
    optimized = optimize_fresh(copy.deepcopy(model))
    assert_parity(model, optimized, inputs, torch.float32)
    got = counts(optimized)
    assert (got["compressed_attention"], got["select_blocks"], got["selected_attention"]) == (1, 1, 0), got
    before, after = pass_code(optimized, "selected_attention")
    assert before == after
    (reason,) = row(optimized, "selected_attention")["reasons"]
    assert reason.startswith("3-D scores over packed tokens: the mask of the 3-D scores over packed tokens differs "
                             "from nsa.selected_attention's visibility (l'=8, per document) on probe block choice 0: "
                             "head 0, query t=24 (position 24, blocks [0, 1, 2, 3]) hides token 0"), reason


def test_the_varlen_checks_in_chunks_of_a_few_rows_give_the_same_rewrites_and_reasons(monkeypatch):
    """select_blocks' and selected_attention's varlen checks run the model's regions for chunks of
    query rows (nsa_compile/row_regions.py: the model's [H, T, T] mask and [H, T, N] probabilities
    at T 65,536 would not fit whole). With chunks of a few rows here (6 of the mask's, 29 of the
    probabilities'), the corpus model keeps its rewrites and parity, and the two near misses their
    reasons: the first difference over all chunks, as the whole region's."""
    from nsa_compile import row_regions

    monkeypatch.setattr(row_regions, "CHUNK_ELEMENTS", 5000)
    wl = load_workload(spec("xunhaolai_varlen.py"))
    optimized = optimize_fresh(copy.deepcopy(wl.model))
    assert_parity(wl.model, optimized, wl.inputs, torch.float32)
    assert {name: counts(optimized)[name] for name in PASSES} == dict.fromkeys(PASSES, 1)
    test_a_block_choice_off_by_one_key_is_refused()
    test_a_selected_branch_that_reads_other_blocks_is_refused()


# --- canonicalize: an in-place mask that nothing else reads ---------------------------------------


class InPlaceMask(nn.Module):
    """Causal attention q, k, v [B, H, S, D] with the scores masked in place; `shared`: the masked
    scores are also read after the softmax (their in-place change is seen there), `view`: the
    in-place op writes into a view of the product."""

    def __init__(self, shared=False, view=False):
        super().__init__()
        self.shared, self.view = shared, view

    def forward(self, q, k, v):
        S = q.shape[2]
        t = torch.arange(S, device=q.device)
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if self.view:
            s = s[:, :, :, :]
        s.masked_fill_(t[None, :] > t[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0)
        out = p @ v
        return out + s.clamp(min=0).mean() if self.shared else out


@pytest.mark.parametrize("shared, view", [(False, False), (True, False), (False, True)],
                         ids=["read-once", "read-again", "into-a-view"])
def test_canonicalize_reads_an_in_place_mask_only_where_nothing_else_reads_it(shared, view):
    """x.masked_fill_(m, -inf) on a product nothing else reads is x.masked_fill(m, -inf): the scores
    rule writes it out of place (its note), empty_rows takes the nan_to_num, and the window pass
    then rewrites the causal attention. Where the masked scores are read again, or the write goes
    into a view of the product, the in-place op stays and empty_rows refuses, naming it."""
    g = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    module = InPlaceMask(shared, view)
    optimized = optimize_fresh(copy.deepcopy(module))
    assert_parity(module, optimized, inputs, torch.float32)
    canonical = row(optimized, "canonicalize")
    before, after = pass_code(optimized, "canonicalize")
    if not (shared or view):
        assert "masked_fill_" in before and "masked_fill_" not in after
        assert any("in-place masked_fill_ -> masked_fill (its input has no other reader)" in k
                   for k in canonical["kernels"]), canonical
        assert counts(optimized)["window_attention"] == 1
        return
    assert "masked_fill_" in after and counts(optimized)["window_attention"] == 0
    assert canonical["reasons"] == ["empty_rows: rows are zeroed after the softmax, and the scores are masked in "
                                    "place (masked_fill_: masked_fill_), which the score chain does not read (an "
                                    "out-of-place masked_fill is)"], canonical
