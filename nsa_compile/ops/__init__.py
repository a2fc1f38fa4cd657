"""Custom ops that rewrite passes put in place of eager subgraphs (functional, with fakes and
autograd, so they trace under torch.compile fullgraph and AOTAutograd).

    torch.ops.nsa.window_attention(q, k, v, window, scale)   # sliding-window causal GQA attention
"""

from .window import window_attention, window_attention_backward

__all__ = ["window_attention", "window_attention_backward"]
