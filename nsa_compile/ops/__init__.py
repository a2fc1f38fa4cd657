"""Custom ops that rewrite passes put in place of eager subgraphs (functional, with fakes and
autograd, so they trace under torch.compile fullgraph and AOTAutograd).

    torch.ops.nsa.window_attention(q, k, v, window, scale, backend)   # -> (o, lse): sliding-window causal GQA attention
    torch.ops.nsa.selected_attention(q, k, v, block_idx, block_size, scale)   # NSA selected branch

`selected_attention` has no pass yet (the selection rewrite is issue 4's next step); it is
tested against the eager model's selected branch.
"""

from .selection import selected_attention, selected_attention_backward
from .window import window_attention, window_attention_backward

__all__ = ["selected_attention", "selected_attention_backward", "window_attention", "window_attention_backward"]
