"""OptimizeConfig: the one configuration object of nsa_compile.

Every switch lives here and is passed explicitly to `optimize(model, config)`. The project
reads no environment variables.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from .ops import registry

__all__ = ["OptimizeConfig", "COMPILERS"]

# How the rewritten graph is turned into code:
#   inductor   torch.compile's default compiler; the passes run inside it (pre_grad hook).
#   aot_eager  the passes, then AOTAutograd tracing and eager execution of the ATen graphs:
#              the same graphs Inductor would see, without codegen (fast CPU tests).
#   eager      the passes, then eager execution of the rewritten Dynamo graph.
COMPILERS = ("inductor", "aot_eager", "eager")


# The backend fields' earlier names (the order of the InitVars below) -> today's.
RENAMED_FIELDS = {
    "window_backend": "window_attention_backend", "selection_backend": "selected_attention_backend",
    "compressed_backend": "compressed_attention_backend", "block_select_backend": "select_blocks_backend",
    "combine_backend": "gated_combine_backend",
}

# Passes' earlier names, accepted in disabled_passes (deprecated) -> today's.
RENAMED_PASSES = {"block_selection": "select_blocks", "selection_attention": "selected_attention",
                  "projections_rope": "projection_rope"}


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
    window_attention_backend, selected_attention_backend, compressed_attention_backend, select_blocks_backend, gated_combine_backend,
    projection_rope_backend:
                     the backend of each custom op (torch.ops.nsa.window_attention,
                     selected_attention, compressed_attention, select_blocks, gated_combine,
                     projection_rope), declared with the op (nsa_compile/ops/registry.py;
                     `nsa_compile.explain.backend_table()` lists them). 'auto' (the default) takes
                     the first backend of the op's order that can run a graph's tensors: its Triton
                     kernels on CUDA where they can run (the window's and the projections' in
                     fp16/bf16 only; the window then FA-2, 'flash'), else 'reference' (PyTorch,
                     every device and dtype). A named backend that cannot run a graph's tensors
                     leaves that op un-rewritten, with the reason in `explain` (no fallback). The
                     selection also has 'varlen' (PyTorch's FA-2 varlen kernels: CUDA, fp16/bf16,
                     Dk == Dv) and 'varlen_flash_attn' (the same through the flash-attn package, an
                     opt-in not installed on this project's machines), never taken by 'auto'.
                     `OptimizeConfig.backend(op)` reads the choice by op name.
    deterministic:   True: every rewrite runs kernels whose backward sums in a fixed order, so
                     two runs give the rewritten ops bitwise the same gradients. Naming a backend
                     whose backward is declared not deterministic (atomic adds: 'flash' for the
                     window, 'varlen*' for the selection) is an error, and 'auto' of an op whose
                     order holds one becomes the op's last deterministic backend (the window's
                     'reference'). It sets no global state: the rest of the model (embedding and
                     gather backwards, cuBLAS) and the selection's reference backward (a
                     scatter-add on CUDA, where its Triton kernels cannot run) need
                     torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8,
                     both set by the user.
    window_backend, selection_backend, compressed_backend, block_select_backend, combine_backend:
                     the earlier names of the backend fields (`<op>_backend` now: one name per
                     concept, the op's); accepted with a DeprecationWarning for one release.
    strict:          True: the first compile raises nsa_compile.coverage.CoverageError, with the
                     coverage table (per layer: branches rewritten / detected; each eager branch
                     with its source line and reasons), where an NSA branch it detects stays eager,
                     so that a training job cannot silently run the slow eager code. Detected: every
                     softmax, F.scaled_dot_product_attention and top-k/sort ranking left after the
                     passes (coverage.py), so a model whose other softmaxes are not NSA (a router)
                     cannot use it. Frames Dynamo skips whole are not seen (`explain` lists them).
    cuda_graphs:     True: Inductor replays each compiled CUDA graph (forward, backward) as one CUDA
                     graph (its `triton.cudagraphs`, what torch.compile's mode='reduce-overhead'
                     turns on), so a step no longer waits on the host launching its kernels one by
                     one: a single NSA layer at S 2048 x 32 takes about as long to launch as to run
                     (H200, 2026-11-27). compiler='inductor' only. The outputs of one step's replay
                     are overwritten by the next (Inductor's rule: copy what is kept across steps).
                     A rewritten op that reads a value back to the host cannot be captured (the
                     window's FA-2 path and the reference backends with document positions `pos`,
                     the selection's 'varlen' backends): the compile raises
                     nsa_compile.pass_manager.CudaGraphsError naming it.
    """

    compiler: str = "inductor"
    disabled_passes: tuple[str, ...] = ()
    dynamic: bool | None = None
    fullgraph: bool = False
    window_attention_backend: str = "auto"
    selected_attention_backend: str = "auto"
    compressed_attention_backend: str = "auto"
    select_blocks_backend: str = "auto"
    gated_combine_backend: str = "auto"
    projection_rope_backend: str = "auto"
    deterministic: bool = False
    strict: bool = False
    cuda_graphs: bool = False
    # the backend fields that deterministic=True turned from 'auto' into a deterministic backend
    # (replace() starts them from 'auto' again, so that replace(deterministic=False) undoes it)
    _resolved_auto: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    # the fields' earlier names (deprecated aliases, for one release)
    window_backend: dataclasses.InitVar[str | None] = None
    selection_backend: dataclasses.InitVar[str | None] = None
    compressed_backend: dataclasses.InitVar[str | None] = None
    block_select_backend: dataclasses.InitVar[str | None] = None
    combine_backend: dataclasses.InitVar[str | None] = None

    def __post_init__(self, *old_names) -> None:
        for (old, new), given in zip(RENAMED_FIELDS.items(), old_names):
            if given is None:
                continue
            warnings.warn(f"OptimizeConfig({old}=...) is deprecated: the field is {new} now (the op's name)",
                          DeprecationWarning, stacklevel=3)
            if getattr(self, new) not in ("auto", given):
                raise ValueError(f"{old}={given!r} and {new}={getattr(self, new)!r} name one field twice")
            object.__setattr__(self, new, given)
        if self.compiler not in COMPILERS:
            raise ValueError(f"unknown compiler {self.compiler!r}; valid: {', '.join(COMPILERS)}")
        # torch.compile reads these as truthy (fullgraph='no' is True) or fails at the first call
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph must be a bool, not {type(self.fullgraph).__name__}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be a bool, not {type(self.strict).__name__}")
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, not {type(self.cuda_graphs).__name__}")
        if self.cuda_graphs and self.compiler != "inductor":
            raise ValueError(f"cuda_graphs=True needs compiler='inductor' (its CUDA graph trees), not {self.compiler!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic must be None, True or False, not {type(self.dynamic).__name__}")
        for op in registry.ops():
            choice, valid = getattr(self, op.config_field), op.backend_names()
            if choice not in valid:
                raise ValueError(f"unknown {op.config_field} {choice!r}; valid: {', '.join(valid)}")
        self._check_deterministic()
        if isinstance(self.disabled_passes, str) or not hasattr(self.disabled_passes, "__iter__"):
            raise TypeError("disabled_passes is a tuple of pass names")
        disabled = []
        for name in self.disabled_passes:
            if name in RENAMED_PASSES:
                warnings.warn(f"pass {name!r} is {RENAMED_PASSES[name]!r} now (the op's name); the old name is "
                              "deprecated", DeprecationWarning, stacklevel=3)
            disabled.append(RENAMED_PASSES.get(name, name))
        object.__setattr__(self, "disabled_passes", tuple(disabled))
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
        resolved = []
        for op in registry.ops():
            name, choice = op.config_field, getattr(self, op.config_field)
            if choice != "auto" and (atomic := op.backend(choice).nondeterministic):
                raise ValueError(f"{name}={choice!r} with deterministic=True: {atomic}; leave {name}='auto' "
                                 "(deterministic=True makes it take a deterministic backend)")
            if choice == "auto" and (backend := op.deterministic_auto()):
                object.__setattr__(self, name, backend)
                resolved.append(name)
        object.__setattr__(self, "_resolved_auto", tuple(resolved))

    def backend(self, op: str) -> str:
        """The backend asked for the custom op `op` (its torch.ops.nsa name, e.g. 'window_attention'):
        'auto' or a backend's name, as the passes hand it to the op's backend choice."""
        return getattr(self, registry.get(op).config_field)

    def replace(self, **changes) -> "OptimizeConfig":
        for name in self._resolved_auto:  # what deterministic=True resolved is 'auto' again
            changes.setdefault(name, "auto")
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """What of this config changes the rewritten graph (part of each pass's uuid)."""
        fields = dataclasses.asdict(self)
        fields.pop("_resolved_auto")  # bookkeeping for replace(), no behaviour of its own
        fields.pop("strict")  # checks the rewritten graph, changes nothing in it (checked on cache hits too)
        # 'auto' reads the registered backends in their order (add_backend changes them at run time)
        fields["registered_backends"] = [(op.name, [b.name for b in op.backends]) for op in registry.ops()]
        return repr(sorted(fields.items()))
