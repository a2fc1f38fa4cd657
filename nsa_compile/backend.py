"""The Dynamo backend behind `optimize`: where the NSA passes meet the compiler.

The passes rewrite the Dynamo graph (torch IR), before AOTAutograd. There a pattern sees the
user's ops undecomposed and the same in every dtype, in training and inference alike, and a
replacement that needs its own backward can be a custom op with registered autograd, so no
backward pattern has to be matched (see docs/DESIGN.md).

- compiler='inductor': the composite pass goes into Inductor's `pre_grad_custom_pass` hook
  through `config_patches` for this compile only (never a global assignment), chained after
  any pass already installed there.
- compiler='aot_eager' / 'eager': the same composite pass runs here, then the rewritten graph
  goes through AOTAutograd with eager execution, or runs as it is.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .pass_manager import NSAGraphPass, OptimizeState

__all__ = ["make_backend"]


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
            return compile_fx(gm, example_inputs, config_patches={"pre_grad_custom_pass": composite})
        NSAGraphPass(state)(gm.graph)
        if compiler == "aot_eager":
            return _aot_eager(gm, example_inputs, state.graphs[-1].aten)
        return gm.forward

    return nsa_backend
