"""Byte-level language-model training: corpus, batches, loop, checkpoints (`nsa-compile train`).

The default corpus is the Python standard library's own source files (present on every
machine with Python), sorted by path and split deterministically: every 20th file is validation.
Batch i is drawn from a generator seeded by (seed, i), so the data position is the step number
and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import contextlib
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .workload import loss_of

__all__ = ["Corpus", "load_corpus", "TrainConfig", "train", "save_checkpoint", "load_checkpoint"]

MAX_CORPUS_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Corpus:
    name: str
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor

    def batch(self, split: str, index: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
        """Tokens [batch, seq_len + 1] (int64) at offsets drawn from generator (seed, index)."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {split} split of {self.name} has {len(data)} bytes, fewer than seq-len + 2")
        g = torch.Generator().manual_seed(seed * 1_000_003 + index * 2 + (split == "val"))
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def load_corpus(path: str | None = None) -> Corpus:
    """The stdlib's .py files (path None) or the files of a text file/folder, split 19:1 by file."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        name = f"python stdlib ({root})"
    else:
        root = Path(path)
        if not root.exists():
            raise ValueError(f"--data {path}: no such file or folder")
        files, name = _files(root), str(root)
    if not files:
        raise ValueError(f"no files found in {name}")
    train, val, total = [], [], 0
    for i, f in enumerate(files):
        data = f.read_bytes()
        total += len(data)
        if total > MAX_CORPUS_BYTES:
            break
        (val if len(files) > 1 and i % 20 == 19 else train).append(data)
    if not val:  # a single file: its last 5% validates
        whole = b"".join(train)
        cut = int(len(whole) * 0.95)
        train, val = [whole[:cut]], [whole[cut:]]
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    return Corpus(name, as_tensor(train), as_tensor(val))


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 100
    checkpoint: str | None = None  # a file path; None: no checkpoints
    autocast: bool = True  # bf16 autocast on CUDA (False: fp32 there too); the CPU always runs fp32


def autocast_for(cfg: TrainConfig, device: torch.device):
    """The context factory the steps (and evaluate) run under: bf16 autocast on CUDA unless
    cfg.autocast is off; nothing on the CPU."""
    if device.type == "cuda" and cfg.autocast:
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def save_checkpoint(path: str, model: nn.Module, opt, step: int, losses: list[float]) -> None:
    """Write atomically: a kill during the write leaves the previous checkpoint whole."""
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "losses": losses}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, model: nn.Module, opt) -> tuple[int, list[float]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
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
    if resume and cfg.checkpoint and Path(cfg.checkpoint).exists():
        start_step, losses = load_checkpoint(cfg.checkpoint, model, opt)
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
        if cfg.checkpoint and cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
            save_checkpoint(cfg.checkpoint, model, opt, step, losses)
            on_event(f"step {step}: checkpoint saved to {cfg.checkpoint}")
    return losses
