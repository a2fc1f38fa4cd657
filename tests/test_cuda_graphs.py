"""OptimizeConfig(cuda_graphs=True): the option's checks, Inductor compiled with its CUDA graphs for
this compile only, and the refusal (CudaGraphsError) of a rewritten graph holding an op that reads
device values on the host, which a CUDA graph cannot capture. The replay itself needs a GPU:
tools/bench_corpus.py --cuda-graphs measures it (BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import nsa_compile
import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.pass_manager import host_sync


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="cuda_graphs=True needs compiler='inductor'"):
        nsa_compile.OptimizeConfig(compiler="aot_eager", cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        nsa_compile.OptimizeConfig(cuda_graphs="yes")
    assert nsa_compile.OptimizeConfig(cuda_graphs=True).cache_key() != nsa_compile.OptimizeConfig().cache_key()


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_inductor_gets_its_cuda_graphs_for_this_compile_only(monkeypatch, cuda_graphs):
    """compile_fx is called with triton.cudagraphs in its config_patches exactly when the option is
    on (beside the pass hook), and Inductor's global config is left as it was."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    before = inductor_config.triton.cudagraphs
    model = nsa_compile.optimize(Small(), nsa_compile.OptimizeConfig(cuda_graphs=cuda_graphs))
    model(torch.randn(2, 4))
    assert len(seen) == 1 and "pre_grad_custom_pass" in seen[0], seen
    assert seen[0].get("triton.cudagraphs", False) is cuda_graphs, seen
    assert inductor_config.triton.cudagraphs == before


def op_graph(op, backend: str, device: str, pos: bool) -> fx.Graph:
    """One torch.ops.nsa call on fake tensors of `device`, as a rewritten graph holds it."""
    graph = fx.Graph()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 4, 8, 16, device=device)
        kv = torch.empty(1, 2, 8, 16, device=device)
        positions = torch.zeros(1, 8, dtype=torch.long, device=device)
        ids = torch.zeros(1, 2, 8, 2, dtype=torch.long, device=device)
    nodes = {}
    for name, val in [("q", q), ("k", kv), ("v", kv), ("pos", positions), ("ids", ids)]:
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = val
    p = nodes["pos"] if pos else None
    if op == "window":
        call = graph.call_function(torch.ops.nsa.window_attention.default,
                                   (nodes["q"], nodes["k"], nodes["v"], 4, 0.25, backend, p))
    else:
        call = graph.call_function(torch.ops.nsa.selected_attention.default,
                                   (nodes["q"], nodes["k"], nodes["v"], nodes["ids"], 4, 0.25, backend, p))
    graph.output(call)
    return graph


@pytest.mark.parametrize(
    "op, backend, device, pos, reason",
    [
        ("window", "flash", "cuda", True, "(nsa.window_attention[flash]) takes document positions"),
        ("window", "reference", "cuda", True, "(nsa.window_attention[reference]) takes document positions"),
        ("selection", "varlen", "cuda", False, "(nsa.selected_attention[varlen]) reads its block counts"),
        ("window", "triton", "cuda", True, None),  # the Triton kernels take pos on the device
        ("window", "flash", "cuda", False, None),  # no documents: FA-2 needs no host numbers
        ("window", "reference", "cpu", True, None),  # no CUDA graph on the CPU
    ],
)
def test_host_sync_names_the_op_that_cannot_be_captured(op, backend, device, pos, reason):
    why = host_sync(op_graph(op, backend, device, pos))
    if reason is None:
        assert why is None, why
    else:
        assert why is not None and reason in why, why


def test_the_graph_pass_raises_for_a_host_reading_op_only_with_cuda_graphs():
    """NSAGraphPass (the hook Inductor runs) on a rewritten graph holding the window's FA-2 call
    with document positions on CUDA: CudaGraphsError with cuda_graphs=True, nothing without."""
    from nsa_compile.pass_manager import CudaGraphsError, NSAGraphPass, OptimizeState

    config = nsa_compile.OptimizeConfig(disabled_passes=tuple(nsa_compile.pass_names()))
    NSAGraphPass(OptimizeState.for_config(config))(op_graph("window", "flash", "cuda", True))
    state = OptimizeState.for_config(config.replace(cuda_graphs=True))
    with pytest.raises(CudaGraphsError, match=r"cannot capture graph 0: .*nsa.window_attention\[flash\]"):
        NSAGraphPass(state)(op_graph("window", "flash", "cuda", True))


def train_losses(model, inputs, steps: int = 3) -> list[float]:
    from nsa_compile.workload import loss_of

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = loss_of(model, inputs, True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
def test_training_replayed_as_cuda_graphs_follows_the_uncaptured_run():
    """The seed preset (2 layers, S 256) trained 3 steps under bf16 autocast with and without
    cuda_graphs: the same kernels, replayed, give the same losses."""
    from nsa_compile.models import build_model
    from helpers import tokens

    batch = tokens(2, 256, seed=1).cuda()
    runs = []
    for cuda_graphs in (False, True):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = nsa_compile.optimize(build_model("seed", n_layers=2).cuda(),
                                     nsa_compile.OptimizeConfig(cuda_graphs=cuda_graphs))
        runs.append(train_losses(model, (batch,)))
    torch.testing.assert_close(runs[1], runs[0], rtol=2e-3, atol=0)
