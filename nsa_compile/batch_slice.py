"""A region of a static graph evaluated on one batch row, where it keeps its batch rows apart.

A pass that verifies a region by evaluating it (probe.py) runs the region at the graph's shapes.
Some regions materialize per-query copies of K and V (lucidrains' fine branch gathers [B, G, S,
(n + 1) l', D]) or per-bucket scores, and at a realistic batch one probe would take tens of GB.
Attention regions treat dim 0 as the batch: each batch row's output is a function of that row's
inputs only. Where that is so, the region on one batch row computes the same function as on B,
and the probe can run at B = 1.

`one_row(nodes, inputs, out, batch)` proves it op by op from the recorded shapes and arguments, and
returns the argument changes that make the region run on one row (each size argument that names
the batch, e.g. `view(B, G, S, ..)` or `expand(B, ..)`, becomes 1); else it raises Refused with
the first op that would mix rows. The rules, for every node that reads a batched tensor (an input,
or a node computed from one):

- its result is batched too: a tensor whose dim 0 is the batch (size B);
- pointwise ops (arithmetic, comparisons, masks, casts, where): every other tensor operand of the
  result's rank has dim 0 of size 1 or is batched (an unbatched [B, ..] constant would pair its
  rows with the batch rows);
- ops with a dim argument (softmax, reductions, top-k, sort, gather, cat, flatten, transpose, ...)
  never name dim 0 (a full reduction, `flip(0)` or `sum(0)` is refused); permute keeps dim 0 first;
  indexing keeps dim 0 whole (`x[:, ..]`, `x[..., i]`);
- views and expands keep dim 0: their first size is B (or -1) on a batched input;
- a matrix product of batched operands of rank >= 3 (dim 0 is a batch dim of the product), or of
  a batched [B, K] left operand;
- this project's ops (torch.ops.nsa.*) and SDPA: batched by definition of their [B, ..] layouts.

Any other op refuses: a check that does not know an op does not guess. Nodes that read no batched
tensor (position tables, masks from arange) run unchanged. Sizes are read as numbers, so symbolic
graphs (Dynamo's dynamic shapes) are not handled here: their probes run at probe sizes already
(sizes.py).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .attention_match import Refused
from .fx import op_name, value
from .probe import element_budget, repeat_as_expand

__all__ = ["one_row", "peak_elements", "probe_rows"]

POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "floordiv", "floor_divide", "mod", "remainder", "pow",
    "masked_fill", "masked_fill_", "where", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert",
    "bitwise_not", "bitwise_and", "bitwise_or", "logical_not", "logical_and", "logical_or", "exp", "exp2", "log",
    "sqrt", "rsqrt", "abs", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "sigmoid", "relu", "tanh",
    "nan_to_num", "float", "half", "bfloat16", "double", "long", "int", "bool", "to", "type", "type_as",
    "contiguous", "clone", "detach", "zeros_like", "ones_like", "full_like", "empty_like",
}
# ops with dim arguments: (positional index, keyword) of each; a missing one has the default given
DIM_ARGS = {
    "softmax": [(1, "dim")], "log_softmax": [(1, "dim")], "sum": [(1, "dim")], "mean": [(1, "dim")],
    "amax": [(1, "dim")], "amin": [(1, "dim")], "max": [(1, "dim")], "min": [(1, "dim")], "any": [(1, "dim")],
    "all": [(1, "dim")], "argmax": [(1, "dim")], "argmin": [(1, "dim")], "cumsum": [(1, "dim")],
    "topk": [(2, "dim")], "sort": [(1, "dim")], "argsort": [(1, "dim")], "gather": [(1, "dim")],
    "index_select": [(1, "dim")], "take_along_dim": [(2, "dim")], "repeat_interleave": [(2, "dim")],
    "unsqueeze": [(1, "dim")], "squeeze": [(1, "dim")], "select": [(1, "dim")], "narrow": [(1, "dim")],
    "unflatten": [(1, "dim")], "split": [(2, "dim")], "chunk": [(2, "dim")], "unbind": [(1, "dim")],
    "transpose": [(1, "dim0"), (2, "dim1")], "movedim": [(1, "source"), (2, "destination")],
    "flatten": [(1, "start_dim")], "cat": [(1, "dim")], "stack": [(1, "dim")],
}
# a missing dim argument means: the last dim (-1), every dim (None: refused), or dim 0 for cat/stack
DIM_DEFAULTS = {"softmax": None, "log_softmax": None, "topk": -1, "sort": -1, "argsort": -1, "flatten": 0,
                "cat": 0, "stack": 0, "squeeze": None, "repeat_interleave": None, "unbind": 0, "split": 0,
                "chunk": 0, "take_along_dim": None}
VIEWS = {"view", "reshape", "expand", "repeat"}
FACTORIES = {"zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full", "new_empty"}
MATMULS = {"matmul", "bmm"}
LAST_TWO = {"tril", "triu"}
# ops that return a view of their input (no new memory): not counted by peak_elements
VIEW_OPS = {"view", "expand", "permute", "transpose", "unsqueeze", "squeeze", "getitem", "select", "narrow",
            "unflatten", "detach", "t", "movedim", "split", "chunk", "unbind", "alias"}
# ... and these, of a contiguous input (else they may copy)
RESHAPES = {"flatten", "reshape"}


def peak_elements(nodes: list[fx.Node], shape_of, batched: set | None = None, rows: int | None = None) -> int:
    """The most elements the tensors of `nodes` hold at once while probe.run evaluates them in
    order, freeing each value after its last reader among `nodes` (those no node reads, the
    output among them, are held to the end); a view (VIEW_OPS, an in-place op, a flatten or
    reshape of a contiguous tensor, a repeat that probe.run evaluates as an expand) holds its
    base's memory until the base and all its views are freed, and adds none. The region's inputs are not
    counted. `shape_of(tensor)` gives the sizes (sizes.Sizes.shape); with `batched` and `rows`, the
    batched nodes count `rows` batch rows."""
    inside = set(nodes)
    last = {i: step for step, node in enumerate(nodes) for i in node.all_input_nodes if i in inside}
    base, holders, size = {}, {}, {}  # node -> the node owning its memory; owner -> its live nodes; owner -> elements
    live = peak = 0
    for step, node in enumerate(nodes):
        name = op_name(node) or ""
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        if source is not None and (name in VIEW_OPS or name.endswith("_") or _expanded_repeat(node, shape_of)
                                   or (name in RESHAPES and _contiguous(source))):
            owner = base.get(source)  # None: a view of an input (not counted)
        else:
            owner, size[node] = node, _elements(node, shape_of, batched, rows)
            live += size[node]
        base[node] = owner
        if owner is not None:
            holders.setdefault(owner, set()).add(node)
        peak = max(peak, live)
        for i in set(node.all_input_nodes):
            if last.get(i) == step and base.get(i) is not None:
                held = holders[base[i]]
                held.discard(i)
                if not held:
                    live -= size[base[i]]
    return peak


def _contiguous(node: fx.Node) -> bool:
    val = value(node)
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _expanded_repeat(node: fx.Node, shape_of) -> bool:
    """A repeat that probe.run evaluates as a view (probe.repeat_as_expand): it holds no memory."""
    source = node.all_input_nodes[0] if node.all_input_nodes else None
    val = value(source) if source is not None else None
    return isinstance(val, torch.Tensor) and node.args[:1] == (source,) and \
        repeat_as_expand(node, shape_of(val), node.args[1:]) is not None


def _elements(node: fx.Node, shape_of, batched: set | None, rows: int | None) -> int:
    """The elements of the node's tensor, or of the tensors of its tuple (topk, sort, split: their
    getitems are views of it)."""
    val = value(node)
    tensors = [val] if isinstance(val, torch.Tensor) else \
        [t for t in val if isinstance(t, torch.Tensor)] if isinstance(val, (tuple, list)) else []
    total = 0
    for t in tensors:
        shape = shape_of(t)
        count = 1
        for d in shape:
            count *= d
        if batched is not None and node in batched and shape and count:
            count = count // shape[0] * rows
        total += count
    return total


def probe_rows(nodes: list[fx.Node], inputs: list[fx.Node], out: fx.Node, at, what: str,
               float32_ok: bool = False) -> tuple[int | None, dict, torch.dtype]:
    """How a probe of the region at the sizes `at` (sizes.Sizes) runs: (None, {}, float64) where it
    fits element_budget whole (at the graph's batch), else (1, changes, float64) where it keeps its
    batch rows apart and one row fits (probe.run takes the changes); with `float32_ok` (a check
    whose tolerance allows float32 rounding) the same two in float32, whose budget holds twice the
    elements, where float64 fits neither way; else Refused saying why."""
    device = value(inputs[0]).device
    budget = element_budget(device)
    cost = peak_elements(nodes, at.shape)
    if cost <= budget:
        return None, {}, torch.float64
    over = f"verifying {what} takes {cost:,} elements per probe, over the budget of {budget:,} on {device.type}"
    if at.symbolic:
        raise Refused(f"{over} (a graph with symbolic sizes is not run on one batch row)")
    try:
        changes, batched = one_row(nodes, inputs, out, at.shape(value(inputs[0]))[0])
    except Refused as why:
        changes, batched, why_not = None, None, why
    one = peak_elements(nodes, at.shape, batched, 1) if changes is not None else None
    if one is not None and one <= budget:
        return 1, changes, torch.float64
    budget32 = element_budget(device, torch.float32) if float32_ok else None
    if float32_ok:
        if cost <= budget32:
            return None, {}, torch.float32
        if one is not None and one <= budget32:
            return 1, changes, torch.float32
    if one is None:
        raise Refused(f"{over}, and it cannot run on one batch row: {why_not}")
    in_float32 = f" ({budget32:,} in float32)" if float32_ok else ""
    raise Refused(f"{over}{in_float32}, {one:,} on one batch row: not verified at this size yet")


def one_row(nodes: list[fx.Node], inputs: list[fx.Node], out: fx.Node, batch: int) -> tuple[dict, set]:
    """(changes, batched): `changes` maps each node whose arguments name the batch to its (args,
    kwargs) on one row, for probe.run; `batched` holds the nodes whose dim 0 is the batch. Refused
    where the region does not keep its `batch` rows apart (module docstring)."""
    if batch < 2:
        raise Refused(f"the batch is {batch}: nothing to slice")
    batched: set = set()
    for x in inputs:
        val = value(x)
        if val is None or val.dim() == 0 or val.shape[0] != batch:
            raise Refused(f"the input {x.name} is not [B = {batch}, ..]")
        batched.add(x)
    changes = {}
    for node in nodes:
        reads = [x for x in node.all_input_nodes if x in batched]
        if not reads:
            if _makes_batch(node, batch):  # zeros(B, ..) or expand(B, ..) of a row-independent tensor
                changes[node] = _one_row_sizes(node, batch)
                batched.add(node)
            continue
        _check(node, batched, batch)
        batched.add(node)
        if op_name(node) in VIEWS:
            changes[node] = _one_row_sizes(node, batch)
    if out not in batched:
        raise Refused(f"the region's output {out.name} is not computed from the batched inputs")
    return changes, batched


def _result_rank(node: fx.Node) -> int | None:
    val = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(val, torch.Tensor):
        return val.dim()
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return val[0].dim()
    return None


def _dim0(val, batch: int) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape[0] == batch


def _check(node: fx.Node, batched: set, batch: int) -> None:
    """Refused unless `node`, which reads a batched tensor, keeps the batch rows apart."""
    name = op_name(node) or str(node.target)
    where = f"{node.name} ({name})"
    rank = _result_rank(node)
    val = node.meta.get("example_value", node.meta.get("val"))
    results = val if isinstance(val, (tuple, list)) else [val]
    if rank is None or not all(_dim0(v, batch) for v in results if isinstance(v, torch.Tensor)):
        raise Refused(f"{where} does not give a [B = {batch}, ..] result: the batch rows mix")
    if node.op == "call_function" and node.target is operator.getitem:
        _check_index(node, where)
        return
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        if str(node.target).startswith("nsa."):
            return  # this project's ops: [B, ..] in and out, rows apart by definition
    if name == "scaled_dot_product_attention":
        return _check_operands(node, batched, batch, rank, where)
    if name in POINTWISE or name in MATMULS or name == "pad" or name in LAST_TWO or name == "linear":
        if name in MATMULS and rank < 3 and any(x in batched for x in node.args[1:2]):
            raise Refused(f"{where}: the batched tensor is the right operand of a 2-D product (its dim 0 is summed)")
        if name in LAST_TWO and rank < 3:
            raise Refused(f"{where} on a 2-D [B, ..] tensor: dim 0 is one of its two dims")
        if name == "pad":
            widths = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad", ())
            if len(widths) // 2 >= rank:
                raise Refused(f"{where} pads dim 0")
        return _check_operands(node, batched, batch, rank, where)
    if name in VIEWS:
        return _check_operands(node, batched, batch, rank, where)
    if name == "permute":
        dims = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (tuple, list)) else node.args[1]
        if dims[0] % rank != 0:
            raise Refused(f"{where} moves dim 0")
        return
    if name in DIM_ARGS:
        for index, key in DIM_ARGS[name]:
            dim = node.args[index] if len(node.args) > index else node.kwargs.get(key, DIM_DEFAULTS.get(name, "?"))
            if dim is None or dim == "?":
                raise Refused(f"{where} over every dim (or an unread dim argument): it reads across the batch")
            dims = dim if isinstance(dim, (tuple, list)) else [dim]
            in_rank = value(node.args[0]).dim() if value(node.args[0]) is not None else rank
            width = rank if name in ("unsqueeze", "stack") else in_rank
            if any(d % width == 0 for d in dims):
                raise Refused(f"{where} over dim 0, the batch")
        return _check_operands(node, batched, batch, rank, where)
    raise Refused(f"{where} is not an op known to keep batch rows apart")


def _check_operands(node: fx.Node, batched: set, batch: int, rank: int, where: str) -> None:
    """Every tensor operand of the result's rank is batched or has dim 0 of size 1 (broadcast)."""
    for x in node.all_input_nodes:
        val = value(x)
        if x in batched or val is None or val.dim() < rank:
            continue
        if val.shape[0] != 1:
            raise Refused(f"{where} pairs the batch rows with the rows of {x.name} {tuple(val.shape)}, "
                          "which is not batched")


def _check_index(node: fx.Node, where: str) -> None:
    index = node.args[1]
    source = node.args[0].meta.get("example_value", node.args[0].meta.get("val"))
    if isinstance(source, (tuple, list)):
        return  # one result of topk, sort, split, ...: each is [B, ..] (checked as the result)
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index):
        raise Refused(f"{where}: a tensor index (the kept dims may move)")
    first = index[0] if index else slice(None)
    if first is Ellipsis:
        if len([i for i in index[1:] if i is not None]) >= _result_rank(node.args[0]):
            raise Refused(f"{where} indexes dim 0")
        return
    if first != slice(None):
        raise Refused(f"{where} indexes dim 0, the batch")


def _sizes(node: fx.Node) -> tuple[int, list, bool]:
    """(position, sizes, listed): where the sizes start in node.args, the sizes, and whether they
    are one list argument (`view((B, G, ..))`) rather than one argument each (`view(B, G, ..)`)."""
    # a method (`x.view(..)`, or `torch.Tensor.view(x, ..)` as the passes insert it) or torch.reshape
    # takes the tensor first; a factory (`torch.zeros(B, ..)`) takes the sizes first
    start = 1 if node.args and isinstance(value(node.args[0]), torch.Tensor) else 0
    rest = node.args[start:]
    if rest and isinstance(rest[0], (tuple, list, torch.Size)):
        return start, list(rest[0]), True
    return start, list(rest), False


def _makes_batch(node: fx.Node, batch: int) -> bool:
    """A factory, or an expand or repeat of unbatched values (one copy for every row), whose result
    has dim 0 = B from its first size."""
    if op_name(node) not in FACTORIES | {"expand", "repeat"}:
        return False
    _, sizes, _ = _sizes(node)
    return bool(sizes) and sizes[0] == batch and _dim0(value(node), batch)


def _one_row_sizes(node: fx.Node, batch: int) -> tuple[tuple, dict]:
    """node's (args, kwargs) with its first size, where it is the batch, as 1."""
    start, sizes, listed = _sizes(node)
    if not sizes or sizes[0] != batch:
        return node.args, node.kwargs  # -1 or 1: one row follows from the input
    one = (1, *sizes[1:])
    if listed:
        return (*node.args[:start], one, *node.args[start + 1:]), node.kwargs
    return (*node.args[:start], *one), node.kwargs
