"""canonicalize's `autocast` rule: the casts autocast makes, written into the graph.

Under `torch.autocast` (around the compiled call, as training loops use it), Dynamo records the
user's calls as written, `p @ v` or `softmax(scores, -1)`, and autocast changes their dtypes when
they run: on CUDA a matmul casts its operands to the autocast dtype (bf16), a softmax casts its
input up to float32. The recorded fake values show it (a matmul of two float32 tensors whose
value is bf16; a softmax of bf16 scores whose value is float32), but the nodes do not, so a pass
reading the graph sees a softmax "in bf16 on bf16 scores", or q and keys "of two dtypes", and
refuses a model that is fine.

The rule writes those casts as `x.to(dtype)` nodes before the call, on the inputs whose dtype
differs from the call's recorded output dtype:
- a matmul (`@`, torch.matmul, bmm, mm, einsum): every floating operand not in the output dtype
  (eager matmul requires equal operand dtypes and returns theirs, so a difference is autocast's
  cast; autocast casts each operand to its dtype the same way);
- a softmax or log_softmax without a dtype argument: the input, where the output is wider (the
  input is cast up first, as autocast's float32 policy does, and `dtype=` would).
Exact: the cast is the one autocast makes on that input, and autocast leaves an explicit `.to` and
a call whose inputs are already in its dtype as they are, so the compiled graph computes what the
eager code computed, under autocast or not. The NSA ops that replace these calls later are outside
autocast's op lists: with the casts in the graph they receive the dtypes eager code computed in.

A call whose recorded dtypes need no cast is left alone (no match); nothing is refused: a dtype
change this rule does not know stays in the graph, and the passes read it as before.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from nsa_compile.fx import op_name, value

# Calls autocast runs in its lower precision (operands cast to the autocast dtype)...
LOWER_PRECISION = ("matmul", "bmm", "mm", "einsum")
# ...and calls it runs in float32 (the input cast up), when no dtype argument is given.
FLOAT32 = ("softmax", "log_softmax")


def operands(node: fx.Node) -> list[fx.Node]:
    """The tensor operands of a matmul-like call (einsum: after the equation, listed or not)."""
    if op_name(node) == "einsum":
        rest = node.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = rest[0]
        return [x for x in rest if isinstance(x, fx.Node)]
    return [x for x in node.args[:2] if isinstance(x, fx.Node)]


def has_dtype_argument(node: fx.Node) -> bool:
    """softmax(x, dim, dtype=...) in any of its spellings (function, F.softmax, method)."""
    if node.kwargs.get("dtype") is not None:
        return True
    index = 3 if node.op == "call_function" and node.target in (F.softmax, F.log_softmax) else 2
    return len(node.args) > index and node.args[index] is not None


# Views that only reorder dims: the cast moves above them (a cast commutes with them), so that
# `k.transpose(-1, -2)` stays the key transpose the passes read.
REORDERING = ("transpose", "swapaxes", "permute", "t")


def cast_before(graph: fx.Graph, x: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
    """`x.to(dtype)` inserted for `user`, with its fake value; `user` reads it instead of x. Where x
    is a dim-reordering view read by `user` only, the cast goes on the view's input instead and the
    view (its fake value recomputed) reads the cast."""
    views = []
    while op_name(x) in REORDERING and len(x.users) == 1 and isinstance(x.args[0], fx.Node) \
            and value(x.args[0]) is not None and value(x.args[0]).dtype == value(x).dtype:
        views.append(x)
        x = x.args[0]
    reader = views[-1] if views else user
    with graph.inserting_before(reader):
        cast = graph.call_method("to", (x, dtype))
    fake = value(x)
    with fake.fake_mode:
        cast.meta["example_value"] = fake.to(dtype)
        for view in reversed(views):  # outermost last: each reads the one before, now in dtype
            source = view.args[0]
            view.replace_input_with(source, cast if source is x else source)
            args, kwargs = fx.node.map_arg((view.args, view.kwargs), value)
            view.meta["example_value"] = (getattr(args[0], view.target)(*args[1:], **kwargs)
                                          if view.op == "call_method" else view.target(*args, **kwargs))
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in reader.meta:
            cast.meta[key] = reader.meta[key]
    if not views:
        user.replace_input_with(x, cast)
    return cast


def explicit_autocast(graph: fx.Graph, node: fx.Node) -> str | None:
    """The rule (module docstring): a description of the casts written, or None."""
    name = op_name(node)
    out = value(node)
    if out is None or not out.is_floating_point():
        return None
    if name in LOWER_PRECISION:
        inputs = operands(node)
    elif name in FLOAT32 and not has_dtype_argument(node):
        inputs = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    else:
        return None
    cast = []
    for x in dict.fromkeys(inputs):
        val = value(x)
        if val is None or not val.is_floating_point() or val.dtype == out.dtype or not hasattr(val, "fake_mode"):
            continue
        if name in FLOAT32 and torch.finfo(val.dtype).bits >= torch.finfo(out.dtype).bits:
            continue  # only the cast up autocast makes
        cast_before(graph, x, out.dtype, node)
        cast.append(f"{x.name} {str(val.dtype).removeprefix('torch.')}")
    if not cast:
        return None
    return (f"autocast: {name} computes in {str(out.dtype).removeprefix('torch.')} under autocast; "
            f"its cast of {', '.join(cast)} written as .to()")
