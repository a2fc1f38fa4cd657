"""Triton kernels for NSA selected attention (section 3), group-centric, forward and backward.

    o, lse = selected_forward(q, k, v, block_idx, block_size, scale, pos=None)
    dq, dk, dv = selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, pos=None)
    why = unsupported_reason(q, k, v, block_idx, block_size, pos)   # None when the kernels can run

Same semantics as the `reference` backend of `nsa::selected_attention` (nsa_compile/ops/selection.py):
q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv], H = G * h, block_idx [B, G, S, n] int64
(ascending, -1 padded, shared by the group's h heads). Query t of head j attends to the tokens
s <= t of the blocks block_idx[:, j // h, t] (entries < 0 ignored, blocks past the end hold no
token <= t); duplicated block ids count twice. With packed documents, pos [B, S] int64 (each
token's position in its document), block j of query t is the tokens [start, start + l') with
start = t - pos[t] + j * l' (counted from its document's first token, so not on the l' grid in
general). o [B, H, S, Dv] in v's dtype, lse [B, H, S] float32 (natural log; -inf on a row
without a valid token, whose output and gradients are 0).
Strides are passed to the kernels: q, k, v, grad_o may be any strided views (the model passes
[B, S, heads, D] memory transposed to [B, heads, S, D]). o, dq, dk, dv are allocated in that
layout too ([B, S, heads, D] memory), the layout the op's fakes promise.

Numerics: scores q @ k^T accumulate in fp32 and stay fp32 (the reference rounds them to q's
dtype first: the kernel is the closer of the two to exact arithmetic), softmax in fp32 with an
online max (exp2 with log2(e) folded into the scale), p cast to v's dtype for p @ v, the standard
flash-attention backward with delta = rowsum(dO * O) in fp32. fp32 inputs use
`tl.dot(..., input_precision="ieee")` (no TF32; the argument exists since Triton 3.0). No atomics
anywhere: every kernel is deterministic, and so are the torch ops that build the inverted
selection (a stable sort, searchsorted, cumsum).

Packed documents without a host sync: pos is read by the kernels and by torch ops on the device
(never on the host, no data-dependent shape). The kernels take it as an optional pointer (POS;
QSTART for dk/dv) with the HAS_POS constexpr: without pos those are None (a constexpr to Triton)
and False, every `if HAS_POS` block is left out, and the kernels compile to the PTX they had
before pos existed (compared for sm_90a, fp16/bf16, the seed's and the paper's tiles). A block
is then named by its first token instead of its id: the forward and dq compare a row's chosen
blocks as first tokens t - pos[t] + j * l' (one scalar document start per program when TQ = 1,
one per row otherwise), their union holds first tokens (`union_kernel`), and the dk/dv
kernel masks each entry to its block's tokens. The document start is clamped into [-1, S]
(attention_tiles.document_start) and a block that would start before token 0 holds no token:
where pos[t] > t (not a position) the kernels and the reference (which clamps token ids for its
gather) differ; both stay in bounds. Valid positions give the reference's attention.

Kernels (tile sizes from `_tiles`):
- forward, grid (ceil(S / TQ), B*G, ceil(TQ * h / ROWS)): one program per tile of TQ consecutive
  query tokens of one (batch, group). Its rows are the tile's (query, head) pairs, query-major
  (h = 6 and ROWS = 64: 10 queries, 60 rows; no padded copy, rows past the tile are masked
  loads). It streams the UNION of the tile's selected blocks straight from k and v by block id
  (no gathered copy), in chunks of BLOCK_N tokens, with an online softmax in fp32: a block
  chosen by several of the tile's queries is read once for all of them (the per-query form
  re-read each block once per query, L2-bound at small h). Each row masks what it may not see:
  blocks its query did not choose (tested against the query's own list, held in registers; a
  block listed twice counts twice, as weight 2) and tokens after its query. The union comes
  from `_tile_union` (`union_kernel`: a program per tile sorts its TQ * n ids in registers and
  writes each distinct one once; no host sync); with TQ = 1 the query's own list is read
  directly, slot by slot, with no membership test (a repeated id is met twice). With pos the
  union is of first tokens (rows of one tile in two documents name one block with two ids, or
  two blocks with one id), sorted and deduplicated the same way, and each row compares its
  chosen blocks' first tokens with the union entry. One
  flat loop runs over the (union block, chunk) pairs with no
  data-dependent `if` around the K/V loads, so Triton's pipeliner prefetches the next pair
  during this one's compute (num_stages). The running max starts at a finite floor (-1e30), so
  a chunk fully masked for a row leaves its state unchanged (alpha = 1, p = 0) instead of
  making NaN; the first valid chunk gets alpha = 0, as from -inf. TQ and ROWS (`_tiles`): large
  tiles while the blocks are few (ceil(S / l') <= 4 n: the union is at most all of them), small
  ones past that (random choices share few blocks), one query per program for h >= 16.
- backward dq (+ delta), the same grid, tiles and masked (union block, chunk) loop: recomputes
  p from the saved lse (0 where masked) and accumulates dq = scale * sum_blocks ds @ k in fp32.
  It also writes delta = rowsum(dO * O) for the dk/dv kernel (no [B, H, S, Dv] fp32 temporary).
- backward dk/dv, from the inverted selection: with torch ops, every valid (batch, group, token,
  slot) entry gets the key (b*G + g)*NB + block (NB = ceil(S / l')); a stable sort of the keys
  lists, per KV block, the query tokens that chose it (ascending t; a token that chose a block
  twice is listed twice), and searchsorted gives each block's range (CSR). Each list is cut into
  segments of at most DKV_SEGMENT entries (every token chooses block 0: one program per block
  would serialize S queries); a work item is one (block, segment), and the grid is 1-D, U * CPB
  programs (U a static bound on the number of items: no host sync; CPB = ceil(l' / BLOCK_N)),
  program id = item * CPB + chunk: the chunk fastest, so the CPB programs of an item run side by
  side and read its q / dO rows while they are still in L2 (1-D rather than (CPB, U): U can pass
  CUDA's 65535 limit on grid dimension y, e.g. batch 8 at the paper shape). A program holds a
  [BLOCK_N, D] chunk of the block's K and V and walks its (query, head) pairs in tiles of ROWS
  rows, pairs of consecutive queries packed back to back (for small h no row idles except at a
  segment's end), accumulating dk, dv in fp32. A block of one segment writes dk/dv directly
  (cast once); a block of several writes fp32 partials ([items, l', D], at most
  (B*G*NB + B*G*S*n / DKV_SEGMENT) * l' * (Dk + Dv) * 4 bytes) that a second kernel sums in
  segment order. Every token belongs to exactly one (block, chunk), so every element of dk and
  dv is written (unchosen tokens get 0). With pos a chosen block [start, start + l') is cut by
  the l' grid unless its document starts on it, and touches up to two grid blocks: the inversion
  lists each choice under the grid block of its first token and, where it reaches a token <= t
  in the next one, under that one too (2 * B*G*S*n keys, half of them unused where blocks sit on
  the grid; still a stable sort, so still ascending t), with the entry's start beside its query
  (qstart); the kernel masks each (query, token) pair to s in [start, start + l') and s <= t.
  The grid, the work items, the partials and their reduction stay those without pos, and so
  does the determinism (no atomics; a query listed twice under one grid block, for its blocks
  j and j + 1, is two entries with disjoint tokens).

Dense mode (`_tiles`' "dense": block ids per query head, h = 1, no pos, at most DENSE_BLOCKS * n
K/V blocks, e.g. S <= 2048 at l' 64, n 16): a query then chose most of the blocks it can see, and
the union and the inverted selection cost more than they save (the sort alone has B*H*S*n keys).
The forward and dq tiles read every block up to their last query (constexpr ALL: no union
tensors; a block no row chose is fully masked and leaves the state unchanged, so o, lse and dq
are those of the union). The dk/dv kernel runs one item per (batch, group, KV block), no sort:
the item walks every query from the block's first token on, each row weighted by how often its
query chose the block (read from block_idx: 0 masks the row, 2 for a block listed twice), and
writes its dk/dv directly (no partials, no reduce). The sums run in another order than the
inverted selection's (other tiles of rows), so dk/dv agree with it to rounding, not bit for bit;
each mode is deterministic.

A chunk of queries (the op's q_offset; not with pos): q holds S rows, k and v SK >= q_offset + S
tokens, and row t is token q_offset + t. The kernels take SK and Q_OFF as int arguments (one
compiled kernel for every offset): the blocks, the union's and the inversion's NB, and the token
bounds are K/V's (SK), Q_OFF is added to a row's token where it is compared with a key's (s <=
Q_OFF + t), and every load and store of a row stays at t. The whole sequence is SK = S, Q_OFF = 0.

Supported (`unsupported_reason` says why not): CUDA tensors, or any device with TRITON_INTERPRET=1
(pos, where given, on the same device); with or without packed documents; q, k, v all fp16, bf16
or fp32; head dims up to 256 (padded to a power of two >= 16 by masking);
any h >= 1 (several row tiles when TQ * h > ROWS); any block size l' >= 1: a K/V chunk is the next
power of two of l' between 16 and 64 (32 in the dk/dv kernel), masked, so l' < 16 or not a power
of two wastes columns but is correct. fp32 (no tensor cores) is correct but slow.

The tile loads, the online-softmax step, the backward's row statistics and the document start
are attention_tiles' helpers.

CPU interpreter: the kernels are module-level `triton_support.jit` functions, made by triton.jit
when launched, once per mode (compiled or interpreted: TRITON_INTERPRET as Triton reads it at the
launch), so the interpreter can be turned on and off at any time, whether or not triton was
imported before. Two interpreter gaps are worked around only when interpreted: bf16 tl.dot
(operands cast to fp32 first: `triton_support.upcast_dots`) and calls of triton.language's own
@jit helpers (the reductions are `triton_support.reduce_max` / `reduce_sum`; tl.zeros is written
tl.full for the same reason).
"""

from __future__ import annotations

import math

import torch

from .common import empty_attention_grads, empty_attention_outputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; unsupported_reason says why the kernels cannot run
    triton = tl = None

from .block_select_triton import _sort_rows  # the bitonic sort in registers
from .attention_tiles import (
    dim_ranges, document_start, load_tile, row_delta, row_stats, softmax_accumulate, softmax_finish, softmax_state,
    softmax_update, store_tile,
)
from .triton_support import (
    cdiv as _cdiv, cumulative_sum, device_reason, dot_precision as _dot_precision, jit, next_pow2 as _next_pow2,
    qkv_reason, reduce_sum, upcast_dots,
)

__all__ = ["DKV_SEGMENT", "schedule", "selected_backward", "selected_forward", "unsupported_reason"]

# Query entries per dk/dv work item (a module constant so tests can shrink it).
DKV_SEGMENT = 1024
# `_tiles`' "dense" mode, for block ids per query head (h = 1) while the K/V blocks are at most
# DENSE_BLOCKS * n: a query then chose a large share of the blocks it can see, so walking all of
# them with a per-row weight wastes little and needs no union, no inverted selection (whose sort
# has B*H*S*n keys per head) and no reduce. H100, 2k x 32, bf16, 2026-11-28: per head, random
# choices, fwd+bwd 4.50 ms against 6.80 (profile_selection); the corpus' two per-head models' steps
# 14.0 -> 12.2 and 14.6 -> 12.4 ms. At 4k (4n blocks) per head 0.78x the union's speed. Group-shared
# (h = 6) it won on random choices (4.94 against 6.05 ms) but lost on the reference model's own
# choices (step 11.14 against 10.83 ms, twice each in one process): not taken there.
DENSE_BLOCKS = 2
MAX_HEAD_DIM = 256


def unsupported_reason(q, k, v, block_idx, block_size, pos=None) -> str | None:
    """Why the Triton kernels cannot run these inputs, or None when they can (packed documents
    included: pos [B, S] int64, which the op has checked, on q's device)."""
    if why := device_reason(q, k, v, block_idx, pos) or qkv_reason(q, k, v, MAX_HEAD_DIM):
        return why
    if block_idx.dtype != torch.int64:
        return f"block_idx dtype {block_idx.dtype} (needs int64)"
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        return f"block_size {block_size!r} (needs an int >= 1)"
    entries = block_idx.numel() * (1 if pos is None else 2)  # with pos a block touches up to two of the l' grid
    if entries >= 2**31 or q.shape[2] >= 2**31:
        return f"{entries} inverted-selection entries (the inverted selection indexes them in int32)"
    return None


def _dense(h: int, blocks: int, n_selected: int, packed: bool) -> bool:
    """`_tiles`' default "dense": block ids per query head, no packed documents, few K/V blocks."""
    return h == 1 and not packed and blocks <= DENSE_BLOCKS * n_selected


def schedule(h: int, keys, block_size: int, n_selected: int, packed: bool = False) -> str:
    """How the kernels read the chosen blocks for these sizes, in words (explain's text): the dense
    mode or the tiles' union with the inverted selection (`_tiles`' "dense"). keys: K/V's length,
    an int or a symbolic size (then the rule by length)."""
    union = "the query tiles' union of chosen blocks, dK/dV from the inverted selection"
    if packed or h != 1:
        return union
    limit = DENSE_BLOCKS * n_selected if isinstance(n_selected, int) else f"{DENSE_BLOCKS} n"
    if isinstance(keys, int) and isinstance(n_selected, int):
        blocks = _cdiv(keys, block_size)
        if _dense(h, blocks, n_selected, packed):
            return f"dense: every block up to a tile's last query ({blocks} blocks <= {DENSE_BLOCKS} n), no union, no sort"
        return union
    return f"dense while ceil(S / l') <= {limit}, else {union}"


def _tiles(h: int, Dk: int, Dv: int, block_size: int, fp32: bool = False, override: dict | None = None, *,
           seq_len: int, n_selected: int, keys: int | None = None, packed: bool = False) -> dict:
    """Tile sizes and warps per kernel. Every tl.dot operand dimension is a power of two >= 16
    (padding is masked). Chosen so that no kernel spills registers on sm_90 in bf16/fp16 at the
    paper's (h 16, D 128) and the seed's (h 6, D 64) shapes (ptxas resource usage of kernels
    compiled without a GPU); warps and stages then tuned by timing (below). fp32 (IEEE dots, no tensor cores) gets the
    smallest tiles; its dk/dv kernel still spills at D 128: correct but slow.

    "dense" (h = 1, few blocks, no packed documents; keys: K/V's length, seq_len when None): whether the
    forward and dq tiles read every block up to their last query instead of their union, and the
    dk/dv kernel walks every later query of each block instead of the inverted selection (see
    DENSE_BLOCKS).

    `override` ({kernel: {launch parameter: value}}, kernels "fwd", "dq", "dkdv", "reduce"; e.g.
    {"dkdv": {"ROWS": 64, "num_stages": 2}}; and "dense": a bool) replaces single entries, for
    tools/profile_selection.py.
    BLOCK_N and ROWS must stay powers of two >= 16, TQ >= 1; num_warps and num_stages are Triton's
    launch options (num_stages unset: Triton's default)."""
    DK_P, DV_P = max(16, _next_pow2(Dk)), max(16, _next_pow2(Dv))
    D_P = max(DK_P, DV_P)
    # forward / dq: a tile of TQ consecutive queries, its TQ * h (query, head) pairs as ROWS-row
    # MMA tiles; small groups fill the rows with more queries (h 6: 10 queries in 64 rows)
    # (h 16, the paper's: one query, 16 rows). A tile reads the union of its queries' blocks, at
    # most all ceil(S / l') of them: while those are few (<= 4 n) a large tile reads each block
    # once for many queries; past that, consecutive queries may share few blocks (random choices
    # share only the 3 forced ones) and building the union costs more than it saves, so one query
    # per program. Measured on an H200 (tools/bench_selection.py, random choices, fwd+bwd,
    # 2026-11-26): seed 2k batch 32: 5.27 ms at TQ 10 vs 12.70 per query; seed 64k: 16.64 ms at
    # TQ 2 (union included) vs 12.97 per query; paper 64k fwd kernel 19.6 ms at TQ 1 vs 45.6 at TQ 4.
    few_blocks = _cdiv(seq_len, block_size) <= 4 * n_selected
    tq = 64 // h if few_blocks and h < 16 and D_P <= 128 else 1
    rows = 64 if tq > 1 else max(16, min(_next_pow2(h), 32 if D_P <= 128 else 16))

    def block_n(cap: int) -> int:  # tokens per K/V chunk
        return max(16, min(_next_pow2(block_size), cap))

    blocks = _cdiv(seq_len if keys is None else keys, block_size)
    tiles = {"DK_P": DK_P, "DV_P": DV_P, "reduce": {"BLOCK_N": 16, "num_warps": 4},
             "dense": bool((override or {}).get("dense", _dense(h, blocks, n_selected, packed)))}
    if fp32:
        fwd = {"TQ": 1, "ROWS": 16, "BLOCK_N": block_n(16), "num_warps": 8}
        tiles |= {"fwd": fwd, "dq": fwd, "dkdv": {"ROWS": 16, "BLOCK_N": 16, "num_warps": 8}}
        return _override_tiles(tiles, override)
    # num_stages=2 (fwd, dq) and 4 warps (dkdv): tools/profile_selection.py on an H200 (Triton
    # 3.6, 2026-11-26) at the seed shape (2k, 16k) and the paper shape (16k), bitwise the same
    # results: fwd 1.2-1.45x, dq 1.13-1.24x, dkdv 1.09-1.9x faster than Triton's defaults.
    # 2 warps for one query of a small group at D <= 64 (16 rows x 64: half the warps idle at 4):
    # seed 16k on an H100 (profile_selection, 2026-11-26, bitwise-equal dq, o within 1e-3 of the
    # 4-warp order) fwd 1.271 vs 1.455 ms, dq 1.156 vs 1.325
    warps = 2 if tq == 1 and rows == 16 and D_P <= 64 else 4 if rows * D_P <= 64 * 64 or tq == 1 and rows == 16 else 8
    # the dense mode at D <= 64 (every block read, the loop as long as a causal FlashAttention's):
    # 3 stages, fwd 1.121 vs 1.201 ms, dq 1.271 vs 1.420 (profile_selection, H200, per head 2k x 32,
    # 2026-11-28, bitwise the same o, dq, dk, dv; 128-row tiles were no faster, or spilled)
    stages = 3 if tiles["dense"] and D_P <= 64 else 2
    tiles |= {
        "fwd": {"TQ": tq, "ROWS": rows, "BLOCK_N": block_n(64 if D_P <= 128 else 32), "num_warps": warps,
                "num_stages": stages},
        "dq": {"TQ": tq, "ROWS": rows, "BLOCK_N": block_n(64 if D_P <= 64 else 32), "num_warps": warps,
               "num_stages": stages},
        # ROWS: (query, head) pairs per tile. 64 at D 128 too: tools/profile_selection.py on an
        # H200 (2026-11-26, paper shape) 23.3 ms vs 30.3 at 64k, 5.8 vs 7.6 at 16k, bitwise the same
        # dk/dv (16 bytes of spill notwithstanding); 128 at D <= 64: seed 16k on an H100, 0.561 vs
        # 0.691 ms, bitwise the same (210 registers, no spill)
        # dense: 64 rows and 64 keys at D 64 (profile_selection, H100, 2k x 32, 2026-11-28: 64 rows
        # 2.40 ms vs 3.94 at 128 per head, 2.62 vs 3.90 group-shared; then 64 keys 1.98 and 2.28,
        # 239 registers, no spill; its rows also read their choices)
        "dkdv": {"ROWS": 128 if D_P <= 64 and not tiles["dense"] else 64 if D_P <= 128 else 32,
                 "BLOCK_N": block_n(64 if tiles["dense"] and D_P <= 64 else 32), "num_warps": 4},
    }
    return _override_tiles(tiles, override)


def _override_tiles(tiles: dict, override: dict | None) -> dict:
    for kernel, params in (override or {}).items():
        if kernel == "dense":
            tiles["dense"] = bool(params)
            continue
        if kernel not in ("fwd", "dq", "dkdv", "reduce"):
            raise ValueError(f"_tiles: unknown kernel {kernel!r} in override")
        tiles[kernel] = tiles[kernel] | params  # a new dict: fp32's fwd and dq share one
    return tiles


@jit
def _query_rows(G, S, HPG: tl.constexpr, TQ: tl.constexpr, ROWS: tl.constexpr):
    """The forward's and dq's program: a tile of TQ consecutive queries of one (batch, group), its
    rows the tile's (query, head) pairs, query-major (TQ queries x HPG heads), ROWS of them from
    program_id(2). Returns tile, bg, b (int64), g, and t (query token), row_ok, head (int64) [ROWS]."""
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    pair = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    t = tile * TQ + pair // HPG  # [ROWS] query token of each row
    row_ok = (pair < TQ * HPG) & (t < S)
    head = (g * HPG + pair % HPG).to(tl.int64)
    return tile, bg, b, g, t, row_ok, head


@jit
def _row_choices(IDX, b, g, t64, row_ok, sib, sig, sis, sin_, N_SEL, N_P: tl.constexpr):
    """Each row's own block list [ROWS, N_P] int32 (-1 padded), to test membership of the tile's
    blocks."""
    nsel = tl.arange(0, N_P)
    return tl.load(IDX + b * sib + g.to(tl.int64) * sig + t64[:, None] * sis + nsel[None, :] * sin_,
                   mask=row_ok[:, None] & (nsel < N_SEL)[None, :], other=-1).to(tl.int32)


@jit
def _union_blocks(IDX, UNION, UCNT, b, g, bg, tile, sib, sig, sis, NT, N_SEL, S, SK, Q_OFF, BS,
                  TQ: tl.constexpr, ALL: tl.constexpr):
    """The blocks the tile reads, as a base pointer and a count: the tile's row of `_tile_union`'s
    union, or for TQ = 1 the query's own ascending list (read with stride sin_; no union tensors),
    or with ALL (few blocks, `_tiles`' "dense") every block up to the tile's last query's, 0..count-1
    (no union tensors: u_base unused)."""
    if ALL:
        u_base = UNION
        n_union = tl.minimum((Q_OFF + tl.minimum(tile * TQ + TQ, S) - 1) // BS + 1, (SK + BS - 1) // BS)
    elif TQ == 1:
        u_base = IDX + b * sib + g.to(tl.int64) * sig + tile.to(tl.int64) * sis
        n_union = N_SEL
    else:
        u_base = UNION + (bg * NT + tile).to(tl.int64) * (TQ * N_SEL + 1)
        n_union = tl.load(UCNT + bg * NT + tile)
    return u_base, n_union


@jit
def _union_chunk(u_base, it, cols, sin_, S, BS, TQ: tl.constexpr, CPB: tl.constexpr, BLOCK_N: tl.constexpr,
                 ALL: tl.constexpr):
    """Step `it` of the flat (union block, chunk) loop over the tile's blocks (u_base, from
    `_union_blocks`): the block id blk, the chunk's token ids s and col_ok [BLOCK_N] (the block's
    tokens that exist; none for a padding id < 0)."""
    u = it // CPB
    if ALL:
        blk = u
    elif TQ == 1:
        blk = tl.load(u_base + u * sin_).to(tl.int32)
    else:
        blk = tl.load(u_base + u)
    s = blk * BS + (it - u * CPB) * BLOCK_N + cols  # [BLOCK_N] token ids
    lo = tl.where(blk >= 0, blk * BS, S)  # an id < 0 (TQ = 1 padding) holds no token
    col_ok = (s >= lo) & (s < blk * BS + BS) & (s < S)
    return blk, s, col_ok


@jit
def _document_chunk(u_base, it, cols, sin_, S, BS, doc, TQ: tl.constexpr, CPB: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """`_union_chunk` with packed documents: a block is named by its first token `start` (the
    union of `_tile_union(..., pos)` holds those, all >= 0; for TQ = 1 the query's own list gives
    start = doc + id * l', doc its document start, a scalar). Returns start, the chunk's token
    ids s and col_ok [BLOCK_N] (the block's tokens in [0, S); none for padding or start < 0)."""
    u = it // CPB
    if TQ == 1:
        blk = tl.load(u_base + u * sin_).to(tl.int32)
        start = tl.where(blk >= 0, doc + blk * BS, -1)
    else:
        start = tl.load(u_base + u)
    s = start + (it - u * CPB) * BLOCK_N + cols  # [BLOCK_N] token ids
    lo = tl.where(start >= 0, start, S)  # padding, or a block before token 0 (pos[t] > t): no token
    col_ok = (s >= lo) & (s < start + BS) & (s < S)
    return start, s, col_ok


@jit
def _document_rows(POS, chosen, b, tile, t64, row_ok, S, BS, TQ: tl.constexpr):
    """Packed documents, the forward's and dq's program: the document start doc = t - pos[t] of
    its query for TQ = 1 (a scalar; `_document_chunk` adds it to the list's ids), and for TQ > 1
    each row's chosen blocks [ROWS, N_P] as their first tokens doc + id * l' per row, -1 for
    padding and for a block that would start before token 0 (pos[t] > t): what the entries of
    `_tile_union(..., pos)` are compared with. Returns (doc, chosen) (doc 0 for TQ > 1, unused)."""
    if TQ == 1:
        doc = document_start(POS, b, tile.to(tl.int64), tile < S, S)
    else:
        doc = 0
        start = document_start(POS, b, t64, row_ok, S)[:, None] + chosen * BS
        chosen = tl.where((chosen >= 0) & (start >= 0), start, -1)
    return doc, chosen


@jit
def fwd_kernel(
    Q, K, V, IDX, UNION, UCNT, O, LSE, POS,  # POS: [B, S] int64 positions in the documents (None without HAS_POS)
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd,
    sib, sig, sis, sin_, sob, soh, sos, sod,
    S, G, N_SEL, BS, NT, qk_scale,  # qk_scale = scale * log2(e)
    SK, Q_OFF,  # the keys' length and the token of query row 0 (a chunk of queries; S and 0 otherwise)
    HPG: tl.constexpr, TQ: tl.constexpr, ROWS: tl.constexpr, N_P: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_N: tl.constexpr,
    CPB: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,  # CPB = ceil(l' / BLOCK_N)
    HAS_POS: tl.constexpr, ALL: tl.constexpr,  # ALL: every block up to the tile's last query (no union)
):  # fmt: skip
    tile, bg, b, g, t, row_ok, head = _query_rows(G, S, HPG, TQ, ROWS)
    dk, dv, dk_ok, dv_ok = dim_ranges(DK, DV, DK_P, DV_P)
    t64 = t.to(tl.int64)
    q = load_tile(Q + b * sqb + head[:, None] * sqh, t64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [ROWS, DK_P]
    chosen = _row_choices(IDX, b, g, t64, row_ok, sib, sig, sis, sin_, N_SEL, N_P)  # [ROWS, N_P]
    if HAS_POS:  # blocks named by their first token: one document start per query
        doc, chosen = _document_rows(POS, chosen, b, tile, t64, row_ok, S, BS, TQ)
    k_base = K + b * skb + g.to(tl.int64) * skg
    v_base = V + b * svb + g.to(tl.int64) * svg
    u_base, n_union = _union_blocks(IDX, UNION, UCNT, b, g, bg, tile, sib, sig, sis, NT, N_SEL, S, SK, Q_OFF, BS,
                                    TQ, ALL)
    cols = tl.arange(0, BLOCK_N)

    m_i, l_i, acc = softmax_state(ROWS, DV_P)
    # one flat loop over (block of the tile's union, chunk) pairs; each row masks the blocks
    # it did not choose and the tokens after it (no data-dependent branch around the loads, so
    # Triton's pipeliner prefetches the next pair during this one's compute)
    for it in range(0, n_union * CPB):
        if HAS_POS:
            blk, s, col_ok = _document_chunk(u_base, it, cols, sin_, S, BS, doc, TQ, CPB, BLOCK_N)
        else:
            blk, s, col_ok = _union_chunk(u_base, it, cols, sin_, SK, BS, TQ, CPB, BLOCK_N, ALL)
        s64 = s.to(tl.int64)
        k = load_tile(k_base, s64, dk, sks, skd, col_ok, dk_ok, UPCAST)  # [BLOCK_N, DK_P]
        v = load_tile(v_base, s64, dv, svs, svd, col_ok, dv_ok, UPCAST)  # [BLOCK_N, DV_P]
        if TQ == 1 and not ALL:  # the query's own list, slot by slot: a repeated id is met (and counts) twice
            times = tl.full([ROWS], 1.0, tl.float32)
        else:
            times = reduce_sum((chosen == blk).to(tl.float32), 1)  # [ROWS] how often the row chose blk
        valid = (times[:, None] > 0) & col_ok[None, :] & (s[None, :] <= Q_OFF + t[:, None])
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [ROWS, BLOCK_N]
        qk = tl.where(valid, qk, float("-inf"))
        # p 0 where masked; a block chosen twice counts twice
        m_new, alpha, p, l_i = softmax_update(m_i, l_i, qk, times)
        acc = softmax_accumulate(acc, alpha, p, v, V.dtype.element_ty, PREC, UPCAST)
        m_i = m_new

    o, lse = softmax_finish(acc, m_i, l_i)  # a row without a valid token: o 0, lse -inf
    store_tile(O + b * sob + head[:, None] * soh, t64, dv, sos, sod, o, row_ok, dv_ok)
    tl.store(LSE + (b * G * HPG + head) * S + t64, lse, mask=row_ok)


@jit
def dq_kernel(
    Q, K, V, IDX, UNION, UCNT, DO, O, LSE, DELTA, DQ, POS,
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd,
    sib, sig, sis, sin_, sdob, sdoh, sdos, sdod, sob, soh, sos, sod, sdqb, sdqh, sdqs, sdqd,
    S, G, N_SEL, BS, NT, scale, qk_scale,
    SK, Q_OFF,  # as the forward's
    HPG: tl.constexpr, TQ: tl.constexpr, ROWS: tl.constexpr, N_P: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_N: tl.constexpr,
    CPB: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,  # CPB = ceil(l' / BLOCK_N)
    HAS_POS: tl.constexpr, ALL: tl.constexpr,  # ALL: every block up to the tile's last query (no union)
):  # fmt: skip
    tile, bg, b, g, t, row_ok, head = _query_rows(G, S, HPG, TQ, ROWS)
    dk, dv, dk_ok, dv_ok = dim_ranges(DK, DV, DK_P, DV_P)
    t64 = t.to(tl.int64)
    q = load_tile(Q + b * sqb + head[:, None] * sqh, t64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [ROWS, DK_P]
    do = load_tile(DO + b * sdob + head[:, None] * sdoh, t64, dv, sdos, sdod, row_ok, dv_ok, UPCAST)  # [ROWS, DV_P]
    o = load_tile(O + b * sob + head[:, None] * soh, t64, dv, sos, sod, row_ok, dv_ok, False)
    delta = row_delta(do, o)  # [ROWS]
    row_lin = (b * G * HPG + head) * S + t64
    tl.store(DELTA + row_lin, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_lin, mask=row_ok, other=0.0) * 1.4426950408889634
    chosen = _row_choices(IDX, b, g, t64, row_ok, sib, sig, sis, sin_, N_SEL, N_P)  # [ROWS, N_P]
    if HAS_POS:
        doc, chosen = _document_rows(POS, chosen, b, tile, t64, row_ok, S, BS, TQ)
    k_base = K + b * skb + g.to(tl.int64) * skg
    v_base = V + b * svb + g.to(tl.int64) * svg
    u_base, n_union = _union_blocks(IDX, UNION, UCNT, b, g, bg, tile, sib, sig, sis, NT, N_SEL, S, SK, Q_OFF, BS,
                                    TQ, ALL)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.full([ROWS, DK_P], 0.0, tl.float32)
    # the forward's flat (union block, chunk) loop, each row masking what it did not choose
    # (p = 0 there; an empty row's lse is -inf, but it has no valid column)
    for it in range(0, n_union * CPB):
        if HAS_POS:
            blk, s, col_ok = _document_chunk(u_base, it, cols, sin_, S, BS, doc, TQ, CPB, BLOCK_N)
        else:
            blk, s, col_ok = _union_chunk(u_base, it, cols, sin_, SK, BS, TQ, CPB, BLOCK_N, ALL)
        s64 = s.to(tl.int64)
        k = load_tile(k_base, s64, dk, sks, skd, col_ok, dk_ok, UPCAST)  # [BLOCK_N, DK_P]
        v = load_tile(v_base, s64, dv, svs, svd, col_ok, dv_ok, UPCAST)  # [BLOCK_N, DV_P]
        if TQ == 1 and not ALL:
            times = tl.full([ROWS], 1.0, tl.float32)
        else:
            times = reduce_sum((chosen == blk).to(tl.float32), 1)
        valid = row_ok[:, None] & (times[:, None] > 0) & col_ok[None, :] & (s[None, :] <= Q_OFF + t[:, None])
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(valid, tl.exp2(qk - lse2[:, None]), 0.0) * times[:, None]  # [ROWS, BLOCK_N]
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        ds = ds.to(K.dtype.element_ty)
        if UPCAST:
            ds = ds.to(tl.float32)
        acc += tl.dot(ds, k, input_precision=PREC)
    dq = acc * scale
    store_tile(DQ + b * sdqb + head[:, None] * sdqh, t64, dk, sdqs, sdqd, dq, row_ok, dk_ok)


@jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, PK, PV,
    ITEM_KEY, ITEM_SEG, QOFF, NSEG, QTOK, QSTART,  # QSTART: each entry's block start (None without HAS_POS)
    IDX,  # ALL: block_idx [B, G, S, n], each row's choices (None otherwise)
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd,
    sdob, sdoh, sdos, sdod, sdkb, sdkg, sdks, sdkd, sdvb, sdvg, sdvs, sdvd, sib, sig, sis, sin_,
    S, G, NB, BS, SEG, N_SEL, scale, qk_scale,
    SK, Q_OFF,  # as the forward's: the blocks are the keys' (NB = ceil(SK / l'))
    HPG: tl.constexpr, DK_: tl.constexpr, DV_: tl.constexpr,
    DK_P: tl.constexpr, DV_P: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    CPB: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,  # CPB = ceil(l' / BLOCK_N)
    HAS_POS: tl.constexpr, ALL: tl.constexpr, N_P: tl.constexpr,
):  # fmt: skip
    # a 1-D grid of U * CPB programs, the chunk fastest: the CPB programs of an item run
    # together and share its q / dO rows in L2 (1-D: U can pass CUDA's 65535 limit on grid y).
    # ALL (few blocks): one item per KV block, B*G*NB of them, no inverted selection: the item
    # walks every query from the block's first token on, each row weighted by how often its
    # query chose the block (0: masked)
    pid = tl.program_id(0)
    item = pid // CPB
    chunk = pid - item * CPB
    if ALL:
        key = item
        item_ok = key >= 0
        seg = 0
    else:
        key_raw = tl.load(ITEM_KEY + item)  # (b*G + g)*NB + block, -1 for an unused item
        item_ok = key_raw >= 0
        key = tl.maximum(key_raw, 0)
        seg = tl.load(ITEM_SEG + item)
    blk = key % NB
    bg = key // NB
    b = (bg // G).to(tl.int64)
    g = bg % G
    if ALL:  # rows: the queries from the block's first token on
        q_lo = tl.maximum(blk * BS - Q_OFF, 0)
        q_hi = S
    else:
        q_lo = tl.load(QOFF + key) + seg * SEG
        q_hi = tl.minimum(tl.load(QOFF + key + 1), q_lo + SEG)
    n_pairs = tl.where(item_ok, tl.maximum(q_hi - q_lo, 0), 0) * HPG  # (query, head) pairs of this item

    j = chunk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] offset in the block
    s = blk * BS + j  # token ids
    col_ok = (j < BS) & (s < SK)
    s64 = s.to(tl.int64)
    dk, dv, dk_ok, dv_ok = dim_ranges(DK_, DV_, DK_P, DV_P)
    kmask = col_ok[:, None] & dk_ok[None, :]
    vmask = col_ok[:, None] & dv_ok[None, :]
    k = load_tile(K + b * skb + g.to(tl.int64) * skg, s64, dk, sks, skd, col_ok, dk_ok, UPCAST)  # [BLOCK_N, DK_P]
    v = load_tile(V + b * svb + g.to(tl.int64) * svg, s64, dv, svs, svd, col_ok, dv_ok, UPCAST)  # [BLOCK_N, DV_P]

    acc_k = tl.full([BLOCK_N, DK_P], 0.0, tl.float32)
    acc_v = tl.full([BLOCK_N, DV_P], 0.0, tl.float32)
    rows = tl.arange(0, ROWS)
    for p0 in range(0, n_pairs, ROWS):
        pr = p0 + rows  # [ROWS] (query, head) pair ids: query-major, heads inside
        row_ok = pr < n_pairs
        if ALL:
            tq = q_lo + pr // HPG
        else:
            tq = tl.load(QTOK + q_lo + pr // HPG, mask=row_ok, other=0)  # query token of each row
        head = (g * HPG + pr % HPG).to(tl.int64)
        tq64 = tq.to(tl.int64)
        q = load_tile(Q + b * sqb + head[:, None] * sqh, tq64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [ROWS, DK_P]
        do = load_tile(DO + b * sdob + head[:, None] * sdoh, tq64, dv, sdos, sdod, row_ok, dv_ok, UPCAST)
        lse2, delta = row_stats(LSE, DELTA, (b * G * HPG + head) * S + tq64, row_ok)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [ROWS, BLOCK_N]
        valid = row_ok[:, None] & col_ok[None, :] & (s[None, :] <= Q_OFF + tq[:, None])
        if HAS_POS:  # the entry's own block [start, start + l'), which this grid block cuts
            start = tl.load(QSTART + q_lo + pr // HPG, mask=row_ok, other=0)[:, None]
            valid = valid & (s[None, :] >= start) & (s[None, :] < start + BS)
        if ALL:  # how often the row's query chose this block (duplicates count twice, as listed twice)
            chosen = _row_choices(IDX, b, g, tq64, row_ok, sib, sig, sis, sin_, N_SEL, N_P)
            times = reduce_sum((chosen == blk).to(tl.float32), 1)  # [ROWS]
            valid = valid & (times[:, None] > 0)  # before exp2: an empty row's lse is -inf
            p = tl.where(valid, tl.exp2(qk - lse2[:, None]), 0.0) * times[:, None]
        else:
            p = tl.where(valid, tl.exp2(qk - lse2[:, None]), 0.0)
        pv = p.to(DO.dtype.element_ty)
        if UPCAST:
            pv = pv.to(tl.float32)
        acc_v += tl.dot(tl.trans(pv), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # [ROWS, BLOCK_N]
        ds = p * (dp - delta[:, None])
        ds = ds.to(Q.dtype.element_ty)
        if UPCAST:
            ds = ds.to(tl.float32)
        acc_k += tl.dot(tl.trans(ds), q, input_precision=PREC)
    acc_k = acc_k * scale

    # one segment: the final value; several: an fp32 partial per item, summed by reduce_kernel
    # (the scalar conditions become column limits: block masks only)
    if ALL:
        nseg = 1
    else:
        nseg = tl.load(NSEG + key)
    direct = (j < tl.where(item_ok & (nseg == 1), BS, 0))[:, None]
    split = (j < tl.where(item_ok & (nseg > 1), BS, 0))[:, None]
    tl.store(DK + b * sdkb + g.to(tl.int64) * sdkg + s64[:, None] * sdks + dk[None, :] * sdkd,
             acc_k.to(DK.dtype.element_ty), mask=kmask & direct)
    tl.store(DV + b * sdvb + g.to(tl.int64) * sdvg + s64[:, None] * sdvs + dv[None, :] * sdvd,
             acc_v.to(DV.dtype.element_ty), mask=vmask & direct)
    item64 = item.to(tl.int64)
    jk = j.to(tl.int64)[:, None]
    tl.store(PK + (item64 * BS + jk) * DK_ + dk[None, :], acc_k, mask=kmask & split)
    tl.store(PV + (item64 * BS + jk) * DV_ + dv[None, :], acc_v, mask=vmask & split)


@jit
def reduce_kernel(
    PK, PV, DK, DV, NSEG, ITEM_START,
    sdkb, sdkg, sdks, sdkd, sdvb, sdvg, sdvs, sdvd,
    S, G, NB, BS,
    DK_: tl.constexpr, DV_: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    key = tl.program_id(0)
    chunk = tl.program_id(1)
    nseg = tl.load(NSEG + key)
    first = tl.load(ITEM_START + key).to(tl.int64)
    blk = key % NB
    bg = key // NB
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)
    j = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    s = blk * BS + j
    col_ok = (j < BS) & (s < S)
    s64 = s.to(tl.int64)
    jk = j.to(tl.int64)[:, None]
    split = (j < tl.where(nseg > 1, BS, 0))[:, None]
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    kmask = col_ok[:, None] & (dk < DK_)[None, :]
    vmask = col_ok[:, None] & (dv < DV_)[None, :]
    acc_k = tl.full([BLOCK_N, DK_P], 0.0, tl.float32)
    acc_v = tl.full([BLOCK_N, DV_P], 0.0, tl.float32)
    for i in range(tl.where(nseg > 1, nseg, 0)):  # in segment order: deterministic
        acc_k += tl.load(PK + ((first + i) * BS + jk) * DK_ + dk[None, :], mask=kmask, other=0.0)
        acc_v += tl.load(PV + ((first + i) * BS + jk) * DV_ + dv[None, :], mask=vmask, other=0.0)
    tl.store(DK + b * sdkb + g * sdkg + s64[:, None] * sdks + dk[None, :] * sdkd,
             acc_k.to(DK.dtype.element_ty), mask=kmask & split)
    tl.store(DV + b * sdvb + g * sdvg + s64[:, None] * sdvs + dv[None, :] * sdvd,
             acc_v.to(DV.dtype.element_ty), mask=vmask & split)


def _require(q, k, v, block_idx, block_size, pos) -> None:
    why = unsupported_reason(q, k, v, block_idx, block_size, pos)
    if why is not None:
        raise ValueError(f"selected_attention (triton): cannot run these inputs: {why}")


def selected_forward(q, k, v, block_idx, block_size: int, scale: float, pos=None, q_offset: int = 0,
                     doc_len: int = 0, *, tiles: dict | None = None):
    """o [B, H, S, Dv] (v's dtype) and lse [B, H, S] float32 (natural log, -inf on empty rows).
    pos: [B, S] int64 positions in the documents (packed documents), or None. q_offset: a chunk
    of queries, row t is token q_offset + t of k and v's SK >= q_offset + S tokens (the op checks
    it; not with pos). doc_len: with pos, the longest document where the caller knows it (a hint
    for the tiles, `_tile_len`; 0: unknown). `tiles`: an override of `_tiles`
    (tools/profile_selection.py); None, the default tiles."""
    _require(q, k, v, block_idx, block_size, pos)
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    h = H // G
    o, lse = empty_attention_outputs(q, v)  # the op's output layout: [B, S, H, Dv] memory
    if B * H * S == 0:
        return o, lse
    pos = None if pos is None else pos.contiguous()
    T = _tiles(h, Dk, Dv, block_size, q.dtype == torch.float32, tiles, seq_len=_tile_len(S, pos, doc_len),
               n_selected=block_idx.shape[3], keys=k.shape[2], packed=pos is not None)
    union = _tile_union(block_idx, block_size, S, T["fwd"]["TQ"], pos, k.shape[2], T["dense"], q_offset)
    _fwd_stage(q, k, v, block_idx, union, block_size, scale, T, o, lse, pos, q_offset)
    return o, lse


def _tile_len(S: int, pos, doc_len: int) -> int:
    """The query span `_tiles` plans for: S, or with packed documents the longest document where
    the caller knows it (doc_len > 0, e.g. positions that are a constant of the graph). One row of
    packed tokens (varlen, T = 65,536 in documents of 2,048) would otherwise get the long
    sequence's one-query tiles, though no query sees past its document: seed shape, H200, random
    choices (.gpu scratch, session 22): fwd 4.79 -> 1.86 ms, bwd 6.77 -> 4.17. A hint only: the
    tiles change the speed, never the results (a wrong doc_len is as correct as 0)."""
    return min(S, doc_len) if pos is not None and doc_len > 0 else S


def _document_starts(block_idx: torch.Tensor, pos: torch.Tensor, block_size: int, S: int):
    """Packed documents: the first token of every choice, start = doc + id * l' [B, G, S, n]
    int64 (doc = t - pos[t] clamped into [-1, S], as the kernels' attention_tiles.document_start),
    and `chosen` [B, G, S, n]: the entry names a block (id >= 0) that does not start before token
    0 (start < 0 only where pos[t] > t, not a position)."""
    t = torch.arange(S, device=block_idx.device)
    doc = (t - pos).clamp(-1, S)  # [B, S]
    start = doc[:, None, :, None] + block_idx * block_size
    return start, (block_idx >= 0) & (start >= 0)


def _tile_union(block_idx: torch.Tensor, block_size: int, S: int, TQ: int, pos: torch.Tensor | None = None,
                keys: int | None = None, dense: bool = False, q_offset: int = 0):
    """The blocks each tile of TQ consecutive queries reads: per (batch, group, tile), the
    distinct block ids its queries chose that hold a token the choosing query sees (0 <= id <
    NB = ceil(keys / l'), keys: the length of K/V, S when None; and id * l' <= its token
    q_offset + t: a block chosen after its query, which a non-causal choice lists, adds nothing
    to any row), ascending, in `union` [B*G, NT, TQ*n+1] int32 (entries past `count` unused), and
    `count` [B*G, NT] int32; NT = ceil(S / TQ). With pos (packed documents) a query's block j is
    the tokens [start, start + l'), start = t - pos[t] + j * l', which queries of other documents
    in the same tile name with other ids and which need not sit on the l' grid: the union then
    holds the distinct starts in [0, t] (`union_kernel`). One kernel, no host sync. Returns
    (union, count, NT); for TQ = 1 no tensors (placeholders): the kernels read the query's own
    list slot by slot; likewise with `dense` (`_tiles`' choice for few blocks: the kernels read
    every block up to the tile's last query)."""
    B, G, _, n = block_idx.shape
    NT, NB = _cdiv(S, TQ), _cdiv(S if keys is None else keys, block_size)
    device = block_idx.device
    if TQ == 1 or dense:  # the kernels read each query's own list or every block (placeholders, never read)
        none = torch.zeros(1, dtype=torch.int32, device=device)
        return none, none, NT
    union = torch.empty(B * G, NT, TQ * n + 1, dtype=torch.int32, device=device)
    count = torch.empty(B * G, NT, dtype=torch.int32, device=device)
    if B * G * NT:
        E_P = max(2, _next_pow2(TQ * n))
        union_kernel[(B * G, NT)](
            block_idx, pos, union, count, *block_idx.stride(), S, G, NT, NB, n, block_size, q_offset,
            TQ=TQ, E_P=E_P, LOG_E=E_P.bit_length() - 1, HAS_POS=pos is not None, num_warps=4,
        )  # fmt: skip
    return union, count, NT


@jit
def union_kernel(
    IDX, POS, UNION, UCNT, sib, sig, sis, sin_, S, G, NT, NB, N_SEL, BS, Q_OFF,
    TQ: tl.constexpr, E_P: tl.constexpr, LOG_E: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    """`_tile_union`'s union of one (batch * group, tile): its TQ * n entries as keys (the block
    id, or with pos the block's first token; a sentinel where the entry names no token its query
    sees: padding, a block past the keys, starting before token 0 or after the query's token
    Q_OFF + row, a row past S), sorted (block selection's
    bitonic network in registers), then each first of a run of equal keys written at its rank
    (the sorted keys go through the union's row once: a key's predecessor is read back from
    there), and the count."""
    bg = tl.program_id(0)
    tile = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)
    e = tl.arange(0, E_P)
    E = TQ * N_SEL
    row = (tile * TQ + e // N_SEL).to(tl.int64)
    ok = (e < E) & (row < S)
    ids = tl.load(IDX + b * sib + g * sig + row * sis + (e % N_SEL) * sin_, mask=ok, other=-1)
    if HAS_POS:
        start = document_start(POS, b, row, ok, S).to(tl.int64) + ids * BS
        end = S
        key = tl.where(ok & (ids >= 0) & (start >= 0) & (start <= row), start, end).to(tl.int32)
    else:
        end = NB
        key = tl.where(ok & (ids >= 0) & (ids < NB) & (ids * BS <= Q_OFF + row), ids, end).to(tl.int32)
    key = tl.reshape(_sort_rows(tl.reshape(key, [1, E_P]), 1, E_P, LOG_E, False), [E_P])  # sentinels last
    base = UNION + (bg * NT + tile).to(tl.int64) * (E + 1)
    tl.store(base + e, key, mask=e < E)  # the valid keys sit in the first E places
    tl.debug_barrier()
    prev = tl.load(base + e - 1, mask=(e >= 1) & (e < E), other=-1)
    tl.debug_barrier()
    first = (key != prev) & (key < end) & (e < E)
    rank = cumulative_sum(first.to(tl.int32), 0) - 1
    tl.store(base + rank, key, mask=first)
    tl.store(UCNT + bg * NT + tile, reduce_sum(first.to(tl.int32), 0))


def _fwd_stage(q, k, v, block_idx, union, block_size, scale, T, o, lse, pos=None, q_offset: int = 0):
    """The forward kernel into o and lse (allocated by the caller), over `_tile_union`'s tiles
    (made with T["fwd"]["TQ"] and the same pos: contiguous, or None). Returns what the launch
    returns (the compiled kernel, whose registers and spills tools/profile_selection.py shows)."""
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    h, n = H // G, block_idx.shape[3]
    cfg = T["fwd"]
    u, count, NT = union
    grid = (NT, B * G, _cdiv(cfg["TQ"] * h, cfg["ROWS"]))
    return fwd_kernel[grid](
        q, k, v, block_idx, u, count, o, lse, pos,
        *q.stride(), *k.stride(), *v.stride(), *block_idx.stride(), *o.stride(),
        S, G, n, block_size, NT, scale * math.log2(math.e), k.shape[2], q_offset,
        HPG=h, N_P=max(2, _next_pow2(n)), DK=Dk, DV=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"],
        CPB=_cdiv(block_size, cfg["BLOCK_N"]), PREC=_dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype),
        HAS_POS=pos is not None, ALL=T["dense"] and cfg["TQ"] > 1, **cfg,
    )  # fmt: skip


def _inverted_selection(block_idx: torch.Tensor, block_size: int, S: int, segment: int,
                        pos: torch.Tensor | None = None, keys: int | None = None, q_offset: int = 0):
    """The selection inverted, per (batch, group, KV block) key = (b*G + g)*NB + block, with
    NB = ceil(keys / l') (keys: K/V's length, S when None; a chunk of queries, row t at token
    q_offset + t, reads keys >= q_offset + S tokens), as work items of at most `segment` query
    entries (torch ops, no host sync):

        qtok [E] int32        query tokens, grouped by key, ascending t within a key
        qoff [NK + 1] int32   key k's queries are qtok[qoff[k]:qoff[k + 1]]
        nseg [NK] int32       its number of items (at least 1, so every block is written)
        item_start [NK] int32 its first item
        item_key, item_seg [U] int32   per item: its key (-1 past the last item) and segment
        qstart [E] int32      with pos: the first token of the entry's chosen block (None without)
    U = NK + E_max // segment bounds the number of items statically (E_max = B*G*S*n, and twice
    that with pos). Entry (b, g, t, i) is valid when 0 <= block_idx <= t // l' (the block holds a
    token <= t). With pos (packed documents) a choice's block [start, start + l') (start =
    t - pos[t] + id * l') need not sit on the l' grid: it is listed under the grid block of its
    first token and, when it is cut by the grid and reaches a token <= t in the next grid block,
    under that one too (two entries per choice, the second invalid where unused); the dk/dv
    kernel masks each entry's tokens to [start, start + l').
    """
    B, G, _, n = block_idx.shape
    device = block_idx.device
    NB = _cdiv(S if keys is None else keys, block_size)
    NK = B * G * NB
    t = q_offset + torch.arange(S, device=device)[:, None]  # [S, 1] the rows' tokens
    bg = torch.arange(B * G, device=device).view(B, G, 1, 1)
    if pos is None:
        valid = (block_idx >= 0) & (block_idx * block_size <= t)  # [B, G, S, n]
        key = torch.where(valid, bg * NB + block_idx, NK).flatten()  # invalid entries sort last
        per_choice = 1
    else:
        start, chosen = _document_starts(block_idx, pos, block_size, S)  # [B, G, S, n]
        first = chosen & (start <= t)  # holds a token <= t (start in [0, t])
        grid = start.clamp(min=0) // block_size  # the grid block of its first token
        second = first & (start % block_size != 0) & ((grid + 1) * block_size <= t)
        key = torch.stack((torch.where(first, bg * NB + grid, NK), torch.where(second, bg * NB + grid + 1, NK)),
                          dim=-1).flatten()  # [B*G*S*n*2]
        per_choice = 2
    if NK < torch.iinfo(torch.int16).max:
        # the narrowest keys that hold NK: the CUDA radix sort makes one pass per 8 key bits (the
        # sort took 1.02 ms a step at the seed shape with per-head selection as int64: profile_step,
        # H200). int16, 2 passes, for NK < 32767 (the seed's 2,048 keys): a stable sort of 2.1M
        # keys 0.101 ms against 0.153 as int32, of 4.2M (packed) 0.149 against 0.245 (H200,
        # .gpu scratch, session 22)
        key = key.to(torch.int16)
    elif NK < torch.iinfo(torch.int32).max:
        key = key.to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    qtok = (order // (n * per_choice) % S).to(torch.int32)
    qoff = torch.searchsorted(sorted_key, torch.arange(NK + 1, device=device, dtype=key.dtype))  # [NK + 1]
    counts = qoff[1:] - qoff[:-1]
    nseg = ((counts + segment - 1) // segment).clamp_min(1)
    item_end = torch.cumsum(nseg, 0)
    item_start = item_end - nseg
    U = NK + key.numel() // segment
    items = torch.arange(U, device=device)
    item_key = torch.searchsorted(item_end, items, right=True)  # NK past the last item
    used = item_key < NK
    item_seg = items - item_start[item_key.clamp(max=NK - 1)]
    item_key = torch.where(used, item_key, -1)
    i32 = lambda x: x.to(torch.int32).contiguous()
    qstart = None if pos is None else i32(start.flatten()[order // 2])
    return i32(qtok), i32(qoff), i32(nseg), i32(item_start), i32(item_key), i32(item_seg), U, NB, qstart


def selected_backward(
    grad_o, q, k, v, o, lse, block_idx, block_size: int, scale: float, pos=None, q_offset: int = 0,
    doc_len: int = 0, *, tiles: dict | None = None, segment: int | None = None,
):  # fmt: skip
    """dq (like q), dk (like k), dv (like v): gradients of `selected_forward`'s o, given its o
    and lse (and the same pos, q_offset and doc_len). dk/dv are summed over the group's heads in fp32 without atomics
    (deterministic). `tiles` (an override of `_tiles`) and `segment` (None: DKV_SEGMENT) are for
    tools/profile_selection.py; the stages are `_dq_stage`, `_inverted_selection`, `_dkdv_stage`
    and `_reduce_stage`."""
    _require(q, k, v, block_idx, block_size, pos)
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    h = H // G
    if grad_o.dtype != v.dtype:
        grad_o = grad_o.to(v.dtype)
    dq, dk, dv = empty_attention_grads(q, k, v)  # the op's layout: [B, S, heads, D] memory
    if B * H * S == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    pos = None if pos is None else pos.contiguous()
    T = _tiles(h, Dk, Dv, block_size, q.dtype == torch.float32, tiles, seq_len=_tile_len(S, pos, doc_len),
               n_selected=block_idx.shape[3], keys=k.shape[2], packed=pos is not None)
    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    union = _tile_union(block_idx, block_size, S, T["dq"]["TQ"], pos, k.shape[2], T["dense"], q_offset)
    _dq_stage(grad_o, q, k, v, o, lse, block_idx, union, block_size, scale, T, dq, delta, pos, q_offset)
    segment = DKV_SEGMENT if segment is None else segment
    if T["dense"]:  # few blocks: each KV block walks all later queries, no inverted selection
        _dkdv_stage(grad_o, q, k, v, lse, delta, None, block_size, segment, scale, T, dk, dv, q_offset, block_idx)
        return dq, dk, dv
    inv = _inverted_selection(block_idx, block_size, S, segment, pos, k.shape[2], q_offset)
    pk, pv, _ = _dkdv_stage(grad_o, q, k, v, lse, delta, inv, block_size, segment, scale, T, dk, dv, q_offset)
    _reduce_stage(pk, pv, inv, block_size, T, dk, dv)
    return dq, dk, dv


def _dq_stage(grad_o, q, k, v, o, lse, block_idx, union, block_size, scale, T, dq, delta, pos=None,
              q_offset: int = 0):
    """The dq kernel into dq and delta (allocated by the caller; lse contiguous), over
    `_tile_union`'s tiles made with T["dq"]["TQ"] and the same pos (contiguous, or None).
    Returns the launch's result, like `_fwd_stage`."""
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    h, n = H // G, block_idx.shape[3]
    cfg = T["dq"]
    u, count, NT = union
    return dq_kernel[(NT, B * G, _cdiv(cfg["TQ"] * h, cfg["ROWS"]))](
        q, k, v, block_idx, u, count, grad_o, o, lse, delta, dq, pos,
        *q.stride(), *k.stride(), *v.stride(), *block_idx.stride(), *grad_o.stride(), *o.stride(), *dq.stride(),
        S, G, n, block_size, NT, scale, scale * math.log2(math.e), k.shape[2], q_offset,
        HPG=h, N_P=max(2, _next_pow2(n)), DK=Dk, DV=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"],
        CPB=_cdiv(block_size, cfg["BLOCK_N"]), PREC=_dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype),
        HAS_POS=pos is not None, ALL=T["dense"] and cfg["TQ"] > 1, **cfg,
    )  # fmt: skip


def _dkdv_stage(grad_o, q, k, v, lse, delta, inv, block_size, segment, scale, T, dk, dv, q_offset: int = 0,
                block_idx=None):
    """The dk/dv kernel over the work items of `inv` (`_inverted_selection`'s result at this
    `segment`): writes dk/dv of single-item blocks, returns the fp32 partials (pk, pv) of the
    others (no rows when no block can need two items), and the launch's result. Packed documents
    come with `inv` (its qstart; None without pos). With T["dense"], inv is None: one item per
    KV block reads the choices from block_idx, and every block is written directly (no partials)."""
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    h = H // G
    if T["dense"]:
        NB = _cdiv(k.shape[2], block_size)
        U, none = B * G * NB, None
        qtok = qoff = nseg = item_key = item_seg = qstart = none
        n_sel, idx, idx_strides = block_idx.shape[3], block_idx, block_idx.stride()
    else:
        qtok, qoff, nseg, _, item_key, item_seg, U, NB, qstart = inv
        n_sel, idx, idx_strides = 0, None, (0, 0, 0, 0)
    pk_rows = U if not T["dense"] and U > B * G * NB else 0  # fp32 partials [U, l', D], only when a block can need two items
    pk = torch.empty(pk_rows, block_size, Dk, dtype=torch.float32, device=q.device)
    pv = torch.empty(pk_rows, block_size, Dv, dtype=torch.float32, device=q.device)
    cpb = _cdiv(block_size, T["dkdv"]["BLOCK_N"])
    launched = dkdv_kernel[(U * cpb,)](
        q, k, v, grad_o, lse, delta, dk, dv, pk, pv,
        item_key, item_seg, qoff, nseg, qtok, qstart, idx,
        *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *dk.stride(), *dv.stride(), *idx_strides,
        S, G, NB, block_size, segment, n_sel, scale, scale * math.log2(math.e), k.shape[2], q_offset,
        HPG=h, DK_=Dk, DV_=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"], CPB=cpb, PREC=_dot_precision(q.dtype),
        UPCAST=upcast_dots(q.dtype), HAS_POS=qstart is not None, ALL=T["dense"], N_P=max(2, _next_pow2(n_sel)),
        **T["dkdv"],
    )  # fmt: skip
    return pk, pv, launched


def _reduce_stage(pk, pv, inv, block_size, T, dk, dv):
    """Sums the partials of blocks split into several items into dk/dv (nothing without partials:
    returns None, else the launch's result)."""
    if pk.shape[0] == 0:
        return None
    B, G, S, Dk = dk.shape
    Dv = dv.shape[3]
    nseg, item_start, NB = inv[2], inv[3], inv[7]
    return reduce_kernel[(B * G * NB, _cdiv(block_size, T["reduce"]["BLOCK_N"]))](
        pk, pv, dk, dv, nseg, item_start,
        *dk.stride(), *dv.stride(),
        S, G, NB, block_size,
        DK_=Dk, DV_=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"], **T["reduce"],
    )  # fmt: skip
