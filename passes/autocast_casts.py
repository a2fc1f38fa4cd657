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
- `F.scaled_dot_product_attention`: q, k, v and a floating attn_mask not in the output dtype, for
  the same reason (eager SDPA requires q, k, v of one dtype and a bool mask or one of theirs;
  CUDA's and the CPU's autocast both run it in their lower precision: chunked_queries' float32
  RoPE'd q and k reached the window op in float32, where eager computed in bf16);
- `F.conv1d`: input, weight and bias not in the output dtype (both autocasts run it in their lower
  precision; a learned depthwise `nn.Conv1d` pooling keeps float32 parameters that autocast casts
  for bf16 activations, and compress_pooling reads the casts);
- a softmax or log_softmax without a dtype argument: the input, where the output is wider (the
  input is cast up first, as autocast's float32 policy does, and `dtype=` would).
Exact: the cast is the one autocast makes on that input, and autocast leaves an explicit `.to` and
a call whose inputs are already in its dtype as they are, so the compiled graph computes what the
eager code computed, under autocast or not. The NSA ops that replace these calls later are outside
autocast's op lists: with the casts in the graph they receive the dtypes eager code computed in.

The autocast state of each call is read from the graph (its `_enter_autocast` regions) and the
ambient state it is compiled under (`AutocastRegions`, which the projection pass reads too). A
call outside autocast, or one whose output is not in the dtype autocast gives it, is left alone
(no match); nothing is refused: a dtype change this rule does not know stays in the graph, and the
passes read it as before.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from nsa_compile.fx import arg, call, op_name, value

# What Dynamo records for a `with torch.autocast(...)` inside the compiled code (2.11 and 2.13).
ENTER_AUTOCAST = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
EXIT_AUTOCAST = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
AUTOCAST_SIGNATURE = inspect.signature(torch.amp.autocast)

# Calls autocast runs in its lower precision (operands cast to the autocast dtype)...
LOWER_PRECISION = ("matmul", "bmm", "mm", "einsum", "scaled_dot_product_attention", "conv1d")
# ...and calls it runs in float32 (the input cast up), when no dtype argument is given.
FLOAT32 = ("softmax", "log_softmax")


class AutocastRegions:
    """The autocast state, per device type, that each call of a graph runs under: the ambient
    state the graph is compiled under (AOTAutograd traces the graph under it), changed by the
    graph's own `_enter_autocast` / `_exit_autocast` nodes. A state is (enabled, dtype), or None
    where it cannot be read (an enter node whose arguments do not bind; a node made after the
    regions were read)."""

    UNKNOWN = "?"  # key of a state in which no device's autocast is known

    def __init__(self, graph: fx.Graph):
        self.at: dict[fx.Node, dict] = {}
        current: dict = {}  # device type -> (enabled, dtype) set by enter nodes; absent: ambient
        before: dict[fx.Node, dict] = {}
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            if ENTER_AUTOCAST is not None and node.target is ENTER_AUTOCAST:
                before[node] = current
                current = self.entered(current, node)
            elif EXIT_AUTOCAST is not None and node.target is EXIT_AUTOCAST:
                enter = node.args[0] if node.args else None
                current = before.get(enter, {self.UNKNOWN: None})
            else:
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
            bound = AUTOCAST_SIGNATURE.bind(*node.args, **node.kwargs)
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


def operands(node: fx.Node) -> list[fx.Node]:
    """The tensor operands of a matmul-like call (einsum: after the equation, listed or not; SDPA:
    query, key, value and attn_mask, which autocast casts alike when it is floating)."""
    if op_name(node) == "scaled_dot_product_attention":
        named = [arg(node, i, name) for i, name in enumerate(("query", "key", "value", "attn_mask"))]
        return [x for x in named if isinstance(x, fx.Node)]
    if op_name(node) == "einsum":
        rest = node.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = rest[0]
        return [x for x in rest if isinstance(x, fx.Node)]
    if op_name(node) == "conv1d":
        named = [arg(node, i, name) for i, name in enumerate(("input", "weight", "bias"))]
        return [x for x in named if isinstance(x, fx.Node)]
    return [x for x in node.args[:2] if isinstance(x, fx.Node)]


def has_dtype_argument(node: fx.Node) -> bool:
    """softmax(x, dim, dtype=...) in any of its spellings (function, F.softmax, method)."""
    if node.kwargs.get("dtype") is not None:
        return True
    index = 3 if node.op == "call_function" and node.target in (F.softmax, F.log_softmax) else 2
    return len(node.args) > index and node.args[index] is not None


def cast_before(graph: fx.Graph, x: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
    """`x.to(dtype)` inserted for `user`, with its fake value; `user` reads it instead of x.
    canonicalize's next rule, `cast_hoist`, moves it above the data movement x may be (a transpose,
    a slice, a GQA copy), where the passes read that movement."""
    cast = call(graph, torch.Tensor.to, x, dtype, anchor=user)
    user.replace_input_with(x, cast)
    return cast


class ExplicitAutocast:
    """The rule (module docstring), one call at a time; the graph's autocast regions are read once
    per graph. A call outside autocast (no region, ambient autocast off for its device) is left
    alone: a dtype change there is eager PyTorch's own (einsum's type promotion), not a cast
    autocast makes."""

    def __init__(self):
        self.graph: fx.Graph | None = None
        self.regions: AutocastRegions | None = None

    def __call__(self, graph: fx.Graph, node: fx.Node) -> str | None:
        name = op_name(node)
        out = value(node)
        if out is None or not out.is_floating_point() or name not in LOWER_PRECISION + FLOAT32:
            return None
        if name in FLOAT32 and has_dtype_argument(node):
            return None
        if self.graph is not graph:
            self.graph, self.regions = graph, AutocastRegions(graph)
        state = self.regions.state(node, out.device.type)
        if state is None or not state[0]:
            return None
        wanted = state[1] if name in LOWER_PRECISION else torch.float32
        if out.dtype != wanted:
            return None  # not the dtype autocast gives this call: not autocast's doing
        if name in LOWER_PRECISION:
            inputs = operands(node)
        else:
            inputs = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
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
