"""compress_pooling: a weighted sum over a short window, written as a matrix-vector product or a
depthwise convolution, becomes a multiply-sum that Inductor fuses with the reading of the window.

NSA's compressed branch pools each window of l keys into one key. A learned pooling (one weight
per window position, XunhaoLai's `weightedpool`) is usually written as a product with a vector:
`einsum('bgnkd,gk->bgnd', windows, w)` (which canonicalize's einsum rule makes a matmul),
`windows.transpose(-1, -2) @ w[..., None]` or `windows @ w`. Inductor sends such a product to
cuBLAS as a GEMM with one column: the windows are copied out first (every key twice for
overlapping windows), and the weight's gradient is a GEMM whose output is the few weights and
whose reduction runs over every (batch, window, dim) element. A multiply-sum over the window is a
reduction Inductor fuses: the windows are read in place, and the weight's gradient is a split
reduction. At the seed shape on an H100 (bf16, BENCHMARKS.md's nineteenth session) one pooling's forward and
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

A depthwise convolution is the same pooling with one weight per channel and window position
(fused_qkv_per_head: `F.conv1d(x, w, stride=d, groups=C)`, w [C, 1, l], its mean pooling). Its
backward in ATen is `conv_depthwise2d_backward_kernel`, 0.84 ms a call at that model's seed shape
on an H100 (tools/profile_step.py). Matches
    out = F.conv1d(x, w, bias, stride=d, groups=C)      x [B, C, S], w [C, 1, l], l <= MAX_TERMS,
                                                         padding 0, dilation 1
Becomes, where l = r * d (each window is r consecutive blocks of d tokens; M = Tc + r - 1 blocks):
    xb  = x.narrow(-1, 0, M * d).unflatten(-1, (M, d))                               # [B, C, M, d]
    out = sum over i < r of (xb.narrow(-2, i, Tc) * w[:, 0, i*d:(i+1)*d][:, None]).sum(-1, dtype=float32)
    out = (out + bias[:, None]).to(dtype)
no overlapping view, so the backward is shifted slices and a reduction, no scatter (BENCHMARKS.md:
0.49 ms against 0.87 for the multiply-sum over overlapping windows); else the
multiply-sum over `x.unfold(-1, l, d)`. The partial sums are float32, as the convolution
accumulates.

Overlapping windows cut by `F.unfold` (`nn.Unfold`; lucidrains' compression: kernel (1, l),
stride (1, d) over [B*H, D, 1, S], each window then flattened into an MLP) are an im2col copy
whose backward is ATen's col2im, a scatter (0.42 ms a step in lucidrains_shared_kv's profile on
an H100, seventeenth session). Where l = r * d the same windows are r shifted views of one
non-overlapping cut into blocks of d, so Matches
    out = F.unfold(x, (1, l), stride=(1, d))       x [N, C, H, W]   (or kernel (l, 1), stride (d, 1))
Becomes
    xb  = x.narrow(3, 0, M * d).unflatten(3, (M, d))                          # [N, C, H, M, d], M = W // d
    win = cat([xb.narrow(3, i, Tc) for i < r], dim=-1)                         # [N, C, H, Tc, l]
    out = win.permute(0, 1, 4, 2, 3).flatten(1, 2).flatten(2, 3)              # [N, C * l, H * Tc]
the same elements in im2col's order (channel c * l + j, window h * Tc + t), so the same values,
and a backward of slices and adds that Inductor fuses, no scatter. Not yet timed on a GPU.

Windows written as an `as_strided` view of x with a window dim (grouped5d_nograd:
`x.as_strided((B, G, Tc, l, D), (sB, sG, d * sS, sS, sD))`) are the same view as
`x.unfold(dim, l, d).movedim(-1, p)` (p the window dim's place): the same strides over the same
storage offset, so the same values. Only the backward differs: autograd's for `as_strided` is
generic (it must allow any overlap), unfold's is made for windows. One pooling's forward and
backward at the seed shape on an H100 (tools/bench_pooling.py, twentieth session, run a): 0.65 ms
as the multiply-sum over the as_strided windows, 0.50 ms over `unfold`. So Matches
    win = x.as_strided(size, stride[, x.storage_offset()])   size and stride: x's with the
          dim a's size Tc = (S - l) // d + 1 and stride d * x.stride(a), and one more dim at p of
          size l and stride x.stride(a)
Becomes
    win = x.unfold(a, l, d).movedim(-1, p)
Any other as_strided is left alone without a refusal (it is no window view).

Refused (graph unchanged), with the reason, for a product with one output column or a
convolution with one filter per channel only:
- a sum longer than MAX_TERMS (a long dot product is a GEMV, where cuBLAS is at home);
- operands or output of different dtypes (autocast casts this product's operands: the autocast
  rule writes those casts first where it reads them; a product it did not cast stays);
- a left operand of one dim (a vector-vector or vector-matrix product);
- a convolution with padding or dilation, an input not [B, C, S], a filter of symbolic size, or
  one that may have no output position.
And for `F.unfold` whose kernel is one row or one column of more than one element: padding or
dilation, a stride across the window's other axis, a window not a multiple of its stride, or an
input that may hold no window.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from nsa_compile.fx import MATMULS, arg, call, op_name, same, size, size_value, value
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


def depthwise(conv: fx.Node) -> bool:
    """conv is a convolution of one filter per channel: F.conv1d(x, w, groups=C), w [C, 1, l]."""
    x, w = value(conv.args[0]) if conv.args else None, value(arg(conv, 1, "weight"))
    groups = arg(conv, 6, "groups", 1)
    return (x is not None and w is not None and w.dim() == 3 and x.dim() >= 2 and isinstance(groups, int)
            and groups > 1 and w.shape[1] == 1 and w.shape[0] == groups
            and statically_known_true(x.shape[-2] == groups))  # no guard on a symbolic channel count


def conv_refusal(conv: fx.Node) -> tuple[str | None, tuple]:
    """(reason, ()) or (None, (l, d)) for a depthwise conv1d."""
    x, w, out = value(conv.args[0]), value(arg(conv, 1, "weight")), value(conv)
    bias = value(arg(conv, 2, "bias"))
    stride, padding, dilation = (arg(conv, i, name, default) for i, name, default in
                                 ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1)))
    one = lambda v: v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v  # noqa: E731
    stride, padding, dilation = one(stride), one(padding), one(dilation)
    if x.dim() != 3 or not all(isinstance(n, int) for n in w.shape):
        return "a convolution input not [B, C, S] (an unbatched one) or a filter of symbolic size", ()
    if padding not in (0, "valid") or dilation != 1 or not isinstance(stride, int):
        return f"a convolution with padding {padding!r}, dilation {dilation!r}, stride {stride!r} (not a window pooling)", ()
    if not (x.dtype == w.dtype == out.dtype and (bias is None or bias.dtype == out.dtype)) or not x.is_floating_point():
        return (f"a convolution of {x.dtype} by {w.dtype} weights into {out.dtype} (autocast's cast): the "
                "multiply-sum would compute in another dtype"), ()
    l = w.shape[-1]
    if l > MAX_TERMS:
        return f"a sum of {l} terms (over {MAX_TERMS}: a long filter stays a convolution)", ()
    if not statically_known_true(out.shape[-1] >= 1):
        return "a convolution that may have no output position (S < l at some size)", ()
    return None, (l, stride)


def rewrite_conv(graph: fx.Graph, conv: fx.Node, l: int, d: int) -> str:
    x, w, bias = conv.args[0], arg(conv, 1, "weight"), arg(conv, 2, "bias")
    dtype = value(conv).dtype
    taps = call(graph, torch.select, w, 1, 0, anchor=conv)  # [C, l]
    if l % d == 0:  # r consecutive blocks of d tokens per window: no overlapping view
        # M = Tc + r - 1 = (S - l) // d + r = S // d blocks; sizes as numbers, or graph arithmetic on
        # a symbolic S (dynamic shapes)
        r, S = l // d, size(graph, x, -1, anchor=conv)
        arith = (lambda f, a, b: f(a, b)) if isinstance(S, int) else (lambda f, a, b: call(graph, f, a, b, anchor=conv))
        M = arith(operator.floordiv, S, d)
        Tc = arith(operator.sub, M, r - 1)
        blocks = call(graph, torch.narrow, x, -1, 0, arith(operator.mul, M, d), anchor=conv)
        blocks = call(graph, torch.unflatten, blocks, -1, (M, d), anchor=conv)  # [B, C, M, d]
        out = None
        for i in range(r):
            rows = call(graph, torch.narrow, blocks, -2, i, Tc, anchor=conv)  # [B, C, Tc, d]
            part = call(graph, torch.narrow, taps, -1, i * d, d, anchor=conv)  # [C, d]
            part = call(graph, torch.unsqueeze, part, 1, anchor=conv)  # [C, 1, d]
            term = call(graph, torch.sum, call(graph, torch.mul, rows, part, anchor=conv), -1, dtype=torch.float32,
                        anchor=conv)
            out = term if out is None else call(graph, torch.add, out, term, anchor=conv)
        form = f"{r} blocks of {d} per window"
    else:
        windows = call(graph, torch.Tensor.unfold, x, -1, l, d, anchor=conv)  # [B, C, Tc, l]
        out = call(graph, torch.sum, call(graph, torch.mul, windows, call(graph, torch.unsqueeze, taps, 1, anchor=conv),
                                          anchor=conv), -1, dtype=torch.float32, anchor=conv)
        form = "over unfold windows"
    if bias is not None:
        out = call(graph, torch.add, out, call(graph, torch.unsqueeze, bias, -1, anchor=conv), anchor=conv)
    out = call(graph, torch.Tensor.to, out, dtype, anchor=conv)
    conv.replace_all_uses_with(out)
    graph.erase_node(conv)
    return f"multiply-sum over {l} terms, {form} (Inductor reduction, no depthwise convolution)"


def _same(a, b) -> bool:
    """Two sizes (ints, SymInts or the size nodes that record them) equal for every value of their
    symbols, without a guard; False for anything that is no size."""
    a, b = size_value(a), size_value(b)
    return a is not None and b is not None and same(a, b)


def strided_windows(node: fx.Node) -> tuple[int, int, int, int] | None:
    """(a, p, l, d) when `node` is x.as_strided(...) with unfold's windows of x's dim a, the window
    dim at p (module docstring); None for any other as_strided."""
    if op_name(node) != "as_strided" or not node.args:
        return None
    x, out = value(node.args[0]), value(node)
    size, stride, offset = arg(node, 1, "size"), arg(node, 2, "stride"), arg(node, 3, "storage_offset")
    if x is None or out is None or not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)):
        return None
    if len(size) != x.dim() + 1 or len(stride) != x.dim() + 1 or not (offset is None or _same(offset, x.storage_offset())):
        return None
    for p in range(len(size)):
        l, inner = size[p], stride[p]
        rest_size, rest_stride = list(size[:p]) + list(size[p + 1:]), list(stride[:p]) + list(stride[p + 1:])
        if not isinstance(l, int) or l < 1:
            continue
        for a in range(x.dim()):
            xs, st = x.stride(a), rest_stride[a]
            if not (isinstance(xs, int) and isinstance(st, int) and xs > 0 and _same(inner, xs) and st % xs == 0):
                continue
            d = st // xs
            others = [k for k in range(x.dim()) if k != a]
            if d >= 1 and statically_known_true(x.shape[a] >= l) and all(_same(rest_size[k], x.shape[k]) and _same(rest_stride[k], x.stride(k)) for k in others) \
                    and _same(rest_size[a], (x.shape[a] - l) // d + 1):
                return a, p, l, d
    return None


def rewrite_strided(graph: fx.Graph, node: fx.Node, a: int, p: int, l: int, d: int) -> str:
    windows = call(graph, torch.Tensor.unfold, node.args[0], a, l, d, anchor=node)  # the window dim last
    out = windows if p == value(node).dim() - 1 else call(graph, torch.movedim, windows, -1, p, anchor=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return f"as_strided windows of {l} at stride {d} -> unfold, the same view (unfold's backward, not as_strided's)"


def unfold_windows(node: fx.Node) -> int | None:
    """The axis (2 or 3) along which `F.unfold(x, kernel_size, ...)` slides a window of one row or
    one column of more than one element over a 4-D x; None for any other unfold."""
    if node.op != "call_function" or node.target is not F.unfold or not node.args:
        return None
    x, kernel = value(node.args[0]), _pair(arg(node, 1, "kernel_size"))
    if x is None or x.dim() != 4 or kernel is None or 1 not in kernel or kernel == (1, 1):
        return None
    return 2 if kernel[1] == 1 else 3


def _pair(v) -> tuple | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(e, int) for e in v):
        return tuple(v)
    return None


def unfold_refusal(node: fx.Node, axis: int) -> tuple[str | None, tuple]:
    """(reason, ()) or (None, (l, d)) for an F.unfold sliding along `axis`."""
    x = value(node.args[0])
    kernel = _pair(arg(node, 1, "kernel_size"))
    dilation, padding, stride = (_pair(arg(node, i, name, default)) for i, name, default in
                                 ((2, "dilation", 1), (3, "padding", 0), (4, "stride", 1)))
    across = 3 - (axis - 2)  # the other spatial axis (2 <-> 3)
    if dilation != (1, 1) or padding != (0, 0) or stride is None or stride[across - 2] != 1:
        return (f"an unfold with dilation {dilation}, padding {padding}, stride {stride} (not windows of one "
                "axis)"), ()
    l, d = kernel[axis - 2], stride[axis - 2]
    if l % d:
        return f"windows of {l} at stride {d} (not whole blocks of the stride: the overlapping copy stays)", ()
    if not statically_known_true(x.shape[axis] >= l):
        return "an input that may hold no window (fewer than l tokens at some size)", ()
    return None, (l, d)


def rewrite_unfold(graph: fx.Graph, node: fx.Node, axis: int, l: int, d: int) -> str:
    x = node.args[0]
    r, W = l // d, size(graph, x, axis, anchor=node)
    arith = (lambda f, a, b: f(a, b)) if isinstance(W, int) else (lambda f, a, b: call(graph, f, a, b, anchor=node))
    M = arith(operator.floordiv, W, d)
    Tc = arith(operator.sub, M, r - 1)
    blocks = call(graph, torch.narrow, x, axis, 0, arith(operator.mul, M, d), anchor=node)
    blocks = call(graph, torch.unflatten, blocks, axis, (M, d), anchor=node)  # the axis -> (M, d)
    shifted = [call(graph, torch.narrow, blocks, axis, i, Tc, anchor=node) for i in range(r)]
    windows = shifted[0] if r == 1 else call(graph, torch.cat, shifted, axis + 1, anchor=node)  # (Tc, l)
    if axis == 3:  # [N, C, H, Tc, l] -> [N, C, l, H, Tc]
        order = (0, 1, 4, 2, 3)
    else:  # [N, C, Tc, l, W] -> [N, C, l, Tc, W]
        order = (0, 1, 3, 2, 4)
    out = call(graph, torch.permute, windows, order, anchor=node)
    out = call(graph, torch.flatten, call(graph, torch.flatten, out, 1, 2, anchor=node), 2, 3, anchor=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    views = "the blocks" if r == 1 else f"{r} shifted views of blocks"
    return f"windows of {l} as {views} of {d} (no im2col, a backward without col2im)"


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
    summary = ("a matrix-vector product or depthwise conv1d over a short window (pooling) -> multiply-sum "
               "Inductor fuses; F.unfold windows -> shifted block views; as_strided windows -> unfold")

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        for mm in list(graph.nodes):
            strided = strided_windows(mm)
            if strided is not None:
                ctx.matched(mm, rewrite_strided(graph, mm, *strided))
                continue
            axis = unfold_windows(mm)
            if axis is not None:
                reason, window = unfold_refusal(mm, axis)
                if reason:
                    ctx.refused(mm, reason)
                    continue
                ctx.matched(mm, rewrite_unfold(graph, mm, axis, *window))
                continue
            if op_name(mm) == "conv1d" and depthwise(mm):
                reason, window = conv_refusal(mm)
                if reason:
                    ctx.refused(mm, reason)
                    continue
                ctx.matched(mm, rewrite_conv(graph, mm, *window))
                continue
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
