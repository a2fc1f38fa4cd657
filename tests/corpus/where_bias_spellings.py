"""This project's NSA semantics (models/nsa.py) in other spellings, sequence-first [B, S, H, D].

Style: the same computation as the reference model with the spellings swapped for their
equivalents: window scores masked by `torch.where(mask, scores, -inf)`; compressed scores masked by
an additive bias (`scores + bias`, bias 0 or -inf; a row with no visible block keeps a zero bias,
so its softmax stays finite, and is zeroed by `torch.where` after the softmax); the selected
branch's softmax written out by hand (`exp(s - amax) / sum`); compression by prefix sums (`cumsum`,
then the difference of two gathered rows over l); GQA by `repeat_interleave` on the KV-head axis of
[B, S, G, D]; the selected K fetched with `index_select` on a flattened [B*S*G, D] tensor and V
with `torch.take_along_dim`; the top n by `argsort(descending=True, stable=True)[..., :n]`; scores
upcast with `.to(torch.float32)`. RoPE (rotate-half) tables computed in `forward`; the group gate
(mean of the group's queries -> MLP -> softmax) combined as
`(g[..., None] * torch.stack(o, -2)).sum(-2)`.

Semantics: NSA_SEMANTICS.md exactly: l = 8, d = 4, block i visible iff i*d + l - 1 <= t;
importance by token overlap / l onto l' = 16 blocks, summed over the group; forced {0, current,
previous}; top n = 4 (stable), ascending, -1 padding; window w = 16. Causal.
"""

import torch
import torch.nn as nn


class SpelledNSA(nn.Module):
    def __init__(self, dim=64, heads=4, groups=2, l=8, d=4, l_sel=16, n=4, window=16):
        super().__init__()
        self.H, self.G, self.D = heads, groups, dim // heads
        self.l, self.d, self.l_sel, self.n, self.window = l, d, l_sel, n, window
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.ModuleDict({b: nn.Linear(dim, groups * self.D, bias=False) for b in ("cmp", "sel", "win")})
        self.wv = nn.ModuleDict({b: nn.Linear(dim, groups * self.D, bias=False) for b in ("cmp", "sel", "win")})
        self.gate = nn.Sequential(nn.Linear(self.D, self.D // 2), nn.SiLU(), nn.Linear(self.D // 2, 3))
        self.wo = nn.Linear(dim, dim, bias=False)

    @staticmethod
    def rope(x):  # [B, S, N, D], rotate-half
        S, D = x.shape[1], x.shape[-1]
        inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
        freqs = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * inv_freq
        cos, sin = freqs.cos().repeat(1, 2)[:, None].to(x.dtype), freqs.sin().repeat(1, 2)[:, None].to(x.dtype)
        return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1) * sin

    def block_means(self, x):  # [B, S, G, D] -> [B, Tc, G, D] by prefix sums
        S = x.shape[1]
        Tc = (S - self.l) // self.d + 1
        prefix = torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(dim=1)], dim=1)  # [B, S + 1, G, D]
        starts = torch.arange(Tc, device=x.device) * self.d
        return (prefix[:, starts + self.l] - prefix[:, starts]) / self.l

    def forward(self, x):  # x [B, S, dim]
        B, S, _ = x.shape
        H, G, D = self.H, self.G, self.D
        h = H // G
        q = self.rope(self.wq(x).view(B, S, H, D))
        k = {b: self.wk[b](x).view(B, S, G, D) for b in self.wk}
        v = {b: self.wv[b](x).view(B, S, G, D) for b in self.wv}
        k = {b: self.rope(t) for b, t in k.items()}
        t = torch.arange(S, device=x.device)

        # compressed branch, additive bias
        kc = self.block_means(k["cmp"]).repeat_interleave(h, dim=2)  # [B, Tc, H, D]
        vc = self.block_means(v["cmp"]).repeat_interleave(h, dim=2)
        Tc = kc.shape[1]
        i = torch.arange(Tc, device=x.device)
        visible = i[None, :] * self.d + self.l - 1 <= t[:, None]  # [S, Tc]
        has_block = visible.any(-1, keepdim=True)  # [S, 1]
        # rows without a block keep a zero bias (no NaN in the backward) and are zeroed below
        bias = torch.zeros(S, Tc, device=x.device).masked_fill(~visible & has_block, float("-inf"))
        s_cmp = torch.matmul(q.transpose(1, 2), kc.permute(0, 2, 3, 1)).to(torch.float32) * D**-0.5 + bias
        p_cmp = torch.softmax(s_cmp, dim=-1)
        p_cmp = torch.where(has_block, p_cmp, torch.zeros_like(p_cmp))  # [B, H, S, Tc]
        o_cmp = torch.matmul(p_cmp.to(vc.dtype), vc.transpose(1, 2)).transpose(1, 2)  # [B, S, H, D]

        # block selection
        Ns = -(-S // self.l_sel)
        j = torch.arange(Ns, device=x.device)
        overlap = (torch.minimum(i[:, None] * self.d + self.l, (j + 1) * self.l_sel)
                   - torch.maximum(i[:, None] * self.d, j * self.l_sel)).clamp(min=0)
        p_grp = (p_cmp @ (overlap.to(p_cmp.dtype) / self.l)).unflatten(1, (G, h)).sum(2)  # [B, G, S, Ns]
        cur = (t // self.l_sel)[:, None]
        forced = (j == 0) | (j == cur) | (j == cur - 1)
        key = torch.where(forced, float("inf"), torch.where(j * self.l_sel <= t[:, None], p_grp, float("-inf")))
        if Ns < self.n:
            key = torch.cat([key, key.new_full((*key.shape[:-1], self.n - Ns), float("-inf"))], dim=-1)
        order = key.argsort(dim=-1, descending=True, stable=True)[..., : self.n]
        picked = torch.take_along_dim(key, order, dim=-1) > float("-inf")
        blocks = torch.where(picked, order, key.shape[-1]).sort(dim=-1).values
        blocks = torch.where(blocks == key.shape[-1], -1, blocks).transpose(1, 2)  # [B, S, G, n]

        # selected branch: index_select for K, take_along_dim for V
        tok = blocks.clamp(min=0)[..., None] * self.l_sel + torch.arange(self.l_sel, device=x.device)
        ok = ((blocks >= 0)[..., None] & (tok <= t[:, None, None, None])).flatten(-2)  # [B, S, G, T]
        tok = tok.flatten(-2).clamp(max=S - 1)  # [B, S, G, T]
        T = tok.shape[-1]
        g_idx = torch.arange(G, device=x.device)[:, None]
        rows = ((torch.arange(B, device=x.device) * S)[:, None, None, None] + tok) * G + g_idx  # [B, S, G, T]
        ks = k["sel"].reshape(B * S * G, D).index_select(0, rows.flatten()).view(B, S, G, T, D)
        vs = torch.take_along_dim(v["sel"].transpose(1, 2)[:, None], tok[..., None], dim=3)  # [B, S, G, T, D]
        ks, vs = ks.repeat_interleave(h, dim=2), vs.repeat_interleave(h, dim=2)  # [B, S, H, T, D]
        s_sel = torch.einsum("bshd,bshtd->bsht", q, ks).to(torch.float32) * D**-0.5
        s_sel = s_sel.masked_fill(~ok.repeat_interleave(h, dim=2), float("-inf"))
        e = (s_sel - s_sel.amax(dim=-1, keepdim=True)).exp()
        p_sel = e / e.sum(dim=-1, keepdim=True)
        o_sel = torch.einsum("bsht,bshtd->bshd", p_sel.to(vs.dtype), vs)

        # sliding window, torch.where
        in_window = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.window)
        kw, vw = k["win"].repeat_interleave(h, dim=2), v["win"].repeat_interleave(h, dim=2)
        s_win = torch.matmul(q.transpose(1, 2), kw.permute(0, 2, 3, 1)).to(torch.float32) * D**-0.5
        p_win = torch.softmax(torch.where(in_window, s_win, float("-inf")), dim=-1)
        o_win = torch.matmul(p_win.to(vw.dtype), vw.transpose(1, 2)).transpose(1, 2)

        q_bar = q.unflatten(2, (G, h)).mean(3)  # [B, S, G, D]
        g = torch.softmax(self.gate(q_bar), dim=-1).repeat_interleave(h, dim=2)  # [B, S, H, 3]
        o = (g[..., None] * torch.stack([o_cmp, o_sel, o_win], dim=-2)).sum(-2)  # [B, S, H, D]
        return self.wo(o.reshape(B, S, -1))


def make():
    torch.manual_seed(0)
    return SpelledNSA(), torch.randn(2, 88, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). Exactly the seed's sizes and
    semantics."""
    torch.manual_seed(0)
    model = SpelledNSA(dim=768, heads=12, groups=2, l=32, d=16, l_sel=64, n=16, window=512)
    return model, torch.randn(batch, seq_len, 768)
