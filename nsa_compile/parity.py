"""Parity of an optimized model against its eager original: a verdict that separates a rewrite's
error from rounding noise, and the same verdict every run.

What runs (`check_parity`), each variant on its own deep copy of `eager` (which itself never
runs), one forward and one backward each, in this order:

1. eager in the checked dtype, `eager_runs` times (3 on CUDA, where eager's backward adds with
   atomics and so differs run to run; 1 on the CPU, where runs are identical);
2. the optimized model, `optimize_fn(copy in dtype)`;
3. the oracle, eager in float64, LAST, once along eager's block choices and once along the
   optimized model's (one run where they are the same). State that a model keeps outside its
   instance, which copies cannot isolate (a RoPE table cached on its class in the first call's
   dtype), is then made by a run in the checked dtype, and the oracle's float64 activations
   promote it; a model that keeps such state cannot be checked in two dtypes in one process.

Split oracle for the block choice (ARCHITECTURE.md): in bf16, NSA's top-n choice flips near-tied
blocks, and one flipped row moves a layer's gradients by more than all of its rounding (tiny, n 5,
S 128, bf16: 2 flipped rows of 192 made the optimized selection gradients 3x eager's error). So
each NSA layer of the oracle (a module with `select_blocks(p_cmp, S[, pos])` and a `cfg` with the
block sizes, as models/nsa.py) computes its own ranking and top-n, records them, and then goes on
with the judged model's choice: the numbers compare arithmetic along the same choices, and the
choices are judged on their own. The optimized model's choices are the block indices each
`nsa.selected_attention` call receives. A row's choice (batch, KV group, token; over every layer;
only rows with more candidate blocks than n, n > 3) is exact (the oracle's top-n), a near tie
(every block taken instead of one of the oracle's is within `tolerance` of it in the oracle's
importance, relative), or other. The tolerance is twice the largest importance error eager itself
makes along its choices (relative to the row's smallest freely chosen importance; `NEAR_TIE` is
its least value), so eager has no other row by construction and a correct rewrite, whose
importance rounds like eager's, has none either.

Memory: every float64 and eager run is checkpointed block by block (torch.utils.checkpoint,
non-reentrant, on each entry of the model's block list: of its nn.ModuleList and nn.Sequential
containers with two or more entries, the one holding the most parameters). The forward keeps
only the blocks' inputs; each block's activations are recomputed, in the same arithmetic, when
its backward runs, so the peak is one block's, not the model's. A model without such a container
(one layer) runs as it is. The seed model at S 2048, batch 1, float64, its parameters included:
38.1 GiB (40.9 GB) checkpointed, 312 GiB without (tensor storage alive, counted op by op on the
meta device: tools/parity_breakdown.py --oracle-memory). One layer's floor is three
[1, 12, 2048, 1024, 64] float64 tensors of its eager selected branch alive at once in its
backward (the repeated K copy, its gradient and the V copy's gradient: 12.9 GB each).

Metric: relative error ||x - ref|| / ||ref|| of the output, the loss and every parameter
gradient, for eager (err_eager: the largest over its runs) and the optimized model (err), each
against the oracle along its own choices.

Verdict (`ParityReport.ok`): every bar below holds.
- Output and loss: err <= max(k * err_eager, floor), k = 2 in fp32 and fp64 and 3 in fp16 and
  bf16 (`FACTORS`), floors 1e-5 fp32, 1e-2 bf16, 5e-3 fp16 (`FLOORS`): sums over every element,
  not noisy samples.
- Each gradient: err <= max(TENSOR_CAP * err_eager, floor), TENSOR_CAP = 10. A single gradient's
  error is a noisy sample where the gradient is a sum with heavy cancellation: a gate bias's is a
  sum over every token of terms that nearly cancel (the gate softmax makes each row's logit
  gradients sum to zero), and any change in the order of roundings moves it by several times its
  usual error (H100, seed, bf16, S 256: eager's own error of one measured 0.007 in one run and
  0.020 in the next; the no-op rewrite failed 2x a lucky sample). The cap keeps out a gradient
  that a rewrite got wrong by itself, not one that rounded unluckily.
- All rows together: the geometric mean of err / err_eager over every row <= MEAN_BOUND = 1.5,
  each error floored at the dtype's unit roundoff eps / 2 (below it an error is as exact as the
  dtype holds: a scalar loss is exact or one ulp off, and a ratio of the two says nothing). A
  wrong rewrite moves many tensors (every gradient of the layers before it) the same way;
  rounding moves some up and others down. This is the bar with teeth for an error below a
  dtype's noise in any one tensor.
- Block choice: no row of the optimized model's is other (where measured).

Measured (CPU, tiny with n 5 at S 128, where 192 rows choose; aot_eager; seeds 0-2;
tests/test_parity_verdict.py): unchanged code passes in fp32 (geometric mean 0.96-1.04, largest
gradient ratio 1.8) and bf16 (0.87-0.91, largest 4.9 on a gate bias; the optimized model and
eager each flip 0-2 rows, near ties with gaps <= 8.6e-4 against a tolerance of 4e-3). A window
one token longer fails in fp32 (mean 3.3e4-4.3e4) and bf16 (mean 3.2-3.6, gradients 18-48x). The
(n+1)-th ranked block in place of the n-th passes every numeric bar (the oracle follows the same
choice) and fails the block choice (fp32: 192 of 192 rows other; bf16: 168-174 other, 18-23 near
ties). The gate computed in bf16 fails in fp32 (mean 392-637, output 77-173x).

A limit: at the seed model's size one token more in a window of 512 moves the window branch's
gradients by 1.2-1.6% (fp32, seed shape with 2 layers and n 5 at S 1024), about what bf16 rounds
them by, so a bf16 check sees it only as ratios of 1.3-2.1 on those tensors and an aggregate of
1.16 (passes); the fp32 check sees it 1e4 times over. `nsa-compile parity` checks fp32 too, and the
GPU tests inject it in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .api import optimize
from .bench import free_memory, is_oom
from .config import OptimizeConfig
from .workload import Workload, cast_inputs, loss_of

__all__ = ["FACTORS", "FLOORS", "MEAN_BOUND", "NEAR_TIE", "TENSOR_CAP", "ChoiceAgreement", "ParityReport",
           "ParityRow", "block_list", "check_parity", "checkpoint_blocks", "choice_length", "forward_backward",
           "relative_error", "run_parity"]

FLOORS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float64: 1e-12}
FACTORS = {torch.float32: 2.0, torch.bfloat16: 3.0, torch.float16: 3.0, torch.float64: 2.0}
TENSOR_CAP = 10.0
MEAN_BOUND = 1.5
# The smallest near-tie tolerance (relative importance gap); check_parity widens it to twice eager's
# own largest importance error (measured: fp32 1.8e-7, fp16 1.6e-4, bf16 1.3e-3 on tiny, n 5, S 128).
NEAR_TIE = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float64: 1e-12}

_CFG_FIELDS = ("cmp_block", "cmp_stride", "sel_block", "n_selected", "n_kv_groups")


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (absolute norm of x - ref when ref is all zero)."""
    x, ref = x.detach().double(), ref.detach().double()
    diff = torch.linalg.vector_norm(x - ref).item()
    scale = torch.linalg.vector_norm(ref).item()
    return diff / scale if scale > 0 else diff


# --- the verdict ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParityRow:
    name: str  # 'output', 'loss', 'grad <parameter>', or the aggregate
    err_eager: float
    err_optimized: float
    bar: float

    @property
    def ok(self) -> bool:
        return self.err_optimized <= self.bar

    def as_dict(self) -> dict:
        return {"name": self.name, "err_eager": self.err_eager, "err_optimized": self.err_optimized,
                "bar": self.bar, "ok": self.ok}


@dataclass(frozen=True)
class ChoiceAgreement:
    """Query rows with a top-n choice (batch, KV group, token, over every NSA layer) where `variant`
    chose exactly the oracle's blocks, differed by a near tie, or differed otherwise."""

    variant: str  # 'optimized' or 'eager'
    rows: int
    exact: int
    near_tie: int
    other: int
    largest_gap: float  # the largest relative importance gap of a differing row (inf: a forced or impossible block)
    tolerance: float  # a near tie's largest gap

    def as_dict(self) -> dict:
        return {"variant": self.variant, "rows": self.rows, "exact": self.exact, "near_tie": self.near_tie,
                "other": self.other, "largest_gap": self.largest_gap, "tolerance": self.tolerance}

    def sentence(self, dtype: torch.dtype) -> str:
        name = "optimized" if self.variant == "optimized" else f"eager {str(dtype).removeprefix('torch.')}"
        text = f"{name}: {self.exact} exact, {self.near_tie} near tie (gap <= {self.tolerance:g}), {self.other} other"
        return text + (f" (largest gap {self.largest_gap:.3g})" if self.exact < self.rows else "")


@dataclass(frozen=True)
class ParityReport:
    dtype: torch.dtype
    rows: tuple[ParityRow, ...]  # every tensor, worst first (err_optimized / bar)
    mean_ratio: float = 1.0  # geometric mean of err_optimized / err_eager over the rows
    eager_runs: int = 1
    choices: tuple[ChoiceAgreement, ...] = ()  # the optimized model's (where measured), then eager's
    choice_note: str = ""  # why the block choice is not judged, where it is not

    @property
    def mean_row(self) -> ParityRow:
        """The aggregate bar as a row (eager's side is 1: its own err / err_eager)."""
        return ParityRow(f"geometric mean of err / eager err over {len(self.rows)} tensors", 1.0,
                         self.mean_ratio, MEAN_BOUND)

    @property
    def choice_row(self) -> ParityRow | None:
        """The block-choice bar as a row: the optimized model's rows that differ from the oracle's
        top-n by more than a near tie (none allowed; eager's count beside it), where measured."""
        optimized = next((c for c in self.choices if c.variant == "optimized"), None)
        if optimized is None:
            return None
        eager = next(c for c in self.choices if c.variant == "eager")
        return ParityRow(f"block choice: rows beyond a near tie of the oracle's top-n (of {optimized.rows})",
                         float(eager.other), float(optimized.other), 0.0)

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[ParityRow]:
        """Rows over their bars, then the aggregate and the block choice where they fail."""
        extra = [row for row in (self.mean_row, self.choice_row) if row is not None and not row.ok]
        return [row for row in self.rows if not row.ok] + extra

    def summary(self) -> list[str]:
        """What a user reads under the verdict: the aggregate, then the block choice."""
        runs = f"; eager err: the largest of {self.eager_runs} runs" if self.eager_runs > 1 else ""
        lines = [(f"geometric mean of err / eager err over {len(self.rows)} tensors: {self.mean_ratio:.3g} "
                  f"(bound {MEAN_BOUND:g}; per tensor: output and loss {FACTORS[self.dtype]:g}x eager err, "
                  f"gradients {TENSOR_CAP:g}x, or the floor{runs})")]
        if self.choices:
            lines.append(f"block choice vs the float64 top-n ({self.choices[0].rows} rows with a choice): "
                         + "; ".join(c.sentence(self.dtype) for c in self.choices))
        if self.choice_note:
            lines.append(f"block choice: {self.choice_note}")
        return lines


# --- block-wise checkpointing ---------------------------------------------------------------------


def block_list(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the entries of its nn.ModuleList or nn.Sequential with two or more
    entries that holds the most parameters ([] when it has none: the model is one block)."""
    best, most = [], 0
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            count = sum(p.numel() for p in module.parameters())
            if count > most:
                best, most = list(module), count
    return best


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint each of `block_list(model)` (non-reentrant; in place, on a copy made for parity):
    the forward keeps only the blocks' inputs, and each block's activations are recomputed when its
    backward runs. Returns the number of blocks."""
    blocks = block_list(model)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)


def choice_length(cfg) -> int | None:
    """The shortest power of two S >= (n + 3) * l' (a model config's n_selected and sel_block): a
    length at which most rows past n * l' choose freely among more candidate blocks than n
    (2048 for the seed model). None when n <= 3: the forced blocks fill every choice."""
    if cfg.n_selected <= 3:
        return None
    return 1 << ((cfg.n_selected + 3) * cfg.sel_block - 1).bit_length()


# --- block choices --------------------------------------------------------------------------------


@dataclass
class _Choice:
    """One NSA layer call's block choice (and, for eager calls, what judging it needs)."""

    layer: str  # the module's name in the model ('' for the optimized model's op calls)
    block_idx: torch.Tensor  # [B, G, S, n] int64, ascending, -1 padded
    positions: torch.Tensor | None = None  # [S] tokens or [B, S] document positions
    key: torch.Tensor | None = None  # [B, G, S, Ns] ranking key (+inf forced, -inf not a candidate, else p_grp)
    n: int = 0  # n_selected
    sel_block: int = 0  # l'


class _Choices:
    """The block choices of one run's forward, in call order (one per NSA layer call)."""

    def __init__(self) -> None:
        self.recording = False
        self.calls: list[_Choice] = []


def _ranking_key(p_cmp: torch.Tensor, S: int, pos: torch.Tensor | None, cfg) -> torch.Tensor:
    """NSA_SEMANTICS.md section 3, as models/nsa.py ranks: key [B, G, S, Ns], +inf for forced
    blocks, -inf for blocks that are not candidates, else the group's importance p_grp (p_cmp
    [B, H, S, Tc] mapped onto the selection blocks by token overlap, summed over the group's heads)."""
    B, _, _, Tc = p_cmp.shape
    l, d, ls = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    Ns = -(-S // ls)
    dev = p_cmp.device
    i = torch.arange(Tc, device=dev)[:, None]
    j = torch.arange(Ns, device=dev)[None, :]
    start = i * d if pos is None else pos[:, :Tc, None]  # [Tc, 1] or [B, Tc, 1]
    overlap = (torch.minimum(start + l, (j + 1) * ls) - torch.maximum(start, j * ls)).clamp(min=0)
    overlap = overlap.to(p_cmp.dtype) / l  # [Tc, Ns] or [B, Tc, Ns]
    p_grp = (p_cmp @ (overlap if pos is None else overlap[:, None])).view(B, cfg.n_kv_groups, -1, S, Ns).sum(2)
    t = torch.arange(S, device=dev)[:, None] if pos is None else pos[:, None, :, None]
    current = t // ls
    forced = (j == 0) | (j == current) | (j == current - 1)
    return torch.where(forced, math.inf, torch.where(j * ls <= t, p_grp, -math.inf))


def _nsa_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The NSAAttention-like modules of `model` by name: a select_blocks method and a cfg with the
    block sizes (models/nsa.py)."""
    return {name: module for name, module in model.named_modules()
            if callable(getattr(module, "select_blocks", None))
            and all(isinstance(getattr(getattr(module, "cfg", None), f, None), int) for f in _CFG_FIELDS)}


def _record_choices(model: nn.Module, choices: _Choices, forced: dict[str, torch.Tensor] | None = None) -> None:
    """Wrap every NSA layer's select_blocks (in place) so that each call's own choice and ranking
    key are recorded while `choices.recording`; with `forced`, each layer then goes on with
    forced[its name] instead of its own choice (also when a checkpointed block recomputes it)."""
    for name, module in _nsa_layers(model).items():
        def recording(p_cmp, S, *rest, _name=name, _select=module.select_blocks, _cfg=module.cfg, **kwargs):
            block_idx = _select(p_cmp, S, *rest, **kwargs)
            if choices.recording:
                pos = rest[0] if rest else kwargs.get("pos")
                positions = torch.arange(S, device=p_cmp.device) if pos is None else pos
                key = _ranking_key(p_cmp.detach(), S, pos, _cfg)
                choices.calls.append(_Choice(_name, block_idx.detach().clone(), positions, key, _cfg.n_selected,
                                             _cfg.sel_block))
            return block_idx if forced is None else forced[_name]

        module.select_blocks = recording


@contextlib.contextmanager
def _record_op_choices(choices: _Choices):
    """Record the block indices every `nsa.selected_attention` call receives (real tensors only,
    not a compile's fakes) while `choices.recording`: the optimized model's choices, whatever
    computed them."""
    from .ops import registry

    op = registry.get("selected_attention")
    check = op.check  # the declaration's check, which every call of the op runs first

    from .ops.triton_support import made_aside

    def recording(q, k, v, block_idx, *args, **kwargs):
        if choices.recording and type(block_idx) is torch.Tensor:
            # copied outside a CUDA graph's memory pool (OptimizeConfig(cuda_graphs=True)): a copy
            # kept from inside the graph's warm-up would be a pool tensor the graph does not return
            choices.calls.append(_Choice("", made_aside(lambda: block_idx.detach().clone(), block_idx.device)))
        return check(q, k, v, block_idx, *args, **kwargs)

    op.check = recording
    try:
        yield
    finally:
        op.check = check


def _choice_rows(call: _Choice) -> torch.Tensor:
    """[B or 1, 1, S] bool: the query rows of a call with a top-n choice (more candidate blocks than
    n, and n > 3: block 0 and the two local blocks are always chosen)."""
    t = call.positions if call.positions.dim() == 2 else call.positions[None]  # [B or 1, S]
    return ((t // call.sel_block + 1 > call.n) & (call.n > 3))[:, None, :]


def _importance_error(eager: list[_Choice], oracle: list[_Choice]) -> float:
    """The largest |key_eager - key_oracle| over the candidate blocks of the rows with a choice,
    relative to the row's boundary (the smallest importance the oracle chose freely): how far
    eager's own rounding moves a block's importance, along the same choices."""
    largest = 0.0
    for mine, ref in zip(eager, oracle):
        chosen = ref.key.gather(-1, ref.block_idx.clamp(min=0))  # [B, G, S, n]
        free = (ref.block_idx >= 0) & torch.isfinite(chosen)
        boundary = torch.where(free, chosen, math.inf).amin(-1, keepdim=True)  # [B, G, S, 1]
        rows = _choice_rows(ref)[..., None] & torch.isfinite(boundary)
        candidate = torch.isfinite(ref.key) & torch.isfinite(mine.key) & rows  # [B, G, S, Ns]
        moved = torch.where(candidate, (mine.key - ref.key).abs() / boundary.abs().clamp(min=1e-300), 0.0)
        largest = max(largest, float(moved.max()) if moved.numel() else 0.0)
    return largest


def _importance(key: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
    """key [B, G, S, Ns] at block_idx [B, G, S, n] (-inf at the -1 padding)."""
    return torch.where(block_idx >= 0, key.gather(-1, block_idx.clamp(min=0)), -math.inf)


def _agreement(variant: str, mine: list[_Choice], oracle: list[_Choice], tolerance: float) -> ChoiceAgreement:
    """`mine`'s choices against the oracle's own top-n along the same choices, layer by layer, on
    the rows with a choice. A differing row's gap: (best importance it dropped - worst it took
    instead) / best dropped, in the oracle's key; inf if it dropped a forced block or took one
    that is no candidate."""
    rows = exact = near = 0
    largest = 0.0
    for var, ref in zip(mine, oracle):
        chosen_freely = _choice_rows(ref).expand(ref.block_idx.shape[:3])  # [B, G, S]
        same = (var.block_idx == ref.block_idx).all(-1)
        kept = (ref.block_idx[..., :, None] == var.block_idx[..., None, :]).any(-1)  # [B, G, S, n]
        also_oracle = (var.block_idx[..., :, None] == ref.block_idx[..., None, :]).any(-1)
        dropped = torch.where(kept, -math.inf, _importance(ref.key, ref.block_idx)).amax(-1)
        taken = torch.where(also_oracle, math.inf, _importance(ref.key, var.block_idx)).amin(-1)
        finite = torch.isfinite(dropped) & torch.isfinite(taken)
        gap = torch.where(finite, (dropped - taken) / dropped.abs().clamp(min=1e-300), math.inf)
        differ = chosen_freely & ~same
        rows += int(chosen_freely.sum())
        exact += int((chosen_freely & same).sum())
        near += int((differ & (gap <= tolerance)).sum())
        if bool(differ.any()):
            largest = max(largest, float(gap[differ].max()))
    return ChoiceAgreement(variant, rows, exact, near, rows - exact - near, largest, tolerance)


# --- the runs -------------------------------------------------------------------------------------


def forward_backward(model: nn.Module, inputs: tuple, is_lm: bool, dtype: torch.dtype,
                     choices: _Choices | None = None) -> dict[str, torch.Tensor | None]:
    """One forward and backward of `model` (in dtype) on `inputs`, with check_parity's loss:
    {'output': ..., 'loss': ..., 'grad <parameter name>': its grad or None}. `choices` records the
    forward's block choices."""
    model.zero_grad(set_to_none=True)
    if choices is not None:
        choices.recording = True
    try:
        out, loss = loss_of(model, cast_inputs(inputs, dtype), is_lm)
    finally:
        if choices is not None:
            choices.recording = False
    loss.backward()
    return {"output": out.detach(), "loss": loss.detach(),
            **{f"grad {name}": p.grad for name, p in model.named_parameters()}}


def _errors(runs: list[dict], oracle: dict) -> dict[str, float | None]:
    """Per tensor of the oracle, the largest relative error over `runs`; None where a gradient is
    None on one side but not on the other (inf where the runs disagree about it)."""
    errors = {}
    for name, ref in oracle.items():
        missing = [run.get(name) is None for run in runs]
        if ref is None or any(missing):
            errors[name] = None if ref is None and all(missing) else math.inf
        else:
            errors[name] = max(relative_error(run[name], ref) for run in runs)
    return errors


def _release(device: torch.device) -> None:
    """Give a dropped model's memory back before the next run: on CUDA, collect the reference
    cycles that hold it (the checkpoint wrappers make some) and empty the cache. Not on the CPU,
    where a full collection after a compile costs seconds and frees nothing another run needs."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def check_parity(
    eager: nn.Module,
    optimize_fn,
    inputs: torch.Tensor | tuple,
    dtype: torch.dtype,
    is_lm: bool = True,
    floors: dict | None = None,
    eager_runs: int | None = None,
    blockwise: bool = True,
) -> ParityReport:
    """Compare `optimize_fn(copy of eager in dtype)` with eager in dtype, each against eager in
    float64 along its own block choices (the module docstring says what runs, in which order, and
    what the verdict asks).

    `eager` is left untouched: every variant runs on its own deep copy. With is_lm (the default)
    `inputs` are tokens [B, S + 1] (and pos [B, S] for packed documents) and the loss is
    next-token cross-entropy; otherwise `inputs` are the model's positional inputs (floating ones
    cast to each model's dtype) and the loss is the mean square of the first floating output. A
    gradient that is None in the oracle must be None in the optimized model and vice versa.
    `blockwise` checkpoints the eager runs, the oracle's included, block by block (False: as they are).
    """
    floor = (floors or FLOORS)[dtype]
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    device = inputs[0].device
    if eager_runs is None:
        eager_runs = 3 if device.type == "cuda" else 1
    if eager_runs < 1:
        raise ValueError(f"eager_runs must be >= 1, got {eager_runs}")

    def run_eager(to: torch.dtype, runs: int, choices: _Choices, forced: dict | None = None) -> list[dict]:
        model = copy.deepcopy(eager).to(to)
        if blockwise:
            checkpoint_blocks(model)
        _record_choices(model, choices, forced)
        results = [forward_backward(model, inputs, is_lm, to, choices if run == 0 else None) for run in range(runs)]
        del model
        _release(device)
        return results

    eager_choices, optimized_choices = _Choices(), _Choices()
    eager_results = run_eager(dtype, eager_runs, eager_choices)
    with _record_op_choices(optimized_choices):
        model = optimize_fn(copy.deepcopy(eager).to(dtype))
        optimized = forward_backward(model, inputs, is_lm, dtype, optimized_choices)
    del model
    _release(device)

    # The oracle, last: along eager's block choices, then along the optimized model's where they
    # differ. Each variant's errors are taken as soon as its oracle exists, and its results dropped.
    layers = [c.layer for c in eager_choices.calls]
    split = bool(layers) and len(set(layers)) == len(layers)  # each NSA layer ran once in the forward
    measured = split and len(optimized_choices.calls) == len(layers)
    eager_forced = dict(zip(layers, (c.block_idx for c in eager_choices.calls))) if split else None
    optimized_forced = dict(zip(layers, (c.block_idx for c in optimized_choices.calls))) if measured else None
    same_choices = optimized_forced is None or all(torch.equal(optimized_forced[k], eager_forced[k]) for k in layers)
    eager_oracle = _Choices()
    (reference,) = run_eager(torch.float64, 1, eager_oracle, eager_forced)
    err_eager = _errors(eager_results, reference)
    del eager_results
    optimized_oracle = eager_oracle
    if not same_choices:
        del reference
        _release(device)
        optimized_oracle = _Choices()
        (reference,) = run_eager(torch.float64, 1, optimized_oracle, optimized_forced)
    err = _errors([optimized], reference)
    del reference, optimized
    _release(device)

    rows, ratios = [], []
    roundoff = torch.finfo(dtype).eps / 2
    for name, base in err_eager.items():
        if base is None and err[name] is None:
            continue
        if base is None or err[name] is None or math.isinf(base) or math.isinf(err[name]):
            rows.append(ParityRow(f"{name} (grad None mismatch)", 0.0, math.inf, 0.0))
            continue
        factor = TENSOR_CAP if name.startswith("grad ") else FACTORS[dtype]
        rows.append(ParityRow(name, base, err[name], max(factor * base, floor)))
        ratios.append(math.log(max(err[name], roundoff) / max(base, roundoff)))
    rows.sort(key=lambda r: r.err_optimized / r.bar if r.bar > 0 else math.inf, reverse=True)
    mean_ratio = math.exp(sum(ratios) / len(ratios)) if ratios else 1.0
    choices, note = _choice_report(eager_choices, optimized_choices, eager_oracle, optimized_oracle, split,
                                   measured, dtype)
    return ParityReport(dtype, tuple(rows), mean_ratio, eager_runs, choices, note)


def run_parity(wl: Workload, dtype: torch.dtype, config: OptimizeConfig) -> ParityReport:
    """check_parity of the workload's model against optimize(model, config) (a fresh Dynamo each
    time), then the compiled code and the models' memory given back (what the CLI and tools run)."""
    def optimize_fn(m):
        torch._dynamo.reset()
        return optimize(m, config)

    result = check_parity(wl.model, optimize_fn, wl.inputs, dtype, is_lm=wl.is_lm)
    free_memory()
    return result


def _choice_report(eager: _Choices, optimized: _Choices, eager_oracle: _Choices, optimized_oracle: _Choices,
                   split: bool, measured: bool, dtype: torch.dtype) -> tuple[tuple[ChoiceAgreement, ...], str]:
    """(the agreements of the optimized model and of eager with the oracle's top-n along their own
    choices, and a note where the choice is not judged)."""
    if not eager.calls:
        return (), "not measured (the model has no NSA layer with select_blocks)"
    if not split:
        return (), "not measured (an NSA layer ran more than once in one forward)"
    if not any(bool(_choice_rows(c).any()) for c in eager.calls):
        return (), ("not exercised: no row chooses among its candidate blocks (below n * l' tokens a row takes "
                    "them all; with n <= 3 every chosen block is forced)")
    tolerance = max(NEAR_TIE[dtype], 2 * _importance_error(eager.calls, eager_oracle.calls))
    mine = _agreement("eager", eager.calls, eager_oracle.calls, tolerance)
    if not measured:
        return (mine,), (f"not measured for the optimized model (it passed {len(optimized.calls)} block choices "
                         f"to nsa.selected_attention, eager made {len(eager.calls)})")
    return (_agreement("optimized", optimized.calls, optimized_oracle.calls, tolerance), mine), ""


# --- parity at the longest length that fits (the bench tools) -------------------------------------


@dataclass
class FittedParity:
    """check_parity at the longest length that fits (fit_parity): the report, or why there is none."""

    report: ParityReport | None
    length: int | None  # where it ran, or where it failed with an error other than out of memory
    oom_at: list[int] = field(default_factory=list)  # where the float64 oracle ran out of memory, longest first
    detail: str | None = None  # why there is no report: the error, or every length too long or too short

    def record(self) -> dict:
        """The JSON fields every bench record holds: ok (None: not checked), parity_len, oom_at and,
        without a report, detail."""
        if self.report is not None:
            return {"ok": self.report.ok, "parity_len": self.length, "oom_at": self.oom_at}
        return {"ok": None if self.length is None else False, "parity_len": self.length, "oom_at": self.oom_at,
                "detail": self.detail}


def fit_parity(run: Callable[[int], ParityReport], length: int, min_length: int) -> FittedParity:
    """run(length) (a check_parity at that sequence length), halving the length while the float64
    oracle runs out of memory and the half is at least min_length (the first length always runs).
    Another error ends the search (its traceback is printed, its first line kept); the memory of
    each failed try is given back before the next."""
    oom_at = []
    while True:
        try:
            return FittedParity(run(length), length, oom_at)
        except Exception as err:
            free_memory()
            if not is_oom(err):
                traceback.print_exc()
                first = (str(err).strip().splitlines() or [""])[0][:200]
                return FittedParity(None, length, oom_at, f"{type(err).__name__}: {first}")
            oom_at.append(length)
            if length // 2 < min_length:
                return FittedParity(None, None, oom_at, f"the float64 oracle ran out of memory down to seq-len {length}")
            length //= 2


def parity_sentence(record: dict, checked: str, where: str, note: str = "") -> str:
    """The verdict line of a bench record (FittedParity.record() and the tool's fields): `checked` is
    what was compared, `where` the dtype, batch and length, `note` why that length, if it needs saying."""
    if record["ok"] is None:
        return f"parity: not checked ({record['detail']})"
    if "detail" in record:
        return f"parity at seq-len {record['parity_len']}: FAIL ({record['detail']})"
    if record["oom_at"]:
        where += f"; the float64 oracle did not fit at {', '.join(map(str, record['oom_at']))}"
    elif note:
        where += f" ({note})"
    if not record["selection_exercised"]:
        where += "; every candidate block is selected at this length (top-n choice not exercised)"
    return f"parity of {checked} ({where}): {'PASS' if record['ok'] else 'FAIL'}"
