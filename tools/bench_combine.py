"""The gate + combine stage alone (NSA section 5: the gate MLP, its softmax / sigmoid and the
weighted sum of the three branch outputs), side by side in one process on one CUDA card: fwd and
fwd+bwd times (CUDA events, median after a warm-up), the bytes of the memory floor, achieved GB/s
and the time over the floor's time, and parity, per variant:

  eager      the model's lines (models/nsa.py NSAAttention.gates and the combine line) in PyTorch
  compile    torch.compile (default mode, Inductor) of the same lines
  op         nsa.gated_combine, backend triton (what the gated_combine pass puts in their place)
  op-logits  head gate only: nsa.gated_combine on logits computed before (the form the pass takes
             when projection_rope merged the gate's Linear into the projections' GEMM); its
             floor reads the logits instead of x

Inputs: the gate input (q [B, S, H, Dk] for the group gate, x [B, S, dim] for the head gate), the
gate weights, and the three branch outputs [B, S, H, Dv] contiguous (the attention ops' output
layout), in --dtype. The memory floor, from the tensor sizes: forward reads the gate input and the
three branch outputs and writes o; the backward reads grad_o, the branch outputs and the gate input
and writes the three branch gradients and the gate input's gradient (weights are negligible). The
floor's time is those bytes over the card's copy bandwidth, measured here (a 2 GiB
device-to-device copy: read + write); "x floor" is the time over that (target <= 1.3 at >= 256 MB
of branch outputs). Parity: each variant's o and every gradient against the same lines in float32
(TF32 off) on the same inputs, relative RMS error (the worst of them), bar max(1e-2 in fp16/bf16
or 1e-4 in fp32, 2x the eager lines' own error); a variant that fails prints FAIL, not its times.

Shapes: seed (H 12, G 2, Dk = Dv = 64, dim 768; group gate) with the batch that brings the three
branch outputs to >= --min-mb MB (default 256) at each --seq-len; paper (H 64, G 4, Dk = Dv = 128,
dim 2048; head gate), batch 1 unless --batch. --gate picks the other variant for a shape.

    python3 tools/bench_combine.py --shape seed --seq-len 2048 --seq-len 8192
    python3 tools/bench_combine.py --shape paper --seq-len 8192 --seq-len 65536
    python3 tools/bench_combine.py --shape seed --seq-len 8192 --tiles '{"fwd": {"ROWS": 64, "num_warps": 8}}'
    python3 tools/bench_combine.py --shape seed --seq-len 8192 --profile     # per-kernel CUDA times
    python3 tools/bench_combine.py --shape paper --seq-len 8192 --variants op --tile-sweep
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

from nsa_compile.bench import cuda_graph_time_ms, cuda_time_ms, print_kernel_profile
from nsa_compile.ops import gated_combine_triton as gt

SHAPES = {"seed": {"H": 12, "G": 2, "Dk": 64, "Dv": 64, "dim": 768, "gate": "group"},
          "paper": {"H": 64, "G": 4, "Dk": 128, "Dv": 128, "dim": 2048, "gate": "head"}}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def group_lines(G):
    """The seed's group gate and the combine line (models/nsa.py), as a function of its tensors."""
    def combine(q, w1, b1, w2, b2, o_cmp, o_sel, o_win):
        B, S, H, Dk = q.shape
        q_bar = q.view(B, S, G, H // G, Dk).mean(3)  # [B, S, G, Dk]
        g = torch.softmax(F.linear(F.silu(F.linear(q_bar, w1, b1)), w2, b2), dim=-1)
        g = g.repeat_interleave(H // G, dim=2)  # [B, S, H, 3]
        return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    return combine


def head_lines(x, w, b, o_cmp, o_sel, o_win):
    """The paper's head gate and the combine line."""
    B, S, H, _ = o_cmp.shape
    g = torch.sigmoid(F.linear(x, w, b)).view(B, S, H, 3)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win


def logits_lines(z, o_cmp, o_sel, o_win):
    """The head gate after its Linear (logits z [B, S, 3H] computed elsewhere)."""
    B, S, H, _ = o_cmp.shape
    g = torch.sigmoid(z).view(B, S, H, 3)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win


def op_fn(gate, G, tiles):
    """The op on the same tensors: through torch.ops (autograd) by default; with --tiles, the
    kernels' entry points with those launch parameters (a custom autograd.Function around them)."""
    def gate_in_of(t):
        if gate == "group":
            B, S, H, Dk = t.shape
            return t.view(B, S, G, H // G, Dk)
        return t[:, :, None, None, :]

    def call(first, *rest):
        if gate == "group":
            w1, b1, w2, b2, *branches = rest
            act = "silu"
        elif gate == "head":
            w1 = b1 = None
            w2, b2, *branches = rest
            act = "none"
        else:  # logits
            w1 = b1 = w2 = b2 = None
            branches = rest
            act = "none"
        norm = "softmax" if gate == "group" else "sigmoid"
        args = (gate_in_of(first), w1, b1, w2, b2, *branches, act, norm)
        if tiles is None:
            return torch.ops.nsa.gated_combine(*args, "triton")[0]
        return _Tiled.apply(tiles, *args)
    return call


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tiles, *args):
        o, gates = gt.combine_forward(*args, tiles=tiles)
        ctx.save_for_backward(*(a for a in args[:8] if a is not None), gates)
        ctx.args, ctx.tiles = args, tiles
        return o

    @staticmethod
    def backward(ctx, grad_o):
        args = ctx.args
        grads = gt.combine_backward(grad_o.contiguous(), *args[:8], ctx.saved_tensors[-1], *args[8:], tiles=ctx.tiles)
        return (None, *(g if a is not None else None for g, a in zip(grads, args[:8])), None, None)


def make_inputs(shape, gate, B, S, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *size, scale=1.0: (torch.randn(*size, device="cuda", generator=g) * scale).to(dtype)
    H, Dk, Dv, dim = shape["H"], shape["Dk"], shape["Dv"], shape["dim"]
    branches = [r(B, S, H, Dv) for _ in range(3)]
    if gate == "group":
        weights = [r(Dk // 2, Dk, scale=Dk**-0.5), r(Dk // 2, scale=0.1), r(3, Dk // 2, scale=(Dk // 2) ** -0.5),
                   r(3, scale=0.1)]
        first = r(B, S, H, Dk)
    elif gate == "head":
        weights = [r(3 * H, dim, scale=dim**-0.5), r(3 * H, scale=0.1)]
        first = r(B, S, dim)
    else:
        weights = []
        first = r(B, S, 3 * H)
    return [first, *weights, *branches], r(B, S, H, Dv)


def floor_bytes(inputs, gate) -> tuple[int, int]:
    """(forward, backward) bytes of the memory floor: gate input + 3 branch outputs read, o written;
    grad_o + 3 branch outputs + gate input read, 3 branch gradients + the gate input's written."""
    first, branches = inputs[0], inputs[-3:]
    unit = branches[0].numel() * branches[0].element_size()
    gin = first.numel() * first.element_size()
    return gin + 4 * unit, 7 * unit + 2 * gin


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (read + write bytes): the floor's yardstick on this card."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), reps=20, warmup=3)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_grads(fn, inputs, grad):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def profile(fn, inputs, grad, name):
    """Per-kernel CUDA time of one fwd+bwd (after a warm-up): what each variant launches."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    print_kernel_profile(lambda: torch.autograd.grad(fn(*leaves), leaves, grad), name)


def stage_times(fwd_call, both_call, reps) -> dict:
    """fwd and fwd+bwd ms: GPU time (CUDA-graph replay; None when the capture fails) and per call
    (events around each synchronized call)."""
    times = {"fwd": cuda_time_ms(fwd_call, reps=reps, warmup=2), "both": cuda_time_ms(both_call, reps=reps, warmup=2)}
    for key, call in (("gpu_fwd", fwd_call), ("gpu_both", both_call)):
        try:
            times[key] = cuda_graph_time_ms(call, reps=reps)
        except Exception as why:  # noqa: BLE001 - reported in the table, the event times still stand
            print(f"CUDA graph capture failed ({key}): {type(why).__name__}: {str(why)[:200]}")
            times[key] = None
    return times


def cells(times, fwd_bytes, bwd_bytes, bw) -> list[str]:
    """Table cells: GPU fwd, its x floor, GPU fwd+bwd, its x floor, then the per-call times."""
    floor_fwd, floor_both = fwd_bytes / bw / 1e6, (fwd_bytes + bwd_bytes) / bw / 1e6  # ms
    gf, gb = times["gpu_fwd"], times["gpu_both"]
    return [f"{gf:.3f}" if gf else "n/a", f"{gf / floor_fwd:.2f}" if gf else "n/a",
            f"{gb:.3f}" if gb else "n/a", f"{gb / floor_both:.2f}" if gb else "n/a",
            f"{times['fwd']:.3f}", f"{times['both']:.3f}"]


def tile_sweep(kind, G, inputs, grad, ref, bar, fwd_bytes, bwd_bytes, bw, reps, title):
    """The op's times per launch configuration (the same ROWS and num_warps for every kernel)."""
    rows = []
    configs = [("fwd, bwd", {"ROWS": r, "num_warps": w}) for r in (16, 32, 64) for w in (4, 8)]
    configs += [("mlp", {"ROWS": r, "num_warps": w, "PER_SM": p}) for r in (16, 32) for w in (4, 8) for p in (2, 4, 8)]
    for kernels, cfg in configs:
        fn = op_fn(kind, G, {k.strip(): cfg for k in kernels.split(",")})
        err = max(rel_err(a, r) for a, r in zip(run_grads(fn, inputs, grad), ref))
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        times = stage_times(lambda fn=fn, leaves=leaves: fn(*leaves),
                            lambda fn=fn, leaves=leaves: torch.autograd.grad(fn(*leaves), leaves, grad), reps)
        rows.append([kernels, cfg["ROWS"], cfg["num_warps"], cfg.get("PER_SM", "-"),
                     *(cells(times, fwd_bytes, bwd_bytes, bw) if err <= bar else ["FAIL"] * 6), f"{err:.1e}"])
    print(f"\ntile sweep, {title} (the kernels named take ROWS and warps, the others keep _tiles' defaults)")
    print(tabulate(rows, headers=["kernels", "ROWS", "warps", "programs per SM", "fwd GPU ms", "fwd x floor", "fwd+bwd GPU ms",
                                  "fwd+bwd x floor", "fwd ms per call", "fwd+bwd ms per call", "max rel err"],
                   tablefmt="github"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="seed")
    ap.add_argument("--gate", choices=["group", "head"], help="default: the shape's own (seed group, paper head)")
    ap.add_argument("--seq-len", type=int, action="append")
    ap.add_argument("--batch", type=int, help="default: seed enough for --min-mb of branch outputs, paper 1")
    ap.add_argument("--min-mb", type=float, default=256.0)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--variants", default="eager,compile,op,op-logits")
    ap.add_argument("--tiles", type=json.loads, help="launch parameters for the op's kernels (see _tiles)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print each variant's kernels (one fwd+bwd)")
    ap.add_argument("--tile-sweep", action="store_true",
                    help="time the op with ROWS 16/32/64 x 4/8 warps (every kernel alike) and print the table")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shape = SHAPES[args.shape]
    gate = args.gate or shape["gate"]
    dtype = DTYPES[args.dtype]
    G = shape["G"]
    bw = copy_bandwidth()
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"shape {args.shape} (H {shape['H']}, G {G}, Dk {shape['Dk']}, Dv {shape['Dv']}, dim {shape['dim']}), "
          f"{gate} gate, {args.dtype}, copy bandwidth {bw:.0f} GB/s (read + write)")
    print("command: python3 " + " ".join(sys.argv))
    lines = {"group": group_lines(G), "head": head_lines, "logits": logits_lines}
    floor_err = 1e-4 if dtype == torch.float32 else 1e-2
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    for S in args.seq_len or [2048, 8192]:
        per_token = 3 * shape["H"] * shape["Dv"] * torch.tensor([], dtype=dtype).element_size()
        B = args.batch or (math.ceil(args.min_mb * 2**20 / (S * per_token)) if args.shape == "seed" else 1)
        for kind in (gate, "logits") if gate == "head" else (gate,):
            chosen = [v for v in variants if (v == "op-logits") == (kind == "logits")]
            if not chosen:
                continue
            inputs, grad = make_inputs(shape, kind, B, S, dtype, seed=S)
            eager_fn = lines[kind]
            fwd_bytes, bwd_bytes = floor_bytes(inputs, kind)
            mb = 3 * inputs[-1].numel() * inputs[-1].element_size() / 2**20
            try:  # the float32 lines on the same inputs, and the eager lines' own error against them
                ref = run_grads(eager_fn, [x.float() for x in inputs], grad.float())
                err_eager = max(rel_err(a, r) for a, r in zip(run_grads(eager_fn, inputs, grad), ref))
            except torch.OutOfMemoryError:
                rows.append([S, B, f"{mb:.0f}", kind, *["OOM"] * 6, "-", "-", "-"])
                continue
            for name in chosen:
                fn = {"eager": eager_fn, "compile": torch.compile(eager_fn), "op": op_fn(kind, G, args.tiles),
                      "op-logits": op_fn(kind, G, args.tiles)}[name]
                try:
                    err = max(rel_err(a, r) for a, r in zip(run_grads(fn, inputs, grad), ref))
                    ok = name == "eager" or err <= max(floor_err, 2 * err_eager)
                    leaves = [x.detach().clone().requires_grad_() for x in inputs]
                    fwd_call = lambda fn=fn, leaves=leaves: fn(*leaves)
                    both_call = lambda fn=fn, leaves=leaves, grad=grad: torch.autograd.grad(fn(*leaves), leaves, grad)
                    times = stage_times(fwd_call, both_call, args.reps)
                    rows.append([S, B, f"{mb:.0f}", name, *(cells(times, fwd_bytes, bwd_bytes, bw) if ok else
                                                            ["FAIL"] * 6),
                                 f"{fwd_bytes / 2**20:.0f}", f"{(fwd_bytes + bwd_bytes) / 2**20:.0f}", f"{err:.1e}"])
                    if args.profile:
                        profile(fn, inputs, grad, f"S {S} B {B} {name}")
                except torch.OutOfMemoryError:
                    rows.append([S, B, f"{mb:.0f}", name, *["OOM"] * 6, "-", "-", "-"])
                torch.cuda.empty_cache()
            if args.tile_sweep and ("op" in chosen or "op-logits" in chosen):
                tile_sweep(kind, G, inputs, grad, ref, max(floor_err, 2 * err_eager), fwd_bytes, bwd_bytes, bw,
                           args.reps, f"S {S} B {B} {kind}")
            del ref, inputs, grad
            torch.cuda.empty_cache()
    print(tabulate(rows, headers=["S", "B", "branch MB", "variant", "fwd GPU ms", "fwd x floor", "fwd+bwd GPU ms",
                                  "fwd+bwd x floor", "fwd ms per call", "fwd+bwd ms per call", "floor fwd MB",
                                  "floor fwd+bwd MB", "max rel err"], tablefmt="github"))
    print("GPU ms: CUDA-graph replay (the host's launch and dispatch time taken out: what the stage costs in a "
          "step whose host runs ahead); x floor uses it. ms per call: each call bracketed by events and "
          "synchronized (host time included).")


if __name__ == "__main__":
    main()
