"""NSA in the style of lucidrains/native-sparse-attention-pytorch (`SparseAttention`, plain-torch path).

Style: einops-heavy code with the einops calls written out by hand (einops is not installed
here): `rearrange` as view/permute, `repeat` as expand(...).reshape(...), `reduce(..., 'mean')` as
view(...).mean(...). One fused `to_qkv` Linear whose q, k, v are shared by all three branches
(K/V shared across branches); an RMSNorm before it; 5-D grouped scores
`einsum('b h qh i d, b h j d -> b h qh i j')` with `max_neg_value = -finfo.max`, and
`mask_value // 10` in the compressed branch; compression windows cut by ZeroPad2d + `nn.Unfold`
into an MLP with learned intra-block positions; interleaved RoPE (rotary-embedding-torch's
default) whose tables are built inside `forward`; the sliding window as bucketed local attention
(each window of w queries looks at its own and the previous window of keys); the combine as an
`einsum` over the stacked branch outputs with a per-head sigmoid gate.

Semantics (lucidrains' variant, not the paper's): keys are compressed *before* RoPE; compressed
block i covers tokens [(i+1)d - l, (i+1)d) (left zero padding) and is visible to t only when it
ends strictly before t ((i+1)d - 1 < t); a learned memory slot is always visible, so no row is
empty. Block choice from the compressed *logits*: their mean over the group's heads, averaged over
the l'/d compressed columns of each selection block, the current (diagonal) block masked out,
softmax with a -1e3 sink column, top n; a selected block counts only if its probability is
> 1e-10. The diagonal block is then appended with a causal (tril) mask. The window sees distance
0..w (w + 1 tokens). Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


def pad_at_dim(t, pad, dim=-1, value=0.0):
    dims_from_right = (-dim - 1) if dim < 0 else (t.ndim - dim - 1)
    return F.pad(t, (*((0, 0) * dims_from_right), *pad), value=value)


class Rotary(nn.Module):
    """Interleaved rotary embedding: pairs (2i, 2i + 1); frequencies built on every call."""

    def __init__(self, dim, theta=10000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, t):  # t [..., n, d]
        seq = torch.arange(t.shape[-2], device=t.device, dtype=torch.float32)
        freqs = torch.einsum("i, j -> i j", seq, self.inv_freq)
        freqs = freqs[..., None].expand(*freqs.shape, 2).reshape(freqs.shape[0], -1)  # '... n -> ... (n r)', r=2
        pairs = t.unflatten(-1, (-1, 2))
        x1, x2 = pairs.unbind(-1)
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return t * freqs.cos().to(t.dtype) + rotated * freqs.sin().to(t.dtype)


class CompressWindows(nn.Module):
    """'b h n d -> (b h) d 1 n', ZeroPad2d, Unfold, '(b h) (d n) w -> b h w n d'."""

    def __init__(self, block, stride, heads, dim_head):
        super().__init__()
        self.block, self.heads, self.dim_head = block, heads, dim_head
        self.pad = nn.ZeroPad2d((block - stride, 0, 0, 0))
        self.unfold = nn.Unfold(kernel_size=(1, block), stride=(1, stride))

    def forward(self, t):
        b, h, n, d = t.shape
        t = self.unfold(self.pad(t.reshape(b * h, n, d).transpose(1, 2).unsqueeze(2)))  # [(b h), (d n), w]
        return t.view(b, h, d, self.block, -1).permute(0, 1, 4, 3, 2)  # [b, h, w, n, d]


def attend(q, k, v, mask, scale):
    """Grouped attention; q [b, (h qh), i, d], k/v [b, h, j, d]. Returns out and the masked logits."""
    qh = q.shape[1] // k.shape[1]
    q = q.view(q.shape[0], k.shape[1], qh, *q.shape[2:])  # 'b (h qh) ... -> b h qh ...'
    sim = torch.einsum("b h q i d, b h j d -> b h q i j", q, k) * scale
    sim = sim.masked_fill(~mask, max_neg_value(sim) // 10)
    attn = sim.softmax(dim=-1)
    out = torch.einsum("b h q i j, b h j d -> b h q i d", attn, v)
    return out.flatten(1, 2), sim.flatten(1, 2)  # 'b h qh ... -> b (h qh) ...'


class SparseAttention(nn.Module):
    def __init__(self, dim=64, dim_head=16, heads=4, kv_heads=2, sliding_window_size=16, compress_block_size=8,
                 compress_block_sliding_stride=4, selection_block_size=16, num_selected_blocks=2,
                 num_compressed_mem_kv=1):
        super().__init__()
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.num_grouped_queries = heads // kv_heads
        self.scale = dim_head**-0.5
        self.norm = nn.RMSNorm(dim)
        self.rotary_emb = Rotary(dim_head)
        self.qkv_split = (dim_head * heads, dim_head * kv_heads, dim_head * kv_heads)
        self.to_qkv = nn.Linear(dim, sum(self.qkv_split), bias=False)
        self.sliding_window_size = sliding_window_size
        self.compress_block_size = compress_block_size
        self.compress_block_sliding_stride = compress_block_sliding_stride
        self.split_compress_window = CompressWindows(compress_block_size, compress_block_sliding_stride,
                                                     kv_heads, dim_head)
        self.compress_mem_kv = nn.Parameter(torch.zeros(2, kv_heads, num_compressed_mem_kv, dim_head))
        self.k_intrablock_positions = nn.Parameter(torch.zeros(kv_heads, compress_block_size, dim_head))
        self.v_intrablock_positions = nn.Parameter(torch.zeros(kv_heads, compress_block_size, dim_head))
        compress_dim = compress_block_size * dim_head
        self.k_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(compress_dim, compress_dim), nn.ReLU(),
                                        nn.Linear(compress_dim, dim_head))
        self.v_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(compress_dim, compress_dim), nn.ReLU(),
                                        nn.Linear(compress_dim, dim_head))
        self.selection_block_size = selection_block_size
        self.num_selected_blocks = num_selected_blocks
        self.to_strategy_combine = nn.Sequential(nn.Linear(dim, 3 * heads), nn.Sigmoid())
        self.combine_heads = nn.Linear(dim_head * heads, dim, bias=False)

    def split_heads(self, t):  # 'b n (h d) -> b h n d'
        return t.view(*t.shape[:2], -1, self.dim_head).transpose(1, 2)

    def repeat_kv(self, t):  # repeat(t, 'b h ... -> b (h gh) ...', gh=num_grouped_queries)
        b, h = t.shape[:2]
        return t[:, :, None].expand(b, h, self.num_grouped_queries, *t.shape[2:]).reshape(b, -1, *t.shape[2:])

    def forward(self, inp):  # inp [B, S, dim]
        batch, seq_len = inp.shape[:2]
        device, stride, fine = inp.device, self.compress_block_sliding_stride, self.selection_block_size
        num_compress_blocks = seq_len // stride
        fine_divisible_seq_len = -(-seq_len // fine) * fine
        num_fine_blocks = fine_divisible_seq_len // fine

        inp = self.norm(inp)
        q, k, v = self.to_qkv(inp).split(self.qkv_split, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))

        # 1. compressed attention over windows of unrotated keys, with memory slots
        k_windows = self.split_compress_window(k[..., : num_compress_blocks * stride, :])
        v_windows = self.split_compress_window(v[..., : num_compress_blocks * stride, :])
        ck = self.k_compress(k_windows + self.k_intrablock_positions[:, None])  # [B, G, W, D]
        cv = self.v_compress(v_windows + self.v_intrablock_positions[:, None])
        mem_ck, mem_cv = self.compress_mem_kv[:, None].expand(2, batch, *self.compress_mem_kv.shape[1:])
        num_mem = mem_ck.shape[-2]
        ck, cv = torch.cat((mem_ck, ck), dim=-2), torch.cat((mem_cv, cv), dim=-2)
        cq_seq = torch.arange(seq_len, device=device)
        ck_seq = (torch.arange(num_compress_blocks, device=device) + 1) * stride - 1
        ck_seq = F.pad(ck_seq, (num_mem, 0), value=-1)
        cmask = ck_seq[None, :] < cq_seq[:, None]  # einx.less('j, i -> i j')
        compressed_attn_out, csim = attend(q, ck, cv, cmask, self.scale)

        q, k = self.rotary_emb(q), self.rotary_emb(k)

        # 2. fine attention over the blocks chosen from the compressed logits
        importance = csim[..., num_mem:]
        importance = importance.view(batch, self.kv_heads, self.num_grouped_queries, *importance.shape[2:]).mean(2)
        per_fine = fine // stride
        importance = importance[..., : importance.shape[-1] // per_fine * per_fine]
        importance = importance.view(*importance.shape[:-1], -1, per_fine).mean(-1)  # '... (j n) -> ... j'
        q_seq = torch.arange(seq_len, device=device) // fine
        k_seq = torch.arange(importance.shape[-1], device=device)
        importance = importance.masked_fill(q_seq[:, None] == k_seq[None, :], max_neg_value(csim))
        importance = F.pad(importance, (1, 0), value=-1e3).softmax(dim=-1)[..., 1:]
        num_selected = min(self.num_selected_blocks, importance.shape[-1])
        values, selected = importance.topk(num_selected, dim=-1)  # [B, G, S, n]
        fmask = values > 1e-10

        remainder = fine_divisible_seq_len - seq_len
        fq, fk, fv = (pad_at_dim(t, (0, remainder), dim=-2) for t in (q, k, v))
        fmask = pad_at_dim(fmask, (0, remainder), value=False, dim=-2)
        selected = pad_at_dim(selected, (0, remainder), value=0, dim=-2)
        h = selected.shape[1]
        window_seq = (torch.arange(fine_divisible_seq_len, device=device) // fine)[:, None]
        selected = torch.cat((selected, window_seq.expand(batch, h, -1, 1)), dim=-1)  # the diagonal block
        fmask = fmask[..., None].expand(*fmask.shape, fine)  # 'b h i w -> b h i w j'
        causal = torch.ones((fine, fine), device=device, dtype=torch.bool).tril()
        causal = causal[None, None, None].expand(batch, h, num_fine_blocks, fine, fine)
        causal = causal.reshape(batch, h, fine_divisible_seq_len, 1, fine)  # 'i j -> b h (w i) 1 j'
        fmask = torch.cat((fmask, causal), dim=-2).flatten(-2)[:, :, None]  # 'b h i w j -> b h 1 i (w j)'

        fk = fk.view(batch, h, num_fine_blocks, fine, -1)  # 'b h (w n) d -> b h w n d'
        fv = fv.view(batch, h, num_fine_blocks, fine, -1)
        fk = fk[:, :, None].expand(-1, -1, fine_divisible_seq_len, -1, -1, -1)  # 'b h w j d -> b h i w j d'
        fv = fv[:, :, None].expand(-1, -1, fine_divisible_seq_len, -1, -1, -1)
        index = selected[..., None, None].expand(*selected.shape, fine, self.dim_head)
        fk = fk.gather(3, index).flatten(3, 4)  # [B, G, Sp, (n+1) l', D]
        fv = fv.gather(3, index).flatten(3, 4)
        fq = fq.view(batch, h, self.num_grouped_queries, *fq.shape[2:])
        fsim = torch.einsum("b h q i d, b h i j d -> b h q i j", fq, fk) * self.scale
        fsim = fsim.masked_fill(~fmask, max_neg_value(fsim))
        fattn = fsim.softmax(dim=-1)
        fine_attn_out = torch.einsum("b h q i j, b h i j d -> b h q i d", fattn, fv).flatten(1, 2)
        fine_attn_out = fine_attn_out[..., :seq_len, :]

        # 3. sliding window: buckets of w queries look at their own and the previous bucket
        sliding_attn_out = self.local_attention(q, self.repeat_kv(k), self.repeat_kv(v))

        weights = self.to_strategy_combine(inp).view(batch, seq_len, self.heads, 3).permute(0, 2, 1, 3)
        out = torch.einsum("b h n s, s b h n d -> b h n d", weights,
                           torch.stack([compressed_attn_out, fine_attn_out, sliding_attn_out]))
        return self.combine_heads(out.transpose(1, 2).flatten(2))  # 'b h n d -> b n (h d)'

    def local_attention(self, q, k, v):
        """Exact causal window (distance 0..w) through buckets of w; q, k, v [B, H, S, D]."""
        w, (b, h, n, d) = self.sliding_window_size, q.shape
        pad = -n % w
        q, k, v = (pad_at_dim(t, (0, pad), dim=-2) for t in (q, k, v))
        pos = pad_at_dim(torch.arange(n, device=q.device), (0, pad), value=-1)
        windows = (n + pad) // w
        bq, bk, bv = (t.view(b, h, windows, w, d) for t in (q, k, v))
        bq_t = pos.view(windows, w)

        def look_around(t, bucket_dim, value):  # the previous bucket, then this one
            prev = pad_at_dim(t, (1, 0), dim=bucket_dim, value=value).narrow(bucket_dim, 0, t.shape[bucket_dim])
            return torch.cat((prev, t), dim=bucket_dim + 1)

        bk, bv, bk_t = look_around(bk, 2, 0.0), look_around(bv, 2, 0.0), look_around(bq_t, 0, -1)
        sim = torch.einsum("b h w i d, b h w j d -> b h w i j", bq, bk) * self.scale
        dist = bq_t[..., :, None] - bk_t[..., None, :]
        mask = (bk_t[..., None, :] == -1) | (dist < 0) | (dist > w)
        sim = sim.masked_fill(mask, max_neg_value(sim))
        out = torch.einsum("b h w i j, b h w j d -> b h w i d", sim.softmax(dim=-1), bv)
        return out.reshape(b, h, -1, d)[..., :n, :]


def make():
    torch.manual_seed(0)
    return SparseAttention(), torch.randn(2, 77, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) nearest the seed preset's shapes (models/config.py: dim
    768, 12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). l, d, l' and the heads as the seed's.
    lucidrains' semantics differ by a block or a token, chosen here to do the seed's work: the top
    15 blocks plus the appended diagonal block read 16 blocks (the seed: 16 including its forced
    ones); the window sees distances 0..512, one token more than the seed's 512 (w = 511 would not
    divide S into the bucketed local attention's windows)."""
    torch.manual_seed(0)
    model = SparseAttention(dim=768, dim_head=64, heads=12, kv_heads=2, sliding_window_size=512,
                            compress_block_size=32, compress_block_sliding_stride=16, selection_block_size=64,
                            num_selected_blocks=15)
    return model, torch.randn(batch, seq_len, 768)
