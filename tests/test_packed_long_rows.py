"""Packed rows longer than the whole-tensor cap (issue 20 point 3): compressed_attention verifies
its packed masks in row chunks (nsa_compile/mask_rows.py), so rows past about 20k tokens, which
the 2^31-element cap on evaluating [B, 1, S, Tc] masks whole left eager (and block selection and
the selected branch with them), keep every rewrite.

- the packed tiny model (models/nsa.py with pos) with MAX_VERIFIED_ELEMENTS below what evaluating
  its compressed masks whole takes, and chunks of a few rows: every pass fires (exact counts),
  outputs and gradients match eager; a mask spelling that is not row-local (evaluated whole) is
  refused there with the cap's reason, so the cap is live at this size;
- the packed compressed branch at S = 22,000 (past the old cap at batch 1), compiled without
  running (its eager scores would not fit): the model's masks fire, a near miss is refused;
- GPU: the packed seed model at S = 65,536, compiled without running: every pass fires.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from helpers import FAST, optimize_fresh, packed_positions, row
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)
from test_compressed_packed import NO_GQA, PackedBranch, kernel

import nsa_compile.passes.compressed_attention as compressed
from nsa_compile.fx import value
from nsa_compile.models import build_model, preset
from nsa_compile.models.nsa import upcast
from nsa_compile.pass_manager import GraphRecord, NSAGraphPass, OptimizeState

CMP = "compressed_attention"
# what each pass rewrites in a 2-layer packed model: every NSA branch of both layers
FIRED = {"canonicalize": 0, "projection_rope": 2, "window_attention": 2, "compressed_attention": 2,
         "select_blocks": 2, "selected_attention": 2, "gated_combine": 2, "gqa_grouped_matmul": 0,
         "compress_pooling": 0, "query_chunks": 0}
LAYERS = ["blocks.0.attn", "blocks.1.attn"]


def passes_without_running(model: nn.Module, *inputs, config=FAST) -> GraphRecord:
    """The record of the NSA passes on the Dynamo graph of model(*inputs), the graph itself not
    run: Dynamo traces it on fake tensors, the passes check their masks at compile time, and the
    compiled call returns zeros of the outputs' shapes. For rows whose eager run would not fit
    (the packed model's [B, H, S, Tc] scores)."""
    torch._dynamo.reset()
    state = OptimizeState.for_config(config)

    def capture(gm, example_inputs):
        outputs = [value(node) for node in gm.graph.find_nodes(op="output")[0].args[0]]
        NSAGraphPass(state)(gm.graph)
        return lambda *args: tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in outputs)

    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    (record,) = state.graphs
    return record


def fired(record: GraphRecord) -> dict:
    return {log.pass_name: len(log.matches) for log in record.logs}


def refusals(record: GraphRecord, name: str) -> list[str]:
    return [r.reason for log in record.logs if log.pass_name == name for r in log.refusals]


# --- the cap lowered to a small size: the model's masks are verified in chunks -----------------------


def test_packed_model_fires_past_the_whole_evaluation_cap(monkeypatch):
    """At S = 400 (batch 2) evaluating the compressed masks whole takes more than 4 B S Tc
    elements (the [B, S, Tc] comparisons, their conjunction and its inversion): with the cap
    below that and chunks of 7 rows, every pass still fires on both layers and the model matches
    eager in its loss and every parameter's gradient."""
    S, B, tiny = 400, 2, preset("tiny")
    Tc = S - tiny.cmp_block + 1
    monkeypatch.setattr(compressed, "MAX_VERIFIED_ELEMENTS", 10**6)
    monkeypatch.setattr(compressed, "CHUNK_ELEMENTS", 7 * B * Tc)
    assert 4 * B * S * Tc > compressed.MAX_VERIFIED_ELEMENTS
    torch.manual_seed(1)
    eager = build_model("tiny")
    pos = packed_positions([[150, 3, 7, 1, 239], [400]])
    tokens = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(4))
    model = optimize_fresh(copy.deepcopy(eager))
    got, want = model.loss(tokens, pos), eager.loss(tokens, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward()
    want.backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, count in FIRED.items():
        r = row(model, name)
        assert r["matches"] == count, (name, r)
        if count:
            assert r["where"] == LAYERS, (name, r)
    assert "packed documents (pos)" in row(model, CMP)["kernels"][0]


class ColumnHasBlock(nn.Module):
    """The packed branch with has_block reduced without keepdim and unsqueezed back
    (visible.any(-1)[..., None]): the same masks, but a reduction that moves the row dim, which
    the chunked evaluation does not follow, so the masks are evaluated whole."""

    def forward(self, q, k, v, pos):
        l, d, h = 4, 2, 2
        S = q.shape[1]
        k_rep = k.unfold(1, l, 1).mean(-1).transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
        v_rep = v.unfold(1, l, 1).mean(-1).transpose(1, 2).repeat_interleave(h, dim=1)
        Tc = k_rep.shape[2]
        scores = upcast(q.transpose(1, 2) @ k_rep.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, S, Tc]
        t = torch.arange(S)[:, None]
        i = torch.arange(Tc)[None, :]
        slot_pos = pos[:, :Tc]
        is_block = (slot_pos % d == 0) & (pos[:, l - 1 :] == slot_pos + l - 1)
        visible = ((i + l - 1 <= t) & (i >= t - pos[:, :, None]) & is_block[:, None, :])[:, None]  # [B, 1, S, Tc]
        has_block = visible.any(dim=-1)[..., None]  # [B, 1, S, 1]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")).masked_fill(~has_block, 0.0), dim=-1) * visible
        return (p.to(v_rep.dtype) @ v_rep).transpose(1, 2)


@pytest.mark.parametrize("cap", [None, 10**5], ids=["default-cap", "cap-below-the-whole-masks"])
def test_masks_that_are_not_row_local_are_evaluated_whole_up_to_the_cap(monkeypatch, cap):
    """The spelling the chunks do not follow fires as before under the default cap (same verdict
    as the whole evaluation gave), and is refused, naming both, where the cap is below its cost."""
    if cap is not None:
        monkeypatch.setattr(compressed, "MAX_VERIFIED_ELEMENTS", cap)
    S = 120
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, S, 4, 8, generator=g), torch.randn(2, S, 2, 8, generator=g), torch.randn(2, S, 2, 8, generator=g)
    pos = packed_positions([[50, 3, 67], [9, 111]])
    optimized = optimize_fresh(ColumnHasBlock())
    torch.testing.assert_close(optimized(q, k, v, pos), ColumnHasBlock()(q, k, v, pos), rtol=1e-5, atol=1e-5)
    r = row(optimized, CMP)
    if cap is None:
        assert (r["matches"], r["kernels"]) == (1, [kernel(2)]), r
    else:
        assert r["matches"] == 0 and len(r["reasons"]) == 1, r
        assert r["reasons"][0].startswith("the visibility mask reduces an [S, Tc] tensor at ")
        assert r["reasons"][0].endswith(f"over the cap of {cap:,}: not verified at this size")


# --- a real long row on the CPU: the compressed branch alone, compiled without running -----------


@pytest.mark.parametrize(
    "change, reason",
    [(None, None),
     ("previous-document", "the visibility mask is not the packed one for (l=4, d=2) on probe positions 'short "
                           "documents' (documents: 1, 2, 3, 4, 5, 3, 3, 11, ...): query t=10 of batch row 0 sees "
                           "slot s=6, but it lies in an earlier document (t's document starts at token 10)")],
    ids=["model", "previous-document"],
)
def test_packed_branch_at_22k_tokens(change, reason):
    """S = 22,000 at batch 1: evaluating the masks whole took about 5 S Tc = 2.4e9 elements, over
    the old cap of 2^31, so the branch stayed eager. In row chunks the model's masks are verified
    on every probe and rewritten; a mask that lets a query see the previous document is refused
    with the probe and the first query that shows it."""
    S = 22_000
    assert 5 * S * (S - 3) > 2**31
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, S, 2, 8, generator=g), torch.randn(1, S, 1, 8, generator=g), torch.randn(1, S, 1, 8, generator=g)
    pos = packed_positions([[S // 3, 7, S - S // 3 - 7]])
    record = passes_without_running(PackedBranch(change, h=2), q, k, v, pos, config=NO_GQA)
    (log,) = [log for log in record.logs if log.pass_name == CMP]
    if reason is None:
        assert [m.kernel for m in log.matches] == [kernel(2)] and not log.refusals, log
        assert "torch.ops.nsa.compressed_attention(" in record.code_after and "torch.softmax(" not in record.code_after
    else:
        assert not log.matches and [r.reason for r in log.refusals] == [reason]
        assert record.code_after == record.code_before


# --- GPU: the seed model at 64k tokens -------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_packed_seed_model_at_64k_fires_every_pass():
    """The packed seed model (2 layers, l 32, d 16, l' 64, n 16, w 512) at S = 65,536 with
    documents of 100 to 40,000 tokens, compiled without running (the masks are checked on the
    GPU): every pass fires on both layers, with the positions."""
    S = 65_536
    torch.manual_seed(0)
    model = build_model("seed", n_layers=2).cuda()
    lengths = [40_000, 100, 1, 333, 8_192, 1_000]
    pos = packed_positions([lengths + [S - sum(lengths)]]).cuda()
    tokens = torch.zeros(1, S, dtype=torch.int64, device="cuda")
    record = passes_without_running(model, tokens, pos)
    assert fired(record) == FIRED, {name: refusals(record, name) for name in FIRED}
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.compressed_attention(" in line]
    # the positions are the op's last argument (a line may go on with `;  x = None`)
    assert len(calls) == 2 and all(re.search(r"compressed_attention\(.*, l_pos_\)", line) for line in calls), calls
