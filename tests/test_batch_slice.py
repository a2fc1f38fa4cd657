"""Probes on one batch row (nsa_compile/batch_slice.py): a region that keeps its batch rows apart is
verified at B = 1 where the whole batch would exceed the probe budget.

- `one_row` on Dynamo graphs of small functions: attention-like regions (views, expands, gathers,
  masks, softmax, matmuls, tensors made with the batch's size) are accepted, and running them on
  one row with the returned changes gives row 0 of the whole result; every op that mixes rows
  (flip(0), sum(0), softmax over dim 0, a view that merges the batch, transpose(0, 1), x[0], a
  [B, ..] constant paired with the rows, a 2-D product that sums the batch, cat on dim 0) is
  refused, naming the node.
- lucidrains' three probed regions (block choice, fine branch, bucketed window) in the corpus
  model: with the budget between one row's cost and the whole batch's, all three fire through one
  row with eager's outputs and gradients; with the budget under one row's cost all three are
  refused with both sizes in the reason and the graph unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from corpus import lucidrains_shared_kv
from helpers import optimize_fresh
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

import nsa_compile
from nsa_compile import batch_slice, probe
from nsa_compile.attention_match import Refused
from nsa_compile.fx import op_name, value


def dynamo_graph(fn, *inputs):
    """The Dynamo graph of fn(*inputs), with the fake values the passes read."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm


def region(gm):
    """(nodes, inputs, out): every call of the graph, its tensor inputs, its one output."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    (out,) = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    return nodes, inputs, out


def attention_like(q, k, v, ids):
    """q [B, H, S, D], k/v [B, H, S, D], ids [B, H, S, 2]: gathered keys per query, masks, softmax."""
    B, H, S, D = q.shape
    keys = k[:, :, None].expand(B, H, S, S, D).gather(3, ids[..., None].expand(B, H, S, 2, D))
    vals = v[:, :, None].expand(-1, -1, S, -1, -1).gather(3, ids[..., None].expand(B, H, S, 2, D))
    scores = (q.unsqueeze(-2) @ keys.transpose(-1, -2)).squeeze(-2) * D**-0.5
    causal = ids <= torch.arange(S)[:, None]
    extra = torch.zeros(B, H, S, 2).masked_fill(~causal, float("-inf"))
    p = (scores + extra).softmax(-1)
    dense = torch.tril(q @ k.transpose(-1, -2)).float().softmax(dim=-1) @ v
    out = (p.unsqueeze(-2) @ vals).squeeze(-2) + dense
    return F.pad(out, (0, 0, 0, 1))[:, :, :S].reshape(B, H, S * D).view(B, H, S, D)


def attention_inputs(B=3, H=2, S=5, D=4):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    ids = torch.randint(0, S, (B, H, S, 2), generator=gen)
    ids[..., 0] = 0  # every row keeps a key
    return q, k, v, ids


def test_an_attention_like_region_runs_on_one_row():
    inputs = attention_inputs()
    gm = dynamo_graph(attention_like, *inputs)
    nodes, placeholders, out = region(gm)
    changes, batched = batch_slice.one_row(nodes, placeholders, out, batch=3)
    assert changes and out in batched  # the expands and the zeros named B
    whole = attention_like(*inputs)
    by_name = dict(zip(("l_q_", "l_k_", "l_v_", "l_ids_"), inputs))  # Dynamo orders its inputs by first use
    env = {p: by_name[p.name][:1].double() if p.name != "l_ids_" else by_name[p.name][:1] for p in placeholders}
    row = probe.run(nodes, env, out, "the region", changes=changes)
    assert row.shape == (1, *whole.shape[1:])
    torch.testing.assert_close(row.float(), whole[:1], rtol=1e-5, atol=1e-5)
    shape = lambda t: tuple(t.shape)  # noqa: E731
    assert batch_slice.peak_elements(nodes, shape, batched, 1) * 2 < batch_slice.peak_elements(nodes, shape)


CONSTANT = torch.randn(3, 2, 5, 4)


@pytest.mark.parametrize("fn, shape, reason", [
    (lambda x: x.flip(0), (3, 2, 5, 4), "flip"),
    (lambda x: x.sum(0, keepdim=True).expand(3, -1, -1, -1) + x, (3, 2, 5, 4), "sum"),
    (lambda x: x.softmax(0), (3, 2, 5, 4), "over dim 0, the batch"),
    (lambda x: x.reshape(6, 5, 4).sum(-1).view(3, 2, 5), (3, 2, 5, 4), "does not give a [B = 3, ..] result"),
    (lambda x: x.transpose(0, 1) * 2, (3, 3, 5, 4), "over dim 0, the batch"),  # B = G: shapes cannot tell
    (lambda x: x[0].expand(3, 2, 5, 4), (3, 2, 5, 4), "does not give a [B = 3, ..] result"),
    (lambda x: x[:3] * 2, (3, 2, 5, 4), "indexes dim 0"),
    (lambda x: x + CONSTANT, (3, 2, 5, 4), "which is not batched"),
    (lambda x: torch.ones(3, 3) @ x.flatten(1)[:, :3], (3, 2, 5, 4), "right operand of a 2-D product"),
    (lambda x: torch.cat([x, x], dim=2).permute(1, 0, 2, 3).permute(1, 0, 2, 3), (3, 3, 5, 4), "moves dim 0"),
    (lambda x: torch.cat([x, x], dim=0)[:3], (3, 2, 5, 4), "does not give a [B = 3, ..] result"),
])
def test_ops_that_mix_batch_rows_are_refused(fn, shape, reason):
    x = torch.randn(shape)
    gm = dynamo_graph(fn, x)
    nodes, _, out = region(gm)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "l_x_"]  # not CONSTANT
    with pytest.raises(Refused, match="^.*" + reason.replace("[", r"\[").replace("(", r"\(")):
        batch_slice.one_row(nodes, inputs, out, batch=3)


# --- lucidrains' probed regions through one row ----------------------------------------------------

PROBED = ("select_blocks", "selected_attention", "window_attention")


def lucidrains(batch=6):
    model, x = lucidrains_shared_kv.make()
    return model, torch.randn(batch, *x.shape[1:], generator=torch.Generator().manual_seed(1))


def probe_costs(monkeypatch) -> dict:
    """Each probed region's (whole batch, one row) elements, by what it verifies: recorded at its
    probe while compiling the model with the default budget."""
    seen = {}
    real = batch_slice.probe_rows

    def spy(nodes, inputs, out, at, what, **kw):
        _, batched = batch_slice.one_row(nodes, inputs, out, at.shape(value(inputs[0]))[0])
        seen[what] = (batch_slice.peak_elements(nodes, at.shape),
                      batch_slice.peak_elements(nodes, at.shape, batched, 1))
        return real(nodes, inputs, out, at, what, **kw)

    monkeypatch.setattr(batch_slice, "probe_rows", spy)
    model, x = lucidrains()
    optimize_fresh(model)(x)
    monkeypatch.setattr(batch_slice, "probe_rows", real)
    assert set(seen) == {"lucidrains' block choice", "lucidrains' fine branch", "the bucketed window"}, seen
    return seen


def counts(model) -> dict:
    return {r["name"]: r["matches"] for r in nsa_compile.report(model) if r["name"] in PROBED}


def budget_per_region(monkeypatch, budget_of) -> None:
    """Each probed region verified under its own budget, budget_of(what)."""
    real = batch_slice.probe_rows

    def with_budget(nodes, inputs, out, at, what, **kw):
        monkeypatch.setattr(probe, "CPU_BUDGET", budget_of(what))
        return real(nodes, inputs, out, at, what, **kw)

    monkeypatch.setattr(batch_slice, "probe_rows", with_budget)


def as_eager(model, opt, out, x) -> None:
    """The optimized output `out` and every parameter gradient as the eager model's."""
    want = model(x)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    want.square().mean().backward()
    for (name, p), (_, p_opt) in zip(model.named_parameters(), opt.named_parameters()):
        torch.testing.assert_close(p_opt.grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)


def test_lucidrains_regions_fire_on_one_row_with_eager_gradients(monkeypatch):
    """Each region's budget exactly its one-row probe's elements: under the whole batch's."""
    costs = probe_costs(monkeypatch)
    assert all(one < whole for whole, one in costs.values()), costs
    budget_per_region(monkeypatch, lambda what: costs[what][1])
    model, x = lucidrains()
    opt = optimize_fresh(copy.deepcopy(model))
    out = opt(x)
    assert counts(opt) == {name: 1 for name in PROBED}
    as_eager(model, opt, out, x)


@pytest.mark.parametrize("what, name", [("lucidrains' block choice", "select_blocks"),
                                        ("lucidrains' fine branch", "selected_attention"),
                                        ("the bucketed window", "window_attention")])
def test_a_region_over_the_budget_on_one_row_is_refused(monkeypatch, what, name):
    """The budget one element under the region's one-row probe (every other region's whole: the fine
    branch still sees the block choice's op): that region is refused with both sizes, eager's outputs.
    The fine branch may also probe in float32 (twice the elements): its budget is under half its
    one-row probe, and the reason gives the float32 budget too."""
    costs = probe_costs(monkeypatch)
    fine = what == "lucidrains' fine branch"
    budget = (costs[what][1] - 1) // 2 if fine else costs[what][1] - 1
    budget_per_region(monkeypatch, lambda w: budget if w == what else costs[w][0])
    model, x = lucidrains()
    opt = optimize_fresh(copy.deepcopy(model))
    torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert counts(opt)[name] == 0
    (record,) = nsa_compile.api.state_of(opt).graphs
    reasons = [why for r in nsa_compile.report(opt) if r["name"] == name for why in r["reasons"]]
    in_float32 = f" ({budget * 2:,} in float32)" if fine else ""
    assert any(f"verifying {what} takes {costs[what][0]:,} elements per probe, over the budget of {budget:,} on cpu"
               f"{in_float32}, {costs[what][1]:,} on one batch row: not verified at this size yet" in why
               for why in reasons), reasons


def test_the_fine_branch_over_the_float64_budget_is_verified_in_float32(monkeypatch):
    """lucidrains' fine branch with its one-row probe over the float64 budget but within float32's
    (twice the elements): verified on float32 probes and rewritten, the match says so, eager's
    outputs and gradients; the other regions' budgets untouched (their whole batch)."""
    costs = probe_costs(monkeypatch)
    what = "lucidrains' fine branch"
    one = costs[what][1]
    budget_per_region(monkeypatch, lambda w: (one + 1) // 2 if w == what else costs[w][0])
    model, x = lucidrains()
    opt = optimize_fresh(copy.deepcopy(model))
    out = opt(x)
    assert counts(opt) == {name: 1 for name in PROBED}
    (kernel,) = [k for r in nsa_compile.report(opt) if r["name"] == "selected_attention" for k in r["kernels"]]
    assert "verified on probe values in float32 (float64 probes would exceed the probe budget)" in kernel, kernel
    as_eager(model, opt, out, x)


def test_float32_probes_still_tell_a_wrong_fine_branch(monkeypatch):
    """The float32 check is not blind: against an op whose scale is off by 0.1% (a difference far
    smaller than a block or a key more or less), the float32 probes refuse the branch."""
    costs = probe_costs(monkeypatch)
    what = "lucidrains' fine branch"
    budget_per_region(monkeypatch, lambda w: (costs[w][1] + 1) // 2 if w == what else costs[w][0])
    from nsa_compile.passes import selected_attention as sa
    real = sa.selected_attention_op

    def scale_off(q, k, v, ids, block, scale, backend):
        return real(q, k, v, ids, block, scale * 1.001, backend)

    monkeypatch.setattr(sa, "selected_attention_op", scale_off)
    model, x = lucidrains()
    opt = optimize_fresh(copy.deepcopy(model))
    opt(x)
    assert counts(opt)["selected_attention"] == 0
    reasons = [why for r in nsa_compile.report(opt) if r["name"] == "selected_attention" for why in r["reasons"]]
    assert any("differs from nsa.selected_attention" in why and "(float32 probes)" in why for why in reasons), reasons


def test_sizes_of_a_method_called_as_a_function_are_read_after_the_tensor():
    """The passes insert methods as functions (`torch.Tensor.expand(x, sizes)`, fx.call): the batch
    size is read after the tensor argument, and one row gives row 0 of the whole result."""
    x = torch.randn(3, 5, 4)
    gm = dynamo_graph(lambda t: t.unsqueeze(1) * 2, x)
    nodes, placeholders, out = region(gm)
    unsqueeze = next(n for n in nodes if n.target == "unsqueeze")
    with gm.graph.inserting_after(unsqueeze):
        expand = gm.graph.call_function(torch.Tensor.expand, (unsqueeze, [3, 2, 5, 4]))
    with value(unsqueeze).fake_mode:
        expand.meta["example_value"] = value(unsqueeze).expand(3, 2, 5, 4)
    out.replace_input_with(unsqueeze, expand)
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    changes, _ = batch_slice.one_row(nodes, placeholders, out, batch=3)
    assert changes[expand][0][1] == (1, 2, 5, 4)
    row = probe.run(nodes, {placeholders[0]: x[:1].double()}, out, "the region", changes=changes)
    torch.testing.assert_close(row.float(), (x.unsqueeze(1).expand(3, 2, 5, 4) * 2)[:1])


def test_the_probe_cost_is_the_peak_of_live_tensors_not_their_sum():
    """probe.run frees each value after its last reader: a chain of large temporaries holds two at
    a time, a view keeps its base alive until the view is read for the last time, and a tuple's
    tensors (topk) count through its getitems."""
    def chain(x):
        a = x * 2          # 60 elements
        b = a + 1          # 60; a freed after
        v = b.view(-1)     # a view of b: no memory, holds b
        c = v.exp()        # 60; b freed after (its view's last reader)
        top = c.topk(3)    # values and indices: 6
        return top.indices.float() + top.values  # 3

    x = torch.randn(3, 4, 5)
    gm = dynamo_graph(chain, x)
    nodes, _, _ = region(gm)
    shape = lambda t: tuple(t.shape)  # noqa: E731
    assert batch_slice.peak_elements(nodes, shape) == 60 + 60  # b (held by its view v) beside c
    # b not held by its view: a, b, c each freed after their reader, so at most two at a time as well;
    # the topk's 6 elements count with c alive (c is read by topk): 66 < 120
    assert sum(t.numel() for n in nodes for t in [value(n)] if isinstance(t, torch.Tensor)
               and op_name(n) not in batch_slice.VIEW_OPS) == 3 * 60 + 3 + 3


def test_a_repeat_over_size_one_dims_read_by_gather_runs_as_an_expand():
    """lucidrains' fine branch repeats K/V once per query (`k[:, :, None].repeat(1, 1, S, 1, 1)`)
    and gathers each query's keys from the copy: the probe runs that repeat as an expand (same
    values, no memory) and its cost counts it as a view. A repeat that tiles a dim larger than 1,
    or one read by anything but gather, is a copy and counts in full; a flatten of a contiguous
    tensor is a view, of a transposed one a copy."""
    def gathered(k, ids):  # k [B, S, D], ids [B, S, 2, 1]
        B, S, D = k.shape
        per_query = k[:, None].repeat(1, S, 1, 1)  # [B, S(query), S(key), D]: tiles a size-1 dim
        index = ids.repeat(1, 1, 1, D)  # [B, S, 2, D]: tiles the size-1 last dim
        picked = per_query.gather(2, index)  # [B, S, 2, D]
        return picked.flatten(2) * 2  # contiguous: a view

    def tiled(k, ids):
        B, S, D = k.shape
        twice = k.repeat(1, 2, 1)  # [B, 2S, D]: tiles S (> 1): a copy
        scaled = k[:, None].repeat(1, S, 1, 1) * 1.0  # a size-1 dim, but read by mul: a copy
        return twice.gather(1, ids[..., 0, :].expand(B, S, D)) + scaled.sum(2) + k.transpose(1, 2).flatten(1).sum()

    k = torch.randn(2, 6, 4)
    ids = torch.randint(0, 6, (2, 6, 2, 1))
    shape = lambda t: tuple(t.shape)  # noqa: E731
    gm = dynamo_graph(gathered, k, ids)
    nodes, inputs, out = region(gm)
    repeats = [n for n in nodes if op_name(n) == "repeat"]
    assert len(repeats) == 2 and all(batch_slice._expanded_repeat(n, shape) for n in repeats)
    # only the gather's result counts (its flatten is a view of it) and then the product
    assert batch_slice.peak_elements(nodes, shape) == 2 * 6 * 2 * 4 * 2
    got = probe.run(nodes, dict(zip(inputs, (k.double(), ids))), out, "the region")
    torch.testing.assert_close(got.float(), gathered(k, ids))
    gm = dynamo_graph(tiled, k, ids)
    nodes, inputs, out = region(gm)
    repeats = [n for n in nodes if op_name(n) == "repeat"]
    assert len(repeats) == 2 and not any(batch_slice._expanded_repeat(n, shape) for n in repeats)
    flat = next(n for n in nodes if op_name(n) == "flatten")
    assert not batch_slice._contiguous(flat.all_input_nodes[0])  # the transposed k: flatten copies
    got = probe.run(nodes, dict(zip(inputs, (k.double(), ids))), out, "the region")
    torch.testing.assert_close(got.float(), tiled(k, ids))
