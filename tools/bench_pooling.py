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

Then lucidrains_shared_kv's windows (B*G 64 rows of D 64 channels, S 2048, left-padded by l - d
as ZeroPad2d does, l 32, d 16) flattened into its compression MLP (Linear(l*D, l*D), ReLU,
Linear(l*D, D)), forward and backward, compiled:

  im2col       the model's `nn.Unfold` (kernel (1, l), stride (1, d)); its backward is col2im
  blocks       what compress_pooling makes of it: l / d shifted views of blocks of d (a cat)

The cut windows must be equal element for element, and the outputs and gradients (x and the
first Linear's weight, bf16 autocast) within twice the im2col variant's error against float64,
else FAIL.

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


def im2col_windows(x):  # x [N, D, 1, S + l - d] -> [N, D * l, Tc']
    return torch.nn.functional.unfold(x, (1, l), stride=(1, d))


def block_windows(x):  # passes/compress_pooling.py's rewrite, written out
    r, M = l // d, x.shape[-1] // d
    xb = x.narrow(3, 0, M * d).unflatten(3, (M, d))  # [N, D, 1, M, d]
    win = torch.cat([xb.narrow(3, i, M - r + 1) for i in range(r)], dim=-1)  # [N, D, 1, Tc', l]
    return win.permute(0, 1, 4, 2, 3).flatten(1, 2).flatten(2, 3)


def mlp_windows():
    torch.manual_seed(0)
    N = B * G
    x0 = torch.randn(N, D, 1, S + l - d, device="cuda", dtype=torch.bfloat16)
    mlp = torch.nn.Sequential(torch.nn.Linear(l * D, l * D), torch.nn.ReLU(), torch.nn.Linear(l * D, D)).cuda()
    windows_out = S // d
    g = torch.randn(N, windows_out, D, device="cuda", dtype=torch.bfloat16)

    def run(cut, x, net):
        return net(cut(x).transpose(1, 2))

    ref_x = x0.double().requires_grad_()
    ref_mlp = __import__("copy").deepcopy(mlp).double()
    ref = run(im2col_windows, ref_x, ref_mlp)
    ref.backward(g.double())
    print(f"{'windows':<14} {'fwd+bwd ms':>10} {'out err':>9} {'dx err':>9} {'dW1 err':>9}")
    bar = None
    for name, cut in (("im2col", im2col_windows), ("blocks", block_windows)):
        torch._dynamo.reset()
        net = __import__("copy").deepcopy(mlp)
        f = torch.compile(lambda x, cut=cut, net=net: run(cut, x, net))
        x = x0.clone().requires_grad_()

        def step():
            x.grad = None
            net.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = f(x)
            out.backward(g)
            return out
        out = step()
        errs = [((a.double() - b).norm() / b.norm()).item() for a, b in
                ((out, ref), (x.grad, ref_x.grad), (net[0].weight.grad, ref_mlp[0].weight.grad))]
        bar = bar or [2 * e for e in errs]
        ok = all(e <= b for e, b in zip(errs, bar)) and torch.equal(cut(x0), im2col_windows(x0))
        ms = triton.testing.do_bench(step, warmup=25, rep=200)
        print(f"{name:<14} {f'{ms:.3f}' if ok else 'FAIL':>10} " + " ".join(f"{e:>9.2e}" for e in errs))


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
    mlp_windows()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench_pooling: needs a CUDA GPU")
    main()
