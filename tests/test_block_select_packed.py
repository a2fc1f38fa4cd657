"""nsa::select_blocks with packed documents (pos) against the eager packed
`NSAAttention.select_blocks(p_cmp, S, pos)` of models/nsa.py, on p_cmp and lse built with the
eager packed formulas (a slot per token, visible per document; PACKED documents in models/nsa.py).

The choice must be eager's exactly: document-relative block ids, ascending, -1 padded, ties to
the lower block, in documents shorter than l and l' too. (The op computes exp(s - lse) where
eager takes a softmax, so a near tie, within ~1e-6 relative, could in principle go the other way;
`near_ties` names any such row, and the cases here have none.) The packings vary per batch row
and hold documents of 1 and 2 tokens, shorter than l, than l', of lengths that are not multiples
of d, longer than n * l', and documents starting on selection-block boundaries and just off them.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import helpers
from oracles import LargestTensor, assert_raises_eager_and_fake, upcast
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.models.config import ModelConfig
from nsa_compile.models.nsa import NSAAttention
from nsa_compile.ops import block_select as bs_mod
from nsa_compile.ops import select_blocks

L, D, LS = 16, 8, 16  # l, d, l' (as tests/test_block_select_op.py)
S = 100  # 7 selection blocks a row
# document lengths per batch row: 1, 2, < l, < l', not multiples of d, > n * l', starting on a
# selection-block boundary (16, 32, 48) and just off one (17, 33), one document for the whole row
PACKINGS = [[13, 40, 1, 6, 30, 10], [100], [16, 16, 2, 15, 51], [17, 16, 67], [7, 83, 10]]
GEOMETRIES = [(L, D, LS), (32, 8, 16), (12, 4, 12), (8, 8, 16), (12, 8, 16), (16, 8, 12)]


def packed_positions(packings=PACKINGS) -> torch.Tensor:
    return helpers.packed_positions(packings)  # [B, S]


# --- the eager side --------------------------------------------------------------------------------


@functools.cache
def eager_module(H, G, Dk, l, d, ls, n):
    """An NSAAttention with (l, d, l', n). ModelConfig wants d to divide l and l', and n >= 3; the op
    does not: for other values the fields select_blocks reads (only they) are set directly."""
    if l % d == 0 and ls % d == 0 and n >= 3:
        return NSAAttention(ModelConfig(dim=8, n_heads=H, n_kv_groups=G, head_dim=Dk, cmp_block=l, cmp_stride=d,
                                        sel_block=ls, n_selected=n))  # fmt: skip
    attn = NSAAttention(ModelConfig(dim=8, n_heads=H, n_kv_groups=G, head_dim=Dk))
    attn.cfg = types.SimpleNamespace(cmp_block=l, cmp_stride=d, sel_block=ls, n_selected=n, n_kv_groups=G)
    return attn


def eager_p_cmp(q, k_slots, l, d, scale, pos):
    """p_cmp [B, H, S, Tc] and lse [B, H, S] float32 for q [B, H, S, Dk] and slot keys k_slots
    [B, G, Tc = S - l + 1, Dk]: the packed lines of models/nsa.py `compressed_attention` after the
    pooling, and the log-sum-exp of the same masked scores (-inf where no slot is visible)."""
    S, Tc = q.shape[2], k_slots.shape[2]
    h = q.shape[1] // k_slots.shape[1]
    scores = upcast(q @ k_slots.repeat_interleave(h, dim=1).transpose(-1, -2)) * scale  # [B, H, S, Tc]
    visible = helpers.packed_slot_visibility(S, Tc, pos, l, d)  # [B, 1, S, Tc]
    scores = scores.masked_fill(~visible, float("-inf"))
    has_block = visible.any(dim=-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible
    return p, torch.logsumexp(scores, dim=-1).float()


def eager_p_grp(p, S, G, l, ls, pos):
    """The packed importance [B, G, S, Ns] of models/nsa.py `select_blocks` (its first lines)."""
    B, H, _, Tc = p.shape
    j = torch.arange(-(-S // ls), device=p.device)[None, :]
    start = pos[:, :Tc, None]
    overlap = (torch.minimum(start + l, (j + 1) * ls) - torch.maximum(start, j * ls)).clamp(min=0).to(p.dtype) / l
    return (p @ overlap[:, None]).view(B, G, H // G, S, -1).sum(2)


def make_case(pos, G, h, Dk, dtype, seed, l=L, keys="random", device="cpu"):
    """q [B, H, S, Dk] (a view of [B, S, H, Dk] memory), slot keys [B, G, S - l + 1, Dk], scale.
    keys: 'random', 'zero' (uniform probabilities) or 'periodic' (a slot's key depends on its
    document position modulo l' only: every whole earlier selection block of a document sees the
    same probabilities, exact ties)."""
    B, S = pos.shape
    gen = torch.Generator().manual_seed(seed)
    Tc = max(0, S - l + 1)
    q = torch.randn(B, S, G * h, Dk, generator=gen)
    k = torch.randn(B, G, Tc, Dk, generator=gen)
    if keys == "zero":
        k = torch.zeros_like(k)
    elif keys == "periodic":
        base = torch.randn(B, G, LS, Dk, generator=gen)
        k = torch.gather(base, 2, (pos[:, None, :Tc, None] % LS).expand(B, G, Tc, Dk))
    return q.to(dtype).to(device).transpose(1, 2), k.to(dtype).to(device), Dk**-0.5


def eager(q, k, scale, n, pos, l=L, d=D, ls=LS):
    """(eager packed block_idx, eager p_grp, lse) for these inputs."""
    _, H, S, Dk = q.shape
    G = k.shape[1]
    p, lse = eager_p_cmp(q, k, l, d, scale, pos)
    idx = eager_module(H, G, Dk, l, d, ls, n).select_blocks(p, S, pos)
    return idx, eager_p_grp(p, S, G, l, ls, pos), lse


def near_ties(got, want, p_grp, tol=1e-6) -> int:
    """Rows where got and want differ; AssertionError unless each one swaps near-tied blocks."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int64
    rows = (got != want).any(-1).nonzero().tolist()
    for b, g, t in rows:
        ours, theirs = set(got[b, g, t].tolist()) - {-1}, set(want[b, g, t].tolist()) - {-1}
        where = f"row (b={b}, g={g}, t={t}): ours {sorted(ours)}, eager {sorted(theirs)}"
        assert len(ours - theirs) == len(theirs - ours) > 0, where
        hi, lo = p_grp[b, g, t, sorted(theirs - ours)].max().item(), p_grp[b, g, t, sorted(ours - theirs)].min().item()
        assert hi - lo <= tol * abs(hi), f"{where}: eager p_grp {hi!r} vs {lo!r} is no near tie"
    return len(rows)


# --- the reference backend against eager ------------------------------------------------------------


def test_test_formula_is_the_models_method():
    """eager_p_cmp on slot keys == NSAAttention.compressed_attention(q, k, v, pos)'s p on the tokens."""
    pos = packed_positions()
    B, G, h, Dk = pos.shape[0], 2, 3, 16
    attn = eager_module(G * h, G, Dk, L, D, LS, 5)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, G * h, Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, G, Dk, generator=gen, dtype=torch.float64)
    _, want = attn.compressed_attention(q, k, k, pos)
    k_slots = attn.compress(k, None, 1).transpose(1, 2)  # [B, G, S - l + 1, Dk]
    got, lse = eager_p_cmp(q.transpose(1, 2), k_slots, L, D, attn.scale, pos)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    # rows that see no slot (the first l - 1 tokens of each document) have lse = -inf
    assert torch.equal(lse.isneginf(), (pos < L - 1)[:, None].expand_as(lse))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_reference_matches_eager_exactly(dtype):
    pos = packed_positions()
    for (h, n), (l, d, ls) in zip([(1, 3), (3, 5), (4, 9), (2, 4), (3, 3), (2, 5)], GEOMETRIES):
        q, k, scale = make_case(pos, 2, h, 16, dtype, seed=l * 7 + h + n, l=l)
        want, p_grp, lse = eager(q, k, scale, n, pos, l, d, ls)
        got = select_blocks(q, k, lse, l, d, ls, n, scale, "reference", pos=pos)
        assert got.shape == (pos.shape[0], 2, S, n) and got.dtype == torch.int64 and got.is_contiguous()
        assert near_ties(got, want, p_grp) == 0, (l, d, ls)


def test_the_cases_tell_document_blocks_from_row_blocks():
    """Long documents off the block boundaries tell the near misses apart: the choice is sparse (not
    all candidates), -1 padded, numbered within documents, and counting the overlap from the row
    start (slot index in place of pos[s]) or the forced blocks from t (in place of pos[t]) changes
    it in many rows. The op gives eager's choice."""
    pos = packed_positions([[5, 95], [21, 79], [100], [37, 63]])  # long documents off the block boundaries
    q, k, scale = make_case(pos, 2, 3, 16, torch.float64, seed=3)
    want, p_grp, lse = eager(q, k, scale, 4, pos)
    t_doc = pos[:, None, :]  # [B, 1, S]
    candidates = t_doc // LS + 1
    chosen = (want >= 0).sum(-1)  # [B, G, S]
    assert torch.equal(chosen, candidates.clamp(max=4).expand_as(chosen))  # padded where few candidates
    assert (chosen < candidates).any() and (want == -1).any()
    assert (want.amax(-1) == (t_doc // LS)).all()  # the current block, by document position
    # overlap from the row start: slot i taken to start at document position i (not pos[i])
    p, _ = eager_p_cmp(q, k, L, D, scale, pos)
    i = torch.arange(k.shape[2])[:, None]
    j = torch.arange(-(-S // LS))[None, :]
    overlap = (torch.minimum(i + L, (j + 1) * LS) - torch.maximum(i, j * LS)).clamp(min=0).to(p.dtype) / L
    from_row_start = (p @ overlap).view(*want.shape[:2], 3, S, -1).sum(2)  # [B, G, S, Ns]
    ranked = bs_mod.rank_and_choose(from_row_start, pos[:, None, :, None], LS, 4)
    assert (ranked != want).any(-1).sum() > 20
    # forced and candidate blocks from t: unpacked ranking of the packed importance
    ranked = bs_mod.rank_and_choose(p_grp, torch.arange(S)[:, None], LS, 4)
    assert (ranked != want).any(-1).sum() > 20
    assert torch.equal(bs_mod.rank_and_choose(p_grp, pos[:, None, :, None], LS, 4), want)
    assert torch.equal(select_blocks(q, k, lse, L, D, LS, 4, scale, "reference", pos=pos), want)


def test_one_document_is_the_unpacked_op():
    """pos = 0..S-1: the packed op on the slots gives the unpacked op's choice on every d-th slot."""
    pos = torch.arange(S).expand(2, S).contiguous()
    for n in (3, 5):
        q, k, scale = make_case(pos, 2, 3, 16, torch.float32, seed=n)
        _, lse = eager_p_cmp(q, k, L, D, scale, pos)
        packed = select_blocks(q, k, lse, L, D, LS, n, scale, "reference", pos=pos)
        assert torch.equal(packed, select_blocks(q, k[:, :, ::D], lse, L, D, LS, n, scale, "reference"))


def test_short_sequences_and_documents():
    """S < l (no slot at all), S < l', and rows of documents all shorter than l (no row sees a slot:
    every importance is 0, the forced blocks then the candidates in ascending order)."""
    for lengths, n in (([10], 3), ([5, 5], 3), ([15], 5), ([20], 3), ([1], 3), ([7, 7, 7, 7, 7, 7, 7, 7], 4),
                       ([3, 30, 2, 15], 2)):  # fmt: skip
        pos = packed_positions([lengths, lengths[::-1]])
        q, k, scale = make_case(pos, 2, 3, 16, torch.float32, seed=len(lengths))
        want, _, lse = eager(q, k, scale, n, pos)
        got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference", pos=pos)
        assert torch.equal(got, want), lengths


def test_chunking_is_exact(monkeypatch):
    """A budget of a few rows per chunk (chunks not aligned with documents or blocks): the same result."""
    pos = packed_positions()
    q, k, scale = make_case(pos, 2, 3, 16, torch.float32, seed=7)
    want, p_grp, lse = eager(q, k, scale, 5, pos)
    full = select_blocks(q, k, lse, L, D, LS, 5, scale, "reference", pos=pos)
    assert near_ties(full, want, p_grp) == 0
    rows = pos.shape[0] * 6 * k.shape[2]
    for budget in (1, rows * 3, rows * 7):  # 1, 3 and 7 rows per chunk
        monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", budget)
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, 5, scale, "reference", pos=pos), full), budget


# --- exact ties ---------------------------------------------------------------------------------------


def assert_ties_matter(p_grp, pos, n):
    """Some row has more equal free candidates than free slots: the stable order decides."""
    j = torch.arange(p_grp.shape[-1])
    free = (j >= 1) & (j <= (pos // LS)[..., None] - 2)  # [B, S, Ns]: candidates that are not forced
    decided = False
    for b, t in (free.sum(-1) > n - 3).nonzero().tolist():
        vals = p_grp[b, 0, t][free[b, t]]
        decided |= bool((vals == vals.max()).sum() > n - 3)
    assert decided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("keys", ["zero", "periodic"])
def test_reference_breaks_exact_ties_like_eager(dtype, keys):
    pos = packed_positions()
    q, k, scale = make_case(pos, 2, 3, 16, dtype, seed=11, keys=keys)
    for n in (3, 4, 5):
        want, p_grp, lse = eager(q, k, scale, n, pos)
        assert_ties_matter(p_grp, pos, n)
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, n, scale, "reference", pos=pos), want), n


# --- backends and plumbing -------------------------------------------------------------------------------


def test_auto_takes_reference_with_pos_on_the_cpu_as_without():
    """The kernel takes pos (tests/test_block_select_op.py runs it); on the CPU auto takes
    reference with pos for the reason it does without."""
    pos = packed_positions()
    q, k, scale = make_case(pos, 2, 2, 16, torch.float32, seed=0)
    lse = torch.zeros(pos.shape[0], 4, S)
    args = (q, k, lse, L, D, LS, 5)
    assert bs_mod.choose_backend(*args, "auto", pos) == "reference"
    assert bs_mod.why_not_triton(*args, pos) == "the Triton kernel runs on CUDA (tensors on cpu)"


def test_opcheck():
    for lengths, h, n in (([13, 27], 3, 5), ([7], 1, 3), ([40, 2, 6], 2, 4)):
        pos = packed_positions([lengths, lengths[::-1]])
        q, k, scale = make_case(pos, 2, h, 16, torch.float32, seed=len(lengths))
        _, lse = eager_p_cmp(q, k, L, D, scale, pos)
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        torch.library.opcheck(torch.ops.nsa.select_blocks.default, (q, k, lse, L, D, LS, n, scale, "reference"),
                              {"pos": pos})
        assert not torch.ops.nsa.select_blocks(q, k, lse, L, D, LS, n, scale, pos=pos).requires_grad


def test_compile_fullgraph_with_pos():
    """Under torch.compile (aot_eager, fullgraph) the op takes pos through its fake and matches eager."""
    torch._dynamo.reset()
    pos = packed_positions()
    q, k, scale = make_case(pos, 2, 3, 16, torch.float32, seed=5)
    want, _, lse = eager(q, k, scale, 5, pos)

    def fn(q, k, lse, pos):
        return torch.ops.nsa.select_blocks(q, k, lse, L, D, LS, 5, scale, "auto", pos=pos) + 0

    assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, lse, pos), want)


def test_reference_memory_is_bounded_by_the_chunk(monkeypatch):
    """With a budget of B*H*Tc*4 elements (4 rows a chunk) no tensor the packed reference computes
    is larger than the budget or the output, far below eager's [B, H, S, Tc] probabilities (and no
    [B, Tc, Ns] overlap matrix: it would exceed the budget here)."""
    lengths = [300, 13, 411, 1, 299]
    pos = packed_positions([lengths])
    B, G, h, n, Tc = 1, 2, 4, 5, 1024 - L + 1
    q, k, scale = make_case(pos, G, h, 8, torch.float32, seed=2)
    want, p_grp, lse = eager(q, k, scale, n, pos)
    budget = B * G * h * Tc * 4
    monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", budget)
    spy = LargestTensor()
    with spy:
        got = bs_mod._reference_packed(q, k, lse, L, D, LS, n, scale, pos)
    assert spy.max_numel <= max(budget, B * G * 1024 * n) < min(B * G * h * 1024 * Tc // 100, B * Tc * 64)
    assert near_ties(got, want, p_grp) == 0


def bad_args(**change):
    pos = packed_positions([[20, 20]])
    q, k, _ = make_case(pos, 2, 2, 16, torch.float32, seed=0)
    args = dict(q=q, k=k, lse=torch.zeros(1, 4, 40), cmp_block=L, cmp_stride=D, sel_block=LS, n_selected=5,
                scale=0.25, pos=pos)  # fmt: skip
    args.update(change)
    return args


BAD = [
    (dict(pos=torch.zeros(1, 40, dtype=torch.int32)), r"pos must be an int64 tensor of shape \[B, S\] = \[1, 40\]"),
    (dict(pos=torch.zeros(1, 41, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\]"),
    (dict(pos=torch.zeros(2, 40, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\]"),
    (dict(pos=torch.zeros(40, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\]"),
    (dict(k=torch.randn(1, 2, 4, 16)), r"with pos, k must hold a slot per token, Tc = max\(0, S - cmp_block \+ 1\) "
                                       "= 25"),
    (dict(pos=torch.zeros(1, 40, dtype=torch.int64, device="meta")), "must be on one device"),
]


@pytest.mark.parametrize("change,match", BAD, ids=["int32", "longer", "batch", "1-D", "stride-d-keys", "device"])
def test_argument_validation(change, match):
    assert_raises_eager_and_fake(select_blocks, bad_args(**change), match)


# --- GPU: the reference backend with pos at larger sizes --------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_reference_on_cuda_matches_eager(dtype):
    """The paper's geometry (l = 32, d = 16, l' = 64, n = 16) at S = 4096, random packings per row:
    eager's choice but for near ties (auto takes triton there)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2):
        lengths, left = [], 4096
        while left:
            lengths.append(min(left, int(torch.randint(1, 1500, (1,), generator=gen))))
            left -= lengths[-1]
        rows.append(helpers.document_positions(lengths))
    pos = torch.stack(rows).cuda()
    q, k, scale = make_case(pos.cpu(), 2, 6, 64, dtype, seed=1, l=32, device="cuda")
    want, p_grp, lse = eager(q, k, scale, 16, pos, 32, 16, 64)
    got = select_blocks(q, k, lse, 32, 16, 64, 16, scale, "auto", pos=pos)
    assert near_ties(got, want, p_grp, 1e-5) <= 2 * 2 * 4096 // 1000
    assert bs_mod.why_not_triton(q, k, lse, 32, 16, 64, 16, pos) is None  # auto takes triton
