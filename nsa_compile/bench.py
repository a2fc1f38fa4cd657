"""Timing of training steps, side by side in one process (used by the CLI and tools/)."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from .parity import training_loss

__all__ = ["StepTiming", "time_training"]


@dataclass(frozen=True)
class StepTiming:
    tokens_per_s: float
    step_ms: float  # median of the timed steps
    first_step_s: float  # includes compilation for compiled models
    peak_memory_gib: float | None  # CUDA only


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training(
    model: nn.Module,
    batch: torch.Tensor,
    steps: int = 5,
    warmup: int = 1,
    autocast_dtype: torch.dtype | None = None,
) -> StepTiming | None:
    """Time `steps` training steps (forward, backward, AdamW) on token batch [B, S + 1].

    Returns None when the GPU runs out of memory (a result, not an error: eager NSA does).
    """
    try:
        return _time_training(model, batch, steps, warmup, autocast_dtype)
    except torch.OutOfMemoryError:
        return None
    finally:
        gc.collect()
        if batch.device.type == "cuda":
            torch.cuda.empty_cache()


def _time_training(model, batch, steps, warmup, autocast_dtype) -> StepTiming:
    device = batch.device
    fused = device.type == "cuda" and all(p.is_floating_point() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )

    def step():
        with autocast:
            _, loss = training_loss(model, batch)
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
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    tokens = batch.shape[0] * (batch.shape[1] - 1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return StepTiming(tokens / median, 1000 * median, first, peak)
