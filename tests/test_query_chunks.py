"""query_chunks (passes/query_chunks.py): the op calls the branch passes made per chunk of queries
become one call per op over the whole sequence.

Matches: the small chunked models of test_query_offset.py (compressed, block selection and
selected branches over chunks of 24 or 10 queries) and test_window_offset.py (two windows per
chunk, the first chunk's keys a prefix slice), and the corpus' chunked_queries (all four ops, 4
chunks): the exact number of merges, the per-chunk calls gone from the forward ATen graph and one
call per op left there with q_offset 0, outputs and every gradient as eager's (fp32; bf16 too for
the small chunked model).

Near misses, each a module calling the op on slices of q directly: rows left out, overlapping
chunks, a q_offset that is not the chunk's first row, chunks over other keys, keys written in place
between the chunks' calls (the same node, another value). Each is refused with
its reason and the graph is as the passes before left it; the output is eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import FAST, CHUNK_TOL, matches, only_graph, optimize_fresh, optimized_with_parity
from test_query_offset import OFFSET_AT, ChunkedBranches, eager_ops_left, offsets_of
from test_window_offset import ChunkedWindows, code_around, reasons, window_calls

import nsa_compile
from corpus import chunked_queries


def forward_calls(opt, name: str) -> int:
    target = getattr(torch.ops.nsa, name).default
    return sum(n.op == "call_function" and n.target is target for n in only_graph(opt).aten["forward"].graph.nodes)


def calls_in(code: str, name: str) -> int:
    return code.count(f"nsa.{name}(")


@pytest.mark.parametrize("chunk, dtype", [(24, torch.float32), (24, torch.bfloat16), (10, torch.float32)],
                         ids=["24-fp32", "24-bf16", "10-fp32"])
def test_the_chunks_of_each_branch_become_one_call(chunk, dtype):
    """Chunks [0, 24), [24, 48), [48, 61) (or 7 chunks of 10, the last a single row): the
    compressed, block-selection and selected calls of every chunk, one merged call each."""
    torch.manual_seed(0)
    model, x = ChunkedBranches(chunk=chunk), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, dtype)
    chunks = len(range(0, 61, chunk))
    fired = matches(opt)
    assert [fired[name] for name in OFFSET_AT] == [chunks] * 3  # the branch passes, per chunk
    assert fired["query_chunks"] == 3
    before, after = code_around(opt, "query_chunks")
    for name in OFFSET_AT:
        assert (calls_in(before, name), calls_in(after, name)) == (chunks, 1), name
        assert offsets_of(opt, name) == [0], name
    assert eager_ops_left(opt) == []
    (row,) = [r for r in nsa_compile.report(opt) if r["name"] == "query_chunks"]
    assert all(f"call for {chunks} chunks of queries (61 rows of" in kernel for kernel in row["kernels"]), row


def test_two_windows_per_chunk_become_one_call_each():
    """Two windows (w 8 and 20) per chunk of 24 rows: two merged calls, one per window (the
    calls over rows of q with other keys are another set); the first chunk's keys are the prefix
    k[:, :, :24] of the others' whole K."""
    torch.manual_seed(0)
    model, x = ChunkedWindows(), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x)
    assert (matches(opt)["window_attention"], matches(opt)["query_chunks"]) == (6, 2)
    assert window_calls(opt) == [(8, 0), (20, 0)]
    before, after = code_around(opt, "query_chunks")
    assert (calls_in(before, "window_attention"), calls_in(after, "window_attention")) == (6, 2)


def test_the_corpus_chunked_model_runs_one_call_per_op():
    """(In bf16 weights its compressed and selected softmaxes run in bf16 and stay eager: the
    window alone is merged there.)"""
    model, x = chunked_queries.make()
    opt = optimized_with_parity(model, x)
    assert matches(opt)["query_chunks"] == 4
    for name in ("compressed_attention", "select_blocks", "selected_attention", "window_attention"):
        assert forward_calls(opt, name) == 1, name
    assert forward_calls(opt, "gated_combine") == 4  # the gate stays per chunk (not an attention op)


class DirectChunks(nn.Module):
    """nsa.window_attention called on chunks of q [B, H, 64, D] directly: `spans` the chunks'
    rows, `offsets` their q_offset (default: the first row), `other_keys` the chunks from which on
    the keys are another tensor's."""

    def __init__(self, spans, offsets=None, other_keys=None, prefixes=False, written=False, spelling="slice"):
        super().__init__()
        self.spans, self.offsets, self.other_keys = spans, offsets or [s0 for s0, _ in spans], other_keys
        self.prefixes, self.written, self.spelling = prefixes, written, spelling

    def forward(self, q, k, v):
        outs = []
        if self.written:  # K written in place after the first chunk's call: the chunks read other keys
            k = k.clone()
        for i, ((s0, s1), off) in enumerate(zip(self.spans, self.offsets)):
            if self.written and i == 1:
                k.mul_(2)
            keys, values = (k * 2 if self.other_keys is not None and i >= self.other_keys else k), v
            if self.prefixes:  # each chunk's own view of K and V (after the previous chunk's call), cut at its end
                keys, values = (x.transpose(2, 3).transpose(2, 3)[:, :, :s1] for x in (keys, values))
            rows = {"slice": lambda: q[:, :, s0:s1], "ellipsis": lambda: q[..., s0:s1, :],
                    "narrow": lambda: q.narrow(2, s0, s1 - s0)}[self.spelling]()
            outs.append(torch.ops.nsa.window_attention(rows, keys, values, 16, 0.25, "reference", None, off)[0])
        return torch.cat(outs, dim=2)


def run_direct(model) -> tuple:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 64, 8), torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8)
    opt = optimize_fresh(copy.deepcopy(model), FAST)  # optimize compiles in place: `model` stays eager
    torch.testing.assert_close(opt(q, k, v), model(q, k, v), **CHUNK_TOL[torch.float32])
    return opt


@pytest.mark.parametrize("spelling", ["slice", "ellipsis", "narrow"])
def test_direct_chunks_covering_the_rows_merge(spelling):
    """The chunks cut as q[:, :, s0:s1], q[..., s0:s1, :] or q.narrow(2, s0, n), as the branch passes
    read them (compressed_attention.query_rows)."""
    opt = run_direct(DirectChunks([(0, 20), (20, 41), (41, 64)], spelling=spelling))
    assert matches(opt)["query_chunks"] == 1
    before, after = code_around(opt, "query_chunks")
    assert (calls_in(before, "window_attention"), calls_in(after, "window_attention")) == (3, 1)


def test_chunks_reading_their_own_prefix_of_k_merge():
    """Each chunk reads K and V through its own views, cut after its last query: the same values as
    the whole K and V for the chunk; the merged call reads copies of the last chunk's views made
    before the first chunk's call (the chunks' views are gone with their calls)."""
    opt = run_direct(DirectChunks([(0, 20), (20, 41), (41, 64)], prefixes=True))
    assert matches(opt)["query_chunks"] == 1
    before, after = code_around(opt, "query_chunks")
    assert (calls_in(before, "window_attention"), calls_in(after, "window_attention")) == (3, 1)
    assert (before.count("transpose("), after.count("transpose(")) == (12, 4)  # K's and V's: 2 x 2 per chunk, 2 x 2


@pytest.mark.parametrize("model, reason", [
    (DirectChunks([(0, 32), (40, 64)]), "2 nsa.window_attention calls over rows of l_q_: rows [32, 40) are in no chunk"),
    (DirectChunks([(0, 40), (32, 64)]), "2 nsa.window_attention calls over rows of l_q_: chunks overlap at rows [32, 40)"),
    (DirectChunks([(0, 32), (32, 64)], offsets=[0, 31]),
     "2 nsa.window_attention calls over rows of l_q_: window_attention_1's q_offset 31 is not its first row 32"),
    (DirectChunks([(0, 32), (32, 64)], other_keys=1),
     "1 nsa.window_attention calls over rows of l_q_ (and 1 with other arguments): rows [32, 64) are in no chunk"),
    (DirectChunks([(0, 32), (32, 64)], written=True),
     "2 nsa.window_attention calls over rows of l_q_: k is written in place between the chunks' calls (mul_)"),
], ids=["gap", "overlap", "offset", "other-keys", "written"])
def test_near_misses_are_refused_with_the_graph_unchanged(model, reason):
    opt = run_direct(model)
    assert matches(opt)["query_chunks"] == 0
    before, after = code_around(opt, "query_chunks")
    assert before == after
    assert reason in reasons(opt, "query_chunks"), reasons(opt, "query_chunks")


def test_chunks_under_autocast_casts_merge():
    """CUDA autocast's casts written out (test_query_offset's ChunkedBranches(casts=True)): each
    chunk's q slice is cast, and K and V get a bf16 copy per chunk; the chunks' copies are the same
    computation of the same tensors, so the calls still merge; eager's outputs and gradients."""
    torch.manual_seed(0)
    model, x = ChunkedBranches(casts=True), torch.randn(2, 61, 32)
    opt = optimize_fresh(copy.deepcopy(model), FAST)
    for m in (model, opt):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
    tol = CHUNK_TOL[torch.bfloat16]
    torch.testing.assert_close(opt(x), model(x), **tol)
    for (name, p), (_, p_opt) in zip(model.named_parameters(), opt.named_parameters()):
        torch.testing.assert_close(p_opt.grad, p.grad, **tol, msg=name)
    assert matches(opt)["query_chunks"] == 3, nsa_compile.report(opt)
    for name in OFFSET_AT:
        assert offsets_of(opt, name) == [0], name
