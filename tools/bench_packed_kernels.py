"""Packed against unpacked documents at the kernel level: the compressed forward and backward and
block selection on their Triton backends, one process (preliminary: no parity check in the run).

    python3 tools/bench_packed_kernels.py        # on the GPU; on the CPU a tiny interpreted smoke

Shapes: seed (B 32, S 2048, G 2, h 6, D 64, documents of 100-800 tokens) and paper (B 1, S 65536,
G 4, h 16, D 128, documents of 100-8000 tokens); l 32, d 16, l' 64, n 16; bf16; document lengths
drawn uniformly per row (seeded). Times from triton.testing.do_bench. The packed form's k and v
hold a slot per token (Tc = S - l + 1), as the op takes them with pos.
"""
import time

import torch

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
shapes = {"seed": (32, 2048, 2, 6, 64, 100, 800), "paper": (1, 65536, 4, 16, 128, 100, 8000)}
if dev == "cpu":
    shapes = {"tiny": (1, 96, 1, 2, 16, 10, 40)}
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
        fwd = bench(lambda: ct.compressed_forward(q, k, v, l, d, D**-0.5, pos))
        bwd = bench(lambda: ct.compressed_backward(go, q, k, v, o, lse, l, d, D**-0.5, pos))
        sel = bench(lambda: bst.select_blocks_forward(q, k, lse, l, d, ls, n, D**-0.5, pos))
        print(f"{name} B={B} S={S} {'packed' if packed else 'unpacked'}: compressed fwd {fwd:.3f} ms, "
              f"bwd {bwd:.3f} ms, select {sel:.3f} ms")
