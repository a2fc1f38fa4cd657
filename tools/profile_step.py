"""Where the time of one training step goes: torch.profiler around the steps of the e2e benchmark.

    python3 tools/profile_step.py --seq-len 2048 --batch 32 --variant optimize --variant dense

Per variant: the step's wall time, how much of it the GPU was busy (union of kernel intervals),
the device time under each NSA op (forward and backward, kernels launched inside included), and
the GPU time by kernel family (cuBLAS GEMMs, flash attention, Inductor's Triton kernels, our
Triton kernels, the rest), then the top kernels. The step is bench.time_training's: forward,
backward and fused AdamW under bf16 autocast. --trace DIR writes a Chrome trace per variant.
On the CPU (--device cpu: fp32, no autocast; the tests run it so) the op table gives CPU time and
there are no kernels.

--selection-tiles JSON forces tiles on the Triton selection kernels for the whole run (an override
of `selection_triton._tiles` for fp16/bf16 calls, e.g. '{"fwd": {"TQ": 8, "ROWS": 64}}'): how a
tile choice plays in the training step, with the model's own block choices.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path

import torch

from nsa_compile.bench import VARIANTS, compile_variant, nsa_op_times, print_nsa_op_times
from nsa_compile.ops import selection_triton
from nsa_compile.workload import load_workload, loss_of

# Kernel families by name (the first that matches): what library or compiler wrote the kernel.
FAMILIES = (
    ("flash attention", ("flash", "fmha", "cudnn")),
    ("cuBLAS GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma", "cublas")),
    ("Inductor Triton", ("triton_",)),
    ("AdamW", ("adam",)),
    ("copies/fills", ("copy", "fill", "elementwise_kernel", "vectorized_elementwise")),
)


def family(name: str) -> str:
    low = name.lower()
    for label, keys in FAMILIES:
        if any(k in low for k in keys):
            return label
    return "other (ours: *_kernel)" if low.endswith("kernel") else "other"


def build(variant: str, args, device):
    """The workload and the variant's model, as `nsa-compile bench` builds its columns (a fresh
    Dynamo for each: another model's shapes would make this one dynamic)."""
    wl = load_workload(args.model, batch=args.batch, seq_len=args.seq_len).to(device)
    return wl, compile_variant(variant, wl, args.compiler, device, args.cuda_graphs)


def profile_variant(variant: str, args, device) -> None:
    wl, model = build(variant, args, device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        with autocast:
            _, loss = loss_of(model, wl.inputs, wl.is_lm)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("train_step"):
                step()
                sync()  # the range then spans the step's GPU work too
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    steps = [e for e in events if e.name == "train_step" and e.device_type == cpu]  # not its GPU twin
    wall_us = sum(e.time_range.end - e.time_range.start for e in steps) / len(steps)
    # the GPU side of the record_function range is listed as a CUDA event too: not a kernel
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "train_step"]
    busy = union_us([(k.time_range.start, k.time_range.end) for k in kernels]) / args.steps
    tokens = wl.tokens_per_step
    print(f"\n## {variant}: {args.model}, S {args.seq_len}, batch {args.batch} ({tokens:,} tokens/step)")
    gpu = f", GPU busy {busy / 1e3:.1f} ms ({100 * busy / wall_us:.0f}%), {len(kernels) / args.steps:,.0f} kernels/step"
    print(f"step wall {wall_us / 1e3:.1f} ms ({tokens / wall_us * 1e6:,.0f} tok/s){gpu if cuda else ''}")

    print_nsa_op_times(nsa_op_times(events, cuda), args.steps, cuda)

    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace) / f"{variant}_S{args.seq_len}.json"))
    if cuda:
        print_kernels(kernels, args)


def print_kernels(kernels: list, args) -> None:
    fams = collections.defaultdict(float)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        dur = k.time_range.end - k.time_range.start
        fams[family(k.name)] += dur
        by_name[k.name][0] += 1
        by_name[k.name][1] += dur
    print("\nGPU time by kernel family, per step:")
    for label, us in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {us / args.steps / 1e3:8.2f} ms")
    print(f"\nTop {args.top} kernels, per step:")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {us / args.steps / 1e3:8.2f} ms {count // args.steps:5d}x  {name[:110]}")


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


@contextlib.contextmanager
def selection_tiles(forced: dict):
    """While the block runs, every fp16/bf16 call of the selection kernels takes `forced` (a
    `selection_triton._tiles` override) on top of its default tiles; restored after."""
    unknown = set(forced) - {"fwd", "dq", "dkdv", "reduce", "dense"}
    if unknown:
        raise ValueError(f"--selection-tiles: unknown kernel(s) {sorted(unknown)} (fwd, dq, dkdv, reduce, dense)")
    original = selection_triton._tiles

    def tiles(h, Dk, Dv, block_size, fp32=False, override=None, **sizes):
        return original(h, Dk, Dv, block_size, fp32, override if fp32 else forced | (override or {}), **sizes)

    selection_triton._tiles = tiles
    try:
        yield
    finally:
        selection_triton._tiles = original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="seed")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--variant", action="append", choices=VARIANTS, help="repeatable (default: optimize, dense)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace", default=None, help="write Chrome traces into this folder")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--compiler", default="inductor", help="optimize's compiler (nsa_compile.config.COMPILERS)")
    ap.add_argument("--cuda-graphs", action="store_true", help="compiled variants replay CUDA graphs "
                    "(bench.compile_variant's cuda_graphs)")
    ap.add_argument("--selection-tiles", type=json.loads, default={},
                    help="JSON override of the Triton selection kernels' tiles for the whole run")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("profile_step: --device cuda, but no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
    with selection_tiles(args.selection_tiles):
        for variant in args.variant or ["optimize", "dense"]:
            profile_variant(variant, args, device)  # its model and optimizer are freed on return
            if cuda:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
