"""NSA in the style of the nsa-vibe project (seconds-0/nsa-vibe, nsa/core): NOT CAUSAL, on purpose.

Style: queries grouped 5-D `[B, S, G, h, D]`, keys and values `[B, G, S, D]` with their own
projections per branch; interleaved RoPE through `x.view(..., D // 2, 2)` with sin/cos computed in
`forward` from integer positions; the compressed keys pooled by `F.avg_pool2d` on a
`[B*G, D, S, 1]` view; selection scores by `einsum('bsghd,bgdc->bsghc')`, mapped onto selection
blocks through a COO list of (compressed block, selection block, weight) and `scatter_add`, then
summed over the group's heads; forced blocks marked by `scatter_`, a tiny index bias as the
tie-break before `topk`, forced and chosen blocks concatenated, de-duplicated and sorted; the
window by `F.scaled_dot_product_attention` with a boolean `attn_mask`; a gate MLP (mean of the
group's queries -> Linear -> SiLU -> Linear -> softmax) weighting the three branches.

Semantics and the bug: the selection scores have no causal mask at all. `p_cmp` is a softmax over
*all* compressed blocks (each head's normalizer includes blocks that end after t), and every
selection block, future ones included, competes for the free top-n slots. The selected attention
masks the tokens after t, so a chosen future block adds nothing itself, but it takes a slot that a
past block would have had: which past tokens the query at t attends to depends on the tokens
after t. Compressed branch: l = 8, d = 4, causally masked (block i visible iff i*d + l - 1 <= t),
empty rows zeroed after the softmax. Selection: l' = 8, forced {0, current, previous}, n = 5.
Window w = 16. NOT causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def apply_rope(x, pos, base=10000.0):
    """Interleaved RoPE on x [..., S, D] at integer positions pos [S]."""
    D = x.shape[-1]
    inv_freq = base ** (-2 * torch.arange(D // 2, device=x.device, dtype=torch.float32) / D)
    angles = pos.to(torch.float32).unsqueeze(-1) * inv_freq  # [S, D/2]
    sin, cos = torch.sin(angles).to(x.dtype), torch.cos(angles).to(x.dtype)
    x_2 = x.view(*x.shape[:-1], D // 2, 2)
    x0, x1 = x_2[..., 0], x_2[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).view_as(x)


class GateMLP(nn.Module):
    def __init__(self, d_k):
        super().__init__()
        self.fc1 = nn.Linear(d_k, d_k // 2)
        self.fc2 = nn.Linear(d_k // 2, 3)

    def forward(self, q_group_pooled):  # [B, S, G, Dk] -> [B, S, G, 3]
        return F.softmax(self.fc2(F.silu(self.fc1(q_group_pooled))), dim=-1)


class VibeNSA(nn.Module):
    def __init__(self, dim=64, n_heads=4, n_kv_groups=2, d_k=16, d_v=16, l=8, d=4, l_sel=8, n_sel=5, w=16):
        super().__init__()
        self.n_heads, self.n_kv_groups, self.h_per_group = n_heads, n_kv_groups, n_heads // n_kv_groups
        self.d_k, self.d_v, self.l, self.d, self.l_sel, self.n_sel, self.w = d_k, d_v, l, d, l_sel, n_sel, w
        self.W_Q = nn.Linear(dim, n_heads * d_k, bias=False)
        self.W_K_sel = nn.Linear(dim, n_kv_groups * d_k, bias=False)
        self.W_V_sel = nn.Linear(dim, n_kv_groups * d_v, bias=False)
        self.W_K_win = nn.Linear(dim, n_kv_groups * d_k, bias=False)
        self.W_V_win = nn.Linear(dim, n_kv_groups * d_v, bias=False)
        self.W_K_cmp = nn.Linear(dim, n_kv_groups * d_k, bias=False)
        self.W_V_cmp = nn.Linear(dim, n_kv_groups * d_v, bias=False)
        self.gate = GateMLP(d_k)
        self.out = nn.Linear(n_heads * d_v, dim, bias=False)

    def _shape_kv(self, X, B, S):  # [B, S, G*D] -> [B, G, S, D]
        return X.view(B, S, self.n_kv_groups, -1).transpose(1, 2)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        G, h, l, d, l_sel = self.n_kv_groups, self.h_per_group, self.l, self.d, self.l_sel
        pos = torch.arange(S, device=x.device)
        Q = apply_rope(self.W_Q(x).view(B, S, self.n_heads, self.d_k).transpose(1, 2), pos)  # [B, H, S, Dk]
        Q = Q.transpose(1, 2).reshape(B, S, G, h, self.d_k)
        K_sel = apply_rope(self._shape_kv(self.W_K_sel(x), B, S), pos)
        V_sel = self._shape_kv(self.W_V_sel(x), B, S)
        K_win = apply_rope(self._shape_kv(self.W_K_win(x), B, S), pos)
        V_win = self._shape_kv(self.W_V_win(x), B, S)
        K_raw = apply_rope(self._shape_kv(self.W_K_cmp(x), B, S), pos)  # RoPE before phi
        V_raw = self._shape_kv(self.W_V_cmp(x), B, S)

        # phi: average pooling over time with kernel l, stride d
        Kp = F.avg_pool2d(K_raw.reshape(B * G, S, -1).transpose(1, 2).unsqueeze(3), kernel_size=(l, 1), stride=(d, 1))
        Vp = F.avg_pool2d(V_raw.reshape(B * G, S, -1).transpose(1, 2).unsqueeze(3), kernel_size=(l, 1), stride=(d, 1))
        S_cmp = Kp.shape[2]
        K_cmp = Kp.squeeze(3).transpose(1, 2).reshape(B, G, S_cmp, -1)
        V_cmp = Vp.squeeze(3).transpose(1, 2).reshape(B, G, S_cmp, -1)
        scale = 1.0 / (self.d_k**0.5)

        # selection scores: softmax over ALL compressed blocks (the causal mask is missing here)
        logits = torch.einsum("bsghd,bgdc->bsghc", Q, K_cmp.permute(0, 1, 3, 2)) * scale
        p_cmp_all = F.softmax(logits, dim=-1)  # [B, S, G, h, S_cmp]
        S_sel = (S + l_sel - 1) // l_sel
        rows, cols, weights = [], [], []
        for r in range(S_cmp):
            for c in range(S_sel):
                overlap = min(r * d + l, (c + 1) * l_sel) - max(r * d, c * l_sel)
                if overlap > 0:
                    rows.append(r), cols.append(c), weights.append(overlap / l)
        rows, cols = torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)
        p_src = p_cmp_all[..., rows] * torch.tensor(weights, device=x.device, dtype=p_cmp_all.dtype)
        p_slc = torch.zeros(B, S, G, h, S_sel, device=x.device, dtype=p_cmp_all.dtype)
        p_slc = p_slc.scatter_add(-1, cols.view(1, 1, 1, 1, -1).expand(B, S, G, h, -1), p_src)
        p_grp = p_slc.sum(dim=3)  # [B, S, G, S_sel]
        block_idx = self.select(p_grp, S)  # [B, S, G, n_sel]

        O_cmp = self.compressed_attention(Q, K_cmp, V_cmp, scale)
        O_sel = self.selected_attention(Q, K_sel, V_sel, block_idx, scale)
        O_win = self.window_attention(Q, K_win, V_win)

        p = self.gate(Q.mean(dim=3))  # [B, S, G, 3]
        w_cmp, w_sel, w_win = p[..., 0:1].unsqueeze(-1), p[..., 1:2].unsqueeze(-1), p[..., 2:3].unsqueeze(-1)
        O = w_cmp * O_cmp + w_sel * O_sel + w_win * O_win  # [B, S, G, h, Dv]
        return self.out(O.reshape(B, S, -1))

    def select(self, p_grp, S):
        B, _, G, S_sel = p_grp.shape
        device = p_grp.device
        last_block = torch.arange(S, device=device) // self.l_sel
        forced = torch.stack([torch.zeros_like(last_block), last_block, (last_block - 1).clamp_min(0)], dim=-1)
        forced = forced.view(1, S, 1, 3).expand(B, S, G, 3)
        forced_mask = torch.zeros_like(p_grp, dtype=torch.bool).scatter_(-1, forced, True)
        masked = p_grp.masked_fill(forced_mask, float("-inf"))  # no candidate mask: future blocks compete
        composite = masked.to(torch.float32) - torch.arange(S_sel, device=device, dtype=torch.float32) * 1e-8
        _, top_idx = torch.topk(composite, k=min(self.n_sel - 3, S_sel), dim=-1, largest=True, sorted=True)
        selected = torch.cat([forced, top_idx], dim=-1).sort(dim=-1).values
        duplicate = F.pad(selected[..., 1:] == selected[..., :-1], (1, 0), value=False)
        return torch.where(duplicate, -1, selected).sort(dim=-1).values

    def compressed_attention(self, Q, K_cmp, V_cmp, scale):
        S, S_cmp = Q.shape[1], K_cmp.shape[2]
        tpos = torch.arange(S, device=Q.device)
        num_cmp = torch.where(tpos + 1 < self.l, 0, (tpos + 1 - self.l) // self.d + 1)  # [S]
        allowed = torch.arange(S_cmp, device=Q.device)[None, :] < num_cmp[:, None]  # [S, S_cmp]
        have_any = (num_cmp > 0).view(1, S, 1, 1, 1)
        logits = torch.einsum("bsghd,bgcd->bsghc", Q, K_cmp) * scale
        logits = logits.masked_fill(~allowed.view(1, S, 1, 1, S_cmp), float("-inf"))
        p = torch.softmax(logits, dim=-1).masked_fill(~have_any, 0.0)
        return torch.einsum("bsghc,bgcd->bsghd", p, V_cmp)

    def selected_attention(self, Q, K, V, block_idx, scale):
        B, S, G, h, _ = Q.shape
        offsets = torch.arange(self.l_sel, device=Q.device)
        tok = block_idx.clamp_min(0).unsqueeze(-1) * self.l_sel + offsets  # [B, S, G, n, l']
        tpos = torch.arange(S, device=Q.device).view(1, S, 1, 1, 1)
        ok = ((block_idx >= 0).unsqueeze(-1) & (tok <= tpos)).flatten(-2)  # [B, S, G, n*l']
        tok = tok.flatten(-2).clamp_max(S - 1)
        idx = tok.permute(0, 2, 1, 3).reshape(B, G, -1, 1)  # [B, G, S*n*l', 1]
        K_g = torch.gather(K, 2, idx.expand(-1, -1, -1, K.shape[-1])).view(B, G, S, -1, K.shape[-1])
        V_g = torch.gather(V, 2, idx.expand(-1, -1, -1, V.shape[-1])).view(B, G, S, -1, V.shape[-1])
        logits = torch.einsum("bsghd,bgsnd->bsghn", Q, K_g) * scale
        logits = logits.masked_fill(~ok.unsqueeze(3), float("-inf"))
        return torch.einsum("bsghn,bgsnd->bsghd", torch.softmax(logits, dim=-1), V_g)

    def window_attention(self, Q, K, V):
        B, S, G, h, Dk = Q.shape
        q = Q.reshape(B, S, G * h, Dk).transpose(1, 2)  # [B, H, S, Dk]
        k, v = K.repeat_interleave(h, dim=1), V.repeat_interleave(h, dim=1)
        t = torch.arange(S, device=Q.device)
        band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - self.w)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return o.transpose(1, 2).reshape(B, S, G, h, -1)


def make():
    torch.manual_seed(0)
    return VibeNSA(), torch.randn(2, 96, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). Exactly the seed's sizes and gate;
    the selection scores stay unmasked (not causal), as this model has them."""
    torch.manual_seed(0)
    model = VibeNSA(dim=768, n_heads=12, n_kv_groups=2, d_k=64, d_v=64, l=32, d=16, l_sel=64, n_sel=16, w=512)
    return model, torch.randn(batch, seq_len, 768)
