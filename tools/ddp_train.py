"""Data-parallel training of an optimized NSA model: DDP or FSDP2 across torchrun's ranks, or the
same global batch on one process (--single) for the loss comparison.

    torchrun --nproc_per_node=2 tools/ddp_train.py --mode ddp  --steps 50
    torchrun --nproc_per_node=2 tools/ddp_train.py --mode fsdp --steps 50
    python3 tools/ddp_train.py --single --steps 50               # the same global batches, one process

Each rank builds the model from the same seed, passes it through `nsa_compile.optimize`, then
wraps it: DDP (`DistributedDataParallel` around the compiled module), or FSDP2 (`fully_shard` on
every block, then on the root); --wrap-first wraps first and optimizes the DDP module instead
(`optimize(DDP(model))`). Step i trains on global batch i of the corpus (`nsa_compile.train.Corpus`);
rank r takes rows [r * B / W, (r + 1) * B / W). Printed per step: the global loss (the mean of the
ranks' losses, which is the single-process loss of the same global batch) and tok/s (global tokens
over the step's wall time). At the end each rank prints its graphs, the pieces DDP's buckets split
them into, what `report()` counted (the rewrites of every pass over all its graphs) and the nsa op
calls of step 2 (the rewrites that ran, whatever the graphs: see kernel_calls).

What to compare: under DDP the passes see the whole graph, which is then split at the gradient
buckets (nsa_compile/ddp.py), so the rewrites are one process's, in more than one piece on a
model larger than one bucket; --optimize-ddp no_optimization leaves the graph unsplit (the same
rewrites, no overlap of the gradient all-reduce with the backward).

On CUDA the ranks use NCCL and bf16 autocast (as `nsa-compile train`); on the CPU, gloo and fp32.
--bucket-cap-mb shrinks DDP's buckets so that a small model is split as a large one would be.
--optimize-ddp sets `torch._dynamo.config.optimize_ddp` for this run (default: PyTorch's own,
'ddp_optimizer').
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.config import COMPILERS
from nsa_compile.ddp import pieces_of
from nsa_compile.models import build_model
from nsa_compile.train import load_corpus
from nsa_compile.workload import loss_of

MODES = ("ddp", "fsdp", "single")
OPTIMIZE_DDP = ("ddp_optimizer", "python_reducer", "no_optimization")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES[:2], default="ddp", help="data parallelism under torchrun")
    p.add_argument("--single", action="store_true", help="one process, the same global batches (no torchrun)")
    p.add_argument("--model", default="tiny", help="model preset (tiny, seed, paper)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a field of the preset, e.g. --set dim=256 --set compression=mlp (repeatable)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows), divided among the ranks")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib sources)")
    p.add_argument("--compiler", default="inductor", choices=COMPILERS)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default: DDP's 25)")
    p.add_argument("--optimize-ddp", choices=OPTIMIZE_DDP, default=None,
                   help="torch._dynamo.config.optimize_ddp for this run (default: PyTorch's)")
    p.add_argument("--wrap-first", action="store_true",
                   help="--mode ddp: optimize(DDP(model)) instead of DDP(optimize(model))")
    p.add_argument("--json", default=None, help="write each rank's result to this path (rank appended)")
    args = p.parse_args(argv)
    if any("=" not in item for item in args.set):
        p.error(f"--set takes FIELD=VALUE, got {args.set}")
    args.changes = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (i.split("=", 1) for i in args.set)}
    first_bucket_mb = dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20
    if args.bucket_cap_mb is not None and args.bucket_cap_mb < first_bucket_mb:
        # Dynamo's DDPOptimizer asserts this (its first bucket is DDP's fixed 1 MiB one)
        p.error(f"--bucket-cap-mb must be at least DDP's first bucket, {first_bucket_mb:g}")
    if args.single:
        args.mode = "single"
    if args.wrap_first and args.mode != "ddp":
        p.error("--wrap-first applies to --mode ddp")
    return args


def _fully_shard():
    """FSDP2's `fully_shard`: public since PyTorch 2.6, before that under _composable."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "fully_shard"):
        return fsdp.fully_shard
    from torch.distributed._composable.fsdp import fully_shard

    return fully_shard


def wrap(model: nn.Module, mode: str, device: torch.device, world: int, bucket_cap_mb: float | None) -> nn.Module:
    """The optimized model wrapped for data parallelism (unchanged for 'single')."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = _fully_shard()
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def rewrite_counts(model: nn.Module) -> dict[str, int]:
    """Matches per pass, over every graph this model compiled (report()'s counts)."""
    return {row["name"]: row["matches"] for row in nsa_compile.report(model)}


def kernel_calls(profile) -> dict[str, int]:
    """Calls of each nsa op (torch.ops.nsa.*, forward and backward) in a profiled step: what ran
    as a rewrite, whichever graphs it ran in. report() counts rewrites per compiled graph, and
    under FSDP2 every block runs the one graph compiled for the first (its hooks break the graph
    at each block), so the calls are the count to compare across modes."""
    calls = {}
    for event in profile.key_averages():
        if event.key.startswith("nsa::"):
            calls[event.key] = calls.get(event.key, 0) + event.count
    return dict(sorted(calls.items()))


def train(args: argparse.Namespace, rank: int = 0, world: int = 1, on_step=None) -> dict:
    """Train args.steps steps on this rank; the process group must exist unless mode is 'single'.

    Returns losses (global, per step), tok_s (per step), rewrites (pass -> matches on this rank),
    graphs (how many graphs this rank compiled), pieces (how many pieces DDP's buckets split them
    into; 0 where none was split) and calls (nsa op calls in step 2, see kernel_calls; empty for
    a one-step run). on_step(step, loss, tok_s) after each step.
    """
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} does not divide among {world} ranks")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    corpus = load_corpus(args.data)
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model = build_model(args.model, **args.changes).to(device)
    config = nsa_compile.OptimizeConfig(compiler=args.compiler)
    if args.wrap_first:
        model = optimized = nsa_compile.optimize(wrap(model, args.mode, device, world, args.bucket_cap_mb), config)
    else:
        optimized = nsa_compile.optimize(model, config)
        model = wrap(model, args.mode, device, world, args.bucket_cap_mb)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused or None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if fused else contextlib.nullcontext
    rows = args.batch // world
    losses, rates, calls = [], [], {}
    profiled = 2  # after the compile (step 1 also counts the calls made while tracing)
    for step in range(1, args.steps + 1):
        batch = corpus.batch("train", step, args.batch, args.seq_len, args.seed)
        tokens = batch[rank * rows : (rank + 1) * rows].to(device)
        profile = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True)
                   if step == profiled else contextlib.nullcontext())
        began = time.perf_counter()
        with profile:
            with autocast():
                _, loss = loss_of(model, (tokens,), True)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)  # synchronizes the ranks: the step's time is the slowest rank's
        value = total.item() / world
        rate = args.batch * args.seq_len / (time.perf_counter() - began)
        losses.append(value)
        rates.append(rate)
        if step == profiled:
            calls = kernel_calls(profile)
        if on_step:
            on_step(step, value, rate)
    graphs = state_of(optimized).graphs
    return {"rank": rank, "world": world, "mode": args.mode, "losses": losses, "tok_s": rates,
            "rewrites": rewrite_counts(optimized), "graphs": len(graphs),
            "pieces": sum(pieces_of(g) for g in graphs), "calls": calls}


def main(argv=None) -> None:
    args = parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.single and launched and int(os.environ["WORLD_SIZE"]) > 1:
        raise SystemExit("--single runs one process: start it with python3, not torchrun")
    if not args.single and not launched:
        raise SystemExit(f"--mode {args.mode} runs under torchrun (torchrun --nproc_per_node=2 {__file__} ...); "
                         "--single runs one process")
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if launched else (0, 1)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not args.single:
        dist.init_process_group("nccl" if cuda else "gloo")
    patch = (torch._dynamo.config.patch(optimize_ddp=args.optimize_ddp) if args.optimize_ddp
             else contextlib.nullcontext())

    def on_step(step, loss, rate):
        if rank == 0:
            print(f"step {step:4d}  loss {loss:.4f}  {rate:,.0f} tok/s", flush=True)

    try:
        with patch:
            result = train(args, rank, world, on_step)
        # the first step compiles; the profiled one is slower
        rates = [r for step, r in enumerate(result["tok_s"], 1) if step > 2] or result["tok_s"]
        counts = ", ".join(f"{name} {n}" for name, n in result["rewrites"].items())
        calls = ", ".join(f"{name} {n}" for name, n in result["calls"].items())
        calls = calls or ("none" if args.steps >= 2 else "not counted (one step)")
        split = f"split into {result['pieces']} piece(s) at DDP's buckets" if result["pieces"] else "not split"
        print(f"rank {rank}/{world} ({args.mode}): {result['graphs']} graph(s), {split}; rewrites: {counts}; "
              f"nsa op calls per step: {calls}; median {sorted(rates)[len(rates) // 2]:,.0f} tok/s "
              "after the first two steps", flush=True)
        if args.json:
            Path(f"{args.json}.{rank}").write_text(json.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
