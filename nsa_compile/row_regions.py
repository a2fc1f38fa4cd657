"""Running a written region of the user's graph for a chunk of query rows.

The varlen verifications of select_blocks and selected_attention run a region of the graph
(`compressed_attention.written_region`: what computes a mask or a block choice, the in-place writes
into it included) on probe inputs and compare its result with the op's, every element. Over packed
tokens the model's own region holds [H, T, T] or [H, T, N] tensors (xunhaolai_varlen: a dense mask
over all the packed documents), 5e10 elements at T = 65,536. `RowRegion` runs the region for query
rows r0..r1 only: each node's value cut to those rows along its row dim, computed from its inputs'
cut values, so a verification costs O(rows * width) memory at any T and every element is still
computed (as nsa_compile/mask_rows.py does for masks from positions, here with data and writes).

A value is either whole (computed as the graph computes it: what has no query-row dim, e.g.
positions, aranges, per-document constants, the compressed keys) or `Rows`: rows lo..hi of a tensor
whose row dim `dim` spans the sequence's rows a..b (all T, or one document's slice of them). Where
they come from: the leaves named with their row dim (a [H, T, D] query probe: dim 1), and a
creation (zeros, ones, full, empty) with a dim of T elements (at its first such dim: the mask
`zeros(G, T, T)` is rows of [G, T] columns). How each op carries them:

- element-wise ops (with broadcasting) and in-place arithmetic: the Rows operands must share one
  range and their row dim's place from the right; a whole operand is cut along the dim it aligns
  with there when that dim holds the range's b - a rows (a per-document [2, 45, 6] zeros meeting
  that document's ids), and broadcast as it is when it holds 1;
- `getitem` and `setitem` with basic indices (slices, None, Ellipsis, ints off the row dim): a
  slice of the row dim is a sub-range (`ids[:, a:b]` is the document's rows a..b), rebased onto the
  chunk (empty where the chunk misses it); `setitem` with a bool tensor index cuts the index alike;
- reductions, softmax, topk, sort, cumsum, scatter, repeat_interleave, pad along other dims;
  shape ops (unsqueeze, squeeze, permute, transpose, view, reshape, expand, flatten, unflatten,
  contiguous, clone) move the row dim; matmul with the rows on the left operand; tril/triu with the
  row dim second to last (the diagonal shifted by the chunk's first row).

Any other op on Rows, or a row dim that would be reduced, gathered along or mixed with another
range, is refused with the node's name. A check on the probe values given, as the whole-region
evaluation is; the chunks only bound its memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .attention_match import Refused, call_node
from .fx import op_name, value
from .mask_rows import POINTWISE, real_device

__all__ = ["CHUNK_ELEMENTS", "Rows", "RowRegion"]

# Elements of the widest node of a region for one chunk of rows (64M: a [12, rows, 65536] bool mask
# takes 85 rows, 64 MB; the varlen verifications' Python work grows with the number of chunks).
CHUNK_ELEMENTS = 2**26

ELEMENTWISE = POINTWISE | {
    "nan_to_num", "exp", "log", "sqrt", "rsqrt", "div", "truediv", "__truediv__", "pow", "sigmoid", "type_as", "sign",
    "iadd", "isub", "imul", "itruediv", "iand", "ior", "__iadd__", "__isub__", "__imul__", "__iand__", "__ior__",
    "masked_fill_", "clamp_", "fill_",
}
CREATIONS = {"zeros": 0, "ones": 1, "full": None, "empty": 0}
# ops along one dim that keep the others: (the position of their dim argument, its name, its default)
ALONG = {"softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "cumsum": (1, "dim", None),
         "topk": (2, "dim", -1), "sort": (1, "dim", -1), "argsort": (1, "dim", -1),
         "repeat_interleave": (2, "dim", None), "roll": (2, "dims", None), "flip": (1, "dims", None)}  # fmt: skip
REDUCTIONS = {"sum", "any", "all", "amax", "amin", "mean", "max", "min", "prod"}
RESHAPES = {"view", "reshape", "expand", "flatten", "unflatten", "expand_as", "view_as", "reshape_as"}
AS_IS = {"contiguous", "clone", "detach"}


@dataclass
class Rows:
    """Rows lo..hi (global query rows) of a tensor whose dim `dim` spans rows a..b: t.shape[dim] ==
    hi - lo, a <= lo <= hi <= b."""

    t: torch.Tensor
    dim: int
    a: int
    b: int
    lo: int
    hi: int

    def like(self, t: torch.Tensor, dim: int) -> "Rows":
        return Rows(t, dim, self.a, self.b, self.lo, self.hi)


class RowRegion:
    """`region` (nodes in graph order, as written_region gives them) run for query rows r0..r1 of
    T: `run(r0, r1, inputs)` -> {node: value} (whole values or Rows). `inputs` maps the region's
    leaves to tensors (cut here along their row dim `row_dims[leaf]`, or kept whole when the leaf
    has none) or to Rows (a previous region's output for the same chunk)."""

    def __init__(self, region: list[fx.Node], T: int, row_dims: dict[fx.Node, int], what: str):
        self.region, self.T, self.row_dims, self.what = region, T, row_dims, what
        # each value's last reader in the region (a chunk's values are dropped after it)
        self.last_use = {x: i for i, node in enumerate(region) for x in node.all_input_nodes}

    def rows_per_chunk(self, elements: int) -> int:
        """Rows per chunk so that no node of the region holds more than about `elements` elements
        (its full size over T per row; at least 1)."""
        width = 1
        for node in self.region:
            fake = value(node)
            if isinstance(fake, torch.Tensor) and self.T in tuple(fake.shape):
                width = max(width, math.prod(int(s) for s in fake.shape) // self.T)
        return max(1, elements // width)

    def run(self, r0: int, r1: int, inputs: dict, keep=()) -> dict:
        """{node: value} for rows r0..r1: the nodes in `keep` (and those no node of the region reads)
        at least; a value is dropped after its last reader, so a chunk holds few at once."""
        env = {}
        for leaf, x in inputs.items():
            if isinstance(x, Rows) or leaf not in self.row_dims:
                env[leaf] = x
            else:
                dim = self.row_dims[leaf] % x.dim()
                env[leaf] = Rows(x.narrow(dim, r0, r1 - r0), dim, 0, self.T, r0, r1)
        for i, node in enumerate(self.region):
            missing = [n for n in node.all_input_nodes if n not in env]
            if missing:
                raise Refused(f"evaluating {self.what} in row chunks: {node.name} reads {missing[0].name}, which the "
                              "check has no value for")
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            env[node] = self.step(node, args, kwargs, r0, r1)
            for x in node.all_input_nodes:
                if self.last_use.get(x) == i and x not in keep:
                    env.pop(x, None)
        return env

    # --- one node -------------------------------------------------------------------------------

    def step(self, node: fx.Node, args, kwargs, r0: int, r1: int):
        name = op_name(node) or ""
        rows = [x for x in _leaves((args, kwargs)) if isinstance(x, Rows)]
        if not rows:
            if name in CREATIONS:
                return self.create(node, name, args, kwargs, r0, r1)
            fake = value(node)
            if (name in ELEMENTWISE and isinstance(fake, torch.Tensor) and self.T in tuple(fake.shape)
                    and fake.numel() > CHUNK_ELEMENTS):
                # a large product of positions alone (t[:, None] >= t[None, :]): rows of it, at its first T dim
                dim = tuple(fake.shape).index(self.T)
                rows = [Rows(torch.empty((0,) * fake.dim()), dim, 0, self.T, r0, r1)]
            else:
                return call_node(node, args, kwargs, f"{self.what} (row chunks)")
        refuse = lambda why: Refused(f"{self.what} is not verified in row chunks: {node.name} ({name}) {why}")
        if name in ELEMENTWISE:
            return self.elementwise(node, args, kwargs, refuse, rows[0])
        first = args[0] if args else None
        if name == "getitem" and isinstance(first, (tuple, list)):  # an output of topk or sort
            return first[args[1]]
        if name == "scatter":  # the indices (rows) written into a whole per-document tensor, or rows
            like = rows[0]
            dim = (args[1] if len(args) > 1 else kwargs["dim"]) % like.t.dim()
            if dim == like.dim:
                raise refuse("scatters along the row dim")
            cut = [self.cut(x, like, refuse) for x in args]
            return like.like(call_node(node, tuple(cut), kwargs, self.what), like.dim)
        if not isinstance(first, Rows):
            raise refuse("reads rows in an operand other than its first")
        if name == "getitem":
            return self.getitem(first, args[1], refuse)
        if name == "setitem":
            self.setitem(first, args[1], args[2], refuse)
            return None
        if name in AS_IS:
            return first.like(call_node(node, (first.t, *args[1:]), kwargs, self.what), first.dim)
        if name in ("unsqueeze", "squeeze", "permute", "transpose", "t", "movedim") or name in RESHAPES:
            return self.reshape(node, first, refuse)
        if name in ALONG or name in REDUCTIONS:
            return self.along(node, name, first, args, kwargs, refuse)
        if name in ("matmul", "bmm"):
            if any(isinstance(x, Rows) for x in args[1:]) or first.dim != first.t.dim() - 2:
                raise refuse("has its rows other than as the left operand's rows")
            out = call_node(node, (first.t, *args[1:]), kwargs, self.what)
            return first.like(out, out.dim() - 2)
        if name in ("tril", "triu"):
            if first.dim != first.t.dim() - 2:
                raise refuse("has its rows off the second-to-last dim")
            diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
            return first.like(getattr(torch, name)(first.t, diagonal + first.lo - first.a), first.dim)
        if name == "pad":
            pad = args[1] if len(args) > 1 else kwargs["pad"]
            if first.dim >= first.t.dim() - len(pad) // 2:
                raise refuse("pads the row dim")
            return first.like(call_node(node, (first.t, *args[1:]), kwargs, self.what), first.dim)
        raise refuse("is not an op the row chunks carry")

    def create(self, node: fx.Node, name: str, args, kwargs, r0: int, r1: int):
        fake = value(node)
        shape = tuple(int(x) for x in fake.shape)
        if self.T not in shape:
            return call_node(node, args, kwargs, self.what)
        dim = shape.index(self.T)
        fill = CREATIONS[name]
        if fill is None:
            fill = kwargs.get("fill_value", args[1] if len(args) > 1 else None)
        chunk = shape[:dim] + (r1 - r0,) + shape[dim + 1:]
        device = kwargs.get("device") or real_device(fake)
        return Rows(torch.full(chunk, fill, dtype=fake.dtype, device=device), dim, 0, self.T, r0, r1)

    def cut(self, x, like: Rows, refuse):
        """A whole operand `x` meeting rows `like`: cut along the dim aligned with like's row dim
        (counted from the right, as broadcasting aligns dims) where it holds like's b - a rows;
        as it is where that dim is 1 or missing. A Rows operand must have like's range."""
        if isinstance(x, Rows):
            if (x.a, x.b, x.lo, x.hi) != (like.a, like.b, like.lo, like.hi) or \
                    x.t.dim() - x.dim != like.t.dim() - like.dim:
                raise refuse(f"mixes rows {x.a}..{x.b} with rows {like.a}..{like.b} (or at another dim)")
            return x.t
        if not isinstance(x, torch.Tensor):
            return x
        at = x.dim() - (like.t.dim() - like.dim)
        if at < 0 or x.shape[at] == 1:
            return x
        if x.shape[at] != like.b - like.a:
            raise refuse(f"broadcasts {tuple(x.shape)} against rows {like.a}..{like.b}")
        return x.narrow(at, like.lo - like.a, like.hi - like.lo)

    def elementwise(self, node: fx.Node, args, kwargs, refuse, like: Rows):
        args, kwargs = torch.utils._pytree.tree_map(lambda x: self.cut(x, like, refuse), (args, kwargs),
                                                    is_leaf=lambda x: isinstance(x, Rows))
        out = call_node(node, args, kwargs, self.what)
        return like.like(out, out.dim() - (like.t.dim() - like.dim))

    def index(self, x: Rows, index, refuse) -> tuple[tuple, tuple[int, int, int, int, int]]:
        """(the index into x.t, (the result's row dim, a, b, lo, hi)) for a basic index of x's full
        value."""
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, (torch.Tensor, list)) for i in index):
            raise refuse("indexes with a tensor")
        used = sum(1 for i in index if i is not None and i is not Ellipsis)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (x.t.dim() - used) + index[at + 1:]
        index = index + (slice(None),) * (x.t.dim() - sum(1 for i in index if i is not None))
        out, src, out_dim, rows = [], 0, 0, None
        for i in index:
            if i is None:
                out.append(None)
                out_dim += 1
                continue
            if src == x.dim:
                if not isinstance(i, slice) or i.step not in (None, 1):
                    raise refuse("indexes the row dim with other than a slice")
                start, stop, _ = i.indices(x.b - x.a)
                a, b = x.a + start, x.a + max(start, stop)
                lo, hi = max(x.lo, a), min(x.hi, b)
                if lo >= hi:  # the chunk misses these rows: none of them, at the range's nearer end
                    lo = hi = min(max(x.lo, a), b)
                    out.append(slice(0, 0))
                else:
                    out.append(slice(lo - x.lo, hi - x.lo))
                rows = (out_dim, a, b, lo, hi)
            else:
                out.append(i)
            if not isinstance(i, int):
                out_dim += 1
            src += 1
        return tuple(out), rows

    def getitem(self, x: Rows, index, refuse):
        local, (dim, a, b, lo, hi) = self.index(x, index, refuse)
        return Rows(x.t[local], dim, a, b, lo, hi)

    def setitem(self, x: Rows, index, v, refuse) -> None:
        if isinstance(index, (torch.Tensor, Rows)):  # a bool mask over x's full value
            mask = self.cut(index, x, refuse)
            x.t[mask] = self.cut(v, x, refuse) if isinstance(v, (torch.Tensor, Rows)) else v
            return
        local, (dim, a, b, lo, hi) = self.index(x, index, refuse)
        target = Rows(x.t[local], dim, a, b, lo, hi)
        if isinstance(v, (torch.Tensor, Rows)):
            v = self.cut(v, target, refuse)
        x.t[local] = v

    def along(self, node: fx.Node, name: str, x: Rows, args, kwargs, refuse):
        if name in ALONG:
            at, key, default = ALONG[name]
            dim = args[at] if len(args) > at else kwargs.get(key, default)
            keep = True
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keep = (args[2] if len(args) > 2 else kwargs.get("keepdim", False)) is True
        if dim is None:
            raise refuse("reduces or flattens every dim, the rows included")
        dims = [d % x.t.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,))]
        if x.dim in dims:
            raise refuse("works along the row dim")
        out = call_node(node, (x.t, *args[1:]), kwargs, self.what)
        row = x.dim if keep else x.dim - sum(d < x.dim for d in dims)
        if isinstance(out, tuple):  # topk, sort, max(dim): values and indices
            return tuple(x.like(o, row) for o in out)
        return x.like(out, row)

    def reshape(self, node: fx.Node, x: Rows, refuse):
        """A shape op: the row dim found in the full output shape (the fake value) as the dim whose
        size is the range's and whose leading elements match the input's before its row dim."""
        full_in = tuple(int(s) for s in value(node.args[0]).shape) if isinstance(node.args[0], fx.Node) else None
        full_out = tuple(int(s) for s in value(node).shape)
        if full_in is None:
            raise refuse("has no traced input shape")
        n = x.b - x.a
        before = math.prod(full_in[:x.dim])
        name = op_name(node)
        if name in ("permute", "transpose", "t", "movedim"):
            perm = _permutation(name, node, len(full_in))
            row = perm.index(x.dim)
            return x.like(x.t.permute(perm), row)
        if name in ("expand", "expand_as"):  # dims aligned from the right; the row dim is not expanded
            row = x.dim + len(full_out) - len(full_in)
            chunk = full_out[:row] + (x.hi - x.lo,) + full_out[row + 1:]
            return x.like(x.t.expand(chunk), row)
        rows_at = [k for k in range(len(full_out)) if full_out[k] == n and math.prod(full_out[:k]) == before]
        if not rows_at or full_in[x.dim] != n:
            raise refuse(f"reshapes {full_in} to {full_out} across the row dim")
        row = rows_at[0]
        chunk = full_out[:row] + (x.hi - x.lo,) + full_out[row + 1:]
        try:
            return x.like(x.t.view(chunk), row)
        except RuntimeError:
            return x.like(x.t.reshape(chunk), row)


def _permutation(name: str, node: fx.Node, rank: int) -> list[int]:
    """The dims of the input in the output's order, for permute / transpose / t / movedim."""
    args = node.args[1:]
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        return [d % rank for d in dims]
    perm = list(range(rank))
    if name == "t":
        return perm[::-1]
    if name == "transpose":
        i, j = (d % rank for d in args[:2])
        perm[i], perm[j] = perm[j], perm[i]
        return perm
    src, dst = (d % rank for d in args[:2])  # movedim with ints
    perm.pop(src)
    perm.insert(dst, src)
    return perm


def _leaves(tree) -> list:
    return torch.utils._pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Rows))
