"""nsa::select_blocks (nsa_compile/ops/block_select.py, block_select_triton.py) against the eager
`NSAAttention.select_blocks` of models/nsa.py, on p_cmp and lse built with the eager formulas.

Inputs on a grid (multiples of 1/32, |x| <= 1) make every score q @ k^T exact in fp32 in any
summation order (multiples of 2^-10 below 2^7), so its rounding to bf16/fp16 (which does happen:
the scores need more bits) is the same in every implementation; the chosen
blocks can then differ from eager's only where the importance differs by float32 rounding (the op
computes exp(s - lse), eager a softmax): each mismatch must be a near tie, and rare. Constructed
exact ties (uniform and periodic probabilities) must be broken exactly as eager breaks them.

The Triton kernel runs on CUDA when there is one, else through Triton's CPU interpreter
(TRITON_INTERPRET=1, set by a module fixture and restored after it) at tiny sizes.
"""

from __future__ import annotations

import functools
import itertools
import re

import helpers
import pytest
import torch
from oracles import LargestTensor, assert_raises_eager_and_fake, triton_interpreter, upcast
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.models.config import ModelConfig
from nsa_compile.models.nsa import NSAAttention
from nsa_compile.ops import block_select as bs_mod
from nsa_compile.ops import block_select_triton as bst
from nsa_compile.ops import compressed_triton as ct
from nsa_compile.ops import select_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_TRITON = bst.triton is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
# the compiled path built without a GPU: only where triton was imported compiled (its library functions,
# tl.max and friends, are interpreted ones for good when TRITON_INTERPRET=1 was set at its import)
compiles_here = pytest.mark.skipif(
    not HAVE_TRITON or torch.cuda.is_available() or not isinstance(bst.tl.max, bst.triton.runtime.JITFunction),
    reason="on CUDA the kernel tests launch the compiled kernel; triton imported under TRITON_INTERPRET=1 "
           "cannot compile here")
# l, d, l' of the tests: l' = 4 d as in the paper, l = 2 d; small, so S = 100 spans 6 selection blocks
L, D, LS = 16, 8, 16
NEAR_TIE = 1e-6  # relative difference of eager's p_grp that float32 rounding may swap


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    """Without CUDA: TRITON_INTERPRET=1 while this module runs."""
    with triton_interpreter(on=DEVICE == "cpu" and HAVE_TRITON):
        yield


# --- the eager side --------------------------------------------------------------------------------


@functools.cache
def eager_module(H, G, Dk, l, d, ls, n):
    cfg = ModelConfig(dim=8, n_heads=H, n_kv_groups=G, head_dim=Dk, cmp_block=l, cmp_stride=d, sel_block=ls,
                      n_selected=n)  # fmt: skip
    return NSAAttention(cfg)


def eager_p_cmp(q, k_cmp, l, d, scale):
    """p_cmp [B, H, S, Tc] and lse [B, H, S] float32 for q [B, H, S, Dk] and pooled keys k_cmp
    [B, G, Tc, Dk]: the lines of models/nsa.py `compressed_attention` after the pooling, and the
    log-sum-exp of the same masked scores (-inf on rows without a visible block)."""
    S, Tc = q.shape[2], k_cmp.shape[2]
    h = q.shape[1] // k_cmp.shape[1]
    k_rep = k_cmp.repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
    scores = upcast(q @ k_rep.transpose(-1, -2)) * scale  # [B, H, S, Tc]
    t = torch.arange(S, device=q.device)[:, None]
    i = torch.arange(Tc, device=q.device)[None, :]
    visible = i * d + l - 1 <= t
    scores = scores.masked_fill(~visible, float("-inf"))
    has_block = visible.any(dim=-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible
    return p, torch.logsumexp(scores, dim=-1).float()


def eager_p_grp(p_cmp, S, G, l, d, ls):
    """The importance [B, G, S, Ns] of models/nsa.py `select_blocks` (its first lines)."""
    B, H, _, Tc = p_cmp.shape
    Ns = -(-S // ls)
    i = torch.arange(Tc, device=p_cmp.device)[:, None]
    j = torch.arange(Ns, device=p_cmp.device)[None, :]
    overlap = torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)
    overlap = overlap.clamp(min=0).to(p_cmp.dtype) / l
    return (p_cmp @ overlap).view(B, G, H // G, S, Ns).sum(2)


def make_case(B, G, h, S, Dk, dtype, seed, l=L, d=D, grid=True, device="cpu"):
    """q [B, H, S, Dk] (a view of [B, S, H, Dk] memory), pooled keys k [B, G, Tc, Dk], scale."""
    gen = torch.Generator().manual_seed(seed)
    Tc = max(0, (S - l) // d + 1)
    if grid:  # multiples of 1/32 in [-1, 1]: exact in fp16/bf16, exact products and sums in fp32
        q = torch.randint(-32, 33, (B, S, G * h, Dk), generator=gen) / 32
        k = torch.randint(-32, 33, (B, G, Tc, Dk), generator=gen) / 32
    else:
        q = torch.randn(B, S, G * h, Dk, generator=gen)
        k = torch.randn(B, G, Tc, Dk, generator=gen)
    return q.to(dtype).to(device).transpose(1, 2), k.to(dtype).to(device), Dk**-0.5


def eager(q, k, scale, n, l=L, d=D, ls=LS):
    """(eager block_idx, eager p_grp, lse) for these inputs."""
    _, H, S, Dk = q.shape
    G = k.shape[1]
    p, lse = eager_p_cmp(q, k, l, d, scale)
    idx = eager_module(H, G, Dk, l, d, ls, n).select_blocks(p, S)
    return idx, eager_p_grp(p, S, G, l, d, ls), lse


def near_ties(got, want, p_grp, tol=NEAR_TIE) -> int:
    """The number of (batch, group, token) rows where got and want differ; AssertionError unless
    each such row swaps blocks whose eager importance lies within `tol` (relative) of each other:
    the best block eager chose that got did not is at most tol above the worst one got chose."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int64
    rows = (got != want).any(-1).nonzero().tolist()
    for b, g, t in rows:
        ours, theirs = set(got[b, g, t].tolist()) - {-1}, set(want[b, g, t].tolist()) - {-1}
        only_ours, only_theirs = sorted(ours - theirs), sorted(theirs - ours)
        where = f"row (b={b}, g={g}, t={t}): ours {sorted(ours)}, eager {sorted(theirs)}"
        assert len(only_ours) == len(only_theirs) > 0, where
        hi = p_grp[b, g, t, only_theirs].max().item()
        lo = p_grp[b, g, t, only_ours].min().item()
        assert hi - lo <= tol * abs(hi), f"{where}: eager p_grp {hi!r} vs {lo!r} is no near tie"
    return len(rows)


# --- the reference backend against eager ------------------------------------------------------------

SEQ_LENS = (31, 32, 63, 100)  # below l' * n, not multiples of l or l' (but 32), t < l rows
GROUP_SIZES = (1, 4, 6)
N_SELECTED = (3, 5, 9)  # Ns = 7 at S = 100: n > Ns and n < Ns both occur


def test_test_formula_is_the_models_method():
    """eager_p_cmp on pooled keys == NSAAttention.compressed_attention's p on the tokens."""
    B, G, h, S, Dk = 2, 2, 3, 100, 16
    attn = eager_module(G * h, G, Dk, L, D, LS, 5)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, G * h, Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, G, Dk, generator=gen, dtype=torch.float64)
    _, want = attn.compressed_attention(q, k, k)
    k_cmp = attn.compress(k, None, D).transpose(1, 2)  # [B, G, Tc, Dk]
    got, lse = eager_p_cmp(q.transpose(1, 2), k_cmp, L, D, attn.scale)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    # the lse a compressed op returns: softmax = exp(s - lse) on the visible blocks
    assert lse[:, :, : L - 1].isneginf().all() and lse[:, :, L - 1 :].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_reference_matches_eager(dtype):
    rows = mismatched = 0
    for S, h, n in itertools.product(SEQ_LENS, GROUP_SIZES, N_SELECTED):
        q, k, scale = make_case(2, 2, h, S, 16, dtype, seed=S * 13 + h * 5 + n)
        want, p_grp, lse = eager(q, k, scale, n)
        got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference")
        assert got.shape == (2, 2, S, n) and got.dtype == torch.int64 and got.is_contiguous()
        mismatched += near_ties(got, want, p_grp)
        rows += want.shape[0] * want.shape[1] * S
    assert mismatched <= rows // 200, f"{mismatched} of {rows} rows differ"


def test_reference_matches_eager_when_blocks_reach_past_the_forced_ones():
    """l = 32 > l' = 16: a compression block covers free candidates too (visibility matters)."""
    for S, h in ((100, 2), (77, 3)):
        q, k, scale = make_case(2, 2, h, S, 16, torch.bfloat16, seed=S, l=32, d=8)
        want, p_grp, lse = eager(q, k, scale, 4, 32, 8, 16)
        assert near_ties(select_blocks(q, k, lse, 32, 8, 16, 4, scale, "reference"), want, p_grp) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_eager_on_gaussian_inputs(dtype):
    """Scores off the grid: q @ k^T rounds differently per summation order. On the CPU both sides
    run the same matmul kernel, so the rounded scores still agree and only near ties may differ."""
    rows = mismatched = 0
    for S, h in ((100, 4), (200, 6), (257, 1)):
        q, k, scale = make_case(3, 2, h, S, 16, dtype, seed=S + h, grid=False)
        want, p_grp, lse = eager(q, k, scale, 5)
        mismatched += near_ties(select_blocks(q, k, lse, L, D, LS, 5, scale, "reference"), want, p_grp)
        rows += 3 * 2 * S
    assert mismatched <= rows // 200, f"{mismatched} of {rows} rows differ"


def test_sparse_choices_in_the_cases_tested():
    """The cases above include rows whose choice is not all candidates (else any ranking passes),
    -1 padding (n > the candidates), and groups that choose differently."""
    q, k, scale = make_case(2, 2, 4, 100, 16, torch.float32, seed=3)
    want, _, _ = eager(q, k, scale, 5)
    t = torch.arange(100)
    candidates = t // LS + 1
    chosen = (want >= 0).sum(-1)  # [B, G, S]
    assert (chosen < candidates).any() and (want == -1).any()
    assert torch.equal(chosen, candidates.clamp(max=5).expand_as(chosen))
    assert not torch.equal(want[:, 0], want[:, 1])


def test_short_sequences_and_no_compression_block():
    """S < l (Tc = 0: no row sees a block; every candidate has importance 0) and S < l'."""
    for S, n in ((10, 3), (15, 5), (20, 3), (1, 3)):
        q, k, scale = make_case(2, 2, 3, S, 16, torch.float32, seed=S)
        want, _, lse = eager(q, k, scale, n)
        got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference")
        assert torch.equal(got, want), S


def test_chunking_is_exact(monkeypatch):
    """A budget of a few rows per chunk (chunks not aligned with blocks): the same result."""
    q, k, scale = make_case(2, 2, 3, 100, 16, torch.float32, seed=7)
    want, p_grp, lse = eager(q, k, scale, 5)
    full = select_blocks(q, k, lse, L, D, LS, 5, scale, "reference")
    for budget in (1, 2 * 6 * 11 * 3, 2 * 6 * 11 * 7):  # 1, 3 and 7 rows per chunk
        monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", budget)
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, 5, scale, "reference"), full), budget
    near_ties(full, want, p_grp)


# --- exact ties ---------------------------------------------------------------------------------------


def tie_cases(dtype, device="cpu", B=2):
    """(name, q, k, scale) whose eager importance has exact ties among the free candidates:
    all keys zero (uniform p), and keys repeating with the period of a selection block (l' / d
    compression blocks), so every whole earlier selection block sees the same probabilities."""
    G, h, S, Dk = 2, 3, 100, 16
    q, k, scale = make_case(B, G, h, S, Dk, dtype, seed=11)
    period = LS // D
    base = k[:, :, :period]
    k_periodic = base.repeat(1, 1, -(-k.shape[2] // period), 1)[:, :, : k.shape[2]].contiguous()
    return [("uniform", q.to(device), torch.zeros_like(k).to(device), scale),
            ("periodic", q.to(device), k_periodic.to(device), scale)]  # fmt: skip


def assert_ties_matter(want, p_grp, n):
    """Some row has more equal free candidates than free slots: the stable order decides."""
    S = want.shape[2]
    t = torch.arange(S, device=want.device)
    j = torch.arange(p_grp.shape[-1], device=want.device)
    cur = (t // LS)[:, None]
    free = (j >= 1) & (j <= cur - 2)  # candidates that are not forced
    decided = False
    for tt in range(S):
        if free[tt].sum() > n - 3:  # more free candidates than free slots
            vals = p_grp[0, 0, tt][free[tt]]
            decided |= bool((vals == vals.max()).sum() > n - 3)
    assert decided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_breaks_exact_ties_like_eager(dtype):
    for name, q, k, scale in tie_cases(dtype):
        for n in (3, 4, 5):
            want, p_grp, lse = eager(q, k, scale, n)
            assert_ties_matter(want, p_grp, n)
            got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference")
            assert torch.equal(got, want), f"{name} n={n}"


def rounding_case(dtype, device="cpu"):
    """q, k, scale where the free choice depends on rounding q @ k^T to the input dtype: block 1's
    compression blocks score 1 + e, block 2's 1 + 3e (e = 1/8 of the dtype's ulp at 1: both round
    to 1.0, a tie that goes to block 1; unrounded, block 2 wins). One head, one free slot (n = 4)."""
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    S, Tc = 100, (100 - L) // D + 1
    q = torch.zeros(1, S, 1, 16)
    q[..., :2] = 1.0
    k = torch.zeros(1, 1, Tc, 16)
    k[0, 0, 1:4, 0] = 1.0  # compression blocks 1..3 (block 1's: half of 1, 2, half of 3)
    k[0, 0, 1:4, 1] = ulp / 8
    k[0, 0, 4:6, 0] = 1.0  # blocks 4, 5 (block 2's: half of 3, 4, half of 5)
    k[0, 0, 4:6, 1] = 3 * ulp / 8
    return q.to(dtype).to(device).transpose(1, 2), k.to(dtype).to(device), 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_rounds_the_scores_to_the_input_dtype_first(dtype):
    q, k, scale = rounding_case(dtype)
    want, _, lse = eager(q, k, scale, 4)
    unrounded, _, _ = eager(q.float(), k.float(), scale, 4)
    assert (want[..., 64:, :] != unrounded[..., 64:, :]).any()  # the rounding decides there
    assert torch.equal(select_blocks(q, k, lse, L, D, LS, 4, scale, "reference"), want)


# --- a rounded importance (importance_dtype: the importance matmul under autocast, issue 17) -------------

ROUNDINGS = (torch.bfloat16, torch.float16)


def eager_rounded(p_cmp, S, G, n, dtype, l=L, d=D, ls=LS, pos=None, float32_sum=False, group_first=False):
    """(block ids, importance [B, G, S, Ns] in dtype) of models/nsa.py `select_blocks` with its
    importance computed in `dtype`, written out as autocast runs it: p and the block map rounded to
    dtype, their matmul in dtype (float32 accumulation, the result rounded), the group sum in dtype,
    the key in dtype, a stable descending sort. pos: packed documents (a block map per batch row,
    forced and candidate blocks by document position)."""
    B, H, _, Tc = p_cmp.shape
    Ns = -(-S // ls)
    i = torch.arange(Tc, device=p_cmp.device)[:, None]
    j = torch.arange(Ns, device=p_cmp.device)[None, :]
    start = i * d if pos is None else pos[:, :Tc, None]  # [Tc, 1] or [B, Tc, 1]
    overlap = (torch.minimum(start + l, (j + 1) * ls) - torch.maximum(start, j * ls)).clamp(min=0).to(p_cmp.dtype) / l
    p_slc = p_cmp.to(dtype) @ (overlap if pos is None else overlap[:, None]).to(dtype)  # [B, H, S, Ns]
    if group_first:  # torch.einsum('bghsc,cj->bgsj', p, map): the heads summed in dtype, then the map
        p_grp = p_cmp.to(dtype).view(B, G, H // G, S, Tc).sum(2) @ overlap.to(dtype)
    elif float32_sum:  # CUDA autocast runs sum in float32: the rounded per-head importances summed unrounded
        p_grp = p_slc.view(B, G, H // G, S, Ns).float().sum(2)
    else:
        p_grp = p_slc.view(B, G, H // G, S, Ns).sum(2)
        assert p_slc.dtype == p_grp.dtype == dtype
    t = torch.arange(S, device=p_cmp.device)[:, None] if pos is None else pos[:, None, :, None]
    forced = (j == 0) | (j == t // ls) | (j == t // ls - 1)
    key = torch.where(forced, float("inf"), torch.where(j * ls <= t, p_grp, float("-inf")))
    key = torch.nn.functional.pad(key, (0, max(0, n - Ns)), value=float("-inf"))
    values, order = torch.sort(key, dim=-1, descending=True, stable=True)
    past_end = key.shape[-1]
    chosen = torch.where(values[..., :n] > float("-inf"), order[..., :n], past_end)
    chosen = torch.sort(chosen, dim=-1).values
    return torch.where(chosen == past_end, -1, chosen), p_grp


@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_rounded_formula_is_the_model_under_autocast(dtype):
    """eager_rounded == NSAAttention.select_blocks run under CPU autocast in that dtype."""
    for S, h, n in ((100, 3, 5), (77, 1, 3)):
        q, k, scale = make_case(2, 2, h, S, 16, torch.float32, seed=S, grid=False)
        p, _ = eager_p_cmp(q, k, L, D, scale)
        with torch.autocast("cpu", dtype=dtype):
            want = eager_module(2 * h, 2, 16, L, D, LS, n).select_blocks(p, S)
        assert torch.equal(eager_rounded(p, S, 2, n, dtype)[0], want), S


@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_reference_with_a_rounded_importance_matches_eager(dtype):
    """importance_dtype: eager's block ids of the rounded importance, equal on random inputs at odd
    shapes (q in bf16 as autocast's projections give it, and in float32), where the unrounded op's
    differ in some rows (the rounding decides there)."""
    unrounded = 0
    for S, h, n, q_scale in itertools.product((37, 100, 131), (1, 3, 6), (3, 5), (0.3, 1.0)):
        for q_dtype in (torch.bfloat16, torch.float32):
            q, k, scale = make_case(2, 2, h, S, 16, q_dtype, seed=S * 7 + h + n, grid=False)
            q = (q.float() * q_scale).to(q_dtype)
            p, lse = eager_p_cmp(q, k, L, D, scale)
            want, _ = eager_rounded(p, S, 2, n, dtype)
            got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference", importance_dtype=dtype)
            assert got.shape == (2, 2, S, n) and got.dtype == torch.int64 and got.is_contiguous()
            assert torch.equal(got, want), (S, h, n, q_scale, q_dtype)
            unrounded += int((select_blocks(q, k, lse, L, D, LS, n, scale, "reference") != want).any(-1).sum())
    assert unrounded >= {torch.bfloat16: 40, torch.float16: 5}[dtype], unrounded  # of 2,736 rows: 53, 7


def bf16_tie_case(dtype):
    """q, k, lse (S 100, one head) where the free blocks 1..4 of rows t >= 96 get importances that
    differ in float32 (compression block 8, in block 4 only, scores 2^-16 above the others) but
    round to one value in dtype: rounded, the tie goes to block 1; unrounded, block 4 wins."""
    S, Tc = 100, (100 - L) // D + 1
    q = torch.zeros(1, S, 1, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, Tc, 16)
    k[0, 0, 8, 0] = 2.0**-16
    q, k = q.to(dtype).transpose(1, 2), k.to(dtype)
    p, lse = eager_p_cmp(q, k, L, D, 1.0)
    return q, k, lse, p


@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_rounded_importance_breaks_its_exact_ties_to_the_lower_block(dtype):
    q, k, lse, p = bf16_tie_case(dtype)
    want, p_grp = eager_rounded(p, 100, 1, 4, dtype)
    assert (p_grp[0, 0, 99, 1:5] == p_grp[0, 0, 99, 1]).all()  # an exact tie in dtype...
    unrounded = eager_p_grp(p, 100, 1, L, D, LS)[0, 0, 99, 1:5]
    assert unrounded.argmax() == 3 and (unrounded[:3] < unrounded[3]).all()  # ...of unequal float32 importances
    assert want[0, 0, 96:].tolist() == [[0, 1, 5, 6]] * 4
    got = select_blocks(q, k, lse, L, D, LS, 4, 1.0, "reference", importance_dtype=dtype)
    assert torch.equal(got, want)
    plain = select_blocks(q, k, lse, L, D, LS, 4, 1.0, "reference")
    assert plain[0, 0, 96:].tolist() == [[0, 4, 5, 6]] * 4  # the float32 ranking: block 4
    for name, q, k, scale in tie_cases(torch.bfloat16):  # ties exact in float32 stay ties when rounded
        for n in (3, 5):
            p, lse = eager_p_cmp(q, k, L, D, scale)
            got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference", importance_dtype=dtype)
            assert torch.equal(got, eager_rounded(p, 100, 2, n, dtype)[0]), (name, n)


def test_rounded_importance_chunking_is_exact(monkeypatch):
    q, k, scale = make_case(2, 2, 3, 100, 16, torch.bfloat16, seed=7, grid=False)
    p, lse = eager_p_cmp(q, k, L, D, scale)
    want, _ = eager_rounded(p, 100, 2, 5, torch.bfloat16)
    for budget in (1, 2 * 6 * 11 * 3):  # 1 and 3 rows per chunk
        monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", budget)
        got = select_blocks(q, k, lse, L, D, LS, 5, scale, "reference", importance_dtype=torch.bfloat16)
        assert torch.equal(got, want), budget


@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_rounded_importance_with_packed_documents(dtype):
    """pos and importance_dtype: the packed block map per batch row rounded the same way."""
    pos = helpers.packed_positions([[9, 1, 30, 13, 70, 77], [5, 1, 47, 47, 100]])  # documents up to 7 blocks
    B, S = pos.shape
    G, h, Dk = 2, 3, 16
    gen = torch.Generator().manual_seed(1)
    q = (0.1 * torch.randn(B, S, G * h, Dk, generator=gen)).to(torch.bfloat16).transpose(1, 2)  # flat: ties
    k = torch.randn(B, G, S - L + 1, Dk, generator=gen).to(torch.bfloat16)
    scores = upcast(q @ k.repeat_interleave(h, dim=1).transpose(-1, -2)) * Dk**-0.5  # [B, H, S, Tc]
    visible = helpers.packed_slot_visibility(S, k.shape[2], pos, L, D)  # [B, 1, S, Tc]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores.masked_fill(~visible.any(-1, keepdim=True), 0.0), dim=-1) * visible
    lse = torch.logsumexp(scores, dim=-1)
    want, _ = eager_rounded(p, S, G, 5, dtype, pos=pos)
    with torch.autocast("cpu", dtype=dtype):  # the model's packed selection under autocast: the same
        assert torch.equal(eager_module(G * h, G, Dk, L, D, LS, 5).select_blocks(p, S, pos), want)
    got = select_blocks(q, k, lse, L, D, LS, 5, Dk**-0.5, "reference", pos=pos, importance_dtype=dtype)
    assert torch.equal(got, want)
    assert not torch.equal(select_blocks(q, k, lse, L, D, LS, 5, Dk**-0.5, "reference", pos=pos), want)


def test_rounded_importance_with_the_fla_rule():
    """Rule 'fla' with importance_dtype: p rounded, the current block set to 1.0 and the group sum in
    bf16, ranked by a stable sort (the eager formula written with p.to(bf16))."""
    B, G, h, S, block, n = 2, 2, 3, 37, 4, 3
    gen = torch.Generator().manual_seed(1)
    q = (0.3 * torch.randn(B, S, G * h, 8, generator=gen)).transpose(1, 2)
    k = torch.randn(B, G, -(-S // block), 8, generator=gen)
    p, lse = eager_p_cmp(q, k, block, block, 8**-0.5)
    current = torch.arange(S)[:, None] // block
    key = p.to(torch.bfloat16).masked_fill(current == torch.arange(k.shape[2]), 1.0).view(B, G, h, S, -1).sum(2)
    idx = key.sort(dim=-1, descending=True, stable=True).indices[..., :n]
    want = idx.masked_fill(idx > current, -1)
    got = select_blocks(q, k, lse, block, block, block, n, 8**-0.5, "reference", rule="fla",
                        importance_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(select_blocks(q, k, lse, block, block, block, n, 8**-0.5, "reference", rule="fla"), want)


def test_rounded_importance_argument_backends_and_schema():
    """importance_dtype takes None, bf16 or fp16 (ValueError otherwise, eager and fake); the triton
    backend takes it where one chunk of heads holds the group (its reason otherwise), so 'auto'
    chooses as without it; opcheck passes."""
    args = bad_args(importance_dtype=torch.float32)
    assert_raises_eager_and_fake(select_blocks, args, "importance_dtype must be None, torch.bfloat16 or "
                                                      "torch.float16, got torch.float32")
    q, k, scale = make_case(2, 2, 2, 40, 16, torch.bfloat16, seed=0, device=DEVICE)  # where triton runs
    _, lse = eager_p_cmp(q, k, L, D, scale)
    choice = (q, k, lse, L, D, LS, 5)
    assert bs_mod.why_not_triton(*choice, None, "nsa", torch.bfloat16) == bs_mod.why_not_triton(*choice)
    assert bs_mod._triton_reason(*choice, None, "nsa", torch.float16) is None
    assert bs_mod.choose_backend(*choice, "auto", None, "nsa", torch.bfloat16) == \
        bs_mod.choose_backend(*choice, "auto")
    q17, k17, _ = make_case(1, 1, 17, 40, 16, torch.bfloat16, seed=0, device=DEVICE)  # 17 heads: 2 chunks of 16
    lse17 = torch.zeros(1, 17, 40, device=DEVICE)
    reason = ("importance rounded to bfloat16 with 17 heads a group in chunks of 16 (the rounded importance is kept "
              "per head for one chunk only)")
    assert bs_mod._triton_reason(q17, k17, lse17, L, D, LS, 5, None, "nsa", torch.bfloat16) == reason
    assert bs_mod._triton_reason(q17, k17, lse17, L, D, LS, 5) is None
    torch.library.opcheck(torch.ops.nsa.select_blocks.default, (q, k, lse, L, D, LS, 5, scale, "reference"),
                          {"importance_dtype": torch.bfloat16})


@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_triton_with_a_rounded_importance_matches_eager(dtype):
    """The triton backend with importance_dtype: eager's block ids of the rounded importance at odd
    shapes, with and without packed documents, and its exact ties to the lower block. q and k in
    fp16: the kernel rounds its scores to the input dtype, which Triton's CPU interpreter does by
    truncation in bf16 (the GPU test runs bf16 inputs)."""
    for S, h, n, q_scale in ((100, 2, 5, 1.0), (150, 3, 4, 3.0), (200, 4, 5, 1.0), (77, 1, 6, 0.3)):
        q, k, scale = make_case(2, 2, h, S, 16, torch.float16, seed=S + h, grid=False)
        q = (q.float() * q_scale).to(torch.float16)
        p, lse = eager_p_cmp(q, k, L, D, scale)
        want, _ = eager_rounded(p, S, 2, n, dtype)
        got = select_blocks(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), L, D, LS, n, scale, "triton",
                            importance_dtype=dtype)
        assert torch.equal(got.cpu(), want), (S, h, n)
    q, k, lse, p = bf16_tie_case(dtype)
    got = select_blocks(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), L, D, LS, 4, 1.0, "triton",
                        importance_dtype=dtype).cpu()
    assert got[0, 0, 96:].tolist() == [[0, 1, 5, 6]] * 4  # the rounded tie: block 1 (unrounded: block 4)
    assert torch.equal(got, eager_rounded(p, 100, 1, 4, dtype)[0])
    pos = helpers.packed_positions([[9, 1, 30, 13, 70, 77]])
    S = pos.shape[1]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, S, 4, 16, generator=gen).to(torch.float16).transpose(1, 2)
    k = torch.randn(1, 2, S - L + 1, 16, generator=gen).to(torch.float16)
    lse = packed_lse(q, k, pos)
    want = select_blocks(q, k, lse, L, D, LS, 5, 0.25, "reference", pos=pos, importance_dtype=dtype)
    q, k, lse, pos = q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), pos.to(DEVICE)
    got = select_blocks(q, k, lse, L, D, LS, 5, 0.25, "triton", pos=pos, importance_dtype=dtype)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rounded_importance_with_a_float32_group_sum(backend):
    """group_sum_dtype=torch.float32 (CUDA autocast's sum): eager's block ids where the rounded
    per-head importances are summed in float32, which differ from the rounded sum's on these
    inputs; the argument is validated."""
    if backend == "triton" and not HAVE_TRITON:
        pytest.skip("no triton")
    differ = 0
    for S, h, n in ((150, 3, 4), (200, 4, 5)):
        q, k, scale = make_case(2, 2, h, S, 16, torch.float16, seed=S + h, grid=False)
        p, lse = eager_p_cmp(q, k, L, D, scale)
        want, _ = eager_rounded(p, S, 2, n, torch.bfloat16, float32_sum=True)
        got = select_blocks(q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), L, D, LS, n, scale, backend,
                            importance_dtype=torch.bfloat16, group_sum_dtype=torch.float32)
        assert torch.equal(got.cpu(), want), (S, h, n)
        differ += int((eager_rounded(p, S, 2, n, torch.bfloat16)[0] != want).any(-1).sum())
    assert differ > 0  # the float32 sum is a different ranking
    q, k, scale = make_case(1, 1, 2, 40, 16, torch.float16, seed=0)
    lse = eager_p_cmp(q, k, L, D, scale)[1]
    q, k, lse = q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE)
    for bad in ({"group_sum_dtype": torch.float32}, {"importance_dtype": torch.bfloat16, "group_sum_dtype": torch.float16}):
        with pytest.raises(ValueError, match="group_sum_dtype must be None, or torch.float32 with an importance_dtype"):
            select_blocks(q, k, lse, L, D, LS, 4, scale, backend, **bad)


def packed_lse(q, k, pos):
    """The compressed lse [B, H, S] of packed q and per-token slots k (scale 0.25), -inf where no slot is visible."""
    h = q.shape[1] // k.shape[1]
    scores = upcast(q @ k.repeat_interleave(h, dim=1).transpose(-1, -2)) * 0.25
    visible = helpers.packed_slot_visibility(q.shape[2], k.shape[2], pos, L, D)
    return torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)




@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_rounded_importance_on_cuda_at_the_seed_shape(dtype):
    """The seed's geometry (h 6, G 2, Dk 64, l 32, d 16, l' 64, n 16) at S 2048 on CUDA, bf16 q and
    k: the triton backend ('auto' takes it) and the reference backend with importance_dtype against
    the model's select_blocks under CUDA autocast (cuBLAS's bf16/fp16 matmul; CUDA autocast runs the
    group sum in float32: group_sum_dtype): the same block ids but in a few rows (CPU: 2 in 10^6);
    without importance_dtype many more rows differ."""
    S, G, h, Dk = 2048, 2, 6, 64
    q, k, scale = make_case(2, G, h, S, Dk, torch.bfloat16, seed=3, l=32, d=16, grid=False, device="cuda")
    p, lse = eager_p_cmp(q, k, 32, 16, scale)
    with torch.autocast("cuda", dtype=dtype):
        want = eager_module(G * h, G, Dk, 32, 16, 64, 16).select_blocks(p, S)
    assert bs_mod.choose_backend(q, k, lse, 32, 16, 64, 16, "auto", None, "nsa", dtype) == "triton"
    rows = 2 * G * S
    for backend in ("triton", "reference"):
        got = select_blocks(q, k, lse, 32, 16, 64, 16, scale, backend, importance_dtype=dtype,
                            group_sum_dtype=torch.float32)
        differ = int((got != want).any(-1).sum())
        assert differ <= rows // 500, f"{backend}: {differ} of {rows} rows differ"
    plain = int((select_blocks(q, k, lse, 32, 16, 64, 16, scale) != want).any(-1).sum())
    print(f"{dtype}: rows that differ from eager under autocast without importance_dtype: {plain} of {rows}")


# --- the Triton kernel ----------------------------------------------------------------------------------

# B, G, h, S, Dk, n, dtype, (l, d, l') (CPU: the interpreter runs each program in Python, seconds)
TRITON_CASES = [
    (2, 2, 4, 63, 16, 3, torch.bfloat16, (L, D, LS)),
    (1, 2, 1, 100, 16, 9, torch.float32, (L, D, LS)),
    (2, 1, 6, 100, 24, 5, torch.float16, (L, D, LS)),
    (1, 1, 3, 32, 16, 20, torch.float32, (L, D, LS)),
    # l > l': a compression block reaches back into a free candidate, so visibility matters
    (1, 2, 2, 100, 16, 4, torch.bfloat16, (32, 8, 16)),
]


@needs_triton
@pytest.mark.parametrize("B,G,h,S,Dk,n,dtype,geometry", TRITON_CASES, ids=[str(c) for c in range(len(TRITON_CASES))])
def test_triton_matches_eager(B, G, h, S, Dk, n, dtype, geometry):
    l, d, ls = geometry
    q, k, scale = make_case(B, G, h, S, Dk, dtype, seed=S + h + n, l=l, d=d, device=DEVICE)
    want, p_grp, lse = eager(q, k, scale, n, l, d, ls)
    got = select_blocks(q, k, lse, l, d, ls, n, scale, "triton")
    assert got.shape == (B, G, S, n) and got.dtype == torch.int64 and got.is_contiguous()
    assert near_ties(got, want, p_grp) <= want.numel() // n // 200


@needs_triton
@pytest.mark.parametrize("case,dtype", [(0, torch.float32), (1, torch.bfloat16)], ids=["uniform", "periodic"])
def test_triton_breaks_exact_ties_like_eager(case, dtype):
    for name, q, k, scale in tie_cases(dtype, DEVICE, B=1)[case : case + 1]:
        want, p_grp, lse = eager(q, k, scale, 4)
        assert_ties_matter(want, p_grp, 4)
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, 4, scale, "triton"), want), f"{name} {dtype}"


@needs_triton
def test_triton_rounds_the_scores_to_the_input_dtype_first():
    q, k, scale = rounding_case(torch.bfloat16, DEVICE)
    want, _, lse = eager(q, k, scale, 4)
    assert torch.equal(select_blocks(q, k, lse, L, D, LS, 4, scale, "triton"), want)


@needs_triton
def test_triton_tiles_paper_block_geometry_and_head_chunks():
    """Smaller tiles than the defaults, so these short sequences span several tiles of compression
    blocks (each selection block's reach into the previous tile, the merges across tiles): the
    paper's l = 32, d = 16, l' = 64 (TC 16: 4 selection blocks a tile, S = 300 spans 2 tiles);
    and l' = 2 d with h = 5 in chunks of 2 heads (3 chunks, the last one partial)."""
    q, k, scale = make_case(1, 1, 2, 300, 16, torch.bfloat16, seed=5, l=32, d=16, device=DEVICE)
    want, p_grp, lse = eager(q, k, scale, 3, l=32, d=16, ls=64)
    got = bst.select_blocks_forward(q, k, lse, 32, 16, 64, 3, scale, tiles={"TC": 16, "BLOCK_M": 64})
    assert near_ties(got, want, p_grp) == 0
    q, k, scale = make_case(1, 1, 5, 150, 16, torch.float32, seed=6, device=DEVICE)
    want, p_grp, lse = eager(q, k, scale, 3)
    got = bst.select_blocks_forward(q, k, lse, L, D, LS, 3, scale, tiles={"HC": 2, "TC": 16, "BLOCK_M": 32})
    assert near_ties(got, want, p_grp) == 0


@needs_triton
def test_unsupported_reason(monkeypatch):
    q, k, scale = make_case(1, 2, 2, 40, 16, torch.float32, seed=0, device=DEVICE)
    lse = torch.zeros(1, 4, 40, device=DEVICE)
    assert bst.unsupported_reason(q, k, lse, L, D, LS, 5) is None
    assert "dtype" in bst.unsupported_reason(q.double(), k.double(), lse, L, D, LS, 5)
    assert "lse dtype" in bst.unsupported_reason(q, k, lse.double(), L, D, LS, 5)
    assert "divide" in bst.unsupported_reason(q, k, lse, 12, 8, 16, 5)
    assert "power of two" in bst.unsupported_reason(q, k, lse, 16, 8, 24, 5)
    assert "n_selected" in bst.unsupported_reason(q, k, lse, L, D, LS, 200)
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: the stride"):
        select_blocks(q, k, lse, 12, 8, 16, 5, scale, "triton")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "device cpu" in bst.unsupported_reason(q, k, lse, L, D, LS, 5)
        assert bs_mod.choose_backend(q, k, lse, L, D, LS, 5) == "reference"
        assert "CUDA" in bs_mod.why_not_triton(q, k, lse, L, D, LS, 5)


def test_reference_runs_what_triton_refuses():
    """l' / d = 3 (not a power of two) and d not dividing l: eager's arithmetic still holds."""
    for l, d, ls in ((24, 8, 24), (12, 4, 12)):
        q, k, scale = make_case(2, 2, 2, 90, 16, torch.float32, seed=l, l=l, d=d)
        p, lse = eager_p_cmp(q, k, l, d, scale)
        cfg = ModelConfig(dim=8, n_heads=4, n_kv_groups=2, head_dim=16, cmp_block=l, cmp_stride=d, sel_block=ls,
                          n_selected=4)  # fmt: skip
        want = NSAAttention(cfg).select_blocks(p, 90)
        got = select_blocks(q, k, lse, l, d, ls, 4, scale, "reference")
        near_ties(got, want, eager_p_grp(p, 90, 2, l, d, ls))


# --- the Triton kernel with packed documents (pos) ------------------------------------------------------


def packed_case(lengths, G, h, Dk, dtype, seed, l=L, keys="grid", device=DEVICE):
    """pos [B, S] for batch rows packed with documents of these lengths, q [B, H, S, Dk] (a view of
    [B, S, H, Dk] memory), slot keys k [B, G, S - l + 1, Dk] (a slot per token) and scale. keys:
    'grid' (q and k on make_case's grid: exact scores), 'gaussian', or 'zero' (uniform
    probabilities: exact ties)."""
    pos = helpers.packed_positions(lengths)
    B, S = pos.shape
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, S, G * h, Dk), (B, G, max(0, S - l + 1), Dk))
    if keys == "gaussian":
        q, k = (torch.randn(*shape, generator=gen) for shape in shapes)
    else:
        q, k = (torch.randint(-32, 33, shape, generator=gen) / 32 for shape in shapes)
    if keys == "zero":
        k = torch.zeros_like(k)
    return pos.to(device), q.to(dtype).to(device).transpose(1, 2), k.to(dtype).to(device), Dk**-0.5


def eager_packed(q, k, scale, n, pos, l=L, d=D, ls=LS):
    """(eager block_idx, eager p_grp, lse) with packed documents: the packed p_cmp of models/nsa.py
    `compressed_attention` (slot keys k), its log-sum-exp (-inf where no slot is visible), and
    `select_blocks(p_cmp, S, pos)` with its importance (its first lines)."""
    B, H, S, Dk = q.shape
    G, Tc = k.shape[1], k.shape[2]
    scores = upcast(q @ k.repeat_interleave(H // G, dim=1).transpose(-1, -2)) * scale  # [B, H, S, Tc]
    visible = helpers.packed_slot_visibility(S, Tc, pos, l, d)  # [B, 1, S, Tc]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores.masked_fill(~visible.any(-1, keepdim=True), 0.0), dim=-1) * visible
    idx = eager_module(H, G, Dk, l, d, ls, n).select_blocks(p, S, pos)
    j = torch.arange(-(-S // ls), device=q.device)[None, :]
    start = pos[:, :Tc, None]  # [B, Tc, 1]: each slot's document position
    overlap = (torch.minimum(start + l, (j + 1) * ls) - torch.maximum(start, j * ls)).clamp(min=0).to(p.dtype) / l
    p_grp = (p @ overlap[:, None]).view(B, G, H // G, S, -1).sum(2)
    return idx, p_grp, torch.logsumexp(scores, dim=-1).float()


# per-row document lengths (B = 2: documents of 1 token and shorter than l), G, h, Dk, n, dtype,
# (l, d, l'), tiles (None: the defaults). Together they take every packed path of the kernel
# (test_packed_cases_take_every_kernel_path).
PACKED_CASES = [
    (([9, 1, 30, 13], [5, 1, 47]), 2, 2, 16, 4, torch.float32, (8, 4, 8), None),
    (([20, 1, 3, 46], [70]), 1, 3, 16, 4, torch.bfloat16, (16, 4, 8), None),  # l > l': visibility matters
    (([1, 40, 4, 22], [33, 2, 32]), 2, 5, 16, 4, torch.float32, (4, 2, 8), {"HC": 2, "TC": 16, "BLOCK_M": 16}),
    (([6, 1, 31], [38]), 1, 4, 24, 3, torch.float16, (16, 8, 32), {"TC": 16, "BLOCK_M": 16}),  # n > Ns
]


def packed_kernel_paths(pos, h, Dk, n, dtype, geometry, tiles) -> set:
    """The packed paths of the kernel that these positions take with these tiles: 'groups' (a
    query tile holds rows of several documents with blocks: one pass over the blocks each),
    'blockless' (a document without blocks starts inside a tile: a pass that finds no rows),
    'key_tiles' (a group's pass spans several tiles of compression blocks, the previous one
    reaching into the next), 'head_chunks' (the heads in several chunks), 'free_choice' (rows with
    more candidates than n: the importance decides), 'padding' (rows with fewer: -1 padded)."""
    l, d, ls = geometry
    T = bst._tiles(h, Dk, d, ls, n, dtype == torch.float32, tiles)
    S = pos.shape[1]
    _, lo, _, _, _ = ct.document_slots(pos, S - l + 1, l, d)
    found = {"head_chunks"} if -(-h // T["HC"]) > 1 else set()
    candidates = pos // ls + 1  # [B, S]
    found |= {"free_choice"} if (candidates > n).any() else set()
    found |= {"padding"} if (candidates < n).any() else set()
    for rows in torch.arange(S).split(T["BLOCK_M"]):
        for b in range(pos.shape[0]):
            groups = lo[b, rows].unique()
            starts = int((pos[b, rows[1:]] == 0).sum())  # documents starting after the tile's first query
            if len(groups) > 1:
                found.add("groups")
            if starts + 1 > len(groups):
                found.add("blockless")
            for group in groups:
                last = int(pos[b, rows][lo[b, rows] == group].max())
                if (last // ls) // (T["TC"] * d // ls) > 0:
                    found.add("key_tiles")
    return found


def test_packed_cases_take_every_kernel_path():
    found = set()
    for lengths, _, h, Dk, n, dtype, geometry, tiles in PACKED_CASES:
        found |= packed_kernel_paths(helpers.packed_positions(lengths), h, Dk, n, dtype, geometry, tiles)
    assert found == {"groups", "blockless", "key_tiles", "head_chunks", "free_choice", "padding"}


@needs_triton
@pytest.mark.parametrize("lengths,G,h,Dk,n,dtype,geometry,tiles", PACKED_CASES,
                         ids=[str(c) for c in range(len(PACKED_CASES))])  # fmt: skip
def test_triton_with_pos_matches_eager(lengths, G, h, Dk, n, dtype, geometry, tiles):
    """pos in the kernel: eager's packed choice (document-relative block ids, forced and candidate
    blocks by document position, rows that see no slot: importance 0), exact on grid inputs."""
    l, d, ls = geometry
    pos, q, k, scale = packed_case(lengths, G, h, Dk, dtype, seed=sum(lengths[0]) + h + n, l=l)
    want, p_grp, lse = eager_packed(q, k, scale, n, pos, l, d, ls)
    assert (lse.isneginf().any() and (want == -1).any() and (want.amax(-1) == (pos // ls)[:, None]).all()
            and not torch.equal(want, eager(q, k[:, :, ::d], scale, n, l, d, ls)[0]))  # the packing matters
    got = bst.select_blocks_forward(q, k, lse, l, d, ls, n, scale, pos, tiles=tiles)
    assert got.shape == (pos.shape[0], G, pos.shape[1], n) and got.dtype == torch.int64 and got.is_contiguous()
    assert near_ties(got, want, p_grp) == 0


@needs_triton
def test_triton_with_pos_breaks_exact_ties_like_eager():
    """Zero keys (uniform probabilities over each row's visible slots): many exactly equal free
    candidates per row; the kernel breaks the ties as eager (to the lower block), for the op
    named 'triton' too."""
    pos, q, k, scale = packed_case(([5, 95], [100]), 2, 3, 16, torch.bfloat16, seed=2, keys="zero")
    for n in (4, 5):
        want, p_grp, lse = eager_packed(q, k, scale, n, pos)
        j = torch.arange(p_grp.shape[-1], device=DEVICE)
        free = (j >= 1) & (j <= (pos // LS)[..., None] - 2)  # [B, S, Ns]: candidates not forced
        assert any(bool((p_grp[b, 0, t][free[b, t]] == p_grp[b, 0, t][free[b, t]].max()).sum() > n - 3)
                   for b, t in (free.sum(-1) > n - 3).nonzero().tolist())  # the stable order decides
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, n, scale, "triton", pos=pos), want), n


@needs_triton
def test_triton_with_pos_on_short_sequences_and_documents():
    """S < l (no slot), documents all shorter than l (no row sees a slot: the forced blocks, then
    the candidates ascending), S < l'."""
    for lengths, n in ((([10], [3, 7]), 3), (([7, 7, 7, 1, 7, 7, 7, 7], [1, 15, 15, 15, 4]), 4), (([20], [19, 1]), 3)):
        pos, q, k, scale = packed_case(lengths, 2, 3, 16, torch.float32, seed=len(lengths[0]))
        want, _, lse = eager_packed(q, k, scale, n, pos)
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, n, scale, "triton", pos=pos), want), lengths


@needs_triton
def test_unsupported_reason_with_pos(monkeypatch):
    """A valid pos: the kernel takes it (auto takes it on CUDA: gpu tests); on the CPU auto takes
    reference with pos for the reason it does without; an invalid pos has a reason."""
    pos, q, k, scale = packed_case(([13, 27], [40]), 2, 2, 16, torch.float32, seed=0)
    lse = torch.zeros(2, 4, 40, device=DEVICE)
    args = (q, k, lse, L, D, LS, 5)
    assert bst.unsupported_reason(*args, pos) is None
    assert bs_mod._triton_reason(*args, pos) is None
    assert "pos must be int64 [B, S] = [2, 40], got torch.int32" in bst.unsupported_reason(*args, pos.int())
    assert "Tc must be S - block + 1 = 25, got 24" in bst.unsupported_reason(q, k[:, :, 1:], *args[2:], pos)
    if DEVICE == "cpu":
        assert bs_mod.choose_backend(*args, "auto", pos) == "reference"
        assert bs_mod.why_not_triton(*args, pos) == bs_mod.why_not_triton(*args) == (
            "the Triton kernel runs on CUDA (tensors on cpu)")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: device cpu"):
            select_blocks(q, k, lse, L, D, LS, 5, scale, "triton", pos=pos)


def sm90_ptx(monkeypatch, options: dict | None = None, **flags) -> str:
    """select_kernel built as on the GPU (TRITON_INTERPRET off) and compiled to PTX for an H100 by
    the Triton installed here: bf16, the seed's h 6, Dk 64, l 32, d 16, l' 64, n 16; `flags` the
    constexprs past UPCAST (HAS_POS, IMP_DTYPE, ...; those not given are None); `options` compile
    options besides num_warps (select_blocks_forward's FLA_OPTIONS)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    T = bst._tiles(6, 64, 16, 64, 16, False)
    fn = bst.select_kernel.built()
    pointers = {"Q": "*bf16", "KC": "*bf16", "LSE": "*fp32", "W": "*fp32", "OUT": "*i64", "POS": "*i64", "LO": "*i32",
                "SLOT": "*i32", "MEANS": "*fp32"}  # fmt: skip
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name) or ("fp32" if p.name == "scale" else "i32")
                 for p in fn.params}  # fmt: skip
    given = {"HPG": 6, "HC": T["HC"], "NHC": 1, "DK": 64, "DK_P": T["DK_P"], "BLOCK_M": T["BLOCK_M"], "TC": T["TC"],
             "NS": T["TC"] // 4, "KS": T["KS"], "LOG_KS": T["KS"].bit_length() - 1, "PREC": "tf32", "ROUND": True,
             "UPCAST": False, **flags}  # fmt: skip
    compiled = bst.triton.compile(ASTSource(fn, signature, given), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": T["num_warps"], **(options or {})})
    return compiled.asm["ptx"]


@compiles_here
def test_the_packed_kernel_compiles_for_sm90_without_a_gpu(monkeypatch):
    """The compiled path of the kernel with pos (HAS_POS: a loop over the tile's document groups),
    which the interpreted tests never take, compiles for an H100."""
    assert ".entry select_kernel(" in sm90_ptx(monkeypatch, HAS_POS=True)


# --- the op's plumbing ------------------------------------------------------------------------------------


def test_opcheck():
    for S, h, n, Tc_extra in ((40, 3, 5, 0), (7, 1, 3, 0), (33, 2, 4, 2)):
        q, k, scale = make_case(2, 2, h, S, 16, torch.float32, seed=S)
        if Tc_extra:  # more pooled keys than S has blocks: the extra ones are never visible
            k = torch.cat([k, torch.randn(2, 2, Tc_extra, 16)], dim=2)
        _, lse = eager_p_cmp(q, k, L, D, scale)
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        torch.library.opcheck(torch.ops.nsa.select_blocks.default, (q, k, lse, L, D, LS, n, scale, "reference"))
        out = torch.ops.nsa.select_blocks(q, k, lse, L, D, LS, n, scale)
        assert not out.requires_grad


def test_compile_fullgraph_dynamic_shapes():
    """Under torch.compile (dynamic shapes) the op is one node of one graph for two lengths (its
    fake takes symbolic S), and the compiled result matches eager (AOTAutograd traced too)."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(q, k, lse):
        return torch.ops.nsa.select_blocks(q, k, lse, L, D, LS, 5, 0.25, "auto") + 0

    captured = torch.compile(fn, fullgraph=True, backend=capture, dynamic=True)
    aot = torch.compile(lambda *args: fn(*args), fullgraph=True, backend="aot_eager", dynamic=True)
    for S in (40, 77):  # Tc 4, 8; H 6
        q, k, scale = make_case(1, 2, 3, S, 16, torch.float32, seed=S)
        want, p_grp, lse = eager(q, k, scale, 5)
        assert torch.equal(captured(q, k, lse), aot(q, k, lse))
        near_ties(aot(q, k, lse), want, p_grp)
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.nsa.select_blocks) == 1  # the Dynamo graph holds the packet


def test_reference_memory_is_bounded_by_the_chunk(monkeypatch):
    """With a budget of B*H*Tc*8 elements (8 rows a chunk) no tensor the reference computes is
    larger than the budget or the output, far below eager's [B, H, S, Tc] probabilities."""
    B, G, h, S, Dk, n = 1, 2, 4, 1024, 8, 5
    q, k, scale = make_case(B, G, h, S, Dk, torch.float32, seed=2)
    want, p_grp, lse = eager(q, k, scale, n)
    Tc = k.shape[2]
    budget = B * G * h * Tc * 8
    monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", budget)
    spy = LargestTensor()
    with spy:
        got = bs_mod._reference(q, k, lse, L, D, LS, n, scale)
    assert spy.max_numel <= max(budget, B * G * S * n) < B * G * h * S * Tc // 50
    near_ties(got, want, p_grp)


def bad_args(**change):
    q, k, _ = make_case(2, 2, 2, 40, 16, torch.float32, seed=0)
    args = dict(q=q, k=k, lse=torch.zeros(2, 4, 40), cmp_block=L, cmp_stride=D, sel_block=LS, n_selected=5,
                scale=0.25)  # fmt: skip
    args.update(change)
    return args


BAD = [
    (dict(q=torch.randn(2, 4, 40)), "q must be 4-D"),
    (dict(k=torch.randn(2, 2, 4)), "k must be 4-D"),
    (dict(q=torch.ones(2, 4, 40, 16, dtype=torch.int64)), "floating-point"),
    (dict(k=torch.randn(2, 2, 4, 16, dtype=torch.float64)), "share a dtype"),
    (dict(k=torch.randn(3, 2, 4, 16)), "batch sizes differ"),
    (dict(k=torch.randn(2, 2, 4, 12)), "head dims differ"),
    (dict(k=torch.randn(2, 3, 4, 16)), "H=4 must be a multiple of KV heads G=3"),
    (dict(k=torch.randn(2, 0, 4, 16)), "at least one KV head"),
    (dict(lse=torch.zeros(2, 4, 40, dtype=torch.float64)), "lse must be a float32"),
    (dict(lse=torch.zeros(2, 4, 41)), r"lse must have shape \[B, H, S\]"),
    (dict(cmp_block=0), "cmp_block must be >= 1"),
    (dict(cmp_stride=-1), "cmp_stride must be >= 1"),
    (dict(sel_block=0), "sel_block must be >= 1"),
    (dict(n_selected=0), "n_selected must be >= 1"),
    (dict(backend="fast"), "unknown backend 'fast'"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m for _, m in BAD])
def test_argument_validation(change, match):
    assert_raises_eager_and_fake(select_blocks, bad_args(**change), match)


# --- GPU: the Triton kernel at larger sizes -------------------------------------------------------------


def _gpu_case(S, h, dtype, grid, n=16, l=32, d=16, ls=64, B=1, G=2, Dk=64, seed=0):
    q, k, scale = make_case(B, G, h, S, Dk, dtype, seed=seed, l=l, d=d, grid=grid, device="cuda")
    want, p_grp, lse = eager(q, k, scale, n, l, d, ls)
    got = select_blocks(q, k, lse, l, d, ls, n, scale, "triton")
    ref = select_blocks(q, k, lse, l, d, ls, n, scale, "reference")
    return got, ref, want, p_grp


# bf16/fp16 scores off the grid round to the input dtype after an fp32 sum whose order differs
# between cuBLAS and the kernel: a score one ulp (2^-8 / 2^-11 relative) apart moves p by up to
# scale*|s|*ulp, so off-grid mismatches are checked against that rounding, not against 1e-6
OFF_GRID_TIE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1000, 4096])
@pytest.mark.parametrize("h", [6, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_on_cuda_matches_eager(S, h, dtype):
    rows = 2 * S
    got, ref, want, p_grp = _gpu_case(S, h, dtype, grid=True, seed=S + h)
    assert near_ties(got, want, p_grp) <= rows // 1000
    assert near_ties(ref, want, p_grp) <= rows // 1000
    got, ref, want, p_grp = _gpu_case(S, h, dtype, grid=False, seed=S + h + 1)
    assert near_ties(got, want, p_grp, OFF_GRID_TIE[dtype]) <= rows // 100
    assert near_ties(ref, want, p_grp, OFF_GRID_TIE[dtype]) <= rows // 100


@pytest.mark.gpu
def test_triton_on_cuda_ties_and_memory():
    for name, q, k, scale in tie_cases(torch.bfloat16, "cuda"):
        want, _, lse = eager(q, k, scale, 4)
        assert torch.equal(select_blocks(q, k, lse, L, D, LS, 4, scale, "triton"), want), name
    # the paper's shape at 16k: no [.., S, Tc] or [.., S, Ns] tensor; the extra memory is the output
    B, H, G, S, Dk, n = 1, 64, 4, 16384, 128, 16
    q = torch.randn(B, S, H, Dk, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, G, (S - 32) // 16 + 1, Dk, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(B, H, S, device="cuda").abs() + 8
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for backend, allowed in (("triton", 2 * B * G * S * n * 8), ("reference", 2**30)):
        select_blocks(q, k, lse, 32, 16, 64, n, Dk**-0.5, backend)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= allowed, (backend, extra)
        torch.cuda.reset_peak_memory_stats()


@pytest.mark.gpu
@pytest.mark.sweep
@pytest.mark.parametrize("S", [8192, 16384])
@pytest.mark.parametrize("shape", ["paper", "seed"])
def test_triton_at_the_issue_sizes(S, shape):
    H, G, Dk = (64, 4, 128) if shape == "paper" else (12, 2, 64)
    got, ref, want, p_grp = _gpu_case(S, H // G, torch.bfloat16, grid=True, G=G, Dk=Dk, seed=S)
    assert near_ties(got, want, p_grp) <= G * S // 1000
    assert near_ties(ref, want, p_grp) <= G * S // 1000


@pytest.mark.gpu
@pytest.mark.parametrize("keys", ["grid", "gaussian"])
def test_triton_with_pos_on_cuda_at_the_seed_shape(keys):
    """The seed's geometry (h 6, G 2, Dk 64, l 32, d 16, l' 64, n 16) at S 2048, bf16, a realistic
    mix of documents (100 to 800 tokens) per row: auto takes triton with pos, and triton and the
    reference backend give eager's packed choice but for near ties (on the grid 1e-6; off it the
    bf16 rounding of scores summed in another order, OFF_GRID_TIE)."""
    S, rows = 2048, [helpers.random_lengths(2048, 100, 800, seed) for seed in range(2)]
    pos, q, k, scale = packed_case(rows, 2, 6, 64, torch.bfloat16, seed=5, l=32, keys=keys, device="cuda")
    want, p_grp, lse = eager_packed(q, k, scale, 16, pos, 32, 16, 64)
    assert bs_mod.choose_backend(q, k, lse, 32, 16, 64, 16, "auto", pos) == "triton"
    tie = NEAR_TIE if keys == "grid" else OFF_GRID_TIE[torch.bfloat16]
    allowed = 2 * 2 * S // (1000 if keys == "grid" else 100)
    for backend in ("triton", "reference"):
        got = select_blocks(q, k, lse, 32, 16, 64, 16, scale, backend, pos=pos)
        assert near_ties(got, want, p_grp, tie) <= allowed, backend


# --- rule 'fla': flash-linear-attention's choice (issue 17.3: a variant is a parameter) ---------------


def fla_eager(q, k, scale, n, block, ranking="topk"):
    """flash-linear-attention's `naive_nsa_with_compression` choice (tests/corpus/fla_naive_bthd.py,
    written here as plain eager code) for q [B, H, S, Dk] and pooled keys k [B, G, Tc, Dk] with
    l = d = l' = block: (block ids [B, G, S, min(n, Tc)] in rank order with -1 in place, the ranking
    key [B, G, S, Tc], lse). ranking 'topk' as fla writes it; 'sort' a stable descending sort (the
    tie order the op documents)."""
    B, H, S, _ = q.shape
    G, Tc = k.shape[1], k.shape[2]
    p, lse = eager_p_cmp(q, k, block, block, scale)  # [B, H, S, Tc]: 0 on hidden blocks and empty rows
    t = torch.arange(S, device=q.device)[:, None]
    current = t // block
    key = p.masked_fill(current == torch.arange(Tc, device=q.device), 1.0).view(B, G, H // G, S, Tc).sum(2)
    m = min(n, Tc)
    if ranking == "topk":
        idx = key.topk(m, dim=-1).indices
    else:
        idx = key.sort(dim=-1, descending=True, stable=True).indices[..., :m]
    return idx.masked_fill(idx > current, -1), key, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("B,G,h,S,block,n", [(2, 2, 3, 37, 4, 3), (1, 3, 1, 29, 5, 4), (2, 1, 2, 50, 7, 9)],
                         ids=["h3-S37-l4-n3", "h1-S29-l5-n4", "n-above-Tc"])
def test_fla_rule_matches_the_eager_formula_at_odd_sizes(B, G, h, S, block, n, dtype):
    """The reference backend's rule 'fla' gives the eager formula's block ids exactly in rank order
    (the stable-sort form: ties to the lower block), and torch.topk's as sets; the -1 sit where
    fla's masked_fill puts them (rank order), and n > Tc is padded with -1 at the end."""
    Tc = -(-S // block)  # fla's pooling: the last, partial block is never visible
    gen = torch.Generator().manual_seed(S)
    q = (torch.randn(B, S, G * h, 8, generator=gen)).to(dtype).transpose(1, 2)
    k = torch.randn(B, G, Tc, 8, generator=gen).to(dtype)
    scale = 8**-0.5
    want, key, lse = fla_eager(q, k, scale, n, block, ranking="sort")
    got = select_blocks(q, k, lse, block, block, block, n, scale, "reference", rule="fla")
    assert got.shape == (B, G, S, n) and got.dtype == torch.int64
    m = min(n, Tc)
    assert (got[..., m:] == -1).all()
    # the same blocks in the same order, but where float rounding swaps near ties (the op's exp(s - lse)
    # with a float32 lse against a float64 softmax: 1 - 1e-7 for a lone visible block's 1.0)
    for b, g, t in (got[..., :m] != want).any(-1).nonzero().tolist():
        ours, theirs = got[b, g, t, :m], want[b, g, t]
        assert torch.equal(ours.sort().values, theirs.sort().values), (b, g, t, ours, theirs)
        swapped = ours != theirs
        gap = key[b, g, t, theirs[swapped].clamp(min=0)] - key[b, g, t, ours[swapped].clamp(min=0)]
        assert dtype == torch.float64 and gap.abs().max() <= 1e-6 * key[b, g, t].max(), (b, g, t, gap)
    topk_ids = fla_eager(q, k, scale, n, block)[0]
    assert torch.equal(got[..., :m].sort(-1).values, topk_ids.sort(-1).values)
    # the rule's substance: rank order (the current block first wherever it ranks first), not ascending;
    # early rows whose top-n reached future blocks, -1 after the top-n
    current = torch.arange(S) // block
    assert not torch.equal(got, got.sort(-1).values) and (got[..., 0] == current[:, None].T).float().mean() > 0.5
    assert (got[..., :m][:, :, : (m - 1) * block] == -1).any()


def test_fla_rule_differs_from_the_paper_rule_and_auto_chooses_as_for_it():
    """Rule 'fla' is not the default rule; 'auto' chooses its backend as for the paper's rule (off
    CUDA: the reference, with the CUDA reason; rule 'fla' itself is no reason)."""
    B, G, h, S, block, n = 1, 2, 2, 40, 4, 3
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, G * h, S, 8, generator=gen)
    k = torch.randn(B, G, -(-S // block), 8, generator=gen)
    _, _, lse = fla_eager(q, k, 0.5, n, block)
    fla = select_blocks(q, k, lse, block, block, block, n, 0.5, rule="fla")
    paper = select_blocks(q, k, lse, block, block, block, n, 0.5)  # the default: today's rule, unchanged
    assert torch.equal(paper, select_blocks(q, k, lse, block, block, block, n, 0.5, rule="nsa"))
    assert not torch.equal(fla.sort(-1).values, paper.sort(-1).values)
    choice = (q, k, lse, block, block, block, n)
    assert bs_mod.choose_backend(*choice, "auto", None, "fla") == bs_mod.choose_backend(*choice, "auto") == "reference"
    assert bs_mod.why_not_triton(*choice, rule="fla") == bs_mod.why_not_triton(*choice) == \
        "the Triton kernel runs on CUDA (tensors on cpu)"
    assert not hasattr(bs_mod, "FLA_REASON") and not hasattr(bs_mod, "RULE_REASONS")  # every rule has the kernel
    torch.library.opcheck(torch.ops.nsa.select_blocks.default, (q, k, lse, block, block, block, n, 0.5, "reference"),
                          {"rule": "fla"})


@pytest.mark.parametrize("change,match", [(dict(rule="topk"), "unknown rule 'topk'"),
                                          (dict(rule="fla", pos=torch.zeros(2, 40, dtype=torch.int64)),
                                           "rule 'fla' with pos")], ids=["unknown", "packed"])
def test_fla_rule_argument_validation(change, match):
    args = bad_args(**change)
    if "pos" in change:
        args["k"] = torch.randn(2, 2, 40 - L + 1, 16)
    assert_raises_eager_and_fake(select_blocks, args, match)


# rule 'fla' on the Triton kernel (CPU: interpreted). Entries of q and k are multiples of 1/2 in [-1, 1]
# and Dk = 8, so every score q @ k^T is a multiple of 1/4 below 8: exact in fp32, fp16 and bf16 (the
# interpreter truncates a cast to bf16 where the GPU and torch round; an exact score is the same either
# way). (B, G, h, S, (l, d, l'), n, seed): h 1, 3, 6 at S not a multiple of the query tile; fla's l = d = l'
# and the paper's overlapping l = 2d; S 100 (l' 4) and 300 (l' 16) span two tiles of compression blocks;
# Ns < n at S 45; S 3 < l (no compression block: every row [0, -1, ..])
FLA_CASES = [(2, 2, 1, 37, (4, 4, 4), 3, 0), (1, 2, 3, 100, (4, 4, 4), 5, 1), (1, 1, 6, 45, (L, D, LS), 9, 2),
             (1, 1, 3, 300, (L, D, LS), 4, 3), (1, 2, 3, 3, (4, 4, 4), 2, 4)]  # fmt: skip
FLA_IMPORTANCE = [(None, None), (torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.float32)]


def fla_case(B, G, h, S, dtype, seed, l=4, d=4, Dk=8):
    """(q, k, lse, scale) on DEVICE: q [B, H, S, Dk] and pooled keys k [B, G, Tc, Dk] with entries
    multiples of 1/2 in [-1, 1] (exact scores, above), the eager lse."""
    gen = torch.Generator().manual_seed(seed)
    Tc = max(0, (S - l) // d + 1)
    q = (torch.randint(-2, 3, (B, S, G * h, Dk), generator=gen) / 2).to(dtype).transpose(1, 2)
    k = (torch.randint(-2, 3, (B, G, Tc, Dk), generator=gen) / 2).to(dtype)
    lse = eager_p_cmp(q, k, l, d, Dk**-0.5)[1]
    return q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), Dk**-0.5


@needs_triton
@pytest.mark.parametrize("importance_dtype,group_sum_dtype", FLA_IMPORTANCE, ids=["fp32", "bf16", "fp16", "bf16-sum32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_triton_fla_equals_the_reference(dtype, importance_dtype, group_sum_dtype):
    """The triton backend with rule 'fla': the reference backend's block ids exactly, in rank order
    (-1 after the chosen blocks and where Ns < n), with and without a rounded importance; a chunk of
    queries (q_offset, starting inside a block, its rows' current blocks past the first tile of
    compression blocks) the same rows as the whole sequence. fp32 inputs run one head per chunk,
    so with a rounded importance only h = 1 runs (the others: the kernel's reason)."""
    rounding = {"importance_dtype": importance_dtype, "group_sum_dtype": group_sum_dtype}
    ran = 0
    for B, G, h, S, (l, d, ls), n, seed in FLA_CASES:
        q, k, lse, scale = fla_case(B, G, h, S, dtype, seed, l, d)
        args = (q, k, lse, l, d, ls, n, scale)
        want = select_blocks(*args, "reference", rule="fla", **rounding)
        if why := bs_mod._triton_reason(*args[:7], None, "fla", importance_dtype):
            assert dtype == torch.float32 and importance_dtype is not None and "in chunks of 1" in why, why
            continue
        got = select_blocks(*args, "triton", rule="fla", **rounding)
        assert got.shape == (B, G, S, n) and got.dtype == torch.int64 and torch.equal(got, want), (S, h, n, seed)
        ran += 1
    assert ran == (1 if dtype == torch.float32 and importance_dtype is not None else len(FLA_CASES))
    h = 1 if dtype == torch.float32 and importance_dtype is not None else 3
    q, k, lse, scale = fla_case(1, 2, h, 300, dtype, seed=5)
    whole = select_blocks(q, k, lse, 4, 4, 4, 5, scale, "reference", rule="fla", **rounding)
    chunk = (q[:, :, 130:], k, lse[:, :, 130:], 4, 4, 4, 5, scale)
    got = select_blocks(*chunk, "triton", rule="fla", q_offset=130, **rounding)
    assert torch.equal(got, whole[:, :, 130:])
    assert torch.equal(got, select_blocks(*chunk, "reference", rule="fla", q_offset=130, **rounding))


@needs_triton
def test_triton_fla_reaches_the_kernel():
    """The same inputs through the kernel with rule 'fla' and the paper's rule: each gives its own
    reference ids, and they differ (other blocks, and the order: fla's in rank order, not ascending)."""
    q, k, lse, scale = fla_case(2, 2, 3, 100, torch.float16, seed=6, l=L, d=D)
    args = (q, k, lse, L, D, LS, 4, scale)
    fla, paper = select_blocks(*args, "triton", rule="fla"), select_blocks(*args, "triton")
    assert torch.equal(fla, select_blocks(*args, "reference", rule="fla"))
    assert torch.equal(paper, select_blocks(*args, "reference"))
    ascending = lambda ids: (ids.masked_fill(ids < 0, 1 << 20).diff(dim=-1) >= 0).all(-1)  # -1 only at the end
    assert ascending(paper).all() and (~ascending(fla)).float().mean() > 0.5, (~ascending(fla)).float().mean()
    other = (fla.sort(-1).values != paper.sort(-1).values).any(-1).float().mean()
    assert other > 0.2, other


@needs_triton
def test_triton_fla_reasons_and_auto(monkeypatch):
    """'auto' takes triton for rule 'fla' where it takes it for the paper's rule (off CUDA: the CUDA
    reason, rule 'fla' is none); the kernel module refuses rule 'fla' with pos or group_first (the op
    refuses both first: test_fla_rule_argument_validation, test_group_first_is_a_rounded_...), and a
    rounded importance in several chunks of heads as for the paper's rule."""
    q, k, lse, scale = fla_case(1, 2, 3, 40, torch.bfloat16, seed=0)
    choice = (q, k, lse, 4, 4, 4, 3)
    for dtype in (None, *ROUNDINGS):
        assert bs_mod._triton_reason(*choice, None, "fla", dtype) is None
        assert bs_mod.why_not_triton(*choice, None, "fla", dtype) == bs_mod.why_not_triton(*choice)
    if DEVICE == "cpu":
        monkeypatch.setattr(bs_mod, "why_not_triton_on", lambda device, unsupported, kernels: unsupported())
    assert bs_mod.choose_backend(*choice, "auto", None, "fla") == "triton"
    assert bs_mod.choose_backend(*choice, "auto", None, "fla", torch.bfloat16) == "triton"
    refused = "rule 'fla' takes no pos (packed documents) and no group_first (the op's rule 'fla' has neither)"
    pos = torch.arange(40, device=DEVICE)[None]
    assert bst.unsupported_reason(q, k[:, :, :0], lse, 4, 4, 4, 3, pos, fla=True) == refused
    assert bst.unsupported_reason(*choice, None, torch.bfloat16, True, fla=True) == refused
    q17, k17, lse17, _ = fla_case(1, 1, 17, 40, torch.bfloat16, seed=0)
    assert "with 17 heads a group in chunks of 16" in bs_mod._triton_reason(q17, k17, lse17, 4, 4, 4, 3, None, "fla",
                                                                            torch.bfloat16)
    assert bs_mod._triton_reason(q17, k17, lse17, 4, 4, 4, 3, None, "fla") is None


@needs_triton
def test_fla_kernels_compile_without_fused_multiply_adds(monkeypatch):
    """select_blocks_forward launches the kernel with FLA_OPTIONS (no FP fusion: s * scale rounded
    before - lse, as the reference) for rule 'fla' only; the interpreter ignores the option, so the
    launch is recorded. Where a lone visible block's p is exactly 1 (lse its score), its key ties the
    current block's h and goes first (the lower block), as the reference and eager order it."""
    launches = []
    kernel = bst.select_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({name: kwargs.get(name) for name in ("FLA", "enable_fp_fusion")})
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(bst, "select_kernel", Recorder())
    q, k, lse, scale = fla_case(1, 1, 3, 12, torch.float32, seed=0)
    fla = select_blocks(q, k, lse, 4, 4, 4, 2, scale, "triton", rule="fla")
    select_blocks(q, k, lse, 4, 4, 4, 2, scale, "triton")
    assert launches == [{"FLA": True, "enable_fp_fusion": False}, {"FLA": False, "enable_fp_fusion": None}]
    assert bst.FLA_OPTIONS == {"enable_fp_fusion": False}
    # rows 4 .. 6 see block 0 alone (p = 1 per head, key 3) and are in block 1 (key 3): the tie, block 0 first
    assert fla[0, 0, 3:8].tolist() == [[0, -1], [0, 1], [0, 1], [0, 1], [1, 0]]


@compiles_here
def test_the_fla_kernel_compiles_for_sm90_without_a_gpu(monkeypatch):
    """The kernel with FLA (unrounded, and bf16-rounded importance), which the other tests interpret
    on the CPU, compiles for an H100 with FLA_OPTIONS: s * scale - lse is a multiply and a subtract
    (fused, as Triton 3.9 compiles the paper's rule's kernel by default, it is one multiply-add and
    the kernel has no fp32 subtract)."""
    plain = dict(HAS_POS=False, SUM_ROUND=True, MAP_UPCAST=False, GROUP_FIRST=False)
    for flags in (plain, plain | {"IMP_DTYPE": bst.tl.bfloat16}):
        ptx = sm90_ptx(monkeypatch, bst.FLA_OPTIONS, **flags, FLA=True)
        assert ".entry select_kernel(" in ptx and re.search(r"\bsub(\.rn)?\.f32\b", ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("importance_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_on_cuda_at_the_seed_shape(importance_dtype):
    """The fla corpus models' seed shape (tests/corpus/fla_naive_bthd.py make_seed: h 6, G 2, Dk 64,
    l = d = l' = 64, n 16) at S 2048 on CUDA, bf16 q and k on the 1/32 grid (exact scores in any
    summation order): 'auto' takes triton for rule 'fla'; triton and the reference differ in at most
    1 row of 500, and each differs from fla's eager formula (a stable sort of its float32 key) only
    by swapping blocks whose keys are within 1e-5 (relative; bf16 importance: 2e-2, each key within
    two bf16 roundings of 2^-9: the rounded p, the rounded group sum)."""
    S, G, h, Dk, block, n = 2048, 2, 6, 64, 64, 16
    q, k, scale = make_case(2, G, h, S, Dk, torch.bfloat16, seed=3, l=block, d=block, device="cuda")
    want, key, lse = fla_eager(q, k, scale, n, block, ranking="sort")
    args = (q, k, lse, block, block, block, n)
    assert bs_mod.choose_backend(*args, "auto", None, "fla", importance_dtype) == "triton"
    rows, tol = 2 * G * S, 1e-5 if importance_dtype is None else 2e-2
    got = {b: select_blocks(*args, scale, b, rule="fla", importance_dtype=importance_dtype)
           for b in ("triton", "reference")}  # fmt: skip
    differ = int((got["triton"] != got["reference"]).any(-1).sum())
    assert differ <= rows // 500, f"triton against reference: {differ} of {rows} rows differ"
    for backend, ids in got.items():
        assert torch.equal(ids < 0, want < 0), backend  # the same number of blocks in every row (Tc >= n here)
        ours, theirs = key.gather(-1, ids.clamp(min=0)), key.gather(-1, want.clamp(min=0))
        gap = ((ours - theirs).abs() / theirs.abs().clamp(min=1e-30)).masked_fill(want < 0, 0)
        assert gap.max() <= tol, f"{backend}: rank keys {gap.max().item():.2e} apart"
        print(f"{backend}, importance {importance_dtype}: {int((ids != want).any(-1).sum())} of {rows} rows "
              "differ from the eager formula")


# --- group_first: the group's heads summed (and rounded) before the block map ----------------------------


def test_group_first_is_a_rounded_nsa_variant_and_the_reference_computes_it():
    q, k, scale = make_case(2, 2, 3, 45, 16, torch.bfloat16, seed=5, grid=False)
    _, lse = eager_p_cmp(q, k, L, D, scale)
    for kwargs in ({}, {"importance_dtype": torch.bfloat16, "group_sum_dtype": torch.float32},
                   {"importance_dtype": torch.bfloat16, "rule": "fla"}):
        with pytest.raises(ValueError, match="group_first .* takes rule 'nsa' with an importance_dtype"):
            select_blocks(q, k, lse, L, D, LS, 3, scale, "reference", group_first=True, **kwargs)
    differ = 0
    for S, h, n, dtype in itertools.product((45, 100, 131), (3, 6), (3, 5), ROUNDINGS):
        q, k, scale = make_case(2, 2, h, S, 16, torch.bfloat16, seed=S + h + n, grid=False)
        p, lse = eager_p_cmp(q, k, L, D, scale)
        want, _ = eager_rounded(p, S, 2, n, dtype, group_first=True)
        got = select_blocks(q, k, lse, L, D, LS, n, scale, "reference", importance_dtype=dtype, group_first=True)
        assert got.shape == (2, 2, S, n) and got.dtype == torch.int64 and torch.equal(got, want), (S, h, n, dtype)
        head_first = select_blocks(q, k, lse, L, D, LS, n, scale, "reference", importance_dtype=dtype)
        differ += int((head_first != want).any(-1).sum())
    assert differ >= 1, differ  # the order decides in some rows (1 of 5,472 when written; more at h 6, S 120 in
    # test_block_selection_variants)


# group_first on the Triton kernel (CPU: interpreted). q and k in fp16: the interpreter truncates a
# cast to bf16, so bf16 inputs would round their scores unlike the reference (the GPU test runs bf16).
# (S, h, n, seed): h 1, 3, 6 at S not a multiple of the query tile (64, 32, 16 rows), S 300 spanning two
# tiles of compression blocks (TC 32: 256 tokens)
GROUP_FIRST_CASES = [(45, 1, 3, 0), (100, 1, 6, 1), (100, 3, 5, 2), (131, 3, 4, 3), (77, 6, 5, 4), (131, 6, 4, 5),
                     (300, 3, 6, 6)]  # fmt: skip


def group_first_case(B, G, h, S, seed, Dk=16):
    """(q, k, lse, scale) on DEVICE: gaussian fp16 q and pooled keys, the eager lse."""
    q, k, scale = make_case(B, G, h, S, Dk, torch.float16, seed=seed, grid=False)
    lse = eager_p_cmp(q, k, L, D, scale)[1]
    return q.to(DEVICE), k.to(DEVICE), lse.to(DEVICE), scale


@needs_triton
@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_triton_group_first_equals_the_reference(dtype):
    """The triton backend with group_first: the reference backend's block ids exactly (p rounded per
    head, the group sum in fp32 rounded, one map, rounded), at odd sizes, several seeds; a chunk of
    queries (q_offset) the same rows as the whole sequence."""
    for S, h, n, seed in GROUP_FIRST_CASES:
        q, k, lse, scale = group_first_case(2, 2, h, S, seed)
        args = (q, k, lse, L, D, LS, n, scale)
        want = select_blocks(*args, "reference", importance_dtype=dtype, group_first=True)
        got = select_blocks(*args, "triton", importance_dtype=dtype, group_first=True)
        assert got.shape == (2, 2, S, n) and got.dtype == torch.int64 and torch.equal(got, want), (S, h, n, seed)
    q, k, lse, scale = group_first_case(1, 2, 3, 131, seed=7)
    whole = select_blocks(q, k, lse, L, D, LS, 5, scale, "reference", importance_dtype=dtype, group_first=True)
    chunk = select_blocks(q[:, :, 60:], k, lse[:, :, 60:], L, D, LS, 5, scale, "triton", importance_dtype=dtype,
                          q_offset=60, group_first=True)
    assert torch.equal(chunk, whole[:, :, 60:])


@needs_triton
def test_triton_group_first_sums_over_chunks_of_heads():
    """Only the group's rounded sums pass from tile to tile, so the heads may come in several chunks:
    17 heads in chunks of 16 (the default tiles; the per-head rounding refuses them) and 5 heads in
    chunks of 2 (a tile override, the last chunk partial) give the reference's ids."""
    q, k, lse, scale = group_first_case(1, 1, 17, 70, seed=8)
    args = (q, k, lse, L, D, LS, 4, scale)
    assert bs_mod._triton_reason(*args[:7], None, "nsa", torch.bfloat16) is not None
    assert bs_mod._triton_reason(*args[:7], None, "nsa", torch.bfloat16, True) is None
    want = select_blocks(*args, "reference", importance_dtype=torch.bfloat16, group_first=True)
    assert torch.equal(select_blocks(*args, "triton", importance_dtype=torch.bfloat16, group_first=True), want)
    q, k, lse, scale = group_first_case(2, 1, 5, 100, seed=9)
    args = (q, k, lse, L, D, LS, 5, scale)
    want = select_blocks(*args, "reference", importance_dtype=torch.float16, group_first=True)
    got = bst.select_blocks_forward(*args, importance_dtype=torch.float16, group_first=True,
                                    tiles={"HC": 2, "BLOCK_M": 16})
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="5 heads in chunks of 2 .the rounded importance is kept per head"):
        bst.select_blocks_forward(*args, importance_dtype=torch.float16, tiles={"HC": 2, "BLOCK_M": 16})


@needs_triton
@pytest.mark.parametrize("dtype,h,seed,rows", [(torch.bfloat16, 3, 0, 2), (torch.float16, 6, 2, 1)])
def test_triton_group_first_reaches_the_kernel(dtype, h, seed, rows):
    """Inputs where summing the heads first changes the choice (found with the reference backend):
    the kernel with group_first gives the reference's group_first ids, without it the reference's
    per-head ids, and the two differ in `rows` rows."""
    q, k, lse, scale = group_first_case(1, 2, h, 120, seed, Dk=8)
    args = (q, k, lse, L, D, LS, 4, scale)
    first = select_blocks(*args, "triton", importance_dtype=dtype, group_first=True)
    per_head = select_blocks(*args, "triton", importance_dtype=dtype)
    assert torch.equal(first, select_blocks(*args, "reference", importance_dtype=dtype, group_first=True))
    assert torch.equal(per_head, select_blocks(*args, "reference", importance_dtype=dtype))
    assert int((first != per_head).any(-1).sum()) == rows


@needs_triton
def test_auto_takes_triton_for_group_first_where_it_can(monkeypatch):
    """'auto' chooses for group_first as for the same inputs without it (triton on CUDA, the CUDA
    reason elsewhere); where the kernel cannot run, the kernel's reason. The kernel module refuses
    group_first without an importance_dtype, with pos, or with a float32 group sum."""
    q, k, lse, scale = group_first_case(1, 2, 6, 40, seed=0)
    choice = (q, k, lse, L, D, LS, 5)
    for dtype in ROUNDINGS:
        assert bs_mod._triton_reason(*choice, None, "nsa", dtype, True) is None
        assert bs_mod.why_not_triton(*choice, None, "nsa", dtype, True) == bs_mod.why_not_triton(*choice)
        assert bs_mod.choose_backend(*choice, "auto", None, "nsa", dtype, True) == \
            ("triton" if DEVICE == "cuda" else "reference")
    if DEVICE == "cpu":
        assert bs_mod.why_not_triton(*choice, None, "nsa", torch.bfloat16, True) == \
            "the Triton kernel runs on CUDA (tensors on cpu)"
        monkeypatch.setattr(bs_mod, "why_not_triton_on", lambda device, unsupported, kernels: unsupported())
        assert bs_mod.choose_backend(*choice, "auto", None, "nsa", torch.bfloat16, True) == "triton"
    odd = (q, k, lse, L, D, 24, 5)  # l' / d = 3: no whole selection blocks in a tile
    why = bs_mod._triton_reason(*odd, None, "nsa", torch.bfloat16, True)
    assert "l' / d = 3" in why
    if DEVICE == "cuda":
        assert bs_mod.why_not_triton(*odd, None, "nsa", torch.bfloat16, True) == why
    assert bs_mod.choose_backend(*odd, "auto", None, "nsa", torch.bfloat16, True) == "reference"
    pos = torch.arange(40, device=DEVICE)[None]
    for kwargs in ({}, {"pos": pos, "importance_dtype": torch.bfloat16}):
        assert "group_first (the group's heads summed and rounded before the block map) takes an importance_dtype " \
               "and no pos" in bst.unsupported_reason(*choice, group_first=True, **kwargs)
    with pytest.raises(ValueError, match="group_first with group_sum_dtype torch.float32"):
        bst.select_blocks_forward(q, k, lse, L, D, LS, 5, scale, importance_dtype=torch.bfloat16,
                                  group_sum_dtype=torch.float32, group_first=True)


@compiles_here
def test_the_group_first_kernel_compiles_for_sm90_without_a_gpu(monkeypatch):
    """The kernel with GROUP_FIRST, which the other tests interpret on the CPU, compiles for an H100."""
    ptx = sm90_ptx(monkeypatch, HAS_POS=False, IMP_DTYPE=bst.tl.bfloat16, SUM_ROUND=True, MAP_UPCAST=False,
                   GROUP_FIRST=True)  # fmt: skip
    assert ".entry select_kernel(" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ROUNDINGS)
def test_group_first_on_cuda_at_the_seed_shape(dtype):
    """The seed's geometry (h 6, G 2, Dk 64, l 32, d 16, l' 64, n 16) at S 2048 on CUDA, bf16 q and k,
    group_first: 'auto' takes triton; triton and the reference against the heads summed first under
    CUDA (cuBLAS's bf16/fp16 matmul of the rounded group sum): the same ids but in a few rows (the
    kernel's fused s * scale - lse and its sum orders move a rounded value near a boundary)."""
    S, G, h, Dk = 2048, 2, 6, 64
    q, k, scale = make_case(2, G, h, S, Dk, torch.bfloat16, seed=3, l=32, d=16, grid=False, device="cuda")
    p, lse = eager_p_cmp(q, k, 32, 16, scale)
    want, _ = eager_rounded(p, S, G, 16, dtype, l=32, d=16, ls=64, group_first=True)
    args = (q, k, lse, 32, 16, 64, 16)
    assert bs_mod.choose_backend(*args, "auto", None, "nsa", dtype, True) == "triton"
    rows = 2 * G * S
    got = {}
    for backend in ("triton", "reference"):
        got[backend] = select_blocks(*args, scale, backend, importance_dtype=dtype, group_first=True)
        differ = int((got[backend] != want).any(-1).sum())
        assert differ <= rows // 500, f"{backend}: {differ} of {rows} rows differ"
    differ = int((got["triton"] != got["reference"]).any(-1).sum())
    assert differ <= rows // 500, f"triton against reference: {differ} of {rows} rows differ"
