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

Becomes `torch.ops.nsa.window_attention(q, k, v, w, c, backend[, pos])[0]` on the un-repeated
K/V: no [S, S] scores, no K/V copy (nsa_compile/ops/window.py). The backend is chosen here, from
the fake tensors, and written into the graph: `triton` (this project's window kernels, packed
documents too) on CUDA in fp16/bf16, else `flash` (FA-2 with a window; with pos its varlen form,
one sequence per document, at one host sync per call) on CUDA in fp16/bf16 with equal head dims
<= 256, else `reference` (memory-bounded PyTorch, exact); `explain` shows which and why not the
ones before it.

Refuses (graph unchanged), with the reason shown by `explain`:
- a mask that depends on data, is not [S, S] over the last two dims, is non-causal, or is not a
  window (off by one, a band that does not reach the diagonal, ...), or S beyond what is verified;
  at symbolic sizes, a mask that is a different window at different probe sizes;
- with positions: other data besides them, a mask that is not [B, 1, S, S] (one per row, the same
  for all heads), or one that differs from the packed window on a probe (a document term off by
  one, a row that ignores pos, ...; the reason names the probe and the first differing element),
  or B * S * S beyond MAX_VERIFIED_PACKED;
- scores, probabilities or the masked tensor used anywhere else (the dense tensor is needed);
- q, k, v not [B, heads, S, D], or K/V heads that do not divide the query heads.
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.ops.window import WINDOW, choose_backend
from nsa_compile.attention_match import Refused, ancestors, erase_replaced, keep_mask, only_user, strip_upcast, unrepeat
from nsa_compile.fx import MATMULS, arg, call, op_name, value
from nsa_compile.mask_rows import CHUNK_ELEMENTS, RowChunks, mask_nodes, real_device
from nsa_compile.rewrite import PassContext, RewritePass
from nsa_compile.sizes import Sizes

from .compressed_attention import unbatched

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


class WindowAttention(RewritePass):
    name = "window_attention"
    summary = "masked dense sliding-window (or causal) attention -> nsa.window_attention, no S x S tensor"

    def source_files(self) -> tuple[str, ...]:
        return super().source_files() + (inspect.getfile(RowChunks),)  # the row-chunk evaluation of the masks

    def apply(self, graph: fx.Graph, ctx: PassContext) -> None:
        checked = {}  # packed masks already checked on probes in this graph -> their w
        for softmax in list(graph.nodes):
            if op_name(softmax) != "softmax" or softmax.graph is not graph:
                continue
            try:
                plan = self.check(softmax, ctx.config.backend("window_attention"), checked)
            except Refused as why:
                ctx.refused(softmax, str(why))
                continue
            self.rewrite(graph, softmax, plan)
            why = plan["why_not_faster"]
            docs = "" if plan["pos"] is None else ", per document (pos)"
            ctx.matched(softmax, KERNEL.format(window=plan["window"], docs=docs, backend=plan["backend"], why=why))

    def check(self, softmax: fx.Node, requested: str = "auto", checked: dict | None = None) -> dict:
        probs = value(softmax)
        dim = arg(softmax, 1, "dim")
        if probs is None or probs.dim() != 4 or dim is None or dim % 4 != 3:
            raise Refused(unbatched(probs, dim) or "not a softmax over the last dim of [B, H, S, S] scores")
        masked = softmax.args[0]
        nxt = single_user(softmax, "probability tensor")
        cast = None
        if op_name(nxt) in ("to", "type_as"):
            cast, nxt = nxt, single_user(nxt, "probability tensor")
        if op_name(nxt) not in MATMULS or nxt.args[0] is not (cast or softmax):
            raise Refused("the probabilities are not multiplied by V (p @ v)")
        pv = nxt
        B, H, S, S2 = probs.shape
        if not statically_known_true(S == S2):
            raise Refused(f"scores are {S} x {S2}: queries and keys differ (not self-attention)")
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
        return {"q": q, "k": k, "v": v, "window": window, "scale": scale, "pv": pv, "backend": backend, "pos": pos,
                "why_not_faster": why_not_faster(requested, backend, qv, kv, vv, value(pos)),
                "chain": [pv, cast, softmax, masked, scaled, raw, qk, kt], "mask": mask}

    def rewrite(self, graph: fx.Graph, softmax: fx.Node, plan: dict) -> None:
        pv = plan["pv"]
        packed = () if plan["pos"] is None else (plan["pos"],)  # without pos, the call as it always was
        both = call(graph, torch.ops.nsa.window_attention, plan["q"], plan["k"], plan["v"], plan["window"],
                    plan["scale"], plan["backend"], *packed, anchor=pv)
        out = call(graph, operator.getitem, both, 0, anchor=pv)  # o; the log-sum-exp is for the backward
        pv.replace_all_uses_with(out)
        # erase the dense chain, then whatever only it used (the K/V copies, the mask arithmetic)
        erase_replaced(graph, plan["chain"], [plan["mask"]])

PASS = WindowAttention()
