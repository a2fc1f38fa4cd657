"""Byte-level language-model training: corpus, batches, loop, checkpoints (`nsa-compile train`).

The default corpus is the Python standard library's own source files (present on every
machine with Python), sorted by path and split deterministically: every 20th file is validation.
Batch i is drawn from a generator seeded by (seed, i), so the data position is the step number
and a resumed run sees exactly the batches it would have seen. A checkpoint records the run's
settings (model, lr, batch, seq-len, seed, data identity); a resume that contradicts them is
refused unless TrainConfig.allow_changed_settings (`--allow-changed-settings`) is set.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .workload import loss_of

__all__ = ["Corpus", "load_corpus", "TrainConfig", "TrainError", "train", "run_settings", "save_checkpoint",
           "read_checkpoint", "load_checkpoint"]

MIB = 2**20
MAX_CORPUS_BYTES = 64 * MIB


class TrainError(ValueError):
    """A problem with the data, the checkpoint or the settings of a run (one line, for the CLI)."""


@dataclass(frozen=True)
class Corpus:
    name: str
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    identity: dict | None = None  # resolved path, bytes read, sha256 of train's first MiB: what a resume checks

    def batch(self, split: str, index: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
        """Tokens [batch, seq_len + 1] (int64) at offsets drawn from generator (seed, index)."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise TrainError(f"the {split} split of {self.name} has {len(data)} bytes, fewer than seq-len + 2")
        g = torch.Generator().manual_seed(seed * 1_000_003 + index * 2 + (split == "val"))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def _read_head(path: Path, limit: int) -> bytes:
    """At most `limit` bytes from the start of the file; TrainError with one line if it cannot be read."""
    try:
        with path.open("rb") as f:
            return f.read(limit)
    except OSError as err:
        raise TrainError(f"--data: cannot read {path}: {err.strerror or err}") from None


def load_corpus(path: str | None = None) -> Corpus:
    """The stdlib's .py files (path None) or the files of a text file/folder, split 19:1 by file.

    At most MAX_CORPUS_BYTES are read: the files in order, the last one cut where the cap falls
    (a single file larger than the cap gives its first 64 MiB); the name then says so."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        name = f"python stdlib ({root})"
    else:
        root = Path(path)
        if not root.exists():
            raise TrainError(f"--data {path}: no such file or folder")
        files, name = _files(root), str(root)
    if not files:
        raise TrainError(f"no files found in {name}")
    train, val, total = [], [], 0
    for i, f in enumerate(files):
        data = _read_head(f, MAX_CORPUS_BYTES - total)
        total += len(data)
        (val if len(files) > 1 and i % 20 == 19 else train).append(data)
        if total >= MAX_CORPUS_BYTES:
            if i + 1 < len(files) or f.stat().st_size > len(data):
                name += f" (its first {MAX_CORPUS_BYTES // MIB} MiB)"
            break
    if total == 0:
        raise TrainError(f"--data {name}: no bytes to train on (the files are empty)")
    if not val:  # a single file: its last 5% validates
        whole = b"".join(train)
        cut = int(len(whole) * 0.95)
        train, val = [whole[:cut]], [whole[cut:]]
    train_bytes, val_bytes = b"".join(train), b"".join(val)
    identity = {"data": str(root.resolve()), "train_bytes": len(train_bytes), "val_bytes": len(val_bytes),
                "sha256_first_mib": hashlib.sha256(train_bytes[:MIB]).hexdigest()}
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return Corpus(name, as_tensor(train_bytes), as_tensor(val_bytes), identity)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 100  # and at the last step; 0: only at the last step
    checkpoint: str | None = None  # a file path; None: no checkpoints
    autocast: bool = True  # bf16 autocast on CUDA (False: fp32 there too); the CPU always runs fp32
    model: str = "model"  # the model's name (the CLI's --model), recorded in the checkpoint
    allow_changed_settings: bool = False  # resume even where run_settings differ from the checkpoint's


def autocast_for(cfg: TrainConfig, device: torch.device):
    """The context factory the steps (and evaluate) run under: bf16 autocast on CUDA unless
    cfg.autocast is off; nothing on the CPU."""
    if device.type == "cuda" and cfg.autocast:
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def run_settings(cfg: TrainConfig, corpus: Corpus) -> dict:
    """What a resumed run must share with the run that wrote its checkpoint: the model, the
    optimizer's learning rate, the batch shape, the seed of the batches and the data."""
    return {"model": cfg.model, "lr": cfg.lr, "batch": cfg.batch, "seq_len": cfg.seq_len, "seed": cfg.seed,
            "data": corpus.identity}


def changed_settings(saved: dict | None, now: dict) -> list[str]:
    """One 'name: checkpoint -> now' entry per setting that differs; saved None (a checkpoint
    written before settings were recorded) differs in everything."""
    if saved is None:
        return ["settings: not recorded in the checkpoint (written by an older nsa-compile)"]
    return [f"{key.replace('_', '-')}: {saved.get(key)!r} -> {value!r}" for key, value in now.items()
            if saved.get(key) != value]


def save_checkpoint(path: str, model: nn.Module, opt, step: int, losses: list[float],
                    settings: dict | None = None) -> None:
    """Write atomically: a kill during the write leaves the previous checkpoint whole."""
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "losses": losses,
                "settings": settings}, tmp)
    os.replace(tmp, path)


def read_checkpoint(path: str) -> dict:
    """A checkpoint's contents; TrainError with one line for a file that is not a whole checkpoint
    (empty, truncated by a full disk or a copy, or some other file)."""
    size = os.path.getsize(path)
    if size == 0:
        raise TrainError(f"checkpoint {path} is empty (0 bytes): not a checkpoint; remove it to start afresh")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types (EOFError, RuntimeError, UnpicklingError)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainError(f"checkpoint {path} ({size:,} bytes) cannot be read (truncated, or not a checkpoint): "
                         f"{first}") from None
    missing = {"model", "optimizer", "step", "losses"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise TrainError(f"{path} is not an nsa-compile checkpoint (no {', '.join(sorted(missing))})")
    return state


def load_checkpoint(path: str, model: nn.Module, opt) -> tuple[int, list[float]]:
    """Restore model and optimizer from a checkpoint; (step, losses). TrainError if they do not fit."""
    return _restore(read_checkpoint(path), path, model, opt)


def _restore(state: dict, path: str, model: nn.Module, opt) -> tuple[int, list[float]]:
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainError(f"checkpoint {path} does not fit this model: {first}") from None
    return state["step"], list(state["losses"])


@torch.no_grad()
def evaluate(model: nn.Module, corpus: Corpus, cfg: TrainConfig, device, autocast) -> float:
    losses = []
    for i in range(cfg.eval_batches):
        tokens = corpus.batch("val", i, cfg.batch, cfg.seq_len, cfg.seed).to(device)
        with autocast():
            losses.append(loss_of(model, (tokens,), True)[1].item())
    return sum(losses) / len(losses)


def train(model: nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device, resume: bool = False,
          on_step=None, on_event=None) -> list[float]:
    """Train; return the training loss of every step from 1 to cfg.steps (resumed ones included).

    on_step(step, loss, tokens_per_s) is called after each step; on_event(text) for evaluations
    and checkpoints.
    """
    on_step = on_step or (lambda *a: None)
    on_event = on_event or (lambda text: None)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused or None)
    autocast = autocast_for(cfg, device)
    start_step, losses = 0, []
    settings = run_settings(cfg, corpus)
    if resume and cfg.checkpoint and Path(cfg.checkpoint).exists():
        state = read_checkpoint(cfg.checkpoint)
        changed = changed_settings(state.get("settings"), settings)
        if changed and not cfg.allow_changed_settings:
            raise TrainError(f"--resume: this run's settings differ from those of {cfg.checkpoint} ("
                             f"{'; '.join(changed)}); pass --allow-changed-settings to resume with the new ones")
        start_step, losses = _restore(state, cfg.checkpoint, model, opt)
        if changed:  # the optimizer's state came back with the old learning rate
            for group in opt.param_groups:
                group["lr"] = cfg.lr
            on_event(f"resuming with changed settings: {'; '.join(changed)}")
        on_event(f"resumed from {cfg.checkpoint} at step {start_step}")
    tokens_per_step = cfg.batch * cfg.seq_len
    for step in range(start_step + 1, cfg.steps + 1):
        tokens = corpus.batch("train", step, cfg.batch, cfg.seq_len, cfg.seed).to(device)
        began = time.perf_counter()
        with autocast():
            _, loss = loss_of(model, (tokens,), True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # synchronizes
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {step}")
        losses.append(value)
        on_step(step, value, tokens_per_step / (time.perf_counter() - began))
        if cfg.eval_every and step % cfg.eval_every == 0:
            on_event(f"step {step}: validation loss {evaluate(model, corpus, cfg, device, autocast):.4f}")
        if cfg.checkpoint and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
            save_checkpoint(cfg.checkpoint, model, opt, step, losses, settings)
            on_event(f"step {step}: checkpoint saved to {cfg.checkpoint}")
    return losses
