"""window_attention: masked dense sliding-window attention -> one GQA-native window-attention op.

Matches (torch IR), anchored at the softmax:
    k_rep = k.repeat_interleave(h, dim=1)            # optional (GQA); k [B, G, S, Dk]
    scores = upcast(q @ k_rep.transpose(-1, -2)) * c  # q [B, H, S, Dk]; upcast: .float(), .to(float32), or none;
                                                      # `* c` optional (q scaled before the product: c = 1)
    p = softmax(scores.masked_fill(~mask, -inf), dim=-1)      # or masked_fill(not_mask, -inf), where(mask, scores, -inf)
    o = p.to(v.dtype) @ v_rep                         # .to optional; v_rep as k_rep
where `mask` [S, S] is computed from positions only (aranges, comparisons, arithmetic). The mask
is evaluated once at compile time and must equal the sliding window exactly: query t sees key s
iff s <= t and t - s < w, for some w >= 1 (w >= S is plain causal attention).

Packed documents (models/nsa.py with pos): the mask [B, 1, S, S] also reads one data tensor, the
positions pos [B, S] int64 (each token's position in its document; in the model's graph the
placeholder l_pos_), and must equal the window within each query's document:
    (s <= t) & (t - s < w) & (s >= t - pos[:, :, None])          # then [:, None]
The pass finds that tensor (the first int64 [B, S] node through which alone the mask reads
data) and cannot evaluate the mask once for all inputs any more. It evaluates it on probe
positions of the real [B, S] shape instead: one document per row (which gives w), documents of
lengths 1, 2, 3, w - 1, w, w + 1, 2w + 1 and 5 in an order that differs per row, and random
packings of a different density per row; each must give exactly the formula above, every
element, chunk by chunk. This is a check on probes, not a proof for every pos, and it holds for
valid positions only (0 at each document start, +1 per token, as the model's check_positions
demands): a mask written with document ids (cumsum of pos == 0) passes, and so it should. The
op then reads the same positions node. Identical mask subgraphs (one per layer) are checked once.
A mask that reads no data takes this path too where it reads one constant int64 [B, S] node
marked CONSTANT_POSITIONS: canonicalize's positions for a varlen window whose documents are
constants (probed the same way; the op reads that constant).

Symbolic sizes (Dynamo's compile after S changed, S a SymInt): the mask is evaluated the same
way at probe sizes (nsa_compile/sizes.py: the S Dynamo saw, +1 and +19) and must be the same
window w at each; a mask causal at every probe (w >= S there) is probed at doubled sizes until
the window shows, and one still causal at CAUSAL_UP_TO is written as w = the longest probe with a
guard S <= it (window_at_probe_sizes). Packed positions at symbolic sizes are refused.

Becomes `torch.ops.nsa.window_attention(q, k, v, w, c, backend[, pos][, q_offset])[0]` on the un-repeated
K/V: no [S, S] scores, no K/V copy (nsa_compile/ops/window.py). The backend is chosen here, from
the fake tensors, and written into the graph: `triton` (this project's window kernels, packed
documents too) on CUDA in fp16/bf16, else `flash` (FA-2 with a window; with pos its varlen form,
one sequence per document, at one host sync per call) on CUDA in fp16/bf16 with equal head dims
<= 256, else `reference` (memory-bounded PyTorch, exact); `explain` shows which and why not the
ones before it.

lucidrains' bucketed local attention (buckets of b queries scoring the previous and their own
bucket's keys, then reshaped back and cut to S: the window of w = b + 1 tokens in another layout)
is read by BucketedWindow where the dense reading refuses a softmax that is not [B, H, S, S]:
the region from q, K, V to the output is evaluated on float64 probes, w and the scale are read
from it and the result must equal the op's reference (see there). Its refusals follow the dense
reason: `<dense reason>; read as bucketed local attention: <why>`.

A chunk of queries (a model's Python loop over query chunks, unrolled by Dynamo; issue 17,
tests/corpus/chunked_queries.py): scores [B, H, S, C] with C != S, q = q_full[:, :, a:b] and
K, V = k_full[:, :, a':b'], v_full[:, :, a':b'] (either may be whole), the mask from positions only
(canonicalize's sdpa rule writes SDPA out where its mask is a window shifted along the keys).
The mask is evaluated for real (whole: a chunk is a few rows) and, widened back to all the keys
K was cut from, must be exactly the window of its widest row at row tokens a + r: every key of
every row's window is inside the slice, so the op reads the whole K/V with q_offset = a (the
op's docstring says why no k_offset). A band off by one token, or a slice that starts after a
key some row's window holds, is refused with the first differing element. Static sizes (a
length Dynamo fixed by a guard included: sizes read as numbers), no packed documents.

Refuses (graph unchanged), with the reason shown by `explain`:
- a mask that depends on data, is not [S, S] over the last two dims, is non-causal, or is not a
  window (off by one, a band that does not reach the diagonal, ...), or S beyond what is verified;
  at symbolic sizes, a mask that is a different window at different probe sizes;
- with positions: other data besides them, a mask that is not [B, 1, S, S] (one per row, the same
  for all heads), or one that differs from the packed window on a probe (a document term off by
  one, a row that ignores pos, ...; the reason names the probe and the first differing element),
  or B * S * S beyond MAX_VERIFIED_PACKED;
- a chunk of queries whose mask is not the window at the slices' offsets, whose K and V are cut
  differently, at symbolic sizes or with packed documents (`<dense reason>; read as a chunk of
  queries: <why>`);
- scores, probabilities or the masked tensor used anywhere else (the dense tensor is needed);
- q, k, v not [B, heads, S, D], or K/V heads that do not divide the query heads.
"""

from __future__ import annotations

import inspect
import math
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile import batch_slice, probe as region_probe
from nsa_compile.ops.window import WINDOW, choose_backend
from nsa_compile.ops.window import window_attention as window_attention_op
from nsa_compile.attention_match import Refused, ancestors, erase_replaced, keep_mask, only_user, strip_upcast, unrepeat
from nsa_compile.fx import MATMULS, arg, call, contiguous_if_read_by_layout, op_name, value
from nsa_compile.mask_rows import CHUNK_ELEMENTS, RowChunks, mask_nodes, real_device
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes, is_size

from .compressed_attention import first, query_rows, unbatched
from .selected_attention import constant, output_after, product_after, same

KERNEL = "nsa.window_attention[{backend}] (w={window}{docs}, GQA-native, no S x S tensor{why})"


def why_not_faster(requested: str, backend: str, q, k, v, pos) -> str:
    """What `explain` adds after the kernel: why 'auto' passed over the backends before the one it
    took (the op's declared order: triton, then flash), or that the config named reference."""
    if backend == "reference" and requested == "reference":
        return f"; not triton or flash: window_attention_backend={requested!r} in OptimizeConfig"
    if requested != "auto":
        return ""
    return "".join(f"; not {name}: {why}" for name, why in WINDOW.passed_over(backend, q, k, v, pos))


def single_user(node: fx.Node, what: str) -> fx.Node:
    return only_user(node, what, "the dense tensor is needed")


def split_scale(node: fx.Node) -> tuple[fx.Node, float]:
    """scores * c, c * scores, scores / c -> (scores, scale); unscaled scores (q scaled before the
    product, or no scale) -> (scores, 1.0)."""
    name, (a, b) = op_name(node), (node.args + (None, None))[:2]
    if name == "mul" and isinstance(b, (int, float)) and isinstance(a, fx.Node):
        return a, float(b)
    if name == "mul" and isinstance(a, (int, float)) and isinstance(b, fx.Node):
        return b, float(a)
    if name in ("truediv", "div") and isinstance(b, (int, float)) and isinstance(a, fx.Node):
        return a, 1.0 / float(b)
    if name in ("mul", "truediv", "div"):
        raise Refused("the scores are not scaled by a constant (q @ k^T * c)")
    return node, 1.0


MAX_VERIFIED_S = 131072  # S * S = 2^34 mask elements, in chunks, on the device of the mask's code
# A packed mask is checked on 4 probes of B * S * S elements each (plus the row that gives w):
# 2^35 is batch 2 at S = 128k or batch 8 at S = 64k, a few seconds of chunks on a GPU per model
# (the layers share one check).
MAX_VERIFIED_PACKED = 2**35


def mask_rows(mask: fx.Node, S: int, positions: tuple[fx.Node, torch.Tensor] | None = None,
              sizes: Sizes | None = None):
    """A function (r0, r1) -> rows r0..r1 of the mask as an [r1 - r0, S] tensor (with positions
    (leaf, probe): [B, r1 - r0, S]), computed for real in row chunks (nsa_compile/mask_rows.py:
    O(rows * S) memory at any S, every element computed; a node that is not row-local is
    refused with its name)."""
    chunks = RowChunks([mask], S, S, positions, sizes)

    def rows(r0: int, r1: int) -> torch.Tensor:
        out = chunks(r0, r1)[0]
        return out.expand(*out.shape[:-1], S)  # a mask of one value per row, over every key

    return rows


def widest_row(rows, S: int, step: int) -> int:
    """The most keys any query keeps, for a bool, causal mask, or Refused. `rows(r0, r1)` gives
    the kept entries of rows r0..r1 ([r1 - r0, S], or [B, r1 - r0, S] for a packed mask), `step`
    rows at a time."""
    w = 0
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        keep = rows(r0, r1)
        if keep.dtype != torch.bool:
            raise Refused(f"the mask is {keep.dtype}, not bool")
        t = torch.arange(r0, r1, device=keep.device)[:, None]
        s = torch.arange(S, device=keep.device)[None, :]
        if bool((keep & (s > t)).any()):
            raise Refused("the mask is non-causal: a query sees a later key")
        w = max(w, int(keep.sum(-1).max()))
    if w == 0:
        raise Refused("the mask hides every key from every query")
    return w


def window_of(rows, S: int) -> int:
    """The w with mask == (s <= t) & (t - s < w), checked chunk by chunk over all S rows, or
    Refused saying how it differs. `rows(r0, r1)` gives the kept (True) entries of rows r0..r1."""
    step = max(1, CHUNK_ELEMENTS // S)
    w = widest_row(rows, S, step)  # first pass: causal, and the widest row
    for r0 in range(0, S, step):  # second pass: exactly the window of that width
        r1 = min(S, r0 + step)
        keep = rows(r0, r1)
        t = torch.arange(r0, r1, device=keep.device)[:, None]
        s = torch.arange(S, device=keep.device)[None, :]
        if not torch.equal(keep, (s <= t) & (t - s < w)):
            raise Refused("the mask is causal but not a sliding window (s <= t and t - s < w for any w)")
    return w


def kept_rows(mask: fx.Node, keep_where_true: bool, S: int, sizes: Sizes | None = None):
    """(r0, r1) -> the kept entries of rows r0..r1 (mask_rows, negated where the mask is the
    dropped set)."""
    chunk = mask_rows(mask, S, sizes=sizes)
    return chunk if keep_where_true else (lambda r0, r1: ~chunk(r0, r1))


# --- a chunk of queries over a slice of the keys ------------------------------------------------


# The most elements of a chunk's mask [S, C] that is evaluated (whole: a chunk is a few rows).
MAX_VERIFIED_CHUNK = 2**28


def chunk_mask(mask: fx.Node, keep_where_true: bool, S: int, C: int, sizes: Sizes) -> torch.Tensor:
    """The kept entries [S, C] of a chunk's mask (static sizes; the size nodes the graph reads, e.g.
    a slice's end min(s0 + chunk, S), as `sizes` gives them), computed for real, whole (its
    subgraph from positions only: nsa_compile/mask_rows.mask_nodes); Refused where it reads data,
    is not one [S, C] pattern for every batch row and head, or is over MAX_VERIFIED_CHUNK."""
    if S * C > MAX_VERIFIED_CHUNK:
        raise Refused(f"the mask has {S * C:,} elements, over the cap of {MAX_VERIFIED_CHUNK:,}: not verified at this "
                      "size yet")
    numbers = sizes.size_nodes()
    got = region_probe.run(mask_nodes([mask], known=numbers), dict(numbers), mask, "the mask",
                           device=str(real_device(value(mask))))
    if got.dtype != torch.bool:
        raise Refused(f"the mask is {got.dtype}, not bool")
    if (got.dim() < 2 or any(d != 1 for d in got.shape[:-2]) or got.shape[-2] not in (1, S)
            or got.shape[-1] not in (1, C)):
        raise Refused(f"the mask is {list(got.shape)}, not one [S, C] = [{S}, {C}] pattern for all rows and heads")
    keep = got.reshape(got.shape[-2:]).expand(S, C)
    return keep if keep_where_true else ~keep


def key_slice(x: fx.Node, shape) -> tuple[fx.Node, int]:
    """(the tensor K or V was cut from, the token of its first key): `full[:, :, a:b]` (or
    `full.narrow(2, a, n)`, a constant a) -> (full, a); any other x -> (x, 0). `shape`: a fake
    tensor's sizes as numbers (Sizes.shape)."""
    start, length = query_rows(x, shape)
    return (x, 0) if length is None else (first(x), start)


def _chunk_difference(keep: torch.Tensor, want: torch.Tensor, t: torch.Tensor, r0: int, k_offset: int, C: int,
                      w: int) -> str:
    """How the kept entries `keep` [c, L] of query rows r0.. (tokens t [c, 1]) over all L keys
    (False outside the slice k_offset .. k_offset + C - 1) differ from the window `want`, in words:
    the band shifted by a token either way (these rows are that window, one token off), else the
    first differing element."""
    s = torch.arange(keep.shape[1], device=keep.device)[None, :]
    for shift, what in ((1, "t - w + 2 .. t + 1: the next token, not t - w + 1"),
                        (-1, "t - w .. t - 1: not itself, but t - w")):
        if torch.equal(keep, (s <= t + shift) & (t + shift - s < w) & (s >= k_offset) & (s < k_offset + C)):
            return f"the band is shifted by one token: query t sees the keys {what} (w = {w})"
    row, key = (int(i) for i in (keep != want).nonzero()[0])
    token = int(t[row, 0])
    at = f"query row {r0 + row} (token {token}) "
    if bool(want[row, key]) and not k_offset <= key < k_offset + C:
        end = f"starts at token {k_offset}, after" if key < k_offset else f"ends before token {k_offset + C}, at"
        return (f"the key slice {end} key {key}, which {at}sees in a window of {w} (tokens {token - w + 1}..{token}): "
                "the slice misses keys of the window")
    if bool(want[row, key]):
        return f"{at}does not see key {key} of its window of {w} (tokens {token - w + 1}..{token})"
    if key > token:
        return f"{at}sees the later key {key} (non-causal)"
    return f"{at}sees key {key}, outside its window of {w} (tokens {token - w + 1}..{token})"


def chunk_window_of(keep: torch.Tensor, q_offset: int, k_offset: int, L: int) -> int:
    """The w of the mask of a chunk of queries over a slice of the keys, or Refused naming the first
    differing element. `keep` [S, C]: the kept entries of query rows r (tokens q_offset + r) over
    key columns j (tokens k_offset + j of the L tokens K/V were cut from). Widened back to all L
    keys (nothing kept outside the slice), it must be exactly the window (s <= t) & (t - s < w), w
    its widest row: so every key that any row's window holds lies inside the slice, and the op may
    read the whole K/V. Checked CHUNK_ELEMENTS at a time (O(rows * L) memory)."""
    S, C = keep.shape
    w = int(keep.sum(-1).max()) if S else 0
    if w == 0:
        raise Refused("the mask hides every key from every query")
    step = max(1, CHUNK_ELEMENTS // max(L, 1))
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        widened = torch.zeros(r1 - r0, L, dtype=torch.bool, device=keep.device)
        widened[:, k_offset:k_offset + C] = keep[r0:r1]
        t = q_offset + torch.arange(r0, r1, device=keep.device)[:, None]
        s = torch.arange(L, device=keep.device)[None, :]
        want = (s <= t) & (t - s < w)
        if not torch.equal(widened, want):
            raise Refused(f"a chunk of queries from token {q_offset} over keys {k_offset}..{k_offset + C - 1}: the "
                          f"mask is not a sliding window: {_chunk_difference(widened, want, t, r0, k_offset, C, w)}")
    return w


# Under symbolic sizes a mask that is causal at every probe size (w >= S) has not shown its
# window yet: the probes double until one reaches this S, and a mask still causal at the longest
# probe S_top is rewritten with w = S_top and a guard S <= S_top (a longer S compiles again).
CAUSAL_UP_TO = 8192


def window_at_probe_sizes(mask: fx.Node, keep_where_true: bool, S, sizes: Sizes) -> int:
    """The w of a mask in a graph with symbolic sizes (S a SymInt): the mask is evaluated, every
    element, at each probe size (sizes.probes(): the size Dynamo saw, +1 and +19) and must be the
    same window w at all of them (Refused naming the sizes where it is not). Where every probe is
    shorter than the window (the mask is causal at each), the probes double until the window shows
    (w < S), or past CAUSAL_UP_TO; see there."""
    found = {}  # S at a probe -> its widest row (= S where the mask is causal there)
    probes = sizes.probes()
    while True:
        for probe in probes:
            n = probe.int(S)
            if n not in found:
                found[n] = window_of(kept_rows(mask, keep_where_true, n, probe), n)
        windows = {w for n, w in found.items() if w < n}
        if len(windows) > 1:
            raise Refused("at symbolic sizes the mask is a different window at different S: "
                          + ", ".join(f"w={w} at S={n}" for n, w in sorted(found.items())))
        if windows:
            (w,) = windows
            short = [n for n, got in found.items() if got == n and n > w]
            if short:  # causal at a size longer than the window shown elsewhere
                raise Refused(f"at symbolic sizes the mask is causal at S={short[0]} but a window of {w} at a "
                              "shorter S")
            return w
        top = max(found)
        if top >= CAUSAL_UP_TO:
            # causal at every probe up to `top`: w = top is the same attention for every S <= top,
            # and a guard keeps this graph to those S (bool() on the SymInt records it; a longer S
            # compiles again)
            if not bool(S <= top):
                raise Refused(f"the mask showed no window up to S={top}")  # not reached: S's own size is a probe
            return top
        probes = [probe.scaled(2) for probe in probes]


# --- packed documents: the mask also reads positions, checked on probes ------------------------


# Node meta: a constant int64 [B, S] positions tensor that canonicalize's sdpa rule built from a
# mask of constant document bounds (a varlen layout); the packed path reads it as it reads l_pos_.
CONSTANT_POSITIONS = "nsa_constant_positions"


def _is_data(node: fx.Node) -> bool:
    return node.op not in ("call_function", "call_method")


def positions_of(mask: fx.Node, B, S) -> fx.Node | None:
    """The packed form's positions: the first int64 [B, S] node (graph order) through which alone
    the mask reads data. First, so that it is the positions themselves (l_pos_, or a slice of
    it), not a tensor the mask computes from them, such as document ids (cumsum of pos == 0),
    that would be probed as if it held positions. A mask that reads no data has positions only
    where one constant positions node marked CONSTANT_POSITIONS (canonicalize's documents of
    constant bounds) feeds it. None where the mask reads no data (and no such node), reads no
    such tensor, or has symbolic sizes (the unpacked path then refuses the data as it always
    has); Refused where it reads the positions and other data too."""
    nodes = ancestors([mask])
    data = [n for n in nodes if _is_data(n) and not isinstance(n.meta.get("example_value"), torch.SymInt)]
    if not data:
        marked = [n for n in nodes if n.meta.get(CONSTANT_POSITIONS) and (val := value(n)) is not None
                  and val.dtype == torch.int64 and tuple(val.shape) == (B, S)]
        return marked[0] if len(marked) == 1 else None
    if not isinstance(B, int) or not isinstance(S, int):
        raise Refused(f"the mask reads {data[0].op} {data[0].name} (packed positions?) in a graph with symbolic "
                      "sizes: packed documents are verified at static sizes only (OptimizeConfig(dynamic=False))")
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    tables = [n for n in nodes if (val := value(n)) is not None and val.dtype == torch.int64
              and all(isinstance(d, int) for d in val.shape) and tuple(val.shape) == (B, S)]
    first_data = None
    for leaf in sorted(tables, key=order.__getitem__):
        data = [n for n in ancestors([mask], stop=leaf) if n is not leaf and _is_data(n)]
        if not data:
            return leaf
        first_data = first_data or min(data, key=order.__getitem__)
    if first_data is None:  # no int64 [B, S] tensor: data, as before
        return None
    raise Refused(f"the mask depends on {first_data.op} {first_data.name} (data other than the positions, "
                  "an int64 [B, S] tensor)")


def _positions(starts: torch.Tensor) -> torch.Tensor:
    """starts [B, S] bool (True where a document begins; column 0 is forced) -> pos [B, S] int64."""
    starts = starts.clone()
    starts[:, 0] = True
    t = torch.arange(starts.shape[1], device=starts.device)
    last_start = torch.where(starts, t, 0).cummax(dim=1).values
    return t - last_start


def document_probes(B: int, S: int, window: int, device) -> list[tuple[str, torch.Tensor]]:
    """(name, pos [B, S] int64) probes: one document per row; documents of lengths 1, 2, 3,
    w - 1, w, w + 1, 2w + 1 and 5 repeated, in an order rotated by one per row (so no two rows
    pack alike, and documents start both on and off multiples of w); random packings whose
    density differs per row (from a document every other token to a few per row)."""
    t = torch.arange(S, device="cpu")
    lengths = torch.tensor([n for n in (1, 2, 3, window - 1, window, window + 1, 2 * window + 1, 5) if n >= 1],
                           device="cpu")
    structured = torch.zeros(B, S, dtype=torch.bool, device="cpu")
    for b in range(B):
        ends = lengths.roll(-b).repeat(S // int(lengths.sum()) + 1).cumsum(0)
        structured[b, ends[ends < S]] = True
    gen = torch.Generator().manual_seed(0)
    density = torch.tensor([0.5, 0.1, 1.0 / max(2, window), 4.0 / max(4, S)], device="cpu").repeat(B // 4 + 1)[:B]
    random = torch.rand(B, S, generator=gen, device="cpu") < density[:, None]
    return [("one document per row", t.expand(B, S).contiguous().to(device)),
            ("documents of lengths 1, 2, 3, w - 1, w, w + 1, 2w + 1, 5, per row in another order",
             _positions(structured).to(device)),
            ("random packings, denser in some rows", _positions(random).to(device))]


def _packed_window(t: torch.Tensor, s: torch.Tensor, start: torch.Tensor, window: int) -> torch.Tensor:
    """(s <= t) & (t - s < w) & (s >= start) for queries t [1, c, 1], keys s [1, 1, S] and their
    document starts start [B, c, 1]: [B, c, S]."""
    return (s <= t) & (t - s < window) & (s >= start)


def _difference(keep: torch.Tensor, t: torch.Tensor, s: torch.Tensor, start: torch.Tensor, window: int) -> str:
    """How the kept entries `keep` [B, c, S] differ from the packed window, in words: the
    document term off by one either way (the whole chunk is that mask), else what the first
    differing entry shows."""
    if torch.equal(keep, _packed_window(t, s, start - 1, window)):
        return ("the document term is off by one: a query sees the last token of the previous document "
                "(s >= t - pos[t] - 1, not s >= t - pos[t])")
    if torch.equal(keep, _packed_window(t, s, start + 1, window)):
        return ("the document term is off by one: a query does not see its document's first token "
                "(s > t - pos[t], not s >= t - pos[t])")
    want = _packed_window(t, s, start, window)
    b, row, key = (int(i) for i in (keep != want).nonzero()[0])
    query, first = int(t[0, row, 0]), int(start[b, row, 0])
    where = f" (first at batch row {b}, query {query}, key {key}, document start {first})"
    if not bool(keep[b, row, key]):
        return "the mask hides a key of the query's own document inside the window" + where
    if key > query:
        return "a query sees a later key (non-causal)" + where
    if key < first:
        return "a query sees a key of an earlier document" + where
    return "a query sees a key outside the window" + where


def check_against_probe(rows, probe: torch.Tensor, window: int, S: int, name: str) -> None:
    """rows(r0, r1) [B, r1 - r0, S] (the kept entries with pos = probe) must be the packed window
    (s <= t) & (t - s < w) & (s >= t - pos[t]) in every element, or Refused saying how not."""
    B = probe.shape[0]
    step = max(1, CHUNK_ELEMENTS // (B * S))
    s = torch.arange(S, device=probe.device)[None, None, :]
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        keep = rows(r0, r1)
        if keep.dtype != torch.bool:
            raise Refused(f"the mask is {keep.dtype}, not bool")
        t = torch.arange(r0, r1, device=probe.device)[None, :, None]
        start = t - probe[:, r0:r1, None]  # [B, c, 1]: the query's document start
        if not torch.equal(keep, _packed_window(t, s, start, window)):
            raise Refused(f"on probe positions ({name}): {_difference(keep, t, s, start, window)}")


class _Input:
    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"<input {self.i}>"


def _structure(nodes: list[fx.Node], leaf: fx.Node, mask: fx.Node) -> str:
    """What the mask computes from the positions, as text: equal texts compute the same function
    (same ops, constants and wiring), so one check serves both (the layers of a model)."""
    index = {leaf: 0, **{node: i + 1 for i, node in enumerate(nodes)}}
    ops = [(n.op, n.target, fx.node.map_arg((n.args, n.kwargs), lambda x: _Input(index[x]))) for n in nodes]
    return repr((ops, index[mask]))


def document_window_of(mask: fx.Node, leaf: fx.Node, keep_where_true: bool, B: int, S: int,
                       checked: dict) -> int:
    """The w of a packed mask that reads the positions `leaf`, or Refused: its shape must put
    one [S, S] pattern per batch row (the same for all heads), w is its widest row with one
    document per row, and every probe of `document_probes` must give the packed window of that w
    exactly. `checked` maps the structures already checked (this graph) to their w."""
    shape = tuple(value(mask).shape)
    lead = (1, 1, *shape[:-2])[-2:]  # (batch, heads) as the mask broadcasts against [B, H, S, S]
    if len(shape) > 4 or lead[1] != 1 or lead[0] not in (1, B):
        raise Refused(f"the mask is {list(shape)}: with positions it must be [B, 1, S, S] (one pattern per "
                      "batch row, the same for all heads)")
    if B * S * S > MAX_VERIFIED_PACKED:
        raise Refused(f"B * S * S = {B * S * S:,} mask elements per probe, over the cap of {MAX_VERIFIED_PACKED:,}: "
                      "the packed mask is not verified at this size yet")
    key = (_structure(mask_nodes([mask], leaf), leaf, mask), B, S, keep_where_true)
    if key in checked:
        return checked[key]
    device = real_device(value(leaf))

    def kept_rows(probe):
        rows = mask_rows(mask, S, (leaf, probe))
        return rows if keep_where_true else (lambda r0, r1: ~rows(r0, r1))

    # w: the widest row with one document per row; then every probe (that one too) exactly
    window = widest_row(kept_rows(torch.arange(S, device=device).repeat(B, 1)), S,
                        max(1, CHUNK_ELEMENTS // (B * S)))
    for name, probe in document_probes(B, S, window, device):
        check_against_probe(kept_rows(probe), probe, window, S, name)
    checked[key] = window
    return window


# --- lucidrains' bucketed local attention, read as a computation --------------------------------

BUCKETED_KERNEL = ("nsa.window_attention[{backend}] (w={window}: bucketed local attention read on probe values, "
                   "distances 0..{reach}; {heads}, no bucket scores{why})")
_PRODUCTS = MATMULS + ("einsum",)


def _product_operands(node: fx.Node) -> list:
    """The tensor operands of a matmul / bmm (left, right) or an einsum (in its equation's order)."""
    if op_name(node) == "einsum":
        rest = node.args[1:]
        return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    return [arg(node, 0, "input"), arg(node, 1, "other", arg(node, 1, "mat2"))]


def _dead_size(node: fx.Node) -> bool:
    """A size read from a tensor that nothing uses (a sym_size a rewrite before left behind)."""
    return is_size(node) and not node.users


class BucketedWindow:
    """lucidrains' sliding window (tests/corpus/lucidrains_shared_kv.py `local_attention`): the
    sequence padded to a multiple of the bucket size b, viewed as [B, H, S / b, b, D]; each
    bucket's queries score the previous bucket's and their own keys (look-around: pad, narrow,
    cat), under a mask from positions (padding -1, dist < 0, dist > b) filled with -finfo.max; the
    softmax, p @ V, and back to [B, H, S, Dv] with the padding cut off ([..., :S, :]). The same
    function as the window op of w = b + 1 tokens (distances 0..b), in another layout.

    Read as a computation, in any spelling (canonicalize's rewrites of the einsums included): from
    a softmax whose probabilities multiply V, the output is p @ v followed forward through data
    movement (squeeze, unflatten, permute, reshape, the [:S] cut) to a [B, H, S, Dv] tensor. Its
    inputs are q [B, H, S, Dk], K [B, G, S, Dk] and V [B, G, S, Dv]: among the nodes that only the
    output uses (and the tensors they read), the earliest 4-D float tensor [B, heads, S, D] (S the
    output's) that reaches only the scores' left operand, only their right one, only p @ v's V.
    The region is every node between them and the output that only the output uses, and it must
    read nothing else but sizes. The K/V repeat per head (repeat_kv) is inside the region where
    only it uses the copy; a repeat_interleave(h, 1) input is read through (the op takes the
    un-repeated K/V); else K/V are taken as given (G = H).
    The window and the scale are read from the region by evaluating it at compile time on float64
    probes: with q = 0 every kept key weighs the same, so V = s + 1 gives each row's mean kept
    position, hence the widest window w; with one query/key direction and V = [s == 1] row 1
    gives sigmoid(scale), hence the scale (the graph's constant multiply where it agrees). Then two
    random probes must equal nsa.window_attention(q, K, V, w, scale, 'reference') to 1e-9 (every
    row, the padding cut off); at symbolic sizes at each probe size, with the same w and scale. A
    check on probes, not a proof. A softmax in fp16/bf16 is refused as the dense reading refuses
    it (the op computes it in float32): under autocast it runs in float32.
    Only softmaxes that are not [B, H, S, S] over q's S are read this way (the dense window's
    refusals stand as they are)."""

    @staticmethod
    def region_of(softmax: fx.Node) -> dict | None:
        """{out, pv, nodes, q, k, v} where the softmax is followed by p @ v, the region computing
        the output reads three float tensors besides sizes (q, K, V as the scores read them) and
        the output is [B, H, S, Dv] over q's [B, H, S]; None for any other softmax."""
        found = product_after(softmax, _PRODUCTS)  # softmax -> [cast] -> [unsqueeze] -> p @ v
        if found is None:
            return None
        prev, pv = found
        operands = _product_operands(pv)
        if not operands or operands[0] is not prev:
            return None
        out = output_after(pv)
        order = {n: i for i, n in enumerate(softmax.graph.nodes)}
        scores = softmax
        for _ in range(16):  # the scores product up the softmax's float-tensor argument chain
            tensors = [x for x in scores.all_input_nodes if value(x) is not None and value(x).is_floating_point()]
            scores = tensors[0] if tensors else None
            if scores is None or op_name(scores) in _PRODUCTS:
                break
        if scores is None or op_name(scores) not in _PRODUCTS or len(_product_operands(scores)) != 2:
            return None
        ov, probs = value(out), value(softmax)
        if ov is None or ov.dim() != 4 or probs is None:
            return None
        B, S = ov.shape[0], ov.shape[2]
        if same(tuple(probs.shape), (B, ov.shape[1], S, S)):
            return None  # the dense [B, H, S, S] form: the dense matcher's reading stands
        # q, K, V: where the region starts, the earliest [B, heads, S, D] float tensor (S the
        # output's) that reaches only the scores' left operand, only the right one, only p @ v's
        region, region_leaves = BucketedWindow._exclusive(out, set(), order)
        region |= set(region_leaves)
        operands = (*_product_operands(scores), _product_operands(pv)[1])
        reach = [ancestors([x], into_sizes=False) & region for x in operands]

        def starts(i: int) -> fx.Node | None:
            others = set().union(*(r for j, r in enumerate(reach) if j != i))
            found = [n for n in reach[i] - others if (val := value(n)) is not None and val.is_floating_point()
                     and val.dim() == 4 and same(val.shape[0], B) and same(val.shape[2], S)]
            return min(found, key=order.__getitem__) if found else None

        q, k, v = (starts(i) for i in range(3))
        if q is None or k is None or v is None:
            return None
        inside, leaves = BucketedWindow._exclusive(out, {q, k, v}, order)
        if {x for x in leaves if not is_size(x)} != {q, k, v} or not same(value(q).shape[:3], ov.shape[:3]):
            return None
        return {"out": out, "pv": pv, "nodes": sorted(inside, key=order.__getitem__), "q": q, "k": k, "v": v,
                "scores": scores}

    @staticmethod
    def _exclusive(out: fx.Node, stops: set, order: dict) -> tuple[set, list]:
        """(nodes, leaves): `out` and every call that only they use, not walking past `stops` (nor
        past x[i] of a tensor x from outside: the one unpacked is the input); and the nodes they
        read from outside."""
        inside = {out}
        for n in sorted(ancestors([out]) - {out}, key=order.__getitem__, reverse=True):
            if (n not in stops and n.op in ("call_function", "call_method") and n.users
                    and all(u in inside or _dead_size(u) for u in n.users)):
                inside.add(n)
        inside -= {n for n in inside if op_name(n) == "getitem" and isinstance(n.args[1], int)
                   and n.args[0] not in inside and n is not out}
        leaves = []
        for n in inside:
            leaves += [x for x in n.all_input_nodes if x not in inside and x not in leaves]
        return inside, leaves

    @staticmethod
    def check(softmax: fx.Node, region: dict, requested: str, sizes: Sizes, verified: dict) -> dict:
        q, k_in, v_in, out, nodes = region["q"], region["k"], region["v"], region["out"], region["nodes"]
        # as the dense reading: the op's float32 softmax is eager's only where eager upcasts too
        low = value(softmax)
        if low is not None and low.dtype in (torch.float16, torch.bfloat16):
            raise Refused(f"the softmax runs in {low.dtype}; the op computes it in torch.float32")
        k, h_k = unrepeat(k_in)
        v, h_v = unrepeat(v_in)
        if h_k != h_v:
            k, h_k, v, h_v = k_in, 1, v_in, 1  # repeated differently: K/V as given
        qv, kv, vv = value(q), value(k), value(v)
        H, G = qv.shape[1], kv.shape[1]
        constant("query tensor", H=H, G=G, Dk=qv.shape[3], Dv=vv.shape[3])
        if not (same(qv.shape[:1] + qv.shape[2:3], kv.shape[:1] + kv.shape[2:3]) and same(kv.shape[:3], vv.shape[:3])
                and H % G == 0 and same(qv.shape[3], kv.shape[3])):
            raise Refused(f"q {tuple(qv.shape)}, K {tuple(kv.shape)} and V {tuple(vv.shape)} do not fit as "
                          "[B, H, S, Dk], [B, G, S, Dk], [B, G, S, Dv]")
        if value(out).dtype != vv.dtype:
            raise Refused(f"the branch gives {value(out).dtype} from V in {vv.dtype}: the op's output is in V's dtype")
        key = (region_probe.fingerprint(nodes, [q, k_in, v_in]), sizes.shape(qv), sizes.shape(kv), sizes.shape(vv),
               h_k)
        if key not in verified:
            verified[key] = BucketedWindow.verify(region, (q, k, v), h_k, sizes)
        window, scale = verified[key]
        try:
            backend = choose_backend(qv, kv, vv, requested)
        except ValueError as why:
            raise Refused(f"OptimizeConfig(window_attention_backend={requested!r}): {why}") from None
        heads = "GQA-native" if G < H else "K/V as given, one per query head"
        text = BUCKETED_KERNEL.format(backend=backend, window=window, reach=window - 1, heads=heads,
                                      why=why_not_faster(requested, backend, qv, kv, vv, None))
        return {"out": out, "nodes": nodes, "q": q, "k": k, "v": v, "window": window, "scale": scale,
                "backend": backend, "text": text}

    @staticmethod
    def graph_scale(scores: fx.Node) -> float | None:
        """The constant c of `scores * c` (or / c) between the scores product and the softmax."""
        for node in scores.users:
            if op_name(node) in ("mul", "truediv", "div"):
                try:
                    _, c = split_scale(node)
                except Refused:
                    return None
                return c
            if op_name(node) in ("squeeze", "unsqueeze", "view", "reshape", "permute", "transpose", "float", "to"):
                return BucketedWindow.graph_scale(node)
        return None

    @staticmethod
    def verify(region: dict, leaves: tuple, h: int, sizes: Sizes) -> tuple[int, float]:
        """(w, scale) read from the region on probe values (class docstring), or Refused."""
        q, _, v = leaves
        q_in, k_in, v_in, nodes, out = region["q"], region["k"], region["v"], region["nodes"], region["out"]
        device = value(q).device
        graph_c = BucketedWindow.graph_scale(region["scores"])
        found = {}  # S at a probe -> (w, scale)
        for at in sizes.probes():
            where = f" at the probe sizes {at.describe()}" if sizes.symbolic else ""
            one_row, changes, _ = batch_slice.probe_rows(nodes, [q_in, k_in, v_in], out, at, "the bucketed window")
            (B, H, S, Dk), (_, G, _, Dv) = at.shape(value(q)), at.shape(value(v))
            B = one_row or B

            sizes_at = at.size_nodes()

            def run(qp, kp, vp, sizes_at=sizes_at, shape=(B, H, S, Dv), where=where, changes=changes):
                env = {q_in: qp, k_in: kp.repeat_interleave(h, 1), v_in: vp.repeat_interleave(h, 1), **sizes_at}
                got = region_probe.run(nodes, env, out, "the bucketed window", device=str(device), changes=changes)
                if tuple(got.shape) != shape:
                    raise Refused(f"the bucketed window gives {tuple(got.shape)} on probe values{where}, "
                                  f"not [B, H, S, Dv] = {shape}")
                return got

            f64 = {"dtype": torch.float64, "device": device}
            gen = torch.Generator().manual_seed(0)
            # the window: q = 0 weighs every kept key alike, so row t's output is the mean of its kept s + 1
            t = torch.arange(S, dtype=torch.float64, device=device)
            mean = run(torch.zeros(B, H, S, Dk, dtype=torch.float64, device=device),
                       torch.randn(B, G, S, Dk, generator=gen, device="cpu").to(**f64),
                       (t + 1)[:, None].expand(B, G, S, Dv).contiguous())[..., 0]
            widths = 2 * t - 2 * mean + 3  # t - lo + 1 for kept keys lo..t
            if not bool(torch.isfinite(widths).all()):
                raise Refused(f"the bucketed window gives non-finite rows on probe values{where}")
            window = int(widths.max().round())
            if window < 1:
                raise Refused(f"the bucketed window keeps no key of a query on probe values{where}")
            # the scale: row 1 keeps keys 0 and 1 (w >= 2); scores c * q1.k1 = c and c * q1.k0 = 0, V = [s == 1]
            scale = 1.0
            if window >= 2 and S >= 2:
                qp = torch.zeros(B, H, S, Dk, dtype=torch.float64, device=device)
                qp[..., 0] = 1
                kp = torch.zeros(B, G, S, Dk, dtype=torch.float64, device=device)
                kp[:, :, 1, 0] = 1
                vp = torch.zeros(B, G, S, Dv, dtype=torch.float64, device=device)
                vp[:, :, 1, :] = 1
                p = run(qp, kp, vp)[0, 0, 1, 0]
                if not 0 < float(p) < 1:
                    raise Refused(f"the bucketed window's scale could not be read (row 1 weighs key 1 by {float(p)} "
                                  f"on probe values{where})")
                scale = math.log(float(p) / (1 - float(p)))
                if graph_c is not None and math.isclose(scale, graph_c, rel_tol=1e-9):
                    scale = graph_c
            for seed in (1, 2):
                gen = torch.Generator().manual_seed(seed)
                qp, kp, vp = (torch.randn(*shape, generator=gen, device="cpu").to(**f64)
                              for shape in ((B, H, S, Dk), (B, G, S, Dk), (B, G, S, Dv)))
                got = run(qp, kp, vp)
                want = window_attention_op(qp, kp, vp, window, scale, "reference")
                if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
                    bad = (got - want).abs().amax(dim=(0, 1, 3)).argmax()
                    raise Refused(f"the bucketed window differs from nsa.window_attention (w={window}: distances "
                                  f"0..{window - 1}, scale {scale:.6g}) on probe values{where}, first at query "
                                  f"{int(bad)}")
            found[S] = (window, scale)
        windows = {w for n, (w, _) in found.items() if w < n}  # a window narrower than S shows its w
        scale = next(iter(found.values()))[1]
        if (len(windows) > 1 or any(not math.isclose(c, scale, rel_tol=1e-9) for _, c in found.values())
                or (windows and any(w >= n > min(windows) for n, (w, _) in found.items()))):
            raise Refused("at symbolic sizes the bucketed window differs between probe sizes: "
                          + ", ".join(f"w={w}, scale {c:.6g} at S={n}" for n, (w, c) in sorted(found.items())))
        if not windows and sizes.symbolic:
            raise Refused("at symbolic sizes the bucketed window reaches past every probe size: w not read")
        return (windows.pop() if windows else next(iter(found.values()))[0]), scale

    @staticmethod
    def rewrite(graph: fx.Graph, plan: dict) -> None:
        out = plan["out"]
        both = call(graph, torch.ops.nsa.window_attention, plan["q"], plan["k"], plan["v"], plan["window"],
                    plan["scale"], plan["backend"], anchor=out)
        new = call(graph, operator.getitem, both, 0, anchor=out)
        out.replace_all_uses_with(contiguous_if_read_by_layout(graph, new, out, out))
        for node in plan["nodes"]:  # sizes read from the region's tensors that nothing uses
            for user in [u for u in node.users if _dead_size(u)]:
                graph.erase_node(user)
        erase_replaced(graph, list(reversed(plan["nodes"])), [])


class WindowAttention(RewritePass):
    name = "window_attention"
    summary = "masked dense sliding-window (or causal) attention -> nsa.window_attention, no S x S tensor"

    def source_files(self) -> tuple[str, ...]:
        # the row-chunk evaluation of the masks; the probe evaluation and the helpers of the bucketed reading
        return super().source_files() + (inspect.getfile(RowChunks), inspect.getfile(region_probe),
                                         inspect.getfile(constant))

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        checked = {}  # packed masks already checked on probes in this graph -> their w
        bucketed = {}  # bucketed windows already read on probes in this graph -> (w, scale)
        for softmax in list(graph.nodes):
            if op_name(softmax) != "softmax" or softmax.graph is not graph or softmax._erased:
                continue
            try:
                plan = self.check(softmax, ctx.config.backend("window_attention"), checked)
            except Refused as why:
                self.bucketed(graph, softmax, ctx, str(why), bucketed)
                continue
            self.rewrite(graph, softmax, plan)
            why = plan["why_not_faster"]
            docs = ("" if plan["pos"] is None else ", per document (pos)") + (
                f", query rows from token {plan['q_offset']} over the whole K/V" if plan["chunk"] else "")
            ctx.matched(softmax, KERNEL.format(window=plan["window"], docs=docs, backend=plan["backend"], why=why))

    def bucketed(self, graph: fx.Graph, softmax: fx.Node, ctx: PassContext, dense_reason: str, verified: dict) -> None:
        """A softmax the dense reading refused (`dense_reason`): rewritten where it is lucidrains'
        bucketed window (BucketedWindow), else refused with the dense reason (and, where the region
        has the bucketed form's inputs, why the bucketed reading failed)."""
        region = BucketedWindow.region_of(softmax)
        if region is None:
            ctx.refused(softmax, dense_reason)
            return
        try:
            plan = BucketedWindow.check(softmax, region, ctx.config.backend("window_attention"), Sizes.of(graph),
                                        verified)
        except Refused as why:
            ctx.refused(softmax, f"{dense_reason}; read as bucketed local attention: {why}")
            return
        BucketedWindow.rewrite(graph, plan)
        ctx.matched(softmax, plan["text"])

    def check(self, softmax: fx.Node, requested: str = "auto", checked: dict | None = None) -> dict:
        probs = value(softmax)
        dim = arg(softmax, 1, "dim")
        if probs is None or probs.dim() != 4 or dim is None or dim % 4 != 3:
            raise Refused(unbatched(probs, dim) or "not a softmax over the last dim of [B, H, S, S] scores")
        cast, pv = self.product(softmax)
        B, _, S, S2 = probs.shape
        if not statically_known_true(S == S2):
            return self.check_chunk(softmax, cast, pv, requested)
        found = self.read(softmax, cast, pv)
        mask, keep_where_true, (qv, kv, vv) = found["mask"], found["keep_where_true"], found["shapes"]
        sizes = Sizes.of(softmax.graph)
        pos = positions_of(mask, B, S)
        if pos is None and sizes.symbolic:  # positions only, at symbolic sizes: on probe sizes
            window = window_at_probe_sizes(mask, keep_where_true, S, sizes)
        elif pos is None:  # positions only: evaluated once, every element (a proof for this S)
            if S > MAX_VERIFIED_S:
                raise Refused(f"S = {S} > {MAX_VERIFIED_S}: the mask is not verified at this length yet")
            window = window_of(kept_rows(mask, keep_where_true, S), S)
        else:  # packed documents: checked on probe positions
            window = document_window_of(mask, pos, keep_where_true, B, S, {} if checked is None else checked)
        try:  # from the fake tensors: device, dtype, head dims
            backend = choose_backend(qv, kv, vv, requested, value(pos))
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(window_attention_backend={requested!r}): {why}") from None
        return {**found, "window": window, "backend": backend, "pos": pos, "q_offset": 0, "chunk": False,
                "why_not_faster": why_not_faster(requested, backend, qv, kv, vv, value(pos))}

    def check_chunk(self, softmax: fx.Node, cast: fx.Node | None, pv: fx.Node, requested: str) -> dict:
        """A softmax over [B, H, S, C] scores (C != S): a chunk of queries over a slice of the keys
        (a model's loop over query chunks), or Refused with the dense reason. q = q_full[:, :, a:b]
        gives q_offset = a (`query_rows`; else 0), K = k_full[:, :, a':b'] the key offset a' (else
        0, K whole), V cut as K; the mask, from positions only, evaluated for real, must be the
        window at those offsets with every key of every row's window inside the slice
        (`chunk_window_of`). The op then reads the whole K/V it was cut from, with q_offset.
        Static sizes only; not with packed documents."""
        _, _, S, C = value(softmax).shape
        dense = f"scores are {S} x {C}: queries and keys differ (not self-attention)"
        try:
            found = self.read(softmax, cast, pv)
        except Refused:
            raise Refused(dense) from None
        # sizes as numbers: a graph Dynamo compiled again at a new length may hold sizes that its
        # guards fixed (SymInts of no symbol, the slices' ends `min(s0 + chunk, S)` among them)
        sizes = Sizes.of(softmax.graph)
        q, k, v, mask = found["q"], found["k"], found["v"], found["mask"]
        q_offset, rows_of = query_rows(q, sizes.shape)
        (k_full, k_offset), (v_full, v_offset) = key_slice(k, sizes.shape), key_slice(v, sizes.shape)
        if rows_of is None and k_full is k:  # neither cut from a longer sequence
            raise Refused(dense)
        why = f"{dense}; read as a chunk of queries"
        if sizes.symbolic:
            raise Refused(f"{why}: at symbolic sizes (dynamic shapes) chunks are not read")
        kf, vf = value(k_full), value(v_full)
        ks, vs = sizes.shape(kf), sizes.shape(vf)
        if k_offset != v_offset or len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
            raise Refused(f"{why}: K and V are cut differently (keys from token {k_offset} of {ks}, values from token "
                          f"{v_offset} of {vs})")
        S, C, L = sizes.int(S), sizes.int(C), ks[2]
        if rows_of is not None and rows_of != L:
            raise Refused(f"{why}: the queries are rows {q_offset}..{q_offset + S - 1} of {rows_of} tokens, the keys "
                          f"{L} tokens")
        if q_offset + S > L:
            raise Refused(f"{why}: query rows up to token {q_offset + S - 1} past the keys' {L} tokens")
        B = value(q).shape[0]
        if positions_of(mask, B, S) is not None:
            raise Refused(f"{why}: the mask reads positions (packed documents are matched over the whole sequence)")
        try:
            window = chunk_window_of(chunk_mask(mask, found["keep_where_true"], S, C, sizes), q_offset, k_offset, L)
        except Refused as err:
            raise Refused(f"{why}: {err}") from None
        qv = found["shapes"][0]
        try:
            backend = choose_backend(qv, kf, vf, requested)
        except ValueError as err:
            raise Refused(f"OptimizeConfig(window_attention_backend={requested!r}): {err}") from None
        return {**found, "k": k_full, "v": v_full, "window": window, "backend": backend, "pos": None,
                "q_offset": q_offset, "chunk": True,
                "why_not_faster": why_not_faster(requested, backend, qv, kf, vf, None)}

    @staticmethod
    def product(softmax: fx.Node) -> tuple[fx.Node | None, fx.Node]:
        """(the cast of p, or None; p @ v) after the softmax, each the only user; else Refused."""
        nxt = single_user(softmax, "probability tensor")
        cast = None
        if op_name(nxt) in ("to", "type_as"):
            cast, nxt = nxt, single_user(nxt, "probability tensor")
        if op_name(nxt) not in MATMULS or nxt.args[0] is not (cast or softmax):
            raise Refused("the probabilities are not multiplied by V (p @ v)")
        return cast, nxt

    def read(self, softmax: fx.Node, cast: fx.Node | None, pv: fx.Node) -> dict:
        """The dense window's region before its softmax (whose `product`: cast, pv): the masked,
        scaled (and upcast) q @ K^T, K/V un-repeated; Refused where the chain has another form or
        a tensor in it is used elsewhere."""
        H = value(softmax).shape[1]
        masked = softmax.args[0]
        scaled = masked.args[0] if op_name(masked) == "masked_fill" else arg(masked, 1, "input")
        mask, keep_where_true = keep_mask(masked, scaled)
        single_user(masked, "masked score tensor")
        single_user(scaled, "score tensor")
        raw, scale = split_scale(scaled)
        qk = strip_upcast(raw)
        if raw is not qk:
            single_user(raw, "score tensor")
        # the op computes scores as the eager code does only if that code upcasts like it:
        # fp16/bf16 -> fp32, fp32 and fp64 unchanged
        low, high = value(qk), value(raw)
        if low is not None and high is not None:
            expected = torch.float32 if low.dtype in (torch.float16, torch.bfloat16) else low.dtype
            if high.dtype != expected:
                raise Refused(f"the softmax runs in {high.dtype} on {low.dtype} scores; the op computes it in {expected}")
        if op_name(qk) not in MATMULS:
            raise Refused("the scores are not q @ k^T")
        single_user(qk, "score tensor")
        q, kt = qk.args[0], qk.args[1]
        if op_name(kt) not in ("transpose", "swapaxes") or {d % 4 for d in (kt.args[1], kt.args[2])} != {2, 3}:
            raise Refused("the keys are not transposed over their last two dims (q @ k.transpose(-1, -2))")
        k, h_k = unrepeat(kt.args[0])
        v, h_v = unrepeat(pv.args[1])
        shapes = [value(x) for x in (q, k, v)]
        if any(x is None or x.dim() != 4 for x in shapes):
            raise Refused("q, k, v are not [B, heads, S, D]")
        (qv, kv, vv) = shapes
        if h_k != h_v or kv.shape[1] != vv.shape[1] or qv.shape[1] != kv.shape[1] * h_k or qv.shape[1] != H:
            raise Refused(f"K/V heads {kv.shape[1]} (x{h_k}) and {vv.shape[1]} (x{h_v}) do not serve {H} query heads")
        return {"q": q, "k": k, "v": v, "scale": scale, "pv": pv, "mask": mask, "keep_where_true": keep_where_true,
                "shapes": shapes, "chain": [pv, cast, softmax, masked, scaled, raw, qk, kt]}

    def rewrite(self, graph: fx.Graph, softmax: fx.Node, plan: dict) -> None:
        pv = plan["pv"]
        # without pos and q_offset, the call as it always was
        extra = (None, plan["q_offset"]) if plan["q_offset"] else () if plan["pos"] is None else (plan["pos"],)
        both = call(graph, torch.ops.nsa.window_attention, plan["q"], plan["k"], plan["v"], plan["window"],
                    plan["scale"], plan["backend"], *extra, anchor=pv)
        out = call(graph, operator.getitem, both, 0, anchor=pv)  # o; the log-sum-exp is for the backward
        pv.replace_all_uses_with(out)
        # erase the dense chain, then whatever only it used (the K/V copies and slices, the mask arithmetic)
        erase_replaced(graph, plan["chain"], [plan["mask"]])

PASS = WindowAttention()
