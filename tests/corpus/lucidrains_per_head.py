"""NSA in the style of lucidrains/native-sparse-attention-pytorch with `query_heads_share_selected_kv=False`.

Style: as lucidrains' plain-torch path, einops written out by hand, but GQA by `.repeat(...)`
(`repeat(t, 'b h ... -> b (h gh) ...')` spelled as `t.unsqueeze(2).repeat(1, 1, gh, 1, 1).flatten(1, 2)`),
non-overlapping compression windows (l = d, so no padding: `unfold` + a single Linear compressor
over the flattened window), two learned memory slots, the window as a dense einsum with the
flex-attention sliding mask (`0 <= q - k <= w`) filled with `-finfo.max`, interleaved RoPE from a
frequency table cached as a buffer at construction, and the combine as an einsum over the stacked
branches.

Semantics: per-head selection: each query head ranks the blocks by its own compressed logits
(no group reduction) and gathers its own blocks. Compressed block i covers [i*l, (i+1)*l) and is
visible to t only when (i+1)*l - 1 < t (strictly before t); memory slots always visible. Block
choice as lucidrains: logits averaged over the l'/d columns of each selection block, the diagonal
block masked, softmax with a -1e3 sink, top n, kept if > 1e-10, the diagonal block appended under
a causal mask. Window: distance 0..w (w + 1 tokens). Keys compressed before RoPE. Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


def rotate_every_two(t):
    x1, x2 = t.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class PerHeadSparseAttention(nn.Module):
    def __init__(self, dim=48, dim_head=12, heads=4, kv_heads=2, sliding_window_size=12, compress_block_size=8,
                 selection_block_size=16, num_selected_blocks=2, num_compressed_mem_kv=2, max_seq_len=256):
        super().__init__()
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.num_grouped_queries = heads // kv_heads
        self.scale = dim_head**-0.5
        self.window = sliding_window_size
        self.block = compress_block_size
        self.fine = selection_block_size
        self.num_selected = num_selected_blocks
        self.norm = nn.RMSNorm(dim)
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.compress_mem_kv = nn.Parameter(torch.randn(2, kv_heads, num_compressed_mem_kv, dim_head) * 0.02)
        self.k_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(compress_block_size * dim_head, dim_head))
        self.v_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(compress_block_size * dim_head, dim_head))
        self.to_strategy_combine = nn.Sequential(nn.Linear(dim, 3 * heads), nn.Sigmoid())
        self.combine_heads = nn.Linear(heads * dim_head, dim, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim_head, 2).float() / dim_head)
        freqs = torch.arange(max_seq_len).float()[:, None] * inv_freq  # [max_seq_len, D/2]
        self.register_buffer("cached_freqs", freqs.repeat_interleave(2, dim=-1), persistent=False)

    def rotate(self, t):  # t [b, h, n, d]
        freqs = self.cached_freqs[: t.shape[-2]].to(t.dtype)
        return t * freqs.cos() + rotate_every_two(t) * freqs.sin()

    def repeat_heads(self, t):  # 'b h ... -> b (h gh) ...'
        return t.unsqueeze(2).repeat(1, 1, self.num_grouped_queries, *([1] * (t.ndim - 2))).flatten(1, 2)

    def forward(self, inp):  # inp [B, S, dim]
        b, n = inp.shape[:2]
        device, block, fine = inp.device, self.block, self.fine
        inp = self.norm(inp)
        q = self.to_q(inp).view(b, n, self.heads, -1).transpose(1, 2)  # [b, H, n, d]
        k, v = self.to_kv(inp).view(b, n, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)  # [b, G, n, d]

        # compressed: non-overlapping windows of unrotated keys, plus memory slots
        num_blocks = n // block
        ck = self.k_compress(k[..., : num_blocks * block, :].unflatten(2, (num_blocks, block)))  # [b, G, W, d]
        cv = self.v_compress(v[..., : num_blocks * block, :].unflatten(2, (num_blocks, block)))
        mem_k, mem_v = self.compress_mem_kv.unsqueeze(1).repeat(1, b, 1, 1, 1)
        num_mem = mem_k.shape[-2]
        ck, cv = self.repeat_heads(torch.cat((mem_k, ck), dim=-2)), self.repeat_heads(torch.cat((mem_v, cv), dim=-2))
        ck_seq = F.pad((torch.arange(num_blocks, device=device) + 1) * block - 1, (num_mem, 0), value=-1)
        cmask = ck_seq[None, :] < torch.arange(n, device=device)[:, None]
        csim = torch.einsum("b h i d, b h j d -> b h i j", q, ck) * self.scale
        csim = csim.masked_fill(~cmask, max_neg_value(csim) // 10)
        compressed_out = torch.einsum("b h i j, b h j d -> b h i d", csim.softmax(dim=-1), cv)

        q, k = self.rotate(q), self.rotate(k)

        # fine: every query head ranks blocks by its own logits
        per_fine = fine // block
        importance = csim[..., num_mem:]
        importance = importance[..., : importance.shape[-1] // per_fine * per_fine]
        importance = importance.unflatten(-1, (-1, per_fine)).mean(-1)  # [b, H, n, J]
        diagonal = (torch.arange(n, device=device) // fine)[:, None] == torch.arange(importance.shape[-1], device=device)
        importance = importance.masked_fill(diagonal, max_neg_value(csim))
        importance = F.pad(importance, (1, 0), value=-1e3).softmax(dim=-1)[..., 1:]
        values, selected = importance.topk(min(self.num_selected, importance.shape[-1]), dim=-1)  # [b, H, n, sel]
        fmask = values > 1e-10

        padded = -(-n // fine) * fine
        fq, fk, fv = (F.pad(t, (0, 0, 0, padded - n)) for t in (q, self.repeat_heads(k), self.repeat_heads(v)))
        fmask = F.pad(fmask, (0, 0, 0, padded - n), value=False)
        selected = F.pad(selected, (0, 0, 0, padded - n), value=0)
        diag = (torch.arange(padded, device=device) // fine)[None, None, :, None].expand(b, self.heads, padded, 1)
        selected = torch.cat((selected, diag), dim=-1)
        causal = torch.ones(fine, fine, dtype=torch.bool, device=device).tril().repeat(padded // fine, 1)  # [padded, j]
        fmask = torch.cat((fmask[..., None].repeat(1, 1, 1, 1, fine),
                           causal[None, None, :, None].repeat(b, self.heads, 1, 1, 1)), dim=-2).flatten(-2)
        gather_index = selected[..., None, None].repeat(1, 1, 1, 1, fine, self.dim_head)  # [b, H, i, sel, j, d]
        fk = fk.unflatten(2, (-1, fine)).unsqueeze(2).repeat(1, 1, padded, 1, 1, 1).gather(3, gather_index)
        fv = fv.unflatten(2, (-1, fine)).unsqueeze(2).repeat(1, 1, padded, 1, 1, 1).gather(3, gather_index)
        fsim = torch.einsum("b h i d, b h i j d -> b h i j", fq, fk.flatten(3, 4)) * self.scale
        fsim = fsim.masked_fill(~fmask, max_neg_value(fsim))
        fine_out = torch.einsum("b h i j, b h i j d -> b h i d", fsim.softmax(dim=-1), fv.flatten(3, 4))[..., :n, :]

        # sliding window with the flex-attention mask, dense
        dist = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]
        sliding = (dist >= 0) & (dist <= self.window)
        ssim = torch.einsum("b h i d, b h j d -> b h i j", q, self.repeat_heads(k)) * self.scale
        ssim = ssim.masked_fill(~sliding, max_neg_value(ssim))
        sliding_out = torch.einsum("b h i j, b h j d -> b h i d", ssim.softmax(dim=-1), self.repeat_heads(v))

        weights = self.to_strategy_combine(inp).unflatten(-1, (self.heads, 3)).permute(0, 2, 1, 3)  # [b, H, n, 3]
        out = torch.einsum("b h n s, s b h n d -> b h n d", weights, torch.stack([compressed_out, fine_out, sliding_out]))
        return self.combine_heads(out.transpose(1, 2).flatten(2))


def make():
    torch.manual_seed(0)
    return PerHeadSparseAttention(), torch.randn(2, 83, 48)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) nearest the seed preset's shapes (models/config.py: dim
    768, 12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). This model's compression windows do
    not overlap (l = d): 16, the seed's stride, so that it has the seed's S / 16 compressed tokens
    and l' / d = 4 columns per selection block. The top 15 blocks plus the appended diagonal block
    read 16 blocks, as the seed's 16 (forced ones included); the window sees distances 0..512, one
    token more than the seed's 512 (kept as lucidrains' sliding_window_size=512 is written)."""
    torch.manual_seed(0)
    model = PerHeadSparseAttention(dim=768, dim_head=64, heads=12, kv_heads=2, sliding_window_size=512,
                                   compress_block_size=16, selection_block_size=64, num_selected_blocks=15,
                                   max_seq_len=seq_len)
    return model, torch.randn(batch, seq_len, 768)
