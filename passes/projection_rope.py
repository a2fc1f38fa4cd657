"""projection_rope: the Linear projections of one input -> one GEMM over their concatenated
weights, with the RoPE of the rotated ones applied in that GEMM's epilogue.

Matches (torch IR), per input node x (models/nsa.py `NSAAttention.forward`; tests/corpus/):
    y_i = F.linear(x, W_i[, b_i])                     # every projection of the same x: q, k_c, v_c, the gate
    q, k, v = y.split(sizes, -1)                      # optional: a fused Linear split by its columns
    out_i = rope(piece_i)                             # optional: arithmetic that is a rotation
It reads, top to bottom:

- anchor: the F.linear nodes of one input x, grouped by the dtype they compute in;
- pieces: a projection whose output is only split by columns is taken apart, each piece a
  projection by its rows of the weight: split / chunk / slices of the last dim, or a view to
  [B, S, n, H, D] (any permute of it) then unbind / select / indexing along n. The views are run
  on index codes (nsa_compile/probe.py): a piece is a node whose values are the columns
  [a, a + n) of the output laid out as [B, S, n], [B, S, h, D] or [B, h, S, D]. Pieces that meet
  again in the RoPE arithmetic (the two halves of a single head) are not taken apart, and a
  split projection none of whose pieces is rotated stays whole;
- region: the nodes reachable from a piece through _ROPE_OPS whose every input is in the region
  or independent of the projection; for the output of each closed such subgraph of shape
  [B, S, heads, D] or heads-first [B, heads, S, D] (largest first) the tables are found by
  walking up from what the arithmetic reads, through views, casts and signs of one tensor (a
  cat may repeat it), to where that chain starts (any other op, or one that reads a second
  tensor: the gather cos[pos] reads pos); on each chain the table is the node nearest its start
  whose value has a table's shape (the gather, not cos and pos: the op reads its value,
  whatever computed it). Either two real tables, or one complex table (`view_as_complex`
  arithmetic: its real part is the cosine, its imaginary part the sine);
- parameters and verify: the subgraph is evaluated in float64 on random y and random tables
  (whatever values the model's tables hold) against the rotation formula, for both conventions
  (rotate-half: pairs (j, j + R/2); interleaved: pairs (2j, 2j + 1)), either table as cos and
  either sign of the angle (x*cos - rotate(x)*sin: the op is given -sin), the first R of each
  head's D dims rotated (partial rotary), the rest passed through. Tables are [S, F] or
  [1 or B, S, F] with any size-1 dims between, of one entry per pair (F = R/2) or one per column
  (F = R: the full-width tables of `x * cos + rotate_half(x) * sin`, cached as cat([f, f]) or
  f.repeat_interleave(2); the op reads them as they are, `full_tables`, assuming nothing of
  their values). Its ops being linear in y and polynomial in the tables, one random probe tells
  a rotation from anything else.
  Identical subgraphs (one per layer) are evaluated once per graph; tables computed the same
  way twice (once for q, once for k) are one table pair;
- replace: tables computed after the group's first projection are moved before it (they do not
  depend on it), then the op below is inserted before that projection.

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
    w = torch.cat([W_1, ..., W_n])                    # the module's own parameters (or row ranges
    b = torch.cat([b_i or zeros])                     #   of them), every call: autograd splits dW back
    outs = torch.ops.nsa.projection_rope(x, w, b, cos, sin, widths, head_dims, style, backend, full_tables)
(x, W_i, b_i each cast to the group's compute dtype first where they are not in it: autocast)
and each piece (unrotated) or out_i (rotated, viewed as [B, S, heads, D] or [B, heads, S, D]) is
replaced by its piece of the op: one GEMM instead of n, no eager RoPE arithmetic, each piece
written straight into its own contiguous tensor. The backend is chosen from the fake tensors and
written into the graph (`triton` on CUDA in fp16/bf16, else `reference`; explain says why).

The projection read before its RoPE too (lucidrains compresses k, and scores the compressed
branch with q, before RoPE): the values of the RoPE subgraph computed from the projection alone
(the piece, its views, halves and casts: `unrotated`) may have readers outside the rotation.
The op then also returns that piece unrotated (`plain`: the same GEMM, its result stored before
and after the rotation), the piece's node is replaced by that output, and those readers, with
the views between, keep computing from it. A value that reads the tables (x1 * cos) used
elsewhere is a partial result of the rotation, which the op does not return: refused.

Symbolic sizes (dynamic shapes: Dynamo's graph after a length changes, B and S as symbols,
nsa_compile/sizes.py): the views of a split projection and the RoPE probe run with numbers for
the symbols, at every probe size (the sizes Dynamo saw, then each symbol +1 and +19: another
parity and residue), and must find the same pieces and the same rotation at each; the graph's
size nodes (`s27`, `s27 // 4`) enter the evaluation as numbers and are neither tables nor data.
The rewrite writes no size as a number: the pieces' views read B and S from the op's output
(sym_size) and the tables' reshape from the tables. Checked on probe sizes, as the window mask
is: not a proof for every size.

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
  scale, one table used twice), that reads other than two real tables or one complex one,
  tables that require grad or have another shape (another length than S, or [B, 1, R/2]: one
  angle per row), a rotary dim over the head dim, a result in another dtype than the projection (a bf16 projection times float32
  tables is float32 by type promotion, the op's pieces are in the projection's dtype), a partial
  result of the rotation (a value that reads the tables, x * cos) used elsewhere (the reason
  names its reader and the reader's source line), tables computed after the first projection
  that cannot be moved before it (an autocast boundary or an impure op on the way), a second
  RoPE convention or table pair in the same group;
- at symbolic sizes (below): RoPE arithmetic that is not the same rotation at every probe size
  (the reason names the size where it fails), or whose output or tables carry other sizes than
  the projection's B and S;
- more than MAX_PIECES projections of one input are split into several groups (not refused).
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile import probe
from nsa_compile.attention_match import Refused, ancestors, erase_replaced
from nsa_compile.coverage import user_line
from nsa_compile.fx import arg, call, contiguous_if_read_by_layout, module_path, op_name, size, value
from nsa_compile.ops import rope_triton
from nsa_compile.ops.rope import choose_backend, rotate, why_not_triton
from nsa_compile.rewrite import Match, PassContext, RewritePass
from nsa_compile.sizes import Sizes, is_size

from .autocast_casts import ENTER_AUTOCAST as _ENTER_AUTOCAST
from .autocast_casts import EXIT_AUTOCAST as _EXIT_AUTOCAST
from .autocast_casts import AutocastRegions

MAX_PIECES = rope_triton.MAX_PIECES
# The probe evaluates the RoPE subgraph at the real shape, in float64, on the graph's device:
# larger projections are not verified (the seed model at batch 8, S = 8192: 50M elements).
MAX_VERIFIED_ELEMENTS = 2**28
# Columns of a merged projection without RoPE come in whole multiples of this (16 bytes of bf16):
# a piece of another width stays apart (ProjectionRope.aligned)
COLUMN_ALIGN = 8
KERNEL = "nsa.projection_rope[{backend}] ({n} projection{s}{of} -> 1 GEMM of {N} columns{cast}; {rope}{why})"

# Ops the RoPE arithmetic may use on the projection (all linear in it, none random or in place).
_ROPE_OPS = {
    "getitem", "view", "reshape", "unflatten", "flatten", "unsqueeze", "squeeze", "contiguous", "clone",
    "narrow", "select", "chunk", "split", "unbind", "tensor_split", "view_as", "reshape_as", "expand",
    "expand_as", "neg", "mul", "add", "sub", "cat", "concat", "concatenate", "stack", "to", "type_as",
    "float", "half", "bfloat16", "double", "transpose", "permute", "movedim", "view_as_complex", "view_as_real",
}
# Ops the table side may use between a table and the arithmetic (data movement, casts, a sign).
_TABLE_OPS = {
    "getitem", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "to",
    "type_as", "float", "half", "bfloat16", "double", "cat", "concat", "concatenate", "stack", "repeat",
    "repeat_interleave", "flatten", "unflatten", "contiguous", "clone", "view_as", "narrow", "select", "neg",
    "transpose", "permute",
}
# Ops that take a projection's output apart by columns (pieces) without computing anything.
_VIEW_OPS = {
    "view", "reshape", "unflatten", "flatten", "permute", "transpose", "contiguous", "getitem", "select", "narrow",
    "movedim", "swapaxes", "squeeze", "unsqueeze",
}
_SPLIT_OPS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}
# Table-side ops that must not be moved before the first projection (random, in place).
_IMPURE_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "manual_seed")


def shape_at(node: fx.Node, what: str, sizes: Sizes) -> tuple[int, ...]:
    """The node's tensor shape as numbers under `sizes` (a static graph's: its own)."""
    val = value(node)
    if val is None:
        raise Refused(f"the {what} has no recorded tensor value")
    return sizes.shape(val)


def static_shape(node: fx.Node, what: str) -> tuple[int, ...]:
    val = value(node)
    if val is None:
        raise Refused(f"the {what} has no recorded tensor value")
    if not all(is_concrete_int(d) for d in val.shape):
        raise Refused(f"the {what} has symbolic sizes {tuple(val.shape)} (dynamic shapes): not verified yet")
    return tuple(int(d) for d in val.shape)


def check_linear(linear: fx.Node, regions: AutocastRegions) -> tuple[fx.Node, fx.Node | None, torch.dtype]:
    """(weight, bias, the dtype it computes in) of F.linear(x, weight, bias), or Refused."""
    x, weight, bias = arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or not (bias is None or isinstance(bias, fx.Node)):
        raise Refused("the projection's input, weight or bias is not a tensor in the graph")
    # the lead dims of x may be symbolic (dynamic shapes: RoPE is then probed at probe sizes),
    # the weight's may not
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


def op_table_dims(shape: tuple, B: int, S: int) -> tuple[int, ...] | None:
    """The dims of a table of `shape` that make the [S, F] or [Bt, S, F] shape the op reads it as
    (any size-1 dims around S dropped: [S, 1, F] for [B, S, h, D] arithmetic, [1, 1, S, F] for
    heads-first), or None."""
    if (len(shape) == 2 and shape[0] == S) or (len(shape) == 3 and tuple(shape[:2]) in ((1, S), (B, S))):
        return tuple(range(len(shape)))
    kept = [i for i, d in enumerate(shape[:-1]) if d != 1]
    if [shape[i] for i in kept] in ([S], [B, S]):
        return (*kept, len(shape) - 1)
    return None


def op_table(shape: tuple, B: int, S: int) -> tuple[int, ...] | None:
    """The [S, F] or [Bt, S, F] shape the op reads a table of `shape` as (op_table_dims), or None."""
    dims = op_table_dims(shape, B, S)
    return None if dims is None else tuple(shape[i] for i in dims)


def table_layout(node: fx.Node, B: int, S: int, sizes: Sizes) -> tuple[int, ...] | None:
    """op_table of the node's value (its sizes as numbers under `sizes`) when it is a float or
    complex tensor, else None."""
    val = value(node)
    if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()):
        return None
    return op_table(sizes.shape(val), B, S)



def follows(shape: tuple, lead: tuple) -> bool:
    """Whether every symbolic size in `shape` is, for any value of the symbols, one of the sizes
    in `lead` (the projection's lead dims, the only sizes the op's pieces carry)."""
    return all(is_concrete_int(d) or any(statically_known_true(d == t) for t in lead) for d in shape)


def shape_from(graph: fx.Graph, shape: tuple, source: fx.Node, anchor: fx.Node) -> tuple:
    """`shape` as view arguments: its ints as they are, each symbolic size as a sym_size of the
    dim of `source` that is that size (`follows` checked it is one), so that no number that
    depends on a size is written into the graph."""
    dims = value(source).shape
    return tuple(int(d) if is_concrete_int(d) else
                 size(graph, source, next(j for j, t in enumerate(dims) if statically_known_true(d == t)), anchor)
                 for d in shape)


def tokens(shape: tuple, layout: str) -> tuple[int, int]:
    """(B, S) of a projection or RoPE output of `shape` in `layout` (packed tokens [N, ...]: 1, N)."""
    if layout == "heads-first":
        return shape[0], shape[-2]
    if layout == "packed" or len(shape) == 2:
        return 1, shape[0]
    return shape[0], shape[1]


def as_bsn(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A probe value laid out as `layout` as [B, S, n]: 'bsn' [B, S, n] (or [N, n]),
    'tokens-first' [B, S, *heads, D], 'heads-first' [B, *heads, S, D], 'packed' [N, *heads, D]."""
    B, S = tokens(tuple(t.shape), layout)
    if layout == "heads-first":
        t = t.movedim(-2, 1)
    return t.reshape(B, S, -1)


def rope_layouts(shape: tuple, B: int, S: int, n: int) -> list[str]:
    """How a [B, S, n] piece can be split into heads of D in a tensor of `shape` (heads in one
    dim or more: [B, H, S, D], [B, G, h, S, D])."""
    found = []
    if len(shape) >= 4 and shape[:2] == (B, S) and math.prod(shape[2:]) == n:
        found.append("tokens-first")
    if len(shape) >= 4 and shape[0] == B and shape[-2] == S and math.prod(shape[1:-2]) * shape[-1] == n:
        found.append("heads-first")
    if len(shape) >= 3 and B == 1 and shape[0] == S and math.prod(shape[1:]) == n:
        found.append("packed")
    return found


@dataclass
class Member:
    """One projection of a group: a Linear, or a column range of one (a piece of a fused Linear)."""

    linear: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    dtype: torch.dtype
    node: fx.Node  # the tensor holding the projection: the linear itself, or a split / view of it
    start: int  # its first column of the linear's output
    width: int
    layout: str  # 'bsn' [*lead, width], 'tokens-first', 'heads-first' or 'packed' (as_bsn)
    rope: dict | None = None
    late: bool = False


class ProjectionsRope(RewritePass):
    name = "projection_rope"
    summary = "Linear projections of one input (+ their RoPE) -> one GEMM with RoPE in its epilogue"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            if op_name(node) == "linear" and node.graph is graph and isinstance(arg(node, 0, "input"), fx.Node):
                groups.setdefault(arg(node, 0, "input"), []).append(node)
        regions = AutocastRegions(graph)
        sizes = Sizes.of(graph)  # numbers for the size symbols of a graph with dynamic shapes
        verified: dict = {}  # structure of a RoPE subgraph -> its hypothesis (one per layer is the same)
        keys: dict = {}  # what each table node computes, as a number (tables computed twice are one)
        for linears in groups.values():
            # one GEMM computes in one dtype: the projections of x are grouped by the dtype they
            # compute in (they differ where autocast is on for some and off for others)
            by_dtype: dict[torch.dtype, list[Member]] = {}
            for linear in linears:
                try:
                    weight, bias, dtype = check_linear(linear, regions)
                except Refused as why:
                    ctx.refused(linear, str(why))
                    continue
                by_dtype.setdefault(dtype, []).extend(
                    Member(linear, weight, bias, dtype, node, start, width, layout)
                    for node, start, width, layout in self.pieces(linear, sizes))
            for dtype, members in by_dtype.items():
                # a lone projection is rewritten only for its RoPE
                if len(members) > 1 or any(self.rope_candidate(m.node) for m in members):
                    for m in members:  # (RoPE-less ones, the v projections, return None at once)
                        try:
                            m.rope = self.find_rope(m, order, verified, keys, sizes)
                        except Refused as why:
                            ctx.refused(m.node, f"RoPE left eager: {why}")
                members = self.whole_unless_rotated(members)
                chunks = self.plan(graph, members, order, ctx)
                order = {node: i for i, node in enumerate(graph.nodes)}  # tables may have moved
                if len(by_dtype) > 1:
                    others = ", ".join(str(d) for d in by_dtype if d != dtype)
                    for m in members:
                        if not m.late and not any(m in chunk for chunk in chunks):
                            ctx.refused(m.linear, f"it computes in {dtype}, the other projections of "
                                                  f"{arg(m.linear, 0, 'input').name} in {others} (autocast on for "
                                                  "some, off for others?): one GEMM computes in one dtype")
                for chunk in chunks:
                    self.rewrite(graph, chunk, ctx)
                    order = {node: i for i, node in enumerate(graph.nodes)}  # the rewrite added nodes

    # --- pieces of a fused projection ----------------------------------------------------------

    def pieces(self, linear: fx.Node, sizes: Sizes) -> list[tuple[fx.Node, int, int, str]]:
        """(node, first column, width, layout) of each piece the projection's output is split
        into (module docstring), or the whole projection [(linear, 0, N, 'bsn')]. With symbolic
        sizes the views are run at every probe size (sizes.probes()) and must give the same pieces
        at each, laid out in the projection's own sizes (else the whole projection)."""
        shape = tuple(value(linear).shape)
        whole = [(linear, 0, shape[-1], "bsn")]
        if len(shape) != 3 or not is_concrete_int(shape[-1]):
            return whole
        children, tree = self.view_tree(linear)
        if len(tree) == 1:
            return whole
        found = None
        for probe_sizes in sizes.probes():
            at = self.pieces_at(linear, children, tree, probe_sizes)
            if at is None or (found is not None and at != found):
                return whole
            found = at
        lead = shape[:-1]
        if sizes.symbolic and not all(follows(tuple(value(node).shape), lead) for node, *_ in found):
            return whole
        return found  # (one piece: the only columns used)

    def pieces_at(self, linear: fx.Node, children: dict, tree: list[fx.Node],
                  sizes: Sizes) -> list[tuple[fx.Node, int, int, str]] | None:
        """The pieces (`pieces`) found by running the views at the sizes `sizes`, or None."""
        B, S, N = sizes.shape(value(linear))
        if max(B * S, N) >= probe.EXACT_BELOW[torch.float32]:
            return None
        # two probes of stride-0 views (no memory): each element's column, each element's token
        device = value(linear).device
        codes = (probe.index_codes((1, 1, N), device, torch.float32).expand(B, S, N),
                 probe.index_codes((B, S, 1), device, torch.float32).expand(B, S, N))
        try:
            values = [probe.run_all(tree[1:], {linear: c, **sizes.size_nodes()}, "the views of the projection",
                                    torch.float32) for c in codes]
        except Refused:
            return None
        found = self.descend(linear, children, values, codes)
        if not found or (len(found) == 1 and found[0][2] == N) or self.meet_again([node for node, *_ in found]):
            return None
        return found

    @staticmethod
    def view_tree(linear: fx.Node) -> tuple[dict, list[fx.Node]]:
        """({node: the tensors made from it by one view or split}, the nodes in graph order): the
        projection's output through ops that move data without computing (_VIEW_OPS, _SPLIT_OPS
        and the getitems of a split), each reading only the tensor before it."""
        children: dict[fx.Node, list[fx.Node]] = {}
        tree, stack = [linear], [linear]
        while stack:
            node = stack.pop()
            kids = []
            for user in node.users:
                name = op_name(user)
                # one tensor read (the sizes of a view under dynamic shapes are nodes too)
                if arg(user, 0, "input") is not node or len([i for i in user.all_input_nodes if not is_size(i)]) != 1:
                    continue
                if name in _SPLIT_OPS and all(op_name(u) == "getitem" for u in user.users):
                    tree.append(user)
                    kids += list(user.users)
                elif name in _VIEW_OPS and isinstance(value(user), torch.Tensor):
                    kids.append(user)
            children[node] = kids
            tree += kids
            stack += kids
        position = {n: i for i, n in enumerate(linear.graph.nodes)}
        return children, sorted(set(tree), key=position.__getitem__)

    def descend(self, node, children, values, codes) -> list[tuple[fx.Node, int, int, str]] | None:
        """The pieces below `node` (a column range of the projection in any layout): the pieces
        of the column ranges it is split into where it is split, else `node` itself when it
        lays its columns out as a piece does (None when it does not)."""
        mine = self.columns(node, values, codes)
        if mine is None:
            return None
        itself = [(node, *mine)] if mine[2] else None
        kids = children.get(node, [])
        whole_use = any(u not in kids and not (op_name(u) in _SPLIT_OPS and all(g in kids for g in u.users))
                        for u in node.users)
        ranges = [self.columns(k, values, codes) for k in kids]
        if whole_use or not kids or any(r is None for r in ranges):
            return itself
        if len(kids) == 1 and ranges[0][:2] == mine[:2]:  # a view of the same columns
            return self.descend(kids[0], children, values, codes) or itself
        spans = sorted(r[:2] for r in ranges)
        if all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:])) and all(w < mine[1] for _, w in spans):
            found = [self.descend(k, children, values, codes) for k in kids]
            return None if any(f is None for f in found) else [p for f in found for p in f]
        return itself

    @staticmethod
    def columns(node: fx.Node, values: list[dict], codes: tuple) -> tuple[int, int, str | None] | None:
        """(first column, width, layout) when `node` holds the columns [a, a + width) of every
        token (its probe values: each element's column and token, 1-based): layout 'bsn',
        'tokens-first' or 'heads-first' when it lays them out as a piece, None when in another
        order (a permute of [B, S, 3, H, D]); None for anything else."""
        column, token = (v[node] for v in values)
        B, S, _ = codes[0].shape
        if column.numel() == 0 or column.numel() % (B * S):
            return None
        width = column.numel() // (B * S)
        start = int(column.min()) - 1
        if int(column.max()) != start + width:
            return None
        shape = tuple(column.shape)
        for layout in (["bsn"] if shape == (B, S, width) else []) + rope_layouts(shape, B, S, width):
            if torch.equal(as_bsn(column, layout), codes[0][:, :, start : start + width]) and \
                    torch.equal(as_bsn(token, layout), codes[1][:, :, start : start + width]):
                return start, width, layout
        return start, width, None

    @staticmethod
    def meet_again(nodes: list[fx.Node]) -> bool:
        """Whether arithmetic reached through RoPE-like ops combines two of these pieces (the
        halves of one head: x1 * cos - x2 * sin), unlike the pieces of a q / k / v split."""
        reached: dict[fx.Node, int] = {}
        for i, node in enumerate(nodes):
            stack = [node]
            while stack:
                for user in stack.pop().users:
                    if op_name(user) not in _ROPE_OPS or reached.get(user) == i:
                        continue
                    if user in reached and op_name(user) in ("add", "sub", "mul"):
                        return True
                    reached[user] = i
                    stack.append(user)
        return False

    @staticmethod
    def whole_unless_rotated(members: list[Member]) -> list[Member]:
        """The pieces of a split projection none of which is rotated, as the one projection."""
        kept, merged = [], set()
        for m in members:
            parts = [p for p in members if p.linear is m.linear]
            if len(parts) == 1 or any(p.rope for p in parts):
                kept.append(m)
            elif m.linear not in merged:
                merged.add(m.linear)
                kept.append(Member(m.linear, m.weight, m.bias, m.dtype, m.linear, 0, value(m.linear).shape[-1], "bsn"))
        return kept

    # --- RoPE recognition -------------------------------------------------------------------------

    @staticmethod
    def rope_candidate(node: fx.Node) -> bool:
        """Whether the projection's output feeds any RoPE-like arithmetic at all (cheap pre-check)."""
        seen, stack = set(), [node]
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

    def region(self, start: fx.Node, linear: fx.Node, order: dict) -> list[fx.Node]:
        """The nodes reachable from the piece `start` through _ROPE_OPS whose every input is either
        in the region or independent of the projection, in graph order (the piece first)."""
        region, rejected = {start}, set()
        first = order[linear]
        memo: dict[fx.Node, bool] = {linear: True}  # other pieces of the projection depend on it too

        def depends(node: fx.Node) -> bool:
            """Whether node depends on the projection (nodes before it cannot); iterative, memoized."""
            stack = [node]
            while stack:
                top = stack[-1]
                if top in region or top in memo or order.get(top, -1) < first:
                    stack.pop()
                    continue
                pending = [i for i in top.all_input_nodes
                           if i not in region and i not in memo and order.get(i, -1) >= first]
                if pending:
                    stack.extend(pending)
                    continue
                memo[top] = any(i in region or memo.get(i, False) for i in top.all_input_nodes)
                stack.pop()
            return node in region or memo.get(node, False)

        heap = [(order[u], u.name, u) for u in start.users]
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

    def find_rope(self, m: Member, order: dict, verified: dict, keys: dict, sizes: Sizes) -> dict | None:
        """The RoPE applied to this projection ({output node, subgraph, tables, style, ...}), None
        when there is no RoPE-like arithmetic, Refused when there is one that is not a rotation.

        With symbolic sizes (dynamic shapes) the search and its probe run at every probe size
        (sizes.probes(): the sizes Dynamo saw, then each symbol +1 and +19) and must find the same
        rotation at each; the rotated output and the tables must then carry the projection's own
        B and S (the sizes of the op's pieces), for any value of the symbols."""
        if not self.rope_candidate(m.node):
            return None
        if value(m.node) is None:
            raise Refused("the projection has no recorded tensor value")
        region = self.region(m.node, m.linear, order)
        found = []
        for probe_sizes in sizes.probes():
            try:
                found.append(self.find_rope_at(m, region, order, verified, keys, probe_sizes))
            except Refused as why:
                if not found:  # at the sizes Dynamo saw (a static graph's only sizes): as it is
                    raise
                raise Refused(f"{why} (at {probe_sizes.describe()}; at {sizes.describe()}: "
                              f"{self.hypothesis(found[0])})") from None
        rope = found[0]
        if not sizes.symbolic:
            return rope
        seen = [self.hypothesis(r) for r in found]
        if len(set(seen)) > 1:
            raise Refused("the arithmetic is not the same rotation at every size: " + "; ".join(
                f"{text} at {p.describe()}" for text, p in zip(seen, sizes.probes())))
        if rope is None:
            return None
        B, S = tokens(tuple(value(m.node).shape), m.layout)
        out_B, out_S = tokens(tuple(value(rope["out"]).shape), rope["out_layout"])
        table = [value(rope["cos"]).shape[i] for i in rope["table_dims"][:-1]]  # [S] or [Bt, S]
        if not (statically_known_true(out_B == B) and statically_known_true(out_S == S)
                and statically_known_true(table[-1] == S)
                and (len(table) == 1 or statically_known_true(table[0] == 1) or statically_known_true(table[0] == B))
                and follows(tuple(value(rope["out"]).shape), tuple(value(m.linear).shape[:-1]))):
            raise Refused(f"the rotated output {tuple(value(rope['out']).shape)} or the tables "
                          f"{tuple(value(rope['cos']).shape)} have sizes that are not, for every value of the size "
                          f"symbols, the projection's B, S = {B}, {S}")
        return rope

    @staticmethod
    def hypothesis(rope: dict | None) -> str:
        """What find_rope_at found, as text without sizes (equal at every probe size, or Refused)."""
        if rope is None:
            return "no rotation"
        negate = ", by the opposite angle" if rope["negate"] else ""
        plain = ", the unrotated projection read too" if rope["plain"] else ""
        return (f"a {rope['style']} rotation r={rope['rotary']} of heads of {rope['head_dim']} with {rope['width']} "
                f"tables {rope['cos'].name}, {rope['sin'].name}{negate} at {rope['out'].name} "
                f"({rope['out_layout']}, table dims {rope['table_dims']}){plain}")

    def find_rope_at(self, m: Member, region: list[fx.Node], order: dict, verified: dict, keys: dict,
                     sizes: Sizes) -> dict | None:
        """find_rope with the sizes `sizes` gives the graph's symbols (a static graph's own)."""
        shape = sizes.shape(value(m.node))
        if m.layout == "bsn" and len(shape) not in (2, 3):
            return None
        B, S = tokens(shape, m.layout)
        first_reason = None
        # candidates: the [B, S, heads, D] / [B, heads, S, D] (/ packed) outputs of closed subgraphs, largest first
        for out in reversed(region[1:]):
            layouts = rope_layouts(sizes.shape(value(out)), B, S, m.width) if value(out) is not None else []
            if not layouts:
                continue
            sub = self.ancestors_in(out, region)
            leaks = [(n, u) for n in sub if n is not out for u in n.users if u not in sub]
            # values computed from the projection alone keep being computed, from the op's plain
            # output; partial results of the rotation (they read the tables) are not returned
            unrotated = self.unrotated(sub)
            partial = [(n, u) for n, u in leaks if n not in unrotated]
            if partial:
                if first_reason is None and any(op_name(n) == "mul" for n in sub):
                    first_reason = Refused(self.partial_use(*partial[0]))
                continue
            if not any(op_name(n) in ("mul", "view_as_complex") for n in sub):
                continue
            for layout in layouts:
                try:
                    return self.verify(m, out, layout, sub, order, verified, keys, B, S, sizes) | {"plain": bool(leaks)}
                except Refused as why:
                    first_reason = first_reason or why
        if first_reason is not None:
            raise first_reason
        return None

    @classmethod
    def unrotated(cls, sub: list[fx.Node]) -> set[fx.Node]:
        """The nodes of the RoPE subgraph `sub` (the piece first, graph order) computed from the
        projection alone: the piece and whatever reads nothing else besides sizes and
        dtype/shape-only inputs (q.transpose(1, 2), its halves, a cast), not the tables."""
        alone = {sub[0]}
        for node in sub[1:]:
            reads = [i for i in node.all_input_nodes if not is_size(i) and i not in cls.like_only(node)]
            if reads and all(i in alone for i in reads):
                alone.add(node)
        return alone

    @staticmethod
    def partial_use(node: fx.Node, reader: fx.Node) -> str:
        """Why a RoPE whose partial result `node` is read by `reader` outside it stays eager, with
        the reader's source line."""
        where, code = user_line(reader)
        line = f" ({where}: {code})" if where else ""
        return (f"values inside the RoPE arithmetic are used elsewhere: {node.name} ({op_name(node)}, a partial "
                f"result of the rotation: it reads the tables) by {reader.name}{line}; the op returns the projection "
                "and its rotation, not values between them")

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
    def tables(sub: list[fx.Node], order: dict, B: int, S: int,
               sizes: Sizes) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
        """(tables, table-side nodes in graph order, the values the subgraph reads besides the
        projection). From each value the arithmetic reads, the walk goes up through _TABLE_OPS that
        move ONE tensor (a cat or stack may repeat it); it stops at any other node (rope_tables'
        cos, a gather cos[pos] that also reads the packed positions, any expression). On that chain
        the table is the node nearest the stop whose value has a table's shape (else the stop
        itself, refused for its shape): the op reads its value, whatever computed it. Sizes (the
        SymInt nodes of a graph with dynamic shapes, given as numbers) are neither tables nor values."""
        inside = set(sub)
        externals = list(dict.fromkeys(i for n in sub[1:] for i in n.all_input_nodes
                                       if i not in inside and i not in ProjectionsRope.like_only(n) and not is_size(i)))
        tables, side = [], set()
        for node in externals:
            chain = [node]  # from the arithmetic up
            while chain[-1].op in ("call_function", "call_method") and op_name(chain[-1]) in _TABLE_OPS and \
                    len(read := [i for i in chain[-1].all_input_nodes if not is_size(i)]) == 1:
                chain.append(read[0])
            shaped = [n for n in chain if table_layout(n, B, S, sizes) is not None]
            table = shaped[-1] if shaped else chain[-1]
            if table not in tables:
                tables.append(table)
            side.update(chain[: chain.index(table)])
        return sorted(tables, key=order.__getitem__), sorted(side, key=order.__getitem__), externals

    @staticmethod
    def like_only(node: fx.Node) -> list[fx.Node]:
        """The inputs `node` reads only for their dtype or shape (x.type_as(t), x.view_as(t), ...)."""
        if op_name(node) in ("type_as", "view_as", "expand_as", "reshape_as") or \
                (op_name(node) == "to" and isinstance(arg(node, 1, "other"), fx.Node)):
            return [n for n in node.args[1:2] if isinstance(n, fx.Node)]
        return []

    def verify(self, m: Member, out: fx.Node, out_layout: str, sub: list[fx.Node], order: dict, verified: dict,
               keys: dict, B: int, S: int, sizes: Sizes) -> dict:
        """The rotation `out` computes from the projection (find_rope's dict), checked on a probe at
        the sizes `sizes` (B, S: the projection's tokens there), or Refused."""
        D = sizes.int(value(out).shape[-1])
        sources, side, externals = self.tables(sub, order, B, S, sizes)
        names = ", ".join(n.name for n in sources)
        vals = [value(n) for n in sources]
        complex_table = len(sources) == 1 and vals[0] is not None and vals[0].is_complex()
        if len(sources) != 2 and not complex_table:
            raise Refused(f"the arithmetic reads {len(sources)} tables besides the projection ({names}); "
                          "RoPE reads two (cos, sin) or one complex table")
        shapes = [shape_at(n, "RoPE table", sizes) for n in sources]
        layout = op_table(shapes[0], B, S)
        if len(set(shapes)) != 1 or layout is None or not all(v.is_floating_point() or complex_table for v in vals):
            pair = " and ".join(str(s) for s in shapes) if len(shapes) == 2 else str(shapes[0])
            raise Refused(f"the tables {names} are {pair}; the op reads two float tables [S, R/2] or "
                          f"[1 or B, S(, 1), R/2] (S = {S}), any size-1 dims between, or one complex table")
        if any(v.requires_grad for v in vals):
            raise Refused(f"the tables {names} require grad; the op gives them none")
        if value(out).dtype != value(m.node).dtype:
            raise Refused(f"the rotated projection is {value(out).dtype} (type promotion with the "
                          f"{', '.join(sorted({str(v.dtype) for v in vals}))} tables), the op returns the projection's "
                          f"{value(m.node).dtype}")
        if B * S * m.width > MAX_VERIFIED_ELEMENTS:
            raise Refused(f"the projection has {B * S * m.width:,} elements, over the cap of "
                          f"{MAX_VERIFIED_ELEMENTS:,} for the probe: not verified at this size yet")
        F = layout[-1]
        # the table widths the rotary dim R fits: one entry per pair [.., R/2] (or complex), per column [.., R]
        widths = [w for w in (["complex"] if complex_table else ["half", "full"])
                  if (F if w == "full" else 2 * F) <= D and (w != "full" or F % 2 == 0)]
        if not widths:
            raise Refused(f"the rotary dim (from the tables {shapes[0]}) exceeds the head dim {D}")
        key = (probe.fingerprint([*side, *sub[1:]], [m.node, *sources]), sub.index(out), sizes.shape(value(m.node)),
               m.layout, out_layout, shapes[0])
        if key not in verified:
            verified[key] = self.probe(m, out, out_layout, sources, side, sub, layout, D, widths, sizes)
        swap, style, negate, width = verified[key]
        if complex_table:
            cos = sin = sources[0]  # its real and imaginary parts
        else:
            cos, sin = sources[::-1] if swap else sources
        R = F if width == "full" else 2 * F
        tables = [self.key(t, keys) for t in (cos, sin)]
        return {"out": out, "out_layout": out_layout, "sub": sub, "externals": externals, "cos": cos, "sin": sin,
                "negate": negate, "style": style, "width": width, "rotary": R, "head_dim": D,
                "table_dims": op_table_dims(shapes[0], B, S),
                "signature": (*tables, negate, style, width, D)}

    @staticmethod
    def key(node: fx.Node, keys: dict) -> int:
        """What a table node computes, as a number: equal numbers for equal computations (graph
        inputs by name, every op with its arguments: q's and k's tables computed twice are one).
        `keys` holds node -> number and each (op, target, arguments) -> number."""
        pending = [node]
        while pending:
            top = pending[-1]
            if top in keys:
                pending.pop()
                continue
            todo = [i for i in top.all_input_nodes if i not in keys]
            if todo:
                pending.extend(todo)
                continue
            if top.op in ("call_function", "call_method"):
                what = (top.op, str(top.target), repr(fx.node.map_arg((top.args, top.kwargs), lambda a: keys[a])))
            else:
                what = (top.op, str(top.target))
            keys[top] = keys.setdefault(what, len(keys))
            pending.pop()
        return keys[node]

    def probe(self, m, out, out_layout, sources, side, sub, layout, D, widths,
              sizes: Sizes) -> tuple[bool, str, bool, str]:
        """(tables swapped, style, angle negated, table width) of the rotation the subgraph
        computes on random y and random tables, or Refused. Widths: 'half' (one entry per pair),
        'full' (one entry per column), 'complex' (one complex table: cos + i sin). Shapes and the
        graph's size nodes take their numbers under `sizes`."""
        device = value(m.node).device
        gen = torch.Generator(device=device).manual_seed(0)
        y = torch.randn(sizes.shape(value(m.node)), generator=gen, device=device, dtype=torch.float64)
        shape = sizes.shape(value(sources[0]))
        rand = lambda: torch.rand(shape, generator=gen, device=device, dtype=torch.float64) * 2 - 1
        if widths == ["complex"]:
            t = [torch.complex(rand(), rand())]
            pairs = [(t[0].real.reshape(layout), t[0].imag.reshape(layout))]
        else:
            t = [rand() for _ in sources]
            pairs = [(t[0].reshape(layout), t[1].reshape(layout))]
            pairs.append(pairs[0][::-1])
        env = {**sizes.size_nodes(), m.node: y, **dict(zip(sources, t))}
        for n in sub[1:]:  # inputs read for their dtype or shape only: any values
            env.update((i, torch.zeros(sizes.shape(value(i)), device=device, dtype=torch.float64))
                       for i in self.like_only(n) if i not in env and i not in sub)
        got = probe.run([*side, *sub[1:]], env, out, "the RoPE arithmetic")
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != sizes.shape(value(out)):
            raise Refused("the RoPE arithmetic evaluates to another shape than traced")
        got, y = as_bsn(got, out_layout), as_bsn(y, m.layout)
        for width in widths:
            for swap, (cos, sin) in enumerate(pairs):
                for style in ("half", "interleaved"):
                    for negate in (False, True):  # negate: a rotation by the opposite angle
                        want = rotate(y, cos, -sin if negate else sin, D, style, full_tables=width == "full")
                        if torch.allclose(got, want, rtol=1e-9, atol=1e-9):
                            return bool(swap), style, negate, width
        raise Refused("the arithmetic on the projection is not a RoPE rotation (checked on random values: "
                      "rotate-half and interleaved, either table as cos, either sign of the angle, tables of one "
                      "entry per pair or per column)")

    # --- grouping and rewriting -----------------------------------------------------------------

    def plan(self, graph: fx.Graph, members: list[Member], order: dict, ctx: PassContext) -> list[list[Member]]:
        """The groups to rewrite: members whose inputs exist before the group's first projection
        (tables computed later are moved before it), one RoPE signature per group, at most
        MAX_PIECES each; lone unrotated projections dropped."""
        if not members:
            return []
        anchor = members[0].linear
        kept = []
        for m in members:
            late = [n for n in (m.weight, m.bias) if n is not None and order[n] >= order[anchor]]
            if late:
                m.late = True
                ctx.refused(m.linear, f"its {late[0].name} is computed after the group's first projection "
                                      f"{anchor.name}: one GEMM cannot read it")
            else:
                kept.append(m)
        signature = next((m.rope["signature"] for m in kept if m.rope), None)
        linears, tables = {m.linear for m in members}, None
        for m in kept:
            rope = m.rope
            if rope is None:
                continue
            if rope["signature"] != signature:
                ctx.refused(m.node, "RoPE left eager: the group already rotates with another table pair, "
                                    "convention or head dim")
                m.rope = None
                continue
            if tables is None:  # the group's table pair: this one's, moved before the anchor if need be
                try:
                    self.hoist(graph, [rope["cos"], rope["sin"]], anchor, linears)
                    tables = rope["cos"], rope["sin"]
                except Refused as why:
                    ctx.refused(m.node, f"RoPE left eager: its tables are computed after the group's first "
                                        f"projection {anchor.name} and cannot be moved before it: {why}")
                    m.rope = None
                    continue
            rope["cos"], rope["sin"] = tables  # the same values (equal signatures): one pair for the op
        kept, apart = self.aligned(kept, ctx)
        chunks = [kept[i : i + MAX_PIECES] for i in range(0, len(kept), MAX_PIECES)]
        return [c for c in chunks if len(c) > 1 or (c and c[0].rope)] + [[m] for m in apart]

    @staticmethod
    def aligned(members: list[Member], ctx: PassContext) -> tuple[list[Member], list[Member]]:
        """(members, apart): the members without the unrotated ones whose width alone keeps the
        op's tiles from being ALIGNED (rope_triton.tiles_aligned), or, without RoPE, whose width is
        not a multiple of COLUMN_ALIGN. Merged, such a projection (a gate of 3 x heads columns)
        saves one read of x and makes every column access of the fused kernel masked, or (no RoPE)
        the merged width odd for cuBLAS: chunked_queries' q, k, v and 36-column gate, 1572 columns,
        took 0.68 ms for the weight gradient on an H100, 3x the time per FLOP of 768 columns
        (0.11 ms; bf16, 65,536 tokens; BENCHMARKS.md, eighteenth session). A whole Linear of them is left to its own GEMM; a piece of a fused Linear is
        returned in `apart`, to be computed by an op of its own (its rows of the weight), so that
        the fused Linear is not computed again for it."""
        rope = next((m.rope for m in members if m.rope), None)

        def fits(group: list[Member]) -> bool:
            if rope is None:  # one GEMM: every piece a whole number of 16-byte columns (COLUMN_ALIGN)
                return all(m.width % COLUMN_ALIGN == 0 for m in group)
            return rope_triton.tiles_aligned([m.width for m in group],
                                             [m.rope["head_dim"] if m.rope else 0 for m in group], rope["rotary"] // 2)

        rotated = [m for m in members if m.rope]
        if fits(members) or not fits(rotated):
            return members, []
        loose = [m for m in members if m.rope is None and not fits(rotated + [m])]
        rest = [m for m in members if m not in loose]
        if not loose or not rest or not fits(rest):
            return members, []
        apart = []
        for m in loose:
            if m.start == 0 and m.width == value(m.linear).shape[-1] and rope is None:
                ctx.refused(m.linear, f"left to its own GEMM: its {m.width} columns are not a multiple of "
                                      f"{COLUMN_ALIGN}, and merged the GEMM's {sum(x.width for x in members)} columns "
                                      "would put the weight gradient on cuBLAS's unaligned kernels")
            elif m.start == 0 and m.width == value(m.linear).shape[-1]:
                ctx.refused(m.linear, f"left to its own GEMM: its {m.width} columns fit no column tile of the "
                                      "rotated projections, and merged they would make every tile of the fused RoPE "
                                      "kernel masked")
            else:
                apart.append(m)
        return rest, apart

    @staticmethod
    def hoist(graph: fx.Graph, tables: list[fx.Node], anchor: fx.Node, linears: set) -> None:
        """Move what computes the tables after `anchor` to before it, or Refused (graph unchanged)."""
        order = {node: i for i, node in enumerate(graph.nodes)}
        needed = ancestors(tables)
        late = sorted((n for n in needed if order[n] > order[anchor]), key=order.__getitem__)
        if not late:
            return
        if needed & linears:
            raise Refused("they are computed from a projection of the group")
        for node in late:
            name = (op_name(node) or "").lower()
            if node.op not in ("call_function", "call_method") or name.endswith("_") or \
                    any(word in name for word in _IMPURE_WORDS) or node.target in (_ENTER_AUTOCAST, _EXIT_AUTOCAST):
                raise Refused(f"{node.name} ({name or node.op}) has effects or randomness")
        between = [n for n in graph.nodes if order[anchor] < order[n] < order[late[-1]]
                   and n.target in (_ENTER_AUTOCAST, _EXIT_AUTOCAST)]
        if between:
            raise Refused(f"an autocast region starts or ends on the way ({between[0].name})")
        for node in late:
            anchor.prepend(node)

    def rewrite(self, graph: fx.Graph, group: list[Member], ctx: PassContext) -> None:
        anchor = group[0].linear
        dtype = group[0].dtype
        casts = []
        before = set(graph.nodes)

        def cast(node: fx.Node) -> fx.Node:
            """node in the group's compute dtype: autocast's cast of a linear's input, made explicit
            (a .to is in no autocast op list: AOTAutograd traces it as it is)."""
            if value(node).dtype == dtype:
                return node
            casts.append(node)
            return call(graph, torch.Tensor.to, node, dtype, anchor=anchor)

        def rows(t: fx.Node, start: int, width: int) -> fx.Node:
            """Rows [start, start + width) of a weight or bias (all of it as it is)."""
            if start == 0 and width == value(t).shape[0]:
                return t
            return call(graph, torch.narrow, t, 0, start, width, anchor=anchor)

        x = cast(arg(anchor, 0, "input"))
        ropes = [m.rope for m in group if m.rope]
        rope = ropes[0] if ropes else None
        if rope and value(x).dim() == 2:  # packed tokens [N, K]: the op rotates [1, N, K]
            x = call(graph, torch.unsqueeze, x, 0, anchor=anchor)
        widths = [m.width for m in group]
        head_dims = [m.rope["head_dim"] if m.rope else 0 for m in group]
        plain = [i for i, m in enumerate(group) if m.rope and m.rope["plain"]]  # also returned unrotated
        # consecutive pieces of one weight as one range (a fused qkv Linear cut in order: its weight
        # itself, no narrow and cat, whose backward was a weight-sized slice_backward per piece);
        # each cast before the cat, as autocast casts each weight (the cat then mixes no dtypes)
        spans = []
        for m in group:
            last = spans[-1][0] if spans else None
            if last is not None and last.weight is m.weight and last.bias is m.bias and \
                    spans[-1][1] + spans[-1][2] == m.start:
                spans[-1][2] += m.width
            else:
                spans.append([m, m.start, m.width])
        spans = [(m, start, width) for m, start, width in spans]
        weights = [cast(rows(m.weight, start, width)) for m, start, width in spans]
        weight = weights[0] if len(weights) == 1 else call(graph, torch.cat, weights, 0, anchor=anchor)
        bias = None
        if any(m.bias is not None for m in group):
            parts = [cast(rows(m.bias, start, width)) if m.bias is not None else
                     call(graph, torch.Tensor.new_zeros, x, (width,), anchor=anchor) for m, start, width in spans]
            bias = parts[0] if len(parts) == 1 else call(graph, torch.cat, parts, 0, anchor=anchor)
        cos = sin = None
        style = rope["style"] if rope else "half"
        if rope:
            cos, sin = (self.op_table(graph, t, rope, anchor) for t in ("cos", "sin"))
            if rope["negate"]:  # the code rotates by -angle: the op gets -sin
                sin = call(graph, torch.neg, sin, anchor=anchor)
        fakes = [value(n) if n is not None else None for n in (x, weight, bias, cos, sin)]
        requested = ctx.config.backend("projection_rope")
        try:
            backend = choose_backend(*fakes, widths, head_dims, requested, plain)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            # the nodes made above feed only each other: erased, the graph is as it was
            for node in reversed([n for n in graph.nodes if n not in before]):
                graph.erase_node(node)
            for m in group:
                ctx.refused(m.linear, f"OptimizeConfig(projection_rope_backend={requested!r}): {why}")
            return
        full = bool(rope) and rope["width"] == "full"
        outs = call(graph, torch.ops.nsa.projection_rope, x, weight, bias, cos, sin, widths, head_dims, style,
                    backend, full, plain, anchor=anchor)
        # every new node goes in before the anchor (the first projection) is erased
        news = [self.laid_out(graph, call(graph, operator.getitem, outs, i, anchor=anchor), m, anchor)
                for i, m in enumerate(group)]
        unrotated = {i: self.laid_out(graph, call(graph, operator.getitem, outs, len(group) + j, anchor=anchor),
                                      group[i], anchor, rotated=False) for j, i in enumerate(plain)}
        paths = [module_path(m.linear).split(".") for m in group]
        order = {node: i for i, node in enumerate(graph.nodes)}
        for i, (m, new) in enumerate(zip(group, news)):
            if m.rope:
                m.rope["out"].replace_all_uses_with(new)
                if i in unrotated:  # what reads the projection before its rotation reads the plain output
                    m.node.replace_all_uses_with(unrotated[i])
                # the arithmetic, then the table views only it used (users before producers); what
                # other code reads (computed from the plain output now) stays
                self.erase_unread(graph, sorted(m.rope["sub"], key=order.__getitem__, reverse=True),
                                  m.rope["externals"])
            else:
                m.node.replace_all_uses_with(new)
                erase_replaced(graph, [m.node], [])
        common = []
        for parts in zip(*paths):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        where = ".".join(common) if len(group) > 1 else ".".join(paths[0][:-1])
        why = "" if backend == "triton" else (f"; not triton: {why_not_triton(*fakes, widths, head_dims, plain)}"
                                              if requested == "auto" else
                                              f"; not triton: projection_rope_backend={requested!r} in OptimizeConfig")
        rope_text = (f"RoPE {rope['style']} r={rope['rotary']} on {len(ropes)} of them" if rope else "no RoPE")
        if rope and rope["width"] != "half":
            rope_text += " (complex tables)" if rope["width"] == "complex" else " (full-width tables)"
        if plain:
            rope_text += f"; {len(plain)} also returned unrotated (read before RoPE)"
        cast_text = f" in {dtype} (autocast: the inputs cast to it)" if casts else ""
        n_linears = len({m.linear for m in group})
        of = f" of {n_linears} Linear{'s' if n_linears > 1 else ''}" if n_linears != len(group) else ""
        ctx.log.matches.append(Match(anchor.name, where or "<top>", KERNEL.format(
            backend=backend, n=len(group), s="s" if len(group) > 1 else "", of=of, N=sum(widths), cast=cast_text,
            rope=rope_text, why=why)))

    @staticmethod
    def op_table(graph: fx.Graph, which: str, rope: dict, anchor: fx.Node) -> fx.Node:
        """The op's [S, F] or [Bt, S, F] table from the model's: reshaped, or the real or
        imaginary part of a complex table."""
        node = rope[which]
        if rope["width"] == "complex":
            node = call(graph, torch.real if which == "cos" else torch.imag, node, anchor=anchor)
        dims = rope["table_dims"]
        if dims != tuple(range(value(node).dim())):  # [Bt, S, 1, R/2] -> [Bt, S, R/2]
            node = call(graph, torch.reshape, node, tuple(size(graph, node, i, anchor) for i in dims), anchor=anchor)
        return node

    @staticmethod
    def erase_unread(graph: fx.Graph, nodes: list[fx.Node], roots: list[fx.Node]) -> None:
        """Erase each of `nodes` (users before producers) that nothing reads any more, then what
        only they and `roots` read (erase_replaced)."""
        inputs = []
        for node in nodes:
            if not node.users:
                inputs += node.all_input_nodes
                graph.erase_node(node)
        erase_replaced(graph, [], [*roots, *inputs])

    @staticmethod
    def laid_out(graph: fx.Graph, piece: fx.Node, m: Member, anchor: fx.Node, rotated: bool = True) -> fx.Node:
        """The op's piece [*lead, width] laid out as what it replaces: the rotated output
        [B, S, heads, D] or [B, heads, S, D], or the projection (piece) in its layout (an
        unrotated piece, or `rotated` False: the plain output of a rotated one). Symbolic sizes are
        read from the piece (shape_from), never written as numbers."""
        layout, shape = (m.rope["out_layout"], tuple(value(m.rope["out"]).shape)) if m.rope and rotated else \
            (m.layout, tuple(value(m.node).shape))
        if layout == "heads-first":  # [B, S, *heads, D] with the token dim moved after the heads
            B, S = tokens(shape, layout)
            piece = call(graph, torch.reshape, piece, shape_from(graph, (B, S, *shape[1:-2], shape[-1]), piece, anchor),
                         anchor=anchor)
            piece = call(graph, torch.movedim, piece, 1, -2, anchor=anchor)
        elif len(value(piece).shape) != len(shape) or \
                not all(statically_known_true(a == b) for a, b in zip(value(piece).shape, shape)):
            piece = call(graph, torch.reshape, piece, shape_from(graph, shape, piece, anchor), anchor=anchor)
        return contiguous_if_read_by_layout(graph, piece, m.rope["out"] if m.rope and rotated else m.node, anchor)


PASS = ProjectionsRope()
