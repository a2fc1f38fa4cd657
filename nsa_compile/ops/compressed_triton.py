"""Triton kernels for NSA compressed attention (section 2), flash-style, forward and backward.

    o, lse = compressed_forward(q, k, v, block, stride, scale, pos=None)
    dq, dk, dv = compressed_backward(grad_o, q, k, v, o, lse, block, stride, scale, pos=None)
    why = unsupported_reason(q, k, v, block, stride, pos=None)        # None when the kernels can run
    slot, lo, hi, count, end = document_slots(pos, Tc, block, stride, ends=False)   # packed: compact blocks

Same semantics as the `reference` backend of `nsa::compressed_attention` (nsa_compile/ops/compressed.py):
q [B, H, S, Dk], k [B, G, Tc, Dk], v [B, G, Tc, Dv], H = G * h; query t of head j sees the
compression tokens i of KV head j // h with i * stride + block - 1 <= t (without pos block may be
< 1: memory slots, columns seen from t = 0; the dk/dv kernel then clamps its first query at 0,
EARLY, a constexpr the default path does not compile). o [B, H, S, Dv] in v's
dtype, lse [B, H, S] float32 (natural log; -inf on a row without a visible block, whose output
and gradients are 0). Strides are passed to the kernels: q, k, v, grad_o may be any strided
views; o and dq are allocated as [B, S, H, D] memory, dk and dv as [B, Tc, G, D] memory (the
layouts the op's fakes promise).

Numerics: the score of (t, i) is the eager one, bit for bit where the dot products agree:
q @ k^T accumulates in fp32, is rounded to q's dtype (as the eager bf16/fp16 matmul rounds its
output) and back, then multiplied by scale in fp32. So lse is the log-sum-exp of exactly the
eager scores, and a consumer can rebuild p = exp(score - lse) (the block selection does). The
softmax runs in fp32 with an online max (exp2 of score * log2(e)); p is cast to v's dtype for
p @ v. Backward: the flash-attention formulas with delta = rowsum(dO * O) in fp32, ds * scale
rounded to q's dtype before its dots (as the eager `da`). fp32 inputs use IEEE dots (no TF32).
No atomics anywhere: every kernel is deterministic.

Rows are (query, head) pairs: pair id = t * h + r for head r of the group, query-major. One
program takes ROWS consecutive pairs of one (batch, group): ROWS / h queries with all h heads of
the group, so each K/V tile it loads serves the whole group (GQA-native; no padding row for
h = 6 except at the sequence's end). The queries of a tile span [t_min, t_max]: compression
tokens < n_full (visible to t_min) need no mask, tokens in [n_full, n_vis) (n_vis visible to
t_max) are the diagonal, masked, and tokens >= n_vis are never loaded.

Packed documents (pos [B, S] int64, each token's position in its document; k and v hold a slot
per token, Tc = S - block + 1; the visibility is compressed.py's): `document_slots` lists each
row's blocks (the slots that start a block of their document, in token order) as compact slots
0 .. count - 1, on the device with torch ops (a cumsum, searchsorted and gathers: no host sync, no
data-dependent shape). Query t sees exactly the compact slots [lo[t], hi[t]): those from its
document's first block to the last block that ends by t. The kernels then run on compact slots
in place of compression tokens, reading k, v (and writing dk, dv) at the tokens where the slots
start; a HAS_POS constexpr (None pointers without pos) compiles the code without pos exactly as
before. The forward's and dq's tiles read the slots [min lo, max hi) of their rows: unmasked
where all rows are in one document and see whole BLOCK_N tiles, else masked by each row's
[lo, hi); so a query reads only its document's blocks (about S / stride per row, as unpacked),
not Tc ~ S slots. dk/dv: a program holds BLOCK_N compact slots, seen by the queries
[slot + block - 1, end of its document); the queries after its last slot see all of it when
it lies in one document (unmasked), the others are masked. Its work items are planned on the
host from shapes alone, for at most S // min(block, stride) compact slots a row (a document of
n >= block tokens holds (n - block) // stride + 1 blocks) with compact slot c starting at token
>= c * min(block, stride); the segments of a tile past its real pairs find none. dk and dv
start at 0: the kernels write the blocks' slots only. This relies on pos counting up by one
inside each document (models.check_positions), as the op's docstring says.

Kernels (tile sizes from `_tiles`, overridable for tools/bench_compressed.py --tiles):
- forward, grid (ceil(S*h / ROWS), B*G): online softmax over tiles of BLOCK_N compression
  tokens; first the unmasked tiles, then the diagonal ones. Programs run in reverse sequence
  order (the last queries see the most tokens: the long programs start first).
- backward dq (+ delta), the same grid and loops: recomputes p from the saved lse, writes
  delta = rowsum(dO * O) for the dk/dv kernel and dq = sum_tiles (ds * scale) @ k.
- backward dk/dv, grid (work items, B*G): a program holds BLOCK_N compression tokens' K and V
  and walks the pairs that can see them (queries t >= i0 * stride + block - 1), first the
  diagonal (masked) pair tiles, then the rest unmasked. The early key tiles are seen by almost
  every query: a tile's pair range is cut into segments of SEGMENT pairs (a multiple of ROWS; on
  CUDA by default sized so that there are a few programs per SM), one work item each. A tile of
  one segment writes dk/dv directly; a tile of several writes fp32 partials that a second
  kernel sums in segment order (deterministic).

Supported (`unsupported_reason` says why not): CUDA tensors, or any device with TRITON_INTERPRET=1;
q, k, v all fp16, bf16 or fp32; head dims up to 256 (padded to a power of two >= 16 by
masking); any h >= 1, block >= 1, stride >= 1, Tc >= 0 (Tc = 0: zeros and -inf without a launch);
pos int64 [B, S] with Tc = S - block + 1 (any block and stride: block < stride too).

The tile loads, the online-softmax step and the backward's row statistics are attention_tiles'
helpers; the forward's and dq's two passes over the tokens (whole tiles, then the diagonal) and
dk/dv's over the pairs (diagonal, then the rest) are one loop body each, unrolled twice by
tl.static_range (the same code as two loops).

CPU interpreter: as nsa_compile/ops/selection_triton.py (module-level `triton_support.jit`
kernels built for the mode Triton is in when launched, bf16 dot operands cast to fp32 when
interpreted, reductions through tl.reduce). One more gap: the interpreter's fp32 -> bf16 cast
truncates, so interpreted kernels round to bf16 on the fp32 bits (`rounded`'s interpreted
stand-in `_rounded_interpreted`); without that the CPU tests could not check the score rounding.
The Triton 3.6 interpreter (the GPU image's) cannot run these kernels, nor selection_triton's:
computed loop bounds fail there; the tests pin Triton 3.9 (pyproject.toml). Compiled for sm_90,
both 3.6 and 3.9 build them.
"""

from __future__ import annotations

import functools

import torch

from .common import empty_attention_grads, empty_attention_outputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; unsupported_reason says why the kernels cannot run
    triton = tl = None

from .attention_tiles import (
    load_tile, row_delta, row_stats, softmax_finish, softmax_state, softmax_update, store_tile,
)
from .triton_support import (
    cdiv as _cdiv, device_reason, dot_precision as _dot_precision, jit, made_aside, next_pow2 as _next_pow2,
    qkv_reason, reduce_max, reduce_min, upcast_dots,
)

__all__ = ["compressed_backward", "compressed_forward", "unsupported_reason"]

MAX_HEAD_DIM = 256
# The dk/dv kernel's default segment on CUDA: enough work items for this many per SM.
ITEMS_PER_SM = 4
LOG2E = 1.4426950408889634


def unsupported_reason(q, k, v, block, stride, pos=None) -> str | None:
    """Why the Triton kernels cannot run these inputs, or None when they can (pos: packed
    documents, [B, S] int64, with k and v holding a slot per token)."""
    if why := device_reason(q, k, v, pos) or qkv_reason(q, k, v, MAX_HEAD_DIM):
        return why
    for name, value in (("block", block), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} {value!r} (needs an int)"
    # without pos block is the staircase's intercept, of any sign (ops/compressed.py: memory slots)
    if stride < 1 or (block < 1 and pos is not None) or block < -(2**30):
        return f"block {block!r}, stride {stride!r} (needs stride >= 1, block >= 1 with pos, block >= -2**30)"
    G = k.shape[1]
    if G >= 1 and q.shape[2] * (q.shape[1] // G) >= 2**31 - 2**20:
        return f"{q.shape[2]} queries x {q.shape[1] // G} heads per group (pair ids are int32)"
    if pos is not None:
        return packed_reason(q.shape[0], q.shape[2], k.shape[2], block, pos)
    return None


def packed_reason(B: int, S: int, Tc: int, block: int, pos) -> str | None:
    """Why `document_slots` cannot take this pos (None: it can): it must be int64 [B, S], and the
    keys must hold a slot per token (Tc = S - block + 1, 0 when S < block)."""
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) != (B, S):
        got = f"{pos.dtype} {list(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        return f"pos must be int64 [B, S] = [{B}, {S}], got {got}"
    if Tc != max(0, S - block + 1):
        return f"with pos the keys hold a slot per token: Tc must be S - block + 1 = {max(0, S - block + 1)}, got {Tc}"
    return None


def slot_capacity(S: int, Tc: int, block: int, stride: int) -> int:
    """The most compact slots (`document_slots`) a row of S tokens can hold: a document of n >= l
    tokens has (n - l) // d + 1 <= n / min(l, d) blocks (l = block, d = stride), so a row has at
    most S // min(l, d) (and at most Tc). No assumption l >= d: min(l, d) covers both."""
    return min(Tc, S // min(block, stride))


def document_slots(pos: torch.Tensor, Tc: int, block: int, stride: int, ends: bool = False):
    """The packed compression slots in compact form, built on pos's device with no host sync.

    pos [B, S] int64 counts up by one inside each document from 0 at its start (what
    models.check_positions accepts; the model checks it once per forward). Slot s pools tokens
    [s, s + block); it is a block of its document when pos[s] % stride == 0 and its tokens lie in
    that document. A row's blocks, in token order, are its compact slots 0, 1, ..., count - 1:
    the i-th block of a document is compact slot (its first block's) + i, at document position
    i * stride. Returns
        slot   [B, Tc] int32   the token where compact slot c starts (c < count; Tc - 1 past it)
        lo, hi [B, S] int32    query t sees exactly the compact slots [lo[t], hi[t]): those that
                               start in its document (>= t - pos[t]) and end by t (start + block
                               - 1 <= t), the op's visibility; none where hi <= lo. lo[t] is its
                               document's first block.
        count  [B] int32       blocks per row (<= slot_capacity)
        end    [B, Tc] int32   with `ends`: the token after compact slot c's document, so c is
                               seen by the queries [slot[c] + block - 1, end[c]) (else None)
    """
    B, S = pos.shape
    dev = pos.device
    first = pos[:, :Tc]  # [B, Tc]: each slot's first token's document position
    is_block = (first % stride == 0) & (pos[:, block - 1 : block - 1 + Tc] == first + block - 1)
    upto = is_block.cumsum(1, dtype=torch.int32)  # [B, Tc]: blocks starting at or before s
    before = torch.nn.functional.pad(upto, (1, 0))  # [B, Tc + 1]: blocks starting before token u
    rank = torch.arange(1, Tc + 1, device=dev, dtype=torch.int32).expand(B, Tc).contiguous()
    slot = torch.searchsorted(upto, rank, out_int32=True).clamp_(max=max(Tc - 1, 0))  # the rank-th block
    t = torch.arange(S, device=dev)
    doc_start = t - pos  # [B, S]
    lo = before.gather(1, doc_start.clamp(0, Tc))
    hi = before.gather(1, (t - block + 2).clamp(0, Tc).expand(B, S))
    end = torch.searchsorted(doc_start, slot.long(), right=True, out_int32=True) if ends else None
    return slot, lo, hi, before[:, Tc].contiguous(), end


def _tiles(Dk: int, Dv: int, fp32: bool = False, override: dict | None = None, packed: bool = False) -> dict:
    """Tile sizes and warps per kernel ("fwd", "dq", "dkdv", "reduce"). ROWS: (query, head) pairs
    per tile; BLOCK_N: compression tokens per tile; both powers of two >= 16 (tl.dot). num_warps
    and num_stages are Triton's launch options. "dkdv" may also take SEGMENT (pairs per dk/dv work
    item, rounded up to a multiple of ROWS; unset: `_segment`'s choice).

    `override` ({kernel: {parameter: value}}, e.g. {"fwd": {"ROWS": 64, "num_warps": 4}}) replaces
    single entries: tools/bench_compressed.py --tiles sweeps them on the GPU. The defaults: sizes
    that compile for sm_90 without register spills in bf16/fp16 at D 64, 128 and 256 (ptxas
    resource usage of kernels compiled without a GPU, Triton 3.9, unit head-dim strides; fp32's
    dk/dv kernel spills a little at D 128); the dk/dv tile was then tuned by timing (below).
    `packed` (pos given): the dk/dv tile of compact slots at D <= 64 is 32 wide with 4 warps.
    A tile of 64 compact slots mostly straddles two documents (the seed's 2,048-token documents
    hold 127 blocks each: 31 of 64 tiles), walks the second document's queries for its one slot
    there and runs masked; 32-wide tiles walk about a third less (rows x columns). dk/dv kernel
    on one row of 65,536 tokens in documents of 2,048, seed heads, bf16, H200 (.gpu scratch,
    session 24): 0.350 ms -> 0.308 (8 warps at 32 wide: 0.424; unpacked batch: 0.193)."""
    DK_P, DV_P = max(16, _next_pow2(Dk)), max(16, _next_pow2(Dv))
    D_P = max(DK_P, DV_P)
    tiles = {"DK_P": DK_P, "DV_P": DV_P, "reduce": {"BLOCK_N": 16, "num_warps": 4}}
    if fp32:  # IEEE dots without tensor cores: small tiles (the dk/dv kernel still spills a little)
        tiles |= {
            "fwd": {"ROWS": 32, "BLOCK_N": 16, "num_warps": 8},
            "dq": {"ROWS": 32, "BLOCK_N": 16, "num_warps": 8},
            "dkdv": {"ROWS": 16, "BLOCK_N": 16, "num_warps": 8},
        }
    elif D_P <= 128:
        tiles |= {
            "fwd": {"ROWS": 128, "BLOCK_N": 64, "num_warps": 8 if D_P > 64 else 4, "num_stages": 2},
            "dq": {"ROWS": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
            # timed on an H200 (tools/bench_compressed.py --tiles, 2026-11-26): ROWS 32 -> 128
            # took the paper shape at 64k from 103 to 66 ms fwd+bwd and seed 16k from 1.26 to
            # 0.70 ms (with 3 stages; at D 128 three stages exceed shared memory)
            "dkdv": {"ROWS": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2 if D_P > 64 else 3},
        }
        if packed and D_P <= 64:
            tiles["dkdv"] = tiles["dkdv"] | {"BLOCK_N": 32, "num_warps": 4}
    else:
        tiles |= {
            "fwd": {"ROWS": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
            "dq": {"ROWS": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
            "dkdv": {"ROWS": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
        }
    for kernel, params in (override or {}).items():
        if kernel not in ("fwd", "dq", "dkdv", "reduce"):
            raise ValueError(f"_tiles: unknown kernel {kernel!r} in override (fwd, dq, dkdv, reduce)")
        tiles[kernel] = tiles[kernel] | params
    return tiles


def _launch_options(cfg: dict) -> dict:
    """The kernel's tile parameters and Triton's launch options (not SEGMENT: a host-side value)."""
    return {name: value for name, value in cfg.items() if name != "SEGMENT"}


def _rounded_interpreted(x, dtype):
    """`rounded` for Triton's interpreter, whose fp32 -> bf16 cast truncates (and whose 'rtne'
    mode does not carry into the exponent): bf16 is rounded on the fp32 bits instead (round to
    nearest even; the values here are finite). fp16 casts go through numpy: exact."""
    if dtype != tl.bfloat16:
        return x.to(dtype).to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@jit(interpreted=_rounded_interpreted)
def rounded(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to DTYPE (round to nearest even), as fp32."""
    return x.to(DTYPE).to(tl.float32)


@jit
def _score(q, k, scale, DTYPE: tl.constexpr, PREC: tl.constexpr):
    """The eager score [ROWS, BLOCK_N]: q @ k^T rounded to q's dtype DTYPE, then scaled in fp32."""
    return rounded(tl.dot(q, tl.trans(k), input_precision=PREC), DTYPE) * scale


@jit
def _dot_operand(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """x (fp32) as a tl.dot operand of DTYPE: cast; with UPCAST (interpreted bf16) rounded to
    DTYPE but kept fp32."""
    return rounded(x, DTYPE) if UPCAST else x.to(DTYPE)


@jit
def _pair_tile(N_TILES, G, S, TC, BLK, STRIDE, HPG: tl.constexpr, ROWS: tl.constexpr):
    """The forward's and dq's program: ROWS (query, head) pairs of one (batch, group), the last
    queries (most tokens) first. Returns b (int64), g, row_ok, tq (query token), head (int64)
    [ROWS] each, and the tile's compression tokens: those < n_full are visible to every row,
    those >= n_vis to none."""
    tile = N_TILES - 1 - tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    n_pairs = S * HPG
    p0 = tile * ROWS
    pr = p0 + tl.arange(0, ROWS)  # [ROWS] (query, head) pairs, query-major
    row_ok = pr < n_pairs
    tq = pr // HPG  # [ROWS] query token
    head = (g * HPG + pr % HPG).to(tl.int64)
    t_min = p0 // HPG
    t_max = (tl.minimum(p0 + ROWS, n_pairs) - 1) // HPG  # the tile's last query
    # query t sees (t - BLK + 1) // STRIDE + 1 tokens when t >= BLK - 1, else none (written
    # without a branch and without dividing a negative number)
    n_full = tl.minimum(tl.maximum(t_min - BLK + 1 + STRIDE, 0) // STRIDE, TC)
    n_vis = tl.minimum(tl.maximum(t_max - BLK + 1 + STRIDE, 0) // STRIDE, TC)
    return b, g, row_ok, tq, head, n_full, n_vis


@jit
def _document_range(LO, HI, b, S, tq, row_ok, BLOCK_N: tl.constexpr):
    """Packed documents: the forward's and dq's tile of rows (queries tq [ROWS], b int64) sees
    compact slots (`document_slots`). Returns each row's range lo, hi [ROWS] (nothing past the
    sequence's end: lo = hi = 0) and the tile's loop bounds: it reads the slots [c_start, n_vis),
    those in [c_start, full_end) (whole BLOCK_N tiles) visible to every row: only where all its
    rows are in one document (one lo), else full_end = c_start and every tile is masked."""
    lo = tl.load(LO + b * S + tq, mask=row_ok, other=0)
    hi = tl.load(HI + b * S + tq, mask=row_ok, other=0)
    c_start = reduce_min(tl.where(row_ok, lo, 2147483647), 0)
    one_doc = c_start == reduce_max(lo, 0)
    whole = tl.maximum(reduce_min(tl.where(row_ok, hi, 2147483647), 0) - c_start, 0) // BLOCK_N
    full_end = c_start + tl.where(one_doc, whole, 0) * BLOCK_N
    return lo, hi, c_start, full_end, reduce_max(hi, 0)


@jit
def _slot_rows(SLOT, b, TC, c, c_ok):
    """Packed documents: the rows of k and v (int64 [BLOCK_N]) that compact slots c read, the
    tokens where they start (`document_slots`' slot; c_ok None: every c is below the count)."""
    if c_ok is None:
        token = tl.load(SLOT + b * TC + c)
    else:
        token = tl.load(SLOT + b * TC + c, mask=c_ok, other=0)
    return token.to(tl.int64)


@jit
def fwd_kernel(
    Q, K, V, O, LSE, SLOT, LO, HI,
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sob, soh, sos, sod,
    S, G, TC, BLK, STRIDE, scale, N_TILES,
    HPG: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    b, g, row_ok, tq, head, n_full, n_vis = _pair_tile(N_TILES, G, S, TC, BLK, STRIDE, HPG, ROWS)
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    dk_ok = dk < DK
    dv_ok = dv < DV
    tq64 = tq.to(tl.int64)
    q = load_tile(Q + b * sqb + head[:, None] * sqh, tq64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [ROWS, DK_P]
    k_base = K + b * skb + g.to(tl.int64) * skg
    v_base = V + b * svb + g.to(tl.int64) * svg
    cols = tl.arange(0, BLOCK_N)

    m_i, l_i, acc = softmax_state(ROWS, DV_P)
    if HAS_POS:  # compact slots [c_start, n_vis), row t's [lo, hi)
        lo, hi, c_start, full_end, n_vis = _document_range(LO, HI, b, S, tq, row_ok, BLOCK_N)
    else:
        c_start = 0
        full_end = (n_full // BLOCK_N) * BLOCK_N
    # two passes over the tokens: first the tiles every row sees whole, [c_start, full_end), then
    # the diagonal, [full_end, n_vis), with the staircase mask (with pos, each row's range)
    for diagonal in tl.static_range(2):
        for c0 in range(full_end if diagonal else c_start, n_vis if diagonal else full_end, BLOCK_N):
            c = c0 + cols
            c_ok = c < n_vis
            if HAS_POS:
                c64 = _slot_rows(SLOT, b, TC, c, c_ok if diagonal else None)
            else:
                c64 = c.to(tl.int64)
            k = load_tile(k_base, c64, dk, sks, skd, c_ok if diagonal else None, dk_ok, UPCAST)  # [BLOCK_N, DK_P]
            v = load_tile(v_base, c64, dv, svs, svd, c_ok if diagonal else None, dv_ok, UPCAST)  # [BLOCK_N, DV_P]
            s = _score(q, k, scale, Q.dtype.element_ty, PREC)
            if diagonal:
                if HAS_POS:
                    visible = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
                else:
                    visible = c_ok[None, :] & (c[None, :] * STRIDE + BLK - 1 <= tq[:, None])
                s2 = tl.where(visible, s * 1.4426950408889634, float("-inf"))
            else:
                s2 = s * 1.4426950408889634  # [ROWS, BLOCK_N], log2 units
            m_new, alpha, p, l_i = softmax_update(m_i, l_i, s2, None)  # p 0 where invisible
            pv = _dot_operand(p, V.dtype.element_ty, UPCAST)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PREC)
            m_i = m_new

    o, lse = softmax_finish(acc, m_i, l_i)  # a row without a visible token: o 0, lse -inf
    store_tile(O + b * sob + head[:, None] * soh, tq64, dv, sos, sod, o, row_ok, dv_ok)
    tl.store(LSE + (b * G * HPG + head) * S + tq64, lse, mask=row_ok)


@jit
def dq_kernel(
    Q, K, V, DO, O, LSE, DELTA, DQ, SLOT, LO, HI,
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd,
    sdob, sdoh, sdos, sdod, sob, soh, sos, sod, sdqb, sdqh, sdqs, sdqd,
    S, G, TC, BLK, STRIDE, scale, N_TILES,
    HPG: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    b, g, row_ok, tq, head, n_full, n_vis = _pair_tile(N_TILES, G, S, TC, BLK, STRIDE, HPG, ROWS)
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    dk_ok = dk < DK
    dv_ok = dv < DV
    tq64 = tq.to(tl.int64)
    q = load_tile(Q + b * sqb + head[:, None] * sqh, tq64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [ROWS, DK_P]
    do = load_tile(DO + b * sdob + head[:, None] * sdoh, tq64, dv, sdos, sdod, row_ok, dv_ok, UPCAST)  # [ROWS, DV_P]
    o = load_tile(O + b * sob + head[:, None] * soh, tq64, dv, sos, sod, row_ok, dv_ok, False)
    delta = row_delta(do, o)  # [ROWS]
    row_lin = (b * G * HPG + head) * S + tq64
    tl.store(DELTA + row_lin, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_lin, mask=row_ok, other=0.0) * 1.4426950408889634

    k_base = K + b * skb + g.to(tl.int64) * skg
    v_base = V + b * svb + g.to(tl.int64) * svg
    cols = tl.arange(0, BLOCK_N)
    acc = tl.full([ROWS, DK_P], 0.0, tl.float32)
    if HAS_POS:
        lo, hi, c_start, full_end, n_vis = _document_range(LO, HI, b, S, tq, row_ok, BLOCK_N)
    else:
        c_start = 0
        full_end = (n_full // BLOCK_N) * BLOCK_N
    # the forward's two passes; rows without a visible token never reach the first (their lse
    # is -inf) and get p = 0 in the second
    for diagonal in tl.static_range(2):
        for c0 in range(full_end if diagonal else c_start, n_vis if diagonal else full_end, BLOCK_N):
            c = c0 + cols
            c_ok = c < n_vis
            if HAS_POS:
                c64 = _slot_rows(SLOT, b, TC, c, c_ok if diagonal else None)
            else:
                c64 = c.to(tl.int64)
            k = load_tile(k_base, c64, dk, sks, skd, c_ok if diagonal else None, dk_ok, UPCAST)
            v = load_tile(v_base, c64, dv, svs, svd, c_ok if diagonal else None, dv_ok, UPCAST)
            s = _score(q, k, scale, Q.dtype.element_ty, PREC)
            if diagonal:
                if HAS_POS:  # rows past the sequence's end have lo = hi = 0
                    visible = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
                else:
                    visible = row_ok[:, None] & c_ok[None, :] & (c[None, :] * STRIDE + BLK - 1 <= tq[:, None])
                p = tl.where(visible, tl.exp2(s * 1.4426950408889634 - lse2[:, None]), 0.0)
            else:
                p = tl.exp2(s * 1.4426950408889634 - lse2[:, None])  # [ROWS, BLOCK_N]
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = _dot_operand(p * (dp - delta[:, None]) * scale, Q.dtype.element_ty, UPCAST)
            acc += tl.dot(ds, k, input_precision=PREC)
    store_tile(DQ + b * sdqb + head[:, None] * sdqh, tq64, dk, sdqs, sdqd, acc, row_ok, dk_ok)


@jit
def _pair_gradients(acc_k, acc_v, s, visible, lse2, delta, q, do, v, scale, QDT: tl.constexpr, DODT: tl.constexpr,
                    PREC: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """acc_k [BLOCK_N, DK_P] and acc_v [BLOCK_N, DV_P] plus one pair tile's share, from its
    scores s [ROWS, BLOCK_N]: p = exp(s - lse), 0 where not `visible` (None: visible everywhere),
    dv += p^T @ dO, ds = p * (dO @ v^T - delta) * scale, dk += ds^T @ q (p and ds rounded to the
    operands' dtypes QDT, DODT first, as the eager backward rounds them)."""
    if visible is None:
        p = tl.exp2(s * 1.4426950408889634 - lse2[:, None])
    else:
        p = tl.where(visible, tl.exp2(s * 1.4426950408889634 - lse2[:, None]), 0.0)  # [ROWS, BLOCK_N]
    pv = _dot_operand(p, DODT, UPCAST)
    acc_v += tl.dot(tl.trans(pv), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = _dot_operand(p * (dp - delta[:, None]) * scale, QDT, UPCAST)
    acc_k += tl.dot(tl.trans(ds), q, input_precision=PREC)
    return acc_k, acc_v


@jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, PK, PV, ITEM_TILE, ITEM_SEG, TILE_NSEG, SLOT, LO, HI, COUNT, END,
    sqb, sqh, sqs, sqd, skb, skg, sks, skd, svb, svg, svs, svd,
    sdob, sdoh, sdos, sdod, sdkb, sdkg, sdks, sdkd, sdvb, sdvg, sdvs, sdvd,
    S, G, TC, BLK, STRIDE, scale, SEG, N_ITEMS,
    HPG: tl.constexpr, DK_: tl.constexpr, DV_: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_POS: tl.constexpr,
    EARLY: tl.constexpr = False,
):  # fmt: skip
    item = tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // G).to(tl.int64)
    g = bg % G
    tile = tl.load(ITEM_TILE + item)
    seg = tl.load(ITEM_SEG + item)
    nseg = tl.load(TILE_NSEG + tile)
    n_pairs = S * HPG
    c0 = tile * BLOCK_N
    c = c0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] compression tokens (with pos: compact slots)
    if HAS_POS:
        # the tile's slots start at tokens s_first .. s_last; slot c is seen by the queries
        # [slot + BLK - 1, end of its document): pairs [p_lo, p_end) see some slot of the tile,
        # pairs >= p_full all of them where the tile lies in one document (else none does)
        n_cols = tl.load(COUNT + b)
        c_ok = c < n_cols
        c_last = tl.minimum(c0 + BLOCK_N, n_cols) - 1
        tile_ok = c0 < n_cols
        s_first = tl.load(SLOT + b * TC + c0, mask=tile_ok, other=0)
        s_last = tl.load(SLOT + b * TC + c_last, mask=tile_ok, other=0)
        end_first = tl.load(END + b * TC + c0, mask=tile_ok, other=0)
        end_last = tl.load(END + b * TC + c_last, mask=tile_ok, other=0)
        p_lo = (s_first + BLK - 1) * HPG
        p_end = end_last * HPG
        p_full = tl.where(end_first == end_last, tl.minimum(s_last + BLK - 1, end_last), end_last) * HPG
    else:
        n_cols = TC
        c_ok = c < TC
        c_last = tl.minimum(c0 + BLOCK_N, TC) - 1
        # pairs [p_lo, n_pairs) see some token of the tile, pairs >= p_full see all of them
        p_lo = tl.minimum(c0 * STRIDE + BLK - 1, S) * HPG
        p_end = n_pairs
        p_full = tl.minimum(c_last * STRIDE + BLK - 1, S) * HPG
        if EARLY:  # block < 1 (memory slots): columns seen from before t = 0, by every query
            p_lo = tl.maximum(p_lo, 0)
            p_full = tl.maximum(p_full, 0)
    # the masked tiles end at p_mid, a whole number of ROWS after p_lo (as the segments are)
    p_mid = p_lo + (p_full - p_lo + ROWS - 1) // ROWS * ROWS
    a = p_lo + seg * SEG
    e = tl.minimum(a + SEG, p_end)

    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    dk_ok = dk < DK_
    dv_ok = dv < DV_
    if HAS_POS:  # the slots' rows of k, v, dk, dv
        c64 = tl.load(SLOT + b * TC + c, mask=c_ok, other=0).to(tl.int64)
    else:
        c64 = c.to(tl.int64)
    kmask = c_ok[:, None] & dk_ok[None, :]
    vmask = c_ok[:, None] & dv_ok[None, :]
    # written out, not load_tile: the helper moved ptxas's schedule of this kernel at D 64 (same
    # instructions); the schedule was not timed on the GPU, so the measured one stays
    k = tl.load(K + b * skb + g.to(tl.int64) * skg + c64[:, None] * sks + dk[None, :] * skd,
                mask=kmask, other=0.0)  # [BLOCK_N, DK_P]
    v = tl.load(V + b * svb + g.to(tl.int64) * svg + c64[:, None] * svs + dv[None, :] * svd,
                mask=vmask, other=0.0)  # [BLOCK_N, DV_P]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    acc_k = tl.full([BLOCK_N, DK_P], 0.0, tl.float32)
    acc_v = tl.full([BLOCK_N, DV_P], 0.0, tl.float32)
    rows = tl.arange(0, ROWS)
    # two passes over the item's pairs: first the diagonal pair tiles, [a, p_mid), with the
    # staircase mask (and rows past the end of the sequence); then the rest, which see every
    # token of the tile: no visibility mask (rows past the end load q = dO = 0 and add nothing;
    # columns past Tc are not stored)
    for full in tl.static_range(2):
        for r0 in range(tl.maximum(a, p_mid) if full else a, e if full else tl.minimum(e, p_mid), ROWS):
            pr = r0 + rows
            if HAS_POS:  # a tile may run past its document's end into the next one's queries
                row_ok = pr < e
            else:
                row_ok = pr < n_pairs
            tq = pr // HPG
            tq64 = tq.to(tl.int64)
            head = (g * HPG + pr % HPG).to(tl.int64)
            q = load_tile(Q + b * sqb + head[:, None] * sqh, tq64, dk, sqs, sqd, row_ok, dk_ok, UPCAST)  # [ROWS, DK_P]
            do = load_tile(DO + b * sdob + head[:, None] * sdoh, tq64, dv, sdos, sdod, row_ok, dv_ok, UPCAST)
            lse2, delta = row_stats(LSE, DELTA, (b * G * HPG + head) * S + tq64, row_ok)
            s = _score(q, k, scale, Q.dtype.element_ty, PREC)
            if full:
                visible = None
            elif HAS_POS:  # row t sees the compact slots [lo, hi) (rows past the end: none)
                lo = tl.load(LO + b * S + tq64, mask=row_ok, other=0)
                hi = tl.load(HI + b * S + tq64, mask=row_ok, other=0)
                visible = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
            else:
                visible = row_ok[:, None] & c_ok[None, :] & (c[None, :] * STRIDE + BLK - 1 <= tq[:, None])
            acc_k, acc_v = _pair_gradients(acc_k, acc_v, s, visible, lse2, delta, q, do, v, scale, Q.dtype.element_ty,
                                           DO.dtype.element_ty, PREC, UPCAST)

    # one segment: the final value; several: an fp32 partial per item, summed by reduce_kernel
    # (the scalar conditions become column limits: block masks only)
    direct = (c < tl.where(nseg == 1, n_cols, 0))[:, None]
    split = (c < tl.where(nseg > 1, n_cols, 0))[:, None]
    tl.store(DK + b * sdkb + g.to(tl.int64) * sdkg + c64[:, None] * sdks + dk[None, :] * sdkd,
             acc_k.to(DK.dtype.element_ty), mask=kmask & direct)
    tl.store(DV + b * sdvb + g.to(tl.int64) * sdvg + c64[:, None] * sdvs + dv[None, :] * sdvd,
             acc_v.to(DV.dtype.element_ty), mask=vmask & direct)
    # partials [B*G, items, BLOCK_N, D]
    slot = (bg.to(tl.int64) * N_ITEMS + item) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    tl.store(PK + slot[:, None] * DK_ + dk[None, :], acc_k, mask=kmask & split)
    tl.store(PV + slot[:, None] * DV_ + dv[None, :], acc_v, mask=vmask & split)


@jit
def reduce_kernel(
    PK, PV, DK, DV, TILE_NSEG, TILE_FIRST, SLOT, COUNT,
    sdkb, sdkg, sdks, sdkd, sdvb, sdvg, sdvs, sdvd,
    G, TC, N_ITEMS,
    DK_: tl.constexpr, DV_: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    # program (tile, chunk of BLOCK_N of its TILE_N tokens, batch*group)
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    bg = tl.program_id(2)
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)
    nseg = tl.load(TILE_NSEG + tile)
    first = tl.load(TILE_FIRST + tile).to(tl.int64)
    j = chunk * BLOCK_N + tl.arange(0, BLOCK_N)  # offset in the tile
    c = tile * TILE_N + j
    if HAS_POS:  # compact slots below the row's count, stored at the tokens where they start
        c_ok = (j < TILE_N) & (c < tl.load(COUNT + b))
        c64 = tl.load(SLOT + b * TC + c, mask=c_ok, other=0).to(tl.int64)
    else:
        c_ok = (j < TILE_N) & (c < TC)
        c64 = c.to(tl.int64)
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    kmask = c_ok[:, None] & (dk < DK_)[None, :]
    vmask = c_ok[:, None] & (dv < DV_)[None, :]
    acc_k = tl.full([BLOCK_N, DK_P], 0.0, tl.float32)
    acc_v = tl.full([BLOCK_N, DV_P], 0.0, tl.float32)
    # in segment order: deterministic (a one-item tile reads a slot it never wrote, and
    # stores nothing: `split` below)
    for i in range(nseg):
        slot = (bg.to(tl.int64) * N_ITEMS + first + i) * TILE_N + j.to(tl.int64)
        acc_k += tl.load(PK + slot[:, None] * DK_ + dk[None, :], mask=kmask, other=0.0)
        acc_v += tl.load(PV + slot[:, None] * DV_ + dv[None, :], mask=vmask, other=0.0)
    split = (j < tl.where(nseg > 1, TILE_N, 0))[:, None]
    tl.store(DK + b * sdkb + g * sdkg + c64[:, None] * sdks + dk[None, :] * sdkd,
             acc_k.to(DK.dtype.element_ty), mask=kmask & split)
    tl.store(DV + b * sdvb + g * sdvg + c64[:, None] * sdvs + dv[None, :] * sdvd,
             acc_v.to(DV.dtype.element_ty), mask=vmask & split)


def _require(q, k, v, block, stride, pos=None) -> None:
    why = unsupported_reason(q, k, v, block, stride, pos)
    if why is not None:
        raise ValueError(f"compressed_attention (triton): cannot run these inputs: {why}")


def compressed_forward(q, k, v, block: int, stride: int, scale: float, pos=None, *, tiles: dict | None = None):
    """o [B, H, S, Dv] (v's dtype) and lse [B, H, S] float32 (natural log, -inf on empty rows).
    pos: packed documents ([B, S] int64; k and v then hold a slot per token). `tiles`: an
    override of `_tiles` (tools/bench_compressed.py); None, the default tiles."""
    _require(q, k, v, block, stride, pos)
    B, H, S, Dk = q.shape
    G, Tc, Dv = k.shape[1], k.shape[2], v.shape[3]
    h = H // G
    o, lse = empty_attention_outputs(q, v)  # the op's output layout: [B, S, H, Dv] memory
    if B * H * S == 0:
        return o, lse
    if Tc == 0:  # no query sees a block (S < block)
        return o.zero_(), lse.fill_(float("-inf"))
    # with pos: the compact slots and each query's range of them (None: the no-pos kernel)
    slot, lo, hi, _, _ = (None,) * 5 if pos is None else document_slots(pos, Tc, block, stride)
    T = _tiles(Dk, Dv, q.dtype == torch.float32, tiles)
    cfg = T["fwd"]
    n_tiles = _cdiv(S * h, cfg["ROWS"])
    fwd_kernel[(n_tiles, B * G)](
        q, k, v, o, lse, slot, lo, hi,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        S, G, Tc, block, stride, scale, n_tiles,
        HPG=h, DK=Dk, DV=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"], PREC=_dot_precision(q.dtype),
        UPCAST=upcast_dots(q.dtype), HAS_POS=pos is not None, **_launch_options(cfg),
    )  # fmt: skip
    return o, lse


def _segment(S: int, h: int, Tc: int, block: int, stride: int, BG: int, cfg: dict, device) -> int:
    """Pairs per dk/dv work item, a multiple of ROWS: cfg["SEGMENT"] if given; on CUDA, the
    total pair work over ITEMS_PER_SM items per SM (at least 4 pair tiles per item); elsewhere
    (the interpreter) one item per key tile."""
    rows = cfg["ROWS"]
    n_pairs = S * h
    if cfg.get("SEGMENT") is not None:
        return max(rows, _cdiv(int(cfg["SEGMENT"]), rows) * rows)
    if device.type != "cuda":
        return max(rows, _cdiv(n_pairs, rows) * rows)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n_tiles = _cdiv(Tc, cfg["BLOCK_N"])
    work = sum(max(0, n_pairs - min(max(i * cfg["BLOCK_N"] * stride + block - 1, 0), S) * h) for i in range(n_tiles))
    per_item = _cdiv(work * BG, ITEMS_PER_SM * sms)
    return max(4 * rows, _cdiv(per_item, rows) * rows)


@functools.lru_cache(maxsize=64)
def _work_items(S: int, h: int, Tc: int, block: int, stride: int, block_n: int, segment: int, device):
    """The dk/dv work items, built on the host from the shapes alone (no device sync):
        item_tile, item_seg [U] int32: each item's key tile and segment, the heaviest tiles first
        tile_nseg, tile_first [n_tiles] int32: each tile's number of items (>= 1, so every tile is
                                              written) and its first item
    A tile i is seen by the pairs [min(max(i * block_n * stride + block - 1, 0), S) * h, S * h). Cached
    per shape and device (the tensors are only read), so a training step copies nothing."""
    n_pairs = S * h
    n_tiles = _cdiv(Tc, block_n)
    nseg = [max(1, _cdiv(n_pairs - min(max(i * block_n * stride + block - 1, 0), S) * h, segment))
            for i in range(n_tiles)]
    first = [0] * n_tiles
    for i in range(1, n_tiles):
        first[i] = first[i - 1] + nseg[i - 1]
    item_tile = [i for i in range(n_tiles) for _ in range(nseg[i])]
    item_seg = [s for i in range(n_tiles) for s in range(nseg[i])]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    # cached constants: made outside a CUDA graph's pool
    made = made_aside(lambda: (i32(item_tile), i32(item_seg), i32(nseg), i32(first)), device)
    return (*made, len(item_tile), max(nseg))


def compressed_backward(grad_o, q, k, v, o, lse, block: int, stride: int, scale: float, pos=None, *,
                        tiles: dict | None = None):  # fmt: skip
    """dq (like q, [B, S, H, Dk] memory), dk (like k), dv (like v): gradients of
    `compressed_forward`'s o, given its o and lse (pos: as there; dk and dv are 0 at the slots no
    query sees). dk/dv are summed over the group's heads in fp32 without atomics
    (deterministic). `tiles`: an override of `_tiles`."""
    _require(q, k, v, block, stride, pos)
    B, H, S, Dk = q.shape
    G, Tc, Dv = k.shape[1], k.shape[2], v.shape[3]
    h = H // G
    if grad_o.dtype != v.dtype:
        grad_o = grad_o.to(v.dtype)
    dq, dk, dv = empty_attention_grads(q, k, v)  # the op's layout: [B, S, heads, D] memory
    if B * H * S == 0 or Tc == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    T = _tiles(Dk, Dv, q.dtype == torch.float32, tiles, packed=pos is not None)
    prec, upcast = _dot_precision(q.dtype), upcast_dots(q.dtype)
    if pos is None:
        slot = lo = hi = count = end = None
        key_tiles, key_stride = Tc, stride
    else:  # the kernels write the blocks' dk, dv; every other slot's stays 0
        slot, lo, hi, count, end = document_slots(pos, Tc, block, stride, ends=True)
        dk.zero_()
        dv.zero_()
        # the dk/dv key tiles hold compact slots: at most slot_capacity of them, and compact slot
        # c starts at token >= c * min(l, d) (blocks of a document are d apart, the next
        # document's first block is l after its last one), so the work items planned for that
        # stride cover every tile's pairs
        key_tiles, key_stride = slot_capacity(S, Tc, block, stride), min(block, stride)

    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    n_tiles = _cdiv(S * h, T["dq"]["ROWS"])
    dq_kernel[(n_tiles, B * G)](
        q, k, v, grad_o, o, lse, delta, dq, slot, lo, hi,
        *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *o.stride(), *dq.stride(),
        S, G, Tc, block, stride, scale, n_tiles,
        HPG=h, DK=Dk, DV=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"], PREC=prec, UPCAST=upcast, HAS_POS=pos is not None,
        **_launch_options(T["dq"]),
    )  # fmt: skip

    cfg = T["dkdv"]
    segment = _segment(S, h, key_tiles, block, key_stride, B * G, cfg, q.device)
    item_tile, item_seg, tile_nseg, tile_first, n_items, max_seg = _work_items(
        S, h, key_tiles, block, key_stride, cfg["BLOCK_N"], segment, q.device
    )
    # fp32 partials only when some tile has several items
    part_rows = B * G * n_items * cfg["BLOCK_N"] if max_seg > 1 else 0
    pk = torch.empty(part_rows, Dk, dtype=torch.float32, device=q.device)
    pv = torch.empty(part_rows, Dv, dtype=torch.float32, device=q.device)
    dkdv_kernel[(n_items, B * G)](
        q, k, v, grad_o, lse, delta, dk, dv, pk, pv, item_tile, item_seg, tile_nseg, slot, lo, hi, count, end,
        *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *dk.stride(), *dv.stride(),
        S, G, Tc, block, stride, scale, segment, n_items,
        HPG=h, DK_=Dk, DV_=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"], PREC=prec, UPCAST=upcast, HAS_POS=pos is not None,
        EARLY=block < 1, **_launch_options(cfg),
    )  # fmt: skip
    if max_seg > 1:
        rcfg = T["reduce"]
        reduce_kernel[(_cdiv(key_tiles, cfg["BLOCK_N"]), _cdiv(cfg["BLOCK_N"], rcfg["BLOCK_N"]), B * G)](
            pk, pv, dk, dv, tile_nseg, tile_first, slot, count,
            *dk.stride(), *dv.stride(),
            G, Tc, n_items,
            DK_=Dk, DV_=Dv, DK_P=T["DK_P"], DV_P=T["DV_P"], TILE_N=cfg["BLOCK_N"], HAS_POS=pos is not None, **rcfg,
        )  # fmt: skip
    return dq, dk, dv
