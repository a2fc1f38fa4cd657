"""Custom ops that rewrite passes put in place of eager subgraphs (functional, with fakes and
autograd, so they trace under torch.compile fullgraph and AOTAutograd).

    torch.ops.nsa.projection_rope(x, weight, bias, cos, sin, widths, head_dims, style, backend)  # -> pieces: one GEMM for the projections of x, RoPE in its epilogue
    torch.ops.nsa.window_attention(q, k, v, window, scale, backend, pos=None)       # -> (o, lse): sliding-window causal GQA attention
    torch.ops.nsa.compressed_attention(q, k_cmp, v_cmp, block, stride, scale, backend, pos=None, q_offset=0)   # -> (o, lse): NSA compressed branch over the pooled tokens
    torch.ops.nsa.select_blocks(q, k_cmp, lse, l, d, l_sel, n, scale, backend, pos=None, rule="nsa",
                                importance_dtype=None, group_sum_dtype=None, q_offset=0)   # -> block_idx [B, G, S, n]: eager's top-n, recomputed from the lse (rule "lucidrains": lse None, from the logits)
    torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend, pos=None, q_offset=0)   # -> (o, lse): NSA selected branch
    torch.ops.nsa.gated_combine(gate_in, w1, b1, w2, b2, o_cmp, o_sel, o_win, activation, normalize, backend)  # -> (o, gates)

Each module declares its op once at its bottom (registry.py: the schema, the backends with their
reasons and determinism, the autograd formula); the torch ops are made from that declaration. The
passes choose each op's backend from the fake tensors at compile time and write it into the
graph: window `triton` | `flash` | `reference`; compressed, block selection, gated combine,
projection `triton` | `reference`; selection `triton` | `reference` | `varlen` |
`varlen_flash_attn` (see each module, or `registry.ops()`). `pos` [B, S] int64 (packed
documents: each token's position in its document, models/nsa.py) makes the four attention ops
work per document (their Triton kernels read each query's document start; no host sync) and
the compressed ops take S - l + 1 stride-1 slots. `q_offset` (no pos) makes q a chunk of
queries, rows at tokens q_offset.. of the sequence K/V hold (a model's loop over query chunks).
The compressed op's `block` is the visibility staircase's intercept (strict visibility and
memory slots are other intercepts: ops/compressed.py).
"""

# in the order the passes put the ops into a layer: the order of registry.ops() (and explain's table)
from .rope import projection_rope, projection_rope_backward
from .window import window_attention, window_attention_backward
from .compressed import compressed_attention, compressed_attention_backward
from .block_select import select_blocks
from .selection import selected_attention, selected_attention_backward
from .gated_combine import gated_combine_backward, gated_sum

__all__ = [
    "gated_combine_backward", "gated_sum", "projection_rope", "projection_rope_backward", "select_blocks",
    "compressed_attention", "compressed_attention_backward", "selected_attention", "selected_attention_backward",
    "window_attention", "window_attention_backward",
]
