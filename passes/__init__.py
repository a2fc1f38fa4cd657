"""The built-in rewrite passes, one per file, in the order they run (order is priority: a pass
that replaces a whole attention branch runs before the GQA pass, which takes what is left)."""

from . import gqa_grouped_matmul, selected_attention, window_attention

BUILTIN_PASSES = (window_attention.PASS, selected_attention.PASS, gqa_grouped_matmul.PASS)

__all__ = ["BUILTIN_PASSES"]
