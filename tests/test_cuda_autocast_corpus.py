"""Corpus models as CUDA bf16 autocast runs them, on the CPU: the casts written out.

On the H200 (tools/bench_corpus.py, 2026-11-27) two corpus models lost branches under CUDA autocast
that they keep in the CPU tests, because CUDA autocast runs some ops in other dtypes than CPU
autocast does (CPU autocast keeps a bf16 softmax, so it cannot stand in for it). Here each model
runs in bf16 with the casts CUDA autocast adds written into its source, one replacement per
autocast rule, and every NSA branch must still be rewritten, with outputs and gradients as eager's:

- grouped5d_nograd: the block importance einsum 'bghsc,cj->bgsj' of float32 probabilities runs in
  bf16 (its operands cast); canonicalize then sees the probabilities cast twice (for p @ v and for
  the importance) and writes the einsum as torch.einsum computes it (the heads summed first).
- where_bias_spellings: its prefix-sum pooling's cumsum runs in float32 (the pooled keys and values
  float32), so autocast casts the laid-out keys `kc.permute(..)` and the probabilities
  `p.to(vc.dtype)` (float32 -> float32) to bf16 for their matmuls, and the importance matmul's
  operands too; the group sum runs in float32.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import optimize_fresh

import nsa_compile

BRANCHES = ("window_attention", "compressed_attention", "select_blocks", "selected_attention", "gated_combine")
BF16 = "torch.bfloat16"

# (corpus model, [(eager source, the same line with CUDA autocast's casts written out)])
CASTS = {
    "grouped5d_nograd": [
        ('importance = torch.einsum("bghsc,cj->bgsj", p_cmp, overlap.float() / self.l)',
         f'importance = torch.einsum("bghsc,cj->bgsj", p_cmp.to({BF16}), (overlap.float() / self.l).to({BF16}))'),
    ],
    "where_bias_spellings": [
        ("torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(dim=1)], dim=1)",  # cumsum: float32; cat promotes
         "torch.cat([torch.zeros_like(x[:, :1]).float(), x.float().cumsum(dim=1)], dim=1)"),
        ("torch.matmul(q.transpose(1, 2), kc.permute(0, 2, 3, 1))",
         f"torch.matmul(q.transpose(1, 2), kc.permute(0, 2, 3, 1).to({BF16}))"),
        ("torch.matmul(p_cmp.to(vc.dtype), vc.transpose(1, 2))",
         f"torch.matmul(p_cmp.to(vc.dtype).to({BF16}), vc.transpose(1, 2).to({BF16}))"),
        ("p_grp = (p_cmp @ (overlap.to(p_cmp.dtype) / self.l)).unflatten(1, (G, h)).sum(2)",  # sum: float32
         f"p_grp = (p_cmp.to({BF16}) @ (overlap.to(p_cmp.dtype) / self.l).to({BF16})).unflatten(1, (G, h)).float()"
         ".sum(2)"),
    ],
}


def as_cuda_autocast_runs(name: str):
    """(module in bf16, x in bf16) of the corpus model with CUDA autocast's casts written out."""
    module = importlib.import_module(f"corpus.{name}")
    source = open(module.__file__).read()
    for eager, cast in CASTS[name]:
        assert source.count(eager) == 1, f"{name}: the line {eager!r} changed"
        source = source.replace(eager, cast)
    namespace = {"__name__": f"{name}_cuda_autocast"}
    exec(compile(source, f"<{name} under CUDA autocast>", "exec"), namespace)
    model, x = namespace["make"]()
    return model.to(torch.bfloat16), x.to(torch.bfloat16)


@pytest.mark.parametrize("name", sorted(CASTS))
def test_every_branch_is_rewritten_with_cuda_autocasts_casts(name):
    model, x = as_cuda_autocast_runs(name)
    eager_x, opt_x = (x.clone().requires_grad_() for _ in range(2))
    want = model(eager_x)
    optimized = optimize_fresh(model, nsa_compile.OptimizeConfig(compiler="aot_eager"))
    got = optimized(opt_x)
    rows = {r["name"]: r for r in nsa_compile.report(optimized)}
    assert {b: rows[b]["matches"] for b in BRANCHES} == dict.fromkeys(BRANCHES, 1), \
        {b: rows[b]["reasons"] for b in BRANCHES}
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(want.dtype)
    params = [p for p in model.parameters() if p.requires_grad]  # shared: optimize wraps the module
    grads_want = torch.autograd.grad(want, [eager_x, *params], grad)
    grads_got = torch.autograd.grad(got, [opt_x, *params], grad)
    for a, b in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
