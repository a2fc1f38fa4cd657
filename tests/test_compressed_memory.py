"""lucidrains' compressed branch (issue 17, point 3): learned memory slots and strict visibility.

nsa::compressed_attention takes them as its staircase intercept `block` (nsa_compile/ops/compressed.py):
M memory columns before blocks that end at i*d + e, seen from t = i*d + e + delay (delay 1: strictly
after the last token), are the one staircase j*d + block - 1 <= t with block = e + 1 + delay - M*d.
Here: the op against an eager formula written in lucidrains' spelling (float64 oracle, fp32, bf16,
fp16, odd sizes, outputs and gradients, the reference backend; the Triton kernels through the CPU
interpreter at intercepts <= 0), and the compressed_attention pass on a small module in lucidrains'
spelling (fired once, the softmax gone, the op present, outputs and gradients as eager; near
misses refused with the graph unchanged and the reason).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import helpers
from helpers import only_graph, optimize_fresh, row
from oracles import (
    assert_close_all, assert_kernel_matches_reference, assert_within_twice_eager, attention_inputs,
    triton_interpreter, upcast,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile
from nsa_compile.ops import compressed as cmp_mod
from nsa_compile.ops import compressed_attention
from nsa_compile.ops import compressed_triton as ct

B, G, DK, DV = 2, 2, 16, 24
CMP = "compressed_attention"


def intercept(M: int, d: int, end: int, delay: int) -> int:
    """The op's block argument for M memory slots before blocks ending at i*d + end, seen `delay`
    tokens after their last one."""
    return end + 1 + delay - M * d


def lucid_eager(q, k, v, M, d, end, delay, scale):
    """lucidrains' compressed attention, heads first: k, v [B, G, M + W, D] hold M memory slots
    then W pooled blocks; block i ends at token i*d + end (ck_seq), memory at -1; strict
    visibility (`ck_seq < t`) for delay 1, `<=` for delay 0; the finite fill `-finfo.max // 10`;
    the scores upcast as the op computes them (lucidrains' own bf16 path would not). Without memory
    (M = 0) the first rows see nothing: -inf, those rows zeroed, as models/nsa.py (the op's 0)."""
    S, W, h = q.shape[2], k.shape[2] - M, q.shape[1] // k.shape[1]
    ck_seq = F.pad(torch.arange(W) * d + end, (M, 0), value=-1)
    t = torch.arange(S)
    cmask = ck_seq[None, :] < t[:, None] if delay else ck_seq[None, :] <= t[:, None]
    sim = upcast(q @ k.repeat_interleave(h, dim=1).transpose(-1, -2)) * scale
    if M:
        p = sim.masked_fill(~cmask, -torch.finfo(sim.dtype).max // 10).softmax(dim=-1)
    else:
        has = cmask.any(-1, keepdim=True)
        p = sim.masked_fill(~cmask, float("-inf")).masked_fill(~has, 0.0).softmax(dim=-1) * cmask
    return p.to(v.dtype) @ v.repeat_interleave(h, dim=1)


def run(fn, q, k, v, grad_o, *extra):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, *extra)
    return (o.detach(), *torch.autograd.grad(o, leaves, grad_o))


def op(q, k, v, M, d, end, delay, scale, backend="reference"):
    return compressed_attention(q, k, v, intercept(M, d, end, delay), d, scale, backend)


# S, h, M, d, end, delay: lucidrains_per_head's windows (l = d = 8, strict, 2 slots), shared_kv's
# (windows of 8 at stride 4 ending at 4i + 3, strict, 1 slot), inclusive blocks one longer than d,
# strict blocks without memory, 3 slots; S not a multiple of d
CASES = [(37, 2, 2, 8, 7, 1), (50, 3, 1, 4, 3, 1), (41, 1, 2, 5, 5, 0), (33, 2, 0, 4, 3, 1), (29, 3, 3, 3, 2, 1)]


def inputs(S, h, M, d, end, dtype, seed):
    W = max(0, (S - end - 1) // d + 1)  # blocks whose last token is in the sequence
    return attention_inputs(B, S, h, G, DK, DV, dtype, seed, kv_len=M + W)


def test_the_intercept_is_the_lucidrains_mask():
    """The op's staircase i*d + block - 1 <= t over [memory, blocks] is lucidrains' mask, memory
    columns visible from t = 0, for every case (the premise of the rest)."""
    for S, _, M, d, end, delay in CASES:
        W = (S - end - 1) // d + 1
        ck_seq = F.pad(torch.arange(W) * d + end, (M, 0), value=-1)
        t = torch.arange(S)[:, None]
        lucid = ck_seq[None, :] < t if delay else ck_seq[None, :] <= t
        ours = torch.arange(M + W)[None, :] * d + intercept(M, d, end, delay) - 1 <= t
        assert torch.equal(ours, lucid), (S, M, d, end, delay)
        assert M == 0 or bool(ours.any(-1).all())  # no empty row with memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_lucidrains_eager(dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for S, h, M, d, end, delay in CASES:
        q, k, v, grad_o = inputs(S, h, M, d, end, dtype, seed=S + h)
        ours = run(op, q, k, v, grad_o, M, d, end, delay, DK**-0.5)
        eager = run(lucid_eager, q, k, v, grad_o, M, d, end, delay, DK**-0.5)
        assert_close_all(ours, eager, f"S={S} h={h} M={M} d={d} end={end} delay={delay}", **tol)
        if M:  # the memory columns are seen by every query: they get gradients
            assert ours[2][:, :, :M].abs().amin() > 0 and ours[3][:, :, :M].abs().amin() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_vs_fp64_oracle(dtype):
    worst = 0.0
    for S, h, M, d, end, delay in CASES:
        q, k, v, grad_o = inputs(S, h, M, d, end, dtype, seed=2 * S + h)
        extra = (M, d, end, delay, DK**-0.5)
        oracle = run(lucid_eager, *(x.double() for x in (q, k, v, grad_o)), *extra)
        ours = run(op, q, k, v, grad_o, *extra)
        eager = run(lucid_eager, q, k, v, grad_o, *extra)
        worst = max(worst, assert_within_twice_eager(ours, eager, oracle, dtype, f"S={S} M={M} d={d}"))
    assert worst > 0


def test_rows_are_never_empty_with_memory_and_lse_is_finite():
    S, h, M, d, end, delay = 37, 2, 2, 8, 7, 1
    q, k, v, _ = inputs(S, h, M, d, end, torch.float32, seed=5)
    o, lse = torch.ops.nsa.compressed_attention(q, k, v, intercept(M, d, end, delay), d, 0.3, "reference")
    assert lse.isfinite().all() and o[:, :, 0].abs().amax() > 0
    # row 0 sees only the memory slots: their softmax
    scores = q[:, :, :1] @ k[:, :, :M].repeat_interleave(h, 1).transpose(-1, -2) * 0.3
    want = scores.softmax(-1) @ v[:, :, :M].repeat_interleave(h, 1)
    torch.testing.assert_close(o[:, :, :1], want, rtol=1e-6, atol=1e-6)


def test_block_validation():
    """block is any int without pos (the intercept), >= 1 with pos (also the slot length)."""
    q, k, v, _ = inputs(20, 2, 1, 4, 3, torch.float32, seed=0)
    assert cmp_mod._check(q, k, v, -1000, 4, 0.3) == "reference"
    pos = torch.arange(20).expand(B, 20)
    with pytest.raises(ValueError, match="block must be >= 1 with pos"):
        compressed_attention(q, k, v, -3, 4, 0.3, "reference", pos)


# --- the Triton kernels (interpreted on the CPU) at intercepts <= 0 --------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"fwd": {"ROWS": 16, "BLOCK_N": 16}, "dq": {"ROWS": 16, "BLOCK_N": 16},
         "dkdv": {"ROWS": 16, "BLOCK_N": 16, "SEGMENT": 16}}


@pytest.mark.parametrize(
    "S, h, M, d, end, delay, dtype, tiles",
    [(37, 2, 2, 8, 7, 1, torch.float32, None), (50, 3, 1, 4, 3, 1, torch.bfloat16, SMALL),
     (45, 1, 3, 2, 1, 1, torch.float16, SMALL)],
    ids=["per-head-M2", "shared-kv-M1-bf16-split", "M3-d2-fp16-split"],
)
def test_triton_matches_the_reference_with_memory(S, h, M, d, end, delay, dtype, tiles):
    """Intercepts -7, 1 and -1: memory columns seen from t = 0 (the dk/dv kernel's EARLY path),
    dk/dv split into several work items per key tile (SEGMENT 16)."""
    pytest.importorskip("triton")
    block = intercept(M, d, end, delay)
    q, k, v, grad_o = (x.to(DEVICE) for x in inputs(S, h, M, d, end, dtype, seed=S))
    with triton_interpreter(on=DEVICE == "cpu"):
        assert ct.unsupported_reason(q, k, v, block, d) is None
        o, lse = ct.compressed_forward(q, k, v, block, d, 0.3, tiles=tiles)
        grads = ct.compressed_backward(grad_o, q, k, v, o, lse, block, d, 0.3, tiles=tiles)
    f = lambda x: x.float()
    ref_o, ref_lse = cmp_mod._reference_forward(f(q), f(k), f(v), block, d, 0.3)
    ref = (ref_o, *cmp_mod._reference_backward(f(grad_o), f(q), f(k), f(v), block, d, 0.3))
    assert lse.isfinite().all()
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert_kernel_matches_reference((o, *grads), ref, dtype, f"S={S} M={M} d={d} block={block}")


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the kernel tests launch the compiled kernels")
def test_the_early_dkdv_kernel_compiles_for_sm90_without_a_gpu(monkeypatch):
    """EARLY (block < 1) is a constexpr of the dk/dv kernel: its compiled path, which the
    interpreted tests never take, builds to PTX for an H100 (bf16, h 6, D 64: the seed's tiles)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = ct._tiles(64, 64, False)["dkdv"]
    fn = ct.dkdv_kernel.built()
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "DK": "*bf16", "DV": "*bf16",
                "LSE": "*fp32", "DELTA": "*fp32", "PK": "*fp32", "PV": "*fp32", "ITEM_TILE": "*i32",
                "ITEM_SEG": "*i32", "TILE_NSEG": "*i32", "SLOT": "*i32", "LO": "*i32", "HI": "*i32", "COUNT": "*i32",
                "END": "*i32"}  # fmt: skip
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name)
                 or ("fp32" if p.name == "scale" else "i32") for p in fn.params}
    given = {"HPG": 6, "DK_": 64, "DV_": 64, "DK_P": 64, "DV_P": 64, "PREC": "tf32", "UPCAST": False,
             "HAS_POS": False, "EARLY": True} | cfg
    constants = {n: v for n, v in given.items() if signature.get(n) == "constexpr"}
    compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={n: v for n, v in cfg.items() if n.startswith("num_")})
    assert ".entry dkdv_kernel(" in compiled.asm["ptx"]


# --- the pass on a module in lucidrains' spelling ------------------------------------------------


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class LucidCompressed(nn.Module):
    """lucidrains' compressed branch (tests/corpus/lucidrains_per_head.py): non-overlapping windows
    of l = d tokens cut by unflatten, a Linear compressor, M memory slots `cat`-ed before them,
    GQA by unsqueeze + repeat + flatten, the mask from a padded `ck_seq`, einsum scores filled with
    `-finfo.max // 10`, einsum p @ v. Returns the output and the masked logits (lucidrains' block
    choice reads them). `change` makes a near miss."""

    def __init__(self, change=None, heads=4, kv_heads=2, dim_head=8, block=4, mem=2):
        super().__init__()
        self.change, self.block, self.h, self.scale = change, block, heads // kv_heads, dim_head**-0.5
        self.mem_kv = nn.Parameter(torch.randn(2, kv_heads, mem, dim_head) * 0.5)
        self.k_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(block * dim_head, dim_head))
        self.v_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(block * dim_head, dim_head))

    def repeat_heads(self, t):  # 'b h ... -> b (h gh) ...'
        return t.unsqueeze(2).repeat(1, 1, self.h, 1, 1).flatten(1, 2)

    def forward(self, q, k, v):  # q [b, H, n, d], k and v [b, G, n, d]
        b, n, block = q.shape[0], q.shape[2], self.block
        W = n // block
        ck = self.k_compress(k[..., : W * block, :].unflatten(2, (W, block)))
        cv = self.v_compress(v[..., : W * block, :].unflatten(2, (W, block)))
        mem_k, mem_v = self.mem_kv.unsqueeze(1).repeat(1, b, 1, 1, 1)
        M = mem_k.shape[-2]
        if self.change == "no-memory":  # the first queries see no block: the finite fill averages them
            M = 0
        else:
            ck, cv = torch.cat((mem_k, ck), dim=-2), torch.cat((mem_v, cv), dim=-2)
        ck, cv = self.repeat_heads(ck), self.repeat_heads(cv)
        ends = (torch.arange(W, device=q.device) + 1) * block - (0 if self.change == "late-by-two" else 1)
        ck_seq = F.pad(ends, (M, 0), value=0 if self.change == "memory-hidden-at-0" else -1)
        cmask = ck_seq[None, :] < torch.arange(n, device=q.device)[:, None]
        csim = torch.einsum("b h i d, b h j d -> b h i j", q, ck) * self.scale
        csim = csim.masked_fill(~cmask, max_neg_value(csim) // 10)
        out = torch.einsum("b h i j, b h j d -> b h i d", csim.softmax(dim=-1), cv)
        return out, csim


def branch_inputs(S=23, heads=4, kv_heads=2, dim_head=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, S, dim_head, generator=gen), torch.randn(2, kv_heads, S, dim_head, generator=gen),
            torch.randn(2, kv_heads, S, dim_head, generator=gen))


def run_both(module, args):
    eager_args = [x.clone().requires_grad_() for x in args]
    opt_args = [x.clone().requires_grad_() for x in args]
    expected = module(*eager_args)
    optimized = optimize_fresh(copy.deepcopy(module), nsa_compile.OptimizeConfig(compiler="aot_eager"))
    return (expected, eager_args, module), (optimized(*opt_args), opt_args, optimized)


def gradients(out, csim, leaves, module):
    loss = out.square().sum() + (csim.clamp_min(-10) * 0.1).sum()  # the kept logits get gradients too
    return torch.autograd.grad(loss, [*leaves, *module.parameters()])


@pytest.mark.parametrize("mem, block, S", [(2, 4, 23), (1, 3, 20), (3, 5, 31)])
def test_pass_fires_once_with_the_softmax_gone_and_eager_outputs_and_gradients(mem, block, S):
    torch.manual_seed(0)
    module = LucidCompressed(block=block, mem=mem)
    (expected, eager_args, eager_mod), (got, opt_args, optimized) = run_both(module, branch_inputs(S))
    r = row(optimized, CMP)
    assert r["matches"] == 1, r
    assert r["kernels"] == [f"nsa.compressed_attention[reference] (l={block}, d={block}, strict visibility (block i "
                            f"seen from t = i*d + l), {mem} memory slot{'s' if mem > 1 else ''} seen by every query, "
                            f"fill -3.40282e+37 read as -inf, the scores also kept for output, GQA-native, no "
                            "repeated K/V; not triton: the Triton kernels run on CUDA (tensors on cpu))"]
    record = only_graph(optimized)
    assert record.code_before.count("softmax(") == 1 and "softmax(" not in record.code_after
    want = block + 1 - mem * block  # the op's intercept: l + 1 (strict) - M*d
    assert "torch.ops.nsa.compressed_attention(" in record.code_after
    (node,) = [n for n in record.aten["forward"].graph.nodes if n.target is torch.ops.nsa.compressed_attention.default]
    assert (node.args[3], node.args[4]) == (want, block)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    for a, e in zip(gradients(*got, opt_args, optimized), gradients(*expected, eager_args, eager_mod)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert len([n for n in record.aten["backward"].graph.nodes
                if n.target is torch.ops.nsa.compressed_attention_backward.default]) == 1


@pytest.mark.parametrize(
    "change, reason",
    [("memory-hidden-at-0", "memory slot 0 (of the 2 before the pooled blocks: cat((mem, pooled))) is hidden from "
                            "query 0: memory slots must be visible to every query"),
     ("late-by-two", "the visibility mask is off by 2: block i becomes visible at t = i*d + l - 1 + 2, not at its "
                     "last token (pooling l=4, d=4); the op takes a block from its last token (i*d + l - 1 <= t) or "
                     "strictly after it (< t)"),
     ("no-memory", "the visibility mask fills -3.40282e+37, not -inf, and rows without a visible block are not "
                   "zeroed: eager gives them the uniform average of the blocks, the op 0")],
)
def test_near_misses_are_refused_with_the_graph_unchanged(change, reason):
    torch.manual_seed(0)
    (expected, _, _), (got, _, optimized) = run_both(LucidCompressed(change), branch_inputs())
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)  # the same eager code ran
    record = only_graph(optimized)
    assert "softmax(" in record.code_after and "nsa.compressed_attention" not in record.code_after
    r = row(optimized, CMP)
    assert r["matches"] == 0 and reason in r["reasons"], r["reasons"]


def test_memory_read_from_the_sequence_is_refused():
    """`cat((m, pooled))` with m computed from the keys is no memory slot: refused, named."""

    class FromSequence(LucidCompressed):
        def forward(self, q, k, v):
            n, block = q.shape[2], self.block
            W = n // block
            ck = self.k_compress(k[..., : W * block, :].unflatten(2, (W, block)))
            cv = self.v_compress(v[..., : W * block, :].unflatten(2, (W, block)))
            mem_k, mem_v = k[:, :, :2] * 0 + k.mean(2, keepdim=True), v[:, :, :2] * 0 + 1.0
            ck = self.repeat_heads(torch.cat((mem_k, ck), dim=-2))
            cv = self.repeat_heads(torch.cat((mem_v, cv), dim=-2))
            ck_seq = F.pad((torch.arange(W) + 1) * block - 1, (2, 0), value=-1)
            cmask = ck_seq[None, :] < torch.arange(n)[:, None]
            csim = torch.einsum("b h i d, b h j d -> b h i j", q, ck) * self.scale
            csim = csim.masked_fill(~cmask, max_neg_value(csim) // 10)
            return torch.einsum("b h i j, b h j d -> b h i d", csim.softmax(dim=-1), cv), csim

    torch.manual_seed(0)
    (_, _, _), (_, _, optimized) = run_both(FromSequence(), branch_inputs())
    r = row(optimized, CMP)
    assert r["matches"] == 0 and any("not memory slots from parameters" in text for text in r["reasons"]), r["reasons"]


# --- the casts CUDA autocast makes, written out (bench_corpus found them on the GPU) -----------------

AUTOCAST_DTYPE = torch.bfloat16
# the block choice off: its bf16 logits have ties that torch.topk breaks its own way (a row may then
# read other blocks than eager's), which says nothing of the compressed branch
COMPRESSED_ONLY = helpers.FAST.replace(disabled_passes=("select_blocks", "selected_attention"))


def autocast_attend(scale_override=None):
    """lucidrains' `attend` with the casts CUDA bf16 autocast makes, written out: the einsums'
    operands cast to bf16 (the compressed keys and values are float32 there: cat with the float32
    memory slots), the masked bf16 logits cast up to float32 for the softmax (autocast's float32
    policy), the probabilities cast back for p @ v. CPU autocast keeps a bf16 softmax, so on the CPU
    this spelling is the only way to give the passes the graph the GPU gives them."""
    from corpus import lucidrains_shared_kv as lucid

    def attend(q, k, v, mask, scale):
        scale = scale if scale_override is None else scale_override
        qh = q.shape[1] // k.shape[1]
        q = q.view(q.shape[0], k.shape[1], qh, *q.shape[2:])
        sim = torch.einsum("b h q i d, b h j d -> b h q i j", q.to(AUTOCAST_DTYPE), k.to(AUTOCAST_DTYPE)) * scale
        sim = sim.masked_fill(~mask, lucid.max_neg_value(sim) // 10)
        attn = sim.to(torch.float32).softmax(dim=-1)
        out = torch.einsum("b h q i j, b h j d -> b h q i d", attn.to(AUTOCAST_DTYPE), v.to(AUTOCAST_DTYPE))
        return out.flatten(1, 2).float(), sim.flatten(1, 2)

    return lucid, attend


def test_autocast_casts_around_the_masked_logits_are_read(monkeypatch):
    """Logits scaled and masked in bf16, then cast up for the softmax, and memory slots cat'ed before
    the cast of the keys: the compressed branch fires (the scale 0.25 is exact in bf16), eager's
    outputs and gradients (bf16 rounding)."""
    lucid, attend = autocast_attend()
    monkeypatch.setattr(lucid, "attend", attend)
    model, x = lucid.make()
    opt = optimize_fresh(copy.deepcopy(model), COMPRESSED_ONLY)
    out = opt(x)
    (record,) = nsa_compile.api.state_of(opt).graphs
    log = next(log for log in record.logs if log.pass_name == CMP)
    assert len(log.matches) == 1, log.refusals
    assert "1 memory slot" in log.matches[0].kernel
    want = model(x)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    out.square().mean().backward()
    want.square().mean().backward()
    for (name, p), (_, p_opt) in zip(model.named_parameters(), opt.named_parameters()):
        torch.testing.assert_close(p_opt.grad, p.grad, rtol=5e-2, atol=5e-3, msg=name)


def test_a_scale_that_bf16_rounds_before_the_cast_up_is_refused(monkeypatch):
    """The same with scale 0.3 (not a power of two): eager rounds s * 0.3 to bf16 before the cast
    up, which the op does not: refused with that reason, the graph unchanged."""
    lucid, attend = autocast_attend(scale_override=0.3)
    monkeypatch.setattr(lucid, "attend", attend)
    model, x = lucid.make()
    opt = optimize_fresh(copy.deepcopy(model), COMPRESSED_ONLY)
    torch.testing.assert_close(opt(x), model(x), rtol=2e-2, atol=2e-2)
    (record,) = nsa_compile.api.state_of(opt).graphs
    log = next(log for log in record.logs if log.pass_name == CMP)
    assert not log.matches
    assert any("scaled by 0.3 in torch.bfloat16 before the cast up to float32" in r.reason for r in log.refusals), \
        log.refusals
    names = [lg.pass_name for lg in record.logs]
    assert log.code_after == record.logs[names.index(CMP) - 1].code_after


class UpcastSoftmax(LucidCompressed):
    """LucidCompressed with its softmax cast up to float32 as CUDA autocast runs it (CPU autocast
    keeps it in bf16): under CPU autocast the graph is then the GPU's, the float32 memory slots
    promoting the cat, so each einsum casts the keys and values, repeated per head, to bf16."""

    def forward(self, q, k, v):
        b, n, block = q.shape[0], q.shape[2], self.block
        W = n // block
        ck = self.k_compress(k[..., : W * block, :].unflatten(2, (W, block)))
        cv = self.v_compress(v[..., : W * block, :].unflatten(2, (W, block)))
        mem_k, mem_v = self.mem_kv.unsqueeze(1).repeat(1, b, 1, 1, 1)
        ck, cv = self.repeat_heads(torch.cat((mem_k, ck), dim=-2)), self.repeat_heads(torch.cat((mem_v, cv), dim=-2))
        ck_seq = F.pad((torch.arange(W, device=q.device) + 1) * block - 1, (mem_k.shape[-2], 0), value=-1)
        cmask = ck_seq[None, :] < torch.arange(n, device=q.device)[:, None]
        csim = torch.einsum("b h i d, b h j d -> b h i j", q, ck) * self.scale
        csim = csim.masked_fill(~cmask, max_neg_value(csim) // 10)
        return torch.einsum("b h i j, b h j d -> b h i d", csim.float().softmax(dim=-1), cv), csim


def test_memory_slots_repeated_per_head_keep_their_reading_under_autocast():
    """The GPU's case (lucidrains_per_head under CUDA autocast, bench_corpus): autocast casts the
    repeated float32 `cat((mem, pooled))` for each einsum. canonicalize's cast goes above the GQA
    repeat (unsqueeze, repeat, flatten: a cast commutes with them), so the pass reads the memory
    slots and the GQA copy on the cast's input, as without autocast: fired once (it refused with
    "repeat_interleave on the way" when the cast sat after the repeat), eager's outputs and
    gradients under autocast."""
    torch.manual_seed(0)
    module = UpcastSoftmax(block=4, mem=2, dim_head=16)  # scale 0.25: exact in bf16
    args = branch_inputs(S=23, dim_head=16)
    eager_args = [x.clone().requires_grad_() for x in args]
    opt_args = [x.clone().requires_grad_() for x in args]
    optimized = optimize_fresh(copy.deepcopy(module), COMPRESSED_ONLY)
    with torch.autocast("cpu", dtype=AUTOCAST_DTYPE):
        want, got = module(*eager_args), optimized(*opt_args)
    r = row(optimized, CMP)
    assert r["matches"] == 1 and "2 memory slots seen by every query" in r["kernels"][0], r
    casts = [k for k in row(optimized, "canonicalize")["kernels"] if k.startswith("autocast:")]
    assert len(casts) == 2, casts  # the two einsums
    record = only_graph(optimized)
    (node,) = [n for n in record.aten["forward"].graph.nodes if n.target is torch.ops.nsa.compressed_attention.default]
    assert {a.meta["val"].dtype for a in node.args[:3]} == {AUTOCAST_DTYPE}
    assert want[0].dtype == got[0].dtype == AUTOCAST_DTYPE
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-2)
    for a, e in zip(gradients(*got, opt_args, optimized), gradients(*want, eager_args, module)):
        torch.testing.assert_close(a.float(), e.float(), rtol=5e-2, atol=5e-2)
