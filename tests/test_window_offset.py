"""Chunks of queries for the window branch and the gate (issue 17): nsa.window_attention's
`q_offset`, and the passes that read a model's loop over query chunks.

Op: query row r of a chunk is token q_offset + r and K/V are the whole sequence, so a call on
the rows [off, off + S) with q_offset=off must give exactly those rows of the call on the whole
sequence (the op without an offset, tested against eager in test_window_op.py): o, lse and dq,
and dk, dv of the whole call whose output gradient is zero outside the chunk; and the eager
formula of a chunk (the model's: K/V cut to [off - w + 1, off + S), a band mask) through
autograd. At odd sizes, offsets and windows, in fp32, bf16 and fp16. The triton backend
(Triton's interpreter off CUDA, tiny shapes) on a chunk against the reference's chunk, with
small tiles so that a chunk spans several tiles and some key tiles are read by no row.

Passes: a small module in the style of tests/corpus/chunked_queries.py (a loop over chunks of
24 queries, each with two sliding windows through SDPA over the chunk's key slice and a third
branch, combined by a slice of a sigmoid gate, then concatenated): every window becomes one
nsa.window_attention with the chunk's first token as q_offset on the whole K/V, every chunk's
gated sum one nsa.gated_combine; no SDPA, softmax or sigmoid is left; outputs and gradients
match eager. Near misses, each refused with the reason and the pass leaving the graph as it was:
a band shifted by one token (each query sees the next one), a key slice that starts one token
too late (a row misses the first key of its window), a chunk whose gated sum weighs the window
by the wrong gate column.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import PER_CHUNK, matches, only_graph, optimize_fresh, optimized_with_parity
from oracles import attention_inputs, triton_interpreter

import nsa_compile
from nsa_compile.ops import window as win_mod

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
# (whole length L, chunk start off, chunk rows S, window w): the first chunk of a longer sequence,
# chunks whose window reaches back past token 0, odd starts, a window wider than everything, a
# window of one token, a chunk ending at the sequence's end, keys left after the chunk
CHUNKS = [(53, 0, 21, 5), (53, 3, 11, 9), (53, 17, 21, 7), (53, 40, 13, 100), (70, 33, 5, 1), (61, 24, 24, 16)]
B, G, H_PER_G, DK, DV = 2, 2, 3, 12, 10


def rows(x: torch.Tensor, off: int, S: int) -> torch.Tensor:
    return x[:, :, off:off + S]


def run(op, q, k, v, grad_o, *args):
    """(o, lse, dq, dk, dv) of op(q, k, v, *args) through autograd (lse None for an o-only op)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = op(q, k, v, *args)
    o, lse = out if isinstance(out, tuple) else (out, None)
    o.backward(grad_o)
    return o.detach(), lse, q.grad, k.grad, v.grad


def eager_chunk(q, k, v, w: int, scale: float, off: int):
    """The eager model's chunk (tests/corpus/chunked_queries.py): K/V cut to the keys the chunk's
    rows can see, a band mask, scores upcast as models/nsa.py does, K/V repeated per head."""
    S = q.shape[2]
    k0 = max(0, off - w + 1)
    t = torch.arange(off, off + S)[:, None]
    s = torch.arange(k0, off + S)[None, :]
    band = (s <= t) & (t - s < w)
    h = q.shape[1] // k.shape[1]
    kc, vc = (x[:, :, k0:off + S].repeat_interleave(h, dim=1) for x in (k, v))
    up = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    p = ((q @ kc.transpose(-1, -2)).to(up) * scale).masked_fill(~band, float("-inf")).softmax(-1)
    return p.to(v.dtype) @ vc


# --- the op ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S, w", CHUNKS)
def test_a_chunk_is_the_rows_of_the_whole_and_the_eager_chunk(L, off, S, w, dtype):
    q, k, v, grad_o = attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=L + off + w)
    op, scale = torch.ops.nsa.window_attention, DK**-0.5
    whole_grad = torch.zeros_like(grad_o)
    whole_grad[:, :, off:off + S] = rows(grad_o, off, S)
    whole = run(op, q, k, v, whole_grad, w, scale, "reference")
    chunk = run(op, rows(q, off, S), k, v, rows(grad_o, off, S), w, scale, "reference", None, off)
    tol = TOL[dtype]
    for name, got, want in zip(("o", "lse", "dq"), chunk, whole):
        torch.testing.assert_close(got, rows(want, off, S), **tol, msg=lambda m, name=name: f"{name}: {m}")
    for name, got, want in zip(("dk", "dv"), chunk[3:], whole[3:]):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert not chunk[3][:, :, off + S:].any() and not chunk[3][:, :, :max(0, off - w + 1)].any()  # keys no row reads
    eager = run(eager_chunk, rows(q, off, S), k, v, rows(grad_o, off, S), w, scale, off)
    for name, got, want in zip(("o", "dq", "dk", "dv"), chunk[:1] + chunk[2:], eager[:1] + eager[2:]):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"eager {name}: {m}")


def test_an_offset_with_small_reference_chunks(monkeypatch):
    """The reference's own row chunks inside a chunk of queries (boundaries at odd rows)."""
    L, off, S, w = 60, 13, 29, 6
    q, k, v, grad_o = attention_inputs(B, L, H_PER_G, G, DK, DV, torch.float32, seed=5)
    op = torch.ops.nsa.window_attention
    args = (rows(q, off, S), k, v, rows(grad_o, off, S), w, DK**-0.5, "reference", None, off)
    want = run(op, *args)
    monkeypatch.setattr(win_mod, "REFERENCE_CHUNK", 4)
    for name, got, ref in zip(("o", "lse", "dq", "dk", "dv"), run(op, *args), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_invalid_chunks_are_refused_eagerly_and_by_the_fakes():
    q, k, v, _ = attention_inputs(B, 30, H_PER_G, G, DK, DV, torch.float32, seed=0)
    op = torch.ops.nsa.window_attention
    with pytest.raises(ValueError, match="q_offset must be >= 0"):
        op(q[:, :, :10], k, v, 4, 1.0, "reference", None, -1)
    with pytest.raises(ValueError, match="q_offset must be 0 with pos"):
        op(q, k, v, 4, 1.0, "reference", torch.arange(30).expand(B, 30).contiguous(), 2)
    with pytest.raises(ValueError, match="Sk >= q_offset \\+ S = 31 tokens, got 30 and 30"):  # keys end too early
        op(q[:, :, :10], k, v, 4, 1.0, "reference", None, 21)
    with pytest.raises(ValueError, match="sequence lengths differ"):  # packed documents: the whole sequence only
        op(q[:, :, :10], k, v, 4, 1.0, "reference", torch.arange(10).expand(B, 10).contiguous())
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="Sk >= q_offset"):
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        op(fq[:, :, :10], fk, fv, 4, 1.0, "reference", None, 25)


def test_flash_is_refused_for_a_chunk_and_auto_never_takes_it():
    """FA-2 aligns fewer queries to the keys' end: a chunk (K/V longer than q, q_offset 0 or not)
    is refused by name with that reason, and passed over by 'auto' with it; the whole sequence
    gets flash's own reasons as before."""
    q, k, v, _ = attention_inputs(B, 30, H_PER_G, G, DK, DK, torch.float16, seed=0)
    for qc in (q[:, :, :10], q[:, :, 12:20]):
        why = win_mod.flash_reason(qc, k, v)
        assert why.startswith(f"a chunk of queries ({qc.shape[2]} queries, 30 keys): FA-2 aligns"), why
        with pytest.raises(ValueError, match="backend 'flash' cannot run these inputs: a chunk of queries"):
            win_mod.choose_backend(qc, k, v, "flash")
        assert ("flash", why) in win_mod.WINDOW.passed_over("reference", qc, k, v, None)
    assert win_mod.flash_reason(q, k, v) == win_mod.flash.unsupported_reason(q, k, v)


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# several tiles per chunk, key tiles before and after every row's window
SMALL_TILES = {"fwd": {"BLOCK_M": 16, "BLOCK_N": 16}, "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16},
               "dq": {"BLOCK_M": 16, "BLOCK_N": 16}}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S, w", [(40, 0, 13, 6), (53, 17, 21, 7), (70, 33, 37, 100), (130, 97, 7, 3)])
def test_triton_chunk_matches_the_reference(L, off, S, w, dtype):
    """The Triton kernels (interpreted off CUDA) with SK and the offset as kernel arguments: a
    chunk at 0 of a longer K/V (the chunk path with Q_OFF 0), an odd start, a window past every
    key, and a far chunk whose first key tiles no row reads (dk, dv 0 there), forward and
    backward against the reference's chunk, with the default tiles (through the op) and small
    ones."""
    pytest.importorskip("triton")
    from nsa_compile.ops import window_triton as wt
    q, k, v, grad_o = (x.to(TRITON_DEVICE) for x in attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=off))
    qc, gc, scale = rows(q, off, S), rows(grad_o, off, S), DK**-0.5
    op = torch.ops.nsa.window_attention
    with triton_interpreter(on=TRITON_DEVICE == "cpu"):
        ours = run(op, qc, k, v, gc, w, scale, "triton", None, off)
        o, lse = wt.window_forward(qc, k, v, w, scale, None, off, tiles=SMALL_TILES)
        small = (o, lse, *wt.window_backward(gc, qc, k, v, o, lse, w, scale, None, off, tiles=SMALL_TILES))
    ref = run(op, qc, k, v, gc, w, scale, "reference", None, off)
    tol = TOL[dtype] if dtype != torch.bfloat16 else dict(rtol=3e-2, atol=3e-2)
    for label, got in (("op", ours), ("small tiles", small)):
        for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name, label=label: f"{label} {name}: {m}")
    assert not ours[3][:, :, :max(0, off - w + 1)].any() and not ours[3][:, :, off + S:].any()


# --- the passes on a chunked module ------------------------------------------------------------


class ChunkedWindows(nn.Module):
    """A loop over chunks of `chunk` queries (unrolled by Dynamo) in the style of
    tests/corpus/chunked_queries.py: per chunk two sliding windows (w 8 and 20) through
    `F.scaled_dot_product_attention(qc, k[:, :, k0:s1], v[:, :, k0:s1], attn_mask=band,
    enable_gqa=True)` with k0 = max(0, s0 - w + 1), a third branch (the chunk's values, head
    by head), combined by the chunk's slice of a per-head sigmoid gate; the chunks concatenated.
    Near misses: `shift` (each query's band one token later: it sees the next token), `late` (the
    key slice starts one token late: a row misses the first key of its window), `mixed` (the last
    chunk weighs the second window by gate column 1, which weighs the first window)."""

    def __init__(self, dim=32, heads=4, kv_heads=2, windows=(8, 20), chunk=24, shift=False, late=False, mixed=False):
        super().__init__()
        self.H, self.G, self.D = heads, kv_heads, dim // heads
        self.windows, self.chunk, self.shift, self.late, self.mixed = windows, chunk, shift, late, mixed
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.kv_proj = nn.Linear(dim, 4 * kv_heads * self.D, bias=False)
        self.g_proj = nn.Linear(dim, 3 * heads)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        H, G, D = self.H, self.G, self.D
        q = self.q_proj(x).view(B, S, H, D).transpose(1, 2)  # [B, H, S, D]
        k1, v1, k2, v2 = self.kv_proj(x).view(B, S, 4, G, D).permute(2, 0, 3, 1, 4)  # [B, G, S, D]
        g = torch.sigmoid(self.g_proj(x)).view(B, S, H, 3).transpose(1, 2)  # [B, H, S, 3]
        outs = []
        for s0 in range(0, S, self.chunk):
            s1 = min(s0 + self.chunk, S)
            qc, t = q[:, :, s0:s1], torch.arange(s0, s1, device=x.device) + (1 if self.shift else 0)
            branch = []
            for (k, v), w in zip(((k1, v1), (k2, v2)), self.windows):
                k0 = max(0, s0 - w + (2 if self.late else 1))
                s = torch.arange(k0, s1, device=x.device)
                band = (s[None, :] <= t[:, None]) & (t[:, None] - s[None, :] < w)
                branch.append(F.scaled_dot_product_attention(qc, k[:, :, k0:s1], v[:, :, k0:s1], attn_mask=band,
                                                             enable_gqa=True))
            third = v1[:, :, s0:s1].repeat_interleave(H // G, dim=1)  # [B, H, c, D]
            gc = g[:, :, s0:s1]
            second = gc[..., 0:1] if self.mixed and s1 == S else gc[..., 1:2]
            outs.append(gc[..., 0:1] * branch[0] + second * branch[1] + gc[..., 2:3] * third)
        o = torch.cat(outs, dim=2)  # [B, H, S, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


def reasons(model, name: str) -> list[str]:
    (row,) = [r for r in nsa_compile.report(model) if r["name"] == name]
    return row["reasons"]


def window_calls(opt) -> list[tuple[int, int]]:
    """(w, q_offset) of each nsa.window_attention call of the forward ATen graph, in order (the
    ATen graph passes every argument: q_offset is the 8th)."""
    target = torch.ops.nsa.window_attention.default
    calls = [n for n in only_graph(opt).aten["forward"].graph.nodes if n.op == "call_function" and n.target is target]
    return [(n.args[3], n.args[7] if len(n.args) > 7 else 0) for n in calls]


def code_around(opt, name: str) -> tuple[str, str]:
    """The graph's code before pass `name` ran (after the pass before it) and after it."""
    logs = only_graph(opt).logs
    at = [log.pass_name for log in logs].index(name)
    return logs[at - 1].code_after, logs[at].code_after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_chunk_becomes_one_window_call_per_branch_and_one_combine(dtype):
    """Chunks of 24 rows of 61 tokens: [0, 24), [24, 48), [48, 61). The first chunk's key slices
    start at 0 (plain self-attention over its 24 tokens: the op as always), the others' at s0 - w +
    1 (read as chunks: the whole K/V and q_offset s0)."""
    torch.manual_seed(0)
    model, x = ChunkedWindows(), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, dtype, PER_CHUNK)
    fired = matches(opt)
    assert (fired["window_attention"], fired["gated_combine"]) == (6, 3)
    assert window_calls(opt) == [(8, 0), (20, 0), (8, 24), (20, 24), (8, 48), (20, 48)]
    code = only_graph(opt).code_after
    # no SDPA, softmax, gate or K/V copy of a window is left (the third branch's copy per chunk stays)
    assert re.findall(r"\b(scaled_dot_product_attention|softmax|sigmoid|repeat_interleave)\(", code) == \
        ["repeat_interleave"] * 3
    assert code.count("nsa.window_attention(") == 6 and code.count("nsa.gated_combine(") == 3


def test_a_band_shifted_by_one_token_is_refused_with_the_graph_unchanged():
    torch.manual_seed(0)
    model, x = ChunkedWindows(shift=True), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, config=PER_CHUNK)
    assert matches(opt)["window_attention"] == 0
    before, after = code_around(opt, "window_attention")
    assert before == after
    found = reasons(opt, "window_attention")
    # the later chunks: canonicalize wrote SDPA out (a window along the slice), the window pass
    # refuses it at the first row; the first chunk's SDPA stays (its mask is not causal)
    assert ("scores are 24 x 31: queries and keys differ (not self-attention); read as a chunk of queries: a chunk of "
            "queries from token 24 over keys 17..47: the mask is not a sliding window: the band is shifted by one "
            "token: query t sees the keys t - w + 2 .. t + 1: the next token, not t - w + 1 (w = 8)") in found, found
    assert len(found) == 4  # the later chunks' two windows
    assert any("SDPA's mask is not a causal sliding window: SDPA stays" in r for r in reasons(opt, "canonicalize"))


def test_a_key_slice_that_starts_too_late_is_refused_with_the_graph_unchanged():
    torch.manual_seed(0)
    model, x = ChunkedWindows(late=True), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, config=PER_CHUNK)
    fired = matches(opt)
    # the first chunk's slices start at 0 (max(0, ...)): it is the window; the others miss a key
    assert fired["window_attention"] == 2 and window_calls(opt) == [(8, 0), (20, 0)]
    found = reasons(opt, "window_attention")
    assert ("scores are 24 x 30: queries and keys differ (not self-attention); read as a chunk of queries: a chunk of "
            "queries from token 24 over keys 18..47: the mask is not a sliding window: the key slice starts at token "
            "18, after key 17, which query row 0 (token 24) sees in a window of 8 (tokens 17..24): the slice misses "
            "keys of the window") in found, found
    # only the first chunk's two windows changed the graph: the others' softmaxes stay
    before, after = code_around(opt, "window_attention")
    assert (len(re.findall(r"\bsoftmax\(", before)), len(re.findall(r"\bsoftmax\(", after))) == (6, 4)


def test_a_chunk_weighed_by_the_wrong_gate_column_keeps_every_chunk_eager():
    """The chunks are rewritten together or not at all (the gate is computed once for all of
    them): the last chunk weighs two branches by column 0, so the gate stays, with the chunk's
    reason, and every node built for the chunks is gone again."""
    torch.manual_seed(0)
    model, x = ChunkedWindows(mixed=True), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, config=PER_CHUNK)
    fired = matches(opt)
    assert (fired["window_attention"], fired["gated_combine"]) == (6, 0)
    before, after = code_around(opt, "gated_combine")
    assert before == after
    (why,) = reasons(opt, "gated_combine")
    assert why.endswith("; read per chunk of tokens: tokens 48..60: the branches are weighed by gate columns "
                        "[0, 0, 2], not 0, 1, 2 once each"), why
