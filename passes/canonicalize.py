"""canonicalize: rewrite equivalent spellings of attention into the one form the NSA passes read.

Runs first. Each rule rewrites one family of spellings into the normal form below and proves
the rewrite where it applies (statically, from shapes, equations and constants, or by evaluating
position-only masks at compile time); a rule that cannot prove it leaves the graph unchanged and
records a refusal with the reason. Every firing is one match in `report()` and `explain`, its
text starting with the rule's name ("einsum: ...", "scores: ..."). Code already in the normal
form is left as it is.

The normal form, anchored at the softmax of attention scores:
    scores = q @ k.transpose(-1, -2)                 # [batch.., M, D] @ [batch.., D, N]
    scores = scores.to(torch.float32)                # only where the product is fp16/bf16
    scores = scores * c                              # one positive python number (or no scale)
    scores = scores.masked_fill(drop, float("-inf")) # drop = ~keep; one node per run of masks
    scores = scores.masked_fill(empty, 0.0)          # optional: rows with no key (compressed branch)
    p = torch.softmax(scores, dim=-1)                # no dtype argument
    p = p * (keep & ~empty)                          # with the zero fill above
    o = p.to(v.dtype) @ v

Rules, in the order they run:

autocast
    The casts autocast makes when the graph runs (a matmul's operands to bf16, a softmax's input
    up to float32 on CUDA), read from the recorded dtypes and written as `.to()` nodes, so that the
    rules below and the passes see the dtypes the eager code computes in (passes/autocast_casts.py).

cast_hoist
    A narrowing float cast (float32 to bf16 or fp16, float64 to float32) of data movement, read by
    a product (matmul, einsum, SDPA; directly or through more data movement), goes on the
    movement's input, through the whole chain:
    transposes and permutes, basic slices (ints, slices, None), and reshapes and copies (unsqueeze,
    flatten, view, reshape, expand, repeat, repeat_interleave; not `view(dtype)`, nor a
    repeat_interleave with a tensor of repeats). `x.unsqueeze(2).repeat(1, 1, h, 1, 1).flatten(1,
    2).to(bf16)` becomes `x.to(bf16).unsqueeze(2).repeat(..).flatten(1, 2)`. These are the casts the
    autocast rule writes right before a product (CUDA autocast's cast of a float32 K/V copy, of
    float32 pooled keys laid out for the product, of per-query rows `q.unsqueeze(-2)`, of a chunk's
    key slice) and the same casts written by hand; moved, the copy, the layout, the rows, the slice
    and `cat((mem, pooled))` sit next to the product where the passes read them. Exact: a cast is
    elementwise. Chain nodes with other readers stay for them; the cast reads its own copy of the
    chain (views copy nothing; a copy is made in the cast's dtype in place of the cast's own). A
    cast up stays: the passes read upcasts where they are (`.squeeze(-2).float()`), and moved it
    would widen more elements; so does a cast no product reads (RoPE tables cast to bf16).

sdpa
    `F.scaled_dot_product_attention(q, k, v, attn_mask=m[, scale=c][, enable_gqa=True])` becomes
    the normal form by SDPA's definition (softmax(q k^T * c + m) v, a bool m keeping True, K/V
    repeat_interleave'd for enable_gqa), but only where a pass reads the result: queries = keys
    with a position mask that is a causal sliding window (the window branch), or a bool mask that
    is the same window within each of two or more documents of constant bounds (a varlen layout
    packed into one sequence, its mask assembled from cu_seqlens), written as the window pass's
    packed form `(s <= t) & (t - s < w) & (s >= t - pos[:, :, None])` on constant positions pos
    [B, T] derived from the evaluated mask (equal to it element for element); another key count
    with a position mask whose rows keep growing prefixes of the keys (compressed blocks, memory
    slots first), where rows that keep no key get SDPA's 0 through the zero fill and `* keep`, or
    whose row r keeps the columns r + d - w + 1 .. r + d (a chunk of queries' sliding window over a
    slice of the keys, `shifted_window`: the window pass reads the offsets from the slices); 5-D
    per-query SDPA ([B, H, S, 1, D] against gathered [B, H, S, n, D], the selected branch) with a
    bool mask, followed by `nan_to_num(p)` (SDPA's 0 for a row with no key, which the selected op
    gives too). Other masked SDPA calls stay (SDPA's own kernels are their fast path) with the
    reason; `is_causal` without a mask is dense causal attention and is left alone. At symbolic
    sizes a prefix mask is written with the zero fill and `* keep` whether or not a probe shows an
    empty row (exact either way), and a window within constant documents stays SDPA (its positions
    would be constants of one length).

grouped_heads
    5-D grouped attention, two einsums over q [.., G, h, ..] and K/V [.., G, ..] shared by a
    group's h heads (`'bghsd,bgtd->bghst'`, `'bsghd,bgcd->bsghc'`, `'bghsd,bgsnd->bghsn'`) with the
    masks, scale and softmax between them, becomes 4-D heads [B, G * h, S, ..] (see GroupedHeads).
    G and h may be sizes at symbolic sizes (the blocks of a bucketed window as groups): the views
    and the K/V repeat then take them from q (sym_size nodes).

softmax
    A softmax written out, `e = exp(x - x.amax(d, keepdim=True)); p = e / e.sum(d, keepdim=True)`
    (the max also as `x.max(d, keepdim=True).values`, detached or not), becomes
    `torch.softmax(x, d)`: the same function (both subtract the row max; a row of -inf is NaN both
    ways); the gradient through the max is zero in exact arithmetic, so only rounding differs (in
    fp16/bf16 eager rounds exp and the sum to that dtype, torch.softmax accumulates in float32: the
    match says so). Refused: exp(x) / sum without the max (it overflows where softmax does not),
    a max or shifted scores read elsewhere.

einsum
    A two-operand `torch.einsum` (explicit `->`; `...` allowed) becomes permutes, one matmul and
    views back to the equation's output order. Letters of both operands and the output are batch
    dims, letters of one operand and the output the rows (M) or columns (N), letters of both
    operands only are contracted (K): the left operand becomes [batch.., M, K], the right
    [batch.., K, N] (`transpose(-1, -2)` when it holds N before K); several letters of a kind are
    flattened, none is a size-1 dim (`unsqueeze(-2)` / `unsqueeze(-1)`, then `squeeze`). Proven by
    the equation: every output element is the same sum of products, in the same dtype. Refused:
    other than two operands, a repeated letter within an operand (a diagonal), a letter summed
    within the right operand, a letter whose size differs between the operands (broadcast; at
    symbolic sizes: not the same size for every value of the size symbols), operands of two dtypes
    (einsum may promote them, matmul does not), an implicit output. A letter summed within the
    left operand only (a group sum folded into the product, 'bghsc,cj->bgsj') is summed out of that
    operand first, then the product: torch.einsum's own order, so the same roundings in bf16 and
    fp16 (summed after the product, a bf16 result differed by up to 0.25 on [0, 1) inputs). A right operand that is
    a matrix [K, N] is broadcast by matmul over the left operand's rows, kept as dims (a leading
    unflatten of the left operand moves after the product). At symbolic sizes (dynamic shapes) the
    views take their sizes from the operands (sym_size nodes), never as numbers.

gqa_expand
    A K/V copy for the heads of each group, `x[:, :, None].expand(B, G, h, ..).reshape(B, G*h, ..)`
    (Hugging Face's repeat_kv, einops `repeat('b g ... -> b (g h) ...')`, `unsqueeze(2).repeat(1, 1,
    h, ..).flatten(1, 2)`), becomes `x.repeat_interleave(h, dim=1)`: shapes show head g * h + r
    reads group g. Tiling, `x.repeat(1, h, 1, 1)` or `x[:, None].expand(B, h, G, ..)`, gives head
    r * G + g group g, another grouping: refused unless the tiled dim has size 1 (then the two agree).
    At symbolic sizes the shapes are compared as sizes (equal for every value of the symbols); h
    must be a number.

cast_chain
    A float cast of a float cast that loses nothing (the same dtype, or wider: `p.to(p.dtype)`, bf16
    -> float32) becomes one cast from the first tensor (`p_cmp.to(vc.dtype).to(torch.bfloat16)`,
    where vc is float32 under CUDA autocast and autocast then casts p to bf16 for its matmul): exact,
    the inner cast changes no value. A rounding inner cast (float32 -> bf16 -> float32) stays.

key_layout
    Scores `q @ k.permute(0, 2, 3, 1)`, whose permute also swaps the last two dims, become
    `q @ k.permute(0, 2, 1, 3).transpose(-1, -2)`: the same tensor.

gqa_layout
    A permute or transpose that moves the repeated dim of a `repeat_interleave` copy (sequence-first
    [B, S, H, D] code: `x.repeat_interleave(h, dim=2).transpose(1, 2)`) is moved before the copy:
    `x.transpose(1, 2).repeat_interleave(h, dim=1)`, the same elements in the same places, with
    the copy on the head dim the passes read.

scores
    The steps between the score product (a matmul) and the softmax over its last dim are read as
    casts, one positive scale and masks, and written again in the normal order:
    - `softmax(x, dim, dtype=torch.float32)` is `softmax(x.to(torch.float32), dim)`: PyTorch casts
      the input to `dtype` first.
    - A cast up after a mask moves before it: masked_fill(x, m, f) in bf16, then cast, is the cast
      then masked_fill with f as bf16 stores it (the same number in every element).
    - A mask before a positive scale c moves after it: masked_fill(x, m, f) * c is
      masked_fill(x * c, m, f * c) (-inf * c = -inf, 0 * c = 0).
    - A scale before the cast up moves after it. Exact when c is a power of two; otherwise eager
      rounds s * c to fp16/bf16 once more than the normal form does (the op is the more accurate),
      and the match says so.
    - masked_fill(x, m, f), torch.where(m, x, f), torch.where(m, f, x) and an additive bias x + b
      (b from positions only; evaluated, its values must be 0 and one fill f) become
      masked_fill(x, drop, -inf); adjacent ones merge (drop1 | drop2).
    - A finite fill f (finfo.min, -finfo.max, -1e9, `mask_value // 10`, ...) becomes -inf only
      where nothing changes: f <= -1e4 as the softmax sees it (exp(f - m) is then 0 in float32 for
      any kept score m above f + 104), and every row keeps a key or is overwritten whole by a
      later zero fill (a fully masked row gives the uniform average of its keys with a finite
      fill, NaN with -inf). The masks are evaluated at compile time. A finite fill that cannot be
      shown safe (its mask reads data: block ids, document positions; or a row can be fully
      masked) stays finite, as the softmax sees it, while the rest of the chain is rewritten
      (selected_attention takes a finite fill where select_blocks's op gives every row a key);
      with nothing else to rewrite, that is a refusal.
    - `x.masked_fill_(m, f)` reads as `x.masked_fill(m, f)` where x is a new tensor (a product, a
      scale, another mask's result: no view, input or alias) that only the in-place op reads:
      nothing else sees x change (xunhaolai's `qk.masked_fill_(~mask, -inf)`).
    Refused: a negative or non-constant scale, two scales, a cast down, a fill other than -inf, 0
    or a large negative, a bias that reads data or holds other values.

empty_rows
    Probabilities set to 0 after the softmax for rows with no visible key, `p.masked_fill(empty,
    0.0)` (empty a per-row mask, last dim 1) or `torch.nan_to_num(p)` (the NaN of the all -inf
    rows), become the compressed branch's form `softmax(x.masked_fill(empty, 0.0)) * (keep &
    ~empty)`. Exact: a row in `empty` is 0 both ways; in any other row p is already 0 where keep is
    False. For nan_to_num, empty = `~keep.any(-1, keepdim=True)`: the same rows for finite scores
    (nan_to_num would also zero a NaN from non-finite scores; the match says so). Where no row is
    empty (the mask evaluated), the fill is dropped instead.

Symbolic sizes (Dynamo's compile after S changed, S a SymInt): the rules read shapes as sizes
(compared with statically_known_true, never with == or bool(), which would add a guard) and give
views their sizes from tensors (sym_size nodes). The masks that sdpa, scores and empty_rows
evaluate are evaluated at each probe size (nsa_compile/sizes.py: the sizes Dynamo saw, then every
symbol +1 and +19), the graph's size nodes given their numbers there, and a rule's decision must
hold at every probe (a window or prefix mask at each, every row keeping a key at each for a finite
fill, one fill of a bias): a check on probe sizes, as the passes' are; a refusal names the probe
sizes where it failed. Before the rules, a size read from a K/V copy (`Tc = kc.shape[2]` of kc =
x.repeat_interleave(h, 1), a number in a static graph) is read from x (times h on the copied dim),
so that the copy serves its products only, as in a static graph (`sizes_off_copies`; not a match).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import string
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from nsa_compile.attention_match import LARGE_NEGATIVE, Refused, ancestors, erase_replaced
from nsa_compile.fx import MATMULS, arg, call, constant, op_name, same, value
from nsa_compile.fx import size as size_of
from nsa_compile.mask_rows import CHUNK_ELEMENTS
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes, is_size

from . import compressed_attention as cmp
from .autocast_casts import ExplicitAutocast
from .window_attention import CONSTANT_POSITIONS, mask_rows

INF = float("inf")
# Node meta: a zeroing of the output whose rows the scores rule turned from a finite fill to -inf
# (they were finite in eager, so eager's backward was finite there too).
FINITE_ROWS = "nsa_canonical_finite_rows"


def first(node: fx.Node):
    return arg(node, 0, "input")


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def shape_of(node) -> tuple | None:
    """A tensor node's shape: ints, and SymInts in a graph with symbolic sizes (compared with
    `same` only, never with == or bool(): that would add a guard); None for anything else."""
    val = value(node)
    return None if val is None else tuple(val.shape)


def dims_of(graph: fx.Graph, x: fx.Node, anchor: fx.Node) -> list:
    """x's sizes as a view's arguments: ints where static, sym_size nodes where symbolic."""
    return [size_of(graph, x, d, anchor) for d in range(value(x).dim())]


# The most elements a static SDPA mask's nodes may materialize to be evaluated whole (what
# cmp.PositionSubgraphs.evaluate refuses past); a larger self-attention mask is verified in chunks of
# rows (`window_rows`: an SDPA window mask at S 32k has 4.3e9).
WHOLE_MASK_CAP = cmp.MAX_VERIFIED_ELEMENTS


class ProbeMasks:
    """Position masks evaluated at compile time (cmp.PositionSubgraphs, once per structure: the
    layers share them) under each probe assignment of the graph's sizes (`Sizes.probes`: the one
    assignment of a static graph; at symbolic sizes the sizes Dynamo saw, then every symbol +1 and
    +19). A rule decides from every probe's values: a check on probe sizes, as the passes' are."""

    def __init__(self):
        self.sizes: Sizes | None = None
        self.subgraphs: cmp.PositionSubgraphs | None = None
        self.evaluators: list[cmp.PositionSubgraphs] = []

    def read(self, graph: fx.Graph) -> None:
        """Take the graph's sizes and size nodes (again: a rule may have added sym_size nodes);
        the values already evaluated are kept (their cache key holds the sizes' numbers)."""
        cache = self.subgraphs.cache if self.subgraphs is not None else None
        self.sizes = Sizes.of(graph)
        self.subgraphs = cmp.PositionSubgraphs(self.sizes)
        if cache is not None:
            self.subgraphs.cache = cache
        self.evaluators = [self.subgraphs.at(probe) for probe in self.sizes.probes()]

    @property
    def symbolic(self) -> bool:
        return self.sizes.symbolic

    def each(self, fn) -> list:
        """fn(evaluator) for the evaluator of every probe, in order (the same evaluator objects
        until the next `read`); a refusal at a probe of a symbolic graph names its sizes."""
        results = []
        for at in self.evaluators:
            try:
                results.append(fn(at))
            except Refused as why:
                if not at.sizes.symbolic:
                    raise
                raise Refused(f"at the probe sizes {at.sizes.describe()}: {why}") from None
        return results

    def evaluate(self, node: fx.Node, what: str) -> list[tuple[Sizes, torch.Tensor]]:
        """(probe sizes, the value of `node`) at every probe."""
        return self.each(lambda at: (at.sizes, at.evaluate(node, what)))

    def over_cap(self, node: fx.Node, what: str) -> bool:
        """Whether evaluating `node` whole at the graph's one probe (static sizes) would materialize
        more than WHOLE_MASK_CAP elements."""
        at = self.evaluators[0]
        nodes, _ = at.plan(node, what)
        return at.cost(nodes, {}) > WHOLE_MASK_CAP


# --- einsum -------------------------------------------------------------------------------------


def size_product(graph: fx.Graph, x: fx.Node, dims, anchor: fx.Node):
    """The product of the sizes of x's `dims`: an int where they are static, else a graph
    expression of sym_size nodes (a view's argument, never a number of the first call)."""
    known, symbolic = 1, []
    for d in dims:
        n = value(x).shape[d]
        if is_concrete_int(n):
            known *= int(n)
        else:
            symbolic.append(size_of(graph, x, d, anchor))
    total = known if known != 1 or not symbolic else None
    for n in symbolic:
        if total is None:
            total = n
            continue
        total = call(graph, operator.mul, total, n, anchor=anchor)
    return total


def value_or_int(x):
    """A node's recorded value (a SymInt for a size node), or x itself (an int)."""
    return x.meta.get("example_value", x.meta.get("val")) if isinstance(x, fx.Node) else x


def parse_equation(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """'bhid,bhjd->bhij' -> (['bhid', 'bhjd'], 'bhij'): spaces dropped, '...' spelled out as
    upper-case letters; Refused for an implicit output, ellipses of different widths, a term
    that does not fit its operand or repeats a letter."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        raise Refused("einsum without '->' (implicit output order)")
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise Refused(f"the einsum equation names {len(terms)} operands for {len(ranks)} tensors")
    spare = [c for c in string.ascii_uppercase if c not in equation]
    widths = {rank - len(term.replace("...", "")) for term, rank in zip(terms, ranks) if "..." in term}
    if len(widths) > 1:
        raise Refused("the einsum operands' ellipses cover different numbers of dims (broadcast)")
    dots = "".join(spare[: widths.pop()]) if widths else ""
    terms, out = [term.replace("...", dots) for term in terms], out.replace("...", dots)
    for term, rank in zip(terms, ranks):
        if len(term) != rank or not term.isalpha():
            raise Refused(f"the einsum term {term!r} does not fit a {rank}-D operand")
        if len(set(term)) != len(term):
            raise Refused(f"the einsum term {term!r} repeats a letter (a diagonal)")
    return terms, out


def einsum_to_matmul(graph: fx.Graph, node: fx.Node) -> str | None:
    """torch.einsum(eq, a, b) -> permute/reshape, matmul, reshape/permute (module docstring)."""
    if op_name(node) != "einsum" or node.op != "call_function" or not node.args or not isinstance(node.args[0], str):
        return None
    equation, operands = node.args[0], list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if len(operands) != 2 or not all(isinstance(x, fx.Node) and value(x) is not None for x in operands):
        raise Refused(f"einsum of {len(operands)} operands (the matmul form takes two tensors)")
    a, b = operands
    shapes = [tuple(value(a).shape), tuple(value(b).shape)]  # symbolic sizes too (dynamic shapes)
    if value(a).dtype != value(b).dtype:  # einsum may promote (an outer product is a mul); matmul does not
        raise Refused(f"einsum of {value(a).dtype} and {value(b).dtype} operands (matmul takes one dtype)")
    (ta, tb), out = parse_equation(equation, [len(s) for s in shapes])
    if len(set(out)) != len(out) or any(c not in ta + tb for c in out):
        raise Refused(f"the einsum output {out!r} repeats a letter or names one no operand has")
    size = {}
    for term, shape in zip((ta, tb), shapes):
        for c, n in zip(term, shape):
            if not statically_known_true(size.setdefault(c, n) == n):  # for every value of the symbols
                raise Refused(f"einsum letter {c!r} has sizes {size[c]} and {n} (broadcast)")
    # each letter's size as a view argument: an int, or a sym_size of the operand that has it
    where = {c: (x, term.index(c)) for x, term in ((b, tb), (a, ta)) for c in term}

    def letter_size(c: str):
        return size_of(graph, where[c][0], where[c][1], node)
    batch = [c for c in out if c in ta and c in tb]
    rows = [c for c in out if c in ta and c not in tb]
    cols = [c for c in out if c in tb and c not in ta]
    inner = [c for c in ta if c in tb and c not in out]
    summed = [c for c in ta if c not in tb and c not in out]  # summed within the left operand
    if any(c not in out and c not in ta for c in tb):
        raise Refused("a letter of the right einsum operand is summed within it (not a product of the two)")
    if summed:  # summed out of the left operand first, as torch.einsum does: the same roundings in any dtype
        dims = [ta.index(c) for c in summed]
        a = call(graph, torch.sum, a, dims[0] if len(dims) == 1 else dims, anchor=node)
        ta = "".join(c for c in ta if c not in summed)
        where.update({c: (a, ta.index(c)) for c in ta})
    rows_all = rows

    def arranged(x: fx.Node, term: str, order: list[str]) -> fx.Node:
        perm = [term.index(c) for c in order]
        return x if perm == sorted(perm) else call(graph, torch.permute, x, perm, anchor=node)

    def matrix(x: fx.Node, first_group: list[str], second_group: list[str]) -> fx.Node:
        """[batch.., *first, *second] -> [batch.., prod first, prod second]."""
        lengths = (len(first_group), len(second_group))
        if lengths == (1, 1):
            return x
        if lengths == (0, 1):
            return call(graph, torch.unsqueeze, x, -2, anchor=node)
        if lengths == (1, 0):
            return call(graph, torch.unsqueeze, x, -1, anchor=node)
        nb, nf = len(batch), len(first_group)
        shape = [letter_size(c) for c in batch] + [
            size_product(graph, x, range(nb, nb + nf), node),
            size_product(graph, x, range(nb + nf, nb + nf + len(second_group)), node)]
        return call(graph, torch.reshape, x, shape, anchor=node)

    if not batch and len(inner) == 1 and len(cols) == 1 and rows_all:
        # a matrix on the right ([K, N]): matmul broadcasts it over the left operand's rows, kept as dims
        left = arranged(a, ta, rows_all + inner)
        unflattened = None
        if op_name(left) == "unflatten" and isinstance(first(left), fx.Node):
            dim, sizes = arg(left, 1, "dim"), arg(left, 2, "sizes")
            if isinstance(dim, int) and dim % len(rows_all + inner) + len(sizes) < len(rows_all):
                unflattened, left = (dim, sizes), first(left)  # unflatten a leading dim after the product
        right = arranged(b, tb, inner + cols)
        product = call(graph, torch.matmul, left, right, anchor=node)  # [rows.., N]
        if unflattened is not None:
            product = call(graph, torch.unflatten, product, *unflattened, anchor=node)
        natural = rows_all + cols
    else:
        left = matrix(arranged(a, ta, batch + rows_all + inner), rows_all, inner)  # [batch.., M, K]
        if cols and inner and tb.index(cols[0]) < tb.index(inner[0]):  # the right operand holds N before K
            right = matrix(arranged(b, tb, batch + cols + inner), cols, inner)
            right = call(graph, torch.transpose, right, -1, -2, anchor=node)
        else:
            right = matrix(arranged(b, tb, batch + inner + cols), inner, cols)  # [batch.., K, N]
        product = call(graph, torch.matmul, left, right, anchor=node)  # [batch.., M, N]
        natural = batch + rows_all + cols
        lengths = (len(rows_all), len(cols))
        if lengths == (0, 1):
            product = call(graph, torch.squeeze, product, -2, anchor=node)
        elif lengths == (1, 0):
            product = call(graph, torch.squeeze, product, -1, anchor=node)
        elif lengths != (1, 1):
            product = call(graph, torch.reshape, product, [letter_size(c) for c in natural], anchor=node)
    result = arranged(product, "".join(natural), list(out))
    node.replace_all_uses_with(result)
    erase_replaced(graph, [node], [])  # and a view of the left operand the product no longer reads
    if summed:
        return (f"einsum: {equation!r} -> a sum over {''.join(summed)} of the left operand, then matmul "
                "(torch.einsum's order)")
    return f"einsum: {equation!r} -> matmul"


# --- grouped 5-D heads ------------------------------------------------------------------------------


def einsum_terms(node: fx.Node) -> tuple[list[str], str, list[fx.Node]] | None:
    """(operand terms, output term, operands) of a two-operand einsum of tensors, or None."""
    if op_name(node) != "einsum" or node.op != "call_function" or not node.args or not isinstance(node.args[0], str):
        return None
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    shapes = [shape_of(x) for x in operands]
    if len(operands) != 2 or None in shapes:
        return None
    try:
        terms, out = parse_equation(node.args[0], [len(x) for x in shapes])
    except Refused:
        return None
    return terms, out, operands


def group_letters(terms: list[str], out: str) -> tuple[str, str] | None:
    """(g, h) of a grouped product: g a letter of both operands and the output, followed in the
    output by h, a letter of the first operand and the output only (the query heads of group g).
    The output's first letter is the batch, never a group."""
    (a, b) = terms
    pairs = [(g, h) for g, h in itertools.pairwise(out[1:]) if g in a and g in b and h in a and h not in b]
    return pairs[0] if len(pairs) == 1 else None


class GroupedHeads:
    """The `grouped_heads` rule: attention over 5-D grouped queries q [.., G, h, ..] against K/V
    [.., G, ..] shared by the h heads of a group (two einsums with the masks, scale, casts and
    softmax between them) is written on 4-D heads [B, G * h, S, ..]: q with (G, h) flattened, K and
    V repeat_interleave(h) on their group dim, every mask and operand between them reshaped the
    same way, and the output brought back to 5-D. Each score, probability and output element is
    the same number (head g * h + r is query head r of group g, as repeat_interleave pairs them).
    The 4-D tensors put the heads right after the batch dim and the queries next (the layout the
    passes read), whatever order the 5-D ones had. Tensors of the region used elsewhere are given
    back in their 5-D layout."""

    def __call__(self, graph: fx.Graph, softmax: fx.Node) -> str | None:
        if op_name(softmax) != "softmax" or value(softmax) is None or value(softmax).dim() != 5:
            return None
        chain, node = [], first(softmax)
        while isinstance(node, fx.Node) and op_name(node) != "einsum":
            step = read_step(node) if node.op in ("call_function", "call_method") else None
            if step is None:
                return None
            chain.append(step)
            node = step.source
        found = einsum_terms(node) if isinstance(node, fx.Node) else None
        if found is None:
            return None
        (ta, tb), out, (q, k) = found
        letters = group_letters([ta, tb], out)
        if letters is None:
            return None
        g, h = letters
        pos = out.index(g)  # the (G, h) dims of the 5-D scores and probabilities
        product, post, node = node, [], softmax
        while True:
            products = [u for u in node.users if self.grouped_product(u, node, pos)]
            if len(products) == 1:
                second = products[0]
                break
            nxt = [u for u in node.users if cast_dtype(u) is not None or zeroing_of(u, node) is not None]
            if not products and len(nxt) > 1:  # casts for other readers too (autocast casts p for each matmul)
                leading = [u for u in nxt if cast_dtype(u) is not None
                           and any(self.grouped_product(w, u, pos) for w in u.users)]
                nxt = leading if len(leading) == 1 else nxt
            if products or len(nxt) != 1:
                raise Refused(not_attention(softmax, chain))
            post.append(nxt[0])
            node = nxt[0]
        (tp, tv), out2, (_, v) = einsum_terms(second)
        g2, h2 = group_letters([tp, tv], out2)
        if ta.index(h) != ta.index(g) + 1:
            raise Refused("the grouped queries do not hold their heads right after their group dim")
        for step in chain:  # heads share their group's mask; queries do not
            mask = step.mask if step.kind == "mask" else step.bias
            shape = shape_of(mask) if isinstance(mask, fx.Node) else None
            if shape is not None and len(shape) >= len(out) - pos - 1 and not same(shape[pos + 1 - len(out)], 1):
                raise Refused(f"the mask {mask.name} varies along '{h}', so '{h}' holds queries, not the heads of group "
                              f"'{g}' (e.g. bucketed local attention: windows of queries against their keys); kept 5-D "
                              "(4-D heads would copy K and V once per query)")
        region = [s.node for s in reversed(chain)] + [softmax, *post]
        zeros = {a for p_node in post if op_name(p_node) == "where" for a in p_node.args[1:] if is_zero(a)}
        order = {n: i for i, n in enumerate(graph.nodes)}
        early = [u for n in [product, *region] for u in n.users
                 if u not in region and u is not second and u not in zeros and order[u] < order[second]]
        if early:
            raise Refused(f"{early[0].name} reads the grouped chain before p @ v (not rewritten)")
        G, heads = shape_of(q)[ta.index(g)], shape_of(q)[ta.index(h)]  # ints, or SymInts (e.g. blocks as groups)
        fresh = next(c for c in string.ascii_uppercase if c not in ta + tb + out + tp + tv + out2)
        merged = out.replace(g + h, fresh)  # the 4-D scores with the heads where the group was
        layout = heads_first(merged, fresh)  # ... and in the order the passes read
        anchor = second
        # G, h and G * h as view (and repeat) arguments: ints, or sym_size nodes of q where symbolic
        G_arg, h_arg = (size_of(graph, q, ta.index(c), anchor) for c in (g, h))
        GH_arg = size_product(graph, q, (ta.index(g), ta.index(h)), anchor)

        def heads_of(x):
            """An operand of the 5-D chain (it broadcasts against `out`) in the 4-D `layout`. Its
            sizes other than the group and head dims enter views as ints or sym_size nodes."""
            shape = shape_of(x)
            if shape is None:
                raise Refused("an operand of the grouped chain is not a tensor")
            pad = 5 - len(shape)
            grouped = [1] * pad + list(shape)  # x as 5-D
            ones = all(same(a, 1) for a in grouped[pos : pos + 2])
            if not ones and not all(same(a, b) for a, b in zip(grouped[pos : pos + 2], (G, heads))):
                if not all(same(a, 1) or same(a, b) for a, b in zip(grouped[pos : pos + 2], (G, heads))):
                    raise Refused("an operand of the grouped chain does not broadcast over the group and head dims")
                if pad:
                    x = call(graph, torch.reshape, x, [1] * pad + dims_of(graph, x, anchor), anchor=anchor)
                    pad = 0
                sizes = [-1] * 5
                sizes[pos : pos + 2] = (G_arg, h_arg)
                x = call(graph, torch.Tensor.expand, x, sizes, anchor=anchor)
            if len(shape) <= 5 - pos - 2 and layout == merged:
                return x  # it does not reach the group and head dims, and the layout is kept
            full = [1] * pad + dims_of(graph, x, anchor)  # x's sizes as 5-D view arguments
            four = full[:pos] + [1 if ones else GH_arg] + full[pos + 2:]
            x = call(graph, torch.reshape, x, four, anchor=anchor)
            perm = [merged.index(c) for c in layout]
            return x if perm == sorted(perm) else call(graph, torch.permute, x, perm, anchor=anchor)

        qa = call(graph, torch.flatten, q, ta.index(g), ta.index(h), anchor=anchor)
        ka = call(graph, torch.repeat_interleave, k, h_arg, tb.index(g), anchor=anchor)
        x = call(graph, torch.functional.einsum, f"{ta.replace(g + h, fresh)},{tb.replace(g, fresh)}->{layout}",
                 qa, ka, anchor=anchor)
        replaced = {product: x}
        for step in reversed(chain):
            replaced[step.node] = x = recreate(graph, step.node, step.source, x, heads_of, anchor)
        replaced[softmax] = x = recreate(graph, softmax, first(softmax), x, heads_of, anchor)
        before = softmax
        for p_node in post:
            source = first(p_node) if cast_dtype(p_node) is not None else zeroing_of(p_node, before).target
            replaced[p_node] = x = recreate(graph, p_node, source, x, heads_of, anchor)
            before = p_node
        # p @ v on the 4-D probabilities: their letters are E2's names for E1's output dims
        rename = dict(zip(out, tp))
        p_layout = "".join(fresh if c == fresh else rename[c] for c in layout)
        va = call(graph, torch.repeat_interleave, v, h_arg, tv.index(g2), anchor=anchor)
        o_layout = heads_first(out2.replace(g2 + h2, fresh), fresh)
        o4 = call(graph, torch.functional.einsum, f"{p_layout},{tv.replace(g2, fresh)}->{o_layout}", x, va,
                  anchor=anchor)
        o5 = call(graph, torch.unflatten, o4, o_layout.index(fresh), (G_arg, h_arg), anchor=anchor)
        five = o_layout.replace(fresh, g2 + h2)
        perm = [five.index(c) for c in out2]
        if perm != sorted(perm):
            o5 = call(graph, torch.permute, o5, perm, anchor=anchor)
        second.replace_all_uses_with(o5)
        back_perm = [layout.replace(fresh, g + h).index(c) for c in out]
        for old in reversed([product, *region]):  # users outside the region get the 5-D layout back
            outside = [u for u in old.users if u is not second and u not in region]
            if outside:
                back = call(graph, torch.unflatten, replaced[old], layout.index(fresh), (G_arg, h_arg), anchor=anchor)
                if back_perm != sorted(back_perm):
                    back = call(graph, torch.permute, back, back_perm, anchor=anchor)
                for user in outside:
                    user.replace_input_with(old, back)
        erase_replaced(graph, [second, *reversed(region), product], [])
        return f"grouped_heads: 5-D grouped attention [.., G, h, ..] -> heads G * h with repeat_interleave({heads}) K/V"

    @staticmethod
    def grouped_product(node: fx.Node, p: fx.Node, pos: int) -> bool:
        """node is an einsum of p (first) with a tensor shared by the heads of each group, over p's
        group and head dims at pos, pos + 1."""
        found = einsum_terms(node)
        if found is None or found[2][0] is not p:
            return False
        (tp, tv), out, _ = found
        letters = group_letters([tp, tv], out)
        return letters is not None and (tp.index(letters[0]), tp.index(letters[1])) == (pos, pos + 1)


def feeds_topk(node: fx.Node, limit: int = 200) -> bool:
    """Whether a torch.topk reads `node`'s value through the nodes after it (up to `limit` nodes)."""
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if op_name(n) == "topk":
            return True
        stack.extend(n.users)
    return False


def not_attention(softmax: fx.Node, chain: list[Step]) -> str:
    """The grouped_heads refusal for probabilities that are not multiplied by V once. Where they
    are an unmasked softmax (no mask step between the score einsum and it: every key, later ones
    included) read by a top-k, they are a block choice's scores that read later tokens."""
    if feeds_topk(softmax) and not any(step.kind == "mask" for step in chain):
        return ("the grouped probabilities are not multiplied by V: a softmax over scores with no mask (every key, "
                "later tokens included) feeding a top-k: block scores that read later tokens (non-causal), left to "
                "select_blocks (its rule 'nsa_vibe')")
    return "the grouped probabilities are not multiplied by V once (p @ v as an einsum over the same group and head dims)"


def heads_first(term: str, heads: str) -> str:
    """A 4-D term with the heads letter moved right after the first (batch) letter."""
    rest = [c for c in term if c != heads]
    return rest[0] + heads + "".join(rest[1:])


def recreate(graph: fx.Graph, node: fx.Node, old_input: fx.Node, new_input: fx.Node, convert, anchor: fx.Node):
    """The op of `node` again on `new_input` in place of `old_input`, its other tensor operands
    passed through `convert` (the zeros of a where(rows, p, zeros_like(p)) as the number 0)."""
    def swap(i, x):
        if x is old_input:
            return new_input
        if op_name(node) == "where" and i and is_zero(x):
            return 0.0
        return convert(x) if isinstance(x, fx.Node) else x

    args = [swap(i, a) for i, a in enumerate(node.args)]
    kwargs = {key: swap(-1, a) for key, a in node.kwargs.items()}
    target = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    return call(graph, target, *args, anchor=anchor, **kwargs)


# --- the score chain ----------------------------------------------------------------------------


@dataclass
class Step:
    """One step between the score product and the softmax."""

    node: fx.Node
    kind: str  # "cast", "scale" or "mask"
    source: fx.Node  # the scores it reads
    dtype: torch.dtype | None = None  # cast: the dtype it makes
    scale: float | None = None
    mask: fx.Node | None = None  # mask: the bool tensor
    fill_where_true: bool = True  # mask: the fill applies where `mask` is True
    fill: float | None = None  # mask: the fill, as the softmax sees it (None for a bias, until evaluated)
    bias: fx.Node | None = None  # an additive bias (its mask is found by evaluating it)


@dataclass
class Chain:
    """The steps from the score product to the softmax (read by `read_chain`)."""

    softmax: fx.Node
    product: fx.Node  # the score matmul (or its squeeze, `is_product`)
    steps: list[Step]  # product side first
    compute: torch.dtype  # the dtype the softmax computes in
    softmax_dtype: torch.dtype | None  # its dtype argument
    scale: float | None = None
    scale_before_cast: bool = False

    @property
    def masks(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "mask"]


def softmax_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype argument of a softmax call (function, F.softmax or method)."""
    if "dtype" in node.kwargs:
        return node.kwargs["dtype"]
    index = 3 if node.op == "call_function" and node.target is F.softmax else 2
    return node.args[index] if len(node.args) > index else None


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a float -> float cast makes (float(), to(dtype), type_as(t), bfloat16(), ...)."""
    if op_name(node) not in ("float", "double", "half", "bfloat16", "to", "type", "type_as"):
        return None
    src, out = value(first(node)), value(node)
    if src is None or out is None or not src.is_floating_point() or not out.is_floating_point():
        return None
    if src.device != out.device:
        return None
    return out.dtype


def scale_of(node: fx.Node, x: fx.Node) -> float | None:
    """c when `node` is x * c, c * x or x / c with a python number c; None otherwise."""
    name = cmp.name_of(node)
    a, b = (node.args + (None, None))[:2]
    if node.kwargs or len(node.args) != 2:
        return None
    if name == "mul" and a is x and is_number(b):
        return float(b)
    if name == "mul" and b is x and is_number(a):
        return float(a)
    if name in ("truediv", "div") and a is x and is_number(b) and b != 0:
        return 1.0 / float(b)
    return None


def reads_data(node: fx.Node) -> bool:
    """Whether a node depends on a graph input (data or a parameter), not positions only. Sizes
    (a graph's SymInt inputs and what is computed from them) are not data: probes give them numbers."""
    return any((n.op == "placeholder" and not is_size(n)) or n.op == "get_attr"
               for n in ancestors([node], into_sizes=False))


# Ops whose result is a new tensor (never a view or the input itself, as `.float()` of a float32
# tensor is): an in-place op on such a result that no one else reads is the out-of-place op.
_FRESH = {"mul", "add", "sub", "truediv", "div", "matmul", "bmm", "baddbmm", "einsum", "masked_fill", "where"}


def in_place_is_fresh(node: fx.Node) -> bool:
    """`node` is an in-place op (x.masked_fill_(m, f)) on an x that a fresh-result op computed
    (`_FRESH`: no view, no graph input, no alias) and that only `node` reads: no one sees x before
    or after the change, so the out-of-place op (x.masked_fill(m, f), a new tensor of x's shape:
    the in-place op only runs where m broadcasts to x) computes the same."""
    x = first(node)
    return (isinstance(x, fx.Node) and x.op in ("call_function", "call_method")
            and cmp.name_of(x) in _FRESH and list(x.users) == [node])


def read_through_write(x: fx.Node) -> fx.Node:
    """x, or the in-place mask written into it: where x is fresh (`_FRESH`) and its first user is
    its only write, `w = x.masked_fill_(m, f)` (the statement form `s.masked_fill_(m, f)`, whose
    result nothing names), every later reader of x reads the tensor w returns (x itself, changed):
    they are made to read w, which the graph then shows as the dataflow (the same values). Then
    `in_place_is_fresh(w)` holds where w's result has one reader."""
    if not (x.op in ("call_function", "call_method") and cmp.name_of(x) in _FRESH):
        return x
    order = {n: i for i, n in enumerate(x.graph.nodes)}
    users = sorted(x.users, key=order.__getitem__)
    writes = [u for u in users if (op_name(u) or "").endswith("_") and not (op_name(u) or "").startswith("_")
              or u.op == "call_function" and u.target is operator.setitem]
    if len(users) < 2 or len(writes) != 1 or users[0] is not writes[0] or op_name(writes[0]) != "masked_fill_" \
            or first(writes[0]) is not x:
        return x
    for user in users[1:]:
        user.replace_input_with(x, writes[0])
    return writes[0]


def read_step(node: fx.Node) -> Step | None:
    """The chain step `node` is, or None (then it is not part of a score chain)."""
    name = cmp.name_of(node)
    x = first(node)
    dtype = cast_dtype(node)
    if dtype is not None and isinstance(x, fx.Node):
        return Step(node, "cast", x, dtype=dtype)
    for operand in node.args[:2]:
        if isinstance(operand, fx.Node) and (c := scale_of(node, operand)) is not None:
            return Step(node, "scale", operand, scale=c)
    if (name == "masked_fill" or name == "masked_fill_" and in_place_is_fresh(node)) and isinstance(x, fx.Node):
        mask, fill = arg(node, 1, "mask"), arg(node, 2, "value")
        if isinstance(mask, fx.Node) and is_number(fill):
            return Step(node, "mask", x, mask=mask, fill_where_true=True, fill=float(fill))
        return None
    if name == "where" and len(node.args) == 3 and not node.kwargs and isinstance(node.args[0], fx.Node):
        cond, a, b = node.args
        if isinstance(a, fx.Node) and is_number(b):
            return Step(node, "mask", a, mask=cond, fill_where_true=False, fill=float(b))
        if isinstance(b, fx.Node) and is_number(a):
            return Step(node, "mask", b, mask=cond, fill_where_true=True, fill=float(a))
        return None
    if name == "add" and len(node.args) == 2 and not node.kwargs and all(isinstance(n, fx.Node) for n in node.args):
        a, b = node.args
        # the bias is the operand computed from positions only; the scores read q and k
        sides = [(s, t) for s, t in ((a, b), (b, a)) if reads_data(s) and not reads_data(t)]
        if len(sides) == 1 and value(sides[0][1]) is not None and value(sides[0][1]).is_floating_point():
            scores, bias = sides[0]
            return Step(node, "mask", scores, bias=bias)
    return None


def is_product(node: fx.Node) -> bool:
    """A matmul, or the per-query product of the selected branch (q.unsqueeze(-2) @ k^T).squeeze(-2)."""
    if op_name(node) in MATMULS:
        return True
    source, dim, val = first(node), arg(node, 1, "dim"), value(node)
    return (op_name(node) == "squeeze" and isinstance(source, fx.Node) and op_name(source) in MATMULS
            and len(source.users) == 1 and val is not None and isinstance(dim, int)
            and dim % (val.dim() + 1) == val.dim() - 1)


def read_chain(softmax: fx.Node) -> Chain | None:
    """The score chain ending at `softmax` (a softmax over the last dim of a matmul's result
    through casts, scales and masks, each used once), or None where it is not one."""
    dim, x, probs = arg(softmax, 1, "dim"), first(softmax), value(softmax)
    if probs is None or not isinstance(x, fx.Node) or not isinstance(dim, int) or probs.dim() < 2 \
            or dim % probs.dim() != probs.dim() - 1:
        return None
    steps, node = [], read_through_write(x)
    while node.op in ("call_function", "call_method") and not is_product(node):
        step = read_step(node) if len(node.users) == 1 else None
        if step is None:
            return None
        steps.append(step)
        node = read_through_write(step.source)
    if not is_product(node) or value(node) is None or not value(node).is_floating_point():
        return None
    if any(first(u) is node and ((op_name(u) or "").endswith("_") and not (op_name(u) or "").startswith("_")
                                 or u.op == "call_function" and u.target is operator.setitem) for u in node.users):
        return None  # the product is changed in place (`s.mul_(c)`, `s[..] = ..`): the chain does not show it
    dtype = softmax_dtype(softmax)
    return Chain(softmax, node, steps[::-1], dtype if dtype is not None else value(x).dtype, dtype)


def precision(dtype: torch.dtype) -> int:
    """Orders float dtypes by what they hold (bf16 and fp16 differ in range, not ordered)."""
    return {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}.get(dtype, 0)


def resolve(chain: Chain) -> None:
    """Fills in what the softmax sees of each step (fills after the casts and scales that follow,
    the scale and whether it came before the cast), or Refused for a chain with no normal form."""
    current = value(chain.product).dtype
    pending = []  # masks read so far: a scale after them scales their fill
    for step in chain.steps:
        if step.kind == "cast":
            if precision(step.dtype) < precision(current) or (precision(step.dtype) == precision(current)
                                                               and step.dtype != current):
                raise Refused(f"the scores are cast from {current} to {step.dtype} before the softmax")
            current = step.dtype
        elif step.kind == "scale":
            if chain.scale is not None:
                raise Refused("the scores are scaled twice (one constant scale is read)")
            if step.scale <= 0:
                raise Refused(f"the scores are scaled by {step.scale}, not a positive number")
            chain.scale = step.scale
            chain.scale_before_cast = current != chain.compute
            for mask in pending:
                mask.fill = None if mask.fill is None else mask.fill * step.scale
        else:
            if step.fill is not None:
                step.fill = float(torch.tensor(step.fill, dtype=current, device="cpu"))  # as this dtype stores it
            pending.append(step)
    if chain.compute != current and precision(chain.compute) <= precision(current):
        raise Refused(f"the softmax computes in {chain.compute} on {current} scores")
    for step in chain.masks:
        if step.fill is not None and step.fill != 0.0 and not step.fill <= LARGE_NEGATIVE:
            raise Refused(f"the scores are filled with {step.fill} (not -inf, 0 or a large negative <= "
                          f"{LARGE_NEGATIVE:g}): a mask that only shifts scores")


def is_normal(chain: Chain, finite_ok: bool = False) -> bool:
    """The chain is already in the normal form (nothing to rewrite); with `finite_ok`, but for
    large negative fills in place of -inf."""
    if chain.softmax_dtype is not None:
        return False
    kinds = []
    for step in chain.steps:
        if (op_name(step.node) or "").endswith("_"):
            return False  # an in-place mask (`in_place_is_fresh`): written out of place
        if step.kind == "cast":
            kinds.append("cast")
        elif step.kind == "scale":
            kinds.append("scale")
        elif finite_ok and step.bias is None and step.fill is not None and step.fill <= LARGE_NEGATIVE:
            kinds.append("inf")
        elif step.bias is not None or (step.fill != 0.0 and step.fill != -INF):
            return False
        elif step.fill == -INF and step.fill_where_true and cmp.name_of(step.node) == "where":
            return False  # where(drop, -inf, x): the window pass reads masked_fill or where(keep, x, -inf)
        else:
            kinds.append("inf" if step.fill == -INF else "zero")
    order = "".join({"cast": "a", "scale": "b", "inf": "c", "zero": "d"}[k] for k in kinds)
    return order == "".join(sorted(order)) and order.count("a") <= 1 and order.count("c") <= 1


@dataclass
class MaskValues:
    """Masks of a chain evaluated at compile time (bool, broadcast to one shape)."""

    keep: torch.Tensor  # True where no large-negative mask or -inf bias hides the key
    overwritten: torch.Tensor  # True where a zero fill after them rewrites the entry


def mask_values(chain: Chain, subgraphs: cmp.PositionSubgraphs) -> MaskValues:
    """Evaluate the chain's masks (positions only) and its biases (values 0 and one fill: the
    same one at every probe size, where a bias's fill is already read)."""
    keeps, overwritten = [], []
    for step in chain.masks:
        if step.bias is not None:
            bias = subgraphs.evaluate(step.bias, "additive mask")
            fills = bias.unique()
            fills = fills[fills != 0]
            if len(fills) > 1:
                raise Refused(f"the additive mask holds {len(fills)} values besides 0 (not one fill): it shifts scores")
            if len(fills):  # (none: the bias hides no key at these sizes)
                fill = float(fills[0])
                if not fill <= LARGE_NEGATIVE:
                    raise Refused(f"the additive mask adds {fill} (not -inf or a large negative <= {LARGE_NEGATIVE:g})")
                if step.fill is not None and step.fill != fill:
                    raise Refused(f"the additive mask adds {step.fill:g} at one size and {fill:g} at another")
                step.fill = fill
            keeps.append(bias == 0)
            continue
        got = subgraphs.evaluate(step.mask, "mask")
        if got.dtype != torch.bool:
            raise Refused(f"the mask is {got.dtype}, not bool")
        filled = got if step.fill_where_true else ~got
        if step.fill == 0.0:
            overwritten.append(filled)
        else:
            keeps.append(~filled)
    shape = torch.broadcast_shapes(*(t.shape for t in keeps + overwritten))
    device = (keeps + overwritten)[0].device if keeps + overwritten else "cpu"  # the graph's (CUDA on a GPU)
    keep = torch.ones(shape, dtype=torch.bool, device=device)
    for k in keeps:
        keep = keep & k
    over = torch.zeros(shape, dtype=torch.bool, device=device)
    for o in overwritten:
        over = over | o
    return MaskValues(keep, over)


class ScoreChains:
    """The `scores` rule (module docstring), one softmax at a time."""

    def __init__(self, masks: ProbeMasks):
        self.masks = masks

    def __call__(self, graph: fx.Graph, softmax: fx.Node) -> str | None:
        if op_name(softmax) != "softmax":
            return None
        chain = read_chain(softmax)
        if chain is None or is_normal(chain):
            return None
        resolve(chain)
        notes = []
        finite = [s for s in chain.masks if s.fill is not None and s.fill not in (0.0, -INF)]
        biases = [s for s in chain.masks if s.bias is not None]
        kept = None  # why the finite fills stay finite
        if finite or biases:
            try:  # fills the biases' fill (the same at every probe)
                per_probe = self.masks.each(lambda at: (at, mask_values(chain, at)))
            except Refused as why:
                if biases or not finite:
                    raise
                per_probe, kept = None, f"its mask is not from positions only ({why})"
            for step in biases:
                step.fill = -INF if step.fill is None else step.fill  # a bias of zeros: -inf hides nothing either
            finite = [s for s in chain.masks if s.fill not in (0.0, -INF)]
            if per_probe is not None and finite:
                zero = row_zeroing(softmax)

                def every_row_safe(at, values) -> bool:
                    safe = (values.keep | values.overwritten).any(-1)
                    if not bool(safe.all()) and zero is not None and zero.empty is not None:
                        # rows zeroed after the softmax (not nan_to_num)
                        rows = at.evaluate(zero.empty, "zeroing mask")[..., 0]
                        safe = safe | (rows if zero.empty_where_true else ~rows)
                        zero.node.meta[FINITE_ROWS] = True  # empty_rows: these rows were finite in eager
                    return bool(safe.all())

                values_of = dict(per_probe)
                safe = self.masks.each(lambda at: every_row_safe(at, values_of[at]))
                if not all(safe):
                    at = next(at for at, ok in zip(self.masks.evaluators, safe) if not ok)
                    where = f" (at the probe sizes {at.sizes.describe()})" if at.sizes.symbolic else ""
                    kept = (f"a row can be fully masked{where}: with the finite fill it gets the uniform average of "
                            "its keys, with -inf NaN")
            fills = ", ".join(f"{s.fill:g}" for s in finite)
            if kept is not None:
                if is_normal(chain, finite_ok=True):
                    raise Refused(f"finite fill {fills} not rewritten: {kept}")
                notes.append(f"finite fill {fills} kept ({kept})")
            elif finite:
                for step in finite:
                    step.fill = -INF
                notes.append(f"finite fill {fills} -> -inf (every row keeps a key)")
            if biases:
                notes.append("additive mask -> masked_fill")
        if chain.softmax_dtype is not None:
            notes.append(f"softmax dtype={chain.softmax_dtype} -> cast first")
        if any((op_name(s.node) or "").endswith("_") for s in chain.steps):
            notes.append("in-place masked_fill_ -> masked_fill (its input has no other reader)")
        low = value(chain.product).dtype
        if chain.scale is not None and chain.scale_before_cast:
            exact = math.frexp(chain.scale)[0] == 0.5
            notes.append(f"scale {chain.scale:g} moved after the cast to {chain.compute}" +
                         ("" if exact else f" (eager rounds s * c to {low} once more)"))
        self.rewrite(graph, chain)
        if not notes:
            notes.append("reordered to cast, scale, masks")
        return "scores: " + "; ".join(notes)

    @staticmethod
    def rewrite(graph: fx.Graph, chain: Chain) -> None:
        softmax = chain.softmax
        x = chain.product
        if value(x).dtype != chain.compute:
            x = call(graph, torch.Tensor.to, x, chain.compute, anchor=softmax)
        if chain.scale is not None:
            x = call(graph, operator.mul, x, chain.scale, anchor=softmax)
        run = []  # drop masks of adjacent -inf masks, merged into one masked_fill

        def flush(x):
            if not run:
                return x
            drop = run[0]
            for other in run[1:]:
                drop = call(graph, operator.or_, drop, other, anchor=softmax)
            run.clear()
            return call(graph, torch.masked_fill, x, drop, -INF, anchor=softmax)

        for step in chain.masks:
            if step.bias is not None:
                drop = call(graph, torch.ne, step.bias, 0, anchor=softmax)
            elif step.fill_where_true:
                drop = step.mask
            else:
                drop = call(graph, operator.invert, step.mask, anchor=softmax)
            if step.fill == -INF:
                run.append(drop)
            else:  # a zero fill, or a finite fill that stays
                x = flush(x)
                x = call(graph, torch.masked_fill, x, drop, step.fill, anchor=softmax)
        x = flush(x)
        new = call(graph, torch.softmax, x, arg(softmax, 1, "dim"), anchor=softmax)
        softmax.replace_all_uses_with(new)
        erase_replaced(graph, [softmax, *reversed([s.node for s in chain.steps])], [])


# --- empty rows after the softmax ----------------------------------------------------------------


def is_zero(x) -> bool:
    """The constant 0, or a tensor of zeros made in the graph (zeros_like, new_zeros, zeros)."""
    if is_number(x):
        return float(x) == 0.0
    if not isinstance(x, fx.Node):
        return False
    name = op_name(x)
    if name in ("zeros_like", "new_zeros", "zeros"):
        return True
    fill = arg(x, 1, "fill_value")
    return name in ("full_like", "new_full") and is_number(fill) and float(fill) == 0


@dataclass
class RowZeroing:
    """Rows set to 0 after a softmax: `node` zeroes `target` (the probabilities, a cast of them, or
    the output p @ v) where `empty` [.., S, 1] is True; `empty` None for nan_to_num (the rows whose
    probabilities are NaN, i.e. whose scores are all -inf)."""

    node: fx.Node
    target: fx.Node
    empty: fx.Node | None
    empty_where_true: bool  # False: `empty` holds the rows that are kept (where(has_key, p, 0))


def zeroing_of(node: fx.Node, target: fx.Node) -> RowZeroing | None:
    """The row zeroing `node` applies to `target`, or None."""
    name = op_name(node)
    if name == "nan_to_num" and first(node) is target:
        nan = arg(node, 1, "nan", 0.0)
        if is_number(nan) and float(nan) == 0.0 and arg(node, 2, "posinf") is None and arg(node, 3, "neginf") is None:
            return RowZeroing(node, target, None, True)
        return None
    if name == "masked_fill" and first(node) is target and is_zero(arg(node, 2, "value")):
        mask = arg(node, 1, "mask")
        return RowZeroing(node, target, mask, True) if isinstance(mask, fx.Node) else None
    if name == "where" and len(node.args) == 3 and not node.kwargs and isinstance(node.args[0], fx.Node):
        cond, a, b = node.args
        if a is target and is_zero(b):
            return RowZeroing(node, target, cond, False)
        if b is target and is_zero(a):
            return RowZeroing(node, target, cond, True)
    return None


def row_zeroing(softmax: fx.Node) -> RowZeroing | None:
    """The zeroing of rows after `softmax`: of the probabilities (through casts) or of the output
    p @ v that is the probabilities' only use; None where there is none. Per row: `empty` must
    have a last dim of 1."""
    node = softmax
    for _ in range(4):
        users = [u for u in node.users if not (is_zero(u) and first(u) is node)]  # zeros_like(p): a shape
        if len(users) != 1:
            return None
        user = users[0]
        found = zeroing_of(user, node)
        if found is not None:
            shape = shape_of(found.empty) if found.empty is not None else (1,)
            return found if shape and same(shape[-1], 1) else None
        if cast_dtype(user) is not None or (op_name(user) in MATMULS and user.args[0] is node):
            node = user
            continue
        return None
    return None


def in_place_step(softmax: fx.Node, depth: int = 8) -> fx.Node | None:
    """The first in-place op (masked_fill_, mul_, ...) on the softmax's input chain (its first
    operands, up to `depth` nodes back), or None."""
    node = first(softmax)
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            return None
        name = op_name(node) or ""
        if name.endswith("_") and not name.startswith("_"):
            return node
        writes = [u for u in node.users if (op_name(u) or "").endswith("_") and not (op_name(u) or "").startswith("_")
                  and first(u) is node]
        if writes:  # written in place by a statement (`s.masked_fill_(m, f)`), or through a view of it
            return writes[0]
        node = first(node)
    return None


def hoist(node: fx.Node, anchor: fx.Node) -> None:
    """Move `node` and the inputs it needs before `anchor` where they come after it (pure ops
    only: Refused for in-place ops and graph inputs, which cannot move)."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    if order[node] < order[anchor]:
        return
    if node.op not in ("call_function", "call_method") or (op_name(node) or "").endswith("_"):
        raise Refused(f"{node.name} is computed after the softmax and cannot move before it")
    for x in node.all_input_nodes:
        hoist(x, anchor)
    anchor.prepend(node)


class EmptyRows:
    """The `empty_rows` rule (module docstring), one softmax at a time."""

    def __init__(self, masks: ProbeMasks):
        self.masks = masks

    def __call__(self, graph: fx.Graph, softmax: fx.Node) -> str | None:
        if op_name(softmax) != "softmax":
            return None
        zero = row_zeroing(softmax)
        if zero is None:
            return None
        chain = read_chain(softmax)
        if chain is not None and op_name(chain.product) == "squeeze" and zero.empty is None:
            return None  # per-query scores (selected branch): nan_to_num is the form selected_attention reads
        in_place = in_place_step(softmax) if chain is None else None
        if in_place is not None:
            raise Refused(f"rows are zeroed after the softmax, and the scores are masked in place ({in_place.name}: "
                          f"{op_name(in_place)}), which the score chain does not read (an out-of-place "
                          f"{op_name(in_place)[:-1]} is)")
        if chain is None or not is_normal(chain) or not chain.masks or chain.masks[-1].fill != -INF \
                or any(m.fill == -INF for m in chain.masks[:-1]):
            raise Refused("rows are zeroed after the softmax, but the scores are not masked with -inf last")
        last = chain.masks[-1]
        output = op_name(zero.target) in MATMULS
        where = "the output" if output else "the probabilities"

        def rows_at(at) -> tuple[bool, bool]:
            """(the zeroing hits a row, a row keeps no key) at one probe's sizes."""
            keep = at.evaluate(last.mask, "mask")
            keep = ~keep if last.fill_where_true else keep
            if zero.empty is None:
                hits = not bool(keep.any(-1).all())
            else:
                rows = at.evaluate(zero.empty, "zeroing mask")
                hits = bool((rows if zero.empty_where_true else ~rows).any())
            return hits, not bool(keep.any(-1).all())

        try:  # at any probe size
            hits, nan_rows = (any(found) for found in zip(*self.masks.each(rows_at)))
        except Refused:
            hits = nan_rows = True  # masks that read data: rows not known
        if output and nan_rows and not zero.node.meta.get(FINITE_ROWS):
            raise Refused("rows with no key are NaN until the output is zeroed: eager's backward is NaN there "
                          "(p^T @ grad_o with NaN rows of p), the rewritten one would not be")
        if not hits:
            zero.node.replace_all_uses_with(zero.target)
            erase_replaced(graph, [zero.node], [])
            return f"empty_rows: a zeroing of {where} that hits no row -> dropped"
        anchor = softmax
        if zero.empty is not None:
            hoist(zero.empty, anchor)  # the user may compute it after the softmax (it zeroes the output)
        drop = last.mask if last.fill_where_true else call(graph, operator.invert, last.mask, anchor=anchor)
        if zero.empty is None:  # nan_to_num: the rows that keep no key
            has_key = call(graph, torch.any, call(graph, operator.invert, drop, anchor=anchor), -1, keepdim=True,
                           anchor=anchor)
            empty = call(graph, operator.invert, has_key, anchor=anchor)
        elif zero.empty_where_true:
            empty = zero.empty
        else:
            empty = call(graph, operator.invert, zero.empty, anchor=anchor)
        drop = call(graph, operator.or_, drop, empty, anchor=anchor)  # the empty rows are overwritten below
        masked = call(graph, torch.masked_fill, last.source, drop, -INF, anchor=anchor)
        zeroed = call(graph, torch.masked_fill, masked, empty, 0.0, anchor=anchor)
        probs = call(graph, torch.softmax, zeroed, arg(softmax, 1, "dim"), anchor=anchor)
        out = call(graph, operator.mul, probs, call(graph, operator.invert, drop, anchor=anchor), anchor=anchor)
        zero.node.replace_all_uses_with(zero.target)  # first: the target may be the softmax itself
        softmax.replace_all_uses_with(out)
        erase_replaced(graph, [zero.node, softmax, last.node], [])
        if zero.empty is None:
            return f"empty_rows: nan_to_num of {where} -> zero fill before the softmax, * keep after (finite scores)"
        return f"empty_rows: zeroing of {where} per row -> zero fill before the softmax, * keep after"


# --- GQA copies ----------------------------------------------------------------------------------


def size_reads(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """(node, i) for each use of the tensor `node` that reads one of its sizes as a SymInt:
    x.size(i), sym_size(x, i), an item i of x.size() all of whose uses take one item."""
    reads = []
    for user in node.users:
        name, dim = op_name(user), arg(user, 1, "dim")
        if name in ("size", "sym_size.int") and isinstance(dim, int):
            reads.append((user, dim))
        elif name == "size" and dim is None and all(
                op_name(item) == "getitem" and isinstance(item.args[1], int) for item in user.users):
            reads += [(item, item.args[1]) for item in user.users]
    return [(read, i) for read, i in reads if is_size(read)]


def sizes_off_copies(graph: fx.Graph) -> None:
    """At symbolic sizes Dynamo reads sizes from tensors where a static graph holds numbers
    (`Tc = kc.shape[2]` of a K/V copy kc = x.repeat_interleave(h, 1)). Such reads of a copy read
    x's size instead (times h on the copied dim), so that the copy serves its products only and the
    rules and passes that remove copies see it as they do in a static graph. Not a rewrite of
    attention: no match."""
    for rep in list(graph.nodes):
        x, repeats, dim = first(rep), arg(rep, 1, "repeats"), arg(rep, 2, "dim")
        if (op_name(rep) != "repeat_interleave" or not isinstance(x, fx.Node) or value(x) is None
                or not isinstance(dim, int) or arg(rep, 3, "output_size") is not None
                or not (isinstance(repeats, int) or isinstance(repeats, fx.Node) and is_size(repeats))):
            continue
        rank, reads = value(x).dim(), size_reads(rep)
        for read, i in reads:
            n = value(x).shape[i % rank]
            # a size a guard fixed to one number is that number (a sym_size of it would be an int node)
            size = int(n) if is_concrete_int(n) else size_of(graph, x, i % rank, read)
            if i % rank == dim % rank:
                size = size * repeats if isinstance(size, int) and isinstance(repeats, int) else \
                    call(graph, operator.mul, size, repeats, anchor=read)
                if isinstance(size, fx.Node):
                    size.meta["example_value"] = value_or_int(read)  # the value of the size read it replaces
            for user in list(read.users):
                user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs),
                                                         lambda a, read=read, size=size: size if a is read else a)
        for read, _ in reads:
            erase_replaced(graph, [read], [])


def inserted_dim(node: fx.Node) -> int | None:
    """p when `node` inserts one size-1 dim at p: x.unsqueeze(p), or x[:, :, None] (full slices and
    one None, an Ellipsis only at the end)."""
    src = first(node)
    if not isinstance(src, fx.Node) or value(src) is None:
        return None
    rank = value(src).dim()
    if op_name(node) == "unsqueeze":
        dim = arg(node, 1, "dim")
        return dim % (rank + 1) if isinstance(dim, int) else None
    index = arg(node, 1, "index")
    if op_name(node) != "getitem" or not isinstance(index, tuple):
        return None
    if index and index[-1] is Ellipsis:
        index = index[:-1]
    if index.count(None) != 1 or any(i is not None and i != slice(None) for i in index):
        return None
    return index.index(None)


def merged_dims(node: fx.Node) -> int | None:
    """a when `node` (reshape / view / flatten) merges dims a and a + 1 of its input and keeps the rest."""
    if op_name(node) not in ("reshape", "view", "flatten"):
        return None
    before, after = shape_of(first(node)), shape_of(node)
    if before is None or after is None or len(after) != len(before) - 1:
        return None
    for a in range(len(after)):
        if same(before[:a], after[:a]) and same(before[a + 2:], after[a + 1:]) \
                and same(before[a] * before[a + 1], after[a]):
            return a
    return None


def copied_dim(node: fx.Node, p: int) -> int | None:
    """h when `node` (expand / repeat / broadcast_to) copies its input h times along the size-1 dim p
    and leaves every other dim as it is."""
    src = first(node)
    if op_name(node) not in ("expand", "repeat", "broadcast_to", "expand_as") or not isinstance(src, fx.Node):
        return None
    before, after = shape_of(src), shape_of(node)
    if before is None or after is None or len(before) != len(after) or not same(before[p], 1):
        return None
    if any(not same(b, a) for i, (b, a) in enumerate(zip(before, after)) if i != p):
        return None
    return after[p] if isinstance(after[p], int) else None  # a head count, not a symbolic size


def feeds_matmul(node: fx.Node, depth: int = 4) -> bool:
    """Whether `node` reaches a matmul through at most `depth` single-input layout ops (K/V)."""
    for user in node.users:
        if op_name(user) in MATMULS or op_name(user) == "einsum":
            return True
        if depth and op_name(user) in ("transpose", "permute", "swapaxes", "reshape", "view", "flatten",
                                       "contiguous", "to", "float", "unsqueeze") and feeds_matmul(user, depth - 1):
            return True
    return False


def gqa_copy(graph: fx.Graph, node: fx.Node) -> str | None:
    """The `gqa_expand` rule: a copy of K/V for the heads of a group -> repeat_interleave."""
    val = value(node)
    if val is None or not val.is_floating_point():
        return None
    if op_name(node) == "repeat" and node.op == "call_method":
        return tiled_repeat(graph, node)
    a = merged_dims(node)
    if a is None:
        return None
    copy = first(node)
    if not isinstance(copy, fx.Node) or len(copy.users) != 1:
        return None
    inserted = first(copy)
    if not isinstance(inserted, fx.Node) or len(inserted.users) != 1:
        return None
    p = inserted_dim(inserted)
    if p is None or p not in (a, a + 1):
        return None
    h = copied_dim(copy, p)
    if h is None:
        return None
    x = first(inserted)
    what = f"{op_name(inserted)} + {op_name(copy)} + {op_name(node)}"
    # [.., G, h, ..] merged: head g * h + r reads group g; [.., h, 1, ..]: one group, where tiling
    # and interleaving agree
    if p == a + 1 or same(value(x).shape[a], 1):
        dim = a
    else:
        raise Refused(f"{what} tiles K/V over the heads (head r * G + g reads group g); the ops take head "
                      "g * h + r (repeat_interleave): a different grouping, not rewritten")
    new = call(graph, torch.repeat_interleave, x, h, dim, anchor=node)
    node.replace_all_uses_with(new)
    erase_replaced(graph, [node, copy, inserted], [])
    return f"gqa_expand: {what} -> repeat_interleave({h}, dim={dim})"


def tiled_repeat(graph: fx.Graph, node: fx.Node) -> str | None:
    """x.repeat(1, h, 1, 1) of K/V: repeat_interleave where the tiled dim has size 1, else Refused."""
    reps = node.args[1:]
    if len(reps) == 1 and isinstance(reps[0], (tuple, list)):
        reps = tuple(reps[0])
    x = first(node)
    shape = shape_of(x)
    if shape is None or len(reps) != len(shape) or not all(isinstance(r, int) for r in reps):
        return None
    copied = [i for i, r in enumerate(reps) if r != 1]
    if len(copied) != 1 or not feeds_matmul(node):
        return None
    dim = copied[0]
    if not same(shape[dim], 1):
        raise Refused(f"x.repeat{tuple(reps)} tiles K/V over the heads (head r * G + g reads group g); the ops take "
                      "head g * h + r (repeat_interleave): a different grouping, not rewritten")
    new = call(graph, torch.repeat_interleave, x, reps[dim], dim, anchor=node)
    node.replace_all_uses_with(new)
    erase_replaced(graph, [node], [])
    return f"gqa_expand: repeat over a size-1 dim -> repeat_interleave({reps[dim]}, dim={dim})"


def layout_of(node: fx.Node) -> list[int] | None:
    """The permutation a permute / transpose / swapaxes node applies (output dim i = input dim perm[i])."""
    src = first(node)
    shape = shape_of(src)
    if shape is None:
        return None
    rank = len(shape)
    name = op_name(node)
    if name in ("transpose", "swapaxes"):
        d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
        if not isinstance(d0, int) or not isinstance(d1, int):
            return None
        perm = list(range(rank))
        perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
        return perm
    if name == "permute":
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        dims = dims or arg(node, 1, "dims")
        if isinstance(dims, (tuple, list)) and all(isinstance(d, int) for d in dims) and len(dims) == rank:
            return [d % rank for d in dims]
    return None


def key_transpose(graph: fx.Graph, softmax: fx.Node) -> str | None:
    """The `key_layout` rule: scores q @ k.permute(..) whose permute also swaps the last two dims
    (k [B, S, H, D].permute(0, 2, 3, 1)) -> q @ k.permute(0, 2, 1, 3).transpose(-1, -2): the same
    tensor, written as the transposed keys the passes read."""
    if op_name(softmax) != "softmax":
        return None
    chain = read_chain(softmax)
    if chain is None:
        return None
    product = chain.product if op_name(chain.product) in MATMULS else first(chain.product)
    rhs = product.args[1] if len(product.args) > 1 else None
    perm = layout_of(rhs) if isinstance(rhs, fx.Node) and op_name(rhs) == "permute" else None
    if perm is None or len(rhs.users) != 1:
        return None
    rank = len(perm)
    keys = perm[:-2] + [perm[-1], perm[-2]]  # permute to [.., N, K], then transpose the last two
    x = first(rhs)
    if keys != list(range(rank)):
        x = call(graph, torch.permute, x, keys, anchor=product)
    new = call(graph, torch.transpose, x, -1, -2, anchor=product)
    product.replace_input_with(rhs, new)
    erase_replaced(graph, [rhs], [])
    return "key_layout: keys permuted with their last two dims swapped -> permute, then transpose(-1, -2)"


# the casts the cast rules move or merge (cast_dtype reads type / type_as too)
MOVABLE_CASTS = ("to", "float", "half", "bfloat16", "double")


def movable_cast(node: fx.Node) -> torch.dtype | None:
    """The dtype a float-to-float cast on one device (`x.to(dtype)`, `x.float()`, ...) makes, else None."""
    return cast_dtype(node) if op_name(node) in MOVABLE_CASTS else None


def cast_moved_before(graph: fx.Graph, node: fx.Node, x: fx.Node, dtype: torch.dtype, remake) -> None:
    """node (a cast of remake(x)) -> remake(x.to(dtype)): the cast moved before the op remake repeats."""
    new = remake(call(graph, torch.Tensor.to, x, dtype, anchor=node))
    node.replace_all_uses_with(new)
    erase_replaced(graph, [node], [])


# Data movement a float cast moves above (it commutes with it, exactly): dims reordered, so that
# `k.transpose(-1, -2)` or a pooled `kc.permute(0, 2, 3, 1)` stays the key layout the passes read;
# basic slices, so that a chunk's `k[:, :, k0:s1]` stays a slice of K (the window pass reads the
# chunk's offsets from it); and the reshapes and copies of GQA, per-query rows and memory slots
# (`unsqueeze(2).repeat(1, 1, h, 1, 1).flatten(1, 2)`, `repeat_interleave(h, 1)`, `unsqueeze(-2)`),
# so that the passes read the copy, the rows and `cat((mem, pooled))` on the cast's input.
REORDERING = ("transpose", "swapaxes", "permute", "t")
RESHAPING = ("unsqueeze", "squeeze", "flatten", "unflatten", "view", "reshape", "expand", "repeat",
             "repeat_interleave", "contiguous")


def basic_slice(node: fx.Node) -> bool:
    """x[...] with ints, slices, None and Ellipsis only (no tensor index: that would gather), or a
    narrow or a reordering."""
    name = op_name(node)
    if name in REORDERING or name == "narrow":
        return True
    if name != "getitem" or len(node.args) != 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)

    def not_a_tensor(b) -> bool:  # a bound: a number, None, or a size node (a SymInt)
        return not isinstance(b, fx.Node) or not isinstance(value(b), torch.Tensor)

    def basic(i) -> bool:
        if isinstance(i, slice):
            return all(not_a_tensor(b) for b in (i.start, i.stop, i.step))
        return i is None or i is Ellipsis or (isinstance(i, int) and not isinstance(i, bool))

    return all(basic(i) for i in index)


def moves_cast_above(node: fx.Node) -> bool:
    """Data movement a cast commutes with: a reshape or copy (RESHAPING; not `x.view(dtype)`, which
    reinterprets bits, nor a repeat_interleave with a tensor of repeats, a gather) or a basic slice;
    its tensor given first, positionally, and of the dtype of its output."""
    src = node.args[0] if node.op in ("call_function", "call_method") and node.args else None
    if not isinstance(src, fx.Node) or value(src) is None or value(node) is None \
            or value(src).dtype != value(node).dtype:
        return False
    if op_name(node) in RESHAPING:
        return not any(isinstance(value(a), torch.Tensor) for a in node.all_input_nodes[1:]) and not any(
            isinstance(a, torch.dtype) for a in (*node.args, *node.kwargs.values()))
    return basic_slice(node)


# What the casts cast_hoist moves are read by: a product (autocast casts its operands).
PRODUCTS = (*MATMULS, "mm", "einsum", "scaled_dot_product_attention")


def read_by_product(node: fx.Node) -> bool:
    """Whether a product (PRODUCTS) reads node, directly or through data movement."""
    return any(op_name(user) in PRODUCTS or moves_cast_above(user) and read_by_product(user) for user in node.users)


def hoist_cast(graph: fx.Graph, node: fx.Node) -> str | None:
    """The `cast_hoist` rule: a narrowing float cast of data movement (`moves_cast_above`), read by
    a product (`read_by_product`: the cast autocast makes on its operand, or the same by hand), goes on
    the movement's input, through the whole chain: `x.unsqueeze(2).repeat(1, 1, h, 1, 1).flatten(1,
    2).to(bf16)` -> `x.to(bf16).unsqueeze(2).repeat(..).flatten(1, 2)`. These are the casts autocast
    makes before a product (the autocast rule writes them right there) and the same casts written by
    hand. Exact: a cast is elementwise. A chain node with other readers stays for them; the cast
    reads a copy of the chain (a view copies nothing; a copy is made in the cast's dtype instead of
    the cast's own copy). Casts of one tensor for several readers (a model's loop over query chunks
    casts the whole q for each chunk's product) share the cast and the copied chain as far as their
    chains agree (`call_once`): one copy, and passes that read the cast tensor see one tensor."""
    dtype = movable_cast(node)
    chain, x = [], first(node)
    while dtype is not None and isinstance(x, fx.Node) and moves_cast_above(x):
        chain.append(x)
        x = x.args[0]
    if not chain or torch.finfo(dtype).bits >= torch.finfo(value(x).dtype).bits or not read_by_product(node):
        return None  # a cast up stays where it is: the passes read upcasts in place, and it would widen more
    moved = call_once(graph, torch.Tensor.to, (x, dtype), {}, node)
    for step in reversed(chain):
        target = getattr(torch.Tensor, step.target) if step.op == "call_method" else step.target
        moved = call_once(graph, target, (moved, *step.args[1:]), step.kwargs, node)
    node.replace_all_uses_with(moved)
    erase_replaced(graph, [node], [])
    names = " <- ".join(op_name(step) for step in chain)
    return f"cast_hoist: cast to {str(dtype).removeprefix('torch.')} after {names} -> before them"


def call_once(graph: fx.Graph, target, args: tuple, kwargs: dict, anchor: fx.Node) -> fx.Node:
    """`target(*args, **kwargs)` before anchor, or the node that already computes it there (the
    same target on the same arguments, a reader of args[0] before anchor; casts and views only)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for user in args[0].users:
        if (user.op == "call_function" and user.target is target and user.args == args and user.kwargs == kwargs
                and order[user] < order[anchor]):
            return user
    return call(graph, target, *args, anchor=anchor, **kwargs)


def lossless(src: torch.dtype, mid: torch.dtype) -> bool:
    """Whether casting src values to mid keeps every value (the same dtype, or a wider one)."""
    if src == mid:
        return True
    wider = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return mid in wider.get(src, ())


def cast_of_cast(graph: fx.Graph, node: fx.Node) -> str | None:
    """The `cast_chain` rule: x.to(mid).to(dtype) -> x.to(dtype) where the cast to mid loses nothing."""
    inner, dtype = first(node), movable_cast(node)
    mid = movable_cast(inner) if dtype is not None else None
    if mid is None or not lossless(value(first(inner)).dtype, mid):
        return None
    cast_moved_before(graph, node, first(inner), dtype, lambda moved: moved)
    return (f"cast_chain: cast to {str(mid).removeprefix('torch.')} then to {str(dtype).removeprefix('torch.')} "
            "-> one cast")


def layout_past_copy(graph: fx.Graph, node: fx.Node) -> str | None:
    """The `gqa_layout` rule: permute(x.repeat_interleave(h, d)) -> permute(x).repeat_interleave(h, d'),
    where the permute moves the repeated dim d (a layout change of K/V after its GQA copy: the copy
    then sits on the head dim the passes read). Exact: the same elements in the same places."""
    perm = layout_of(node)
    rep = first(node)
    if perm is None or op_name(rep) != "repeat_interleave":
        return None
    repeats, dim = arg(rep, 1, "repeats"), arg(rep, 2, "dim")
    x = first(rep)
    if not (isinstance(repeats, int) or isinstance(repeats, fx.Node) and is_size(repeats)) \
            or not isinstance(dim, int) or not isinstance(x, fx.Node) or arg(rep, 3, "output_size") is not None:
        return None
    dim %= len(perm)
    if perm.index(dim) == dim or any(layout_of(u) is None for u in rep.users):
        return None  # the permute keeps the repeated dim in place, or the copy has other users
    moved = call(graph, torch.permute, x, perm, anchor=node)
    new = call(graph, torch.repeat_interleave, moved, repeats, perm.index(dim), anchor=node)
    node.replace_all_uses_with(new)
    erase_replaced(graph, [node], [])
    return f"gqa_layout: layout change after repeat_interleave -> before it (dim {dim} -> {perm.index(dim)})"


# --- F.scaled_dot_product_attention -----------------------------------------------------------------


@dataclass
class SDPACall:
    """The arguments of one F.scaled_dot_product_attention call."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float
    groups: int  # enable_gqa: the query heads per K/V head (1 without)


def read_sdpa(node: fx.Node) -> SDPACall | None:
    """The call's arguments, or None if it is not an SDPA call; Refused for dropout, is_causal
    without a mask and other forms the decomposition does not take."""
    if op_name(node) != "scaled_dot_product_attention" or node.op != "call_function":
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    q, k, v, mask = given.get("query"), given.get("key"), given.get("value"), given.get("attn_mask")
    if mask is None:
        return None  # plain or is_causal attention: SDPA's own kernels are the fast path, no window to read
    if given.get("dropout_p", 0.0) not in (0, 0.0):
        raise Refused("SDPA with dropout (the decomposition has none)")
    if given.get("is_causal", False):
        raise Refused("SDPA with both attn_mask and is_causal")
    shapes = [shape_of(x) for x in (q, k, v, mask)]
    if None in shapes:
        raise Refused("SDPA operands that are not tensors")
    qs, ks, vs, _ = shapes
    if len(qs) not in (4, 5) or len(ks) != len(qs) or len(vs) != len(qs):
        raise Refused(f"SDPA on {len(qs)}-D tensors (the passes read 4-D, or 5-D with one query row)")
    scale = given.get("scale")
    if scale is None and not isinstance(qs[-1], int):
        raise Refused(f"SDPA with a symbolic head size {qs[-1]} (its default scale is not a number)")
    if scale is None:
        scale = qs[-1] ** -0.5
    if not is_number(scale):
        raise Refused("SDPA with a scale that is not a number")
    groups = 1
    if not same(qs[-3], ks[-3]):
        if not isinstance(qs[-3], int) or not isinstance(ks[-3], int):
            raise Refused(f"SDPA with {qs[-3]} query heads and {ks[-3]} K/V heads (symbolic sizes)")
        if not given.get("enable_gqa", False) or ks[-3] == 0 or qs[-3] % ks[-3]:
            raise Refused(f"SDPA with {qs[-3]} query heads and {ks[-3]} K/V heads")
        groups = qs[-3] // ks[-3]
    return SDPACall(q, k, v, mask, float(scale), groups)


def staircase_like(keep: torch.Tensor) -> bool:
    """keep [.., L, S] is one pattern whose rows each keep a prefix of the keys, no shorter than the
    row before (causal visibility of compressed blocks or a window over one sequence)."""
    grid = keep.reshape(-1, *keep.shape[-2:])
    if grid.shape[0] != 1:
        return False
    grid = grid[0].cpu()
    counts = grid.sum(-1)
    prefix = torch.arange(grid.shape[-1], device="cpu")[None, :] < counts[:, None]
    return torch.equal(grid, prefix) and bool((counts[1:] >= counts[:-1]).all())


def causal_window(keep: torch.Tensor) -> bool:
    """keep [.., S, S] is one causal sliding window (s <= t and t - s < w, some w >= 1)."""
    grid = keep.reshape(-1, *keep.shape[-2:])
    if grid.shape[0] != 1 or grid.shape[-1] != grid.shape[-2]:
        return False
    grid = grid[0].cpu()
    w = int(grid.sum(-1).max())
    t = torch.arange(grid.shape[0], device="cpu")[:, None]
    s = torch.arange(grid.shape[1], device="cpu")[None, :]
    return w >= 1 and torch.equal(grid, (s <= t) & (t - s < w))


def shifted_window(keep: torch.Tensor) -> tuple[int, int] | None:
    """(d, w) when keep [.., L, C] is one pattern whose row r keeps the columns r + d - w + 1 ..
    r + d that exist, for some d >= 0 and w >= 1: a causal sliding window of a chunk of queries
    over a slice of the keys (row r at key column r + d; d and w from the first row and the widest
    one). None otherwise. The window pass proves the rest from the slices (their offsets)."""
    grid = keep.reshape(-1, *keep.shape[-2:])
    if grid.shape[0] != 1 or not bool(grid[0, 0].any()):
        return None
    grid = grid[0].cpu()
    d = int(grid[0].nonzero().max())
    w = int(grid.sum(-1).max())
    r = torch.arange(grid.shape[0], device="cpu")[:, None] + d
    s = torch.arange(grid.shape[1], device="cpu")[None, :]
    return (d, w) if torch.equal(grid, (s <= r) & (r - s < w)) else None


def document_windows(keep: torch.Tensor) -> tuple[int, int] | None:
    """(documents, w) when keep [.., T, T] is one pattern that is a causal sliding window of w
    tokens within each of two or more consecutive documents (block diagonal: a packed varlen
    layout whose documents are constants); None otherwise."""
    grid = keep.reshape(-1, *keep.shape[-2:])
    if grid.shape[0] != 1 or grid.shape[-1] != grid.shape[-2] or grid.shape[-1] < 2:
        return None
    grid = grid[0].cpu()
    T = grid.shape[0]
    t = torch.arange(T, device="cpu")
    starts = document_starts(grid)
    doc = torch.cumsum(starts.long(), 0)
    w = int(grid.sum(-1).max())
    same_doc = doc[:, None] == doc[None, :]
    expected = same_doc & (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < w)
    documents = int(doc[-1])
    return (documents, w) if documents > 1 and w >= 1 and torch.equal(grid, expected) else None


def document_starts(grid: torch.Tensor) -> torch.Tensor:
    """[T] bool: the tokens that begin a document in grid [T, T] (the kept keys of a window mask
    within documents): token 0, and every token that does not see the one before it."""
    T = grid.shape[0]
    t = torch.arange(1, T, device=grid.device)
    starts = torch.ones(T, dtype=torch.bool, device="cpu")
    starts[1:] = (~grid[t, t - 1]).cpu()
    return starts


def window_rows(rows, T: int, step: int) -> tuple[torch.Tensor, int, int]:
    """`causal_window` and `document_windows` for a [T, T] mask too large to evaluate whole (more
    than cmp.MAX_VERIFIED_ELEMENTS for its nodes at once): rows(r0, r1) computes its rows r0..r1
    ([r1 - r0, T], bool or additive: nsa_compile/mask_rows.py), `step` rows at a time, once. Each
    row must keep exactly the c_t keys t - c_t + 1 .. t (compared element by element); then, with
    w the largest c_t and a document starting at every token that does not see the one before it
    (c_t < 2), c_t must be min(w, t - start(t) + 1): the same verdict as comparing the whole mask
    with (doc(s) == doc(t)) & (s <= t) & (t - s < w). Returns (starts [T] bool: the tokens that
    begin a document, w, the number of documents: 1 for a causal window over the whole sequence);
    Refused, with the whole-mask rule's reason, where the mask is not one, or is additive with
    values other than 0 and one large negative fill, or additive over several documents."""
    counts = torch.empty(T, dtype=torch.long, device="cpu")
    fills, additive = set(), False
    for r0 in range(0, T, step):  # on the mask's device (the GPU while compiling there); small results to the CPU
        got = rows(r0, min(T, r0 + step))
        additive = got.dtype != torch.bool
        keep = got == 0 if additive else got
        if additive:
            fills.update(float(x) for x in got[got != 0].unique().cpu())
        c = keep.sum(-1)  # [rows]
        t = torch.arange(r0, r0 + keep.shape[0], device=keep.device)[:, None]
        s = torch.arange(T, device=keep.device)[None, :]
        if not torch.equal(keep, (s <= t) & (s > t - c[:, None])):
            raise Refused("SDPA's mask is not a causal sliding window: SDPA stays")
        counts[r0:r0 + keep.shape[0]] = c.cpu()
    if len(fills) > 1 or (fills and not max(fills) <= LARGE_NEGATIVE):
        raise Refused("SDPA's additive mask holds values other than 0 and one large negative fill")
    w = int(counts.max())
    t = torch.arange(T, device="cpu")
    starts = torch.ones(T, dtype=torch.bool, device="cpu")
    starts[1:] = counts[1:] < 2
    first_token = torch.cummax(torch.where(starts, t, 0), 0).values
    if w < 1 or not torch.equal(counts, torch.clamp(t - first_token + 1, max=w)):
        raise Refused("SDPA's mask is not a causal sliding window: SDPA stays")
    documents = int(starts.sum())
    if documents > 1 and additive:
        raise Refused(f"SDPA's additive mask is a causal window of {w} tokens within each of {documents} documents "
                      "of constant bounds: the documents are read from a bool mask only; SDPA stays")
    return starts, w, documents


def window_miss(keep: torch.Tensor) -> str:
    """The sdpa rule's refusal for a [.., S, S] mask that is not one causal sliding window (nor a
    bool mask of one within documents of constant bounds)."""
    found = document_windows(keep)
    if found is None:
        return "SDPA's mask is not a causal sliding window: SDPA stays"
    return (f"SDPA's additive mask is a causal window of {found[1]} tokens within each of {found[0]} documents of "
            "constant bounds: the documents are read from a bool mask only; SDPA stays")


class SDPADecomposition:
    """The `sdpa` rule: F.scaled_dot_product_attention with an attn_mask -> the normal form.

    Decomposed (exact, from SDPA's definition: softmax(q k^T * scale + mask) v, bool masks keeping
    True, K/V repeated per head with enable_gqa), where a pass can then read it:
    - 4-D, queries = keys, a mask from positions only that is a causal sliding window (the window
      branch; every row keeps its own key); or a bool one that is that window within documents of
      constant bounds (`document_windows`), its mask rewritten from constant positions
      (`documents`, marked CONSTANT_POSITIONS for the window pass). A static mask whose nodes would
      take more than WHOLE_MASK_CAP elements evaluated whole (S 32k: 4.3e9) is computed and compared
      in chunks of rows instead (`window_rows`, nsa_compile/mask_rows.py), for these two forms;
    - 4-D, another key count, a mask from positions only whose rows keep growing prefixes of the
      keys (compressed blocks, memory slots first), or a sliding window shifted along them
      (`shifted_window`: a chunk of queries over a slice of the keys; static sizes only); rows
      that keep no key are 0 in SDPA (bool or -inf masks), written as the compressed form's zero
      fill and final mask;
    - 5-D with one query row per token ([B, H, S, 1, D] against gathered [B, H, S, n, D]: the
      selected branch), any bool mask: the rows with no key are 0 in SDPA, so the probabilities
      are followed by nan_to_num (0 there, the selected op's own result).
    Other masked SDPA calls stay (SDPA's kernels are the fast path for them), with the reason.
    The decomposition computes the scores in q's dtype and the softmax in float32 (fp16/bf16),
    as the normal form does; SDPA's fused kernels keep the scores in float32 throughout."""

    def __init__(self, masks: ProbeMasks):
        self.masks = masks

    def __call__(self, graph: fx.Graph, node: fx.Node) -> str | None:
        call_ = read_sdpa(node)
        if call_ is None:
            return None
        qs, ks = shape_of(call_.q), shape_of(call_.k)
        mask_val = value(call_.mask)
        per_query = len(qs) == 5
        if per_query and not same(qs[-2], 1):
            raise Refused("5-D SDPA with more than one query row per token")
        self_attention = same(qs[-2], ks[-2])
        empty_rows = None
        if not per_query:
            if reads_data(call_.mask):
                raise Refused("SDPA's mask reads data (not positions only): the window and compressed passes "
                              "read position masks")
            if self_attention and not self.masks.symbolic and self.masks.over_cap(call_.mask, "SDPA mask"):
                return self.window_in_rows(graph, node, call_, int(qs[-2]))
            has_empty_row = finite = chunk = False
            for probe, got in self.masks.evaluate(call_.mask, "SDPA mask"):
                at = f"at the probe sizes {probe.describe()}: " if probe.symbolic else ""
                keep = got if got.dtype == torch.bool else got == 0
                if got.dtype != torch.bool:
                    fills = got.unique()
                    fills = fills[fills != 0]
                    if len(fills) > 1 or (len(fills) and not float(fills[0]) <= LARGE_NEGATIVE):
                        raise Refused(f"{at}SDPA's additive mask holds values other than 0 and one large negative fill")
                if self_attention and not causal_window(keep):
                    found = document_windows(keep)
                    if found is None or got.dtype != torch.bool:
                        raise Refused(at + window_miss(keep))
                    if probe.symbolic:
                        raise Refused(f"SDPA's mask is a causal window of {found[1]} tokens within each of {found[0]} "
                                      "documents of constant bounds: at symbolic sizes (dynamic shapes) their "
                                      "positions are not one constant; SDPA stays")
                    starts = document_starts(keep.reshape(-1, *keep.shape[-2:])[0].cpu())
                    self.rewrite(graph, node, self.documents(graph, node, call_, starts, found[1]), False, None)
                    return (f"sdpa: F.scaled_dot_product_attention (window of {found[1]} tokens within {found[0]} "
                            "documents of constant bounds) -> scores, mask from constant positions, softmax, @ v")
                if not self_attention and not staircase_like(keep):
                    if shifted_window(keep) is None:
                        raise Refused(f"{at}SDPA's mask does not keep a growing prefix of the keys per query, nor a "
                                      "sliding window of a chunk of queries over a slice of them: SDPA stays")
                    if probe.symbolic:
                        raise Refused(f"{at}SDPA's mask is a sliding window over a slice of the keys: at symbolic "
                                      "sizes (dynamic shapes) the window pass does not read chunks; SDPA stays")
                    chunk = True
                finite |= got.dtype != torch.bool and bool((got != 0).any()) and bool(torch.isfinite(got).all())
                has_empty_row |= not bool(keep.any(-1).all())
            # SDPA gives 0 where a bool / -inf mask keeps no key. At symbolic sizes a prefix mask's
            # rows are written that way even where no probe shows an empty one (exact either way:
            # the zero fill and `* keep` change no row that keeps a key).
            if not finite and (has_empty_row or (self.masks.symbolic and not self_attention)):
                empty_rows = True
        elif mask_val.dtype != torch.bool:
            raise Refused("5-D SDPA with an additive mask")
        self.rewrite(graph, node, call_, per_query, empty_rows)
        what = "per-query 5-D" if per_query else ("window" if self_attention else
                                                  "window over a key slice" if chunk else "prefix mask")
        return f"sdpa: F.scaled_dot_product_attention ({what}) -> scores, mask, softmax, @ v"

    def window_in_rows(self, graph: fx.Graph, node: fx.Node, c: SDPACall, T: int) -> str:
        """A static self-attention mask too large to evaluate whole (S 32k and up): verified in
        chunks of rows (`window_rows`: every element computed and compared), then decomposed as
        the whole-mask path does (a causal window, or one within documents of constant bounds)."""
        rows = mask_rows(c.mask, T, sizes=self.masks.sizes)
        starts, w, documents = window_rows(rows, T, max(1, CHUNK_ELEMENTS // T))
        if documents > 1:
            self.rewrite(graph, node, self.documents(graph, node, c, starts, w), False, None)
            return (f"sdpa: F.scaled_dot_product_attention (window of {w} tokens within {documents} documents of "
                    "constant bounds, verified in row chunks) -> scores, mask from constant positions, softmax, @ v")
        self.rewrite(graph, node, c, False, None)
        return "sdpa: F.scaled_dot_product_attention (window, verified in row chunks) -> scores, mask, softmax, @ v"

    @staticmethod
    def documents(graph: fx.Graph, node: fx.Node, c: SDPACall, starts: torch.Tensor, w: int) -> SDPACall:
        """The call with its mask of constant documents (starting at the tokens where `starts` [T]
        is True; the mask verified by document_windows or window_rows) written as the packed window
        of the window pass, from constant positions pos [B, T] (each token's position in its
        document; marked CONSTANT_POSITIONS): (s <= t) & (t - s < w) & (s >= t - pos[:, :, None]),
        [B, 1, T, T]. Equal to the mask for every (t, s): s >= t - pos[t] is s at or after t's
        document start."""
        T = starts.shape[0]
        t = torch.arange(T, device="cpu")
        first_token = torch.cummax(torch.where(starts, t, 0), 0).values  # each token's document start
        # static sizes only (the caller refuses symbolic ones; int(): a size a guard fixed is a SymInt)
        B, device = int(value(c.q).shape[0]), value(c.q).device
        rows = [(t - first_token).tolist()] * B
        pos = constant(graph, torch.tensor, rows, like=c.q, anchor=node, dtype=torch.int64, device=device)
        pos.meta[CONSTANT_POSITIONS] = True
        ids = constant(graph, torch.arange, T, like=c.q, anchor=node, device=device)
        tq = call(graph, torch.unsqueeze, ids, 1, anchor=node)  # [T, 1]
        ts = call(graph, torch.unsqueeze, ids, 0, anchor=node)  # [1, T]
        band = call(graph, operator.and_, call(graph, operator.le, ts, tq, anchor=node),
                    call(graph, operator.lt, call(graph, operator.sub, tq, ts, anchor=node), w, anchor=node),
                    anchor=node)
        start = call(graph, operator.sub, tq, call(graph, torch.unsqueeze, pos, -1, anchor=node), anchor=node)
        mask = call(graph, operator.and_, band, call(graph, operator.ge, ts, start, anchor=node), anchor=node)
        return dataclasses.replace(c, mask=call(graph, torch.unsqueeze, mask, 1, anchor=node))

    @staticmethod
    def rewrite(graph: fx.Graph, node: fx.Node, c: SDPACall, per_query: bool, empty_rows) -> None:
        rank = value(c.q).dim()
        k, v = c.k, c.v
        if c.groups > 1:
            k = call(graph, torch.repeat_interleave, k, c.groups, rank - 3, anchor=node)
            v = call(graph, torch.repeat_interleave, v, c.groups, rank - 3, anchor=node)
        scores = call(graph, torch.matmul, c.q, call(graph, torch.transpose, k, -1, -2, anchor=node), anchor=node)
        mask = c.mask
        if per_query:
            scores = call(graph, torch.squeeze, scores, -2, anchor=node)
            mshape = shape_of(mask)
            if len(mshape) >= 2 and same(mshape[-2], 1):
                mask = call(graph, torch.squeeze, mask, -2, anchor=node)
        low = value(scores).dtype
        compute = torch.float32 if low in (torch.float16, torch.bfloat16) else low
        if compute != low:
            scores = call(graph, torch.Tensor.to, scores, compute, anchor=node)
        scores = call(graph, operator.mul, scores, c.scale, anchor=node)
        if value(mask).dtype == torch.bool:
            keep = mask
            scores = call(graph, torch.masked_fill, scores, call(graph, operator.invert, mask, anchor=node), -INF,
                          anchor=node)
        else:
            keep = None
            scores = call(graph, operator.add, scores, mask, anchor=node)
        if empty_rows:
            if keep is None:
                keep = call(graph, torch.eq, mask, 0, anchor=node)
            has_key = call(graph, torch.any, keep, -1, keepdim=True, anchor=node)
            empty = call(graph, operator.invert, has_key, anchor=node)
            scores = call(graph, torch.masked_fill, scores, empty, 0.0, anchor=node)
        p = call(graph, torch.softmax, scores, -1, anchor=node)
        if empty_rows:
            p = call(graph, operator.mul, p, call(graph, operator.and_, keep, has_key, anchor=node), anchor=node)
        if per_query:
            p = call(graph, torch.nan_to_num, p, 0.0, anchor=node)
        p = call(graph, torch.Tensor.to, p, value(v).dtype, anchor=node)
        if per_query:
            out = call(graph, torch.matmul, call(graph, torch.unsqueeze, p, -2, anchor=node), v, anchor=node)
        else:
            out = call(graph, torch.matmul, p, v, anchor=node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)


# --- sorts --------------------------------------------------------------------------------------------


def argsort_to_sort(graph: fx.Graph, node: fx.Node) -> str | None:
    """The `sort` rule: `order = x.argsort(dim, descending, stable)[..]` with the keys read back by
    `torch.take_along_dim(x, order, dim)` (or `x.gather(dim, order)`) -> `values, order =
    torch.sort(x, ...)` cut the same way: sort's values are the keys at its indices, element for
    element, and argsort is sort's indices."""
    if op_name(node) != "argsort":
        return None
    x, dim = first(node), arg(node, 1, "dim", -1)
    descending, stable = arg(node, 2, "descending", False), node.kwargs.get("stable", False)
    if not isinstance(x, fx.Node) or not isinstance(dim, int) or value(x) is None:
        return None
    reads = []  # (take node, the cut of the order it reads: a getitem of node, or node itself)
    for user in node.users:
        cut_users = list(user.users) if op_name(user) == "getitem" else [user]
        for take in cut_users:
            if op_name(take) in ("take_along_dim", "gather") and first(take) is x:
                index = arg(take, 1, "indices") if op_name(take) == "take_along_dim" else arg(take, 2, "index")
                take_dim = arg(take, 2, "dim") if op_name(take) == "take_along_dim" else arg(take, 1, "dim")
                order_read = user if op_name(user) == "getitem" else node
                rank = value(x).dim()
                if index is order_read and isinstance(take_dim, int) and take_dim % rank == dim % rank:
                    reads.append((take, order_read))
    if not reads:
        return None
    both = call(graph, torch.sort, x, dim=dim, descending=descending, stable=stable, anchor=node)
    values = call(graph, operator.getitem, both, 0, anchor=node)
    order = call(graph, operator.getitem, both, 1, anchor=node)
    for take, order_read in reads:
        if order_read is node:
            keys = values
        else:
            keys = call(graph, operator.getitem, values, order_read.args[1], anchor=take)
        take.replace_all_uses_with(keys)
        graph.erase_node(take)
    node.replace_all_uses_with(order)
    graph.erase_node(node)
    return f"sort: argsort + take_along_dim of the keys -> torch.sort ({len(reads)} read{'s' * (len(reads) > 1)})"


# --- softmax written out by hand ----------------------------------------------------------------


def reduced_dim(node: fx.Node, rank: int) -> int | None:
    """The one dim (modulo rank) that `x.amax(dim, keepdim=True)` / `x.sum(dim, keepdim=True)` /
    `x.max(dim, keepdim=True)` reduces, or None (several dims, no keepdim, not a constant)."""
    d = arg(node, 1, "dim")
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    keepdim = arg(node, 2, "keepdim", False)
    if not isinstance(d, int) or keepdim is not True or node.kwargs.get("dtype") is not None:
        return None
    return d % rank


def row_max(node: fx.Node) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(x, dim, the nodes from node down to the reduction) when node is the max of x over one dim,
    kept: `x.amax(dim, keepdim=True)`, `x.max(dim, keepdim=True)[0]` (`.values`), optionally
    `.detach()`ed; else None."""
    chain = [node]
    if op_name(node) == "detach" and isinstance(first(node), fx.Node):
        node = first(node)
        chain.append(node)
    if op_name(node) == "getitem" and node.args[1] == 0 and isinstance(node.args[0], fx.Node) \
            and op_name(node.args[0]) == "max":
        node = node.args[0]
        chain.append(node)
    x = first(node)
    if op_name(node) not in ("amax", "max") or not isinstance(x, fx.Node) or value(x) is None:
        return None
    d = reduced_dim(node, value(x).dim())
    return None if d is None else (x, d, chain)


def handwritten_softmax(graph: fx.Graph, node: fx.Node) -> str | None:
    """The `softmax` rule: e = exp(x - x.amax(d, keepdim=True)); p = e / e.sum(d, keepdim=True)
    -> torch.softmax(x, d). The same function (softmax subtracts the row max too, and gives NaN
    for a row of -inf as the division does); the gradient through the max is zero in exact
    arithmetic (a shift does not change the softmax), so only rounding differs. In fp16/bf16 eager
    rounds exp and the sum to the low precision, torch.softmax accumulates in float32: the match
    says so. Refused: no max subtracted (exp overflows to inf and the row to NaN above x = 88 in
    float32, where softmax is finite)."""
    if op_name(node) not in ("truediv", "div") or node.kwargs.get("rounding_mode") is not None:
        return None
    e, total = arg(node, 0, "input"), arg(node, 1, "other")
    if not isinstance(e, fx.Node) or not isinstance(total, fx.Node) or op_name(e) != "exp" \
            or op_name(total) != "sum" or first(total) is not e or value(e) is None:
        return None
    rank = value(e).dim()
    d = reduced_dim(total, rank)
    shifted = first(e)
    if d is None or set(e.users) != {node, total} or len(total.users) != 1 or not isinstance(shifted, fx.Node):
        return None
    if op_name(shifted) != "sub" or len(shifted.args) != 2 or shifted.kwargs:
        raise Refused("exp(x) / exp(x).sum() without the row max subtracted: exp overflows to inf (a NaN row) "
                      "where torch.softmax is finite; not rewritten")
    if len(shifted.users) != 1:
        raise Refused("the shifted scores x - max of the hand-written softmax are also read elsewhere; not rewritten")
    x, peak = shifted.args
    found = row_max(peak) if isinstance(peak, fx.Node) else None
    if found is None or found[0] is not x or found[1] != d:
        raise Refused("exp(x - m) / sum: m is not x's max over the summed dim (x.amax(dim, keepdim=True))")
    if any(len(n.users) != 1 for n in found[2]):
        raise Refused("the row max of the hand-written softmax is also read elsewhere; not rewritten")
    new = call(graph, torch.softmax, x, d, anchor=node)
    node.replace_all_uses_with(new)
    erase_replaced(graph, [node, total, e, shifted], [peak])
    dtype = value(x).dtype
    note = (f"; eager rounds exp and the sum to {dtype}, torch.softmax accumulates in float32"
            if dtype in (torch.float16, torch.bfloat16) else "")
    return f"softmax: exp(x - amax) / sum -> torch.softmax (dim {d}){note}"


# --- the pass -------------------------------------------------------------------------------------


class Canonicalize(RewritePass):
    name = "canonicalize"
    summary = "equivalent spellings of attention (einsum, mask forms, softmax dtype, ...) -> the form the passes read"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        sizes_off_copies(graph)
        masks = ProbeMasks()
        rules = (("autocast", ExplicitAutocast()), ("cast_hoist", hoist_cast), ("cast_chain", cast_of_cast),
                 ("sdpa", SDPADecomposition(masks)), ("grouped_heads", GroupedHeads()), ("sort", argsort_to_sort), ("softmax", handwritten_softmax),
                 ("einsum", einsum_to_matmul), ("gqa_expand", gqa_copy), ("key_layout", key_transpose),
                 ("gqa_layout", layout_past_copy), ("scores", ScoreChains(masks)),
                 ("empty_rows", EmptyRows(masks)))
        for name, rule in rules:
            masks.read(graph)  # the size nodes the rules before may have added
            for node in list(graph.nodes):
                if node._erased or node.op not in ("call_function", "call_method"):
                    continue
                try:
                    what = rule(graph, node)
                except Refused as why:
                    ctx.refused(node, f"{name}: {why}")
                    continue
                if what:
                    ctx.matched(node, what)

    def source_files(self) -> tuple[str, ...]:
        return super().source_files() + (cmp.__file__,)


PASS = Canonicalize()
