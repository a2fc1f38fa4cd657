"""The Dynamo backend behind `optimize`: where the NSA passes meet the compiler.

The passes rewrite the Dynamo graph (torch IR), before AOTAutograd. There a pattern sees the
user's ops undecomposed and the same in every dtype, in training and inference alike, and a
replacement that needs its own backward can be a custom op with registered autograd, so no
backward pattern has to be matched (see docs/DESIGN.md).

- compiler='inductor': the composite pass goes into Inductor's `pre_grad_custom_pass` hook
  through `config_patches` for this compile only (never a global assignment), chained after
  any pass already installed there.
  Since PyTorch 2.12 the hook runs after Inductor's cache lookup; on a hit the passes run on a
  copy of the graph only to keep `report()` true.
- compiler='aot_eager' / 'eager': the same composite pass runs here, then the rewritten graph
  goes through AOTAutograd with eager execution, or runs as it is.
- Gradients that eager leaves None: AOTAutograd's backward is one function of every output's
  gradient, and autograd hands it zeros for the outputs the loss did not use, so an input that
  only such outputs depend on (a parameter of an unused head) would get a zero gradient where
  eager leaves `.grad` None (and AdamW's weight decay would then move it). Where a graph has such
  inputs, `keep_unreached_grads_none` restores None at run time (see there).
- A graph compiled with symbolic sizes (Dynamo makes a size dynamic once it changes) is rewritten
  like a static one: the passes check their candidates at probe sizes (sizes.py). A branch they
  refuse there (a computation that differs between sizes, packed documents in the window and
  compressed passes) stays eager: `optimize` says so once per model, with a DynamicShapesWarning
  naming the passes and their reasons.
- Under DDP (see ddp.py) Dynamo hands over the whole graph; the passes run here, whatever the
  compiler, and the rewritten graph is split at DDP's gradient buckets as Dynamo would have split
  it; each piece is compiled without the passes (plain `compile_fx` for Inductor), so every
  rewrite is made, and counted, once.
"""

from __future__ import annotations

import functools
import operator
import re
import warnings

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .ddp import ddp_to_split_for, split_at_buckets
from .pass_manager import NSAGraphPass, OptimizeState
from .rewrite import PassLog, Refusal

__all__ = ["make_backend", "DynamicShapesWarning", "keep_unreached_grads_none", "inputs_with_partial_grads"]


class DynamicShapesWarning(UserWarning):
    """A graph compiled with symbolic sizes keeps NSA branches eager (the passes verify masks and
    index arithmetic at static sizes only)."""


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm whose graph and subgraphs (higher-order ops' bodies, recursively) are new
    objects, so that passes run on it leave gm as it is; other attributes are shared."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    attrs = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            attr = operator.attrgetter(node.target)(gm)
            attrs[node.target] = _graph_copy(attr) if isinstance(attr, fx.GraphModule) else attr
    return fx.GraphModule(attrs, graph)


def _subgraphs_first(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The bodies of gm's higher-order ops (activation checkpointing, torch.cond, ...: GraphModule
    attributes reached through get_attr), depth first, then gm: the order in which Inductor's
    pre-grad stage runs the hook on each (`_recursive_pre_grad_passes`). The user's attention
    code can sit in such a body."""
    found = []
    for target in dict.fromkeys(node.target for node in gm.graph.find_nodes(op="get_attr")):
        sub = operator.attrgetter(target)(gm)
        if isinstance(sub, fx.GraphModule):
            found += _subgraphs_first(sub)
    return found + [gm]


def _run_passes(gm: fx.GraphModule, state: OptimizeState) -> None:
    """One record per graph: each subgraph's, then gm's (the last record)."""
    for module in _subgraphs_first(gm):
        NSAGraphPass(state)(module.graph)


def _record_cache_hit(gm: fx.GraphModule, state: OptimizeState) -> None:
    """Inductor served this graph from its cache (keyed by our pass's uuid), so our hook did not
    run (PyTorch >= 2.12 runs pre-grad passes after the cache lookup). Run the passes on a copy
    of the untouched graph and its subgraphs, only to record what the cached code contains."""
    seen = len(state.graphs)
    _run_passes(_graph_copy(gm), state)
    for record in state.graphs[seen:]:
        record.from_cache = True


META_REASON = ("the graph's tensors are on the meta device (no values to check a pattern on): it runs as "
               "traced, giving eager's shapes; compile on a real device for the rewrites")


def empty_input_reason(gm: fx.GraphModule, example_inputs) -> str | None:
    """Why no pass may look at gm, whose inputs include an empty tensor (batch 0, an empty
    sequence), or None. Such a graph computes nothing (or nothing along that input), and the
    passes' checks evaluate masks and probes whose patterns an empty size leaves undefined."""
    for node, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(x, torch.Tensor) and x.numel() == 0:
            return (f"the graph input {node.name} is empty {list(x.shape)} (batch 0 or an empty sequence): "
                    "nothing to check a pattern on; it runs as traced, with eager's answer")
    return None


def _record_untouched(gm: fx.GraphModule, state: OptimizeState, reason: str) -> None:
    """A graph no pass may look at (on the meta device, or with an empty input): the record says
    why for each pass, and the graph stays as traced."""
    record = state.new_graph()
    record.code_before = record.code_after = gm.code
    nodes = len(gm.graph.nodes)
    for p in state.passes:
        log = PassLog(p.name, record.graph_id, nodes_before=nodes, nodes_after=nodes, code_after=gm.code)
        log.refusals.append(Refusal("", "", reason))
        record.logs.append(log)


def _aot_eager(gm: fx.GraphModule, example_inputs, keep: dict, prefix: str = ""):
    """AOTAutograd with eager execution, keeping each ATen graph it makes in `keep` (under its kind,
    'forward', 'backward' or 'inference', after `prefix`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keeper(kind):
        def compiler(aten_gm, _inputs):
            keep[prefix + kind] = aten_gm
            return make_boxed_func(aten_gm.forward)

        return compiler

    return aot_autograd(
        fw_compiler=keeper("forward"), bw_compiler=keeper("backward"), inference_compiler=keeper("inference")
    )(gm, example_inputs)


# --- gradients that eager leaves None ----------------------------------------------------------


def _requires_grad(node: fx.Node) -> bool | None:
    """Whether the value Dynamo traced for node requires grad (None: no traced value)."""
    val = node.meta.get("example_value", node.meta.get("val"))
    if val is None:
        return None
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(val))


def inputs_with_partial_grads(gm: fx.GraphModule) -> dict[int, frozenset[int]]:
    """{input index: output indices} for each graph input that requires grad and is used, whose
    gradient flows from some, none included, but not all of the differentiable outputs (outputs
    indexed as the flattened output tuple). {} where no output is differentiable.

    None included: AOTAutograd gives a zero gradient to an input that reaches only
    non-differentiable outputs (a Linear whose output feeds argmax), where eager's is None.
    Autograd's own connectivity, read from the requires_grad Dynamo traced: a value depends on an
    input when an argument that requires grad depends on it and the value requires grad itself
    (so no path through argmax, comparisons or integer math). A node without a traced value is
    taken to depend on all its arguments: more outputs, so at worst eager's zeros stay zeros."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    depends: dict[fx.Node, int] = {}  # node -> bitmask of the inputs its value depends on
    for i, node in enumerate(placeholders):
        if _requires_grad(node):
            depends[node] = 1 << i
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or _requires_grad(node) is False:
            continue
        mask = 0
        for arg in node.all_input_nodes:
            mask |= depends.get(arg, 0)
        if mask:
            depends[node] = mask
    (output,) = gm.graph.find_nodes(op="output")
    outputs = [depends.get(o, 0) if isinstance(o, fx.Node) else 0 for o in tree_leaves(output.args[0])]
    differentiable = frozenset(j for j, mask in enumerate(outputs) if mask)
    partial = {}
    for i, node in enumerate(placeholders):
        if not differentiable or node not in depends or not node.users:
            continue
        reached_from = frozenset(j for j, mask in enumerate(outputs) if mask >> i & 1)
        if reached_from != differentiable:
            partial[i] = reached_from
    return partial


def _backward_id():
    """The running backward pass (autograd's graph task), or None where torch cannot say."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


class _GradUnlessReached(torch.autograd.Function):
    """Identity on a graph input; in the backward, its gradient, or None where this backward
    reached none of the outputs that depend on it (`reached`: output index -> backward id)."""

    @staticmethod
    def forward(ctx, x, reached: dict, outputs: frozenset):
        ctx.reached, ctx.outputs = reached, outputs
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        now = _backward_id()
        hit = any(j in ctx.reached and ctx.reached[j] == now for j in ctx.outputs)
        return (grad if hit else None), None, None


def _mark_reached(reached: dict, j: int, grad: torch.Tensor | None) -> None:
    """Output j's hook. Outputs of one autograd node share it, so the hook also runs, with None,
    for an output the backward did not reach while it reached another."""
    if grad is not None:
        reached[j] = _backward_id()


def keep_unreached_grads_none(compiled, partial: dict[int, frozenset[int]]):
    """`compiled`, called so that an input's gradient is None where eager's would be.

    `partial` is inputs_with_partial_grads of its graph. Each call, those inputs pass through
    _GradUnlessReached and a hook on each output they depend on records the backward that reached
    it; their gradient is then None in a backward that reached none of their outputs (the compiled
    backward computed zeros from autograd's zero-filled output gradients). No wrapping where
    `partial` is empty (a single output: every model whose loss is computed in the graph)."""
    if not partial:
        return compiled
    watched = sorted(frozenset().union(*partial.values()))  # may be empty: inputs that reach no output

    def run(*args):
        if not torch.is_grad_enabled():
            return compiled(*args)
        reached: dict[int, object] = {}
        args = list(args)
        for i, outputs in partial.items():
            if isinstance(args[i], torch.Tensor) and args[i].requires_grad:
                args[i] = _GradUnlessReached.apply(args[i], reached, outputs)
        result = compiled(*args)
        leaves = tree_leaves(result)
        for j in watched:
            if j < len(leaves) and isinstance(leaves[j], torch.Tensor) and leaves[j].requires_grad:
                leaves[j].register_hook(functools.partial(_mark_reached, reached, j))
        return result

    return run


# --- symbolic sizes ---------------------------------------------------------------------------


def size_symbols(gm: fx.GraphModule) -> set[str]:
    """The names of gm's symbolic-size inputs (SymInt placeholders such as 's27'): none where
    Dynamo compiled it at static sizes."""
    return {node.name for node in gm.graph.find_nodes(op="placeholder")
            if isinstance(node.meta.get("example_value"), torch.SymInt)}


def symbolic_refusals(records, symbols: set[str]) -> dict[str, list[tuple[str, str]]]:
    """{pass name: [(where, reason)]}, distinct and in order, of the refusals in these records that
    the symbolic sizes caused: the reason says 'symbolic sizes' or names one of the `symbols`
    (a pass that reads a size input as data, e.g. 'the mask depends on placeholder s27')."""
    if not symbols:
        return {}
    names = re.compile(r"\b(" + "|".join(map(re.escape, sorted(symbols))) + r")\b")
    found: dict[str, list[tuple[str, str]]] = {}
    for record in records:
        for log in record.logs:
            for refusal in log.refusals:
                if "symbolic sizes" in refusal.reason or names.search(refusal.reason):
                    seen = found.setdefault(log.pass_name, [])
                    if (refusal.where, refusal.reason) not in seen:
                        seen.append((refusal.where, refusal.reason))
    return found


def warn_symbolic_refusals(records, symbols: set[str]) -> bool:
    """Warn (DynamicShapesWarning) where these graphs, compiled with the size inputs `symbols`,
    keep branches eager because of them; True if it warned."""
    found = symbolic_refusals(records, symbols)
    if not found:
        return False
    lines = []
    for name, refusals in found.items():
        places = ", ".join(dict.fromkeys(where for where, _ in refusals))
        reasons = "; ".join(dict.fromkeys(reason for _, reason in refusals))
        lines.append(f"  {name} at {places}: {reasons}")
    warnings.warn(
        "nsa_compile: a graph was compiled with symbolic sizes (Dynamo makes a size dynamic once it "
        "changes between calls), and these passes refused candidates there for reasons of those sizes, "
        "so those stay as the eager code (slow, and it can run out of memory at long sequences):\n"
        + "\n".join(lines) + "\n"
        "OptimizeConfig(dynamic=False) recompiles at each new size instead, with every rewrite "
        "(up to torch._dynamo.config.recompile_limit sizes). This warning is given once per model.",
        DynamicShapesWarning)
    return True


def make_backend(state: OptimizeState):
    compiler = state.config.compiler
    warned = False  # DynamicShapesWarning: once per model

    def nsa_backend(gm: fx.GraphModule, example_inputs):
        nonlocal warned
        seen = len(state.graphs)
        partial = inputs_with_partial_grads(gm)  # before the passes change the graph
        symbols = size_symbols(gm)
        try:
            compiled = compile_graph(gm, example_inputs)
        except BaseException:
            # a compile that failed (an OOM, a compiler error) never runs: report() must not count it
            del state.graphs[seen:]
            raise
        if not warned:
            warned = warn_symbolic_refusals(state.graphs[seen:], symbols)
        if compiler == "eager":  # the graph's own ops run under autograd: None where eager has None
            return compiled
        return keep_unreached_grads_none(compiled, partial)

    def inductor_patches() -> dict:
        """Inductor settings of this compile only (config_patches, never a global assignment)."""
        return {"triton.cudagraphs": True} if state.config.cuda_graphs else {}

    def compile_graph(gm: fx.GraphModule, example_inputs):
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs):
            _record_untouched(gm, state, META_REASON)
            return gm.forward  # shapes only, as the eager model computes them on meta
        empty = empty_input_reason(gm, example_inputs)
        ddp = ddp_to_split_for()
        if ddp is not None:
            return compile_for_ddp(gm, example_inputs, ddp, empty)
        if empty is not None:
            _record_untouched(gm, state, empty)
            return compile_unchanged(gm, example_inputs, state.graphs[-1])
        if compiler == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            composite = NSAGraphPass(state, chained=inductor_config.pre_grad_custom_pass)
            seen = len(state.graphs)
            compiled = compile_fx(gm, example_inputs,
                                  config_patches={"pre_grad_custom_pass": composite, **inductor_patches()})
            if len(state.graphs) == seen:
                _record_cache_hit(gm, state)
            return compiled
        _run_passes(gm, state)  # as Inductor's pre-grad stage would: subgraphs too
        if compiler == "aot_eager":
            return _aot_eager(gm, example_inputs, state.graphs[-1].aten)
        return gm.forward

    def compile_unchanged(gm: fx.GraphModule, example_inputs, record, prefix: str = ""):
        """gm as it is, by the configured compiler, without the NSA passes."""
        if compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            # a pass the user installed on pre_grad_custom_pass still runs
            return compile_fx(gm, example_inputs, config_patches=inductor_patches())
        if compiler == "aot_eager":
            return _aot_eager(gm, example_inputs, record.aten, prefix=prefix)
        return gm.forward

    def compile_for_ddp(gm: fx.GraphModule, example_inputs, ddp, empty: str | None):
        if empty is None:
            _run_passes(gm, state)
        else:
            _record_untouched(gm, state, empty)
        record = state.graphs[-1]
        pieces = 0

        def compile_piece(piece: fx.GraphModule, piece_inputs):
            # no NSA passes here: they ran on the whole graph
            nonlocal pieces
            pieces += 1
            return compile_unchanged(piece, piece_inputs, record, prefix=f"piece{pieces - 1}_")

        compiled = split_at_buckets(gm, example_inputs, ddp, compile_piece)
        record.ddp_pieces = pieces  # one per gradient bucket
        return compiled

    return nsa_backend
