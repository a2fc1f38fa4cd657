"""projection_rope on packed documents (pos [B, S], NSA_SEMANTICS.md section 6): the LM gathers its
RoPE tables per token, cos[pos] and sin[pos] [B, S, r/2], and the pass takes each gather as a table
(the op reads [B, S, R/2] tables). Graph tests on the packed tiny model (fired on every layer, exact
count; the separate GEMMs and the RoPE arithmetic gone; the op reading the gathered tables), parity
of outputs and every gradient with the eager packed model in fp32 and bf16, other ways of writing
the per-token tables accepted, and near misses (tables of the wrong length, arithmetic that is not a
rotation) refused with the graph unchanged. The unpacked form is tests/test_fused_projections.py."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, packed_positions, row

import nsa_compile
from nsa_compile.models import build_model
from nsa_compile.models.nsa import apply_rope, rope_tables
from nsa_compile.parity import check_parity

PASS = "projection_rope"
ONLY = nsa_compile.OptimizeConfig(
    compiler="aot_eager", disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != PASS))
NOT_TRITON = "; not triton: the Triton kernel runs on CUDA (tensors on cpu)"


positions = packed_positions


# Rows packed differently: documents of 1 and 3 tokens, one shorter than a rotary period, one row
# a single document (pos = arange).
PACKINGS = [[13, 20, 1, 3], [37]]


def lm_inputs(seed=4) -> tuple[torch.Tensor, torch.Tensor]:
    pos = positions(PACKINGS)
    tokens = torch.randint(0, 256, pos.shape, generator=torch.Generator().manual_seed(seed))
    return tokens, pos


# --- the packed tiny model --------------------------------------------------------------------------


def test_packed_tiny_model_fires_per_layer_with_the_gathered_tables_and_parity_fp32():
    torch.manual_seed(1)
    eager = build_model("tiny")
    optimized = optimize_fresh(copy.deepcopy(eager), ONLY)
    tokens, pos = lm_inputs()
    B, S = pos.shape
    got, want = optimized(tokens, pos), eager(tokens, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    want.square().mean().backward()
    opt_params = dict(optimized.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(opt_params[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)

    r = row(optimized, PASS)
    assert (r["matches"], r["where"], r["refused"]) == (2, ["blocks.0.attn", "blocks.1.attn"], 0), r
    assert r["kernels"] == [f"nsa.projection_rope[reference] (7 projections -> 1 GEMM of 256 columns; RoPE half "
                            f"r=16 on 4 of them{NOT_TRITON})"]
    record = only_graph(optimized)
    (log,) = [log for log in record.logs if log.pass_name == PASS]
    before, after = record.code_before, log.code_after
    assert "l_pos_" in before  # the packed graph: pos is an input
    assert before.count("torch._C._nn.linear(") - after.count("torch._C._nn.linear(") == 14
    assert after.count("torch.ops.nsa.projection_rope(") == 2
    # the RoPE arithmetic (a neg per rotated projection) is gone; the gathers stay, read by the op
    negs = re.compile(r"^\s*neg\w* = -", re.M)
    assert len(negs.findall(before)) == 8 and len(negs.findall(after)) == 0
    fwd, bwd = record.aten["forward"], record.aten["backward"]
    ops = [n for n in fwd.graph.nodes if n.op == "call_function" and n.target is torch.ops.nsa.projection_rope.default]
    assert len(ops) == 2
    assert sum(1 for n in bwd.graph.nodes if n.op == "call_function"
               and n.target is torch.ops.nsa.projection_rope_backward.default) == 2
    for op in ops:
        for table in op.args[3:5]:  # cos, sin: the per-token gathers cos[pos], sin[pos] [B, S, r/2]
            assert table.target is torch.ops.aten.index.Tensor, table.format_node()
            assert tuple(table.meta["val"].shape) == (B, S, 8)
            assert any(a.op == "placeholder" for a in torch.utils._pytree.tree_leaves(table.args)
                       if isinstance(a, torch.fx.Node))


def test_packed_tiny_model_interleaved_partial_rotary_parity_bf16():
    """Outputs and every gradient within the parity bar of the eager packed model in bf16, with the
    other convention and R < D (the half convention with R = D: the fp32 test above)."""
    torch.manual_seed(2)
    eager = build_model("tiny", rope="interleaved", rotary_dim=8)
    holder = {}

    def optimize(m):
        holder["model"] = optimize_fresh(m, ONLY)
        return holder["model"]

    report = check_parity(eager, optimize, lm_inputs(seed=5), torch.bfloat16, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert len(report.rows) == 2 + len(list(eager.parameters()))
    r = row(holder["model"], PASS)
    assert (r["matches"], r["refused"]) == (2, 0), r
    assert "RoPE interleaved r=8 on 4 of them" in r["kernels"][0], r


# --- other ways to write per-token tables, and near misses -------------------------------------------


class PackedRope(nn.Module):
    """One projection rotated by the RoPE tables gathered at each token's document position, as
    the LM does it, or written with `change`."""

    def __init__(self, change=None, dim=16, H=2, D=8):
        super().__init__()
        self.change, self.H, self.D = change, H, D
        self.w = nn.Linear(dim, H * D, bias=False)

    def forward(self, x, cos, sin, pos):  # x [B, S, dim]; cos, sin [S, r/2]; pos [B, S]
        B, S, _ = x.shape
        change = self.change
        if change == "index-select":  # a gather that is not a getitem: its view is the table
            c = cos.index_select(0, pos.flatten()).view(B, S, -1)
            s = sin.index_select(0, pos.flatten()).view(B, S, -1)
        elif change == "row-0-positions":  # [1, S, r/2]: every row turned as row 0 (the op broadcasts)
            c, s = cos[pos[:1]], sin[pos[:1]]
        elif change == "first-token-angles":  # [B, 1, r/2]: every token turned by its row's first angle
            c, s = cos[pos[:, :1]], sin[pos[:, :1]]
        else:
            c, s = cos[pos], sin[pos]  # [B, S, r/2]
        y = self.w(x).view(B, S, self.H, self.D)
        if change not in ("missing-neg", "same-table-twice"):
            return apply_rope(y, c, s, "half")
        r = 2 * c.shape[-1]
        cc, ss = torch.cat([c, c], dim=-1)[:, :, None], torch.cat([s, s], dim=-1)[:, :, None]  # [B, S, 1, r]
        x_rot, x_pass = y[..., :r], y[..., r:]
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
        rotated = torch.cat([x2, x1] if change == "missing-neg" else [-x2, x1], dim=-1)
        out = x_rot * cc + rotated * (cc if change == "same-table-twice" else ss)
        return torch.cat([out, x_pass], dim=-1)


def module_inputs(B=2, S=11, dim=16, rot=6):
    g = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(S, rot, 10000.0, "cpu")
    x = torch.randn(B, S, dim, generator=g, requires_grad=True)
    return x, cos, sin, positions([[4, 7], [1, 2, 8]])


def run_both(change):
    module = PackedRope(change)
    args = module_inputs()
    optimized = optimize_fresh(copy.deepcopy(module), ONLY)
    got, want = optimized(*args), module(*args)
    grads = torch.autograd.grad(got.square().sum(), [args[0], *optimized.parameters()])
    want_grads = torch.autograd.grad(want.square().sum(), [args[0], *module.parameters()])
    return (got, *grads), (want, *want_grads), optimized


@pytest.mark.parametrize("change", [None, "index-select", "row-0-positions"])
def test_accepted_per_token_tables(change):
    got, want, optimized = run_both(change)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    assert (r["matches"], r["refused"]) == (1, 0) and r["kernels"][0].startswith(
        "nsa.projection_rope[reference] (1 projection -> 1 GEMM of 16 columns; RoPE half r=6 on 1"), r
    after = only_graph(optimized).code_after
    assert "torch.cat(" not in after and after.count("torch.ops.nsa.projection_rope(") == 1


@pytest.mark.parametrize(
    "change, reason",
    [
        ("first-token-angles", "RoPE left eager: the tables c, s are (2, 1, 3) and (2, 1, 3); the op reads "
                               "two float tables [S, R/2] or [1 or B, S(, 1), R/2] (S = 11)"),
        ("missing-neg", "RoPE left eager: the arithmetic on the projection is not a RoPE rotation"),
        ("same-table-twice", "RoPE left eager: the arithmetic reads 1 tables besides the projection (c)"),
    ],
)
def test_near_misses_refused_with_the_graph_unchanged(change, reason):
    got, want, optimized = run_both(change)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same eager code
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and any(text.startswith(reason) for text in r["reasons"]), r["reasons"]


# --- on the GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_packed_seed_model_parity_on_cuda_with_the_pass():
    """The Triton kernel reads the per-token [B, S, R/2] tables; bf16 parity with the eager packed model."""
    torch.manual_seed(0)
    eager = build_model("seed", n_layers=2).cuda()
    pos = positions([[100, 1, 31, 124], [256]]).cuda()
    tokens = torch.randint(0, eager.cfg.vocab_size, pos.shape, generator=torch.Generator().manual_seed(1)).cuda()
    holder = {}

    def optimize(m):
        holder["model"] = optimize_fresh(m, ONLY)
        return holder["model"]

    report = check_parity(eager, optimize, (tokens, pos), torch.bfloat16, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    r = row(holder["model"], PASS)
    assert r["matches"] == 2 and r["kernels"][0].startswith("nsa.projection_rope[triton] (7 projections"), r
