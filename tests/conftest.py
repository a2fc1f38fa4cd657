import os
import tempfile
from pathlib import Path

import pytest

# tools/gpu_check.sh --parallel runs pytest-xdist workers on a host with several GPUs: worker gwN
# takes one of the GPUs listed in NSA_TEST_GPUS (N modulo their count), set before CUDA starts.
if os.environ.get("NSA_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER"):
    _gpus = os.environ["NSA_TEST_GPUS"].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % len(_gpus)]

import torch  # noqa: E402 (after the GPU choice above)

# Without a GPU, one intra-op thread in the test process and in the processes tests start (the
# CLI, the training tools, the distributed ranks): the tests' tensors are tiny, and on a 2-core
# machine shared with other work two OpenMP threads spinning against other processes made a
# training step of the tiny model 13x slower (3.1 s instead of 0.24 s). The GPU machine keeps its
# threads (its CPU-side float64 oracles are large).
if not torch.cuda.is_available():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_report_header(config):
    return ("the whole suite takes about 8 minutes on 2 idle CPU cores with two workers (README, Set-up); a test "
            "that compiles can hold one progress dot for a minute")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tools/gpu_check.sh on the H100)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write in (the CLI tests' outputs): a chmod 555 folder, or, for
    root, who ignores modes, /sys."""
    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    try:
        with tempfile.NamedTemporaryFile(dir="/sys"):
            pytest.skip("no folder this process cannot write in")
    except OSError:
        yield Path("/sys")


@pytest.fixture
def wrong_pass():
    """helpers.BreaksNumbers registered for one test."""
    import nsa_compile
    from helpers import BreaksNumbers

    nsa_compile.register_pass(BreaksNumbers())
    yield
    nsa_compile.unregister_pass(BreaksNumbers.name)
