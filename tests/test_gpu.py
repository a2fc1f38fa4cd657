"""GPU-marked tests: run on the H100 by tools/gpu_check.sh (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import row, tokens

import nsa_compile
from nsa_compile.models import build_model
from nsa_compile.parity import check_parity

pytestmark = pytest.mark.gpu


def with_inductor(model):
    torch._dynamo.reset()
    return nsa_compile.optimize(model)


@pytest.mark.parametrize(
    "preset_name, dtype",
    [("tiny", torch.float32), ("tiny", torch.bfloat16), ("tiny", torch.float16), ("seed", torch.bfloat16)],
)
def test_gqa_rewrite_parity_on_cuda(preset_name, dtype):
    torch.manual_seed(0)
    eager = build_model(preset_name).cuda()
    batch = tokens(2, 100 if preset_name == "tiny" else 256, seed=1).cuda()
    report = check_parity(eager, with_inductor, batch, dtype)
    assert report.ok, [r.as_dict() for r in report.failures()]
    model = with_inductor(copy.deepcopy(eager).to(dtype))
    model.loss(batch).backward()
    assert row(model, "gqa_grouped_matmul")["matches"] == 6 * eager.cfg.n_layers
