"""tools/kernel_resources.py: kernels compiled for sm_90 on the CPU from captured launches, read
with cuobjdump; and one fact it established, kept: block selection's rounded-importance variant
(what training under CUDA autocast runs) costs about what the unrounded kernel costs in machine
code. Its group sums once came out in a layout that held each key in 8 lanes, and the top-n merge
then ran 8 times its integer work per thread (Triton 3.6 on the GPU: select_kernel 2.1x slower
than unrounded; with Triton 3.9 at 77eee5f: 1,303 integer compares against 336, 3,616 instructions
against 1,910)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import kernel_resources as kr  # noqa: E402

from nsa_compile.ops import triton_support  # noqa: E402

pytestmark = pytest.mark.skipif(triton_support.interpreting(), reason="the kernels must be built for the GPU")


def code_of(op, shape, rounded):
    (kernel, args, kw), = kr.launches(op, shape, rounded)
    return kw, kr.machine_code(kr.compile_launch(kernel, args, kw))


def test_a_captured_launch_has_the_cuda_call_s_tiles_and_compiles():
    """The seed shape's block selection: the launch the op makes on CUDA (its _tiles), compiled to a
    cubin with registers and instructions read back, and the constexpr importance dtype present only
    in the rounded variant."""
    from nsa_compile.ops import block_select_triton as bst

    kw, code = code_of("select_blocks", "seed", rounded=False)
    tiles = bst._tiles(6, 64, kr.D_STRIDE, kr.L_SEL, kr.N_SEL, False)
    assert {n: kw[n] for n in ("HC", "BLOCK_M", "TC", "KS", "num_warps")} == \
        {n: tiles[n] for n in ("HC", "BLOCK_M", "TC", "KS", "num_warps")}
    assert kw["IMP_DTYPE"] is None and kw["HPG"] == 6
    assert 32 <= code["registers"] <= 255 and code["instructions"] > 500
    kw_r, _ = code_of("select_blocks", "seed", rounded=True)
    assert kw_r["IMP_DTYPE"] is not None


def test_the_rounded_block_selection_costs_about_the_unrounded_in_machine_code():
    plain = code_of("select_blocks", "seed", rounded=False)[1]
    rounded = code_of("select_blocks", "seed", rounded=True)[1]
    assert rounded["stack"] == 0 == plain["stack"]
    assert rounded["instructions"] <= 1.25 * plain["instructions"], (rounded["instructions"], plain["instructions"])
    assert rounded["opcodes"]["ISETP"] <= 1.5 * plain["opcodes"]["ISETP"], (rounded["opcodes"]["ISETP"],
                                                                           plain["opcodes"]["ISETP"])


def test_packed_launches_are_the_has_pos_kernels():
    """--packed: the window's launches with pos are the HAS_POS kernels (the unpacked ones are not),
    same tiles, and they compile."""
    plain = kr.launches("window_attention", "seed", False)
    packed = kr.launches("window_attention", "seed", False, packed=True)
    assert [k.__name__ for k, _, _ in packed] == [k.__name__ for k, _, _ in plain]
    flags = lambda launches: [kw["HAS_POS"] for _, _, kw in launches if "HAS_POS" in kw]  # not the delta kernel
    assert flags(packed) == [True] * 3 and flags(plain) == [False] * 3
    assert [kw["BLOCK_M"] for _, _, kw in packed] == [kw["BLOCK_M"] for _, _, kw in plain]
    kernel, args, kw = packed[0]
    assert kr.machine_code(kr.compile_launch(kernel, args, kw))["instructions"] > 500
