"""What the CLI runs: a model, its inputs and its loss, from a built-in preset or a user's file.

A model spec is a preset name ('tiny', 'seed', 'paper', '<preset>-dense'), or a user's factory
as 'path/to/file.py:factory' or 'package.module:factory'. The factory takes no arguments and
returns the module, or (module, example_inputs) with example_inputs a tensor or a tuple of the
module's positional inputs. Presets are language models: their inputs are random tokens and their
loss is next-token cross-entropy; a user's model without example inputs is refused. A preset can
take packed documents (`documents`: their lengths, one packing for every row): its inputs are
then (tokens, pos), pos each token's position in its document (models/nsa.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "ModelSpecError", "load_workload", "load_module"]


class ModelSpecError(ValueError):
    """The model spec cannot be turned into a module and inputs (one line, for the CLI)."""


@dataclass
class Workload:
    spec: str
    model: nn.Module
    inputs: tuple  # positional inputs of model (for presets: tokens [B, S + 1], targets included[, pos [B, S]])
    is_lm: bool  # inputs are tokens whose next-token cross-entropy is the loss
    dense_twin: str | None = None  # the preset of the dense twin, for presets

    @property
    def tokens_per_step(self) -> int:
        first = self.inputs[0]
        return first.shape[0] * (first.shape[1] - 1) if self.is_lm else first.shape[0]

    def to(self, device: torch.device) -> "Workload":
        self.model = self.model.to(device)
        self.inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in self.inputs)
        return self


def loss_of(model: nn.Module, inputs: tuple, is_lm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, scalar loss) of one forward: next-token CE for LMs (inputs (tokens[, pos])), mean
    square otherwise."""
    if is_lm:
        tokens, *pos = inputs
        logits = model(tokens[:, :-1], *pos)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    out = model(*inputs)
    first = out if isinstance(out, torch.Tensor) else next(
        x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()
    )
    return first, first.float().square().mean()


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """Floating-point inputs follow the model's dtype; integer inputs (tokens) stay."""
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def random_tokens(batch: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=g)


def load_workload(spec: str, batch: int = 1, seq_len: int = 128, seed: int = 0,
                  documents: list[int] | None = None) -> Workload:
    """The model and inputs a spec names (on the CPU; move with .to(device)). `documents`: packed
    document lengths summing to seq_len, for an NSA preset (see the module docstring)."""
    if ":" not in spec:
        from nsa_compile.models import build_model, positions_from_cu_seqlens, preset

        try:
            cfg = preset(spec)
        except ValueError as err:
            raise ModelSpecError(f"{err} (or a user model as path/to/file.py:factory or package.module:factory)") from None
        torch.manual_seed(seed)
        twin = None if cfg.attention == "dense" else f"{spec}-dense"
        inputs = (random_tokens(batch, seq_len, cfg.vocab_size, seed),)
        if documents is not None:
            if cfg.attention != "nsa":
                raise ModelSpecError(f"{spec}: packed documents need an NSA model (the dense twin takes no positions)")
            if not documents or min(documents) < 1 or sum(documents) != seq_len:
                raise ModelSpecError(f"document lengths {documents} must be positive and sum to the sequence "
                                     f"length {seq_len}")
            cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()])
            inputs += (positions_from_cu_seqlens(cu, seq_len).expand(batch, seq_len).contiguous(),)
        return Workload(spec, build_model(cfg), inputs, True, twin)
    if documents is not None:
        raise ModelSpecError(f"{spec}: packed documents apply to the presets (a user model takes its own inputs)")
    module, inputs = _user_model(spec)
    if inputs is None:
        raise ModelSpecError(f"{spec}: the factory returned no example inputs; return (module, inputs)")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return Workload(spec, module, inputs, False)


def load_module(spec: str, seed: int = 0) -> nn.Module:
    """Only the module a spec names (a preset, or a user's factory, example inputs ignored)."""
    if ":" not in spec:
        from nsa_compile.models import build_model

        torch.manual_seed(seed)
        try:
            return build_model(spec)
        except ValueError as err:
            raise ModelSpecError(str(err)) from None
    return _user_model(spec)[0]


def _user_model(spec: str) -> tuple[nn.Module, object]:
    factory = _load_factory(spec)
    try:
        made = factory()
    except Exception as err:  # the user's code: report, do not crash
        raise ModelSpecError(f"{spec}: the factory raised {type(err).__name__}: {err}") from err
    module, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"{spec}: the factory returned {type(module).__name__}, not an nn.Module")
    return module, inputs


def _load_factory(spec: str):
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ModelSpecError(f"{spec}: no such file {where}")
        module_name = f"nsa_user_model_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        try:
            loader.loader.exec_module(module)
        except Exception as err:
            raise ModelSpecError(f"{spec}: importing {where} raised {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ModelSpecError(f"{spec}: cannot import {where}: {err}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelSpecError(f"{spec}: {where} has no callable named {name!r}")
    return factory
