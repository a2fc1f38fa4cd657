"""Evaluating attention masks computed from positions, for real, in chunks of query rows.

The window and compressed passes prove a mask by computing it at compile time and comparing it
with the formula of their op, every element. A mask over [S, C] scores (C = S keys for the window,
C = Tc compression slots) is S * C elements per batch row: 4.3e9 at S = 64k. `RowChunks` computes
rows r0..r1 of the masks at a time, so that verifying them costs O(rows * C) memory at any S, yet
every element is computed (a proof for the shape, or for the probe positions a packed mask reads).

Nodes whose value is small (aranges, [S, 1] and [1, C] position vectors, the [B, S] positions of
packed documents and what is computed from them alone) are computed once, whole. A node that makes
an [S, C] tensor, or reads one, must be row-local, so that rows r0..r1 of it are computed from rows
r0..r1 of its inputs: an element-wise op (POINTWISE), a constant fill, tril/triu (rows r0.. of
tril(x, k) are tril(rows, k + r0)), a view that only adds or drops leading size-1 dims, or a
reduction over the last dim that keeps it (ROW_REDUCTIONS: visible.any(-1, keepdim=True), one
value per row). Anything else is refused with its name.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .attention_match import Refused, call_node
from .fx import arg, op_name, value
from .sizes import Sizes

__all__ = ["CHUNK_ELEMENTS", "RowChunks", "mask_nodes", "real_device"]

# Elements of one row chunk of a mask (rows = CHUNK_ELEMENTS // (batch * C)).
CHUNK_ELEMENTS = 2**24

# Ops that act element by element (with broadcasting): rows r0..r1 of their output are the op
# applied to rows r0..r1 of their [.., S, C] inputs.
POINTWISE = {
    "add", "sub", "rsub", "mul", "neg", "abs", "floordiv", "floor_divide", "remainder", "mod",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert", "logical_and", "logical_or",
    "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor",
    "__and__", "__or__", "__xor__", "__invert__", "where", "to", "bool", "int", "long", "clamp",
    "clamp_min", "clamp_max", "minimum", "maximum", "masked_fill", "float", "double", "half", "bfloat16",
    # the same as tensor methods: PyTorch 2.11's Dynamo records `a == b` on tensors as a.__eq__(b)
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__mul__", "__rmul__", "__neg__", "__floordiv__", "__mod__",
}
CREATIONS = {"ones": 1, "zeros": 0, "full": None, "ones_like": 1, "zeros_like": 0, "full_like": None}
BANDS = ("tril", "triu")
SHAPE_ONLY = {"view", "reshape", "unsqueeze", "squeeze", "expand", "contiguous", "clone", "detach", "getitem"}
# Reductions over the last dim with keepdim=True: rows r0..r1 of the result reduce rows r0..r1.
ROW_REDUCTIONS = {"any", "all", "sum", "amax", "amin"}
_RANDOM = ("rand", "bernoulli", "dropout", "multinomial", "normal", "poisson", "uniform", "exponential")


def mask_nodes(roots: list[fx.Node], leaf: fx.Node | None = None, known=(), what: str = "mask") -> list[fx.Node]:
    """The subgraph of the masks `roots` in graph order (not walking into `leaf`, a packed form's
    positions, nor into the `known` nodes: sizes, given as numbers); Refused if it reads anything
    but positions, or draws random numbers."""
    order, seen, stack = [], set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is leaf or node in known:
            continue
        if node.op not in ("call_function", "call_method"):
            raise Refused(f"the {what} depends on {node.op} {node.name} (data, not positions)")
        name = op_name(node) or ""
        if any(word in name for word in _RANDOM):
            raise Refused(f"the {what} uses {name} (random, not positions)")
        order.append(node)
        stack.extend(node.all_input_nodes)
    index = {n: i for i, n in enumerate(roots[0].graph.nodes)}
    return sorted(order, key=index.__getitem__)


def real_device(fake: torch.Tensor) -> torch.device:
    """The device a fake tensor stands for (CPU for meta)."""
    return fake.device if fake.device.type != "meta" else torch.device("cpu")


def _run(node: fx.Node, args, kwargs, what: str):
    """node's value from the values of its arguments; the user's code failing on them (positions it
    may not expect) refuses, naming `what` and the node; running out of memory is raised."""
    if any(isinstance(x, torch.SymInt) for x in torch.utils._pytree.tree_leaves((args, kwargs))):
        raise Refused("the mask has symbolic sizes (dynamic shapes): not verified")
    return call_node(node, args, kwargs, f"the {what}")


def _is_shape_only(node: fx.Node) -> bool:
    """A view of one input that only adds or drops leading size-1 dims (mask[None, None],
    unsqueeze(0), view(1, 1, S, S), ...): its rows are its input's rows. Indexing that is not
    None / ... / a full slice (mask[::-1], mask[1:]) is not."""
    name = op_name(node) or ""
    if name not in SHAPE_ONLY or len(node.all_input_nodes) != 1:
        return False
    if name == "getitem":
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in index)
    return True


def _reduces_rows(node: fx.Node, shapes: dict) -> bool:
    """x.any(-1, keepdim=True) and the like (ROW_REDUCTIONS): one value per row of x."""
    if (op_name(node) or "") not in ROW_REDUCTIONS or len(node.all_input_nodes) != 1:
        return False
    rank = len(shapes[node.all_input_nodes[0]])
    dim, keep = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim % rank == rank - 1 and keep is True


class RowChunks:
    """Rows r0..r1 of the masks `roots` over [.., S, C] scores, computed for real: `chunks(r0, r1)`
    gives each root's rows as [r1 - r0, c] (no positions) or [B, r1 - r0, c] (positions), where
    c is the root's last dim: C, or 1 for a column (one value per row, broadcast by the caller).

    A packed mask reads positions: `positions` = (leaf, probe) takes the node `leaf` to be the
    tensor `probe` [B, S]. Its nodes may then carry the batch: a small node up to 4 * B * S
    elements, a row node one leading dim of B.

    A graph with symbolic sizes is evaluated under `sizes` (one number per size symbol: S and C
    must be the numbers it gives the masks' sizes); its size nodes (s27, s27 // 4) enter as
    numbers. `what` names the masks and `grid` their [S, C] pattern in the reasons.
    """

    def __init__(self, roots: list[fx.Node], S: int, C: int, positions: tuple[fx.Node, torch.Tensor] | None = None,
                 sizes: Sizes | None = None, what: str = "mask", grid: str = "[S, S]"):
        self.roots, self.S, self.C, self.what = roots, S, C, what
        self.leaf, probe = positions or (None, None)
        self.batch = 1 if probe is None else probe.shape[0]
        sizes = sizes or Sizes.of(roots[0].graph)
        self.numbers = sizes.size_nodes()
        nodes = mask_nodes(roots, self.leaf, self.numbers, what)
        self.shapes = {}
        for node in nodes:
            fake = value(node)
            if fake is None:
                raise Refused(f"the {what} node {node.name} has no traced value (cannot verify it)")
            self.shapes[node] = sizes.shape(fake)
        per = "" if self.leaf is None else " per batch row"
        self.small = dict(self.numbers) if self.leaf is None else {self.leaf: probe, **self.numbers}
        self.rows_of = []  # the nodes computed per chunk, in graph order
        for node in nodes:
            shape = self.shapes[node]
            reads_rows = any(n in self.rows_of for n in node.all_input_nodes)
            if math.prod(shape) <= 4 * S * self.batch and not reads_rows:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.small[n])
                self.small[node] = _run(node, args, kwargs, what)
                continue
            if not self._is_rows(shape):
                if reads_rows and math.prod(shape) <= 4 * S * self.batch:
                    raise Refused(f"the {what} reduces an {grid} tensor at {node.name} (not verified in chunks)")
                raise Refused(f"the {what} node {node.name} is {shape}, not one {grid} pattern{per} for all heads")
            name = op_name(node) or ""
            row_local = (name in POINTWISE or name in CREATIONS or name in BANDS or _is_shape_only(node)
                         or _reduces_rows(node, self.shapes))
            if not row_local:
                raise Refused(f"the {what} uses {name} on an {grid} tensor (only element-wise ops, fills, "
                              "tril/triu and views are verified in chunks)")
            self.rows_of.append(node)
        for root in roots:
            lead = [d for d in self.shapes.get(root, ())[:-2] if d != 1]
            if lead and lead != [self.batch]:
                raise Refused(f"the {what} {root.name} is {self.shapes[root]}, not one {grid} pattern{per} for all "
                              "heads")

    def _is_rows(self, shape) -> bool:
        """[..., S, C] (or [..., S, 1]: one value per row) with leading dims of 1, except (packed
        masks, batch > 1) one of the batch size."""
        lead = [d for d in shape[:-2] if d != 1]
        return (len(shape) >= 2 and shape[-2] == self.S and shape[-1] in (self.C, 1)
                and (not lead or (self.batch > 1 and lead == [self.batch])))

    def __call__(self, r0: int, r1: int) -> list[torch.Tensor]:
        S, env = self.S, {}

        def chunk_of(n: fx.Node):
            if n in env:
                return env[n]
            x = self.small[n]  # broadcast operand: slice its row dim when it spans the S rows
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] == S:
                return x[..., r0:r1, :]
            return x

        for node in self.rows_of:
            name = op_name(node) or ""
            shape = self.shapes[node][:-2] + (r1 - r0, self.shapes[node][-1])
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), chunk_of)
            made = name in CREATIONS and all(n in self.numbers for n in node.all_input_nodes)  # sizes only
            if made or name in ("ones_like", "zeros_like", "full_like"):
                fill = CREATIONS[name]
                if fill is None:
                    fill = kwargs.get("fill_value", args[-1] if name == "full_like" else args[1])
                fake = value(node)
                env[node] = torch.full(shape, fill, dtype=fake.dtype, device=real_device(fake))
            elif name in BANDS:
                x = args[0]
                diagonal = (args[1] if len(args) > 1 else kwargs.get("diagonal", 0)) + r0
                env[node] = getattr(torch, name)(x, diagonal)
            elif name in POINTWISE or name in ROW_REDUCTIONS:
                env[node] = _run(node, args, kwargs, self.what)
            elif args[0].numel() == math.prod(shape):
                env[node] = args[0].reshape(shape)  # a view that adds or drops leading size-1 dims
            else:  # a packed mask's rows expanded over the batch
                env[node] = torch.broadcast_to(args[0], shape)
        out = []
        for root in self.roots:
            shape = self.shapes[root]
            cols = shape[-1] if shape else 1  # C, or 1 for one value per row (not broadcast: no copy)
            rows = torch.broadcast_to(chunk_of(root), shape[:-2] + (r1 - r0, cols))
            out.append(rows.reshape(r1 - r0, cols) if self.leaf is None else
                       rows.reshape(-1, r1 - r0, cols).expand(self.batch, r1 - r0, cols))  # leading dims: 1, or B
        return out
