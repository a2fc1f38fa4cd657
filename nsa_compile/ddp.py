"""DistributedDataParallel without cut rewrites: Dynamo's bucket split moves behind the passes.

Inside a DDP forward, Dynamo's DDPOptimizer (torch/_dynamo/backends/distributed.py) splits each
captured graph at the gradient-bucket boundaries (counted backwards from the last parameter use)
and calls the backend once per piece, so that the all-reduce of one bucket overlaps the backward
of the next. The split comes before the backend, so a boundary inside a pattern that spans
parameters (a layer's q/k/v projections) cut the rewrite: the passes saw partial patterns.

Here the order is: the passes on the whole graph, then the same split on the rewritten graph.

- `whole_graph_calls` wraps an optimized module's compiled call. When Dynamo would split
  (`torch._dynamo.config.optimize_ddp` is 'ddp_optimizer', PyTorch's default) and the call runs
  under DDP, it turns Dynamo's split off for this call only (`config.patch`, restored on return)
  and marks the call, so the backend knows the user asked for the split.
- `ddp_to_split_for` tells the backend which DDP module (if any) it must split for.
- `split_at_buckets` splits the rewritten graph with DDPOptimizer at that module's bucket cap and
  compiles each piece with the given piece compiler (which must not run the passes again).

Supported: `DDP(optimize(model))` (optimize the inner module, then wrap it: the usual order, and
tools/ddp_train.py's), `optimize(DDP(model))`, and an optimized submodule of a DDP-wrapped model.
Other `optimize_ddp` modes ('no_optimization', 'python_reducer') are left as the user set them:
there Dynamo does not split, and neither do we. FSDP2 (`fully_shard`) never uses DDPOptimizer and
is not touched. The patch is process-wide while the call runs: a module compiled apart from
nsa_compile and run inside the optimized module's forward (past a graph break), or one another
thread compiles at the same moment under DDP, is not split either.
"""

from __future__ import annotations

import contextvars
import functools

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_to_split_for", "pieces_of", "split_at_buckets", "whole_graph_calls"]

# True while an optimized module's call runs with Dynamo's DDP split turned off by us: the backend
# must then split for the active DDP module itself.
_SPLIT_AFTER_PASSES = contextvars.ContextVar("nsa_compile_split_after_passes", default=False)


def _dynamo_would_split() -> bool:
    return torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"


def whole_graph_calls(compiled_call, module: torch.nn.Module):
    """`compiled_call` (an `nn.Module.compile`d call of `module`) such that, under DDP, Dynamo hands
    the backend whole graphs and the backend splits them after the passes."""
    wraps_ddp = isinstance(module, DistributedDataParallel)

    @functools.wraps(compiled_call)
    def call(*args, **kwargs):
        # Traced inside another compiled region, the call is that region's business; outside a DDP
        # forward (and for a module that is not a DDP) there is nothing to split.
        under_ddp = wraps_ddp or DistributedDataParallel._get_active_ddp_module() is not None
        if torch.compiler.is_compiling() or not under_ddp or not _dynamo_would_split():
            return compiled_call(*args, **kwargs)
        token = _SPLIT_AFTER_PASSES.set(True)
        try:
            with torch._dynamo.config.patch(optimize_ddp=False):
                return compiled_call(*args, **kwargs)
        finally:
            _SPLIT_AFTER_PASSES.reset(token)

    return call


def ddp_to_split_for() -> DistributedDataParallel | None:
    """The DDP module whose buckets the graph being compiled must be split at, or None: the call
    came through `whole_graph_calls` with the split requested, and a DDP forward is running."""
    if not _SPLIT_AFTER_PASSES.get():
        return None
    return DistributedDataParallel._get_active_ddp_module()


def split_at_buckets(gm: fx.GraphModule, example_inputs, ddp: DistributedDataParallel, compile_piece):
    """gm split as Dynamo would have split it for `ddp` (DDPOptimizer with ddp's bucket cap and
    DDP's first-bucket size), each piece compiled by `compile_piece(piece_gm, piece_inputs)`, and
    stitched back into one callable. One piece, gm itself, when its parameters fit one bucket."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    optimizer = DDPOptimizer(bucket_bytes_cap=ddp.bucket_bytes_cap, backend_compile_fn=compile_piece)
    return optimizer.compile_fn(gm, example_inputs)


def pieces_of(record) -> int:
    """How many pieces the graph of a GraphRecord was compiled as for DDP's buckets (the backend
    sets `ddp_pieces` when it splits; 0: the graph was not split for DDP)."""
    return record.ddp_pieces
