"""Do eager and optimized training agree? The losses of `nsa-compile train`'s loop, three runs from
one seed on the same batches (issue 7, point 2):

  eager      the eager model
  optimize   nsa_compile.optimize of the same model
  control    the eager model with every parameter scaled by (1 + eps * N(0, 1)) once at the start
             (default eps 1e-3, below bf16's rounding step of 2^-8): how far two runs drift apart
             when nothing but rounding separates them, the yardstick for eager vs optimize
  fp32       (CUDA, with --runs ...,fp32) the optimized model without autocast, all in float32:
             every bf16 run's distance from the float32 computation, to tell which of two
             disagreeing bf16 runs is the closer. (Optimize's float32 route, whose parity with
             eager in float32 is tested, rather than eager itself: the eager seed model in float32
             does not fit an 80 GB card even at S 1024.)

Per pair: the largest and the mean per-step relative difference of the training loss, the
relative difference of the mean loss over windows of --window steps, and of the final
validation loss.

    python3 tools/train_agreement.py --model seed --seq-len 2048 --batch 1 --steps 200 --lr 3e-4
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tabulate import tabulate

from nsa_compile import OptimizeConfig, optimize
from nsa_compile.train import TrainConfig, autocast_for, evaluate, load_corpus, train
from nsa_compile.workload import load_module

RUNS = ("eager", "optimize", "control", "fp32")


def run(kind: str, args, corpus, device) -> tuple[list[float], float]:
    model = load_module(args.model, seed=args.seed).to(device)
    if kind in ("optimize", "fp32"):
        torch._dynamo.reset()  # no shapes left from earlier compiles (automatic dynamic)
        optimize(model, OptimizeConfig(compiler=args.compiler))
    if kind == "control":
        g = torch.Generator(device="cpu").manual_seed(12345)
        with torch.no_grad():
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=g).to(device=device, dtype=p.dtype)
                p.mul_(1 + args.eps * noise)
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                      eval_every=0, save_every=0, autocast=kind != "fp32")
    losses = train(model, corpus, cfg, device)
    val = evaluate(model, corpus, cfg, device, autocast_for(cfg, device))
    print(f"{kind}: last loss {losses[-1]:.4f}, validation {val:.4f}", flush=True)
    return losses, val


def compare(a: list[float], b: list[float], val_a: float, val_b: float, window: int) -> list:
    rel = [abs(y - x) / abs(x) for x, y in zip(a, b)]
    windows = [abs(sum(b[i:i + window]) - sum(a[i:i + window])) / abs(sum(a[i:i + window]))
               for i in range(0, len(a) - window + 1, window)]
    return [f"{max(rel):.4f} (step {rel.index(max(rel)) + 1})", f"{sum(rel) / len(rel):.4f}",
            f"{max(windows):.4f}", f"{abs(val_b - val_a) / abs(val_a):.4f}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eps", type=float, default=1e-3, help="the control's relative parameter noise")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--compiler", default="inductor", help="optimize's compiler (nsa_compile.config.COMPILERS)")
    ap.add_argument("--data", default=None, help="a text file or folder (default: the stdlib's sources)")
    ap.add_argument("--out", default=None, help="write every run's losses here (JSON)")
    ap.add_argument("--runs", default="eager,optimize,control",
                    help="comma-separated subset of " + ",".join(RUNS) + " (eager is always run)")
    args = ap.parse_args(argv)
    runs = ["eager"] + [r for r in dict.fromkeys(args.runs.split(",")) if r and r != "eager"]
    if bad := [r for r in runs if r not in RUNS]:
        ap.error(f"--runs: unknown run(s) {', '.join(bad)} (choose from {', '.join(RUNS)})")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if "fp32" in runs and not cuda:
        ap.error("--runs fp32: the CPU runs are float32 already (the fp32 run is for CUDA)")
    corpus = load_corpus(args.data)
    print(f"{args.model}, S {args.seq_len}, batch {args.batch}, {args.steps} steps, lr {args.lr}, {device.type}"
          f"{' ' + torch.cuda.get_device_name() if cuda else ''}, torch {torch.__version__}", flush=True)
    results = {kind: run(kind, args, corpus, device) for kind in runs}
    # each run against eager, and, with an fp32 run, every bf16 run against it
    pairs = [("eager", kind) for kind in runs if kind not in ("eager", "fp32")]
    if "fp32" in results:
        pairs += [("fp32", kind) for kind in runs if kind != "fp32"]
    header = ["pair", "max step rel diff", "mean step rel diff", f"max {args.window}-step window", "validation"]
    rows = [[f"{a} vs {b}", *compare(results[a][0], results[b][0], results[a][1], results[b][1], args.window)]
            for a, b in pairs]
    print(tabulate(rows, headers=header, tablefmt="github"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: {"losses": v[0], "validation": v[1]} for k, v in results.items()} | {"args": vars(args)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
