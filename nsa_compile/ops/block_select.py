"""Block importance and selection as a custom op (NSA section 3), recomputed from the compressed
branch's log-sum-exp, so the [B, H, S, Tc] probabilities are never stored.

    block_idx = torch.ops.nsa.select_blocks(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend)
    block_idx = select_blocks(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend="auto")

q [B, H, S, Dk] (normally a view of [B, S, H, Dk] memory), k [B, G, Tc, Dk]: the pooled compressed
keys K~ (never repeated: query head j reads KV head j // (H // G)), lse [B, H, S] float32: the
log-sum-exp of the compressed branch's scaled scores over each row's visible blocks, as
`nsa::compressed_attention` returns it for the same q and k (-inf on a row with no visible block).
Returns block_idx [B, G, S, n] int64 (contiguous): exactly what eager `NSAAttention.select_blocks(
p_cmp, S)` (models/nsa.py) returns. With l = cmp_block, d = cmp_stride, l' = sel_block, n = n_selected,
Ns = ceil(S / l'):

    s = upcast(q @ k^T) * scale         # q @ k^T rounded to q's dtype, then fp16/bf16 -> fp32 (as eager)
    p[b, h, t, i] = exp(s - lse[b, h, t]) where block i is visible to t (i*d + l - 1 <= t), else 0
    p_grp[b, g, t, j] = sum over the group's heads of sum_i p[b, head, t, i] * overlap(i, j) / l
    key[t, j] = +inf if j is forced (0, t // l', t // l' - 1), -inf unless j*l' <= t, else p_grp
    block_idx = the first n of a stable descending sort of key (padded to >= n columns with -inf)
                that are > -inf, ascending, padded with -1

overlap(i, j) is the number of tokens in both [i*d, i*d + l) and [j*l', j*l' + l'). Eager computes p
as a softmax and this op as exp(s - lse): the importance differs from eager's by float32 rounding
only, so blocks whose p_grp are within about 1e-6 (relative) of each other may be ranked the other
way; everything else, exact ties included (ties go to the lower block index), is eager's choice.
Importance is float32 (float64 for float64 inputs). The op is not differentiable (an int64 result).

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error):
- `triton` (CUDA): nsa_compile/ops/block_select_triton.py, one program per (batch, group, query
  tile): the scores are recomputed tile by tile over the compression blocks, mapped onto the
  selection blocks and merged into a running top-n in registers. No [.., S, Tc] or [.., S, Ns]
  tensor; extra memory is the output.
- `reference` (every device and dtype): PyTorch, chunked over query rows: a chunk's
  probabilities [B, H, c, Tc] and keys [B, G, c, max(Ns, n)], never all S rows at once (c is set
  so a chunk's largest tensor stays under REFERENCE_BUDGET elements). The overlap map is a sum
  over each selection block's band of compression blocks in ascending order (what a matmul with
  the [Tc, Ns] overlap matrix does, without its zeros or TF32), then the heads are summed, and the
  ranking is eager's code (torch.sort, stable).
"""

from __future__ import annotations

import torch

from . import block_select_triton
from .common import check_gqa, check_positive_int, pick_backend, upcast_dtype, why_not_triton_on

__all__ = ["BACKENDS", "REFERENCE_BUDGET", "choose_backend", "select_blocks", "why_not_triton"]

BACKENDS = ("auto", "triton", "reference")

# Elements of the reference backend's largest per-chunk tensor (a module constant so tests can
# shrink it): 2^24 fp32 elements are 64 MiB; a chunk holds a few such tensors at once.
REFERENCE_BUDGET = 1 << 24

_OP = "select_blocks"


def choose_backend(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, backend: str = "auto") -> str:
    """`common.pick_backend` for this op: `backend` itself (ValueError, with why, where it cannot
    run these inputs), or for 'auto' triton where it can run on CUDA and reference elsewhere."""
    args = (q, k, lse, cmp_block, cmp_stride, sel_block, n_selected)
    return pick_backend(_OP, BACKENDS, backend,
                        cannot_run={"triton": lambda: block_select_triton.unsupported_reason(*args)},
                        preferred="triton", why_not_preferred=lambda: why_not_triton(*args))


def why_not_triton(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected) -> str | None:
    """Why 'auto' does not take the triton backend for these inputs (None: it does)."""
    return why_not_triton_on(
        q.device,
        lambda: block_select_triton.unsupported_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected),
        kernels="the Triton kernel runs",
    )


def _check(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend="auto") -> str:
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, block sizes and backend are valid."""
    check_gqa(_OP, q, k, rows="Tc", lse=lse)
    B, H, S, _ = q.shape
    if lse.dtype != torch.float32:
        raise ValueError(f"{_OP}: lse must be a float32 tensor, got {lse.dtype}")
    if tuple(lse.shape) != (B, H, S):
        raise ValueError(f"{_OP}: lse must have shape [B, H, S] = [{B}, {H}, {S}], got {tuple(lse.shape)}")
    for name, value in (("cmp_block", cmp_block), ("cmp_stride", cmp_stride), ("sel_block", sel_block),
                        ("n_selected", n_selected)):  # fmt: skip
        check_positive_int(_OP, name, value)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat, torch.SymInt)):
        raise ValueError(f"{_OP}: scale must be a float, got {type(scale).__name__}")
    return choose_backend(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, backend)


def overlap_band(Tc: int, Ns: int, cmp_block: int, cmp_stride: int, sel_block: int, device, dtype):
    """The overlap map as bands: index [W, Ns] and weight [W, Ns] (overlap(i, j) / l in `dtype`, the
    eager matrix's entries) with p_slc[j] = sum_w p[index[w, j]] * weight[w, j], w ascending = i
    ascending. index[w, j] = i_first(j) + w, the first compression block that overlaps selection
    block j plus w, clamped into [0, Tc); terms past the band (or past Tc) have weight 0."""
    l, d, ls = cmp_block, cmp_stride, sel_block
    j = torch.arange(Ns, device=device)
    first = ((j * ls - l) // d + 1).clamp(min=0)  # [Ns]: smallest i with i*d + l > j*l'
    width = -(-(l + ls) // d) + 1  # an upper bound of the blocks overlapping one selection block
    i = first + torch.arange(width, device=device)[:, None]  # [W, Ns]
    overlap = torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)
    overlap = torch.where(i < Tc, overlap.clamp(min=0), 0)
    return i.clamp(max=max(Tc - 1, 0)), overlap.to(dtype) / l


def rank_and_choose(p_grp: torch.Tensor, t0: int, sel_block: int, n_selected: int) -> torch.Tensor:
    """Eager's ranking (models/nsa.py `select_blocks`) of p_grp [B, G, c, Ns] for the query rows
    t0..t0 + c - 1: chosen blocks [B, G, c, n] int64, ascending, -1 padded."""
    c, Ns = p_grp.shape[2], p_grp.shape[3]
    dev = p_grp.device
    j = torch.arange(Ns, device=dev)[None, :]
    t = torch.arange(t0, t0 + c, device=dev)[:, None]
    current = t // sel_block
    forced = (j == 0) | (j == current) | (j == current - 1)  # [c, Ns]
    candidate = j * sel_block <= t
    key = torch.where(forced, float("inf"), torch.where(candidate, p_grp, float("-inf")))
    key = torch.nn.functional.pad(key, (0, max(0, n_selected - Ns)), value=float("-inf"))  # >= n columns
    values, order = torch.sort(key, dim=-1, descending=True, stable=True)
    past_end = key.shape[-1]
    chosen = torch.where(values[..., :n_selected] > float("-inf"), order[..., :n_selected], past_end)
    chosen = torch.sort(chosen, dim=-1).values  # ascending, unchosen last
    return torch.where(chosen == past_end, -1, chosen)


def _reference(q, k, lse, cmp_block: int, cmp_stride: int, sel_block: int, n_selected: int, scale: float,
               budget: int | None = None) -> torch.Tensor:  # fmt: skip
    B, H, S, _ = q.shape
    G, Tc = k.shape[1], k.shape[2]
    h = H // G
    up = upcast_dtype(q.dtype)
    Ns = -(-S // sel_block)
    out = torch.empty((B, G, S, n_selected), dtype=torch.int64, device=q.device)
    if out.numel() == 0:
        return out
    index, weight = overlap_band(Tc, Ns, cmp_block, cmp_stride, sel_block, q.device, up)  # [W, Ns]
    width = max(Ns, n_selected)
    budget = budget or REFERENCE_BUDGET
    chunk = max(1, min(S, budget // max(1, B * H * max(Tc, width))))
    qg = q.unflatten(1, (G, h))  # [B, G, h, S, Dk]
    kT = k.transpose(-1, -2)[:, :, None]  # [B, G, 1, Dk, Tc]
    lse_g = lse.unflatten(1, (G, h))  # [B, G, h, S]
    i = torch.arange(Tc, device=q.device)
    for t0 in range(0, S, chunk):
        t1 = min(S, t0 + chunk)
        t = torch.arange(t0, t1, device=q.device)[:, None]  # [c, 1]
        visible = i * cmp_stride + cmp_block - 1 <= t  # [c, Tc]: the whole block is in the past
        s = (qg[:, :, :, t0:t1] @ kT).to(up) * scale  # [B, G, h, c, Tc]
        # where, not multiply: a row without a visible block has lse = -inf and exp(s - lse) = inf
        p = torch.where(visible, torch.exp(s - lse_g[:, :, :, t0:t1, None].to(up)), 0.0)
        del s
        p_slc = torch.zeros((*p.shape[:-1], Ns), dtype=up, device=q.device)  # [B, G, h, c, Ns]
        if Tc:
            for w in range(index.shape[0]):  # ascending compression block: a matmul's order
                p_slc += p[..., index[w]] * weight[w]
        del p
        out[:, :, t0:t1] = rank_and_choose(p_slc.sum(2), t0, sel_block, n_selected)  # heads summed: [B, G, c, Ns]
    return out


@torch.library.custom_op("nsa::select_blocks", mutates_args=())
def _select_blocks_op(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, cmp_block: int, cmp_stride: int, sel_block: int,
    n_selected: int, scale: float, backend: str = "auto",
) -> torch.Tensor:
    """NSA block selection: q [B, H, S, Dk], pooled keys k [B, G, Tc, Dk], the compressed branch's
    lse [B, H, S] float32 -> block_idx [B, G, S, n_selected] int64 (ascending, -1 padded), eager
    `NSAAttention.select_blocks` recomputed without storing the probabilities."""
    chosen = _check(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend)
    if chosen == "triton":
        return block_select_triton.select_blocks_forward(
            q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale
        )
    return _reference(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale)


@_select_blocks_op.register_fake
def _select_blocks_fake(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend="auto"):
    _check(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend)
    B, _, S, _ = q.shape
    return q.new_empty((B, k.shape[1], S, n_selected), dtype=torch.int64)


def select_blocks(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, cmp_block: int, cmp_stride: int, sel_block: int,
    n_selected: int, scale: float, backend: str = "auto",
) -> torch.Tensor:
    """`torch.ops.nsa.select_blocks` (see the module docstring)."""
    return torch.ops.nsa.select_blocks(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend)
