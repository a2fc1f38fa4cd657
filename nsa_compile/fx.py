"""Helpers for reading and editing Dynamo (torch IR) FX graphs.

Torch IR is not normalized: the same op can be a function (`torch.matmul`), an operator
(`a @ b`) or a method (`a.matmul(b)`), with arguments positional or keyword. These helpers
give passes one way to ask.
"""

from __future__ import annotations

import contextlib
import operator
import re

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_leaves

__all__ = ["op_name", "arg", "value", "module_path", "call", "constant", "size", "MATMULS", "contiguous_if_read_by_layout"]

# op_name() of every node that computes a (batched) matrix product.
MATMULS = ("matmul", "bmm")

_FUNCTION_NAMES = {operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "bmm"}


def op_name(node: fx.Node) -> str | None:
    """A canonical name for call_function / call_method nodes ('matmul', 'transpose', ...)."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        if node.target in _FUNCTION_NAMES:
            return _FUNCTION_NAMES[node.target]
        return getattr(node.target, "__name__", None)
    return None


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument `name` of a call, given positionally at `index` (method: self is index 0)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def value(node) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for a node (None for non-tensors and constants)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


_PREFIX = re.compile(r"^(L\[['\"](self|fn|mod)['\"]\]|L__self__|self)\.?")


def size_value(x):
    """An int as it is, the SymInt a size node stands for; None for anything else."""
    if isinstance(x, fx.Node):
        x = x.meta.get("example_value", x.meta.get("val"))
    return x if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) else None


def same(a, b) -> bool:
    """Two sizes (ints or SymInts), or two shapes (tuples, lists or torch.Size of them), equal for
    every value of their symbols, decided without adding a guard (statically_known_true: a guard
    on a size specializes a dynamic graph, see nsa_compile/sizes.py; an equality it cannot decide
    is False). Plain ints compare as ints."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def module_path(node: fx.Node) -> str:
    """The user's module path of a node ('blocks.0.attn'), from Dynamo's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top>"
    path = list(stack.values())[-1][0]
    path = _PREFIX.sub("", str(path))
    path = re.sub(r"\[['\"]?([\w.]+)['\"]?\]", r".\1", path).strip(".")
    return path or "<top>"


def call(graph: fx.Graph, target, *args, anchor: fx.Node, **kwargs) -> fx.Node:
    """Insert `target(*args, **kwargs)` before `anchor`, with its fake value and anchor's metadata."""
    with graph.inserting_before(anchor):
        node = graph.call_function(target, args, kwargs)
    fakes = fx.node.map_arg((args, kwargs), lambda n: n.meta.get("example_value", n.meta.get("val")))
    modes = [x.fake_mode for x in tree_leaves(fakes) if hasattr(x, "fake_mode")]
    mode = modes[0] if modes else None
    if mode is not None:
        # No new guards: a pass proves its preconditions statically (statically_known_true), so
        # the rewritten graph is valid wherever the original graph's guards hold. Guards added
        # here would only narrow that, and on PyTorch 2.11 one on a product of sizes refined
        # every symbol to its first value (a recompile per shape under dynamic=True).
        shape_env = getattr(mode, "shape_env", None)
        no_guards = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
        with mode, no_guards:
            node.meta["example_value"] = target(*fakes[0], **fakes[1])
    else:
        # size arithmetic (sym_size nodes and ints): SymInts compute without a fake mode, and with
        # no new guards for the same reason
        sizes = [x for x in tree_leaves(fakes) if isinstance(x, torch.SymInt)]
        if sizes:
            with sizes[0].node.shape_env.suppress_guards():
                node.meta["example_value"] = target(*fakes[0], **fakes[1])
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in anchor.meta:
            node.meta[key] = anchor.meta[key]
    return node


def constant(graph: fx.Graph, target, *args, like: fx.Node, anchor: fx.Node, **kwargs) -> fx.Node:
    """Insert `target(*args, **kwargs)`, a tensor made from python values only (torch.tensor,
    torch.arange), before `anchor`, its fake value made in the fake mode of `like`'s value."""
    with graph.inserting_before(anchor):
        node = graph.call_function(target, args, kwargs)
    with value(like).fake_mode:
        node.meta["example_value"] = target(*args, **kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in anchor.meta:
            node.meta[key] = anchor.meta[key]
    return node


def size(graph: fx.Graph, node: fx.Node, dim: int, anchor: fx.Node):
    """Size `dim` of the tensor `node`: an int when static, else a new `sym_size` node (a SymInt).

    Passes give views their sizes this way instead of -1: under dynamic shapes an inferred -1
    becomes an expression such as s1 // (s1 // s2) that the shape environment cannot simplify,
    and its guards on it can specialize every size to the first input's (seen on PyTorch 2.11).
    """
    val = value(node).shape[dim]
    if isinstance(val, int):
        return val
    return call(graph, torch.ops.aten.sym_size.int, node, dim % value(node).dim(), anchor=anchor)


# Ops whose result may alias their input's memory (its strides follow the input's).
_ALIASING = {"reshape", "transpose", "permute", "getitem", "select", "narrow", "unsqueeze", "squeeze", "expand",
             "expand_as", "flatten", "unflatten", "split", "chunk", "unbind", "movedim", "swapaxes", "t"}
# Ops that read a tensor's memory layout: as_strided reads other elements under other strides,
# view fails on some layouts.
_READ_LAYOUT = {"as_strided", "view", "view_as"}


def contiguous_if_read_by_layout(graph: fx.Graph, new: fx.Node, old: fx.Node, anchor: fx.Node) -> fx.Node:
    """`new` (a replacement holding `old`'s values) made contiguous when `old` was and `new` is
    not and a use of `old`, directly or through views, reads the memory layout (as_strided,
    view): Dynamo bakes the strides it saw into such calls (and drops a `.contiguous()` of a
    contiguous tensor), so a rewrite must not change them. Otherwise `new` as it is."""
    if not value(old).is_contiguous() or value(new).is_contiguous():
        return new
    stack, seen = [old], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            name = op_name(user)
            if name in _READ_LAYOUT:
                return call(graph, torch.Tensor.contiguous, new, anchor=anchor)
            if name in _ALIASING and user not in seen:
                seen.add(user)
                stack.append(user)
    return new
