"""A user's model file for the CLI tests: `nsa-compile explain --model tests/user_models/gqa_block.py:make`."""

import torch
import torch.nn as nn


class GQABlock(nn.Module):
    """Causal GQA attention with repeat_interleave, as users write it."""

    def __init__(self, dim=32, heads=4, groups=2):
        super().__init__()
        self.heads, self.groups, self.hd = heads, groups, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * groups * self.hd)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.groups, self.hd).permute(2, 0, 3, 1, 4)
        k = k.repeat_interleave(self.heads // self.groups, dim=1)
        v = v.repeat_interleave(self.heads // self.groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.hd**-0.5
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(B, S, -1))


class BreakingBlock(GQABlock):
    """The same, with a data-dependent branch between the scores and the softmax: a graph break."""

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: Dynamo breaks the graph here
            x = x * 2
        return super().forward(x)


def make():
    torch.manual_seed(0)
    return GQABlock(), torch.randn(2, 10, 32)


def make_breaking():
    torch.manual_seed(0)
    return BreakingBlock(), torch.randn(2, 10, 32)


def module_only():
    return GQABlock()


def not_a_module():
    return "a string", torch.randn(1)


def raises():
    raise RuntimeError("weights not found")
