"""What the attention ops share: the eager upcast rule and the argument checks."""

from __future__ import annotations

import torch


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 -> float32; float32 and float64 stay (models/nsa.py `upcast`)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **same_device: torch.Tensor) -> None:
    """Raise ValueError (prefixed with `op`) unless q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv]
    fit together as GQA attention; `same_device` names further tensors that must share the device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            want = "[B, H, S, Dk]" if name == "q" else f"[B, G, S, {'Dk' if name == 'k' else 'Dv'}]"
            raise ValueError(f"{op}: {name} must be 4-D {want}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    if q.dtype != k.dtype:
        raise ValueError(f"{op}: q and k must share a dtype (q @ k^T), got {q.dtype} and {k.dtype}")
    tensors = {"q": q, "k": k, "v": v, **same_device}
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(
            f"{op}: {', '.join(tensors)} must be on one device, got {', '.join(str(t.device) for t in tensors.values())}"
        )
    B, H, S, Dk = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"{op}: batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[2] != S or v.shape[2] != S:
        raise ValueError(f"{op}: sequence lengths differ: q {S}, k {k.shape[2]}, v {v.shape[2]}")
    if k.shape[3] != Dk:
        raise ValueError(f"{op}: q and k head dims differ: {Dk} and {k.shape[3]}")
    G = k.shape[1]
    if v.shape[1] != G:
        raise ValueError(f"{op}: k and v must have the same number of KV heads, got {G} and {v.shape[1]}")
    if G < 1:
        raise ValueError(f"{op}: k and v need at least one KV head (G >= 1)")
    if H % G != 0:
        raise ValueError(f"{op}: query heads H={H} must be a multiple of KV heads G={G}")


def check_positive_int(op: str, name: str, value, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{op}: {name} must be >= 1{what}, got {value}")


def check_grad_o(op: str, grad_o: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    want = (*q.shape[:3], v.shape[3])
    if tuple(grad_o.shape) != tuple(want):
        raise ValueError(f"{op}: grad_o must have shape {tuple(want)}, got {tuple(grad_o.shape)}")


def bshd_empty(B: int, heads: int, S: int, D: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty [B, heads, S, D] tensor laid out as [B, S, heads, D]: the layout of every attention
    op's outputs and gradients (the model's projections are [B, S, heads, D]), in real kernels and
    fakes alike (Inductor trusts a custom op's fake strides)."""
    return like.new_empty((B, S, heads, D), dtype=dtype or like.dtype).transpose(1, 2)
