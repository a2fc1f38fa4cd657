"""Graph tests of select_blocks on packed documents (pos): the pass fires on every layer of the
packed tiny model (exact count) with the sorts and the [B, H, S, Tc] probabilities gone and
nsa.select_blocks taking the positions; outputs and gradients match the eager packed model; the
block ids equal eager's; the near misses (slots counted from the row start, forced or candidate
blocks from t, off by one, positions from another tensor) are refused with the graph's selection
unchanged and a reason. The unpacked form is tests/test_compressed_pass.py's (unchanged).

The selection pass needs compressed_attention's packed rewrite (the lse with pos): these tests
fail where that pass refuses the packed branch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import document_positions, only_graph, optimize_fresh, packed_slot_visibility, row, tokens
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.models import build_model, preset
from nsa_compile.models.nsa import NSAAttention, upcast
from nsa_compile.parity import check_parity

CMP, SEL = "compressed_attention", "select_blocks"
TINY = preset("tiny")
LAYERS = ["blocks.0.attn", "blocks.1.attn"]
PACKED_KERNEL = (f"nsa.select_blocks[reference] (l'={TINY.sel_block}, n={TINY.n_selected}, packed documents (pos), "
                 "from the compressed lse, no [B, H, S, Tc] probabilities; not triton: the Triton kernel runs on "
                 "CUDA (tensors on cpu))")


positions = document_positions


def float_nodes_ending_in(gm, shape):
    """Nodes of an ATen graph whose value is a float tensor whose last dims are `shape`."""
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and tuple(val.shape[-len(shape):]) == shape:
            out.append(node)
    return out


# --- the packed tiny model ------------------------------------------------------------------------


def test_packed_model_fires_on_every_layer_with_parity():
    """Rows of documents 1, 6, 13, 30, 40 tokens long, and one document: both layers rewritten,
    the op given the positions, outputs and gradients of the eager packed model (fp32)."""
    torch.manual_seed(1)
    eager = build_model("tiny")
    S = 90
    pos = torch.stack([positions([13, 40, 1, 6, 30]), positions([90])])
    tokens = torch.randint(0, 256, (2, S + 1), generator=torch.Generator().manual_seed(4))
    model = optimize_fresh(copy.deepcopy(eager))
    got = model.loss(tokens, pos)
    want = eager.loss(tokens, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward()
    want.backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)

    r = row(model, SEL)
    assert (r["matches"], r["where"], r["refused"], r["kernels"]) == (2, LAYERS, 0, [PACKED_KERNEL]), r
    assert row(model, CMP)["matches"] == 2
    record = only_graph(model)
    calls = [line for line in record.code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 2 and all("'reference', l_pos_)" in line for line in calls), calls
    assert record.code_before.count("torch.sort(") == 4 and "torch.sort(" not in record.code_after
    Tc, Ns = S - TINY.cmp_block + 1, -(-S // TINY.sel_block)
    fwd, bwd = record.aten["forward"], record.aten["backward"]
    for gm in (fwd, bwd):
        assert float_nodes_ending_in(gm, (S, Tc)) == []  # no scores or probabilities [B, H, S, Tc]
        assert float_nodes_ending_in(gm, (Tc, Ns)) == []  # no [B, Tc, Ns] block map
        assert not [n for n in gm.graph.nodes if n.target in (torch.ops.aten.sort.stable, torch.ops.aten.sort.default)]
    ops = [n for n in fwd.graph.nodes if n.target is torch.ops.nsa.select_blocks.default]
    assert len(ops) == 2
    for op in ops:  # the positions reach the op: a [B, S] int64 input of the forward graph
        pos_arg = op.args[9] if len(op.args) > 9 else op.kwargs["pos"]
        assert pos_arg.op == "placeholder" and pos_arg.meta["val"].dtype == torch.int64
        assert tuple(pos_arg.meta["val"].shape) == (2, S)


# --- the branch on its own: accepted forms, block ids, near misses ----------------------------------

L, D, LS, N = 4, 2, 8, 4  # l, d, l', n of the module tests: S = 45 spans 6 selection blocks
S_BRANCH = 45
PACKINGS = [[3, 20, 1, 21], [45], [9, 8, 17, 11]]  # < l, off and on block boundaries, > n * l' / 2


class PackedBranch(nn.Module):
    """NSAAttention.compressed_attention + select_blocks with pos (models/nsa.py) on q [B, S, H, Dk],
    k, v [B, S, G, D] and pos [B, S], returning (o_cmp, block_idx), written the model's way except
    for `change`."""

    def __init__(self, change=None, h=2, sizes=(L, D, LS, N)):
        super().__init__()
        self.change, self.h = change, h
        self.l, self.d, self.ls, self.n = sizes

    def forward(self, q, k, v, pos, other_pos=None):
        h, l, d = self.h, self.l, self.d
        S, Dk = q.shape[1], q.shape[3]
        k_cmp, v_cmp = k.unfold(1, l, 1).mean(-1), v.unfold(1, l, 1).mean(-1)  # [B, Tc, G, D]: a slot per token
        Tc = k_cmp.shape[1]
        k_rep = k_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
        v_rep = v_cmp.transpose(1, 2).repeat_interleave(h, dim=1)
        scores = upcast(q.transpose(1, 2) @ k_rep.transpose(-1, -2)) * Dk**-0.5  # [B, H, S, Tc]
        visible = packed_slot_visibility(S, Tc, pos, l, d)  # [B, 1, S, Tc]
        scores = scores.masked_fill(~visible, float("-inf"))
        has_block = visible.any(dim=-1, keepdim=True)
        p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible
        o = (p.to(v_rep.dtype) @ v_rep).transpose(1, 2)  # [B, S, H, Dv]
        return o, self.select(p, S, pos, other_pos)

    def select(self, p, S, pos, other_pos):
        change, l, ls, n = self.change, self.l, self.ls, self.n
        B, H, _, Tc = p.shape
        Ns = -(-S // ls)
        j = torch.arange(Ns, device=p.device)[None, :]
        start = {"overlap-from-row-start": torch.arange(Tc, device=p.device)[:, None],
                 "overlap-off-by-one": pos[:, :Tc, None] + 1,
                 "overlap-from-another-tensor": other_pos[:, :Tc, None] if other_pos is not None else None,
                 }.get(change, pos[:, :Tc, None])  # fmt: skip
        overlap = torch.minimum(start + l, (j + 1) * ls) - torch.maximum(start, j * ls)
        overlap = overlap.clamp(min=0).to(p.dtype) / l  # [B, Tc, Ns] (or [Tc, Ns])
        p_slc = p @ (overlap if overlap.dim() == 2 else overlap[:, None])  # [B, H, S, Ns]
        p_grp = p_slc.view(B, H // self.h, self.h, S, Ns).sum(2)  # [B, G, S, Ns]
        t = pos[:, None, :, None]  # [B, 1, S, 1]
        row_t = torch.arange(S, device=p.device)[:, None]
        current = (row_t if change in ("forced-from-t", "all-from-t") else t) // ls
        if change == "current-off-by-one":
            current = (t + 1) // ls
        forced = (j == 0) | (j == current) | (j == current - 1)
        candidate = j * ls <= (row_t if change == "all-from-t" else t)
        if change == "masked-fill-key":
            key = p_grp.masked_fill(~candidate, float("-inf")).masked_fill(forced, float("inf"))
        else:
            key = torch.where(forced, float("inf"), torch.where(candidate, p_grp, float("-inf")))
        key = F.pad(key, (0, max(0, n - Ns)), value=float("-inf"))
        if change == "topk":
            values, order = torch.topk(key, n, dim=-1)
        else:
            values, order = torch.sort(key, dim=-1, descending=True, stable=True)
            values, order = values[..., :n], order[..., :n]
        past_end = key.shape[-1]
        chosen = torch.where(values > float("-inf"), order, past_end)
        chosen = torch.sort(chosen, dim=-1).values
        return torch.where(chosen == past_end, -1, chosen)


def branch_inputs(h=2, G=2, Dk=8, Dv=6, dtype=torch.float32, packings=PACKINGS):
    g = torch.Generator().manual_seed(0)
    B, S = len(packings), sum(packings[0])
    q = torch.randn(B, S, G * h, Dk, generator=g).to(dtype)
    k = torch.randn(B, S, G, Dk, generator=g).to(dtype)
    v = torch.randn(B, S, G, Dv, generator=g).to(dtype)
    return q, k, v, torch.stack([positions(lengths) for lengths in packings])


def run_both(module, args):
    """(eager outputs and float leaves, optimized outputs and float leaves, the optimized module)."""
    def leaves():
        return [x.clone().requires_grad_() if x.is_floating_point() else x for x in args]

    eager_args, opt_args = leaves(), leaves()
    expected = module(*eager_args)
    optimized = optimize_fresh(copy.deepcopy(module))
    return (expected, eager_args[:3]), (optimized(*opt_args), opt_args[:3]), optimized


@pytest.mark.parametrize("change, h, dtype", [(None, 2, torch.float32), ("masked-fill-key", 1, torch.float32),
                                              ("topk", 3, torch.bfloat16)],
                         ids=["model-form", "masked-fill-key-h1", "bf16-h3-topk"])
def test_accepted_forms_give_eager_block_ids_and_gradients(change, h, dtype):
    args = branch_inputs(h=h, dtype=dtype)
    (expected, eager_args), (got, opt_args), optimized = run_both(PackedBranch(change, h), args)
    assert row(optimized, CMP)["matches"] == 1, row(optimized, CMP)
    r = row(optimized, SEL)
    assert r["matches"] == 1 and "packed documents (pos)" in r["kernels"][0], r
    record = only_graph(optimized)
    assert "torch.sort(" not in record.code_after and "topk(" not in record.code_after
    assert record.code_after.count("torch.ops.nsa.select_blocks(") == 1
    assert torch.equal(got[1], expected[1])  # block ids: exactly eager's (ties to the lower block)
    assert (got[1] >= 0).sum(-1).max() == N and (got[1] == -1).any()  # sparse somewhere, padded somewhere
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], expected[0], **tol)
    grads = torch.autograd.grad(expected[0].float().square().sum(), eager_args)
    for a, b in zip(torch.autograd.grad(got[0].float().square().sum(), opt_args), grads):
        torch.testing.assert_close(a, b, **tol)


def test_the_models_own_functions_give_eager_block_ids():
    """NSAAttention.compressed_attention and select_blocks themselves, with pos (tiny's l, d, l', n)."""

    class ModelBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = NSAAttention(TINY)

        def forward(self, q, k, v, pos):
            o, p = self.attn.compressed_attention(q, k, v, pos)
            return o, self.attn.select_blocks(p, q.shape[1], pos)

    g = torch.Generator().manual_seed(2)
    B, S, H, G, Dh = 2, 100, TINY.n_heads, TINY.n_kv_groups, TINY.head_dim
    q, k, v = (torch.randn(B, S, heads, Dh, generator=g) for heads in (H, G, G))
    pos = torch.stack([positions([5, 60, 35]), positions([17, 83])])
    (expected, _), (got, _), optimized = run_both(ModelBranch(), (q, k, v, pos))
    assert row(optimized, CMP)["matches"] == row(optimized, SEL)["matches"] == 1
    assert torch.equal(got[1], expected[1]) and (got[1] >= 0).sum(-1).max() == TINY.n_selected
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_under_autocast_the_rounded_importance_gives_eager_block_ids():
    """The model's packed functions under CPU bf16 autocast (bf16 q, k, v as projections give them,
    n = 5: two free slots): select_blocks fires with pos and importance_dtype=torch.bfloat16, and
    the block ids equal eager's under autocast, where the float32 ranking of the same p differs."""
    cfg = preset("tiny", n_selected=5)

    class ModelBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = NSAAttention(cfg)

        def forward(self, q, k, v, pos):
            o, p = self.attn.compressed_attention(q, k, v, pos)
            return o, self.attn.select_blocks(p, q.shape[1], pos)

    g = torch.Generator().manual_seed(2)
    B, S, H, G, Dh = 2, 150, cfg.n_heads, cfg.n_kv_groups, cfg.head_dim
    q, k, v = (torch.randn(B, S, heads, Dh, generator=g) for heads in (H, G, G))
    q, k, v = (0.1 * q).to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)  # flat scores: near ties
    pos = torch.stack([positions([13, 100, 1, 6, 30]), positions([150])])
    module = ModelBranch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (expected, _), (got, _), optimized = run_both(module, (q, k, v, pos))
        _, p = module.attn.compressed_attention(q, k, v, pos)
    assert not torch.equal(module.attn.select_blocks(p, S, pos), expected[1])  # unrounded: another choice
    r = row(optimized, SEL)
    assert (r["matches"], r["refused"]) == (1, 0) and "importance rounded to bfloat16" in r["kernels"][0], r
    calls = [line for line in only_graph(optimized).code_after.splitlines() if "torch.ops.nsa.select_blocks(" in line]
    assert len(calls) == 1 and "importance_dtype = torch.bfloat16" in calls[0], calls
    assert torch.equal(got[1], expected[1]) and (got[1] >= 0).sum(-1).max() == 5
    torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=2e-2)


NEAR_MISSES = [
    ("overlap-from-row-start", "the block map counts the slots from the row start (slot s starting at token s) "
                               "instead of their document position pos[s]"),
    ("overlap-off-by-one", "the block map is not overlap(s, j) / l of each slot's document position"),
    ("forced-from-t", "the key's forced (+inf) and excluded (-inf) blocks are not NSA's per document for l' = 8"),
    ("all-from-t", "the key's forced (+inf) and candidate blocks are counted from the token t, not from its "
                   "document position pos[t]"),
    # one document per row already shows it: block 1 enters one token early, at t = l' - 1
    ("current-off-by-one", "the key has 6 blocks, not ceil(S / l') = 7 for the l' = 7 its masks imply"),
    ("overlap-from-another-tensor", "the block map and the key masks depend on placeholder l_other_pos_ (data "
                                    "other than the positions l_pos_ the compressed op was given)"),
]


@pytest.mark.parametrize("change, reason", NEAR_MISSES, ids=[change for change, _ in NEAR_MISSES])
def test_near_misses_are_refused_and_the_compressed_pass_still_fires(change, reason):
    q, k, v, pos = branch_inputs()
    args = (q, k, v, pos) + ((pos.clone(),) if change == "overlap-from-another-tensor" else ())
    (expected, _), (got, _), optimized = run_both(PackedBranch(change), args)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # the eager selection ran
    r = row(optimized, SEL)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]
    assert row(optimized, CMP)["matches"] == 1  # o_cmp from the op; p stays for the eager selection
    record = only_graph(optimized)
    assert record.code_after.count("torch.sort(") == record.code_before.count("torch.sort(") == 2
    assert "select_blocks" not in record.code_after and "torch.softmax(" in record.code_after


# --- GPU (tools/gpu_check.sh runs these on the H100) ----------------------------------------------

# a document longer than n * l' = 1024 (the ranking decides), short ones, off the boundaries; B 2,
# S 1100: the float64 eager oracle gathers [B, H, S, n*l', D] K/V (2 x 7 GB here; at B 4, S 2048
# it ran out of an H200's memory)
GPU_PACKINGS = [[900, 17, 183], [37, 1063]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_seed_layers_packed_fire_with_parity(dtype):
    """Two seed-config layers at S = 1100 with packed documents: both passes fire on every layer and
    the optimized model's outputs and gradients are within eager's own error of float64."""
    torch.manual_seed(0)
    eager = build_model("seed", n_layers=2).cuda()
    pos = torch.stack([positions(lengths) for lengths in GPU_PACKINGS]).cuda()
    kept = []

    def optimize(m):
        kept.append(optimize_fresh(m))
        return kept[-1]

    report = check_parity(eager, optimize, (tokens(2, 1100, seed=4)[:, :-1].cuda(), pos), dtype, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    for name in (CMP, SEL):
        r = row(kept[0], name)
        print(name, r["kernels"], f"{r['time_ms']} ms")
        assert (r["matches"], r["where"]) == (2, LAYERS), r


@pytest.mark.gpu
def test_gpu_seed_shape_packed_block_ids_match_eager_but_for_near_ties():
    """The packed branch at the seed shape (l 32, d 16, l' 64, n 16, h 6, D 64) in bf16 at S = 2048:
    the op's importance is exp(s - lse), eager's a softmax, so only near-tied blocks may be ranked
    the other way."""
    q, k, v, pos = (x.cuda() for x in branch_inputs(h=6, Dk=64, Dv=64, dtype=torch.bfloat16, packings=GPU_PACKINGS))
    module = PackedBranch(h=6, sizes=(32, 16, 64, 16))
    with torch.no_grad():
        expected = module(q, k, v, pos)
        optimized = optimize_fresh(copy.deepcopy(module))
        got = optimized(q, k, v, pos)
    assert row(optimized, CMP)["matches"] == row(optimized, SEL)["matches"] == 1
    print(row(optimized, SEL)["kernels"], f"{row(optimized, SEL)['time_ms']} ms")
    differ = (got[1] != expected[1]).any(-1).float().mean().item()
    print(f"rows whose blocks differ from eager's: {differ:.2e}")
    assert differ < 1e-3 and bool((got[1] >= 0).sum(-1).max() == 16)
    torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=2e-2)


def test_packed_documents_at_symbolic_sizes_stay_eager_with_the_reason():
    """dynamic=None: the second length compiles with S as a symbol, where the packed masks are not
    verified (static sizes only): both passes refuse with that reason, the answers stay eager's."""
    from nsa_compile.api import state_of

    torch.manual_seed(1)
    eager = build_model(preset("tiny", n_layers=1))
    model = optimize_fresh(copy.deepcopy(eager))
    for S, lengths in ((40, [13, 27]), (41, [13, 1, 27])):
        pos = positions(lengths)[None]
        batch = torch.randint(0, 256, (1, S + 1), generator=torch.Generator().manual_seed(S))
        torch.testing.assert_close(model.loss(batch, pos), eager.loss(batch, pos), rtol=1e-5, atol=1e-5)
    static, dynamic = state_of(model).graphs
    assert "torch.SymInt" in dynamic.code_before
    for name in (CMP, SEL):
        (static_log,) = [log for log in static.logs if log.pass_name == name]
        (log,) = [log for log in dynamic.logs if log.pass_name == name]
        assert (len(static_log.matches), len(log.matches)) == (1, 0)
        assert any("packed documents are verified at static sizes only" in r.reason for r in log.refusals), \
            [r.reason for r in log.refusals]
    assert "torch.ops.nsa.select_blocks" not in dynamic.code_after
