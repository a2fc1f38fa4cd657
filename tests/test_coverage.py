"""Coverage (nsa_compile/coverage.py): NSA branches rewritten / detected per layer, read from the
graph after the passes; strict mode; explain's coverage and skipped frames; crash isolation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from click.testing import CliRunner
from helpers import FAST, optimize_fresh, tokens

from nsa_compile.api import state_of
from nsa_compile.cli import cli
from nsa_compile.coverage import Branch, Coverage, CoverageError, coverage_of, graph_branches, shown_path
from nsa_compile.explain import coverage_line
from nsa_compile.isolation import EXIT_CRASHED, crash_line
from nsa_compile.models import build_model
from nsa_compile.models import nsa as nsa_model
from nsa_compile.rewrite import PassLog

HERE = Path(__file__).parent
REPO = HERE.parent
LAYERS = ["blocks.0.attn", "blocks.1.attn"]
ALL_FIVE = ["compressed", "block selection", "selected", "window", "gate"]  # graph order in models/nsa.py


def nsa_line(code: str) -> str:
    """'models/nsa.py:N' (as coverage shows the path) of the one line of the reference model that
    holds `code` (the node's source)."""
    lines = Path(nsa_model.__file__).read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if code in line]
    return f"{shown_path(nsa_model.__file__)}:{number}"


WINDOW_SOFTMAX = "p = torch.softmax(scores.masked_fill(~in_window"
COMPRESSED_SOFTMAX = "p = torch.softmax(scores.masked_fill(~has_block"
BLOCK_SORT = "values, order = torch.sort(key"
GATE_SOFTMAX = "g = torch.softmax(self.gate(q_bar)"


def tiny_coverage(config=FAST, seq: int = 40) -> Coverage:
    model = optimize_fresh(build_model("tiny"), config)
    model.loss(tokens(1, seq)).backward()
    return coverage_of(state_of(model))


def per_layer(cov: Coverage) -> dict[str, tuple[int, int]]:
    return {layer.where: (layer.rewritten, layer.detected) for layer in cov.layers}


# --- the tiny preset, whole and with a pass switched off --------------------------------------------


def test_tiny_preset_has_every_branch_of_every_layer_rewritten(monkeypatch):
    monkeypatch.chdir(REPO)  # source lines are shown relative to the working directory
    cov = tiny_coverage()
    assert per_layer(cov) == {"blocks.0.attn": (5, 5), "blocks.1.attn": (5, 5)}
    assert [[b.kind for b in layer.branches] for layer in cov.layers] == [ALL_FIVE, ALL_FIVE]
    assert cov.eager == [] and cov.summary() == "10/10 NSA branches rewritten (blocks.0.attn 5/5, blocks.1.attn 5/5)"
    # each rewritten op keeps a source line of the code it replaced
    window = [b for b in cov.branches if b.kind == "window"]
    assert [b.op for b in window] == ["nsa.window_attention"] * 2
    first, last = (int(nsa_line(code).rsplit(":", 1)[1]) for code in ("def window_attention", "def gates"))
    for b in window:
        path, line = b.source.rsplit(":", 1)
        assert path == shown_path(nsa_model.__file__) and first < int(line) < last


@pytest.mark.parametrize("disabled, left, kinds", [
    ("window_attention", 4, {"attention": WINDOW_SOFTMAX}),
    ("gated_combine", 4, {"gate": GATE_SOFTMAX}),
    # block selection reads the compressed op's lse: without it the ranking stays eager too
    ("compressed_attention", 3, {"attention": COMPRESSED_SOFTMAX, "block selection": BLOCK_SORT}),
])
def test_a_switched_off_pass_leaves_its_branch_eager_with_its_source_line(disabled, left, kinds, monkeypatch):
    monkeypatch.chdir(REPO)
    cov = tiny_coverage(FAST.replace(disabled_passes=(disabled,)))
    assert per_layer(cov) == {"blocks.0.attn": (left, 5), "blocks.1.attn": (left, 5)}
    eager = cov.eager
    assert [b.where for b in eager] == [w for w in LAYERS for _ in kinds]
    for b in eager:
        assert b.source == nsa_line(kinds[b.kind]) and kinds[b.kind] in b.code
        assert not b.rewritten and b.op in ("softmax", "sort")
    off = [b for b in eager if (disabled, "switched off (OptimizeConfig.disabled_passes)") in b.reasons]
    assert len(off) == 2  # one per layer: the branch of the switched-off pass
    if disabled == "compressed_attention":
        (sort_reasons,) = {b.reasons for b in eager if b.kind == "block selection"}
        assert [p for p, _ in sort_reasons] == ["select_blocks"]
        assert "compressed_attention did not rewrite these probabilities" in sort_reasons[0][1]
    if disabled == "gated_combine":  # the attention passes' "not mine" refusals of the gate are not its reasons
        assert {p for b in eager for p, _ in b.reasons} == {"gated_combine"}


def test_a_recompile_replaces_the_frames_graphs_in_the_coverage():
    """A new shape recompiles the frame; the coverage is what runs now, not the sum of both."""
    model = optimize_fresh(build_model("tiny"), FAST.replace(dynamic=False))
    model.loss(tokens(1, 40)).backward()
    model.loss(tokens(1, 48)).backward()
    state = state_of(model)
    assert len(state.graphs) == 2 and {g.frame_compile for g in state.graphs} == {0, 1}
    assert per_layer(coverage_of(state)) == {"blocks.0.attn": (5, 5), "blocks.1.attn": (5, 5)}


# --- reading a graph, independent of the passes ----------------------------------------------------------


class Spellings(torch.nn.Module):
    """An attention softmax (product upstream), a gate softmax (Linear upstream), SDPA, a top-k, a
    sort of scores and a sort of integer ids (not a ranking)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(4, 3)

    def forward(self, q, k, ids):  # q, k [2, 5, 4]; ids [5]
        p = (q @ k.transpose(-1, -2)).masked_fill(ids > 3, float("-inf")).softmax(-1)
        g = torch.nn.functional.softmax(self.gate(q), dim=-1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, k)
        top = torch.topk(p, 2, dim=-1).indices
        ranked = torch.sort(p, dim=-1, descending=True).indices
        ordered = torch.sort(ids).values
        return p, g, o, top, ranked, ordered


def dynamo_graph(module: torch.nn.Module, *inputs) -> fx.GraphModule:
    """The graph Dynamo captures of module(*inputs), with its metadata (values, stack traces)."""
    captured = []

    def keep(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=keep, fullgraph=True)(*inputs)
    (gm,) = captured
    return gm


def spellings_graph() -> fx.GraphModule:
    return dynamo_graph(Spellings(), torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.arange(5))


def test_eager_branches_are_every_softmax_sdpa_and_ranking_left(monkeypatch):
    monkeypatch.chdir(REPO)
    found = graph_branches(spellings_graph().graph, 0)
    assert [(b.kind, b.op, b.rewritten) for b in found] == [
        ("attention", "softmax", False), ("gate", "softmax", False),
        ("attention", "scaled_dot_product_attention", False),
        ("block selection", "topk", False), ("block selection", "sort", False)]
    lines = Path(__file__).read_text().splitlines()
    assert [b.source for b in found] == [
        f"tests/test_coverage.py:{next(i + 1 for i, line in enumerate(lines) if line.strip().startswith(code))}"
        for code in ("p = (q @ k", "g = torch.nn", "o = torch.nn", "top = ", "ranked = ")]
    assert found[0].code.startswith("p = (q @ k.transpose(-1, -2))")


def test_nsa_ops_are_rewritten_branches_and_the_projection_op_is_not():
    import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa)

    graph = fx.Graph()
    x = graph.placeholder("x")
    window = graph.call_function(torch.ops.nsa.window_attention.default, (x, x, x, 4, 1.0, "reference"))
    graph.call_function(torch.ops.nsa.projection_rope, (x,))
    graph.output(window)
    (branch,) = graph_branches(graph, 3)
    assert (branch.graph, branch.kind, branch.op, branch.rewritten) == (3, "window", "nsa.window_attention", True)


def test_reasons_are_the_refusals_at_the_node_and_the_gates_at_its_layer():
    gm = spellings_graph()
    names = {n.name: n for n in gm.graph.nodes}
    attention = next(n for n in names.values() if n.op == "call_method" and n.target == "softmax")
    gate = next(n for n in names.values() if n.op == "call_function" and getattr(n.target, "__name__", "") == "softmax")
    window, combine, canon = PassLog("window_attention", 0), PassLog("gated_combine", 0), PassLog("canonicalize", 0)
    window.refused(attention, "the mask is not a window")
    window.refused(gate, "the probabilities are not multiplied by V (p @ v)")  # another kind's pass: not a reason
    canon.refused(gate, "a cast down")
    combine.refused(gm.graph.find_nodes(op="output")[0], "the gated sum has 2 terms")  # anchored elsewhere in the layer
    logs = [canon, window, combine]
    found = {b.node: b for b in graph_branches(gm.graph, 0, logs, disabled=("selected_attention",))}
    assert found[attention.name].reasons == (("selected_attention", "switched off (OptimizeConfig.disabled_passes)"),
                                             ("window_attention", "the mask is not a window"))
    assert found[gate.name].reasons == (("canonicalize", "a cast down"), ("gated_combine", "the gated sum has 2 terms"))


def test_the_coverage_line_names_each_eager_branch_and_its_source():
    branches = [Branch(0, "blocks.0.attn", "window", True, "w", "nsa.window_attention"),
                Branch(0, "blocks.0.attn", "attention", False, "p", "softmax", "m.py:7", "p = x.softmax(-1)",
                       (("window_attention", "no"),))]
    cov = Coverage(branches)
    assert coverage_line(cov) == ("coverage: 1/2 NSA branches rewritten (blocks.0.attn 1/2); left eager: "
                                  "blocks.0.attn attention (softmax) (m.py:7) (why: nsa-compile explain)")
    assert cov.layer_rows() == [["blocks.0.attn", "1/2", "window", "attention (softmax)"]]
    assert cov.eager_rows() == [["blocks.0.attn", "attention (softmax)", "m.py:7", "p = x.softmax(-1)",
                                 "window_attention: no"]]


# --- strict mode -----------------------------------------------------------------------------------------


def test_strict_mode_lets_a_fully_rewritten_model_train():
    model = optimize_fresh(build_model("tiny"), FAST.replace(strict=True))
    model.loss(tokens(1, 40)).backward()
    assert per_layer(coverage_of(state_of(model))) == {"blocks.0.attn": (5, 5), "blocks.1.attn": (5, 5)}


def test_strict_mode_raises_at_the_first_compile_with_the_coverage_table(monkeypatch):
    monkeypatch.chdir(REPO)
    model = optimize_fresh(build_model("tiny"), FAST.replace(strict=True, disabled_passes=("window_attention",)))
    with pytest.raises(Exception) as raised:
        model.loss(tokens(1, 40))
    chain, err = [], raised.value
    while err is not None:
        chain.append(err)
        err = getattr(err, "inner_exception", None) or err.__cause__
    (strict,) = [e for e in chain if isinstance(e, CoverageError)]
    text = str(strict)
    assert text.startswith("OptimizeConfig(strict=True): 2 of 10 NSA branches detected in graph 0 stay eager")
    for layer in LAYERS:
        assert re.search(rf"\| {re.escape(layer)} +\| 4/5 +\|", text), text
    assert text.count(nsa_line(WINDOW_SOFTMAX)) == 2
    assert text.count("window_attention: switched off (OptimizeConfig.disabled_passes)") == 2
    assert state_of(model).graphs == []  # the failed compile is not reported as compiled


def test_strict_is_a_checked_bool_outside_the_cache_key():
    with pytest.raises(TypeError, match="strict must be a bool, not str"):
        FAST.replace(strict="yes")
    assert FAST.replace(strict=True).cache_key() == FAST.cache_key()


# --- explain -----------------------------------------------------------------------------------------------


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_explain_json_has_the_coverage_per_layer_and_each_eager_branch(monkeypatch):
    monkeypatch.chdir(REPO)
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40", "--format", "json",
                    "--pass", "window_attention")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    cov = data["coverage"]
    assert (cov["rewritten"], cov["detected"]) == (2, 10) and data["skipped_frames"] == []
    assert cov["layers"] == [{"where": w, "rewritten": 1, "detected": 5,
                              "branches": ["attention (softmax)", "block selection (sort)", "attention (softmax)",
                                           "window", "gate (softmax)"]} for w in LAYERS]
    assert [(e["where"], e["kind"], e["op"], e["source"]) for e in cov["eager"]] == [
        (w, kind, op, nsa_line(code)) for w in LAYERS for kind, op, code in (
            ("attention", "softmax", COMPRESSED_SOFTMAX), ("block selection", "sort", BLOCK_SORT),
            ("attention", "softmax", "p = torch.softmax(scores, dim=-1)"), ("gate", "softmax", GATE_SOFTMAX))]
    first = cov["eager"][0]
    assert set(first) == {"graph", "where", "kind", "rewritten", "node", "op", "source", "code", "reasons"}
    assert first["rewritten"] is False and first["code"].startswith(COMPRESSED_SOFTMAX)
    switched_off = {"pass": "compressed_attention", "reason": "switched off (OptimizeConfig.disabled_passes)"}
    assert switched_off in first["reasons"]


def test_explain_table_ends_with_the_coverage():
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40")
    assert result.exit_code == 0, result.output
    tail = result.output.split("\ncoverage: ", 1)[1].splitlines()
    assert tail[0] == "10/10 NSA branches rewritten (blocks.0.attn 5/5, blocks.1.attn 5/5)"
    assert [[cell.strip() for cell in row.split("|")[1:3]] for row in tail[3:]] == [[w, "5/5"] for w in LAYERS]


def test_explain_lists_a_frame_dynamo_skipped_whole_with_its_source_line(monkeypatch):
    monkeypatch.chdir(REPO)
    spec = "tests/user_models/loop_break.py:make"
    lines = (REPO / "tests" / "user_models" / "loop_break.py").read_text().splitlines()
    branch = next(i + 1 for i, line in enumerate(lines) if "if row.abs().sum() > 0:" in line)
    forward = next(i + 1 for i, line in enumerate(lines) if "def forward" in line)
    data = json.loads(invoke("explain", "--model", spec, "--device", "cpu", "--format", "json").output)
    assert data["skipped_frames"] == [{
        "function": "forward", "frame": f"tests/user_models/loop_break.py:{forward}",
        "source": f"tests/user_models/loop_break.py:{branch}",
        "line": "if row.abs().sum() > 0:  # data-dependent branch inside the loop",
        "reason": "Data-dependent branching, inside a loop: Dynamo runs the whole function eagerly"}]
    assert data["graphs"] == 0 and data["coverage"]["detected"] == 0
    text = invoke("explain", "--model", spec, "--device", "cpu").output
    assert "frames Dynamo skipped whole (1)" in text and "no graph breaks" not in text


def test_bench_prints_the_coverage_line():
    result = invoke("bench", "--model", "tiny", "--device", "cpu", "--seq-len", "24", "--steps", "1",
                    "--variants", "optimize", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "coverage: 10/10 NSA branches rewritten (blocks.0.attn 5/5, blocks.1.attn 5/5)" in result.output.splitlines()


# --- crash isolation -------------------------------------------------------------------------------------


def run_cli(*args) -> subprocess.CompletedProcess:
    """The nsa-compile program itself (its entry point isolates explain and parity)."""
    return subprocess.run([sys.executable, "-m", "nsa_compile", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("command, factory, signal_name", [
    ("explain", "make_abort", "SIGABRT (signal 6)"),
    ("parity", "make_segfault", "SIGSEGV (signal 11)"),
])
def test_a_crash_of_the_compiled_model_is_one_line_and_exit_4(command, factory, signal_name):
    lines = (REPO / "tests" / "user_models" / "crashing.py").read_text().splitlines()
    call = "os.abort()" if factory == "make_abort" else "ctypes.string_at(0)"
    crash = next(i + 1 for i, line in enumerate(lines) if line.strip().startswith(call))
    extra = ("--dtypes", "fp32") if command == "parity" else ()
    done = run_cli(command, "--model", f"tests/user_models/crashing.py:{factory}", "--device", "cpu", *extra)
    assert done.returncode == EXIT_CRASHED == 4
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {command} crashed: the process running it died of {signal_name} in "
                                  f"tests/user_models/crashing.py:{crash} (forward); ")


def test_the_isolated_program_passes_output_and_status_through():
    done = run_cli("explain", "--model", "tests/user_models/gqa_block.py:make", "--pass", "window_attention",
                   "--device", "cpu", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["coverage"]["layers"] == [
        {"where": "<top>", "rewritten": 1, "detected": 1, "branches": ["window"]}]
    done = run_cli("explain", "--model", "no_such_preset")
    assert done.returncode == 2 and done.stderr.startswith("error: unknown model preset 'no_such_preset'")


FAULTHANDLER = """free(): invalid pointer
Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f0000000000 (most recent call first):
  File "{torch}/_functorch/_aot_autograd/runtime_wrappers.py", line 99 in call_func_at_runtime_with_args
  File "{user}", line 12 in forward
  File "{torch}/nn/modules/module.py", line 1773 in _call_impl

Extension modules: torch._C (total: 1)
"""


def test_the_crash_line_names_the_signal_the_users_frame_and_a_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dump = FAULTHANDLER.format(torch=Path(torch.__file__).parent, user=tmp_path / "model.py")
    assert crash_line("parity", 6, dump) == (
        "error: parity crashed: the process running it died of SIGABRT (signal 6) in model.py:12 (forward); "
        "try --compiler aot_eager (no Inductor-generated code), then --compiler eager (--debug shows its output)")
    assert crash_line("explain", 9, "").startswith("error: explain crashed: the process running it died of SIGKILL "
                                                   "(signal 9); the system's out-of-memory killer")
