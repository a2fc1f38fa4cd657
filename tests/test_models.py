"""Tests of the eager reference models (nsa_compile.models), CPU only.

They pin down NSA_SEMANTICS.md: causality of every variant, output shapes at awkward lengths,
which parameters get gradients, block selection (by hand and by property), the presets and
config validation, and the window / selected / compressed branches against loop references.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from nsa_compile.models import (
    PRESETS,
    DenseAttention,
    ModelConfig,
    NSAAttention,
    TinyLM,
    build_model,
    preset,
)

TINY = preset("tiny")  # l=8, d=4, l'=16, n=3, w=32, H=4, G=2, h=2, D=16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: one intra-op thread is fastest, and on a loaded 2-core machine
    two OpenMP threads spinning against other processes made this file 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tokens(B: int, S: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g)


def _model(name_or_cfg="tiny", seed: int = 0, dtype=torch.float64, **changes) -> TinyLM:
    torch.manual_seed(seed)
    model = build_model(name_or_cfg, **changes).eval()
    return model.to(dtype)


def test_tiny_preset_shape():
    # The rest of this file relies on these numbers.
    c = TINY
    assert (c.cmp_block, c.cmp_stride, c.sel_block, c.n_selected, c.window) == (8, 4, 16, 3, 32)
    assert (c.n_heads, c.n_kv_groups, c.group_size, c.head_dim, c.dim_v) == (4, 2, 2, 16, 16)
    assert c.attention == "nsa" and c.compression == "mean" and c.gate == "group"


# --- 1. causality ---------------------------------------------------------------------------

NSA_VARIANTS = [
    dict(compression=c, gate=g, rope=r, shared_kv=s)
    for c, g, r, s in itertools.product(("mean", "mlp"), ("group", "head"), ("half", "interleaved"), (False, True))
]
CAUSAL_CASES = (
    [("tiny", v) for v in NSA_VARIANTS]
    + [("tiny", dict(head_dim_v=8, rotary_dim=8, compression="mlp")), ("tiny-dense", {})]
)


def _case_id(case):
    name, changes = case
    if not changes:
        return name
    return "-".join(
        f"{k}={v}" if k in ("head_dim_v", "rotary_dim") else (("shared" if v else "sep") if isinstance(v, bool) else v)
        for k, v in changes.items()
    )


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=[_case_id(c) for c in CAUSAL_CASES])
def test_causality(case):
    name, changes = case
    model = _model(name, **changes)
    cfg = model.cfg
    S = 70  # > n*l' = 48 (selection is sparse), > w = 32 (window truncates), not a multiple of l or l'
    tokens = _tokens(2, S, cfg.vocab_size, seed=1)
    with torch.no_grad():
        base = model(tokens)
        assert base.dtype == torch.float64
        assert torch.isfinite(base).all()
        # p = 0: nothing before; 7: last token of the first compression block; 16: first token of
        # selection block 1; 41: mid-sequence; 69: the last token.
        for p in (0, 7, 16, 41, S - 1):
            perturbed = tokens.clone()
            perturbed[:, p] = (perturbed[:, p] + 1) % cfg.vocab_size
            out = model(perturbed)
            assert torch.equal(out[:, :p], base[:, :p]), f"position < {p} changed"
            # The perturbed position itself changes, in every batch row.
            for b in range(tokens.shape[0]):
                assert not torch.equal(out[b, p], base[b, p])
            if p < S - 1:
                # ... and the change reaches later positions (including ones past the window).
                assert not torch.equal(out[:, p + 1 :], base[:, p + 1 :])
                if p + cfg.window < S:
                    assert not torch.equal(out[:, p + cfg.window :], base[:, p + cfg.window :])


# --- 2. shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,changes", [
    ("tiny", {}),
    ("tiny", dict(compression="mlp", gate="head", rope="interleaved", shared_kv=True)),
    ("tiny", dict(head_dim_v=8, rotary_dim=8, compression="mlp", rope="interleaved")),
    ("tiny-dense", {}),
])
@pytest.mark.parametrize("S", [1, 7, 8, 13, 16, 37, 48, 49, 100])
def test_logits_shape(name, changes, S):
    model = _model(name, dtype=torch.float32, **changes)
    B = 3
    with torch.no_grad():
        logits = model(_tokens(B, S, model.cfg.vocab_size, seed=S))
    assert logits.shape == (B, S, model.cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_batch_rows_independent():
    # Batch rows do not interact: row b of a batch equals the same sequence run alone.
    model = _model("tiny", compression="mlp")
    tokens = _tokens(3, 37, 256, seed=5)
    with torch.no_grad():
        full = model(tokens)
        for b in range(3):
            alone = model(tokens[b : b + 1])
            torch.testing.assert_close(full[b : b + 1], alone, rtol=1e-12, atol=1e-12)


# --- 3. gradients ---------------------------------------------------------------------------


def _grads(model: TinyLM, B: int, S: int, seed: int = 0):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model.loss(_tokens(B, S + 1, model.cfg.vocab_size, seed=seed))
    assert torch.isfinite(loss)
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _no_grad_expected(model: TinyLM, S: int) -> set[str]:
    """Parameters that take no part: with S < l the compressed branch is skipped entirely, so
    phi (compress_k/v) and, when the branches have their own projections, W_k^cmp and W_v^cmp."""
    cfg = model.cfg
    if cfg.attention == "dense" or S >= cfg.cmp_block:
        return set()
    out = set()
    for name, _ in model.named_parameters():
        if ".attn.compress_k." in name or ".attn.compress_v." in name:
            out.add(name)
        if not cfg.shared_kv and (".attn.wk.cmp." in name or ".attn.wv.cmp." in name):
            out.add(name)
    return out


@pytest.mark.parametrize("changes", [
    dict(compression="mlp"),
    dict(compression="mlp", shared_kv=True, gate="head"),
    dict(compression="mean"),
    dict(compression="mean", shared_kv=True, rope="interleaved"),
])
@pytest.mark.parametrize("S", [5, 7, 8, 13, 37])
def test_gradients(changes, S):
    model = _model("tiny", dtype=torch.float32, **changes)
    cfg = model.cfg
    grads = _grads(model, B=2, S=S)
    expected_none = _no_grad_expected(model, S)
    if cfg.compression == "mlp" and S < cfg.cmp_block:
        assert any(".compress_k." in n for n in expected_none) and any(".compress_v." in n for n in expected_none)
    none = {name for name, g in grads.items() if g is None}
    assert none == expected_none
    for name, g in grads.items():
        if g is not None:
            assert torch.isfinite(g).all(), name
    if cfg.compression == "mlp" and S >= cfg.cmp_block:
        # phi takes part: its gradients are present and not all zero. (For phi_K only once some
        # query sees two blocks, S >= l + d: a softmax over one block is 1 whatever its key, so
        # with S = l the gradient of phi_K is exactly zero, correctly.)
        for layer in range(cfg.n_layers):
            for which in ("compress_k", "compress_v") if S >= cfg.cmp_block + cfg.cmp_stride else ("compress_v",):
                for pname in ("pos_emb", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"):
                    g = grads[f"blocks.{layer}.attn.{which}.{pname}"]
                    assert g is not None and torch.isfinite(g).all()
                    assert g.abs().sum() > 0, (layer, which, pname)
    # The projections every branch uses always get a nonzero gradient.
    for layer in range(cfg.n_layers):
        assert grads[f"blocks.{layer}.attn.wq.weight"].abs().sum() > 0
        assert grads[f"blocks.{layer}.attn.wo.weight"].abs().sum() > 0


def test_gradients_dense():
    model = _model("tiny-dense", dtype=torch.float32)
    for S in (5, 37):
        grads = _grads(model, B=2, S=S)
        for name, g in grads.items():
            assert g is not None, name
            assert torch.isfinite(g).all(), name


def test_mlp_compression_gradient_none_exactly_when_short():
    # The same model and parameters: S = l - 1 -> compress_k/v grads None; S = l -> present.
    model = _model("tiny", dtype=torch.float32, compression="mlp")
    l = model.cfg.cmp_block
    g_short = _grads(model, B=1, S=l - 1)
    assert g_short["blocks.0.attn.compress_k.pos_emb"] is None
    assert g_short["blocks.1.attn.compress_v.mlp.2.bias"] is None
    g_full = _grads(model, B=1, S=l)
    assert g_full["blocks.0.attn.compress_k.pos_emb"] is not None
    assert g_full["blocks.1.attn.compress_v.mlp.2.bias"] is not None


# --- 4. block selection by hand --------------------------------------------------------------

# A config small enough to work by hand: l = 4, d = 2, l' = 4, n = 4, H = 4, G = 2 (h = 2;
# heads 0, 1 -> group 0, heads 2, 3 -> group 1).
HAND = ModelConfig(
    vocab_size=16, dim=16, n_layers=1, n_heads=4, n_kv_groups=2, head_dim=4,
    cmp_block=4, cmp_stride=2, sel_block=4, n_selected=4, window=8,
)
# Compression block i covers [2i, 2i + 4); selection block j covers [4j, 4j + 4). overlap / l:
#   i = 2j -> 4/4 = 1, i = 2j - 1 and i = 2j + 1 -> 2/4 = 1/2, so
#   p_slc[j] = 1/2 p[2j-1] + p[2j] + 1/2 p[2j+1].
# With S = 20: Tc = (20 - 4) // 2 + 1 = 9 (i = 0..8), Ns = 5 (j = 0..4).


def _hand_p_cmp() -> torch.Tensor:
    p = torch.zeros(1, 4, 20, 9, dtype=torch.float32)
    # t = 2 (< l'): block 4 scores high, but only block 0 is a candidate.
    p[0, 0, 2, 8] = 1.0
    # t = 9: mass on i = 8 (tokens 16..19 -> j = 4, not a candidate since 4*4 > 9).
    p[0, 0, 9, 8] = 1.0
    p[0, 2, 9, 7] = 1.0  # i = 7 -> j = 3 (1/2) and j = 4 (1/2): neither a candidate
    # t = 13: forced {0, 2, 3}; j = 1 is the only other candidate, j = 4 is not one.
    p[0, 1, 13, 8] = 1.0
    # t = 16: forced {0, 3, 4} (current 4, previous 3); free slot between j = 1 and j = 2.
    #   group 0: head 0 p[2] = 0.5 -> j1 = 0.5;
    #            head 1 p[4] = 0.25, p[5] = 0.5 -> j2 = 0.25 + 1/2 * 0.5 = 0.5.  Tie -> j = 1.
    p[0, 0, 16, 2] = 0.5
    p[0, 1, 16, 4] = 0.25
    p[0, 1, 16, 5] = 0.5
    #   group 1: head 2 p[4] = 1 -> j2 = 1; head 3 p[0] = 1 -> j0 = 1 (forced anyway). -> j = 2.
    p[0, 2, 16, 4] = 1.0
    p[0, 3, 16, 0] = 1.0
    # t = 17: group 0 (the 1/2 weights decide):
    #   head 0 p[2] = 0.25, p[3] = 0.25 -> j1 = 0.25 + 0.125 = 0.375, j2 = 0.125;
    #   head 1 p[5] = 0.375 -> j2 += 0.1875 -> j2 = 0.3125 < 0.375 -> j = 1.
    #   (with full instead of 1/2 weights j2 = 0.625 > j1 = 0.5 would win.)
    p[0, 0, 17, 2] = 0.25
    p[0, 0, 17, 3] = 0.25
    p[0, 1, 17, 5] = 0.375
    #   group 1: head 2 p[5] = 1 -> j2 = 0.5, j3 = 0.5; head 3 p[1] = 0.75 -> j0 = j1 = 0.375.
    #   j2 = 0.5 > j1 = 0.375 -> j = 2.
    p[0, 2, 17, 5] = 1.0
    p[0, 3, 17, 1] = 0.75
    # t = 18: group 0 all zero -> tie at 0 -> j = 1.
    #   group 1: head 2 p[1] = 0.125 -> j0 = j1 = 0.0625; head 3 p[4] = 0.125 -> j2 = 0.125.
    #   Group sum: j2 = 0.125 > j1 = 0.0625 -> j = 2 (head 2 alone would pick j = 1).
    p[0, 2, 18, 1] = 0.125
    p[0, 3, 18, 4] = 0.125
    # t = 19: group 1: the forced blocks score highest (head 2 p[6] = 1 -> j3 = 1; head 3
    #   p[8] = 1 -> j4 = 1), j1 = 1/2 p[3] = 0.25 (head 2 p[3] = 0.5), j2 = 1/2 * 0.5 = 0.25
    #   plus head 3 p[5] = 0.25 -> j2 = 0.25 + 0.125 = 0.375 > 0.25 -> j = 2.
    p[0, 2, 19, 6] = 1.0
    p[0, 3, 19, 8] = 1.0
    p[0, 2, 19, 3] = 0.5
    p[0, 3, 19, 5] = 0.25
    return p


# Expected rows: t = 0..3 -> only block 0; t = 4..7 -> {0, 1} (forced: 0 and current 1);
# t = 8..11 -> {0, 1, 2} (forced: 0, previous 1, current 2); t = 12..15 -> forced {0, 2, 3}
# plus the only other candidate 1; t = 16..19 -> forced {0, 3, 4} plus 1 or 2 (see above).
_EXPECTED_HAND = [
    [  # group 0
        [0, -1, -1, -1], [0, -1, -1, -1], [0, -1, -1, -1], [0, -1, -1, -1],  # t = 0..3
        [0, 1, -1, -1], [0, 1, -1, -1], [0, 1, -1, -1], [0, 1, -1, -1],  # t = 4..7
        [0, 1, 2, -1], [0, 1, 2, -1], [0, 1, 2, -1], [0, 1, 2, -1],  # t = 8..11
        [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3],  # t = 12..15
        [0, 1, 3, 4],  # t = 16: tie j1 = j2 = 0.5 -> lower index 1
        [0, 1, 3, 4],  # t = 17: j1 = 0.375 > j2 = 0.3125
        [0, 1, 3, 4],  # t = 18: all zero, tie -> 1
        [0, 1, 3, 4],  # t = 19: all zero, tie -> 1
    ],
    [  # group 1
        [0, -1, -1, -1], [0, -1, -1, -1], [0, -1, -1, -1], [0, -1, -1, -1],
        [0, 1, -1, -1], [0, 1, -1, -1], [0, 1, -1, -1], [0, 1, -1, -1],
        [0, 1, 2, -1], [0, 1, 2, -1], [0, 1, 2, -1], [0, 1, 2, -1],
        [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3],
        [0, 2, 3, 4],  # t = 16: j2 = 1 > j1 = 0
        [0, 2, 3, 4],  # t = 17: j2 = 0.5 > j1 = 0.375
        [0, 2, 3, 4],  # t = 18: j2 = 0.125 > j1 = 0.0625
        [0, 2, 3, 4],  # t = 19: j2 = 0.375 > j1 = 0.25
    ],
]


def test_select_blocks_by_hand():
    attn = NSAAttention(HAND)
    out = attn.select_blocks(_hand_p_cmp(), 20)
    expected = torch.tensor([_EXPECTED_HAND], dtype=torch.int64)  # [1, G=2, S=20, n=4]
    assert out.dtype == torch.int64
    assert out.shape == expected.shape
    assert torch.equal(out, expected), (out != expected).nonzero().tolist()


def test_select_blocks_by_hand_tiny():
    # The tiny preset's own mapping (l = 8, d = 4, l' = 16), as printed in NSA_SEMANTICS.md:
    #   p_slc[j] = 1/2 p[4j-1] + p[4j] + p[4j+1] + p[4j+2] + 1/2 p[4j+3].
    # n = 4, S = 80: Tc = (80 - 8) // 4 + 1 = 19, Ns = 5. At t = 64..79 forced {0, 3, 4},
    # free slot between j = 1 and j = 2.
    cfg = preset("tiny", n_selected=4)
    p = torch.zeros(1, 4, 80, 19)
    # t = 70, group 0: head 0 p[7] = 1 -> j1 = 1/2, j2 = 1/2 (i = 7 straddles blocks 1 and 2);
    #   head 1 p[8] = 0.25 -> j2 = 0.75 > 0.5 -> j = 2.
    p[0, 0, 70, 7] = 1.0
    p[0, 1, 70, 8] = 0.25
    # t = 70, group 1: head 2 p[3] = 1 -> j0 = j1 = 1/2; head 3 p[11] = 1 -> j2 = j3 = 1/2.
    #   j1 = j2 = 0.5: tie -> j = 1.
    p[0, 2, 70, 3] = 1.0
    p[0, 3, 70, 11] = 1.0
    # t = 79, group 0: head 0 p[4] = p[5] = p[6] = 0.25 -> j1 = 0.75; head 1 p[9] = 0.5 -> j2 = 0.5
    #   -> j = 1.   group 1: all zero -> tie -> j = 1.
    p[0, 0, 79, 4:7] = 0.25
    p[0, 1, 79, 9] = 0.5
    out = NSAAttention(cfg).select_blocks(p, 80)
    assert out.shape == (1, 2, 80, 4)
    assert out[0, :, 70].tolist() == [[0, 2, 3, 4], [0, 1, 3, 4]]
    assert out[0, :, 79].tolist() == [[0, 1, 3, 4], [0, 1, 3, 4]]
    assert out[0, :, 5].tolist() == [[0, -1, -1, -1]] * 2  # t < l'
    assert out[0, :, 40].tolist() == [[0, 1, 2, -1]] * 2  # forced {0, 1, 2}, no other candidate
    assert out[0, :, 50].tolist() == [[0, 1, 2, 3]] * 2  # forced {0, 2, 3} + the only candidate 1


def test_select_blocks_fewer_blocks_than_n():
    # S < l: Tc = 0 (empty p_cmp), Ns = 1 < n; and S = 6 with the hand config: Ns = 2 < n = 4.
    out = NSAAttention(TINY).select_blocks(torch.zeros(2, 4, 7, 0), 7)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.tensor([0, -1, -1]).expand(2, 2, 7, 3))
    p = torch.zeros(1, 4, 6, 2)
    p[0, :, 5, 1] = 1.0  # i = 1 covers [2, 6): j0 and j1 halves
    out = NSAAttention(HAND).select_blocks(p, 6)
    row_a, row_b = [0, -1, -1, -1], [0, 1, -1, -1]
    assert torch.equal(out, torch.tensor([[[row_a] * 4 + [row_b] * 2] * 2]))


# --- 5. select_blocks properties ---------------------------------------------------------------


def _real_p_cmp(cfg: ModelConfig, B: int, S: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    attn = NSAAttention(cfg)
    q = torch.randn(B, S, cfg.n_heads, cfg.head_dim) * 3
    k = torch.randn(B, S, cfg.n_kv_groups, cfg.head_dim)
    v = torch.randn(B, S, cfg.n_kv_groups, cfg.dim_v)
    _, p = attn.compressed_attention(q, k, v)
    return p


@pytest.mark.parametrize("n_selected", [3, 5])
def test_select_blocks_properties(n_selected):
    cfg = preset("tiny", n_selected=n_selected)
    B, S, ls, n, G = 2, 100, cfg.sel_block, cfg.n_selected, cfg.n_kv_groups
    p_cmp = _real_p_cmp(cfg, B, S, seed=n_selected)
    Tc = (S - cfg.cmp_block) // cfg.cmp_stride + 1
    assert p_cmp.shape == (B, cfg.n_heads, S, Tc) and p_cmp.dtype == torch.float32
    idx = NSAAttention(cfg).select_blocks(p_cmp, S)
    assert idx.dtype == torch.int64
    assert idx.shape == (B, G, S, n)
    for b in range(B):
        for g in range(G):
            for t in range(S):
                row = idx[b, g, t].tolist()
                chosen = [j for j in row if j >= 0]
                k = len(chosen)
                assert row[k:] == [-1] * (n - k), row  # -1 only at the end
                assert chosen == sorted(set(chosen)), row  # ascending, no duplicates
                assert all(j * ls <= t for j in chosen), (t, row)  # candidates only
                cur = t // ls
                forced = {0, cur} | ({cur - 1} if cur >= 1 else set())
                assert forced <= set(chosen), (t, row)
                assert k == min(n, cur + 1), (t, row)  # as many as allowed


def _select_reference(p_cmp: torch.Tensor, cfg: ModelConfig, S: int) -> torch.Tensor:
    """Section 3 in plain Python (float64 arithmetic; exact for the dyadic inputs used)."""
    B, H, _, Tc = p_cmp.shape
    l, d, ls, n, G, h = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.n_kv_groups, cfg.group_size
    Ns = -(-S // ls)
    overlap = [[max(0, min(i * d + l, (j + 1) * ls) - max(i * d, j * ls)) / l for j in range(Ns)] for i in range(Tc)]
    p = p_cmp.tolist()
    out = torch.full((B, G, S, n), -1, dtype=torch.int64)
    for b in range(B):
        for g in range(G):
            for t in range(S):
                cur = t // ls
                key = []
                for j in range(Ns):
                    if j in (0, cur, cur - 1):
                        key.append(math.inf)
                    elif j * ls <= t:
                        key.append(sum(p[b][hd][t][i] * overlap[i][j] for hd in range(g * h, g * h + h) for i in range(Tc)))
                    else:
                        key.append(-math.inf)
                order = sorted(range(Ns), key=lambda j: -key[j])  # Python's sort is stable
                chosen = sorted(j for j in order[:n] if key[j] > -math.inf)
                out[b, g, t, : len(chosen)] = torch.tensor(chosen)
    return out


@pytest.mark.parametrize("n_selected", [3, 5])
def test_select_blocks_matches_reference_with_ties(n_selected):
    # Dyadic scores in {0, 1/4, ..., 1}: every sum is exact in float32, ties are frequent.
    cfg = preset("tiny", n_selected=n_selected)
    B, S = 2, 100
    Tc = (S - cfg.cmp_block) // cfg.cmp_stride + 1
    g = torch.Generator().manual_seed(n_selected)
    p_cmp = torch.randint(0, 5, (B, cfg.n_heads, S, Tc), generator=g).float() / 4
    idx = NSAAttention(cfg).select_blocks(p_cmp, S)
    ref = _select_reference(p_cmp, cfg, S)
    assert torch.equal(idx, ref), (idx != ref).nonzero()[:5].tolist()


# --- 6. presets and config validation -------------------------------------------------------------


def test_preset_seed():
    c = preset("seed")
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_groups) == (256, 768, 12, 12, 2)
    assert (c.head_dim, c.dim_v, c.group_size) == (64, 64, 6)
    assert (c.cmp_block, c.cmp_stride, c.sel_block, c.n_selected, c.window) == (32, 16, 64, 16, 512)
    assert (c.compression, c.gate, c.rope, c.shared_kv, c.attention) == ("mean", "group", "half", False, "nsa")
    assert c.rot_dim == 64 and c.rope_base == 10000.0 and c.mlp_ratio == 4


def test_preset_paper():
    c = preset("paper")
    assert (c.n_heads, c.n_kv_groups, c.head_dim, c.group_size) == (64, 4, 128, 16)
    assert (c.compression, c.gate) == ("mlp", "head")
    assert (c.cmp_block, c.cmp_stride, c.sel_block, c.n_selected, c.window) == (32, 16, 64, 16, 512)


def test_preset_dense_and_changes():
    d = preset("tiny-dense")
    assert d.attention == "dense" and d.replace(attention="nsa") == TINY
    assert preset("seed-dense").attention == "dense"
    c = preset("tiny", window=7, n_selected=5)
    assert (c.window, c.n_selected, c.dim) == (7, 5, 64)
    assert PRESETS["tiny"].window == 32  # the preset itself is untouched
    assert preset("tiny") == TINY
    assert isinstance(build_model("tiny-dense").blocks[0].attn, DenseAttention)
    assert isinstance(build_model("tiny").blocks[0].attn, NSAAttention)
    assert build_model(TINY.replace(n_layers=1)).cfg.n_layers == 1


@pytest.mark.parametrize("name", ["bogus", "tiny-sparse", "Tiny", ""])
def test_preset_unknown(name):
    with pytest.raises(ValueError) as info:
        preset(name)
    msg = str(info.value)
    for valid in ("seed", "tiny", "paper", "tiny-dense"):
        assert valid in msg
    with pytest.raises(ValueError):
        build_model(name)


@pytest.mark.parametrize("changes,match", [
    (dict(n_heads=12, n_kv_groups=5), "multiple"),
    (dict(n_heads=4, n_kv_groups=3), "multiple"),
    (dict(n_selected=2), "n_selected"),
    (dict(n_selected=0), "n_selected"),
    (dict(rotary_dim=7), "rotary_dim"),
    (dict(rotary_dim=128), "rotary_dim"),
    (dict(head_dim=15), "rotary_dim"),  # odd head dim with full rotary
    (dict(cmp_stride=24), "stride"),
    (dict(sel_block=40), "stride"),
    (dict(compression="max"), "compression"),
    (dict(gate="token"), "gate"),
    (dict(rope="neox"), "rope"),
    (dict(attention="flash"), "attention"),
])
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**changes)
    with pytest.raises(ValueError, match=match):
        preset("seed", **changes)


def test_config_valid_edges():
    assert ModelConfig(n_selected=3).n_selected == 3
    assert ModelConfig(rotary_dim=32).rot_dim == 32
    assert ModelConfig(head_dim_v=32).dim_v == 32


# --- 7. branches against loop references ------------------------------------------------------------


def _qkv(cfg: ModelConfig, B: int, S: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, cfg.n_heads, cfg.head_dim, generator=g, dtype=dtype)
    k = torch.randn(B, S, cfg.n_kv_groups, cfg.head_dim, generator=g, dtype=dtype)
    v = torch.randn(B, S, cfg.n_kv_groups, cfg.dim_v, generator=g, dtype=dtype)
    return q, k, v


def _attend(q_t, keys, values, scale):
    """One query [D] over keys [T, D] / values [T, Dv]."""
    p = torch.softmax((keys @ q_t) * scale, dim=0)
    return p @ values


@pytest.mark.parametrize("window,S", [(5, 13), (4, 4), (1, 9), (32, 13)])
def test_window_attention_loop_reference(window, S):
    cfg = preset("tiny", window=window, head_dim_v=8)
    attn = NSAAttention(cfg).double()
    B, h = 2, cfg.group_size
    q, k, v = _qkv(cfg, B, S, seed=window)
    out = attn.window_attention(q, k, v)
    assert out.shape == (B, S, cfg.n_heads, cfg.dim_v) and out.dtype == torch.float64
    ref = torch.empty_like(out)
    for b in range(B):
        for hd in range(cfg.n_heads):
            g = hd // h
            for t in range(S):
                lo = max(0, t - window + 1)
                ref[b, t, hd] = _attend(q[b, t, hd], k[b, lo : t + 1, g], v[b, lo : t + 1, g], cfg.head_dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if window == 1:  # attends only to itself: o = v of its own group
        torch.testing.assert_close(out, v.repeat_interleave(h, dim=2), rtol=0, atol=1e-15)


def _all_past_blocks(cfg: ModelConfig, B: int, S: int) -> torch.Tensor:
    """[B, G, S, n]: blocks 0..t // l' for every t, then -1 (needs S <= n * l')."""
    ls, n = cfg.sel_block, cfg.n_selected
    idx = torch.full((B, cfg.n_kv_groups, S, n), -1, dtype=torch.int64)
    for t in range(S):
        c = t // ls + 1
        assert c <= n
        idx[:, :, t, :c] = torch.arange(c)
    return idx


@pytest.mark.parametrize("S", [1, 9, 16, 40, 48])
def test_selected_attention_all_blocks_is_causal(S):
    cfg = preset("tiny")  # n * l' = 48
    attn = NSAAttention(cfg).double()
    B = 2
    q, k, v = _qkv(cfg, B, S, seed=S)
    idx = _all_past_blocks(cfg, B, S)
    # For t < n*l' the selection itself picks every candidate block: exactly these indices.
    p_cmp = _real_p_cmp(cfg, B, S, seed=S)
    assert torch.equal(attn.select_blocks(p_cmp, S), idx)
    out = attn.selected_attention(q, k, v, idx)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2).repeat_interleave(cfg.group_size, dim=1),
        v.transpose(1, 2).repeat_interleave(cfg.group_size, dim=1),
        attn_mask=mask,
    ).transpose(1, 2)
    assert out.shape == (B, S, cfg.n_heads, cfg.dim_v)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if S <= cfg.window:  # then the window branch is the same causal attention
        torch.testing.assert_close(attn.window_attention(q, k, v), ref, rtol=1e-12, atol=1e-12)


def test_selected_attention_sparse_loop_reference():
    # S = 100 > n*l': the real (sparse) selection, checked against a per-query loop.
    cfg = preset("tiny", n_selected=4)
    attn = NSAAttention(cfg).double()
    B, S, ls, h = 2, 100, cfg.sel_block, cfg.group_size
    q, k, v = _qkv(cfg, B, S, seed=3)
    idx = attn.select_blocks(_real_p_cmp(cfg, B, S, seed=3), S)
    out = attn.selected_attention(q, k, v, idx)
    ref = torch.empty_like(out)
    for b in range(B):
        for hd in range(cfg.n_heads):
            g = hd // h
            for t in range(S):
                toks = [s for j in idx[b, g, t].tolist() if j >= 0 for s in range(j * ls, (j + 1) * ls) if s <= t]
                assert 0 in toks and t in toks
                toks = torch.tensor(toks)
                ref[b, t, hd] = _attend(q[b, t, hd], k[b, toks, g], v[b, toks, g], cfg.head_dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("S", [7, 8, 13, 37])
def test_compressed_attention_loop_reference(S):
    cfg = preset("tiny")  # mean compression
    attn = NSAAttention(cfg).double()
    B, l, d, h = 2, cfg.cmp_block, cfg.cmp_stride, cfg.group_size
    q, k, v = _qkv(cfg, B, S, seed=S)
    o, p = attn.compressed_attention(q, k, v)
    Tc = (S - l) // d + 1 if S >= l else 0
    assert o.shape == (B, S, cfg.n_heads, cfg.dim_v) and o.dtype == torch.float64
    assert p.shape == (B, cfg.n_heads, S, Tc) and p.dtype == torch.float64
    assert torch.isfinite(o).all() and torch.isfinite(p).all()
    o_ref, p_ref = torch.zeros_like(o), torch.zeros_like(p)
    for b in range(B):
        for hd in range(cfg.n_heads):
            g = hd // h
            kc = torch.stack([k[b, i * d : i * d + l, g].mean(0) for i in range(Tc)]) if Tc else None
            vc = torch.stack([v[b, i * d : i * d + l, g].mean(0) for i in range(Tc)]) if Tc else None
            for t in range(S):
                vis = [i for i in range(Tc) if i * d + l - 1 <= t]
                if not vis:
                    continue  # no visible block: p = 0, o = 0
                pr = torch.softmax((kc[vis] @ q[b, t, hd]) * cfg.head_dim**-0.5, dim=0)
                p_ref[b, hd, t, vis] = pr
                o_ref[b, t, hd] = pr @ vc[vis]
    torch.testing.assert_close(p, p_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(o[:, : l - 1], torch.zeros_like(o[:, : l - 1]))  # rows t < l - 1


def test_gates_sum_and_range():
    B, S = 2, 13
    for gate in ("group", "head"):
        cfg = preset("tiny", gate=gate)
        attn = NSAAttention(cfg).double()
        q, _, _ = _qkv(cfg, B, S, seed=0)
        x = torch.randn(B, S, cfg.dim, dtype=torch.float64)
        g = attn.gates(x, q)
        assert g.shape == (B, S, cfg.n_heads, 3)
        assert ((g > 0) & (g < 1)).all()
        if gate == "group":  # softmax over branches; the h heads of a group share it
            torch.testing.assert_close(g.sum(-1), torch.ones(B, S, cfg.n_heads, dtype=torch.float64))
            assert torch.equal(g[:, :, 0], g[:, :, 1]) and torch.equal(g[:, :, 2], g[:, :, 3])
            assert not torch.equal(g[:, :, 1], g[:, :, 2])


def test_branch_dtypes_bfloat16():
    # Scores and p_cmp in float32, branch outputs back in the input dtype (sections 2 and 7).
    cfg = preset("tiny")
    attn = NSAAttention(cfg)
    B, S = 1, 37
    q, k, v = (x.bfloat16() for x in _qkv(cfg, B, S, seed=1, dtype=torch.float32))
    o_cmp, p_cmp = attn.compressed_attention(q, k, v)
    assert o_cmp.dtype == torch.bfloat16 and p_cmp.dtype == torch.float32
    idx = attn.select_blocks(p_cmp, S)
    assert idx.dtype == torch.int64
    assert attn.selected_attention(q, k, v, idx).dtype == torch.bfloat16
    assert attn.window_attention(q, k, v).dtype == torch.bfloat16
    model = _model("tiny", dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(_tokens(2, S, cfg.vocab_size))
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, S, cfg.vocab_size)
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_pairs_and_relative_position(style):
    from nsa_compile.models.nsa import apply_rope, rope_tables

    D, r, S = 16, 8, 40
    cos, sin = rope_tables(S, r, 10000.0, "cpu")
    assert cos.shape == (S, r // 2) and cos.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, S, 2, D, dtype=torch.float64, generator=g)
    y = apply_rope(x, cos, sin, style)
    assert torch.equal(y[..., r:], x[..., r:])  # dims past rotary_dim pass through
    assert torch.equal(y[:, 0], x[:, 0])  # position 0: no rotation
    # Each pair keeps its norm: (i, i + r/2) for 'half', (2i, 2i + 1) for 'interleaved'.
    if style == "half":
        a, b = slice(0, r // 2), slice(r // 2, r)
    else:
        a, b = slice(0, r, 2), slice(1, r, 2)
    torch.testing.assert_close(y[..., a] ** 2 + y[..., b] ** 2, x[..., a] ** 2 + x[..., b] ** 2)
    # Position t rotates pair i by the angle t * 10000^(-2i/r).
    t, i = 5, 1
    ang = t * 10000.0 ** (-2 * i / r)
    xa, xb = x[0, t, 0, a][i], x[0, t, 0, b][i]
    expected = torch.stack([xa * math.cos(ang) - xb * math.sin(ang), xa * math.sin(ang) + xb * math.cos(ang)])
    torch.testing.assert_close(torch.stack([y[0, t, 0, a][i], y[0, t, 0, b][i]]), expected, rtol=1e-6, atol=1e-6)
    # Scores depend only on the relative position: the same q, k at (t, s) and (t + c, s + c).
    q = torch.randn(D, dtype=torch.float64, generator=g)
    k = torch.randn(D, dtype=torch.float64, generator=g)
    qs = apply_rope(q.expand(1, S, 1, D), cos, sin, style)[0, :, 0]
    ks = apply_rope(k.expand(1, S, 1, D), cos, sin, style)[0, :, 0]
    torch.testing.assert_close(qs[12] @ ks[3], qs[30] @ ks[21], rtol=1e-5, atol=1e-5)
