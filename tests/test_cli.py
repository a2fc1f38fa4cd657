"""The nsa-compile command line: every command, its outputs, and the errors a user can hit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import networkx as nx
import pytest
import torch
from click.testing import CliRunner

import nsa_compile
from nsa_compile.cli import cli, main, resolve_dtype
from nsa_compile.fx import op_name
from nsa_compile.models import build_model

HERE = Path(__file__).parent
USER_FILE = str(HERE / "user_models" / "gqa_block.py")


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def run_main(args, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
    return done.value.code, capsys.readouterr()


def without_timings(text: str) -> str:
    """The explain output without the pass table's last (time) column, the only part that varies."""
    lines = [ln.rsplit("|", 2)[0] + "|" if ln.count("|") == 8 else ln for ln in text.splitlines()]
    return "\n".join(lines) + "\n"


def test_explain_table_matches_the_golden_file():
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40")
    assert result.exit_code == 0, result.output
    golden = (HERE / "golden" / "explain_tiny.txt").read_text()
    assert without_timings(result.output) == golden


def test_explain_json_has_passes_near_misses_and_breaks():
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    by_name = {p["name"]: p for p in data["passes"]}
    assert tuple(p["name"] for p in data["passes"]) == nsa_compile.pass_names()
    # every NSA structure of both layers is rewritten; no K/V copy is left for the GQA pass
    assert {name: p["matches"] for name, p in by_name.items()} == {
        "projections_rope": 2, "window_attention": 2, "compressed_attention": 2, "block_selection": 2,
        "selection_attention": 2, "gated_combine": 2, "gqa_grouped_matmul": 0}
    assert by_name["block_selection"]["where"] == ["blocks.0.attn", "blocks.1.attn"]
    # per layer: the compressed, selected and gate softmaxes (window pass); the selected and gate
    # softmaxes (compressed pass); the gate softmax (selection pass)
    misses = [m["pass"] for m in data["near_misses"]]
    assert (misses.count("window_attention"), misses.count("compressed_attention"),
            misses.count("selection_attention"), len(misses)) == (6, 4, 2, 12)
    assert {m["where"] for m in data["near_misses"]} == {"blocks.0.attn", "blocks.1.attn"}
    assert data["graph_breaks"] == []


def test_explain_dense_twin_has_nothing_to_rewrite():
    data = json.loads(invoke("explain", "--model", "tiny-dense", "--device", "cpu", "--seq-len", "20",
                             "--format", "json").output)
    # no attention rewrite; the dense layer's q, k, v projections do become one GEMM (+ RoPE)
    assert {p["name"]: p["matches"] for p in data["passes"]} == {name: 2 if name == "projections_rope" else 0
                                                                 for name in nsa_compile.pass_names()}
    assert data["near_misses"] == []


def test_explain_a_user_file_shows_its_graph_break_with_the_source_line():
    result = invoke("explain", "--model", f"{USER_FILE}:make_breaking", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "2 graph(s) compiled" in result.output
    assert f"{USER_FILE}:33" in result.output and "if x.sum() > 0:" in result.output
    data = json.loads(invoke("explain", "--model", f"{USER_FILE}:make", "--pass", "window_attention",
                             "--format", "json").output)
    assert data["passes"][0]["name"] == "window_attention" and data["passes"][0]["matches"] == 1
    assert data["graph_breaks"] == []


def test_graph_breaks_runs_the_model_without_grad(monkeypatch):
    """Dynamo's explain executes the captured graphs for real: with grad the eager seed model kept
    every layer's gathered K/V for a backward that never comes (killed at 24 GB at S 512 on the
    CPU); without grad each layer's intermediates are freed as it goes."""
    from types import SimpleNamespace

    from nsa_compile.cli import graph_breaks

    seen = []

    def recording_explain(model):
        def run(*inputs):
            seen.append(torch.is_grad_enabled())
            return SimpleNamespace(break_reasons=[])
        return run

    monkeypatch.setattr(torch._dynamo, "explain", recording_explain)
    assert graph_breaks(torch.nn.Linear(2, 2), (torch.randn(1, 2),)) == []
    assert seen == [False] and torch.is_grad_enabled()


def test_explain_package_module_spec():
    data = json.loads(invoke("explain", "--model", "user_models.gqa_block:make", "--pass", "window_attention",
                             "--format", "json").output)
    assert data["passes"][0]["matches"] == 1


def test_explain_diff_shows_source_gone_and_target_added():
    result = invoke("explain", "--model", f"{USER_FILE}:make", "--pass", "window_attention", "--diff")
    assert result.exit_code == 0, result.output
    assert "# graph_0_window_attention.diff" in result.output
    removed = [ln for ln in result.output.splitlines() if ln.startswith("-") and "repeat_interleave" in ln]
    added = [ln for ln in result.output.splitlines() if ln.startswith("+") and "nsa.window_attention(" in ln]
    assert len(removed) == 2 and len(added) == 1


def test_explain_exports_dot_and_graphml_with_rewritten_nodes_marked(tmp_path):
    # the window rewrite alone (projections_rope also fuses this model's K and V projections)
    dot = invoke("explain", "--model", f"{USER_FILE}:make", "--pass", "window_attention", "--format", "dot").output
    assert dot.startswith('digraph "graph_0"') and 'fillcolor="#ffd27f"' in dot
    result = invoke("explain", "--model", f"{USER_FILE}:make", "--pass", "window_attention", "--out", str(tmp_path))
    assert "wrote 6 file(s)" in result.output
    backward = (tmp_path / "graph_0_aten_backward.py").read_text()
    assert "nsa.window_attention_backward" in backward and "repeat_interleave" not in backward
    g = nx.read_graphml(tmp_path / "graph_0.graphml")
    rewritten = [d["target"] for n, d in g.nodes(data=True) if d["rewritten"]]
    # the op (o, lse) and the getitem that takes o
    assert len(rewritten) == 2 and "window_attention" in rewritten[0] and "getitem" in rewritten[1], rewritten
    assert not any("repeat_interleave" in d["target"] for _, d in g.nodes(data=True))
    assert json.loads((tmp_path / "explain.json").read_text())["passes"][0]["matches"] == 1
    assert (tmp_path / "graph_0_window_attention.diff").read_text().startswith("--- graph 0 before")


def test_explain_single_pass():
    data = json.loads(invoke("explain", "--model", f"{USER_FILE}:make", "--pass", "gqa_grouped_matmul",
                             "--format", "json").output)
    assert [p["name"] for p in data["passes"]] == ["gqa_grouped_matmul"]
    assert data["passes"][0]["matches"] == 2  # alone, it takes both K/V copies


def test_parity_passes_and_prints_every_tensor():
    result = invoke("parity", "--model", "tiny", "--device", "cpu", "--dtypes", "fp32", "--seq-len", "40",
                    "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "tiny fp32 on cpu: PASS" in result.output
    n_params = len(list(build_model("tiny").parameters()))
    assert result.output.count("| ok |") == 2 + n_params  # output, loss, every parameter


def test_packed_documents_explain_and_parity():
    """--documents packs every row with documents of these lengths: the attention passes all fire
    with the positions (their kernel text says so), and parity passes on the packed model."""
    args = ("--model", "tiny", "--device", "cpu", "--seq-len", "70", "--documents", "13,1,50,6")
    result = invoke("explain", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["documents"] == "13,1,50,6"
    by_name = {p["name"]: p for p in data["passes"]}
    for name in ("window_attention", "compressed_attention", "block_selection", "selection_attention"):
        assert by_name[name]["matches"] == 2 and all("(pos)" in k for k in by_name[name]["kernels"]), by_name[name]
    result = invoke("parity", *args, "--dtypes", "fp32", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "tiny fp32 on cpu: PASS" in result.output


@pytest.mark.parametrize("documents, model, message", [
    ("13,1", "tiny", "must be positive and sum to the sequence length 70"),
    ("70,0", "tiny", "must be positive"),
    ("a,b", "tiny", "comma-separated lengths"),
    ("70", "tiny-dense", "need an NSA model"),
    ("70", f"{USER_FILE}:make", "apply to the presets"),
])
def test_packed_documents_bad_lengths_are_refused(documents, model, message):
    result = invoke("parity", "--model", model, "--device", "cpu", "--seq-len", "70", "--documents", documents)
    assert result.exit_code == 2 and message in result.output, result.output


def test_parity_of_a_user_model():
    result = invoke("parity", "--model", f"{USER_FILE}:make", "--dtypes", "fp32,bf16", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert result.output.count("PASS") == 2


class BreaksNumbers(nsa_compile.RewritePass):
    """A wrong rewrite: scales the input of every linear layer by 1.1."""

    name = "user_breaks_numbers"
    summary = "a deliberately wrong rewrite, to prove parity catches it"

    def apply(self, graph, log):
        for node in list(graph.nodes):
            if op_name(node) == "linear":
                with graph.inserting_before(node):
                    scaled = graph.call_function(torch.mul, (node.args[0], 1.1))
                node.replace_input_with(node.args[0], scaled)
                log.matched(node, "wrong")


@pytest.fixture
def wrong_pass():
    nsa_compile.register_pass(BreaksNumbers())
    yield
    nsa_compile.unregister_pass("user_breaks_numbers")


def test_parity_fails_with_exit_1_on_a_wrong_rewrite(wrong_pass):
    result = invoke("parity", "--model", f"{USER_FILE}:make", "--dtypes", "fp32", "--compiler", "aot_eager")
    assert result.exit_code == 1
    assert "FAIL" in result.output


def test_bench_runs_side_by_side():
    result = invoke("bench", "--model", "tiny", "--device", "cpu", "--seq-len", "40", "--steps", "1",
                    "--variants", "eager,optimize", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "parity (float32, seq-len 40) PASS" in result.output
    assert re.search(r"\| optimize \|\s+[\d,]+ \|.*\|\s+[\d.]+x\s+\|", result.output), result.output
    # the rewrites the timed model ran with (a refused branch would run as eager code)
    assert ("optimize ran with: projections_rope 2, window_attention 2 (refused 6), compressed_attention 2 "
            "(refused 4), block_selection 2, selection_attention 2 (refused 2), gated_combine 2, "
            "gqa_grouped_matmul 0") in result.output, result.output


def test_bench_refuses_speedups_when_parity_fails(wrong_pass):
    result = invoke("bench", "--model", f"{USER_FILE}:make", "--device", "cpu", "--steps", "1",
                    "--variants", "eager,optimize", "--compiler", "aot_eager")
    assert "parity (float32, seq-len 256) FAIL" in result.output
    assert result.output.count("n/a (parity failed)") == 2
    assert not re.search(r"\d\.\d\dx", result.output)


def test_demo_runs_end_to_end_on_cpu():
    result = invoke("demo", "--device", "cpu", "--seq-len", "40", "--steps", "1", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "nsa_compile demo: tiny on cpu" in result.output
    assert "PASS" in result.output
    for name in ("projections_rope", "window_attention", "compressed_attention", "block_selection",
                 "selection_attention", "gated_combine"):
        assert re.search(rf"\| {name} +\| +2 \|", result.output), (name, result.output)
    assert "| optimize |" in result.output and "| eager    |" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["explain", "--model", "huge"], "error: unknown model preset 'huge'; valid:"),
        (["explain", "--model", "missing.py:make"], "error: missing.py:make: no such file missing.py"),
        (["explain", "--model", "no_such_package_xyz:make"], "error: no_such_package_xyz:make: cannot import"),
        (["explain", "--model", f"{USER_FILE}:nothing"], f"error: {USER_FILE}:nothing: "),
        (["explain", "--model", f"{USER_FILE}:not_a_module"], "error: "),
        (["explain", "--model", f"{USER_FILE}:raises"], "error: "),
        (["explain", "--model", f"{USER_FILE}:module_only"], "error: "),
        (["explain", "--pass", "bogus"],
         "error: unknown pass 'bogus'; valid: projections_rope, window_attention, compressed_attention, "
         "block_selection, selection_attention, gated_combine, gqa_grouped_matmul"),
        (["parity", "--dtypes", "fp8", "--device", "cpu"], "error: unknown dtype(s) fp8; valid: fp32, bf16, fp16"),
        (["bench", "--variants", "eager,jit"], "error: unknown variant(s) jit; valid:"),
        (["explain", "--seq-len", "0"], "error: --batch and --seq-len must be positive"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(args, message, capsys):
    code, captured = run_main(args, capsys)
    assert code == 2
    assert captured.err.startswith(message), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "factory, says",
    [("nothing", "has no callable named 'nothing'"), ("not_a_module", "returned str, not an nn.Module"),
     ("raises", "the factory raised RuntimeError: weights not found"),
     ("module_only", "returned no example inputs; return (module, inputs)")],
)
def test_model_spec_errors_say_what_is_wrong(factory, says, capsys):
    code, captured = run_main(["explain", "--model", f"{USER_FILE}:{factory}"], capsys)
    assert code == 2 and says in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    code, captured = run_main(["explain", "--device", "cuda"], capsys)
    assert code == 2
    assert captured.err == "error: --device cuda was asked for, but no CUDA GPU is available\n"


def test_a_dtype_the_device_cannot_run_is_a_clear_error(monkeypatch):
    def no_half(x, dim):
        raise RuntimeError('"softmax_lastdim_kernel_impl" not implemented for \'Half\'')

    monkeypatch.setattr(torch, "softmax", no_half)
    with pytest.raises(Exception, match="cpu cannot run fp16: .*not implemented for 'Half'"):
        resolve_dtype("fp16", torch.device("cpu"))


def test_debug_flag_shows_the_exception():
    with pytest.raises(Exception, match="unknown model preset"):
        main(["--debug", "explain", "--model", "huge"])
