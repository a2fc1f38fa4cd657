"""Graph tests of select_blocks on flash-linear-attention's choice rule (issue 17.3: the rule is the
op's `rule='fla'`, not a refusal): only the current block favoured (each head's importance of it
set to 1.0 before the group sum), torch.topk over every block, then the blocks after the current one
set to -1 *after* the top-k, in rank order (tests/corpus/fla_naive_bthd.py, tiled_gqa_fla.py).

For each form: the pass fires once per selection (exact count), the topk and the probabilities'
masked_fill are gone, nsa.select_blocks with rule='fla' is there; outputs and gradients equal
eager; the block ids equal eager's (the same blocks; the same order but where the current block
ties with a lone visible block: torch.topk leaves tied keys' order unspecified). Near misses (the
previous block also favoured, the -1 mask off by one, overlapping compression blocks) are refused
with the graph's selection unchanged and the reason.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.nn as nn
from helpers import only_graph, optimize_fresh, row
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile

SEL = "select_blocks"
CORPUS = pathlib.Path(__file__).parent / "corpus"


class FlaSelection(nn.Module):
    """fla's compressed branch and choice (fla_naive_bthd.py's lines, [B, T, H, D] layout, GQA by
    expand): returns (o_cmp [B, T, HQ, D], block ids [B, T, H, n]), the ids in rank order.
    `change` makes one near miss; `tiled` groups the query heads as j % H (Tensor.repeat)."""

    def __init__(self, block=4, n=3, change=None, tiled=False, cmp_stride=None):
        super().__init__()
        self.block, self.n, self.change, self.tiled = block, n, change, tiled
        self.stride = cmp_stride or block

    def pool(self, x):  # [B, T, H, D] -> [B, C, H, D]: means of windows of `block` at `stride`
        BS, d = self.block, self.stride
        T = x.shape[1]
        C = (T + d - 1) // d
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, (C - 1) * d + BS - T))
        return x.unfold(1, BS, d).mean(-1)

    def forward(self, q, k, v):  # q [B, T, HQ, D], k, v [B, T, H, D]
        B, T, HQ, D = q.shape
        H, BS, d = k.shape[2], self.block, self.stride
        G = HQ // H
        k_cmp, v_cmp = self.pool(k), self.pool(v)
        C = k_cmp.shape[1]
        if self.tiled:
            k_cmp, v_cmp = k_cmp.repeat(1, 1, G, 1), v_cmp.repeat(1, 1, G, 1)
        else:
            k_cmp = k_cmp.unsqueeze(3).expand(B, C, H, G, D).flatten(2, 3)
            v_cmp = v_cmp.unsqueeze(3).expand(B, C, H, G, D).flatten(2, 3)
        i_t = torch.arange(T)
        c = torch.arange(C)[None, :]
        hidden = (c * d + BS - 1) > i_t[:, None]
        current = i_t[:, None] // BS
        local = current == c
        if self.change == "previous-favoured":  # the paper's previous block favoured too, no -1 padding for it
            local = local | (current - 1 == c)
        attn = torch.einsum("bqhd,bkhd->bhqk", q * D**-0.5, k_cmp).masked_fill(hidden, float("-inf"))
        attn = torch.nan_to_num(attn.softmax(-1), nan=0.0)
        o_cmp = torch.einsum("bhqk,bkhd->bqhd", attn, v_cmp)
        if self.change == "bf16-importance":  # the probabilities rounded: the 1.0 and the group sum in bf16
            attn = attn.to(torch.bfloat16)
        score = attn.masked_fill(local, 1.0)
        score = score.view(B, G, H, T, C).sum(1) if self.tiled else score.view(B, H, G, T, C).sum(2)
        idx = score.topk(min(self.n, C), -1)[1]
        after = idx >= current if self.change == "drops-current" else idx > current
        return o_cmp, idx.masked_fill(after, -1).transpose(1, 2)


def inputs(B=2, T=37, HQ=6, H=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, heads, D, generator=gen) for heads in (HQ, H, H))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def run_both(module, args, config=None):
    """(eager results, optimized results, the optimized module)."""
    optimized = optimize_fresh(copy.deepcopy(module), config or nsa_compile.OptimizeConfig(compiler="aot_eager"))
    return module(*args), optimized(*args), optimized


def assert_eager_block_ids(got, want, module, args):
    """got equals eager's want: the same blocks per row, in the same order but where the keys tie
    (the current block's h against a lone visible block's h * 1.0: topk's order is unspecified)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int64
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    differ = (got != want).any(-1)  # [B, T, H]
    T, BS = got.shape[1], module.block
    t = torch.arange(T)[None, :, None].expand_as(differ)
    lone = (t >= BS - 1) & (t < 2 * BS - 1) if module.stride == BS else torch.zeros_like(differ)
    assert not (differ & ~lone).any(), (differ & ~lone).nonzero()[:5]


# T = 5 (two blocks, one visible row) tiled: compressed_attention reads no (l, d) there, no lse to select from
@pytest.mark.parametrize("tiled,T", [(False, 37), (False, 16), (False, 5), (True, 37), (True, 16)],
                         ids=["contiguous-37", "contiguous-16", "contiguous-5", "tiled-37", "tiled-16"])
def test_fla_rule_fires_with_eager_ids_outputs_and_gradients(tiled, T):
    module = FlaSelection(tiled=tiled)
    args = inputs(T=T)
    (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    n = min(3, -(-T // 4))  # the model's topk(min(n, C))
    assert r["kernels"][0].startswith(f"nsa.select_blocks[reference] (l'=4, n={n}, from the compressed lse"), r
    assert "not triton: the Triton kernel runs on CUDA (tensors on cpu)" in r["kernels"][0], r  # the rule is no reason
    record = only_graph(optimized)
    assert record.code_before.count("topk(") == 1 and "topk(" not in record.code_after
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "rule = 'fla'" in calls[0], calls
    assert "masked_fill(" not in record.code_after.split("select_blocks")[0].rsplit("compressed_attention", 1)[-1]
    assert_eager_block_ids(ids_got, ids_want, module, args)
    torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(o_got.square().sum(), args)
    for a, b in zip(grads, torch.autograd.grad(o_want.square().sum(), args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def stable_topk(key, k, dim=-1):
    """torch.topk's result with ties broken to the lower index (a stable descending sort): one of the
    results topk may give, the one the op documents."""
    values, indices = key.sort(dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def test_fla_rule_of_rounded_probabilities_takes_the_rounded_importance(monkeypatch):
    """p.to(bf16) before fla's 1.0 fill (the key, its group sum and the topk in bf16, with many exact
    ties): the op runs rule 'fla' with importance_dtype=torch.bfloat16 and gives eager's ids with
    topk's ties broken to the lower block; eager's own topk differs only at ties of its bf16 key."""
    module = FlaSelection(change="bf16-importance")
    args = inputs(T=37)
    (o_want, ids_topk), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert "importance rounded to bfloat16 as eager computes it" in r["kernels"][0], r
    calls = [line for line in only_graph(optimized).code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "rule = 'fla', importance_dtype = torch.bfloat16" in calls[0], calls
    keys = []
    monkeypatch.setattr(torch.Tensor, "topk", lambda key, k, dim=-1: keys.append(key) or stable_topk(key, k, dim))
    ids_want = module(*args)[1]
    assert keys[0].dtype == torch.bfloat16 and torch.equal(ids_got, ids_want)
    key = keys[0].transpose(1, 2)  # [B, T, H, C], as the ids
    differ = (ids_topk.sort(-1).values != ids_want.sort(-1).values).any(-1)
    kth = key.sort(-1, descending=True).values[..., 2:3]  # the 3rd best key of each row
    assert differ.any() and ((key == kth).sum(-1) > 1)[differ].all()  # topk's ties: sets differ only there
    torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-6)


NEAR_MISSES = [
    ("previous-favoured", {}, "the blocks set to 1.0 are not exactly the current block t // l' (l' = l = d = 4)"),
    ("drops-current", {}, "the -1 mask also drops the current block (id >= t // l'): fla's rule keeps it"),
    (None, {"cmp_stride": 2}, "selection blocks of their own need l = d (here l = 4, d = 2)"),
]


@pytest.mark.parametrize("change,kwargs,reason", NEAR_MISSES, ids=["previous-favoured", "drops-current", "l-above-d"])
def test_near_misses_are_refused_with_the_graph_unchanged(change, kwargs, reason):
    """What the op's rule cannot express stays eager: the previous block favoured too (without the
    paper's forced set and ascending -1 padding), a -1 mask that drops the current block, overlapping
    compression blocks (the importance's blocks are then no selection blocks)."""
    module = FlaSelection(change=change, **kwargs)
    args = inputs()
    (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert r["matches"] == 0 and r["refused"] == 1, r
    assert any(reason in why for why in r["reasons"]), r["reasons"]
    record = only_graph(optimized)
    assert record.code_after.count("topk(") == 1 and "select_blocks" not in record.code_after
    assert torch.equal(ids_got, ids_want)
    torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-6)


def load_corpus(name):
    spec = importlib.util.spec_from_file_location(name[:-3], CORPUS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make()


@pytest.mark.parametrize("name", ["fla_naive_bthd.py", "tiled_gqa_fla.py"])
def test_corpus_models_fire_with_parity(name):
    """The two corpus models of fla's rule: one selection each, rewritten; output and every gradient
    equal eager (fp32)."""
    model, x = load_corpus(name)
    eager = copy.deepcopy(model)
    optimized = optimize_fresh(model)
    got, want = optimized(x), eager(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    for (what, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=what)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    record = only_graph(optimized)
    assert "topk(" in record.code_before and "topk(" not in record.code_after
    assert record.code_after.count("rule = 'fla'") == 1


class PerHeadSelection(nn.Module):
    """tests/corpus/fused_qkv_per_head.py's compressed branch and per-head choice (no group sum:
    block ids [B, H, S, n], one set per query head) on q [B, S, H, D], k, v [B, S, G, D]; returns
    (o_cmp [B, H, S, D], block ids). `change`: "bf16-rounded" rounds the probabilities to bf16
    before the importance (a near miss: the op ranks them unrounded); "upcast-scores" takes q @ k^T
    to float32 before the scale (under CPU autocast p is then float32 and the importance matmul
    rounds it to bf16, as under CUDA autocast)."""

    def __init__(self, cmp_len=8, cmp_stride=4, sel_len=8, n=3, change=None):
        super().__init__()
        self.l, self.d, self.ls, self.n, self.change = cmp_len, cmp_stride, sel_len, n, change

    def forward(self, q, k, v):  # [B, S, heads, D] each, heads-first inside
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        B, H, S, D = q.shape
        G = k.shape[1]
        pos = torch.arange(S)

        def compress(x):  # [B, G, S, D] -> [B, G, Tc, D], means of l tokens every d
            weight = torch.full((G * D, 1, self.l), 1.0 / self.l, dtype=x.dtype)
            y = torch.nn.functional.conv1d(x.permute(0, 1, 3, 2).reshape(B, G * D, S), weight, stride=self.d,
                                           groups=G * D)
            return y.view(B, G, D, -1).transpose(-1, -2)

        kc, vc = compress(k).repeat_interleave(H // G, dim=1), compress(v).repeat_interleave(H // G, dim=1)
        blk = torch.arange(kc.shape[2])
        visible = blk[None, :] * self.d + self.l - 1 <= pos[:, None]
        scores = q @ kc.transpose(2, 3) * D**-0.5
        if self.change == "upcast-scores":  # float32 scores before the scale, as the reference model
            scores = (q @ kc.transpose(2, 3)).float() * D**-0.5
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # rows with no visible block
        o_cmp = p @ vc
        if self.change == "bf16-rounded":
            p = p.to(torch.bfloat16)
        n_blocks = -(-S // self.ls)
        j = torch.arange(n_blocks)
        start = blk[:, None] * self.d
        overlap = (torch.minimum(start + self.l, (j[None, :] + 1) * self.ls)
                   - torch.maximum(start, j[None, :] * self.ls)).clamp(min=0)
        importance = p.float() @ (overlap.float() / self.l)  # [B, H, S, Ns]: per query head
        current = (pos // self.ls)[:, None]
        forced = (j == 0) | (j == current) | (j == current - 1)
        key = torch.where(forced, float("inf"), torch.where(j * self.ls <= pos[:, None], importance, float("-inf")))
        values, order = key.sort(dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., :self.n] > float("-inf"), order[..., :self.n], n_blocks)
        chosen = chosen.sort(dim=-1).values
        return o_cmp, torch.where(chosen == n_blocks, -1, chosen)


def per_head_inputs(B=2, H=4, G=2, S=37, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, heads, D, generator=gen) for heads in (H, G, G))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def test_per_head_selection_fires_with_eager_ids_outputs_and_gradients():
    """No group sum: each query head is its own group for nsa.select_blocks, which gets the
    compressed keys repeated per query head (a copy, said in the match text); the ids [B, H, S, n]
    equal eager's, the compressed output and its gradients too."""
    module = PerHeadSelection(n=5)  # 9 blocks, 2 chosen beyond the 3 forced ones
    args = per_head_inputs(S=70)
    (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert r["kernels"][0].startswith(
        "nsa.select_blocks[reference] (l'=8, n=5, per query head (each head its own group: the compressed keys "
        "repeated x2 per query head, a [B, H, Tc, Dk] copy), from the compressed lse"), r
    record = only_graph(optimized)
    assert record.code_before.count(".sort(") == 2 and ".sort(" not in record.code_after
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1, calls
    assert ids_got.shape == ids_want.shape == (2, 4, 70, 5) and torch.equal(ids_got, ids_want)
    assert not torch.equal(ids_want[:, 0], ids_want[:, 1])  # the heads of a group choose differently
    torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(o_got.square().sum(), args)
    for a, b in zip(grads, torch.autograd.grad(o_want.square().sum(), args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_per_head_selection_of_rounded_probabilities_is_refused():
    """Probabilities rounded to bf16 before the importance (p.to(bfloat16).float()): the op ranks the
    float32 probabilities, so the ranking could differ; the selection stays as it is."""
    module = PerHeadSelection(change="bf16-rounded")
    args = per_head_inputs()
    (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert r["matches"] == 0 and r["refused"] == 1, r
    assert any("cast that changes their dtype (torch.bfloat16 -> torch.float32)" in why for why in r["reasons"]), r
    record = only_graph(optimized)
    assert record.code_after.count(".sort(") == 2 and "select_blocks" not in record.code_after
    assert torch.equal(ids_got, ids_want)
    torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-6)


def test_per_head_selection_under_autocast_takes_the_rounded_importance():
    """Under CPU bf16 autocast (bf16 inputs, float32 scores and softmax) the per-head importance
    matmul runs in bf16 (p and the map rounded): select_blocks fires per query head with
    importance_dtype=torch.bfloat16, and the ids [B, H, S, n] and the compressed output equal
    eager's under autocast."""
    module = PerHeadSelection(n=5, change="upcast-scores")
    args = [x.detach().to(torch.bfloat16).requires_grad_() for x in per_head_inputs(S=70)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert "per query head" in r["kernels"][0], r
    assert "importance rounded to bfloat16 as eager computes it" in r["kernels"][0], r
    calls = [line for line in only_graph(optimized).code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "importance_dtype = torch.bfloat16" in calls[0], calls
    assert torch.equal(ids_got, ids_want) and (ids_want >= 0).sum(-1).max() == 5
    torch.testing.assert_close(o_got, o_want, rtol=2e-2, atol=2e-2)


def test_per_head_selection_at_varying_length_with_symbolic_sizes():
    """Lengths 70, 53, 90: the second compile has S as a symbol; per-head selection is rewritten in
    both graphs and the ids equal eager's at every length."""
    module = PerHeadSelection(n=5)
    optimized = optimize_fresh(copy.deepcopy(module), nsa_compile.OptimizeConfig(compiler="aot_eager"))
    for S in (70, 53, 90):
        args = per_head_inputs(S=S)
        (o_want, ids_want), (o_got, ids_got) = module(*args), optimized(*args)
        assert torch.equal(ids_got, ids_want), S
        torch.testing.assert_close(o_got, o_want, rtol=1e-5, atol=1e-6)
    r = row(optimized, SEL)
    assert (r["graphs"], r["matches"], r["refused"]) == (2, 2, 0), r
    assert all("per query head" in kernel for kernel in r["kernels"]), r["kernels"]


class LeakyChoice(nn.Module):
    """A top-n block choice on q, k [B, H, S, D] (l = d = l' = 4: the compressed blocks are the
    selection blocks) whose key hides no later block: `form` "forced-excluded" marks the forced
    blocks -inf and subtracts a tie-break (tests/corpus/nsa_vibe_noncausal.py's key), "forced-only"
    sets them +inf and nothing -inf. `masked_scores` masks the scores of later blocks (-1e9) before
    the softmax: the importance then hides them itself. Returns the chosen block ids [B, H, S, n]."""

    def __init__(self, form, masked_scores=False):
        super().__init__()
        self.form, self.masked_scores = form, masked_scores

    def forward(self, q, k):
        S, D = q.shape[2:]
        Tc = S // 4
        k_cmp = k.unflatten(2, (Tc, 4)).mean(3)  # [B, H, Tc, D]
        scores = q @ k_cmp.transpose(-1, -2) * D**-0.5
        t, j = torch.arange(S)[:, None], torch.arange(Tc)[None, :]
        if self.masked_scores:
            scores = scores.masked_fill(j * 4 + 3 > t, -1e9)
        importance = scores.softmax(-1)  # [B, H, S, Ns]
        forced = (j == 0) | (j == t // 4) | (j == t // 4 - 1)
        if self.form == "forced-excluded":
            key = importance.masked_fill(forced, float("-inf")) - j * 1e-8
        else:
            key = torch.where(forced, float("inf"), importance)
        return key.topk(2, dim=-1).indices


NONCAUSAL = "no candidate mask hides the blocks after the current one"


@pytest.mark.parametrize("form,masked_scores,reason", [
    ("forced-excluded", False, NONCAUSAL),
    ("forced-only", False, NONCAUSAL),
    ("forced-only", True, "the ranking key does not fill both +inf (forced) and -inf (not a candidate) blocks"),
], ids=["forced-excluded", "forced-only", "forced-only-masked-scores"])
def test_a_key_that_hides_no_later_block_is_refused_as_non_causal(form, masked_scores, reason):
    """Issue 17.4: a key over an unmasked softmax whose +-inf fills hide no block after block 0 in
    any row (t = 0 then ranks blocks of later tokens) is refused as non-causal; where the scores are
    masked before the softmax the importance may hide later blocks itself: the old reason stands.
    The graph keeps its topk, the ids equal eager's."""
    module = LeakyChoice(form, masked_scores)
    gen = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(2, 2, 16, 8, generator=gen) for _ in range(2))
    want, got, optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (0, 1), r
    (why,) = r["reasons"]
    assert why.startswith(reason), why
    assert ("(non-causal)" in why) == (reason == NONCAUSAL), why
    record = only_graph(optimized)
    assert record.code_after.count("topk(") == 1 and "select_blocks" not in record.code_after
    assert torch.equal(got, want)


class VarlenChoice(nn.Module):
    """xunhaolai_varlen.py's form on packed tokens q, k [T, H, D]: 3-D compressed scores [H, T, Tc]
    (no batch dim), causally masked, softmax, top-2 blocks per (head, token)."""

    def forward(self, q, k):
        T, D = q.shape[0], q.shape[2]
        k_cmp = k.unflatten(0, (T // 4, 4)).mean(1)  # [Tc, H, D]
        scores = (q.transpose(0, 1) @ k_cmp.permute(1, 2, 0)) * D**-0.5  # [H, T, Tc]
        hidden = torch.arange(T // 4)[None, :] * 4 + 3 > torch.arange(T)[:, None]
        return scores.masked_fill(hidden, -1e9).softmax(-1).topk(2, dim=-1).indices


def test_a_varlen_key_without_batch_dim_is_refused_with_its_reason():
    """Issue 17.4: a top-k over 3-D varlen block scores is a near miss of select_blocks with
    compressed_attention's reason for 3-D softmaxes (not 'no pass recognized this form'), then why
    it is not read as a varlen choice (tests/test_varlen_3d.py: here its softmax is no compressed
    branch, no p @ v); the graph keeps its topk."""
    gen = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(16, 2, 8, generator=gen) for _ in range(2))
    want, got, optimized = run_both(VarlenChoice(), args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (0, 1), r
    (why,) = r["reasons"]
    assert why.startswith("the ranking key [2, 16, 4] is computed from 3-D scores [2, 16, 4] with no batch dim "
                          "(packed [T, H, D] tokens, as in a varlen layout with cu_seqlens"), why
    assert why.endswith("select_blocks reads a [B, G, S, Ns] key; read as a varlen choice: compressed_attention did "
                        "not rewrite the 3-D compressed branch this choice reads (its reason is in explain)"), why
    record = only_graph(optimized)
    assert record.code_after.count("topk(") == 1 and "select_blocks" not in record.code_after
    assert torch.equal(got, want)


# --- a ranking key padded by torch.cat with -inf columns (where_bias_spellings at S < n l') -------


def test_a_key_padded_by_cat_with_minus_inf_columns_is_read_as_f_pad():
    """where_bias_spellings pads its ranking key to n columns with `torch.cat([key,
    key.new_full(.., -inf)], -1)` when S < n l' (seed sizes at S 128: 2 blocks, n 16): read as F.pad,
    every branch is rewritten (6/6), and output and input gradient match eager."""
    import importlib

    model, x = importlib.import_module("corpus.where_bias_spellings").make_seed(batch=1, seq_len=128)
    optimized = optimize_fresh(copy.deepcopy(model))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = optimized(x1), model(x2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().mean().backward()
    want.square().mean().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-7)
    assert row(optimized, "select_blocks")["matches"] == 1
    assert row(optimized, "selected_attention")["matches"] == 1


@pytest.mark.parametrize("fill, refused", [(float("-inf"), None), (0.0, "padded with 0.0, not -inf")])
def test_the_cat_padding_reader_takes_minus_inf_columns_only(fill, refused):
    from nsa_compile.attention_match import Refused
    from nsa_compile.fx import op_name
    from nsa_compile.passes.select_blocks import SelectBlocks

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda key: torch.cat([key, key.new_full((*key.shape[:-1], 3), fill)], dim=-1),
                  backend=backend, fullgraph=True)(torch.randn(1, 2, 5, 4))
    (gm,) = graphs
    (cat,) = [n for n in gm.graph.nodes if op_name(n) == "cat"]
    if refused is None:
        key, pad, _ = SelectBlocks.read_cat_pad(cat)
        assert key.op == "placeholder" and pad == 3
    else:
        with pytest.raises(Refused, match=refused):
            SelectBlocks.read_cat_pad(cat)


# --- the group's heads summed before the block map (torch.einsum's order) -------------------------


class GroupFirstImportance(nn.Module):
    """Compressed attention and the block choice of 5-D grouped queries q [B, G, h, S, D] against
    compressed keys [B, G, Tc, D] (grouped5d_nograd's spelling), the importance one einsum that sums
    the group's heads inside the block map ('bghsc,cj->bgsj'): torch.einsum sums h out first, then
    maps. Under CUDA bf16 autocast p and the map enter that einsum in bf16; the casts are written out
    here (CPU autocast keeps a bf16 softmax). `change`: 'float32-head-sum' sums the rounded heads with
    dtype=torch.float32 and maps that sum in float32 (a near miss: the op rounds the sum to bf16)."""

    def __init__(self, change=None, l=4, d=2, l_sel=8, n=3):
        super().__init__()
        self.change, self.l, self.d, self.l_sel, self.n = change, l, d, l_sel, n

    def forward(self, q, k, v):  # q [B, G, h, S, D], k, v [B, G, S, D], all bf16
        l, d, l_sel, bf16 = self.l, self.d, self.l_sel, torch.bfloat16
        S, D = q.shape[3], q.shape[4]
        kc, vc = k.unfold(2, l, d).mean(-1), v.unfold(2, l, d).mean(-1)  # [B, G, Tc, D]
        Tc = kc.shape[2]
        t, c = torch.arange(S, device=q.device), torch.arange(Tc, device=q.device)
        visible = c[None, :] * d + l - 1 <= t[:, None]  # [S, Tc]
        s = torch.einsum("bghsd,bgcd->bghsc", q, kc).float() * D**-0.5
        p = s.masked_fill(~visible, -torch.finfo(torch.float32).max).softmax(-1)
        p = torch.where(visible.any(-1, keepdim=True), p, torch.zeros_like(p))
        o = torch.einsum("bghsc,bgcd->bghsd", p.to(bf16), vc)
        with torch.no_grad():
            Ns = -(-S // l_sel)
            j = torch.arange(Ns, device=q.device)
            overlap = (torch.minimum(c[:, None] * d + l, (j[None, :] + 1) * l_sel)
                       - torch.maximum(c[:, None] * d, j[None, :] * l_sel)).clamp(min=0)
            if self.change == "float32-head-sum":
                importance = p.to(bf16).sum(2, dtype=torch.float32) @ (overlap.float() / l)
            else:
                importance = torch.einsum("bghsc,cj->bgsj", p.to(bf16), (overlap.float() / l).to(bf16))
            cur = (t // l_sel)[:, None]
            forced = (j == 0) | (j == cur) | (j == cur - 1)
            score = torch.where(forced, torch.inf, torch.where(j * l_sel <= t[:, None], importance, -torch.inf))
            values, blocks = torch.sort(score, dim=-1, descending=True, stable=True)  # bf16 ties: the lower block
            values, blocks = values[..., :self.n], blocks[..., :self.n]
            blocks = torch.where(values > -torch.inf, blocks, Ns).sort(-1).values
            blocks = blocks.masked_fill(blocks == Ns, -1)  # [B, G, S, n]
        return o.float(), blocks


def group_first_inputs(B=2, G=2, h=3, S=53, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, G, h, S, D, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(B, G, S, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def test_heads_summed_before_the_block_map_fire_with_eager_ids(monkeypatch):
    """canonicalize writes the einsum as torch.einsum computes it (the heads summed, then the map);
    select_blocks reads that order and gives the op group_first=True: p rounded to bf16, the group
    sum rounded to bf16, then the map. The ids equal eager's (ties to the lower block, as eager's
    stable sort), and the compressed output and its gradients too; the op mapping each head first
    (group_first ignored) gives other ids in some rows here."""
    module = GroupFirstImportance(n=5)
    args = group_first_inputs(h=6, S=120)
    (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert ("importance rounded to bfloat16 as eager computes it, the group's heads summed (and rounded) before "
            "the block map") in r["kernels"][0], r
    assert "not triton: the Triton kernel runs on CUDA (tensors on cpu)" in r["kernels"][0], r  # group_first is no reason
    calls = [line for line in only_graph(optimized).code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "group_first = True" in calls[0] and "importance_dtype = torch.bfloat16" in calls[0]
    assert torch.equal(ids_got, ids_want) and (ids_want >= 0).sum(-1).max() == 5
    torch.testing.assert_close(o_got, o_want, rtol=2e-2, atol=2e-2)
    grads_want = torch.autograd.grad(o_want.square().sum(), args)
    for a, b in zip(torch.autograd.grad(o_got.square().sum(), args), grads_want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

    import nsa_compile.ops.block_select as block_select

    reference = block_select._reference
    monkeypatch.setattr(block_select, "_reference", lambda *a, group_first=False, **kw: reference(*a, **kw))
    _, (_, ids_head_first), _ = run_both(module, args)
    assert (ids_head_first != ids_want).any(-1).sum() >= 3  # 5 of 480 rows when written


def test_heads_summed_in_float32_before_the_map_are_refused():
    module = GroupFirstImportance(change="float32-head-sum")
    args = group_first_inputs()
    (o_want, ids_want), (o_got, ids_got), optimized = run_both(module, args)
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (0, 1), r
    assert any("the group's heads are summed with dtype=torch.float32 before the block map, the sum not rounded"
               in why for why in r["reasons"]), r
    assert "select_blocks" not in only_graph(optimized).code_after
    assert torch.equal(ids_got, ids_want)
