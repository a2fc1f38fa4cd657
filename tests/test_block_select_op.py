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

import pytest
import torch
from oracles import LargestTensor, assert_raises_eager_and_fake, triton_interpreter, upcast
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.models.config import ModelConfig
from nsa_compile.models.nsa import NSAAttention
from nsa_compile.ops import block_select as bs_mod
from nsa_compile.ops import block_select_triton as bst
from nsa_compile.ops import select_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_TRITON = bst.triton is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
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
    t = torch.arange(S)[:, None]
    current = t // block
    key = p.masked_fill(current == torch.arange(Tc), 1.0).view(B, G, H // G, S, Tc).sum(2)
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


def test_fla_rule_differs_from_the_paper_rule_and_auto_takes_reference_with_the_reason():
    B, G, h, S, block, n = 1, 2, 2, 40, 4, 3
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, G * h, S, 8, generator=gen)
    k = torch.randn(B, G, -(-S // block), 8, generator=gen)
    _, _, lse = fla_eager(q, k, 0.5, n, block)
    fla = select_blocks(q, k, lse, block, block, block, n, 0.5, rule="fla")
    paper = select_blocks(q, k, lse, block, block, block, n, 0.5)  # the default: today's rule, unchanged
    assert torch.equal(paper, select_blocks(q, k, lse, block, block, block, n, 0.5, rule="nsa"))
    assert not torch.equal(fla.sort(-1).values, paper.sort(-1).values)
    assert bs_mod.choose_backend(q, k, lse, block, block, block, n, "auto", None, "fla") == "reference"
    assert bs_mod.why_not_triton(q, k, lse, block, block, block, n, rule="fla") == bs_mod.FLA_REASON
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: rule 'fla'"):
        select_blocks(q, k, lse, block, block, block, n, 0.5, "triton", rule="fla")
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
