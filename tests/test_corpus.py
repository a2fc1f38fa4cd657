"""The corpus of eager NSA models in other people's idioms (tests/corpus), and the causality check.

For every corpus model: eager forward and backward are finite; `check_causality` calls the causal
ones causal and catches the one that reads the future; `optimize` (aot_eager) runs and matches
eager in fp32, output and every gradient; and the passes' match counts equal
tests/corpus/coverage.json exactly (`python tools/corpus_coverage.py --update` rewrites it when a
pass learns, or unlearns, a corpus model), also in the graphs compiled when the length changes
(S + 1: Dynamo's graph with S a symbol; S + 15), where output and gradients match eager's too.
Then `check_causality` on small models whose leak is known, and the `nsa-compile check` command.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import nsa_compile
from corpus import HERE, MODELS, spec
from helpers import optimize_fresh
from nsa_compile.causality import check_causality, default_cuts
from nsa_compile.parity import check_parity
from nsa_compile.cli import cli
from nsa_compile.workload import load_workload, loss_of

COVERAGE = json.loads((HERE / "coverage.json").read_text())


def forward_backward(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and every parameter's gradient of one step on the mean-square loss."""
    model.zero_grad(set_to_none=True)
    out, loss = loss_of(model, inputs, is_lm=False)
    loss.backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", params=sorted(MODELS))
def corpus_run(request):
    """One corpus model, run eagerly and under optimize(aot_eager) once for the tests below."""
    name = request.param
    wl = load_workload(spec(name))
    eager_out, eager_grads = forward_backward(wl.model, wl.inputs)
    optimized = optimize_fresh(copy.deepcopy(wl.model))
    try:
        opt_out, opt_grads = forward_backward(optimized, wl.inputs)
        error = None
    except Exception as err:  # a pass that breaks the model: each test below reports it
        opt_out, opt_grads, error = None, None, err
    return {"name": name, "workload": wl, "eager": (eager_out, eager_grads), "optimized": optimized,
            "opt": (opt_out, opt_grads), "error": error}


def test_the_corpus_is_complete():
    files = sorted(p.name for p in HERE.glob("*.py") if p.name != "__init__.py")
    assert files == sorted(MODELS), "every corpus file is in MODELS, and every entry has its file"
    assert len(MODELS) >= 12
    assert [name for name, (_, _, causal) in MODELS.items() if not causal] == ["nsa_vibe_noncausal.py"]
    assert sorted(COVERAGE) == sorted(MODELS), "coverage.json has one row per corpus model"


def test_eager_forward_and_backward_are_finite(corpus_run):
    wl = corpus_run["workload"]
    x = wl.inputs[0]
    out, grads = corpus_run["eager"]
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    params = dict(wl.model.named_parameters())
    assert sorted(grads) == sorted(params), "every parameter gets a gradient"
    bad = [name for name, g in grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients: {bad}"


def test_causality_check_agrees_with_the_table(corpus_run):
    name, wl = corpus_run["name"], corpus_run["workload"]
    report = check_causality(wl.model, wl.inputs, trials=1)
    assert report.causal == MODELS[name][2], report.verdict()
    if not report.causal:  # the leak is real: the changed rows lie at or before their cut
        assert all(p <= leak.cut for leak in report.leaks for p in leak.positions)
        assert report.max_change > 1e-3


def test_optimize_matches_eager(corpus_run):
    if corpus_run["error"] is not None:
        raise corpus_run["error"]
    eager_out, eager_grads = corpus_run["eager"]
    opt_out, opt_grads = corpus_run["opt"]
    torch.testing.assert_close(opt_out, eager_out, rtol=1e-4, atol=1e-5)
    assert sorted(opt_grads) == sorted(eager_grads)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(opt_grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


def test_rewrites_match_coverage_json(corpus_run):
    if corpus_run["error"] is not None:
        raise corpus_run["error"]
    matches = {row["name"]: row["matches"] for row in nsa_compile.report(corpus_run["optimized"])}
    assert matches == COVERAGE[corpus_run["name"]], (
        "the passes' matches changed: if on purpose, run python tools/corpus_coverage.py --update")


# --- the paper-variant files compute the reference model ----------------------------------------------

PAPER_SHAPE = dict(dim=64, n_heads=4, n_kv_groups=2, head_dim=16, cmp_block=8, cmp_stride=4, sel_block=16,
                   n_selected=4, window=16)


def branch_weights(ks, vs) -> dict:
    """models/nsa.py's per-branch K/V weights from three (cmp, sel, win) k and v weight matrices."""
    return {f"w{kind}.{branch}.weight": w for kind, weights in (("k", ks), ("v", vs))
            for branch, w in zip(("cmp", "sel", "win"), weights)}


def prefixed(prefix: str, module: nn.Module) -> dict:
    return {f"{prefix}.{key}": value for key, value in module.state_dict().items()}


# corpus file -> (ModelConfig changes from PAPER_SHAPE, the reference's state dict from the file's module)
REFERENCE_TWINS = {
    "paper_bhsd.py": (dict(gate="head"), lambda m: {
        "wq.weight": m.to_q.weight, "wo.weight": m.to_out.weight, **prefixed("gate", m.to_gate),
        **branch_weights([p.weight for p in m.to_k], [p.weight for p in m.to_v])}),
    "where_bias_spellings.py": ({}, lambda m: {
        "wq.weight": m.wq.weight, "wo.weight": m.wo.weight, **prefixed("gate", m.gate),
        **branch_weights([m.wk[b].weight for b in ("cmp", "sel", "win")], [m.wv[b].weight for b in ("cmp", "sel", "win")])}),
    "sdpa_complex_rope.py": (dict(window=20, rope="interleaved", compression="mlp"), lambda m: {
        "wq.weight": m.wq.weight, "wo.weight": m.wo.weight, **prefixed("gate", m.gate),
        **branch_weights(m.wk.weight.chunk(3), m.wv.weight.chunk(3)),
        "compress_k.pos_emb": m.compress_k.pe, "compress_v.pos_emb": m.compress_v.pe,
        **prefixed("compress_k.mlp", m.compress_k.mlp), **prefixed("compress_v.mlp", m.compress_v.mlp)}),
    "chunked_queries.py": (dict(rope="interleaved", gate="head"), lambda m: {
        "wq.weight": m.q_proj.weight, "wo.weight": m.o_proj.weight, **prefixed("gate", m.g_proj),
        **branch_weights(m.k_proj.weight.chunk(3), m.v_proj.weight.chunk(3))}),
    # its learned pooling weights start at 1/l: the mean of the reference
    "grouped5d_nograd.py": (dict(gate="head", rotary_dim=8), lambda m: {
        "wq.weight": m.q.weight, "wo.weight": m.o.weight, **prefixed("gate", m.gate),
        **branch_weights([m.kv[b].weight.chunk(2)[0] for b in ("cmp", "sel", "win")],
                         [m.kv[b].weight.chunk(2)[1] for b in ("cmp", "sel", "win")])}),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_TWINS))
def test_paper_variants_compute_the_reference_model(name):
    """The files that claim the paper's semantics give models/nsa.py's output with the same weights."""
    from nsa_compile.models.config import ModelConfig
    from nsa_compile.models.nsa import NSAAttention, rope_tables

    assert MODELS[name][1].startswith("paper")
    wl = load_workload(spec(name))
    changes, weights = REFERENCE_TWINS[name]
    cfg = ModelConfig(**{**PAPER_SHAPE, **changes})
    reference = NSAAttention(cfg)
    reference.load_state_dict(weights(wl.model), strict=True)
    x = wl.inputs[0]
    cos, sin = rope_tables(x.shape[1], cfg.rotary_dim or cfg.head_dim, cfg.rope_base, x.device)
    with torch.no_grad():
        torch.testing.assert_close(wl.model(x), reference(x, cos, sin), rtol=1e-5, atol=1e-6)


# --- check_causality on models whose leak is known ----------------------------------------------------


class Lookahead(nn.Module):
    """y[t] = W x[t] + 0.5 * x[t + 1]: every position reads the next one (through `mix`)."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.mix = Shift()

    def forward(self, x):  # [B, S, dim]
        return self.mix(self.proj(x))


class Shift(nn.Module):
    def forward(self, x):
        return x + 0.5 * torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


class PrefixMean(nn.Module):
    """y[t] = mean of x[0..t]: causal."""

    def forward(self, x):
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]


def test_a_one_token_lookahead_leaks_exactly_at_each_cut():
    report = check_causality(Lookahead(), torch.randn(2, 20, 8), per_module=True)
    assert not report.causal
    assert report.cuts == default_cuts(20) == (0, 1, 2, 5, 10, 15, 18)
    assert [(leak.cut, leak.positions) for leak in report.leaks] == [(t, (t,)) for t in report.cuts]
    assert report.first_leak == 0
    assert all(leak.modules == ("mix",) for leak in report.leaks), "proj is causal; the leak enters in mix"
    assert "first leaking module: mix" in report.verdict()


def test_a_causal_model_and_token_inputs_pass():
    assert check_causality(PrefixMean(), torch.randn(2, 20, 8)).causal
    tokens = torch.randint(0, 256, (2, 24))
    embed_then_lookahead = nn.Sequential(nn.Embedding(256, 8), Shift())
    report = check_causality(embed_then_lookahead, tokens, cuts=(3, 10))
    assert [(leak.cut, leak.positions) for leak in report.leaks] == [(3, (3,)), (10, (10,))]
    assert check_causality(nn.Embedding(256, 8), tokens).causal


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cut points"):
        check_causality(PrefixMean(), torch.randn(1, 6, 2), cuts=(5,))
    with pytest.raises(ValueError, match="no future"):
        check_causality(PrefixMean(), torch.randn(1, 1, 2))
    with pytest.raises(ValueError, match="sequence"):
        check_causality(nn.Flatten(), torch.randn(2, 6, 3))


# --- nsa-compile check ------------------------------------------------------------------------------


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_check_command_passes_the_tiny_preset():
    result = invoke("check", "--model", "tiny", "--seq-len", "48", "--device", "cpu", "--trials", "1")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("tiny: causal:") and result.output.count("\n") == 1


def test_check_command_fails_the_model_that_reads_the_future():
    result = invoke("check", "--model", spec("nsa_vibe_noncausal.py"), "--device", "cpu", "--trials", "1")
    assert result.exit_code == 1, result.output
    assert "NOT causal: output position" in result.output and result.output.count("\n") == 1
    as_json = invoke("check", "--model", spec("nsa_vibe_noncausal.py"), "--device", "cpu", "--trials", "1",
                     "--format", "json")
    data = json.loads(as_json.output)
    assert as_json.exit_code == 1 and data["causal"] is False and data["leaks"]


# --- on the GPU: the CUDA backends (Triton kernels) on the corpus's layouts ------------------------


def bf16_matches(wl, device: str) -> dict[str, int]:
    """The passes' match counts for the workload's model in bf16 on `device` (aot_eager), after one
    forward and backward."""
    torch._dynamo.reset()
    model = nsa_compile.optimize(copy.deepcopy(wl.model).to(device, torch.bfloat16),
                                 nsa_compile.OptimizeConfig(compiler="aot_eager"))
    inputs = tuple(x.to(device, torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point()
                   else x.to(device) if isinstance(x, torch.Tensor) else x for x in wl.inputs)
    loss_of(model, inputs, is_lm=False)[1].backward()
    return {row["name"]: row["matches"] for row in nsa_compile.report(model)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_bf16_parity_and_the_same_rewrites(name):
    """Each corpus model on CUDA in bf16 (aot_eager: the ops take their CUDA backends, the Triton
    kernels where auto chooses them, on the layouts these idioms hand them: sequence-first views,
    reordered heads, squeezed K): the parity verdict against the float64 oracle passes, and the
    passes match on CUDA what they match on the CPU in bf16 (not coverage.json's fp32 counts: a
    model that rounds to its dtype before the block choice, fused_qkv_per_head, is refused in bf16
    on purpose)."""
    wl = load_workload(spec(name))
    inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in wl.inputs)
    eager = wl.model.cuda()

    def optimize_fn(model):
        torch._dynamo.reset()
        return nsa_compile.optimize(model, nsa_compile.OptimizeConfig(compiler="aot_eager"))

    report = check_parity(eager, optimize_fn, inputs, torch.bfloat16, is_lm=False)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert bf16_matches(wl, "cuda") == bf16_matches(wl, "cpu")


# Corpus models whose own code fixes the length in the graph Dynamo compiles after it changed, so
# that each length compiles a static graph: a Python loop over query chunks (chunked_queries), a
# size used as a tensor value (where_bias_spellings: torch.where(picked, order, key.shape[-1])),
# documents that are constants of the model (xunhaolai_varlen: its doc_lens change with S).
STATIC_PER_LENGTH = {"chunked_queries.py", "where_bias_spellings.py", "xunhaolai_varlen.py"}
# rewrites refused in a graph with symbolic sizes, by design, with the reason's start: nsa_vibe's
# non-causal choice builds its block map from Python lists at the traced size (passes/noncausal_choice.py)
SYMBOLIC_REFUSED = {"nsa_vibe_noncausal.py": {"select_blocks": "symbolic sizes (dynamic shapes): a non-causal choice"}}


def test_changing_lengths_keep_the_rewrites_of_coverage_json(corpus_run):
    """The model compiled at its length S (static), then run at S + 1 (Dynamo compiles again with S a
    symbol, where the passes check their candidates at probe sizes) and S + 15: every graph compiled
    rewrites what coverage.json says, pass by pass, and the output and every gradient match eager's
    at each length. xunhaolai_varlen's documents grow with S (the last one)."""
    if corpus_run["error"] is not None:
        raise corpus_run["error"]
    name, wl, optimized = corpus_run["name"], corpus_run["workload"], corpus_run["optimized"]
    x = wl.inputs[0]
    documents = getattr(wl.model, "doc_lens", None)
    try:
        for S in (x.shape[1] + 1, x.shape[1] + 15):
            if documents is not None:
                wl.model.doc_lens = optimized.doc_lens = (*documents[:-1], S - sum(documents[:-1]))
            xi = torch.randn(x.shape[0], S, *x.shape[2:], generator=torch.Generator().manual_seed(S))
            (eager_out, eager_grads), (opt_out, opt_grads) = (forward_backward(m, (xi,)) for m in (wl.model, optimized))
            torch.testing.assert_close(opt_out, eager_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"S={S}: {m}")
            for key, grad in eager_grads.items():
                torch.testing.assert_close(opt_grads[key], grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, k=key: f"S={S}, grad {k}: {m}")
    finally:
        if documents is not None:
            wl.model.doc_lens = optimized.doc_lens = documents
    graphs = nsa_compile.api.state_of(optimized).graphs
    for i, record in enumerate(graphs):
        want = dict(COVERAGE[name])
        if "torch.SymInt" in record.code_before:
            for pass_name, why in SYMBOLIC_REFUSED.get(name, {}).items():
                want[pass_name] = 0
                (log,) = [log for log in record.logs if log.pass_name == pass_name]
                assert any(why in r.reason for r in log.refusals), [r.reason for r in log.refusals]
        assert {log.pass_name: len(log.matches) for log in record.logs} == want, f"graph {i} of {len(graphs)}"
    symbolic = ["torch.SymInt" in record.code_before for record in graphs[1:]]
    assert any(symbolic) == (name not in STATIC_PER_LENGTH), symbolic
