"""What the CLI runs: a model, its inputs and its loss, from a built-in preset or a user's file.

A model spec is a preset name ('tiny', 'seed', 'paper', '<preset>-dense'), or a user's factory
as 'path/to/file.py:factory' or 'package.module:factory'. The factory takes no arguments and
returns the module, or (module, example_inputs) with example_inputs a tensor or a tuple of the
module's positional inputs. Presets are language models: their inputs are random tokens and their
loss is next-token cross-entropy; a user's model without example inputs is refused. A preset can
take packed documents (`documents`: their lengths, one packing for every row): its inputs are
then (tokens, pos), pos each token's position in its document (models/nsa.py).

A user's model is run once eagerly (check_runs, check_language_model) before anything is
compiled, so that a mistake in it or in its inputs is reported with the user's file and line
(user_error) rather than from deep inside Dynamo.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "ModelSpecError", "load_workload", "checked_workload", "load_module", "check_runs",
           "check_language_model", "user_error", "user_frame"]


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
        """Tokens a step trains on: batch * S for presets (the targets' column excluded); for a
        user's model, batch * S where its first input is a sequence (x [B, S, dim], or token ids
        [B, S] of an integer dtype), else its first dim (rows)."""
        first = self.inputs[0]
        if self.is_lm:
            return first.shape[0] * (first.shape[1] - 1)
        sequence = first.dim() >= 3 or (first.dim() == 2 and not first.is_floating_point())
        return first.shape[0] * first.shape[1] if sequence else first.shape[0]

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
            raise ModelSpecError(f"{err} (or a user model as path/to/file.py:factory or "
                                 f"package.module:factory)") from None
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
    return Workload(spec, module, inputs, False)


def checked_workload(spec: str, batch: int, seq_len: int, device: torch.device, seed: int = 0,
                     documents: str | list[int] | None = None) -> Workload:
    """load_workload on `device`, with what the command line gives checked: batch and seq_len
    positive, `documents` as lengths or their comma-separated text ('100,28'), and a user's model
    run once eagerly (check_runs), so that its mistakes show the user's own line. ModelSpecError,
    one line, for each refusal."""
    if batch < 1 or seq_len < 1:
        raise ModelSpecError("--batch and --seq-len must be positive")
    if isinstance(documents, str):
        try:
            documents = [int(x) for x in documents.split(",")]
        except ValueError:
            raise ModelSpecError(f"--documents takes comma-separated lengths (e.g. 100,28), got {documents!r}") from None
    wl = load_workload(spec, batch=batch, seq_len=seq_len, seed=seed, documents=documents).to(device)
    if not wl.is_lm:
        check_runs(wl)
    return wl


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


def _user_model(spec: str) -> tuple[nn.Module, tuple | None]:
    """(module, example inputs as a tuple, or None where the factory returned the module alone)."""
    factory = _load_factory(spec)
    try:
        made = factory()
    except (Exception, SystemExit) as err:  # the user's code (sys.exit included): report, do not crash
        raise ModelSpecError(f"{spec}: the factory raised {user_error(err)}") from err
    module, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(module, nn.Module):
        raise ModelSpecError(f"{spec}: the factory returned {type(module).__name__}, not an nn.Module")
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        raise ModelSpecError(f"{spec}: the model's parameters are on the meta device (shapes without data); "
                             f"materialize them first (module.to_empty(device=...) and initialize)")
    if inputs is None or isinstance(inputs, torch.Tensor):
        return module, None if inputs is None else (inputs,)
    if isinstance(inputs, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in inputs):
        return module, tuple(inputs)
    raise ModelSpecError(f"{spec}: the factory's example inputs are {_describe(inputs)}; return a tensor or a "
                         f"tuple of the forward's positional inputs (at least one of them a tensor)")


def _load_factory(spec: str):
    where, _, name = spec.rpartition(":")
    if not where:
        raise ModelSpecError(f"{spec}: name a file or module before the ':' (path/to/file.py:factory)")
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
        except (Exception, SystemExit) as err:
            del sys.modules[module_name]
            raise ModelSpecError(f"{spec}: importing {where} raised {user_error(err)}") from err
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ModelSpecError(f"{spec}: cannot import {where}: {err}") from None
        except (Exception, SystemExit) as err:  # the user's module raised while importing
            raise ModelSpecError(f"{spec}: importing {where} raised {user_error(err)}") from err
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelSpecError(f"{spec}: {where} has no callable named {name!r}")
    return factory


# --- running a user's model once, and saying where its code failed --------------------------------


def check_runs(wl: Workload) -> None:
    """Run a user's model once, eagerly and without grad, on its example inputs (on a copy, so that
    buffers such as BatchNorm's running statistics stay as they were). ModelSpecError, with the
    user's file and line, if it raises or returns no floating-point tensor to take a loss of."""
    model = copy.deepcopy(wl.model)
    try:
        with torch.no_grad():
            out = model(*wl.inputs)
    except (Exception, SystemExit) as err:
        raise ModelSpecError(f"{wl.spec}: on the factory's example inputs {_describe(wl.inputs)} the model raised "
                             f"{user_error(err)}") from err
    leaves = torch.utils._pytree.tree_leaves(out)
    if not any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves):
        raise ModelSpecError(f"{wl.spec}: the model returned {_describe(out)}, with no floating-point tensor to "
                             f"take a loss of (the loss is the mean square of its first one)")


def check_language_model(module: nn.Module, spec: str, seq_len: int, device: torch.device,
                         vocab: int = 256) -> None:
    """Train's contract, checked with one eager forward without grad on a copy: tokens [1, seq_len]
    (int64) -> logits [1, seq_len, V] (floating point) with V >= vocab. ModelSpecError otherwise,
    with the user's file and line where the model raised."""
    contract = f"train needs a language model: tokens [B, S] (int64) -> logits [B, S, V], V >= {vocab}"
    tokens = torch.zeros(1, seq_len, dtype=torch.int64, device=device)
    try:
        with torch.no_grad():
            out = copy.deepcopy(module)(tokens)
    except (Exception, SystemExit) as err:
        raise ModelSpecError(f"{spec}: {contract}; on tokens [1, {seq_len}] the model raised "
                             f"{user_error(err)}") from err
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() == 3
            and tuple(out.shape[:2]) == (1, seq_len) and out.shape[2] >= vocab):
        raise ModelSpecError(f"{spec}: {contract}; on tokens [1, {seq_len}] it returned {_describe(out)}")


def user_error(err: BaseException) -> str:
    """'Type: first line of the message', and where the user's code raised it if it did:
    ' (at path/to/file.py:18 in forward: `B, S, _ = x.shape`)'."""
    message = str(err).strip().splitlines()
    text = type(err).__name__ + (f": {message[0]}" if message else "")
    where = user_frame(err)
    return f"{text} (at {where})" if where else text


def user_frame(err: BaseException) -> str | None:
    """'file:line in function: `source`' of the innermost frame of the user's code (any file outside
    PyTorch, nsa_compile, its models and passes, click and the Python installation) in err's
    traceback or in the errors it was raised from, where the user's code raised it; None where no
    frame is the user's, where nsa_compile's own code, called from the user's, raised it, or where
    the compiler failed (Dynamo's BackendCompilerFailed: the passes or Inductor, not the model)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if type(err).__name__ == "BackendCompilerFailed":
            return None
        if isinstance(err, SyntaxError) and err.filename and not _is_library(err.filename):
            return f"{_shown(err.filename)}:{err.lineno}"
        frames = traceback.extract_tb(err.__traceback__)
        users = [i for i, f in enumerate(frames) if not _is_library(f.filename)]
        if users:
            if any(_is_ours(f.filename) for f in frames[users[-1] + 1 :]):
                return None
            f = frames[users[-1]]
            return f"{_shown(f.filename)}:{f.lineno} in {f.name}" + (f": `{f.line.strip()}`" if f.line else "")
        err = err.__cause__ or err.__context__
    return None


def _roots(paths) -> tuple[str, ...]:
    return tuple(str(Path(path).resolve()) + os.sep for path in paths)


@functools.cache
def _our_roots() -> tuple[str, ...]:
    """nsa_compile, its models and its passes."""
    import nsa_compile.models
    import nsa_compile.passes

    return _roots([Path(__file__).parent, Path(nsa_compile.models.__file__).parent,
                   Path(nsa_compile.passes.__file__).parent])


@functools.cache
def _library_roots() -> tuple[str, ...]:
    import click

    paths = sysconfig.get_paths()
    return _our_roots() + _roots([Path(torch.__file__).parent, Path(click.__file__).parent] +
                                 [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths])


def _is_ours(filename: str) -> bool:
    return not filename.startswith("<") and os.path.realpath(filename).startswith(_our_roots())


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # generated code: <frozen ...>, <string>, Dynamo's <eval_with_key>
        return True
    return os.path.realpath(filename).startswith(_library_roots())


def _shown(filename: str) -> str:
    """The path relative to the working directory where it lies below it, else as it is."""
    try:
        return os.path.relpath(filename) if Path(filename).resolve().is_relative_to(Path.cwd()) else filename
    except ValueError:  # another drive (Windows)
        return filename


def _describe(value) -> str:
    """A short description of inputs or outputs for an error line: 'float32 [2, 10, 16]', ..."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(x) for x in value) + ")"
    return type(value).__name__
