"""NSA in the style of XunhaoLai/native-sparse-attention-triton's torch reference ops, varlen layout.

Style: packed varlen tensors `[total_tokens, H, D]` with `cu_seqlens` (flash-attn's varlen API):
the batch rows of x [B, S, dim] are flattened and each row holds the documents `doc_lens`
(known when the model is built, so the per-document Python loops over `cu_seqlens` unroll under
torch.compile with no `.item()`). Per document: average pooling of the keys and values with
`F.avg_pool1d(kernel l, stride d)` plus the mean intra-block position embedding as a bias;
RoPE (rotate-half) at positions within the document, on the compressed keys at positions
i*stride after compression. Scores by `einsum('qhd,khd->hqk')` on `repeat_interleave`d K/V over
dense [H, total_q, total_k] masks assembled from per-document slices; `masked_fill_(~mask, -inf)`,
`softmax(dim=-1, dtype=torch.float32)`, `nan_to_num(0)` for queries that see no block yet. The
block choice runs under `torch.no_grad()` and ends in `topk(...).indices.sort(-1).values` with
boolean-mask assignments; the selected branch is dense attention under a block mask scattered
from the chosen indices and `tril`; the window is `F.scaled_dot_product_attention` with a boolean
`attn_mask`. One k and v shared by the branches; sigmoid gate per head and branch.

Semantics (the paper's, as this reference implements it): l = 8, d = 4 (block i visible to t iff
i*d + l - 1 <= t); block importance = the compressed probabilities summed over the group's heads,
mapped onto selection blocks of l' = 8 with overlap counts (1, 2, 1 for l/d = l'/d = 2; twice
overlap / l), blocks scored up to the longest document's last complete block (the others 0);
forced: block 0 (init) and the current and previous blocks (local) by +inf; top n = 4, sorted
ascending, blocks after the current one -> -1. Window: the w + 1 tokens t - w..t (flash-attn's
window_size=(w, 0)), w = 12. Every branch stays within the query's document. Causal.
"""

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class VarlenNSA(nn.Module):
    def __init__(self, hidden_size=64, num_q_heads=4, num_kv_heads=2, kernel_size=8, kernel_stride=4, block_size=8,
                 topk=4, window_size=12, doc_lens=(45, 51), rope_theta=10000.0):
        super().__init__()
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim = hidden_size // num_q_heads
        self.kernel_size, self.kernel_stride, self.block_size = kernel_size, kernel_stride, block_size
        self.topk, self.window_size, self.doc_lens = topk, window_size, tuple(doc_lens)
        self.proj_q = nn.Linear(hidden_size, num_q_heads * self.head_dim, bias=False)
        self.proj_k = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.proj_v = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.intra_block_pe = nn.Parameter(torch.randn(num_kv_heads, kernel_size, self.head_dim) * 0.02)
        self.gate = nn.Sequential(nn.Linear(hidden_size, num_q_heads * 3, bias=False), nn.Sigmoid())
        self.proj_o = nn.Linear(num_q_heads * self.head_dim, hidden_size, bias=False)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x, cu_seqlens, stride=1):  # x [total, H, D]; positions restart in every sequence
        pos = torch.cat([torch.arange(cu_seqlens[i + 1] - cu_seqlens[i], device=x.device) * stride
                         for i in range(len(cu_seqlens) - 1)])
        freqs = pos[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [total, 1, D]
        return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)

    def avgpool_compress(self, x, cu_seqlens, pe):  # [total, H, D] -> [total_c, H, D], compressed cu_seqlens
        outs, y_cu = [], [0]
        for i in range(len(cu_seqlens) - 1):
            seq = x[cu_seqlens[i] : cu_seqlens[i + 1]]  # [n, H, D]
            n = seq.shape[0]
            y = F.avg_pool1d(seq.flatten(1).t()[None], self.kernel_size, self.kernel_stride)  # [1, H*D, n_c]
            y = y[0].t().view(-1, *x.shape[1:])
            if pe is not None:
                y = y + pe.mean(dim=1)[None]
            outs.append(y)
            y_cu.append(y_cu[-1] + (n - self.kernel_size) // self.kernel_stride + 1)
        return torch.cat(outs, dim=0), y_cu

    def forward(self, x):  # x [B, S, hidden]
        B, S, _ = x.shape
        cu_seqlens = [0]
        for _ in range(B):
            for n in self.doc_lens:
                cu_seqlens.append(cu_seqlens[-1] + n)
        x = x.reshape(B * S, -1)
        q = self.proj_q(x).view(-1, self.num_q_heads, self.head_dim)
        k = self.proj_k(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.proj_v(x).view(-1, self.num_kv_heads, self.head_dim)

        compressed_k, compressed_cu = self.avgpool_compress(k, cu_seqlens, self.intra_block_pe)
        compressed_v, _ = self.avgpool_compress(v, cu_seqlens, None)
        q = self.rope(q, cu_seqlens)
        compressed_k = self.rope(compressed_k, compressed_cu, stride=self.kernel_stride)
        compressed_out, topk_idx = self.compressed_attention(q, compressed_k, compressed_v, cu_seqlens, compressed_cu)
        k = self.rope(k, cu_seqlens)
        sparse_out = self.topk_sparse_attention(q, k, v, topk_idx, cu_seqlens)
        sliding_out = self.sliding_window_attention(q, k, v, cu_seqlens)

        gate = self.gate(x).view(-1, self.num_q_heads, 3)  # 'n (h g) -> n h g'
        out = gate[..., 0:1] * compressed_out + gate[..., 1:2] * sparse_out + gate[..., 2:3] * sliding_out
        return self.proj_o(out.flatten(1)).view(B, S, -1)

    def compressed_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        total_q, total_k = q.shape[0], k.shape[0]
        share = self.num_q_heads // self.num_kv_heads
        mask = torch.zeros((total_q, total_k), dtype=torch.bool, device=q.device)
        for b in range(len(cu_seqlens_q) - 1):
            k_len = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
            k_max_ids = torch.arange(k_len, device=q.device) * self.kernel_stride + self.kernel_size - 1
            q_ids = torch.arange(cu_seqlens_q[b + 1] - cu_seqlens_q[b], device=q.device)
            mask[cu_seqlens_q[b] : cu_seqlens_q[b + 1], cu_seqlens_k[b] : cu_seqlens_k[b + 1]] = \
                q_ids[:, None] >= k_max_ids[None, :]
        qk = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(share, 1)) * self.head_dim**-0.5
        qk = qk.masked_fill_(~mask[None, ...], -torch.inf)
        qk = qk.softmax(dim=-1, dtype=torch.float32)
        qk = qk.nan_to_num(0)  # a query before the first complete block sees nothing
        attn_output = torch.einsum("hqk,khd->qhd", qk.to(v.dtype), v.repeat_interleave(share, 1))
        with torch.no_grad():
            score = qk.view(self.num_kv_heads, share, total_q, total_k).sum(1)  # '(h g) q k -> h q k', sum
            topk_idx = self.select_blocks(score, cu_seqlens_q, cu_seqlens_k)
        return attn_output, topk_idx

    def select_blocks(self, score, cu_seqlens_q, cu_seqlens_k):
        """Top-k selection blocks [H_kv, total_q, topk] (ascending, -1 for padding)."""
        max_q = max(cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(len(cu_seqlens_q) - 1))
        max_k = max(cu_seqlens_k[i + 1] - cu_seqlens_k[i] for i in range(len(cu_seqlens_k) - 1))
        heads, total_q = score.shape[:2]
        per_doc = torch.zeros(heads, total_q, max_k, dtype=torch.float32, device=score.device)
        for b in range(len(cu_seqlens_q) - 1):
            k_len = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
            per_doc[:, cu_seqlens_q[b] : cu_seqlens_q[b + 1], :k_len] = \
                score[:, cu_seqlens_q[b] : cu_seqlens_q[b + 1], cu_seqlens_k[b] : cu_seqlens_k[b + 1]]
        ratio_k, ratio_b = self.kernel_size // self.kernel_stride, self.block_size // self.kernel_stride
        pad_len = ratio_k - 1
        per_doc = F.pad(per_doc, (pad_len, pad_len), value=0)
        max_blocks, full_blocks = -(-max_q // self.block_size), max_q // self.block_size
        block_score = torch.zeros(heads, total_q, max_blocks, dtype=torch.float32, device=score.device)
        offsets = Counter(a + c for a in range(ratio_k) for c in range(ratio_b))
        for offset, weight in offsets.items():
            block_score[..., :full_blocks] += weight * per_doc[..., offset::ratio_b][..., :full_blocks]
        q_idx = torch.cat([torch.arange(cu_seqlens_q[i + 1] - cu_seqlens_q[i], device=score.device)
                           for i in range(len(cu_seqlens_q) - 1)]) // self.block_size
        b_idx = torch.arange(max_blocks, device=score.device)
        block_score[..., :1] = torch.inf  # init block
        local_mask = (q_idx[:, None] >= b_idx[None, :]) & (q_idx[:, None] < b_idx[None, :] + 2)
        block_score[local_mask.unsqueeze(0).expand(heads, -1, -1)] = torch.inf  # current and previous block
        topk_idx = block_score.topk(min(self.topk, max_blocks), dim=-1).indices.sort(-1).values
        topk_idx[topk_idx > q_idx[None, :, None]] = -1
        return topk_idx

    def topk_sparse_attention(self, q, k, v, topk_idx, cu_seqlens):
        total, share = q.shape[0], self.num_q_heads // self.num_kv_heads
        mask = torch.zeros((self.num_kv_heads, total, total), dtype=torch.bool, device=q.device)
        for i in range(len(cu_seqlens) - 1):
            n = cu_seqlens[i + 1] - cu_seqlens[i]
            num_blocks = -(-n // self.block_size)
            idx = topk_idx[:, cu_seqlens[i] : cu_seqlens[i + 1]].clamp(min=0)  # padding -> block 0 (always chosen)
            block_mask = torch.zeros(self.num_kv_heads, n, num_blocks, dtype=torch.bool, device=q.device)
            block_mask = block_mask.scatter(-1, idx.clamp(max=num_blocks - 1), True)
            token_mask = block_mask.repeat_interleave(self.block_size, dim=-1)[..., :n]
            mask[:, cu_seqlens[i] : cu_seqlens[i + 1], cu_seqlens[i] : cu_seqlens[i + 1]] = token_mask
        mask = torch.tril(mask).repeat_interleave(share, 0)
        qk = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(share, 1)) * self.head_dim**-0.5
        qk = torch.masked_fill(qk, ~mask, -torch.inf)
        qk = torch.softmax(qk, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", qk, v.repeat_interleave(share, 1))

    def sliding_window_attention(self, q, k, v, cu_seqlens):
        total, share = q.shape[0], self.num_q_heads // self.num_kv_heads
        doc = torch.cat([torch.full((cu_seqlens[i + 1] - cu_seqlens[i],), i, device=q.device)
                         for i in range(len(cu_seqlens) - 1)])
        t = torch.arange(total, device=q.device)
        allowed = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] <= self.window_size)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(share, 1).transpose(0, 1)[None],
                                             v.repeat_interleave(share, 1).transpose(0, 1)[None], attn_mask=allowed)
        return out[0].transpose(0, 1)  # [total, H, D]


def make():
    torch.manual_seed(0)
    return VarlenNSA(), torch.randn(2, 96, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). One document per row, as the seed
    model trains in bench_e2e (the varlen layout packs the rows into batch * seq_len tokens); the
    window_size 511 of flash-attn's convention (w + 1 tokens) is the seed's 512 tokens."""
    torch.manual_seed(0)
    model = VarlenNSA(hidden_size=768, num_q_heads=12, num_kv_heads=2, kernel_size=32, kernel_stride=16,
                      block_size=64, topk=16, window_size=511, doc_lens=(seq_len,))
    return model, torch.randn(batch, seq_len, 768)
