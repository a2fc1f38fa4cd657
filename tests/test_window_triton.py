"""The Triton sliding-window kernels (nsa_compile/ops/window_triton.py) against the reference
backend of nsa::window_attention, on CUDA when there is one, else on the CPU through Triton's
interpreter (TRITON_INTERPRET=1 for this module only, set by a module fixture and restored after
it; the kernels are built lazily, so they are built interpreted here).

Tiny odd sizes: the interpreter runs every program instance in Python. Tiles are shrunk where a
case needs several of them (more key tiles than one window, several query tiles per key tile).
Packed documents (pos) are run against the reference backend with the same pos.
"""

import itertools

import pytest
import torch
from oracles import (
    assert_backend_matches_reference, assert_kernel_matches_reference, attention_inputs, run_without_triton,
    triton_interpreter,
)
from helpers import random_lengths
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

pytest.importorskip("triton")

from nsa_compile.models import positions_from_cu_seqlens
from nsa_compile.ops import window as window_mod
from nsa_compile.ops import window_triton as wt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B = 2
SMALL = {kernel: {"BLOCK_M": 16, "BLOCK_N": 16} for kernel in ("fwd", "dkdv", "dq")}


@pytest.fixture(autouse=True, scope="module")
def interpreter_on_cpu():
    """On a machine without CUDA: TRITON_INTERPRET=1 while this module runs."""
    with triton_interpreter(on=DEVICE == "cpu"):
        yield


def make_inputs(S, h, G, dk, dv, dtype, seed):
    return [x.to(DEVICE) for x in attention_inputs(B, S, h, G, dk, dv, dtype, seed)]


def reference(q, k, v, grad_o, window, scale, pos=None):
    """o, dq, dk, dv of the reference backend in float32 (and its lse)."""
    q, k, v, grad_o = (x.float() for x in (q, k, v, grad_o))
    o, lse = window_mod._reference_forward(q, k, v, window, scale, pos=pos)
    return (o, *window_mod._reference_backward(grad_o, q, k, v, window, scale, pos=pos)), lse


def run(q, k, v, grad_o, window, scale, tiles=None, pos=None):
    o, lse = wt.window_forward(q, k, v, window, scale, pos, tiles=tiles)
    return (o, *wt.window_backward(grad_o, q, k, v, o, lse, window, scale, pos, tiles=tiles)), lse


def positions(*rows):
    """pos [len(rows), S] on DEVICE: each row packed with documents of the given lengths (each
    row's lengths sum to S)."""
    return torch.stack([positions_from_cu_seqlens(torch.tensor([0, *itertools.accumulate(r)]), sum(r))
                        for r in rows]).to(DEVICE)


CASES = [  # S, h, G, dk, dv, window, dtype
    (37, 3, 2, 16, 16, 5, torch.float32),  # GQA h 3, a window inside a tile
    (45, 1, 1, 24, 8, 16, torch.float32),  # h 1, head dims not powers of two, Dk != Dv
    (50, 2, 2, 16, 16, 100, torch.float32),  # a window longer than S: causal attention
    (41, 2, 1, 16, 16, 1, torch.float32),  # window 1: each query sees only itself
    (39, 4, 2, 16, 16, 17, torch.bfloat16),
    (33, 2, 2, 32, 32, 9, torch.float16),
    # window 40 over tiles of 16: key tiles inside every row's window and before the diagonal
    # (the unmasked interior loop) between masked ones on both sides
    (100, 2, 1, 16, 16, 40, torch.float32),
    (90, 3, 1, 16, 16, 40, torch.bfloat16),
]


@pytest.mark.parametrize("S,h,G,dk,dv,window,dtype", CASES, ids=[str(c).replace(" ", "") for c in CASES])
def test_matches_reference(S, h, G, dk, dv, window, dtype):
    q, k, v, grad_o = make_inputs(S, h, G, dk, dv, dtype, seed=S + window)
    scale = dk**-0.5
    ours, lse = run(q, k, v, grad_o, window, scale, tiles=SMALL)
    ref, ref_lse = reference(q, k, v, grad_o, window, scale)
    assert_kernel_matches_reference(ours, ref, dtype, f"S={S} h={h} w={window}")
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_a_window_past_the_int32_range_is_causal_attention():
    """The kernels compute their tile bounds in int32: a window longer than S is passed as S (the
    same attention), so a huge one cannot wrap around."""
    q, k, v, grad_o = make_inputs(35, 2, 1, 16, 16, torch.float32, seed=7)
    huge, huge_lse = run(q, k, v, grad_o, 2**31 + 5, 0.25, tiles=SMALL)
    causal, causal_lse = run(q, k, v, grad_o, 35, 0.25, tiles=SMALL)
    assert all(torch.equal(a, b) for a, b in zip(huge, causal)) and torch.equal(huge_lse, causal_lse)
    ref, _ = reference(q, k, v, grad_o, 2**31 + 5, 0.25)
    assert_kernel_matches_reference(huge, ref, torch.float32, "huge window")


def test_default_tiles_match_the_small_tiles():
    """The default tiles (one tile spans the whole short sequence) against the shrunk ones."""
    q, k, v, grad_o = make_inputs(70, 2, 2, 16, 16, torch.float32, seed=3)
    default, _ = run(q, k, v, grad_o, 20, 0.25)
    small, _ = run(q, k, v, grad_o, 20, 0.25, tiles=SMALL)
    for a, b in zip(default, small):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_backward_is_bitwise_repeatable():
    q, k, v, grad_o = make_inputs(40, 3, 2, 16, 16, torch.bfloat16, seed=4)
    first, _ = run(q, k, v, grad_o, 12, 0.3, tiles=SMALL)
    second, _ = run(q, k, v, grad_o, 12, 0.3, tiles=SMALL)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_empty_batch_and_sequence():
    for shape in ((0, 10), (2, 0)):
        b, S = shape
        q = torch.zeros(b, 4, S, 16, device=DEVICE)
        k = v = torch.zeros(b, 2, S, 16, device=DEVICE)
        o, lse = wt.window_forward(q, k, v, 4, 0.5)
        dq, dk, dv = wt.window_backward(o, q, k, v, o, lse, 4, 0.5)
        assert o.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape and dv.shape == v.shape


def test_unsupported_reason(monkeypatch):
    q, k, v, _ = make_inputs(4, 2, 1, 16, 16, torch.float32, seed=0)
    assert wt.unsupported_reason(q, k, v) is None
    assert wt.unsupported_reason(q, k, v, positions([1, 3], [4])) is None  # packed documents run
    assert "dtype" in wt.unsupported_reason(q.double(), k.double(), v.double())
    assert "head dim" in wt.unsupported_reason(q.new_zeros(B, 2, 4, 300), k.new_zeros(B, 1, 4, 300), v)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "device cpu" in wt.unsupported_reason(q, k, v)
        assert "device cpu" in wt.unsupported_reason(q, k, v, positions([1, 3], [4]))
        with pytest.raises(ValueError, match="device cpu"):
            wt.window_forward(q, k, v, 2, 0.5)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the kernel tests launch the compiled kernels")
def test_the_kernels_compile_for_sm90_without_a_gpu(monkeypatch):
    """The compiled path, which the interpreted tests here never take: the forward and the dq
    kernel, their attention_tiles helpers and the reductions built as on the GPU (TRITON_INTERPRET
    off at launch) and compiled to PTX for an H100 by the Triton installed here (bf16, h 6, D 64:
    the seed's tiles), without pos (POS None, a constexpr) and with it (an int64 pointer): the
    kernel without pos has no POS parameter, the one with pos loads it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tiles = wt._tiles(64, 64, False)
    consts = {"HPG": 6, "DK": 64, "DV": 64, "DK_P": 64, "DV_P": 64, "PREC": "tf32", "UPCAST": False}
    for (kernel, cfg), has_pos in itertools.product(((wt.fwd_kernel, tiles["fwd"]), (wt.dq_kernel, tiles["dq"])),
                                                    (False, True)):
        fn = kernel.built()
        signature = {p.name: "constexpr" if p.is_constexpr else "*bf16" if p.name in ("Q", "K", "V", "O", "DO", "DQ")
                     else "*fp32" if p.name in ("LSE", "DELTA") else "fp32" if "scale" in p.name else "i32"
                     for p in fn.params}  # fmt: skip
        signature["POS"] = "*i64" if has_pos else "constexpr"
        given = consts | {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "HAS_POS": has_pos, "POS": None}
        compiled = triton.compile(ASTSource(fn, signature, {n: v for n, v in given.items()
                                                            if signature.get(n) == "constexpr"}),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        ptx = compiled.asm["ptx"]
        assert f".entry {kernel.__name__}(" in ptx
        assert ("ld.global.b64" in ptx or "ld.global.v2.b64" in ptx) == has_pos, (kernel.__name__, has_pos)


def test_module_imports_without_triton():
    out = run_without_triton(
        "import torch\n"
        "from nsa_compile.ops import window_triton as wt\n"
        "x = torch.zeros(1, 1, 4, 8)\n"
        "print(wt.unsupported_reason(x, x, x))\n"
    )
    assert "triton is not installed" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_with_backend_triton_matches_backend_reference_through_autograd(dtype):
    """The op's plumbing around the kernels: (o, lse) saved for the backward, the layouts the
    fakes promise, gradients for q, k, v; against the reference backend on the same inputs."""
    q, k, v, grad_o = make_inputs(27, 3, 2, 16, 8, dtype, seed=11)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_backend_matches_reference(torch.ops.nsa.window_attention, "triton", q, k, v, grad_o, 6, 0.4,
                                     rtol=tol, atol=tol)


@pytest.mark.gpu
def test_auto_takes_the_kernels_on_cuda_in_bf16_and_they_match_the_float64_reference():
    """On a real GPU: the window pass's 'auto' picks triton for the model's bf16 layout, and its
    output and gradients are within the parity bar of the float64 reference (3x the reference
    backend's own bf16 error, nsa_compile.parity's factor for half precision)."""
    from nsa_compile.parity import FACTORS

    q, k, v, grad_o = make_inputs(300, 6, 2, 64, 64, torch.bfloat16, seed=9)
    assert window_mod.choose_backend(q, k, v) == "triton"
    ours, _ = run(q, k, v, grad_o, 100, 0.125)
    in_dtype = (window_mod._reference_forward(q, k, v, 100, 0.125)[0],
                *window_mod._reference_backward(grad_o, q, k, v, 100, 0.125))
    q64, k64, v64, g64 = (x.double() for x in (q, k, v, grad_o))
    oracle = (window_mod._reference_forward(q64, k64, v64, 100, 0.125)[0],
              *window_mod._reference_backward(g64, q64, k64, v64, 100, 0.125))
    for name, a, e, r in zip(("o", "dq", "dk", "dv"), ours, in_dtype, oracle):
        err, bar = (a.double() - r).norm() / r.norm(), (e.double() - r).norm() / r.norm()
        assert err <= FACTORS[torch.bfloat16] * bar, f"{name}: {err:.2e} vs eager's {bar:.2e}"


# --- packed documents (pos) ---------------------------------------------------------------------

# S 37..70, two rows each: documents of 1 token, shorter than a tile (16), longer than the window,
# starting inside and at the edges of tiles; a row of one document
PACKED_CASES = [  # rows of document lengths, h, G, dk, dv, window, dtype
    (([1, 20, 7, 25], [40, 3, 1, 9]), 3, 2, 16, 16, 9, torch.float32),
    (([16, 1, 32, 4], [53]), 2, 1, 24, 8, 100, torch.float32),  # window past S: causal per document
    (([5, 1, 31], [12, 12, 13]), 1, 1, 16, 16, 1, torch.float32),  # window 1
    (([2, 29, 1, 15, 23], [70]), 4, 2, 16, 16, 17, torch.bfloat16),
    (([33, 1, 7], [1, 1, 39]), 2, 2, 32, 32, 12, torch.float16),
    # window 40 over tiles of 16 (interior key tiles): documents starting inside a query tile
    # take the tile's latest start as the interior's first key; a tile inside one long document not
    (([30, 3, 45, 22], [100]), 2, 1, 16, 16, 40, torch.float32),
    (([7, 61, 32], [50, 50]), 2, 2, 16, 16, 40, torch.bfloat16),
]


@pytest.mark.parametrize("rows,h,G,dk,dv,window,dtype", PACKED_CASES,
                         ids=[str(c).replace(" ", "") for c in PACKED_CASES])
def test_packed_documents_match_the_reference(rows, h, G, dk, dv, window, dtype):
    """Forward and backward with pos against the reference backend with the same pos, with the
    small tiles (several query and key tiles, documents crossing them) and the default ones."""
    pos = positions(*rows)
    S = pos.shape[1]
    q, k, v, grad_o = make_inputs(S, h, G, dk, dv, dtype, seed=S + window + h)
    scale = dk**-0.5
    ref, ref_lse = reference(q, k, v, grad_o, window, scale, pos)
    for tiles in (SMALL, None):
        ours, lse = run(q, k, v, grad_o, window, scale, tiles=tiles, pos=pos)
        assert_kernel_matches_reference(ours, ref, dtype, f"rows={rows} w={window} tiles={tiles}")
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if window > 1:  # the mask is live: without pos the same inputs give other results
        unpacked, _ = run(q, k, v, grad_o, window, scale, tiles=SMALL)
        assert not torch.allclose(unpacked[0].float(), ref[0], rtol=1e-2, atol=1e-2)


def test_packed_dkdv_walks_up_to_the_last_query_tile_that_sees_the_keys():
    """dk/dv stop below the query tiles whose rows all start their documents after the key tile
    (the next document's queries), found by a downward scan, so a row high in the window whose
    document starts early still counts: a document of 16 then one of 30, window 40, tiles of 16,
    and row 48 given pos 48 (its document starts at 0: it sees keys 9..15 of the first tile,
    past two query tiles that see none)."""
    pos = positions([16, 30, 10], [56]).clone()
    pos[0, 48] = 48
    q, k, v, grad_o = make_inputs(56, 2, 1, 16, 16, torch.float32, seed=5)
    ref, ref_lse = reference(q, k, v, grad_o, 40, 0.25, pos)
    ours, lse = run(q, k, v, grad_o, 40, 0.25, tiles=SMALL, pos=pos)
    assert_kernel_matches_reference(ours, ref, torch.float32, "row 48 from document start 0")
    without, _ = run(q, k, v, grad_o, 40, 0.25, tiles=SMALL, pos=positions([16, 30, 10], [56]))
    assert not torch.allclose(without[2][0, 0, 9:16], ours[2][0, 0, 9:16])  # row 48 adds to those keys' dk


def test_packed_row_of_one_document_is_bitwise_the_unpacked_kernel():
    """pos = 0..S-1 (one document per row) masks nothing: the same bits as without pos."""
    q, k, v, grad_o = make_inputs(45, 3, 1, 16, 16, torch.bfloat16, seed=21)
    one = torch.arange(45, device=DEVICE).expand(B, 45)
    packed, packed_lse = run(q, k, v, grad_o, 13, 0.25, tiles=SMALL, pos=one)
    plain, plain_lse = run(q, k, v, grad_o, 13, 0.25, tiles=SMALL)
    assert all(torch.equal(a, b) for a, b in zip(packed, plain)) and torch.equal(packed_lse, plain_lse)


def test_packed_row_without_a_key_gives_zeros_and_no_nan():
    """A row whose document starts after it (pos[t] < 0: not a position, the only way a row of
    the window sees no key) gets o 0, lse -inf, zero dq and adds nothing to dk, dv; the other rows
    are those of the reference backend, where that row's grad_o is 0 (the reference itself gives
    NaN on such a row: a softmax over nothing)."""
    pos = positions([20, 1, 18], [39]).clone()
    empty = [(0, 5), (0, 20), (1, 30)]  # inside a document, a document of one token, a single-document row
    for b, t in empty:
        pos[b, t] = -1
    q, k, v, grad_o = make_inputs(39, 2, 2, 16, 16, torch.float32, seed=3)
    ours, lse = run(q, k, v, grad_o, 10, 0.3, tiles=SMALL, pos=pos)
    valid_pos, quiet_grad = pos.clone(), grad_o.clone()
    for b, t in empty:
        valid_pos[b, t] = 0  # any valid start: the row's output is not compared, its gradient is 0
        quiet_grad[b, :, t] = 0
    ref, ref_lse = reference(q, k, v, quiet_grad, 10, 0.3, valid_pos)
    for x in (*ours, lse):
        assert not x.isnan().any()
    for b, t in empty:
        assert lse[b, :, t].isneginf().all()
        assert torch.equal(ours[0][b, :, t], torch.zeros_like(ours[0][b, :, t]))
        assert torch.equal(ours[1][b, :, t], torch.zeros_like(ours[1][b, :, t]))
        ref[0][b, :, t] = 0
        ref[1][b, :, t] = 0
        ref_lse[b, :, t] = float("-inf")
    assert_kernel_matches_reference(ours, ref, torch.float32, "rows without a key")
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_packed_backward_is_bitwise_repeatable():
    pos = positions([11, 1, 28], [3, 37])
    q, k, v, grad_o = make_inputs(40, 3, 1, 16, 16, torch.bfloat16, seed=6)
    first, _ = run(q, k, v, grad_o, 12, 0.3, tiles=SMALL, pos=pos)
    second, _ = run(q, k, v, grad_o, 12, 0.3, tiles=SMALL, pos=pos)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_packed_op_with_backend_triton_matches_backend_reference_through_autograd():
    """The op with pos, backend triton named, against backend reference (the pos argument reaches
    the kernels through the op's forward and backward)."""
    pos = positions([4, 1, 22], [27])
    q, k, v, grad_o = make_inputs(27, 3, 2, 16, 8, torch.float32, seed=12)

    def op(q, k, v, window, scale, pos, backend):  # the helper passes backend last
        return torch.ops.nsa.window_attention(q, k, v, window, scale, backend, pos)

    assert_backend_matches_reference(op, "triton", q, k, v, grad_o, 6, 0.4, pos, rtol=1e-4, atol=1e-4)


def test_auto_takes_triton_with_packed_documents(monkeypatch):
    """auto with pos: on (fake) CUDA tensors in fp16/bf16, triton (before flash: no host sync), and
    reference in fp32 as without pos; on the CPU the kernels' own reason is None for valid pos,
    and auto's reason the device."""
    import nsa_compile.ops.flash

    monkeypatch.setattr(nsa_compile.ops.flash, "unsupported_reason", lambda q, k, v: None)  # flash as on a GPU
    with torch._subclasses.fake_tensor.FakeTensorMode():
        def cuda(shape, dtype):
            return torch.empty(shape, dtype=dtype, device="cuda")

        pos = cuda((1, 8), torch.int64)
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = cuda((1, 4, 8, 16), dtype), cuda((1, 2, 8, 16), dtype), cuda((1, 2, 8, 16), dtype)
            assert window_mod.why_not_triton(q, k, v, pos) is None
            assert window_mod.choose_backend(q, k, v, "auto", pos) == "triton"
        q, k, v = (x.float() for x in (q, k, v))
        assert "fp16/bf16 only" in window_mod.why_not_triton(q, k, v, pos)
    q, k, v, _ = make_inputs(8, 2, 1, 16, 16, torch.bfloat16, seed=0)
    pos = positions([3, 5], [8])
    assert wt.unsupported_reason(q, k, v, pos) is None
    if DEVICE == "cpu":
        assert "on CUDA (tensors on cpu)" in window_mod.why_not_triton(q, k, v, pos)
        assert window_mod.choose_backend(q, k, v, "triton", pos) == "triton"  # named: the interpreter runs it
    else:
        assert window_mod.choose_backend(q, k, v, "auto", pos) == "triton"


@pytest.mark.gpu
def test_packed_seed_shape_on_cuda_matches_the_reference():
    """The seed's shape on the GPU: S 2048, documents of 100..800 tokens, bf16, h 6, G 2, D 64,
    window 512; auto takes triton with pos; output, lse and gradients against the reference
    backend with the same pos (run in fp32 on the same bf16 inputs), and the backward repeats
    bit for bit."""
    rows = [random_lengths(2048, 100, 800, seed=2048 + b) for b in range(B)]
    pos = positions(*rows)
    q, k, v, grad_o = make_inputs(2048, 6, 2, 64, 64, torch.bfloat16, seed=20)
    assert window_mod.choose_backend(q, k, v, "auto", pos) == "triton"
    ours, lse = run(q, k, v, grad_o, 512, 0.125, pos=pos)
    ref, ref_lse = reference(q, k, v, grad_o, 512, 0.125, pos)
    assert_kernel_matches_reference(ours, ref, torch.bfloat16, f"seed packed {rows}")
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    again, _ = run(q, k, v, grad_o, 512, 0.125, pos=pos)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))


@pytest.mark.gpu
def test_packed_kernels_sync_nothing_and_capture_in_a_cuda_graph():
    """With pos, forward and backward read no value back to the host (torch's sync debug mode
    set to raise) and replay from a CUDA graph with the eager call's bits."""
    pos = positions([1, 120, 33, 146], [300], [7, 7, 286])[:B]
    q, k, v, grad_o = make_inputs(300, 6, 2, 64, 64, torch.bfloat16, seed=30)

    def step():
        o, lse = wt.window_forward(q, k, v, 64, 0.125, pos)
        return (o, lse, *wt.window_backward(grad_o, q, k, v, o, lse, 64, 0.125, pos))

    eager = step()  # the first call builds the kernels
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
