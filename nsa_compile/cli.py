"""The `nsa-compile` command line: demo, explain, parity.

Errors a user can cause print one line and exit with status 2 (a traceback only with --debug).
"""

from __future__ import annotations

import copy
import gc
import json
import sys

import click
import torch
from tabulate import tabulate

from .api import optimize, report, state_of
from .config import OptimizeConfig
from .parity import check_parity

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UserError(click.ClickException):
    """A mistake in the command line or its environment: one line, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError("this GPU cannot run bf16")
    return dtype


def build(model_name: str, device: torch.device):
    from nsa_compile.models import build_model

    try:
        model = build_model(model_name)
    except ValueError as err:
        raise UserError(str(err)) from None
    return model.to(device)


def example_tokens(batch: int, seq_len: int, device: torch.device, vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=g).to(device)


def pass_table(model) -> list[dict]:
    """report() rows plus nodes before/after, summed over graphs."""
    state = state_of(model)
    rows = []
    for r in report(model):
        logs = [log for g in state.graphs for log in g.logs if log.pass_name == r["name"]]
        rows.append({
            **r,
            "nodes_before": sum(log.nodes_before for log in logs),
            "nodes_after": sum(log.nodes_after for log in logs),
        })
    return rows


def near_misses(model) -> list[dict]:
    state = state_of(model)
    return [
        {"pass": log.pass_name, "graph": g.graph_id, "where": r.where, "node": r.node, "reason": r.reason}
        for g in state.graphs for log in g.logs for r in log.refusals
    ]


def print_pass_table(rows: list[dict]) -> None:
    table = [
        [r["name"], r["matches"], ", ".join(r["where"]) or "-", "; ".join(r["kernels"]) or "-", r["refused"],
         f'{r["nodes_before"]} -> {r["nodes_after"]}', f'{r["time_ms"]:.1f}']
        for r in rows
    ]
    headers = ["pass", "matches", "where", "became", "refused", "nodes", "ms"]
    click.echo(tabulate(table, headers=headers, tablefmt="github"))


def print_near_misses(misses: list[dict]) -> None:
    if not misses:
        return
    click.echo("\nnear misses (candidates a pass looked at and refused):")
    grouped: dict[tuple, list[str]] = {}
    for m in misses:
        grouped.setdefault((m["pass"], m["reason"]), []).append(m["where"])
    table = [[p, reason, len(wheres), ", ".join(dict.fromkeys(wheres))] for (p, reason), wheres in grouped.items()]
    click.echo(tabulate(table, headers=["pass", "reason", "count", "where"], tablefmt="github"))


@click.group()
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.pass_context
def cli(ctx, debug):
    """nsa_compile: optimize eager NSA models with torch.compile passes, and show what changed."""
    ctx.obj = {"debug": debug}


MODEL = click.option("--model", default="tiny", show_default=True,
                     help="Built-in preset: tiny, seed, paper, or <preset>-dense (the dense twin).")
DEVICE = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)


@cli.command()
@MODEL
@DEVICE
@click.option("--seq-len", type=int, default=128, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def explain(model, device, seq_len, batch, dtype, fmt):
    """Show what each pass rewrote, where, into what, and what it refused and why.

    Runs one forward and backward of the model through Dynamo and the passes (AOTAutograd with
    eager execution: the rewrites are the ones Inductor would receive, without its codegen).
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    net = build(model, dev).to(dt)
    optimize(net, OptimizeConfig(compiler="aot_eager"))
    _, loss = _training_loss(net, example_tokens(batch, seq_len, dev))
    loss.backward()
    rows, misses = pass_table(net), near_misses(net)
    if fmt == "json":
        click.echo(json.dumps({"model": model, "seq_len": seq_len, "batch": batch, "dtype": dtype,
                               "device": dev.type, "graphs": len(state_of(net).graphs),
                               "passes": rows, "near_misses": misses}, indent=2))
        return
    click.echo(f"model {model}, {dev.type}, {dtype}, batch {batch}, seq-len {seq_len}: "
               f"{len(state_of(net).graphs)} graph(s) compiled\n")
    print_pass_table(rows)
    print_near_misses(misses)


def _training_loss(model, tokens):
    from .parity import training_loss

    return training_loss(model, tokens)


def parity_table(eager, dtype, tokens, compiler: str):
    def optimize_fn(m):
        torch._dynamo.reset()
        return optimize(m, OptimizeConfig(compiler=compiler))

    return check_parity(eager, optimize_fn, tokens, dtype)


def print_parity(result, limit: int | None = 8) -> None:
    rows = result.rows if limit is None else result.rows[:limit]
    table = [[r.name, f"{r.err_optimized:.2e}", f"{r.err_eager:.2e}", f"{r.bar:.2e}", "ok" if r.ok else "FAIL"]
             for r in rows]
    click.echo(tabulate(table, headers=["tensor (worst first)", "optimized err", "eager err", "bar", ""],
                        tablefmt="github"))
    if limit is not None and len(result.rows) > limit:
        click.echo(f"... and {len(result.rows) - limit} more, all within their bars" if result.ok
                   else f"... {len(result.rows) - limit} more rows")


@cli.command()
@MODEL
@DEVICE
@click.option("--dtypes", default="fp32,bf16,fp16", show_default=True, help="Comma-separated: fp32, bf16, fp16.")
@click.option("--seq-len", type=int, default=100, show_default=True)
@click.option("--batch", type=int, default=2, show_default=True)
@click.option("--compiler", type=click.Choice(["inductor", "aot_eager", "eager"]), default="inductor",
              show_default=True)
def parity(model, device, dtypes, seq_len, batch, compiler):
    """Eager vs optimized forward + backward against a float64 oracle; exit 1 on failure."""
    dev = resolve_device(device)
    names = [d.strip() for d in dtypes.split(",") if d.strip()]
    unknown = [d for d in names if d not in DTYPES]
    if unknown:
        raise UserError(f"unknown dtype(s) {', '.join(unknown)}; valid: {', '.join(DTYPES)}")
    eager = build(model, dev)
    tokens = example_tokens(batch, seq_len, dev)
    failed = False
    for name in names:
        result = parity_table(eager, resolve_dtype(name, dev), tokens, compiler)
        click.echo(f"\n{model} {name} on {dev.type}: {'PASS' if result.ok else 'FAIL'}")
        print_parity(result, limit=None)
        failed |= not result.ok
    sys.exit(1 if failed else 0)


@cli.command()
@click.option("--model", default="auto", show_default=True,
              help="Preset to run; auto: tiny on a CPU, seed on a GPU.")
@DEVICE
@click.option("--seq-len", type=int, default=None, help="Default: 256 (tiny), 1024 (others: eager fits).")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True)
@click.option("--compiler", type=click.Choice(["inductor", "aot_eager", "eager"]), default="inductor",
              show_default=True)
def demo(model, device, seq_len, batch, steps, compiler):
    """The main job: optimize the reference NSA model, show the rewrites, check parity, time training."""
    from .bench import time_training

    dev = resolve_device(device)
    model = model if model != "auto" else ("seed" if dev.type == "cuda" else "tiny")
    seq_len = seq_len or (256 if model.startswith("tiny") else 1024)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    eager = build(model, dev)
    click.echo(f"nsa_compile demo: {model} on {dev.type}, seq-len {seq_len}, batch {batch}, compiler {compiler}")

    # Parity on a shorter sequence on the GPU: the eager float64 oracle is memory-hungry.
    parity_len = seq_len if dev.type == "cpu" else min(seq_len, 256)
    result = parity_table(eager, dtype, example_tokens(batch, parity_len, dev, seed=1), compiler)
    click.echo(f"\n1. parity ({str(dtype).removeprefix('torch.')}, seq-len {parity_len}, "
               f"forward + every gradient vs float64): {'PASS' if result.ok else 'FAIL'}")
    print_parity(result)

    torch._dynamo.reset()  # frees the parity models' compiled code
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    optimized = optimize(copy.deepcopy(eager), OptimizeConfig(compiler=compiler))
    tokens = example_tokens(batch, seq_len, dev, seed=2)
    autocast = torch.bfloat16 if dev.type == "cuda" else None
    timings = {"eager": time_training(copy.deepcopy(eager), tokens, steps, autocast_dtype=autocast),
               "optimize": time_training(optimized, tokens, steps, autocast_dtype=autocast)}
    click.echo("\n2. what was rewritten")
    print_pass_table(pass_table(optimized))
    print_near_misses(near_misses(optimized))

    click.echo(f"\n3. training steps ({steps} timed, AdamW{', bf16 autocast' if autocast else ''})")
    base = timings["eager"].tokens_per_s if timings["eager"] else None
    table = []
    for name, t in timings.items():
        if t is None:
            table.append([name, "out of memory", "-", "-", "-", "-"])
            continue
        speedup = "n/a (parity failed)" if not result.ok else "-" if base is None else f"{t.tokens_per_s / base:.2f}x"
        table.append([name, f"{t.tokens_per_s:,.0f}", f"{t.step_ms:.1f}", f"{t.first_step_s:.1f}",
                      "-" if t.peak_memory_gib is None else f"{t.peak_memory_gib:.2f}", speedup])
    click.echo(tabulate(table, headers=["", "tok/s", "step ms", "first step s", "peak GiB", "vs eager"],
                        tablefmt="github"))
    sys.exit(0 if result.ok else 1)


def main(argv=None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as err:
        if debug:
            raise
        err.show()
        sys.exit(err.exit_code)
    except click.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
