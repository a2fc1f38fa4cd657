"""End-to-end training benchmark of an NSA language model (issue 7, point 1): what `nsa-compile bench`
runs, at full size, side by side in one process per sequence length.

Each timed step is a forward, a backward and a fused AdamW step under bf16 autocast (on CUDA) of
the preset model (default: the seed model) on random tokens, for these variants:

  eager     the eager model
  compile   torch.compile's default (Inductor, no NSA passes)
  optimize  nsa_compile.optimize (the NSA passes, then Inductor); the rewrites it ran with are printed
  dense     the dense twin (the same model with causal SDPA attention), torch.compile'd, with the
            SDPA backend that is fastest at the twin's attention shape (measured in the same run,
            fwd+bwd; --dense-backend names one instead)

Per variant: tokens/s (median step), peak memory, and the first step's time, which includes the
compile; each compiled variant compiles from an empty Inductor/Triton cache (--warm-cache keeps
the shared one), so the first step is a cold compile. A variant that runs out of memory is
reported as OOM. Batch: --batch, or --tokens-per-step // seq-len (at least 1).

Parity, after the timings: nsa_compile.parity.check_parity of the first training step (loss,
output and every gradient in bf16, fp32 on the CPU, against the float64 eager model run block by
block), at batch 1 and the run's seq-len, or --parity-len where shorter (default: the model's
nsa_compile.parity.choice_length, the shortest power of two >= (n + 3) * l', where the top-n block
choice is exercised: 2048 for the seed model, whose float64 oracle then needs about 38 GiB); at the
longest half, quarter, ... that fits where the oracle does not (stated in the output). The
aggregate bar and the block-choice agreement are printed with the verdict. Ratios between variants
are shown only when parity passed. Below n * l' tokens every candidate block is selected, so a
parity length that short does not exercise the top-n choice; the output says so.

Every result is appended to --out (JSON lines: one record per variant and one per parity check,
each with card, torch version, date and command), so a sweep can be split over several calls:

    python3 tools/bench_e2e.py --seq-len 2048 --out e2e.jsonl
    python3 tools/bench_e2e.py --seq-len 8192 --variants optimize,dense --out e2e.jsonl
    python3 tools/bench_e2e.py --report-only --out e2e.jsonl --plot e2e.png   # no GPU needed

--cuda-graphs replays CUDA graphs in every compiled column (optimize with
OptimizeConfig(cuda_graphs=True), torch.compile and the dense twin with mode='reduce-overhead'):
its records form a summary of their own.

--report-only reads --out, prints the summary (the latest record per seq-len, batch and variant,
one table per card, torch version and model) with the issue's targets, and writes the plot
(tok/s against seq-len; needs matplotlib: pip install -e '.[plot]').
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch
from tabulate import tabulate

from nsa_compile.bench import (
    VARIANTS, compile_variant, config_for, cuda_time_ms, device_named, free_memory, is_oom, time_training,
)
from nsa_compile.config import OptimizeConfig
from nsa_compile.explain import pass_table, rewrite_summary
from nsa_compile.models import preset
from nsa_compile.parity import choice_length, fit_parity, parity_sentence, run_parity
from nsa_compile.workload import checked_workload

DEFAULT_SEQ_LENS = (2048, 8192, 32768, 65536)
# The seed model's optimize column took ~0.8 MB per token at S = 8192 (docs/BENCHMARK_HISTORY.md): 65536 tokens
# fit an 80 GB card. The passes verify their rewrites on probes whose cost grows with the tokens
# per step and refuse beyond a cap; a refused branch runs as eager code, which the printed
# rewrite summary shows (fewer matches, more refusals).
DEFAULT_TOKENS_PER_STEP = 65536
# Issue 7's targets: optimize's tok/s over the dense twin's, per seq-len; optimize's first step
# at most this many times torch.compile's.
SPEEDUP_TARGETS = {2048: 0.7, 32768: 1.5, 65536: 2.5}
COMPILE_TIME_TARGET = 1.5
SDPA_BACKENDS = ("cudnn", "flash", "efficient")
PARITY_BATCH = 1


# --- the run's environment and records -----------------------------------------------------------


def environment(device: torch.device, command: str) -> dict:
    """Card, versions, date and the exact command: stored with every record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "card": card,
            "torch": torch.__version__, "triton": triton_version,
            "command": command}


def append_record(path: str | None, record: dict) -> None:
    """One JSON line, written as soon as the result exists (a call cut by its time limit keeps it)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def load_records(path: str) -> list[dict]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# --- the dense twin's SDPA backend ----------------------------------------------------------------


def sdpa_context(name: str | None):
    """SDPA restricted to one backend (None: SDPA's own choice). With one backend enabled, a shape
    it cannot run raises instead of falling back to another."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    return sdpa_kernel(backend)


def pick_dense_backend(model: str, batch: int, seq_len: int, device: torch.device, choice: str) -> tuple:
    """(backend name or None, a sentence saying why) for the dense twin's attention.

    auto: time causal GQA SDPA fwd+bwd at the twin's shape and layout under each backend and take
    the fastest that runs; a named backend must run (else this exits with its error)."""
    if choice == "default":
        return None, "SDPA's default choice (--dense-backend default)"
    if device.type != "cuda":
        if choice == "auto":
            return None, f"SDPA's default choice ({device.type}: no backends to choose from)"
        sys.exit(f"bench_e2e: --dense-backend {choice} needs CUDA")
    cfg = preset(f"{model}-dense")
    B, S, H, G, D, Dv = batch, seq_len, cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.dim_v
    gen = torch.Generator(device=device).manual_seed(0)
    # the twin's layout: [B, S, heads, D] projections viewed as [B, heads, S, D]
    make = lambda heads, dim: torch.randn(B, S, heads, dim, device=device, dtype=torch.bfloat16, generator=gen) \
        .transpose(1, 2).requires_grad_()
    q, k, v = make(H, D), make(G, D), make(G, Dv)

    def fwd_bwd():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    times, cannot = {}, {}
    for name in SDPA_BACKENDS if choice == "auto" else (choice,):
        try:
            with sdpa_context(name):
                times[name] = cuda_time_ms(fwd_bwd, reps=5, warmup=1)
        except RuntimeError as err:  # includes OutOfMemoryError
            cannot[name] = str(err).strip().splitlines()[0][:120]
    if not times:
        sys.exit(f"bench_e2e: no SDPA backend runs the dense twin's attention: {cannot}")
    best = min(times, key=times.get)
    measured = ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(times.items(), key=lambda item: item[1]))
    failed = "".join(f"; {n} cannot run: {why}" for n, why in cannot.items())
    return best, f"{best} (causal GQA SDPA fwd+bwd at the twin's shape: {measured}{failed})"


# --- one seq-len ----------------------------------------------------------------------------------


def compile_cache(cold: bool):
    """An empty Inductor/Triton cache for one variant (a cold compile), or the shared one."""
    if not cold:
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def warm_up_compiler(device: torch.device) -> None:
    """One trivial compile, so that no variant pays for starting the compile workers and Triton."""
    if device.type != "cuda":
        return
    torch._dynamo.reset()
    with compile_cache(True):
        torch.compile(lambda x: (x * 2).sum())(torch.ones(64, device=device))
    torch._dynamo.reset()


def run_variant(variant: str, args, wl, device, dense_backend: str | None) -> dict:
    """Compile (where the variant compiles) and time one variant; a record of the result."""
    record = {"variant": variant}
    started = time.perf_counter()
    try:
        with compile_cache(not args.warm_cache), sdpa_context(dense_backend if variant == "dense" else None):
            model = compile_variant(variant, wl, args.compiler, device, args.cuda_graphs)
            if model is None:
                return {**record, "status": "n/a", "detail": f"{wl.spec} has no dense twin"}
            timing = time_training(model, wl.inputs, steps=args.steps, warmup=args.warmup,
                                   autocast_dtype=torch.bfloat16 if device.type == "cuda" else None)
            if variant == "optimize" and timing is not None:
                # what the timed model ran with: a refused branch runs as eager code
                table = pass_table(model)
                record["rewrites"] = rewrite_summary(table)
                record["passes"] = [{k: r[k] for k in ("name", "matches", "refused", "kernels", "reasons")}
                                    for r in table]
            del model
    except Exception as err:  # one variant's failure must not cost the others their results
        if not is_oom(err):
            traceback.print_exc()
            return {**record, "status": "error",
                    "detail": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"}
        timing = None
    finally:
        free_memory()
    if timing is None:
        return {**record, "status": "OOM", "detail": f"out of memory after {time.perf_counter() - started:.0f} s"}
    if variant == "dense":
        record["sdpa_backend"] = dense_backend or "default"
    return {**record, "status": "ok", "tok_s": timing.tokens_per_s, "step_ms": timing.step_ms,
            "first_step_s": timing.first_step_s, "peak_gib": timing.peak_memory_gib}


class ParityCache:
    """check_parity at batch 1 and the longest length <= min(the run's seq-len, --parity-len or the
    model's choice_length) that fits, halving on OOM (nsa_compile.parity.fit_parity). Results and
    OOMs are remembered per length, so later seq-lens of the same run reuse them."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.done: dict = {}
        self.too_long: set[int] = set()

    def check(self, seq_len: int) -> dict:
        args = self.args
        length = min(seq_len, args.parity_len or choice_length(preset(args.model)) or seq_len)
        fit = fit_parity(self.run, length, args.parity_min_len)
        if fit.report is None:
            return {**fit.record(), "worst": []}
        return {**fit.record(), **self.summary(fit.length, fit.report)}

    def run(self, length: int):
        if length in self.too_long:  # known from an earlier seq-len of this run
            raise torch.OutOfMemoryError(f"the float64 oracle ran out of memory at seq-len {length} before")
        if length not in self.done:
            try:
                self.done[length] = run_parity(checked_workload(self.args.model, PARITY_BATCH, length, self.device,
                                                                seed=1), self.dtype,
                                                run_config(self.args))
            except Exception as err:
                if is_oom(err):
                    self.too_long.add(length)
                raise
        return self.done[length]

    def summary(self, length: int, result) -> dict:
        cfg = preset(self.args.model)
        return {"batch": PARITY_BATCH, "dtype": str(self.dtype).removeprefix("torch."),
                "selection_exercised": length > cfg.n_selected * cfg.sel_block,
                "choice_exercised": any(c.rows for c in result.choices),
                "mean_ratio": result.mean_ratio, "block_choice": [c.as_dict() for c in result.choices],
                "summary": result.summary(),
                "worst": [row.as_dict() for row in (result.failures() or result.rows)[:5]]}


def parity_text(seq_len: int, p: dict) -> str:
    ran = p["ok"] is not None and "detail" not in p
    where = f"loss, output, every gradient vs float64; {p['dtype']}, batch {p['batch']}, seq-len {p['parity_len']}" \
        if ran else ""
    note = "--parity-len, or the length where the block choice is exercised" if ran and p["parity_len"] != seq_len else ""
    return parity_sentence(p, "the first step", where, note)


def run_seq_len(seq_len: int, args, device, env: dict, parity: ParityCache) -> list[dict]:
    batch = args.batch or max(1, args.tokens_per_step // seq_len)
    wl = checked_workload(args.model, batch, seq_len, device)
    dense_backend, backend_note = None, None
    if "dense" in args.variants:
        dense_backend, backend_note = pick_dense_backend(args.model, batch, seq_len, device, args.dense_backend)
    print(f"\n{args.model}, seq-len {seq_len}, batch {batch} ({batch * seq_len:,} tokens/step), "
          f"{args.steps} timed steps after {args.warmup} warm-up", flush=True)
    if backend_note:
        print(f"dense twin SDPA backend: {backend_note}")
    base = {"record": "timing", **env, "model": args.model, "seq_len": seq_len, "batch": batch,
            "steps": args.steps, "compiler": args.compiler, "cold_cache": not args.warm_cache,
            "cuda_graphs": args.cuda_graphs}
    records = []
    for variant in args.variants:
        print(f"  {variant} ...", file=sys.stderr, flush=True)
        record = {**base, **run_variant(variant, args, wl, device, dense_backend)}
        if variant == "dense" and backend_note:
            record["sdpa_backend_note"] = backend_note
        append_record(args.out, record)
        records.append(record)
        print(f"  {variant}: {record['status']}", file=sys.stderr, flush=True)
    del wl
    free_memory()
    if args.no_parity:
        p = {"ok": None, "parity_len": None, "detail": "--no-parity"}
    else:
        p = parity.check(seq_len)
    parity_record = {"record": "parity", **env, "model": args.model, "cuda_graphs": args.cuda_graphs,
                     "seq_len": seq_len, "compiler": args.compiler,
                     **p}
    append_record(args.out, parity_record)
    records.append(parity_record)
    print(parity_text(seq_len, p))
    for line in p.get("summary", []):  # the aggregate bar and the block choice
        print(line)
    if p["ok"] is False:
        print(tabulate([[r["name"], f"{r['err_optimized']:.2e}", f"{r['err_eager']:.2e}", f"{r['bar']:.2e}"]
                        for r in p["worst"]], headers=["tensor (worst first)", "optimized err", "eager err", "bar"],
                       tablefmt="github", disable_numparse=True))
    print(tabulate(variant_rows(records, p["ok"]), headers=["", "tok/s", "step ms", "first step s", "peak GiB",
                                                             "vs dense"], tablefmt="github", disable_numparse=True))
    for r in records:
        if r.get("rewrites"):
            print(r["rewrites"])
    return records


def variant_rows(records: list[dict], parity_ok: bool | None) -> list[list]:
    timings = [r for r in records if r["record"] == "timing"]
    dense = next((r for r in timings if r["variant"] == "dense" and r["status"] == "ok"), None)
    rows = []
    for r in timings:
        if r["status"] != "ok":
            rows.append([r["variant"], r["status"], "-", "-", "-", r.get("detail", "")])
            continue
        ratio = "-" if dense is None else ratio_text(r["tok_s"] / dense["tok_s"], parity_ok)
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        rows.append([r["variant"], f"{r['tok_s']:,.0f}", f"{r['step_ms']:.1f}", f"{r['first_step_s']:.1f}", peak,
                     ratio])
    return rows


def ratio_text(ratio: float, parity_ok: bool | None) -> str:
    if parity_ok is None:
        return "n/a (no parity)"
    return f"{ratio:.2f}x" if parity_ok else "n/a (parity failed)"


# --- the summary over every record ----------------------------------------------------------------


def run_config(args) -> OptimizeConfig:
    """optimize's config of the run: --compiler and --cuda-graphs (the parity check's too; also
    bench_corpus's, for every model and the reference)."""
    return config_for(args.compiler).replace(cuda_graphs=args.cuda_graphs)


def group_of(r: dict) -> tuple[str, str, str]:
    """(card, torch version, model): runs with CUDA graphs (--cuda-graphs) are a group of their own."""
    return r["card"], r["torch"], r["model"] + (" with CUDA graphs" if r.get("cuda_graphs") else "")


def latest(records: list[dict]) -> tuple[dict, dict]:
    """The latest timing per (group, seq-len, batch, variant) and parity per (group, seq-len);
    a group is one card, torch version and model (numbers of different groups are not compared)."""
    timings, parities = {}, {}
    for r in records:  # file order is time order: later records replace earlier ones
        group = group_of(r)
        if r["record"] == "timing":
            timings[(group, r["seq_len"], r["batch"], r["variant"])] = r
        elif r["record"] == "parity" and (r["ok"] is not None or (group, r["seq_len"]) not in parities):
            parities[(group, r["seq_len"])] = r
    return timings, parities


def summary_tables(records: list[dict]) -> list[tuple[tuple, list[list], list[list]]]:
    """Per group: (group, throughput rows, compile-time and memory rows)."""
    timings, parities = latest(records)
    out = []
    for group in dict.fromkeys(key[0] for key in timings):
        shapes = sorted({(key[1], key[2]) for key in timings if key[0] == group})
        speed, compile_rows = [], []
        for seq_len, batch in shapes:
            got = {v: timings.get((group, seq_len, batch, v)) for v in VARIANTS}
            ok = {v: got[v] is not None and got[v]["status"] == "ok" for v in VARIANTS}
            p = parities.get((group, seq_len))
            parity_ok = None if p is None else p["ok"]
            parity = "-" if p is None else parity_cell(p)
            target = SPEEDUP_TARGETS.get(seq_len)
            if ok["optimize"] and ok["dense"]:
                ratio = got["optimize"]["tok_s"] / got["dense"]["tok_s"]
                verdict = ratio_text(ratio, parity_ok)
                if target is not None and parity_ok:
                    verdict += f" (target {target}x: {'met' if ratio >= target else 'missed'})"
            else:
                verdict = "-"
            speed.append([seq_len, batch, *(cell(got[v], "tok_s", "{:,.0f}") for v in VARIANTS), verdict, parity])
            if ok["optimize"] and ok["compile"]:
                c = got["optimize"]["first_step_s"] / got["compile"]["first_step_s"]
                cverdict = f"{c:.2f}x ({'met' if c <= COMPILE_TIME_TARGET else 'missed'})"
            else:
                cverdict = "-"
            compile_rows.append([seq_len, batch, *(cell(got[v], "first_step_s", "{:.1f}") for v in VARIANTS),
                                 cverdict, *(cell(got[v], "peak_gib", "{:.2f}") for v in VARIANTS)])
        out.append((group, speed, compile_rows))
    return out


def cell(record: dict | None, key: str, fmt: str) -> str:
    """A record's value, or its status where it did not run ('OOM', 'error', ...), or '-'."""
    if record is None:
        return "-"
    if record["status"] != "ok":
        return record["status"]
    return "-" if record[key] is None else fmt.format(record[key])


def parity_cell(p: dict) -> str:
    if p["ok"] is None:
        return "not checked"
    return f"{'PASS' if p['ok'] else 'FAIL'} (seq-len {p['parity_len']})"


def print_summary(records: list[dict]) -> None:
    for (card, version, model), speed, compile_rows in summary_tables(records):
        dates = sorted(r["date"] for r in records if group_of(r) == (card, version, model))
        print(f"\nsummary: {model} on {card}, torch {version}, {dates[0][:10]}"
              + (f" to {dates[-1][:10]}" if dates[-1][:10] != dates[0][:10] else ""))
        print("tok/s")
        print(tabulate(speed, headers=["seq-len", "batch", *VARIANTS, "optimize / dense", "parity"],
                       tablefmt="github", disable_numparse=True))
        print(f"first step s (includes the compile) and peak GiB; target: optimize <= {COMPILE_TIME_TARGET}x compile")
        print(tabulate(compile_rows, headers=["seq-len", "batch", *(f"first {v}" for v in VARIANTS),
                                              "optimize / compile", *(f"GiB {v}" for v in VARIANTS)],
                       tablefmt="github", disable_numparse=True))


def write_plot(records: list[dict], path: str) -> bool:
    """tok/s against seq-len, one line per variant (and group); False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot written to {path}: matplotlib is not installed (pip install -e '.[plot]', or run "
              f"--report-only --out FILE --plot {path} where it is)")
        return False
    timings, _ = latest(records)
    groups = list(dict.fromkeys(key[0] for key in timings))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group in groups:
        for variant in VARIANTS:
            points = sorted((key[1], r["tok_s"]) for key, r in timings.items()
                            if key[0] == group and key[3] == variant and r["status"] == "ok")
            if points:
                label = variant if len(groups) == 1 else f"{variant} ({group[0]}, torch {group[1]})"
                ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    seq_lens = sorted({key[1] for key in timings})
    ax.set_xticks(seq_lens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seq_lens])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("training tokens / s")
    if len(groups) == 1:
        card, version, model = groups[0]
        ax.set_title(f"{model}: training throughput, {card}, torch {version}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    return True


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="seed", help="a preset: tiny, seed, paper (default seed)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seq-len", type=int, action="append",
                    help=f"repeatable (default {', '.join(map(str, DEFAULT_SEQ_LENS))})")
    ap.add_argument("--tokens-per-step", type=int, default=DEFAULT_TOKENS_PER_STEP,
                    help="batch = max(1, this // seq-len) unless --batch is given (default %(default)s)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=3, help="timed steps (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default %(default)s)")
    ap.add_argument("--compiler", default="inductor", help="optimize's compiler (nsa_compile.config.COMPILERS)")
    ap.add_argument("--dense-backend", choices=["auto", "default", *SDPA_BACKENDS], default="auto",
                    help="the dense twin's SDPA backend; auto: the fastest at its shape (default)")
    ap.add_argument("--parity-len", type=int, default=None,
                    help="the longest parity length to try (default: the model's "
                         "nsa_compile.parity.choice_length, 2048 for seed; at most the run's seq-len)")
    ap.add_argument("--parity-min-len", type=int, default=64, help="halve the parity length on OOM no further than this (the first length always runs)")
    ap.add_argument("--no-parity", action="store_true", help="skip parity (ratios then print n/a)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="compile with the shared Inductor cache (default: an empty one per variant)")
    ap.add_argument("--cuda-graphs", action="store_true", help="every compiled column replays CUDA graphs: optimize "
                    "with OptimizeConfig(cuda_graphs=True), torch.compile and the dense twin with mode='reduce-overhead'")
    ap.add_argument("--out", default=None, help="append JSON-line records here")
    ap.add_argument("--plot", default=None, help="write a PNG of tok/s against seq-len (needs matplotlib)")
    ap.add_argument("--report-only", action="store_true", help="run nothing: summarize --out (and --plot)")
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"unknown variant(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(VARIANTS)}")
    if args.report_only and not args.out:
        ap.error("--report-only needs --out (the records to summarize)")
    if min(args.steps, args.tokens_per_step, args.batch or 1, *(args.seq_len or [1])) < 1 or args.warmup < 0:
        ap.error("--steps, --tokens-per-step, --batch and --seq-len must be positive, --warmup >= 0")
    try:
        preset(args.model)
        run_config(args)
    except ValueError as err:
        ap.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        records = load_records(args.out)
        print_summary(records)
        if args.plot:
            write_plot(records, args.plot)
        return 0
    try:
        device = device_named(args.device)
    except ValueError as err:
        sys.exit(f"bench_e2e: {err}")
    env = environment(device, "python3 tools/bench_e2e.py " + shlex.join(argv))
    print(f"{env['date']}  {env['card']}  torch {env['torch']}  triton {env['triton']}")
    print(f"$ {env['command']}")
    if any(v in ("compile", "optimize", "dense") for v in args.variants):
        warm_up_compiler(device)
    parity = ParityCache(args, device)
    records = []
    for seq_len in args.seq_len or DEFAULT_SEQ_LENS:
        records += run_seq_len(seq_len, args, device, env, parity)
    print_summary(load_records(args.out) if args.out else records)
    if args.plot:
        write_plot(load_records(args.out) if args.out else records, args.plot)
    failed = any(r.get("status") == "error" or r.get("ok") is False for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
