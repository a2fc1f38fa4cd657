"""Sliding-window causal attention with GQA as a functional custom op (NSA section 4).

    o, lse = torch.ops.nsa.window_attention(q, k, v, window, scale, backend, pos, q_offset)
    o = window_attention(q, k, v, window, scale, backend="auto", pos=None, q_offset=0)   # the output only

q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv] with H = G * h: query head j reads KV head
j // h (GQA-native: K and V are never repeated). Query t attends to keys s with s <= t and
t - s < window. o [B, H, S, Dv] in v's dtype (a view of [B, S, H, Dv] memory, the layout the
model's `o.transpose(1, 2)` reads next), lse [B, H, S] float32: the log-sum-exp of each row's
scaled scores. The eager model's arithmetic (`NSAAttention.window_attention`, models/nsa.py):

    scores = upcast(q @ k^T) * scale         # fp16/bf16 -> fp32, fp32/fp64 stay
    p = softmax(scores.masked_fill(~in_window, -inf), dim=-1)
    o = p.to(v.dtype) @ v

Packed documents (NSA_SEMANTICS.md section 6): pos [B, S] int64 (None: one document per row) is
each token's position in its own document (0 at a document start), the tensor the eager model
takes. Query t then also needs s >= t - pos[t]: it sees only keys of its own document (the eager
`window_attention(..., pos)` of models/nsa.py, whose mask is [B, 1, S, S]).

A chunk of queries (`q_offset`, an int, default 0; issue 17): query row r of q is token
q_offset + r, and k, v hold the sequence's first Sk >= q_offset + S tokens (key s is token s):
row r attends to the keys s <= q_offset + r with q_offset + r - s < window. A model that loops
over query chunks, each chunk attending to a slice of K/V that starts at or before its first
row's first key, becomes one call per chunk on the whole K/V with the chunk's first token as
q_offset. Why the whole K/V and not a second `k_offset` for a key slice: the op's default call
(q_offset 0, Sk = S) is exactly the one before; the pass proves the slice reaches back at least
as far as the window (passes/window_attention.py widens it to the tensor it was cut from); the
key index stays the key's token in every backend, so the offset is one int added to a row's
token where it is compared with a key's; and dk, dv have K/V's shape, as the slice's gradient
has after autograd scatters it back. Keys past the last row's token are never read (dk, dv are 0
there). Not with pos (ValueError): packed documents are matched over the whole sequence only,
where S = Sk.

Backward is a second op, `nsa::window_attention_backward(grad_o, q, k, v, o, lse, window,
scale, backend, pos, q_offset) -> (dq, dk, dv)`, with dk and dv summed over each group's h query
heads; pos gets no gradient.

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error):
- `triton` (auto takes it on CUDA in fp16/bf16, with or without pos): this project's kernels
  (nsa_compile/ops/window_triton.py), GQA-native, any head dims <= 256, the flash backend's
  numerics (fp32 scores, fp32 softmax), and no atomics (its backward is bitwise repeatable).
  Measured faster than FA-2 with a window on an H100 at the seed and the paper shapes
  (BENCHMARKS.md, "Window branch"). A chunk of queries: the kernels take Sk and q_offset as
  int arguments (see window_triton.py). Packed documents: each kernel reads pos on the device and
  masks s >= t - pos[t] per query (no host sync, capturable in a CUDA graph, one compiled
  kernel for every packing), so with pos auto takes it before flash, whose varlen form reads
  the documents back to the host on every call. Where pos is not a position it applies the same
  mask: pos[t] > t keeps every key of the window, and a row left with no key (pos[t] < 0) gets
  o 0, lse -inf and zero gradients (where the eager formula and reference give NaN).
- `flash`: FlashAttention-2 with a window (left w - 1, right 0), GQA-native, through PyTorch's
  own kernels (nsa_compile/ops/flash.py): CUDA, fp16/bf16, Dk == Dv <= 256, the whole sequence
  only (S = Sk: FA-2 aligns fewer queries to the keys' end, not to q_offset). Scores are
  accumulated in fp32 (eager rounds q @ k^T to fp16/bf16 first): closer to the exact result.
  With pos it runs FA-2's varlen form with one sequence per document (`flash.document_seqlens`:
  cut at every row start and every pos == 0). FA-2 needs the number of documents and the
  longest one on the host, so each call (forward, and again backward) reads them back from the
  device: one host sync per call, and not capturable in a CUDA graph. It also checks there that
  pos counts up by one within each document (ValueError otherwise), the condition under which
  its sequences are exactly the eager mask term.
- `reference` (every device and dtype): PyTorch, chunked over query rows, the eager arithmetic
  step for step. A chunk of C queries at tokens [t0, t1) (q_offset + its rows) reads only the
  keys [t0 - window + 1, t1), so memory is O(B * H * C * (C + window)) and no [S, S] tensor is
  built (with pos, the document
  mask is made per chunk too: [B, C, C + window - 1]). The group's h heads are folded into the
  rows of one matmul per (batch, group), so K and V are read once per group. The backward
  recomputes each chunk's probabilities and applies the formulas autograd applies to the eager
  graph (written out, see `_reference_backward`). It takes any pos, valid or not, as the eager
  formula does (no sync: its values are never read back).
"""

from __future__ import annotations

import torch

from . import flash, window_triton
from .common import (
    bshd_empty, check_gqa, check_grad_o, check_offset, check_positive_int, check_qkv, empty_attention_grads,
    empty_attention_outputs, upcast_dtype, why_not_triton_on,
)
from .registry import Backend, Op, declare

__all__ = ["WINDOW", "choose_backend", "why_not_triton", "window_attention", "window_attention_backward"]

# Query rows per chunk of the reference backend (a module constant so tests can shrink it).
REFERENCE_CHUNK = 128


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, backend: str,
           pos: torch.Tensor | None = None, q_offset: int = 0) -> str:
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, window, positions, offset and backend are valid."""
    op = "window_attention"
    check_offset(op, q_offset, pos)
    if pos is not None or (q_offset == 0 and k.shape[2] == q.shape[2]):
        check_qkv(op, q, k, v, **({} if pos is None else {"pos": pos}))
    else:  # a chunk of queries: K/V of the sequence up to (at least) the chunk's last row
        check_gqa(op, q, k, v)
        if k.shape[2] != v.shape[2] or k.shape[2] < q_offset + q.shape[2]:
            raise ValueError(f"{op}: a chunk of queries needs k and v of Sk >= q_offset + S = "
                             f"{q_offset + q.shape[2]} tokens, got {k.shape[2]} and {v.shape[2]}")
    check_positive_int(op, "window", window, " (the query itself)")
    B, S = q.shape[0], q.shape[2]
    if pos is not None and (pos.dtype != torch.int64 or tuple(pos.shape) != (B, S)):
        raise ValueError(f"window_attention: pos must be an int64 tensor of shape [B, S] = [{B}, {S}] "
                         f"(each token's position in its document), got {pos.dtype} {tuple(pos.shape)}")
    return choose_backend(q, k, v, backend, pos)


def choose_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto",
                   pos: torch.Tensor | None = None) -> str:
    """`WINDOW.choose` (ops/registry.py): `backend` itself (ValueError, with why, where it cannot
    run these inputs), or for 'auto' triton where `why_not_triton` says nothing, else flash where
    it can run, else reference."""
    return WINDOW.choose(backend, q, k, v, pos)


def why_not_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None) -> str | None:
    """Why 'auto' does not take the triton backend (None: it does): off CUDA, what the kernels
    cannot run, or fp32 (where auto keeps the eager arithmetic: reference). Packed documents
    (pos) change nothing: the kernels take them with no host sync, where flash needs one; nor
    does a chunk of queries (the kernels take any q_offset)."""
    why = why_not_triton_on(q.device, lambda: window_triton.unsupported_reason(q, k, v, pos))
    if why is None and q.dtype not in (torch.float16, torch.bfloat16):
        why = f"auto takes the Triton window kernels in fp16/bf16 only ({str(q.dtype).removeprefix('torch.')}: reference)"
    return why


def _chunk_bounds(S: int, window: int, chunk: int, q_offset: int = 0):
    """(r0, r1, t0, t1, s0) per chunk: query rows [r0, r1), at tokens [t0, t1) = q_offset + the
    rows, read keys [s0, t1)."""
    for r0 in range(0, S, chunk):
        r1 = min(S, r0 + chunk)
        t0 = q_offset + r0
        yield r0, r1, t0, q_offset + r1, max(0, t0 - window + 1)


def _chunk_probs(qc, kc, t0, t1, s0, window, scale, pos=None):
    """Softmax probabilities of one chunk, the eager way.

    qc [B, G, h * c, Dk] (rows ordered head-major: row i*c + r is head i, query t0 + r),
    kc [B, G, L, Dk] for keys [s0, t1). Returns p [B, G, h * c, L] in the upcast dtype, the
    mask (True = attended) as it broadcasts over [B, G, h, c, L] ([c, L], or [B, 1, 1, c, L]
    with pos) and the rows' log-sum-exp.
    """
    B, G, hc, _ = qc.shape
    c, L = t1 - t0, t1 - s0
    t = torch.arange(t0, t1, device=qc.device)[:, None]
    s = torch.arange(s0, t1, device=qc.device)[None, :]
    in_window = (s <= t) & (t - s < window)  # [c, L]
    if pos is not None:  # and the query's own document: keys from its start t - pos[t] on
        in_window = (in_window & (s >= t - pos[:, t0:t1, None]))[:, None, None]  # [B, 1, 1, c, L]
    scores = (qc @ kc.transpose(-1, -2)).to(upcast_dtype(qc.dtype)) * scale  # [B, G, h*c, L]
    scores = scores.view(B, G, hc // c, c, L).masked_fill(~in_window, float("-inf"))
    p = torch.softmax(scores, dim=-1).view(B, G, hc, L)
    return p, in_window, torch.logsumexp(scores, dim=-1).float()


def _rows(x: torch.Tensor, G: int, t0: int, t1: int) -> torch.Tensor:
    """x [B, H, S, D] -> the chunk's rows [B, G, h * (t1 - t0), D] (a copy of c rows per head)."""
    B, H, _, D = x.shape
    return x.unflatten(1, (G, H // G))[:, :, :, t0:t1].reshape(B, G, (H // G) * (t1 - t0), D)


def _reference_forward(q, k, v, window: int, scale: float, chunk: int | None = None, pos=None, q_offset: int = 0):
    """o [B, H, S, Dv] (in [B, S, H, Dv] memory) and lse [B, H, S] in float32."""
    B, H, S, _ = q.shape
    G, Dv = k.shape[1], v.shape[3]
    chunk = chunk or REFERENCE_CHUNK
    out, lse = empty_attention_outputs(q, v)
    for r0, r1, t0, t1, s0 in _chunk_bounds(S, window, chunk, q_offset):
        p, _, row_lse = _chunk_probs(_rows(q, G, r0, r1), k[:, :, s0:t1], t0, t1, s0, window, scale, pos)
        o = p.to(v.dtype) @ v[:, :, s0:t1]  # [B, G, h*c, Dv]
        out[:, :, r0:r1] = o.view(B, H, r1 - r0, Dv)
        lse[:, :, r0:r1] = row_lse.view(B, H, r1 - r0)
    return out, lse


def _reference_backward(grad_o, q, k, v, window: int, scale: float, chunk: int | None = None, pos=None,
                        q_offset: int = 0):
    """dq, dk, dv by recomputing each chunk and applying autograd's formulas for the eager graph.

    Autograd itself cannot run here: a custom op's kernel runs with the autograd dispatch keys
    excluded, so tensors built inside it never get a grad_fn. The steps below are the backward
    formulas of the forward's ops, in reverse, in the same dtypes:
        o = pv @ v          ->  d_pv = g @ v^T,  dv = pv^T @ g          (v's dtype)
        pv = p.to(v.dtype)  ->  dp = d_pv.to(p.dtype)
        p = softmax(sm)     ->  d_sm = _softmax_backward_data(dp, p)    (upcast dtype)
        sm = masked_fill    ->  zero outside the window
        s = a.to(up) * scale -> da = (d_sm * scale).to(q.dtype)
        a = q @ k^T         ->  dq = da @ k,  dk = da^T @ q              (q's dtype)
    dk and dv of one chunk are already summed over the group's heads (the h*c rows contract in
    one matmul); across chunks they accumulate in the upcast dtype and are cast once at the end.
    With q_offset, dk and dv have K/V's Sk tokens: 0 at keys no row reads.
    """
    B, H, S, Dk = q.shape
    G, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    h = H // G
    chunk = chunk or REFERENCE_CHUNK
    up = upcast_dtype(q.dtype)
    dq = bshd_empty(B, H, S, Dk, q)
    # accumulators in the upcast dtype, laid out like the outputs: the final cast keeps the layout
    dk = bshd_empty(B, G, Sk, Dk, k, upcast_dtype(k.dtype)).zero_()
    dv = bshd_empty(B, G, Sk, Dv, v, upcast_dtype(v.dtype)).zero_()
    for r0, r1, t0, t1, s0 in _chunk_bounds(S, window, chunk, q_offset):
        c, L = t1 - t0, t1 - s0
        qc, kc, vc = _rows(q, G, r0, r1), k[:, :, s0:t1], v[:, :, s0:t1]
        g = _rows(grad_o, G, r0, r1).to(v.dtype)  # [B, G, h*c, Dv]
        p, in_window, _ = _chunk_probs(qc, kc, t0, t1, s0, window, scale, pos)  # [B, G, h*c, L]
        pv = p.to(v.dtype)
        dv[:, :, s0:t1] += pv.transpose(-1, -2) @ g  # [B, G, L, Dv]
        dp = (g @ vc.transpose(-1, -2)).to(up)  # [B, G, h*c, L]
        d_sm = torch._softmax_backward_data(dp, p, -1, up)
        d_sm = d_sm.view(B, G, h, c, L).masked_fill(~in_window, 0).view(B, G, h * c, L)
        da = (d_sm * scale).to(q.dtype)
        dq[:, :, r0:r1] = (da @ kc).view(B, H, c, Dk)
        dk[:, :, s0:t1] += da.transpose(-1, -2) @ qc  # [B, G, L, Dk]
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _documents(pos: torch.Tensor | None) -> dict:
    """flash's sequence arguments: one per document with pos (one host sync), else one per row."""
    if pos is None:
        return {}
    try:
        cu_seqlens, max_seqlen = flash.document_seqlens(pos)
    except ValueError as why:
        raise ValueError(f"window_attention: backend 'flash': {why}") from None
    return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}


def _check_backward(grad_o, q, k, v, o, lse, window, scale, backend="auto", pos=None, q_offset=0) -> str:
    chosen = _check(q, k, v, window, scale, backend, pos, q_offset)
    check_grad_o("window_attention_backward", grad_o, q, v)
    return chosen


def _gradients(saved, grad_o, _grad_lse) -> dict:
    s = saved
    # without pos and q_offset, the call (and so the backward graph) stays as it was before they existed
    packed = (s.pos, s.q_offset) if s.q_offset else () if s.pos is None else (s.pos,)
    dq, dk, dv = torch.ops.nsa.window_attention_backward(grad_o, s.q, s.k, s.v, s.o, s.lse, s.window, s.scale,
                                                         s.backend, *packed)
    return {"q": dq, "k": dk, "v": dv}


def flash_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None) -> str | None:
    """Why the flash backend cannot run these inputs (None: it can). Packed documents never rule it
    out (it takes them as its varlen sequences); a chunk of queries does, and shows in the shapes:
    the op checks Sk >= q_offset + S, so any q_offset > 0 has Sk > S, and a chunk at 0 of a longer
    K/V has too. FA-2 would align such queries to the keys' end, not to q_offset."""
    if k.shape[2] != q.shape[2]:
        return (f"a chunk of queries ({q.shape[2]} queries, {k.shape[2]} keys): FA-2 aligns the queries to the "
                "keys' end, not to q_offset")
    return flash.unsupported_reason(q, k, v)


WINDOW = declare(Op(
    name="window_attention",
    schema='(Tensor q, Tensor k, Tensor v, SymInt window, float scale, str backend="auto", Tensor? pos=None, '
           "int q_offset=0) -> (Tensor, Tensor)",
    config_field="window_attention_backend",
    # q_offset is not among them: a chunk shows in the shapes (Sk != S), which is all flash needs
    choice_args=("q", "k", "v", "pos"),
    backends=(
        Backend("triton", cannot_run=window_triton.unsupported_reason, auto_reason=why_not_triton,
                forward=lambda q, k, v, window, scale, pos, q_offset: window_triton.window_forward(
                    q, k, v, window, scale, pos, q_offset),
                backward=lambda grad_o, q, k, v, o, lse, window, scale, pos, q_offset: window_triton.window_backward(
                    grad_o, q, k, v, o, lse, window, scale, pos, q_offset)),
        Backend("flash", cannot_run=flash_reason,
                forward=lambda q, k, v, window, scale, pos, q_offset: flash.flash_forward(
                    q, k, v, scale, window, **_documents(pos)),
                backward=lambda grad_o, q, k, v, o, lse, window, scale, pos, q_offset: flash.flash_backward(
                    grad_o, q, k, v, o, lse, scale, window, **_documents(pos)),
                nondeterministic="FA-2's backward accumulates dQ with atomic adds (not bitwise repeatable)"),
        Backend("reference",
                forward=lambda q, k, v, window, scale, pos, q_offset: _reference_forward(
                    q, k, v, window, scale, pos=pos, q_offset=q_offset),
                backward=lambda grad_o, q, k, v, o, lse, window, scale, pos, q_offset: _reference_backward(
                    grad_o, q, k, v, window, scale, pos=pos, q_offset=q_offset)),
    ),
    check=_check,
    fake=lambda q, k, v, *_: empty_attention_outputs(q, v),
    backward_schema="(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, SymInt window, float scale, "
                    'str backend="auto", Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor, Tensor)',
    check_backward=_check_backward,
    backward_fake=lambda grad_o, q, k, v, *_: empty_attention_grads(q, k, v),
    outputs=("o", "lse"),
    non_differentiable=("lse",),
    gradients=_gradients,
))
window_attention_backward = WINDOW.backward_op


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, backend: str = "auto",
    pos: torch.Tensor | None = None, q_offset: int = 0,
) -> torch.Tensor:
    """The output o of `torch.ops.nsa.window_attention` (see the module docstring)."""
    if q_offset:
        return torch.ops.nsa.window_attention(q, k, v, window, scale, backend, pos, q_offset)[0]
    if pos is None:
        return torch.ops.nsa.window_attention(q, k, v, window, scale, backend)[0]
    return torch.ops.nsa.window_attention(q, k, v, window, scale, backend, pos)[0]
