"""The dtypes each NSA op receives under autocast, per corpus model: dtype slips shown at once.

    python tools/op_dtypes.py                     # every corpus model (tests/corpus), CPU bf16 autocast
    python tools/op_dtypes.py paper_bhsd.py       # only these
    python tools/op_dtypes.py --seed-shape        # make_seed(batch=1, seq_len=256): the seed's widths
    python tools/op_dtypes.py --preset seed --seq-len 256   # a preset instead

Under `torch.autocast` eager code computes attention in bf16: autocast casts a matmul's operands
and SDPA's q, k, v. An op that receives an activation in float32 instead computes in float32,
which is slow (paper_bhsd's gate GEMM, 2.52 ms a step on an H200, sixteenth session) and not what
eager computed (chunked_queries' window). Each model is optimized (aot_eager), run forward and
backward under CPU autocast, and the arguments of every `torch.ops.nsa` call in the ATen forward
graphs AOTAutograd derived are read: a slip is a floating activation argument (ACTIVATIONS: q, k,
v, x, gate_in, o_cmp, o_sel, o_win) not in the autocast dtype. Weights, biases, RoPE tables and
the log-sum-exp stay float32 by design (the kernels cast weights as autocast does). Exit status 1
if any model has a slip. tests/test_op_dtypes.py runs the corpus through the same check.

Run on the commits before the sixteenth session's two fixes, it reports both slips:
`gated_combine.gate_in float32` for paper_bhsd (at d8068ce~1) and `window_attention.q float32`,
`.k float32` for chunked_queries (at 9972103~1), with make() and with --seed-shape.

The CPU's graphs are not the GPU's, so this audit may miss a slip only the GPU has: CPU autocast
leaves softmax in bf16, so some branches are refused on the CPU (explain says why) and have no op
to audit.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from pathlib import Path

import torch
import torch.fx as fx
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nsa_compile  # noqa: E402
from corpus import MODELS, spec  # noqa: E402
from nsa_compile.workload import load_workload, loss_of  # noqa: E402

# the ops' arguments that carry activations (their schemas' names); the others are weights, biases,
# RoPE tables, block ids, positions or the float32 log-sum-exp
ACTIVATIONS = ("q", "k", "v", "x", "gate_in", "o_cmp", "o_sel", "o_win")


def op_arguments(graph: fx.Graph) -> list[tuple[str, dict[str, torch.dtype]]]:
    """(op name, {argument: dtype}) for every `torch.ops.nsa` call in an ATen graph, its floating
    tensor arguments only, named by the op's schema."""
    calls = []
    for node in graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith("nsa."):
            continue
        schema = node.target._schema
        bound = dict(zip((a.name for a in schema.arguments), node.args))
        bound.update(node.kwargs)
        dtypes = {}
        for name, arg in bound.items():
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                dtypes[name] = val.dtype
        calls.append((schema.name.removeprefix("nsa::"), dtypes))
    return calls


def slips(calls: list[tuple[str, dict[str, torch.dtype]]], dtype: torch.dtype) -> list[str]:
    """'op.argument float32' for every activation argument not in `dtype`."""
    return [f"{op}.{name} {str(d).removeprefix('torch.')}" for op, dtypes in calls for name, d in dtypes.items()
            if name in ACTIVATIONS and d != dtype]


def audit(model: torch.nn.Module, inputs: tuple, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, dict]]:
    """Optimize a copy of `model` (aot_eager), run it forward and backward under CPU autocast to
    `dtype`, and return the op calls of its ATen forward graphs (`op_arguments`)."""
    torch._dynamo.reset()
    optimized = nsa_compile.optimize(copy.deepcopy(model), nsa_compile.OptimizeConfig(compiler="aot_eager"))
    with torch.autocast("cpu", dtype=dtype):
        _, loss = loss_of(optimized, inputs, is_lm=False)
    loss.float().backward()
    calls = []
    for record in nsa_compile.api.state_of(optimized).graphs:
        if "forward" in record.aten:
            calls += op_arguments(record.aten["forward"].graph)
    return calls


def workloads(args):
    """(label, model, inputs) for each model the command line names."""
    if args.preset:
        wl = load_workload(args.preset, seq_len=args.seq_len or 128)
        yield args.preset, wl.model, wl.inputs
        return
    for name in args.models or MODELS:
        if args.seed_shape:
            module = importlib.import_module(f"corpus.{name.removesuffix('.py')}")
            model, x = module.make_seed(batch=1, seq_len=args.seq_len or 256)
            yield f"{name} (make_seed)", model, (x,)
        else:
            wl = load_workload(spec(name))
            yield name, wl.model, wl.inputs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus file names, .py optional (default: all)")
    parser.add_argument("--preset", help="a preset (tiny, seed, paper) instead of corpus models")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="for --preset (default 128) and --seed-shape (default 256)")
    parser.add_argument("--seed-shape", action="store_true",
                        help="each corpus model's make_seed(batch=1, seq_len=...): the seed preset's widths "
                             "(dim 768, 12 heads), where make() builds a small model")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the autocast dtype")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    args.models = [m if m.endswith(".py") else f"{m}.py" for m in args.models]  # bench_corpus names them by stem
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown corpus model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    rows, bad = [], 0
    for label, model, inputs in workloads(args):
        calls = audit(model, inputs, dtype)
        found = slips(calls, dtype)
        bad += bool(found)
        for op, dtypes in calls:
            args_text = " ".join(f"{n}:{str(d).removeprefix('torch.')}" for n, d in dtypes.items())
            rows.append([label, op, args_text])
        rows.append([label, "slips", ", ".join(found) or "none"])
    print(tabulate(rows, headers=["model", "op", "floating arguments"], tablefmt="github"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
