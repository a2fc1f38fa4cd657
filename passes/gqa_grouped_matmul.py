"""gqa_grouped_matmul: remove the GQA `repeat_interleave` copy of K/V in front of a matmul.

Matches
    kv_rep = kv.repeat_interleave(h, dim=a)        # [..., G*h (at a), ..., T, D]   (a copy)
    out = lhs @ kv_rep             or   lhs @ kv_rep.transpose(-1, -2)
where `a` is a batch dim of the matmul and every use of `kv_rep` is such a matmul, with kv_rep
on the right and no broadcasting over batch dims. This is how eager GQA attention computes
q @ K^T and p @ V (and the per-query gathered K/V of the selected branch).

Becomes, per matmul (no copy of K/V; the h query heads of a group ride in the row dim):
    lhs_g = lhs.unflatten(a, (G, h)).movedim(a + 1, -3).flatten(-3, -2)   # [..., G, ..., h*M, K]
    out   = (lhs_g @ kv[.transpose(-1, -2)])                              # [..., G, ..., h*M, N]
               .unflatten(-2, (h, M)).movedim(-3, a + 1).flatten(a, a + 1)
Every element of `out` is the same dot product as before, in the same dtype.

Refuses (graph unchanged), with the reason shown by `explain`:
- repeats that are a tensor, or no `dim` (the input is flattened); symbolic (SymInt) repeats,
  as under dynamic shapes, are fine;
- a repeat over a matrix dim of the matmul (not a head dim);
- kv_rep used by anything but such a matmul (the copy must stay for that use), or on the left;
- a matmul that broadcasts over batch dims, or whose operands differ in rank;
- an operand with a dim of size 0 (nothing to compute; unflatten could not infer its sizes);
- K/V read by advanced indexing (`k[b, tokens, h]`): the fake strides PyTorch gives aten.index can
  differ from the real ones (a non-contiguous index tensor), and the matmul's view of the
  un-copied tensor would fail at run time.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from nsa_compile.fx import MATMULS, arg, call, op_name, size, value
from nsa_compile.rewrite import PassContext, RewritePass

KERNEL = "grouped matmul (K/V broadcast over the group's heads, no copy)"


def is_last_two_transpose(node: fx.Node) -> bool:
    """node is x.transpose(i, j) / torch.transpose(x, i, j) swapping the last two dims of x."""
    if op_name(node) not in ("transpose", "swapaxes") or value(node) is None:
        return False
    rank = value(node).dim()
    dims = {arg(node, 1, "dim0"), arg(node, 2, "dim1")}
    if not all(isinstance(d, int) for d in dims):
        return False
    return {d % rank for d in dims} == {rank - 2, rank - 1}


def is_symint(node: fx.Node) -> bool:
    """node computes a symbolic int (a size under dynamic shapes), not a tensor."""
    return isinstance(node.meta.get("example_value", node.meta.get("val")), torch.SymInt)


def matmul_uses(rep: fx.Node) -> tuple[list[tuple[fx.Node, fx.Node | None]], str | None]:
    """Every (matmul, transpose-or-None) consuming `rep` on the right, or a refusal reason."""
    uses = []
    for user in rep.users:
        transpose = None
        consumers = [user]
        if is_last_two_transpose(user) and user.args[0] is rep:
            transpose, consumers = user, list(user.users)
        for mm in consumers:
            operand = transpose or rep
            if op_name(mm) not in MATMULS:
                return [], f"the repeated tensor is also used by {op_name(mm) or mm.op}: the copy must stay"
            if mm.args[0] is operand and mm.args[1] is not operand:
                return [], "the repeated tensor is the left operand of a matmul"
            if mm.args[1] is not operand:
                return [], "a matmul uses the repeated tensor on both sides"
            uses.append((mm, transpose))
    if not uses:
        return [], "the repeated tensor has no matmul consumer"
    return uses, None


_VIEWS = ("transpose", "permute", "swapaxes", "view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten",
          "expand", "contiguous")


def read_by_advanced_indexing(node: fx.Node) -> bool:
    """node is, through views, the result of indexing with a tensor (x[b, tokens, h])."""
    while op_name(node) in _VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if op_name(node) != "getitem" or len(node.args) < 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return any(isinstance(i, fx.Node) and value(i) is not None for i in index)


def check_matmul(mm: fx.Node, dim: int) -> str | None:
    lhs, out = value(mm.args[0]), value(mm)
    rhs = value(mm.args[1])
    if lhs is None or rhs is None or out is None:
        return "matmul operand shapes are unknown"
    rank = lhs.dim()
    if rhs.dim() != rank or rank < 3:
        return f"matmul operands of rank {lhs.dim()} and {rhs.dim()} (need equal ranks >= 3)"
    if dim >= rank - 2:
        return f"repeat_interleave over dim {dim}, a matrix dim of the matmul, not a head dim"
    if not all(statically_known_true(a == b) for a, b in zip(lhs.shape[:-2], rhs.shape[:-2])):
        return f"the matmul broadcasts over batch dims {tuple(lhs.shape[:-2])} vs {tuple(rhs.shape[:-2])}"
    if any(statically_known_true(size == 0) for size in (*lhs.shape, *rhs.shape)):
        return "a matmul operand is empty (a dim of size 0)"
    return None


def rewrite_matmul(graph: fx.Graph, mm: fx.Node, transpose: fx.Node | None, kv: fx.Node, dim: int, h: int):
    rank = value(mm).dim()
    lhs = mm.args[0]
    rhs = kv if transpose is None else call(graph, torch.transpose, kv, -2, -1, anchor=mm)
    # explicit sizes, no -1 (see nsa_compile.fx.size): G from K/V, M from the left operand
    G, M = size(graph, kv, dim, anchor=mm), size(graph, lhs, rank - 2, anchor=mm)
    grouped = call(graph, torch.unflatten, lhs, dim, (G, h), anchor=mm)  # [..., G, h, ..., M, K]
    if dim + 1 != rank - 2:
        grouped = call(graph, torch.movedim, grouped, dim + 1, rank - 2, anchor=mm)  # h next to M
    grouped = call(graph, torch.flatten, grouped, rank - 2, rank - 1, anchor=mm)  # [..., G, ..., h*M, K]
    out = call(graph, torch.matmul, grouped, rhs, anchor=mm)  # [..., G, ..., h*M, N]
    out = call(graph, torch.unflatten, out, rank - 2, (h, M), anchor=mm)
    if dim + 1 != rank - 2:
        out = call(graph, torch.movedim, out, rank - 2, dim + 1, anchor=mm)
    out = call(graph, torch.flatten, out, dim, dim + 1, anchor=mm)  # same shape as mm
    mm.replace_all_uses_with(out)
    graph.erase_node(mm)


class GQAGroupedMatmul(RewritePass):
    name = "gqa_grouped_matmul"
    summary = "repeat_interleave of K/V feeding a matmul -> grouped matmul without the copy"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        for rep in list(graph.nodes):
            if op_name(rep) != "repeat_interleave":
                continue
            reason, plan = self.check(rep)
            if reason:
                ctx.refused(rep, reason)
                continue
            kv, h, dim, uses = plan
            for mm, transpose in uses:
                rewrite_matmul(graph, mm, transpose, kv, dim, h)
                if transpose is not None and not transpose.users:
                    graph.erase_node(transpose)
            graph.erase_node(rep)
            ctx.matched(rep, KERNEL)

    def check(self, rep: fx.Node):
        kv, repeats, dim = arg(rep, 0, "input"), arg(rep, 1, "repeats"), arg(rep, 2, "dim")
        if not (isinstance(repeats, int) or isinstance(repeats, fx.Node) and is_symint(repeats)):
            return "repeats is not an int or SymInt (tensor repeats are data-dependent)", None
        if dim is None:
            return "repeat_interleave without dim flattens its input", None
        if arg(rep, 3, "output_size") is not None:
            return "output_size is given", None
        val = value(kv)
        if val is None or not val.is_floating_point():
            return "the repeated tensor is not a floating-point tensor (not K/V)", None
        dim %= val.dim()
        if read_by_advanced_indexing(kv):
            return ("the repeated tensor is read by advanced indexing (x[idx, ...]): PyTorch's fake strides of "
                    "aten.index differ from the real ones for a non-contiguous index, and the matmul's view of it "
                    "would fail at run time; the copy stays"), None
        uses, reason = matmul_uses(rep)
        if reason:
            return reason, None
        for mm, _ in uses:
            reason = check_matmul(mm, dim)
            if reason:
                return reason, None
        return None, (kv, repeats, dim, uses)


PASS = GQAGroupedMatmul()
