"""What the attention passes share when they read eager attention code in a Dynamo graph: the
refusal exception, the single-use check, the upcast / GQA-repeat / -inf-mask readers, the
ancestor walk and the node-by-node evaluation that masks and index arithmetic are verified by,
and the clean-up after a subgraph is replaced."""

from __future__ import annotations

import torch
from torch import fx

from .fx import arg, op_name, value
from .sizes import is_size

__all__ = ["LARGE_NEGATIVE", "Refused", "ancestors", "erase_replaced", "evaluate_node", "is_large_negative",
           "keep_mask", "mask_fill", "only_user", "strip_upcast", "unrepeat"]


class Refused(Exception):
    """A check failed; the message is the reason `explain` shows."""


def only_user(node: fx.Node, what: str, why: str = "it must stay as it is") -> fx.Node:
    """The single user of `node`, or Refused naming the users (the tensor is needed elsewhere)."""
    users = list(node.users)
    if len(users) != 1:
        names = ", ".join(op_name(u) or u.op for u in users) or "nothing"
        raise Refused(f"the {what} is used by {len(users)} nodes ({names}); {why}")
    return users[0]


def strip_upcast(node: fx.Node) -> fx.Node:
    """x.float() / x.to(torch.float32) -> x (the ops upcast fp16/bf16 scores themselves); else node."""
    name = op_name(node)
    if name == "float" or (name == "to" and arg(node, 1, "dtype") in (torch.float32, torch.float64)):
        return arg(node, 0, "input")
    return node


def unrepeat(node: fx.Node) -> tuple[fx.Node, int]:
    """x_rep -> (x, h) when x_rep = x.repeat_interleave(h, dim=1) with an int h; else (node, 1)."""
    if op_name(node) == "repeat_interleave":
        dim, repeats = arg(node, 2, "dim"), arg(node, 1, "repeats")
        x = arg(node, 0, "input")
        if (isinstance(repeats, int) and isinstance(dim, int) and value(x) is not None
                and dim % value(x).dim() == 1 and arg(node, 3, "output_size") is None):
            return x, repeats
    return node, 1


# A finite fill at or below this hides a key from a float32 softmax as -inf does, next to any kept
# score above fill + 104 (exp underflows to 0): finfo.min, -finfo.max, -1e9, fp16's -65504 ...
# It differs from -inf only on a row that keeps no key (the uniform average of its keys, not NaN).
LARGE_NEGATIVE = -1e4


def is_large_negative(fill) -> bool:
    """-inf, or a finite number at or below LARGE_NEGATIVE."""
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= LARGE_NEGATIVE


def keep_mask(masked: fx.Node, scores: fx.Node, finite: bool = False) -> tuple[fx.Node, bool]:
    """(mask node, True if the positions where it is True are kept) of the -inf masking of `scores`:
    masked_fill(~m, -inf), masked_fill(logical_not(m), -inf), masked_fill(m_drop, -inf) or
    where(m, scores, -inf). With `finite`, a large negative fill (`is_large_negative`) is read as
    -inf too: the caller must make sure no row is left without a key (`mask_fill` tells which)."""
    def hides(fill) -> bool:
        return fill == float("-inf") or finite and is_large_negative(fill)

    name = op_name(masked)
    if name == "masked_fill":
        target, fill = arg(masked, 1, "mask"), arg(masked, 2, "value")
        if arg(masked, 0, "input") is not scores or not hides(fill) or not isinstance(target, fx.Node):
            raise Refused("masked_fill does not set -inf on the scores")
        if op_name(target) in ("invert", "logical_not", "bitwise_not"):
            return arg(target, 0, "input"), True
        return target, False
    if name == "where" and len(masked.args) == 3 and masked.args[1] is scores and hides(masked.args[2]):
        if not isinstance(masked.args[0], fx.Node):
            raise Refused("torch.where keeps the scores by a constant condition")
        return masked.args[0], True
    raise Refused(f"the softmax input is {name}, not masked scores")


def mask_fill(masked: fx.Node):
    """The constant a masked_fill / where(m, scores, c) masking puts on the hidden scores, or None."""
    if op_name(masked) == "masked_fill":
        return arg(masked, 2, "value")
    if op_name(masked) == "where" and len(masked.args) == 3:
        return masked.args[2]
    return None


def ancestors(roots: list[fx.Node], stop: fx.Node | None = None, into_sizes: bool = True) -> set[fx.Node]:
    """Every node the roots depend on (roots included), not walking through `stop`, nor, with
    into_sizes=False, through sizes (SymInt nodes: a probe gives them numbers, whatever tensor
    they were read from)."""
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is not stop and (into_sizes or not is_size(node)):
            stack.extend(node.all_input_nodes)
    return seen


def evaluate_node(node: fx.Node, env: dict, what: str):
    """The value of `node` (a call of a subgraph being verified at compile time) from the values
    of its inputs in `env`. The user's code failing on the values it is run on (positions or probe
    values it may not expect) refuses the rewrite, naming `what` ("the token ids and the mask on
    probe block ids") and the node; running out of memory is raised: it says nothing of the code."""
    missing = [n for n in node.all_input_nodes if n not in env]
    if missing:  # a value the check was not given (e.g. a size read some way it does not follow)
        raise Refused(f"evaluating {what}: {node.name} reads {missing[0].op} {missing[0].name}, which the check "
                      "has no value for")
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    return call_node(node, args, kwargs, what)


def call_node(node: fx.Node, args, kwargs, what: str):
    """node's call on these argument values; the user's code failing on them refuses, naming `what`
    and the node; running out of memory is raised."""
    try:
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise Refused(f"evaluating {what} failed at {node.name} ({type(error).__name__}: {first_line})") from None


def erase_replaced(graph: fx.Graph, chain: list, roots: list[fx.Node]) -> None:
    """Erase the replaced chain (None entries skipped), then whatever only it and `roots` used
    (the K/V copies, the index and mask arithmetic), stopping at placeholders and shared nodes."""
    dead = [n for n in dict.fromkeys(chain) if n is not None]
    candidates = list(roots) + [i for n in dead for i in n.all_input_nodes]
    for node in dead:
        graph.erase_node(node)
    while candidates:
        node = candidates.pop()
        if not node._erased and node.op in ("call_function", "call_method") and not node.users:
            candidates.extend(node.all_input_nodes)
            graph.erase_node(node)
