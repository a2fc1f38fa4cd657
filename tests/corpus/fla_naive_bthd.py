"""NSA in the style of flash-linear-attention's `naive_nsa_with_compression` (fla/ops/nsa/naive.py).

Style: sequence-first `[B, T, H, D]` tensors everywhere; scores and outputs by `torch.einsum`
('bqhd,bkhd->bhqk', 'bhqk,bkhd->bqhd'), the scale folded into q; GQA by einops
`repeat('b t h d -> b t (h g) d')`, written as `unsqueeze(3).expand(...).flatten(2, 3)`; one k and v
shared by the three branches; rotate-half RoPE whose cos/sin are computed in `forward`; the
compressed probabilities' empty rows turned from NaN into 0 by `torch.nan_to_num`; the selected
K/V fetched by advanced indexing `k[batch, token, head]`; the gates (`sigmoid(g_proj(x))`, one per
query head and branch) multiplied inside the compressed and selected branches, the branches summed,
the window added with `torch.addcmul(o, o_swa, g_swa)`.

Semantics (fla's variant): l = l' = d = 16 (mean pooling over non-overlapping blocks, the last
block partial and never visible); block c visible to t iff (c+1)*16 - 1 <= t; block importance =
the compressed probabilities summed over the group's heads, with only the current block favoured
(its probability set to 1.0 before the sum); `topk` of n = 3, then blocks after the current one
turned into -1 *after* the top-k (no forced first or previous block). Window w = 16. Causal.
"""

import torch
import torch.nn as nn


def repeat_kv(x, g):  # 'b t h d -> b t (h g) d'
    B, T, H, D = x.shape
    return x.unsqueeze(3).expand(B, T, H, g, D).flatten(2, 3)


class NaiveNSA(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, num_kv_heads=2, block_size=16, block_counts=3, window_size=16,
                 rope_theta=10000.0):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.block_size, self.block_counts, self.window_size = block_size, block_counts, window_size
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, num_heads * 3, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def rotary(self, x):  # x [B, T, H, D], rotate-half
        T, D = x.shape[1], x.shape[-1]
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos()[:, None, :].to(x.dtype), freqs.sin()[:, None, :].to(x.dtype)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def mean_pooling(self, x):  # [B, T, H, D] -> [B, C, H, D], C = ceil(T / BS)
        B, T, H, D = x.shape
        BS = self.block_size
        C = (T + BS - 1) // BS
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, C * BS - T))
        counts = (T - torch.arange(C, device=x.device) * BS).clamp(max=BS)
        return x.view(B, C, BS, H, D).sum(2) / counts[None, :, None, None].to(x.dtype)

    def forward(self, hidden_states):  # [B, T, hidden]
        B, T, _ = hidden_states.shape
        HQ, H, BS = self.num_heads, self.num_kv_heads, self.block_size
        G = HQ // H
        scale = self.head_dim**-0.5
        q = self.rotary(self.q_proj(hidden_states).view(B, T, HQ, -1))
        k = self.rotary(self.k_proj(hidden_states).view(B, T, H, -1))
        v = self.v_proj(hidden_states).view(B, T, H, -1)
        g_cmp, g_slc, g_swa = self.g_proj(hidden_states).view(B, T, HQ, 3).sigmoid().unbind(-1)

        # compression
        k_cmp, v_cmp = self.mean_pooling(k), self.mean_pooling(v)
        C = k_cmp.shape[1]
        S = min(self.block_counts, C)
        k_cmp, v_cmp = repeat_kv(k_cmp, G), repeat_kv(v_cmp, G)
        i_t = torch.arange(T, device=q.device)
        casual_mask = ((i_t - BS + 1)[:, None] // BS) < torch.arange(C, device=q.device)[None, :]
        local_mask = (i_t[:, None] // BS) == torch.arange(C, device=q.device)[None, :]
        attn_cmp = torch.einsum("bqhd,bkhd->bhqk", q * scale, k_cmp)
        attn_cmp = attn_cmp.masked_fill(casual_mask, float("-inf"))
        attn_cmp = torch.nan_to_num(attn_cmp.softmax(-1), nan=0.0)
        o_cmp = torch.einsum("bhqk,bkhd->bqhd", attn_cmp, v_cmp) * g_cmp.unsqueeze(-1)

        # selection: favour the current block, top-k, then drop blocks after the current one
        attn_select = attn_cmp.masked_fill(local_mask, 1.0)
        attn_select = attn_select.view(B, H, G, T, C).sum(2)
        block_indices = attn_select.topk(S, -1)[1]
        block_indices = block_indices.masked_fill(block_indices > (i_t[:, None] // BS), -1)
        block_indices = block_indices.transpose(1, 2)  # [B, T, H, S]

        # selected attention
        tokens = (block_indices.clamp(min=0).unsqueeze(-1) * BS + torch.arange(BS, device=q.device)).flatten(-2)
        invalid = (block_indices < 0).repeat_interleave(BS, dim=-1) | (tokens > i_t[None, :, None, None])
        tokens = tokens.clamp(max=T - 1)  # [B, T, H, S*BS]
        b_idx = torch.arange(B, device=q.device)[:, None, None, None]
        h_idx = torch.arange(H, device=q.device)[None, None, :, None]
        k_slc, v_slc = k[b_idx, tokens, h_idx], v[b_idx, tokens, h_idx]  # [B, T, H, S*BS, D]
        k_slc = k_slc.unsqueeze(3).expand(-1, -1, -1, G, -1, -1).flatten(2, 3)  # [B, T, HQ, S*BS, D]
        v_slc = v_slc.unsqueeze(3).expand(-1, -1, -1, G, -1, -1).flatten(2, 3)
        invalid = invalid.unsqueeze(3).expand(-1, -1, -1, G, -1).flatten(2, 3)
        attn_slc = torch.einsum("bthd,bthnd->bthn", q * scale, k_slc).masked_fill(invalid, float("-inf"))
        o_slc = torch.einsum("bthn,bthnd->bthd", attn_slc.softmax(-1), v_slc) * g_slc.unsqueeze(-1)

        # sliding window
        k_idx = i_t[None, :]
        swa_mask = (k_idx > i_t[:, None]) | (i_t[:, None] - k_idx >= self.window_size)
        attn_swa = torch.einsum("bthd,bkhd->bhtk", q * scale, repeat_kv(k, G)).masked_fill(swa_mask, float("-inf"))
        o_swa = torch.einsum("bhtk,bkhd->bthd", attn_swa.softmax(-1), repeat_kv(v, G))

        o = torch.addcmul(o_slc + o_cmp, o_swa, g_swa.unsqueeze(-1))
        return self.o_proj(o.reshape(B, T, -1))


def make():
    torch.manual_seed(0)
    return NaiveNSA(), torch.randn(2, 65, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) nearest the seed preset's shapes (models/config.py: dim
    768, 12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). fla's semantics tie l = l' = d to one
    block size: 64, the seed's l' (so the selected branch reads the seed's n * l' = 1024 tokens; the
    compressed branch sees S / 64 blocks where the seed sees about S / 16)."""
    torch.manual_seed(0)
    model = NaiveNSA(hidden_size=768, num_heads=12, num_kv_heads=2, block_size=64, block_counts=16, window_size=512)
    return model, torch.randn(batch, seq_len, 768)
