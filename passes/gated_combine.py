"""gated_combine: the NSA gate (its MLP and softmax or sigmoid) and the gated sum of the three
branch outputs -> one nsa.gated_combine op that reads each branch output once and writes o once.

Recognized by what it computes, whatever the spelling (models/nsa.py `NSAAttention.gates` and its
combine line; the corpus in tests/corpus/):
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win          # any order, nesting
    o = torch.einsum("bhns,sbhnd->bhnd", g, torch.stack([o_cmp, o_sel, o_win]))  # or its matmul form
    o = (g.unsqueeze(-2) * torch.stack([o_cmp, o_sel, o_win], -1)).sum(-1)
    g_cmp, g_sel, g_win = g.unbind(-1); o = torch.addcmul(o_sel * g_sel[..., None], o_cmp, g_cmp[..., None]) + ...
with branch outputs and result in [B, S, H, Dv], heads-first [B, H, S, Dv] (heads in one dim or
more: [B, G, h, S, Dv]) or packed tokens [N, H, Dv], each in its own, the result also flattened
[B, S, H * Dv]. It reads, top to bottom:

- anchor: the normalized gate T, a softmax over a last dim of 3 or a sigmoid, of [B, S, ...]
  (or [N, ...]) with a last dim of 3 or a view that has a dim of 3;
- region: every node that depends on T through data movement and arithmetic (views, slices,
  unbind, repeat_interleave, repeat, expand, casts, mul, add, addcmul, sum, stack, cat, einsum,
  matmul), up to the first node O that all of T's uses flow into, with nothing in between used
  elsewhere, that reads three tensors besides T (the branch outputs; a stack of them, and a
  view of the stack, count as the region's);
- parameters, by running the region at compile time (nsa_compile/probe.py; float32 where the
  codes stay exact, inputs of stride 0 where they can be: no memory): with index codes for T,
  ones for one branch and zeros for the others, the codes that reach O say which gate column
  weighs that branch and which heads share a triple; the layouts follow from the shapes;
- verify: the region on a random T and random branches (varying over [B, S, H], then over Dv)
  against sum_c G[..., c] * o_c, with G the gate read as the op reads it (triple k of a token
  serves heads k * rep .. (k + 1) * rep - 1). A region is probed once per structure (its
  fingerprint: the same in every layer);
- the gate above T: views of the logits z, then
      z = linear(a, w2, b2)                                   # [B, S, 3 * NI] or [B, S, R, 3 * NI]
      a = act(linear(u, w1, b1))                              # optional hidden layer: silu, relu, gelu (erf)
      u = v.mean(3) with v [B, S, R, m, Din]  |  any u [B, S, R, Din] or [B, S, Din]
  or z as it is when it is not a Linear's output (logits computed elsewhere: projection_rope
  merges the paper's gate Linear into the GEMM of the projections that read the same x, and
  whatever else computes the logits, an unknown activation or another tensor added in, stays);
- symbolic sizes (dynamic shapes: one graph for every length once S changes): the check above
  runs at each assignment of `nsa_compile.sizes.Sizes.probes()` (the sizes Dynamo saw, then every
  size symbol +1 and +19), shapes read as numbers there and the region's size nodes (s27 in a
  view's shape) given them, and must find the same plan at each (heads, columns, layouts, the
  gate MLP; only B and S differ); the branch outputs, the result and the gate input must hold
  the gate's token sizes as sizes (statically_known_true, no guard added) and constants
  elsewhere. The rewrite writes no size: views take B and S from the gate input (sym_size).

A gate cut into chunks of tokens (a model's loop over query chunks, unrolled by Dynamo; issue 17,
tests/corpus/chunked_queries.py): every use of T, through views, is a token slice `gc = g[:, :,
s0:s1]` whose chunk's weighted sum is one of the chunks a cat joins. The whole gate then reads
more than three tensors; instead each chunk gets its own gate, the normalization and views of
the logits' token slice z[:, s0:s1] (inserted before the chunk's slice and checked equal to it
on random logits), and is read as above: one op per chunk with the chunk's logits, the cat
staying (it writes the output once, as eager). All chunks or none (the gate is computed once
for all of them): one chunk refused leaves the graph as it was, with `<whole reason>; read per
chunk of tokens: tokens a..b-1: <why>`. Static sizes only. Why per chunk and not one op over
the cat of each branch's chunks: that copies the three branch outputs once more.

Becomes `torch.ops.nsa.gated_combine(v or u (or z) as [B, S, R, m, Din], w1, b1, w2, b2, o_cmp,
o_sel, o_win, act, normalize, backend)[0]` (nsa_compile/ops/gated_combine.py; the gate input u
rounded to the first Linear's dtype where autocast runs that Linear narrower than u, as autocast
rounds it: the op multiplies in its gate input's dtype; the branches viewed
as [B, S, H, Dv], the result viewed back as O was laid out), cast to O's dtype when that differs
from the branch outputs' (a float32 gate on bf16 branch outputs: CUDA's bf16 autocast runs the
softmax in float32) unless every use of O is the input of a Linear or matmul that rounds it back
to the branch outputs' dtype itself (autocast's next Linear, wo): then the op's output goes there
as it is. The backend is chosen here from the fake tensors (OptimizeConfig.gated_combine_backend) and
written into the graph; `explain` shows which and, for reference, why not triton.

Refuses (graph unchanged), with the reason shown by `explain`, a gate whose
- region reads other than three branch outputs, or weighs them by other than the gate columns
  0, 1, 2 once each (a gate that mixes two branches, a column used twice), or computes anything
  but that weighted sum (a branch scaled, the gate squared: the random probe differs);
- columns are branch-major (feature c * K + k: gate of branch c for triple k) or otherwise not
  the op's triple order; heads that share a triple are not consecutive;
- softmax runs over another dim than the three branches, or with a dtype other than float32;
- values (T, its slices, the products, partial sums, logits, hidden layer) are used elsewhere:
  they would have to stay, the op does not return them;
- branch outputs differ in dtype, or are laid out in none of the ways above for the gate's
  [B, S]; shapes that do not fit (R rows of 3 * NI logits for H heads); a region with tensors
  over MAX_PROBE_ELEMENTS elements (not verified at that size);
- at symbolic sizes: a sum right at one probe size and not at another (the refusal names the
  sizes), branch outputs or a result whose token dims are not provably the gate's (separate
  inputs get separate symbols) or whose other dims are symbols.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile import probe
from nsa_compile.attention_match import Refused, erase_replaced, only_user
from nsa_compile.fx import arg, call, contiguous_if_read_by_layout, op_name, size, value
from nsa_compile.ops.gated_combine import choose_backend, why_not_triton
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes, is_size

KERNEL = "nsa.gated_combine[{backend}] ({gate} -> {norm}, {share}; branch outputs read once{layout}{why})"
# Ops the region between the normalized gate and the combined output may use (data movement,
# casts and the arithmetic of a weighted sum); anything else ends the region.
_REGION_OPS = {
    "getitem", "view", "reshape", "unflatten", "flatten", "unsqueeze", "squeeze", "permute", "transpose",
    "movedim", "contiguous", "clone", "expand", "expand_as", "repeat", "repeat_interleave", "unbind", "split", "chunk",
    "select", "narrow", "to", "type_as", "float", "half", "bfloat16", "double", "mul", "add", "addcmul", "sum",
    "stack", "cat", "concat", "einsum", "matmul", "bmm",
}
# Views between a stack of the branch outputs and the region (an einsum over the stack as a matmul).
_STACK_VIEWS = ("permute", "transpose", "view", "reshape", "unsqueeze", "contiguous", "movedim")
# Views that keep the row-major order of the elements (the logits' order is the op's order).
_FLAT_VIEWS = ("view", "reshape", "unflatten", "flatten")
_DTYPE_KEEPING_VIEWS = ("view", "reshape", "unflatten", "flatten", "transpose", "permute", "contiguous")
# The probes run the region at its real shapes (float32 where the gate's index codes stay exact):
# regions with larger tensors are not verified (the paper layer at 65536 tokens: 2**29 elements).
MAX_PROBE_ELEMENTS = 2**30


def shape_at(node: fx.Node, what: str, sizes: Sizes) -> tuple[int, ...]:
    """The node's shape as numbers under `sizes` (its traced shape in a static graph)."""
    val = value(node)
    if val is None:
        raise Refused(f"the {what} has no recorded tensor value")
    return sizes.shape(val)


def same_sizes(a, b) -> bool:
    """Whether two shapes (ints or SymInts) are equal for every value of their size symbols
    (statically_known_true: no guard is added, an undecided equality is False)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def token_sizes(t: torch.Tensor, n: int) -> tuple:
    """(B, S) of a tensor whose first n dims are tokens: [B, S, ...], or packed [N, ...] read as
    B = 1, S = N (ints, or SymInts in a graph with symbolic sizes)."""
    return tuple(t.shape[:2]) if n == 2 else (1, t.shape[0])



def token_slice(node: fx.Node, x: fx.Node, dim: int, n: int, numbers: dict) -> tuple[int, int] | None:
    """(a, b) where `node` is x[..., a:b, ...] on dim `dim` (of n tokens) only (constant bounds, or
    size nodes of a static graph given by `numbers`, step 1, every other dim whole) or
    x.narrow(dim, a, b - a); else None."""
    number = lambda e: numbers.get(e) if isinstance(e, fx.Node) else e
    if op_name(node) == "narrow" and arg(node, 0, "input") is x:
        d, start, length = arg(node, 1, "dim"), number(arg(node, 2, "start")), number(arg(node, 3, "length"))
        if isinstance(d, int) and d % value(x).dim() == dim and isinstance(start, int) and isinstance(length, int):
            return start, start + length
        return None
    if op_name(node) != "getitem" or node.args[0] is not x or not isinstance(node.args[1], tuple):
        return None
    index = node.args[1]
    whole = slice(None, None, None)
    if (len(index) <= dim or not isinstance(index[dim], slice)
            or any(i != whole for i in index[:dim] + index[dim + 1:])):
        return None
    cut = slice(number(index[dim].start), number(index[dim].stop), index[dim].step)
    if cut.step not in (None, 1) or not all(isinstance(e, (int, type(None))) for e in (cut.start, cut.stop)):
        return None
    a, b, _ = cut.indices(n)
    return (a, b) if a < b else None


def is_three(d) -> bool:
    """A dim that is the constant 3 (a symbolic size is not, whatever its value now)."""
    return isinstance(d, int) and d == 3


def layouts(shape: tuple, lead: tuple) -> list[tuple[str, int]]:
    """(layout, H) for each way a branch output or result of `shape` can hold [B, S, H, Dv] for
    the gate's token dims `lead` ((B, S), or (N,) for packed tokens [N, ...] read as B = 1):
    'tokens-first' [*lead, *heads, Dv] (heads: any dims, H their product; H = 0 when they are
    merged with Dv, [*lead, H * Dv]) or 'heads-first' [B, *heads, S, Dv]."""
    found, n = [], len(lead)
    if tuple(shape[:n]) == lead and len(shape) > n:
        found.append(("tokens-first", math.prod(shape[n:-1]) if len(shape) > n + 1 else 0))
    if n == 2 and len(shape) >= 4 and shape[0] == lead[0] and shape[-2] == lead[1]:
        found.append(("heads-first", math.prod(shape[1:-2])))
    return found


def canonical(t: torch.Tensor, layout: str, B: int, S: int, H: int) -> torch.Tensor:
    """A probe value (or fake) in `layout` as [B, S, H, Dv]."""
    if layout == "heads-first":
        return t.reshape(B, H, S, -1).transpose(1, 2)
    return t.reshape(B, S, H, -1)


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


class GatedCombine(RewritePass):
    name = "gated_combine"
    summary = "gate MLP + softmax/sigmoid + gated sum of the three branch outputs -> nsa.gated_combine, one kernel"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        requested = ctx.config.backend("gated_combine")
        verified: dict = {}  # region fingerprint -> how it mixes the branches (one probe per structure)
        sizes = Sizes.of(graph)
        for gate in list(graph.nodes):
            if gate._erased or not self.is_gate(gate):
                continue
            try:
                plans = [self.check_at_probe_sizes(gate, requested, verified, sizes)]
            except Refused as why:
                try:
                    plans = self.chunked(graph, gate, str(why), requested, verified, sizes)
                except Refused as chunk_why:
                    ctx.refused(gate, str(chunk_why))
                    continue
            for plan in plans:
                self.rewrite(graph, plan)
                why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
                ctx.matched(plan["out"], KERNEL.format(
                    backend=plan["backend"], gate=plan["gate"], norm=plan["normalize"], share=plan["share"],
                    layout=", heads-first" if plan["out_layout"] == "heads-first" else "", why=why))
            cuts = [plan["cut"] for plan in plans if "cut" in plan]
            if cuts:  # chunks: the whole gate, its views and slices, now read by none
                erase_replaced(graph, cuts, [])

    # --- a gate cut into chunks of tokens -------------------------------------------------------

    def chunked(self, graph: fx.Graph, gate: fx.Node, whole: str, requested: str, verified: dict,
                sizes: Sizes) -> list[dict]:
        """A gate whose every use is a token slice of it (through views): a model's loop over query
        chunks (tests/corpus/chunked_queries.py), each chunk's gated sum reading
        `gc = g[:, :, s0:s1]`, the chunks' results concatenated after. Each chunk becomes the gate
        of its own tokens: the normalization and the same views of the logits' token slice
        z[:, s0:s1] (built here, before the chunk's slice; on a random z they must equal the slice
        exactly), then `check` as for any gate, whose op reads that slice as its logits; one plan
        per chunk, each with the slice it replaces ("cut"). Any chunk refused: every node built is
        erased (the graph as it was) and Refused with `whole`, the whole gate's reason, and the
        chunk's. Static sizes, gates over [B, S, ...] only."""
        if sizes.symbolic:  # a loop over chunks is unrolled at static sizes only
            raise Refused(whole)
        found = self.token_chunks(gate, sizes)
        if found is None:
            raise Refused(whole)
        views, cuts, dims = found
        z = arg(gate, 0, "input")
        made, replaced, plans = [], [], []  # the nodes built; (slice, its chunk gate's view)
        try:
            for cut, (a, b) in cuts:
                gate_c, end = self.chunk_gate(graph, gate, z, views, dims, cut, a, b, made, sizes)
                cut.replace_all_uses_with(end)
                replaced.append((cut, end))
                try:
                    plans.append(self.check(gate_c, requested, verified, sizes) | {"cut": cut})
                except Refused as why:
                    raise Refused(f"{whole}; read per chunk of tokens: tokens {a}..{b - 1}: {why}") from None
        except Refused:
            for cut, end in replaced:
                end.replace_all_uses_with(cut)
            for node in reversed(made):
                graph.erase_node(node)
            raise
        return plans

    @staticmethod
    def token_chunks(gate: fx.Node, sizes: Sizes) -> tuple[list[fx.Node], list, list[int]] | None:
        """(views, cuts, dims): the gate [B, S, ...] (token dim 1) followed by a chain of views, each
        the only user of the one before (reshape / view keeping the token dim whole, transpose,
        permute), whose result is used only by token slices `x[:, :, a:b]` (any dim, constant
        bounds, the other dims whole) or `x.narrow(dim, a, n)`; cuts: (slice node, (a, b)) in graph
        order; dims: the token dim after each view. None for any other gate. Static sizes
        (`sizes`: their numbers)."""
        val = value(gate)
        if val is None or val.dim() < 3:
            return None
        views, dims, node, dim = [], [], gate, 1
        while len(node.users) == 1:
            user = next(iter(node.users))
            if arg(user, 0, "input") is not node or value(user) is None:
                break
            before, after, name = sizes.shape(value(node)), sizes.shape(value(user)), op_name(user)
            if name in ("view", "reshape"):
                lead = math.prod(before[:dim])
                at = [i for i in range(len(after)) if math.prod(after[:i]) == lead and after[i] == before[dim]]
                if not at:
                    return None
                dim = at[0]
            elif name in ("transpose", "swapaxes") and len(user.args) == 3 and not user.kwargs:
                pair = [d % len(before) for d in user.args[1:3]]
                dim = pair[1] if dim == pair[0] else pair[0] if dim == pair[1] else dim
            elif name == "permute" and len(user.args) >= 2 and not user.kwargs:
                order = user.args[1] if isinstance(user.args[1], (list, tuple)) else user.args[1:]
                dim = [d % len(before) for d in order].index(dim)
            else:
                break
            views.append(user)
            dims.append(dim)
            node = user
        cuts = []
        numbers = sizes.size_nodes()
        for user in node.users:
            bounds = token_slice(user, node, dim, sizes.int(value(node).shape[dim]), numbers)
            if bounds is None:
                return None
            cuts.append((user, bounds))
        return (views, cuts, dims) if cuts else None

    def chunk_gate(self, graph: fx.Graph, gate: fx.Node, z: fx.Node, views: list[fx.Node], dims: list[int],
                   cut: fx.Node, a: int, b: int, made: list, sizes: Sizes) -> tuple[fx.Node, fx.Node]:
        """(the gate of tokens a..b-1, the last of its views): z[:, a:b], normalized as `gate` is,
        then `views` with b - a tokens, inserted before `cut` and appended to `made`; Refused
        unless the views' result equals `cut` on a random z."""
        zv = value(z)
        if zv is None or zv.dim() != value(gate).dim():
            raise Refused("the gate is not computed from logits of its own shape")
        node = call(graph, operator.getitem, z, (slice(None), slice(a, b)), anchor=cut)
        made.append(node)
        if op_name(gate) == "softmax":
            node = call(graph, torch.softmax, node, arg(gate, 1, "dim"), anchor=cut)
        else:
            node = call(graph, torch.sigmoid, node, anchor=cut)
        made.append(node)
        gate_c = node
        for view, dim in zip(views, dims):
            name = op_name(view)
            if name in ("view", "reshape"):
                shape = list(sizes.shape(value(view)))
                shape[dim] = b - a
                node = call(graph, torch.reshape, node, shape, anchor=cut)
            elif name in ("transpose", "swapaxes"):
                node = call(graph, torch.transpose, node, *view.args[1:3], anchor=cut)
            else:
                order = view.args[1] if isinstance(view.args[1], (list, tuple)) else view.args[1:]
                node = call(graph, torch.permute, node, list(order), anchor=cut)
            made.append(node)
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(sizes.shape(zv), generator=gen, dtype=torch.float64, device="cpu").to(zv.device)
        numbers = sizes.size_nodes()
        want = probe.run([gate, *views, cut], {**numbers, z: logits}, cut, "the gate's chunk")
        got = probe.run(made[-len(views) - 2:], {**numbers, z: logits}, node, "the gate's chunk")
        if want.shape != got.shape or not torch.equal(want, got):
            raise Refused(f"the gate of tokens {a}..{b - 1} computed from z[:, {a}:{b}] differs from its slice "
                          f"{cut.name}")
        return gate_c, node

    # --- anchor ---------------------------------------------------------------------------------
    # --- anchor ---------------------------------------------------------------------------------

    @staticmethod
    def is_gate(node: fx.Node) -> bool:
        """A softmax or sigmoid whose result has a last dim of 3, or is viewed with a dim of 3
        after its first (a triple per head, or three branches of heads)."""
        if op_name(node) not in ("softmax", "sigmoid") or value(node) is None or value(node).dim() < 2:
            return False
        if is_three(value(node).shape[-1]):
            return True
        return any(op_name(u) in _FLAT_VIEWS and value(u) is not None and any(map(is_three, value(u).shape[1:]))
                   for u in node.users)

    # Plan entries that are numbers of the probe sizes (the token dims); all others must agree.
    _SIZED = ("lead", "B", "S")

    def check_at_probe_sizes(self, gate: fx.Node, requested: str, verified: dict, sizes: Sizes) -> dict:
        """`check` at every probe assignment of the graph's sizes (once for a static graph): in a
        graph with symbolic sizes the region must be the same weighted sum, read the same way
        (heads, columns, layouts, the gate MLP), at each, and its token dims sizes the op can take
        from the gate input; Refused naming the sizes where it is not."""
        plans = []
        for probe_sizes in sizes.probes():
            try:
                plans.append(self.check(gate, requested, verified, probe_sizes))
            except Refused as why:
                raise (Refused(f"at {probe_sizes.describe()}: {why}") if sizes.symbolic else why) from None
        plan = plans[0]
        for probe_sizes, other in zip(sizes.probes()[1:], plans[1:]):
            differ = [k for k in plan if k not in self._SIZED and plan[k] != other[k]]
            if differ or len(plan["lead"]) != len(other["lead"]):
                what = ", ".join(differ) or "token dims"
                raise Refused(f"the gated sum is read differently at {sizes.describe()} and at "
                              f"{probe_sizes.describe()} ({what})")
        if sizes.symbolic:
            self.check_symbolic_tokens(plan)
        return plan

    @staticmethod
    def check_symbolic_tokens(plan: dict) -> None:
        """In a graph with symbolic sizes: the branch outputs, the result and the gate input have
        the gate's token dims, as sizes (equal for every value of the symbols, not only at the
        probes), and every other dim is a constant; Refused where not. The rewrite then takes the
        token dims from the gate input (`token_sizes`)."""
        n = len(plan["lead"])
        tokens = tuple(value(plan["gate_node"]).shape[:n])
        if not same_sizes(value(plan["gate_in"]).shape[:n], tokens):
            raise Refused(f"the gate input {tuple(value(plan['gate_in']).shape)} does not have the gate's token "
                          f"sizes {tokens} for every size (symbolic sizes)")
        named = [(b, lay, "branch output") for b, lay in zip(plan["branches"], plan["branch_layouts"])]
        for node, layout, what in [*named, (plan["out"], plan["out_layout"], "combined output")]:
            shape = tuple(value(node).shape)
            where = [0, len(shape) - 2] if layout == "heads-first" else list(range(n))
            got = tuple(shape[i] for i in where)
            rest = [d for i, d in enumerate(shape) if i not in where]
            if not same_sizes(got, tokens) or not all(isinstance(d, int) for d in rest):
                raise Refused(f"the {what} {shape} does not hold the gate's token sizes {tokens} in its token dims "
                              "and constants elsewhere, for every size (symbolic sizes)")

    def check(self, gate: fx.Node, requested: str, verified: dict, sizes: Sizes) -> dict:
        """The plan for the rewrite of the gate and the region after it (module docstring), or
        Refused; shapes read as numbers under `sizes` (one probe assignment)."""
        shape = shape_at(gate, "gate", sizes)
        if op_name(gate) == "softmax":
            dim = arg(gate, 1, "dim")
            dtype = next((x for x in (*gate.args[2:], gate.kwargs.get("dtype")) if isinstance(x, torch.dtype)), None)
            if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1 or shape[-1] != 3:
                raise Refused(f"the gate softmax runs over dim {dim} of {shape}, not over the three branches "
                              "(the last dim, of size 3)")
            if dtype not in (None, torch.float32):
                raise Refused(f"the gate softmax computes in {dtype}; the op computes it in float32")
        # the gate's token dims: [B, S, ...], or packed tokens [N, 3K] / [N, K, 3]
        leads = [shape[:2]] if len(shape) > 3 or (len(shape) == 3 and shape[-1] != 3) else \
            [shape[:2], shape[:1]] if len(shape) == 3 else [shape[:1]]
        nodes, out, branches = self.region(gate, leads, sizes)
        mix = self.mixing(gate, nodes, out, branches, leads, verified, sizes)
        plan = self.read_gate(gate, mix["lead"], mix["H"], mix["K"], sizes)
        branch_fakes = [value(b) for b in mix["branches"]]
        if len({b.dtype for b in branch_fakes}) != 1:
            raise Refused(f"the branch outputs differ in dtype: {', '.join(str(b.dtype) for b in branch_fakes)}")
        if not branch_fakes[0].is_floating_point():
            raise Refused("the branch outputs are not floating point")
        gate_in = value(plan["gate_in"])
        if plan["gate_cast"] is not None:
            with gate_in.fake_mode:
                gate_in = gate_in.to(plan["gate_cast"])
        gate_in = self.gate_input(gate_in, mix["lead"])  # the op's [B, S, R, m, Din], as a fake
        w1, w2 = (value(plan[k]) if plan[k] is not None else None for k in ("w1", "w2"))
        B, S = token_sizes(value(gate), len(mix["lead"]))
        o_like = branch_fakes[0].new_empty((B, S, mix["H"], mix["Dv"]))  # [B, S, H, Dv] as the op reads it
        try:
            backend = choose_backend(gate_in, w1, w2, o_like, plan["act"], requested)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(gated_combine_backend={requested!r}): {why}") from None
        why_not = (why_not_triton(gate_in, w1, w2, o_like, plan["act"])
                   if requested == "auto" else f"gated_combine_backend={requested!r} in OptimizeConfig")
        return {**plan, **mix, "out": out, "dead": nodes + plan["chain"], "backend": backend,
                "why_not_triton": why_not, "dtype": value(out).dtype, "gate_node": gate}

    @staticmethod
    def gate_input(t, lead: tuple, unsqueeze=torch.unsqueeze):
        """The gate input [*lead, (R, (m,)) Din] as the op's [B, S, R, m, Din] (unsqueeze: the
        function that adds a dim, torch.unsqueeze or one that inserts a graph node)."""
        if len(lead) == 1:  # packed tokens: B = 1
            t = unsqueeze(t, 0)
        dims = (value(t) if isinstance(t, fx.Node) else t).dim()
        if dims == 3:
            t, dims = unsqueeze(t, 2), 4
        return unsqueeze(t, 3) if dims == 4 else t

    # --- region ---------------------------------------------------------------------------------

    def region(self, gate: fx.Node, leads: list[tuple], sizes: Sizes) -> tuple[list[fx.Node], fx.Node, list[fx.Node]]:
        """(the region's nodes after the gate in graph order (with the stacks of branch outputs it
        absorbed), its result O, the branch outputs it reads), or Refused. Sizes the region reads
        (s27 in a view's shape) are not among the tensors it reads."""
        reach = {gate}
        for node in self.after(gate):
            if op_name(node) in _REGION_OPS and node.op in ("call_function", "call_method") and \
                    any(i in reach for i in node.all_input_nodes):
                reach.add(node)
        order = [n for n in self.after(gate) if n in reach]
        uses = set(gate.users)
        escaped = sorted({u.name for u in uses if u not in reach})
        if escaped:
            raise Refused(f"the gate is also used by {', '.join(escaped)} (not part of a weighted sum); "
                          "it must stay as it is")
        closed = []  # nodes that every use of the gate flows into, with nothing between used elsewhere
        for node in order:
            ancestors = self.ancestors_within(node, reach)
            if value(node) is not None and uses <= ancestors and \
                    all(u in ancestors for n in ancestors if n is not node for u in n.users):
                closed.append((node, ancestors))
        branches = []
        for out, inside in closed:  # the first of a result's shape reading three tensors besides the gate, else the last
            nodes = [n for n in order if n in inside and n is not gate]
            reads = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes
                                       if i not in inside and not is_size(i)))
            absorbed, branches = self.stacked(reads, inside)
            if len(branches) == 3 and any(self.fits(out, branches, lead, sizes) for lead in leads):
                break
        # the region's values used outside it, but for the last (the result)
        label = lambda u: u.name if op_name(u) in (None, u.name) else f"{u.name} ({op_name(u)})"
        leaks = [(n, [label(u) for u in n.users if u not in reach]) for n in order]
        leaks = [(n, users) for n, users in leaks if users][:-1]
        if len(branches) < 3 and leaks:
            where = "; ".join(f"{n.name} ({op_name(n)}) by {', '.join(users)}" for n, users in leaks[:2])
            raise Refused(f"values of the gated sum are also used elsewhere: {where}; they would have to stay")
        if len(branches) != 3 or any(value(b) is None for b in branches):
            names = ", ".join(b.name for b in branches)
            raise Refused(f"the weighted sum reads {len(branches)} tensors besides the gate ({names}); the op mixes "
                          "exactly three branch outputs")
        position = {n: i for i, n in enumerate(gate.graph.nodes)}
        return sorted(nodes + absorbed, key=position.__getitem__), out, branches

    @staticmethod
    def stacked(reads: list[fx.Node], inside: set) -> tuple[list[fx.Node], list[fx.Node]]:
        """(nodes to absorb, the branch outputs): a stack (or cat) of the branch outputs that only
        the region reads, and the views of it the region reads (a permute, when canonicalize
        spelled an einsum over the stack as a matmul), are part of the region."""
        absorbed, branches = [], []
        for node in reads:
            chain = [node]
            while op_name(chain[-1]) in _STACK_VIEWS and isinstance(arg(chain[-1], 0, "input"), fx.Node):
                chain.append(arg(chain[-1], 0, "input"))
            top = chain[-1]
            users_inside = all(u in inside or u in chain for n in chain for u in n.users)
            if op_name(top) in ("stack", "cat") and users_inside:
                absorbed += chain
                branches += top.all_input_nodes
            else:
                branches.append(node)
        return absorbed, list(dict.fromkeys(branches))

    @staticmethod
    def fits(out: fx.Node, branches: list[fx.Node], lead: tuple, sizes: Sizes) -> bool:
        """Whether the result and the branches can all hold [B, S, H, Dv] with one H (0: any)."""
        if any(value(n) is None for n in (out, *branches)):
            return False
        heads = [{h for _, h in layouts(sizes.shape(value(n)), lead)} for n in (out, *branches)]
        if not all(heads):
            return False
        known = [h - {0} for h in heads if h - {0}]
        return not known or bool(set.intersection(*known))

    @staticmethod
    def after(node: fx.Node):
        node = node.next
        while node.op != "output":
            yield node
            node = node.next

    @staticmethod
    def ancestors_within(node: fx.Node, inside: set) -> set:
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(i for i in n.all_input_nodes if i in inside)
        return seen

    # --- parameters and verification -------------------------------------------------------------

    def mixing(self, gate, nodes, out, branches, leads: list[tuple], verified: dict, sizes: Sizes) -> dict:
        """How the region mixes the branches: the gate's token dims, the branches in the order of
        the gate columns that weigh them, their layouts and the result's, H, K and Dv; or Refused.
        Probed once per region structure (one per layer is the same) and probe sizes."""
        shapes = [shape_at(b, "branch output", sizes) for b in branches]
        out_shape = shape_at(out, "combined output", sizes)
        key = (probe.fingerprint(nodes, [gate, *branches]), sizes.shape(value(gate)), tuple(shapes), out_shape)
        if key not in verified:
            try:
                verified[key] = self.probe(gate, nodes, out, branches, leads, shapes, out_shape, sizes)
            except Refused as why:
                verified[key] = why
        if isinstance(verified[key], Refused):
            raise verified[key]
        found = dict(verified[key])
        order = found.pop("order")
        return found | {"branches": [branches[j] for j in order]}

    def probe(self, gate, nodes, out, branches, leads, shapes, out_shape, sizes: Sizes) -> dict:
        """`mixing` at the shapes of one probe assignment `sizes` (the region's size nodes read as
        its numbers)."""
        largest = max(math.prod(s) for s in [out_shape, *shapes])
        if largest > MAX_PROBE_ELEMENTS:
            raise Refused(f"the weighted sum has {largest:,} elements per tensor, over the cap of "
                          f"{MAX_PROBE_ELEMENTS:,} for its probe: not verified at this size yet")
        first, numbers = None, sizes.size_nodes() if sizes.symbolic else {}
        for lead in leads:
            B, S = lead if len(lead) == 2 else (1, lead[0])
            n_gate = math.prod(sizes.shape(value(gate)))
            options = [layouts(s, lead) for s in shapes]
            if n_gate % (B * S * 3) or not all(options):
                continue
            K = n_gate // (B * S * 3)  # gate triples per token
            known = [found for found in ({h for _, h in opts if h} for opts in options) if found]
            heads = set.intersection(*known) if known else {K}  # H from the branches, else one triple per head
            for H in sorted(heads):
                if H % K:
                    first = first or Refused(f"the gate has {K} triples per token for {H} heads")
                    continue
                dims = (B, S, H, K)
                for out_layout, h in layouts(out_shape, lead):
                    if h not in (0, H):
                        continue
                    try:
                        columns = [self.column(gate, nodes, out, branches, j, out_layout, dims, sizes, numbers)
                                   for j in range(3)]
                    except Refused as why:
                        first = first or why
                        continue
                    if sorted(columns) != [0, 1, 2]:
                        raise Refused(f"the branches are weighed by gate columns {columns}, not 0, 1, 2 once each")
                    found = self.verify(gate, nodes, out, branches, columns, options, out_layout, dims, sizes,
                                        numbers)
                    if found is not None:
                        order = sorted(range(3), key=columns.__getitem__)  # the branches by gate column
                        return {"lead": lead, "B": B, "S": S, "H": H, "K": K, "Dv": math.prod(shapes[0]) // (B * S * H),
                                "order": order,
                                "branch_layouts": [found[j] for j in order], "out_layout": out_layout}
                    first = first or Refused("the region is not the weighted sum of the branch outputs by the gate "
                                             "columns (checked on random values)")
        raise first or Refused(f"the branch outputs {shapes} and the result {out_shape} are not [B, S, H, Dv] or "
                               f"[B, H, S, Dv] (or packed [N, H, Dv]) for the gate {sizes.shape(value(gate))}")

    @staticmethod
    def probe_dtype(n_gate: int) -> torch.dtype:
        """float32 where the gate's index codes (n_gate of them) stay exact in it (half the memory),
        else float64."""
        return torch.float32 if n_gate < probe.EXACT_BELOW[torch.float32] else torch.float64

    def column(self, gate, nodes, out, branches, j: int, out_layout: str, dims: tuple, sizes: Sizes,
               numbers: dict) -> int:
        """The gate column that weighs branch j: the region run on index codes for the gate, ones
        for branch j and zeros for the others (stride-0 views: no memory); the codes reaching O
        name the gate entries. Shapes are those under `sizes`, the size nodes' `numbers` given."""
        B, S, H, K = dims
        gate_shape = sizes.shape(value(gate))
        n_gate = math.prod(gate_shape)
        device, dtype = value(gate).device, self.probe_dtype(n_gate)
        env = {**numbers, gate: probe.index_codes(gate_shape, device, dtype)}
        for i, b in enumerate(branches):
            env[b] = torch.full((), 1.0 if i == j else 0.0, dtype=dtype, device=device).expand(sizes.shape(value(b)))
        got = probe.run(nodes, env, out, "the weighted sum", dtype)
        got = canonical(got, out_layout, B, S, H)  # [B, S, H, Dv]
        index = probe.decode(got, n_gate)
        if index is None or not bool((index == index[..., :1]).all()):
            raise Refused(f"branch {branches[j].name} is not weighed by one gate entry per head and token")
        index = index[..., 0]  # [B, S, H]: flat index of the gate entry
        per_token = 3 * K
        b = torch.arange(B, device=device)[:, None, None]
        s = torch.arange(S, device=device)[None, :, None]
        if not bool((index // per_token == b * S + s).all()):
            raise Refused(f"branch {branches[j].name} of a token is weighed by another token's gate")
        r = index % per_token  # [B, S, H]: the entry within the token
        if not bool((r == r[:1, :1]).all()):
            raise Refused("the gate entries weighing a head differ between tokens")
        r = r[0, 0]  # [H]
        rep = H // K
        triple = torch.arange(H, device=device) // rep
        if bool((r % 3 == r[0] % 3).all()) and bool((r // 3 == triple).all()):
            return int(r[0]) % 3
        if bool((r // K == r[0] // K).all()) and bool((r % K == triple).all()):
            raise Refused("the gate's columns are branch-major (entry c * K + k: branch c of triple k); the op "
                          "reads triples (entry 3 * k + c)")
        raise Refused(f"the gate entries weighing branch {branches[j].name} are {r.tolist()} over the heads, not "
                      f"one column of consecutive triples shared by {rep} heads each")

    def verify(self, gate, nodes, out, branches, columns, options, out_layout: str, dims: tuple,
               sizes: Sizes, numbers: dict) -> list[str] | None:
        """The branches' layouts under which the region computes sum_c G[..., c] * o_c for a random
        gate, on two random probes of the branches made of stride-0 views (no memory): one that
        varies over [B, S, H] and one over Dv (None: under no layouts)."""
        B, S, H, K = dims
        gate_shape = sizes.shape(value(gate))
        device, dtype = value(gate).device, self.probe_dtype(math.prod(gate_shape))
        gen = torch.Generator(device=device).manual_seed(0)
        rand = lambda *shape: torch.rand(shape, generator=gen, device=device, dtype=dtype) * 2 - 1
        t = rand(*gate_shape)
        g = t.reshape(B, S, K, 3).repeat_interleave(H // K, dim=2)  # [B, S, H, 3]
        Dv = math.prod(sizes.shape(value(branches[0]))) // (B * S * H)
        probes = [[rand(B, S, H, 1).expand(B, S, H, Dv) for _ in branches],
                  [rand(1, 1, 1, Dv).expand(B, S, H, Dv) for _ in branches]]
        choices = [[lay for lay, h in opts if h in (0, H)] for opts in options]
        for combo in ((a, b, c) for a in choices[0] for b in choices[1] for c in choices[2]):
            for canon in probes:  # each branch in its layout, from [B, S, H, Dv]
                env = {**numbers, gate: t}
                for b, lay, o in zip(branches, combo, canon):
                    env[b] = (o.transpose(1, 2) if lay == "heads-first" else o).reshape(sizes.shape(value(b)))
                got = canonical(probe.run(nodes, env, out, "the weighted sum", dtype), out_layout, B, S, H)
                want = sum(g[..., col, None] * o for col, o in zip(columns, canon))
                if want.shape != got.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    break
            else:
                return list(combo)
        return None

    # --- the gate above T -------------------------------------------------------------------------

    def read_gate(self, gate: fx.Node, lead: tuple, H: int, K: int, sizes: Sizes) -> dict:
        """Read the gate upwards from its softmax or sigmoid (module docstring); Refused if the
        logits or their MLP do not fit the op. Shapes are read under `sizes`."""
        normalize = op_name(gate)
        chain, z, n = [gate], arg(gate, 0, "input"), len(lead)
        # up through views of the logits that keep the token dims
        while isinstance(z, fx.Node) and op_name(z) in _FLAT_VIEWS and isinstance(arg(z, 0, "input"), fx.Node) and \
                value(arg(z, 0, "input")) is not None and sizes.shape(value(arg(z, 0, "input")))[:n] == lead:
            only_user(z, "gate logits")
            chain.append(z)
            z = arg(z, 0, "input")
        if not isinstance(z, fx.Node):
            raise Refused("the gate is not computed from a tensor in the graph")
        zs = shape_at(z, "gate logits", sizes)
        if zs[:n] != lead or len(zs) not in (n + 1, n + 2) or zs[-1] % 3:
            raise Refused(f"the gate logits are {zs}, not [*tokens, (R,) 3 * NI] with tokens {lead}")
        R = 1 if len(zs) == n + 1 else zs[-2]
        NI = zs[-1] // 3
        rep = H // K
        share = f"one triple per {rep} heads" if rep > 1 else "one triple per head"
        plan = {"w1": None, "b1": None, "w2": None, "b2": None, "act": "none", "normalize": normalize,
                "share": share, "M": 1}
        if not is_linear(z):  # logits computed elsewhere (e.g. a GEMM shared with the projections): read as they are
            if not value(z).is_floating_point():
                raise Refused("the gate logits are not floating point")
            return plan | {"chain": chain, "u": z, "gate_in": z, "gate": "gate logits", "gate_cast": None}
        only_user(z, "gate logits")
        chain.append(z)
        x, w2, b2 = linear_parts(z)
        act, w1, b1 = "none", None, None
        first = z  # the Linear that reads the gate input
        activation = activation_of(x)
        if activation is not None and is_linear(arg(x, 0, "input")):
            only_user(x, "gate hidden layer")
            hidden = arg(x, 0, "input")
            only_user(hidden, "gate hidden layer")
            chain += [x, hidden]
            x, w1, b1 = linear_parts(hidden)
            act, first = activation, hidden
        u = x
        us = shape_at(u, "gate input", sizes)
        mean_of = arg(u, 0, "input")
        dim = arg(u, 1, "dim")
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if op_name(u) == "mean" and isinstance(mean_of, fx.Node) and len(shape_at(mean_of, "gate input", sizes)) == n + 3 \
                and isinstance(dim, int) and dim % (n + 3) == n + 1 and not arg(u, 2, "keepdim", False) \
                and arg(u, 3, "dtype") is None:
            gate_in, M = mean_of, shape_at(mean_of, "gate input", sizes)[n + 1]
        else:
            gate_in, M = u, 1
        if us[:n] != lead or len(us) != len(zs) or (len(us) == n + 2 and us[n] != R):
            raise Refused(f"the gate input is {us}, not [*tokens, (R,) Din] with tokens {lead} and R = {R} gate rows")
        for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
            if t is not None and (value(t) is None or not value(t).is_floating_point()):
                raise Refused(f"the gate's {name} is not a floating-point tensor")
        din = us[-1]
        mlp = (f"Linear({din}, {value(w1).shape[0]}) -> {act} -> Linear({value(w1).shape[0]}, {3 * NI})"
               if w1 is not None else f"Linear({din}, {3 * NI})")
        source = f"mean of {M} vectors" if M > 1 else "gate input"
        # Under autocast the Linear computes in a narrower dtype than its input's (eager F.linear
        # needs equal dtypes, so a difference is autocast's): it rounds the input to that dtype
        # first. The op then gets the input so rounded, as the Linear did, and multiplies in that
        # dtype (it casts the weights to the gate input's dtype, as autocast does); given the wider
        # input it would run the GEMM in float32, slower and not what eager computed. With a mean
        # (M > 1) the Linear rounds the mean, not its inputs: then the input stays as it is.
        cast = value(first).dtype if M == 1 and value(first).dtype.itemsize < value(u).dtype.itemsize else None
        if cast is not None:
            source += f" rounded to {str(cast).removeprefix('torch.')} (autocast's Linear)"
        return plan | {"chain": chain, "u": u, "gate_in": gate_in, "M": M, "w1": w1, "b1": b1, "w2": w2, "b2": b2,
                       "act": act, "gate": f"{source} -> {mlp}", "gate_cast": cast}

    # --- replacement ------------------------------------------------------------------------------

    def rewrite(self, graph: fx.Graph, plan: dict) -> None:
        out = plan["out"]
        H, Dv, n = plan["H"], plan["Dv"], len(plan["lead"])
        # the token sizes B, S: as sizes of the fakes (SymInts where symbolic) and as graph values
        # (ints, or sym_size nodes of the gate input made when first needed)
        tokens = token_sizes(value(plan["gate_in"]), n)
        made = {}

        def token(i: int):
            if i not in made:
                made[i] = 1 if n == 1 and i == 0 else size(graph, plan["gate_in"], i + n - 2, anchor=out)
            return made[i]

        def graph_shape(shape) -> list:
            """A shape of constants and token sizes as reshape's arguments (check_symbolic_tokens)."""
            return [d if isinstance(d, int) else token(next(i for i in (0, 1) if statically_known_true(d == tokens[i])))
                    for d in shape]

        gate_in = plan["gate_in"]
        if plan["gate_cast"] is not None:
            gate_in = call(graph, torch.Tensor.to, gate_in, plan["gate_cast"], anchor=out)
        gate_in = self.gate_input(gate_in, plan["lead"], lambda t, dim: call(graph, torch.unsqueeze, t, dim, anchor=out))
        branches = []
        for b, layout in zip(plan["branches"], plan["branch_layouts"]):  # as [B, S, H, Dv] views
            first = (tokens[0], H, tokens[1], Dv) if layout == "heads-first" else (*tokens, H, Dv)
            if not same_sizes(value(b).shape[:3], first[:3]) or value(b).dim() != 4:
                b = call(graph, torch.reshape, b, graph_shape(first), anchor=out)
            branches.append(call(graph, torch.transpose, b, 1, 2, anchor=out) if layout == "heads-first" else b)
        both = call(graph, torch.ops.nsa.gated_combine, gate_in, plan["w1"], plan["b1"], plan["w2"], plan["b2"],
                    *branches, plan["act"], plan["normalize"], plan["backend"], anchor=out)
        new = call(graph, operator.getitem, both, 0, anchor=out)  # [B, S, H, Dv]
        if plan["out_layout"] == "heads-first":
            new = call(graph, torch.transpose, new, 1, 2, anchor=out)
        if not same_sizes(value(new).shape, value(out).shape):
            new = call(graph, torch.reshape, new, graph_shape(value(out).shape), anchor=out)
        new = contiguous_if_read_by_layout(graph, new, out, out)
        views = []
        if value(new).dtype != plan["dtype"] and rounded_by_its_users(out, value(new).dtype, views):
            # bf16 autocast: O is float32 (the softmax ran in float32) but the next Linear rounds
            # it to bf16 itself: the op's bf16 output gives it the same values, without a cast
            # kernel there and back
            out.replace_all_uses_with(new)
            for node in views:
                refresh_value(node)
        else:
            if value(new).dtype != plan["dtype"]:
                new = call(graph, torch.Tensor.to, new, plan["dtype"], anchor=out)
            out.replace_all_uses_with(new)
        order = {node: i for i, node in enumerate(graph.nodes)}
        # the region, the stacks it read and the gate chain, users first; then the mean if only the gate used it
        erase_replaced(graph, sorted(set(plan["dead"]), key=order.__getitem__, reverse=True), [plan["u"]])


PASS = GatedCombine()
