"""select_blocks: NSA's block importance and top-n choice from the compressed probabilities
-> one block-selection op that recomputes them from the compressed op's log-sum-exp.

Matches (torch IR), anchored at the descending sort or topk (models/nsa.py `NSAAttention.select_blocks`):
    p_slc = p @ overlap                               # p [B, H, S, Tc]: compressed_attention's probabilities
    p_grp = p_slc.view(B, G, h, S, Ns).sum(2)          # or unflatten/reshape; none when h = 1 and H = G
    key = torch.where(forced, inf, torch.where(candidate, p_grp, -inf))   # or masked_fill(.., +-inf), either order
    key = F.pad(key, (0, max(0, n - Ns)), value=-inf)  # optional
    values, order = torch.sort(key, dim=-1, descending=True, stable=True)
    values, order = values[..., :n], order[..., :n]
    # or, for the two lines above: values, order = torch.topk(key, n, dim=-1)   (sorted or not; [..., :n] optional)
    chosen = torch.where(values > -inf, order, past_end)                     # or != -inf; past_end >= Ns
    chosen = torch.sort(chosen, dim=-1).values
    block_idx = torch.where(chosen == past_end, -1, chosen)                  # or masked_fill(.., -1)
    # or, for the three lines above, the blocks in rank order: block_idx = torch.where(values > -inf, order, -1),
    # where every use of block_idx is a selected branch that selected_attention accepts (it checks on probes
    # that the attention depends on each query's blocks as a set: the op's ascending order gives the same)
where overlap [Tc, Ns], forced and candidate [S, Ns] are computed from positions only.

flash-linear-attention's rule (the op's rule='fla'; tests/corpus/fla_naive_bthd.py, tiled_gqa_fla.py):
    key = p.masked_fill(j == t // l', 1.0).view(B, G, h, S, Ns).sum(2)   # or tiled: view(B, h, G, S, Ns).sum(1)
    ids = key.topk(n, -1).indices
    block_idx = ids.masked_fill(ids > t // l', -1)      # rank order, -1 after the top-n
with no block map (l = d = l': the compression blocks are the selection blocks). The 1.0 mask is
evaluated at compile time and must be exactly the current block; the -1 mask reads the ids, so it
is evaluated on probe block ids (every block at every (batch, group, token)) and must be exactly
id > t // l'; both at every probe size. Tiled groups need the compressed K tiled the same way
(repeat); the op then gets q and lse with each group's heads made contiguous and K's first G heads.

Per-head selection (tests/corpus/fused_qkv_per_head.py): no group sum, the key [B, H, S, Ns] one
per query head over grouped compressed keys (G < H): the same function as the grouped form with
every query head a group of one, so the op gets the compressed keys repeated per query head
(`k.repeat_interleave(H // G, 1)`, a [B, H, Tc, Dk] copy, said in the match text), q and the lse
as they are, and returns [B, H, S, n].

lucidrains' rule (the op's rule='lucidrains'; tests/corpus/lucidrains_*.py): a topk over
`softmax(F.pad(a, (1, 0), value=-1e3))[..., 1:]` of the averaged compressed logits, its values read
only by `> 1e-10`. Read as a computation (`LucidrainsChoice`): the region from q and the compressed
keys is evaluated on probe values against the op's `lucidrains_probabilities`; see that class.

A non-causal choice (the op's rule='nsa_vibe'; tests/corpus/nsa_vibe_noncausal.py): where the paper's
rule refuses a key over a softmax of unmasked scores, the region from q and the compressed keys to
the block ids is read as a computation (`NonCausalChoice`, passes/noncausal_choice.py): run on
probes against the op's rule 'nsa_vibe' and replaced by it, NOT causal as the model is.

Packed [T, H, D] tokens (tests/corpus/xunhaolai_varlen.py): a topk over a 3-D key [G, T, Ns]
computed from the 3-D compressed probabilities that compressed_attention rewrote into the op's
packed form is read as a computation (`VarlenChoice`): the region from p to the block ids is run
on probes against `nsa.select_blocks(.., pos)` and replaced by it.

Casts and autocast (issue 17: the rounding is a parameter of the op, not a refusal). Casts of p
that keep its dtype (fp32 `.to(float32)`, `.float()`) are read through. Under torch.autocast (bf16
or fp16) eager's `p @ overlap` runs in the autocast dtype, and canonicalize writes autocast's casts
as `.to()` nodes:
    p_slc = p.to(bf16) @ overlap.to(bf16)      # p float32, rounded; the map rounded; the result bf16
    p_grp = p_slc.view(B, G, h, S, Ns).sum(2)   # bf16 (accumulated in float32, rounded)
    key = torch.where(forced, inf, torch.where(candidate, p_grp, -inf))   # bf16, then pad, sort
Where the matmul computes in bf16 or fp16, the casts round the wider p to that dtype and to no
other narrower one (a rounded p widened and rounded again is exact: `p.to(bf16).float()` under
autocast, as tests/corpus/fused_qkv_per_head.py's `.to(q.dtype)` then `.float()`), the map the
matmul reads is exactly overlap / l rounded to it (evaluated), and the group sum, the key, its
fills and the padding stay in it, the op gets `importance_dtype` = that dtype (the user's own casts
in those places count the same). The same for the per-head form and for fla's rule
(`p.to(bf16).masked_fill(.., 1.0)`, its group sum and key in bf16). Any other mixture is refused,
naming the nodes and dtypes: p rounded and cast back up before a float32 matmul
(p.to(bf16).float() @ overlap), the matmul's result cast before the group sum or the key, a key in
another dtype than the rounded importance, a matmul in a lower dtype with no cast in the graph.
The group's heads summed before the map (`torch.einsum('bghsc,cj->bgsj', p, map)`, which sums h
out of p first, written that way by canonicalize; grouped5d_nograd):
    p_grp = p.to(bf16).view(B, G, h, S, Tc).sum(2) @ overlap.to(bf16)   # the sum rounded, then the map
is read with the casts on either side of the 5-D view; rounded, the op gets group_first=True (both
backends compute it: 'auto' takes the Triton kernel on CUDA); in float32 the two orders differ by
float32 rounding only and the op's usual order is used. A head sum with its own dtype argument
(not rounded) is refused.

Verified, not assumed: p must be exactly compressed_attention's probabilities (the same chain and
mask checks as that pass, for the pooling's (l, d)), and an `nsa.compressed_attention` node must
already compute them from the same q, pooled K, (l, d) and scale: the new op takes its lse. The
position-only subgraphs are evaluated at compile time (a proof for the shape compiled): overlap
must be overlap(i, j) / l (the tokens shared by [i*d, i*d + l) and [j*l', j*l' + l'), float
rounding aside), and the key must put +inf exactly on blocks 0, t // l', t // l' - 1 and -inf
exactly on the blocks with j*l' > t (NSA_SEMANTICS.md section 3), with l' read from when block 1
enters (any l' >= S when Ns = 1). n comes from the slice (capped by the key's width), or is topk's k.

A chunk of queries (issue 17): the compressed op carries q_offset (compressed_attention read it
from q's slice); the key's classes are then NSA's for rows at tokens q_offset + r, l' the one whose
classes and block map are NSA's among those the rows' last candidate block allows (a chunk shorter
than l' may fit several; the block map decides), the key may hold the whole sequence's
ceil(L / l') blocks (-inf on every row of the chunk), and the op gets the same q_offset. The
paper's rule only (fla's with a chunk is refused).

Packed documents (models/nsa.py `select_blocks(p_cmp, S, pos)`): the compressed op carries the
[B, S] positions pos (a graph input) and the document stride d; its keys are slots at stride 1.
Then the block map and the key's masks read pos too:
    start = pos[:, :Tc, None]                          # [B, Tc, 1]: each slot's document position
    overlap = min(start + l, (j + 1) * l') - max(start, j * l'), clamped at 0, / l  # [B, Tc, Ns]
    p_slc = p @ overlap[:, None]                       # [B, H, S, Ns]
    t = pos[:, None, :, None]                          # forced and candidate blocks by document position
They may depend on no data but that pos node, the one the compressed op was given (p is
re-checked with compressed_attention's packed checks, which find d and pos; the op must carry
both). They cannot be evaluated without inputs, so they are checked on probes: evaluated at
compile time with probe positions of the real [B, S] shape in place of pos (one document per row,
from which l' is read as above; then compressed_attention's probes for (l, d) and this pass's for
l': documents of odd lengths (1, 2, shorter than l and l', not multiples of d, longer than n*l'),
documents on selection-block boundaries and one token off them, random packings, each batch row
packed differently), and compared on each with NSA's per-document rules: the overlap of slot s
by its document position pos[s], +inf on blocks 0, pos[t] // l', pos[t] // l' - 1 and -inf on
blocks with j*l' > pos[t]. This is a check on probes, not a proof for every packing. One verdict
serves every layer with the same subgraphs.

Symbolic sizes: a graph Dynamo compiled with S as a symbol is checked as above (the compressed
probabilities with compressed_attention's checks) at each probe size, the size nodes (s27, the
key's width as a sym_max) as their numbers: a check on probe sizes, not a proof for every S. The
-inf padding and past_end may then be size nodes; the op's arguments hold no size. A top-k of
`min(n, Ns)` blocks (the model's `topk(min(n, blocks))`, torch.sym_min(n, Ns) at symbolic sizes:
fewer than n columns where S < n l') takes n for the op, whose ids are then cut to the model's
`[..., :min(n, Ns)]`: exact at every S, since the op's ids past Ns are -1 (fla's rule and the
paper's alike: at most Ns blocks exist to choose), so the cut keeps eager's ids (block ids that a
selected branch then reads with n = min(n, Ns): selected_attention gives its op all n).

Becomes `torch.ops.nsa.select_blocks(q, k_cmp, lse, l, d, l', n, c, backend[, pos][, rule='fla']
[, importance_dtype=torch.bfloat16])` (nsa_compile/ops/block_select.py), [B, G, S, n] int64. The
importance chain (its casts included), the sorts and then, once nothing else reads them, the
[B, H, S, Tc] probabilities and scores of the compressed branch are erased. The op's importance
differs from eager's by float32 rounding only (exp(s - lse) for a softmax): blocks within ~1e-6
relative of each other may be ranked the other way (with importance_dtype: where that moves one
rounded importance by one unit, which the op's docstring measures); exact ties go to the lower
block, as the stable sort does. That is also a valid torch.topk result: where keys tie at the
n-th place, topk may return any of the tied blocks (its choice is unspecified), and the sets can
differ only there; `explain` notes this on every topk match.

Refuses (graph unchanged), with the reason shown by `explain`:
- compressed_attention did not rewrite the branch (disabled, or refused: its reason is repeated);
- p used by anything else (a third consumer keeps the [B, H, S, Tc] tensor: nothing to gain);
- a map that is not the overlap / l (weights all 1, another stride; rounded: not exactly overlap / l
  rounded to the matmul's dtype), forced or candidate blocks that differ from NSA's (e.g. block 0
  not forced), padding that is not -inf;
- a mixture of dtypes in the importance other than one rounding (above), naming nodes and dtypes;
- a sort that is not stable (it leaves the order of tied keys at the n-th place unspecified);
- torch.topk with largest=False (the lowest-ranked blocks), over another dim, with a k that is not
  the n kept (topk(key, k)[..., :n] with n < k), or with its values used beyond the > -inf filter
  (the op returns block ids only);
- intermediate tensors used elsewhere, a verification larger than the cap;
- symbolic sizes (dynamic shapes): a key or block map that differs from NSA's at one of the probe
  sizes (`Sizes.probes`: the sizes Dynamo saw, then every symbol +1 and +19; the reason names
  them), an l' that is not one number at all of them (any l' >= S serves a probe with one
  selection block), a number of block ids that depends on S other than min(n, Ns); packed documents (pos) at symbolic
  sizes (compressed_attention refuses them: no lse).
- a key over an unmasked softmax whose +-inf fills hide no block after block 0 in any query row
  (t = 0 then ranks blocks of later tokens: the choice reads the future, non-causal; the masks are
  evaluated at compile time, zeros_like / ones_like taken as the constants they are), unless the
  choice is the op's rule 'nsa_vibe' on probes (then rewritten; NonCausalChoice's refusal is
  appended to this reason otherwise);
- a topk over a 3-D key computed from 3-D softmax probabilities (varlen [H, T, ..] scores with no
  batch dim) that `VarlenChoice` does not read: its compressed branch not rewritten, data other
  than p read, or a choice that differs from the op's on a probe (named: probe, group, token);
- packed: a block map or mask that reads data other than the compressed op's pos, or that differs
  from NSA's per-document rules on a probe (slots counted from the row start instead of pos[s];
  forced or candidate blocks from t instead of pos[t]; an off-by-one).
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile import batch_slice, probe as region_probe, row_regions
from nsa_compile.attention_match import Refused, ancestors, erase_replaced, evaluate_node, only_user
from nsa_compile.fx import MATMULS, arg, call, op_name, same, value
from nsa_compile.row_regions import RowRegion, Rows
from nsa_compile.ops.block_select import LUCIDRAINS_SINK, LUCIDRAINS_THRESHOLD, ROUNDINGS, choose_backend
from nsa_compile.ops.block_select import lucidrains_probabilities, why_not_triton
from nsa_compile.ops.common import upcast_dtype
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes, is_size

from . import compressed_attention as cmp
from . import block_choice
from .block_choice import clamped_count, first_arg, noncausal_reason, size_of, unbatched_key
from .noncausal_choice import NonCausalChoice, NotThisRule

KERNEL = ("nsa.select_blocks[{backend}] (l'={block}, n={n}{packed}, from the compressed lse, no [B, H, S, Tc] "
          "probabilities{note}{why})")
# On every topk match: the op's choice is one of the results topk may give, not necessarily eager's.
TOPK_NOTE = "; torch.topk: ties at the n-th place go to the lower block (eager's topk leaves them unspecified)"
# A top-k of min(n, Ns) blocks at symbolic sizes: the op takes n, its ids cut to the model's number.
CLAMP_NOTE = "; the model's top-k of min({n}, Ns) blocks: the op's ids past Ns are -1, cut off"
# Per-head selection (no group sum): every query head is a group of one for the op.
PER_HEAD = (", per query head (each head its own group: the compressed keys repeated x{h} per query head, "
            "a [B, H, Tc, Dk] copy)")
# An importance computed in bf16/fp16 (autocast's matmul): the op rounds as eager does.
ROUNDED = ", importance rounded to {dtype} as eager computes it"
# the cast calls read between the compressed probabilities and the importance matmul
CASTS = ("to", "float", "type", "half", "bfloat16", "double")
INF = float("inf")


def single(node: fx.Node, what: str) -> fx.Node:
    return only_user(node, what, "it must stay as it is")


def first_n(node: fx.Node) -> int | None:
    """x[..., :n] or x[:, :, :, :n] on a 4-D x -> n; None for anything else."""
    index = arg(node, 1, "index")
    if op_name(node) != "getitem" or not isinstance(index, tuple) or not index:
        return None
    cut, whole = index[-1], slice(None, None, None)
    lead = index[:-1]
    if not (lead == (Ellipsis,) or len(lead) == 3 and all(s == whole for s in lead)):
        return None
    if isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1) and isinstance(cut.stop, int):
        return cut.stop
    return None


def always(condition) -> bool:
    """A comparison of sizes that holds for every value of their symbols (decided without a guard)."""
    return bool(condition) if isinstance(condition, bool) else statically_known_true(condition)


def kept_columns(out: torch.Tensor | None, n: int, width, clamp: fx.Node | None = None) -> int:
    """The number of block ids, out.shape[-1], when it is min(n, width) (width: the key's, a SymInt
    under symbolic sizes, where it must be n and the width at least n at every size, unless the
    top-k took `clamp` = min(n, width) blocks: then n)."""
    m = None if out is None or out.dtype != torch.int64 else out.shape[-1]
    if clamp is not None and m is not None and same(m, size_of(clamp)):
        return n
    if isinstance(m, int) and (m == min(n, width) if isinstance(width, int) else m == n and always(width >= n)):
        return m
    raise Refused("the block ids are not int64 [B, G, S, n]" + ("" if isinstance(m, int) or m is None else
                  f": their number {m} depends on the sequence length (a key narrower than n at some lengths)"))


def item_users(node: fx.Node, what: str) -> dict[int, fx.Node]:
    """{i: getitem(node, i)} for a node whose users all take one item of its tuple, each once."""
    items = {}
    for user in node.users:
        i = user.args[1] if op_name(user) == "getitem" and len(user.args) == 2 else None
        if not isinstance(i, int) or i in items:
            raise Refused(f"the {what} result is used other than by taking its values and indices")
        items[i] = user
    return items


def op_positions(op: fx.Node):
    """The pos argument of an nsa.compressed_attention node (None: one document per row)."""
    return arg(op, 7, "pos")


def op_offset(op: fx.Node) -> int:
    """The q_offset argument of an nsa.compressed_attention node: the token of its first query row
    (0 but for a chunk of queries)."""
    return arg(op, 8, "q_offset", 0)


def compressed_ops(probs: cmp.Probabilities, block: int) -> list[fx.Node]:
    """The nsa.compressed_attention nodes on these probabilities' q, pooled K, l and scale (their
    stride and positions are compared with what the masks show by the caller)."""
    targets = (torch.ops.nsa.compressed_attention, torch.ops.nsa.compressed_attention.default)
    return [user for user in probs.q.users
            if user.op == "call_function" and user.target in targets and user.args[1] is probs.k
            and (user.args[3], user.args[5]) == (block, probs.scale)]


def key_classes(forced: torch.Tensor, excluded: torch.Tensor, forced_outside: bool) -> torch.Tensor:
    """[S, Ns] (packed: [B, G, S, Ns]) int: 2 where the key is +inf, 0 where -inf, 1 where it is the
    importance, from the cells the +inf and the -inf fills apply to. `forced_outside`: the +inf
    fill is applied last."""
    cls = torch.ones(forced.shape, dtype=torch.int8, device=forced.device)
    if forced_outside:
        return cls.masked_fill(excluded, 0).masked_fill(forced, 2)
    return cls.masked_fill(forced, 2).masked_fill(excluded, 0)


def nsa_classes(S: int, Ns: int, block: int, device, q_offset: int = 0) -> torch.Tensor:
    """NSA's key classes (`key_classes`) [S, Ns] for query rows at tokens q_offset .. q_offset + S - 1."""
    t = q_offset + torch.arange(S, device=device)[:, None]
    j = torch.arange(Ns, device=device)[None, :]
    current = t // block
    forced = (j == 0) | (j == current) | (j == current - 1)
    return key_classes(forced, ~(j * block <= t), forced_outside=True)


def classes_reason(got: torch.Tensor, want: torch.Tensor, block: int, q_offset: int = 0) -> str:
    """Which of NSA's ranking rules the key breaks (query rows from token q_offset)."""
    S = got.shape[0]
    t = torch.arange(S, device=got.device)  # the rows; their tokens are q_offset + t
    current = (q_offset + t) // block
    forced = got == 2
    prefix = f"the key's forced (+inf) and excluded (-inf) blocks are not NSA's for l' = {block}"
    if not bool(forced[:, 0].all()):
        return f"{prefix}: block 0 is not forced"
    if not bool(forced[t, current].all()):
        return f"{prefix}: the current block t // l' is not forced"
    previous = current >= 1
    if not bool(forced[t[previous], current[previous] - 1].all()):
        return f"{prefix}: the block before the current one is not forced"
    if bool((forced & (want != 2)).any()):
        return f"{prefix}: blocks other than 0, t // l' and t // l' - 1 are forced"
    return f"{prefix}: the candidates (finite keys) are not the blocks with j * l' <= t"


def overlap_matrix(Tc: int, Ns: int, l: int, d: int, ls: int, device) -> torch.Tensor:
    """overlap(i, j) / l in float64: tokens shared by [i*d, i*d + l) and [j*l', j*l' + l')."""
    i = torch.arange(Tc, device=device, dtype=torch.float64)[:, None]
    j = torch.arange(Ns, device=device, dtype=torch.float64)[None, :]
    shared = torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)
    return shared.clamp(min=0) / l


# --- packed documents: the block map and the masks read pos; checked on probes -----------------


def selection_probes(B: int, S: int, l: int, d: int, ls: int, n: int, device) -> list[tuple[str, torch.Tensor]]:
    """(name, pos [B, S] int64) probes for the selection blocks, besides compressed_attention's
    (`cmp.position_probes`, for the compression blocks): documents of odd lengths (1, 2, shorter
    than l and l', not multiples of d, longer than n * l'); documents on selection-block boundaries
    and one token off them; random documents up to 2 n l' tokens long. Row b starts the cycle of
    lengths at its b-th entry (random: its own draws), so the rows pack differently."""
    def rotated(cycle):
        return lambda b: cycle[b % len(cycle):] + cycle[: b % len(cycle)]

    gen = torch.Generator().manual_seed(1)
    drawn = torch.randint(1, 2 * n * ls + 2, (B, S), generator=gen, device="cpu").tolist()
    probes = [
        ("odd selection lengths", cmp.documents(B, S, rotated([1, 2, l - 1, d + 1, l + 1, ls - 1, n * ls + 3,
                                                               2 * d + 1, 3, ls + d + 1]))),
        ("documents on and off selection-block boundaries",
         cmp.documents(B, S, rotated([ls, 2 * ls, ls + 1, ls - 1, ls, n * ls + 1, 3 * ls, 1]))),
        ("random long documents", cmp.documents(B, S, lambda b: drawn[b])),
    ]
    return [(name, pos.to(device)) for name, pos in probes]


def packed_classes(pos: torch.Tensor, G: int, Ns: int, block: int) -> torch.Tensor:
    """[B, G, S, Ns] key classes (as `key_classes`) of NSA's per-document rules for positions pos."""
    t = pos[:, None, :, None]  # [B, 1, S, 1]
    j = torch.arange(Ns, device=pos.device)
    current = t // block
    forced = (j == 0) | (j == current) | (j == current - 1)
    classes = key_classes(forced, ~(j * block <= t), forced_outside=True)  # [B, 1, S, Ns]
    return classes.expand(-1, G, -1, -1)


def packed_overlap(start: torch.Tensor, Ns: int, l: int, ls: int, dtype=torch.float64) -> torch.Tensor:
    """[Tc, Ns] overlap / l of slots whose first tokens sit at document positions start [Tc]: the
    shared tokens counted in int64, then converted to `dtype` and divided by l (eager's arithmetic)."""
    s = start[:, None]
    j = torch.arange(Ns, device=start.device)[None, :]
    return (torch.minimum(s + l, (j + 1) * ls) - torch.maximum(s, j * ls)).clamp(min=0).to(dtype) / l


def in_place(node: fx.Node) -> bool:
    """x.clamp_(...), torch.relu_(x), operator.iand(x, y) (x &= y): a node that mutates its input
    (operator.and_ / or_ do not)."""
    name = op_name(node) or ""
    if node.op == "call_function" and getattr(node.target, "__module__", "") in ("_operator", "operator"):
        return name.startswith("i") and (hasattr(operator, name[1:]) or hasattr(operator, name[1:] + "_"))
    return name.endswith("_") and not name.startswith("_")


class PackedProbes:
    """Runs the position subgraphs of a packed key (they read the [B, S] positions pos, a graph
    input) at compile time with probe tensors in place of pos. Keeps one verdict (l' or the
    refusal) per structure: the layers of a model share their subgraphs."""

    def __init__(self):
        self.verdicts: dict = {}  # structure -> the verified value, or its Refused (probe.remembered)

    @staticmethod
    def nodes(roots: list[fx.Node], pos: fx.Node, what: str) -> list[fx.Node]:
        """The nodes between pos and the roots in post-order (inputs first), or Refused where they
        read other data or randomness."""
        nodes, seen, stack = [], set(), [(root, False) for root in reversed(roots)]
        while stack:
            node, done = stack.pop()
            if done:
                if node not in seen:
                    seen.add(node)
                    nodes.append(node)
                continue
            if node in seen or node is pos:
                continue
            if node.op not in ("call_function", "call_method"):
                raise Refused(f"the {what} depend on {node.op} {node.name} (data other than the positions "
                              f"{pos.name} the compressed op was given)")
            name = op_name(node) or ""
            if any(word in name for word in cmp._RANDOM):
                raise Refused(f"the {what} use {name} (random, not positions)")
            for user in node.users:
                if in_place(user):
                    raise Refused(f"the {what} are changed in place ({op_name(user)})")
            stack.append((node, True))
            stack.extend((x, False) for x in reversed(node.all_input_nodes) if x not in seen)
        return nodes

    @staticmethod
    def structure(nodes: list[fx.Node], pos: fx.Node, roots: list[fx.Node]) -> str:
        """What the subgraphs compute from pos, as text: equal texts compute the same functions."""
        index = {pos: "%pos", **{node: f"%{i}" for i, node in enumerate(nodes)}}
        ops = []
        for node in nodes:
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
            if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
                   for x in torch.utils._pytree.tree_leaves(args)):
                raise Refused("the block map or the key masks have symbolic sizes (dynamic shapes): not verified yet")
            ops.append((node.op, node.target, args))
        return repr((ops, [index[r] for r in roots]))

    @staticmethod
    def run(nodes: list[fx.Node], pos: fx.Node, probe: torch.Tensor, roots: list[fx.Node]) -> list:
        """The roots' values with pos = probe."""
        env = {pos: probe}
        last_use = {x: i for i, node in enumerate(nodes) for x in node.all_input_nodes}
        for i, node in enumerate(nodes):
            env[node] = evaluate_node(node, env, "the block map and the key masks on probe positions")
            for x in node.all_input_nodes:  # free what no later node reads
                if last_use[x] == i and x not in roots and x is not pos:
                    env.pop(x, None)
        return [env[r] for r in roots]


def packed_grid(mask, sense: bool, shape: tuple, what: str) -> torch.Tensor:
    """The [B, G, S, Ns] cells a key fill applies to, from its mask evaluated on a probe."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise Refused(f"the {what} is not a bool tensor")
    try:
        return torch.broadcast_to(mask if sense else ~mask, shape)
    except RuntimeError:
        raise Refused(f"the {what} {tuple(mask.shape)} does not broadcast to the key's {shape}") from None


def check_packed_overlap(got, probe: torch.Tensor, H: int, Tc: int, Ns: int, l: int, ls: int, name: str) -> None:
    """Refused unless got, the right operand of p [B, H, S, Tc] @ got, is overlap / l of each slot's
    document position pos[s] for every batch row and head."""
    B = probe.shape[0]
    if not isinstance(got, torch.Tensor) or not got.is_floating_point() or not 2 <= got.dim() <= 4:
        raise Refused("the block map is not a floating-point matrix per batch row ([B, 1, Tc, Ns])")
    dims = (1,) * (4 - got.dim()) + tuple(got.shape)  # matmul broadcasting: leading dims of 1
    if dims[2:] != (Tc, Ns) or dims[0] not in (1, B) or dims[1] not in (1, H):
        raise Refused(f"the block map is {tuple(got.shape)}, not [B, 1, Tc, Ns] = {(B, 1, Tc, Ns)} (packed documents: "
                      "a map per batch row)")
    got = got.reshape(dims)
    slot = torch.arange(Tc, device=probe.device)
    for b in range(B):
        mine = got[min(b, dims[0] - 1)]  # [1 or H, Tc, Ns]
        if torch.equal(mine, packed_overlap(probe[b, :Tc], Ns, l, ls, got.dtype).expand_as(mine)):
            continue  # eager's arithmetic exactly: the usual case, no float64 copies
        mine = mine.double()
        want = packed_overlap(probe[b, :Tc], Ns, l, ls)  # [Tc, Ns] float64
        if torch.equal(mine != 0, (want != 0).expand_as(mine)) and torch.allclose(mine, want.expand_as(mine),
                                                                                 rtol=1e-6, atol=0):
            continue
        if bool((probe[b, :Tc] != slot).any()) and torch.allclose(mine, packed_overlap(slot, Ns, l, ls).expand_as(mine),
                                                                  rtol=1e-6, atol=0):
            raise Refused("the block map counts the slots from the row start (slot s starting at token s) instead "
                          "of their document position pos[s]: blocks would be numbered across documents (on probe "
                          f"positions '{name}')")
        raise Refused(f"the block map is not overlap(s, j) / l of each slot's document position (the tokens "
                      f"[pos[s], pos[s] + l) shares with [j*l', (j+1)*l'), over l = {l}; l' = {ls}) (on probe "
                      f"positions '{name}')")


def packed_classes_reason(got: torch.Tensor, probe: torch.Tensor, block: int, name: str) -> str:
    """Why the key's classes on a packed probe are not NSA's per-document ones."""
    B, G, S, Ns = got.shape
    t = torch.arange(S, device=probe.device).expand(B, S)
    on = f" (on probe positions '{name}')"
    if torch.equal(got, packed_classes(t, G, Ns, block)):
        return ("the key's forced (+inf) and candidate blocks are counted from the token t, not from its document "
                f"position pos[t] (blocks would be numbered across documents){on}")
    return (f"the key's forced (+inf) and excluded (-inf) blocks are not NSA's per document for l' = {block} "
            f"(blocks 0, pos[t] // l', pos[t] // l' - 1 forced; j*l' > pos[t] excluded){on}")


def verify_packed_key(probes: PackedProbes, pos: fx.Node, overlap: fx.Node, forced_fill: tuple, cand_fill: tuple,
                      forced_outside: bool, dims: tuple, l: int, d: int, n: int) -> int:  # fmt: skip
    """l' of a packed ranking key whose block map and forced / candidate masks follow NSA's
    per-document rules on every probe (see the module docstring), else Refused. dims: (B, G, H, S,
    Tc, Ns)."""
    roots = [overlap, forced_fill[1], cand_fill[1]]
    what = "block map and the key masks"
    nodes = probes.nodes(roots, pos, what)
    key = (probes.structure(nodes, pos, roots), forced_fill[2], cand_fill[2], forced_outside, dims, l, d, n)
    return region_probe.remembered(probes.verdicts, key, lambda: _verify_on_probes(
        probes, nodes, pos, roots, forced_fill[2], cand_fill[2], forced_outside, dims, l, d, n))


def _verify_on_probes(probes, nodes, pos, roots, forced_sense, cand_sense, forced_outside, dims, l, d, n) -> int:
    B, G, H, S, Tc, Ns = dims
    cost = sum(value(x).numel() for x in nodes if value(x) is not None and op_name(x) not in cmp._VIEWS)
    if cost > cmp.MAX_VERIFIED_ELEMENTS:
        raise Refused(f"verifying the block map and the key masks takes {cost:,} elements per probe, over the cap "
                      f"of {cmp.MAX_VERIFIED_ELEMENTS:,}: not verified at this size yet")
    device = value(pos).device
    shape = (B, G, S, Ns)

    def classes_on(probe):
        overlap, forced, candidate = probes.run(nodes, pos, probe, roots)
        cls = key_classes(packed_grid(forced, forced_sense, shape, "forced-block mask"),
                          packed_grid(candidate, cand_sense, shape, "candidate mask"), forced_outside)
        return overlap, cls

    # one document per row: the unpacked rules, and l' read from when block 1 enters
    one = torch.arange(S, device=device).expand(B, S).contiguous()
    overlap, cls = classes_on(one)
    block = SelectBlocks.selection_block(cls[0, 0])
    if not torch.equal(cls, packed_classes(one, G, Ns, block)):
        want = nsa_classes(S, Ns, block, device)
        raise Refused(classes_reason(cls[0, 0], want, block) if not torch.equal(cls[0, 0], want) else
                      "the key's forced and excluded blocks differ between batch rows or groups of one document each")
    check_packed_overlap(overlap, one, H, Tc, Ns, l, block, "one document")
    for name, probe in cmp.position_probes(B, S, l, d, device) + selection_probes(B, S, l, d, block, n, device):
        overlap, cls = classes_on(probe)
        if not torch.equal(cls, packed_classes(probe, G, Ns, block)):
            raise Refused(packed_classes_reason(cls, probe, block, name))
        check_packed_overlap(overlap, probe, H, Tc, Ns, l, block, name)
    return block


class SelectBlocks(RewritePass):
    name = "select_blocks"
    summary = "importance map + top-n sort over the compressed probabilities -> nsa.select_blocks from the lse"

    def __init__(self):
        self.lucidrains = LucidrainsChoice()
        self.varlen = VarlenChoice()
        self.noncausal = NonCausalChoice()

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        subgraphs, data, probes = cmp.PositionSubgraphs(Sizes.of(graph)), cmp.data_nodes(graph), PackedProbes()
        self.lucidrains.verdicts.clear()  # verdicts hold nodes of this graph
        self.noncausal.verdicts.clear()
        requested = ctx.config.backend("select_blocks")
        cmp_requested = ctx.config.backend("compressed_attention")
        for node in list(graph.nodes):
            if op_name(node) not in ("sort", "topk") or node._erased:
                continue
            key = value(first_arg(node))
            if key is not None and key.is_floating_point() and (why := unbatched_key(node)) is not None:
                try:  # packed [T, H, D] tokens: read as a computation
                    plan = self.varlen.check(node, requested)
                except Refused as varlen_why:
                    ctx.refused(node, f"{why}; read as a varlen choice: {varlen_why}")
                    continue
                self.varlen.rewrite(graph, plan)
                data = cmp.data_nodes(graph)
                why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
                ctx.matched(node, KERNEL.format(block=plan["block"], n=plan["n"], backend=plan["backend"],
                                                packed=VARLEN, note=TOPK_NOTE, why=why))
                continue
            if key is None or key.dim() != 4 or not key.is_floating_point():
                continue  # the ascending sort of the chosen ids, or a sort of something else
            try:
                if lucidrains_key(first_arg(node)) is not None:  # lucidrains' rule: ranks averaged logits
                    plan = self.lucidrains.check(node, subgraphs, data, requested)
                else:
                    plan = self.check(node, subgraphs, data, requested, cmp_requested, probes)
            except Refused as why:
                try:  # a softmax over unmasked scores: the choice read as a non-causal computation
                    plan = self.noncausal.check(node, requested)
                except NotThisRule:
                    ctx.refused(node, str(why))
                    continue
                except Refused as noncausal_why:
                    ctx.refused(node, f"{why}; read as a non-causal choice (rule 'nsa_vibe'): {noncausal_why}")
                    continue
                self.noncausal.rewrite(graph, plan)
                data = cmp.data_nodes(graph)
                ctx.matched(node, plan["text"])
                continue
            if plan["rule"] == "lucidrains":
                self.lucidrains.rewrite(graph, plan)
                data = cmp.data_nodes(graph)
                ctx.matched(node, plan["text"])
                continue
            self.rewrite(graph, plan)
            data = cmp.data_nodes(graph)  # the graph changed
            why = f"; not triton: {plan['why_not_triton']}" if plan["backend"] != "triton" else ""
            # with one selection block every l' >= S selects the same: say so rather than print S
            block = plan["block"] if plan["Ns"] > 1 else f">={plan['block']}"
            note = TOPK_NOTE if op_name(node) == "topk" else ""
            if plan["clamp"] is not None:
                note += CLAMP_NOTE.format(n=plan["n"])
            packed = ", packed documents (pos)" if plan["pos"] is not None else ""
            if plan.get("per_head", 1) > 1:
                packed += PER_HEAD.format(h=plan["per_head"])
            if plan.get("importance_dtype") is not None:
                packed += ROUNDED.format(dtype=str(plan["importance_dtype"]).removeprefix("torch."))
                if plan.get("group_sum_dtype") is not None:
                    packed += ", the group sum in float32"
                if plan.get("group_first"):
                    packed += ", the group's heads summed (and rounded) before the block map"
            ctx.matched(node, KERNEL.format(block=block, n=plan["n"], backend=plan["backend"], packed=packed, note=note,
                                            why=why))

    def check(self, ranking: fx.Node, subgraphs, data: set, requested: str = "auto",
              cmp_requested: str = "auto", probes: PackedProbes | None = None) -> dict:
        if favoured_key(first_arg(ranking)) is not None:  # fla's rule: the current block set to 1.0
            return self.check_fla(ranking, subgraphs, data, requested, cmp_requested)
        # SymInts in a graph with symbolic sizes: compared with `same` only, numbers at each probe
        B, G, S, width = value(first_arg(ranking)).shape
        # backward from the sort or topk: [pad] <- key <- group sum <- p @ overlap <- p
        padded = first_arg(ranking)
        single(padded, "ranking key")
        key, pad, fillers = padded, 0, []
        if op_name(padded) == "pad":
            key, pad = self.read_pad(padded)
            single(key, "ranking key")
        elif op_name(padded) == "cat":
            key, pad, filler = self.read_cat_pad(padded)
            fillers = [filler]  # erased with the cat, before the key it reads
        Ns = width - pad
        outer_inf = cmp.fill_of(key, INF)
        outer = outer_inf or cmp.fill_of(key, -INF)
        if outer is None:
            raise Refused(noncausal_reason(key, subgraphs) or "the ranking key is not the importance with +inf "
                          "(forced) and -inf (not a candidate) blocks filled in")
        forced_outside = outer_inf is not None  # the +inf fill is applied last
        inner = cmp.fill_of(outer[0], -INF if forced_outside else INF)
        if inner is None:
            raise Refused(noncausal_reason(key, subgraphs) or "the ranking key does not fill both +inf (forced) "
                          "and -inf (not a candidate) blocks")
        single(outer[0], "ranking key")
        forced_fill, cand_fill = (outer, inner) if forced_outside else (inner, outer)
        p_grp = inner[0]
        single(p_grp, "group importance")
        chain = [key, outer[0]]
        widened = None  # p_slc.view(..).float().sum(2): the group sum in float32 (CUDA autocast's, spelled out)
        if op_name(p_grp) == "sum":
            grouped = first_arg(p_grp)
            if (op_name(grouped) in CASTS and isinstance(first_arg(grouped), fx.Node) and value(grouped) is not None
                    and value(grouped).dtype == torch.float32):
                widened = grouped
                single(widened, "importance per head")
                grouped = first_arg(widened)
            dims = arg(p_grp, 1, "dim")
            # sum(.., dtype=torch.float32): the group sum accumulated in float32 (as CUDA autocast runs it)
            if (arg(p_grp, 2, "keepdim", False) or arg(p_grp, 3, "dtype") not in (None, torch.float32)
                    or not isinstance(dims, int)
                    or dims % 5 != 2 or op_name(grouped) not in ("view", "reshape", "unflatten")):
                raise Refused("the importance is not summed over the group's heads (p_slc.view(B, G, h, S, Ns).sum(2))")
            single(grouped, "importance per head")
            p_slc = first_arg(grouped)
            if value(grouped) is None or value(grouped).dim() != 5 or value(p_slc) is None:
                raise Refused("the importance is not summed over the group's heads (p_slc.view(B, G, h, S, Ns).sum(2))")
            h = value(grouped).shape[2]
            if (not isinstance(h, int) or not same(value(grouped).shape, (B, G, h, S, Ns))
                    or not same(value(p_slc).shape, (B, G * h, S, Ns))):
                raise Refused(f"the heads are not grouped as [B, G, h, S, Ns]: {tuple(value(grouped).shape)}")
            chain += [p_grp] + ([widened] if widened is not None else []) + [grouped]
        else:
            p_slc, h = p_grp, 1
        cast_after_matmul(p_slc)
        if op_name(p_slc) not in MATMULS or not all(isinstance(x, fx.Node) for x in p_slc.args[:2]):
            raise Refused("the importance is not the probabilities times a block map (p @ overlap)")
        single(p_slc, "importance per head")
        chain.append(p_slc)
        p, overlap = p_slc.args
        summed_first = []  # the group's heads summed before the block map (torch.einsum's order for 'bghsc,cj->bgsj')
        if h == 1 and op_name(p) == "sum":
            p, h, summed_first = group_summed_first(p, B, G, S)
        p, casts, rounding = importance_casts(p, p_slc)
        cast_view = bool(summed_first) and p is summed_first[-1]
        if cast_view:  # the casts were on the 5-D view: the probabilities are its input
            p = first_arg(p)
        group_first = bool(summed_first) and rounding is not None  # in float32 the two orders differ by rounding only
        group_sum_dtype = None
        if rounding is not None:  # rounded by the matmul: it stays in that dtype up to the sort, or from the
            # group sum on in float32 (CUDA autocast runs sum in float32; or the user's .float() before it)
            if p_grp is not p_slc and value(p_grp) is not None and value(p_grp).dtype == torch.float32:
                group_sum_dtype = torch.float32
            kept_rounding(group_sum_dtype or rounding, [(p_grp, "the group sum"), (outer[0], "the ranking key"),
                                                        (key, "the ranking key"), (padded, "the padded ranking key")])
        elif widened is not None:
            raise Refused(f"the group sum {p_grp.name} reads the importance widened to float32 at {widened.name}, "
                          "but the importance was not rounded: nothing to widen")
        if summed_first:  # users first: the sum, then the casts and the view in the order they read each other
            chain += [summed_first[0], *casts, summed_first[-1]] if cast_view else [summed_first[0], summed_first[-1],
                                                                                    *casts]
        else:
            chain += casts
        probs, op, sizes, (l, d, pos) = self.compressed_source(p, "(p @ overlap)", ranking, subgraphs, data,
                                                                cmp_requested)
        Bp, H, Sp, Tc = probs.shape
        Gk = value(probs.k).shape[1]
        # per-head selection: no group sum and a key per query head (G = H) over grouped compressed
        # keys (Gk < H); the op then sees every query head as its own group of one
        per_head = probs.h if h == 1 and probs.h > 1 and same(G, H) and same(Gk * probs.h, H) else 1
        if not same((Bp, Sp, Gk * per_head, H), (B, S, G, G * h)) or h * per_head != probs.h:
            raise Refused(f"the importance groups {H} heads as {G} x {h}; the compressed keys have {Gk} groups")
        reader = casts[-1] if casts and first_arg(casts[-1]) is p else (summed_first[-1] if summed_first else p_slc)
        others = [u for u in p.users if u is not reader]
        if others:
            names = ", ".join(op_name(u) or u.op for u in others)
            raise Refused(f"the compressed probabilities are also used by {names}: the [B, H, S, Tc] tensor stays, "
                          "and the selection reads it as it is")
        # forward from the sort or topk: values/indices -> first n -> > -inf filter -> ascending sort -> -1 padding
        n, tail, clamp = self.read_choice(ranking, Ns, width)
        final = tail[0]
        if op_name(final) == "where" and final.args[2] == -1:
            read_as_sets(final, requested_selection(ranking))
        q_offset = op_offset(op)  # a chunk of queries: its rows' first token (compressed_attention read it)
        chunk = q_offset if cmp.query_rows(probs.q)[1] is not None else None  # None: the whole sequence
        if pos is None:  # the position-only subgraphs: evaluated, a proof for this shape (or each probe's)
            block = self.key_at_probe_sizes(subgraphs, sizes, (S, Tc, Ns), forced_fill, cand_fill, forced_outside,
                                            overlap, l, d, None if rounding is None else
                                            (upcast_dtype(value(probs.q).dtype), rounding), chunk)
        else:  # packed documents: the subgraphs read pos, checked on probe positions
            block = verify_packed_key(probes or PackedProbes(), pos, overlap, forced_fill, cand_fill, forced_outside,
                                      (B, G, H, S, Tc, Ns), l, d, n)
        order = {node: i for i, node in enumerate(ranking.graph.nodes)}
        if order[op] > order[final] and any(order[x] > order[final] for x in op.all_input_nodes):
            raise Refused("the compressed branch's V is computed after the block selection")
        lse_fake = op.meta["example_value"][1]
        k_fake = value(probs.k) if per_head == 1 else value(probs.k).repeat_interleave(per_head, 1)
        fakes = (value(probs.q), k_fake, lse_fake, l, d, block, n)
        try:
            backend = choose_backend(*fakes, requested, value(pos), "nsa", rounding, group_first)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(select_blocks_backend={requested!r}): {why}") from None
        return {"probs": probs, "op": op, "final": final, "block": block, "Ns": sizes.int(Ns), "n": n, "l": l, "d": d,
                "backend": backend, "pos": pos, "rule": "nsa", "q": probs.q, "k": probs.k, "tiled": None, "clamp": clamp,
                "per_head": per_head, "importance_dtype": rounding, "group_sum_dtype": group_sum_dtype,
                "group_first": group_first,
                "q_offset": q_offset,
                "chain": tail + [ranking] + ([padded] if padded is not key else []) + fillers + chain,
                "roots": [overlap, forced_fill[1], cand_fill[1], p],
                "why_not_triton": why_not_triton(*fakes, value(pos), "nsa", rounding, group_first) if requested == "auto"
                else f"select_blocks_backend={requested!r} in OptimizeConfig"}

    @staticmethod
    def compressed_source(p: fx.Node, form: str, ranking: fx.Node, subgraphs, data: set, cmp_requested: str):
        """The compressed branch behind the probabilities p the importance reads: (probs, its
        nsa.compressed_attention node, the graph's Sizes, (l, d, pos)), or Refused."""
        softmax = cmp.probabilities_softmax(p)
        if softmax is None:
            raise Refused(f"the importance does not read softmax probabilities {form}")
        try:
            probs = cmp.read_probabilities(softmax)
        except Refused as why:
            raise Refused(f"compressed_attention did not rewrite these probabilities ({why}): no lse to select "
                          "from") from None
        if probs.p is not p:
            raise Refused("the importance reads the softmax before its final mask, not the probabilities")
        sizes = subgraphs.sizes if subgraphs.sizes is not None else Sizes.of(ranking.graph)
        try:
            pooling = cmp.pooling_of(cmp.at_sizes(probs, sizes), probs.k, "keys", data, subgraphs.at(sizes))
            ops = compressed_ops(probs, pooling.block)
            if not ops:  # ask the pass why, for the reason
                cmp.PASS.check(softmax, subgraphs, data, cmp_requested)
                raise Refused("disabled")
            # the op exists, so this passed there: (l, d) and, packed, the positions of these masks
            seen = cmp.verify_at_probe_sizes(probs, None, data, subgraphs)
            op = next((op for op in ops if op.args[4] == seen.stride and op_positions(op) is seen.pos
                       and op_offset(op) == seen.q_offset), None)
            if op is None:
                raise Refused(f"the nsa.compressed_attention op on these q and K computes blocks of another stride "
                              f"or other positions than these probabilities (d = {seen.stride})")
        except Refused as why:
            raise Refused(f"compressed_attention did not rewrite these probabilities ({why}): no lse to select "
                          "from") from None
        return probs, op, sizes, (seen.block, seen.stride, seen.pos)

    def check_fla(self, ranking: fx.Node, subgraphs, data: set, requested: str, cmp_requested: str) -> dict:
        """flash-linear-attention's rule (the module docstring's second form) -> the plan of an
        nsa.select_blocks call with rule='fla', or Refused."""
        favoured, grouped, tiled_groups = favoured_key(first_arg(ranking))
        p, fill_mask, fill_sense = cmp.fill_of(favoured, 1.0)
        p, casts, rounding = importance_casts(p, favoured)  # p.to(bf16): the 1.0 and the group sum in bf16
        key = first_arg(ranking)
        B, G, S, Ns = value(key).shape
        chain = [key] + ([grouped] if grouped is not None else []) + [favoured]
        for node in chain:
            single(node, "ranking key")
        if rounding is not None:
            kept_rounding(rounding, [(key, "the ranking key")])
        chain += casts
        h = 1 if grouped is None else value(grouped).shape[1 if tiled_groups else 2]
        probs, op, sizes, (l, d, pos) = self.compressed_source(p, "(the current block set to 1.0)", ranking,
                                                                subgraphs, data, cmp_requested)
        Bp, H, Sp, Tc = probs.shape
        if pos is not None:
            raise Refused("fla's rule (the current block favoured) with packed documents (pos): the op's rule 'fla' "
                          "has no document positions")
        if op_offset(op):
            raise Refused(f"fla's rule (the current block favoured) for a chunk of queries (rows from token "
                          f"{op_offset(op)}): matched over the whole sequence only")
        if not same((Bp, Sp, H), (B, S, G * h)) or not same(Tc, Ns):
            raise Refused(f"the importance [B, G, S, Ns] = {tuple(value(key).shape)} is not the compressed "
                          f"probabilities {tuple(probs.shape)} summed over groups of {h} heads")
        if l != d:
            raise Refused(f"the importance is the compressed probabilities themselves (no block map), so its blocks "
                          f"are the compression blocks: selection blocks of their own need l = d (here l = {l}, "
                          f"d = {d})")
        q_sel, k_sel = probs.q, probs.k
        Gk = value(probs.k).shape[1]
        if tiled_groups and h > 1:  # query head j in group j % G: K must be the compressed keys tiled the same way
            if not tiled(probs.k, h) or probs.h != 1:
                raise Refused("the importance sums the heads of a tiled group (view(B, h, G, S, Ns).sum(1)) but the "
                              "compressed keys are not tiled the same way (K.repeat(1, h, 1, 1))")
            k_sel = None  # the first G heads of the tiled keys: made by `rewrite`
        elif Gk != G or probs.h != h:
            raise Refused(f"the importance groups {H} heads as {G} x {h}; the compressed keys have {Gk} groups")
        if [u for u in p.users if u is not (casts[-1] if casts else favoured)]:
            raise Refused("the compressed probabilities are also used other than by the selection: the [B, H, S, Tc] "
                          "tensor stays")
        n, final, ids, tail, clamp = self.read_fla_choice(ranking, Ns)
        for probe in sizes.probes():  # the favoured block and the -1 rule, evaluated at every probe size
            try:
                self.verify_fla(subgraphs.at(probe), probe, (S, Ns), value(ids).shape, fill_mask, fill_sense,
                                final, ids, l)
            except Refused as why:
                where = f"at the probe sizes {probe.describe()}: " if sizes.symbolic else ""
                raise Refused(f"{where}{why}") from None
        order = {node: i for i, node in enumerate(ranking.graph.nodes)}
        if order[op] > order[final] and any(order[x] > order[final] for x in op.all_input_nodes):
            raise Refused("the compressed branch's V is computed after the block selection")
        lse_fake = op.meta["example_value"][1]
        fakes = (value(probs.q), value(probs.k)[:, :G], lse_fake, l, d, l, n)
        try:
            backend = choose_backend(*fakes, requested, None, "fla", rounding)
        except ValueError as why:
            raise Refused(f"OptimizeConfig(select_blocks_backend={requested!r}): {why}") from None
        return {"probs": probs, "op": op, "final": final, "block": l, "Ns": sizes.int(Ns), "n": n, "l": l, "d": d,
                "backend": backend, "pos": None, "rule": "fla", "q": q_sel, "k": k_sel, "clamp": clamp,
                "tiled": (h, G) if tiled_groups and h > 1 else None, "importance_dtype": rounding,
                "chain": tail + [ranking] + chain, "roots": [fill_mask, p],
                "why_not_triton": why_not_triton(*fakes, None, "fla", rounding) if requested == "auto"
                else f"select_blocks_backend={requested!r} in OptimizeConfig"}

    @staticmethod
    def read_fla_choice(ranking: fx.Node, Ns) -> tuple:
        """topk(key, n, dim=-1).indices, then x.masked_fill(mask(x), -1) (or torch.where(mask, -1, x))
        -> (n, the filled ids, the topk ids, [the nodes after the topk that read the ids, consumers
        first], the size node min(n, Ns) where the topk takes that many: `clamped_count`); the mask
        is checked by `verify_fla`."""
        if op_name(ranking) != "topk":
            raise Refused("fla's rule (the current block favoured) is ranked by torch.topk only")
        k, dim, largest = arg(ranking, 1, "k"), arg(ranking, 2, "dim", -1), arg(ranking, 3, "largest", True)
        if largest is not True or not isinstance(dim, int) or dim % 4 != 3:
            raise Refused("torch.topk does not take the largest keys over the blocks (the key's last dim)")
        clamp = k if clamped_count(k, Ns) is not None else None
        k = clamped_count(k, Ns) or k
        if not isinstance(k, int) or k < 1 or not (clamp is not None or always(Ns >= k)):
            raise Refused(f"torch.topk's k is {k}, not a positive constant at most the number of blocks")
        items = item_users(ranking, "torch.topk")
        values = items.pop(0, None)
        if set(items) != {1} or (values is not None and values.users):
            raise Refused("torch.topk's values are used: the op returns the block ids only")
        ids = items[1]
        finals = [u for u in ids.users if (cmp.fill_of(u, -1) or (None,))[0] is ids]
        if len(finals) != 1:
            raise Refused("the chosen blocks are not set to -1 by one mask (ids.masked_fill(mask, -1))")
        final = finals[0]
        mask = cmp.fill_of(final, -1)[1]
        between = ancestors([mask]) & descendants(ids)
        if set(ids.users) != {final} | (between & set(ids.users)) or ids in ancestors([mask], stop=None) - between - {ids}:
            raise Refused("the chosen blocks are used other than by the -1 mask")
        for node in between:
            if any(u is not final and u not in between for u in node.users):
                raise Refused(f"{node.name}, computed from the chosen blocks, is used outside the -1 mask")
        order = {node: i for i, node in enumerate(ranking.graph.nodes)}
        between_order = sorted(between, key=order.get, reverse=True)
        kept_columns(value(final), k, Ns, clamp)
        return k, final, ids, [final, *between_order, ids] + ([values] if values is not None else []), clamp

    @staticmethod
    def verify_fla(subgraphs, sizes: Sizes, dims: tuple, ids_shape, fill_mask: fx.Node, fill_sense: bool,
                   final: fx.Node, ids: fx.Node, block: int) -> None:
        """Refused unless the 1.0 fill is exactly the current block j == t // l' and the -1 mask
        exactly the chosen blocks after it (id > t // l'), with l' = l = d: the mask evaluated on
        probe block ids covering every block at every (batch, group, token), under these sizes."""
        S, Ns = (sizes.int(x) for x in dims)
        t = torch.arange(S, device="cpu")[:, None]
        filled = subgraphs.evaluate(fill_mask, "favoured-block mask")
        if filled.dtype != torch.bool:
            raise Refused("the favoured-block mask is not bool")
        got = cmp.as_grid(filled if fill_sense else ~filled, S, Ns, "favoured-block mask")
        if not torch.equal(got.cpu(), (torch.arange(Ns, device="cpu") == t // block).expand(S, Ns)):
            raise Refused(f"the blocks set to 1.0 are not exactly the current block t // l' (l' = l = d = {block}): "
                          "fla's rule favours that block only")
        shape = sizes.shape(ids_shape)
        n = shape[-1]
        mask, sense = cmp.fill_of(final, -1)[1:]
        device = value(ids).device
        for first in range(0, Ns, n):  # probe ids (first + c) % Ns in column c: every block somewhere
            probe = ((first + torch.arange(n, device="cpu")) % Ns).expand(shape).contiguous().to(device)
            got = subgraphs.evaluate(mask, "-1 mask on probe block ids", inputs={ids: probe}, probe=f"ids+{first}")
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
                raise Refused("the -1 mask is not a bool tensor")
            try:
                got = torch.broadcast_to(got if sense else ~got, shape).cpu()
            except RuntimeError:
                raise Refused(f"the -1 mask {tuple(got.shape)} does not broadcast to the block ids' {shape}") from None
            want = probe.cpu() > torch.arange(S, device="cpu")[:, None] // block
            if not torch.equal(got, want):
                if torch.equal(got, probe.cpu() > torch.arange(S, device="cpu")[:, None] // block - 1):
                    raise Refused("the -1 mask also drops the current block (id >= t // l'): fla's rule keeps it")
                raise Refused(f"the -1 mask is not exactly the chosen blocks after the current one (id > t // l', "
                              f"l' = {block}) on probe block ids")

    def source_files(self) -> tuple[str, ...]:
        # compressed_attention's matchers and checks are ours too, and block_choice reads the key
        return super().source_files() + (inspect.getfile(cmp), inspect.getfile(block_choice))

    @staticmethod
    def read_pad(padded: fx.Node) -> tuple[fx.Node, int]:
        """F.pad(key, (0, P), value=-inf) -> (key, P)."""
        amounts, mode, fill = arg(padded, 1, "pad"), arg(padded, 2, "mode", "constant"), arg(padded, 3, "value")
        end = size_of(amounts[1]) if isinstance(amounts, (tuple, list)) and len(amounts) >= 2 else None
        if (end is None or amounts[0] != 0 or any(a != 0 for a in amounts[2:]) or not always(end >= 0)
                or mode != "constant"):
            raise Refused("the ranking key is padded other than at the end of its last dim")
        if not cmp.is_const(fill, -INF):
            raise Refused(f"the ranking key is padded with {fill}, not -inf (padded columns could be chosen)")
        return first_arg(padded), end

    @staticmethod
    def read_cat_pad(padded: fx.Node) -> tuple[fx.Node, int, fx.Node]:
        """torch.cat([key, filler], dim=-1) with filler = key.new_full(shape, -inf) or torch.full(shape,
        -inf) of the key's leading dims -> (key, P, filler): F.pad's -inf columns, written another way."""
        tensors, dim, out = arg(padded, 0, "tensors"), arg(padded, 1, "dim", 0), value(padded)
        if (not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or out is None
                or not all(isinstance(t, fx.Node) for t in tensors) or not isinstance(dim, int)
                or dim % out.dim() != out.dim() - 1):
            raise Refused("the ranking key is concatenated with other than one block of columns at the end of its "
                          "last dim")
        key, filler = tensors
        name = op_name(filler)
        fill = arg(filler, 2, "fill_value") if name == "new_full" else arg(filler, 1, "fill_value") if name == "full" else None
        if name not in ("new_full", "full"):
            raise Refused(f"the ranking key is padded by {name}, not a constant block (padded columns could be chosen)")
        if not cmp.is_const(fill, -INF):
            raise Refused(f"the ranking key is padded with {fill}, not -inf (padded columns could be chosen)")
        kv, fv = value(key), value(filler)
        if kv is None or fv is None or kv.dim() != fv.dim() or not all(
                same(a, b) for a, b in zip(kv.shape[:-1], fv.shape[:-1])):
            raise Refused("the -inf columns do not have the ranking key's leading dims")
        if set(filler.users) != {padded} or any(u is not padded and u is not filler for u in key.users):
            raise Refused("the ranking key or its -inf columns are used elsewhere: they must stay as they are")
        return key, size_of(fv.shape[-1]), filler

    @staticmethod
    def read_sort(sort: fx.Node) -> tuple[int, list[fx.Node], None]:
        """torch.sort(key, dim=-1, descending=True, stable=True), both cut to [..., :n]
        -> (n, [first n keys, first n blocks, values, order], None)."""
        dim, descending = arg(sort, 1, "dim", -1), arg(sort, 2, "descending", False)
        if not isinstance(dim, int) or dim % 4 != 3 or descending is not True:
            raise Refused("the ranking key is not sorted in descending order over its last dim")
        if sort.kwargs.get("stable") is not True:
            raise Refused("the sort is not stable (stable=True): the order of tied keys at the n-th place is "
                          "unspecified, the op takes the lower block")
        items = item_users(sort, "sort")
        if set(items) != {0, 1}:
            raise Refused("the sort's values and indices are not both used")
        values, order = items[0], items[1]
        values_n, order_n = single(values, "sorted key"), single(order, "sort order")
        n = first_n(values_n)
        if n is None or first_n(order_n) != n or n < 1:
            raise Refused("the sorted values and order are not cut to the same first n columns")
        return n, [values_n, order_n, values, order], None

    @staticmethod
    def read_topk(topk: fx.Node, width) -> tuple[int, list[fx.Node], fx.Node | None]:
        """torch.topk(key, n, dim=-1), each result optionally cut to [..., :m] with m >= n
        -> (n, [top keys, top blocks, values, indices], the size node min(n, width) where the
        topk takes that many: `clamped_count`). `sorted` does not matter: the chosen blocks are
        sorted ascending afterwards (checked by the caller)."""
        k, dim, largest = arg(topk, 1, "k"), arg(topk, 2, "dim", -1), arg(topk, 3, "largest", True)
        clamp = k if clamped_count(k, width) is not None else None
        k = clamped_count(k, width) or k
        if largest is not True:
            raise Refused("torch.topk(largest=False) takes the lowest-ranked blocks, not the n best")
        if not isinstance(dim, int) or dim % 4 != 3:
            raise Refused(f"torch.topk runs over dim {dim}, not over the blocks (the ranking key's last dim)")
        if not isinstance(k, int) or k < 1:
            raise Refused(f"torch.topk's k is {k}, not a positive constant")
        items = item_users(topk, "torch.topk")
        if set(items) != {0, 1}:
            raise Refused("torch.topk's values and indices are not both used")
        values, order = items[0], items[1]
        values_n = SelectBlocks.whole_topk(values, k, "values", "the op returns the block ids, not the keys")
        order_n = SelectBlocks.whole_topk(order, k, "indices", "it must stay as it is")
        return k, [values_n, order_n, values, order], clamp

    @staticmethod
    def whole_topk(item: fx.Node, k: int, what: str, why: str) -> fx.Node:
        """A topk result, or its one [..., :m] cut when that keeps all k columns; else Refused."""
        user = only_user(item, f"torch.topk {what} tensor", why)
        if op_name(user) != "getitem":
            return item
        m = first_n(user)
        if m is None:
            raise Refused(f"torch.topk's {what} are indexed other than by [..., :n]")
        if m < k:
            raise Refused(f"torch.topk takes k = {k} blocks but its {what} are cut to the first {m}: k is not "
                          "the n blocks kept")
        return user

    @staticmethod
    def read_choice(ranking: fx.Node, Ns: int, width: int) -> tuple[int, list[fx.Node], fx.Node | None]:
        """The chain after the descending sort or topk -> (n, [block_idx, ..., values, order]
        consumers first, the topk's k where it is min(n, width): `clamped_count`)."""
        if op_name(ranking) == "topk":
            n, head, clamp = SelectBlocks.read_topk(ranking, width)
        else:
            n, head, clamp = SelectBlocks.read_sort(ranking)
        values_n, order_n = head[0], head[1]
        valid = single(values_n, "first n keys")
        if (cmp.name_of(valid) not in ("gt", "ne") or len(valid.args) != 2 or valid.args[0] is not values_n
                or not cmp.is_const(valid.args[1], -INF)):
            raise Refused("the first n blocks are not filtered by key > -inf")
        chosen = single(valid, "filter")
        if (op_name(chosen) != "where" or len(chosen.args) != 3 or chosen.args[0] is not valid
                or chosen.args[1] is not order_n or size_of(chosen.args[2]) is None):
            raise Refused("the unchosen slots are not marked with one constant (torch.where(keep, order, past_end))")
        past_end = size_of(chosen.args[2])  # an int, or a SymInt under symbolic sizes (the key's width)
        if single(order_n, "first n blocks") is not chosen:
            raise Refused("the first n blocks are used elsewhere")
        if isinstance(past_end, int) and past_end == -1:  # the blocks in rank order, -1 for the unchosen
            return kept_columns(value(chosen), n, width, clamp), [chosen, valid, *head], clamp
        if not always(past_end >= Ns):
            raise Refused(f"unchosen slots are marked {past_end}, which is a block id (< {Ns})")
        ascending = single(chosen, "chosen blocks")
        dim = arg(ascending, 1, "dim", -1)
        if (op_name(ascending) != "sort" or arg(ascending, 2, "descending", False) or not isinstance(dim, int)
                or dim % 4 != 3):
            raise Refused("the chosen blocks are not sorted ascending over their last dim")
        items = item_users(ascending, "ascending sort")
        dead = [items.pop(1)] if 1 in items and not items[1].users else []  # Dynamo may take it unused
        if set(items) != {0}:
            raise Refused("the ascending sort's indices are used")
        ids = items[0]
        users = list(ids.users)
        final = next((u for u in users if op_name(u) in ("where", "masked_fill")), None)
        if final is None or len(users) != 2:
            raise Refused("the sorted chosen blocks are not padded with -1 (torch.where(ids == past_end, -1, ids))")
        eq = next(u for u in users if u is not final)
        marked = eq.args[1] if len(eq.args) == 2 else None
        if (cmp.name_of(eq) != "eq" or len(eq.args) != 2 or eq.args[0] is not ids or size_of(marked) is None
                or not (marked is chosen.args[2] or isinstance(marked, int) and marked == chosen.args[2])
                or list(eq.users) != [final]):
            raise Refused("the -1 padding does not replace exactly the unchosen slots (ids == past_end)")
        filled = cmp.fill_of(final, -1)
        if filled is None or filled[0] is not ids or filled[1] is not eq or filled[2] is not True:
            raise Refused("the unchosen slots are not set to -1")
        return (kept_columns(value(final), n, width, clamp), [final, eq, ids, *dead, ascending, chosen, valid, *head],
                clamp)

    @staticmethod
    def verify_key(subgraphs, S: int, Tc: int, Ns: int, forced_fill: tuple, cand_fill: tuple, forced_outside: bool,
                   overlap: fx.Node, l: int, d: int, rounded: tuple | None = None,
                   q_offset: int | None = None) -> int:  # fmt: skip
        """l' of a key whose forced and candidate blocks and block map are NSA's (evaluated at
        compile time, every element: a proof for these sizes), else Refused. rounded: (up, dtype)
        where the matmul reads the map rounded to dtype: it must then be exactly the op's weights,
        overlap / l in up rounded to dtype. q_offset (None: the rows are the whole sequence): the
        rows are tokens q_offset + r of a chunk of queries, whose key may show several l'
        (`chunk_selection_blocks`) and may hold more blocks than the chunk reaches (the model's
        Ns is the sequence's, ceil(L / l'): they are -inf on every row of the chunk, never chosen,
        as the classes show): the first l' whose classes and block map are NSA's is taken."""
        cls = key_classes(SelectBlocks.grid(subgraphs, forced_fill, S, Ns, "forced-block mask"),
                          SelectBlocks.grid(subgraphs, cand_fill, S, Ns, "candidate mask"), forced_outside)  # [S, Ns]
        if q_offset is None:
            return SelectBlocks.verify_key_for(subgraphs, cls, SelectBlocks.selection_block(cls), Tc, overlap, l, d,
                                               rounded)
        reasons = []
        for block in SelectBlocks.chunk_selection_blocks(cls, q_offset, Tc * d + l):
            try:
                return SelectBlocks.verify_key_for(subgraphs, cls, block, Tc, overlap, l, d, rounded, q_offset)
            except Refused as why:
                reasons.append(str(why))
        raise Refused(reasons[0])

    @staticmethod
    def chunk_selection_blocks(classes: torch.Tensor, q_offset: int, longest: int) -> list[int]:
        """The l' a chunk's key [S, Ns] may show (rows at tokens q_offset + r), ascending: those with
        t // l' the last block each row keeps (NSA's candidates j*l' <= t end there); several where
        no row of the chunk starts a block (every l' past the chunk's last token when all its rows
        are in block 0, up to `longest`, the pooled sequence's bound Tc*d + l). Refused where none
        fits."""
        S, Ns = classes.shape
        kept = classes != 0
        last = torch.where(kept, torch.arange(Ns, device=classes.device), -1).amax(-1)  # [S]
        t = q_offset + torch.arange(S, device=classes.device)
        sizes = torch.arange(1, max(q_offset + S, longest) + 1, device=classes.device)[:, None]
        blocks = sizes[(t // sizes == last).all(-1)].flatten().tolist()
        if not blocks:
            raise Refused(f"the key's candidates for the query rows from token {q_offset} (a chunk of queries) end at "
                          "no block t // l' for any l' (NSA's candidates are the blocks with j * l' <= t)")
        return blocks

    @staticmethod
    def verify_key_for(subgraphs, cls: torch.Tensor, block: int, Tc: int, overlap: fx.Node, l: int, d: int,
                       rounded: tuple | None = None, q_offset: int = 0) -> int:  # fmt: skip
        """`block` when the key classes cls [S, Ns] and the block map are NSA's for l' = block with
        query rows at tokens q_offset + r, else Refused."""
        S, Ns = cls.shape
        want = nsa_classes(S, Ns, block, cls.device, q_offset)
        if not torch.equal(cls, want):
            raise Refused(classes_reason(cls, want, block, q_offset))
        got = subgraphs.evaluate(overlap, "block map")
        expected = overlap_matrix(Tc, Ns, l, d, block, got.device)
        if rounded is not None:
            up, dtype = rounded
            if tuple(got.shape) != (Tc, Ns) or got.dtype != dtype or not torch.equal(got, expected.to(up).to(dtype)):
                name = str(dtype).removeprefix("torch.")
                raise Refused(f"the block map the {name} matmul reads is not overlap(i, j) / l rounded to {name} (the "
                              f"tokens compression block i shares with selection block j, over l = {l}; d = {d}, "
                              f"l' = {block}), as the op rounds it")
            return block
        if (tuple(got.shape) != (Tc, Ns) or not got.is_floating_point() or not torch.equal(got != 0, expected != 0)
                or not torch.allclose(got.double(), expected, rtol=1e-6, atol=0)):
            raise Refused(f"the block map is not overlap(i, j) / l (the tokens compression block i shares with "
                          f"selection block j, over l = {l}; d = {d}, l' = {block})")
        return block

    @staticmethod
    def key_at_probe_sizes(subgraphs, sizes: Sizes, dims: tuple, forced_fill: tuple, cand_fill: tuple,
                           forced_outside: bool, overlap: fx.Node, l: int, d: int,
                           rounded: tuple | None = None, q_offset: int | None = None) -> int:  # fmt: skip
        """`verify_key` once per probe assignment of the graph's sizes (just the one when static):
        the l' shown where a probe has two selection blocks or more must be one number, and every
        probe with one block (where any l' >= S selects the same) must be shorter than it; else
        Refused naming the sizes. dims: (S, Tc, Ns), SymInts under symbolic sizes."""
        if not sizes.symbolic:  # (ints: a size a guard fixed may still be a SymInt of one number)
            return SelectBlocks.verify_key(subgraphs, *(sizes.int(x) for x in dims), forced_fill, cand_fill,
                                             forced_outside, overlap, l, d, rounded, q_offset)
        found = []  # (sizes, S, Ns, l') per probe
        for probe in sizes.probes():
            S, Tc, Ns = (probe.int(x) for x in dims)
            try:
                block = SelectBlocks.verify_key(subgraphs.at(probe), S, Tc, Ns, forced_fill, cand_fill,
                                                  forced_outside, overlap, l, d, rounded, q_offset)
            except Refused as why:
                raise Refused(f"at the probe sizes {probe.describe()} (S = {S}): {why}") from None
            found.append((probe.describe(), S, Ns, block))
        shown = {block for _, _, Ns, block in found if Ns > 1}
        if len(shown) != 1:
            raise Refused("the key's selection block l' is not one number at every size: " + "; ".join(
                f"{'any ' if Ns == 1 else ''}l' = {block}{' or more' if Ns == 1 else ''} at {where} (S = {S})"
                for where, S, Ns, block in found))
        (block,) = shown
        longer = [(where, S) for where, S, Ns, _ in found if Ns == 1 and S > block]
        if longer:
            raise Refused(f"the key has one selection block at {longer[0][0]} (S = {longer[0][1]}), longer than the "
                          f"l' = {block} it shows at other sizes")
        return block

    @staticmethod
    def grid(subgraphs, fill: tuple, S: int, Ns: int, what: str) -> torch.Tensor:
        """The [S, Ns] cells a key fill applies to, from its position-only mask."""
        mask = subgraphs.evaluate(fill[1], what)
        if mask.dtype != torch.bool:
            raise Refused(f"the {what} is {mask.dtype}, not bool")
        return cmp.as_grid(mask if fill[2] else ~mask, S, Ns, what)

    @staticmethod
    def selection_block(classes: torch.Tensor) -> int:
        """l': the first t where block 1 is forced or a candidate (any l' >= S when Ns = 1)."""
        S, Ns = classes.shape
        if Ns == 1:
            return S
        enters = (classes[:, 1] != 0).nonzero()
        if not len(enters):
            raise Refused("block 1 is never forced nor a candidate")
        block = int(enters[0])
        if block < 1 or -(-S // block) != Ns:
            raise Refused(f"the key has {Ns} blocks, not ceil(S / l') = {-(-S // max(block, 1))} for the l' = {block} "
                          "its masks imply")
        return block

    def rewrite(self, graph: fx.Graph, plan: dict) -> None:
        probs, op, final = plan["probs"], plan["op"], plan["final"]
        order = {node: i for i, node in enumerate(graph.nodes)}
        if order[op] > order[final]:
            final.prepend(op)  # its inputs come earlier (checked); the selection needs its lse
        lse = next((u for u in op.users if op_name(u) == "getitem" and u.args[1] == 1), None)
        if lse is None or order.get(lse, len(order)) > order[final]:
            lse = call(graph, operator.getitem, op, 1, anchor=final)
        packed = () if plan["pos"] is None else (plan["pos"],)
        q, rule = plan["q"], {} if plan["rule"] == "nsa" else {"rule": plan["rule"]}
        if plan.get("q_offset"):  # a chunk of queries: the token of its first row
            rule["q_offset"] = plan["q_offset"]
        if plan.get("importance_dtype") is not None:
            rule["importance_dtype"] = plan["importance_dtype"]
        if plan.get("group_sum_dtype") is not None:
            rule["group_sum_dtype"] = plan["group_sum_dtype"]
        if plan.get("group_first"):
            rule["group_first"] = True
        if plan["tiled"] is not None:  # heads of a tiled group made contiguous: head r*G + g -> g*h + r
            h, G = plan["tiled"]
            q, lse = (call(graph, torch.flatten, call(graph, torch.transpose, call(
                graph, torch.unflatten, x, 1, (h, G), anchor=final), 1, 2, anchor=final), 1, 2, anchor=final)
                for x in (q, lse))
            plan["k"] = call(graph, torch.narrow, probs.k, 1, 0, G, anchor=final)  # head g of a tiled K: KV head g
        if plan.get("per_head", 1) > 1:  # each query head its own group: its KV head's compressed keys, copied
            plan["k"] = call(graph, torch.repeat_interleave, probs.k, plan["per_head"], 1, anchor=final)
        chosen = call(graph, torch.ops.nsa.select_blocks, q, plan["k"], lse, plan["l"], plan["d"], plan["block"],
                      plan["n"], probs.scale, plan["backend"], *packed, anchor=final, **rule)
        if plan["clamp"] is not None:  # the model's min(n, Ns) ids: the op's ids past Ns are -1, cut off
            chosen = call(graph, operator.getitem, chosen, (Ellipsis, slice(None, plan["clamp"])), anchor=final)
        final.replace_all_uses_with(chosen)
        # the selection chain, then what only it used: the masks, and the compressed branch's
        # probabilities and scores (the op computes o and the lse without them)
        erase_replaced(graph, plan["chain"], plan["roots"])


def requested_selection(node: fx.Node) -> str:
    return "auto"  # the selection backend does not change what its check accepts


def read_as_sets(ids: fx.Node, selected_attention_backend: str) -> None:
    """Refused unless every use of `ids` (block ids in rank order, -1 padded) is the token-id and
    mask arithmetic of a selected branch that selected_attention accepts: that pass checks on
    probes that its attention depends on each query's blocks as a set, so the op's ascending order
    gives the same result."""
    from . import selected_attention as sel  # the pass that reads the ids after this one

    graph = ids.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    region, seen, stack = set(), set(), [ids]
    while stack:  # the softmaxes that read the ids (through the token ids, masks and gathers)
        node = stack.pop()
        for user in node.users:
            if user not in seen and len(seen) < 10_000:
                seen.add(user)
                stack.append(user)
    for softmax in [n for n in seen if op_name(n) == "softmax"]:
        try:
            plan = sel.PASS.check(softmax, order, {}, selected_attention_backend)
        except Refused:
            continue
        if plan["block_idx"] is ids:
            region |= ancestors(plan["roots"], stop=ids)
    outside = [u for u in ids.users if u not in region]
    if outside:
        raise Refused(f"the chosen blocks are in rank order (not sorted ascending), and {outside[0].name} reads "
                      "them other than as the blocks of a selected branch that selected_attention accepts: their "
                      "order may matter")


def favoured_key(key: fx.Node):
    """fla's ranking key: (x.masked_fill(mask, 1.0), the [B, ., ., S, Ns] view whose .sum(2)
    (contiguous groups) or .sum(1) (tiled groups) the key is, or None, tiled) or None."""
    grouped, tiled, favoured = None, False, key
    if op_name(key) == "sum":
        grouped, dims = first_arg(key), arg(key, 1, "dim")
        value_ = value(grouped)
        if (arg(key, 2, "keepdim", False) or arg(key, 3, "dtype") is not None or not isinstance(dims, int)
                or value_ is None or value_.dim() != 5 or dims % 5 not in (1, 2)
                or op_name(grouped) not in ("view", "reshape", "unflatten")):
            return None
        tiled, favoured = dims % 5 == 1, first_arg(grouped)
    filled = cmp.fill_of(favoured, 1.0) if isinstance(favoured, fx.Node) else None
    return None if filled is None else (favoured, grouped, tiled)


def tiled(k: fx.Node, h: int) -> bool:
    """k [B, H, Tc, Dk] is KV heads tiled h times over the head axis: x.repeat(1, h, 1, 1), or
    x.repeat(1, 1, h, 1).permute(0, 2, 1, 3) ([B, Tc, G, Dk] keys): head j holds KV head j % G."""
    want = (1, h, 1, 1)
    if op_name(k) in ("permute", "transpose") and isinstance(first_arg(k), fx.Node):
        dims = tuple(d % 4 for d in (k.args[1:] if op_name(k) == "transpose" else
                                     (k.args[1] if len(k.args) == 2 else k.args[1:])))
        if dims not in ((0, 2, 1, 3), (1, 2), (2, 1)):
            return False
        k, want = first_arg(k), (1, 1, h, 1)
    repeats = k.args[1:] if op_name(k) == "repeat" else ()
    if len(repeats) == 1 and isinstance(repeats[0], (tuple, list)):
        repeats = tuple(repeats[0])
    return tuple(repeats) == want


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node computed from `node` (itself excluded)."""
    seen, stack = set(), list(node.users)
    while stack:
        user = stack.pop()
        if user not in seen:
            seen.add(user)
            stack.extend(user.users)
    return seen




def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def importance_casts(operand: fx.Node, p_slc: fx.Node) -> tuple[fx.Node, list[fx.Node], torch.dtype | None]:
    """The casts (.to, .float, .type, ...) between the compressed probabilities and the importance
    matmul p_slc = operand @ map -> (p, [the casts, the one nearest the matmul first], rounding):

    - rounding None: the matmul computes in p's own dtype and no cast rounds p (fp32
      probabilities cast to float32 again, or widened and cast back: exact);
    - rounding bf16 or fp16: the matmul computes in that dtype, p is wider, and the casts round p
      to that dtype and to no other narrower one (autocast's `p.to(bf16)`, written into the graph
      by canonicalize, or the user's own; `p.to(bf16).float().to(bf16)` too: the widening between is
      exact): the op takes importance_dtype=rounding. (fla's rule: p_slc is the 1.0 fill, no matmul.)

    Refused, naming the nodes and dtypes, for any other mixture (p rounded and cast back up: a
    float32 matmul of rounded probabilities; a matmul in a dtype no cast in the graph gives), a
    cast that moves p to another device, or a cast used elsewhere."""
    casts, p = [], operand
    while op_name(p) in CASTS and isinstance(first_arg(p), fx.Node):
        inner = first_arg(p)
        got, was = value(p), value(inner)
        if got is None or was is None:
            break
        if got.device != was.device:
            raise Refused(f"the importance reads the compressed probabilities through a cast to another device "
                          f"({was.device} -> {got.device}) at {p.name}")
        if casts:
            single(p, "cast probabilities")
        casts.append(p)
        p = inner
    if casts:
        single(casts[0], "cast probabilities")
    source, computes = value(p).dtype, value(p_slc).dtype
    changes = [c for c in casts if value(c).dtype != value(first_arg(c)).dtype]  # nearest the matmul first
    narrowed = {value(c).dtype for c in casts if torch.finfo(value(c).dtype).bits < torch.finfo(source).bits}
    path = " -> ".join(f"{x.name} ({dtype_name(value(x).dtype)})" for x in [p, *reversed(casts), p_slc])
    if computes == source and not narrowed:
        return p, casts, None
    if computes in ROUNDINGS and torch.finfo(source).bits > torch.finfo(computes).bits and narrowed == {computes}:
        return p, casts, computes
    if changes:
        last = changes[0]
        raise Refused(f"the importance reads the compressed probabilities through a cast that changes their dtype "
                      f"({value(first_arg(last)).dtype} -> {value(last).dtype}) at {last.name}: {path}; the op "
                      "reproduces one rounding of p to the dtype the importance is computed in (bf16 or fp16, as "
                      "autocast casts it), not this mixture")
    raise Refused(f"the importance {p_slc.name} ({op_name(p_slc)}) computes in {dtype_name(computes)} from "
                  f"{dtype_name(source)} probabilities with no cast in the graph ({path}): a rounding the pass cannot "
                  "read")


def group_summed_first(total: fx.Node, B, G, S) -> tuple[fx.Node, int, list[fx.Node]]:
    """(operand, h, nodes) for the importance's left operand `total` = x.sum(2) of the grouped
    probabilities x [B, G, h, S, Tc] (a view of [B, G * h, S, Tc], cast on one side of it): the
    group's heads summed before the block map, as torch.einsum computes 'bghsc,cj->bgsj'. operand:
    where `importance_casts` starts (the cast after the view, or the view's input); nodes: the sum,
    the casts after the view, the view."""
    why = "the importance is not summed over the group's heads ([B, G, h, S, Tc].sum(2) before the block map)"
    dims, x = arg(total, 1, "dim"), first_arg(total)
    if arg(total, 3, "dtype") is not None:
        raise Refused(f"the group's heads are summed with dtype={arg(total, 3, 'dtype')} before the block map, the sum "
                      "not rounded: the op (group_first) rounds it to the importance dtype, as a sum in that dtype does")
    if (arg(total, 2, "keepdim", False) or not isinstance(dims, int) or not isinstance(x, fx.Node)
            or value(x) is None or value(x).dim() != 5 or dims % 5 != 2):
        raise Refused(why)
    outer, view = [], x
    while op_name(view) in CASTS and isinstance(first_arg(view), fx.Node):
        outer.append(view)
        view = first_arg(view)
    if op_name(view) not in ("view", "reshape", "unflatten") or value(view) is None or value(view).dim() != 5:
        raise Refused(why)
    inner = first_arg(view)
    if outer and op_name(inner) in CASTS:
        raise Refused("the grouped probabilities are cast on both sides of their 5-D view (not read)")
    h = value(view).shape[2]
    if (not isinstance(h, int) or not isinstance(inner, fx.Node) or value(inner) is None
            or not same(value(view).shape[:4], (B, G, h, S))
            or not same(value(inner).shape[:3], (B, G * h, S))):
        raise Refused(f"the heads are not grouped as [B, G, h, S, Tc]: {tuple(value(view).shape)}")
    single(total, "group importance")
    for node in [*outer, view]:
        single(node, "grouped probabilities")
    return (outer[0] if outer else inner), h, [total, *outer, view]


def kept_rounding(rounding: torch.dtype, nodes: list[tuple[fx.Node, str]]) -> None:
    """Refused unless every node (the group sum, the key and its fills, the padding) is in the
    dtype the importance was rounded to: the op's importance stays in it up to the sort."""
    for node, what in nodes:
        got = value(node)
        if got is not None and got.dtype != rounding:
            raise Refused(f"the importance is rounded to {dtype_name(rounding)}, but {what} {node.name} is "
                          f"{dtype_name(got.dtype)}: the op reproduces an importance kept in {dtype_name(rounding)} "
                          "up to the sort, not this mixture")


def cast_after_matmul(node: fx.Node) -> None:
    """Refused, naming the dtypes, where the importance is cast after its matmul (before the group
    sum or the key): a rounding, or a widening, of p @ map that the op does not reproduce."""
    inner = first_arg(node) if op_name(node) in CASTS else None
    if (not isinstance(inner, fx.Node) or op_name(inner) not in (*MATMULS, "sum") or value(node) is None
            or value(inner) is None):
        return
    was, got = value(inner).dtype, value(node).dtype
    if was != got:
        raise Refused(f"the importance is cast from {dtype_name(was)} to {dtype_name(got)} at {node.name} after "
                      f"{inner.name} ({op_name(inner)}): the op keeps the dtype of p @ map up to the sort")


# --- lucidrains' rule: the block choice from the averaged compressed logits (op rule 'lucidrains') ---

LUCIDRAINS_KERNEL = ("nsa.select_blocks[{backend}] (rule 'lucidrains': l'={block}, d={d}, n={n}, the compressed "
                     "logits averaged over l'/d columns{per_head}, a -1e3 sink, kept above 1e-10, the diagonal block "
                     "appended; verified on probe values{note}{why})")
LUCIDRAINS_PER_HEAD = ", per query head (each head its own group: the compressed keys repeated x{h})"
# the data movement read from the scores' right operand back to the compressed keys [B, G, T, Dk]
KEY_MOVES = ("view", "reshape", "flatten", "unflatten", "transpose", "permute", "movedim", "unsqueeze", "squeeze",
             "expand", "repeat_interleave", "contiguous")


def lucidrains_key(p: fx.Node) -> fx.Node | None:
    """softmax(F.pad(a, (1, 0), value=c), dim=-1)[..., 1:] (a sink column dropped after the softmax;
    the padded logits may be cast first: `.float()`, autocast's `.to(torch.float32)`) -> the pad
    node; None for any other ranking key."""
    index = arg(p, 1, "index") if isinstance(p, fx.Node) else None
    if op_name(p) != "getitem" or not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis:
        return None
    cut = index[1]
    if not (isinstance(cut, slice) and cut.start == 1 and cut.stop is None and cut.step in (None, 1)):
        return None
    softmax = first_arg(p)
    if not isinstance(softmax, fx.Node) or op_name(softmax) != "softmax":
        return None
    padded = first_arg(softmax)
    if op_name(padded) in CASTS and isinstance(padded, fx.Node):
        padded = first_arg(padded)
    return padded if op_name(padded) == "pad" else None


class LucidrainsChoice:
    """lucidrains' block choice (tests/corpus/lucidrains_*.py), read as a computation:

        csim = (q @ k_cmp^T) * scale, its invisible columns filled    # k_cmp [B, G, T, Dk], any movement
        p = softmax(F.pad(<the importance of csim[..., m:]>, (1, 0), value=-1e3), dim=-1)[..., 1:]
        values, selected = p.topk(min(n, Jc), dim=-1)
        fmask = values > 1e-10

    Anchored at the topk; the region between q, the compressed keys and p is evaluated at compile
    time on random float64 probe values (two scales, at every probe size of a dynamic graph) and
    must equal the op's `lucidrains_probabilities` for one (d, l') (d with S // d = T - m columns,
    l' = d * the columns per block): the group mean, the averaged columns, the masks and the
    softmax are whatever the model writes, as long as they compute that. m is the number of
    leading memory-slot columns the region cuts off (csim[..., m:]); p [B, G, S, Jc] with the
    group's mean, or [B, H, S, Jc] per query head (the op's groups are then the query heads, the
    compressed keys repeated). Read structurally: the sink -1e3, the topk (largest, last dim, k
    = min(n, Jc) or n), values used only by `> 1e-10`, every value of the region in q's dtype
    but for the softmax and p, which may be float32 (a cast of the padded logits, or CUDA
    autocast's float32 softmax: the op's importance_dtype=torch.float32). Replaced by ids = nsa.select_blocks(q, k_cmp[:, :, m:],
    None, d, d, l', n, scale, rule='lucidrains'): fmask -> ids[..., :k] >= 0 and selected ->
    ids[..., :k].clamp(min=0) (a dropped slot reads block 0, masked as eager's arbitrary id was);
    the diagonal column ids[..., k] is the selected_attention pass's to read. A check on probe
    values, not a proof; topk's order of tied probabilities is unspecified, the op's goes to the
    lower block."""

    def __init__(self):
        self.verdicts: dict = {}  # fingerprint -> (d, l'), or its Refused (probe.remembered)

    def check(self, ranking: fx.Node, subgraphs, data: set, requested: str) -> dict:
        p = first_arg(ranking)
        pad = lucidrains_key(p)
        if op_name(ranking) != "topk":
            raise Refused("lucidrains' choice (a softmax with a sink column) ranked by a sort, not torch.topk: not "
                          "read yet")
        sink = arg(pad, 3, "value")
        if arg(pad, 1, "pad") not in ((1, 0), [1, 0]) or arg(pad, 2, "mode", "constant") != "constant" or \
                not cmp.is_const(sink, LUCIDRAINS_SINK):
            raise Refused(f"the sink column is not F.pad(.., (1, 0), value=-1e3) (value {sink}): rule 'lucidrains' "
                          "has a -1e3 sink")
        sizes = subgraphs.sizes if subgraphs.sizes is not None else Sizes.of(ranking.graph)
        width = value(p).shape[-1]
        k, dim, largest = arg(ranking, 1, "k"), arg(ranking, 2, "dim", -1), arg(ranking, 3, "largest", True)
        n = clamped_count(k, width) or k
        if largest is not True or not isinstance(dim, int) or dim % 4 != 3 or not isinstance(n, int) or n < 1:
            raise Refused("torch.topk is not the n largest probabilities over the blocks (largest, last dim, k a "
                          "constant or min(n, blocks))")
        if not isinstance(k, int) and clamped_count(k, width) is None:
            raise Refused(f"torch.topk's k is {k}, not a constant")
        items = item_users(ranking, "torch.topk")
        if set(items) != {0, 1}:
            raise Refused("torch.topk's values and indices are not both used")
        values, selected = items[0], items[1]
        keep = only_user(values, "torch.topk values tensor", "the op returns block ids, not probabilities")
        if cmp.name_of(keep) != "gt" or len(keep.args) != 2 or keep.args[0] is not values or not \
                cmp.is_const(keep.args[1], LUCIDRAINS_THRESHOLD):
            raise Refused(f"the kept blocks are not those with probability > 1e-10 ({cmp.name_of(keep)} "
                          f"{keep.args[1] if len(keep.args) == 2 else '?'}): rule 'lucidrains' keeps p > 1e-10")
        q, k_cmp, scale = self.sources(p)
        region = self.region(p, q, k_cmp, data)
        dtype = value(q).dtype
        # the softmax and p may be float32 over logits in q's dtype (CUDA autocast runs softmax in float32)
        softmax = first_arg(p)
        softmax_dtype = value(p).dtype if value(p).dtype != dtype and value(p).dtype == torch.float32 else None
        wide = {p, softmax, first_arg(softmax)} - {pad} if softmax_dtype is not None else set()
        for node in region:
            v = value(node)
            if v is not None and v.is_floating_point() and v.dtype != dtype and node not in wide:
                raise Refused(f"{node.name} computes in {v.dtype}, q in {dtype}: rule 'lucidrains' computes the "
                              "choice in q's dtype, step by step (the softmax may be float32)")
        H, G = value(q).shape[1], value(k_cmp).shape[1]
        rows = value(p).shape[1]
        per_head = 1
        if not same(rows, G):
            if not same(rows, H):
                raise Refused(f"the probabilities have {rows} heads, neither the {G} groups nor the {H} query heads")
            per_head = H // G
        m = self.memory_columns(region)
        d, block = self.verify(region, p, q, k_cmp, m, per_head, scale, sizes)
        k_fake = value(k_cmp) if per_head == 1 else value(k_cmp).repeat_interleave(per_head, 1)
        fakes = (value(q), k_fake[:, :, m:], None, d, d, block, n)
        try:
            backend = choose_backend(*fakes, requested, None, "lucidrains", softmax_dtype)
        except ValueError as why:
            raise Refused(f"OptimizeConfig(select_blocks_backend={requested!r}): {why}") from None
        why = (why_not_triton(*fakes, None, "lucidrains", softmax_dtype) if requested == "auto"
               else f"select_blocks_backend={requested!r} in OptimizeConfig")
        why = f"; not triton: {why}" if backend != "triton" else ""
        note = TOPK_NOTE + (CLAMP_NOTE.format(n=n) if not isinstance(k, int) else "")
        per_head_text = LUCIDRAINS_PER_HEAD.format(h=per_head) if per_head > 1 else ""
        if softmax_dtype is not None:
            per_head_text += ", the softmax in float32"
        text = LUCIDRAINS_KERNEL.format(backend=backend, block=block, d=d, n=n, note=note, why=why,
                                        per_head=per_head_text)
        return {"rule": "lucidrains", "ranking": ranking, "keep": keep, "values": values, "selected": selected,
                "p": p, "q": q, "k": k_cmp, "m": m, "per_head": per_head, "d": d, "block": block, "n": n, "k_top": k,
                "scale": scale, "backend": backend, "text": text, "softmax_dtype": softmax_dtype}

    @staticmethod
    def sources(p: fx.Node) -> tuple[fx.Node, fx.Node, float]:
        """(q [B, H, S, Dk], the compressed keys [B, G, T, Dk], scale) of the scores p is computed
        from: the first matmul up p's first-argument chain, times a constant; K read back through
        data movement (transpose, GQA repeat, views)."""
        node = p
        for _ in range(64):
            node = first_arg(node) if isinstance(node, fx.Node) else None
            if node is None or op_name(node) in MATMULS:
                break
        if node is None or op_name(node) not in MATMULS:
            raise Refused("the probabilities are not computed from scores q @ k^T")
        matmul = end = node
        while len(end.users) == 1 and op_name(next(iter(end.users))) in KEY_MOVES:
            end = next(iter(end.users))  # e.g. a grouped product reshaped back to [B, G, h, S, T]
        scaled = next(iter(end.users)) if len(end.users) == 1 else None
        if (scaled is None or cmp.name_of(scaled) != "mul" or len(scaled.args) != 2 or scaled.args[0] is not end
                or not isinstance(scaled.args[1], float)):
            raise Refused("the scores are not (q @ k^T) * scale, with the product used once")
        k = matmul.args[1]
        while isinstance(k, fx.Node) and op_name(k) in KEY_MOVES:
            k = first_arg(k)
        kv = value(k)
        B, S = value(p).shape[0], value(p).shape[2]
        q = matmul.args[0]
        while isinstance(q, fx.Node):  # back through data movement to q as [B, H, S, Dk]
            qv = value(q)
            if (qv is not None and qv.dim() == 4 and kv is not None and same(
                    (qv.shape[0], qv.shape[2], qv.shape[3]), (B, S, kv.shape[-1]))):
                break
            q = first_arg(q) if op_name(q) in KEY_MOVES else None
        qv = value(q) if isinstance(q, fx.Node) else None
        if qv is None or kv is None or kv.dim() != 4:
            raise Refused("the scores' operands are not q [B, H, S, Dk] and compressed keys [B, G, T, Dk] moved into "
                          "place")
        G = kv.shape[1]
        if not isinstance(G, int) or not isinstance(qv.shape[1], int) or qv.shape[1] % G:
            raise Refused(f"the compressed keys have {G} heads, which do not divide the {qv.shape[1]} query heads")
        return q, k, scaled.args[1]

    @staticmethod
    def region(p: fx.Node, q: fx.Node, k: fx.Node, data: set) -> list[fx.Node]:
        """The nodes that compute p from q and k (graph order), or Refused where they read other data."""
        outside = ancestors([q, k])
        nodes = ancestors([p]) - outside
        for node in nodes:
            if node.op in ("placeholder", "get_attr") and not is_size(node):
                raise Refused(f"the block choice reads {node.op} {node.name} besides q and the compressed keys")
            for x in node.all_input_nodes:
                if x in outside and x not in (q, k) and x in data:
                    raise Refused(f"the block choice reads {x.name} besides q and the compressed keys")
        order = {node: i for i, node in enumerate(p.graph.nodes)}
        return sorted(nodes, key=order.__getitem__)

    @staticmethod
    def memory_columns(region: list[fx.Node]) -> int:
        """m of the first x[..., m:] in the region (the memory slots cut off the scores), else 0."""
        for node in region:
            index = arg(node, 1, "index")
            if (op_name(node) == "getitem" and isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
                    and isinstance(index[1], slice) and isinstance(index[1].start, int) and index[1].start > 0
                    and index[1].stop is None and index[1].step in (None, 1)):
                return index[1].start
        return 0

    def verify(self, region, p, q, k, m: int, per_head: int, scale: float, sizes: Sizes) -> tuple[int, int]:
        """(d, l') for which the region equals the op's probabilities on probe values at every
        probe size, else Refused with the first difference. One verdict per region structure."""
        key = (region_probe.fingerprint(region, [q, k]), m, per_head, scale, sizes.shape(value(q)),
               sizes.shape(value(k)), sizes.shape(value(p)))
        return region_probe.remembered(self.verdicts, key,
                                       lambda: self._verify(region, p, q, k, m, per_head, scale, sizes))

    @staticmethod
    def _verify(region, p, q, k, m: int, per_head: int, scale: float, sizes: Sizes) -> tuple[int, int]:
        found = None
        for at in sizes.probes():
            (B, H, S, Dk), (_, G, T, _), Jc = at.shape(value(q)), at.shape(value(k)), at.shape(value(p))[-1]
            where = f" at the probe sizes {at.describe()}" if sizes.symbolic else ""
            one_row, changes, _ = batch_slice.probe_rows(region, [q, k], p, at, "lucidrains' block choice")
            B = one_row or B
            Tc = T - m
            if Jc < 1 or Tc < 1:
                raise Refused(f"the choice has no selection block to rank{where} (S = {S})")
            candidates = [(d, d * per) for per in range(1, Tc + 1) if Tc // per == Jc
                          for d in range(1, S + 1) if S // d == Tc]
            if found is not None:
                candidates = [found] if found in candidates else []
            gen = torch.Generator().manual_seed(17)
            device = value(q).device
            for spread in (1.0, 16.0):  # 16: probabilities below the 1e-10 threshold as well
                qp = (torch.randn(B, H, S, Dk, generator=gen, dtype=torch.float64, device="cpu") * spread).to(device)
                kp = torch.randn(B, G, T, Dk, generator=gen, dtype=torch.float64, device="cpu").to(device)
                env = {q: qp, k: kp, **at.size_nodes()}
                got = region_probe.run(region, env, p, "lucidrains' block choice", changes=changes)
                k_op = (kp if per_head == 1 else kp.repeat_interleave(per_head, 1))[:, :, m:]
                matching = []
                for d, block in candidates:
                    want = lucidrains_probabilities(qp, k_op, d, block, scale)
                    if (want.shape == got.shape and torch.equal(want > LUCIDRAINS_THRESHOLD, got > LUCIDRAINS_THRESHOLD)
                            and torch.allclose(got, want, rtol=1e-9, atol=1e-12)):
                        matching.append((d, block))
                if not matching:
                    raise Refused("the block choice differs from rule 'lucidrains' (the compressed logits of columns "
                                  f"that end before t, averaged per selection block, blocks before t // l' only, a "
                                  f"-1e3 sink) on probe values{where} for every (d, l') with S // d = {Tc} columns "
                                  f"after {m} memory slots and {Jc} blocks")
                candidates = matching
            found = candidates[0]
        return found

    @staticmethod
    def rewrite(graph: fx.Graph, plan: dict) -> None:
        ranking = plan["ranking"]
        k_cmp = plan["k"]
        if plan["per_head"] > 1:  # each query head its own group: its KV head's compressed keys, copied
            k_cmp = call(graph, torch.repeat_interleave, k_cmp, plan["per_head"], 1, anchor=ranking)
        if plan["m"]:
            k_cmp = call(graph, operator.getitem, k_cmp, (slice(None), slice(None), slice(plan["m"], None)),
                         anchor=ranking)
        wide = {} if plan["softmax_dtype"] is None else {"importance_dtype": plan["softmax_dtype"]}
        ids = call(graph, torch.ops.nsa.select_blocks, plan["q"], k_cmp, None, plan["d"], plan["d"], plan["block"],
                   plan["n"], plan["scale"], plan["backend"], anchor=ranking, rule="lucidrains", **wide)
        top = call(graph, operator.getitem, ids, (Ellipsis, slice(None, plan["k_top"])), anchor=ranking)
        plan["keep"].replace_all_uses_with(call(graph, torch.ge, top, 0, anchor=ranking))
        plan["selected"].replace_all_uses_with(call(graph, torch.clamp, top, anchor=ranking, min=0))
        erase_replaced(graph, [plan["keep"], plan["values"], plan["selected"], ranking], [plan["p"]])


# --- packed [T, H, D] tokens (varlen): a block choice over 3-D compressed probabilities -----------

# A varlen block choice is verified on this many random probes of q and the compressed keys.
VARLEN_PROBES = 2
VARLEN = ", packed [T, H, D] tokens (3-D: the choice evaluated on probes against the op, per document (pos))"


class VarlenChoice:
    """A block choice over the 3-D compressed probabilities p [H, T, N] of packed tokens
    (tests/corpus/xunhaolai_varlen.py: the group sum `p.view(G, h, T, N).sum(1)`, each document's
    keys scattered into per-document columns by `x[:, a:b, :n] = ...`, the overlap weights as
    strided sums written in place, the forced blocks by boolean-mask assignments, then
    `topk(n).indices.sort(-1).values` and `ids[ids > q_block] = -1`) after compressed_attention
    rewrote that branch into the op's packed form (one row of T tokens, a slot per token, pos).

    Read as a computation, not a spelling: the region from p to the block ids the rest of the
    graph reads (the ids after the in-place writes into them; `cmp.written_region`, the writes
    included) may read nothing but p and positions. It is run on VARLEN_PROBES random float64
    probes of q and the compressed keys (p from the graph's own compressed branch, run on the same
    probes) and must give exactly `nsa.select_blocks(q, k_slots, lse, l, d, l', n, scale,
    'reference', pos)` (lse from `nsa.compressed_attention` on the same probes), with n the
    top-k's k and l' the block size whose count ceil(longest document / l') is the key's width
    (each candidate tried; the first that matches every probe). A check on probes: float64
    probabilities have no ties but exact zeros, and the op's importance is exp(s - lse) with a
    float32 lse (~1e-7 relative), so a probe can differ only on near ties, which random probes
    do not hold; at the model's own float32 values the choice differs from eager's where eager's
    softmax and exp(s - lse) rank two blocks within float32 rounding the other way (the topk
    note). Static sizes only (the documents are constants of the graph). Both regions (p from the
    probes, the choice from p) run for chunks of query rows (nsa_compile/row_regions.py), so the
    check holds O(rows * N) at any T: the model's p is [H, T, N], 3.2e9 elements at T 65,536."""

    def check(self, ranking: fx.Node, requested: str) -> dict:
        if op_name(ranking) != "topk":
            raise Refused("a varlen block choice is read from its topk (a sort of a 3-D key is not)")
        key, n = first_arg(ranking), arg(ranking, 1, "k")
        if not isinstance(n, int) or arg(ranking, 3, "largest", True) is not True:
            raise Refused("the varlen topk does not take the n largest keys (k a constant, largest=True)")
        softmaxes = [s for s in block_choice.written_from(key) if op_name(s) == "softmax"
                     and value(s) is not None and value(s).dim() == 3]
        if len(softmaxes) != 1:
            raise Refused(f"the 3-D ranking key is computed from {len(softmaxes)} 3-D softmaxes, not one")
        probs = cmp.read_probabilities(softmaxes[0])
        comp = varlen_compressed_op(probs)
        final = varlen_ids(ranking)
        order = {node: i for i, node in enumerate(ranking.graph.nodes)}
        writes = cmp.writes_into(final, len(order), order)  # ids[ids > q_block] = -1
        feeds_writes = ancestors(writes, stop=final) - {final}
        consumers = [u for u in final.users if u not in feeds_writes and u not in writes]
        if not consumers:
            raise Refused("the varlen block ids are read by nothing")
        anchor = min(consumers, key=order.__getitem__)
        if any(order[w] > order[anchor] for w in writes):
            raise Refused("the varlen block ids are written in place after they are first read")
        region = cmp.written_region([final], "varlen block choice", leaves={probs.p}, before=order[anchor])
        G, T, width = cmp.concrete(value(key).shape)
        if cmp.concrete(value(final).shape) != (G, T, n) or value(final).dtype != torch.int64:
            raise Refused(f"the varlen block ids are {tuple(value(final).shape)} {value(final).dtype}, not int64 "
                          f"[G, T, n] = {(G, T, n)}")
        block = self.verify(probs, comp, region, final, n, width)
        q4, k4, _, l, d, scale, _, pos = comp.args
        lse = next((u for u in comp.users if op_name(u) == "getitem" and u.args[1] == 1), None)
        with value(q4).fake_mode:
            fake_lse = value(q4).new_empty(cmp.concrete(value(q4).shape)[:3], dtype=torch.float32)
        try:
            backend = choose_backend(value(q4), value(k4), fake_lse, l, d, block, n, requested, value(pos))
        except ValueError as why:
            raise Refused(f"OptimizeConfig(select_blocks_backend={requested!r}): {why}") from None
        return {"comp": comp, "lse": lse, "final": final, "consumers": consumers, "anchor": anchor, "block": block,
                "n": n, "backend": backend, "region": region, "p": probs.p,
                "why_not_triton": why_not_triton(value(q4), value(k4), fake_lse, l, d, block, n, value(pos))
                if requested == "auto" else f"select_blocks_backend={requested!r} in OptimizeConfig"}

    @staticmethod
    def verify(probs: cmp.Probabilities, comp: fx.Node, region: list, final: fx.Node, n: int, width: int) -> int:
        """l': the block size for which the region gives the op's ids on every probe (Refused
        naming the first probe and query that differ)."""
        _, k4, _, l, d, scale, _, pos_node = comp.args
        # on the graph's device: the region makes its constants there (torch.zeros(.., device=..))
        slots = cmp.evaluate_written(k4.args[0].args[2], "compressed key slots")
        pos = cmp.evaluate_written(pos_node, "positions")
        longest = int(pos.max()) + 1
        blocks = [b for b in range(1, longest + 1) if -(-longest // b) == width] or \
                 [b for b in range(d, longest + 1, d)]
        p_region = cmp.written_region([probs.p], "compressed probabilities", leaves={probs.q, probs.k})
        gen = torch.Generator().manual_seed(0)
        (H, T, Dk), (G, N, _) = cmp.concrete(value(probs.q).shape), cmp.concrete(value(probs.k).shape)
        probes = []  # (q, slots of k, lse, the region's ids) per probe, made when a candidate first needs it

        # both regions for chunks of query rows (the model's p is [H, T, N]: 3.2e9 elements at T 65,536)
        p_rows = RowRegion(p_region, T, {probs.q: 1}, "the compressed probabilities")
        choice_rows = RowRegion(region, T, {}, "the varlen block choice")
        step = min(chunks.rows_per_chunk(row_regions.CHUNK_ELEMENTS) for chunks in (p_rows, choice_rows))
        shape = cmp.concrete(value(final).shape)  # [G, T, n]

        def choice(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            got = torch.empty(shape, dtype=torch.int64, device=pos.device)
            for r0 in range(0, T, step):
                r1 = min(T, r0 + step)
                p = p_rows.run(r0, r1, {probs.q: q, probs.k: k}, keep={probs.p})[probs.p]
                ids = choice_rows.run(r0, r1, {probs.p: p}, keep={final})[final]
                if not isinstance(ids, Rows) or ids.dim != 1 or (ids.a, ids.b) != (0, T):
                    raise Refused("the varlen block ids [G, T, n] do not hold the queries' rows second")
                got[:, r0:r1] = ids.t
            return got

        def probe(i: int):
            while len(probes) <= i:
                q = torch.randn(H, T, Dk, generator=gen, dtype=torch.float64, device="cpu").to(pos.device)
                k = torch.randn(G, N, Dk, generator=gen, dtype=torch.float64, device="cpu").to(pos.device)
                got = choice(q, k)
                k_slots = k.new_zeros(G, T - l + 1, Dk).index_copy(1, slots, k)[None]
                lse = torch.ops.nsa.compressed_attention(q[None], k_slots, k_slots, l, d, scale, "reference", pos)[1]
                probes.append((q, k_slots, lse, got))
            return probes[i]

        failures = {}
        for block in blocks:  # the smallest l' that gives the op's ids on every probe (each checked until it fails)
            for i in range(VARLEN_PROBES):
                q, k_slots, lse, got = probe(i)
                want = torch.ops.nsa.select_blocks(q[None], k_slots, lse, l, d, block, n, scale, "reference", pos)[0]
                if not torch.equal(got, want):
                    g, t = (int(x) for x in (got != want).any(-1).nonzero()[0])
                    failures[block] = (f"on probe {i}, group {g}, token {t} (position {int(pos[0, t])}): "
                                       f"{got[g, t].tolist()}, the op's {want[g, t].tolist()}")
                    break
            else:
                return block
        tried = "; ".join(f"l'={b}: {why}" for b, why in failures.items())
        raise Refused(f"the varlen block choice differs from nsa.select_blocks (l={l}, d={d}, n={n}, per document) "
                      f"for every l' that gives its {width} blocks ({tried})")

    @staticmethod
    def rewrite(graph: fx.Graph, plan: dict) -> None:
        comp, anchor = plan["comp"], plan["anchor"]
        q4, k4, _, l, d, scale, _, pos = comp.args
        order = {node: i for i, node in enumerate(graph.nodes)}
        lse = plan["lse"]
        if lse is None or order[lse] > order[anchor]:
            lse = call(graph, operator.getitem, comp, 1, anchor=anchor)
        chosen = call(graph, torch.ops.nsa.select_blocks, q4, k4, lse, l, d, plan["block"], plan["n"], scale,
                      plan["backend"], pos, anchor=anchor)
        ids = call(graph, operator.getitem, chosen, 0, anchor=anchor)  # [G, T, n]
        for user in plan["consumers"]:
            user.replace_input_with(plan["final"], ids)
        # the choice, then the compressed probabilities and scores (the op computes them from the lse)
        cmp.erase_dead(graph, set(plan["region"]) | {n for n in block_choice.written_from(plan["p"])
                                                       if n.op in ("call_function", "call_method")})


def varlen_compressed_op(probs: cmp.Probabilities) -> fx.Node:
    """The nsa.compressed_attention node compressed_attention wrote for these 3-D probabilities:
    q [1, H, T, D] = q.unsqueeze(0), K the slots index_copy'd from these compressed keys."""
    targets = (torch.ops.nsa.compressed_attention, torch.ops.nsa.compressed_attention.default)
    for view in probs.q.users:
        if op_name(view) != "unsqueeze":
            continue
        for op in view.users:
            k4 = op.args[1] if op.op == "call_function" and op.target in targets and len(op.args) == 8 else None
            copy = first_arg(k4) if isinstance(k4, fx.Node) and op_name(k4) == "unsqueeze" else None
            if (op.args[0] is view and isinstance(copy, fx.Node) and op_name(copy) == "index_copy"
                    and copy.args[3] is probs.k and op.args[5] == probs.scale):
                return op
    raise Refused("compressed_attention did not rewrite the 3-D compressed branch this choice reads (its reason is "
                  "in explain)")


def varlen_ids(ranking: fx.Node) -> fx.Node:
    """The block ids node: topk(..).indices, optionally `.sort(-1).values` (the ids ascending);
    the in-place writes into it are read with the region."""
    indices = [u for u in ranking.users if op_name(u) == "getitem" and u.args[1] == 1]
    if len(indices) != 1 or any(op_name(u) != "getitem" or u.args[1] not in (0, 1) for u in ranking.users):
        raise Refused("the varlen topk's indices are not read once (its values elsewhere)")
    node = indices[0]
    users = list(node.users)
    if len(users) == 1 and op_name(users[0]) == "sort":
        values = [u for u in users[0].users if op_name(u) == "getitem" and u.args[1] == 0]
        if len(values) != 1 or len(users[0].users) != 1:
            raise Refused("the sorted varlen block ids are not read once")
        node = values[0]
    return node


PASS = SelectBlocks()
