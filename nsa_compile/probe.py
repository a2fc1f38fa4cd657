"""Running a region of a Dynamo graph on probe values at compile time.

A pass that recognizes a computation by what it computes (the RoPE arithmetic, the gated sum of
the branch outputs) evaluates the region's nodes on values it chooses and compares the result
with its op's formula. Here every floating-point value and every dtype argument becomes one
probe dtype, float64 by default (complex: complex128), so

- random probes compare with the formula up to that dtype's rounding (one random probe tells a
  function that is linear in its inputs from any other: the passes' regions are);
- index codes (`index_codes`: 1, 2, ..., n, exact below EXACT_BELOW: 2**53 in float64, 2**24 in
  float32) pass through data movement unchanged: reading a result's codes tells which input
  element reached each output element (`decode`);
- `fingerprint` writes what a region computes as text, so that the same region (one per layer)
  is probed once.

The values are dropped after their last use: a probe runs at the graph's real shapes (float32
halves its memory where codes stay exact). A `repeat` that only tiles dims of size 1 and is read
only by `gather` runs as the `expand` with the same values (`repeat_as_expand`): gather reads its
operands through their strides, so the copy is never made (lucidrains' fine branch repeats K and
V once per query before gathering each query's blocks). A probe runs with autocast off: the passes run while
the user's `torch.autocast` is on (Dynamo compiles inside the call), where a float32 matmul of the
probe would compute in bf16 and round its index codes; the casts autocast makes in the model are
in the graph already, as `.to` nodes (passes/autocast_casts.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from .attention_match import Refused

__all__ = ["EXACT_BELOW", "decode", "element_budget", "fingerprint", "index_codes", "remembered", "repeat_as_expand",
           "run", "run_all"]

_CASTS = {"float", "half", "bfloat16", "double"}
# Index codes (integers) are exact in these dtypes below these numbers.
EXACT_BELOW = {torch.float32: 2**24, torch.float64: 2**53}


def _widen(dtype: torch.dtype, device: str | None = None):
    """x -> float dtypes as `dtype`, complex ones as its complex twin, devices as `device` where one
    is given (anything else as it is)."""
    complex_twin = torch.complex128 if dtype == torch.float64 else torch.complex64

    def wide(x):
        if device is not None and isinstance(x, torch.device):
            return torch.device(device)
        if isinstance(x, torch.dtype):
            if x.is_complex:
                return complex_twin
            if x.is_floating_point:
                return dtype
        return x

    return wide


# The most elements the tensors of one probe may hold on the CPU (2 GiB of float64).
CPU_BUDGET = 2**28
# ... and on a GPU (32 GiB of float64), where a quarter of the free memory allows it. The probes'
# cost is the peak of their live tensors (batch_slice.peak_elements): lucidrains_shared_kv's fine
# branch at the seed shape (S 2048, one batch row) holds 2,153,250,816 at once, just over the
# earlier cap of 2^31 (H200, 2026-11-27).
GPU_BUDGET_CAP = 2**32


def element_budget(device: torch.device | str, dtype: torch.dtype = torch.float64) -> int:
    """The most elements (of `dtype`) the tensors of one verification probe may hold together: on
    the CPU CPU_BUDGET float64 elements' bytes (2 GiB); on a GPU a quarter of its free memory (a
    probe runs once per region structure, at compile time, beside the model's own tensors), at
    most GPU_BUDGET_CAP elements."""
    device = torch.device(device)
    itemsize = dtype.itemsize
    if device.type != "cuda":
        return CPU_BUDGET * 8 // itemsize
    free, _ = torch.cuda.mem_get_info(device)
    return min(GPU_BUDGET_CAP, free // 4 // itemsize)


def _is_repeat(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "repeat") or \
        (node.op == "call_function" and node.target is torch.Tensor.repeat)


def _reads_as_gather_operand(user: fx.Node, node: fx.Node) -> bool:
    """`user` is a gather reading `node` as its input or index (not as its dim)."""
    is_gather = (user.op == "call_method" and user.target == "gather") or \
        (user.op == "call_function" and user.target in (torch.gather, torch.Tensor.gather))
    return is_gather and user.args[1:2] != (node,) and user.kwargs.get("dim") is not node


def repeat_as_expand(node: fx.Node, shape, args: tuple) -> tuple[int, ...] | None:
    """The shape to expand to where `node`, a `Tensor.repeat` of a tensor of `shape` by the
    repeats in `args` (the node's arguments after the tensor: ints, or one list or tuple of
    them), tiles only dims of size 1 (new leading dims count as size 1) and every reader of it
    in the graph is a `gather` taking it as input or index: then `x.reshape(ones + shape)
    .expand(result)` holds the same values without a copy, and the gathers read the same
    elements. None otherwise (any other repeat runs as written)."""
    if not _is_repeat(node) or not node.users or node.kwargs:
        return None
    reps = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    if not reps or not all(isinstance(r, int) for r in reps) or len(reps) < len(shape):
        return None
    padded = (1,) * (len(reps) - len(shape)) + tuple(int(d) for d in shape)
    if any(r != 1 and d != 1 for r, d in zip(reps, padded)):
        return None
    if not all(_reads_as_gather_operand(user, node) for user in node.users):
        return None
    return tuple(d * r for d, r in zip(padded, reps))


def run(nodes: list[fx.Node], env: dict, keep: fx.Node, what: str, dtype=torch.float64,
        device: str | None = None, changes: dict | None = None) -> torch.Tensor:
    """The value of `keep` after running `nodes` (in graph order) on the values in `env` (a node
    -> tensor map holding every input the nodes read from outside them), every float in `dtype`
    (float32 halves the memory of a probe at a large shape; index codes stay exact below 2**24).
    `device` (e.g. "cpu", where env holds CPU tensors): every torch.device argument of the nodes
    (the constants the graph makes on its own device, CUDA on a GPU) becomes this one.
    `changes`: node -> (args, kwargs) run in place of the node's own (batch_slice.one_row's sizes
    for one batch row).
    The user's code failing on probe values refuses the rewrite, naming `what` and the node;
    running out of memory is raised (it says nothing of the code)."""
    return _run(nodes, env, keep, what, dtype, device, changes)[keep]


def run_all(nodes: list[fx.Node], env: dict, what: str, dtype=torch.float64) -> dict:
    """`env` with the value of every node in `nodes` (views of a few inputs: nothing is dropped)."""
    return _run(nodes, env, None, what, dtype)


def _reference_backend(node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call of one of this project's ops (torch.ops.nsa.*) with backend 'reference': a rewrite
    already in the region wrote the backend it chose for the graph's tensors (e.g. 'triton' on
    CUDA), which a probe's float64 (or CPU) values may not run on; the reference backend is the
    op's definition."""
    target = node.target
    overload = target.default if isinstance(target, torch._ops.OpOverloadPacket) else target
    schema = getattr(overload, "_schema", None)
    if schema is None or not schema.name.startswith("nsa::"):
        return args, kwargs
    names = [a.name for a in schema.arguments]
    if "backend" not in names:
        return args, kwargs
    at = names.index("backend")
    if len(args) > at:
        return (*args[:at], "reference", *args[at + 1:]), kwargs
    return args, {**kwargs, "backend": "reference"}


def _autocast_off() -> contextlib.ExitStack:
    """A context in which autocast is off on every device type where it is on now."""
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _run(nodes: list[fx.Node], env: dict, keep: fx.Node | None, what: str, dtype: torch.dtype,
         device: str | None = None, changes: dict | None = None) -> dict:
    with _autocast_off():
        return _run_nodes(nodes, env, keep, what, dtype, device, changes or {})


def _run_nodes(nodes: list[fx.Node], env: dict, keep: fx.Node | None, what: str, dtype: torch.dtype,
               device: str | None, changes: dict) -> dict:
    last = {i: n for n, node in enumerate(nodes) for i in node.all_input_nodes} if keep is not None else {}
    wide = _widen(dtype, device)
    for step, node in enumerate(nodes):
        args, kwargs = fx.node.map_arg(changes.get(node, (node.args, node.kwargs)), lambda n: env[n])
        args, kwargs = torch.utils._pytree.tree_map(wide, (args, kwargs))
        if node.op == "call_function":
            args, kwargs = _reference_backend(node, args, kwargs)
        try:
            expanded = repeat_as_expand(node, args[0].shape, args[1:]) if _is_repeat(node) else None
            if expanded is not None:
                x = args[0]
                env[node] = x.reshape((1,) * (len(expanded) - x.dim()) + tuple(x.shape)).expand(expanded)
            elif node.op == "call_method" and node.target in _CASTS:
                env[node] = args[0].to(dtype)
            elif node.op == "call_method":
                env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                env[node] = node.target(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # the user's code, run on values it may not expect
            raise Refused(f"evaluating {what} on probe values failed at {node.name} ({type(error).__name__})") from None
        for i in node.all_input_nodes:
            if last.get(i) == step and i is not keep:
                del env[i]
    return env


def index_codes(shape, device, dtype=torch.float64) -> torch.Tensor:
    """[shape] holding 1, 2, ..., n in row-major order (0 stays free for 'no element')."""
    n = 1
    for d in shape:
        n *= int(d)
    return torch.arange(1, n + 1, dtype=dtype, device=device).reshape(tuple(shape))


def remembered(verdicts: dict, key, check):
    """check()'s result for `key`, computed once (one probe per region structure: every layer's
    copy shares it); a refusal is remembered too and raised again, with its reason, for the next
    region of the same key."""
    if key not in verdicts:
        try:
            verdicts[key] = check()
        except Refused as why:
            verdicts[key] = why
    if isinstance(verdicts[key], Refused):
        raise Refused(str(verdicts[key]))
    return verdicts[key]


def fingerprint(nodes: list[fx.Node], inputs: list[fx.Node]) -> str:
    """What `nodes` compute from `inputs`, as text: each op with its arguments, inputs and nodes
    by position, anything else by name (equal texts: the same function of the inputs, so one
    probe serves both, e.g. the same region in every layer; shapes enter through the arguments
    of views and must be compared by the caller too)."""
    index = {n: i for i, n in enumerate([*inputs, *nodes])}

    class Ref:
        def __init__(self, node):
            self.text = f"<{index[node]}>" if node in index else node.name

        def __repr__(self):
            return self.text

    ops = [(n.op, n.target, fx.node.map_arg((n.args, n.kwargs), Ref)) for n in nodes]
    return repr(ops)


def decode(result: torch.Tensor, numel: int) -> torch.Tensor | None:
    """The flat input indices (int64, result's shape) that index codes of an input of `numel`
    elements became in `result`, or None where some element is not one input element (a sum,
    a product, a zero, a value changed on the way)."""
    if numel >= EXACT_BELOW.get(result.dtype, 0):
        return None
    index = result.round()
    if not torch.equal(index, result) or bool((index < 1).any()) or bool((index > numel).any()):
        return None
    return index.to(torch.int64) - 1
