"""Eager NSA attention, written the way a researcher writes it: plain PyTorch, no custom ops.

This module is the oracle every rewrite is tested against. It implements NSA_SEMANTICS.md
sections 1-7 literally (memory-hungry on purpose: it builds the [B, H, S, Tc] importance
tensor, gathers K/V per query and masks dense S x S window scores).

Packed documents (section 6) enter as `pos` [B, S] int64, each token's position in its own
document (0 where a document starts; `positions_from_cu_seqlens` converts cu_seqlens). Shapes
stay static, so one compiled graph serves every packing. With `pos`, every branch adds one mask
term and measures its blocks from the document start (t - pos[t]):
- compression blocks are pooled at every token (unfold stride 1); the slot starting at token s
  is a block of its document when pos[s] % d == 0 and its l tokens lie in that document;
- selection blocks are numbered within the document (block j = document tokens [j*l', (j+1)*l')),
  and so are the forced blocks and the candidates;
- a query sees keys s >= its document start only.
Without `pos` the code is the unpacked form (one document per row), unchanged.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig

__all__ = ["NSAAttention", "DenseAttention", "rope_tables", "apply_rope", "upcast", "positions_from_cu_seqlens",
           "check_positions", "reject_input"]


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32 and float64 stay (so a float64 oracle stays float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def rope_tables(seq_len: int, rot_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [S, rot_dim // 2] (float32) for positions 0..S-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [S, r/2]
    return freqs.cos(), freqs.sin()


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[S] int64 position of each token in its document, from cu_seqlens [docs + 1] (0, ..., S)."""
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != seq_len or bool((cu.diff() <= 0).any()):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to seq_len={seq_len}, got {cu.tolist()}")
    t = torch.arange(seq_len, device=cu.device)
    doc = torch.searchsorted(cu, t, right=True) - 1  # document of each token
    return t - cu[doc]


POSITIONS_ERROR = "pos must be positions within documents: 0 at each document start, then +1 per token"


@torch.compiler.disable
def reject_input(message: str) -> None:
    """Raise ValueError(message). Under torch.compile a call to this is a graph break, so that the
    error is raised by eager code: a `raise` that Dynamo traces itself makes it give up on the
    whole frame, which then stays eager (uncompiled) at every later recompile."""
    raise ValueError(message)


def check_positions(pos: torch.Tensor, seq_len: int) -> None:
    """Raise unless pos [B, S] is int64, restarts at 0 and otherwise counts up by one (so that
    0 <= pos[b, t] <= t < S).

    Eager: ValueError, after one host sync. Under torch.compile the dtype and shape are checked
    while tracing (ValueError, see reject_input) and the values on the device, with no sync and
    no graph break: `torch._assert_async` on one bool, which raises RuntimeError(POSITIONS_ERROR)
    where it runs on the CPU, and on a GPU fails the CUDA context (a device-side assert) at the
    next sync.
    """
    if pos.dtype != torch.int64 or pos.dim() != 2 or pos.shape[1] != seq_len:
        reject_input(f"pos must be int64 [B, {seq_len}], got {pos.dtype} {list(pos.shape)}")
    if not seq_len:
        return
    steps_ok = (pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)  # [B, S - 1]
    valid = (pos[:, 0] == 0).all() & steps_ok.all()  # [] bool
    if torch.compiler.is_compiling():
        torch._assert_async(valid, POSITIONS_ERROR)
    elif not bool(valid):
        raise ValueError(POSITIONS_ERROR)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x [B, S, N, D]; the rest pass through.
    cos, sin: [S, r/2], or [B, S, r/2] per token (packed documents)."""
    r = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if cos.dim() == 2:
        cos = cos[:, None, :].to(x.dtype)  # [S, 1, r/2]
        sin = sin[:, None, :].to(x.dtype)
    else:
        cos = cos[:, :, None, :].to(x.dtype)  # [B, S, 1, r/2]
        sin = sin[:, :, None, :].to(x.dtype)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos, sin [S, r/2] (or [B, S, r/2] at `pos`); pos [B, S] or None."""
        cfg = self.cfg
        B, S, _ = x.shape
        H, G, Dk, Dv = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim, cfg.dim_v
        q = apply_rope(self.wq(x).view(B, S, H, Dk), cos, sin, cfg.rope)  # [B, S, H, Dk]
        k, v = {}, {}
        for name in self.kv_names:
            k[name] = apply_rope(self.wk[name](x).view(B, S, G, Dk), cos, sin, cfg.rope)  # [B, S, G, Dk]
            v[name] = self.wv[name](x).view(B, S, G, Dv)  # [B, S, G, Dv]
        kv = (lambda b: (k["shared"], v["shared"])) if cfg.shared_kv else (lambda b: (k[b], v[b]))

        if pos is None:
            o_cmp, p_cmp = self.compressed_attention(q, *kv("cmp"))
            block_idx = self.select_blocks(p_cmp, S)
            o_sel = self.selected_attention(q, *kv("sel"), block_idx)
            o_win = self.window_attention(q, *kv("win"))
        else:
            o_cmp, p_cmp = self.compressed_attention(q, *kv("cmp"), pos)
            block_idx = self.select_blocks(p_cmp, S, pos)
            o_sel = self.selected_attention(q, *kv("sel"), block_idx, pos)
            o_win = self.window_attention(q, *kv("win"), pos)

        g = self.gates(x, q)  # [B, S, H, 3]
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # [B, S, H, Dv]
        return self.wo(o.reshape(B, S, H * Dv))

    # --- compressed branch (NSA_SEMANTICS.md section 2) -------------------------------------

    def compress(self, x: torch.Tensor, compressor: nn.Module | None, stride: int) -> torch.Tensor:
        """[B, S, G, D] -> [B, Tc, G, D], block i covering tokens [i*stride, i*stride + l)."""
        blocks = x.unfold(1, self.cfg.cmp_block, stride)  # [B, Tc, G, D, l]
        if compressor is None:
            return blocks.mean(-1)
        return compressor(blocks)

    def compressed_attention(self, q, k, v, pos=None):
        """o_cmp [B, S, H, Dv] and p_cmp [B, H, S, Tc] (float32, zero where invisible).
        With pos, Tc = S - l + 1 slots, one starting at every token (see the module docstring)."""
        cfg = self.cfg
        B, S, H, _ = q.shape
        l, d, h = cfg.cmp_block, cfg.cmp_stride, cfg.group_size
        if S < l:  # no complete block yet: nothing to attend, and phi takes no part
            return q.new_zeros(B, S, H, cfg.dim_v), upcast(q.new_zeros(B, H, S, 0))
        mlp = cfg.compression == "mlp"
        stride = d if pos is None else 1
        k_cmp = self.compress(k, self.compress_k if mlp else None, stride)  # [B, Tc, G, Dk]
        v_cmp = self.compress(v, self.compress_v if mlp else None, stride)  # [B, Tc, G, Dv]
        Tc = k_cmp.shape[1]
        k_cmp = k_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dk]
        v_cmp = v_cmp.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, Tc, Dv]

        scores = upcast(q.transpose(1, 2) @ k_cmp.transpose(-1, -2)) * self.scale  # [B, H, S, Tc]
        t = torch.arange(S, device=q.device)[:, None]
        i = torch.arange(Tc, device=q.device)[None, :]
        if pos is None:
            visible = i * d + l - 1 <= t  # [S, Tc]: the whole block is in the past
        else:
            slot_pos = pos[:, :Tc]  # [B, Tc]: document position of each slot's first token
            is_block = (slot_pos % d == 0) & (pos[:, l - 1 :] == slot_pos + l - 1)  # in one document
            same_doc = i >= (t - pos[:, :, None])  # [B, S, Tc]: the slot starts in t's document
            visible = ((i + l - 1 <= t) & same_doc & is_block[:, None, :])[:, None]  # [B, 1, S, Tc]
        scores = scores.masked_fill(~visible, float("-inf"))
        # A row with no visible block would be all -inf: softmax over zeros, then zeroed.
        has_block = visible.any(dim=-1, keepdim=True)  # [S, 1]
        p = torch.softmax(scores.masked_fill(~has_block, 0.0), dim=-1) * visible  # [B, H, S, Tc]
        o = p.to(v_cmp.dtype) @ v_cmp  # [B, H, S, Dv]
        return o.transpose(1, 2), p

    # --- block importance and selection (section 3) -----------------------------------------

    def select_blocks(self, p_cmp: torch.Tensor, S: int, pos=None) -> torch.Tensor:
        """Chosen selection blocks [B, G, S, n] int64, ascending, padded with -1.
        With pos, blocks are numbered within each token's document and p_cmp has a slot per token."""
        cfg = self.cfg
        B, H, _, Tc = p_cmp.shape
        l, d, ls, n, G = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.n_kv_groups
        Ns = (S + ls - 1) // ls
        dev = p_cmp.device

        # overlap(i, j) / l: tokens shared by compression block i and selection block j.
        i = torch.arange(Tc, device=dev)[:, None]
        j = torch.arange(Ns, device=dev)[None, :]
        start = i * d if pos is None else pos[:, :Tc, None]  # [Tc, 1] or [B, Tc, 1]: block's first token
        overlap = torch.minimum(start + l, (j + 1) * ls) - torch.maximum(start, j * ls)
        overlap = overlap.clamp(min=0).to(p_cmp.dtype) / l  # [Tc, Ns] or [B, Tc, Ns]
        p_slc = p_cmp @ (overlap if pos is None else overlap[:, None])  # [B, H, S, Ns]
        p_grp = p_slc.view(B, G, H // G, S, Ns).sum(2)  # [B, G, S, Ns]

        t = torch.arange(S, device=dev)[:, None] if pos is None else pos[:, None, :, None]  # [S, 1] or [B, 1, S, 1]
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

    def selected_attention(self, q, k, v, block_idx, pos=None):
        """o_sel [B, S, H, Dv]: each group's heads attend to the tokens of its chosen blocks
        (blocks counted from the document start t - pos[t] with pos)."""
        cfg = self.cfg
        B, S, H, Dk = q.shape
        G, ls, h, Dv = cfg.n_kv_groups, cfg.sel_block, cfg.group_size, cfg.dim_v
        offsets = torch.arange(ls, device=q.device)
        tokens = (block_idx.clamp(min=0)[..., None] * ls + offsets).flatten(-2)  # [B, G, S, n*l']
        t = torch.arange(S, device=q.device)[:, None]
        if pos is not None:
            tokens = tokens + (t - pos[:, None, :, None])  # + document start: [B, G, S, n*l']
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

    def window_attention(self, q, k, v, pos=None):
        """o_win [B, S, H, Dv]: query t attends to tokens max(0, t - w + 1)..t (and, with pos,
        only to those of its own document)."""
        cfg = self.cfg
        S, h = q.shape[1], cfg.group_size
        k = k.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, S, Dk]
        v = v.transpose(1, 2).repeat_interleave(h, dim=1)  # [B, H, S, Dv]
        scores = upcast(q.transpose(1, 2) @ k.transpose(-1, -2)) * self.scale  # [B, H, S, S]
        t = torch.arange(S, device=q.device)[:, None]
        s = torch.arange(S, device=q.device)[None, :]
        in_window = (s <= t) & (t - s < cfg.window)
        if pos is not None:
            in_window = (in_window & (s >= t - pos[:, :, None]))[:, None]  # [B, 1, S, S]
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
