"""Packed documents through every rewrite at once (issue 8.3, NSA_SEMANTICS.md section 6).

The packed tiny LM (models/lm.py with `pos`) optimized with all passes: each attention pass fires
on every layer with the positions as its op's last argument, no pass is refused, and the
output and every gradient match the eager packed model (the float64 oracle, parity.py's bars)
in fp32, bf16 and fp16. A right-padded batch needs no positions: its valid tokens match what
each row gives alone. The per-pass tests (near misses, probes) are in the test_*_packed files.
"""

from __future__ import annotations

import pytest
import torch
from helpers import optimize_fresh, packed_positions, tokens

import nsa_compile
from nsa_compile.models import build_model
from nsa_compile.parity import check_parity

# every pass that fires on the unpacked tiny model fires here too, twice (two layers)
EXPECTED = {"canonicalize": 0, "projection_rope": 2, "window_attention": 2, "compressed_attention": 2, "select_blocks": 2,
            "selected_attention": 2, "gated_combine": 2, "gqa_grouped_matmul": 0,
            "compress_pooling": 0, "query_chunks": 0}
# softmaxes that are not the pass's branch (tests/golden/explain_tiny.txt: the same on the unpacked model)
UNPACKED_REFUSALS = {"window_attention": 6, "compressed_attention": 4, "selected_attention": 2}


# S = 70: documents shorter than l (8), than l' (16), longer than n * l' (48), off block boundaries
POS = packed_positions([[13, 1, 50, 6], [70]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_pass_fires_on_the_packed_model_with_parity(dtype):
    torch.manual_seed(0)
    eager = build_model("tiny")
    batch = tokens(2, 70, seed=1)
    made = []

    def optimize(model):
        made.append(optimize_fresh(model))
        return made[-1]

    report = check_parity(eager, optimize, (batch[:, :-1], POS), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    rows = {r["name"]: r for r in nsa_compile.report(made[0])}
    assert {name: r["matches"] for name, r in rows.items()} == EXPECTED
    # each attention op was given the positions (its kernel text says so); the refusals are the
    # other softmaxes of the graph, as on the unpacked model, none about the documents
    for name in ("window_attention", "compressed_attention", "select_blocks", "selected_attention"):
        assert all("(pos)" in k for k in rows[name]["kernels"]), rows[name]["kernels"]
    reasons = [why for r in rows.values() for why in r["reasons"]]
    assert not [why for why in reasons if "pos" in why or "document" in why], reasons
    assert {name: r["refused"] for name, r in rows.items() if r["refused"]} == UNPACKED_REFUSALS


def test_right_padded_rows_need_no_positions():
    # Every branch is causal: a row padded on the right gives, at its valid tokens, what it gives
    # alone, through the optimized model too (the padding's outputs are unspecified).
    torch.manual_seed(0)
    eager = build_model("tiny").eval()
    optimized = optimize_fresh(build_model("tiny").eval())
    optimized.load_state_dict(eager.state_dict())
    batch = tokens(2, 60, seed=2)[:, :-1]
    with torch.no_grad():
        padded = optimized(batch)
        for b, valid in enumerate((60, 37)):
            alone = eager(batch[b : b + 1, :valid])[0]
            torch.testing.assert_close(padded[b, :valid], alone, rtol=1e-4, atol=1e-5)
