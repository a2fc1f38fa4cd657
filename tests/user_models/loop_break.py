"""A user's model whose forward Dynamo skips whole: a data-dependent branch inside a loop.

Dynamo cannot resume after a graph break inside a for loop, so it gives up on the whole
function and runs it eagerly: no graph, no rewrite, and no message unless one asks
(`nsa-compile explain` lists such frames with their source lines).
"""

import torch
import torch.nn as nn


class RowByRowAttention(nn.Module):
    """Causal attention computed one batch row at a time."""

    def __init__(self, dim=16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.scale = dim**-0.5

    def forward(self, x):  # x [B, S, dim]
        rows = []
        for row in x.unbind(0):  # [S, dim]
            if row.abs().sum() > 0:  # data-dependent branch inside the loop
                row = row * 1.0
            q, k, v = self.qkv(row).chunk(3, dim=-1)
            S = row.shape[0]
            future = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
            p = torch.softmax((q @ k.T * self.scale).masked_fill(future, float("-inf")), dim=-1)
            rows.append(p @ v)
        return torch.stack(rows)


def make():
    torch.manual_seed(0)
    return RowByRowAttention(), torch.randn(2, 6, 16)
