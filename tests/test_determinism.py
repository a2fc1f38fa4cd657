"""OptimizeConfig(deterministic=True): validated, part of the cache key, followed by the window
pass (never FA-2, whose backward adds dQ atomically), and, on the GPU, two backward runs of an
optimized seed-shaped model give bitwise the same gradients.

Whole-model determinism on CUDA also needs PyTorch's own switch for the rest of the model
(embedding and gather backwards, Inductor's scatter kernels, cuBLAS): the config sets no global
state, so the GPU tests set torch.use_deterministic_algorithms(True) themselves, as a user would.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import optimize_fresh, row, tokens

import nsa_compile
from nsa_compile.models import build_model
from nsa_compile.ops import flash
from nsa_compile.pass_manager import NSAGraphPass, OptimizeState

FAST = nsa_compile.OptimizeConfig(compiler="aot_eager")
DETERMINISTIC = FAST.replace(deterministic=True)
WINDOW_TINY = "nsa.window_attention[{}] (w=32, GQA-native, no S x S tensor{})"


# --- the config ------------------------------------------------------------------------------------


def test_deterministic_resolves_the_window_backend_and_undoes_on_replace():
    assert nsa_compile.OptimizeConfig().deterministic is False
    assert DETERMINISTIC.window_attention_backend == "reference"  # 'auto' could take FA-2
    assert "deterministic=True" in repr(DETERMINISTIC) and "window_attention_backend='reference'" in repr(DETERMINISTIC)
    # replace() starts from what the user asked for: 'auto' comes back with deterministic=False
    assert DETERMINISTIC.replace(deterministic=False).window_attention_backend == "auto"
    assert DETERMINISTIC.replace(compiler="eager").window_attention_backend == "reference"
    named = FAST.replace(window_attention_backend="reference", deterministic=True)
    assert named.replace(deterministic=False).window_attention_backend == "reference"  # named by the user: kept
    # the backends that are deterministic anyway stay as asked
    assert DETERMINISTIC.selected_attention_backend == "auto"
    assert FAST.replace(deterministic=True, selected_attention_backend="triton").selected_attention_backend == "triton"


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"deterministic": "yes"}, TypeError, "deterministic must be a bool, not str"),
        ({"deterministic": 1}, TypeError, "deterministic must be a bool, not int"),
        ({"deterministic": True, "window_attention_backend": "flash"}, ValueError,
         "window_attention_backend='flash' with deterministic=True: FA-2's backward accumulates dQ with atomic adds"),
        ({"deterministic": True, "selected_attention_backend": "varlen"}, ValueError,
         "selected_attention_backend='varlen' with deterministic=True: FA-2's backward accumulates dQ"),
        ({"deterministic": True, "window_attention_backend": "flahs"}, ValueError, "unknown window_attention_backend 'flahs'"),
    ],
    ids=["str", "int", "flash", "varlen", "typo-before-determinism"],
)
def test_bad_deterministic_configs_raise_at_construction(changes, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        nsa_compile.OptimizeConfig(**changes)
    # the selection's deterministic backends are accepted
    for backend in ("auto", "triton", "reference"):
        nsa_compile.OptimizeConfig(deterministic=True, selected_attention_backend=backend)


def test_deterministic_is_in_the_cache_key_and_the_pass_uuid():
    """Compiled code must not be shared between the two settings, even where they pick the same
    backends (a pass reading config.deterministic would rewrite differently)."""
    plain = FAST.replace(window_attention_backend="reference")
    strict = plain.replace(deterministic=True)
    assert plain.cache_key() != strict.cache_key()
    assert "('deterministic', True)" in strict.cache_key()
    uuids = {NSAGraphPass(OptimizeState.for_config(c)).uuid() for c in (plain, strict)}
    assert len(uuids) == 2
    # the bookkeeping of replace() is not behaviour: the same backends give the same key
    assert DETERMINISTIC.cache_key() == strict.cache_key()


# --- the window pass follows it ----------------------------------------------------------------


def test_window_pass_takes_reference_where_auto_would_take_flash(monkeypatch):
    """With FA-2 reported runnable (as for bf16 on an H100), 'auto' writes the flash kernel into
    the graph (it then fails here, on the CPU, which proves it was called) and deterministic=True
    writes the reference kernel (which runs, with the eager numbers)."""
    monkeypatch.setattr(flash, "unsupported_reason", lambda q, k, v: None)
    torch.manual_seed(0)
    eager = build_model("tiny")
    batch = tokens(2, 64, seed=1)

    fast = optimize_fresh(copy.deepcopy(eager), FAST)
    with pytest.raises(Exception, match="_flash_attention_forward"):
        fast.loss(batch)
    assert row(fast, "window_attention")["kernels"] == [
        WINDOW_TINY.format("flash", "; not triton: the Triton kernels run on CUDA (tensors on cpu)")]

    strict = optimize_fresh(copy.deepcopy(eager), DETERMINISTIC)
    loss = strict.loss(batch)
    r = row(strict, "window_attention")
    assert (r["matches"], r["where"]) == (2, ["blocks.0.attn", "blocks.1.attn"])
    assert r["kernels"] == [WINDOW_TINY.format("reference", "; not triton or flash: window_attention_backend='reference' in OptimizeConfig")]
    assert "torch.ops.nsa.window_attention" in "".join(g.code_after for g in nsa_compile.api.state_of(strict).graphs)
    torch.testing.assert_close(loss, eager.loss(batch), rtol=1e-5, atol=1e-6)


def grads_of_one_step(model, batch, autocast=None):
    model.zero_grad(set_to_none=True)
    with autocast or torch.autocast("cpu", enabled=False):
        loss = model.loss(batch)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def test_two_backward_runs_are_bitwise_equal_on_the_cpu():
    torch.manual_seed(0)
    model = optimize_fresh(build_model("tiny"), DETERMINISTIC)
    batch = tokens(2, 100, seed=2)  # S > n * l': the selection is sparse
    loss, first = grads_of_one_step(model, batch)
    again, second = grads_of_one_step(model, batch)
    assert torch.equal(loss, again)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert row(model, "selected_attention")["matches"] == 2


# --- on the GPU -----------------------------------------------------------------------------------


@pytest.fixture
def torch_deterministic(monkeypatch):
    """torch.use_deterministic_algorithms(True) for one test (restored after): what a user sets
    for the parts of the model outside the rewrites. cuBLAS needs its workspace setting too."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


NOT_REPEATABLE = ("[flash]", "[varlen")  # kernels whose backward uses atomics


@pytest.mark.gpu
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_seed_shaped_model_gives_bitwise_equal_gradients(torch_deterministic, compiler):
    """The seed model's shapes (2 layers), S = 2048 (> n * l' = 1024: sparse selection), batch 2,
    bf16 autocast as in training: two forward+backward runs, every gradient bitwise equal."""
    torch.manual_seed(0)
    model = build_model("seed", n_layers=2).cuda()
    optimized = optimize_fresh(model, nsa_compile.OptimizeConfig(compiler=compiler, deterministic=True))
    batch = tokens(2, 2048, seed=3).cuda()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    loss, first = grads_of_one_step(optimized, batch, autocast)
    again, second = grads_of_one_step(optimized, batch, autocast)
    assert torch.equal(loss, again)
    names = [name for name, _ in optimized.named_parameters()]
    differ = [n for n, a, b in zip(names, first, second) if not torch.equal(a, b)]
    assert not differ, differ
    rows = nsa_compile.report(optimized)
    kernels = [k for r in rows for k in r["kernels"]]
    assert not [k for k in kernels if any(tag in k for tag in NOT_REPEATABLE)], kernels
    assert row(optimized, "window_attention")["matches"] == 2
    assert row(optimized, "selected_attention")["matches"] == 2


@pytest.mark.gpu
def test_window_backend_of_a_deterministic_config_repeats_without_the_global_switch():
    """The rewrites alone need no global state: the backend deterministic=True picks for the
    window (reference) gives bitwise the same gradients twice with torch's switch off."""
    assert not torch.are_deterministic_algorithms_enabled()
    backend = nsa_compile.OptimizeConfig(deterministic=True).window_attention_backend
    g = torch.Generator(device="cuda").manual_seed(0)
    B, G, h, S, D, w = 2, 2, 6, 4096, 64, 512
    q, k, v = (torch.randn(B, n, S, D, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for n in (G * h, G, G))
    grad = torch.randn(B, G * h, S, D, device="cuda", generator=g, dtype=torch.bfloat16)

    def run():
        out = torch.ops.nsa.window_attention(q, k, v, w, D**-0.5, backend)[0]
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


@pytest.mark.gpu
def test_flash_backward_repeats_under_the_global_switch(torch_deterministic):
    """What PyTorch does for FA-2 under torch.use_deterministic_algorithms(True): its backward
    takes FA-2's deterministic path (aten passes deterministic=true). A future window route could
    keep flash when the user has set the switch; this pins the behaviour it would rely on."""
    if flash.unsupported_reason(*(torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16),) * 3):
        pytest.skip("FA-2 cannot run on this GPU")
    g = torch.Generator(device="cuda").manual_seed(1)
    B, G, h, S, D, w = 2, 2, 6, 4096, 64, 512
    q, k, v = (torch.randn(B, n, S, D, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for n in (G * h, G, G))
    grad = torch.randn(B, G * h, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        out = torch.ops.nsa.window_attention(q, k, v, w, D**-0.5, "flash")[0]
        runs.append(torch.autograd.grad(out, (q, k, v), grad))
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other))
