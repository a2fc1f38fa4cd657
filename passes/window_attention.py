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

MAX_VERIFIED_S = 16384  # the mask is evaluated as an [S, S] bool tensor at compile time
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


def evaluate_mask(mask: fx.Node) -> torch.Tensor:
    """Run the mask's position-only subgraph for real (it has no inputs)."""
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
    env = {}
    for node in sorted(order, key=lambda n: list(n.graph.nodes).index(n)):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        if any(isinstance(x, torch.SymInt) for x in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise Refused("the mask has symbolic sizes (dynamic shapes): not verified")
        if node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env[mask]


def window_of(keep: torch.Tensor) -> int:
    """The w with keep == (s <= t) & (t - s < w), or Refused saying how it differs."""
    S = keep.shape[-1]
    t = torch.arange(S, device=keep.device)[:, None]
    s = torch.arange(S, device=keep.device)[None, :]
    if bool((keep & (s > t)).any()):
        raise Refused("the mask is non-causal: a query sees a later key")
    w = int(keep.sum(-1).max())
    if w == 0 or not torch.equal(keep, (s <= t) & (t - s < w)):
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
        keep = evaluate_mask(mask)
        keep = keep if keep_where_true else ~keep
        if keep.dtype != torch.bool or keep.shape[-2:] != (S, S) or keep.numel() != S * S:
            raise Refused(f"the mask is {tuple(keep.shape)} {keep.dtype}, not one [S, S] bool pattern for all heads")
        window = window_of(keep.reshape(S, S))
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
