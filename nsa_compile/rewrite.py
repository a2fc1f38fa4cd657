"""The anatomy every rewrite pass shares, the context it runs in, and the log each run writes.

A pass is an object with a `name` (containing its family word: gqa, gate, rope, selection,
window, compress, chunk), a one-line `summary`, and `apply(graph, ctx)`, which rewrites a Dynamo
(torch IR) FX graph in place. `ctx` (PassContext) holds the OptimizeConfig the graph is compiled
under (`ctx.config`: the backend choices) and the pass's log, and tells the log of every match
(`ctx.matched`) and every refusal, with a reason (`ctx.refused`). A refused candidate must leave
the graph unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from .fx import module_path

if TYPE_CHECKING:  # a type only: config.py imports the registry, which imports this module
    from .config import OptimizeConfig

__all__ = ["RewritePass", "PassContext", "PassLog", "Match", "Refusal"]

FAMILIES = ("gqa", "gate", "rope", "selection", "window", "compress", "chunk")


@dataclass(frozen=True)
class Match:
    node: str  # the source node that was rewritten
    where: str  # module path, e.g. 'blocks.0.attn'
    kernel: str  # what it became


@dataclass(frozen=True)
class Refusal:
    node: str
    where: str
    reason: str


@dataclass
class PassLog:
    """What one pass did to one graph."""

    pass_name: str
    graph_id: int
    matches: list[Match] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    code_after: str = ""  # the graph's code after this pass (for per-pass diffs)

    def matched(self, node: fx.Node, kernel: str) -> None:
        self.matches.append(Match(node.name, module_path(node), kernel))

    def refused(self, node: fx.Node, reason: str) -> None:
        self.refusals.append(Refusal(node.name, module_path(node), reason))


@dataclass
class PassContext:
    """What a pass gets besides the graph: the config the graph is compiled under and its log."""

    config: OptimizeConfig
    log: PassLog

    def matched(self, node: fx.Node, kernel: str) -> None:
        self.log.matched(node, kernel)

    def refused(self, node: fx.Node, reason: str) -> None:
        self.log.refused(node, reason)


class RewritePass:
    """Base of every rewrite. Subclasses set `name` and `summary` and implement `apply`."""

    name: str = ""
    summary: str = ""

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        raise NotImplementedError

    def source_files(self) -> tuple[str, ...]:
        """Files whose contents decide this pass's behaviour (they enter the cache key)."""
        return (inspect.getfile(type(self)),)

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


def check_pass(p: RewritePass) -> None:
    """Raise if `p` lacks the anatomy (used when a pass is registered)."""
    if not isinstance(p, RewritePass):
        raise TypeError(f"{p!r} is not a RewritePass")
    if not p.name or not p.name.replace("_", "").isalnum():
        raise ValueError(f"pass name {p.name!r} must be a non-empty identifier")
    if not any(word in p.name for word in FAMILIES) and not p.name.startswith("user_"):
        raise ValueError(
            f"pass name {p.name!r} must contain a family word ({', '.join(FAMILIES)}) or start with 'user_'"
        )
    if not p.summary:
        raise ValueError(f"pass {p.name!r} needs a one-line summary")
