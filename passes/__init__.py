"""The built-in rewrite passes, one per file, in the order they run (order is priority)."""

from . import gqa_grouped_matmul

BUILTIN_PASSES = (gqa_grouped_matmul.PASS,)

__all__ = ["BUILTIN_PASSES"]
