"""Timing of training steps, side by side in one process (used by the CLI and tools/).

The bench columns (VARIANTS): eager, torch.compile's default, nsa_compile.optimize and the
compiled dense twin of a preset; `compile_variant` makes one column's model, `time_variants`
times the columns one after the other (freeing each model before the next) and `bench_rows`
turns the timings into the table `nsa-compile bench` and `demo` print.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from .api import optimize
from .config import OptimizeConfig
from .registry import pass_names
from .workload import Workload, checked_workload, loss_of

__all__ = [
    "BENCH_HEADERS", "StepTiming", "VARIANTS", "bench_rows", "compile_variant", "config_for", "cuda_graph_time_ms",
    "cuda_time_ms", "device_named", "free_memory", "is_oom", "machine_pulse", "nsa_op_times", "print_kernel_profile",
    "print_nsa_op_times", "time_training", "time_training_of", "time_variants",
]

VARIANTS = ("eager", "compile", "optimize", "dense")
BENCH_HEADERS = ["", "tok/s", "step ms", "first step s", "peak GiB", "vs eager"]


@dataclass(frozen=True)
class StepTiming:
    tokens_per_s: float
    step_ms: float  # median of the timed steps
    first_step_s: float  # includes compilation for compiled models
    peak_memory_gib: float | None  # CUDA only: over every step, the first (its compile) included
    steps_peak_gib: float | None = None  # CUDA only: over the steps after the first (training alone)
    # Where a step's time went (tell a slow host from a slow GPU or a thrashing allocator):
    host_ms: float | None = None  # median time to issue a timed step (until step() returns, before the sync)
    alloc_retries: int | None = None  # CUDA only: the caching allocator's free-all-and-retry in the timed steps
    device_allocs: int | None = None  # CUDA only: cudaMalloc calls in the timed steps (0 when the cache serves)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training(
    model: nn.Module,
    batch: torch.Tensor | tuple,
    steps: int = 5,
    warmup: int = 1,
    autocast_dtype: torch.dtype | None = None,
    is_lm: bool = True,
    progress=None,
) -> StepTiming | None:
    """Time `steps` training steps (forward, backward, AdamW) on token batch [B, S + 1] (or, with
    is_lm=False, the model's inputs and a mean-square loss). `progress(n)` is told of each step.

    Returns None when the GPU runs out of memory (a result, not an error: eager NSA does).
    """
    try:
        inputs = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        return _time_training(model, inputs, steps, warmup, autocast_dtype, is_lm, progress or (lambda n: None))
    except torch.OutOfMemoryError:
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _time_training(model, inputs, steps, warmup, autocast_dtype, is_lm, progress) -> StepTiming:
    device = inputs[0].device
    fused = device.type == "cuda" and all(p.is_floating_point() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )

    def step():
        with autocast:
            _, loss = loss_of(model, inputs, is_lm)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    progress(1)
    if device.type == "cuda":  # the first step's peak (a compile's probes among it) is kept apart
        first_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
        progress(1)
    times, issued = [], []
    before = _allocator_counts(device)
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        issued.append(time.perf_counter() - start)
        _sync(device)
        times.append(time.perf_counter() - start)
        progress(1)
    after = _allocator_counts(device)
    median = sorted(times)[len(times) // 2]
    host_ms = 1000 * sorted(issued)[len(issued) // 2]
    lead = inputs[0]
    tokens = lead.shape[0] * (lead.shape[1] - 1) if is_lm else lead.shape[0]
    if device.type != "cuda":
        return StepTiming(tokens / median, 1000 * median, first, None, host_ms=host_ms)
    steps_peak = torch.cuda.max_memory_allocated(device)
    retries, mallocs = (a - b if a is not None and b is not None else None for a, b in zip(after, before))
    return StepTiming(tokens / median, 1000 * median, first, max(first_peak, steps_peak) / 2**30, steps_peak / 2**30,
                      host_ms, retries, mallocs)


def _allocator_counts(device: torch.device) -> tuple[int | None, int | None]:
    """(alloc retries, cudaMalloc calls) of the CUDA caching allocator so far; (None, None) off CUDA.
    A retry frees every cached block and mallocs again: near a full card it can happen each step."""
    if device.type != "cuda":
        return None, None
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries"), stats.get("num_device_alloc")


def machine_pulse(device: torch.device, repeats: int = 3) -> dict:
    """How fast this machine is right now, on fixed work (the best of `repeats`): host_ms, a pure
    Python loop (the launching thread's speed: a host-bound step scales with it); gpu_ms, 16 bf16
    matrix products 4096^3 (CUDA only: the card's clocks); load, the 1-minute load average. Taken
    beside a timing, it tells a slow moment of the host or the card from a slow model."""
    host = []
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i & 7
        host.append(time.perf_counter() - start)
    pulse = {"host_ms": 1000 * min(host), "gpu_ms": None, "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        gpu = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for _ in range(16):
                a @ a
            _sync(device)
            gpu.append(time.perf_counter() - start)
        pulse["gpu_ms"] = 1000 * min(gpu)
        del a
    return pulse


def time_training_of(model: nn.Module, wl: Workload, steps: int, autocast: torch.dtype | None,
                     progress=None) -> StepTiming | None:
    """time_training of `model` on the workload's inputs and loss (None: out of memory)."""
    return time_training(model, wl.inputs, steps, autocast_dtype=autocast, is_lm=wl.is_lm, progress=progress)


def config_for(compiler: str, only_pass: str | None = None) -> OptimizeConfig:
    """The OptimizeConfig of a run: `compiler`, and every registered pass, or only `only_pass`.
    ValueError, one line naming the valid passes, for an unknown pass."""
    if only_pass is None:
        return OptimizeConfig(compiler=compiler)
    if only_pass not in pass_names():
        raise ValueError(f"unknown pass {only_pass!r}; valid: {', '.join(pass_names())}")
    return OptimizeConfig(compiler=compiler, disabled_passes=tuple(n for n in pass_names() if n != only_pass))


def device_named(name: str) -> torch.device:
    """The device a --device option names: 'auto' (CUDA where there is a GPU, else the CPU), 'cpu'
    or 'cuda'; ValueError for 'cuda' without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def is_oom(err: BaseException | None) -> bool:
    """Out of memory, raised directly or wrapped (Dynamo wraps errors of the compile in its own)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, torch.OutOfMemoryError):
            return True
        seen.add(id(err))
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return False


def free_memory() -> None:
    """Forget Dynamo's compiled code and give the memory of dropped models back (between columns)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_variant(variant: str, wl: Workload, compiler: str, device: torch.device,
                    cuda_graphs: bool = False) -> nn.Module | None:
    """A fresh model for one bench column (a copy: wl.model stays eager), or None where the variant
    does not apply (dense, for a model without a dense twin). `compiler`: optimize's. cuda_graphs:
    every compiled column replays CUDA graphs (optimize: OptimizeConfig(cuda_graphs=True); the
    torch.compile columns: mode='reduce-overhead', the same Inductor setting), eager stays eager."""
    torch._dynamo.reset()
    mode = "reduce-overhead" if cuda_graphs else None
    if variant == "eager":
        return copy.deepcopy(wl.model)
    if variant == "compile":  # torch.compile's default, no NSA passes
        model = copy.deepcopy(wl.model)
        model.compile(mode=mode)
        return model
    if variant == "optimize":
        return optimize(copy.deepcopy(wl.model), config_for(compiler).replace(cuda_graphs=cuda_graphs))
    if wl.dense_twin is None:
        return None
    torch.manual_seed(0)
    twin = checked_workload(wl.dense_twin, 1, 1, device).model
    twin.compile(mode=mode)
    return twin


def time_variants(wl: Workload, variants: list[str], steps: int, compiler: str, device: torch.device,
                  progress=None, on_optimized=None) -> dict[str, StepTiming | None]:
    """{variant: its timing (None: out of memory)} of `steps` training steps per column, bf16
    autocast on CUDA; columns that do not apply are left out. `progress(variant, length)`, if
    given, returns a context manager around a column's steps whose value's update(n) is told of
    each step (click.progressbar's). `on_optimized(model)`, if given, sees the optimize column's
    model after its timed steps (the demo reads its rewrite report there instead of compiling again)."""
    autocast = torch.bfloat16 if device.type == "cuda" else None
    results = {}
    for variant in variants:
        model = compile_variant(variant, wl, compiler, device)
        if model is None:
            continue
        with (progress(variant, steps + 2) if progress is not None else contextlib.nullcontext()) as bar:
            results[variant] = time_training_of(model, wl, steps, autocast, None if bar is None else bar.update)
        if variant == "optimize" and on_optimized is not None:
            on_optimized(model)
        del model
        free_memory()
    return results


def bench_rows(results: dict[str, StepTiming | None], parity_ok: bool) -> list[list]:
    """One row of BENCH_HEADERS per timed variant; the speedup over eager only where parity passed."""
    base = results.get("eager")
    rows = []
    for variant, t in results.items():
        if t is None:
            rows.append([variant, "out of memory", "-", "-", "-", "-"])
            continue
        if not parity_ok:
            speedup = "n/a (parity failed)"
        else:
            speedup = f"{t.tokens_per_s / base.tokens_per_s:.2f}x" if base is not None else "-"
        rows.append([variant, f"{t.tokens_per_s:,.0f}", f"{t.step_ms:.1f}", f"{t.first_step_s:.1f}",
                     "-" if t.peak_memory_gib is None else f"{t.peak_memory_gib:.2f}", speedup])
    return rows


def cuda_time_ms(fn, reps: int = 10, warmup: int = 1) -> float:
    """Median time of `fn()` in ms over `reps` runs, each bracketed by CUDA events and synchronized,
    after `warmup` untimed runs (the kernel benchmarks in tools/)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_graph_time_ms(fn, reps: int = 10, replays: int = 20, warmup: int = 3) -> float:
    """Median GPU time of `fn()` in ms with the host taken out: `fn` is captured once in a CUDA
    graph (after `warmup` runs on a side stream, which compile and allocate), then `replays`
    replays are bracketed by one pair of CUDA events, `reps` times. This is what a stage costs
    inside a step whose host runs ahead of the GPU; `cuda_time_ms` adds the host's launch and
    dispatch time of each call. Raises what the capture raises (a host synchronization inside
    `fn`, a CPU tensor, ...): the caller reports it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    del graph
    return statistics.median(times)


def print_kernel_profile(call, title: str, top: int = 12, warmup: int = 2) -> None:
    """Print the CUDA kernels of one `call()` (after `warmup` calls), by GPU time: what a variant
    launches and where its time goes (torch.profiler; the tools' --profile)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"\n{title}: {sum(e.count for e in events)} kernel launches, {total / 1000:.3f} ms CUDA time")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 1000:8.3f} ms  x{e.count:<4d} {e.key[:110]}")


def nsa_op_times(events, cuda: bool) -> dict[str, tuple[int, float]]:
    """{op name: (calls, microseconds)} of the `nsa::` ops among torch.profiler events: on the GPU
    the device time of the kernels each call launched, on the CPU its CPU time. (No nsa op calls
    another, so no time is counted twice.)"""
    per_op: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.name.startswith("nsa::") and e.device_type != torch.autograd.DeviceType.CUDA:
            # the attribute was renamed in 2.4
            us = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) if cuda else e.cpu_time_total
            calls, total = per_op.get(e.name, (0, 0.0))
            per_op[e.name] = (calls + 1, total + us)
    return per_op


def print_nsa_op_times(per_op: dict[str, tuple[int, float]], runs: int, cuda: bool, per: str = "step") -> None:
    """`nsa_op_times`' table, per `per` (the profile covered `runs` of them)."""
    if not per_op:
        return
    what = "device time incl. the kernels they launch" if cuda else "CPU time"
    print(f"\nNSA ops ({what}), per {per}:")
    for name, (count, us) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:42s} {count // runs:4d} calls {us / runs / 1e3:8.2f} ms")
    total = sum(us for _, us in per_op.values()) / runs
    print(f"  {'all NSA ops':42s}            {total / 1e3:8.2f} ms")
