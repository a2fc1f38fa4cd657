"""Triton kernels for `nsa::projection_rope`: the projections of one input as one GEMM with RoPE
in its epilogue, and the backward's inverse rotation.

    outs = projection_rope_forward(x2, weight, bias, cos, sin, widths, head_dims, style, S, plain=plain)
    dy = projection_rope_grad(grads, cos, sin, widths, head_dims, style, S, plain=plain)
    why = unsupported_reason(x, weight, bias, cos, sin, widths, head_dims, plain)   # None when they can run

Same semantics as the `reference` backend of nsa_compile/ops/rope.py: x2 [M, K] (M = B * S rows,
row m is token m % S of batch m // S), weight [N, K] (the pieces' weights one after another,
N = sum(widths)), bias [N] or None; piece i is x2 @ weight[rows of i]^T + bias, [M, widths[i]],
and when head_dims[i] = D > 0 each head of D columns has its first R = 2 * cos.shape[-1] columns
rotated by the angle of the row's position (pairs (j, j + R/2) for style 'half', (2j, 2j + 1) for
'interleaved'; the remaining D - R columns pass through). cos, sin: [Bt, S, R/2] with Bt 1 or B;
with full_tables [Bt, S, R], one entry per column (FULL: the partner b of a pair reads its own
entries, from views of the same tables, out_b = b*cos_b + a*sin_b; two more loads per pair).

Forward kernel, a 1-D grid over (row tile, column tile), the column tile fastest (the programs
of one row tile run together and share its x rows in L2; the weights, a few MB, stay in L2).
Column tiles never straddle pieces; a host-built table (`_tile_table`, cached per layout) gives
each its piece, first column, weight row offset, rotated flag and the piece's width. A rotated
tile covers HT whole heads and holds two accumulators, fed by the same x tile:
    acc   [BM, 2 NA]  the first column of every rotation pair (NA = HT * R/2), then the partner
                      column of each pair: one dot per K step over both (the weight rows of a
                      and b stacked), split into acc_a and acc_b [BM, NA] after the K loop,
    acc_p [BM, NP]    the pass-through columns (NP = HT * (D - R); none when R = D),
so the rotation is elementwise on registers: out_a = a*cos - b*sin, out_b = b*cos + a*sin, in
fp32 on the fp32 accumulators (one rounding, where the eager code rounds the projection and
then each product). The weight rows of a pair are gathered by index (each row is contiguous
along K, so the loads stay vectorized). A raw (unrotated) tile uses the same accumulators as
three windows of consecutive columns (NA, NA, NP wide). Interleaved pairs that fill whole heads
in ALIGNED tiles (JOINED, `_joined_pairs`) take every tile's 2 NA consecutive weight rows in
order instead, split into the even (a) and odd (b) columns in registers and joined back for one
vectorized store (raw tiles alike); the backward loads and stores its tiles the same way. Bias
is added before the rotation.
Each piece is its own output tensor (a custom op's outputs may not alias each other): the
kernel takes up to MAX_PIECES output pointers and picks its tile's with a scalar branch.
Plain outputs (`plain`: rotated pieces also returned before their rotation, after the pieces)
take output pointers too: a rotated tile whose piece has one (the tile table's flag 2 + its
output index; HAS_PLAIN) also stores its accumulators, bias added, before the rotation; the
backward adds that output's gradient to the inverse rotation. Without plain outputs the kernels
are compiled as before (HAS_PLAIN off).
Loads in the K loop are unmasked: rows past M and padded columns read row 0 (their results
are never stored); K is masked only when BK does not divide it. When every tile is full and
every width a multiple of 16 (`_aligned`: the seed model, where HT = 2 heads of 64 tile the 768
q columns and the 128-column k/v pieces exactly), the kernels drop the column masks and hint
16-alignment, so the stores are 16-byte vectors, and read each table once per row ([BM, R/2],
repeated over the tile's heads). Compiled for sm_90 without a GPU (Triton 3.6, ptxas): the seed
layout at BM 128 with 8 warps uses 128 registers, no spills, 96 KB of shared memory (3 stages);
the default is now 4 warps, the fastest of the tile sweep (`_config`), its registers not read.

Where the forward's time goes (ncu on an H100, seed layout, M 65536, 2026-11-26): 327 us against
cuBLAS's 220 us for the same concatenated GEMM without RoPE. Both move about 7.3 TB/s from L2 into
the SMs; this kernel's 128 x 128 tiles at K = 768 read 1.5x the bytes per output of cuBLAS's
192 x 192 tiles (which also pair CTAs in clusters), and larger tiles here spilled or lost occupancy
in the sweep. Reaching cuBLAS needs bigger tiles fed by TMA with warp specialization.

Backward kernel: the gradient of the projection before the rotation, dy [M, N], from the
pieces' gradients in one elementwise pass over the same tiles: for a pair,
dy_a = g_a*cos + g_b*sin, dy_b = g_b*cos - g_a*sin (the inverse rotation; with full tables the
transposed map, dy_a = g_a*cos + g_b*sin_b, dy_b = g_b*cos_b - g_a*sin); the rest is copied.
dx = dy @ W and dW = dy^T @ x are left to cuBLAS (the op's autograd formula).

Supported (`unsupported_reason` says why not): CUDA tensors (or any device with
TRITON_INTERPRET=1); x, weight, bias all fp16, bf16 or fp32 (fp32 uses IEEE dots: correct, not
fast; `auto` gives fp32 to the reference backend); tables of any float dtype; at most
MAX_PIECES outputs (pieces and plain outputs); one head dim D <= 256 for all rotated pieces.

The two kernels share their tile's geometry (`_column_tile`, `_pair_columns`, `_pass_columns`),
the table loads (`_rotation`) and the pick of the piece's tensor (`_piece_pointer`).

CPU interpreter: the kernels are module-level `triton_support.jit` functions, as in
selection_triton.py (built for the mode Triton is in when launched), and bf16 tl.dot operands
are cast to fp32 there (the interpreter multiplies bf16 bits as integers).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; unsupported_reason says why the kernels cannot run
    triton = tl = None

from .triton_support import cdiv as _cdiv, device_reason, jit, made_aside, next_pow2 as _next_pow2, upcast_dots

__all__ = ["MAX_PIECES", "projection_rope_forward", "projection_rope_grad", "tiles_aligned", "unsupported_reason"]

MAX_PIECES = 8
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A tile of raw columns when no piece is rotated: two windows of RAW_WINDOW columns.
RAW_WINDOW = 64


def unsupported_reason(x, weight, bias, cos, sin, widths, head_dims, plain=()) -> str | None:
    """Why the Triton kernels cannot run these inputs, or None when they can."""
    if why := device_reason(x, weight, bias, cos, sin):
        return why
    dtypes = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1 or x.dtype not in _DTYPES:
        return f"dtypes {sorted(map(str, dtypes))} (x, weight and bias must share one of fp16, bf16, fp32)"
    if len(widths) + len(plain) > MAX_PIECES:
        also = f" and {len(plain)} plain outputs" if plain else ""
        return f"{len(widths)} pieces{also} (the kernel writes at most {MAX_PIECES} outputs)"
    dims = {d for d in head_dims if d}
    if len(dims) > 1:
        return f"rotated pieces with different head dims {sorted(dims)} (the kernel takes one)"
    if dims and dims.pop() > MAX_HEAD_DIM:
        return f"head dim over {MAX_HEAD_DIM}"
    return None


def _layout(widths, head_dims, rot_half: int, heads_per_tile: int | None = None) -> dict:
    """Column geometry of a tile: D, R2 = R/2, HT heads per rotated tile, NA pairs and NP pass
    columns per tile (JA, JP: their power-of-two register widths, at least 16 for tl.dot), the
    tile width TW, and ALIGNED (`_aligned`). HT: `heads_per_tile` if given, else the largest
    tile of at most 128 columns that is ALIGNED, else 128 // D heads."""
    D = max(head_dims)
    if D == 0:  # no rotation: raw tiles of two windows
        lay = {"D": 1, "R2": 1, "HT": 1, "NA": RAW_WINDOW, "NP": 0, "JA": RAW_WINDOW, "JP": 0, "TW": 2 * RAW_WINDOW}
        return lay | {"ALIGNED": _aligned(widths, lay)}
    R2 = rot_half
    widest = max(1, 128 // D)
    for HT in [heads_per_tile] if heads_per_tile else [*range(widest, 0, -1), widest]:
        NA, NP = HT * R2, HT * (D - 2 * R2)
        lay = {"D": D, "R2": R2, "HT": HT, "NA": NA, "NP": NP, "JA": max(16, _next_pow2(NA)),
               "JP": max(16, _next_pow2(NP)) if NP else 0, "TW": HT * D}
        lay["ALIGNED"] = _aligned(widths, lay)
        if lay["ALIGNED"]:
            break
    return lay


def _aligned(widths, lay: dict) -> bool:
    """Whether every tile is full and unpadded and every piece's width a multiple of 16: then the
    kernels drop column masks and hint 16-alignment, so column accesses are vectorized."""
    return (lay["NA"] == lay["JA"] and lay["NP"] == lay["JP"] and lay["TW"] % 16 == 0
            and all(w % lay["TW"] == 0 for w in widths))


def tiles_aligned(widths, head_dims, rot_half: int) -> bool:
    """Whether the kernels run these pieces in ALIGNED tiles (`_aligned`: no column masks,
    vectorized column accesses). One piece whose width fits no tile, e.g. a gate Linear of 36
    columns beside q, k and v, unaligns every tile of the op: the projection_rope pass leaves such a
    Linear to its own GEMM (lucidrains_shared_kv's forward took 2.45 ms with it merged, against
    0.33 ms for the reference model's q, k, v: H200, tools/profile_step.py, 2026-11-27)."""
    return _layout(list(widths), list(head_dims), rot_half)["ALIGNED"]


@functools.lru_cache(maxsize=256)
def _tile_table(widths: tuple, head_dims: tuple, tile_width: int, plain: tuple = ()) -> tuple[tuple[int, ...], int]:
    """Per column tile (flattened, 5 ints each): piece, first column in the piece, the piece's
    first weight row, its flag (0 raw, 1 rotated, 2 + k rotated and also stored before the
    rotation into output k: a plain output), the piece's width. Tiles of a piece are tile_width
    wide (a rotated piece's tiles start at head boundaries: tile_width is a whole number of heads)."""
    table, row0 = [], 0
    for piece, (width, dim) in enumerate(zip(widths, head_dims)):
        flag = 2 + len(widths) + plain.index(piece) if piece in plain else 1 if dim else 0
        for c0 in range(0, width, tile_width):
            table += [piece, c0, row0, flag, width]
        row0 += width
    return tuple(table), len(table) // 5


_device_tables: dict = {}


def _tiles_on(device, widths, head_dims, tile_width, plain=()) -> tuple[torch.Tensor, int]:
    """The tile table as an int32 tensor on `device`, made once per layout and device (no host
    to device copy, and no synchronization, on later calls)."""
    key = (str(device), tuple(widths), tuple(head_dims), tile_width, tuple(plain))
    if key not in _device_tables:
        flat, count = _tile_table(tuple(widths), tuple(head_dims), tile_width, tuple(plain))
        _device_tables[key] = (made_aside(lambda: torch.tensor(flat, dtype=torch.int32, device=device), device), count)
    return _device_tables[key]


def _config(dtype: torch.dtype, override: dict | None) -> dict:
    """Launch parameters of the forward (`fwd`) and backward (`bwd`) kernels. `override`
    ({"fwd": {...}, "bwd": {...}}; HT, BM, BK, num_warps, num_stages) replaces single entries,
    for tools/bench_projections.py. BM and BK must be powers of two >= 16."""
    if dtype == torch.float32:
        cfg = {"fwd": {"BM": 64, "BK": 32, "num_warps": 4, "num_stages": 2}, "bwd": {"BM": 32, "num_warps": 4}}
    else:
        # 4 warps: the best of 72 tile configs on an H100 (tools/bench_projections.py --sweep, seed,
        # M 65536, 2026-11-26): 0.424 ms against 0.445 with 8 (bitwise the same pieces)
        cfg = {"fwd": {"BM": 128, "BK": 64, "num_warps": 4, "num_stages": 3}, "bwd": {"BM": 32, "num_warps": 4}}
    for kernel, params in (override or {}).items():
        if kernel not in cfg:
            raise ValueError(f"projection_rope (triton): unknown kernel {kernel!r} in override; valid: fwd, bwd")
        cfg[kernel] = cfg[kernel] | params
    return cfg


@jit
def _column_tile(TILES, NT, ALIGNED: tl.constexpr):
    """The program's row tile mt and its column tile's entry of the tile table (`_tile_table`):
    piece, first column c0, first weight row row0, rotated flag, the piece's width (ALIGNED:
    host-checked multiples of 16). Programs run column tile fastest."""
    pid = tl.program_id(0)
    mt = pid // NT
    tile = TILES + (pid - mt * NT) * 5
    piece = tl.load(tile)
    c0 = tl.load(tile + 1)
    row0 = tl.load(tile + 2)
    rot_flag = tl.load(tile + 3)
    width = tl.load(tile + 4)
    if ALIGNED:  # host-checked: every tile full, widths and tile starts multiples of 16
        c0 = tl.multiple_of(c0, 16)
        row0 = tl.multiple_of(row0, 16)
        width = tl.multiple_of(width, 16)
    return mt, piece, c0, row0, rot_flag, width


@jit
def _pair_columns(c0, rot_flag, width, D: tl.constexpr, R2: tl.constexpr, NA: tl.constexpr, JA: tl.constexpr,
                  HALF: tl.constexpr, HAS_TABLE: tl.constexpr, ALIGNED: tl.constexpr, JOINED: tl.constexpr):  # fmt: skip
    """The tile's columns relative to the piece, [JA] each: pair firsts ca and partners cb (a raw
    tile: two windows of NA consecutive columns; JOINED: every tile's columns 2j and 2j + 1), their
    masks ok_a, ok_b, the rotated flag as a vector rot (the interpreter rejects scalar bools in
    masks) and each pair's frequency index f."""
    ja = tl.arange(0, JA)
    rot = (ja * 0 + rot_flag) != 0
    if JOINED:  # interleaved pairs filling whole heads, raw tiles read the same way
        f = ja % R2
        ca = c0 + 2 * ja
        cb = ca + 1
    elif HAS_TABLE:
        head = ja // R2
        f = ja % R2  # frequency index of the pair
        if HALF:
            ca_rot = head * D + f
            cb_rot = ca_rot + R2
        else:
            ca_rot = head * D + 2 * f
            cb_rot = ca_rot + 1
        ca = c0 + tl.where(rot, ca_rot, ja)
        cb = c0 + tl.where(rot, cb_rot, NA + ja)
    else:
        f = ja  # no table: unused
        ca = c0 + ja
        cb = c0 + NA + ja
    if ALIGNED:  # no column masks: stores and loads of consecutive columns are vectorized
        ok_a = ja < JA
        ok_b = ok_a
    else:
        ok_a = (ja < NA) & (ca < width)
        ok_b = (ja < NA) & (cb < width)
    return ja, rot, f, ca, cb, ok_a, ok_b


@jit
def _pass_columns(c0, rot_flag, width, D: tl.constexpr, R2: tl.constexpr, NA: tl.constexpr, NP: tl.constexpr,
                  JP: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """The tile's pass-through columns cp [JP] relative to the piece and their mask ok_p: for a
    rotated tile, head jp // P's column R + jp % P (P = D - R); for a raw one, the third window."""
    jp = tl.arange(0, JP)
    cp_rot = (jp // (D - 2 * R2)) * D + 2 * R2 + jp % (D - 2 * R2)
    cp = c0 + tl.where((jp * 0 + rot_flag) != 0, cp_rot, 2 * NA + jp)
    ok_p = jp < JP if ALIGNED else (jp < NP) & (cp < width)
    return cp, ok_p


@jit
def _piece_pointer(piece, P0, P1, P2, P3, P4, P5, P6, P7, NOUT: tl.constexpr):
    """P<piece> of the NOUT pieces' tensors (separate tensors: a custom op's outputs may not
    alias), picked with scalar branches."""
    ptr = P0
    if NOUT > 1:
        if piece == 1:
            ptr = P1
    if NOUT > 2:
        if piece == 2:
            ptr = P2
    if NOUT > 3:
        if piece == 3:
            ptr = P3
    if NOUT > 4:
        if piece == 4:
            ptr = P4
    if NOUT > 5:
        if piece == 5:
            ptr = P5
    if NOUT > 6:
        if piece == 6:
            ptr = P6
    if NOUT > 7:
        if piece == 7:
            ptr = P7
    return ptr


@jit
def _rotation(COS, SIN, COS_B, SIN_B, rows_c, rot, f, S, scb, scs, scf, BM: tl.constexpr, HT: tl.constexpr,
              R2: tl.constexpr, JA: tl.constexpr, ALIGNED: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """cos and sin [BM, JA] in fp32 of each row's position (batch m // S, token m % S; rows_c:
    rows clamped into [0, M)) for each pair of the tile, and the partners' own entries c_b, s_b
    (FULL tables; else c, s again). A raw tile rotates by nothing: cos 1, sin 0."""
    bidx = rows_c // S
    t_off = bidx * scb + (rows_c - bidx * S) * scs  # int32: a table is small (batch stride 0 for one batch)
    # f < R/2 and rows clamped: every table address is valid (no column mask)
    if ALIGNED:  # one [BM, R/2] load per table, repeated over the tile's HT heads
        fr = tl.arange(0, R2)
        t_ptr = t_off[:, None] + fr[None, :] * scf
        c = tl.reshape(tl.broadcast_to(tl.load(COS + t_ptr)[:, None, :], [BM, HT, R2]), [BM, JA])
        s = tl.reshape(tl.broadcast_to(tl.load(SIN + t_ptr)[:, None, :], [BM, HT, R2]), [BM, JA])
        if FULL:  # the partners' own entries of full-width tables
            c_b = tl.reshape(tl.broadcast_to(tl.load(COS_B + t_ptr)[:, None, :], [BM, HT, R2]), [BM, JA])
            s_b = tl.reshape(tl.broadcast_to(tl.load(SIN_B + t_ptr)[:, None, :], [BM, HT, R2]), [BM, JA])
    else:
        t_ptr = t_off[:, None] + f[None, :] * scf
        c = tl.load(COS + t_ptr)
        s = tl.load(SIN + t_ptr)
        if FULL:
            c_b = tl.load(COS_B + t_ptr)
            s_b = tl.load(SIN_B + t_ptr)
    c = tl.where(rot[None, :], c.to(tl.float32), 1.0)
    s = tl.where(rot[None, :], s.to(tl.float32), 0.0)
    if FULL:
        c_b = tl.where(rot[None, :], c_b.to(tl.float32), 1.0)
        s_b = tl.where(rot[None, :], s_b.to(tl.float32), 0.0)
    else:
        c_b = c
        s_b = s
    return c, s, c_b, s_b


@jit
def _joined(a, b, BM: tl.constexpr, JA: tl.constexpr):
    """[BM, 2 JA] with a's column j at 2j and b's at 2j + 1 (interleaved pairs, in registers)."""
    return tl.reshape(tl.join(a, b), [BM, 2 * JA])


@jit
def _split_pairs(x, BM: tl.constexpr, JA: tl.constexpr):
    """The even and odd columns of x [BM, 2 JA], in fp32 (_joined's inverse)."""
    return tl.split(tl.reshape(x.to(tl.float32), [BM, JA, 2]))


@jit
def fwd_kernel(
    X, W, BIAS, COS, SIN, COS_B, SIN_B, TILES, O0, O1, O2, O3, O4, O5, O6, O7,
    M, K, S, NT, sxm, sxk, swn, swk, scb, scs, scf,
    D: tl.constexpr, R2: tl.constexpr, HT: tl.constexpr, NA: tl.constexpr, NP: tl.constexpr,
    JA: tl.constexpr, JP: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_TABLE: tl.constexpr, FULL: tl.constexpr, NOUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, WIDE: tl.constexpr, ALIGNED: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    HAS_PLAIN: tl.constexpr, JOINED: tl.constexpr,
):  # fmt: skip
    mt, piece, c0, row0, rot_flag, width = _column_tile(TILES, NT, ALIGNED)

    rows = mt * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)  # rows past M read row 0, never stored

    # columns of the tile, relative to the piece: pair firsts (a), partners (b), pass-through (p)
    ja, rot, f, ca, cb, ok_a, ok_b = _pair_columns(c0, rot_flag, width, D, R2, NA, JA, HALF, HAS_TABLE, ALIGNED,
                                                   JOINED)
    kk = tl.arange(0, BK)
    # pointers advanced by BK each step (the Triton tutorial's form: no per-step broadcasts)
    x_ptrs = X + rows64[:, None] * sxm + kk[None, :] * sxk  # [BM, BK]
    # the a and b weight rows stacked, [a_0 .. a_{JA-1}, b_0 .. b_{JA-1}]: one dot of 2 JA
    # columns per step instead of two of JA (wider MMAs, x read once from shared memory)
    if JOINED:  # the tile's 2 JA consecutive columns, pairs side by side: [a_0, b_0, a_1, b_1, ..]
        c_ab = c0 + tl.arange(0, 2 * JA)
    else:
        c_ab = tl.reshape(tl.permute(tl.join(tl.where(ok_a, ca, 0), tl.where(ok_b, cb, 0)), (1, 0)), [2 * JA])
    w_ptrs = W + (row0 + c_ab)[:, None] * swn + kk[None, :] * swk  # [2 JA, BK]
    acc = tl.full([BM, 2 * JA], 0.0, tl.float32)
    if NP > 0:
        cp, ok_p = _pass_columns(c0, rot_flag, width, D, R2, NA, NP, JP, ALIGNED)
        wp_ptrs = W + (row0 + tl.where(ok_p, cp, 0))[:, None] * swn + kk[None, :] * swk
        acc_p = tl.full([BM, JP], 0.0, tl.float32)

    for k0 in range(0, K, BK):
        if EVEN_K:
            xt = tl.load(x_ptrs)
            wt = tl.load(w_ptrs)
        else:
            k_ok = (k0 + kk < K)[None, :]
            xt = tl.load(x_ptrs, mask=k_ok, other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok, other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
        if NP > 0:
            if EVEN_K:
                wp = tl.load(wp_ptrs)
            else:
                wp = tl.load(wp_ptrs, mask=(k0 + kk < K)[None, :], other=0.0)
            if UPCAST:
                wp = wp.to(tl.float32)
            acc_p = tl.dot(xt, tl.trans(wp), acc_p, input_precision=PREC)
            wp_ptrs += BK * swk
        x_ptrs += BK * sxk
        w_ptrs += BK * swk
    if JOINED:  # [BM, JA, 2] -> two [BM, JA]
        acc_a, acc_b = tl.split(tl.reshape(acc, [BM, JA, 2]))
    else:  # back to the a and b halves: [BM, 2, JA] -> [BM, JA, 2] -> two [BM, JA]
        acc_a, acc_b = tl.split(tl.permute(tl.reshape(acc, [BM, 2, JA]), (0, 2, 1)))

    if HAS_BIAS:
        acc_a += tl.load(BIAS + row0 + ca, mask=ok_a, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(BIAS + row0 + cb, mask=ok_b, other=0.0).to(tl.float32)[None, :]
        if NP > 0:
            acc_p += tl.load(BIAS + row0 + cp, mask=ok_p, other=0.0).to(tl.float32)[None, :]
    if HAS_TABLE:
        c, s, c_b, s_b = _rotation(COS, SIN, COS_B, SIN_B, tl.where(row_ok, rows, 0), rot, f, S, scb, scs, scf, BM, HT,
                                   R2, JA, ALIGNED, FULL)
        out_a = acc_a * c - acc_b * s
        out_b = acc_b * c_b + acc_a * s_b
    else:
        out_a = acc_a
        out_b = acc_b

    out = _piece_pointer(piece, O0, O1, O2, O3, O4, O5, O6, O7, NOUT)  # the tile's output tensor
    # int32 offsets unless a piece passes 2^31 elements (fewer registers in the epilogue)
    if WIDE:
        o_row = rows64[:, None] * width
    else:
        o_row = tl.where(row_ok, rows, 0)[:, None] * width
    if JOINED:  # one store of the tile's consecutive columns c_ab (vectorized), the pairs joined in registers
        tl.store(out + o_row + c_ab[None, :], _joined(out_a, out_b, BM, JA).to(O0.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        tl.store(out + o_row + ca[None, :], out_a.to(O0.dtype.element_ty), mask=row_ok[:, None] & ok_a[None, :])
        tl.store(out + o_row + cb[None, :], out_b.to(O0.dtype.element_ty), mask=row_ok[:, None] & ok_b[None, :])
    if NP > 0:
        tl.store(out + o_row + cp[None, :], acc_p.to(O0.dtype.element_ty), mask=row_ok[:, None] & ok_p[None, :])
    if HAS_PLAIN:
        if rot_flag >= 2:  # the piece before its rotation, into its plain output (same columns)
            plain = _piece_pointer(rot_flag - 2, O0, O1, O2, O3, O4, O5, O6, O7, NOUT)
            if JOINED:
                tl.store(plain + o_row + c_ab[None, :], _joined(acc_a, acc_b, BM, JA).to(O0.dtype.element_ty),
                         mask=row_ok[:, None])
            else:
                tl.store(plain + o_row + ca[None, :], acc_a.to(O0.dtype.element_ty),
                         mask=row_ok[:, None] & ok_a[None, :])
                tl.store(plain + o_row + cb[None, :], acc_b.to(O0.dtype.element_ty),
                         mask=row_ok[:, None] & ok_b[None, :])
            if NP > 0:
                tl.store(plain + o_row + cp[None, :], acc_p.to(O0.dtype.element_ty),
                         mask=row_ok[:, None] & ok_p[None, :])


@jit
def grad_kernel(
    G0, G1, G2, G3, G4, G5, G6, G7, DY, COS, SIN, COS_B, SIN_B, TILES,
    M, N, S, NT, scb, scs, scf,
    D: tl.constexpr, R2: tl.constexpr, HT: tl.constexpr, NA: tl.constexpr, NP: tl.constexpr,
    JA: tl.constexpr, JP: tl.constexpr, HALF: tl.constexpr, HAS_TABLE: tl.constexpr, FULL: tl.constexpr,
    NOUT: tl.constexpr, BM: tl.constexpr, WIDE: tl.constexpr, ALIGNED: tl.constexpr, HAS_PLAIN: tl.constexpr,
    JOINED: tl.constexpr,
):  # fmt: skip
    mt, piece, c0, row0, rot_flag, width = _column_tile(TILES, NT, ALIGNED)
    rows = mt * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows_c = tl.where(row_ok, rows, 0)
    # int32 offsets unless a tensor passes 2^31 elements (fewer registers)
    rows_w = rows_c.to(tl.int64) if WIDE else rows_c

    ja, rot, f, ca, cb, ok_a, ok_b = _pair_columns(c0, rot_flag, width, D, R2, NA, JA, HALF, HAS_TABLE, ALIGNED,
                                                   JOINED)
    cols = c0 + tl.arange(0, 2 * JA)  # JOINED: the tile's consecutive columns, read and written at once

    grad = _piece_pointer(piece, G0, G1, G2, G3, G4, G5, G6, G7, NOUT)  # the tile's gradient tensor
    g_row = grad + rows_w[:, None] * width
    a_mask = row_ok[:, None] & ok_a[None, :]
    b_mask = row_ok[:, None] & ok_b[None, :]
    if JOINED:
        ga, gb = _split_pairs(tl.load(g_row + cols[None, :], mask=row_ok[:, None], other=0.0), BM, JA)
    else:
        ga = tl.load(g_row + ca[None, :], mask=a_mask, other=0.0).to(tl.float32)
        gb = tl.load(g_row + cb[None, :], mask=b_mask, other=0.0).to(tl.float32)
    if HAS_TABLE:
        c, s, c_b, s_b = _rotation(COS, SIN, COS_B, SIN_B, rows_c, rot, f, S, scb, scs, scf, BM, HT, R2, JA, ALIGNED,
                                   FULL)
        # the forward's [[c, -s], [s_b, c_b]] transposed
        da = ga * c + gb * s_b
        db = gb * c_b - ga * s
    else:
        da = ga
        db = gb
    if HAS_PLAIN:  # the gradient of the piece's plain output joins, unrotated (flag 2 + its output)
        plain_row = _piece_pointer(rot_flag - 2, G0, G1, G2, G3, G4, G5, G6, G7, NOUT) + rows_w[:, None] * width
        if rot_flag >= 2:
            if JOINED:
                pa, pb = _split_pairs(tl.load(plain_row + cols[None, :], mask=row_ok[:, None], other=0.0), BM, JA)
                da += pa
                db += pb
            else:
                da += tl.load(plain_row + ca[None, :], mask=a_mask, other=0.0).to(tl.float32)
                db += tl.load(plain_row + cb[None, :], mask=b_mask, other=0.0).to(tl.float32)
    dy_row = DY + rows_w[:, None] * N + row0
    if JOINED:
        tl.store(dy_row + cols[None, :], _joined(da, db, BM, JA).to(DY.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(dy_row + ca[None, :], da.to(DY.dtype.element_ty), mask=a_mask)
        tl.store(dy_row + cb[None, :], db.to(DY.dtype.element_ty), mask=b_mask)
    if NP > 0:
        cp, ok_p = _pass_columns(c0, rot_flag, width, D, R2, NA, NP, JP, ALIGNED)
        p_mask = row_ok[:, None] & ok_p[None, :]
        gp = tl.load(g_row + cp[None, :], mask=p_mask, other=0.0)
        if HAS_PLAIN:
            gp = gp.to(tl.float32)  # one type on both sides of the branch
            if rot_flag >= 2:
                gp += tl.load(plain_row + cp[None, :], mask=p_mask, other=0.0).to(tl.float32)
        tl.store(dy_row + cp[None, :], gp.to(DY.dtype.element_ty), mask=p_mask)


def _table_strides(cos) -> tuple[int, int, int]:
    """(batch, token, frequency) strides of a table [S, R/2] or [Bt, S, R/2] (batch stride 0 when
    the table serves every batch)."""
    if cos.dim() == 2:
        return 0, cos.stride(0), cos.stride(1)
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1), cos.stride(2)


def _readable_tables(cos, sin):
    """cos and sin as the kernels read them: one set of strides for both, the frequencies
    contiguous (copies of these small tables otherwise). The real and imaginary views of a
    complex table (sdpa_complex_rope) have a frequency stride of 2: read in place they ran the
    forward at 1.3-1.6x the time with contiguous tables (H200, bf16, M 65536, 2026-11-27; a scratch
    script calling the op's triton backend with CUDA events, not in the repository)."""
    if cos is None or (cos.stride() == sin.stride() and cos.stride(-1) == 1):
        return cos, sin
    return cos.contiguous(), sin.contiguous()


def _tables(cos, sin, style: str, full_tables: bool) -> tuple:
    """(cos, sin, cos_b, sin_b, R/2) as the kernels read them: one entry per pair, and for
    full-width tables the partners' entries, all four with one set of strides. Rotate-half's are
    views of the same tables (halves, frequency stride 1). Interleaved's even and odd columns are
    copied into contiguous tables: read in place (frequency stride 2) the forward took 0.527 ms and
    the grad kernel 0.307 ms against 0.223 and 0.071 with per-pair tables (H200, bf16, M 65,536,
    widths 768 + 128 + 128, head dim 64, 2026-11-28, .gpu/rope_lucid.py, a scratch script not in the
    repository); the copies are four small kernels on tables of S x R/2 entries."""
    if cos is None:
        return None, None, None, None, 0
    cos, sin = _readable_tables(cos, sin)
    if not full_tables:
        return cos, sin, cos, sin, cos.shape[-1]
    R2 = cos.shape[-1] // 2
    if style == "half":
        return cos[..., :R2], sin[..., :R2], cos[..., R2:], sin[..., R2:], R2
    even_odd = (cos[..., 0::2], sin[..., 0::2], cos[..., 1::2], sin[..., 1::2])
    return (*(t.contiguous() for t in even_odd), R2)


def _joined_pairs(style: str, rotated: bool, lay: dict) -> bool:
    """Whether the kernels read and write a tile's columns at once, interleaved pairs split and
    joined in registers: interleaved RoPE over whole heads (no pass-through columns) in ALIGNED
    tiles. The two stores of columns 2j and 2j + 1 each (a stride of 2) ran the forward at 2.4x
    and forward + backward at 2.1x rotate-half's time (H100, bf16, M 65536, widths 768 + 4 x 128
    + 384, 2026-11-27; a scratch script calling the op's triton backend with CUDA events, not in the
    repository: `tools/bench_projections.py --rope interleaved` is the committed measurement)."""
    return rotated and style == "interleaved" and lay["NP"] == 0 and lay["ALIGNED"]


def _pad_outputs(tensors: list) -> list:
    return tensors + [tensors[0]] * (MAX_PIECES - len(tensors))


def projection_rope_forward(x2, weight, bias, cos, sin, widths, head_dims, style: str, S: int,
                            *, override: dict | None = None, full_tables: bool = False,
                            plain=()) -> list[torch.Tensor]:
    """The pieces [M, widths[i]] (x2's dtype, contiguous), then the plain outputs [M, widths[i]]
    of the rotated pieces i in `plain`; see the module docstring. S is the sequence length (rows
    per batch) when a piece is rotated."""
    why = unsupported_reason(x2, weight, bias, cos, sin, widths, head_dims, plain)
    if why is not None:
        raise ValueError(f"projection_rope (triton): cannot run these inputs: {why}")
    M, K = x2.shape
    bias = bias.contiguous() if bias is not None else None  # the kernel reads it with stride 1
    outs = [x2.new_empty((M, w)) for w in [*widths, *(widths[i] for i in plain)]]
    if M == 0:
        return outs
    rotated = any(head_dims)
    cos, sin, cos_b, sin_b, rot_half = _tables(cos, sin, style, full_tables) if rotated else (None,) * 4 + (0,)
    cfg = _config(x2.dtype, override)["fwd"]
    lay = _layout(widths, head_dims, rot_half, cfg.get("HT"))
    table, NT = _tiles_on(x2.device, widths, head_dims, lay["TW"], plain)
    scb, scs, scf = _table_strides(cos) if rotated else (0, 0, 0)
    launch = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    BM, BK = cfg["BM"], cfg["BK"]
    fwd_kernel[(_cdiv(M, BM) * NT,)](
        x2, weight, bias if bias is not None else weight, *((cos, sin, cos_b, sin_b) if rotated else (weight,) * 4),
        table, *_pad_outputs(outs),
        M, K, max(S, 1), NT, *x2.stride(), *weight.stride(), scb, scs, scf,
        D=lay["D"], R2=lay["R2"], HT=lay["HT"], NA=lay["NA"], NP=lay["NP"], JA=lay["JA"], JP=lay["JP"],
        HALF=style == "half", HAS_BIAS=bias is not None, HAS_TABLE=rotated, FULL=rotated and full_tables,
        NOUT=len(outs), BM=BM, BK=BK,
        EVEN_K=K % BK == 0, WIDE=M * max(widths) >= 2**31, ALIGNED=lay["ALIGNED"],
        PREC="ieee" if x2.dtype == torch.float32 else "tf32",
        UPCAST=upcast_dots(x2.dtype), HAS_PLAIN=bool(plain), JOINED=_joined_pairs(style, rotated, lay), **launch,
    )  # fmt: skip
    return outs


def projection_rope_grad(grads, cos, sin, widths, head_dims, style: str, S: int,
                         *, override: dict | None = None, full_tables: bool = False, plain=()) -> torch.Tensor:
    """dy [M, N] (the pieces' dtype): the gradient of the projection before the rotation, from the
    pieces' gradients grads[i] [M, widths[i]] (any row stride; columns contiguous), then those of
    the plain outputs of the pieces in `plain`."""
    grads = [g if g.stride(-1) == 1 and g.stride(0) == g.shape[1] else g.contiguous() for g in grads]
    M = grads[0].shape[0]
    N = sum(widths)
    dy = grads[0].new_empty((M, N))
    if M == 0:
        return dy
    rotated = any(head_dims)
    cos, sin, cos_b, sin_b, rot_half = _tables(cos, sin, style, full_tables) if rotated else (None,) * 4 + (0,)
    cfg = _config(grads[0].dtype, override)
    lay = _layout(widths, head_dims, rot_half, cfg["fwd"].get("HT"))
    table, NT = _tiles_on(dy.device, widths, head_dims, lay["TW"], plain)
    scb, scs, scf = _table_strides(cos) if rotated else (0, 0, 0)
    BM = cfg["bwd"]["BM"]
    launch = {k: v for k, v in cfg["bwd"].items() if k in ("num_warps", "num_stages")}
    grad_kernel[(_cdiv(M, BM) * NT,)](
        *_pad_outputs(grads), dy, *((cos, sin, cos_b, sin_b) if rotated else (dy,) * 4), table,
        M, N, max(S, 1), NT, scb, scs, scf,
        D=lay["D"], R2=lay["R2"], HT=lay["HT"], NA=lay["NA"], NP=lay["NP"], JA=lay["JA"], JP=lay["JP"],
        HALF=style == "half", HAS_TABLE=rotated, FULL=rotated and full_tables, NOUT=len(grads), BM=BM, WIDE=M * N >= 2**31, ALIGNED=lay["ALIGNED"],
        HAS_PLAIN=bool(plain), JOINED=_joined_pairs(style, rotated, lay), **launch,
    )  # fmt: skip
    return dy
