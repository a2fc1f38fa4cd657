"""Packed documents (pos) in selected attention: the op nsa::selected_attention(..., pos) and its
backward against the eager packed formula (models/nsa.py), and the selected_attention pass on
the packed model's graph (fired per layer with the pos node, parity, near misses refused).

Block ids are counted within each query's document: token (t - pos[t]) + j * l' + offset, valid
iff the block is chosen and the token is <= t (PACKED.md's contract)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, row, tokens
from oracles import (
    AllocationSpy, assert_close_all, assert_compiles_like_eager, assert_fakes_promise_the_layout,
    assert_raises_eager_and_fake, assert_within_twice_eager, attention_inputs, upcast,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile
import nsa_compile.passes.selected_attention as selection_pass
from nsa_compile.models import build_model, check_positions, positions_from_cu_seqlens
from nsa_compile.models.config import ModelConfig
from nsa_compile.models.nsa import NSAAttention
from nsa_compile.ops import selection as sel_mod
from nsa_compile.ops import selected_attention
from nsa_compile.parity import check_parity

B, G, DK, DV, LS, L_CMP = 2, 2, 16, 24, 16, 16
PASS = "selected_attention"


def positions(lengths: list[int]) -> torch.Tensor:
    """pos [S] of documents of these lengths, packed in order."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return positions_from_cu_seqlens(cu, sum(lengths))


def packed_positions(S: int) -> torch.Tensor:
    """pos [2, S]: row 0 documents of odd lengths (1, 2, < l', > n * l'), row 1 documents starting
    on a block boundary and one token after one (a different packing per row)."""
    def fill(cycle):
        out, total, i = [], 0, 0
        while total < S:
            out.append(min(cycle[i % len(cycle)], S - total))
            total, i = total + out[-1], i + 1
        return positions(out)

    return torch.stack([fill([1, 2, LS - 3, 5 * LS + 7, 3]), fill([LS, 2 * LS + 1, LS - 1, 3 * LS])])


def model_cfg(h, n, dk=DK, dv=DV, block_size=LS):
    return ModelConfig(dim=32, n_heads=G * h, n_kv_groups=G, head_dim=dk, head_dim_v=dv,
                       cmp_block=L_CMP, cmp_stride=8, sel_block=block_size, n_selected=n)


def eager_packed(q, k, v, block_idx, block_size, scale, pos):
    """NSAAttention.selected_attention(..., pos) (models/nsa.py) with heads before the sequence."""
    h = q.shape[1] // k.shape[1]
    attn = NSAAttention(model_cfg(h, block_idx.shape[-1], q.shape[-1], v.shape[-1], block_size))
    attn.scale = scale
    o = attn.selected_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_idx, pos)
    return o.transpose(1, 2)


def packed_block_idx(S, h, n, pos, seed=0):
    """The eager model's own packed selection on a random p_cmp (a slot at every token)."""
    attn = NSAAttention(model_cfg(h, n))
    Tc = max(0, S - L_CMP + 1)
    p_cmp = torch.rand(pos.shape[0], G * h, S, Tc, generator=torch.Generator().manual_seed(seed + 1000))
    return attn.select_blocks(p_cmp, S, pos)


def run(fn, q, k, v, grad_o, block_idx, scale, pos, block_size=LS):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, block_idx, block_size, scale, pos=pos)
    grads = torch.autograd.grad(o, leaves, grad_o)
    return (o.detach(), *grads)


# --- the op -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_op_matches_the_eager_packed_formula(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for S, n, h in ((1, 3, 3), (17, 3, 1), (100, 5, 3), (150, 3, 2)):  # 100, 150: chunk boundaries inside
        q, k, v, grad_o = attention_inputs(B, S, h, G, DK, DV, dtype, seed=S + n)
        pos = packed_positions(S)
        idx = packed_block_idx(S, h, n, pos, seed=S)
        ours = run(selected_attention, q, k, v, grad_o, idx, 0.3, pos)
        assert_close_all(ours, run(eager_packed, q, k, v, grad_o, idx, 0.3, pos), f"S={S} n={n} h={h}", **tol)


def test_the_cases_are_packed_and_sparse():
    """The cases above hold documents of 1 and 2 tokens, blocks counted from document starts that
    are not multiples of l', and queries that skip earlier blocks of their document."""
    pos = packed_positions(150)
    check_positions(pos, 150)
    starts = [torch.nonzero(row == 0).flatten().tolist() for row in pos]
    assert starts[0][:4] == [0, 1, 3, 16] and 16 in starts[1] and 49 in starts[1]  # 49 % 16 == 1
    for n in (3, 5):
        idx = packed_block_idx(150, 3, n, pos)
        assert (idx.amax(-1) == (pos // LS)[:, None]).all()  # the current document block is chosen
        ids = (pos - torch.arange(150))[:, None, :, None, None] + idx[..., None] * LS + torch.arange(LS)
        valid = ((idx >= 0)[..., None] & (ids <= torch.arange(150)[:, None, None])).flatten(-2)
        n_valid = valid.sum(-1)  # [B, G, S]
        assert (n_valid >= 1).all() and (n_valid < (pos + 1)[:, None]).any()  # some queries skip blocks


def test_one_document_per_row_is_the_unpacked_op_exactly():
    q, k, v, grad_o = attention_inputs(B, 100, 3, G, DK, DV, torch.float32, seed=3)
    idx = packed_block_idx(100, 3, 3, torch.arange(100).expand(B, 100), seed=3)
    packed = run(selected_attention, q, k, v, grad_o, idx, 0.3, torch.arange(100).expand(B, 100))
    unpacked = run(selected_attention, q, k, v, grad_o, idx, 0.3, None)
    for a, b in zip(packed, unpacked):
        assert torch.equal(a, b)


def test_no_attention_across_documents():
    """Changing the keys and values of one document leaves every other document's output and
    gradients bit for bit (hand-built ids: blocks past the document end, padding, duplicates)."""
    S, h = 70, 2
    pos = positions([30, 25, 15])[None].expand(B, S)
    q, k, v, grad_o = attention_inputs(B, S, h, G, DK, DV, torch.float64, seed=5)
    idx = packed_block_idx(S, h, 3, pos, seed=5).clone()
    idx[0, 0, 40] = torch.tensor([0, 1, 3])  # t = 40 is token 10 of document 2: blocks 1, 3 are in the future
    idx[1, 1, 60] = torch.tensor([-1, 0, 0])  # duplicate of the current block
    base = run(selected_attention, q, k, v, grad_o, idx, 0.4, pos)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:55] += 1.0
    v2[:, :, 30:55] -= 2.0
    changed = run(selected_attention, q, k2, v2, grad_o, idx, 0.4, pos)
    others = torch.cat([torch.arange(30), torch.arange(55, 70)])
    for a, b in zip(base, changed):  # o, dq, dk, dv: dim 2 is the sequence in each
        assert torch.equal(a[:, :, others], b[:, :, others])
        assert not torch.equal(a[:, :, 30:55], b[:, :, 30:55])
    assert_close_all(base, run(eager_packed, q, k, v, grad_o, idx, 0.4, pos), "hand-built", rtol=1e-12, atol=1e-12)


def test_chunk_boundaries(monkeypatch):
    for chunk in (1, 7):
        monkeypatch.setattr(sel_mod, "REFERENCE_CHUNK", chunk)
        q, k, v, grad_o = attention_inputs(B, 45, 3, G, DK, DV, torch.float64, seed=chunk)
        pos = packed_positions(45)
        idx = packed_block_idx(45, 3, 3, pos, seed=chunk)
        assert_close_all(run(selected_attention, q, k, v, grad_o, idx, 0.3, pos),
                         run(eager_packed, q, k, v, grad_o, idx, 0.3, pos), f"chunk={chunk}", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_vs_fp64_oracle(dtype):
    q, k, v, grad_o = attention_inputs(B, 100, 3, G, DK, DV, dtype, seed=8)
    pos = packed_positions(100)
    idx = packed_block_idx(100, 3, 5, pos, seed=8)
    oracle = run(eager_packed, *(x.double() for x in (q, k, v, grad_o)), idx, 0.3, pos)
    eager = run(eager_packed, q, k, v, grad_o, idx, 0.3, pos)
    assert assert_within_twice_eager(run(selected_attention, q, k, v, grad_o, idx, 0.3, pos), eager, oracle,
                                     dtype, "packed") > 0


def test_memory_bounded_with_pos():
    S, h, n, chunk, D = 512, 4, 3, 64, 8
    q, k, v, grad_o = attention_inputs(1, S, h, G, D, D, torch.float32, seed=2)
    pos = packed_positions(S)[:1]
    idx = packed_block_idx(S, h, n, pos, seed=2)
    spy = AllocationSpy()
    with spy:
        o, _ = sel_mod._reference_forward(q, k, v, idx, LS, 0.25, chunk, pos=pos)
        dq, dk, dv = sel_mod._reference_backward(grad_o, q, k, v, idx, LS, 0.25, chunk, pos=pos)
    T = n * LS
    assert spy.max_numel <= max(G * chunk * T * max(h, D), G * h * S * D) < G * S * T * D // 4
    assert_close_all((o, dq, dk, dv), run(eager_packed, q, k, v, grad_o, idx, 0.25, pos), "spy", rtol=1e-5, atol=1e-5)


def test_opcheck_forward_and_backward_ops_with_pos():
    for S, h, n in ((7, 3, 3), (40, 1, 3)):
        q, k, v, grad_o = attention_inputs(B, S, h, G, 8, 5, torch.float32, seed=S)
        pos = packed_positions(S)
        idx = packed_block_idx(S, h, n, pos, seed=S)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        torch.library.opcheck(torch.ops.nsa.selected_attention.default, (q, k, v, idx, LS, 0.5, "reference", pos))
        o, lse = torch.ops.nsa.selected_attention(q, k, v, idx, LS, 0.5, "reference", pos)
        torch.library.opcheck(torch.ops.nsa.selected_attention_backward.default,
                              (grad_o, *(x.detach() for x in (q, k, v, o, lse)), idx, LS, 0.5, "reference", pos))


def test_fakes_promise_the_layout_with_pos():
    q, k, v, grad_o = attention_inputs(B, 50, 3, G, DK, DV, torch.float32, seed=1)
    pos = packed_positions(50)
    assert_fakes_promise_the_layout(torch.ops.nsa.selected_attention, torch.ops.nsa.selected_attention_backward,
                                    grad_o, q, k, v, packed_block_idx(50, 3, 3, pos), LS, 0.5, "auto", pos)


def packed_loss(fn):
    def loss(x_q, x_k, x_v, idx, pos):
        o = fn(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), idx, LS, 0.3, pos=pos)
        return (o.transpose(1, 2).sin() * 1.5).sum()
    return loss


def test_compile_fullgraph_aot_eager_with_pos():
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*s, generator=gen) for s in ((B, 90, G * 3, DK), (B, 90, G, DK), (B, 90, G, DV))]
    pos = packed_positions(90)
    assert_compiles_like_eager(packed_loss(selected_attention), packed_loss(lambda *a, pos: eager_packed(*a, pos)),
                               inputs, packed_block_idx(90, 3, 5, pos), pos)


def bad_args(**change):
    q, k, v, _ = attention_inputs(B, 8, 2, G, DK, DV, torch.float32, seed=0)
    args = dict(q=q, k=k, v=v, block_idx=torch.zeros(B, G, 8, 3, dtype=torch.int64), block_size=4, scale=0.5,
                backend="auto", pos=torch.zeros(B, 8, dtype=torch.int64))
    args.update(change)
    return args


BAD_POS = [
    (dict(pos=torch.zeros(B, 8, dtype=torch.int32)), r"pos must be an int64 tensor of shape \[B, S\] = \[2, 8\]"),
    (dict(pos=torch.zeros(B, 9, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\]"),
    (dict(pos=torch.zeros(8, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\]"),
    (dict(pos=torch.zeros(B + 1, 8, dtype=torch.int64)), r"pos must be an int64 tensor of shape \[B, S\]"),
    (dict(pos=torch.zeros(B, 8, dtype=torch.int64, device="meta")), "must be on one device"),
]


@pytest.mark.parametrize("change,match", BAD_POS, ids=["int32", "S+1", "1-D", "B+1", "device"])
def test_pos_argument_validation(change, match):
    assert_raises_eager_and_fake(selected_attention, bad_args(**change), match)


def test_varlen_backends_refuse_pos_with_the_reason():
    """The varlen backends refuse pos; triton takes it (on the CPU its reason is the device, as
    without pos: tests/test_selection_triton.py runs its document mask)."""
    args = bad_args()
    q, k, v, idx, pos = args["q"], args["k"], args["v"], args["block_idx"], args["pos"]
    assert sel_mod.choose_backend(q, k, v, idx, 4, "auto", pos) == "reference"
    assert sel_mod.why_not_triton(q, k, v, idx, 4, pos) == sel_mod.why_not_triton(q, k, v, idx, 4)
    for backend in ("varlen", "varlen_flash_attn"):
        with pytest.raises(ValueError, match=rf"backend '{backend}' cannot run these inputs: packed documents "
                                             r"\(pos\): the varlen segments have no document mask"):
            selected_attention(**bad_args(backend=backend))
    # without pos the reasons are what they were
    assert "run on CUDA" in sel_mod.why_not_triton(q, k, v, idx, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_op_on_cuda_matches_the_eager_formula(dtype):
    S, h, n = 1000, 3, 5
    q, k, v, grad_o = (x.cuda() for x in attention_inputs(B, S, h, G, DK, DV, dtype, seed=11))
    pos = packed_positions(S).cuda()
    idx = packed_block_idx(S, h, n, pos.cpu(), seed=11).cuda()
    assert sel_mod.choose_backend(q, k, v, idx, LS, "auto", pos) == "triton"
    ours = run(selected_attention, q, k, v, grad_o, idx, 0.3, pos)
    eager = run(eager_packed, q, k, v, grad_o, idx, 0.3, pos)
    oracle = run(eager_packed, *(x.double() for x in (q, k, v, grad_o)), idx, 0.3, pos)
    assert_within_twice_eager(ours, eager, oracle, dtype, "cuda packed")


# --- the pass -----------------------------------------------------------------------------------


def packed_batch(S: int):
    """tokens [2, S + 1] and pos [2, S]: a different packing per row (see packed_positions)."""
    return tokens(2, S, seed=4), packed_positions(S)


def assert_fired_with_pos(model, layers):
    r = row(model, PASS)
    assert r["matches"] == layers and r["where"] == [f"blocks.{i}.attn" for i in range(layers)], r
    # block ids from the eager chain (select_blocks off) may, for all the pass knows, leave a row
    # empty: eager's NaN is kept there; from nsa.select_blocks they cannot
    selected_by_op = any(r["name"] == "select_blocks" and r["matches"] for r in nsa_compile.report(model))
    empty = "" if selected_by_op else "rows with no token: NaN as eager; "
    assert r["kernels"] == [
        "nsa.selected_attention[reference] (l'=16, n=3, GQA-native, no gathered K/V, packed documents (pos); "
        f"{empty}not triton: the Triton kernels run on CUDA (tensors on cpu))"], r["kernels"]
    record = only_graph(model)
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.selected_attention(" in line]
    assert len(calls) == layers and all(", 'reference', l_pos_);" in line for line in calls), calls
    assert "torch.gather(" in record.code_before and "torch.gather(" not in record.code_after
    for part, op in (("forward", torch.ops.nsa.selected_attention.default),
                     ("backward", torch.ops.nsa.selected_attention_backward.default)):
        gm = record.aten[part]
        assert not any(node.target is torch.ops.aten.gather.default for node in gm.graph.nodes)
        ops = [node for node in gm.graph.nodes if node.target is op]
        assert len(ops) == layers and all(len(node.args) == (11 if part == "backward" else 8) for node in ops)


SELECTION_ONLY = nsa_compile.OptimizeConfig(
    compiler="aot_eager", disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != PASS))


@pytest.mark.parametrize("config, dtype", [(SELECTION_ONLY, torch.float32), (SELECTION_ONLY, torch.bfloat16),
                                           (nsa_compile.OptimizeConfig(compiler="aot_eager"), torch.float32)],
                         ids=["selection-pass-only", "selection-pass-only-bf16", "every-pass"])
def test_packed_model_fires_per_layer_with_pos_and_matches_eager(config, dtype):
    torch.manual_seed(0)
    eager = build_model("tiny")
    batch, pos = packed_batch(90)
    optimized = []

    def optimize(model):
        optimized.append(optimize_fresh(model, config))
        return optimized[-1]

    report = check_parity(eager, optimize, (batch[:, :-1], pos), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert len(report.rows) == 2 + len(list(eager.parameters()))
    assert_fired_with_pos(optimized[0], 2)


class PackedSelected(nn.Module):
    """NSAAttention.selected_attention(..., pos) on q [B, S, H, Dk], k/v [B, S, G, D], block_idx
    [B, G, S, n] and pos [B, S], written as in models/nsa.py except for `change`."""

    def __init__(self, block=4, change=None):
        super().__init__()
        self.block, self.change = block, change

    def forward(self, q, k, v, block_idx, pos, extra=None):
        B, S, H, Dk = q.shape
        G, Dv, ls, change = k.shape[2], v.shape[3], self.block, self.change
        h = H // G
        if change == "pos-through-views":
            pos = pos[:, :S].reshape(B, S)
        offsets = torch.arange(ls, device=q.device)
        row_tokens = (block_idx.clamp(min=0)[..., None] * ls + offsets).flatten(-2)  # [B, G, S, n*l']
        t = torch.arange(S, device=q.device)[:, None]
        start = t - pos[:, None, :, None]  # [B, 1, S, 1]
        if change == "start-off-by-one":
            start = start + 1
        if change == "two-position-inputs":
            start = start - extra[:, None, :, None]
        tokens = row_tokens if change == "row-start" else row_tokens + start
        chosen = (block_idx >= 0)[..., None].expand(-1, -1, -1, -1, ls).flatten(-2)
        if change == "row-start":  # masked by document, but blocks counted from the row start
            valid = chosen & (tokens <= t) & (tokens >= start)
        elif change == "mask-ignores-pos":
            valid = chosen & (row_tokens <= t)
        else:
            valid = chosen & (tokens <= t)
        tokens = tokens.clamp(max=S - 1)
        T = tokens.shape[-1]
        index = tokens.flatten(2)[..., None]  # [B, G, S*n*l', 1]
        k_sel = torch.gather(k.transpose(1, 2), 2, index.expand(-1, -1, -1, Dk)).view(B, G, S, T, Dk)
        v_sel = torch.gather(v.transpose(1, 2), 2, index.expand(-1, -1, -1, Dv)).view(B, G, S, T, Dv)
        k_rep = k_sel.repeat_interleave(h, dim=1) if h > 1 else k_sel  # [B, H, S, T, Dk]
        v_rep = v_sel.repeat_interleave(h, dim=1) if h > 1 else v_sel
        scores = upcast(q.transpose(1, 2).unsqueeze(-2) @ k_rep.transpose(-1, -2)).squeeze(-2) * Dk**-0.5
        scores = scores.masked_fill(~valid.repeat_interleave(h, dim=1), float("-inf"))
        p = torch.softmax(scores, dim=-1)
        return (p.to(v_sel.dtype).unsqueeze(-2) @ v_rep).squeeze(-2).transpose(1, 2)  # [B, S, H, Dv]


def packed_inputs(h=2, S=40, n=3, block=4, pos_dtype=torch.int64):
    """q, k, v, block ids relative to each query's document (slot 0 its current block, the others
    random earlier document blocks or -1) and pos [2, S] (rows packed differently)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, S, G * h, 8, generator=g)
    k = torch.randn(2, S, G, 8, generator=g)
    v = torch.randn(2, S, G, 6, generator=g)
    pos = torch.stack([positions([1, 2, 3, 9, 25]), positions([4, 13, 23])])
    current = (pos // block)[:, None, :, None].expand(2, G, S, n)
    others = (torch.rand(2, G, S, n, generator=g) * (current + 2)).long() - 1  # in [-1, current]
    return q, k, v, torch.where(torch.arange(n) == 0, current, others), pos.to(pos_dtype)


def run_both(module, args, config=None):
    def leaves():
        return [x.clone().requires_grad_() if x.is_floating_point() else x for x in args]

    eager_args, opt_args = leaves(), leaves()
    expected = module(*eager_args)
    optimized = optimize_fresh(copy.deepcopy(module), config or nsa_compile.OptimizeConfig(compiler="aot_eager"))
    return (expected, eager_args), (optimized(*opt_args), opt_args), optimized


@pytest.mark.parametrize("change, h", [(None, 2), (None, 1), ("pos-through-views", 3)],
                         ids=["model", "h1-no-repeat", "pos-through-views"])
def test_accepted_packed_forms(change, h):
    (expected, eager_args), (got, opt_args), optimized = run_both(PackedSelected(change=change), packed_inputs(h))
    r = row(optimized, PASS)
    assert r["matches"] == 1 and r["kernels"][0].startswith(
        "nsa.selected_attention[reference] (l'=4, n=3, GQA-native, no gathered K/V, packed documents (pos);"), r
    code = only_graph(optimized).code_after
    assert "torch.gather(" not in code and "'reference', l_pos_)" in code
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), opt_args[:3]),
                    torch.autograd.grad(expected.square().sum(), eager_args[:3])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


PACKED_NEAR_MISSES = [
    ("row-start",
     "the token ids are counted from the row start (block * l' + offset), not from the document start t - pos[t]"),
    ("start-off-by-one", "the document start is off by one: token ids (t - pos[t]) + 1 + block * l' + offset"),
    ("mask-ignores-pos",
     "the mask compares token ids counted from the row start with t (it ignores the document start t - pos[t])"),
    ("two-position-inputs", "the token ids or the mask depend on 2 int64 [B, S] inputs (l_pos_, l_extra_); "
                            "packed documents take one, the positions pos"),
    ("int32-positions", "the token ids or the mask depend on placeholder l_pos_ (data other than one "
                        "[B, G, S, n] block index tensor and positions)"),
]


@pytest.mark.parametrize("change, reason", PACKED_NEAR_MISSES, ids=[change for change, _ in PACKED_NEAR_MISSES])
def test_packed_near_misses_refused_with_the_graph_unchanged(change, reason):
    args = packed_inputs(pos_dtype=torch.int32 if change == "int32-positions" else torch.int64)
    if change == "two-position-inputs":
        args = (*args, torch.zeros_like(args[-1]))
    module = PackedSelected(change=None if change == "int32-positions" else change)
    config = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=("gqa_grouped_matmul",))
    (expected, _), (got, _), optimized = run_both(module, args, config)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)  # the same eager code
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and reason in r["reasons"], r["reasons"]


def test_near_misses_are_real_differences_only_packed_probes_show():
    """The row-start and off-by-one forms differ from the model on packed positions but equal it
    on one document per row for the first: only probes with document starts inside the row
    catch it (and the pass's probes include them)."""
    q, k, v, idx, pos = packed_inputs()
    model, row_start = PackedSelected(), PackedSelected(change="row-start")
    assert not torch.allclose(model(q, k, v, idx, pos), row_start(q, k, v, idx, pos))
    one_doc = torch.arange(40).expand(2, 40)
    cur = (one_doc // 4)[:, None, :, None].expand(2, G, 40, 3)
    torch.testing.assert_close(model(q, k, v, cur, one_doc), row_start(q, k, v, cur, one_doc), rtol=0, atol=0)


def test_position_probes_cover_the_packings():
    B_, S, n, block = 3, 200, 3, 16
    probes = selection_pass.position_probes(B_, S, n, block, "cpu")
    assert len(probes) == selection_pass.POSITION_KINDS
    lengths, starts = set(), set()
    for p in probes:
        check_positions(p, S)  # valid positions: 0 at each document start, +1 per token
        assert all(not torch.equal(p[0], p[b]) for b in range(1, B_))  # the rows of a probe differ
        for r in p:
            cuts = torch.nonzero(r == 0).flatten().tolist() + [S]
            lengths |= {b - a for a, b in zip(cuts, cuts[1:])}
            starts |= {c % block for c in cuts[:-1]}
    assert {1, 2, block - 1, S}.issubset(lengths) and max(lengths - {S}) > n * block
    assert {0, 1}.issubset(starts)  # documents starting on block boundaries and one token off
    # with one batch row every kind is probed all the same
    kinds = {tuple(selection_pass.position_probes(1, S, n, block, "cpu")[i][0].tolist()) for i in range(4)}
    assert len(kinds) == 4 and tuple(range(S)) in kinds
    # the block probes follow each query's document: its current block appears
    pos = probes[1]
    structured = selection_pass.probes(B_, G, S, n, block, "cpu", pos)[0]
    assert (structured == (pos // block)[:, None, :, None]).any(-1).float().mean() > 0.3


@pytest.mark.gpu
@pytest.mark.inductor
def test_inductor_smoke_packed_on_cuda():
    """The packed form through Inductor on CUDA: the pass fires with pos (the triton backend, its
    document mask) and the compiled module gives the eager outputs and gradients."""
    args = [x.cuda() for x in packed_inputs(h=3)]
    (expected, eager_args), (got, opt_args), optimized = run_both(
        PackedSelected(), args, nsa_compile.OptimizeConfig(disabled_passes=("gqa_grouped_matmul",)))
    r = row(optimized, PASS)
    assert r["matches"] == 1 and "packed documents (pos)" in r["kernels"][0], r
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), opt_args[:3]),
                    torch.autograd.grad(expected.square().sum(), eager_args[:3])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
