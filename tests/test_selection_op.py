"""nsa::selected_attention (+ its backward op) against the eager gather formula of models/nsa.py."""

import itertools

import pytest
import torch
from oracles import (
    AllocationSpy, assert_close_all, assert_compiles_like_eager, assert_fakes_promise_the_layout,
    assert_graphs_hold_the_ops, assert_raises_eager_and_fake, assert_within_twice_eager, attention_inputs,
    opcheck_forward_and_backward, qkv_argument_errors, rel_rms, upcast,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile.ops
from nsa_compile.models.config import ModelConfig
from nsa_compile.models.nsa import NSAAttention
from nsa_compile.ops import selection as sel_mod
from nsa_compile.ops import selected_attention, selected_attention_backward

B, G, DK, DV, LS = 2, 2, 16, 24, 16
SEQ_LENS = (1, 17, 63, 100, 200)  # 100, 200 > REFERENCE_CHUNK (64): chunk boundaries inside
N_SELECTED = (3, 5)
GROUP_SIZES = (1, 3)


def eager_selected(q, k, v, block_idx, block_size, scale):
    """NSAAttention.selected_attention with heads before sequence: q [B,H,S,Dk], k/v [B,G,S,D]."""
    Bq, H, S, Dk = q.shape
    Gk, Dv = k.shape[1], v.shape[3]
    h = H // Gk
    offsets = torch.arange(block_size)
    tokens = (block_idx.clamp(min=0)[..., None] * block_size + offsets).flatten(-2)  # [B, G, S, T]
    t = torch.arange(S)[:, None]
    chosen = (block_idx >= 0)[..., None].expand(-1, -1, -1, -1, block_size).flatten(-2)
    valid = chosen & (tokens <= t)
    tokens = tokens.clamp(max=S - 1)
    T = tokens.shape[-1]
    index = tokens.flatten(2)[..., None]  # [B, G, S*T, 1]
    k_sel = torch.gather(k, 2, index.expand(-1, -1, -1, Dk)).view(Bq, Gk, S, T, Dk)
    v_sel = torch.gather(v, 2, index.expand(-1, -1, -1, Dv)).view(Bq, Gk, S, T, Dv)
    k_sel = k_sel.repeat_interleave(h, dim=1)  # [B, H, S, T, Dk]
    v_sel = v_sel.repeat_interleave(h, dim=1)
    scores = upcast(q.unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * scale  # [B, H, S, T]
    scores = scores.masked_fill(~valid.repeat_interleave(h, dim=1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return (p.to(v_sel.dtype).unsqueeze(-2) @ v_sel).squeeze(-2)  # [B, H, S, Dv]


def model_cfg(h, n, g=G, dk=DK, dv=DV):
    return ModelConfig(
        dim=32, n_heads=g * h, n_kv_groups=g, head_dim=dk, head_dim_v=dv,
        cmp_block=16, cmp_stride=8, sel_block=LS, n_selected=n,
    )  # fmt: skip


def make_block_idx(S, h, n, seed=0, b=B, g=G):
    """The eager model's own selection on a random p_cmp [B, H, S, Tc]."""
    attn = NSAAttention(model_cfg(h, n, g))
    Tc = max(0, (S - 16) // 8 + 1)
    gen = torch.Generator().manual_seed(seed + 1000)
    p_cmp = torch.rand(b, g * h, S, Tc, generator=gen)
    return attn.select_blocks(p_cmp, S)


def make_inputs(S, h, dtype, seed=0, b=B, g=G, dk=DK, dv=DV):
    """q, k, v in the model's layout ([B, S, heads, D]) transposed to heads-first (non-contiguous),
    plus a fixed output gradient."""
    return attention_inputs(b, S, h, g, dk, dv, dtype, seed)


def run(fn, q, k, v, grad_o, block_idx, scale, block_size=LS):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, block_idx, block_size, scale)
    grads = torch.autograd.grad(o, leaves, grad_o)
    return (o.detach(), *grads)


def test_selection_is_sparse_in_the_cases_tested():
    """The cases below must include rows whose selection is not all of [0, t] (else it is causal
    attention), rows with -1 padding, and a block set that differs between the two groups."""
    t = torch.arange(200)
    for n in N_SELECTED:
        idx = make_block_idx(200, 3, n, seed=5)
        assert (idx == -1).any()  # early tokens have fewer than n candidate blocks
        tokens = idx.clamp(min=0)[..., None] * LS + torch.arange(LS)
        n_valid = ((idx >= 0)[..., None] & (tokens <= t[:, None, None])).flatten(-2).sum(-1)
        assert (n_valid < t + 1).any()  # some rows skip past tokens
        assert (n_valid >= 1).all()
    # n = 5 leaves two free choices, made from p_cmp: the groups differ (n = 3 is all forced)
    assert not torch.equal(idx[:, 0], idx[:, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_fp32_fp64(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for S, n, h in itertools.product(SEQ_LENS, N_SELECTED, GROUP_SIZES):
        seed = S * 7 + n + h
        q, k, v, grad_o = make_inputs(S, h, dtype, seed=seed)
        idx = make_block_idx(S, h, n, seed=seed)
        scale = DK**-0.5
        ours = run(selected_attention, q, k, v, grad_o, idx, scale)
        ref = run(eager_selected, q, k, v, grad_o, idx, scale)
        assert ours[0].shape == (B, G * h, S, DV) and ours[0].dtype == dtype
        assert_close_all(ours, ref, f"S={S} n={n} h={h}", **tol)


def test_test_formula_is_the_models_method():
    """eager_selected (heads first) == NSAAttention.selected_attention (sequence first)."""
    h, n, S = 3, 3, 100
    attn = NSAAttention(model_cfg(h, n))
    q, k, v, _ = make_inputs(S, h, torch.float64, seed=11)
    idx = make_block_idx(S, h, n, seed=11)
    want = attn.selected_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), idx).transpose(1, 2)
    torch.testing.assert_close(eager_selected(q, k, v, idx, LS, attn.scale), want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(selected_attention(q, k, v, idx, LS, attn.scale), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_vs_fp64_oracle(dtype):
    worst = 0.0
    for S, n, h in itertools.product((17, 100, 200), N_SELECTED, GROUP_SIZES):
        seed = S + n + h
        q, k, v, grad_o = make_inputs(S, h, dtype, seed=seed)
        idx = make_block_idx(S, h, n, seed=seed)
        scale = DK**-0.5
        oracle = run(eager_selected, *(x.double() for x in (q, k, v, grad_o)), idx, scale)
        ours = run(selected_attention, q, k, v, grad_o, idx, scale)
        eager = run(eager_selected, q, k, v, grad_o, idx, scale)
        worst = max(worst, assert_within_twice_eager(ours, eager, oracle, dtype, f"S={S} n={n} h={h}"))
    assert worst > 0


def test_chunk_boundaries(monkeypatch):
    """Small chunks (not dividing S, not aligned with blocks): same result, exactly."""
    for chunk in (1, 7, 16, 64):
        monkeypatch.setattr(sel_mod, "REFERENCE_CHUNK", chunk)
        for S in (17, 100):
            q, k, v, grad_o = make_inputs(S, 3, torch.float64, seed=S + chunk)
            idx = make_block_idx(S, 3, 3, seed=S + chunk)
            ours = run(selected_attention, q, k, v, grad_o, idx, 0.3)
            ref = run(eager_selected, q, k, v, grad_o, idx, 0.3)
            assert_close_all(ours, ref, f"S={S} chunk={chunk}", rtol=1e-12, atol=1e-12)


def test_hand_built_block_idx_and_empty_rows():
    """Hand-built selection: a row of only -1 gives output 0 and no gradient anywhere; other rows
    (non-forced block sets, a block past the end, blocks ahead of the query) match eager."""
    S, h, n = 40, 3, 3  # blocks 0, 1, 2 (the last is partial: tokens 32..39)
    q, k, v, grad_o = make_inputs(S, h, torch.float64, seed=4)
    idx = make_block_idx(S, h, n, seed=4).clone()
    idx[0, 1, 5] = -1  # empty row (b 0, group 1, t 5)
    idx[1, 0, 38] = torch.tensor([1, -1, -1])  # only an earlier block: tokens 16..31
    idx[1, 1, 30] = torch.tensor([0, 2, 5])  # block 2 lies after t = 30, block 5 past the end
    idx[0, 0, 20] = torch.tensor([2, -1, -1])  # only a later block: no valid token, empty
    ours = run(selected_attention, q, k, v, grad_o, idx, 0.4)
    ref = run(eager_selected, q, k, v, grad_o, idx, 0.4)
    o, dq, dk, dv = ours
    assert not any(x.isnan().any() for x in ours)
    for b, g, t in ((0, 1, 5), (0, 0, 20)):
        heads = slice(g * h, (g + 1) * h)
        assert torch.equal(o[b, heads, t], torch.zeros(h, DV))
        assert torch.equal(dq[b, heads, t], torch.zeros(h, DK))
        assert ref[0][b, heads, t].isnan().all()  # eager itself gives NaN there
    # elsewhere equal to eager; the eager NaN rows poison only their own row and the gathered
    # keys' gradients, so compare o and dq outside the empty rows, dk and dv against an eager run
    # whose empty rows get zero output gradient
    keep = torch.ones(B, G * h, S, 1, dtype=torch.bool)
    keep[0, h : 2 * h, 5] = False
    keep[0, 0:h, 20] = False
    torch.testing.assert_close(o * keep, ref[0].nan_to_num() * keep, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq * keep, ref[1].nan_to_num() * keep, rtol=1e-12, atol=1e-12)
    # dk/dv: the empty rows' keys get nothing from them; rebuild eager without those rows by
    # giving them a dummy valid block (its output gradient 0 makes its contribution 0)
    idx2 = idx.clone()
    idx2[0, 1, 5] = torch.tensor([0, -1, -1])
    idx2[0, 0, 20] = torch.tensor([0, -1, -1])
    ref2 = run(eager_selected, q, k, v, grad_o * keep, idx2, 0.4)
    torch.testing.assert_close(dk, ref2[2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dv, ref2[3], rtol=1e-12, atol=1e-12)


def test_all_padding_gives_zeros():
    q, k, v, grad_o = make_inputs(30, 2, torch.float32, seed=6)
    for n in (0, 3):
        idx = torch.full((B, G, 30, n), -1, dtype=torch.int64)
        o, dq, dk, dv = run(selected_attention, q, k, v, grad_o, idx, 0.5)
        for x in (o, dq, dk, dv):
            assert torch.equal(x, torch.zeros_like(x))


def test_mixed_dtypes_follow_eager():
    """q, k in bf16 and v in fp32: p is cast to v's dtype, the output is fp32, grads keep dtypes."""
    q, k, _, _ = make_inputs(100, 3, torch.bfloat16, seed=1)
    _, _, v, grad_o = make_inputs(100, 3, torch.float32, seed=2)
    idx = make_block_idx(100, 3, 3, seed=1)
    ours = run(selected_attention, q, k, v, grad_o, idx, 0.25)
    ref = run(eager_selected, q, k, v, grad_o, idx, 0.25)
    for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert a.dtype == r.dtype, name
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
        assert rel_rms(a, r) < 5e-3, name


def test_memory_bounded_gqa_native_and_fully_written():
    S, h, n, chunk, D = 1024, 4, 3, 64, 8
    q, k, v, grad_o = make_inputs(S, h, torch.float32, b=1, dk=D, dv=D)
    idx = make_block_idx(S, h, n, seed=2, b=1)
    spy = AllocationSpy()
    with spy:
        o, _ = sel_mod._reference_forward(q, k, v, idx, LS, 0.25, chunk)
        dq, dk, dv = sel_mod._reference_backward(grad_o, q, k, v, idx, LS, 0.25, chunk)
    T = n * LS
    # largest intermediate: one chunk's gathered K/V [1, G, chunk, T, D] or scores
    # [1, G, chunk, h, T], or the full-size outputs [1, H, S, D]; never a gather over all S
    # (eager's k_sel alone is [1, H, S, T, D])
    per_chunk = G * chunk * T * max(h, D)
    assert spy.max_numel <= max(per_chunk, G * h * S * D) < G * S * T * D // 4
    # K and V are never repeated per head: q @ k_sel^T is one bmm over (batch, group, query)
    # whose rows are the group's h heads
    assert "repeat_interleave" not in spy.names and "repeat" not in spy.names
    assert ((G * chunk, h, D), (G * chunk, D, T)) in spy.bmm_shapes
    ref = run(eager_selected, q, k, v, grad_o, idx, 0.25)
    assert_close_all((o, dq, dk, dv), ref, "spy", rtol=1e-5, atol=1e-5)


def test_low_precision_dk_dv_accumulate_in_fp32(monkeypatch):
    """Many queries add to the same keys (block 0 is forced for every row): the sums must not
    round to bf16 on the way."""
    monkeypatch.setattr(sel_mod, "REFERENCE_CHUNK", 8)
    S = 512
    q, k, v, grad_o = make_inputs(S, 1, torch.bfloat16, seed=3, b=1, g=1, dk=8, dv=8)
    idx = make_block_idx(S, 1, 3, seed=3, b=1, g=1)
    oracle = run(eager_selected, *(x.double() for x in (q, k, v, grad_o)), idx, 0.3)
    ours = run(selected_attention, q, k, v, grad_o, idx, 0.3)
    for name in ("dk", "dv"):
        i = ("o", "dq", "dk", "dv").index(name)
        # block 0's keys collect a sum over all 512 queries; bf16 accumulation would be ~1e-2 off
        err = rel_rms(ours[i][:, :, :LS], oracle[i][:, :, :LS])
        assert err < 4e-3, f"{name}: {err:.2e}"


def test_opcheck_forward_and_backward_ops():
    for S, h, n, v_dtype in ((7, 3, 3, torch.float32), (40, 1, 3, torch.float32), (33, 2, 5, torch.float64)):
        q, k, v, grad_o = make_inputs(S, h, torch.float32, dk=8, dv=5)
        v, grad_o = v.to(v_dtype), grad_o.to(v_dtype)
        idx = make_block_idx(S, h, n, seed=S)
        opcheck_forward_and_backward(torch.ops.nsa.selected_attention, torch.ops.nsa.selected_attention_backward,
                                     q, k, v, grad_o, idx, 8, 0.5)


def model_loss(x_q, x_k, x_v, idx):
    o = selected_attention(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), idx, LS, 0.3)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def eager_loss(x_q, x_k, x_v, idx):
    o = eager_selected(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), idx, LS, 0.3)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def model_inputs(S, h=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, S, G * h, DK), (B, S, G, DK), (B, S, G, DV))
    return [torch.randn(*s, generator=gen, requires_grad=True) for s in shapes]


def test_compile_fullgraph_aot_eager_forward_backward():
    assert_compiles_like_eager(model_loss, eager_loss, model_inputs(150), make_block_idx(150, 3, 5, seed=9))


def test_compiled_graphs_hold_the_ops_and_fakes_take_dynamic_shapes():
    cases = [(model_inputs(S, seed=S), make_block_idx(S, 3, 3, seed=S)) for S in (40, 77)]
    assert_graphs_hold_the_ops(model_loss, eager_loss, cases, torch.ops.nsa.selected_attention.default,
                               torch.ops.nsa.selected_attention_backward.default)


def bad_args(**change):
    q, k, v, _ = make_inputs(8, 2, torch.float32)
    args = dict(q=q, k=k, v=v, block_idx=torch.zeros(2, 2, 8, 3, dtype=torch.int64), block_size=4, scale=0.5)
    args.update(change)
    return args


BAD = [
    *qkv_argument_errors(B, 2 * G, G, 8, DK, DV),  # the inputs of bad_args: S = 8, h = 2
    (dict(block_idx=torch.zeros(2, 2, 8, 3, dtype=torch.int32)), "block_idx must be an int64"),
    (dict(block_idx=torch.zeros(2, 2, 8, dtype=torch.int64)), r"block_idx must have shape \[B, G, S, n\]"),
    (dict(block_idx=torch.zeros(2, 4, 8, 3, dtype=torch.int64)), r"block_idx must have shape"),
    (dict(block_idx=torch.zeros(2, 2, 7, 3, dtype=torch.int64)), r"block_idx must have shape"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(block_size=-16), "block_size must be >= 1"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m for _, m in BAD])
def test_argument_validation(change, match):
    assert_raises_eager_and_fake(selected_attention, bad_args(**change), match)


def test_backward_op_validates_grad_shape():
    q, k, v, grad_o = make_inputs(8, 2, torch.float32)
    idx = torch.zeros(2, 2, 8, 3, dtype=torch.int64)
    o, lse = torch.ops.nsa.selected_attention(q, k, v, idx, 4, 0.5)
    selected_attention_backward(grad_o, q, k, v, o, lse, idx, 4, 0.5)
    with pytest.raises(ValueError, match="grad_o must have shape"):
        selected_attention_backward(grad_o[:, :, :7], q, k, v, o, lse, idx, 4, 0.5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        selected_attention_backward(grad_o[:, :3], q[:, :3], k, v, o, lse, idx, 4, 0.5)
    with pytest.raises(ValueError, match="block_idx must be an int64"):
        selected_attention_backward(grad_o, q, k, v, o, lse, idx.int(), 4, 0.5)


def test_log_sum_exp_and_backend_choice():
    S, h, n = 40, 3, 3
    q, k, v, _ = make_inputs(S, h, torch.float64, seed=5)
    idx = make_block_idx(S, h, n, seed=5)
    _, lse = torch.ops.nsa.selected_attention(q, k, v, idx, LS, 0.3)
    # the eager scores of the gathered tokens, -inf where invalid, reduced per row
    tokens = (idx.clamp(min=0)[..., None] * LS + torch.arange(LS)).flatten(-2)  # [B, G, S, T]
    valid = (idx >= 0).repeat_interleave(LS, dim=-1) & (tokens <= torch.arange(S)[:, None])
    tokens = tokens.clamp(max=S - 1)
    k_sel = torch.gather(k, 2, tokens.flatten(2)[..., None].expand(-1, -1, -1, k.shape[-1]))
    k_sel = k_sel.view(*tokens.shape, -1).repeat_interleave(h, dim=1)  # [B, H, S, T, Dk]
    scores = (q.unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * 0.3
    scores = scores.masked_fill(~valid.repeat_interleave(h, dim=1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), rtol=1e-6, atol=1e-6)
    assert sel_mod.choose_backend(q, k, v, idx, LS) == "reference"  # the CPU: auto never interprets
    assert "run on CUDA" in sel_mod.why_not_triton(q, k, v, idx, LS)
    with pytest.raises(ValueError, match="unknown backend 'cuda'; valid: auto, triton, reference"):
        selected_attention(q, k, v, idx, LS, 0.3, "cuda")


def test_outputs_keep_the_layout_the_fakes_promise():
    """Inductor trusts a custom op's fake strides: the real outputs must have the same ones."""
    q, k, v, grad_o = make_inputs(50, 3, torch.float32)
    idx = make_block_idx(50, 3, 3, seed=1)
    assert_fakes_promise_the_layout(torch.ops.nsa.selected_attention, selected_attention_backward, grad_o, q, k, v,
                                    idx, LS, 0.5)


def test_public_surface():
    assert nsa_compile.ops.selected_attention is selected_attention
    assert nsa_compile.ops.selected_attention_backward is selected_attention_backward
    schema = torch.ops.nsa.selected_attention.default._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "block_idx", "block_size", "scale", "backend", "pos",
                                                  "q_offset", "doc_len"]
    for op in (torch.ops.nsa.selected_attention, torch.ops.nsa.selected_attention_backward):
        # packed documents; a chunk of queries (tests/test_query_offset.py); the longest document
        # (the tiles' hint: tests/test_selection_triton.py)
        assert ', str backend="auto", Tensor? pos=None, int q_offset=0, int doc_len=0) -> (' in str(op.default._schema)
    assert len(schema.returns) == 2  # o and the log-sum-exp
