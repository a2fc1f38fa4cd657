"""The gate + combine rewrite (passes/gated_combine.py) and its op nsa::gated_combine
(nsa_compile/ops/gated_combine.py; Triton kernels in gated_combine_triton.py):

- the op's reference backend against the eager formulas under float64 autograd, opcheck, its checks;
- the Triton kernels against the reference backend, on CUDA when there is one, else on the CPU
  through Triton's interpreter (TRITON_INTERPRET=1, set by a fixture for those tests only);
- graph tests: fired (exact count) on every layer of the tiny model with both gate variants, with
  and without the attention passes, the three multiply-adds and the gate's softmax / sigmoid gone
  and the op present; parity of outputs and every gradient (fp32, bf16, fp16); accepted forms; near
  misses refused with the graph unchanged and a reason.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import only_graph, optimize_fresh, row, tokens, train_at_lengths
from oracles import rel_rms, triton_interpreter

import nsa_compile
from nsa_compile.api import state_of
from nsa_compile.models import build_model
from nsa_compile.ops import gated_combine as gc
from nsa_compile.parity import check_parity

PASS = "gated_combine"
ATTENTION = ("window_attention", "compressed_attention", "select_blocks", "selected_attention")
NOT_TRITON = "; not triton: the Triton kernels run on CUDA (tensors on cpu)"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- the op -----------------------------------------------------------------------------------------


def eager_combine(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize):
    """The op's semantics written the eager way (models/nsa.py generalized): autograd is the oracle."""
    B, S, R = gate_in.shape[:3]
    H = o_cmp.shape[2]
    x = gate_in.mean(3)  # [B, S, R, Din]
    if w1 is not None:
        x = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[activation](F.linear(x, w1, b1))
    z = (F.linear(x, w2, b2) if w2 is not None else x).unflatten(-1, (-1, 3))  # [B, S, R, NI, 3]
    g = torch.softmax(z, dim=-1) if normalize == "softmax" else torch.sigmoid(z)
    g = g.repeat_interleave(H // R // z.shape[3], dim=3).reshape(B, S, H, 3)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win


# name: B, S, H, R, M, Din, Dh (0: no hidden layer), NI, Dv, activation, normalize, biases
VARIANTS = {
    "group-silu-softmax": (2, 7, 6, 2, 3, 16, 8, 1, 8, "silu", "softmax", True),
    "head-sigmoid": (2, 5, 4, 1, 1, 24, 0, 4, 8, "none", "sigmoid", True),
    "gelu-2-triples-per-row": (1, 9, 8, 2, 2, 16, 16, 2, 6, "gelu", "softmax", False),
    "relu-sigmoid-no-bias": (2, 37, 6, 1, 3, 8, 16, 3, 16, "relu", "sigmoid", False),
    "head-20-triples": (1, 9, 20, 1, 1, 70, 0, 20, 8, "none", "softmax", True),
    "logits": (2, 5, 8, 2, 1, 6, -1, 2, 8, "none", "sigmoid", False),  # Dh -1: no w2, gate_in the logits
}


def make_args(B, S, H, R, M, Din, Dh, NI, Dv, activation, normalize, bias, dtype=torch.float32, seed=0,
              device=DEVICE):
    """Inputs of the op; the branch outputs as the eager attention leaves them ([B, H, S, Dv]
    memory transposed to [B, S, H, Dv])."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    gate_in = r(B, S, R, M, Din)
    w1 = r(Dh, Din, scale=Din**-0.5) if Dh > 0 else None
    b1 = r(Dh) if Dh > 0 and bias else None
    w2 = r(3 * NI, Dh or Din, scale=(Dh or Din) ** -0.5) if Dh >= 0 else None
    b2 = r(3 * NI) if bias else None
    branches = [r(B, H, S, Dv).transpose(1, 2) for _ in range(3)]
    grad_o = r(B, S, H, Dv)
    return (gate_in, w1, b1, w2, b2, *branches, activation, normalize), grad_o


def with_grads(fn, args, grad_o):
    """fn(*args) and the gradients of every float tensor argument (None where absent)."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    grads = torch.autograd.grad(out, tensors, grad_o)
    it = iter(grads)
    return out, [next(it) if isinstance(x, torch.Tensor) else None for x in leaves[:8]]


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_reference_backend_matches_the_eager_formulas(variant, monkeypatch):
    """float64, every output and gradient, chunked (3 tokens a chunk) so chunks split the batch."""
    monkeypatch.setattr(gc, "REFERENCE_CHUNK", 3)
    args, grad_o = make_args(*VARIANTS[variant], dtype=torch.float64, device="cpu")
    want, want_grads = with_grads(eager_combine, args, grad_o)
    got, got_grads = with_grads(lambda *a: torch.ops.nsa.gated_combine(*a, "reference"), args, grad_o)
    assert got.shape == want.shape and got.dtype == torch.float64 and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("gate_in w1 b1 w2 b2 o_cmp o_sel o_win".split(), got_grads, want_grads):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    # the saved gates: the normalized g per row and triple
    gates = torch.ops.nsa.gated_combine(*args, "reference")[1]
    B, S, _, R, _, _, _, NI = VARIANTS[variant][:8]
    assert gates.shape == (B, S, R, NI, 3) and gates.dtype == torch.float64
    if args[-1] == "softmax":
        torch.testing.assert_close(gates.sum(-1), torch.ones(B, S, R, NI, dtype=torch.float64))


def test_opcheck_forward_and_backward_ops():
    """The group gate (every weight; both ops), the head gate (absent w1, b1; the forward op)."""
    for variant, backward in (("group-silu-softmax", True), ("head-sigmoid", False)):
        args, grad_o = make_args(*VARIANTS[variant], device="cpu")
        leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(torch.ops.nsa.gated_combine.default, (*leaves, "reference"))
        if backward:
            gates = torch.ops.nsa.gated_combine(*args, "reference")[1]
            torch.library.opcheck(torch.ops.nsa.gated_combine_backward.default,
                                  (grad_o, *args[:8], gates, *args[8:], "reference"))


def test_low_precision_inputs_and_float32_weights_autocast_style():
    """bf16 gate input and branch outputs with float32 weights (what bf16 autocast hands the op):
    o in bf16, weight gradients in float32, all within bf16 rounding of the float64 oracle."""
    args, grad_o = make_args(*VARIANTS["group-silu-softmax"], device="cpu")
    low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and i in (0, 5, 6, 7) else a for i, a in enumerate(args)]
    got, grads = with_grads(lambda *a: torch.ops.nsa.gated_combine(*a), low, grad_o.to(torch.bfloat16))
    exact = [a.double() if isinstance(a, torch.Tensor) else a for a in low]
    want, want_grads = with_grads(eager_combine, exact, grad_o.to(torch.bfloat16).double())
    assert got.dtype == torch.bfloat16 and [g.dtype for g in grads[1:5]] == [torch.float32] * 4
    for a, b in zip([got, *grads], [want, *want_grads]):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-2


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a | {1: None, 2: None}, "activation 'silu' with w1 absent"),
        (lambda a: a | {8: "tanh"}, "unknown activation 'tanh'"),
        (lambda a: a | {9: "relu"}, "unknown normalize 'relu'"),
        (lambda a: a | {3: a[3][:, :5]}, "w2 must be [3 * NI, Dh] with Dh = 8"),
        (lambda a: a | {3: torch.randn(6, 8, dtype=torch.float64)}, "NI = 2 gate triples per row, which must divide"),
        (lambda a: a | {1: None, 2: None, 3: None, 8: "none"}, "without w2 the gate input holds the logits"),
        (lambda a: a | {0: a[0][:, :, :1].expand(-1, -1, 4, -1, -1)}, "R = 4 gate rows"),
        (lambda a: a | {6: a[6].float()}, "the branch outputs differ in dtype"),
        (lambda a: a | {7: a[7][:, :3]}, "the branch outputs differ in shape"),
        (lambda a: a | {2: a[2][:3]}, "b1 must be [Dh] = [8]"),
    ],
    ids=["none-with-silu", "activation", "normalize", "w2-shape", "triples", "logits", "rows", "dtype", "shape", "b1"],
)
def test_checks_name_the_bad_argument(change, message):
    args, _ = make_args(*VARIANTS["group-silu-softmax"], dtype=torch.float64, device="cpu")
    bad = change(dict(enumerate(args)))
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.nsa.gated_combine(*(bad[i] for i in range(len(args))), "reference")


def test_backend_choice():
    args, _ = make_args(*VARIANTS["group-silu-softmax"], device="cpu")
    assert gc.choose_backend(args[0], args[1], args[3], args[5], "silu") == "reference"
    why = gc.why_not_triton(args[0], args[1], args[3], args[5], "silu")
    assert why == "the Triton kernels run on CUDA (tensors on cpu)"
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        gc.choose_backend(args[0], args[1], args[3], args[5], "silu", "fast")
    double = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: (device cpu|.*torch.float64)"):
        torch.ops.nsa.gated_combine(*double, "triton")


# --- the Triton kernels -----------------------------------------------------------------------------


@pytest.fixture
def interpreter():
    """Without CUDA: TRITON_INTERPRET=1 while the test runs (and as it was after, so the other
    tests see the CPU as it is)."""
    pytest.importorskip("triton")
    from nsa_compile.ops import gated_combine_triton as gt

    with triton_interpreter(on=DEVICE == "cpu"):
        yield gt


TRITON_CASES = [
    ("group-silu-softmax", torch.float32),
    ("head-20-triples", torch.float32),
    ("gelu-2-triples-per-row", torch.float32),
    ("relu-sigmoid-no-bias", torch.float32),
    ("group-silu-softmax", torch.bfloat16),
    ("head-sigmoid", torch.float16),
    ("logits", torch.bfloat16),
]


@pytest.mark.parametrize("variant, dtype", TRITON_CASES, ids=[f"{v}-{str(d)[6:]}" for v, d in TRITON_CASES])
def test_triton_matches_the_reference_backend(interpreter, variant, dtype):
    """o, the gates and all eight gradients against the reference backend on the same inputs (in
    float32); fp16/bf16 within their rounding (the kernels round dot operands to the input dtype)."""
    gt = interpreter
    args, grad_o = make_args(*VARIANTS[variant], dtype=dtype, seed=3)
    o, gates = gt.combine_forward(*args)
    grads = gt.combine_backward(grad_o, *args[:8], gates, *args[8:])
    f32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    ref_o, ref_gates = gc._reference_forward(*f32)
    ref_grads = gc._reference_backward(grad_o.float(), *f32)
    assert o.dtype == dtype and o.is_contiguous() and gates.dtype == torch.float32
    names = "o gates d_gate_in d_w1 d_b1 d_w2 d_b2 d_cmp d_sel d_win".split()
    for name, a, r in zip(names, (o, gates, *grads), (ref_o, ref_gates, *ref_grads)):
        assert a.shape == r.shape, name
        if r.numel() == 0:
            continue
        assert not a.isnan().any(), name
        if dtype == torch.float32:
            torch.testing.assert_close(a.float(), r, rtol=2e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert rel_rms(a, r) < 1e-2, f"{name}: {rel_rms(a, r):.2e}"


def test_triton_backward_is_deterministic_across_many_tiles(interpreter):
    """More row tiles than programs (the persistent hidden-layer kernel sums fp32 partials per
    program, then over programs in order): bit for bit the same on a rerun, and correct."""
    gt = interpreter
    args, grad_o = make_args(2, 50, 4, 2, 2, 16, 8, 1, 8, "silu", "softmax", True, seed=5)  # 200 rows, 7 tiles
    _, gates = gt.combine_forward(*args)
    first = gt.combine_backward(grad_o, *args[:8], gates, *args[8:])
    again = gt.combine_backward(grad_o, *args[:8], gates, *args[8:])
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for a, r in zip(first, gc._reference_backward(grad_o, *args)):
        torch.testing.assert_close(a, r, rtol=2e-5, atol=2e-5)


def test_the_op_with_backend_triton_through_autograd(interpreter):
    """The op's plumbing around the kernels (the saved gates, absent biases, the empty gradients
    of absent weights) against backend reference."""
    args, grad_o = make_args(*VARIANTS["gelu-2-triples-per-row"], seed=7)
    got, got_grads = with_grads(lambda *a: torch.ops.nsa.gated_combine(*a, "triton"), args, grad_o)
    want, want_grads = with_grads(lambda *a: torch.ops.nsa.gated_combine(*a, "reference"), args, grad_o)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_triton_unsupported_reason(interpreter, monkeypatch):
    gt = interpreter
    args, _ = make_args(*VARIANTS["group-silu-softmax"])
    gate_in, w1, _, w2, _, o_cmp = args[:6]
    assert gt.unsupported_reason(gate_in, w1, w2, o_cmp, "silu") is None
    assert "dtype torch.float64" in gt.unsupported_reason(gate_in.double(), w1, w2, o_cmp, "silu")
    wide = o_cmp.new_zeros(2, 7, 6, 300)
    assert "head dim Dv 300" in gt.unsupported_reason(gate_in, w1, w2, wide, "silu")
    big = torch.zeros(128, 256, device=gate_in.device)
    gin = gate_in.new_zeros(2, 7, 2, 3, 256)
    assert "a hidden layer of 128 x 256" in gt.unsupported_reason(gin, big, w2.new_zeros(3, 128), o_cmp, "silu")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "device cpu" in gt.unsupported_reason(gate_in, w1, w2, o_cmp, "silu")


# --- the pass: the tiny model ---------------------------------------------------------------------


def aten_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def softmaxes_over_three(gm):
    """ATen softmax / sigmoid nodes over the tiny model's gate logits: 3 wide (group) or 3H = 12 wide
    (head); its attention scores at S = 40 are 9, 40 and 48 wide."""
    targets = (torch.ops.aten._softmax.default, torch.ops.aten.sigmoid.default)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets
            and n.meta["val"].shape[-1] in (3, 3 * 4)]


# projection_rope (the pass merging the Linears that read one input into one GEMM) takes the
# head gate's Linear(dim, 3H) into the GEMM of the q/k/v projections of x: the op then reads the
# logits; without it the op runs the Linear itself. The group gate's Linears read q_bar alone.
PROJECTIONS = "projection_rope"
READ = f"branch outputs read once{NOT_TRITON})"
GROUP_GATE = "mean of 2 vectors -> Linear(16, 8) -> silu -> Linear(8, 3) -> softmax, one triple per 2 heads"
FIRES = {
    "group-all-passes": ("group", (), GROUP_GATE),
    "group-eager-attention": ("group", ATTENTION + (PROJECTIONS,), GROUP_GATE),
    # the per-head gate's 12 columns fit no column tile of the rotated projections: projection_rope
    # leaves that Linear alone, and the combine takes it in (as with the projections' pass disabled)
    "head-all-passes": ("head", (), "gate input -> Linear(64, 12) -> sigmoid, one triple per head"),
    "head-eager-attention": ("head", ATTENTION + (PROJECTIONS,),
                             "gate input -> Linear(64, 12) -> sigmoid, one triple per head"),
}


@pytest.mark.parametrize("case", FIRES)
def test_fires_once_per_layer_and_the_multiply_adds_are_gone(case):
    gate, disabled, kernel = FIRES[case]
    torch.manual_seed(0)
    config = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=disabled)
    model = optimize_fresh(build_model("tiny", gate=gate), config)
    model.loss(tokens(2, 40)).backward()
    r = row(model, PASS)
    assert (r["matches"], r["where"], r["refused"]) == (2, ["blocks.0.attn", "blocks.1.attn"], 0), r
    assert r["kernels"] == [f"nsa.gated_combine[reference] ({kernel}; {READ}"]
    record = only_graph(model)
    assert record.code_after.count("torch.ops.nsa.gated_combine(") == 2
    assert record.code_before.count("(Ellipsis, slice(2, 3, None))") == 2
    for c in range(3):  # the gate slices, and with them their products and sums
        assert f"(Ellipsis, slice({c}, {c + 1}, None))" not in record.code_after
    forward, backward = record.aten["forward"], record.aten["backward"]
    assert len(aten_nodes(forward, torch.ops.nsa.gated_combine.default)) == 2
    assert len(aten_nodes(backward, torch.ops.nsa.gated_combine_backward.default)) == 2
    assert softmaxes_over_three(forward) == [] and softmaxes_over_three(backward) == []
    # each branch output goes to the op alone (and to the backward, saved): no product of it is left
    for node in forward.graph.nodes:
        if node.target is torch.ops.nsa.gated_combine.default:
            assert all(user is node or user.op == "output" for b in node.args[5:8] for user in b.users)


def test_disabled_keeps_the_eager_gate():
    config = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=(PASS,))
    model = optimize_fresh(build_model("tiny"), config)
    model.loss(tokens(2, 40)).backward()
    assert "gated_combine" not in only_graph(model).code_after
    assert len(softmaxes_over_three(only_graph(model).aten["forward"])) == 2


PARITY = [
    ("group", torch.float32, ()),
    ("group", torch.bfloat16, ATTENTION + ("gqa_grouped_matmul",)),
    ("head", torch.float16, ATTENTION),
    ("head", torch.bfloat16, ()),
]


@pytest.mark.parametrize("gate, dtype, disabled", PARITY, ids=[f"{g}-{str(d)[6:]}-{'alone' if x else 'all'}"
                                                                for g, d, x in PARITY])
def test_parity_outputs_and_every_gradient(gate, dtype, disabled):
    torch.manual_seed(1)
    eager = build_model("tiny", gate=gate)
    config = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=disabled)
    report = check_parity(eager, lambda m: optimize_fresh(m, config), tokens(2, 40, seed=4), dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]
    assert len(report.rows) == 2 + len(list(eager.parameters()))


# --- accepted forms and near misses, on the model's lines with one change each ----------------------


class Combine(nn.Module):
    """NSAAttention.gates and the combine line of models/nsa.py on q [B, S, H, Dk], x [B, S, dim]
    and the branch outputs, written as there except for `change`."""

    def __init__(self, gate="group", change=None, G=2, Dk=8, dim=12, H=4):
        super().__init__()
        self.kind, self.change, self.G = gate, change, G
        if gate == "group":
            act = {"relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh()}.get(change, nn.SiLU())
            self.gate = nn.Sequential(nn.Linear(Dk, Dk // 2, bias=change != "no-bias"), act,
                                      nn.Linear(Dk // 2, 3, bias=change != "no-bias"))
        else:
            self.gate = nn.Linear(dim, 3 * H)
        self.other = nn.Linear(Dk, 3)

    def gates(self, x, q):
        B, S, H, Dk = q.shape
        change, G = self.change, self.G
        if self.kind == "head":
            logits = self.gate(x)
            if change == "per-head-softmax":
                return torch.softmax(logits.view(B, S, H, 3), dim=-1)
            if change == "softmax-over-all-heads":
                return torch.softmax(logits, dim=-1).view(B, S, H, 3)
            return torch.sigmoid(logits).unflatten(-1, (H, 3)) if change == "unflatten" else \
                torch.sigmoid(logits).view(B, S, H, 3)
        q_bar = q.view(B, S, G, H // G, Dk).mean(3)  # [B, S, G, Dk]
        logits = self.gate(q_bar)
        if change == "logits-read-another-tensor":
            logits = logits + self.other(q_bar)
        g = torch.softmax(logits, dim=2 if change == "softmax-wrong-dim" else -1)  # [B, S, G, 3]
        if change == "gate-scaled-by-another-tensor":
            g = g * self.other.bias
        return g.repeat_interleave(H // G, dim=2)

    def forward(self, x, q, o_cmp, o_sel, o_win):
        g = self.gates(x, q)  # [B, S, H, 3]
        change = self.change
        if change == "two-branches":
            return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel
        if change == "column-twice":
            return g[..., 0:1] * o_cmp + g[..., 0:1] * o_sel + g[..., 2:3] * o_win
        if change == "factors-swapped-and-nested":
            return o_cmp * g[..., 0:1] + (o_sel * g[..., 1, None] + g[..., 2].unsqueeze(-1) * o_win)
        if change == "product-returned":
            product = g[..., 2:3] * o_win
            return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + product, product
        if change == "partial-sum-returned":
            partial = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel
            return partial + g[..., 2:3] * o_win, partial
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # [B, S, H, Dv]
        return (o, g) if change == "gate-returned" else o


def combine_inputs(B=2, S=5, H=4, Dk=8, Dv=6, dim=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, dim, generator=g).to(dtype)
    q = torch.randn(B, S, H, Dk, generator=g).to(dtype)
    branches = [torch.randn(B, H, S, Dv, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    return [x, q, *branches]


# the pass alone on these modules (projection_rope would merge the test's two Linears on q_bar)
ONLY = nsa_compile.OptimizeConfig(compiler="aot_eager", disabled_passes=(PROJECTIONS,))


def run_both(module, args, config=None):
    """(eager outputs, optimized outputs, their input gradients and parameter gradients, the
    optimized module), on leaf copies of the inputs."""
    def run(m, leaves):
        out = m(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).square().sum() for o in outs)
        loss.backward()
        return outs, [x.grad for x in leaves] + [p.grad for p in m.parameters()]

    leaves = lambda: [x.clone().requires_grad_() for x in args]
    optimized = optimize_fresh(copy.deepcopy(module), config or nsa_compile.OptimizeConfig(compiler="aot_eager"))
    return run(module, leaves()), run(optimized, leaves()), optimized


@pytest.mark.parametrize(
    "gate, change",
    [("group", None), ("group", "factors-swapped-and-nested"), ("group", "relu"), ("group", "gelu"),
     ("group", "no-bias"), ("group", "tanh"), ("group", "logits-read-another-tensor"), ("head", None),
     ("head", "unflatten"), ("head", "per-head-softmax")],
    ids=["group", "factors-swapped-and-nested", "relu", "gelu", "no-bias", "tanh-stays-as-the-gate-input",
         "logits-read-another-tensor", "head", "head-unflatten", "head-per-head-softmax"],
)
def test_accepted_forms(gate, change):
    (want, want_grads), (got, got_grads), optimized = run_both(Combine(gate, change), combine_inputs(), ONLY)
    r = row(optimized, PASS)
    assert r["matches"] == 1 and r["refused"] == 0, r
    code = only_graph(optimized).code_after
    if change == "tanh":  # an activation the op does not know: the hidden layer stays, the op takes its output
        assert "Linear(4, 3)" in r["kernels"][0] and "torch.tanh(" in code
    if change == "logits-read-another-tensor":  # the logits stay as they are, the op reads them
        assert r["kernels"][0].startswith("nsa.gated_combine[reference] (gate logits -> softmax") and " + " in code
    assert "(Ellipsis, slice(0, 1, None))" not in code and "(Ellipsis, 1, None)" not in code
    for a, b in zip(got + tuple(got_grads), want + tuple(want_grads)):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "gate, change, reason",
    [
        ("group", "two-branches", "the weighted sum reads 2 tensors besides the gate (l_o_cmp_, l_o_sel_); the op "
                                  "mixes exactly three branch outputs"),
        ("group", "column-twice", "the branches are weighed by gate columns [0, 0, 2], not 0, 1, 2 once each"),
        ("group", "softmax-wrong-dim", "the gate softmax runs over dim 2 of (2, 5, 2, 3), not over the three branches"),
        ("head", "softmax-over-all-heads", "the gate softmax runs over dim -1 of (2, 5, 12), not over the three"),
        ("group", "gate-scaled-by-another-tensor", "the weighted sum reads 4 tensors besides the gate "
                                                   "(l_self_modules_other_parameters_bias_, l_o_cmp_, l_o_sel_, l_o_win_)"),
        ("group", "gate-returned", "values of the gated sum are also used elsewhere: g_1 (repeat_interleave) by output"),
        ("group", "partial-sum-returned", "values of the gated sum are also used elsewhere: partial (add) by output"),
        ("group", "product-returned", "values of the gated sum are also used elsewhere: product (mul) by output"),
    ],
    ids=["two-branches", "column-twice", "softmax-wrong-dim", "softmax-over-all-heads", "gate-scaled-by-another-tensor",
         "gate-returned", "partial-sum-returned", "product-returned"],
)
def test_near_misses_refused_with_the_graph_unchanged(gate, change, reason):
    (want, _), (got, _), optimized = run_both(Combine(gate, change), combine_inputs(), ONLY)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same eager code
    record = only_graph(optimized)
    assert record.code_before == record.code_after
    r = row(optimized, PASS)
    assert r["matches"] == 0 and any(reason in text for text in r["reasons"]), r["reasons"]


def test_branch_outputs_of_different_dtypes_are_refused():
    x, q, o_cmp, o_sel, o_win = combine_inputs()
    (_, _), (_, _), optimized = run_both(Combine(), [x, q, o_cmp, o_sel.double(), o_win], ONLY)
    r = row(optimized, PASS)
    assert r["matches"] == 0 and r["reasons"] == [
        "the branch outputs differ in dtype: torch.float32, torch.float64, torch.float32"]


def test_a_float32_gate_on_bf16_branch_outputs_is_cast_back():
    """A float32 gate on bf16 branch outputs makes o float32 (type promotion; on CUDA, bf16 autocast
    does this, its softmax runs in float32): the op writes bf16 and a cast restores float32."""
    x, q, *branches = combine_inputs()
    args = [x, q, *(o.to(torch.bfloat16) for o in branches)]
    (want, want_grads), (got, got_grads), optimized = run_both(Combine(), args, ONLY)
    assert want[0].dtype == got[0].dtype == torch.float32
    assert row(optimized, PASS)["matches"] == 1
    assert "torch_Tensor_to(getitem" in only_graph(optimized).code_after  # torch.Tensor.to
    for a, b in zip(got + tuple(got_grads), want + tuple(want_grads)):
        if b is not None:
            assert a.dtype == b.dtype and rel_rms(a, b) < 1e-2


class CombineThenOutput(Combine):
    """The gate softmax in float32 (as CUDA's bf16 autocast runs it), then the output projection."""

    def __init__(self):
        super().__init__()
        self.wo = nn.Linear(4 * 6, 10, bias=False)

    def forward(self, x, q, o_cmp, o_sel, o_win):
        B, S, H, Dk = q.shape
        logits = self.gate(q.view(B, S, self.G, H // self.G, Dk).mean(3))
        g = torch.softmax(logits.float(), dim=-1).repeat_interleave(H // self.G, dim=2)
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # float32
        return self.wo(o.reshape(B, S, -1))


def test_bf16_autocast_next_linear_rounds_the_op_output_itself():
    """Under bf16 autocast the op gets bf16 activations and float32 weights (the eager Linear
    casts them); the float32 sum feeds only wo, which autocast rounds to bf16 anyway: no cast
    kernel, the op's bf16 output goes there, same result."""
    module = CombineThenOutput()
    args = [a.to(torch.bfloat16) if i >= 2 else a for i, a in enumerate(combine_inputs())]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (want, want_grads), (got, got_grads), optimized = run_both(module, args, ONLY)
    assert want[0].dtype == got[0].dtype == torch.bfloat16
    assert row(optimized, PASS)["matches"] == 1
    assert "torch_Tensor_to(" not in only_graph(optimized).code_after
    for a, b in zip(got + tuple(got_grads), want + tuple(want_grads)):
        if b is not None:
            assert a.dtype == b.dtype and rel_rms(a, b) < 2e-2, (a.dtype, rel_rms(a, b))


# --- symbolic sizes (dynamic shapes, issue 19.2) ------------------------------------------------

ALONE = nsa_compile.OptimizeConfig(
    compiler="aot_eager", disabled_passes=tuple(p for p in nsa_compile.pass_names() if p != PASS))


def pass_logs(record) -> list:
    return [log for log in record.logs if log.pass_name == PASS]


@pytest.mark.parametrize("gate", ["group", "head"])
def test_varying_length_keeps_the_rewrite_in_one_graph_with_symbolic_sizes(gate):
    """The tiny model (one layer, the pass alone) trained at lengths 64, 57, 100, 129: Dynamo
    compiles 64 static and from 57 on one graph with S as a symbol (the model's block padding
    guards n <= S / l', true at each of these lengths); the op in both graphs, the gate's slices
    and multiply-adds gone, loss and every gradient as eager at each length."""
    torch.manual_seed(0)
    eager = build_model("tiny", n_layers=1, gate=gate)
    model = optimize_fresh(copy.deepcopy(eager), ALONE)
    graphs = train_at_lengths(eager, model, (64, 57, 100, 129))
    assert len(graphs) == 2  # no recompile per length
    assert "torch.SymInt" not in graphs[0].code_before and "torch.SymInt" in graphs[1].code_before
    for record in graphs:
        (log,) = pass_logs(record)
        assert len(log.matches) == 1 and log.refusals == [], log.refusals
        assert record.code_after.count("torch.ops.nsa.gated_combine(") == 1
        assert record.code_before.count("(Ellipsis, slice(2, 3, None))") == 1
        for c in range(3):
            assert f"(Ellipsis, slice({c}, {c + 1}, None))" not in record.code_after
        assert len(aten_nodes(record.aten["forward"], torch.ops.nsa.gated_combine.default)) == 1
        assert len(aten_nodes(record.aten["backward"], torch.ops.nsa.gated_combine_backward.default)) == 1


class FromOneInput(nn.Module):
    """`Combine` (or a subclass) on x, q and the branch outputs sliced from one tensor u
    [B, S, H, Dk + 3 * Dv]: as in the model, every size is the input's, so Dynamo gives them one
    size symbol each for B and S (separate inputs each get their own)."""

    def __init__(self, inner: nn.Module, Dk: int = 8, Dv: int = 6):
        super().__init__()
        self.inner, self.Dk, self.Dv = inner, Dk, Dv

    def forward(self, u):
        Dk, Dv = self.Dk, self.Dv
        x = u[..., :3].flatten(2)  # [B, S, 3H]: the head gate's input (dim 12 for H = 4)
        q = u[..., :Dk].contiguous()
        branches = [u[..., Dk + i * Dv:Dk + (i + 1) * Dv] for i in range(3)]  # [B, S, H, Dv]
        return self.inner(x, q, *branches)


def run_shapes(module, shapes, config=ALONE, H=4, Dk=8, Dv=6):
    """The module eager and optimized on a random u [B, S, H, Dk + 3 Dv] for each (B, S) of
    `shapes`: (optimized module, [(eager output and gradients, optimized ones)] per shape)."""
    optimized = optimize_fresh(copy.deepcopy(module), config)
    results = []
    for B, S in shapes:
        u = torch.randn(B, S, H, Dk + 3 * Dv, generator=torch.Generator().manual_seed(S))
        pair = []
        for m in (module, optimized):
            leaf = u.clone().requires_grad_()
            out = m(leaf)
            loss = (out * torch.linspace(-1, 1, out.shape[-1])).square().sum()
            grads = torch.autograd.grad(loss, [leaf, *m.parameters()], allow_unused=True)
            pair.append((out, [g for g in grads if g is not None]))  # Combine.other is not used
        results.append(pair)
    return optimized, results


@pytest.mark.parametrize("gate", ["group", "head"])
def test_symbolic_batch_and_length_one_graph(gate):
    """(B, S) = (2, 5), (3, 6), (2, 9), (2, 17): one static graph, then one with B and S symbolic
    that serves every later shape; the op in both, outputs and every gradient as eager."""
    shapes = [(2, 5), (3, 6), (2, 9), (2, 17)]
    optimized, results = run_shapes(FromOneInput(Combine(gate)), shapes)
    for (want, want_grads), (got, got_grads) in results:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)
    graphs = state_of(optimized).graphs
    assert len(graphs) == 2
    assert graphs[1].code_before.count("torch.SymInt") == 2  # B and S
    for record in graphs:
        (log,) = pass_logs(record)
        assert len(log.matches) == 1 and log.refusals == [], log.refusals
        assert record.code_after.count("torch.ops.nsa.gated_combine(") == 1


class ScaledAtLongerSizes(Combine):
    """The weighted sum with the window branch doubled from S = 16 on (1 + S // 16): right at the
    size Dynamo saw (6) and the probe 7, wrong at the probe 6 + 19 = 25."""

    def forward(self, x, q, o_cmp, o_sel, o_win):
        g = self.gates(x, q)
        return g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win * (1 + q.shape[1] // 16)


def test_a_sum_right_only_at_the_traced_size_is_refused_at_symbolic_sizes():
    """S = 5 compiles static (the sum is right there: rewritten); S = 6 compiles with S symbolic
    and the probe S = 25 shows the window branch doubled: refused naming that size, the graph
    unchanged, outputs the eager code's."""
    optimized, results = run_shapes(FromOneInput(ScaledAtLongerSizes()), [(2, 5), (2, 6)])
    for (want, _), (got, _) in results:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    static, dynamic = state_of(optimized).graphs
    assert len(pass_logs(static)[0].matches) == 1
    (log,) = pass_logs(dynamic)
    assert log.matches == [] and "torch.SymInt" in dynamic.code_before
    (reason,) = [r.reason for r in log.refusals]
    assert re.fullmatch(r"at s\d+=25: branch getitem_\d+ is not weighed by one gate entry per head and token",
                        reason), reason
    assert dynamic.code_after == dynamic.code_before


def test_backend_named_in_the_config_is_used_or_the_sum_refused():
    """OptimizeConfig(gated_combine_backend=...): 'reference' is written into the graph; 'triton', which
    cannot run on the CPU outside the interpreter, leaves the eager lines with the reason."""
    (_, _), (_, _), ref = run_both(Combine(), combine_inputs(), ONLY.replace(gated_combine_backend="reference"))
    r = row(ref, PASS)
    assert r["matches"] == 1 and r["kernels"][0].endswith("not triton: gated_combine_backend='reference' in OptimizeConfig)")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return
    (want, _), (got, _), tri = run_both(Combine(), combine_inputs(), ONLY.replace(gated_combine_backend="triton"))
    r = row(tri, PASS)
    assert r["matches"] == 0 and r["reasons"][0].startswith(
        "OptimizeConfig(gated_combine_backend='triton'): gated_combine: backend 'triton' cannot run these inputs:"), r
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.inductor
def test_inductor_smoke_gated_combine():
    args = combine_inputs()
    torch.manual_seed(0)
    eager = Combine()
    torch._dynamo.reset()
    optimized = nsa_compile.optimize(copy.deepcopy(eager), nsa_compile.OptimizeConfig(disabled_passes=(PROJECTIONS,)))
    torch.testing.assert_close(optimized(*args), eager(*args), rtol=1e-5, atol=1e-6)
    assert row(optimized, PASS)["matches"] == 1


# --- on the GPU ---------------------------------------------------------------------------------------

FLOORS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _errors(dtype, shape, seed):
    """Relative errors of (triton op, eager formula) against the float64 eager formula for o and
    every gradient, on CUDA."""
    args, grad_o = make_args(*shape, dtype=dtype, seed=seed, device="cuda")
    exact = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    ref, ref_grads = with_grads(eager_combine, exact, grad_o.double())
    got, got_grads = with_grads(lambda *a: torch.ops.nsa.gated_combine(*a, "triton"), args, grad_o)
    eager, eager_grads = with_grads(eager_combine, args, grad_o)
    rows = []
    for name, a, e, r in zip("o gate_in w1 b1 w2 b2 o_cmp o_sel o_win".split(), (got, *got_grads),
                             (eager, *eager_grads), (ref, *ref_grads)):
        if r is not None:
            assert a.dtype == e.dtype and a.shape == e.shape, name
            rows.append((name, rel_rms(a, r), rel_rms(e, r)))
    again = with_grads(lambda *a: torch.ops.nsa.gated_combine(*a, "triton"), args, grad_o)
    assert torch.equal(again[0], got) and all(
        torch.equal(a, b) for a, b in zip(again[1], got_grads) if a is not None)  # deterministic
    return rows


# B, S, H, R, M, Din, Dh, NI, Dv, activation, normalize, biases: the seed's group gate, the paper's head gate
SEED_GROUP = (2, 1000, 12, 2, 6, 64, 32, 1, 64, "silu", "softmax", True)
PAPER_HEAD = (1, 700, 64, 1, 1, 2048, 0, 64, 128, "none", "sigmoid", True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [SEED_GROUP, PAPER_HEAD], ids=["seed-group", "paper-head"])
def test_triton_on_cuda_against_the_float64_oracle(shape, dtype):
    """Within 2x the eager formula's own error (or the floor), deterministic."""
    for name, err, err_eager in _errors(dtype, shape, seed=1):
        assert err <= max(2 * err_eager, FLOORS[dtype]), (name, err, err_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["group", "head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_with_inductor_on_cuda(gate, dtype):
    def with_inductor(model):
        torch._dynamo.reset()
        return nsa_compile.optimize(model)

    torch.manual_seed(0)
    eager = build_model("tiny", gate=gate).cuda()
    batch = tokens(2, 100, seed=1).cuda()
    report = check_parity(eager, with_inductor, batch, dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = with_inductor(copy.deepcopy(eager).to(dtype))
    model.loss(batch).backward()
    r = row(model, PASS)
    assert r["matches"] == eager.cfg.n_layers and "[triton]" in r["kernels"][0], r


@pytest.mark.gpu
@pytest.mark.sweep
@pytest.mark.parametrize("S", [63, 100, 1000, 4096])
@pytest.mark.parametrize("h", [1, 4, 6, 16])
def test_triton_at_the_issue_sizes(S, h):
    """Group gates (G = 2, h heads each, Dk 64, hidden 32) and head gates (dim 256, 2h heads),
    batch 2, Dv 32, every dtype: o and every gradient within the floors of the float64 oracle
    (or 2x the eager formula's error)."""
    group = (2, S, 2 * h, 2, h, 64, 32, 1, 32, "silu", "softmax", True)
    head = (2, S, 2 * h, 1, 1, 256, 0, 2 * h, 32, "none", "sigmoid", True)
    for shape in (group, head):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for name, err, err_eager in _errors(dtype, shape, seed=S + h):
                assert err <= max(2 * err_eager, FLOORS[dtype]), (name, dtype, shape[6], err, err_eager)


def gate_input_dtype(optimized) -> torch.dtype:
    """The dtype of the gate input the op receives in the ATen forward graph."""
    (node,) = aten_nodes(only_graph(optimized).aten["forward"], torch.ops.nsa.gated_combine.default)
    return node.args[0].meta["val"].dtype


def test_autocast_head_gate_gets_its_input_rounded_as_the_linear_does():
    """A head gate Linear on a float32 x under bf16 autocast: eager's Linear rounds x to bf16 and
    multiplies in bf16. The op receives x so rounded (a GEMM in float32 would be slower and not
    what eager computed); outside autocast, x stays float32 and no cast is written."""
    args = [a.to(torch.bfloat16) if i >= 1 else a for i, a in enumerate(combine_inputs())]  # x float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (want, want_grads), (got, got_grads), optimized = run_both(Combine("head"), args, ONLY)
    r = row(optimized, PASS)
    assert r["matches"] == 1 and "gate input rounded to bfloat16 (autocast's Linear)" in r["kernels"][0], r
    assert "torch_Tensor_to(l_x_, torch.bfloat16)" in only_graph(optimized).code_after
    assert gate_input_dtype(optimized) == torch.bfloat16
    for a, b in zip(got + tuple(got_grads), want + tuple(want_grads)):
        if b is not None:
            assert a.dtype == b.dtype and rel_rms(a, b) < 2e-2, (a.dtype, rel_rms(a, b))
    # near miss: no autocast, the Linear computes in x's float32: nothing rounded
    (_, _), (_, _), plain = run_both(Combine("head"), combine_inputs(), ONLY)
    assert row(plain, PASS)["matches"] == 1 and "rounded" not in row(plain, PASS)["kernels"][0]
    assert "torch_Tensor_to(" not in only_graph(plain).code_after and gate_input_dtype(plain) == torch.float32
