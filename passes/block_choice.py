"""A block choice as user code writes it: the ranking key a top-k or sort reads, and whether the
choice it makes can be causal.

select_blocks rewrites causal choices; what it refuses, and selected_attention's reason for
block ids it cannot take, both need the same reading of the key: its fills (+-inf cells from
positions only, evaluated at compile time), the importance under them, and the varlen layout.
It lives here so that both passes read it (select_blocks also asks selected_attention whether
its ids are read as sets, so neither pass may import the other for this).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from nsa_compile.attention_match import Refused, ancestors
from nsa_compile.fx import arg, op_name, same, value

from . import compressed_attention as cmp

INF = float("inf")


def first_arg(node: fx.Node):
    return arg(node, 0, "input")


def unbatched_key(ranking: fx.Node) -> str | None:
    """The refusal for a sort or topk over the last dim of a 3-D float key computed from 3-D
    softmax probabilities (varlen scores [H, T, ..] with no batch dim: compressed_attention's
    `unbatched`), or None for another form."""
    key = first_arg(ranking)
    dim = arg(ranking, 2 if op_name(ranking) == "topk" else 1, "dim", -1)
    if cmp.unbatched(value(key), dim) is None:
        return None
    scores = next((cmp.unbatched(value(n), arg(n, 1, "dim")) for n in written_from(key)
                   if op_name(n) == "softmax" and cmp.unbatched(value(n), arg(n, 1, "dim")) is not None), None)
    if scores is None:
        return None
    shape = ", ".join(str(n) for n in value(key).shape)
    return f"the ranking key [{shape}] is computed from {scores}; select_blocks reads a [B, G, S, Ns] key"


def written_from(node: fx.Node, cap: int = 10_000) -> set[fx.Node]:
    """The nodes `node` is computed from, the in-place writes into it and into them included
    (x = zeros(..); x[.., :k] = y; x.scatter_(..): y and the scatter's inputs too), up to `cap` nodes."""
    seen, stack = set(), [node]
    while stack and len(seen) < cap:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
        stack.extend(u for u in x.users if op_name(u) == "setitem" or (op_name(u) or "").endswith("_"))
    return seen


# ops a ranking key is read through back to its importance: they keep +-inf cells +-inf
_KEY_CASTS = ("to", "float", "type", "contiguous", "clone")
# ops that may write constants into some cells of the key: the walk stops undecided at them
_KEY_WRITERS = ("index_put", "index_put_", "masked_fill", "masked_fill_", "where", "scatter", "scatter_", "setitem",
                "copy_", "fill_", "clamp", "clamp_min", "clamp_max", "nan_to_num", "masked_scatter")


def position_only(node, subgraphs) -> bool:
    """node is a number or a tensor computed from positions only."""
    if not isinstance(node, fx.Node):
        return isinstance(node, (int, float))
    try:
        subgraphs.evaluate(node, "key offset")
    except Refused:
        return False
    return True


def position_mask(mask: fx.Node, subgraphs) -> torch.Tensor | None:
    """A key fill's bool mask evaluated at compile time, the zeros_like / ones_like it reads taken
    as the constants they are (they read only their input's shape, data or not); None where it
    depends on data or is not bool."""
    like = {}
    for node in ancestors([mask], into_sizes=False):
        name, val = op_name(node), value(node)
        if name in ("zeros_like", "ones_like") and val is not None:
            make = torch.zeros if name == "zeros_like" else torch.ones
            like[node] = make(subgraphs.shape(val), dtype=val.dtype)
    try:
        got = subgraphs.evaluate(mask, "key mask", inputs=like, probe="zeros_like/ones_like")
    except Refused:
        return None
    return got if isinstance(got, torch.Tensor) and got.dtype == torch.bool else None


def noncausal_reason(key: fx.Node, subgraphs) -> str | None:
    """The refusal for a ranking key [.., Ns] (any layout) whose position-only +-inf fills leave,
    in every query row, some block j >= 1 ranked by its importance: the row t = 0 (whose only past
    block is block 0) then ranks blocks of later tokens, so the choice is not causal. None where
    some row hides every block after block 0, or where the key's fills cannot be evaluated."""
    val = value(key)
    if val is None or val.dim() < 2:
        return None
    shape = subgraphs.shape(val)
    Ns = shape[-1]
    if not isinstance(Ns, int) or Ns < 2:
        return None
    hidden = torch.zeros(shape, dtype=torch.bool, device="cpu")  # cells a position-only fill sets to +-inf
    node, fills = key, 0
    while isinstance(node, fx.Node):
        filled = cmp.fill_of(node, -INF) or cmp.fill_of(node, INF)
        name = cmp.name_of(node) or ""
        if filled is not None:
            x, mask, sense = filled
            cells = position_mask(mask, subgraphs)
            if cells is None:
                return None
            try:
                hidden |= torch.broadcast_to((cells if sense else ~cells).cpu(), shape)
            except RuntimeError:
                return None
            node, fills = x, fills + 1
        elif name in _KEY_CASTS:
            node = first_arg(node)
        elif name in ("add", "sub") and len(node.args) == 2 and isinstance(node.args[0], fx.Node) \
                and position_only(node.args[1], subgraphs):
            node = node.args[0]  # a tie-break or offset from positions: finite, +-inf stays +-inf
        elif name == "add" and len(node.args) == 2 and isinstance(node.args[1], fx.Node) \
                and position_only(node.args[0], subgraphs):
            node = node.args[1]
        elif name in _KEY_WRITERS or op_name(node) in _KEY_WRITERS:
            return None  # cells may be set some other way: undecided
        else:
            break  # the importance
    if not isinstance(node, fx.Node) or bool(hidden[..., 1:].all(-1).any()):
        return None  # a row hides every block after block 0: possibly causal, the other checks judge it
    before = written_from(node)
    if not any(op_name(n) == "softmax" for n in before) or any(
            (cmp.name_of(n) or "") in _KEY_WRITERS for n in before):
        return None  # the importance may hide later blocks itself (scores masked before their softmax)
    lead = "the ranking key has no -inf fill" if not fills else "no candidate mask hides the blocks after the current one"
    return (f"{lead}: in every query row some block j >= 1 is ranked by its importance, t = 0 included (its only "
            "past block is block 0), and the importance is a softmax over unmasked scores (later tokens included), "
            "so the top-n choice reads the future (non-causal): which past blocks it keeps depends on later tokens; "
            "NSA ranks only the blocks j with j * l' <= t (-inf elsewhere)")


def size_of(x):
    """An int argument as it is, or the SymInt a size node stands for (a graph with symbolic
    sizes passes sizes such as the key's width as nodes); None for anything else."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    val = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, fx.Node) else None
    return val if isinstance(val, torch.SymInt) else None


def clamped_count(k, width) -> int | None:
    """n when a top-k's k is min(n, width) as a size node (torch.sym_min(n, W): a model's
    `min(n, blocks)` at symbolic sizes), n a positive constant and W the key's width; else None."""
    if not isinstance(k, fx.Node) or op_name(k) != "sym_min" or len(k.args) != 2 or k.kwargs:
        return None
    n, other = k.args if isinstance(k.args[0], int) else k.args[::-1]
    other = size_of(other)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or other is None or not same(other, width):
        return None
    return n
