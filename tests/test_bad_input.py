"""Bad input through an optimized model with every pass on (tests/test_reliability.py covers the
GQA pass alone): token ids out of range, NaN and Inf activations, block ids out of range in a
user's selection graph, and an out-of-memory error during the first compile.

The bar: the eager behaviour (the same error, NaN where eager has NaN) or a clear error, never a
silent different result. Where the code falls short today the test is marked xfail(strict=True)
with what has to change: it fails (XPASS) once the fix lands, and the mark comes off.

The tiny-model tests share one optimized model compiled once at [2, SEQ] (the `tiny` fixture);
a test that changes its weights or gradients puts them back.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from helpers import optimize_fresh, row, tokens

import nsa_compile
import nsa_compile.backend
from nsa_compile.api import state_of
from nsa_compile.models import build_model
from nsa_compile.rewrite import RewritePass


def counts(model) -> dict[str, int]:
    return {r["name"]: r["matches"] for r in nsa_compile.report(model)}


# --- token ids and non-finite activations, every pass on -------------------------------------------

SEQ = 64  # every tiny-model test feeds token ids [2, SEQ] ...
# ... as the view batch[:, :-1] of a [2, SEQ + 1] batch, what model.loss(batch) passes on: one
# compile serves them all (a contiguous [2, SEQ] has other strides, and Dynamo would recompile)


@pytest.fixture(scope="module")
def tiny():
    """The eager tiny model, an optimized copy compiled once at [2, SEQ], and that compile's
    rewrite counts (taken before any other test can reset Dynamo)."""
    torch.manual_seed(0)
    eager = build_model("tiny")
    optimized = optimize_fresh(copy.deepcopy(eager))
    optimized.loss(tokens(2, SEQ, seed=1))
    return SimpleNamespace(eager=eager, optimized=optimized, clean_counts=counts(optimized))


def test_out_of_range_token_ids_raise_like_eager_with_every_pass(tiny):
    eager, optimized = tiny.eager, tiny.optimized
    batch = tokens(2, SEQ, seed=1)
    good = batch[:, :-1]
    expected = eager(good)
    graphs = len(state_of(optimized).graphs)
    for bad_id in (eager.cfg.vocab_size, -1, 10**9):
        bad = batch.clone()[:, :-1]
        bad[1, 50] = bad_id
        with pytest.raises((IndexError, RuntimeError)) as eager_error:
            eager(bad)
        with pytest.raises((IndexError, RuntimeError)) as optimized_error:
            optimized(bad)
        assert optimized_error.type is eager_error.type
        assert "index out of range" in str(optimized_error.value)
    torch.testing.assert_close(optimized(good), expected, rtol=1e-5, atol=1e-5)  # still works
    assert len(state_of(optimized).graphs) == graphs  # the errors did not recompile anything
    assert counts(optimized)["window_attention"] == counts(optimized)["selected_attention"] == 2


def poisoned_batch(seq: int = SEQ):
    """tokens [2, seq + 1] and a token id that occurs in row 1 only, first at position > seq / 2."""
    batch = tokens(2, seq, seed=1)
    for position in range(seq // 2, seq):
        token = int(batch[1, position])
        if token not in batch[0].tolist() and token not in batch[1, :position].tolist():
            return batch, token, position
    raise AssertionError("no token to poison")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_activations_are_never_hidden_nor_invented(value, tiny):
    """One embedding row poisoned, in row 1 only, first at position p. Every logit of row 1 from
    p on depends on it: non-finite in eager and in the optimized model (every branch rewritten).
    Eager also spreads NaN to positions before p (its masked matmuls multiply 0 by the NaN of a
    later token); the ops read fewer masked keys, so the optimized model may keep some of those
    finite: it must then give there the clean model's values. Nowhere is the optimized output
    non-finite where eager's is finite; row 0 is the eager row."""
    eager, optimized = tiny.eager, tiny.optimized
    batch, token, position = poisoned_batch()
    inputs = batch[:, :-1]
    unpoisoned = eager(inputs).detach()
    clean_rows = [m.embed.weight[token].clone() for m in (eager, optimized)]
    try:
        with torch.no_grad():  # the weights are graph inputs: no recompile
            eager.embed.weight[token] = value
            optimized.embed.weight[token] = value
        expected, got = eager(inputs), optimized(inputs)
        assert expected[0].isfinite().all() and not expected[1, position:].isfinite().any()
        assert not got[1, position:].isfinite().any()  # not hidden
        assert not (~got.isfinite() & expected.isfinite()).any()  # not invented
        both = got.isfinite() & expected.isfinite()
        torch.testing.assert_close(got[both], expected[both], rtol=1e-5, atol=1e-5)
        spared = got.isfinite() & ~expected.isfinite()  # eager's 0 * NaN before p
        torch.testing.assert_close(got[spared], unpoisoned[spared], rtol=1e-5, atol=1e-5)
        eager.loss(batch).backward()
        optimized.loss(batch).backward()
        for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
            assert not (~q.grad.isfinite() & p.grad.isfinite()).any(), name
            assert not q.grad.isfinite().all(), name  # the NaN loss reaches every gradient
        assert len(state_of(optimized).graphs) == 1, "the poisoned weights recompiled"
    finally:
        with torch.no_grad():
            for m, row_ in zip((eager, optimized), clean_rows):
                m.embed.weight[token] = row_
        for m in (eager, optimized):
            m.zero_grad(set_to_none=True)
    rewritten = counts(optimized)
    assert rewritten["window_attention"] == rewritten["selected_attention"] == 2, rewritten


def test_no_nan_fill_when_the_blocks_come_from_nsa_select_blocks(tiny):
    """In the NSA model the block ids are select_blocks's op output, which forces each query's
    current block: no row can be empty, and the rewrite adds nothing after the op."""
    optimized = tiny.optimized
    optimized(tokens(2, SEQ, seed=3)[:, :-1])
    (kernel,) = set(row(optimized, "selected_attention")["kernels"])
    assert "NaN" not in kernel
    code = state_of(optimized).graphs[0].code_after
    assert "nsa.select_blocks" in code and "isneginf" not in code


# --- block ids out of range in a user's selection graph --------------------------------------------


class UserSelection(nn.Module):
    """Selected-block attention as models/nsa.py writes it, on block ids the user's code supplies:
    q [B, S, H, Dk], k/v [B, S, G, D], block_idx [B, G, S, n] -> o [B, S, H, Dv]. clamp=False
    leaves out the two clamps that keep the gather index inside [0, S)."""

    def __init__(self, block: int = 4, clamp: bool = True):
        super().__init__()
        self.block, self.clamp = block, clamp

    def forward(self, q, k, v, block_idx):
        B, S, H, Dk = q.shape
        G, Dv, ls = k.shape[2], v.shape[3], self.block
        h = H // G
        first = block_idx.clamp(min=0) if self.clamp else block_idx
        tokens = (first[..., None] * ls + torch.arange(ls)).flatten(-2)  # [B, G, S, n*l']
        t = torch.arange(S)[:, None]
        valid = (block_idx >= 0)[..., None].expand(-1, -1, -1, -1, ls).flatten(-2) & (tokens <= t)
        if self.clamp:
            tokens = tokens.clamp(max=S - 1)
        T = tokens.shape[-1]
        index = tokens.flatten(2)[..., None]  # [B, G, S*n*l', 1]
        k_sel = torch.gather(k.transpose(1, 2), 2, index.expand(-1, -1, -1, Dk)).view(B, G, S, T, Dk)
        v_sel = torch.gather(v.transpose(1, 2), 2, index.expand(-1, -1, -1, Dv)).view(B, G, S, T, Dv)
        k_sel, v_sel = k_sel.repeat_interleave(h, dim=1), v_sel.repeat_interleave(h, dim=1)
        scores = (q.transpose(1, 2).unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * Dk**-0.5
        p = torch.softmax(scores.masked_fill(~valid.repeat_interleave(h, dim=1), float("-inf")), dim=-1)
        return (p.unsqueeze(-2) @ v_sel).squeeze(-2).transpose(1, 2)


def selection_inputs(B=2, G=2, h=2, S=24, D=8, n=3, block=4):
    """q, k, v (leaves) and block ids in range: slot 0 the current block, the others earlier blocks."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, G * h, D, generator=g)
    k, v = torch.randn(B, S, G, D, generator=g), torch.randn(B, S, G, D, generator=g)
    current = (torch.arange(S)[:, None] // block).expand(S, n)
    earlier = (torch.rand(B, G, S, n, generator=g) * (current + 1)).long()
    return q, k, v, torch.where(torch.arange(n) == 0, current, earlier)


def forward_backward(module, q, k, v, block_idx):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = module(*leaves, block_idx)
    out.nan_to_num(0.0).square().sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


def with_out_of_range_ids(block_idx, S, block=4):
    """Slots 1 and 2 of some queries set to ids eager's clamp-and-mask ignores: far past the end,
    one past the last block, below -1. Slot 0 (the current block) stays: every query keeps a token."""
    Ns = -(-S // block)
    bad = block_idx.clone()
    bad[0, 0, 5:9, 1] = Ns
    bad[0, 1, 11, 2] = 10**6
    bad[1, 0, 20:, 1] = -7
    bad[1, 1, 3, 2] = Ns + 3
    return bad


def test_out_of_range_block_ids_are_ignored_like_eager():
    """The model's form clamps the gather index and masks what is not a token <= t of a chosen
    block: ids past the end or below -1 take no part, in eager and in the op alike."""
    q, k, v, block_idx = selection_inputs()
    bad = with_out_of_range_ids(block_idx, S=q.shape[1])
    module = UserSelection()
    optimized = optimize_fresh(copy.deepcopy(module))
    for ids in (block_idx, bad):
        expected, got = forward_backward(module, q, k, v, ids), forward_backward(optimized, q, k, v, ids)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert row(optimized, "selected_attention")["matches"] == 1
    assert "torch.gather(" not in state_of(optimized).graphs[0].code_after


def test_a_query_left_with_no_valid_block_gets_eager_nan():
    """The op gives 0 to a query none of whose blocks holds a token <= t; eager's softmax over all
    -inf gives NaN. On a user's block ids the rewrite sets those rows to NaN, as eager."""
    q, k, v, block_idx = selection_inputs()
    bad = block_idx.clone()
    bad[0, 1, 10] = -1  # every slot padding
    bad[1, 0, 7] = 50  # every slot past the end
    module = UserSelection()
    optimized = optimize_fresh(copy.deepcopy(module))
    expected, got = module(q, k, v, bad), optimized(q, k, v, bad)
    assert expected.isnan().any()
    assert torch.equal(got.isnan(), expected.isnan())
    torch.testing.assert_close(got.nan_to_num(), expected.nan_to_num(), rtol=1e-5, atol=1e-5)
    assert "rows with no token: NaN as eager" in row(optimized, "selected_attention")["kernels"][0]
    assert "torch.isneginf" in state_of(optimized).graphs[0].code_after


def test_unclamped_gather_index_out_of_range_fails_like_eager():
    q, k, v, block_idx = selection_inputs()
    bad = with_out_of_range_ids(block_idx, S=q.shape[1])
    module = UserSelection(clamp=False)
    with pytest.raises(RuntimeError, match="out of bounds"):
        module(q, k, v, bad)
    optimized = optimize_fresh(copy.deepcopy(module))
    with pytest.raises(RuntimeError, match="out of bounds"):
        optimized(q, k, v, bad)


# --- out of memory during the first compile ----------------------------------------------------------


OOM = "CUDA out of memory. Tried to allocate 20.00 GiB (simulated during the first compile)"


def is_out_of_memory(error: BaseException) -> bool:
    """The OOM itself, or Dynamo's BackendCompilerFailed around it (Dynamo wraps every error a
    backend raises; the original is its inner_exception and its message names it)."""
    inner = getattr(error, "inner_exception", None)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(inner, torch.OutOfMemoryError) and "OutOfMemoryError: " + OOM in str(error))


class OutOfMemoryOnce(RewritePass):
    """A user pass that runs out of memory the first time (after the built-in passes rewrote)."""

    name = "user_out_of_memory_once"
    summary = "raises torch.OutOfMemoryError on its first graph"

    def __init__(self):
        self.left = 1

    def apply(self, graph, ctx):
        if self.left:
            self.left -= 1
            raise torch.OutOfMemoryError(OOM)


@pytest.fixture
def oom_pass():
    p = nsa_compile.register_pass(OutOfMemoryOnce())
    yield p
    nsa_compile.unregister_pass(p.name)


@pytest.fixture
def oom_in_aot(monkeypatch):
    """The compiler after the passes runs out of memory once (AOTAutograd for compiler='aot_eager',
    where Inductor's compile_fx runs for compiler='inductor')."""
    original, left = nsa_compile.backend._aot_eager, [1]

    def compile_once_out_of_memory(*args, **kwargs):
        if left[0]:
            left[0] -= 1
            raise torch.OutOfMemoryError(OOM)
        return original(*args, **kwargs)

    monkeypatch.setattr(nsa_compile.backend, "_aot_eager", compile_once_out_of_memory)


def first_call_out_of_memory_then_recompile(eager):
    """An optimized copy of the tiny model after a first call that ran out of memory while
    compiling (raised, not swallowed) and a second that compiled and gave eager's loss."""
    optimized = optimize_fresh(copy.deepcopy(eager))
    batch = tokens(2, SEQ, seed=2)
    with pytest.raises(Exception) as error:
        optimized.loss(batch)
    assert is_out_of_memory(error.value), repr(error.value)
    loss = optimized.loss(batch)  # memory freed: the next call compiles and runs
    loss.backward()
    torch.testing.assert_close(loss, eager.loss(batch), rtol=1e-5, atol=1e-6)
    return optimized


@pytest.mark.parametrize("where", ["oom_pass", "oom_in_aot"])
def test_out_of_memory_while_compiling_raises_and_the_next_call_works(where, request, tiny):
    """...and report() counts only the compile that ran: the same rewrites as a clean compile of
    this model at this shape (the `tiny` fixture's), nothing from the failed one."""
    request.getfixturevalue(where)
    optimized = first_call_out_of_memory_then_recompile(tiny.eager)
    assert counts(optimized)["window_attention"] == 2  # the second compile rewrote
    assert counts(optimized).items() >= tiny.clean_counts.items()  # oom_pass adds its own row


def test_out_of_memory_while_verifying_the_selection_is_raised_not_refused(monkeypatch):
    original, left = torch.Tensor.clamp, [1]

    def clamp(self, *args, **kwargs):
        # the first real (not fake) int64 [B, G, S, n] tensor clamped is a probe of block ids
        if left[0] and self.dtype == torch.int64 and self.dim() == 4 and \
                not isinstance(self, torch._subclasses.FakeTensor):
            left[0] -= 1
            raise torch.OutOfMemoryError(OOM)
        return original(self, *args, **kwargs)

    q, k, v, block_idx = selection_inputs()
    module = UserSelection()
    optimized = optimize_fresh(copy.deepcopy(module))
    monkeypatch.setattr(torch.Tensor, "clamp", clamp)
    try:
        optimized(q, k, v, block_idx)
    except Exception as error:  # noqa: BLE001 (what is raised is the question)
        assert is_out_of_memory(error), repr(error)
    else:
        pytest.fail(f"no error; report: {row(optimized, 'selected_attention')}")
