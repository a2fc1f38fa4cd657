#!/usr/bin/env bash
# The GPU-marked and Inductor tests and the parity checks, on the H100 with the GPU image's
# PyTorch (2.11): run it whenever kernel or pass code changes (a few minutes).
# On the device machine: bash tools/gpu_check.sh   (python3 there is the interpreter with torch;
# it installs the checkout without dependencies:
# the GPU image already has torch, triton, click, networkx, tabulate and pytest).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/nsa_gpu_check}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
python3 - <<'PY'
import inspect, torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as err:
    print("no varlen_attn:", err)
PY
# default: the GPU and Inductor tests without the size sweeps (about 5 minutes);
# --sweep: only the GPU size sweeps (the kernels at the issues' sizes; a few minutes);
# --all: the whole suite (the CPU tests on the image's PyTorch too; over 10 minutes with the
# sweeps: run --sweep and `--all -m "not sweep"`-style splits when a call is capped at 10 minutes)
selection=(-m "(gpu or inductor) and not sweep")
[ "${1:-}" = "--sweep" ] && selection=(-m sweep)
[ "${1:-}" = "--all" ] && selection=()
status=0
python3 -m pytest -q -p no:cacheprovider -p no:logging --durations=12 "${selection[@]}" tests 2>&1 | tee "$out/pytest.log" | tail -15 || status=1
if [ -z "${1:-}" ]; then
  # the Triton kernels on CUDA (on the CPU the same file runs them interpreted)
  python3 -m pytest -q -p no:cacheprovider -p no:logging -m "not sweep" tests/test_selection_triton.py tests/test_compressed_op.py \
    tests/test_block_select_op.py tests/test_gated_combine.py tests/test_fused_projections.py 2>&1 \
    | tee "$out/triton.log" | tail -5 || status=1
fi
if [ "${1:-}" != "--sweep" ]; then
  for dtype in fp32,bf16,fp16; do
    python3 -m nsa_compile parity --device cuda --model tiny --dtypes "$dtype" >"$out/parity_tiny.log" 2>&1 || status=1
    tail -4 "$out/parity_tiny.log"
  done
  python3 -m nsa_compile explain --device cuda --model seed --seq-len 256 >"$out/explain_seed.log" 2>&1 || status=1
  head -8 "$out/explain_seed.log"
fi
exit $status
