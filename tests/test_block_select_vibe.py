"""Rule 'nsa_vibe' of `nsa.select_blocks` (nsa_compile/ops/block_select.py): the nsa-vibe model's
NON-causal block choice (tests/corpus/nsa_vibe_noncausal.py). The reference backend is held to
that model's own eager spelling (`eager_choice` below: the einsum, the softmax over every
compressed block, the COO overlap list with scatter_add, the forced blocks filled -inf, the index
tie-break, top-k, concatenation, de-duplication and the two sorts); the triton backend (CPU:
Triton's interpreter) to the reference.

Float64 inputs for the eager comparison: its float32 tie-break (j * 1e-8) then orders only exact
ties, which random float64 probabilities do not have, so the ids must be equal. The kernel test
uses float32 and bf16 inputs on a grid of multiples of 1/32 with a power-of-two scale (every logit
exact, or one correctly rounded bf16 step as in the reference); its exp and its online sum differ
from torch's by float32 rounding, so the test accepts a differing row only where the reference's
own importance has a near tie at the cut (none at these sizes so far).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import (
    one_thread,  # noqa: F401  (an autouse fixture: imported, it runs for this module)
    triton_interpreter,
)

from nsa_compile.ops import block_select_triton as bst
from nsa_compile.ops import select_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_TRITON = bst.triton is not None


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    """Without CUDA: TRITON_INTERPRET=1 while this module runs."""
    with triton_interpreter(on=DEVICE == "cpu" and HAVE_TRITON):
        yield


def eager_choice(q, k_cmp, l, d, l_sel, n_sel, scale):
    """The corpus model's choice, spelled as it spells it, from q [B, H, S, Dk] and the pooled keys
    [B, G, Tc, Dk]: block ids [B, G, S, n] (the model's [B, S, G, n] transposed)."""
    B, H, S, Dk = q.shape
    G, S_cmp = k_cmp.shape[1], k_cmp.shape[2]
    h = H // G
    Q = q.transpose(1, 2).reshape(B, S, G, h, Dk)
    logits = torch.einsum("bsghd,bgdc->bsghc", Q, k_cmp.permute(0, 1, 3, 2)) * scale
    p_all = F.softmax(logits, dim=-1)
    S_sel = (S + l_sel - 1) // l_sel
    rows, cols, weights = [], [], []
    for r in range(S_cmp):
        for c in range(S_sel):
            overlap = min(r * d + l, (c + 1) * l_sel) - max(r * d, c * l_sel)
            if overlap > 0:
                rows.append(r), cols.append(c), weights.append(overlap / l)
    p_src = p_all[..., torch.tensor(rows)] * torch.tensor(weights, dtype=p_all.dtype)
    p_slc = torch.zeros(B, S, G, h, S_sel, dtype=p_all.dtype).scatter_add(
        -1, torch.tensor(cols).view(1, 1, 1, 1, -1).expand(B, S, G, h, -1), p_src)
    p_grp = p_slc.sum(dim=3)
    last = torch.arange(S) // l_sel
    forced = torch.stack([torch.zeros_like(last), last, (last - 1).clamp_min(0)], dim=-1).view(1, S, 1, 3)
    forced = forced.expand(B, S, G, 3)
    masked = p_grp.masked_fill(torch.zeros_like(p_grp, dtype=torch.bool).scatter_(-1, forced, True), float("-inf"))
    composite = masked.to(torch.float32) - torch.arange(S_sel, dtype=torch.float32) * 1e-8
    _, top = torch.topk(composite, k=min(n_sel - 3, S_sel), dim=-1, largest=True, sorted=True)
    chosen = torch.cat([forced, top], dim=-1).sort(dim=-1).values
    duplicate = F.pad(chosen[..., 1:] == chosen[..., :-1], (1, 0), value=False)
    return torch.where(duplicate, -1, chosen).sort(dim=-1).values.transpose(1, 2)


# (B, G, h, S, l, d, l', n): several query rows per selection block and tiles of compression blocks;
# Ns < n - 3 (every block chosen, -1 padding), Ns = 1 (S <= l'), h = 1, l = d
CASES = [(2, 2, 3, 83, 8, 4, 8, 5), (1, 1, 6, 150, 16, 8, 16, 6), (1, 2, 1, 77, 4, 2, 8, 12),
         (2, 1, 3, 30, 8, 4, 16, 5), (1, 2, 2, 12, 4, 4, 16, 4), (1, 1, 4, 100, 8, 8, 8, 7)]  # fmt: skip


@pytest.mark.parametrize("B,G,h,S,l,d,ls,n", CASES)
def test_reference_is_the_models_eager_choice(B, G, h, S, l, d, ls, n):
    gen = torch.Generator().manual_seed(S + n)
    Tc = (S - l) // d + 1
    q = torch.randn(B, G * h, S, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, Tc, 16, generator=gen, dtype=torch.float64)
    want = eager_choice(q, k, l, d, ls, n, 0.3)
    got = select_blocks(q, k, None, l, d, ls, n, 0.3, "reference", rule="nsa_vibe")
    assert got.shape == want.shape == (B, G, S, n)
    assert torch.equal(got, want)
    # the choice reads later tokens: some row holds a block that starts after it
    t = torch.arange(S)[:, None]
    assert S <= ls or bool(((got * ls > t) & (got >= 0)).any())


def grid_case(B, G, h, S, Tc, Dk, dtype, seed):
    """q [B, H, S, Dk] (a view of [B, S, H, Dk] memory) and keys [B, G, Tc, Dk], multiples of 1/32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 33, (B, S, G * h, Dk), generator=gen) / 32
    k = torch.randint(-32, 33, (B, G, Tc, Dk), generator=gen) / 32
    return q.to(dtype).transpose(1, 2).to(DEVICE), k.to(dtype).to(DEVICE)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,G,h,S,l,d,ls,n", [CASES[0], CASES[2], CASES[3], CASES[4]])
def test_triton_matches_the_reference(B, G, h, S, l, d, ls, n, dtype):
    Tc = (S - l) // d + 1
    q, k = grid_case(B, G, h, S, Tc, 16, dtype, seed=S * 7 + n)
    want = select_blocks(q, k, None, l, d, ls, n, 0.25, "reference", rule="nsa_vibe")
    got = select_blocks(q, k, None, l, d, ls, n, 0.25, "triton", rule="nsa_vibe")
    assert got.shape == want.shape and got.dtype == torch.int64
    assert torch.equal(got.cpu(), want.cpu())


def test_bad_arguments_are_refused():
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="lse must be None"):
        select_blocks(q, k, torch.zeros(1, 2, 20), 8, 4, 8, 5, 0.3, "reference", rule="nsa_vibe")
    with pytest.raises(ValueError, match="n_selected must be >= 3"):
        select_blocks(q, k, None, 8, 4, 8, 2, 0.3, "reference", rule="nsa_vibe")
    with pytest.raises(ValueError, match="q_offset"):
        select_blocks(q, k, None, 8, 4, 8, 5, 0.3, "reference", rule="nsa_vibe", q_offset=4)
    with pytest.raises(ValueError, match="pos"):
        select_blocks(q, k, None, 8, 4, 8, 5, 0.3, "reference", rule="nsa_vibe",
                      pos=torch.arange(20).view(1, 20))
