"""selection_attention: the eager selected-block branch (gather, repeat, masked per-query attention)
-> one GQA-native selected-attention op.

Matches (torch IR), anchored at the softmax (models/nsa.py `NSAAttention.selected_attention`):
    tokens = (block_idx.clamp(min=0)[..., None] * l' + arange(l')).flatten(-2)   # [B, G, S, n*l']
    valid = (block_idx >= 0)[..., None].expand(..., l').flatten(-2) & (tokens <= t)
    index = tokens.clamp(max=S - 1).flatten(2)[..., None]                      # [B, G, S*n*l', 1]
    k_sel = torch.gather(k, 2, index.expand(-1, -1, -1, Dk)).view(B, G, S, n*l', Dk)   # k [B, G, S, Dk]
    k_sel = k_sel.repeat_interleave(h, dim=1)                                   # optional (h = 1)
    scores = upcast(q.unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * c   # q [B, H, S, Dk]
    p = softmax(scores.masked_fill(~valid.repeat_interleave(h, 1), -inf), dim=-1)  # or where(valid, scores, -inf)
    o = (p.to(v.dtype).unsqueeze(-2) @ v_sel).squeeze(-2)                        # v_sel as k_sel
upcast: .float(), .to(float32) or none (fp32); squeeze and upcast in either order; c: `* c`,
`c *`, `/ c` with a python number, or no scale (c = 1); `p = torch.nan_to_num(p)` after the
softmax (canonicalize's form of SDPA's rows with no key: 0, the op's own result, so no NaN fill);
the fill a large negative (finfo.min, -1e9: `attention_match.is_large_negative`) in place of -inf
where block_idx is nsa.select_blocks' output (every row keeps its own token, so the two agree).
Packed documents (models/nsa.py with pos [B, S], each token's position in its document): the
token ids also add the query's document start, blocks being counted within the document,
    tokens = tokens + (t - pos[:, None, :, None])                               # [B, G, S, n*l']

Verified, not assumed: the gather index and the mask must be functions of one int64 tensor
block_idx [B, G, S, n] and of positions only (the nearest such tensor that every path from them
to the graph's inputs passes through), or, for packed documents, of block_idx, positions and one
int64 [B, S] graph input, the document positions pos (a placeholder such as `l_pos_`, read
through any slices and views). Those subgraphs are evaluated at compile time on probe
block ids of the real shape (padding -1, block 0, the current partial block, a block in the
future, blocks past the end, duplicates, and random ids), and for every (b, head, t) the
gathered tokens kept by the mask must be exactly the tokens <= t of the blocks >= 0, token =
block * l' + offset (l' = n*l' / n from the shapes), as a multiset (the order of the slots does
not change attention). The mask must be the same for the h heads of a group. Unlike the window
pass's mask (no inputs, so its evaluation is a proof), this is a check on two probes of block
ids, not a proof for every block_idx; the probes vary by batch, group, query and slot so that
code treating any of them differently shows. Identical subgraphs (one per layer) are evaluated
once per graph. A query whose blocks hold no token <= t gets 0 from the op (ops/selection.py)
where eager's softmax over all -inf gives NaN: the rewrite then sets those rows to NaN, as eager
(`o.masked_fill(lse == -inf, nan)`, fused by Inductor into o's consumer), unless block_idx is
the output of `nsa.select_blocks` (block_selection's op), which forces each query's current
block, so every row holds its own token and the fill is left out.
With pos the check runs on the product of probe positions and probe block ids (4 x 2): the
positions of a probe differ per batch row and cycle through one document (arange), documents of
odd lengths (1, 2, l' - 1, 3, longer than n * l', ...), documents starting at block boundaries
and one token off them, and random packings; the block probes are drawn relative to each
query's document (its current block pos[t] // l', the one before, the next, ...), and the kept
tokens must be those of the blocks counted from the document start, (t - pos[t]) + block * l' +
offset <= t. Again a check on probes, not a proof for every pos.

Symbolic sizes (dynamic shapes: Dynamo compiles one graph for every length once S changes): B
and S may be size symbols (s27), the heads, n, l' and head dims must be constants. Shapes are
compared as sizes (statically_known_true: equal for every value of the symbols, no guard added;
q, K, V, the block ids and pos must share B and S, as they do when all come from one input or
the model checks pos's shape), and the selection subgraph, which reads the sizes (arange(s27),
clamp(max=s27 - 1)), is evaluated on the probes above at each assignment of
`nsa_compile.sizes.Sizes.probes()` (the sizes Dynamo saw, then every symbol +1 and +19), the
graph's size nodes given their numbers there; the verification cap applies at each. A refusal
then names the sizes where the probe failed ("at s27=43: the mask is off by one ..."). The op
reads B and S from its tensors: the rewrite writes no size into the graph.

Becomes `torch.ops.nsa.selected_attention(q, k, v, block_idx, l', c, backend)[0]` (NaN-filled as
above where rows may be empty) on the un-gathered,
un-repeated q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv] (nsa_compile/ops/selection.py), with
the pos node as a last argument for packed documents: no gathered or repeated K/V, no
[B, H, S, n*l'] scores in the graph. The backend is chosen here from the fake tensors and written
into the graph (`triton` on CUDA, else `reference`; with pos only `reference` runs); `explain`
shows which and, for reference, why not triton.

Refuses (graph unchanged), with the reason shown by `explain`:
- a softmax not followed by p.unsqueeze(-2) @ v_sel (compressed branch, gates, dense attention);
- scores, probabilities, the masked tensor, the gathered or repeated K/V used anywhere else;
- fp16/bf16 scores without the upcast (the op computes the softmax in float32);
- a finite fill where the block ids may leave a query no token (eager's uniform average there);
- K/V not gathered along the sequence dim of [B, G, S, D] with one token id per row;
- token ids or a mask that depend on other data, or that differ from the blocks on the probes:
  padding not masked, the current token hidden or a later one seen (off by one), a mapping that
  is not block * l' + offset (overlapping blocks), a mask that differs across a group's heads;
  with pos: blocks counted from the row start instead of the document start, a document start
  off by one, a mask that compares row-start token ids (ignores pos);
- shapes that do not fit; a verification larger than the cap;
- at symbolic sizes: heads, n, l' or head dims that are symbols; q, K, V, block ids (or pos) whose
  B and S are not provably the same sizes (separate inputs get separate symbols); a selection
  right at one probe size and wrong at another.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.attention_match import (
    Refused, erase_replaced, evaluate_node, keep_mask, mask_fill, only_user, strip_upcast, unrepeat,
)
from nsa_compile.fx import MATMULS, arg, call, op_name, value
from nsa_compile.ops.common import upcast_dtype
from nsa_compile.ops.selection import choose_backend, why_not_triton
from nsa_compile.rewrite import PassLog, RewritePass
from nsa_compile.sizes import Sizes

# The probes evaluate the position-only subgraphs at the real shape, on the device of the graph's
# tensors; more elements than this (summed over the nodes that materialize a tensor, per probe)
# are not verified. The cost grows as B * S * (H + c) * n*l': 39.9M elements at the seed shape,
# S = 1024, batch 1 (the refusal reason prints it: run the pass with the cap set to 1). 2^27
# refused the seed model from S = 8192 on, and the refused branch ran as the eager gather code:
# 490 against 150,242 tok/s (NOTES.md, 2026-11-26). Each intermediate is freed after its last
# use, so the transient memory is a few of the largest tensors (about 1 GB each for the seed
# shape at 64k, B*G*S*n*l' int64), not the sum; 2^34 verifies the seed shape to S = 64k at
# batch 2 and the paper shape (64 heads) to 64k at batch 1. Each distinct subgraph is verified
# once per compile (the layers of a model share one).
MAX_VERIFIED_ELEMENTS = 2**34
KERNEL = "nsa.selected_attention[{backend}] (l'={block}, n={n}, GQA-native, no gathered K/V{packed}{empty}{why})"
# block ids that may leave a query without a token <= t: its row is NaN, as eager's softmax makes it
EMPTY_ROWS = "; rows with no token: NaN as eager"
PACKED = ", packed documents (pos)"

# Ops that return a view (no new elements) when the selection subgraphs are evaluated.
_VIEWS = {"expand", "expand_as", "broadcast_to", "view", "unsqueeze", "squeeze", "getitem", "transpose",
          "permute", "unflatten", "movedim", "swapaxes", "as_strided", "t"}
_OPERATOR_IN_PLACE = {"iadd", "iand", "ior", "ixor", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                      "ilshift", "irshift", "imatmul"}
_RANDOM = ("rand", "bernoulli", "dropout", "multinomial", "normal", "poisson", "uniform", "exponential")


def first(node: fx.Node):
    """The tensor a unary op / method works on (positional or `input=`)."""
    return arg(node, 0, "input")


def operands(mm: fx.Node) -> tuple:
    """(left, right) of a matmul or bmm, positional or by keyword."""
    return arg(mm, 0, "input"), arg(mm, 1, "other", arg(mm, 1, "mat2"))


def dims(node: fx.Node, what: str, rank: int) -> tuple:
    """The shape of `node` (ints, SymInts where sizes are symbolic), which must have `rank` dims,
    or Refused."""
    val = value(node)
    if val is None or val.dim() != rank:
        got = "unknown" if val is None else f"{val.dim()}-D"
        raise Refused(f"the {what} is {got}, not {rank}-D")
    return tuple(val.shape)


def same(a, b) -> bool:
    """Whether two sizes, or two shapes, are equal for every value of their size symbols
    (statically_known_true: no guard is added to Dynamo's shape environment, an equality it cannot
    decide is False). Plain ints compare as ints."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return statically_known_true(a == b)


def constant(what: str, **sizes) -> None:
    """Refused unless every size given is a constant (an int): heads, gathered tokens per query,
    blocks per query and head dims may not vary with the sequence length."""
    for name, d in sizes.items():
        if not isinstance(d, int):
            raise Refused(f"the {what} has a symbolic size {name} = {d}; only the batch and sequence sizes may vary")


def is_size(node: fx.Node) -> bool:
    """A node whose value is a size (a SymInt: the input s27, s27 - 1), not a tensor."""
    return isinstance(node.meta.get("example_value", node.meta.get("val")), torch.SymInt)


def ancestors_upto(roots: list[fx.Node], stop: fx.Node | None = None) -> set[fx.Node]:
    """Every node the roots depend on (roots included), not walking through `stop` nor through
    sizes (SymInt nodes: the probes give them numbers, whatever tensor they were read from)."""
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is not stop and not is_size(node):
            stack.extend(node.all_input_nodes)
    return seen


def is_dim(node: fx.Node, name: str, index: int, rank: int, want: int) -> bool:
    """node is `name(x, dim)` (unsqueeze/squeeze) with dim == want modulo `rank`."""
    d = arg(node, index, "dim")
    return op_name(node) == name and isinstance(d, int) and d % rank == want


def is_last_two_transpose(node: fx.Node, rank: int) -> bool:
    if op_name(node) not in ("transpose", "swapaxes"):
        return False
    d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
    return isinstance(d0, int) and isinstance(d1, int) and {d0 % rank, d1 % rank} == {rank - 2, rank - 1}


def scores_chain(masked_input: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """scaled scores -> (the q @ k^T matmul, scale, the nodes in between, matmul excluded).

    Accepts [scale] after {squeeze(-2), upcast} in either order; the scale must come after the
    upcast (the op multiplies in the upcast dtype)."""
    chain, node, scale = [], masked_input, 1.0
    name, (a, b) = op_name(node), (node.args + (None, None))[:2]
    if name == "mul" and isinstance(b, (int, float)) and isinstance(a, fx.Node):
        chain.append(node)
        node, scale = a, float(b)
    elif name == "mul" and isinstance(a, (int, float)) and isinstance(b, fx.Node):
        chain.append(node)
        node, scale = b, float(a)
    elif name in ("truediv", "div") and isinstance(b, (int, float)) and isinstance(a, fx.Node) and not node.kwargs:
        chain.append(node)
        node, scale = a, 1.0 / float(b)
    elif name in ("mul", "truediv", "div"):
        raise Refused("the scores are not scaled by a constant (q @ k^T * c)")
    seen = set()
    while op_name(node) not in MATMULS:
        only_user(node, "score tensor")
        val = value(node)
        if "squeeze" not in seen and val is not None and is_dim(node, "squeeze", 1, val.dim() + 1, 3):
            seen.add("squeeze")
        elif "upcast" not in seen and strip_upcast(node) is not node:
            seen.add("upcast")
        else:
            raise Refused("the scores are not upcast(q.unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * c")
        chain.append(node)
        node = first(node)
        if not isinstance(node, fx.Node):
            raise Refused("the scores are not q.unsqueeze(-2) @ k_sel^T")
    if "squeeze" not in seen:
        raise Refused("the per-query scores are not squeezed back to [B, H, S, T] (.squeeze(-2))")
    only_user(node, "score tensor")
    return node, scale, chain


def gathered(sel: fx.Node, what: str, B: int, G: int, S: int, T: int) -> tuple[fx.Node, fx.Node, list[fx.Node]]:
    """sel [B, G, S, T, D] = gather(x [B, G, S, D], 2, index [B, G, S*T, D]).view(...) ->
    (x, index, [sel, gather])."""
    only_user(sel, f"gathered {what}")
    D = dims(sel, f"gathered {what}", 5)[4]
    constant(f"gathered {what}", D=D)
    if not same(dims(sel, f"gathered {what}", 5), (B, G, S, T, D)):
        raise Refused(f"the gathered {what} is {tuple(value(sel).shape)}, not [B, G, S, T, D] = {(B, G, S, T, D)}")
    g = first(sel)
    if op_name(sel) not in ("view", "reshape", "unflatten") or not isinstance(g, fx.Node):
        raise Refused(f"the gathered {what} is not a view of torch.gather(x, 2, index) rows")
    if op_name(g) != "gather" or arg(g, 3, "sparse_grad", False):
        raise Refused(f"{what} is not gathered per query (torch.gather(x, 2, index).view(B, G, S, T, D))")
    only_user(g, f"gathered {what}")
    src, dim, index = arg(g, 0, "input"), arg(g, 1, "dim"), arg(g, 2, "index")
    if not isinstance(src, fx.Node) or not isinstance(index, fx.Node) or not isinstance(dim, int):
        raise Refused(f"{what} is not gathered with a tensor index along a constant dim")
    if not same(dims(g, f"gathered {what}", 4), (B, G, S * T, D)) or dim % 4 != 2:
        raise Refused(f"{what} is not gathered along the sequence dim of [B, G, S, D] (dim 2, rows S * T)")
    if not same(dims(src, what, 4), (B, G, S, D)):
        raise Refused(f"{what} is {tuple(value(src).shape)}, not [B, G, S, D] = {(B, G, S, D)}")
    if not same(dims(index, f"{what} gather index", 4), (B, G, S * T, D)) or value(index).dtype != torch.int64:
        raise Refused(f"the {what} gather index is not an int64 [B, G, S * T, D] tensor")
    return src, index, [sel, g]


def is_positions(node: fx.Node, B: int, S: int) -> bool:
    """node may be the document positions pos: an int64 [B, S] tensor."""
    val = value(node)
    return val is not None and val.dtype == torch.int64 and same(tuple(val.shape), (B, S))


def find_block_idx(roots: list[fx.Node], B: int, G: int, S: int,
                   order: dict) -> tuple[fx.Node, fx.Node | None, list[fx.Node]]:
    """The int64 [B, G, S, n] tensor nearest the roots through which alone (with at most one int64
    [B, S] graph input, the document positions) they depend on data, that input (None without
    one), and the position-only nodes between them and the roots (in graph order), or Refused."""
    candidates = [n for n in ancestors_upto(roots) if (val := value(n)) is not None and val.dtype == torch.int64
                  and val.dim() == 4 and same(tuple(val.shape[:3]), (B, G, S))]
    if not candidates:
        raise Refused("no int64 [B, G, S, n] block index tensor feeds the token ids and the mask")
    # the reason of the candidate nearest to passing: the fewest other data inputs, and of those the
    # farthest from the roots (nearer ones would blame the block index itself)
    closest = None
    for block_idx in sorted(candidates, key=order.__getitem__, reverse=True):
        nodes = [n for n in ancestors_upto(roots, stop=block_idx) if n is not block_idx and not is_size(n)]
        data = [n for n in nodes if n.op not in ("call_function", "call_method")]
        positions = [n for n in data if is_positions(n, B, S)]
        if len(data) == len(positions) <= 1:
            pos = positions[0] if positions else None
            return block_idx, pos, sorted((n for n in nodes if n is not pos), key=order.__getitem__)
        others = sorted((n for n in data if n not in positions), key=order.__getitem__)
        if others:
            why = (f"the token ids or the mask depend on {others[0].op} {others[0].name} "
                   "(data other than one [B, G, S, n] block index tensor and positions)")
        else:
            names = ", ".join(n.name for n in sorted(positions, key=order.__getitem__))
            why = (f"the token ids or the mask depend on {len(positions)} int64 [B, S] inputs ({names}); "
                   "packed documents take one, the positions pos")
        if closest is None or len(others) <= closest[0]:
            closest = (len(others), why)
    raise Refused(closest[1])


def in_place(node: fx.Node) -> bool:
    """x.clamp_(...), torch.relu_(x), operator.iand(x, y) (x &= y), ...: a node that mutates its input."""
    name = op_name(node) or ""
    if node.op == "call_function" and isinstance(node.target, type(operator.iand)) and \
            getattr(node.target, "__module__", "") in ("_operator", "operator"):
        return name in _OPERATOR_IN_PLACE
    return name.endswith("_") and not name.startswith("_")


def check_evaluable(nodes: list[fx.Node], leaves: list[fx.Node], B, H: int, S, T: int,
                    probe_sizes: list[Sizes]) -> None:
    """Refused unless the nodes can be run at compile time, with a bounded cost at each of the
    probe sizes, and give what they give at run time (nothing random, nothing changed in place,
    no SymInt constants in their arguments). The leaves (block_idx, and pos for packed documents)
    are given by the probes, the sizes they read (s27, s27 - 1) by probe_sizes."""
    for node in [*leaves, *nodes]:
        name = op_name(node) or ""
        if node not in leaves and any(word in name for word in _RANDOM):
            raise Refused(f"the token ids or the mask use {name} (random, not positions)")
        for user in node.users:
            if in_place(user):
                raise Refused(f"the token ids or the mask are changed in place ({op_name(user)})")
        for x in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(x, torch.SymInt):
                raise Refused("the token ids or the mask have a symbolic size as a constant argument (not a size "
                              "node of the graph): not evaluated")
    for at in probe_sizes:
        cost = at.int(B) * H * at.int(S) * T + sum(math.prod(at.shape(value(n))) for n in nodes
                                                    if value(n) is not None and op_name(n) not in _VIEWS)
        if cost > MAX_VERIFIED_ELEMENTS:
            where = f" (at {at.describe()})" if at.symbolic else ""
            raise Refused(f"verifying the selection takes {cost:,} elements per probe{where}, over the cap of "
                          f"{MAX_VERIFIED_ELEMENTS:,}: not verified at this size yet")


class _Input:
    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"<input {self.i}>"


class _Size:
    def __init__(self, node: fx.Node):
        self.expr = str(node.meta.get("example_value", node.meta.get("val")))

    def __repr__(self) -> str:
        return f"<size {self.expr}>"


def structure(nodes: list[fx.Node], leaves: list[fx.Node], roots: list[fx.Node]) -> str:
    """What the subgraph computes from its leaves (block_idx [, pos]) and sizes (by their symbolic
    expression, s27 - 1), as text: equal texts compute the same function (same ops, same constants,
    same wiring), so one verification serves both."""
    index = {**{leaf: i for i, leaf in enumerate(leaves)}, **{node: i + len(leaves) for i, node in enumerate(nodes)}}
    ops = [(node.op, node.target,
            fx.node.map_arg((node.args, node.kwargs), lambda n: _Input(index[n]) if n in index else _Size(n)))
           for node in nodes]
    return repr((ops, [index[r] for r in roots]))


def evaluate(nodes: list[fx.Node], leaves: dict, roots: list[fx.Node]) -> list:
    """Run the position-only nodes (graph order) with the leaves given ({block_idx: probe[, pos:
    probe positions]}); the roots' values."""
    env = dict(leaves)
    last_use = {}  # input node -> index of the last node that reads it (freed after that)
    for i, node in enumerate(nodes):
        for x in node.all_input_nodes:
            last_use[x] = i
    keep = set(roots)
    for i, node in enumerate(nodes):
        env[node] = evaluate_node(node, env, "the token ids and the mask on probe block ids")
        for x in node.all_input_nodes:
            if last_use[x] == i and x not in keep and x not in leaves:
                del env[x]
    return [env[r] for r in roots]


def probes(B: int, G: int, S: int, n: int, block: int, device, pos: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Block ids [B, G, S, n]: one structured (per slot and query: padding, block 0, the current
    block, duplicates of it, the next block (future), one past the last block, far past the end,
    the previous block), one random in [-1, Ns + 1]. With pos [B, S] the blocks are those of each
    query's document (the current block is pos[t] // l')."""
    Ns = -(-S // block)
    t = torch.arange(S, device=device)[:, None]
    position = t.expand(B, S, 1) if pos is None else pos[:, :, None]  # [B, S, 1]
    cur = position // block
    choices = torch.stack(torch.broadcast_tensors(
        torch.full_like(cur, -1), torch.zeros_like(cur), cur, cur, cur + 1, torch.full_like(cur, Ns),
        torch.full_like(cur, Ns + 3), cur - 1), dim=-1)[:, :, 0]  # [B, S, 8]
    b, g, i = (torch.arange(x, device=device) for x in (B, G, n))
    pick = (b[:, None, None, None] + 3 * g[None, :, None, None] + t[None, None] + i[None, None, None]) % 8
    structured = torch.gather(choices[:, None].expand(B, G, S, 8), 3, pick.expand(B, G, S, n))
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-1, Ns + 2, (B, G, S, n), generator=gen).to(device)
    return [structured, rand]


def document_lengths(kind: int, S: int, n: int, block: int, seed: int) -> list[int]:
    """Lengths of the documents of one probe row (summing to S): 0 one document, 1 odd lengths
    (1, 2, shorter than a block, longer than n blocks), 2 documents starting on block boundaries
    and one token off them, 3 random lengths."""
    if kind == 0:
        return [S]
    if kind == 3:
        gen = torch.Generator().manual_seed(seed)
        cycle = torch.randint(1, 2 * n * block + 2, (S,), generator=gen).tolist()
    else:
        cycle = ([1, 2, block - 1, 3, n * block + 5, block + 3, 5] if kind == 1
                 else [block, 2 * block, block + 1, block - 1, 3 * block])
    lengths, total, i = [], 0, 0
    while total < S:
        length = min(max(1, cycle[i % len(cycle)]), S - total)
        lengths.append(length)
        total, i = total + length, i + 1
    return lengths


POSITION_KINDS = 4


def position_probes(B: int, S: int, n: int, block: int, device) -> list[torch.Tensor]:
    """Document positions pos [B, S] int64, one probe per kind of `document_lengths`: row b of
    probe i packs documents of kind (i + b) % 4, so the rows of a probe differ and with one row
    every kind is still probed."""
    out = []
    for i in range(POSITION_KINDS):
        rows = []
        for b in range(B):
            lengths = document_lengths((i + b) % POSITION_KINDS, S, n, block, seed=i * 1009 + b)
            rows.append(torch.cat([torch.arange(length) for length in lengths]))
        out.append(torch.stack(rows).to(device))
    return out


def verify(keep: torch.Tensor, tokens: torch.Tensor, blocks: torch.Tensor, block: int, h: int,
           pos: torch.Tensor | None = None) -> None:
    """keep [B, H, S, T] bool, tokens [B, G, S, T] (gather index) for block ids blocks [B, G, S, n]:
    for each (b, head, t) the kept tokens must be the multiset {start + block * l' + o <= t :
    block >= 0}, start = t - pos[b, t] with pos [B, S] (packed documents), else 0."""
    B, G, S, n = blocks.shape
    keep5 = keep.reshape(B, G, h, S, -1)
    if not bool((keep5 == keep5[:, :, :1]).all()):
        raise Refused("the mask differs between the heads of a group (the group shares its blocks)")
    keep = keep5[:, :, 0]
    offsets = torch.arange(block, device=blocks.device)
    expected = (blocks.clamp(min=0)[..., None] * block + offsets).flatten(-2)  # [B, G, S, T]
    t = torch.arange(S, device=blocks.device)[:, None]
    start = 0 if pos is None else (t[:, 0] - pos)[:, None, :, None]  # document start [B, 1, S, 1]
    expected = expected + start
    chosen = (blocks >= 0)[..., None].expand(B, G, S, n, block).flatten(-2)
    valid = chosen & (expected <= t)
    if torch.equal(keep, valid) and torch.equal(torch.where(keep, tokens, 0), torch.where(valid, expected, 0)):
        return
    # slot order does not change attention: compare the kept tokens of each query as multisets
    big = torch.iinfo(torch.int64).max
    got = torch.where(keep, tokens, big).sort(dim=-1).values
    want = torch.where(valid, expected, big).sort(dim=-1).values
    if torch.equal(got, want):
        return
    if pos is not None:
        document_miss(keep, tokens, expected, chosen, start, t)
    padding = (blocks < 0)[..., None].expand(B, G, S, n, block).flatten(-2)
    if bool((keep & valid & (tokens != expected)).any()):
        origin = "" if pos is None else " from the document start t - pos[t]"
        raise Refused(f"the token ids are not block * l' + offset{origin} for l' = {block} (overlapping or "
                      "shifted blocks?)")
    if bool((keep & padding).any()):
        raise Refused("padding (block id -1) is not masked: a query would see tokens of a block it did not choose")
    if bool((keep & ~valid).any()):
        later = keep & ~valid & ~padding
        if bool((expected[later] == t.expand_as(expected)[later] + 1).all()):
            raise Refused("the mask is off by one: query t sees token t + 1 (tokens <= t + 1 instead of <= t)")
        raise Refused("the mask is non-causal: a query sees a later token of its blocks")
    hidden = ~keep & valid
    if bool((expected[hidden] == t.expand_as(expected)[hidden]).all()):
        raise Refused("the mask is off by one: query t does not see itself (tokens < t instead of <= t)")
    raise Refused("the mask hides tokens <= t of the chosen blocks")


def document_miss(keep, tokens, expected, chosen, start, t) -> None:
    """Refused naming the packed-document mistake the probe shows, if it is one of the near ones:
    token ids counted from the row start, a document start off by one, a mask that compares the
    row-start ids with t. keep, tokens, expected, chosen [B, G, S, T]; start [B, 1, S, 1]."""
    kept = keep & chosen
    in_row = expected < keep.shape[2]  # the gather index of a later token may be clamped to S - 1
    if bool(kept.any()):
        shift = (tokens - expected)[kept]
        if torch.equal(shift, (-start).expand_as(expected)[kept]) and bool((shift != 0).any()):
            raise Refused("the token ids are counted from the row start (block * l' + offset), not from the "
                          "document start t - pos[t]")
        if bool((shift == 1).all()) or bool((shift == -1).all()):
            sign = "+" if bool((shift == 1).all()) else "-"
            raise Refused(f"the document start is off by one: token ids (t - pos[t]) {sign} 1 + block * l' + offset")
        row_start_mask = chosen & (expected - start <= t)
        if torch.equal(tokens[kept & in_row], expected[kept & in_row]) and torch.equal(keep, row_start_mask):
            raise Refused("the mask compares token ids counted from the row start with t (it ignores the "
                          "document start t - pos[t])")


class SelectionAttention(RewritePass):
    name = "selection_attention"
    summary = "gathered per-query selected-block attention -> nsa.selected_attention, no gathered K/V"

    def apply(self, graph: fx.Graph, log: PassLog) -> None:
        verified = set()  # structures of selection subgraphs already verified (one per layer is the same)
        sizes = Sizes.of(graph)
        for softmax in list(graph.nodes):
            if op_name(softmax) != "softmax" or softmax.graph is not graph or softmax._erased:
                continue
            order = {node: i for i, node in enumerate(graph.nodes)}  # graph positions (rewrites add nodes)
            try:
                plan = self.check(softmax, order, verified, log.config.selection_backend if log.config else "auto",
                                  sizes)
            except Refused as why:
                log.refused(softmax, str(why))
                continue
            self.rewrite(graph, plan)
            why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
            log.matched(softmax, KERNEL.format(block=plan["block"], n=plan["n"], backend=plan["backend"],
                                               packed="" if plan["pos"] is None else PACKED,
                                               empty=EMPTY_ROWS if may_leave_rows_empty(plan) else "", why=why))

    def check(self, softmax: fx.Node, order: dict, verified: set, requested: str = "auto",
              sizes: Sizes | None = None) -> dict:
        """The plan for the rewrite (module docstring), or Refused. In a graph with symbolic sizes
        (B and S may be SymInts; heads, n, l' and head dims must be constants) the selection is
        verified at every probe assignment of `sizes` (Sizes.probes: the sizes Dynamo saw, then
        every size symbol +1 and +19), a refusal naming the sizes where it failed."""
        sizes = Sizes.of(softmax.graph) if sizes is None else sizes
        probs = value(softmax)
        dim = arg(softmax, 1, "dim")
        if probs is None or probs.dim() != 4 or not isinstance(dim, int) or dim % 4 != 3:
            raise Refused("not a softmax over the last dim of [B, H, S, T] scores")
        if arg(softmax, 2, "dtype") is not None:
            raise Refused("the softmax has a dtype argument")
        # forward: p -> [nan_to_num] -> [.to(v.dtype)] -> unsqueeze(-2) -> @ v_sel -> squeeze(-2)
        nxt = only_user(softmax, "probability tensor")
        zeroed = None
        if is_nan_to_zero(nxt, softmax):  # rows with no token -> 0, as the op gives them
            zeroed, nxt = nxt, only_user(nxt, "probability tensor")
        cast = None
        if op_name(nxt) in ("to", "type_as"):
            cast, nxt = nxt, only_user(nxt, "probability tensor")
        p4 = nxt
        pv = only_user(p4, "probability tensor") if is_dim(p4, "unsqueeze", 1, 5, 3) else None
        if pv is None or op_name(pv) not in MATMULS or operands(pv)[0] is not p4 or operands(pv)[1] is p4:
            raise Refused("the probabilities are not multiplied by V per query (p.unsqueeze(-2) @ v_sel)")
        out = only_user(pv, "per-query output")
        if not is_dim(out, "squeeze", 1, 5, 3):
            raise Refused("the per-query output is not squeezed back to [B, H, S, Dv] (.squeeze(-2))")
        B, H, S, T = dims(softmax, "probability tensor", 4)
        constant("probability tensor", H=H, T=T)
        # backward: masked <- [scale] <- {squeeze, upcast} <- q.unsqueeze(-2) @ k_sel^T
        masked = first(softmax)
        if not isinstance(masked, fx.Node):
            raise Refused("the softmax input is not a tensor computed in the graph")
        scaled = first(masked) if op_name(masked) == "masked_fill" else arg(masked, 1, "input")
        if not isinstance(scaled, fx.Node):
            raise Refused(f"the softmax input is {op_name(masked)}, not masked scores")
        mask, keep_where_true = keep_mask(masked, scaled, finite=True)
        fill = mask_fill(masked)
        only_user(masked, "masked score tensor")
        only_user(scaled, "score tensor")
        qk, scale, chain = scores_chain(scaled)
        low, high = value(qk), value(scaled)
        if low is None or high is None:
            raise Refused("the score dtypes are unknown")
        if high.dtype != upcast_dtype(low.dtype):
            raise Refused(f"the softmax runs in {high.dtype} on {low.dtype} scores; the op computes it in "
                          f"{upcast_dtype(low.dtype)}")
        q4, kt = operands(qk)
        if not isinstance(q4, fx.Node) or not is_dim(q4, "unsqueeze", 1, 5, 3) or not isinstance(first(q4), fx.Node):
            raise Refused("the scores are not q.unsqueeze(-2) @ k_sel^T (one query row per token)")
        only_user(q4, "query row tensor")
        q = first(q4)
        Dk = dims(q, "query tensor", 4)[3]
        constant("query tensor", Dk=Dk)
        if not same(dims(q, "query tensor", 4), (B, H, S, Dk)):
            raise Refused(f"q is {tuple(value(q).shape)}, not [B, H, S, Dk] with [B, H, S] = {(B, H, S)}")
        if not isinstance(kt, fx.Node) or not is_last_two_transpose(kt, 5) or not isinstance(first(kt), fx.Node):
            raise Refused("the gathered keys are not transposed over their last two dims (k_sel.transpose(-1, -2))")
        only_user(kt, "transposed gathered K")
        k_rep, v_rep = first(kt), operands(pv)[1]
        if not isinstance(v_rep, fx.Node):
            raise Refused("the probabilities are not multiplied by gathered V")
        k_sel, h_k = unrepeat(k_rep)
        v_sel, h_v = unrepeat(v_rep)
        repeats = [n for n, sel in ((k_rep, k_sel), (v_rep, v_sel)) if n is not sel]
        for node in repeats:
            only_user(node, "repeated gathered K/V")
        G = dims(k_sel, "gathered K", 5)[1]
        constant("gathered K", G=G)
        if h_k != h_v or G * h_k != H or not same(dims(v_sel, "gathered V", 5)[1], G):
            raise Refused(f"gathered K/V heads {G} (x{h_k}) and {value(v_sel).shape[1]} (x{h_v}) do not serve "
                          f"{H} query heads")
        k, k_index, k_nodes = gathered(k_sel, "K", B, G, S, T)
        v, v_index, v_nodes = gathered(v_sel, "V", B, G, S, T)
        if value(k).dtype != value(q).dtype or not value(v).is_floating_point():
            raise Refused("q and K differ in dtype, or V is not floating point")
        if cast is not None and value(cast).dtype != value(v).dtype:
            raise Refused(f"the probabilities are cast to {value(cast).dtype}, not to V's {value(v).dtype}")
        # the selection: block_idx, positions and (packed documents) pos only, evaluated on probes
        roots = [mask, k_index, v_index]
        block_idx, pos, nodes = find_block_idx(roots, B, G, S, order)
        leaves = [block_idx] if pos is None else [block_idx, pos]
        n = dims(block_idx, "block index tensor", 4)[3]
        constant("block index tensor", n=n)
        if n == 0 or T % n:
            raise Refused(f"the {T} gathered tokens per query are not n * l' for the n = {n} blocks")
        block = T // n
        check_evaluable(nodes, leaves, B, H, S, T, sizes.probes())
        key = (structure(nodes, leaves, roots), tuple(d if isinstance(d, int) else str(d) for d in (B, H, G, S, T, n)),
               keep_where_true)
        if key not in verified:
            for at in sizes.probes():
                try:
                    self.verify_at(at, nodes, roots, block_idx, pos, (k_index, v_index), (G, H, T, n, block),
                                   keep_where_true, B, S)
                except Refused as why:
                    raise (Refused(f"at {at.describe()}: {why}") if sizes.symbolic else why) from None
        verified.add(key)
        if fill != float("-inf") and may_leave_rows_empty({"rows_zeroed": False, "block_idx": block_idx}):
            raise Refused(f"the scores are filled with {fill:g}, not -inf, and the block ids may leave a query no "
                          "token (they are not nsa.select_blocks' output): such a row gets the uniform average of its "
                          "gathered tokens in eager code, 0 or NaN from the op")
        fakes = [value(x) for x in (q, k, v, block_idx)]
        fake_pos = None if pos is None else value(pos)
        try:
            backend = choose_backend(*fakes, block, requested, fake_pos)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(selection_backend={requested!r}): {why}") from None
        return {"q": q, "k": k, "v": v, "block_idx": block_idx, "pos": pos, "block": block, "n": n, "scale": scale,
                "backend": backend,
                "why_not_triton": why_not_triton(*fakes, block, fake_pos) if requested == "auto"
                else f"selection_backend={requested!r} in OptimizeConfig",
                "out": out, "rows_zeroed": zeroed is not None,
                "chain": [out, pv, p4, cast, zeroed, softmax, masked, *chain, qk, q4, kt, *repeats, *k_nodes, *v_nodes],
                "roots": roots}

    @staticmethod
    def verify_at(at: Sizes, nodes: list[fx.Node], roots: list[fx.Node], block_idx: fx.Node, pos: fx.Node | None,
                  indices: tuple[fx.Node, fx.Node], heads: tuple, keep_where_true: bool, B, S) -> None:
        """The selection subgraph (nodes, from block_idx [and pos] to roots = [mask, K index, V
        index]) evaluated on the probe block ids (and positions) at the sizes `at` (B and S as
        numbers there, the graph's size nodes given their numbers), each result checked by
        `verify`; Refused at the first probe that differs. heads = (G, H, T, n, l')."""
        G, H, T, n, block = heads
        B, S = at.int(B), at.int(S)
        numbers = at.size_nodes() if at.symbolic else {}
        device = value(block_idx).device
        positions = [None] if pos is None else position_probes(B, S, n, block, device)
        for probe_pos, probe in [(p, blocks) for p in positions for blocks in probes(B, G, S, n, block, device, p)]:
            given = {**numbers, block_idx: probe} if pos is None else {**numbers, block_idx: probe, pos: probe_pos}
            m, ki, vi = evaluate(nodes, given, roots)
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                raise Refused("the mask is not a bool tensor")
            try:
                keep = torch.broadcast_to(m, (B, H, S, T))
            except RuntimeError:
                raise Refused(f"the mask {tuple(m.shape)} does not broadcast to the scores {(B, H, S, T)}") from None
            keep = keep if keep_where_true else ~keep
            tokens = []
            for what, index, traced in zip("KV", (ki, vi), indices):
                if not isinstance(index, torch.Tensor) or tuple(index.shape) != at.shape(value(traced)):
                    raise Refused(f"the {what} gather index evaluates to something else than its traced shape")
                if index.stride(-1) != 0 and not torch.equal(index, index[..., :1].expand_as(index)):
                    raise Refused(f"the {what} gather index differs across the head dim (not one token per row)")
                tokens.append(index[..., 0].reshape(B, G, S, T))
            if not torch.equal(tokens[0], tokens[1]):
                raise Refused("K and V are gathered at different token ids")
            verify(keep, tokens[0], probe, block, H // G, probe_pos)
            if bool((tokens[0] < 0).any()) or bool((tokens[0] >= S).any()):  # eager's gather raises there
                raise Refused("the gather index leaves [0, S) on probe block ids (eager's gather would raise; "
                              "the op would ignore them)")

    def rewrite(self, graph: fx.Graph, plan: dict) -> None:
        out = plan["out"]
        packed = () if plan["pos"] is None else (plan["pos"],)  # unpacked graphs keep the 7-argument call
        both = call(graph, torch.ops.nsa.selected_attention, plan["q"], plan["k"], plan["v"], plan["block_idx"],
                    plan["block"], plan["scale"], plan["backend"], *packed, anchor=out)
        op = call(graph, operator.getitem, both, 0, anchor=out)  # o; the log-sum-exp is for the backward
        if may_leave_rows_empty(plan):  # eager's NaN where a query's blocks hold no token <= t
            lse = call(graph, operator.getitem, both, 1, anchor=out)
            empty = call(graph, torch.unsqueeze, call(graph, torch.isneginf, lse, anchor=out), -1, anchor=out)
            op = call(graph, torch.masked_fill, op, empty, float("nan"), anchor=out)
        out.replace_all_uses_with(op)
        # erase the per-query chain, then whatever only it used (token ids, mask, K/V views)
        erase_replaced(graph, plan["chain"], plan["roots"])

def is_nan_to_zero(node: fx.Node, p: fx.Node) -> bool:
    """node is torch.nan_to_num(p) with nan = 0 (posinf, neginf as default): the rows of -inf
    scores, NaN after the softmax, become 0 (the canonical form of SDPA's empty rows)."""
    nan = arg(node, 1, "nan", 0.0)
    return (op_name(node) == "nan_to_num" and first(node) is p and isinstance(nan, (int, float)) and nan == 0
            and arg(node, 2, "posinf") is None and arg(node, 3, "neginf") is None)


def may_leave_rows_empty(plan: dict) -> bool:
    """False when the eager code zeroes the rows with no token itself (nan_to_num after the
    softmax: the op's own result there), or when block_idx is nsa.select_blocks' output: it forces
    each query's current block (NSA's rule, kept by that op exactly), so every row holds its own
    token."""
    if plan["rows_zeroed"]:
        return False
    source = plan["block_idx"]
    return not (source.op == "call_function" and source.target in (torch.ops.nsa.select_blocks,
                                                                    torch.ops.nsa.select_blocks.default))


PASS = SelectionAttention()
