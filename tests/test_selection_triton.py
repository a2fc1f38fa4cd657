"""The Triton selected-attention kernels (nsa_compile/ops/selection_triton.py) against the
reference backend of nsa::selected_attention, on CUDA when there is one, else on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set by a module fixture for this module only and
restored after it; the kernels are built lazily, so they are built interpreted here).

Tiny odd sizes: the interpreter runs every program instance in Python.
"""

import pytest
import torch
from oracles import (
    assert_backend_matches_reference, assert_kernel_matches_reference, assert_lse_close, attention_inputs,
    run_without_triton, triton_interpreter,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)
from oracles import random_block_idx as _random_block_idx

pytest.importorskip("triton")

from nsa_compile.ops import selection as sel_ref
from nsa_compile.ops import selection_triton as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, DK = 2, 16


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    """On a machine without CUDA: TRITON_INTERPRET=1 while this module runs."""
    with triton_interpreter(on=DEVICE == "cpu"):
        yield


def random_block_idx(b, g, S, n, block_size, seed):
    """A random valid selection [b, g, S, n] on DEVICE (oracles.random_block_idx)."""
    return _random_block_idx(b, g, S, n, block_size, seed, DEVICE)


def make_inputs(S, h, g, dv, dtype, seed, dk=DK):
    """q, k, v as [B, S, heads, D] memory viewed [B, heads, S, D] (non-contiguous), grad_o."""
    return [x.to(DEVICE) for x in attention_inputs(B, S, h, g, dk, dv, dtype, seed)]


def reference_lse(q, k, block_idx, block_size, scale):
    """Dense log-sum-exp over each row's selected tokens, counted with multiplicity."""
    _, H, S, _ = q.shape
    G = k.shape[1]
    h = H // G
    s = torch.arange(S, device=q.device)
    blk = block_idx[..., None]  # [B, G, S, n, 1]
    hit = (blk >= 0) & (s // block_size == blk) & (s <= s[:, None, None])  # [B, G, S, n, S]
    mult = hit.sum(3).double().repeat_interleave(h, dim=1)  # [B, H, S, S]
    kk = k.double().repeat_interleave(h, dim=1)
    scores = q.double() @ kk.transpose(-1, -2) * scale + mult.log()
    return torch.logsumexp(scores, dim=-1)


def reference(q, k, v, grad_o, block_idx, block_size, scale):
    """o, dq, dk, dv of the reference backend in float32 at the same inputs."""
    f = lambda x: x.float()
    o, _ = sel_ref._reference_forward(f(q), f(k), f(v), block_idx, block_size, scale)
    return (o, *sel_ref._reference_backward(f(grad_o), f(q), f(k), f(v), block_idx, block_size, scale))


def run_triton(q, k, v, grad_o, block_idx, block_size, scale):
    o, lse = st.selected_forward(q, k, v, block_idx, block_size, scale)
    dq, dk, dv = st.selected_backward(grad_o, q, k, v, o, lse, block_idx, block_size, scale)
    return o, lse, dq, dk, dv


def check_lse(lse, q, k, idx, block_size, scale, what):
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    assert_lse_close(lse, reference_lse(q, k, idx, block_size, scale), tol, what)


# S, h, G, block_size, n, Dv, dtype
CASES = [
    (1, 1, 2, 4, 2, 8, torch.float32),
    (7, 3, 2, 4, 3, 24, torch.float32),
    (33, 4, 1, 8, 4, 8, torch.float32),
    (33, 1, 2, 8, 2, 24, torch.float32),
    (33, 3, 2, 4, 3, 8, torch.float32),
    (33, 3, 2, 8, 3, 24, torch.bfloat16),
    (7, 4, 1, 4, 4, 8, torch.bfloat16),
    (33, 1, 1, 4, 4, 24, torch.float16),
]


@pytest.mark.parametrize("S,h,G,block_size,n,dv,dtype", CASES, ids=[str(c).replace(" ", "") for c in CASES])
def test_matches_reference(S, h, G, block_size, n, dv, dtype):
    seed = S * 31 + h * 7 + G + n
    q, k, v, grad_o = make_inputs(S, h, G, dv, dtype, seed)
    idx = random_block_idx(B, G, S, n, block_size, seed).clone()
    if S > 8:
        idx[1, G - 1, S - 2, :2] = idx[1, G - 1, S - 2, 1].item()  # a duplicated block: counts twice
    scale = DK**-0.5
    o, lse, *grads = run_triton(q, k, v, grad_o, idx, block_size, scale)
    ref = reference(q, k, v, grad_o, idx, block_size, scale)
    assert_kernel_matches_reference((o, *grads), ref, dtype, f"S={S} h={h} G={G}")
    check_lse(lse, q, k, idx, block_size, scale, f"S={S} h={h} G={G}")
    assert (idx == -1).any()  # the first tokens have fewer than n candidate blocks


def test_edge_rows_and_block_sizes_not_power_of_two():
    """Hand-built rows (all -1, only a later block, a block past the end, a duplicate) and block
    sizes that are not powers of two, one above 64 (two K/V chunks per block)."""
    S, h, G, dv = 33, 2, 2, 8
    q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=5)
    for block_size, n in ((20, 2), (80, 1), (6, 3)):
        idx = random_block_idx(B, G, S, n, block_size, seed=block_size).clone()
        idx[0, 1, 5] = -1  # no block: empty row
        idx[1, 0, 10, 0] = 3  # only a block after t = 10 (past the end of S for l' >= 20): empty
        idx[1, 0, 10, 1:] = -1
        idx[0, 0, S - 1, :] = idx[0, 0, S - 1, 0].item()  # the same block n times (CUDA refuses an overlapping copy)
        o, lse, dq, dk, dv_ = run_triton(q, k, v, grad_o, idx, block_size, 0.3)
        ref = reference(q, k, v, grad_o, idx, block_size, 0.3)
        assert_kernel_matches_reference((o, dq, dk, dv_), ref, torch.float32, f"l'={block_size}")
        check_lse(lse, q, k, idx, block_size, 0.3, f"l'={block_size}")
        for b, g, t in ((0, 1, 5), (1, 0, 10)):
            heads = slice(g * h, (g + 1) * h)
            assert torch.equal(o[b, heads, t], torch.zeros_like(o[b, heads, t]))
            assert torch.equal(dq[b, heads, t], torch.zeros_like(dq[b, heads, t]))
            assert lse[b, heads, t].isneginf().all()


@pytest.mark.parametrize("tq,rows", [(1, 16), (3, 16), (5, 32)])
def test_query_tiles_any_order_and_repeats(tq, rows):
    """The forward and dq kernels at other query tiles (TQ queries per program: 1 reads each
    query's own list, more read the tile's union), on lists in any order with repeats that are
    not adjacent (each counts as often as it appears)."""
    S, h, G, block_size, n, dv = 29, 3, 2, 4, 4, 8
    q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=tq)
    idx = random_block_idx(B, G, S, n, block_size, seed=tq).clone()
    idx = idx.gather(-1, torch.rand(idx.shape, generator=torch.Generator().manual_seed(tq)).argsort(-1).to(DEVICE))
    idx[0, 0, S - 3, 2] = idx[0, 0, S - 3, 0].item()  # a repeat, not next to its first copy
    idx[1, 1, 12] = torch.tensor([2, -1, 2, 0])  # another, with padding between
    tiles = {kernel: {"TQ": tq, "ROWS": rows} for kernel in ("fwd", "dq")}
    o, lse = st.selected_forward(q, k, v, idx, block_size, 0.4, tiles=tiles)
    dq, dk, dv_ = st.selected_backward(grad_o, q, k, v, o, lse, idx, block_size, 0.4, tiles=tiles)
    ref = reference(q, k, v, grad_o, idx, block_size, 0.4)
    assert_kernel_matches_reference((o, dq, dk, dv_), ref, torch.float32, f"TQ={tq}")
    check_lse(lse, q, k, idx, block_size, 0.4, f"TQ={tq}")


def test_all_padding_and_no_blocks_give_zeros():
    q, k, v, grad_o = make_inputs(9, 3, 1, 8, torch.float32, seed=2)
    for n in (0, 2):
        idx = torch.full((B, 1, 9, n), -1, dtype=torch.int64, device=DEVICE)
        o, lse, *grads = run_triton(q, k, v, grad_o, idx, 4, 0.5)
        assert lse.isneginf().all()
        for x in (o, *grads):
            assert torch.equal(x, torch.zeros_like(x))


def test_dkdv_split_into_segments_is_exact_and_deterministic(monkeypatch):
    """Blocks chosen by more than DKV_SEGMENT queries are split over several work items whose
    fp32 partials are summed in a fixed order: same result, bit for bit on a rerun."""
    monkeypatch.setattr(st, "DKV_SEGMENT", 3)
    S, h, G, block_size, n = 33, 3, 2, 8, 3
    q, k, v, grad_o = make_inputs(S, h, G, 24, torch.float32, seed=8)
    idx = random_block_idx(B, G, S, n, block_size, seed=8)
    first = run_triton(q, k, v, grad_o, idx, block_size, 0.25)
    ref = reference(q, k, v, grad_o, idx, block_size, 0.25)
    assert_kernel_matches_reference((first[0], *first[2:]), ref, torch.float32, "segments")
    again = run_triton(q, k, v, grad_o, idx, block_size, 0.25)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_many_heads_and_wide_head_dims():
    """h = 65 > the largest head tile (several head tiles per token; (query, head) pairs of the
    dk/dv kernel span queries), and head dims > 128 that are not powers of two, Dk != Dv."""
    for S, h, G, dk, dv in ((5, 65, 1, 16, 8), (9, 2, 1, 200, 136)):
        q, k, v, grad_o = make_inputs(S, h, G, dv, torch.float32, seed=h, dk=dk)
        idx = random_block_idx(B, G, S, 2, 4, seed=h)
        ours = run_triton(q, k, v, grad_o, idx, 4, dk**-0.5)
        ref = reference(q, k, v, grad_o, idx, 4, dk**-0.5)
        assert_kernel_matches_reference((ours[0], *ours[2:]), ref, torch.float32, f"h={h} dk={dk}")


def test_unsupported_reason(monkeypatch):
    q, k, v, _ = make_inputs(4, 2, 1, 8, torch.float32, seed=0)
    idx = random_block_idx(B, 1, 4, 2, 4, seed=0)
    assert st.unsupported_reason(q, k, v, idx, 4) is None
    assert "dtype" in st.unsupported_reason(q.double(), k.double(), v.double(), idx, 4)
    assert "dtype" in st.unsupported_reason(q, k, v.half(), idx, 4)
    assert "head dim" in st.unsupported_reason(q.new_zeros(B, 2, 4, 300), k.new_zeros(B, 1, 4, 300), v, idx, 4)
    assert "int64" in st.unsupported_reason(q, k, v, idx.int(), 4)
    assert "block_size" in st.unsupported_reason(q, k, v, idx, 0)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "device cpu" in st.unsupported_reason(q, k, v, idx, 4)
        with pytest.raises(ValueError, match="device cpu"):
            st.selected_forward(q, k, v, idx, 4, 0.5)


def test_module_imports_without_triton():
    out = run_without_triton(
        "import torch\n"
        "from nsa_compile.ops import selection_triton as st\n"
        "x = torch.zeros(1, 1, 4, 8)\n"
        "print(st.unsupported_reason(x, x, x, torch.zeros(1, 1, 4, 1, dtype=torch.int64), 4))\n"
    )
    assert "triton is not installed" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_with_backend_triton_matches_backend_reference_through_autograd(dtype):
    """The op's plumbing around the kernels: (o, lse) saved for the backward, the layouts the
    fakes promise, gradients for q, k, v; against the reference backend on the same inputs."""
    S, h, g, n, ls = 23, 3, 2, 3, 4
    q, k, v, grad_o = make_inputs(S, h, g, 8, dtype, seed=11)
    idx = random_block_idx(B, g, S, n, ls, seed=11)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_backend_matches_reference(torch.ops.nsa.selected_attention, "triton", q, k, v, grad_o, idx, ls, 0.4,
                                     rtol=tol, atol=tol)


def test_jit_builds_each_mode_with_that_modes_helpers_and_reductions(monkeypatch):
    """triton_support.jit: a module-level kernel is handed to triton.jit per mode, read from
    TRITON_INTERPRET at first use (set after import here), and kept. Compiled, the helpers it
    calls are their compiled objects and the reductions tl.max / tl.sum themselves (what
    @triton.jit at module level would see; the GPU tests launch them); interpreted, their
    interpreted objects and tl.reduce stand-ins. The kernel module's own globals stay as written."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from nsa_compile.ops import attention_tiles
    from nsa_compile.ops.triton_support import reduce_max, reduce_min, reduce_sum

    built = {}
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        built[interpret] = st.fwd_kernel.built()
        assert st.fwd_kernel.built() is built[interpret]  # kept
        update = attention_tiles.softmax_update.built()
        assert built[interpret].fn.__globals__["softmax_update"] is update
        if interpret == "0":
            assert (reduce_max.built(), reduce_min.built(), reduce_sum.built()) == (tl.max, tl.min, tl.sum)
            assert update.fn.__globals__["reduce_max"] is tl.max
        else:
            assert not {reduce_max.built(), reduce_min.built(), reduce_sum.built()} & {tl.max, tl.min, tl.sum}
            assert update.fn.__globals__["reduce_max"] is not tl.max
    assert isinstance(built["0"], JITFunction) and isinstance(built["1"], InterpretedFunction)
    assert st.softmax_update is attention_tiles.softmax_update and attention_tiles.reduce_max is reduce_max
