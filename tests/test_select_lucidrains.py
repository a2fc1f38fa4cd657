"""lucidrains' block choice and selected branch (issue 17.3): `nsa.select_blocks(rule='lucidrains')`
against lucidrains' eager formula (written out below, as tests/corpus/lucidrains_*.py spell it), and
the select_blocks / selected_attention passes on a small module in lucidrains' spelling.

The eager formula ranks the compressed *logits* averaged over each selection block's columns, with
finite fills (-finfo.max // 10, -finfo.max), a -1e3 sink column and torch.topk; the op uses -inf
and a stable sort. Inputs on a grid (multiples of 1/32) make q @ k^T exact in float32 in any
summation order, so each rounding to bf16/fp16 is the same in both: the stable-sort form must then
give the op's ids exactly, ties included (many in bf16/fp16, and constructed ones), and topk's
must be the same probabilities (a valid topk result where ties sit at the n-th place).
"""

from __future__ import annotations

import copy

import helpers
import pytest
import torch
import torch.nn.functional as F
from oracles import (
    assert_raises_eager_and_fake,
    one_thread,  # noqa: F401  (an autouse fixture: imported, it runs for this module)
)
from torch import nn

import nsa_compile
from nsa_compile.ops import block_select as bs_mod
from nsa_compile.ops import select_blocks


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


def lucidrains_choice(q, ck, scale, d, ls, n, ranking="topk", softmax_dtype=None):
    """lucidrains' choice for q [B, H, S, Dk] and compressed keys ck [B, G, Tc, Dk] (memory slots
    already sliced off; compressed column i ends at token (i + 1) d - 1): (block ids [B, G, S, n + 1]
    with -1 where eager's mask `values > 1e-10` is False, columns past min(n, Jc) -1, the diagonal
    block last; the probabilities [B, G, S, Jc]). ranking 'topk' as lucidrains writes it, 'sort' a
    stable descending sort (the tie order the op documents). softmax_dtype float32: the padded
    logits cast up before the softmax, as CUDA autocast runs it."""
    B, H, S, Dk = q.shape
    G, Tc = ck.shape[1], ck.shape[2]
    sim = torch.einsum("b g q i d, b g j d -> b g q i j", q.view(B, G, H // G, S, Dk), ck) * scale
    cmask = ((torch.arange(Tc) + 1) * d - 1)[None, :] < torch.arange(S)[:, None]
    sim = sim.masked_fill(~cmask, max_neg_value(sim) // 10)
    importance = sim.mean(2)  # the group's heads (none to reduce for h = 1)
    per_fine = ls // d
    importance = importance[..., : Tc // per_fine * per_fine]
    importance = importance.view(*importance.shape[:-1], -1, per_fine).mean(-1)
    diagonal = (torch.arange(S) // ls)[:, None] == torch.arange(importance.shape[-1])[None, :]
    importance = importance.masked_fill(diagonal, max_neg_value(sim))
    importance = F.pad(importance, (1, 0), value=-1e3)
    importance = (importance if softmax_dtype is None else importance.to(softmax_dtype)).softmax(dim=-1)[..., 1:]
    m = min(n, importance.shape[-1])
    if ranking == "topk":
        values, selected = importance.topk(m, dim=-1)
    else:
        values, selected = importance.sort(dim=-1, descending=True, stable=True)
        values, selected = values[..., :m], selected[..., :m]
    ids = torch.where(values > 1e-10, selected, -1)
    ids = F.pad(ids, (0, n - m), value=-1)
    diag = (torch.arange(S) // ls)[None, None, :, None].expand(B, G, S, 1)
    return torch.cat((ids, diag), dim=-1), importance


def grid_case(B, G, h, S, Tc, Dk, dtype, seed, spread=1.0):
    """q [B, H, S, Dk] (a view of [B, S, H, Dk] memory) and compressed keys [B, G, Tc, Dk] on a grid
    of multiples of 1/32 (times a power of two `spread`): exact in every dtype here."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 33, (B, S, G * h, Dk), generator=gen) / 32 * spread
    k = torch.randint(-32, 33, (B, G, Tc, Dk), generator=gen) / 32
    return q.to(dtype).transpose(1, 2), k.to(dtype)


def assert_valid_topk(got, want_topk, p, n):
    """got and eager's topk ids keep blocks of the same probabilities, rank by rank (they can differ
    only among tied probabilities), and the same diagonal column."""
    assert torch.equal(got[..., n], want_topk[..., n])
    kept_got, kept_want = got[..., :n] >= 0, want_topk[..., :n] >= 0
    assert torch.equal(kept_got, kept_want)
    p_got = torch.gather(p, -1, got[..., :n].clamp(min=0)).masked_fill(~kept_got, 0)
    p_want = torch.gather(p, -1, want_topk[..., :n].clamp(min=0)).masked_fill(~kept_want, 0)
    assert torch.equal(p_got, p_want)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, G, h, S, d, l', n): odd lengths, a partial last block, n above the blocks there are, per-head (h 1)
SIZES = [(2, 2, 3, 37, 4, 8, 3), (1, 3, 1, 29, 5, 10, 4), (2, 1, 2, 50, 2, 6, 12), (1, 2, 2, 83, 8, 16, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,G,h,S,d,ls,n", SIZES, ids=["h3-S37", "h1-S29", "n-above-blocks", "S83-l16"])
@pytest.mark.parametrize("spread", [1.0, 64.0], ids=["flat", "spread"])
def test_rule_matches_the_eager_formula(B, G, h, S, d, ls, n, dtype, spread):
    """The reference backend's rule 'lucidrains' is the eager formula with a stable sort exactly (ties
    to the lower block), and a valid topk result of eager's topk; spread puts probabilities below
    the 1e-10 threshold (spread 64), so kept and dropped choices both occur."""
    Tc = S // d
    q, ck = grid_case(B, G, h, S, Tc, 12, dtype, seed=S, spread=spread)
    scale = 12**-0.5
    want, p = lucidrains_choice(q, ck, scale, d, ls, n, ranking="sort")
    got = select_blocks(q, ck, None, d, d, ls, n, scale, "reference", rule="lucidrains")
    assert got.shape == (B, G, S, n + 1) and got.dtype == torch.int64 and got.is_contiguous()
    assert torch.equal(got, want)
    assert_valid_topk(got, lucidrains_choice(q, ck, scale, d, ls, n)[0], p, n)
    kept = got[..., :n] >= 0
    assert kept.any() and (~kept).any()
    if spread > 1:  # some candidates ranked but under the threshold
        j = torch.arange(p.shape[-1])
        candidate = (j[None, :] < (torch.arange(S) // ls)[:, None]).expand_as(p)
        assert ((p <= 1e-10) & candidate).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constructed_ties_go_to_the_lower_block(dtype):
    """q = 0 makes every candidate's logit 0: all tie; the op keeps the lowest n blocks, in order,
    as the stable sort does, and that is a valid topk result (the same probabilities)."""
    B, G, h, S, d, ls, n = 1, 2, 2, 40, 2, 4, 3
    q = torch.zeros(B, G * h, S, 8, dtype=dtype)
    ck = torch.randn(B, G, S // d, 8).to(dtype)
    got = select_blocks(q, ck, None, d, d, ls, n, 0.5, "reference", rule="lucidrains")
    want, p = lucidrains_choice(q, ck, 0.5, d, ls, n, ranking="sort")
    assert torch.equal(got, want)
    t = torch.arange(S)
    lowest = torch.arange(n).expand(S, n)
    lowest = torch.where(lowest < (t // ls)[:, None], lowest, -1)
    assert torch.equal(got[0, 0, :, :n], lowest)
    assert_valid_topk(got, lucidrains_choice(q, ck, 0.5, d, ls, n)[0], p, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_softmax_in_float32(dtype):
    """importance_dtype=torch.float32: the softmax over q's-dtype logits computed and kept in float32
    (CUDA autocast's softmax): the eager formula with the cast, exactly; in bf16 the probabilities
    rounded to bf16 tie where the float32 ones do not, so the choice differs somewhere."""
    B, G, h, S, d, ls, n = 2, 2, 3, 83, 4, 8, 3
    q, ck = grid_case(B, G, h, S, S // d, 12, dtype, seed=11, spread=4.0)
    want, _ = lucidrains_choice(q, ck, 12**-0.5, d, ls, n, ranking="sort", softmax_dtype=torch.float32)
    got = select_blocks(q, ck, None, d, d, ls, n, 12**-0.5, "reference", rule="lucidrains",
                        importance_dtype=torch.float32)
    assert torch.equal(got, want)
    if dtype == torch.bfloat16:  # the rounded probabilities tie where the float32 ones do not
        assert not torch.equal(got, select_blocks(q, ck, None, d, d, ls, n, 12**-0.5, "reference", rule="lucidrains"))


def test_random_fp32_inputs_match_topk():
    """Off the grid (gaussian inputs, fp32): eager's topk ids themselves, rank for rank."""
    B, G, h, S, d, ls, n = 2, 2, 2, 77, 4, 16, 2
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, G * h, S, 16, generator=gen)
    ck = torch.randn(B, G, S // d, 16, generator=gen)
    got = select_blocks(q, ck, None, 8, d, ls, n, 0.25, "reference", rule="lucidrains")
    assert torch.equal(got, lucidrains_choice(q, ck, 0.25, d, ls, n)[0])


def test_chunked_rows_give_the_same_ids(monkeypatch):
    q, ck = grid_case(2, 2, 3, 61, 61 // 4, 8, torch.bfloat16, seed=5)
    whole = select_blocks(q, ck, None, 4, 4, 8, 3, 0.3, "reference", rule="lucidrains")
    monkeypatch.setattr(bs_mod, "REFERENCE_BUDGET", 2 * 6 * 15 * 7)  # chunks of 7 rows
    assert torch.equal(select_blocks(q, ck, None, 4, 4, 8, 3, 0.3, "reference", rule="lucidrains"), whole)


def test_auto_takes_reference_off_cuda_with_the_reason_and_opcheck():
    """On the CPU (no interpreter) 'auto' takes the reference for the CUDA reason alone (the Triton
    kernel computes the rule: tests/test_block_select_lucidrains.py)."""
    q, ck = grid_case(1, 2, 2, 33, 8, 8, torch.float32, seed=1)
    args = (q, ck, None, 4, 4, 8, 2)
    assert bs_mod.choose_backend(*args, "auto", None, "lucidrains") == "reference"
    assert bs_mod.why_not_triton(*args, rule="lucidrains") == bs_mod.why_not_triton(*args[:2], torch.zeros(1, 4, 33),
                                                                                    *args[3:])
    if bs_mod.block_select_triton.triton is not None:
        with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: device cpu"):
            select_blocks(*args, 0.5, "triton", rule="lucidrains")
    torch.library.opcheck(torch.ops.nsa.select_blocks.default, (*args, 0.5, "reference"), {"rule": "lucidrains"})


def test_argument_errors():
    q, ck = grid_case(1, 2, 2, 33, 8, 8, torch.float32, seed=1)
    lse = torch.zeros(1, 4, 33)
    base = {"q": q, "k": ck, "lse": None, "cmp_block": 4, "cmp_stride": 4, "sel_block": 8, "n_selected": 2,
            "scale": 0.5, "backend": "reference", "rule": "lucidrains"}
    for change, match in [
        ({"lse": lse}, "rule 'lucidrains' ranks the compressed logits: lse must be None"),
        ({"rule": "nsa"}, "rule 'nsa' ranks the compressed probabilities: it needs the lse"),
        ({"sel_block": 6}, "sel_block 6 must be a multiple of cmp_stride 4"),
        ({"pos": torch.zeros(1, 33, dtype=torch.int64)}, "rule 'lucidrains' with pos"),
        ({"importance_dtype": torch.bfloat16}, "importance_dtype must be None or torch.float32"),
        ({"group_sum_dtype": torch.float32, "importance_dtype": torch.float32}, "group_sum_dtype must be None"),
    ]:
        assert_raises_eager_and_fake(select_blocks, base | change, match)


# --- the passes on a small module in lucidrains' spelling ------------------------------------------


class LucidrainsBranch(nn.Module):
    """lucidrains' block choice and fine branch alone (tests/corpus/lucidrains_*.py): unfolded
    non-overlapping compression windows of the unrotated keys (l = d = `block`) through a Linear,
    `mem` memory slots cut off the logits, the choice as lucidrains writes it, then the fine
    attention over the gathered blocks of the padded sequence with the diagonal block appended
    causally. per_head: every query head ranks its own logits and reads K/V repeated per head
    (`repeat(t, 'b h ... -> b (h gh) ...')`); else the group's mean and 5-D grouped einsums.
    The near misses: `threshold` (lucidrains' 1e-10), `columns` ('mean', or 'amax' of each
    block's columns), `causal_diagonal` (False: the diagonal block read whole, the future too).
    return_ids: also return fmask and selected. softmax_float32: `.float()` before the choice's
    softmax (CUDA autocast's float32 softmax, spelled out)."""

    def __init__(self, per_head=False, threshold=1e-10, columns="mean", causal_diagonal=True, return_ids=False,
                 softmax_float32=False, dim=32, heads=4, kv_heads=2, dim_head=8, block=4, fine=8, num_selected=2, mem=1):
        super().__init__()
        self.heads, self.kv_heads, self.dim_head, self.gh = heads, kv_heads, dim_head, heads // kv_heads
        self.block, self.fine, self.num_selected, self.scale = block, fine, num_selected, dim_head**-0.5
        self.per_head, self.threshold, self.columns = per_head, threshold, columns
        self.causal_diagonal, self.return_ids, self.softmax_float32 = causal_diagonal, return_ids, softmax_float32
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.k_compress = nn.Linear(block * dim_head, dim_head)
        self.mem_k = nn.Parameter(torch.randn(kv_heads, mem, dim_head))

    def repeat_heads(self, t):  # 'b h ... -> b (h gh) ...'
        return t.unsqueeze(2).repeat(1, 1, self.gh, *([1] * (t.ndim - 2))).flatten(1, 2)

    def projections(self, x):
        """q [b, H, n, d], k, v [b, G, n, d] and the compressed keys [b, G, n // block, d] (no memory)."""
        b, n = x.shape[:2]
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(x).view(b, n, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        num_blocks = n // self.block
        ck = self.k_compress(k[..., : num_blocks * self.block, :].unflatten(2, (num_blocks, self.block)).flatten(-2))
        return q, k, v, ck

    def forward(self, x):
        b, n = x.shape[:2]
        block, fine, h = self.block, self.fine, self.gh
        q, k, v, ck = self.projections(x)
        num_blocks = ck.shape[2]
        ck = torch.cat((self.mem_k.expand(b, -1, -1, -1), ck), dim=-2)
        num_mem = self.mem_k.shape[-2]
        ck_seq = F.pad((torch.arange(num_blocks) + 1) * block - 1, (num_mem, 0), value=-1)
        cmask = ck_seq[None, :] < torch.arange(n)[:, None]
        if self.per_head:
            csim = torch.einsum("b h i d, b h j d -> b h i j", q, self.repeat_heads(ck)) * self.scale
        else:
            csim = torch.einsum("b g q i d, b g j d -> b g q i j", q.view(b, self.kv_heads, h, n, -1), ck) * self.scale
        csim = csim.masked_fill(~cmask, max_neg_value(csim) // 10)
        importance = csim[..., num_mem:]
        if not self.per_head:
            importance = importance.mean(2)  # the group's heads
        per_fine = fine // block
        importance = importance[..., : importance.shape[-1] // per_fine * per_fine].unflatten(-1, (-1, per_fine))
        importance = importance.mean(-1) if self.columns == "mean" else importance.amax(-1)
        diagonal = (torch.arange(n) // fine)[:, None] == torch.arange(importance.shape[-1])[None, :]
        importance = importance.masked_fill(diagonal, max_neg_value(csim))
        importance = F.pad(importance, (1, 0), value=-1e3)
        importance = (importance.float() if self.softmax_float32 else importance).softmax(dim=-1)[..., 1:]
        values, selected = importance.topk(min(self.num_selected, importance.shape[-1]), dim=-1)
        fmask = values > self.threshold

        rows = self.heads if self.per_head else self.kv_heads
        padded = -(-n // fine) * fine
        kv_src = (self.repeat_heads(k), self.repeat_heads(v)) if self.per_head else (k, v)
        fq, fk, fv = (F.pad(t, (0, 0, 0, padded - n)) for t in (q, *kv_src))
        fmask_p = F.pad(fmask, (0, 0, 0, padded - n), value=False)
        chosen = F.pad(selected, (0, 0, 0, padded - n), value=0)
        diag = (torch.arange(padded) // fine)[None, None, :, None].expand(b, rows, padded, 1)
        chosen = torch.cat((chosen, diag), dim=-1)
        causal = torch.ones(fine, fine, dtype=torch.bool)
        causal = (causal.tril() if self.causal_diagonal else causal).repeat(padded // fine, 1)  # [padded, j]
        fmask_p = torch.cat((fmask_p[..., None].expand(*fmask_p.shape, fine),
                             causal[None, None, :, None].expand(b, rows, padded, 1, fine)), dim=-2).flatten(-2)
        index = chosen[..., None, None].expand(*chosen.shape, fine, self.dim_head)
        fk = fk.unflatten(2, (-1, fine))[:, :, None].expand(-1, -1, padded, -1, -1, -1).gather(3, index).flatten(3, 4)
        fv = fv.unflatten(2, (-1, fine))[:, :, None].expand(-1, -1, padded, -1, -1, -1).gather(3, index).flatten(3, 4)
        if self.per_head:
            fsim = torch.einsum("b h i d, b h i j d -> b h i j", fq, fk) * self.scale
            fsim = fsim.masked_fill(~fmask_p, max_neg_value(fsim))
            out = torch.einsum("b h i j, b h i j d -> b h i d", fsim.softmax(dim=-1), fv)
        else:
            fsim = torch.einsum("b g q i d, b g i j d -> b g q i j", fq.view(b, self.kv_heads, h, padded, -1), fk)
            fsim = (fsim * self.scale).masked_fill(~fmask_p[:, :, None], max_neg_value(fsim))
            out = torch.einsum("b g q i j, b g i j d -> b g q i d", fsim.softmax(dim=-1), fv).flatten(1, 2)
        out = out[..., :n, :]
        return (out, fmask, selected) if self.return_ids else out


def compiled(module, x):
    """(optimized copy after one forward and backward, its output, its first graph's record)."""
    opt = helpers.optimize_fresh(copy.deepcopy(module))
    out = opt(x)
    (out[0] if isinstance(out, tuple) else out).square().mean().backward()
    return opt, out, nsa_compile.api.state_of(opt).graphs[0]


def log_of(record, name):
    return next(log for log in record.logs if log.pass_name == name)


def code_before(record, name):
    names = [log.pass_name for log in record.logs]
    i = names.index(name)
    return record.code_before if i == 0 else record.logs[i - 1].code_after


def grads(module, x):
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.square().mean().backward()
    return out.detach(), {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "group-mean"])
def test_block_ids_equal_eager(per_head):
    """select_blocks fires once: topk and the choice's softmax gone, nsa.select_blocks(rule='lucidrains')
    there; the returned fmask and the kept ids are eager's exactly (x on the grid, fp32)."""
    torch.manual_seed(0)
    module = LucidrainsBranch(per_head=per_head, return_ids=True)
    x = torch.randn(2, 45, 32)
    _, (_, fmask, selected), record = compiled(module, x)
    assert len(log_of(record, "select_blocks").matches) == 1
    code = log_of(record, "select_blocks").code_after
    assert "topk" not in code and "rule = 'lucidrains'" in code and code.count("nsa.select_blocks") == 1
    assert code.count("softmax(") == code_before(record, "select_blocks").count("softmax(") - 1
    _, want_mask, want_ids = module(x)
    assert want_mask.any() and (~want_mask).any()
    assert torch.equal(fmask, want_mask)
    assert torch.equal(selected[fmask], want_ids[want_mask])
    assert fmask.shape[1] == (4 if per_head else 2)


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "group-mean"])
def test_both_passes_fire_with_eager_outputs_and_gradients(per_head):
    """Both passes fire once each; no topk, no gather, no selection softmax left; the ops present;
    output and every gradient as eager's (fp32)."""
    torch.manual_seed(1)
    module = LucidrainsBranch(per_head=per_head)
    x = torch.randn(2, 45, 32)
    want_out, want_grads = grads(module, x)
    opt, _, record = compiled(module, x)
    assert len(log_of(record, "select_blocks").matches) == 1
    assert len(log_of(record, "selected_attention").matches) == 1
    code = record.code_after
    assert "topk" not in code and "gather" not in code and "softmax(" not in code
    assert code.count("nsa.select_blocks") == 1 and code.count("nsa.selected_attention") == 1
    assert ("per query head" in log_of(record, "selected_attention").matches[0].kernel) == per_head
    got_out, got_grads = grads(opt, x)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("change,reason", [
    ({"threshold": 1e-3}, "the kept blocks are not those with probability > 1e-10"),
    ({"columns": "amax"}, "the block choice differs from rule 'lucidrains'"),
])
def test_a_near_miss_of_the_choice_is_refused_with_the_graph_unchanged(change, reason):
    torch.manual_seed(2)
    module = LucidrainsBranch(**change)
    x = torch.randn(2, 45, 32)
    want_out, _ = grads(module, x)
    opt, _, record = compiled(module, x)
    log = log_of(record, "select_blocks")
    assert not log.matches and any(reason in r.reason for r in log.refusals), log.refusals
    assert log.code_after == code_before(record, "select_blocks")
    assert not log_of(record, "selected_attention").matches  # no lucidrains ids to read
    got_out, _ = grads(opt, x)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)


def test_a_fine_branch_that_reads_the_diagonal_block_whole_is_refused():
    """The choice is lucidrains' (select_blocks fires); the fine branch reads the whole diagonal
    block, future tokens included: selected_attention refuses with the probe's reason, its graph
    unchanged, and the model still computes eager's (leaky) output."""
    torch.manual_seed(3)
    module = LucidrainsBranch(causal_diagonal=False)
    x = torch.randn(2, 45, 32)
    want_out, _ = grads(module, x)
    opt, _, record = compiled(module, x)
    assert len(log_of(record, "select_blocks").matches) == 1
    log = log_of(record, "selected_attention")
    assert not log.matches
    assert any("lucidrains' fine branch differs from nsa.selected_attention" in r.reason for r in log.refusals)
    assert log.code_after == code_before(record, "selected_attention")
    torch.testing.assert_close(grads(opt, x)[0], want_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_both_passes_fire_in_low_precision(dtype):
    """In bf16/fp16 the choice is computed in that dtype by both (select_blocks fires; its ids are
    eager's up to tied probabilities, frequent here), and the fine branch's output is eager's up to
    the rounding of the op's float32 softmax (lucidrains' runs in the model's dtype) on every row
    whose choice is the same set."""
    torch.manual_seed(4)
    module = LucidrainsBranch(return_ids=True).to(dtype)
    x = torch.randn(2, 45, 32, dtype=dtype)
    _, (out, fmask, selected), record = compiled(module, x)
    assert len(log_of(record, "select_blocks").matches) == 1
    want_out, want_mask, want_ids = module(x)
    q, _, _, ck = module.projections(x)
    p = lucidrains_choice(q, ck, module.scale, module.block, module.fine, module.num_selected)[1]
    n = module.num_selected
    got = torch.cat((torch.where(fmask, selected, -1), torch.zeros_like(fmask[..., :1], dtype=torch.int64)), -1)
    want = torch.cat((torch.where(want_mask, want_ids, -1), got[..., n:]), -1)
    assert_valid_topk(got, want, p, n)  # the same probabilities rank by rank: ids differ only among ties
    module.return_ids = False
    _, out, record = compiled(module, x)
    assert len(log_of(record, "selected_attention").matches) == 1
    # rows whose tied choice went the other way attend to other blocks: compare the others
    same = (got[..., :n].sort(-1).values == want[..., :n].sort(-1).values).all(-1)  # [B, G, S]
    assert same.float().mean() > 0.9
    same = same.repeat_interleave(module.gh, 1)
    torch.testing.assert_close(out[same], want_out.detach()[same], rtol=2e-2, atol=2e-2)


def test_the_choice_with_a_float32_softmax_in_a_bf16_model():
    """A bf16 model whose choice softmax runs in float32 (as CUDA autocast runs it): select_blocks
    fires with importance_dtype=torch.float32, the kept ids are eager's (up to ties); a cast
    anywhere else in the choice is refused."""
    torch.manual_seed(5)
    module = LucidrainsBranch(return_ids=True, softmax_float32=True).to(torch.bfloat16)
    x = torch.randn(2, 45, 32, dtype=torch.bfloat16)
    _, (_, fmask, selected), record = compiled(module, x)
    (match,) = log_of(record, "select_blocks").matches
    assert "the softmax in float32" in match.kernel
    assert "importance_dtype = torch.float32" in log_of(record, "select_blocks").code_after
    _, want_mask, want_ids = module(x)
    q, _, _, ck = module.projections(x)
    p = lucidrains_choice(q, ck, module.scale, module.block, module.fine, module.num_selected,
                          softmax_dtype=torch.float32)[1]
    n = module.num_selected
    got = torch.cat((torch.where(fmask, selected, -1), torch.zeros_like(fmask[..., :1], dtype=torch.int64)), -1)
    want = torch.cat((torch.where(want_mask, want_ids, -1), got[..., n:]), -1)
    assert_valid_topk(got, want, p, n)
