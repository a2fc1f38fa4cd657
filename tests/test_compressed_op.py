"""nsa::compressed_attention (+ its backward op): the reference backend against the eager formula
of models/nsa.py (float64 oracle), the Triton kernels (nsa_compile/ops/compressed_triton.py)
against the reference backend, on CUDA when there is one, else through Triton's interpreter
(TRITON_INTERPRET=1, set by a class fixture for the Triton tests only and restored after them),
and GPU-marked checks at larger sizes (`gpu`; the issue sizes also under `sweep`).
"""

import itertools

import pytest
import torch
from oracles import (
    FLOORS, NAMES, AllocationSpy, assert_backend_matches_reference, assert_close_all, assert_compiles_like_eager,
    assert_fakes_promise_the_layout, assert_graphs_hold_the_ops, assert_kernel_matches_reference, assert_lse_close,
    assert_raises_eager_and_fake, assert_within_twice_eager, attention_inputs, gqa_argument_errors,
    opcheck_forward_and_backward, rel_rms, run_without_triton, triton_interpreter, upcast,
)
from helpers import random_lengths
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile
import nsa_compile.ops
from nsa_compile.models.config import ModelConfig
from nsa_compile.models.nsa import NSAAttention, positions_from_cu_seqlens
from nsa_compile.ops import compressed as cmp_mod
from nsa_compile.ops import compressed_attention, compressed_attention_backward
from nsa_compile.ops import compressed_triton as ct

B, G, DK, DV = 2, 2, 16, 24


def n_blocks(S, l, d):
    """Tc of NSA_SEMANTICS.md section 2."""
    return (S - l) // d + 1 if S >= l else 0


def eager_scores(q, k, l, d, scale):
    """The eager scores [B, H, S, Tc] (upcast(q @ k^T) * scale, K repeated per head) and the
    visibility [S, Tc]."""
    S, Tc, h = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    scores = upcast(q @ k.repeat_interleave(h, dim=1).transpose(-1, -2)) * scale
    visible = torch.arange(Tc)[None, :] * d + l - 1 <= torch.arange(S)[:, None]
    return scores, visible


def eager_compressed(q, k, v, l, d, scale):
    """NSAAttention.compressed_attention's attention step, heads first, on compression tokens:
    q [B, H, S, Dk], k [B, G, Tc, Dk], v [B, G, Tc, Dv] -> o [B, H, S, Dv]."""
    h = q.shape[1] // k.shape[1]
    scores, visible = eager_scores(q, k, l, d, scale)
    scores = scores.masked_fill(~visible, float("-inf"))
    has_block = visible.any(dim=-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible
    return p.to(v.dtype) @ v.repeat_interleave(h, dim=1)


def make_inputs(S, h, dtype, l=8, d=4, seed=0, b=B, g=G, dk=DK, dv=DV, Tc=None):
    """q in the model's layout ([B, S, H, Dk] memory) transposed to heads-first, k and v as
    [B, Tc, G, D] memory (what compression produces) transposed, a fixed output gradient."""
    return attention_inputs(b, S, h, g, dk, dv, dtype, seed, kv_len=n_blocks(S, l, d) if Tc is None else Tc)


def run(fn, q, k, v, grad_o, l, d, scale, *extra):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, l, d, scale, *extra)
    grads = torch.autograd.grad(o, leaves, grad_o, allow_unused=True)
    return (o.detach(), *(torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)))


# --- the reference backend against the eager formula ------------------------------------------

# S, (l, d), h: S not a multiple of l, d != l and d == l, batch 2, Dk 16 != Dv 24
SEQ_LENS = (31, 32, 63, 100)
BLOCKS = ((8, 4), (6, 3), (8, 8))
GROUP_SIZES = (1, 4, 6)


def test_test_formula_is_the_models_method():
    """eager_compressed on mean-pooled K/V == NSAAttention.compressed_attention (sequence first)."""
    h, S, l, d = 3, 70, 16, 8
    cfg = ModelConfig(dim=32, n_heads=G * h, n_kv_groups=G, head_dim=DK, head_dim_v=DV, cmp_block=l, cmp_stride=d,
                      sel_block=16, n_selected=3)  # fmt: skip
    attn = NSAAttention(cfg).double()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, G * h, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, G, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(B, S, G, DV, generator=gen, dtype=torch.float64)
    want_o, want_p = attn.compressed_attention(q, k, v)
    k_cmp, v_cmp = attn.compress(k, None, d).transpose(1, 2), attn.compress(v, None, d).transpose(1, 2)  # [B, G, Tc, D]
    assert k_cmp.shape[2] == n_blocks(S, l, d)
    ours = eager_compressed(q.transpose(1, 2), k_cmp, v_cmp, l, d, attn.scale).transpose(1, 2)
    torch.testing.assert_close(ours, want_o, rtol=1e-13, atol=1e-13)
    o, lse = torch.ops.nsa.compressed_attention(q.transpose(1, 2), k_cmp, v_cmp, l, d, attn.scale)
    torch.testing.assert_close(o.transpose(1, 2), want_o, rtol=1e-12, atol=1e-12)
    # lse rebuilds the model's p_cmp (float32 for float64 inputs, as nsa::selected_attention)
    assert lse.dtype == torch.float32
    scores, visible = eager_scores(q.transpose(1, 2), k_cmp, l, d, attn.scale)
    p = torch.where(visible, torch.exp(scores - lse.double()[..., None]), 0.0)  # 0 on empty rows
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_fp32_fp64(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for S, (l, d), h in itertools.product(SEQ_LENS, BLOCKS, GROUP_SIZES):
        seed = S * 7 + l + d + h
        q, k, v, grad_o = make_inputs(S, h, dtype, l, d, seed=seed)
        ours = run(compressed_attention, q, k, v, grad_o, l, d, DK**-0.5)
        ref = run(eager_compressed, q, k, v, grad_o, l, d, DK**-0.5)
        assert ours[0].shape == (B, G * h, S, DV) and ours[0].dtype == dtype
        assert_close_all(ours, ref, f"S={S} l={l} d={d} h={h}", **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_vs_fp64_oracle(dtype):
    worst = 0.0
    for S, (l, d), h in itertools.product((31, 100), ((8, 4), (6, 3)), GROUP_SIZES):
        seed = S + l + h
        q, k, v, grad_o = make_inputs(S, h, dtype, l, d, seed=seed)
        oracle = run(eager_compressed, *(x.double() for x in (q, k, v, grad_o)), l, d, DK**-0.5)
        ours = run(compressed_attention, q, k, v, grad_o, l, d, DK**-0.5)
        eager = run(eager_compressed, q, k, v, grad_o, l, d, DK**-0.5)
        worst = max(worst, assert_within_twice_eager(ours, eager, oracle, dtype, f"S={S} l={l} d={d} h={h}"))
    assert worst > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lse_is_the_log_sum_exp_of_the_eager_scores(dtype):
    """q @ k^T rounded to the input dtype, then scaled: exp(score - lse) is the eager p (the block
    selection rebuilds p this way), -inf exactly on the rows without a visible block."""
    S, h, l, d = 63, 4, 8, 4
    q, k, v, _ = make_inputs(S, h, dtype, l, d, seed=8)
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, 0.3)
    scores, visible = eager_scores(q, k, l, d, 0.3)
    want = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (B, G * h, S)
    assert torch.equal(lse.isneginf(), want.isneginf()) and lse.isneginf()[:, :, : l - 1].all()
    fin = want.isfinite()
    torch.testing.assert_close(lse[fin], want[fin], rtol=1e-6, atol=1e-6)
    if dtype == torch.bfloat16:  # unrounded scores give a different lse: the rounding is tested
        exact = (q.float() @ k.float().repeat_interleave(h, 1).transpose(-1, -2)) * 0.3
        off = torch.logsumexp(exact.masked_fill(~visible, float("-inf")), -1)[fin]
        assert (off - lse[fin]).abs().max() > 1e-3


def test_rows_without_a_visible_block_and_blocks_never_visible():
    """t < l - 1: o = 0, lse = -inf, dq = 0, no NaN anywhere; k and v with more compression tokens
    than any query sees (Tc past the end): those tokens get zero gradient."""
    S, h, l, d = 30, 3, 8, 4
    Tc = n_blocks(S, l, d) + 3  # 3 tokens that no t < S sees
    q, k, v, grad_o = make_inputs(S, h, torch.float64, l, d, seed=4, Tc=Tc)
    ours = run(compressed_attention, q, k, v, grad_o, l, d, 0.4)
    ref = run(eager_compressed, q, k, v, grad_o, l, d, 0.4)
    assert not any(x.isnan().any() for x in ours)
    assert_close_all(ours, ref, "extra blocks", rtol=1e-12, atol=1e-12)
    o, dq, dk, dv = ours
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, 0.4)
    assert torch.equal(o[:, :, : l - 1], torch.zeros_like(o[:, :, : l - 1]))
    assert torch.equal(dq[:, :, : l - 1], torch.zeros_like(dq[:, :, : l - 1]))
    assert lse[:, :, : l - 1].isneginf().all() and lse[:, :, l - 1 :].isfinite().all()
    assert (o[:, :, l - 1] != 0).all()  # the first query that sees block 0
    assert torch.equal(dk[:, :, -3:], torch.zeros_like(dk[:, :, -3:]))
    assert torch.equal(dv[:, :, -3:], torch.zeros_like(dv[:, :, -3:]))


def test_sequence_shorter_than_a_block_gives_zeros():
    """S < l: Tc = 0 is valid input; o = 0, lse = -inf, dq = 0 and empty dk, dv (the eager model
    returns zeros there and its compression parameters get no gradient)."""
    for S, l in ((5, 8), (1, 2)):
        q, k, v, grad_o = make_inputs(S, 2, torch.float32, l, 4, seed=S)
        assert k.shape[2] == 0
        o, dq, dk, dv = run(compressed_attention, q, k, v, grad_o, l, 4, 0.5)
        _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, 4, 0.5)
        assert lse.isneginf().all()
        assert o.shape == (B, 2 * G, S, DV) and torch.equal(o, torch.zeros_like(o))
        assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape and dv.shape == v.shape


def test_chunk_boundaries(monkeypatch):
    """Small chunks (not dividing S, not aligned with blocks, chunks whose rows see no block):
    same result as the oracle, to float64 rounding."""
    for chunk in (1, 5, 16):
        monkeypatch.setattr(cmp_mod, "REFERENCE_CHUNK", chunk)
        for S, h in ((31, 3), (100, 1)):
            q, k, v, grad_o = make_inputs(S, h, torch.float64, 8, 4, seed=S + chunk)
            ours = run(compressed_attention, q, k, v, grad_o, 8, 4, 0.3)
            ref = run(eager_compressed, q, k, v, grad_o, 8, 4, 0.3)
            assert_close_all(ours, ref, f"S={S} chunk={chunk}", rtol=1e-12, atol=1e-12)


def test_chunk_size_follows_the_budget(monkeypatch):
    monkeypatch.setattr(cmp_mod, "REFERENCE_BUDGET", 2 * 4 * 7 * 100)
    chunks = list(cmp_mod._chunks(50, 2, 4, 7, 8, 4, None))
    assert [(t0, t1) for t0, t1, _ in chunks] == [(0, 50)]
    monkeypatch.setattr(cmp_mod, "REFERENCE_BUDGET", 2 * 4 * 7 * 20)
    chunks = list(cmp_mod._chunks(50, 2, 4, 7, 8, 4, None))
    assert [(t0, t1) for t0, t1, _ in chunks] == [(0, 20), (20, 40), (40, 50)]
    # the number of blocks the last row of each chunk sees: (t - 7) // 4 + 1, capped at Tc = 7
    assert [n for *_, n in chunks] == [4, 7, 7]
    assert cmp_mod.visible_blocks(6, 8, 4, 7) == 0 and cmp_mod.visible_blocks(7, 8, 4, 7) == 1


def test_memory_bounded_gqa_native_and_fully_written():
    S, h, l, d, chunk, D = 1024, 4, 16, 8, 64, 8
    q, k, v, grad_o = make_inputs(S, h, torch.float32, l, d, b=1, dk=D, dv=D)
    Tc = k.shape[2]
    spy = AllocationSpy()
    with spy:
        o, lse = cmp_mod._reference_forward(q, k, v, l, d, 0.25, chunk)
        dq, dk, dv = cmp_mod._reference_backward(grad_o, q, k, v, l, d, 0.25, chunk)
    # largest intermediate: one chunk's scores [1, G, h * chunk, Tc] or the full-size outputs;
    # never the [1, H, S, Tc] scores of all queries at once
    per_chunk = G * h * chunk * Tc
    assert spy.max_numel <= max(per_chunk, G * h * S * D) < G * h * S * Tc // 4
    # K and V are never repeated per head: q @ k^T is one bmm per (batch, group) whose rows are
    # the group's h heads; the last chunk reads only the blocks its rows can see (a prefix)
    assert "repeat_interleave" not in spy.names
    assert ((G, h * chunk, D), (G, D, Tc)) in spy.bmm_shapes
    assert ((G, h * chunk, D), (G, D, 7)) in spy.bmm_shapes  # rows 0..63 see blocks 0..6
    ref = run(eager_compressed, q, k, v, grad_o, l, d, 0.25)
    assert_close_all((o, dq, dk, dv), ref, "spy", rtol=1e-5, atol=1e-5)
    assert not lse.isnan().any()


def test_low_precision_dk_dv_accumulate_in_fp32(monkeypatch):
    """Every query adds to block 0's gradient; with 64 chunks the sums must not round to bf16."""
    monkeypatch.setattr(cmp_mod, "REFERENCE_CHUNK", 8)
    S, l, d = 512, 4, 4
    q, k, v, grad_o = make_inputs(S, 1, torch.bfloat16, l, d, seed=3, b=1, g=1, dk=8, dv=8)
    oracle = run(eager_compressed, *(x.double() for x in (q, k, v, grad_o)), l, d, 0.3)
    ours = run(compressed_attention, q, k, v, grad_o, l, d, 0.3)
    for i in (2, 3):
        err = rel_rms(ours[i][:, :, :4], oracle[i][:, :, :4])
        assert err < 4e-3, f"{NAMES[i]}: {err:.2e}"


def test_mixed_dtypes_follow_eager():
    """q, k in bf16 and v in fp32: p is cast to v's dtype, the output is fp32, grads keep dtypes."""
    q, k, _, _ = make_inputs(63, 3, torch.bfloat16, seed=1)
    _, _, v, grad_o = make_inputs(63, 3, torch.float32, seed=2)
    ours = run(compressed_attention, q, k, v, grad_o, 8, 4, 0.25)
    ref = run(eager_compressed, q, k, v, grad_o, 8, 4, 0.25)
    for name, a, r in zip(NAMES, ours, ref):
        assert a.dtype == r.dtype, name
        assert rel_rms(a, r) < 5e-3, name


def test_opcheck_forward_and_backward_ops():
    for S, h, l, d, v_dtype in ((7, 3, 8, 4, torch.float32), (33, 2, 6, 3, torch.float64)):  # Tc = 0 and Tc = 10
        q, k, v, grad_o = make_inputs(S, h, torch.float32, l, d, dk=8, dv=5)
        v, grad_o = v.to(v_dtype), grad_o.to(v_dtype)
        opcheck_forward_and_backward(torch.ops.nsa.compressed_attention, torch.ops.nsa.compressed_attention_backward,
                                     q, k, v, grad_o, l, d, 0.5)


def model_loss(x_q, k, v):
    o = compressed_attention(x_q.transpose(1, 2), k, v, 8, 4, 0.3)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def eager_loss(x_q, k, v):
    o = eager_compressed(x_q.transpose(1, 2), k, v, 8, 4, 0.3)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def model_inputs(S, h=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Tc = n_blocks(S, 8, 4)
    shapes = ((B, S, G * h, DK), (B, G, Tc, DK), (B, G, Tc, DV))
    return [torch.randn(*s, generator=gen) for s in shapes]


def test_compile_fullgraph_aot_eager_forward_backward():
    assert_compiles_like_eager(model_loss, eager_loss, model_inputs(90))


def test_compiled_graphs_hold_the_ops_and_fakes_take_dynamic_shapes():
    cases = [(model_inputs(S, seed=S),) for S in (40, 77)]
    assert_graphs_hold_the_ops(model_loss, eager_loss, cases, torch.ops.nsa.compressed_attention.default,
                               torch.ops.nsa.compressed_attention_backward.default)


def bad_args(**change):
    q, k, v, _ = make_inputs(20, 2, torch.float32)  # Tc = 4
    args = dict(q=q, k=k, v=v, block=8, stride=4, scale=0.5)
    args.update(change)
    return args


BAD = [
    *gqa_argument_errors(B, 2 * G, G, 20, 4, DK, DV),  # the inputs of bad_args: S = 20, Tc = 4, h = 2
    (dict(v=torch.randn(2, 2, 5, 24)), "same number of compression tokens"),
    (dict(stride=-4), "stride must be >= 1"),
    (dict(backend="cuda"), "unknown backend 'cuda'; valid: auto, triton, reference"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m for _, m in BAD])
def test_argument_validation(change, match):
    assert_raises_eager_and_fake(compressed_attention, bad_args(**change), match)


def test_backward_op_validates_grad_shape():
    q, k, v, grad_o = make_inputs(20, 2, torch.float32)
    o, lse = torch.ops.nsa.compressed_attention(q, k, v, 8, 4, 0.5)
    compressed_attention_backward(grad_o, q, k, v, o, lse, 8, 4, 0.5)
    with pytest.raises(ValueError, match="grad_o must have shape"):
        compressed_attention_backward(grad_o[:, :, :7], q, k, v, o, lse, 8, 4, 0.5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        compressed_attention_backward(grad_o[:, :3], q[:, :3], k, v, o, lse, 8, 4, 0.5)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        compressed_attention_backward(grad_o, q, k, v, o, lse, 8, 0, 0.5)


def test_backend_choice_on_the_cpu(monkeypatch):
    q, k, v, _ = make_inputs(20, 2, torch.float32)
    assert cmp_mod.choose_backend(q, k, v, 8, 4) == "reference"  # the CPU: auto never interprets
    assert "run on CUDA" in cmp_mod.why_not_triton(q, k, v, 8, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: device cpu"):
        compressed_attention(q, k, v, 8, 4, 0.5, "triton")


def test_outputs_keep_the_layout_the_fakes_promise():
    """Inductor trusts a custom op's fake strides: the real outputs must have the same ones."""
    q, k, v, grad_o = make_inputs(50, 3, torch.float32)
    o, *_ = assert_fakes_promise_the_layout(torch.ops.nsa.compressed_attention, compressed_attention_backward,
                                            grad_o, q, k, v, 8, 4, 0.5)
    assert o.transpose(1, 2).is_contiguous()  # [B, S, H, Dv] memory


def test_public_surface_and_config():
    assert nsa_compile.ops.compressed_attention is compressed_attention
    assert nsa_compile.ops.compressed_attention_backward is compressed_attention_backward
    schema = torch.ops.nsa.compressed_attention.default._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "block", "stride", "scale", "backend", "pos",
                                                  "q_offset"]
    assert str(schema.arguments[-2].type) == "Optional[Tensor]" and schema.arguments[-2].default_value is None
    # a chunk of queries (tests/test_query_offset.py)
    assert str(schema.arguments[-1].type) == "int" and schema.arguments[-1].default_value == 0
    assert len(schema.returns) == 2  # o and the log-sum-exp
    schema = torch.ops.nsa.compressed_attention_backward.default._schema
    assert [a.name for a in schema.arguments][:6] == ["grad_o", "q", "k", "v", "o", "lse"]
    assert schema.arguments[-2].name == "pos" and str(schema.arguments[-2].type) == "Optional[Tensor]"
    assert schema.arguments[-1].name == "q_offset"
    assert cmp_mod.COMPRESSED.backend_names() == ("auto", "triton", "reference")
    assert nsa_compile.OptimizeConfig().compressed_attention_backend == "auto"
    assert nsa_compile.OptimizeConfig(compressed_attention_backend="reference").compressed_attention_backend == "reference"
    with pytest.raises(ValueError, match="unknown compressed_attention_backend 'flash'; valid: auto, triton, reference"):
        nsa_compile.OptimizeConfig(compressed_attention_backend="flash")


# --- packed documents (pos): the eager packed formula of models/nsa.py ----------------------------


def packed_visible(pos, Tc, l, d):
    """models/nsa.py's packed visibility [B, S, Tc]: slot s (tokens [s, s + l)) is visible to t iff
    it lies in t's past, starts in t's document, is every d-th of its document and lies in it."""
    S = pos.shape[1]
    t = torch.arange(S, device=pos.device)[:, None]
    i = torch.arange(Tc, device=pos.device)[None, :]
    slot_pos = pos[:, :Tc]
    is_block = (slot_pos % d == 0) & (pos[:, l - 1 :] == slot_pos + l - 1)
    same_doc = i >= (t - pos[:, :, None])
    return (i + l - 1 <= t) & same_doc & is_block[:, None, :]


def eager_packed(q, k, v, l, d, scale, pos):
    """NSAAttention.compressed_attention's attention step with pos, heads first, on the slots:
    q [B, H, S, Dk], k [B, G, S - l + 1, Dk], v [B, G, S - l + 1, Dv] -> o [B, H, S, Dv]."""
    h = q.shape[1] // k.shape[1]
    scores = upcast(q @ k.repeat_interleave(h, dim=1).transpose(-1, -2)) * scale
    visible = packed_visible(pos, k.shape[2], l, d)[:, None]  # [B, 1, S, Tc]
    scores = scores.masked_fill(~visible, float("-inf"))
    has_block = visible.any(dim=-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible
    return p.to(v.dtype) @ v.repeat_interleave(h, dim=1)


def positions(rows, S):
    """pos [len(rows), S] int64 from document lengths per row (the last document cut at S)."""
    out = []
    for lengths in rows:
        starts, at = [], 0
        for length in lengths:
            if at >= S:
                break
            starts.append(at)
            at += length
        cu = torch.tensor([*starts, S])
        out.append(positions_from_cu_seqlens(cu, S))
    return torch.stack(out)


def odd_packing(S, l, d, seed, rows=B):
    """pos [rows, S]: the first rows - 1 rows hold documents of length 1, 2, < l, l, l + 1, not
    multiples of d, long, again and again (the cycle rotated per row); the last row random lengths."""
    cycle = [1, 2, l - 1, l, l + 1, d + 1, 2 * l + 3, 3, l + d - 1]
    gen = torch.Generator().manual_seed(seed)
    out = [(cycle[r:] + cycle[:r]) * S for r in range(rows - 1)]
    out.append(torch.randint(1, 3 * l, (S,), generator=gen).tolist())
    return positions(out, S)


def packed_inputs(S, h, dtype, l=8, d=4, seed=0, **kw):
    """make_inputs with Tc = S - l + 1 slots (unfold stride 1)."""
    return make_inputs(S, h, dtype, l, d, seed=seed, Tc=max(0, S - l + 1), **kw)


def test_packed_formula_is_the_models_method():
    """eager_packed on the mean-pooled slots == NSAAttention.compressed_attention(q, k, v, pos); the
    op gives the same o and its lse rebuilds the model's p_cmp."""
    h, S, l, d = 3, 70, 16, 8
    cfg = ModelConfig(dim=32, n_heads=G * h, n_kv_groups=G, head_dim=DK, head_dim_v=DV, cmp_block=l, cmp_stride=d,
                      sel_block=16, n_selected=3)  # fmt: skip
    attn = NSAAttention(cfg).double()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, G * h, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, G, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(B, S, G, DV, generator=gen, dtype=torch.float64)
    pos = odd_packing(S, l, d, seed=5)
    want_o, want_p = attn.compressed_attention(q, k, v, pos)
    k_cmp, v_cmp = attn.compress(k, None, 1).transpose(1, 2), attn.compress(v, None, 1).transpose(1, 2)
    assert k_cmp.shape[2] == S - l + 1
    ours = eager_packed(q.transpose(1, 2), k_cmp, v_cmp, l, d, attn.scale, pos).transpose(1, 2)
    torch.testing.assert_close(ours, want_o, rtol=1e-13, atol=1e-13)
    o, lse = torch.ops.nsa.compressed_attention(q.transpose(1, 2), k_cmp, v_cmp, l, d, attn.scale, "auto", pos)
    torch.testing.assert_close(o.transpose(1, 2), want_o, rtol=1e-12, atol=1e-12)
    visible = packed_visible(pos, S - l + 1, l, d)[:, None]
    scores = q.transpose(1, 2) @ k_cmp.repeat_interleave(h, 1).transpose(-1, -2) * attn.scale
    p = torch.where(visible, torch.exp(scores - lse.double()[..., None]), 0.0)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=1e-6)
    assert bool((~visible.any(-1)).any())  # the packing has rows without a block (short documents)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_matches_eager_fp32_fp64(dtype, monkeypatch):
    """Odd packings (documents of 1, 2, < l tokens, not multiples of d, long), d < l and d == l,
    h 1 and 4, chunks of 5 rows (boundaries inside documents) and one chunk."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for (S, (l, d), h), chunk in itertools.product(((45, (8, 4), 4), (33, (6, 3), 1), (40, (4, 4), 2)), (5, None)):
        monkeypatch.setattr(cmp_mod, "REFERENCE_CHUNK", chunk)
        q, k, v, grad_o = packed_inputs(S, h, dtype, l, d, seed=S + h)
        pos = odd_packing(S, l, d, seed=S)
        ours = run(compressed_attention, q, k, v, grad_o, l, d, DK**-0.5, "auto", pos)
        ref = run(eager_packed, q, k, v, grad_o, l, d, DK**-0.5, pos)
        assert_close_all(ours, ref, f"S={S} l={l} d={d} h={h} chunk={chunk}", **tol)


def test_packed_low_precision_error_vs_fp64_oracle():
    worst = 0.0
    for dtype, (S, h) in itertools.product((torch.bfloat16, torch.float16), ((45, 4), (60, 1))):
        q, k, v, grad_o = packed_inputs(S, h, dtype, seed=S + h)
        pos = odd_packing(S, 8, 4, seed=h)
        oracle = run(eager_packed, *(x.double() for x in (q, k, v, grad_o)), 8, 4, DK**-0.5, pos)
        ours = run(compressed_attention, q, k, v, grad_o, 8, 4, DK**-0.5, "auto", pos)
        eager = run(eager_packed, q, k, v, grad_o, 8, 4, DK**-0.5, pos)
        worst = max(worst, assert_within_twice_eager(ours, eager, oracle, dtype, f"{dtype} S={S} h={h}"))
    assert worst > 0


def test_packed_rows_without_a_slot_give_zeros_and_lse_minus_inf():
    """Documents shorter than l and the first l - 1 tokens of each: o = 0, lse = -inf, dq = 0, no
    NaN; slots no query sees (not every d-th, crossing a document end) get zero dk, dv; lse is
    the log-sum-exp of the eager scores over the visible slots."""
    S, h, l, d = 40, 2, 8, 4
    q, k, v, grad_o = packed_inputs(S, h, torch.float64, l, d, seed=9)
    pos = positions([[3, 7, 12, 18], [21, 1, 18]], S)
    o, dq, dk, dv = run(compressed_attention, q, k, v, grad_o, l, d, 0.4, "auto", pos)
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, 0.4, "auto", pos)
    visible = packed_visible(pos, S - l + 1, l, d)  # [B, S, Tc]
    empty = ~visible.any(-1)  # [B, S]
    assert empty.sum() > S // 2 and (~empty).sum() > 5
    assert not any(x.isnan().any() for x in (o, dq, dk, dv))
    assert not o.transpose(1, 2)[empty].any() and not dq.transpose(1, 2)[empty].any()
    assert (o.transpose(1, 2)[~empty] != 0).all()
    assert torch.equal(lse.isneginf(), empty[:, None].expand_as(lse))
    unseen = ~visible.any(1)  # [B, Tc]: slots no query sees
    assert not dk.transpose(1, 2)[unseen].any() and not dv.transpose(1, 2)[unseen].any()
    scores = upcast(q @ k.repeat_interleave(h, 1).transpose(-1, -2)) * 0.4
    want = torch.logsumexp(scores.masked_fill(~visible[:, None], float("-inf")), -1)
    torch.testing.assert_close(lse[~lse.isneginf()], want[~lse.isneginf()].float(), rtol=1e-6, atol=1e-6)


def test_one_document_is_the_unpacked_op_on_every_dth_slot():
    """pos = 0..S-1: the slots are visible exactly where the unpacked blocks are (every d-th), so
    the op gives the unpacked op's o and lse on k[:, :, ::d], and no gradient to the other slots."""
    S, h, l, d = 50, 3, 8, 4
    q, k, v, grad_o = packed_inputs(S, h, torch.float64, l, d, seed=2)
    pos = torch.arange(S).expand(B, S)
    ours = run(compressed_attention, q, k, v, grad_o, l, d, 0.3, "auto", pos)
    blocks = run(compressed_attention, q, k[:, :, ::d], v[:, :, ::d], grad_o, l, d, 0.3)
    assert k[:, :, ::d].shape[2] == n_blocks(S, l, d)
    torch.testing.assert_close(ours[0], blocks[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], blocks[1], rtol=1e-12, atol=1e-12)
    for ours_grad, block_grad in zip(ours[2:], blocks[2:]):
        torch.testing.assert_close(ours_grad[:, :, ::d], block_grad, rtol=1e-12, atol=1e-12)
        off = torch.ones(ours_grad.shape[2], dtype=torch.bool)
        off[::d] = False
        assert not ours_grad[:, :, off].any()
    lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, 0.3, "auto", pos)[1]
    torch.testing.assert_close(lse, torch.ops.nsa.compressed_attention(q, k[:, :, ::d], v[:, :, ::d], l, d, 0.3)[1])


def test_packed_sequence_shorter_than_a_block():
    """S < l: Tc = 0 slots is valid with pos too; zeros, lse -inf."""
    q, k, v, grad_o = packed_inputs(5, 2, torch.float32, 8, 4)
    assert k.shape[2] == 0
    pos = torch.zeros(B, 5, dtype=torch.int64)
    o, dq, dk, dv = run(compressed_attention, q, k, v, grad_o, 8, 4, 0.5, "auto", pos)
    assert not o.any() and not dq.any() and dk.shape == k.shape and dv.shape == v.shape


def test_packed_memory_bounded_and_fully_written():
    """With pos the largest intermediate is one chunk's [B, G, h * C, Tc] (scores or its mask):
    never an [S, Tc] mask or the [B, H, S, Tc] scores."""
    S, h, l, d, chunk, D = 512, 2, 8, 4, 32, 8
    q, k, v, grad_o = packed_inputs(S, h, torch.float32, l, d, b=1, dk=D, dv=D)
    pos = odd_packing(S, l, d, seed=1, rows=1)
    Tc = k.shape[2]
    spy = AllocationSpy()
    with spy:
        o, lse = cmp_mod._reference_forward(q, k, v, l, d, 0.25, chunk, pos=pos)
        dq, dk, dv = cmp_mod._reference_backward(grad_o, q, k, v, l, d, 0.25, chunk, pos=pos)
    assert spy.max_numel <= max(G * h * chunk * Tc, G * h * S * D) < S * Tc // 2
    assert "repeat_interleave" not in spy.names
    assert not lse.isnan().any() and lse.isneginf().any()
    ref = run(eager_packed, q, k, v, grad_o, l, d, 0.25, pos)
    assert_close_all((o, dq, dk, dv), ref, "spy", rtol=1e-5, atol=1e-5)


def packed_bad_args(**change):
    q, k, v, _ = packed_inputs(20, 2, torch.float32)  # Tc = 13
    args = dict(q=q, k=k, v=v, block=8, stride=4, scale=0.5, backend="auto", pos=odd_packing(20, 8, 4, seed=0))
    args.update(change)
    return args


PACKED_BAD = [
    (dict(pos=torch.zeros(B, 20, dtype=torch.int32)), r"pos must be an int64 \[B, S\] tensor"),
    (dict(pos=torch.zeros(20, dtype=torch.int64)), r"pos must be an int64 \[B, S\] tensor"),
    (dict(pos=torch.zeros(B, 21, dtype=torch.int64)), r"pos must have shape \[B, S\] = \[2, 20\], got \[2, 21\]"),
    (dict(pos=torch.zeros(1, 20, dtype=torch.int64)), r"pos must have shape \[B, S\] = \[2, 20\], got \[1, 20\]"),
    (dict(pos=torch.zeros(B, 20, dtype=torch.int64, device="meta")), "pos must be on q's device cpu, got meta"),
    (dict(k=torch.randn(B, G, 4, DK), v=torch.randn(B, G, 4, DV)), r"Tc must be S - block \+ 1 = 13, got 4"),
]


@pytest.mark.parametrize("change,match", PACKED_BAD, ids=[m[:40] for _, m in PACKED_BAD])
def test_packed_argument_validation(change, match):
    assert_raises_eager_and_fake(compressed_attention, packed_bad_args(**change), match)


def test_packed_backend_choice_and_backward_validation(monkeypatch):
    """On the CPU auto takes reference with pos as without it, for the same reason (the kernels
    run on CUDA; they take pos: TestTriton); the backward op validates pos."""
    args = packed_bad_args()
    q, k, v, pos = args["q"], args["k"], args["v"], args["pos"]
    assert cmp_mod.choose_backend(q, k, v, 8, 4, "auto", pos) == "reference"
    assert cmp_mod.why_not_triton(q, k, v, 8, 4, pos) == "the Triton kernels run on CUDA (tensors on cpu)"
    o, lse = torch.ops.nsa.compressed_attention(q, k, v, 8, 4, 0.5, "auto", pos)
    grad_o = torch.randn_like(o)
    compressed_attention_backward(grad_o, q, k, v, o, lse, 8, 4, 0.5, "auto", pos)
    with pytest.raises(ValueError, match=r"pos must have shape"):
        compressed_attention_backward(grad_o, q, k, v, o, lse, 8, 4, 0.5, "auto", pos[:, :7])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: device cpu"):
        compressed_attention_backward(grad_o, q, k, v, o, lse, 8, 4, 0.5, "triton", pos)


def test_packed_opcheck_and_layouts():
    for S, h, l, d in ((7, 3, 8, 4), (33, 2, 6, 3)):  # Tc = 0 and Tc = 28
        q, k, v, grad_o = packed_inputs(S, h, torch.float32, l, d, dk=8, dv=5)
        pos = odd_packing(S, l, d, seed=S)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        torch.library.opcheck(torch.ops.nsa.compressed_attention.default, (q, k, v, l, d, 0.5, "reference", pos))
        o, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, 0.5, "auto", pos)
        torch.library.opcheck(torch.ops.nsa.compressed_attention_backward.default,
                              (grad_o, *(x.detach() for x in (q, k, v, o, lse)), l, d, 0.5, "reference", pos))
    o, *_ = assert_fakes_promise_the_layout(torch.ops.nsa.compressed_attention, compressed_attention_backward,
                                            grad_o, q.detach(), k.detach(), v.detach(), l, d, 0.5, "auto", pos)
    assert o.transpose(1, 2).is_contiguous()


def packed_model_loss(x_q, k, v, pos):
    o = compressed_attention(x_q.transpose(1, 2), k, v, 8, 4, 0.3, "auto", pos)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def packed_eager_loss(x_q, k, v, pos):
    o = eager_packed(x_q.transpose(1, 2), k, v, 8, 4, 0.3, pos)
    return (o.transpose(1, 2).sin() * 1.5).sum()


def test_packed_compiles_like_eager_with_the_ops_in_the_graphs():
    """pos is a graph input (the same graph serves every packing, and dynamic lengths)."""
    cases = []
    for S in (40, 57):
        gen = torch.Generator().manual_seed(S)
        shapes = ((B, S, G * 3, DK), (B, G, S - 7, DK), (B, G, S - 7, DV))
        cases.append(([torch.randn(*s, generator=gen) for s in shapes], odd_packing(S, 8, 4, seed=S)))
    assert_compiles_like_eager(packed_model_loss, packed_eager_loss, cases[0][0], cases[0][1])
    assert_graphs_hold_the_ops(packed_model_loss, packed_eager_loss, cases, torch.ops.nsa.compressed_attention.default,
                               torch.ops.nsa.compressed_attention_backward.default)


# --- the Triton kernels (interpreted on the CPU) ------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="class")
def triton_device():
    """On a machine without CUDA: TRITON_INTERPRET=1 while the class runs."""
    pytest.importorskip("triton")
    with triton_interpreter(on=DEVICE == "cpu"):
        yield DEVICE


def reference(q, k, v, grad_o, l, d, scale, pos=None):
    """o, lse, dq, dk, dv of the reference backend in float32 at the same inputs."""
    f = lambda x: x.float()
    o, lse = cmp_mod._reference_forward(f(q), f(k), f(v), l, d, scale, pos=pos)
    return (o, lse, *cmp_mod._reference_backward(f(grad_o), f(q), f(k), f(v), l, d, scale, pos=pos))


def run_triton(q, k, v, grad_o, l, d, scale, tiles=None, pos=None):
    o, lse = ct.compressed_forward(q, k, v, l, d, scale, pos, tiles=tiles)
    return (o, lse, *ct.compressed_backward(grad_o, q, k, v, o, lse, l, d, scale, pos, tiles=tiles))


def check_triton(ours, ref, dtype, what):
    """ours, ref: (o, lse, dq, dk, dv)."""
    assert_lse_close(ours[1], ref[1], 1e-5 if dtype == torch.float32 else 2e-2, what)
    assert_kernel_matches_reference((ours[0], *ours[2:]), (ref[0], *ref[2:]), dtype, what)


def assert_rows_sum_to_one(sums, max_fraction=0.05):
    """Rows of p = exp(score - lse) sum to 1 to fp32 rounding, except some: where the kernel's
    fp32 dot and the eager matmul sum in different orders, a product can round to the
    neighbouring fp16/bf16 value (the row is then off by that entry's p times one ulp; on the GPU,
    with cuBLAS's own summation order and ~255 blocks per row, in up to a few percent of rows).
    Without the rounding to the input dtype nearly every row would be off by more than 1e-5."""
    off = (sums - 1).abs()
    assert off.max() < 1e-2, off.max()
    assert (off > 1e-5).double().mean() < max_fraction, (off > 1e-5).double().mean()


def p_sums(q, k, lse, l, d, scale):
    """sum over the visible blocks of exp(eager score - lse), per row (1 where lse is finite)."""
    scores, visible = eager_scores(q.cpu(), k.cpu(), l, d, scale)
    p = torch.where(visible, torch.exp(scores.double() - lse.cpu().double()[..., None]), 0.0)
    return p.sum(-1)


# S, h, G, l, d, Dv, dtype, tiles: every case has rows without a visible block; the fp32 tiles
# (ROWS 32 / BLOCK_N 16 in fwd and dq, BLOCK_N 16 in dkdv) give unmasked and diagonal tiles at
# S = 100, l 4, d 2
TRITON_CASES = [
    (100, 1, 2, 4, 2, 24, torch.float32, None),
    (33, 3, 2, 8, 4, 8, torch.float32, None),
    (63, 6, 1, 6, 3, 24, torch.float32, {"fwd": {"ROWS": 16}, "dq": {"ROWS": 16}, "dkdv": {"SEGMENT": 16}}),
    (50, 4, 2, 8, 8, 8, torch.bfloat16, None),
    (40, 2, 1, 4, 2, 24, torch.float16, {"dkdv": {"SEGMENT": 32}}),
]


# Packed documents in the kernels: S, the document lengths of the two batch rows (each row with a
# document shorter than l, most with one of a single token), h, G, l, d, dtype, tiles. Together
# they take every packed path of the kernels (test_packed_cases_take_every_kernel_path): forward
# and dq tiles of rows in one document that see whole tiles of slots unmasked, and tiles of rows
# from several documents; dk/dv key tiles inside one document (with unmasked query tiles) and
# over several; dk/dv split into several work items per key tile (summed by the reduce kernel).
SMALL_TILES = {"fwd": {"ROWS": 16, "BLOCK_N": 16}, "dq": {"ROWS": 16, "BLOCK_N": 16},
               "dkdv": {"ROWS": 16, "BLOCK_N": 16, "SEGMENT": 16}}
PACKED_TRITON_CASES = [
    (70, ([1, 12, 7, 50], [23, 3, 44]), 2, 2, 4, 2, torch.float32, None),
    (60, ([9, 1, 40, 10], [2, 1, 57]), 3, 2, 4, 2, torch.bfloat16, SMALL_TILES),
    (37, ([20, 1, 16], [2, 1, 34]), 1, 2, 6, 3, torch.float16, None),
    (61, ([3, 40, 1, 17], [61]), 2, 1, 3, 4, torch.float32, {"dkdv": {"SEGMENT": 32}}),  # l < d
    # l < d, documents of l tokens: blocks l apart, closer than d (the dk/dv work plan's bound)
    (70, ([3] * 23 + [1], [1] + [3] * 13 + [30]), 2, 1, 3, 4, torch.float32, {"dkdv": {"SEGMENT": 16}}),
    # the seed's l and d with the default tiles: a dk/dv row tile that runs past a document's end
    # into a short document's queries (lse -inf), NaN before its rows were cut at the item's end
    (113, ([100, 13], [100, 10, 3]), 2, 1, 32, 16, torch.bfloat16, None),
]


def packed_kernel_paths(pos, h, l, d, tiles) -> set:
    """The packed paths of the kernels that these positions take with these tiles (`_tiles`'
    result), from `document_slots` as the kernels read it: 'whole' (a forward tile of rows in one
    document sees whole BLOCK_N tiles of slots), 'mixed' (a forward tile of rows from several
    documents), 'dkdv_whole' (a dk/dv key tile in one document, seen whole by later queries),
    'dkdv_mixed' (a key tile over several documents), 'split' (several dk/dv work items a tile)."""
    S = pos.shape[1]
    slot, lo, hi, count, end = ct.document_slots(pos, S - l + 1, l, d, ends=True)
    found = set()
    for rows in (torch.arange(S * h) // h).split(tiles["fwd"]["ROWS"]):  # the queries of each tile
        lo_t, hi_t = lo[:, rows], hi[:, rows]
        one_doc = lo_t.amin(1) == lo_t.amax(1)
        if (one_doc & (hi_t.amin(1) - lo_t.amin(1) >= tiles["fwd"]["BLOCK_N"])).any():
            found.add("whole")
        if (~one_doc).any():
            found.add("mixed")
    block_n = tiles["dkdv"]["BLOCK_N"]
    for b in range(pos.shape[0]):
        for c0 in range(0, int(count[b]), block_n):
            c_last = min(c0 + block_n, int(count[b])) - 1
            if end[b, c0] != end[b, c_last]:
                found.add("dkdv_mixed")
            elif slot[b, c_last] + l - 1 < end[b, c0]:
                found.add("dkdv_whole")
    capacity = ct.slot_capacity(S, S - l + 1, l, d)
    segment = ct._segment(S, h, capacity, l, min(l, d), pos.shape[0], tiles["dkdv"], pos.device)
    if ct._work_items(S, h, capacity, l, min(l, d), block_n, segment, pos.device)[5] > 1:
        found.add("split")
    return found


def test_packed_cases_take_every_kernel_path():
    found = set()
    for S, lengths, h, _, l, d, dtype, tiles in PACKED_TRITON_CASES:
        found |= packed_kernel_paths(positions(lengths, S), h, l, d, ct._tiles(DK, DV, dtype == torch.float32, tiles,
                                                                               packed=True))
    assert found == {"whole", "mixed", "dkdv_whole", "dkdv_mixed", "split"}


def test_document_slots_are_the_visible_slots():
    """document_slots (no host sync) against the packed visibility of the eager formula: query t
    sees exactly the slots slot[lo[t]:hi[t]], the slots are the blocks in token order, each seen
    by the queries [slot + l - 1, end), a row holds at most slot_capacity of them, and compact slot
    c starts at token >= c * min(l, d) (what the dk/dv work plan assumes; l < d too)."""
    cases = [(S, l, d, odd_packing(S, l, d, seed=S, rows=3)) for S, l, d in ((70, 8, 4), (53, 4, 4), (61, 3, 4),
                                                                                (40, 6, 3))]
    cases.append((60, 3, 4, positions([[3] * 20, [3] * 19 + [1, 2]], 60)))  # S // l blocks: the capacity
    for S, l, d, pos in cases:
        Tc = S - l + 1
        slot, lo, hi, count, end = ct.document_slots(pos, Tc, l, d, ends=True)
        assert slot.dtype == lo.dtype == hi.dtype == count.dtype == end.dtype == torch.int32
        visible = packed_visible(pos, Tc, l, d)  # [B, S, Tc]
        for b in range(pos.shape[0]):
            n = int(count[b])
            blocks = visible[b].any(0).nonzero().flatten()  # every block is seen by its last token
            assert torch.equal(slot[b, :n].long(), blocks) and n <= ct.slot_capacity(S, Tc, l, d)
            assert (slot[b, :n] >= torch.arange(n) * min(l, d)).all()
            for t in range(S):
                seen = slot[b, int(lo[b, t]) : max(int(lo[b, t]), int(hi[b, t]))].long()
                assert torch.equal(seen, visible[b, t].nonzero().flatten()), (S, l, d, b, t)
            for c in range(n):
                assert torch.equal(visible[b, :, slot[b, c]].nonzero().flatten(),
                                   torch.arange(int(slot[b, c]) + l - 1, int(end[b, c]))), (S, l, d, b, c)
        assert ct.slot_capacity(S, Tc, l, d) == S // min(l, d)
    assert int(count[0]) == ct.slot_capacity(S, Tc, l, d)  # the last case fills it


@pytest.mark.usefixtures("triton_device")
class TestTriton:
    @pytest.mark.parametrize(
        "S,h,g,l,d,dv,dtype,tiles", TRITON_CASES, ids=[str(c[:7]).replace(" ", "") for c in TRITON_CASES]
    )
    def test_matches_reference(self, S, h, g, l, d, dv, dtype, tiles):
        q, k, v, grad_o = (x.to(DEVICE) for x in make_inputs(S, h, dtype, l, d, seed=S + h, g=g, dv=dv))
        ours = run_triton(q, k, v, grad_o, l, d, DK**-0.5, tiles)
        check_triton(ours, reference(q, k, v, grad_o, l, d, DK**-0.5), dtype, f"S={S} h={h} l={l} d={d}")
        assert ours[1][:, :, : l - 1].isneginf().all()
        assert torch.equal(ours[0][:, :, : l - 1], torch.zeros_like(ours[0][:, :, : l - 1]))
        assert torch.equal(ours[2][:, :, : l - 1], torch.zeros_like(ours[2][:, :, : l - 1]))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_lse_reproduces_the_eager_probabilities(self, dtype):
        """The kernel rounds q @ k^T to the input dtype before scaling, as eager does: p rebuilt
        from its lse and the eager scores sums to 1 per row (without the rounding, ~1e-3 off)."""
        S, h, l, d = 60, 3, 8, 4
        q, k, v, _ = (x.to(DEVICE) for x in make_inputs(S, h, dtype, l, d, seed=21, dk=32))
        _, lse = ct.compressed_forward(q, k, v, l, d, 0.4)
        fin = lse.cpu().isfinite()
        assert_rows_sum_to_one(p_sums(q, k, lse, l, d, 0.4)[fin])
        assert torch.equal(fin, torch.arange(S)[None, None, :].expand_as(fin) >= l - 1)

    def test_edge_shapes(self):
        """Tc = 0 (no launch), more compression tokens than any query sees, h = 17 > every ROWS
        tile's query count, head dims not powers of two, Dk > 128."""
        q, k, v, grad_o = (x.to(DEVICE) for x in make_inputs(5, 2, torch.float32, 8, 4))
        o, lse, dq, dk, dv = run_triton(q, k, v, grad_o, 8, 4, 0.5)
        assert lse.isneginf().all() and not o.any() and not dq.any()
        assert dk.shape == k.shape == (B, G, 0, DK) and dv.shape == v.shape
        for S, h, g, l, d, dk_, dv_, extra in ((30, 3, 2, 8, 4, 16, 24, 3), (21, 17, 1, 4, 4, 24, 8, 0),
                                                (18, 2, 1, 4, 2, 136, 40, 0)):  # fmt: skip
            Tc = n_blocks(S, l, d) + extra
            inputs = make_inputs(S, h, torch.float32, l, d, seed=h, g=g, dk=dk_, dv=dv_, Tc=Tc)
            q, k, v, grad_o = (x.to(DEVICE) for x in inputs)
            ours = run_triton(q, k, v, grad_o, l, d, 0.3)
            check_triton(ours, reference(q, k, v, grad_o, l, d, 0.3), torch.float32, f"S={S} h={h} Dk={dk_}")
            if extra:
                assert not ours[3][:, :, -extra:].any() and not ours[4][:, :, -extra:].any()

    def test_dkdv_segments_are_exact_and_deterministic(self):
        """Key tiles split into many work items (fp32 partials summed in segment order): the same
        result as one item per tile, and bit for bit the same on a rerun."""
        S, h, l, d = 40, 2, 4, 2
        q, k, v, grad_o = (x.to(DEVICE) for x in make_inputs(S, h, torch.float32, l, d, seed=8))
        whole = run_triton(q, k, v, grad_o, l, d, 0.25, {"dkdv": {"SEGMENT": 10**6}})
        split = run_triton(q, k, v, grad_o, l, d, 0.25, {"dkdv": {"SEGMENT": 16}})
        block_n = ct._tiles(DK, DV, fp32=True)["dkdv"]["BLOCK_N"]
        items = ct._work_items(S, h, k.shape[2], l, d, block_n, 16, q.device)
        assert items[5] > 3  # several items per tile
        for a, b in zip(whole, split):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        check_triton(split, reference(q, k, v, grad_o, l, d, 0.25), torch.float32, "segments")
        again = run_triton(q, k, v, grad_o, l, d, 0.25, {"dkdv": {"SEGMENT": 16}})
        assert all(torch.equal(a, b) for a, b in zip(split, again))

    def test_unsupported_reason(self, monkeypatch):
        q, k, v, _ = (x.to(DEVICE) for x in make_inputs(20, 2, torch.float32))
        assert ct.unsupported_reason(q, k, v, 8, 4) is None
        assert "dtype" in ct.unsupported_reason(q.double(), k.double(), v.double(), 8, 4)
        assert "dtype" in ct.unsupported_reason(q, k, v.half(), 8, 4)
        assert "head dim" in ct.unsupported_reason(q.new_zeros(B, 4, 20, 300), k.new_zeros(B, G, 4, 300), v, 8, 4)
        assert "stride" in ct.unsupported_reason(q, k, v, 8, 0)
        assert "block" in ct.unsupported_reason(q, k, v, True, 4)
        if DEVICE == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            assert "device cpu" in ct.unsupported_reason(q, k, v, 8, 4)
            with pytest.raises(ValueError, match="device cpu"):
                ct.compressed_forward(q, k, v, 8, 4, 0.5)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_the_op_with_backend_triton_matches_backend_reference_through_autograd(self, dtype):
        """The op's plumbing around the kernels: (o, lse) saved for the backward, the layouts the
        fakes promise, gradients for q, k, v; against the reference backend on the same inputs."""
        S, h, l, d = 37, 3, 8, 4
        q, k, v, grad_o = (x.to(DEVICE) for x in make_inputs(S, h, dtype, l, d, seed=11, dv=8))
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert_backend_matches_reference(torch.ops.nsa.compressed_attention, "triton", q, k, v, grad_o, l, d, 0.4,
                                         rtol=tol, atol=tol)

    @pytest.mark.parametrize(
        "S,lengths,h,g,l,d,dtype,tiles", PACKED_TRITON_CASES, ids=[str(c[:1] + c[2:7]).replace(" ", "")
                                                                  for c in PACKED_TRITON_CASES]
    )  # fmt: skip
    def test_packed_matches_reference(self, S, lengths, h, g, l, d, dtype, tiles):
        """pos in the kernels: o, lse, dq, dk, dv against the reference backend with the same pos;
        rows that see no slot get o = 0, lse = -inf, dq = 0, the slots no query sees dk = dv = 0
        (exactly, no NaN); a rerun is bit for bit the same."""
        inputs = packed_inputs(S, h, dtype, l, d, seed=S + h, g=g)
        q, k, v, grad_o = (x.to(DEVICE) for x in inputs)
        pos = positions(lengths, S).to(DEVICE)
        ours = run_triton(q, k, v, grad_o, l, d, DK**-0.5, tiles, pos)
        check_triton(ours, reference(q, k, v, grad_o, l, d, DK**-0.5, pos), dtype, f"S={S} h={h} l={l} d={d}")
        visible = packed_visible(pos.cpu(), S - l + 1, l, d)  # [B, S, Tc]
        empty, unseen = ~visible.any(-1), ~visible.any(1)  # [B, S] rows, [B, Tc] slots
        assert empty.any() and (~empty).any() and unseen.any()
        o, lse, dq, dk, dv = (x.cpu() for x in ours)
        assert torch.equal(lse.isneginf(), empty[:, None].expand_as(lse))
        assert not o.transpose(1, 2)[empty].any() and not dq.transpose(1, 2)[empty].any()
        assert not dk.transpose(1, 2)[unseen].any() and not dv.transpose(1, 2)[unseen].any()
        again = run_triton(q, k, v, grad_o, l, d, DK**-0.5, tiles, pos)
        assert all(torch.equal(a, b) for a, b in zip(ours, again))

    def test_packed_rows_without_a_slot_and_sequences_shorter_than_a_block(self):
        """Only documents shorter than l (no row sees a slot): zeros, lse -inf, zero gradients, no
        NaN; and S < l (Tc = 0: no launch)."""
        for S, lengths in ((30, ([7, 1, 7, 7, 7, 1], [1, 6, 7, 7, 7, 2])), (5, ([5], [2, 3]))):
            q, k, v, grad_o = (x.to(DEVICE) for x in packed_inputs(S, 2, torch.bfloat16, 8, 4, seed=S))
            pos = positions(lengths, S).to(DEVICE)
            o, lse, dq, dk, dv = run_triton(q, k, v, grad_o, 8, 4, 0.5, None, pos)
            assert lse.isneginf().all() and not any(x.isnan().any() or x.any() for x in (o, dq, dk, dv))
            assert dk.shape == k.shape and dv.shape == v.shape

    def test_packed_unsupported_reason(self):
        """With a valid pos the kernels take the inputs (auto takes them on CUDA: gpu tests); an
        invalid one has a reason."""
        q, k, v, _ = (x.to(DEVICE) for x in packed_inputs(20, 2, torch.float32))  # Tc = 13
        pos = odd_packing(20, 8, 4, seed=0).to(DEVICE)
        assert ct.unsupported_reason(q, k, v, 8, 4, pos) is None
        assert cmp_mod._triton_reason(q, k, v, 8, 4, pos) is None
        assert "pos must be int64 [B, S] = [2, 20], got torch.int32" in ct.unsupported_reason(q, k, v, 8, 4, pos.int())
        assert "pos must be int64" in ct.unsupported_reason(q, k, v, 8, 4, pos[:1])
        assert "Tc must be S - block + 1 = 13, got 12" in ct.unsupported_reason(q, k[:, :, 1:], v[:, :, 1:], 8, 4, pos)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_the_packed_op_with_backend_triton_matches_backend_reference_through_autograd(self, dtype):
        S, h, l, d = 45, 3, 8, 4
        q, k, v, grad_o = (x.to(DEVICE) for x in packed_inputs(S, h, dtype, l, d, seed=13, dv=8))
        pos = odd_packing(S, l, d, seed=2).to(DEVICE)

        def op(q, k, v, l, d, scale, pos, backend):
            return torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, backend, pos)

        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert_backend_matches_reference(op, "triton", q, k, v, grad_o, l, d, 0.4, pos, rtol=tol, atol=tol)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the kernel tests launch the compiled kernels")
def test_the_packed_kernels_compile_for_sm90_without_a_gpu(monkeypatch):
    """The compiled path of the kernels with pos (HAS_POS), which the interpreted tests here never
    take: built as on the GPU (TRITON_INTERPRET off) and compiled to PTX for an H100 by the Triton
    installed here (bf16, h 6, D 64: the seed's tiles)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tiles = ct._tiles(64, 64, False, packed=True)  # the packed dk/dv tile (32 wide, 4 warps)
    assert (tiles["dkdv"]["BLOCK_N"], tiles["dkdv"]["num_warps"]) == (32, 4)
    assert ct._tiles(64, 64, False)["dkdv"]["BLOCK_N"] == 64 and ct._tiles(128, 128, False, packed=True)["dkdv"][
        "BLOCK_N"] == 64  # unpacked, and packed at D 128: as before
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "LSE": "*fp32",
                "DELTA": "*fp32", "PK": "*fp32", "PV": "*fp32", "ITEM_TILE": "*i32", "ITEM_SEG": "*i32",
                "TILE_NSEG": "*i32", "TILE_FIRST": "*i32", "SLOT": "*i32", "LO": "*i32", "HI": "*i32", "COUNT": "*i32",
                "END": "*i32"}  # fmt: skip
    for kernel, cfg in ((ct.fwd_kernel, tiles["fwd"]), (ct.dq_kernel, tiles["dq"]), (ct.dkdv_kernel, tiles["dkdv"]),
                        (ct.reduce_kernel, tiles["reduce"])):  # fmt: skip
        fn = kernel.built()
        # DK, DV: the head dims of the forward and dq, the gradients' pointers of the dk/dv and reduce kernels
        grads = {"DK": "*bf16", "DV": "*bf16"} if kernel in (ct.dkdv_kernel, ct.reduce_kernel) else {}
        signature = {p.name: "constexpr" if p.is_constexpr else (pointers | grads).get(p.name)
                     or ("fp32" if p.name == "scale" else "i32") for p in fn.params}  # fmt: skip
        given = {"HPG": 6, "DK": 64, "DV": 64, "DK_": 64, "DV_": 64, "DK_P": 64, "DV_P": 64, "PREC": "tf32",
                 "UPCAST": False, "HAS_POS": True, "TILE_N": tiles["dkdv"]["BLOCK_N"]} | cfg  # fmt: skip
        compiled = triton.compile(ASTSource(fn, signature, {n: v for n, v in given.items() if signature.get(n) == "constexpr"}),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={n: v for n, v in cfg.items() if n.startswith("num_")})
        assert f".entry {kernel.__name__}(" in compiled.asm["ptx"]


def test_triton_module_imports_without_triton():
    out = run_without_triton(
        "import torch\n"
        "from nsa_compile.ops import compressed_triton as ct\n"
        "x = torch.zeros(1, 1, 4, 8)\n"
        "print(ct.unsupported_reason(x, x, x, 4, 2))\n"
    )
    assert "triton is not installed" in out


# --- on the GPU ---------------------------------------------------------------------------------


def _cuda_case(S, h, dtype, l, d, dk, dv, seed, b=2, g=2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    Tc = n_blocks(S, l, d)
    q = torch.randn(b, S, g * h, dk, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, Tc, g, dk, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, Tc, g, dv, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    grad_o = torch.randn(b, g * h, S, dv, device="cuda", generator=gen).to(dtype)
    return q, k, v, grad_o


def _check_against_oracle(S, h, dtype, backend, l=32, d=16, dk=64, dv=32, seed=0):
    """The op with `backend` and the eager formula in `dtype` against the float64 oracle: within
    2x eager's own error (or the floor); lse rebuilds eager's p; triton deterministic."""
    q, k, v, grad_o = _cuda_case(S, h, dtype, l, d, dk, dv, seed)
    scale = dk**-0.5

    def op(q, k, v, l, d, scale):
        return torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, backend)[0]

    def eager(q, k, v, l, d, scale):  # eager_compressed on the GPU
        Tc, hh = k.shape[2], q.shape[1] // k.shape[1]
        scores = upcast(q @ k.repeat_interleave(hh, 1).transpose(-1, -2)) * scale
        t = torch.arange(q.shape[2], device="cuda")[:, None]
        visible = torch.arange(Tc, device="cuda")[None, :] * d + l - 1 <= t
        scores = scores.masked_fill(~visible, float("-inf"))
        p = torch.softmax(scores.masked_fill(~visible.any(-1, keepdim=True), 0.0), -1) * visible
        return p.to(v.dtype) @ v.repeat_interleave(hh, 1)

    ref = run(eager, *(x.double() for x in (q, k, v, grad_o)), l, d, scale)
    got, exp = run(op, q, k, v, grad_o, l, d, scale), run(eager, q, k, v, grad_o, l, d, scale)
    for name, a, e, r in zip(NAMES, got, exp, ref):
        assert a.shape == e.shape and a.dtype == e.dtype == dtype, name
        assert rel_rms(a, r) <= max(2 * rel_rms(e, r), FLOORS[dtype]), (name, rel_rms(a, r), rel_rms(e, r))
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, backend)
    scores = upcast(q @ k.repeat_interleave(h, 1).transpose(-1, -2)) * scale
    visible = torch.arange(k.shape[2], device="cuda")[None, :] * d + l - 1 <= torch.arange(S, device="cuda")[:, None]
    sums = torch.where(visible, torch.exp(scores.double() - lse.double()[..., None]), 0.0).sum(-1)
    fin = lse.isfinite()
    assert torch.equal(fin[0, 0], torch.arange(S, device="cuda") >= l - 1)
    if fin.any():  # the eager scores, rounded as eager rounds them
        assert_rows_sum_to_one(sums[fin], max_fraction=0.25)
    if backend == "triton":  # deterministic: no atomics in the backward
        again = run(op, q, k, v, grad_o, l, d, scale)
        assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, backend, h",
    [(torch.bfloat16, "triton", 1), (torch.bfloat16, "triton", 4), (torch.float16, "triton", 6),
     (torch.bfloat16, "triton", 16), (torch.float32, "triton", 6), (torch.bfloat16, "reference", 6),
     (torch.float32, "reference", 16)],
)  # fmt: skip
def test_on_cuda_matches_the_eager_formula(dtype, backend, h):
    _check_against_oracle(1000, h, dtype, backend, seed=h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_on_cuda_at_the_paper_head_shape(dtype):
    """h 16, D 128, l 32, d 16 at S 4096: the default tiles of the paper shape, the dk/dv split
    into several work items per key tile (CUDA's default segment)."""
    _check_against_oracle(4096, 16, dtype, "triton", dk=128, dv=128, seed=7)


@pytest.mark.gpu
def test_triton_auto_on_cuda():
    q, k, v, _ = _cuda_case(100, 2, torch.bfloat16, 32, 16, 64, 64, 0)
    assert cmp_mod.choose_backend(q, k, v, 32, 16) == "triton"
    assert cmp_mod.choose_backend(q.double(), k.double(), v.double(), 32, 16) == "reference"


@pytest.mark.gpu
@pytest.mark.sweep
@pytest.mark.parametrize("S", [31, 100, 1000, 4096])
@pytest.mark.parametrize("h", [1, 4, 6, 16])
def test_triton_at_the_issue_sizes(S, h):
    """Batch 2, Dk 64 != Dv 32, l 32 d 16 (S = 31: no block at all; 100: not a multiple of l),
    every dtype: triton within 2x the eager error of the float64 oracle (or the floor)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _check_against_oracle(S, h, dtype, "triton", seed=S * 31 + h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, backend", [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.float32, "auto"),
                                            (torch.bfloat16, "reference")])  # fmt: skip
def test_packed_on_cuda_matches_the_eager_formula(dtype, backend):
    """Packed documents at S 2048 (odd lengths, documents shorter than l = 32, random packings),
    h 6, Dk 64 != Dv 32: auto takes triton, and it and reference are within 2x eager's own error
    of the float64 oracle (or the floor), lse -inf exactly on the rows without a slot."""
    S, h, l, d = 2048, 6, 32, 16
    q, k, v, grad_o = (x.cuda() for x in packed_inputs(S, h, dtype, l, d, seed=3, dk=64, dv=32))
    pos = odd_packing(S, l, d, seed=3).cuda()
    assert cmp_mod.choose_backend(q, k, v, l, d, "auto", pos) == "triton"
    oracle = run(eager_packed, *(x.double() for x in (q, k, v, grad_o)), l, d, 0.125, pos)
    ours = run(compressed_attention, q, k, v, grad_o, l, d, 0.125, backend, pos)
    eager = run(eager_packed, q, k, v, grad_o, l, d, 0.125, pos)
    for name, a, e, r in zip(NAMES, ours, eager, oracle):
        assert a.dtype == e.dtype == dtype, name
        assert rel_rms(a, r) <= max(2 * rel_rms(e, r), FLOORS[dtype]), (name, rel_rms(a, r), rel_rms(e, r))
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, 0.125, backend, pos)
    empty = ~packed_visible(pos, S - l + 1, l, d).any(-1)  # [B, S]
    assert torch.equal(lse.isneginf(), empty[:, None].expand_as(lse)) and bool(empty.any())


@pytest.mark.gpu
def test_packed_triton_on_cuda_at_the_seed_shape():
    """The seed's heads (h 6, G 2, D 64, l 32, d 16) at S 2048, bf16, a realistic mix of documents
    (100 to 800 tokens) per row: auto takes triton with pos; it and the reference backend are
    within 2x the reference's own error of the float64 reference (or the floor); lse -inf on
    exactly the rows without a slot; the kernels deterministic; the default CUDA work split."""
    S, h, l, d, scale = 2048, 6, 32, 16, 0.125
    q, k, v, grad_o = (x.cuda() for x in packed_inputs(S, h, torch.bfloat16, l, d, seed=4, dk=64, dv=64))
    pos = positions([random_lengths(S, 100, 800, seed=b) for b in range(B)], S).cuda()
    assert cmp_mod.choose_backend(q, k, v, l, d, "auto", pos) == "triton"

    def op(backend):
        return lambda q, k, v, l, d, scale: torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, backend, pos)[0]

    oracle = run(op("reference"), *(x.double() for x in (q, k, v, grad_o)), l, d, scale)
    ours = run(op("triton"), q, k, v, grad_o, l, d, scale)
    ref = run(op("reference"), q, k, v, grad_o, l, d, scale)
    for name, a, e, r in zip(NAMES, ours, ref, oracle):
        assert a.dtype == e.dtype == torch.bfloat16, name
        assert rel_rms(a, r) <= max(2 * rel_rms(e, r), FLOORS[torch.bfloat16]), (name, rel_rms(a, r), rel_rms(e, r))
    _, lse = torch.ops.nsa.compressed_attention(q, k, v, l, d, scale, "triton", pos)
    empty = ~packed_visible(pos, S - l + 1, l, d).any(-1)  # [B, S]
    assert torch.equal(lse.isneginf(), empty[:, None].expand_as(lse)) and bool(empty.any())
    again = run(op("triton"), q, k, v, grad_o, l, d, scale)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))

