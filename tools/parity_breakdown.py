"""Which step moves a model's numbers: the rewrites, or Inductor's codegen? And how much memory
does the float64 oracle take?

Runs check_parity for optimized variants of the same eager model against the same float64
oracle and prints the worst rows of each, the aggregate and the block-choice agreement:
  identity  AOTAutograd + eager execution, no NSA pass (what the bar makes of a no-op: on CUDA,
            eager's own run-to-run nondeterminism)
  compile   Inductor with every NSA pass disabled (torch.compile's own numerics)
  passes    the NSA passes with AOTAutograd + eager execution (the rewrites alone)
  optimize  the NSA passes with Inductor (what optimize() does)

    python tools/parity_breakdown.py --model seed --dtype bf16 --seq-len 2048 --batch 1 --device cuda

--oracle-memory runs only the float64 oracle's forward and backward as check_parity runs it,
checkpointed block by block and (with --no-blockwise too) without, and prints its peak memory:
torch.cuda.max_memory_allocated on CUDA; elsewhere the bytes of tensor storage alive at once,
counted op by op (LiveBytes). On the meta device nothing is computed or allocated, so a CPU
estimates the seed model at S 2048 in a second:

    python tools/parity_breakdown.py --oracle-memory --model seed --seq-len 2048 --batch 1 --device meta
"""

from __future__ import annotations

import argparse
import copy
import sys
import weakref

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nsa_compile
from nsa_compile.models import build_model
from nsa_compile.parity import check_parity, checkpoint_blocks, forward_backward

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, while active: each storage an op returns
    counts from that op until the storage is freed (storages made before, such as parameters,
    are not counted). Works on any device, the meta device included."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.finalize] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._alive:
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    self._alive[key] = weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def oracle_peak_bytes(model: torch.nn.Module, inputs: tuple, is_lm: bool, blockwise: bool) -> int:
    """Peak bytes of check_parity's float64 oracle (a float64 copy of `model`, checkpointed block by
    block with blockwise) over one forward and backward, the copy's parameters included: on CUDA
    torch.cuda.max_memory_allocated above what was allocated before, elsewhere LiveBytes."""
    device = inputs[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        oracle = copy.deepcopy(model).to(torch.float64)
        if blockwise:
            checkpoint_blocks(oracle)
        forward_backward(oracle, inputs, is_lm, torch.float64)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as counter:
        oracle = copy.deepcopy(model).to(torch.float64)
        if blockwise:
            checkpoint_blocks(oracle)
        forward_backward(oracle, inputs, is_lm, torch.float64)
    return counter.peak


def print_oracle_memory(args, device: torch.device) -> None:
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(args.model)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch, args.seq_len + 1), device=device)
    rows = []
    for blockwise in (True, False) if args.no_blockwise else (True,):
        try:
            peak = oracle_peak_bytes(model, (tokens,), True, blockwise)
            rows.append(["block by block" if blockwise else "whole model", f"{peak / 1e9:.2f}", f"{peak / 2**30:.2f}"])
        except torch.OutOfMemoryError:
            rows.append(["block by block" if blockwise else "whole model", "out of memory", "-"])
    print(f"float64 oracle of {args.model}, batch {args.batch}, seq-len {args.seq_len}, {device.type}: peak memory "
          f"of one forward and backward ({'max_memory_allocated' if device.type == 'cuda' else 'tensor storage alive'})")
    print(tabulate(rows, headers=["checkpointed", "GB", "GiB"], tablefmt="github", disable_numparse=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--worst", type=int, default=5)
    ap.add_argument("--variants", default="identity,compile,passes,optimize")
    ap.add_argument("--eager-runs", type=int, default=None, help="eager runs behind the bar (default: 3 on CUDA, 1 on CPU)")
    ap.add_argument("--oracle-memory", action="store_true", help="print the float64 oracle's peak memory only")
    ap.add_argument("--no-blockwise", action="store_true",
                    help="with --oracle-memory: also measure the oracle without block-wise checkpointing")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.oracle_memory:
        print_oracle_memory(args, device)
        return 0

    torch.manual_seed(0)
    eager = build_model(args.model).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g).to(device)
    variants = {
        "identity": nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=nsa_compile.pass_names()),
        "compile": nsa_compile.OptimizeConfig(disabled_passes=nsa_compile.pass_names()),
        "passes": nsa_compile.OptimizeConfig(compiler="aot_eager"),
        "optimize": nsa_compile.OptimizeConfig(),
    }
    failed = False
    for name in args.variants.split(","):
        config = variants[name]

        def optimize_fn(m, config=config):
            torch._dynamo.reset()
            return nsa_compile.optimize(m, config)

        report = check_parity(eager, optimize_fn, tokens, DTYPES[args.dtype], eager_runs=args.eager_runs)
        failed |= not report.ok
        print(f"\n{name}: {'PASS' if report.ok else 'FAIL'} ({len(report.failures())} of {len(report.rows)} over the bar)")
        rows = [[r.name, f"{r.err_optimized:.3g}", f"{r.err_eager:.3g}", f"{r.bar:.3g}", "ok" if r.ok else "FAIL"]
                for r in report.rows[: args.worst]]
        print(tabulate(rows, headers=["tensor", "err", "eager err", "bar", ""], tablefmt="github"))
        print("\n".join(report.summary()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
