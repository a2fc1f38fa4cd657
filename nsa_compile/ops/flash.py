"""FlashAttention-2 as PyTorch ships it (`aten._flash_attention_forward/_backward`): the CUDA
route of the window op, and later of the varlen selection backend.

Layout: the varlen form, [B * S, heads, D] with cu_seqlens 0, S, 2S, ..., B*S, since the batch
form's backward takes cumulative-length tensors that Python cannot leave undefined. Packed
documents use the same form with one sequence per document: `document_seqlens(pos)` gives their
cu_seqlens and longest length, and flash_forward / flash_backward take them. GQA-native:
K/V with G heads serve H = G * h query heads (FA-2 maps query head j to KV head j // h, the
same mapping as `repeat_interleave(h, dim=heads)`), and its backward sums dK/dV over the group.
A window (left, 0) with is_causal=True lets query t see keys t - left .. t.

Tensors cross this module in the ops' layout: q/k/v/o [B, heads, S, D] (any strides) and the
log-sum-exp [B, H, S] float32 (natural log); results come back as [B, heads, S, D] views of
[B, S, heads, D] memory, which is what a model's `o.transpose(1, 2)` wants next.
"""

from __future__ import annotations

import torch

__all__ = ["document_seqlens", "flash_backward", "flash_forward", "unsupported_reason"]

MAX_HEAD_DIM = 256


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why FA-2 cannot compute attention over these q, k, v (None: it can). Works on fake tensors."""
    if q.device.type != "cuda":
        return f"FA-2 runs on CUDA only (tensors on {q.device.type})"
    if torch.version.hip:
        return "FA-2's ROCm build uses another log-sum-exp layout (not supported here)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FA-2 computes in float16/bfloat16 only ({str(q.dtype).removeprefix('torch.')} needs the exact route)"
    if v.dtype != q.dtype:
        return f"FA-2 needs q, k and v in one dtype (q {q.dtype}, v {v.dtype})"
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Dk != Dv:
        return f"FA-2 needs equal head dims for K and V (Dk {Dk}, Dv {Dv})"
    if Dk > MAX_HEAD_DIM or Dk % 8:
        return f"FA-2 needs a head dim that is a multiple of 8 and at most {MAX_HEAD_DIM} (got {Dk})"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this PyTorch has no aten._flash_attention_forward"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this PyTorch build has no FlashAttention kernels"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return f"FA-2 needs compute capability 8.0 or newer (this GPU: {major}.x)"
    return None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, S, D] -> [B * S, heads, D] (a view when x is [B, S, heads, D] in memory)."""
    B, heads, S, D = x.shape
    return x.transpose(1, 2).reshape(B * S, heads, D)


def _unflat(x: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """[B * S, heads, D] -> [B, heads, S, D] (a view)."""
    return x.view(B, S, x.shape[1], x.shape[2]).transpose(1, 2)


def _row_seqlens(B: int, S: int, device) -> tuple[torch.Tensor, int]:
    """One sequence per batch row: cu_seqlens 0, S, ..., B*S and the longest length S."""
    return torch.arange(0, (B + 1) * S, S, device=device, dtype=torch.int32), S


def document_seqlens(pos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """FA-2's sequences for packed documents: (cu_seqlens [docs + 1] int32, max_seqlen).

    pos [B, S] int64 is each token's position in its document (models/nsa.py). The sequences
    cut the flattened [B * S] token stream at every row start b * S and at every token with
    pos == 0, so that within a sequence query t sees keys from its start on: exactly the eager
    mask term s >= t - pos[t] (clipped at the row start), provided pos counts up by one from
    each document start. A row may begin inside a document (pos[b, 0] > 0, a stream cut into
    rows): its first sequence then starts at the row. Anything else (a step other than +1 or a
    restart at 0, a negative position) raises ValueError: FA-2 would silently attend by other
    documents than the eager formula.

    FA-2 takes the number of sequences and max_seqlen as host integers, so this reads three
    numbers back from the device (documents, longest, invalid steps): one host sync per call.
    The boundaries themselves stay on the device (searchsorted over the running count of starts).
    """
    B, S = pos.shape
    device = pos.device
    if B * S == 0:
        return torch.zeros(1, device=device, dtype=torch.int32), 0
    t = torch.arange(S, device=device)
    starts = (pos == 0) | (t == 0)  # [B, S]: a sequence begins here
    steps_ok = (pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)  # [B, S - 1]
    invalid = (~steps_ok).sum() + (pos[:, 0] < 0).sum()
    # the token's index in its sequence + 1: pos + 1, or t + 1 in a row's first, cut document
    length_so_far = torch.minimum(pos, t) + 1  # [B, S]
    docs, max_seqlen, bad = torch.stack([starts.sum(), length_so_far.max(), invalid]).tolist()  # the sync
    if bad:
        raise ValueError(f"pos must count up by one within each document and restart at 0 ({bad} tokens "
                         "break that): FA-2's sequences are cut where pos == 0")
    count = starts.reshape(-1).cumsum(0)  # [B * S]: sequences begun up to each token
    first = torch.searchsorted(count, torch.arange(1, docs + 1, device=device))  # token where sequence i begins
    total = torch.full((1,), B * S, device=device, dtype=first.dtype)
    return torch.cat([first, total]).to(torch.int32), int(max_seqlen)


def _window_args(window: int | None) -> dict:
    # None: plain causal; w: keys t - w + 1 .. t
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def _sequences(B: int, S: int, device, cu_seqlens: torch.Tensor | None, max_seqlen: int | None):
    if (cu_seqlens is None) != (max_seqlen is None):
        raise ValueError("flash: give cu_seqlens and max_seqlen together (or neither: one sequence per row)")
    return _row_seqlens(B, S, device) if cu_seqlens is None else (cu_seqlens, max_seqlen)


def flash_forward(q, k, v, scale: float, window: int | None = None, cu_seqlens: torch.Tensor | None = None,
                  max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (optionally windowed) GQA attention: o [B, H, S, D] in q's dtype, lse [B, H, S] float32.
    cu_seqlens / max_seqlen (`document_seqlens`): sequences over the flattened [B * S] tokens,
    default one per row."""
    B, H, S, _ = q.shape
    cu, longest = _sequences(B, S, q.device, cu_seqlens, max_seqlen)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _flat(q), _flat(k), _flat(v), cu, cu, longest, longest, 0.0, True, False, scale=scale, **_window_args(window)
    )
    # lse comes as [H, B * S] in the varlen form (token order of the flattened stream)
    return _unflat(out, B, S), lse.view(H, B, S).transpose(0, 1).contiguous()


def flash_backward(grad_o, q, k, v, o, lse, scale: float, window: int | None = None,
                   cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None):
    """dq [B, H, S, D], dk and dv [B, G, S, D] (summed over each group's heads) of `flash_forward`
    (with the same sequences)."""
    B, H, S, _ = q.shape
    cu, longest = _sequences(B, S, q.device, cu_seqlens, max_seqlen)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
    unused = torch.empty(0, device=q.device)
    lse_flat = lse.transpose(0, 1).reshape(H, B * S)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _flat(grad_o.to(q.dtype)), _flat(q), _flat(k), _flat(v), _flat(o), lse_flat, cu, cu, longest, longest, 0.0,
        True, rng_state, unused, scale=scale, **_window_args(window)
    )
    return _unflat(dq, B, S), _unflat(dk, B, S), _unflat(dv, B, S)
