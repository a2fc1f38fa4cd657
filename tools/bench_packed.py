"""Packed documents against one document per row (issue 20, point 3): the optimized preset model
trained on the same number of tokens a step, side by side in one process per sequence length.

    python3 tools/bench_packed.py --seq-len 2048 --seq-len 32768 --out packed.jsonl

Per seq-len, two timed columns of `nsa_compile.optimize` (forward, backward and a fused AdamW step
under bf16 autocast on CUDA; batch --tokens-per-step // seq-len):

  unpacked  one document per row (no positions: the model's plain path)
  packed    every row packs the same documents, their lengths drawn log-uniformly from
            [--min-doc, min(--max-doc, seq-len)] (seeded; the last one cut so they sum to
            seq-len): the model
            takes the positions within each document (models/nsa.py `pos`)

and what each ran with: the rewrites, and the backend each NSA op's forward took (`auto`'s choice,
read at each call: a packed row that falls back to a chunked `reference` backend shows it here). Then parity of the packed model's first training step
(nsa_compile.parity.check_parity at batch 1, documents drawn for the parity length the same way,
halving while the float64 oracle runs out of memory). The packed / unpacked ratio is printed only
when that parity passed; the issue's target is >= 0.9 (within 10%).

Records (JSON lines, with card, torch, date and command) go to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import DEFAULT_TOKENS_PER_STEP, append_record, environment, warm_up_compiler

from nsa_compile.bench import compile_variant, config_for, device_named, free_memory, is_oom, time_training
from nsa_compile.explain import pass_table, rewrite_summary
from nsa_compile.models import preset
from nsa_compile.ops import registry
from nsa_compile.parity import choice_length, fit_parity, parity_sentence, run_parity
from nsa_compile.workload import checked_workload

TARGET = 0.9  # issue 20: packed tok/s within 10% of unpacked


def document_mix(seq_len: int, min_doc: int, max_doc: int, seed: int) -> list[int]:
    """Document lengths summing to seq_len, each drawn log-uniformly from [min_doc, max_doc] (many
    short documents and a few long ones, as a pretraining packer sees them); the last is cut to fit."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(round(math.exp(rng.uniform(math.log(min_doc), math.log(max_doc)))))
    lengths[-1] -= sum(lengths) - seq_len
    return lengths


@contextlib.contextmanager
def backends_taken():
    """Yields a set that collects 'op: backend' for every NSA op forward run meanwhile (each op's
    check returns the backend it chose; the registry reads op.check at each call)."""
    taken, checks = set(), [(op, op.check) for op in registry.ops()]

    def recording(op, check):
        def check_and_record(*values):
            chosen = check(*values)
            taken.add(f"{op.name}: {chosen}")
            return chosen
        return check_and_record

    for op, check in checks:
        op.check = recording(op, check)
    try:
        yield taken
    finally:
        for op, check in checks:
            op.check = check


def documents_for(seq_len: int, args) -> list[int]:
    """The run's documents at this length: drawn from [--min-doc, --max-doc], capped at seq_len (a
    2k row packs several documents rather than one cut from an 8k draw)."""
    return document_mix(seq_len, min(args.min_doc, seq_len), min(args.max_doc, seq_len), args.seed)


def time_column(column: str, args, seq_len: int, batch: int, device: torch.device) -> dict:
    """Optimize and time one column: a record (status ok, OOM or error)."""
    documents = documents_for(seq_len, args) if column == "packed" else None
    record = {"column": column, "documents": None if documents is None else len(documents)}
    model = None
    try:
        wl = checked_workload(args.model, batch, seq_len, device, documents=documents)
        model = compile_variant("optimize", wl, args.compiler, device)
        with backends_taken() as taken:
            timing = time_training(model, wl.inputs, steps=args.steps, warmup=args.warmup,
                                   autocast_dtype=torch.bfloat16 if device.type == "cuda" else None)
        if timing is None:
            return {**record, "status": "OOM", "detail": "out of memory in a training step"}
        table = pass_table(model)
        record.update(status="ok", tok_s=timing.tokens_per_s, step_ms=timing.step_ms,
                      first_step_s=timing.first_step_s, peak_gib=timing.peak_memory_gib,
                      rewrites=rewrite_summary(table), backends=sorted(taken))
        return record
    except Exception as err:  # one column's failure must not cost the other its result
        if is_oom(err):
            return {**record, "status": "OOM", "detail": "out of memory"}
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return {**record, "status": "error", "detail": f"{type(err).__name__}: {first}"}
    finally:
        del model
        free_memory()


def packed_parity(args, seq_len: int, device: torch.device) -> dict:
    """check_parity of the packed model's first step at batch 1 (documents drawn for that length)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = config_for(args.compiler)

    def run(length):
        documents = documents_for(length, args)
        return run_parity(checked_workload(args.model, 1, length, device, seed=1, documents=documents), dtype, config)

    length = min(seq_len, args.parity_len or choice_length(preset(args.model)) or seq_len)
    fit = fit_parity(run, length, args.parity_min_len)
    if fit.report is None:
        return fit.record()
    cfg = preset(args.model)
    return {**fit.record(), "dtype": str(dtype).removeprefix("torch."),
            "selection_exercised": fit.length > cfg.n_selected * cfg.sel_block, "summary": fit.report.summary()}


def run_seq_len(seq_len: int, args, device: torch.device, env: dict) -> list[dict]:
    batch = args.batch or max(1, args.tokens_per_step // seq_len)
    print(f"\n{args.model}, seq-len {seq_len}, batch {batch}: documents "
          f"{documents_for(seq_len, args)}", flush=True)
    base = {"record": "packed", **env, "model": args.model, "seq_len": seq_len, "batch": batch,
            "compiler": args.compiler}
    records = []
    for column in ("unpacked", "packed"):
        started = time.perf_counter()
        record = {**base, **time_column(column, args, seq_len, batch, device)}
        print(f"  {column}: {record['status']} ({time.perf_counter() - started:.0f} s)"
              + (f": {record['detail']}" if "detail" in record else ""), flush=True)
        if record["status"] == "ok":
            print(f"    {record['rewrites']}\n    backends: {', '.join(record['backends'])}")
        append_record(args.out, record)
        records.append(record)
    p = {"ok": None, "parity_len": None, "detail": "--no-parity"} if args.no_parity else \
        packed_parity(args, seq_len, device)
    ran = p["ok"] is not None and "detail" not in p
    where = f"loss, output, every gradient vs float64; {p['dtype']}, batch 1, seq-len {p['parity_len']}" if ran else ""
    print(parity_sentence(p, "the packed model's first step", where))
    for line in p.get("summary", []):
        print(f"  {line}")
    parity_record = {**base, "record": "packed_parity", **p}
    append_record(args.out, parity_record)
    print(tabulate(rows(records, p["ok"]), headers=["", "tok/s", "step ms", "first step s", "peak GiB",
                                                    "/ unpacked"], tablefmt="github", disable_numparse=True))
    return records + [parity_record]


def rows(records: list[dict], parity_ok: bool | None) -> list[list[str]]:
    unpacked = next((r for r in records if r["column"] == "unpacked" and r["status"] == "ok"), None)
    out = []
    for r in records:
        if r["status"] != "ok":
            out.append([r["column"], r["status"], "-", "-", "-", "-"])
            continue
        if r["column"] == "unpacked" or unpacked is None:
            ratio = "-"
        elif parity_ok is None:
            ratio = "n/a (no parity)"
        elif not parity_ok:
            ratio = "n/a (parity failed)"
        else:
            value = r["tok_s"] / unpacked["tok_s"]
            ratio = f"{value:.2f}x (target >= {TARGET}: {'met' if value >= TARGET else 'missed'})"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        out.append([f"{r['column']} ({r['documents']} documents)" if r["documents"] else r["column"],
                    f"{r['tok_s']:,.0f}", f"{r['step_ms']:.1f}", f"{r['first_step_s']:.1f}", peak, ratio])
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="seed", help="a preset: tiny, seed, paper (default seed)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seq-len", type=int, action="append", help="repeatable (default 2048)")
    ap.add_argument("--tokens-per-step", type=int, default=DEFAULT_TOKENS_PER_STEP,
                    help="batch = max(1, this // seq-len) unless --batch is given (default %(default)s)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--min-doc", type=int, default=100, help="shortest document drawn (default %(default)s)")
    ap.add_argument("--max-doc", type=int, default=8192, help="longest document drawn (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the document draw's seed (default %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default %(default)s)")
    ap.add_argument("--compiler", default="inductor", help="optimize's compiler (nsa_compile.config.COMPILERS)")
    ap.add_argument("--parity-len", type=int, default=None,
                    help="the longest parity length to try (default: the model's choice_length)")
    ap.add_argument("--parity-min-len", type=int, default=64,
                    help="halve the parity length on OOM no further than this (the first length always runs)")
    ap.add_argument("--no-parity", action="store_true", help="skip parity (the ratio then prints n/a)")
    ap.add_argument("--out", default=None, help="append JSON-line records here")
    args = ap.parse_args(argv)
    if min(args.steps, args.tokens_per_step, args.batch or 1, *(args.seq_len or [1])) < 1 or args.warmup < 0:
        ap.error("--steps, --tokens-per-step, --batch and --seq-len must be positive, --warmup >= 0")
    if not 1 <= args.min_doc <= args.max_doc:
        ap.error(f"need 1 <= --min-doc <= --max-doc, got {args.min_doc} and {args.max_doc}")
    try:
        preset(args.model)
        config_for(args.compiler)
    except ValueError as err:
        ap.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        device = device_named(args.device)
    except ValueError as err:
        sys.exit(f"bench_packed: {err}")
    env = environment(device, "python3 tools/bench_packed.py " + shlex.join(argv))
    print(f"{env['date']}  {env['card']}  torch {env['torch']}  triton {env['triton']}")
    print(f"$ {env['command']}")
    warm_up_compiler(device)
    records = []
    for seq_len in args.seq_len or [2048]:
        records += run_seq_len(seq_len, args, device, env)
    failed = [r for r in records if r.get("status") == "error" or r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
