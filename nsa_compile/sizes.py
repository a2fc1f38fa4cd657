"""Symbolic sizes (dynamic shapes) given numbers, so that a pass can check a candidate by evaluating it.

Once a size changes between calls, Dynamo compiles the graph again with that size as a symbol:
a SymInt graph input (`s27`), expressions of it in the graph (`s27 // 4`, `s27 + 16`) and fake
tensors of shape `(1, s27, 64)`. The passes check what a candidate computes by evaluating it (the
window mask row by row, a region on probe values, probe.py), and evaluation needs numbers.

`Sizes` is one assignment of numbers to a graph's symbols. `Sizes.of(graph)` gives the values
Dynamo saw (its hints); `probes()` gives that assignment and two more, each symbol moved by +1
and by +19, and a pass checks its candidate under every one of them: one compiled graph serves
every size its guards allow, so a check at one size is not enough. The three sizes differ in
parity and in their residue modulo every power of two up to 16 and every block size up to 19, so
a mask or block map off at some residue differs on one of them (a check on probe sizes, as the
packed window's check on probe positions is, not a proof for every size). A static graph has no
symbols: `probes()` is then just the one assignment and every method returns the sizes as they are.

Passes read sizes through `int()` and `shape()` and never call `int()`, `bool()` or `==` on a
SymInt themselves: those add guards to Dynamo's shape environment, and a guard on a symbol's
value specializes the graph to it (a recompile per size, the thing a dynamic graph is for).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

__all__ = ["Sizes", "PROBE_STEPS", "is_size"]

# Each probe moves every symbol by this much from the size Dynamo saw (0: the hint itself).
PROBE_STEPS = (0, 1, 19)


def is_size(node: fx.Node) -> bool:
    """Whether the node's value is a size (a SymInt: the input `s27`, `s27 // 4`), not a tensor."""
    return isinstance(node.meta.get("example_value", node.meta.get("val")), torch.SymInt)


def _free_symbols(x) -> set:
    if isinstance(x, torch.SymInt):
        return set(x.node.expr.free_symbols)
    if isinstance(x, torch.Tensor):
        return set().union(*(_free_symbols(d) for d in x.shape)) if x.dim() else set()
    return set()


def _hint(symbol: sympy.Symbol, graph: fx.Graph) -> int:
    for node in graph.nodes:
        val = node.meta.get("example_value", node.meta.get("val"))
        env = getattr(getattr(val, "node", None), "shape_env", None)
        if env is None and isinstance(val, torch.Tensor):
            env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
        # backed_var_to_val on newer PyTorch (var_to_val there warns), var_to_val on 2.11
        values = None if env is None else getattr(env, "backed_var_to_val", None)
        values = values if values is not None else getattr(env, "var_to_val", None)
        if values is not None and symbol in values:
            return int(values[symbol])
    raise ValueError(f"no value recorded for the size symbol {symbol}")


class Sizes:
    """Numbers for a graph's size symbols (empty for a static graph)."""

    def __init__(self, graph: fx.Graph, values: dict):
        self.graph = graph
        self.values = dict(values)  # sympy.Symbol -> int

    @classmethod
    def of(cls, graph: fx.Graph) -> "Sizes":
        """The sizes Dynamo saw when it traced `graph` (its hints)."""
        symbols = set()
        for node in graph.nodes:
            symbols |= _free_symbols(node.meta.get("example_value", node.meta.get("val")))
        return cls(graph, {s: _hint(s, graph) for s in sorted(symbols, key=str)})

    @property
    def symbolic(self) -> bool:
        return bool(self.values)

    def probes(self) -> list["Sizes"]:
        """This assignment, then each symbol moved by every further PROBE_STEPS (none when static)."""
        if not self.symbolic:
            return [self]
        return [Sizes(self.graph, {s: v + step for s, v in self.values.items()}) for step in PROBE_STEPS]

    def scaled(self, factor: int) -> "Sizes":
        """Every symbol's number times `factor` (longer probes)."""
        return Sizes(self.graph, {s: v * factor for s, v in self.values.items()})

    def int(self, x) -> int:
        """A size (an int, or a SymInt of this graph) as a number under this assignment."""
        if isinstance(x, torch.SymInt):
            expr = x.node.expr.xreplace({s: sympy.Integer(v) for s, v in self.values.items()})
            if not expr.is_number:
                raise ValueError(f"the size {x} has symbols without a value: {expr.free_symbols}")
            return int(expr)
        return int(x)

    def shape(self, x) -> tuple[int, ...]:
        """A tensor's (or a shape's) sizes as numbers."""
        dims = x.shape if isinstance(x, torch.Tensor) else x
        return tuple(self.int(d) for d in dims)

    def size_nodes(self) -> dict:
        """Every node of the graph whose value is a size (a SymInt input such as `s27`, or an
        expression of sizes), with its number: the values a region's evaluation reads for them."""
        found = {}
        for node in self.graph.nodes:
            val = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(val, torch.SymInt):
                found[node] = self.int(val)
        return found

    def describe(self) -> str:
        return ", ".join(f"{s}={v}" for s, v in self.values.items()) or "static"
