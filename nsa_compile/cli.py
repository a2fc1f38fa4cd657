"""The `nsa-compile` command line: demo, explain, parity, bench, train.

Exit status (main): 0 done; 1 a failed verdict (parity failed); 2 a mistake the user can fix (the
command line, its files, the user's model: one line `error: ...`, with the user's file and line
where their code raised); 3 an internal error (one line `internal error: ...`); 4 the process
running explain or parity (a child: isolation.py) crashed (one line: the signal, where, a hint); 130 Ctrl-C.
--debug adds the traceback and keeps the status.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

import click
import torch
from tabulate import tabulate

from .api import optimize, state_of
from .bench import BENCH_HEADERS, VARIANTS, bench_rows, config_for, device_named, free_memory, time_variants
from .config import COMPILERS
from .explain import (backend_table, coverage, coverage_line, graph_breaks, near_misses, networkx_graph,
                      pass_table, print_backend_table, print_coverage, print_graph_breaks, print_near_misses,
                      print_pass_table, rewrite_summary, skipped_frames, to_dot, to_graphml)
from .isolation import can_isolate, run_isolated
from .parity import choice_length, run_parity
from .workload import ModelSpecError, Workload, cast_inputs, checked_workload, loss_of, user_error, user_frame

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXIT_VERDICT_FAILED, EXIT_USER_ERROR, EXIT_INTERNAL_ERROR, EXIT_INTERRUPTED = 1, 2, 3, 130


class UserError(click.ClickException):
    """A mistake in the command line or its environment: one line, exit status 2."""

    exit_code = EXIT_USER_ERROR

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


def check_output_file(option: str, path: str | None) -> None:
    """Refuse, before anything is trained or compiled, an output file that could not be written
    when its time comes: a folder, a missing folder, a folder this process cannot write in."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{option} {path} is a folder; name a file")
    folder = target.parent
    if not folder.is_dir():
        raise UserError(f"{option} {path}: the folder {folder} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", suffix=".probe"):
            pass
    except OSError as err:
        raise UserError(f"{option} {path}: cannot write in {folder}: {err.strerror or err}") from None


def check_output_folder(option: str, path: str | None) -> None:
    """Create the folder if needed and refuse it, before anything is compiled, if it cannot be written."""
    if path is None:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".nsa-compile.", suffix=".probe"):
            pass
    except OSError as err:
        raise UserError(f"{option} {path}: cannot write there: {err.strerror or err}") from None


def write_atomically(path: str, text: str) -> None:
    """A kill during the write leaves the previous file whole (and needs only the folder writable)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


# --- resolving what the user asked for -----------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    try:
        return device_named(name)
    except ValueError as err:
        raise UserError(str(err)) from None


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
    """nsa_compile.workload.checked_workload, its refusals as UserError."""
    try:
        return checked_workload(spec, batch, seq_len, device, seed=seed, documents=documents)
    except ModelSpecError as err:
        raise UserError(str(err)) from err


def print_parity(result, limit: int | None = 8) -> None:
    rows = result.rows if limit is None else result.rows[:limit]
    table = [[r.name, f"{r.err_optimized:.2e}", f"{r.err_eager:.2e}", f"{r.bar:.2e}", "ok" if r.ok else "FAIL"]
             for r in rows]
    click.echo(tabulate(table, headers=["tensor (worst first)", "optimized err", "eager err", "bar", ""],
                        tablefmt="github"))
    if limit is not None and len(result.rows) > limit:
        rest = len(result.rows) - limit
        click.echo(f"... and {rest} more, all within their bars" if result.ok else f"... and {rest} more rows")
    for line in result.summary():  # the aggregate bar and the block choice (nsa_compile/parity.py)
        click.echo(line)


# --- commands -------------------------------------------------------------------------------------


class EndOfInput(Exception):
    """Carries an EOFError out of click, which would turn it into Abort (exit 130, as for Ctrl-C)."""

    def __init__(self, error: EOFError):
        super().__init__(str(error))
        self.error = error


class Commands(click.Group):
    """The command group; lets an EOFError through as EndOfInput."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EOFError as err:  # e.g. torch.load of an empty file: an error, not an interruption
            raise EndOfInput(err) from err


@click.group(cls=Commands)
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
    """Show what each pass rewrote, where, into what, what it refused and why, graph breaks and the
    frames Dynamo skipped, and the coverage: per layer, the NSA branches rewritten / detected, and
    each branch left eager with its source line and reasons.

    Runs one forward and backward through Dynamo and the passes, with AOTAutograd and eager
    execution: the rewrites are the ones Inductor receives, without its codegen.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        config = config_for("aot_eager", only_pass)
    except ValueError as err:
        raise UserError(str(err)) from None
    check_output_folder("--out", out)
    wl = get_workload(model, batch, seq_len, dev, documents=documents)
    net = wl.model.to(dt)
    inputs = cast_inputs(wl.inputs, dt)
    with skipped_frames() as skipped:
        breaks = graph_breaks(copy.deepcopy(net), (inputs[0][:, :-1], *inputs[1:]) if wl.is_lm else inputs)
    optimize(net, config)
    _, loss = loss_of(net, inputs, wl.is_lm)
    if loss.requires_grad:
        loss.backward()
    state = state_of(net)
    cov = coverage(net)
    data = {"model": model, "seq_len": seq_len, "batch": batch, "dtype": dtype, "device": dev.type,
            **({"documents": documents} if documents else {}),
            "graphs": len(state.graphs), "passes": pass_table(net), "near_misses": near_misses(net),
            "graph_breaks": breaks, "skipped_frames": skipped, "coverage": cov.to_json(),
            "backends": backend_table(config)}
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
        print_graph_breaks(breaks, skipped)
        click.echo("\nbackends (ops/registry.py; the pass table says which one each rewrite took and why):")
        print_backend_table(data["backends"])
        print_coverage(cov)
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


@cli.command()
@MODEL
@DEVICE
@click.option("--seq-len", type=int, default=128, show_default=True, help="For presets (a user model takes its factory's inputs).")
@click.option("--batch", type=int, default=1, show_default=True, help="For presets.")
@click.option("--trials", type=int, default=2, show_default=True, help="Random perturbations per cut point.")
@click.option("--format", "fmt", type=click.Choice(["line", "json"]), default="line", show_default=True)
def check(model, device, seq_len, batch, trials, fmt):
    """Causality: perturb the inputs after position t (several t) and report every output at a position
    <= t that changed, and the first submodule whose output did; exit 1 when the future leaks."""
    from .causality import check_causality

    if trials < 1:
        raise UserError("--trials must be positive")
    dev = resolve_device(device)
    wl = get_workload(model, batch, seq_len, dev)
    inputs = (wl.inputs[0][:, :-1], *wl.inputs[1:]) if wl.is_lm else wl.inputs  # presets: drop the targets
    try:
        result = check_causality(wl.model, inputs, trials=trials, per_module=True)
    except ValueError as err:
        raise UserError(f"{model}: {err}") from err
    click.echo(json.dumps(result.as_dict(), indent=2) if fmt == "json" else f"{model}: {result.verdict()}")
    sys.exit(0 if result.causal else EXIT_VERDICT_FAILED)


def run_bench(wl: Workload, variants: list[str], steps: int, compiler: str, device: torch.device,
              parity_ok: bool, on_optimized=None) -> list[list]:
    """nsa_compile.bench's rows of the variants' timings, with a progress bar per variant on stderr."""
    def progress(variant, length):
        return click.progressbar(length=length, label=f"  {variant:<8}", file=sys.stderr)

    return bench_rows(time_variants(wl, variants, steps, compiler, device, progress, on_optimized), parity_ok)


@cli.command()
@MODEL
@DEVICE
@click.option("--seq-len", "seq_lens", type=int, multiple=True, help="Repeatable. Default: 256.")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True)
@click.option("--variants", default=None,
              help="Columns: eager, compile (torch.compile default), optimize, dense (the compiled dense twin of a "
                   "preset). Default: all that apply.")
@COMPILER
def bench(model, device, seq_lens, batch, steps, variants, compiler):
    """Training steps of eager / torch.compile / optimize / dense twin, side by side in one process.

    Speedups are printed only when parity (eager vs optimize, against float64) passed in the same run.
    """
    dev = resolve_device(device)
    chosen = [v.strip() for v in (variants or ",".join(VARIANTS)).split(",") if v.strip()]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad or not chosen:
        raise UserError(f"unknown variant(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(VARIANTS)}")
    if steps < 1:
        raise UserError("--steps must be at least 1")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    failed = False
    for seq_len in seq_lens or (256,):
        wl = get_workload(model, batch, seq_len, dev)
        if not wl.is_lm and seq_lens:
            raise UserError(f"--seq-len applies to the presets; {model} runs on its factory's example inputs")
        if wl.dense_twin is None and "dense" in chosen:
            if variants:
                raise UserError(f"--variants dense: {model} has no dense twin (the NSA presets have one)")
            chosen.remove("dense")
        parity_len, parity_batch = seq_len, batch
        if dev.type == "cuda" and wl.is_lm:
            # batch 1 at a length where the block choice is real (2048 for the seed preset), as demo
            cfg = getattr(wl.model, "cfg", None)
            choice = choice_length(cfg) if getattr(cfg, "attention", None) == "nsa" else None
            parity_len, parity_batch = min(seq_len, choice or 256), 1
        parity_wl = (wl if (parity_len, parity_batch) == (seq_len, batch)
                     else get_workload(model, parity_batch, parity_len, dev))
        result = run_parity(parity_wl, dtype, config_for(compiler))
        shape = f"seq-len {seq_len}, batch {batch}" if wl.is_lm else "the factory's example inputs"
        on = f"seq-len {parity_len}" if wl.is_lm else "its inputs"
        click.echo(f"\n{model}, {dev.type}, {shape}: parity "
                   f"({str(dtype).removeprefix('torch.')}, {on}) {'PASS' if result.ok else 'FAIL'}")
        failed |= not result.ok
        if not result.ok:
            print_parity(result, limit=5)
        seen = {}
        rows = run_bench(wl, chosen, steps, compiler, dev, result.ok,
                         on_optimized=lambda m: seen.update(table=pass_table(m), coverage=coverage(m)))
        click.echo(tabulate(rows, headers=BENCH_HEADERS, tablefmt="github"))
        if "table" in seen:  # what the optimize column ran with: a refusal here means eager code
            click.echo(rewrite_summary(seen["table"]))
            click.echo(coverage_line(seen["coverage"]))
    sys.exit(EXIT_VERDICT_FAILED if failed else 0)


@cli.command()
@click.option("--model", default="auto", show_default=True, help="Preset to run; auto: tiny on a CPU, seed on a GPU.")
@DEVICE
@click.option("--seq-len", type=int, default=None, help="Default: 256 (tiny), 1024 (others: eager fits).")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True)
@COMPILER
def demo(model, device, seq_len, batch, steps, compiler):
    """The main job: optimize the reference NSA model, show the rewrites, check parity, time training."""
    if steps < 1 or batch < 1 or (seq_len is not None and seq_len < 1):
        raise UserError("--steps, --batch and --seq-len must be positive")
    dev = resolve_device(device)
    model = model if model != "auto" else ("seed" if dev.type == "cuda" else "tiny")
    seq_len = seq_len or (256 if model.startswith("tiny") else 1024)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    click.echo(f"nsa_compile demo: {model} on {dev.type}, seq-len {seq_len}, batch {batch}, compiler {compiler}")

    # On the GPU, parity at a length where NSA's top-n choice is exercised (2048 for the seed model):
    # the float64 oracle runs block by block (one layer's memory), halved while it does not fit.
    from nsa_compile.models import preset

    try:
        cfg = preset(model)
    except ValueError as err:
        raise UserError(str(err)) from None
    parity_len, too_long = seq_len, []
    if dev.type == "cuda" and cfg.attention == "nsa":
        parity_len = choice_length(cfg) or seq_len
    while True:
        try:
            result = run_parity(get_workload(model, batch, parity_len, dev, seed=1), dtype, config_for(compiler))
            break
        except Exception as err:
            if not any(isinstance(e, torch.OutOfMemoryError) for e in exception_chain(err)) or parity_len < 512:
                raise
            free_memory()
            too_long.append(parity_len)
            parity_len //= 2
    tried = f"; the float64 oracle did not fit at {', '.join(map(str, too_long))}" if too_long else ""
    click.echo(f"\n1. parity ({str(dtype).removeprefix('torch.')}, seq-len {parity_len}, "
               f"forward + every gradient vs float64{tried}): {'PASS' if result.ok else 'FAIL'}")
    print_parity(result)

    # One compile serves both the rewrite report and the timing (the seed model compiles slowly).
    wl = get_workload(model, batch, seq_len, dev, seed=2)
    seen = {}
    rows = run_bench(wl, ["eager", "optimize"], steps, compiler, dev, result.ok,
                     on_optimized=lambda m: seen.update(table=pass_table(m), misses=near_misses(m),
                                                        coverage=coverage(m)))
    click.echo(f"\n2. what was rewritten (seq-len {seq_len})")
    if "table" in seen:
        print_pass_table(seen["table"])
        print_near_misses(seen["misses"])
        click.echo("\n" + coverage_line(seen["coverage"]))
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
@click.option("--save-every", type=int, default=100, show_default=True,
              help="Checkpoint every N steps, and at the last step (0: only at the last step).")
@click.option("--checkpoint", type=click.Path(dir_okay=False), default=None,
              help="Checkpoint file (model, optimizer, step, the run's settings); written atomically.")
@click.option("--resume", is_flag=True,
              help="Continue from --checkpoint if it exists (refused where this run's model, lr, batch, seq-len, "
                   "seed or data differ from the checkpoint's).")
@click.option("--allow-changed-settings", is_flag=True,
              help="With --resume: continue even where the settings differ from the checkpoint's (the new ones "
                   "apply, the new --lr included).")
@click.option("--optimize/--no-optimize", "use_optimize", default=True, show_default=True)
@COMPILER
@click.option("--losses", type=click.Path(dir_okay=False), default=None, help="Write every step's loss here (JSON).")
def train(model, device, data, steps, batch, seq_len, lr, seed, eval_every, save_every, checkpoint, resume,
          allow_changed_settings, use_optimize, compiler, losses):
    """Byte-level language-model training on real text, with validation and resumable checkpoints."""
    from .train import TrainConfig, TrainError, load_corpus
    from .train import train as run_training
    from .workload import check_language_model, load_module

    dev = resolve_device(device)
    if min(steps, batch, seq_len) < 1:
        raise UserError("--steps, --batch and --seq-len must be positive")
    if not (math.isfinite(lr) and lr > 0):
        raise UserError(f"--lr must be a positive number, got {lr}")
    if min(eval_every, save_every) < 0:
        raise UserError("--eval-every and --save-every must be 0 or more")
    if resume and not checkpoint:
        raise UserError("--resume needs --checkpoint")
    if allow_changed_settings and not resume:
        raise UserError("--allow-changed-settings applies to --resume")
    # Every output is checked before any work, so that no run is lost to a path at its end.
    check_output_file("--checkpoint", checkpoint)
    check_output_file("--losses", losses)
    if checkpoint and losses and Path(checkpoint).resolve() == Path(losses).resolve():
        raise UserError("--checkpoint and --losses name the same file")
    if checkpoint and Path(checkpoint).exists() and not resume:
        raise UserError(f"--checkpoint {checkpoint} exists: pass --resume to continue that run, or remove the "
                        f"file (or name another) to start afresh")
    try:
        corpus = load_corpus(data)
        net = load_module(model, seed=seed).to(dev)
        if ":" in model:  # a user's model: is it a language model? (one eager forward, before compiling)
            check_language_model(net, model, seq_len, dev)
    except (TrainError, ModelSpecError) as err:
        raise UserError(str(err)) from err
    if use_optimize:
        optimize(net, config_for(compiler))
    cfg = TrainConfig(steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=seed, eval_every=eval_every,
                      save_every=save_every, checkpoint=checkpoint, model=model,
                      allow_changed_settings=allow_changed_settings)
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
        except TrainError as err:
            raise UserError(str(err)) from err
        except FloatingPointError as err:
            kept = f"; {checkpoint} keeps the last saved step" if checkpoint and Path(checkpoint).exists() else ""
            raise UserError(f"the run diverged: {err}{kept} (a lower --lr may help)") from err
    click.echo(f"done: {len(history)} steps, last loss {history[-1]:.4f}")
    if losses:
        write_atomically(losses, json.dumps(history))


def main(argv=None) -> None:
    """The console entry point: run the command and turn its outcome into the exit status (see the
    module docstring): one line on stderr for every error, the traceback too with --debug.
    As the program's entry point (argv None) explain and parity run in a child process, so that
    a crash of the compiled model is one line (isolation.py); main(args) runs here."""
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None and can_isolate(args):
        run_isolated(args, main)  # does not return
    debug = "--debug" in args
    try:
        cli.main(args=args, prog_name="nsa-compile", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.Abort:  # Ctrl-C (EOFError comes as EndOfInput)
        click.echo("aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except EndOfInput as wrapped:
        fail(wrapped.error, debug)
    except click.ClickException as err:
        if debug:
            traceback.print_exc()
        if isinstance(err, click.UsageError) and not isinstance(err, UserError):
            where = f" ({err.ctx.command_path} --help)" if err.ctx is not None else ""
            click.echo(f"error: {err.format_message()}{where}", err=True)
            sys.exit(EXIT_USER_ERROR)
        err.show()
        sys.exit(err.exit_code if isinstance(err, UserError) else EXIT_USER_ERROR)
    except Exception as err:
        fail(err, debug)


def fail(err: BaseException, debug: bool) -> None:
    """Exit for an exception no command turned into a UserError: where the user's code raised it, a
    user error naming their file and line (exit 2); out of memory, a user error (exit 2); anything
    else, an internal error (exit 3)."""
    if debug:
        traceback.print_exception(err)
    out_of_memory = next((e for e in exception_chain(err) if isinstance(e, torch.OutOfMemoryError)), None)
    if out_of_memory is not None:
        first = (str(out_of_memory).strip().splitlines() or [""])[0]
        click.echo(f"error: out of memory: {first} (a smaller --batch or --seq-len may fit)", err=True)
        sys.exit(EXIT_USER_ERROR)
    if user_frame(err) is not None:
        click.echo(f"error: your code raised {user_error(err)}", err=True)
        sys.exit(EXIT_USER_ERROR)
    hint = "" if debug else "; --debug shows the traceback"
    # Dynamo wraps what a backend raised (BackendCompilerFailed): say what that was
    raised = next((e for e in exception_chain(err) if type(e).__name__ != "BackendCompilerFailed"), err)
    click.echo(f"internal error: {user_error(raised)} (a bug in nsa-compile or PyTorch: please report it{hint})",
               err=True)
    sys.exit(EXIT_INTERNAL_ERROR)


def exception_chain(err: BaseException | None):
    """err, then what it was raised from (Dynamo wraps a backend's error: inner_exception)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
