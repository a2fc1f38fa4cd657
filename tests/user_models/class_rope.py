"""A user's model whose rotary embedding caches its cos/sin tables on the class, in the dtype of the
first call (some codebases share tables between layers this way). Copies of the model share the
class, so a run in one dtype leaves tables that the next run, in another, reads: float64 tables
turn a float32 model's activations into float64, and its next linear layer raises. For
`nsa-compile parity`, which runs its float64 oracle last (nsa_compile/parity.py)."""

import torch
import torch.nn as nn


class ClassCachedRope(nn.Module):
    """Rotate-half RoPE over x [B, S, H, D]; the tables [S, D / 2] are made once per (S, device)."""

    tables: dict = {}  # (S, device) -> (cos, sin): on the class, shared by every instance and copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S, D = x.shape[1], x.shape[-1]
        key = (S, x.device)
        if key not in ClassCachedRope.tables:
            inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=x.device, dtype=x.dtype) / D)
            angles = torch.outer(torch.arange(S, device=x.device, dtype=x.dtype), inv_freq)  # [S, D / 2]
            ClassCachedRope.tables[key] = (angles.cos()[:, None], angles.sin()[:, None])  # [S, 1, D / 2]
        cos, sin = ClassCachedRope.tables[key]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RopeAttention(nn.Module):
    """Causal multi-head attention with RoPE on q and k: x [B, S, dim] -> [B, S, dim]."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.rope = ClassCachedRope()

    def forward(self, x):
        B, S, _ = x.shape
        q = self.rope(self.q(x).view(B, S, self.heads, self.hd)).transpose(1, 2)  # [B, H, S, hd]
        k = self.rope(self.k(x).view(B, S, self.heads, self.hd)).transpose(1, 2)
        v = self.v(x).view(B, S, self.heads, self.hd).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, hd]
        return self.o(o.transpose(1, 2).reshape(B, S, -1))


def make():
    torch.manual_seed(0)
    return RopeAttention(), torch.randn(2, 10, 32)
