"""Hostile inputs to an optimized model (issue 19, point 5; CPU, aot_eager, the tiny preset with one
layer: every NSA structure, half the compile time).

Each case states the exact behaviour: the optimized model gives eager's answer (the same values
within float32 rounding, the same NaN pattern, the same None gradients), or both raise, the
optimized model with eager's message (an error Dynamo meets while tracing arrives wrapped, eager's
message inside it). Malformed packed positions are in test_reliability.py (section 5); the CLI's
cases in test_cli.py and test_bad_input.py.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import FAST, optimize_fresh, packed_positions, tokens

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.backend import META_REASON
from nsa_compile.models import build_model, positions_from_cu_seqlens, preset
from nsa_compile.parity import check_parity

TINY = preset("tiny", n_layers=1)
# the passes that fire once per layer on the tiny LM
TINY_REWRITES = ("projection_rope", "window_attention", "compressed_attention", "select_blocks",
                 "selected_attention", "gated_combine")
S = 56  # > n * l' = 48: block selection ranks free candidates; > w = 32: the window slides


def make_pair(config=FAST, seed=0, cfg=TINY):
    """(eager, optimized copy) of the tiny LM, freshly compiled."""
    torch.manual_seed(seed)
    eager = build_model(cfg)
    return eager, optimize_fresh(copy.deepcopy(eager), config)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref)).item()


def assert_close(got: torch.Tensor, expected: torch.Tensor, bar: float = 1e-5):
    """Same shape, dtype, device and NaN/inf pattern; finite values within `bar` (relative)."""
    assert (got.shape, got.dtype, got.device) == (expected.shape, expected.dtype, expected.device)
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
    finite = expected.isfinite()
    if finite.any():
        assert rel(got[finite], expected[finite]) < bar


def assert_same_error(call_eager, call_optimized, message: str):
    """Both raise, the optimized model an error of eager's type (Dynamo's TorchRuntimeError is a
    RuntimeError, with eager's message and the user's line inside), both messages containing
    `message`."""
    with pytest.raises(Exception) as eager_error:
        call_eager()
    with pytest.raises(Exception) as optimized_error:
        call_optimized()
    assert isinstance(optimized_error.value, eager_error.type), (eager_error.value, optimized_error.value)
    assert message in str(eager_error.value) and message in str(optimized_error.value), \
        (eager_error.value, optimized_error.value)


def rewritten(model) -> dict[str, int]:
    """Matches per branch pass (0 for a pass switched off)."""
    rows = {r["name"]: r["matches"] for r in nsa_compile.report(model)}
    return {name: rows.get(name, 0) for name in TINY_REWRITES}


ALL_ONCE = dict.fromkeys(TINY_REWRITES, 1)


# --- token dtypes and layouts ---------------------------------------------------------------------


def test_float16_tokens_raise_like_eager():
    eager, optimized = make_pair()
    batch = tokens(2, S)[:, :-1].half()
    assert_same_error(lambda: eager(batch), lambda: optimized(batch),
                      f"tokens must be int64 or int32 [B, S], got torch.float16 [2, {S}]")


def test_int32_tokens_give_eagers_answer():
    eager, optimized = make_pair()
    batch = tokens(2, S)[:, :-1]
    assert_close(optimized(batch.int()), eager(batch))
    assert rewritten(optimized) == ALL_ONCE


def test_non_contiguous_tokens():
    eager, optimized = make_pair()
    wide = tokens(2, 2 * S)[:, :-2]
    batch = wide[:, ::2]  # stride 2
    assert not batch.is_contiguous()
    assert_close(optimized(batch), eager(batch.contiguous()))


def test_non_contiguous_positions():
    eager, optimized = make_pair()
    batch = tokens(2, S)[:, :-1]
    pos = packed_positions([[13, S - 13], [S]]).t().contiguous().t()  # [B, S] with strides (1, B)
    assert not pos.is_contiguous()
    assert_close(optimized(batch, pos), eager(batch, pos.contiguous()))
    assert rewritten(optimized) == ALL_ONCE


def test_tokens_of_the_wrong_rank_raise_like_eager():
    eager, optimized = make_pair()
    flat = tokens(1, S)[0, :-1]  # [S]: no batch dim
    assert_same_error(lambda: eager(flat), lambda: optimized(flat),
                      f"tokens must be int64 or int32 [B, S], got torch.int64 [{S}]")


# --- sizes: batch 0, S = 1, S < l, S not a multiple of the blocks ---------------------------------


def test_batch_zero():
    """Eager's empty logits; no pass looks at a graph with an empty input (the record says so),
    and the next real batch compiles with every rewrite."""
    eager, optimized = make_pair(FAST.replace(dynamic=False))
    batch = tokens(2, S)[:0, :-1]
    expected = eager(batch)
    assert expected.shape == (0, S, 256)
    assert_close(optimized(batch), expected)
    reasons = {reason for r in nsa_compile.report(optimized) for reason in r["reasons"]}
    assert reasons == {(f"the graph input l_tokens_ is empty [0, {S}] (batch 0 or an empty sequence): nothing to "
                        "check a pattern on; it runs as traced, with eager's answer")}
    batch = tokens(2, S)[:, :-1]
    assert_close(optimized(batch), eager(batch))
    assert rewritten(optimized) == ALL_ONCE


@pytest.mark.parametrize("seq", [1, 5, 17], ids=["S=1", "S<l", "S=l'+1"])
def test_short_sequences(seq):
    eager, optimized = make_pair()
    batch = tokens(2, seq, seed=seq)
    loss_e, loss_o = eager.loss(batch), optimized.loss(batch)
    assert rel(loss_o, loss_e) < 1e-6
    loss_e.backward()
    loss_o.backward()
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None and p.grad.abs().max() > 0:
            assert rel(q.grad, p.grad) < 1e-5, name


# --- devices, dtypes, parameters --------------------------------------------------------------------


def test_meta_device_model_gives_eagers_shapes_then_rewrites_once_materialized():
    """A model on the meta device (not yet materialized) runs for its shapes, as eager does; the
    passes have no values to check and say so. Materialized and loaded, it compiles again with
    every rewrite."""
    with torch.device("meta"):
        torch.manual_seed(0)
        meta_model = build_model(TINY)
    optimized = optimize_fresh(meta_model)
    batch = tokens(2, S)[:, :-1]
    out = optimized(batch.to("meta"))
    assert (out.device.type, out.shape, out.dtype) == ("meta", (2, S, 256), torch.float32)
    assert all(r["matches"] == 0 and r["reasons"] == [META_REASON] for r in nsa_compile.report(optimized))
    torch.manual_seed(0)
    eager = build_model(TINY)
    optimized.to_empty(device="cpu")
    optimized.load_state_dict(eager.state_dict())
    assert_close(optimized(batch), eager(batch))
    assert rewritten(optimized) == ALL_ONCE


def test_frozen_parameters_keep_none_gradients():
    eager, optimized = make_pair()
    for model in (eager, optimized):
        model.embed.requires_grad_(False)
        model.blocks[0].attn.wq.requires_grad_(False)
    batch = tokens(2, S, seed=2)
    for model in (eager, optimized):
        model.loss(batch).backward()
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert rel(q.grad, p.grad) < 1e-5, name
    assert optimized.embed.weight.grad is None and optimized.blocks[0].attn.wq.weight.grad is None


def test_every_parameter_frozen_backward_raises_like_eager():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=3)
    for model in (eager, optimized):
        model.requires_grad_(False)
    loss_e, loss_o = eager.loss(batch), optimized.loss(batch)
    assert rel(loss_o, loss_e) < 1e-6
    assert_same_error(loss_e.backward, loss_o.backward, "element 0 of tensors does not require grad")


def test_inputs_without_requires_grad_on_a_user_model():
    """A user's GQA block: the input x with and without requires_grad; its gradient (when asked)
    and every parameter's match eager."""
    from user_models.gqa_block import make

    block, x = make()
    optimized = optimize_fresh(copy.deepcopy(block))
    for needs_grad in (False, True):
        grads = []
        for model in (block, optimized):
            model.zero_grad()
            xi = x.clone().requires_grad_(needs_grad)
            model(xi).square().mean().backward()
            grads.append([xi.grad] + [p.grad for p in model.parameters()])
        for a, b in zip(*grads):
            assert (a is None) == (b is None)
            if a is not None:
                assert rel(b, a) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_parameters_without_autocast(dtype):
    """model.to(bf16 / fp16), no autocast: the parity verdict (eager and optimized each against the
    float64 oracle) holds."""
    torch.manual_seed(0)
    eager = build_model(TINY)
    made = []

    def optimize(model):
        made.append(optimize_fresh(model))
        return made[-1]

    report = check_parity(eager, optimize, tokens(2, S, seed=4), dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert rewritten(made[0]) == ALL_ONCE


def test_model_moved_to_float64_after_optimize():
    """A dtype change after the first call: Dynamo's guards see it and recompile, with every
    rewrite, and the answer is eager's in float64."""
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=5)[:, :-1]
    assert_close(optimized(batch), eager(batch))
    eager.double()
    optimized.double()
    out = optimized(batch)
    assert out.dtype == torch.float64
    assert_close(out, eager(batch), bar=1e-12)
    assert len(state_of(optimized).graphs) == 2
    assert rewritten(optimized) == dict.fromkeys(TINY_REWRITES, 2)


def test_tied_embedding_and_head():
    eager, optimized = make_pair()
    for model in (eager, optimized):
        model.head.weight = model.embed.weight
    batch = tokens(2, S, seed=6)
    for model in (eager, optimized):
        model.loss(batch).backward()
    assert optimized.head.weight is optimized.embed.weight
    assert rel(optimized.embed.weight.grad, eager.embed.weight.grad) < 1e-5


# --- NaN and inf --------------------------------------------------------------------------------------


def test_inf_in_an_attention_weight_gives_eagers_nan_pattern():
    torch.manual_seed(0)
    eager = build_model(TINY)
    with torch.no_grad():
        eager.blocks[0].attn.wq.weight[3, 5] = float("inf")
    optimized = optimize_fresh(copy.deepcopy(eager))
    batch = tokens(2, S, seed=7)[:, :-1]
    expected = eager(batch)
    assert expected.isnan().any()
    assert_close(optimized(batch), expected)


def test_nan_input_to_a_user_model_gives_eagers_nan_pattern():
    from user_models.gqa_block import make

    block, x = make()
    x = x.clone()
    x[1, 4, 7] = float("nan")  # one token of row 1: its value row is NaN, and p @ v multiplies it
    optimized = optimize_fresh(copy.deepcopy(block))  # by 0 for the queries before it: all of row 1
    expected = block(x)
    assert expected[0].isfinite().all() and expected[1].isnan().all()
    assert_close(optimized(x), expected)


# --- packed documents: unusual but valid, and malformed --------------------------------------------


def test_every_document_of_length_one():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=8)[:, :-1]
    pos = torch.zeros(2, S, dtype=torch.int64)
    assert_close(optimized(batch, pos), eager(batch, pos))
    assert rewritten(optimized) == ALL_ONCE


def test_one_document_equals_the_unpacked_model():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=9)[:, :-1]
    pos = torch.arange(S).expand(2, S)
    assert_close(optimized(batch, pos), eager(batch))


def test_empty_document_in_cu_seqlens_is_refused():
    with pytest.raises(ValueError, match=re.escape(f"cu_seqlens must rise strictly from 0 to seq_len={S}")):
        positions_from_cu_seqlens(torch.tensor([0, 13, 13, S]), S)


def test_positions_of_one_row_broadcast_like_eager():
    """pos [1, S] for tokens [2, S]: eager broadcasts the packing to every row, and so does the
    optimized model (the passes, which read [B, S] positions, leave those branches eager)."""
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=10)[:, :-1]
    pos = packed_positions([[13, S - 13]])
    assert_close(optimized(batch, pos), eager(batch, pos))


def test_positions_of_another_batch_raise_like_eager():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=10)[:, :-1]
    pos = packed_positions([[13, S - 13]] * 3)
    assert_same_error(lambda: eager(batch, pos), lambda: optimized(batch, pos),
                      "pos has 3 rows for 2 rows of tokens (or 1 for all)")


def test_positions_of_the_wrong_length_raise_like_eager():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=11)[:, :-1]
    pos = packed_positions([[13, S - 12], [S + 1]])
    for model in (eager, optimized):
        with pytest.raises(ValueError, match=re.escape(f"pos must be int64 [B, {S}], got torch.int64 [2, {S + 1}]")):
            model(batch, pos)


# --- modes and repeated use ------------------------------------------------------------------------


def test_no_grad_and_inference_mode():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=12)[:, :-1]
    expected = eager(batch)
    with torch.no_grad():
        assert_close(optimized(batch), expected.detach())
    with torch.inference_mode():
        out = optimized(batch)
    assert out.is_inference()
    assert_close(out, expected.detach())


def test_optimize_twice_recompiles_with_the_new_config():
    eager, optimized = make_pair()
    batch = tokens(2, S, seed=13)[:, :-1]
    optimized(batch)
    again = nsa_compile.optimize(optimized, FAST.replace(disabled_passes=("window_attention",)))
    assert again is optimized
    assert_close(again(batch), eager(batch))
    assert rewritten(again) == {**ALL_ONCE, "window_attention": 0}


def test_gradient_accumulation_over_two_calls():
    eager, optimized = make_pair()
    first, second = tokens(2, S, seed=14), tokens(2, S, seed=15)
    for model in (eager, optimized):
        (model.loss(first) + 0.5 * model.loss(second)).backward()
    for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
        assert rel(q.grad, p.grad) < 1e-5, name


class TwoOutputs(nn.Module):
    """The tiny LM's logits and an auxiliary head's; training on the logits alone leaves the aux
    head's gradient None in eager."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.aux = nn.Linear(256, 4)

    def forward(self, batch):
        logits = self.lm(batch)
        return logits, self.aux(logits)


def test_auxiliary_head_unused_by_the_loss_keeps_a_none_gradient():
    torch.manual_seed(0)
    eager = TwoOutputs(build_model(TINY))
    optimized = optimize_fresh(copy.deepcopy(eager))
    batch = tokens(2, S, seed=16)[:, :-1]
    for model in (eager, optimized):
        model(batch)[0].logsumexp(-1).mean().backward()
        assert model.aux.weight.grad is None and model.lm.head.weight.grad is not None
    assert rel(optimized.lm.head.weight.grad, eager.lm.head.weight.grad) < 1e-5


# --- CUDA: malformed positions fail the CUDA context, never silently (tools/gpu_check.sh) -------------

CUDA_POSITIONS_SCRIPT = """
import sys, torch
sys.path.insert(0, "tests")
import nsa_compile
from helpers import packed_positions, tokens
from nsa_compile.models import build_model, preset
compiler, case = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
config = nsa_compile.OptimizeConfig(compiler=compiler)
model = nsa_compile.optimize(build_model(preset("tiny", n_layers=1)).cuda(), config)
batch = tokens(2, 56)[:, :-1].cuda()
good = packed_positions([[13, 43], [56]]).cuda()
model(batch, good).sum().item()  # compiles and runs
bad = good.clone()
if case == "past S":
    bad[0, 20:] += 1000
elif case == "-1":
    bad[0, 20] = -1
else:
    bad = good.flip(1)
try:
    model(batch, bad)
    torch.cuda.synchronize()
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0], flush=True)
    sys.exit(3)
print("no error", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("compiler, case", [("inductor", "past S"), ("inductor", "-1"), ("aot_eager", "reversed")])
def test_cuda_malformed_positions_raise_at_the_next_sync(compiler, case):
    """On CUDA the check is a device-side assert (no host sync on the hot path): the call, or the
    next sync, raises RuntimeError and the CUDA context is lost, so each case runs in its own
    process. Never a silent answer, never SIGABRT."""
    result = subprocess.run([sys.executable, "-c", CUDA_POSITIONS_SCRIPT, compiler, case], capture_output=True,
                            text=True, timeout=600, cwd=Path(__file__).parent.parent, check=False)
    assert result.returncode == 3, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    # a device-side assert fired (CUDA prints "Assertion `...` failed." on stderr); the error
    # surfaces at whichever CUDA call comes next: usually "device-side assert triggered", once
    # (H200, 2026-11-27, case -1) a cuBLAS GEMM's CUBLAS_STATUS_INTERNAL_ERROR
    assert re.search(r"Assertion `.*` failed", result.stderr), result.stderr[-2000:]
    assert "CUDA" in result.stdout or "CUBLAS" in result.stdout, result.stdout[-2000:]
