"""tools/ddp_train.py on the CPU: two gloo ranks (torch.multiprocessing, spawn) train a small
model a few steps under DDP and under FSDP2, and one process trains on the same global batches.
Checked: nothing hangs (every wait has a deadline), the losses agree within 1 %, and the same
rewrites run.

Dynamo's DDPOptimizer compiles one graph per gradient bucket (boundaries just before a
parameter's first use, counted backwards), and the NSA passes see those pieces. The attention
patterns sit between parameters and survive; a pattern that spans parameters is cut when a
boundary falls inside it: fused projections on the seed model with DDP's 25 MiB buckets (17
partial fusions for 12 layers). The model here, tiny with dim 256, mlp_ratio 1 and 1 MiB
buckets, is cut the same way (3 for 2). Without Dynamo's split (optimize_ddp='no_optimization')
every rewrite stays. FSDP2's hooks break the graph at each block and every block runs the one
graph compiled for the first, so report() counts a rewrite once for all blocks there: the nsa op
calls of a step are what must agree.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ddp_train  # noqa: E402

WORLD = 2
DEADLINE_S = 420  # the whole two-rank run; a collective that waits gives up after COLLECTIVE_S
COLLECTIVE_S = 120
STEPS = 3
# name -> (ddp_train --mode, torch._dynamo.config.optimize_ddp or None for PyTorch's default)
RUNS = {"ddp": ("ddp", None), "ddp-unsplit": ("ddp", "no_optimization"), "fsdp": ("fsdp", None)}


def worker(rank: int, init_file: str, argv: list[str], out_dir: str) -> None:
    """One rank: each of RUNS from a fresh model, results to out_dir/rank<r>.json."""
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        results = {}
        for name, (mode, optimize_ddp) in RUNS.items():
            torch._dynamo.reset()
            args = ddp_train.parse_args([*argv, "--mode", mode])
            with torch._dynamo.config.patch(optimize_ddp=optimize_ddp or torch._dynamo.config.optimize_ddp):
                results[name] = ddp_train.train(args, rank, WORLD)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{'single': result, run name: [rank results]} (results of ddp_train.train)."""
    tmp = tmp_path_factory.mktemp("distributed")
    corpus = tmp / "corpus.txt"  # a small fixed text: the same batches in every process and run
    words = "native sparse attention selects blocks of tokens and slides a window over the rest".split()
    g = torch.Generator().manual_seed(0)
    corpus.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (20000,), generator=g)))
    argv = ["--compiler", "aot_eager", "--device", "cpu", "--data", str(corpus), "--batch", "4", "--seq-len", "64",
            "--steps", str(STEPS), "--set", "dim=256", "--set", "mlp_ratio=1", "--bucket-cap-mb", "1"]

    context = mp.start_processes(worker, args=(str(tmp / "store"), argv, str(tmp)), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):  # raises if a rank failed, with its traceback
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD} ranks did not finish within {DEADLINE_S} s (hang?)")
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]

    torch._dynamo.reset()
    single = ddp_train.train(ddp_train.parse_args([*argv, "--single"]))
    return {"single": single, **{name: [r[name] for r in ranks] for name in RUNS}}


def assert_losses_agree(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert abs(a - b) <= 0.01 * abs(b), (step, got, expected)


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_match_one_process_on_the_same_global_batch(runs, name):
    single = runs["single"]
    assert single["losses"][-1] < single["losses"][0]  # it trains
    for rank in runs[name]:
        assert_losses_agree(rank["losses"], single["losses"])


def test_attention_rewrites_survive_the_ddp_split(runs):
    single = runs["single"]
    assert single["graphs"] == 1
    assert single["rewrites"]["window_attention"] == single["rewrites"]["selection_attention"] == 2
    for rank in runs["ddp"]:
        assert rank["graphs"] > 1  # DDPOptimizer split at the 1 MiB buckets
        for name in ("window_attention", "selection_attention"):
            assert rank["rewrites"][name] == single["rewrites"][name]
        for op in ("nsa::window_attention", "nsa::selected_attention"):
            assert rank["calls"][op] == single["calls"][op] == 2


@pytest.mark.xfail(strict=True, reason=(
    "Dynamo's DDPOptimizer hands the passes one graph per bucket: a boundary inside the projections "
    "cuts projections_rope (3 partial fusions for 2 layers here, 17 for 12 on the seed model). Fix "
    "in nsa_compile/backend.py + api.py: with optimize_ddp off around our compiled calls, nsa_backend "
    "runs the passes on the whole graph, then, inside a DDP forward, splits the rewritten graph with "
    "torch._dynamo.backends.distributed.DDPOptimizer(ddp.bucket_bytes_cap, <per-piece compiler>)."))
def test_ddp_keeps_every_rewrite_of_one_process(runs):
    for rank in runs["ddp"]:
        assert rank["rewrites"] == runs["single"]["rewrites"]
        assert rank["calls"] == runs["single"]["calls"]


def test_ddp_without_dynamos_split_keeps_every_rewrite(runs):
    for rank in runs["ddp-unsplit"]:
        assert rank["graphs"] == 1
        assert rank["rewrites"] == runs["single"]["rewrites"]
        assert rank["calls"] == runs["single"]["calls"]


def test_fsdp_runs_the_same_rewritten_ops(runs):
    single = runs["single"]
    assert single["calls"]["nsa::window_attention"] == single["calls"]["nsa::window_attention_backward"] == 2
    assert single["calls"]["nsa::selected_attention"] == 2
    for rank in runs["fsdp"]:
        assert rank["calls"] == single["calls"]
        # every pass that fired in one process fired in the block graph the blocks share
        assert {p for p, n in rank["rewrites"].items() if n} == {p for p, n in single["rewrites"].items() if n}
