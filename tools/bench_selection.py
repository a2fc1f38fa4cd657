"""The selected-attention branch alone, side by side in one process on one CUDA card: fwd and
fwd+bwd times (CUDA events, median after a warm-up), peak extra memory, and parity, per variant:

  triton     nsa.selected_attention, backend triton (nsa_compile/ops/selection_triton.py: group-centric
             forward, dq, inverted-selection dk/dv)
  varlen     nsa.selected_attention, backend varlen (nsa_compile/ops/selection_varlen.py: PyTorch's
             FA-2 varlen kernels, queries grouped by the KV block they chose, merged by log-sum-exp)
  reference  nsa.selected_attention, backend reference (chunked PyTorch gather)
  dense      causal SDPA over all S keys, GQA-native (enable_gqa=True), default backend: the yardstick
  fa2        causal FA-2 over all S keys, GQA-native (nsa.window_attention, backend flash, window S+1):
             the dense FA-2 the issue compares varlen with (target: varlen <= 1/4 of it)
  cudnn      causal SDPA forced to cuDNN (K/V repeated to every head: cuDNN has no GQA here)

Inputs in the model's layout ([B, S, heads, D] memory viewed [B, heads, S, D]), bf16, random
valid block indices (block 0, the current and the previous block forced, the rest distinct random
earlier blocks, ascending, -1 padded where fewer candidates exist). Parity, for each of triton
and varlen that runs: its o, dq, dk, dv against the reference op in float32 at the same inputs,
on the first min(S, --parity-len) tokens, once per shape (relative RMS error, the worst of the
four; bar 1e-2); also whether two backward runs agree bit for bit (varlen: FA-2's backward adds
dq with atomics, so no). A variant that fails parity prints FAIL instead of its times. With
varlen and fa2 both chosen, the ratio varlen / fa2 is printed per length.

    python3 tools/bench_selection.py --shape paper --seq-len 8192 --seq-len 32768
    python3 tools/bench_selection.py --shape seed --variants triton,dense
    python3 tools/bench_selection.py --shape paper --seq-len 65536 --variants varlen,triton,fa2
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

from nsa_compile.bench import cuda_time_ms, print_kernel_profile
from nsa_compile.ops import selected_attention, window_attention
from nsa_compile.ops import selection_triton as st
from nsa_compile.ops import selection_varlen as sv

SHAPES = {"paper": (64, 4, 128, 64, 16), "seed": (12, 2, 64, 64, 16),  # H, G, D, l', n
          "seed-per-head": (12, 12, 64, 64, 16)}  # each query head its own blocks (K/V as the copies per head)
PARITY_BAR = 1e-2


def triton_selected(q, k, v, block_idx, block_size, scale):
    return selected_attention(q, k, v, block_idx, block_size, scale, backend="triton")


def varlen_selected(q, k, v, block_idx, block_size, scale):
    return selected_attention(q, k, v, block_idx, block_size, scale, backend="varlen")


def reference_selected(q, k, v, block_idx, block_size, scale):
    return selected_attention(q, k, v, block_idx, block_size, scale, backend="reference")


def dense_cudnn(q, k, v, block_idx, block_size, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                              v.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                              is_causal=True, scale=scale)


def dense_causal(q, k, v, block_idx, block_size, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def dense_fa2(q, k, v, block_idx, block_size, scale):
    # a window past S: FA-2 drops a left window >= the key length, so this is its plain causal kernel
    return window_attention(q, k, v, q.shape[2] + 1, scale, backend="flash")


VARIANTS = {"triton": triton_selected, "varlen": varlen_selected, "reference": reference_selected,
            "dense": dense_causal, "fa2": dense_fa2, "cudnn": dense_cudnn}
# the selection variants whose parity is checked against the reference
CHECKED = ("triton", "varlen")


def random_block_idx(B, G, S, n, block_size, gen, chunk=2048, device="cuda"):
    """[B, G, S, n] int64: blocks 0, t // l' and t // l' - 1 forced, the rest distinct random
    earlier blocks, ascending, -1 padded. Built in chunks of tokens (the keys are [.., chunk, NB])."""
    NB = -(-S // block_size)
    width = max(NB, n)
    j = torch.arange(width, device=device)
    out = torch.empty(B, G, S, n, dtype=torch.int64, device=device)
    for t0 in range(0, S, chunk):
        t = torch.arange(t0, min(S, t0 + chunk), device=device)
        cur = (t // block_size)[:, None]  # [c, 1]
        key = torch.rand(B, G, t.numel(), width, device=device, generator=gen)
        forced = (j == 0) | (j == cur) | (j == cur - 1)
        key = torch.where(forced, 2.0, key).masked_fill(j > cur, float("-inf"))
        val, idx = key.topk(n, dim=-1)
        idx = torch.where(val > float("-inf"), idx, width).sort(dim=-1).values  # padding last
        out[:, :, t0 : t0 + t.numel()] = torch.where(idx == width, -1, idx)
    return out


class _Captured(Exception):
    pass


def model_block_idx(B, S, shape, device="cuda"):
    """[B, G, S, n] int64: the block ids the seed preset's own eager NSA layer (models/nsa.py, at
    initialization, torch.manual_seed(S), x ~ N(0, 1)) chooses for one row of S tokens, the same
    for every batch row. Its forward stops once `select_blocks` has chosen (no selected or window
    branch). Only for shapes with the seed preset's G, n and l' (random choices may overstate or
    understate how much a tile's queries share; NOTES.md, twentieth session)."""
    from nsa_compile.models import NSAAttention, preset
    from nsa_compile.models.nsa import rope_tables

    cfg = preset("seed")
    H, G, D, block_size, n = SHAPES[shape]
    if (cfg.n_heads, cfg.n_kv_groups, cfg.sel_block, cfg.n_selected) != (H, G, block_size, n):
        sys.exit(f"--choices model: the seed preset's layer (H {cfg.n_heads}, G {cfg.n_kv_groups}, l' "
                 f"{cfg.sel_block}, n {cfg.n_selected}) does not choose for shape {shape}")
    torch.manual_seed(S)
    layer = NSAAttention(cfg).to(device)
    captured = {}

    def stop(p_cmp, S_, pos=None):
        captured["idx"] = NSAAttention.select_blocks(layer, p_cmp, S_)
        raise _Captured

    layer.select_blocks = stop
    x = torch.randn(1, S, cfg.dim, device=device)
    cos, sin = rope_tables(S, cfg.rot_dim, cfg.rope_base, x.device)
    with torch.no_grad():
        try:
            layer(x, cos, sin)
        except _Captured:
            pass
    return captured["idx"].expand(B, -1, -1, -1).contiguous()


def model_layout(B, S, heads, D, gen, dtype):
    return torch.randn(B, S, heads, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)


def time_ms(fn, reps) -> float:
    return cuda_time_ms(fn, reps, warmup=2)


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def fwd_bwd(fn, leaves, block_idx, block_size, scale, grad):
    out = fn(*leaves, block_idx, block_size, scale)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


def measure(fn, q, k, v, block_idx, block_size, scale, grad, reps) -> tuple[float, float, float]:
    """fwd ms, fwd+bwd ms, and the peak memory of one fwd+bwd above what was allocated before (GiB)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, leaves, block_idx, block_size, scale, grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    with torch.no_grad():
        fwd = time_ms(lambda: fn(*leaves, block_idx, block_size, scale), reps)
    both = time_ms(lambda: fwd_bwd(fn, leaves, block_idx, block_size, scale, grad), reps)
    return fwd, both, peak


def parity(fn, q, k, v, grad, block_idx, block_size, scale) -> tuple[float, bool]:
    """Worst relative RMS error of fn's o/dq/dk/dv against the fp32 reference op; whether a
    second run gives the same bits."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    ours = fwd_bwd(fn, leaves, block_idx, block_size, scale, grad)
    again = fwd_bwd(fn, leaves, block_idx, block_size, scale, grad)
    leaves32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = fwd_bwd(reference_selected, leaves32, block_idx, block_size, scale, grad.float())
    worst = max(rel_err(a, r) for a, r in zip(ours, ref))
    return worst, all(torch.equal(a, b) for a, b in zip(ours, again))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="paper")
    ap.add_argument("--seq-len", type=int, action="append", help="repeatable (default 8192)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="triton,reference,dense")
    ap.add_argument("--profile", action="store_true", help="print each variant's kernels in one fwd+bwd (torch.profiler)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--choices", choices=["random", "model"], default="random",
                    help="block ids: random valid choices, or the seed preset's own layer's at init (model_block_idx)")
    ap.add_argument("--parity-len", type=int, default=2048, help="tokens of the parity check (once per shape)")
    ap.add_argument("--varlen-chunk-rows", type=int, help=f"varlen's CHUNK_ROWS (default {sv.CHUNK_ROWS})")
    ap.add_argument("--varlen-segment-rows", type=int,
                    help=f"varlen's SEGMENT_ROWS (default {sv.SEGMENT_ROWS}; a huge value: never split, no K copy)")
    args = ap.parse_args()
    # the varlen tuning constants, for A/B runs (module constants, read at each call)
    sv.CHUNK_ROWS = args.varlen_chunk_rows or sv.CHUNK_ROWS
    sv.SEGMENT_ROWS = args.varlen_segment_rows or sv.SEGMENT_ROWS
    if not torch.cuda.is_available():
        sys.exit("bench_selection: needs a CUDA GPU")
    chosen = [name for name in args.variants.split(",") if name]
    for name in chosen:
        if name not in VARIANTS:
            sys.exit(f"bench_selection: unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    H, G, D, block_size, n = SHAPES[args.shape]
    B, dtype, scale = args.batch, torch.bfloat16, D**-0.5
    triton_version = getattr(st.triton, "__version__", "not installed")
    print(f"{datetime.date.today()}  {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton_version}")
    print(f"$ python3 {' '.join(sys.argv)}")
    print(f"shape {args.shape}: B {B}, H {H}, G {G}, D {D}, l' {block_size}, n {n}, bf16, {args.choices} choices; "
          f"varlen CHUNK_ROWS {sv.CHUNK_ROWS}, SEGMENT_ROWS {sv.SEGMENT_ROWS}")
    rows, parity_ok, ratios = [], {}, []
    for S in args.seq_len or [8192]:
        gen = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (model_layout(B, S, heads, D, gen, dtype) for heads in (H, G, G))
        grad = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen)
        block_idx = (model_block_idx(B, S, args.shape) if args.choices == "model"
                     else random_block_idx(B, G, S, n, block_size, gen))
        for name, why in (("triton", st.unsupported_reason(q, k, v, block_idx, block_size)),
                          ("varlen", sv.unsupported_reason(q, k, v, block_idx, block_size))):
            if name in chosen and why:
                sys.exit(f"bench_selection: the {name} backend cannot run: {why}")
        for name in CHECKED:
            if name in chosen and name not in parity_ok:
                P = min(S, args.parity_len)
                q_p, k_p, v_p, grad_p, idx_p = (x[:, :, :P] for x in (q, k, v, grad, block_idx))
                err, same = parity(VARIANTS[name], q_p, k_p, v_p, grad_p, idx_p, block_size, scale)
                parity_ok[name] = err <= PARITY_BAR
                print(f"{name} parity at S={P}: worst rel RMS of o/dq/dk/dv vs fp32 reference {err:.2e} "
                      f"({'ok' if parity_ok[name] else 'FAIL'}), backward bitwise repeatable: {same}")  # fmt: skip
        times = {}
        for name in chosen:
            ok = parity_ok.get(name, True)
            par = "-" if name not in CHECKED else ("ok" if ok else "FAIL")
            try:
                fwd, both, peak = measure(VARIANTS[name], q, k, v, block_idx, block_size, scale, grad, args.reps)
                if args.profile:
                    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                    print_kernel_profile(lambda fn=VARIANTS[name], leaves=leaves: fwd_bwd(
                        fn, leaves, block_idx, block_size, scale, grad), f"{args.shape} S {S} {name} fwd+bwd")
                rows.append([S, name, f"{fwd:.2f}" if ok else "FAIL", f"{both:.2f}" if ok else "FAIL",
                             f"{peak:.2f}", par])  # fmt: skip
                if ok:
                    times[name] = (fwd, both)
            except torch.OutOfMemoryError:
                rows.append([S, name, "OOM", "OOM", "-", par])
        if "varlen" in times and "fa2" in times:
            (vf, vb), (ff, fb) = times["varlen"], times["fa2"]
            ratios.append(f"S={S}: varlen / fa2 = {vf / ff:.3f} fwd, {vb / fb:.3f} fwd+bwd (target <= 0.25)")
    print(tabulate(rows, headers=["S", "variant", "fwd ms", "fwd+bwd ms", "peak extra GiB", "parity"],
                   tablefmt="github"))  # fmt: skip
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
