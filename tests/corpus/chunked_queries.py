"""NSA written independently from the paper, memory-bounded by a Python loop over query chunks.

Style: the queries are processed in chunks of 32 rows (a loop over `range(0, S, chunk)` that
torch.compile unrolls: one softmax per branch and chunk), each chunk's outputs concatenated at
the end; heads-first [B, H, S, D]; masks filled with the constant `-1e9` (finite: compressed rows
with no visible block are zeroed after the softmax); the window through
`F.scaled_dot_product_attention(..., attn_mask=band, enable_gqa=True)` over the chunk's key range
only (no K/V repeat); the other branches repeat K/V with `repeat_interleave`; interleaved RoPE
from cos/sin tables computed in `forward`; the paper's per-head sigmoid gate.

Semantics (the paper's): l = 8, d = 4, block i visible iff i*d + l - 1 <= t; importance by overlap
/ l onto l' = 16 blocks, summed over the group; forced {0, current, previous}; top n = 4 by a
stable descending sort, ascending, -1 padding; window w = 16. Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG = -1e9


def rope_interleaved(x, cos, sin):  # x [B, N, S, D]; cos, sin [S, D/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class ChunkedNSA(nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2, l=8, d=4, l_sel=16, n=4, window=16, chunk=32):
        super().__init__()
        self.H, self.G, self.D = heads, kv_heads, dim // heads
        self.l, self.d, self.l_sel, self.n, self.window, self.chunk = l, d, l_sel, n, window, chunk
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, 3 * kv_heads * self.D, bias=False)
        self.v_proj = nn.Linear(dim, 3 * kv_heads * self.D, bias=False)
        self.g_proj = nn.Linear(dim, 3 * heads)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        H, G, D = self.H, self.G, self.D
        h = H // G
        scale = D**-0.5
        inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=x.device).float() / D)
        ang = torch.arange(S, device=x.device).float()[:, None] * inv_freq
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        q = rope_interleaved(self.q_proj(x).view(B, S, H, D).transpose(1, 2), cos, sin)  # [B, H, S, D]
        k = self.k_proj(x).view(B, S, 3, G, D).permute(2, 0, 3, 1, 4)  # [3, B, G, S, D]
        v = self.v_proj(x).view(B, S, 3, G, D).permute(2, 0, 3, 1, 4)
        k_cmp, k_sel, k_win = (rope_interleaved(k[b], cos, sin) for b in range(3))
        v_cmp, v_sel, v_win = v[0], v[1], v[2]
        g = torch.sigmoid(self.g_proj(x)).view(B, S, H, 3).transpose(1, 2)  # [B, H, S, 3]

        kc = k_cmp.unfold(2, self.l, self.d).mean(-1).repeat_interleave(h, dim=1)  # [B, H, Tc, D]
        vc = v_cmp.unfold(2, self.l, self.d).mean(-1).repeat_interleave(h, dim=1)
        Tc, Ns = kc.shape[2], -(-S // self.l_sel)
        i = torch.arange(Tc, device=x.device)
        j = torch.arange(Ns, device=x.device)
        overlap = (torch.minimum(i[:, None] * self.d + self.l, (j + 1) * self.l_sel)
                   - torch.maximum(i[:, None] * self.d, j * self.l_sel)).clamp(min=0).to(x.dtype) / self.l  # [Tc, Ns]
        offsets = torch.arange(self.l_sel, device=x.device)

        outs = []
        for s0 in range(0, S, self.chunk):
            s1 = min(s0 + self.chunk, S)
            qc, t = q[:, :, s0:s1], torch.arange(s0, s1, device=x.device)

            visible = i[None, :] * self.d + self.l - 1 <= t[:, None]  # [c, Tc]
            p_cmp = ((qc @ kc.transpose(-1, -2)) * scale).masked_fill(~visible, NEG).softmax(-1)
            p_cmp = p_cmp.masked_fill(~visible.any(-1, keepdim=True), 0.0)
            o_cmp = p_cmp @ vc

            p_grp = (p_cmp @ overlap).view(B, G, h, s1 - s0, Ns).sum(2)  # [B, G, c, Ns]
            cur = (t // self.l_sel)[:, None]
            forced = (j == 0) | (j == cur) | (j == cur - 1)
            key = torch.where(forced, float("inf"), torch.where(j * self.l_sel <= t[:, None], p_grp, float("-inf")))
            key = F.pad(key, (0, max(0, self.n - Ns)), value=float("-inf"))
            val, order = key.sort(dim=-1, descending=True, stable=True)
            top = torch.where(val[..., : self.n] > float("-inf"), order[..., : self.n], key.shape[-1]).sort(-1).values
            top = torch.where(top == key.shape[-1], -1, top)  # [B, G, c, n]
            tok = top.clamp(min=0)[..., None] * self.l_sel + offsets
            ok = ((top >= 0)[..., None] & (tok <= t[:, None, None])).flatten(-2).repeat_interleave(h, dim=1)
            at = tok.flatten(-2).clamp(max=S - 1).flatten(2)[..., None].expand(-1, -1, -1, D)
            ks = torch.gather(k_sel, 2, at).view(B, G, s1 - s0, -1, D).repeat_interleave(h, dim=1)
            vs = torch.gather(v_sel, 2, at).view(B, G, s1 - s0, -1, D).repeat_interleave(h, dim=1)
            s_sel = (qc.unsqueeze(-2) @ ks.transpose(-1, -2)).squeeze(-2) * scale
            o_sel = (s_sel.masked_fill(~ok, NEG).softmax(-1).unsqueeze(-2) @ vs).squeeze(-2)

            k0 = max(0, s0 - self.window + 1)
            s = torch.arange(k0, s1, device=x.device)
            band = (s[None, :] <= t[:, None]) & (t[:, None] - s[None, :] < self.window)
            o_win = F.scaled_dot_product_attention(qc, k_win[:, :, k0:s1], v_win[:, :, k0:s1], attn_mask=band,
                                                   enable_gqa=True)

            gc = g[:, :, s0:s1]
            outs.append(gc[..., 0:1] * o_cmp + gc[..., 1:2] * o_sel + gc[..., 2:3] * o_win)
        o = torch.cat(outs, dim=2)  # [B, H, S, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


def make():
    torch.manual_seed(0)
    return ChunkedNSA(), torch.randn(2, 100, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). The seed's sizes; query chunks of 512
    rows, so that S 2048 unrolls into 4 chunks as make()'s 100 tokens in chunks of 32 do."""
    torch.manual_seed(0)
    model = ChunkedNSA(dim=768, heads=12, kv_heads=2, l=32, d=16, l_sel=64, n=16, window=512, chunk=512)
    return model, torch.randn(batch, seq_len, 768)
