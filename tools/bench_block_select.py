"""NSA block selection alone, side by side in one process on one CUDA card: forward time (CUDA
events, median after a warm-up), peak extra memory and exactness, per variant:

  triton     nsa.select_blocks, backend triton (nsa_compile/ops/block_select_triton.py)
  triton-autocast  the same kernel with the importance rounded as under CUDA bf16 autocast
             (importance_dtype=bf16, group_sum_dtype=float32: what the seed model's rewrite
             calls in training), checked against reference with the same arguments
  triton-lucidrains  the same kernel with rule 'lucidrains' (lucidrains' choice: the compressed
             logits averaged over each block's columns, softmaxed; no lse), checked against the
             reference backend with the same rule: FAIL where over 0.1% of the rows differ (the
             rule's p can differ by an fp32 unit and move a rounding in rare rows: the op's docstring)
  reference  nsa.select_blocks, backend reference (chunked PyTorch)
  eager      the eager chain of models/nsa.py `select_blocks` from a given p_cmp [B, H, S, Tc]
             (p_cmp itself not timed; OOM where p_cmp and p_slc do not fit)
  dense      causal SDPA forward over the same q and S tokens of k / v, GQA-native: the yardstick
  cmp+select nsa.compressed_attention fwd+bwd (its lse feeding the op) + select_blocks fwd, both
             triton: the issue's budget (<= 40 ms at the paper shape, 64k); only if that op exists

Inputs in the model's layout ([B, S, heads, D] memory viewed [B, heads, S, D]), bf16, random
gaussian tokens; the pooled keys are the mean of l token keys at stride d (eager's `mean`
compression); lse is eager's (the log-sum-exp of the masked scores, computed in chunks).

Exactness, once per shape, before the times: the chosen blocks of triton against reference over
all S, and against eager on the first --parity-len tokens. Every row where they differ is judged
against the importance recomputed exactly (float64, from the scores rounded to bf16 once):
'near tie' when the swapped blocks are within 1e-6 (relative), 'rounding' within 5e-2 (a score
of q @ k^T rounded to bf16 the other way: the fp32 sums of cuBLAS, PyTorch and the kernel run in
different orders), anything else fails the variant (FAIL instead of its times).

    python3 tools/bench_block_select.py --shape paper --seq-len 8192 --seq-len 65536
    python3 tools/bench_block_select.py --shape seed --variants triton,dense --tiles '{"BLOCK_M": 32}'
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

import nsa_compile.ops  # noqa: F401  (registers the nsa:: ops)
from nsa_compile.bench import cuda_time_ms
from nsa_compile.ops import block_select as bs
from nsa_compile.ops import block_select_triton as bst

SHAPES = {"paper": (64, 4, 128), "seed": (12, 2, 64), "seed-per-head": (12, 12, 64)}  # H, G, D (per head: h 1)
L, D_STRIDE, LS, N = 32, 16, 64, 16  # l, d, l', n
NEAR_TIE, ROUNDING = 1e-6, 5e-2


def model_layout(B, S, heads, D, gen, dtype):
    return torch.randn(B, S, heads, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)


def pooled(k_tokens: torch.Tensor) -> torch.Tensor:
    """[B, G, S, D] token keys -> [B, G, Tc, D]: the mean of each block of l tokens at stride d."""
    return k_tokens.unfold(2, L, D_STRIDE).mean(-1)


def visible(t0: int, t1: int, Tc: int) -> torch.Tensor:
    t = torch.arange(t0, t1, device="cuda")[:, None]
    return torch.arange(Tc, device="cuda")[None, :] * D_STRIDE + L - 1 <= t  # [c, Tc]


def chunked_lse(q, k, scale, chunk=1024) -> torch.Tensor:
    """lse [B, H, S] float32 of the compressed branch (eager's masked scores), chunked over rows."""
    B, H, S, _ = q.shape
    G, Tc = k.shape[1], k.shape[2]
    out = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    kT = k.repeat_interleave(H // G, dim=1).transpose(-1, -2)
    for t0 in range(0, S, chunk):
        t1 = min(S, t0 + chunk)
        s = (q[:, :, t0:t1] @ kT).float() * scale
        out[:, :, t0:t1] = torch.logsumexp(s.masked_fill(~visible(t0, t1, Tc), float("-inf")), dim=-1)
    return out


def eager_p_cmp(q, k, scale) -> torch.Tensor:
    """p_cmp [B, H, S, Tc] float32 as models/nsa.py `compressed_attention` computes it."""
    S, Tc = q.shape[2], k.shape[2]
    scores = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2)).float() * scale
    vis = visible(0, S, Tc)
    scores = scores.masked_fill(~vis, float("-inf"))
    return torch.softmax(scores.masked_fill(~vis.any(-1, keepdim=True), 0.0), dim=-1) * vis


def eager_select(p_cmp, S, G) -> torch.Tensor:
    """models/nsa.py `select_blocks`, line for line."""
    B, H, _, Tc = p_cmp.shape
    Ns = (S + LS - 1) // LS
    i = torch.arange(Tc, device="cuda")[:, None]
    j = torch.arange(Ns, device="cuda")[None, :]
    overlap = torch.minimum(i * D_STRIDE + L, (j + 1) * LS) - torch.maximum(i * D_STRIDE, j * LS)
    overlap = overlap.clamp(min=0).to(p_cmp.dtype) / L
    p_grp = (p_cmp @ overlap).view(B, G, H // G, S, Ns).sum(2)
    t = torch.arange(S, device="cuda")[:, None]
    current = t // LS
    forced = (j == 0) | (j == current) | (j == current - 1)
    key = torch.where(forced, float("inf"), torch.where(j * LS <= t, p_grp, float("-inf")))
    key = F.pad(key, (0, max(0, N - Ns)), value=float("-inf"))
    values, order = torch.sort(key, dim=-1, descending=True, stable=True)
    chosen = torch.where(values[..., :N] > float("-inf"), order[..., :N], key.shape[-1])
    chosen = torch.sort(chosen, dim=-1).values
    return torch.where(chosen == key.shape[-1], -1, chosen)


def exact_p_grp(q, k, scale, b, g, t) -> torch.Tensor:
    """The importance [Ns] of row (b, g, t) in float64, from the scores rounded to q's dtype once."""
    H, S = q.shape[1], q.shape[2]
    h, Tc = H // k.shape[1], k.shape[2]
    s = (q[b, g * h : (g + 1) * h, t].double() @ k[b, g].double().T).to(q.dtype).double() * scale  # [h, Tc]
    vis = visible(t, t + 1, Tc)[0]
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1) * vis if vis.any() else torch.zeros_like(s)
    i = torch.arange(Tc, device="cuda")[:, None]
    j = torch.arange((S + LS - 1) // LS, device="cuda")[None, :]
    overlap = (torch.minimum(i * D_STRIDE + L, (j + 1) * LS) - torch.maximum(i * D_STRIDE, j * LS)).clamp(min=0)
    return (p @ (overlap.double() / L)).sum(0)


def judge(got, want, q, k, scale) -> dict:
    """Rows where got and want differ, classified by the exact importance of the swapped blocks."""
    counts = {"rows": got.shape[0] * got.shape[1] * got.shape[2], "near tie": 0, "rounding": 0, "other": 0}
    worst = 0.0
    for b, g, t in (got != want).any(-1).nonzero().tolist():
        ours, theirs = set(got[b, g, t].tolist()) - {-1}, set(want[b, g, t].tolist()) - {-1}
        a, e = sorted(ours - theirs), sorted(theirs - ours)
        if len(a) != len(e) or not a:
            counts["other"] += 1
            continue
        p = exact_p_grp(q, k, scale, b, g, t)
        lo, hi = p[a].min().item(), p[e].max().item()  # the exact order ranks e first when hi > lo
        gap = abs(hi - lo) / max(abs(hi), abs(lo), 1e-300)
        worst = max(worst, gap)
        counts["near tie" if gap <= NEAR_TIE else "rounding" if gap <= ROUNDING else "other"] += 1
    counts["worst gap"] = f"{worst:.1e}"
    return counts


def peak_and_time(fn, reps) -> tuple[float, float]:
    """fwd ms (median) and the peak memory of one call above what was allocated before (GiB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return cuda_time_ms(fn, reps, warmup=2), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="paper")
    ap.add_argument("--seq-len", type=int, action="append", help="repeatable (default 8192 16384 32768 65536)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="triton,reference,eager,dense,cmp+select")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--parity-len", type=int, default=8192, help="tokens of the check against eager")
    ap.add_argument("--tiles", type=json.loads, default=None, help="JSON override of the triton tiles")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_block_select: needs a CUDA GPU")
    valid = ("triton", "triton-autocast", "triton-lucidrains", "reference", "eager", "dense", "cmp+select")
    chosen = [name for name in args.variants.split(",") if name]
    for name in chosen:
        if name not in valid:
            sys.exit(f"bench_block_select: unknown variant {name!r}; valid: {', '.join(valid)}")
    H, G, D = SHAPES[args.shape]
    B, dtype, scale = args.batch, torch.bfloat16, D**-0.5
    print(f"{datetime.date.today()}  {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {getattr(bst.triton, '__version__', 'not installed')}")  # fmt: skip
    print(f"$ python3 {' '.join(sys.argv)}")
    print(f"shape {args.shape}: B {B}, H {H}, G {G}, D {D}, l {L}, d {D_STRIDE}, l' {LS}, n {N}, bf16, "
          f"triton tiles {bst._tiles(H // G, D, D_STRIDE, LS, N, False, args.tiles)}")  # fmt: skip
    rows, checks = [], []
    for S in args.seq_len or [8192, 16384, 32768, 65536]:
        gen = torch.Generator(device="cuda").manual_seed(S)
        q = model_layout(B, S, H, D, gen, dtype)
        k_tok, v_tok = model_layout(B, S, G, D, gen, dtype), model_layout(B, S, G, D, gen, dtype)
        k = pooled(k_tok)  # [B, G, Tc, D]
        lse = chunked_lse(q, k, scale)
        why = bst.unsupported_reason(q, k, lse, L, D_STRIDE, LS, N)
        if why and "triton" in chosen:
            sys.exit(f"bench_block_select: the triton backend cannot run: {why}")

        triton_fn = functools.partial(bst.select_blocks_forward, q, k, lse, L, D_STRIDE, LS, N, scale,
                                      tiles=args.tiles)  # fmt: skip
        reference_fn = functools.partial(bs.select_blocks, q, k, lse, L, D_STRIDE, LS, N, scale, "reference")
        ok = {}
        autocast = {"importance_dtype": torch.bfloat16, "group_sum_dtype": torch.float32}
        autocast_fn = functools.partial(bst.select_blocks_forward, q, k, lse, L, D_STRIDE, LS, N, scale,
                                        tiles=args.tiles, **autocast)  # fmt: skip
        if "triton-autocast" in chosen:
            c = judge(autocast_fn(), bs.select_blocks(q, k, lse, L, D_STRIDE, LS, N, scale, "reference", **autocast),
                      q, k, scale)
            checks.append([S, "triton-autocast vs reference", *c.values()])
            ok["triton-autocast"] = c["other"] == 0
        lucid_fn = functools.partial(bs.select_blocks, q, k, None, L, D_STRIDE, LS, N, scale, "triton",
                                     rule="lucidrains")  # fmt: skip
        if "triton-lucidrains" in chosen:
            got = lucid_fn()
            want = bs.select_blocks(q, k, None, L, D_STRIDE, LS, N, scale, "reference", rule="lucidrains")
            differ = int((got != want).any(-1).sum())
            n_rows = got.shape[0] * got.shape[1] * got.shape[2]
            checks.append([S, "triton-lucidrains vs reference", n_rows, "-", "-", differ, "-"])
            ok["triton-lucidrains"] = differ <= n_rows // 1000
            del got, want
        dense_fn = functools.partial(F.scaled_dot_product_attention, q, k_tok, v_tok, is_causal=True, enable_gqa=True)
        if "triton" in chosen:
            got = triton_fn()
            if "reference" in chosen:
                c = judge(got, reference_fn(), q, k, scale)
                checks.append([S, "triton vs reference", *c.values()])
                ok["triton"] = ok["reference"] = c["other"] == 0
            P = min(S, args.parity_len)
            qp = q[:, :, :P]
            kp = k[:, :, : max(0, (P - L) // D_STRIDE + 1)]
            want = eager_select(eager_p_cmp(qp, kp, scale), P, G)
            c = judge(got[:, :, :P], want, qp, kp, scale)
            checks.append([P, "triton vs eager", *c.values()])
            ok["triton"] = ok.get("triton", True) and c["other"] == 0
            ok["eager"] = c["other"] == 0
            del want, got
        variants = {"triton": triton_fn, "triton-autocast": autocast_fn, "triton-lucidrains": lucid_fn,
                    "reference": reference_fn, "dense": dense_fn}
        for name in chosen:
            if name == "eager":
                try:
                    p_cmp = eager_p_cmp(q, k, scale)
                    fwd, peak = peak_and_time(functools.partial(eager_select, p_cmp, S, G), args.reps)
                    rows.append([S, name, f"{fwd:.2f}" if ok.get(name, True) else "FAIL", f"{peak:.2f}"])
                except torch.OutOfMemoryError:
                    rows.append([S, name, "OOM", "-"])
                p_cmp = None
                continue
            if name == "cmp+select":
                rows.append([S, name, *cmp_and_select(q, k_tok, v_tok, scale, args)])
                continue
            try:
                fwd, peak = peak_and_time(variants[name], args.reps)
                rows.append([S, name, f"{fwd:.2f}" if ok.get(name, True) else "FAIL", f"{peak:.2f}"])
            except torch.OutOfMemoryError:
                rows.append([S, name, "OOM", "-"])
    print(tabulate(checks, headers=["S", "exactness", "rows", "near tie", "rounding", "other", "worst gap"],
                   tablefmt="github"))  # fmt: skip
    print()
    print(tabulate(rows, headers=["S", "variant", "fwd ms", "peak extra GiB"], tablefmt="github"))


def cmp_and_select(q, k_tok, v_tok, scale, args) -> list[str]:
    """[ms, GiB] of compressed attention fwd+bwd plus block selection fwd (both triton)."""
    if not hasattr(torch.ops.nsa, "compressed_attention"):
        return ["unavailable (no nsa.compressed_attention)", "-"]
    k, v = pooled(k_tok), pooled(v_tok)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    grad = torch.randn_like(q)

    def step():
        o, lse = torch.ops.nsa.compressed_attention(*leaves, L, D_STRIDE, scale, "triton")
        idx = bst.select_blocks_forward(q, k, lse, L, D_STRIDE, LS, N, scale, tiles=args.tiles)
        torch.autograd.grad(o, leaves, grad)
        return idx

    try:
        ms, peak = peak_and_time(step, args.reps)
        return [f"{ms:.2f}", f"{peak:.2f}"]
    except torch.OutOfMemoryError:
        return ["OOM", "-"]


if __name__ == "__main__":
    main()
