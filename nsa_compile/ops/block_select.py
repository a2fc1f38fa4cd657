"""Block importance and selection as a custom op (NSA section 3), recomputed from the compressed
branch's log-sum-exp, so the [B, H, S, Tc] probabilities are never stored.

    block_idx = torch.ops.nsa.select_blocks(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend,
                                            pos=None, rule="nsa", importance_dtype=None)
    block_idx = select_blocks(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend="auto", pos=None,
                              rule="nsa", importance_dtype=None)

q [B, H, S, Dk] (normally a view of [B, S, H, Dk] memory), k [B, G, Tc, Dk]: the pooled compressed
keys K~ (never repeated: query head j reads KV head j // (H // G)), lse [B, H, S] float32: the
log-sum-exp of the compressed branch's scaled scores over each row's visible blocks, as
`nsa::compressed_attention` returns it for the same q and k (-inf on a row with no visible block;
None for rule 'lucidrains', which ranks logits).
Returns block_idx [B, G, S, n] int64 (contiguous): exactly what eager `NSAAttention.select_blocks(
p_cmp, S)` (models/nsa.py) returns. With l = cmp_block, d = cmp_stride, l' = sel_block, n = n_selected,
Ns = ceil(S / l'):

    s = upcast(q @ k^T) * scale         # q @ k^T rounded to q's dtype, then fp16/bf16 -> fp32 (as eager)
    p[b, h, t, i] = exp(s - lse[b, h, t]) where block i is visible to t (i*d + l - 1 <= t), else 0
    p_grp[b, g, t, j] = sum over the group's heads of sum_i p[b, head, t, i] * overlap(i, j) / l
    key[t, j] = +inf if j is forced (0, t // l', t // l' - 1), -inf unless j*l' <= t, else p_grp
    block_idx = the first n of a stable descending sort of key (padded to >= n columns with -inf)
                that are > -inf, ascending, padded with -1

overlap(i, j) is the number of tokens in both [i*d, i*d + l) and [j*l', j*l' + l').

`rule` is the choice rule (issue 17.3: a semantic variant is a parameter, not a refusal):
- "nsa" (the default, the paper's; everything above): blocks 0, t // l', t // l' - 1 forced, only
  blocks with j*l' <= t candidates, the chosen blocks ascending, -1 padded.
- "fla" (flash-linear-attention's `naive_nsa_with_compression`): only the current block favoured,
  by setting each head's importance of it to 1.0 before the group sum; every block competes (a
  block that is not visible has importance 0); then blocks after the current one become -1 *after*
  the top-n. The result is in rank order, as torch.topk returns it, with -1 in place:

    p_slc[b, head, t, j] = sum_i p[b, head, t, i] * overlap(i, j) / l, set to 1.0 where j == t // l'
    key[t, j] = sum over the group's heads of p_slc (padded to >= n columns with -inf)
    order = the first n of a stable descending sort of key (-1 where the key is -inf: padding)
    block_idx = order where order <= t // l', else -1        # rank order, not ascending

  Ties go to the lower block (torch.topk leaves their order unspecified: this is one of its
  results). With importance_dtype (and group_sum_dtype) as below; not with pos or group_first
  (ValueError). Both backends compute it.
- "lucidrains" (lucidrains' native-sparse-attention-pytorch; tests/corpus/lucidrains_shared_kv.py,
  lucidrains_per_head.py): the choice ranks the compressed *logits*, not probabilities, so lse
  must be None (the op computes everything from q and k); k holds the compressed keys without
  memory slots, compressed column i ending at token (i + 1) * d - 1 (cmp_block is validated but
  not read: the column's start does not enter); l' must be a multiple of d. In q's dtype, step by
  step as eager (each step rounded to that dtype as eager's op is; softmax computes in float32
  and rounds its output):

    s[b, head, t, i] = (q @ k^T) * scale, -inf unless (i + 1) * d - 1 < t   # column ended before t
    m[b, g, t, i] = mean over the group's h heads of s                      # no reduction for h = 1
    a[b, g, t, J] = mean of m over the l'/d columns of block J, J < Jc = Tc // (l'/d)
    a = -inf unless J < t // l'                  # the diagonal block t // l' and later ones
    p = softmax([-1e3, a_0, .., a_{Jc-1}])[1:]  # a sink column: a row without a candidate gets p = 0
    order = the first n' = min(n, Jc) of a stable descending sort of p     # ties: the lower block
    block_idx[.., :n] = order where p > 1e-10 (compared in q's dtype), else -1; columns n' .. n-1 -1
    block_idx[.., n] = t // l'                   # the diagonal block, appended: [B, G, S, n + 1]

  Eager fills the invisible columns with -finfo.max // 10 and the diagonal with -finfo.max instead
  of -inf: the diagonal is then -finfo.max and every later block has only invisible columns, a
  mean of -finfo.max // 10 (-6552 in fp16), more than 5e3 below the -1e3 sink, whose exp is
  exactly 0 in float32: p and the sum of the softmax are the same. The blocks before t // l' end
  before t, so the kept ids are whole blocks of the past, and the last column is the only partial
  one (read causally by nsa.selected_attention). Per-query-head selection (no group reduction) is
  G = H: k repeated to one group per query head (the mean over h = 1 is exact). Rank order as
  torch.topk returns it; ties (frequent for bf16/fp16 probabilities) go to the lower block, one of
  topk's valid results. importance_dtype=torch.float32 (q in bf16/fp16; CUDA autocast runs softmax
  in float32): the softmax computed and p kept in float32 (`softmax(dim=-1, dtype=torch.float32)`),
  ranked and compared with 1e-10 there; every step before it in q's dtype as above.
  Not with pos (ValueError). Both backends compute it (the triton backend: l'/d <= 16).

- "nsa_vibe" (the nsa-vibe project's eager model; tests/corpus/nsa_vibe_noncausal.py): NOT causal.
  lse must be None: the probabilities are a softmax over *every* compressed block, later ones
  included, and every block competes for the free slots, so the ids of the query at t depend on
  the tokens after t (nsa.selected_attention then reads only their tokens up to t). In q's dtype
  as eager: q @ k^T rounded, times scale rounded; then float32 (the softmax as CUDA autocast runs
  it, or a float32 model):

    s = (q @ k^T) * scale                            # every column, no mask
    p = softmax(s, dim=-1)                           # computed as exp(s - logsumexp(s))
    p_grp[b, g, t, j] = sum over the group's heads of sum_i p[b, head, t, i] * overlap(i, j) / l
    F = {0, t // l', t // l' - 1 (clamped at 0)}     # |F| distinct forced blocks: 1, 2 or 3
    key[t, j] = +inf for j in F, else p_grp          # every block a candidate, future ones too
    chosen = the first n - 3 + |F| of a stable descending sort of key (at most Ns exist)
    block_idx = ascending sort of chosen, -1 padded to n: the -1 FIRST

  which is eager's `forced` (3 slots) concatenated with the top n - 3 of the other blocks, the
  duplicates among the forced turned into -1 and the row sorted ascending. Ties go to the lower
  block (eager subtracts j * 1e-8 before its top-k: the same order on ties; on blocks whose
  importance differs by less than that, below the float32 noise of exp(s - lse) against eager's
  softmax, the two may differ). Not with pos, q_offset or importance_dtype; n >= 3. Both backends
  compute it (the triton backend: the row's logsumexp in a first kernel, `vibe_lse_kernel`).

A chunk of queries (`q_offset`, an int, default 0; issue 17): query row r of q (and of lse) is
token q_offset + r of the sequence k was pooled from; t above is that token, Ns = ceil((q_offset +
S) / l') (the blocks up to the last query's), block_idx [B, G, S, n] for the chunk's rows. Rules
'nsa' and 'fla' (the triton backend too, the offset added to each row's token where it is a
position); not with pos or rule 'lucidrains' (ValueError).

Packed documents (`pos` [B, S] int64, each token's position in its document; models/nsa.py): k
holds a slot per token, [B, G, Tc = S - l + 1 (0 when S < l), Dk], slot u pooling tokens
[u, u + l); `cmp_stride` stays the document stride d. Everything is counted from each token's
document start, as eager `NSAAttention.select_blocks(p_cmp, S, pos)`:

    p[b, h, t, u] = exp(s - lse[b, h, t]) where slot u is visible to t: u + l - 1 <= t,
                    u >= t - pos[t] (t's document), pos[u] % d == 0 and pos[u + l - 1] ==
                    pos[u] + l - 1 (a block of its document), else 0
    overlap(u, j) = tokens in both [pos[u], pos[u] + l) and [j*l', j*l' + l') (document positions)
    forced / candidate as above with pos[t] in place of t

so block ids are numbered within the query's document (block j = its tokens [j*l', (j+1)*l')),
Ns = ceil(S / l') still, and a row that sees no slot (a document shorter than l, the first l - 1
tokens of each) has importance 0 everywhere: its forced blocks, then its candidates ascending.
pos must count up by one inside each document from 0 at its start (models.check_positions, which
the model runs once per forward): the triton backend relies on it (the i-th block of a document
is then its slot at document position i*d), the reference computes the formulas above for any
int64 pos.

Eager computes p as a softmax and this op as exp(s - lse): the importance differs from eager's by
float32 rounding only, so blocks whose p_grp are within about 1e-6 (relative) of each other may be
ranked the other way; everything else, exact ties included (ties go to the lower block index), is
eager's choice.
Importance is float32 (float64 for float64 inputs). The op is not differentiable (an int64 result).

`importance_dtype` (None, torch.bfloat16 or torch.float16; issue 17: a semantic variant is a
parameter): the importance as eager computes it in that dtype, as under torch.autocast, where
`p_cmp @ overlap` runs in the autocast dtype (models/nsa.py `select_blocks` under bf16 autocast):
p rounded to it, the overlap weights (overlap / l, float32) rounded to it, each p_slc entry
the sum of their products accumulated in float32 (ascending compression block) and rounded to
it, the group sum of those accumulated in float32 and rounded to it (torch's sum of that dtype),
the key in that dtype; the ranking as above (a stable descending sort: the many exact ties of
the rounded importance go to the lower block). Rule 'fla' rounds the same way (p, then its
favoured 1.0 and the group sum in that dtype); with pos the same. Where the result can still
differ from eager's: p itself (exp(s - lse) against a softmax, about 1e-6 relative) may sit on
the other side of a rounding boundary, and eager's matmul may add its float32 products in
another order (a different last bit, again near a boundary); either moves one rounded importance
by one unit, which turns a tie into an order or an order into a tie. Measured on the CPU (random
gaussian q and pooled keys, the seed preset's h 6, G 2, Dk 64, l 32, d 16, l' 64, n 16,
S 2048, 40 seeds at each of the q scales 0.3, 1 and 3: 491,520 rows): bf16 1 row differs from
eager under autocast (fp16: 4 rows); without importance_dtype 17,857 rows (3.6%; fp16 2,364)
do. At S 1024 (Ns = n) every candidate is chosen and none differs. `group_sum_dtype=torch.float32`
(with importance_dtype; CUDA autocast, which runs `sum` in float32): the group sum of the rounded
per-head importances accumulated and kept in float32 (not rounded), the key float32. The triton backend takes it
(one chunk of heads: h <= 16 in fp16/bf16), rounding at the same places; its sums run in another
order than the reference's, with the same caveat. `group_first=True` (with importance_dtype, rule
'nsa', no pos, no group_sum_dtype): the group's heads summed before the block map, as
`torch.einsum('bghsc,cj->bgsj', p, map)` computes it in that dtype (it sums a letter of one operand
out first; grouped5d_nograd under CUDA autocast): p rounded, its group sum accumulated in float32
and rounded, then the map as above. In float32 the two orders differ by float32 rounding only
(group_first=False computes it). The triton backend takes it (any number of heads: only the
group's rounded sums are kept from tile to tile), rounding at the same places; its float32 sums
(the heads', the map's) run in another order than the reference's, with the same caveat.

Backends (`backend="auto"` takes the first that can run; naming one that cannot is an error):
- `triton` (CUDA): nsa_compile/ops/block_select_triton.py, one program per (batch, group, query
  tile): the scores are recomputed tile by tile over the compression blocks, mapped onto the
  selection blocks and merged into a running top-n in registers. No [.., S, Tc] or [.., S, Ns]
  tensor; extra memory is the output. With importance_dtype it rounds where eager under autocast
  does (each head mapped, then the group sum; group_first: the group sum, then one map). With pos
  each query is the unpacked query pos[t] of its document, whose blocks it reads from the compact
  list of the row's blocks (compressed_triton.document_slots, built on the device: no host sync);
  a query tile takes one pass over the blocks per document in it. Rule 'fla' (an FLA constexpr; the
  kernel without it is unchanged): the importance as above, the current block's group key h (the
  sum of the heads' 1.0, exact in any order and rounding), no forced blocks, only the blocks up to
  each query's current one ranked (a later block has key +0.0, so it ranks after all of them and
  becomes -1: the same ids as ranking all Ns), the first n of the running list written in its rank
  order. Compiled without fused multiply-adds (s * scale rounded, then - lse, as here), so a lone
  visible block's p is exactly 1 wherever the reference's is (lse equal to that block's score): its
  key ties the current block's h, the lower block first, as in the reference and eager. Rule
  'lucidrains' (a LUCID constexpr; the kernel without it compiles to the same PTX): no lse; each
  step of the logits rounded where the reference's ops round (q @ k^T, times scale, the group's
  mean, each block's mean of its l'/d columns added in ascending order), two passes over the
  blocks: the softmax's max and sum (the sink's -1e3 included; online, so the sum is added in
  another order than torch's), then each candidate's p = exp(a - max) / sum (libdevice's expf,
  rounded to q's dtype unless the softmax is float32) ranked in the running list, kept where
  p > 1e-10 as torch compares it in p's dtype, written in rank order, the diagonal block in column
  n. A p one fp32 unit from the reference's (the sum's order; torch's CPU softmax has its own exp)
  can move a bf16/fp16 rounding, or a float32 tie: on the grid inputs of the CPU tests none does;
  on CUDA at the seed shape tests/test_block_select_lucidrains.py bounds it at 1 row in 500.
- `reference` (every device and dtype): PyTorch, chunked over query rows: a chunk's
  probabilities [B, H, c, Tc] and keys [B, G, c, max(Ns, n)], never all S rows at once (c is set
  so a chunk's largest tensor stays under REFERENCE_BUDGET elements). With pos a chunk reads only
  the slots that are blocks, from its rows' earliest document start to its last row's last slot,
  and ranks only the blocks up to its largest document position (`packed_chunks`: one host read
  of pos per call): the work is about that of each document's unpacked staircase, not S * Tc / 2
  with a slot per token, and the ids are exactly those of the full width (the slots and blocks
  left out are 0 and -inf on every row of the chunk). The overlap map is a sum over each
  selection block's band of compression blocks in ascending order (what a matmul with the
  [Tc, Ns] overlap matrix does, without its zeros or TF32), then the heads are summed
  (group_first: before the map), and the ranking is eager's code (torch.sort, stable). With pos
  the slots a selection block can overlap are a band of l + l' - 1 document positions
  [j*l' - l + 1, (j + 1)*l') counted from the query's document start (t - pos[t]); the chunk's
  probabilities are gathered at those slots in ascending order (only every d-th when d divides l':
  the others are never blocks), so no [B, Tc, Ns] overlap matrix is built.
"""

from __future__ import annotations

import torch

from . import block_select_triton
from .common import check_gqa, check_offset, check_positive_int, upcast_dtype, why_not_triton_on
from .compressed import columns_on, document_chunks
from .registry import Backend, Op, declare

__all__ = ["BLOCK_SELECT", "REFERENCE_BUDGET", "choose_backend", "lucidrains_probabilities", "nsa_vibe_importance",
           "select_blocks", "why_not_triton"]

RULES = ("nsa", "fla", "lucidrains", "nsa_vibe")
# the rules that compute everything from q and k (lse None)
OWN_NORMALIZER = ("lucidrains", "nsa_vibe")
# rule 'lucidrains': the sink column's logit and the probability a chosen block must exceed
LUCIDRAINS_SINK, LUCIDRAINS_THRESHOLD = -1e3, block_select_triton.LUCID_THRESHOLD  # the kernel's sink: its -1000.0
# the importance dtypes the op rounds to (autocast's lower precisions)
ROUNDINGS = (torch.bfloat16, torch.float16)

# Elements of the reference backend's largest per-chunk tensor (a module constant so tests can
# shrink it): 2^24 fp32 elements are 64 MiB; a chunk holds a few such tensors at once.
REFERENCE_BUDGET = 1 << 24

_OP = "select_blocks"


def choose_backend(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, backend: str = "auto",
                   pos=None, rule: str = "nsa", importance_dtype: torch.dtype | None = None,
                   group_first: bool = False) -> str:  # fmt: skip
    """`BLOCK_SELECT.choose` (ops/registry.py): `backend` itself (ValueError, with why, where it
    cannot run these inputs), or for 'auto' triton where it can run on CUDA (with pos or without;
    every rule) and reference elsewhere."""
    return BLOCK_SELECT.choose(backend, q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos, rule,
                               importance_dtype, group_first)


def why_not_triton(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos=None, rule: str = "nsa",
                   importance_dtype: torch.dtype | None = None, group_first: bool = False) -> str | None:  # fmt: skip
    """Why 'auto' does not take the triton backend for these inputs (None: it does)."""
    return why_not_triton_on(
        q.device,
        lambda: block_select_triton.unsupported_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos,
                                                       importance_dtype, group_first, rule == "fla",
                                                       rule == "lucidrains", rule == "nsa_vibe"),
        kernels="the Triton kernel runs",
    )


def _check(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend="auto", pos=None,
           rule="nsa", importance_dtype=None, group_sum_dtype=None, q_offset=0, group_first=False) -> str:  # fmt: skip
    """The backend that computes these inputs; ValueError, naming the argument, unless the shapes,
    dtypes, block sizes, positions, rule, importance dtype and backend are valid."""
    if group_first and (rule != "nsa" or pos is not None or importance_dtype is None or group_sum_dtype is not None):
        raise ValueError(f"{_OP}: group_first (the heads summed before the block map, rounded) takes rule 'nsa' with "
                         "an importance_dtype, no group_sum_dtype and no pos (in float32 the two orders differ by "
                         "float32 rounding only: group_first=False computes it)")
    if rule not in RULES:
        raise ValueError(f"{_OP}: unknown rule {rule!r}; valid: {', '.join(RULES)}")
    if importance_dtype is not None and importance_dtype not in ROUNDINGS and rule != "lucidrains":
        raise ValueError(f"{_OP}: importance_dtype must be None, torch.bfloat16 or torch.float16, got "
                         f"{importance_dtype}")
    if group_sum_dtype is not None and (group_sum_dtype != torch.float32 or importance_dtype is None):
        raise ValueError(f"{_OP}: group_sum_dtype must be None, or torch.float32 with an importance_dtype, got "
                         f"{group_sum_dtype} (importance_dtype {importance_dtype})")
    check_offset(_OP, q_offset, pos)
    if rule == "lucidrains" and q_offset:
        raise ValueError(f"{_OP}: rule 'lucidrains' with q_offset (a chunk of queries) is not implemented")
    if rule != "nsa" and pos is not None:
        raise ValueError(f"{_OP}: rule {rule!r} with pos (packed documents) is not implemented")
    if (rule in OWN_NORMALIZER) != (lse is None):
        own = ("ranks the compressed logits" if rule == "lucidrains"
               else "computes its own softmax normalizer over every compressed block")
        raise ValueError(f"{_OP}: rule {rule!r} " + (f"{own}: lse must be None" if lse is not None
                                                     else "ranks the compressed probabilities: it needs the lse"))
    if rule == "nsa_vibe" and (importance_dtype is not None or group_sum_dtype is not None or q_offset):
        raise ValueError(f"{_OP}: rule 'nsa_vibe' computes the importance in float32 over the whole sequence: "
                         "importance_dtype, group_sum_dtype and q_offset must be unset")
    if rule == "nsa_vibe" and isinstance(n_selected, int) and n_selected < 3:
        raise ValueError(f"{_OP}: rule 'nsa_vibe' holds 3 forced slots: n_selected must be >= 3, got {n_selected}")
    if rule == "lucidrains" and group_sum_dtype is not None:
        raise ValueError(f"{_OP}: rule 'lucidrains' has no group sum: group_sum_dtype must be None")
    if rule == "lucidrains" and importance_dtype not in (None, torch.float32):
        raise ValueError(f"{_OP}: rule 'lucidrains' computes in q's dtype: importance_dtype must be None or "
                         f"torch.float32 (the softmax in float32), got {importance_dtype}")
    extra = ({} if lse is None else {"lse": lse}) | ({} if pos is None else {"pos": pos})
    check_gqa(_OP, q, k, rows="Tc", **extra)
    B, H, S, _ = q.shape
    if lse is not None and lse.dtype != torch.float32:
        raise ValueError(f"{_OP}: lse must be a float32 tensor, got {lse.dtype}")
    if lse is not None and tuple(lse.shape) != (B, H, S):
        raise ValueError(f"{_OP}: lse must have shape [B, H, S] = [{B}, {H}, {S}], got {tuple(lse.shape)}")
    for name, value in (("cmp_block", cmp_block), ("cmp_stride", cmp_stride), ("sel_block", sel_block),
                        ("n_selected", n_selected)):  # fmt: skip
        check_positive_int(_OP, name, value)
    if rule == "lucidrains" and sel_block % cmp_stride:
        raise ValueError(f"{_OP}: rule 'lucidrains' averages the l'/d columns of each block: sel_block "
                         f"{sel_block} must be a multiple of cmp_stride {cmp_stride}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat, torch.SymInt)):
        raise ValueError(f"{_OP}: scale must be a float, got {type(scale).__name__}")
    if pos is not None:
        if pos.dtype != torch.int64 or tuple(pos.shape) != (B, S):
            raise ValueError(f"{_OP}: pos must be an int64 tensor of shape [B, S] = [{B}, {S}], got {pos.dtype} "
                             f"{tuple(pos.shape)}")
        slots = max(0, S - cmp_block + 1)
        if k.shape[2] != slots:
            raise ValueError(f"{_OP}: with pos, k must hold a slot per token, Tc = max(0, S - cmp_block + 1) = "
                             f"{slots}, got {k.shape[2]}")
    return choose_backend(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, backend, pos, rule,
                          importance_dtype, group_first)


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


def rank_and_choose(p_grp: torch.Tensor, t: torch.Tensor, sel_block: int, n_selected: int,
                    rule: str = "nsa") -> torch.Tensor:  # fmt: skip
    """Eager's ranking (models/nsa.py `select_blocks`) of p_grp [B, G, c, Ns] for query rows at
    positions t (int64, [c, 1]: the tokens themselves, or [B, 1, c, 1]: their document positions):
    chosen blocks [B, G, c, n] int64, ascending, -1 padded. Rule 'fla': p_grp is already the key
    (the current block favoured by the caller); the first n blocks in rank order, those after the
    current one (and padding) -1."""
    Ns = p_grp.shape[3]
    j = torch.arange(Ns, device=p_grp.device)[None, :]
    current = t // sel_block
    if rule == "nsa_vibe":  # every block a candidate; n - 3 + |F| chosen; the -1 first
        key = torch.where((j == 0) | (j == current) | (j == current - 1), float("inf"), p_grp)
        key = torch.nn.functional.pad(key, (0, max(0, n_selected - Ns)), value=float("-inf"))  # >= n columns
        values, order = torch.sort(key, dim=-1, descending=True, stable=True)
        n_forced = 1 + current.clamp(max=2)  # distinct forced blocks: {0}, {0, 1}, {0, c - 1, c}
        rank = torch.arange(n_selected, device=p_grp.device)
        keep = (rank < n_selected - 3 + n_forced) & (values[..., :n_selected] > float("-inf"))
        return torch.sort(torch.where(keep, order[..., :n_selected], -1), dim=-1).values
    if rule == "fla":
        key = torch.nn.functional.pad(p_grp, (0, max(0, n_selected - Ns)), value=float("-inf"))  # >= n columns
        values, order = torch.sort(key, dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., :n_selected] > float("-inf"), order[..., :n_selected], -1)
        return torch.where(chosen > current, -1, chosen)  # rank order, future blocks -1 after the top-n
    forced = (j == 0) | (j == current) | (j == current - 1)  # [c, Ns]
    candidate = j * sel_block <= t
    key = torch.where(forced, float("inf"), torch.where(candidate, p_grp, float("-inf")))
    key = torch.nn.functional.pad(key, (0, max(0, n_selected - Ns)), value=float("-inf"))  # >= n columns
    values, order = torch.sort(key, dim=-1, descending=True, stable=True)
    past_end = key.shape[-1]
    chosen = torch.where(values[..., :n_selected] > float("-inf"), order[..., :n_selected], past_end)
    chosen = torch.sort(chosen, dim=-1).values  # ascending, unchosen last
    return torch.where(chosen == past_end, -1, chosen)


def rounded(x: torch.Tensor, importance_dtype: torch.dtype | None) -> torch.Tensor:
    """x rounded to importance_dtype, as float32 again: the operand values a bf16/fp16 matmul
    multiplies (their products exact in its float32 accumulator); x itself for None."""
    return x if importance_dtype is None else x.to(importance_dtype).float()


def group_sum(p_slc: torch.Tensor, group_sum_dtype: torch.dtype | None) -> torch.Tensor:
    """The group's heads summed, [B, G, c, Ns]: in p_slc's dtype (rounded once, as torch's sum of a
    bf16/fp16 tensor), or accumulated and kept in group_sum_dtype (float32: CUDA autocast runs sum
    in float32)."""
    return (p_slc if group_sum_dtype is None else p_slc.to(group_sum_dtype)).sum(2)


def accumulator(up: torch.dtype, importance_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the overlap sums accumulate in: the probabilities' own, float32 for a rounded
    importance (a bf16/fp16 matmul accumulates in float32; its result is then rounded)."""
    return up if importance_dtype is None else torch.float32


def _reference(q, k, lse, cmp_block: int, cmp_stride: int, sel_block: int, n_selected: int, scale: float,
               budget: int | None = None, rule: str = "nsa", importance_dtype: torch.dtype | None = None,
               group_sum_dtype: torch.dtype | None = None, q_offset: int = 0,
               group_first: bool = False) -> torch.Tensor:  # fmt: skip
    B, H, S, _ = q.shape
    G, Tc = k.shape[1], k.shape[2]
    h = H // G
    up = upcast_dtype(q.dtype)
    Ns = -(-(q_offset + S) // sel_block)  # the blocks of the tokens up to the last query
    out = torch.empty((B, G, S, n_selected), dtype=torch.int64, device=q.device)
    if out.numel() == 0:
        return out
    index, weight = overlap_band(Tc, Ns, cmp_block, cmp_stride, sel_block, q.device, up)  # [W, Ns]
    weight, acc = rounded(weight, importance_dtype), accumulator(up, importance_dtype)
    width = max(Ns, n_selected)
    budget = budget or REFERENCE_BUDGET
    chunk = max(1, min(S, budget // max(1, B * H * max(Tc, width))))
    qg = q.unflatten(1, (G, h))  # [B, G, h, S, Dk]
    kT = k.transpose(-1, -2)[:, :, None]  # [B, G, 1, Dk, Tc]
    lse_g = None if lse is None else lse.unflatten(1, (G, h))  # [B, G, h, S]
    i = torch.arange(Tc, device=q.device)
    for t0 in range(0, S, chunk):
        t1 = min(S, t0 + chunk)
        t = torch.arange(q_offset + t0, q_offset + t1, device=q.device)[:, None]  # [c, 1]: the rows' tokens
        if rule == "nsa_vibe":  # every column, scaled in q's dtype; the row's own logsumexp
            s = ((qg[:, :, :, t0:t1] @ kT) * scale).to(up)  # [B, G, h, c, Tc]
            visible, lse_c = torch.ones_like(i, dtype=torch.bool), torch.logsumexp(s, dim=-1, keepdim=True)
        else:
            visible = i * cmp_stride + cmp_block - 1 <= t  # [c, Tc]: the whole block is in the past
            s = (qg[:, :, :, t0:t1] @ kT).to(up) * scale  # [B, G, h, c, Tc]
            lse_c = lse_g[:, :, :, t0:t1, None].to(up)
        # where, not multiply: a row without a visible block has lse = -inf and exp(s - lse) = inf
        p = rounded(torch.where(visible, torch.exp(s - lse_c), 0.0), importance_dtype)
        del s
        if group_first:  # the group's heads summed first (accumulated in float32, rounded), then the block map
            p = rounded(p.sum(2, keepdim=True), importance_dtype)
        p_slc = torch.zeros((*p.shape[:-1], Ns), dtype=acc, device=q.device)  # [B, G, h, c, Ns]
        if Tc:
            for w in range(index.shape[0]):  # ascending compression block: a matmul's order
                p_slc += p[..., index[w]] * weight[w]
        del p
        if importance_dtype is not None:  # the matmul's result, rounded; the head sum then in that dtype
            p_slc = p_slc.to(importance_dtype)
        if rule == "fla":  # each head's importance of the current block set to 1.0 before the group sum
            p_slc = torch.where(torch.arange(Ns, device=q.device) == t // sel_block, 1.0, p_slc)
        out[:, :, t0:t1] = rank_and_choose(group_sum(p_slc, group_sum_dtype), t, sel_block, n_selected, rule)
    return out


def document_band(cmp_block: int, cmp_stride: int, sel_block: int, device, dtype):
    """The packed overlap map as a band: offsets [W'] and weights [W'] with p_slc[t, j] = sum_w
    p[t, start + j*l' + offset[w]] * weight[w] (start = t - pos[t], t's document start; w ascending
    = slot ascending). Slot start + j*l' + o starts at document position j*l' + o and shares
    min(o + l, l') - max(o, 0) tokens with block j, for o in [-(l - 1), l'): every slot that
    overlaps block j. Where d divides l' only the offsets with o % d == 0 remain (a slot at another
    document position is never a block: its probability is 0, and adding 0 changes no sum)."""
    l, d, ls = cmp_block, cmp_stride, sel_block
    offset = torch.arange(1 - l, ls, device=device)
    if ls % d == 0:
        offset = offset[offset % d == 0]
    shared = torch.minimum(offset + l, torch.full_like(offset, ls)) - offset.clamp(min=0)
    return offset, shared.to(dtype) / l  # eager's arithmetic: int overlap -> dtype, / l


def packed_chunks(pos: torch.Tensor, cmp_block: int, cmp_stride: int, Tc: int, sel_block: int, Ns: int, per_row: int,
                  floor: int, budget: int):
    """(t0, t1, cols, nb) per query chunk of `_reference_packed`: rows [t0, t1) read the slots cols
    (int64 [n] on the host, ascending: compressed.document_chunks, the blocks their documents can
    hold) and rank the blocks [0, nb): nb = the chunk's largest document position // l' + 1
    (1 <= nb <= Ns), since each later block is neither forced nor a candidate on any of its rows
    (key -inf), and a stable sort keeps the order of the others. The rows per chunk keep
    B * H * rows * max(n, nb, floor) within budget. One host read of pos [B, S]."""
    pos = pos.cpu()
    blocks = (pos.amax(0) // sel_block + 1).clamp(1, Ns)  # [S]: the blocks each row can rank
    chunks = document_chunks(pos, cmp_block, cmp_stride, Tc, per_row, budget, floor=blocks.clamp(min=floor))
    for t0, t1, cols in chunks:
        yield t0, t1, cols, int(blocks[t0:t1].max())


def _reference_packed(q, k, lse, cmp_block: int, cmp_stride: int, sel_block: int, n_selected: int, scale: float,
                      pos: torch.Tensor, budget: int | None = None, importance_dtype: torch.dtype | None = None,
                      group_sum_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    B, H, S, Dk = q.shape
    G, Tc = k.shape[1], k.shape[2]
    h = H // G
    l, d, ls = cmp_block, cmp_stride, sel_block
    up = upcast_dtype(q.dtype)
    Ns = -(-S // ls)
    out = torch.empty((B, G, S, n_selected), dtype=torch.int64, device=q.device)
    if out.numel() == 0:
        return out
    offset, weight = document_band(l, d, ls, q.device, up)  # [W']
    weight, acc = rounded(weight, importance_dtype), accumulator(up, importance_dtype)
    band = list(zip(offset.tolist(), weight))  # read once (a device sync), not per chunk
    slot_pos = pos[:, :Tc]  # [B, Tc]: document position of each slot's first token
    is_block = (slot_pos % d == 0) & (pos[:, l - 1 :] == slot_pos + l - 1)  # [B, Tc]: l tokens in one document
    token = torch.arange(S, device=q.device)
    doc_start = token - pos  # [B, S]
    qg = q.unflatten(1, (G, h))  # [B, G, h, S, Dk]
    lse_g = lse.unflatten(1, (G, h))  # [B, G, h, S]
    j_first = torch.arange(Ns, device=q.device) * ls  # [Ns]: each selection block's first document position
    chunks = list(packed_chunks(pos, l, d, Tc, ls, Ns, B * H, max(n_selected, Dk), budget or REFERENCE_BUDGET))
    for (t0, t1, cols, nb), i in zip(chunks, columns_on(q.device, chunks)):
        t = token[t0:t1, None]  # [c, 1]
        start = doc_start[:, t0:t1, None]  # [B, c, 1]
        p_slc = torch.zeros((B, G, h, t1 - t0, nb), dtype=acc, device=q.device)  # [B, G, h, c, nb]
        if len(cols):  # the slots cols (every other one is 0 on every row of the chunk: it adds nothing)
            lo, hi = int(cols[0]), int(cols[-1]) + 1  # (cols on the host, i on q's device)
            visible = (i + l - 1 <= t) & (i >= start) & is_block[:, None, i]  # [B, c, n]
            # the group's h heads as the rows of one matmul per (batch, group): K is read, never copied
            s = (qg[:, :, :, t0:t1].flatten(2, 3) @ k[:, :, i].transpose(-1, -2)).unflatten(2, (h, t1 - t0))
            s = s.to(up) * scale  # [B, G, h, c, n]
            # where, not multiply: a row without a visible slot has lse = -inf and exp(s - lse) = inf
            p = torch.where(visible[:, None, None], torch.exp(s - lse_g[:, :, :, t0:t1, None].to(up)), 0.0)
            p = rounded(p, importance_dtype)  # [B, G, h, c, n]
            del s
            columns = torch.full((hi - lo,), -1, device=q.device)  # slot lo + x is column columns[x] of p, or none
            columns[i - lo] = torch.arange(len(i), device=q.device)
            for o, w in band:  # ascending slot: a matmul's order
                slot = start + j_first[:nb] + o  # [B, c, nb]
                column = columns[(slot - lo).clamp(0, hi - lo - 1)]
                inside = (slot >= lo) & (slot < hi) & (column >= 0)  # the others are 0 here, or do not exist
                taken = torch.gather(p, 4, column.clamp(min=0)[:, None, None].expand(p_slc.shape))
                p_slc += torch.where(inside[:, None, None], taken, 0.0) * w
            del p
        if importance_dtype is not None:  # the matmul's result, rounded; the head sum then in that dtype
            p_slc = p_slc.to(importance_dtype)
        t_doc = pos[:, None, t0:t1, None]  # [B, 1, c, 1]: forced and candidate blocks by document position
        out[:, :, t0:t1] = rank_and_choose(group_sum(p_slc, group_sum_dtype), t_doc, ls, n_selected)
    return out


def lucidrains_probabilities(q, k, cmp_stride: int, sel_block: int, scale: float, t0: int = 0, t1: int | None = None,
                             softmax_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """Rule 'lucidrains': p [B, G, c, Jc] of query rows t0 .. t1 - 1 (the module docstring's p, in
    q's dtype, or softmax_dtype: the sink column dropped, 0 on every block that is not a
    candidate). q [B, H, S, Dk], k [B, G, Tc, Dk] (H = G h); also what the select_blocks pass
    compares a model's region with."""
    S, G, Tc = q.shape[2], k.shape[1], k.shape[2]
    t1 = S if t1 is None else t1
    per = sel_block // cmp_stride  # compressed columns averaged per selection block
    Jc = Tc // per
    t = torch.arange(t0, t1, device=q.device)[:, None]  # [c, 1]
    ends = (torch.arange(Tc, device=q.device) + 1) * cmp_stride - 1  # [Tc]: each column's last token
    s = (q.unflatten(1, (G, -1))[:, :, :, t0:t1] @ k.transpose(-1, -2)[:, :, None]) * scale  # [B, G, h, c, Tc]
    s = s.masked_fill(~(ends < t), float("-inf")).mean(2)  # the group's mean: [B, G, c, Tc]
    a = s[..., : Jc * per].unflatten(-1, (Jc, per)).mean(-1)  # [B, G, c, Jc]
    a = a.masked_fill(~(torch.arange(Jc, device=q.device) < t // sel_block), float("-inf"))
    return torch.nn.functional.pad(a, (1, 0), value=LUCIDRAINS_SINK).softmax(dim=-1, dtype=softmax_dtype)[..., 1:]


def nsa_vibe_importance(q, k, cmp_block: int, cmp_stride: int, sel_block: int, scale: float) -> torch.Tensor:
    """Rule 'nsa_vibe''s importance p_grp [B, G, S, Ns] (the module docstring), whole (not chunked):
    what the select_blocks pass compares a model's choice with where a probe's rows differ."""
    B, H, S, _ = q.shape
    G, Tc = k.shape[1], k.shape[2]
    up = upcast_dtype(q.dtype)
    Ns = -(-S // sel_block)
    s = ((q.unflatten(1, (G, H // G)) @ k.transpose(-1, -2)[:, :, None]) * scale).to(up)  # [B, G, h, S, Tc]
    p = torch.softmax(s, dim=-1)
    index, weight = overlap_band(Tc, Ns, cmp_block, cmp_stride, sel_block, q.device, up)
    p_slc = sum(p[..., index[w]] * weight[w] for w in range(index.shape[0])) if Tc else p.new_zeros(*p.shape[:-1], Ns)
    return p_slc.sum(2)


def _reference_lucidrains(q, k, cmp_stride: int, sel_block: int, n_selected: int, scale: float,
                          budget: int | None = None,
                          softmax_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """Rule 'lucidrains' (the module docstring): [B, G, S, n + 1] int64, chunked over query rows
    (a chunk's scores [B, H, c, Tc] under the budget), every step in q's dtype as eager's."""
    B, H, S, _ = q.shape
    G, Tc = k.shape[1], k.shape[2]
    top = min(n_selected, Tc // (sel_block // cmp_stride))
    out = torch.full((B, G, S, n_selected + 1), -1, dtype=torch.int64, device=q.device)
    out[..., n_selected] = torch.arange(S, device=q.device) // sel_block  # the diagonal block, appended
    if out.numel() == 0 or top == 0:
        return out
    budget = budget or REFERENCE_BUDGET
    chunk = max(1, min(S, budget // max(1, B * H * Tc)))
    for t0 in range(0, S, chunk):
        t1 = min(S, t0 + chunk)
        p = lucidrains_probabilities(q, k, cmp_stride, sel_block, scale, t0, t1, softmax_dtype)
        values, order = torch.sort(p, dim=-1, descending=True, stable=True)
        values, order = values[..., :top], order[..., :top]
        out[:, :, t0:t1, :top] = torch.where(values > LUCIDRAINS_THRESHOLD, order, -1)
    return out


def _reference_forward(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, pos=None, rule="nsa",
                       importance_dtype=None, group_sum_dtype=None, q_offset=0, group_first=False):  # fmt: skip
    if q_offset or group_first:  # pos and rule 'lucidrains' take neither (_check)
        return _reference(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, rule=rule,
                          importance_dtype=importance_dtype, group_sum_dtype=group_sum_dtype, q_offset=q_offset,
                          group_first=group_first)
    if rule == "lucidrains":
        return _reference_lucidrains(q, k, cmp_stride, sel_block, n_selected, scale, softmax_dtype=importance_dtype)
    if pos is not None:
        return _reference_packed(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, pos,
                                 importance_dtype=importance_dtype, group_sum_dtype=group_sum_dtype)
    return _reference(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, rule=rule,
                      importance_dtype=importance_dtype, group_sum_dtype=group_sum_dtype)


def _triton_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos=None, rule="nsa",
                   importance_dtype=None, group_first=False) -> str | None:  # fmt: skip
    return block_select_triton.unsupported_reason(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, pos,
                                                  importance_dtype, group_first, rule == "fla", rule == "lucidrains",
                                                  rule == "nsa_vibe")


# The block ids are integers: no gradient, no backward op.
BLOCK_SELECT = declare(Op(
    name="select_blocks",
    schema="(Tensor q, Tensor k, Tensor? lse, SymInt cmp_block, SymInt cmp_stride, SymInt sel_block, "
           'SymInt n_selected, float scale, str backend="auto", Tensor? pos=None, str rule="nsa", '
           "ScalarType? importance_dtype=None, ScalarType? group_sum_dtype=None, int q_offset=0, "
           "bool group_first=False) -> Tensor",
    config_field="select_blocks_backend",
    choice_args=("q", "k", "lse", "cmp_block", "cmp_stride", "sel_block", "n_selected", "pos", "rule",
                 "importance_dtype", "group_first"),
    backends=(
        Backend("triton", cannot_run=_triton_reason, auto_reason=why_not_triton,
                forward=lambda q, k, lse, l, d, ls, n, scale, pos, rule, importance_dtype, group_sum_dtype, q_offset,
                group_first:
                    block_select_triton.select_blocks_forward(q, k, lse, l, d, ls, n, scale, pos, importance_dtype,
                                                              group_sum_dtype, q_offset, group_first, rule == "fla",
                                                              rule == "lucidrains", rule == "nsa_vibe")),
        Backend("reference", forward=_reference_forward),
    ),
    check=_check,
    fake=lambda q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend="auto", pos=None,
    rule="nsa", *_: q.new_empty(  # rule 'lucidrains' appends the diagonal block: n + 1 columns
        (q.shape[0], k.shape[1], q.shape[2], n_selected + (rule == "lucidrains")), dtype=torch.int64),
))


def select_blocks(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, cmp_block: int, cmp_stride: int, sel_block: int,
    n_selected: int, scale: float, backend: str = "auto", pos: torch.Tensor | None = None, rule: str = "nsa",
    importance_dtype: torch.dtype | None = None, group_sum_dtype: torch.dtype | None = None, q_offset: int = 0,
    group_first: bool = False,
) -> torch.Tensor:
    """`torch.ops.nsa.select_blocks` (see the module docstring)."""
    return torch.ops.nsa.select_blocks(q, k, lse, cmp_block, cmp_stride, sel_block, n_selected, scale, backend,
                                       pos=pos, rule=rule, importance_dtype=importance_dtype,
                                       group_sum_dtype=group_sum_dtype, q_offset=q_offset, group_first=group_first)
