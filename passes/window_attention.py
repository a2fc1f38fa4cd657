"""window_attention: masked dense sliding-window attention -> one GQA-native window-attention op.

Matches (torch IR), anchored at the softmax:
    k_rep = k.repeat_interleave(h, dim=1)            # optional (GQA); k [B, G, S, Dk]
    scores = upcast(q @ k_rep.transpose(-1, -2)) * c  # q [B, H, S, Dk]; upcast: .float(), .to(float32), or none
    p = softmax(scores.masked_fill(~mask, -inf), dim=-1)      # or masked_fill(not_mask, -inf), where(mask, scores, -inf)
    o = p.to(v.dtype) @ v_rep                         # .to optional; v_rep as k_rep
where `mask` [S, S] is computed from positions only (aranges, comparisons, arithmetic). The mask
is evaluated once at compile time and must equal the sliding window exactly: query t sees key s
iff s <= t and t - s < w, for some w >= 1 (w >= S is plain causal attention).

Becomes `torch.ops.nsa.window_attention(q, k, v, w, c, backend)[0]` on the un-repeated K/V: no
[S, S] scores, no K/V copy (nsa_compile/ops/window.py). The backend is chosen here, from the
fake tensors, and written into the graph: `flash` (FA-2 with a window) on CUDA in fp16/bf16 with
equal head dims <= 256, else `reference` (memory-bounded PyTorch, exact); `explain` shows which
and, for reference, why not flash.

Refuses (graph unchanged), with the reason shown by `explain`:
- a mask that depends on data, is not [S, S] over the last two dims, is non-causal, or is not a
  window (off by one, a band that does not reach the diagonal, ...), or S beyond what is verified;
- scores, probabilities or the masked tensor used anywhere else (the dense tensor is needed);
- q, k, v not [B, heads, S, D], or K/V heads that do not divide the query heads.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import nsa_compile.ops  # noqa: F401  (registers torch.ops.nsa.*)
from nsa_compile.ops import flash
from nsa_compile.ops.window import choose_backend
from nsa_compile.attention_match import Refused, erase_replaced, keep_mask, only_user, strip_upcast, unrepeat
from nsa_compile.fx import MATMULS, arg, call, op_name, value
from nsa_compile.rewrite import PassLog, RewritePass

KERNEL = "nsa.window_attention[{backend}] (w={window}, GQA-native, no S x S tensor{why})"


def single_user(node: fx.Node, what: str) -> fx.Node:
    return only_user(node, what, "the dense tensor is needed")


def split_scale(node: fx.Node) -> tuple[fx.Node, float]:
    """scores * c, c * scores, scores / c -> (scores, scale)."""
    name, (a, b) = op_name(node), (node.args + (None, None))[:2]
    if name == "mul" and isinstance(b, (int, float)) and isinstance(a, fx.Node):
        return a, float(b)
    if name == "mul" and isinstance(a, (int, float)) and isinstance(b, fx.Node):
        return b, float(a)
    if name in ("truediv", "div") and isinstance(b, (int, float)) and isinstance(a, fx.Node):
        return a, 1.0 / float(b)
    raise Refused("the scores are not scaled by a constant (q @ k^T * c)")


# Ops that act element by element (with broadcasting): rows r0..r1 of their output are the op
# applied to rows r0..r1 of their [.., S, S] inputs. Only these may produce an [S, S] tensor in a
# mask that is evaluated in row chunks (plus constant creation, tril/triu, leading-dim views).
POINTWISE = {
    "add", "sub", "rsub", "mul", "neg", "abs", "floordiv", "floor_divide", "remainder", "mod",
    "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert", "logical_and", "logical_or",
    "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor",
    "__and__", "__or__", "__xor__", "__invert__", "where", "to", "bool", "int", "long", "clamp",
    "clamp_min", "clamp_max", "minimum", "maximum",
}
CREATIONS = {"ones": 1, "zeros": 0, "full": None, "ones_like": 1, "zeros_like": 0, "full_like": None}
BANDS = ("tril", "triu")
CHUNK_ELEMENTS = 2**24  # elements of one row chunk of the mask (rows = CHUNK_ELEMENTS // S)
MAX_VERIFIED_S = 131072  # S * S = 2^34 mask elements, in chunks, on the device of the mask's code


def mask_nodes(mask: fx.Node) -> list[fx.Node]:
    """The mask's subgraph in graph order; Refused if it reads anything but positions."""
    order, seen, stack = [], set(), [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op not in ("call_function", "call_method"):
            raise Refused(f"the mask depends on {node.op} {node.name} (data, not positions)")
        order.append(node)
        stack.extend(node.all_input_nodes)
    index = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(order, key=index.__getitem__)


def _run(node: fx.Node, args, kwargs):
    if any(isinstance(x, torch.SymInt) for x in torch.utils._pytree.tree_leaves((args, kwargs))):
        raise Refused("the mask has symbolic sizes (dynamic shapes): not verified")
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _is_square(shape, S: int) -> bool:
    return len(shape) >= 2 and tuple(shape[-2:]) == (S, S) and all(d == 1 for d in shape[:-2])


def mask_rows(mask: fx.Node, S: int):
    """A function (r0, r1) -> rows r0..r1 of the mask as an [r1 - r0, S] tensor, computed for real.

    The mask is evaluated in row chunks so that verifying it costs O(rows * S) memory at any S,
    yet every element is computed (a proof for this S, not a sample). Nodes whose value is small
    (aranges, [S, 1] and [1, S] position vectors) are computed once, whole; a node that makes an
    [S, S] tensor must be chunkable: an element-wise op (POINTWISE), a constant fill, tril/triu
    (rows r0.. of tril(x, d) are tril(rows, d + r0)) or a view that only adds or drops leading
    size-1 dims. Anything else is refused with its name.
    """
    nodes = mask_nodes(mask)
    shapes = {}
    for node in nodes:
        fake = value(node)
        if fake is None:
            raise Refused(f"the mask node {node.name} has no traced value (cannot verify it)")
        shapes[node] = tuple(fake.shape)
    small, big = {}, []
    for node in nodes:
        shape = shapes[node]
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel <= 4 * S:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: small[n] if n in small else None)
            if any(n not in small for n in node.all_input_nodes):
                raise Refused(f"the mask reduces an [S, S] tensor at {node.name} (not verified in chunks)")
            small[node] = _run(node, args, kwargs)
            continue
        if not _is_square(shape, S):
            raise Refused(f"the mask node {node.name} is {shape}, not one [S, S] pattern for all heads")
        name = op_name(node) or ""
        if name not in POINTWISE and name not in CREATIONS and name not in BANDS and not _is_shape_only(node):
            raise Refused(f"the mask uses {name} on an [S, S] tensor (only element-wise ops, fills, "
                          "tril/triu and views are verified in chunks)")
        big.append(node)

    def rows(r0: int, r1: int) -> torch.Tensor:
        env = {}

        def chunk_of(n: fx.Node):
            if n in env:
                return env[n]
            x = small[n]  # broadcast operand: slice its row dim when it spans the S rows
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] == S:
                return x[..., r0:r1, :]
            return x

        for node in big:
            name = op_name(node) or ""
            shape = shapes[node][:-2] + (r1 - r0, S)
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), chunk_of)
            if name in CREATIONS and not node.all_input_nodes or name in ("ones_like", "zeros_like", "full_like"):
                fill = CREATIONS[name]
                if fill is None:
                    fill = kwargs.get("fill_value", args[-1] if name == "full_like" else args[1])
                fake = value(node)
                env[node] = torch.full(shape, fill, dtype=fake.dtype, device=_real_device(fake))
            elif name in BANDS:
                x = args[0]
                diagonal = (args[1] if len(args) > 1 else kwargs.get("diagonal", 0)) + r0
                env[node] = getattr(torch, name)(x, diagonal)
            elif name in POINTWISE:
                env[node] = _run(node, args, kwargs)
            else:  # a view that adds or drops leading size-1 dims
                env[node] = args[0].reshape(shape)
        out = env[mask] if mask in env else chunk_of(mask)
        return torch.broadcast_to(out, shapes[mask][:-2] + (r1 - r0, S)).reshape(r1 - r0, S)

    return rows


SHAPE_ONLY = {"view", "reshape", "unsqueeze", "squeeze", "expand", "contiguous", "clone", "detach", "getitem"}


def _is_shape_only(node: fx.Node) -> bool:
    """A view of one [S, S] input that only adds or drops leading size-1 dims (mask[None, None],
    unsqueeze(0), view(1, 1, S, S), ...): its rows are its input's rows. Indexing that is not
    None / ... / a full slice (mask[::-1], mask[1:]) is not."""
    name = op_name(node) or ""
    if name not in SHAPE_ONLY or len(node.all_input_nodes) != 1:
        return False
    if name == "getitem":
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in index)
    return True


def _real_device(fake: torch.Tensor) -> torch.device:
    return fake.device if fake.device.type != "meta" else torch.device("cpu")


def window_of(rows, S: int) -> int:
    """The w with mask == (s <= t) & (t - s < w), checked chunk by chunk over all S rows, or
    Refused saying how it differs. `rows(r0, r1)` gives the kept (True) entries of rows r0..r1."""
    step = max(1, CHUNK_ELEMENTS // S)
    w = 0
    for r0 in range(0, S, step):  # first pass: causal, and the widest row
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
    for r0 in range(0, S, step):  # second pass: exactly the window of that width
        r1 = min(S, r0 + step)
        keep = rows(r0, r1)
        t = torch.arange(r0, r1, device=keep.device)[:, None]
        s = torch.arange(S, device=keep.device)[None, :]
        if not torch.equal(keep, (s <= t) & (t - s < w)):
            raise Refused("the mask is causal but not a sliding window (s <= t and t - s < w for any w)")
    return w


class WindowAttention(RewritePass):
    name = "window_attention"
    summary = "masked dense sliding-window (or causal) attention -> nsa.window_attention, no S x S tensor"

    def apply(self, graph: fx.Graph, log: PassLog) -> None:
        for softmax in list(graph.nodes):
            if op_name(softmax) != "softmax" or softmax.graph is not graph:
                continue
            try:
                plan = self.check(softmax, log.config.window_backend if log.config else "auto")
            except Refused as why:
                log.refused(softmax, str(why))
                continue
            self.rewrite(graph, softmax, plan)
            why = f"; not flash: {plan['why_not_flash']}" if plan["backend"] != "flash" else ""
            log.matched(softmax, KERNEL.format(window=plan["window"], backend=plan["backend"], why=why))

    def check(self, softmax: fx.Node, requested: str = "auto") -> dict:
        probs = value(softmax)
        dim = arg(softmax, 1, "dim")
        if probs is None or probs.dim() != 4 or dim is None or dim % 4 != 3:
            raise Refused("not a softmax over the last dim of [B, H, S, S] scores")
        masked = softmax.args[0]
        nxt = single_user(softmax, "probability tensor")
        cast = None
        if op_name(nxt) in ("to", "type_as"):
            cast, nxt = nxt, single_user(nxt, "probability tensor")
        if op_name(nxt) not in MATMULS or nxt.args[0] is not (cast or softmax):
            raise Refused("the probabilities are not multiplied by V (p @ v)")
        pv = nxt
        B, H, S, S2 = probs.shape
        if S != S2:
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
        if S > MAX_VERIFIED_S:
            raise Refused(f"S = {S} > {MAX_VERIFIED_S}: the mask is not verified at this length yet")
        chunk = mask_rows(mask, S)
        window = window_of(chunk if keep_where_true else (lambda r0, r1: ~chunk(r0, r1)), S)
        try:  # from the fake tensors: device, dtype, head dims
            backend = choose_backend(qv, kv, vv, requested)
        except ValueError as why:  # a backend named in the config that cannot run these tensors
            raise Refused(f"OptimizeConfig(window_backend={requested!r}): {why}") from None
        return {"q": q, "k": k, "v": v, "window": window, "scale": scale, "pv": pv, "backend": backend,
                "why_not_flash": flash.unsupported_reason(qv, kv, vv) if requested == "auto"
                else f"window_backend={requested!r} in OptimizeConfig",
                "chain": [pv, cast, softmax, masked, scaled, raw, qk, kt], "mask": mask}

    def rewrite(self, graph: fx.Graph, softmax: fx.Node, plan: dict) -> None:
        pv = plan["pv"]
        both = call(graph, torch.ops.nsa.window_attention, plan["q"], plan["k"], plan["v"], plan["window"],
                    plan["scale"], plan["backend"], anchor=pv)
        out = call(graph, operator.getitem, both, 0, anchor=pv)  # o; the log-sum-exp is for the backward
        pv.replace_all_uses_with(out)
        # erase the dense chain, then whatever only it used (the K/V copies, the mask arithmetic)
        erase_replaced(graph, plan["chain"], [plan["mask"]])

PASS = WindowAttention()
