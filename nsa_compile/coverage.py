"""Coverage: which NSA branches of each layer run rewritten, which stay eager, and why.

Read from each graph after the passes ran, without asking the passes what they matched:

- every `torch.ops.nsa.*` branch op in the graph is a rewritten branch (window_attention,
  compressed_attention, select_blocks, selected_attention, gated_combine; the projection op is
  not a branch);
- every softmax left in the graph (`torch.softmax`, `F.softmax`, `Tensor.softmax`) and every
  `F.scaled_dot_product_attention` is an attention branch or a gate left eager (a gate when the
  nearest product feeding it is a Linear, an attention otherwise);
- every `topk`, and every `sort` / `argsort` of floating-point values (the eager block ranking),
  is a block selection left eager.

A layer is a module path ('blocks.3.attn'); its coverage is rewritten / detected branches. Each
eager branch carries the user's source line (the node's stack trace) and the reasons the passes
gave for that node (refusals are logged per node; the gate's are logged at the gated sum of its
layer; a pass that takes only other kinds of branch is not asked) or that a pass that takes
such a branch is switched off. A sigmoid gate left eager is not
detected (only softmax, SDPA and rankings are anchors): `explain` lists gated_combine's refusal.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import torch.fx as fx
from tabulate import tabulate

from .fx import module_path, op_name, value

__all__ = ["Branch", "Coverage", "CoverageError", "graph_branches", "coverage_of", "shown_path"]

# nsa op -> the branch it computes
BRANCH_OPS = {"window_attention": "window", "compressed_attention": "compressed", "select_blocks": "block selection",
              "selected_attention": "selected", "gated_combine": "gate"}
NOT_BRANCHES = ("projection_rope",)  # rewritten, but not one of the five NSA branches
# the built-in passes that take an eager branch of each kind (named when switched off)
PASSES_FOR = {"attention": ("window_attention", "compressed_attention", "selected_attention"),
              "gate": ("gated_combine",), "block selection": ("select_blocks",)}
_PRODUCTS = ("matmul", "bmm", "baddbmm", "einsum")
_RANKINGS = ("topk", "sort", "argsort")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')


class CoverageError(RuntimeError):
    """OptimizeConfig(strict=True): a detected NSA branch stays eager (the message holds the table)."""


@dataclass(frozen=True)
class Branch:
    """One NSA branch of one graph: rewritten (an nsa op) or left eager (a softmax, SDPA or ranking)."""

    graph: int
    where: str  # module path, e.g. 'blocks.0.attn'
    kind: str  # rewritten: window, compressed, block selection, selected, gate; eager: attention, gate, block selection
    rewritten: bool
    node: str  # the graph node
    op: str  # e.g. 'nsa.window_attention', 'softmax', 'sort'
    source: str = ""  # 'path/to/file.py:LINE' of the user's code ('' where Dynamo kept no stack)
    code: str = ""  # that line
    reasons: tuple[tuple[str, str], ...] = ()  # (pass, reason) for an eager branch

    @property
    def label(self) -> str:
        return self.kind if self.rewritten else f"{self.kind} ({self.op})"

    def why(self) -> str:
        """The reasons as one line ('pass: reason; ...')."""
        if not self.reasons:
            return "no pass recognized this form (none refused it with a reason)"
        return "; ".join(f"{p}: {r}" for p, r in self.reasons)

    def to_json(self) -> dict:
        data = asdict(self)
        data["reasons"] = [{"pass": p, "reason": r} for p, r in self.reasons]
        return data


def _nsa_op(node: fx.Node) -> str | None:
    """'window_attention' for a call of torch.ops.nsa.window_attention(.default), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname if target.namespace == "nsa" else None
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return name if namespace == "nsa" else None
    return None


def _softmax_kind(node: fx.Node, depth: int = 8) -> str:
    """'gate' when the nearest product upstream of the softmax input is a Linear (or the fused
    projections' op), else 'attention'."""
    frontier, seen = list(node.all_input_nodes), set()
    for _ in range(depth):
        following = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            name = op_name(n)
            if name == "linear" or _nsa_op(n) in NOT_BRANCHES:
                return "gate"
            if name in _PRODUCTS or _nsa_op(n) is not None:
                return "attention"
            following += n.all_input_nodes
        frontier = following
    return "attention"


def _eager_kind(node: fx.Node) -> tuple[str, str] | None:
    """(kind, op) of a node that is an NSA branch left eager, else None."""
    name = op_name(node)
    if name == "softmax":
        return _softmax_kind(node), name
    if name == "scaled_dot_product_attention":
        return "attention", name
    if name in _RANKINGS:
        scores = value(node.args[0]) if node.args else None
        if name == "topk" or (scores is not None and scores.is_floating_point()):
            return "block selection", name
    return None


def shown_path(path: str) -> str:
    """The path relative to the working directory where it lies below it, else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def user_line(node: fx.Node) -> tuple[str, str]:
    """('file:line', code) of the innermost frame of the node's stack trace, ('', '') without one."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return "", ""
    last = frames[-1]
    return f"{shown_path(last['file'])}:{last['line']}", last["code"].strip()


def graph_branches(graph: fx.Graph, graph_id: int, logs=(), disabled: tuple[str, ...] = ()) -> list[Branch]:
    """Every NSA branch of `graph` after the passes (logs: their PassLogs for this graph), in graph order."""
    at_node: dict[str, list[tuple[str, str]]] = {}
    gate_sums: dict[str, list[tuple[str, str]]] = {}  # gated_combine anchors on the sum, not the softmax
    for log in logs:
        for r in log.refusals:
            at_node.setdefault(r.node, []).append((log.pass_name, r.reason))
            if log.pass_name in PASSES_FOR["gate"]:
                gate_sums.setdefault(r.where, []).append((log.pass_name, r.reason))
    found = []
    for node in graph.nodes:
        op = _nsa_op(node)
        if op is not None and op not in NOT_BRANCHES:
            found.append(Branch(graph_id, module_path(node), BRANCH_OPS.get(op, op), True, node.name, f"nsa.{op}",
                                *user_line(node)))
            continue
        eager = _eager_kind(node)
        if eager is None:
            continue
        kind, name = eager
        where = module_path(node)
        # the refusals of passes that take other kinds of branch only say "not mine"
        others = {p for k, names in PASSES_FOR.items() if k != kind for p in names}
        reasons = [(p, "switched off (OptimizeConfig.disabled_passes)") for p in PASSES_FOR[kind] if p in disabled]
        reasons += [(p, r) for p, r in at_node.get(node.name, []) if p not in others]
        if kind == "gate":
            reasons += gate_sums.get(where, [])
        found.append(Branch(graph_id, where, kind, False, node.name, name, *user_line(node),
                            tuple(dict.fromkeys(reasons))))
    return found


@dataclass
class Layer:
    where: str
    branches: list[Branch] = field(default_factory=list)

    @property
    def rewritten(self) -> int:
        return sum(b.rewritten for b in self.branches)

    @property
    def detected(self) -> int:
        return len(self.branches)

    @property
    def ratio(self) -> str:
        return f"{self.rewritten}/{self.detected}"


@dataclass
class Coverage:
    """Branches grouped by layer (module path), in the order the layers first appear."""

    branches: list[Branch]

    @property
    def layers(self) -> list[Layer]:
        by_where: dict[str, Layer] = {}
        for b in self.branches:
            by_where.setdefault(b.where, Layer(b.where)).branches.append(b)
        return list(by_where.values())

    @property
    def eager(self) -> list[Branch]:
        return [b for b in self.branches if not b.rewritten]

    @property
    def rewritten(self) -> int:
        return sum(b.rewritten for b in self.branches)

    def summary(self) -> str:
        """One line, e.g. '10/10 NSA branches rewritten (blocks.0.attn 5/5, blocks.1.attn 5/5)'."""
        if not self.branches:
            return "no NSA branch detected (no softmax, attention or top-k left, no nsa op)"
        layers = ", ".join(f"{layer.where} {layer.ratio}" for layer in self.layers)
        return f"{self.rewritten}/{len(self.branches)} NSA branches rewritten ({layers})"

    def layer_rows(self) -> list[list[str]]:
        rows = []
        for layer in self.layers:
            done = Counter(b.label for b in layer.branches if b.rewritten)
            left = Counter(b.label for b in layer.branches if not b.rewritten)
            rows.append([layer.where, layer.ratio, _counted(done) or "-", _counted(left) or "-"])
        return rows

    def eager_rows(self) -> list[list[str]]:
        return [[b.where, b.label, b.source or "?", b.code, b.why()] for b in self.eager]

    def table(self) -> str:
        """The per-layer table, then each eager branch with its source line and reasons."""
        text = tabulate(self.layer_rows(), headers=["layer", "rewritten", "rewritten branches", "left eager"],
                        tablefmt="github")
        if self.eager:
            text += f"\n\nleft eager ({len(self.eager)}): each runs as the eager code\n"
            text += tabulate(self.eager_rows(), headers=["layer", "branch", "source", "line", "why"],
                             tablefmt="github")
        return text

    def to_json(self) -> dict:
        return {"rewritten": self.rewritten, "detected": len(self.branches),
                "layers": [{"where": layer.where, "rewritten": layer.rewritten, "detected": layer.detected,
                            "branches": [b.label for b in layer.branches]} for layer in self.layers],
                "eager": [b.to_json() for b in self.eager]}


def _counted(labels: Counter) -> str:
    return ", ".join(label if n == 1 else f"{n} x {label}" for label, n in labels.items())


def coverage_of(state) -> Coverage:
    """The coverage of what a model runs now: over its graphs, each Dynamo frame at its latest
    compile (a recompile, e.g. for a new shape, replaces the frame's earlier graphs)."""
    latest: dict[object, object] = {}
    for record in state.graphs:
        if record.frame is not None:
            latest[record.frame] = max(latest.get(record.frame, record.frame_compile), record.frame_compile)
    kept = [r for r in state.graphs if r.frame is None or r.frame_compile == latest[r.frame]]
    return Coverage([b for r in kept for b in r.branches])
