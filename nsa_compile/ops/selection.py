"""Selected-block attention with GQA as a functional custom op (NSA section 3).

    o, lse = torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend, pos)
    o = selected_attention(q, k, v, block_idx, block_size, scale, backend="auto", pos=None)   # the output only

q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv] with H = G * h: query head j reads KV head
j // h (GQA-native: K and V are never repeated). block_idx [B, G, S, n] int64 lists the chosen
selection blocks of each (batch, group, token), ascending and padded with -1 (the output of
`NSAAttention.select_blocks`); the group's h heads share them. Query t attends to the tokens of
its chosen blocks intersected with [0, t] (the current block is partial); entries < 0 are
ignored, and so are the tokens of blocks past the end of the sequence. o [B, H, S, Dv] in v's
dtype (a view of [B, S, H, Dv] memory), lse [B, H, S] float32 (the log-sum-exp of each row's
scaled scores over its valid tokens; -inf on a row without one). The arithmetic is the eager model's (`NSAAttention.selected_attention` in
models/nsa.py) step for step, over each query's gathered tokens:

    scores = upcast(q @ k_sel^T) * scale     # q @ k^T in q's dtype; fp16/bf16 -> fp32, fp32/fp64 stay
    p = softmax(scores.masked_fill(~valid, -inf), dim=-1)
    o = p.to(v.dtype) @ v_sel

A row without a single valid token (all blocks -1, or n == 0) gets output 0 and zero gradients
(the eager formula would give NaN there; `select_blocks` never produces such a row, since the
current block is always forced). The block ids are used as given: duplicates count twice, as in
the eager gather.

A chunk of queries (`q_offset`, an int, default 0; issue 17): query row r of q is token
q_offset + r, and k, v hold the sequence's first Skv >= q_offset + S tokens (the whole sequence
of a model that loops over query chunks); the validity test above is then token <= q_offset + r.
block_idx stays [B, G, S, n] (the chunk's rows). The reference and the triton backend take it
(the kernels get Skv and q_offset as ints: the blocks are K/V's, ceil(Skv / l'), and q_offset is
added to a row's token where it is compared with a key's); the varlen backends take the whole
sequence only (their reason). Not with pos (ValueError).

Packed documents (NSA_SEMANTICS.md section 6): pos [B, S] int64 (None: one document per row) is
each token's position in its own document (0 at a document start), the tensor the eager model
takes. Block ids are then counted within the query's document: block j of query t covers the
tokens (t - pos[t]) + j * l' + offset, offset in [0, l'), and the token is valid iff the block is
chosen and the token is <= t (the eager `selected_attention(..., pos)` of models/nsa.py). The
values of pos are not checked (that would read them back from the device); token ids outside
[0, S) that invalid positions would give are clamped for the gather, never read out of bounds.

The longest document (`doc_len`, an int, default 0: unknown; with pos only) is a hint for the
triton backend's tiles where the caller knows it (the varlen pass: positions that are a constant of
the graph): one row of packed tokens then gets the tiles of its documents' length, not of the
whole row's (selection_triton `_tile_len`). The results never depend on it; the other backends
ignore it.

Backward is a second op, `nsa::selected_attention_backward(grad_o, q, k, v, o, lse, block_idx,
block_size, scale, backend, pos, q_offset, doc_len) -> (dq, dk, dv)`, with dk and dv summed over each group's h
query heads (shapes of k and v); block_idx and pos get no gradient.

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error;
`triton` and `reference` take pos, the varlen backends give the packed documents as their reason):
- `triton` (CUDA): the group-centric kernels of nsa_compile/ops/selection_triton.py: one
  program per token and KV group loads the group's h heads and streams the chosen K/V blocks
  by index (no gathered copy); dq on the same grid; dk/dv from the inverted selection, without
  atomics (deterministic). Scores accumulate in fp32 (eager rounds q @ k^T to fp16/bf16 first).
  Packed documents: the kernels read pos on the device (no host sync, capturable in a CUDA
  graph, one compiled kernel for every packing) and name each chosen block by its first token
  t - pos[t] + j * l'; the inverted selection lists a block that the l' grid cuts under both
  grid blocks it touches (see selection_triton.py). Valid positions give the reference's
  attention; where pos[t] > t (not a position) the two differ, each in bounds: the reference
  clamps token ids into [0, S) for its gather, the kernels take the document start as
  max(t - pos[t], -1) and drop a block that would start before token 0.
- `reference` (every device and dtype): PyTorch, chunked over query rows. A chunk of C queries
gathers its own selected tokens, K and V [B, G, C, n*l', D] (never for all S at once), so
memory is O(B * G * C * n * l' * (D + h)). The group's h heads are folded into the rows of one
matmul per (batch, group, query), so the gathered K and V are shared by the group. The backward
recomputes each chunk's probabilities, applies the formulas autograd applies to the eager graph
(written out, see `_reference_backward`), and scatter-adds dk and dv over the gathered token
indices into float32 (float64 for float64) accumulators, cast once at the end.
- `varlen` (CUDA, fp16/bf16, Dk == Dv; never chosen by `auto`): FlashAttention-2's varlen kernels
  as PyTorch ships them (nsa_compile/ops/selection_varlen.py): the queries that chose a KV block
  form one segment over that block's keys (q gathered, K/V read in place but for small copies of
  blocks that very many queries chose), the current block of every query by one causal call
  whose segments are the blocks themselves, partial results merged by log-sum-exp in float32,
  chunked over queries; the backward is FA-2's per segment, given the merged o and lse. Partial
  outputs are rounded to fp16/bf16 before the merge.
- `varlen_flash_attn`: the same through the flash-attn package's `flash_attn_varlen_func`
  (an opt-in; not run on this project's machines, where the package cannot be installed).
"""

from __future__ import annotations

import torch

from . import selection_triton, selection_varlen
from .common import (
    bshd_empty, check_gqa, check_grad_o, check_offset, check_positive_int, check_qkv, empty_attention_grads,
    empty_attention_outputs, upcast_dtype, why_not_triton_on,
)
from .registry import Backend, Op, declare

__all__ = ["SELECTION", "choose_backend", "selected_attention", "selected_attention_backward", "why_not_triton"]

# Query rows per chunk of the reference backend (a module constant so tests can shrink it).
REFERENCE_CHUNK = 64


def choose_backend(q, k, v, block_idx, block_size, backend: str = "auto", pos=None, q_offset: int = 0) -> str:
    """`SELECTION.choose` (ops/registry.py): `backend` itself (ValueError, with why, where it
    cannot run these inputs), or for 'auto' triton where it can run on CUDA (with or without
    pos) and reference elsewhere ('auto' never takes a varlen backend)."""
    return SELECTION.choose(backend, q, k, v, block_idx, block_size, pos, q_offset)


def chunk_reason(q, k, q_offset: int) -> str | None:
    """Why the varlen backends, which attend over the queries' own sequence, cannot take a chunk
    of queries (None: q_offset 0 and K/V of q's length)."""
    if q_offset != 0 or k.shape[2] != q.shape[2]:
        return (f"a chunk of queries (q_offset={q_offset}, {q.shape[2]} queries, {k.shape[2]} keys): the varlen "
                "kernels take the whole sequence only")
    return None


def why_not_triton(q, k, v, block_idx, block_size, pos=None, q_offset: int = 0) -> str | None:
    """Why 'auto' does not take the triton backend for these inputs (None: it does): off CUDA,
    or what the kernels cannot run. Packed documents (pos) and chunks of queries (q_offset, K/V
    longer than q) change nothing: the kernels take them."""
    return why_not_triton_on(q.device, lambda: selection_triton.unsupported_reason(q, k, v, block_idx, block_size,
                                                                                   pos))


def _check(q, k, v, block_idx, block_size, scale, backend="auto", pos=None, q_offset=0, doc_len=0) -> str:
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, block size, positions, query offset, document length and backend are valid."""
    check_offset("selected_attention", q_offset, pos)
    if isinstance(doc_len, bool) or not isinstance(doc_len, int) or doc_len < 0 or doc_len and pos is None:
        raise ValueError(f"selected_attention: doc_len must be an int >= 0, and 0 without pos (it bounds the "
                         f"packed documents' length), got {doc_len!r}" + (" without pos" if pos is None else ""))
    if pos is not None:
        check_qkv("selected_attention", q, k, v, block_idx=block_idx, pos=pos)
    else:  # a chunk of queries reads K/V of the tokens up to its last query, at least
        check_gqa("selected_attention", q, k, v, block_idx=block_idx)
        if k.shape[2] != v.shape[2] or k.shape[2] < q_offset + q.shape[2]:
            raise ValueError(f"selected_attention: sequence lengths differ: k and v must hold the same Skv >= "
                             f"q_offset + S = {q_offset + q.shape[2]} tokens, got {k.shape[2]} and {v.shape[2]}")
    B, G, S = q.shape[0], k.shape[1], q.shape[2]
    if block_idx.dtype != torch.int64:
        raise ValueError(f"selected_attention: block_idx must be an int64 tensor, got {block_idx.dtype}")
    if block_idx.dim() != 4 or tuple(block_idx.shape[:3]) != (B, G, S):
        raise ValueError(
            f"selected_attention: block_idx must have shape [B, G, S, n] = [{B}, {G}, {S}, n], "
            f"got {tuple(block_idx.shape)}"
        )
    check_positive_int("selected_attention", "block_size", block_size)
    if pos is not None and (pos.dtype != torch.int64 or tuple(pos.shape) != (B, S)):
        raise ValueError(f"selected_attention: pos must be an int64 tensor of shape [B, S] = [{B}, {S}] "
                         f"(each token's position in its document), got {pos.dtype} {tuple(pos.shape)}")
    return choose_backend(q, k, v, block_idx, block_size, backend, pos, q_offset)


def _chunk_tokens(block_idx, t0: int, t1: int, block_size: int, S: int, pos=None, q_offset: int = 0):
    """Gathered token ids [B, G, c, n*l'] (clamped into [0, S): S the keys' length) and their
    validity mask, the eager way (with pos, the blocks counted from each query's document start
    t - pos[t]); query row t is token q_offset + t."""
    bi = block_idx[:, :, t0:t1]  # [B, G, c, n]
    offsets = torch.arange(block_size, device=bi.device)
    tokens = (bi.clamp(min=0)[..., None] * block_size + offsets).flatten(-2)  # [B, G, c, T]
    t = torch.arange(q_offset + t0, q_offset + t1, device=bi.device)[:, None]  # [c, 1]: the rows' tokens
    if pos is not None:
        tokens = tokens + (t[:, 0] - pos[:, t0:t1])[:, None, :, None]  # + document start [B, 1, c, 1]
    chosen = (bi >= 0)[..., None].expand(*bi.shape, block_size).flatten(-2)
    valid = chosen & (tokens <= t)  # [B, G, c, T]
    # ids < 0 come only from invalid positions (pos[t] > t): clamped, so the gather stays in bounds
    return tokens.clamp(min=0, max=S - 1), valid


def _gather(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """x [B, G, S, D], tokens [B, G, c, T] -> x at those tokens [B, G, c, T, D]."""
    B, G, c, T = tokens.shape
    D = x.shape[3]
    index = tokens.reshape(B, G, c * T, 1).expand(B, G, c * T, D)
    return torch.gather(x, 2, index).view(B, G, c, T, D)


def _scatter_add(acc: torch.Tensor, tokens: torch.Tensor, src: torch.Tensor) -> None:
    """acc [B, G, S, D] += src [B, G, c, T, D] at tokens [B, G, c, T] (repeats add up)."""
    B, G, c, T = tokens.shape
    D = acc.shape[3]
    index = tokens.reshape(B, G, c * T, 1).expand(B, G, c * T, D)
    acc.scatter_add_(2, index, src.reshape(B, G, c * T, D).to(acc.dtype))


def _rows(x: torch.Tensor, G: int, t0: int, t1: int) -> torch.Tensor:
    """x [B, H, S, D] -> the chunk's rows [B, G, c, h, D] (query-major, the group's heads inside)."""
    B, H, _, D = x.shape
    return x.unflatten(1, (G, H // G))[:, :, :, t0:t1].permute(0, 1, 3, 2, 4)


def _chunk_probs(qc, k_sel, valid, scale):
    """Softmax probabilities [B, G, c, h, T] in the upcast dtype, zero on rows without a valid token,
    and the rows' log-sum-exp [B, G, c, h] in float32 (-inf on those rows).

    qc [B, G, c, h, Dk], k_sel [B, G, c, T, Dk], valid [B, G, c, T].
    """
    scores = (qc @ k_sel.transpose(-1, -2)).to(upcast_dtype(qc.dtype)) * scale  # [B, G, c, h, T]
    scores = scores.masked_fill(~valid[:, :, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    has_token = valid.any(dim=-1)[:, :, :, None, None]  # [B, G, c, 1, 1]
    p = torch.where(has_token, p, torch.zeros((), dtype=p.dtype, device=p.device))
    return p, torch.logsumexp(scores, dim=-1).float()


def _chunk_bounds(S: int, chunk: int):
    for t0 in range(0, S, chunk):
        yield t0, min(S, t0 + chunk)


def _reference_forward(q, k, v, block_idx, block_size: int, scale: float, chunk: int | None = None, pos=None,
                       q_offset: int = 0):
    B, H, S, _ = q.shape
    G, Dv = k.shape[1], v.shape[3]
    chunk = chunk or REFERENCE_CHUNK
    out, lse = empty_attention_outputs(q, v)
    for t0, t1 in _chunk_bounds(S, chunk):
        tokens, valid = _chunk_tokens(block_idx, t0, t1, block_size, k.shape[2], pos, q_offset)
        p, row_lse = _chunk_probs(_rows(q, G, t0, t1), _gather(k, tokens), valid, scale)
        o = p.to(v.dtype) @ _gather(v, tokens)  # [B, G, c, h, Dv]
        out[:, :, t0:t1] = o.permute(0, 1, 3, 2, 4).reshape(B, H, t1 - t0, Dv)
        lse[:, :, t0:t1] = row_lse.permute(0, 1, 3, 2).reshape(B, H, t1 - t0)
    return out, lse


def _reference_backward(grad_o, q, k, v, block_idx, block_size: int, scale: float, chunk: int | None = None,
                        pos=None, q_offset: int = 0):
    """dq, dk, dv by recomputing each chunk and applying autograd's formulas for the eager graph.

    Autograd itself cannot run here: a custom op's kernel runs with the autograd dispatch keys
    excluded. The steps below are the backward formulas of the forward's ops, in reverse, in the
    same dtypes:
        o = pv @ v_sel          ->  d_pv = g @ v_sel^T,  dv_sel = pv^T @ g      (v's dtype)
        pv = p.to(v.dtype)      ->  dp = d_pv.to(p.dtype)
        p = softmax(sm)         ->  d_sm = _softmax_backward_data(dp, p)        (upcast dtype)
        sm = masked_fill        ->  zero on invalid tokens (and p == 0 on empty rows gives 0)
        s = a.to(up) * scale    ->  da = (d_sm * scale).to(q.dtype)
        a = q @ k_sel^T         ->  dq = da @ k_sel,  dk_sel = da^T @ q          (q's dtype)
        k_sel, v_sel = gather   ->  scatter-add of dk_sel, dv_sel onto the gathered tokens
    dk_sel and dv_sel of one query are already summed over the group's heads (the h rows contract
    in one matmul); they accumulate in the upcast dtype and are cast once at the end.
    """
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    chunk = chunk or REFERENCE_CHUNK
    up = upcast_dtype(q.dtype)
    dq = bshd_empty(B, H, S, Dk, q)
    # accumulators in the upcast dtype, laid out like the outputs: the final cast keeps the layout
    Skv = k.shape[2]
    dk = bshd_empty(B, G, Skv, Dk, k, upcast_dtype(k.dtype)).zero_()
    dv = bshd_empty(B, G, Skv, Dv, v, upcast_dtype(v.dtype)).zero_()
    for t0, t1 in _chunk_bounds(S, chunk):
        tokens, valid = _chunk_tokens(block_idx, t0, t1, block_size, Skv, pos, q_offset)
        qc, k_sel, v_sel = _rows(q, G, t0, t1), _gather(k, tokens), _gather(v, tokens)
        g = _rows(grad_o, G, t0, t1).to(v.dtype)  # [B, G, c, h, Dv]
        p, _ = _chunk_probs(qc, k_sel, valid, scale)  # [B, G, c, h, T]
        pv = p.to(v.dtype)
        _scatter_add(dv, tokens, pv.transpose(-1, -2) @ g)  # [B, G, c, T, Dv]
        dp = (g @ v_sel.transpose(-1, -2)).to(up)  # [B, G, c, h, T]
        d_sm = torch._softmax_backward_data(dp, p, -1, up)
        d_sm = d_sm.masked_fill(~valid[:, :, :, None, :], 0)
        da = (d_sm * scale).to(q.dtype)
        dq[:, :, t0:t1] = (da @ k_sel).permute(0, 1, 3, 2, 4).reshape(B, H, t1 - t0, Dk)
        _scatter_add(dk, tokens, da.transpose(-1, -2) @ qc)  # [B, G, c, T, Dk]
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _check_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, backend="auto", pos=None,
                    q_offset=0, doc_len=0) -> str:
    chosen = _check(q, k, v, block_idx, block_size, scale, backend, pos, q_offset, doc_len)
    check_grad_o("selected_attention_backward", grad_o, q, v)
    return chosen


def _gradients(saved, grad_o, _grad_lse) -> dict:
    s = saved
    # without pos, an offset or a document length, the call (and so the backward graph) stays as it
    # was before they existed
    packed = ((s.pos, s.q_offset, s.doc_len) if s.doc_len else (s.pos, s.q_offset) if s.q_offset
              else () if s.pos is None else (s.pos,))
    dq, dk, dv = torch.ops.nsa.selected_attention_backward(
        grad_o, s.q, s.k, s.v, s.o, s.lse, s.block_idx, s.block_size, s.scale, s.backend, *packed)
    return {"q": dq, "k": dk, "v": dv}


def _varlen(name: str) -> Backend:
    """A varlen backend: FA-2's varlen kernels through PyTorch ('varlen') or the flash-attn
    package ('varlen_flash_attn'), whose reasons depend on which of the two is named."""
    return Backend(
        name, in_auto=False,
        cannot_run=lambda q, k, v, block_idx, block_size, pos, q_offset: chunk_reason(q, k, q_offset) or (
            selection_varlen.unsupported_reason(q, k, v, block_idx, block_size, name, pos=pos)),
        forward=lambda q, k, v, block_idx, block_size, scale, pos, q_offset, doc_len: selection_varlen.selected_forward(
            q, k, v, block_idx, block_size, scale, name),
        backward=lambda grad_o, q, k, v, o, lse, block_idx, block_size, scale, pos, q_offset, doc_len:
            selection_varlen.selected_backward(
            grad_o, q, k, v, o, lse, block_idx, block_size, scale, name),
        nondeterministic="FA-2's backward accumulates dQ, and index_add dK/dV, with atomic adds")


SELECTION = declare(Op(
    name="selected_attention",
    schema="(Tensor q, Tensor k, Tensor v, Tensor block_idx, SymInt block_size, float scale, "
           'str backend="auto", Tensor? pos=None, int q_offset=0, int doc_len=0) -> (Tensor, Tensor)',
    config_field="selected_attention_backend",
    choice_args=("q", "k", "v", "block_idx", "block_size", "pos", "q_offset"),
    backends=(
        Backend("triton",
                cannot_run=lambda q, k, v, block_idx, block_size, pos, q_offset: selection_triton.unsupported_reason(
                    q, k, v, block_idx, block_size, pos),
                auto_reason=why_not_triton,
                forward=lambda q, k, v, block_idx, block_size, scale, pos, q_offset, doc_len:
                    selection_triton.selected_forward(q, k, v, block_idx, block_size, scale, pos, q_offset, doc_len),
                backward=lambda grad_o, q, k, v, o, lse, block_idx, block_size, scale, pos, q_offset, doc_len:
                    selection_triton.selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, pos,
                                                       q_offset, doc_len)),
        _varlen("varlen"),
        _varlen("varlen_flash_attn"),
        # its backward scatter-adds dK/dV: on CUDA repeatable under torch.use_deterministic_algorithms(True),
        # which OptimizeConfig(deterministic=True) asks the user to set for the rest of the model too
        Backend("reference",
                forward=lambda q, k, v, block_idx, block_size, scale, pos, q_offset, doc_len: _reference_forward(
                    q, k, v, block_idx, block_size, scale, pos=pos, q_offset=q_offset),
                backward=lambda grad_o, q, k, v, o, lse, block_idx, block_size, scale, pos, q_offset, doc_len:
                    _reference_backward(grad_o, q, k, v, block_idx, block_size, scale, pos=pos, q_offset=q_offset)),
    ),
    check=_check,
    fake=lambda q, k, v, *_: empty_attention_outputs(q, v),
    backward_schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor block_idx, "
                    'SymInt block_size, float scale, str backend="auto", Tensor? pos=None, int q_offset=0, '
                    'int doc_len=0) -> (Tensor, Tensor, Tensor)',
    check_backward=_check_backward,
    backward_fake=lambda grad_o, q, k, v, *_: empty_attention_grads(q, k, v),
    outputs=("o", "lse"),
    non_differentiable=("lse",),
    gradients=_gradients,
))
selected_attention_backward = SELECTION.backward_op


def selected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_size: int, scale: float,
    backend: str = "auto", pos: torch.Tensor | None = None, q_offset: int = 0, doc_len: int = 0,
) -> torch.Tensor:
    """The output o of `torch.ops.nsa.selected_attention` (see the module docstring)."""
    if doc_len:
        return torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend, pos, q_offset,
                                                doc_len)[0]
    if q_offset:
        return torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend, pos, q_offset)[0]
    if pos is None:
        return torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend)[0]
    return torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend, pos)[0]
