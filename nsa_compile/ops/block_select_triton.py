"""Triton kernel for NSA block selection (section 3): importance recomputed from the compressed
branch's log-sum-exp, mapped onto selection blocks and ranked, in one pass, without storing
the [B, H, S, Tc] probabilities or the [B, G, S, Ns] scores.

    block_idx = select_blocks_forward(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, pos=None,
                                      importance_dtype=None, group_sum_dtype=None, q_offset=0, group_first=False,
                                      fla=False, lucid=False, vibe=False)
    why = unsupported_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos=None, importance_dtype=None,
                             group_first=False, fla=False, lucid=False, vibe=False)   # None: it can run

Same contract as the `reference` backend of `nsa::select_blocks` (nsa_compile/ops/block_select.py):
q [B, H, S, Dk], pooled keys k [B, G, Tc, Dk] (H = G * h), lse [B, H, S] float32, any strides;
block_idx [B, G, S, n] int64 (contiguous), ascending, -1 padded (rule 'fla': rank order, -1 after the
blocks chosen; rule 'lucidrains': lse None, [B, G, S, n + 1], rank order, the diagonal block last).
With l = cmp_block, d = cmp_stride, l' = sel_block, m = l' / d (compression strides per selection block).

The kernel, grid (ceil(S / BLOCK_M), B * G): one program per (query tile of BLOCK_M tokens, batch,
group); the tiles of one (batch, group) run heaviest (latest) first, for a short tail. It loads the
group's h heads of its BLOCK_M queries as the rows of one [BLOCK_M * HC, Dk] tile (row = query *
HC + head; HC = the next power of two of h, at most 16 (1 for fp32); more heads are several
chunks of HC, reloaded per tile) and its lse, then walks the compression blocks in tiles of TC
(TC * d = NS * l': a tile holds NS whole selection blocks), up to the last selection block its
latest query may choose, the next tile's keys loaded while this one is worked on (Triton's
pipeliner leaves this loop alone):
- s = q_rows @ k_tile^T (fp32 accumulation; fp32 inputs with IEEE precision, no TF32), rounded to
  the input dtype and back as eager's `upcast(q @ k^T)` does, times scale (an fp32 scalar, as
  eager's multiply by a Python float);
- p = exp(s - lse) where block i is visible to the row's token t (i*d + l - 1 <= t, i < Tc), else 0;
- the group's heads summed (one reduction over the head axis of the [BLOCK_M, HC, TC] view);
- the overlap map onto the tile's NS selection blocks as one fp32 IEEE tl.dot of [previous tile's
  sums | this tile's sums] (2*TC columns, ascending compression block) with the constant
  [2*TC, KS] matrix of overlap(i, j) / l (built on the host with eager's arithmetic; the previous
  tile supplies the l/d - 1 compression blocks that reach into the first selection block; column
  j >= NS is zero and never a candidate);
- the ranking key of eager, packed into one int64 per (query, block), high word the float32 bits
  of the key (+inf for forced blocks, p_grp >= 0 for candidates: nonnegative floats order like
  their bits) or -1 for a non-candidate, low word 2^31 - 1 - j, so that a descending order of the
  integers is eager's stable descending sort (ties to the lower block index) and no two keys of a
  row are equal;
- merged into a running top-KS per query (sorted descending, in registers): the tile's keys are
  sorted ascending by a bitonic network, the elementwise max with the running list is the top KS
  of both (a bitonic sequence), a bitonic merge sorts it. The merge is skipped when no key of the
  tile beats any query's running minimum.
At the end the first n of each query's list that are > -1 (forced or candidates) are decoded,
sorted ascending by the same network, and written with -1 padding.

Packed documents (pos [B, S] int64; k holds a slot per token, Tc = S - l + 1): query t is the
unpacked query pos[t] of its document, and that document's i-th compression block (at document
position i*d: the overlap matrix is the unpacked one) is compact slot lo[t] + i of
compressed_triton.document_slots (the row's blocks in token order, built on the device: no host
sync). So the kernel above runs with pos[t] in place of t (visibility i*d + l - 1 <= pos[t],
forced blocks from pos[t] // l', candidates j*l' <= pos[t]) and keys read at the tokens where
compact slots lo + i start. A query tile may hold several documents: its rows are taken in
groups of one lo, one pass over the blocks each (up to the group's latest current block), the
other groups' queries getting no keys in that pass; a document without blocks shares the next
document's lo (its rows see no block either way). The passes are at most one more than the
documents starting inside the tile after its first query. A HAS_POS constexpr (None pointers
without pos) compiles the code without pos exactly as before. This relies on pos counting up
by one inside each document (models.check_positions), as the op's docstring says.

A chunk of queries (the op's q_offset; not with pos): an int argument Q_OFF (one compiled kernel
for every offset) added to each row's token where the token is a position (the visibility
i*d + l - 1 <= t, the current block t // l', the candidates j*l' <= t, the last block a tile
reads), never where it addresses q, lse or the output.

Importance rounded as under autocast (importance_dtype bf16/fp16, the op's docstring): p rounded
per (query, head) row, each head's rows mapped by the rounded overlap matrix in one [ROWS, 2 TC]
x [2 TC, KS] fp32 dot, rounded, summed over the group's heads in fp32 and rounded, then ranked as
above (the heads are not summed first: eager rounds each head's map). One chunk of heads only
(NHC == 1: h <= 16 in fp16/bf16), since each head's previous tile is kept. group_sum_dtype float32
(CUDA autocast's sum): the group sum is kept in fp32, not rounded. group_first (a GROUP_FIRST
constexpr; eager's torch.einsum('bghsc,cj->bgsj', p, map) under autocast, which sums the heads
before the map): p rounded per (query, head) row, the group's heads summed in fp32 (the head axis of
the [BLOCK_M, HC, TC] view, added up over the chunks of heads) and rounded, then mapped as the
unrounded importance is, by one IEEE fp32 dot of [previous tile's rounded sums | this tile's] with
the rounded overlap matrix (exact products, fp32 accumulation), and rounded: the einsum's output,
no group sum after it. Only the group's sums are kept from tile to tile, so any number of chunks
of heads runs. Without GROUP_FIRST the kernel compiles as it did before the flag.

Rule 'fla' (an FLA constexpr; flash-linear-attention's choice, the op's docstring): no forced block
and the current block favoured by each head's importance of it set to 1.0 before the group sum. The
group's key of the current block is then HPG * 1.0 = h exactly, however its sum is ordered or
rounded (h ones are exact in fp32 and, for h <= 16, in bf16/fp16), so the kernel writes h there
after the importance is computed as above (unrounded: the heads summed first, then the map;
rounded: each head mapped and rounded, the group sum rounded or, group_sum_dtype float32, not); the
other blocks' keys are the paper's rule's candidates'. Every block competes in the rule, but only
the blocks up to each query's current block get a key here (the candidates j*l' <= t above, the
tiles walked up to the latest query's current block): no compression block that overlaps a block j
after the current one is visible (it ends at i*d + l - 1 >= j*l' > t), so that block's importance
is +0.0; in the stable descending order it comes after every earlier block (those of key > 0 by
the key, those of key 0 by the lower index), and every later block in the top n becomes -1. So the
rule's ids are the first n of the earlier blocks in rank order, then -1 (also where Ns < n): the
first n keys of the running list in its own descending order, decoded without the ascending sort.
With Q_OFF the current block is (Q_OFF + t) // l' as above. Not with pos or group_first (the op has
neither for the rule). The rule's ties decide its rank order, and one is systematic: a lone visible
block (one visible compression block; l = d = l': the rows t in [l', 2l') with block 0) has p
exactly 1 in eager's softmax and in the reference wherever lse is that block's score, so its key
ties the current block's h and the lower block goes first. FLA kernels are therefore compiled
without fused multiply-adds (FLA_OPTIONS: Triton's enable_fp_fusion=False), so s * scale is
rounded before - lse is subtracted, as the reference does (a fused s * scale - lse leaves the
product's rounding error in the exponent: p one unit from 1, on either side of the tie); the paper's
rule keeps its fused form (its ids are a set, ascending). Without FLA the kernel compiles as it did
before the flag (the same sm_90 PTX but for line numbers).

Rule 'nsa_vibe' (a VIBE constexpr; the op's docstring: not causal): lse None. A first kernel,
`vibe_lse_kernel` (grid (ceil(S / BLOCK_M), B * H)), computes each row's logsumexp over every
compression block (online max and sum in fp32) of s = q @ k^T rounded to q's dtype, times scale
rounded again (`_rounded`, as eager's bf16 einsum and multiply), into an fp32 [B, H, S] buffer
that select_kernel then reads as it reads the compressed branch's lse. There every compression
block is visible (i < Tc), s is rounded the same way and p = exp(s - lse); the tiles run over the
whole sequence's blocks, every block j < ceil(S / l') is a candidate, the forced blocks as the
paper's, and the first n - 3 + |F| keys are kept (|F| = 1 + min(t // l', 2) distinct forced
blocks), decoded with -1 for the rest and sorted ascending: the -1 first, as eager's last sort.
Without VIBE the kernel compiles as before the flag.

Rule 'lucidrains' (a LUCID constexpr, with P_ROUND and KEEP; lucidrains' choice, the op's
docstring): lse None, no overlap matrix. Each tile's logits are rounded where the reference's ops
round them: s = q @ k^T rounded to q's dtype, times scale rounded again (exact in the interpreter
too: `_rounded`), the group's heads summed in fp32 (padded heads add 0), divided by h (div_rn) and
rounded: the column means; each selection block's mean adds its m = l'/d columns in ascending
order (column r of every block picked exactly, a masked sum of it and zeros, as torch sums
a short row), times 1/m (exact), rounded: a [BLOCK_M, KS]. Candidates are the blocks j < t // l'
(whose columns all end before t) and j < Tc // m. The tiles are walked twice (the outer loop's two
groups): the first pass keeps each query's running max and sum of the softmax (online, from the
sink's logit -1e3 and its 1.0) and gives no key; the second computes p = exp(a - max) / sum
(`_exp`: libdevice's expf, CUDA's own, not tl.exp's ex2.approx; div_rn), rounded to q's dtype
(P_ROUND: the softmax in q's dtype) or not (float32 softmax), and gives each candidate with
p >= KEEP (the smallest p torch's `p > 1e-10` keeps in p's dtype) the key of its p's bits, the
lower block first among equal p as the reference's stable sort; the first n of the list are
written in rank order (no ascending sort), -1 past the kept ones (also where Tc // m < n), and
the diagonal block t // l' in column n. Not with pos, q_offset, group_first, group_sum_dtype or
FLA. The sum's order (online, tile by tile) is not torch's, and the exp is not torch's CPU one: p
can differ from the reference's by an fp32 unit, which moves a bf16/fp16 rounding (or makes or
breaks a float32 tie) in rare rows (the op's docstring). Twice the logit work of one pass: the
probability threshold and a rounded p's ties need the row's whole sum before the ranking. With
h > 1 the group's head sums pass through an exact identity dot first (one element per thread; the
reduction over the heads leaves each entry in several lanes: 1.71 -> 0.57 ms at the seed's h 6,
2k x 32, H200). Without LUCID the kernel compiles to the same sm_90 PTX as before the flag (but for line numbers).

KS = max(16, next power of two of n) >= n: the list keeps at least n, so its first n are eager's.
Summation order: the heads are summed before the overlap map (eager maps each head, then sums),
and on the GPU s * scale - lse is one fused multiply-add (not with FLA, above): both are exact
formulas rounded in fp32 differently, so only near ties (within ~1e-6 relative) can be ranked
differently. Every column of a tile is computed by the same operations, so exact ties stay exact
and go to the lower block.

The bitonic network is this module's own (`_compare_swap` and friends), written with Triton's
builtin reshape / min / max / where, not tl.sort / tl.topk: those are @triton.jit library
functions that Triton's CPU interpreter cannot call from a kernel built after triton was imported
(the tests run the kernel interpreted), so one network serves both and is tested on the CPU.

Supported (`unsupported_reason` says why not): CUDA tensors, or any device under TRITON_INTERPRET=1;
q and k both fp16, bf16 or fp32; Dk <= 256; d divides l and l', m = l' / d a power of two <= 128
(a tile of compression blocks must hold whole selection blocks), l <= (TC + 1) * d (the previous
tile covers the first block's reach); n <= 128; S < 2^31; pos int64 [B, S] with Tc = S - l + 1;
importance_dtype bf16 or fp16, with one chunk of heads unless group_first; group_first with an
importance_dtype and without pos (group_sum_dtype None: the sum is rounded); rule 'fla' without pos
or group_first; rule 'lucidrains' with l'/d <= 16 (one masked sum per column of a block), importance_dtype
None or torch.float32, without lse, pos or group_first (l is not read).

CPU interpreter: the kernel and its helpers are module-level `triton_support.jit` functions, as in
selection_triton.py (built for the mode Triton is in when launched); interpreted, bf16 dot operands
are cast to fp32 first (the interpreter multiplies bf16 as raw bits) and the reductions are
tl.reduce with triton's combine functions (triton_support.reduce_max and friends).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the module still imports; unsupported_reason says why the kernel cannot run
    triton = tl = libdevice = None

from .compressed_triton import document_slots, packed_reason
from .triton_support import (
    KERNEL_DTYPES, cdiv as _cdiv, device_reason, jit, made_aside, next_pow2 as _next_pow2, reduce_max, reduce_min,
    reduce_sum, upcast_dots,
)

__all__ = ["select_blocks_forward", "unsupported_reason"]

MAX_HEAD_DIM = 256
MAX_SELECTED = 128
# rule 'lucidrains': the probability a kept block must exceed (block_select.LUCIDRAINS_THRESHOLD is this
# value: that module imports this one) and the most compressed columns a selection block averages (l' / d;
# one masked sum over the block's columns per column)
LUCID_THRESHOLD, LUCID_MAX_COLUMNS = 1e-10, 16
# rule 'lucidrains': the most bytes of first-pass block means kept for the ranking pass (the seed's
# 2k x 32 at h 6 keeps 16.8 MB; 64k rows would need S^2 / l' floats a group, so they compute again)
MEANS_BUDGET = 256 * 2**20
# rule 'nsa_vibe': query rows per program of the logsumexp kernel
VIBE_LSE_ROWS = 64
_TL_DTYPES = {} if tl is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# rule 'fla' compiles without fused multiply-adds: s * scale is rounded before - lse, as the reference
# computes it, so a lone visible block's p is exactly 1 where lse is its rounded score (the module docstring)
FLA_OPTIONS = {"enable_fp_fusion": False}


def _tiles(h: int, Dk: int, cmp_stride: int, sel_block: int, n_selected: int, fp32: bool,
           override: dict | None = None) -> dict:  # fmt: skip
    """Tile sizes: HC heads per chunk, BLOCK_M queries, TC compression blocks (NS = TC / m
    selection blocks) per tile, KS keys kept per query; warps. Every tl.dot dimension is a power
    of two >= 16: BLOCK_M >= 16 (the overlap dot's rows), HC * BLOCK_M rows in the score dot.
    `override` replaces single entries (tools/bench_block_select.py --tiles)."""
    m = sel_block // cmp_stride
    ks = max(16, _next_pow2(n_selected))
    if fp32:
        # IEEE fp32 dots run on FMA units and need many registers: one head per chunk, small
        # tiles (on sm_90 a few spilled registers at Dk 128, larger tiles spill kilobytes;
        # correct, not fast)
        hc, block_m, tc_cap, warps = 1, 16, 16, 4
    else:
        hc = min(_next_pow2(h), 16)
        block_m = max(16, min(64, 128 // hc))  # rows of the score dot: 128, or 256 at h = 16
        # sm_90 (ptxas, Triton 3.6, bf16): 256 rows (h = 16) with TC 64 take 255 registers (one
        # block per SM either way); 128 rows with TC 32 take 120-160. Timed on an H200 at 64k
        # (BENCHMARKS.md): the seed shape 6.27 ms with 4 warps against 6.78 with 8, and TC 64
        # slower (8.66); the paper shape the same with 4 or 8 warps (22.6 / 22.8)
        tc_cap, warps = (64, 8) if hc * block_m >= 256 else (32, 4)
    tc = max(min(tc_cap, ks * m), m, 16)  # NS = tc / m <= ks, at least one selection block
    tiles = {"HC": hc, "BLOCK_M": block_m, "TC": tc, "KS": ks, "DK_P": max(16, _next_pow2(Dk)), "num_warps": warps}
    for name, value in (override or {}).items():
        if name not in tiles and name != "num_stages":
            raise ValueError(f"_tiles: unknown tile parameter {name!r}")
        tiles[name] = value
    pow2 = lambda x: x >= 1 and x & (x - 1) == 0
    if not (all(pow2(tiles[n]) for n in ("HC", "BLOCK_M", "TC", "KS")) and tiles["BLOCK_M"] >= 16
            and tiles["TC"] >= 16 and tiles["KS"] >= ks and tiles["TC"] % m == 0 and tiles["TC"] // m <= tiles["KS"]):
        raise ValueError(f"_tiles: {tiles} (HC, BLOCK_M, TC, KS powers of two; BLOCK_M, TC >= 16; "
                         f"KS >= {ks}; TC a multiple of l'/d = {m} with TC / {m} <= KS)")  # fmt: skip
    return tiles


def unsupported_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos=None,
                       importance_dtype=None, group_first: bool = False, fla: bool = False,
                       lucid: bool = False, vibe: bool = False) -> str | None:  # fmt: skip
    """Why the Triton kernel cannot run these inputs, or None when it can (pos: packed documents,
    [B, S] int64, with k holding a slot per token; importance_dtype: None, bf16 or fp16;
    group_first: the group's rounded heads summed before the block map, with importance_dtype;
    fla: the op's rule 'fla', without pos or group_first; lucid: the op's rule 'lucidrains', lse
    None, importance_dtype None or torch.float32 (the softmax in float32), no pos, group_first or
    fla, cmp_block not read); vibe: the op's rule 'nsa_vibe', lse None, no pos, importance_dtype,
    group_first or fla."""
    if why := device_reason(q, k, lse, pos):
        return why
    if vibe and (lse is not None or pos is not None or importance_dtype is not None or group_first or fla or lucid):
        return "rule 'nsa_vibe' takes no lse, pos (packed documents), importance_dtype, group_first or other rule"
    if q.dtype != k.dtype or q.dtype not in KERNEL_DTYPES:
        return f"dtypes q {q.dtype}, k {k.dtype} (needs one of fp16, bf16, fp32 for both)"
    if q.dim() != 4 or k.dim() != 4:
        return "q and k must be 4-D"
    if q.shape[3] > MAX_HEAD_DIM:
        return f"head dim {q.shape[3]} (at most {MAX_HEAD_DIM})"
    if lucid and (lse is not None or pos is not None or group_first or fla):
        return "rule 'lucidrains' takes no lse, pos (packed documents), group_first or rule 'fla'"
    if not lucid and not vibe and lse.dtype != torch.float32:
        return f"lse dtype {lse.dtype} (needs float32)"
    l, d, ls = cmp_block, cmp_stride, sel_block
    for v in (l, d, ls, n_selected):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"block sizes and n must be ints >= 1, got {(l, d, ls, n_selected)}"
    if (l % d and not lucid) or ls % d:  # rule 'lucidrains' does not read l
        return f"the stride d={d} must divide l={l} and l'={ls}"
    m = ls // d
    if m & (m - 1) or m > 128:
        return f"l' / d = {m} (needs a power of two <= 128: a tile of compression blocks holds whole selection blocks)"
    if lucid and m > LUCID_MAX_COLUMNS:
        return (f"rule 'lucidrains' with l' / d = {m} (at most {LUCID_MAX_COLUMNS}: each block's mean adds its columns "
                "one exact dot each)")
    if lucid:
        if importance_dtype not in (None, torch.float32):
            return f"rule 'lucidrains' with importance_dtype {importance_dtype} (None, or torch.float32: the softmax)"
        if n_selected > MAX_SELECTED or q.shape[2] >= 2**31 or k.shape[2] >= 2**31:
            return f"n_selected {n_selected}, S={q.shape[2]}, Tc={k.shape[2]} (n <= {MAX_SELECTED}; ids in 31 bits)"
        return None
    if n_selected > MAX_SELECTED:
        return f"n_selected {n_selected} (at most {MAX_SELECTED}: the running top-n lives in registers)"
    G = k.shape[1]
    h = q.shape[1] // max(G, 1)
    tc = _tiles(h, q.shape[3], d, ls, n_selected, q.dtype == torch.float32)["TC"]
    if l > (tc + 1) * d:
        return f"l={l} > (TC + 1) * d = {(tc + 1) * d} (a selection block's reach back past one tile)"
    if q.shape[2] >= 2**31 or k.shape[2] >= 2**31:
        return f"S={q.shape[2]}, Tc={k.shape[2]} (block ids are packed into 31 bits)"
    if group_first and (importance_dtype is None or pos is not None):
        return ("group_first (the group's heads summed and rounded before the block map) takes an importance_dtype "
                "and no pos (packed documents)")
    if fla and (pos is not None or group_first):
        return "rule 'fla' takes no pos (packed documents) and no group_first (the op's rule 'fla' has neither)"
    if importance_dtype is not None:
        if importance_dtype not in (torch.bfloat16, torch.float16):
            return f"importance_dtype {importance_dtype} (None, torch.bfloat16 or torch.float16)"
        hc = _tiles(h, q.shape[3], d, ls, n_selected, q.dtype == torch.float32)["HC"]
        if h > hc and not group_first:  # group_first keeps only the group's sums: any number of chunks
            return (f"importance rounded to {str(importance_dtype).removeprefix('torch.')} with {h} heads a group in "
                    f"chunks of {hc} (the rounded importance is kept per head for one chunk only)")
    if pos is not None:
        return packed_reason(q.shape[0], q.shape[2], k.shape[2], l, pos)
    return None


@jit
def _compare_swap(x, M: tl.constexpr, N: tl.constexpr, DIST: tl.constexpr, SPAN: tl.constexpr,
                  DESC: tl.constexpr):  # fmt: skip
    """One step of a bitonic network on each row of x [M, N]: the elements at positions p and
    p + DIST (p & DIST == 0) are put in order: ascending where p & SPAN == 0, descending
    elsewhere (SPAN = 2N: one direction for the whole row), all reversed when DESC."""
    pairs: tl.constexpr = N // (2 * DIST)
    xr = tl.reshape(x, [M, pairs, 2, DIST])  # position = pair * 2 DIST + half * DIST + offset
    lo = reduce_min(xr, 2)[:, :, None, :]  # [M, pairs, 1, DIST]
    hi = reduce_max(xr, 2)[:, :, None, :]
    first = tl.arange(0, pairs)[:, None] * (2 * DIST) + tl.arange(0, DIST)[None, :]  # [pairs, DIST]
    if DESC:
        ascending = (first & SPAN) != 0
    else:
        ascending = (first & SPAN) == 0
    upper = (tl.arange(0, 2) == 1)[:, None]  # [2, 1]
    # ascending: the lower position takes the min, the upper one the max; descending: swapped
    take_hi = upper[None, None, :, :] == ascending[None, :, None, :]  # [1, pairs, 2, DIST]
    return tl.reshape(tl.where(take_hi, hi, lo), [M, N])


@jit
def _sort_rows(x, M: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, DESC: tl.constexpr):
    """Each row of x [M, N] (N = 2^LOG_N) sorted (bitonic sort)."""
    for s in tl.static_range(1, LOG_N + 1):  # sorted runs of 2^s
        for r in tl.static_range(s):
            x = _compare_swap(x, M, N, 1 << (s - 1 - r), 1 << s, DESC)
    return x


@jit
def _merge_top(run, new, M: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """The N largest of each row of run [M, N] (sorted descending) and new [M, N] (any order),
    sorted descending: new sorted ascending, the elementwise max (the top N of both, a
    bitonic sequence), then a bitonic merge."""
    top = tl.maximum(run, _sort_rows(new, M, N, LOG_N, False))
    for r in tl.static_range(LOG_N):
        top = _compare_swap(top, M, N, N >> (r + 1), 2 * N, True)
    return top


@jit
def select_kernel(
    Q, KC, LSE, W, OUT, POS, LO, SLOT, MEANS,
    sqb, sqh, sqs, sqd, skb, skg, skt, skd, slb, slh, sls, sob, sog, sos,
    S, G, Tc, N_SEL, L, D, LS, scale, Q_OFF, N_COLS,
    HPG: tl.constexpr, HC: tl.constexpr, NHC: tl.constexpr, DK: tl.constexpr, DK_P: tl.constexpr,
    BLOCK_M: tl.constexpr, TC: tl.constexpr, NS: tl.constexpr, KS: tl.constexpr, LOG_KS: tl.constexpr,
    PREC: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr, HAS_POS: tl.constexpr,
    IMP_DTYPE: tl.constexpr, SUM_ROUND: tl.constexpr, MAP_UPCAST: tl.constexpr, GROUP_FIRST: tl.constexpr,
    FLA: tl.constexpr, LUCID: tl.constexpr, P_ROUND: tl.constexpr, KEEP: tl.constexpr, STORED: tl.constexpr,
    VIBE: tl.constexpr = False,
):  # fmt: skip
    # heaviest (latest) query tiles first: a short tail for the causal imbalance
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    ROWS: tl.constexpr = BLOCK_M * HC
    row = tl.arange(0, ROWS)
    t_row = tile * BLOCK_M + row // HC  # [ROWS] token of each (query, head) row
    t_q = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    dk = tl.arange(0, DK_P)
    dk_ok = dk < DK
    k_base = KC + b * skb + g.to(tl.int64) * skg
    if NHC == 1:  # all heads in one chunk: q and lse stay in registers for the whole loop
        head = row % HC
        row_ok = (head < HPG) & (t_row < S)
        hd = (g * HPG + head).to(tl.int64)
        q0 = tl.load(Q + b * sqb + hd[:, None] * sqh + t_row.to(tl.int64)[:, None] * sqs + dk[None, :] * sqd,
                     mask=row_ok[:, None] & dk_ok[None, :], other=0.0)  # [ROWS, DK_P]
        if UPCAST:
            q0 = q0.to(tl.float32)
        if not LUCID:  # (rule 'lucidrains' ranks the logits: no lse)
            lse0 = tl.load(LSE + b * slb + hd * slh + t_row.to(tl.int64) * sls, mask=row_ok, other=0.0)
    if HAS_POS:
        # packed documents: query t is the unpacked query pos[t] of its document, whose i-th
        # compression block is compact slot lo[t] + i (document_slots). The rows are taken in
        # groups of one lo, a group per pass over the blocks (a document without blocks shares
        # the next one's lo: its rows see no block either way); a tile holds at most one group
        # more than documents starting in it after its first query
        q_ok = t_q < S
        p_q = tl.load(POS + b * S + t_q, mask=q_ok, other=0).to(tl.int32)  # [BLOCK_M] document positions
        lo_q = tl.load(LO + b * S + t_q, mask=q_ok, other=0)
        p_row = tl.load(POS + b * S + t_row, mask=t_row < S, other=0).to(tl.int32)  # [ROWS]
        cur = p_q // LS  # [BLOCK_M] the current selection block (of the document)
        n_groups = 1 + reduce_sum(((p_q == 0) & q_ok & (t_q > tile * BLOCK_M)).to(tl.int32), 0)
        first = -1  # the group's lo; past the last group Tc + 1 (no rows, no keys loaded)
    else:  # query row t is token Q_OFF + t (a chunk of queries; 0 for the whole sequence)
        cur = (Q_OFF + t_q) // LS  # [BLOCK_M] the current selection block
        t_last = Q_OFF + tl.minimum(tile * BLOCK_M + BLOCK_M, S) - 1
        if VIBE:  # not causal: every block of the sequence
            t_last = S - 1
        n_tiles = (t_last // LS) // NS + 1  # up to the latest query's current block
        n_groups = 1
        if LUCID:  # two passes over the blocks: the softmax's normalizer, then the ranking by p
            n_groups = 1 if STORED else 2  # STORED: the second pass reads the block means back from MEANS
            m_run = tl.full([BLOCK_M], -1000.0, tl.float32)  # the row's running max: the sink's logit first
            l_run = tl.full([BLOCK_M], 1.0, tl.float32)  # the running sum of exp(logit - m_run), the sink's 1
    kk = tl.arange(0, 2 * TC)
    jj = tl.arange(0, KS)
    if not LUCID:  # rule 'lucidrains' maps no probabilities: no overlap matrix
        w = tl.load(W + kk[:, None] * KS + jj[None, :])  # [2 TC, KS] overlap / l: previous | this tile
    ic = tl.arange(0, TC)
    if LUCID and HC > 1:
        eye_tc = tl.where(ic[:, None] == ic[None, :], 1.0, 0.0)  # [TC, TC]: the layout fix below
    if IMP_DTYPE is not None and not GROUP_FIRST:
        # the two halves apart, in the importance dtype (the weights are rounded to it): the per-head
        # map is two tensor-core dots, not a joined [ROWS, 2 TC] operand in IEEE fp32 (which ran the
        # kernel 6.4x slower at the seed shape, 32k: H200, 2026-11-27)
        w_prev = tl.load(W + ic[:, None] * KS + jj[None, :])  # [TC, KS]
        w_this = tl.load(W + (TC + ic)[:, None] * KS + jj[None, :])
        eye = tl.where(jj[:, None] == jj[None, :], 1.0, 0.0)  # [KS, KS]
        if not MAP_UPCAST:
            w_prev = w_prev.to(IMP_DTYPE)
            w_this = w_this.to(IMP_DTYPE)
    run = tl.full([BLOCK_M, KS], -1, tl.int64)  # running top KS keys, descending (-1: none)
    for grp in range(n_groups):
        prev = tl.full([BLOCK_M, TC], 0.0, tl.float32)  # the previous tile's head sums (none before 0)
        if IMP_DTYPE is not None and not GROUP_FIRST:  # the previous tile's rounded p per (query, head) row
            prev_r = tl.full([ROWS, TC], 0.0, tl.float32)
            if not MAP_UPCAST:
                prev_r = prev_r.to(IMP_DTYPE)
        if HAS_POS:
            first = reduce_min(tl.where(q_ok & (lo_q > first), lo_q, Tc + 1), 0)
            in_q = q_ok & (lo_q == first)  # [BLOCK_M] the group's queries
            p_last = reduce_max(tl.where(in_q, p_q, -1), 0)
            n_tiles = tl.where(p_last >= 0, (p_last // LS) // NS + 1, 0)  # up to its latest query's current block
            kt = _document_keys(k_base, SLOT + b * Tc, first + ic, Tc, skt, skd, dk, dk_ok)
        else:
            kt = tl.load(k_base + ic.to(tl.int64)[:, None] * skt + dk[None, :] * skd,
                         mask=(ic < Tc)[:, None] & dk_ok[None, :], other=0.0)  # [TC, DK_P] the first tile
        for c in range(n_tiles):
            i = c * TC + ic  # [TC] compression blocks of this tile
            # the next tile's keys requested now, used next iteration: the load overlaps this work
            i_next = i + TC
            if HAS_POS:
                kt_next = _document_keys(k_base, SLOT + b * Tc, first + i_next, Tc, skt, skd, dk, dk_ok)
            else:
                kt_next = tl.load(k_base + i_next.to(tl.int64)[:, None] * skt + dk[None, :] * skd,
                                  mask=(i_next < Tc)[:, None] & dk_ok[None, :], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            psum = tl.full([BLOCK_M, TC], 0.0, tl.float32)
            for hc in tl.static_range(NHC):
                if NHC == 1:
                    q = q0
                    if not LUCID:
                        lse = lse0
                    ok = row_ok
                else:
                    head = hc * HC + row % HC
                    ok = (head < HPG) & (t_row < S)
                    hd = (g * HPG + head).to(tl.int64)
                    q = tl.load(Q + b * sqb + hd[:, None] * sqh + t_row.to(tl.int64)[:, None] * sqs + dk[None, :] * sqd,
                                mask=ok[:, None] & dk_ok[None, :], other=0.0)
                    if UPCAST:
                        q = q.to(tl.float32)
                    if not LUCID:
                        lse = tl.load(LSE + b * slb + hd * slh + t_row.to(tl.int64) * sls, mask=ok, other=0.0)
                s = tl.dot(q, tl.trans(kt), input_precision=PREC)  # [ROWS, TC] fp32
                if LUCID:  # lucidrains: (q @ k^T) in q's dtype, times scale in q's dtype, the group's sum in fp32
                    if ROUND:
                        s = _rounded(_rounded(s, Q.dtype.element_ty) * scale, Q.dtype.element_ty)
                    else:
                        s = s * scale
                    psum += reduce_sum(tl.reshape(tl.where(ok[:, None], s, 0.0), [BLOCK_M, HC, TC]), 1)
                elif VIBE:  # (q @ k^T) * scale in q's dtype over every column; lse over every column
                    if ROUND:
                        s = _rounded(_rounded(s, Q.dtype.element_ty) * scale, Q.dtype.element_ty)
                    else:
                        s = s * scale
                    p = tl.where(ok[:, None] & (i < Tc)[None, :], tl.exp(s - lse[:, None]), 0.0)
                    psum += reduce_sum(tl.reshape(p, [BLOCK_M, HC, TC]), 1)  # the group's heads summed
                else:
                    if ROUND:  # eager's q @ k^T is rounded to the input dtype before the upcast
                        s = s.to(Q.dtype.element_ty).to(tl.float32)
                    if HAS_POS:  # block i (of the group's documents) where i*d + l - 1 <= pos[t]: it exists
                        # then; the other groups' rows only add to their own queries' sums, whose keys
                        # this pass drops
                        vis = ok[:, None] & (i[None, :] * D + L - 1 <= p_row[:, None])
                    else:
                        vis = ok[:, None] & (i < Tc)[None, :] & (i[None, :] * D + L - 1 <= Q_OFF + t_row[:, None])
                    # where, not multiply: a row without a visible block has lse = -inf (exp = inf)
                    p = tl.where(vis, tl.exp(s * scale - lse[:, None]), 0.0)
                    if GROUP_FIRST:  # p rounded per head, the group's heads summed in fp32 (over every chunk)
                        psum += reduce_sum(tl.reshape(_rounded(p, IMP_DTYPE), [BLOCK_M, HC, TC]), 1)
                    elif IMP_DTYPE is not None:  # one chunk (NHC == 1): p rounded per head, summed after the map
                        p_r = _rounded(p, IMP_DTYPE)  # exact in IMP_DTYPE: the cast below only stores it so
                        if not MAP_UPCAST:
                            p_r = p_r.to(IMP_DTYPE)
                    else:
                        psum += reduce_sum(tl.reshape(p, [BLOCK_M, HC, TC]), 1)  # the group's heads summed
            if LUCID:
                if HC > 1:
                    # an exact identity (x * 1 plus zeros, IEEE fp32) that gives the head sums the dot's
                    # layout of one element per thread, as for the paper's rule under autocast below
                    # (the sum over the heads' axis leaves each entry held by several lanes, and every
                    # step of _lucid_keys and the top-n merge then ran that many times)
                    psum = tl.dot(psum, eye_tc, input_precision="ieee")
                a = _lucid_means(psum, c * NS + jj, t_q, S, Tc, LS, HPG, TC, NS, KS, Q.dtype.element_ty, ROUND)
                if STORED:  # [BLOCK_M, NS] of the row's block means, for the ranking pass below
                    tl.store(MEANS + (bg * S + t_q).to(tl.int64)[:, None] * N_COLS + (c * NS + jj)[None, :], a,
                             mask=(t_q < S)[:, None] & (jj < NS)[None, :])
                bits, m_run, l_run = _lucid_keys(a, grp, m_run, l_run, Q.dtype.element_ty, P_ROUND, KEEP)
            elif GROUP_FIRST:
                # eager's einsum under autocast: the group sum rounded, then mapped by the rounded weights
                # (w holds them in fp32) in one IEEE fp32 dot of [previous | this tile] in ascending
                # compression block (the products exact, accumulated in fp32), rounded; no group sum after
                psum = _rounded(psum, IMP_DTYPE)
                both = tl.reshape(tl.permute(tl.join(prev, psum), (0, 2, 1)), [BLOCK_M, 2 * TC])
                p_grp = _rounded(tl.dot(both, w, input_precision="ieee"), IMP_DTYPE)  # [BLOCK_M, KS]
                prev = psum
            elif IMP_DTYPE is not None:
                # eager under autocast: each head's p (rounded) mapped by the rounded overlap weights,
                # accumulated in fp32 and rounded; the group sum of those in fp32, rounded
                # products of two IMP_DTYPE values are exact in fp32, accumulated in fp32 as
                # eager's autocast matmul accumulates (interpreted bf16, MAP_UPCAST: fp32 IEEE dots)
                if MAP_UPCAST:
                    p_head = tl.dot(p_r, w_this, acc=tl.dot(prev_r, w_prev, input_precision="ieee"),
                                    input_precision="ieee")
                else:
                    p_head = tl.dot(p_r, w_this, acc=tl.dot(prev_r, w_prev))
                p_head = _rounded(p_head, IMP_DTYPE)  # [ROWS, KS]
                p_grp = reduce_sum(tl.reshape(p_head, [BLOCK_M, HC, KS]), 1)
                # an exact identity (x * 1 plus zeros, IEEE fp32) that gives the group sums a layout
                # of one element per thread: the head sum's own layout holds each key in 8 lanes, and
                # the top-n merge below then ran 8 times its work per thread (sm_90 SASS of the seed
                # tile: 1,380 integer compares against 408; 4,303 instructions against 2,483)
                p_grp = tl.dot(p_grp, eye, input_precision="ieee")
                if SUM_ROUND:  # CPU autocast: the group sum in that dtype (CUDA autocast: float32)
                    p_grp = _rounded(p_grp, IMP_DTYPE)
                prev_r = p_r
            else:
                # [previous | this tile] in ascending compression block, then the overlap map
                both = tl.reshape(tl.permute(tl.join(prev, psum), (0, 2, 1)), [BLOCK_M, 2 * TC])
                p_grp = tl.dot(both, w, input_precision="ieee")  # [BLOCK_M, KS]
                prev = psum
            j = c * NS + jj  # [KS] selection blocks (columns >= NS: none)
            real = (jj < NS)[None, :]
            if HAS_POS:  # the other groups' queries get no key here (-1 bits)
                real = real & in_q[:, None]
            if FLA:  # flash-linear-attention's rule: only the current block favoured, not forced (below)
                forced = real & (j[None, :] == cur[:, None])
            else:
                forced = real & ((j[None, :] == 0) | (j[None, :] == cur[:, None]) | (j[None, :] == cur[:, None] - 1))
            if HAS_POS:  # counted in the document
                candidate = real & (j[None, :] * LS <= p_q[:, None])
            elif VIBE:  # every block of the sequence, later ones too
                candidate = real & (j[None, :] * LS < S)
            else:
                candidate = real & (j[None, :] * LS <= Q_OFF + t_q[:, None])
            if FLA:
                # each head's importance of the current block is 1.0, so the group's key there is HPG,
                # exactly (in any order and rounding). The later blocks (key +0.0: ranked after every
                # earlier block, then -1) get no key: the ids are the earlier blocks' top n, -1 after
                bits = tl.where(candidate, tl.where(forced, HPG * 1.0, p_grp).to(tl.int32, bitcast=True), -1)
            elif not LUCID:  # (rule 'lucidrains': the bits of _lucid_keys above)
                bits = tl.where(forced, 0x7F800000, tl.where(candidate, p_grp.to(tl.int32, bitcast=True), -1))
            run = _merged(run, bits, j, BLOCK_M, KS, LOG_KS)
            kt = kt_next
    if LUCID and STORED:  # the ranking pass over the stored block means: no keys read, no logits again
        for c in range(n_tiles):
            a = tl.load(MEANS + (bg * S + t_q).to(tl.int64)[:, None] * N_COLS + (c * NS + jj)[None, :],
                        mask=(t_q < S)[:, None] & (jj < NS)[None, :], other=float("-inf"))
            bits, m_run, l_run = _lucid_keys(a, 1, m_run, l_run, Q.dtype.element_ty, P_ROUND, KEEP)
            run = _merged(run, bits, c * NS + jj, BLOCK_M, KS, LOG_KS)

    # the first n keys of each query that are forced or candidates, as ascending block ids (rule 'fla': in
    # rank order, the list's own descending order: its candidates first, then the -1 keys)
    col = tl.arange(0, KS)[None, :]
    none: tl.constexpr = 0x7FFFFFFF
    if VIBE:
        # the first n - 3 + |F| (|F| = 1 + min(t // l', 2) distinct forced); the rest of the first n
        # columns -1, so the ascending sort below puts them first (eager's last sort), the columns
        # past n last
        kept = (col < N_SEL - 2 + tl.minimum(cur, 2)[:, None]) & (run >= 0)
        ids = tl.where(kept, 0x7FFFFFFF - (run & 0x7FFFFFFF), tl.where(col < N_SEL, -1, none))
    else:
        ids = tl.where((col < N_SEL) & (run >= 0), 0x7FFFFFFF - (run & 0x7FFFFFFF), none)
    if not FLA and not LUCID:
        ids = _sort_rows(ids, BLOCK_M, KS, LOG_KS, False)
    out_ptrs = OUT + b * sob + g.to(tl.int64) * sog + t_q.to(tl.int64)[:, None] * sos + col
    tl.store(out_ptrs, tl.where(ids == none, -1, ids), mask=(t_q < S)[:, None] & (col < N_SEL))
    if LUCID:  # the diagonal block, appended as column n
        tl.store(OUT + b * sob + g.to(tl.int64) * sog + t_q.to(tl.int64) * sos + N_SEL, cur.to(tl.int64),
                 mask=t_q < S)


@jit
def vibe_lse_kernel(
    Q, KC, LSE, sqb, sqh, sqs, sqd, skb, skg, skt, skd, S, H, Tc, scale,
    HPG: tl.constexpr, DK: tl.constexpr, DK_P: tl.constexpr, BLOCK_M: tl.constexpr, TC: tl.constexpr,
    PREC: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Rule 'nsa_vibe': LSE [B, H, S] fp32 (contiguous), each row's logsumexp over every compression
    block of s = (q @ k^T) * scale, rounded as select_kernel rounds it (online max and sum, fp32).
    Grid (ceil(S / BLOCK_M), B * H)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hd = (bh % H).to(tl.int64)
    t = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = t < S
    dk = tl.arange(0, DK_P)
    dk_ok = dk < DK
    q = tl.load(Q + b * sqb + hd * sqh + t.to(tl.int64)[:, None] * sqs + dk[None, :] * sqd,
                mask=t_ok[:, None] & dk_ok[None, :], other=0.0)  # [BLOCK_M, DK_P]
    if UPCAST:
        q = q.to(tl.float32)
    k_base = KC + b * skb + (hd // HPG) * skg
    ic = tl.arange(0, TC)
    m_run = tl.full([BLOCK_M], -1e30, tl.float32)  # a finite floor: exp(-inf - floor) = 0, never NaN
    l_run = tl.full([BLOCK_M], 0.0, tl.float32)
    for c0 in range(0, Tc, TC):
        i = c0 + ic
        kt = tl.load(k_base + i.to(tl.int64)[:, None] * skt + dk[None, :] * skd,
                     mask=(i < Tc)[:, None] & dk_ok[None, :], other=0.0)  # [TC, DK_P]
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC)  # [BLOCK_M, TC] fp32
        if ROUND:
            s = _rounded(_rounded(s, Q.dtype.element_ty) * scale, Q.dtype.element_ty)
        else:
            s = s * scale
        s = tl.where((i < Tc)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_run, reduce_max(s, 1))
        l_run = l_run * tl.exp(m_run - m_new) + reduce_sum(tl.exp(s - m_new[:, None]), 1)
        m_run = m_new
    tl.store(LSE + bh.to(tl.int64) * S + t, m_run + tl.log(l_run), mask=t_ok)


@jit
def _rounded(x, DTYPE: tl.constexpr):
    """x (fp32, finite) rounded to DTYPE (bf16 or fp16) to nearest, ties to even, as fp32 again. bf16
    by its bits: Triton's CPU interpreter truncates a cast to bf16 (the GPU rounds), so the tests
    and the GPU compute the same bits."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


def _exp_interpreted(x):
    """`_exp` for Triton's interpreter (no libdevice there): numpy's exp."""
    return tl.exp(x)


@jit(interpreted=_exp_interpreted)
def _exp(x):
    """exp(x) in fp32 as CUDA's expf computes it (libdevice: what torch's softmax kernels call),
    not tl.exp's ex2.approx of x * log2(e), whose error grows with |x| (rule 'lucidrains' rounds
    the probabilities to bf16/fp16, where each error can move a rounding)."""
    return libdevice.exp(x)


@jit
def _lucid_means(psum, j, t_q, S, Tc, LS, HPG: tl.constexpr, TC: tl.constexpr, NS: tl.constexpr, KS: tl.constexpr,
                 XDTYPE: tl.constexpr, X_ROUND: tl.constexpr):  # fmt: skip
    """Rule 'lucidrains' on one tile: psum [BLOCK_M, TC] the group's sums of the scaled logits (fp32
    sums of q-dtype values), j [KS] the tile's selection blocks (c * NS + jj). The column means
    (psum / h, rounded to XDTYPE with X_ROUND), each block's mean of its M = TC / NS columns added in
    ascending column order (as torch's sum of a short row) and rounded: a [BLOCK_M, KS], -inf but
    for the candidates j < t // l' and j < Tc // M."""
    M: tl.constexpr = TC // NS
    col = tl.math.div_rn(psum, tl.full(psum.shape, HPG, tl.float32))  # the group's mean
    if X_ROUND:
        col = _rounded(col, XDTYPE)
    # column r of each block picked exactly (a sum of it and zeros), added in ascending order
    cols = tl.reshape(col, [col.shape[0], NS, M])  # [BLOCK_M, NS, M]: block j's columns j*M .. j*M + M - 1
    lane = tl.arange(0, M)[None, None, :]
    block = reduce_sum(tl.where(lane == 0, cols, 0.0), 2)  # [BLOCK_M, NS]
    for r in tl.static_range(1, M):
        block += reduce_sum(tl.where(lane == r, cols, 0.0), 2)
    block = _zero_columns_after(block, NS, KS)  # [BLOCK_M, KS]
    a = block * (1.0 / M)  # M a power of two: exact
    if X_ROUND:
        a = _rounded(a, XDTYPE)
    cand = ((tl.arange(0, KS) < NS)[None, :] & (j[None, :] < (t_q // LS)[:, None]) & (j < Tc // M)[None, :]
            & (t_q < S)[:, None])  # fmt: skip
    return tl.where(cand, a, float("-inf"))  # exp(-inf) = 0: no other block enters the softmax


@jit
def _lucid_keys(a, pass_, m_run, l_run, XDTYPE: tl.constexpr, P_ROUND: tl.constexpr, KEEP: tl.constexpr):
    """Rule 'lucidrains' on one tile's block means a [BLOCK_M, KS] (`_lucid_means`). The first pass
    (pass_ 0) updates the row's running max and sum of the softmax (m_run, l_run [BLOCK_M], the
    sink's -1e3 included) and gives no key; the second gives each candidate whose p = exp(a - m) / l
    (rounded to XDTYPE with P_ROUND) is at least KEEP (> 0: never a -inf mean's) the bits of p, -1
    elsewhere. Returns (bits [BLOCK_M, KS] int32, m_run, l_run)."""
    m_new = tl.maximum(m_run, reduce_max(a, 1))  # in the second pass m_run itself (the row's max)
    e = _exp(a - m_new[:, None])
    l_new = l_run * _exp(m_run - m_new) + reduce_sum(e, 1)
    p = tl.math.div_rn(e, l_run[:, None])  # (its value in the second pass only, where l_run is the row's sum)
    if P_ROUND:
        p = _rounded(p, XDTYPE)
    bits = tl.where((p >= KEEP) & (pass_ == 1), p.to(tl.int32, bitcast=True), -1)
    return bits, tl.where(pass_ == 0, m_new, m_run), tl.where(pass_ == 0, l_new, l_run)


@jit
def _merged(run, bits, j, BLOCK_M: tl.constexpr, KS: tl.constexpr, LOG_KS: tl.constexpr):
    """The running top KS keys run [BLOCK_M, KS] with a tile's keys (bits [BLOCK_M, KS] int32, -1:
    none; j [KS] their blocks: the lower block first among equal bits) merged in, only when some
    key beats some query's running minimum (the list's last entry)."""
    key = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - j).to(tl.int64)[None, :]  # [BLOCK_M, KS]
    beats = reduce_max(key, 1) > reduce_min(run, 1)  # [BLOCK_M]
    if reduce_max(beats.to(tl.int32), 0) > 0:
        run = _merge_top(run, key, BLOCK_M, KS, LOG_KS)
    return run


@jit
def _doubled(x, W: tl.constexpr):
    """x [R, W] as [R, 2 W]: its columns, then W zero columns."""
    return tl.reshape(tl.permute(tl.join(x, tl.full(x.shape, 0.0, x.dtype)), (0, 2, 1)), [x.shape[0], 2 * W])


@jit
def _zero_columns_after(x, W: tl.constexpr, KS: tl.constexpr):
    """x [R, W] widened to [R, KS] (KS / W a power of two, at most 128) with zero columns after its own."""
    for step in tl.static_range(7):
        if W << step < KS:
            x = _doubled(x, W << step)
    return x


@jit
def _document_keys(k_base, SLOT_ROW, c, Tc, skt, skd, dk, dk_ok):
    """Packed documents: the keys [TC, DK_P] of compact slots c [TC] (0 where c >= Tc), read
    at the tokens where they start (SLOT_ROW: the batch row's `document_slots` slot)."""
    ok = c < Tc
    token = tl.load(SLOT_ROW + c, mask=ok, other=0).to(tl.int64)
    return tl.load(k_base + token[:, None] * skt + dk[None, :] * skd, mask=ok[:, None] & dk_ok[None, :], other=0.0)


@functools.lru_cache(maxsize=64)
def _overlap_matrix(TC: int, NS: int, KS: int, cmp_block: int, cmp_stride: int, sel_block: int, device,
                    importance_dtype=None):  # fmt: skip
    """Made once per geometry and device (a constant the kernel only reads: no small kernels per
    call). [2*TC, KS] float32: row r is compression block r - TC relative to a tile's first one (the
    previous tile, then this one), column j < NS the tile's selection block j, the entry
    overlap / l with eager's arithmetic (int overlap -> float32, / l), rounded to importance_dtype
    where given (the matmul's operand under autocast); columns >= NS zero."""
    l, d, ls = cmp_block, cmp_stride, sel_block

    def make() -> torch.Tensor:
        i = torch.arange(-TC, TC, device=device)[:, None]
        j = torch.arange(KS, device=device)[None, :]
        overlap = (torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)).clamp(min=0)
        overlap = torch.where(j < NS, overlap, 0)
        weight = overlap.to(torch.float32) / l
        if importance_dtype is not None:
            weight = weight.to(importance_dtype).float()
        return weight.contiguous()

    return made_aside(make, device)  # a cached constant: outside a CUDA graph's pool


@functools.cache
def _lucid_keep(dtype: torch.dtype) -> float:
    """Rule 'lucidrains' keeps a block where `p > 1e-10` with p in `dtype` (torch compares it in that
    dtype: bf16's 1e-10 rounds up to 1.0004e-10 and is not kept, fp16's to 0): the smallest value of
    dtype that torch keeps, as a Python float (exact in fp32), so the kernel keeps p >= it."""
    v = torch.tensor(LUCID_THRESHOLD, dtype=dtype)
    while not bool(v > LUCID_THRESHOLD):
        v = torch.nextafter(v, torch.tensor(1.0, dtype=dtype))
    return v.item()


def select_blocks_forward(q, k, lse, cmp_block: int, cmp_stride: int, sel_block: int, n_selected: int,
                          scale: float, pos=None, importance_dtype=None, group_sum_dtype=None, q_offset: int = 0,
                          group_first: bool = False, fla: bool = False, lucid: bool = False, vibe: bool = False, *,
                          tiles: dict | None = None) -> torch.Tensor:  # fmt: skip
    """block_idx [B, G, S, n_selected] int64 (see the module docstring). pos: packed documents
    ([B, S] int64; k then holds a slot per token). importance_dtype: None, or bf16/fp16 for the
    importance rounded as eager computes it under autocast (the op's docstring). q_offset: query
    row t is token q_offset + t (a chunk of queries; not with pos), a kernel argument added to the
    row's token wherever it is a position (visibility, current block, candidates), never where it
    addresses q, lse or the output. group_first: the group's heads summed (p rounded per head, the
    sum in fp32, rounded) before the block map, as eager's einsum under autocast (the op's
    docstring; with importance_dtype, without group_sum_dtype or pos). fla: the op's rule 'fla' (the
    current block favoured, no forced blocks, the ids in rank order, -1 after; without pos or
    group_first). lucid: the op's rule 'lucidrains' (lse None; importance_dtype None or torch.float32,
    the softmax's dtype; [B, G, S, n_selected + 1], the diagonal block last; not with pos, q_offset,
    group_first or group_sum_dtype). vibe: the op's rule 'nsa_vibe' (lse None: computed here over every
    compression block by `vibe_lse_kernel`; not causal; not with pos, q_offset, importance_dtype,
    group_sum_dtype or group_first; n >= 3). `tiles`: an override of `_tiles`
    (tools/bench_block_select.py); None, the default tiles."""
    why = unsupported_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos, importance_dtype,
                             group_first, fla, lucid, vibe)
    if why is None and vibe and (q_offset or group_sum_dtype is not None or n_selected < 3):
        why = "rule 'nsa_vibe' takes no q_offset and no group_sum_dtype, and n_selected >= 3"
    if why is None and group_first and group_sum_dtype is not None:
        why = f"group_first with group_sum_dtype {group_sum_dtype} (the group sum is rounded before the map)"
    if why is None and lucid and (q_offset or group_sum_dtype is not None):
        why = "rule 'lucidrains' takes no q_offset and no group_sum_dtype"
    if why is not None:
        raise ValueError(f"select_blocks (triton): cannot run these inputs: {why}")
    B, H, S, Dk = q.shape
    G, Tc = k.shape[1], k.shape[2]
    h = H // G
    out = torch.empty((B, G, S, n_selected + lucid), dtype=torch.int64, device=q.device)
    if out.numel() == 0:
        return out
    T = _tiles(h, Dk, cmp_stride, sel_block, n_selected, q.dtype == torch.float32, tiles)
    if cmp_block > (T["TC"] + 1) * cmp_stride and not lucid:
        raise ValueError(f"select_blocks (triton): tiles {T}: l={cmp_block} reaches back past one tile of TC blocks")
    if importance_dtype is not None and not group_first and not lucid and h > T["HC"]:
        raise ValueError(f"select_blocks (triton): tiles {T}: {h} heads in chunks of {T['HC']} (the rounded importance "
                         "is kept per head for one chunk only)")
    m = sel_block // cmp_stride
    NS = T["TC"] // m
    w = None if lucid else _overlap_matrix(T["TC"], NS, T["KS"], cmp_block, cmp_stride, sel_block, q.device,
                                           importance_dtype)
    # rule 'lucidrains': p rounded to q's dtype unless the softmax runs in float32, kept where >= KEEP
    p_dtype = torch.float32 if importance_dtype == torch.float32 else q.dtype
    launch = {"num_warps": T["num_warps"]} | ({"num_stages": T["num_stages"]} if "num_stages" in T else {})
    launch |= FLA_OPTIONS if fla else {}
    grid = (_cdiv(S, T["BLOCK_M"]), B * G)
    doc_pos = lo = slot = None
    if pos is not None:
        doc_pos = pos.contiguous()
        slot, lo, _, _, _ = document_slots(pos, Tc, cmp_block, cmp_stride)
        if Tc == 0:  # S < l: no slot to read (the kernel's loads are all masked), a valid pointer still
            slot = lo
    # rule 'lucidrains': the block means of the first pass kept for the ranking pass (fp32 [B*G, S,
    # selection blocks]) where they fit MEANS_BUDGET, else the ranking pass computes them again
    n_cols = _cdiv(_cdiv(S, sel_block), NS) * NS
    stored = lucid and B * G * S * n_cols * 4 <= MEANS_BUDGET
    means = torch.empty(B * G, S, n_cols, dtype=torch.float32, device=q.device) if stored else None
    if vibe:  # the rows' own normalizer over every compression block
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        vibe_lse_kernel[(_cdiv(S, VIBE_LSE_ROWS), B * H)](
            q, k, lse, *q.stride(), *k.stride(), S, H, Tc, scale,
            HPG=h, DK=Dk, DK_P=T["DK_P"], BLOCK_M=VIBE_LSE_ROWS, TC=max(16, min(64, _next_pow2(Tc))),
            PREC="ieee" if q.dtype == torch.float32 else "tf32", ROUND=q.dtype != torch.float32,
            UPCAST=upcast_dots(q.dtype), num_warps=4,
        )  # fmt: skip
    select_kernel[grid](
        q, k, lse, w, out, doc_pos, lo, slot, means,
        *q.stride(), *k.stride(), *(lse.stride() if lse is not None else (0, 0, 0)), *out.stride()[:3],
        S, G, Tc, n_selected, cmp_block, cmp_stride, sel_block, scale, q_offset, n_cols,
        HPG=h, HC=T["HC"], NHC=_cdiv(h, T["HC"]), DK=Dk, DK_P=T["DK_P"], BLOCK_M=T["BLOCK_M"], TC=T["TC"], NS=NS,
        KS=T["KS"], LOG_KS=T["KS"].bit_length() - 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        ROUND=q.dtype != torch.float32, UPCAST=upcast_dots(q.dtype), HAS_POS=pos is not None,
        IMP_DTYPE=None if importance_dtype is None or lucid else _TL_DTYPES[importance_dtype],
        SUM_ROUND=group_sum_dtype is None, MAP_UPCAST=importance_dtype is not None and not lucid and upcast_dots(
            importance_dtype), GROUP_FIRST=group_first, FLA=fla,
        LUCID=lucid, P_ROUND=lucid and p_dtype != torch.float32, KEEP=_lucid_keep(p_dtype) if lucid else 0.0,
        STORED=stored, VIBE=vibe, **launch,
    )  # fmt: skip
    return out
