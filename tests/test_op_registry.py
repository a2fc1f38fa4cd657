"""The op registry (nsa_compile/ops/registry.py): every custom op declared once, with its schema
and backends; the config, the determinism rule, the backend choice and `explain` read it, so a
backend added in one place is chosen, configured, compiled and explained."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import optimize_fresh, row, tokens

import nsa_compile
from nsa_compile import explain
from nsa_compile.api import state_of
from nsa_compile.models import build_model
from nsa_compile.ops import registry, window

FAST = nsa_compile.OptimizeConfig(compiler="aot_eager")
WINDOW_TINY = "nsa.window_attention[{}] (w=32, GQA-native, no S x S tensor{})"

# the schemas the compiled graphs, the passes and the tests call (as they were before the registry)
SCHEMAS = {
    "projection_rope": "nsa::projection_rope(Tensor x, Tensor weight, Tensor? bias, Tensor? cos, Tensor? sin, "
                       'SymInt[] widths, SymInt[] head_dims, str style, str backend="auto", bool full_tables=False, '
                       "int[] plain=[]) -> Tensor[]",
    "projection_rope_backward": "nsa::projection_rope_backward(Tensor[] grads, Tensor? cos, Tensor? sin, "
                                'SymInt[] head_dims, str style, str backend="auto", bool full_tables=False, '
                                "int[] plain=[]) -> Tensor",
    "window_attention": "nsa::window_attention(Tensor q, Tensor k, Tensor v, SymInt window, float scale, "
                        'str backend="auto", Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor)',
    "window_attention_backward": "nsa::window_attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, "
                                 'Tensor o, Tensor lse, SymInt window, float scale, str backend="auto", '
                                 "Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor, Tensor)",
    "compressed_attention": "nsa::compressed_attention(Tensor q, Tensor k, Tensor v, SymInt block, SymInt stride, "
                            'float scale, str backend="auto", Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor)',
    "compressed_attention_backward": "nsa::compressed_attention_backward(Tensor grad_o, Tensor q, Tensor k, "
                                     "Tensor v, Tensor o, Tensor lse, SymInt block, SymInt stride, float scale, "
                                     'str backend="auto", Tensor? pos=None, int q_offset=0) -> (Tensor, Tensor, '
                                     "Tensor)",
    "select_blocks": "nsa::select_blocks(Tensor q, Tensor k, Tensor? lse, SymInt cmp_block, SymInt cmp_stride, "
                     'SymInt sel_block, SymInt n_selected, float scale, str backend="auto", Tensor? pos=None, '
                     'str rule="nsa", ScalarType? importance_dtype=None, ScalarType? group_sum_dtype=None, '
                     "int q_offset=0, bool group_first=False) -> Tensor",
    "selected_attention": "nsa::selected_attention(Tensor q, Tensor k, Tensor v, Tensor block_idx, "
                          'SymInt block_size, float scale, str backend="auto", Tensor? pos=None, int q_offset=0, '
                          "int doc_len=0) -> (Tensor, Tensor)",
    "selected_attention_backward": "nsa::selected_attention_backward(Tensor grad_o, Tensor q, Tensor k, Tensor v, "
                                   "Tensor o, Tensor lse, Tensor block_idx, SymInt block_size, float scale, "
                                   'str backend="auto", Tensor? pos=None, int q_offset=0, int doc_len=0) '
                                   "-> (Tensor, Tensor, Tensor)",
    "gated_combine": "nsa::gated_combine(Tensor gate_in, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, "
                     "Tensor o_cmp, Tensor o_sel, Tensor o_win, str activation, str normalize, "
                     'str backend="auto") -> (Tensor, Tensor)',
    "gated_combine_backward": "nsa::gated_combine_backward(Tensor grad_o, Tensor gate_in, Tensor? w1, Tensor? b1, "
                              "Tensor? w2, Tensor? b2, Tensor o_cmp, Tensor o_sel, Tensor o_win, Tensor gates, "
                              'str activation, str normalize, str backend="auto") -> (Tensor, Tensor, Tensor, '
                              "Tensor, Tensor, Tensor, Tensor, Tensor)",
}


def qkv(S=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, S, 8, generator=g) for heads in (4, 2, 2))


# --- the declarations ------------------------------------------------------------------------------


def test_every_op_is_declared_once_with_its_schema_backends_and_config_field():
    ops = registry.ops()
    assert [op.name for op in ops] == ["projection_rope", "window_attention", "compressed_attention",
                                       "select_blocks", "selected_attention", "gated_combine"]
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.nsa, name).default._schema) == schema
    assert [op.backward_op is not None for op in ops] == [True, True, True, False, True, True]
    # one config field per op, and no backend field without an op
    fields = {f.name for f in dataclasses.fields(nsa_compile.OptimizeConfig) if f.name.endswith("_backend")}
    assert {op.config_field for op in ops} == fields and len(fields) == len(ops)
    config = nsa_compile.OptimizeConfig(projection_rope_backend="reference")
    assert [config.backend(op.name) for op in ops] == ["reference"] + ["auto"] * 5
    with pytest.raises(ValueError, match="no op named 'window'; declared: projection_rope, window_attention"):
        config.backend("window")
    # auto's last backend runs everything, deterministically
    for op in ops:
        last = op.backends[-1]
        assert (last.name, last.cannot_run(), last.nondeterministic) == ("reference", None, None)


def test_the_determinism_rule_reads_the_declarations():
    breakers = {(op.name, b.name): b.nondeterministic for op in registry.ops() for b in op.backends
                if b.nondeterministic}
    assert sorted(breakers) == [("selected_attention", "varlen"), ("selected_attention", "varlen_flash_attn"),
                                ("window_attention", "flash")]
    # 'auto' changes under deterministic=True only where it could take one of them (varlen: only by name)
    assert {op.name: op.deterministic_auto() for op in registry.ops()} == {
        "projection_rope": None, "window_attention": "reference", "compressed_attention": None,
        "select_blocks": None, "selected_attention": None, "gated_combine": None}
    strict = nsa_compile.OptimizeConfig(deterministic=True)
    assert [strict.backend(op.name) for op in registry.ops()] == ["auto", "reference", "auto", "auto", "auto", "auto"]


# --- a backend added in one place --------------------------------------------------------------------


def toy_backend(op: str, calls: list, **changes) -> registry.Backend:
    """A backend named 'toy' that runs `op`'s reference code and records each call."""
    reference = registry.get(op).backend("reference")

    def forward(*args):
        calls.append("forward")
        return reference.forward(*args)

    def backward(*args):
        calls.append("backward")
        return reference.backward(*args)

    return registry.Backend("toy", forward=forward, backward=backward, **changes)


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return build_model("tiny"), tokens(2, 64, seed=1)


def test_an_added_backend_is_chosen_configured_compiled_and_explained(tiny):
    eager, batch = tiny
    calls = []
    registry.add_backend("window_attention", toy_backend("window_attention", calls), first=True)
    try:
        q, k, v = qkv()
        # named, and first in auto's order where it can run
        assert window.choose_backend(q, k, v, "toy") == window.choose_backend(q, k, v) == "toy"
        assert registry.get("window_attention").backend_names() == ("auto", "toy", "triton", "flash", "reference")
        config = FAST.replace(window_attention_backend="toy")
        assert "('window_attention', ['toy', 'triton', 'flash', 'reference'])" in FAST.cache_key()  # auto's order
        (listed,) = [r for r in explain.backend_table(config) if r["op"] == "window_attention"]
        assert (listed["asked"], listed["auto_order"]) == ("toy", ["toy", "triton", "flash", "reference"])
        # the pass writes it into the graph, the compiled model runs it forward and backward
        model = optimize_fresh(copy.deepcopy(eager), config)
        loss = model.loss(batch)
        loss.backward()
        assert sorted(calls) == ["backward"] * 2 + ["forward"] * 2  # two layers
        r = row(model, "window_attention")
        assert (r["matches"], r["kernels"]) == (2, [WINDOW_TINY.format("toy", "")])
        expected = eager.loss(batch)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    finally:
        registry.remove_backend("window_attention", "toy")
    assert "toy" not in registry.get("window_attention").backend_names()
    with pytest.raises(ValueError, match="unknown window_attention_backend 'toy'; valid: auto, triton, flash, reference"):
        nsa_compile.OptimizeConfig(window_attention_backend="toy")


def test_an_added_backend_that_cannot_run_is_refused_by_name_and_passed_over_by_auto(tiny):
    eager, batch = tiny
    calls = []
    never = toy_backend("window_attention", calls, cannot_run=lambda q, k, v, pos: "the toy runs nothing")
    registry.add_backend("window_attention", never, first=True)
    try:
        q, k, v = qkv()
        with pytest.raises(ValueError, match="window_attention: backend 'toy' cannot run these inputs: the toy runs"):
            window.choose_backend(q, k, v, "toy")
        assert window.choose_backend(q, k, v) == "reference"
        # named: each window left eager, the reason in explain's near misses; the graph keeps no op
        named = optimize_fresh(copy.deepcopy(eager), FAST.replace(window_attention_backend="toy"))
        torch.testing.assert_close(named.loss(batch), eager.loss(batch), rtol=1e-5, atol=1e-6)
        assert row(named, "window_attention")["matches"] == 0
        reason = "OptimizeConfig(window_attention_backend='toy'): window_attention: backend 'toy' cannot run these inputs: " \
                 "the toy runs nothing"
        assert [m["where"] for m in explain.near_misses(named) if m["reason"] == reason] == \
            ["blocks.0.attn", "blocks.1.attn"]
        assert "nsa.window_attention" not in "".join(g.code_after for g in state_of(named).graphs)
        # auto: the reference, and explain says why not the toy first
        auto = optimize_fresh(copy.deepcopy(eager), FAST)
        torch.testing.assert_close(auto.loss(batch), eager.loss(batch), rtol=1e-5, atol=1e-6)
        why = ("; not toy: the toy runs nothing; not triton: the Triton kernels run on CUDA (tensors on cpu); "
               "not flash: FA-2 runs on CUDA only (tensors on cpu)")
        assert row(auto, "window_attention")["kernels"] == [WINDOW_TINY.format("reference", why)]
        assert calls == []
    finally:
        registry.remove_backend("window_attention", "toy")


def test_an_added_backend_that_is_not_deterministic_follows_the_determinism_rule():
    registry.add_backend("compressed_attention", toy_backend("compressed_attention", [], nondeterministic="atomics"))
    try:
        assert registry.get("compressed_attention").backend_names() == ("auto", "triton", "toy", "reference")
        assert nsa_compile.OptimizeConfig(deterministic=True).compressed_attention_backend == "reference"
        with pytest.raises(ValueError, match="compressed_attention_backend='toy' with deterministic=True: atomics"):
            nsa_compile.OptimizeConfig(deterministic=True, compressed_attention_backend="toy")
    finally:
        registry.remove_backend("compressed_attention", "toy")
    assert nsa_compile.OptimizeConfig(deterministic=True).compressed_attention_backend == "auto"


def test_the_registry_refuses_clashes():
    reference = registry.get("window_attention").backend("reference")
    with pytest.raises(ValueError, match="window_attention: a backend named 'flash' is already registered"):
        registry.add_backend("window_attention", dataclasses.replace(reference, name="flash"))
    with pytest.raises(ValueError, match="'reference' is a built-in backend"):
        registry.remove_backend("window_attention", "reference")
    with pytest.raises(ValueError, match="window_attention: unknown backend 'toy'"):
        registry.remove_backend("window_attention", "toy")
    with pytest.raises(ValueError, match="an op named 'window_attention' is already declared"):
        registry.declare(registry.get("window_attention"))
    assert registry.get("window_attention").backend_names() == ("auto", "triton", "flash", "reference")
