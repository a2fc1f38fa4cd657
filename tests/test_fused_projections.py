"""projection_rope and nsa::projection_rope: graph tests (fired, exact count; the separate GEMMs
and the RoPE arithmetic gone, the op in place), parity of outputs and every gradient in fp32, bf16
and fp16 and under bf16 autocast with fp32 parameters, the parameters staying the module's own,
accepted forms, near misses refused with the graph unchanged, opcheck of both ops (also with plain
outputs: rotated pieces returned unrotated too), and the Triton kernels (on CUDA when there is
one, else on the CPU through Triton's interpreter, TRITON_INTERPRET=1 set by a fixture for those
tests only)."""

from __future__ import annotations

import contextlib
import copy
import os
import re

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, row, tokens

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.models import build_model
from nsa_compile.models.config import preset
from nsa_compile.models.nsa import apply_rope, rope_tables
from nsa_compile.ops import rope as rope_op
from nsa_compile.parity import FLOORS, check_parity, relative_error
from nsa_compile.passes.projection_rope import PASS as PASS_OBJECT
from nsa_compile.rewrite import PassContext, PassLog
from nsa_compile.workload import cast_inputs, loss_of

PASS = "projection_rope"
ONLY = nsa_compile.OptimizeConfig(
    compiler="aot_eager", disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != PASS))
NOT_TRITON = "; not triton: the Triton kernel runs on CUDA (tensors on cpu)"


def aten_count(gm, *targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def gemms_reading_the_op_input(gm) -> list:
    """mm / addmm nodes of an ATen graph that read (a view or a cast of) a projection_rope op's
    input or what that input was cast from (under autocast each eager linear casts x itself)."""
    aten = torch.ops.aten
    views = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.nsa.projection_rope.default:
            x = node.args[0]
            views.add(x)
            while x.op == "call_function" and x.target is aten._to_copy.default:
                x = x.args[0]
                views.add(x)
    for node in gm.graph.nodes:  # graph order: a view's source comes first
        if node.op == "call_function" and node.args and node.args[0] in views and node.target in (
                aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten._to_copy.default):
            views.add(node)
    gemms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in gemms
            and any(a in views for a in n.args if isinstance(a, torch.fx.Node))]


# --- the tiny model ---------------------------------------------------------------------------------


def test_fires_once_per_layer_with_parity_and_the_gemms_and_rope_arithmetic_gone():
    """The tiny model with every pass (the attention passes read the op's pieces), bf16."""
    torch.manual_seed(1)
    eager = build_model("tiny")
    holder = {}

    def optimize(m):
        holder["model"] = optimize_fresh(m)
        return holder["model"]

    report = check_parity(eager, optimize, tokens(2, 37, seed=4), torch.bfloat16)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert len(report.rows) == 2 + len(list(eager.parameters()))
    model = holder["model"]
    r = row(model, PASS)
    assert (r["matches"], r["where"], r["refused"]) == (2, ["blocks.0.attn", "blocks.1.attn"], 0), r
    assert r["kernels"] == [f"nsa.projection_rope[reference] (7 projections -> 1 GEMM of 256 columns; RoPE half "
                            f"r=16 on 4 of them{NOT_TRITON})"]
    record = only_graph(model)
    (log,) = [log for log in record.logs if log.pass_name == PASS]
    before, after = record.code_before, log.code_after
    # per layer 7 projections of the normed input became one op; wo, the gate and MLP stay
    assert before.count("torch._C._nn.linear(") - after.count("torch._C._nn.linear(") == 14
    assert after.count("torch.ops.nsa.projection_rope(") == 2
    # the RoPE arithmetic: 4 per layer, each a neg and 4 cats (cos, sin, halves, pass-through)
    negs = re.compile(r"^\s*neg\w* = -", re.M)
    assert len(negs.findall(before)) == 8 and len(negs.findall(after)) == 0
    assert before.count("torch.cat(") - after.count("torch.cat(") == 2 * 4 * 4 - 2  # 2 weight cats added
    fwd, bwd = record.aten["forward"], record.aten["backward"]
    assert aten_count(fwd, torch.ops.nsa.projection_rope.default) == 2
    assert aten_count(bwd, torch.ops.nsa.projection_rope_backward.default) == 2
    # no other GEMM reads the projections' input, and no RoPE arithmetic is left
    assert gemms_reading_the_op_input(fwd) == []
    assert aten_count(fwd, torch.ops.aten.neg.default) == 0


# --- a module with NSAAttention's projection lines ------------------------------------------------


class Projections(nn.Module):
    """The projection and RoPE lines of NSAAttention.forward (models/nsa.py), all outputs returned
    as one tensor (check_parity's loss reads the first output)."""

    def __init__(self, dim=32, H=4, G=2, D=8, style="half", shared_kv=False, bias=False):
        super().__init__()
        self.H, self.G, self.D, self.style = H, G, D, style
        self.wq = nn.Linear(dim, H * D, bias=bias)
        names = ("shared",) if shared_kv else ("cmp", "sel", "win")
        self.wk = nn.ModuleDict({n: nn.Linear(dim, G * D, bias=bias) for n in names})
        self.wv = nn.ModuleDict({n: nn.Linear(dim, G * D, bias=bias) for n in names})

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, self.H, self.D), cos, sin, self.style)  # [B, S, H, D]
        ks = [apply_rope(w(x).view(B, S, self.G, self.D), cos, sin, self.style) for w in self.wk.values()]
        vs = [w(x).view(B, S, self.G, self.D) for w in self.wv.values()]
        return torch.cat([t.flatten(2) for t in (q, *ks, *vs)], dim=-1)


def projection_inputs(B=2, S=11, dim=32, rot=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_tables(S, rot, 10000.0, "cpu")
    return torch.randn(B, S, dim, generator=g), cos, sin


@pytest.mark.parametrize(
    "kwargs, rot, dtype",
    [({}, 8, torch.float32), ({}, 8, torch.bfloat16), ({}, 8, torch.float16),
     ({"style": "interleaved"}, 8, torch.bfloat16), ({}, 4, torch.float16), ({"shared_kv": True}, 8, torch.float32),
     ({"bias": True}, 8, torch.bfloat16)],
    ids=["half-fp32", "half-bf16", "half-fp16", "interleaved-bf16", "partial-rotary-fp16", "shared-kv-fp32",
         "bias-bf16"],
)
def test_parity_outputs_and_every_gradient(kwargs, rot, dtype):
    torch.manual_seed(2)
    eager = Projections(**kwargs)
    holder = {}

    def optimize(m):
        holder["model"] = optimize_fresh(m, ONLY)
        return holder["model"]

    report = check_parity(eager, optimize, projection_inputs(rot=rot), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert len(report.rows) == 2 + len(list(eager.parameters()))
    r = row(holder["model"], PASS)
    pieces = 3 if kwargs.get("shared_kv") else 7
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert r["kernels"][0].startswith(f"nsa.projection_rope[reference] ({pieces} projections")
    style = kwargs.get("style", "half")
    assert f"RoPE {style} r={rot} on {pieces // 2 + 1} of them" in r["kernels"][0]


def test_parameters_and_state_dict_stay_the_modules_own():
    torch.manual_seed(3)
    model = Projections(bias=True)
    eager = copy.deepcopy(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    optimized = optimize_fresh(model, ONLY)
    x, cos, sin = projection_inputs()
    optimized(x, cos, sin).square().sum().backward()
    eager(x, cos, sin).square().sum().backward()
    assert list(optimized.state_dict()) == keys
    assert all(p is params[name] for name, p in optimized.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-5)
    # a step on the parameters shows in the next call: nothing was copied at compile time
    with torch.no_grad():
        params["wq.weight"].add_(1.0)
        eager.wq.weight.add_(1.0)
    torch.testing.assert_close(optimized(x, cos, sin), eager(x, cos, sin), rtol=1e-5, atol=1e-5)


# --- accepted forms and near misses on one projection ---------------------------------------------------


class OneRope(nn.Module):
    """One projection and its RoPE written with `change`."""

    def __init__(self, change=None, dim=16, H=2, D=8):
        super().__init__()
        self.change, self.H, self.D = change, H, D
        self.w = nn.Linear(dim, H * D, bias=False)
        if change == "learned-tables":
            self.table_scale = nn.Parameter(torch.ones(()))

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        change, r = self.change, 2 * cos.shape[-1]
        if change == "learned-tables":
            cos, sin = cos * self.table_scale, sin * self.table_scale
        if change in ("autocast", "autocast-float32-tables"):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # y: bf16 from fp32 x and weight
                y = self.w(x)
        else:
            y = self.w(x)
        y = y.view(B, S, self.H, self.D)
        c, s = cos[:, None, :], sin[:, None, :]
        if change != "autocast-float32-tables":  # else bf16 y times fp32 tables: fp32 by type promotion
            c, s = c.to(y.dtype), s.to(y.dtype)
        x_rot, x_pass = y[..., :r], y[..., r:]
        half = r // 2 + S % 2 if change == "residue-split" else r // 2  # odd S: a wrong partner
        x1, x2 = x_rot.chunk(2, dim=-1) if change == "chunk" else (x_rot[..., :half], x_rot[..., half:])
        cc, ss = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
        if change == "missing-neg":
            rotated = torch.cat([x2, x1], dim=-1)
        elif change == "wrong-partner":
            rotated = torch.cat([-x1, x2], dim=-1)
        else:
            rotated = torch.cat([-x2, x1], dim=-1)
        if change == "same-table-twice":
            out = x_rot * cc + rotated * cc
        elif change == "opposite-angle":
            out = x_rot * cc - rotated * ss
        elif change == "sin-as-cos":
            out = x_rot * ss + rotated * cc
        elif change == "product-returned":
            product = x_rot * cc
            out = product + rotated * ss
        else:
            out = x_rot * cc + rotated * ss
        out = torch.cat([out, x_pass], dim=-1)
        if change == "scaled-after":
            out = out * 0.5
        if change == "rot-returned":  # the rotated columns before the rotation: the projection's values
            return out, x_rot
        if change == "product-returned":  # a partial result of the rotation
            return out, product
        return out


def run_both(module, args, config=ONLY):
    expected = module(*args)
    optimized = optimize_fresh(copy.deepcopy(module), config)
    return expected, optimized(*args), optimized


@pytest.mark.parametrize("change", [None, "chunk", "opposite-angle", "sin-as-cos", "scaled-after", "rot-returned"])
def test_accepted_rope_forms(change):
    x, cos, sin = projection_inputs(dim=16, rot=6)
    expected, got, optimized = run_both(OneRope(change), (x, cos, sin))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    # rot-returned: its slice of the projection reads the op's plain output
    plain = "; 1 also returned unrotated (read before RoPE)" if change == "rot-returned" else ""
    assert r["matches"] == 1 and r["kernels"][0].startswith(
        f"nsa.projection_rope[reference] (1 projection -> 1 GEMM of 16 columns; RoPE half r=6 on 1 of them{plain}; "), r
    assert "torch.cat(" not in only_graph(optimized).code_after


@pytest.mark.parametrize(
    "change, reason",
    [
        ("missing-neg", "the arithmetic on the projection is not a RoPE rotation"),
        ("wrong-partner", "the arithmetic on the projection is not a RoPE rotation"),
        ("same-table-twice", "the arithmetic reads 1 tables besides the projection"),
        ("learned-tables", "require grad; the op gives them none"),
        ("product-returned", "values inside the RoPE arithmetic are used elsewhere: product (mul, a partial result "
                             "of the rotation: it reads the tables) by output"),
        ("autocast-float32-tables", "RoPE left eager: the rotated projection is torch.float32 (type promotion with "
                                    "the torch.float32 tables), the op returns the projection's torch.bfloat16"),
    ],
)
def test_near_misses_refused_with_the_graph_unchanged(change, reason):
    x, cos, sin = projection_inputs(dim=16, rot=6)
    expected, got, optimized = run_both(OneRope(change), (x, cos, sin))
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same eager code
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]


def test_the_backend_named_in_the_config():
    """OptimizeConfig(projection_rope_backend=...): 'reference' is written into the graph, and explain
    says the config named it; 'triton', which cannot run on the CPU outside Triton's interpreter,
    leaves the projection eager with the reason and the graph unchanged."""
    x, cos, sin = projection_inputs(dim=16, rot=6)
    expected, got, optimized = run_both(OneRope(), (x, cos, sin), ONLY.replace(projection_rope_backend="reference"))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    assert r["matches"] == 1 and r["kernels"][0].startswith("nsa.projection_rope[reference] (1 projection")
    assert r["kernels"][0].endswith("; not triton: projection_rope_backend='reference' in OptimizeConfig)")
    expected, got, optimized = run_both(OneRope(), (x, cos, sin), ONLY.replace(projection_rope_backend="triton"))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same eager code
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and r["reasons"] == [
        "OptimizeConfig(projection_rope_backend='triton'): projection_rope: backend 'triton' cannot run these inputs: "
        "device cpu (needs CUDA, or TRITON_INTERPRET=1 for the CPU interpreter)"]


# --- what the projections share, or do not ---------------------------------------------------------


class TwoInputs(nn.Module):
    """q from x, k and v from another input (cross-attention): two groups."""

    def __init__(self, dim=16, D=8):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, 2 * D, bias=False) for _ in range(3))

    def forward(self, x, mem, cos, sin):
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, 2, 8), cos, sin, "half")
        k = apply_rope(self.wk(mem).view(B, S, 2, 8), cos, sin, "half")
        return torch.cat([q.flatten(2), k.flatten(2), self.wv(mem)], dim=-1)


def test_projections_of_different_inputs_are_separate_groups():
    x, cos, sin = projection_inputs(dim=16)
    mem = torch.randn_like(x)
    expected, got, optimized = run_both(TwoInputs(), (x, mem, cos, sin))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    assert r["matches"] == 2 and sorted(k.split(";")[0] for k in r["kernels"]) == [
        "nsa.projection_rope[reference] (1 projection -> 1 GEMM of 16 columns",
        "nsa.projection_rope[reference] (2 projections -> 1 GEMM of 32 columns"], r


class SharedUse(nn.Module):
    """wq's weight also used elsewhere (tied), and the raw k projection returned too."""

    def __init__(self, dim=16, D=8, late_weight=False):
        super().__init__()
        self.late_weight = late_weight
        self.wq, self.wk = nn.Linear(dim, 2 * D, bias=False), nn.Linear(dim, 2 * D, bias=True)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, 2, 8), cos, sin, "half")
        # a weight computed after the first projection cannot join its GEMM
        wk = self.wk.weight * 2 if self.late_weight else self.wk.weight
        k_raw = nn.functional.linear(x, wk, self.wk.bias)
        k = apply_rope(k_raw.view(B, S, 2, 8), cos, sin, "half")
        tied = self.wq.weight.sum()
        return torch.cat([q.flatten(2), k.flatten(2), k_raw], dim=-1) * tied


def test_a_tied_weight_and_a_raw_output_used_elsewhere():
    x, cos, sin = projection_inputs(dim=16)
    module = SharedUse()
    args = [x.clone().requires_grad_(), cos, sin]
    expected, got, optimized = run_both(module, args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(expected.square().sum(), [args[0], *module.parameters()])
    got_grads = torch.autograd.grad(got.square().sum(), [args[0], *optimized.parameters()])
    for a, b in zip(got_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    # merged with its bias; k rotated by the op, which also returns it unrotated for the cat
    assert r["matches"] == 1 and "(2 projections -> 1 GEMM of 32 columns; RoPE half r=8 on 2 of them; 1 also " \
        "returned unrotated (read before RoPE);" in r["kernels"][0], r["kernels"]
    assert r["reasons"] == []


class WithGate(nn.Module):
    """q, k (rotated, or not with rope=False) and v Linears and a gate of `gate` columns, all
    reading x; `fused`: the four as the pieces of one Linear, cut in order (fused_qkv_per_head's
    spelling)."""

    def __init__(self, gate: int, fused: bool = False, dim=32, H=4, G=2, D=16, rope=True):
        super().__init__()
        self.H, self.G, self.D, self.fused, self.rope = H, G, D, fused, rope
        self.widths = [H * D, G * D, G * D, gate]
        if fused:
            self.qkvg = nn.Linear(dim, sum(self.widths), bias=True)
        else:
            self.parts = nn.ModuleList(nn.Linear(dim, w, bias=True) for w in self.widths)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q, k, v, g = self.qkvg(x).split(self.widths, -1) if self.fused else [p(x) for p in self.parts]
        if self.rope:
            q = apply_rope(q.view(B, S, self.H, self.D), cos, sin, "half").flatten(2)
            k = apply_rope(k.view(B, S, self.G, self.D), cos, sin, "half").flatten(2)
        return torch.cat([q, k, v, g.sigmoid()], dim=-1)


@pytest.mark.parametrize("gate, fused", [(36, False), (36, True), (64, False)])
def test_a_projection_that_would_unalign_the_kernels_tiles_is_not_merged(gate, fused):
    """A gate of 36 columns beside q, k and v (64, 32, 32) would make every column tile of the op's
    Triton kernel masked (rope_triton.tiles_aligned): a whole Linear is left to its own GEMM (said in
    the reasons), a piece of a fused Linear gets an op of its own (two matches, no Linear left); a
    gate of 64 columns keeps the tiles aligned and is merged. Outputs and gradients equal eager's."""
    x, cos, sin = projection_inputs(dim=32, rot=16)
    module = WithGate(gate, fused)
    expected, got, optimized = run_both(module, (x, cos, sin))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    expected.square().sum().backward()
    eager_grads = [p.grad for p in module.parameters()]
    opt_grads = [p.grad for p in optimized.parameters()]
    for a, b in zip(opt_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    code = only_graph(optimized).code_after
    assert rope_op.rope_triton.tiles_aligned([64, 32, 32, 64], [16, 16, 0, 0], 8)
    assert not rope_op.rope_triton.tiles_aligned([64, 32, 32, 36], [16, 16, 0, 0], 8)
    if gate == 64:
        assert r["matches"] == 1 and r["kernels"][0].startswith(
            "nsa.projection_rope[reference] (4 projections -> 1 GEMM of 192 columns"), r
        assert "linear(" not in code
    elif not fused:
        assert r["matches"] == 1 and r["kernels"][0].startswith(
            "nsa.projection_rope[reference] (3 projections -> 1 GEMM of 128 columns"), r
        assert any("left to its own GEMM: its 36 columns fit no column tile" in t for t in r["reasons"]), r
        assert code.count("linear(") == 1  # the gate's own
    else:
        assert r["matches"] == 2 and r["kernels"][1].startswith(
            "nsa.projection_rope[reference] (1 projection -> 1 GEMM of 36 columns"), r
        assert "linear(" not in code


@pytest.mark.parametrize("gate, fused", [(36, False), (36, True), (40, False)])
def test_without_rope_a_projection_of_odd_width_is_not_merged(gate, fused):
    """No RoPE: one GEMM. A gate of 36 columns (not a multiple of 8) beside q, k and v would make
    the merged GEMM 164 columns, which cuBLAS multiplies in its unaligned kernels (the weight
    gradient 3x slower per FLOP on an H100): a whole Linear is left to its own GEMM with the
    reason; a gate of 40 columns is merged. The four as pieces of one Linear of 164 columns are
    already one GEMM, as the model wrote it: nothing to merge, left as it is. Outputs and gradients
    equal eager's."""
    x, cos, sin = projection_inputs(dim=32, rot=16)
    module = WithGate(gate, fused, rope=False)
    expected, got, optimized = run_both(module, (x, cos, sin))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    expected.square().sum().backward()
    for a, b in zip([p.grad for p in optimized.parameters()], [p.grad for p in module.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    code = only_graph(optimized).code_after
    if gate == 40:
        assert r["matches"] == 1 and r["kernels"][0].startswith(
            "nsa.projection_rope[reference] (4 projections -> 1 GEMM of 168 columns"), r
        assert "linear(" not in code and r["reasons"] == []
    elif not fused:
        assert r["matches"] == 1 and r["kernels"][0].startswith(
            "nsa.projection_rope[reference] (3 projections -> 1 GEMM of 128 columns"), r
        assert ("left to its own GEMM: its 36 columns are not a multiple of 8, and merged the GEMM's 164 columns "
                "would put the weight gradient on cuBLAS's unaligned kernels") in r["reasons"], r
        assert code.count("linear(") == 1  # the gate's own
    else:
        assert r["matches"] == 0 and code.count("linear(") == 1, r


def test_a_weight_computed_after_the_first_projection_is_left_out():
    x, cos, sin = projection_inputs(dim=16)
    expected, got, optimized = run_both(SharedUse(late_weight=True), (x, cos, sin))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    r = row(optimized, PASS)
    # q alone keeps its RoPE rewrite; k's projection stays eager
    assert r["matches"] == 1 and r["kernels"][0].startswith("nsa.projection_rope[reference] (1 projection"), r
    assert any(text.startswith("its wk is computed after the group's first projection") for text in r["reasons"])


# --- symbolic sizes (dynamic shapes) ---------------------------------------------------------------


def symbolic_records(model) -> list:
    """The compiled graphs of `model` with symbolic sizes (SymInt inputs: Dynamo's dynamic graphs)."""
    return [g for g in state_of(model).graphs if "torch.SymInt" in g.code_before]


def log_of(record, name: str = PASS):
    (log,) = [log for log in record.logs if log.pass_name == name]
    return log


def outputs_and_grads(module, args) -> tuple[torch.Tensor, list]:
    """The output and the gradients of x and of every parameter for the loss sum(out^2)."""
    x = args[0].clone().requires_grad_()
    out = module(x, *args[1:])
    return out.detach(), torch.autograd.grad(out.square().sum(), [x, *module.parameters()])


@pytest.mark.parametrize("dynamic, graphs", [(None, 2), (True, 1)], ids=["dynamic-after-a-change", "dynamic"])
def test_rope_fused_at_symbolic_sizes(dynamic, graphs):
    """One graph with S (and under dynamic=True B) as a symbol serves every length: the GEMMs
    merged and the RoPE fused in it (checked at the probe sizes), outputs and gradients equal to
    eager at each length, no recompile per length."""
    module = Projections()
    optimized = optimize_fresh(copy.deepcopy(module), ONLY.replace(dynamic=dynamic))
    for S in (11, 12, 13, 17, 30):
        args = projection_inputs(S=S)
        (want, want_grads), (got, got_grads) = outputs_and_grads(module, args), outputs_and_grads(optimized, args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(state_of(optimized).graphs) == graphs
    (record,) = symbolic_records(optimized)
    log = log_of(record)
    assert [m.kernel for m in log.matches] == [
        f"nsa.projection_rope[reference] (7 projections -> 1 GEMM of 128 columns; RoPE half r=8 on 4 of them"
        f"{NOT_TRITON})"] and log.refusals == []
    before, after = record.code_before, record.code_after
    assert before.count("torch._C._nn.linear(") == 7 and "torch._C._nn.linear(" not in after
    assert after.count("torch.ops.nsa.projection_rope(") == 1
    # the RoPE arithmetic is gone (x_rot * cos + rotated * sin, the sign flip) and the pieces' views
    # read their sizes from the op's output (sym_size), not numbers of the first call
    negation = re.compile(r"= -[a-z_]")
    assert " * " in before and negation.search(before) and " * " not in after and not negation.search(after)
    assert "torch.ops.aten.sym_size.int(" in after


def test_tiny_model_keeps_the_rewrite_at_varying_lengths():
    """The tiny reference model at four lengths (not multiples of its block sizes): the first
    compiles static, the others share one graph with S a symbol, where the pass fires once per
    layer with the RoPE fused; logits and every gradient equal eager's at each length."""
    torch.manual_seed(3)
    eager = build_model(preset("tiny", n_layers=1))
    config = ONLY.replace(disabled_passes=tuple(p for p in nsa_compile.pass_names() if p not in (PASS, "canonicalize")))
    optimized = optimize_fresh(copy.deepcopy(eager), config)
    for S in (40, 41, 45, 47):  # (past 48 the model itself recompiles: its top-n takes min(n, blocks))
        batch = tokens(1, S, seed=S)
        for model in (eager, optimized):
            model.zero_grad(set_to_none=True)
        want, got = eager(batch[:, :-1]), optimized(batch[:, :-1])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        want.square().mean().backward()
        got.square().mean().backward()
        for (name, a), b in zip(optimized.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert len(state_of(optimized).graphs) == 2
    (record,) = symbolic_records(optimized)
    log = log_of(record)
    assert [m.where for m in log.matches] == ["blocks.0.attn"] and log.refusals == []
    assert "(7 projections -> 1 GEMM of 256 columns; RoPE half r=16 on 4 of them" in log.matches[0].kernel
    assert record.code_after.count("torch.ops.nsa.projection_rope(") == 1


def test_a_rotation_at_one_residue_only_is_refused_at_symbolic_sizes():
    """Halves split at r/2 + S % 2: a rotation at even S, a wrong partner at odd S. The static
    graph (S = 12) fuses it; the symbolic one, first seen at S = 14, is checked at 14, 15 and 33
    too and refused (graph unchanged, eager's output at odd S) with the size where it fails."""
    module = OneRope("residue-split")
    optimized = optimize_fresh(copy.deepcopy(module), ONLY)
    for S in (12, 14, 15, 17):
        args = projection_inputs(dim=16, rot=6, S=S)
        torch.testing.assert_close(optimized(*args), module(*args), rtol=1e-5, atol=1e-5)
    static, symbolic = state_of(optimized).graphs
    assert len(log_of(static).matches) == 1 and "torch.SymInt" not in static.code_before
    log = log_of(symbolic)
    assert log.matches == [] and symbolic.code_after == symbolic.code_before and "% 2" in symbolic.code_before
    (refusal,) = log.refusals
    assert re.fullmatch(r"RoPE left eager: the arithmetic on the projection is not a RoPE rotation \(.*\) "
                        r"\(at s\d+=15; at s\d+=14: a half rotation r=6 of heads of 8 .*\)", refusal.reason), refusal


# --- under autocast (fp32 parameters, bf16 compute) ------------------------------------------------

CPU_BF16 = dict(device_type="cpu", dtype=torch.bfloat16)  # CPU autocast casts linear's inputs as CUDA's does


def step_under(model, inputs, is_lm, autocast):
    """(output, loss, {name: grad}) of one forward (with the loss) under `autocast`, and a backward
    outside it, as training code writes it."""
    model.zero_grad(set_to_none=True)
    with autocast:
        out, loss = loss_of(model, inputs, is_lm)
    loss.backward()
    return out.detach(), loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def autocast_parity_failures(eager, optimized, inputs, is_lm, device="cpu", eager_runs=1) -> list[dict]:
    """check_parity's bar for bf16, under bf16 autocast on `device`: the float64 model without
    autocast is the oracle; the optimized and the eager model, both fp32 under autocast, are
    measured against it; err(optimized) <= max(2 * err(eager), the bf16 floor) for the output, the
    loss and every gradient, err(eager) the largest of `eager_runs` runs (CUDA's eager backward is
    not deterministic). Returns the rows that miss it (a gradient None in one and not the other
    misses)."""
    autocast = dict(device_type=device, dtype=torch.bfloat16)
    oracle = step_under(copy.deepcopy(eager).double(), cast_inputs(inputs, torch.float64), is_lm,
                        contextlib.nullcontext())
    bases = [step_under(eager, inputs, is_lm, torch.autocast(**autocast)) for _ in range(eager_runs)]
    got = step_under(optimized, inputs, is_lm, torch.autocast(**autocast))
    rows = [("output", oracle[0], [b[0] for b in bases], got[0]), ("loss", oracle[1], [b[1] for b in bases], got[1])]
    rows += [(f"grad {name}", ref, [b[2][name] for b in bases], got[2].get(name)) for name, ref in oracle[2].items()]
    failures = []
    for name, ref, base, g in rows:
        if ref is None or g is None or any(b is None for b in base):
            if not (ref is None and g is None and all(b is None for b in base)):
                failures.append({"name": name, "missing": [x is None for x in (ref, *base, g)]})
            continue
        err_eager, err = max(relative_error(b, ref) for b in base), relative_error(g, ref)
        if err > max(2 * err_eager, FLOORS[torch.bfloat16]):
            failures.append({"name": name, "err_eager": err_eager, "err_optimized": err})
    return failures


def gemm_count(gm) -> int:
    return aten_count(gm, torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def test_tiny_model_under_autocast_fires_per_layer_with_parity_and_one_bf16_gemm_per_group():
    """The usual training setup: fp32 parameters, bf16 autocast around forward and loss. The
    linears see fp32 x and weights in Dynamo's graph and compute in bf16; the op gets autocast's
    casts explicitly and computes the same bf16 GEMM, once per layer instead of 7 times."""
    torch.manual_seed(1)
    eager = build_model("tiny")
    batch = (tokens(2, 37, seed=4),)
    optimized = optimize_fresh(copy.deepcopy(eager), ONLY)
    assert autocast_parity_failures(eager, optimized, batch, is_lm=True) == []
    r = row(optimized, PASS)
    assert (r["matches"], r["where"], r["refused"]) == (2, ["blocks.0.attn", "blocks.1.attn"], 0), r
    assert r["kernels"] == ["nsa.projection_rope[reference] (7 projections -> 1 GEMM of 256 columns in "
                            "torch.bfloat16 (autocast: the inputs cast to it); RoPE half r=16 on 4 of them"
                            f"{NOT_TRITON})"]
    record = only_graph(optimized)
    before, after = record.code_before, record.code_after
    assert before.count("torch._C._nn.linear(") - after.count("torch._C._nn.linear(") == 14
    # per layer: the 7 weights and x cast to bf16 in front of the op
    assert len(re.findall(r"torch_Tensor_to\(\w+_parameters_weight_, torch\.bfloat16\)", after)) == 14
    xs = re.findall(r"torch\.ops\.nsa\.projection_rope\((\w+), ", after)
    assert len(xs) == 2 and all(re.search(rf"^\s*{x} = torch_Tensor_to\(rms_norm\w*, torch\.bfloat16\)", after, re.M)
                                for x in xs)
    fwd, bwd = record.aten["forward"], record.aten["backward"]
    ops = [n for n in fwd.graph.nodes if n.op == "call_function" and n.target is torch.ops.nsa.projection_rope.default]
    assert len(ops) == 2 and aten_count(bwd, torch.ops.nsa.projection_rope_backward.default) == 2
    for op in ops:  # autocast left the inserted casts and the op as they are: one GEMM in bf16
        assert [op.args[i].meta["val"].dtype for i in (0, 1)] == [torch.bfloat16] * 2
        assert {v.dtype for v in op.meta["val"]} == {torch.bfloat16}
    assert gemms_reading_the_op_input(fwd) == []
    # the 14 separate mm's of the same model compiled without the pass are gone, nothing else
    baseline = optimize_fresh(copy.deepcopy(eager), ONLY.replace(disabled_passes=nsa_compile.pass_names()))
    with torch.autocast(**CPU_BF16):
        loss_of(baseline, batch, True)
    assert gemm_count(only_graph(baseline).aten["forward"]) - gemm_count(fwd) == 14


def test_an_autocast_region_inside_the_compiled_code_fires():
    """`with torch.autocast` inside forward: Dynamo records _enter_autocast / _exit_autocast
    nodes around the linear (no autocast around the call): the pass reads the region from them."""
    x, cos, sin = projection_inputs(dim=16, rot=6)
    expected, got, optimized = run_both(OneRope("autocast"), (x, cos, sin))
    assert "_enter_autocast" in only_graph(optimized).code_before
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    r = row(optimized, PASS)
    assert r["matches"] == 1 and r["kernels"][0].startswith(
        "nsa.projection_rope[reference] (1 projection -> 1 GEMM of 16 columns in torch.bfloat16 (autocast: the "
        "inputs cast to it); RoPE half r=6 on 1"), r


class MixedAutocast(nn.Module):
    """Projections of one fp32 input (k rotated), each in its own `with torch.autocast("cpu",
    enabled=...)` (no dtype given: the caller's bf16): those named in `off` with autocast
    disabled, computed in fp32; the others in bf16."""

    def __init__(self, names=("q", "k", "v", "u"), off=("v",), dim=16, D=8):
        super().__init__()
        self.names, self.off = names, off
        self.w = nn.ModuleDict({name: nn.Linear(dim, 2 * D, bias=False) for name in names})

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        outs = []
        for name in self.names:
            with torch.autocast("cpu", enabled=name not in self.off):
                y = self.w[name](x)
            if name == "k":
                y = apply_rope(y.view(B, S, 2, 8), cos, sin, "half").flatten(2)
            outs.append(y.float())
        return torch.cat(outs, dim=-1)


@pytest.mark.parametrize(
    "off, kernels",
    [
        (("v",), ["nsa.projection_rope[reference] (3 projections -> 1 GEMM of 48 columns in torch.bfloat16 "
                  "(autocast: the inputs cast to it); RoPE half r=8 on 1 of them"]),
        # the fp32 pair: its own group, no casts
        (("v", "u"), ["nsa.projection_rope[reference] (2 projections -> 1 GEMM of 32 columns in torch.bfloat16 "
                      "(autocast: the inputs cast to it); RoPE half r=8 on 1 of them",
                      "nsa.projection_rope[reference] (2 projections -> 1 GEMM of 32 columns; no RoPE"]),
    ],
    ids=["one-off", "two-off"],
)
def test_projections_with_autocast_disabled_are_not_merged_with_bf16_ones(off, kernels):
    """One GEMM computes in one dtype: the fp32 projections form their own group (fp32, no casts)
    or, alone there, stay eager with the reason; the bf16 ones merge with autocast's casts."""
    torch.manual_seed(5)
    eager = MixedAutocast(off=off)
    inputs = projection_inputs(dim=16)
    optimized = optimize_fresh(copy.deepcopy(eager), ONLY)
    assert autocast_parity_failures(eager, optimized, inputs, is_lm=False) == []
    r = row(optimized, PASS)
    assert len(r["kernels"]) == len(kernels), r
    assert all(got.startswith(want) for got, want in zip(sorted(r["kernels"]), sorted(kernels))), r
    lone = [text for text in r["reasons"] if "one GEMM computes in one dtype" in text]
    assert r["refused"] == len(lone) == (1 if off == ("v",) else 0), r
    if lone:
        assert lone[0].startswith("it computes in torch.float32, the other projections of l_x_ in torch.bfloat16")
    code = only_graph(optimized).code_after
    assert code.count("torch._C._nn.linear(") == (1 if off == ("v",) else 0)


def test_a_lone_bf16_and_a_lone_fp32_projection_of_one_input_are_refused_with_the_graph_unchanged():
    eager = MixedAutocast(names=("q", "v"), off=("v",))  # q alone in bf16, v alone in fp32
    x, cos, sin = projection_inputs(dim=16)
    with torch.autocast(**CPU_BF16):
        expected = eager(x, cos, sin)
        optimized = optimize_fresh(copy.deepcopy(eager), ONLY)
        got = optimized(x, cos, sin)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same eager code
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert (r["matches"], r["refused"]) == (0, 2) and sorted(r["reasons"]) == [
        f"it computes in torch.{a}, the other projections of l_x_ in torch.{b} (autocast on for some, off for "
        "others?): one GEMM computes in one dtype" for a, b in (("bfloat16", "float32"), ("float32", "bfloat16"))], r


def dynamo_graph(module, args, autocast) -> torch.fx.GraphModule:
    """The Dynamo (torch IR) graph of module(*args) traced under `autocast`, as the passes see it."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with autocast:
        torch.compile(module, backend=keep, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


@pytest.mark.parametrize(
    "autocast, reason",
    [
        (contextlib.nullcontext(), "outside any autocast region: the op computes in one"),
        (torch.autocast("cpu", dtype=torch.float16), "and returns torch.bfloat16 in an autocast region of torch.float16"),
        (torch.autocast("cpu", dtype=torch.bfloat16), None),
    ],
    ids=["no-autocast", "fp16-autocast", "bf16-autocast"],
)
def test_mixed_dtypes_are_taken_only_in_an_autocast_region_of_the_projections_dtype(autocast, reason):
    """The pass on a graph traced under bf16 autocast (fp32 in, bf16 out), run under another
    autocast state than the graph's: only autocast of that dtype explains the mixed dtypes."""
    module = Projections(shared_kv=True)
    gm = dynamo_graph(module, projection_inputs(), torch.autocast(**CPU_BF16))
    before = gm.code
    log = PassLog(PASS, 0)
    with autocast:
        PASS_OBJECT.apply(gm.graph, PassContext(nsa_compile.OptimizeConfig(), log))
    gm.graph.lint()
    if reason is None:
        assert len(log.matches) == 1 and not log.refusals
        assert "3 projections -> 1 GEMM of 64 columns in torch.bfloat16 (autocast" in log.matches[0].kernel
        gm.recompile()
        assert "torch.ops.nsa.projection_rope(" in gm.code and "torch._C._nn.linear(" not in gm.code
    else:
        assert not log.matches and len(log.refusals) == 3
        assert all(f.reason.startswith("the projection mixes dtypes ['torch.bfloat16', 'torch.float32'] ")
                   and reason in f.reason for f in log.refusals), log.refusals
        gm.recompile()
        assert gm.code == before


# --- the op -----------------------------------------------------------------------------------------------


def op_args(B=2, S=5, K=12, widths=(16, 8, 8), head_dims=(8, 8, 0), rot=4, bias=True, table_batch=None,
            dtype=torch.float32, device="cpu", seed=0, full=False):
    """The op's inputs; full: tables of one entry per rotated column [.., rot] (else per pair)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, K, generator=g)
    w = torch.randn(sum(widths), K, generator=g) / K**0.5
    b = torch.randn(sum(widths), generator=g) if bias else None
    if any(head_dims):
        F = rot if full else rot // 2
        shape = (S, F) if table_batch is None else (table_batch, S, F)
        cos, sin = torch.randn(shape, generator=g), torch.randn(shape, generator=g)  # any values: tables are inputs
    else:
        cos = sin = None
    move = lambda t: None if t is None else t.to(device)
    return [move(x).to(dtype), move(w).to(dtype), None if b is None else move(b).to(dtype), move(cos), move(sin),
            list(widths), list(head_dims)]


@pytest.mark.parametrize(
    "kwargs, style",
    [({}, "half"), ({"table_batch": 2, "bias": False, "head_dims": (4, 0, 4)}, "interleaved")],
    ids=["half-bias-partial", "interleaved-batch-tables-full"],
)
def test_opcheck(kwargs, style):
    x, w, b, cos, sin, widths, head_dims = op_args(**kwargs)
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_()
    torch.library.opcheck(torch.ops.nsa.projection_rope, (x, w, b, cos, sin, widths, head_dims, style, "reference"))
    grads = [torch.randn(*x.shape[:-1], n) for n in widths]
    torch.library.opcheck(torch.ops.nsa.projection_rope_backward,
                          (grads, cos, sin, head_dims, style, "reference"))


def eager_full_tables(x, w, b, cos, sin, widths, head_dims, style):
    """The op with full-width tables written as the models write RoPE, y * cos + rotate(y) * sin,
    per head of each rotated piece (autograd is the oracle of the backward)."""
    y = nn.functional.linear(x, w, b)
    outs, start = [], 0
    for width, D in zip(widths, head_dims):
        piece = y[..., start : start + width]
        start += width
        if D:
            B, S, _ = piece.shape
            h, R = piece.view(B, S, width // D, D), cos.shape[-1]
            c, s_ = ((t if t.dim() == 3 else t[None])[:, :, None] for t in (cos, sin))  # [Bt, S, 1, R]
            rot, rest = h[..., :R], h[..., R:]
            if style == "half":
                r1, r2 = rot.chunk(2, dim=-1)
                rotated = torch.cat([-r2, r1], dim=-1)
            else:
                r1, r2 = rot[..., 0::2], rot[..., 1::2]
                rotated = torch.stack([-r2, r1], dim=-1).flatten(-2)
            piece = torch.cat([rot * c + rotated * s_, rest], dim=-1).reshape(B, S, width)
        outs.append(piece)
    return outs


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("table_batch", [None, 2], ids=["tables-SR", "tables-BSR"])
def test_full_tables_reference_matches_the_eager_formula(style, table_batch):
    """full_tables: one entry per column, whatever the values (random: the entries of a pair differ)."""
    x, w, b, cos, sin, widths, head_dims = (t.double() if isinstance(t, torch.Tensor) else t for t in op_args(
        widths=(16, 12, 8), head_dims=(8, 6, 0), rot=4, table_batch=table_batch, full=True))
    leaves = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_()]
    got = rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, style, "reference", full_tables=True)
    want = eager_full_tables(x, w, b, cos, sin, widths, head_dims, style)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) for o in want]
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for a, e in zip(torch.autograd.grad(got, leaves, grads), torch.autograd.grad(want, leaves, grads)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # with the entries of each pair equal (cat([f, f]) / repeat_interleave(2)) they are the per-pair tables
    c, s_ = cos[..., :2], sin[..., :2]
    repeat = (lambda t: torch.cat([t, t], dim=-1)) if style == "half" else (lambda t: t.repeat_interleave(2, dim=-1))
    same = rope_op.projection_rope(x, w, b, repeat(c), repeat(s_), widths, head_dims, style, "reference",
                                   full_tables=True)
    for a, e in zip(same, rope_op.projection_rope(x, w, b, c, s_, widths, head_dims, style, "reference")):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_opcheck_full_tables():
    x, w, b, cos, sin, widths, head_dims = op_args(table_batch=2, full=True)
    for t in (x, w, b):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.nsa.projection_rope,
                          (x, w, b, cos, sin, widths, head_dims, "interleaved", "reference", True))
    grads = [torch.randn(*x.shape[:-1], n) for n in widths]
    torch.library.opcheck(torch.ops.nsa.projection_rope_backward,
                          (grads, cos, sin, head_dims, "half", "reference", True))


def eager_with_plain(x, w, b, cos, sin, widths, head_dims, style, plain):
    """The op's pieces written with torch ops (rotate), then the plain outputs: the projection's
    columns of the pieces in `plain` (autograd is the oracle of the backward)."""
    y = nn.functional.linear(x, w, b)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    pieces = [y[..., a : a + n] for a, n in zip(starts, widths)]
    return [rope_op.rotate(p, cos, sin, d, style) if d else p for p, d in zip(pieces, head_dims)] + \
        [pieces[i] for i in plain]


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_plain_outputs_reference_matches_the_eager_formula(style):
    """plain: the rotated pieces 0 and 1 also returned before their rotation; their gradients join
    the inverse rotation's in the backward (float64, exact up to rounding)."""
    x, w, b, cos, sin, widths, head_dims = (t.double() if isinstance(t, torch.Tensor) else t for t in op_args(
        widths=(16, 12, 8), head_dims=(8, 6, 0), rot=4, table_batch=2))
    leaves = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_()]
    got = rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, style, "reference", plain=[0, 1])
    want = eager_with_plain(x, w, b, cos, sin, widths, head_dims, style, [0, 1])
    assert [tuple(o.shape) for o in got] == [(2, 5, 16), (2, 5, 12), (2, 5, 8), (2, 5, 16), (2, 5, 12)]
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
             for i, o in enumerate(want)]
    for a, e in zip(torch.autograd.grad(got, leaves, grads, retain_graph=True),
                    torch.autograd.grad(want, leaves, grads, retain_graph=True)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # a plain output that gets no gradient contributes none
    only_rotated = torch.autograd.grad(got[:3], leaves, grads[:3])
    for a, e in zip(only_rotated, torch.autograd.grad(want[:3], leaves, grads[:3])):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_opcheck_plain_outputs():
    x, w, b, cos, sin, widths, head_dims = op_args(widths=(16, 8, 8), head_dims=(8, 0, 8))
    for t in (x, w, b):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.nsa.projection_rope,
                          (x, w, b, cos, sin, widths, head_dims, "half", "reference", False, [0, 2]))
    grads = [torch.randn(*x.shape[:-1], n) for n in (*widths, 16, 8)]
    torch.library.opcheck(torch.ops.nsa.projection_rope_backward,
                          (grads, cos, sin, head_dims, "half", "reference", False, [0, 2]))


def test_the_op_checks_its_arguments():
    x, w, b, cos, sin, widths, head_dims = op_args()
    with pytest.raises(ValueError, match="weight has 32 rows, the pieces 31"):
        rope_op.projection_rope(x, w, b, cos, sin, [16, 8, 7], head_dims)
    with pytest.raises(ValueError, match=r"piece 1 \(width 8, head dim 3\) must be whole heads"):
        rope_op.projection_rope(x, w, b, cos, sin, widths, [8, 3, 0])
    with pytest.raises(ValueError, match="unknown style 'full'"):
        rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, style="full")
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: device cpu"):
        rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, backend="triton")
    with pytest.raises(ValueError, match="full-width tables need an even rotary dim, got 3"):
        rope_op.projection_rope(x, w, b, cos[:, :1].repeat(1, 3), sin[:, :1].repeat(1, 3), widths, head_dims,
                                full_tables=True)
    plain_error = r"plain must list rotated pieces \(head_dims > 0\) in ascending order, once each; got "
    for plain in ([2], [1, 0], [0, 0], [3]):  # piece 2 is not rotated; not ascending; twice; no piece 3
        with pytest.raises(ValueError, match=plain_error + re.escape(str(plain))):
            rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, plain=plain)
    grads = [torch.randn(2, 5, n) for n in (*widths, 8)]
    with pytest.raises(ValueError, match="one gradient per output: 4 gradients for 3 pieces and 2 plain outputs"):
        torch.ops.nsa.projection_rope_backward(grads, cos, sin, head_dims, "half", "reference", False, [0, 1])
    with pytest.raises(ValueError, match=r"the gradient of plain output 0 \(piece 0\) is \(2, 5, 8\); piece 0 is 16 "
                                         "wide"):
        torch.ops.nsa.projection_rope_backward(grads, cos, sin, head_dims, "half", "reference", False, [0])


# --- the Triton kernels -------------------------------------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def interpreter():
    """On a machine without CUDA: TRITON_INTERPRET=1 for the kernel tests (the kernels are built
    for the mode Triton is in when they are launched)."""
    pytest.importorskip("triton")
    before = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if DEVICE == "cpu":
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def float64(args):
    return [t.double() if isinstance(t, torch.Tensor) else t for t in args]


TRITON_CASES = {
    # layout: (B, S, K, widths, head_dims, rot, bias, table_batch)
    "nsa-like-aligned": (2, 9, 32, (64, 32, 32, 32), (16, 16, 0, 16), 16, False, None),
    "partial-rotary": (2, 5, 24, (32, 16, 16), (16, 16, 0), 8, True, None),
    "odd-sizes": (1, 7, 40, (48, 24, 10), (24, 24, 0), 12, False, 1),
    "batch-tables": (2, 6, 20, (64, 64), (16, 0), 16, True, 2),
    "no-rotation": (3, 3, 20, (10, 7), (0, 0), 0, True, None),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "case, dtype, style, full",
    [("nsa-like-aligned", torch.float32, "half", False), ("nsa-like-aligned", torch.bfloat16, "half", False),
     ("nsa-like-aligned", torch.float16, "interleaved", False), ("partial-rotary", torch.bfloat16, "interleaved", False),
     ("partial-rotary", torch.float32, "half", False), ("odd-sizes", torch.float16, "half", False),
     ("odd-sizes", torch.float32, "interleaved", False), ("batch-tables", torch.bfloat16, "half", False),
     ("no-rotation", torch.float16, "half", False),
     # full-width tables (one entry per column, the entries of a pair different)
     ("nsa-like-aligned", torch.bfloat16, "half", True), ("nsa-like-aligned", torch.float32, "interleaved", True),
     ("partial-rotary", torch.float16, "interleaved", True), ("batch-tables", torch.float32, "half", True)],
    ids=lambda v: {True: "full-tables", False: "pair-tables"}.get(v, str(v).replace("torch.", "")),
)
def test_triton_forward_and_backward_match_float64(interpreter, case, dtype, style, full):
    triton_against_float64(case, dtype, style, full)


@pytest.mark.parametrize(
    "case, dtype, style, full, plain",
    [("nsa-like-aligned", torch.bfloat16, "half", False, [0, 3]),  # aligned tiles
     ("partial-rotary", torch.float16, "interleaved", False, [0, 1]),  # pass-through columns
     ("nsa-like-aligned", torch.float16, "interleaved", False, [0, 3]),  # pairs joined in registers
     ("odd-sizes", torch.float32, "half", True, [1])],  # masked columns, full-width tables
    ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, bool) else {True: "full", False: "pairs"}[v],
)
def test_triton_plain_outputs_match_float64(interpreter, case, dtype, style, full, plain):
    """plain: the kernel also stores the rotated pieces' accumulators before the rotation, and
    its backward adds their gradients to the inverse rotation."""
    triton_against_float64(case, dtype, style, full, plain)


def test_triton_reads_the_real_and_imaginary_views_of_a_complex_table(interpreter):
    """cos and sin as torch.real / torch.imag of one complex table (frequency stride 2, as
    projection_rope's pass gives them for view_as_complex RoPE): the triton backend copies them
    contiguous and gives the reference backend's outputs."""
    from nsa_compile.ops import rope_triton

    x, w, b, cos, sin, widths, head_dims = op_args(2, 9, 32, (64, 32, 32, 32), (16, 16, 0, 16), 16, False, None,
                                                   torch.float32, DEVICE)
    table = torch.complex(cos, sin)
    real, imag = torch.real(table), torch.imag(table)
    assert real.stride(-1) == 2
    read, _ = rope_triton._readable_tables(real, imag)
    assert read.stride(-1) == 1 and torch.equal(read, cos)
    got = rope_op.projection_rope(x, w, b, real, imag, widths, head_dims, style="interleaved", backend="triton")
    want = rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, style="interleaved", backend="reference")
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_interleaved_full_tables_are_read_as_contiguous_even_and_odd_columns():
    """Full-width interleaved tables: the triton backend reads the pair's entries (even columns)
    and the partner's (odd columns) as contiguous copies with one set of strides (read in place,
    at a frequency stride of 2, the kernels took over twice the time); rotate-half's stay views."""
    from nsa_compile.ops import rope_triton as rt

    cos, sin = torch.randn(1, 9, 16), torch.randn(1, 9, 16)
    c, s, c_b, s_b, r2 = rt._tables(cos, sin, "interleaved", True)
    assert r2 == 8 and all(t.is_contiguous() and t.stride() == c.stride() for t in (s, c_b, s_b))
    assert torch.equal(c, cos[..., 0::2]) and torch.equal(s_b, sin[..., 1::2])
    c, _, c_b, _, _ = rt._tables(cos, sin, "half", True)
    assert c.data_ptr() == cos.data_ptr() and torch.equal(c_b, cos[..., 8:])


def test_interleaved_pairs_are_joined_only_over_whole_heads_in_aligned_tiles():
    """JOINED (one store of a tile's consecutive columns) holds for the aligned interleaved case
    the tests above run, and not where pass-through columns or masked columns sit between pairs,
    nor for rotate-half."""
    from nsa_compile.ops import rope_triton as rt

    def joined(case, style="interleaved"):
        _, _, _, widths, head_dims, rot, _, _ = TRITON_CASES[case]
        return rt._joined_pairs(style, True, rt._layout(widths, head_dims, rot // 2))

    assert joined("nsa-like-aligned") and not joined("nsa-like-aligned", "half")
    assert not joined("partial-rotary") and not joined("odd-sizes")


def triton_against_float64(case: str, dtype, style: str, full: bool, plain=()) -> None:
    """The triton backend's outputs and the gradients of x, weight and bias against the
    reference backend in float64, within TOLERANCE."""
    B, S, K, widths, head_dims, rot, bias, table_batch = TRITON_CASES[case]
    args = op_args(B, S, K, widths, head_dims, rot, bias, table_batch, dtype, DEVICE, full=full)
    leaves = [t.requires_grad_() if t is not None and i < 3 else t for i, t in enumerate(args)]
    outs = rope_op.projection_rope(*leaves, style=style, backend="triton", full_tables=full, plain=plain)
    ref_leaves = [t.detach().double().requires_grad_() if t is not None and i < 3 else t for i, t in enumerate(args)]
    ref_leaves[3:5] = float64(args[3:5])
    refs = rope_op.projection_rope(*ref_leaves, style=style, backend="reference", full_tables=full, plain=plain)
    assert len(outs) == len(widths) + len(plain)
    tol = TOLERANCE[dtype]
    for o, ref in zip(outs, refs):
        assert o.dtype == dtype and o.is_contiguous() and o.shape == ref.shape
        assert rel_err(o, ref) < tol
    g = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE) for o in outs]
    got = torch.autograd.grad(outs, [t for t in leaves[:3] if t is not None], g)
    want = torch.autograd.grad(refs, [t for t in ref_leaves[:3] if t is not None], [x.double() for x in g])
    for a, b in zip(got, want):
        assert rel_err(a, b) < tol


def rel_err(x, ref) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm()).item()


def test_triton_writes_every_element(interpreter):
    """Outputs and dy filled with NaN first (torch.empty could hold zeros by luck): all overwritten."""
    from nsa_compile.ops import rope_triton

    args = op_args(2, 9, 32, (64, 32, 32, 32), (16, 16, 0, 16), 16, True, None, torch.float32, DEVICE)
    x, w, b, _, _, widths, head_dims = args
    cos, sin = rope_tables(9, 16, 10000.0, DEVICE)  # true angles: the inverse rotation undoes the rotation
    real_empty = torch.Tensor.new_empty

    def nan_empty(self, *size, **kw):
        t = real_empty(self, *size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.Tensor.new_empty = nan_empty
    try:
        outs = rope_triton.projection_rope_forward(x.reshape(-1, 32), w, b, cos, sin, widths, head_dims, "half", 9)
        dy = rope_triton.projection_rope_grad(outs, cos, sin, widths, head_dims, "half", 9)
        # with plain outputs of pieces 0 and 3 (the rotated ones), their gradients zero
        with_plain = rope_triton.projection_rope_forward(x.reshape(-1, 32), w, b, cos, sin, widths, head_dims, "half",
                                                         9, plain=[0, 3])
        zeros = [torch.zeros_like(o) for o in with_plain[4:]]
        dy_plain = rope_triton.projection_rope_grad(with_plain[:4] + zeros, cos, sin, widths, head_dims, "half", 9,
                                                    plain=[0, 3])
    finally:
        torch.Tensor.new_empty = real_empty
    assert not any(o.isnan().any() for o in outs + with_plain) and not dy.isnan().any() and not dy_plain.isnan().any()
    # the inverse rotation undoes the rotation: dy of the outputs is the unrotated projection
    y = torch.nn.functional.linear(x.reshape(-1, 32), w, b)
    torch.testing.assert_close(dy, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dy_plain, y, rtol=1e-5, atol=1e-5)
    # the plain outputs are the projection's columns of pieces 0 and 3; the pieces as without them
    torch.testing.assert_close(with_plain[4], y[:, :64], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_plain[5], y[:, 128:], rtol=1e-5, atol=1e-5)
    for a, e in zip(with_plain[:4], outs):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the kernel tests launch the compiled kernels")
@pytest.mark.parametrize("plain", [(), (0, 1)], ids=["no-plain", "plain"])
@pytest.mark.parametrize("joined", [False, True], ids=["pairs-apart", "pairs-joined"])
def test_the_kernels_compile_for_sm90_without_a_gpu(monkeypatch, plain, joined):
    """The compiled path (the interpreted tests here do not check what the compiler does, e.g. the
    branch on the tile's flag that stores and reads the plain outputs): both kernels built as on
    the GPU (TRITON_INTERPRET off) and compiled to PTX for an H100 by the Triton installed here,
    bf16, at lucidrains_per_head's seed layout (q 768 and k 128 rotated, v 128, gate 36)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nsa_compile.ops import rope_triton as rt

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    widths, head_dims = (768, 128, 128, 36), (64, 64, 0, 0)
    lay = rt._layout(widths, head_dims, 32)
    cfg = rt._config(torch.bfloat16, None)
    given = {"D": lay["D"], "R2": lay["R2"], "HT": lay["HT"], "NA": lay["NA"], "NP": lay["NP"], "JA": lay["JA"],
             "JP": lay["JP"], "HALF": False, "HAS_BIAS": False, "HAS_TABLE": True, "FULL": True,
             "NOUT": len(widths) + len(plain), "BK": cfg["fwd"]["BK"], "EVEN_K": True, "WIDE": False,
             "ALIGNED": lay["ALIGNED"], "PREC": "tf32", "UPCAST": False, "HAS_PLAIN": bool(plain),
             "JOINED": joined and rt._joined_pairs("interleaved", True, lay)}
    pointers = {"COS": "*fp32", "SIN": "*fp32", "COS_B": "*fp32", "SIN_B": "*fp32", "TILES": "*i32"} | {
        name: "*bf16" for name in ("X", "W", "BIAS", "DY", *(f"O{i}" for i in range(8)), *(f"G{i}" for i in range(8)))}
    for kernel, launch in ((rt.fwd_kernel, cfg["fwd"]), (rt.grad_kernel, cfg["bwd"])):
        fn = kernel.built()
        signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32") for p in fn.params}
        constexprs = {n: v for n, v in (given | {"BM": launch["BM"]}).items() if signature.get(n) == "constexpr"}
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={n: v for n, v in launch.items() if n.startswith("num_")})
        assert f".entry {kernel.__name__}(" in compiled.asm["ptx"]


# --- CUDA ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [100, 2048])
def test_triton_at_the_seed_shape_on_cuda(dtype, S):
    """The seed model's projections (dim 768, 12 heads, 2 KV groups, head dim 64, 7 projections)."""
    widths = (768, 128, 128, 128, 128, 128, 128)
    head_dims = (64, 64, 0, 64, 0, 64, 0)
    args = op_args(2, S, 768, widths, head_dims, 64, False, None, dtype, "cuda")
    x, w, b, cos, sin, widths, head_dims = args
    cos, sin = rope_tables(S, 64, 10000.0, "cuda")
    outs = rope_op.projection_rope(x, w, b, cos, sin, widths, head_dims, backend="triton")
    refs = rope_op.projection_rope(x.double(), w.double(), None, cos.double(), sin.double(), widths, head_dims,
                                   backend="reference")
    for o, ref in zip(outs, refs):
        assert rel_err(o, ref) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_seed_model_parity_on_cuda_with_the_pass():
    torch.manual_seed(0)
    eager = build_model("seed", n_layers=2).cuda()
    holder = {}

    def optimize(m):
        holder["model"] = optimize_fresh(m, ONLY)
        return holder["model"]

    report = check_parity(eager, optimize, tokens(2, 256, seed=1).cuda(), torch.bfloat16)
    assert report.ok, [r.as_dict() for r in report.failures()]
    r = row(holder["model"], PASS)
    assert r["matches"] == 2 and r["kernels"][0].startswith("nsa.projection_rope[triton] (7 projections"), r


@pytest.mark.gpu
def test_seed_model_under_cuda_autocast_with_the_pass():
    """The training setup of the end-to-end benchmark: fp32 parameters, bf16 autocast: the
    projections merge (2 layers), the Triton kernel runs on autocast's bf16 casts."""
    torch.manual_seed(0)
    eager = build_model("seed", n_layers=2).cuda()
    optimized = optimize_fresh(copy.deepcopy(eager), ONLY)
    failures = autocast_parity_failures(eager, optimized, (tokens(2, 256, seed=1).cuda(),), is_lm=True,
                                        device="cuda", eager_runs=3)
    assert failures == []
    r = row(optimized, PASS)
    assert r["matches"] == 2 and all(k.startswith("nsa.projection_rope[triton] (7 projections") and
                                     "in torch.bfloat16 (autocast" in k for k in r["kernels"]), r


@pytest.mark.inductor
def test_inductor_smoke_projections():
    torch.manual_seed(4)
    eager = Projections(shared_kv=True)  # q, k, v: three GEMMs in one (fewer kernels for the CPU compiler)
    holder = {}

    def with_inductor(m):
        torch._dynamo.reset()
        holder["model"] = nsa_compile.optimize(m, nsa_compile.OptimizeConfig(disabled_passes=ONLY.disabled_passes))
        return holder["model"]

    report = check_parity(eager, with_inductor, projection_inputs(), torch.float32, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert row(holder["model"], PASS)["matches"] == 1
