"""Compile-time evaluation code names the device of every tensor it makes.

The passes evaluate the user's mask and index subgraphs on the graph's device (CUDA on a GPU) and
compare the results with tensors they build themselves. A tensor built without `device=` lands on
the CPU, so a comparison that works in the CPU suite crashed the compile on CUDA (found by the
corpus GPU test: `keep & k` in canonicalize's mask evaluation, cuda:0 and cpu). The CPU suite
cannot see that class of bug by running, so this test reads the sources: every torch factory call
in the passes and the evaluation modules passes `device=` (the graph's device, or "cpu" where the
tensor is a CPU probe moved later or compared with a `.cpu()` copy).
"""

from __future__ import annotations

import ast
import operator
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACTORIES = {"arange", "ones", "zeros", "full", "tensor", "empty", "eye", "rand", "randn", "randint", "linspace"}
EVALUATING = sorted(ROOT.glob("passes/*.py")) + [
    ROOT / "nsa_compile" / name for name in ("attention_match.py", "sizes.py", "probe.py", "fx.py", "rewrite.py")]


def factories_without_device(source: str) -> list[tuple[int, str]]:
    """(line, name) of each `torch.<factory>(...)` call in `source` without a `device=` keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                and not any(k.arg == "device" for k in node.keywords):
            found.append((node.lineno, f"torch.{node.func.attr}"))
    return found


def test_the_scan_sees_a_factory_without_a_device():
    assert factories_without_device("import torch\nt = torch.arange(4)\nu = torch.ones(2, device=t.device)\n") \
        == [(2, "torch.arange")]


@pytest.mark.parametrize("path", EVALUATING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tensor_the_evaluation_makes_names_its_device(path):
    assert path.exists(), path
    assert factories_without_device(path.read_text()) == []


def test_probe_run_moves_the_graphs_own_constants_to_the_probe_device():
    """A region whose constants the graph makes on its device (meta stands in for CUDA here) runs on
    CPU probes when probe.run is given device="cpu": the constant follows, the sum is computed."""
    import torch
    from torch import fx

    from nsa_compile import probe

    graph = fx.Graph()
    x = graph.placeholder("x")
    ramp = graph.call_function(torch.arange, (4,), {"device": torch.device("meta"), "dtype": torch.float32})
    out = graph.call_function(torch.add, (x, ramp))
    nodes = [ramp, out]
    got = probe.run(nodes, {x: torch.ones(4, dtype=torch.float64)}, out, "a test region", device="cpu")
    assert got.device.type == "cpu" and got.dtype == torch.float64
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(Exception):  # without the mapping the meta constant cannot meet CPU values
        probe.run(nodes, {x: torch.ones(4, dtype=torch.float64)}, out, "a test region").tolist()


def test_probe_run_evaluates_the_projects_ops_with_their_reference_backend():
    """A region holding a rewritten op with the backend its pass wrote for the graph (here 'triton',
    which cannot run CPU float64 probes) is evaluated with the op's reference backend."""
    import torch
    from torch import fx

    import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
    from nsa_compile import probe
    from nsa_compile.ops.window import _reference_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    graph = fx.Graph()
    xs = [graph.placeholder(name) for name in ("q", "k", "v")]
    op = graph.call_function(torch.ops.nsa.window_attention.default, (*xs, 3, 0.5, "triton"))
    out = graph.call_function(operator.getitem, (op, 0))
    env = dict(zip(xs, (q, k, v)))
    got = probe.run([op, out], dict(env), out, "a test region")
    torch.testing.assert_close(got, _reference_forward(q, k, v, 3, 0.5)[0])
    with pytest.raises(ValueError):  # the backend the graph names cannot run these values
        torch.ops.nsa.window_attention(q, k, v, 3, 0.5, "triton")
