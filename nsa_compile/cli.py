"""The `nsa-compile` command line: demo, explain, parity, bench, train.

Errors a user can cause print one line and exit with status 2 (a traceback only with --debug).
"""

from __future__ import annotations

import copy
import gc
import io
import json
import sys
from pathlib import Path

import click
import networkx as nx
import torch
from tabulate import tabulate

from .api import optimize, report, state_of
from .config import COMPILERS, OptimizeConfig
from .parity import check_parity
from .registry import pass_names
from .workload import ModelSpecError, Workload, cast_inputs, load_workload, loss_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = ("eager", "compile", "optimize", "dense")


class UserError(click.ClickException):
    """A mistake in the command line or its environment: one line, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


# --- resolving what the user asked for -----------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name}; valid: {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    try:  # a matmul and a softmax: what every NSA branch needs
        x = torch.ones(4, 4, dtype=dtype, device=device)
        torch.softmax(x @ x, dim=-1)
    except RuntimeError as err:
        raise UserError(f"{device.type} cannot run {name}: {str(err).splitlines()[0]}") from None
    return dtype


def get_workload(spec: str, batch: int, seq_len: int, device: torch.device, seed: int = 0,
                 documents: str | None = None) -> Workload:
    if batch < 1 or seq_len < 1:
        raise UserError("--batch and --seq-len must be positive")
    lengths = None
    if documents is not None:
        try:
            lengths = [int(x) for x in documents.split(",")]
        except ValueError:
            raise UserError(f"--documents takes comma-separated lengths (e.g. 100,28), got {documents!r}") from None
    try:
        return load_workload(spec, batch=batch, seq_len=seq_len, seed=seed, documents=lengths).to(device)
    except ModelSpecError as err:
        raise UserError(str(err)) from None


def config_for(compiler: str, only_pass: str | None = None) -> OptimizeConfig:
    if only_pass is None:
        return OptimizeConfig(compiler=compiler)
    if only_pass not in pass_names():
        raise UserError(f"unknown pass {only_pass!r}; valid: {', '.join(pass_names())}")
    return OptimizeConfig(compiler=compiler, disabled_passes=tuple(n for n in pass_names() if n != only_pass))


def free_memory() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- what the passes did --------------------------------------------------------------------------


def pass_table(model) -> list[dict]:
    """report() rows plus nodes before/after, summed over graphs."""
    state = state_of(model)
    rows = []
    for r in report(model):
        logs = [log for g in state.graphs for log in g.logs if log.pass_name == r["name"]]
        rows.append({**r, "nodes_before": sum(log.nodes_before for log in logs),
                     "nodes_after": sum(log.nodes_after for log in logs)})
    return rows


def near_misses(model) -> list[dict]:
    state = state_of(model)
    return [
        {"pass": log.pass_name, "graph": g.graph_id, "where": r.where, "node": r.node, "reason": r.reason}
        for g in state.graphs for log in g.logs for r in log.refusals
    ]


def graph_breaks(model, inputs: tuple) -> list[dict]:
    """Dynamo's graph breaks of one forward, with reasons and the user's source lines.

    torch._dynamo.explain runs the captured graphs eagerly at the real size; without grad, so that
    each layer's intermediates are freed as it goes (with grad, the eager seed model at S 512 on
    the CPU kept over 24 GB of gathered K/V for its backward and was killed)."""
    torch._dynamo.reset()
    with torch.no_grad():
        result = torch._dynamo.explain(model)(*inputs)
    torch._dynamo.reset()
    breaks = []
    for b in result.break_reasons:
        frames = [f for f in (b.user_stack or []) if "torch/" not in f.filename.replace("\\", "/")]
        where = frames[-1] if frames else (b.user_stack[-1] if b.user_stack else None)
        breaks.append({"reason": str(b.reason).strip().splitlines()[0],
                       "source": f"{where.filename}:{where.lineno}" if where else "?",
                       "line": (where.line or "").strip() if where else ""})
    return breaks


def networkx_graph(record) -> nx.DiGraph:
    g = nx.DiGraph(name=f"graph_{record.graph_id}")
    for name, op, target, inputs in record.nodes_after:
        g.add_node(name, op=op, target=target, rewritten=name in record.new_nodes)
        for src in inputs:
            g.add_edge(src, name)
    return g


def to_dot(g: nx.DiGraph) -> str:
    lines = [f'digraph "{g.graph["name"]}" {{', "  node [shape=box, fontsize=10];"]
    for name, data in g.nodes(data=True):
        style = ', style=filled, fillcolor="#ffd27f"' if data["rewritten"] else ""
        label = f"{name}\\n{data['target']}".replace('"', "'")
        lines.append(f'  "{name}" [label="{label}"{style}];')
    lines += [f'  "{a}" -> "{b}";' for a, b in g.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_graphml(g: nx.DiGraph) -> str:
    buffer = io.BytesIO()
    nx.write_graphml(g, buffer)
    return buffer.getvalue().decode()


def print_pass_table(rows: list[dict]) -> None:
    table = [
        [r["name"], r["matches"], ", ".join(r["where"]) or "-", "; ".join(r["kernels"]) or "-", r["refused"],
         f'{r["nodes_before"]} -> {r["nodes_after"]}', f'{r["time_ms"]:.1f}']
        for r in rows
    ]
    click.echo(tabulate(table, headers=["pass", "matches", "where", "became", "refused", "nodes", "ms"],
                        tablefmt="github"))


def print_near_misses(misses: list[dict]) -> None:
    if not misses:
        return
    click.echo("\nnear misses (candidates a pass looked at and refused):")
    grouped: dict[tuple, list[str]] = {}
    for m in misses:
        grouped.setdefault((m["pass"], m["reason"]), []).append(m["where"])
    table = [[p, reason, len(wheres), ", ".join(dict.fromkeys(wheres))] for (p, reason), wheres in grouped.items()]
    click.echo(tabulate(table, headers=["pass", "reason", "count", "where"], tablefmt="github"))


def print_graph_breaks(breaks: list[dict]) -> None:
    if not breaks:
        click.echo("\nno graph breaks: every pattern was seen whole")
        return
    click.echo(f"\ngraph breaks ({len(breaks)}): a break splits a pattern and can prevent its rewrite")
    click.echo(tabulate([[b["source"], b["line"], b["reason"]] for b in breaks],
                        headers=["source", "line", "reason"], tablefmt="github"))


def print_parity(result, limit: int | None = 8) -> None:
    rows = result.rows if limit is None else result.rows[:limit]
    table = [[r.name, f"{r.err_optimized:.2e}", f"{r.err_eager:.2e}", f"{r.bar:.2e}", "ok" if r.ok else "FAIL"]
             for r in rows]
    click.echo(tabulate(table, headers=["tensor (worst first)", "optimized err", "eager err", "bar", ""],
                        tablefmt="github"))
    if limit is not None and len(result.rows) > limit:
        rest = len(result.rows) - limit
        click.echo(f"... and {rest} more, all within their bars" if result.ok else f"... and {rest} more rows")


def run_parity(wl: Workload, dtype: torch.dtype, config: OptimizeConfig):
    def optimize_fn(m):
        torch._dynamo.reset()
        return optimize(m, config)

    result = check_parity(wl.model, optimize_fn, wl.inputs, dtype, is_lm=wl.is_lm)
    free_memory()
    return result


# --- commands -------------------------------------------------------------------------------------


@click.group()
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
def cli(debug):
    """nsa_compile: optimize eager NSA models with torch.compile passes, and show what changed."""


MODEL = click.option(
    "--model", default="tiny", show_default=True,
    help="A preset (tiny, seed, paper, <preset>-dense) or a user model: path/to/file.py:factory or "
         "package.module:factory (returning the module, or (module, example inputs)).")
DEVICE = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
DOCUMENTS = click.option(
    "--documents", default=None, metavar="LENGTHS",
    help="Packed documents for a preset: comma-separated lengths summing to --seq-len (every row packed "
         "alike); the model then gets each token's position in its document.")
COMPILER = click.option("--compiler", type=click.Choice(COMPILERS), default="inductor", show_default=True)


@cli.command()
@MODEL
@DEVICE
@click.option("--seq-len", type=int, default=128, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json", "dot", "graphml"]), default="table",
              show_default=True)
@click.option("--pass", "only_pass", default=None, help="Run only this pass.")
@click.option("--diff", is_flag=True, help="Show the graph code diff of each pass that changed it.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Also write explain.json, the diffs, the dot/graphml exports and the ATen forward and "
                   "backward graphs AOTAutograd derived from each rewritten graph here.")
@DOCUMENTS
def explain(model, device, seq_len, batch, dtype, fmt, only_pass, diff, out, documents):
    """Show what each pass rewrote, where, into what, what it refused and why, and graph breaks.

    Runs one forward and backward through Dynamo and the passes, with AOTAutograd and eager
    execution: the rewrites are the ones Inductor receives, without its codegen.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config = config_for("aot_eager", only_pass)
    wl = get_workload(model, batch, seq_len, dev, documents=documents)
    net = wl.model.to(dt)
    inputs = cast_inputs(wl.inputs, dt)
    breaks = graph_breaks(copy.deepcopy(net), (inputs[0][:, :-1], *inputs[1:]) if wl.is_lm else inputs)
    optimize(net, config)
    _, loss = loss_of(net, inputs, wl.is_lm)
    if loss.requires_grad:
        loss.backward()
    state = state_of(net)
    data = {"model": model, "seq_len": seq_len, "batch": batch, "dtype": dtype, "device": dev.type,
            **({"documents": documents} if documents else {}),
            "graphs": len(state.graphs), "passes": pass_table(net), "near_misses": near_misses(net),
            "graph_breaks": breaks}
    exports = {}
    if fmt in ("dot", "graphml") or out:
        for record in state.graphs:
            g = networkx_graph(record)
            exports[f"graph_{record.graph_id}.dot"] = to_dot(g)
            exports[f"graph_{record.graph_id}.graphml"] = to_graphml(g)
    diffs = {f"graph_{r.graph_id}_{name}.diff": text for r in state.graphs for name, text in r.diffs()}
    # The ATen graphs AOTAutograd derived from each rewritten graph: the backward follows the rewrite.
    aten = {f"graph_{r.graph_id}_aten_{kind}.py": gm.print_readable(print_output=False)
            for r in state.graphs for kind, gm in r.aten.items()}
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "explain.json").write_text(json.dumps(data, indent=2))
        for name, text in {**exports, **diffs, **aten}.items():
            (folder / name).write_text(text)
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    elif fmt in ("dot", "graphml"):
        for name, text in exports.items():
            if name.endswith(fmt):
                click.echo(text, nl=False)
    else:
        shape = f"batch {batch}, seq-len {seq_len}" if wl.is_lm else "the factory's example inputs"
        shape += f", documents {documents}" if documents else ""
        click.echo(f"model {model}, {dev.type}, {dtype}, {shape}: {len(state.graphs)} graph(s) compiled\n")
        print_pass_table(data["passes"])
        print_near_misses(data["near_misses"])
        print_graph_breaks(breaks)
        if diff:
            for name, text in diffs.items():
                click.echo(f"\n# {name}\n{text}")
        if out:
            click.echo(f"\nwrote {1 + len(exports) + len(diffs) + len(aten)} file(s) to {out}")


@cli.command()
@MODEL
@DEVICE
@click.option("--dtypes", default="fp32,bf16,fp16", show_default=True, help="Comma-separated: fp32, bf16, fp16.")
@click.option("--seq-len", type=int, default=100, show_default=True)
@click.option("--batch", type=int, default=2, show_default=True)
@COMPILER
@DOCUMENTS
def parity(model, device, dtypes, seq_len, batch, compiler, documents):
    """Eager vs optimized forward + backward against a float64 oracle; exit 1 on failure."""
    dev = resolve_device(device)
    names = [d.strip() for d in dtypes.split(",") if d.strip()]
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not names:
        raise UserError(f"unknown dtype(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(DTYPES)}")
    wl = get_workload(model, batch, seq_len, dev, documents=documents)
    failed = False
    for name in names:
        result = run_parity(wl, resolve_dtype(name, dev), config_for(compiler))
        click.echo(f"\n{model} {name} on {dev.type}: {'PASS' if result.ok else 'FAIL'}")
        print_parity(result, limit=None)
        failed |= not result.ok
    sys.exit(1 if failed else 0)


def compile_variant(variant: str, wl: Workload, compiler: str, device: torch.device):
    """A fresh model for one bench column, or None where the variant does not apply."""
    torch._dynamo.reset()
    if variant == "eager":
        return copy.deepcopy(wl.model)
    if variant == "compile":  # torch.compile's default, no NSA passes
        model = copy.deepcopy(wl.model)
        model.compile()
        return model
    if variant == "optimize":
        return optimize(copy.deepcopy(wl.model), config_for(compiler))
    if wl.dense_twin is None:
        return None
    torch.manual_seed(0)
    twin = get_workload(wl.dense_twin, 1, 1, device).model
    twin.compile()
    return twin


def run_bench(wl: Workload, variants: list[str], steps: int, compiler: str, device: torch.device,
              parity_ok: bool, on_optimized=None) -> list[list]:
    """One table row per variant. `on_optimized(model)`, if given, sees the optimize column's model
    after its timed steps (the demo reads its rewrite report there instead of compiling again)."""
    autocast = torch.bfloat16 if device.type == "cuda" else None
    results = {}
    for variant in variants:
        model = compile_variant(variant, wl, compiler, device)
        if model is None:
            continue
        with click.progressbar(length=steps + 2, label=f"  {variant:<8}", file=sys.stderr) as bar:
            results[variant] = time_training_of(model, wl, steps, autocast, bar.update)
        if variant == "optimize" and on_optimized is not None:
            on_optimized(model)
        del model
        free_memory()
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


def time_training_of(model, wl: Workload, steps: int, autocast, progress):
    from .bench import time_training

    return time_training(model, wl.inputs, steps, autocast_dtype=autocast, is_lm=wl.is_lm, progress=progress)


BENCH_HEADERS = ["", "tok/s" , "step ms", "first step s", "peak GiB", "vs eager"]


@cli.command()
@MODEL
@DEVICE
@click.option("--seq-len", "seq_lens", type=int, multiple=True, help="Repeatable. Default: 256.")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True)
@click.option("--variants", default=",".join(VARIANTS), show_default=True,
              help="Columns: eager, compile (torch.compile default), optimize, dense (the compiled dense twin).")
@COMPILER
def bench(model, device, seq_lens, batch, steps, variants, compiler):
    """Training steps of eager / torch.compile / optimize / dense twin, side by side in one process.

    Speedups are printed only when parity (eager vs optimize, against float64) passed in the same run.
    """
    dev = resolve_device(device)
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad or not chosen:
        raise UserError(f"unknown variant(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(VARIANTS)}")
    if steps < 1:
        raise UserError("--steps must be at least 1")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for seq_len in seq_lens or (256,):
        wl = get_workload(model, batch, seq_len, dev)
        parity_len = seq_len if dev.type == "cpu" else min(seq_len, 256)
        parity_wl = wl if parity_len == seq_len else get_workload(model, batch, parity_len, dev)
        result = run_parity(parity_wl, dtype, config_for(compiler))
        click.echo(f"\n{model}, {dev.type}, seq-len {seq_len}, batch {batch}: parity "
                   f"({str(dtype).removeprefix('torch.')}, seq-len {parity_len}) {'PASS' if result.ok else 'FAIL'}")
        if not result.ok:
            print_parity(result, limit=5)
        seen = {}
        rows = run_bench(wl, chosen, steps, compiler, dev, result.ok,
                         on_optimized=lambda m: seen.update(table=pass_table(m)))
        click.echo(tabulate(rows, headers=BENCH_HEADERS, tablefmt="github"))
        if "table" in seen:  # what the optimize column ran with: a refusal here means eager code
            click.echo(rewrite_summary(seen["table"]))


def rewrite_summary(rows: list[dict]) -> str:
    """One line: matches and refusals per pass, e.g. 'optimize ran with: window_attention 12 (refused 36), ...'."""
    parts = [f"{r['name']} {r['matches']}" + (f" (refused {r['refused']})" if r["refused"] else "") for r in rows]
    return "optimize ran with: " + ", ".join(parts) + " (reasons: nsa-compile explain)"


@cli.command()
@click.option("--model", default="auto", show_default=True, help="Preset to run; auto: tiny on a CPU, seed on a GPU.")
@DEVICE
@click.option("--seq-len", type=int, default=None, help="Default: 256 (tiny), 1024 (others: eager fits).")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True)
@COMPILER
def demo(model, device, seq_len, batch, steps, compiler):
    """The main job: optimize the reference NSA model, show the rewrites, check parity, time training."""
    dev = resolve_device(device)
    model = model if model != "auto" else ("seed" if dev.type == "cuda" else "tiny")
    seq_len = seq_len or (256 if model.startswith("tiny") else 1024)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    click.echo(f"nsa_compile demo: {model} on {dev.type}, seq-len {seq_len}, batch {batch}, compiler {compiler}")

    # Parity on a shorter sequence on the GPU: the eager float64 oracle is memory-hungry.
    parity_len = seq_len if dev.type == "cpu" else min(seq_len, 256)
    result = run_parity(get_workload(model, batch, parity_len, dev, seed=1), dtype, config_for(compiler))
    click.echo(f"\n1. parity ({str(dtype).removeprefix('torch.')}, seq-len {parity_len}, "
               f"forward + every gradient vs float64): {'PASS' if result.ok else 'FAIL'}")
    print_parity(result)

    # One compile serves both the rewrite report and the timing (the seed model compiles slowly).
    wl = get_workload(model, batch, seq_len, dev, seed=2)
    seen = {}
    rows = run_bench(wl, ["eager", "optimize"], steps, compiler, dev, result.ok,
                     on_optimized=lambda m: seen.update(table=pass_table(m), misses=near_misses(m)))
    click.echo(f"\n2. what was rewritten (seq-len {seq_len})")
    if "table" in seen:
        print_pass_table(seen["table"])
        print_near_misses(seen["misses"])
    else:
        click.echo("nothing: the optimized model did not run")
    click.echo(f"\n3. training steps ({steps} timed, AdamW{', bf16 autocast' if dev.type == 'cuda' else ''})")
    click.echo(tabulate(rows, headers=BENCH_HEADERS, tablefmt="github"))
    sys.exit(0 if result.ok else 1)


@cli.command()
@click.option("--model", default="tiny", show_default=True,
              help="A preset, or path/to/file.py:factory returning a module: tokens [B, S] -> logits [B, S, 256].")
@DEVICE
@click.option("--data", default=None, help="A text file or folder. Default: the Python standard library's sources.")
@click.option("--steps", type=int, default=200, show_default=True)
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=int, default=50, show_default=True, help="Validation loss every N steps (0: never).")
@click.option("--save-every", type=int, default=100, show_default=True)
@click.option("--checkpoint", type=click.Path(dir_okay=False), default=None,
              help="Checkpoint file (model, optimizer, step); written atomically every --save-every steps.")
@click.option("--resume", is_flag=True, help="Continue from --checkpoint if it exists.")
@click.option("--optimize/--no-optimize", "use_optimize", default=True, show_default=True)
@COMPILER
@click.option("--losses", type=click.Path(dir_okay=False), default=None, help="Write every step's loss here (JSON).")
def train(model, device, data, steps, batch, seq_len, lr, seed, eval_every, save_every, checkpoint, resume,
          use_optimize, compiler, losses):
    """Byte-level language-model training on real text, with validation and resumable checkpoints."""
    from .train import TrainConfig, load_corpus
    from .train import train as run_training
    from .workload import load_module

    dev = resolve_device(device)
    if min(steps, batch, seq_len) < 1:
        raise UserError("--steps, --batch and --seq-len must be positive")
    if resume and not checkpoint:
        raise UserError("--resume needs --checkpoint")
    try:
        corpus = load_corpus(data)
        net = load_module(model, seed=seed).to(dev)
    except (ValueError, ModelSpecError) as err:
        raise UserError(str(err)) from None
    if use_optimize:
        optimize(net, config_for(compiler))
    cfg = TrainConfig(steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=seed, eval_every=eval_every,
                      save_every=save_every, checkpoint=checkpoint)
    click.echo(f"training {model} ({'optimized, ' + compiler if use_optimize else 'eager'}) on {dev.type}: "
               f"{corpus.name}, {len(corpus.train):,} train / {len(corpus.val):,} validation bytes")
    status = {"text": ""}
    with click.progressbar(length=steps, label="train", show_eta=True, show_pos=True,
                           item_show_func=lambda _: status["text"]) as bar:
        def on_step(step, loss, tok_s):
            status["text"] = f"loss {loss:.4f}, {tok_s:,.0f} tok/s"
            bar.update(1)

        def on_event(text):
            if text.startswith("resumed"):
                bar.update(int(text.rsplit(" ", 1)[1]))
            click.echo(f"\n{text}")

        try:
            history = run_training(net, corpus, cfg, dev, resume=resume, on_step=on_step, on_event=on_event)
        except ValueError as err:
            raise UserError(str(err)) from None
    click.echo(f"done: {len(history)} steps, last loss {history[-1]:.4f}")
    if losses:
        Path(losses).write_text(json.dumps(history))


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=args, prog_name="nsa-compile", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as err:
        if "--debug" in args:
            raise
        err.show()
        sys.exit(err.exit_code if isinstance(err, UserError) else 2)
    except click.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
