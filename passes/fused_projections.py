"""projections_rope: the Linear projections of one input -> one GEMM over their concatenated
weights, with the RoPE of the rotated ones applied in that GEMM's epilogue.

Matches (torch IR), per input node x (models/nsa.py `NSAAttention.forward`):
    y_i = F.linear(x, W_i[, b_i])                     # every projection of the same x: q, k_c, v_c
    out_i = rope(y_i)                                 # optional: arithmetic that is a rotation
where rope is any arithmetic of views, slices, cat/stack, neg, mul, add, sub and casts that turns
y_i.view(B, S, heads, D) into its rotation by two tables (cos, sin) [S, R/2] or [1 or B, S(, 1),
R/2] read through views and casts, each any expression of data independent of y_i (rope_tables'
cos; with packed documents the per-token gather cos[pos] [B, S, R/2], models/lm.py):
rotate-half (pairs (j, j + R/2)) or interleaved (pairs (2j, 2j + 1)), the first R of each head's
D dims (partial rotary), the rest passed through, by the angle or its opposite
(x*cos - rotate(x)*sin: the op is given -sin).

Recognized from the arithmetic, not from names: the nodes that depend only on y_i and on data
independent of it (the tables) are collected; for the output of each closed such subgraph of
shape [B, S, heads, D] (largest first), the tables are found by walking up from what the
arithmetic reads, through views, casts and signs of one tensor (a cat may repeat it), to where
that chain starts (any other op, or one that reads a second tensor: the gather cos[pos] reads
pos); on each chain the table is the node nearest its start whose value has a table's shape (the
gather, not cos and pos: the op reads its value, whatever computed it). There must be two, and
the subgraph is evaluated in float64 on random y and random tables (whatever values the model's
tables hold) against the rotation formula, for both conventions, either table as cos and either
sign. Its ops being linear in y and polynomial in the tables, one random probe tells a rotation
from anything else. Identical subgraphs (one per layer) are evaluated once per graph.

Under autocast (`torch.autocast` around the compiled call, or a `with torch.autocast` inside
it: Dynamo records no cast, only `torch.amp.autocast_mode._enter_autocast` / `_exit_autocast`
nodes for a region inside the compiled code, on PyTorch 2.11 and 2.13 alike; AOTAutograd applies
the casts later, when it traces the ATen graph under them) F.linear gets fp32 x and weights and
computes in the autocast dtype A, which the recorded output value shows. The projections of one
input are grouped by that compute dtype, and a group whose inputs are not in A gets the casts
autocast would have made, x.to(A) and W_i.to(A) (b_i.to(A)), written into the graph before the
op: a `.to` and the custom op are outside autocast's op lists, so the ATen graph computes
exactly what autocast's linear computes, one GEMM in A for the group.

Becomes, before the group's first projection:
    w = torch.cat([W_1, ..., W_n])                    # the module's own parameters, every call:
    b = torch.cat([b_i or zeros])                     #   autograd splits dW back onto each
    outs = torch.ops.nsa.projection_rope(x, w, b, cos, sin, widths, head_dims, style, backend)
(x, W_i, b_i each cast to the group's compute dtype first where they are not in it: autocast)
and each y_i (unrotated) or out_i (rotated, viewed as [B, S, heads, D]) is replaced by its piece:
one GEMM instead of n, no eager RoPE arithmetic, each piece written straight into its own
contiguous tensor, as the eager code laid it out. The backend is chosen from the fake tensors and
written into the graph (`triton` on CUDA in fp16/bf16, else `reference`; explain says why).

Refuses (that projection stays eager, or its RoPE stays eager on its merged piece), with the
reason shown by `explain`:
- a projection whose input, weight or bias is in another dtype than it computes in, unless it
  runs in an autocast region of that dtype for its device (the casts are then autocast's own);
  with a symbolic weight shape, or whose weight or bias is computed after the group's first
  projection;
- a projection that computes in another dtype than the other projections of its input (autocast
  disabled around it only, or another autocast dtype) is not merged with them: it joins a group
  of its own dtype, and is refused when it is alone there (and has no RoPE);
- RoPE-like arithmetic that is not a rotation on the probe (a wrong sign, a wrong partner, a
  scale, one table used twice), that reads other than two tables, tables that require grad or
  have another shape (another length than S, or [B, 1, R/2]: one angle per row), a rotary dim
  over the head dim, a result in another dtype than the projection (a bf16 projection times
  float32 tables is float32 by type promotion, the op's pieces are in the projection's dtype),
  intermediate values used elsewhere, a second RoPE convention or table pair in the same group,
  or symbolic sizes (dynamic shapes: the projections still merge, their RoPE stays eager);
- more than MAX_PIECES projections of one input are split into several groups (not refused).
"""

from __future__ import annotations

import heapq
import inspect
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.attention_match import Refused, erase_replaced
from nsa_compile.fx import arg, call, module_path, op_name, value
from nsa_compile.ops import rope_triton
from nsa_compile.ops.rope import choose_backend, rotate, why_not_triton
from nsa_compile.rewrite import Match, PassLog, RewritePass

MAX_PIECES = rope_triton.MAX_PIECES
# The probe evaluates the RoPE subgraph at the real shape, in float64, on the graph's device:
# larger projections are not verified (the seed model at batch 8, S = 8192: 50M elements).
MAX_VERIFIED_ELEMENTS = 2**28
KERNEL = "nsa.projection_rope[{backend}] ({n} projection{s} -> 1 GEMM of {N} columns{cast}; {rope}{why})"

# Ops the RoPE arithmetic may use on the projection (all linear in it, none random or in place).
_ROPE_OPS = {
    "getitem", "view", "reshape", "unflatten", "flatten", "unsqueeze", "squeeze", "contiguous", "clone",
    "narrow", "select", "chunk", "split", "unbind", "tensor_split", "view_as", "reshape_as", "expand",
    "expand_as", "neg", "mul", "add", "sub", "cat", "concat", "concatenate", "stack", "to", "type_as",
    "float", "half", "bfloat16", "double",
}
# Ops the table side may use between a table and the arithmetic (data movement, casts, a sign).
_TABLE_OPS = {
    "getitem", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "to",
    "type_as", "float", "half", "bfloat16", "double", "cat", "concat", "concatenate", "stack", "repeat",
    "repeat_interleave", "flatten", "unflatten", "contiguous", "clone", "view_as", "narrow", "select", "neg",
}
_CASTS = {"float", "half", "bfloat16", "double"}
# What Dynamo records for a `with torch.autocast(...)` inside the compiled code (2.11 and 2.13).
_ENTER_AUTOCAST = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
_EXIT_AUTOCAST = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
_AUTOCAST_SIGNATURE = inspect.signature(torch.amp.autocast)


def static_shape(node: fx.Node, what: str) -> tuple[int, ...]:
    val = value(node)
    if val is None:
        raise Refused(f"the {what} has no recorded tensor value")
    if not all(is_concrete_int(d) for d in val.shape):
        raise Refused(f"the {what} has symbolic sizes {tuple(val.shape)} (dynamic shapes): not verified yet")
    return tuple(int(d) for d in val.shape)


class AutocastRegions:
    """The autocast state, per device type, that each linear of a graph runs under: the ambient
    state the graph is compiled under (AOTAutograd traces the graph under it), changed by the
    graph's own `_enter_autocast` / `_exit_autocast` nodes. A state is (enabled, dtype), or None
    where the pass cannot read it (an enter node whose arguments do not bind)."""

    UNKNOWN = "?"  # key of a state in which no device's autocast is known

    def __init__(self, graph: fx.Graph):
        self.at: dict[fx.Node, dict] = {}
        current: dict = {}  # device type -> (enabled, dtype) set by enter nodes; absent: ambient
        before: dict[fx.Node, dict] = {}
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if _ENTER_AUTOCAST is not None and node.target is _ENTER_AUTOCAST:
                before[node] = current
                current = self.entered(current, node)
            elif _EXIT_AUTOCAST is not None and node.target is _EXIT_AUTOCAST:
                enter = node.args[0] if node.args else None
                current = before.get(enter, {self.UNKNOWN: None})
            elif op_name(node) == "linear":
                self.at[node] = current

    @staticmethod
    def ambient(device: str) -> tuple[bool, torch.dtype] | None:
        try:
            return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
            return None

    def state(self, node: fx.Node, device: str) -> tuple[bool, torch.dtype] | None:
        current = self.at.get(node, {self.UNKNOWN: None})
        if self.UNKNOWN in current:
            return None
        return current[device] if device in current else self.ambient(device)

    def entered(self, current: dict, node: fx.Node) -> dict:
        """The state inside `torch.autocast(*node.args, **node.kwargs)` entered in `current`."""
        try:
            bound = _AUTOCAST_SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            return {self.UNKNOWN: None}
        bound.apply_defaults()
        device, dtype, enabled = (bound.arguments[k] for k in ("device_type", "dtype", "enabled"))
        if not isinstance(device, str) or not isinstance(enabled, bool) or \
                not (dtype is None or isinstance(dtype, torch.dtype)):
            return {self.UNKNOWN: None}
        outer = current[device] if device in current else self.ambient(device)
        if dtype is None:  # torch.autocast keeps the dtype in effect when given none
            if outer is None:
                return {self.UNKNOWN: None}
            dtype = outer[1]
        return {**current, device: (enabled, dtype)}


def check_linear(linear: fx.Node, regions: AutocastRegions) -> tuple[fx.Node, fx.Node | None, torch.dtype]:
    """(weight, bias, the dtype it computes in) of F.linear(x, weight, bias), or Refused."""
    x, weight, bias = arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or not (bias is None or isinstance(bias, fx.Node)):
        raise Refused("the projection's input, weight or bias is not a tensor in the graph")
    # the lead dims of x may be symbolic (dynamic shapes: the GEMMs still merge; RoPE is probed
    # at static shapes only), the weight's may not
    ws, xs = static_shape(weight, "weight"), tuple(value(x).shape) if value(x) is not None else ()
    if len(ws) != 2 or len(xs) < 2 or not is_concrete_int(xs[-1]) or int(xs[-1]) != ws[1]:
        raise Refused(f"the projection is not x [..., K] by a weight [N, K] (x {xs}, weight {ws})")
    if bias is not None and static_shape(bias, "bias") != (ws[0],):
        raise Refused(f"the bias is {static_shape(bias, 'bias')}, not [{ws[0]}]")
    if value(linear) is None or not value(x).is_floating_point():
        raise Refused("the projection is not a floating-point tensor")
    computes_in = value(linear).dtype
    inputs = (x, weight) + ((bias,) if bias is not None else ())
    if any(value(n).dtype != computes_in for n in inputs):
        # only autocast makes F.linear take other dtypes than it returns: its region's dtype is
        # the output's, and it cast every input to it (the op gets the same casts in the graph)
        dtypes = sorted({str(value(n).dtype) for n in (*inputs, linear)})
        state = regions.state(linear, value(linear).device.type)
        if state is None:
            raise Refused(f"the projection mixes dtypes {dtypes} in an autocast region the pass cannot read: "
                          "the op computes in one")
        if not state[0]:
            raise Refused(f"the projection mixes dtypes {dtypes} outside any autocast region: the op computes in one")
        if state[1] != computes_in:
            raise Refused(f"the projection mixes dtypes {dtypes} and returns {computes_in} in an autocast region "
                          f"of {state[1]}: the op computes in one")
    return weight, bias, computes_in


class Probe:
    """Evaluates subgraphs for real, in float64 (casts to other float types become float64)."""

    @staticmethod
    def _f64(x):
        return torch.float64 if isinstance(x, torch.dtype) and x.is_floating_point else x

    @classmethod
    def run(cls, nodes: list[fx.Node], env: dict, keep: fx.Node) -> torch.Tensor:
        """The value of `keep`; values are dropped after their last use (the probe runs at the real
        shape: at most a few projection-sized tensors live at once)."""
        last = {i: n for n, node in enumerate(nodes) for i in node.all_input_nodes}
        for step, node in enumerate(nodes):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            args, kwargs = torch.utils._pytree.tree_map(cls._f64, (args, kwargs))
            try:
                if node.op == "call_method" and node.target in _CASTS:
                    env[node] = args[0].to(torch.float64)
                elif node.op == "call_method":
                    env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    env[node] = node.target(*args, **kwargs)
            except torch.OutOfMemoryError:  # not a property of the user's code: never a refusal
                raise
            except Exception as error:  # the user's code, run on values it may not expect
                raise Refused(f"evaluating the RoPE arithmetic on probe values failed at {node.name} "
                              f"({type(error).__name__})") from None
            for i in node.all_input_nodes:
                if last.get(i) == step and i is not keep:
                    del env[i]
        return env[keep]


def op_table(shape: tuple, B: int, S: int) -> tuple[int, ...] | None:
    """The [S, R/2] or [Bt, S, R/2] shape the op reads a table of `shape` as, or None."""
    if len(shape) == 2 and shape[0] == S:
        return shape
    if len(shape) == 3 and shape[:2] in ((1, S), (B, S)):
        return shape
    if len(shape) == 4 and shape[:3] in ((1, S, 1), (B, S, 1)):
        return (shape[0], S, shape[3])
    return None


def table_layout(node: fx.Node, B: int, S: int) -> tuple[int, ...] | None:
    """op_table of the node's value when it is a float tensor of static shape, else None."""
    val = value(node)
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or \
            not all(is_concrete_int(d) for d in val.shape):
        return None
    return op_table(tuple(int(d) for d in val.shape), B, S)


class ProjectionsRope(RewritePass):
    name = "projections_rope"
    summary = "Linear projections of one input (+ their RoPE) -> one GEMM with RoPE in its epilogue"

    def apply(self, graph: fx.Graph, log: PassLog) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            if op_name(node) == "linear" and node.graph is graph and isinstance(arg(node, 0, "input"), fx.Node):
                groups.setdefault(arg(node, 0, "input"), []).append(node)
        regions = AutocastRegions(graph)
        verified: dict = {}  # structure of a RoPE subgraph -> its hypothesis (one per layer is the same)
        for linears in groups.values():
            # one GEMM computes in one dtype: the projections of x are grouped by the dtype they
            # compute in (they differ where autocast is on for some and off for others)
            by_dtype: dict[torch.dtype, list[dict]] = {}
            for linear in linears:
                try:
                    weight, bias, dtype = check_linear(linear, regions)
                except Refused as why:
                    log.refused(linear, str(why))
                    continue
                by_dtype.setdefault(dtype, []).append(
                    {"linear": linear, "weight": weight, "bias": bias, "dtype": dtype, "rope": None})
            for dtype, members in by_dtype.items():
                # a lone projection is rewritten only for its RoPE
                if len(members) > 1 or any(self.rope_candidate(m["linear"]) for m in members):
                    for m in members:  # (RoPE-less ones, the v projections, return None at once)
                        try:
                            m["rope"] = self.find_rope(m["linear"], order, verified)
                        except Refused as why:
                            log.refused(m["linear"], f"RoPE left eager: {why}")
                chunks = self.plan(members, order, log)
                if len(by_dtype) > 1:
                    others = ", ".join(str(d) for d in by_dtype if d != dtype)
                    for m in members:
                        if not m.get("late") and not any(m in chunk for chunk in chunks):
                            log.refused(m["linear"], f"it computes in {dtype}, the other projections of "
                                                     f"{arg(m['linear'], 0, 'input').name} in {others} (autocast on for "
                                                     "some, off for others?): one GEMM computes in one dtype")
                for chunk in chunks:
                    self.rewrite(graph, chunk, log)
                    order = {node: i for i, node in enumerate(graph.nodes)}  # the rewrite added nodes

    # --- RoPE recognition -------------------------------------------------------------------------

    @staticmethod
    def rope_candidate(linear: fx.Node) -> bool:
        """Whether the projection's output feeds any RoPE-like arithmetic at all (cheap pre-check)."""
        seen, stack = set(), [linear]
        while stack:
            node = stack.pop()
            for user in node.users:
                name = op_name(user)
                if name in _ROPE_OPS and user not in seen:
                    if name == "mul":
                        return True
                    seen.add(user)
                    stack.append(user)
        return False

    def region(self, linear: fx.Node, order: dict) -> list[fx.Node]:
        """The nodes reachable from the projection through _ROPE_OPS whose every input is either in
        the region or independent of the projection, in graph order (the projection first)."""
        region, rejected = {linear}, set()
        start = order[linear]
        memo: dict[fx.Node, bool] = {}

        def depends(node: fx.Node) -> bool:
            """Whether node depends on the projection (nodes before it cannot); iterative, memoized."""
            stack = [node]
            while stack:
                top = stack[-1]
                if top in region or top in memo or order.get(top, -1) <= start:
                    stack.pop()
                    continue
                pending = [i for i in top.all_input_nodes
                           if i not in region and i not in memo and order.get(i, -1) > start]
                if pending:
                    stack.extend(pending)
                    continue
                memo[top] = any(i in region or memo.get(i, False) for i in top.all_input_nodes)
                stack.pop()
            return node in region or memo.get(node, False)

        heap = [(order[u], u.name, u) for u in linear.users]
        heapq.heapify(heap)
        while heap:
            _, _, node = heapq.heappop(heap)
            if node in region or node in rejected:
                continue
            if node.op not in ("call_function", "call_method") or op_name(node) not in _ROPE_OPS or \
                    any(i not in region and depends(i) for i in node.all_input_nodes):
                rejected.add(node)
                continue
            region.add(node)
            for user in node.users:
                heapq.heappush(heap, (order[user], user.name, user))
        return sorted(region, key=order.__getitem__)

    def find_rope(self, linear: fx.Node, order: dict, verified: dict) -> dict | None:
        """The RoPE applied to this projection ({output node, subgraph, tables, style, ...}), None
        when there is no RoPE-like arithmetic, Refused when there is one that is not a rotation."""
        if not self.rope_candidate(linear):
            return None
        ys = static_shape(linear, "projection")
        if len(ys) != 3:
            return None
        B, S, N = ys
        region = self.region(linear, order)
        first_reason = None
        # candidates: the [B, S, heads, D] outputs of closed subgraphs, largest first
        for out in reversed(region[1:]):
            shape = tuple(value(out).shape) if value(out) is not None else ()
            if len(shape) != 4 or shape[:2] != (B, S) or shape[2] * shape[3] != N:
                continue
            sub = self.ancestors_in(out, region)
            if any(u not in sub for n in sub if n is not out for u in n.users):
                if first_reason is None and any(op_name(n) == "mul" for n in sub):
                    first_reason = Refused("values inside the RoPE arithmetic (or the projection) are used elsewhere")
                continue
            if not any(op_name(n) == "mul" for n in sub):
                continue
            try:
                return self.verify(linear, out, sub, order, verified)
            except Refused as why:
                first_reason = first_reason or why
        if first_reason is not None:
            raise first_reason
        return None

    @staticmethod
    def ancestors_in(out: fx.Node, region: list[fx.Node]) -> list[fx.Node]:
        inside, keep, stack = set(region), set(), [out]
        while stack:
            node = stack.pop()
            if node in keep:
                continue
            keep.add(node)
            stack.extend(i for i in node.all_input_nodes if i in inside)
        return [n for n in region if n in keep]

    @staticmethod
    def tables(sub: list[fx.Node], order: dict, B: int, S: int) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
        """(tables, table-side nodes in graph order, the values the subgraph reads besides the
        projection). From each value the arithmetic reads, the walk goes up through _TABLE_OPS that
        move ONE tensor (a cat or stack may repeat it); it stops at any other node (rope_tables'
        cos, a gather cos[pos] that also reads the packed positions, any expression). On that chain
        the table is the node nearest the stop whose value has a table's shape (else the stop
        itself, refused for its shape): the op reads its value, whatever computed it."""
        inside = set(sub)
        externals = list(dict.fromkeys(i for n in sub[1:] for i in n.all_input_nodes if i not in inside))
        tables, side = [], set()
        for node in externals:
            chain = [node]  # from the arithmetic up
            while chain[-1].op in ("call_function", "call_method") and op_name(chain[-1]) in _TABLE_OPS and \
                    len(chain[-1].all_input_nodes) == 1:
                chain.append(chain[-1].all_input_nodes[0])
            shaped = [n for n in chain if table_layout(n, B, S) is not None]
            table = shaped[-1] if shaped else chain[-1]
            if table not in tables:
                tables.append(table)
            side.update(chain[: chain.index(table)])
        return sorted(tables, key=order.__getitem__), sorted(side, key=order.__getitem__), externals

    def verify(self, linear: fx.Node, out: fx.Node, sub: list[fx.Node], order: dict, verified: dict) -> dict:
        B, S, N = static_shape(linear, "projection")
        heads, D = tuple(value(out).shape)[2:]
        sources, side, externals = self.tables(sub, order, B, S)
        names = ", ".join(n.name for n in sources)
        if len(sources) != 2:
            raise Refused(f"the arithmetic reads {len(sources)} tables besides the projection ({names}); "
                          "RoPE reads two (cos, sin)")
        shapes = [static_shape(n, "RoPE table") for n in sources]
        vals = [value(n) for n in sources]
        layout = op_table(shapes[0], B, S)
        if shapes[0] != shapes[1] or layout is None or not all(v.is_floating_point() for v in vals):
            raise Refused(f"the tables {names} are {shapes[0]} and {shapes[1]}; the op reads two float tables "
                          f"[S, R/2] or [1 or B, S(, 1), R/2] (S = {S})")
        if any(v.requires_grad for v in vals):
            raise Refused(f"the tables {names} require grad; the op gives them none")
        R = 2 * layout[-1]
        if R == 0 or R > D:
            raise Refused(f"the rotary dim {R} (from the tables {shapes[0]}) exceeds the head dim {D}")
        if value(out).dtype != value(linear).dtype:
            raise Refused(f"the rotated projection is {value(out).dtype} (type promotion with the "
                          f"{', '.join(sorted({str(v.dtype) for v in vals}))} tables), the op returns the projection's "
                          f"{value(linear).dtype}")
        if B * S * N > MAX_VERIFIED_ELEMENTS:
            raise Refused(f"the projection has {B * S * N:,} elements, over the cap of {MAX_VERIFIED_ELEMENTS:,} "
                          "for the probe: not verified at this size yet")
        key = (self.structure(linear, sources, side, sub), (B, S, N, heads, D), shapes[0])
        if key not in verified:
            verified[key] = self.probe(linear, out, sources, side, sub, layout, D)
        swap, style, negate = verified[key]
        cos, sin = sources[::-1] if swap else sources
        return {"out": out, "sub": sub, "externals": externals, "cos": cos, "sin": sin, "negate": negate,
                "style": style, "rotary": R, "head_dim": D, "table_shape": layout,
                "signature": (cos, sin, negate, style, D)}

    @staticmethod
    def structure(linear, sources, side, sub) -> str:
        """What the subgraph computes from the projection and the tables, as text (equal texts:
        the same function, so one probe serves both)."""
        index = {n: i for i, n in enumerate([linear, *sources, *side, *sub[1:]])}

        class Ref:
            def __init__(self, i):
                self.i = i

            def __repr__(self):
                return f"<{self.i}>"

        ops = [(n.op, n.target, fx.node.map_arg((n.args, n.kwargs), lambda a: Ref(index[a])))
               for n in [*side, *sub[1:]]]
        return repr((ops, index[sub[-1]] if sub else None, [index[s] for s in sources]))

    def probe(self, linear, out, sources, side, sub, layout, D) -> tuple[bool, str, bool]:
        """(tables swapped, style, angle negated) of the rotation the subgraph computes, or Refused."""
        device = value(linear).device
        gen = torch.Generator(device=device).manual_seed(0)
        y = torch.randn(value(linear).shape, generator=gen, device=device, dtype=torch.float64)
        t = [torch.rand(value(s).shape, generator=gen, device=device, dtype=torch.float64) * 2 - 1 for s in sources]
        got = Probe.run([*side, *sub[1:]], {linear: y, sources[0]: t[0], sources[1]: t[1]}, keep=out)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(value(out).shape):
            raise Refused("the RoPE arithmetic evaluates to another shape than traced")
        tables = [x.reshape(layout) for x in t]
        for swap in (False, True):
            cos, sin = tables[::-1] if swap else tables
            for style in ("half", "interleaved"):
                for negate in (False, True):  # negate: a rotation by the opposite angle
                    want = rotate(y, cos, -sin if negate else sin, D, style).view(got.shape)
                    if torch.allclose(got, want, rtol=1e-9, atol=1e-9):
                        return swap, style, negate
        raise Refused("the arithmetic on the projection is not a RoPE rotation (checked on random values: "
                      "rotate-half and interleaved, either table as cos, either sign of the angle)")

    # --- grouping and rewriting -----------------------------------------------------------------

    def plan(self, members: list[dict], order: dict, log: PassLog) -> list[list[dict]]:
        """The groups to rewrite: members whose inputs exist before the group's first projection,
        one RoPE signature per group, at most MAX_PIECES each; lone unrotated projections dropped."""
        if not members:
            return []
        anchor = members[0]["linear"]
        kept = []
        for m in members:
            late = [n for n in (m["weight"], m["bias"]) if n is not None and order[n] >= order[anchor]]
            if late:
                m["late"] = True
                log.refused(m["linear"], f"its {late[0].name} is computed after the group's first projection "
                                         f"{anchor.name}: one GEMM cannot read it")
            else:
                kept.append(m)
        signature = next((m["rope"]["signature"] for m in kept if m["rope"]), None)
        for m in kept:
            rope = m["rope"]
            if rope is None:
                continue
            if rope["signature"] != signature:
                log.refused(m["linear"], "RoPE left eager: the group already rotates with another table pair, "
                                         "convention or head dim")
                m["rope"] = None
            elif any(order[s] >= order[anchor] for s in (rope["cos"], rope["sin"])):
                log.refused(m["linear"], f"RoPE left eager: its tables are computed after the group's first "
                                         f"projection {anchor.name}")
                m["rope"] = None
        chunks = [kept[i : i + MAX_PIECES] for i in range(0, len(kept), MAX_PIECES)]
        return [c for c in chunks if len(c) > 1 or (c and c[0]["rope"])]

    def rewrite(self, graph: fx.Graph, group: list[dict], log: PassLog) -> None:
        anchor = group[0]["linear"]
        dtype = group[0]["dtype"]
        casts = []

        def cast(node: fx.Node) -> fx.Node:
            """node in the group's compute dtype: autocast's cast of a linear's input, made explicit
            (a .to is in no autocast op list: AOTAutograd traces it as it is)."""
            if value(node).dtype == dtype:
                return node
            casts.append(node)
            return call(graph, torch.Tensor.to, node, dtype, anchor=anchor)

        x = cast(arg(anchor, 0, "input"))
        ropes = [m["rope"] for m in group if m["rope"]]
        rope = ropes[0] if ropes else None
        widths = [value(m["weight"]).shape[0] for m in group]
        head_dims = [m["rope"]["head_dim"] if m["rope"] else 0 for m in group]
        # each piece cast before the cat, as autocast casts each weight (the cat then mixes no dtypes)
        weights = [cast(m["weight"]) for m in group]
        weight = weights[0] if len(weights) == 1 else call(graph, torch.cat, weights, 0, anchor=anchor)
        bias = None
        if any(m["bias"] is not None for m in group):
            parts = [cast(m["bias"]) if m["bias"] is not None else
                     call(graph, torch.Tensor.new_zeros, x, (w,), anchor=anchor) for m, w in zip(group, widths)]
            bias = parts[0] if len(parts) == 1 else call(graph, torch.cat, parts, 0, anchor=anchor)
        cos = sin = None
        style = rope["style"] if rope else "half"
        if rope:
            cos, sin = rope["cos"], rope["sin"]
            if tuple(value(cos).shape) != rope["table_shape"]:  # [Bt, S, 1, R/2] -> [Bt, S, R/2]
                cos = call(graph, torch.reshape, cos, rope["table_shape"], anchor=anchor)
                sin = call(graph, torch.reshape, sin, rope["table_shape"], anchor=anchor)
            if rope["negate"]:  # the code rotates by -angle: the op gets -sin
                sin = call(graph, torch.neg, sin, anchor=anchor)
        fakes = [value(n) if n is not None else None for n in (x, weight, bias, cos, sin)]
        backend = choose_backend(*fakes, widths, head_dims)
        outs = call(graph, torch.ops.nsa.projection_rope, x, weight, bias, cos, sin, widths, head_dims, style,
                    backend, anchor=anchor)
        # every new node goes in before the anchor (the first projection) is erased
        pieces = [call(graph, operator.getitem, outs, i, anchor=anchor) for i in range(len(group))]
        views = [call(graph, torch.reshape, piece, tuple(value(m["rope"]["out"]).shape), anchor=anchor)
                 if m["rope"] else piece for m, piece in zip(group, pieces)]
        paths = [module_path(m["linear"]).split(".") for m in group]
        order = {node: i for i, node in enumerate(graph.nodes)}
        for m, new in zip(group, views):
            if m["rope"]:
                m["rope"]["out"].replace_all_uses_with(new)
                # the arithmetic, then the table views only it used (users before producers)
                erase_replaced(graph, sorted(m["rope"]["sub"], key=order.__getitem__, reverse=True),
                               m["rope"]["externals"])
            else:
                m["linear"].replace_all_uses_with(new)
                erase_replaced(graph, [m["linear"]], [])
        common = []
        for parts in zip(*paths):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        where = ".".join(common) if len(group) > 1 else ".".join(paths[0][:-1])
        why = "" if backend == "triton" else f"; not triton: {why_not_triton(*fakes, widths, head_dims)}"
        rope_text = (f"RoPE {rope['style']} r={rope['rotary']} on {len(ropes)} of them"
                     if rope else "no RoPE")
        cast_text = f" in {dtype} (autocast: the inputs cast to it)" if casts else ""
        log.matches.append(Match(anchor.name, where or "<top>", KERNEL.format(
            backend=backend, n=len(group), s="s" if len(group) > 1 else "", N=sum(widths), cast=cast_text,
            rope=rope_text, why=why)))


PASS = ProjectionsRope()
