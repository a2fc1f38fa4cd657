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
- Under DDP (see ddp.py) Dynamo hands over the whole graph; the passes run here, whatever the
  compiler, and the rewritten graph is split at DDP's gradient buckets as Dynamo would have split
  it; each piece is compiled without the passes (plain `compile_fx` for Inductor), so every
  rewrite is made, and counted, once.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .ddp import ddp_to_split_for, split_at_buckets
from .pass_manager import NSAGraphPass, OptimizeState

__all__ = ["make_backend"]


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


def make_backend(state: OptimizeState):
    compiler = state.config.compiler

    def nsa_backend(gm: fx.GraphModule, example_inputs):
        seen = len(state.graphs)
        try:
            return compile_graph(gm, example_inputs)
        except BaseException:
            # a compile that failed (an OOM, a compiler error) never runs: report() must not count it
            del state.graphs[seen:]
            raise

    def compile_graph(gm: fx.GraphModule, example_inputs):
        ddp = ddp_to_split_for()
        if ddp is not None:
            return compile_for_ddp(gm, example_inputs, ddp)
        if compiler == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            composite = NSAGraphPass(state, chained=inductor_config.pre_grad_custom_pass)
            seen = len(state.graphs)
            compiled = compile_fx(gm, example_inputs, config_patches={"pre_grad_custom_pass": composite})
            if len(state.graphs) == seen:
                _record_cache_hit(gm, state)
            return compiled
        _run_passes(gm, state)  # as Inductor's pre-grad stage would: subgraphs too
        if compiler == "aot_eager":
            return _aot_eager(gm, example_inputs, state.graphs[-1].aten)
        return gm.forward

    def compile_for_ddp(gm: fx.GraphModule, example_inputs, ddp):
        _run_passes(gm, state)
        record = state.graphs[-1]
        pieces = 0

        def compile_piece(piece: fx.GraphModule, piece_inputs):
            nonlocal pieces
            pieces += 1
            if compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx

                # no NSA passes here (they ran on the whole graph); a pass the user installed on
                # pre_grad_custom_pass still runs on each piece, after ours as on one graph
                return compile_fx(piece, piece_inputs)
            if compiler == "aot_eager":
                return _aot_eager(piece, piece_inputs, record.aten, prefix=f"piece{pieces - 1}_")
            return piece.forward

        compiled = split_at_buckets(gm, example_inputs, ddp, compile_piece)
        record.ddp_pieces = pieces  # one per gradient bucket
        return compiled

    return nsa_backend
