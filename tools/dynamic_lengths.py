"""Training steps at changing sequence lengths through one optimized model: compiles, rewrites, parity.

    python3 tools/dynamic_lengths.py --model seed --seq-lens 100,101,150,200,257,1000,2048

Issue 19.2: a model trained at several lengths (the last batch of an epoch, a length curriculum)
should keep every rewrite with a bounded number of compiles. Under OptimizeConfig's default
(dynamic=None) Dynamo compiles the first length static and, from the first change on, one graph
with S a symbol; the passes check their candidates at probe sizes there (nsa_compile/sizes.py).

Per length, one training step (forward, backward; the loss under bf16 autocast on CUDA, fp32 on
the CPU) of the optimized model and of eager from the same weights: the graphs compiled so far,
the NSA branches rewritten in the newest graph out of those the passes counted, the relative
difference of the loss and of the gradients (all parameters as one vector) against eager, and
the step time (the first step at a new length includes its compile). The last lines: the graph
count and whether every graph rewrote every branch the static graph did.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from tabulate import tabulate

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.models import build_model, preset
from nsa_compile.workload import loss_of

BRANCH_PASSES = ("projection_rope", "window_attention", "compressed_attention", "select_blocks",
                 "selected_attention", "gated_combine")


def step(model, tokens, autocast):
    """(loss, flat gradient) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        _, loss = loss_of(model, (tokens,), is_lm=True)  # the model reads tokens[:, :-1]: S tokens
    loss.backward()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach().float(), grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def matches(record) -> dict[str, int]:
    return {log.pass_name: len(log.matches) for log in record.logs if log.pass_name in BRANCH_PASSES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="preset (default: seed on CUDA, tiny on the CPU)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the preset (default: the preset's)")
    ap.add_argument("--seq-lens", default="100,101,150,200,257,1000,2048")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.model or ("seed" if device.type == "cuda" else "tiny")
    changes = {} if args.layers is None else {"n_layers": args.layers}
    lengths = [int(x) for x in args.seq_lens.split(",")]
    torch.manual_seed(0)
    cfg = preset(name, **changes)
    eager = build_model(cfg).to(device)
    optimized = nsa_compile.optimize(copy.deepcopy(eager), nsa_compile.OptimizeConfig(compiler=args.compiler))
    autocast = device.type == "cuda"
    print(f"{name} ({sum(p.numel() for p in eager.parameters()) / 1e6:.1f}M parameters), batch {args.batch}, "
          f"{'bf16 autocast' if autocast else 'fp32'}, {args.compiler}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if autocast else 'CPU'}")
    rows, per_graph = [], None
    for S in lengths:
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, S + 1), device=device,
                               generator=torch.Generator(device=device).manual_seed(S))
        loss_e, grad_e = step(eager, tokens, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss_o, grad_o = step(optimized, tokens, autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        graphs = state_of(optimized).graphs
        got = matches(graphs[-1])
        rows.append([S, len(graphs), f"{sum(got.values())}/{len(BRANCH_PASSES) * cfg.n_layers}",
                     f"{relative(loss_o, loss_e):.1e}", f"{relative(grad_o, grad_e):.1e}", f"{seconds:.2f}"])
    print(tabulate(rows, headers=["S", "graphs", "branches rewritten (newest graph)", "loss rel. diff",
                                  "grad rel. diff", "step s"], tablefmt="github"))
    graphs = state_of(optimized).graphs
    per_graph = [matches(g) for g in graphs]
    kept = all(m == per_graph[0] for m in per_graph)
    print(f"{len(graphs)} graphs compiled for {len(set(lengths))} lengths; "
          f"{'every graph rewrote the branches the first did' if kept else 'NOT every graph rewrote every branch'}: "
          + "; ".join(f"graph {i}: {m}" for i, m in enumerate(per_graph)))


if __name__ == "__main__":
    main()
