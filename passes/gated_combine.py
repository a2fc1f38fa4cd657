"""gated_combine: the NSA gate (its MLP and softmax or sigmoid) and the gated sum of the three
branch outputs -> one nsa.gated_combine op that reads each branch output once and writes o once.

Matches (torch IR), anchored at the sum (models/nsa.py `NSAAttention.forward` and `.gates`):
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win      # o_c [B, S, H, Dv]
terms in any order and nesting, factors either way round, g[..., c:c+1] or g[..., c, None] or
g[..., c].unsqueeze(-1); g [B, S, H, 3] computed, reading upwards, as
    g = t.repeat_interleave(rep, dim=2)                     # optional: heads sharing a gate triple
    t = softmax(z', dim=-1) over a last dim of 3  |  sigmoid(z')   # views of the trailing dims around
    z = linear(a, w2, b2)                                   # [B, S, 3 * NI] or [B, S, R, 3 * NI]
    a = act(linear(u, w1, b1))                              # optional hidden layer: silu, relu, gelu (erf)
    u = v.mean(3) with v [B, S, R, m, Din]  |  any u [B, S, R, Din] or [B, S, Din]
or, when z is not a Linear's output, z as it is (logits computed elsewhere: fused_projections
merges the paper's gate Linear into the GEMM of the projections that read the same x, and
whatever else computes the logits, an unknown activation or another tensor added in, stays).
The seed's group gate: v = q.view(B, S, G, h, Dk), Linear -> SiLU -> Linear(., 3), softmax,
repeat_interleave(h, dim=2). The paper's head gate: sigmoid(Linear(dim, 3H)(x)).view(B, S, H, 3)
(after fused_projections: sigmoid(logits) with the logits a slice of the shared GEMM).
The branch outputs are whatever tensors the sum reads: the attention ops' outputs when the
attention passes fired, the eager attention code's otherwise.

Becomes `torch.ops.nsa.gated_combine(v or u (or z) as [B, S, R, m, Din], w1, b1, w2, b2, o_cmp,
o_sel, o_win, act, normalize, backend)[0]` (nsa_compile/ops/gated_combine.py; w1 = b1 = w2 = b2 =
None for logits from elsewhere), cast to the sum's dtype when that differs from the branch
outputs' (a float32 gate on bf16 branch outputs: CUDA's bf16 autocast runs the softmax in float32)
unless every use of the sum is the input of a Linear or matmul that rounds it back to the branch
outputs' dtype itself (autocast's next Linear, wo): then the op's output goes there as it is.
The backend is chosen here from the fake tensors (OptimizeConfig.combine_backend) and written
into the graph; `explain` shows which and, for reference, why not triton.

Refuses (graph unchanged), with the reason shown by `explain`, a sum with a gate-sliced term
whose
- terms are not three, or not each gate[..., c:c+1] * branch output (a gate that mixes two
  branches), or slice different gates, or do not use the columns 0, 1, 2 once each;
- gate is not a softmax over the three branches or a sigmoid (of whatever logits): a softmax
  over another dim, or the normalized gate changed before it is sliced (scaled by another
  tensor, say), or views that change [B, S];
- gate, its slices, the products, partial sums, logits or hidden layer are used elsewhere
  (they would have to stay: the op does not return them);
- branch outputs differ in shape or dtype, or broadcast; shapes that do not fit (R rows of
  3 * NI logits for H heads); symbolic (dynamic) sizes.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.attention_match import Refused, erase_replaced, only_user
from nsa_compile.fx import arg, call, op_name, value
from nsa_compile.ops.gated_combine import choose_backend, why_not_triton
from nsa_compile.rewrite import PassLog, RewritePass

KERNEL = "nsa.gated_combine[{backend}] ({gate} -> {norm}, {share}; branch outputs read once{why})"
_VIEWS = ("view", "reshape", "unflatten")
_DTYPE_KEEPING_VIEWS = ("view", "reshape", "unflatten", "flatten", "transpose", "permute", "contiguous")


def is_add(node) -> bool:
    """a + b of two tensors (operator, torch.add or Tensor.add, no alpha)."""
    return (isinstance(node, fx.Node) and op_name(node) == "add" and len(node.args) == 2 and not node.kwargs
            and all(isinstance(x, fx.Node) for x in node.args))


def sum_terms(top: fx.Node) -> tuple[list, list[fx.Node]]:
    """The leaves of a nest of additions under `top` (an inner sum is a leaf when it has other
    users) and the addition nodes, outermost first."""
    terms, adds, stack = [], [], [top]
    while stack:
        node = stack.pop(0)
        adds.append(node)
        for side in node.args:
            if is_add(side) and len(side.users) == 1:
                stack.append(side)
            else:
                terms.append(side)
    return terms, adds


def gate_slice(node) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """g[..., c:c+1], g[..., c, None] or g[..., c].unsqueeze(-1) -> (g, c, [slice nodes, user first])."""
    if not isinstance(node, fx.Node):
        return None
    chain = [node]
    if op_name(node) == "unsqueeze" and arg(node, 1, "dim") == -1:
        inner = arg(node, 0, "input")
        if isinstance(inner, fx.Node) and op_name(inner) == "getitem":
            g, index = inner.args
            if isinstance(g, fx.Node) and index in ((Ellipsis, 0), (Ellipsis, 1), (Ellipsis, 2)):
                return g, index[1], chain + [inner]
        return None
    if op_name(node) != "getitem" or not isinstance(node.args[0], fx.Node) or not isinstance(node.args[1], tuple):
        return None
    g, index = node.args
    if len(index) == 3 and index[0] is Ellipsis and index[2] is None and isinstance(index[1], int):
        return g, index[1], chain
    last = index[-1] if index else None
    leading = index[:-1]
    if isinstance(last, slice) and last.step in (None, 1) and isinstance(last.start, int) \
            and last.stop == last.start + 1 and all(x is Ellipsis or x == slice(None) for x in leading) \
            and (Ellipsis in leading or len(index) == 4):
        return g, last.start, chain
    return None


def gate_term(node) -> tuple[fx.Node, int, fx.Node, list[fx.Node]] | None:
    """slice * o or o * slice -> (g, column, o, [mul, slice nodes])."""
    if not isinstance(node, fx.Node) or op_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    for s, o in (node.args, node.args[::-1]):
        found = gate_slice(s)
        if found is not None and isinstance(o, fx.Node):
            g, c, chain = found
            return g, c, o, [node, *chain]
    return None


def rounded_by_its_users(node: fx.Node, dtype: torch.dtype, views: list[fx.Node]) -> bool:
    """Whether every use of `node` reaches, through views, the input of a Linear or matmul that
    computes in `dtype` although `node` is wider (autocast: the consumer rounds its input to `dtype`
    itself). Then `node` may arrive in `dtype` already: the same values reach the consumer. The
    views on the way are appended to `views` (their recorded dtypes must be refreshed)."""
    for user in node.users:
        name = op_name(user)
        if name in _DTYPE_KEEPING_VIEWS and arg(user, 0, "input") is node:
            views.append(user)
            if not rounded_by_its_users(user, dtype, views):
                return False
        elif name not in ("linear", "matmul", "mm", "bmm") or value(user) is None or value(user).dtype != dtype \
                or (name == "linear" and arg(user, 0, "input") is not node):
            return False
    return bool(node.users)


def refresh_value(node: fx.Node) -> None:
    """Recompute a node's recorded fake value from its inputs' (after an input changed dtype)."""
    fakes = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("example_value", n.meta.get("val")))
    mode = value(node).fake_mode
    shape_env = getattr(mode, "shape_env", None)
    no_guards = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
    with mode, no_guards:
        if node.op == "call_method":
            fresh = getattr(fakes[0][0], node.target)(*fakes[0][1:], **fakes[1])
        else:
            fresh = node.target(*fakes[0], **fakes[1])
    node.meta["example_value"] = fresh


def static_shape(node: fx.Node, what: str) -> tuple[int, ...]:
    val = value(node)
    if val is None:
        raise Refused(f"the {what} has no recorded tensor value")
    if not all(isinstance(d, int) for d in val.shape):
        raise Refused(f"the {what} has symbolic sizes {tuple(val.shape)} (dynamic shapes): not matched yet")
    return tuple(val.shape)


def is_linear(node) -> bool:
    return isinstance(node, fx.Node) and op_name(node) == "linear"


def linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or not (b is None or isinstance(b, fx.Node)):
        raise Refused("a gate Linear does not take tensors (input, weight, bias)")
    return x, w, b


def activation_of(node) -> str | None:
    """'silu', 'relu' or 'gelu' for F.silu / torch.relu / F.relu / F.gelu (exact) without in-place."""
    name = op_name(node) if isinstance(node, fx.Node) else None
    if name in ("silu", "relu") and not arg(node, 1, "inplace", False):
        return name
    if name == "gelu" and arg(node, 1, "approximate", "none") == "none":
        return name
    return None


class GatedCombine(RewritePass):
    name = "gated_combine"
    summary = "gate MLP + softmax/sigmoid + gated sum of the three branch outputs -> nsa.gated_combine, one kernel"

    def apply(self, graph: fx.Graph, log: PassLog) -> None:
        requested = log.config.combine_backend if log.config else "auto"
        for top in list(graph.nodes):
            if top._erased or not is_add(top):
                continue
            users = list(top.users)
            if len(users) == 1 and is_add(users[0]):
                continue  # an inner sum: its outermost sum is the candidate
            terms, adds = sum_terms(top)
            if not any(gate_term(t) for t in terms):
                continue  # not a gated sum (residual adds and the like)
            try:
                plan = self.check(top, terms, adds, requested)
            except Refused as why:
                log.refused(top, str(why))
                continue
            self.rewrite(graph, top, plan)
            why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
            log.matched(top, KERNEL.format(backend=plan["backend"], gate=plan["gate"], norm=plan["normalize"],
                                           share=plan["share"], why=why))

    def check(self, top: fx.Node, terms: list, adds: list[fx.Node], requested: str = "auto") -> dict:
        for t in terms:
            if is_add(t) and any(gate_term(x) for x in t.args):
                raise Refused("a partial sum of the gated terms is also used elsewhere; it must stay as it is")
        if len(terms) != 3:
            raise Refused(f"the gated sum has {len(terms)} terms; the op mixes exactly three branches")
        parsed = [gate_term(t) for t in terms]
        if not all(parsed):
            raise Refused("a term of the gated sum is not gate[..., c:c+1] * branch output")
        g = parsed[0][0]
        if any(p[0] is not g for p in parsed):
            raise Refused("the three terms slice different gate tensors")
        columns = sorted(p[1] for p in parsed)
        if columns != [0, 1, 2]:
            raise Refused(f"the terms use gate columns {columns}, not 0, 1, 2 once each")
        branches = [p[2] for p in sorted(parsed, key=lambda p: p[1])]  # o_cmp, o_sel, o_win
        shape = static_shape(branches[0], "branch output")
        if len(shape) != 4:
            raise Refused(f"the branch outputs are {len(shape)}-D, not [B, S, H, Dv]")
        B, S, H, _ = shape
        if any(static_shape(o, "branch output") != shape for o in branches):
            raise Refused("the branch outputs differ in shape")
        if len({value(o).dtype for o in branches}) != 1:
            raise Refused(f"the branch outputs differ in dtype: {', '.join(str(value(o).dtype) for o in branches)}")
        if not value(branches[0]).is_floating_point():
            raise Refused("the branch outputs are not floating point")
        if static_shape(g, "gate") != (B, S, H, 3):
            raise Refused(f"the gate is {tuple(value(g).shape)}, not [B, S, H, 3] = {(B, S, H, 3)}")
        for node in adds + [p[3][0] for p in parsed]:
            if static_shape(node, "gated sum") != shape:
                raise Refused(f"a product or partial sum is {tuple(value(node).shape)}, not the branch outputs' "
                              f"{shape} (broadcasting)")
        chain = list(adds)
        for _, _, _, nodes in parsed:
            mul, *slices = nodes
            only_user(mul, "gated product")
            chain.append(mul)
            for node in slices:
                only_user(node, "gate slice")
            chain.extend(slices)
        if len(g.users) != 3:
            names = ", ".join(op_name(u) or u.op for u in g.users)
            raise Refused(f"the gate is used by {len(g.users)} nodes ({names}); it must stay as it is")
        gate = self.gate_chain(g, B, S, H)
        chain += gate["chain"]
        fakes = {name: value(gate[name]) if gate[name] is not None else None for name in ("w1", "w2")}
        gate_in = value(gate["gate_in"])
        # the op's gate input [B, S, R, m, Din] as a fake (the graph nodes are made in rewrite)
        gate_in = gate_in.unsqueeze(2) if gate_in.dim() == 3 else gate_in
        gate_in = gate_in.unsqueeze(3) if gate_in.dim() == 4 else gate_in
        try:
            backend = choose_backend(gate_in, fakes["w1"], fakes["w2"], value(branches[0]), gate["act"], requested)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(combine_backend={requested!r}): {why}") from None
        why_not = (why_not_triton(gate_in, fakes["w1"], fakes["w2"], value(branches[0]), gate["act"])
                   if requested == "auto" else f"combine_backend={requested!r} in OptimizeConfig")
        return {**gate, "branches": branches, "chain": chain, "backend": backend, "why_not_triton": why_not,
                "dtype": value(top).dtype}

    def gate_chain(self, g: fx.Node, B: int, S: int, H: int) -> dict:
        """Read the gate upwards from g [B, S, H, 3] (module docstring); Refused if it is not one."""
        chain, node, rep, normalize = [], g, 1, None
        while True:
            name = op_name(node)
            shape = static_shape(node, "gate")
            if shape[:2] != (B, S):
                raise Refused(f"a gate tensor is {shape}: its leading dims are not [B, S] = {(B, S)}")
            if is_linear(node) or (normalize is not None and name not in _VIEWS and name != "repeat_interleave"):
                break  # the logits: a Linear's output, or computed elsewhere
            if name in _VIEWS:
                pass
            elif name == "repeat_interleave" and rep == 1:
                repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
                source = arg(node, 0, "input")
                if not isinstance(repeats, int) or not isinstance(dim, int) or arg(node, 3, "output_size") is not None \
                        or not isinstance(source, fx.Node) or len(static_shape(source, "gate")) != 4 \
                        or dim % 4 != 2 or static_shape(source, "gate")[3] != 3:
                    raise Refused("the gate is repeated other than t.repeat_interleave(heads, dim=2) on [B, S, K, 3]")
                rep = repeats
            elif name == "softmax" and normalize is None:
                dim = arg(node, 1, "dim")
                if any(isinstance(x, torch.dtype) for x in (*node.args[2:], node.kwargs.get("dtype"))):
                    raise Refused("the gate softmax has a dtype argument")
                if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1 or shape[-1] != 3:
                    raise Refused(f"the gate softmax runs over dim {dim} of {shape}, not over the three branches "
                                  "(the last dim, of size 3)")
                normalize = "softmax"
            elif name == "sigmoid" and normalize is None:
                normalize = "sigmoid"
            else:
                raise Refused(f"the gate is computed by {name or node.op} ({node.name}), not by a softmax over the "
                              "three branches or a sigmoid")
            if node is not g:
                only_user(node, "gate tensor")
            chain.append(node)
            node = arg(node, 0, "input")
            if not isinstance(node, fx.Node):
                raise Refused("the gate is not computed from a tensor in the graph")
        if normalize is None:
            raise Refused("the gate logits reach the sum without a softmax or sigmoid")
        z = node
        zs = static_shape(z, "gate logits")
        if len(zs) not in (3, 4) or zs[-1] % 3:
            raise Refused(f"the gate logits are {zs}, not [B, S, (R,) 3 * NI]")
        R = 1 if len(zs) == 3 else zs[2]
        NI = zs[-1] // 3
        if R * NI * rep != H:
            raise Refused(f"the gate gives {R} x {NI} triples (x{rep} repeats) for {H} heads")
        shared = f"one triple per {rep} heads" if rep > 1 else "one triple per head"
        plan = {"w1": None, "b1": None, "w2": None, "b2": None, "act": "none", "normalize": normalize,
                "share": shared, "M": 1}
        if not is_linear(z):  # logits computed elsewhere (e.g. a GEMM shared with the projections): read as they are
            if not value(z).is_floating_point():
                raise Refused("the gate logits are not floating point")
            return plan | {"chain": chain, "u": z, "gate_in": z, "gate": "gate logits"}
        only_user(z, "gate logits")
        chain.append(z)
        x, w2, b2 = linear_parts(z)
        act, w1, b1 = "none", None, None
        activation = activation_of(x)
        if activation is not None and is_linear(arg(x, 0, "input")):
            only_user(x, "gate hidden layer")
            hidden = arg(x, 0, "input")
            only_user(hidden, "gate hidden layer")
            chain += [x, hidden]
            x, w1, b1 = linear_parts(hidden)
            act = activation
        u = x
        us = static_shape(u, "gate input")
        mean_of = arg(u, 0, "input")
        dim = arg(u, 1, "dim")
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if op_name(u) == "mean" and isinstance(mean_of, fx.Node) and len(static_shape(mean_of, "gate input")) == 5 \
                and isinstance(dim, int) and dim % 5 == 3 and not arg(u, 2, "keepdim", False) \
                and arg(u, 3, "dtype") is None:
            gate_in, M = mean_of, static_shape(mean_of, "gate input")[3]
        else:
            gate_in, M = u, 1
        if us[:2] != (B, S) or len(us) != len(zs) or (len(us) == 4 and us[2] != R):
            raise Refused(f"the gate input is {us}, not [B, S, (R,) Din] with R = {R} gate rows")
        for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
            if t is not None and (value(t) is None or not value(t).is_floating_point()):
                raise Refused(f"the gate's {name} is not a floating-point tensor")
        din = us[-1]
        mlp = (f"Linear({din}, {value(w1).shape[0]}) -> {act} -> Linear({value(w1).shape[0]}, {3 * NI})"
               if w1 is not None else f"Linear({din}, {3 * NI})")
        source = f"mean of {M} vectors" if M > 1 else "gate input"
        return plan | {"chain": chain, "u": u, "gate_in": gate_in, "M": M, "w1": w1, "b1": b1, "w2": w2, "b2": b2,
                       "act": act, "gate": f"{source} -> {mlp}"}

    def rewrite(self, graph: fx.Graph, top: fx.Node, plan: dict) -> None:
        gate_in = plan["gate_in"]
        while value(gate_in).dim() < 5:  # [B, S, Din] / [B, S, R, Din] -> [B, S, R, m, Din]
            gate_in = call(graph, torch.unsqueeze, gate_in, 2 if value(gate_in).dim() == 3 else 3, anchor=top)
        both = call(graph, torch.ops.nsa.gated_combine, gate_in, plan["w1"], plan["b1"], plan["w2"], plan["b2"],
                    *plan["branches"], plan["act"], plan["normalize"], plan["backend"], anchor=top)
        out = call(graph, operator.getitem, both, 0, anchor=top)
        views = []
        if value(out).dtype != plan["dtype"] and rounded_by_its_users(top, value(out).dtype, views):
            # bf16 autocast: the sum is float32 (the softmax ran in float32) but the next Linear
            # rounds it to bf16 itself: the op's bf16 output gives it the same values, without a
            # cast kernel there and back
            top.replace_all_uses_with(out)
            for node in views:
                refresh_value(node)
        else:
            if value(out).dtype != plan["dtype"]:
                out = call(graph, torch.Tensor.to, out, plan["dtype"], anchor=top)
            top.replace_all_uses_with(out)
        # the sum, products, slices and the gate chain; then the mean if only the gate used it
        erase_replaced(graph, plan["chain"], [plan["u"]])


PASS = GatedCombine()
