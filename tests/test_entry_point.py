"""torch.compile(model, backend="nsa"): the entry point PyTorch discovers, its options, report()."""

from __future__ import annotations

import pytest
import torch

import nsa_compile
from nsa_compile import entry_point
from nsa_compile.models import build_model

from helpers import tokens


@pytest.fixture
def fresh_backend_records(monkeypatch):
    """Each test sees only its own backend="nsa" compiles."""
    monkeypatch.setattr(entry_point, "_STATES", {})
    torch._dynamo.reset()


def test_backend_is_found_by_name_through_the_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("nsa") is entry_point.nsa


def test_backend_by_name_rewrites_and_matches_eager(fresh_backend_records):
    torch.manual_seed(0)
    model = build_model("tiny")
    batch = tokens(1, 40)
    expected = model(batch[:, :-1])
    compiled = torch.compile(model, backend="nsa", options={"compiler": "aot_eager"})
    out = compiled(batch[:, :-1])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    rows = {r["name"]: r for r in nsa_compile.report()}
    assert rows["window_attention"]["matches"] == 2
    assert rows["selected_attention"]["matches"] == 2
    assert rows["window_attention"]["where"] == ["blocks.0.attn", "blocks.1.attn"]


def test_report_without_a_model_before_any_backend_compile(fresh_backend_records):
    with pytest.raises(ValueError, match="none ran in this process yet"):
        nsa_compile.report()


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"compilr": "eager"}, ValueError, "unknown option.*'compilr'.*valid: compiler"),
        ({"fullgraph": True}, ValueError, "pass fullgraph to torch.compile itself"),
        ({"compiler": "gcc"}, ValueError, "unknown compiler 'gcc'"),
        ("eager", TypeError, "dict of OptimizeConfig fields"),
    ],
)
def test_bad_options_raise_with_the_valid_names(fresh_backend_records, options, error, match):
    with pytest.raises(error, match=match):
        entry_point._config_from(options)
