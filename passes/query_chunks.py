"""query_chunks: one call of each NSA op where the model loops over chunks of queries.

A model that bounds its memory by a Python loop over query chunks (tests/corpus/chunked_queries.py)
is unrolled by Dynamo into one softmax per branch and chunk, and the branch passes rewrite each
into its own op call with the chunk's q_offset. After them, this pass matches, per op
(compressed_attention, select_blocks, selected_attention, window_attention, in that order),

    for each chunk [s0, s1) of rows 0..S of one tensor q, in order, without gap or overlap:
        out_i = nsa.<op>(q[:, :, s0:s1], k, v, ..., q_offset=s0)

where every other argument is the same for every chunk, except
- the per-query ones (select_blocks' lse, selected_attention's block_idx): rows [s0, s1) of one
  tensor, as the previous op's merged outputs are once it is rewritten;
- window_attention's k and v, which may be the prefix k[:, :, :e], e >= s1, of the whole
  (the op reads k as the sequence's first tokens; keys after the chunk's last query are hidden);
- the backend, which is chosen again for the whole call.
"The same" is the same node, or the same pure computation (casts, views, getitem of constants)
of the same nodes: CUDA autocast's cast of k gets one copy per chunk.

Becomes
    out = nsa.<op>(q, k, v, ...)                       # q_offset 0: the chunks' rows in one call
    out_i = out[:, :, s0:s1]                           # (each output of a tuple alike)
Each op computes every query row from that row, the keys and its own per-query arguments, with
the same keys for row s0 + r of the whole as for row r of chunk i: every output element is the
same computation. Gradients of k and v are summed over all queries in one kernel instead of one
sum per chunk added afterwards (another order of the same float sums).

Refuses (graph unchanged), with the reason in explain, a set of two or more calls over rows of one
tensor that are not such chunks: rows not covered, chunks overlapping, q_offset not the chunk's
start, other arguments that differ, an input (or what its casts and views read) written in place
between the first call and the last (the same node, another value), an input the merged call
would read before the graph computes it. Calls with packed documents (pos) or rows at symbolic
sizes are not taken.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.fx import call, op_name, value
from nsa_compile.ops import registry
from nsa_compile.rewrite import PassContext, RewritePass

from . import compressed_attention as cmp

# per op: the arguments that hold one row per query (sliced like q), in merge order
PER_QUERY = {
    "compressed_attention": ("q",),
    "select_blocks": ("q", "lse"),
    "selected_attention": ("q", "block_idx"),
    "window_attention": ("q",),
}
# the arguments read as the sequence's first tokens (a prefix slice reaching the chunk's end is the whole)
PREFIX_ANY = {"window_attention": ("k", "v")}
ROW_DIM = 2  # q [B, H, S, D], lse [B, H, S], block_idx [B, G, S, n], outputs alike
# pure computations: the same one of the same inputs is the same value (no in-place write may follow);
# ELEMENTWISE keep every element where it was (a prefix slice below them is a prefix slice of them)
ELEMENTWISE = {"to", "float", "half", "bfloat16", "double", "type", "contiguous", "clone", "detach", "_to_copy"}
PURE = ELEMENTWISE | {"transpose", "permute", "movedim", "view", "reshape", "unsqueeze", "squeeze", "flatten",
                      "unflatten", "expand", "getitem"}
KERNEL = "one nsa.{op}[{backend}] call for {n} chunks of queries ({rows} rows of {base})"


class NotChunks(Exception):
    """Why a set of calls over rows of one tensor is not merged (explain shows it)."""


def _static(n) -> int | None:
    """n as an int: an int, or a SymInt a guard fixed to one number (Dynamo's graph after a length
    change of a model that compiles each length alone); None for a symbolic size."""
    if isinstance(n, torch.SymInt) and n.node.expr.is_number:
        return int(n.node.expr)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def row_slice(node) -> tuple[fx.Node, int, int] | None:
    """(base, s0, s1) where node is rows [s0, s1) of base's dim 2, every other dim whole
    (`cmp.sequence_cut`: base[:, :, s0:s1], base[..., s0:s1, :], base.narrow(2, s0, n)), with a
    start that is a number (a node of the graph by the number it holds: min(s0 + chunk, S) after a
    recompile), s1 = s0 + node's own rows; else None."""
    if not isinstance(node, fx.Node) or value(node) is None:
        return None
    cut = cmp.sequence_cut(node, ROW_DIM)
    if cut is None:
        return None
    base, start = cut
    if isinstance(start, fx.Node):
        start = start.meta.get("example_value", start.meta.get("val"))
    size, rows, start = _static(value(base).shape[ROW_DIM]), _static(value(node).shape[ROW_DIM]), _static(start)
    if size is None or rows is None or start is None:
        return None
    start = start + size if start < 0 else start
    return (base, start, start + rows) if 0 <= start <= size - rows else None


def rows_of(node) -> tuple[fx.Node, int, int]:
    """(base, s0, s1) of a row slice, or (node, 0, its row count) for a whole tensor."""
    found = row_slice(node)
    if found is not None:
        return found
    val = value(node)
    rows = _static(val.shape[ROW_DIM]) if val is not None and val.dim() > ROW_DIM else None
    if rows is None:
        raise NotChunks(f"{getattr(node, 'name', node)} has no static row count")
    return node, 0, rows


def _written(node: fx.Node, order: dict) -> bool:
    """Something writes into node's memory in place (or into a view of it): not a pure value
    (order: the graph's node positions)."""
    return bool(cmp.writes_into(node, len(order), order))


def same_key(x, order: dict, prefix_end: int | None = None):
    """A hashable key equal for the same value: the node itself, or (for a pure computation of
    nodes that nothing writes into) the op and its arguments' keys. With prefix_end, a prefix
    slice x[:, :, :e] (e >= prefix_end) under the casts keys as the whole tensor. order: the
    graph's node positions."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(same_key(a, order, prefix_end) for a in x))
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    if not isinstance(x, fx.Node):
        return ("const", x if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device)) else repr(x))
    if prefix_end is not None:
        cut = row_slice(x)
        if cut is not None and cut[1] == 0 and cut[2] >= prefix_end:
            return same_key(cut[0], order, prefix_end)
    name = op_name(x) or ""
    if x.op in ("call_function", "call_method") and name in PURE and not _written(x, order):
        below = prefix_end if name in ELEMENTWISE else None
        args = tuple(same_key(a, order, below if i == 0 else None) for i, a in enumerate(x.args))
        return (x.op, name, args, tuple(sorted((k, same_key(v, order)) for k, v in x.kwargs.items())))
    return ("node", x)


def rebuild(graph: fx.Graph, x, anchor: fx.Node, order: dict, prefix_end: int | None, made: dict):
    """A node of x's value (prefix slices under casts dropped as same_key drops them) computed
    before `anchor`: x itself where it is, else a copy of its pure computation."""
    if not isinstance(x, fx.Node):
        return x
    if prefix_end is not None and (cut := row_slice(x)) is not None and cut[1] == 0 and cut[2] >= prefix_end:
        return rebuild(graph, cut[0], anchor, order, prefix_end, made)
    if order[x] < order[anchor]:
        return x
    if x in made:
        return made[x]
    name = op_name(x) or ""
    if name not in PURE or _written(x, order):
        raise NotChunks(f"{x.name}, an argument of every chunk, is computed after the first chunk's call")
    below = prefix_end if name in ELEMENTWISE else None
    args = tuple(rebuild(graph, a, anchor, order, below if i == 0 else None, made) for i, a in enumerate(x.args))
    kwargs = {k: rebuild(graph, v, anchor, order, None, made) for k, v in x.kwargs.items()}
    # a method as the function torch.Tensor.<name> (as Dynamo records torch.Tensor.to); its value
    # computed again: a prefix slice below it may be gone
    target = getattr(torch.Tensor, x.target) if x.op == "call_method" else x.target
    node = call(graph, target, *args, anchor=anchor, **kwargs)
    made[x] = node
    return node


def _bound(node: fx.Node) -> dict:
    """The call's arguments by the op's schema names, defaults filled in."""
    return registry.get(op_name(node).split(".")[0]).bound(node.args, node.kwargs)  # packet or .default


class QueryChunksPass(RewritePass):
    name = "query_chunks"
    summary = "one call of each NSA op for a model that loops over chunks of queries"

    def source_files(self) -> tuple[str, ...]:
        return super().source_files() + (cmp.__file__,)  # sequence_cut, writes_into, erase_dead

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        for op in PER_QUERY:
            target = getattr(torch.ops.nsa, op)
            groups: dict = {}  # (q's base's key, the other arguments' keys) -> calls
            over: dict = {}  # q's base's key -> how many calls read rows of it
            order = {n: i for i, n in enumerate(graph.nodes)}  # again per op: the merges before add nodes
            for node in graph.nodes:
                if node.op != "call_function" or node.target not in (target, target.default):
                    continue
                args = _bound(node)
                found = row_slice(args["q"])
                if found is None or args.get("pos") is not None:  # not a chunk; packed rows are not merged
                    continue
                base = same_key(found[0], order)
                over[base] = over.get(base, 0) + 1
                groups.setdefault((base, self.signature(op, args, found[2], order)), []).append(node)
            for (key, _), group in groups.items():
                if over[key] < 2:
                    continue
                others = over[key] - len(group)
                base = row_slice(_bound(group[0])["q"])[0]
                named = (f"{len(group)} nsa.{op} calls over rows of {base.name}" +
                         (f" (and {others} with other arguments)" if others else ""))
                try:
                    plan = self.check(op, base, group)
                except NotChunks as why:
                    ctx.refused(group[0], f"{named}: {why}")
                    continue
                self.rewrite(graph, op, base, group, plan, ctx, named)

    @staticmethod
    def signature(op: str, args: dict, s1: int, order: dict) -> tuple:
        """The keys of a call's arguments that must be the same in every chunk: all but q_offset,
        the backend, and the per-query ones (their base only); k and v of the window as the whole
        where they are a prefix reaching the chunk's last query s1."""
        keys = []
        for name, x in args.items():
            if name in ("q_offset", "backend", "pos", "q"):
                continue
            if name in PER_QUERY[op]:
                found = row_slice(x)
                keys.append((name, ("rows of", same_key(found[0] if found else x, order))))
            else:
                keys.append((name, same_key(x, order, s1 if name in PREFIX_ANY.get(op, ()) else None)))
        return tuple(keys)

    @staticmethod
    def check(op: str, base: fx.Node, group: list[fx.Node]) -> dict:
        """The merged call's arguments (per name: ("same", a chunk's node of the value, the prefix
        bound past which slices are the whole), the per-query ones' whole), or NotChunks."""
        spans = []
        for node in group:
            args = _bound(node)
            _, s0, s1 = rows_of(args["q"])
            if args.get("q_offset", 0) != s0:
                raise NotChunks(f"{node.name}'s q_offset {args.get('q_offset')} is not its first row {s0}")
            spans.append((s0, s1, node, args))
        spans.sort(key=lambda s: s[0])
        rows = _static(value(base).shape[ROW_DIM])
        end = 0
        for s0, s1, node, _ in spans:
            if s0 != end:
                raise NotChunks(f"rows [{end}, {s0}) are in no chunk" if s0 > end else
                                f"chunks overlap at rows [{s0}, {min(end, s1)})")
            end = s1
        if end != rows:
            raise NotChunks(f"rows [{end}, {rows}) are in no chunk")
        QueryChunksPass.unwritten(group)
        merged = {}
        for name in spans[0][3]:
            if name in ("q_offset", "backend", "pos"):
                continue
            if name in PER_QUERY[op]:
                for s0, s1, node, args in spans:
                    _, r0, r1 = rows_of(args[name])
                    if (r0, r1) != (s0, s1):
                        raise NotChunks(f"{node.name}'s {name} holds rows [{r0}, {r1}), its queries [{s0}, {s1})")
                merged[name] = ("same", rows_of(spans[0][3][name])[0], None)  # the same whole in every chunk
            elif name in PREFIX_ANY.get(op, ()):
                merged[name] = ("same", spans[-1][3][name], rows)  # the last chunk's: the longest prefix
            else:
                merged[name] = ("same", spans[0][3][name], None)
        return {"spans": spans, "args": merged}

    @staticmethod
    def unwritten(group: list[fx.Node]) -> None:
        """NotChunks where a tensor the calls read (through their casts and views) is written in
        place between the first call and the last: the same node would hold another value for the
        later chunks, which one call before the write would not see."""
        order = {n: i for i, n in enumerate(group[0].graph.nodes)}
        first, last = min(order[n] for n in group), max(order[n] for n in group)
        seen, stack = set(), [x for node in group for x in node.all_input_nodes]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            late = [w for w in cmp.writes_into(x, last, order) if order[w] > first]
            if late:
                raise NotChunks(f"{x.name} is written in place between the chunks' calls ({op_name(late[0])})")
            if (op_name(x) or "") in PURE:
                stack += x.all_input_nodes

    @staticmethod
    def rewrite(graph: fx.Graph, op: str, base: fx.Node, group: list[fx.Node], plan: dict, ctx: PassContext,
                named: str) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(group, key=order.__getitem__)
        made: dict = {}
        args = {}
        try:
            for name, (_, node, prefix_end) in plan["args"].items():
                args[name] = rebuild(graph, node, first, order, prefix_end, made)
        except NotChunks as why:
            for node in reversed(list(made.values())):
                graph.erase_node(node)
            ctx.refused(first, f"{named}: {why}")
            return
        entry = registry.get(op)
        fake = lambda x: value(x) if isinstance(x, fx.Node) else x  # noqa: E731
        bound = dict(plan["spans"][0][3], **args, q_offset=0)
        try:
            backend = entry.choose(ctx.config.backend(op), *(fake(bound[a]) for a in entry.choice_args))
        except ValueError as why:
            for node in reversed(list(made.values())):
                graph.erase_node(node)
            ctx.refused(first, f"{named}: the whole call: {why}")
            return
        schema = getattr(torch.ops.nsa, op).default._schema
        positional = [bound[a.name] if a.name != "backend" else backend for a in schema.arguments if not a.kwarg_only]
        target = getattr(torch.ops.nsa, op)
        whole = call(graph, target, *positional, anchor=first)
        single = isinstance(whole.meta["example_value"], torch.Tensor)
        parts = None if single else [call(graph, operator.getitem, whole, j, anchor=first)
                                     for j in range(len(whole.meta["example_value"]))]
        for s0, s1, node, _ in plan["spans"]:
            cut = (slice(None), slice(None), slice(s0, s1))
            if parts is None:
                node.replace_all_uses_with(call(graph, operator.getitem, whole, cut, anchor=first))
            else:
                for user in list(node.users):
                    j = user.args[1] if user.target is operator.getitem else None
                    if not isinstance(j, int):
                        raise AssertionError(f"{user.name} reads {node.name} other than by one output")
                    user.replace_all_uses_with(call(graph, operator.getitem, parts[j], cut, anchor=first))
                    graph.erase_node(user)
        inputs = [x for _, _, node, _ in plan["spans"] for x in node.all_input_nodes]
        for _, _, node, _ in plan["spans"]:  # after the last insertion before `first`, which is one of them
            graph.erase_node(node)
        cmp.erase_dead(graph, _pure_ancestors(inputs))
        rows = _static(value(base).shape[ROW_DIM])
        ctx.matched(first, KERNEL.format(op=op, backend=backend, n=len(group), rows=rows, base=base.name))


def _pure_ancestors(nodes) -> set[fx.Node]:
    """`nodes` and what they read through pure computations (the chunks' q slices, their casts of
    k): the nodes a merge may leave without readers, for `cmp.erase_dead`."""
    found, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in found and node.op in ("call_function", "call_method") and (op_name(node) or "") in PURE:
            found.add(node)
            stack += node.all_input_nodes
    return found


def _shown(x) -> str:
    return x.name if isinstance(x, fx.Node) else repr(x)


PASS = QueryChunksPass()
