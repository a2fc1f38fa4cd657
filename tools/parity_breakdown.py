"""Which step moves a model's numbers: the rewrites, or Inductor's codegen?

Runs check_parity for optimized variants of the same eager model against the same float64
oracle and prints the worst rows of each:
  identity  AOTAutograd + eager execution, no NSA pass (what the bar makes of a no-op: on CUDA,
            eager's own run-to-run nondeterminism)
  compile   Inductor with every NSA pass disabled (torch.compile's own numerics)
  passes    the NSA passes with AOTAutograd + eager execution (the rewrites alone)
  optimize  the NSA passes with Inductor (what optimize() does)

    python tools/parity_breakdown.py --model seed --dtype bf16 --seq-len 256 --device cuda
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import nsa_compile
from nsa_compile.models import build_model
from nsa_compile.parity import check_parity

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--worst", type=int, default=5)
    ap.add_argument("--variants", default="identity,compile,passes,optimize")
    ap.add_argument("--eager-runs", type=int, default=None, help="eager runs behind the bar (default: 3 on CUDA, 1 on CPU)")
    args = ap.parse_args()

    torch.manual_seed(0)
    eager = build_model(args.model).to(args.device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g).to(args.device)
    variants = {
        "identity": nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=nsa_compile.pass_names()),
        "compile": nsa_compile.OptimizeConfig(disabled_passes=nsa_compile.pass_names()),
        "passes": nsa_compile.OptimizeConfig(compiler="aot_eager"),
        "optimize": nsa_compile.OptimizeConfig(),
    }
    for name in args.variants.split(","):
        config = variants[name]
        def optimize_fn(m, config=config):
            torch._dynamo.reset()
            return nsa_compile.optimize(m, config)

        report = check_parity(eager, optimize_fn, tokens, DTYPES[args.dtype], eager_runs=args.eager_runs)
        print(f"\n{name}: {'PASS' if report.ok else 'FAIL'} ({len(report.failures())} of {len(report.rows)} over the bar)")
        rows = [[r.name, f"{r.err_optimized:.3g}", f"{r.err_eager:.3g}", f"{r.bar:.3g}", "ok" if r.ok else "FAIL"]
                for r in report.rows[: args.worst]]
        print(tabulate(rows, headers=["tensor", "err", "eager err", "bar", ""], tablefmt="github"))


if __name__ == "__main__":
    main()
