"""Chunks of queries (issue 17): the ops' `q_offset` and the passes that read it from a model's
Python loop over query chunks.

Ops: query row r of a chunk is token q_offset + r, so an op call on the rows [off, off + S) of q
with q_offset=off must give exactly those rows of the call on the whole sequence (the op without
an offset, tested against eager in test_compressed_op.py, test_block_select_op.py and
test_selection_op.py): outputs, lse, block ids and every gradient (the whole call's gradients with
the output gradient zero outside the chunk), at odd sizes and offsets, in fp32, bf16 and fp16.
The triton backends (Triton's interpreter off CUDA, tiny shapes) on a chunk against the
reference's chunk.

Passes: a small module in the style of tests/corpus/chunked_queries.py (compressed, block
selection and selected branches over chunks of 24 queries; the window and the gate left out):
each chunk's three branches become one op each, with the chunk's first token as q_offset; the
softmaxes and sorts are gone; outputs and gradients match eager. A near miss: chunks whose
compressed mask is one token early (a later token leaks in) are refused with the reason, their
softmaxes kept.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import PER_CHUNK, matches, only_graph, optimize_fresh, optimized_with_parity
from oracles import attention_inputs, random_block_idx, triton_interpreter

import nsa_compile
from nsa_compile.ops import block_select as blk_mod
from nsa_compile.ops import compressed as cmp_mod
from nsa_compile.ops import selection as sel_mod

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
# (whole length L, chunk start off, chunk rows S): a chunk at 0 of a longer sequence, chunks whose
# first rows see no compression block yet, odd starts, a chunk ending at the sequence's end
CHUNKS = [(53, 0, 21), (53, 3, 11), (53, 17, 21), (53, 40, 13), (70, 33, 5)]
B, G, H_PER_G, DK, DV = 2, 2, 3, 12, 10
L_CMP, D_CMP, L_SEL, N_SEL = 7, 3, 8, 3


def rows(x: torch.Tensor, off: int, S: int) -> torch.Tensor:
    return x[:, :, off:off + S]


def chunk_grad(grad_o: torch.Tensor, off: int, S: int) -> torch.Tensor:
    """grad_o of the whole call: zero outside the chunk's rows."""
    g = torch.zeros_like(grad_o)
    g[:, :, off:off + S] = grad_o[:, :, off:off + S]
    return g


def run(op, q, k, v, grad_o, *args, **kwargs):
    """(o, lse, dq, dk, dv) of op(q, k, v, *args, **kwargs) through autograd."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o, lse = op(q, k, v, *args, **kwargs)
    o.backward(grad_o)
    return o.detach(), lse, q.grad, k.grad, v.grad


def assert_rows_match(chunk, whole, off, S, dtype):
    """The chunk call's o, lse, dq against the whole call's rows; dk, dv against the whole call's."""
    o, lse, dq, dk, dv = chunk
    wo, wlse, wdq, wdk, wdv = whole
    tol = TOL[dtype]
    torch.testing.assert_close(o, rows(wo, off, S), **tol)
    torch.testing.assert_close(lse, rows(wlse, off, S), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq, rows(wdq, off, S), **tol)
    torch.testing.assert_close(dk, wdk, **tol)
    torch.testing.assert_close(dv, wdv, **tol)


# --- the ops -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S", CHUNKS)
def test_compressed_chunk_is_the_rows_of_the_whole(L, off, S, dtype):
    Tc = (L - L_CMP) // D_CMP + 1
    q, k, v, grad_o = attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=L + off, kv_len=Tc)
    op, scale = torch.ops.nsa.compressed_attention, DK**-0.5
    whole = run(op, q, k, v, chunk_grad(grad_o, off, S), L_CMP, D_CMP, scale, "reference")
    chunk = run(op, rows(q, off, S), k, v, rows(grad_o, off, S), L_CMP, D_CMP, scale, "reference", None, off)
    assert_rows_match(chunk, whole, off, S, dtype)
    empty = torch.arange(off, off + S) < L_CMP - 1  # rows before the first block's last token
    assert bool(torch.isneginf(chunk[1][:, :, empty]).all()) and bool(torch.isfinite(chunk[1][:, :, ~empty]).all())


def test_compressed_offset_with_small_reference_chunks(monkeypatch):
    """The reference's own row chunks inside a chunk of queries (boundaries at odd rows)."""
    L, off, S = 60, 13, 29
    Tc = (L - L_CMP) // D_CMP + 1
    q, k, v, grad_o = attention_inputs(B, L, H_PER_G, G, DK, DV, torch.float32, seed=5, kv_len=Tc)
    op, scale = torch.ops.nsa.compressed_attention, DK**-0.5
    whole = run(op, q, k, v, chunk_grad(grad_o, off, S), L_CMP, D_CMP, scale, "reference")
    monkeypatch.setattr(cmp_mod, "REFERENCE_CHUNK", 4)
    chunk = run(op, rows(q, off, S), k, v, rows(grad_o, off, S), L_CMP, D_CMP, scale, "reference", None, off)
    assert_rows_match(chunk, whole, off, S, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S", CHUNKS)
def test_selected_chunk_is_the_rows_of_the_whole(L, off, S, dtype):
    q, k, v, grad_o = attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=3 * L + off)
    ids = random_block_idx(B, G, L, N_SEL, L_SEL, seed=off)
    op, scale = torch.ops.nsa.selected_attention, DK**-0.5
    whole = run(op, q, k, v, chunk_grad(grad_o, off, S), ids, L_SEL, scale, "reference")
    chunk = run(op, rows(q, off, S), k, v, rows(grad_o, off, S), rows(ids, off, S), L_SEL, scale, "reference", None,
                off)
    assert_rows_match(chunk, whole, off, S, dtype)


def test_selected_offset_with_small_reference_chunks(monkeypatch):
    L, off, S = 60, 13, 29
    q, k, v, grad_o = attention_inputs(B, L, H_PER_G, G, DK, DV, torch.float32, seed=7)
    ids = random_block_idx(B, G, L, N_SEL, L_SEL, seed=1)
    op, scale = torch.ops.nsa.selected_attention, DK**-0.5
    whole = run(op, q, k, v, chunk_grad(grad_o, off, S), ids, L_SEL, scale, "reference")
    monkeypatch.setattr(sel_mod, "REFERENCE_CHUNK", 5)
    chunk = run(op, rows(q, off, S), k, v, rows(grad_o, off, S), rows(ids, off, S), L_SEL, scale, "reference", None,
                off)
    assert_rows_match(chunk, whole, off, S, torch.float32)


@pytest.mark.parametrize("rule", ["nsa", "fla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S", CHUNKS)
def test_select_blocks_chunk_is_the_rows_of_the_whole(L, off, S, dtype, rule):
    l, d, ls = (L_CMP, D_CMP, L_SEL) if rule == "nsa" else (4, 4, 4)  # fla: l = d = l'
    Tc = (L - l) // d + 1
    q, k, v, _ = attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=11 * L + off, kv_len=Tc)
    scale = DK**-0.5
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, "reference")
    whole = torch.ops.nsa.select_blocks(q, k, lse, l, d, ls, N_SEL, scale, "reference", rule=rule)
    chunk = torch.ops.nsa.select_blocks(rows(q, off, S), k, rows(lse, off, S), l, d, ls, N_SEL, scale, "reference",
                                        rule=rule, q_offset=off)
    assert chunk.shape == (B, G, S, N_SEL)
    assert torch.equal(chunk, rows(whole, off, S))


def test_select_blocks_offset_with_small_reference_chunks(monkeypatch):
    L, off, S = 60, 13, 29
    Tc = (L - L_CMP) // D_CMP + 1
    q, k, v, _ = attention_inputs(B, L, H_PER_G, G, DK, DV, torch.float32, seed=9, kv_len=Tc)
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, L_CMP, D_CMP, 0.3, "reference")
    whole = torch.ops.nsa.select_blocks(q, k, lse, L_CMP, D_CMP, L_SEL, N_SEL, 0.3, "reference")
    monkeypatch.setattr(blk_mod, "REFERENCE_BUDGET", B * H_PER_G * G * Tc * 3)  # 3 rows a chunk
    chunk = torch.ops.nsa.select_blocks(rows(q, off, S), k, rows(lse, off, S), L_CMP, D_CMP, L_SEL, N_SEL, 0.3,
                                        "reference", q_offset=off)
    assert torch.equal(chunk, rows(whole, off, S))


def test_invalid_offsets_are_refused_eagerly_and_by_the_fakes():
    q, k, v, _ = attention_inputs(B, 20, H_PER_G, G, DK, DV, torch.float32, seed=0, kv_len=5)
    pos = torch.arange(20).expand(B, 20).contiguous()
    with pytest.raises(ValueError, match="q_offset must be >= 0"):
        torch.ops.nsa.compressed_attention(q, k, v, L_CMP, D_CMP, 1.0, "reference", None, -1)
    with pytest.raises(ValueError, match="q_offset must be 0 with pos"):
        torch.ops.nsa.select_blocks(q, k[:, :, :5], torch.zeros(B, G * H_PER_G, 20), L_CMP, D_CMP, L_SEL, N_SEL, 1.0,
                                    "reference", pos=pos, q_offset=2)
    q2, k2, v2, _ = attention_inputs(B, 20, H_PER_G, G, DK, DV, torch.float32, seed=0, kv_len=24)
    ids = random_block_idx(B, G, 20, N_SEL, L_SEL, seed=0)
    with pytest.raises(ValueError, match="Skv >= q_offset \\+ S = 25"):  # keys end before the chunk's last query
        torch.ops.nsa.selected_attention(q2, k2, v2, ids, L_SEL, 1.0, "reference", None, 5)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="q_offset must be >= 0"):
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        torch.ops.nsa.compressed_attention(fq, fk, fv, L_CMP, D_CMP, 1.0, "reference", None, -3)


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S", [(40, 0, 13), (40, 3, 9), (53, 29, 24)])
def test_compressed_triton_chunk_matches_the_reference(L, off, S, dtype):
    """The triton backend (Triton's interpreter off CUDA) on a chunk of queries: the staircase at
    the chunk's intercept, forward and backward, against the reference's chunk."""
    pytest.importorskip("triton")
    Tc = (L - L_CMP) // D_CMP + 1
    q, k, v, grad_o = (x.to(TRITON_DEVICE) for x in attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=off,
                                                                      kv_len=Tc))
    args = (rows(q, off, S), k, v, rows(grad_o, off, S), L_CMP, D_CMP, DK**-0.5)
    op = torch.ops.nsa.compressed_attention
    with triton_interpreter(on=TRITON_DEVICE == "cpu"):
        ours = run(op, *args, "triton", None, off)
    ref = run(op, *args, "reference", None, off)
    tol = TOL[dtype] if dtype != torch.bfloat16 else dict(rtol=3e-2, atol=3e-2)
    for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L, off, S", [(90, 0, 37), (90, 5, 40), (130, 61, 69)])
def test_select_blocks_triton_chunk_matches_the_reference(L, off, S, dtype):
    """The Triton kernel (interpreted off CUDA) with the offset as a kernel argument: the chunk's
    block ids are the reference's, with query tiles of 16 rows and compression tiles of 16 blocks
    (several of each, and the offset inside a selection block)."""
    pytest.importorskip("triton")
    from nsa_compile.ops import block_select_triton as bst
    l, d, ls = 8, 4, 16  # the kernel needs d | l and d | l'
    Tc = (L - l) // d + 1
    q, k, v, _ = (x.to(TRITON_DEVICE) for x in attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=off,
                                                                 kv_len=Tc))
    scale = DK**-0.5
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, "reference")
    whole = torch.ops.nsa.select_blocks(q, k, lse, l, d, ls, N_SEL, scale, "reference")
    qc, lse_c = rows(q, off, S), rows(lse, off, S)
    with triton_interpreter(on=TRITON_DEVICE == "cpu"):
        by_op = torch.ops.nsa.select_blocks(qc, k, lse_c, l, d, ls, N_SEL, scale, "triton", q_offset=off)
        tiled = bst.select_blocks_forward(qc, k, lse_c, l, d, ls, N_SEL, scale, q_offset=off,
                                          tiles={"TC": 16, "BLOCK_M": 16})
    assert torch.equal(by_op, rows(whole, off, S))
    assert torch.equal(tiled, rows(whole, off, S))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L, off, S", [(40, 0, 13), (53, 17, 21), (70, 33, 37)])
def test_selected_triton_chunk_matches_the_reference(L, off, S, dtype):
    """The Triton kernels (interpreted off CUDA) on a chunk: K/V of the whole sequence (the blocks
    are K/V's), the offset added to each row's token; forward and backward against the reference's
    chunk, and the backward again with segments of 2 queries (blocks split into several work
    items, summed by the reduce kernel)."""
    pytest.importorskip("triton")
    from nsa_compile.ops import selection_triton as st
    q, k, v, grad_o = (x.to(TRITON_DEVICE) for x in attention_inputs(B, L, H_PER_G, G, DK, DV, dtype, seed=off))
    ids = rows(random_block_idx(B, G, L, N_SEL, L_SEL, seed=off), off, S).to(TRITON_DEVICE)
    args = (rows(q, off, S), k, v, rows(grad_o, off, S), ids, L_SEL, DK**-0.5)
    op = torch.ops.nsa.selected_attention
    with triton_interpreter(on=TRITON_DEVICE == "cpu"):
        ours = run(op, *args, "triton", None, off)
        o, lse = ours[:2]
        bwd = lambda **kw: st.selected_backward(args[3], args[0], k, v, o, lse, ids, L_SEL, DK**-0.5, None, off, **kw)
        split = bwd(segment=2, tiles={"dense": False})
        dense = bwd(tiles={"dense": True})
    ref = run(op, *args, "reference", None, off)
    tol = TOL[dtype] if dtype != torch.bfloat16 else dict(rtol=3e-2, atol=3e-2)
    for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name: f"{name}: {m}")
    for mode, grads in (("segments of 2", split), ("dense", dense)):
        for name, a, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
            torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name, mode=mode: f"{mode}: {name}: {m}")


def test_backend_reasons_for_chunks():
    """The triton backends of the three ops take a chunk (compressed attention as the intercept
    block - q_offset); the varlen backends of selected attention take the whole sequence only and
    say so."""
    q, k, v, _ = attention_inputs(B, 20, H_PER_G, G, DK, DV, torch.float32, seed=0, kv_len=5)
    assert cmp_mod._triton_reason(q, k, v, L_CMP, D_CMP, None, 4) == cmp_mod._triton_reason(q, k, v, L_CMP, D_CMP)
    q2, k2, v2, _ = attention_inputs(B, 20, H_PER_G, G, DK, DV, torch.float16, seed=0, kv_len=30)
    ids = random_block_idx(B, G, 20, N_SEL, L_SEL, seed=0)
    assert sel_mod.why_not_triton(q2, k2, v2, ids, L_SEL, None, 3) == sel_mod.why_not_triton(q2, k2, v2, ids, L_SEL)
    with pytest.raises(ValueError, match="backend 'varlen' cannot run these inputs: a chunk of queries \\(q_offset=3, "
                                         "20 queries, 30 keys\\): the varlen kernels take the whole sequence only"):
        torch.ops.nsa.selected_attention(q2, k2, v2, ids, L_SEL, 1.0, "varlen", None, 3)


# --- the passes on a chunked module ------------------------------------------------------------

NEG = -1e9


class ChunkedBranches(nn.Module):
    """NSA's compressed, block-selection and selected branches over chunks of `chunk` queries (a
    Python loop, unrolled by Dynamo), in the style of tests/corpus/chunked_queries.py: heads-first,
    GQA by repeat_interleave, finite -1e9 fills, the compressed rows without a block zeroed after
    the softmax; scores upcast to float32 and probabilities cast back to V's dtype (models/nsa.py's
    `upcast`: so bf16 runs the softmax in float32, as the ops do). Paper semantics: l, d, l' = 8,
    4, 16, n = 3, forced {0, current, previous}. `leak`: every chunk after the first sees a
    compression block one token early (i*d + l - 1 <= t + 1): a near miss."""

    def __init__(self, dim=32, heads=4, kv_heads=2, l=8, d=4, l_sel=16, n=3, chunk=24, leak=False, casts=False):
        super().__init__()
        self.H, self.G, self.D = heads, kv_heads, dim // heads
        self.l, self.d, self.l_sel, self.n, self.chunk, self.leak = l, d, l_sel, n, chunk, leak
        self.casts = casts  # the casts CUDA bf16 autocast makes around the compressed product, written out
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.kv_proj = nn.Linear(dim, 4 * kv_heads * self.D, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        H, G, D, l, d, ls, n = self.H, self.G, self.D, self.l, self.d, self.l_sel, self.n
        h, scale = H // G, D**-0.5
        q = self.q_proj(x).view(B, S, H, D).transpose(1, 2)  # [B, H, S, D]
        k_cmp, v_cmp, k_sel, v_sel = self.kv_proj(x).view(B, S, 4, G, D).permute(2, 0, 3, 1, 4)  # [B, G, S, D]
        kc = k_cmp.unfold(2, l, d).mean(-1).repeat_interleave(h, dim=1)  # [B, H, Tc, D]
        vc = v_cmp.unfold(2, l, d).mean(-1).repeat_interleave(h, dim=1)
        Tc, Ns = kc.shape[2], -(-S // ls)
        i, j = torch.arange(Tc, device=x.device), torch.arange(Ns, device=x.device)
        overlap = (torch.minimum(i[:, None] * d + l, (j + 1) * ls)
                   - torch.maximum(i[:, None] * d, j * ls)).clamp(min=0).float() / l  # [Tc, Ns]
        offsets = torch.arange(ls, device=x.device)
        outs = []
        for s0 in range(0, S, self.chunk):
            s1 = min(s0 + self.chunk, S)
            qc, t = q[:, :, s0:s1], torch.arange(s0, s1, device=x.device)
            early = 1 if self.leak and s0 else 0
            visible = i[None, :] * d + l - 1 <= t[:, None] + early  # [c, Tc]
            if self.casts:  # q's chunk and the float32 K copy cast to bf16 for the product, p and V for p @ v
                scores = qc.to(torch.bfloat16) @ kc.to(torch.bfloat16).transpose(-1, -2)
            else:
                scores = qc @ kc.transpose(-1, -2)
            p_cmp = (scores.float() * scale).masked_fill(~visible, NEG).softmax(-1)
            p_cmp = p_cmp.masked_fill(~visible.any(-1, keepdim=True), 0.0)
            if self.casts:
                o_cmp = (p_cmp.to(torch.bfloat16) @ vc.to(torch.bfloat16)).float()
            else:
                o_cmp = p_cmp.to(vc.dtype) @ vc
            p_grp = (p_cmp @ overlap).view(B, G, h, s1 - s0, Ns).sum(2)  # [B, G, c, Ns]
            cur = (t // ls)[:, None]
            forced = (j == 0) | (j == cur) | (j == cur - 1)
            key = torch.where(forced, float("inf"), torch.where(j * ls <= t[:, None], p_grp, float("-inf")))
            key = F.pad(key, (0, max(0, n - Ns)), value=float("-inf"))
            val, order = key.sort(dim=-1, descending=True, stable=True)
            top = torch.where(val[..., :n] > float("-inf"), order[..., :n], key.shape[-1]).sort(-1).values
            top = torch.where(top == key.shape[-1], -1, top)  # [B, G, c, n]
            tok = top.clamp(min=0)[..., None] * ls + offsets
            ok = ((top >= 0)[..., None] & (tok <= t[:, None, None])).flatten(-2).repeat_interleave(h, dim=1)
            at = tok.flatten(-2).clamp(max=S - 1).flatten(2)[..., None].expand(-1, -1, -1, D)
            ks = torch.gather(k_sel, 2, at).view(B, G, s1 - s0, -1, D).repeat_interleave(h, dim=1)
            vs = torch.gather(v_sel, 2, at).view(B, G, s1 - s0, -1, D).repeat_interleave(h, dim=1)
            if self.casts:  # the rows cast after their unsqueeze, the gathered K/V copies after the copy
                s_sel = (qc.unsqueeze(-2).to(torch.bfloat16) @ ks.to(torch.bfloat16).transpose(-1, -2))
                s_sel = s_sel.squeeze(-2).float() * scale
                p_sel = s_sel.masked_fill(~ok, NEG).softmax(-1).unsqueeze(-2).to(torch.bfloat16)
                o_sel = (p_sel @ vs.to(torch.bfloat16)).squeeze(-2).float()
            else:
                s_sel = (qc.unsqueeze(-2) @ ks.transpose(-1, -2)).squeeze(-2).float() * scale
                o_sel = (s_sel.masked_fill(~ok, NEG).softmax(-1).to(vs.dtype).unsqueeze(-2) @ vs).squeeze(-2)
            outs.append(o_cmp + o_sel)
        o = torch.cat(outs, dim=2)  # [B, H, S, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


# where q_offset sits among each op's arguments (its schema), as the ATen graph passes them all
OFFSET_AT = {"compressed_attention": 8, "select_blocks": 13, "selected_attention": 8}


def offsets_of(opt, name: str) -> list[int]:
    """q_offset of each nsa.<name> call of the optimized model's forward ATen graph, in order."""
    target = getattr(torch.ops.nsa, name).default
    calls = [n for n in only_graph(opt).aten["forward"].graph.nodes if n.op == "call_function" and n.target is target]
    return [n.args[OFFSET_AT[name]] if len(n.args) > OFFSET_AT[name] else 0 for n in calls]


def eager_ops_left(opt) -> list[str]:
    """The softmaxes, sorts, gathers and K/V repeats of the rewritten (Dynamo) graph."""
    return re.findall(r"\b(softmax|sort|gather|repeat_interleave)\(", only_graph(opt).code_after)


@pytest.mark.parametrize("chunk, dtype", [(24, torch.float32), (24, torch.bfloat16), (10, torch.float32)],
                         ids=["24-fp32", "24-bf16", "10-fp32"])
def test_each_chunk_becomes_one_call_per_branch_with_its_offset(chunk, dtype):
    """Chunks of 24 rows: [0, 24), [24, 48), [48, 61). Chunks of 10: the first one's rows all in
    selection block 0 (l' = 16: its key shows no l', the block map does) and some without a
    compression block, a chunk that starts inside a selection block, the last one a single row."""
    torch.manual_seed(0)
    model, x = ChunkedBranches(chunk=chunk), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, dtype, PER_CHUNK)
    starts = list(range(0, 61, chunk))
    fired = matches(opt)
    assert [fired[name] for name in OFFSET_AT] == [len(starts)] * 3
    for name in OFFSET_AT:
        assert offsets_of(opt, name) == starts, name
    assert eager_ops_left(opt) == []  # no softmax, sort, gathered or repeated K/V is left


def test_a_chunk_mask_one_token_early_is_refused_with_the_graph_unchanged():
    torch.manual_seed(0)
    model, x = ChunkedBranches(leak=True), torch.randn(2, 61, 32)
    opt = optimized_with_parity(model, x, torch.float32, PER_CHUNK)
    fired = matches(opt)
    # the first chunk (offset 0) is NSA's; the two others leak: their compressed branch stays eager,
    # and so does their block selection (no lse) and their selected branch (finite fill, eager ids)
    assert (fired["compressed_attention"], fired["select_blocks"], fired["selected_attention"]) == (1, 1, 1)
    (row,) = [r for r in nsa_compile.report(opt) if r["name"] == "compressed_attention"]
    assert any("off by 1: block i is visible from t = i*d + l - 1 - 1" in why for why in row["reasons"]), row["reasons"]
    assert offsets_of(opt, "compressed_attention") == [0]
    # the leaking chunks' compressed and selected softmaxes and their sorts, as they were
    assert sorted(eager_ops_left(opt)).count("softmax") == 4 and "sort" in eager_ops_left(opt)


def test_chunks_under_autocast_casts_keep_their_offsets():
    """The casts CUDA autocast makes (found on the H200 in tests/corpus/chunked_queries.py), written
    out: the chunk of q and the float32 K copies cast to bf16 for the products, the selected
    branch's rows cast after their unsqueeze. The q chunk's cast is read through to its slice, the
    copies' casts move before the copies and the rows' casts before the unsqueeze (canonicalize's
    cast_hoist), the gathered K/V's cast, moved between the gather and its view, is read through to
    its source (cast for the op):
    every chunk's three branches fire at its offset, eager's outputs and gradients."""
    torch.manual_seed(0)
    model, x = ChunkedBranches(casts=True), torch.randn(2, 61, 32)  # float32 weights, as under autocast
    opt = optimize_fresh(copy.deepcopy(model), PER_CHUNK)
    for m in (model, opt):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
    torch.testing.assert_close(opt(x), model(x), **TOL[torch.bfloat16])
    for (name, p), (_, p_opt) in zip(model.named_parameters(), opt.named_parameters()):
        torch.testing.assert_close(p_opt.grad, p.grad, **TOL[torch.bfloat16], msg=name)
    assert [matches(opt)[name] for name in OFFSET_AT] == [3, 3, 3]
    for name in OFFSET_AT:
        assert offsets_of(opt, name) == [0, 24, 48], name
