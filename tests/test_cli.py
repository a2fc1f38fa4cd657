"""The nsa-compile command line: every command, its outputs, and the errors a user can hit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import networkx as nx
import pytest
import torch
from click.testing import CliRunner

import nsa_compile
from nsa_compile.cli import cli, main, resolve_dtype
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


@pytest.fixture(scope="module")
def tiny_explained(tmp_path_factory):
    """One `explain` of the tiny preset at seq-len 40, with --out: (the table it printed, the
    folder with explain.json, the same data --format json prints). Two tests read it."""
    folder = tmp_path_factory.mktemp("explained")
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40", "--out", str(folder))
    assert result.exit_code == 0, result.output
    return result.output, folder


def test_explain_table_matches_the_golden_file(tiny_explained):
    output, folder = tiny_explained
    table, wrote = output.rstrip("\n").rsplit("\n", 1)
    assert re.fullmatch(rf"wrote \d+ file\(s\) to {re.escape(str(folder))}", wrote), wrote
    golden = (HERE / "golden" / "explain_tiny.txt").read_text()
    assert without_timings(table.rstrip("\n") + "\n") == golden


def test_explain_json_has_passes_near_misses_and_breaks(tiny_explained):
    data = json.loads((tiny_explained[1] / "explain.json").read_text())
    by_name = {p["name"]: p for p in data["passes"]}
    assert tuple(p["name"] for p in data["passes"]) == nsa_compile.pass_names()
    # every NSA structure of both layers is rewritten; no K/V copy is left for the GQA pass
    assert {name: p["matches"] for name, p in by_name.items()} == {
        "canonicalize": 0, "projection_rope": 2, "window_attention": 2, "compressed_attention": 2, "select_blocks": 2,
        "selected_attention": 2, "gated_combine": 2, "gqa_grouped_matmul": 0, "compress_pooling": 0, "query_chunks": 0}
    assert by_name["select_blocks"]["where"] == ["blocks.0.attn", "blocks.1.attn"]
    # per layer: the compressed, selected and gate softmaxes (window pass); the selected and gate
    # softmaxes (compressed pass); the gate softmax (selection pass)
    misses = [m["pass"] for m in data["near_misses"]]
    assert (misses.count("window_attention"), misses.count("compressed_attention"),
            misses.count("selected_attention"), len(misses)) == (6, 4, 2, 12)
    assert {m["where"] for m in data["near_misses"]} == {"blocks.0.attn", "blocks.1.attn"}
    assert data["graph_breaks"] == []
    # the op registry as the default config sees it: every op, 'auto', its backends in auto's order
    from nsa_compile.ops import registry
    assert [(b["op"], b["asked"]) for b in data["backends"]] == [(op.name, "auto") for op in registry.ops()]
    window = next(b for b in data["backends"] if b["op"] == "window_attention")
    assert window["auto_order"] == ["triton", "flash", "reference"] and "flash" in window["not_deterministic"]


def test_explain_dense_twin_has_nothing_to_rewrite():
    data = json.loads(invoke("explain", "--model", "tiny-dense", "--device", "cpu", "--seq-len", "20",
                             "--format", "json").output)
    # no attention rewrite; the dense layer's q, k, v projections do become one GEMM (+ RoPE)
    assert {p["name"]: p["matches"] for p in data["passes"]} == {name: 2 if name == "projection_rope" else 0
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
    # the window rewrite alone (projection_rope also fuses this model's K and V projections)
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
    for name in ("window_attention", "compressed_attention", "select_blocks", "selected_attention"):
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
    assert ("optimize ran with: canonicalize 0, projection_rope 2, window_attention 2 (refused 6), compressed_attention 2 "
            "(refused 4), select_blocks 2, selected_attention 2 (refused 2), gated_combine 2, "
            "gqa_grouped_matmul 0") in result.output, result.output


def test_bench_refuses_speedups_when_parity_fails(wrong_pass):
    result = invoke("bench", "--model", f"{USER_FILE}:make", "--device", "cpu", "--steps", "1",
                    "--variants", "eager,optimize", "--compiler", "aot_eager")
    assert "parity (float32, its inputs) FAIL" in result.output
    assert "the factory's example inputs" in result.output and "seq-len" not in result.output
    assert result.exit_code == 1  # a failed verdict
    assert result.output.count("n/a (parity failed)") == 2
    assert not re.search(r"\d\.\d\dx", result.output)


def test_demo_runs_end_to_end_on_cpu():
    result = invoke("demo", "--device", "cpu", "--seq-len", "40", "--steps", "1", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "nsa_compile demo: tiny on cpu" in result.output
    assert "PASS" in result.output
    for name in ("projection_rope", "window_attention", "compressed_attention", "select_blocks",
                 "selected_attention", "gated_combine"):
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
         f"error: unknown pass 'bogus'; valid: {', '.join(nsa_compile.pass_names())}\n"),
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


def test_debug_flag_adds_the_traceback_and_keeps_the_status(capsys):
    code, captured = run_main(["--debug", "explain", "--model", "huge"], capsys)
    assert code == 2
    assert "Traceback" in captured.err and "ModelSpecError: unknown model preset 'huge'" in captured.err
    assert captured.err.splitlines()[-1].startswith("error: unknown model preset 'huge'; valid: ")


# --- hostile input at the command line: one line and the exit status the README's table gives ------

HOSTILE = str(HERE / "user_models" / "hostile.py")
SHOWN_HOSTILE = os.path.relpath(HOSTILE)  # user_frame shows paths below the working directory relative


def one_line_error(args, capsys, code=2, prefix="error: "):
    """Run main(args); assert the exit status and a single stderr line starting with prefix; return it."""
    status, captured = run_main(args, capsys)
    assert status == code, captured.err
    assert captured.err.startswith(prefix) and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


def source_line(name: str, text: str) -> int:
    """The line number of `text` in tests/user_models/<name>: the line an error must point at."""
    lines = (HERE / "user_models" / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


@pytest.mark.parametrize("factory, says", [
    ("inputs_a_string", "the factory's example inputs are str; return a tensor or a tuple of the forward's "
                        "positional inputs"),
    ("inputs_a_dict", "the factory's example inputs are dict"),
    ("integer_output", "the model returned int64 [2], with no floating-point tensor to take a loss of"),
    ("on_meta", "the model's parameters are on the meta device"),
    ("exits", "the factory raised SystemExit: 1 (at "),
])
def test_a_user_factory_returning_the_wrong_things_is_one_line(factory, says, capsys):
    for command in ("explain", "parity", "bench"):
        line = one_line_error([command, "--model", f"{HOSTILE}:{factory}", "--device", "cpu"], capsys)
        assert line.startswith(f"error: {HOSTILE}:{factory}: {says}"), line


@pytest.mark.parametrize("factory, raised, at", [
    ("wrong_shape", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (20x16 and 32x32)",
     "return self.proj(x).view(B, S, -1)"),
    ("wrong_dtype", "RuntimeError: mat1 and mat2 must have the same dtype", "return self.proj(x).view(B, S, -1)"),
    ("raises_in_forward", "ValueError: expected 8 features, got 4", 'raise ValueError(f"expected 8 features'),
])
def test_a_user_model_that_raises_names_the_users_file_and_line(factory, raised, at, capsys):
    """Before anything is compiled the model runs once eagerly on its example inputs: the error
    is the model's own, at the user's line (not a 43-line traceback from inside Dynamo)."""
    line = one_line_error(["explain", "--model", f"{HOSTILE}:{factory}", "--device", "cpu"], capsys)
    assert f"the model raised {raised}" in line, line
    assert f"(at {SHOWN_HOSTILE}:{source_line('hostile.py', at)} in forward: `{at}" in line, line


def test_debug_does_not_hide_where_the_users_code_raised(capsys):
    code, captured = run_main(["--debug", "explain", "--model", f"{HOSTILE}:raises_in_forward"], capsys)
    assert code == 2
    line = source_line("hostile.py", "raise ValueError(")
    assert f'File "{HOSTILE}", line {line}, in forward' in captured.err  # the user's frame in the traceback
    assert captured.err.splitlines()[-1].startswith(f"error: {HOSTILE}:raises_in_forward: on the factory's")


def test_a_syntax_error_in_the_users_file_names_its_line(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\ndef make(:\n    pass\n")
    line = one_line_error(["explain", "--model", f"{broken}:make"], capsys)
    assert line.startswith(f"error: {broken}:make: importing {broken} raised SyntaxError: ") and \
        f"(at {broken}:3)" in line, line


@pytest.mark.parametrize("args, message", [
    (["explain", "--model", ":make"], "error: :make: name a file or module before the ':'"),
    (["explain", "--model", ""], "error: unknown model preset ''"),
    (["explain", "--batch", "-1"], "error: --batch and --seq-len must be positive"),
    (["explain", "--bogus"], "error: No such option '--bogus'."),
    (["explain", "--dtype", "fp64"], "error: Invalid value for '--dtype': 'fp64' is not one of"),
    (["frobnicate"], "error: No such command 'frobnicate'. (nsa-compile --help)"),
    (["demo", "--steps", "0"], "error: --steps, --batch and --seq-len must be positive"),
    (["demo", "--seq-len", "0"], "error: --steps, --batch and --seq-len must be positive"),
    (["demo", "--batch", "-2"], "error: --steps, --batch and --seq-len must be positive"),
    (["bench", "--steps", "0"], "error: --steps must be at least 1"),
    (["bench", "--model", f"{HOSTILE}:projection", "--variants", "eager,dense", "--device", "cpu"],
     f"error: --variants dense: {HOSTILE}:projection has no dense twin"),
    (["bench", "--model", "tiny-dense", "--variants", "dense", "--device", "cpu"],
     "error: --variants dense: tiny-dense has no dense twin"),
    (["bench", "--model", f"{HOSTILE}:projection", "--seq-len", "64", "--device", "cpu"],
     f"error: --seq-len applies to the presets; {HOSTILE}:projection runs on its factory's example inputs"),
])
def test_more_mistakes_are_one_line_and_exit_2(args, message, capsys):
    """Each is refused before any parity run or compile (demo --steps 0 used to fail after 100 s)."""
    line = one_line_error(args, capsys)
    assert line.startswith(message), line


def test_an_existing_file_as_out_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    line = one_line_error(["explain", "--out", str(tmp_path / "taken")], capsys)
    assert "Invalid value for '--out'" in line and "is a file" in line, line


def test_explain_out_into_a_read_only_folder_is_refused_before_compiling(read_only_dir, monkeypatch, capsys):
    compiled = []
    monkeypatch.setattr("nsa_compile.cli.optimize", lambda *a, **k: compiled.append(a))
    line = one_line_error(["explain", "--out", str(read_only_dir / "explained")], capsys)
    assert line.startswith(f"error: --out {read_only_dir / 'explained'}: cannot write there: "), line
    assert compiled == []


def library_raiser(error: BaseException):
    """A function that raises `error` from a frame that is not the user's (as nsa_compile's or
    PyTorch's own code would): compiled under a '<...>' file name, which user_frame skips."""
    namespace = {"error": error}
    exec(compile("def raise_it(*args, **kwargs):\n    raise error\n", "<library>", "exec"), namespace)
    return namespace["raise_it"]


def test_an_internal_error_is_one_line_and_exit_3(monkeypatch, capsys):
    monkeypatch.setattr("nsa_compile.cli.get_workload", library_raiser(AssertionError("node has no meta 'val'")))
    line = one_line_error(["explain", "--seq-len", "20"], capsys, code=3, prefix="internal error: ")
    assert line == ("internal error: AssertionError: node has no meta 'val' (a bug in nsa-compile or PyTorch: "
                    "please report it; --debug shows the traceback)\n")
    code, captured = run_main(["--debug", "explain", "--seq-len", "20"], capsys)
    assert code == 3 and "Traceback" in captured.err and captured.err.splitlines()[-1].startswith("internal error")


def test_an_eof_error_is_not_mistaken_for_ctrl_c(monkeypatch, capsys):
    """click turns EOFError into Abort, as it does Ctrl-C: only a real KeyboardInterrupt exits 130
    (a 0-byte checkpoint used to print 'aborted' and exit 130)."""
    monkeypatch.setattr("nsa_compile.cli.get_workload", library_raiser(EOFError("Ran out of input")))
    line = one_line_error(["explain", "--seq-len", "20"], capsys, code=3, prefix="internal error: ")
    assert line.startswith("internal error: EOFError: Ran out of input"), line
    monkeypatch.setattr("nsa_compile.cli.get_workload", library_raiser(KeyboardInterrupt()))
    code, captured = run_main(["explain", "--seq-len", "20"], capsys)
    assert code == 130 and captured.err.endswith("aborted\n")


def test_out_of_memory_is_one_line_and_exit_2(monkeypatch, capsys):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr("nsa_compile.cli.get_workload", library_raiser(oom))
    line = one_line_error(["explain", "--seq-len", "20"], capsys)
    assert line == ("error: out of memory: CUDA out of memory. Tried to allocate 20.00 GiB (a smaller --batch "
                    "or --seq-len may fit)\n")


def test_an_error_in_the_users_code_after_the_first_run_names_its_line(monkeypatch, capsys):
    """An exception that reaches main from a frame of the user's code (here: this test file, which
    is not library code) is the user's: exit 2 with the file and line, not an internal error."""
    def users_code(*args, **kwargs):
        raise ValueError("my code failed")

    monkeypatch.setattr("nsa_compile.cli.get_workload", users_code)
    line = one_line_error(["explain", "--seq-len", "20"], capsys)
    at = f"{os.path.relpath(__file__)}:{users_code.__code__.co_firstlineno + 1} in users_code"
    source = 'raise ValueError("my code failed")'
    assert line == f"error: your code raised ValueError: my code failed (at {at}: `{source}`)\n"


def test_a_failed_compile_is_an_internal_error(capsys):
    """A compile that fails (Dynamo's BackendCompilerFailed: a pass or Inductor raised) is the
    compiler's failure: exit 3, naming the pass's error rather than Dynamo's wrapper, even though
    the raising pass lies outside the library (this test registers it, as a user could)."""
    class Fails(nsa_compile.RewritePass):
        name = "user_fails"
        summary = "raises on every graph"

        def apply(self, graph, ctx):
            raise RuntimeError("pass bug")

    nsa_compile.register_pass(Fails())
    try:
        line = one_line_error(["explain", "--model", f"{USER_FILE}:make", "--device", "cpu"], capsys,
                              code=3, prefix="internal error: ")
    finally:
        nsa_compile.unregister_pass("user_fails")
    assert line.startswith("internal error: RuntimeError: pass bug (at "), line


def test_our_code_failing_when_called_by_the_users_code_is_an_internal_error(monkeypatch, capsys):
    def users_code(*args, **kwargs):
        return nsa_compile.workload.loss_of(torch.nn.Identity(), (), False)  # ours raises inside

    monkeypatch.setattr("nsa_compile.cli.get_workload", users_code)
    line = one_line_error(["explain", "--seq-len", "20"], capsys, code=3, prefix="internal error: ")
    assert line.startswith("internal error: TypeError: "), line


def test_tokens_per_step_counts_batch_times_sequence_for_every_workload():
    """profile_step's tok/s: a preset trains on B * S tokens (its targets' column excluded), a
    user's [B, S, dim] module or one taking token ids [B, S] on B * S, a [B, dim] one on B rows."""
    from torch import nn

    from nsa_compile.workload import Workload

    assert Workload("tiny", nn.Identity(), (torch.zeros(3, 9, dtype=torch.long),), True).tokens_per_step == 24
    assert Workload("f.py:make", nn.Identity(), (torch.zeros(3, 8, 5),), False).tokens_per_step == 24
    assert Workload("f.py:make", nn.Identity(), (torch.zeros(3, 5, dtype=torch.long),), False).tokens_per_step == 15
    assert Workload("f.py:make", nn.Identity(), (torch.zeros(3, 5),), False).tokens_per_step == 3
    assert Workload("f.py:make", nn.Identity(), (torch.zeros(7),), False).tokens_per_step == 7
