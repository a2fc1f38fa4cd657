"""nsa-compile train: corpus, deterministic batches, eager vs optimized losses, resume after a kill,
and no lost work: outputs checked before training, checkpoints that record the run's settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import nsa_compile.train
from nsa_compile.cli import cli, main
from nsa_compile.train import MAX_CORPUS_BYTES, load_corpus

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
    # batch 2, not FAST's 4: half the time of what was the suite's longest test, the same claim
    common = ["--data", str(text_dir), "--steps", "200", *FAST, "--batch", "2"]
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


# --- no lost work: every output checked first, settings recorded, bad checkpoints one line ----------

HOSTILE = str(Path(__file__).parent / "user_models" / "hostile.py")
QUICK = ["--no-optimize", "--steps", "2", "--save-every", "1", *FAST]
LM = f"{HOSTILE}:byte_lm"  # an embedding and a linear layer: a checkpoint in a fraction of a second


def train_error(args, capsys, code=2):
    """Run `nsa-compile train *args` through main; assert the status and one stderr line; return it."""
    with pytest.raises(SystemExit) as done:
        main(["train", *args])
    err = capsys.readouterr().err
    assert done.value.code == code, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def never_trains(monkeypatch):
    """Make a training step fail the test: the refusals below must come before any step."""
    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking")

    monkeypatch.setattr(nsa_compile.train, "train", no_training)


@pytest.mark.parametrize("option", ["--checkpoint", "--losses"])
def test_an_output_in_a_missing_folder_is_refused_before_training(option, tmp_path, text_dir, monkeypatch, capsys):
    never_trains(monkeypatch)
    target = tmp_path / "missing" / "out"
    err = train_error(["--data", str(text_dir), *QUICK, option, str(target)], capsys)
    assert err == f"error: {option} {target}: the folder {target.parent} does not exist\n"


@pytest.mark.parametrize("option", ["--checkpoint", "--losses"])
def test_an_output_in_a_read_only_folder_is_refused_before_training(option, read_only_dir, text_dir, monkeypatch,
                                                                     capsys):
    never_trains(monkeypatch)
    err = train_error(["--data", str(text_dir), *QUICK, option, str(read_only_dir / "out")], capsys)
    assert err.startswith(f"error: {option} {read_only_dir / 'out'}: cannot write in {read_only_dir}: "), err


def test_more_output_mistakes_are_refused_before_training(tmp_path, text_dir, monkeypatch, capsys):
    never_trains(monkeypatch)
    common = ["--data", str(text_dir), *QUICK]
    err = train_error([*common, "--checkpoint", str(tmp_path), "--resume"], capsys)
    assert "Invalid value for '--checkpoint'" in err and "is a directory" in err, err
    same = str(tmp_path / "run.out")
    assert train_error([*common, "--checkpoint", same, "--losses", same], capsys) == \
        "error: --checkpoint and --losses name the same file\n"
    existing = tmp_path / "ck.pt"
    existing.write_bytes(b"a previous run")
    err = train_error([*common, "--checkpoint", str(existing)], capsys)  # no --resume: it would be overwritten
    assert err.startswith(f"error: --checkpoint {existing} exists: pass --resume to continue that run"), err
    assert existing.read_bytes() == b"a previous run"
    err = train_error([*common, "--allow-changed-settings"], capsys)
    assert err == "error: --allow-changed-settings applies to --resume\n"


@pytest.mark.parametrize("args, message", [
    (["--lr", "0"], "error: --lr must be a positive number, got 0.0"),
    (["--lr", "nan"], "error: --lr must be a positive number, got nan"),
    (["--lr", "-1e-3"], "error: --lr must be a positive number, got -0.001"),
    (["--eval-every", "-1"], "error: --eval-every and --save-every must be 0 or more"),
    (["--save-every", "-5"], "error: --eval-every and --save-every must be 0 or more"),
    (["--batch", "0"], "error: --steps, --batch and --seq-len must be positive"),
])
def test_bad_numbers_are_one_line(args, message, monkeypatch, capsys):
    never_trains(monkeypatch)
    assert train_error([*args], capsys).startswith(message)


def checkpoint_of(tmp_path, text_dir) -> str:
    """A checkpoint after 2 steps of the byte LM on text_dir (eager, batch 4, seq-len 64)."""
    ck = str(tmp_path / "ck.pt")
    train("--data", str(text_dir), *QUICK, "--model", LM, "--checkpoint", ck)
    return ck


@pytest.mark.parametrize("content, says", [
    (b"", "is empty (0 bytes): not a checkpoint; remove it to start afresh"),
    (b"step 100, loss 2.3\n", "(19 bytes) cannot be read (truncated, or not a checkpoint): "),
])
def test_an_empty_or_foreign_checkpoint_is_one_line_not_ctrl_c(content, says, tmp_path, text_dir, capsys):
    """A 0-byte checkpoint used to print 'aborted' and exit 130, as if Ctrl-C, with --debug too."""
    ck = tmp_path / "ck.pt"
    ck.write_bytes(content)
    args = ["--data", str(text_dir), *QUICK, "--steps", "4", "--checkpoint", str(ck), "--resume"]
    err = train_error(args, capsys)
    assert err.startswith(f"error: checkpoint {ck} {says}"), err
    with pytest.raises(SystemExit) as done:
        main(["--debug", "train", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.splitlines()[-1].startswith(f"error: checkpoint {ck} "), err


def test_a_truncated_checkpoint_is_one_line(tmp_path, text_dir, capsys):
    ck = checkpoint_of(tmp_path, text_dir)
    whole = Path(ck).read_bytes()
    Path(ck).write_bytes(whole[: len(whole) // 2])  # a full disk, a copy cut short
    err = train_error(["--data", str(text_dir), *QUICK, "--model", LM, "--steps", "4", "--checkpoint", ck,
                       "--resume"], capsys)
    assert err.startswith(f"error: checkpoint {ck} ({len(whole) // 2:,} bytes) cannot be read (truncated, or not a "
                          f"checkpoint): "), err


def test_the_checkpoint_records_the_runs_settings(tmp_path, text_dir):
    ck = checkpoint_of(tmp_path, text_dir)
    settings = torch.load(ck, weights_only=True)["settings"]
    corpus = load_corpus(str(text_dir))
    assert settings == {"model": LM, "lr": 1e-3, "batch": 4, "seq_len": 64, "seed": 0, "data": corpus.identity}
    assert corpus.identity["data"] == str(text_dir.resolve())
    assert corpus.identity["train_bytes"] == len(corpus.train) and corpus.identity["val_bytes"] == len(corpus.val)
    assert len(corpus.identity["sha256_first_mib"]) == 64


@pytest.mark.parametrize("change, says", [
    (["--lr", "3e-4"], "lr: 0.001 -> 0.0003"),
    (["--batch", "2"], "batch: 4 -> 2"),
    (["--seq-len", "32"], "seq-len: 64 -> 32"),
    (["--seed", "1"], "seed: 0 -> 1"),
    (["--model", "tiny"], f"model: {LM!r} -> 'tiny'"),
    (["--data", "OTHER"], "data: "),
])
def test_a_resume_that_contradicts_the_checkpoint_is_refused(change, says, tmp_path, text_dir, capsys):
    ck = checkpoint_of(tmp_path, text_dir)
    other = tmp_path / "other.txt"
    other.write_text(open(__file__).read())
    change = [str(other) if arg == "OTHER" else arg for arg in change]
    before = Path(ck).read_bytes()
    err = train_error(["--data", str(text_dir), *QUICK, "--model", LM, "--steps", "4", "--checkpoint", ck,
                       "--resume", *change], capsys)
    assert err.startswith(f"error: --resume: this run's settings differ from those of {ck} ("), err
    assert says in err and err.endswith("pass --allow-changed-settings to resume with the new ones\n"), err
    assert Path(ck).read_bytes() == before


def test_allow_changed_settings_resumes_with_the_new_ones(tmp_path, text_dir):
    ck = checkpoint_of(tmp_path, text_dir)
    out = train("--data", str(text_dir), *QUICK, "--model", LM, "--steps", "3", "--checkpoint", ck, "--resume",
                "--lr", "3e-4", "--allow-changed-settings")
    assert "resuming with changed settings: lr: 0.001 -> 0.0003" in out and "at step 2" in out
    saved = torch.load(ck, weights_only=True)
    assert saved["step"] == 3 and saved["settings"]["lr"] == 3e-4
    assert {group["lr"] for group in saved["optimizer"]["param_groups"]} == {3e-4}  # the new --lr took effect


def test_a_checkpoint_of_another_model_is_one_line_even_when_allowed(tmp_path, text_dir, capsys):
    ck = checkpoint_of(tmp_path, text_dir)
    err = train_error(["--data", str(text_dir), *QUICK, "--steps", "4", "--checkpoint", ck, "--resume",
                       "--model", "tiny", "--allow-changed-settings"], capsys)
    assert err.startswith(f"error: checkpoint {ck} does not fit this model: "), err


def test_a_checkpoint_without_settings_needs_the_override(tmp_path, text_dir, capsys):
    """Checkpoints written before settings were recorded: refused, unless the user says so."""
    ck = checkpoint_of(tmp_path, text_dir)
    state = torch.load(ck, weights_only=True)
    del state["settings"]
    torch.save(state, ck)
    args = ["--data", str(text_dir), *QUICK, "--model", LM, "--steps", "3", "--checkpoint", ck, "--resume"]
    assert "settings: not recorded in the checkpoint" in train_error(args, capsys)
    assert "resumed from" in train(*args, "--allow-changed-settings")


def test_save_every_0_still_saves_the_last_step(tmp_path, text_dir):
    ck = str(tmp_path / "ck.pt")
    train("--data", str(text_dir), *QUICK, "--model", LM, "--steps", "3", "--save-every", "0", "--checkpoint", ck,
          "--losses", str(tmp_path / "losses.json"))
    assert torch.load(ck, weights_only=True)["step"] == 3
    assert len(losses_of(tmp_path / "losses.json")) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "losses.json"]  # no .tmp or probe left


def test_a_data_file_over_the_cap_is_read_up_to_the_cap(tmp_path):
    """A single 65 MiB file used to give 'both buffer length (0) and count (-1) must not be 0'."""
    big = tmp_path / "big.txt"
    line = b"the quick brown fox jumps over the lazy dog\n"
    big.write_bytes(line * ((MAX_CORPUS_BYTES + 2**20) // len(line)))
    corpus = load_corpus(str(big))
    assert len(corpus.train) + len(corpus.val) == MAX_CORPUS_BYTES
    assert corpus.name == f"{big} (its first 64 MiB)"
    assert bytes(corpus.train[: len(line)].tolist()) == line
    folder = tmp_path / "folder"
    folder.mkdir()
    big.rename(folder / "a.txt")
    (folder / "b.txt").write_bytes(line)  # past the cap: not read
    corpus = load_corpus(str(folder))
    assert len(corpus.train) + len(corpus.val) == MAX_CORPUS_BYTES and corpus.name.endswith("(its first 64 MiB)")


def test_an_unreadable_data_file_is_one_line(text_dir, monkeypatch, capsys):
    """One file of the folder cannot be read (permission denied; root reads anything, so the
    refusal is simulated at Path.open for that file only)."""
    never_trains(monkeypatch)
    unreadable = text_dir / "doc07.txt"
    original = Path.open

    def open_(self, *args, **kwargs):
        if self == unreadable:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    err = train_error(["--data", str(text_dir), *QUICK], capsys)
    assert err == f"error: --data: cannot read {unreadable}: Permission denied\n"


@pytest.mark.parametrize("content, says", [
    ("", "no bytes to train on (the files are empty)"), ("x" * 30, "fewer than seq-len + 2"),
])
def test_data_too_small_is_one_line(content, says, tmp_path, capsys):
    data = tmp_path / "small.txt"
    data.write_text(content)
    assert says in train_error(["--data", str(data), *QUICK], capsys)


def test_an_empty_data_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert train_error(["--data", str(tmp_path / "empty"), *QUICK], capsys) == \
        f"error: no files found in {tmp_path / 'empty'}\n"


def test_a_model_that_is_not_a_language_model_names_the_users_line(text_dir, monkeypatch, capsys):
    """Used to fail with 'not enough values to unpack' and no origin, --debug showing none either."""
    never_trains(monkeypatch)
    lines = open(HOSTILE).read().splitlines()
    at = next(i for i, text in enumerate(lines, 1) if "B, S, _ = x.shape" in text)
    args = ["--data", str(text_dir), *QUICK, "--model", f"{HOSTILE}:projection"]
    err = train_error(args, capsys)
    assert err.startswith(f"error: {HOSTILE}:projection: train needs a language model: tokens [B, S] (int64) -> "
                          f"logits [B, S, V], V >= 256; on tokens [1, 64] the model raised ValueError: not enough "
                          f"values to unpack (expected 3, got 2) (at {os.path.relpath(HOSTILE)}:{at} in forward"), err
    with pytest.raises(SystemExit) as done:
        main(["--debug", "train", *args])
    assert done.value.code == 2 and f'File "{HOSTILE}", line {at}, in forward' in capsys.readouterr().err
    err = train_error(["--data", str(text_dir), *QUICK, "--model", f"{HOSTILE}:small_vocab_lm"], capsys)
    assert err.endswith("on tokens [1, 64] it returned float32 [1, 64, 100]\n"), err


def test_a_user_language_model_trains(tmp_path, text_dir):
    out = train("--data", str(text_dir), *QUICK, "--model", LM, "--losses",
                str(tmp_path / "losses.json"))
    assert "done: 2 steps" in out and len(losses_of(tmp_path / "losses.json")) == 2


def test_a_diverged_run_is_one_line(tmp_path, text_dir, capsys):
    err = train_error(["--data", str(text_dir), *QUICK, "--model", f"{HOSTILE}:nan_lm"], capsys)
    assert err == "error: the run diverged: loss is nan at step 1 (a lower --lr may help)\n"
