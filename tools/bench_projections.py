"""The projection + RoPE stage of one NSA layer alone, side by side in one process: fwd and fwd+bwd
times and parity against a float32 reference, per variant:

  eager       the eager lines of NSAAttention.forward: 7 Linears (q, and k, v per branch; 3 with
              --shared-kv) and apply_rope on q and each k (models/nsa.py)
  compile     torch.compile of those lines (Inductor's own code: one cuBLAS GEMM per Linear,
              the RoPE as pointwise kernels)
  optimized   nsa_compile.optimize of those lines with projection_rope alone (Inductor): the
              weights concatenated in the graph, one nsa.projection_rope op
  op          nsa.projection_rope[triton] called directly on concatenated weights (no graph)
  cublas      F.linear on the concatenated weights alone: the one GEMM the op replaces the
              projections with, without RoPE (the yardstick: the op should be within 1.2x)
  cublas+rope torch.compile of the concatenated GEMM followed by the eager RoPE of each piece
              (what Inductor makes of an already merged GEMM)

    python3 tools/bench_projections.py                      # seed shapes, S 2048 and 8192, batch 1 and 8
    python3 tools/bench_projections.py --sweep --batch 8 --seq-len 8192   # tile configs of the op's GEMM
A variant that fails parity prints FAIL and no time; one that runs out of memory prints OOM.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import nsa_compile
from nsa_compile.bench import cuda_graph_time_ms, cuda_time_ms
from nsa_compile.models.nsa import apply_rope, rope_tables
from nsa_compile.ops import rope_triton
from nsa_compile.ops.rope import projection_rope

SHAPES = {"seed": (768, 12, 2, 64), "paper": (2048, 64, 4, 128)}  # dim, H, G, D


class Projections(nn.Module):
    """NSAAttention's projection and RoPE lines; returns q, the k's, the v's ([B, S, heads, D])."""

    def __init__(self, dim, H, G, D, shared_kv=False, style="half"):
        super().__init__()
        self.H, self.G, self.D, self.style = H, G, D, style
        self.wq = nn.Linear(dim, H * D, bias=False)
        names = ("shared",) if shared_kv else ("cmp", "sel", "win")
        self.wk = nn.ModuleDict({n: nn.Linear(dim, G * D, bias=False) for n in names})
        self.wv = nn.ModuleDict({n: nn.Linear(dim, G * D, bias=False) for n in names})

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, self.H, self.D), cos, sin, self.style)
        ks = [apply_rope(w(x).view(B, S, self.G, self.D), cos, sin, self.style) for w in self.wk.values()]
        vs = [w(x).view(B, S, self.G, self.D) for w in self.wv.values()]
        return (q, *ks, *vs)

    def layout(self):
        """The concatenated weight's pieces in the op's order (q, then k and v per branch)."""
        weights = [self.wq.weight]
        for name in self.wk:
            weights += [self.wk[name].weight, self.wv[name].weight]
        heads = [self.D] + [self.D, 0] * len(self.wk)
        return weights, [w.shape[0] for w in weights], heads


def reorder(outs, n_kv):
    """The op's pieces (q, k1, v1, k2, v2, ...) in the module's output order (q, k's, v's)."""
    return [outs[0], *outs[1::2][:n_kv], *outs[2::2][:n_kv]]


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def variants(module, cos, sin):
    weights, widths, heads = module.layout()
    n_kv = len(module.wk)

    def op(x):
        w = torch.cat(weights)
        outs = projection_rope(x, w, None, cos, sin, widths, heads, module.style, "triton")
        return reorder([o.view(*x.shape[:2], -1, module.D) for o in outs], n_kv)

    def cublas(x):
        return (F.linear(x, torch.cat(weights)),)

    def merged(x):
        B, S, _ = x.shape
        y = F.linear(x, torch.cat(weights))
        pieces, start = [], 0
        for width, dim in zip(widths, heads):
            p = y[..., start : start + width].view(B, S, -1, module.D)
            pieces.append(apply_rope(p, cos, sin, module.style) if dim else p)
            start += width
        return reorder(pieces, n_kv)

    only = nsa_compile.OptimizeConfig(
        disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != "projection_rope"))
    torch._dynamo.reset()  # a new shape compiles static again (no automatic dynamic shapes)
    compiled = torch.compile(module)
    return {
        "eager": lambda x: module(x, cos, sin),
        "compile": lambda x: compiled(x, cos, sin),
        "optimized": _optimized(module, only, cos, sin),
        "op": op,
        "cublas": cublas,
        "cublas+rope": torch.compile(merged),
    }


def _optimized(module, config, cos, sin):
    """nsa_compile.optimize compiles in place: optimize a shallow copy sharing the parameters."""
    optimized = nsa_compile.optimize(copy.copy(module), config)

    def run(x):
        return optimized(x, cos, sin)

    run.model = optimized
    return run


def bench(args) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dim, H, G, D = SHAPES[args.shape]
    torch.manual_seed(0)
    module = Projections(dim, H, G, D, args.shared_kv, args.rope).cuda().to(dtype)
    ref_module = Projections(dim, H, G, D, args.shared_kv, args.rope).cuda()
    ref_module.load_state_dict(module.state_dict())
    chosen = [v for v in args.variants.split(",") if v]
    rows, notes = [], []
    for S, B in itertools.product(args.seq_len or [2048, 8192], args.batch or [1, 8]):
        cos, sin = rope_tables(S, D, 10000.0, "cuda")
        fns = variants(module, cos, sin)
        g = torch.Generator(device="cuda").manual_seed(S + B)
        x = torch.randn(B, S, dim, device="cuda", generator=g).to(dtype)
        refs = ref_module(x.float(), cos, sin)
        params = list(module.parameters())
        for name in chosen:
            fn = fns[name]
            leaf = x.clone().requires_grad_()
            try:
                outs = fn(leaf)
                if name == "cublas":
                    ok, err = True, "-"
                else:
                    errs = [rel_err(o, r) for o, r in zip(outs, refs)]
                    ok, err = max(errs) <= 1e-2, f"{max(errs):.1e}"
                # an explicit generator: the default one is in a graph-capture state after a failed capture
                grads = [torch.randn(o.shape, device=o.device, generator=g).to(o.dtype) for o in outs]
                # free the parity run's autograd graph: its parameters' gradient accumulators, made
                # on the default stream, would otherwise break the CUDA-graph capture below
                del outs
                inputs = [leaf, *params]
                fwd_call = lambda fn=fn, leaf=leaf: fn(leaf)
                both_call = lambda fn=fn, leaf=leaf, inputs=inputs, grads=grads: torch.autograd.grad(
                    fn(leaf), inputs, grads)
                times = [cuda_time_ms(fwd_call, reps=args.reps, warmup=2),
                         cuda_time_ms(both_call, reps=args.reps, warmup=2)]
                for call in (fwd_call, both_call):
                    try:  # GPU time alone: CUDA-graph replay (nsa_compile.bench.cuda_graph_time_ms)
                        times.append(cuda_graph_time_ms(call, reps=args.reps))
                    except Exception as why:  # noqa: BLE001 - the table says n/a, the note says why
                        times.append(None)
                        notes.append(f"S {S}, B {B}, {name}: no CUDA graph ({type(why).__name__}: {str(why)[:300]})")
                        print(notes[-1], flush=True)
                rows.append([S, B, name, *(fmt(t) if ok else "FAIL" for t in times[2:] + times[:2]), err])
            except torch.OutOfMemoryError:
                rows.append([S, B, name, "OOM", "OOM", "OOM", "OOM", "-"])
            except Exception as why:  # noqa: BLE001 - one variant's failure is a row, not the end of the table
                rows.append([S, B, name, "error", "error", "error", "error", "-"])
                notes.append(f"S {S}, B {B}, {name}: {type(why).__name__}: {str(why)[:300]}")
            torch.cuda.empty_cache()
        if "optimized" in chosen:  # what the optimized variant ran with (a refused rewrite runs eager code)
            (r,) = [r for r in nsa_compile.report(fns["optimized"].model) if r["name"] == "projection_rope"]
            notes.append(f"S {S}, B {B}: optimized: {r['matches']} rewrite(s) {r['kernels']} {r['reasons']}")
        base = {r[2]: r[3:7] for r in rows if r[0] == S and r[1] == B}
        number = lambda t: t.replace(".", "", 1).isdigit()
        for name in ("op", "optimized"):  # the target: within 1.2x of the concatenated GEMM alone
            if name in base and "cublas" in base:
                ratios = [f"{float(a) / float(b):.2f}x" if number(a) and number(b) else "-"
                          for a, b in zip(base[name], base["cublas"])]
                rows.append([S, B, f"{name} / cublas", *ratios, ""])
    print(tabulate(rows, headers=["S", "B", "variant", "fwd GPU ms", "fwd+bwd GPU ms", "fwd ms per call",
                                  "fwd+bwd ms per call", "max rel err"], tablefmt="github"))
    print("GPU ms: CUDA-graph replay (host launch and dispatch time taken out); ms per call: each call "
          "bracketed by events and synchronized (host time included).")
    print("\n".join(notes))


def fmt(t) -> str:
    return "n/a" if t is None else f"{t:.3f}"


def sweep(args) -> None:
    """Forward time of the op's GEMM kernel for tile configs (parity checked against the default)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dim, H, G, D = SHAPES[args.shape]
    module = Projections(dim, H, G, D, args.shared_kv, args.rope)
    _, widths, heads = module.layout()
    S, B = (args.seq_len or [8192])[0], (args.batch or [8])[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B * S, dim, device="cuda", generator=g).to(dtype)
    w = (torch.randn(sum(widths), dim, device="cuda", generator=g) / dim**0.5).to(dtype)
    cos, sin = rope_tables(S, D, 10000.0, "cuda")
    run = lambda o: rope_triton.projection_rope_forward(x, w, None, cos, sin, widths, heads, args.rope, S, override=o)
    ref = run(None)
    cublas = cuda_time_ms(lambda: F.linear(x, w), reps=args.reps, warmup=2)
    rows = []
    for BM, HT, BK, warps, stages in itertools.product((64, 128, 256), (2, 4), (32, 64, 128), (4, 8), (3, 4)):
        o = {"fwd": {"BM": BM, "HT": HT, "BK": BK, "num_warps": warps, "num_stages": stages}}
        try:
            outs = run(o)
            err = max(rel_err(a, b) for a, b in zip(outs, ref))
            ms = cuda_time_ms(lambda: run(o), reps=args.reps, warmup=2)
            rows.append([BM, HT * D, BK, warps, stages, f"{ms:.3f}", f"{ms / cublas:.2f}x", f"{err:.0e}"])
        except Exception as why:  # out of shared memory or registers for this config
            rows.append([BM, HT * D, BK, warps, stages, "n/a", "", type(why).__name__])
    rows.sort(key=lambda r: float(r[5]) if r[5] != "n/a" else 1e9)
    print(f"cuBLAS F.linear alone: {cublas:.3f} ms (M {B * S}, N {sum(widths)}, K {dim})")
    print(tabulate(rows, headers=["BM", "tile cols", "BK", "warps", "stages", "fwd ms", "/ cublas", "vs default"],
                   tablefmt="github"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="seed")
    ap.add_argument("--seq-len", type=int, action="append")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--rope", choices=["half", "interleaved"], default="half")
    ap.add_argument("--shared-kv", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="eager,compile,optimized,op,cublas,cublas+rope")
    ap.add_argument("--sweep", action="store_true", help="time tile configs of the op's GEMM instead")
    args = ap.parse_args()
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}, shape {args.shape} {SHAPES[args.shape]} (dim, H, G, D), {args.dtype}, "
          f"rope {args.rope}{', shared kv' if args.shared_kv else ''}")
    print("command: python3 " + " ".join(sys.argv))
    (sweep if args.sweep else bench)(args)


if __name__ == "__main__":
    main()
