"""NSA with flash-linear-attention's block choice and *tiled* GQA (`k.repeat(1, h, 1, 1)`).

Style: heads-first [B, H, S, D]; K/V repeated for GQA with `Tensor.repeat` over the head axis,
which tiles the KV heads (query head j reads KV head j % G, not j // h: the group of a query head
is {g, g + G, g + 2G, ...}); every group reduction follows that map (`view(B, h, G, ...).sum(1)`).
Compression by `F.pad` to a multiple of the block, then `view(...).mean(-2)`; the compressed
scores masked with -inf only on rows that see some block (the others softmax over all blocks and
are zeroed afterwards with `masked_fill`, as fla's earlier reference did); the window by
`F.scaled_dot_product_attention` with a boolean `attn_mask`; each branch's output multiplied by its
own sigmoid gate and the three summed with `+`. Rotate-half RoPE computed in `forward`.

Semantics (fla's variant): l = l' = d = 16 (non-overlapping blocks), block c visible iff
(c+1)*16 - 1 <= t; importance = the compressed probabilities summed over the (tiled) group, the
current block set to 1.0 before the sum; `topk` n = 3, blocks after the current one -> -1 after
the top-k. Window w = 24. Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class TiledGQANSA(nn.Module):
    def __init__(self, dim=48, n_head=6, n_kv_head=2, block=16, n_blocks=3, window=24):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, dim // n_head
        self.block, self.n_blocks, self.window = block, n_blocks, window
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_kv = nn.ModuleList(nn.Linear(dim, 2 * n_kv_head * self.hd, bias=False) for _ in range(3))
        self.c_gate = nn.Linear(dim, 3 * n_head)
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def rotary(self, x):  # [B, N, S, D]
        S, D = x.shape[-2], x.shape[-1]
        theta = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
        ang = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * theta[None, :]
        cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, x):  # x [B, S, dim]
        B, S, C = x.shape
        H, G, hd, BS = self.n_head, self.n_kv_head, self.hd, self.block
        rep = H // G
        q = self.rotary(self.c_q(x).view(B, S, H, hd).transpose(1, 2))  # [B, H, S, hd]
        kv = [proj(x).view(B, S, 2, G, hd).permute(2, 0, 3, 1, 4) for proj in self.c_kv]  # each [2, B, G, S, hd]
        (k_cmp, v_cmp), (k_sel, v_sel), (k_win, v_win) = [(self.rotary(k), v) for k, v in kv]
        gates = torch.sigmoid(self.c_gate(x)).view(B, S, H, 3).permute(3, 0, 2, 1).unsqueeze(-1)  # [3, B, H, S, 1]
        t = torch.arange(S, device=x.device)
        scale = 1.0 / hd**0.5

        # compressed: block means (the padded last block is never visible)
        nc = (S + BS - 1) // BS
        k_c = F.pad(k_cmp, (0, 0, 0, nc * BS - S)).view(B, G, nc, BS, hd).mean(-2).repeat(1, rep, 1, 1)
        v_c = F.pad(v_cmp, (0, 0, 0, nc * BS - S)).view(B, G, nc, BS, hd).mean(-2).repeat(1, rep, 1, 1)
        c = torch.arange(nc, device=x.device)
        hidden = (c[None, :] + 1) * BS - 1 > t[:, None]  # [S, nc]
        empty = hidden.all(-1, keepdim=True)
        att = (q @ k_c.transpose(-2, -1)) * scale
        att = att.masked_fill(hidden & ~empty, float("-inf")).softmax(dim=-1).masked_fill(empty, 0.0)
        o_cmp = att @ v_c  # [B, H, S, hd]

        # selection: current block favoured, summed over the tiled group, top-k, then future -> -1
        score = att.masked_fill((t[:, None] // BS) == c[None, :], 1.0).view(B, rep, G, S, nc).sum(1)  # [B, G, S, nc]
        idx = score.topk(min(self.n_blocks, nc), dim=-1).indices
        idx = idx.masked_fill(idx > (t // BS)[:, None], -1)  # [B, G, S, n]
        tok = idx.clamp(min=0)[..., None] * BS + torch.arange(BS, device=x.device)
        keep = ((idx >= 0)[..., None] & (tok <= t[:, None, None])).flatten(-2).repeat(1, rep, 1, 1)  # [B, H, S, n*BS]
        at = tok.flatten(-2).clamp(max=S - 1).flatten(2)[..., None].expand(-1, -1, -1, hd)
        k_s = k_sel.gather(2, at).view(B, G, S, -1, hd).repeat(1, rep, 1, 1, 1)  # [B, H, S, n*BS, hd]
        v_s = v_sel.gather(2, at).view(B, G, S, -1, hd).repeat(1, rep, 1, 1, 1)
        att_s = (q.unsqueeze(-2) @ k_s.transpose(-2, -1)).squeeze(-2) * scale
        o_sel = (att_s.masked_fill(~keep, float("-inf")).softmax(dim=-1).unsqueeze(-2) @ v_s).squeeze(-2)

        # sliding window
        mask = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.window)
        o_win = F.scaled_dot_product_attention(q, k_win.repeat(1, rep, 1, 1), v_win.repeat(1, rep, 1, 1), attn_mask=mask)

        y = o_cmp * gates[0] + o_sel * gates[1] + o_win * gates[2]
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, S, C))


def make():
    torch.manual_seed(0)
    return TiledGQANSA(), torch.randn(2, 71, 48)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) nearest the seed preset's shapes (models/config.py: dim
    768, 12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). fla's semantics tie l = l' = d to one
    block size: 64, the seed's l' (so the selected branch reads the seed's n * l' = 1024 tokens; the
    compressed branch sees S / 64 blocks where the seed sees about S / 16). GQA stays tiled."""
    torch.manual_seed(0)
    model = TiledGQANSA(dim=768, n_head=12, n_kv_head=2, block=64, n_blocks=16, window=512)
    return model, torch.randn(batch, seq_len, 768)
