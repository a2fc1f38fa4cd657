"""NSA written independently from the paper, in 5-D grouped tensors [B, G, h, S, D].

Style: the query heads are kept grouped `[B, G, h, S, D]` next to their keys `[B, G, S, D]`, so
no K/V is ever repeated: every score and output is an einsum ('bghsd,bgtd->bghst',
'bghst,bgtd->bghsd'). Scores are upcast first and then masked with the finite `-finfo(float32).max`;
rows of the compressed branch with no visible block are zeroed with `torch.where` after the
softmax. Partial rotary: rotate-half on the first half of each head's dims, from cos/sin tables
cached as buffers. Compression by learned weighted pooling (one weight per KV head and window
position, as XunhaoLai's `weightedpool`) over `as_strided` windows. Block selection runs under
`torch.no_grad()`: the overlap mapping and the group sum are one einsum ('bghsc,cj->bgsj'), then
`topk` and `sort` of the indices. The per-head sigmoid gate is combined with an einsum over the
stacked branch outputs.

Semantics (the paper's): l = 8, d = 4, block i visible iff i*d + l - 1 <= t; importance = the
compressed probabilities mapped onto l' = 16 blocks by overlap / l and summed over the group;
forced {0, current, previous}; top n = 4 (topk, then sort), non-candidates -1. Window w = 16.
Causal.
"""

import torch
import torch.nn as nn


class Grouped5DNSA(nn.Module):
    def __init__(self, dim=64, groups=2, heads_per_group=2, head_dim=16, l=8, d=4, l_sel=16, n=4, window=16,
                 max_len=256):
        super().__init__()
        self.G, self.h, self.D = groups, heads_per_group, head_dim
        self.l, self.d, self.l_sel, self.n, self.window = l, d, l_sel, n, window
        H = groups * heads_per_group
        self.q = nn.Linear(dim, H * head_dim, bias=False)
        self.kv = nn.ModuleDict({name: nn.Linear(dim, 2 * groups * head_dim, bias=False) for name in ("cmp", "sel", "win")})
        self.pool_k = nn.Parameter(torch.full((groups, l), 1.0 / l))
        self.pool_v = nn.Parameter(torch.full((groups, l), 1.0 / l))
        self.gate = nn.Linear(dim, 3 * H)
        self.o = nn.Linear(H * head_dim, dim, bias=False)
        rot = head_dim // 2
        inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
        angles = torch.arange(max_len).float()[:, None] * inv_freq  # [max_len, rot/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, x):  # [..., S, D]: rotate the first D/2 dims, rotate-half
        S, r = x.shape[-2], self.cos.shape[-1]
        cos, sin = self.cos[:S].to(x.dtype), self.sin[:S].to(x.dtype)
        x1, x2, rest = x[..., :r], x[..., r : 2 * r], x[..., 2 * r :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def windows(self, x):  # [B, G, S, D] -> [B, G, Tc, l, D]
        B, G, S, D = x.shape
        x = x.contiguous()
        Tc = (S - self.l) // self.d + 1
        return x.as_strided((B, G, Tc, self.l, D), (x.stride(0), x.stride(1), self.d * x.stride(2), x.stride(2), x.stride(3)))

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        G, h, D = self.G, self.h, self.D
        neg = -torch.finfo(torch.float32).max
        scale = D**-0.5
        q = self.rope(self.q(x).view(B, S, G, h, D).permute(0, 2, 3, 1, 4))  # [B, G, h, S, D]
        kv = {name: proj(x).view(B, S, 2, G, D).permute(2, 0, 3, 1, 4) for name, proj in self.kv.items()}
        k_cmp, v_cmp = self.rope(kv["cmp"][0]), kv["cmp"][1]  # [B, G, S, D]
        k_sel, v_sel = self.rope(kv["sel"][0]), kv["sel"][1]
        k_win, v_win = self.rope(kv["win"][0]), kv["win"][1]
        t = torch.arange(S, device=x.device)

        # compressed branch
        kc = torch.einsum("bgnkd,gk->bgnd", self.windows(k_cmp), self.pool_k)  # [B, G, Tc, D]
        vc = torch.einsum("bgnkd,gk->bgnd", self.windows(v_cmp), self.pool_v)
        Tc = kc.shape[2]
        c = torch.arange(Tc, device=x.device)
        visible = c[None, :] * self.d + self.l - 1 <= t[:, None]  # [S, Tc]
        s_cmp = torch.einsum("bghsd,bgcd->bghsc", q, kc).float() * scale
        p_cmp = s_cmp.masked_fill(~visible, neg).softmax(-1)
        p_cmp = torch.where(visible.any(-1, keepdim=True), p_cmp, torch.zeros_like(p_cmp))
        o_cmp = torch.einsum("bghsc,bgcd->bghsd", p_cmp.to(vc.dtype), vc)

        # block selection, no gradient
        with torch.no_grad():
            Ns = -(-S // self.l_sel)
            j = torch.arange(Ns, device=x.device)
            overlap = (torch.minimum(c[:, None] * self.d + self.l, (j[None, :] + 1) * self.l_sel)
                       - torch.maximum(c[:, None] * self.d, j[None, :] * self.l_sel)).clamp(min=0)
            importance = torch.einsum("bghsc,cj->bgsj", p_cmp, overlap.float() / self.l)  # [B, G, S, Ns]
            cur = (t // self.l_sel)[:, None]
            forced = (j == 0) | (j == cur) | (j == cur - 1)
            candidate = j * self.l_sel <= t[:, None]
            score = torch.where(forced, torch.inf, torch.where(candidate, importance, -torch.inf))
            values, blocks = score.topk(min(self.n, Ns), dim=-1)
            blocks = torch.where(values > -torch.inf, blocks, Ns).sort(-1).values
            blocks = blocks.masked_fill(blocks == Ns, -1)  # [B, G, S, n]

        # selected branch
        tok = blocks.clamp(min=0)[..., None] * self.l_sel + torch.arange(self.l_sel, device=x.device)
        keep = ((blocks >= 0)[..., None] & (tok <= t[:, None, None])).flatten(-2)  # [B, G, S, n*l']
        at = tok.flatten(-2).clamp(max=S - 1).flatten(2)[..., None].expand(-1, -1, -1, D)
        ks = k_sel.gather(2, at).view(B, G, S, -1, D)
        vs = v_sel.gather(2, at).view(B, G, S, -1, D)
        s_sel = torch.einsum("bghsd,bgsnd->bghsn", q, ks).float() * scale
        p_sel = s_sel.masked_fill(~keep[:, :, None], neg).softmax(-1)
        o_sel = torch.einsum("bghsn,bgsnd->bghsd", p_sel.to(vs.dtype), vs)

        # sliding window
        band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.window)
        s_win = torch.einsum("bghsd,bgtd->bghst", q, k_win).float() * scale
        p_win = s_win.masked_fill(~band, neg).softmax(-1)
        o_win = torch.einsum("bghst,bgtd->bghsd", p_win.to(v_win.dtype), v_win)

        g = torch.sigmoid(self.gate(x)).view(B, S, G, h, 3)
        o = torch.einsum("bsghk,kbghsd->bghsd", g, torch.stack([o_cmp, o_sel, o_win]))
        return self.o(o.permute(0, 3, 1, 2, 4).reshape(B, S, -1))


def make():
    torch.manual_seed(0)
    return Grouped5DNSA(), torch.randn(2, 81, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads = 2 groups of 6, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). Exactly the seed's sizes; RoPE stays
    partial (the first 32 of 64 dims) and the pooling learned, as this model has them."""
    torch.manual_seed(0)
    model = Grouped5DNSA(dim=768, groups=2, heads_per_group=6, head_dim=64, l=32, d=16, l_sel=64, n=16, window=512,
                         max_len=seq_len)
    return model, torch.randn(batch, seq_len, 768)
