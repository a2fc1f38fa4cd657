"""Reliability: unknown and near-miss models, dynamic shapes, checkpoints, activation
checkpointing, bad input (malformed packed positions) and gradients that eager leaves None.
Every model runs eager and optimized (aot_eager: the same passes, AOTAutograd, eager execution)
and must give the same numbers; a few tests go through Inductor."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import FAST as ALL_PASSES
from helpers import GQA_ONLY as FAST, growing_float_expands, optimize_fresh, packed_positions, row, tokens
from reliability_models import (NEAR_MISSES, NO_NSA, REWRITTEN, CheckpointedGQA, HeadAndIds, TwoHeads, WindowedGQA,
                                qkv, randn)
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.backend import DynamicShapesWarning, _record_cache_hit, inputs_with_partial_grads
from nsa_compile.models import build_model, preset
from nsa_compile.models.lm import TinyLM
from nsa_compile.models.nsa import POSITIONS_ERROR
from nsa_compile.pass_manager import OptimizeState

PASS = "gqa_grouped_matmul"
KV_COPIES = 12  # tiny: 2 layers x 3 branches x (K, V)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (ARCHITECTURE.md's parity metric)."""
    x, ref = x.detach().double(), ref.detach().double()
    return (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref)).item()


def training_loss(model, batch):
    """(logits, next-token cross-entropy) of a TinyLM on tokens [B, S + 1]."""
    logits = model(batch[:, :-1])
    return logits, F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def forward_backward(module, inputs):
    """Outputs, and the gradients of sum(out**2) w.r.t. every float input and parameter."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = module(*inputs)
    leaves = [o for o in tree_leaves(out) if o.is_floating_point()]
    sum((o.double() ** 2).sum() for o in leaves).backward()
    grads = [x.grad for x in inputs if x.is_floating_point()] + [p.grad for p in module.parameters()]
    return [o.detach() for o in leaves], grads


def assert_same(got, expected, exact):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        if exact:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()


def run_case(case, config=FAST):
    torch.manual_seed(0)
    eager = case.make()
    optimized = optimize_fresh(copy.deepcopy(eager), config)
    for i in range(case.calls):
        inputs = case.inputs(i)
        expected = forward_backward(eager, inputs)
        got = forward_backward(optimized, inputs)
        # where no graph changed, the same ATen ops run: bit-for-bit
        exact = case.matches == 0
        assert_same(got[0], expected[0], exact)
        assert_same(got[1], expected[1], exact)
    assert_same(list(optimized.state_dict().values()), list(eager.state_dict().values()), exact=True)  # buffers
    return optimized


def check_record(optimized, case):
    r = row(optimized, PASS)
    assert (r["matches"], r["refused"]) == (case.matches, case.refused), r
    for reason in case.reasons:
        assert any(reason in text for text in r["reasons"]), (reason, r["reasons"])
    graphs = state_of(optimized).graphs
    assert len(graphs) == case.graphs
    if case.matches == 0:
        assert all(g.code_before == g.code_after for g in graphs)
    else:  # each rewrite removed exactly one K/V copy
        before = sum(g.code_before.count("repeat_interleave(") for g in graphs)
        after = sum(g.code_after.count("repeat_interleave(") for g in graphs)
        assert before - after == case.matches


# --- 1. unknown and near-miss models ------------------------------------------------------------


@pytest.mark.parametrize("case", NO_NSA, ids=lambda c: c.id)
def test_models_without_nsa_are_left_alone(case):
    check_record(run_case(case), case)


@pytest.mark.parametrize("case", REWRITTEN, ids=lambda c: c.id)
def test_gqa_variants_are_rewritten_exactly(case):
    check_record(run_case(case), case)


@pytest.mark.parametrize("case", NEAR_MISSES, ids=lambda c: c.id)
def test_near_misses_are_refused_with_graph_unchanged(case):
    check_record(run_case(case), case)


def test_symbolic_repeats_under_dynamic_shapes():
    """h = H // G from the shapes is a SymInt under dynamic=True: still rewritten, correct at
    every shape (it was refused as 'not a Python int' before)."""

    class ShapeDerivedGroups(nn.Module):
        def forward(self, q, k, v):
            h = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v

    optimized = optimize_fresh(ShapeDerivedGroups(), FAST.replace(dynamic=True))
    for B, G, h, S in [(2, 3, 3, 5), (3, 2, 4, 7), (4, 5, 2, 9)]:  # distinct sizes: no duck sizing
        inputs = qkv(B=B, G=G, h=h, S=S, Dv=6)
        assert_same([optimized(*inputs)], [ShapeDerivedGroups()(*inputs)], exact=False)
    (graph,) = state_of(optimized).graphs  # one symbolic graph served every shape
    assert "torch.SymInt" in graph.code_before
    assert (graph.logs[0].pass_name, len(graph.logs[0].matches)) == (PASS, 2)


def test_tiny_nsa_with_head_dim_320():
    """The GQA rewrite has no head-dim limit."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", head_dim=320))
    optimized = optimize_fresh(copy.deepcopy(eager), FAST)
    batch = tokens(1, 64, seed=1)
    _, loss_e = training_loss(eager, batch)
    _, loss_o = training_loss(optimized, batch)
    loss_e.backward()
    loss_o.backward()
    assert relative_error(loss_o, loss_e) < 1e-6
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert relative_error(q.grad, p.grad) < 1e-5, name
    r = row(optimized, PASS)
    assert r["matches"] == KV_COPIES and r["where"] == ["blocks.0.attn", "blocks.1.attn"]


# --- 2. dynamic shapes --------------------------------------------------------------------------


def test_training_with_changing_sequence_length_compiles_twice():
    torch.manual_seed(0)
    eager = build_model("tiny")
    optimized = optimize_fresh(copy.deepcopy(eager), FAST)
    counters.clear()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_o = torch.optim.AdamW(optimized.parameters(), lr=1e-3)
    for step, seq in enumerate([100, 64, 77, 120]):
        batch = tokens(2, seq, seed=step)
        results = []
        for model, opt in ((eager, opt_e), (optimized, opt_o)):
            logits, loss = training_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            results.append((logits.detach(), loss.detach()))
        (logits_e, loss_e), (logits_o, loss_o) = results
        assert relative_error(logits_o, logits_e) < 1e-5, (step, seq)
        assert torch.allclose(loss_o, loss_e, rtol=1e-5, atol=0), (step, seq)
        # static at the first length, one dynamic graph from the first change on
        assert len(state_of(optimized).graphs) == min(step + 1, 2)
    assert counters["stats"]["unique_graphs"] == 2
    static, dynamic = state_of(optimized).graphs
    assert "torch.SymInt" not in static.code_before and "torch.SymInt" in dynamic.code_before
    for record in (static, dynamic):
        (log,) = record.logs
        assert len(log.matches) == KV_COPIES
    assert row(optimized, PASS)["matches"] == 2 * KV_COPIES


# the passes that fire once per layer on the tiny LM
TINY_REWRITES = ("projection_rope", "window_attention", "compressed_attention", "select_blocks",
                 "selected_attention", "gated_combine")


def windowed_inputs(B, S):
    return randn(B, 4, S, 8, seed=1), randn(B, 2, S, 8, seed=2), randn(B, 2, S, 8, seed=3)


def test_symbolic_sizes_warn_once_naming_the_pass_and_reason():
    """dynamic=None: Dynamo compiles the second length with symbolic sizes, where the window pass
    finds the mask a different window at the probe sizes: optimize warns once per model (a third,
    batch-dynamic, compile does not warn again), naming the pass, where and why; the answers stay
    eager's."""
    eager = WindowedGQA()
    optimized = optimize_fresh(WindowedGQA(), ALL_PASSES)
    caught = []
    for B, S in [(2, 9), (2, 11), (3, 13)]:
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            got, expected = optimized(*windowed_inputs(B, S)), eager(*windowed_inputs(B, S))
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
        caught.append([w for w in found if issubclass(w.category, DynamicShapesWarning)])
    assert len(state_of(optimized).graphs) == 3  # static, then S dynamic, then B dynamic too
    assert [len(c) for c in caught] == [0, 1, 0]
    text = str(caught[1][0].message)
    assert re.search(r"\n  window_attention at <top>: [^\n]*(symbolic sizes|placeholder s\d+)", text), text
    assert "OptimizeConfig(dynamic=False)" in text
    (static, dynamic, _) = state_of(optimized).graphs
    assert [len(log.matches) for log in static.logs if log.pass_name == "window_attention"] == [1]
    assert [len(log.matches) for log in dynamic.logs if log.pass_name == "window_attention"] == [0]


def test_static_recompiles_keep_every_rewrite():
    """dynamic=False: each new length is a static recompile with every branch rewritten (one graph
    per length; S in {100, 101, 150, 200, 257, 1000, 2048} measured 7 graphs, all rewritten, where
    dynamic=None gives 2 graphs and eager branches from the second length on), no warning."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", n_layers=1))
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES.replace(dynamic=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicShapesWarning)
        for S in (40, 41, 64):
            batch = tokens(1, S, seed=S)
            assert relative_error(optimized.loss(batch), eager.loss(batch)) < 1e-6, S
    graphs = state_of(optimized).graphs
    assert len(graphs) == 3
    for record in graphs:
        assert "torch.SymInt" not in record.code_before
        assert {log.pass_name: len(log.matches) for log in record.logs if log.pass_name in TINY_REWRITES} == \
            dict.fromkeys(TINY_REWRITES, 1)


def test_changing_lengths_keep_every_rewrite_in_two_graphs():
    """Issue 19.2's target: S in {100, 101, 150, 200, 257, 1000, 2048} through one model under the
    default dynamic=None: a static graph at 100, then one graph with S a symbol for every later
    length (2 compiles), every branch rewritten in both (the passes check their candidates at the
    probe sizes 101, 102 and 120 there), no warning; the loss and every gradient match eager at
    each length."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", n_layers=1))
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicShapesWarning)
        for S in (100, 101, 150, 200, 257, 1000, 2048):
            batch = tokens(1, S, seed=S)
            losses = [model.loss(batch) for model in (eager, optimized)]
            grads = [torch.autograd.grad(loss, list(model.parameters()))
                     for loss, model in zip(losses, (eager, optimized))]
            assert relative_error(losses[1], losses[0]) < 1e-6, S
            for got, expected in zip(grads[1], grads[0]):
                assert relative_error(got, expected) < 1e-4, S
    static, dynamic = state_of(optimized).graphs
    assert "torch.SymInt" not in static.code_before and "torch.SymInt" in dynamic.code_before
    for record in (static, dynamic):
        assert {log.pass_name: len(log.matches) for log in record.logs if log.pass_name in TINY_REWRITES} == \
            dict.fromkeys(TINY_REWRITES, 1)


# --- 3. checkpoints -------------------------------------------------------------------------------


def train(model, opt, batches):
    losses = []
    for batch in batches:
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_state_equal(a: dict, b: dict):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_state_dict_round_trip_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    optimized = optimize_fresh(build_model("tiny"), FAST)
    train(optimized, torch.optim.AdamW(optimized.parameters(), lr=1e-2), [tokens(2, 40, seed=1)])
    torch.save(optimized.state_dict(), tmp_path / "optimized.pt")

    torch.manual_seed(1)  # different initial weights
    eager = build_model("tiny")
    eager.load_state_dict(torch.load(tmp_path / "optimized.pt"))
    assert_state_equal(eager.state_dict(), optimized.state_dict())

    # and back: eager weights into the compiled model, without a recompile
    with torch.no_grad():
        for p in eager.parameters():
            p.mul_(0.5)
    torch.save(eager.state_dict(), tmp_path / "eager.pt")
    optimized.load_state_dict(torch.load(tmp_path / "eager.pt"))
    assert_state_equal(optimized.state_dict(), eager.state_dict())
    batch = tokens(2, 40, seed=2)[:, :-1]
    assert relative_error(optimized(batch), eager(batch)) < 1e-5
    assert len(state_of(optimized).graphs) == 1


def test_resume_after_save_and_load_gives_the_same_losses(tmp_path):
    batches = [tokens(2, 40, seed=10 + i) for i in range(6)]
    torch.manual_seed(0)
    straight = optimize_fresh(build_model("tiny"), FAST)
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    losses = train(straight, opt, batches[:3])
    torch.save({"model": straight.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    # the optimizer's state is keyed and shaped as for the eager model
    eager = build_model("tiny")
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    train(eager, eager_opt, batches[:1])
    saved = opt.state_dict()
    assert saved["param_groups"] == eager_opt.state_dict()["param_groups"]
    for i, state in saved["state"].items():
        reference = eager_opt.state_dict()["state"][i]
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in reference.items()}
    losses += train(straight, opt, batches[3:])
    final = straight.state_dict()

    torch.manual_seed(123)
    resumed = build_model("tiny")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(ckpt["model"])
    resumed = optimize_fresh(resumed, FAST)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(ckpt["opt"])
    for i, state in resumed_opt.state_dict()["state"].items():
        assert_state_equal(state, ckpt["opt"]["state"][i])
    resumed_losses = train(resumed, resumed_opt, batches[3:])

    assert all(torch.equal(a, b) for a, b in zip(resumed_losses, losses[3:])), (resumed_losses, losses[3:])
    assert_state_equal(resumed.state_dict(), final)


# --- 4. activation checkpointing -----------------------------------------------------------------


class Checkpointed(nn.Module):
    """A TinyLM block run under torch.utils.checkpoint (non-reentrant)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return checkpoint(self.block, x, cos, sin, use_reentrant=False)


CHECKPOINTED_RECORDS = [6, 6, 0]  # matches in blocks.0's body, blocks.1's body, the top graph


def matches_per_record(model) -> list[int]:
    return [sum(len(log.matches) for log in record.logs) for record in state_of(model).graphs]


def checkpointed_tiny(seed=0) -> TinyLM:
    torch.manual_seed(seed)
    model = build_model("tiny")
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block)
    return model


def assert_loss_and_grads_match(eager, optimized, batch, bar=1e-5):
    _, loss_e = training_loss(eager, batch)
    _, loss_o = training_loss(optimized, batch)
    loss_e.backward()
    loss_o.backward()
    assert relative_error(loss_o, loss_e) < 1e-6
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert relative_error(q.grad, p.grad) < bar, name


def test_activation_checkpointing_keeps_the_rewrites():
    eager = checkpointed_tiny()
    optimized = optimize_fresh(copy.deepcopy(eager), FAST)
    assert_loss_and_grads_match(eager, optimized, tokens(2, 64, seed=4))
    r = row(optimized, PASS)
    assert r["matches"] == KV_COPIES
    assert r["where"] == ["blocks.0.block.attn", "blocks.1.block.attn"]
    # one record per graph, as Inductor's pre-grad stage makes them: each block's body, then the top
    assert matches_per_record(optimized) == CHECKPOINTED_RECORDS
    body, top = state_of(optimized).graphs[0], state_of(optimized).graphs[-1]
    assert body.code_before.count(".repeat_interleave(") == 8 and body.code_after.count(".repeat_interleave(") == 2
    assert top.code_after.count("tag_activation_checkpoint(") == 2  # still checkpointed
    # ATen forward: no K/V copy left, only the gate's [.., G, 1, 3] -> [.., G, h, 3] per layer
    expands = growing_float_expands(top.aten["forward"])
    assert len(expands) == 2 and all(dst[-1] == 3 for _, dst in expands), expands


def test_cache_hit_record_sees_subgraphs_and_leaves_the_graph_alone():
    """On an Inductor cache hit the backend runs the passes on a copy only to keep report()
    true: the copy must include the checkpoint bodies, and the original must stay as it was."""
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    inputs = qkv()
    torch.compile(CheckpointedGQA(), backend=capture)(*inputs)
    (gm,) = captured
    body = gm.get_submodule("wrap_body_0")
    code, body_code = gm.code, body.code
    state = OptimizeState.for_config(FAST)
    _record_cache_hit(gm, state)
    body_record, top_record = state.graphs
    assert body_record.from_cache and top_record.from_cache
    assert (len(body_record.logs[0].matches), len(top_record.logs[0].matches)) == (2, 0)
    assert (gm.code, body.code) == (code, body_code)
    assert gm.get_submodule("wrap_body_0") is body and "repeat_interleave" in body.code


@pytest.mark.inductor
def test_inductor_activation_checkpointing_parity():
    """The one Inductor test: the pre_grad hook reaches the checkpoint bodies, the records are
    those of aot_eager, and a second compile (served from Inductor's caches where they apply)
    reports the same."""
    eager = checkpointed_tiny(seed=3)
    for attempt in range(2):
        torch._dynamo.reset()
        optimized = nsa_compile.optimize(copy.deepcopy(eager), FAST.replace(compiler="inductor"))  # Inductor, GQA pass
        if attempt == 0:
            assert_loss_and_grads_match(eager, optimized, tokens(2, 64, seed=5))
        else:
            optimized.loss(tokens(2, 64, seed=5)).backward()
        assert matches_per_record(optimized) == CHECKPOINTED_RECORDS, attempt
        r = row(optimized, PASS)
        assert r["matches"] == KV_COPIES and r["where"] == ["blocks.0.block.attn", "blocks.1.block.attn"]


# --- 5. bad input -----------------------------------------------------------------------------------


def test_out_of_range_token_ids_raise_like_eager():
    torch.manual_seed(0)
    eager = build_model("tiny")
    optimized = optimize_fresh(copy.deepcopy(eager), FAST)
    good = tokens(2, 40, seed=1)[:, :-1]
    for bad_id in (eager.cfg.vocab_size, -1):
        bad = good.clone()
        bad[1, 7] = bad_id
        with pytest.raises((IndexError, RuntimeError)) as eager_error:
            eager(bad)
        with pytest.raises((IndexError, RuntimeError)) as optimized_error:
            optimized(bad)
        assert optimized_error.type is eager_error.type
    # the error left the compiled model working
    assert relative_error(optimized(good), eager(good)) < 1e-5


def test_nan_embedding_gives_nan_like_eager():
    torch.manual_seed(0)
    eager = build_model("tiny")
    batch = tokens(2, 40, seed=1)[:, :-1]
    poisoned = next(t for t in batch[1].tolist() if t not in batch[0].tolist())  # in sequence 1 only
    with torch.no_grad():
        eager.embed.weight[poisoned] = float("nan")
    optimized = optimize_fresh(copy.deepcopy(eager), FAST)
    expected, got = eager(batch), optimized(batch)
    assert expected[0].isfinite().all() and expected[1].isnan().any()
    assert torch.equal(got.isnan(), expected.isnan())  # NaN exactly where eager has it, nowhere else
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


# Packed positions eager refuses with ValueError; the optimized model checks them in its graph
# (torch._assert_async: RuntimeError with the same message, raised where the check runs).
S_PACKED = 40
GOOD_POSITIONS = packed_positions([[13, 27], [S_PACKED]])


def _bumped(pos, value, at=(0, 20)):
    bad = pos.clone()
    bad[at] = value
    return bad


def _past_the_end(pos):
    bad = pos.clone()
    bad[0, 20:] += 1000  # counts up by one, from 1007: indexes the RoPE tables out of bounds
    return bad


MALFORMED_POSITIONS = {
    "past S": _past_the_end,
    "-1": lambda pos: _bumped(pos, -1),
    "shuffled": lambda pos: pos[:, torch.randperm(S_PACKED, generator=torch.Generator().manual_seed(0))],
    "reversed": lambda pos: pos.flip(1),
    "first not 0": lambda pos: _bumped(pos, 3, at=(1, 0)),
    "a step of 2": lambda pos: _bumped(pos, 9),
}


@pytest.fixture(scope="module")
def packed_models():
    """(eager, optimized, tokens [2, 40], eager's logits) of the packed tiny LM, compiled once
    (aot_eager, every pass) on the good positions."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", n_layers=1))
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES)
    batch = tokens(2, S_PACKED, seed=3)[:, :-1]
    expected = eager(batch, GOOD_POSITIONS)
    assert relative_error(optimized(batch, GOOD_POSITIONS), expected) < 1e-5
    return eager, optimized, batch, expected


@pytest.mark.parametrize("case", list(MALFORMED_POSITIONS))
def test_malformed_positions_raise_under_optimize(packed_models, case):
    eager, optimized, batch, expected = packed_models
    bad = MALFORMED_POSITIONS[case](GOOD_POSITIONS)
    with pytest.raises(ValueError, match=re.escape(POSITIONS_ERROR)):
        eager(batch, bad)
    graphs = len(state_of(optimized).graphs)
    with pytest.raises(RuntimeError, match=re.escape(POSITIONS_ERROR)):
        optimized(batch, bad)
    assert len(state_of(optimized).graphs) == graphs  # checked inside the compiled graph
    assert relative_error(optimized(batch, GOOD_POSITIONS), expected) < 1e-5  # and it still works


def test_position_check_is_one_device_assert_without_a_sync(packed_models):
    """The values are checked by one aten._assert_async in the compiled forward: no graph break
    (one graph), no read back to the host (no _local_scalar_dense, no .item())."""
    _, optimized, _, _ = packed_models
    (record,) = state_of(optimized).graphs
    assert record.code_before.count("torch._assert_async(") == 1
    forward = record.aten["forward"].code
    assert forward.count("torch.ops.aten._assert_async.msg(") == 1
    assert "_local_scalar_dense" not in forward


def test_int32_positions_raise_and_the_model_stays_compiled():
    """A dtype is known while tracing: ValueError, as eager. The error is raised by eager code
    after a graph break, so Dynamo does not give up on the frame: a later length still compiles
    with every rewrite."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", n_layers=1))
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES.replace(dynamic=False))
    batch = tokens(2, S_PACKED, seed=3)[:, :-1]
    optimized(batch, GOOD_POSITIONS)
    for model in (eager, optimized):
        with pytest.raises(ValueError, match=re.escape(f"pos must be int64 [B, {S_PACKED}], got torch.int32")):
            model(batch, GOOD_POSITIONS.int())
    with pytest.raises(ValueError, match="pos must be int64"):
        optimized(batch, GOOD_POSITIONS[0])  # 1-D
    longer = tokens(1, 48, seed=4)[:, :-1]
    pos = packed_positions([[20, 28]])
    assert relative_error(optimized(longer, pos), eager(longer, pos)) < 1e-5
    last = state_of(optimized).graphs[-1]
    assert {log.pass_name: len(log.matches) for log in last.logs if log.pass_name in TINY_REWRITES} == \
        dict.fromkeys(TINY_REWRITES, 1)


@pytest.mark.inductor
def test_inductor_malformed_positions_raise():
    """Through Inductor's CPU code (where a position past S aborted the process from generated
    code before): each malformed case raises RuntimeError with eager's message."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", n_layers=1))
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES.replace(compiler="inductor"))
    batch = tokens(2, S_PACKED, seed=3)[:, :-1]
    expected = eager(batch, GOOD_POSITIONS)
    assert relative_error(optimized(batch, GOOD_POSITIONS), expected) < 1e-5
    for make in MALFORMED_POSITIONS.values():
        with pytest.raises(RuntimeError, match=re.escape(POSITIONS_ERROR)):
            optimized(batch, make(GOOD_POSITIONS))
    with pytest.raises(ValueError, match="pos must be int64"):
        optimized(batch, GOOD_POSITIONS.int())
    assert relative_error(optimized(batch, GOOD_POSITIONS), expected) < 1e-5


def test_bad_arguments_raise_clear_type_errors():
    model = build_model("tiny")
    with pytest.raises(TypeError, match="an nn.Module instance, not the class TinyLM"):
        nsa_compile.optimize(TinyLM)
    with pytest.raises(TypeError, match="config must be an OptimizeConfig, not type"):
        nsa_compile.optimize(model, nsa_compile.OptimizeConfig)
    with pytest.raises(TypeError, match="config must be an OptimizeConfig, not str"):
        nsa_compile.optimize(model, "aot_eager")
    # torch.compile would take fullgraph='no' as True, and fail on dynamic='yes' at the first call
    with pytest.raises(TypeError, match="fullgraph must be a bool, not str"):
        FAST.replace(fullgraph="no")
    with pytest.raises(TypeError, match="dynamic must be None, True or False, not str"):
        FAST.replace(dynamic="yes")
    with pytest.raises(TypeError, match="disabled_passes is a tuple of pass names"):
        FAST.replace(disabled_passes=None)
    with pytest.raises(TypeError, match="nn.Module passed to nsa_compile.optimize"):
        nsa_compile.report("model")
    with pytest.raises(ValueError, match="not passed through nsa_compile.optimize"):
        state_of(model)  # nothing was half-done


# --- 6. gradients that eager leaves None ------------------------------------------------------------


def test_partial_gradient_inputs_are_found_from_the_traced_graph():
    """Which inputs' gradients come from some outputs only: head_a's from output 0, head_b's from
    output 1, the trunk's from both (left alone); a Linear that feeds only argmax from none (an
    integer output is no gradient path); a single output (a language model) needs nothing."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for module in (TwoHeads(), HeadAndIds(), nn.Linear(8, 8)):
        torch._dynamo.reset()
        torch.compile(module, backend=capture)(randn(2, 8))
    names = [[n.name for n in gm.graph.find_nodes(op="placeholder")] for gm in graphs]
    found = [{names[k][i]: set(outputs) for i, outputs in inputs_with_partial_grads(gm).items()}
             for k, gm in enumerate(graphs)]
    assert found[0] == {f"l_self_modules_head_{h}_parameters_{p}_": {j} for h, j in (("a", 0), ("b", 1))
                        for p in ("weight", "bias")}
    assert found[1] == {f"l_self_modules_ids_parameters_{p}_": set() for p in ("weight", "bias")}
    assert found[2] == {}


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_gradient_eager_leaves_none_stays_none(compiler):
    """A loss of one output: eager leaves the other head's .grad None, so AdamW (weight decay)
    leaves that head alone; plain torch.compile gives it zeros and decays it. optimize matches
    eager: None, the same weights after the step; a loss of both outputs then reaches it."""
    torch.manual_seed(0)
    eager = TwoHeads()
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES.replace(compiler=compiler))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (eager, optimized)]
    before = copy.deepcopy(eager.head_b.state_dict())
    x = randn(4, 8, seed=5)
    for model, opt in zip((eager, optimized), optimizers):
        model(x)[0].square().mean().backward()
        assert model.head_b.weight.grad is None and model.head_b.bias.grad is None
        assert model.head_a.weight.grad is not None and model.trunk.weight.grad is not None
        opt.step()
        opt.zero_grad()
    assert_state_equal(optimized.head_b.state_dict(), before)
    assert_state_equal(eager.head_b.state_dict(), before)
    for p, q in zip(eager.parameters(), optimized.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    # both outputs, then the second alone: each backward decides for itself
    for model in (eager, optimized):
        a, b = model(x)
        (a.sum() + b.sum()).backward()
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grad()
        a, b = model(x)
        b.sum().backward()
        assert [p.grad is None for p in model.parameters()] == [False, False, True, True, False, False]
        model.zero_grad()


def test_gradient_accumulation_over_calls_reaching_different_outputs():
    """Two forwards, one backward of both losses: call 1's loss reads output 0, call 2's output 1;
    every parameter is reached by one call and gets eager's gradient."""
    torch.manual_seed(0)
    eager = TwoHeads()
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES)
    for model in (eager, optimized):
        loss = model(randn(4, 8, seed=6))[0].sum() + model(randn(4, 8, seed=7))[1].square().sum()
        loss.backward()
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert q.grad is not None and torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-6), name


def test_parameter_feeding_only_argmax_keeps_a_none_gradient():
    """A Linear computed for its argmax has no gradient path: eager leaves its .grad None (plain
    torch.compile gives zeros); optimize gives None too, and the other head its gradient."""
    torch.manual_seed(0)
    eager = HeadAndIds()
    optimized = optimize_fresh(copy.deepcopy(eager), ALL_PASSES)
    for model in (eager, optimized):
        out, ids = model(randn(4, 8, seed=9))
        assert ids.dtype == torch.int64
        out.sum().backward()
        assert model.ids.weight.grad is None and model.ids.bias.grad is None and model.head.weight.grad is not None
