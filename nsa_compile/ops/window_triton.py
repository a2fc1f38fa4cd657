"""Triton kernels for sliding-window causal GQA attention: the `triton` backend of
`nsa::window_attention` (nsa_compile/ops/window.py), forward and backward.

    o, lse = window_forward(q, k, v, window, scale, pos=None, q_offset=0)
    dq, dk, dv = window_backward(grad_o, q, k, v, o, lse, window, scale, pos=None, q_offset=0)
    why = unsupported_reason(q, k, v, pos)        # None when the kernels can run

Semantics of the op: q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv], H = G * h; query t of
head j attends to the keys s of KV head j // h with s <= t and t - s < window. With packed
documents, pos [B, S] int64 (each token's position in its document), also s >= t - pos[t]: the
keys of its own document (t - pos[t] is its document's first token). o [B, H, S, Dv] in v's
dtype, lse [B, H, S] float32 (natural log). q, k, v and grad_o may be any strided views (the
model passes [B, S, heads, D] memory transposed); o, dq, dk, dv come back as [B, heads, S, D]
views of [B, S, heads, D] memory, the op's layout.

A chunk of queries (the op's q_offset; not with pos): q holds S rows, k and v SK >= q_offset + S
tokens, and row r is token q_offset + r. The kernels take SK and Q_OFF as int arguments (one
compiled kernel for every chunk): key bounds are K/V's (SK), Q_OFF is added to a row's index where
it becomes the token compared with a key's (t = Q_OFF + r), and every load and store of a row
(q, o, lse, delta, dO, dq) stays at r. Both are read under the CHUNK constexpr (SK != S or
q_offset != 0), as pos under HAS_POS: the whole sequence (CHUNK False) compiles to the machine
code it had before chunks existed (tools/kernel_resources.py, Triton 3.9, sm_90: the same
registers and SASS at the seed and paper shapes). The chunk kernels, for the record (bf16, no
spills): forward / dk,dv / dq 228 / 204 / 108 registers at the seed shape (whole sequence: 236 /
198 / 122) and 172 / 244 / 167 at the paper's (175 / 254 / 225).

Packed documents without a host sync: pos is read only by the kernels (never on the host, no
data-dependent shape), as an optional POS pointer with the HAS_POS constexpr. Without pos,
POS is None (a constexpr to Triton) and HAS_POS False, so every `if HAS_POS` block is left out
and the kernels compile to the PTX they had before pos existed (compared for sm_90a, fp16/bf16,
D 64 and 128). With pos, each query row loads its document start t - pos[t] once
(attention_tiles.document_start, clamped into [-1, S]: positions that are not positions cannot
wrap around) and masks its keys with it; the forward and dq also start their key loop at the
tile's earliest document start (rounded down to BLOCK_N) when that is past the window's first
key. The dk/dv kernel masks each (query, key) pair with the query's start, loaded per query
tile; it walks the same query tiles as without pos.

Numerics (those of the op's `flash` backend, FA-2): scores q @ k^T accumulate in fp32 and stay
fp32, softmax in fp32 with an online max (exp2, log2(e) folded into the scale), p cast to v's
dtype for p @ v; the standard flash-attention backward with delta = rowsum(dO * O) in fp32.
fp32 inputs use IEEE dots (no TF32). No atomics: every kernel is deterministic.

Kernels (tile sizes from `_tiles`):
- forward, grid (ceil(S / BLOCK_M), B * H): BLOCK_M consecutive queries of one head walk the key
  tiles from the first key any of them sees (t0 - window + 1, rounded down to BLOCK_N) to the
  last query's token, about (window + BLOCK_M) / BLOCK_N tiles whatever S; an online softmax in fp32.
  The key tiles every row of the query tile sees whole (`_interior`: past the window's edge for
  the last row, before the diagonal for the first, past every row's document start with pos)
  run without a mask, those before and after them masked per (row, key) pair, in key order (at
  the seed's tiles and window about 6 of 10 tiles are interior).
  The running max starts at a finite floor (-1e30), so a tile masked for a row leaves its state
  unchanged instead of making NaN; a row that sees no key at all (only with pos[t] < 0) gets
  o 0 and lse -inf, and zero gradients in the backward.
- delta (attention_tiles.delta_kernel), the same grid: rowsum(dO * O) in fp32 per row, for both
  backward kernels (no [B, H, S, Dv] fp32 temporary).
- dk/dv, grid (ceil(SK / BLOCK_N), B * G): BLOCK_N keys of one KV head walk, for each of the
  group's h query heads in turn, the query tiles that see them (from the keys' own first token to
  window - 1 tokens past their last; none for keys no row of a chunk reads: dk, dv 0),
  accumulating dk and dv in fp32 in registers: the sum over the group's heads happens in the
  program, in a fixed order (no atomics, no partials).
- dq, grid as the forward: recomputes p from the saved lse over the forward's key tiles (its
  interior unmasked too) and accumulates dq = scale * ds @ k in fp32.

Supported (`unsupported_reason` says why not): CUDA tensors or any device under
TRITON_INTERPRET=1 (pos, where given, on the same device), q, k, v all fp16, bf16 or fp32, head
dims up to 256 (padded to a power of two >= 16 by masking), with or without packed documents.

The tile loads, the online-softmax step, the backward's row statistics, the delta kernel and the
document start are attention_tiles'. CPU interpreter: module-level `triton_support.jit` kernels,
as in selection_triton.py, with the same two interpreter workarounds (bf16 dot operands cast to
fp32 first; the reductions of `triton_support`).
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

from .attention_tiles import (
    delta_kernel, dim_ranges, document_start, load_tile, row_stats, softmax_accumulate, softmax_finish, softmax_state,
    softmax_update, store_tile,
)
from .triton_support import (
    cdiv as _cdiv, device_reason, dot_precision as _dot_precision, jit, next_pow2 as _next_pow2, qkv_reason,
    reduce_max, reduce_min, upcast_dots,
)

__all__ = ["unsupported_reason", "window_backward", "window_forward"]

MAX_HEAD_DIM = 256


def unsupported_reason(q, k, v, pos=None) -> str | None:
    """Why the Triton window kernels cannot run these inputs, or None when they can (packed
    documents included: pos [B, S] int64, which the op has checked, on q's device)."""
    return device_reason(q, k, v, pos) or qkv_reason(q, k, v, MAX_HEAD_DIM)


def _tiles(Dk: int, Dv: int, fp32: bool, override: dict | None = None) -> dict:
    """Tile sizes and launch options per kernel ("fwd", "delta", "dkdv", "dq"); `override`
    ({kernel: {parameter: value}}) replaces single entries (tools/bench_window.py --tiles).
    BLOCK_M and BLOCK_N stay powers of two >= 16."""
    DK_P, DV_P = max(16, _next_pow2(Dk)), max(16, _next_pow2(Dv))
    wide = max(DK_P, DV_P) > 64
    if fp32:  # IEEE dots without tensor cores: small tiles, no spills
        small = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4}
        tiles = {"fwd": small, "dkdv": small, "dq": small}
    else:  # one-parameter sweeps on an H100 (tools/bench_window.py --tiles, 2026-11-26), fwd+bwd ms:
        # D 128 (paper 16k): dk/dv at 4 warps 5.39 vs 6.88 at 8, dq at 4 warps 5.53, forward at 4
        # warps 7.91 (worse); then the forward at BLOCK_M 64 with 4 warps 3.95 vs 4.25 (fwd 1.26 vs
        # 1.49); D 64 (seed 2k x 32): dq BLOCK_N 32 2.23 vs 2.55, dk/dv at 4 warps 3.60 and BLOCK_N
        # 64 2.94 (worse); the forward's variants within the run-to-run noise
        tiles = {
            "fwd": {"BLOCK_M": 64 if wide else 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
            "dkdv": {"BLOCK_M": 64, "BLOCK_N": 64 if wide else 128, "num_warps": 4 if wide else 8, "num_stages": 2},
            "dq": {"BLOCK_M": 64 if wide else 128, "BLOCK_N": 64 if wide else 32, "num_warps": 4 if wide else 8,
                   "num_stages": 2},
        }
    tiles = {"DK_P": DK_P, "DV_P": DV_P, "delta": {"BLOCK_M": 64, "num_warps": 4}, **tiles}
    for kernel, params in (override or {}).items():
        if kernel not in ("fwd", "delta", "dkdv", "dq"):
            raise ValueError(f"window _tiles: unknown kernel {kernel!r} in override")
        tiles[kernel] = tiles[kernel] | params
    return tiles


@jit
def _query_tile(S, G, HPG: tl.constexpr, BLOCK_M: tl.constexpr):
    """The forward's and dq's program: BLOCK_M consecutive query rows r [BLOCK_M] (row_ok: r < S)
    of one head; also its tile index, batch b and head (int64), and KV head g."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // (G * HPG)).to(tl.int64)
    head = (bh % (G * HPG)).to(tl.int64)
    g = head // HPG
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < S
    return tile, b, head, g, r, row_ok


@jit
def _tokens(r, S, SK, Q_OFF, CHUNK: tl.constexpr):
    """The tokens t of query rows r and the number of keys: Q_OFF + r and SK for a chunk of
    queries, r and S for the whole sequence (CHUNK False: no offset in the code)."""
    if CHUNK:
        return Q_OFF + r, SK
    return r, S


@jit
def _key_range(tile, keys, Q_OFF, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """The keys [lo, hi) that query tile `tile` walks in tiles of BLOCK_N: from the first key any
    of its queries sees (t0 - W + 1 for its first token t0, rounded down to BLOCK_N) to its last
    query's token (at most `keys`)."""
    t0 = tile * BLOCK_M
    if CHUNK:
        t0 += Q_OFF
    lo = tl.maximum(t0 - W + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(t0 + BLOCK_M, keys)
    return lo, hi


@jit
def _interior(tile, keys, Q_OFF, W, lo, hi, doc_last, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CHUNK: tl.constexpr):
    """The key tiles [mid_lo, mid_hi) of [lo, hi) (`_key_range`'s, starts on the BLOCK_N grid) that
    every query row of the tile sees whole, so they need no mask: all their keys s < keys, s <= t
    for the tile's first token t0, t - s < W for its last (s >= t0 + BLOCK_M - W), and s >=
    doc_last (with pos the latest document start of the tile's rows, else 0). mid_lo <= mid_hi;
    both hi where no tile qualifies. The kernels walk [lo, mid_lo) and [mid_hi, hi) masked and
    the interior without a mask, in that order: the same tiles in the same order as one masked
    loop (a mask that keeps everything changes no score)."""
    t0 = tile * BLOCK_M
    if CHUNK:
        t0 += Q_OFF
    first = tl.maximum(tl.maximum(t0 + BLOCK_M - W, doc_last), 0)  # the first key every row sees
    mid_lo = tl.minimum(tl.maximum(lo, (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N), hi)
    mid_hi = tl.maximum(tl.minimum(t0 + 1, keys) // BLOCK_N * BLOCK_N, mid_lo)  # s + BLOCK_N <= t0 + 1, keys
    return mid_lo, mid_hi


@jit
def _document_keys(POS, b, t64, row_ok, S, lo, BLOCK_N: tl.constexpr):
    """Packed documents, for a query tile: each row's document start doc [BLOCK_M] int32 (its
    keys are s >= doc), the tile's first key tile `lo` raised past the keys no row's document
    holds (the earliest start, rounded down to BLOCK_N), and the latest start (keys from there on
    are in every row's document: `_interior`)."""
    doc = document_start(POS, b, t64, row_ok, S)
    first = reduce_min(tl.where(row_ok, doc, S), 0)
    last = reduce_max(tl.where(row_ok, doc, -1), 0)
    return doc, tl.maximum(lo, tl.maximum(first, 0) // BLOCK_N * BLOCK_N), last


@jit
def _document_query_tiles(POS, b, q_lo, n_tiles, s_last, S, BLOCK_M: tl.constexpr):
    """Packed documents, dk/dv: how many of the n_tiles query tiles from q_lo to walk, the last
    one the highest whose rows include one with its document starting at or before s_last (the
    key tile's last key); the tiles above it have no row that sees any of the keys. Scanned
    downwards from the window's end, one pos load a tile: near a document's end that skips the
    next document's queries (up to W of them), for any pos (starts need not grow with t)."""
    rows = tl.arange(0, BLOCK_M)
    n = n_tiles
    r = q_lo + (n - 1) * BLOCK_M + rows
    ok = (r >= q_lo) & (r < S)
    lowest = reduce_min(tl.where(ok, document_start(POS, b, r.to(tl.int64), ok, S), S), 0)
    while (n > 0) & (lowest > s_last):
        n -= 1
        r = q_lo + (n - 1) * BLOCK_M + rows
        ok = (r >= q_lo) & (r < S)
        lowest = reduce_min(tl.where(ok, document_start(POS, b, r.to(tl.int64), ok, S), S), 0)
    return n


@jit
def _fwd_tile(q, k_base, v_base, s, keys, t, doc, W, qk_scale, m_i, l_i, acc, sks, skd, svs, svd, dk, dv, dk_ok, dv_ok,
              VDT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
              HAS_POS: tl.constexpr):
    """One key tile (tokens s [BLOCK_N]) of the forward's online softmax: (m_i, l_i, acc) in,
    updated out. MASKED: each (row, key) pair tested (s < keys, s <= t, t - s < W, and s >= the
    row's document start with pos); without, the tile is one `_interior` says every row sees."""
    col_ok = s < keys
    s64 = s.to(tl.int64)
    k = load_tile(k_base, s64, dk, sks, skd, col_ok, dk_ok, UPCAST)  # [BLOCK_N, DK_P]
    v = load_tile(v_base, s64, dv, svs, svd, col_ok, dv_ok, UPCAST)  # [BLOCK_N, DV_P]
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if MASKED:
        valid = col_ok[None, :] & (s[None, :] <= t[:, None]) & (t[:, None] - s[None, :] < W)
        if HAS_POS:
            valid = valid & (s[None, :] >= doc[:, None])
        qk = tl.where(valid, qk, float("-inf"))
    m_new, alpha, p, l_i = softmax_update(m_i, l_i, qk, None)
    acc = softmax_accumulate(acc, alpha, p, v, VDT, PREC, UPCAST)
    return m_new, l_i, acc


@jit
def fwd_kernel(
    Q, K, V, O, LSE, POS,  # POS: [B, S] int64 positions in the documents (None without HAS_POS)
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sob, soh, sos, sod,
    S, SK, Q_OFF, G, W, qk_scale,  # S query rows, SK keys, row r at token Q_OFF + r; qk_scale = scale * log2(e)
    HPG: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    HAS_POS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    tile, b, head, g, r, row_ok = _query_tile(S, G, HPG, BLOCK_M)
    dk, dv, dk_ok, dv_ok = dim_ranges(DK, DV, DK_P, DV_P)
    r64 = r.to(tl.int64)
    t, keys = _tokens(r, S, SK, Q_OFF, CHUNK)  # the rows' tokens, the keys' count
    q = load_tile(Q + b * sqb + head * sqh, r64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [BLOCK_M, DK_P]
    k_base = K + b * skb + g * skg
    v_base = V + b * svb + g * svg
    cols = tl.arange(0, BLOCK_N)
    m_i, l_i, acc = softmax_state(BLOCK_M, DV_P)
    lo, hi = _key_range(tile, keys, Q_OFF, W, BLOCK_M, BLOCK_N, CHUNK)
    doc, doc_last = 0, 0  # without pos: no document start (unused)
    if HAS_POS:  # not with CHUNK: rows are tokens
        doc, lo, doc_last = _document_keys(POS, b, r64, row_ok, S, lo, BLOCK_N)
    mid_lo, mid_hi = _interior(tile, keys, Q_OFF, W, lo, hi, doc_last, BLOCK_M, BLOCK_N, CHUNK)
    for start in range(lo, mid_lo, BLOCK_N):  # the window's first key tiles, masked
        m_i, l_i, acc = _fwd_tile(q, k_base, v_base, start + cols, keys, t, doc, W, qk_scale, m_i, l_i, acc, sks, skd, svs, svd,
                          dk, dv, dk_ok, dv_ok, V.dtype.element_ty, PREC, UPCAST, True, HAS_POS)
    for start in range(mid_lo, mid_hi, BLOCK_N):  # the interior: every row sees every key (no mask)
        m_i, l_i, acc = _fwd_tile(q, k_base, v_base, start + cols, keys, t, doc, W, qk_scale, m_i, l_i, acc, sks, skd, svs, svd,
                          dk, dv, dk_ok, dv_ok, V.dtype.element_ty, PREC, UPCAST, False, HAS_POS)
    for start in range(mid_hi, hi, BLOCK_N):  # the diagonal's key tiles, masked
        m_i, l_i, acc = _fwd_tile(q, k_base, v_base, start + cols, keys, t, doc, W, qk_scale, m_i, l_i, acc, sks, skd, svs, svd,
                          dk, dv, dk_ok, dv_ok, V.dtype.element_ty, PREC, UPCAST, True, HAS_POS)
    # every query sees itself (with valid positions): only rows past S are empty; a row that
    # sees no key (pos[t] < 0) gets o 0 and lse -inf
    o, lse = softmax_finish(acc, m_i, l_i)
    store_tile(O + b * sob + head * soh, r64, dv, sos, sod, o, row_ok, dv_ok)
    tl.store(LSE + (b * G * HPG + head) * S + r64, lse, mask=row_ok)


@jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, POS,
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sdob, sdoh, sdos, sdod,
    sdkb, sdkg, sdks, sdkd, sdvb, sdvg, sdvs, sdvd,
    S, SK, Q_OFF, G, W, scale, qk_scale,
    HPG: tl.constexpr, DK_: tl.constexpr, DV_: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    HAS_POS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    ktile = tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)
    s = ktile * BLOCK_N + tl.arange(0, BLOCK_N)
    _, keys = _tokens(s, S, SK, Q_OFF, CHUNK)
    col_ok = s < keys
    s64 = s.to(tl.int64)
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    kmask = col_ok[:, None] & (dk < DK_)[None, :]
    vmask = col_ok[:, None] & (dv < DV_)[None, :]
    k = tl.load(K + b * skb + g * skg + s64[:, None] * sks + dk[None, :] * skd, mask=kmask, other=0.0)
    v = tl.load(V + b * svb + g * svg + s64[:, None] * svs + dv[None, :] * svd, mask=vmask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    acc_k = tl.full([BLOCK_N, DK_P], 0.0, tl.float32)
    acc_v = tl.full([BLOCK_N, DV_P], 0.0, tl.float32)
    # the queries that see these keys: t >= the first key, t - s < W for the last key; with CHUNK
    # as rows r = t - Q_OFF in [0, S) (none, n_tiles <= 0, for keys no row of the chunk reads)
    if CHUNK:
        q_lo = tl.maximum(ktile * BLOCK_N - Q_OFF, 0) // BLOCK_M * BLOCK_M
        q_hi = tl.minimum(ktile * BLOCK_N + BLOCK_N - 1 + W - Q_OFF, S)
    else:
        q_lo = ktile * BLOCK_N // BLOCK_M * BLOCK_M
        q_hi = tl.minimum(ktile * BLOCK_N + BLOCK_N - 1 + W, S)
    n_tiles = (q_hi - q_lo + BLOCK_M - 1) // BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    if HAS_POS:  # not past the last query tile with a row whose document holds one of these keys
        n_tiles = _document_query_tiles(POS, b, q_lo, n_tiles, tl.minimum(ktile * BLOCK_N + BLOCK_N, keys) - 1, S,
                                        BLOCK_M)
    for it in range(0, HPG * n_tiles):  # the group's heads in turn, each over its query tiles
        j = it // n_tiles
        head = g * HPG + j
        r = q_lo + (it - j * n_tiles) * BLOCK_M + rows
        row_ok = r < S
        r64 = r.to(tl.int64)
        t = _tokens(r, S, SK, Q_OFF, CHUNK)[0]  # the rows' tokens
        q = load_tile(Q + b * sqb + head * sqh, r64, dk, sqs, sqd, row_ok, dk < DK_, UPCAST)  # [BLOCK_M, DK_P]
        do = load_tile(DO + b * sdob + head * sdoh, r64, dv, sdos, sdod, row_ok, dv < DV_, UPCAST)  # [BLOCK_M, DV_P]
        lse2, delta = row_stats(LSE, DELTA, (b * G * HPG + head) * S + r64, row_ok)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
        valid = row_ok[None, :] & col_ok[:, None] & (s[:, None] <= t[None, :]) & (t[None, :] - s[:, None] < W)
        if HAS_POS:  # each query's own document: keys from its start on (rows are tokens)
            valid = valid & (s[:, None] >= document_start(POS, b, r64, row_ok, S)[None, :])
        p_t = tl.where(valid, tl.exp2(qk_t - lse2[None, :]), 0.0)
        pv = p_t.to(DO.dtype.element_ty)
        if UPCAST:
            pv = pv.to(tl.float32)
        acc_v += tl.dot(pv, do, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
        ds_t = (p_t * (dp_t - delta[None, :])).to(Q.dtype.element_ty)
        if UPCAST:
            ds_t = ds_t.to(tl.float32)
        acc_k += tl.dot(ds_t, q, input_precision=PREC)
    acc_k = acc_k * scale
    tl.store(DK + b * sdkb + g * sdkg + s64[:, None] * sdks + dk[None, :] * sdkd, acc_k.to(DK.dtype.element_ty),
             mask=kmask)
    tl.store(DV + b * sdvb + g * sdvg + s64[:, None] * sdvs + dv[None, :] * sdvd, acc_v.to(DV.dtype.element_ty),
             mask=vmask)


@jit
def _dq_tile(q, do, k_base, v_base, s, keys, t, row_ok, doc, W, qk_scale, lse2, delta, acc, sks, skd, svs, svd, dk, dv,
             dk_ok, dv_ok, KDT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
             HAS_POS: tl.constexpr):
    """One key tile (tokens s [BLOCK_N]) of dq: acc [BLOCK_M, DK_P] += ds @ k, p recomputed from
    the saved lse; MASKED as `_fwd_tile` (the interior needs no mask: rows past S are never stored)."""
    col_ok = s < keys
    s64 = s.to(tl.int64)
    k = load_tile(k_base, s64, dk, sks, skd, col_ok, dk_ok, UPCAST)
    v = load_tile(v_base, s64, dv, svs, svd, col_ok, dv_ok, UPCAST)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if MASKED:
        valid = row_ok[:, None] & col_ok[None, :] & (s[None, :] <= t[:, None]) & (t[:, None] - s[None, :] < W)
        if HAS_POS:
            valid = valid & (s[None, :] >= doc[:, None])
        p = tl.where(valid, tl.exp2(qk - lse2[:, None]), 0.0)
    else:
        p = tl.exp2(qk - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = (p * (dp - delta[:, None])).to(KDT)
    if UPCAST:
        ds = ds.to(tl.float32)
    return acc + tl.dot(ds, k, input_precision=PREC)


@jit
def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, POS,
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sdob, sdoh, sdos, sdod,
    sdqb, sdqh, sdqs, sdqd,
    S, SK, Q_OFF, G, W, scale, qk_scale,
    HPG: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    HAS_POS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    tile, b, head, g, r, row_ok = _query_tile(S, G, HPG, BLOCK_M)
    r64 = r.to(tl.int64)
    t, keys = _tokens(r, S, SK, Q_OFF, CHUNK)  # the rows' tokens, the keys' count
    dk, dv, dk_ok, dv_ok = dim_ranges(DK, DV, DK_P, DV_P)
    q = load_tile(Q + b * sqb + head * sqh, r64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)
    do = load_tile(DO + b * sdob + head * sdoh, r64, dv, sdos, sdod, row_ok, dv_ok, UPCAST)
    lse2, delta = row_stats(LSE, DELTA, (b * G * HPG + head) * S + r64, row_ok)
    k_base = K + b * skb + g * skg
    v_base = V + b * svb + g * svg
    cols = tl.arange(0, BLOCK_N)
    acc = tl.full([BLOCK_M, DK_P], 0.0, tl.float32)
    lo, hi = _key_range(tile, keys, Q_OFF, W, BLOCK_M, BLOCK_N, CHUNK)
    doc, doc_last = 0, 0  # without pos: no document start (unused)
    if HAS_POS:  # not with CHUNK: rows are tokens
        doc, lo, doc_last = _document_keys(POS, b, r64, row_ok, S, lo, BLOCK_N)
    mid_lo, mid_hi = _interior(tile, keys, Q_OFF, W, lo, hi, doc_last, BLOCK_M, BLOCK_N, CHUNK)
    for start in range(lo, mid_lo, BLOCK_N):  # masked, as the forward's
        acc = _dq_tile(q, do, k_base, v_base, start + cols, keys, t, row_ok, doc, W, qk_scale, lse2, delta, acc,
                       sks, skd, svs, svd, dk, dv, dk_ok, dv_ok, K.dtype.element_ty, PREC, UPCAST, True, HAS_POS)
    for start in range(mid_lo, mid_hi, BLOCK_N):  # the interior, no mask
        acc = _dq_tile(q, do, k_base, v_base, start + cols, keys, t, row_ok, doc, W, qk_scale, lse2, delta, acc,
                       sks, skd, svs, svd, dk, dv, dk_ok, dv_ok, K.dtype.element_ty, PREC, UPCAST, False, HAS_POS)
    for start in range(mid_hi, hi, BLOCK_N):
        acc = _dq_tile(q, do, k_base, v_base, start + cols, keys, t, row_ok, doc, W, qk_scale, lse2, delta, acc,
                       sks, skd, svs, svd, dk, dv, dk_ok, dv_ok, K.dtype.element_ty, PREC, UPCAST, True, HAS_POS)
    tl.store(DQ + b * sdqb + head * sdqh + r64[:, None] * sdqs + dk[None, :] * sdqd,
             (acc * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & dk_ok[None, :])


def _require(q, k, v, pos) -> None:
    why = unsupported_reason(q, k, v, pos)
    if why is not None:
        raise ValueError(f"window_attention (triton): cannot run these inputs: {why}")


def _launch_config(q, k, v, tiles, pos, q_offset: int = 0):
    """`_tiles` for these inputs, the constexprs every kernel but delta takes, and the kernels'
    POS argument: pos made contiguous (a [B, S] view with other strides is copied), None without
    packed documents (a None argument is a constexpr: the kernels compile as they did before pos).
    CHUNK: a chunk of queries (K/V of other than q's S tokens, or an offset)."""
    T = _tiles(q.shape[3], v.shape[3], q.dtype == torch.float32, tiles)
    consts = {"HPG": q.shape[1] // k.shape[1], "DK_P": T["DK_P"], "DV_P": T["DV_P"], "PREC": _dot_precision(q.dtype),
              "HAS_POS": pos is not None, "CHUNK": q_offset != 0 or k.shape[2] != q.shape[2]}
    return T, consts, None if pos is None else pos.contiguous()


def window_forward(q, k, v, window: int, scale: float, pos=None, q_offset: int = 0, *, tiles: dict | None = None):
    """o [B, H, S, Dv] (v's dtype, [B, S, H, Dv] memory) and lse [B, H, S] float32 (natural log).
    pos: [B, S] int64 positions in the documents (packed documents), or None. q_offset: a chunk
    of queries, row r is token q_offset + r of k and v's SK >= q_offset + S tokens (the op checks
    it). `tiles`: an override of `_tiles` (tools/bench_window.py); None, the defaults."""
    _require(q, k, v, pos)
    B, H, S, Dk = q.shape
    SK = k.shape[2]
    o, lse = empty_attention_outputs(q, v)
    if B * H * S == 0:
        return o, lse
    T, consts, pos = _launch_config(q, k, v, tiles, pos, q_offset)
    cfg = T["fwd"]
    fwd_kernel[(_cdiv(S, cfg["BLOCK_M"]), B * H)](
        q, k, v, o, lse, pos, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        S, SK, q_offset, k.shape[1], min(window, SK), scale * math.log2(math.e),  # a window past SK is SK: int32-safe
        DK=Dk, DV=v.shape[3], UPCAST=upcast_dots(q.dtype), **consts, **cfg,
    )  # fmt: skip
    return o, lse


def window_backward(grad_o, q, k, v, o, lse, window: int, scale: float, pos=None, q_offset: int = 0, *,
                    tiles: dict | None = None):
    """dq (like q), dk (like k), dv (like v), each in [B, S, heads, D] memory; dk and dv summed
    over the group's heads in fp32 inside the dk/dv kernel (0 at keys no row reads). pos and
    q_offset as for `window_forward`."""
    _require(q, k, v, pos)
    B, H, S, Dk = q.shape
    G, SK, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq, dk, dv = empty_attention_grads(q, k, v)
    if B * H * S == 0:  # no row: no key is read (a chunk of no rows still has K/V of SK tokens)
        return dq, dk.zero_(), dv.zero_()
    if grad_o.dtype != v.dtype:
        grad_o = grad_o.to(v.dtype)
    lse = lse.contiguous()
    T, consts, pos = _launch_config(q, k, v, tiles, pos, q_offset)
    W = min(window, SK)  # a window past SK is SK: int32-safe bounds in the kernels
    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    bm = T["delta"]["BLOCK_M"]
    delta_kernel[(_cdiv(S, bm), B * H)](
        grad_o, o, delta, *grad_o.stride(), *o.stride(), S, H, DV=Dv, DV_P=T["DV_P"], **T["delta"],
    )  # fmt: skip
    upcast = upcast_dots(q.dtype)
    qk_scale = scale * math.log2(math.e)
    cfg = T["dkdv"]
    dkdv_kernel[(_cdiv(SK, cfg["BLOCK_N"]), B * G)](
        q, k, v, grad_o, lse, delta, dk, dv, pos,
        *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *dk.stride(), *dv.stride(),
        S, SK, q_offset, G, W, scale, qk_scale, DK_=Dk, DV_=Dv, UPCAST=upcast, **consts, **cfg,
    )  # fmt: skip
    cfg = T["dq"]
    dq_kernel[(_cdiv(S, cfg["BLOCK_M"]), B * H)](
        q, k, v, grad_o, lse, delta, dq, pos,
        *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *dq.stride(),
        S, SK, q_offset, G, W, scale, qk_scale, DK=Dk, DV=Dv, UPCAST=upcast, **consts, **cfg,
    )  # fmt: skip
    return dq, dk, dv
