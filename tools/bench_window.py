"""The sliding-window branch alone, side by side in one process: fwd and fwd+bwd times, peak extra
memory, and parity against a float64 (small S) or float32 reference, per variant:

  eager      the eager masked-dense formula of models/nsa.py (repeat_interleave, S x S scores)
  compile    torch.compile of that formula (Inductor)
  op-triton  nsa.window_attention, backend triton (nsa_compile/ops/window_triton.py)
  op-flash   nsa.window_attention, backend flash (FA-2 through PyTorch's kernels)
  op-ref     nsa.window_attention, backend reference (chunked PyTorch; the fp32 route)
  fa2        torch.nn.attention.varlen.varlen_attn with window_size=(w - 1, 0), when importable
             (GQA through repeat: 2.11's varlen_attn has no enable_gqa; bf16/fp16 only)
  fa2-aten   torch.ops.aten._flash_attention_forward with window_size_left = w - 1 (GQA-native)
  fa2-causal the aten flash op with no window (all S keys, causal): is the window itself slow?
  flex       FlexAttention (compiled) with a sliding-window block mask built once per shape
  dense      causal SDPA over all S keys (the dense-attention yardstick), default backend

    python3 tools/bench_window.py --shape paper --seq-len 8192 --seq-len 65536
    python3 tools/bench_window.py --shape seed --batch 32 --seq-len 2048 --variants op-triton,op-flash \
        --tiles '{"bn128": {"fwd": {"BLOCK_N": 128}}}'      # + op-triton:bn128, the kernels with those tiles

Parity: the output (and, for the op variants, dq, dk and dv) against the window op's reference
backend in float32, relative RMS error; above 1e-2 the variant prints FAIL and no time. One that
runs out of memory prints OOM. Peak extra GiB: of that parity call (the forward, and for the op
variants their backward too).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from tabulate import tabulate

from nsa_compile.bench import cuda_time_ms
from nsa_compile.ops import window_attention, window_triton

SHAPES = {"paper": (64, 4, 128), "seed": (12, 2, 64)}  # H, G, D


def eager_window(q, k, v, w, scale):
    h = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
    S = q.shape[2]
    scores = (q @ k.transpose(-1, -2)).float() * scale
    t = torch.arange(S, device=q.device)[:, None]
    s = torch.arange(S, device=q.device)[None, :]
    p = torch.softmax(scores.masked_fill(~((s <= t) & (t - s < w)), float("-inf")), dim=-1)
    return p.to(v.dtype) @ v


def fa2_window(q, k, v, w, scale):
    from torch.nn.attention.varlen import varlen_attn

    B, H, S, D = q.shape
    h = H // k.shape[1]
    k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
    flat = lambda x: x.transpose(1, 2).reshape(B * S, x.shape[1], x.shape[3])  # [B*S, heads, D]
    cu = torch.arange(0, (B + 1) * S, S, device=q.device, dtype=torch.int32)
    out = varlen_attn(flat(q), flat(k), flat(v), cu, cu, S, S, scale=scale, window_size=(w - 1, 0))
    return out.view(B, S, H, -1).transpose(1, 2)


def fa2_aten_window(q, k, v, w, scale):
    """The aten flash op in batch layout [B, S, heads, D]: GQA-native (K/V not repeated)."""
    t = lambda x: x.transpose(1, 2)
    S = q.shape[2]
    out = torch.ops.aten._flash_attention_forward(
        t(q), t(k), t(v), None, None, S, S, 0.0, True, False, scale=scale, window_size_left=w - 1,
        window_size_right=0)[0]
    return t(out)


def fa2_aten_causal(q, k, v, w, scale):
    """The aten flash op over all S keys (no window), GQA-native: the window variants' yardstick."""
    t = lambda x: x.transpose(1, 2)
    S = q.shape[2]
    return t(torch.ops.aten._flash_attention_forward(t(q), t(k), t(v), None, None, S, S, 0.0, True, False,
                                                     scale=scale)[0])


_flex_masks: dict = {}


def flex_window(q, k, v, w, scale):
    """FlexAttention with a sliding-window block mask (cached per (S, w)), compiled, GQA-native."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _flex_masks:
        _flex_masks["fn"] = torch.compile(flex_attention)
    S = q.shape[2]
    if (S, w) not in _flex_masks:
        def in_window(b, h, t, s):
            return (s <= t) & (t - s < w)
        _flex_masks[S, w] = create_block_mask(in_window, None, None, S, S, device=q.device)
    return _flex_masks["fn"](q, k, v, block_mask=_flex_masks[S, w], scale=scale, enable_gqa=True)


def dense_causal(q, k, v, w, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


class TritonWithTiles(torch.autograd.Function):
    """The Triton window kernels with a tile override (--tiles), outside the op."""

    @staticmethod
    def forward(ctx, q, k, v, w, scale, tiles):
        o, lse = window_triton.window_forward(q, k, v, w, scale, tiles=tiles)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (w, scale, tiles)
        return o

    @staticmethod
    def backward(ctx, grad):
        w, scale, tiles = ctx.args
        return *window_triton.window_backward(grad, *ctx.saved_tensors, w, scale, tiles=tiles), None, None, None


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="paper")
    ap.add_argument("--seq-len", type=int, action="append")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="eager,compile,op-triton,op-flash,op-ref,fa2,fa2-aten,fa2-causal,flex,dense")
    ap.add_argument("--tiles", default="{}", help="JSON {label: window_triton._tiles override}: adds op-triton:label")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    H, G, D = SHAPES[args.shape]
    variants = {"eager": eager_window, "compile": torch.compile(eager_window),
                "op-triton": lambda *a: window_attention(*a, backend="triton"),
                "op-flash": lambda *a: window_attention(*a, backend="flash"),
                "op-ref": lambda *a: window_attention(*a, backend="reference"),
                "fa2": fa2_window, "fa2-aten": fa2_aten_window, "fa2-causal": fa2_aten_causal,
                "flex": flex_window, "dense": dense_causal}
    chosen = [v for v in args.variants.split(",") if v]
    for label, override in json.loads(args.tiles).items():
        variants[f"op-triton:{label}"] = lambda *a, o=override: TritonWithTiles.apply(*a, o)
        chosen.append(f"op-triton:{label}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape} (H {H}, G {G}, D {D}), "
          f"w {args.window}, {args.dtype}, batch {args.batch}")
    rows = []
    for S in args.seq_len or [8192]:
        g = torch.Generator(device="cuda").manual_seed(S)
        B = args.batch
        q = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(B, G, S, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(B, G, S, D, device="cuda", dtype=dtype, generator=g)
        grad = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)
        scale = D**-0.5
        # the reference: the window op in float32 (it computes the eager arithmetic in chunks)
        ref_leaves = [x.float().requires_grad_() for x in (q, k, v)]
        ref = window_attention(*ref_leaves, args.window, scale, backend="reference")
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad.float())
        ref = ref.detach()
        for name in chosen:
            fn = variants[name]
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                out = fn(*leaves, args.window, scale)
                errs = [] if name in ("dense", "fa2-causal") else [rel_err(out, ref)]
                if name.startswith("op-"):
                    grads = torch.autograd.grad(out, leaves, grad)
                    errs += [rel_err(x, r) for x, r in zip(grads, ref_grads)]
                    del grads
                del out
                ok = all(e <= 1e-2 for e in errs)
                fwd = cuda_time_ms(lambda: fn(*leaves, args.window, scale))
                both = cuda_time_ms(lambda: torch.autograd.grad(fn(*leaves, args.window, scale), leaves, grad))
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                err = " / ".join(f"{e:.1e}" for e in errs) or "-"
                rows.append([S, name, f"{fwd:.2f}" if ok else "FAIL", f"{both:.2f}" if ok else "FAIL",
                             f"{peak:.2f}", err])
            except torch.OutOfMemoryError:
                rows.append([S, name, "OOM", "OOM", "-", "-"])
            except (ImportError, RuntimeError) as why:
                rows.append([S, name, "n/a", "n/a", "-", str(why).splitlines()[0][:60]])
    print(tabulate(rows, headers=["S", "variant", "fwd ms", "fwd+bwd ms", "peak extra GiB", "rel err (o / dq / dk / dv)"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
