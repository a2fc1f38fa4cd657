"""Issue 17's GPU table: each corpus model (tests/corpus) at the seed shape, trained under
`optimize`, against the reference seed preset's NSA attention under `optimize`, in one process.

Every corpus model is one attention module (its projections, three branches, gate and output
projection; two put an RMSNorm first), so the yardstick is the same: `reference` below is
models/nsa.py's NSAAttention with the seed preset, alone, taking x [B, S, 768] (RoPE tables
computed in its forward, as TinyLM computes them). The reference runs first, then each model
(default: all of tests/corpus.MODELS; --models a,b chooses), each built by its `make_seed(batch,
seq_len)` (the seed's sizes, or the nearest its semantics allow: its docstring says which):

- timing, as tools/bench_e2e.py times the preset: `nsa_compile.optimize` (--compiler, Inductor by
  default), then training steps (forward, backward, fused AdamW) under bf16 autocast on CUDA, the
  loss the mean square of the output: the first step (which compiles), --warmup untimed steps,
  then the median of --steps timed ones. tok/s = batch * seq-len / median step; peak memory over
  all of them (CUDA; the table's column), and over the steps after the first (printed and
  recorded as steps_peak_gib: the first step holds the compile and its float64 probes, e.g.
  lucidrains' fine branch at 2.15e9 elements, 16 GiB). A model that runs out of memory is reported as OOM (the target: it fits
  wherever the reference fits). Batch: --batch, or bench_e2e's 65536 tokens per step // seq-len
  (32 at S 2048, the batch the seed preset trains at in bench_e2e).
- rewritten: how many of the six NSA rewrites (projections + RoPE, window, compressed, block
  selection, selected, gated combine) matched at least once in the timed model
  (`nsa_compile.report`), and the coverage line (NSA branches rewritten / detected).
- parity: `nsa_compile.parity.check_parity` of the first step (output and every gradient, bf16
  on CUDA and fp32 on the CPU, against the float64 eager model), at batch 1 and length
  min(seq-len, --parity-len), --parity-len defaulting to the seed's choice_length (2048, where
  the top-n block choice is exercised), halving while it runs out of memory (the length used is
  printed and stored; at n * l' = 1024 tokens or fewer every candidate block is selected).
- the ratio: the model's tok/s over the reference's of the same run, shown only where both passed
  parity (issue 17's target: at least 0.9x).

--model-limit SECONDS stops a model whose timing and parity together run longer (a compile that
stalls): its record says 'time limit' and where it was (the innermost frames), and the next model
runs. Per-model progress goes to stdout as it happens. Each model's record (one JSON line, with card,
torch version, date, command and the run's id) is appended to --out as soon as it exists, so a call
cut by its time limit keeps the models it finished. About six models are meant to fit one
10-minute GPU call (each list: four that coverage.json has fully rewritten, then partly rewritten ones):

    python3 tools/bench_corpus.py --models paper_bhsd,fla_naive_bthd,sdpa_complex_rope,where_bias_spellings,lucidrains_shared_kv,xunhaolai_varlen --out corpus.jsonl
    python3 tools/bench_corpus.py --models tiled_gqa_fla,grouped5d_nograd,fused_qkv_per_head,nsa_vibe_noncausal,chunked_queries,lucidrains_per_head --out corpus.jsonl
    python3 tools/bench_corpus.py --report-only --out corpus.jsonl      # both calls' table, no GPU needed

Each call times its own reference; a ratio is always against the reference of the same run.
The same model's median step has moved between about 12 and 22 ms from one run to the next on one
host kind (H200, 2026-11-27; BENCHMARKS.md), so a single run's ratio is not to be trusted alone:
--repeats R times each model R times in its process (the median of the medians, each printed) and
--reference-after times the reference again after the last model (its ratio to the first is the
run's drift), which tell a slow process from a slow moment. Each timing also records how long
Python's garbage collector ran in the timed steps (gc_ms_per_step, gc_full: a stall of the
launching thread shows in a host-bound step whole), how long the host took to issue a step
(host_ms: near the step's time, the step waits on the host), the caching allocator's retries and
cudaMallocs in the timed steps (a card near full frees and mallocs every step), and, before each
repeat, machine_pulse: a fixed Python loop, fixed bf16 matmuls and the load average, which say
whether the host or the card was slow at that moment.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_e2e beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the corpus
from bench_e2e import DEFAULT_TOKENS_PER_STEP, append_record, environment, load_records, run_config, warm_up_compiler
from corpus import MODELS

import nsa_compile
from nsa_compile.bench import device_named, free_memory, is_oom, machine_pulse, time_training
from nsa_compile.explain import coverage
from nsa_compile.models import NSAAttention, preset
from nsa_compile.models.nsa import rope_tables
from nsa_compile.parity import check_parity, choice_length, fit_parity, parity_sentence

REFERENCE = "reference"
# --reference-after: the reference timed once more after the last model, in the same process
REFERENCE_AFTER = "reference (after)"
SEED = preset("seed")
# The six NSA rewrites a model's row counts (of nsa_compile.report's passes; canonicalize and
# gqa_grouped_matmul serve them and are not counted).
REWRITES = ("projection_rope", "window_attention", "compressed_attention", "select_blocks",
            "selected_attention", "gated_combine")
TARGET_RATIO = 0.9  # issue 17: each corpus model at >= 0.9x the reference's tok/s
HEADERS = ["model", "rewritten", "tok/s", "step ms", "first step s", "peak GiB", "/ reference", "parity"]


class ReferenceAttention(nn.Module):
    """The reference: models/nsa.py's NSAAttention of a preset, x [B, S, dim] -> [B, S, dim], with
    the RoPE tables [S, r/2] computed in forward (as TinyLM does): one attention module, like each
    corpus model."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.attn = NSAAttention(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(x.shape[1], self.cfg.rot_dim, self.cfg.rope_base, x.device)
        return self.attn(x, cos, sin)


def make_reference(batch: int = 32, seq_len: int = 2048) -> tuple[nn.Module, torch.Tensor]:
    """(the seed preset's attention, x [batch, seq_len, 768]): the corpus models' make_seed contract."""
    torch.manual_seed(0)
    return ReferenceAttention(SEED), torch.randn(batch, seq_len, SEED.dim)


def build(name: str, batch: int, seq_len: int, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """(module, x) of the reference or a corpus model (file stem) at the seed shape, on device."""
    if name in (REFERENCE, REFERENCE_AFTER):
        model, x = make_reference(batch, seq_len)
    else:
        model, x = importlib.import_module(f"corpus.{name}").make_seed(batch=batch, seq_len=seq_len)
    return model.to(device), x.to(device)


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


# --- one model ------------------------------------------------------------------------------------


def rewrites_of(model: nn.Module) -> dict:
    """What the optimized model ran with: matches per pass, how many of REWRITES matched, coverage."""
    rows = nsa_compile.report(model)
    matches = {r["name"]: r["matches"] for r in rows}
    return {"rewritten": sum(matches.get(name, 0) > 0 for name in REWRITES), "matches": matches,
            "refused": {r["name"]: r["refused"] for r in rows if r["refused"]},
            "reasons": {r["name"]: r["reasons"] for r in rows if r["reasons"]},
            "coverage": coverage(model).summary()}


class GcClock:
    """The time Python's garbage collector ran during the timed steps (a gc callback), and its
    collections of the oldest generation: a host-bound step shows every stall of the launching
    thread. Only collections inside the `steps_timed` timed steps count: not those of the
    `steps_before` steps before them (the first and the warm-up ones), nor time_training's own
    gc.collect() after them. `step()` is time_training's progress callback."""

    def __init__(self, steps_before: int, steps_timed: int) -> None:
        self.steps_before, self.steps_timed = steps_before, steps_timed
        self.done, self.seconds, self.full, self._start = 0, 0.0, 0, None

    def step(self, n: int) -> None:
        self.done += n

    def timing_again(self) -> None:  # a repeat starts its first and warm-up steps afresh
        self.done = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            if self.steps_before <= self.done < self.steps_before + self.steps_timed:  # in a timed step
                self.seconds += time.perf_counter() - self._start
                self.full += info.get("generation") == 2
            self._start = None


def time_model(name: str, args, device: torch.device) -> dict:
    """Optimize the model at (args.batch, args.seq_len) and time its training steps: a record."""
    model = None
    try:
        model, x = build(name, args.batch, args.seq_len, device)
        torch._dynamo.reset()
        model = nsa_compile.optimize(model, run_config(args))
        timings, pulses = [], []
        clock = GcClock(1 + args.warmup, args.steps)
        gc.callbacks.append(clock)
        try:
            for _ in range(args.repeats):  # the first compiles; each repeat times its own steps
                clock.timing_again()
                pulses.append(machine_pulse(device))  # the host's and the card's speed of the moment
                timings.append(time_training(model, (x,), steps=args.steps, warmup=args.warmup, is_lm=False,
                                             autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                                             progress=clock.step))
                if timings[-1] is None:
                    break
        finally:
            gc.callbacks.remove(clock)
        timing = timings[0] if all(t is not None for t in timings) else None
        status, detail = ("ok", None) if timing is not None else ("OOM", "out of memory in a training step")
    except Exception as err:  # one model's failure must not cost the others their results
        timing = None
        status, detail = ("OOM", f"out of memory: {one_line(err)}") if is_oom(err) else ("error", one_line(err))
        if status == "error":
            traceback.print_exc()
    record = {"status": status, "detail": detail}
    try:
        record.update(rewrites_of(model))  # where the passes ran (also when a step then ran out of memory)
    except Exception:  # optimize itself failed: no record of the passes
        record.update(rewritten=None, matches={}, refused={}, reasons={}, coverage=None)
    if timing is not None:
        runs = [t.step_ms for t in timings]
        step_ms = sorted(runs)[len(runs) // 2]  # the median of the repeats' medians
        peaks = [t.peak_memory_gib for t in timings if t.peak_memory_gib is not None]
        steps_peaks = [t.steps_peak_gib for t in timings if t.steps_peak_gib is not None]
        record.update(tok_s=args.batch * args.seq_len * 1000 / step_ms, step_ms=step_ms,
                      first_step_s=timing.first_step_s, peak_gib=max(peaks) if peaks else None,
                      steps_peak_gib=max(steps_peaks) if steps_peaks else None)
        if len(runs) > 1:
            record["step_ms_repeats"] = runs
        record.update(gc_ms_per_step=1000 * clock.seconds / (args.steps * len(runs)), gc_full=clock.full)
        hosts = sorted(t.host_ms for t in timings if t.host_ms is not None)
        record.update(host_ms=hosts[len(hosts) // 2] if hosts else None, pulses=pulses)
        if device.type == "cuda":
            record.update(alloc_retries=sum(t.alloc_retries or 0 for t in timings),
                          device_allocs=sum(t.device_allocs or 0 for t in timings))
    del model
    free_memory()
    return record


def parity_of(name: str, args, device: torch.device) -> dict:
    """check_parity at batch 1 and the longest length <= min(seq_len, --parity-len) that fits,
    halving while it runs out of memory: a record."""
    if args.no_parity:
        return {"ok": None, "parity_len": None, "detail": "--no-parity"}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = run_config(args)

    def optimize_fn(module):
        torch._dynamo.reset()
        return nsa_compile.optimize(module, config)

    def run(length):
        model, x = build(name, 1, length, device)
        result = check_parity(model, optimize_fn, (x,), dtype, is_lm=False)
        del model, x
        free_memory()
        return result

    fit = fit_parity(run, min(args.seq_len, args.parity_len), args.parity_min_len)
    if fit.report is None:
        return fit.record()
    return {**fit.record(), "dtype": str(dtype).removeprefix("torch."),
            "selection_exercised": fit.length > SEED.n_selected * SEED.sel_block, "summary": fit.report.summary(),
            "worst": [r.as_dict() for r in (fit.report.failures() or fit.report.rows)[:5]]}


def parity_text(p: dict) -> str:
    ran = p["ok"] is not None and "detail" not in p
    where = f"output, every gradient vs float64; {p['dtype']}, batch 1, seq-len {p['parity_len']}" if ran else ""
    return parity_sentence(p, "the first step", where)


class TimeLimit(BaseException):
    """--model-limit ran out (a BaseException: the phases' `except Exception` must not take it)."""


def where_stopped(err: BaseException) -> str:
    """Where a model was when its time ran out, short: the innermost frame, then the innermost four
    of this project's passes and ops (nsa_compile/; a probe's own frames name no pass)."""
    frames = traceback.extract_tb(err.__traceback__)[1:-1]  # [0] is run_model, [-1] the alarm handler
    ours = [f for f in frames if "nsa_compile" in Path(f.filename).parts and Path(f.filename).name != "probe.py"]
    shown = frames[-1:] + [f for f in reversed(ours[-4:]) if f is not frames[-1]] if frames else []
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in shown)


@contextlib.contextmanager
def time_limited(seconds: int):
    """TimeLimit in the body after `seconds` (0: none), via SIGALRM in the main thread; the previous
    handler is put back after it."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise TimeLimit(f"--model-limit {seconds} s ran out")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_model(name: str, args, device: torch.device, env: dict, run: str) -> dict:
    """Time and check one model within --model-limit, print its progress, append and return its record
    (REFERENCE_AFTER: timed only, its parity is the first reference's)."""
    started = time.perf_counter()
    record = {"record": "corpus", **env, "run": run, "model": name, "seq_len": args.seq_len, "batch": args.batch,
              "compiler": args.compiler, "cuda_graphs": args.cuda_graphs}
    phase = "timing"
    try:
        with time_limited(args.model_limit):
            print(f"\n{name}: optimize, {args.batch} x {args.seq_len}, {args.warmup} warm-up and {args.steps} "
                  f"timed steps ...", flush=True)
            record.update(time_model(name, args, device))
            report_timing(record)
            phase = "parity"
            if name == REFERENCE_AFTER:
                record["parity"] = {"ok": None, "parity_len": None, "detail": "timing only: the reference again"}
            else:
                print("  parity ...", flush=True)
                record["parity"] = parity_of(name, args, device)
    except TimeLimit as err:
        detail = f"{err} in {phase}: {where_stopped(err)}"
        print(f"  time limit: {detail}", flush=True)
        if phase == "timing":
            record.update(status="time limit", detail=detail, rewritten=None, matches={}, refused={}, reasons={},
                          coverage=None)
        record["parity"] = {"ok": None, "parity_len": None, "detail": detail}
        torch._dynamo.reset()
        free_memory()
    record["seconds"] = round(time.perf_counter() - started, 1)
    report_parity(record)
    print(f"  ({record['seconds']:.0f} s)", flush=True)
    append_record(args.out, record)
    return record


def report_timing(record: dict) -> None:
    """Print a model's timing, coverage and refusals, as explain says them."""
    if record["status"] == "ok":
        repeats = record.get("step_ms_repeats")
        spread = "" if not repeats else " (median of " + ", ".join(f"{ms:.1f}" for ms in repeats) + " ms)"
        print(f"  {record['tok_s']:,.0f} tok/s, step {record['step_ms']:.1f} ms{spread}, first step "
              f"{record['first_step_s']:.1f} s" + ("" if record["peak_gib"] is None else
                                                    f", peak {record['peak_gib']:.2f} GiB (the steps after "
                                                    f"the first: {record['steps_peak_gib']:.2f})")
              + f", gc {record['gc_ms_per_step']:.2f} ms a timed step ({record['gc_full']} full)", flush=True)
        if record.get("host_ms") is not None:  # older records have no diagnostics
            allocator = ("" if "alloc_retries" not in record else
                         f"; allocator: {record['alloc_retries']} retries, {record['device_allocs']} cudaMallocs")
            print(f"  issued in {record['host_ms']:.1f} ms of the step{allocator}; pulse "
                  + ", ".join(pulse_text(p) for p in record["pulses"]), flush=True)
    else:
        print(f"  {record['status']}: {record['detail']}", flush=True)
    if record["coverage"] is not None:
        print(f"  rewritten {record['rewritten']}/{len(REWRITES)}: {record['coverage']}", flush=True)
    for pass_name, reasons in record["reasons"].items():  # why a branch stayed eager, as explain says it
        print(f"  {pass_name} refused {record['refused'][pass_name]}x: " + "; ".join(r[:240] for r in reasons[:3]),
              flush=True)


def pulse_text(pulse: dict) -> str:
    """machine_pulse in a few characters: host loop ms / GPU matmuls ms / load."""
    gpu = "" if pulse["gpu_ms"] is None else f"/{pulse['gpu_ms']:.1f}"
    load = "" if pulse["load"] is None else f" (load {pulse['load']:.1f})"
    return f"{pulse['host_ms']:.1f}{gpu} ms{load}"


def report_parity(record: dict) -> None:
    """Print a model's parity verdict, and its worst tensors when it failed."""
    print(f"  {parity_text(record['parity'])}", flush=True)
    for line in record["parity"].get("summary", []):
        print(f"  {line}")
    if record["parity"]["ok"] is False and record["parity"].get("worst"):
        print(tabulate([[r["name"], f"{r['err_optimized']:.2e}", f"{r['err_eager']:.2e}", f"{r['bar']:.2e}"]
                        for r in record["parity"]["worst"]],
                       headers=["tensor (worst first)", "optimized err", "eager err", "bar"], tablefmt="github",
                       disable_numparse=True))


# --- the table ------------------------------------------------------------------------------------


def ratio_cell(record: dict, reference: dict | None) -> str:
    """tok/s over the same run's reference, only where both ran and passed parity; a model out of
    memory where the reference ran misses the target whatever its parity."""
    if record["model"] == REFERENCE:
        return "1.00x" if record["status"] == "ok" else "-"
    if reference is None or reference["status"] != "ok":
        return "-"
    if record["model"] == REFERENCE_AFTER:  # the reference's own drift over the run: no target
        return f"{record['tok_s'] / reference['tok_s']:.2f}x (drift)" if record["status"] == "ok" else "-"
    if record["status"] == "OOM":  # the target: it fits wherever the reference fits
        return "OOM: missed"
    if record["status"] != "ok":
        return "-"
    if record["parity"]["ok"] is None or reference["parity"]["ok"] is None:
        return "n/a (no parity)"
    if not (record["parity"]["ok"] and reference["parity"]["ok"]):
        return "n/a (parity failed)"
    ratio = record["tok_s"] / reference["tok_s"]
    return f"{ratio:.2f}x ({'met' if ratio >= TARGET_RATIO else 'missed'})"


def parity_cell(p: dict) -> str:
    if p["ok"] is None:
        return "not checked"
    return f"{'PASS' if p['ok'] else 'FAIL'} (S {p['parity_len']})"


def cell(record: dict, key: str, fmt: str) -> str:
    """A timed value, or the record's status where it did not run ('OOM', 'error'), or '-'."""
    if record["status"] != "ok":
        return record["status"]
    return "-" if record.get(key) is None else fmt.format(record[key])


def table_rows(records: list[dict]) -> list[list[str]]:
    """One row per record (each against the reference of its own run)."""
    references = {r["run"]: r for r in records if r["model"] == REFERENCE}
    rows = []
    for r in records:
        rewritten = "-" if r["rewritten"] is None else f"{r['rewritten']}/{len(REWRITES)}"
        rows.append([r["model"], rewritten, cell(r, "tok_s", "{:,.0f}"), cell(r, "step_ms", "{:.1f}"),
                     cell(r, "first_step_s", "{:.1f}"), cell(r, "peak_gib", "{:.2f}"),
                     ratio_cell(r, references.get(r["run"])), parity_cell(r["parity"])])
    return rows


def print_table(records: list[dict]) -> None:
    """The table, one per card, torch version and shape (numbers of different groups are not compared)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["card"], r["torch"], r["seq_len"], r["batch"], r["compiler"], r.get("cuda_graphs", False)),
                          []).append(r)
    for (card, version, seq_len, batch, compiler, graphs), group in groups.items():
        dates = sorted(r["date"][:10] for r in group)
        span = dates[0] + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
        print(f"\ncorpus at the seed shape: {card}, torch {version}, {span}, S {seq_len} x batch {batch}, "
              f"optimize ({compiler}{', CUDA graphs' if graphs else ''}); target: >= {TARGET_RATIO}x the reference's tok/s of the same run")
        print(tabulate(table_rows(group), headers=HEADERS, tablefmt="github", disable_numparse=True))


def latest(records: list[dict]) -> list[dict]:
    """The latest record of each model per run group (file order is time order), runs kept in order."""
    kept: dict[tuple, dict] = {}
    for r in records:
        if r.get("record") == "corpus":
            kept[(r["run"], r["model"])] = r
    return list(kept.values())


# --- command line ---------------------------------------------------------------------------------


def model_names(text: str | None) -> list[str]:
    """The corpus file stems named in --models (stems or file names; default all)."""
    stems = [m.removesuffix(".py") for m in MODELS]
    if text is None:
        return stems
    names = [n.strip().removesuffix(".py") for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in stems]
    if unknown or not names:
        raise ValueError(f"unknown corpus model(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(stems)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma-separated corpus file stems (default: all); the "
                                                   "reference always runs first")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seq-len", type=int, default=2048, help="default %(default)s (the seed shape)")
    ap.add_argument("--batch", type=int, default=None,
                    help=f"default {DEFAULT_TOKENS_PER_STEP} // seq-len (bench_e2e's tokens per step)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="time each model's --warmup and --steps this many "
                    "times (the first compiles); its step is the median of the repeats' medians, each printed "
                    "(default %(default)s)")
    ap.add_argument("--reference-after", action="store_true", help="time the reference again after the last "
                    "model (its tok/s over the first reference's is printed as the run's drift)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (default %(default)s)")
    ap.add_argument("--compiler", default="inductor", help="optimize's compiler (nsa_compile.config.COMPILERS)")
    ap.add_argument("--parity-len", type=int, default=choice_length(SEED),
                    help="the longest parity length to try (default %(default)s: the seed's choice_length; "
                         "at most --seq-len)")
    ap.add_argument("--parity-min-len", type=int, default=64, help="halve the parity length on OOM no further than this (the first length always runs)")
    ap.add_argument("--no-parity", action="store_true", help="skip parity (ratios then print n/a)")
    ap.add_argument("--model-limit", type=int, default=0, help="seconds one model (timing and parity) may take "
                    "before it is stopped and recorded as 'time limit' with where it was (default: no limit)")
    ap.add_argument("--cuda-graphs", action="store_true", help="OptimizeConfig(cuda_graphs=True) for every model "
                    "and the reference: each compiled graph replayed as one CUDA graph (no per-kernel launches)")
    ap.add_argument("--out", default=None, help="append JSON-line records here")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the table of --out's records")
    args = ap.parse_args(argv)
    if args.report_only and not args.out:
        ap.error("--report-only needs --out (the records to tabulate)")
    try:
        args.models = model_names(args.models)
        run_config(args)
    except ValueError as err:
        ap.error(str(err))
    if min(args.steps, args.seq_len, args.parity_len, args.batch or 1, args.repeats) < 1 or args.warmup < 0:
        ap.error("--steps, --seq-len, --batch, --parity-len and --repeats must be positive, --warmup >= 0")
    args.batch = args.batch or max(1, DEFAULT_TOKENS_PER_STEP // args.seq_len)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        print_table(latest(load_records(args.out)))
        return 0
    try:
        device = device_named(args.device)
    except ValueError as err:
        sys.exit(f"bench_corpus: {err}")
    env = environment(device, "python3 tools/bench_corpus.py " + shlex.join(argv))
    run = f"{env['date']} pid {os.getpid()}"
    print(f"{env['date']}  {env['card']}  torch {env['torch']}  triton {env['triton']}")
    print(f"$ {env['command']}")
    print(f"{len(args.models)} corpus model(s) and the reference at {args.batch} x {args.seq_len}, "
          f"optimize ({args.compiler}{', CUDA graphs' if args.cuda_graphs else ''})", flush=True)
    warm_up_compiler(device)
    names = (REFERENCE, *args.models, *((REFERENCE_AFTER,) if args.reference_after else ()))
    records = [run_model(name, args, device, env, run) for name in names]
    print_table(records)
    failed = any(r["status"] in ("error", "time limit") or r["parity"]["ok"] is False for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
