"""Registers, spills and machine code of the project's Triton kernels as an H100 / H200 runs them,
on a machine without a GPU: what a kernel change does to a kernel before any device time is spent.

    python3 tools/kernel_resources.py                          # every op at the seed and paper shapes
    python3 tools/kernel_resources.py --shape seed-32k --op select_blocks,selected_attention
    python3 tools/kernel_resources.py --shape seed --op window_attention --packed   # with pos beside
    pip install --target /tmp/triton36 triton==3.6.0           # the GPU image's Triton, beside ours:
    PYTHONPATH=/tmp/triton36 python3 tools/kernel_resources.py # numbers that match the GPU's build

How: each op's Triton launcher runs on meta tensors of the shape (no data, no device) with every
kernel launch captured instead of run, so the kernel, its arguments, its constexprs and launch
options are exactly those of a CUDA call at that shape (the tiles `_tiles` picks, the union and
inverted-selection sizes). Each launch is then specialized as Triton's JIT specializes a CUDA
call (an int argument equal to 1 becomes the constant 1; every pointer, and every int divisible by
16, gets tt.divisibility 16: meta tensors have no address, and CUDA allocations are 256-byte
aligned), compiled for sm_90 and read with the cuobjdump that Triton's wheel ships: registers and
stack bytes (spilled registers) from `-res-usage`, instruction count and mix from `-sass`.

Per launch one row: op and kernel, its constexpr tiles and warps, registers, stack, SASS
instructions and the most frequent opcodes. Not a timing: it says what changed (spills, a layout
that multiplies work per thread, e.g. a top-n merge over keys replicated in 8 lanes: 4x the
integer compares) and where to look; the GPU decides (tools/bench_*.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from unittest import mock

import torch
from tabulate import tabulate

from nsa_compile.ops import (block_select_triton, compressed_triton, selection_triton, triton_support,
                             window_triton)

# (B, S, G, h, D): the seed preset and the paper's shape (models/config.py, NSA_SEMANTICS.md)
SHAPES = {
    "seed": (32, 2048, 2, 6, 64),
    "seed-32k": (2, 32768, 2, 6, 64),
    "paper": (1, 65536, 4, 16, 128),
}
L, D_STRIDE, L_SEL, N_SEL, WINDOW = 32, 16, 64, 16, 512
OPS = ("select_blocks", "selected_attention", "compressed_attention", "window_attention")
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32", torch.bool: "*i1"}


def meta(*shape, dtype=torch.bfloat16, bshd=True):
    """A meta tensor in the model's layout: [B, S, heads, D] memory viewed [B, heads, S, D]."""
    if bshd and len(shape) == 4:
        return torch.empty(shape[0], shape[2], shape[1], shape[3], dtype=dtype, device="meta").transpose(1, 2)
    return torch.empty(*shape, dtype=dtype, device="meta")


def launches(op: str, shape: str, rounded: bool, packed: bool = False):
    """The kernel launches of `op`'s forward and backward at `shape`: (kernel, args, constexprs).
    packed: with document positions pos [B, S] (the HAS_POS kernels; the compressed keys then in
    a slot per token, Tc = S - l + 1, as the ops take them with pos)."""
    B, S, G, h, D = SHAPES[shape]
    H, scale = G * h, D**-0.5
    pos = torch.empty(B, S, dtype=torch.int64, device="meta") if packed else None
    Tc = S - L + 1 if packed else (S - L) // D_STRIDE + 1
    q = meta(B, H, S, D)
    captured = []

    class Capture:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kw: captured.append((self.kernel, args, kw))

    patches = [mock.patch.object(triton_support.TritonFunction, "__getitem__",
                                 lambda self, grid: Capture(self)[grid])]
    for module in (block_select_triton, compressed_triton, selection_triton, window_triton):
        patches.append(mock.patch.object(module, "device_reason", lambda *tensors: None))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        if op == "select_blocks":
            k = meta(B, G, Tc, D, bshd=False)
            lse = torch.empty(B, H, S, device="meta")
            extra = {"importance_dtype": torch.bfloat16, "group_sum_dtype": torch.float32} if rounded else {}
            block_select_triton.select_blocks_forward(q, k, lse, L, D_STRIDE, L_SEL, N_SEL, scale, pos, **extra)
        elif op == "selected_attention":
            k, v = meta(B, G, S, D), meta(B, G, S, D)
            idx = torch.empty(B, G, S, N_SEL, dtype=torch.int64, device="meta")
            o, lse = selection_triton.selected_forward(q, k, v, idx, L_SEL, scale, pos)
            selection_triton.selected_backward(meta(B, H, S, D), q, k, v, o, lse, idx, L_SEL, scale, pos)
        elif op == "compressed_attention":
            k, v = meta(B, G, Tc, D), meta(B, G, Tc, D)
            o, lse = compressed_triton.compressed_forward(q, k, v, L, D_STRIDE, scale, pos)
            compressed_triton.compressed_backward(meta(B, H, S, D), q, k, v, o, lse, L, D_STRIDE, scale, pos)
        elif op == "window_attention":
            k, v = meta(B, G, S, D), meta(B, G, S, D)
            o, lse = window_triton.window_forward(q, k, v, WINDOW, scale, pos)
            window_triton.window_backward(meta(B, H, S, D), q, k, v, o, lse, WINDOW, scale, pos)
        else:
            raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    return captured


def compile_launch(kernel, args, kw):
    """triton.compile of one captured launch for sm_90, specialized as the JIT specializes it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.built()
    names = [p.name for p in fn.params]
    constexprs = {p.name: kw[p.name] for p in fn.params if p.is_constexpr}
    signature, attrs = {}, {}
    for i, (param, value) in enumerate(zip(fn.params, list(args) + [kw.get(n) for n in names[len(args):]])):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
    options = {n: v for n, v in kw.items() if n in ("num_warps", "num_stages")}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def machine_code(compiled) -> dict:
    """Registers, stack bytes and the SASS instruction mix of a compiled kernel's cubin."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    opcodes = Counter(op.split(".")[0] for op in re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", sass, re.M))
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), "instructions": sum(opcodes.values()),
            "opcodes": opcodes}


def tile_summary(kw: dict) -> str:
    keep = ("TQ", "ROWS", "BLOCK_M", "BLOCK_N", "HC", "TC", "KS", "IMP_DTYPE", "num_warps", "num_stages")
    return " ".join(f"{n}={kw[n]}" for n in keep if n in kw and kw[n] is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="seed,paper", help=f"comma-separated among {', '.join(SHAPES)}")
    ap.add_argument("--op", default=",".join(OPS), help=f"comma-separated among {', '.join(OPS)}")
    ap.add_argument("--top", type=int, default=5, help="opcodes listed per kernel")
    ap.add_argument("--packed", action="store_true",
                    help="also the packed-documents kernels (pos given: HAS_POS), a row each beside the unpacked one")
    args = ap.parse_args()
    if triton_support.triton is None:
        sys.exit("kernel_resources: triton is not installed")
    if triton_support.interpreting():
        sys.exit("kernel_resources: TRITON_INTERPRET is on; the kernels must be built for the GPU")
    import triton

    print(f"Triton {triton.__version__}, sm_90, bf16; l {L}, d {D_STRIDE}, l' {L_SEL}, n {N_SEL}, w {WINDOW}")
    rows = []
    for shape in args.shape.split(","):
        if shape not in SHAPES:
            sys.exit(f"kernel_resources: unknown shape {shape!r}; valid: {', '.join(SHAPES)}")
        for op in args.op.split(","):
            for rounded in ((False, True) if op == "select_blocks" else (False,)):
                for packed in ((False, True) if args.packed else (False,)):
                    for kernel, launch_args, kw in launches(op, shape, rounded, packed):
                        code = machine_code(compile_launch(kernel, launch_args, kw))
                        mix = ", ".join(f"{n} {c}" for n, c in code["opcodes"].most_common(args.top))
                        label = op + (" (rounded)" if rounded else "") + (" (packed)" if packed else "")
                        rows.append([shape, label, kernel.__name__, tile_summary(kw),
                                     code["registers"], code["stack"], code["instructions"], mix])
    print(tabulate(rows, headers=["shape", "op", "kernel", "tiles", "regs", "stack B", "SASS", "most frequent"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
