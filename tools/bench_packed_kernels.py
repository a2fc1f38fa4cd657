"""Packed against unpacked documents at the kernel level: the compressed forward and backward and
block selection on their Triton backends, one process, each checked against the op's `reference`
backend on the same inputs before it is timed.

    python3 tools/bench_packed_kernels.py        # on the GPU; on the CPU a tiny interpreted smoke

Shapes: seed (B 32, S 2048, G 2, h 6, D 64, documents of 100-800 tokens) and paper (B 1, S 65536,
G 4, h 16, D 128, documents of 100-8000 tokens); l 32, d 16, l' 64, n 16; bf16; document lengths
drawn uniformly per row (seeded). Times from triton.testing.do_bench. The packed form's k and v
hold a slot per token (Tc = S - l + 1), as the op takes them with pos.

Check (the line's verdict), with the op tests' bounds for bf16 (tests/oracles.py): o, dq, dk, dv
within 1e-2 relative RMS error, lse within 2e-2 (of 1 + |lse|), and the
block ids of at most 0.1% of the query rows different (both rank fp32 importances; a different
summation order swaps near ties only). A FAIL prints no times.
"""
import os
import time

import torch

if not torch.cuda.is_available():  # the CPU smoke runs the kernels in Triton's interpreter (set before they are made)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from nsa_compile.ops import compressed_triton as ct, block_select_triton as bst
from nsa_compile.models.nsa import positions_from_cu_seqlens
dev = "cuda" if torch.cuda.is_available() else "cpu"
def bench(fn):
    if dev == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=200)
    t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
def lengths(S, lo, hi, seed):
    g = torch.Generator().manual_seed(seed); out = []
    while sum(out) < S: out.append(min(S - sum(out), int(torch.randint(lo, hi + 1, (1,), generator=g))))
    return out
def pos_of(S, B, lo, hi):
    rows = []
    for b in range(B):
        cu = torch.tensor([0, *torch.tensor(lengths(S, lo, hi, b)).cumsum(0).tolist()])
        rows.append(positions_from_cu_seqlens(cu, S))
    return torch.stack(rows).to(dev)
def check(q, k, v, go, pos, o, lse, scale) -> str:
    """PASS, or what differed: the Triton results against the reference backend's (module docstring)."""
    ops = torch.ops.nsa
    o_r, lse_r = ops.compressed_attention(q, k, v, l, d, scale, "reference", pos)
    grads = ct.compressed_backward(go, q, k, v, o, lse, l, d, scale, pos)
    grads_r = ops.compressed_attention_backward(go, q, k, v, o_r, lse_r, l, d, scale, "reference", pos)
    bad = []
    for what, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_r, *grads_r)):
        diff, ref = got.float() - want.float(), want.float()
        err = (diff.square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-6)).item()  # 0 where no gradient reaches
        if not err <= 1e-2:
            bad.append(f"{what} relative RMS error {err:.2e}")
    finite = lse_r.isfinite()
    if not torch.equal(finite, lse.isfinite()):
        bad.append("lse: -inf on other rows")
    elif finite.any() and (gap := ((lse[finite] - lse_r[finite]).abs() / (1 + lse_r[finite].abs())).max().item()) > 2e-2:
        bad.append(f"lse gap {gap:.2e}")
    ids = bst.select_blocks_forward(q, k, lse_r, l, d, ls, n, scale, pos)
    ids_r = ops.select_blocks(q, k, lse_r, l, d, ls, n, scale, "reference", pos)
    rows = (ids != ids_r).any(-1).float().mean().item()
    if rows > 1e-3:
        bad.append(f"block ids differ in {rows:.2%} of the rows")
    return "PASS" if not bad else "FAIL (" + "; ".join(bad) + ")"


shapes = {"seed": (32, 2048, 2, 6, 64, 100, 800), "paper": (1, 65536, 4, 16, 128, 100, 8000)}
if dev == "cpu":
    shapes = {"tiny": (1, 96, 1, 2, 16, 60, 96)}  # documents long enough for several blocks each
l, d, ls, n = 32, 16, 64, 16
for name, (B, S, G, h, D, lo, hi) in shapes.items():
    for packed in (False, True):
        Tc = S - l + 1 if packed else (S - l) // d + 1
        q = torch.randn(B, S, G * h, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, Tc, G, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, Tc, G, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        go = torch.randn_like(q)
        pos = pos_of(S, B, lo, hi) if packed else None
        o, lse = ct.compressed_forward(q, k, v, l, d, D**-0.5, pos)
        verdict = check(q, k, v, go, pos, o, lse, D**-0.5)
        if verdict != "PASS":
            print(f"{name} B={B} S={S} {'packed' if packed else 'unpacked'}: {verdict}")
            continue
        fwd = bench(lambda: ct.compressed_forward(q, k, v, l, d, D**-0.5, pos))
        bwd = bench(lambda: ct.compressed_backward(go, q, k, v, o, lse, l, d, D**-0.5, pos))
        sel = bench(lambda: bst.select_blocks_forward(q, k, lse, l, d, ls, n, D**-0.5, pos))
        print(f"{name} B={B} S={S} {'packed' if packed else 'unpacked'}: compressed fwd {fwd:.3f} ms, "
              f"bwd {bwd:.3f} ms, select {sel:.3f} ms (check against reference: PASS)")
