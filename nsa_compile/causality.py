"""Does a sequence model read the future? Perturb the inputs after position t and watch the outputs.

    report = check_causality(model, (x,))       # x [B, S, dim] floats, or tokens [B, S] int64
    report.causal, report.first_leak, report.verdict()

A causal model's output at position p depends only on inputs at positions <= p. For several cut
points t, the check replaces the inputs after t with fresh random values (random tokens for an
integer input, Gaussian values of the input's own spread for a floating one), runs the model
again, and compares the outputs at positions 0..t with the unperturbed run: every position that
changed by more than `atol` leaks the future. NSA code leaks easily (a selection score without
its causal mask, a block that ends one token late, a finite mask that turns an empty row into a
uniform average of future values), and a leak rarely shows in a loss curve.

The sequence axis is dim 1 of the perturbed inputs and of the output ([B, S, ...]); the output is
the model's tensor output or its first floating-point tensor (as nsa_compile.workload.loss_of
reads it). With `per_module=True`, forward hooks compare every submodule's output the same way
(those whose output has the sequence length at dim 1) and name, in call order, the submodules
whose output leaked: the first of them is where the future gets in.

Each forward runs under torch.no_grad() with the same RNG seed (dropout draws the same mask in
every run), so a position that changes changed because of the perturbation. A check can miss a
leak that only flips a discrete choice on rare inputs (a top-k that ties); more cut points and
trials make that less likely, never impossible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["check_causality", "CausalityReport", "Leak", "default_cuts"]


@dataclass(frozen=True)
class Leak:
    """What changed at positions <= cut when the inputs after `cut` were perturbed (worst trial).

    positions: output positions <= cut that changed, ascending; max_change: their largest absolute
    change; modules: submodules (name, or name#call for a module called several times) whose
    output changed at positions <= cut, in call order (per_module=True only)."""

    cut: int
    positions: tuple[int, ...]
    max_change: float
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class CausalityReport:
    """The outcome of check_causality: causal when no cut leaked."""

    seq_len: int
    cuts: tuple[int, ...]
    trials: int
    atol: float
    leaks: tuple[Leak, ...] = field(default=())
    per_module: bool = False

    @property
    def causal(self) -> bool:
        return not self.leaks

    @property
    def first_leak(self) -> int | None:
        """The lowest output position that changed under any cut, or None when causal."""
        return min((leak.positions[0] for leak in self.leaks), default=None)

    @property
    def max_change(self) -> float:
        return max((leak.max_change for leak in self.leaks), default=0.0)

    def verdict(self) -> str:
        """One line: causal, or where the future leaks and by how much."""
        tested = f"{len(self.cuts)} cut point(s) x {self.trials} trial(s), seq-len {self.seq_len}"
        if self.causal:
            return f"causal: no output at positions <= t changed when the inputs after t were perturbed ({tested})"
        worst = max(self.leaks, key=lambda leak: leak.max_change)
        first = min(self.leaks, key=lambda leak: leak.positions[0])
        where = ""
        if self.per_module:  # no submodule leaked: the future gets in in the top module's own forward
            where = f"; first leaking module: {first.modules[0] if first.modules else '(the top module itself)'}"
        return (f"NOT causal: output position {first.positions[0]} changed when the inputs after "
                f"{first.cut} were perturbed; {sum(len(leak.positions) for leak in self.leaks)} position(s) over "
                f"{len(self.leaks)} of {len(self.cuts)} cut point(s), max change {worst.max_change:.3g} "
                f"(after {worst.cut}){where} ({tested})")

    def as_dict(self) -> dict:
        return {"causal": self.causal, "seq_len": self.seq_len, "cuts": list(self.cuts), "trials": self.trials,
                "atol": self.atol, "first_leak": self.first_leak, "max_change": self.max_change,
                "leaks": [{"cut": leak.cut, "positions": list(leak.positions), "max_change": leak.max_change,
                           "modules": list(leak.modules)} for leak in self.leaks]}


def default_cuts(seq_len: int) -> tuple[int, ...]:
    """Cut points spread over the sequence, the first rows included (where NSA's compressed branch
    has no block yet and empty-row handling leaks most often): 0, 1, S/8, S/4, S/2, 3S/4, S-2."""
    points = {0, 1, seq_len // 8, seq_len // 4, seq_len // 2, 3 * seq_len // 4, seq_len - 2}
    return tuple(sorted(t for t in points if 0 <= t < seq_len - 1))


def check_causality(model: nn.Module, inputs, *, cuts: tuple[int, ...] | None = None, trials: int = 2,
                    perturb: tuple[int, ...] = (0,), vocab: int | None = None, atol: float = 0.0,
                    per_module: bool = False, seed: int = 0) -> CausalityReport:
    """Perturb the inputs after each cut point and report every output position <= cut that changed.

    model:   any module taking `inputs` positionally (eager; the check does not compile it).
    inputs:  a tensor or a tuple of the forward's positional inputs. The inputs named by `perturb`
             (indices into the tuple; default the first) have the sequence at dim 1: tokens [B, S]
             (integer) or features [B, S, ...] (floating point).
    cuts:    positions t (0 <= t < S - 1); default `default_cuts(S)`. For each, positions t+1..S-1
             of the perturbed inputs are redrawn, `trials` times with different random values.
    vocab:   the token range for integer inputs (default: one more than the largest token given).
    atol:    a position counts as changed when its largest absolute change exceeds this. The default
             0.0 asks for bitwise-equal past outputs, which eager PyTorch gives (the same ops on the
             same shapes; a masked future entry contributes an exact zero). Raise it only for a
             model whose kernels are not bitwise repeatable.
    per_module: also compare every submodule's output (forward hooks) and name the leaking ones.
    Returns a CausalityReport (`.causal`, `.first_leak`, `.leaks`, `.verdict()`).
    """
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not perturb:
        raise ValueError("perturb names no input")
    for index in perturb:
        if not (0 <= index < len(inputs) and isinstance(inputs[index], torch.Tensor) and inputs[index].dim() >= 2):
            raise ValueError(f"input {index} is not a tensor with the sequence at dim 1 ([B, S, ...])")
    seq_len = inputs[perturb[0]].shape[1]
    if any(inputs[index].shape[1] != seq_len for index in perturb):
        raise ValueError("the perturbed inputs disagree on the sequence length (dim 1)")
    if seq_len < 2:
        raise ValueError(f"a sequence of {seq_len} token(s) has no future to perturb")
    cuts = default_cuts(seq_len) if cuts is None else tuple(sorted(set(cuts)))
    if not cuts or cuts[0] < 0 or cuts[-1] >= seq_len - 1:
        raise ValueError(f"cut points must lie in 0..{seq_len - 2} (seq-len {seq_len}), got {list(cuts)}")

    recorder = _ModuleRecorder(model, seq_len) if per_module else None
    try:
        baseline = _output(model, inputs, seed, recorder)
        if baseline.dim() < 2 or baseline.shape[1] != seq_len:
            raise ValueError(f"the output {list(baseline.shape)} has no sequence of length {seq_len} at dim 1")
        generator = torch.Generator().manual_seed(seed)
        leaks = []
        for cut in cuts:
            worst_change = torch.zeros(cut + 1, dtype=torch.float64)
            modules: dict[str, None] = {}
            for _ in range(trials):
                perturbed = list(inputs)
                for index in perturb:
                    perturbed[index] = _redraw_after(inputs[index], cut, generator, vocab)
                if recorder is not None:
                    recorder.compare_up_to(cut)
                out = _output(model, tuple(perturbed), seed, recorder)
                change = (out[:, : cut + 1] - baseline[:, : cut + 1]).abs().double().transpose(0, 1)
                worst_change = torch.maximum(worst_change, change.reshape(cut + 1, -1).amax(1).cpu())
                if recorder is not None:
                    modules.update(dict.fromkeys(recorder.leaking(atol)))
            changed = torch.nonzero(worst_change > atol).flatten().tolist()
            if changed:
                leaks.append(Leak(cut, tuple(changed), float(worst_change.max()), tuple(modules)))
    finally:
        if recorder is not None:
            recorder.remove()
    return CausalityReport(seq_len, cuts, trials, atol, tuple(leaks), per_module)


def _output(model: nn.Module, inputs: tuple, seed: int, recorder) -> torch.Tensor:
    """The model's output tensor (or its first floating-point tensor), with a fixed RNG seed."""
    if recorder is not None:
        recorder.start_call()
    devices = [x.device for x in inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"]
    with torch.no_grad(), torch.random.fork_rng(devices=list(dict.fromkeys(devices))):
        torch.manual_seed(seed)
        out = model(*inputs)
    if isinstance(out, torch.Tensor):
        return out
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise ValueError(f"the model returned no floating-point tensor ({type(out).__name__})")


def _redraw_after(x: torch.Tensor, cut: int, generator: torch.Generator, vocab: int | None) -> torch.Tensor:
    """x with positions cut+1.. along dim 1 redrawn: random tokens, or Gaussian values of x's spread."""
    tail_shape = (x.shape[0], x.shape[1] - cut - 1, *x.shape[2:])
    if x.is_floating_point():
        spread = float(x.float().std()) if x.numel() > 1 else 1.0
        tail = torch.randn(tail_shape, generator=generator) * (spread or 1.0)
    elif x.dtype == torch.bool:
        tail = torch.randint(0, 2, tail_shape, generator=generator).bool()
    else:
        high = vocab if vocab is not None else int(x.max()) + 1
        tail = torch.randint(0, max(high, 2), tail_shape, generator=generator)
    out = x.clone()
    out[:, cut + 1 :] = tail.to(device=x.device, dtype=x.dtype)
    return out


class _ModuleRecorder:
    """Forward hooks on every submodule: keep the first (baseline) run's outputs, then measure how
    far later runs moved them at positions <= cut. Only outputs with the sequence at dim 1 count."""

    def __init__(self, model: nn.Module, seq_len: int):
        self.seq_len = seq_len
        self.baseline: dict[str, torch.Tensor] = {}
        self.change: dict[str, float] = {}
        self.cut: int | None = None
        self.calls: dict[str, int] = {}
        self.handles = [module.register_forward_hook(self._hook(name))
                        for name, module in model.named_modules() if name]

    def start_call(self) -> None:
        self.calls = {}
        self.change = {}

    def compare_up_to(self, cut: int) -> None:
        self.cut = cut

    def leaking(self, atol: float) -> list[str]:
        return [key for key, change in self.change.items() if change > atol]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, name: str):
        def hook(module, args, output):
            out = output if isinstance(output, torch.Tensor) else next(
                (x for x in torch.utils._pytree.tree_leaves(output) if isinstance(x, torch.Tensor)), None)
            if out is None or out.dim() < 2 or out.shape[1] != self.seq_len or not out.is_floating_point():
                return
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            key = name if call == 0 else f"{name}#{call}"
            if self.cut is None:
                self.baseline[key] = out.detach().clone()
            elif key in self.baseline and self.baseline[key].shape == out.shape:
                past = slice(0, self.cut + 1)
                self.change[key] = float((out[:, past] - self.baseline[key][:, past]).abs().max())

        return hook
