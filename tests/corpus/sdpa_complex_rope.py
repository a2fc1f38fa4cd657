"""NSA written independently from the paper, with `F.scaled_dot_product_attention` in every branch.

Style: a Llama-trained author's version: RoPE by complex multiplication (`torch.view_as_complex`
with `freqs_cis` built by `torch.polar` inside `forward`, pairs (2i, 2i + 1)); heads-first
[B, H, S, D]; each branch an SDPA call with an explicit `attn_mask`: the window with an *additive*
float mask (0 or -inf), the compressed branch with an additive mask of `finfo.min` (finite, so a
query that sees no block gets the uniform average of all blocks, zeroed afterwards with
`masked_fill`), the selected branch as 5-D SDPA (`[B, H, S, 1, D]` queries over the gathered
`[B, H, S, n*l', D]` keys) with a boolean mask. The compressed probabilities that selection needs
are recomputed from the same scores with `torch.softmax`. GQA by `repeat_interleave`; compression
by the paper's MLP (intra-block position embedding, Linear, SiLU, Linear) over `unfold` windows;
the group gate (mean of the group's queries -> MLP -> softmax), combined as
`(torch.stack(branches, -1) * gate.unsqueeze(-2)).sum(-1)`.

Semantics (the paper's): l = 8, d = 4, block i visible iff i*d + l - 1 <= t; importance = the
compressed probabilities mapped onto l' = 16 blocks by overlap / l and summed over the group;
forced {0, current, previous}; `topk` of n = 4 over the ranking key (+inf forced, -inf not a
candidate), then `sort` of the indices, -inf picks turned into -1. Window w = 20. Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def apply_rotary_emb(x, freqs_cis):  # x [B, N, S, D], freqs_cis [S, D/2] complex
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(-2).type_as(x)


class Compressor(nn.Module):
    def __init__(self, block, head_dim):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(block, head_dim) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(block * head_dim, head_dim), nn.SiLU(), nn.Linear(head_dim, head_dim))

    def forward(self, windows):  # [B, G, Tc, D, l] -> [B, G, Tc, D]
        return self.mlp((windows.transpose(-1, -2) + self.pe).flatten(-2))


class SDPANSA(nn.Module):
    def __init__(self, dim=64, n_heads=4, n_kv_heads=2, block=8, stride=4, sel_block=16, n_sel=4, window=20):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.block, self.stride, self.sel_block, self.n_sel, self.window = block, stride, sel_block, n_sel, window
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, 3 * n_kv_heads * self.head_dim, bias=False)  # cmp, sel, win
        self.wv = nn.Linear(dim, 3 * n_kv_heads * self.head_dim, bias=False)
        self.compress_k = Compressor(block, self.head_dim)
        self.compress_v = Compressor(block, self.head_dim)
        self.gate = nn.Sequential(nn.Linear(self.head_dim, self.head_dim // 2), nn.SiLU(), nn.Linear(self.head_dim // 2, 3))
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        device, Hd = x.device, self.head_dim
        freqs = 1.0 / (10000.0 ** (torch.arange(0, Hd, 2, device=device).float() / Hd))
        freqs_cis = torch.polar(torch.ones(S, Hd // 2, device=device),
                                torch.outer(torch.arange(S, device=device).float(), freqs))  # [S, D/2]
        q = apply_rotary_emb(self.wq(x).view(B, S, self.n_heads, Hd).transpose(1, 2), freqs_cis)  # [B, H, S, D]
        k_cmp, k_sel, k_win = self.wk(x).view(B, S, 3, self.n_kv_heads, Hd).permute(2, 0, 3, 1, 4)  # [B, G, S, D]
        v_cmp, v_sel, v_win = self.wv(x).view(B, S, 3, self.n_kv_heads, Hd).permute(2, 0, 3, 1, 4)
        k_cmp, k_sel, k_win = (apply_rotary_emb(k, freqs_cis) for k in (k_cmp, k_sel, k_win))
        t = torch.arange(S, device=device)
        scale = Hd**-0.5

        # compressed branch
        kc = self.compress_k(k_cmp.unfold(2, self.block, self.stride)).repeat_interleave(self.n_rep, dim=1)  # [B, H, Tc, D]
        vc = self.compress_v(v_cmp.unfold(2, self.block, self.stride)).repeat_interleave(self.n_rep, dim=1)
        Tc = kc.shape[2]
        i = torch.arange(Tc, device=device)
        visible = i[None, :] * self.stride + self.block - 1 <= t[:, None]  # [S, Tc]
        bias = torch.zeros(S, Tc, device=device, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
        o_cmp = F.scaled_dot_product_attention(q, kc, vc, attn_mask=bias)
        empty = ~visible.any(-1)[:, None]  # [S, 1]
        o_cmp = o_cmp.masked_fill(empty, 0.0)
        p_cmp = torch.softmax(((q @ kc.transpose(-1, -2)) * scale + bias).float(), dim=-1).masked_fill(empty, 0.0)

        # block selection
        Ns = -(-S // self.sel_block)
        j = torch.arange(Ns, device=device)
        lo = torch.maximum(i[:, None] * self.stride, j[None, :] * self.sel_block)
        hi = torch.minimum(i[:, None] * self.stride + self.block, (j[None, :] + 1) * self.sel_block)
        p_slc = p_cmp @ ((hi - lo).clamp(min=0).float() / self.block)  # [B, H, S, Ns]
        p_grp = p_slc.unflatten(1, (self.n_kv_heads, self.n_rep)).sum(2)  # [B, G, S, Ns]
        cur = (t // self.sel_block)[:, None]
        forced = (j == 0) | (j == cur) | (j == cur - 1)
        key = torch.where(forced, torch.inf, torch.where(j * self.sel_block <= t[:, None], p_grp, -torch.inf))
        top_val, top_idx = key.topk(min(self.n_sel, Ns), dim=-1)
        top_idx = torch.where(top_val > -torch.inf, top_idx, Ns)  # unchosen sort last
        idx = top_idx.sort(dim=-1).values
        idx = torch.where(idx == Ns, -1, idx)  # [B, G, S, n]

        # selected branch
        tok = idx.clamp(min=0)[..., None] * self.sel_block + torch.arange(self.sel_block, device=device)
        ok = ((idx >= 0)[..., None] & (tok <= t[:, None, None])).flatten(-2)  # [B, G, S, n*l']
        gather_at = tok.flatten(-2).clamp(max=S - 1).flatten(2)[..., None].expand(-1, -1, -1, Hd)
        ks = torch.gather(k_sel, 2, gather_at).view(B, self.n_kv_heads, S, -1, Hd).repeat_interleave(self.n_rep, dim=1)
        vs = torch.gather(v_sel, 2, gather_at).view(B, self.n_kv_heads, S, -1, Hd).repeat_interleave(self.n_rep, dim=1)
        o_sel = F.scaled_dot_product_attention(q.unsqueeze(-2), ks, vs,
                                               attn_mask=ok.repeat_interleave(self.n_rep, dim=1).unsqueeze(-2))
        o_sel = o_sel.squeeze(-2)

        # sliding window, additive mask
        in_window = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.window)
        window_bias = torch.zeros(S, S, device=device, dtype=q.dtype).masked_fill(~in_window, float("-inf"))
        o_win = F.scaled_dot_product_attention(q, k_win.repeat_interleave(self.n_rep, dim=1),
                                               v_win.repeat_interleave(self.n_rep, dim=1), attn_mask=window_bias)

        q_bar = q.transpose(1, 2).unflatten(2, (self.n_kv_heads, self.n_rep)).mean(3)  # [B, S, G, D]
        gate = torch.softmax(self.gate(q_bar), dim=-1).repeat_interleave(self.n_rep, dim=2).transpose(1, 2)  # [B, H, S, 3]
        o = (torch.stack([o_cmp, o_sel, o_win], dim=-1) * gate.unsqueeze(-2)).sum(-1)  # [B, H, S, D]
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


def make():
    torch.manual_seed(0)
    return SDPANSA(), torch.randn(2, 90, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). Exactly the seed's sizes; the
    compression stays this model's MLP (the paper's, as the `paper` preset's)."""
    torch.manual_seed(0)
    model = SDPANSA(dim=768, n_heads=12, n_kv_heads=2, block=32, stride=16, sel_block=64, n_sel=16, window=512)
    return model, torch.randn(batch, seq_len, 768)
