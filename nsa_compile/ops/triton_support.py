"""What the Triton kernel modules share on the host, and the one wrapper that lets their kernels
live at module level and still run under Triton's CPU interpreter.

    @jit                     a Triton function (kernel or helper) at module level, in place of
                             @triton.jit; `kernel[grid](...)` launches it as a triton.jit kernel
    @jit(interpreted=f)      the same, with the plain function f standing in for it interpreted
    reduce_max, reduce_min, reduce_sum
                             tl.max / tl.min / tl.sum as kernels call them, f(x, axis)
    interpreting()           whether triton.jit builds kernels for Triton's CPU interpreter
    upcast_dots(dtype)       whether bf16 dot operands go through fp32 (interpreted only)
    device_reason(*tensors)  why Triton kernels cannot run on these tensors' device (None: they can)
    qkv_reason(q, k, v, max_head_dim)
                             why attention kernels cannot take these q, k, v (dtypes, ranks, head dims)
    next_pow2(x), cdiv(a, b)
    dot_precision(dtype)     tl.dot's input_precision: IEEE for fp32 (no TF32), ignored for fp16/bf16

Why the wrapper (Triton 3.6 and 3.9 alike): `triton.jit` decides when it decorates a function
whether it builds a GPU kernel (JITFunction) or an interpreted one (InterpretedFunction): it reads
TRITON_INTERPRET through `triton.knobs` at that moment, and triton.language's own @jit helpers
(tl.max and friends) were decided when triton was first imported. The CPU tests turn the
interpreter on after import, per test module, and back off after. A compiled kernel cannot be
launched on the CPU, and an interpreted kernel cannot call a compiled helper (JITFunction.__call__
raises outside a kernel). So `jit` keeps the plain Python function and hands it to triton.jit when
it is first launched in each mode (read from Triton's knob at each launch; one triton.jit object
per mode, kept): the copy it hands over sees, in place of every @jit helper and row reduction it
names, that helper's object for the same mode (its own copy of the module's globals; the module
itself is not touched). Compiled, that is exactly what @triton.jit at module level would build;
interpreted, the reductions are tl.reduce with triton's own combine functions (which the
interpreter maps to numpy by identity) and `interpreted=` stand-ins replace their functions.
This project reads no environment variable itself.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel modules say why their kernels cannot run
    triton = tl = None

__all__ = ["KERNEL_DTYPES", "TritonFunction", "cdiv", "device_reason", "dot_precision", "interpreting", "jit",
           "next_pow2", "qkv_reason", "reduce_max", "reduce_min", "reduce_sum", "cumulative_sum", "upcast_dots"]

# The dtypes the kernels take (fp32 without TF32: IEEE dots).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether triton.jit builds kernels for Triton's CPU interpreter: Triton's own setting
    (TRITON_INTERPRET, read through its knobs exactly as triton.jit reads it); this project
    reads no environment itself."""
    return bool(triton.knobs.runtime.interpret)


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether bf16 tl.dot operands are cast to fp32 first: only under Triton's interpreter, which
    multiplies bf16 as its raw uint16 bits (exact: the values rounded to bf16 on the GPU are still
    rounded first). The kernels take it as their UPCAST constexpr; compiled, it is always False."""
    return dtype == torch.bfloat16 and interpreting()


class _ModeBound:
    """Something a Triton function names that is one object compiled and another interpreted."""

    def built(self):
        """The object for the mode Triton is in now."""
        raise NotImplementedError


class TritonFunction(_ModeBound):
    """A Triton kernel or device function written at module level (made by `jit`). Launch it as
    a triton.jit kernel, `kernel[grid](*args, **constexprs_and_launch_options)`; a kernel calls a
    helper by its name, as with triton.jit. See the module docstring for why it is built late."""

    def __init__(self, fn: Callable, interpreted: Callable | None = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.interpreted = interpreted
        self._built: dict[bool, object] = {}

    def __getitem__(self, grid):
        return self.built()[grid]

    def built(self):
        """What @triton.jit makes of this function in the mode Triton is in now (a JITFunction
        compiled, an InterpretedFunction interpreted: triton.jit decides, reading the same knob),
        over `_bound_for`'s copy; interpreted, the `interpreted` stand-in if given. Made on first
        use of each mode and kept."""
        mode = interpreting()
        if mode not in self._built:
            if mode and self.interpreted is not None:
                self._built[mode] = self.interpreted
            else:
                self._built[mode] = triton.jit(_bound_for(self.fn))
        return self._built[mode]


class _Reduction(_ModeBound):
    """tl.max / tl.min / tl.sum called as f(x, axis). Compiled: the library function itself.
    Interpreted: a plain function around tl.reduce with triton's own combine function (the
    library functions are @triton.jit, built compiled when triton was imported without the
    interpreter, and a compiled function cannot be called from an interpreted kernel). It reads
    `tl` when called; the interpreter patches that module object while a kernel runs."""

    def __init__(self, op: str):
        self.op = op

    def built(self):
        if not interpreting():
            return getattr(tl, self.op)
        combine = {"max": tl.standard._elementwise_max, "min": tl.standard._elementwise_min,
                   "sum": tl.standard._sum_combine}[self.op]
        return lambda x, axis: tl.reduce(x, axis, combine)


reduce_max, reduce_min, reduce_sum = _Reduction("max"), _Reduction("min"), _Reduction("sum")


class _CumulativeSum(_ModeBound):
    """tl.cumsum called as f(x, axis): compiled, the library function; interpreted, a plain
    function around tl.associative_scan with triton's own add (as `_Reduction`)."""

    def built(self):
        if not interpreting():
            return tl.cumsum
        return lambda x, axis: tl.associative_scan(x, axis, tl.standard._sum_combine)


cumulative_sum = _CumulativeSum()


def _bound_for(fn: Callable) -> Callable:
    """fn over a copy of its module's globals in which the @jit functions and reductions it names
    (the names its code reads: `co_names`) are their objects for the mode Triton is in now."""
    scope = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        if isinstance(scope.get(name), _ModeBound):
            scope[name] = scope[name].built()
    bound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__qualname__, bound.__doc__, bound.__kwdefaults__ = fn.__qualname__, fn.__doc__, fn.__kwdefaults__
    bound.__annotations__ = fn.__annotations__  # triton reads tl.constexpr parameters there
    return bound


def jit(fn: Callable | None = None, *, interpreted: Callable | None = None):
    """`@jit` or `@jit(interpreted=plain_function)` over a module-level Triton function: a
    TritonFunction. `interpreted`, where given, is called in its place by interpreted kernels
    (a workaround for an interpreter gap, e.g. compressed_triton's bf16 rounding)."""
    if fn is None:
        return lambda f: TritonFunction(f, interpreted)
    return TritonFunction(fn, interpreted)


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


_aside: dict = {}  # device index -> (a one-thread executor, a stream of that device)


def made_aside(make: Callable, device: torch.device):
    """make()'s tensors (constants an op caches per shape and device), made by another thread on a
    stream of its own. Inductor's CUDA graphs (OptimizeConfig(cuda_graphs=True)) send every
    allocation of the thread warming a graph up into their memory pool (torch >= 2.8: per thread),
    and refuse a pool tensor that outlives the graph without being one of its outputs: a cache
    filled there would be one, and a later replay could overwrite it. Made by another thread, the
    constant comes from the ordinary allocator; that thread waits for its stream before returning,
    so the constant is ready for any stream. A cache filled during the warm-up is hit when the
    graph is recorded (no allocation, no wait while capturing)."""
    device = torch.device(device)
    if device.type != "cuda":
        return make()
    import concurrent.futures

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _aside:
        _aside[index] = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nsa-constants"),
                         torch.cuda.Stream(index))
    worker, stream = _aside[index]
    torch.cuda.current_stream(index).synchronize()  # what make() reads was written on this stream

    def run():
        with torch.cuda.device(index), torch.cuda.stream(stream):
            made = make()
        stream.synchronize()
        return made

    return worker.submit(run).result()


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16/bf16 operands ignore it
