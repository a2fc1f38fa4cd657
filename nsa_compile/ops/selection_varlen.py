"""The `varlen` backends of nsa::selected_attention: NSA selection through FlashAttention-2's
variable-length kernels, queries grouped by the KV block they chose, partial results merged by
log-sum-exp.

    o, lse = selected_forward(q, k, v, block_idx, block_size, scale, backend="varlen")
    dq, dk, dv = selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, backend="varlen")
    why = unsupported_reason(q, k, v, block_idx, block_size, backend="varlen")   # None when it can run

Same semantics as the `reference` backend (nsa_compile/ops/selection.py): q [B, H, S, Dk],
k [B, G, S, Dk], v [B, G, S, Dv], H = G * h, block_idx [B, G, S, n] int64 shared by a group's h
heads; query t sees the tokens <= t of its chosen blocks (entries < 0 ignored, duplicates count
twice); o [B, H, S, Dv] in v's dtype and lse [B, H, S] float32 (-inf, with output and gradients
0, on a row without a valid token). Outputs and gradients are laid out [B, S, heads, D] in
memory, the layout the op's fakes promise.

The algorithm. Each entry j of query t's list falls in one of three cases:
- j < 0 or j > t // l' (padding, a block after t, a block past the end): no token, skipped;
- j == t // l', the current block: its tokens j*l' .. t. Every query's current block is handled
  by one causal FA-2 call over all of q, K, V (GQA-native) whose varlen segments are the
  selection blocks themselves: segment i holds the queries AND the keys of block i, so every
  segment has as many queries as keys and the causal mask of FA-2 lets query t see exactly
  j*l' .. t. (FA-2 aligns a causal mask to the bottom right, SDPA to the top left: they differ
  only when a segment has fewer queries than keys, never here; NSA_SEMANTICS.md section 8 is
  the trap of a single query row in a causal call.) A query that lists its current block c
  times gets the call's log-sum-exp + log c (c = 0: -inf, no contribution);
- j < t // l', an earlier block: all l' of its tokens, no mask. Per KV group g, the (query, head)
  rows of the entries that chose block j form one varlen segment over the l' keys of block j,
  which are contiguous in K: cu_seqlens_k cuts the [B * S] flattened tokens at the block
  boundaries (the same for every call), K and V of group g are passed as strided views
  ([B * S, 1, D], no copy), and cu_seqlens_q counts the packed rows per (batch, block). The
  query rows are gathered (index_select) into a packed [rows, 1, Dk] buffer: q is what is
  copied, not K or V. The group's h heads are folded into the rows (one KV head, one query
  head per call), so a segment has (queries that chose the block) * h rows for FA-2's tiles.
  One exception, for speed: a segment of more than SEGMENT_ROWS rows (block 0, which every
  query chooses, has c * h of them) is cut into sub-segments of SEGMENT_ROWS rows, each over its
  own copy of the block's l' keys, in a second call (`_plan` says why: FA-2's grid is sized by
  the longest segment, and its backward walks a segment's rows in one program per key block).
  Those copies are at most 2 * l' / SEGMENT_ROWS key rows per packed query row (1/8 at l' = 64).
The partial results of a (query, head) row (its full blocks and its current block) are merged
in float32: lse = logsumexp(lse_i), o = sum_i exp(lse_i - lse) * o_i. Each partial o_i is
rounded to q's dtype by FA-2 before the merge.

Memory stays bounded: the queries are processed in chunks of c tokens per group, c chosen so
that a chunk has at most CHUNK_ROWS (entry, head) rows (B * c * n * h): the packed q, the FA-2
output and the dense float32 merge buffer of a chunk ([B * c * n, h, Dv], one slot per entry:
the merge reads no data-dependent order, so it is deterministic) are O(CHUNK_ROWS * D). The
current-block call's output and log-sum-exp ([B * S, H, Dv] and [H, B * S]) live through the
whole forward, the size of the op's own output. Never a packed copy of n * l' keys per query.
Host syncs: a few per (chunk, group) (the number of entries, the longest segment).

Backward, by the split-softmax identity: the gradient of the merged attention is the sum over the
partials of FA-2's own backward, each given the FINAL o and lse of the row (P = exp(s - lse) is
then the row's final probability restricted to the partial's keys, and D = rowsum(dO * o) the
final one). So each FA-2 backward call gets the gathered dO, o and lse rows; the current-block
call gets lse - log c (+inf where c = 0: P = 0, the convention FA-2 itself uses for empty rows).
dq of the packed rows is summed per query in float32 (the same dense slots as the forward); dk
and dv come out per call over the whole of K and V (zero outside the call's segments: FA-2
writes zeros for a key block no query reads), or over the copied blocks of split segments
(index_add back to where they were copied from), and accumulate in float32, cast once at the
end. FA-2's backward accumulates dq with atomics, and so does index_add on CUDA: the backward
is not bitwise repeatable (the forward is).

The per-segment attention call is a parameter (`SegmentAttention`: forward and backward with
the conventions of `aten._flash_attention_forward/_backward` in varlen form), so the whole
algorithm runs on the CPU in the tests with a PyTorch stand-in of the same signature. Two
implementations ship, one per backend name:
- `varlen`: PyTorch's own FA-2 kernels (`aten._flash_attention_forward/_backward`, the ops that
  nsa_compile/ops/flash.py wraps for the window op; its `unsupported_reason` decides what runs):
  CUDA, fp16/bf16, Dk == Dv (FA-2 has one head dim for q, k and v: Dk != Dv is refused), head
  dim a multiple of 8 and at most 256, and B * ceil(S / l') <= 65535 segments (FA-2's grid).
- `varlen_flash_attn`: the same algorithm through the flash-attn package's public
  `flash_attn_varlen_func` (opt-in: `OptimizeConfig(selected_attention_backend="varlen_flash_attn")`).
  NOT RUN on this project's machines: the package cannot be installed there (no wheels for the
  GPU image; source builds only). Its call convention is tested against a stand-in module with
  the same signature. The public function returns its log-sum-exp (return_attn_probs=True) but
  its backward takes no gradient for it and uses its own (partial) lse and o, so the backward
  here recovers the exact gradient with two calls per partial: autograd through the function
  with dO scaled by the partial's weight w = exp(lse_i - lse) (the value path), plus the missing
  log-sum-exp path P_i * c with c = w * (rowsum(dO * o_i) - rowsum(dO * o)): dq += scale * c *
  (P_i K), with P_i K the output of a second call with K as the values, and dk += scale *
  P_i^T (c q), the value gradient of that second call. About twice the backward cost of `varlen`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import flash
from .common import bshd_empty

__all__ = ["ATTENTION", "CHUNK_ROWS", "SEGMENT_ROWS", "SegmentAttention", "selected_backward",
           "selected_forward", "unsupported_reason"]

# (entry, head) rows per chunk of queries: bounds the packed q, the FA-2 output and the float32
# merge buffer of one chunk (a module constant so tests can shrink it). 2^20 rows at D = 128:
# 0.5 GiB per float32 buffer; at the paper shape (h = 16, n = 16, batch 1) a chunk is 4096
# tokens, and a block chosen at random gets about 4096 * (n - 3) / (t / l') * h rows (800 at
# t = 64k): mostly full FA-2 tiles of 128 rows.
CHUNK_ROWS = 1 << 20

# Packed (entry, head) rows of one segment beyond which its rows are split into sub-segments over
# copies of the block's keys (see `_plan`): 8 FA-2 query tiles of 128 rows.
SEGMENT_ROWS = 1024

# FA-2 launches (m blocks, segments, heads): the segment count is a CUDA grid y dimension.
MAX_SEGMENTS = 65535


class SegmentAttention(NamedTuple):
    """One implementation of the per-segment attention call, in the varlen form of
    `aten._flash_attention_forward/_backward`:

        forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> (o, lse)
        backward(grad_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> (dq, dk, dv)
        unsupported_reason(q, k, v) -> str | None        # q/k/v of the op, [B, heads, S, D]

    q [Tq, Hq, Dk], k [Tk, Hk, Dk], v [Tk, Hk, Dv] (last dim contiguous, other strides free),
    Hq a multiple of Hk (query head i reads KV head i // (Hq / Hk)); cu_q [segs + 1] and
    cu_k [segs + 1] int32 cumulative lengths: segment i is q rows cu_q[i]:cu_q[i+1] against k
    rows cu_k[i]:cu_k[i+1] (a segment may have no query). causal: query r of a segment sees
    keys <= r + len_k - len_q of it (FA-2's bottom-right alignment; this module only makes
    causal calls with len_q == len_k). o [Tq, Hq, Dv] in q's dtype, lse [Hq, Tq] float32.
    backward computes the attention gradient with P = exp(scale * q k^T - lse) and
    D = rowsum(grad_o * o) from the given o and lse (not recomputed ones); dk, dv summed over the
    query heads of each KV head, in q's dtype.
    """

    name: str
    forward: Callable
    backward: Callable
    unsupported_reason: Callable


# --- PyTorch's FA-2 --------------------------------------------------------------------------------


def _fa2_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    o, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return o, lse


def _fa2_backward(grad_o, q, k, v, o, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
    )
    return dq, dk, dv


FA2 = SegmentAttention("PyTorch FA-2 (aten._flash_attention_forward/_backward)", _fa2_forward, _fa2_backward,
                       flash.unsupported_reason)


# --- the flash-attn package (opt-in, not run on this project's machines) ----------------------------

# The parameters of flash_attn.flash_attn_varlen_func this adapter passes (checked by name: a
# version that renamed one is refused with the reason, not called wrongly).
_PACKAGE_PARAMETERS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                       "dropout_p", "softmax_scale", "causal", "return_attn_probs")


def _varlen_func():
    """flash_attn.flash_attn_varlen_func, imported when used (the package is optional)."""
    import flash_attn

    return flash_attn.flash_attn_varlen_func


def _package_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    out, lse, _ = _varlen_func()(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        return_attn_probs=True,
    )
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        # flash-attn before the unpadded varlen lse returned [segments, heads, max_q]
        raise RuntimeError(f"flash_attn_varlen_func returned a log-sum-exp of shape {tuple(lse.shape)}, "
                           f"expected [heads, total_q] = {(q.shape[1], q.shape[0])} (flash-attn too old)")
    return out, lse


def _package_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    with torch.no_grad():
        return _package_call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)


def _package_backward(grad_o, q, k, v, o, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    """The SegmentAttention backward from the public function only (see the module docstring):
    its autograd gives the value path with dO * w; the log-sum-exp path, which its backward
    drops, comes from a second call with K as the values."""
    g = grad_o.float()
    with torch.enable_grad():
        q_, k_, v_, keys_ = (x.detach().requires_grad_() for x in (q, k, v, k))
        o_own, lse_own = _package_call(q_, k_, v_, cu_q, cu_k, max_q, max_k, scale, causal)
        p_keys, _ = _package_call(q.detach(), k.detach(), keys_, cu_q, cu_k, max_q, max_k, scale, causal)  # P_own K
        lse_own, lse_t = lse_own.detach().t(), lse.t()  # [Tq, Hq]
        # a row without keys in this call (lse_own +inf) or excluded by the caller (lse +inf): weight 0
        w = torch.where(lse_own.isfinite() & (lse_t < math.inf), torch.exp(lse_own - lse_t), 0.0)  # [Tq, Hq]
        c = w * ((g * o_own.detach().float()).sum(-1) - (g * o.float()).sum(-1))  # [Tq, Hq]
        dq, dk, dv, dk_lse = torch.autograd.grad(
            (o_own, p_keys), (q_, k_, v_, keys_),
            ((w[..., None] * g).to(o_own.dtype), (scale * c[..., None] * q.float()).to(p_keys.dtype)),
        )
    dq = dq.float() + scale * c[..., None] * p_keys.detach().float()
    return dq.to(q.dtype), (dk.float() + dk_lse.float()).to(k.dtype), dv.to(v.dtype)


def _package_unsupported(q, k, v) -> str | None:
    try:
        fn = _varlen_func()
    except ImportError as err:
        return f"the flash-attn package is not importable ({err})"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "flash_attn.flash_attn_varlen_func has no inspectable signature"
    missing = [name for name in _PACKAGE_PARAMETERS if name not in params]
    if missing:
        return f"flash_attn.flash_attn_varlen_func has no parameter {', '.join(missing)} (unknown flash-attn version)"
    if q.device.type != "cuda":
        return f"flash-attn runs on CUDA only (tensors on {q.device.type})"
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"flash-attn computes in float16/bfloat16 only, all three alike (q {q.dtype}, k {k.dtype}, v {v.dtype})"
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dk != Dv:
        return f"flash-attn 2 needs equal head dims for K and V (Dk {Dk}, Dv {Dv})"
    if Dk > flash.MAX_HEAD_DIM or Dk % 8:
        return f"flash-attn needs a head dim that is a multiple of 8 and at most {flash.MAX_HEAD_DIM} (got {Dk})"
    return None


FLASH_ATTN_PACKAGE = SegmentAttention("flash-attn package (flash_attn_varlen_func)", _package_forward,
                                      _package_backward, _package_unsupported)

# backend name -> its segment attention
ATTENTION = {"varlen": FA2, "varlen_flash_attn": FLASH_ATTN_PACKAGE}


def unsupported_reason(q, k, v, block_idx, block_size, backend: str = "varlen", pos=None) -> str | None:
    """Why `backend` ('varlen' or 'varlen_flash_attn') cannot compute these inputs (None: it can).
    Works on fake tensors."""
    if pos is not None:
        return "packed documents (pos): the varlen segments have no document mask"
    if block_idx.dtype != torch.int64:
        return f"block_idx dtype {block_idx.dtype} (needs int64)"
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        return f"block_size {block_size!r} (needs an int >= 1)"
    B, _, S, _ = q.shape
    if S == 1:  # measured, not understood: dq came back 5.7e31 at S = 1 on an H200 (torch 2.11)
        return "S = 1 (FA-2's backward gave a wrong dq for one-token sequences here; not yet understood)"
    segments = B * -(-S // block_size)
    if segments > MAX_SEGMENTS:
        return f"B * ceil(S / l') = {segments} segments (FA-2 launches at most {MAX_SEGMENTS})"
    return ATTENTION[backend].unsupported_reason(q, k, v)


# --- the algorithm ---------------------------------------------------------------------------------


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, S, D] -> [B * S, heads, D] (a view when x is [B, S, heads, D] in memory)."""
    B, heads, S, D = x.shape
    return x.transpose(1, 2).reshape(B * S, heads, D)


def _block_bounds(B: int, S: int, block_size: int, device) -> torch.Tensor:
    """cu_seqlens [B * NB + 1] int32 cutting the [B * S] flattened tokens at the selection blocks
    (the last block of each batch row may be short)."""
    NB = -(-S // block_size)
    starts = torch.arange(B, device=device)[:, None] * S + torch.arange(NB, device=device)[None, :] * block_size
    return F.pad(starts.flatten(), (0, 1), value=B * S).to(torch.int32)


class _Call(NamedTuple):
    """One non-causal segment call of a chunk and group: the packed (entry, head) rows
    rows0:rows1 (entries rows0 / h .. rows1 / h) against K/V `keys` (None: the group's own view,
    segments at the block boundaries; else the key rows of a copy, one block per segment)."""

    rows0: int
    rows1: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor | None  # None: the block boundaries
    max_q: int
    keys: torch.Tensor | None  # [segments * l'] int64 rows of the [B * S] tokens


class _Plan(NamedTuple):
    """The full-block entries of one chunk of queries and one group, packed: light segments
    first (by segment), then heavy ones (by segment)."""

    count: int  # E
    slot: torch.Tensor  # [E] int64: the entry's index in the chunk's [B, c, n] block list
    rows: torch.Tensor  # [E] int64: its query's row in the [B * S] flattened tokens
    calls: list[_Call]


def _plan(chosen: torch.Tensor, t0: int, block_size: int, S: int, h: int, segment_rows: int) -> _Plan | None:
    """The calls for chosen [B, c, n], the block lists of queries t0 .. t0 + c - 1 of one group
    (None: no query of the chunk has a full block).

    A segment of at most `segment_rows` rows (light) goes into one call with every (batch, block)
    as a segment, K/V the group's own strided view: FA-2's grid is (max rows / 128, segments), so
    one segment much longer than the rest (block 0: every query chooses it) would leave most of
    that grid idle, and its backward (one program per key block) would walk all its rows alone.
    So a heavy segment's rows are cut into sub-segments of `segment_rows` rows, each over its own
    copy of the block's l' keys (a second call): at most 2 * l' / segment_rows copied key rows
    per packed query row, a small fraction of the q gather (64 / 1024 by default)."""
    B, c, n = chosen.shape
    NB = -(-S // block_size)
    current = torch.arange(t0, t0 + c, device=chosen.device) // block_size  # [c]
    full = (chosen >= 0) & (chosen < current[:, None])  # [B, c, n]: a whole block before t's own
    slot = full.flatten().nonzero().squeeze(1)  # [E]
    if slot.numel() == 0:
        return None
    b, t = slot // (c * n), slot // n % c + t0
    segment = b * NB + chosen.flatten()[slot]
    per_segment = torch.bincount(segment, minlength=B * NB)  # entries
    heavy_segment = per_segment * h > segment_rows  # [B * NB]
    order = torch.argsort(heavy_segment[segment].long() * (B * NB) + segment, stable=True)
    slot, rows = slot[order], (b * S + t)[order]
    light = torch.where(heavy_segment, 0, per_segment)
    heavy_rows = torch.where(heavy_segment, per_segment * h, 0)
    n_sub = -(-heavy_rows // segment_rows)  # sub-segments per segment
    n_light, max_light, total_sub = (int(x) for x in torch.stack([light.sum(), light.max(), n_sub.sum()]).tolist())
    calls = []
    if n_light:
        cu_q = F.pad(torch.cumsum(light, 0) * h, (1, 0)).to(torch.int32)
        calls.append(_Call(0, n_light * h, cu_q, None, max_light * h, None))
    if total_sub:
        # sub-segment i of a heavy segment: rows i * segment_rows .. of it, over the block's keys
        seg_of_sub = torch.repeat_interleave(torch.arange(B * NB, device=chosen.device), n_sub, output_size=total_sub)
        first_sub = torch.cumsum(n_sub, 0) - n_sub  # [B * NB]
        i = torch.arange(total_sub, device=chosen.device) - first_sub[seg_of_sub]
        sub_rows = torch.clamp(heavy_rows[seg_of_sub] - i * segment_rows, max=segment_rows)
        cu_q = F.pad(torch.cumsum(sub_rows, 0), (1, 0)).to(torch.int32)
        block_start = seg_of_sub // NB * S + seg_of_sub % NB * block_size  # [total_sub]
        keys = (block_start[:, None] + torch.arange(block_size, device=chosen.device)).flatten()
        cu_k = torch.arange(0, (total_sub + 1) * block_size, block_size, device=chosen.device, dtype=torch.int32)
        # a heavy segment has more than segment_rows rows: its first sub-segment is a full one
        calls.append(_Call(n_light * h, slot.numel() * h, cu_q, cu_k, segment_rows, keys))
    return _Plan(slot.numel(), slot, rows, calls)


def _call_args(call: _Call, packed: list[torch.Tensor], kg: torch.Tensor, vg: torch.Tensor, blocks: torch.Tensor,
               block_len: int):
    """The packed tensors' rows of this call, its K and V, and its cu_q, cu_k, max_q, max_k."""
    k, v = (kg, vg) if call.keys is None else (kg.index_select(0, call.keys), vg.index_select(0, call.keys))
    cu_k = blocks if call.cu_k is None else call.cu_k
    return [x[call.rows0 : call.rows1] for x in packed], k, v, call.cu_q, cu_k, call.max_q, block_len


def _chunk_len(B: int, n: int, h: int, chunk_rows: int | None) -> int:
    return max(1, (chunk_rows or CHUNK_ROWS) // max(1, B * n * h))


def _current_count(block_idx: torch.Tensor, t0: int, t1: int, block_size: int) -> torch.Tensor:
    """How many times each query of t0 .. t1 - 1 lists its current block: [B, G, t1 - t0] int64."""
    current = torch.arange(t0, t1, device=block_idx.device) // block_size
    return (block_idx[:, :, t0:t1] == current[:, None]).sum(-1)


def _gather_rows(x_flat: torch.Tensor, g: int, G: int, rows: torch.Tensor) -> torch.Tensor:
    """x_flat [B * S, G * h, D] -> the h heads of group g at `rows`, packed [E * h, 1, D]."""
    BS, H, D = x_flat.shape
    return x_flat.view(BS, G, H // G, D)[:, g].index_select(0, rows).view(-1, 1, D)


def selected_forward(q, k, v, block_idx, block_size: int, scale: float, backend: str = "varlen", *,
                     attention: SegmentAttention | None = None, chunk_rows: int | None = None,
                     segment_rows: int | None = None):
    """o [B, H, S, Dv] (v's dtype, [B, S, H, Dv] memory) and lse [B, H, S] float32.
    `attention`: the segment attention (default: the backend's; tests pass a stand-in);
    `chunk_rows`, `segment_rows`: CHUNK_ROWS and SEGMENT_ROWS by default. Callers check
    `unsupported_reason` first (the op does)."""
    attn = attention or ATTENTION[backend]
    B, H, S, _ = q.shape
    G, Dv, n = k.shape[1], v.shape[3], block_idx.shape[3]
    h = H // G
    out = bshd_empty(B, H, S, Dv, v)
    lse = q.new_empty((B, H, S), dtype=torch.float32)
    if B * H * S == 0:
        return out, lse
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    blocks = _block_bounds(B, S, block_size, q.device)
    block_len = min(block_size, S)
    # the current block of every query: causal attention inside each selection block
    o_cur, lse_cur = attn.forward(qf, kf, vf, blocks, blocks, block_len, block_len, scale, True)
    o_cur, lse_cur = o_cur.reshape(B, S, G, h, Dv), lse_cur.reshape(G, h, B, S)
    c = _chunk_len(B, n, h, chunk_rows)
    for t0 in range(0, S, c):
        t1 = min(S, t0 + c)
        count_cur = _current_count(block_idx, t0, t1, block_size).float()  # [B, G, c]
        for g in range(G):
            plan = _plan(block_idx[:, g, t0:t1], t0, block_size, S, h, segment_rows or SEGMENT_ROWS)
            heads = slice(g * h, (g + 1) * h)
            # log-sum-exp of every partial of the chunk's rows: the n entries (-inf where not a full
            # block) and, last, the current block with its multiplicity
            part_lse = lse.new_full((B * (t1 - t0) * n, h), -math.inf)
            part_o = lse.new_zeros((B * (t1 - t0) * n, h, Dv))
            if plan:
                q_packed = _gather_rows(qf, g, G, plan.rows)  # [E * h, 1, Dk]
                for call in plan.calls:
                    (q_rows,), *args = _call_args(call, [q_packed], kf[:, g : g + 1], vf[:, g : g + 1], blocks,
                                                  block_len)
                    o_e, lse_e = attn.forward(q_rows, *args, scale, False)
                    slots = plan.slot[call.rows0 // h : call.rows1 // h]
                    part_lse[slots] = lse_e.view(-1, h)
                    part_o.index_copy_(0, slots, o_e.view(-1, h, Dv).float())
            cur_lse = lse_cur[g, :, :, t0:t1].permute(1, 2, 0) + count_cur[:, g, :, None].log()  # [B, c, h]
            all_lse = torch.cat([part_lse.view(B, t1 - t0, n, h), cur_lse[:, :, None]], dim=2)  # [B, c, n+1, h]
            row_lse = torch.logsumexp(all_lse, dim=2)  # [B, c, h]
            # a row without any partial keeps lse -inf and gets weights exp(-inf - 0) = 0
            weight = torch.exp(all_lse - row_lse.nan_to_num(neginf=0.0)[:, :, None])  # [B, c, n+1, h]
            part_o = part_o.view(B, t1 - t0, n, h, Dv).mul_(weight[:, :, :n, :, None]).sum(2)
            merged = part_o + weight[:, :, n, :, None] * o_cur[:, t0:t1, g].float()  # [B, c, h, Dv]
            out[:, heads, t0:t1] = merged.transpose(1, 2)
            lse[:, heads, t0:t1] = row_lse.transpose(1, 2)
    return out, lse


def selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size: int, scale: float, backend: str = "varlen",
                      *, attention: SegmentAttention | None = None, chunk_rows: int | None = None,
                      segment_rows: int | None = None):
    """dq [B, H, S, Dk], dk [B, G, S, Dk], dv [B, G, S, Dv] (the inputs' dtypes, [B, S, heads, D]
    memory) from the forward's o and lse; arguments as `selected_forward`."""
    attn = attention or ATTENTION[backend]
    B, H, S, Dk = q.shape
    G, Dv, n = k.shape[1], v.shape[3], block_idx.shape[3]
    h = H // G
    if B * H * S == 0:
        return tuple(bshd_empty(B, heads, S, D, x).zero_() for heads, D, x in ((H, Dk, q), (G, Dk, k), (G, Dv, v)))
    qf, kf, vf, of = _flat(q), _flat(k), _flat(v), _flat(o)
    gf = _flat(grad_o.to(v.dtype))
    blocks = _block_bounds(B, S, block_size, q.device)
    block_len = min(block_size, S)
    # the current blocks: P = count * exp(s - lse), i.e. lse - log(count); no entry: +inf, P = 0
    count = _current_count(block_idx, 0, S, block_size)[:, :, None]  # [B, G, 1, S]
    lse_cur = torch.where(count > 0, lse.reshape(B, G, h, S) - count.float().log(), math.inf)
    lse_cur = lse_cur.view(B, H, S).transpose(0, 1).reshape(H, B * S)
    dq_cur, dk_cur, dv_cur = attn.backward(gf, qf, kf, vf, of, lse_cur, blocks, blocks, block_len, block_len,
                                           scale, True)
    dq_cur = dq_cur.reshape(B, S, G, h, Dk)
    dk_acc, dv_acc = dk_cur.float().contiguous(), dv_cur.float().contiguous()  # [B * S, G, D]
    dq = bshd_empty(B, H, S, Dk, q)
    lse_rows = lse.transpose(1, 2).reshape(B * S, G, h)  # [B * S, G, h]
    c = _chunk_len(B, n, h, chunk_rows)
    for t0 in range(0, S, c):
        t1 = min(S, t0 + c)
        for g in range(G):
            plan = _plan(block_idx[:, g, t0:t1], t0, block_size, S, h, segment_rows or SEGMENT_ROWS)
            dq_rows = dq_cur[:, t0:t1, g].float()  # [B, c, h, Dk]
            if plan:
                packed = [_gather_rows(x, g, G, plan.rows) for x in (gf, qf, of)]  # [E * h, 1, D]
                packed_lse = lse_rows[:, g].index_select(0, plan.rows).view(1, plan.count * h)
                parts = dq_rows.new_zeros((B * (t1 - t0) * n, h, Dk))
                for call in plan.calls:
                    (g_rows, q_rows, o_rows), k_call, v_call, *args = _call_args(
                        call, packed, kf[:, g : g + 1], vf[:, g : g + 1], blocks, block_len)
                    dq_e, dk_e, dv_e = attn.backward(g_rows, q_rows, k_call, v_call, o_rows,
                                                     packed_lse[:, call.rows0 : call.rows1], *args, scale, False)
                    parts.index_copy_(0, plan.slot[call.rows0 // h : call.rows1 // h],
                                      dq_e.view(-1, h, Dk).float())
                    if call.keys is None:  # dk/dv of the whole group view (0 where no query looked)
                        dk_acc[:, g] += dk_e[:, 0]
                        dv_acc[:, g] += dv_e[:, 0]
                    else:  # of the copied blocks: added where they were copied from
                        dk_acc[:, g].index_add_(0, call.keys, dk_e[:, 0].float())
                        dv_acc[:, g].index_add_(0, call.keys, dv_e[:, 0].float())
                dq_rows = dq_rows + parts.view(B, t1 - t0, n, h, Dk).sum(2)
            dq[:, g * h : (g + 1) * h, t0:t1] = dq_rows.transpose(1, 2)
    dk = dk_acc.to(k.dtype).view(B, S, G, Dk).transpose(1, 2)
    dv = dv_acc.to(v.dtype).view(B, S, G, Dv).transpose(1, 2)
    return dq, dk, dv
