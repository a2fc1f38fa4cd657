"""Runs the registered passes over each graph Dynamo captures, and keeps the record.

`NSAGraphPass` is the composite pass: one object per hook that runs every enabled pass in
registry order (timed, counted, logged), then any pass that was already installed on the hook.
It is a `CustomGraphPass` whose uuid covers the pass sources and the config, so Inductor's
caches never serve code compiled by other passes or options. After the passes it records the
graph's NSA branches, rewritten or left eager (coverage.py), and under OptimizeConfig(strict=True)
raises CoverageError where one stays eager.
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.fx as fx
from torch._guards import CompileContext
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .config import OptimizeConfig
from .fx import value
from .coverage import Branch, Coverage, CoverageError, graph_branches
from .registry import registered_passes
from .rewrite import PassContext, PassLog, RewritePass

__all__ = ["CudaGraphsError", "NSAGraphPass", "OptimizeState", "GraphRecord", "host_sync"]


@dataclass
class GraphRecord:
    """One captured graph: its code before and after the passes, and each pass's log."""

    graph_id: int
    code_before: str = ""
    code_after: str = ""
    logs: list[PassLog] = field(default_factory=list)
    # The ATen graphs AOTAutograd made of the rewritten graph ('forward', 'backward',
    # 'inference'), kept by compiler='aot_eager' for tests and `explain`.
    aten: dict[str, fx.GraphModule] = field(default_factory=dict)
    from_cache: bool = False  # Inductor served the compiled code from its cache
    ddp_pieces: int = 0  # the pieces DDP's gradient buckets split this graph into (0: not split)

    # The rewritten graph as (name, op, target, input names), for networkx exports.
    nodes_after: list[tuple[str, str, str, tuple[str, ...]]] = field(default_factory=list)
    new_nodes: set[str] = field(default_factory=set)  # nodes the passes created
    branches: list[Branch] = field(default_factory=list)  # the NSA branches left after the passes (coverage.py)
    # Dynamo's frame and its compile count (a recompile of the frame replaces its graphs; None outside Dynamo)
    frame: int | None = None
    frame_compile: int | None = None

    def diffs(self) -> list[tuple[str, str]]:
        """(pass name, unified diff of the graph code before -> after that pass), changed ones only."""
        out, before = [], self.code_before
        for log in self.logs:
            if log.code_after != before:
                text = "".join(difflib.unified_diff(
                    before.splitlines(True), log.code_after.splitlines(True),
                    f"graph {self.graph_id} before {log.pass_name}", f"graph {self.graph_id} after {log.pass_name}",
                ))
                out.append((log.pass_name, text))
            before = log.code_after
        return out


@dataclass
class OptimizeState:
    """Everything `optimize` learned about one model: config, passes, and each graph's record."""

    config: OptimizeConfig
    passes: tuple[RewritePass, ...]
    graphs: list[GraphRecord] = field(default_factory=list)

    @classmethod
    def for_config(cls, config: OptimizeConfig) -> "OptimizeState":
        enabled = tuple(p for p in registered_passes() if p.name not in config.disabled_passes)
        return cls(config, enabled)

    def new_graph(self) -> GraphRecord:
        record = GraphRecord(len(self.graphs))
        self.graphs.append(record)
        return record


# What the built-in passes read besides their own file: the graph helpers, the shared matchers
# and the ops (whose checks choose a backend that is written into the graph). Part of the uuid.
_HERE = Path(__file__).parent
SUPPORT_FILES = tuple(
    str(f) for f in sorted([_HERE / "pass_manager.py", _HERE / "fx.py", _HERE / "attention_match.py",
                            _HERE / "rewrite.py", _HERE / "sizes.py", *(_HERE / "ops").glob("*.py")])
)


def _graph_code(graph: fx.Graph) -> str:
    return graph.python_code("self").src


def _target_name(node: fx.Node) -> str:
    if node.op in ("call_function", "call_method"):
        return getattr(node.target, "__qualname__", None) or str(node.target)
    return str(node.target)


def check_strict(record: GraphRecord) -> None:
    """OptimizeConfig(strict=True): raise CoverageError, with the coverage table, where an NSA
    branch of this graph stays eager."""
    coverage = Coverage(record.branches)
    if coverage.eager:
        raise CoverageError(
            f"OptimizeConfig(strict=True): {len(coverage.eager)} of {len(coverage.branches)} NSA branches detected in "
            f"graph {record.graph_id} stay eager, so this model would run their slow eager code:\n"
            f"{coverage.table()}\n(nsa-compile explain --model ... says more; strict=False runs them eager)")


class CudaGraphsError(RuntimeError):
    """OptimizeConfig(cuda_graphs=True) and a rewritten op that reads values back to the host."""


def host_sync(graph: fx.Graph) -> str | None:
    """Why this rewritten graph cannot be captured in a CUDA graph, or None: the first torch.ops.nsa
    call on CUDA whose backend reads, or may read, device values on the host (a sync, forbidden
    while capturing): document positions `pos` on any backend but 'triton' (the window's FA-2 path
    counts documents on the host, the compressed and block-selection references copy pos there;
    the others are not proven free of it), and the selection's 'varlen' backends."""
    for node in graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "nsa":
            continue
        schema = node.target._schema
        args = {a.name: v for a, v in zip(schema.arguments, node.args)} | dict(node.kwargs)
        backend, pos = args.get("backend"), args.get("pos")
        tensor = next((value(a) for a in node.all_input_nodes if value(a) is not None), None)
        if tensor is None or getattr(tensor, "device", None) is None or tensor.device.type != "cuda":
            continue
        op = schema.name.removeprefix("nsa::")
        if pos is not None and backend != "triton":
            return (f"{node.name} (nsa.{op}[{backend}]) takes document positions, and only the 'triton' backends keep "
                    "them on the device (FA-2's counts the documents on the host, the reference ones may copy them)")
        if isinstance(backend, str) and backend.startswith("varlen"):
            return f"{node.name} (nsa.{op}[{backend}]) reads its block counts on the host"
    return None


class NSAGraphPass(CustomGraphPass):
    """The composite pass installed on one hook (Inductor's pre_grad_custom_pass)."""

    def __init__(self, state: OptimizeState, chained=None):
        self.state = state
        self.chained = chained  # whatever was installed on the hook before us

    def __call__(self, graph: fx.Graph) -> None:
        record = self.state.new_graph()
        record.code_before = _graph_code(graph)
        before_names = {n.name for n in graph.nodes}
        for p in self.state.passes:
            log = PassLog(p.name, record.graph_id, nodes_before=len(graph.nodes))
            start = time.perf_counter()
            p.apply(graph, PassContext(self.state.config, log))  # a pass erases what it replaced
            graph.lint()
            log.seconds = time.perf_counter() - start
            log.nodes_after = len(graph.nodes)
            log.code_after = _graph_code(graph)
            record.logs.append(log)
        record.code_after = _graph_code(graph)
        record.nodes_after = [
            (n.name, n.op, _target_name(n), tuple(a.name for a in n.all_input_nodes)) for n in graph.nodes
        ]
        record.new_nodes = {name for name, *_ in record.nodes_after} - before_names
        record.branches = graph_branches(graph, record.graph_id, record.logs, self.state.config.disabled_passes)
        compile_id = CompileContext.current_compile_id()
        record.frame = getattr(compile_id, "frame_id", None)
        record.frame_compile = getattr(compile_id, "frame_compile_id", None)
        if self.state.config.strict:
            check_strict(record)
        if self.state.config.cuda_graphs and (why := host_sync(graph)):
            raise CudaGraphsError(f"OptimizeConfig(cuda_graphs=True) cannot capture graph {record.graph_id}: {why}; "
                                  "CUDA graphs need every op to stay on the device (leave cuda_graphs False)")
        if graph.owning_module is not None:
            graph.owning_module.recompile()
        if self.chained is not None:
            self.chained(graph)

    def uuid(self):
        files = sorted({f for p in self.state.passes for f in p.source_files()} | set(SUPPORT_FILES))
        parts = [get_hash_for_files(tuple(files)).hex(), self.state.config.cache_key()]
        parts += [p.name for p in self.state.passes]
        if self.chained is not None:
            chained_uuid = self.chained.uuid() if hasattr(self.chained, "uuid") else None
            if chained_uuid is None:
                return None  # an uncacheable pass was installed before us: no caching
            parts.append(str(chained_uuid))
        return "|".join(parts)
