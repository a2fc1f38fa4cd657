"""Graph tests of gqa_grouped_matmul: fired (exact count), source gone / target present,
parity of outputs and gradients, and near misses refused with the graph unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import GQA_ONLY as FAST, growing_float_expands, only_graph, optimize_fresh, row, tokens

import nsa_compile
from nsa_compile.models import build_model, preset
from nsa_compile.parity import check_parity

PASS = "gqa_grouped_matmul"


def run_tiny(**changes):
    torch.manual_seed(0)
    model = optimize_fresh(build_model(preset("tiny", **changes)), FAST)
    model.loss(tokens(2, 100)).backward()
    return model


@pytest.mark.parametrize(
    "changes, refused",
    [
        ({}, 4),  # per layer: the gate's repeat (used by getitem) and the selection mask (bool)
        ({"shared_kv": True}, 4),
        ({"gate": "head", "compression": "mlp", "rope": "interleaved"}, 2),  # no gate repeat
    ],
)
def test_fires_on_every_kv_copy_of_every_layer(changes, refused):
    model = run_tiny(**changes)
    r = row(model, PASS)
    # 2 layers x 3 branches x (K, V)
    assert r["matches"] == 12
    assert r["where"] == ["blocks.0.attn", "blocks.1.attn"]
    assert r["refused"] == refused
    assert r["graphs"] == 1


def test_kv_copies_gone_and_grouped_matmuls_present():
    model = run_tiny()
    record = only_graph(model)
    # torch IR: the only repeat_interleaves left are the gate's and the bool mask's
    dynamo_left = record.code_after.count(".repeat_interleave(")
    assert record.code_before.count(".repeat_interleave(") == 16
    assert dynamo_left == 4
    # ATen: no expand that copies a float tensor with rows of the head dim (K/V) is left
    head_dim = preset("tiny").head_dim
    expands = growing_float_expands(record.aten["forward"])
    assert all(dst[-1] != head_dim for _, dst in expands), expands
    assert len(expands) == 2  # the gate's [.., G, 1, 3] -> [.., G, h, 3], one per layer
    # the replacement: each rewritten matmul became unflatten -> flatten -> matmul -> unflatten
    assert record.code_after.count("torch.unflatten(") == 24
    assert record.code_after.count("torch.matmul(") == 12


def test_disabled_pass_leaves_copies():
    torch._dynamo.reset()
    model = nsa_compile.optimize(build_model("tiny"), FAST.replace(disabled_passes=nsa_compile.pass_names()))
    model.loss(tokens(2, 100)).backward()
    record = only_graph(model)
    assert [r["name"] for r in nsa_compile.report(model)] == []
    assert record.code_before == record.code_after
    head_dim = preset("tiny").head_dim
    assert sum(dst[-1] == head_dim for _, dst in growing_float_expands(record.aten["forward"])) == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "changes",
    [{}, {"gate": "head", "compression": "mlp", "rope": "interleaved", "shared_kv": True}],
    ids=["seed-variants", "paper-variants"],
)
def test_parity_outputs_and_every_gradient(dtype, changes):
    torch.manual_seed(1)
    eager = build_model(preset("tiny", **changes))
    report = check_parity(eager, lambda m: optimize_fresh(m, FAST), tokens(2, 100, seed=3), dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert len(report.rows) == 2 + len(list(eager.parameters()))


# --- near misses: refused, graph unchanged, same numbers --------------------------------------


class GQAAttention(nn.Module):
    """Plain GQA attention on [B, G, S, D] K/V and [B, H, S, D] queries."""

    def __init__(self, h=3):
        super().__init__()
        self.h = h

    def forward(self, q, k, v):
        k = k.repeat_interleave(self.h, dim=1)
        v = torch.repeat_interleave(v, self.h, dim=1)
        p = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return torch.matmul(p, v)


class RepeatOverSequence(nn.Module):
    """repeat_interleave over the key axis (a matrix dim), not over heads."""

    def forward(self, q, k):
        k = k.repeat_interleave(2, dim=2)  # [B, H, 2T, D]
        return q @ k.transpose(-1, -2)


class CopyUsedElsewhere(GQAAttention):
    """The repeated K is also returned: its copy must stay."""

    def forward(self, q, k):
        k = k.repeat_interleave(self.h, dim=1)
        return q @ k.transpose(-1, -2), k


def qkv(B=2, G=2, h=3, S=5, D=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, G * h, S, D, generator=g), torch.randn(B, G, S, D, generator=g),
            torch.randn(B, G, S, D, generator=g))


def test_plain_gqa_module_exact_count_and_equal_output():
    q, k, v = qkv()
    module = GQAAttention()
    expected = module(q, k, v)
    optimized = optimize_fresh(GQAAttention(), FAST)
    assert torch.allclose(optimized(q, k, v), expected, atol=1e-6, rtol=1e-5)
    r = row(optimized, PASS)
    assert (r["matches"], r["refused"]) == (2, 0)
    assert growing_float_expands(only_graph(optimized).aten["inference"]) == []  # no K/V copy


@pytest.mark.parametrize(
    "module, args, reason",
    [
        (RepeatOverSequence(), lambda: qkv(G=6, h=1)[:2], "a matrix dim of the matmul, not a head dim"),
        (CopyUsedElsewhere(), lambda: qkv()[:2], "also used by output: the copy must stay"),
    ],
    ids=["repeat-over-sequence", "copy-used-elsewhere"],
)
def test_near_miss_refused_with_graph_unchanged(module, args, reason):
    inputs = args()
    expected = module(*inputs)
    optimized = optimize_fresh(module, FAST)
    got = optimized(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(a, b)
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and r["refused"] == 1
    assert any(reason in text for text in r["reasons"]), r["reasons"]


INDUCTOR_GQA_ONLY = nsa_compile.OptimizeConfig(disabled_passes=FAST.disabled_passes)


@pytest.mark.inductor
def test_inductor_smoke_fires_and_matches():
    """Through Inductor (pre_grad hook): fired on every layer, parity holds, and a second
    compile of the same graph (served from Inductor's cache on PyTorch >= 2.12) reports the same."""
    torch.manual_seed(2)
    eager = build_model("tiny")

    def with_inductor(m):
        torch._dynamo.reset()
        return nsa_compile.optimize(m, INDUCTOR_GQA_ONLY)  # Inductor, the GQA pass alone

    report = check_parity(eager, with_inductor, tokens(2, 100, seed=5), torch.float32)
    assert report.ok, [r.as_dict() for r in report.failures()]
    for _ in range(2):
        model = with_inductor(copy.deepcopy(eager))
        model.loss(tokens(2, 100, seed=5)).backward()
        # the K/V copies of all three branches of both layers (the gate's copy is not a matmul operand)
        assert row(model, PASS)["matches"] == 12
