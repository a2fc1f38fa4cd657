"""The Triton sliding-window kernels (nsa_compile/ops/window_triton.py) against the reference
backend of nsa::window_attention, on CUDA when there is one, else on the CPU through Triton's
interpreter (TRITON_INTERPRET=1 for this module only, set by a module fixture and restored after
it; the kernels are built lazily, so they are built interpreted here).

Tiny odd sizes: the interpreter runs every program instance in Python. Tiles are shrunk where a
case needs several of them (more key tiles than one window, several query tiles per key tile).
"""

import pytest
import torch
from oracles import (
    assert_backend_matches_reference, assert_kernel_matches_reference, attention_inputs, run_without_triton,
    triton_interpreter,
)
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

pytest.importorskip("triton")

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


def reference(q, k, v, grad_o, window, scale):
    """o, dq, dk, dv of the reference backend in float32 (and its lse)."""
    q, k, v, grad_o = (x.float() for x in (q, k, v, grad_o))
    o, lse = window_mod._reference_forward(q, k, v, window, scale)
    return (o, *window_mod._reference_backward(grad_o, q, k, v, window, scale)), lse


def run(q, k, v, grad_o, window, scale, tiles=None):
    o, lse = wt.window_forward(q, k, v, window, scale, tiles=tiles)
    return (o, *wt.window_backward(grad_o, q, k, v, o, lse, window, scale, tiles=tiles)), lse


CASES = [  # S, h, G, dk, dv, window, dtype
    (37, 3, 2, 16, 16, 5, torch.float32),  # GQA h 3, a window inside a tile
    (45, 1, 1, 24, 8, 16, torch.float32),  # h 1, head dims not powers of two, Dk != Dv
    (50, 2, 2, 16, 16, 100, torch.float32),  # a window longer than S: causal attention
    (41, 2, 1, 16, 16, 1, torch.float32),  # window 1: each query sees only itself
    (39, 4, 2, 16, 16, 17, torch.bfloat16),
    (33, 2, 2, 32, 32, 9, torch.float16),
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
    assert "packed documents" in wt.unsupported_reason(q, k, v, torch.zeros(B, 4, dtype=torch.int64))
    assert "dtype" in wt.unsupported_reason(q.double(), k.double(), v.double())
    assert "head dim" in wt.unsupported_reason(q.new_zeros(B, 2, 4, 300), k.new_zeros(B, 1, 4, 300), v)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "device cpu" in wt.unsupported_reason(q, k, v)
        with pytest.raises(ValueError, match="device cpu"):
            wt.window_forward(q, k, v, 2, 0.5)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the kernel tests launch the compiled kernels")
def test_the_kernels_compile_for_sm90_without_a_gpu(monkeypatch):
    """The compiled path, which the interpreted tests here never take: the forward and the dq
    kernel, their attention_tiles helpers and the reductions built as on the GPU (TRITON_INTERPRET
    off at launch) and compiled to PTX for an H100 by the Triton installed here (bf16, h 6, D 64:
    the seed's tiles)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tiles = wt._tiles(64, 64, False)
    consts = {"HPG": 6, "DK": 64, "DV": 64, "DK_P": 64, "DV_P": 64, "PREC": "tf32", "UPCAST": False}
    for kernel, cfg in ((wt.fwd_kernel, tiles["fwd"]), (wt.dq_kernel, tiles["dq"])):
        fn = kernel.built()
        signature = {p.name: "constexpr" if p.is_constexpr else "*bf16" if p.name in ("Q", "K", "V", "O", "DO", "DQ")
                     else "*fp32" if p.name in ("LSE", "DELTA") else "fp32" if "scale" in p.name else "i32"
                     for p in fn.params}  # fmt: skip
        given = consts | {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
        compiled = triton.compile(ASTSource(fn, signature, {n: v for n, v in given.items() if n in signature}),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        assert f".entry {kernel.__name__}(" in compiled.asm["ptx"]


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
