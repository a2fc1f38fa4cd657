"""Compressed-token attention with GQA as a functional custom op (NSA section 2).

    o, lse = torch.ops.nsa.compressed_attention(q, k, v, block, stride, scale, backend, pos=None, q_offset=0)
    o = compressed_attention(q, k, v, block, stride, scale, backend="auto", pos=None, q_offset=0)   # the output only

q [B, H, S, Dk] (normally a transposed view of [B, S, H, Dk] memory), k [B, G, Tc, Dk] and
v [B, G, Tc, Dv]: the pooled compression tokens K~, V~ (one per compression block), H = G * h;
query head j reads KV head j // h (GQA-native: K and V are never repeated). Query t sees
compression block i iff i * stride + block - 1 <= t (the whole block lies in the past: a
staircase mask; block = l, stride = d). Tc is whatever k has: blocks that no query t < S can see
are simply never read. o [B, H, S, Dv] in v's dtype (a view of [B, S, H, Dv] memory), lse
[B, H, S] float32 (natural log; float32 for float64 inputs too, as nsa::selected_attention).
The arithmetic is the eager model's (`NSAAttention.compressed_attention`, models/nsa.py) step
for step:

    scores = upcast(q @ k^T) * scale         # q @ k^T rounded to q's dtype, then fp16/bf16 -> fp32
    p = softmax(scores.masked_fill(~visible, -inf), dim=-1)
    o = p.to(v.dtype) @ v

lse is the log-sum-exp of exactly those scores over the visible blocks, so a later consumer can
rebuild p = exp(scores - lse) (the block selection does). A row without a visible block (t <
block - 1, or Tc = 0 when S < block: both are valid inputs) gets o = 0, lse = -inf and zero
gradients, never NaN. lse is not differentiable.

`block` is the staircase's intercept, an integer of any sign without pos (>= 1 with pos, where it
is also the slot length): the op itself pools nothing, so it is only where the staircase starts.
Two other alignments of the compressed branch are this same mask (lucidrains'
native-sparse-attention-pytorch, tests/corpus/lucidrains_*.py):
- strict visibility, block i of l tokens seen only after its last token (i*d + l - 1 < t):
  block = l + 1;
- M learned memory slots prepended to the pooled tokens (k = cat(mem_k, k_cmp) on the token dim),
  visible to every query, with strict or inclusive blocks of l <= d tokens (l <= d + 1 when
  inclusive): column j = M + i is visible iff i*d + l' - 1 <= t (l' = l + 1 strict, l inclusive),
  i.e. j*d + (l' - M*d) - 1 <= t, and every memory column j < M passes that test at t = 0
  ((M - 1)*d + l' - M*d - 1 = l' - d - 1 <= 0). So block = l' - M*d (<= 0 for M >= 2) computes
  it, memory columns included, and no row is empty.
Why one integer and not a memory parameter or a softmax split into memory and blocks merged by
their log-sum-exps: the integer is the smaller honest change. The reference and the Triton
kernels already compute the mask as `i * stride + block - 1 <= t` in integers, so both take it
unchanged (the Triton dk/dv kernel only clamps its first query at 0, under a constexpr that the
default path does not compile), the arithmetic stays eager's softmax over the same columns, lse
stays non-differentiable, and dk, dv of the memory columns come out of the same backward.
Memory slots before overlapping blocks (l' - d - 1 > 0) are not one staircase: the last memory
column would be hidden from the first queries, and passes/compressed_attention.py refuses them.

Packed documents (`pos` [B, S] int64, each token's position in its own document, the model's
tensor; models/nsa.py): k and v then hold one compression slot per token, Tc = S - block + 1
(slot s pools tokens [s, s + block), `x.unfold(1, block, 1)`; Tc = 0 when S < block), and query
t sees slot s iff
    s + block - 1 <= t                                   (the whole slot lies in the past)
    s >= t - pos[t]                                      (it starts in t's document)
    pos[s] % stride == 0                                 (a block of its document: stride = d)
    pos[s + block - 1] == pos[s] + block - 1             (its tokens lie in one document)
Any row may then lack a visible slot (a document shorter than block, the first block - 1 tokens
of each): o = 0, lse = -inf and zero gradients there, as above. Without pos nothing changes.
pos must count up by one inside each document from 0 at its start (what models.check_positions
accepts, and the model checks once per forward): the triton backend relies on it (a document's
start is t - pos[t], and its blocks are at least min(block, stride) tokens apart); the reference
computes the formula above for any int64 pos.

A chunk of queries (`q_offset`, an int, default 0): query row r of q is token q_offset + r of
the sequence the keys were pooled from, so row r sees block i iff i * stride + block - 1 <=
q_offset + r. A model that loops over query chunks of a long sequence (each chunk reading the
whole pooled K/V) becomes one op call per chunk with its offset (issue 17). Not with pos
(ValueError). That test is the staircase of intercept block - q_offset over the rows
(i * stride + (block - q_offset) - 1 <= r): the triton backend runs its kernels with that
intercept (`block` may be < 1 there, as for memory slots), so the offset adds no kernel argument
and q_offset = 0 launches exactly the kernels it did before; the reference adds q_offset to its
rows' tokens.

Backward is a second op, `nsa::compressed_attention_backward(grad_o, q, k, v, o, lse, block,
stride, scale, backend, pos=None, q_offset=0) -> (dq, dk, dv)`: dq in q's dtype ([B, S, H, Dk] memory), dk and
dv with the shapes and dtypes of k and v, summed over each group's h query heads; pos gets no
gradient.

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error):
- `triton` (CUDA): the flash-style kernels of nsa_compile/ops/compressed_triton.py (online
  softmax over tiles of compression tokens, the staircase mask only on the diagonal tiles,
  deterministic backward without atomics). With pos the same kernels read the blocks of each row
  in compact form, built on the device (no host sync): query t sees one contiguous range of them,
  so a query reads its document's blocks only (not Tc ~ S slots), the mask compares the range's
  bounds, and dk, dv are written back to the blocks' slots (0 at every other slot).
- `reference` (every device and dtype): PyTorch, chunked over query rows. A chunk of C queries
  [t0, t1) reads only the blocks the last of them can see, so memory is O(B * H * C * Tc) and
  the [B, H, S, Tc] scores are never built at once; C is as large as REFERENCE_BUDGET allows
  (few Python iterations on CUDA). The group's h heads are folded into the rows of one matmul
  per (batch, group), so K and V are read once per group. With pos a chunk builds its rows'
  [B, h * C, n] document mask from pos (the slot test is [B, Tc], computed once per call) and
  reads only the slots that are blocks, from its rows' earliest document start to its last
  row's last slot (`document_chunks`: one host read of pos per call): the packed form has a slot
  per token, Tc ~ S (d times the unpacked count, as in the eager model), and a query sees a d-th
  of its own document's, so the work is about that of each document's unpacked staircase, not
  S * Tc / 2. Leaving out masked columns changes no term of the softmax's and p @ v's sums, only
  the order their float additions take (results within rounding of the full-width ones). The
  backward recomputes each chunk's probabilities and applies the formulas autograd applies to the
  eager graph (written out, see `_reference_backward`), accumulating dk and dv in float32 (float64
  for float64).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import compressed_triton
from .common import (
    bshd_empty, check_gqa, check_grad_o, check_offset, check_positive_int, empty_attention_grads,
    empty_attention_outputs, upcast_dtype, why_not_triton_on,
)
from .registry import Backend, Op, declare

__all__ = ["COMPRESSED", "choose_backend", "compressed_attention", "compressed_attention_backward", "why_not_triton"]

# Elements of one chunk's score tensor [B, H, C, Tc] in the reference backend: C follows from it.
# 2**25 fp32 scores are 128 MiB, and a chunk holds a few tensors of that size; at the paper shape
# (H 64, Tc 4095 at 64k) that is C = 128 query rows, 512 chunks.
REFERENCE_BUDGET = 2**25
# Query rows per chunk, overriding the budget (None: from the budget; a module constant so tests
# can put chunk boundaries inside small sequences).
REFERENCE_CHUNK: int | None = None
# With pos (`document_chunks`): query rows a chunk takes before it may end at a document start, and
# before its columns limit its rows.
MIN_ROWS = 128


def choose_backend(q, k, v, block, stride, backend: str = "auto", pos=None, q_offset: int = 0) -> str:
    """`COMPRESSED.choose` (ops/registry.py): `backend` itself (ValueError, with why, where it
    cannot run these inputs), or for 'auto' triton where it can run on CUDA (with pos or without)
    and reference elsewhere."""
    return COMPRESSED.choose(backend, q, k, v, block, stride, pos, q_offset)


def _triton_reason(q, k, v, block, stride, pos=None, q_offset: int = 0) -> str | None:
    return compressed_triton.unsupported_reason(q, k, v, block - q_offset, stride, pos)


def why_not_triton(q, k, v, block, stride, pos=None, q_offset: int = 0) -> str | None:
    """Why 'auto' does not take the triton backend for these inputs (None: it does)."""
    return why_not_triton_on(q.device, lambda: _triton_reason(q, k, v, block, stride, pos, q_offset))


def _check(q, k, v, block, stride, scale, backend="auto", pos=None, q_offset=0) -> str:
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, block, stride, pos and backend are valid. (k and v hold Tc compression tokens, not S:
    common.check_qkv does not fit.)"""
    op = "compressed_attention"
    check_gqa(op, q, k, v, rows="Tc")
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{op}: k and v must hold the same number of compression tokens, got {k.shape[2]} and {v.shape[2]}"
        )
    if pos is None:  # the staircase's intercept: any int (module docstring)
        check_int(op, "block", block)
    else:  # with pos also the slot length
        check_positive_int(op, "block", block, " with pos")
    check_positive_int(op, "stride", stride)
    check_offset(op, q_offset, pos)
    if pos is not None:
        _check_pos(op, q, k, block, pos)
    return choose_backend(q, k, v, block, stride, backend, pos, q_offset)


def check_int(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"{op}: {name} must be an int, got {type(value).__name__}")


def _check_pos(op: str, q, k, block, pos) -> None:
    """pos must be int64 [B, S] on q's device, and k must hold one slot per token (S - block + 1)."""
    B, S = q.shape[0], q.shape[2]
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.dim() != 2:
        got = f"{pos.dtype} {list(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValueError(f"{op}: pos must be an int64 [B, S] tensor (each token's position in its document), got {got}")
    if pos.shape[0] != B or pos.shape[1] != S:
        raise ValueError(f"{op}: pos must have shape [B, S] = [{B}, {S}], got {list(pos.shape)}")
    if pos.device != q.device:
        raise ValueError(f"{op}: pos must be on q's device {q.device}, got {pos.device}")
    slots = max(0, S - block + 1)
    if k.shape[2] != slots:
        raise ValueError(f"{op}: with pos, k and v hold a slot per token (x.unfold(1, block, 1)): Tc must be "
                         f"S - block + 1 = {slots}, got {k.shape[2]}")


def visible_blocks(t: int, block: int, stride: int, Tc: int) -> int:
    """How many compression blocks query t sees: blocks 0 .. n-1 with i * stride + block - 1 <= t."""
    if t < block - 1:
        return 0
    return min(Tc, (t - block + 1) // stride + 1)


def _chunk_rows(B: int, H: int, Tc: int, chunk: int | None) -> int:
    if chunk is not None:
        return chunk
    if REFERENCE_CHUNK is not None:
        return REFERENCE_CHUNK
    return max(1, REFERENCE_BUDGET // max(1, B * H * Tc))


def _chunks(S: int, B: int, H: int, Tc: int, block: int, stride: int, chunk: int | None, q_offset: int = 0):
    """(t0, t1, n): query rows [t0, t1) (tokens q_offset + t0 ..) and the number of blocks the last
    of them sees (every row of the chunk sees a prefix of those n: the staircase)."""
    rows = _chunk_rows(B, H, Tc, chunk)
    for t0 in range(0, S, rows):
        t1 = min(S, t0 + rows)
        yield t0, t1, visible_blocks(q_offset + t1 - 1, block, stride, Tc)


def _column_chunks(q, Tc: int, block: int, stride: int, chunk: int | None, q_offset: int, pos, floor: int):
    """(t0, t1, cols, n): query rows [t0, t1) and the n columns of k they read, cols a slice or an
    int64 index tensor on q's device (ascending). Without pos `_chunks`: the prefix [0, n); with
    pos `document_chunks` (rows per chunk: `chunk`, REFERENCE_CHUNK, else as many as
    REFERENCE_BUDGET allows for their columns, at least floor)."""
    B, H, S = q.shape[:3]
    if pos is None:
        return ((t0, t1, slice(0, n), n) for t0, t1, n in _chunks(S, B, H, Tc, block, stride, chunk, q_offset))
    rows = chunk if chunk is not None else REFERENCE_CHUNK
    chunks = list(document_chunks(pos.cpu(), block, stride, Tc, B * H, REFERENCE_BUDGET, rows, floor))
    return ((t0, t1, cols, len(cols)) for (t0, t1, _), cols in zip(chunks, columns_on(q.device, chunks)))


def columns_on(device, chunks: list) -> tuple[torch.Tensor, ...]:
    """The host column indices of `chunks` (each chunk's third item) on device, copied at once
    (one transfer, not one per chunk)."""
    if not chunks:
        return ()
    return torch.cat([chunk[2] for chunk in chunks]).to(device).split([len(chunk[2]) for chunk in chunks])


def document_chunks(pos: torch.Tensor, block: int, stride: int, Tc: int, per_row: int, budget: int,
                    rows: int | None = None, floor: int | torch.Tensor = 1):
    """Query chunks of a packed reference (compressed attention's, block selection's): (t0, t1,
    cols) for rows [t0, t1) and the slots cols (int64 [n] on the host, ascending) that some row of
    theirs can see. pos [B, S] int64 on the host (the caller reads the device's once). Row t sees
    slot s only where t - pos[t] <= s, s + block - 1 <= t and s is a block of some batch row's
    document (pos[s] % stride == 0 and its block tokens in one document): cols are the slots
    that are a block on some batch row, from lo = the earliest document start t - pos[t] among
    the chunk's rows over the batch (0 at least) to hi = min(Tc, t1 - block + 1). Every other
    slot is masked for every row of the chunk (probability exactly 0 in the full-width
    computation), so a query reads the blocks of its own document, not a slot per token of the
    whole row (d times fewer, S / n-token documents times fewer again).

    `rows` rows per chunk, or (None) chunks that waste little: a chunk reads (t1 - t0) * n
    elements per head, of which its rows see about a triangle less, so it holds at most
    max(MIN_ROWS, w / 2) rows (w = the tokens from its first row's earliest document start to it:
    at most a quarter more than the rows see), ends at a document start once it holds MIN_ROWS
    rows (so it does not read the last document's blocks for the next one's rows), and keeps
    per_row * rows * max(n, floor) within budget (at least one row); floor an int or [S] per row
    (the chunk's largest counts): the caller's other per-row widths."""
    S = pos.shape[1]
    t = torch.arange(S)
    starts = ((t - pos).amin(0) if len(pos) else t).clamp(0, Tc)  # [S]: each row's earliest document start
    ends = (t - block + 2).clamp(0, Tc)  # [S]: one past the last slot each row can see
    first_pos = pos[:, :Tc]
    is_block = ((first_pos % stride == 0) & (pos[:, block - 1 : block - 1 + Tc] == first_pos + block - 1)).any(0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), is_block.cumsum(0)])  # [Tc + 1]: blocks before each slot
    floor = torch.as_tensor(floor, dtype=torch.int64).expand(S)
    t0 = 0
    while t0 < S:
        if rows is not None:
            t1 = min(S, t0 + rows)
        else:
            span = int((ends[t0] - starts[t0]).clamp(min=0))
            first = int(before[ends[t0]] - before[min(starts[t0], ends[t0])])
            t_max = min(S, t0 + max(MIN_ROWS, span // 2), t0 + max(1, budget // (max(1, per_row) * max(first, 1))))
            hi = ends[t0:t_max].cummax(0).values
            lo = torch.minimum(starts[t0:t_max].cummin(0).values, hi)
            width = torch.maximum((before[hi] - before[lo]).clamp(min=1), floor[t0:t_max].cummax(0).values)
            cost = per_row * torch.arange(1, t_max - t0 + 1) * width  # grows with the rows: a prefix fits
            t1 = t0 + max(1, int((cost <= budget).sum()))
            new_document = (starts[t0 + MIN_ROWS : t1] > starts[t0 + MIN_ROWS - 1 : t1 - 1]).nonzero()
            if len(new_document):
                t1 = t0 + MIN_ROWS + int(new_document[0])
        hi = int(ends[t1 - 1])
        lo = min(int(starts[t0:t1].min()), hi)
        yield t0, t1, is_block[lo:hi].nonzero().flatten() + lo
        t0 = t1


def _rows(x: torch.Tensor, G: int, t0: int, t1: int) -> torch.Tensor:
    """x [B, H, S, D] -> the chunk's rows [B, G, h * c, D] (head-major inside the group: a copy
    when x is a transposed view, which the matmul would make anyway)."""
    B, H, _, D = x.shape
    return x.unflatten(1, (G, H // G))[:, :, :, t0:t1].reshape(B, G, (H // G) * (t1 - t0), D)


def _put_rows(out: torch.Tensor, G: int, t0: int, t1: int, rows: torch.Tensor) -> None:
    """out [B, H, S, ...][:, :, t0:t1] = rows [B, G, h * c, ...] (the layout of `_rows`)."""
    B, H = out.shape[:2]
    out.unflatten(1, (G, H // G))[:, :, :, t0:t1] = rows.view(B, G, H // G, t1 - t0, *out.shape[3:])


def _visible(t0: int, t1: int, cols, block: int, stride: int, h: int, device, pos=None,
             is_block=None) -> torch.Tensor:
    """[h * c, n] bool: row (head, t) of the chunk sees block i (the same for every head), for the
    n columns i of cols (a slice, or an index tensor on the device; `_column_chunks`). With pos:
    [B, 1, h * c, n], row (head, t) of batch row b sees slot s (the module docstring's test;
    is_block [B, Tc] holds its last two terms)."""
    t = torch.arange(t0, t1, device=device)[:, None]
    i = (cols if isinstance(cols, torch.Tensor) else torch.arange(cols.start, cols.stop, device=device))[None, :]
    if pos is None:
        return (i * stride + block - 1 <= t).repeat(h, 1)
    same_doc = i >= t - pos[:, t0:t1, None]  # [B, c, n]: the slot starts in t's document
    visible = (i + block - 1 <= t) & same_doc & is_block[:, None, cols]  # [B, c, n]
    return visible.repeat(1, h, 1)[:, None]  # [B, 1, h * c, n]


def _slot_is_block(pos: torch.Tensor, Tc: int, block: int, stride: int) -> torch.Tensor:
    """[B, Tc] bool: slot s is a compression block of its document (pos[s] % stride == 0) and its
    block tokens lie in that document."""
    start = pos[:, :Tc]  # [B, Tc]: the document position of each slot's first token
    return (start % stride == 0) & (pos[:, block - 1 : block - 1 + Tc] == start + block - 1)


def _chunk_probs(qc, kc, visible, scale, empty_rows: bool):
    """Softmax probabilities [B, G, R, n] in the upcast dtype (zero where invisible and on rows
    without a visible block), and the rows' log-sum-exp [B, G, R] in float32 (-inf on those rows).
    `empty_rows`: whether the chunk has rows without a visible block (t < block - 1). Only then
    does it take the eager steps for them: masked_fill(~has_block, 0) keeps softmax finite, and
    `* visible` zeroes those rows (elsewhere it is an exact no-op: exp(-inf) = 0), two passes over
    the scores that the other chunks skip."""
    scores = (qc @ kc.transpose(-1, -2)).to(upcast_dtype(qc.dtype)) * scale  # [B, G, R, n]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).float()
    if not empty_rows:
        return torch.softmax(scores, dim=-1), lse
    has_block = visible.any(dim=-1, keepdim=True)  # [R, 1]
    return torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible, lse


def _reference_forward(q, k, v, block: int, stride: int, scale: float, chunk: int | None = None, pos=None,
                       q_offset: int = 0):
    H, G, Tc = q.shape[1], k.shape[1], k.shape[2]
    h = H // G
    out, lse = empty_attention_outputs(q, v)
    # with pos any row may be empty (a chunk reads the blocks its rows' documents can hold)
    is_block = None if pos is None else _slot_is_block(pos, Tc, block, stride)
    for t0, t1, cols, n in _column_chunks(q, Tc, block, stride, chunk, q_offset, pos, max(q.shape[3], v.shape[3])):
        if n == 0:  # no row of the chunk sees a block (yet)
            out[:, :, t0:t1] = 0
            lse[:, :, t0:t1] = float("-inf")
            continue
        # without pos the rows' positions are their tokens, q_offset + t (pos rules q_offset out)
        visible = _visible(q_offset + t0, q_offset + t1, cols, block, stride, h, q.device, pos, is_block)
        empty_rows = pos is not None or q_offset + t0 < block - 1
        p, row_lse = _chunk_probs(_rows(q, G, t0, t1), k[:, :, cols], visible, scale, empty_rows)
        _put_rows(out, G, t0, t1, p.to(v.dtype) @ v[:, :, cols])  # [B, G, R, Dv]
        _put_rows(lse, G, t0, t1, row_lse)
    return out, lse


def _reference_backward(grad_o, q, k, v, block: int, stride: int, scale: float, chunk: int | None = None,
                        pos=None, q_offset: int = 0):
    """dq, dk, dv by recomputing each chunk and applying autograd's formulas for the eager graph.

    Autograd itself cannot run here: a custom op's kernel runs with the autograd dispatch keys
    excluded. The steps below are the backward formulas of the forward's ops, in reverse, in the
    same dtypes:
        o = pv @ v              ->  d_pv = g @ v^T,  dv = pv^T @ g              (v's dtype)
        pv = p.to(v.dtype)      ->  dp = d_pv.to(p.dtype)
        p = softmax(sm) * vis   ->  d_sm = _softmax_backward_data(dp, p)       (upcast dtype;
                                    p is 0 where invisible and on empty rows, so d_sm is too)
        s = a.to(up) * scale    ->  da = (d_sm * scale).to(q.dtype)
        a = q @ k^T             ->  dq = da @ k,  dk = da^T @ q                 (q's dtype)
    One chunk's dk and dv are already summed over the group's heads (the h * c rows contract in
    one matmul); they accumulate over chunks in the upcast dtype and are cast once at the end.
    """
    B, H, S, Dk = q.shape
    G, Tc, Dv = k.shape[1], k.shape[2], v.shape[3]
    h = H // G
    up = upcast_dtype(q.dtype)
    dq = bshd_empty(B, H, S, Dk, q)
    # accumulators in the upcast dtype, laid out like the outputs: the final cast keeps the layout
    dk = bshd_empty(B, G, Tc, Dk, k, upcast_dtype(k.dtype)).zero_()
    dv = bshd_empty(B, G, Tc, Dv, v, upcast_dtype(v.dtype)).zero_()
    is_block = None if pos is None else _slot_is_block(pos, Tc, block, stride)
    for t0, t1, cols, n in _column_chunks(q, Tc, block, stride, chunk, q_offset, pos, max(Dk, Dv)):
        if n == 0:
            dq[:, :, t0:t1] = 0
            continue
        visible = _visible(q_offset + t0, q_offset + t1, cols, block, stride, h, q.device, pos, is_block)
        qc, kc, vc = _rows(q, G, t0, t1), k[:, :, cols], v[:, :, cols]
        g = _rows(grad_o, G, t0, t1).to(v.dtype)  # [B, G, R, Dv]
        p, _ = _chunk_probs(qc, kc, visible, scale, pos is not None or q_offset + t0 < block - 1)  # [B, G, R, n]
        pv = p.to(v.dtype)
        dv[:, :, cols] += pv.transpose(-1, -2) @ g  # (with an index tensor: read, add, written back)
        dp = (g @ vc.transpose(-1, -2)).to(up)
        d_sm = torch._softmax_backward_data(dp, p, -1, up)
        da = (d_sm * scale).to(q.dtype)
        _put_rows(dq, G, t0, t1, da @ kc)
        dk[:, :, cols] += da.transpose(-1, -2) @ qc
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _check_backward(grad_o, q, k, v, o, lse, block, stride, scale, backend="auto", pos=None, q_offset=0) -> str:
    chosen = _check(q, k, v, block, stride, scale, backend, pos, q_offset)
    check_grad_o("compressed_attention_backward", grad_o, q, v)
    return chosen


def _gradients(saved, grad_o, _grad_lse) -> dict:
    s = saved
    dq, dk, dv = torch.ops.nsa.compressed_attention_backward(
        grad_o, s.q, s.k, s.v, s.o, s.lse, s.block, s.stride, s.scale, s.backend, s.pos, s.q_offset)
    return {"q": dq, "k": dk, "v": dv}


COMPRESSED = declare(Op(
    name="compressed_attention",
    schema='(Tensor q, Tensor k, Tensor v, SymInt block, SymInt stride, float scale, str backend="auto", '
           "Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor)",
    config_field="compressed_attention_backend",
    choice_args=("q", "k", "v", "block", "stride", "pos", "q_offset"),
    backends=(
        Backend("triton", cannot_run=_triton_reason, auto_reason=why_not_triton,
                # a chunk of queries as the staircase's intercept (module docstring)
                forward=lambda q, k, v, block, stride, scale, pos, q_offset: compressed_triton.compressed_forward(
                    q, k, v, block - q_offset, stride, scale, pos),
                backward=lambda grad_o, q, k, v, o, lse, block, stride, scale, pos, q_offset:
                    compressed_triton.compressed_backward(grad_o, q, k, v, o, lse, block - q_offset, stride, scale,
                                                          pos)),
        Backend("reference",
                forward=lambda q, k, v, block, stride, scale, pos, q_offset: _reference_forward(
                    q, k, v, block, stride, scale, pos=pos, q_offset=q_offset),
                backward=lambda grad_o, q, k, v, o, lse, block, stride, scale, pos, q_offset: _reference_backward(
                    grad_o, q, k, v, block, stride, scale, pos=pos, q_offset=q_offset)),
    ),
    check=_check,
    fake=lambda q, k, v, *_: empty_attention_outputs(q, v),
    backward_schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, SymInt block, SymInt stride, "
                    'float scale, str backend="auto", Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor, Tensor)',
    check_backward=_check_backward,
    backward_fake=lambda grad_o, q, k, v, *_: empty_attention_grads(q, k, v),
    outputs=("o", "lse"),
    non_differentiable=("lse",),
    gradients=_gradients,
))
compressed_attention_backward = COMPRESSED.backward_op


def compressed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, stride: int, scale: float, backend: str = "auto",
    pos: Optional[torch.Tensor] = None, q_offset: int = 0,
) -> torch.Tensor:
    """The output o of `torch.ops.nsa.compressed_attention` (see the module docstring)."""
    return torch.ops.nsa.compressed_attention(q, k, v, block, stride, scale, backend, pos, q_offset)[0]
