"""Rule 'lucidrains' in the Triton block-selection kernel (nsa_compile/ops/block_select_triton.py,
LUCID): `nsa.select_blocks(q, k, None, d, d, l', n, scale, "triton", rule="lucidrains")` against the
reference backend, whose formula tests/test_select_lucidrains.py holds to lucidrains' eager code.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by a module fixture).
Inputs on a grid (multiples of 1/32) with a power-of-two scale make every logit and every fp32 sum
of logits exact in any order, so fp32 ids must equal the reference's exactly; in bf16/fp16 each
step is one correctly rounded operation of exact values (the kernel rounds where the reference's
ops do), so those must be exact too, ties among equal rounded probabilities included. The
softmax's exp differs (numpy's here, libdevice's expf on CUDA, Sleef's in torch's CPU softmax): a
probability one fp32 unit apart can move a bf16/fp16 rounding, which these sizes do not meet; the
GPU test bounds it at the seed shape.
"""

from __future__ import annotations

import re

import pytest
import torch
from oracles import (
    one_thread,  # noqa: F401  (an autouse fixture: imported, it runs for this module)
    triton_interpreter,
)

from nsa_compile.ops import block_select as bs_mod
from nsa_compile.ops import block_select_triton as bst
from nsa_compile.ops import select_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_TRITON = bst.triton is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
compiles_here = pytest.mark.skipif(
    not HAVE_TRITON or torch.cuda.is_available() or not isinstance(bst.tl.max, bst.triton.runtime.JITFunction),
    reason="triton imported under TRITON_INTERPRET=1 cannot compile here; on CUDA the kernel tests compile it")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    """Without CUDA: TRITON_INTERPRET=1 while this module runs."""
    with triton_interpreter(on=DEVICE == "cpu" and HAVE_TRITON):
        yield


def grid_case(B, G, h, S, Tc, Dk, dtype, seed, spread=1.0, device=DEVICE):
    """q [B, H, S, Dk] (a view of [B, S, H, Dk] memory) and compressed keys [B, G, Tc, Dk], multiples
    of 1/32 (q times a power of two `spread`): exact in every dtype here."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 33, (B, S, G * h, Dk), generator=gen) / 32 * spread
    k = torch.randint(-32, 33, (B, G, Tc, Dk), generator=gen) / 32
    return q.to(dtype).transpose(1, 2).to(device), k.to(dtype).to(device)


# (B, G, h, S, d, l', n, spread): h 1, 3, 6; S not a multiple of the query tile (16 to 64 rows) and
# spanning several tiles of compression columns; Tc // (l'/d) < n (fewer blocks than n); l'/d 2, 4, 8;
# spread 256 puts probabilities under the 1e-10 threshold
CASES = [(2, 2, 3, 83, 4, 8, 3, 1.0), (1, 1, 6, 150, 4, 16, 5, 1.0), (1, 2, 1, 77, 2, 8, 12, 1.0),
         (2, 1, 3, 301, 2, 16, 4, 256.0), (1, 2, 6, 45, 4, 8, 16, 256.0)]  # fmt: skip


@pytest.mark.parametrize("softmax_dtype", [None, torch.float32], ids=["softmax-in-q-dtype", "softmax-fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_lucidrains_equals_the_reference(dtype, softmax_dtype):
    """The kernel's ids equal the reference's exactly: rank order, -1 where p <= 1e-10 and past
    min(n, Jc), the diagonal block in column n; both the softmax in q's dtype and in float32."""
    dropped = short = 0
    for B, G, h, S, d, ls, n, spread in CASES:
        Tc = S // d
        q, k = grid_case(B, G, h, S, Tc, 12, dtype, seed=S + h, spread=spread)
        args = (q, k, None, d, d, ls, n, 0.25)
        want = select_blocks(*args, "reference", rule="lucidrains", importance_dtype=softmax_dtype)
        got = select_blocks(*args, "triton", rule="lucidrains", importance_dtype=softmax_dtype)
        assert got.shape == (B, G, S, n + 1) and got.dtype == torch.int64 and got.is_contiguous()
        assert torch.equal(got, want), (B, G, h, S, d, ls, n, int((got != want).any(-1).sum()))
        jc = Tc // (ls // d)
        j = torch.arange(jc, device=q.device)
        candidates = (j[None, :] < (torch.arange(S, device=q.device) // ls)[:, None]).sum(-1)  # [S]
        kept = (got[..., :n] >= 0).sum(-1)
        dropped += int((kept < candidates.clamp(max=n)).sum())  # candidates under the threshold
        short += jc < n
    assert dropped > 0 and short >= 2, (dropped, short)

@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_stored_block_means_and_the_second_pass_give_the_same_ids(dtype, monkeypatch):
    """The ranking pass reads the first pass's block means back (STORED, within MEANS_BUDGET) or,
    past the budget, computes them again: the same ids either way, bit for bit, on every case but
    the longest (S 301: the interpreter's time; the others span several tiles of columns)."""
    for B, G, h, S, d, ls, n, spread in CASES[:3] + CASES[4:]:
        q, k = grid_case(B, G, h, S, S // d, 12, dtype, seed=S + 2 * h, spread=spread)
        args = (q, k, None, d, d, ls, n, 0.25, "triton")
        stored = select_blocks(*args, rule="lucidrains")
        monkeypatch.setattr(bst, "MEANS_BUDGET", 0)
        again = select_blocks(*args, rule="lucidrains")
        monkeypatch.undo()
        assert torch.equal(stored, again), (B, G, h, S, d, ls, n)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounded_probabilities_tie_and_go_to_the_lower_block(dtype):
    """In q's dtype the probabilities tie where the logits do not; the kernel ranks those ties to
    the lower block as the reference's stable sort does (the same ids), so its order differs from
    the float32 softmax's somewhere, and q = 0 ties every candidate: the lowest n blocks in order."""
    q, k = grid_case(2, 2, 3, 130, 130 // 2, 12, dtype, seed=9, spread=4.0)
    args = (q, k, None, 2, 2, 8, 6, 0.25)
    rounded = select_blocks(*args, "triton", rule="lucidrains")
    assert torch.equal(rounded, select_blocks(*args, "reference", rule="lucidrains"))
    wide = select_blocks(*args, "triton", rule="lucidrains", importance_dtype=torch.float32)
    assert torch.equal(wide, select_blocks(*args, "reference", rule="lucidrains", importance_dtype=torch.float32))
    assert not torch.equal(rounded, wide)
    zero = (torch.zeros_like(q), *args[1:])
    got = select_blocks(*zero, "triton", rule="lucidrains")
    t = torch.arange(130, device=q.device)[:, None]
    lowest = torch.arange(6, device=q.device).expand(130, 6)
    assert torch.equal(got[0, 0, :, :6], torch.where(lowest < t // 8, lowest, -1))
    assert torch.equal(got, select_blocks(*zero, "reference", rule="lucidrains"))


def test_the_kernel_computes_each_rule_on_the_same_inputs():
    """The same q and compressed keys through the kernel with rule 'lucidrains' and the paper's rule
    (its lse from the same keys, l = d): each gives its own reference ids, and they differ."""
    q, k = grid_case(1, 2, 3, 100, 25, 12, torch.float16, seed=4)
    scores = (q.unflatten(1, (2, 3)) @ k.transpose(-1, -2)[:, :, None]).flatten(1, 2).float() * 0.25
    visible = (torch.arange(25, device=q.device) + 1) * 4 - 1 <= torch.arange(100, device=q.device)[:, None]
    lse = scores.masked_fill(~visible, float("-inf")).logsumexp(-1)
    lucid = select_blocks(q, k, None, 4, 4, 8, 3, 0.25, "triton", rule="lucidrains")
    paper = select_blocks(q, k, lse, 4, 4, 8, 3, 0.25, "triton")
    assert torch.equal(lucid, select_blocks(q, k, None, 4, 4, 8, 3, 0.25, "reference", rule="lucidrains"))
    assert torch.equal(paper, select_blocks(q, k, lse, 4, 4, 8, 3, 0.25, "reference"))
    chosen = lambda ids: ids.clamp(min=-1).sort(-1).values
    assert (chosen(lucid[..., :3]) != chosen(paper)).any(-1).float().mean() > 0.5


def test_reasons_and_auto(monkeypatch):
    """'auto' takes triton for rule 'lucidrains' where the kernel runs (off CUDA: the CUDA reason
    only); the kernel says why not for what it does not do, and the op refuses what the reference
    refuses first."""
    q, k = grid_case(1, 2, 3, 40, 10, 8, torch.bfloat16, seed=0)
    choice = (q, k, None, 4, 4, 8, 3)
    for softmax_dtype in (None, torch.float32):
        assert bs_mod._triton_reason(*choice, None, "lucidrains", softmax_dtype) is None
    if DEVICE == "cpu":
        monkeypatch.setattr(bs_mod, "why_not_triton_on", lambda device, unsupported, kernels: unsupported())
    assert bs_mod.why_not_triton(*choice, rule="lucidrains") is None
    assert bs_mod.choose_backend(*choice, "auto", None, "lucidrains", torch.float32) == "triton"
    assert not hasattr(bs_mod, "LUCIDRAINS_REASON") and bst.LUCID_THRESHOLD == bs_mod.LUCIDRAINS_THRESHOLD
    lse = torch.zeros(1, 6, 40, device=q.device)
    refused = "rule 'lucidrains' takes no lse, pos (packed documents), group_first or rule 'fla'"
    assert bst.unsupported_reason(q, k, lse, 4, 4, 8, 3, lucid=True) == refused
    assert bst.unsupported_reason(*choice, None, torch.float32, False, True, True) == refused
    assert "with l' / d = 32 (at most 16" in bst.unsupported_reason(q, k, None, 1, 1, 32, 3, lucid=True)
    assert "importance_dtype torch.bfloat16" in bst.unsupported_reason(*choice, None, torch.bfloat16, lucid=True)
    assert bst.unsupported_reason(q, k, None, 3, 4, 8, 3, lucid=True) is None  # l is not read
    with pytest.raises(ValueError, match="rule 'lucidrains' takes no q_offset"):
        bst.select_blocks_forward(*choice, 0.5, q_offset=4, lucid=True)
    with pytest.raises(ValueError, match="rule 'lucidrains' with q_offset"):
        select_blocks(*choice, 0.5, "triton", rule="lucidrains", q_offset=4)


@compiles_here
def test_the_lucidrains_kernel_compiles_for_sm90_without_a_gpu(monkeypatch):
    """The kernel with LUCID (p rounded to bf16, and the float32 softmax; the block means stored
    for the ranking pass or computed again), which the other tests interpret on the CPU, compiles
    for an H100: libdevice's expf and correctly rounded divisions."""
    from test_block_select_op import sm90_ptx

    plain = {"HAS_POS": False, "SUM_ROUND": True, "MAP_UPCAST": False, "GROUP_FIRST": False, "FLA": False, "LUCID": True}
    for p_round, stored in ((True, True), (False, True), (True, False)):
        ptx = sm90_ptx(monkeypatch, **plain, P_ROUND=p_round, KEEP=bst._lucid_keep(torch.bfloat16), STORED=stored)
        assert ".entry select_kernel(" in ptx and re.search(r"\bdiv\.rn\.f32\b", ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("softmax_dtype", [None, torch.float32], ids=["bf16-softmax", "fp32-softmax"])
def test_lucidrains_on_cuda_at_the_seed_shape(softmax_dtype):
    """lucidrains_shared_kv's seed shape (tests/corpus/lucidrains_shared_kv.py make_seed: h 6, G 2,
    Dk 64, d 16, l' 64, n 15) at S 2048 on CUDA, bf16 q and k on the 1/32 grid: 'auto' takes triton,
    and triton and the reference differ in at most 1 row of 500 (their softmax sums run in another
    order; the float32 softmax of CUDA autocast is fp32-softmax); print the count."""
    S, G, h, Dk, d, ls, n = 2048, 2, 6, 64, 16, 64, 15
    q, k = grid_case(2, G, h, S, S // d, Dk, torch.bfloat16, seed=3, device="cuda")
    args = (q, k, None, d, d, ls, n)
    assert bs_mod.choose_backend(*args, "auto", None, "lucidrains", softmax_dtype) == "triton"
    got = {b: select_blocks(*args, Dk**-0.5, b, rule="lucidrains", importance_dtype=softmax_dtype)
           for b in ("triton", "reference")}  # fmt: skip
    rows = 2 * G * S
    differ = int((got["triton"] != got["reference"]).any(-1).sum())
    print(f"softmax {softmax_dtype}: {differ} of {rows} rows differ")
    assert differ <= rows // 500, f"triton against reference: {differ} of {rows} rows differ"
