"""The NSA gate and the weighted sum of the three branch outputs as one functional custom op
(NSA_SEMANTICS.md section 5).

    o, gates = torch.ops.nsa.gated_combine(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win,
                                           activation, normalize, backend)
    o = gated_sum(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize)   # o only

The branch outputs o_cmp, o_sel, o_win are [B, S, H, Dv] (any strides). The gate reads
gate_in [B, S, R, m, Din]: R gate rows per token, each the mean of m vectors (the seed's group
gate passes q.view(B, S, G, h, Dk): R = G, m = h; the paper's head gate passes x [B, S, dim] as
[B, S, 1, 1, dim]). Per gate row, with u = mean of its m vectors [Din]:

    z = w2 @ act(w1 @ u + b1) + b2      # with a hidden layer (w1 [Dh, Din]; act silu, relu or gelu)
    z = w2 @ u + b2                     # without (w1 = b1 = None, activation 'none')
    z = u                               # logits computed elsewhere (w1 = b1 = w2 = b2 = None, m = 1)
    g = softmax(z.view(NI, 3), -1)      # normalize 'softmax': over the three branches
    g = sigmoid(z.view(NI, 3))          # normalize 'sigmoid': each gate on its own

w2 is [3 * NI, Dh or Din]: NI gate triples per row, feature i * 3 + c is branch c (order cmp,
sel, win) of triple i, biases optional. Without w2 the gate input is the logits themselves
(Din = 3 * NI): the gate's Linear ran elsewhere (e.g. in a GEMM shared with the projections).
Row r serves heads r * HPR .. (r + 1) * HPR - 1 (HPR = H / R); triple i serves REP = HPR / NI
consecutive heads of them (NI = 1: the whole group shares its gates, as the seed's
`repeat_interleave`; NI = HPR: one triple per head, as the paper's). Then

    o[b, s, head] = g_cmp * o_cmp[b, s, head] + g_sel * o_sel[b, s, head] + g_win * o_win[b, s, head]

o [B, S, H, Dv] contiguous, in the branch outputs' dtype; gates [B, S, R, NI, 3] (the normalized
g, float32; float64 for float64 inputs), saved for the backward. All arithmetic runs in float32
(float64 for float64 inputs), rounded to the output dtype once: eager fp16/bf16 code rounds the
mean, the hidden layer, the gates and each product to fp16/bf16 on the way, so this op is the
closer of the two to exact arithmetic. The weights may be float32 under fp16/bf16 inputs (autocast:
the eager Linear casts them down); the kernels multiply them in the gate input's dtype as autocast
does, the reference in float32.

Backward is a second op, `nsa::gated_combine_backward(grad_o, gate_in, w1, b1, w2, b2, o_cmp,
o_sel, o_win, gates, activation, normalize, backend) -> (d_gate_in, d_w1, d_b1, d_w2, d_b2,
d_cmp, d_sel, d_win)`, each in its input's dtype and shape (an empty tensor for an absent w1, b1,
b2): gradients reach the gate input, every gate weight and bias, and all three branch outputs.

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error):
- `triton` (CUDA): nsa_compile/ops/gated_combine_triton.py. The forward is one kernel per tile of
  gate rows: the gate MLP on tensor cores, the normalization, and the weighted sum, reading each
  branch output once and writing o once. The backward reads grad_o and the branch outputs once,
  writes their three gradients once, and back-propagates through the gate: for a gate with a
  hidden layer (the seed's) in a second kernel with per-program partial weight gradients summed
  afterwards (no atomics: deterministic); for a single Linear (the paper's [3H, dim] weight, too
  large for per-program partials) by two GEMMs from the logit gradient.
- `reference` (every device and dtype): PyTorch in float32 / float64, chunked over tokens, with the
  backward formulas written out (see `_reference_backward`).
"""

from __future__ import annotations

import math

import torch

from . import gated_combine_triton
from .common import why_not_triton_on
from .registry import Backend, Op, declare

__all__ = [
    "ACTIVATIONS", "COMBINE", "NORMALIZATIONS", "choose_backend", "gate_dims", "gated_combine_backward", "gated_sum",
    "why_not_triton",
]
ACTIVATIONS = ("none", "silu", "relu", "gelu")  # 'none': no hidden layer (w1 = b1 = None)
NORMALIZATIONS = ("softmax", "sigmoid")

# Tokens per chunk of the reference backend (a module constant so tests can shrink it).
REFERENCE_CHUNK = 2048


def gate_dims(gate_in: torch.Tensor, w2: torch.Tensor | None, o_cmp: torch.Tensor) -> dict:
    """The sizes the op works with: B, S, H, Dv, R (gate rows per token), M (vectors averaged per
    row), DIN, NI (gate triples per row), HPR (heads per row), REP (heads per triple)."""
    B, S, R, M, DIN = gate_in.shape
    H, Dv = o_cmp.shape[2], o_cmp.shape[3]
    NI = (w2.shape[0] if w2 is not None else DIN) // 3
    return {"B": B, "S": S, "H": H, "Dv": Dv, "R": R, "M": M, "DIN": DIN, "NI": NI, "HPR": H // R,
            "REP": H // R // NI}


def _check(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation: str, normalize: str,
           backend: str = "auto") -> str:
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, variant names and backend are valid."""
    op = "gated_combine"
    branches = {"o_cmp": o_cmp, "o_sel": o_sel, "o_win": o_win}
    for name, t in branches.items():
        if t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point [B, S, H, Dv] tensor, got "
                             f"{t.dtype} of shape {tuple(t.shape)}")
    if not (o_cmp.shape == o_sel.shape == o_win.shape):
        raise ValueError(f"{op}: the branch outputs differ in shape: {tuple(o_cmp.shape)}, "
                         f"{tuple(o_sel.shape)}, {tuple(o_win.shape)}")
    if not (o_cmp.dtype == o_sel.dtype == o_win.dtype):
        raise ValueError(f"{op}: the branch outputs differ in dtype: {o_cmp.dtype}, {o_sel.dtype}, {o_win.dtype}")
    B, S, H, _ = o_cmp.shape
    if gate_in.dim() != 5 or not gate_in.is_floating_point():
        raise ValueError(f"{op}: gate_in must be a floating-point [B, S, R, m, Din] tensor, got {gate_in.dtype} "
                         f"of shape {tuple(gate_in.shape)}")
    if tuple(gate_in.shape[:2]) != (B, S):
        raise ValueError(f"{op}: gate_in is {tuple(gate_in.shape)}, its [B, S] differ from the branch outputs' "
                         f"{(B, S)}")
    R, M, DIN = gate_in.shape[2:]
    if R < 1 or M < 1 or H % R:
        raise ValueError(f"{op}: gate_in has R = {R} gate rows and m = {M} vectors per row: needs R >= 1 "
                         f"dividing H = {H}, and m >= 1")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"{op}: unknown normalize {normalize!r}; valid: {', '.join(NORMALIZATIONS)}")
    if (w1 is None) != (activation == "none"):
        raise ValueError(f"{op}: activation {activation!r} with w1 {'absent' if w1 is None else 'given'}: "
                         "'none' means no hidden layer (w1 = b1 = None)")
    if w1 is None and b1 is not None:
        raise ValueError(f"{op}: b1 given without w1")
    if w2 is None and (w1 is not None or b2 is not None or M != 1 or DIN % 3 or DIN == 0):
        raise ValueError(f"{op}: without w2 the gate input holds the logits: needs w1 = b1 = b2 = None, m = 1 and "
                         f"Din a multiple of 3, got m = {M}, Din = {DIN}")
    params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    for name, t in params.items():
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be floating point, got {t.dtype}")
    K2 = DIN
    if w1 is not None:
        if w1.dim() != 2 or w1.shape[1] != DIN:
            raise ValueError(f"{op}: w1 must be [Dh, Din] with Din = {DIN}, got {tuple(w1.shape)}")
        K2 = w1.shape[0]
        if b1 is not None and tuple(b1.shape) != (K2,):
            raise ValueError(f"{op}: b1 must be [Dh] = [{K2}], got {tuple(b1.shape)}")
    if w2 is not None and (w2.dim() != 2 or w2.shape[1] != K2 or w2.shape[0] % 3 or w2.shape[0] == 0):
        raise ValueError(f"{op}: w2 must be [3 * NI, {'Dh' if w1 is not None else 'Din'}] with "
                         f"{'Dh' if w1 is not None else 'Din'} = {K2}, got {tuple(w2.shape)}")
    NI = (w2.shape[0] if w2 is not None else DIN) // 3
    if (H // R) % NI:
        raise ValueError(f"{op}: the gate gives NI = {NI} gate triples per row, which must divide the "
                         f"H / R = {H // R} heads of a row")
    if b2 is not None and tuple(b2.shape) != (3 * NI,):
        raise ValueError(f"{op}: b2 must be [3 * NI] = [{3 * NI}], got {tuple(b2.shape)}")
    tensors = {"gate_in": gate_in, **{k: v for k, v in params.items() if v is not None}, **branches}
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(f"{op}: {', '.join(tensors)} must be on one device, got "
                         f"{', '.join(str(t.device) for t in tensors.values())}")
    return choose_backend(gate_in, w1, w2, o_cmp, activation, backend)


def choose_backend(gate_in, w1, w2, o_cmp, activation: str, backend: str = "auto") -> str:
    """`COMBINE.choose` (ops/registry.py): `backend` itself (ValueError, with why, where it cannot
    run these inputs), or for 'auto' triton where it can run on CUDA and reference elsewhere."""
    return COMBINE.choose(backend, gate_in, w1, w2, o_cmp, activation)


def why_not_triton(gate_in, w1, w2, o_cmp, activation: str) -> str | None:
    """Why 'auto' does not take the triton backend for these inputs (None: it does)."""
    return why_not_triton_on(o_cmp.device,
                             lambda: gated_combine_triton.unsupported_reason(gate_in, w1, w2, o_cmp, activation))


def compute_dtype(gate_in: torch.Tensor, o_cmp: torch.Tensor) -> torch.dtype:
    """float64 when the gate input or the branch outputs are float64, else float32."""
    return torch.float64 if torch.float64 in (gate_in.dtype, o_cmp.dtype) else torch.float32


# --- reference backend --------------------------------------------------------------------------


def activate(pre: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return pre * torch.sigmoid(pre)
    if activation == "relu":
        return pre.clamp_min(0)
    return 0.5 * pre * (1 + torch.erf(pre * 0.5**0.5))  # gelu, the exact (erf) form


def activation_slope(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """d act / d pre."""
    if activation == "silu":
        s = torch.sigmoid(pre)
        return s * (1 + pre * (1 - s))
    if activation == "relu":
        return (pre > 0).to(pre.dtype)
    cdf = 0.5 * (1 + torch.erf(pre * 0.5**0.5))
    return cdf + pre * torch.exp(-0.5 * pre * pre) / math.sqrt(2 * math.pi)


def _chunks(B: int, S: int, chunk: int):
    for b in range(B):
        for s0 in range(0, S, chunk):
            yield b, s0, min(S, s0 + chunk)


def _gate_chunk(gi, w1, b1, w2, b2, activation, normalize, up):
    """gi [n, R, m, Din] -> (u [n, R, Din], pre and a [n, R, Dh] or None, g [n, R, NI, 3]), in `up`."""
    u = gi.to(up).mean(2)
    pre = a = None
    x = z = u  # without w2, u is the logits
    if w1 is not None:
        pre = u @ w1.to(up).t()
        if b1 is not None:
            pre = pre + b1.to(up)
        a = x = activate(pre, activation)
    if w2 is not None:
        z = x @ w2.to(up).t()
    if b2 is not None:
        z = z + b2.to(up)
    z = z.unflatten(-1, (-1, 3))  # [n, R, NI, 3]
    g = torch.softmax(z, dim=-1) if normalize == "softmax" else torch.sigmoid(z)
    return u, pre, a, g


def _heads(x: torch.Tensor, R: int, NI: int) -> torch.Tensor:
    """x [n, H, D] -> [n, R, NI, REP, D] (row r, triple i, head r * HPR + i * REP + j)."""
    n, H, D = x.shape
    return x.reshape(n, R, NI, H // (R * NI), D)


def _reference_forward(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize, chunk=None):
    d = gate_dims(gate_in, w2, o_cmp)
    up = compute_dtype(gate_in, o_cmp)
    out = o_cmp.new_empty((d["B"], d["S"], d["H"], d["Dv"]))
    gates = o_cmp.new_empty((d["B"], d["S"], d["R"], d["NI"], 3), dtype=up)
    for b, s0, s1 in _chunks(d["B"], d["S"], chunk or REFERENCE_CHUNK):
        _, _, _, g = _gate_chunk(gate_in[b, s0:s1], w1, b1, w2, b2, activation, normalize, up)
        acc = 0
        for c, o_c in enumerate((o_cmp, o_sel, o_win)):
            acc = acc + g[..., c, None, None] * _heads(o_c[b, s0:s1].to(up), d["R"], d["NI"])
        out[b, s0:s1] = acc.reshape(s1 - s0, d["H"], d["Dv"])
        gates[b, s0:s1] = g
    return out, gates


def _reference_backward(grad_o, gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize,
                        chunk=None):
    """All gradients by recomputing each chunk's gate and applying the backward formulas of the
    forward's steps in reverse (autograd cannot run inside a custom op's kernel):
        o = sum_c g_c * o_c        ->  d o_c = g_c * dO,  dg_c = sum over the triple's heads and Dv of dO * o_c
        g = softmax(z) / sigmoid(z) ->  dz = g * (dg - sum_c g_c dg_c)  /  dz = dg * g * (1 - g)
        z = x @ w2^T + b2          ->  d w2 += dz^T @ x,  d b2 += sum dz,  dx = dz @ w2   (no w2: dx = dz)
        a = act(pre)               ->  d pre = da * act'(pre)
        pre = u @ w1^T + b1        ->  d w1 += d pre^T @ u,  d b1 += sum d pre,  du = d pre @ w1
        u = mean of m vectors      ->  d gate_in = du / m for each of them
    Weight gradients accumulate over chunks in float32 (float64) and are cast once at the end."""
    d = gate_dims(gate_in, w2, o_cmp)
    up = compute_dtype(gate_in, o_cmp)
    R, NI, M = d["R"], d["NI"], d["M"]
    d_gin = torch.empty_like(gate_in, memory_format=torch.contiguous_format)
    d_branches = [o_cmp.new_empty((d["B"], d["S"], d["H"], d["Dv"])) for _ in range(3)]
    acc = {name: torch.zeros(t.shape, dtype=up, device=t.device)
           for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)) if t is not None}
    for b, s0, s1 in _chunks(d["B"], d["S"], chunk or REFERENCE_CHUNK):
        n = s1 - s0
        u, pre, a, g = _gate_chunk(gate_in[b, s0:s1], w1, b1, w2, b2, activation, normalize, up)
        dO = _heads(grad_o[b, s0:s1].to(up), R, NI)  # [n, R, NI, REP, Dv]
        dg = []
        for c, (o_c, d_c) in enumerate(zip((o_cmp, o_sel, o_win), d_branches)):
            d_c[b, s0:s1] = (g[..., c, None, None] * dO).reshape(n, d["H"], d["Dv"])
            dg.append((dO * _heads(o_c[b, s0:s1].to(up), R, NI)).sum((-1, -2)))  # [n, R, NI]
        dg = torch.stack(dg, dim=-1)  # [n, R, NI, 3]
        if normalize == "softmax":
            dz = g * (dg - (g * dg).sum(-1, keepdim=True))
        else:
            dz = dg * g * (1 - g)
        dz = dz.flatten(-2).flatten(0, 1)  # [n * R, 3 * NI]
        x = (a if w1 is not None else u).flatten(0, 1)  # [n * R, Dh or Din]
        dx = dz
        if w2 is not None:
            acc["w2"] += dz.t() @ x
            dx = dz @ w2.to(up)
        if b2 is not None:
            acc["b2"] += dz.sum(0)
        if w1 is not None:
            d_pre = dx * activation_slope(pre.flatten(0, 1), activation)
            acc["w1"] += d_pre.t() @ u.flatten(0, 1)
            if b1 is not None:
                acc["b1"] += d_pre.sum(0)
            dx = d_pre @ w1.to(up)
        d_gin[b, s0:s1] = (dx / M).view(n, R, 1, d["DIN"]).expand(n, R, M, d["DIN"])
    grads = {name: acc[name].to(t.dtype) if t is not None else gate_in.new_empty((0,))
             for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2))}
    return (d_gin, grads["w1"], grads["b1"], grads["w2"], grads["b2"], *d_branches)


# --- the custom ops -------------------------------------------------------------------------------


def _fake(gate_in, w1, b1, w2, b2, o_cmp, *_) -> tuple[torch.Tensor, torch.Tensor]:
    d = gate_dims(gate_in, w2, o_cmp)
    gates = o_cmp.new_empty((d["B"], d["S"], d["R"], d["NI"], 3), dtype=compute_dtype(gate_in, o_cmp))
    return o_cmp.new_empty((d["B"], d["S"], d["H"], d["Dv"])), gates


def _check_backward(grad_o, gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, gates, activation, normalize,
                    backend="auto") -> str:  # fmt: skip
    chosen = _check(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize, backend)
    d = gate_dims(gate_in, w2, o_cmp)
    if tuple(grad_o.shape) != tuple(o_cmp.shape):
        raise ValueError(f"gated_combine_backward: grad_o must have shape {tuple(o_cmp.shape)}, got "
                         f"{tuple(grad_o.shape)}")
    want = (d["B"], d["S"], d["R"], d["NI"], 3)
    if tuple(gates.shape) != want:
        raise ValueError(f"gated_combine_backward: gates must have shape {want}, got {tuple(gates.shape)}")
    return chosen


def _backward_fake(grad_o, gate_in, w1, b1, w2, b2, o_cmp, *_) -> tuple[torch.Tensor, ...]:
    like = lambda t: t.new_empty(t.shape) if t is not None else gate_in.new_empty((0,))
    return (gate_in.new_empty(gate_in.shape), like(w1), like(b1), like(w2), like(b2), *(like(o_cmp) for _ in range(3)))


def _gradients(saved, grad_o, _grad_gates) -> dict:
    s = saved
    grads = torch.ops.nsa.gated_combine_backward(grad_o, s.gate_in, s.w1, s.b1, s.w2, s.b2, s.o_cmp, s.o_sel, s.o_win,
                                                 s.gates, s.activation, s.normalize, s.backend)
    names = ("gate_in", "w1", "b1", "w2", "b2", "o_cmp", "o_sel", "o_win")
    # an absent w1, b1 or b2 gets an empty tensor from the op and no gradient here
    return {name: grad for name, grad in zip(names, grads) if getattr(s, name) is not None}


COMBINE = declare(Op(
    name="gated_combine",
    schema="(Tensor gate_in, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, Tensor o_cmp, Tensor o_sel, "
           'Tensor o_win, str activation, str normalize, str backend="auto") -> (Tensor, Tensor)',
    config_field="gated_combine_backend",
    choice_args=("gate_in", "w1", "w2", "o_cmp", "activation"),
    backends=(
        Backend("triton", cannot_run=gated_combine_triton.unsupported_reason, auto_reason=why_not_triton,
                forward=gated_combine_triton.combine_forward, backward=gated_combine_triton.combine_backward),
        Backend("reference", forward=_reference_forward,
                backward=lambda grad_o, *args: _reference_backward(grad_o, *args[:8], *args[9:])),  # without gates
    ),
    check=_check,
    fake=_fake,
    backward_schema="(Tensor grad_o, Tensor gate_in, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, Tensor o_cmp, "
                    'Tensor o_sel, Tensor o_win, Tensor gates, str activation, str normalize, str backend="auto") '
                    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    check_backward=_check_backward,
    backward_fake=_backward_fake,
    outputs=(None, "gates"),
    non_differentiable=("gates",),
    gradients=_gradients,
))
gated_combine_backward = COMBINE.backward_op


def gated_sum(
    gate_in: torch.Tensor, w1: torch.Tensor | None, b1: torch.Tensor | None, w2: torch.Tensor | None,
    b2: torch.Tensor | None, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, activation: str,
    normalize: str, backend: str = "auto",
) -> torch.Tensor:
    """The output o of `torch.ops.nsa.gated_combine` (see the module docstring)."""
    return torch.ops.nsa.gated_combine(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize,
                                       backend)[0]
