"""Eager NSA models written in other people's idioms: what `optimize` must recognize (issue 17).

Each file is one self-contained module (plain PyTorch, no einops) with a `make()` factory that
returns `(module, x)`, x [2, S, dim] floats, exactly as the CLI takes a user model:
`nsa-compile explain --model tests/corpus/paper_bhsd.py:make`. Outputs are [2, S, dim]; the loss
is the mean square of the output. Each docstring says whose style the file follows and which
semantic variant it implements. MODELS lists them for the tests (tests/test_corpus.py) and
tools/corpus_coverage.py; coverage.json holds the measured per-pass match counts. Each file also
has `make_seed(batch=32, seq_len=2048)`: the same model at the seed preset's shapes (dim 768, 12
heads, 2 KV groups, head dim 64, l 32, d 16, l' 64, n 16, w 512), or the nearest its semantics
allow (its docstring says where it differs), x [batch, seq_len, 768]; tools/bench_corpus.py times
them against the seed's own attention.

Where each idiom of issue 17 appears (file stems):

| idiom | files |
|---|---|
| einsum scores and p @ v | lucidrains_*, fla_naive_bthd, xunhaolai_varlen, grouped5d_nograd, nsa_vibe_noncausal |
| 5-D grouped [B, G, h, S, D] / [B, S, G, h, D] | lucidrains_shared_kv, grouped5d_nograd, nsa_vibe_noncausal |
| [B, T, H, D] layout; varlen [total, H, D] + cu_seqlens | fla_naive_bthd, where_bias_spellings; xunhaolai_varlen |
| finite masks: finfo.min, -finfo.max, max_neg_value, mask_value // 10, -1e9 | fused_qkv_per_head, sdpa_complex_rope; grouped5d_nograd; lucidrains_*; chunked_queries |
| mask before the upcast; softmax(dtype=torch.float32) | paper_bhsd; paper_bhsd, xunhaolai_varlen, fused_qkv_per_head |
| empty rows: nan_to_num; masked_fill / where after the softmax | fla_naive_bthd, xunhaolai_varlen; paper_bhsd, tiled_gqa_fla, grouped5d_nograd, where_bias_spellings |
| compression windows: F.pad, nn.Unfold, unfold, avg_pool1d/2d, conv1d, as_strided, cumsum | fla_naive_bthd, tiled_gqa_fla; lucidrains_shared_kv; paper_bhsd; xunhaolai_varlen, nsa_vibe_noncausal; fused_qkv_per_head; grouped5d_nograd; where_bias_spellings |
| SDPA window: additive / boolean attn_mask; enable_gqa | sdpa_complex_rope; xunhaolai_varlen, nsa_vibe_noncausal, tiled_gqa_fla; chunked_queries |
| GQA: expand+reshape, .repeat (interleaving), .repeat (tiling), repeat_interleave | lucidrains_shared_kv, fla_naive_bthd, fused_qkv_per_head; lucidrains_per_head; tiled_gqa_fla; paper_bhsd |
| combine: einsum over stacked; gates inside the branches; stack * gate, sum | lucidrains_*, grouped5d_nograd; fla_naive_bthd, tiled_gqa_fla, fused_qkv_per_head; sdpa_complex_rope, where_bias_spellings |
| RoPE: lazy tables; cached cos/sin; interleaved; complex; partial | fla_naive_bthd, nsa_vibe_noncausal, ...; paper_bhsd, fused_qkv_per_head, grouped5d_nograd; lucidrains_*, nsa_vibe_noncausal, chunked_queries; sdpa_complex_rope; grouped5d_nograd |
| fused qkv Linear; K/V shared across branches | lucidrains_shared_kv, fused_qkv_per_head; lucidrains_shared_kv, fla_naive_bthd, xunhaolai_varlen |
| per-head selection; l = l' = d; topk then sort; selection under no_grad | lucidrains_per_head, fused_qkv_per_head; fla_naive_bthd, tiled_gqa_fla; xunhaolai_varlen, sdpa_complex_rope, grouped5d_nograd; xunhaolai_varlen, grouped5d_nograd |
| gather: gather, advanced indexing, index_select, take_along_dim | most; fla_naive_bthd; where_bias_spellings |
| Python loop over query chunks (unrolled by Dynamo) | chunked_queries |

Semantic variants: lucidrains block choice and windows ending at (i+1)d - 1 with memory slots
(lucidrains_shared_kv, lucidrains_per_head); fla's (fla_naive_bthd, tiled_gqa_fla); the paper's
forced {0, current, previous} with the overlap-weighted group sum (paper_bhsd, xunhaolai_varlen,
sdpa_complex_rope, grouped5d_nograd, where_bias_spellings, chunked_queries; per head:
fused_qkv_per_head); selection scores without a causal mask (nsa_vibe_noncausal, not causal).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MODELS", "HERE", "spec"]

HERE = Path(__file__).parent

# file name -> (whose style, semantic variant, causal)
MODELS: dict[str, tuple[str, str, bool]] = {
    "paper_bhsd.py": ("written from the paper", "paper", True),
    "lucidrains_shared_kv.py": ("lucidrains/native-sparse-attention-pytorch", "lucidrains", True),
    "lucidrains_per_head.py": ("lucidrains/native-sparse-attention-pytorch", "lucidrains, per-head selection", True),
    "fla_naive_bthd.py": ("fla-org/flash-linear-attention naive", "fla", True),
    "tiled_gqa_fla.py": ("fla-like, tiled GQA", "fla, tiled GQA groups", True),
    "xunhaolai_varlen.py": ("XunhaoLai/native-sparse-attention-triton torch ops", "paper, varlen", True),
    "nsa_vibe_noncausal.py": ("seconds-0/nsa-vibe", "selection scores without a causal mask", False),
    "sdpa_complex_rope.py": ("written from the paper, SDPA everywhere", "paper", True),
    "grouped5d_nograd.py": ("written from the paper, 5-D grouped", "paper, weighted pooling", True),
    "fused_qkv_per_head.py": ("written from the paper, Hugging Face style", "paper, per-head selection", True),
    "where_bias_spellings.py": ("this project's model, other spellings", "paper (NSA_SEMANTICS.md)", True),
    "chunked_queries.py": ("written from the paper, chunked over queries", "paper", True),
}


def spec(name: str) -> str:
    """The CLI's --model spec of a corpus file: 'path/to/file.py:make'."""
    return f"{HERE / name}:make"
