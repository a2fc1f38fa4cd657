"""check_parity itself: the bar, the eager error over several runs, None gradients."""

import copy
import itertools

import pytest
import torch
from torch import nn

from nsa_compile.parity import FLOORS, check_parity


CALLS = {"float32": itertools.count(1)}  # shared by every copy of a noisy model


class Linear(nn.Module):
    """y = x @ w + b; when `noisy`, float32 runs are scaled by 1.001, 1.002, ... (a stand-in for
    eager CUDA's nondeterministic atomics: each run rounds differently; the float64 oracle is exact)."""

    def __init__(self, noisy=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8, generator=gen))
        self.b = nn.Parameter(torch.randn(8, generator=gen))
        self.noisy = noisy

    def forward(self, x):
        y = x @ self.w + self.b
        if self.noisy and x.dtype == torch.float32:
            y = y * (1 + 1e-3 * next(CALLS["float32"]))
        return y


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def test_identity_passes_and_a_wrong_model_fails():
    ok = check_parity(Linear(), copy.deepcopy, (X,), torch.float32, is_lm=False)
    assert ok.ok and {r.name for r in ok.rows} == {"output", "loss", "grad w", "grad b"}

    def wrong(model):
        with torch.no_grad():
            model.w.mul_(1.01)
        return model

    bad = check_parity(Linear(), wrong, (X,), torch.float32, is_lm=False)
    assert not bad.ok and bad.rows[0].err_optimized > 100 * FLOORS[torch.float32]


def test_eager_error_is_the_largest_of_several_runs():
    """Runs 1..3 scale the output by 1.001, 1.002, 1.003: the eager error is the third's."""
    CALLS["float32"] = itertools.count(1)
    one = check_parity(Linear(noisy=True), copy.deepcopy, (X,), torch.float32, is_lm=False, eager_runs=1)
    CALLS["float32"] = itertools.count(1)
    three = check_parity(Linear(noisy=True), copy.deepcopy, (X,), torch.float32, is_lm=False, eager_runs=3)
    out1, out3 = (next(r for r in rep.rows if r.name == "output") for rep in (one, three))
    assert out1.err_eager == pytest.approx(1e-3, rel=1e-3)
    assert out3.err_eager == pytest.approx(3e-3, rel=1e-3)
    assert out3.bar == pytest.approx(6e-3, rel=1e-3)


def test_eager_runs_must_be_positive():
    with pytest.raises(ValueError, match="eager_runs must be >= 1"):
        check_parity(Linear(), copy.deepcopy, (X,), torch.float32, is_lm=False, eager_runs=0)


def test_a_gradient_missing_on_one_side_fails():
    def detach_weight(model):
        model.b.requires_grad_(False)
        return model

    report = check_parity(Linear(), detach_weight, (X,), torch.float32, is_lm=False)
    assert not report.ok and report.failures()[0].name == "grad b (grad None mismatch)"


def test_the_bar_factor_is_two_in_fp32_and_three_in_half_precision():
    """Half precision: 3x the eager error (a no-op reorder of roundings fails 2x on the gate biases,
    nsa_compile/parity.py); fp32 stays at 2x. Floors at 0 so the factor alone sets each bar."""
    no_floor = {dtype: 0.0 for dtype in FLOORS}
    for dtype, factor in ((torch.float32, 2.0), (torch.bfloat16, 3.0), (torch.float16, 3.0)):
        CALLS["float32"] = itertools.count(1)
        rep = check_parity(Linear(noisy=True), copy.deepcopy, (X,), dtype, is_lm=False, floors=no_floor)
        out = next(r for r in rep.rows if r.name == "output")
        assert out.err_eager > 0 and out.bar == pytest.approx(factor * out.err_eager, rel=1e-9), dtype
