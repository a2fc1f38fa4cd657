"""selected_attention: the eager selected-block branch (gather, repeat, masked per-query attention)
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

Also read (issue 17: fla's and Hugging Face's code, tests/corpus):
- sequence-first: q [B, S, H, Dk], gathered K/V [B, S, G, T, D] repeated on dim 2, scores and
  mask [B, S, H, T], output [B, S, H, Dv]; the rewrite transposes q into the op and its output
  back (`Layout`);
- K/V gathered as `x.reshape(B*S*G, D).index_select(0, rows).view(.., T, D)` (x [B, S, G, D] or
  [B, G, S, D]), `torch.take_along_dim(x5, index, dim=3)` (x5 the source with a size-1 query
  axis, [B, 1, G, S, D]) or advanced indexing `x[b, tokens, g]` (`Gathered`): the probes decode
  each slot's batch row, KV group and token from the evaluated index tensors, and the batch row
  and group must be the slot's own;
- tiled GQA, K/V and mask copied with `.repeat(1, h, 1, 1, 1)` (query head r * G + g reads group
  g): the rewrite orders q's heads by group for the op (g * h + r) and the output back, and the
  probes check the mask per tiled group.

Packed [T, H, D] tokens (tests/corpus/xunhaolai_varlen.py; `VarlenSelected`): dense 3-D scores
[H, T, T] under a bool mask built from `nsa.select_blocks`' packed ids (select_blocks rewrote the
model's choice) and positions, checked on probe block choices drawn as that op draws them, becomes
the op on q[None], K[None], V[None] with the ids and the select_blocks op's positions.

A chunk of queries (issue 17): q = q_full[:, :, a:b] (`compressed_attention.query_rows`) with K/V
gathered by torch.gather from q_full's whole sequence [B, G, L, D]: the probes then put row r at
token a + r (ids up to ceil(L / l') + 1, kept tokens <= a + r, the gather inside [0, L)), and the
op gets q_offset = a and the whole K/V (the first chunk too, with q_offset 0). Heads-first only.

Block ids per query head ([B, H, S, n], tests/corpus/fused_qkv_per_head.py) gathered from K/V the
model repeated per head (repeat_kv, canonicalized to repeat_interleave(h, 1)) are this form with G =
H: the op reads the model's [B, H, S, D] copies (they stay; the match text says so instead of
"GQA-native").

lucidrains' fine branch (tests/corpus/lucidrains_*.py) over the ids of `nsa.select_blocks(rule=
'lucidrains')` ([B, G', S, n + 1], the diagonal block last) is read as a computation instead:
`LucidrainsFine` evaluates the whole branch on probe values and ids against the op.

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
the output of `nsa.select_blocks` (select_blocks's op), which forces each query's current
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
reads B and S from its tensors: the rewrite writes no size into the graph. Block ids whose number
is min(n, Ns) (select_blocks's op output cut as the model's top-k of min(n, blocks) took them,
`clamped_ids`) are read with their n = min(n, Ns) at each probe size, and the op gets the uncut
ids: the ids cut off are past the Ns blocks, where the op's are -1, so it attends to the same tokens.

Becomes `torch.ops.nsa.selected_attention(q, k, v, block_idx, l', c, backend)[0]` (NaN-filled as
above where rows may be empty) on the un-gathered,
un-repeated q [B, H, S, Dk], k [B, G, S, Dk], v [B, G, S, Dv] (nsa_compile/ops/selection.py), with
the pos node as a last argument for packed documents: no gathered or repeated K/V, no
[B, H, S, n*l'] scores in the graph. The backend is chosen here from the fake tensors and written
into the graph (`triton` on CUDA, packed documents too, else `reference`); `explain`
shows which and, for reference, why not triton.

Refuses (graph unchanged), with the reason shown by `explain`:
- a softmax not followed by p.unsqueeze(-2) @ v_sel (compressed branch, gates, dense attention);
- scores, probabilities, the masked tensor, the gathered or repeated K/V used anywhere else;
- fp16/bf16 scores without the upcast (the op computes the softmax in float32);
- a finite fill where the block ids may leave a query no token (eager's uniform average there);
- K/V not gathered along the sequence dim of [B, G, S, D] with one token id per row; rows of
  another batch row or KV group than the query's (index_select / advanced indexing); K and V
  copied for the heads differently;
- token ids or a mask that depend on other data, or that differ from the blocks on the probes:
  padding not masked, the current token hidden or a later one seen (off by one), a mapping that
  is not block * l' + offset (overlapping blocks), a mask that differs across a group's heads;
  with pos: blocks counted from the row start instead of the document start, a document start
  off by one, a mask that compares row-start token ids (ignores pos);
- shapes that do not fit; a verification larger than the cap;
- at symbolic sizes: heads, n (but for min(n, Ns) cut from nsa.select_blocks' ids), l' or head
  dims that are symbols; q, K, V, block ids (or pos) whose
  B and S are not provably the same sizes (separate inputs get separate symbols); a selection
  right at one probe size and wrong at another.
"""

from __future__ import annotations

import math
import operator
import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile import batch_slice, probe as region_probe, row_regions
from nsa_compile.row_regions import RowRegion, Rows
from nsa_compile.attention_match import (
    Refused, ancestors, erase_replaced, evaluate_node, keep_mask, mask_fill, only_user, strip_upcast, unrepeat,
)
from nsa_compile.fx import MATMULS, arg, call, op_name, same, value
from nsa_compile.ops.common import upcast_dtype
from nsa_compile.ops import selection_triton
from nsa_compile.ops.selection import choose_backend, why_not_triton
from nsa_compile.ops.selection import selected_attention as selected_attention_op
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes, is_size

from . import compressed_attention as cmp
from .compressed_attention import query_rows

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
KERNEL = "nsa.selected_attention[{backend}] (l'={block}, n={n}, {heads}, no gathered K/V{packed}{empty}{why})"
GQA_NATIVE = "GQA-native"
# block ids that may leave a query without a token <= t: its row is NaN, as eager's softmax makes it
EMPTY_ROWS = "; rows with no token: NaN as eager"
PACKED = ", packed documents (pos)"
# block ids per query head (G = H) over K/V that the model copied per head (repeat_interleave(h, 1)
# of [B, H / h, S, D]): the op reads the copies, one group per head
PER_HEAD = "per query head (block ids [B, H, S, n]; K/V read from the model's x{h} copies per query head, [B, H, S, D] each)"

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


def clamped_ids(block_idx: fx.Node, sizes: Sizes) -> tuple[fx.Node, int]:
    """(ids, n) for block ids [B, G, S, min(n, Ns)]: ids[..., :k], ids = nsa.select_blocks(.., n, ..)
    [B, G, S, n] and k = torch.sym_min(n, W) (select_blocks's rewrite of a model's top-k of
    min(n, blocks) at symbolic sizes), with W = Ns = ceil(S / l') at every probe size: the columns
    cut off are past the Ns blocks, where the op's ids are -1 (no tokens), so the op reading all n
    ids attends to the same tokens. Refused for any other block ids whose number is a symbol."""
    n = dims(block_idx, "block index tensor", 4)[3]
    why = (f"the block index tensor has a symbolic size n = {n}; only the batch and sequence sizes may vary (or "
           "n = min(n, Ns) cut from nsa.select_blocks' ids)")
    source, index = (block_idx.args + (None, None))[:2] if op_name(block_idx) == "getitem" else (None, None)
    targets = (torch.ops.nsa.select_blocks, torch.ops.nsa.select_blocks.default)
    if not (isinstance(source, fx.Node) and source.op == "call_function" and source.target in targets
            and isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
            and isinstance(index[1], slice) and index[1].start is None and index[1].step is None):
        raise Refused(why)
    k, n_op, block = index[1].stop, arg(source, 6, "n_selected"), arg(source, 5, "sel_block")
    if not isinstance(k, fx.Node) or op_name(k) != "sym_min" or n_op not in k.args or not isinstance(block, int):
        raise Refused(why)
    width = k.args[1] if k.args[0] == n_op else k.args[0]
    width = width.meta.get("example_value", width.meta.get("val")) if isinstance(width, fx.Node) else width
    S = value(source).shape[2]
    if not isinstance(width, (int, torch.SymInt)) or any(at.int(width) != -(-at.int(S) // block)
                                                         for at in sizes.probes()):
        raise Refused(f"the block ids are nsa.select_blocks' cut to min({n_op}, {width}), and {width} is not the "
                      f"number of selection blocks ceil(S / {block}) at every probe size")
    return source, n_op


def constant(what: str, **sizes) -> None:
    """Refused unless every size given is a constant (an int): heads, gathered tokens per query,
    blocks per query and head dims may not vary with the sequence length."""
    for name, d in sizes.items():
        if not isinstance(d, int):
            raise Refused(f"the {what} has a symbolic size {name} = {d}; only the batch and sequence sizes may vary")




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


@dataclass(frozen=True)
class Layout:
    """Where the heads sit in the per-query tensors: heads-first (scores [B, H, S, T], gathered K/V
    [B, G, S, T, D]; head = 1) or sequence-first (fla's and Hugging Face's [B, S, H, D] code:
    scores [B, S, H, T], gathered K/V [B, S, G, T, D]; head = 2). tiled: K/V copied for the heads
    with `.repeat` (query head r * G + g reads KV head g) instead of repeat_interleave (head
    g * h + r reads group g); the rewrite then orders q's heads by group and the output back."""

    head: int
    tiled: bool = False

    @property
    def seq(self) -> int:
        return 3 - self.head

    def slots(self, B, G, S, T) -> tuple:
        """The gathered tensors' leading dims in this layout: [B, G, S, T] or [B, S, G, T]."""
        return (B, G, S, T) if self.head == 1 else (B, S, G, T)

    def describe(self) -> str:
        order = "heads-first [B, H, S, D]" if self.head == 1 else "sequence-first [B, S, H, D]"
        return order + (", tiled GQA (head r * G + g reads KV head g)" if self.tiled else "")


def head_copy(node: fx.Node) -> tuple[fx.Node, int, int | None, bool]:
    """x_rep [B, .., T, D] -> (x, h, the repeated axis, tiled) when x_rep is x copied for the h heads
    of each group on axis 1 or 2: x.repeat_interleave(h, dim) (head g * h + r reads group g) or
    x.repeat(1, h, 1, 1, 1) / x.repeat(1, 1, h, 1, 1) (tiled: head r * G + g reads group g);
    else (node, 1, None, False)."""
    x, name = arg(node, 0, "input"), op_name(node)
    if not isinstance(x, fx.Node) or value(x) is None or value(x).dim() != 5:
        return node, 1, None, False
    if name == "repeat_interleave" and arg(node, 3, "output_size") is None:
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(repeats, int) and isinstance(dim, int) and dim % 5 in (1, 2):
            return x, repeats, dim % 5, False
    if name == "repeat" and node.op == "call_method" and not node.kwargs:
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = tuple(sizes[0])
        copied = [i for i, r in enumerate(sizes) if r != 1]
        if len(sizes) == 5 and all(isinstance(r, int) for r in sizes) and len(copied) == 1 and copied[0] in (1, 2):
            return x, sizes[copied[0]], copied[0], True
    return node, 1, None, False


@dataclass
class Gathered:
    """One gathered K or V, sel [*layout.slots(B, G, S, T), D]: rows of `source` at token ids that
    the `roots` (index tensors, evaluated on the probes) give. kind: how it is read,
      gather          torch.gather(x [B, G, S, D], 2, index [B, G, S*T, D]).view(B, G, S, T, D)
      index_select    x.reshape(B*S*G, D).index_select(0, rows).view(*slots, D), x [B, S, G, D] or
                      [B, G, S, D] (`source_seq_first`), rows = (b * S + token) * G + g (or the
                      [B, G, S, D] order)
      take_along_dim  torch.take_along_dim(x5, index, dim=3), x5 the source with a size-1 axis for
                      the queries ([B, 1, G, S, D] sequence-first, [B, G, 1, S, D] heads-first)
      indexing        x[b, tokens, g] (or x[b, g, tokens]), three broadcast int64 index tensors.
    Any of them may be gathered in the other layout and brought to this one by a transpose of
    its dims 1 and 2 (canonicalize's permute of a sequence-first gather: `transposed`)."""

    what: str
    kind: str
    source: fx.Node
    source_seq_first: bool
    roots: list[fx.Node]
    nodes: list[fx.Node]
    cast: torch.dtype | None = None  # the gathered rows cast to this float dtype (CUDA autocast's cast)
    transposed: bool = False  # gathered [B, S, G, T, D] (or [B, G, S, T, D]) and transposed over dims 1, 2

    def for_op(self, graph: fx.Graph, layout: Layout, anchor: fx.Node) -> fx.Node:
        """The source as the op reads it, [B, G, S, D] (a view; cast first where the rows were: a
        cast is elementwise, so the rows of the cast source are the cast rows)."""
        source = self.source if self.cast is None else call(graph, torch.Tensor.to, self.source, self.cast,
                                                            anchor=anchor)
        if self.kind == "take_along_dim":
            return call(graph, torch.squeeze, source, layout.seq, anchor=anchor)
        if self.source_seq_first:
            return call(graph, torch.transpose, source, 1, 2, anchor=anchor)
        return source

    def fake(self, layout: Layout):
        """The fake tensor of `for_op`'s result (for the backend choice)."""
        val = value(self.source) if self.cast is None else value(self.source).to(self.cast)
        if self.kind == "take_along_dim":
            return val.squeeze(layout.seq)
        return val.transpose(1, 2) if self.source_seq_first else val

    def coordinates(self, values: list, slots: tuple, B: int, G: int, S: int) -> tuple:
        """(batch row, KV group, token) read by each slot, each broadcast to `slots` (the gathered
        tensor's leading dims at the probe sizes), from the roots' values; Refused where the
        index differs across the head dim or leaves the source."""
        if self.transposed:  # read in the gathered tensor's own slots, then brought to these
            inner = dataclasses.replace(self, transposed=False)
            found = inner.coordinates(values, (slots[0], slots[2], slots[1], slots[3]), B, G, S)
            return tuple(None if x is None else x.transpose(1, 2) for x in found)
        if self.kind in ("gather", "take_along_dim"):
            (index,) = values
            if index.stride(-1) != 0 and not torch.equal(index, index[..., :1].expand_as(index)):
                raise Refused(f"the {self.what} gather index differs across the head dim (not one token per row)")
            tokens = index[..., 0].reshape(slots)
            return None, None, tokens
        if self.kind == "index_select":
            (rows,) = values
            if bool((rows < 0).any()) or bool((rows >= B * S * G).any()):
                raise Refused(f"the {self.what} rows of index_select leave [0, B * S * G) on probe block ids (eager's "
                              "index_select would raise)")
            rows = rows.reshape(slots)
            if self.source_seq_first:  # rows of [B, S, G, D]: (b * S + s) * G + g
                return rows // (S * G), rows % G, (rows // G) % S
            return rows // (G * S), (rows // S) % G, rows % S
        b, mid, last = (torch.broadcast_to(x, slots) for x in values)
        return (b, last, mid) if self.source_seq_first else (b, mid, last)


def float_cast(node: fx.Node) -> torch.dtype | None:
    """The dtype of a float-to-float cast on one device that keeps the shape, else None."""
    src = first(node) if isinstance(first(node), fx.Node) else None
    out, x = value(node), value(src) if src is not None else None
    if (op_name(node) in ("to", "float", "half", "bfloat16") and out is not None and x is not None
            and out.is_floating_point() and x.is_floating_point() and out.device == x.device
            and out.dtype != x.dtype and same(tuple(out.shape), tuple(x.shape))):
        return out.dtype
    return None


def read_gathered(sel: fx.Node, what: str, layout: Layout, B, G: int, S, T: int, keys=None) -> Gathered:
    """The gathered K or V `sel` [*layout.slots(B, G, S, T), D] read as one of Gathered's kinds,
    or Refused. keys: the length of the sequence a chunk of S queries is cut from (`query_rows`),
    which torch.gather's source may have in place of S; None for no chunk. A float cast of the
    gathered rows (CUDA autocast's `.to(bf16)` before the product) is read through: the op then
    reads the source cast (`Gathered.cast`); so is one between the gather and its view (where
    canonicalize's cast_hoist puts that cast)."""
    outer = float_cast(sel)
    if outer is not None:
        only_user(sel, f"gathered {what}")
        found = read_gathered(first(sel), what, layout, B, G, S, T, keys)
        return dataclasses.replace(found, cast=outer, nodes=[sel, *found.nodes])
    if swaps_dims_1_2(sel) and isinstance(first(sel), fx.Node) and value(first(sel)) is not None:
        # gathered in the other layout, transposed to this one (canonicalize's permute of a
        # sequence-first gather into the grouped heads-first form)
        only_user(sel, f"transposed gathered {what}")
        other = Layout(3 - layout.head, layout.tiled)
        found = read_gathered(first(sel), what, other, B, G, S, T, keys)
        if found.transposed:
            raise Refused(f"the gathered {what} is transposed twice")
        return dataclasses.replace(found, transposed=True, nodes=[sel, *found.nodes])
    only_user(sel, f"gathered {what}")
    D = dims(sel, f"gathered {what}", 5)[4]
    constant(f"gathered {what}", D=D)
    slots = layout.slots(B, G, S, T)
    if not same(dims(sel, f"gathered {what}", 5), (*slots, D)):
        names = "[B, G, S, T, D]" if layout.head == 1 else "[B, S, G, T, D]"
        raise Refused(f"the gathered {what} is {tuple(value(sel).shape)}, not {names} = {(*slots, D)}")
    inner, cast = first(sel), None
    reshaped = op_name(sel) in ("view", "reshape", "unflatten") and isinstance(inner, fx.Node)
    if reshaped and float_cast(inner) and op_name(first(inner)) in ("gather", "index_select"):
        only_user(inner, f"gathered {what}")
        inner, cast = first(inner), inner
    if reshaped and op_name(inner) in ("gather", "index_select"):
        found = (read_torch_gather(sel, inner, what, layout, B, G, S, T, D, keys) if op_name(inner) == "gather"
                 else read_index_select(sel, inner, what, B, G, S, T, D))
        if cast is None:
            return found
        return dataclasses.replace(found, cast=float_cast(cast), nodes=[sel, cast, *found.nodes[1:]])
    if op_name(sel) == "take_along_dim":
        return read_take_along_dim(sel, what, layout, slots, S, D)
    if op_name(sel) == "getitem" and isinstance(sel.args[1], tuple):
        return read_indexing(sel, what, B, G, S, D)
    raise Refused(f"{what} is not gathered per query (torch.gather(x, 2, index).view(B, G, S, T, D), "
                  "x.reshape(-1, D).index_select(0, rows), torch.take_along_dim or x[b, tokens, g])")


def swaps_dims_1_2(node: fx.Node) -> bool:
    """node is a 5-D x.permute(0, 2, 1, 3, 4) or x.transpose(1, 2) (either sign of the dims)."""
    val = value(node)
    if val is None or val.dim() != 5:
        return False
    if op_name(node) == "permute":
        dims_ = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [d % 5 for d in dims_] == [0, 2, 1, 3, 4]
    if op_name(node) in ("transpose", "swapaxes", "swapdims") and len(node.args) == 3:
        return sorted(d % 5 for d in node.args[1:] if isinstance(d, int)) == [1, 2]
    return False


def source_order(src: fx.Node, what: str, B, G: int, S, D: int) -> bool:
    """True if `src` is [B, S, G, D], False if [B, G, S, D] (the first where S and G are equal
    numbers: the probes then refuse the other); Refused otherwise."""
    shape = dims(src, what, 4)
    if same(shape, (B, S, G, D)):
        return True
    if same(shape, (B, G, S, D)):
        return False
    raise Refused(f"{what} is {tuple(value(src).shape)}, not [B, S, G, D] = {(B, S, G, D)} or [B, G, S, D]")


def read_torch_gather(sel, g, what, layout, B, G, S, T, D, keys=None) -> Gathered:
    if layout.head != 1:
        raise Refused(f"{what} is gathered into [B, G, S*T, D] rows (torch.gather along dim 2) but the scores are "
                      "sequence-first [B, S, H, T]")
    if arg(g, 3, "sparse_grad", False):
        raise Refused(f"{what} is gathered with sparse_grad=True")
    only_user(g, f"gathered {what}")
    src, dim, index = arg(g, 0, "input"), arg(g, 1, "dim"), arg(g, 2, "index")
    if not isinstance(src, fx.Node) or not isinstance(index, fx.Node) or not isinstance(dim, int):
        raise Refused(f"{what} is not gathered with a tensor index along a constant dim")
    if not same(dims(g, f"gathered {what}", 4), (B, G, S * T, D)) or dim % 4 != 2:
        raise Refused(f"{what} is not gathered along the sequence dim of [B, G, S, D] (dim 2, rows S * T)")
    if not same(dims(src, what, 4), (B, G, S, D)) and not (keys is not None and same(dims(src, what, 4),
                                                                                  (B, G, keys, D))):
        of = "" if keys is None else f" (or the {keys} tokens its chunk of queries is cut from)"
        raise Refused(f"{what} is {tuple(value(src).shape)}, not [B, G, S, D] = {(B, G, S, D)}{of}")
    if not same(dims(index, f"{what} gather index", 4), (B, G, S * T, D)) or value(index).dtype != torch.int64:
        raise Refused(f"the {what} gather index is not an int64 [B, G, S * T, D] tensor")
    return Gathered(what, "gather", src, False, [index], [sel, g])


def read_index_select(sel, picked, what, B, G, S, T, D) -> Gathered:
    only_user(picked, f"gathered {what}")
    flat, dim, rows = arg(picked, 0, "input"), arg(picked, 1, "dim"), arg(picked, 2, "index")
    if not isinstance(flat, fx.Node) or not isinstance(rows, fx.Node) or dim not in (0, -2):
        raise Refused(f"{what} is not read with index_select(0, rows) from a [B*S*G, D] tensor")
    src = first(flat)
    if op_name(flat) not in ("reshape", "view", "flatten") or not isinstance(src, fx.Node) \
            or not same(dims(flat, f"flattened {what}", 2), (B * S * G, D)):
        raise Refused(f"index_select reads {what} from {tuple(value(flat).shape)}, not from the [B*S*G, D] "
                      f"flattening of [B, S, G, D]")
    seq_first = source_order(src, what, B, G, S, D)
    if value(rows) is None or value(rows).dtype != torch.int64 or not same(dims(rows, "row ids", 1), (B * S * G * T,)):
        raise Refused(f"the {what} row ids of index_select are not an int64 [B*S*G*T] tensor")
    return Gathered(what, "index_select", src, seq_first, [rows], [sel, picked])


def read_take_along_dim(sel, what, layout, slots, S, D) -> Gathered:
    x5, index, dim = arg(sel, 0, "input"), arg(sel, 1, "indices"), arg(sel, 2, "dim")
    if not isinstance(x5, fx.Node) or not isinstance(index, fx.Node) or not isinstance(dim, int) or dim % 5 != 3:
        raise Refused(f"{what} is not taken along the token dim (torch.take_along_dim(x, index, dim=3))")
    want = list(slots)
    want[layout.seq], want[3] = 1, S  # one source row for every query, the tokens on the taken dim
    if not same(dims(x5, what, 5), (*want, D)):
        raise Refused(f"take_along_dim reads {what} from {tuple(value(x5).shape)}, not {tuple(want) + (D,)} "
                      "(the source with a size-1 query axis)")
    shape = dims(index, f"{what} index", 5)
    if value(index).dtype != torch.int64 or not same(shape[:4], slots) or not (same(shape[4], 1) or same(shape[4], D)):
        raise Refused(f"the {what} index of take_along_dim is not an int64 {tuple(slots) + (1,)} tensor")
    return Gathered(what, "take_along_dim", x5, False, [index], [sel])


def read_indexing(sel, what, B, G, S, D) -> Gathered:
    src, index = sel.args
    tensors = [i for i in index if isinstance(i, fx.Node)]
    rest = index[len(tensors):]
    if len(tensors) != 3 or index[:3] != tuple(tensors) or any(r not in (Ellipsis, slice(None)) for r in rest) \
            or not isinstance(src, fx.Node):
        raise Refused(f"{what} is indexed by {len(tensors)} tensors, not x[b, tokens, g] (three index tensors)")
    if any(value(i) is None or value(i).dtype != torch.int64 for i in tensors):
        raise Refused(f"the {what} index tensors are not int64")
    return Gathered(what, "indexing", src, source_order(src, what, B, G, S, D), tensors, [sel])


def is_positions(node: fx.Node, B: int, S: int) -> bool:
    """node may be the document positions pos: an int64 [B, S] tensor."""
    val = value(node)
    return val is not None and val.dtype == torch.int64 and same(tuple(val.shape), (B, S))


def find_block_idx(roots: list[fx.Node], B: int, G: int, S: int,
                   order: dict) -> tuple[fx.Node, fx.Node | None, list[fx.Node], bool]:
    """The int64 [B, G, S, n] tensor nearest the roots through which alone (with at most one int64
    [B, S] graph input, the document positions) they depend on data, that input (None without
    one), the position-only nodes between them and the roots (in graph order), and whether the
    ids are laid out [B, S, G, n] (the sequence before the groups: the op reads them transposed),
    or Refused."""
    def layout_of(node: fx.Node) -> bool | None:  # False: [B, G, S, n]; True: [B, S, G, n]; None: neither
        val = value(node)
        if val is None or val.dtype != torch.int64 or val.dim() != 4:
            return None
        if same(tuple(val.shape[:3]), (B, G, S)):
            return False
        return True if same(tuple(val.shape[:3]), (B, S, G)) else None

    candidates = [n for n in ancestors(roots, into_sizes=False) if layout_of(n) is not None]
    if not candidates:
        raise Refused("no int64 [B, G, S, n] (or [B, S, G, n]) block index tensor feeds the token ids and the mask"
                      + choice_reason(roots))
    # the reason of the candidate nearest to passing: the fewest other data inputs, and of those the
    # last tried (within a layout the farthest from the roots: nearer ones would blame the block
    # index itself). [B, G, S, n] ids are tried first (the op's layout), each layout nearest first
    closest = None
    for block_idx in sorted(candidates, key=lambda n: (layout_of(n), -order[n])):
        nodes = [n for n in ancestors(roots, stop=block_idx, into_sizes=False) if n is not block_idx and not is_size(n)]
        data = [n for n in nodes if n.op not in ("call_function", "call_method")]
        positions = [n for n in data if is_positions(n, B, S)]
        if len(data) == len(positions) <= 1:
            pos = positions[0] if positions else None
            return block_idx, pos, sorted((n for n in nodes if n is not pos), key=order.__getitem__), layout_of(block_idx)
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
    raise Refused(closest[1] + choice_reason(roots))


def choice_reason(roots: list[fx.Node]) -> str:
    """Where the block ids come from a top-k or sort over float block scores that select_blocks
    left eager (its `noncausal_reason`, or another refusal), that context for the refusal: ''
    for other block ids."""
    # the reading of a block choice that select_blocks shares, and its position-only evaluator
    from . import block_choice as bs
    from . import compressed_attention as cmp

    nodes = ancestors(roots, into_sizes=False)
    rankings = [n for n in nodes if op_name(n) in ("topk", "sort") and isinstance(bs.first_arg(n), fx.Node)
                and (key := value(bs.first_arg(n))) is not None and key.is_floating_point()]
    if not rankings:
        return ""
    subgraphs = cmp.PositionSubgraphs(Sizes.of(roots[0].graph))
    noncausal = any(bs.noncausal_reason(bs.first_arg(n), subgraphs) is not None for n in rankings)
    return ("; the block ids come from a top-k over block scores with no candidate mask hiding the blocks after "
            "the current one (non-causal: select_blocks leaves it eager)" if noncausal
            else "; the block ids come from a top-k or sort over block scores that select_blocks left eager")


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
        cost = at.int(B) * H * at.int(S) * at.int(T) + sum(math.prod(at.shape(value(n))) for n in nodes
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


def probes(B: int, G: int, S: int, n: int, block: int, device, pos: torch.Tensor | None = None,
           q_offset: int = 0, keys: int | None = None) -> list[torch.Tensor]:
    """Block ids [B, G, S, n]: one structured (per slot and query: padding, block 0, the current
    block, duplicates of it, the next block (future), one past the last block, far past the end,
    the previous block), one random in [-1, Ns + 1]. With pos [B, S] the blocks are those of each
    query's document (the current block is pos[t] // l'). A chunk of queries: rows at tokens
    q_offset + r of a sequence of `keys` tokens (its Ns blocks)."""
    Ns = -(-(S if keys is None else keys) // block)
    t = q_offset + torch.arange(S, device=device)[:, None]
    position = t.expand(B, S, 1) if pos is None else pos[:, :, None]  # [B, S, 1]
    cur = position // block
    choices = torch.stack(torch.broadcast_tensors(
        torch.full_like(cur, -1), torch.zeros_like(cur), cur, cur, cur + 1, torch.full_like(cur, Ns),
        torch.full_like(cur, Ns + 3), cur - 1), dim=-1)[:, :, 0]  # [B, S, 8]
    b, g, i = (torch.arange(x, device=device) for x in (B, G, n))
    pick = (b[:, None, None, None] + 3 * g[None, :, None, None] + t[None, None] - q_offset
            + i[None, None, None]) % 8
    structured = torch.gather(choices[:, None].expand(B, G, S, 8), 3, pick.expand(B, G, S, n))
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-1, Ns + 2, (B, G, S, n), generator=gen, device="cpu").to(device)
    return [structured, rand]


def document_lengths(kind: int, S: int, n: int, block: int, seed: int) -> list[int]:
    """Lengths of the documents of one probe row (summing to S): 0 one document, 1 odd lengths
    (1, 2, shorter than a block, longer than n blocks), 2 documents starting on block boundaries
    and one token off them, 3 random lengths."""
    if kind == 0:
        return [S]
    if kind == 3:
        gen = torch.Generator().manual_seed(seed)
        cycle = torch.randint(1, 2 * n * block + 2, (S,), generator=gen, device="cpu").tolist()
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
            rows.append(torch.cat([torch.arange(length, device="cpu") for length in lengths]))
        out.append(torch.stack(rows).to(device))
    return out


def verify(keep: torch.Tensor, tokens: torch.Tensor, blocks: torch.Tensor, block: int, h: int,
           pos: torch.Tensor | None = None, q_offset: int = 0) -> None:
    """keep [B, H, S, T] bool, tokens [B, G, S, T] (gather index) for block ids blocks [B, G, S, n]:
    for each (b, head, t) the kept tokens must be the multiset {start + block * l' + o <= t :
    block >= 0}, start = t - pos[b, t] with pos [B, S] (packed documents), else 0; query row r is
    token t = q_offset + r (a chunk of queries)."""
    B, G, S, n = blocks.shape
    keep5 = keep.reshape(B, G, h, S, -1)
    if not bool((keep5 == keep5[:, :, :1]).all()):
        raise Refused("the mask differs between the heads of a group (the group shares its blocks)")
    keep = keep5[:, :, 0]
    offsets = torch.arange(block, device=blocks.device)
    expected = (blocks.clamp(min=0)[..., None] * block + offsets).flatten(-2)  # [B, G, S, T]
    t = q_offset + torch.arange(S, device=blocks.device)[:, None]
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


class SelectedAttention(RewritePass):
    name = "selected_attention"
    summary = "gathered per-query selected-block attention -> nsa.selected_attention, no gathered K/V"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        verified = {}  # structures of selection subgraphs already verified (one per layer is the same) -> the
        # probes' dtype where that is told (lucidrains' fine branch), else None
        sizes = Sizes.of(graph)
        for softmax in list(graph.nodes):
            if op_name(softmax) != "softmax" or softmax.graph is not graph or softmax._erased:
                continue
            order = {node: i for i, node in enumerate(graph.nodes)}  # graph positions (rewrites add nodes)
            if value(softmax) is not None and value(softmax).dim() == 3:  # packed [T, H, D] tokens
                try:
                    plan = VarlenSelected.check(softmax, ctx.config.backend("selected_attention"))
                    VarlenSelected.rewrite(graph, plan)
                except Refused as why:
                    ctx.refused(softmax, f"3-D scores over packed tokens: {why}")
                    continue
                why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
                packed = VARLEN_TEXT + f", documents of at most {plan['doc_len']} tokens (the kernels' tiles)"
                ctx.matched(softmax, KERNEL.format(block=plan["block"], n=plan["n"], backend=plan["backend"],
                                                   heads=GQA_NATIVE, packed=packed, empty="", why=why))
                continue
            try:
                fine = LucidrainsFine.region_of(softmax)  # lucidrains' fine branch over his choice's ids
                if fine is not None:
                    plan = LucidrainsFine.check(softmax, fine, ctx.config.backend("selected_attention"), sizes,
                                                verified)
                else:
                    plan = self.check(softmax, order, verified, ctx.config.backend("selected_attention"),
                                      sizes)
            except Refused as why:
                ctx.refused(softmax, str(why))
                continue
            if plan.get("rule") == "lucidrains":
                LucidrainsFine.rewrite(graph, plan)
                ctx.matched(softmax, plan["text"])
                continue
            self.rewrite(graph, plan)
            why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else f"; {plan['schedule']}"
            ctx.matched(softmax, KERNEL.format(block=plan["block"], n=plan["n"], backend=plan["backend"],
                                               heads=heads_read(plan), packed="" if plan["pos"] is None else PACKED,
                                               empty=EMPTY_ROWS if may_leave_rows_empty(plan) else "", why=why))

    def check(self, softmax: fx.Node, order: dict, verified: dict, requested: str = "auto",
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
        B, X, Y, T = dims(softmax, "probability tensor", 4)  # [B, H, S, T] or [B, S, H, T]
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
        q_offset, keys = query_rows(q)  # a chunk of queries: rows from token q_offset of `keys` tokens
        Dk = dims(q, "query tensor", 4)[3]
        constant("query tensor", Dk=Dk)
        if not same(dims(q, "query tensor", 4), (B, X, Y, Dk)):
            raise Refused(f"q is {tuple(value(q).shape)}, not the scores' {(B, X, Y)} with Dk")
        if not isinstance(kt, fx.Node) or not is_last_two_transpose(kt, 5) or not isinstance(first(kt), fx.Node):
            raise Refused("the gathered keys are not transposed over their last two dims (k_sel.transpose(-1, -2))")
        only_user(kt, "transposed gathered K")
        k_rep, v_rep = first(kt), operands(pv)[1]
        if not isinstance(v_rep, fx.Node):
            raise Refused("the probabilities are not multiplied by gathered V")
        (k_sel, h_k, axis, tiled), (v_sel, *v_copy) = head_copy(k_rep), head_copy(v_rep)
        if (h_k, axis, tiled) != tuple(v_copy):
            raise Refused(f"K and V are copied for the heads differently (x{h_k} on dim {axis}, x{v_copy[0]} on dim "
                          f"{v_copy[1]})")
        repeats = [n for n, sel in ((k_rep, k_sel), (v_rep, v_sel)) if n is not sel]
        for node in repeats:
            only_user(node, "repeated gathered K/V")
        # the head axis: the repeated one; without a copy (h = 1) heads-first, else sequence-first
        layouts = [Layout(axis, tiled)] if axis is not None else [Layout(1), Layout(2)]
        reasons = []
        for layout in layouts:
            try:
                H, S, G, k, v = self.read_heads(layout, k_sel, v_sel, h_k, B, X, Y, T,
                                                keys if layout.head == 1 else None)
                break
            except Refused as why:
                reasons.append(why)
        else:
            raise reasons[0]
        if (k.cast or value(k.source).dtype) != value(q).dtype or not value(v.source).is_floating_point():
            raise Refused("q and K differ in dtype, or V is not floating point")
        # the keys' length: S, or the sequence a chunk of queries is cut from (torch.gather only)
        Skv = dims(k.source, "K", 4)[2] if k.kind == "gather" else S
        if k.kind == "gather" and not same(dims(v.source, "V", 4)[2], Skv):
            raise Refused(f"K holds {Skv} tokens, V {dims(v.source, 'V', 4)[2]}")
        chunk = (q_offset, Skv) if not same(Skv, S) else (0, None)  # (rows' first token, keys' length)
        v_dtype = v.cast or value(v.source).dtype
        if cast is not None and value(cast).dtype != v_dtype:
            raise Refused(f"the probabilities are cast to {value(cast).dtype}, not to V's {v_dtype}")
        # the selection: block_idx, positions and (packed documents) pos only, evaluated on probes
        roots = [mask, *k.roots, *v.roots]
        block_idx, pos, nodes, ids_seq_first = find_block_idx(roots, B, G, S, order)
        leaves = [block_idx] if pos is None else [block_idx, pos]
        if chunk[1] is not None and pos is not None:
            raise Refused(f"a chunk of queries (rows from token {q_offset} of {Skv}) with packed documents "
                          f"({pos.name}): matched over the whole sequence only")
        n = dims(block_idx, "block index tensor", 4)[3]
        ids, n_op = block_idx, n  # the block ids and their number as the op reads them
        if isinstance(n, int):
            constant("probability tensor", T=T)
            if n == 0 or T % n:
                raise Refused(f"the {T} gathered tokens per query are not n * l' for the n = {n} blocks")
            block = T // n
        elif ids_seq_first:  # the model's own ids (nsa_vibe's top-k of min(n, blocks)): l' = T / n a constant
            block = sizes.int(T) // sizes.int(n)
            if not same(T, n * block):
                raise Refused(f"the {T} gathered tokens per query are not n * l' for the n = {n} blocks")
        else:  # min(n, Ns) blocks (a model's top-k of min(n, blocks)): the op reads all n ids
            ids, n_op = clamped_ids(block_idx, sizes)
            block = sizes.int(T) // sizes.int(n)
            if not same(T, n * block):
                raise Refused(f"the {T} gathered tokens per query are not n * l' for the n = {n} blocks")
        check_evaluable(nodes, leaves, B, H, S, T, sizes.probes())
        key = (structure(nodes, leaves, roots), tuple(d if isinstance(d, int) else str(d) for d in (B, H, G, S, T, n)),
               keep_where_true, layout, k.kind, k.source_seq_first, k.transposed, v.kind, v.source_seq_first, v.transposed,
               chunk, ids_seq_first)
        if key not in verified:
            for at in sizes.probes():
                try:
                    self.verify_at(at, nodes, roots, block_idx, pos, (k, v), (G, H, T, n, block),
                                   keep_where_true, B, S, layout, chunk, ids_seq_first)
                except Refused as why:
                    raise (Refused(f"at {at.describe()}: {why}") if sizes.symbolic else why) from None
        verified[key] = None
        if fill != float("-inf") and may_leave_rows_empty({"rows_zeroed": False, "block_idx": ids}):
            raise Refused(f"the scores are filled with {fill:g}, not -inf, and the block ids may leave a query no "
                          "token (they are not nsa.select_blocks' output): such a row gets the uniform average of its "
                          "gathered tokens in eager code, 0 or NaN from the op")
        fake_q = value(q).transpose(1, 2) if layout.head == 2 else value(q)
        fakes = [fake_q, k.fake(layout), v.fake(layout), value(block_idx).transpose(1, 2) if ids_seq_first
                 else value(block_idx)]
        fake_pos = None if pos is None else value(pos)
        try:
            backend = choose_backend(*fakes, block, requested, fake_pos, chunk[0])
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(selected_attention_backend={requested!r}): {why}") from None
        return {"q": q, "k": k, "v": v, "layout": layout, "G": G, "h": H // G, "block_idx": ids, "pos": pos, "block": block, "n": n_op, "scale": scale,
                "ids_seq_first": ids_seq_first,
                "backend": backend, "q_offset": chunk[0],
                "schedule": selection_triton.schedule(H // G, fakes[1].shape[2], block, n_op, pos is not None),
                "why_not_triton": why_not_triton(*fakes, block, fake_pos, chunk[0]) if requested == "auto"
                else f"selected_attention_backend={requested!r} in OptimizeConfig",
                "out": out, "rows_zeroed": zeroed is not None,
                "chain": [out, pv, p4, cast, zeroed, softmax, masked, *chain, qk, q4, kt, *repeats, *k.nodes, *v.nodes],
                "roots": roots}

    @staticmethod
    def read_heads(layout: Layout, k_sel: fx.Node, v_sel: fx.Node, h: int, B, X, Y, T: int, keys=None) -> tuple:
        """(H, S, G, gathered K, gathered V) of the scores [B, X, Y, T] read in `layout`, or Refused
        (keys: as `read_gathered`)."""
        H, S = (X, Y) if layout.head == 1 else (Y, X)
        constant("probability tensor", H=H)
        G = dims(k_sel, "gathered K", 5)[layout.head]
        constant("gathered K", G=G)
        if G * h != H or not same(dims(v_sel, "gathered V", 5)[layout.head], G):
            raise Refused(f"gathered K/V heads {G} (x{h}) and {value(v_sel).shape[layout.head]} do not serve {H} "
                          f"query heads ({layout.describe()})")
        return (H, S, G, read_gathered(k_sel, "K", layout, B, G, S, T, keys),
                read_gathered(v_sel, "V", layout, B, G, S, T, keys))

    @staticmethod
    def verify_at(at: Sizes, nodes: list[fx.Node], roots: list[fx.Node], block_idx: fx.Node, pos: fx.Node | None,
                  reads: tuple[Gathered, Gathered], heads: tuple, keep_where_true: bool, B, S,
                  layout: Layout = Layout(1), chunk: tuple = (0, None), ids_seq_first: bool = False) -> None:
        """The selection subgraph (nodes, from block_idx [and pos] to roots = [mask, K index
        tensors, V index tensors]) evaluated on the probe block ids (and positions) at the sizes
        `at` (B and S as numbers there, the graph's size nodes given their numbers), each result
        checked by `verify` (mask and token ids brought to the heads-first, grouped order of the
        op); Refused at the first probe that differs. heads = (G, H, T, n, l'). chunk: (q_offset,
        keys) for a chunk of queries, rows from token q_offset of K/V holding `keys` tokens; (0,
        None) for the whole sequence. ids_seq_first: block_idx is laid out [B, S, G, n] (given the
        probes transposed)."""
        G, H, T, n, block = heads
        q_offset, keys = chunk
        B, S, T, n = at.int(B), at.int(S), at.int(T), at.int(n)
        Skv = S if keys is None else at.int(keys)
        numbers = at.size_nodes()  # (also in a graph whose sizes a guard fixed: SymInt nodes of one number)
        device = value(block_idx).device
        scores = (B, H, S, T) if layout.head == 1 else (B, S, H, T)
        slots = layout.slots(B, G, S, T)
        grid = [torch.arange(x, device=device).view([-1 if i == axis else 1 for i in range(4)])
                for x, axis in ((B, 0), (G, layout.head))]  # each slot's own batch row and group
        positions = [None] if pos is None else position_probes(B, S, n, block, device)
        for probe_pos, probe in [(p, blocks) for p in positions
                                 for blocks in probes(B, G, S, n, block, device, p, q_offset, Skv)]:
            ids = probe.transpose(1, 2).contiguous() if ids_seq_first else probe
            given = {**numbers, block_idx: ids} if pos is None else {**numbers, block_idx: ids, pos: probe_pos}
            m, *index_values = evaluate(nodes, given, roots)
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                raise Refused("the mask is not a bool tensor")
            try:
                keep = torch.broadcast_to(m, scores)
            except RuntimeError:
                raise Refused(f"the mask {tuple(m.shape)} does not broadcast to the scores {scores}") from None
            keep = keep if keep_where_true else ~keep
            keep = keep.transpose(1, 2) if layout.head == 2 else keep  # [B, H, S, T]
            if layout.tiled:  # query head r * G + g -> position g * h + r, as the op groups them
                keep = keep.unflatten(1, (H // G, G)).transpose(1, 2).flatten(1, 2)
            tokens = []
            for read in reads:
                values, index_values = index_values[:len(read.roots)], index_values[len(read.roots):]
                for index, traced in zip(values, read.roots):
                    if not isinstance(index, torch.Tensor) or tuple(index.shape) != at.shape(value(traced)):
                        raise Refused(f"the {read.what} gather index evaluates to something else than its traced shape")
                batch, group, token = read.coordinates(values, slots, B, G, S)
                for got, want, name in ((batch, grid[0], "batch row"), (group, grid[1], "KV group")):
                    if got is not None and not torch.equal(got, want.expand(slots)):
                        raise Refused(f"{read.what} is read from another {name} than the query's ({read.kind})")
                tokens.append(token.transpose(1, 2) if layout.head == 2 else token)  # [B, G, S, T]
            if not torch.equal(tokens[0], tokens[1]):
                raise Refused("K and V are gathered at different token ids")
            verify(keep, tokens[0], probe, block, H // G, probe_pos, q_offset)
            if bool((tokens[0] < 0).any()) or bool((tokens[0] >= Skv).any()):  # eager's gather raises there
                raise Refused(f"the gather index leaves [0, {'S' if keys is None else Skv}) on probe block ids "
                              "(eager's gather would raise; the op would ignore them)")

    def rewrite(self, graph: fx.Graph, plan: dict) -> None:
        out = plan["out"]
        packed = () if plan["pos"] is None else (plan["pos"],)  # unpacked graphs keep the 7-argument call
        if plan["q_offset"]:  # a chunk of queries: the token of its first row
            packed = (None, plan["q_offset"])
        layout, G, h = plan["layout"], plan["G"], plan["h"]
        q = plan["q"]
        if layout.head == 2:  # sequence-first [B, S, H, Dk] -> [B, H, S, Dk]
            q = call(graph, torch.transpose, q, 1, 2, anchor=out)
        if layout.tiled:  # query head r * G + g -> position g * h + r: the op's grouping
            q = call(graph, torch.flatten, call(graph, torch.transpose, call(
                graph, torch.unflatten, q, 1, (h, G), anchor=out), 1, 2, anchor=out), 1, 2, anchor=out)
        k, v = plan["k"].for_op(graph, layout, out), plan["v"].for_op(graph, layout, out)
        ids = plan["block_idx"]
        if plan["ids_seq_first"]:  # [B, S, G, n] -> [B, G, S, n], the op's layout
            ids = call(graph, torch.transpose, ids, 1, 2, anchor=out)
        both = call(graph, torch.ops.nsa.selected_attention, q, k, v, ids,
                    plan["block"], plan["scale"], plan["backend"], *packed, anchor=out)
        op = call(graph, operator.getitem, both, 0, anchor=out)  # o; the log-sum-exp is for the backward
        if may_leave_rows_empty(plan):  # eager's NaN where a query's blocks hold no token <= t
            lse = call(graph, operator.getitem, both, 1, anchor=out)
            empty = call(graph, torch.unsqueeze, call(graph, torch.isneginf, lse, anchor=out), -1, anchor=out)
            op = call(graph, torch.masked_fill, op, empty, float("nan"), anchor=out)
        if layout.tiled:  # back to the model's head order
            op = call(graph, torch.flatten, call(graph, torch.transpose, call(
                graph, torch.unflatten, op, 1, (G, h), anchor=out), 1, 2, anchor=out), 1, 2, anchor=out)
        if layout.head == 2:
            op = call(graph, torch.transpose, op, 1, 2, anchor=out)
        out.replace_all_uses_with(op)
        # erase the per-query chain, then whatever only it used (token ids, mask, K/V views)
        erase_replaced(graph, plan["chain"], plan["roots"])

def heads_read(plan: dict) -> str:
    """How the op reads K and V, for the match text: GQA-native, or, where the model repeated them
    per query head (x.repeat_interleave(h, dim=1), heads-first) for block ids per query head, from
    those copies (they stay: the op sees each query head as its own group)."""
    copies = [unrepeat(read.source) for read in (plan["k"], plan["v"])]
    h = copies[0][1]
    if h == 1 or copies[1][1] != h or any(read.source_seq_first for read in (plan["k"], plan["v"])) \
            or plan["layout"].head != 1:
        return GQA_NATIVE
    return PER_HEAD.format(h=h)


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


# --- lucidrains' fine branch over the ids of nsa.select_blocks(rule='lucidrains') ------------------

LUCIDRAINS_KERNEL = ("nsa.selected_attention[{backend}] (lucidrains' fine branch: l'={block}, n={n} + the diagonal "
                     "block, {heads}, no gathered K/V; verified on probe values{precision}{why})")
# rtol, atol of a float32 probe of lucidrains' fine branch against the op in float64 (float64 probes: 1e-9, 1e-12)
FLOAT32_TOLERANCE = (1e-4, 1e-5)
# the data movement read forward from p @ v to the branch output
OUT_MOVES = ("squeeze", "unsqueeze", "getitem", "flatten", "unflatten", "view", "reshape", "transpose", "permute",
             "contiguous")


def product_after(softmax: fx.Node, products) -> tuple[fx.Node, fx.Node] | None:
    """(its input, the node): the first op among `products` reached from the softmax through at
    most 4 single-user links ([cast], [unsqueeze], p @ v), or None (a branch, or none in reach).
    Shared by the regions read on probes (lucidrains' fine branch, the bucketed window)."""
    node = softmax
    for _ in range(4):
        users = list(node.users)
        if len(users) != 1:
            return None
        prev, node = node, users[0]
        if op_name(node) in products:
            return prev, node
    return None


def output_after(pv: fx.Node) -> fx.Node:
    """The branch output: p @ v read forward through single-user data movement (OUT_MOVES)."""
    out = pv
    while len(out.users) == 1 and op_name(next(iter(out.users))) in OUT_MOVES:
        out = next(iter(out.users))
    return out


def _lucidrains_ids(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (torch.ops.nsa.select_blocks,
                                                         torch.ops.nsa.select_blocks.default)
            and node.kwargs.get("rule") == "lucidrains")


class LucidrainsFine:
    """lucidrains' fine (selected) branch (tests/corpus/lucidrains_*.py), whose block ids are the
    output of `nsa.select_blocks(rule='lucidrains')` ([B, G', S, n + 1]: the kept blocks, -1, the
    diagonal block last; the select_blocks pass wrote fmask = ids[..., :n] >= 0 and selected =
    ids[..., :n].clamp(min=0) for the model's own), read as a computation: the region is every node
    that only the branch output uses, from the softmax's p @ v forward through data movement (the
    squeeze, the [..., :S, :] cut of the padded rows), back to its inputs; those must be q, K, V
    (float tensors: q and K reach the scores, V does not) and the ids. Padding the sequence to a
    multiple of l', gathering K/V per query by the ids, the kept and causal masks and the softmax
    are whatever the model writes: the region is evaluated at compile time on random float64
    probe values and probe ids in the op's format (each row up to n distinct blocks before its
    own, -1 slots among them, its own block last; at every probe size of a dynamic graph) and must
    equal nsa.selected_attention(q, K, V, ids, l', scale), l' and scale the choice op's; with ids
    per query head (G' = H over K/V of G < H groups) the op reads K/V repeated per head
    (repeat_interleave, a [B, H, S, D] copy each). Dtypes: the op's softmax runs in float32 where
    lucidrains' runs in q's dtype (bf16/fp16 scores rounded once more there): a difference of
    rounding, not of function. A check on probes, not a proof. Where float64 probes exceed the
    budget even on one batch row, the probes run in float32 (twice the elements) and must agree to
    FLOAT32_TOLERANCE, against float32 rounding of about 1e-6 here: a key more or less moves a row's
    output by about that key's softmax weight (1 / (n + 1) l' on average on random probes), and a
    wrong mask or block moves many rows; a scale off by 0.1% is refused this way
    (tests/test_batch_slice.py). The match says the probes were float32."""

    @staticmethod
    def region_of(softmax: fx.Node) -> dict | None:
        """{out, nodes, leaves} where the softmax is followed by p @ v and the region computing the
        output reads nsa.select_blocks(rule='lucidrains') ids; None for any other softmax."""
        found = product_after(softmax, MATMULS)  # softmax -> [cast] -> unsqueeze -> matmul
        if found is None:
            return None
        pv = found[1]
        out = output_after(pv)
        graph_order = {n: i for i, n in enumerate(softmax.graph.nodes)}
        inside, leaves = {out}, []
        for node in sorted(ancestors([out]) - {out}, key=graph_order.__getitem__, reverse=True):
            if (node.op in ("call_function", "call_method") and not _lucidrains_ids(node)
                    and node.users and all(u in inside for u in node.users)):
                inside.add(node)
        # x[i] of a tensor from outside (k, v = kv.unbind-like unpacking): the one unpacked is the input
        inside -= {node for node in inside if op_name(node) == "getitem" and isinstance(node.args[1], int)
                   and node.args[0] not in inside and node is not out}
        for node in inside:
            leaves += [x for x in node.all_input_nodes if x not in inside and x not in leaves]
        ids = [x for x in leaves if _lucidrains_ids(x)]
        if len(ids) != 1:
            return None
        return {"out": out, "pv": pv, "ids": ids[0], "leaves": leaves,
                "nodes": sorted(inside, key=graph_order.__getitem__)}

    @staticmethod
    def check(softmax: fx.Node, fine: dict, requested: str, sizes: Sizes, verified: dict) -> dict:
        out, ids, nodes = fine["out"], fine["ids"], fine["nodes"]
        scores = softmax
        for _ in range(16):  # the scores matmul up the softmax's first-argument chain
            scores = first(scores) if isinstance(scores, fx.Node) else None
            if scores is None or op_name(scores) in MATMULS:
                break
        if scores is None or op_name(scores) not in MATMULS:
            raise Refused("lucidrains' fine branch: the softmax does not read scores q @ k^T")
        reads_q = ancestors([operands(scores)[0]], stop=ids)  # not through the ids (they read q)
        reads_k = ancestors([operands(scores)[1]], stop=ids)
        data = [x for x in fine["leaves"] if x is not ids and not is_size(x)]
        q = [x for x in data if x in reads_q]
        k = [x for x in data if x in reads_k]
        v = [x for x in data if x not in reads_q and x not in reads_k]
        if len(q) != 1 or len(k) != 1 or len(v) != 1 or len(data) != 3:
            names = ", ".join(x.name for x in data)
            raise Refused(f"lucidrains' fine branch reads {names} besides the block ids: not one q, K and V")
        q, k, v = q[0], k[0], v[0]
        qv, kv, vv, iv = value(q), value(k), value(v), value(ids)
        if any(x is None or x.dim() != 4 for x in (qv, kv, vv)):
            raise Refused("lucidrains' fine branch: q, K, V are not 4-D [B, H, S, D], [B, G, S, D]")
        H, G = qv.shape[1], kv.shape[1]
        constant("query tensor", H=H, G=G, Dk=qv.shape[3], Dv=vv.shape[3])
        if not (same(qv.shape[:1] + qv.shape[2:3], kv.shape[:1] + kv.shape[2:3]) and same(kv.shape[:3], vv.shape[:3])
                and H % G == 0 and same(qv.shape[3], kv.shape[3])):
            raise Refused(f"lucidrains' fine branch: q {tuple(qv.shape)}, K {tuple(kv.shape)} and V "
                          f"{tuple(vv.shape)} do not fit as [B, H, S, Dk], [B, G, S, Dk], [B, G, S, Dv]")
        if value(out) is None or value(out).dtype != vv.dtype:
            raise Refused(f"lucidrains' fine branch gives {None if value(out) is None else value(out).dtype} from V in "
                          f"{vv.dtype}: the op's output is in V's dtype")
        rows = iv.shape[1]
        if rows != G and rows != H:
            raise Refused(f"the block ids have {rows} heads, neither the {G} groups nor the {H} query heads")
        per_head = H // G if rows != G else 1
        block, scale = ids.args[5], ids.args[7]
        key = (region_probe.fingerprint(nodes, [q, k, v, ids]), sizes.shape(qv), sizes.shape(kv), sizes.shape(vv),
               sizes.shape(iv), block, scale, per_head)
        if key not in verified:
            verified[key] = LucidrainsFine.verify(nodes, out, (q, k, v, ids), per_head, block, scale, sizes)
        precision = "" if verified[key] == torch.float64 else \
            " in float32 (float64 probes would exceed the probe budget)"
        k_fake, v_fake = (x if per_head == 1 else x.repeat_interleave(per_head, 1) for x in (kv, vv))
        try:
            backend = choose_backend(qv, k_fake, v_fake, iv, block, requested)
        except ValueError as why:
            raise Refused(f"OptimizeConfig(selected_attention_backend={requested!r}): {why}") from None
        why = (f"; {selection_triton.schedule(qv.shape[1] // k_fake.shape[1], kv.shape[2], block, iv.shape[-1])}"
               if backend == "triton" else
               f"; not triton: {why_not_triton(qv, k_fake, v_fake, iv, block)}" if requested == "auto"
               else f"; selected_attention_backend={requested!r} in OptimizeConfig")
        heads = GQA_NATIVE if per_head == 1 else (f"per query head (block ids [B, H, S, n + 1]; K/V repeated x"
                                                  f"{per_head} per query head, [B, H, S, D] each)")
        text = LUCIDRAINS_KERNEL.format(backend=backend, block=block, n=iv.shape[-1] - 1, heads=heads,
                                        precision=precision, why=why)
        return {"rule": "lucidrains", "out": out, "nodes": nodes, "q": q, "k": k, "v": v, "ids": ids,
                "per_head": per_head, "block": block, "scale": scale, "backend": backend, "text": text}

    @staticmethod
    def probe_ids(B: int, rows: int, S: int, n: int, block: int, seed: int) -> torch.Tensor:
        """[B, rows, S, n + 1] ids as nsa.select_blocks(rule='lucidrains') gives them: each row up to n
        distinct blocks before its own (t // l') in random order, -1 slots among them, its own last."""
        gen = torch.Generator().manual_seed(seed)
        current = torch.arange(S, device="cpu") // block  # [S] (the generator's device; the caller moves them)
        score = torch.rand(B, rows, S, max(1, int(current[-1])), generator=gen, device="cpu")
        score = score.masked_fill(torch.arange(score.shape[-1], device="cpu") >= current[:, None], -1.0)  # not a candidate
        top = score.topk(min(n, score.shape[-1]), dim=-1)
        dropped = torch.rand(top.values.shape, generator=gen, device="cpu") < 0.25
        chosen = torch.where((top.values >= 0) & ~dropped, top.indices, -1)
        chosen = torch.nn.functional.pad(chosen, (0, n - chosen.shape[-1]), value=-1)
        return torch.cat((chosen, current.expand(B, rows, S)[..., None]), dim=-1)

    @staticmethod
    def verify(nodes: list[fx.Node], out: fx.Node, leaves: tuple, per_head: int, block: int, scale: float,
               sizes: Sizes) -> torch.dtype:
        """The probes' dtype (float64, or float32 where float64 is over the budget) where the region
        equals the op on every probe; Refused otherwise."""
        q, k, v, ids = leaves
        used = torch.float64
        for at in sizes.probes():
            where = f" at the probe sizes {at.describe()}" if sizes.symbolic else ""
            one_row, changes, dtype = batch_slice.probe_rows(nodes, list(leaves), out, at, "lucidrains' fine branch",
                                                             float32_ok=True)
            rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else FLOAT32_TOLERANCE
            used = dtype if dtype != torch.float64 else used
            (B, H, S, Dk), (_, G, _, Dv), (_, rows, _, width) = (at.shape(value(x)) for x in (q, v, ids))
            B = one_row or B
            device = value(q).device
            for seed in (0, 1):
                gen = torch.Generator().manual_seed(seed)
                qp = torch.randn(B, H, S, Dk, generator=gen, dtype=dtype, device="cpu").to(device)
                kp = torch.randn(B, G, S, Dk, generator=gen, dtype=dtype, device="cpu").to(device)
                vp = torch.randn(B, G, S, Dv, generator=gen, dtype=dtype, device="cpu").to(device)
                idp = LucidrainsFine.probe_ids(B, rows, S, width - 1, block, seed).to(device)
                got = region_probe.run(nodes, {q: qp, k: kp, v: vp, ids: idp, **at.size_nodes()}, out,
                                       "lucidrains' fine branch", dtype=dtype, changes=changes)
                k_op, v_op = (x.double() if per_head == 1 else x.double().repeat_interleave(per_head, 1)
                              for x in (kp, vp))
                want = selected_attention_op(qp.double(), k_op, v_op, idp, block, scale, "reference")
                if got.shape != want.shape or not torch.allclose(got.double(), want, rtol=rtol, atol=atol):
                    raise Refused("lucidrains' fine branch differs from nsa.selected_attention over its block ids "
                                  f"(the kept blocks whole, the diagonal block causally; l' = {block}) on probe "
                                  f"values{where}{'' if dtype == torch.float64 else ' (float32 probes)'}")
        return used

    @staticmethod
    def rewrite(graph: fx.Graph, plan: dict) -> None:
        out = plan["out"]
        k, v = plan["k"], plan["v"]
        if plan["per_head"] > 1:  # one group per query head: K/V repeated per head
            k, v = (call(graph, torch.repeat_interleave, x, plan["per_head"], 1, anchor=out) for x in (k, v))
        both = call(graph, torch.ops.nsa.selected_attention, plan["q"], k, v, plan["ids"], plan["block"],
                    plan["scale"], plan["backend"], anchor=out)
        out.replace_all_uses_with(call(graph, operator.getitem, both, 0, anchor=out))
        erase_replaced(graph, list(reversed(plan["nodes"])), [])


# --- packed [T, H, D] tokens (varlen): dense 3-D attention under a mask built from the block ids ----

# A varlen selected branch is checked on this many probe block choices.
VARLEN_PROBES = 3
# Queries compared at a time with the op's visibility (`VarlenSelected.first_difference`).
VERIFY_ROWS = 256
INF = float("inf")
VARLEN_TEXT = ", packed [T, H, D] tokens (3-D scores under a block mask, checked on probe block choices)"


class VarlenSelected:
    """The selected branch over packed tokens (tests/corpus/xunhaolai_varlen.py): dense 3-D scores
    [H, T, T] = q [H, T, D] @ K^T (K [G, T, D] repeat_interleave'd over the group's heads) under
    a bool mask [H, T, T] built from the block ids of `nsa.select_blocks` (select_blocks rewrote
    the model's choice: its [1, G, T, n] output, read as ids[0]) and positions (per document: the
    ids scattered into per-document block masks, repeated over each block's l' tokens, written
    into the [G, T, T] mask by `mask[:, a:b, a:b] = ...`, then `tril` and the heads' repeat),
    softmax, p @ V.

    Read as a computation: the mask's region (`cmp.written_region`: the writes into it included)
    may read nothing but those ids and positions; it is evaluated on VARLEN_PROBES block choices
    drawn as the op draws them (block 0 and the query's current and previous blocks of its
    document forced, the other blocks up to the current one ranked by random importance, the
    first n kept, ascending, -1 padded: so block 0 is always there, and a model that maps -1 to
    block 0, as this one does by clamp(min=0), attends as the op does) and must be, for every
    head of each group, exactly the op's visibility: token s for query t iff s <= t and s lies in
    a chosen block of t's document, (s - (t - pos[t])) // l' in ids (the select_blocks op's pos).
    A check on probe choices, exact for the documents at this shape (static sizes only); the region
    runs for chunks of query rows (nsa_compile/row_regions.py: the model's [H, T, T] mask is 5e10
    elements at T 65,536). Every
    row keeps its own document's first token (block 0), so no row is empty and eager has no NaN.
    Becomes `nsa.selected_attention(q[None], K[None], V[None], ids, l', scale, backend, pos)[0][0]`."""

    @staticmethod
    def check(softmax: fx.Node, requested: str) -> dict:
        probs = cmp.read_probabilities(softmax)
        if set(probs.masks) != {"inf"}:
            raise Refused("the 3-D scores over packed tokens have a zero fill or a mask after the softmax: rows "
                          "without a key (not a selected branch over nsa.select_blocks' ids, which keep a token each)")
        pv, cast, v_rep = cmp.output_product(probs)
        v, h_v = cmp.unrepeat_heads(v_rep)
        _, H, T, keys = cmp.concrete(probs.shape)
        kv, vv = value(probs.k), value(v)
        if (h_v != probs.h or vv is None or vv.dim() != 3 or keys != T
                or cmp.concrete(vv.shape)[:2] != cmp.concrete(kv.shape)[:2]):
            raise Refused(f"the 3-D scores [H, T, {keys}] are not over the packed tokens' K/V [G, T = {T}, D] "
                          "(repeated alike)")
        if cast is not None and value(cast).dtype != vv.dtype or cast is None and value(probs.p).dtype != vv.dtype:
            raise Refused(f"the probabilities multiply {vv.dtype} V without a cast to it")
        mask, sense = probs.masks["inf"]
        ids, region = VarlenSelected.block_ids(mask)
        block, n, pos = ids.args[5], ids.args[6], ids.args[9]
        positions = VarlenSelected.verify(region, mask, sense, ids, H, probs.h, T, block, n, pos)
        with value(probs.q).fake_mode:  # the op's inputs as the rewrite makes them
            fakes = (value(probs.q)[None], kv[None], vv[None], value(ids), block)
        try:
            backend = choose_backend(*fakes, requested, value(pos))
        except ValueError as why:
            raise Refused(f"OptimizeConfig(selected_attention_backend={requested!r}): {why}") from None
        # the longest document, from the positions (a constant of the graph here): the kernels' tile
        # hint (doc_len), or one row of T packed tokens gets the tiles of a T-token sequence
        doc_len = int(positions.max()) + 1 if positions.numel() else 0
        return {"probs": probs, "v": v, "pv": pv, "cast": cast, "ids": ids, "block": block, "n": n, "pos": pos,
                "doc_len": doc_len, "region": region, "backend": backend,
                "why_not_triton": why_not_triton(*fakes, value(pos)) if requested == "auto"
                else f"selected_attention_backend={requested!r} in OptimizeConfig"}

    @staticmethod
    def block_ids(mask: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        """(the nsa.select_blocks node, packed form, whose ids the mask reads; the mask's region
        from it, `cmp.written_region`): Refused where the mask reads no such ids, or other data."""
        targets = (torch.ops.nsa.select_blocks, torch.ops.nsa.select_blocks.default)
        choosers = {n for n in mask.graph.nodes if n.op == "call_function" and n.target in targets}
        if not choosers:
            raise Refused("no nsa.select_blocks ids are in the graph for the mask of the 3-D scores over packed tokens "
                          "to read (select_blocks did not rewrite a block choice: its reason is in explain)")
        region = cmp.written_region([mask], "mask of the 3-D scores over packed tokens", leaves=choosers)
        found = {x for node in region for x in node.all_input_nodes if x in choosers}
        if len(found) != 1:
            raise Refused("the mask of the 3-D scores over packed tokens reads " + (
                "no nsa.select_blocks ids (select_blocks did not rewrite the block choice: its reason is in explain)"
                if not found else f"{len(found)} nsa.select_blocks results"))
        chooser = found.pop()
        if len(chooser.args) != 10 or not isinstance(chooser.args[9], fx.Node) or chooser.kwargs:
            raise Refused("the block ids the mask reads are not nsa.select_blocks' packed form (pos, rule 'nsa')")
        return chooser, region

    @staticmethod
    def probe_ids(pos: torch.Tensor, G: int, block: int, n: int, gen: torch.Generator) -> torch.Tensor:
        """[1, G, T, n] block ids as nsa.select_blocks draws them with random importance (rule
        'nsa': blocks 0, cur, cur - 1 forced, the candidates j <= cur ranked, first n, ascending,
        -1 padded), cur = pos[t] // l'."""
        T = pos.shape[1]
        cur = (pos[0] // block)[:, None]  # [T, 1]
        Ns = int(cur.max()) + 1
        j = torch.arange(max(Ns, n), device="cpu")[None, :]
        key = torch.rand(G, T, j.shape[1], generator=gen, dtype=torch.float64, device="cpu")
        forced = (j == 0) | (j == cur) | (j == cur - 1)
        key = torch.where(forced, INF, torch.where(j <= cur, key, -INF))
        values, order = torch.sort(key, dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., :n] > -INF, order[..., :n], Ns + n)
        chosen = torch.sort(chosen, dim=-1).values
        return torch.where(chosen == Ns + n, -1, chosen)[None]

    @staticmethod
    def verify(region: list, mask: fx.Node, sense, ids: fx.Node, H: int, h: int, T: int, block: int, n: int,
               pos_node: fx.Node) -> torch.Tensor:
        """The positions [T] (pos_node's value, a constant here), once Refused has not been raised:
        Refused unless the mask on every probe choice is the op's visibility for every head
        (`first_difference`: every element compared), the region run for chunks of query rows
        (nsa_compile/row_regions.py; the first difference over all chunks named)."""
        pos = cmp.evaluate_written(pos_node, "positions").cpu()
        G = H // h
        gen = torch.Generator().manual_seed(0)
        # the region for chunks of query rows (the model's [H, T, T] mask is 5e10 elements at T 65,536)
        chunks = RowRegion(region, T, {ids: 2}, "the selected branch's mask")
        step = chunks.rows_per_chunk(row_regions.CHUNK_ELEMENTS)
        for i in range(VARLEN_PROBES):
            chosen = VarlenSelected.probe_ids(pos, G, block, n, gen)
            # on the graph's device: the region makes its constants there (torch.zeros(.., device=..))
            chosen_there = chosen.to(value(ids).device)
            pos_there = pos.to(chosen_there.device)
            differences = []  # the first per chunk; the first of all is the first in (head, query, key) order
            for r0 in range(0, T, step):
                r1 = min(T, r0 + step)
                filled = chunks.run(r0, r1, {ids: chosen_there}, keep={mask})[mask]
                if not isinstance(filled, Rows) or filled.dim != filled.t.dim() - 2 or (filled.a, filled.b) != (0, T):
                    raise Refused("the mask of the 3-D scores over packed tokens does not hold the queries' rows "
                                  "second to last")
                if filled.t.dtype != torch.bool:
                    raise Refused(f"the mask of the 3-D scores is {filled.t.dtype}, not bool")
                try:
                    keep = torch.broadcast_to(~filled.t if sense else filled.t, (H, r1 - r0, T))
                except RuntimeError:
                    raise Refused(f"the mask's rows {tuple(filled.t.shape)} are not [H, rows, T] = "
                                  f"{(H, r1 - r0, T)}") from None
                found = VarlenSelected.first_difference(keep, chosen_there[0], pos_there[0], block, row0=r0)
                if found is not None:
                    differences.append((*found, bool(keep[found[0], found[1] - r0, found[2]])))
            if differences:
                head, query, key, sees = min(differences)
                seen = "sees" if sees else "hides"
                raise Refused(f"the mask of the 3-D scores over packed tokens differs from nsa.selected_attention's "
                              f"visibility (l'={block}, per document) on probe block choice {i}: head {head}, query "
                              f"t={query} (position {int(pos[0, query])}, blocks {chosen[0, head // h, query].tolist()}) "
                              f"{seen} token {key}")
        return pos[0]

    @staticmethod
    def first_difference(keep: torch.Tensor, chosen: torch.Tensor, pos: torch.Tensor, block: int,
                         rows: int = VERIFY_ROWS, row0: int = 0) -> tuple[int, int, int] | None:
        """The first (head, query, key), in that order, where keep [H, R, T] (the mask's rows row0 ..
        row0 + R - 1; query and key are global) differs from the op's
        visibility for the block ids chosen [G, T, n] on positions pos [T] (token s for query t iff
        s <= t and s lies in a chosen block of t's document: (s - (t - pos[t])) // l' in the ids,
        the group's ids for each of its H // G heads); None where every element is equal.

        The visibility is built per document, O(H * T * L) for documents of L tokens (the former
        full-width test built [G, T, T, n]), and keep is read once: the queries, `rows` at a time
        among those of one document start t - pos[t], are compared with the op's block mask over
        the keys from their document's start to the last query (the ids scattered into blocks,
        repeated over each block's l' tokens); every key outside those columns must be hidden."""
        H, R, T = keep.shape
        G = chosen.shape[0]
        h = H // G
        device = keep.device  # the GPU while compiling there: keep's chunks are not copied to the CPU
        chosen, pos = chosen.to(device), pos.to(device)
        t_all = torch.arange(T, device=device)
        start = t_all - pos  # [T]: each query's document start
        cut = torch.ones(T, dtype=torch.bool, device=device)
        cut[1:] = start[1:] != start[:-1]
        firsts = cut.nonzero().flatten().tolist()  # the first row of each run of one document start
        found = []
        for a, b in zip(firsts, firsts[1:] + [T]):
            doc = int(start[a])
            for r0 in range(max(a, row0), min(b, row0 + R), rows):  # keep's rows only
                r1 = min(b, row0 + R, r0 + rows)
                lo, hi = min(max(doc, 0), r1), r1  # the keys some of these queries may see: [doc, r1)
                part = keep[:, r0 - row0:r1 - row0]
                for first_key, outside in ((0, part[..., :lo]), (hi, part[..., hi:])):
                    if bool(outside.any()):
                        head, query, key = (int(x) for x in outside.nonzero()[0])
                        found.append((head, r0 + query, first_key + key))
                blocks = -(-(hi - doc) // block) if hi > doc else 0
                picked = torch.zeros(G, r1 - r0, blocks + 1, dtype=torch.bool, device=device)
                ids = chosen[:, r0:r1]  # [G, rows, n]: ids past the document's keys pick no key here
                picked.scatter_(-1, torch.where((ids >= 0) & (ids < blocks), ids, blocks), True)
                offset = torch.arange(lo, hi, device=device) - doc  # [width]: the keys' positions in the document
                want = picked[:, :, offset // block]  # [G, rows, width]
                want &= (torch.arange(lo, hi, device=device)[None, :] <= t_all[r0:r1, None])[None]
                inside = part[..., lo:hi].unflatten(0, (G, h)) != want[:, None]  # [G, h, rows, width]
                if bool(inside.any()):
                    group, head, query, key = (int(x) for x in inside.nonzero()[0])
                    found.append((group * h + head, r0 + query, lo + key))
        return min(found) if found else None

    @staticmethod
    def rewrite(graph: fx.Graph, plan: dict) -> None:
        probs, pv = plan["probs"], plan["pv"]
        order = {node: i for i, node in enumerate(graph.nodes)}
        if order[plan["ids"]] > order[pv]:
            raise Refused("the block ids are computed after the selected branch")
        q, k, v = (call(graph, torch.unsqueeze, x, 0, anchor=pv) for x in (probs.q, probs.k, plan["v"]))
        both = call(graph, torch.ops.nsa.selected_attention, q, k, v, plan["ids"], plan["block"], probs.scale,
                    plan["backend"], plan["pos"], 0, plan["doc_len"], anchor=pv)
        out = call(graph, operator.getitem, call(graph, operator.getitem, both, 0, anchor=pv), 0, anchor=pv)
        pv.replace_all_uses_with(out)
        erase_replaced(graph, [pv], [plan["cast"] or probs.p])
        cmp.erase_dead(graph, set(plan["region"]))


PASS = SelectedAttention()
