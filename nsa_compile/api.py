"""The public entry points: optimize(model, config) and report(model)."""

from __future__ import annotations

import torch.nn as nn

from .backend import make_backend
from .config import OptimizeConfig
from .ddp import whole_graph_calls
from .pass_manager import OptimizeState

__all__ = ["optimize", "report", "state_of"]

_STATE_ATTR = "_nsa_compile_state"


def optimize(model: nn.Module, config: OptimizeConfig | None = None) -> nn.Module:
    """Compile `model` in place with the NSA rewrite passes and return it.

    The returned module is `model` itself (compiled through `nn.Module.compile`), so its
    parameters are the original's, `state_dict()` keys are unchanged (no `_orig_mod.` prefix)
    and an optimizer built before or after trains it. Calling optimize again recompiles with
    the new config. Rewrites happen at the first forward; `report(model)` lists them.

    What eager gives, the optimized model gives: a gradient eager leaves None (a parameter that
    only outputs the loss did not use depend on, or only non-differentiable ones) stays None, where
    plain torch.compile gives zeros (backend.keep_unreached_grads_none); a model on the meta device,
    or a batch of 0, runs as traced, without the passes. A graph compiled with symbolic sizes
    (Dynamo's default after a size changes) is rewritten too, each candidate checked at probe sizes
    (sizes.py): training at several lengths compiles twice (once more where the model's own code
    branches on the length). A branch refused there stays eager, and a DynamicShapesWarning says
    so, once; `OptimizeConfig(dynamic=False)` recompiles per size instead.

    Under DistributedDataParallel (`DDP(optimize(model))` or `optimize(DDP(model))`) the passes
    see whole graphs, which are then split at DDP's gradient buckets as Dynamo would split them
    (see ddp.py), so DDP makes the same rewrites as one process and still overlaps its all-reduce
    with the backward.
    """
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module instance, not the class {model.__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, not {type(model).__name__}")
    config = OptimizeConfig() if config is None else config
    if not isinstance(config, OptimizeConfig):
        raise TypeError(f"config must be an OptimizeConfig, not {type(config).__name__}")
    state = OptimizeState.for_config(config)
    model.compile(backend=make_backend(state), dynamic=config.dynamic, fullgraph=config.fullgraph)
    # nn.Module.compile keeps the compiled call here; Dynamo's DDP split is decided per call, before
    # the backend runs, so the wrapper around this call is where it can be moved behind the passes
    model._compiled_call_impl = whole_graph_calls(model._compiled_call_impl, model)
    object.__setattr__(model, _STATE_ATTR, state)
    return model


def state_of(model: nn.Module) -> OptimizeState:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected the nn.Module passed to nsa_compile.optimize(), not {type(model).__name__}")
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("this model was not passed through nsa_compile.optimize()")
    return state


def report(model: nn.Module | None = None) -> list[dict]:
    """What the passes did so far: one row per enabled pass, in registry order.

    Each row: name, matches (count over all graphs compiled so far), where (module paths of the
    matches, in order, without repeats), kernels (what the matches became), refused (count),
    reasons (distinct refusal reasons), graphs (how many graphs the pass ran on), time_ms.

    `report(model)` reads the record of a model passed through `optimize`; `report()` with no
    model reads every `torch.compile(..., backend="nsa")` compile of this process (entry_point.py).
    """
    if model is None:
        from .entry_point import backend_states

        states = backend_states()
        if not states:
            raise ValueError("report() without a model reads torch.compile(backend='nsa') compiles, and none ran "
                             "in this process yet; for a model passed through optimize(), call report(model)")
    else:
        states = [state_of(model)]
    rows = {}
    for state in states:
        for p in state.passes:
            logs = [log for g in state.graphs for log in g.logs if log.pass_name == p.name]
            row = rows.setdefault(p.name, {"name": p.name, "matches": [], "refusals": [], "graphs": 0, "seconds": 0.0})
            row["matches"] += [m for log in logs for m in log.matches]
            row["refusals"] += [r for log in logs for r in log.refusals]
            row["graphs"] += len(logs)
            row["seconds"] += sum(log.seconds for log in logs)
    return [
        {
            "name": row["name"],
            "matches": len(row["matches"]),
            "where": list(dict.fromkeys(m.where for m in row["matches"])),
            "kernels": list(dict.fromkeys(m.kernel for m in row["matches"])),
            "refused": len(row["refusals"]),
            "reasons": list(dict.fromkeys(r.reason for r in row["refusals"])),
            "graphs": row["graphs"],
            "time_ms": round(1000 * row["seconds"], 3),
        }
        for row in rows.values()
    ]
