"""User model factories for the CLI's hostile-input tests (tests/test_cli.py, tests/test_train.py):
each is one way a user's model or its example inputs can be wrong, and one byte-level LM that is right."""

import sys

import torch
import torch.nn as nn


class Projection(nn.Module):
    """x [B, S, dim] -> [B, S, dim]."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, S, _ = x.shape  # a user's unpacking: tokens [B, S] do not fit
        return self.proj(x).view(B, S, -1)


class ByteLM(nn.Module):
    """tokens [B, S] -> logits [B, S, vocab]: the smallest language model `train` accepts (vocab 256)."""

    def __init__(self, vocab: int = 256, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


class Refuses(nn.Module):
    """A forward whose own check fails."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[-1] != 8:
            raise ValueError(f"expected 8 features, got {x.shape[-1]}")
        return self.proj(x)


class ArgMax(nn.Module):
    """Returns integer ids only: nothing to take a loss of."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).argmax(-1)


def inputs_a_string():
    return Projection(), "abc"


def inputs_a_dict():
    return Projection(), {"x": torch.randn(2, 10, 32)}


def wrong_shape():
    return Projection(), torch.randn(2, 10, 16)


def wrong_dtype():
    return Projection(), torch.ones(2, 10, 32, dtype=torch.int64)


def raises_in_forward():
    return Refuses(), torch.randn(2, 4)


def integer_output():
    return ArgMax(), torch.randn(2, 4)


def on_meta():
    with torch.device("meta"):
        return Projection(), torch.randn(2, 10, 32)


def exits():
    sys.exit(1)  # a script's habit; 1 is the CLI's "verdict failed" status


def projection():
    torch.manual_seed(0)
    return Projection(), torch.randn(2, 10, 32)


def byte_lm():
    torch.manual_seed(0)
    return ByteLM()


def small_vocab_lm():
    return ByteLM(vocab=100)


class NaNLM(ByteLM):
    """A language model whose logits are NaN: its training diverges at the first step."""

    def forward(self, tokens):
        return super().forward(tokens) * float("nan")


def nan_lm():
    return NaNLM()
