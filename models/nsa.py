"""Eager NSA attention, written the way a researcher writes it: plain PyTorch, no custom ops.

This module is the oracle every rewrite is tested against. It implements NSA_SEMANTICS.md
sections 1-5 and 7 literally (memory-hungry on purpose: it builds the [B, H, S, Tc] importance
tensor, gathers K/V per query and masks dense S x S window scores).
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig

__all__ = ["NSAAttention", "DenseAttention", "rope_tables", "apply_rope", "upcast"]


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32 and float64 stay (so a float64 oracle stays float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def rope_tables(seq_len: int, rot_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [S, rot_dim // 2] (float32) for positions 0..S-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [S, r/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x [B, S, N, D]; the rest pass through."""
    r = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    cos = cos[:, None, :].to(x.dtype)  # [S, 1, r/2]
    sin = sin[:, None, :].to(x.dtype)
    if style == "half":
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
        out = x_rot * torch.cat([cos, cos], dim=-1) + rotated * torch.cat([sin, sin], dim=-1)
    else:  # interleaved: pairs (2i, 2i + 1)
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return torch.cat([out, x_pass], dim=-1)


class BlockCompressor(nn.Module):
    """phi of the paper's Eq. 7: block + intra-block position embedding -> MLP -> one token."""

    def __init__(self, block: int, head_dim: int):
        super().__init__()
        self.pos_emb = nn.Parameter(torch.randn(block, head_dim) * 0.02)  # [l, D]
        self.mlp = nn.Sequential(nn.Linear(block * head_dim, head_dim), nn.SiLU(), nn.Linear(head_dim, head_dim))

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:  # [B, Tc, G, D, l] -> [B, Tc, G, D]
        blocks = blocks.transpose(-1, -2) + self.pos_emb  # [B, Tc, G, l, D]
        return self.mlp(blocks.flatten(-2))


class NSAAttention(nn.Module):
    """Native Sparse Attention: compressed, selected and sliding-window branches, gated."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.dim_v
        self.scale = Dk**-0.5
        self.wq = nn.Linear(cfg.dim, H * Dk, bias=False)
        self.kv_names = ("shared",) if cfg.shared_kv else ("cmp", "sel", "win")
        self.wk = nn.ModuleDict({name: nn.Linear(cfg.dim, G * Dk, bias=False) for name in self.kv_names})
        self.wv = nn.ModuleDict({name: nn.Linear(cfg.dim, G * Dv, bias=False) for name in self.kv_names})
        if cfg.compression == "mlp":
            self.compress_k = BlockCompressor(cfg.cmp_block, Dk)
            self.compress_v = BlockCompressor(cfg.cmp_block, Dv)
        if cfg.gate == "group":
            self.gate = nn.Sequential(nn.Linear(Dk, Dk // 2), nn.SiLU(), nn.Linear(Dk // 2, 3))
        else:
            self.gate = nn.Linear(cfg.dim, 3 * H)
        self.wo = nn.Linear(H * Dv, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, S, _ = x.shape
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.dim_v
        q = apply_rope(self.wq(x).view(B, S, H, Dk), cos, sin, cfg.rope)  # [B, S, H, Dk]
        k, v = {}, {}
        for name in self.kv_names:
            k[name] = apply_rope(self.wk[name](x).view(B, S, G, Dk), cos, sin, cfg.rope)  # [B, S, G, Dk]
            v[name] = self.wv[name](x).view(B, S, G, Dv)  # [B, S, G, Dv]
        kv = (lambda b: (k["shared"], v["shared"])) if cfg.shared_kv else (lambda b: (k[b], v[b]))

        o_cmp, p_cmp = self.compressed_attention(q, *kv("cmp"))
        block_idx = self.select_blocks(p_cmp, S)
        o_sel = self.selected_attention(q, *kv("sel"), block_idx)
        o_win = self.window_attention(q, *kv("win"))

        g = self.gates(x, q)  # [B, S, H, 3]
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # [B, S, H, Dv]
        return self.wo(o.reshape(B, S, H * Dv))

    # --- compressed branch (NSA_SEMANTICS.md section 2) -------------------------------------

    def compress(self, x: torch.Tensor, compressor: nn.Module | None) -> torch.Tensor:
        """[B, S, G, D] -> [B, Tc, G, D], block i covering tokens [i*d, i*d + l)."""
        blocks = x.unfold(1, self.cfg.cmp_block, self.cfg.cmp_stride)  # [B, Tc, G, D, l]
        if compressor is None:
            return blocks.mean(-1)
        return compressor(blocks)

    def compressed_attention(self, q, k, v):
        """o_cmp [B, S, H, Dv] and p_cmp [B, H, S, Tc] (float32, zero where invisible)."""
        cfg = self.cfg
        B, S, H, _ = q.shape
        l, d, h = cfg.cmp_block, cfg.cmp_stride, cfg.group_size
        if S < l:  # no complete block yet: nothing to attend, and phi takes no part
            return q.new_zeros(B, S, H, cfg.dim_v), upcast(q.new_zeros(B, H, S, 0))
        mlp = cfg.compression == "mlp"
        k_cmp = self.compress(k, self.compress_k if mlp else None)  # [B, Tc, G, Dk]
        v_cmp = self.compress(v, self.compress_v if mlp else None)  # [B, Tc, G, Dv]
        Tc = k_cmp.shape[1]
        k_cmp = k_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
        v_cmp = v_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dv]

        scores = upcast(q.transpose(1, 2) @ k_cmp.transpose(-1, -2)) * self.scale  # [B, H, S, Tc]
        t = torch.arange(S, device=q.device)[:, None]
        i = torch.arange(Tc, device=q.device)[None, :]
        visible = i * d + l - 1 <= t  # [S, Tc]: the whole block is in the past
        scores = scores.masked_fill(~visible, float("-inf"))
        # A row with no visible block would be all -inf: softmax over zeros, then zeroed.
        has_block = visible.any(dim=-1, keepdim=True)  # [S, 1]
        p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible  # [B, H, S, Tc]
        o = p.to(v_cmp.dtype) @ v_cmp  # [B, H, S, Dv]
        return o.transpose(1, 2), p

    # --- block importance and selection (section 3) -----------------------------------------

    def select_blocks(self, p_cmp: torch.Tensor, S: int) -> torch.Tensor:
        """Chosen selection blocks [B, G, S, n] int64, ascending, padded with -1."""
        cfg = self.cfg
        B, H, _, Tc = p_cmp.shape
        l, d, ls, n, G = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.n_kv_groups
        Ns = (S + ls - 1) // ls
        dev = p_cmp.device

        # overlap(i, j) / l: tokens shared by compression block i and selection block j.
        i = torch.arange(Tc, device=dev)[:, None]
        j = torch.arange(Ns, device=dev)[None, :]
        overlap = torch.minimum(i * d + l, (j + 1) * ls) - torch.maximum(i * d, j * ls)
        overlap = overlap.clamp(min=0).to(p_cmp.dtype) / l  # [Tc, Ns]
        p_slc = p_cmp @ overlap  # [B, H, S, Ns]
        p_grp = p_slc.view(B, G, H // G, S, Ns).sum(2)  # [B, G, S, Ns]

        t = torch.arange(S, device=dev)[:, None]
        current = t // ls
        forced = (j == 0) | (j == current) | (j == current - 1)  # [S, Ns]
        candidate = j * ls <= t
        key = torch.where(forced, float("inf"), torch.where(candidate, p_grp, float("-inf")))
        key = F.pad(key, (0, max(0, n - Ns)), value=float("-inf"))  # at least n columns
        values, order = torch.sort(key, dim=-1, descending=True, stable=True)
        past_end = key.shape[-1]
        chosen = torch.where(values[..., :n] > float("-inf"), order[..., :n], past_end)
        chosen = torch.sort(chosen, dim=-1).values  # ascending, unchosen last
        return torch.where(chosen == past_end, -1, chosen)

    # --- selected branch ----------------------------------------------------------------------

    def selected_attention(self, q, k, v, block_idx):
        """o_sel [B, S, H, Dv]: each group's heads attend to the tokens of its chosen blocks."""
        cfg = self.cfg
        B, S, H, Dk = q.shape
        G, ls, h, Dv = cfg.n_kv_groups, cfg.sel_block, cfg.group_size, cfg.dim_v
        offsets = torch.arange(ls, device=q.device)
        tokens = (block_idx.clamp(min=0)[..., None] * ls + offsets).flatten(-2)  # [B, G, S, n*l']
        t = torch.arange(S, device=q.device)[:, None]
        chosen = (block_idx >= 0)[..., None].expand(-1, -1, -1, -1, ls).flatten(-2)
        valid = chosen & (tokens <= t)  # [B, G, S, n*l']
        tokens = tokens.clamp(max=S - 1)
        T = tokens.shape[-1]

        index = tokens.flatten(2)[..., None]  # [B, G, S*n*l', 1]
        k_sel = torch.gather(k.transpose(1, 2), 2, index.expand(-1, -1, -1, Dk)).view(B, G, S, T, Dk)
        v_sel = torch.gather(v.transpose(1, 2), 2, index.expand(-1, -1, -1, Dv)).view(B, G, S, T, Dv)
        k_sel = k_sel.repeat_interleave(h, dim=1)  # [B, H, S, T, Dk]
        v_sel = v_sel.repeat_interleave(h, dim=1)  # [B, H, S, T, Dv]

        scores = upcast(q.transpose(1, 2).unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2)  # [B, H, S, T]
        scores = scores * self.scale
        scores = scores.masked_fill(~valid.repeat_interleave(h, dim=1), float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = (p.to(v_sel.dtype).unsqueeze(-2) @ v_sel).squeeze(-2)  # [B, H, S, Dv]
        return o.transpose(1, 2)

    # --- sliding-window branch (section 4) ------------------------------------------------------

    def window_attention(self, q, k, v):
        """o_win [B, S, H, Dv]: query t attends to tokens max(0, t - w + 1)..t."""
        cfg = self.cfg
        S, h = q.shape[1], cfg.group_size
        k = k.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, S, Dk]
        v = v.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, S, Dv]
        scores = upcast(q.transpose(1, 2) @ k.transpose(-1, -2)) * self.scale  # [B, H, S, S]
        t = torch.arange(S, device=q.device)[:, None]
        s = torch.arange(S, device=q.device)[None, :]
        in_window = (s <= t) & (t - s < cfg.window)
        p = torch.softmax(scores.masked_fill(~in_window, float("-inf")), dim=-1)
        o = p.to(v.dtype) @ v  # [B, H, S, Dv]
        return o.transpose(1, 2)

    # --- gate (section 5) -----------------------------------------------------------------------

    def gates(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Branch weights [B, S, H, 3] in the order cmp, sel, win."""
        cfg = self.cfg
        B, S, H, Dk = q.shape
        if cfg.gate == "group":
            q_bar = q.view(B, S, cfg.n_kv_groups, cfg.group_size, Dk).mean(3)  # [B, S, G, Dk]
            g = torch.softmax(self.gate(q_bar), dim=-1)  # [B, S, G, 3]
            return g.repeat_interleave(cfg.group_size, dim=2)
        return torch.sigmoid(self.gate(x)).view(B, S, H, 3)


class DenseAttention(nn.Module):
    """The dense twin: the same projections and RoPE, full causal attention through SDPA."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.dim_v
        self.wq = nn.Linear(cfg.dim, H * Dk, bias=False)
        self.wk = nn.Linear(cfg.dim, G * Dk, bias=False)
        self.wv = nn.Linear(cfg.dim, G * Dv, bias=False)
        self.wo = nn.Linear(H * Dv, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, S, _ = x.shape
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.dim_v
        q = apply_rope(self.wq(x).view(B, S, H, Dk), cos, sin, cfg.rope).transpose(1, 2)  # [B, H, S, Dk]
        k = apply_rope(self.wk(x).view(B, S, G, Dk), cos, sin, cfg.rope).transpose(1, 2)  # [B, G, S, Dk]
        v = self.wv(x).view(B, S, G, Dv).transpose(1, 2)  # [B, G, S, Dv]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, S, Dv]
        return self.wo(o.transpose(1, 2).reshape(B, S, H * Dv))
