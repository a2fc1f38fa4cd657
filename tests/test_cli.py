"""The nsa-compile command line: every command, its JSON, and the errors a user can hit."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from nsa_compile.cli import cli, main
from nsa_compile.models import build_model


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_explain_table_lists_the_pass_and_near_misses():
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    (pass_line,) = [ln for ln in lines if ln.startswith("| gqa_grouped_matmul |") and "grouped matmul (" in ln]
    assert pass_line.split("|")[2].strip() == "12"
    assert "near misses" in result.output
    assert "the repeated tensor is also used by getitem: the copy must stay" in result.output


def test_explain_json_has_passes_and_near_misses():
    result = invoke("explain", "--model", "tiny", "--device", "cpu", "--seq-len", "40", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    (gqa,) = [p for p in data["passes"] if p["name"] == "gqa_grouped_matmul"]
    assert gqa["matches"] == 12
    assert gqa["where"] == ["blocks.0.attn", "blocks.1.attn"]
    assert len(data["near_misses"]) == 4
    assert {m["where"] for m in data["near_misses"]} == {"blocks.0.attn", "blocks.1.attn"}


def test_explain_dense_twin_has_nothing_to_rewrite():
    data = json.loads(invoke("explain", "--model", "tiny-dense", "--device", "cpu", "--seq-len", "20",
                             "--format", "json").output)
    assert [p["matches"] for p in data["passes"]] == [0]
    assert data["near_misses"] == []


def test_parity_passes_and_prints_every_tensor():
    result = invoke("parity", "--model", "tiny", "--device", "cpu", "--dtypes", "fp32", "--seq-len", "40",
                    "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "tiny fp32 on cpu: PASS" in result.output
    n_params = len(list(build_model("tiny").parameters()))
    assert result.output.count("| ok |") == 2 + n_params  # output, loss, every parameter


def test_demo_runs_end_to_end_on_cpu():
    result = invoke("demo", "--device", "cpu", "--seq-len", "40", "--steps", "1", "--compiler", "aot_eager")
    assert result.exit_code == 0, result.output
    assert "nsa_compile demo: tiny on cpu" in result.output
    assert "PASS" in result.output
    assert "| gqa_grouped_matmul |        12 |" in result.output
    assert "| optimize |" in result.output and "| eager    |" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["explain", "--model", "huge"], "error: unknown model preset 'huge'; valid:"),
        (["parity", "--dtypes", "fp8", "--device", "cpu"], "error: unknown dtype(s) fp8; valid: fp32, bf16, fp16"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["explain", "--device", "cuda"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: --device cuda was asked for, but no CUDA GPU is available\n"


def test_debug_flag_shows_the_exception():
    with pytest.raises(Exception, match="unknown model preset"):
        main(["--debug", "explain", "--model", "huge"])
