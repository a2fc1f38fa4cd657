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

# deterministic=True: the backends whose backward is not bitwise repeatable (named in a config,
# an error), and what 'auto' becomes where it could pick one of them. 'auto' of the other fields
# takes kernels without atomics (triton on CUDA, PyTorch on the CPU), with one gap: where the
# selection's triton kernels cannot run on CUDA, its reference backward scatter-adds dK/dV
# atomically (the selection pass must refuse that under deterministic=True).
DETERMINISM_BREAKERS = {
    "window_backend": {"flash": "FA-2's backward accumulates dQ with atomic adds (not bitwise repeatable)"},
    "selection_backend": {
        "varlen": "FA-2's backward accumulates dQ, and index_add dK/dV, with atomic adds",
        "varlen_flash_attn": "FA-2's backward accumulates dQ, and index_add dK/dV, with atomic adds",
    },
}
DETERMINISTIC_AUTO = {"window_backend": "reference"}


@dataclass(frozen=True)
class OptimizeConfig:
    """How `nsa_compile.optimize` compiles a model.

    compiler:        one of COMPILERS.
    disabled_passes: names of registered passes to skip (see `nsa_compile.pass_names()`).
    dynamic:         passed to torch.compile (None: static first, then the sizes that changed as
                     symbols, which the passes rewrite too; True: every size a symbol from the
                     first call, head dims included, so a scale computed from one is no constant
                     and the attention passes refuse it; False: a static compile per size).
    fullgraph:       passed to torch.compile (True: a graph break is an error).
    window_backend:  the window op's backend: 'auto' (triton on CUDA in fp16/bf16 without packed
                     documents, else flash where FA-2 can run, else reference), 'triton',
                     'flash' or 'reference'. A named backend that cannot run a graph's tensors
                     leaves that window un-rewritten, with the reason in `explain` (no fallback).
    selection_backend: the selected-attention op's backend: 'auto' (triton on CUDA where the
                     kernels can run, else reference), 'triton', 'reference', 'varlen' (PyTorch's
                     FA-2 varlen kernels: CUDA, fp16/bf16, Dk == Dv; never chosen by 'auto') or
                     'varlen_flash_attn' (the same algorithm through the flash-attn package's
                     flash_attn_varlen_func: the opt-in for that package, which is not installed
                     or run on this project's machines); as above.
    compressed_backend: the compressed-attention op's backend, with the choices of selection_backend.
    block_select_backend: the block-selection op's backend, with the choices of selection_backend.
    combine_backend: the gated-combine op's backend (gate MLP + the three branches' weighted
                     sum): 'auto' (triton on CUDA where the kernels can run, else reference),
                     'triton' or 'reference'; as window_backend.
    deterministic:   True: every rewrite runs kernels whose backward sums in a fixed order, so
                     two runs give the rewritten ops bitwise the same gradients. 'auto' window_backend becomes
                     'reference' (FA-2's backward adds dQ atomically); naming a backend that is
                     not deterministic ('flash' for the window, 'varlen*' for the selection) is
                     an error here. It sets no global state: the rest of the model (embedding and
                     gather backwards, cuBLAS) needs torch.use_deterministic_algorithms(True)
                     and CUBLAS_WORKSPACE_CONFIG=:4096:8, both set by the user.
    strict:          True: the first compile raises nsa_compile.coverage.CoverageError, with the
                     coverage table (per layer: branches rewritten / detected; each eager branch
                     with its source line and reasons), where an NSA branch it detects stays eager,
                     so that a training job cannot silently run the slow eager code. Detected: every
                     softmax, F.scaled_dot_product_attention and top-k/sort ranking left after the
                     passes (coverage.py), so a model whose other softmaxes are not NSA (a router)
                     cannot use it. Frames Dynamo skips whole are not seen (`explain` lists them).
    """

    compiler: str = "inductor"
    disabled_passes: tuple[str, ...] = ()
    dynamic: bool | None = None
    fullgraph: bool = False
    window_backend: str = "auto"
    selection_backend: str = "auto"
    compressed_backend: str = "auto"
    block_select_backend: str = "auto"
    combine_backend: str = "auto"
    deterministic: bool = False
    strict: bool = False
    # the backend fields that deterministic=True turned from 'auto' into a deterministic backend
    # (replace() starts them from 'auto' again, so that replace(deterministic=False) undoes it)
    _resolved_auto: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(f"unknown compiler {self.compiler!r}; valid: {', '.join(COMPILERS)}")
        # torch.compile reads these as truthy (fullgraph='no' is True) or fails at the first call
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph must be a bool, not {type(self.fullgraph).__name__}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be a bool, not {type(self.strict).__name__}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic must be None, True or False, not {type(self.dynamic).__name__}")
        from .ops import block_select, compressed, gated_combine, selection, window

        for name, valid in (("window_backend", window.BACKENDS), ("selection_backend", selection.BACKENDS),
                            ("compressed_backend", compressed.BACKENDS),
                            ("block_select_backend", block_select.BACKENDS),
                            ("combine_backend", gated_combine.BACKENDS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(valid)}")
        self._check_deterministic()
        if isinstance(self.disabled_passes, str) or not hasattr(self.disabled_passes, "__iter__"):
            raise TypeError("disabled_passes is a tuple of pass names")
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))
        from .registry import pass_names

        valid = pass_names()
        unknown = [name for name in self.disabled_passes if name not in valid]
        if unknown:
            raise ValueError(f"unknown pass name(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")

    def _check_deterministic(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic must be a bool, not {type(self.deterministic).__name__}")
        if not self.deterministic:
            return
        for name, atomic in DETERMINISM_BREAKERS.items():
            if getattr(self, name) in atomic:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} with deterministic=True: {atomic[getattr(self, name)]}; "
                    f"leave {name}='auto' (deterministic=True makes it take a deterministic backend)")
        resolved = []
        for name, backend in DETERMINISTIC_AUTO.items():
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, backend)
                resolved.append(name)
        object.__setattr__(self, "_resolved_auto", tuple(resolved))

    def replace(self, **changes) -> "OptimizeConfig":
        for name in self._resolved_auto:  # what deterministic=True resolved is 'auto' again
            changes.setdefault(name, "auto")
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """What of this config changes the rewritten graph (part of each pass's uuid)."""
        fields = dataclasses.asdict(self)
        fields.pop("_resolved_auto")  # bookkeeping for replace(), no behaviour of its own
        fields.pop("strict")  # checks the rewritten graph, changes nothing in it (checked on cache hits too)
        return repr(sorted(fields.items()))
