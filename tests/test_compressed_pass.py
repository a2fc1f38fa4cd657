"""Graph tests of compressed_attention and select_blocks: both fire on every layer of the tiny
model (exact counts) with the [B, H, S, Tc] softmax, sort and K/V copies gone and the two ops
present, parity of outputs and gradients, block ids equal to eager's, the accepted forms (torch.topk
among them, with its note on ties in explain), and near misses refused with the graph unchanged and
a reason."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from click.testing import CliRunner
from helpers import optimize_fresh, only_graph, row, tokens

from nsa_compile.fx import op_name
from nsa_compile.api import state_of
from nsa_compile.coverage import coverage_of

import nsa_compile
from nsa_compile.models import build_model, preset
from nsa_compile.models.nsa import NSAAttention, upcast
from nsa_compile.parity import check_parity

CMP, SEL = "compressed_attention", "select_blocks"
TINY = preset("tiny")
NOT_TRITON_CMP = "; not triton: the Triton kernels run on CUDA (tensors on cpu)"
NOT_TRITON_SEL = "; not triton: the Triton kernel runs on CUDA (tensors on cpu)"
LAYERS = ["blocks.0.attn", "blocks.1.attn"]


def aten_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def float_nodes_ending_in(gm, shape):
    """Nodes of an ATen graph whose value is a float tensor whose last dims are `shape`."""
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and tuple(val.shape[-len(shape):]) == shape:
            out.append(node)
    return out


def n_blocks(S, cfg=TINY):
    return (S - cfg.cmp_block) // cfg.cmp_stride + 1


# --- the tiny model: counts, what is gone, parity -----------------------------------------------


def optimized_with_parity(eager, S, dtype, config=nsa_compile.OptimizeConfig(compiler="aot_eager"), batch=2):
    """check_parity of the optimized model (all passes) against eager, and the optimized model."""
    kept = []

    def optimize(m):
        kept.append(optimize_fresh(m, config))
        return kept[-1]

    device = next(eager.parameters()).device
    report = check_parity(eager, optimize, tokens(batch, S, seed=4).to(device), dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]
    return kept[0]


@pytest.mark.parametrize(
    "changes, S, dtype",
    [({}, 100, torch.float32), ({}, 40, torch.bfloat16), ({}, 100, torch.float16),
     ({"compression": "mlp", "gate": "head", "shared_kv": True}, 40, torch.float32),
     ({"n_heads": 2, "n_kv_groups": 2, "compression": "mlp"}, 100, torch.float32)],
    ids=["fp32-S100", "bf16-S40", "fp16-S100", "mlp-head-gate-shared-kv", "h1-mlp"],
)
def test_fires_on_every_layer_with_parity_and_the_dense_probabilities_gone(changes, S, dtype):
    torch.manual_seed(1)
    eager = build_model("tiny", **changes)
    model = optimized_with_parity(eager, S, dtype)
    cfg = eager.cfg
    r = row(model, CMP)
    assert (r["matches"], r["where"]) == (2, LAYERS)
    assert r["kernels"] == [f"nsa.compressed_attention[reference] (l={cfg.cmp_block}, d={cfg.cmp_stride}, "
                            f"GQA-native, no repeated K/V{NOT_TRITON_CMP})"]
    r = row(model, SEL)
    assert (r["matches"], r["where"], r["refused"]) == (2, LAYERS, 0)
    assert r["kernels"] == [f"nsa.select_blocks[reference] (l'={cfg.sel_block}, n={cfg.n_selected}, from the "
                            f"compressed lse, no [B, H, S, Tc] probabilities{NOT_TRITON_SEL})"]
    record = only_graph(model)
    assert record.code_after.count("torch.ops.nsa.compressed_attention(") == 2
    assert record.code_after.count("torch.ops.nsa.select_blocks(") == 2
    assert record.code_before.count("torch.sort(") == 4 and "torch.sort(" not in record.code_after
    assert ".unfold(" in record.code_after  # the pooling stays
    Tc, Ns = n_blocks(S, cfg), -(-S // cfg.sel_block)
    fwd, bwd = record.aten["forward"], record.aten["backward"]
    for gm in (fwd, bwd):
        assert float_nodes_ending_in(gm, (S, Tc)) == []  # no scores or probabilities [B, H, S, Tc]
        assert float_nodes_ending_in(gm, (S, Ns)) == []  # no importance [B, G, S, Ns]
        assert aten_nodes(gm, torch.ops.aten.sort.stable) == aten_nodes(gm, torch.ops.aten.sort.default) == []
    assert len(aten_nodes(fwd, torch.ops.nsa.compressed_attention.default)) == 2
    assert len(aten_nodes(fwd, torch.ops.nsa.select_blocks.default)) == 2
    assert len(aten_nodes(bwd, torch.ops.nsa.compressed_attention_backward.default)) == 2


def test_explain_names_both_rewrites():
    from nsa_compile.cli import cli

    result = CliRunner().invoke(cli, ["explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40",
                                      "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    by_name = {p["name"]: p for p in json.loads(result.output)["passes"]}
    for name, kernel in ((CMP, "nsa.compressed_attention[reference] (l=8, d=4, "),
                         (SEL, "nsa.select_blocks[reference] (l'=16, n=3, ")):
        assert by_name[name]["matches"] == 2 and by_name[name]["where"] == LAYERS, by_name[name]
        assert str(by_name[name]).count(kernel) == 1, by_name[name]


# --- the branch on its own: block ids, accepted forms, near misses -------------------------------

L, D, LS, N = 4, 2, 8, 3  # l, d, l', n of the module tests
TOPK_FORMS = ("topk", "topk-cut-unsorted", "topk-named-results", "topk-smallest", "topk-k-above-n",
              "topk-over-queries", "topk-values-kept")
# what explain adds to a topk match's kernel text
TOPK_NOTE = "; torch.topk: ties at the n-th place go to the lower block (eager's topk leaves them unspecified)"


class Branch(nn.Module):
    """NSAAttention.compressed_attention + select_blocks (models/nsa.py) on q [B, S, H, Dk] and
    k, v [B, S, G, D], returning (o_cmp, block_idx), written the model's way except for `change`."""

    def __init__(self, change=None, h=2, sizes=(L, D, LS, N)):
        super().__init__()
        self.change, self.h = change, h
        self.l, self.d, self.ls, self.n = sizes

    def pool(self, x):  # [B, S, G, D] -> [B, Tc, G, D]
        l, d = self.l, self.d
        if self.change == "as-strided":
            B, S, G, Dh = x.shape
            x = x.contiguous()
            Tc = (S - l) // d + 1
            return x.as_strided((B, Tc, G, Dh, l), (S * G * Dh, d * G * Dh, Dh, 1, G * Dh)).mean(-1)
        if self.change == "view-blocks":  # non-overlapping blocks: l = d = 4
            B, S, G, Dh = x.shape
            Tc = S // l
            return x[:, :Tc * l].reshape(B, Tc, l, G, Dh).mean(2)
        if self.change == "prefix-sums":  # block means as differences of prefix sums (read by probes)
            Tc = (x.shape[1] - l) // d + 1
            sums = F.pad(x.cumsum(1), (0, 0, 0, 0, 1, 0))  # [B, S + 1, G, D]: sums[j] = x[0] + .. + x[j - 1]
            return (sums[:, l::d][:, :Tc] - sums[:, 0::d][:, :Tc]) / l
        blocks = x.unfold(1, l, d)  # [B, Tc, G, D, l]
        if self.change == "cumsum-pooling":
            return blocks.mean(-1).cumsum(1)
        return blocks.mean(-1)

    def forward(self, q, k, v):
        change, h = self.change, self.h
        B, S, _, Dk = q.shape
        l, d = (self.l, self.l) if change == "view-blocks" else (self.l, self.d)
        k_cmp, v_cmp = self.pool(k), self.pool(v)
        if change == "raw-keys-in-pooling":  # token i of the raw keys, not block i
            k_cmp = k_cmp + k[:, : k_cmp.shape[1]]
        if change == "sequence-mean-in-pooling":  # every token, future ones included
            k_cmp = k_cmp + k.mean(1, keepdim=True)
        Tc = k_cmp.shape[1]
        if change == "expand-gqa":
            G = k_cmp.shape[2]
            k_rep = k_cmp.transpose(1, 2)[:, :, None].expand(B, G, h, Tc, Dk).reshape(B, G * h, Tc, Dk)
            v_rep = v_cmp.transpose(1, 2).unsqueeze(2).expand(B, G, h, Tc, v.shape[3]).reshape(B, G * h, Tc, -1)
        else:
            k_rep = k_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
            v_rep = torch.repeat_interleave(v_cmp.transpose(1, 2), h, dim=1)
        raw = q.transpose(1, 2) @ k_rep.transpose(-1, -2)
        scores = (raw if change == "no-upcast" else upcast(raw)) * Dk**-0.5  # [B, H, S, Tc]
        t = torch.arange(S, device=q.device)[:, None]
        i = torch.arange(Tc, device=q.device)[None, :]
        last = {"late-by-one": i * d + l, "late-by-two": i * d + l + 1, "early-by-one": i * d + l - 2,
                "late-by-two-at-odd-lengths": i * d + l - 1 + 2 * (S % 2)}.get(change, i * d + l - 1)
        visible = last <= t
        if change == "where":
            scores = torch.where(visible, scores, float("-inf"))
        else:
            scores = scores.masked_fill(~visible, float("-inf"))
        has_block = visible.any(dim=-1, keepdim=True)
        if change != "no-has-block-zeroing":
            scores = scores.masked_fill(~has_block, 0.0)
        p = torch.softmax(scores, dim=-1)
        if change != "no-final-mask":
            p = p * visible  # [B, H, S, Tc]
        o = (p.to(v_rep.dtype) @ v_rep).transpose(1, 2)  # [B, S, H, Dv]
        return o, self.select(p, S, l, d)

    def select(self, p, S, l, d):
        change, n = self.change, self.n
        key = self.ranking_key(p, S, l, d)  # [B, G, S, max(Ns, n)]
        if change in TOPK_FORMS:
            values, order = self.topk(key, n)
        else:
            values, order = torch.sort(key, dim=-1, descending=True, stable=change != "unstable-sort")
            values, order = values[..., :n], order[..., :n]
        past_end = key.shape[-1]
        chosen = torch.where(values > float("-inf"), order, past_end)
        chosen = torch.sort(chosen, dim=-1).values
        block_idx = torch.where(chosen == past_end, -1, chosen)
        if change == "p-third-consumer":
            return block_idx, p.sum()
        if change == "topk-values-kept":  # e.g. to log the scores of the chosen blocks
            return block_idx, values
        return block_idx

    def topk(self, key, n):
        """The eager topk forms: (values, indices) of the n best blocks, [B, G, S, n] (any order)."""
        change = self.change
        if change in ("topk", "topk-values-kept"):  # the plain form (TopkAttention's)
            return torch.topk(key, n, dim=-1)
        if change == "topk-cut-unsorted":  # the sort form's [..., :n] kept, a method call, unsorted
            values, order = key.topk(n, sorted=False)
            return values[..., :n], order[..., :n]
        if change == "topk-named-results":
            top = torch.topk(key, k=n, dim=3, largest=True, sorted=True)
            return top.values, top.indices
        if change == "topk-smallest":
            return torch.topk(key, n, dim=-1, largest=False)
        if change == "topk-k-above-n":  # the n + 1 best, cut to n: right here, but k is not n
            values, order = torch.topk(key, n + 1, dim=-1)
            return values[..., :n], order[..., :n]
        if change == "topk-over-queries":
            return torch.topk(key, n, dim=2)
        raise ValueError(f"no topk form {change!r}")

    def ranking_key(self, p, S, l, d):
        """+inf (forced), -inf (not a candidate) or the group importance, -inf padded to n columns."""
        change, ls, n = self.change, self.ls, self.n
        B, H, _, Tc = p.shape
        G = H // self.h
        Ns = (S + ls - 1) // ls
        i = torch.arange(Tc, device=p.device)[:, None]
        j = torch.arange(Ns, device=p.device)[None, :]
        overlap = torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)
        overlap = overlap.clamp(min=0).to(p.dtype) / l  # [Tc, Ns]
        if change == "weights-all-one":
            overlap = (overlap > 0).to(p.dtype)
        bf16 = torch.bfloat16
        if change in ("bf16-importance", "bf16-cat-fp32-pad"):  # the user's own rounding, where autocast puts it
            p_slc = p.to(bf16) @ overlap.to(bf16)
        elif change == "bf16-p-only":  # p rounded, the matmul in float32
            p_slc = p.to(bf16).float() @ overlap
        elif change == "bf16-sum-in-fp32":  # the matmul rounded, the group sum in float32
            p_slc = (p.to(bf16) @ overlap.to(bf16)).float()
        else:
            p_slc = p @ overlap
        p_grp = p_slc.view(B, G, H // G, S, Ns).sum(2)  # [B, G, S, Ns]
        t = torch.arange(S, device=p.device)[:, None]
        current = t // ls
        forced = (j == current) | (j == current - 1)
        if change == "block-1-forced-at-odd-lengths":  # block 0 at even S, block 1 at odd S
            forced = forced | (j == S % 2)
        elif change != "forced-without-block-0":
            forced = forced | (j == 0)
        candidate = j * ls <= t
        if change == "masked-fill-key":
            key = p_grp.masked_fill(~candidate, float("-inf")).masked_fill(forced, float("inf"))
        else:
            key = torch.where(forced, float("inf"), torch.where(candidate, p_grp, float("-inf")))
        if change == "bf16-cat-fp32-pad":  # float32 -inf columns: the key promoted to float32
            filler = key.new_full((*key.shape[:-1], max(0, n - Ns)), float("-inf"), dtype=torch.float32)
            return torch.cat([key, filler], dim=-1)
        return F.pad(key, (0, max(0, n - Ns)), value=float("-inf"))


def branch_inputs(B=2, S=29, G=2, h=2, Dk=8, Dv=6, dtype=torch.float32, zero_keys=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, G * h, Dk, generator=g)
    k = torch.zeros(B, S, G, Dk) if zero_keys else torch.randn(B, S, G, Dk, generator=g)
    v = torch.randn(B, S, G, Dv, generator=g)
    return [x.to(dtype) for x in (q, k, v)]


def run_both(module, args, config=nsa_compile.OptimizeConfig(compiler="aot_eager")):
    """(eager outputs and leaves, optimized outputs and leaves, the optimized module)."""
    def leaves():
        return [x.clone().requires_grad_() for x in args]

    eager_args, opt_args = leaves(), leaves()
    expected = module(*eager_args)
    optimized = optimize_fresh(copy.deepcopy(module), config)
    return (expected, eager_args), (optimized(*opt_args), opt_args), optimized


@pytest.mark.parametrize(
    "change, h, dtype, zero_keys",
    [(None, 2, torch.float32, False), (None, 1, torch.float32, False), (None, 3, torch.bfloat16, False),
     (None, 2, torch.float32, True), ("where", 2, torch.float32, False), ("expand-gqa", 2, torch.float32, False),
     ("masked-fill-key", 2, torch.float32, False), ("as-strided", 2, torch.float32, False),
     ("view-blocks", 2, torch.float32, False), ("topk", 2, torch.float32, False), ("topk", 1, torch.float32, False),
     ("topk-cut-unsorted", 3, torch.bfloat16, False), ("topk-named-results", 2, torch.float32, False),
     ("bf16-importance", 3, torch.float32, False), ("prefix-sums", 2, torch.float32, False)],
    ids=["model", "h1", "bf16-h3", "zero-keys-exact-ties", "where-mask", "expand-reshape-gqa", "masked-fill-key",
         "as-strided-pooling", "view-pooling-l-eq-d", "topk", "topk-h1", "bf16-h3-topk-method-cut-unsorted",
         "topk-named-results", "user-bf16-importance", "prefix-sum-pooling"],
)
def test_accepted_forms_give_eager_block_ids_and_gradients(change, h, dtype, zero_keys):
    args = branch_inputs(h=h, dtype=dtype, zero_keys=zero_keys)
    (expected, eager_args), (got, opt_args), optimized = run_both(Branch(change, h), args)
    for name in (CMP, SEL):
        assert row(optimized, name)["matches"] == 1, row(optimized, name)
    # the topk forms, and only they, carry the note on ties
    assert (TOPK_NOTE in row(optimized, SEL)["kernels"][0]) == (change in TOPK_FORMS)
    record = only_graph(optimized)
    assert ("topk(" in record.code_before) == (change in TOPK_FORMS)
    assert "torch.sort(" not in record.code_after and "topk(" not in record.code_after
    assert torch.equal(got[1], expected[1])  # block ids: exactly eager's (ties to the lower block)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], expected[0], **tol)
    grads = torch.autograd.grad(expected[0].float().square().sum(), eager_args)
    got_grads = torch.autograd.grad(got[0].float().square().sum(), opt_args)
    for a, b in zip(got_grads, grads):
        torch.testing.assert_close(a, b, **tol)


def test_the_models_own_functions_give_eager_block_ids():
    """NSAAttention.compressed_attention and select_blocks themselves (S = 100 > n * l', odd)."""

    class ModelBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = NSAAttention(TINY)

        def forward(self, q, k, v):
            o, p = self.attn.compressed_attention(q, k, v)
            return o, self.attn.select_blocks(p, q.shape[1])

    args = branch_inputs(S=100, Dk=TINY.head_dim, Dv=TINY.head_dim)
    (expected, _), (got, _), optimized = run_both(ModelBranch(), args)
    assert row(optimized, CMP)["matches"] == row(optimized, SEL)["matches"] == 1
    assert torch.equal(got[1], expected[1]) and (got[1] >= 0).sum(-1).max() == TINY.n_selected
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_inside_an_activation_checkpoint():
    """Under torch.utils.checkpoint the branch sits in a higher-order op's body graph, where Dynamo
    also takes the ascending sort's unused indices."""

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.branch = Branch(h=2)

        def forward(self, q, k, v):
            return torch.utils.checkpoint.checkpoint(self.branch, q, k, v, use_reentrant=False)

    (expected, eager_args), (got, opt_args), optimized = run_both(Checkpointed(), branch_inputs())
    assert row(optimized, CMP)["matches"] == row(optimized, SEL)["matches"] == 1
    assert torch.equal(got[1], expected[1])
    grads = torch.autograd.grad(expected[0].square().sum(), eager_args)
    for a, b in zip(torch.autograd.grad(got[0].square().sum(), opt_args), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def probes_tried(monkeypatch) -> list:
    """(what, the source's op, its sequence dim, the probed source's shape) of every pooling probe."""
    import nsa_compile.passes.compressed_attention as compressed

    tried, real = [], compressed._pooling_probe

    def spy(kv, what, source, seq_dim, sizes):
        moved = real(kv, what, source, seq_dim, sizes)
        tried.append((what, source.op if source.op == "placeholder" else op_name(source), seq_dim, moved.shape))
        return moved

    monkeypatch.setattr(compressed, "_pooling_probe", spy)
    return tried


def test_pooling_probes_walk_back_from_the_nearest_tokens_on_one_batch_row(monkeypatch):
    """Block sums as differences of prefix sums: probed at the prefix sums (the nearest [B, S, ..]
    node through which alone the keys arrive) the pooled token reads one token before its block, so
    the probe walks back to the keys themselves, where it is accepted; both on one batch row (the
    region keeps its rows apart)."""
    tried = probes_tried(monkeypatch)
    args = branch_inputs()
    _, _, optimized = run_both(Branch("prefix-sums"), args)
    assert row(optimized, CMP)["matches"] == 1
    once = [(what, source, 1, (1, *x.shape[1:])) for what, x in (("keys", args[1]), ("values", args[2]))
            for source in ("cumsum", "placeholder")]
    assert tried[:4] == once and set(tried[4:]) <= set(once[:2]), tried  # the pass, then select_blocks' keys


def test_pooling_probes_leave_the_projection_out(monkeypatch):
    """tiled_gqa_fla pools with F.pad + view + mean, which the reader does not follow: the probes
    start after the K/V projection (at the keys [B, G, S, D]), on one batch row, so their cost is the
    pooling's, not a float64 projection's per perturbation (at the seed shape on the GPU that took
    minutes)."""
    from corpus import tiled_gqa_fla

    tried = probes_tried(monkeypatch)
    model, x = tiled_gqa_fla.make()
    optimized = optimize_fresh(model, nsa_compile.OptimizeConfig(compiler="aot_eager"))
    optimized(x)
    assert row(optimized, CMP)["matches"] == 1
    assert tried and all(source != "placeholder" and dim == 2 and shape[0] == 1 and shape[2] == x.shape[1]
                         for _, source, dim, shape in tried), tried


NO_GQA = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=("gqa_grouped_matmul",))


@pytest.mark.parametrize(
    "change, dtype, reason",
    [
        ("late-by-two", torch.float32, "the visibility mask is off by 2: block i becomes visible at "
                                       "t = i*d + l - 1 + 2, not at its last token (pooling l=4, d=2); the op "
                                       "takes a block from its last token (i*d + l - 1 <= t) or strictly after it"),
        ("early-by-one", torch.float32, "the visibility mask is off by 1: block i is visible from "
                                        "t = i*d + l - 1 - 1, before its last token"),
        ("no-upcast", torch.bfloat16, "the softmax runs in torch.bfloat16 on torch.bfloat16 scores; the op "
                                      "computes it in torch.float32"),
        ("no-has-block-zeroing", torch.float32, "the rows without a visible block (t < 3) are not zeroed before "
                                                "the softmax"),
        ("no-final-mask", torch.float32, "the probabilities are not multiplied by the visibility mask after the "
                                         "softmax"),
        ("cumsum-pooling", torch.float32, "the pooled keys are not a per-block function of the blocks (cumsum "
                                          "on the way)"),
        ("raw-keys-in-pooling", torch.float32, "the pooled keys are not a per-block function of the blocks "
                                               "(getitem on the way)"),
        ("sequence-mean-in-pooling", torch.float32, "the pooled keys are not a per-block function of the blocks "
                                                    "(add on the way: an operand is broadcast over the blocks)"),
    ],
    ids=["late-by-two", "early-by-one", "bf16-no-upcast", "no-has-block-zeroing", "no-final-mask",
         "pooling-mixes-blocks", "pooling-reads-raw-keys", "pooling-reads-the-whole-sequence"],
)
def test_compressed_near_misses_are_refused_with_the_graph_unchanged(change, dtype, reason):
    args = branch_inputs(dtype=dtype)
    (expected, _), (got, _), optimized = run_both(Branch(change), args, NO_GQA)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # the same eager code ran
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, CMP)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]
    r = row(optimized, SEL)
    assert r["matches"] == 0 and r["reasons"][0].startswith("compressed_attention did not rewrite these "
                                                            "probabilities ("), r["reasons"]
    assert reason in r["reasons"][0]


def test_strict_visibility_is_the_op_with_block_l_plus_1_and_the_selection_stays_eager():
    """Block i seen from t = i*d + l, one token after its last (lucidrains' strict visibility): the
    compressed branch becomes the op with block l + 1 (its staircase), outputs and gradients as
    eager; select_blocks, which reads NSA's visibility, leaves the selection eager (eager block ids)."""
    args = branch_inputs()
    (expected, eager_args), (got, opt_args), optimized = run_both(Branch("late-by-one"), args, NO_GQA)
    r = row(optimized, CMP)
    assert r["matches"] == 1 and r["kernels"] == [
        f"nsa.compressed_attention[reference] (l={L}, d={D}, strict visibility (block i seen from t = i*d + l), "
        f"GQA-native, no repeated K/V{NOT_TRITON_CMP})"]
    assert row(optimized, SEL)["matches"] == 0
    record = only_graph(optimized)
    (op,) = [n for n in record.aten["forward"].graph.nodes if n.target is torch.ops.nsa.compressed_attention.default]
    assert (op.args[3], op.args[4]) == (L + 1, D)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(expected[0].square().sum(), eager_args)
    for a, b in zip(torch.autograd.grad(got[0].square().sum(), opt_args), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, reason",
    [
        ("weights-all-one", "the block map is not overlap(i, j) / l"),
        ("forced-without-block-0", "the key's forced (+inf) and excluded (-inf) blocks are not NSA's for l' = 8: "
                                   "block 0 is not forced"),
        ("unstable-sort", "the sort is not stable (stable=True)"),
        ("p-third-consumer", "the compressed probabilities are also used by sum: the [B, H, S, Tc] tensor stays"),
        ("topk-smallest", "torch.topk(largest=False) takes the lowest-ranked blocks, not the n best"),
        ("topk-k-above-n", "torch.topk takes k = 4 blocks but its values are cut to the first 3: k is not the n "
                           "blocks kept"),
        ("topk-over-queries", "torch.topk runs over dim 2, not over the blocks (the ranking key's last dim)"),
        ("topk-values-kept", "the torch.topk values tensor is used by 2 nodes (gt, output); the op returns the "
                             "block ids, not the keys"),
        ("bf16-p-only", "the importance reads the compressed probabilities through a cast that changes their dtype "
                        "(torch.bfloat16 -> torch.float32) at float_1: p_1 (float32) -> to_2 (bfloat16) -> float_1 "
                        "(float32) -> p_slc (float32); the op reproduces one rounding of p to the dtype the "
                        "importance is computed in (bf16 or fp16, as autocast casts it), not this mixture"),
        ("bf16-sum-in-fp32", "the importance is cast from bfloat16 to float32 at p_slc after matmul_2 (matmul): the "
                             "op keeps the dtype of p @ map up to the sort"),
        ("bf16-cat-fp32-pad", "the importance is rounded to bfloat16, but the padded ranking key key_1 is float32: the "
                              "op reproduces an importance kept in bfloat16 up to the sort, not this mixture"),
    ],
)
def test_selection_near_misses_are_refused_and_the_compressed_pass_still_fires(change, reason):
    args = branch_inputs()
    (expected, _), (got, _), optimized = run_both(Branch(change), args, NO_GQA)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    r = row(optimized, SEL)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]
    assert row(optimized, CMP)["matches"] == 1  # o_cmp from the op; p stays for the eager selection
    record = only_graph(optimized)
    for sorts in ("torch.sort(", "torch.topk("):
        assert record.code_after.count(sorts) == record.code_before.count(sorts)
    if change.startswith("topk"):
        assert record.code_after.count("torch.topk(") == 1
    assert "select_blocks" not in record.code_after and "torch.softmax(" in record.code_after


# --- autocast (issue 17): the importance rounded to bf16 is recognized and reproduced ----------------------

AUTOCAST_TINY = preset("tiny", n_selected=5)  # two free slots beside the three forced blocks: the ranking decides
ROUNDED = ", importance rounded to bfloat16 as eager computes it"


class ModelSelection(nn.Module):
    """NSAAttention.compressed_attention and select_blocks themselves: (o_cmp, block_idx)."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = NSAAttention(cfg)

    def forward(self, q, k, v):
        o, p = self.attn.compressed_attention(q, k, v)
        return o, self.attn.select_blocks(p, q.shape[1])


def test_under_autocast_the_rounded_importance_becomes_an_op_argument_with_eager_block_ids():
    """bf16 q, k, v under CPU bf16 autocast: eager's p @ overlap runs in bf16 (p and the map
    rounded, the group sum and the key in bf16), canonicalize writes autocast's casts, and
    select_blocks fires with importance_dtype=torch.bfloat16: the sort gone, the block ids eager's at
    S 100 > n * l' = 80, where the rounding decides (the float32 ranking of the same p differs); the
    compressed output and the gradients of q, k, v match."""
    cfg = AUTOCAST_TINY
    module = ModelSelection(cfg)
    args = branch_inputs(S=100, Dk=cfg.head_dim, Dv=cfg.head_dim, dtype=torch.bfloat16)  # as projections give them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (expected, eager_args), (got, opt_args), optimized = run_both(module, args)
        _, p = module.attn.compressed_attention(*args)
    assert not torch.equal(module.attn.select_blocks(p, 100), expected[1])  # unrounded: another choice
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert r["kernels"] == [f"nsa.select_blocks[reference] (l'=16, n=5{ROUNDED}, from the compressed lse, no [B, H, S, "
                            "Tc] probabilities; not triton: the Triton kernel runs on CUDA (tensors on cpu))"]
    record = only_graph(optimized)
    assert record.code_before.count("torch.sort(") == 2 and "torch.sort(" not in record.code_after
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "importance_dtype = torch.bfloat16)" in calls[0], calls
    assert torch.equal(got[1], expected[1]) and (got[1] >= 0).sum(-1).max() == cfg.n_selected
    torch.testing.assert_close(got[0], expected[0], rtol=1e-2, atol=1e-2)
    grads = torch.autograd.grad(expected[0].float().square().sum(), eager_args)
    for a, b in zip(torch.autograd.grad(got[0].float().square().sum(), opt_args), grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


class Float32GroupSum(ModelSelection):
    """ModelSelection with the importance's group sum in float32, as CUDA autocast runs `sum`
    (written out: `.float()` before the sum, or `sum(2, dtype=torch.float32)`, whose recorded sum
    reads the bf16 importance and gives float32 as CUDA autocast's does; the rest of models/nsa.py's
    select_blocks)."""

    def __init__(self, cfg, spelling="float"):
        super().__init__(cfg)
        self.spelling = spelling

    def forward(self, q, k, v):
        o, p = self.attn.compressed_attention(q, k, v)
        cfg, S = self.attn.cfg, q.shape[1]
        B, H, _, Tc = p.shape
        l, d, ls, n, G = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.n_kv_groups
        Ns = (S + ls - 1) // ls
        i = torch.arange(Tc, device=p.device)[:, None]
        j = torch.arange(Ns, device=p.device)[None, :]
        overlap = (torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)).clamp(min=0).to(p.dtype) / l
        grouped = (p @ overlap).view(B, G, H // G, S, Ns)
        p_grp = grouped.float().sum(2) if self.spelling == "float" else grouped.sum(2, dtype=torch.float32)
        t = torch.arange(S, device=p.device)[:, None]
        forced = (j == 0) | (j == t // ls) | (j == t // ls - 1)
        key = torch.where(forced, float("inf"), torch.where(j * ls <= t, p_grp, float("-inf")))
        values, order = torch.sort(key, dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., :n] > float("-inf"), order[..., :n], Ns)
        chosen = torch.sort(chosen, dim=-1).values
        return o, torch.where(chosen == Ns, -1, chosen)


@pytest.mark.parametrize("spelling", ["float", "sum_dtype"])
def test_under_autocast_a_float32_group_sum_becomes_group_sum_dtype(spelling):
    """The group sum of the rounded importance in float32 (CUDA autocast runs sum in float32; here
    spelled `.float().sum(2)` under CPU autocast): select_blocks fires with importance_dtype bf16 and
    group_sum_dtype float32, eager's block ids at S 100, which the rounded sum's ranking misses."""
    cfg = AUTOCAST_TINY
    module = Float32GroupSum(cfg, spelling)
    args = branch_inputs(S=100, Dk=cfg.head_dim, Dv=cfg.head_dim, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (expected, _), (got, _), optimized = run_both(module, args)
        rounded_sum = ModelSelection.forward(module, *args)[1]
    assert not torch.equal(rounded_sum, expected[1])  # the float32 sum ranks differently here
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0), r
    assert ", the group sum in float32" in r["kernels"][0], r["kernels"]
    record = only_graph(optimized)
    assert record.code_before.count("torch.sort(") == 2 and "torch.sort(" not in record.code_after
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "importance_dtype = torch.bfloat16, group_sum_dtype = torch.float32)" in calls[0], calls
    assert torch.equal(got[1], expected[1])


def test_tiny_model_under_autocast_is_fully_rewritten_with_parity_and_without_it_unchanged():
    """The tiny preset (n = 5) trained under CPU bf16 autocast: both layers' block selection
    rewritten with importance_dtype=bf16, every NSA branch rewritten, loss and every gradient
    within bf16 tolerances of eager under autocast. Without autocast the op gets no
    importance_dtype (the graph as before)."""
    torch.manual_seed(1)
    eager = build_model("tiny", n_selected=5)
    batch = tokens(2, 100, seed=4)
    model = optimize_fresh(copy.deepcopy(eager))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager.loss(batch), model.loss(batch)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=5e-2, atol=5e-3, msg=lambda m, name=name: f"{name}: {m}")
    r = row(model, SEL)
    assert (r["matches"], r["where"], r["refused"]) == (2, LAYERS, 0), r
    assert all(ROUNDED in kernel for kernel in r["kernels"]), r["kernels"]
    cov = coverage_of(state_of(model))
    assert cov.eager == [] and cov.rewritten == len(cov.branches) == 10, cov.summary()
    record = only_graph(model)
    assert record.code_after.count("importance_dtype = torch.bfloat16") == 2 and "torch.sort(" not in record.code_after
    plain = optimize_fresh(copy.deepcopy(eager))
    plain.loss(batch).backward()
    r = row(plain, SEL)
    assert (r["matches"], r["refused"]) == (2, 0) and not any(ROUNDED in kernel for kernel in r["kernels"]), r
    assert "importance_dtype" not in only_graph(plain).code_after


def test_disabled_compressed_pass_leaves_the_selection_with_a_reason():
    config = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=(CMP,))
    (expected, _), (got, _), optimized = run_both(Branch(), branch_inputs(), config)
    assert torch.equal(got[1], expected[1])
    r = row(optimized, SEL)
    assert r["matches"] == 0 and r["reasons"] == [
        "compressed_attention did not rewrite these probabilities (disabled): no lse to select from"]
    record = only_graph(optimized)
    assert "select_blocks" not in record.code_after
    assert record.code_after.count("torch.sort(") == record.code_before.count("torch.sort(") == 2


def test_a_mask_from_data_is_refused():
    class DataMask(Branch):
        def forward(self, q, k, v, visible):
            k_rep = k.unfold(1, L, D).mean(-1).transpose(1, 2).repeat_interleave(2, dim=1)
            v_rep = v.unfold(1, L, D).mean(-1).transpose(1, 2).repeat_interleave(2, dim=1)
            scores = (q.transpose(1, 2) @ k_rep.transpose(-1, -2)) * 0.5
            scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~visible.any(-1, keepdim=True), 0.0)
            return (torch.softmax(scores, dim=-1) * visible) @ v_rep

    q, k, v = branch_inputs()
    S, Tc = q.shape[1], (q.shape[1] - L) // D + 1
    visible = torch.arange(Tc)[None, :] * D + L - 1 <= torch.arange(S)[:, None]
    optimized = optimize_fresh(DataMask())
    torch.testing.assert_close(optimized(q, k, v, visible), DataMask()(q, k, v, visible))
    r = row(optimized, CMP)
    assert r["matches"] == 0 and r["reasons"] == ["the visibility mask depends on placeholder l_visible_ "
                                                  "(data, not positions)"], r["reasons"]


def test_verification_cap_is_a_reason(monkeypatch):
    import nsa_compile.passes.compressed_attention as compressed

    monkeypatch.setattr(compressed, "MAX_VERIFIED_ELEMENTS", 100)
    (expected, _), (got, _), optimized = run_both(Branch(), branch_inputs())
    assert torch.equal(got[1], expected[1])
    r = row(optimized, CMP)
    assert r["matches"] == 0 and "elements, over the cap of 100: not verified" in r["reasons"][0], r["reasons"]


def test_backends_named_in_the_config_are_used_or_the_rewrite_refused():
    config = nsa_compile.OptimizeConfig(compiler="aot_eager", compressed_attention_backend="reference",
                                        select_blocks_backend="triton")
    (expected, _), (got, _), optimized = run_both(Branch(), branch_inputs(), config)
    assert torch.equal(got[1], expected[1])
    r = row(optimized, CMP)
    assert r["matches"] == 1
    assert r["kernels"][0].endswith("not triton: compressed_attention_backend='reference' in OptimizeConfig)")
    r = row(optimized, SEL)
    assert r["matches"] == 0 and r["reasons"][0].startswith(
        "OptimizeConfig(select_blocks_backend='triton'): select_blocks: backend 'triton' cannot run these inputs:")


@pytest.mark.inductor
def test_inductor_smoke_compressed_and_selection():
    args = branch_inputs()
    torch._dynamo.reset()
    optimized = nsa_compile.optimize(Branch())
    got, expected = optimized(*args), Branch()(*args)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], expected[1])
    assert row(optimized, CMP)["matches"] == row(optimized, SEL)["matches"] == 1


# --- the torch.topk form (issue 3): accepted, with a note on ties at the n-th place -----------------

TOPK_TINY_KERNEL = (f"nsa.select_blocks[reference] (l'={TINY.sel_block}, n={TINY.n_selected}, from the compressed "
                    f"lse, no [B, H, S, Tc] probabilities{TOPK_NOTE}{NOT_TRITON_SEL})")


class TopkAttention(NSAAttention):
    """NSAAttention whose select_blocks ranks with torch.topk(key, n, dim=-1) instead of the stable
    sort (Branch's "topk" form, the model's code otherwise)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.ranking = Branch("topk", cfg.group_size, (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected))

    def select_blocks(self, p_cmp, S):
        return self.ranking.select(p_cmp, S, self.cfg.cmp_block, self.cfg.cmp_stride)


def topk_model(**changes):
    """The tiny model with TopkAttention in every layer."""
    model = build_model("tiny", **changes)
    for block in model.blocks:
        block.attn = TopkAttention(model.cfg)
    return model


def topk_tiny_model():
    """A model factory for `explain --model path/to/this_file.py:topk_tiny_model`: (model, tokens [1, 40])."""
    torch.manual_seed(0)
    return topk_model(), tokens(1, 40)[:, :-1]


def test_topk_model_fires_on_every_layer_with_parity_and_the_note():
    """S = 100 > n * l' = 48: the ranking decides which blocks are chosen (bf16: the branch tests)."""
    torch.manual_seed(1)
    model = optimized_with_parity(topk_model(), 100, torch.float32)
    r = row(model, SEL)
    assert (r["matches"], r["where"], r["refused"], r["kernels"]) == (2, LAYERS, 0, [TOPK_TINY_KERNEL])
    record = only_graph(model)
    assert record.code_before.count("torch.topk(") == 2 and "torch.topk(" not in record.code_after
    assert record.code_before.count("torch.sort(") == 2 and "torch.sort(" not in record.code_after
    assert record.code_after.count("torch.ops.nsa.select_blocks(") == 2
    fwd = record.aten["forward"]
    assert aten_nodes(fwd, torch.ops.aten.topk.default) == aten_nodes(fwd, torch.ops.aten.sort.default) == []
    assert len(aten_nodes(fwd, torch.ops.nsa.select_blocks.default)) == 2


def test_topk_with_ties_at_the_nth_place_takes_the_lower_block_a_result_topk_may_give():
    """Zero keys make every fully visible block's importance equal, so candidates tie at the n-th
    place (n = 4, S = 45: from block 4 on, blocks 1-3 compete for the slot the three forced blocks
    leave). The op takes the lower block, as the stable sort does, and its blocks' keys are exactly
    torch.topk's values row by row: a result torch.topk itself may return."""
    n, S = 4, 45
    args = branch_inputs(S=S, zero_keys=True)
    (_, _), (got, _), optimized = run_both(Branch("topk", sizes=(L, D, LS, n)), args)
    assert row(optimized, SEL)["matches"] == 1
    block_idx = got[1].detach()

    class RankingKey(Branch):
        def select(self, p, S, l, d):
            return self.ranking_key(p, S, l, d)

    with torch.no_grad():
        key = RankingKey("topk", sizes=(L, D, LS, n))(*args)[1]  # eager's [B, G, S, max(Ns, n)]
        stable = Branch(sizes=(L, D, LS, n))(*args)[1]  # the sort form: ties to the lower block
    top = torch.topk(key, n + 1, dim=-1).values
    tied = (top[..., n - 1] == top[..., n]) & top[..., n].isfinite()
    # torch.topk's choice is unspecified from block 4 on (t >= 4 * l'), where blocks 1-3 compete
    assert bool(tied[:, :, 4 * LS:].all()) and not bool(tied[:, :, :4 * LS].any())
    assert torch.equal(block_idx, stable)
    keys_of_chosen = key.gather(-1, block_idx.clamp(min=0)).masked_fill(block_idx < 0, float("-inf"))
    assert torch.equal(keys_of_chosen.sort(-1, descending=True).values, torch.topk(key, n, dim=-1).values)


def test_explain_shows_the_topk_note():
    from nsa_compile.cli import cli

    result = CliRunner().invoke(cli, ["explain", "--model", f"{__file__}:topk_tiny_model", "--device", "cpu"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith(f"| {SEL} ") and x.count("|") == 8]  # pass table
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:5] == ["2", ", ".join(LAYERS), TOPK_TINY_KERNEL, "0"], cells


# --- GPU (tools/gpu_check.sh runs these on the H100) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_seed_layers_fire_with_the_cuda_backends_and_parity(dtype):
    """Two seed-config layers at S = 1100 (> n * l' = 1024, so the ranking decides), batch 1: both
    passes fire on every layer and the optimized model trains with eager's numbers. (At S 2048 and
    batch 2 the float64 eager oracle's gathered K/V alone asked for 24 GiB at a time: out of an
    H100's memory.)"""
    torch.manual_seed(0)
    eager = build_model("seed", n_layers=2).cuda()
    model = optimized_with_parity(eager, 1100, dtype, batch=1)
    for name in (CMP, SEL):
        r = row(model, name)
        print(name, r["kernels"], f"{r['time_ms']} ms")
        assert (r["matches"], r["where"]) == (2, LAYERS), r


@pytest.mark.gpu
@pytest.mark.parametrize("change", [None, "topk"], ids=["sort", "topk"])
def test_gpu_seed_shape_block_ids_match_eager_but_for_near_ties(change):
    """The branch at the seed shape in bf16: the op's importance is exp(s - lse), eager's a softmax,
    so only near-tied blocks may be ranked the other way (nsa_compile/ops/block_select.py); the
    topk form likewise (CUDA's topk also breaks exact ties its own way)."""
    args = [x.cuda() for x in branch_inputs(B=2, S=4096, G=2, h=6, Dk=64, Dv=64, dtype=torch.bfloat16)]
    module = Branch(change, h=6, sizes=(32, 16, 64, 16))
    with torch.no_grad():
        expected = module(*args)
        optimized = optimize_fresh(copy.deepcopy(module))
        got = optimized(*args)
    assert row(optimized, CMP)["matches"] == row(optimized, SEL)["matches"] == 1
    kernel = row(optimized, SEL)["kernels"][0]
    assert kernel.startswith("nsa.select_blocks[triton]") and (TOPK_NOTE in kernel) == (change == "topk"), kernel
    differ = (got[1] != expected[1]).any(-1).float().mean().item()
    print(f"rows whose blocks differ from eager's: {differ:.2e}")
    assert differ < 1e-3
    torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_paper_shape_64k_is_verified_and_runs_without_the_dense_probabilities():
    """H 64, G 4, D 128, l 32, d 16, l' 64, n 16 at S = 65536, bf16: the masks are verified at
    compile time within the cap (the eager branch itself would need 68 GB for p), and the rewritten
    graph runs."""
    S = 65536
    args = [x.cuda() for x in branch_inputs(B=1, S=S, G=4, h=16, Dk=128, Dv=128, dtype=torch.bfloat16)]
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        optimized = optimize_fresh(Branch(h=16, sizes=(32, 16, 64, 16)))
        o, block_idx = optimized(*args)
    for name in (CMP, SEL):
        r = row(optimized, name)
        print(name, r["kernels"], r["reasons"], f"{r['time_ms']} ms")
        assert r["matches"] == 1, r
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    assert tuple(block_idx.shape) == (1, 4, S, 16) and bool(torch.isfinite(o).all())
    assert bool((block_idx[..., 0] == 0).all())  # block 0 is always forced


# --- symbolic sizes (dynamic shapes): one graph for every length ---------------------------------

def logs_of(record, name):
    (log,) = [log for log in record.logs if log.pass_name == name]
    return log


# view-blocks: the eager code's x[:, :Tc * l].reshape(..) guards on whether S % l == 0, so S = 48
# compiles a third graph (Dynamo's doing, not the passes'). The as_strided pooling is left out: its
# backward guards on the storage size (a recompile per length with or without the passes).
@pytest.mark.parametrize("change, graphs", [(None, 2), ("view-blocks", 3), ("topk", 2)],
                         ids=["model", "view-pooling-l-eq-d", "topk"])
def test_symbolic_lengths_fire_in_one_graph_with_eager_block_ids_and_gradients(change, graphs):
    """dynamic=None: static at S = 29, then one graph with S as a symbol serves 30, 45, 48 and 61
    (lengths of every parity, and of residues 0, 1, 5 modulo l' = 8): both rewrites in it, the
    sorts and the dense softmax gone, block ids equal to eager's, outputs and gradients eager's at
    each length."""
    module = Branch(change)
    optimized = optimize_fresh(copy.deepcopy(module), NO_GQA)
    for S in (29, 30, 45, 48, 61):
        args = branch_inputs(S=S)
        eager_args, opt_args = ([x.clone().requires_grad_() for x in args] for _ in range(2))
        expected, got = module(*eager_args), optimized(*opt_args)
        assert torch.equal(got[1], expected[1]), S
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(expected[0].square().sum(), eager_args)
        for a, b in zip(torch.autograd.grad(got[0].square().sum(), opt_args), grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    static, *symbolic = state_of(optimized).graphs  # no recompile per length
    assert len(symbolic) == graphs - 1 and "torch.SymInt" not in static.code_before
    for record in symbolic:
        assert "torch.SymInt" in record.code_before
        assert [len(logs_of(record, name).matches) for name in (CMP, SEL)] == [1, 1]
        assert "torch.ops.nsa.compressed_attention" in record.code_after
        assert "torch.ops.nsa.select_blocks" in record.code_after
        for gone in ("torch.softmax(", "torch.sort(", "topk("):
            assert gone not in record.code_after, gone


def test_tiny_model_keeps_both_rewrites_when_the_length_changes():
    """dynamic=None (static first, then S as a symbol): the tiny model at lengths 64, 65, 83, 100
    compiles twice, and the symbolic graph has both rewrites; logits and gradients are eager's."""
    torch.manual_seed(0)
    eager = build_model(preset("tiny", n_layers=1))
    optimized = optimize_fresh(copy.deepcopy(eager), nsa_compile.OptimizeConfig(compiler="aot_eager"))
    for S in (64, 65, 83, 100):
        x = tokens(1, S, seed=S)[:, :-1]
        expected, got = eager(x), optimized(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        expected.square().mean().backward()
        got.square().mean().backward()
        for (name, a), b in zip(eager.named_parameters(), optimized.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
            a.grad = b.grad = None
    static, dynamic = state_of(optimized).graphs
    assert "torch.SymInt" not in static.code_before and "torch.SymInt" in dynamic.code_before
    for record in (static, dynamic):
        assert [len(logs_of(record, name).matches) for name in (CMP, SEL)] == [1, 1]
        assert "torch.ops.nsa.select_blocks" in record.code_after and "torch.sort(" not in record.code_after


@pytest.mark.parametrize(
    "change, rewritten, reason",
    [("late-by-two-at-odd-lengths", [1, 1, 0, 0], "=31 (S = 31): the visibility mask is off by 2"),
     ("block-1-forced-at-odd-lengths", [1, 1, 1, 0],
      "=31 (S = 31): the key has 4 blocks, not ceil(S / l') = 31 for the l' = 0 its masks imply")],
)
def test_symbolic_near_miss_right_at_even_lengths_only_is_refused(change, rewritten, reason):
    """A mask or key that is NSA's at even S only: the static graph at S = 30 is rewritten, the
    symbolic one (probed at S = 30, 31, 49) is not, with the probe size named, and it stays eager."""
    module = Branch(change)
    optimized = optimize_fresh(copy.deepcopy(module), NO_GQA)
    for S in (30, 31, 44):
        args = branch_inputs(S=S)
        for a, b in zip(optimized(*args), module(*args)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    static, dynamic = state_of(optimized).graphs
    counts = [len(logs_of(record, name).matches) for record in (static, dynamic) for name in (CMP, SEL)]
    assert counts == rewritten
    refusals = [r.reason for name in (CMP, SEL) for r in logs_of(dynamic, name).refusals]
    assert any(reason in text for text in refusals), refusals
    if change == "late-by-two-at-odd-lengths":
        assert dynamic.code_before == dynamic.code_after
    else:  # the compressed op is there, the selection stays eager
        assert "torch.ops.nsa.select_blocks" not in dynamic.code_after
        assert dynamic.code_after.count("torch.sort(") == dynamic.code_before.count("torch.sort(") == 2
