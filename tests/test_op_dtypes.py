"""tools/op_dtypes.py: the dtypes every NSA op receives under autocast, for the corpus models.

Under CPU bf16 autocast every activation an op receives (q, k, v, x, gate_in, the branch outputs)
is bf16 for every corpus model, as eager computes in bf16 there. On the commits before the
sixteenth session's fixes this test fails for paper_bhsd (gate_in) and chunked_queries (the
window's q and k). A model that computes its window in float32 on purpose (autocast off around
it) is reported too: the check reads what eager computes in only where autocast is on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from corpus import MODELS, spec

from nsa_compile.workload import load_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import op_dtypes  # noqa: E402


@pytest.mark.parametrize("name", MODELS)
def test_every_op_gets_bf16_activations_under_cpu_autocast(name):
    wl = load_workload(spec(name))
    calls = op_dtypes.audit(wl.model, wl.inputs, torch.bfloat16)
    assert calls, "no NSA op in the optimized model"
    assert any(arg in op_dtypes.ACTIVATIONS for _, dtypes in calls for arg in dtypes), calls
    assert op_dtypes.slips(calls, torch.bfloat16) == [], calls


class Float32Window(nn.Module):
    """A sliding window computed in float32 with autocast off around it, inside an autocast step:
    the window op receives float32 q, k, v (as eager computes there), which the audit reports."""

    def __init__(self, D=8, W=5):
        super().__init__()
        self.qkv, self.W, self.D = nn.Linear(D, 3 * D), W, D

    def forward(self, x):  # x [B, H, S, D]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        with torch.autocast("cpu", enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            t = torch.arange(x.shape[2])
            band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.W)
            s = (q @ k.transpose(-1, -2)) * self.D**-0.5
            return torch.softmax(s.masked_fill(~band, float("-inf")), dim=-1) @ v


def test_a_window_computed_in_float32_is_reported():
    x = torch.randn(2, 4, 24, 8, generator=torch.Generator().manual_seed(0))
    calls = op_dtypes.audit(Float32Window(), (x,), torch.bfloat16)
    assert [op for op, _ in calls] == ["window_attention"], calls
    assert op_dtypes.slips(calls, torch.bfloat16) == [
        "window_attention.q float32", "window_attention.k float32", "window_attention.v float32"]


def test_models_are_named_with_or_without_py(capsys):
    """bench_corpus names the models by stem: the stem is a corpus model here too, an unknown
    name is an error that lists it."""
    with pytest.raises(SystemExit):
        op_dtypes.main(["paper_bhsd", "no_such_model"])
    err = capsys.readouterr().err
    assert "unknown corpus model(s) no_such_model.py; valid: " in err, err
