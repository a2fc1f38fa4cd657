"""The varlen verify of the selected branch compares the model's mask with nsa.selected_attention's
visibility per document (`VarlenSelected.first_difference`: the queries of one document start, a
few rows at a time, against the block mask over their document's keys; every other key must be
hidden), not by building the [G, T, T, n] full-width test. The oracle is that full-width test as
the pass wrote it before: the first (head, query, key) where keep differs from it, in that order.

Each comparison runs on masks equal to the oracle's visibility (no difference) and on the same
masks with elements flipped inside a document's block columns, outside its columns (another
document's keys, a key after the query) and on several heads at once: the first difference must
be the oracle's. The packings hold documents longer than the row chunk, documents shorter than a
block, and invalid positions (pos[t] > t, negative), for which both give the same formula. The
varlen compressed probe (`varlen_windows`) draws its noise on the perturbed tokens only: its
refusals are the near misses of tests/test_varlen_3d.py, run as before.
"""

from __future__ import annotations

import pytest
import torch
import helpers
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.passes.selected_attention import VarlenSelected

PACKINGS = [[7, 3, 100, 1, 39], [150], [1] * 150, [60, 2, 88]]
S = 150


def full_width_visibility(chosen: torch.Tensor, pos: torch.Tensor, block: int, h: int) -> torch.Tensor:
    """The op's visibility [H, T, T] for ids chosen [G, T, n] on positions pos [T], every (query,
    key, id) at once (the pass's former test, O(G * T^2 * n))."""
    T = pos.shape[0]
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    offset = s - (t - pos[:, None])
    picked = chosen[:, :, None, :] >= 0
    in_block = (offset[None, :, :, None] // block == chosen[:, :, None, :]) & (offset >= 0)[None, :, :, None]
    return ((in_block & picked).any(-1) & (s <= t)[None]).repeat_interleave(h, 0)


def first_of(keep: torch.Tensor, want: torch.Tensor):
    diff = (keep != want).nonzero()
    return tuple(int(x) for x in diff[0]) if len(diff) else None


def positions(case: str) -> torch.Tensor:
    if case == "invalid":  # any int64 (pos[t] > t, negative, past T)
        return torch.randint(-3, S + 4, (S,), generator=torch.Generator().manual_seed(3))
    return helpers.packed_positions([PACKINGS[int(case)]])[0]


def ids_for(pos: torch.Tensor, G: int, block: int, n: int, seed: int) -> torch.Tensor:
    """[G, T, n] ids as the pass draws them (probe_ids), or for invalid positions any ids in
    [-1, T // block] (blocks past a document's keys included)."""
    gen = torch.Generator().manual_seed(seed)
    if bool((pos < 0).any()) or bool((pos > torch.arange(pos.shape[0])).any()):
        return torch.randint(-1, pos.shape[0] // block + 2, (G, pos.shape[0], n), generator=gen)
    return VarlenSelected.probe_ids(pos[None], G, block, n, gen)[0]


CASES = ["0", "1", "2", "3", "invalid"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block, n, rows", [(8, 4, 16), (16, 3, 7), (8, 4, 256)])
def test_first_difference_is_the_full_width_tests(case, block, n, rows):
    G, h = 2, 3
    pos = positions(case)
    chosen = ids_for(pos, G, block, n, seed=block + n)
    want = full_width_visibility(chosen, pos, block, h)
    assert VarlenSelected.first_difference(want.clone(), chosen, pos, block, rows) is None
    gen = torch.Generator().manual_seed(rows)
    T = pos.shape[0]
    flips = [
        # a random element anywhere, then one on a later head only (the head order decides)
        [(int(torch.randint(G * h, (1,), generator=gen)), int(torch.randint(T, (1,), generator=gen)),
          int(torch.randint(T, (1,), generator=gen)))],
        [(G * h - 1, T - 1, 0), (G * h - 1, T // 2, T // 2)],
        [(1, T - 1, T - 1), (0, T - 1, T - 2)],  # the diagonal (s = t), then the key just before it
    ]
    visible = want.nonzero()
    if len(visible):  # a key of the query's own document hidden: inside the compared columns
        flips.append([tuple(int(x) for x in visible[len(visible) // 2])])
    hidden_after = [(0, t, t + 1) for t in range(T - 1)]
    flips.append(hidden_after[len(hidden_after) // 3 : len(hidden_after) // 3 + 1])  # a key after its query
    for flip in flips:
        keep = want.clone()
        for head, query, key in flip:
            keep[head, query, key] = ~keep[head, query, key]
        expected = first_of(keep, want)
        assert expected is not None
        assert VarlenSelected.first_difference(keep, chosen, pos, block, rows) == expected, flip
        for step in (5, 64):  # chunks of rows (row0: keep's first row), the first over all of them
            per_chunk = [VarlenSelected.first_difference(keep[:, r0:r0 + step], chosen, pos, block, rows, row0=r0)
                         for r0 in range(0, T, step)]
            assert min(d for d in per_chunk if d is not None) == expected, (flip, step)
    for step in (5, 64):
        assert all(VarlenSelected.first_difference(want[:, r0:r0 + step], chosen, pos, block, rows, row0=r0) is None
                   for r0 in range(0, T, step))


def test_first_difference_sees_another_documents_key():
    """A key of the previous document shown to a query (a mask that crosses documents), and a
    block one token late: named where the full-width test names them."""
    G, h, block, n = 2, 3, 8, 4
    pos = positions("0")
    chosen = ids_for(pos, G, block, n, seed=1)
    want = full_width_visibility(chosen, pos, block, h)
    crossed = want.clone()
    crossed[:, 120, 5] = True  # query 120 (document [10, 110) ended) sees token 5 of the first document
    assert VarlenSelected.first_difference(crossed, chosen, pos, block, 16) == (0, 120, 5) == first_of(crossed, want)
    late = torch.zeros_like(want)  # every chosen block read one token late
    late[:, :, 1:] = want[:, :, :-1]
    late &= torch.ones(S, S, dtype=torch.bool).tril()
    got = VarlenSelected.first_difference(late, chosen, pos, block, 16)
    assert got is not None and got == first_of(late, want)


# --- the compressed probe's token layout ------------------------------------------------------------


def test_token_layout_keeps_the_values_and_falls_back_to_contiguous():
    """`token_layout` hands the probe region the same token values, contiguous or with the token
    dim innermost in memory; a region that fails on the second (a view of contiguous tokens only)
    or gives other values keeps the contiguous layout and its base value."""
    from nsa_compile.attention_match import Refused
    from nsa_compile.passes.compressed_attention import token_layout

    tokens = torch.randn(64, 2, 8, dtype=torch.float64)
    source = object()

    def pool(values):  # [N, G * D]: means of 8 tokens at stride 4 (the avg_pool1d of a transposed view)
        x = values[source]
        return torch.nn.functional.avg_pool1d(x.flatten(1).t()[None], 8, 4)[0].t()

    laid, base = token_layout(tokens, pool, {}, source)
    assert torch.equal(laid, tokens) and torch.allclose(base, pool({source: tokens}), rtol=1e-12, atol=0)

    def contiguous_only(values):
        x = values[source]
        if not x.is_contiguous():
            raise Refused("evaluating the compressed keys on probe values failed at view (RuntimeError)")
        return pool(values)

    laid, base = token_layout(tokens, contiguous_only, {}, source)
    assert laid.is_contiguous() and torch.equal(laid, tokens) and torch.equal(base, pool({source: tokens}))

    def by_layout(values):  # a region whose values depend on the layout (a stride read): contiguous kept
        x = values[source]
        return pool(values) + (0 if x.is_contiguous() else 1)

    laid, base = token_layout(tokens, by_layout, {}, source)
    assert laid.is_contiguous() and torch.equal(base, pool({source: tokens}))
