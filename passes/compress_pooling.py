"""compress_pooling: a weighted sum over a short window, written as a matrix-vector product,
becomes a multiply-sum that Inductor fuses with the reading of the window.

NSA's compressed branch pools each window of l keys into one key. A learned pooling (one weight
per window position, XunhaoLai's `weightedpool`) is usually written as a product with a vector:
`einsum('bgnkd,gk->bgnd', windows, w)` (which canonicalize's einsum rule makes a matmul),
`windows.transpose(-1, -2) @ w[..., None]` or `windows @ w`. Inductor sends such a product to
cuBLAS as a GEMM with one column: the windows are copied out first (every key twice for
overlapping windows), and the weight's gradient is a GEMM whose output is the few weights and
whose reduction runs over every (batch, window, dim) element. A multiply-sum over the window is a
reduction Inductor fuses: the windows are read in place, and the weight's gradient is a split
reduction. At the seed shape on an H100 (bf16, tools/bench_pooling.py) one pooling's forward and
backward take 1.10 ms as the GEMM and 0.87 ms as the multiply-sum; grouped5d_nograd's step went
from 12.4 to 11.7 ms (BENCHMARKS.md). (Inductor's own decomposition of a matrix-vector bmm into this
form runs only under `coordinate_descent_tuning`, for any length of the sum.)

Matches
    out = a @ b          a [..., M, K], b [..., K, 1] or b [K];  K <= MAX_TERMS
Becomes
    out = (a * b.transpose(-1, -2)).sum(-1, keepdim=True, dtype=out.dtype)     (b [..., K, 1])
    out = (a * b).sum(-1, dtype=out.dtype)                                       (b [K])
The same sum of the same products, broadcast over the batch dims as matmul broadcasts them. The
explicit `dtype` is the product's: autocast runs `sum` in float32 on CUDA unless a dtype is given,
and would otherwise widen what the GEMM returned in bf16. In Inductor the products and the sum are
computed in float32, as the GEMM accumulates; in eager (aot_eager) each product is rounded to the
operands' dtype first, a rounding within a bf16/fp16 product's own error.

Refused (graph unchanged), with the reason, for a product with one output column only:
- a sum longer than MAX_TERMS (a long dot product is a GEMV, where cuBLAS is at home);
- operands or output of different dtypes (autocast casts this product's operands: the autocast
  rule writes those casts first where it reads them; a product it did not cast stays);
- a left operand of one dim (a vector-vector or vector-matrix product).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from nsa_compile.fx import MATMULS, call, op_name, value
from nsa_compile.rewrite import PassContext, RewritePass

MAX_TERMS = 64  # the longest sum rewritten: a window of up to 64 keys (the paper's l is 32)


def one_column(mm: fx.Node) -> bool:
    """mm is a matrix product with a vector on the right: b [K] or b [..., K, 1]."""
    b = value(mm.args[1]) if len(mm.args) == 2 else None
    return b is not None and (b.dim() == 1 or statically_known_true(b.shape[-1] == 1))


def refusal(mm: fx.Node) -> str | None:
    a, b, out = value(mm.args[0]), value(mm.args[1]), value(mm)
    if a is None or out is None or a.dim() < 2:
        return "a left operand of one dim (a vector product, not a weighted sum over rows)"
    if not (a.dtype == b.dtype == out.dtype) or not a.is_floating_point():
        return (f"operands {a.dtype} and {b.dtype} for a {out.dtype} product (a cast the autocast rule did not "
                "write): the multiply-sum would compute in another dtype")
    if not statically_known_true(a.shape[-1] <= MAX_TERMS):
        return f"a sum of {a.shape[-1]} terms (over {MAX_TERMS}: a long dot product stays a cuBLAS GEMV)"
    return None


def rewrite(graph: fx.Graph, mm: fx.Node) -> None:
    a, b = mm.args
    dtype = value(mm).dtype
    if value(b).dim() == 1:
        product = call(graph, torch.mul, a, b, anchor=mm)
        out = call(graph, torch.sum, product, -1, dtype=dtype, anchor=mm)
    else:
        row = call(graph, torch.transpose, b, -1, -2, anchor=mm)  # [..., 1, K]
        product = call(graph, torch.mul, a, row, anchor=mm)  # [..., M, K]
        out = call(graph, torch.sum, product, -1, keepdim=True, dtype=dtype, anchor=mm)
    mm.replace_all_uses_with(out)
    graph.erase_node(mm)


class CompressPooling(RewritePass):
    name = "compress_pooling"
    summary = "a matrix-vector product over a short window (learned pooling) -> multiply-sum Inductor fuses"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        for mm in list(graph.nodes):
            if op_name(mm) not in MATMULS or not one_column(mm):
                continue
            reason = refusal(mm)
            if reason:
                ctx.refused(mm, reason)
                continue
            terms = value(mm.args[0]).shape[-1]
            rewrite(graph, mm)
            ctx.matched(mm, f"multiply-sum over {terms} terms (Inductor reduction, no GEMM of one column)")


PASS = CompressPooling()
