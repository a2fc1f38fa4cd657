"""Graph tests of canonicalize: for each rule a small module in a foreign spelling; the rule fires
(exact count), the source op is gone and the normal form is there, the NSA pass then fires (exact
count), outputs and gradients match eager (fp32; bf16 where the rule moves casts), and near misses
are refused with the graph unchanged and a reason."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import FAST, optimize_fresh, row

import nsa_compile
from nsa_compile.api import state_of

B, G, h, S, D = 2, 2, 2, 24, 8
H = G * h
W = 5  # window
L, STRIDE = 8, 4  # compression block and stride


def only(*names):
    """aot_eager with only the named passes enabled."""
    return FAST.replace(disabled_passes=tuple(p for p in nsa_compile.pass_names() if p not in names))


def canonical_log(model):
    (record,) = state_of(model).graphs
    (log,) = [log for log in record.logs if log.pass_name == "canonicalize"]
    return record, log


def fired(model) -> dict[str, int]:
    """Matches of canonicalize per rule (the word before ':' in what the match became)."""
    counts = {}
    for match in canonical_log(model)[1].matches:
        rule = match.kernel.split(":")[0]
        counts[rule] = counts.get(rule, 0) + 1
    return counts


def code_after_canonicalize(model) -> str:
    return canonical_log(model)[1].code_after


def run(module, inputs, config=FAST, tol=1e-5):
    """Optimize a copy of `module`, and check its outputs and the gradients of every float input
    against eager. Returns the optimized module."""
    def leaves():
        return [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]

    eager_in, opt_in = leaves(), leaves()
    expected = module(*eager_in)
    optimized = optimize_fresh(copy.deepcopy(module), config)
    got = optimized(*opt_in)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    floats = [x for x in eager_in if x.is_floating_point()]
    grad = torch.randn_like(expected, dtype=torch.float32, generator=torch.Generator().manual_seed(5)).to(got.dtype)
    want = torch.autograd.grad(expected, floats, grad)
    have = torch.autograd.grad(got, [x for x in opt_in if x.is_floating_point()], grad)
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return optimized


def qkv(dtype=torch.float32, layout="bhsd", length=S):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(B, H, length, D, generator=g)
    k = torch.randn(B, G, length, D, generator=g)
    v = torch.randn(B, G, length, D, generator=g)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return [x.to(dtype) for x in (q, k, v)]


def window_mask(S, device, w=W):
    t = torch.arange(S, device=device)[:, None]
    s = torch.arange(S, device=device)[None, :]
    return (s <= t) & (t - s < w)


# --- the window branch in foreign spellings -----------------------------------------------------


class Window(nn.Module):
    """Sliding-window attention over q [B, H, S, D] and k, v [B, G, S, D] (or [B, S, H|G, D] for the
    sequence-first spellings), spelled as `spelling` says."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        sp = self.spelling
        S = q.shape[1 if WINDOW_SPELLINGS.get(sp, (None, "bhsd"))[1] == "bshd" else 2]  # the length of this call
        c = D**-0.5
        if sp == "sdpa-bool":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[2], q.device), enable_gqa=True)
        if sp == "sdpa-additive":
            bias = torch.zeros(S, S, device=q.device).masked_fill(~window_mask(S, q.device), float("-inf"))
            kr, vr = k.repeat_interleave(h, 1), v.repeat_interleave(h, 1)
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias)
        if sp == "grouped-5d":  # q [B, G, h, S, D] against k, v [B, G, S, D]
            q5 = q.view(B, G, h, S, D)
            s = torch.einsum("bghsd,bgtd->bghst", q5, k).float() * c
            p = s.masked_fill(~window_mask(S, q.device), -torch.finfo(torch.float32).max).softmax(-1)
            return torch.einsum("bghst,bgtd->bghsd", p.to(v.dtype), v).flatten(1, 2)
        if sp == "sequence-first":  # [B, S, H, D]: einsum, GQA by expand + flatten, q scaled first
            kr = k.unsqueeze(3).expand(B, S, G, h, D).flatten(2, 3)
            vr = v.unsqueeze(3).expand(B, S, G, h, D).flatten(2, 3)
            s = torch.einsum("bqhd,bkhd->bhqk", q * c, kr)
            p = s.masked_fill(~window_mask(S, q.device), float("-inf")).softmax(-1)
            return torch.einsum("bhqk,bkhd->bqhd", p, vr)
        if sp == "key-permute":  # [B, S, G, D] keys repeated on dim 2, permuted to k^T in one permute
            kr, vr = k.repeat_interleave(h, dim=2), v.repeat_interleave(h, dim=2)
            s = torch.matmul(q.transpose(1, 2), kr.permute(0, 2, 3, 1)) * c
            p = torch.softmax(torch.where(window_mask(S, q.device), s, float("-inf")), dim=-1)
            return torch.matmul(p, vr.transpose(1, 2)).transpose(1, 2)
        if sp == "hf-repeat-kv":  # Hugging Face's repeat_kv
            kr, vr = (x[:, :, None].expand(B, G, h, S, D).reshape(B, H, S, D) for x in (k, v))
        else:
            kr, vr = k.repeat_interleave(h, 1), v.repeat_interleave(h, 1)
        keep = window_mask(S, q.device)
        if sp == "einsum":
            s = torch.einsum("bhid,bhjd->bhij", q, kr)
        else:
            s = q @ kr.transpose(-1, -2)
        if sp == "mask-before-upcast":  # scaled and masked in q's dtype, the softmax upcasts (dtype=float32)
            p = (s * c).masked_fill(~keep, float("-inf")).softmax(dim=-1, dtype=torch.float32)
            return p.to(v.dtype) @ vr
        s = s.float() * c
        if sp == "finfo-min":
            s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
        elif sp == "minus-1e9":
            s = torch.where(keep, s, -1e9)
        elif sp == "where-fill-first":
            s = torch.where(~keep, float("-inf"), s)
        elif sp == "additive":
            s = s + torch.zeros(S, S, device=q.device).masked_fill(~keep, float("-inf"))
        elif sp == "two-masks":  # causal, then the band, each with -inf
            t = torch.arange(S, device=q.device)
            s = s.masked_fill(t[None, :] > t[:, None], float("-inf")).masked_fill(t[:, None] - t[None, :] >= W, -1e30)
        else:
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1)
        if sp == "einsum":
            return torch.einsum("bhij,bhjd->bhid", p.to(v.dtype), vr)
        return p.to(v.dtype) @ vr


WINDOW_SPELLINGS = {
    # spelling: (rules that fire, with counts), inputs layout
    "einsum": ({"einsum": 2}, "bhsd"),
    "sequence-first": ({"einsum": 2, "gqa_expand": 2, "gqa_layout": 2}, "bshd"),
    "hf-repeat-kv": ({"gqa_expand": 2}, "bhsd"),
    "key-permute": ({"key_layout": 1, "gqa_layout": 2}, "bshd"),
    "finfo-min": ({"scores": 1}, "bhsd"),
    "minus-1e9": ({"scores": 1}, "bhsd"),
    "where-fill-first": ({"scores": 1}, "bhsd"),
    "additive": ({"scores": 1}, "bhsd"),
    "two-masks": ({"scores": 1}, "bhsd"),
    "mask-before-upcast": ({"scores": 1}, "bhsd"),
    "sdpa-bool": ({"sdpa": 1}, "bhsd"),
    "sdpa-additive": ({"sdpa": 1, "scores": 1}, "bhsd"),
    "grouped-5d": ({"grouped_heads": 1, "einsum": 2, "scores": 1}, "bhsd"),
}


@pytest.mark.parametrize("spelling", list(WINDOW_SPELLINGS))
def test_window_spellings_become_the_normal_form_and_the_window_pass_fires(spelling):
    rules, layout = WINDOW_SPELLINGS[spelling]
    model = run(Window(spelling), qkv(layout=layout), only("canonicalize", "window_attention"))
    assert fired(model) == rules
    code = code_after_canonicalize(model)
    for gone in ("einsum", "scaled_dot_product_attention", "expand", "finfo", "1e+09", "1e+30"):
        assert gone not in code.split("def forward")[1] or gone == "expand" and spelling != "hf-repeat-kv", gone
    assert "softmax" in code and ("masked_fill" in code or "where" in code)
    r = row(model, "window_attention")
    assert (r["matches"], r["refused"]) == (1, 0), r["reasons"]
    assert r["kernels"][0].startswith(f"nsa.window_attention[reference] (w={W}, ")


@pytest.mark.parametrize("spelling", ["mask-before-upcast", "minus-1e9"])
def test_window_spellings_in_bf16_match_eager(spelling):
    """The scores rule moves the upcast before the mask (and the mask after the scale): in bf16 the
    rewritten model agrees with eager bf16 as closely as eager agrees with itself in float64."""
    inputs = qkv(torch.bfloat16)
    module = Window(spelling)
    model = run(module, inputs, only("canonicalize", "window_attention"), tol=2e-2)
    assert fired(model) == {"scores": 1} and row(model, "window_attention")["matches"] == 1
    exact = module(*(x.double() for x in inputs))
    eager_err = (module(*inputs).double() - exact).norm() / exact.norm()
    got_err = (model(*inputs).double() - exact).norm() / exact.norm()
    assert got_err <= 3 * eager_err + 1e-3, (got_err, eager_err)


def test_the_reference_spelling_is_left_as_it_is():
    model = run(Window("reference"), qkv(), only("canonicalize", "window_attention"))
    record, log = canonical_log(model)
    assert fired(model) == {} and log.refusals == [] and log.code_after == record.code_before
    assert row(model, "window_attention")["matches"] == 1


# --- near misses: refused, graph unchanged -------------------------------------------------------


class NearMiss(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        sp = self.spelling
        t = torch.arange(S, device=q.device)
        if sp == "tiled-gqa":  # head j reads K/V head j % G: not repeat_interleave's j // h
            kr, vr = k.repeat(1, h, 1, 1), v.repeat(1, h, 1, 1)
        else:
            kr, vr = k.repeat_interleave(h, 1), v.repeat_interleave(h, 1)
        if sp == "sdpa-two-sided":  # not causal: SDPA stays
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=(t[:, None] - t[None, :]).abs() < W)
        if sp.startswith("sdpa-documents"):  # the window within two documents of constant lengths 10 and 14
            doc = (t >= 10).long()
            keep = window_mask(S, q.device) & (doc[:, None] == doc[None, :])
            if sp == "sdpa-documents-additive":  # -inf outside: the documents are read from bool masks only
                mask = torch.zeros(S, S, device=q.device).masked_fill(~keep, float("-inf"))
            else:  # the second document's window one token wider: not one window w
                mask = keep | ((t[:, None] - t[None, :] == W) & (t[None, :] >= 10))
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        if sp == "einsum-three-operands":
            s = torch.einsum("bhid,bhjd,h->bhij", q, kr, torch.ones(H, device=q.device)) * D**-0.5
        else:
            s = (q @ kr.transpose(-1, -2)).float() * D**-0.5
        if sp == "finite-fill-empty-row":  # query 0 sees no key: uniform with -1e9, NaN with -inf
            s = s.masked_fill(~((t[None, :] < t[:, None]) & (t[:, None] - t[None, :] < W)), -1e9)
        elif sp == "additive-shift":  # a bias of 0 and -1: it shifts scores, it does not mask
            s = s + torch.zeros(S, S, device=q.device).masked_fill(~window_mask(S, q.device), -1.0)
        else:
            s = s.masked_fill(~window_mask(S, q.device), float("-inf"))
        return torch.softmax(s, dim=-1) @ vr


@pytest.mark.parametrize("spelling, reason", [
    ("finite-fill-empty-row", ("scores: finite fill -1e+09 not rewritten: a row can be fully masked: with the finite "
                               "fill it gets the uniform average of its keys, with -inf NaN")),
    ("additive-shift", "scores: the additive mask adds -1.0 (not -inf or a large negative <= -10000)"),
    ("tiled-gqa", ("gqa_expand: x.repeat(1, 2, 1, 1) tiles K/V over the heads (head r * G + g reads group g); the "
                   "ops take head g * h + r (repeat_interleave): a different grouping, not rewritten")),
    ("sdpa-two-sided", "sdpa: SDPA's mask is not a causal sliding window: SDPA stays"),
    ("sdpa-documents-additive", ("sdpa: SDPA's additive mask is a causal window of 5 tokens within each of 2 "
                                 "documents of constant bounds: the documents are read from a bool mask only; SDPA "
                                 "stays")),
    ("sdpa-documents-two-windows", "sdpa: SDPA's mask is not a causal sliding window: SDPA stays"),
    ("einsum-three-operands", "einsum: einsum of 3 operands (the matmul form takes two tensors)"),
])
def test_near_misses_are_refused_with_the_graph_unchanged(spelling, reason):
    model = run(NearMiss(spelling), qkv(), only("canonicalize"))
    record, log = canonical_log(model)
    assert [r.reason for r in log.refusals] == [reason] * (2 if spelling == "tiled-gqa" else 1)  # K and V
    assert log.matches == [] and log.code_after == record.code_before


def test_a_tiled_gqa_is_still_correct_as_full_heads():
    """The window pass takes the tiled copy as H heads of their own (correct, without the GQA saving)."""
    model = run(NearMiss("tiled-gqa"), qkv(), only("canonicalize", "window_attention"))
    assert row(model, "window_attention")["matches"] == 1


# --- the compressed branch: empty rows zeroed after the softmax -----------------------------------


class Compressed(nn.Module):
    """Compressed attention: mean pooling of l tokens every d, the staircase i*d + l - 1 <= t, the
    first l - 1 rows with no block zeroed after the softmax as `spelling` says."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        sp = self.spelling
        S = q.shape[2]  # the length of this call
        kc = k.unfold(2, L, STRIDE).mean(-1).repeat_interleave(h, 1)  # [B, H, Tc, D]
        vc = v.unfold(2, L, STRIDE).mean(-1).repeat_interleave(h, 1)
        Tc = kc.shape[2]
        t = torch.arange(S, device=q.device)[:, None]
        visible = torch.arange(Tc, device=q.device)[None, :] * STRIDE + L - 1 <= t  # [S, Tc]
        empty = ~visible.any(-1, keepdim=True)  # [S, 1]
        s = (q @ kc.transpose(-1, -2)).float() * D**-0.5
        fill = torch.finfo(s.dtype).min if sp.startswith("finfo-min") else float("-inf")
        p = torch.softmax(s.masked_fill(~visible, fill), dim=-1)
        if sp == "nan_to_num":
            p = torch.nan_to_num(p)
        elif sp == "where-zeros-like":
            p = torch.where(empty, torch.zeros_like(p), p)
        elif sp in ("masked_fill-after", "finfo-min-then-zero"):
            p = p.masked_fill(empty, 0.0)
        o = p.to(v.dtype) @ vc
        if sp.endswith("output-zeroed"):  # rows of uniform weights (finfo.min) or NaN (-inf) zeroed
            o = o.masked_fill(empty, 0.0)
        return o


@pytest.mark.parametrize("spelling, rules", [
    ("masked_fill-after", {"empty_rows": 1}),
    ("nan_to_num", {"empty_rows": 1}),
    ("where-zeros-like", {"empty_rows": 1}),
    ("finfo-min-then-zero", {"scores": 1, "empty_rows": 1}),
    ("finfo-min-output-zeroed", {"scores": 1, "empty_rows": 1}),
])
def test_empty_rows_become_the_compressed_form_and_the_compressed_pass_fires(spelling, rules):
    model = run(Compressed(spelling), qkv(), only("canonicalize", "compressed_attention"))
    assert fired(model) == rules
    code = code_after_canonicalize(model).split("def forward")[1]
    assert "nan_to_num" not in code and "zeros_like" not in code
    r = row(model, "compressed_attention")
    assert (r["matches"], r["refused"]) == (1, 0), r["reasons"]
    assert r["kernels"][0].startswith(f"nsa.compressed_attention[reference] (l={L}, d={STRIDE}, ")


def test_zeroing_the_output_of_nan_rows_is_refused():
    """-inf on every block of the first rows, then the *output* zeroed: eager's forward is 0 there but
    its backward is NaN (p^T @ grad_o with NaN rows of p); the rewrite would make it finite."""
    module = Compressed("output-zeroed")
    inputs = [x.requires_grad_() for x in qkv()]
    model = optimize_fresh(copy.deepcopy(module), only("canonicalize", "compressed_attention"))
    out = model(*inputs)
    torch.testing.assert_close(out, module(*inputs))
    assert torch.autograd.grad(out.sum(), inputs[2])[0].isnan().any()  # as eager's
    record, log = canonical_log(model)
    assert [r.reason for r in log.refusals] == [
        ("empty_rows: rows with no key are NaN until the output is zeroed: eager's backward is NaN there "
         "(p^T @ grad_o with NaN rows of p), the rewritten one would not be")]
    assert log.code_after == record.code_before
    assert row(model, "compressed_attention")["matches"] == 0


# --- the selected branch as a 5-D SDPA -------------------------------------------------------------


class SelectedSDPA(nn.Module):
    """Selected attention as SDPA over [B, H, S, 1, D] queries and gathered [B, H, S, n*l', D] keys
    with a boolean mask (SDPA gives 0 to a row with no key)."""

    block = 4

    def forward(self, q, k, v, block_idx):
        ls = self.block
        t = torch.arange(S, device=q.device)[:, None]
        tokens = (block_idx.clamp(min=0)[..., None] * ls + torch.arange(ls, device=q.device)).flatten(-2)
        valid = (block_idx >= 0)[..., None].expand(-1, -1, -1, -1, ls).flatten(-2) & (tokens <= t)
        index = tokens.clamp(max=S - 1).flatten(2)[..., None].expand(-1, -1, -1, D)
        ks = torch.gather(k, 2, index).view(B, G, S, -1, D).repeat_interleave(h, 1)
        vs = torch.gather(v, 2, index).view(B, G, S, -1, D).repeat_interleave(h, 1)
        mask = valid.repeat_interleave(h, 1).unsqueeze(-2)  # [B, H, S, 1, n*l']
        return F.scaled_dot_product_attention(q.unsqueeze(-2), ks, vs, attn_mask=mask).squeeze(-2)


def test_selected_sdpa_becomes_the_per_query_form_and_the_selection_pass_fires():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(-1, S // SelectedSDPA.block, (B, G, S, 3), generator=g)
    blocks[:, :, :5] = -1  # rows with no block at all: 0 in SDPA, and in the op
    model = run(SelectedSDPA(), [*qkv(), blocks], only("canonicalize", "selected_attention"))
    assert fired(model) == {"sdpa": 1}
    assert "scaled_dot_product_attention" not in code_after_canonicalize(model).split("def forward")[1]
    r = row(model, "selected_attention")
    assert (r["matches"], r["refused"]) == (1, 0), r["reasons"]
    assert "NaN as eager" not in r["kernels"][0]  # SDPA's empty rows are 0: no NaN fill


# --- what the passes read beyond the canonical form -------------------------------------------------


from nsa_compile.models import preset  # noqa: E402
from nsa_compile.models.nsa import NSAAttention, rope_tables  # noqa: E402

TINY = preset("tiny")
NSA_S = 100


class Variant(NSAAttention):
    """models/nsa.py's attention with one spelling changed: block ids in rank order (no ascending
    sort), a finite fill in the selected branch, a pooling by convolution or by padding, ..."""

    def __init__(self, change):
        super().__init__(TINY)
        self.change = change

    def forward(self, x):
        cos, sin = rope_tables(x.shape[1], TINY.rot_dim, TINY.rope_base, x.device)
        return super().forward(x, cos, sin)

    def compress(self, x, compressor, stride):  # [B, S, G, D] -> [B, Tc, G, D]
        l = self.cfg.cmp_block
        if self.change == "conv-pooling":  # a depthwise convolution with an averaging kernel, stride d
            B, S, G, D = x.shape
            flat = x.permute(0, 2, 3, 1).reshape(B, G * D, S)
            weight = torch.full((G * D, 1, l), 1.0 / l, device=x.device, dtype=x.dtype)
            return F.conv1d(flat, weight, stride=stride, groups=G * D).view(B, G, D, -1).permute(0, 3, 1, 2)
        if self.change == "leaky-pooling":  # each block also reads the token after it
            B, S, G, D = x.shape
            flat = F.pad(x.permute(0, 2, 3, 1).reshape(B, G * D, S), (0, 1))
            weight = torch.full((G * D, 1, l + 1), 1.0 / (l + 1), device=x.device, dtype=x.dtype)
            out = F.conv1d(flat, weight, stride=stride, groups=G * D).view(B, G, D, -1).permute(0, 3, 1, 2)
            return out[:, : (S - l) // stride + 1]
        return super().compress(x, compressor, stride)

    def select_blocks(self, p_cmp, S, pos=None):
        if self.change not in ("rank-order", "rank-order-also-returned"):
            return super().select_blocks(p_cmp, S, pos)
        # the reference up to the sort, then the first n in rank order with -1 for the unchosen
        cfg = self.cfg
        B, H, _, Tc = p_cmp.shape
        l, d, ls, n, G = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.n_kv_groups
        Ns = (S + ls - 1) // ls
        i = torch.arange(Tc, device=p_cmp.device)[:, None]
        j = torch.arange(Ns, device=p_cmp.device)[None, :]
        overlap = (torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)).clamp(min=0)
        p_grp = (p_cmp @ (overlap.to(p_cmp.dtype) / l)).view(B, G, H // G, S, Ns).sum(2)
        t = torch.arange(S, device=p_cmp.device)[:, None]
        forced = (j == 0) | (j == t // ls) | (j == t // ls - 1)
        key = torch.where(forced, float("inf"), torch.where(j * ls <= t, p_grp, float("-inf")))
        values, order = torch.sort(key, dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., :n] > float("-inf"), order[..., :n], -1)
        self.leaked = chosen if self.change == "rank-order-also-returned" else None
        return chosen

    def selected_attention(self, q, k, v, block_idx, pos=None):
        o = super().selected_attention(q, k, v, block_idx, pos)
        if self.change == "rank-order-also-returned":  # the ids read in rank order: their order matters
            first = self.leaked[..., :1].repeat_interleave(o.shape[2] // self.leaked.shape[1], dim=1)  # [B, H, S, 1]
            o = o + first.transpose(1, 2).to(o.dtype)
        return o


def nsa_input():
    return [torch.randn(2, NSA_S, TINY.dim, generator=torch.Generator().manual_seed(3))]


def branch_counts(model):
    return {name: row(model, name)["matches"] for name in
            ("window_attention", "compressed_attention", "select_blocks", "selected_attention")}


ALL_BRANCHES = {"window_attention": 1, "compressed_attention": 1, "select_blocks": 1, "selected_attention": 1}
BRANCHES = only("canonicalize", "window_attention", "compressed_attention", "select_blocks", "selected_attention")


@pytest.mark.parametrize("change", ["rank-order", "conv-pooling"])
def test_variants_the_passes_read_beyond_the_canonical_form(change):
    torch.manual_seed(0)
    model = run(Variant(change), nsa_input(), BRANCHES, tol=1e-4)
    assert branch_counts(model) == ALL_BRANCHES, [row(model, p)["reasons"] for p in ALL_BRANCHES]


def test_block_ids_in_rank_order_read_elsewhere_are_refused():
    torch.manual_seed(0)
    model = run(Variant("rank-order-also-returned"), nsa_input(), BRANCHES, tol=1e-4)
    r = row(model, "select_blocks")
    assert r["matches"] == 0 and any("the chosen blocks are in rank order (not sorted ascending)" in x
                                     for x in r["reasons"]), r["reasons"]


def test_a_pooling_that_reads_past_its_block_is_refused_by_the_probe():
    torch.manual_seed(0)
    model = run(Variant("leaky-pooling"), nsa_input(), BRANCHES, tol=1e-4)
    r = row(model, "compressed_attention")
    assert r["matches"] == 0 and any("depends on tokens outside its block" in x for x in r["reasons"]), r["reasons"]


class PaddedPooling(Compressed):
    """Non-overlapping blocks of l tokens through F.pad to a multiple of l and a view (the last,
    partial block is never visible)."""

    def forward(self, q, k, v):
        nc = -(-S // L)
        kc = F.pad(k, (0, 0, 0, nc * L - S)).view(B, G, nc, L, D).mean(-2).repeat_interleave(h, 1)
        vc = F.pad(v, (0, 0, 0, nc * L - S)).view(B, G, nc, L, D).mean(-2).repeat_interleave(h, 1)
        t = torch.arange(S, device=q.device)[:, None]
        visible = (torch.arange(nc, device=q.device)[None, :] + 1) * L - 1 <= t
        s = (q @ kc.transpose(-1, -2)) * D**-0.5
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.nan_to_num(p) @ vc


def test_a_pooling_padded_at_the_end_is_read():
    model = run(PaddedPooling("padded"), qkv(), only("canonicalize", "compressed_attention"))
    assert fired(model) == {"empty_rows": 1}
    r = row(model, "compressed_attention")
    assert r["matches"] == 1 and r["kernels"][0].startswith(f"nsa.compressed_attention[reference] (l={L}, d={L}, ")


class IndexedKeys(nn.Module):
    """Keys fetched by advanced indexing with a non-contiguous index, repeated for GQA."""

    def forward(self, q, k, v):
        perm = torch.arange(S, device=q.device).flip(0).view(1, S).expand(G, S).t()  # [S, G], not contiguous
        rows = k.transpose(1, 2)[torch.arange(B, device=q.device)[:, None, None], perm, torch.arange(G)]
        kr = rows.transpose(1, 2).repeat_interleave(h, 1)  # [B, H, S, D]
        return torch.softmax(q @ kr.transpose(-1, -2), dim=-1) @ v.repeat_interleave(h, 1)


def test_keys_read_by_advanced_indexing_keep_their_copy():
    model = run(IndexedKeys(), qkv(), only("gqa_grouped_matmul"))
    r = row(model, "gqa_grouped_matmul")
    assert r["matches"] == 1 and r["refused"] == 1  # V's copy is removed; K's stays
    assert r["reasons"][0].startswith("the repeated tensor is read by advanced indexing")


def test_an_einsum_of_two_dtypes_is_refused():
    """einsum promotes an outer product of float32 and bfloat16 (it is a mul); matmul would not."""
    class Outer(nn.Module):
        def forward(self, a, b):
            return torch.einsum("i,j->ij", a, b.to(torch.bfloat16))

    model = run(Outer(), [torch.randn(5), torch.randn(3)], only("canonicalize"), tol=1e-2)
    record, log = canonical_log(model)
    assert [r.reason for r in log.refusals] == [
        "einsum: einsum of torch.float32 and torch.bfloat16 operands (matmul takes one dtype)"]
    assert log.code_after == record.code_before


# --- symbolic sizes (dynamic shapes) ----------------------------------------------------------------


class Einsums(nn.Module):
    """Two-operand einsums over inputs whose length S changes between calls: a batched product,
    sequence-first heads, two contracted letters flattened, a letter summed within the left
    operand, and a matrix on the right. `broadcast`: one einsum whose letter is 1 in one operand
    and S in the other (a near miss: matmul does not broadcast a contracted dim)."""

    def __init__(self, broadcast=False):
        super().__init__()
        self.broadcast = broadcast
        self.w = nn.Parameter(torch.randn(G, h, D))  # [G, h, N]
        self.proj = nn.Parameter(torch.randn(D, 3))  # [C, J]

    def forward(self, q, k):  # q [B, H, S, D], k [B, H, S, D]
        if self.broadcast:
            return torch.einsum("bhsd,bhsd->bhs", q, k[:, :, :1])  # k's s: 1, broadcast over q's
        scores = torch.einsum("bhid,bhjd->bhij", q, k)  # [B, H, S, S]
        seq = torch.einsum("bqhd,bkhd->bhqk", q.transpose(1, 2), k.transpose(1, 2))  # [B, H, S, S]
        grouped = q.transpose(1, 2).unflatten(2, (G, h))  # [B, S, G, h, D]
        flat = torch.einsum("bsgh,ghn->bsn", grouped.sum(-1), self.w)  # [B, S, D]: g, h contracted
        summed = torch.einsum("bghsc,cj->bgsj", grouped.permute(0, 2, 3, 1, 4), self.proj)  # [B, G, S, 3]
        return scores.sum(-1) + seq.mean(-1) + flat.sum(-1)[:, None] + summed.sum((-1, 1))[:, None]


def qk_of_length(length: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    return [torch.randn(B, H, length, D, generator=g) for _ in range(2)]


def test_einsums_at_symbolic_sizes_become_matmuls():
    """Four lengths: the first compiles static, the others share one graph with S a symbol, where
    each einsum becomes a matmul whose views take S from the operands (no size of the first call
    written into the graph); outputs and gradients equal eager's at each length."""
    module = Einsums()
    optimized = optimize_fresh(copy.deepcopy(module), only("canonicalize"))
    for length in (9, 10, 11, 17):
        inputs = qk_of_length(length)
        leaves = [[x.clone().requires_grad_() for x in inputs] for _ in range(2)]
        want, got = module(*leaves[0]), optimized(*leaves[1])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        grads = [torch.autograd.grad(out.square().sum(), [*xs, *m.parameters()])
                 for out, xs, m in ((want, leaves[0], module), (got, leaves[1], optimized))]
        for a, b in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    static, symbolic = state_of(optimized).graphs
    assert "torch.SymInt" not in static.code_before and "torch.SymInt" in symbolic.code_before
    (log,) = [log for log in symbolic.logs if log.pass_name == "canonicalize"]
    assert [m.kernel for m in log.matches] == [
        "einsum: 'bhid,bhjd->bhij' -> matmul", "einsum: 'bqhd,bkhd->bhqk' -> matmul",
        "einsum: 'bsgh,ghn->bsn' -> matmul",
        "einsum: 'bghsc,cj->bgsj' -> a sum over h of the left operand, then matmul (torch.einsum's order)"]
    assert log.refusals == []
    body = log.code_after.split("def forward")[1]
    assert "einsum" not in body and body.count("torch.matmul(") == 4
    assert "torch.ops.aten.sym_size.int(" in body  # the flattened views' sizes, read from the operands


class HeadSumEinsum(nn.Module):
    """'bghsc,cj->bgsj' in bf16 (the group sum folded into the block map: grouped5d_nograd's importance
    under CUDA autocast). torch.einsum sums h out of the left operand before the product; summed after
    it, bf16 results differ by up to 0.25 on [0, 1) inputs."""

    def forward(self, p, w):
        return torch.einsum("bghsc,cj->bgsj", p, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_einsum_with_a_letter_of_the_left_operand_alone_sums_it_first_exactly(dtype):
    g = torch.Generator().manual_seed(3)
    p, w = torch.rand(2, G, 6, 19, 30, generator=g).to(dtype), torch.rand(30, 9, generator=g).to(dtype)
    assert not torch.equal(torch.einsum("bghsc,cj->bgsj", p, w), (p @ w).sum(2)) or dtype == torch.float32
    model = optimize_fresh(HeadSumEinsum(), only("canonicalize"))
    assert torch.equal(model(p, w), HeadSumEinsum()(p, w))  # bit for bit: the same sum, then the same product
    _, log = canonical_log(model)
    assert [m.kernel for m in log.matches] == [
        "einsum: 'bghsc,cj->bgsj' -> a sum over h of the left operand, then matmul (torch.einsum's order)"]
    body = log.code_after.split("def forward")[1]
    assert "einsum" not in body and body.index("torch.sum(") < body.index("torch.matmul(")


def test_an_einsum_broadcast_at_symbolic_sizes_is_refused():
    """A contracted letter of size 1 against S: not the same size for every S (broadcast)."""
    module = Einsums(broadcast=True)
    optimized = optimize_fresh(copy.deepcopy(module), only("canonicalize"))
    for length in (9, 10, 11):
        inputs = qk_of_length(length)
        torch.testing.assert_close(optimized(*inputs), module(*inputs), rtol=0, atol=0)
    _, symbolic = state_of(optimized).graphs
    (log,) = [log for log in symbolic.logs if log.pass_name == "canonicalize"]
    assert log.matches == [] and log.code_after == symbolic.code_before
    (refusal,) = log.refusals
    assert re.fullmatch(r"einsum: einsum letter 's' has sizes s\d+ and 1 \(broadcast\)", refusal.reason), refusal


def run_at_lengths(module, inputs_of, config, lengths, tol=1e-5):
    """Optimize a copy of `module` (dynamic=None: the first length compiles static, the next ones
    share one graph with S a symbol) and check outputs and the gradients of every input against
    eager at each length. Returns the optimized module."""
    optimized = optimize_fresh(copy.deepcopy(module), config)
    for length in lengths:
        leaves = [[x.clone().requires_grad_() for x in inputs_of(length)] for _ in range(2)]
        want, got = module(*leaves[0]), optimized(*leaves[1])
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(length))
        for a, b in zip(torch.autograd.grad(got, leaves[1], grad), torch.autograd.grad(want, leaves[0], grad)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return optimized


def static_and_symbolic(model):
    """The two graphs of a model run at three lengths: the first length's, and the symbolic one."""
    static, symbolic = state_of(model).graphs
    assert "torch.SymInt" not in static.code_before and "torch.SymInt" in symbolic.code_before
    return static, symbolic


def log_of(record, name: str):
    (log,) = [log for log in record.logs if log.pass_name == name]
    return log


def rules_fired(record) -> dict[str, int]:
    """Matches of canonicalize per rule in one graph."""
    counts = {}
    for match in log_of(record, "canonicalize").matches:
        counts[match.kernel.split(":")[0]] = counts.get(match.kernel.split(":")[0], 0) + 1
    return counts


@pytest.mark.parametrize("spelling", ["grouped-5d", "sequence-first", "hf-repeat-kv", "key-permute", "sdpa-bool",
                                      "sdpa-additive", "finfo-min", "additive"])
def test_window_spellings_at_symbolic_sizes_keep_their_rules_and_the_window(spelling):
    """S 24, then 25 and 31 in one graph with S a symbol: the rules that fire on the static graph
    (sdpa, grouped_heads, gqa_expand, key_layout, gqa_layout, scores: the masks evaluated at each
    probe size) fire on the symbolic one as often, and the window pass takes the result there."""
    rules, layout = WINDOW_SPELLINGS[spelling]
    model = run_at_lengths(Window(spelling), lambda n: qkv(layout=layout, length=n),
                           only("canonicalize", "window_attention"), (24, 25, 31))
    for record in static_and_symbolic(model):
        assert rules_fired(record) == rules
        assert log_of(record, "canonicalize").refusals == []
        window = log_of(record, "window_attention")
        assert [m.kernel.startswith(f"nsa.window_attention[reference] (w={W}, ") for m in window.matches] == [True]
    body = log_of(static_and_symbolic(model)[1], "canonicalize").code_after.split("def forward")[1]
    assert "scaled_dot_product_attention" not in body and "einsum" not in body and "finfo" not in body


@pytest.mark.parametrize("spelling, rules", [("nan_to_num", {"empty_rows": 1}),
                                             ("finfo-min-then-zero", {"scores": 1, "empty_rows": 1})])
def test_empty_rows_at_symbolic_sizes_keep_their_rules_and_the_compressed_branch(spelling, rules):
    """The rows with no block (t < l - 1 at every S) evaluated at each probe size: empty_rows (and
    the finite fill of scores) fire on the symbolic graph as on the static one, and the compressed
    pass takes the result there."""
    model = run_at_lengths(Compressed(spelling), lambda n: qkv(length=n), only("canonicalize", "compressed_attention"),
                           (24, 25, 31))
    for record in static_and_symbolic(model):
        assert rules_fired(record) == rules and log_of(record, "canonicalize").refusals == []
        assert len(log_of(record, "compressed_attention").matches) == 1


class HiddenRowFrom26(nn.Module):
    """A window whose finite fill (finfo.min) also hides every key of query S - 26: there is no such
    query below S = 26, so every row keeps a key up to S = 25 (the fill can be -inf), but from 26 on
    query S - 26 keeps none and gets the finite fill's uniform average of its keys (NaN with -inf)."""

    def forward(self, q, k, v):
        S = q.shape[2]
        t = torch.arange(S, device=q.device)
        keep = window_mask(S, q.device) & (t[:, None] != S - 26)
        s = (q @ k.repeat_interleave(h, 1).transpose(-1, -2)).float() * D**-0.5
        return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v.repeat_interleave(h, 1)


def test_a_rule_right_at_the_symbolic_graphs_size_but_not_at_the_next_probe_is_refused():
    """Compiled static at S 20 (the fill becomes -inf), then with S a symbol at 25: every row keeps a
    key at 25, but at 26, the next probe size, query 0 keeps none, so the scores rule refuses the
    symbolic graph (naming that size) and leaves it unchanged; eager's uniform row stays, at 26 too."""
    model = run_at_lengths(HiddenRowFrom26(), lambda n: qkv(length=n), only("canonicalize"), (20, 25, 26))
    static, symbolic = static_and_symbolic(model)
    assert rules_fired(static) == {"scores": 1}
    log = log_of(symbolic, "canonicalize")
    assert log.matches == [] and log.code_after == symbolic.code_before
    (refusal,) = log.refusals
    assert re.fullmatch(r"scores: finite fill -3.40282e\+38 not rewritten: a row can be fully masked \(at the probe "
                        r"sizes s\d+=26\): with the finite fill it gets the uniform average of its keys, with -inf NaN",
                        refusal.reason), refusal.reason


# --- softmax written out by hand (exp(s - amax) / sum) -----------------------------------------------


class HandSoftmax(nn.Module):
    """Window attention whose softmax is written out: e = exp(s - max); p = e / e.sum (spellings:
    amax, max(...).values, a detached max; `no-max` leaves the max out)."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        kr, vr = k.repeat_interleave(h, 1), v.repeat_interleave(h, 1)
        s = ((q @ kr.transpose(-1, -2)) * D**-0.5).masked_fill(~window_mask(S, q.device), float("-inf"))
        if self.spelling == "amax":
            e = (s - s.amax(dim=-1, keepdim=True)).exp()
        elif self.spelling == "max-values":
            e = torch.exp(s - s.max(-1, keepdim=True).values)
        elif self.spelling == "detached-max":
            e = (s - s.amax(-1, keepdim=True).detach()).exp()
        else:  # no-max
            e = s.exp()
        return (e / e.sum(-1, keepdim=True)) @ vr


@pytest.mark.parametrize("spelling", ["amax", "max-values", "detached-max"])
def test_a_softmax_written_by_hand_becomes_torch_softmax_and_the_window_pass_fires(spelling):
    model = run(HandSoftmax(spelling), qkv(), only("canonicalize", "window_attention"))
    assert fired(model) == {"softmax": 1}
    code = code_after_canonicalize(model)
    assert "torch.softmax(" in code and ".exp()" not in code and "torch.exp(" not in code
    assert "amax" not in code and ".max(" not in code
    assert row(model, "window_attention")["matches"] == 1


def test_a_softmax_by_hand_without_the_max_is_refused_with_the_graph_unchanged():
    model = run(HandSoftmax("no-max"), qkv(), only("canonicalize"))
    record, log = canonical_log(model)
    assert [r.reason for r in log.refusals] == [
        "softmax: exp(x) / exp(x).sum() without the row max subtracted: exp overflows to inf (a NaN row) where "
        "torch.softmax is finite; not rewritten"]
    assert log.matches == [] and log.code_after == record.code_before


# --- the window within packed documents of constant bounds (a varlen layout) ----------------------


class DocumentWindow(nn.Module):
    """xunhaolai's varlen window: tokens of every row packed into one sequence [1, H, B * S, D]
    (documents of the constant lengths `lengths`, row after row), SDPA under the bool mask of the
    window within each document, as that model assembles it from cu_seqlens."""

    def __init__(self, lengths):
        super().__init__()
        self.lengths = lengths

    def forward(self, q, k, v):
        q, k, v = (x.transpose(0, 1).flatten(1, 2)[None] for x in (q, k, v))  # [1, heads, B * S, D]
        doc = torch.cat([torch.full((n,), i, device=q.device) for i, n in enumerate(self.lengths * B)])
        t = torch.arange(B * S, device=q.device)
        keep = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < W)
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(h, 1), v.repeat_interleave(h, 1), attn_mask=keep)
        return o[0].unflatten(1, (B, S)).transpose(0, 1)  # [B, H, S, D]


def test_a_window_within_constant_documents_becomes_the_packed_window_with_constant_positions():
    model = run(DocumentWindow((10, 3, 11)), qkv(), only("canonicalize", "window_attention"))
    assert fired(model) == {"sdpa": 1}
    code = code_after_canonicalize(model).split("def forward")[1]
    assert "scaled_dot_product_attention" not in code and "torch.tensor(" in code
    r = row(model, "window_attention")
    assert (r["matches"], r["refused"]) == (1, 0), r["reasons"]
    assert r["kernels"][0].startswith(f"nsa.window_attention[reference] (w={W}, per document (pos), ")
    _, log = canonical_log(model)
    assert log.matches[0].kernel == (f"sdpa: F.scaled_dot_product_attention (window of {W} tokens within 6 documents "
                                     "of constant bounds) -> scores, mask from constant positions, softmax, @ v")


# --- reasons for branches that differ in meaning, not in spelling ---------------------------------


class GroupedChoice(nn.Module):
    """Block scores from 5-D grouped queries [B, S, G, h, D] against compressed keys [B, G, Tc, D],
    summed over the group's heads and ranked by topk (nsa-vibe's spelling). `causal`: the scores
    are masked to the blocks complete at t first; without it, every block competes (non-causal)."""

    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        grouped = q.transpose(1, 2).unflatten(2, (G, h))  # [B, S, G, h, D]
        kc = k.unfold(2, L, STRIDE).mean(-1)  # [B, G, Tc, D]
        s = torch.einsum("bsghd,bgcd->bsghc", grouped, kc) * D**-0.5
        if self.causal:
            t = torch.arange(S, device=q.device)[:, None]
            visible = torch.arange(kc.shape[2], device=q.device)[None, :] * STRIDE + L - 1 <= t
            s = s.masked_fill(~visible[None, :, None, None, :], -1e4)
        return torch.softmax(s, dim=-1).sum(3).topk(2, dim=-1).values + v.mean()  # [B, S, G, 2]


@pytest.mark.parametrize("causal, reason", [
    (False, ("grouped_heads: the grouped probabilities are not multiplied by V: a softmax over scores with no mask "
             "(every key, later tokens included) feeding a top-k: block scores that read later tokens (non-causal), "
             "left to select_blocks (its rule 'nsa_vibe')")),
    (True, ("grouped_heads: the grouped probabilities are not multiplied by V once (p @ v as an einsum over the same "
            "group and head dims)")),
])
def test_grouped_block_scores_are_refused_naming_the_unmasked_softmax(causal, reason):
    model = run(GroupedChoice(causal), qkv(), only("canonicalize"))
    _, log = canonical_log(model)
    assert [r.reason for r in log.refusals if r.reason.startswith("grouped_heads")] == [reason]
    assert "grouped_heads" not in fired(model)
    code = log.code_after.split("def forward")[1]
    assert code.count("torch.softmax(") == 1 and "repeat_interleave" not in code  # not written on 4-D heads


class GroupedTwoCasts(nn.Module):
    """5-D grouped attention whose probabilities are cast to bf16 twice: for p @ v and for another
    reader (CUDA autocast's casts written out: grouped5d_nograd's bf16 importance einsum reads the
    compressed probabilities beside o_cmp's). `both_to_v`: the second cast multiplies a V as well."""

    def __init__(self, both_to_v=False):
        super().__init__()
        self.both_to_v = both_to_v

    def forward(self, q, k, v):
        bf16 = torch.bfloat16
        grouped = q.unflatten(1, (G, h))  # [B, G, h, S, D]
        s = torch.einsum("bghsd,bgtd->bghst", grouped.to(bf16), k.to(bf16)).float() * D**-0.5
        t = torch.arange(q.shape[2], device=q.device)
        p = s.masked_fill(t[None, :] > t[:, None], float("-inf")).softmax(-1)
        o = torch.einsum("bghst,bgtd->bghsd", p.to(bf16), v.to(bf16))
        other = (torch.einsum("bghst,bgtd->bghsd", p.to(bf16), (2 * v).to(bf16)).flatten(2) if self.both_to_v
                 else p.to(bf16).sum(2).flatten(2))  # the heads' sum [B, G, S * S]
        return torch.cat([o.flatten(2), other], dim=2).float()


def test_grouped_heads_follows_the_cast_that_reaches_p_at_v():
    model = run(GroupedTwoCasts(), qkv(), only("canonicalize"), tol=2e-2)
    assert fired(model).get("grouped_heads") == 1, fired(model)
    code = code_after_canonicalize(model).split("def forward")[1]
    assert "repeat_interleave" in code and code.count("softmax(") == 1  # one softmax, on 4-D heads


def test_grouped_heads_refuses_two_casts_that_each_reach_a_p_at_v():
    model = run(GroupedTwoCasts(both_to_v=True), qkv(), only("canonicalize"), tol=2e-2)
    _, log = canonical_log(model)
    assert "grouped_heads" not in fired(model)
    assert [r.reason for r in log.refusals if r.reason.startswith("grouped_heads")] == [
        "grouped_heads: the grouped probabilities are not multiplied by V once (p @ v as an einsum over the same "
        "group and head dims)"]
    assert "repeat_interleave" not in log.code_after.split("def forward")[1]


class CastAfterLayout(nn.Module):
    """Compressed-style scores whose keys are laid out for the product and then cast (CUDA autocast's
    cast of float32 pooled keys: `q @ kc.permute(0, 2, 3, 1).to(bf16)`), and probabilities cast to
    their own dtype and then to bf16 (`p.to(vc.dtype)` with vc float32, then autocast's cast), as
    where_bias_spellings computes under CUDA autocast. `change`: 'shared-permute' lets another
    reader use the permuted keys (they stay for it; the cast reads its own permute), 'rounding-chain'
    rounds p to bf16 and widens it back for a float32 product (a rounding inner cast: the chain
    stays), 'cast-up' gives a bf16 v laid out and then cast up (a cast up stays where it is)."""

    def __init__(self, change=None):
        super().__init__()
        self.change = change

    def forward(self, q, k, v):  # q [B, H, S, D] bf16, k, v [B, S, H, D] float32
        bf16 = torch.bfloat16
        kt = k.permute(0, 2, 3, 1)  # [B, H, D, S]
        s = torch.matmul(q, kt.to(bf16)).to(torch.float32) * D**-0.5
        t = torch.arange(q.shape[2], device=q.device)
        p = s.masked_fill(t[None, :] > t[:, None], float("-inf")).softmax(-1)
        if self.change == "rounding-chain":  # p rounded to bf16, then widened: a float32 product of rounded p
            o = torch.matmul(p.to(bf16).to(torch.float32), v.transpose(1, 2))
        elif self.change == "cast-up":  # v in bf16, laid out, then cast up for a float32 product
            o = torch.matmul(p, v.to(bf16).transpose(1, 2).to(torch.float32))
        else:
            o = torch.matmul(p.to(torch.float32).to(bf16), v.transpose(1, 2).to(bf16))
        extra = kt.sum() if self.change == "shared-permute" else 0.0
        return o.float() + extra


def layout_cast_inputs():
    g = torch.Generator().manual_seed(8)
    return [torch.randn(B, H, S, D, generator=g).to(torch.bfloat16), torch.randn(B, S, H, D, generator=g),
            torch.randn(B, S, H, D, generator=g)]


def test_casts_after_a_layout_and_lossless_cast_chains_are_normalized():
    model = run(CastAfterLayout(), layout_cast_inputs(), only("canonicalize"), tol=2e-2)
    counts = fired(model)
    assert (counts.get("cast_hoist"), counts.get("cast_chain")) == (2, 1), counts
    _, log = canonical_log(model)
    assert {"cast_hoist: cast to bfloat16 after permute -> before them",
            "cast_hoist: cast to bfloat16 after transpose -> before them"} <= {m.kernel for m in log.matches}
    _, log = canonical_log(model)
    assert "cast_chain: cast to float32 then to bfloat16 -> one cast" in [m.kernel for m in log.matches]
    body = log.code_after.split("def forward")[1]
    # the casts now read k and v themselves; the permute / transpose read the casts
    assert body.count("torch.Tensor.to(l_k_, torch.bfloat16)") + body.count("torch_Tensor_to(l_k_, torch.bfloat16)") == 1
    assert body.count("torch.Tensor.to(l_v_, torch.bfloat16)") + body.count("torch_Tensor_to(l_v_, torch.bfloat16)") == 1


def test_a_shared_layout_stays_for_its_other_reader_and_the_cast_reads_its_own():
    """k's permute has two readers: the cast moves before a permute of its own; the float32 permute
    stays for kt.sum()."""
    model = run(CastAfterLayout("shared-permute"), layout_cast_inputs(), only("canonicalize"), tol=2e-2)
    counts = fired(model)
    assert counts.get("cast_hoist") == 2 and counts.get("cast_chain") == 1, counts
    body = canonical_log(model)[1].code_after.split("def forward")[1]
    assert body.count("permute(") == 2 and ".sum()" in body, body


@pytest.mark.parametrize("change", ["rounding-chain", "cast-up"])
def test_casts_that_round_or_widen_stay(change):
    """A rounding inner cast (p.to(bf16).to(float32)) keeps both casts; a cast up after a layout
    (v.to(bf16).transpose(1, 2).to(float32)) stays after it, the graph as it was there (k's cast
    still moves before its permute)."""
    model = run(CastAfterLayout(change), layout_cast_inputs(), only("canonicalize"), tol=2e-2)
    counts = fired(model)
    assert "cast_chain" not in counts or change == "cast-up", counts
    assert counts.get("cast_hoist") == 1, counts
    (match,) = [m.kernel for m in canonical_log(model)[1].matches if m.kernel.startswith("cast_hoist")]
    assert match == "cast_hoist: cast to bfloat16 after permute -> before them"


class ChunkCasts(nn.Module):
    """A model's loop over two query chunks under CUDA autocast: each chunk's product casts its rows
    of the laid-out float32 q (`q.transpose(1, 2)[:, :, s0:s1].to(bf16) @ k`), so cast_hoist moves
    each cast before the transpose and the slice; `other_dtype` casts the second chunk to fp16."""

    def __init__(self, other_dtype=False):
        super().__init__()
        self.other_dtype = other_dtype

    def forward(self, q, k, v):  # q [B, S, H, D] float32 (the RoPE output), k, v [B, H, S, D] bf16
        qt = q.transpose(1, 2)
        half = q.shape[1] // 2
        second = torch.float16 if self.other_dtype else torch.bfloat16
        a = qt[:, :, :half].to(torch.bfloat16) @ k.transpose(-1, -2)
        b = qt[:, :, half:].to(second) @ v.to(second).transpose(-1, -2)
        return a.float().sum() + b.float().sum()


@pytest.mark.parametrize("other_dtype", [False, True], ids=["same-cast", "other-dtype"])
def test_casts_of_one_tensor_for_several_chunks_share_one_copy(other_dtype):
    """Both chunks' casts move before the transpose and the slice; where they cast to the same dtype
    they share one cast of q and one transpose of it (one bf16 copy of q, as a model's query chunks
    need), the slices apart; casts to two dtypes keep one chain each."""
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(B, S, H, D, generator=g), torch.randn(B, H, S, D, generator=g).to(torch.bfloat16),
              torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)]
    model = run(ChunkCasts(other_dtype), inputs, only("canonicalize"), tol=2e-2)
    assert fired(model).get("cast_hoist") == 2, fired(model)
    body = canonical_log(model)[1].code_after.split("def forward")[1]
    casts = len(re.findall(r"(?:torch\.Tensor\.to|torch_Tensor_to)\(l_q_, torch\.(?:bfloat16|float16)\)", body))
    assert (casts, body.count("transpose(")) == ((2, 2 + 2) if other_dtype else (1, 1 + 2)), body


class CastForNoProduct(nn.Module):
    """A narrowing cast after a layout that no product reads (scaled and summed): not a cast before a
    product, so cast_hoist leaves it where it is."""

    def forward(self, q, k, v):
        return (k.permute(0, 2, 3, 1).to(torch.bfloat16) * 2).float().sum(-1) + q.sum() + v.sum()


def test_a_cast_that_no_product_reads_stays():
    model = run(CastForNoProduct(), layout_cast_inputs(), only("canonicalize"), tol=2e-2)
    assert "cast_hoist" not in fired(model)
    _, log = canonical_log(model)
    assert "permute = l_k_.permute(0, 2, 3, 1)" in log.code_after, log.code_after
    assert "to = permute.to(torch.bfloat16)" in log.code_after, log.code_after  # the cast still reads the layout


def test_document_windows_reads_constant_documents_only_when_each_is_the_same_window():
    from nsa_compile.passes.canonicalize import document_windows

    t = torch.arange(12)
    doc = (t >= 5).long() + (t >= 9).long()  # documents of 5, 4 and 3 tokens
    same = doc[:, None] == doc[None, :]
    window = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < 3)
    assert document_windows(window & same) == (3, 3)
    assert document_windows(window) is None  # one document: the plain window (the sdpa rule takes it)
    assert document_windows(window & same & (t[:, None] != 10)) is None  # a row that drops a key
    wider = window | ((t[None, :] <= t[:, None]) & (t[:, None] >= 5))  # documents after the first causal, not windowed
    assert document_windows(wider & same) is None


class Varlen(nn.Module):
    """Attention over packed tokens q [T, H, D], k, v [T, G, D] with 3-D scores [H, T, T]
    (xunhaolai's varlen spelling, one document here): the window, or (`compressed`) the compressed
    blocks with the rows before the first complete block zeroed by nan_to_num after an in-place
    masked_fill_."""

    def __init__(self, compressed):
        super().__init__()
        self.compressed = compressed

    def forward(self, q, k, v):
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, heads, D]
        t = torch.arange(S, device=q.device)[:, None]
        if self.compressed:
            k = k.transpose(0, 2).unfold(2, L, STRIDE).mean(-1).transpose(0, 2)  # [Tc, G, D]
            v = v.transpose(0, 2).unfold(2, L, STRIDE).mean(-1).transpose(0, 2)
            keep = torch.arange(k.shape[0], device=q.device)[None, :] * STRIDE + L - 1 <= t
        else:
            keep = window_mask(S, q.device)
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(h, 1)) * D**-0.5
        if self.compressed:
            p = torch.softmax(s.masked_fill_(~keep[None], float("-inf")), dim=-1).nan_to_num(0)
        else:
            p = torch.softmax(s.masked_fill(~keep[None], float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(h, 1))


@pytest.mark.parametrize("compressed", [False, True])
def test_unbatched_varlen_scores_are_refused_with_their_layout(compressed):
    """The window pass reads batched scores only; compressed_attention reads the 3-D compressed
    branch over packed tokens (tests/test_varlen_3d.py), once canonicalize has written the
    in-place masked_fill_ that only the softmax reads out of place, and names the window's."""
    model = run(Varlen(compressed), qkv(), only("canonicalize", "window_attention", "compressed_attention"))
    n = (S - L) // STRIDE + 1 if compressed else S
    layout = (f"3-D scores [{H}, {S}, {n}] with no batch dim (packed [T, H, D] tokens, as in a varlen layout with "
              "cu_seqlens, or batch and heads merged): not batched [B, H, S, ..] scores")
    r = row(model, "window_attention")
    assert (r["matches"], r["reasons"]) == (0, [layout]), r
    r = row(model, "compressed_attention")
    assert (r["matches"], r["reasons"]) == ((1, []) if compressed else (0, [
        f"3-D scores [H, T, T] over the packed tokens themselves (T = {S}): dense or windowed attention, not "
        "compressed keys"])), r
    _, log = canonical_log(model)
    assert [r.reason for r in log.refusals if r.reason.startswith("empty_rows")] == []


# --- cast_hoist: a float cast after a GQA copy (CUDA autocast's cast of float32 pooled keys) --------


class CastAfterCopy(nn.Module):
    """The compressed branch with the casts CUDA bf16 autocast makes: q bf16, pooled K float32 (RoPE
    with float32 tables, as tests/corpus/chunked_queries.py), copied per head, then cast to bf16 for
    the product; V bf16. cast="sized": the copy given its output_size."""

    def __init__(self, cast="bf16"):
        super().__init__()
        self.cast = cast

    def forward(self, q, k, v):
        kc = k.unfold(2, L, STRIDE).mean(-1).repeat_interleave(h, dim=1)
        vc = v.to(torch.bfloat16).unfold(2, L, STRIDE).mean(-1).repeat_interleave(h, dim=1)
        Tc, t = kc.shape[2], torch.arange(q.shape[2])
        visible = torch.arange(Tc)[None, :] * STRIDE + L - 1 <= t[:, None]
        if self.cast == "sized":  # the copy with output_size: not the plain copy the rule reads
            kc = k.unfold(2, L, STRIDE).mean(-1).repeat_interleave(h, dim=1, output_size=G * h)
        k_mm = kc.to(torch.bfloat16)
        s = (q @ k_mm.transpose(-1, -2)).to(torch.float32) * D**-0.5
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        p = p.masked_fill(~visible.any(-1, keepdim=True), 0.0)
        return p.to(torch.bfloat16) @ vc


def cast_inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16)
    return q, torch.randn(B, G, S, D, generator=gen), torch.randn(B, G, S, D, generator=gen)


def test_a_cast_after_the_gqa_copy_moves_before_it_and_the_branch_fires():
    """cast_hoist fires once (the copy of kc then feeds the product, un-repeated by the compressed
    pass): the op present, the softmax gone, eager's output exactly (the reference backend is eager's
    arithmetic)."""
    module, inputs = CastAfterCopy(), cast_inputs()
    opt = optimize_fresh(copy.deepcopy(module))
    torch.testing.assert_close(opt(*inputs), module(*inputs), rtol=0, atol=0)
    record, log = canonical_log(opt)
    assert fired(opt).get("cast_hoist") == 1
    assert re.search(r"(\w+) = torch_Tensor_to\(mean, torch\.bfloat16\).*\n"
                     r"\s*\w+ = torch_Tensor_repeat_interleave\(\1, 2, dim = 1\)",
                     log.code_after), log.code_after
    cmp_log = log_of(record, "compressed_attention")
    assert len(cmp_log.matches) == 1, cmp_log.refusals
    assert "softmax" not in cmp_log.code_after and "nsa.compressed_attention" in cmp_log.code_after


def test_a_cast_moves_before_a_copy_with_an_output_size_which_the_compressed_pass_refuses():
    """repeat_interleave given output_size: the cast moves before it (a copy all the same), and the
    compressed pass, which un-repeats plain copies only, refuses the keys; eager's output."""
    module, inputs = CastAfterCopy(cast="sized"), cast_inputs()
    opt = optimize_fresh(copy.deepcopy(module))
    torch.testing.assert_close(opt(*inputs), module(*inputs), rtol=0, atol=0)
    assert fired(opt).get("cast_hoist") == 1
    record, _ = canonical_log(opt)
    assert not log_of(record, "compressed_attention").matches


# --- SDPA masks too large to evaluate whole: verified in chunks of rows ---------------------------


def test_window_rows_gives_the_whole_mask_rules_verdicts_chunk_by_chunk():
    """`window_rows` (a few rows at a time) agrees with `causal_window` and `document_windows` (the
    mask whole) on windows, windows within documents, their additive forms and near misses."""
    from nsa_compile.attention_match import Refused
    from nsa_compile.passes.canonicalize import causal_window, document_windows, window_rows

    T = 13
    t = torch.arange(T)
    doc = (t >= 5).long() + (t >= 9).long()  # documents of 5, 4 and 4 tokens
    window = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < 3)
    same_doc = doc[:, None] == doc[None, :]

    def verdict(mask, step):
        try:
            starts, w, documents = window_rows(lambda r0, r1: mask[r0:r1], T, step)
        except Refused as why:
            return str(why)
        return starts.nonzero().flatten().tolist(), w, documents

    for step in (1, 4, T):
        assert verdict(window, step) == ([0], 3, 1) and causal_window(window)
        assert verdict(window & same_doc, step) == ([0, 5, 9], 3, 3) and document_windows(window & same_doc) == (3, 3)
        additive = torch.zeros(T, T).masked_fill(~window, float("-inf"))
        assert verdict(additive, step) == ([0], 3, 1)
        assert verdict(additive.masked_fill(~window, -1e9), step) == ([0], 3, 1)
        misses = {
            "a row that drops a key": window & (t[:, None] != 10),
            "a later key": window | ((t[:, None] == 2) & (t[None, :] == 7)),
        }
        for name, mask in misses.items():
            assert not causal_window(mask) and document_windows(mask) is None, name
            assert verdict(mask, step) == "SDPA's mask is not a causal sliding window: SDPA stays", name
        two_fills = additive.masked_fill(~window & (t[:, None] == 8), -1e9)
        assert verdict(two_fills, step) == "SDPA's additive mask holds values other than 0 and one large negative fill"
        in_documents = torch.zeros(T, T).masked_fill(~(window & same_doc), float("-inf"))
        assert verdict(in_documents, step).startswith("SDPA's additive mask is a causal window of 3 tokens within "
                                                      "each of 3 documents")


@pytest.mark.parametrize("spelling", ["sdpa-bool", "sdpa-additive", "documents"])
def test_a_window_mask_over_the_whole_mask_cap_is_verified_in_rows(spelling, monkeypatch):
    """A static SDPA window mask whose nodes would take more than WHOLE_MASK_CAP elements (S 32k in
    practice; a cap of 1 here) is computed and compared in chunks of rows: the same rewrite, the
    window pass fires on it, and eager's outputs and gradients."""
    from nsa_compile.passes import canonicalize

    monkeypatch.setattr(canonicalize, "WHOLE_MASK_CAP", 1)
    module = DocumentWindow((10, 3, 11)) if spelling == "documents" else Window(spelling)
    model = run(module, qkv(), only("canonicalize", "window_attention"))
    assert fired(model) == ({"sdpa": 1} if spelling == "documents" else WINDOW_SPELLINGS[spelling][0])
    _, log = canonical_log(model)
    assert "verified in row chunks" in log.matches[0].kernel
    assert ("documents of constant bounds" in log.matches[0].kernel) == (spelling == "documents")
    assert "scaled_dot_product_attention" not in code_after_canonicalize(model).split("def forward")[1]
    r = row(model, "window_attention")
    assert (r["matches"], r["refused"]) == (1, 0), r["reasons"]


class HoledWindow(nn.Module):
    """SDPA under the window mask with one key of one row dropped: not a window."""

    def forward(self, q, k, v):
        keep = window_mask(S, q.device) & ~((torch.arange(S, device=q.device)[:, None] == 17)
                                            & (torch.arange(S, device=q.device)[None, :] == 15))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


def test_a_mask_over_the_cap_that_is_no_window_is_refused_with_the_graph_unchanged(monkeypatch):
    from nsa_compile.passes import canonicalize

    monkeypatch.setattr(canonicalize, "WHOLE_MASK_CAP", 1)
    model = run(HoledWindow(), qkv(), only("canonicalize", "window_attention"))
    record, log = canonical_log(model)
    assert "sdpa" not in fired(model)
    assert "sdpa: SDPA's mask is not a causal sliding window: SDPA stays" in [r.reason for r in log.refusals]
    assert log.code_after == record.code_before
    assert row(model, "window_attention")["matches"] == 0
