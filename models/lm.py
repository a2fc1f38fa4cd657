"""TinyLM: the seed project's byte-level language model around NSA (or dense) attention."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig, preset
from .nsa import DenseAttention, NSAAttention, check_positions, reject_input, rope_tables

__all__ = ["TinyLM", "build_model"]


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int):
        super().__init__()
        self.up = nn.Linear(dim, ratio * dim, bias=False)
        self.down = nn.Linear(ratio * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    """RMSNorm -> attention -> residual -> RMSNorm -> MLP(SiLU) -> residual."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.attn = NSAAttention(cfg) if cfg.attention == "nsa" else DenseAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.mlp = MLP(cfg.dim, cfg.mlp_ratio)

    def forward(self, x, cos, sin, pos=None):
        if pos is None:
            x = x + self.attn(self.attn_norm(x), cos, sin)
        else:
            x = x + self.attn(self.attn_norm(x), cos, sin, pos)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """tokens [B, S] int64 -> logits [B, S, vocab]. With pos [B, S] (packed documents, each
    token's position in its document; see models/nsa.py) RoPE and every NSA branch work per
    document. The dense twin takes no pos."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            reject_input(f"tokens must be int64 or int32 [B, S], got {tokens.dtype} {list(tokens.shape)}")
        S = tokens.shape[1]
        cos, sin = rope_tables(S, self.cfg.rot_dim, self.cfg.rope_base, tokens.device)
        if pos is not None:
            if self.cfg.attention != "nsa":
                reject_input("packed documents (pos) are supported by the NSA model only, not the dense twin")
            check_positions(pos, S)  # under torch.compile too: no sync, see check_positions
            if pos.shape[0] not in (1, tokens.shape[0]):  # one row of positions serves every row
                reject_input(f"pos has {pos.shape[0]} rows for {tokens.shape[0]} rows of tokens (or 1 for all)")
            cos, sin = cos[pos], sin[pos]  # [B, S, r/2]: RoPE at each token's document position
        x = self.embed(tokens)  # [B, S, dim]
        for block in self.blocks:  # pos only when packed: a user's wrapper of a block may take 3 inputs
            x = block(x, cos, sin) if pos is None else block(x, cos, sin, pos)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token cross-entropy over tokens [B, S + 1] (pos [B, S] for packed documents;
        the last token of a document then predicts the next document's first: mask it out in
        the data if that matters)."""
        logits = self(tokens[:, :-1], pos)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def build_model(name_or_config: str | ModelConfig = "tiny", **changes) -> TinyLM:
    """A TinyLM from a preset name ('tiny', 'seed', 'paper', '<preset>-dense') or a config."""
    cfg = preset(name_or_config, **changes) if isinstance(name_or_config, str) else name_or_config
    return TinyLM(cfg)
