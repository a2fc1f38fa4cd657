"""The varlen backends of nsa::selected_attention (nsa_compile/ops/selection_varlen.py).

On the CPU the whole algorithm (grouping by KV block, the current-block call, the log-sum-exp
merge, chunking, the split-softmax backward) runs with a PyTorch stand-in for the per-segment
FA-2 call: same signature and returns as the aten varlen convention, FA-2's math (bottom-right
causal alignment, lse [heads, total_q], +inf lse on a row without keys, a backward that uses the
given o and lse), and checks of what FA-2 requires. It refuses a causal call whose segments have
fewer queries than keys, so every test also proves that the algorithm never depends on how a
causal mask is aligned (NSA_SEMANTICS.md section 8). The flash-attn package adapter runs against
a stand-in module with `flash_attn_varlen_func`'s exact signature (the real package is not
installed or run on this project's machines). The GPU tests compare the real FA-2 calls with the
stand-in call by call, and the backend with the float64 reference at the issue's sizes.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from oracles import (
    FLOORS, assert_backend_matches_reference, assert_lse_close, attention_inputs, random_block_idx, rel_rms,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.ops import selection as sel
from nsa_compile.ops import selection_varlen as sv

B = 2


# --- the stand-in for the per-segment FA-2 call -----------------------------------------------------


def _segments(cu: torch.Tensor, total: int):
    """Segment id and position inside it of each of `total` packed rows."""
    cu = cu.long()
    rows = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu[1:], rows, right=True)
    return seg, rows - cu[seg], cu[1:] - cu[:-1]


def _allowed(cu_q, cu_k, Tq, Tk, max_q, max_k, causal):
    """[Tq, Tk] mask of FA-2's varlen attention, after checking the call the way FA-2 would."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
    assert int(cu_q[0]) == 0 and int(cu_q[-1]) == Tq and int(cu_k[0]) == 0 and int(cu_k[-1]) <= Tk
    seg_q, pos_q, len_q = _segments(cu_q, Tq)
    seg_k, pos_k, len_k = _segments(cu_k, Tk)
    assert (len_q >= 0).all() and (len_k >= 0).all()
    assert int(len_q.max()) <= max_q and int(len_k.max()) <= max_k, "max_seqlen below a segment's length"
    allowed = seg_q[:, None] == seg_k[None, :]
    if causal:
        # FA-2 aligns the causal mask bottom-right; this module must never need to know
        uneven = (len_q > 0) & (len_q != len_k)
        assert not uneven.any(), "a causal call with a segment of fewer queries than keys: the alignment matters"
        shift = (len_k - len_q)[seg_q]
        allowed &= pos_k[None, :] <= (pos_q + shift)[:, None]
    return allowed


def _check_tensors(q, k, v):
    assert q.dim() == k.dim() == v.dim() == 3
    assert q.dtype == k.dtype == v.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "FA-2 needs a contiguous last dim"
    assert q.shape[1] % k.shape[1] == 0 and k.shape[:2] == v.shape[:2]


def _scores(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """One varlen call as FA-2 sees it (checked as FA-2 would): the allowed mask [Tq, Tk], K and V
    repeated to the Hq query heads in float32, and the scaled scores [Hq, Tq, Tk] in float32."""
    _check_tensors(q, k, v)
    Hq, Hk = q.shape[1], k.shape[1]
    allowed = _allowed(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal)
    kk = k.float().repeat_interleave(Hq // Hk, dim=1)
    vv = v.float().repeat_interleave(Hq // Hk, dim=1)
    return allowed, kk, vv, torch.einsum("qhd,khd->hqk", q.float(), kk) * scale


def reference_attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """FA-2's varlen forward in PyTorch (differentiable in o): o [Tq, Hq, Dv] in q's dtype and
    lse [Hq, Tq] float32, +inf on a row without keys (as FA-2 writes it)."""
    allowed, _, vv, s = _scores(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)  # [Hq, Tq]
    # the softmax, differentiable; a row without keys (lse -inf) gets p = 0
    p = torch.exp(s - torch.where(lse.isneginf(), 0.0, lse)[..., None]).masked_fill(~allowed, 0)
    o = torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)
    return o, torch.where(lse.isneginf(), math.inf, lse).detach()


def reference_backward(grad_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    """FA-2's varlen backward in PyTorch: P from the GIVEN lse, D = rowsum(grad_o * given o)."""
    allowed, kk, vv, s = _scores(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    assert grad_o.shape[:2] == o.shape[:2] == q.shape[:2] and lse.shape == (q.shape[1], q.shape[0])
    Hq, Dk = q.shape[1:]
    Tk, Hk, Dv = v.shape
    p = torch.exp(s - lse[..., None]).masked_fill(~allowed, 0)  # lse +inf: P = 0
    g = grad_o.float()
    dp = torch.einsum("qhd,khd->hqk", g, vv)
    delta = (g * o.float()).sum(-1).t()  # [Hq, Tq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = (torch.einsum("hqk,qhd->khd", ds, q.float()) * scale).view(Tk, Hk, Hq // Hk, Dk).sum(2)
    dv = torch.einsum("hqk,qhd->khd", p, g).view(Tk, Hk, Hq // Hk, Dv).sum(2)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


class StandIn:
    """A SegmentAttention in PyTorch that records its calls."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        self.calls.append(("fwd", q, k, v, causal))
        with torch.no_grad():
            return reference_attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)

    def backward(self, grad_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal):
        self.calls.append(("bwd", q, k, v, causal))
        return reference_backward(grad_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, causal)

    def attention(self) -> sv.SegmentAttention:
        return sv.SegmentAttention("stand-in", self.forward, self.backward, lambda q, k, v: None)


# --- inputs and the reference --------------------------------------------------------------------


def make_inputs(S, h, g, dk, dv, dtype, seed, device="cpu"):
    """q, k, v as [B, S, heads, D] memory viewed [B, heads, S, D] (the model's layout), grad_o."""
    return [x.to(device) for x in attention_inputs(B, S, h, g, dk, dv, dtype, seed)]


def reference(q, k, v, grad_o, block_idx, block_size, scale):
    """o, lse, dq, dk, dv of the reference backend in float64 at the same (rounded) inputs."""
    d = lambda x: x.double()  # noqa: E731
    o, lse = sel._reference_forward(d(q), d(k), d(v), block_idx, block_size, scale)
    return (o, lse, *sel._reference_backward(d(grad_o), d(q), d(k), d(v), block_idx, block_size, scale))


def run_varlen(q, k, v, grad_o, block_idx, block_size, scale, attention, chunk_rows=None, segment_rows=None):
    sizes = {"chunk_rows": chunk_rows, "segment_rows": segment_rows}
    o, lse = sv.selected_forward(q, k, v, block_idx, block_size, scale, attention=attention, **sizes)
    grads = sv.selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale, attention=attention, **sizes)
    return (o, lse, *grads)


def check(ours, ref, dtype, what):
    """o, lse, dq, dk, dv against the float64 reference: dtypes, no NaN, the layout, the floors."""
    for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        assert a.shape == r.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert a.dtype == (torch.float32 if name == "lse" else dtype), f"{what} {name}: dtype {a.dtype}"
        if name == "lse":
            assert_lse_close(a, r, 1e-5 if dtype == torch.float32 else 2e-2, what)
            continue
        assert not a.isnan().any(), f"{what} {name}: NaN"
        assert a.transpose(1, 2).is_contiguous(), f"{what} {name}: not [B, S, heads, D] memory"
        err = rel_rms(a, r)
        assert err <= FLOORS[dtype], f"{what} {name}: rel RMS {err:.2e} > {FLOORS[dtype]}"


# --- the algorithm on the CPU --------------------------------------------------------------------

# S, h, G, l', n, Dk, Dv, dtype, chunk_rows, segment_rows (None: the module's defaults: one chunk
# here, no heavy segment; small: segments split into sub-segments, also inside an entry's heads)
CASES = [
    (1, 1, 2, 4, 2, 8, 8, torch.float32, None, None),  # a single token
    (7, 4, 1, 8, 3, 16, 16, torch.float32, None, None),  # S < l': every query is in block 0 (t < l')
    (33, 1, 2, 4, 3, 8, 8, torch.float32, 16, 3),  # a 1-token last block, chunks of 2 tokens
    (37, 6, 2, 8, 3, 16, 24, torch.float32, 200, 7),  # h = 6, Dk != Dv (the algorithm; FA-2 refuses it)
    (40, 4, 2, 4, 4, 16, 16, torch.float32, None, None),
    (50, 4, 2, 8, 4, 16, 16, torch.bfloat16, 256, 16),
    (45, 6, 1, 4, 5, 16, 16, torch.bfloat16, None, 30),
    (29, 4, 2, 4, 3, 8, 8, torch.float16, 100, 1),
]


@pytest.mark.parametrize("S,h,G,ls,n,dk,dv,dtype,chunk_rows,segment_rows", CASES,
                         ids=[str(c[:8] + c[9:]).replace(" ", "") for c in CASES])
def test_matches_reference(S, h, G, ls, n, dk, dv, dtype, chunk_rows, segment_rows):
    seed = S * 31 + h * 7 + G + n
    q, k, v, grad_o = make_inputs(S, h, G, dk, dv, dtype, seed)
    idx = random_block_idx(B, G, S, n, ls, seed).clone()
    if S > 8:
        idx[1, G - 1, S - 2, :2] = idx[1, G - 1, S - 2, 1].item()  # a duplicated block: counts twice
        idx[0, 0, S - 1, 0] = (S - 1) // ls  # block 0 replaced by the current block: listed twice
    scale = dk**-0.5
    standin = StandIn()
    ours = run_varlen(q, k, v, grad_o, idx, ls, scale, standin.attention(), chunk_rows, segment_rows)
    check(ours, reference(q, k, v, grad_o, idx, ls, scale), dtype, f"S={S} h={h} G={G}")
    assert any(c[0] == "fwd" and c[4] for c in standin.calls)  # the current blocks: one causal call
    if S > ls:
        assert any(c[0] == "fwd" and not c[4] for c in standin.calls)  # full blocks: non-causal calls
    if S >= 7:
        assert (idx == -1).any()  # the first tokens have fewer than n candidate blocks


def test_hand_built_rows():
    """Rows the model never produces but the op accepts: no block at all (output 0, lse -inf,
    zero gradients), only a future block, a block past the end, the current block missing,
    the current block three times, an earlier block twice; and n = 0."""
    S, h, G, ls, n = 30, 3, 2, 4, 3
    q, k, v, grad_o = make_inputs(S, h, G, 8, 8, torch.float32, seed=3)
    idx = random_block_idx(B, G, S, n, ls, seed=3).clone()
    idx[0, 1, 5] = -1  # nothing
    idx[1, 0, 10] = torch.tensor([5, -1, -1])  # only a block after t = 10
    idx[1, 1, 11] = torch.tensor([0, 1, 40])  # block 40 is past the end; no current block (2)
    idx[0, 0, 20] = torch.tensor([5, 5, 5])  # the current block three times
    idx[1, 0, 29] = torch.tensor([3, 3, 7])  # an earlier block twice and the current one
    for segment_rows in (None, 4):
        ours = run_varlen(q, k, v, grad_o, idx, ls, 0.3, StandIn().attention(), 50, segment_rows)
        check(ours, reference(q, k, v, grad_o, idx, ls, 0.3), torch.float32, f"hand-built {segment_rows}")
    o, lse, dq = ours[:3]
    for b, g, t in ((0, 1, 5), (1, 0, 10)):
        heads = slice(g * h, (g + 1) * h)
        assert torch.equal(o[b, heads, t], torch.zeros_like(o[b, heads, t]))
        assert torch.equal(dq[b, heads, t], torch.zeros_like(dq[b, heads, t]))
        assert lse[b, heads, t].isneginf().all()
    empty = torch.empty(B, G, S, 0, dtype=torch.int64)
    o, lse, *grads = run_varlen(q, k, v, grad_o, empty, ls, 0.3, StandIn().attention())
    assert lse.isneginf().all()
    for x in (o, *grads):
        assert torch.equal(x, torch.zeros_like(x))


def test_the_model_selection():
    """The eager model's own block choice (NSAAttention.select_blocks) on a random p_cmp."""
    from nsa_compile.models.config import ModelConfig
    from nsa_compile.models.nsa import NSAAttention

    S, h, G, ls, n = 70, 2, 2, 8, 4
    cfg = ModelConfig(dim=32, n_heads=G * h, n_kv_groups=G, head_dim=16, cmp_block=8, cmp_stride=4, sel_block=ls,
                      n_selected=n)
    p_cmp = torch.rand(B, G * h, S, (S - 8) // 4 + 1, generator=torch.Generator().manual_seed(1))
    idx = NSAAttention(cfg).select_blocks(p_cmp, S)
    q, k, v, grad_o = make_inputs(S, h, G, 16, 16, torch.float32, seed=4)
    ours = run_varlen(q, k, v, grad_o, idx, ls, 0.25, StandIn().attention(), chunk_rows=64)
    check(ours, reference(q, k, v, grad_o, idx, ls, 0.25), torch.float32, "model selection")


def test_chunks_bound_the_packed_rows_and_k_v_are_hardly_copied():
    """The chunk and segment sizes change nothing but the packing: every non-causal call packs at
    most chunk_rows (entry, head) rows (or one token's, B * n * h, when that is more); K and V
    reach the calls as views of the inputs' own memory, except the calls of split heavy segments,
    which copy at most 2 * l' / segment_rows key rows per packed row."""
    S, h, G, ls, n = 40, 3, 2, 4, 4
    q, k, v, grad_o = make_inputs(S, h, G, 8, 8, torch.float32, seed=6)
    idx = random_block_idx(B, G, S, n, ls, seed=6)
    results = []
    for chunk_rows, segment_rows in ((1, None), (60, 5), (10_000, None), (10_000, 12)):
        standin = StandIn()
        results.append(run_varlen(q, k, v, grad_o, idx, ls, 0.5, standin.attention(), chunk_rows, segment_rows))
        packed = [c[1].shape[0] for c in standin.calls if c[0] == "fwd" and not c[4]]
        assert packed and max(packed) <= max(chunk_rows, B * n * h)
        if chunk_rows == 1:  # one token per chunk: a call per (token with a full block, group)
            assert len(packed) > 2 * G
        copies = 0
        for _, qc, kc, vc, _ in standin.calls:
            if kc.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
                assert vc.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                continue
            copies += 1
            assert segment_rows and kc.shape[0] % ls == 0 and kc.shape[0] <= 2 * ls * qc.shape[0] / segment_rows
        assert (copies > 0) == (segment_rows is not None)  # block 0 is heavy here whenever splitting is on
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_stand_in_refuses_an_uneven_causal_segment():
    """The guard behind every test above: a causal segment with fewer queries than keys raises
    (where FA-2's bottom-right and SDPA's top-left alignments would disagree)."""
    q = torch.randn(3, 1, 8)
    k = torch.randn(5, 1, 8)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(AssertionError, match="alignment matters"):
        reference_attend(q, k, k, cu_q, cu_k, 3, 5, 1.0, True)
    reference_attend(q, k, k, cu_q, cu_k, 3, 5, 1.0, False)


# --- the op, the backend choice, the config --------------------------------------------------------


def test_the_op_routes_varlen_forward_and_backward(monkeypatch):
    """torch.ops.nsa.selected_attention(..., 'varlen') through autograd, with the stand-in as the
    segment attention: the same numbers as backend 'reference', and the strides the fakes promise."""
    standin = StandIn()
    monkeypatch.setitem(sv.ATTENTION, "varlen", standin.attention())
    S, h, G, ls, n = 23, 3, 2, 4, 3
    q, k, v, grad_o = make_inputs(S, h, G, 8, 8, torch.float32, seed=11)
    idx = random_block_idx(B, G, S, n, ls, seed=11)
    assert_backend_matches_reference(torch.ops.nsa.selected_attention, "varlen", q, k, v, grad_o, idx, ls, 0.4,
                                     rtol=1e-5, atol=1e-5)
    assert {c[0] for c in standin.calls} == {"fwd", "bwd"}  # both ops took the varlen route


def test_backend_choice_on_the_cpu(monkeypatch):
    q, k, v, _ = make_inputs(9, 2, 2, 8, 8, torch.bfloat16, seed=0)
    idx = random_block_idx(B, 2, 9, 2, 4, seed=0)
    assert {"varlen", "varlen_flash_attn"} <= set(sel.SELECTION.backend_names())
    with pytest.raises(ValueError, match="backend 'varlen' cannot run these inputs: FA-2 runs on CUDA only"):
        sel.choose_backend(q, k, v, idx, 4, "varlen")
    # 'auto' never takes varlen, even where it could run
    monkeypatch.setitem(sv.ATTENTION, "varlen", StandIn().attention())
    assert sel.choose_backend(q, k, v, idx, 4, "varlen") == "varlen"
    assert sel.choose_backend(q, k, v, idx, 4, "auto") == "reference"
    assert "int64" in sv.unsupported_reason(q, k, v, idx.int(), 4)
    assert "block_size" in sv.unsupported_reason(q, k, v, idx, 0)
    meta = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.bfloat16)  # noqa: E731
    S = 65536 * 4 + 1
    why = sv.unsupported_reason(meta(1, 2, S, 8), meta(1, 1, S, 8), meta(1, 1, S, 8),
                                torch.empty(1, 1, S, 2, dtype=torch.int64, device="meta"), 4)
    assert "65537 segments" in why


def test_config_accepts_the_varlen_backends():
    from nsa_compile import OptimizeConfig

    assert OptimizeConfig(selected_attention_backend="varlen").selected_attention_backend == "varlen"
    assert OptimizeConfig(selected_attention_backend="varlen_flash_attn").cache_key() != OptimizeConfig().cache_key()


# --- the flash-attn package adapter, against a stand-in module ---------------------------------------


def standin_package(calls: list, drop_parameter: str | None = None) -> types.ModuleType:
    """A module `flash_attn` whose flash_attn_varlen_func has the package's signature (2.6+) and
    behaviour: o differentiable (through FA-2's math), the log-sum-exp returned with
    return_attn_probs=True but not differentiable (the package's backward ignores it)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and softcap == 0.0
        assert alibi_slopes is None and block_table is None
        calls.append({"softmax_scale": softmax_scale, "causal": causal, "return_attn_probs": return_attn_probs,
                      "grad": torch.is_grad_enabled()})
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        o, lse = reference_attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
        return (o, lse, torch.empty(0)) if return_attn_probs else o

    if drop_parameter:  # a function of another version's signature
        import inspect

        sig = inspect.signature(flash_attn_varlen_func)
        params = [p for name, p in sig.parameters.items() if name != drop_parameter]
        flash_attn_varlen_func.__signature__ = sig.replace(parameters=params)
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_package_adapter_against_a_stand_in_module(monkeypatch, dtype):
    """The whole algorithm through FLASH_ATTN_PACKAGE: its backward rebuilds the exact gradient from
    the public function's autograd plus the log-sum-exp path (the package's backward drops it)."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", standin_package(calls))
    S, h, G, ls, n = 31, 4, 2, 4, 4
    q, k, v, grad_o = make_inputs(S, h, G, 8, 8, dtype, seed=9)
    idx = random_block_idx(B, G, S, n, ls, seed=9).clone()
    idx[1, 1, S - 3, :2] = idx[1, 1, S - 3, 1].item()  # a duplicate
    ours = run_varlen(q, k, v, grad_o, idx, ls, 0.35, sv.FLASH_ATTN_PACKAGE, chunk_rows=150, segment_rows=10)
    check(ours, reference(q, k, v, grad_o, idx, ls, 0.35), dtype, "flash-attn adapter")
    assert calls and all(c["softmax_scale"] == 0.35 and c["return_attn_probs"] for c in calls)
    assert any(c["grad"] for c in calls) and any(c["causal"] for c in calls)


def test_flash_attn_package_reasons(monkeypatch):
    q, k, v, _ = make_inputs(9, 2, 1, 8, 8, torch.bfloat16, seed=0)
    idx = random_block_idx(B, 1, 9, 2, 4, seed=0)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    assert "not importable" in sv.unsupported_reason(q, k, v, idx, 4, "varlen_flash_attn")
    with pytest.raises(ValueError, match="'varlen_flash_attn' cannot run these inputs: the flash-attn package"):
        sel.choose_backend(q, k, v, idx, 4, "varlen_flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", standin_package([], drop_parameter="return_attn_probs"))
    assert "no parameter return_attn_probs" in sv.unsupported_reason(q, k, v, idx, 4, "varlen_flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", standin_package([]))
    assert "CUDA only" in sv.unsupported_reason(q, k, v, idx, 4, "varlen_flash_attn")


# --- on the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa2_calls_match_the_stand_in(dtype):
    """The assumptions the CPU tests rest on, checked on the real kernels call by call: lse layout
    [heads, total_q], segments without queries (dk/dv 0 there), K/V as strided views of one
    group, the backward using the given o and lse (+inf rows: no contribution), GQA-native
    causal calls over block segments."""
    g = torch.Generator(device="cuda").manual_seed(0)
    Bc, S, G, D, ls = 2, 300, 2, 64, 64
    kv = torch.randn(Bc * S, G, D, device="cuda", generator=g, dtype=dtype)
    vv = torch.randn(Bc * S, G, D, device="cuda", generator=g, dtype=dtype)
    blocks = sv._block_bounds(Bc, S, ls, "cuda")
    # non-causal: 10 segments (5 blocks x 2 rows), some without queries
    per_seg = torch.tensor([0, 40, 3, 0, 128, 1, 0, 77, 0, 5], device="cuda")
    cu_q = torch.nn.functional.pad(per_seg.cumsum(0), (1, 0)).to(torch.int32)
    Tq = int(per_seg.sum())
    qp = torch.randn(Tq, 1, D, device="cuda", generator=g, dtype=dtype)
    k1, v1 = kv[:, 1:2], vv[:, 1:2]  # group 1 as a strided view
    for causal, q_, k_, v_, cq, mq in ((False, qp, k1, v1, cu_q, int(per_seg.max())),
                                       (True, torch.randn(Bc * S, G * 3, D, device="cuda", generator=g, dtype=dtype),
                                        kv, vv, blocks, ls)):
        o, lse = sv.FA2.forward(q_, k_, v_, cq, blocks, mq, ls, 0.125, causal)
        o_ref, lse_ref = reference_attend(q_, k_, v_, cq, blocks, mq, ls, 0.125, causal)
        assert lse.shape == lse_ref.shape and o.shape == o_ref.shape
        assert rel_rms(o, o_ref) < 1e-2 and (lse - lse_ref).abs().max().item() < 1e-2
        grad = torch.randn(o.shape, device="cuda", generator=g, dtype=dtype)
        given_o = torch.randn(o.shape, device="cuda", generator=g, dtype=dtype)
        given_lse = lse + 0.5
        given_lse[:, ::7] = math.inf  # rows the caller excludes
        got = sv.FA2.backward(grad, q_, k_, v_, given_o, given_lse, cq, blocks, mq, ls, 0.125, causal)
        want = reference_backward(grad, q_, k_, v_, given_o, given_lse, cq, blocks, mq, ls, 0.125, causal)
        for name, a, r in zip(("dq", "dk", "dv"), got, want):
            assert a.shape == r.shape and not a.isnan().any(), name
            assert rel_rms(a, r) < 1e-2, (name, causal, rel_rms(a, r))
        if not causal:  # keys of blocks no query chose: exactly 0
            assert torch.equal(got[1][:ls], torch.zeros_like(got[1][:ls]))


def _issue_size_case(S, h, dtype, chunk_rows=None, monkeypatch=None):
    import nsa_compile.ops  # noqa: F401

    g = torch.Generator(device="cuda").manual_seed(S * 31 + h)
    Bc, G, D, ls, n = 2, 2, 64, 64, 4
    idx = random_block_idx(Bc, G, S, n, ls, seed=S + h, device="cuda").clone()
    idx[1, 1, S - 2, :2] = idx[1, 1, S - 2, 1].item()  # a duplicate
    q = torch.randn(Bc, S, G * h, D, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(Bc, S, G, D, device="cuda", generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(Bc, S, G, D, device="cuda", generator=g).to(dtype).transpose(1, 2)
    grad = torch.randn(Bc, G * h, S, D, device="cuda", generator=g).to(dtype)
    if chunk_rows:
        monkeypatch.setattr(sv, "CHUNK_ROWS", chunk_rows)
    assert sel.choose_backend(q, k, v, idx, ls, "varlen") == "varlen"
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o, lse = torch.ops.nsa.selected_attention(*leaves, idx, ls, 0.125, "varlen")
    got = (o, lse, *torch.autograd.grad(o, leaves, grad))
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_o, ref_lse = torch.ops.nsa.selected_attention(*exact, idx, ls, 0.125, "reference")
    ref = (ref_o, ref_lse, *torch.autograd.grad(ref_o, exact, grad.double()))
    for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
        if name == "lse":
            assert (a.double() - r).abs().max().item() < 0.05, name
            continue
        err = rel_rms(a, r)
        assert a.dtype == dtype and err <= FLOORS[dtype], (name, dtype, err)
        assert a.transpose(1, 2).is_contiguous(), name


@pytest.mark.gpu
@pytest.mark.parametrize("h", [1, 4, 6, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_the_float64_reference_s1000(h, dtype, monkeypatch):
    """S = 1000 (not a multiple of l' = 64), batch 2, G = 2, Dk = Dv = 64, n = 4, a duplicate; for
    h = 6 the chunks are shrunk so that several run (4096 rows: 85 tokens)."""
    _issue_size_case(1000, h, dtype, chunk_rows=4096 if h == 6 else None, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.sweep
@pytest.mark.parametrize("h", [1, 4, 6, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_the_float64_reference_s4096(h, dtype, monkeypatch):
    _issue_size_case(4096, h, dtype, monkeypatch=monkeypatch)


@pytest.mark.gpu
def test_varlen_refusals_on_cuda():
    q = torch.zeros(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, 128, 2, device="cuda", dtype=torch.int64)
    assert sv.unsupported_reason(q, k, k, idx, 64) is None
    assert "float16/bfloat16 only" in sv.unsupported_reason(q.float(), k.float(), k.float(), idx, 64)
    assert "equal head dims" in sv.unsupported_reason(q, k, k[..., :32], idx, 64)


@pytest.mark.gpu
def test_the_tiny_model_with_selection_backend_varlen():
    """OptimizeConfig(selected_attention_backend='varlen'): the pass writes the backend into the graph and
    the rewritten model trains the eager model's numbers in bf16 (check_parity's bar)."""
    import copy

    from helpers import row, tokens

    import nsa_compile
    from nsa_compile.models import build_model
    from nsa_compile.parity import check_parity

    config = nsa_compile.OptimizeConfig(compiler="aot_eager", selected_attention_backend="varlen")

    def optimize(model):
        torch._dynamo.reset()
        return nsa_compile.optimize(model, config)

    torch.manual_seed(0)
    eager = build_model("tiny").cuda()
    batch = tokens(2, 100, seed=1).cuda()
    report = check_parity(eager, optimize, batch, torch.bfloat16)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = optimize(copy.deepcopy(eager).to(torch.bfloat16))
    model.loss(batch).backward()
    r = row(model, "selected_attention")
    assert r["matches"] == eager.cfg.n_layers and "[varlen]" in r["kernels"][0], r


def test_the_pass_refuses_varlen_on_the_cpu_with_the_reason():
    """OptimizeConfig(selected_attention_backend='varlen') where FA-2 cannot run (the CPU): the eager branch
    stays, and `explain`'s near misses give the reason (no silent fallback to another backend)."""
    from helpers import optimize_fresh, row, tokens

    import nsa_compile
    from nsa_compile.cli import near_misses
    from nsa_compile.models import build_model

    torch.manual_seed(0)
    model = optimize_fresh(build_model("tiny"), nsa_compile.OptimizeConfig(compiler="aot_eager",
                                                                           selected_attention_backend="varlen"))
    model.loss(tokens(2, 40)).backward()
    assert row(model, "selected_attention")["matches"] == 0
    reasons = {m["reason"] for m in near_misses(model) if m["pass"] == "selected_attention"}
    assert any("backend 'varlen' cannot run these inputs: FA-2 runs on CUDA only" in r for r in reasons), reasons


@pytest.mark.gpu
def test_varlen_refuses_one_token_sequences_on_cuda():
    """S = 1: FA-2's backward returned a wrong dq (5.7e31, H200, torch 2.11): refused, with why."""
    q, k, v = (torch.randn(2, heads, 1, 32, device="cuda", dtype=torch.bfloat16) for heads in (8, 2, 2))
    idx = torch.zeros(2, 2, 1, 3, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="S = 1"):
        sel.choose_backend(q, k, v, idx, 64, "varlen")


@pytest.mark.gpu
@pytest.mark.parametrize("S,ls", [(2, 64), (63, 64), (100, 64), (100, 16)])
def test_varlen_odd_sizes_on_cuda(S, ls):
    """S = 2 (the smallest accepted), S < l', S not a multiple of l', against the float64
    reference, bf16, h = 4, batch 2, a duplicate."""
    g = torch.Generator(device="cuda").manual_seed(S + ls)
    h, G, D, n = 4, 2, 32, 3
    q, k, v, grad = (torch.randn(B, S, heads, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
                     for heads in (G * h, G, G, G * h))
    idx = random_block_idx(B, G, S, n, ls, seed=S, device="cuda").clone()
    idx[0, 1, S - 1, :2] = idx[0, 1, S - 1, 1].item()
    ours = run_varlen(q, k, v, grad, idx, ls, D**-0.5, None)
    check(ours, reference(q, k, v, grad, idx, ls, D**-0.5), torch.bfloat16, f"S={S} l'={ls}")
