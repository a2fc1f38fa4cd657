"""User models that kill the process running them, for the CLI's crash isolation (isolation.py).

`make_abort`'s forward calls os.abort() when Dynamo compiles it (torch.compiler.is_compiling()
is True while Dynamo traces, and the abort runs at the graph break Dynamo makes there), so its
eager check passes and the compiled run dies of SIGABRT, as compiled code with heap corruption
does. `make_segfault` reads address 0 the same way (SIGSEGV).
"""

import ctypes
import os

import torch
import torch.nn as nn


class AbortWhenCompiled(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # x [B, dim]
        if torch.compiler.is_compiling():
            os.abort()  # stands for a crash in compiled code
        return self.proj(x)


class SegfaultWhenCompiled(AbortWhenCompiled):
    def forward(self, x):
        if torch.compiler.is_compiling():
            ctypes.string_at(0)  # stands for a crash in compiled code
        return self.proj(x)


def make_abort():
    torch.manual_seed(0)
    return AbortWhenCompiled(), torch.randn(2, 8)


def make_segfault():
    torch.manual_seed(0)
    return SegfaultWhenCompiled(), torch.randn(2, 8)
