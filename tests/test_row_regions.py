"""nsa_compile/row_regions.py: a written region run for chunks of query rows gives, row for row,
what it gives whole, and refuses what the chunks cannot carry."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

from nsa_compile.attention_match import Refused
from nsa_compile.row_regions import RowRegion, Rows

G, h, T, n, BLOCK, D, N = 2, 2, 40, 3, 4, 8, 9
DOCS = ((0, 13), (13, 31), (31, 40))


def varlen_region(ids, q, k):
    """xunhaolai's idioms over packed tokens: a dense [H, T, T] mask assembled from per-document
    writes of scattered block ids, tril and the heads' repeat; scores over N keys masked by
    per-document prefixes, softmax, the group sum; a choice per document with strided sums, a bool
    index write and a topk."""
    mask = torch.zeros(G, T, T, dtype=torch.bool)
    for a, b in DOCS:
        blocks = -(-(b - a) // BLOCK)
        idx = ids[:, a:b].clamp(min=0)
        picked = torch.zeros(G, b - a, blocks, dtype=torch.bool).scatter(-1, idx.clamp(max=blocks - 1), True)
        mask[:, a:b, a:b] = picked.repeat_interleave(BLOCK, dim=-1)[..., : b - a]
    keep = torch.tril(mask).repeat_interleave(h, 0)  # [H, T, T]
    visible = torch.zeros((T, N), dtype=torch.bool)
    for i, (a, b) in enumerate(DOCS):
        t = torch.arange(b - a)
        visible[a:b, 3 * i: 3 * i + 3] = t[:, None] >= torch.arange(3)[None, :] * 4
    s = (q @ k.transpose(-1, -2)) * 0.5  # [H, T, N]
    s = s.masked_fill(~visible[None, ...], float("-inf")).softmax(dim=-1).nan_to_num(0)
    score = s.view(G, h, T, N).sum(1)  # [G, T, N]
    block = torch.zeros(G, T, 4)
    block[..., :3] += 2 * torch.nn.functional.pad(score, (1, 1))[..., 0::3][..., :3]
    q_idx = torch.cat([torch.arange(b - a) for a, b in DOCS]) // BLOCK
    block[(q_idx[:, None] == torch.arange(4)[None, :]).unsqueeze(0).expand(G, -1, -1)] = float("inf")
    top = block.topk(2, dim=-1).indices.sort(-1).values
    top[top > q_idx[None, :, None]] = -1
    return keep, s, top


def traced():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(-1, 5, (G, T, n))
    q, k = torch.randn(G * h, T, D), torch.randn(G * h, N, D)
    torch._dynamo.reset()
    torch.compile(varlen_region, backend=capture, fullgraph=True)(ids, q, k)
    (gm,) = graphs
    by_name = {node.name: node for node in gm.graph.nodes if node.op == "placeholder"}
    leaves = [by_name["l_ids_"], by_name["l_q_"], by_name["l_k_"]]  # Dynamo orders them by first use
    region = [node for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    return gm, leaves, region, outputs


def whole(region, leaves, inputs):
    from nsa_compile.attention_match import evaluate_node

    env = dict(zip(leaves, inputs))
    for node in region:
        env[node] = evaluate_node(node, env, "whole")
    return env


@pytest.mark.parametrize("rows", [1, 5, 13, T])
def test_chunks_of_rows_give_the_whole_region_row_for_row(rows):
    gm, leaves, region, outputs = traced()
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(-1, 5, (G, T, n), generator=g)
    q, k = torch.randn(G * h, T, D, generator=g), torch.randn(G * h, N, D, generator=g)
    want = whole(region, leaves, (ids, q, k))
    ids_leaf, q_leaf, k_leaf = leaves
    chunked = RowRegion(region, T, {ids_leaf: 1, q_leaf: 1}, "the test region")
    got = {out: [] for out in outputs}
    for r0 in range(0, T, rows):
        env = chunked.run(r0, min(T, r0 + rows), {ids_leaf: ids, q_leaf: q, k_leaf: k}, keep=set(outputs))
        for out in outputs:
            value = env[out]
            assert isinstance(value, Rows) and (value.a, value.b, value.lo) == (0, T, r0), out.name
            got[out].append(value.t.movedim(value.dim, 0))
    for out in outputs:  # a matmul over fewer rows may add in another order: floats to rounding, the rest exact
        have, expected = torch.cat(got[out]), want[out].movedim(1, 0)
        if expected.is_floating_point():
            torch.testing.assert_close(have, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(have, expected), out.name


def test_rows_per_chunk_bounds_the_widest_node():
    _, leaves, region, _ = traced()
    chunked = RowRegion(region, T, {leaves[0]: 1, leaves[1]: 1}, "the test region")
    assert chunked.rows_per_chunk(G * h * T * 5) == 5  # the [H, T, T] mask: H * T elements a row
    assert chunked.rows_per_chunk(1) == 1


def along_rows(ids, q, k):
    return ids.cumsum(1)  # a running sum over the rows: row t reads rows before it


def across_rows(ids, q, k):
    return ids.reshape(G, T * n)[:, :5]


@pytest.mark.parametrize("fn, why", [(along_rows, "(cumsum) works along the row dim"),
                                     (across_rows, "(reshape) reshapes (2, 40, 3) to (2, 120) across the row dim")])
def test_what_the_chunks_cannot_carry_is_refused_with_the_node(fn, why):
    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(
        torch.zeros(G, T, n, dtype=torch.long), torch.zeros(G * h, T, D), torch.zeros(G * h, N, D))
    (gm,) = graphs
    ids = next(node for node in gm.graph.nodes if node.name == "l_ids_")
    region = [node for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    chunked = RowRegion(region, T, {ids: 1}, "the test region")
    with pytest.raises(Refused, match=rf"the test region is not verified in row chunks: \w+ {re.escape(why)}"):
        chunked.run(0, 8, {ids: torch.zeros(G, T, n, dtype=torch.long)})


def positions_only(ids, q, k):
    t = torch.arange(T)
    return (t[:, None] >= t[None, :]) & (ids[..., :1] >= 0)  # a [T, T] causal mask, then rows of the ids


def test_a_large_mask_of_positions_alone_is_made_in_rows(monkeypatch):
    """An element-wise product of position vectors alone ([T, 1] >= [1, T]) larger than a chunk
    is itself computed in rows (at T 65,536 it would be 4.3e9 elements whole)."""
    from nsa_compile import row_regions

    monkeypatch.setattr(row_regions, "CHUNK_ELEMENTS", T * T - 1)
    graphs = []
    torch._dynamo.reset()
    ids = torch.randint(-1, 5, (G, T, n), generator=torch.Generator().manual_seed(2))
    torch.compile(positions_only, backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(
        ids, torch.zeros(G * h, T, D), torch.zeros(G * h, N, D))
    (gm,) = graphs
    leaf = next(node for node in gm.graph.nodes if node.name == "l_ids_")
    region = [node for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    causal = next(node for node in region if node.target is __import__("operator").ge and node.args[0].op != "placeholder"
                  and "ids" not in node.args[0].name)
    out = next(node for node in gm.graph.nodes if node.op == "output").args[0][0]
    want = positions_only(ids, None, None)
    chunked = RowRegion(region, T, {leaf: 1}, "the test region")
    for r0 in range(0, T, 7):
        env = chunked.run(r0, min(T, r0 + 7), {leaf: ids}, keep={causal, out})
        assert isinstance(env[causal], Rows) and env[causal].t.shape == (min(T, r0 + 7) - r0, T)
        assert torch.equal(env[out].t, want[:, r0:r0 + 7])
