"""Small unknown and near-miss models for tests/test_reliability.py.

Each `Case` is a module, its example inputs, and what gqa_grouped_matmul must do with it: the
exact number of rewrites and refusals, and the refusal reasons that must show in report().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def qkv(B=2, G=2, h=3, S=5, Dk=8, Dv=8):
    """q [B, G*h, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv]."""
    return randn(B, G * h, S, Dk, seed=1), randn(B, G, S, Dk, seed=2), randn(B, G, S, Dv, seed=3)


def attend(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v


# --- no NSA at all -----------------------------------------------------------------------------


class DenseGPTBlock(nn.Module):
    """Pre-norm GPT block, causal attention through SDPA (GQA through enable_gqa)."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, S, D = x.shape
        y = self.norm1(x)
        q = self.q(y).view(B, S, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(y).view(B, S, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(o.transpose(1, 2).reshape(B, S, D))
        return x + self.mlp(self.norm2(x))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )

    def forward(self, x):
        return self.net(x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Dropout(0.0), nn.Linear(64, 16), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class DataDependentBranch(nn.Module):
    """`if y.sum() > 0` on a tensor: Dynamo breaks the graph there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return torch.relu(y) * 2
        return -y


class UpsampleNearest(nn.Module):
    """repeat_interleave as 2x nearest-neighbour upsampling, then a conv: not attention."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x.repeat_interleave(2, dim=-1).repeat_interleave(2, dim=-2))


class EinsumGroupedGQA(nn.Module):
    """GQA written with a grouped view and einsum: no K/V copy to remove."""

    def forward(self, q, k, v):
        B, H, S, D = q.shape
        G = k.shape[1]
        qg = q.view(B, G, H // G, S, D)
        p = torch.einsum("bghsd,bgtd->bghst", qg, k).softmax(-1)
        return torch.einsum("bghst,bgte->bghse", p, v).reshape(B, H, S, -1)


class EinsumRepeatGQA(nn.Module):
    """repeat_interleave of K/V, then einsum (not a matmul the pass knows): refused."""

    def forward(self, q, k, v):
        h = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
        p = torch.einsum("bhsd,bhtd->bhst", q, k).softmax(-1)
        return torch.einsum("bhst,bhtd->bhsd", p, v)


# --- GQA that must be rewritten ------------------------------------------------------------------


class FunctionFormGQA(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, q, k, v):
        k = torch.repeat_interleave(k, self.h, dim=1)
        v = torch.repeat_interleave(v, repeats=self.h, dim=1)
        return attend(q, k, v)


class MethodFormGQA(FunctionFormGQA):
    def forward(self, q, k, v):
        k = k.repeat_interleave(repeats=self.h, dim=-3)
        v = v.repeat_interleave(self.h, -3)
        return attend(q, k, v)


class TransposeFormGQA(nn.Module):
    """K^T written as .transpose(2, 3), torch.transpose(k, -1, -2) or .swapaxes(3, 2)."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v):
        k, v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
        if self.form == "transpose(2, 3)":
            kt = k.transpose(2, 3)
        elif self.form == "torch.transpose(-1, -2)":
            kt = torch.transpose(k, -1, -2)
        else:
            kt = k.swapaxes(3, 2)
        return torch.matmul(torch.softmax(torch.matmul(q, kt), dim=-1), v)


class CausalGQA(nn.Module):
    """Scaled, causally masked GQA with its own projections (D_k != D_v)."""

    def __init__(self, dim=24, heads=6, groups=2, dk=8, dv=4):
        super().__init__()
        self.H, self.G, self.dk, self.dv = heads, groups, dk, dv
        self.wq, self.wk = nn.Linear(dim, heads * dk), nn.Linear(dim, groups * dk)
        self.wv, self.wo = nn.Linear(dim, groups * dv), nn.Linear(heads * dv, dim)

    def forward(self, x):
        B, S, _ = x.shape
        h = self.H // self.G
        q = self.wq(x).view(B, S, self.H, self.dk).transpose(1, 2)
        k = self.wk(x).view(B, S, self.G, self.dk).transpose(1, 2).repeat_interleave(h, dim=1)
        v = self.wv(x).view(B, S, self.G, self.dv).transpose(1, 2).repeat_interleave(h, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.dk**0.5
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.wo((p @ v).transpose(1, 2).reshape(B, S, self.H * self.dv))


class BmmFoldedHeads(nn.Module):
    """3-D attention through bmm, heads folded into the batch: K/V [B*G, S, D] repeated on dim 0."""

    def __init__(self, h=3):
        super().__init__()
        self.h = h

    def forward(self, q, k, v):
        B, H, S, Dk = q.shape
        G, Dv = k.shape[1], v.shape[-1]
        k3 = k.reshape(B * G, S, Dk).repeat_interleave(self.h, dim=0)
        v3 = v.reshape(B * G, S, Dv).repeat_interleave(self.h, dim=0)
        p = torch.softmax(torch.bmm(q.reshape(B * H, S, Dk), k3.transpose(1, 2)), dim=-1)
        return torch.bmm(p, v3).view(B, H, S, Dv)


class MaskedGQA(nn.Module):
    """K and V are rewritten; the bool mask's repeat is refused (not K/V)."""

    def forward(self, q, k, v, mask):
        h = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(h, dim=1).transpose(-1, -2)
        scores = scores.masked_fill(mask.repeat_interleave(h, dim=1), -1e4)
        return torch.softmax(scores, -1) @ v.repeat_interleave(h, dim=1)


class CheckpointedGQA(nn.Module):
    """GQA inside torch.utils.checkpoint: Dynamo puts it in a higher-order op's subgraph."""

    def __init__(self):
        super().__init__()
        self.inner = FunctionFormGQA(3)

    def forward(self, q, k, v):
        return checkpoint(self.inner, q, k, v, use_reentrant=False)


class GQAAfterGraphBreak(nn.Module):
    """A data-dependent branch, then GQA: the rewrite happens in the graph after the break."""

    def forward(self, q, k, v):
        if q.sum() > 0:
            q = q * 2
        return attend(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))


# --- near misses: refused, graph unchanged -----------------------------------------------------


class NoDim(nn.Module):
    def forward(self, q, k):  # q [B, 2G, S, D]: the flattened copy viewed back
        return q @ k.repeat_interleave(2).view_as(q).transpose(-1, -2)


class OutputSizeGiven(nn.Module):
    def forward(self, q, k, v):
        G = k.shape[1]
        k = k.repeat_interleave(3, dim=1, output_size=3 * G)
        return attend(q, k, v.repeat_interleave(3, dim=1, output_size=3 * G))


class BroadcastBatch(nn.Module):
    def forward(self, q, k):  # K of batch 1 against q of batch B
        return q @ k[:1].repeat_interleave(3, dim=1).transpose(-1, -2)


class RankMismatch(nn.Module):
    def forward(self, q, k):  # 3-D q against 4-D repeated K (broadcasts)
        return q[0] @ k.repeat_interleave(3, dim=1).transpose(-1, -2)


class RepeatedOnLeft(nn.Module):
    def forward(self, q, k):
        return k.repeat_interleave(3, dim=1) @ q.transpose(-1, -2)


class RepeatedBothSides(nn.Module):
    def forward(self, q, k):
        kr = k.repeat_interleave(3, dim=1)
        return kr @ kr.transpose(-1, -2)


class TransposeNotLastTwo(nn.Module):
    def forward(self, q, k):  # [B, S, H, D] layout: the copy is transposed over (1, 2) first
        kr = k.repeat_interleave(3, dim=1)
        return q @ kr.transpose(1, 2).transpose(1, 2).transpose(-1, -2)


class RepeatOverHeadDimOfMatrix(nn.Module):
    def forward(self, q, k):  # repeat over D (a matrix dim), q has 2D features
        return q @ k.repeat_interleave(2, dim=-1).transpose(-1, -2)


class BoolMaskOnly(nn.Module):
    def forward(self, scores, mask):
        return scores.masked_fill(mask.repeat_interleave(3, dim=1), 0.0)


class EmptyGroups(nn.Module):
    """repeats 0: an empty copy (the rewrite's unflatten could not infer its sizes)."""

    def forward(self, q, k):
        return q @ k.repeat_interleave(0, dim=1).transpose(-1, -2)


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    matches: int
    refused: int = 0
    reasons: tuple[str, ...] = ()  # each must be a substring of some reported reason
    graphs: int = 1  # graphs compiled over all `inputs` calls
    calls: int = 1  # inputs() is called with call index 0..calls-1


def _branch_inputs(i):
    return (randn(3, 8, seed=4) * (1 if i == 0 else -100),)


NO_NSA = [
    Case("dense-gpt-sdpa", DenseGPTBlock, lambda i: (randn(2, 7, 32),), 0),
    Case("cnn", SmallCNN, lambda i: (randn(2, 3, 12, 12),), 0),
    Case("mlp", MLP, lambda i: (randn(4, 16),), 0),
    # one graph before the break, one per branch after it
    Case("data-dependent-branch", DataDependentBranch, _branch_inputs, 0, graphs=3, calls=2),
    Case("upsample-repeat-interleave", UpsampleNearest, lambda i: (randn(2, 3, 5, 5),), 0, refused=2,
         reasons=("also used by repeat_interleave: the copy must stay", "also used by conv2d: the copy must stay")),
    Case("einsum-grouped-gqa", EinsumGroupedGQA, lambda i: qkv(Dv=4), 0),
    Case("einsum-repeat-gqa", EinsumRepeatGQA, lambda i: qkv(), 0, refused=2,
         reasons=("also used by einsum: the copy must stay",)),
]

REWRITTEN = [
    Case("function-form-h3", lambda: FunctionFormGQA(3), lambda i: qkv(h=3), 2),
    Case("method-form-kwargs-negative-dim", lambda: MethodFormGQA(3), lambda i: qkv(h=3), 2),
    Case("h1", lambda: FunctionFormGQA(1), lambda i: qkv(G=4, h=1), 2),
    Case("h6-mqa", lambda: FunctionFormGQA(6), lambda i: qkv(G=1, h=6), 2),
    Case("h3-g3", lambda: MethodFormGQA(3), lambda i: qkv(G=3, h=3, S=7), 2),
    Case("dk-ne-dv", lambda: FunctionFormGQA(3), lambda i: qkv(Dk=8, Dv=5), 2),
    Case("transpose(2, 3)", lambda: TransposeFormGQA("transpose(2, 3)"), lambda i: qkv(), 2),
    Case("torch.transpose(-1, -2)", lambda: TransposeFormGQA("torch.transpose(-1, -2)"), lambda i: qkv(), 2),
    Case("swapaxes(3, 2)", lambda: TransposeFormGQA("swapaxes(3, 2)"), lambda i: qkv(), 2),
    Case("causal-projections-dk-ne-dv", CausalGQA, lambda i: (randn(2, 9, 24),), 2),
    Case("bmm-heads-folded-into-batch", BmmFoldedHeads, lambda i: qkv(Dv=6), 2),
    Case("bool-mask-refused-kv-rewritten", MaskedGQA, lambda i: (*qkv(), randn(2, 2, 5, 5) > 0), 2, refused=1,
         reasons=("not a floating-point tensor",)),
    Case("activation-checkpoint-subgraph", CheckpointedGQA, lambda i: qkv(), 2, graphs=2),  # body + top
    # first call: graph before the break + the branch taken; both rewrites are after the break
    Case("gqa-after-graph-break", GQAAfterGraphBreak, lambda i: qkv(), 2, graphs=2),
]

NEAR_MISSES = [
    Case("no-dim", NoDim, lambda i: (randn(2, 4, 5, 8), randn(2, 2, 5, 8)), 0, 1,
         ("repeat_interleave without dim flattens its input",)),
    Case("output-size", OutputSizeGiven, lambda i: qkv(), 0, 2, ("output_size is given",)),
    Case("broadcast-batch", BroadcastBatch, lambda i: qkv()[:2], 0, 1, ("the matmul broadcasts over batch dims",)),
    Case("rank-mismatch", RankMismatch, lambda i: qkv()[:2], 0, 1, ("matmul operands of rank 3 and 4",)),
    Case("left-operand", RepeatedOnLeft, lambda i: qkv()[:2], 0, 1, ("the left operand of a matmul",)),
    Case("both-sides", RepeatedBothSides, lambda i: qkv()[:2], 0, 1, ("the left operand of a matmul",)),
    Case("transpose-not-last-two", TransposeNotLastTwo, lambda i: qkv()[:2], 0, 1,
         ("also used by transpose: the copy must stay",)),
    Case("repeat-over-matrix-dim", RepeatOverHeadDimOfMatrix, lambda i: (randn(2, 2, 5, 16), randn(2, 2, 5, 8)), 0, 1,
         ("over dim 3, a matrix dim of the matmul",)),
    Case("bool-mask-only", BoolMaskOnly, lambda i: (randn(2, 6, 5, 5), randn(2, 2, 5, 5) > 0), 0, 1,
         ("not a floating-point tensor",)),
    # these two crashed the compile before empty operands were refused; an empty graph input now
    # keeps every pass off the graph (backend.empty_input_reason): one refusal per pass
    Case("repeats-0", EmptyGroups, lambda i: (randn(2, 0, 5, 8), randn(2, 2, 5, 8)), 0, 1,
         ("the graph input l_q_ is empty [2, 0, 5, 8] (batch 0 or an empty sequence)",)),
    Case("empty-batch", lambda: FunctionFormGQA(3), lambda i: qkv(B=0), 0, 1,
         ("the graph input l_k_ is empty [0, 2, 5, 8] (batch 0 or an empty sequence)",)),
]


# --- models for the gradient and dynamic-shape tests ---------------------------------------------


class TwoHeads(nn.Module):
    """x [B, 8] -> (head_a(trunk(x)), head_b(trunk(x))), each [B, 8]. A loss of the first output
    alone leaves head_b's gradients None in eager, and the trunk's defined."""

    def __init__(self, dim=8):
        super().__init__()
        self.trunk = nn.Linear(dim, dim)
        self.head_a = nn.Linear(dim, dim)
        self.head_b = nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


class HeadAndIds(nn.Module):
    """x [B, 8] -> (head(x) [B, 8], ids(x).argmax(-1) [B]): the ids output has no gradient at all,
    so `ids` is None in both eager and compiled training (no run-time wrapping needed)."""

    def __init__(self, dim=8):
        super().__init__()
        self.head = nn.Linear(dim, dim)
        self.ids = nn.Linear(dim, dim)

    def forward(self, x):
        return self.head(x), self.ids(x).argmax(-1)


class WindowedGQA(nn.Module):
    """Causal sliding-window attention over q [B, 2G, S, D], k/v [B, G, S, D] whose width follows
    S: w = 4 at even S, 5 at odd S. A window at every static S (rewritten there), but not one w at
    symbolic sizes (refused there: the probe sizes disagree)."""

    def forward(self, q, k, v):
        S = q.shape[2]
        t, s = torch.arange(S)[:, None], torch.arange(S)[None, :]
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        keep = (s <= t) & (t - s < 4 + S % 2)
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
