"""Host-side helpers the Triton kernel modules share (plain Python: no kernel code here).

    interpreting()           whether triton.jit builds kernels for Triton's CPU interpreter
    device_reason(*tensors)  why Triton kernels cannot run on these tensors' device (None: they can)
    qkv_reason(q, k, v, max_head_dim)
                             why attention kernels cannot take these q, k, v (dtypes, ranks, head dims)
    row_reductions(interpreted, *ops)
                             the row reductions ('max', 'min', 'sum') a kernel module installs
    next_pow2(x), cdiv(a, b)
    dot_precision(dtype)     tl.dot's input_precision: IEEE for fp32 (no TF32), ignored for fp16/bf16
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel modules say why their kernels cannot run
    triton = tl = None

__all__ = ["KERNEL_DTYPES", "cdiv", "device_reason", "dot_precision", "interpreting", "next_pow2", "qkv_reason",
           "row_reductions"]

# The dtypes the kernels take (fp32 without TF32: IEEE dots).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether triton.jit builds kernels for Triton's CPU interpreter: Triton's own setting
    (TRITON_INTERPRET, read through its knobs exactly as triton.jit reads it); this project
    reads no environment itself."""
    return bool(triton.knobs.runtime.interpret)


def device_reason(*tensors: torch.Tensor | None) -> str | None:
    """Why Triton kernels cannot run on these tensors (None entries are skipped): triton is not
    installed, they are on several devices, or not on CUDA while Triton does not interpret
    (TRITON_INTERPRET=1 runs them on the CPU). None when the device is fine; the kernel module
    checks the rest (dtypes, sizes)."""
    if triton is None:
        return "triton is not installed"
    devices = {t.device.type for t in tensors if t is not None}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(devices)}"
    if devices != {"cuda"} and not interpreting():
        return f"device {devices.pop()} (needs CUDA, or TRITON_INTERPRET=1 for the CPU interpreter)"
    return None


def qkv_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_head_dim: int) -> str | None:
    """Why attention kernels cannot take q [B, H, S, Dk], k [B, G, T, Dk], v [B, G, T, Dv]: not
    one dtype of KERNEL_DTYPES for all three, not 4-D, or a head dim over `max_head_dim` (None:
    they can; the kernel module checks the rest)."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in KERNEL_DTYPES:
        return f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype} (needs one of fp16, bf16, fp32 for all three)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D"
    if q.shape[3] > max_head_dim or v.shape[3] > max_head_dim:
        return f"head dims Dk {q.shape[3]}, Dv {v.shape[3]} (at most {max_head_dim})"
    return None


def row_reductions(interpreted: bool, *ops: str) -> tuple:
    """The reductions along an axis that kernels call as `f(x, axis)`, one per name in `ops`
    ('max', 'min', 'sum'), for kernels built compiled (`interpreted` False) or for Triton's CPU
    interpreter. A kernel module keeps them as module globals (its `_set_reductions`, called when
    its kernels are built), where the JIT and the interpreter look a kernel's callees up.

    Compiled: tl.max, tl.min, tl.sum. Interpreted: plain functions around tl.reduce with triton's
    own combine functions, which the interpreter maps to numpy by identity. (tl.max and friends
    are themselves @triton.jit functions, built interpreted only if TRITON_INTERPRET was set
    before triton was first imported, which `import nsa_compile` already does; a compiled one
    cannot be called from an interpreted kernel. The plain functions read `tl` when called, and
    the interpreter patches that module object itself while a kernel runs.)"""
    if not interpreted:
        library = {"max": tl.max, "min": tl.min, "sum": tl.sum}
        return tuple(library[op] for op in ops)
    combine = {"max": tl.standard._elementwise_max, "min": tl.standard._elementwise_min,
               "sum": tl.standard._sum_combine}
    return tuple(lambda x, axis, fn=combine[op]: tl.reduce(x, axis, fn) for op in ops)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16/bf16 operands ignore it
