"""NSA written independently from the paper (arXiv 2502.11089), heads-first [B, H, S, D].

Style: a researcher's first eager version, read off the paper's equations. Scores by matmul,
`p @ v` by einsum; each branch masks the scores in the input dtype *before* the upcast
(`masked_fill(-inf)` then `.float()` through `softmax(dim=-1, dtype=torch.float32)`); the
compressed branch's rows without a visible block are zeroed *after* the softmax
(`masked_fill(empty, 0)`); RoPE (rotate-half) from cos/sin tables cached as buffers at
construction; GQA by `repeat_interleave`; the paper's per-head sigmoid gate, combined as
`g[..., 0:1] * o_cmp + ...`.

Semantics (the paper's, as NSA_SEMANTICS.md reads it): compression blocks of l = 8 tokens at
stride d = 4 (mean pooling through `unfold`), block i visible to t iff i*d + l - 1 <= t;
importance = compressed probabilities mapped onto selection blocks of l' = 16 by token overlap / l,
summed over the group's heads; forced blocks {0, current, previous}; the top n = 4 by a stable
descending sort, ascending, padded with -1; window w = 16. Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class PaperNSA(nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2, l=8, d=4, l_sel=16, n_sel=4, window=16, max_len=256):
        super().__init__()
        self.H, self.G, self.D = heads, kv_heads, dim // heads
        self.l, self.d, self.l_sel, self.n_sel, self.window = l, d, l_sel, n_sel, window
        self.scale = self.D**-0.5
        self.to_q = nn.Linear(dim, heads * self.D, bias=False)
        self.to_k = nn.ModuleList(nn.Linear(dim, kv_heads * self.D, bias=False) for _ in range(3))
        self.to_v = nn.ModuleList(nn.Linear(dim, kv_heads * self.D, bias=False) for _ in range(3))
        self.to_gate = nn.Linear(dim, 3 * heads)
        self.to_out = nn.Linear(heads * self.D, dim, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.D, 2).float() / self.D)
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)  # [max_len, D/2]
        self.register_buffer("cos_cached", torch.cat([freqs.cos(), freqs.cos()], -1), persistent=False)
        self.register_buffer("sin_cached", torch.cat([freqs.sin(), freqs.sin()], -1), persistent=False)

    def rope(self, x):  # x [B, N, S, D]
        S = x.shape[2]
        cos, sin = self.cos_cached[:S].to(x.dtype), self.sin_cached[:S].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def heads(self, t, n):  # [B, S, n*D] -> [B, n, S, D]
        B, S, _ = t.shape
        return t.view(B, S, n, self.D).transpose(1, 2)

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        h = self.H // self.G
        q = self.rope(self.heads(self.to_q(x), self.H))  # [B, H, S, D]
        ks = [self.heads(proj(x), self.G) for proj in self.to_k]
        vs = [self.heads(proj(x), self.G) for proj in self.to_v]
        k_cmp, k_sel, k_win = (self.rope(k) for k in ks)  # [B, G, S, D]
        v_cmp, v_sel, v_win = vs
        t = torch.arange(S, device=x.device)

        # compressed branch: mean of l tokens every d tokens
        kc = k_cmp.unfold(2, self.l, self.d).mean(-1).repeat_interleave(h, dim=1)  # [B, H, Tc, D]
        vc = v_cmp.unfold(2, self.l, self.d).mean(-1).repeat_interleave(h, dim=1)
        Tc = kc.shape[2]
        i = torch.arange(Tc, device=x.device)
        visible = i[None, :] * self.d + self.l - 1 <= t[:, None]  # [S, Tc]
        empty = ~visible.any(-1, keepdim=True)  # [S, 1]
        scores = (q @ kc.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~visible, float("-inf"))  # masked before the upcast
        p_cmp = scores.softmax(dim=-1, dtype=torch.float32).masked_fill(empty, 0.0)  # [B, H, S, Tc]
        o_cmp = torch.einsum("bhst,bhtd->bhsd", p_cmp.to(vc.dtype), vc)

        # importance of selection blocks: token overlap of compression block i and selection block j
        Ns = (S + self.l_sel - 1) // self.l_sel
        j = torch.arange(Ns, device=x.device)
        start = i[:, None] * self.d
        overlap = (torch.minimum(start + self.l, (j[None, :] + 1) * self.l_sel)
                   - torch.maximum(start, j[None, :] * self.l_sel)).clamp(min=0)
        p_slc = p_cmp @ (overlap.float() / self.l)  # [B, H, S, Ns]
        p_grp = p_slc.view(B, self.G, h, S, Ns).sum(2)  # [B, G, S, Ns]
        cur = (t // self.l_sel)[:, None]
        forced = (j[None, :] == 0) | (j[None, :] == cur) | (j[None, :] == cur - 1)
        candidate = j[None, :] * self.l_sel <= t[:, None]
        rank = torch.where(forced, float("inf"), torch.where(candidate, p_grp, float("-inf")))
        rank = F.pad(rank, (0, max(0, self.n_sel - Ns)), value=float("-inf"))
        values, order = rank.sort(dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., : self.n_sel] > float("-inf"), order[..., : self.n_sel], -1)  # [B, G, S, n]

        # selected branch: gather the chosen blocks' tokens per query
        offs = torch.arange(self.l_sel, device=x.device)
        tok = chosen.clamp(min=0)[..., None] * self.l_sel + offs  # [B, G, S, n, l']
        ok = ((chosen >= 0)[..., None] & (tok <= t[:, None, None])).flatten(-2)  # [B, G, S, n*l']
        tok = tok.flatten(-2).clamp(max=S - 1)
        idx = tok.flatten(2)[..., None].expand(-1, -1, -1, self.D)
        ks_ = torch.gather(k_sel, 2, idx).view(B, self.G, S, -1, self.D).repeat_interleave(h, dim=1)
        vs_ = torch.gather(v_sel, 2, idx).view(B, self.G, S, -1, self.D).repeat_interleave(h, dim=1)
        s_sel = (q.unsqueeze(-2) @ ks_.transpose(-1, -2)).squeeze(-2) * self.scale  # [B, H, S, n*l']
        s_sel = s_sel.masked_fill(~ok.repeat_interleave(h, dim=1), float("-inf"))
        p_sel = s_sel.softmax(dim=-1, dtype=torch.float32)
        o_sel = torch.einsum("bhsn,bhsnd->bhsd", p_sel.to(vs_.dtype), vs_)

        # sliding window
        kw, vw = k_win.repeat_interleave(h, dim=1), v_win.repeat_interleave(h, dim=1)
        band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.window)  # [S, S]
        s_win = ((q @ kw.transpose(-1, -2)) * self.scale).masked_fill(~band, float("-inf"))
        o_win = torch.einsum("bhst,bhtd->bhsd", s_win.softmax(dim=-1, dtype=torch.float32).to(vw.dtype), vw)

        g = torch.sigmoid(self.to_gate(x)).view(B, S, self.H, 3).transpose(1, 2)  # [B, H, S, 3]
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # [B, H, S, D]
        return self.to_out(o.transpose(1, 2).reshape(B, S, -1))


def make():
    torch.manual_seed(0)
    return PaperNSA(), torch.randn(2, 96, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). Exactly the seed's sizes; the gate
    stays this model's per-head sigmoid."""
    torch.manual_seed(0)
    model = PaperNSA(dim=768, heads=12, kv_heads=2, l=32, d=16, l_sel=64, n_sel=16, window=512, max_len=seq_len)
    return model, torch.randn(batch, seq_len, 768)
