"""compress_pooling (passes/compress_pooling.py): a learned pooling of compression windows written
as a product with a vector becomes a multiply-sum.

Matches: a small compression (K and V projected, cut into overlapping windows of l keys with
`as_strided` or `unfold`, pooled with one learned weight per KV head and window position) in three
spellings: einsum 'bgnkd,gk->bgnd' (canonicalize makes it a matmul with a one-column right
operand), `windows.transpose(-1, -2) @ w[..., None]`, and `windows @ w` with a vector w; the
corpus' grouped5d_nograd. Each: the exact number of rewrites, the matmul gone from the graph and a
multiply-sum there, outputs and every gradient (the pooling weights' too) as eager's in fp32, bf16
and fp16, and under CPU autocast with the product's dtype kept.

Near misses: a window of 65 keys (over MAX_TERMS) is refused with its reason and the graph is as
the passes before left it; a two-column product (two pooled keys per window) is no weighted sum and
is left alone without a refusal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import nsa_compile
from helpers import FAST, matches, only_graph, optimize_fresh, optimized_with_parity, row
from test_window_offset import code_around

from corpus import fused_qkv_per_head, grouped5d_nograd, lucidrains_shared_kv
from nsa_compile.passes.compress_pooling import MAX_TERMS

SPELLINGS = ("einsum", "column", "vector")


class Pooling(nn.Module):
    """K and V of 2 heads, windows of l keys at stride d, pooled by learned weights; the output is
    the pooled K and V mixed by a Linear (so every weight gets a gradient)."""

    def __init__(self, spelling="einsum", l=8, d=4, heads=2, head_dim=8, dim=16, columns=1):
        super().__init__()
        self.spelling, self.l, self.d, self.heads = spelling, l, d, heads
        self.kv = nn.Linear(dim, 2 * heads * head_dim, bias=False)
        shape = (l,) if spelling == "vector" else (heads, l, columns)
        self.pool_k = nn.Parameter(torch.randn(shape) / l)
        self.pool_v = nn.Parameter(torch.randn(shape) / l)
        self.out = nn.Linear(2 * head_dim * columns, dim)

    def pooled(self, x, w):  # x [B, G, S, D] -> [B, G, Tc, D * columns]
        if self.spelling == "einsum":
            windows = x.unfold(2, self.l, self.d)  # [B, G, Tc, D, l]
            return torch.einsum("bgndk,gk->bgnd", windows, w[..., 0])
        B, G, S, D = x.shape
        x = x.contiguous()
        Tc = (S - self.l) // self.d + 1
        windows = x.as_strided((B, G, Tc, self.l, D), (x.stride(0), x.stride(1), self.d * x.stride(2),
                                                        x.stride(2), x.stride(3)))
        if self.spelling == "vector":
            return windows.transpose(-1, -2) @ w  # [B, G, Tc, D]
        return (windows.transpose(-1, -2) @ w[:, None]).flatten(-2)  # [.., D, l] @ [G, 1, l, c]

    def forward(self, x):  # [B, S, dim]
        B, S, _ = x.shape
        k, v = self.kv(x).view(B, S, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        kv = torch.cat([self.pooled(k, self.pool_k), self.pooled(v, self.pool_v)], dim=-1)  # [B, G, Tc, 2D]
        return self.out(kv)


class ConvPooling(nn.Module):
    """The same pooling as a depthwise convolution (fused_qkv_per_head's spelling): one learned
    filter of l taps per channel, stride d, a bias; `conv` overrides F.conv1d's other arguments."""

    def __init__(self, l=8, d=4, channels=6, dim=16, **conv):
        super().__init__()
        self.d, self.conv = d, {"stride": d, "groups": channels} | conv
        self.proj = nn.Linear(dim, channels, bias=False)
        groups = self.conv["groups"]
        self.weight = nn.Parameter(torch.randn(channels, channels // groups, l) / l)
        self.bias = nn.Parameter(torch.randn(channels))
        self.out = nn.Linear(channels, dim)

    def forward(self, x):  # [B, S, dim]
        y = F.conv1d(self.proj(x).transpose(1, 2), self.weight, self.bias, **self.conv)  # [B, C, Tc]
        return self.out(y.transpose(1, 2))


def pooling_code(opt) -> tuple[str, str]:
    return code_around(opt, "compress_pooling")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_pooling_product_becomes_a_multiply_sum(spelling, dtype):
    """Each product a multiply-sum; the as_strided windows of the two spellings that cut them so
    become unfold views (two more matches)."""
    torch.manual_seed(0)
    opt = optimized_with_parity(Pooling(spelling), torch.randn(2, 37, 16), dtype)
    strided = spelling != "einsum"
    assert matches(opt)["compress_pooling"] == (4 if strided else 2)
    before, after = pooling_code(opt)
    assert before.count("torch.matmul(") + before.count(" @ ") == 2
    assert after.count("torch.matmul(") + after.count(" @ ") == 0
    assert after.count("torch.mul(") == 2 and after.count("torch.sum(") == 2
    assert (before.count(".as_strided("), after.count(".as_strided(")) == ((2, 0) if strided else (0, 0))
    assert row(opt, "compress_pooling")["kernels"] == (
        ["as_strided windows of 8 at stride 4 -> unfold, the same view (unfold's backward, not as_strided's)"]
        if strided else []) + ["multiply-sum over 8 terms (Inductor reduction, no GEMM of one column)"]


def test_under_autocast_the_pooled_keys_keep_the_products_dtype():
    """CPU autocast (bf16) casts the matmul's operands: the autocast rule writes the casts, the
    multiply-sum reads bf16 operands and returns bf16 as the product did (sum's dtype argument)."""
    torch.manual_seed(0)
    model, x = Pooling("column"), torch.randn(2, 37, 16)
    opt = optimize_fresh(copy.deepcopy(model), FAST)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), opt(x)
    assert matches(opt)["compress_pooling"] == 4  # the two products and their as_strided windows
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_window_longer_than_max_terms_is_refused_unchanged():
    torch.manual_seed(0)
    l = MAX_TERMS + 1
    opt = optimized_with_parity(Pooling("einsum", l=l, d=l // 2), torch.randn(2, 2 * l, 16))
    assert matches(opt)["compress_pooling"] == 0
    before, after = pooling_code(opt)
    assert before == after and before.count("torch.matmul(") + before.count(" @ ") == 2
    assert row(opt, "compress_pooling")["refused"] == 2
    assert row(opt, "compress_pooling")["reasons"] == [
        f"a sum of {l} terms (over {MAX_TERMS}: a long dot product stays a cuBLAS GEMV)"]


def test_a_two_column_product_is_no_pooling_and_is_left_alone():
    """No refusal and the products stay; only their as_strided windows become unfold views."""
    torch.manual_seed(0)
    opt = optimized_with_parity(Pooling("column", columns=2), torch.randn(2, 37, 16))
    assert matches(opt)["compress_pooling"] == 2 and row(opt, "compress_pooling")["refused"] == 0
    before, after = pooling_code(opt)
    assert before.count("torch.matmul(") + before.count(" @ ") == after.count("torch.matmul(") + after.count(" @ ") == 2


def test_the_corpus_grouped_model_pools_with_multiply_sums():
    model, x = grouped5d_nograd.make()
    opt = optimized_with_parity(model, x)
    assert matches(opt)["compress_pooling"] == 4  # two products, their two as_strided window views
    forward = only_graph(opt).aten["forward"].graph
    products = [n for n in forward.nodes if n.op == "call_function"
                and n.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)
                and n.meta["val"].shape[-1] == 1]
    assert products == []  # no GEMM of one column left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("l, d, form", [(8, 4, "2 blocks of 4 per window"), (6, 4, "over unfold windows")],
                         ids=["blocks", "unfold"])
def test_a_depthwise_convolution_becomes_a_multiply_sum(l, d, form, dtype):
    """l = 2 d: each window is two blocks of d tokens (no overlapping view); l = 6, d = 4: unfold."""
    torch.manual_seed(0)
    opt = optimized_with_parity(ConvPooling(l, d), torch.randn(2, 37, 16), dtype)
    assert matches(opt)["compress_pooling"] == 1
    before, after = pooling_code(opt)
    assert before.count("torch.conv1d(") == 1 and after.count("torch.conv1d(") == 0
    assert after.count("torch.mul(") == after.count("torch.sum(") == (2 if form.startswith("2") else 1)
    assert row(opt, "compress_pooling")["kernels"] == [
        f"multiply-sum over {l} terms, {form} (Inductor reduction, no depthwise convolution)"]


@pytest.mark.parametrize("conv, reason", [
    ({"padding": 1}, "a convolution with padding 1, dilation 1, stride 4 (not a window pooling)"),
    ({"dilation": 2}, "a convolution with padding 0, dilation 2, stride 4 (not a window pooling)"),
], ids=["padding", "dilation"])
def test_a_padded_or_dilated_convolution_is_refused_unchanged(conv, reason):
    torch.manual_seed(0)
    opt = optimized_with_parity(ConvPooling(**conv), torch.randn(2, 37, 16))
    assert (matches(opt)["compress_pooling"], row(opt, "compress_pooling")["reasons"]) == (0, [reason])
    before, after = pooling_code(opt)
    assert before == after and "torch.conv1d(" in after


def test_a_convolution_across_channels_is_no_pooling_and_is_left_alone():
    torch.manual_seed(0)
    opt = optimized_with_parity(ConvPooling(groups=2), torch.randn(2, 37, 16))
    assert matches(opt)["compress_pooling"] == 0 and row(opt, "compress_pooling")["refused"] == 0


@pytest.mark.parametrize("corpus_model, gone", [(fused_qkv_per_head, "convolution"), (lucidrains_shared_kv, "im2col")],
                         ids=["per_head_conv1d", "shared_kv_unfold"])
def test_the_corpus_models_pool_without_the_aten_op(corpus_model, gone):
    """fused_qkv_per_head's two depthwise convolutions, lucidrains_shared_kv's two nn.Unfold windows:
    rewritten, and the ATen op (and so its scatter backward) is not in the forward graph."""
    model, x = corpus_model.make()
    opt = optimized_with_parity(model, x)
    assert matches(opt)["compress_pooling"] == 2
    forward = only_graph(opt).aten["forward"].graph
    assert [n for n in forward.nodes if n.op == "call_function" and gone in str(n.target)] == []


class ConvModule(nn.Module):
    """A learned depthwise nn.Conv1d: F.conv1d with positional stride, padding (0,), dilation (1,),
    groups; its weight and bias float32 parameters."""

    def __init__(self, l=8, d=4, channels=6, dim=16):
        super().__init__()
        self.proj = nn.Linear(dim, channels, bias=False)
        self.conv = nn.Conv1d(channels, channels, l, stride=d, groups=channels)
        self.out = nn.Linear(channels, dim)

    def forward(self, x):  # [B, S, dim]
        return self.out(self.conv(self.proj(x).transpose(1, 2)).transpose(1, 2))


def test_an_nn_conv1d_module_in_float32_and_under_cpu_autocast():
    """fp32: the block form, eager's output and gradients. Under CPU autocast (bf16) autocast casts
    the bf16 activations' convolution weight and bias to bf16: the autocast rule writes those casts,
    and the multiply-sum reads bf16 operands and returns bf16, as the convolution did."""
    torch.manual_seed(0)
    model, x = ConvModule(), torch.randn(2, 37, 16)
    assert matches(optimized_with_parity(model, x))["compress_pooling"] == 1
    opt = optimize_fresh(copy.deepcopy(model), FAST)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), opt(x)
    assert matches(opt)["compress_pooling"] == 1
    assert any(k.startswith("autocast: conv1d computes in bfloat16") for k in row(opt, "canonicalize")["kernels"])
    _, after = pooling_code(opt)
    assert "torch.conv1d(" not in after and "torch.bfloat16" in after
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class UnfoldWindows(nn.Module):
    """Compression windows cut by nn.Unfold as lucidrains cuts them: the keys [B, C, S] seen as an
    image [B, C / rows, rows, S] (rows > 1: channels folded into image rows) with a kernel of one
    row, (1, l), stride (1, d); or `vertical`, the sequence down the image's height, kernel (l, 1).
    Each window, flattened, goes through a Linear, as lucidrains' compression MLP takes it."""

    def __init__(self, l=8, d=4, vertical=False, rows=1, dim=16, channels=12, **unfold):
        super().__init__()
        self.vertical, self.rows = vertical, rows
        self.kv = nn.Linear(dim, channels, bias=False)
        kernel, stride = ((l, 1), (d, 1)) if vertical else ((1, l), (1, d))
        self.unfold = nn.Unfold(kernel_size=kernel, **({"stride": stride} | unfold))
        self.mlp = nn.Linear(channels // rows * l, dim)

    def forward(self, x):  # [B, S, dim]
        B, S, _ = x.shape
        t = self.kv(x).transpose(1, 2).reshape(B, -1, self.rows, S)  # [B, C / rows, rows, S]
        if self.vertical:
            t = t.transpose(2, 3)  # [B, C / rows, S, rows]
        return self.mlp(self.unfold(t).transpose(1, 2))  # [B, windows, C / rows * l] -> [B, windows, dim]


def unfold_count(code: str) -> int:
    return code.count("torch.nn.functional.unfold(")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("l, d", [(8, 4), (8, 8), (12, 4)], ids=["2_blocks", "1_block", "3_blocks"])
@pytest.mark.parametrize("vertical, rows", [(False, 1), (True, 1), (False, 2), (True, 3)],
                         ids=["row", "column", "two_rows", "column_3_wide"])
def test_unfold_windows_become_shifted_views_of_blocks(vertical, rows, l, d, dtype):
    """F.unfold (im2col) of windows of l = r * d along one axis: the same elements in the same order
    from r shifted views of one cut into blocks of d (a cat), no unfold left; output and every
    gradient as eager's."""
    torch.manual_seed(0)
    opt = optimized_with_parity(UnfoldWindows(l, d, vertical, rows), torch.randn(2, 37, 16), dtype)
    assert matches(opt)["compress_pooling"] == 1
    before, after = pooling_code(opt)
    assert (unfold_count(before), unfold_count(after)) == (1, 0)
    assert after.count("torch.cat(") - before.count("torch.cat(") == (1 if l > d else 0)
    views = "the blocks" if l == d else f"{l // d} shifted views of blocks"
    assert row(opt, "compress_pooling")["kernels"] == [
        f"windows of {l} as {views} of {d} (no im2col, a backward without col2im)"]


@pytest.mark.parametrize("l, d, unfold, reason", [
    (6, 4, {}, "windows of 6 at stride 4 (not whole blocks of the stride: the overlapping copy stays)"),
    (8, 4, {"padding": (0, 1)}, "an unfold with dilation (1, 1), padding (0, 1), stride (1, 4) (not windows of one axis)"),
    (8, 4, {"dilation": (1, 2)}, "an unfold with dilation (1, 2), padding (0, 0), stride (1, 4) (not windows of one axis)"),
    (8, 4, {"stride": (2, 4)}, "an unfold with dilation (1, 1), padding (0, 0), stride (2, 4) (not windows of one axis)"),
], ids=["not_whole_blocks", "padding", "dilation", "stride_across"])
def test_unfold_near_misses_are_refused_unchanged(l, d, unfold, reason):
    torch.manual_seed(0)
    opt = optimized_with_parity(UnfoldWindows(l, d, rows=2, **unfold), torch.randn(2, 37, 16))
    assert (matches(opt)["compress_pooling"], row(opt, "compress_pooling")["reasons"]) == (0, [reason])
    before, after = pooling_code(opt)
    assert before == after and unfold_count(after) == 1


def test_an_unfold_of_a_square_kernel_is_no_window_and_is_left_alone():
    torch.manual_seed(0)
    model = UnfoldWindows(2, 2, rows=2)
    model.unfold = nn.Unfold(kernel_size=2, stride=2)  # 2 x 2 patches: windows of two axes
    model.mlp = nn.Linear(6 * 4, 16)
    x = torch.randn(2, 36, 16)
    opt = optimize_fresh(copy.deepcopy(model), FAST)
    torch.testing.assert_close(opt(x), model(x))
    assert matches(opt)["compress_pooling"] == 0 and row(opt, "compress_pooling")["refused"] == 0


class StridedWindows(nn.Module):
    """Windows of l keys at stride d as an as_strided view with the window dim at `place` (2: right
    after the sequence's dim, as grouped5d_nograd; 4: last, unfold's own layout), then `windows`
    (Tc, by default all of them); each window flattened into a Linear."""

    def __init__(self, l=8, d=4, place=3, windows=None, dim=16, heads=2, head_dim=8):
        super().__init__()
        self.l, self.d, self.place, self.windows, self.heads = l, d, place, windows, heads
        self.kv = nn.Linear(dim, heads * head_dim, bias=False)
        self.mlp = nn.Linear(l * head_dim, dim)

    def forward(self, x):  # [B, S, dim]
        B, S, _ = x.shape
        k = self.kv(x).view(B, S, self.heads, -1).transpose(1, 2).contiguous()  # [B, G, S, D]
        Tc = self.windows or (S - self.l) // self.d + 1
        size, stride = [B, self.heads, Tc, k.shape[3]], list(k.stride())
        stride[2] *= self.d
        size.insert(self.place, self.l)
        stride.insert(self.place, k.stride(2))
        w = k.as_strided(size, stride)
        if self.place == 4:
            w = w.transpose(-1, -2)  # [B, G, Tc, l, D]
        return self.mlp(w.flatten(-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("place", [3, 4], ids=["window_before_dim", "window_last"])
def test_as_strided_windows_become_the_same_unfold_view(place, dtype):
    torch.manual_seed(0)
    opt = optimized_with_parity(StridedWindows(place=place), torch.randn(2, 37, 16), dtype)
    assert matches(opt)["compress_pooling"] == 1
    before, after = pooling_code(opt)
    assert (before.count(".as_strided("), after.count(".as_strided(")) == (1, 0)
    assert "torch_Tensor_unfold(" in after and ("torch.movedim(" in after) == (place == 3)


@pytest.mark.parametrize("model", [StridedWindows(windows=5), StridedWindows(d=3, l=8, windows=4)],
                         ids=["fewer_windows", "other_count"])
def test_an_as_strided_view_that_is_not_unfolds_windows_is_left_alone(model):
    """Fewer windows than unfold makes (the view is a prefix of them): no window view of unfold's,
    left as it is, no refusal; the model's output and gradients as eager's."""
    torch.manual_seed(0)
    opt = optimized_with_parity(model, torch.randn(2, 37, 16))
    assert matches(opt)["compress_pooling"] == 0 and row(opt, "compress_pooling")["refused"] == 0
    before, after = pooling_code(opt)
    assert before == after and ".as_strided(" in after


@pytest.mark.parametrize("make", [lambda: ConvPooling(8, 4), lambda: UnfoldWindows(8, 4, rows=2), StridedWindows],
                         ids=["conv_blocks", "unfold_blocks", "as_strided"])
def test_each_rewrite_at_symbolic_lengths(make):
    """Run at S, S + 1 and S + 6: Dynamo compiles again with S a symbol. The convolution's and the
    unfold's block counts S // d and windows are graph arithmetic on it; the as_strided view's sizes
    and strides are size nodes, read as their SymInts. Each compiled graph rewrites once, and every
    length matches eager."""
    torch.manual_seed(0)
    model = make()
    opt = optimize_fresh(copy.deepcopy(model), FAST)
    for S in (37, 38, 43):
        x = torch.randn(2, S, 16)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)
    graphs = nsa_compile.api.state_of(opt).graphs
    assert len(graphs) == 2 and "torch.SymInt" in graphs[1].code_before
    assert [len(g.logs[[log.pass_name for log in g.logs].index("compress_pooling")].matches) for g in graphs] == [1, 1]
