"""`torch.compile(model, backend="nsa")`: the NSA passes as a named Dynamo backend.

PyTorch finds this backend through the `torch_dynamo_backends` entry point that pyproject.toml
declares, as it finds any third-party compiler backend. It is the same backend `optimize` uses;
only the bookkeeping differs, because Dynamo hands a named backend graphs but never the module
they came from:

    compiled = torch.compile(model, backend="nsa")                     # OptimizeConfig() defaults
    compiled = torch.compile(model, backend="nsa", options={"compiler": "aot_eager"})
    compiled(x).sum().backward()
    nsa_compile.report()            # what every backend="nsa" compile in this process rewrote

`options` are OptimizeConfig's fields by name (an unknown name raises, listing the valid ones);
`dynamic` and `fullgraph` are torch.compile's own arguments on this route. Compiles with equal
options share one record, so `report()` counts every graph compiled with the defaults together.
Prefer `optimize(model)`: it compiles in place (state_dict keys without `_orig_mod.`), keeps one
record per model, and wraps DDP so that the passes see whole graphs.
"""

from __future__ import annotations

import dataclasses

from .backend import make_backend
from .config import OptimizeConfig
from .pass_manager import OptimizeState

__all__ = ["nsa", "backend_states"]

# One record per distinct config, in the order first used: what report() reads on this route.
_STATES: dict[str, tuple[OptimizeState, object]] = {}


def _config_from(options) -> OptimizeConfig:
    if options is None:
        return OptimizeConfig()
    if isinstance(options, OptimizeConfig):
        return options
    if not isinstance(options, dict):
        raise TypeError(f"backend 'nsa' takes options as a dict of OptimizeConfig fields, not {type(options).__name__}")
    valid = [f.name for f in dataclasses.fields(OptimizeConfig) if f.init]
    owned = [name for name in ("dynamic", "fullgraph") if name in options]
    if owned:
        raise ValueError(f"pass {', '.join(owned)} to torch.compile itself, not in options")
    unknown = [name for name in options if name not in valid]
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for backend 'nsa'; "
                         f"valid: {', '.join(n for n in valid if n not in ('dynamic', 'fullgraph'))}")
    return OptimizeConfig(**options)


def nsa(gm, example_inputs, options=None):
    """The Dynamo backend named "nsa": the NSA passes, then the config's compiler (Inductor by default)."""
    config = _config_from(options)
    key = config.cache_key()
    if key not in _STATES:
        state = OptimizeState.for_config(config)
        _STATES[key] = (state, make_backend(state))
    _, backend = _STATES[key]
    return backend(gm, example_inputs)


def backend_states() -> list[OptimizeState]:
    """The records of every backend="nsa" compile in this process, one per distinct config."""
    return [state for state, _ in _STATES.values()]
