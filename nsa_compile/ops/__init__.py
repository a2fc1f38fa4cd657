"""Custom ops that rewrite passes put in place of eager subgraphs (functional, with fakes and
autograd, so they trace under torch.compile fullgraph and AOTAutograd).

    torch.ops.nsa.window_attention(q, k, v, window, scale, backend)   # -> (o, lse): sliding-window causal GQA attention
    torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale, backend)   # -> (o, lse): NSA selected branch

The passes choose each op's backend from the fake tensors at compile time and write it into the
graph: window `flash` | `reference`, selection `triton` | `reference` (see each module).
"""

from .selection import selected_attention, selected_attention_backward
from .window import window_attention, window_attention_backward

__all__ = ["selected_attention", "selected_attention_backward", "window_attention", "window_attention_backward"]
