"""The Linear projections of one input as one GEMM, with RoPE applied to some of them, as a
functional custom op (NSA section 1).

    outs = torch.ops.nsa.projection_rope(x, weight, bias, cos, sin, widths, head_dims, style, backend,
                                         full_tables, plain)

x [*lead, K]; weight [N, K]: the projections' weights one after another (N = sum(widths); the
pass concatenates the module's own parameters in the graph, so autograd splits dW back onto
them); bias [N] or None. outs[i] [*lead, widths[i]] (x's dtype, contiguous) is projection i,
x @ weight[rows of i]^T + bias[rows of i], and, when head_dims[i] = D > 0, it is rotated: x is
[B, S, K], each head of D columns has its first R = 2 * cos.shape[-1] columns rotated by the
angle of its token's position, the other D - R pass through (partial rotary). Pairs are
(j, j + R/2) for style 'half' (rotate-half) and (2j, 2j + 1) for 'interleaved':

    out_a = y_a * cos[b, s, f] - y_b * sin[b, s, f]
    out_b = y_b * cos[b, s, f] + y_a * sin[b, s, f]        # f: the pair's frequency index

cos, sin: [S, R/2] or [Bt, S, R/2] with Bt 1 or B, any float dtype (the values are inputs: the
op rotates by whatever angles they hold); None when no piece is rotated. head_dims[i] = 0 leaves
piece i unrotated. The tables get no gradient.

With full_tables, cos and sin are [S, R] or [Bt, S, R], one entry per rotated column, as models
that cache `cat([freqs, freqs])` (rotate-half) or `freqs.repeat_interleave(2)` (interleaved)
hold them: column a of a pair uses entry a, its partner b entry b,

    out_a = y_a * cos[b, s, a] - y_b * sin[b, s, a]
    out_b = y_b * cos[b, s, b] + y_a * sin[b, s, b]

which is `y * cos + rotate(y) * sin` for any tables: the op does not assume that the entries of
a pair are equal (a table read from a buffer holds whatever it is given).

plain: indices of rotated pieces (ascending, distinct) whose value before the rotation is also
returned, outs[len(widths) + j] [*lead, widths[plain[j]]] for plain[j]: the projection itself,
for models that read both (lucidrains compresses keys, and scores the compressed branch with
queries, before RoPE). The GEMM runs once; the plain piece is written beside the rotated one.

Numerics: the rotation runs in the upcast dtype (fp16/bf16 -> fp32) with the tables in it, and
rounds once (the eager code casts the tables to the projection's dtype and rounds each product).

Backward: `nsa::projection_rope_backward(grads, cos, sin, head_dims, style, backend, full_tables,
plain) -> dy`, the gradient of x @ weight^T + bias (before the rotation: the transposed rotation of
the pieces' gradients, its inverse for pair tables, plus the gradient of the plain piece where one
was returned, in the upcast dtype, concatenated), [*lead, N]; the autograd formula
then takes dx = dy @ weight,
dW = dy^T x and db = sum(dy) with torch matmuls (cuBLAS on CUDA, visible to Inductor).

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error):
- `triton` (CUDA, fp16/bf16 under auto): one GEMM kernel with the rotation in its epilogue,
  writing each piece straight into its own tensor; the backward's inverse rotation in one pass
  (nsa_compile/ops/rope_triton.py).
- `reference` (every device and dtype): F.linear, then the rotation of each rotated piece with
  torch ops in the upcast dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rope_triton
from .common import upcast_dtype
from .registry import Backend, Op, declare

__all__ = ["PROJECTION", "STYLES", "choose_backend", "projection_rope", "projection_rope_backward", "rotary_dim",
           "rotate", "why_not_triton"]
STYLES = ("half", "interleaved")


def why_not_triton(x, weight, bias, cos, sin, widths, head_dims, plain=()) -> str | None:
    """Why 'auto' does not take the triton backend for these inputs (None: it does)."""
    if x.device.type != "cuda":
        return f"the Triton kernel runs on CUDA (tensors on {x.device.type})"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{x.dtype}: cuBLAS runs fp32 GEMMs faster than the kernel's IEEE fp32 dots"
    return rope_triton.unsupported_reason(x, weight, bias, cos, sin, widths, head_dims, plain)


def choose_backend(x, weight, bias, cos, sin, widths, head_dims, backend: str = "auto", plain=()) -> str:
    """`PROJECTION.choose` (ops/registry.py): `backend` itself (ValueError, with why, where it
    cannot run these inputs), or for 'auto' triton where it can run on CUDA in fp16/bf16 and
    reference elsewhere. Named explicitly, triton also runs fp32, and on the CPU under
    TRITON_INTERPRET=1 (the tests do that)."""
    return PROJECTION.choose(backend, x, weight, bias, cos, sin, widths, head_dims, list(plain))


def _check(x, weight, bias, cos, sin, widths, head_dims, style, backend, full_tables=False, plain=()) -> str:
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, layout and backend are valid."""
    op = "projection_rope"
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"{op}: x must be a floating-point tensor [*lead, K], got {x.dtype} {tuple(x.shape)}")
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{op}: weight must be [N, K] with K = {K} (x's last dim), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{op}: x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}"
                         f"{'' if bias is None else ', ' + str(bias.dtype)}")
    if len(widths) == 0 or len(widths) != len(head_dims):
        raise ValueError(f"{op}: widths and head_dims must list the same pieces (at least one), got "
                         f"{len(widths)} and {len(head_dims)}")
    if any(isinstance(w, bool) or not isinstance(w, (int, torch.SymInt)) or w < 1 for w in widths):
        raise ValueError(f"{op}: widths must be ints >= 1, got {list(widths)}")
    N = sum(widths)
    if weight.shape[0] != N:
        raise ValueError(f"{op}: weight has {weight.shape[0]} rows, the pieces {N} (sum of widths {list(widths)})")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: bias must be [N] = [{N}], got {tuple(bias.shape)}")
    tensors = [t for t in (x, weight, bias, cos, sin) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{op}: tensors on several devices: {sorted({str(t.device) for t in tensors})}")
    if style not in STYLES:
        raise ValueError(f"{op}: unknown style {style!r}; valid: {', '.join(STYLES)}")
    if any(isinstance(d, bool) or not isinstance(d, (int, torch.SymInt)) or d < 0 for d in head_dims):
        raise ValueError(f"{op}: head_dims must be ints >= 0 (0: not rotated), got {list(head_dims)}")
    if any(head_dims):
        _check_rotation(x, cos, sin, widths, head_dims, full_tables)
    elif cos is not None or sin is not None:
        raise ValueError(f"{op}: cos and sin are given but no piece is rotated (all head_dims 0)")
    plain = list(plain)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in plain) or plain != sorted(set(plain)) or \
            not all(0 <= i < len(widths) and head_dims[i] for i in plain):
        raise ValueError(f"{op}: plain must list rotated pieces (head_dims > 0) in ascending order, once each; got "
                         f"{plain} for head_dims {list(head_dims)}")
    return choose_backend(x, weight, bias, cos, sin, widths, head_dims, backend, plain)


def _check_rotation(x, cos, sin, widths, head_dims, full_tables) -> None:
    op = "projection_rope"
    if x.dim() != 3:
        raise ValueError(f"{op}: rotated pieces need x of shape [B, S, K], got {tuple(x.shape)}")
    B, S = x.shape[:2]
    if cos is None or sin is None:
        raise ValueError(f"{op}: rotated pieces need both cos and sin")
    if cos.shape != sin.shape or not cos.is_floating_point() or not sin.is_floating_point():
        raise ValueError(f"{op}: cos and sin must be float tensors of one shape, got {cos.dtype} "
                         f"{tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    lead = tuple(cos.shape[:-1])
    if lead != (S,) and lead not in ((1, S), (B, S)):
        raise ValueError(f"{op}: cos and sin must be [S, R/2] or [1 or B, S, R/2] with B, S = {B}, {S}, "
                         f"got {tuple(cos.shape)}")
    R = rotary_dim(cos, full_tables)
    if full_tables and cos.shape[-1] % 2:
        raise ValueError(f"{op}: full-width tables need an even rotary dim, got {cos.shape[-1]}")
    for i, (w, d) in enumerate(zip(widths, head_dims)):
        if d and (w % d or R > d or R == 0):
            raise ValueError(f"{op}: piece {i} (width {w}, head dim {d}) must be whole heads of at least the "
                             f"rotary dim R = {R} (> 0)")


def rotary_dim(cos: torch.Tensor, full_tables: bool) -> int:
    """R, the rotated columns of each head: the table width (full tables) or twice it."""
    return cos.shape[-1] if full_tables else 2 * cos.shape[-1]


def _table(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos or sin [S, F] / [Bt, S, F] -> [Bt, S, 1, F] in dtype (broadcasts over heads)."""
    t = t if t.dim() == 3 else t[None]
    return t[:, :, None, :].to(dtype)


def _halves(t: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-width table's entries for the first and the second column of each pair."""
    if style == "half":
        return t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2 :]
    return t[..., 0::2], t[..., 1::2]


def rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, style: str,
           inverse: bool = False, full_tables: bool = False) -> torch.Tensor:
    """y [B, S, width] -> y rotated per head of head_dim columns (its first R columns, R from the
    tables), in the upcast dtype; `inverse` applies the transposed map (the backward: the
    rotation by the opposite angle for pair tables)."""
    up = upcast_dtype(y.dtype)
    B, S, width = y.shape
    h = y.reshape(B, S, width // head_dim, head_dim).to(up)
    c_a, s_a = _table(cos, up), _table(sin, up)
    c_b, s_b = c_a, s_a
    if full_tables:
        (c_a, c_b), (s_a, s_b) = _halves(c_a, style), _halves(s_a, style)
    if inverse:  # [[c_a, -s_a], [s_b, c_b]] transposed: [[c_a, s_b], [-s_a, c_b]]
        s_a, s_b = -s_b, -s_a
    R2 = c_a.shape[-1]
    if style == "half":
        a, b = h[..., :R2], h[..., R2 : 2 * R2]
        rotated = torch.cat([a * c_a - b * s_a, b * c_b + a * s_b], dim=-1)
    else:
        a, b = h[..., 0 : 2 * R2 : 2], h[..., 1 : 2 * R2 : 2]
        rotated = torch.stack([a * c_a - b * s_a, b * c_b + a * s_b], dim=-1).flatten(-2)
    return torch.cat([rotated, h[..., 2 * R2 :]], dim=-1).reshape(B, S, width)


def _reference_forward(x, weight, bias, cos, sin, widths, head_dims, style, full_tables, plain) -> list[torch.Tensor]:
    y = F.linear(x, weight, bias)  # [*lead, N]
    outs, pieces, start = [], [], 0
    for width, dim in zip(widths, head_dims):
        piece = y[..., start : start + width]
        pieces.append(piece)
        # contiguous: a column slice is copied out (outputs may not alias each other)
        outs.append(rotate(piece, cos, sin, dim, style, full_tables=full_tables).to(x.dtype) if dim
                    else piece.contiguous())
        start += width
    return outs + [pieces[i].contiguous() for i in plain]


def _reference_backward(grads, cos, sin, head_dims, style, full_tables, plain) -> torch.Tensor:
    n = len(head_dims)
    also = dict(zip(plain, grads[n:]))  # piece -> the gradient of its plain output
    parts = []
    for i, (g, dim) in enumerate(zip(grads[:n], head_dims)):
        if dim:
            d = rotate(g, cos, sin, dim, style, inverse=True, full_tables=full_tables)  # upcast dtype
            parts.append((d + also[i] if i in also else d).to(g.dtype))
        else:
            parts.append(g)
    return torch.cat(parts, dim=-1)


def _triton_forward(x, weight, bias, cos, sin, widths, head_dims, style, full_tables, plain) -> list[torch.Tensor]:
    K = x.shape[-1]
    S = x.shape[1] if any(head_dims) else 1
    outs = rope_triton.projection_rope_forward(x.reshape(-1, K), weight, bias, cos, sin, list(widths), list(head_dims),
                                               style, S, full_tables=full_tables, plain=list(plain))
    return [o.view(*x.shape[:-1], o.shape[1]) for o in outs]


def _triton_backward(grads, cos, sin, head_dims, style, full_tables, plain) -> torch.Tensor:
    lead = grads[0].shape[:-1]
    widths = [g.shape[-1] for g in grads[: len(head_dims)]]
    S = lead[1] if any(head_dims) else 1
    dy = rope_triton.projection_rope_grad([g.reshape(-1, g.shape[-1]) for g in grads], cos, sin, widths,
                                          list(head_dims), style, S, full_tables=full_tables, plain=list(plain))
    return dy.view(*lead, dy.shape[1])


def _check_grads(grads, cos, sin, head_dims, style, backend, full_tables, plain=()) -> str:
    op = "projection_rope_backward"
    n, plain = len(head_dims), list(plain)
    if n == 0 or len(grads) != n + len(plain):
        raise ValueError(f"{op}: one gradient per output: {len(grads)} gradients for {n} pieces and "
                         f"{len(plain)} plain outputs")
    lead, dtype = tuple(grads[0].shape[:-1]), grads[0].dtype
    for i, g in enumerate(grads):
        if tuple(g.shape[:-1]) != lead or g.dtype != dtype:
            raise ValueError(f"{op}: gradient {i} is {g.dtype} {tuple(g.shape)}; all must be {dtype} [*{lead}, width]")
    widths = [g.shape[-1] for g in grads[:n]]
    for j, i in enumerate(plain):
        if 0 <= i < n and grads[n + j].shape[-1] != widths[i]:
            raise ValueError(f"{op}: the gradient of plain output {j} (piece {i}) is {tuple(grads[n + j].shape)}; "
                             f"piece {i} is {widths[i]} wide")
    N = sum(widths)
    # the forward's checks, on a stand-in x and weight of the gradients' lead dims and dtype
    x = grads[0].new_empty((*lead, 1))
    return _check(x, x.new_empty((N, 1)), None, cos, sin, widths, list(head_dims), style, backend, full_tables, plain)


def _gradients(saved, grads: list) -> dict:
    """dy from the backward op (the rotation undone, the plain outputs' gradients added), then the
    Linear's formulas with torch matmuls."""
    s = saved
    widths = [*s.widths, *(s.widths[i] for i in s.plain)]
    # an output that got no gradient contributes zeros
    grads = [g if g is not None else s.x.new_zeros((*s.x.shape[:-1], w)) for g, w in zip(grads, widths)]
    dy = torch.ops.nsa.projection_rope_backward(grads, s.cos, s.sin, list(s.head_dims), s.style, s.backend,
                                                s.full_tables, list(s.plain))
    N, K = s.weight.shape
    dy2 = dy.reshape(-1, N)  # [M, N]
    needs = s.needs_input_grad
    return {"x": (dy2 @ s.weight).view(s.x.shape) if needs["x"] else None,
            "weight": dy2.t() @ s.x.reshape(-1, K) if needs["weight"] else None,
            "bias": dy2.sum(0) if s.bias is not None and needs["bias"] else None}


PROJECTION = declare(Op(
    name="projection_rope",
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor? cos, Tensor? sin, SymInt[] widths, SymInt[] head_dims, "
           'str style, str backend="auto", bool full_tables=False, int[] plain=[]) -> Tensor[]',
    config_field="projection_rope_backend",
    choice_args=("x", "weight", "bias", "cos", "sin", "widths", "head_dims", "plain"),
    backends=(
        Backend("triton", cannot_run=rope_triton.unsupported_reason, auto_reason=why_not_triton,
                forward=_triton_forward, backward=_triton_backward),
        Backend("reference", forward=_reference_forward, backward=_reference_backward),
    ),
    check=_check,
    fake=lambda x, weight, bias, cos, sin, widths, head_dims, style, backend, full_tables, plain: [
        x.new_empty((*x.shape[:-1], w)) for w in [*widths, *(widths[i] for i in plain)]],
    backward_schema='(Tensor[] grads, Tensor? cos, Tensor? sin, SymInt[] head_dims, str style, str backend="auto", '
                    "bool full_tables=False, int[] plain=[]) -> Tensor",
    check_backward=_check_grads,
    backward_fake=lambda grads, cos, sin, head_dims, *_: grads[0].new_empty(
        (*grads[0].shape[:-1], sum(g.shape[-1] for g in grads[: len(head_dims)]))),
    gradients=_gradients,
))
projection_rope_backward = PROJECTION.backward_op


def projection_rope(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor | None,
    sin: torch.Tensor | None, widths, head_dims, style: str = "half", backend: str = "auto",
    full_tables: bool = False, plain=(),
) -> list[torch.Tensor]:
    """`torch.ops.nsa.projection_rope` (see the module docstring)."""
    return torch.ops.nsa.projection_rope(x, weight, bias, cos, sin, list(widths), list(head_dims), style, backend,
                                         full_tables, list(plain))
