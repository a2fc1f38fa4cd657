"""The learned pooling of compression windows (grouped5d_nograd's `einsum('bgnkd,gk->bgnd',
windows, w)` over `as_strided` windows) at the seed shape (B 32, G 2, S 2048, D 64, l 32, d 16),
bf16, compiled by Inductor, forward and backward, side by side in one process on one CUDA card:

  einsum GEMM  the model's spelling: Inductor runs it as a GEMM of one column
  mul-sum      what passes/compress_pooling.py makes of it: a multiply-sum over the window
  unfold       the same multiply-sum over `x.unfold(2, l, d)` windows
  blocks       the window as l / d consecutive blocks of d keys, one multiply-sum per block
               (no overlapping view: no scatter in the backward); not a rewrite of this project

Each variant's output and gradients (x and w) are compared with a float64 run of the einsum
first (relative error, printed); a variant more than twice the GEMM's error is marked FAIL.

    python3 tools/bench_pooling.py
"""
import sys

import torch
import triton.testing

B, G, S, D, l, d = 32, 2, 2048, 64, 32, 16
Tc = (S - l) // d + 1


def windows(x):
    x = x.contiguous()
    return x.as_strided((B, G, Tc, l, D), (x.stride(0), x.stride(1), d * x.stride(2), x.stride(2), x.stride(3)))


def gemm(x, w):
    return torch.einsum("bgnkd,gk->bgnd", windows(x), w)


def mulsum(x, w):
    return (windows(x) * w[None, :, None, :, None]).sum(-2, dtype=x.dtype)


def unfold_mulsum(x, w):  # x.unfold(2, l, d): [B, G, Tc, D, l]
    return (x.unfold(2, l, d) * w[None, :, None, None, :]).sum(-1, dtype=x.dtype)


def blocks(x, w):  # l = r * d: the window is r consecutive blocks of d keys
    r = l // d
    xb = x[:, :, : (Tc + r - 1) * d].unflatten(2, (Tc + r - 1, d))  # [B, G, Tc + r - 1, d, D]
    out = 0
    for i in range(r):
        out = out + (xb[:, :, i : i + Tc] * w[None, :, None, i * d : (i + 1) * d, None]).sum(-2, dtype=torch.float32)
    return out.to(x.dtype)


def main():
    torch.manual_seed(0)
    x0 = torch.randn(B, G, S, D, device="cuda", dtype=torch.bfloat16)
    w0 = (torch.randn(G, l, device="cuda") / l).to(torch.bfloat16)
    g = torch.randn(B, G, Tc, D, device="cuda", dtype=torch.bfloat16)
    ref_x, ref_w = x0.double().requires_grad_(), w0.double().requires_grad_()
    ref = gemm(ref_x, ref_w)
    ref.backward(g.double())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; $ python3 {' '.join(sys.argv)}")
    print(f"{'spelling':<14} {'fwd+bwd ms':>10} {'out err':>9} {'dx err':>9} {'dw err':>9}")
    bar = None
    for name, fn in (("einsum GEMM", gemm), ("mul-sum", mulsum), ("unfold", unfold_mulsum), ("blocks", blocks)):
        torch._dynamo.reset()
        f = torch.compile(fn)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()

        def step():
            x.grad = w.grad = None
            f(x, w).backward(g)
        step()
        errs = [((a.double() - b).norm() / b.norm()).item() for a, b in
                ((f(x, w), ref), (x.grad, ref_x.grad), (w.grad, ref_w.grad))]
        bar = bar or [2 * e for e in errs]  # the GEMM's own rounding, twice
        ok = all(e <= b for e, b in zip(errs, bar))
        ms = triton.testing.do_bench(step, warmup=25, rep=200)
        print(f"{name:<14} {f'{ms:.3f}' if ok else 'FAIL':>10} " + " ".join(f"{e:>9.2e}" for e in errs))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench_pooling: needs a CUDA GPU")
    main()
