"""The Triton selected-attention kernels (nsa_compile/ops/selection_triton.py) against the
reference backend of nsa::selected_attention, on CUDA when there is one, else on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set by a module fixture for this module only and
restored after it; the kernels are built lazily, so they are built interpreted here).

Tiny odd sizes: the interpreter runs every program instance in Python. Packed documents (pos)
are run against the reference backend with the same pos.
"""

import itertools

import pytest
import torch
from oracles import (
    assert_backend_matches_reference, assert_kernel_matches_reference, assert_lse_close, attention_inputs,
    run_without_triton, triton_interpreter,
)
from helpers import random_lengths
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)
from oracles import random_block_idx as _random_block_idx

pytest.importorskip("triton")

from nsa_compile.models import positions_from_cu_seqlens
from nsa_compile.ops import selection as sel_ref
from nsa_compile.ops import selection_triton as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, DK = 2, 16


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    """On a machine without CUDA: TRITON_INTERPRET=1 while this module runs."""
    with triton_interpreter(on=DEVICE == "cpu"):
        yield


def random_block_idx(b, g, S, n, block_size, seed):
    """A random valid selection [b, g, S, n] on DEVICE (oracles.random_block_idx)."""
    return _random_block_idx(b, g, S, n, block_size, seed, DEVICE)


def make_inputs(S, h, g, dv, dtype, seed, dk=DK):
    """q, k, v as [B, S, heads, D] memory viewed [B, heads, S, D] (non-contiguous), grad_o."""
    return [x.to(DEVICE) for x in attention_inputs(B, S, h, g, dk, dv, dtype, seed)]


def reference_lse(q, k, block_idx, block_size, scale):
    """Dense log-sum-exp over each row's selected tokens, counted with multiplicity."""
    _, H, S, _ = q.shape
    G = k.shape[1]
    h = H // G
    s = torch.arange(S, device=q.device)
    blk = block_idx[..., None]  # [B, G, S, n, 1]
    hit = (blk >= 0) & (s // block_size == blk) & (s <= s[:, None, None])  # [B, G, S, n, S]
    mult = hit.sum(3).double().repeat_interleave(h, dim=1)  # [B, H, S, S]
    kk = k.double().repeat_interleave(h, dim=1)
    scores = q.double() @ kk.transpose(-1, -2) * scale + mult.log()
    return torch.logsumexp(scores, dim=-1)


def reference(q, k, v, grad_o, block_idx, block_size, scale):
    """o, dq, dk, dv of the reference backend in float32 at the same inputs."""
    f = lambda x: x.float()
    o, _ = sel_ref._reference_forward(f(q), f(k), f(v), block_idx, block_size, scale)
    return (o, *sel_ref._reference_backward(f(grad_o), f(q), f(k), f(v), block_idx, block_size, scale))


def run_triton(q, k, v, grad_o, block_idx, block_size, scale, tiles=None):
    o, lse = st.selected_forward(q, k, v, block_idx, block_size, scale, tiles=tiles)
    dq, dk, dv = st.selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, tiles=tiles)
    return o, lse, dq, dk, dv


def check_lse(lse, q, k, idx, block_size, scale, what):
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    assert_lse_close(lse, reference_lse(q, k, idx, block_size, scale), tol, what)


# S, h, G, block_size, n, Dv, dtype
CASES = [
    (1, 1, 2, 4, 2, 8, torch.float32),
    (7, 3, 2, 4, 3, 24, torch.float32),
    (33, 4, 1, 8, 4, 8, torch.float32),
    (33, 1, 2, 8, 2, 24, torch.float32),
    (33, 3, 2, 4, 3, 8, torch.float32),
    (33, 3, 2, 8, 3, 24, torch.bfloat16),
    (7, 4, 1, 4, 4, 8, torch.bfloat16),
    (33, 1, 1, 4, 4, 24, torch.float16),
]


@pytest.mark.parametrize("dense", [False, True], ids=["union", "dense"])
@pytest.mark.parametrize("S,h,G,block_size,n,dv,dtype", CASES, ids=[str(c).replace(" ", "") for c in CASES])
def test_matches_reference(S, h, G, block_size, n, dv, dtype, dense):
    """Both ways of reading the blocks: the tiles' union and the inverted selection, and the
    "dense" mode of few blocks (every block up to the tile's last query; each KV block walks all
    later queries), each against the reference."""
    seed = S * 31 + h * 7 + G + n
    q, k, v, grad_o = make_inputs(S, h, G, dv, dtype, seed)
    idx = random_block_idx(B, G, S, n, block_size, seed).clone()
    if S > 8:
        idx[1, G - 1, S - 2, :2] = idx[1, G - 1, S - 2, 1].item()  # a duplicated block: counts twice
    scale = DK**-0.5
    o, lse, *grads = run_triton(q, k, v, grad_o, idx, block_size, scale, {"dense": dense})
    ref = reference(q, k, v, grad_o, idx, block_size, scale)
    assert_kernel_matches_reference((o, *grads), ref, dtype, f"S={S} h={h} G={G}")
    check_lse(lse, q, k, idx, block_size, scale, f"S={S} h={h} G={G}")
    assert (idx == -1).any()  # the first tokens have fewer than n candidate blocks


@pytest.mark.parametrize("dense", [False, True], ids=["union", "dense"])
def test_edge_rows_and_block_sizes_not_power_of_two(dense):
    """Hand-built rows (all -1, only a later block, a block past the end, a duplicate) and block
    sizes that are not powers of two, one above 64 (two K/V chunks per block)."""
    S, h, G, dv = 33, 2, 2, 8
    q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=5)
    for block_size, n in ((20, 2), (80, 1), (6, 3)):
        idx = random_block_idx(B, G, S, n, block_size, seed=block_size).clone()
        idx[0, 1, 5] = -1  # no block: empty row
        idx[1, 0, 10, 0] = 3  # only a block after t = 10 (past the end of S for l' >= 20): empty
        idx[1, 0, 10, 1:] = -1
        idx[0, 0, S - 1, :] = idx[0, 0, S - 1, 0].item()  # the same block n times (CUDA refuses an overlapping copy)
        o, lse, dq, dk, dv_ = run_triton(q, k, v, grad_o, idx, block_size, 0.3, {"dense": dense})
        ref = reference(q, k, v, grad_o, idx, block_size, 0.3)
        assert_kernel_matches_reference((o, dq, dk, dv_), ref, torch.float32, f"l'={block_size}")
        check_lse(lse, q, k, idx, block_size, 0.3, f"l'={block_size}")
        for b, g, t in ((0, 1, 5), (1, 0, 10)):
            heads = slice(g * h, (g + 1) * h)
            assert torch.equal(o[b, heads, t], torch.zeros_like(o[b, heads, t]))
            assert torch.equal(dq[b, heads, t], torch.zeros_like(dq[b, heads, t]))
            assert lse[b, heads, t].isneginf().all()


@pytest.mark.parametrize("dense", [False, True], ids=["union", "dense"])
@pytest.mark.parametrize("tq,rows", [(1, 16), (3, 16), (5, 32)])
def test_query_tiles_any_order_and_repeats(tq, rows, dense):
    """The forward and dq kernels at other query tiles (TQ queries per program: 1 reads each
    query's own list, more read the tile's union), on lists in any order with repeats that are
    not adjacent (each counts as often as it appears)."""
    S, h, G, block_size, n, dv = 29, 3, 2, 4, 4, 8
    q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=tq)
    idx = random_block_idx(B, G, S, n, block_size, seed=tq).clone()
    idx = idx.gather(-1, torch.rand(idx.shape, generator=torch.Generator().manual_seed(tq)).argsort(-1).to(DEVICE))
    idx[0, 0, S - 3, 2] = idx[0, 0, S - 3, 0].item()  # a repeat, not next to its first copy
    idx[1, 1, 12] = torch.tensor([2, -1, 2, 0])  # another, with padding between
    tiles = {kernel: {"TQ": tq, "ROWS": rows} for kernel in ("fwd", "dq")} | {"dense": dense}
    o, lse = st.selected_forward(q, k, v, idx, block_size, 0.4, tiles=tiles)
    dq, dk, dv_ = st.selected_backward(grad_o, q, k, v, o, lse, idx, block_size, 0.4, tiles=tiles)
    ref = reference(q, k, v, grad_o, idx, block_size, 0.4)
    assert_kernel_matches_reference((o, dq, dk, dv_), ref, torch.float32, f"TQ={tq}")
    check_lse(lse, q, k, idx, block_size, 0.4, f"TQ={tq}")


def test_blocks_chosen_after_their_query_add_nothing():
    """A non-causal choice (tests/corpus/nsa_vibe_noncausal.py's: every block competes, future
    ones included) lists blocks that start after their query; the union leaves them out, and the
    rows that chose them get the attention of their other blocks, as the reference computes it.
    Rows of only future blocks are empty (lse -inf, o 0)."""
    S, h, G, block_size, n, dv = 31, 3, 2, 4, 4, 8
    q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=8)
    gen = torch.Generator().manual_seed(8)
    NB = -(-S // block_size)
    idx = torch.rand(B, G, S, NB, generator=gen).argsort(-1)[..., :n].sort(-1).values.to(DEVICE)  # any blocks
    idx[0, 1, 3] = torch.tensor([2, 5, 6, -1])  # only future blocks for t 3
    assert ((idx * block_size > torch.arange(S, device=DEVICE)[:, None]) & (idx >= 0)).float().mean() > 0.3
    tiles = {kernel: {"TQ": 4, "ROWS": 16} for kernel in ("fwd", "dq")} | {"dense": False}
    o, lse = st.selected_forward(q, k, v, idx, block_size, 0.4, tiles=tiles)
    dq, dk, dv_ = st.selected_backward(grad_o, q, k, v, o, lse, idx, block_size, 0.4, tiles=tiles)
    ref = reference(q, k, v, grad_o, idx, block_size, 0.4)
    assert_kernel_matches_reference((o, dq, dk, dv_), ref, torch.float32, "future blocks")
    check_lse(lse, q, k, idx, block_size, 0.4, "future blocks")
    assert lse[0, h:, 3].isneginf().all() and torch.equal(o[0, h:, 3], torch.zeros_like(o[0, h:, 3]))


def test_all_padding_and_no_blocks_give_zeros():
    q, k, v, grad_o = make_inputs(9, 3, 1, 8, torch.float32, seed=2)
    for n in (0, 2):
        idx = torch.full((B, 1, 9, n), -1, dtype=torch.int64, device=DEVICE)
        o, lse, *grads = run_triton(q, k, v, grad_o, idx, 4, 0.5)
        assert lse.isneginf().all()
        for x in (o, *grads):
            assert torch.equal(x, torch.zeros_like(x))


def test_dkdv_split_into_segments_is_exact_and_deterministic(monkeypatch):
    """Blocks chosen by more than DKV_SEGMENT queries are split over several work items whose
    fp32 partials are summed in a fixed order: same result, bit for bit on a rerun."""
    monkeypatch.setattr(st, "DKV_SEGMENT", 3)
    S, h, G, block_size, n = 33, 3, 2, 8, 3
    q, k, v, grad_o = make_inputs(S, h, G, 24, torch.float32, seed=8)
    idx = random_block_idx(B, G, S, n, block_size, seed=8)
    tiles = {"dense": False}  # the inverted selection (the dense mode has no segments)
    first = run_triton(q, k, v, grad_o, idx, block_size, 0.25, tiles)
    ref = reference(q, k, v, grad_o, idx, block_size, 0.25)
    assert_kernel_matches_reference((first[0], *first[2:]), ref, torch.float32, "segments")
    again = run_triton(q, k, v, grad_o, idx, block_size, 0.25, tiles)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_dense_mode_is_chosen_for_few_blocks_only():
    """`_tiles` reads every block (no union, no inverted selection) for block ids per query head
    (h = 1) while the K/V blocks are at most DENSE_BLOCKS * n, not with packed documents, and a
    chunk of queries counts K/V's blocks."""
    n = 16
    dense = lambda S, h=1, **kw: st._tiles(h, 64, 64, 64, seq_len=S, n_selected=n, **kw)["dense"]
    limit = st.DENSE_BLOCKS * n * 64
    assert dense(limit) and not dense(limit + 1)
    assert not dense(limit, h=6)  # group-shared choices: the union (measured faster on a real model)
    assert not dense(limit, packed=True)
    assert not dense(512, keys=limit + 1)  # a chunk of 512 queries of a longer sequence
    assert not st._tiles(1, 64, 64, 64, override={"dense": False}, seq_len=limit, n_selected=n)["dense"]
    assert st._tiles(6, 64, 64, 64, override={"dense": True}, seq_len=4 * limit, n_selected=n)["dense"]
    # the dense mode's fwd/dq loops pipeline 3 stages at D <= 64 (measured), the union's 2
    stages = lambda S, D=64, **kw: {st._tiles(1, D, D, 64, seq_len=S, n_selected=n, **kw)[k]["num_stages"]
                                    for k in ("fwd", "dq")}
    assert stages(limit) == {3} and stages(limit + 1) == {2} and stages(limit, D=128) == {2}
    assert stages(4 * limit, override={"dense": True}) == {3}


def test_dense_mode_is_deterministic_and_skips_the_inversion(monkeypatch):
    """The dense backward builds no inverted selection and no union (both are poisoned here), and
    a rerun gives the same bits."""
    S, h, G, block_size, n = 33, 1, 3, 8, 3
    q, k, v, grad_o = make_inputs(S, h, G, 24, torch.float32, seed=9)
    idx = random_block_idx(B, G, S, n, block_size, seed=9)
    assert st._tiles(h, DK, 24, block_size, True, seq_len=S, n_selected=n)["dense"]  # 5 blocks <= 2 * 3

    def poisoned(*args, **kwargs):
        raise AssertionError("the dense mode must not build the inverted selection")

    monkeypatch.setattr(st, "_inverted_selection", poisoned)
    first = run_triton(q, k, v, grad_o, idx, block_size, 0.25)
    again = run_triton(q, k, v, grad_o, idx, block_size, 0.25)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_many_heads_and_wide_head_dims():
    """h = 65 > the largest head tile (several head tiles per token; (query, head) pairs of the
    dk/dv kernel span queries), and head dims > 128 that are not powers of two, Dk != Dv."""
    for S, h, G, dk, dv in ((5, 65, 1, 16, 8), (9, 2, 1, 200, 136)):
        q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=h, dk=dk)
        idx = random_block_idx(B, G, S, 2, 4, seed=h)
        ours = run_triton(q, k, v, grad_o, idx, 4, dk**-0.5)
        ref = reference(q, k, v, grad_o, idx, 4, dk**-0.5)
        assert_kernel_matches_reference((ours[0], *ours[2:]), ref, torch.float32, f"h={h} dk={dk}")


def test_unsupported_reason(monkeypatch):
    q, k, v, _ = make_inputs(4, 2, 1, 8, torch.float32, seed=0)
    idx = random_block_idx(B, 1, 4, 2, 4, seed=0)
    assert st.unsupported_reason(q, k, v, idx, 4) is None
    assert st.unsupported_reason(q, k, v, idx, 4, positions([1, 3], [4])) is None  # packed documents run
    assert "dtype" in st.unsupported_reason(q.double(), k.double(), v.double(), idx, 4)
    assert "dtype" in st.unsupported_reason(q, k, v.half(), idx, 4)
    assert "head dim" in st.unsupported_reason(q.new_zeros(B, 2, 4, 300), k.new_zeros(B, 1, 4, 300), v, idx, 4)
    assert "int64" in st.unsupported_reason(q, k, v, idx.int(), 4)
    assert "block_size" in st.unsupported_reason(q, k, v, idx, 0)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "device cpu" in st.unsupported_reason(q, k, v, idx, 4)
        assert "device cpu" in st.unsupported_reason(q, k, v, idx, 4, positions([1, 3], [4]))
        with pytest.raises(ValueError, match="device cpu"):
            st.selected_forward(q, k, v, idx, 4, 0.5)


def test_module_imports_without_triton():
    out = run_without_triton(
        "import torch\n"
        "from nsa_compile.ops import selection_triton as st\n"
        "x = torch.zeros(1, 1, 4, 8)\n"
        "print(st.unsupported_reason(x, x, x, torch.zeros(1, 1, 4, 1, dtype=torch.int64), 4))\n"
    )
    assert "triton is not installed" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_with_backend_triton_matches_backend_reference_through_autograd(dtype):
    """The op's plumbing around the kernels: (o, lse) saved for the backward, the layouts the
    fakes promise, gradients for q, k, v; against the reference backend on the same inputs."""
    S, h, g, n, ls = 23, 3, 2, 3, 4
    q, k, v, grad_o = make_inputs(S, h, g, 8, dtype, seed=11)
    idx = random_block_idx(B, g, S, n, ls, seed=11)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_backend_matches_reference(torch.ops.nsa.selected_attention, "triton", q, k, v, grad_o, idx, ls, 0.4,
                                     rtol=tol, atol=tol)


def test_jit_builds_each_mode_with_that_modes_helpers_and_reductions(monkeypatch):
    """triton_support.jit: a module-level kernel is handed to triton.jit per mode, read from
    TRITON_INTERPRET at first use (set after import here), and kept. Compiled, the helpers it
    calls are their compiled objects and the reductions tl.max / tl.sum themselves (what
    @triton.jit at module level would see; the GPU tests launch them); interpreted, their
    interpreted objects and tl.reduce stand-ins. The kernel module's own globals stay as written."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from nsa_compile.ops import attention_tiles
    from nsa_compile.ops.triton_support import reduce_max, reduce_min, reduce_sum

    built = {}
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        built[interpret] = st.fwd_kernel.built()
        assert st.fwd_kernel.built() is built[interpret]  # kept
        update = attention_tiles.softmax_update.built()
        assert built[interpret].fn.__globals__["softmax_update"] is update
        if interpret == "0":
            assert (reduce_max.built(), reduce_min.built(), reduce_sum.built()) == (tl.max, tl.min, tl.sum)
            assert update.fn.__globals__["reduce_max"] is tl.max
        else:
            assert not {reduce_max.built(), reduce_min.built(), reduce_sum.built()} & {tl.max, tl.min, tl.sum}
            assert update.fn.__globals__["reduce_max"] is not tl.max
    assert isinstance(built["0"], JITFunction) and isinstance(built["1"], InterpretedFunction)
    assert st.softmax_update is attention_tiles.softmax_update and attention_tiles.reduce_max is reduce_max


# --- packed documents (pos) ---------------------------------------------------------------------


def positions(*rows):
    """pos [len(rows), S] on DEVICE: each row packed with documents of the given lengths (each
    row's lengths sum to S)."""
    return torch.stack([positions_from_cu_seqlens(torch.tensor([0, *itertools.accumulate(r)]), sum(r))
                        for r in rows]).to(DEVICE)


def packed_block_idx(pos, g, n, block_size, seed):
    """A valid selection [B, g, S, n] with packed documents, as select_blocks makes it: blocks
    counted within each query's document, its current block pos[t] // l' forced, the rest distinct
    random earlier blocks of its document, ascending, -1 padded."""
    b, S = pos.shape
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-S // block_size), n)
    j = torch.arange(width)
    cur = (pos.cpu() // block_size)[:, None, :, None]  # [b, 1, S, 1]
    key = torch.rand(b, g, S, width, generator=gen)
    key = torch.where(j == cur, 2.0, key).masked_fill(j > cur, float("-inf"))
    val, idx = key.topk(n, dim=-1)
    idx = torch.where(val > float("-inf"), idx, width).sort(dim=-1).values
    return torch.where(idx == width, -1, idx).to(DEVICE)


def packed_reference(q, k, v, grad_o, block_idx, block_size, scale, pos):
    """o, dq, dk, dv and lse of the reference backend with pos, in float32 at the same inputs."""
    f = lambda x: x.float()
    o, lse = sel_ref._reference_forward(f(q), f(k), f(v), block_idx, block_size, scale, pos=pos)
    grads = sel_ref._reference_backward(f(grad_o), f(q), f(k), f(v), block_idx, block_size, scale, pos=pos)
    return (o, *grads), lse


def run_packed(q, k, v, grad_o, block_idx, block_size, scale, pos, tiles=None, segment=None):
    o, lse = st.selected_forward(q, k, v, block_idx, block_size, scale, pos, tiles=tiles)
    grads = st.selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, pos, tiles=tiles,
                                 segment=segment)
    return (o, *grads), lse


def check_packed(ours, lse, ref, ref_lse, dtype, what):
    assert_kernel_matches_reference(ours, ref, dtype, what)
    assert_lse_close(lse, ref_lse, 1e-4 if dtype == torch.float32 else 2e-2, what)


# S 37..70, two rows: documents of 1 token, shorter than a block, not multiples of l' (blocks cut
# by the l' grid), a row of one document; l' not a power of two, and one above a K/V chunk
PACKED_CASES = [  # rows of document lengths, h, G, block_size, n, Dv, dtype
    (([1, 20, 7, 25], [40, 3, 1, 9]), 3, 2, 4, 3, 8, torch.float32),
    (([16, 1, 32, 4], [53]), 1, 1, 6, 2, 24, torch.float32),
    (([5, 1, 31], [12, 12, 13]), 4, 1, 8, 4, 8, torch.float32),
    (([2, 29, 1, 15, 23], [70]), 3, 2, 8, 3, 24, torch.bfloat16),
    (([33, 1, 7], [1, 1, 39]), 2, 2, 5, 3, 16, torch.float16),
]


@pytest.mark.parametrize("rows,h,G,block_size,n,dv,dtype", PACKED_CASES,
                         ids=[str(c).replace(" ", "") for c in PACKED_CASES])
def test_packed_documents_match_the_reference(rows, h, G, block_size, n, dv, dtype):
    """Forward and backward with pos against the reference backend with the same pos: the
    default query tiles (a union of many queries' blocks, named by their first tokens) and one
    query per program (its own list, one document start)."""
    pos = positions(*rows)
    S = pos.shape[1]
    seed = S * 31 + h * 7 + G + n
    q, k, v, grad_o = make_inputs(S, h, G, dv, dtype, seed)
    idx = packed_block_idx(pos, G, n, block_size, seed).clone()
    idx[1, G - 1, S - 2, :2] = idx[1, G - 1, S - 2, 1].item()  # a duplicated block: counts twice
    scale = DK**-0.5
    ref, ref_lse = packed_reference(q, k, v, grad_o, idx, block_size, scale, pos)
    one_query = {kernel: {"TQ": 1, "ROWS": 16} for kernel in ("fwd", "dq")}
    for tiles in (None, one_query):
        ours, lse = run_packed(q, k, v, grad_o, idx, block_size, scale, pos, tiles=tiles)
        check_packed(ours, lse, ref, ref_lse, dtype, f"rows={rows} l'={block_size} tiles={tiles}")
    # the document mask is live: without pos the same block ids give other results
    unpacked = st.selected_forward(q, k, v, idx, block_size, scale)[0]
    assert not torch.allclose(unpacked.float(), ref[0], rtol=1e-2, atol=1e-2)


def test_the_longest_document_plans_the_tiles_of_a_packed_row():
    """doc_len (the varlen pass's hint: the longest document, known when the positions are a
    constant) plans the tiles for a document's length, not the row's: rows of 96 tokens in
    documents of at most 12 has 24 blocks of 4 (> 4 n, one query per program) but at most 3 a
    document (a union tile of 64 // h queries). The results are the reference's either way, and a
    hint without pos, or a negative one, is refused by the op. bf16 (fp32 runs one query a program)."""
    pos = positions([12, 9, 12, 11, 12, 4, 12, 12, 12], [12] * 8)  # B rows
    S, h, G, block_size, n = pos.shape[1], 4, 1, 4, 2
    tile = lambda doc_len: st._tiles(h, DK, 8, block_size, seq_len=st._tile_len(S, pos, doc_len), n_selected=n,
                                     packed=True)["fwd"]["TQ"]
    assert (tile(0), tile(12), tile(S + 5)) == (1, 16, 1)
    assert st._tile_len(S, None, 12) == S  # a hint for packed documents only
    q, k, v, grad_o = make_inputs(S, h, G, 8, torch.bfloat16, 5)
    idx = packed_block_idx(pos, G, n, block_size, 5)
    ref, ref_lse = packed_reference(q, k, v, grad_o, idx, block_size, DK**-0.5, pos)
    for doc_len in (0, 12):
        o, lse = st.selected_forward(q, k, v, idx, block_size, DK**-0.5, pos, 0, doc_len)
        grads = st.selected_backward(grad_o, q, k, v, o, lse, idx, block_size, DK**-0.5, pos, 0, doc_len)
        check_packed((o, *grads), lse, ref, ref_lse, torch.bfloat16, f"doc_len={doc_len}")
    for doc_len, where in ((12, None), (-1, pos)):
        with pytest.raises(ValueError, match="doc_len must be an int >= 0, and 0 without pos"):
            torch.ops.nsa.selected_attention(q, k, v, idx, block_size, 0.5, "reference", where, 0, doc_len)


@pytest.mark.parametrize("tq,rows", [(3, 16), (5, 32)])
def test_packed_query_tiles_across_documents(tq, rows):
    """Query tiles that span document starts (TQ 3 and 5 over documents of 1, 2, 4 and 6 tokens):
    rows of one tile name the same ids for different blocks and different ids for the same
    block; lists in any order with repeats that are not adjacent."""
    pos = positions([1, 2, 6, 4, 1, 15], [4, 1, 24])
    S, h, G, block_size, n, dv = 29, 3, 2, 2, 4, 8
    q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=tq)
    idx = packed_block_idx(pos, G, n, block_size, seed=tq)
    idx = idx.gather(-1, torch.rand(idx.shape, generator=torch.Generator().manual_seed(tq)).argsort(-1).to(DEVICE))
    idx[0, 0, S - 3, 2] = idx[0, 0, S - 3, 0].item()  # a repeat, not next to its first copy
    idx[1, 1, 12] = torch.tensor([2, -1, 2, 0])  # another, with padding between (t 12: pos 7)
    tiles = {kernel: {"TQ": tq, "ROWS": rows} for kernel in ("fwd", "dq")}
    ours, lse = run_packed(q, k, v, grad_o, idx, block_size, 0.4, pos, tiles=tiles)
    ref, ref_lse = packed_reference(q, k, v, grad_o, idx, block_size, 0.4, pos)
    check_packed(ours, lse, ref, ref_lse, torch.float32, f"TQ={tq}")


def test_packed_rows_without_a_token_give_zeros():
    """Rows whose choices hold no token of their document up to them (all -1; only a block after
    the query, counted from its document start) get o 0, lse -inf, zero dq, and no NaN anywhere;
    the rest is the reference backend's."""
    pos = positions([10, 1, 22], [33])
    S, h, G, block_size = 33, 2, 2, 4
    q, k, v, grad_o = make_inputs(S, h, G, 8, torch.float32, seed=5)
    idx = packed_block_idx(pos, G, 3, block_size, seed=5).clone()
    empty = [(0, 1, 5), (1, 0, 10), (0, 0, 10), (0, 1, 20)]  # (b, g, t)
    idx[0, 1, 5] = -1  # no block
    idx[1, 0, 10] = torch.tensor([3, -1, -1])  # block 3 of its document starts at token 12 > 10
    idx[0, 0, 10] = torch.tensor([1, -1, -1])  # t 10: position 0 of a one-token document; block 1 is past it
    idx[0, 1, 20] = torch.tensor([3, 3, -1])  # t 20: position 9; block 3 starts at 23
    ours, lse = run_packed(q, k, v, grad_o, idx, block_size, 0.3, pos)
    ref, ref_lse = packed_reference(q, k, v, grad_o, idx, block_size, 0.3, pos)
    check_packed(ours, lse, ref, ref_lse, torch.float32, "empty rows")
    for x in (*ours, lse):
        assert not x.isnan().any()
    o, dq = ours[0], ours[1]
    for b, g, t in empty:
        heads = slice(g * h, (g + 1) * h)
        assert torch.equal(o[b, heads, t], torch.zeros_like(o[b, heads, t]))
        assert torch.equal(dq[b, heads, t], torch.zeros_like(dq[b, heads, t]))
        assert lse[b, heads, t].isneginf().all()


@pytest.mark.parametrize("tq", [1, 4])
def test_packed_all_padding_and_no_blocks_give_zeros(tq):
    pos = positions([3, 2, 4], [9])
    q, k, v, grad_o = make_inputs(9, 3, 1, 8, torch.float32, seed=2)
    tiles = {kernel: {"TQ": tq, "ROWS": 16} for kernel in ("fwd", "dq")}
    for n in (0, 2):
        idx = torch.full((B, 1, 9, n), -1, dtype=torch.int64, device=DEVICE)
        ours, lse = run_packed(q, k, v, grad_o, idx, 4, 0.5, pos, tiles=tiles)
        assert lse.isneginf().all()
        for x in ours:
            assert torch.equal(x, torch.zeros_like(x))


def test_packed_dkdv_split_into_segments_is_exact_and_deterministic(monkeypatch):
    """With pos and blocks chosen by more entries than a segment (split over several items whose
    fp32 partials are summed in a fixed order): the reference's result, bit for bit on a rerun."""
    pos = positions([9, 1, 3, 20], [17, 16])
    S, h, G, block_size, n = 33, 3, 2, 8, 3
    q, k, v, grad_o = make_inputs(S, h, G, 24, torch.float32, seed=8)
    idx = packed_block_idx(pos, G, n, block_size, seed=8)
    first, lse = run_packed(q, k, v, grad_o, idx, block_size, 0.25, pos, segment=3)
    ref, ref_lse = packed_reference(q, k, v, grad_o, idx, block_size, 0.25, pos)
    check_packed(first, lse, ref, ref_lse, torch.float32, "segments")
    again, _ = run_packed(q, k, v, grad_o, idx, block_size, 0.25, pos, segment=3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    default, _ = run_packed(q, k, v, grad_o, idx, block_size, 0.25, pos)  # one segment a block
    assert_kernel_matches_reference(default, ref, torch.float32, "one segment")


def test_packed_inverted_selection_lists_a_cut_block_under_both_grid_blocks():
    """The inversion with pos: a choice whose block the l' grid cuts is listed under both grid
    blocks it reaches (with its first token), one on the grid once, one whose second part lies
    after the query not at all."""
    pos = positions([3, 13])  # the second document starts at token 3
    idx = torch.full((1, 1, 16, 1), -1, dtype=torch.int64, device=DEVICE)
    idx[0, 0, 15, 0] = 2  # t 15 (position 12): block 2 of its document = tokens 11..14: grid blocks 2, 3
    idx[0, 0, 2, 0] = 0  # t 2 (position 2): tokens 0..3 = grid block 0
    idx[0, 0, 8, 0] = 1  # t 8 (position 5): tokens 7..10: grid block 1 (7) and 2 (8..10, all <= 8? 8 only)
    idx[0, 0, 5, 0] = 0  # t 5 (position 2): tokens 3..6: grid block 0 (3) and 1 (4..5 <= 5)
    idx[0, 0, 4, 0] = 0  # t 4 (position 1): tokens 3..6: grid block 0 (3) and 1 (4)
    qtok, qoff, _, _, _, _, _, NB, qstart = st._inverted_selection(idx, 4, 16, 1024, pos)
    listed = {blk: list(zip(qtok[qoff[blk]:qoff[blk + 1]].tolist(), qstart[qoff[blk]:qoff[blk + 1]].tolist()))
              for blk in range(NB)}
    assert listed == {0: [(2, 0), (4, 3), (5, 3)], 1: [(4, 3), (5, 3), (8, 7)], 2: [(8, 7), (15, 11)],
                      3: [(15, 11)]}


@pytest.mark.parametrize("blocks", [40, 40_000])  # NK below and above int16's range: int16 and int32 keys
def test_inverted_selection_lists_each_blocks_queries_in_token_order_at_either_key_width(blocks):
    """The inversion's sort keys are the narrowest integers that hold NK = B*G*NB (int16 below
    32,767, else int32; a radix sort pass per 8 bits): at either width each block lists the
    tokens that chose it (valid entries only: id <= t // l'), ascending, and a token that chose it
    twice twice, as a stable argsort of the entries computed here in int64 says."""
    S, n, block_size = blocks, 3, 1  # l' 1: NB = S blocks, so NK = S (B = G = 1)
    gen = torch.Generator().manual_seed(blocks)
    t = torch.arange(S)[:, None]
    idx = (torch.rand(1, 1, S, n, generator=gen) * (t + 1)).long()  # ids <= t (valid), repeats allowed
    idx[0, 0, ::7, 1] = -1  # padding
    idx[0, 0, 5, 2] = S - 1  # a future block (t 5 < S - 1): not listed
    qtok, qoff, *_, NB, _ = st._inverted_selection(idx.to(DEVICE), block_size, S, 1024)
    valid = (idx >= 0) & (idx <= t)
    key = torch.where(valid, idx, NB).flatten()
    want_tok = (torch.sort(key, stable=True).indices // n)[: int(valid.sum())]
    want_off = torch.searchsorted(torch.sort(key).values, torch.arange(NB + 1))
    assert NB == S and torch.equal(qoff.cpu().long(), want_off)
    assert torch.equal(qtok.cpu().long()[: int(valid.sum())], want_tok)


@pytest.mark.parametrize("packed, q_offset", [(False, 0), (False, 6), (True, 0)])
def test_tile_union_lists_each_tiles_distinct_blocks_ascending(packed, q_offset):
    """`_tile_union` (union_kernel) against sets built here: per (batch, group, tile of TQ
    queries) the distinct block ids that hold a token the choosing query sees (0 <= id < NB,
    id * l' <= its token q_offset + t; padding, ids past the keys and blocks chosen after their
    query dropped), or with pos the distinct first tokens t - pos[t] + id * l' in [0, t],
    ascending, and their count; the last tile partial (S % TQ != 0), repeated ids within and
    across rows. Future choices are frequent here (ids drawn up to 8 for every row), as a
    non-causal block choice (tests/corpus/nsa_vibe_noncausal.py) makes them."""
    S, TQ, n, ls, G = 29, 4, 3, 4, 2
    keys = S + q_offset  # a chunk of queries: K/V hold the tokens before it too
    NB = -(-keys // ls)
    pos = positions([5, 1, 11, 12], [29]) if packed else None
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, NB + 1, (B, G, S, n), generator=gen)  # -1 padding, ids past NB
    idx[0, 1, 6, :] = 1  # one row naming a block three times
    union, count, NT = st._tile_union(idx.to(DEVICE), ls, S, TQ, None if pos is None else pos, keys,
                                      q_offset=q_offset)
    assert NT == 8 and tuple(union.shape) == (B * G, NT, TQ * n + 1)
    dropped = 0
    for b in range(B):
        for g in range(G):
            for tile in range(NT):
                rows = range(tile * TQ, min(S, tile * TQ + TQ))
                if packed:
                    want = {int(t - pos[b, t]) + int(i) * ls for t in rows for i in idx[b, g, t] if i >= 0
                            if 0 <= int(t - pos[b, t]) + int(i) * ls <= t}
                    want = sorted(want)
                else:
                    want = sorted({int(i) for t in rows for i in idx[b, g, t] if 0 <= i < NB and i * ls <= q_offset + t})
                    dropped += sum(1 for t in rows for i in idx[b, g, t] if 0 <= i < NB and i * ls > q_offset + t)
                got = union[b * G + g, tile, : int(count[b * G + g, tile])].tolist()
                assert got == want, (b, g, tile)
    assert packed or dropped > 20  # the future choices were there to drop


def test_packed_op_with_backend_triton_matches_backend_reference_through_autograd():
    """The op with pos, backend triton named, against backend reference (pos reaches the kernels
    through the op's forward and backward)."""
    pos = positions([4, 1, 18], [23])
    S, h, g, n, ls = 23, 3, 2, 3, 4
    q, k, v, grad_o = make_inputs(S, h, g, 8, torch.float32, seed=11)
    idx = packed_block_idx(pos, g, n, ls, seed=11)

    def op(q, k, v, block_idx, block_size, scale, pos, backend):  # the helper passes backend last
        return torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend, pos)

    assert_backend_matches_reference(op, "triton", q, k, v, grad_o, idx, ls, 0.4, pos, rtol=1e-4, atol=1e-4)


def test_auto_takes_triton_with_packed_documents():
    """auto with pos on (fake) CUDA tensors: triton, as without pos; on the CPU the kernels' own
    reason is None for valid pos, auto's the device, and triton named runs (interpreted)."""
    with torch._subclasses.fake_tensor.FakeTensorMode():
        def cuda(shape, dtype):
            return torch.empty(shape, dtype=dtype, device="cuda")

        q, k, v = cuda((1, 4, 8, 16), torch.bfloat16), cuda((1, 2, 8, 16), torch.bfloat16), cuda((1, 2, 8, 8),
                                                                                              torch.bfloat16)
        idx, pos = cuda((1, 2, 8, 2), torch.int64), cuda((1, 8), torch.int64)
        assert sel_ref.why_not_triton(q, k, v, idx, 4, pos) is None
        assert sel_ref.choose_backend(q, k, v, idx, 4, "auto", pos) == "triton"
    pos = positions([3, 5], [8])
    q, k, v, _ = make_inputs(8, 2, 2, 8, torch.bfloat16, seed=0)
    idx = packed_block_idx(pos, 2, 2, 4, seed=0)
    assert st.unsupported_reason(q, k, v, idx, 4, pos) is None
    if DEVICE == "cpu":
        assert "on CUDA (tensors on cpu)" in sel_ref.why_not_triton(q, k, v, idx, 4, pos)
        assert sel_ref.choose_backend(q, k, v, idx, 4, "triton", pos) == "triton"
    else:
        assert sel_ref.choose_backend(q, k, v, idx, 4, "auto", pos) == "triton"


@pytest.mark.gpu
def test_packed_seed_shape_on_cuda_matches_the_reference():
    """The seed's shape on the GPU: S 2048, documents of 100..800 tokens, bf16, h 6, G 2, D 64,
    l' 64, n 16 (the default tiles: 10 queries a program); auto takes triton with pos; output,
    lse and gradients against the reference backend with the same pos (in fp32 on the same bf16
    inputs), and the backward repeats bit for bit."""
    rows = [random_lengths(2048, 100, 800, seed=2048 + b) for b in range(B)]
    pos = positions(*rows)
    q, k, v, grad_o = make_inputs(2048, 6, 2, 64, torch.bfloat16, seed=20, dk=64)
    idx = packed_block_idx(pos, 2, 16, 64, seed=20)
    assert sel_ref.choose_backend(q, k, v, idx, 64, "auto", pos) == "triton"
    ours, lse = run_packed(q, k, v, grad_o, idx, 64, 0.125, pos)
    ref, ref_lse = packed_reference(q, k, v, grad_o, idx, 64, 0.125, pos)
    check_packed(ours, lse, ref, ref_lse, torch.bfloat16, f"seed packed {rows}")
    again, _ = run_packed(q, k, v, grad_o, idx, 64, 0.125, pos)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))


@pytest.mark.gpu
@pytest.mark.parametrize("S,block_size,n", [(300, 64, 16), (2048, 16, 4)])  # 10 queries a program, and one
def test_packed_kernels_sync_nothing_and_capture_in_a_cuda_graph(S, block_size, n):
    """With pos, forward and backward (kernels and the torch ops that build the union and the
    inverted selection) read no value back to the host (torch's sync debug mode set to raise)
    and replay from a CUDA graph with the eager call's bits."""
    pos = positions([1, 120, 33, S - 154], [S])
    q, k, v, grad_o = make_inputs(S, 6, 2, 64, torch.bfloat16, seed=31, dk=64)
    idx = packed_block_idx(pos, 2, n, block_size, seed=31)
    assert st._tiles(6, 64, 64, block_size, seq_len=S, n_selected=n)["fwd"]["TQ"] == (10 if S == 300 else 1)

    def step():
        return run_packed(q, k, v, grad_o, idx, block_size, 0.125, pos)

    (eager, eager_lse) = step()  # the first call builds the kernels
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_lse = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((*captured, captured_lse), (*eager, eager_lse)))


def test_schedule_says_which_way_the_kernels_read_the_blocks():
    """explain's words for `_tiles`' choice: dense for per-head ids and few blocks, else the union
    and the inverted selection; at a symbolic length, the rule."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    union = "the query tiles' union of chosen blocks, dK/dV from the inverted selection"
    assert st.schedule(1, 2048, 64, 16) == "dense: every block up to a tile's last query (32 blocks <= 2 n), no union, no sort"
    assert st.schedule(1, 2049, 64, 16) == union  # 33 blocks
    assert st.schedule(6, 2048, 64, 16) == union
    assert st.schedule(1, 2048, 64, 16, packed=True) == union
    symbolic = ShapeEnv().create_unbacked_symint()  # a length known only at run time
    assert st.schedule(1, symbolic, 64, 16) == f"dense while ceil(S / l') <= 32, else {union}"
    for h, S, packed in ((1, 2048, False), (1, 2049, False), (6, 2048, False), (1, 2048, True)):
        dense = st._tiles(h, 64, 64, 64, seq_len=S, n_selected=16, packed=packed)["dense"]
        assert st.schedule(h, S, 64, 16, packed).startswith("dense") == dense
