"""compressed_attention: NSA's compressed branch (attention over pooled block tokens under a
staircase mask) -> one GQA-native compressed-attention op.

Matches (torch IR), anchored at the softmax (models/nsa.py `NSAAttention.compressed_attention`):
    k_cmp = pool(k)                                  # [B, Tc, G, Dk], see "pooling" below
    k_rep = k_cmp.transpose(1, 2).repeat_interleave(h, dim=1)   # or [:, :, None].expand(..).reshape(..), or none
    scores = upcast(q @ k_rep.transpose(-1, -2)) * c  # q [B, H, S, Dk]; upcast .float()/.to(float32)/none
    scores = scores.masked_fill(~visible, -inf)        # or torch.where(visible, scores, -inf), or a fill <= -1e4
    p = softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible   # [B, H, S, Tc]
    o = p.to(v.dtype) @ v_rep                         # v_rep as k_rep; .to optional (the cast may feed others too)
Pooling: the compression blocks are read from the window view that cuts the key sequence into
blocks, `x.unfold(1, l, d)` (mean pooling `.mean(-1)`, or the MLP BlockCompressor on it), an
`as_strided` view with unfold's layout, or `x[:, :Tc*l].view(B, Tc, l, ..)` (l = d). Every op
from that view to k_cmp must keep the block axis apart (elementwise ops, linear / norms over the
feature dims, reductions and reshapes that do not touch it) and read no other sequence data
(parameters and constants only): then compressed token i depends on tokens [i*d, i*d + l) alone,
and (l, d) are the block and stride. The sequence may be padded at its end first (`F.pad`, then
the view: the padded, partial block ends after the last token and is never visible). A pooling
this reader cannot follow (a convolution, `avg_pool`, a weighted einsum, prefix sums) is probed
instead (`probe_pooling`): for the (l, d) the visibility mask shows, random float64 values with
tokens perturbed 2l apart (each residue in turn) may change only the pooled tokens whose block
holds a perturbed token, and every pooled token must change for some token (a check on probes).
The probes perturb the nearest [B, S, ..] node through which alone the sequence reaches the
pooling (the keys after their projection: `_unpooled_sources`), walking back towards the
projection where a nearer one refuses (prefix sums read the token before each block, their
differences do not); they run on one batch row where the region keeps its rows apart
(nsa_compile/batch_slice.py) and on the graph's device, so their cost is the pooling's own (probes
that ran the float64 projection at the seed shape took minutes). A pooling that fails both is
refused.

Verified, not assumed: the position-only subgraphs of the three masks (the -inf mask, the
has_block zeroing, the final `* visible`) are evaluated at compile time (no inputs, so this is a
proof for the shape compiled; at symbolic sizes, for each probe size, see the end). The -inf mask must be the staircase i*d + l - 1 <= t of the
pooling's (l, d); the zeroing must hit exactly the rows without a visible block (eager's softmax
would give NaN there), and the final mask must keep every visible block and clear those rows
(else eager gives them 1/Tc each); the op gives those rows 0. Both may be absent only when no
row lacks a block (l = 1).

lucidrains' branch (tests/corpus/lucidrains_*.py; issue 17), three variants the op computes
through its staircase intercept `block` (nsa_compile/ops/compressed.py), each read, not assumed:
- memory slots: k_cmp = cat((mem, pooled), dim=2), mem read from parameters only (`split_memory`);
  the mask's first M columns must be visible to every query (evaluated), the rest is checked
  against the pooling as below;
- strict visibility: block i seen from t = i*d + l (one token after its last): the evaluated mask
  must be the staircase for a delay of 0 or 1 token (`visibility_delay`; 2 or more is refused);
- windows ending at i*d + e with e != l - 1 (F.pad at the start + nn.Unfold: block i covers
  [(i+1)d - l, (i+1)d)): when the fixed-window probe fails, `probe_windows_ending` measures each
  pooled token's window on probes and takes e when every window ends at i*d + e.
The whole mask [S, M + Tc] must then be one staircase (memory before blocks with l - 1 + delay <=
d; else refused), the op gets block = e + 1 + delay - M*d (<= 0 with several slots). A finite
fill <= LARGE_NEGATIVE (`-finfo.max // 10`) is read as -inf: it hides a key as -inf does where the
row keeps one, and rows without one must be zeroed and cleared as with -inf (with memory there
are none). The scores, masked or not, may have other users (lucidrains' block choice reads the
masked logits): they stay for them, the op replaces the softmax and p @ v.

Packed documents (models/nsa.py with `pos`): the masks read one data input, an int64 [B, S]
tensor of positions within documents (the model's `l_pos_` placeholder, or the nearest int64
[B, S] node through which alone they read data), and the keys are pooled at every token
(`x.unfold(1, l, 1)`: Tc = S - l + 1 slots). The stride d appears only in the mask, so it is
read from it: with one document per row (pos = 0..S-1) the last query sees slots 0, d, 2d, ...
(one slot only when S - l < d: then every d > S - l gives the same mask, and d = S - l + 1 is
taken). The masks are then evaluated on probe positions of the real [B, S] shape and compared
with NSA's packed visibility for (l, d): slot s is visible to t iff s + l - 1 <= t, s >= t -
pos[t], pos[s] % d == 0 and pos[s + l - 1] == pos[s] + l - 1; the zeroing and the final mask
as above, per probe, for the rows without a visible slot. This is a check on probes, not a proof
for every pos: one document, documents of 1, 2, < l, l, l + 1 tokens and lengths that are not
multiples of d, documents starting on block boundaries and just off them, two long documents,
random packings, and a document per token, each batch row packed differently. The probes are
valid positions (0 at each document start, +1 per token): masks that differ only on invalid pos
are accepted (the model checks pos, `check_positions`); for instance, the term that keeps a slot
inside its document is implied by the other two on valid positions. The packed masks are
[B, 1, S, Tc], about S^2 per batch row: they are evaluated in row chunks of CHUNK_ELEMENTS
(nsa_compile/mask_rows.py: every element, O(rows * Tc) memory), which needs their [S, Tc] nodes
to be row-local (element-wise ops, fills, leading-dim views, reductions over the slots with
keepdim); masks that are not (a transpose, `visible.any(-1)[..., None]`) are evaluated whole, up
to MAX_VERIFIED_ELEMENTS. The reasons name what the whole masks would show first, whatever the
chunks. Up to B * S * Tc = MAX_VERIFIED_PACKED (2^35) elements per probe; one verdict per mask
structure and graph serves every layer, and select_blocks, which checks the masks it reads again.

Packed [T, H, D] tokens (varlen, tests/corpus/xunhaolai_varlen.py; `verify_varlen`): 3-D scores
[H, T, N] = q [H, T, Dk] @ K^T over N compressed keys [G, N, Dk] that each document pooled on its
own and the model concatenated (per-document Python loops over cu_seqlens, unrolled), read as
[1, H, T, N]. The T tokens are one packed row of the op's packed form. K and V are probed
(`varlen_windows`: float64 noise on tokens VARLEN_PROBE_PERIOD apart, each residue in turn): key j
must depend on one window of l tokens [slot_j, slot_j + l), the same for K and V. The -inf mask
is evaluated at compile time with the in-place writes that build it (`written_region`: a
`zeros` filled by `mask[a:b, c:d] = ...`) and must equal, element for element, NSA's packed
visibility of slot_j for positions pos [T] and a stride d: the window op's constant positions (the
documents of its mask) where they fit, else those the keys and the mask show
(`varlen_documents`: a key's document ends where its rows end and starts at its first key's
window; d the gcd of the keys' positions), with no other slot visible; the zeroing and the
final mask as above. Refused, naming the query: a key pooled one token late (it reads a token
after the query that first sees it), a mask that shows a key to another document's queries or
a block one token late. The op then gets q[None], K and V copied into T - l + 1 slots
(`index_copy` at the constant slot_j, zeros elsewhere: no query sees them) and the constant
positions [1, T]; o[0] replaces p @ v. Static sizes only (a length change compiles a graph with
other constant documents).

A chunk of queries (a model's loop over query chunks, issue 17; `query_rows`): q = q_full[:, :,
a:b] with the keys pooled from q_full's whole sequence; the masks are verified with row r at token
a + r (the staircase at that offset; off by one either way is refused, naming it), and the op gets
q_offset = a (after pos = None). Not with packed documents.

Becomes `o, lse = torch.ops.nsa.compressed_attention(q, k_cmp^T, v_cmp^T, l, d, c, backend)` on
the un-repeated pooled K/V [B, G, Tc, D] (nsa_compile/ops/compressed.py), with the positions as
its last argument (`pos`) in the packed form; o replaces the p @ v product. The pooling stays in
the graph (cheap; Inductor fuses it). p usually has another user, the block selection: p and what
computes it stay for it (select_blocks, the next pass, takes the lse from this op and removes
them); only what became dead is erased.

Refuses (graph unchanged), with the reason shown by `explain`:
- a softmax that is not over [B, H, S, Tc] scores masked with -inf, or not followed by p @ v;
- zeroed scores used anywhere else (the dense tensor is needed);
- fp16/bf16 scores without the upcast (the op computes the softmax in float32);
- a mask that depends on data, is not one [S, Tc] pattern, or is not the pooling's staircase (a
  block seen one token early, or two or more late); a missing or wrong has_block zeroing or final
  `* visible`; a finite fill on rows without a visible block that are not zeroed;
- memory slots hidden from some query, computed from the sequence, different for K and V, with
  packed documents, or before overlapping blocks (not one staircase);
- packed: masks that read data besides one int64 [B, S] position tensor, differ between heads,
  or differ from the packed visibility on a probe (a document term off by one, slots counted
  from the row start instead of the document, blocks that cross a document boundary, a zeroing
  or final mask that ignores the documents); positions with keys pooled at a stride other than 1;
- a pooling without a readable (l, d), one that mixes blocks or reads other sequence data, K and
  V pooled with different (l, d), or over a sequence that is not the queries' (nor the one a chunk
  of queries is cut from: below);
- a verification larger than the cap (MAX_VERIFIED_ELEMENTS for masks evaluated whole; packed
  masks in chunks: B * S * Tc over MAX_VERIFIED_PACKED);
- symbolic sizes (dynamic shapes): a branch that differs from NSA's at one of the probe sizes
  (`Sizes.probes`: the sizes Dynamo saw, then every symbol +1 and +19; the reason names them) or
  whose (l, d) is not the same at all of them; packed documents (pos) at symbolic sizes (verified
  at static sizes only).

Symbolic sizes: a graph Dynamo compiled with S as a symbol is verified as above at each probe
size, every mask element evaluated there, with the size nodes (s27, s27 // 4) as their numbers: a
check on probe sizes, not a proof for every S. The op's arguments hold no size (l, d, the scale
are constants); its shapes come from its tensors. The end padding before a view into blocks may
then be a size (C * l - S: `F.pad(x, (.., 0, C * l - S))`): read at any sign, since the blocks cut
from the start of the result are blocks of x either way. A graph whose sizes a guard fixed (its
SymInts each one number: a model that reads a length as a value) is evaluated as a static one.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import operator
import time
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile import batch_slice
from nsa_compile.attention_match import (
    LARGE_NEGATIVE, Refused, ancestors, erase_replaced, evaluate_node, only_user, strip_upcast, unrepeat,
)
from nsa_compile.fx import MATMULS, arg, call, constant, op_name, same, size_value, value
from nsa_compile.mask_rows import CHUNK_ELEMENTS, RowChunks
from nsa_compile.ops.common import upcast_dtype
from nsa_compile.ops.compressed import choose_backend, why_not_triton
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes

# The masks are evaluated at compile time: more elements than this (summed over the evaluated
# nodes that materialize a tensor) are not verified. The -inf mask alone is S * Tc ~ S^2 / d
# elements: 2.7e8 at S = 64k, d = 16, so the cap covers the paper's lengths.
MAX_VERIFIED_ELEMENTS = 2**31
# Packed masks (a slot per token: S * Tc ~ S^2 per batch row) are evaluated in row chunks of
# CHUNK_ELEMENTS, on 8 probes: up to this many elements per probe (B * S * Tc), the window pass's
# bound, batch 8 at S = 64k or batch 2 at S = 128k.
MAX_VERIFIED_PACKED = 2**35
KERNEL = ("nsa.compressed_attention[{backend}] (l={block}, d={stride}{packed}{variant}, GQA-native, no repeated "
          "K/V{why})")

# Ops that return a view (no new elements) when the position subgraphs are evaluated.
_VIEWS = {"expand", "expand_as", "broadcast_to", "view", "unsqueeze", "squeeze", "getitem", "transpose",
          "permute", "unflatten", "movedim", "swapaxes", "as_strided", "t", "reshape", "flatten"}
_RANDOM = ("rand", "bernoulli", "dropout", "multinomial", "normal", "poisson", "uniform", "exponential")


def first(node: fx.Node):
    """The tensor a unary op / method works on (positional or `input=`)."""
    return arg(node, 0, "input")


def name_of(node) -> str | None:
    """op_name without the dunder of a method form: Dynamo on PyTorch 2.11 records `a == b` on a
    tensor as the method `a.__eq__(b)`, later versions as operator.eq ('eq' either way)."""
    name = op_name(node) if isinstance(node, fx.Node) else None
    if name and node.op == "call_method" and name.startswith("__") and name.endswith("__"):
        return name[2:-2]
    return name


def is_const(x, want: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and float(x) == want


def fill_of(node: fx.Node, fill: float) -> tuple[fx.Node, fx.Node, bool] | None:
    """(x, mask, sense) when `node` sets x to the constant `fill` where mask == sense:
    x.masked_fill(mask, fill) (sense True), torch.where(mask, x, fill) (sense False) or
    torch.where(mask, fill, x) (sense True); None for anything else."""
    name = op_name(node)
    if name == "masked_fill":
        x, mask, val = first(node), arg(node, 1, "mask"), arg(node, 2, "value")
        if isinstance(x, fx.Node) and isinstance(mask, fx.Node) and is_const(val, fill):
            return x, mask, True
    if name == "where" and len(node.args) == 3 and not node.kwargs and isinstance(node.args[0], fx.Node):
        cond, a, b = node.args
        if isinstance(a, fx.Node) and is_const(b, fill):
            return a, cond, False
        if isinstance(b, fx.Node) and is_const(a, fill):
            return b, cond, True
    return None


def large_negative_fill_of(node: fx.Node) -> tuple[fx.Node, fx.Node, bool, float] | None:
    """(x, mask, sense, fill) when `node` sets x to a constant fill <= LARGE_NEGATIVE (finfo.min,
    -finfo.max, lucidrains' `-finfo.max // 10`, -1e9; as x's dtype stores it) where mask == sense,
    in the forms of `fill_of` (-inf where x's dtype rounds the fill to it: -finfo(float32).max in
    fp16); None for anything else (a -inf constant included: `fill_of` reads it)."""
    name = op_name(node)
    if name == "masked_fill":
        candidates = [(first(node), arg(node, 1, "mask"), arg(node, 2, "value"), True)]
    elif name == "where" and len(node.args) == 3 and not node.kwargs:
        cond, a, b = node.args
        candidates = [(a, cond, b, False), (b, cond, a, True)]
    else:
        return None
    for x, mask, fill, sense in candidates:
        if (isinstance(x, fx.Node) and isinstance(mask, fx.Node) and isinstance(fill, (int, float))
                and not isinstance(fill, bool) and value(x) is not None and value(x).is_floating_point()):
            stored = float(torch.tensor(fill, dtype=value(x).dtype, device="cpu"))  # as x's dtype stores it
            if stored <= LARGE_NEGATIVE:
                return x, mask, sense, stored
    return None


def split_scale(node: fx.Node) -> tuple[fx.Node, float]:
    """scores * c, c * scores, scores / c -> (scores, c); anything else is unscaled (c = 1)."""
    name, (a, b) = name_of(node), (node.args + (None, None))[:2]
    if name == "mul" and isinstance(b, (int, float)) and isinstance(a, fx.Node):
        return a, float(b)
    if name == "mul" and isinstance(a, (int, float)) and isinstance(b, fx.Node):
        return b, float(a)
    if name in ("truediv", "div") and isinstance(b, (int, float)) and isinstance(a, fx.Node) and not node.kwargs:
        return a, 1.0 / float(b)
    if name in ("mul", "truediv", "div"):
        raise Refused("the scores are not scaled by a constant (q @ k^T * c)")
    return node, 1.0


def ungroup(node: fx.Node) -> tuple[fx.Node, int]:
    """K/V expanded for the query heads -> (K/V [B, G, T, D], h): x.repeat_interleave(h, dim=1), or
    x[:, :, None].expand(B, G, h, T, D).reshape(B, G*h, T, D) (head g*h + r reads group g, as the
    repeat; the size-1 dim may also be copied by repeat_interleave(h, dim=2), which canonicalize
    writes for lucidrains' `repeat(1, 1, h, 1, 1)`); (node, 1) for anything else."""
    x, h = unrepeat(node)
    if x is not node:
        return x, h
    middle = first(node) if op_name(node) in ("reshape", "view", "flatten") else None
    if not isinstance(middle, fx.Node):
        return node, 1
    dim = arg(middle, 2, "dim")
    copied = op_name(middle) in ("expand", "broadcast_to") or (
        op_name(middle) == "repeat_interleave" and isinstance(arg(middle, 1, "repeats"), int)
        and isinstance(dim, int) and dim % 5 == 2 and arg(middle, 3, "output_size") is None)
    if not copied:
        return node, 1
    expanded = first(node)
    unsqueezed = first(expanded)
    if not isinstance(unsqueezed, fx.Node) or not isinstance(first(unsqueezed), fx.Node):
        return node, 1
    name, index = op_name(unsqueezed), arg(unsqueezed, 1, "dim")
    if not (name == "unsqueeze" and isinstance(index, int) and index % 5 == 2 or
            name == "getitem" and index in ((slice(None), slice(None), None),
                                            (slice(None), slice(None), None, Ellipsis))):
        return node, 1
    x, vals = first(unsqueezed), [value(n) for n in (first(unsqueezed), expanded, node)]
    if any(v is None for v in vals) or [v.dim() for v in vals] != [4, 5, 4]:
        return node, 1
    (B, G, T, D), big, out = vals[0].shape, tuple(vals[1].shape), tuple(vals[2].shape)
    h = big[2]
    if not same(big, (B, G, h, T, D)) or not same(out, (B, G * h, T, D)):
        return node, 1
    return x, h


def unrepeat_heads(node: fx.Node) -> tuple[fx.Node, int]:
    """3-D K/V expanded for the query heads, x.repeat_interleave(h, dim=0) of x [G, N, D] (packed
    tokens, heads first) -> (x, h); (node, 1) for anything else."""
    x = arg(node, 0, "input")
    repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
    if (op_name(node) == "repeat_interleave" and isinstance(x, fx.Node) and value(x) is not None
            and value(x).dim() == 3 and isinstance(repeats, int) and not isinstance(repeats, bool)
            and isinstance(dim, int) and dim % 3 == 0 and arg(node, 3, "output_size") is None):
        return x, repeats
    return node, 1


# --- position-only subgraphs ----------------------------------------------------------------


class PositionSubgraphs:
    """Evaluates subgraphs computed from positions only (aranges, comparisons, arithmetic) at
    compile time: once per structure (each layer repeats the same one), with a cost cap. A
    subgraph may read one probe input (`inputs`: a node -> the tensor it stands for, named by
    `probe`, which the cache key holds).

    In a graph with symbolic sizes the subgraphs are evaluated under one assignment of numbers
    to the size symbols (`sizes`; `at` gives the evaluator for another, sharing the cache): the
    size nodes they read (s27, s27 // 4) enter as those numbers, which the cache key holds. So do
    the size nodes of a graph whose sizes a guard has fixed (SymInt nodes of one number each)."""

    def __init__(self, sizes: Sizes | None = None):
        self.sizes = sizes
        self.numbers = sizes.size_nodes() if sizes is not None else {}
        self.cache: dict[str, torch.Tensor] = {}
        self._probes: dict[tuple, list] = {}

    def at(self, sizes: Sizes) -> "PositionSubgraphs":
        """This evaluator under the assignment `sizes` (itself where that is its own)."""
        if sizes is self.sizes:
            return self
        other = PositionSubgraphs.__new__(PositionSubgraphs)
        other.sizes, other.cache, other._probes = sizes, self.cache, self._probes
        other.numbers = sizes.size_nodes()
        return other

    def shape(self, x) -> tuple:
        """A fake tensor's (or a shape's) sizes as numbers under this evaluator's assignment."""
        dims = x.shape if isinstance(x, torch.Tensor) else x
        return tuple(dims) if self.sizes is None else self.sizes.shape(dims)

    def probes(self, B: int, S: int, block: int, stride: int, device) -> list[tuple[str, torch.Tensor]]:
        """`position_probes`, made once per geometry and device (the layers share them)."""
        key = (B, S, block, stride, str(device))
        if key not in self._probes:
            self._probes[key] = position_probes(B, S, block, stride, device)
        return self._probes[key]

    def plan(self, root: fx.Node, what: str, inputs: dict | None = None, probe: str = "") -> tuple[list, str]:
        """(the nodes of root's position subgraph in post-order, with the `inputs` and size nodes
        it reads as leaves; the text that keys it: each op with its arguments, the inputs by
        `probe` name and shape, the sizes as numbers), or Refused where it reads data or draws
        random numbers."""
        inputs = inputs or {}
        nodes, index, stack = [], {}, [(root, False)]
        while stack:  # post-order: inputs before users
            node, done = stack.pop()
            if done:
                if node not in index:
                    index[node] = len(nodes)
                    nodes.append(node)
                continue
            if node in index:
                continue
            if node in inputs or node in self.numbers:  # a leaf: the probe, or a size's number
                stack.append((node, True))
                continue
            if node.op not in ("call_function", "call_method"):
                raise Refused(f"the {what} depends on {node.op} {node.name} (data, not positions)")
            name = op_name(node) or ""
            if any(word in name for word in _RANDOM):
                raise Refused(f"the {what} uses {name} (random, not positions)")
            stack.append((node, True))
            stack.extend((x, False) for x in reversed(node.all_input_nodes) if x not in index)
        ops = []
        for node in nodes:
            if node in inputs:
                ops.append(("input", probe, tuple(inputs[node].shape)))
                continue
            if node in self.numbers:
                ops.append(("size", self.numbers[node]))
                continue
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
            if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
                   for x in torch.utils._pytree.tree_leaves(args)):
                raise Refused(f"the {what} reads a symbolic size that is no node of the graph: not verified")
            ops.append((node.op, node.target, args))
        return nodes, repr(ops)

    def cost(self, nodes: list[fx.Node], inputs: dict) -> int:
        """Elements the evaluation of `nodes` materializes (views aside)."""
        return sum(math.prod(self.shape(value(n))) for n in nodes
                   if n not in inputs and value(n) is not None and op_name(n) not in _VIEWS)

    def evaluate(self, root: fx.Node, what: str, inputs: dict | None = None, probe: str = "") -> torch.Tensor:
        """root's value with `inputs` (a node -> the tensor it stands for, named by `probe`) and
        the sizes as numbers, whole: Refused over MAX_VERIFIED_ELEMENTS."""
        inputs = inputs or {}
        nodes, key = self.plan(root, what, inputs, probe)
        if key in self.cache:
            return self.cache[key]
        cost = self.cost(nodes, inputs)
        if cost > MAX_VERIFIED_ELEMENTS:
            raise Refused(f"verifying the {what} takes {cost:,} elements, over the cap of "
                          f"{MAX_VERIFIED_ELEMENTS:,}: not verified at this size yet")
        last_use = {x: i for i, node in enumerate(nodes) for x in node.all_input_nodes}
        env = {}
        for i, node in enumerate(nodes):
            if node in inputs or node in self.numbers:
                env[node] = inputs[node] if node in inputs else self.numbers[node]
                continue
            on = f" on probe positions '{probe}'" if probe else ""
            env[node] = evaluate_node(node, env, f"the {what}{on}")
            for x in node.all_input_nodes:  # free what no later node reads (S x Tc tensors at long S)
                if last_use[x] == i:
                    env.pop(x, None)
        result = env[root]
        if not isinstance(result, torch.Tensor):
            raise Refused(f"the {what} is not a tensor")
        self.cache[key] = result
        return result


def as_grid(mask: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    """A position mask as one [rows, cols] pattern (leading dims must be 1: the same for every
    batch row and head)."""
    if mask.dim() > 2:
        if any(size != 1 for size in mask.shape[:-2]):
            raise Refused(f"the {what} is {tuple(mask.shape)}: not one [S, Tc] pattern for all rows and heads")
        mask = mask.reshape(mask.shape[-2:])
    try:
        return torch.broadcast_to(mask, (rows, cols))
    except RuntimeError:
        raise Refused(f"the {what} {tuple(mask.shape)} does not broadcast to [S, Tc] = {(rows, cols)}") from None


def staircase(S: int, Tc: int, block: int, stride: int, device, q_offset: int = 0) -> torch.Tensor:
    """visible[r, i] = i*d + l - 1 <= t for query row r, token t = q_offset + r (q_offset > 0 for a
    chunk of queries): compression block i lies entirely in t's past."""
    t = q_offset + torch.arange(S, device=device)[:, None]
    i = torch.arange(Tc, device=device)[None, :]
    return i * stride + block - 1 <= t


def staircase_reason(keep: torch.Tensor, block: int, stride: int, q_offset: int = 0) -> str:
    """Why `keep` [S, Tc] (query rows from token q_offset) is not the staircase of (l, d): an offset
    when it is one (read where block 0 appears, else one token either way: a chunk of queries may
    see block 0 from its first row), else in general, naming the first row that differs."""
    S, Tc = keep.shape
    seen = keep[:, 0].nonzero()
    appears = len(seen) and (int(seen[0]) > 0 or q_offset == 0)  # where block 0 appears, if in these rows
    shifts = ([q_offset + int(seen[0]) - (block - 1)] if appears else []) + [-1, 1]
    for shift in shifts:
        if shift and torch.equal(keep, staircase(S, Tc, block + shift, stride, keep.device, q_offset)):
            if shift < 0:
                return (f"the visibility mask is off by {-shift}: block i is visible from t = i*d + l - 1 - {-shift}, "
                        f"before its last token (a later token leaks in; pooling l={block}, d={stride})")
            return (f"the visibility mask is off by {shift}: block i becomes visible at t = i*d + l - 1 + {shift}, "
                    f"not at its last token (pooling l={block}, d={stride})")
    rows = (keep != staircase(S, Tc, block, stride, keep.device, q_offset)).any(-1).nonzero()
    at = f" (first at query row {int(rows[0])}, token {q_offset + int(rows[0])})" if q_offset and len(rows) else ""
    return f"the visibility mask is not the staircase i*d + l - 1 <= t of the pooling (l={block}, d={stride}){at}"


# --- the pooling ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pooling:
    source: fx.Node  # the unpooled sequence [.., S at seq_dim, ..]
    seq_dim: int
    block: int  # l
    stride: int  # d
    end: int | None = None  # block i's last token is i*d + end (None: l - 1, NSA's windows [i*d, i*d + l))

    @property
    def last(self) -> int:
        """Block i's last token is i*d + last."""
        return self.block - 1 if self.end is None else self.end


def data_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a graph input other than a parameter (the sequence's data). Sizes
    (the SymInt inputs and expressions of a graph with symbolic sizes) are not data."""
    data = set()
    for node in graph.nodes:
        if isinstance(node.meta.get("example_value", node.meta.get("val")), torch.SymInt):
            continue
        if node.op == "placeholder":
            if not isinstance(node.meta.get("example_value", node.meta.get("val")), torch.nn.Parameter):
                data.add(node)
        elif any(x in data for x in node.all_input_nodes):
            data.add(node)
    return data


def _prefix_slice_source(node: fx.Node, dim: int) -> fx.Node:
    """x[:, :N] (a prefix of dim `dim`, every other dim whole; `...` for whole dims, trailing whole
    dims optional: x[..., :N, :]) -> x; otherwise node itself."""
    index = arg(node, 1, "index")
    if op_name(node) != "getitem" or not isinstance(first(node), fx.Node) or not isinstance(index, tuple):
        return node
    whole = slice(None, None, None)
    if Ellipsis in index and index.count(Ellipsis) == 1 and value(first(node)) is not None:
        at = index.index(Ellipsis)
        fill = value(first(node)).dim() - (len(index) - 1)
        if fill < 0:
            return node
        index = index[:at] + (whole,) * fill + index[at + 1:]
    while len(index) > dim + 1 and index[-1] == whole:
        index = index[:-1]
    if len(index) == dim + 1 and all(s == whole for s in index[:dim]):
        cut = index[dim]
        if isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1):
            return first(node)
    return node


def _end_padding_source(node: fx.Node, axis: int) -> fx.Node:
    """F.pad(x, ...) that appends constant tokens at the end of dim `axis` only -> x; otherwise node.
    The blocks that take padded tokens end after the last real token: the staircase mask (checked
    later) never shows them, so what the padding holds does not matter."""
    if op_name(node) != "pad" or not isinstance(first(node), fx.Node) or value(first(node)) is None:
        return node
    pads, mode = arg(node, 1, "pad"), arg(node, 2, "mode", "constant")
    rank = value(first(node)).dim()
    # ints, or SymInts (size nodes: at symbolic sizes the padding is C * l - S, an expression of S)
    amounts = [size_value(p) for p in pads] if isinstance(pads, (tuple, list)) else [None]
    if mode != "constant" or None in amounts:
        return node
    end = 2 * (rank - 1 - axis) + 1  # pads run from the last dim backwards, (start, end) per dim
    if end >= len(amounts) or any(not same(p, 0) for i, p in enumerate(amounts) if i != end):
        return node
    # A symbolic end amount is read whatever its sign at a given S (a negative one cuts tokens off
    # the end): the blocks cut from the start of the result are then blocks of x either way.
    if isinstance(amounts[end], int) and amounts[end] < 0:
        return node
    return first(node)


def window_view(node: fx.Node, axis: int) -> Pooling | None:
    """The Pooling when `node` cuts a sequence into blocks along its dim `axis`: x.unfold(axis, l, d),
    x.as_strided with unfold's layout, or x[.., :Tc*l].view/reshape/unflatten(.., Tc, l, ..) (l = d);
    x may be padded at the end of the sequence first (F.pad: the last, partial block)."""
    pooling = _window_view(node, axis)
    if pooling is None:
        return None
    return Pooling(_end_padding_source(pooling.source, pooling.seq_dim), pooling.seq_dim, pooling.block,
                   pooling.stride)


def _window_view(node: fx.Node, axis: int) -> Pooling | None:
    name, out = op_name(node), value(node)
    src = first(node)
    if out is None or not isinstance(src, fx.Node) or value(src) is None:
        return None
    x = value(src)
    if name == "unfold":
        dim, size, step = arg(node, 1, "dimension"), arg(node, 2, "size"), arg(node, 3, "step")
        if isinstance(dim, int) and isinstance(size, int) and isinstance(step, int) and dim % x.dim() == axis:
            return Pooling(src, axis, size, step)
        return None
    if name == "as_strided":
        size, stride = arg(node, 1, "size"), arg(node, 2, "stride")
        offset = arg(node, 3, "storage_offset")
        if (not x.is_contiguous() or not (offset is None or same(offset, x.storage_offset())) or axis >= x.dim()
                or len(size) != x.dim() + 1 or len(stride) != x.dim() + 1
                or not isinstance(stride[axis], int) or not isinstance(x.stride(axis), int)):
            return None
        step, rem = divmod(stride[axis], x.stride(axis))
        shape, strides = list(x.shape), list(x.stride())
        shape[axis], strides[axis] = size[axis], stride[axis]
        if (rem or step < 1 or not same(size, shape + [size[-1]])
                or not same(stride, strides + [x.stride(axis)]) or not isinstance(size[-1], int)):
            return None
        return Pooling(src, axis, size[-1], step)
    if name in ("view", "reshape", "unflatten") and out.dim() == x.dim() + 1 and axis < x.dim():
        xs, os = tuple(x.shape), tuple(out.shape)
        if (isinstance(os[axis + 1], int) and same(xs[:axis], os[:axis])
                and same(xs[axis + 1:], os[axis + 2:]) and same(os[axis] * os[axis + 1], xs[axis])):
            return Pooling(_prefix_slice_source(src, axis), axis, os[axis + 1], os[axis + 1])
    return None


def _dims(spec, rank: int) -> set[int] | None:
    if isinstance(spec, int):
        return {spec % rank}
    if isinstance(spec, (tuple, list)) and all(isinstance(d, int) for d in spec):
        return {d % rank for d in spec}
    return None


_SAME_SHAPE = {"contiguous", "clone", "float", "half", "bfloat16", "double", "neg", "silu",
               "gelu", "relu", "sigmoid", "tanh", "exp", "abs", "sqrt", "rsqrt", "square", "softplus", "mish"}
_BINARY = {"add", "sub", "mul", "truediv", "div"}


def block_axis_inputs(node: fx.Node, axis: int, data: set, what: str = "keys") -> list[tuple[fx.Node, int | None]]:
    """The inputs of `node` with the dim that carries its block axis `axis` (None for inputs that
    carry no sequence data: parameters, constants), or Refused if the op mixes blocks."""
    name, out = name_of(node) or node.op, value(node)
    src = first(node) if node.op in ("call_function", "call_method") else None
    x = value(src)
    why = f"the pooled {what} are not a per-block function of the blocks ({name} on the way"
    if out is None or x is None and name not in _BINARY:
        raise Refused(f"{why})")
    rank = out.dim()
    side = [(n, None) for n in node.all_input_nodes if n is not src]

    def tracked(a: int) -> list:
        return [(src, a)] + side

    if name in ("transpose", "swapaxes"):
        d0, d1 = (d % rank for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1")))
        return tracked(d1 if axis == d0 else d0 if axis == d1 else axis)
    if name == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        dims = dims or arg(node, 1, "dims")
        return tracked(dims[axis] % rank)
    if name in ("to", "type_as") and x.dim() == rank:
        return [(src, axis)]  # another tensor given here only lends its dtype / device
    if name in _SAME_SHAPE and x.dim() == rank:
        return tracked(axis)
    if name in _BINARY:
        inputs = []
        for operand in (node.args[0], node.args[1]) if len(node.args) >= 2 else ():
            if not isinstance(operand, fx.Node):
                continue
            if operand not in data:
                inputs.append((operand, None))
                continue
            shape = value(operand).shape
            a = axis - (rank - len(shape))
            if a < 0 or not same(shape[a], out.shape[axis]):
                raise Refused(f"{why}: an operand is broadcast over the blocks)")
            inputs.append((operand, a))
        return inputs
    if name == "linear" and axis != rank - 1:
        return tracked(axis)
    if name in ("rms_norm", "layer_norm"):
        normalized = arg(node, 1, "normalized_shape")
        if isinstance(normalized, (tuple, list)) and axis < rank - len(normalized):
            return tracked(axis)
    if name in ("mean", "sum", "amax", "amin"):
        reduced = _dims(arg(node, 1, "dim"), x.dim())
        if reduced is not None:
            keep = arg(node, 2, "keepdim", False)
            kept = list(range(x.dim())) if keep else [d for d in range(x.dim()) if d not in reduced]
            if kept[axis] not in reduced:
                return tracked(kept[axis])
    if name == "flatten":
        start, end = (d % x.dim() for d in (arg(node, 1, "start_dim", 0), arg(node, 2, "end_dim", -1)))
        if axis < start or axis == start == end:
            return tracked(axis)
        if axis > start:
            return tracked(axis + end - start)
    if name == "unflatten":
        dim, sizes = arg(node, 1, "dim") % x.dim(), arg(node, 2, "sizes")
        if axis < dim:
            return tracked(axis)
        if axis >= dim + len(sizes):
            return tracked(axis - len(sizes) + 1)
    if name == "unsqueeze":
        dim = arg(node, 1, "dim") % rank
        if axis != dim:
            return tracked(axis if axis < dim else axis - 1)
    if name in ("view", "reshape") and same(x.shape[:axis + 1], out.shape[:axis + 1]):
        return tracked(axis)  # row-major: the leading dims up to the block axis keep their indices
    raise Refused(f"{why})")


def read_pooling(kv: fx.Node, what: str, data: set) -> Pooling:
    """The pooling that makes kv [B, G, Tc, D] (block axis 2) from a sequence, or Refused."""
    found, seen, stack = set(), set(), [(kv, 2)]
    while stack:
        node, axis = stack.pop()
        if (node, axis) in seen:
            continue
        seen.add((node, axis))
        if node.op not in ("call_function", "call_method"):
            raise Refused(f"the compressed {what} is not pooled from the sequence by a window view "
                          f"(unfold, as_strided, view into blocks): it reads {node.op} {node.name} directly")
        try:  # the user's arguments, read as the ops define them; anything unexpected refuses
            pooling = window_view(node, axis)
            inputs = [] if pooling is not None else block_axis_inputs(node, axis, data, what)
        except (TypeError, ValueError, IndexError, AttributeError):
            raise Refused(f"the pooled {what} are not a per-block function of the blocks ({op_name(node)} "
                          "with arguments not understood)") from None
        if pooling is not None:
            found.add(pooling)
            continue
        for inp, a in inputs:
            if a is None:
                if inp in data:
                    raise Refused(f"the compressed {what} also reads {inp.name}, sequence data outside its "
                                  "pooling window")
                continue
            stack.append((inp, a))
    if len(found) != 1:
        raise Refused(f"the compressed {what} is pooled by {len(found)} window views, not one")
    return found.pop()


# --- a pooling read by probing ------------------------------------------------------------------

# Random probes whose result moves by less than this (relative to its size) leave a pooled token
# unchanged: float64 rounding, as in block sums written as differences of prefix sums.
PROBE_TOLERANCE = 1e-9


def staircase_of(probs: Probabilities, subgraphs: PositionSubgraphs, memory: int = 0) -> tuple[int, int]:
    """(l, d) that the -inf mask's staircase shows: block 0 (the column after the `memory` slots)
    becomes visible at t = l - 1, block 1 d tokens later; Refused for a mask that reads data or
    shows no two blocks."""
    _, _, S, Tc = probs.shape
    mask, sense = probs.masks["inf"]
    filled = subgraphs.evaluate(mask, "visibility mask")
    if filled.dtype != torch.bool:
        raise Refused(f"the visibility mask is {filled.dtype}, not bool")
    keep = as_grid(filled if not sense else ~filled, S, Tc, "visibility mask")[:, memory:]
    first_seen = [int(keep[:, i].nonzero()[0]) if bool(keep[:, i].any()) else None
                  for i in range(min(Tc - memory, 2))]
    if len(first_seen) < 2 or None in first_seen or first_seen[1] <= first_seen[0]:
        raise Refused("the visibility mask shows fewer than two blocks: no (l, d) to read the pooling by")
    return first_seen[0] + 1, first_seen[1] - first_seen[0]


def probe_pooling(moved: "_Moved", what: str, block: int, stride: int) -> None:
    """Refused unless the pooled kv [B, G, Tc, D] that `moved` probes is pooled in blocks (block,
    stride) from the sequence it perturbs, checked on random probes in float64: tokens perturbed 2l
    apart (every residue, so every token once) must change at most the pooled tokens i whose
    window [i*d, i*d + l) holds a perturbed token, and every pooled token must change for some
    perturbation. A check on probes, not a proof: it is how poolings the structural reader cannot
    follow (convolutions, pooling ops, weighted einsums, prefix sums) are accepted."""
    S = moved.S
    period = 2 * block
    t = torch.arange(S, device="cpu")
    i = torch.arange(moved.Tc, device="cpu")
    reached = torch.zeros(moved.Tc, dtype=torch.bool, device="cpu")
    for r in range(min(period, S)):
        perturbed = t % period == r
        changed = moved(perturbed)
        js = t[perturbed]
        window = ((js[None, :] >= i[:, None] * stride) & (js[None, :] < i[:, None] * stride + block)).any(-1)
        if bool((changed & ~window).any()):
            k = int((changed & ~window).nonzero()[0])
            raise Refused(f"the compressed {what}: pooled token {k} depends on tokens outside its block "
                          f"[{k * stride}, {k * stride + block}) (probed, l={block}, d={stride})")
        reached |= changed
    if not bool(reached.all()):
        raise Refused(f"the compressed {what}: pooled token {int((~reached).nonzero()[0])} depends on no token "
                      "(probed)")


def probe_windows_ending(moved: "_Moved", what: str, seen_at: int, stride: int) -> Pooling:
    """The Pooling of the kv that `moved` probes, whose blocks are windows ending at i*d + e for
    one e (lucidrains' `F.pad` at the start + `nn.Unfold`: block i covers [(i+1)d - l, (i+1)d), the
    first ones shortened by the padding), measured on probes: tokens perturbed P = 2 (seen_at + 1 +
    2d) apart, each residue in turn, give each pooled token the residues it depends on, which must
    be one run of fewer than P (a window of consecutive tokens); its position follows from the run
    and the mask's time seen_at + i*d at which block i becomes visible (the window nearest it).
    Every window must end at i*d + e for the same e and be at most P / 2 tokens long; `end` = e
    and `block` = the longest window. A check on probes, as `probe_pooling`."""
    S, Tc = moved.S, moved.Tc
    period = min(2 * (seen_at + 1 + 2 * stride), S)
    t = torch.arange(S, device="cpu")
    runs = torch.stack([moved(t % period == r) for r in range(period)], dim=1)  # [Tc, P]
    ends, longest = set(), 0
    for k in range(Tc):
        residues = runs[k]
        count = int(residues.sum())
        if count == 0:
            raise Refused(f"the compressed {what}: pooled token {k} depends on no token (probed)")
        starts = (residues & ~residues.roll(1)).nonzero().flatten()  # a run starts where its left is False
        if count > period // 2 or len(starts) != 1:
            raise Refused(f"the compressed {what}: pooled token {k} does not depend on one window of at most "
                          f"{period // 2} consecutive tokens (probed, d={stride})")
        first = int(starts[0])
        expected = k * stride + seen_at  # the window ends at or just before it
        last = first + count - 1
        last += round((expected - last) / period) * period  # the run's place nearest the visibility
        ends.add(last - k * stride)
        longest = max(longest, count)
    if len(ends) != 1:
        raise Refused(f"the compressed {what}: the pooled windows end at i*d + e for several e ({sorted(ends)}; "
                      f"probed, d={stride}): not blocks at stride {stride}")
    return Pooling(moved.source, moved.seq_dim, longest, stride, ends.pop())


class _Moved:
    """The pooled tokens [Tc] (bool) that random float64 noise on the perturbed tokens [S] of the
    source (its sequence at seq_dim) moves."""

    def __init__(self, pooled, env, source, seq_dim, shape, gen, Tc):
        self.pooled, self.env, self.source, self.seq_dim, self.shape, self.gen, self.Tc = (
            pooled, env, source, seq_dim, shape, gen, Tc)
        self.S = shape[seq_dim]
        self.base = pooled(env)
        self.scale = float(self.base.abs().max()) + 1.0

    def __call__(self, perturbed: torch.Tensor) -> torch.Tensor:
        """perturbed [S] bool (CPU) -> moved [Tc] bool (CPU)."""
        shifted = dict(self.env)
        base = self.env[self.source]
        noise = torch.randn(self.shape, generator=self.gen, dtype=torch.float64, device="cpu").to(base.device)
        along = [self.S if i == self.seq_dim else 1 for i in range(len(self.shape))]
        shifted[self.source] = base + noise * perturbed.to(base.device).view(along)
        moved = (self.pooled(shifted) - self.base).abs().amax(dim=(0, 1, 3)) > PROBE_TOLERANCE * self.scale
        return moved.cpu()


def _sequence_input(kv: fx.Node, what: str, B: int, S: int, sizes: Sizes) -> fx.Node:
    """The one [B, S, ..] floating-point graph input (not a parameter) kv reads: the sequence."""
    sources = [n for n in ancestors([kv]) if n.op == "placeholder" and (val := value(n)) is not None
               and val.dim() >= 2 and sizes.shape(val)[:2] == (B, S) and val.is_floating_point()
               and not isinstance(val, torch.nn.Parameter)]
    if len(sources) != 1:
        raise Refused(f"the compressed {what} are not pooled by a form the pass reads, and they read "
                      f"{len(sources)} [B, S, ..] inputs, not one sequence to probe")
    return sources[0]


def _learned(node: fx.Node) -> bool:
    """Whether node applies a learned matrix (a parameter of 2 or more dims: a projection)."""
    return any(isinstance(val := value(x), torch.nn.Parameter) and val.dim() >= 2 for x in node.all_input_nodes)


def _unpooled_sources(kv: fx.Node, what: str, S: int, sizes: Sizes) -> list[tuple[fx.Node, int]]:
    """(node, seq_dim) for the probes of kv's pooling, nearest kv first: every [B, S, ..] or
    [B, X, S, ..] floating-point node through which alone the sequence input reaches kv, from
    the nearest back to the first learned projection (the keys' tokens are those after it), or to
    the sequence input itself where no projection is on the way. Probing the nearest is cheap
    (the pooling's ops alone); a farther one is tried where the nearer refuses (a prefix sum
    between them reads tokens outside the blocks, the sums' differences do not)."""
    B = sizes.shape(value(kv))[0]
    sequence = _sequence_input(kv, what, B, S, sizes)
    order = {n: i for i, n in enumerate(kv.graph.nodes)}

    def seq_dim(node: fx.Node) -> int | None:
        val = value(node)
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or isinstance(val, torch.nn.Parameter):
            return None
        shape = sizes.shape(val)
        dims = [i for i in (1, 2) if len(shape) > i and shape[i] == S]
        return dims[0] if len(shape) >= 3 and shape[0] == B and len(dims) == 1 else None

    found, nearer = [], kv
    for node in sorted(ancestors([kv]) - {kv}, key=order.__getitem__, reverse=True):
        if node is not sequence and (node.op not in ("call_function", "call_method") or seq_dim(node) is None):
            continue
        if node is not sequence and sequence in ancestors([kv], stop=node, into_sizes=False):
            continue  # another path reads the sequence: not through node alone
        if nearer is not kv and any(_learned(n) for n in ancestors([nearer], stop=node, into_sizes=False)):
            break  # a projection between: the tokens before it are not the keys' (the pooling's own MLP is kv's side)
        found.append((node, 1 if node is sequence else seq_dim(node)))
        nearer = node
        if node is sequence:
            break
    return found


def _pooling_probe(kv: fx.Node, what: str, source: fx.Node, seq_dim: int, sizes: Sizes) -> _Moved:
    """A `_Moved` for kv [B, G, Tc, D] probed at `source` (its sequence at seq_dim): the region
    between them in float64 on the CPU, at the shapes `sizes` gives, the size nodes it reads as
    their numbers; Refused for a region that cannot be probed."""
    numbers = sizes.size_nodes()
    Tc = sizes.shape(value(kv))[2]
    nodes = ancestors([kv], stop=source, into_sizes=False)
    order = {n: i for i, n in enumerate(kv.graph.nodes)}
    ops = sorted((n for n in nodes if n.op in ("call_function", "call_method") and n not in numbers
                  and n is not source), key=order.__getitem__)
    for node in ops:
        name = op_name(node) or ""
        if any(word in name for word in _RANDOM) or (name.endswith("_") and not name.startswith("_")):
            raise Refused(f"the compressed {what} use {name} (random or in place): not probed")
    # one batch row where the region keeps its rows apart (batch_slice): the probes' cost is then the
    # pooling's on one sequence, whatever the batch
    rows, changes, batched = None, {}, None
    B = sizes.shape(value(source))[0]
    if not sizes.symbolic and B > 1:
        try:
            changes, batched = batch_slice.one_row(ops, [source], kv, B)
            rows = 1
        except Refused:
            pass  # rows read together (or an op the proof does not know): probed at the graph's batch
    from nsa_compile import probe  # float64 evaluation of a region

    device = value(kv).device
    cost = batch_slice.peak_elements([source, *ops], sizes.shape, batched, rows)
    budget = probe.element_budget(device)
    if cost > budget:
        raise Refused(f"probing the compressed {what} takes {cost:,} elements, over the budget of {budget:,} on "
                      f"{device.type}")
    gen = torch.Generator().manual_seed(0)
    # on the graph's device (a GPU runs the float64 region fast; probe.run gives this project's ops in it
    # their reference backends, which take float64 anywhere), values drawn on the CPU (the same on any device)
    env = {n: numbers[n] for n in nodes if n in numbers}
    for n in nodes:
        if (n.op in ("placeholder", "get_attr") or n is source) and n not in numbers:
            val = value(n)
            if val is None or not val.is_floating_point():
                raise Refused(f"the compressed {what} read {n.name}, not a floating-point tensor (not probed)")
            shape = sizes.shape(val)
            env[n] = torch.randn((rows, *shape[1:]) if n is source and rows else shape, generator=gen,
                                 dtype=torch.float64, device="cpu").to(device)

    def pooled(values: dict) -> torch.Tensor:
        return probe.run(ops, dict(values), kv, f"the compressed {what}", device=str(device), changes=changes)

    return _Moved(pooled, env, source, seq_dim, tuple(env[source].shape), gen, Tc)


def probed_pooling(kv: fx.Node, what: str, block: int, stride: int, S: int, sizes: Sizes | None = None) -> Pooling:
    """kv's Pooling for the (l, d) the visibility mask shows, probed (`probe_pooling`, then
    `probe_windows_ending` for windows that end where NSA's do not: lucidrains' padding at the
    start) at each of `_unpooled_sources`, nearest first; the nearest's reason where all refuse.
    In a graph with symbolic sizes the probes have the shapes `sizes` gives (S is the number it
    gives the sequence)."""
    sizes = sizes or Sizes.of(kv.graph)
    first_reason = None
    for source, seq_dim in _unpooled_sources(kv, what, S, sizes):
        try:
            moved = _pooling_probe(kv, what, source, seq_dim, sizes)
            try:
                probe_pooling(moved, what, block, stride)
                return Pooling(source, seq_dim, block, stride)
            except Refused as fixed:
                if "outside its block" not in str(fixed):
                    raise
                try:
                    return probe_windows_ending(moved, what, block - 1, stride)
                except Refused:
                    raise fixed from None
        except Refused as why:
            first_reason = first_reason or why
    if first_reason is None:
        raise Refused(f"the compressed {what} read no [B, S, ..] sequence alone (not probed)")
    raise first_reason


def pooling_of(probs: Probabilities, kv: fx.Node, what: str, data: set, subgraphs: PositionSubgraphs,
               memory: int = 0) -> Pooling:
    """The pooling of kv: read from its code (`read_pooling`), or else probed for the (l, d) the
    visibility mask shows (`probed_pooling`; the mask's first `memory` columns are memory slots,
    not kv's); the reader's reason where both fail."""
    try:
        return read_pooling(kv, what, data)
    except Refused as why:
        try:
            block, stride = staircase_of(probs, subgraphs, memory)
            return probed_pooling(kv, what, block, stride, probs.shape[2], subgraphs.sizes)
        except Refused as probed:
            raise Refused(f"{why}; probed: {probed}") from None


def split_memory(kv: fx.Node, what: str, data: set) -> tuple[fx.Node, int]:
    """(pooled, M) for kv = torch.cat((mem, pooled), dim=2) [B, G, M + Tc, D] whose first operand
    reads no sequence data (learned memory slots: parameters, expanded over the batch); (kv, 0)
    for anything else. Refused for memory slots computed from the sequence. A float cast of that cat
    (autocast's `.to(bf16)` before the score product) is the cat of the casts: read through."""
    inner = first(kv) if op_name(kv) in ("to", "float", "half", "bfloat16") else None
    if (isinstance(inner, fx.Node) and op_name(inner) in ("cat", "concat", "concatenate")
            and value(kv) is not None and value(inner) is not None
            and value(kv).is_floating_point() and value(inner).is_floating_point()):
        kv = inner
    if op_name(kv) not in ("cat", "concat", "concatenate"):
        return kv, 0
    parts, dim = arg(kv, 0, "tensors"), arg(kv, 1, "dim", 0)
    out = value(kv)
    if (out is None or not isinstance(parts, (tuple, list)) or len(parts) != 2 or not isinstance(dim, int)
            or dim % out.dim() != 2 or not all(isinstance(x, fx.Node) and value(x) is not None for x in parts)):
        return kv, 0
    memory, pooled = parts
    if memory in data:
        raise Refused(f"the compressed {what} are cat((m, pooled)) with m computed from the sequence "
                      f"({memory.name}), not memory slots from parameters")
    M = value(memory).shape[2]
    if not isinstance(M, int):
        raise Refused(f"the compressed {what} have a symbolic number of memory slots")
    return pooled, M


# --- the compressed probabilities -------------------------------------------------------------


@dataclass
class Probabilities:
    """What `read_probabilities` found from one softmax (graph nodes and constants)."""

    softmax: fx.Node
    p: fx.Node  # the probabilities (after the final mask, or the softmax itself)
    q: fx.Node  # [B, H, S, Dk]
    k: fx.Node  # un-repeated pooled keys [B, G, Tc, Dk] (memory slots first, when the model has them)
    h: int
    scale: float
    masks: dict  # name -> (node, sense): the node is True where the fill / keep applies per sense
    shape: tuple  # B, H, S, Tc
    finite_fill: float | None = None  # the visibility mask's fill when finite (read as -inf), else None
    score_users: tuple = ()  # other users of the unmasked scores (they keep the [B, H, S, Tc] scores)


def probabilities_softmax(p: fx.Node) -> fx.Node | None:
    """The softmax behind probabilities p (p itself, or p = softmax * mask / masked by 0)."""
    if op_name(p) == "softmax":
        return p
    if name_of(p) == "mul":
        for operand in p.args[:2]:
            if isinstance(operand, fx.Node) and op_name(operand) == "softmax":
                return operand
    filled = fill_of(p, 0.0)
    if filled is not None and op_name(filled[0]) == "softmax":
        return filled[0]
    return None


def final_mask(softmax: fx.Node) -> tuple[fx.Node, tuple | None]:
    """(p, (mask, sense) or None): the softmax output times a mask, or masked to 0 after the softmax."""
    users = list(softmax.users)
    if len(users) != 1:
        return softmax, None
    user = users[0]
    if name_of(user) == "mul" and len(user.args) == 2 and not user.kwargs:
        a, b = user.args
        other = b if a is softmax else a
        if isinstance(other, fx.Node) and other is not softmax:
            return user, ("mul", other)
    filled = fill_of(user, 0.0)
    if filled is not None and filled[0] is softmax:
        return user, ("fill", filled[1], filled[2])
    return softmax, None


def unbatched(probs: torch.Tensor | None, dim) -> str | None:
    """The refusal for a softmax over the last dim of 3-D scores (no batch dim), or None for
    another shape: the attention passes read batched [B, H, S, ..] scores."""
    if probs is None or probs.dim() != 3 or not isinstance(dim, int) or dim % 3 != 2:
        return None
    shape = ", ".join(str(n) for n in probs.shape)
    return (f"3-D scores [{shape}] with no batch dim (packed [T, H, D] tokens, as in a varlen layout with "
            "cu_seqlens, or batch and heads merged): not batched [B, H, S, ..] scores")


def read_probabilities(softmax: fx.Node) -> Probabilities:
    """Read the compressed branch's probability chain ending at `softmax` (structure only; the
    masks are checked by `verify_probabilities`), or Refused."""
    probs = value(softmax)
    dim = arg(softmax, 1, "dim")
    if probs is not None and probs.dim() == 3 and isinstance(dim, int) and dim % 3 == 2:
        rank = 3  # packed [T, H, D] tokens: scores [H, T, N] (`verify_varlen`), read as [1, H, T, N]
    elif probs is None or probs.dim() != 4 or not isinstance(dim, int) or dim % 4 != 3:
        raise Refused(unbatched(probs, dim) or "not a softmax over the last dim of [B, H, S, Tc] scores")
    else:
        rank = 4
    if arg(softmax, 2, "dtype") is not None:
        raise Refused("the softmax has a dtype argument")
    B, H, S, Tc = probs.shape if rank == 4 else (1, *probs.shape)  # SymInts at symbolic sizes: `same` only
    masks = {}
    node = first(softmax)
    if not isinstance(node, fx.Node):
        raise Refused("the softmax input is not a tensor computed in the graph")
    zeroed, zeroed_node = fill_of(node, 0.0), None
    if zeroed is not None:
        masks["zero"] = zeroed[1:]
        only_user(node, "zeroed score tensor", "the dense tensor is needed")
        node, zeroed_node = zeroed[0], node
    up = None  # CUDA autocast: scores masked in fp16/bf16, then cast up to float32 for the softmax
    if (name_of(node) in ("float", "to") and value(node) is not None and value(first(node)) is not None
            and value(node).dtype == torch.float32 and value(first(node)).dtype in (torch.float16, torch.bfloat16)
            and (fill_of(first(node), float("-inf")) is not None or large_negative_fill_of(first(node)) is not None)):
        up, node = node, first(node)
    masked, finite_fill = fill_of(node, float("-inf")), None
    if masked is None and (large := large_negative_fill_of(node)) is not None:
        # a finite fill hides a key as -inf does on every row that keeps one (LARGE_NEGATIVE); the
        # rows that keep none must be zeroed and cleared as with -inf (`check_row_masks`), so the
        # fill never reaches the output
        *masked, finite_fill = large
        finite_fill = None if finite_fill == float("-inf") else finite_fill
    if masked is None:
        raise Refused(f"the softmax input is {op_name(node)}, not scores masked with -inf")
    scaled, mask, sense = masked
    if fill_of(scaled, 0.0) is not None:
        raise Refused("the rows without a visible block are zeroed before the -inf mask, which makes them "
                      "all -inf again (NaN in eager code)")
    masks["inf"] = (mask, sense)
    raw, scale = split_scale(scaled)
    qk = strip_upcast(raw)
    # the scores, masked or not, may have other users (lucidrains' block choice reads the masked
    # logits): they keep their [B, H, S, Tc] tensor, the op replaces the softmax and p @ v
    chain = list(dict.fromkeys(n for n in (qk, raw, scaled, node, up) if n is not None))
    score_users = tuple(u for n in chain for u in n.users if u not in chain and u is not zeroed_node
                        and u is not softmax)
    if op_name(qk) not in MATMULS:
        raise Refused("the scores are not q @ k^T")
    low, high = value(qk), value(scaled)
    if low is None or high is None:
        raise Refused("the score dtypes are unknown")
    if up is not None:  # scaled and masked in low precision, cast up after the mask
        if high.dtype != low.dtype or upcast_dtype(low.dtype) != torch.float32:
            raise Refused(f"the scores are {high.dtype} from {low.dtype} q @ k^T before the cast up to float32")
        if scale is not None and math.frexp(scale)[0] != 0.5:
            raise Refused(f"the scores are scaled by {scale:g} in {low.dtype} before the cast up to float32: eager "
                          "rounds s * c once more than the op (exact for a power of two only)")
    elif high.dtype != upcast_dtype(low.dtype):
        raise Refused(f"the softmax runs in {high.dtype} on {low.dtype} scores; the op computes it in "
                      f"{upcast_dtype(low.dtype)}")
    q, kt = qk.args[0], qk.args[1]
    swapped = (arg(kt, 1, "dim0"), arg(kt, 2, "dim1")) if isinstance(kt, fx.Node) else ()
    if (not swapped or op_name(kt) not in ("transpose", "swapaxes") or not all(isinstance(x, int) for x in swapped)
            or {x % rank for x in swapped} != {rank - 2, rank - 1}):
        raise Refused("the keys are not transposed over their last two dims (q @ k.transpose(-1, -2))")
    k, h = ungroup(first(kt)) if rank == 4 else unrepeat_heads(first(kt))
    qv, kv = value(q), value(k)
    if qv is None or kv is None or qv.dim() != rank or kv.dim() != rank:
        raise Refused("q and the compressed keys are not [B, heads, S or Tc, D]" if rank == 4 else
                      "q and the compressed keys of the 3-D scores are not [heads, T or N, D]")
    qs, ks = (tuple(qv.shape), tuple(kv.shape)) if rank == 4 else ((1, *qv.shape), (1, *kv.shape))
    if (not same(qs[:3], (B, H, S)) or not same(ks[0], B) or not same(ks[2], Tc)
            or not same(ks[1] * h, H)):
        raise Refused(f"q {tuple(qv.shape)} and the compressed keys {tuple(kv.shape)} (x{h}) do not make "
                      f"[B, H, S, Tc] = {(B, H, S, Tc)} scores")
    if same(Tc, 0):
        raise Refused("no compression block (S < l): nothing to attend to")
    p, final = final_mask(softmax)
    if final is not None:
        masks["final"] = final[1:] if final[0] == "fill" else (final[1], None)
    return Probabilities(softmax, p, q, k, h, scale, masks, (B, H, S, Tc), finite_fill, score_users)


@dataclass(frozen=True)
class Visibility:
    """What `verify_probabilities` proved: the masks are NSA's for compression blocks of `block`
    tokens at stride `stride` (d); `pos` is the [B, S] position node in the packed form (the keys
    then hold a slot per token, pooled at stride 1), None otherwise. lucidrains' variants (never
    with pos): `delay` 1 for strict visibility (block i seen one token after its last), `memory` M
    learned slots before the blocks, visible to every query, `end` e when block i ends at i*d + e,
    not i*d + l - 1 (windows padded at the start, `probe_windows_ending`)."""

    block: int
    stride: int
    pos: fx.Node | None
    memory: int = 0
    delay: int = 0
    q_offset: int = 0  # the token of query row 0: a chunk of queries (`query_rows`)
    end: int | None = None  # block i's last token is i*d + end (None: i*d + l - 1)

    @property
    def intercept(self) -> int:
        """The op's `block` argument: its staircase i*d + block - 1 <= t over all the columns,
        memory slots first (nsa_compile/ops/compressed.py)."""
        last = self.block - 1 if self.end is None else self.end
        return last + 1 + self.delay - self.memory * self.stride

    def describe(self) -> str:
        """The variant for the match text ('' for NSA's)."""
        seen = "l" if self.end is None else str(self.end + 1)  # one token after the last
        notes = ([f"windows ending at i*d + {self.end}"] if self.end is not None else []) + (
            [f"strict visibility (block i seen from t = i*d + {seen})"] if self.delay else []) + (
            [f"{self.memory} memory slot{'s' if self.memory > 1 else ''} seen by every query"] if self.memory
            else []) + (
            [f"query rows from token {self.q_offset}"] if self.q_offset else [])
        return "".join(f", {n}" for n in notes)


def verify_probabilities(probs: Probabilities, pooling: Pooling, subgraphs: PositionSubgraphs,
                         memory: int = 0, q_offset: int = 0) -> Visibility:
    """Refused unless the masks of `probs` are exactly NSA's for the pooling's (l, d), or in the
    packed form NSA's packed visibility (on the probes) for l and the d the mask shows. Also read:
    strict visibility (a block seen one token after its last) and `memory` slots before the blocks
    (the first columns), which must be visible to every query; both as one staircase over all the
    columns, the op's (`Visibility.intercept`)."""
    B, _, S, Tc = probs.shape
    l, d = pooling.block, pooling.stride
    roots = [mask for mask, _ in probs.masks.values()]
    pos = positions_input(roots, B, S, subgraphs.shape)
    if pos is not None and subgraphs.sizes is not None and subgraphs.sizes.symbolic:
        raise Refused(f"the masks read positions within documents ({pos.name}) in a graph with symbolic sizes: "
                      "packed documents are verified at static sizes only (OptimizeConfig(dynamic=False))")
    if pos is not None and q_offset:
        raise Refused(f"the masks read positions within documents ({pos.name}) for a chunk of queries (rows from "
                      f"token {q_offset}): packed documents are matched over the whole sequence only")
    if pos is not None and memory:
        raise Refused(f"the masks read positions within documents ({pos.name}) and the keys hold {memory} memory "
                      "slots: memory slots are read without packed documents only")
    if pos is not None:
        return verify_packed(probs, pooling, subgraphs, pos)
    mask, sense = probs.masks["inf"]
    filled = subgraphs.evaluate(mask, "visibility mask")
    if filled.dtype != torch.bool:
        raise Refused(f"the visibility mask is {filled.dtype}, not bool")
    keep = as_grid(filled if not sense else ~filled, S, Tc, "visibility mask")
    if memory:
        hidden = (~keep[:, :memory]).nonzero()
        if len(hidden):
            t, j = (int(x) for x in hidden[0])
            raise Refused(f"memory slot {j} (of the {memory} before the pooled blocks: cat((mem, pooled))) is hidden "
                          f"from query {t}: memory slots must be visible to every query")
    delay = visibility_delay(keep[:, memory:], pooling.last + 1, d, q_offset)
    seen = Visibility(l, d, None, memory, delay, q_offset, pooling.end)
    visible = staircase(S, Tc, seen.intercept, d, keep.device, q_offset)
    if not torch.equal(keep, visible):
        raise Refused(f"the {memory} memory slots before blocks of l={l} tokens at stride d={d}"
                      f"{' seen strictly after their last token' if delay else ''} are not one staircase over "
                      f"all the columns, the op's (it needs {'l <= d' if delay else 'l - 1 <= d'})")
    if probs.finite_fill is not None and "zero" not in probs.masks and not bool(visible.any(-1).all()):
        raise Refused(f"the visibility mask fills {probs.finite_fill:g}, not -inf, and rows without a visible block "
                      "are not zeroed: eager gives them the uniform average of the blocks, the op 0")

    def grid(node: fx.Node, what: str) -> torch.Tensor:
        return as_grid(subgraphs.evaluate(node, what), S, Tc, what)[None]

    check_row_masks(probs, grid, visible[None], f"rows without a visible block (t < {seen.intercept - 1})")
    return seen


def visibility_delay(keep: torch.Tensor, block: int, stride: int, q_offset: int = 0) -> int:
    """0 when keep [S, Tc] is NSA's staircase i*d + l - 1 <= t for (l, d) = (block, stride), 1 when
    it is the strict one i*d + l - 1 < t (lucidrains: block i seen after its last token); Refused
    (with `staircase_reason`) for anything else."""
    S, Tc = keep.shape
    for delay in (0, 1):
        if torch.equal(keep, staircase(S, Tc, block + delay, stride, keep.device, q_offset)):
            return delay
    why = staircase_reason(keep, block, stride, q_offset)
    if "becomes visible at" in why:  # later than its last token
        why += "; the op takes a block from its last token (i*d + l - 1 <= t) or strictly after it (< t)"
    raise Refused(why)


def check_row_masks(probs: Probabilities, grid, visible: torch.Tensor, empty_rows: str, on: str = "") -> None:
    """Refused unless the has_block zeroing hits exactly the rows without a visible block and the
    final mask keeps every visible block and clears those rows (`row_mask_failures`)."""
    failures = row_mask_failures(probs, grid, visible, empty_rows, on)
    if failures:
        raise Refused(failures[min(failures)])


def row_mask_failures(probs: Probabilities, grid, visible: torch.Tensor, empty_rows: str, on: str = "") -> dict:
    """How the has_block zeroing and the final mask fail on these rows: {rank: reason}, the lowest
    rank the reason to give (the rows may be a chunk: merged over the chunks, the lowest rank is
    the reason the whole would give). visible [B or 1, rows, Tc]; grid(node, what) evaluates a
    mask node as [B or 1, rows, Tc]; `empty_rows` names the rows without a visible block, `on`
    the probe (appended to the reasons)."""
    failures = {}
    empty = ~visible.any(-1)  # [B or 1, rows]: rows without a visible block
    has_empty = bool(empty.any())
    if "zero" not in probs.masks:
        if has_empty:
            failures[0] = (f"the {empty_rows} are not zeroed before the softmax (scores.masked_fill(~has_block, "
                           f"0.0)): eager gives NaN there, the op 0{on}")
    else:
        mask, sense = probs.masks["zero"]
        zero = grid(mask, "has_block mask")
        if zero.dtype != torch.bool:
            failures[1] = f"the has_block mask is {zero.dtype}, not bool"
        else:
            # rows the zeroing touches (reduced first: zero is often a broadcast [.., S, 1] column)
            zeroed = zero.any(-1) if sense else ~zero.all(-1)  # [B or 1, rows]
            if bool((zeroed & ~empty).any()):
                failures[2] = ("the zeroing before the softmax also hits rows that see a block (it must hit exactly "
                               f"the rows without one){on}")
            if bool((empty & ~zeroed).any()):
                failures[3] = (f"the zeroing before the softmax misses rows without a visible block (eager gives NaN "
                               f"there){on}")
    if "final" not in probs.masks:
        if has_empty:
            failures[4] = ("the probabilities are not multiplied by the visibility mask after the softmax: rows "
                           f"without a visible block get 1/Tc each in eager code, 0 from the op{on}")
        return failures
    mask, sense = probs.masks["final"]
    kept = grid(mask, "mask after the softmax")
    if kept.dtype == torch.bool and sense is not True and torch.equal(kept, visible):
        return failures  # the visibility mask itself (the usual case): it keeps what it must, and only that
    if sense is None:  # p = softmax * mask: a bool mask, or a float one of zeros and ones
        if kept.is_floating_point() and bool(((kept == 0) | (kept == 1)).all()):
            kept = kept == 1
        elif kept.dtype != torch.bool:
            failures[5] = "the probabilities are multiplied by something other than a 0/1 mask after the softmax"
            return failures
    elif kept.dtype != torch.bool:
        failures[5] = f"the mask after the softmax is {kept.dtype}, not bool"
        return failures
    else:
        kept = ~kept if sense else kept
    if bool((visible & ~kept).any()):
        failures[6] = f"the mask after the softmax clears visible blocks{on}"
    if bool((kept.any(-1) & empty).any()):
        failures[7] = ("the mask after the softmax keeps rows without a visible block (eager gives them 1/Tc each, "
                       f"the op 0){on}")
    return failures


# --- packed documents: positions, probes, the packed visibility ---------------------------------


def positions_input(roots: list[fx.Node], B: int, S: int, shape=lambda val: tuple(val.shape)) -> fx.Node | None:
    """The int64 [B, S] node through which alone the masks read data (the positions of packed
    documents: the nearest such node on every path to a graph input), or None where they read no
    int64 [B, S] tensor (the unpacked form; other data is refused by the evaluation). Refused if
    they read an int64 [B, S] tensor and other data besides. `shape` gives a fake tensor's sizes as
    numbers (those of B and S, under symbolic sizes)."""
    def inputs(nodes) -> list[fx.Node]:  # the graph inputs among nodes, parameters and sizes aside
        return [n for n in nodes if n.op not in ("call_function", "call_method")
                and not isinstance(n.meta.get("example_value", n.meta.get("val")), (torch.nn.Parameter, torch.SymInt))]

    # an int64 [B, S] tensor computed from positions only (an arange when B = 1) is no input
    candidates = [n for n in ancestors(roots) if (val := value(n)) is not None and val.dtype == torch.int64
                  and shape(val) == (B, S) and inputs(ancestors([n]))]
    if not candidates:
        return None
    order = {node: i for i, node in enumerate(roots[0].graph.nodes)}
    outside = None
    for pos in sorted(candidates, key=order.__getitem__, reverse=True):
        data = [n for n in inputs(ancestors(roots, stop=pos)) if n is not pos]
        if not data:
            return pos
        outside = outside or min(data, key=order.__getitem__)
    raise Refused(f"the visibility masks read {outside.op} {outside.name} besides the positions (data other than "
                  "one int64 [B, S] tensor of positions within documents)")


def documents(B: int, S: int, lengths) -> torch.Tensor:
    """Positions [B, S] of documents whose lengths row b takes from the cycle `lengths(b)` (the
    last document cut at S)."""
    rows = []
    for b in range(B):
        cycle = [n for n in lengths(b) if n >= 1] or [S]
        pos, at, i = torch.empty(S, dtype=torch.int64, device="cpu"), 0, 0
        while at < S:
            n = min(cycle[i % len(cycle)], S - at)
            pos[at : at + n] = torch.arange(n, device="cpu")
            at, i = at + n, i + 1
        rows.append(pos)
    return torch.stack(rows)


def position_probes(B: int, S: int, block: int, stride: int, device) -> list[tuple[str, torch.Tensor]]:
    """(name, pos [B, S] int64) probes: valid positions within documents, each batch row packed
    differently (the cycles of lengths are rotated by the row; the random ones drawn per row)."""
    l, d = block, stride

    def rotated(cycle):
        return lambda b: cycle[b % len(cycle):] + cycle[: b % len(cycle)]

    gen = torch.Generator().manual_seed(0)
    short = torch.randint(1, 2 * l + 2, (B, S), generator=gen, device="cpu").tolist()
    mixed = torch.randint(1, 4 * l + 2 * d, (B, S), generator=gen, device="cpu").tolist()
    probes = [
        ("one document", documents(B, S, lambda b: [S])),
        ("short documents", documents(B, S, rotated([1, 2, l - 1, l, l + 1, d + 1, 3, 2 * l + 3, l + d - 1]))),
        ("documents on block boundaries", documents(B, S, rotated([d, l, 2 * d, l + d, 3 * l, 2 * l]))),
        ("documents just off block boundaries", documents(B, S, rotated([d + 1, l - 1, l + 1, 2 * l - 1, d - 1,
                                                                          2 * l + 1, 3 * d + 2]))),
        ("two documents", documents(B, S, lambda b: [S // 2 + b % 3 + 1, S])),
        ("random short documents", documents(B, S, lambda b: short[b])),
        ("random documents", documents(B, S, lambda b: mixed[b])),
        ("a document per token", documents(B, S, lambda b: [1])),
    ]
    return [(name, pos.to(device)) for name, pos in probes]


def packed_visibility(pos: torch.Tensor, Tc: int, block: int, stride: int, r0: int = 0,
                      r1: int | None = None) -> torch.Tensor:
    """[B, r1 - r0, Tc] bool (all S rows by default): NSA's packed visibility (models/nsa.py) for
    the queries r0..r1: slot s, the block of `block` tokens from token s, is visible to query t
    iff it lies in t's past, starts in t's document, starts at a multiple of `stride` within its
    document and lies in that document."""
    S = pos.shape[1]
    r1 = S if r1 is None else r1
    t = torch.arange(r0, r1, device=pos.device)[:, None]
    s = torch.arange(Tc, device=pos.device)[None, :]
    start = pos[:, :Tc]
    in_one_document = pos[:, block - 1 : block - 1 + Tc] == start + block - 1
    is_block = (start % stride == 0) & in_one_document  # [B, Tc]
    return (s + block - 1 <= t) & (s >= t - pos[:, r0:r1, None]) & is_block[:, None, :]


def grid_shape(shape: tuple, B: int, rows: int, cols: int, what: str) -> tuple:
    """A mask's shape as [B or 1, 1, rows or 1, cols or 1] (it broadcasts against the [B, H, S, Tc]
    scores), or Refused where it differs between heads or does not broadcast to [B, S, Tc]."""
    if len(shape) > 4:
        raise Refused(f"the {what} is {shape}: more dims than the [B, H, S, Tc] scores")
    full = (1,) * (4 - len(shape)) + tuple(shape)
    if full[1] != 1:
        raise Refused(f"the {what} is {shape}: not one [S, Tc] pattern for all heads")
    if any(n not in (1, want) for n, want in zip(full[::2] + full[3:], (B, rows, cols))):
        raise Refused(f"the {what} {shape} does not broadcast to [B, S, Tc] = {(B, rows, cols)}")
    return full


def batched_grid(mask: torch.Tensor, B: int, rows: int, cols: int, what: str) -> torch.Tensor:
    """A mask of the [B, H, S, Tc] scores as [B, rows, cols]: one pattern for all heads (it may
    differ per batch row)."""
    full = grid_shape(tuple(mask.shape), B, rows, cols, what)
    return torch.broadcast_to(mask.reshape(full)[:, 0], (B, rows, cols))


def packed_reason(keep: torch.Tensor, want: torch.Tensor, pos: torch.Tensor, block: int, stride: int,
                  probe: str, r0: int = 0) -> str:
    """Why the -inf mask `keep` [B, rows, Tc] (the queries from r0 on) is not the packed visibility
    `want` on the probe `pos`: the first query that sees a slot it must not (and which term that
    breaks), or hides one."""
    l, d = block, stride
    head = (f"the visibility mask is not the packed one for (l={l}, d={d}) on probe positions '{probe}' "
            f"(documents: {pos_summary(pos)})")
    extra = keep & ~want
    if bool(extra.any()):
        b, row, s = (int(x) for x in extra.nonzero()[0])
        t = r0 + row
        start, slot_pos = t - int(pos[b, t]), int(pos[b, s])
        if s + l - 1 > t:
            why = f"its last token {s + l - 1} comes after t (a later token leaks in)"
        elif int(pos[b, s + l - 1]) != slot_pos + l - 1:
            why = "its l tokens cross a document boundary"
        elif s < start:
            why = f"it lies in an earlier document (t's document starts at token {start})"
        else:
            why = (f"it starts at position {slot_pos} of its document, not a multiple of d = {d} (blocks counted "
                   "from the row start, not the document start?)")
        return f"{head}: query t={t} of batch row {b} sees slot s={s}, but {why}"
    b, row, s = (int(x) for x in (want & ~keep).nonzero()[0])
    return (f"{head}: query t={r0 + row} of batch row {b} hides slot s={s}, a block of its own document (position "
            f"{int(pos[b, s])}) that lies in its past")


def pos_summary(pos: torch.Tensor) -> str:
    """The document lengths of batch row 0 of a probe, shortened."""
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    return ", ".join(map(str, lengths[:8])) + (", ..." if len(lengths) > 8 else "")


def stride_from_one_document(keep: torch.Tensor, block: int) -> int:
    """d, read from the -inf mask on one document per row ([B, rows, Tc] on pos = 0..S-1, the last
    row the last query's): the last query sees slots 0, d, 2d, ...; with one slot only (S - l < d),
    S - l + 1 (= Tc), since every d > S - l gives the same mask."""
    Tc = keep.shape[-1]
    slots = keep[0, -1].nonzero().flatten().tolist()
    if not slots or slots[0] != 0:
        raise Refused(f"on one document (pos = 0..S-1) the last query does not see slot 0, the document's first "
                      f"block (it sees slots {slots[:6]}{'...' * (len(slots) > 6)}): not the packed visibility mask")
    d = slots[1] - slots[0] if len(slots) > 1 else Tc
    if slots != list(range(0, slots[-1] + 1, d)):
        raise Refused(f"on one document (pos = 0..S-1) the last query sees slots {slots[:6]}{'...' * (len(slots) > 6)}"
                      ": not every d-th slot from the document start")
    return d


# The verdicts of packed masks, per graph: (their structure, l, device) -> d, or the refusal. The
# layers of a model share one check, and so do this pass and select_blocks (which verifies the
# compressed masks it reads again).
_PACKED_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def verify_packed(probs: Probabilities, pooling: Pooling, subgraphs: PositionSubgraphs, pos: fx.Node) -> Visibility:
    """Refused unless the masks, evaluated on probe positions for `pos`, are NSA's packed ones for
    the pooling's l and the d the mask shows on one document (see the module docstring)."""
    B, _, S, Tc = probs.shape
    l = pooling.block
    if pooling.stride != 1:
        raise Refused(f"the masks read positions within documents ({pos.name}), but the keys are pooled at stride "
                      f"{pooling.stride}: the packed form pools a slot at every token (x.unfold(1, l, 1))")
    if Tc != S - l + 1:
        raise Refused(f"the packed keys hold {Tc} slots, not one per token (S - l + 1 = {S - l + 1})")
    if B * S * Tc > MAX_VERIFIED_PACKED:
        raise Refused(f"B * S * Tc = {B * S * Tc:,} mask elements per probe, over the cap of {MAX_VERIFIED_PACKED:,}: "
                      "the packed masks are not verified at this size yet")
    fake = {pos: value(pos)}
    structure = [(name, sense, subgraphs.plan(mask, MASK_NAMES[name], fake)[1])
                 for name, (mask, sense) in probs.masks.items()]
    key = (repr(structure), l, str(value(pos).device))
    verdicts = _PACKED_VERDICTS.setdefault(probs.softmax.graph, {})

    def check() -> int:
        one = torch.arange(S, device=value(pos).device).expand(B, S)
        last_row = packed_rows(probs, subgraphs, pos, "one document", one)(S - 1, S)
        d = stride_from_one_document(kept_slots(probs, last_row, Tc), l)
        verify_packed_probabilities(probs, l, d, pos, subgraphs)
        return d

    from nsa_compile import probe  # the verdict cache
    return Visibility(l, probe.remembered(verdicts, key, check), pos)


MASK_NAMES = {"inf": "visibility mask", "zero": "has_block mask", "final": "mask after the softmax"}


def packed_rows(probs: Probabilities, subgraphs: PositionSubgraphs, pos: fx.Node, probe: str,
                positions: torch.Tensor):
    """(r0, r1) -> {mask node: its rows r0..r1 as [B, r1 - r0, Tc]} for the masks of `probs`, with
    `positions` [B, S] in place of pos: evaluated in row chunks (nsa_compile/mask_rows.py, O(rows
    * Tc) memory). Masks with a node that is not row-local (a transpose, a reduction over the
    rows) are evaluated whole instead, up to MAX_VERIFIED_ELEMENTS."""
    B, _, S, Tc = probs.shape
    masks = {mask: MASK_NAMES[name] for name, (mask, _) in probs.masks.items()}
    for mask, what in masks.items():
        if value(mask) is None:
            raise Refused(f"the {what} {mask.name} has no traced value (cannot verify it)")
        grid_shape(subgraphs.shape(value(mask)), B, S, Tc, what)
    try:
        chunks = RowChunks(list(masks), S, Tc, (pos, positions), subgraphs.sizes, "visibility mask", "[S, Tc]")
    except Refused as why:
        for mask, what in masks.items():
            cost = subgraphs.cost(subgraphs.plan(mask, what, {pos: positions}, probe)[0], {pos: positions})
            if cost > MAX_VERIFIED_ELEMENTS:
                raise Refused(f"{why}, and evaluating the {what} whole takes {cost:,} elements, over the cap of "
                              f"{MAX_VERIFIED_ELEMENTS:,}: not verified at this size") from None
        whole = {mask: batched_grid(subgraphs.evaluate(mask, what, {pos: positions}, probe), B, S, Tc, what)
                 for mask, what in masks.items()}
        return lambda r0, r1: {mask: grid[:, r0:r1] for mask, grid in whole.items()}
    return lambda r0, r1: dict(zip(masks, chunks(r0, r1)))


def kept_slots(probs: Probabilities, rows: dict, Tc: int) -> torch.Tensor:
    """The slots the -inf mask keeps, [B, rows, Tc] bool, from the masks' rows (`packed_rows`)."""
    mask, sense = probs.masks["inf"]
    filled = rows[mask]
    if filled.dtype != torch.bool:
        raise Refused(f"the visibility mask is {filled.dtype}, not bool")
    return (~filled if sense else filled).expand(*filled.shape[:-1], Tc)


def verify_packed_probabilities(probs: Probabilities, block: int, stride: int, pos: fx.Node,
                                subgraphs: PositionSubgraphs) -> None:
    """Refused unless the three masks of `probs`, evaluated with each probe of `position_probes` in
    place of the positions node `pos`, are NSA's packed visibility for (block, stride) with its
    zeroing and final mask (a check on probes; the module docstring lists them), every element,
    CHUNK_ELEMENTS at a time. The reasons are those the whole [B, S, Tc] masks would give."""
    B, _, S, Tc = probs.shape
    l, d = block, stride
    empty_rows = f"rows without a visible slot (documents shorter than l = {l}, the first {l - 1} tokens of each)"
    step = max(1, CHUNK_ELEMENTS // (B * Tc))
    for probe, positions in subgraphs.probes(B, S, l, d, value(pos).device):
        rows_of = packed_rows(probs, subgraphs, pos, probe, positions)
        failures = {}
        for r0 in range(0, S, step):
            r1 = min(S, r0 + step)
            rows = rows_of(r0, r1)
            keep = kept_slots(probs, rows, Tc)
            if not torch.equal(keep, packed_visibility(positions, Tc, l, d, r0, r1)):
                raise Refused(packed_difference(probs, rows_of, positions, l, d, probe, r0, step))
            found = row_mask_failures(probs, lambda node, what, rows=rows: rows[node], keep, empty_rows,
                                      f" (on probe positions '{probe}')")
            failures = {**found, **failures}  # the first chunk's reason of each rank
        if failures:
            raise Refused(failures[min(failures)])


def packed_difference(probs: Probabilities, rows_of, positions: torch.Tensor, block: int, stride: int, probe: str,
                      r0: int, step: int) -> str:
    """`packed_reason` for the whole probe, read in row chunks from r0 (the first chunk whose -inf
    mask differs from the packed visibility): the first query, batch row first, that sees a slot
    it must not, else the first that hides one, as the whole [B, S, Tc] comparison names it."""
    B, _, S, Tc = probs.shape
    first = {}  # "sees" / "hides" -> (b, t): the first such query, batch row first
    for start in range(r0, S, step):
        end = min(S, start + step)
        keep = kept_slots(probs, rows_of(start, end), Tc)
        want = packed_visibility(positions, Tc, block, stride, start, end)
        for kind, wrong in (("sees", keep & ~want), ("hides", want & ~keep)):
            rows = wrong.any(-1)  # [B, end - start]
            for b in rows.any(-1).nonzero().flatten().tolist():
                found = (b, start + int(rows[b].nonzero()[0]))
                first[kind] = min(first.get(kind, found), found)
    _, t = first.get("sees", first.get("hides"))
    keep = kept_slots(probs, rows_of(t, t + 1), Tc)
    return packed_reason(keep, packed_visibility(positions, Tc, block, stride, t, t + 1), positions, block, stride,
                         probe, t)


def verify_branch(probs: Probabilities, v: fx.Node | None, data: set, subgraphs: PositionSubgraphs) -> Visibility:
    """The poolings of K (and of V, when given) and the masks of `probs` verified under the
    assignment of sizes `subgraphs` evaluates at (`probs` with numbers for its shape)."""
    S = probs.shape[2]
    k, memory = split_memory(probs.k, "keys", data)
    pooling = pooling_of(probs, k, "keys", data, subgraphs, memory)
    pools = [(pooling, "keys")]
    if v is not None:
        v, v_memory = split_memory(v, "values", data)
        if v_memory != memory:
            raise Refused(f"the compressed keys have {memory} memory slots, the values {v_memory}")
        v_pooling = pooling_of(probs, v, "values", data, subgraphs, memory)
        if (pooling.block, pooling.stride, pooling.last) != (v_pooling.block, v_pooling.stride, v_pooling.last):
            raise Refused(f"K and V are pooled with different blocks: (l, d, last token) = "
                          f"{(pooling.block, pooling.stride, pooling.last)} and "
                          f"{(v_pooling.block, v_pooling.stride, v_pooling.last)}")
        pools.append((v_pooling, "values"))
    q_offset, rows_of = query_rows(probs.q, subgraphs.shape)
    for pool, what in pools:
        length = subgraphs.shape(value(pool.source))[pool.seq_dim]
        if length != S and length != rows_of:
            of = f" (rows {q_offset}..{q_offset + S - 1} of {rows_of})" if rows_of is not None else ""
            raise Refused(f"the {what} are pooled from a sequence of {length} tokens, not the {S} queries{of}")
    if probs.shape[3] == 0:
        raise Refused(f"no compression block at S = {S} (S < l): nothing to attend to")
    return verify_probabilities(probs, pooling, subgraphs, memory, q_offset)


def sequence_cut(q: fx.Node, dim: int = 2):
    """(full, start): q is a basic slice of full's dim `dim` with every other dim whole
    (`q_full[:, :, a:b]`, `q_full[..., a:b, :]`, `q_full.narrow(2, a, n)`), start as written (an
    int, or a node of the graph); None for any other q. The rows it keeps are q's own."""
    if op_name(q) not in ("getitem", "narrow") or not isinstance(first(q), fx.Node) or value(first(q)) is None:
        return None
    full = first(q)
    rank = value(full).dim()
    if op_name(q) == "narrow":
        at = arg(q, 1, "dim")
        return (full, arg(q, 2, "start")) if isinstance(at, int) and at % rank == dim else None
    index = arg(q, 1, "index")
    if not isinstance(index, tuple):
        return None
    whole = slice(None, None, None)
    if index.count(Ellipsis) == 1:
        at = index.index(Ellipsis)
        index = index[:at] + (whole,) * (rank + 1 - len(index)) + index[at + 1:]
    index = index + (whole,) * (rank - len(index))
    if len(index) != rank or rank <= dim:
        return None
    cut = index[dim]
    if not (isinstance(cut, slice) and cut.step in (None, 1) and all(s == whole for s in index[:dim] + index[dim + 1:])):
        return None
    return full, 0 if cut.start is None else cut.start


def query_rows(q: fx.Node, shape=lambda val: tuple(val.shape)) -> tuple[int, int | None]:
    """(q_offset, L): q [B, H, S, D] is the rows [q_offset, q_offset + S) of a sequence of L queries,
    cut by a constant slice of the sequence dim (`q_full[:, :, a:b]`, `q_full[..., a:b, :]`,
    `q_full.narrow(2, a, S)`): a chunk of a model that loops over query chunks (issue 17); (0, None)
    for any other q. Only where the rows start is read here: the masks are then evaluated with row
    r at token q_offset + r (`verify_probabilities`), and a mask that is not the op's at that
    offset is refused. `shape`: a fake tensor's sizes as numbers (at probe sizes). A float cast of the
    chunk (CUDA autocast's `.to(bf16)` before the product) is read through: it keeps the rows."""
    if (op_name(q) in ("to", "float", "half", "bfloat16") and isinstance(first(q), fx.Node)
            and value(q) is not None and value(first(q)) is not None and value(q).is_floating_point()
            and value(first(q)).is_floating_point() and same(tuple(value(q).shape), tuple(value(first(q)).shape))):
        q = first(q)
    cut = sequence_cut(q)
    if cut is None or value(cut[0]).dim() != 4 or value(q) is None or value(q).dim() != 4:
        return 0, None
    full, start = value(cut[0]), cut[1]
    if not isinstance(start, int) or isinstance(start, bool):  # a symbolic start is not read
        return 0, None
    length = shape(full)[2]
    if not isinstance(length, int):  # a size symbol: not read as a chunk (no guard on it)
        return 0, None
    start = start + length if start < 0 else start
    return (start, length) if 0 <= start <= length else (0, None)


def at_sizes(probs: Probabilities, sizes: Sizes) -> Probabilities:
    """`probs` with its shape [B, H, S, Tc] as the numbers `sizes` gives it."""
    return probs if not sizes.symbolic else dataclasses.replace(probs, shape=sizes.shape(probs.shape))


def verify_at_probe_sizes(probs: Probabilities, v: fx.Node | None, data: set,
                          subgraphs: PositionSubgraphs) -> Visibility:
    """`verify_branch` once per probe assignment of the graph's sizes (`Sizes.probes`: the sizes
    Dynamo saw, then every symbol +1 and +19; just the one for a static graph): the pooling's and
    the masks' (l, d) must be the same at each, else Refused naming the sizes."""
    sizes = subgraphs.sizes if subgraphs.sizes is not None else Sizes.of(probs.softmax.graph)
    found = {}
    for probe in sizes.probes():
        at = at_sizes(probs, probe)
        try:
            found[probe.describe()] = verify_branch(at, v, data, subgraphs.at(probe))
        except Refused as why:
            if not probe.symbolic:
                raise
            raise Refused(f"at the probe sizes {probe.describe()} (S = {at.shape[2]}): {why}") from None
    verdicts = set(found.values())
    if len(verdicts) > 1:
        raise Refused("the compressed branch is not the same at every size: " + "; ".join(
            f"(l, d) = ({seen.block}, {seen.stride}){seen.describe()} at {where}" for where, seen in found.items()))
    return verdicts.pop()


def output_product(probs: Probabilities) -> tuple[fx.Node, fx.Node | None, fx.Node]:
    """(p @ v matmul, the cast of p or None, v_rep) among the users of p, or Refused."""
    B, H, _, Tc = probs.shape
    found = []
    candidates = []  # (cast or None, user): p's users, and the users of a cast of p (it may feed others too)
    for user in probs.p.users:
        if op_name(user) in ("to", "type_as"):
            candidates += [(user, mm) for mm in user.users]
        else:
            candidates.append((None, user))
    rank = value(probs.softmax).dim()  # 3: packed [T, H, D] tokens, no batch dim
    for cast, mm in candidates:
        if op_name(mm) not in MATMULS or mm.args[0] is not (cast or probs.p) or not isinstance(mm.args[1], fx.Node):
            continue
        v_rep = value(mm.args[1])
        if v_rep is not None and v_rep.dim() == rank and same(v_rep.shape[:rank - 1], (B, H, Tc)[4 - rank:]):
            found.append((mm, cast, mm.args[1]))
    if len(found) != 1:
        raise Refused("the probabilities are not multiplied by V (p @ v)" if not found else
                      f"the probabilities are multiplied by {len(found)} V tensors")
    return found[0]


# --- packed [T, H, D] tokens (varlen): 3-D scores over per-document compressed keys ------------

# Aliasing views: an in-place write into one of them writes into the tensor it views.
_ALIASES = _VIEWS | {"narrow", "select", "detach", "diagonal", "view_as", "contiguous"}
# Calls that write into their first operand (`x[i] = y`, `x += y`; methods ending in `_`).
_WRITES = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.iand,
           operator.ior, operator.ixor}
# Tokens perturbed together in the pooling probe (`varlen_windows`) are this far apart (the whole
# sequence when it is shorter): a pooled key's window must be at most half of it.
VARLEN_PROBE_PERIOD = 128
# Runs of the pooling region per memory layout of the probe tokens (`token_layout`).
LAYOUT_TRIALS = 3


def writes_into(node: fx.Node, before: int, order: dict) -> list[fx.Node]:
    """The in-place writes into node's memory that run before graph position `before`: calls
    that write into node, and those that write into a view of it (with the views)."""
    found = []
    for user in node.users:
        if order[user] >= before:
            continue
        name = op_name(user) or ""
        if ((user.op == "call_function" and user.target in _WRITES) or
                (name.endswith("_") and not name.startswith("_"))) and first(user) is node:
            found.append(user)
        elif name in _ALIASES and first(user) is node and (inner := writes_into(user, before, order)):
            found += [user, *inner]
    return found


def concrete(shape, what: str = "packed [T, H, D] tokens") -> tuple[int, ...]:
    """A shape as ints: SymInts a guard fixed to one number (Dynamo's graph after a length change
    of a model whose documents are constants) as that number; Refused for a symbolic size (the
    varlen checks run at static sizes only)."""
    dims = []
    for n in shape:
        if isinstance(n, torch.SymInt):
            if not n.node.expr.is_number:
                raise Refused(f"{what} at symbolic sizes ({n}): verified at static sizes only")
            n = int(n.node.expr)
        dims.append(int(n))
    return tuple(dims)


def written_region(roots: list[fx.Node], what: str, leaves=(), before: int | None = None) -> list[fx.Node]:
    """The nodes that compute `roots` from `leaves` and positions, in graph order: what they read,
    and every in-place write into those (or into a view of them) before graph position `before`
    (default: the last root's), again with what those read. Refused where they read data (a graph
    input or attribute that is no leaf) or random numbers."""
    order = {n: i for i, n in enumerate(roots[0].graph.nodes)}
    before = max(order[r] for r in roots) if before is None else before
    nodes, stack, data = set(), list(roots), []
    while stack:
        node = stack.pop()
        if node in nodes or node in leaves:
            continue
        nodes.add(node)
        if node.op not in ("call_function", "call_method"):
            data.append(node)
            continue
        name = op_name(node) or ""
        if any(word in name for word in _RANDOM):
            raise Refused(f"the {what} uses {name} (random, not positions)")
        stack += node.all_input_nodes + writes_into(node, before, order)
    if data:  # named by the first graph input it reads (the model's input before its buffers)
        first_input = min(data, key=order.__getitem__)
        raise Refused(f"the {what} depends on {first_input.op} {first_input.name} (data, not positions)")
    return sorted(nodes, key=order.__getitem__)


def run_written(nodes: list[fx.Node], what: str, inputs: dict | None = None) -> dict:
    """The values of `nodes` (`written_region`'s, in graph order: the writes run where the graph
    runs them) from `inputs` (leaf node -> tensor); Refused at symbolic sizes or over
    MAX_VERIFIED_ELEMENTS materialized."""
    cost = sum(math.prod(concrete(value(n).shape, f"the {what}")) for n in nodes
               if isinstance(value(n), torch.Tensor) and op_name(n) not in _VIEWS)
    if cost > MAX_VERIFIED_ELEMENTS:
        raise Refused(f"verifying the {what} takes {cost:,} elements, over the cap of {MAX_VERIFIED_ELEMENTS:,}")
    env = dict(inputs or {})
    for node in nodes:
        env[node] = evaluate_node(node, env, f"the {what}")
    return env


def evaluate_written(root: fx.Node, what: str) -> torch.Tensor:
    """root's value at compile time where its subgraph reads positions only, in-place writes
    included (xunhaolai's masks are zeros filled by `mask[a:b, c:d] = ...` per document, which a
    walk over root's inputs alone would not see; `written_region`)."""
    value_of = run_written(written_region([root], what), what)[root]
    if not isinstance(value_of, torch.Tensor):
        raise Refused(f"the {what} is not a tensor")
    return value_of


def erase_dead(graph: fx.Graph, candidates) -> None:
    """Erase the `candidates` whose results nothing live reads: a node is live when a node outside
    the candidates (or a live one) reads it, and so is every in-place write into a live node or
    into a view of it (a write into a dead tensor is dead with it)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    candidates = {n for n in candidates if not n._erased}
    stack = [u for n in candidates for u in n.users if u not in candidates]
    live = set()
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack += node.all_input_nodes + writes_into(node, len(order), order)
    for node in sorted(candidates - live, key=order.__getitem__, reverse=True):
        graph.erase_node(node)


def token_source(kv: fx.Node, T: int, what: str) -> tuple[fx.Node, list[fx.Node]]:
    """(the [T, ..] floating-point node through which alone the compressed kv reads sequence data,
    the region's nodes from it to kv in graph order): the nearest such node to kv. Its other inputs
    may be parameters and tensors of fewer than T elements (inv_freq): no per-token data."""
    order = {n: i for i, n in enumerate(kv.graph.nodes)}

    def per_token(node: fx.Node) -> bool:  # data that can hold a value per token
        val = value(node)
        return (node.op in ("placeholder", "get_attr") and isinstance(val, torch.Tensor)
                and not isinstance(val, torch.nn.Parameter) and math.prod(concrete(val.shape)) >= T)

    candidates = [n for n in ancestors([kv]) if isinstance(val := value(n), torch.Tensor) and val.dim() >= 1
                  and concrete(val.shape)[0] == T and val.is_floating_point() and not isinstance(val, torch.nn.Parameter)
                  and n.op in ("call_function", "call_method", "placeholder")]
    for source in sorted(candidates, key=order.__getitem__, reverse=True):
        region = ancestors([kv], stop=source) - {source}
        leaves = [n for n in region if n.op not in ("call_function", "call_method")]
        if not any(per_token(n) for n in leaves):
            ops = sorted((n for n in region if n.op in ("call_function", "call_method")), key=order.__getitem__)
            return source, ops
    raise Refused(f"the compressed {what} of the packed tokens read no single [T = {T}, ..] sequence (not probed)")


def token_layout(tokens: torch.Tensor, pooled, env: dict, source: fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [T, ..] in the memory layout that the probe region `pooled` runs faster on, its
    base value there): the same values with the token dim outermost (contiguous) or innermost in
    memory (xunhaolai's `seq.flatten(1).t()` hands avg_pool1d a transposed view, several times
    slower there), each timed LAYOUT_TRIALS times (the fastest of its runs: a busy host only slows
    a run). The contiguous layout is kept where the other fails to run (a `view` that needs
    contiguous tokens) or gives other values (beyond float64 rounding)."""
    layouts = [tokens.contiguous(), tokens.movedim(0, -1).contiguous().movedim(-1, 0)]
    seconds, values = [math.inf, math.inf], [None, None]
    for _ in range(LAYOUT_TRIALS):
        for i, laid in enumerate(layouts):
            started = time.perf_counter()
            try:
                values[i] = pooled({**env, source: laid})
            except Refused:
                if i == 0:
                    raise
                return layouts[0], values[0]
            seconds[i] = min(seconds[i], time.perf_counter() - started)
    if seconds[1] < seconds[0] and torch.allclose(values[1], values[0], rtol=1e-12, atol=0):
        return layouts[1], values[1]
    return layouts[0], values[0]


def varlen_windows(kv: fx.Node, T: int, seen_at: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    """(start [N] int64, l): the compressed kv [G, N, D] of packed tokens (per-document
    pooling, concatenated: xunhaolai's `avg_pool1d` per cu_seqlens slice) read on float64 probes
    of its token source (`token_source`): tokens perturbed P = min(T, VARLEN_PROBE_PERIOD) apart,
    each residue in turn, move the keys whose window holds one; key j must depend on one run of l
    consecutive tokens [start_j, start_j + l), l the same for every key (the run placed nearest
    the first query that sees it, `seen_at` [N], where P < T). A check on probes, as
    `probe_pooling`'s. Each run draws noise for its T / P tokens only; the region's nodes that do
    not read the tokens run once, and the runs take the tokens in the faster memory layout
    (`token_layout`): the same values."""
    source, ops = token_source(kv, T, what)
    order = {n: i for i, n in enumerate(kv.graph.nodes)}
    for node in [source, *ops]:
        if writes_into(node, order[kv], order):  # a value the region's inputs alone do not give
            raise Refused(f"the compressed {what} read {node.name}, which is written in place: not probed")
    for node in ops:
        name = op_name(node) or ""
        if any(word in name for word in _RANDOM) or (name.endswith("_") and not name.startswith("_")) or (
                node.op == "call_function" and node.target in _WRITES):
            raise Refused(f"the compressed {what} use {name} (random or in place): not probed")
    gen = torch.Generator().manual_seed(0)
    env = {}
    for node in ops:
        for x in node.all_input_nodes:
            if x not in env and x not in ops:
                val = value(x)
                if not isinstance(val, torch.Tensor):
                    raise Refused(f"the compressed {what} read {x.name}, not a tensor (not probed)")
                env[x] = (torch.randn(concrete(val.shape), generator=gen, dtype=torch.float64, device="cpu")
                          if val.is_floating_point() else
                          evaluate_written(x, f"input {x.name} of the pooled {what}").cpu())
    from nsa_compile import probe  # float64 evaluation of a region

    moving = {source}  # the nodes that read the perturbed tokens; the others give one value in every run
    for node in ops:
        if any(x in moving for x in node.all_input_nodes):
            moving.add(node)
    for node in ops:
        if node not in moving:  # evaluated once (RoPE tables, a mean of parameters)
            env[node] = probe.run([node], dict(env), node, f"the compressed {what}", device="cpu")
    ops = [node for node in ops if node in moving]

    def pooled(values: dict) -> torch.Tensor:  # [N], per key: its largest value (changes are compared)
        out = probe.run(ops, dict(values), kv, f"the compressed {what}", device="cpu") if ops else values[source]
        return out.transpose(0, 1).reshape(out.shape[1], -1) if out.dim() == 3 else out.reshape(out.shape[0], -1)

    env[source], base = token_layout(env[source], pooled, env, source)
    N = base.shape[0]
    scale = float(base.abs().max()) + 1.0
    period = min(T, VARLEN_PROBE_PERIOD)
    shape = concrete(value(source).shape)
    moved = []
    for r in range(period):
        hit = torch.arange(r, T, period, device="cpu")  # noise on these tokens only (O(T / P) values drawn)
        noise = torch.randn((len(hit), *shape[1:]), generator=gen, dtype=torch.float64, device="cpu")
        tokens = env[source].clone()  # in the chosen layout (`token_layout`)
        shifted = {**env, source: tokens.index_add_(0, hit, noise)}
        moved.append(((pooled(shifted) - base).abs().amax(-1) > PROBE_TOLERANCE * scale))
    runs = torch.stack(moved, dim=1)  # [N, period]: the residues key j depends on
    starts, lengths = [], set()
    for j in range(N):
        count = int(runs[j].sum())
        first_residue = (runs[j] & ~runs[j].roll(1)).nonzero().flatten()
        if count == 0:
            raise Refused(f"the compressed {what}: key {j} of the packed tokens depends on no token (probed)")
        if count == period and period == T:
            raise Refused(f"the compressed {what}: key {j} depends on every token (probed): not a pooled block")
        if len(first_residue) != 1 or 2 * count > max(period, 2) and period < T:
            raise Refused(f"the compressed {what}: key {j} does not depend on one run of consecutive tokens "
                          f"(probed, tokens {period} apart perturbed together)")
        start = int(first_residue[0])
        if period < T:  # the run's place nearest the query that first sees the key (its last token there)
            last = start + count - 1
            start += round((int(seen_at[j]) - last) / period) * period
        starts.append(start)
        lengths.add(count)
    if len(lengths) != 1:
        raise Refused(f"the compressed {what} of the packed tokens pool windows of {sorted(lengths)} tokens (probed), "
                      "not blocks of one length l")
    return torch.tensor(starts, dtype=torch.int64, device="cpu"), lengths.pop()


@dataclass(frozen=True)
class Varlen:
    """What `verify_varlen` proved for 3-D scores [H, T, N] over packed tokens: compressed key j
    pools tokens [slot_j, slot_j + l), and the masks are NSA's packed visibility (`packed_visibility`)
    for (l, d) on positions `pos` [T] with key j in slot slot_j of the op's slot per token."""

    block: int
    stride: int
    pos: tuple  # each token's position in its document, as this branch shows the documents
    slots: tuple  # slot_j per compressed key
    pos_node: fx.Node | None = None  # the window op's constant positions [1, T] where they are pos


def varlen_documents(keep: torch.Tensor, starts: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """(pos [T], d) that the -inf mask keep [T, N] and the keys' windows [starts_j, starts_j + l)
    show: key j's document ends where its rows end (the last query that sees it, + 1) and starts at
    the first window of the keys that end there; the positions count from there, 0 for tokens of no
    such document (documents with no complete block: no query there sees a key, as with a document
    per token); d is the gcd of the keys' positions in their documents (T when each holds one)."""
    T, N = keep.shape
    seen = keep.any(0)
    if not bool(seen.all()):
        j = int((~seen).nonzero()[0])
        raise Refused(f"compressed key {j} of the packed tokens is visible to no query")
    first_row = keep.int().argmax(0)  # [N]
    ends = T - keep.flip(0).int().argmax(0)  # [N]: one past the last query that sees each key
    gaps = keep.sum(0) != ends - first_row  # the rows that see a key are not one run
    if bool(gaps.any()):
        j = int(gaps.nonzero()[0])
        t = int(first_row[j]) + int((~keep[int(first_row[j]):, j]).int().argmax())
        s = int(starts[j])
        raise Refused(f"compressed key {j} (pooled from tokens [{s}, {s + block})) is seen by queries {int(first_row[j])}.."
                      f"{t - 1}, hidden from {t} and seen again later: not the queries of one document (a mask that "
                      "crosses documents)")
    pos = torch.zeros(T, dtype=torch.int64, device="cpu")
    stride, bounds = 0, []
    for end in sorted(set(ends.tolist())):
        keys = (ends == end).nonzero().flatten()
        start = int(starts[keys].min())
        if bounds and start < bounds[-1][1] or start + block > end:
            raise Refused(f"the compressed keys seen up to token {end - 1} are pooled from tokens {start}.. that "
                          f"overlap another document or end after it (not per-document blocks)")
        bounds.append((start, end))
        pos[start:end] = torch.arange(end - start, device="cpu")
        for offset in (starts[keys] - start).tolist():
            stride = math.gcd(stride, offset)
    return pos, stride or T


def varlen_reason(keep: torch.Tensor, want: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, block: int,
                  stride: int) -> str:
    """Why keep [T, N] is not NSA's packed visibility `want` [T, N] of the keys' slots: the first
    query that sees a key it must not (and why), else the first that misses one."""
    l, d = block, stride
    head = f"the compressed mask of the packed tokens is not NSA's per-document visibility (l={l}, d={d})"
    extra = keep & ~want
    if bool(extra.any()):
        t, j = (int(x) for x in extra.nonzero()[0])
        s = int(slots[j])
        if s + l - 1 > t:
            why = f"its last token {s + l - 1} comes after t (a later token leaks in)"
        elif s < t - int(pos[t]):
            why = f"it lies in an earlier document (t's document starts at token {t - int(pos[t])})"
        else:
            why = f"it starts at position {int(pos[s])} of its document, not a multiple of d = {d}"
        return f"{head}: query t={t} sees compressed key {j} (pooled from tokens [{s}, {s + l})), but {why}"
    t, j = (int(x) for x in (want & ~keep).nonzero()[0])
    s = int(slots[j])
    return (f"{head}: query t={t} misses compressed key {j} (pooled from tokens [{s}, {s + l})), a block of its own "
            "document in its past")


def varlen_mismatch(keep: torch.Tensor, starts: torch.Tensor, block: int, pos: torch.Tensor, stride: int) -> str | None:
    """Why keep [T, N] is not NSA's packed visibility (`packed_visibility`, the columns of the
    slots `starts` [N]) for (l, d) = (block, stride) on positions pos [T], every element compared,
    or why another slot would be visible (a block of a document that no key pools); None where
    it is. O(T * N) memory: the slots of the keys only, and the other slots' block test [Tc]."""
    T, N = keep.shape
    Tc = T - block + 1
    start = pos[:Tc]
    is_block = (start % stride == 0) & (pos[block - 1 : block - 1 + Tc] == start + block - 1)  # [Tc]
    t = torch.arange(T, device="cpu")[:, None]
    slots = starts[None, :]
    want = (slots + block - 1 <= t) & (slots >= t - pos[:, None]) & is_block[starts][None, :]  # [T, N]
    if not torch.equal(keep, want):
        return varlen_reason(keep, want, pos, starts, block, stride)
    others = is_block.clone()
    others[starts] = False
    if bool(others.any()):  # a block of its document: visible to its last token at least
        s = int(others.nonzero()[0])
        return (f"the packed visibility (l={block}, d={stride}) shows query t={s + block - 1} the block of tokens "
                f"[{s}, {s + block}) of its document, which no compressed key pools")
    return None


def constant_positions(graph: fx.Graph, T: int) -> list[tuple[fx.Node, torch.Tensor]]:
    """(node, pos [T]) for the positions [1, T] of the varlen window: the pos argument of an
    nsa.window_attention (which runs before this pass) that is computed from no data (canonicalize's
    constant of the documents the window's mask shows, every token's)."""
    targets = (torch.ops.nsa.window_attention, torch.ops.nsa.window_attention.default)
    found = []
    for node in graph.nodes:
        pos = node.args[6] if node.op == "call_function" and node.target in targets and len(node.args) > 6 else None
        if isinstance(pos, fx.Node) and isinstance(val := value(pos), torch.Tensor) and val.dtype == torch.int64 \
                and concrete(val.shape) == (1, T):
            try:
                found.append((pos, evaluate_written(pos, "window positions")[0].cpu()))
            except Refused:  # positions from data (a pos input): not constant
                continue
    return found


def verify_varlen(probs: Probabilities, v: fx.Node) -> Varlen:
    """Refused unless the 3-D branch of `probs` ([1, H, T, N] read from scores [H, T, N] over packed
    [T, H, D] tokens) is NSA's compressed branch over documents: K and V pooled per key from one
    window of l tokens (the same windows, probed: `varlen_windows`), the -inf mask (evaluated at
    compile time, in-place writes included) equal to NSA's packed visibility with key j in the
    slot where its window starts and no other slot visible (`varlen_mismatch`: every element
    compared, exact at this shape) for positions pos and a stride d: those of the window op's
    constant positions (the documents of the window's mask) where they fit, else the ones the keys
    and the mask show (`varlen_documents`); and the rows without a visible key zeroed and cleared
    (`check_row_masks`)."""
    _, _, T, N = probs.shape
    if N == T:
        raise Refused(f"3-D scores [H, T, T] over the packed tokens themselves (T = {T}): dense or windowed "
                      "attention, not compressed keys")
    mask, sense = probs.masks["inf"]
    filled = evaluate_written(mask, "visibility mask")
    if filled.dtype != torch.bool:
        raise Refused(f"the visibility mask is {filled.dtype}, not bool")
    keep = as_grid(~filled if sense else filled, T, N, "visibility mask").cpu()
    seen_at = keep.int().argmax(0)  # [N]: the first query that sees each key
    starts, l = varlen_windows(probs.k, T, seen_at, "keys")
    v_starts, v_l = varlen_windows(v, T, seen_at, "values")
    if v_l != l or not torch.equal(v_starts, starts):
        j = int((v_starts != starts).nonzero()[0]) if v_l == l else 0
        raise Refused(f"the compressed keys and values of the packed tokens are pooled from different windows (key "
                      f"{j}: tokens [{int(starts[j])}, {int(starts[j]) + l}) and [{int(v_starts[j])}, "
                      f"{int(v_starts[j]) + v_l}); probed)")
    if len(set(starts.tolist())) != N:
        raise Refused("two compressed keys of the packed tokens are pooled from the same window")
    found, why = None, None
    for node, pos in constant_positions(probs.softmax.graph, T):
        stride = math.gcd(*pos[starts].tolist()) or T
        if varlen_mismatch(keep, starts, l, pos, stride) is None:
            found = (node, pos, stride)
            break
    if found is None:
        pos, stride = varlen_documents(keep, starts, l)
        why = varlen_mismatch(keep, starts, l, pos, stride)
        if why is not None:
            raise Refused(why)
        found = (None, pos, stride)

    def grid(node: fx.Node, what: str) -> torch.Tensor:
        return as_grid(evaluate_written(node, what), T, N, what).cpu()[None]

    check_row_masks(probs, grid, keep[None], f"rows without a visible key (the first {l - 1} tokens of each document)")
    node, pos, stride = found
    return Varlen(l, stride, tuple(pos.tolist()), tuple(starts.tolist()), node)


def rewrite_varlen(graph: fx.Graph, plan: dict) -> None:
    """p @ v over packed tokens -> the op's packed form on one row of T tokens: q [1, H, T, D] (a
    view), K/V [1, G, T - l + 1, D] with key j copied into its slot (zeros elsewhere: no query
    sees them), the constant positions [1, T]; o [1, H, T, Dv][0] replaces p @ v [H, T, Dv]."""
    probs, pv, seen = plan["probs"], plan["pv"], plan["varlen"]
    T = probs.shape[2]
    Tc = T - seen.block + 1
    device = value(probs.q).device
    slots = constant(graph, torch.tensor, list(seen.slots), like=probs.q, anchor=pv, dtype=torch.int64, device=device)
    pos = seen.pos_node or constant(graph, torch.tensor, [list(seen.pos)], like=probs.q, anchor=pv, dtype=torch.int64,
                                    device=device)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if order[pos] > order[pv]:  # the window's constant (it reads nothing) may come later: before its new use
        pv.prepend(pos)

    def in_slots(x: fx.Node) -> fx.Node:  # [G, N, D] -> [1, G, Tc, D]
        G, _, D = concrete(value(x).shape)
        zeros = call(graph, torch.Tensor.new_zeros, x, (G, Tc, D), anchor=pv)
        return call(graph, torch.unsqueeze, call(graph, torch.index_copy, zeros, 1, slots, x, anchor=pv), 0,
                    anchor=pv)

    q = call(graph, torch.unsqueeze, probs.q, 0, anchor=pv)
    both = call(graph, torch.ops.nsa.compressed_attention, q, in_slots(probs.k), in_slots(plan["v"]), seen.block,
                seen.stride, probs.scale, plan["backend"], pos, anchor=pv)
    out = call(graph, operator.getitem, call(graph, operator.getitem, both, 0, anchor=pv), 0, anchor=pv)
    pv.replace_all_uses_with(out)
    erase_replaced(graph, [pv], [plan["cast"] or probs.p])


class CompressedAttention(RewritePass):
    name = "compressed_attention"
    summary = "pooled-block attention under the staircase mask -> nsa.compressed_attention, no repeated K/V"

    def source_files(self) -> tuple[str, ...]:
        return super().source_files() + (inspect.getfile(RowChunks),)  # the row-chunk evaluation of the masks

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        subgraphs, data = PositionSubgraphs(Sizes.of(graph)), data_nodes(graph)
        requested = ctx.config.backend("compressed_attention")
        for softmax in list(graph.nodes):
            if op_name(softmax) != "softmax" or softmax._erased:
                continue
            try:
                plan = self.check(softmax, subgraphs, data, requested)
            except Refused as why:
                ctx.refused(softmax, str(why))
                continue
            self.rewrite(graph, plan)
            data = data_nodes(graph)  # the graph changed
            why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
            packed = ", packed documents (pos)" if plan["pos"] is not None else ""
            ctx.matched(softmax, KERNEL.format(block=plan["block"], stride=plan["stride"], backend=plan["backend"],
                                               packed=packed, variant=plan["variant"], why=why))

    def check(self, softmax: fx.Node, subgraphs: PositionSubgraphs, data: set, requested: str = "auto") -> dict:
        probs = read_probabilities(softmax)
        pv, cast, v_rep = output_product(probs)
        rank = value(softmax).dim()  # 3: packed [T, H, D] tokens
        v, h_v = ungroup(v_rep) if rank == 4 else unrepeat_heads(v_rep)
        vv = value(v)
        if (h_v != probs.h or vv is None or vv.dim() != rank
                or not same(vv.shape[:rank - 1], value(probs.k).shape[:rank - 1])):
            raise Refused(f"the compressed values {None if vv is None else tuple(vv.shape)} (x{h_v}) do not match "
                          f"the keys {tuple(value(probs.k).shape)} (x{probs.h})")
        if not vv.is_floating_point():
            raise Refused("V is not floating point")
        if cast is not None and value(cast).dtype != vv.dtype:
            raise Refused(f"the probabilities are cast to {value(cast).dtype}, not to V's {vv.dtype}")
        if cast is None and value(probs.p).dtype != vv.dtype:
            raise Refused(f"the {value(probs.p).dtype} probabilities multiply {vv.dtype} V without a cast")
        if value(probs.q).dtype != value(probs.k).dtype:
            raise Refused("q and the compressed keys differ in dtype")
        if rank == 3:
            return self.check_varlen(probs, pv, cast, v, requested)
        seen = verify_at_probe_sizes(probs, v, data, subgraphs)
        fakes = (value(probs.q), value(probs.k), vv, seen.intercept, seen.stride)
        pos = None if seen.pos is None else value(seen.pos)
        try:  # from the fake tensors: device, dtype, head dims
            backend = choose_backend(*fakes, requested, pos, seen.q_offset)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(compressed_attention_backend={requested!r}): {why}") from None
        variant = seen.describe()
        if probs.finite_fill is not None:
            variant += f", fill {probs.finite_fill:g} read as -inf"
        if probs.score_users:
            names = ", ".join(sorted({op_name(u) or u.op for u in probs.score_users}))
            variant += f", the scores also kept for {names}"
        return {"probs": probs, "v": v, "pv": pv, "cast": cast, "block": seen.block, "stride": seen.stride,
                "intercept": seen.intercept, "variant": variant, "pos": seen.pos, "backend": backend,
                "q_offset": seen.q_offset,
                "why_not_triton": why_not_triton(*fakes, pos, seen.q_offset) if requested == "auto"
                else f"compressed_attention_backend={requested!r} in OptimizeConfig"}

    @staticmethod
    def check_varlen(probs: Probabilities, pv: fx.Node, cast: fx.Node | None, v: fx.Node, requested: str) -> dict:
        """The plan for 3-D scores over packed tokens (`verify_varlen`), the backend chosen for the
        tensors the rewrite makes (one row of T tokens, a slot per token)."""
        probs = dataclasses.replace(probs, shape=concrete(probs.shape))
        seen = verify_varlen(probs, v)
        _, H, T, _ = probs.shape
        (G, _, Dk), Dv = concrete(value(probs.k).shape), concrete(value(v).shape)[-1]
        qv, kv, vv = value(probs.q), value(probs.k), value(v)
        with qv.fake_mode:  # the op's inputs as the rewrite makes them
            fakes = (qv.new_empty(1, H, T, Dk), kv.new_empty(1, G, T - seen.block + 1, Dk),
                     vv.new_empty(1, G, T - seen.block + 1, Dv), seen.block, seen.stride)
            pos = torch.zeros(1, T, dtype=torch.int64, device=qv.device)
        try:
            backend = choose_backend(*fakes, requested, pos)
        except ValueError as why:
            raise Refused(f"OptimizeConfig(compressed_attention_backend={requested!r}): {why}") from None
        documents = len({s - seen.pos[s] for s in seen.slots})  # the document starts of the keys
        return {"probs": probs, "v": v, "pv": pv, "cast": cast, "block": seen.block, "stride": seen.stride,
                "varlen": seen, "backend": backend, "pos": None,
                "variant": f", packed [T, H, D] tokens (3-D scores, {len(seen.slots)} per-document keys in slots of "
                           f"{T - seen.block + 1}, {documents} documents with a block)",
                "why_not_triton": why_not_triton(*fakes, pos) if requested == "auto"
                else f"compressed_attention_backend={requested!r} in OptimizeConfig"}

    def rewrite(self, graph: fx.Graph, plan: dict) -> None:
        if "varlen" in plan:
            rewrite_varlen(graph, plan)
            return
        probs, pv = plan["probs"], plan["pv"]
        args = (probs.q, probs.k, plan["v"], plan["intercept"], plan["stride"], probs.scale, plan["backend"])
        if plan["pos"] is not None:  # packed documents: the positions go with it
            args += (plan["pos"],)
        elif plan["q_offset"]:  # a chunk of queries: the token of its first row
            args += (None, plan["q_offset"])
        both = call(graph, torch.ops.nsa.compressed_attention, *args, anchor=pv)
        out = call(graph, operator.getitem, both, 0, anchor=pv)  # o; select_blocks takes the lse (item 1)
        pv.replace_all_uses_with(out)
        # erase p @ v, then whatever only it used: the V copy, and p's chain unless p has other users
        erase_replaced(graph, [pv], [plan["cast"] or probs.p])


PASS = CompressedAttention()
