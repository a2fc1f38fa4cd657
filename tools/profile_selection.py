"""Per-stage profile and tile sweep of the Triton selected-attention kernels
(nsa_compile/ops/selection_triton.py), on one CUDA card, bf16, batch 1 (or --batch), random valid block ids
(tools/bench_selection.py's `random_block_idx` and inputs).

For every (shape, S): the default configuration's stages timed one by one (CUDA events, median of
--reps after a warm-up): the forward kernel, the dq kernel (+ delta), the inverted-selection build
(torch ops), the dk/dv kernel, the reduce kernel, and the totals `selected_forward` and
`selected_backward` (the public functions: allocations and launch gaps included); useful TFLOP/s
per kernel and its registers / spills / shared memory. Then a sweep of the tunables: one
parameter changed at a time from the defaults (`_tiles(..., override=)` and the dk/dv segment
length), each row with the time of the stage(s) it changes, its speedup over the default, and
whether o, dq, dk, dv still match the default's (max abs difference). Last, the best override of
every stage combined, timed whole and checked.

    python3 tools/profile_selection.py --shape seed --seq-len 2048 --seq-len 16384 --shape paper --seq-len 16384
    python3 tools/profile_selection.py --shape paper --seq-len 65536 --sweep none
    python3 tools/profile_selection.py --shape seed --shape paper --list-configs     # no GPU needed

A --seq-len belongs to the --shape before it (default shape paper, default S 8192).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_selection import SHAPES, model_block_idx, model_layout, random_block_idx, time_ms
from tabulate import tabulate

from nsa_compile.ops import selection_triton as st
from nsa_compile.ops.common import bshd_empty

STAGES = ("union", "fwd", "dq", "inv", "dkdv", "reduce")
DTYPE = torch.bfloat16
MATCH_TOL = 1e-2  # max|x - x_default| <= MATCH_TOL * max|x_default|, for each of o, dq, dk, dv


# ---------------------------------------------------------------- configurations (no GPU needed)


def default_tiles(shape: str, S: int = 8192) -> dict:
    H, G, D, block_size, n = SHAPES[shape]
    return st._tiles(H // G, D, D, block_size, False, seq_len=S, n_selected=n)


def sweep_configs(shape: str, mode: str, S: int = 8192) -> list[tuple[str, dict]]:
    """(label, override) pairs; an override holds `_tiles` overrides per kernel ("fwd", "dq",
    "dkdv", "reduce") and/or "segment" (DKV_SEGMENT). quick: one parameter at a time; full: also
    the products of a kernel's main parameters."""
    if mode == "none":
        return []
    T = default_tiles(shape, S)
    values = {
        "fwd": {"BLOCK_N": [16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4], "ROWS": [16, 32, 64, 128],
                "TQ": [1, 2, 4, 8, 10, 16, 21, 32]},
        "dq": {"BLOCK_N": [16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4], "ROWS": [16, 32, 64, 128],
               "TQ": [1, 2, 4, 8, 10, 16, 21, 32]},
        "dkdv": {"ROWS": [16, 32, 64, 128], "BLOCK_N": [16, 32, 64], "num_warps": [4, 8, 16], "num_stages": [1, 2, 3, 4]},
        "reduce": {"BLOCK_N": [16, 32, 64], "num_warps": [2, 4, 8]},
    }
    out, seen = [], set()

    def add(kernel, params):
        cur = {key: T[kernel].get(key, 3 if key == "num_stages" else None) for key in params}  # Triton's default: 3
        if all(cur[key] == val for key, val in params.items()):
            return  # the default itself
        key = (kernel, tuple(sorted(params.items())))
        if key not in seen:
            seen.add(key)
            out.append((f"{kernel} " + " ".join(f"{k}={v}" for k, v in params.items()), {kernel: dict(params)}))

    for kernel, params in values.items():
        for name, vals in params.items():
            for val in vals:
                add(kernel, {name: val})
    # whole tile shapes: one query per program (the per-token kernel: ROWS = the group's heads)
    # and small tiles, with the warps that suit their rows
    h = SHAPES[shape][0] // SHAPES[shape][1]
    for kernel in ("fwd", "dq"):
        for tq in (1, 2, 4):
            rows = max(16, min(64, 1 << (tq * h - 1).bit_length()))
            for warps in (4, 8):
                add(kernel, {"TQ": tq, "ROWS": rows, "num_warps": warps})
    if T["dense"]:  # FlashAttention-sized tiles: 128 (query, head) rows (the dense mode's TQ is 64 // h)
        for kernel in ("fwd", "dq"):
            for warps in (4, 8):
                add(kernel, {"TQ": 128 // h, "ROWS": 128, "num_warps": warps})
                add(kernel, {"TQ": 128 // h, "ROWS": 128, "num_warps": warps, "num_stages": 3})
    if mode == "full":
        for kernel, names in (("fwd", ("TQ", "ROWS", "num_warps")), ("dq", ("TQ", "ROWS", "num_warps")),
                              ("dkdv", ("ROWS", "BLOCK_N", "num_warps"))):  # fmt: skip
            for combo in itertools.product(*(values[kernel][n] for n in names)):
                add(kernel, dict(zip(names, combo)))
    if not T["dense"]:  # the segment length is the inverted selection's
        for seg in (256, 512, 1024, 2048, 4096):
            if seg != st.DKV_SEGMENT:
                out.append((f"segment {seg}", {"segment": seg}))
    # the other way of reading the blocks: every block (dense) or the union and inverted selection
    out.append((f"dense={not T['dense']}", {"dense": not T["dense"]}))
    return out


def stages_of(override: dict) -> list[str]:
    """The stages an override changes (the others run the default's kernels)."""
    if "dense" in override:
        return list(STAGES)
    if "segment" in override:
        return ["inv", "dkdv", "reduce"]
    return [kernel for kernel in ("fwd", "dq", "dkdv", "reduce") if kernel in override]


def split(override: dict) -> tuple[dict, int]:
    return {k: v for k, v in override.items() if k != "segment"}, override.get("segment", st.DKV_SEGMENT)


# ---------------------------------------------------------------- running (CUDA)


def make_inputs(shape: str, S: int, B: int = 1, device="cuda", choices: str = "random"):
    H, G, D, block_size, n = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(S)
    q, k, v = (model_layout(B, S, heads, D, gen, DTYPE) for heads in (H, G, G))
    grad = model_layout(B, S, H, D, gen, DTYPE)  # the layout autograd hands the op
    block_idx = (model_block_idx(B, S, shape, device) if choices == "model"
                 else random_block_idx(B, G, S, n, block_size, gen))
    return q, k, v, grad, block_idx, block_size, D**-0.5


class Run:
    """One fwd + bwd through the stage functions at one override; keeps every buffer so that each
    stage can then be re-run (and timed) alone on the same inputs."""

    def __init__(self, inputs, override):
        self.q, self.k, self.v, self.grad, self.idx, self.bs, self.scale = inputs
        tiles, self.segment = split(override)
        q, k, v = self.q, self.k, self.v
        B, H, S, D = q.shape
        G, Dv = k.shape[1], v.shape[3]
        self.T = st._tiles(H // G, D, Dv, self.bs, q.dtype == torch.float32, tiles, seq_len=S,
                           n_selected=self.idx.shape[3])
        self.tiles = tiles
        self.o = bshd_empty(B, H, S, Dv, v)
        self.lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        self.grad_q = bshd_empty(B, H, S, D, q)
        self.dk, self.dv = bshd_empty(B, G, S, D, k), bshd_empty(B, G, S, Dv, v)
        self.delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        self.launched = {}
        for stage in STAGES:
            getattr(self, stage)()

    def fwd(self):  # the tile union is built once per TQ, outside the timed kernel (its cost: `union`)
        self.union_fwd = getattr(self, "union_fwd", None) or st._tile_union(self.idx, self.bs, self.q.shape[2],
                                                                             self.T["fwd"]["TQ"], dense=self.T["dense"])
        self.launched["fwd"] = st._fwd_stage(self.q, self.k, self.v, self.idx, self.union_fwd, self.bs, self.scale,
                                             self.T, self.o, self.lse)  # fmt: skip

    def dq(self):
        self.union_dq = getattr(self, "union_dq", None) or st._tile_union(self.idx, self.bs, self.q.shape[2],
                                                                           self.T["dq"]["TQ"], dense=self.T["dense"])
        self.launched["dq"] = st._dq_stage(self.grad, self.q, self.k, self.v, self.o, self.lse, self.idx, self.union_dq,
                                           self.bs, self.scale, self.T, self.grad_q, self.delta)  # fmt: skip

    def union(self):
        st._tile_union(self.idx, self.bs, self.q.shape[2], self.T["fwd"]["TQ"], dense=self.T["dense"])

    def inv(self):  # the dense mode has none
        self.inverted = None if self.T["dense"] else st._inverted_selection(self.idx, self.bs, self.q.shape[2],
                                                                            self.segment)

    def dkdv(self):
        self.pk, self.pv, self.launched["dkdv"] = st._dkdv_stage(
            self.grad, self.q, self.k, self.v, self.lse, self.delta, self.inverted, self.bs, self.segment, self.scale,
            self.T, self.dk, self.dv, 0, self.idx)  # fmt: skip

    def reduce(self):
        if not self.T["dense"]:
            self.launched["reduce"] = st._reduce_stage(self.pk, self.pv, self.inverted, self.bs, self.T, self.dk,
                                                       self.dv)

    def outputs(self):
        return self.o, self.grad_q, self.dk, self.dv

    def time_stage(self, stage, reps) -> float | None:
        if stage == "reduce" and self.pk.shape[0] == 0 or self.T["dense"] and stage in ("inv", "union"):
            return None  # no block split into several items: no reduce launch; dense: no union, no inversion
        return time_ms(getattr(self, stage), reps)

    def time_totals(self, reps) -> tuple[float, float]:
        a = (self.q, self.k, self.v, self.idx, self.bs, self.scale)
        fwd = time_ms(lambda: st.selected_forward(*a, tiles=self.tiles), reps)
        bwd = time_ms(lambda: st.selected_backward(self.grad, self.q, self.k, self.v, self.o, self.lse, self.idx,
                                                   self.bs, self.scale, tiles=self.tiles, segment=self.segment), reps)  # fmt: skip
        return fwd, bwd

    def resources(self, stage) -> str:
        kern = self.launched.get(stage)
        if kern is None or stage == "inv":
            return "-"
        regs, spills = getattr(kern, "n_regs", "?"), getattr(kern, "n_spills", "?")
        shared = getattr(getattr(kern, "metadata", None), "shared", None)
        return f"{regs}/{spills}/{shared // 1024 if isinstance(shared, int) else '?'}"


def useful_flops(inputs) -> dict:
    """Useful FLOPs per kernel: (query, head, key) pairs that count (tokens <= t of valid blocks)."""
    q, k, v, _, idx, bs, _ = inputs
    B, H, S, Dk = q.shape
    G, Dv = k.shape[1], v.shape[3]
    t = torch.arange(S, device=idx.device)[:, None]
    start = idx * bs
    cnt = torch.where((idx >= 0) & (start <= t), (t - start + 1).clamp(max=bs), 0)
    pairs = cnt.sum().item() * (H // G)
    return {"fwd": 2 * pairs * (Dk + Dv), "dq": 2 * pairs * (2 * Dk + Dv), "dkdv": 2 * pairs * (2 * Dk + 2 * Dv),
            "pairs_per_row": pairs / (B * H * S)}  # fmt: skip


def diffs(outs, ref) -> tuple[list[float], bool]:
    d = [(a.float() - r.float()).abs().max().item() for a, r in zip(outs, ref)]
    ok = all(x <= MATCH_TOL * max(r.float().abs().max().item(), 1e-6) for x, r in zip(d, ref))
    return d, ok


def fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def profile(shape: str, S: int, args) -> None:
    H, G, D, block_size, n = SHAPES[shape]
    print(f"\n=== shape {shape}: H {H}, G {G}, h {H // G}, D {D}, l' {block_size}, n {n}, S {S}, bf16, B {args.batch}, "
          f"{args.choices} choices")
    inputs = make_inputs(shape, S, args.batch, choices=args.choices)
    flops = useful_flops(inputs)
    t0 = time.time()
    base = Run(inputs, {})
    torch.cuda.synchronize()
    ref = [x.clone() for x in base.outputs()]
    again, _ = diffs(Run(inputs, {}).outputs(), ref)
    times = {stage: base.time_stage(stage, args.reps) for stage in STAGES}
    tot_f, tot_b = base.time_totals(args.reps)
    T = base.T
    rows = []
    def tile_grid(cfg):
        return f"{-(-S // cfg['TQ'])}x{G}x{-(-(H // G) * cfg['TQ'] // cfg['ROWS'])}"

    grids = {"fwd": tile_grid(T["fwd"]), "dq": tile_grid(T["dq"]), "union": "-",
             "dkdv": f"{base.inverted[6] if base.inverted else G * -(-S // block_size)}x{-(-block_size // T['dkdv']['BLOCK_N'])}",
             "reduce": "-" if base.inverted is None else f"{base.inverted[7] * G}x{-(-block_size // T['reduce']['BLOCK_N'])}",
             "inv": "-"}  # fmt: skip
    for stage in STAGES:
        tf = flops.get(stage)
        rate = tf / (times[stage] * 1e-3) / 1e12 if tf and times[stage] else None
        cfg = "" if stage in ("inv", "union") else " ".join(f"{k}={v}" for k, v in T[stage].items())
        if stage in ("inv", "dkdv", "reduce") and not T["dense"]:
            cfg = (cfg + f" segment={st.DKV_SEGMENT}").strip()
        if stage == "dkdv" and T["dense"]:
            cfg += " dense"
        rows.append([stage, fmt(times[stage]), fmt(rate, 0), base.resources(stage), grids[stage], cfg])
    fsum = (times["union"] or 0.0) + times["fwd"]  # each of selected_forward / selected_backward builds its union
    bsum = (times["union"] or 0.0) + sum(times[s] or 0.0 for s in ("dq", "inv", "dkdv", "reduce"))
    rows.append(["fwd total", fmt(tot_f), "", "", "", f"selected_forward (sum of stages {fsum:.3f})"])
    rows.append(["bwd total", fmt(tot_b), "", "", "", f"selected_backward (sum of stages {bsum:.3f})"])
    rows.append(["fwd+bwd", fmt(tot_f + tot_b), "", "", "", ""])
    print(f"useful (query, head, key) pairs per query row: {flops['pairs_per_row']:.0f} "
          f"(n*l' = {n * block_size}); rerun bit-identical: {max(again) == 0}")  # fmt: skip
    print(tabulate(rows, headers=["stage", "ms", "TF/s", "regs/spill/smemKB", "grid", "default config"], tablefmt="github"))

    configs = sweep_configs(shape, args.sweep, S)
    if args.only:
        configs = [c for c in configs if any(word in c[0] for word in args.only.split(","))]
    if not configs:
        return
    rows, best = [], {}
    for label, override in configs:
        stages = stages_of(override)
        try:
            run = Run(inputs, override)
            torch.cuda.synchronize()
            d, ok = diffs(run.outputs(), ref)
            ts = {stage: run.time_stage(stage, args.reps) for stage in stages}
        except Exception as err:  # noqa: BLE001  e.g. triton OutOfResources (shared memory), a compile error
            rows.append([label] + ["err"] * len(STAGES) + ["", "", f"{type(err).__name__}: {str(err)[:60]}"])
            continue
        new = sum(v or 0.0 for v in ts.values())
        old = sum(times[s] or 0.0 for s in stages)
        speed = old / new if new else None
        res = run.resources(stages[0]) if len(stages) == 1 else run.resources("dkdv")
        if args.time_all:
            ts = {stage: run.time_stage(stage, args.reps) for stage in STAGES}
        rows.append([label] + [fmt(ts[s]) if s in ts else "·" for s in STAGES]
                    + [fmt(speed, 2), res, " ".join(f"{x:.0e}" for x in d) + ("" if ok else "  MISMATCH")])  # fmt: skip
        group = "segment" if "segment" in override else stages[0]
        if ok and speed and speed > 1.02 and speed > best.get(group, (1.0, None))[0]:
            best[group] = (speed, override)
    print(tabulate(rows, headers=["config", *STAGES, "x default", "regs/spill/smemKB", "max|Δ| o dq dk dv"],
                   tablefmt="github"))  # fmt: skip
    if best:
        combined = {}
        for _, override in best.values():
            for key, val in override.items():
                combined[key] = combined.get(key, {}) | val if isinstance(val, dict) else val
        run = Run(inputs, combined)
        torch.cuda.synchronize()
        d, ok = diffs(run.outputs(), ref)
        ts = {stage: run.time_stage(stage, args.reps) for stage in STAGES}
        cf, cb = run.time_totals(args.reps)
        print(f"best of each stage combined: {combined}")
        print(tabulate([["default", *(fmt(times[s]) for s in STAGES), fmt(tot_f), fmt(tot_b), fmt(tot_f + tot_b), ""],
                        ["combined", *(fmt(ts[s]) for s in STAGES), fmt(cf), fmt(cb), fmt(cf + cb),
                         " ".join(f"{x:.0e}" for x in d) + ("" if ok else "  MISMATCH")]],
                       headers=["", *STAGES, "fwd total", "bwd total", "fwd+bwd", "max|Δ| o dq dk dv"],
                       tablefmt="github"))  # fmt: skip
    else:
        print("no override beats the default by more than 2%")
    print(f"({time.time() - t0:.0f} s for this shape and S)")


def _prewarm(job):
    """Compile one shape's configurations in a worker process (small S, the same specializations as
    the big runs, so the main process then finds them in Triton's on-disk cache)."""
    shape, overrides = job
    inputs = make_inputs(shape, 512)
    failed = 0
    for override in overrides:
        try:
            Run(inputs, override)
        except Exception:  # noqa: BLE001  the main process reports it
            failed += 1
    torch.cuda.synchronize()
    return failed


def prewarm(plan, args) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = []
    for shape, lens in plan:
        # each S's sweep (the default tiles depend on S), without repeats
        overrides = [{}] + list({repr(o): o for S in lens for label, o in sweep_configs(shape, args.sweep, S)
                                 if "segment" not in o
                                 and (not args.only or any(w in label for w in args.only.split(",")))}.values())  # fmt: skip
        for i in range(args.jobs):
            part = overrides[i :: args.jobs]
            if part:
                jobs.append((shape, part))
    t0 = time.time()
    try:
        with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_prewarm, jobs))
        print(f"compiled in {args.jobs} processes: {time.time() - t0:.0f} s")
    except Exception as err:  # noqa: BLE001  then the main process compiles what is missing
        print(f"prewarm failed ({type(err).__name__}: {err}); compiling in the main process")


class ShapeAction(argparse.Action):
    def __call__(self, parser, ns, value, option_string=None):
        ns.plan.append([value, []])


class SeqAction(argparse.Action):
    def __call__(self, parser, ns, value, option_string=None):
        if not ns.plan:
            ns.plan.append(["paper", []])
        ns.plan[-1][1].append(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.set_defaults(plan=[])
    ap.add_argument("--shape", choices=list(SHAPES), action=ShapeAction, help="repeatable; starts a group of --seq-len")
    ap.add_argument("--seq-len", type=int, action=SeqAction, help="repeatable; for the --shape before it (default 8192)")
    ap.add_argument("--batch", type=int, default=1, help="rows of every shape (the seed model trains 2048 x 32)")
    ap.add_argument("--choices", choices=["random", "model"], default="random",
                    help="block ids: random valid choices, or the seed preset's own layer's at init (seed shape only)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per measurement (median), after 2 warm-up runs")
    ap.add_argument("--sweep", choices=["none", "quick", "full"], default="quick",
                    help="quick: one parameter at a time (default); full: also products of each kernel's parameters")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated substrings: sweep only configs whose label has one (e.g. dkdv,segment)")
    ap.add_argument("--time-all", action="store_true", help="time every stage for every sweep config, not only those it changes")
    ap.add_argument("--jobs", type=int, default=8, help="processes that compile the sweep's kernels first (0: none)")
    ap.add_argument("--list-configs", action="store_true", help="print the default tiles and the sweep, then exit (no GPU)")
    args = ap.parse_args()
    plan = [(shape, lens or [8192]) for shape, lens in (args.plan or [["paper", []]])]
    if args.list_configs:
        for shape, lens in plan:
            for S in lens:
                T = default_tiles(shape, S)
                print(f"{shape} S {S}: default {T} segment={st.DKV_SEGMENT}")
                for label, override in sweep_configs(shape, args.sweep, S):
                    print(f"  {label:40s} {override}  -> stages {stages_of(override)}")
        return
    if not torch.cuda.is_available():
        sys.exit("profile_selection: needs a CUDA GPU (--list-configs does not)")
    print(f"{datetime.date.today()}  {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {st.triton.__version__}")
    print(f"$ python3 {' '.join(sys.argv)}")
    if args.jobs > 0 and args.sweep != "none":
        prewarm(plan, args)
    for shape, lens in plan:
        for S in lens:
            profile(shape, S, args)


if __name__ == "__main__":
    main()
