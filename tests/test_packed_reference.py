"""The packed (pos) reference backends of nsa::compressed_attention and nsa::select_blocks read,
per query chunk, only the slots that are blocks of its rows' documents (`compressed.
document_chunks`: from the earliest document start among its rows to its last row's last slot)
and rank only the blocks up to its largest document position (`block_select.packed_chunks`).

The oracle is the same code at full width: the chunk helper patched to give every chunk the slot
columns it read before (compressed: the prefix [0, hi) its last row can see; select_blocks: all
Tc slots and all Ns blocks). select_blocks' ids must be equal (torch.equal: the columns left out
are exactly 0 and the blocks left out exactly -inf on each row of the chunk; every kept element
is computed as before). The compressed outputs are sums over fewer columns: the same terms, added
in another order (the softmax's sum, p @ v, the gradients' matmuls), so they are compared within
the dtype's rounding (torch.testing's defaults), not bit for bit: on the CPU float32 and float64
differ in the last bits. Each comparison is paired with mutations of the chunks (a column that
matters dropped, or the last block) that the same comparison catches: the packings hold documents
that span several chunks, so the blocks a row sees sit at a chunk's lower bound.
"""

from __future__ import annotations

import pytest
import torch
import helpers
from oracles import LargestTensor
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.ops import block_select as bs_mod
from nsa_compile.ops import compressed as cmp_mod

# per batch row: odd lengths, documents shorter than l (1, 3, 7), one longer than a chunk (100),
# and a second row with other boundaries
PACKINGS = [[7, 3, 100, 1, 39], [60, 2, 88]]
S = 150
GEOMETRIES = [(8, 4, 8), (16, 8, 16)]  # (l, d, l'): xunhaolai's, the op tests'
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def packed_positions() -> torch.Tensor:
    return helpers.packed_positions(PACKINGS)  # [2, S]


def invalid_positions() -> torch.Tensor:
    """Any int64 [2, S] (pos[t] > t, negative, past S): the references compute their formulas for
    these too."""
    return torch.randint(-3, S + 4, (2, S), generator=torch.Generator().manual_seed(3))


def case(l, dtype, seed, G=2, h=3, Dk=16):
    """q [B, H, S, Dk], slot keys and values [B, G, S - l + 1, Dk], an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    B, Tc = len(PACKINGS), S - l + 1
    q, k, v, g = (torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
                  for shape in ((B, G * h, S, Dk), (B, G, Tc, Dk), (B, G, Tc, Dk), (B, G * h, S, Dk)))
    return q, k, v, g


def lse_of(q, k, l, d, scale, pos):
    """The log-sum-exp [B, H, S] float32 of the packed-visible scores (the eager formula)."""
    h = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(h, 1).transpose(-1, -2)).double() * scale
    visible = helpers.packed_slot_visibility(S, k.shape[2], pos, l, d)
    return torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1).float()


# chunk sizes: the budget's greedy rows (a small budget: several chunks), MIN_ROWS small enough for
# document ends to cut chunks, one row per chunk, fixed rows not aligned with anything
CHUNKINGS = {"budget": dict(budget=6 * 40 * 30), "document_cuts": dict(budget=6 * 40 * 30, min_rows=8),
             "one_row": dict(budget=1), "rows_13": dict(rows=13)}


def chunking(monkeypatch, budget=None, min_rows=None, rows=None) -> None:
    if budget is not None:
        monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", budget)
        monkeypatch.setattr(cmp_mod, "REFERENCE_BUDGET", budget)
    if min_rows is not None:
        monkeypatch.setattr(cmp_mod, "MIN_ROWS", min_rows)
    if rows is not None:
        monkeypatch.setattr(cmp_mod, "REFERENCE_CHUNK", rows)


def patched(monkeypatch, module, name, change):
    """module.name's chunks, each passed through change(chunk) -> chunk; returns the list of the
    original chunks, filled as the op runs."""
    original, seen = getattr(module, name), []

    def chunks(*args, **kwargs):
        for chunk in original(*args, **kwargs):
            seen.append(chunk)
            yield change(chunk)

    monkeypatch.setattr(module, name, chunks)
    return seen


# --- the chunks themselves: every visible slot and every block that can be ranked is inside -------


@pytest.mark.parametrize("name", CHUNKINGS)
@pytest.mark.parametrize("positions", [packed_positions, invalid_positions])
def test_chunks_hold_every_slot_a_row_sees_and_every_block_it_can_rank(monkeypatch, name, positions):
    chunking(monkeypatch, **CHUNKINGS[name])
    pos, (l, d, ls), n, Dk = positions(), (8, 4, 8), 4, 16
    Tc, Ns = S - l + 1, -(-S // ls)
    visible = helpers.packed_slot_visibility(S, Tc, pos, l, d)[:, 0]  # [B, S, Tc]
    budget = bs_mod.REFERENCE_BUDGET
    chunks = list(bs_mod.packed_chunks(pos, l, d, Tc, ls, Ns, 2 * 6, max(n, Dk), budget))
    assert [t0 for t0, *_ in chunks] == [0] + [t1 for _, t1, *_ in chunks[:-1]] and chunks[-1][1] == S
    for t0, t1, cols, nb in chunks:
        slots = visible[:, t0:t1].any(0).any(0).nonzero().flatten()  # the slots some row of the chunk sees
        assert set(slots.tolist()) <= set(cols.tolist()) and torch.equal(cols, cols.unique()), (t0, t1)
        top = int(pos[:, t0:t1].max()) // ls  # forced blocks 0, pos // l', pos // l' - 1; candidates j*l' <= pos
        assert min(max(0, top), Ns - 1) < nb <= Ns, (t0, t1, nb)  # (a position past S: all Ns blocks)
        if name != "rows_13" and t1 - t0 > 1:  # the budget is kept, but for a single row
            assert 2 * 6 * (t1 - t0) * max(len(cols), nb, n, Dk) <= budget
    if positions is packed_positions and name != "one_row":  # slots (before the documents, and
        # not blocks) and blocks are left out
        assert any(len(cols) < int(cols.max()) + 1 for _, _, cols, _ in chunks if len(cols))
        assert any(int(cols.min()) > 0 for _, _, cols, _ in chunks if len(cols)) and any(nb < Ns for *_, nb in chunks)


def test_a_chunk_reads_its_documents_blocks_not_the_row():
    """Work (elements of q @ k^T per head) on one row of documents (the seed geometry: 12 heads,
    l 32, d 16, head dim 64): about what the rows see (a quarter more, and the chunks' first
    MIN_ROWS rows): a d-th of the slots of their documents, so far below the S * Tc / 2 of the
    full width even for one document."""
    for lengths, below in (([4096], 12), ([2048, 2048], 24), ([64] * 64, 100), ([5] * 819 + [1], 1000)):
        pos = helpers.packed_positions([lengths])
        T, l, d = pos.shape[1], 32, 16
        chunks = list(cmp_mod.document_chunks(pos, l, d, T - l + 1, 12, 2**25, floor=64))
        read = sum((t1 - t0) * len(cols) for t0, t1, cols in chunks)
        seen = int(helpers.packed_slot_visibility(T, T - l + 1, pos, l, d).sum())
        assert read <= 1.25 * seen + T * cmp_mod.MIN_ROWS / d and read < T * T / 2 / below, (lengths[:2], read, seen)


# --- select_blocks: the ids exactly those of the full width ----------------------------------------


def full_width(Tc: int, Ns: int):
    """A change of packed_chunks' chunks: all Tc slot columns and all Ns blocks (the code before)."""
    return lambda chunk: (chunk[0], chunk[1], torch.arange(Tc), Ns)


# the mutations: the chunk's second and third columns dropped (its first is the block at the earliest
# document's start, which overlaps selection block 0 only, a forced one; the next ones overlap
# block 1), or its last block
SELECT_DROPS = {"columns": lambda c: (c[0], c[1], torch.cat([c[2][:1], c[2][3:]]), c[3]),
                "block": lambda c: (*c[:3], max(1, c[3] - 1))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("name", ["budget", "document_cuts", "one_row"])
def test_select_blocks_ids_are_those_of_the_full_width(monkeypatch, dtype, geometry, name):
    (l, d, ls), n, scale = geometry, 4, 0.3
    chunking(monkeypatch, **CHUNKINGS[name])
    for positions, seed in ((packed_positions, 0), (invalid_positions, 1)):
        pos = positions()
        q, k, _, _ = case(l, dtype, seed)
        lse = lse_of(q, k, l, d, scale, pos)
        got = bs_mod._reference_packed(q, k, lse, l, d, ls, n, scale, pos)
        with monkeypatch.context() as m:
            seen = patched(m, bs_mod, "packed_chunks", full_width(k.shape[2], -(-S // ls)))
            want = bs_mod._reference_packed(q, k, lse, l, d, ls, n, scale, pos)
        assert torch.equal(got, want), (positions.__name__, (got != want).nonzero()[:3].tolist())
        assert len(seen) > 1  # several chunks
        if positions is packed_positions:
            assert any(len(cols) and cols[0] > 0 for _, _, cols, _ in seen) and any(nb < -(-S // ls) for *_, nb in seen)
            for what, drop in SELECT_DROPS.items():
                with monkeypatch.context() as m:
                    patched(m, bs_mod, "packed_chunks", drop)
                    dropped = bs_mod._reference_packed(q, k, lse, l, d, ls, n, scale, pos)
                assert not torch.equal(dropped, want), what


def test_select_blocks_rounded_importance_ids_are_those_of_the_full_width(monkeypatch):
    """importance_dtype bf16 with group_sum_dtype float32 (CUDA autocast's): the same ids."""
    (l, d, ls), n, scale = GEOMETRIES[0], 4, 0.3
    chunking(monkeypatch, **CHUNKINGS["document_cuts"])
    pos = packed_positions()
    q, k, _, _ = case(l, torch.bfloat16, 2)
    lse = lse_of(q, k, l, d, scale, pos)
    rounding = dict(importance_dtype=torch.bfloat16, group_sum_dtype=torch.float32)
    got = bs_mod._reference_packed(q, k, lse, l, d, ls, n, scale, pos, **rounding)
    patched(monkeypatch, bs_mod, "packed_chunks", full_width(k.shape[2], -(-S // ls)))
    assert torch.equal(got, bs_mod._reference_packed(q, k, lse, l, d, ls, n, scale, pos, **rounding))


# --- compressed_attention: the outputs within rounding of the full width ---------------------------


def prefix(block: int, Tc: int):
    """A change of document_chunks' chunks: every slot up to the last one the chunk's last row can
    see, [0, hi) (the code before)."""
    return lambda chunk: (chunk[0], chunk[1], torch.arange(min(Tc, max(0, chunk[1] - block + 1))))


def compressed_both(q, k, v, g, l, d, scale, pos):
    o, lse = cmp_mod._reference_forward(q, k, v, l, d, scale, pos=pos)
    return (o, lse, *cmp_mod._reference_backward(g, q, k, v, l, d, scale, pos=pos))


NAMES = ("o", "lse", "dq", "dk", "dv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("name", ["budget", "document_cuts", "rows_13"])
def test_compressed_outputs_are_those_of_the_full_width_within_rounding(monkeypatch, dtype, geometry, name):
    (l, d, ls), scale = geometry, 0.3
    chunking(monkeypatch, **CHUNKINGS[name])
    for positions, seed in ((packed_positions, 4), (invalid_positions, 5)):
        pos = positions()
        q, k, v, g = case(l, dtype, seed)
        got = compressed_both(q, k, v, g, l, d, scale, pos)
        with monkeypatch.context() as m:
            seen = patched(m, cmp_mod, "document_chunks", prefix(l, k.shape[2]))
            want = compressed_both(q, k, v, g, l, d, scale, pos)
        for name_, a, b in zip(NAMES, got, want):
            torch.testing.assert_close(a, b, msg=lambda m, name_=name_: f"{positions.__name__} {name_}: {m}")
        # the ids chosen from either lse: equal
        ids = [bs_mod._reference_packed(q, k, lse, l, d, ls, 4, scale, pos) for lse in (got[1], want[1])]
        assert torch.equal(*ids)
        assert len(seen) > 2
        if positions is packed_positions:
            assert any(len(cols) and cols[0] > 0 for _, _, cols in seen)
            with monkeypatch.context() as m:  # the mutation: the chunk's first column dropped
                patched(m, cmp_mod, "document_chunks", lambda c: (c[0], c[1], c[2][1:]))
                dropped = compressed_both(q, k, v, g, l, d, scale, pos)
            with pytest.raises(AssertionError):
                for a, b in zip(dropped, want):
                    torch.testing.assert_close(a, b)


def test_compressed_memory_follows_the_chunk_columns(monkeypatch):
    """With a budget of a few rows of the widest document per chunk, no tensor the packed forward
    and backward compute is larger than the budget or the outputs."""
    l, d = 8, 4
    pos = packed_positions()
    q, k, v, g = case(l, torch.float32, 6)
    B, H, _, Dk = q.shape
    budget = B * H * 100 * 8
    chunking(monkeypatch, budget=budget)
    spy = LargestTensor()
    with spy:
        compressed_both(q, k, v, g, l, d, 0.3, pos)
    assert spy.max_numel <= max(budget, B * H * S * Dk) < B * H * S * k.shape[2] // 2
