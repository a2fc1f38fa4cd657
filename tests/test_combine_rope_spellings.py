"""The gate + combine and the projections + RoPE as other people's NSA code spells them (issue 17;
tests/corpus/ holds whole models in these idioms). Each recognized spelling: the pass fires
(exact count), the spelling's ops are gone and the op is in the graph, the output and every
gradient match eager against a float64 oracle (nsa_compile.parity.check_parity) in fp32 and bf16;
each near miss is refused with the graph unchanged and its reason.

Combine: an einsum over the stacked branch outputs (lucidrains; also after canonicalize turned it
into a matmul), a gated stack summed, gates multiplied inside each branch and added with addcmul
(fla), heads-first slices [B, H, S, 3] (the paper written with [B, H, S, D]), 5-D grouped branches
[B, G, h, S, D], packed tokens [N, H, D], per-branch results flattened to [B, S, H * Dv].
RoPE: full-width cached cos/sin buffers on heads-first q/k (HF, the paper), a fused qkv Linear
split into branches with interleaved tables built inside forward after the projection (lucidrains'
rotary-embedding; K/V shared by the branches), complex RoPE by view_as_complex (Meta's llama),
tables computed in forward once per call (fla), a k/v Linear viewed [B, S, 2, G, D] and permuted,
partial rotary with a pass-through, packed tokens [N, H, D] with per-token tables; the projection
also read before its RoPE (lucidrains: the op returns it unrotated too, its readers read that);
the einsum combine under bf16 autocast.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, row

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.parity import FLOORS, check_parity, relative_error
from nsa_compile.passes.projection_rope import PASS as PROJECTION_PASS
from nsa_compile.rewrite import PassContext, PassLog

COMBINE, PROJECTIONS, CANON = "gated_combine", "projection_rope", "canonicalize"


def only(*passes) -> nsa_compile.OptimizeConfig:
    return nsa_compile.OptimizeConfig(compiler="aot_eager",
                                      disabled_passes=tuple(p for p in nsa_compile.pass_names() if p not in passes))


def parity_and_model(module, inputs, dtype, config):
    """The optimized model, after checking its output and every gradient: in fp32 against eager
    (the same roundings but for the order of a few sums: tight tolerances; check_parity's
    geometric mean over the 4 tensors of such a small module turns one lucky exact eager loss
    into a failure), in bf16 against the float64 oracle with check_parity (the ops round once
    where eager rounds every step)."""
    if dtype == torch.float32:
        optimized = optimize_fresh(copy.deepcopy(module), config)
        (want, want_grads), (got, got_grads) = (with_grads(m, inputs) for m in (module, optimized))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert want_grads.keys() == got_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
        return optimized
    holder = {}

    def optimize(m):
        holder["model"] = optimize_fresh(m, config)
        return holder["model"]

    report = check_parity(module, optimize, inputs, dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    # the output, the loss and the gradient of every parameter the spelling uses
    params = {f"grad {n}" for n in with_grads(module, inputs)[1] if not n.startswith("input ")}
    assert {r.name for r in report.rows} == {"output", "loss"} | params
    return holder["model"]


def with_grads(module, inputs) -> tuple[torch.Tensor, dict]:
    """The first output and {name: gradient} of the inputs ('input 0', ...) and of every parameter
    that gets one, for the loss sum(out * w) with fixed weights w."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = module(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape)
    named = {f"input {i}": t for i, t in enumerate(leaves)} | dict(module.named_parameters())
    grads = torch.autograd.grad((out * weights).sum(), list(named.values()), allow_unused=True)
    return out.detach(), {name: g for name, g in zip(named, grads) if g is not None}


def refused_unchanged(module, inputs, config, name, reason):
    """The near miss: the same eager code (bitwise), the graph unchanged, no match, the reason."""
    optimized = optimize_fresh(copy.deepcopy(module), config)
    got, want = optimized(*inputs), module(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, name)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]


# --- the gate and the combine -----------------------------------------------------------------------

B, S, H, G, DV, DIM = 2, 6, 4, 2, 8, 12


class Combine(nn.Module):
    """A per-head sigmoid gate (a group softmax gate for `tiled-gate`) and the combine of three
    branch outputs given heads-first [B, H, S, Dv] (packed: [N, H, Dv]), spelled as `spelling`."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.gate = nn.Linear(DIM, 3 * H)
        self.group_gate = nn.Linear(DIM, 3 * G)

    def forward(self, x, o_cmp, o_sel, o_win):
        sp, os = self.spelling, (o_cmp, o_sel, o_win)
        if sp == "packed":  # x [N, dim], branches [N, H, Dv]
            g = torch.sigmoid(self.gate(x)).view(-1, H, 3)
            return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
        logits = self.gate(x)  # [B, S, 3H]
        if sp == "einsum-stack":  # lucidrains
            g = torch.sigmoid(logits).view(B, S, H, 3).permute(0, 2, 1, 3)  # [B, H, S, 3]
            return torch.einsum("bhns,sbhnd->bhnd", g, torch.stack(os))
        if sp == "stack-sum":
            g = torch.sigmoid(logits).view(B, S, H, 3).transpose(1, 2)
            return (g.unsqueeze(-2) * torch.stack(os, dim=-1)).sum(dim=-1)
        if sp == "per-branch-addcmul":  # fla: [B, S, H, Dv], the gates unbound and applied in each branch
            g_cmp, g_sel, g_win = logits.view(B, S, H, 3).sigmoid().unbind(-1)
            o = o_sel.transpose(1, 2) * g_sel.unsqueeze(-1)
            o = torch.addcmul(o, o_cmp.transpose(1, 2), g_cmp.unsqueeze(-1))
            return torch.addcmul(o, o_win.transpose(1, 2), g_win[..., None])
        if sp == "heads-first-slices":  # the paper, [B, H, S, D]
            g = torch.sigmoid(logits).view(B, S, H, 3).transpose(1, 2)
            return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
        if sp == "grouped-5d":  # [B, G, h, S, Dv] branches, the gate [B, S, G, h, 3]
            g = torch.sigmoid(logits).view(B, S, G, H // G, 3)
            stacked = torch.stack([o.view(B, G, H // G, S, DV) for o in os])
            return torch.einsum("bsghk,kbghsd->bghsd", g, stacked)
        if sp == "flattened-result":  # each weighted branch flattened to [B, S, H * Dv], then summed
            g = torch.sigmoid(logits).view(B, S, H, 3)
            parts = [(g[..., c, None] * o.transpose(1, 2)).reshape(B, S, H * DV) for c, o in enumerate(os)]
            return parts[0] + parts[1] + parts[2]
        # near misses
        if sp == "branch-major":  # gate entry c * H + h: branch c of head h
            g = torch.sigmoid(logits).view(B, S, 3, H).permute(0, 3, 1, 2)  # [B, H, S, 3]
            return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
        if sp == "tiled-gate":  # group gates tiled over the heads: head h takes group h % G
            g = torch.softmax(self.group_gate(x).view(B, S, G, 3), dim=-1).repeat(1, 1, H // G, 1).transpose(1, 2)
            return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
        if sp == "gate-squared":
            g = torch.sigmoid(logits).view(B, S, H, 3).permute(0, 2, 1, 3)
            return torch.einsum("bhns,sbhnd->bhnd", g * g, torch.stack(os))
        if sp == "branch-squared":  # one gate entry per branch element, but not a weighted sum
            g = torch.sigmoid(logits).view(B, S, H, 3).transpose(1, 2)
            return g[..., 0:1] * o_cmp * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
        if sp == "column-twice":
            g = torch.sigmoid(logits).view(B, S, H, 3).permute(0, 2, 1, 3)[..., [0, 0, 2]]
            return torch.einsum("bhns,sbhnd->bhnd", g, torch.stack(os))
        if sp == "normalized-after-gating":  # each gated branch normalized before the sum: another function
            g = torch.sigmoid(logits).view(B, S, H, 3).transpose(1, 2)
            return sum(nn.functional.rms_norm(g[..., c : c + 1] * o, (DV,)) for c, o in enumerate(os))
        if sp == "gate-logged":  # the gate is also returned (a regularizer reads it)
            g = torch.sigmoid(logits).view(B, S, H, 3).permute(0, 2, 1, 3)
            return torch.einsum("bhns,sbhnd->bhnd", g, torch.stack(os)), g.mean()
        raise ValueError(sp)


def combine_inputs(spelling):
    gen = torch.Generator().manual_seed(0)
    if spelling == "packed":
        return (torch.randn(B * S, DIM, generator=gen), *(torch.randn(B * S, H, DV, generator=gen) for _ in range(3)))
    return (torch.randn(B, S, DIM, generator=gen), *(torch.randn(B, H, S, DV, generator=gen) for _ in range(3)))


COMBINE_SPELLINGS = ["einsum-stack", "stack-sum", "per-branch-addcmul", "heads-first-slices", "grouped-5d", "packed",
                     "flattened-result"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", COMBINE_SPELLINGS)
def test_combine_spellings_fire_with_parity(spelling, dtype):
    model = parity_and_model(Combine(spelling), combine_inputs(spelling), dtype, only(COMBINE))
    r = row(model, COMBINE)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert r["kernels"][0].startswith("nsa.gated_combine[reference] (gate input -> Linear(12, 12) -> sigmoid, one "
                                      "triple per head; branch outputs read once"), r["kernels"]
    record = only_graph(model)
    before, after = record.code_before, record.code_after
    assert "sigmoid(" in before and "sigmoid(" not in after
    for spelled in ("einsum", "torch.stack(", "addcmul", "sum("):
        assert spelled not in after, spelled
    assert after.count("torch.ops.nsa.gated_combine(") == 1


def test_the_einsum_combine_after_canonicalize_is_a_matmul_and_fires():
    """canonicalize writes the einsum over the stack as permute + matmul: the same computation."""
    model = parity_and_model(Combine("einsum-stack"), combine_inputs("einsum-stack"), torch.float32,
                             only(CANON, COMBINE))
    assert row(model, CANON)["matches"] == 1
    assert (row(model, COMBINE)["matches"], row(model, COMBINE)["refused"]) == (1, 0)
    after = only_graph(model).code_after
    assert "matmul" not in after and "einsum" not in after and after.count("torch.ops.nsa.gated_combine(") == 1


@pytest.mark.parametrize(
    "spelling, reason",
    [
        ("branch-major", "the gate's columns are branch-major (entry c * K + k: branch c of triple k); the op reads "
                         "triples (entry 3 * k + c)"),
        ("tiled-gate", "are [0, 3, 0, 3] over the heads, not one column of consecutive triples shared by 2 heads each"),
        ("gate-squared", "branch l_o_cmp_ is not weighed by one gate entry per head and token"),
        ("branch-squared", "the region is not the weighted sum of the branch outputs by the gate columns (checked on "
                           "random values)"),
        ("column-twice", "the branches are weighed by gate columns [0, 0, 2], not 0, 1, 2 once each"),
        ("gate-logged", "values of the gated sum are also used elsewhere: g (permute) by mean"),
        ("normalized-after-gating", "values of the gated sum are also used elsewhere: mul (mul) by element (rms_norm)"),
    ],
)
def test_combine_near_misses_refused_with_the_graph_unchanged(spelling, reason):
    refused_unchanged(Combine(spelling), combine_inputs(spelling), only(COMBINE), COMBINE, reason)


class EinsumCombine(nn.Module):
    """lucidrains' combine at any shape: a sigmoid gate per head and branch, an einsum over the
    stacked branch outputs [B, H, S, Dv]."""

    def __init__(self, dim=DIM, heads=H):
        super().__init__()
        self.heads = heads
        self.to_gate = nn.Linear(dim, 3 * heads)

    def forward(self, x, o_cmp, o_sel, o_win):
        Bx, Sx, _ = x.shape
        g = torch.sigmoid(self.to_gate(x)).view(Bx, Sx, self.heads, 3).permute(0, 2, 1, 3)
        return torch.einsum("bhns,sbhnd->bhnd", g, torch.stack([o_cmp, o_sel, o_win]))


def test_the_einsum_combine_under_bf16_autocast_fires():
    """Dynamo compiles inside the caller's autocast, so the passes ran their probes under it: the
    combine's float32 matmul of the gate's index codes (B * S * 3H = 1536 of them) computed in
    bf16, which rounds integers above 256, and the lucidrains combine was refused ('branch ... is
    not weighed by one gate entry per head and token'). The probes run with autocast off."""
    gen = torch.Generator().manual_seed(0)
    # the branch outputs in bf16, as the attention under autocast returns them; x and the gate in float32
    inputs = (torch.randn(2, 64, DIM, generator=gen),
              *(torch.randn(2, H, 64, DV, generator=gen).bfloat16() for _ in range(3)))
    module = EinsumCombine()
    optimized = optimize_fresh(copy.deepcopy(module), only(CANON, COMBINE))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (want, want_grads), (got, got_grads) = (with_grads(m, inputs) for m in (module, optimized))
    r = row(optimized, COMBINE)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert only_graph(optimized).code_after.count("torch.ops.nsa.gated_combine(") == 1
    # against float64: eager rounds the gate and the sum to bf16 (autocast's einsum), the op less often
    oracle, oracle_grads = with_grads(copy.deepcopy(module).double(), tuple(t.double() for t in inputs))
    assert want_grads.keys() == got_grads.keys() == oracle_grads.keys()
    pairs = [("output", got, want, oracle)] + [(n, got_grads[n], want_grads[n], oracle_grads[n]) for n in want_grads]
    for name, a, e, ref in pairs:
        assert relative_error(a, ref) <= max(2 * relative_error(e, ref), FLOORS[torch.bfloat16]), name


# --- the projections and their RoPE ---------------------------------------------------------------

D, HQ, HK, DIMP, SP = 8, 4, 2, 32, 7


def rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat([-t2, t1], dim=-1)


def rotate_pairs(t):
    t1, t2 = t.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([-t2, t1], dim=-1).flatten(-2)


class Rope(nn.Module):
    """q and k projections of x with RoPE spelled as `spelling`; returns q, k, v as one tensor."""

    def __init__(self, spelling, max_len=16):
        super().__init__()
        self.spelling = spelling
        self.q = nn.Linear(DIMP, HQ * D, bias=False)
        self.kv = nn.Linear(DIMP, 2 * HK * D, bias=False)
        self.qkv = nn.Linear(DIMP, (HQ + 2 * HK) * D, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), persistent=False)
        angles = torch.arange(max_len).float()[:, None] * self.inv_freq  # [max_len, D/2]
        full = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos_cached", full.cos(), persistent=False)  # [max_len, D]
        self.register_buffer("sin_cached", full.sin(), persistent=False)
        rot = D // 2  # partial rotary: the first half of each head's dims
        part = torch.arange(max_len).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot))
        self.register_buffer("cos_part", part.cos(), persistent=False)  # [max_len, rot/2]
        self.register_buffer("sin_part", part.sin(), persistent=False)

    def forward(self, x):
        sp = self.spelling
        if sp == "packed":  # x [N, dim]; positions restart at each of two documents
            q = self.q(x).view(-1, HQ, D)
            pos = torch.cat([torch.arange(4, device=x.device), torch.arange(x.shape[0] - 4, device=x.device)])
            emb = torch.cat([pos[:, None].float() * self.inv_freq] * 2, dim=-1)[:, None, :]  # [N, 1, D]
            return q * emb.cos().to(q.dtype) + rotate_half(q) * emb.sin().to(q.dtype)
        Bx, Sx, _ = x.shape
        if sp == "hf-cached-heads-first":  # full-width buffers, [B, H, S, D]
            q = self.q(x).view(Bx, Sx, HQ, D).transpose(1, 2)
            k, v = self.kv(x).view(Bx, Sx, 2 * HK, D).transpose(1, 2).chunk(2, dim=1)
            cos, sin = self.cos_cached[:Sx], self.sin_cached[:Sx]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        elif sp == "fused-qkv-lazy-interleaved":  # one Linear split; tables built after it, per call
            q, k, v = self.qkv(x).split([HQ * D, HK * D, HK * D], dim=-1)
            q, k, v = (t.view(Bx, Sx, -1, D).transpose(1, 2) for t in (q, k, v))
            q, k = self.lazy_interleaved(q), self.lazy_interleaved(k)
        elif sp == "complex":  # Meta's llama: view_as_complex, freqs_cis computed in forward
            q, k, v = self.qkv(x).split([HQ * D, HK * D, HK * D], dim=-1)
            q, k, v = q.view(Bx, Sx, HQ, D), k.view(Bx, Sx, HK, D), v.view(Bx, Sx, HK, D)
            angles = torch.outer(torch.arange(Sx, device=x.device).float(), self.inv_freq.float())
            freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, Sx, 1, D // 2)
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(Bx, Sx, HQ, -1, 2)) * freqs_cis)
            k = torch.view_as_real(torch.view_as_complex(k.float().reshape(Bx, Sx, HK, -1, 2)) * freqs_cis)
            q, k = q.flatten(3).type_as(v), k.flatten(3).type_as(v)
        elif sp == "fla-halves":  # [B, S, H, D]; tables computed in forward, once for q and once for k
            q = self.fla(self.q(x).view(Bx, Sx, HQ, D))
            k, v = self.kv(x).view(Bx, Sx, 2, HK, D).unbind(2)
            k = self.fla(k)
        elif sp == "kv-view-permute-partial":  # k, v = kv.view(B, S, 2, G, D).permute(2, 0, 3, 1, 4)
            q = self.partial(self.q(x).view(Bx, Sx, HQ, D).transpose(1, 2))
            k, v = self.kv(x).view(Bx, Sx, 2, HK, D).permute(2, 0, 3, 1, 4)
            k = self.partial(k)
        # the projection also read before its RoPE (the op returns it beside the rotated one)
        elif sp == "before-rope":  # lucidrains: the compressed branch scores unrotated q against pooled unrotated k
            q, k, v = self.qkv(x).split([HQ * D, HK * D, HK * D], dim=-1)
            q, k, v = (t.view(Bx, Sx, -1, D).transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
            pooled = k.mean(2)  # [B, HK, D]
            compressed = (q.unflatten(1, (HK, -1)) * pooled[:, :, None, None]).sum(-1)  # [B, HK, HQ / HK, S]
            q, k = self.lazy_interleaved(q), self.lazy_interleaved(k)
            return torch.cat([q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2),
                              compressed.flatten(1, 2).transpose(1, 2)], -1)
        elif sp == "raw-key-also-used":  # keys of a kv Linear compressed before RoPE
            k = self.kv(x)[..., : HK * D].view(Bx, Sx, HK, D).transpose(1, 2)
            k_rot = k * self.cos_cached[:Sx] + rotate_half(k) * self.sin_cached[:Sx]
            return k_rot + k.mean(2, keepdim=True)
        # near misses (one projection alone: refused means the graph stays as it was)
        elif sp == "partial-product-also-used":  # a product with the table is read outside the rotation
            k = self.kv(x)[..., : HK * D].view(Bx, Sx, HK, D).transpose(1, 2)
            k_cos = k * self.cos_cached[:Sx]
            k_rot = k_cos + rotate_half(k) * self.sin_cached[:Sx]
            return k_rot + k_cos.mean(2, keepdim=True)
        elif sp == "complex-scaled":  # the complex product scaled: not a rotation
            q = self.q(x).view(Bx, Sx, HQ, D)
            angles = torch.outer(torch.arange(Sx, device=x.device).float(), self.inv_freq.float())
            freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, Sx, 1, D // 2)
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(Bx, Sx, HQ, -1, 2)) * freqs_cis * 2)
            return q.flatten(3).type_as(x)
        elif sp == "tables-in-another-autocast-region":  # tables after the projection, across an autocast exit
            q = self.q(x).view(Bx, Sx, HQ, D).transpose(1, 2)
            with torch.autocast("cpu", enabled=False):
                angles = torch.arange(Sx, device=x.device).float()[:, None] * self.inv_freq
            full = torch.cat([angles, angles], dim=-1)
            return q * full.cos() + rotate_half(q) * full.sin()
        else:
            raise ValueError(sp)
        return torch.cat([t.transpose(1, 2).flatten(2) if t.shape[1] != Sx else t.flatten(2) for t in (q, k, v)], -1)

    def lazy_interleaved(self, t):  # [B, H, S, D], rotary-embedding-torch's interleaved default
        angles = torch.einsum("i,j->ij", torch.arange(t.shape[-2], device=t.device).float(), self.inv_freq)
        angles = angles[..., None].expand(*angles.shape, 2).reshape(angles.shape[0], -1)  # '... n -> ... (n r)'
        return t * angles.cos().to(t.dtype) + rotate_pairs(t) * angles.sin().to(t.dtype)

    def fla(self, t):  # [B, S, H, D]
        angles = torch.outer(torch.arange(t.shape[1], device=t.device).float(), self.inv_freq.float())
        cos, sin = angles.cos()[:, None, :].to(t.dtype), angles.sin()[:, None, :].to(t.dtype)
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], dim=-1)

    def partial(self, t):  # [.., S, D]: rotate-half on the first D/2 dims, the rest passed through
        r = self.cos_part.shape[-1]
        cos, sin = self.cos_part[: t.shape[-2]].to(t.dtype), self.sin_part[: t.shape[-2]].to(t.dtype)
        t1, t2, rest = t[..., :r], t[..., r : 2 * r], t[..., 2 * r :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin, rest], dim=-1)


def rope_inputs(spelling):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(2 * SP, DIMP, generator=gen) if spelling == "packed" else torch.randn(2, SP, DIMP, generator=gen),)


# spelling -> (projections, Linears, RoPE text) in the kernel text
ROPE_SPELLINGS = {
    "hf-cached-heads-first": ("3 projections of 2 Linears", "RoPE half r=8 on 2 of them (full-width tables)"),
    "fused-qkv-lazy-interleaved": ("3 projections of 1 Linear", "RoPE interleaved r=8 on 2 of them (full-width tables)"),
    "complex": ("3 projections of 1 Linear", "RoPE interleaved r=8 on 2 of them (complex tables)"),
    "fla-halves": ("3 projections of 2 Linears", "RoPE half r=8 on 2 of them"),
    "kv-view-permute-partial": ("3 projections of 2 Linears", "RoPE half r=4 on 2 of them"),
    "packed": ("1 projection", "RoPE half r=8 on 1 of them (full-width tables)"),
}

# spelling -> (kernel text, the nodes of the Dynamo graph that read the projection before its RoPE)
BEFORE_ROPE = {
    "before-rope": ("nsa.projection_rope[reference] (3 projections of 1 Linear -> 1 GEMM of 64 columns; RoPE "
                    "interleaved r=8 on 2 of them (full-width tables); 2 also returned unrotated (read before RoPE); ",
                    ("unflatten", "mean")),
    "raw-key-also-used": ("nsa.projection_rope[reference] (1 projection -> 1 GEMM of 16 columns; RoPE half r=8 on 1 "
                          "of them (full-width tables); 1 also returned unrotated (read before RoPE); ", ("mean",)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", list(ROPE_SPELLINGS))
def test_rope_spellings_fire_with_parity(spelling, dtype):
    if spelling == "complex" and dtype == torch.bfloat16:
        pytest.skip("view_as_complex needs float32 (the spelling upcasts with .float()): fp32 only")
    model = parity_and_model(Rope(spelling), rope_inputs(spelling), dtype, only(PROJECTIONS))
    r = row(model, PROJECTIONS)
    projections, rope = ROPE_SPELLINGS[spelling]
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert r["kernels"][0].startswith(f"nsa.projection_rope[reference] ({projections} -> 1 GEMM of ") and \
        f"; {rope};" in r["kernels"][0], r["kernels"]
    record = only_graph(model)
    before, after = record.code_before, record.code_after
    assert after.count("torch.ops.nsa.projection_rope(") == 1 and "torch._C._nn.linear(" not in after
    if projections.endswith("of 1 Linear"):  # the pieces of one Linear in order: its weight itself, uncut
        call = next(line for line in after.splitlines() if "torch.ops.nsa.projection_rope(" in line)
        weight = call.split("torch.ops.nsa.projection_rope(")[1].split(", ")[1]
        assert weight.endswith("_parameters_weight_") and "torch.narrow(" not in after, call
    # the RoPE arithmetic is gone (the tables' computation stays: the op reads them): no sign
    # flip or subtraction, no complex view, fewer products
    rotation = re.compile(r"= -[a-z_]|\w - \w|view_as_complex|view_as_real")
    assert rotation.search(before) and not rotation.search(after)
    assert after.count(" * ") < before.count(" * ")


@pytest.mark.parametrize("spelling", [*ROPE_SPELLINGS, *BEFORE_ROPE])
def test_rope_spellings_fire_at_symbolic_sizes(spelling):
    """Each spelling at four lengths: the first compiles static, the others share one graph with
    the length a symbol, where the pass fires with the same kernel (the views, tables and RoPE
    checked at the probe sizes); output and every gradient equal eager's (fp32) at each length."""
    module = Rope(spelling)
    optimized = optimize_fresh(copy.deepcopy(module), only(PROJECTIONS))
    for length in (SP, SP + 1, SP + 2, 13):  # (max_len 16: the cached tables' length)
        gen = torch.Generator().manual_seed(length)
        x = torch.randn(2 * length, DIMP, generator=gen) if spelling == "packed" else \
            torch.randn(2, length, DIMP, generator=gen)
        (want, want_grads), (got, got_grads) = with_grads(module, (x,)), with_grads(optimized, (x,))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert want_grads.keys() == got_grads.keys()
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    static, symbolic = state_of(optimized).graphs
    assert "torch.SymInt" not in static.code_before and "torch.SymInt" in symbolic.code_before
    (log,) = [log for log in symbolic.logs if log.pass_name == PROJECTIONS]
    assert len(log.matches) == 1 and log.refusals == [], (log.matches, log.refusals)
    kernel = log.matches[0].kernel
    if spelling in BEFORE_ROPE:
        assert kernel.startswith(BEFORE_ROPE[spelling][0]), kernel
    else:
        projections, rope = ROPE_SPELLINGS[spelling]
        assert kernel.startswith(f"nsa.projection_rope[reference] ({projections} -> 1 GEMM of ") and \
            f"; {rope};" in kernel
    after = symbolic.code_after
    assert after.count("torch.ops.nsa.projection_rope(") == 1 and "torch._C._nn.linear(" not in after


def rewritten(module, inputs) -> tuple[torch.fx.GraphModule, PassLog]:
    """module's Dynamo graph after the projection_rope pass alone, and the pass's log."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=keep, fullgraph=True)(*inputs)
    (gm,) = graphs
    log = PassLog(PROJECTIONS, 0)
    PROJECTION_PASS.apply(gm.graph, PassContext(only(PROJECTIONS), log))
    gm.graph.lint()
    gm.recompile()
    return gm, log


def readers_of_the_op(gm: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """(what reads the op's pieces, what reads its plain outputs): the ops reached from its
    outputs through the getitems and the layout views the pass adds."""
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.nsa.projection_rope]
    n_pieces, views = len(op.args[5]), {"getitem", "reshape", "movedim", "contiguous"}
    reached = ([], [])
    for out in op.users:
        side, stack = reached[out.args[1] >= n_pieces], list(out.users)
        while stack:
            node = stack.pop()
            name = node.target if isinstance(node.target, str) else node.target.__name__
            if name in views:
                stack.extend(node.users)
            else:
                side.append(name)
    return sorted(set(reached[0])), sorted(set(reached[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("spelling", list(BEFORE_ROPE))
def test_rope_with_the_projection_also_read_before_it(spelling, dtype):
    """lucidrains scores the compressed branch with q and pools k before RoPE: the op returns each
    rotated piece and, beside it, its plain projection (one GEMM); the readers of the unrotated
    values read the plain outputs, the attention the rotated ones; outputs and every gradient
    match (fp32: eager; bf16, fp16: the float64 oracle)."""
    module = Rope(spelling)
    model = parity_and_model(module, rope_inputs(spelling), dtype, only(PROJECTIONS))
    r = row(model, PROJECTIONS)
    kernel, readers = BEFORE_ROPE[spelling]
    assert (r["matches"], r["refused"]) == (1, 0) and r["kernels"][0].startswith(kernel), r
    record = only_graph(model)
    before, after = record.code_before, record.code_after
    assert after.count("torch.ops.nsa.projection_rope(") == 1 and "torch._C._nn.linear(" not in after
    rotation = re.compile(r"= -[a-z_]|\w - \w")
    assert rotation.search(before) and not rotation.search(after)
    # the readers of the unrotated projection read the op's plain outputs, and only they do
    gm, log = rewritten(module, rope_inputs(spelling))
    assert len(log.matches) == 1 and not log.refusals
    pieces_read_by, plain_read_by = readers_of_the_op(gm)
    assert plain_read_by == sorted(readers) and not set(readers) & set(pieces_read_by), (pieces_read_by, plain_read_by)


@pytest.mark.parametrize(
    "spelling, reason",
    [
        ("partial-product-also-used", "RoPE left eager: values inside the RoPE arithmetic are used elsewhere: k_cos "
                                      "(mul, a partial result of the rotation: it reads the tables) by mean"),
        ("complex-scaled", "RoPE left eager: the arithmetic on the projection is not a RoPE rotation"),
        ("tables-in-another-autocast-region", "RoPE left eager: its tables are computed after the group's first "
                                              "projection linear and cannot be moved before it: an autocast region "
                                              "starts or ends on the way"),
    ],
)
def test_rope_near_misses_refused_with_the_graph_unchanged(spelling, reason):
    refused_unchanged(Rope(spelling), rope_inputs(spelling), only(PROJECTIONS), PROJECTIONS, reason)


def test_a_partial_result_read_elsewhere_is_refused_naming_the_readers_line():
    optimized = optimize_fresh(copy.deepcopy(Rope("partial-product-also-used")), only(PROJECTIONS))
    optimized(*rope_inputs("partial-product-also-used"))
    (reason,) = row(optimized, PROJECTIONS)["reasons"]
    assert re.fullmatch(r"RoPE left eager: .* by mean \(\S*test_combine_rope_spellings\.py:\d+: return k_rot \+ "
                        r"k_cos\.mean\(2, keepdim=True\)\); the op returns the projection and its rotation, not "
                        r"values between them", reason), reason
