"""The built-in rewrite passes, one per file, in the order they run (order is priority: a pass
that replaces a whole attention branch runs before the GQA pass, which takes what is left)."""

from . import (select_blocks, canonicalize, compress_pooling, compressed_attention, projection_rope, gated_combine,
               gqa_grouped_matmul, query_chunks, selected_attention, window_attention)

# canonicalize first: it rewrites equivalent spellings into the form the others read; then projection_rope,
# which rewrites the projections and RoPE whose outputs the attention passes read; query_chunks last:
# it merges the calls the branch passes made per chunk of queries
BUILTIN_PASSES = (canonicalize.PASS, projection_rope.PASS, window_attention.PASS, compressed_attention.PASS,
                  select_blocks.PASS, selected_attention.PASS, gated_combine.PASS, gqa_grouped_matmul.PASS,
                  compress_pooling.PASS, query_chunks.PASS)

__all__ = ["BUILTIN_PASSES"]
