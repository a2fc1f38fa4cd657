"""NSA written independently from the paper, Hugging Face attention style, with per-head selection.

Style: one fused projection `qkvg` gives q, the three branches' own k and v, and the gate logits,
cut apart with `torch.split`; heads-first [B, H, S, D]; GQA with the Hugging Face `repeat_kv`
(`x[:, :, None].expand(b, g, n_rep, s, d).reshape(b, g * n_rep, s, d)`); rotate-half RoPE from
`cos_cached`/`sin_cached` buffers built at construction; masks filled with
`torch.finfo(scores.dtype).min` (finite), compressed rows with no visible block zeroed after the
softmax; compression as a depthwise `F.conv1d` with a constant averaging kernel (stride d); the
sigmoid gates unbound per branch and multiplied in.

Semantics: the paper's compression and importance (l = 16, d = 8, block i visible iff
i*d + l - 1 <= t; overlap / l onto l' = 16 blocks), but *per-head* selection: every query head
ranks the blocks by its own importance (no group sum) and attends to its own top n = 4 blocks;
forced {0, current, previous}; stable descending sort, ascending, -1 padding. Window w = 16.
Causal.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class FusedNSA(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, num_key_value_heads=2, cmp_len=16, cmp_stride=8, sel_len=16,
                 num_sel=4, window=16, max_position_embeddings=256):
        super().__init__()
        self.num_heads, self.num_kv = num_heads, num_key_value_heads
        self.head_dim = hidden_size // num_heads
        self.n_rep = num_heads // num_key_value_heads
        self.cmp_len, self.cmp_stride, self.sel_len, self.num_sel, self.window = cmp_len, cmp_stride, sel_len, num_sel, window
        kv = num_key_value_heads * self.head_dim
        self.split_sizes = [num_heads * self.head_dim] + [kv] * 6 + [3 * num_heads]
        self.qkvg = nn.Linear(hidden_size, sum(self.split_sizes), bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_position_embeddings).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def apply_rotary(self, x):  # [B, N, S, D]
        cos = self.cos_cached[: x.shape[-2]].to(x.dtype)
        sin = self.sin_cached[: x.shape[-2]].to(x.dtype)
        return (x * cos) + (rotate_half(x) * sin)

    def compress(self, x):  # [B, G, S, D] -> [B, G, Tc, D], the mean of cmp_len tokens every cmp_stride
        B, G, S, D = x.shape
        weight = torch.full((G * D, 1, self.cmp_len), 1.0 / self.cmp_len, device=x.device, dtype=x.dtype)
        y = F.conv1d(x.permute(0, 1, 3, 2).reshape(B, G * D, S), weight, stride=self.cmp_stride, groups=G * D)
        return y.view(B, G, D, -1).transpose(-1, -2)

    def forward(self, hidden_states):  # [B, S, hidden]
        bsz, q_len, _ = hidden_states.shape
        device, H = hidden_states.device, self.num_heads
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, g = torch.split(self.qkvg(hidden_states), self.split_sizes, dim=-1)
        q = self.apply_rotary(q.view(bsz, q_len, H, -1).transpose(1, 2))  # [B, H, S, D]
        k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = (
            t.view(bsz, q_len, self.num_kv, -1).transpose(1, 2) for t in (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win))
        k_cmp, k_sel, k_win = self.apply_rotary(k_cmp), self.apply_rotary(k_sel), self.apply_rotary(k_win)
        scale = self.head_dim**-0.5
        pos = torch.arange(q_len, device=device)

        # compressed branch
        kc, vc = repeat_kv(self.compress(k_cmp), self.n_rep), repeat_kv(self.compress(v_cmp), self.n_rep)
        n_cmp = kc.shape[2]
        blk = torch.arange(n_cmp, device=device)
        visible = blk[None, :] * self.cmp_stride + self.cmp_len - 1 <= pos[:, None]
        attn_weights = torch.matmul(q, kc.transpose(2, 3)) * scale
        attn_weights = attn_weights.masked_fill(~visible, torch.finfo(attn_weights.dtype).min)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_weights = attn_weights.masked_fill(~visible.any(-1, keepdim=True), 0.0)  # [B, H, S, Tc]
        o_cmp = torch.matmul(attn_weights, vc)

        # per-head block importance and selection
        n_blocks = -(-q_len // self.sel_len)
        j = torch.arange(n_blocks, device=device)
        start = blk[:, None] * self.cmp_stride
        overlap = (torch.minimum(start + self.cmp_len, (j[None, :] + 1) * self.sel_len)
                   - torch.maximum(start, j[None, :] * self.sel_len)).clamp(min=0)
        importance = attn_weights.float() @ (overlap.float() / self.cmp_len)  # [B, H, S, Ns]
        current = (pos // self.sel_len)[:, None]
        forced = (j == 0) | (j == current) | (j == current - 1)
        key = torch.where(forced, float("inf"), torch.where(j * self.sel_len <= pos[:, None], importance, float("-inf")))
        key = F.pad(key, (0, max(0, self.num_sel - n_blocks)), value=float("-inf"))
        values, order = key.sort(dim=-1, descending=True, stable=True)
        chosen = torch.where(values[..., : self.num_sel] > float("-inf"), order[..., : self.num_sel], key.shape[-1])
        chosen = chosen.sort(dim=-1).values
        chosen = torch.where(chosen == key.shape[-1], -1, chosen)  # [B, H, S, n]

        # selected branch: each head gathers its own blocks
        tok = chosen.clamp(min=0)[..., None] * self.sel_len + torch.arange(self.sel_len, device=device)
        valid = ((chosen >= 0)[..., None] & (tok <= pos[:, None, None])).flatten(-2)  # [B, H, S, n*l']
        index = tok.flatten(-2).clamp(max=q_len - 1).flatten(2)[..., None].expand(-1, -1, -1, self.head_dim)
        ks = repeat_kv(k_sel, self.n_rep).gather(2, index).view(bsz, H, q_len, -1, self.head_dim)
        vs = repeat_kv(v_sel, self.n_rep).gather(2, index).view(bsz, H, q_len, -1, self.head_dim)
        s_sel = torch.matmul(q.unsqueeze(-2), ks.transpose(-1, -2)).squeeze(-2) * scale
        s_sel = s_sel.masked_fill(~valid, torch.finfo(s_sel.dtype).min)
        p_sel = F.softmax(s_sel, dim=-1, dtype=torch.float32).to(q.dtype)
        o_sel = torch.matmul(p_sel.unsqueeze(-2), vs).squeeze(-2)

        # sliding window
        in_window = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.window)
        s_win = torch.matmul(q, repeat_kv(k_win, self.n_rep).transpose(2, 3)) * scale
        s_win = s_win.masked_fill(~in_window, torch.finfo(s_win.dtype).min)
        o_win = torch.matmul(F.softmax(s_win, dim=-1, dtype=torch.float32).to(q.dtype), repeat_kv(v_win, self.n_rep))

        g_cmp, g_sel, g_win = torch.sigmoid(g).view(bsz, q_len, H, 3).transpose(1, 2).unbind(-1)  # [B, H, S]
        o = o_cmp * g_cmp[..., None] + o_sel * g_sel[..., None] + o_win * g_win[..., None]
        return self.o_proj(o.transpose(1, 2).reshape(bsz, q_len, -1))


def make():
    torch.manual_seed(0)
    return FusedNSA(), torch.randn(2, 70, 64)


def make_seed(batch=32, seq_len=2048):
    """(module, x [batch, seq_len, 768]) at the seed preset's shapes (models/config.py: dim 768,
    12 heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512); the default batch is
    tools/bench_e2e.py's at S 2048 (65,536 tokens per step). The seed's sizes; the selection stays
    per head (each of the 12 heads its own 16 blocks, where the seed chooses per KV group)."""
    torch.manual_seed(0)
    model = FusedNSA(hidden_size=768, num_heads=12, num_key_value_heads=2, cmp_len=32, cmp_stride=16, sel_len=64,
                     num_sel=16, window=512, max_position_embeddings=seq_len)
    return model, torch.randn(batch, seq_len, 768)
