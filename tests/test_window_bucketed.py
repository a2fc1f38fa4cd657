"""lucidrains' bucketed sliding window (issue 17): window_attention reads the bucketed local attention
of tests/corpus/lucidrains_shared_kv.py (buckets of b queries scoring the previous and their own
bucket's keys, a mask from positions) as the window op of w = b + 1 tokens, on probe values.

Graph tests on a small module in that spelling: fired once, the bucketed softmax gone and
nsa.window_attention there, outputs and gradients as eager's (fp32 1e-5; a bf16 softmax refused);
the window and scale read from the graph (a reach of b - 1 gives w = b, another scale is written);
near misses (a reach past the previous bucket, no look-around) and a probe over the cap refused with
the graph unchanged and the reason; symbolic sizes fire in every graph.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import helpers
from helpers import optimize_fresh

import nsa_compile

PASS = "window_attention"


def pad_at_dim(t, pad, dim=-1, value=0.0):
    dims_from_right = (-dim - 1) if dim < 0 else (t.ndim - dim - 1)
    return F.pad(t, (*((0, 0) * dims_from_right), *pad), value=value)


class Bucketed(nn.Module):
    """q [B, H, S, d] and K/V [B, G, S, d] from x, K/V repeated per head (repeat_kv, as lucidrains),
    then lucidrains' local_attention: buckets of `bucket` queries, the mask `dist > reach` (the
    model's: reach = bucket, distances 0..bucket), the previous bucket looked at unless
    look_around=False. Returns [B, H, S, d]."""

    def __init__(self, bucket=8, reach=None, look_around=True, scale=None, dim=32, heads=4, kv_heads=2,
                 dim_head=8):
        super().__init__()
        self.bucket, self.reach = bucket, bucket if reach is None else reach
        self.look_around, self.heads, self.kv_heads, self.dim_head = look_around, heads, kv_heads, dim_head
        self.scale = dim_head**-0.5 if scale is None else scale
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)

    def repeat_kv(self, t):  # repeat(t, 'b h ... -> b (h gh) ...')
        b, h = t.shape[:2]
        gh = self.heads // self.kv_heads
        return t[:, :, None].expand(b, h, gh, *t.shape[2:]).reshape(b, -1, *t.shape[2:])

    def forward(self, x):
        b, n = x.shape[:2]
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(x).view(b, n, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        return self.local_attention(q, self.repeat_kv(k), self.repeat_kv(v))

    def local_attention(self, q, k, v):
        w, (b, h, n, d) = self.bucket, q.shape
        pad = -n % w
        q, k, v = (pad_at_dim(t, (0, pad), dim=-2) for t in (q, k, v))
        pos = pad_at_dim(torch.arange(n, device=q.device), (0, pad), value=-1)
        windows = (n + pad) // w
        bq, bk, bv = (t.view(b, h, windows, w, d) for t in (q, k, v))
        bq_t = pos.view(windows, w)

        def look_around(t, bucket_dim, value):  # the previous bucket, then this one
            if not self.look_around:
                return t
            prev = pad_at_dim(t, (1, 0), dim=bucket_dim, value=value).narrow(bucket_dim, 0, t.shape[bucket_dim])
            return torch.cat((prev, t), dim=bucket_dim + 1)

        bk, bv, bk_t = look_around(bk, 2, 0.0), look_around(bv, 2, 0.0), look_around(bq_t, 0, -1)
        sim = torch.einsum("b h w i d, b h w j d -> b h w i j", bq, bk) * self.scale
        dist = bq_t[..., :, None] - bk_t[..., None, :]
        mask = (bk_t[..., None, :] == -1) | (dist < 0) | (dist > self.reach)
        sim = sim.masked_fill(mask, -torch.finfo(sim.dtype).max)
        out = torch.einsum("b h w i j, b h w j d -> b h w i d", sim.softmax(dim=-1), bv)
        return out.reshape(b, h, -1, d)[..., :n, :]


def grads(module, x):
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.float().square().mean().backward()
    return out.detach(), {k: p.grad.clone() for k, p in module.named_parameters()}


def compiled(module, x):
    """(optimized copy after one forward and backward, its graphs' records)."""
    opt = optimize_fresh(copy.deepcopy(module))
    opt(x).float().square().mean().backward()
    return opt, nsa_compile.api.state_of(opt).graphs


def log_of(record, name=PASS):
    return next(log for log in record.logs if log.pass_name == name)


def code_before(record, name=PASS):
    names = [log.pass_name for log in record.logs]
    i = names.index(name)
    return record.code_before if i == 0 else record.logs[i - 1].code_after


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_fires_once_with_eager_outputs_and_gradients(kv_heads):
    """One match; the bucketed softmax gone and one nsa.window_attention of w = bucket + 1 reading
    the un-repeated K/V; output and every gradient as eager's (fp32). S = 45 pads 3 rows."""
    torch.manual_seed(0)
    module = Bucketed(kv_heads=kv_heads)
    x = torch.randn(2, 45, 32)
    want_out, want_grads = grads(module, x)
    opt, (record,) = compiled(module, x)
    log = log_of(record)
    assert len(log.matches) == 1, log.refusals
    assert log.matches[0].kernel.startswith("nsa.window_attention[reference] (w=9: bucketed local attention read "
                                            "on probe values, distances 0..8; ")
    assert ("GQA-native" in log.matches[0].kernel) == (kv_heads == 2)
    assert "softmax(" in code_before(record) and "softmax(" not in log.code_after
    assert log.code_after.count("torch.ops.nsa.window_attention") == 1
    assert "repeat_interleave" not in log.code_after and "expand" not in log.code_after  # no K/V copy left
    got_out, got_grads = grads(opt, x)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("reach, window, scale", [(7, 8, None), (8, 9, 0.3)], ids=["reach-b-1", "scale-0.3"])
def test_the_window_and_the_scale_are_read_from_the_graph(reach, window, scale):
    """A mask `dist > b - 1` is the window of b tokens (still exact: the previous bucket covers it);
    a scale of 0.3 is the op's scale (the graph's constant, which the probe fit agrees with)."""
    torch.manual_seed(1)
    module = Bucketed(reach=reach, scale=scale)
    x = torch.randn(2, 45, 32)
    want_out, want_grads = grads(module, x)
    opt, (record,) = compiled(module, x)
    log = log_of(record)
    assert len(log.matches) == 1 and f"(w={window}: " in log.matches[0].kernel
    call = next(line for line in log.code_after.splitlines() if "nsa.window_attention" in line)
    assert f", {window}, {module.scale}, 'reference')" in call, call
    got_out, got_grads = grads(opt, x)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_a_bf16_softmax_is_refused_as_the_dense_window_refuses_it():
    """bf16 without autocast: lucidrains' softmax runs in bf16, the op's in float32 (the dense
    reading refuses that too): refused, the graph unchanged, the output eager's."""
    torch.manual_seed(2)
    module = Bucketed().to(torch.bfloat16)
    x = torch.randn(2, 45, 32, dtype=torch.bfloat16)
    want_out, _ = grads(module, x)
    opt, (record,) = compiled(module, x)
    log = log_of(record)
    assert not log.matches and log.code_after == code_before(record)
    assert any("read as bucketed local attention: the softmax runs in torch.bfloat16" in r.reason
               for r in log.refusals), log.refusals
    torch.testing.assert_close(grads(opt, x)[0], want_out, rtol=0, atol=0)


@pytest.mark.parametrize("change, reason", [
    ({"reach": 9}, "differs from nsa.window_attention (w=10: distances 0..9"),
    ({"look_around": False}, "differs from nsa.window_attention"),
], ids=["reach-past-the-previous-bucket", "no-look-around"])
def test_near_misses_are_refused_with_the_graph_unchanged(change, reason):
    """A reach of b + 1 (the first query of each bucket sees b keys back, the others b + 1: no
    window) and buckets that only see themselves (block-diagonal): refused on the probes, the
    graph unchanged, the output eager's."""
    torch.manual_seed(3)
    module = Bucketed(**change)
    x = torch.randn(2, 45, 32)
    want_out, _ = grads(module, x)
    opt, (record,) = compiled(module, x)
    log = log_of(record)
    assert not log.matches
    assert any("read as bucketed local attention: the bucketed window " + reason in r.reason
               for r in log.refusals), log.refusals
    assert log.code_after == code_before(record)
    torch.testing.assert_close(grads(opt, x)[0], want_out, rtol=1e-5, atol=1e-6)


def test_a_probe_over_the_budget_is_refused_with_its_size(monkeypatch):
    """Over the probe budget whole and on one batch row (tests/test_batch_slice.py fires it where
    one row fits): refused, the graph unchanged, the reason giving both sizes."""
    monkeypatch.setattr(nsa_compile.probe, "CPU_BUDGET", 1000)
    torch.manual_seed(4)
    module = Bucketed()
    x = torch.randn(2, 45, 32)
    _, (record,) = compiled(module, x)
    log = log_of(record)
    assert not log.matches and log.code_after == code_before(record)
    assert any("verifying the bucketed window takes" in r.reason and "over the budget of 1,000 on cpu" in r.reason
               and "on one batch row: not verified at this size yet" in r.reason for r in log.refusals), log.refusals


def test_symbolic_sizes_fire_in_every_graph():
    """S = 45, then 46 (Dynamo's graph with S a symbol: read at the probe sizes) and 60: one match
    per graph, the same w, eager's outputs at each length."""
    torch.manual_seed(5)
    module = Bucketed()
    opt = optimize_fresh(copy.deepcopy(module))
    for S in (45, 46, 60):
        x = torch.randn(2, S, 32)
        torch.testing.assert_close(opt(x), module(x), rtol=1e-5, atol=1e-5)
    graphs = nsa_compile.api.state_of(opt).graphs
    assert len(graphs) == 2 and "torch.SymInt" in graphs[1].code_before
    for record in graphs:
        (match,) = log_of(record).matches
        assert "(w=9: " in match.kernel


def test_canonicalize_keeps_the_buckets_five_dimensional():
    """`b h w i d, b h w j d -> b h w i j` has the shape of grouped attention (groups w of i heads),
    but the mask varies along i: queries. grouped_heads refuses it, naming the mask, and leaves no
    K/V copy per query (repeat_interleave by the bucket size, bucket x the memory of K and V) in the
    graph, here with the window pass off so the graph shows what canonicalize left; eager's output."""
    torch.manual_seed(6)
    module = Bucketed(bucket=8)
    x = torch.randn(2, 45, 32)
    config = helpers.FAST.replace(disabled_passes=(PASS,))
    opt = optimize_fresh(copy.deepcopy(module), config)
    torch.testing.assert_close(opt(x), module(x), rtol=1e-5, atol=1e-6)
    (record,) = nsa_compile.api.state_of(opt).graphs
    canon = log_of(record, "canonicalize")
    assert any("grouped_heads: the mask" in r.reason and "varies along 'i', so 'i' holds queries" in r.reason
               for r in canon.refusals), canon.refusals
    assert not any(m.kernel.startswith("grouped_heads") for m in canon.matches), canon.matches
    repeats = re.findall(r"repeat_interleave\([^,]+, (\d+)", canon.code_after)
    assert repeats and set(repeats) == {"2"}, repeats  # repeat_kv's own copies (h = 2) only, none by 8
