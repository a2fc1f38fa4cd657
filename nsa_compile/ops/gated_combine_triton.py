"""Triton kernels for nsa::gated_combine (NSA section 5): the gate MLP and the weighted sum of the
three branch outputs, forward and backward.

    o, gates = combine_forward(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize)
    grads = combine_backward(grad_o, gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, gates, activation, normalize)
    why = unsupported_reason(gate_in, w1, w2, o_cmp, activation)     # None when the kernels can run

Same semantics and shapes as the `reference` backend of nsa_compile/ops/gated_combine.py (read its
docstring first): gate rows (b, s, r) average m vectors of gate_in [B, S, R, m, Din], an MLP
gives 3 * NI logits per row, softmax over each triple's three branches (or a sigmoid), and head
r * HPR + i * REP + j gets triple i of row r. Every tensor is read through its strides (the
branch outputs are often transposed [B, H, S, Dv] memory); o and all gradients are written
contiguous.

Kernels (a program owns ROWS consecutive gate rows and NB of a row's gate triples; tile sizes
from `_tiles`):
- forward, 1-D grid over (row tile, triple chunk), the chunk fastest: the gate MLP on the program's rows with tl.dot
  (operands in the gate input's dtype, accumulation in fp32: the tensor-core path; fp32 inputs
  use input_precision="ieee", no TF32), or the logits loaded as they are (no w2), the
  normalization in fp32, the gates stored (fp32, [rows, NI, 3]: the backward's input); then per
  triple its gates back as row vectors and, for each head it serves, o_cmp, o_sel, o_win
  [ROWS, Dv] loaded once and o written once. Without a hidden layer the Din loop runs in chunks
  of BK (the paper's dim = 2048); a row's triples are split over programs (NB = 16 of the paper's
  64 heads each), so no logit is computed twice.
- backward, grid (row tiles, triple chunks): per triple its saved gates, then per head grad_o and
  the three branch outputs loaded once, their three gradients written once, dg = sum(grad_o * o_c)
  reduced, and the normalization's backward gives the logit gradient dz (fp32 [rows, NI, 3]: 3 * NI
  floats a row, about 1% of the bytes the kernels move). Then, by the gate's form:
  * a hidden layer (the seed's group gate, whose weights are small): one more kernel, persistent
    (PROGRAMS_PER_SM programs per SM, each taking every P-th row tile), recomputes the hidden
    layer from gate_in (read once), back-propagates through both Linears and writes d gate_in;
    the weight and bias gradients accumulate in fp32 registers over the program's tiles, one
    partial per program, summed by torch afterwards in a fixed order: no atomics, deterministic
    on a given GPU. (Kept apart from the heavy loop above: together they spilled registers.)
  * a single Linear (the paper's head gate: w2 [3H, dim], 192 x 2048, far too large for
    per-program partials): two GEMMs in the gate input's dtype, d gate_in = dz @ w2 and
    d w2 = dz^T @ u (cuBLAS, deterministic), and d b2 = dz.sum(0).
  * no Linear (logits from elsewhere): d gate_in is dz.

Bytes: the forward reads gate_in and the three branch outputs once and writes o (plus the gates:
3 * NI floats a row); the backward reads grad_o, the branch outputs and gate_in once and writes
the three branch gradients and d gate_in once (plus dz and the gates). That is the memory floor
`tools/bench_combine.py` measures against.

Supported (`unsupported_reason` says why not): CUDA tensors, or any device with TRITON_INTERPRET=1;
fp16, bf16 or fp32 branch outputs, gate input and weights (weights cast to the gate input's dtype
for the dots, as autocast does); Dv up to MAX_DV; with a hidden layer, DH_P * DIN_P up to
MAX_FUSED_WEIGHT (padded to powers of two >= 16: the seed's 32 x 64 and the paper's group gate
64 x 128 fit) and NI up to MAX_FUSED_NI. Offsets are int64 (no size limit).

CPU interpreter: as in selection_triton.py, the kernels and their helpers are module-level
`triton_support.jit` functions, built for the mode Triton is in when launched; interpreted, bf16
dot operands are cast to fp32 (the interpreter multiplies bf16 as raw bits) and row sums use
tl.reduce.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; unsupported_reason says why the kernels cannot run
    triton = tl = None

from .triton_support import (
    KERNEL_DTYPES, cdiv as _cdiv, device_reason, dot_precision as _dot_precision, jit, next_pow2 as _next_pow2,
    reduce_sum, upcast_dots,
)

__all__ = ["MAX_DV", "MAX_FUSED_WEIGHT", "combine_backward", "combine_forward", "unsupported_reason"]

MAX_DV = 256
MAX_FUSED_WEIGHT = 8192  # DH_P * DIN_P: the fp32 dw1 partial a program keeps in registers
MAX_FUSED_NI = 64
PROGRAMS_PER_SM = 2  # persistent backward grid with a hidden layer (2: 0.511 ms fwd+bwd, 4: 0.527; H100, seed 2k x 29)
INTERPRETED_PROGRAMS = 3  # the same on the CPU interpreter (small, so tests cover several tiles per program)
_ACT = {"silu": 1, "relu": 2, "gelu": 3, "none": 0}


def _pad(x: int) -> int:
    """A tl.dot dimension: the next power of two, at least 16."""
    return max(16, _next_pow2(x))


def _dims(gate_in, w1, w2, o_cmp) -> dict:
    B, S, R, M, DIN = gate_in.shape
    H, DV = o_cmp.shape[2], o_cmp.shape[3]
    NI = (w2.shape[0] if w2 is not None else DIN) // 3
    DH = w1.shape[0] if w1 is not None else 0
    return {"B": B, "S": S, "R": R, "M": M, "DIN": DIN, "H": H, "DV": DV, "NI": NI, "HPR": H // R,
            "REP": H // R // NI, "DH": DH, "N_ROWS": B * S * R}


def unsupported_reason(gate_in, w1, w2, o_cmp, activation: str) -> str | None:
    """Why the Triton kernels cannot run these inputs, or None when they can (the op's own checks
    of shapes and variant names have passed)."""
    if why := device_reason(gate_in, w1, w2, o_cmp):
        return why
    for name, t in (("branch outputs", o_cmp), ("gate input", gate_in), ("w2", w2), ("w1", w1)):
        if t is not None and t.dtype not in KERNEL_DTYPES:
            return f"{name} dtype {t.dtype} (needs fp16, bf16 or fp32)"
    if o_cmp.shape[3] > MAX_DV:
        return f"head dim Dv {o_cmp.shape[3]} (at most {MAX_DV})"
    if w1 is not None:
        d = _dims(gate_in, w1, w2, o_cmp)
        size = _pad(d["DH"]) * _pad(d["DIN"])
        if size > MAX_FUSED_WEIGHT:
            return (f"a hidden layer of {d['DH']} x {d['DIN']} (padded {size} elements; the backward keeps its "
                    f"weight gradient in registers, at most {MAX_FUSED_WEIGHT})")
        if d["NI"] > MAX_FUSED_NI:
            return f"{d['NI']} gate triples per row after a hidden layer (at most {MAX_FUSED_NI})"
    return None


def _tiles(d: dict, hidden: bool, fp32: bool = False, override: dict | None = None) -> dict:
    """Launch parameters per kernel ("fwd", "bwd", "mlp"). ROWS gate rows per program (>= 16 for
    tl.dot); NB gate triples per program (>= 16, masked): all of them with a hidden layer (its
    output is every triple), 16 without (the paper's 64 heads: 4 programs per row tile, no logit
    computed twice); BK the Din chunk of the forward's gate GEMM.

    Chosen so that no fp16/bf16 kernel spills registers on sm_90 at the seed's (Dk = Dv = 64,
    hidden 32) and the paper's (Dv 128; group gate hidden 64 x 128, head gate 192 x 2048) shapes:
    ptxas resource usage of the kernels compiled without a GPU (Triton 3.9, 2026-11-27), e.g.
    fwd 70-96 registers, bwd 80-108, mlp 188 (seed, at 8 warps: the default is now 4, faster on
    the H100, its registers not re-read) and 240 (paper group, ROWS 16). fp32 (IEEE
    dots) takes ROWS 16 and 8 warps everywhere; its mlp kernel still spills at the paper's group
    gate: correct, slower. Timing on the H100 may move these (tools/bench_combine.py --tiles).
    `override` ({kernel: {parameter: value}}; ROWS, BK, num_warps, num_stages; PER_SM, the mlp
    kernel's persistent programs per SM) is for that sweep."""
    nb = _pad(d["NI"]) if hidden else 16
    din_p, dh_p, dv_p = _pad(d["DIN"]), _pad(max(d["DH"], 1)), _pad(d["DV"])
    if fp32:
        tiles = {kernel: {"ROWS": 16, "NB": nb, "num_warps": 8} for kernel in ("fwd", "bwd", "mlp")}
    else:
        tiles = {
            "fwd": {"ROWS": 32, "NB": nb, "num_warps": 4},
            "bwd": {"ROWS": 32, "NB": nb, "num_warps": 4 if dv_p <= 64 else 8},
            # 4 warps at the seed's 32 x 64 hidden layer: 0.526 against 0.569 ms fwd+bwd with 8
            # (H100, tools/bench_combine.py --tile-sweep, S 2048 B 29, CUDA-graph GPU time)
            "mlp": {"ROWS": 32 if dh_p * din_p <= 2048 else 16, "NB": nb,
                    "num_warps": 4 if dh_p * din_p <= 2048 else 8},
        }
    tiles["mlp"]["PER_SM"] = PROGRAMS_PER_SM
    tiles["fwd"]["BK"] = min(64, din_p)
    tiles |= {"DIN_P": din_p, "DH_P": dh_p, "DV_P": dv_p}
    for kernel, params in (override or {}).items():
        if kernel not in ("fwd", "bwd", "mlp"):
            raise ValueError(f"_tiles: unknown kernel {kernel!r} in override; valid: fwd, bwd, mlp")
        tiles[kernel] = tiles[kernel] | params
    return tiles


@jit
def _act(pre, ACT: tl.constexpr):
    if ACT == 1:  # silu
        out = pre / (1.0 + tl.exp(-pre))
    elif ACT == 2:  # relu
        out = tl.maximum(pre, 0.0)
    else:  # gelu (erf)
        out = 0.5 * pre * (1.0 + tl.math.erf(pre * 0.7071067811865476))
    return out


@jit
def _act_slope(pre, ACT: tl.constexpr):
    if ACT == 1:
        sig = 1.0 / (1.0 + tl.exp(-pre))
        out = sig * (1.0 + pre * (1.0 - sig))
    elif ACT == 2:
        out = tl.where(pre > 0.0, 1.0, 0.0)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(pre * 0.7071067811865476))
        out = cdf + pre * tl.exp(-0.5 * pre * pre) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return out


@jit
def _normalize(l0, l1, l2, SOFTMAX: tl.constexpr):
    if SOFTMAX:  # over the three branches
        mx = tl.maximum(tl.maximum(l0, l1), l2)
        e0 = tl.exp(l0 - mx)
        e1 = tl.exp(l1 - mx)
        e2 = tl.exp(l2 - mx)
        den = e0 + e1 + e2
        g0, g1, g2 = e0 / den, e1 / den, e2 / den
    else:
        g0 = 1.0 / (1.0 + tl.exp(-l0))
        g1 = 1.0 / (1.0 + tl.exp(-l1))
        g2 = 1.0 / (1.0 + tl.exp(-l2))
    return g0, g1, g2


@jit
def _mm(a, b, DT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with both operands rounded to DT (the tensor-core dtype), fp32 accumulation."""
    a = a.to(DT)
    b = b.to(DT)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@jit
def fwd_kernel(
    GIN, W1, B1, W2, B2, OC, OS, OW, OUT, GATES,
    sgb, sgs, sgr, sgm, sgd, sw1o, sw1i, sw2o, sw2i,
    scb, scs, sch, scd, ssb, sss, ssh, ssd, swb, sws, swh, swd, sob, sos, soh, sod,
    N_ROWS, S, R,
    M: tl.constexpr, DIN: tl.constexpr, DH: tl.constexpr, NI: tl.constexpr, REP: tl.constexpr,
    HPR: tl.constexpr, DV: tl.constexpr, DH_P: tl.constexpr, DV_P: tl.constexpr,
    ROWS: tl.constexpr, NB: tl.constexpr, CHUNKS: tl.constexpr, BK: tl.constexpr,
    HIDDEN: tl.constexpr, LOGITS: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
    ACT: tl.constexpr, SOFTMAX: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    DT = GIN.dtype.element_ty
    # a 1-D grid, the triple chunk fastest: the CHUNKS programs of a row tile run side by side
    # and read its gate input while it is still in L2 (the paper's x: 4 KB a token, 4 chunks)
    tile = tl.program_id(0) // CHUNKS
    chunk = tl.program_id(0) % CHUNKS
    rows = tile * ROWS + tl.arange(0, ROWS)  # gate rows (b, s, r)
    row_ok = rows < N_ROWS
    rows64 = rows.to(tl.int64)
    b = rows64 // (S * R)
    s = rows64 // R % S
    r = rows64 % R
    tri = chunk * NB + tl.arange(0, NB)  # this program's gate triples
    tri_ok = tri < NI
    gin = GIN + b * sgb + s * sgs + r * sgr  # [ROWS] row starts

    # the gate MLP -> logits l0, l1, l2 [ROWS, NB] (branch c of triple i is w2 row i * 3 + c)
    if HIDDEN:
        hid = tl.arange(0, DH_P)
        hid_ok = hid < DH
        pre = tl.full([ROWS, DH_P], 0.0, tl.float32)
        for k0 in range(0, DIN, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < DIN
            u = tl.full([ROWS, BK], 0.0, tl.float32)
            for mi in range(M):
                u += tl.load(gin[:, None] + mi * sgm + kk[None, :] * sgd, mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0).to(tl.float32)
            u = u / M
            w1t = tl.load(W1 + hid[None, :] * sw1o + kk[:, None] * sw1i, mask=k_ok[:, None] & hid_ok[None, :],
                          other=0.0)  # [BK, DH_P]
            pre += _mm(u, w1t, DT, PREC, UPCAST)
        if HAS_B1:
            pre += tl.load(B1 + hid, mask=hid_ok, other=0.0).to(tl.float32)[None, :]
        a = _act(pre, ACT)  # [ROWS, DH_P]; 0 in the padded columns
        wmask = hid_ok[:, None] & tri_ok[None, :]
        w2p = W2 + hid[:, None] * sw2i + (tri * 3)[None, :] * sw2o  # [DH_P, NB]: w2^T of branch 0
        l0 = _mm(a, tl.load(w2p, mask=wmask, other=0.0), DT, PREC, UPCAST)
        l1 = _mm(a, tl.load(w2p + sw2o, mask=wmask, other=0.0), DT, PREC, UPCAST)
        l2 = _mm(a, tl.load(w2p + 2 * sw2o, mask=wmask, other=0.0), DT, PREC, UPCAST)
    elif LOGITS:  # the gate input is the logits (m = 1)
        zmask = row_ok[:, None] & tri_ok[None, :]
        zp = gin[:, None] + (tri * 3 * sgd)[None, :]
        l0 = tl.load(zp, mask=zmask, other=0.0).to(tl.float32)
        l1 = tl.load(zp + sgd, mask=zmask, other=0.0).to(tl.float32)
        l2 = tl.load(zp + 2 * sgd, mask=zmask, other=0.0).to(tl.float32)
    else:
        l0 = tl.full([ROWS, NB], 0.0, tl.float32)
        l1 = tl.full([ROWS, NB], 0.0, tl.float32)
        l2 = tl.full([ROWS, NB], 0.0, tl.float32)
        for k0 in range(0, DIN, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < DIN
            u = tl.full([ROWS, BK], 0.0, tl.float32)
            for mi in range(M):
                u += tl.load(gin[:, None] + mi * sgm + kk[None, :] * sgd, mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0).to(tl.float32)
            u = u / M
            wmask = k_ok[:, None] & tri_ok[None, :]
            w2p = W2 + kk[:, None] * sw2i + (tri * 3)[None, :] * sw2o  # [BK, NB]
            l0 += _mm(u, tl.load(w2p, mask=wmask, other=0.0), DT, PREC, UPCAST)
            l1 += _mm(u, tl.load(w2p + sw2o, mask=wmask, other=0.0), DT, PREC, UPCAST)
            l2 += _mm(u, tl.load(w2p + 2 * sw2o, mask=wmask, other=0.0), DT, PREC, UPCAST)
    if HAS_B2:
        l0 += tl.load(B2 + tri * 3, mask=tri_ok, other=0.0).to(tl.float32)[None, :]
        l1 += tl.load(B2 + tri * 3 + 1, mask=tri_ok, other=0.0).to(tl.float32)[None, :]
        l2 += tl.load(B2 + tri * 3 + 2, mask=tri_ok, other=0.0).to(tl.float32)[None, :]
    g0, g1, g2 = _normalize(l0, l1, l2, SOFTMAX)
    gmask = row_ok[:, None] & tri_ok[None, :]
    gp = GATES + rows64[:, None] * (NI * 3) + (tri * 3)[None, :]
    tl.store(gp, g0, mask=gmask)
    tl.store(gp + 1, g1, mask=gmask)
    tl.store(gp + 2, g2, mask=gmask)

    # the weighted sum: per triple, its gates back from GATES as row vectors (the stores above
    # are by other threads: a barrier first), then its REP heads
    tl.debug_barrier()
    dv = tl.arange(0, DV_P)
    omask = row_ok[:, None] & (dv < DV)[None, :]
    g_row = GATES + rows64 * (NI * 3)
    for jj in range(0, tl.minimum(NI - chunk * NB, NB)):
        j = chunk * NB + jj
        ga = tl.load(g_row + j * 3, mask=row_ok, other=0.0)[:, None]
        gb = tl.load(g_row + j * 3 + 1, mask=row_ok, other=0.0)[:, None]
        gc = tl.load(g_row + j * 3 + 2, mask=row_ok, other=0.0)[:, None]
        for k in range(REP):
            head = r * HPR + j * REP + k  # [ROWS]
            xc = tl.load(OC + (b * scb + s * scs + head * sch)[:, None] + dv[None, :] * scd, mask=omask, other=0.0)
            xs = tl.load(OS + (b * ssb + s * sss + head * ssh)[:, None] + dv[None, :] * ssd, mask=omask, other=0.0)
            xw = tl.load(OW + (b * swb + s * sws + head * swh)[:, None] + dv[None, :] * swd, mask=omask, other=0.0)
            o = ga * xc.to(tl.float32) + gb * xs.to(tl.float32) + gc * xw.to(tl.float32)
            tl.store(OUT + (b * sob + s * sos + head * soh)[:, None] + dv[None, :] * sod,
                     o.to(OUT.dtype.element_ty), mask=omask)


@jit
def bwd_kernel(
    DO, OC, OS, OW, GATES, DOC, DOS, DOW, DZ,
    sdb, sds, sdh, sdd, scb, scs, sch, scd, ssb, sss, ssh, ssd, swb, sws, swh, swd, sxb, sxs, sxh, sxd,
    N_ROWS, S, R,
    NI: tl.constexpr, REP: tl.constexpr, HPR: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
    ROWS: tl.constexpr, NB: tl.constexpr, SOFTMAX: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N_ROWS
    rows64 = rows.to(tl.int64)
    b = rows64 // (S * R)
    s = rows64 // R % S
    r = rows64 % R
    dv = tl.arange(0, DV_P)
    omask = row_ok[:, None] & (dv < DV)[None, :]
    g_row = GATES + rows64 * (NI * 3)
    dz_row = DZ + rows64 * (NI * 3)
    # per triple: d o_c = g_c * dO for its REP heads, dg_c = the sum over them of dO . o_c,
    # then dz, the logit gradient, through the softmax / sigmoid
    for jj in range(0, tl.minimum(NI - tl.program_id(1) * NB, NB)):
        j = tl.program_id(1) * NB + jj
        ga = tl.load(g_row + j * 3, mask=row_ok, other=0.0)
        gb = tl.load(g_row + j * 3 + 1, mask=row_ok, other=0.0)
        gc = tl.load(g_row + j * 3 + 2, mask=row_ok, other=0.0)
        dga = tl.full([ROWS], 0.0, tl.float32)
        dgb = tl.full([ROWS], 0.0, tl.float32)
        dgc = tl.full([ROWS], 0.0, tl.float32)
        for k in range(REP):
            head = r * HPR + j * REP + k
            do = tl.load(DO + (b * sdb + s * sds + head * sdh)[:, None] + dv[None, :] * sdd, mask=omask,
                         other=0.0).to(tl.float32)
            xc = tl.load(OC + (b * scb + s * scs + head * sch)[:, None] + dv[None, :] * scd, mask=omask, other=0.0)
            xs = tl.load(OS + (b * ssb + s * sss + head * ssh)[:, None] + dv[None, :] * ssd, mask=omask, other=0.0)
            xw = tl.load(OW + (b * swb + s * sws + head * swh)[:, None] + dv[None, :] * swd, mask=omask, other=0.0)
            dst = (b * sxb + s * sxs + head * sxh)[:, None] + dv[None, :] * sxd
            tl.store(DOC + dst, (ga[:, None] * do).to(DOC.dtype.element_ty), mask=omask)
            tl.store(DOS + dst, (gb[:, None] * do).to(DOS.dtype.element_ty), mask=omask)
            tl.store(DOW + dst, (gc[:, None] * do).to(DOW.dtype.element_ty), mask=omask)
            dga += reduce_sum(do * xc.to(tl.float32), 1)
            dgb += reduce_sum(do * xs.to(tl.float32), 1)
            dgc += reduce_sum(do * xw.to(tl.float32), 1)
        if SOFTMAX:
            dot = ga * dga + gb * dgb + gc * dgc
            dza, dzb, dzc = ga * (dga - dot), gb * (dgb - dot), gc * (dgc - dot)
        else:
            dza, dzb, dzc = dga * ga * (1.0 - ga), dgb * gb * (1.0 - gb), dgc * gc * (1.0 - gc)
        tl.store(dz_row + j * 3, dza, mask=row_ok)
        tl.store(dz_row + j * 3 + 1, dzb, mask=row_ok)
        tl.store(dz_row + j * 3 + 2, dzc, mask=row_ok)


@jit
def mlp_bwd_kernel(
    DZ, GIN, W1, B1, W2, DGIN, PW1, PB1, PW2, PB2,
    sgb, sgs, sgr, sgm, sgd, sw1o, sw1i, sw2o, sw2i, seb, ses, ser, sem, sed,
    N_ROWS, S, R, N_TILES,
    M: tl.constexpr, DIN: tl.constexpr, DH: tl.constexpr, NI: tl.constexpr,
    DIN_P: tl.constexpr, DH_P: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr,
    HAS_B1: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    DT = GIN.dtype.element_ty
    pid = tl.program_id(0)
    tri = tl.arange(0, NB)  # every triple (NB >= NI)
    tri_ok = tri < NI
    kk = tl.arange(0, DIN_P)
    k_ok = kk < DIN
    hid = tl.arange(0, DH_P)
    hid_ok = hid < DH
    w1mask = hid_ok[:, None] & k_ok[None, :]
    w1p = W1 + hid[:, None] * sw1o + kk[None, :] * sw1i  # [DH_P, DIN_P]
    w2mask = tri_ok[:, None] & hid_ok[None, :]
    w2p = W2 + (tri * 3)[:, None] * sw2o + hid[None, :] * sw2i  # [NB, DH_P], branch 0
    # fp32 gradient partials over this program's row tiles (every P-th)
    acc_w1 = tl.full([DH_P, DIN_P], 0.0, tl.float32)
    acc_b1 = tl.full([DH_P], 0.0, tl.float32)
    acc_w2a = tl.full([NB, DH_P], 0.0, tl.float32)
    acc_w2b = tl.full([NB, DH_P], 0.0, tl.float32)
    acc_w2c = tl.full([NB, DH_P], 0.0, tl.float32)
    acc_b2a = tl.full([NB], 0.0, tl.float32)
    acc_b2b = tl.full([NB], 0.0, tl.float32)
    acc_b2c = tl.full([NB], 0.0, tl.float32)
    for tile in range(pid, N_TILES, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < N_ROWS
        rows64 = rows.to(tl.int64)
        b = rows64 // (S * R)
        s = rows64 // R % S
        r = rows64 % R
        gmask = row_ok[:, None] & tri_ok[None, :]
        dzp = DZ + rows64[:, None] * (NI * 3) + (tri * 3)[None, :]
        dz0 = tl.load(dzp, mask=gmask, other=0.0)  # [ROWS, NB]
        dz1 = tl.load(dzp + 1, mask=gmask, other=0.0)
        dz2 = tl.load(dzp + 2, mask=gmask, other=0.0)
        # the hidden layer again, from gate_in (the weights are tiny: loaded per tile from cache
        # rather than held in registers across the loop)
        gin = GIN + b * sgb + s * sgs + r * sgr
        umask = row_ok[:, None] & k_ok[None, :]
        u = tl.full([ROWS, DIN_P], 0.0, tl.float32)
        for mi in range(M):
            u += tl.load(gin[:, None] + mi * sgm + kk[None, :] * sgd, mask=umask, other=0.0).to(tl.float32)
        u = u / M
        w1 = tl.load(w1p, mask=w1mask, other=0.0)
        pre = _mm(u, tl.trans(w1), DT, PREC, UPCAST)  # [ROWS, DH_P]
        if HAS_B1:
            pre += tl.load(B1 + hid, mask=hid_ok, other=0.0).to(tl.float32)[None, :]
        a = _act(pre, ACT)
        # z = a @ w2^T + b2  ->  dw2 += dz^T @ a, db2 += sum dz, da = dz @ w2
        da = _mm(dz0, tl.load(w2p, mask=w2mask, other=0.0), DT, PREC, UPCAST)
        da += _mm(dz1, tl.load(w2p + sw2o, mask=w2mask, other=0.0), DT, PREC, UPCAST)
        da += _mm(dz2, tl.load(w2p + 2 * sw2o, mask=w2mask, other=0.0), DT, PREC, UPCAST)
        acc_w2a += _mm(tl.trans(dz0), a, DT, PREC, UPCAST)
        acc_w2b += _mm(tl.trans(dz1), a, DT, PREC, UPCAST)
        acc_w2c += _mm(tl.trans(dz2), a, DT, PREC, UPCAST)
        acc_b2a += reduce_sum(dz0, 0)
        acc_b2b += reduce_sum(dz1, 0)
        acc_b2c += reduce_sum(dz2, 0)
        # pre = u @ w1^T + b1  ->  dw1 += d_pre^T @ u, db1 += sum d_pre, du = d_pre @ w1
        d_pre = tl.where(row_ok[:, None], da * _act_slope(pre, ACT), 0.0)
        acc_w1 += _mm(tl.trans(d_pre), u, DT, PREC, UPCAST)
        acc_b1 += reduce_sum(d_pre, 0)
        du = _mm(d_pre, w1, DT, PREC, UPCAST) / M  # [ROWS, DIN_P]: the mean's gradient, to each of its m
        dgin = DGIN + b * seb + s * ses + r * ser
        for mi in range(M):
            tl.store(dgin[:, None] + mi * sem + kk[None, :] * sed, du.to(DGIN.dtype.element_ty), mask=umask)
    # this program's partials: [P, DH, DIN], [P, DH], [P, 3, NI, DH], [P, 3, NI]
    pid64 = pid.to(tl.int64)
    tl.store(PW1 + pid64 * (DH * DIN) + hid[:, None] * DIN + kk[None, :], acc_w1, mask=w1mask)
    tl.store(PB1 + pid64 * DH + hid, acc_b1, mask=hid_ok)
    pw2 = PW2 + pid64 * (3 * NI * DH) + tri[:, None] * DH + hid[None, :]
    tl.store(pw2, acc_w2a, mask=w2mask)
    tl.store(pw2 + NI * DH, acc_w2b, mask=w2mask)
    tl.store(pw2 + 2 * NI * DH, acc_w2c, mask=w2mask)
    pb2 = PB2 + pid64 * (3 * NI) + tri
    tl.store(pb2, acc_b2a, mask=tri_ok)
    tl.store(pb2 + NI, acc_b2b, mask=tri_ok)
    tl.store(pb2 + 2 * NI, acc_b2c, mask=tri_ok)


def _require(gate_in, w1, w2, o_cmp, activation) -> None:
    why = unsupported_reason(gate_in, w1, w2, o_cmp, activation)
    if why is not None:
        raise ValueError(f"gated_combine (triton): cannot run these inputs: {why}")


def _programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return INTERPRETED_PROGRAMS
    return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _weight_strides(w1, w2):
    return (*(w1.stride() if w1 is not None else (0, 0)), *(w2.stride() if w2 is not None else (0, 0)))


def combine_forward(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation: str, normalize: str, *,
                    tiles: dict | None = None):
    """o [B, S, H, Dv] (contiguous, o_cmp's dtype) and the gates [B, S, R, NI, 3] float32.
    `tiles`: an override of `_tiles` (tools/bench_combine.py)."""
    _require(gate_in, w1, w2, o_cmp, activation)
    d = _dims(gate_in, w1, w2, o_cmp)
    out = torch.empty(d["B"], d["S"], d["H"], d["DV"], dtype=o_cmp.dtype, device=o_cmp.device)
    gates = torch.empty(d["B"], d["S"], d["R"], d["NI"], 3, dtype=torch.float32, device=o_cmp.device)
    if d["N_ROWS"] == 0:
        return out, gates
    T = _tiles(d, w1 is not None, gate_in.dtype == torch.float32, tiles)
    cfg = T["fwd"]
    dummy = gate_in  # for an absent w1, b1, w2, b2 (never read)
    chunks = _cdiv(d["NI"], cfg["NB"])
    fwd_kernel[(_cdiv(d["N_ROWS"], cfg["ROWS"]) * chunks,)](
        gate_in, w1 if w1 is not None else dummy, b1 if b1 is not None else dummy, w2 if w2 is not None else dummy,
        b2 if b2 is not None else dummy, o_cmp, o_sel, o_win, out, gates,
        *gate_in.stride(), *_weight_strides(w1, w2),
        *o_cmp.stride(), *o_sel.stride(), *o_win.stride(), *out.stride(),
        d["N_ROWS"], d["S"], d["R"],
        M=d["M"], DIN=d["DIN"], DH=d["DH"], NI=d["NI"], REP=d["REP"], HPR=d["HPR"], DV=d["DV"], DH_P=T["DH_P"],
        DV_P=T["DV_P"], HIDDEN=w1 is not None, LOGITS=w2 is None, HAS_B1=b1 is not None, HAS_B2=b2 is not None,
        ACT=_ACT[activation], SOFTMAX=normalize == "softmax", PREC=_dot_precision(gate_in.dtype),
        UPCAST=upcast_dots(gate_in.dtype), CHUNKS=chunks, **cfg,
    )  # fmt: skip
    return out, gates


def combine_backward(grad_o, gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, gates, activation: str,
                     normalize: str, *, tiles: dict | None = None):
    """(d_gate_in, d_w1, d_b1, d_w2, d_b2, d_cmp, d_sel, d_win) like the reference backend's,
    from the forward's gates. `tiles`: an override of `_tiles`."""
    _require(gate_in, w1, w2, o_cmp, activation)
    d = _dims(gate_in, w1, w2, o_cmp)
    dev = o_cmp.device
    hidden = w1 is not None
    d_branches = [torch.empty(d["B"], d["S"], d["H"], d["DV"], dtype=o_cmp.dtype, device=dev) for _ in range(3)]
    T = _tiles(d, hidden, gate_in.dtype == torch.float32, tiles)
    # the logit gradient [rows, NI, 3] (3 * NI floats a row: about 1% of the bytes the kernels move)
    dz = torch.empty(d["N_ROWS"], d["NI"], 3, dtype=torch.float32, device=dev)
    gates = gates.contiguous()
    cfg = T["bwd"]
    if d["N_ROWS"]:
        bwd_kernel[(_cdiv(d["N_ROWS"], cfg["ROWS"]), _cdiv(d["NI"], cfg["NB"]))](
            grad_o, o_cmp, o_sel, o_win, gates, *d_branches, dz,
            *grad_o.stride(), *o_cmp.stride(), *o_sel.stride(), *o_win.stride(), *d_branches[0].stride(),
            d["N_ROWS"], d["S"], d["R"],
            NI=d["NI"], REP=d["REP"], HPR=d["HPR"], DV=d["DV"], DV_P=T["DV_P"], SOFTMAX=normalize == "softmax",
            **cfg,
        )  # fmt: skip
    if hidden:
        return (*_mlp_backward(dz, gate_in, w1, b1, w2, b2, activation, d, T), *d_branches)
    if w2 is None:  # the gate input is the logits
        d_gin = dz.view(gate_in.shape).to(gate_in.dtype)
        return (d_gin, _empty(gate_in), _empty(gate_in), _empty(gate_in), _empty(gate_in), *d_branches)
    # a single Linear: two GEMMs from the logit gradient, in the gate input's dtype (tensor cores)
    ct = gate_in.dtype if gate_in.dtype in (torch.float16, torch.bfloat16) else torch.float32
    dz2 = dz.view(d["N_ROWS"], 3 * d["NI"])
    u = (gate_in.mean(3) if d["M"] > 1 else gate_in[:, :, :, 0]).reshape(d["N_ROWS"], d["DIN"]).to(ct)
    dzc = dz2.to(ct)
    du = (dzc @ w2.to(ct)).view(d["B"], d["S"], d["R"], 1, d["DIN"])  # the GEMM writes d gate_in (m = 1)
    if d["M"] > 1:  # the mean's gradient, to each of its m vectors
        du = (du / d["M"]).expand(gate_in.shape).contiguous()
    d_w2 = (dzc.t() @ u).to(w2.dtype)
    d_b2 = dz2.sum(0).to(b2.dtype) if b2 is not None else _empty(gate_in)
    return (du.to(gate_in.dtype), _empty(gate_in), _empty(gate_in), d_w2, d_b2, *d_branches)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The gradient of an absent weight: a new empty tensor each (op outputs must not alias)."""
    return like.new_empty((0,))


def _mlp_backward(dz, gate_in, w1, b1, w2, b2, activation, d, T):
    """d_gate_in, d_w1, d_b1, d_w2, d_b2 through a hidden-layer gate, from the logit gradient:
    one persistent kernel, fp32 partials per program summed here in a fixed order."""
    dev = gate_in.device
    cfg = {k: v for k, v in T["mlp"].items() if k != "PER_SM"}
    n_tiles = _cdiv(d["N_ROWS"], cfg["ROWS"])
    P = max(1, min(n_tiles, _programs(dev, T["mlp"]["PER_SM"])))
    # every program writes its partials (P <= n_tiles), and the tiles cover every d_gate_in element
    new = torch.empty if n_tiles else torch.zeros
    f32 = dict(dtype=torch.float32, device=dev)
    pw1, pb1 = new(P, d["DH"], d["DIN"], **f32), new(P, d["DH"], **f32)
    pw2, pb2 = new(P, 3, d["NI"], d["DH"], **f32), new(P, 3, d["NI"], **f32)
    d_gin = torch.empty(gate_in.shape, dtype=gate_in.dtype, device=dev)
    if n_tiles:
        mlp_bwd_kernel[(P,)](
            dz, gate_in, w1, b1 if b1 is not None else w1, w2, d_gin, pw1, pb1, pw2, pb2,
            *gate_in.stride(), *w1.stride(), *w2.stride(), *d_gin.stride(),
            d["N_ROWS"], d["S"], d["R"], n_tiles,
            M=d["M"], DIN=d["DIN"], DH=d["DH"], NI=d["NI"], DIN_P=T["DIN_P"], DH_P=T["DH_P"],
            HAS_B1=b1 is not None, ACT=_ACT[activation], PREC=_dot_precision(gate_in.dtype),
            UPCAST=upcast_dots(gate_in.dtype), **cfg,
        )  # fmt: skip
    d_w1 = pw1.sum(0).to(w1.dtype)
    d_b1 = pb1.sum(0).to(b1.dtype) if b1 is not None else _empty(gate_in)
    d_w2 = pw2.sum(0).transpose(0, 1).reshape(3 * d["NI"], d["DH"]).to(w2.dtype)  # row i * 3 + c
    d_b2 = pb2.sum(0).t().reshape(3 * d["NI"]).to(b2.dtype) if b2 is not None else _empty(gate_in)
    return d_gin, d_w1, d_b1, d_w2, d_b2
