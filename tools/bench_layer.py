"""The NSA attention layer alone (issue 7, point 3): all three branches, the block selection and
the gated combine, without the projections, forward and backward, against dense causal attention,
side by side in one process.

The layer (NSALayer below) takes what the projections and RoPE produce: queries q [B, S, H, Dk],
keys and values per branch [B, S, G, D] (and, for the paper's per-head gate, x [B, S, dim]) and runs
models/nsa.py's own NSAAttention methods: compressed_attention, select_blocks, selected_attention,
window_attention, gates, then the gated sum, giving o [B, S, H, Dv]. Variants:

  nsa      the layer through nsa_compile.optimize (the rewrites it ran with are printed)
  compile  the layer through torch.compile (Inductor, no NSA passes)
  eager    the layer as written (memory-hungry on purpose: it runs out of memory at long S)
  sdpa     causal SDPA on q and the selected branch's K/V, GQA-native, SDPA's default backend
  cudnn    the same, restricted to cuDNN attention
  fa2      the same, restricted to FlashAttention-2
cudnn and fa2 use enable_gqa=True where that backend accepts it; where it does not, K/V are
repeated to all H heads inside the timed function, and the output says which.

Timing: the first call (which compiles) on its own, then the median of --reps runs (CUDA events on
CUDA) of the forward and of the forward + backward (gradients of every input and of the layer's
parameters); peak memory of one forward + backward above what was allocated before it. Inputs
are random, bf16 on CUDA (the layer's parameters too), float32 on the CPU.

Parity, in the same run, before the timings: nsa_compile.parity.check_parity of the optimized
layer against the eager layer in float64 (output, the gradients of q and every K/V, and of the
layer's parameters), at the shortest --seq-len, halving while the float64 oracle runs out of
memory (the length used is printed; below n * l' tokens every candidate block is selected, so the
top-n choice is not exercised, and the output says so), with the aggregate bar and the
block-choice agreement. The layer is one block: its float64 oracle is not checkpointed. Ratios
and targets are printed only when parity passed. --profile (CUDA) adds, per length, where one
forward + backward of the nsa variant spends its GPU time: the device time under each NSA op,
then the top kernels.

    python3 tools/bench_layer.py --shape paper --seq-len 8192 --seq-len 16384 --seq-len 32768 --seq-len 65536
    python3 tools/bench_layer.py --shape seed --seq-len 2048 --variants nsa,sdpa
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_e2e beside this file
from bench_e2e import append_record, compile_cache, environment, sdpa_context

import nsa_compile
from nsa_compile.bench import (
    cuda_time_ms, device_named, free_memory, is_oom, nsa_op_times, print_kernel_profile, print_nsa_op_times,
)
from nsa_compile.explain import pass_table, rewrite_summary
from nsa_compile.models import NSAAttention, preset
from nsa_compile.parity import check_parity, fit_parity, parity_sentence

VARIANTS = ("nsa", "compile", "eager", "sdpa", "cudnn", "fa2")
DENSE_BACKENDS = {"sdpa": None, "cudnn": "cudnn", "fa2": "flash"}
DEFAULT_SEQ_LENS = (8192, 16384, 32768, 65536)
# Issue 7's targets at the paper shape: fwd+bwd at 64k at most 100 ms; faster than cuDNN from 16k.
TARGET_MS_AT_64K = 100.0
FASTER_THAN_CUDNN_FROM = 16384
BRANCHES = ("cmp", "sel", "win")


class NSALayer(nn.Module):
    """NSA attention between the projections and the output projection.

    forward(q [B, S, H, Dk], k_cmp, v_cmp, k_sel, v_sel, k_win, v_win [B, S, G, Dk or Dv],
    x [B, S, dim] or None) -> o [B, S, H, Dv]: NSAAttention.forward from its branch calls to the
    gated sum, through the model's own methods (x feeds the paper's per-head gate; the seed's
    group gate reads q). The projection weights are dropped: this layer starts after them.
    """

    def __init__(self, cfg):
        super().__init__()
        self.attn = NSAAttention(cfg)
        for name in ("wq", "wk", "wv", "wo"):
            delattr(self.attn, name)

    def forward(self, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, x=None):
        a = self.attn
        o_cmp, p_cmp = a.compressed_attention(q, k_cmp, v_cmp)
        block_idx = a.select_blocks(p_cmp, q.shape[1])
        o_sel = a.selected_attention(q, k_sel, v_sel, block_idx)
        o_win = a.window_attention(q, k_win, v_win)
        g = a.gates(x, q)  # [B, S, H, 3]
        return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # [B, S, H, Dv]


def layer_inputs(cfg, batch: int, seq_len: int, device, dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random inputs by name: q, k_<branch>, v_<branch>, and x where the gate reads it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"q": (cfg.n_heads, cfg.head_dim)}
    for b in BRANCHES:
        shapes[f"k_{b}"], shapes[f"v_{b}"] = (cfg.n_kv_groups, cfg.head_dim), (cfg.n_kv_groups, cfg.dim_v)
    inputs = {name: torch.randn(batch, seq_len, *shape, device=device, dtype=dtype, generator=gen)
              for name, shape in shapes.items()}
    if cfg.gate == "head":
        inputs["x"] = torch.randn(batch, seq_len, cfg.dim, device=device, dtype=dtype, generator=gen)
    return inputs


class LayerWithInputs(nn.Module):
    """The layer with its inputs held as parameters, so that check_parity (which compares the
    gradients of parameters) compares dq, dk, dv (and dx) too. forward(gain) scales the output by a
    scalar input: check_parity feeds a model positional inputs."""

    def __init__(self, layer: NSALayer, inputs: dict[str, torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.inputs = nn.ParameterDict({name: nn.Parameter(t.detach().clone()) for name, t in inputs.items()})

    def forward(self, gain):
        return self.layer(**dict(self.inputs.items())) * gain


def optimizer_for(config: nsa_compile.OptimizeConfig):
    def optimize_fn(module):
        torch._dynamo.reset()
        return nsa_compile.optimize(module, config)

    return optimize_fn


def check_layer_parity(cfg, args, device, dtype, config) -> dict:
    """check_parity at the shortest run length, halving while it runs out of memory."""
    def run(length):
        torch.manual_seed(0)
        probe = LayerWithInputs(NSALayer(cfg), layer_inputs(cfg, args.batch, length, "cpu", torch.float32, 1))
        gain = torch.ones((), device=device)
        result = check_parity(probe.to(device), optimizer_for(config), (gain,), dtype, is_lm=False)
        del probe
        free_memory()
        return result

    fit = fit_parity(run, min(args.seq_len), args.parity_min_len)
    if fit.report is None:
        return fit.record()
    result = fit.report
    return {**fit.record(), "selection_exercised": fit.length > cfg.n_selected * cfg.sel_block,
            "choice_exercised": any(c.rows for c in result.choices), "summary": result.summary(),
            "rows": [r.as_dict() for r in result.rows], "failures": [r.as_dict() for r in result.failures()]}


def parity_text(p: dict, dtype: torch.dtype) -> str:
    where = f"output, input and parameter gradients vs float64; {str(dtype).removeprefix('torch.')}, " \
            f"seq-len {p['parity_len']}"
    return parity_sentence(p, "the layer", where)


# --- the variants ---------------------------------------------------------------------------------


def layer_variant(variant: str, cfg, dtype, device, config):
    """The layer of one nsa/compile/eager variant, on device in dtype."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = NSALayer(cfg).to(device=device, dtype=dtype)
    if variant == "nsa":
        return nsa_compile.optimize(layer, config)
    if variant == "compile":
        layer.compile()
    return layer


def dense_call(variant: str, inputs: dict, h: int):
    """(fn(q, k, v) -> o [B, H, S, Dv], a note) for causal SDPA on the selected branch's K/V in the
    model's layout. GQA-native where the backend accepts enable_gqa; else K/V repeated h times.
    Raises what SDPA raises when the backend cannot run the shape even with repeated K/V."""
    backend = DENSE_BACKENDS[variant]
    t = lambda x: x.transpose(1, 2)  # [B, S, heads, D] -> [B, heads, S, D]

    def native(q, k, v):
        with sdpa_context(backend):
            return F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True)

    def repeated(q, k, v):
        with sdpa_context(backend):
            return F.scaled_dot_product_attention(t(q), t(k).repeat_interleave(h, 1), t(v).repeat_interleave(h, 1),
                                                  is_causal=True)

    q, k, v = (inputs[n].detach().requires_grad_() for n in ("q", "k_sel", "v_sel"))
    try:
        out = native(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return native, "GQA-native (enable_gqa=True)"
    except RuntimeError as err:
        if is_oom(err) or backend is None:
            raise
        why = str(err).strip().splitlines()[0][:100]
        return repeated, f"K/V repeated to {h * k.shape[2]} heads (enable_gqa refused: {why})"


def time_ms(fn, reps: int, device: torch.device) -> float:
    if device.type == "cuda":
        return cuda_time_ms(fn, reps, warmup=1)
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(call, leaves: list, device, reps: int) -> dict:
    """First call (compile) seconds, fwd and fwd+bwd ms, peak GiB above the baseline of one fwd+bwd."""
    sync(device)
    start = time.perf_counter()
    out = call()
    grad = torch.randn_like(out)
    torch.autograd.grad(out, leaves, grad)
    sync(device)
    first = time.perf_counter() - start
    del out
    peak = None
    if device.type == "cuda":
        free_memory_keep_graphs()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.autograd.grad(call(), leaves, grad)
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    fwd = time_ms(call, reps, device)
    both = time_ms(lambda: torch.autograd.grad(call(), leaves, grad), reps, device)
    return {"first_call_s": first, "fwd_ms": fwd, "fwd_bwd_ms": both, "peak_gib": peak}


def profile_layer(call, leaves: list, title: str) -> None:
    """--profile: the device time under each NSA op in one forward + backward, then its top kernels."""
    from torch.profiler import ProfilerActivity, profile

    out = call()
    grad = torch.randn_like(out)
    del out
    run = lambda: torch.autograd.grad(call(), leaves, grad)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(f"\n{title}:", end="")
    print_nsa_op_times(nsa_op_times(prof.events(), True), 1, True, per="forward + backward")
    print_kernel_profile(run, f"{title}, forward + backward")


def free_memory_keep_graphs() -> None:
    """Release cached blocks without resetting Dynamo (the compiled layer must stay compiled)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def run_variant(variant: str, cfg, inputs: dict, args, device, dtype, config) -> dict:
    record = {"variant": variant}
    try:
        if variant in DENSE_BACKENDS:
            if DENSE_BACKENDS[variant] is not None and device.type != "cuda":
                return {**record, "status": "n/a", "detail": f"{variant} needs CUDA"}
            fn, note = dense_call(variant, inputs, cfg.group_size)
            record["note"] = note
            leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k_sel", "v_sel")]
            return {**record, "status": "ok", **measure(lambda: fn(*leaves), leaves, device, args.reps)}
        with compile_cache(True) if variant != "eager" else contextlib.nullcontext():
            layer = layer_variant(variant, cfg, dtype, device, config)
            leaves = [t.detach().requires_grad_() for t in inputs.values()]
            named = dict(zip(inputs, leaves))
            leaves += [p for p in layer.parameters()]
            result = measure(lambda: layer(**named), leaves, device, args.reps)
            if variant == "nsa":
                record["rewrites"] = rewrite_summary(pass_table(layer))
                if args.profile and device.type == "cuda":
                    profile_layer(lambda: layer(**named), leaves, f"nsa layer, S {inputs['q'].shape[1]}")
            return {**record, "status": "ok", **result}
    except Exception as err:
        if is_oom(err):
            return {**record, "status": "OOM"}
        traceback.print_exc()
        return {**record, "status": "error", "detail": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"}
    finally:
        free_memory()


def rows_for(records: list[dict], parity_ok: bool | None) -> list[list]:
    rows = []
    for r in records:
        if r["status"] != "ok":
            rows.append([r["seq_len"], r["variant"], r["status"], "-", "-", "-", "-", r.get("detail", "")])
            continue
        cudnn = next((c for c in records if c["seq_len"] == r["seq_len"] and c["variant"] == "cudnn"
                      and c["status"] == "ok"), None)
        if cudnn is None or r["variant"] == "cudnn":
            ratio = "-"
        elif parity_ok is None:
            ratio = "n/a (no parity)"
        else:
            ratio = f"{r['fwd_bwd_ms'] / cudnn['fwd_bwd_ms']:.2f}x" if parity_ok else "n/a (parity failed)"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        rows.append([r["seq_len"], r["variant"], f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}",
                     f"{r['first_call_s']:.1f}", peak, ratio, r.get("note", "")])
    return rows


def target_lines(records: list[dict], shape: str, parity_ok: bool | None) -> list[str]:
    """The issue's targets (stated for the paper shape) where this run measured them."""
    if shape != "paper":
        return []
    if not parity_ok:
        return ["targets: not judged (parity did not pass)"]
    lines = []
    get = lambda S, v: next((r for r in records if r["seq_len"] == S and r["variant"] == v), None)
    nsa64 = get(65536, "nsa")
    if nsa64 is not None:
        got = f"{nsa64['fwd_bwd_ms']:.1f} ms" if nsa64["status"] == "ok" else nsa64["status"]
        met = nsa64["status"] == "ok" and nsa64["fwd_bwd_ms"] <= TARGET_MS_AT_64K
        lines.append(f"target: NSA layer fwd+bwd at 64k <= {TARGET_MS_AT_64K:.0f} ms: {got}, "
                     f"{'met' if met else 'missed'}")
    for S in sorted({r["seq_len"] for r in records if r["seq_len"] >= FASTER_THAN_CUDNN_FROM}):
        nsa, cudnn = get(S, "nsa"), get(S, "cudnn")
        if nsa is None or cudnn is None or cudnn["status"] != "ok":
            continue
        if nsa["status"] != "ok":
            lines.append(f"target: faster than cuDNN at {S}: nsa {nsa['status']}, missed")
            continue
        met = nsa["fwd_bwd_ms"] < cudnn["fwd_bwd_ms"]
        lines.append(f"target: faster than cuDNN at {S}: {nsa['fwd_bwd_ms']:.1f} against {cudnn['fwd_bwd_ms']:.1f} "
                     f"ms, {'met' if met else 'missed'}")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="paper", help="a model preset whose attention shape to use: paper, seed, tiny")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seq-len", type=int, action="append",
                    help=f"repeatable (default {', '.join(map(str, DEFAULT_SEQ_LENS))})")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="nsa,cudnn,fa2", help="subset of " + ",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compiler", default="inductor", help="optimize's compiler (nsa_compile.config.COMPILERS)")
    ap.add_argument("--parity-min-len", type=int, default=64, help="halve the parity length on OOM no further than this (the first length always runs)")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--profile", action="store_true", help="CUDA: per length, the nsa variant's GPU time by NSA op and kernel")
    ap.add_argument("--out", default=None, help="append JSON-line records here")
    args = ap.parse_args(argv)
    args.seq_len = args.seq_len or list(DEFAULT_SEQ_LENS)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"unknown variant(s) {', '.join(bad) or '(none given)'}; valid: {', '.join(VARIANTS)}")
    if min(args.batch, args.reps, *args.seq_len) < 1:
        ap.error("--batch, --reps and --seq-len must be positive")
    try:
        preset(args.shape)
        nsa_compile.OptimizeConfig(compiler=args.compiler)
    except ValueError as err:
        ap.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        device = device_named(args.device)
    except ValueError as err:
        sys.exit(f"bench_layer: {err}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = preset(args.shape)
    config = nsa_compile.OptimizeConfig(compiler=args.compiler)
    env = environment(device, "python3 tools/bench_layer.py " + shlex.join(argv))
    print(f"{env['date']}  {env['card']}  torch {env['torch']}  triton {env['triton']}")
    print(f"$ {env['command']}")
    print(f"shape {args.shape}: B {args.batch}, H {cfg.n_heads}, G {cfg.n_kv_groups}, Dk {cfg.head_dim}, "
          f"Dv {cfg.dim_v}, l {cfg.cmp_block}, d {cfg.cmp_stride}, l' {cfg.sel_block}, n {cfg.n_selected}, "
          f"w {cfg.window}, compression {cfg.compression}, gate {cfg.gate}, {str(dtype).removeprefix('torch.')}")
    if args.no_parity or "nsa" not in args.variants:
        parity = {"ok": None, "detail": "--no-parity" if args.no_parity else "no nsa variant"}
    else:
        parity = check_layer_parity(cfg, args, device, dtype, config)
    print(parity_text(parity, dtype))
    for line in parity.get("summary", []):  # the aggregate bar and the block choice
        print(line)
    if parity["ok"] is False and "rows" in parity:
        print(tabulate([[r["name"], f"{r['err_optimized']:.2e}", f"{r['err_eager']:.2e}", f"{r['bar']:.2e}"]
                        for r in (parity["failures"] or parity["rows"])[:5]],
                       headers=["tensor (worst first)", "optimized err", "eager err", "bar"], tablefmt="github",
                       disable_numparse=True))
    base = {"record": "layer", **env, "shape": args.shape, "batch": args.batch, "dtype": str(dtype),
            "compiler": args.compiler, "parity_ok": parity["ok"], "parity_len": parity.get("parity_len")}
    records = []
    for S in args.seq_len:
        inputs = layer_inputs(cfg, args.batch, S, device, dtype, seed=S)
        for variant in args.variants:
            print(f"  S {S}, {variant} ...", file=sys.stderr, flush=True)
            record = {**base, "seq_len": S, **run_variant(variant, cfg, inputs, args, device, dtype, config)}
            append_record(args.out, record)
            records.append(record)
        del inputs
        free_memory()
    print(tabulate(rows_for(records, parity["ok"]),
                   headers=["S", "variant", "fwd ms", "fwd+bwd ms", "first call s", "peak extra GiB",
                            "fwd+bwd vs cudnn", "note"], tablefmt="github", disable_numparse=True))
    for r in records:
        if r.get("rewrites"):  # what the timed layer ran with: a refused branch runs as eager code
            print(f"S {r['seq_len']}: {r['rewrites']}")
    for line in target_lines(records, args.shape, parity["ok"]):
        print(line)
    failed = parity["ok"] is False or any(r["status"] == "error" for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
