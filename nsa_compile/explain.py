"""What `nsa-compile explain` (and the coverage lines of `bench` and `demo`) reads and prints.

The data: each pass's row (report() plus nodes before/after), the near misses, Dynamo's graph
breaks and the frames it skipped whole (with the user's source lines), the coverage per layer
(coverage.py), the rewritten graphs as networkx graphs. The rendering: GitHub-style tables.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re

import click
import networkx as nx
import torch
from tabulate import tabulate

from .api import report, state_of
from .config import OptimizeConfig
from .coverage import Coverage, coverage_of, shown_path
from .ops import registry

__all__ = ["pass_table", "near_misses", "coverage", "backend_table", "graph_breaks", "skipped_frames",
           "networkx_graph", "to_dot", "to_graphml", "print_pass_table", "print_near_misses", "print_backend_table",
           "print_graph_breaks", "print_coverage", "coverage_line", "rewrite_summary"]


# --- what the passes did --------------------------------------------------------------------------


def pass_table(model) -> list[dict]:
    """report() rows plus nodes before/after, summed over graphs."""
    state = state_of(model)
    rows = []
    for r in report(model):
        logs = [log for g in state.graphs for log in g.logs if log.pass_name == r["name"]]
        rows.append({**r, "nodes_before": sum(log.nodes_before for log in logs),
                     "nodes_after": sum(log.nodes_after for log in logs)})
    return rows


def near_misses(model) -> list[dict]:
    state = state_of(model)
    return [
        {"pass": log.pass_name, "graph": g.graph_id, "where": r.where, "node": r.node, "reason": r.reason}
        for g in state.graphs for log in g.logs for r in log.refusals
    ]


def coverage(model) -> Coverage:
    """Per layer, the NSA branches the optimized model runs rewritten and those left eager."""
    return coverage_of(state_of(model))


def backend_table(config: OptimizeConfig | None = None) -> list[dict]:
    """Per custom op (ops/registry.py): its config field and what `config` asks of it, the
    backends 'auto' tries in order, those taken only where named, and those whose backward is not
    bitwise repeatable, with why."""
    config = config or OptimizeConfig()
    return [{"op": op.name, "field": op.config_field, "asked": config.backend(op.name),
             "auto_order": [b.name for b in op.backends if b.in_auto],
             "named_only": [b.name for b in op.backends if not b.in_auto],
             "not_deterministic": {b.name: b.nondeterministic for b in op.backends if b.nondeterministic}}
            for op in registry.ops()]


# --- what Dynamo did ------------------------------------------------------------------------------


def graph_breaks(model, inputs: tuple) -> list[dict]:
    """Dynamo's graph breaks of one forward, with reasons and the user's source lines.

    torch._dynamo.explain runs the captured graphs eagerly at the real size; without grad, so that
    each layer's intermediates are freed as it goes (with grad, the eager seed model at S 512 on
    the CPU kept over 24 GB of gathered K/V for its backward and was killed)."""
    torch._dynamo.reset()
    with torch.no_grad():
        result = torch._dynamo.explain(model)(*inputs)
    torch._dynamo.reset()
    breaks = []
    for b in result.break_reasons:
        frames = [f for f in (b.user_stack or []) if "torch/" not in f.filename.replace("\\", "/")]
        where = frames[-1] if frames else (b.user_stack[-1] if b.user_stack else None)
        breaks.append({"reason": str(b.reason).strip().splitlines()[0],
                       "source": f"{where.filename}:{where.lineno}" if where else "?",
                       "line": (where.line or "").strip() if where else ""})
    return breaks


# Dynamo's log line for a frame it gives up on and runs eagerly whole (a graph break inside a loop,
# an error it suppresses): "WON'T CONVERT <function> <file> line <first line> ..." (convert_frame.py)
_WONT_CONVERT = re.compile(r"WON'T CONVERT (?P<fn>\S+) (?P<file>.+?) line (?P<line>\d+)")
_DYNAMO_FRAMES = "torch._dynamo.convert_frame"


class _SkippedFrames(logging.Handler):
    """Collects the frames Dynamo skipped whole from its log; passes on what would have been shown."""

    def __init__(self, found: list[dict], shown_from: int):
        super().__init__(logging.INFO)
        self.found, self.shown_from = found, shown_from

    def emit(self, record: logging.LogRecord) -> None:
        head = _WONT_CONVERT.match(str(record.msg))
        if head is not None:
            self.found.append(_skipped_frame(head, record))
        if record.levelno >= self.shown_from:  # what Dynamo's own handlers would have printed
            logging.getLogger(_DYNAMO_FRAMES).parent.handle(record)


def _skipped_frame(head: re.Match, record: logging.LogRecord) -> dict:
    err = record.exc_info[1] if record.exc_info else None
    text = str(err).strip() if err is not None else ""
    first = text.splitlines()[0] if text else "an error Dynamo suppressed"
    in_loop = "graph break in loop" in text or "for/while loop" in text
    stack = getattr(err, "real_stack", None) or []
    where = stack[-1] if stack else None
    frame = f"{shown_path(head['file'])}:{head['line']}"
    return {"function": head["fn"], "frame": frame,
            "source": f"{shown_path(where.filename)}:{where.lineno}" if where else frame,
            "line": (where.line or "").strip() if where else "",
            "reason": f"{first}{', inside a loop' if in_loop else ''}: Dynamo runs the whole function eagerly"}


@contextlib.contextmanager
def skipped_frames():
    """Collect, while the block runs, the frames Dynamo skips whole (no graph, no rewrite: the
    function runs eagerly, silently otherwise), as dicts: function, frame (file:first line),
    source and line (where Dynamo gave up), reason. Reads Dynamo's INFO log of convert_frame for
    the block only; records at the level shown before are still shown."""
    found: list[dict] = []
    logger = logging.getLogger(_DYNAMO_FRAMES)
    level, propagate = logger.level, logger.propagate
    handler = _SkippedFrames(found, logger.getEffectiveLevel())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        unique = list({(f["frame"], f["source"], f["reason"]): f for f in found}.values())
        found[:] = unique


# --- exports ----------------------------------------------------------------------------------------


def networkx_graph(record) -> nx.DiGraph:
    g = nx.DiGraph(name=f"graph_{record.graph_id}")
    for name, op, target, inputs in record.nodes_after:
        g.add_node(name, op=op, target=target, rewritten=name in record.new_nodes)
        for src in inputs:
            g.add_edge(src, name)
    return g


def to_dot(g: nx.DiGraph) -> str:
    lines = [f'digraph "{g.graph["name"]}" {{', "  node [shape=box, fontsize=10];"]
    for name, data in g.nodes(data=True):
        style = ', style=filled, fillcolor="#ffd27f"' if data["rewritten"] else ""
        label = f"{name}\\n{data['target']}".replace('"', "'")
        lines.append(f'  "{name}" [label="{label}"{style}];')
    lines += [f'  "{a}" -> "{b}";' for a, b in g.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_graphml(g: nx.DiGraph) -> str:
    buffer = io.BytesIO()
    nx.write_graphml(g, buffer)
    return buffer.getvalue().decode()


# --- tables and lines -------------------------------------------------------------------------------


def print_pass_table(rows: list[dict]) -> None:
    table = [
        [r["name"], r["matches"], ", ".join(r["where"]) or "-", "; ".join(r["kernels"]) or "-", r["refused"],
         f'{r["nodes_before"]} -> {r["nodes_after"]}', f'{r["time_ms"]:.1f}']
        for r in rows
    ]
    click.echo(tabulate(table, headers=["pass", "matches", "where", "became", "refused", "nodes", "ms"],
                        tablefmt="github"))


def print_near_misses(misses: list[dict]) -> None:
    if not misses:
        return
    click.echo("\nnear misses (candidates a pass looked at and refused):")
    grouped: dict[tuple, list[str]] = {}
    for m in misses:
        grouped.setdefault((m["pass"], m["reason"]), []).append(m["where"])
    table = [[p, reason, len(wheres), ", ".join(dict.fromkeys(wheres))] for (p, reason), wheres in grouped.items()]
    click.echo(tabulate(table, headers=["pass", "reason", "count", "where"], tablefmt="github"))


def print_backend_table(rows: list[dict]) -> None:
    table = [[r["op"], f'{r["field"]}={r["asked"]!r}', " > ".join(r["auto_order"]), ", ".join(r["named_only"]) or "-",
              "; ".join(f"{name}: {why}" for name, why in r["not_deterministic"].items()) or "-"]
             for r in rows]
    click.echo(tabulate(table, headers=["op", "config", "auto tries", "only by name", "backward not deterministic"],
                        tablefmt="github"))


def print_graph_breaks(breaks: list[dict], skipped: list[dict] = ()) -> None:
    """The graph breaks, then the frames Dynamo skipped whole (skipped_frames())."""
    if not breaks and not skipped:
        click.echo("\nno graph breaks: every pattern was seen whole")
    if breaks:
        click.echo(f"\ngraph breaks ({len(breaks)}): a break splits a pattern and can prevent its rewrite")
        click.echo(tabulate([[b["source"], b["line"], b["reason"]] for b in breaks],
                            headers=["source", "line", "reason"], tablefmt="github"))
    if skipped:
        click.echo(f"\nframes Dynamo skipped whole ({len(skipped)}): nothing in them is compiled or rewritten")
        click.echo(tabulate([[f"{f['function']} ({f['frame']})", f["source"], f["line"], f["reason"]] for f in skipped],
                            headers=["function", "source", "line", "reason"], tablefmt="github"))


def print_coverage(cov: Coverage) -> None:
    """The coverage section of explain's table: the summary line, the per-layer table, the eager branches."""
    click.echo(f"\ncoverage: {cov.summary()}")
    if cov.branches:
        click.echo(cov.table())


def coverage_line(cov: Coverage) -> str:
    """One line for bench and demo: the summary, and where branches stay eager."""
    line = f"coverage: {cov.summary()}"
    if cov.eager:
        left = ", ".join(f"{b.where} {b.label} ({b.source or '?'})" for b in cov.eager)
        line += f"; left eager: {left} (why: nsa-compile explain)"
    return line


def rewrite_summary(rows: list[dict]) -> str:
    """One line: matches and refusals per pass, e.g. 'optimize ran with: window_attention 12 (refused 36), ...'."""
    parts = [f"{r['name']} {r['matches']}" + (f" (refused {r['refused']})" if r["refused"] else "") for r in rows]
    return "optimize ran with: " + ", ".join(parts) + " (reasons: nsa-compile explain)"
