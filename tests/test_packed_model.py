"""Packed documents and right padding in the eager reference model (NSA_SEMANTICS.md section 6).

The oracle for a packed row is each document run alone: the packed model must give, at every
token, what the model gives that token's document on its own (positions, blocks, the window and
RoPE all counted from the document start; nothing seen across documents).
"""

from __future__ import annotations

import pytest
import torch
from oracles import one_thread  # noqa: F401  (an autouse fixture: imported, it runs for this module)

from nsa_compile.models import build_model, check_positions, positions_from_cu_seqlens, preset


def _model(seed: int = 0, **changes):
    torch.manual_seed(seed)
    return build_model(preset("tiny", **changes)).double().eval()


# Document lengths per row: shorter than l (8), than l' (16), than w (32), not multiples of d (4),
# and one longer than n * l' (48) so the selection is sparse.
PACKINGS = [[13, 40, 1, 6, 30], [90], [45, 45], [7, 83]]

VARIANTS = [
    {},
    {"compression": "mlp", "gate": "head", "rope": "interleaved"},
    {"shared_kv": True, "rotary_dim": 8, "head_dim_v": 8},
    {"n_selected": 4, "n_heads": 6, "n_kv_groups": 2},
]


def _positions(lengths: list[int]) -> torch.Tensor:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return positions_from_cu_seqlens(cu, sum(lengths))


@pytest.mark.parametrize("changes", VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "tiny")
def test_packed_row_equals_documents_alone(changes):
    model = _model(**changes)
    S = 90
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (len(PACKINGS), S), generator=g)
    pos = torch.stack([_positions(lengths) for lengths in PACKINGS])
    with torch.no_grad():
        packed = model(tokens, pos)
        for b, lengths in enumerate(PACKINGS):
            start = 0
            for length in lengths:
                alone = model(tokens[b : b + 1, start : start + length])[0]
                torch.testing.assert_close(packed[b, start : start + length], alone, rtol=1e-10, atol=1e-10)
                start += length


def test_one_document_per_row_equals_unpacked():
    # pos = 0..S-1 is the unpacked model (the packed form pools a slot at every token and masks
    # all but every d-th: the same blocks).
    model = _model(compression="mlp")
    tokens = torch.randint(0, 256, (2, 77), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(77).expand(2, 77).contiguous()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, pos), model(tokens), rtol=1e-10, atol=1e-10)


def test_packed_gradients_match_documents_alone():
    model = _model()
    lengths = [20, 50, 20]
    tokens = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    pos = _positions(lengths)[None]
    model(tokens, pos).square().sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    start = 0
    for length in lengths:
        model(tokens[:, start : start + length]).square().sum().backward()
        start += length
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_no_attention_across_documents():
    # Changing any token of the first document leaves the second document's outputs unchanged.
    model = _model()
    tokens = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(4))
    pos = _positions([37, 53])[None]
    with torch.no_grad():
        base = model(tokens, pos)
        changed = tokens.clone()
        changed[0, :37] = (changed[0, :37] + 1) % 256
        out = model(changed, pos)
    assert torch.equal(out[0, 37:], base[0, 37:])
    assert not torch.allclose(out[0, :37], base[0, :37])


def test_right_padding_needs_no_mask():
    # Every branch is causal: the valid tokens of a right-padded row give what the row alone gives.
    model = _model()
    tokens = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(5))
    valid = [70, 41]
    with torch.no_grad():
        out = model(tokens)
        for b, n in enumerate(valid):
            torch.testing.assert_close(out[b, :n], model(tokens[b : b + 1, :n])[0], rtol=1e-10, atol=1e-10)


def test_positions_from_cu_seqlens():
    assert positions_from_cu_seqlens(torch.tensor([0, 3, 5]), 5).tolist() == [0, 1, 2, 0, 1]
    assert positions_from_cu_seqlens(torch.tensor([0, 4]), 4).tolist() == [0, 1, 2, 3]
    for bad in ([1, 5], [0, 3], [0, 3, 3, 5], [0, 6]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            positions_from_cu_seqlens(torch.tensor(bad), 5)


def test_bad_positions_refused():
    model = _model()
    tokens = torch.zeros(1, 6, dtype=torch.int64)
    for bad in ([[0, 1, 3, 4, 5, 6]], [[1, 2, 3, 4, 5, 6]], [[0, 1, 2, 1, 2, 3]]):
        with pytest.raises(ValueError, match="pos must be"):
            model(tokens, torch.tensor(bad))
    with pytest.raises(ValueError, match="int64"):
        check_positions(torch.zeros(1, 6, dtype=torch.int32), 6)
    with pytest.raises(ValueError, match="dense twin"):
        build_model("tiny-dense")(tokens, torch.zeros(1, 6, dtype=torch.int64))
