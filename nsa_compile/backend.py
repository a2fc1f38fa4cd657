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
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .pass_manager import NSAGraphPass, OptimizeState

__all__ = ["make_backend"]


def _record_cache_hit(gm: fx.GraphModule, state: OptimizeState) -> None:
    """Inductor served this graph from its cache (keyed by our pass's uuid), so our hook did not
    run (PyTorch >= 2.12 runs pre-grad passes after the cache lookup). Run the passes on a copy
    of the untouched graph, only to record what the cached code contains."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    NSAGraphPass(state)(graph)
    state.graphs[-1].from_cache = True


def _aot_eager(gm: fx.GraphModule, example_inputs, keep: dict):
    """AOTAutograd with eager execution, keeping each ATen graph it makes in `keep`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keeper(kind):
        def compiler(aten_gm, _inputs):
            keep[kind] = aten_gm
            return make_boxed_func(aten_gm.forward)

        return compiler

    return aot_autograd(
        fw_compiler=keeper("forward"), bw_compiler=keeper("backward"), inference_compiler=keeper("inference")
    )(gm, example_inputs)


def make_backend(state: OptimizeState):
    compiler = state.config.compiler

    def nsa_backend(gm: fx.GraphModule, example_inputs):
        if compiler == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            composite = NSAGraphPass(state, chained=inductor_config.pre_grad_custom_pass)
            seen = len(state.graphs)
            compiled = compile_fx(gm, example_inputs, config_patches={"pre_grad_custom_pass": composite})
            if len(state.graphs) == seen:
                _record_cache_hit(gm, state)
            return compiled
        NSAGraphPass(state)(gm.graph)
        if compiler == "aot_eager":
            return _aot_eager(gm, example_inputs, state.graphs[-1].aten)
        return gm.forward

    return nsa_backend
