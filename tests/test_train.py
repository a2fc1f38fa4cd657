"""nsa-compile train: corpus, deterministic batches, eager vs optimized losses, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from nsa_compile.cli import cli
from nsa_compile.train import load_corpus

FAST = ["--device", "cpu", "--compiler", "aot_eager", "--batch", "4", "--seq-len", "64", "--eval-every", "0"]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """A small corpus folder: 40 files of real text (this test file's own source, shifted)."""
    root = tmp_path_factory.mktemp("corpus")
    source = open(__file__, encoding="utf-8").read()
    for i in range(40):
        (root / f"doc{i:02d}.txt").write_text(source[i * 50 :] + source[: i * 50])
    return root


def train(*args):
    result = CliRunner().invoke(cli, ["train", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def losses_of(path):
    return json.loads(open(path).read())


def test_default_corpus_is_the_stdlib_split_by_file():
    corpus = load_corpus()
    assert "python stdlib" in corpus.name
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 10_000
    a = corpus.batch("train", 7, 2, 32, seed=0)
    assert a.shape == (2, 33) and a.dtype == torch.int64 and int(a.max()) < 256
    assert torch.equal(a, corpus.batch("train", 7, 2, 32, seed=0))  # the data position is the step
    assert not torch.equal(a, corpus.batch("train", 8, 2, 32, seed=0))


def test_data_folder_and_single_file(text_dir):
    folder = load_corpus(str(text_dir))
    assert len(folder.val) > 0 and len(folder.train) > 10 * len(folder.val)  # every 20th file validates
    single = load_corpus(str(text_dir / "doc00.txt"))
    assert len(single.val) == len(open(text_dir / "doc00.txt", "rb").read()) - len(single.train)


def test_eager_and_optimized_agree_within_1_percent_over_200_steps(tmp_path, text_dir):
    common = ["--data", str(text_dir), "--steps", "200", *FAST]
    train(*common, "--no-optimize", "--losses", str(tmp_path / "eager.json"))
    out = train(*common, "--optimize", "--losses", str(tmp_path / "opt.json"))
    assert "optimized, aot_eager" in out
    eager, opt = losses_of(tmp_path / "eager.json"), losses_of(tmp_path / "opt.json")
    assert len(eager) == len(opt) == 200
    assert max(abs(a - b) / a for a, b in zip(eager, opt)) < 0.01
    assert sum(eager[-20:]) < sum(eager[:20])  # it learns


def test_resume_gives_the_losses_of_a_run_that_never_stopped(tmp_path, text_dir):
    common = ["--data", str(text_dir), "--no-optimize", *FAST]
    train(*common, "--steps", "6", "--losses", str(tmp_path / "straight.json"))
    ck = str(tmp_path / "ck.pt")
    train(*common, "--steps", "3", "--save-every", "3", "--checkpoint", ck)
    out = train(*common, "--steps", "6", "--checkpoint", ck, "--resume", "--losses", str(tmp_path / "resumed.json"))
    assert "resumed from" in out and "at step 3" in out
    assert losses_of(tmp_path / "resumed.json") == losses_of(tmp_path / "straight.json")


def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path, text_dir):
    ck = str(tmp_path / "ck.pt")
    common = ["--data", str(text_dir), "--no-optimize", "--device", "cpu", *FAST]
    cmd = [sys.executable, "-m", "nsa_compile", "train", *common, "--checkpoint", ck]
    proc = subprocess.Popen([*cmd, "--steps", "100000", "--save-every", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if "checkpoint saved" in line and "step 4:" in line:
                break
        proc.send_signal(signal.SIGKILL)  # no chance to clean up
    finally:
        proc.wait(timeout=60)
    saved = torch.load(ck, weights_only=True)["step"]
    assert saved >= 4 and saved % 2 == 0
    subprocess.run([*cmd, "--steps", str(saved + 2), "--resume", "--losses", str(tmp_path / "resumed.json")],
                   check=True, capture_output=True)
    subprocess.run([*cmd[:-2], "--steps", str(saved + 2), "--losses", str(tmp_path / "straight.json")],
                   check=True, capture_output=True)
    assert losses_of(tmp_path / "resumed.json") == losses_of(tmp_path / "straight.json")


@pytest.mark.parametrize(
    "args, message",
    [(["--data", "/no/such/place"], "--data /no/such/place: no such file or folder"),
     (["--resume"], "--resume needs --checkpoint"),
     (["--steps", "0"], "must be positive")],
)
def test_train_errors(args, message):
    result = CliRunner().invoke(cli, ["train", *args])
    assert result.exit_code == 2 and message in result.output
