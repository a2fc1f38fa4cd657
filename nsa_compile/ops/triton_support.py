"""Host-side helpers the Triton kernel modules share (plain Python: no kernel code here).

    interpreting()        whether triton.jit builds kernels for Triton's CPU interpreter
    next_pow2(x), cdiv(a, b)
    dot_precision(dtype)  tl.dot's input_precision: IEEE for fp32 (no TF32), ignored for fp16/bf16
"""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # the kernel modules say why their kernels cannot run
    triton = None

__all__ = ["cdiv", "dot_precision", "interpreting", "next_pow2"]


def interpreting() -> bool:
    """Whether triton.jit builds kernels for Triton's CPU interpreter: Triton's own setting
    (TRITON_INTERPRET, read through its knobs exactly as triton.jit reads it); this project
    reads no environment itself."""
    return bool(triton.knobs.runtime.interpret)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16/bf16 operands ignore it
