"""What the attention ops share: the eager upcast rule, the argument checks, auto's CUDA rule
for Triton and the layout of their outputs (the backend choice itself: registry.py).

    upcast_dtype(dtype)                        the eager model's fp16/bf16 -> fp32 rule
    check_gqa, check_qkv, check_positive_int, check_grad_o
                                               ValueError naming the op and the argument
    why_not_triton_on(device, reason, ...)     why auto does not take a Triton backend
    bshd_empty, empty_attention_outputs, empty_attention_grads
                                               outputs in [B, S, heads, D] memory (kernels and fakes)
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 -> float32; float32 and float64 stay (models/nsa.py `upcast`)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_gqa(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, rows: str = "S",
              **same_device: torch.Tensor) -> None:
    """Raise ValueError (prefixed with `op`) unless q [B, H, S, Dk] and k [B, G, rows, Dk] (and
    v [B, G, rows, Dv] where given) fit together as GQA attention: floating point, q and k in one
    dtype, the batch size and Dk shared, G >= 1 KV heads in k (and v) with H a multiple of G.
    `same_device` names further tensors that must share the device. The length of k's and v's
    third dim is the caller's to check (`rows` only names it in the messages: S tokens, or Tc
    compression tokens)."""
    kv = {"k": k} if v is None else {"k": k, "v": v}
    layouts = {"q": "[B, H, S, Dk]", "k": f"[B, G, {rows}, Dk]", "v": f"[B, G, {rows}, Dv]"}
    for name, t in {"q": q, **kv}.items():
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D {layouts[name]}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    if q.dtype != k.dtype:
        raise ValueError(f"{op}: q and k must share a dtype (q @ k^T), got {q.dtype} and {k.dtype}")
    tensors = {"q": q, **kv, **same_device}
    if len({t.device for t in tensors.values()}) != 1:
        devices = ", ".join(str(t.device) for t in tensors.values())
        raise ValueError(f"{op}: {', '.join(tensors)} must be on one device, got {devices}")
    B, H, _, Dk = q.shape
    if any(t.shape[0] != B for t in kv.values()):
        raise ValueError(f"{op}: batch sizes differ: q {B}, {', '.join(f'{n} {t.shape[0]}' for n, t in kv.items())}")
    if k.shape[3] != Dk:
        raise ValueError(f"{op}: q and k head dims differ: {Dk} and {k.shape[3]}")
    G = k.shape[1]
    if v is not None and v.shape[1] != G:
        raise ValueError(f"{op}: k and v must have the same number of KV heads, got {G} and {v.shape[1]}")
    if G < 1:
        need = "k needs" if v is None else "k and v need"
        raise ValueError(f"{op}: {need} at least one KV head (G >= 1)")
    if H % G != 0:
        raise ValueError(f"{op}: query heads H={H} must be a multiple of KV heads G={G}")


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **same_device: torch.Tensor) -> None:
    """`check_gqa` for attention over the sequence itself: k [B, G, S, Dk] and v [B, G, S, Dv]
    hold q's S tokens."""
    check_gqa(op, q, k, v, **same_device)
    S = q.shape[2]
    if k.shape[2] != S or v.shape[2] != S:
        raise ValueError(f"{op}: sequence lengths differ: q {S}, k {k.shape[2]}, v {v.shape[2]}")


def check_positive_int(op: str, name: str, value, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{op}: {name} must be >= 1{what}, got {value}")


def check_grad_o(op: str, grad_o: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    want = (*q.shape[:3], v.shape[3])
    if tuple(grad_o.shape) != tuple(want):
        raise ValueError(f"{op}: grad_o must have shape {tuple(want)}, got {tuple(grad_o.shape)}")


def why_not_triton_on(device: torch.device, unsupported: Callable[[], "str | None"],
                      kernels: str = "the Triton kernels run") -> str | None:
    """Why 'auto' does not take a Triton backend: off CUDA `<kernels> on CUDA (tensors on cpu)`,
    on CUDA the kernel module's own reason (None: it takes it). 'auto' never takes Triton's CPU
    interpreter; named explicitly, triton also runs on the CPU under TRITON_INTERPRET=1 (the
    tests do that)."""
    if device.type != "cuda":
        return f"{kernels} on CUDA (tensors on {device.type})"
    return unsupported()


def bshd_empty(B: int, heads: int, S: int, D: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty [B, heads, S, D] tensor laid out as [B, S, heads, D]: the layout of every attention
    op's outputs and gradients (the model's projections are [B, S, heads, D]), in real kernels and
    fakes alike (Inductor trusts a custom op's fake strides)."""
    return like.new_empty((B, S, heads, D), dtype=dtype or like.dtype).transpose(1, 2)


def empty_attention_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty o [B, H, S, Dv] in v's dtype ([B, S, H, Dv] memory) and lse [B, H, S] float32 for
    q [B, H, S, Dk]: what the attention ops return."""
    B, H, S, _ = q.shape
    return bshd_empty(B, H, S, v.shape[3], v), q.new_empty((B, H, S), dtype=torch.float32)


def empty_attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty dq, dk, dv with the shapes and dtypes of q, k, v, each in [B, S, heads, D] memory:
    what the attention ops' backward ops return."""
    return tuple(bshd_empty(*x.shape, x) for x in (q, k, v))


def check_offset(op: str, q_offset, pos) -> None:
    """q_offset (the token of query row 0: a chunk of queries, issue 17) must be an int >= 0, and
    0 with packed documents (pos: each row's position is pos's)."""
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, torch.SymInt)):
        raise ValueError(f"{op}: q_offset must be an int, got {type(q_offset).__name__}")
    if q_offset < 0:
        raise ValueError(f"{op}: q_offset must be >= 0, got {q_offset}")
    if pos is not None and q_offset != 0:
        raise ValueError(f"{op}: q_offset must be 0 with pos (packed documents give each row its position)")
