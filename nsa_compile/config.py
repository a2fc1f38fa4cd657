"""OptimizeConfig: the one configuration object of nsa_compile.

Every switch lives here and is passed explicitly to `optimize(model, config)`. The project
reads no environment variables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["OptimizeConfig", "COMPILERS"]

# How the rewritten graph is turned into code:
#   inductor   torch.compile's default compiler; the passes run inside it (pre_grad hook).
#   aot_eager  the passes, then AOTAutograd tracing and eager execution of the ATen graphs:
#              the same graphs Inductor would see, without codegen (fast CPU tests).
#   eager      the passes, then eager execution of the rewritten Dynamo graph.
COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class OptimizeConfig:
    """How `nsa_compile.optimize` compiles a model.

    compiler:        one of COMPILERS.
    disabled_passes: names of registered passes to skip (see `nsa_compile.pass_names()`).
    dynamic:         passed to torch.compile (None: static first, dynamic after a change).
    fullgraph:       passed to torch.compile (True: a graph break is an error).
    window_backend:  the window op's backend: 'auto' (flash where FA-2 can run, else reference),
                     'flash' or 'reference'. A named backend that cannot run a graph's tensors
                     leaves that window un-rewritten, with the reason in `explain` (no fallback).
    selection_backend: the selected-attention op's backend: 'auto' (triton on CUDA where the
                     kernels can run, else reference), 'triton' or 'reference'; as above.
    """

    compiler: str = "inductor"
    disabled_passes: tuple[str, ...] = ()
    dynamic: bool | None = None
    fullgraph: bool = False
    window_backend: str = "auto"
    selection_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(f"unknown compiler {self.compiler!r}; valid: {', '.join(COMPILERS)}")
        # torch.compile reads these as truthy (fullgraph='no' is True) or fails at the first call
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph must be a bool, not {type(self.fullgraph).__name__}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic must be None, True or False, not {type(self.dynamic).__name__}")
        from .ops import selection, window

        for name, valid in (("window_backend", window.BACKENDS), ("selection_backend", selection.BACKENDS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(valid)}")
        if isinstance(self.disabled_passes, str) or not hasattr(self.disabled_passes, "__iter__"):
            raise TypeError("disabled_passes is a tuple of pass names")
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))
        from .registry import pass_names

        valid = pass_names()
        unknown = [name for name in self.disabled_passes if name not in valid]
        if unknown:
            raise ValueError(f"unknown pass name(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")

    def replace(self, **changes) -> "OptimizeConfig":
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """What of this config changes the rewritten graph (part of each pass's uuid)."""
        return repr(sorted(dataclasses.asdict(self).items()))
