"""Triton code that the attention kernels (window_triton, compressed_triton, selection_triton)
all repeat: tile loads and stores, the online-softmax step, the backward's row statistics, and
the delta preprocess kernel. Helpers are @jit device functions (triton_support.jit) that the
kernels call by name. Triton inlines them: a kernel's PTX has the instructions it had when it
spelled them out, plus debug-line labels around each inlined call, which can move ptxas's
scheduling and registers (not its arithmetic). So a helper is used where the compiled kernels
came out the same (SASS compared for sm_90, fp16/bf16 at the seed and paper shapes); a change
here is a change to every kernel that calls it: time them.

    dk, dv, dk_ok, dv_ok = dim_ranges(DK, DV, DK_P, DV_P)                         # column ranges
    x = load_tile(ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, UPCAST)     # [R, C]
    store_tile(ptr, rows, cols, stride_r, stride_c, x, row_ok, col_ok)
    lse2, delta = row_stats(LSE, DELTA, row_lin, row_ok)                           # [R] each
    delta = row_delta(do, o)                                                       # [R]
    start = document_start(POS, b, t, row_ok, S)                                   # [R] t - pos[t]
    m_i, l_i, acc = softmax_state(ROWS, DV_P)
    m_new, alpha, p, l_i = softmax_update(m_i, l_i, s2, times)
    acc = softmax_accumulate(acc, alpha, p, v, DTYPE, PREC, UPCAST)
    o, lse = softmax_finish(acc, m_i, l_i)
    delta_kernel[(ceil(S / BLOCK_M), B * H)](...)                                  # rowsum(dO * O)

Conventions (those of the kernels): a tile's rows are tokens (queries or keys, int64 ids) and its
columns a head dim padded to a power of two; `ptr` is the tensor's pointer advanced to the tile's
batch and head (a scalar, or a [R, 1] block when each row has its own head); masked entries load
as 0. Scores in log2 units (log2(e) folded into the scale), lse in natural log, both fp32.
UPCAST: bf16 dot operands go through fp32 (`triton_support.upcast_dots`: interpreted only).
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError:  # the kernel modules say why their kernels cannot run
    tl = None

from .triton_support import jit, reduce_max, reduce_sum

__all__ = ["delta_kernel", "dim_ranges", "document_start", "load_tile", "row_delta", "row_stats", "softmax_accumulate",
           "softmax_finish", "softmax_state", "softmax_update", "store_tile"]


@jit
def dim_ranges(DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr):
    """The column ranges of q/k tiles, dk [DK_P], and of v/o tiles, dv [DV_P] (head dims padded
    to powers of two), and their masks dk_ok, dv_ok (the real head dims DK, DV)."""
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    dk_ok = dk < DK
    dv_ok = dv < DV
    return dk, dv, dk_ok, dv_ok


@jit
def load_tile(ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, UPCAST: tl.constexpr):
    """ptr[rows * stride_r + cols * stride_c] as [R, C] (rows [R], cols [C]), 0 outside
    row_ok x col_ok (row_ok None: every row is valid, only the columns are masked); fp32 when
    UPCAST."""
    if row_ok is None:
        mask = col_ok[None, :]
    else:
        mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@jit
def store_tile(ptr, rows, cols, stride_r, stride_c, x, row_ok, col_ok):
    """x [R, C] cast to ptr's element type, stored at ptr[rows * stride_r + cols * stride_c]
    inside row_ok x col_ok."""
    tl.store(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, x.to(ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@jit
def row_stats(LSE, DELTA, row_lin, row_ok):
    """The backward's per-row inputs at the rows' linear ids row_lin ((b * H + head) * S + t):
    lse in log2 units and delta (0 outside row_ok)."""
    lse2 = tl.load(LSE + row_lin, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_lin, mask=row_ok, other=0.0)
    return lse2, delta


@jit
def row_delta(do, o):
    """delta = rowsum(dO * O) [R] in fp32, from dO and O tiles [R, DV_P] (padding 0)."""
    return reduce_sum(do.to(tl.float32) * o.to(tl.float32), 1)


@jit
def softmax_state(ROWS: tl.constexpr, DV_P: tl.constexpr):
    """The online softmax's state before the first key tile: running max m_i [ROWS] (log2 units)
    from a finite floor, so that a tile masked for a row leaves its state unchanged (alpha = 1,
    p = 0) instead of making NaN and its first visible tile gets alpha = 0; running sum l_i
    [ROWS]; output accumulator acc [ROWS, DV_P]; all fp32."""
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, DV_P], 0.0, tl.float32)
    return m_i, l_i, acc


@jit
def softmax_update(m_i, l_i, s2, times):
    """One key tile of the online softmax: scores s2 [ROWS, N] in log2 units (-inf where masked).
    Returns the new running max m_new (finite: at least the floor), alpha = exp2(m_i - m_new) to
    rescale acc by, p [ROWS, N] (0 where masked; times p when `times` [ROWS] is given: a block a
    row chose twice counts twice) and the new running sum l_i. The caller then adds p @ v to
    acc * alpha (`softmax_accumulate`, or its own rounding of p) and takes m_new as m_i."""
    m_new = tl.maximum(m_i, reduce_max(s2, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s2 - m_new[:, None])
    if times is not None:
        p = p * times[:, None]
    l_i = l_i * alpha + reduce_sum(p, 1)
    return m_new, alpha, p, l_i


@jit
def softmax_accumulate(acc, alpha, p, v, DTYPE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc * alpha + p @ v [ROWS, DV_P]: the output accumulator after a key tile, p cast to v's
    dtype DTYPE for the dot (and back to fp32 when UPCAST)."""
    pv = p.to(DTYPE)
    if UPCAST:
        pv = pv.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(pv, v, input_precision=PREC)


@jit
def softmax_finish(acc, m_i, l_i):
    """o = acc / l_i [ROWS, DV_P] and lse [ROWS] in natural log from the final state; a row that
    saw no key (l_i = 0) gets o = 0 and lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # log2 -> ln
    return o, lse


@jit
def document_start(POS, b, t, row_ok, S):
    """Packed documents: the first token of each query's document, t - pos[t] [R] int32, from
    POS, the [B, S] int64 positions in their documents (contiguous), at batch b (int64) and
    query tokens t [R] (int64). Clamped to [-1, S] before the cast (no int32 wrap-around for
    positions that are not positions: pos[t] > t reads as -1, every key of the row before it is
    in its document; pos[t] < 0 as at least t + 1, none is); rows outside row_ok read pos 0."""
    pos = tl.load(POS + b * S + t, mask=row_ok, other=0)
    return tl.minimum(tl.maximum(t - pos, -1), S).to(tl.int32)


@jit
def delta_kernel(
    DO, O, DELTA, sdob, sdoh, sdos, sdod, sob, soh, sos, sod, S, H,
    DV: tl.constexpr, DV_P: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The backward's preprocess, grid (ceil(S / BLOCK_M), B * H): DELTA [B, H, S] fp32 =
    rowsum(dO * O) over dO, O [B, H, S, Dv] (any strides), in fp32."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    head = bh % H
    t = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    dv = tl.arange(0, DV_P)
    mask = (t < S)[:, None] & (dv < DV)[None, :]
    do = tl.load(DO + b * sdob + head * sdoh + t[:, None] * sdos + dv[None, :] * sdod, mask=mask, other=0.0)
    o = tl.load(O + b * sob + head * soh + t[:, None] * sos + dv[None, :] * sod, mask=mask, other=0.0)
    tl.store(DELTA + bh * S + t, row_delta(do, o), mask=t < S)
