"""Shared test helpers: fresh optimization, token batches, graph queries."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

import nsa_compile
from nsa_compile.api import state_of

FAST = nsa_compile.OptimizeConfig(compiler="aot_eager")


def optimize_fresh(model, config=FAST):
    """optimize() after a Dynamo reset, so each test compiles from scratch."""
    torch._dynamo.reset()
    return nsa_compile.optimize(model, config)


def tokens(batch: int, seq: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    """Random token ids [batch, seq + 1] (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def train_at_lengths(eager, model, lengths) -> list:
    """One step of the LM loss at each length (batch 1) through `eager` and `model` (an optimized
    copy with the same weights): the losses and every parameter's gradient must agree at each;
    returns the model's compiled graphs (state_of(model).graphs) after the last length."""
    for S in lengths:
        batch = tokens(1, S, seed=S)
        want, got = eager.loss(batch), model.loss(batch)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, S=S, name=name: f"S={S} {name}: {m}")
            a.grad = b.grad = None
    return state_of(model).graphs


def document_positions(lengths: list[int]) -> torch.Tensor:
    """pos [sum(lengths)] int64: each token's position in its document, for documents of these
    lengths packed in order (packed documents, models/nsa.py)."""
    from nsa_compile.models import positions_from_cu_seqlens

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return positions_from_cu_seqlens(cu, sum(lengths))


def random_lengths(S: int, shortest: int, longest: int, seed: int) -> list[int]:
    """Document lengths drawn uniformly from [shortest, longest] until they fill S tokens (the last
    one cut at S)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < S:
        lengths.append(min(S - sum(lengths), int(torch.randint(shortest, longest + 1, (1,), generator=gen))))
    return lengths


def packed_positions(rows: list[list[int]]) -> torch.Tensor:
    """pos [len(rows), S] for rows packed with documents of these lengths (each row sums to S)."""
    return torch.stack([document_positions(lengths) for lengths in rows])


def packed_slot_visibility(S: int, Tc: int, pos: torch.Tensor, l: int, d: int) -> torch.Tensor:
    """[B, 1, S, Tc] bool: the packed compressed visibility of models/nsa.py (slot i, pooled from
    tokens i .. i + l - 1, is a block of its document at stride d and lies in query t's document
    and past), the model's lines as the packed tests write them."""
    t = torch.arange(S, device=pos.device)[:, None]
    i = torch.arange(Tc, device=pos.device)[None, :]
    slot_pos = pos[:, :Tc]
    is_block = (slot_pos % d == 0) & (pos[:, l - 1 :] == slot_pos + l - 1)
    same_doc = i >= (t - pos[:, :, None])
    return ((i + l - 1 <= t) & same_doc & is_block[:, None, :])[:, None]


def only_graph(model):
    graphs = state_of(model).graphs
    assert len(graphs) == 1, f"expected one compiled graph, got {len(graphs)}"
    return graphs[0]


def row(model, name: str) -> dict:
    (found,) = [r for r in nsa_compile.report(model) if r["name"] == name]
    return found


def growing_float_expands(gm: fx.GraphModule) -> list[tuple]:
    """(input shape, output shape) of every aten.expand that copies a float tensor to more elements."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.expand.default:
            src, dst = node.args[0].meta["val"], node.meta["val"]
            if src.is_floating_point() and dst.numel() > src.numel():
                out.append((tuple(src.shape), tuple(dst.shape)))
    return out

# The GQA pass alone: tests of gqa_grouped_matmul isolate it from the passes that run before it
# (the branch passes take their branch's K/V copies with them; the fusions change its inputs).
GQA_ONLY = FAST.replace(disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != "gqa_grouped_matmul"))


class BreaksNumbers(nsa_compile.RewritePass):
    """A deliberately wrong rewrite (the `wrong_pass` fixture registers it): scales the input of
    every linear layer by 1.1, so that parity must catch it."""

    name = "user_breaks_numbers"
    summary = "a deliberately wrong rewrite, to prove parity catches it"

    def apply(self, graph, ctx):
        from nsa_compile.fx import op_name

        for node in list(graph.nodes):
            if op_name(node) == "linear":
                with graph.inserting_before(node):
                    scaled = graph.call_function(torch.mul, (node.args[0], 1.1))
                node.replace_input_with(node.args[0], scaled)
                ctx.matched(node, "wrong")


# the tolerances of the chunk tests (tests/test_query_offset.py, tests/test_window_offset.py)
CHUNK_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=2e-3, atol=2e-3)}


# the chunk tests of the branch passes read each chunk's own op call: query_chunks (which merges them) off
PER_CHUNK = FAST.replace(disabled_passes=("query_chunks",))


def optimized_with_parity(model, x, dtype=torch.float32, config=FAST):
    """The model optimized (aot_eager, or `config`) in `dtype`, its output and every gradient of
    one step checked against eager's (CHUNK_TOL). optimize compiles in place: the optimized model is
    a copy, so that `model` stays eager."""
    model = model.to(dtype)
    x = x.to(dtype)
    opt = optimize_fresh(copy.deepcopy(model), config)
    outs, grads = [], []
    for m in (model, opt):
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.float().square().mean().backward()
        outs.append(out.detach())
        grads.append({name: p.grad for name, p in m.named_parameters()})
    tol = CHUNK_TOL[dtype]
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, **tol, msg=lambda m, n=name: f"grad {n}: {m}")
    return opt


def matches(model) -> dict:
    """Each pass's match count in `model`'s report."""
    return {r["name"]: r["matches"] for r in nsa_compile.report(model)}
