"""The compressed-attention branch alone, side by side in one process on one CUDA card: fwd and
fwd+bwd times (CUDA events, median after a warm-up), peak extra memory, and parity, per variant:

  triton     nsa.compressed_attention, backend triton (nsa_compile/ops/compressed_triton.py), with
             the default tiles, plus one row per --tiles override (triton[<json>])
  reference  nsa.compressed_attention, backend reference (chunked PyTorch)
  eager      the eager model's attention step (NSAAttention.compressed_attention after pooling):
             K/V repeated to every head, the [B, H, S, Tc] scores at once (OOM at long S)
  dense      causal SDPA over all S tokens (K/V [B, G, S, D]), GQA-native (enable_gqa=True),
             default backend: the yardstick of full attention

Inputs in the model's layout: q [B, S, H, D] memory viewed [B, H, S, D]; the compression tokens
[B, Tc, G, D] memory viewed [B, G, Tc, D], Tc = (S - l) // d + 1; bf16. Parity, per S and per
triton variant: o, dq, dk, dv against the reference op in float32 at the same inputs, on the
first min(S, --parity-len) queries (every compression token stays; the later ones are simply not
visible to them), the worst relative RMS error of the four (bar 1e-2), and whether two triton
backward runs agree bit for bit. A variant that fails parity prints FAIL instead of its times.

    python3 tools/bench_compressed.py --shape paper --seq-len 8192 --seq-len 65536
    python3 tools/bench_compressed.py --shape seed --variants triton,reference,eager
    python3 tools/bench_compressed.py --seq-len 65536 --variants triton \\
        --tiles '{"fwd": {"ROWS": 64}}' --tiles '{"dkdv": {"BLOCK_N": 32, "SEGMENT": 8192}}'
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

from nsa_compile.bench import cuda_time_ms
from nsa_compile.ops import compressed_attention
from nsa_compile.ops import compressed_triton as ct

SHAPES = {"paper": (64, 4, 128, 32, 16), "seed": (12, 2, 64, 32, 16)}  # H, G, D, l, d
PARITY_BAR = 1e-2


def triton_variant(tiles: dict | None):
    """The op's triton forward and backward with `tiles` (None: the defaults), through autograd."""
    if tiles is None:
        return lambda q, k, v, l, d, scale: compressed_attention(q, k, v, l, d, scale, backend="triton")

    class WithTiles(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, l, d, scale):
            o, lse = ct.compressed_forward(q, k, v, l, d, scale, tiles=tiles)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.args = (l, d, scale)
            return o

        @staticmethod
        def backward(ctx, grad_o):
            q, k, v, o, lse = ctx.saved_tensors
            grads = ct.compressed_backward(grad_o, q, k, v, o, lse, *ctx.args, tiles=tiles)
            return (*grads, None, None, None)

    return WithTiles.apply


def reference_compressed(q, k, v, l, d, scale):
    return compressed_attention(q, k, v, l, d, scale, backend="reference")


def eager_compressed(q, k, v, l, d, scale):
    """The eager model's step (models/nsa.py NSAAttention.compressed_attention) on pooled K/V."""
    h, S, Tc = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    t = torch.arange(S, device=q.device)[:, None]
    visible = torch.arange(Tc, device=q.device)[None, :] * d + l - 1 <= t
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores.masked_fill(~visible.any(-1, keepdim=True), 0.0), dim=-1) * visible
    return p.to(v.dtype) @ v


def model_layout(B, S, heads, D, gen, dtype):
    return torch.randn(B, S, heads, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def fwd_bwd(fn, leaves, args, grad):
    out = fn(*leaves, *args)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


def measure(fn, inputs, args, grad, reps) -> tuple[float, float, float]:
    """fwd ms, fwd+bwd ms, and the peak memory of one fwd+bwd above what was allocated before (GiB)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, leaves, args, grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    with torch.no_grad():
        fwd = cuda_time_ms(lambda: fn(*leaves, *args), reps, warmup=2)
    both = cuda_time_ms(lambda: fwd_bwd(fn, leaves, args, grad), reps, warmup=2)
    return fwd, both, peak


def parity(fn, q, k, v, grad, args) -> tuple[float, bool]:
    """Worst relative RMS error of fn's o/dq/dk/dv against the fp32 reference op; whether a
    second backward gives the same bits."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    ours = fwd_bwd(fn, leaves, args, grad)
    again = fwd_bwd(fn, leaves, args, grad)
    leaves32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = fwd_bwd(reference_compressed, leaves32, args, grad.float())
    worst = max(rel_err(a, r) for a, r in zip(ours, ref))
    return worst, all(torch.equal(a, b) for a, b in zip(ours, again))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="paper")
    ap.add_argument("--seq-len", type=int, action="append", help="repeatable (default 8192 16384 32768 65536)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="triton,reference,eager,dense")
    ap.add_argument("--tiles", action="append", default=[],
                    help="repeatable: a JSON override of compressed_triton._tiles, e.g. "
                         "'{\"fwd\": {\"ROWS\": 64, \"num_warps\": 4}}' (one more triton row each)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--parity-len", type=int, default=4096, help="queries of the parity check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_compressed: needs a CUDA GPU")
    variants = {"reference": reference_compressed, "eager": eager_compressed}
    chosen = [name for name in args.variants.split(",") if name]
    for name in chosen:
        if name not in ("triton", "reference", "eager", "dense"):
            sys.exit(f"bench_compressed: unknown variant {name!r}; valid: triton, reference, eager, dense")
    tritons = {}
    if "triton" in chosen:
        tritons["triton"] = triton_variant(None)
    for text in args.tiles:
        try:
            override = json.loads(text)
            ct._tiles(128, 128, False, override)  # unknown kernel names raise here
        except (json.JSONDecodeError, ValueError) as err:
            sys.exit(f"bench_compressed: bad --tiles {text!r}: {err}")
        tritons[f"triton{json.dumps(override, separators=(',', ':'))}"] = triton_variant(override)
    H, G, D, l, d = SHAPES[args.shape]
    B, dtype, scale = args.batch, torch.bfloat16, D**-0.5
    triton_version = getattr(ct.triton, "__version__", "not installed")
    card = torch.cuda.get_device_name()
    print(f"{datetime.date.today()}  {card}  torch {torch.__version__}  triton {triton_version}")
    print(f"$ python3 {' '.join(sys.argv)}")
    print(f"shape {args.shape}: B {B}, H {H}, G {G}, D {D}, l {l}, d {d}, bf16; default tiles {ct._tiles(D, D)}")
    rows = []
    for S in args.seq_len or [8192, 16384, 32768, 65536]:
        Tc = (S - l) // d + 1
        gen = torch.Generator(device="cuda").manual_seed(S)
        q = model_layout(B, S, H, D, gen, dtype)
        k, v = model_layout(B, Tc, G, D, gen, dtype), model_layout(B, Tc, G, D, gen, dtype)
        grad = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen)
        op_args = (l, d, scale)
        why = ct.unsupported_reason(q, k, v, l, d)
        if tritons and why:
            sys.exit(f"bench_compressed: the triton kernels cannot run: {why}")
        P = min(S, args.parity_len)
        for name, fn in tritons.items():
            err, same = parity(fn, q[:, :, :P], k, v, grad[:, :, :P], op_args)
            ok = err <= PARITY_BAR
            par = f"{err:.1e} {'ok' if ok else 'FAIL'}{'' if same else ' (not bitwise repeatable)'}"
            try:
                fwd, both, peak = measure(fn, (q, k, v), op_args, grad, args.reps)
                times = [f"{fwd:.2f}", f"{both:.2f}"] if ok else ["FAIL", "FAIL"]
                rows.append([S, name, *times, f"{peak:.2f}", par])
            except torch.OutOfMemoryError:
                rows.append([S, name, "OOM", "OOM", "-", par])
        for name in chosen:
            if name == "triton":
                continue
            if name == "dense":  # full causal attention over the S tokens the compression pooled
                fn, inputs, fn_args = (lambda q, k, v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=True)), None, ()  # fmt: skip
                try:
                    inputs = (q, model_layout(B, S, G, D, gen, dtype), model_layout(B, S, G, D, gen, dtype))
                except torch.OutOfMemoryError:
                    rows.append([S, name, "OOM", "OOM", "-", "-"])
                    continue
            else:
                fn, inputs, fn_args = variants[name], (q, k, v), op_args
            try:
                fwd, both, peak = measure(fn, inputs, fn_args, grad, args.reps)
                rows.append([S, name, f"{fwd:.2f}", f"{both:.2f}", f"{peak:.2f}", "-"])
            except torch.OutOfMemoryError:
                rows.append([S, name, "OOM", "OOM", "-", "-"])
            inputs = None
    print(tabulate(rows, headers=["S", "variant", "fwd ms", "fwd+bwd ms", "peak extra GiB", "parity vs fp32 reference"],
                   tablefmt="github"))  # fmt: skip


if __name__ == "__main__":
    main()
