"""tools/ddp_train.py on the CPU: two gloo ranks (torch.multiprocessing, spawn) train a small
model a few steps under DDP and under FSDP2, and one process trains on the same global batches.
Checked: nothing hangs (every wait has a deadline), the losses agree within 1 %, and the same
rewrites run.

Under DDP, Dynamo's DDPOptimizer splits each graph at the gradient buckets (boundaries just
before a parameter's first use, counted backwards) before the backend sees it, which cut patterns
that span parameters (fused projections: 3 partial fusions for 2 layers here). nsa_compile turns
that split off for its own calls, runs the passes on the whole graph, then splits the rewritten
graph the same way (nsa_compile/ddp.py): the model here, tiny with dim 256, mlp_ratio 1 and 1 MiB
buckets, must come out in several pieces with one process's rewrites, in both wrapping orders.
FSDP2's hooks break the graph at each block and every block runs the one graph compiled for the
first, so report() counts a rewrite once for all blocks there: the nsa op calls of a step are
what must agree. The last tests use one in-process gloo rank to check that the switch is ours
alone: a model the user compiled without nsa_compile is still split by Dynamo.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.ddp import pieces_of
from nsa_compile.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ddp_train  # noqa: E402

WORLD = 2
DEADLINE_S = 420  # the whole two-rank run; a collective that waits gives up after COLLECTIVE_S
COLLECTIVE_S = 120
STEPS = 3
# name -> (ddp_train flags, torch._dynamo.config.optimize_ddp or None for PyTorch's default)
RUNS = {
    "ddp": (["--mode", "ddp"], None),
    "ddp-wrap-first": (["--mode", "ddp", "--wrap-first"], None),  # optimize(DDP(model))
    "ddp-unsplit": (["--mode", "ddp"], "no_optimization"),
    "fsdp": (["--mode", "fsdp"], None),
}


def worker(rank: int, init_file: str, argv: list[str], out_dir: str) -> None:
    """One rank: each of RUNS from a fresh model, results to out_dir/rank<r>.json."""
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        results = {}
        for name, (flags, optimize_ddp) in RUNS.items():
            torch._dynamo.reset()
            args = ddp_train.parse_args([*argv, *flags])
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


def test_one_process_makes_every_rewrite_in_one_graph(runs):
    single = runs["single"]
    assert single["graphs"] == 1 and single["pieces"] == 0
    assert single["rewrites"]["window_attention"] == single["rewrites"]["selected_attention"] == 2
    assert single["rewrites"]["projection_rope"] == 2
    for op in ("nsa::window_attention", "nsa::selected_attention"):
        assert single["calls"][op] == 2


@pytest.mark.parametrize("name", ["ddp", "ddp-wrap-first"])
def test_ddp_keeps_every_rewrite_of_one_process(runs, name):
    for rank in runs[name]:
        assert rank["graphs"] == 1  # the passes saw the whole graph ...
        assert rank["pieces"] > 1  # ... which was then split at the 1 MiB buckets
        assert rank["rewrites"] == runs["single"]["rewrites"]
        assert rank["calls"] == runs["single"]["calls"]


def test_ddp_without_dynamos_split_keeps_every_rewrite(runs):
    for rank in runs["ddp-unsplit"]:
        assert rank["graphs"] == 1 and rank["pieces"] == 0  # the user's no_optimization is kept
        assert rank["rewrites"] == runs["single"]["rewrites"]
        assert rank["calls"] == runs["single"]["calls"]


def test_fsdp_runs_the_same_rewritten_ops(runs):
    single = runs["single"]
    assert single["calls"]["nsa::window_attention"] == single["calls"]["nsa::window_attention_backward"] == 2
    assert single["calls"]["nsa::selected_attention"] == 2
    for rank in runs["fsdp"]:
        assert rank["pieces"] == 0  # FSDP2 never goes through DDPOptimizer
        assert rank["calls"] == single["calls"]
        # every pass that fired in one process fired in the block graph the blocks share
        assert {p for p, n in rank["rewrites"].items() if n} == {p for p, n in single["rewrites"].items() if n}


# One in-process gloo rank: enough for DDP to be active (and Dynamo's split to apply) in this
# process, cheap enough to check what the switch leaves alone.


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    torch._dynamo.reset()
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_dynamos_split_is_off_only_inside_our_calls(one_rank):
    setting = torch._dynamo.config.optimize_ddp
    assert torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"  # PyTorch's default
    torch.manual_seed(0)
    optimized = nsa_compile.optimize(build_model("tiny", dim=256, mlp_ratio=1),
                                     nsa_compile.OptimizeConfig(compiler="aot_eager"))
    model = DistributedDataParallel(torch.nn.Sequential(optimized), bucket_cap_mb=1)  # a submodule optimized
    tokens = torch.randint(0, 256, (1, 65))
    model(tokens[:, :-1]).float().square().mean().backward()
    assert torch._dynamo.config.optimize_ddp == setting  # restored after the call
    (graph,) = state_of(optimized).graphs
    assert pieces_of(graph) > 1  # split by nsa_compile, after the passes
    assert {row["name"]: row["matches"] for row in nsa_compile.report(optimized)}["projection_rope"] == 2

    # a model the user compiled without nsa_compile, under DDP in the same process: Dynamo splits it
    pieces = []

    def counting_backend(gm, example_inputs):
        pieces.append(gm)
        return gm.forward

    layers = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))  # 1 MiB each
    theirs = DistributedDataParallel(torch.compile(layers, backend=counting_backend), bucket_cap_mb=1)
    theirs(torch.randn(2, 512)).sum().backward()
    assert len(pieces) > 1


@pytest.mark.inductor
def test_inductor_compiles_the_pieces_without_running_the_passes_again(runs, one_rank):
    """compiler='inductor' under DDP: the passes run once on the whole graph (not again in each
    piece's pre-grad hook), the pieces train as the eager model does."""
    torch.manual_seed(0)
    eager = build_model("tiny", dim=256, mlp_ratio=1)  # the model of `runs`
    tokens = torch.randint(0, 256, (1, 65))
    optimized = nsa_compile.optimize(copy.deepcopy(eager), nsa_compile.OptimizeConfig(compiler="inductor"))
    DistributedDataParallel(optimized, bucket_cap_mb=1)(tokens[:, :-1]).float().square().mean().backward()
    eager(tokens[:, :-1]).float().square().mean().backward()

    (graph,) = state_of(optimized).graphs
    assert pieces_of(graph) > 1
    counts = {row["name"]: row["matches"] for row in nsa_compile.report(optimized)}
    assert counts == runs["single"]["rewrites"]  # one process, aot_eager
    assert counts["projection_rope"] == 2  # once per layer: neither cut nor counted twice
    for (name, got), want in zip(optimized.named_parameters(), eager.parameters(), strict=True):
        assert torch.linalg.vector_norm(got.grad - want.grad) <= 1e-4 * torch.linalg.vector_norm(want.grad), name
