#!/usr/bin/env bash
# The GPU-marked and Inductor tests and the parity checks, on the H100 with the GPU image's
# PyTorch (2.11): run it whenever kernel or pass code changes.
# On the device machine: bash tools/gpu_check.sh [--tests | --tests2 | --tests3 | --parity | --kernels | --sweep | --all]
# (python3 there is the interpreter with torch; it installs the checkout without dependencies:
# the GPU image already has torch, triton, click, networkx, tabulate and pytest).
#   --tests    the GPU and Inductor tests without the size sweeps, first third (test files test_b* to
#              test_e*); the whole set took over 20 minutes on an H200, so it runs in three parts, each
#              one device call (H200, 2026-11-26: test_b* to test_gq* together took 9.3 min, too close
#              to the 10-minute limit, hence the thirds)
#   --tests2   the second third (test_f* to test_gq*, test_gpu.py)
#   --tests3   the last third (test_h* to test_w*, without the parity verdict, which is --parity)
#   --parity   the parity verdict on the seed model at S 2048 (tests/test_parity_verdict.py, GPU
#              part: unchanged code passes and each injected error fails at every seed; the float64
#              oracle's peak memory against 40 GiB and the meta-device estimate), then
#              tools/parity_breakdown.py --oracle-memory for the seed model at S 2048 (H200,
#              2026-11-26: the unchanged and injected tests took 71 s and 94 s)
#   --kernels  the Triton op test files on CUDA, as 6 pytest-xdist workers sharing the one GPU
#              (the time goes to compiling kernels, on the CPUs: run serially on a cold H100 they
#              took 8 min on 2026-11-26 and were cut at 46% after 560 s on 2026-11-28, with the
#              selection's dense-mode tests; the workers are not yet timed there), then the CLI
#              parity in three dtypes and explain; each option but (none), --sweep and --all is
#              meant to fit one 10-minute call
#   (none)     all three test parts, the parity verdict, then --kernels (over 30 minutes)
#   --sweep    only the GPU size sweeps (the kernels at the issues' sizes)
#   --all      the whole suite (the CPU tests on the image's PyTorch too)
#   --parallel what (none) runs, at once on a host with 2 or more GPUs (nvidia-h100-x4: one call):
#              the three test parts and --kernels' files as pytest-xdist workers, 3 a GPU, on every
#              GPU but the last (tests/conftest.py gives each worker its GPU from NSA_TEST_GPUS); the
#              last GPU runs --parity's checks, then the CLI parity and explain, alone (the parity
#              verdict measures the oracle's peak memory). Logs in $OUT: pytest.log, triton.log,
#              parity_verdict.log, oracle_memory.log, parity_tiny.log, explain_seed.log
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  ""|--tests|--tests2|--tests3|--kernels|--parity|--sweep|--all|--parallel) ;;
  *) echo "gpu_check.sh: unknown option $mode (valid: --tests, --tests2, --tests3, --parity, --kernels, --sweep, --all, --parallel)"; exit 2 ;;
esac
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
status=0
kernel_files=(tests/test_selection_triton.py tests/test_compressed_op.py tests/test_window_triton.py
  tests/test_block_select_op.py tests/test_gated_combine.py tests/test_fused_projections.py
  tests/test_query_offset.py tests/test_compressed_memory.py tests/test_window_offset.py
  tests/test_block_select_lucidrains.py)
if [ "$mode" = "--parallel" ]; then
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  [ "$gpus" -ge 2 ] || { echo "gpu_check.sh --parallel: needs 2 or more GPUs, this host has $gpus"; exit 2; }
  last=$((gpus - 1))
  workers=$(seq -s, 0 $((last - 1)))
  (
    export CUDA_VISIBLE_DEVICES=$last
    python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -p no:logging --durations=8 -m gpu tests/test_parity_verdict.py \
      >"$out/parity_verdict.log" 2>&1 || echo "FAILED: parity verdict" >>"$out/failed"
    python3 tools/parity_breakdown.py --oracle-memory --model seed --seq-len 2048 --batch 1 >"$out/oracle_memory.log" 2>&1 \
      || echo "FAILED: oracle memory" >>"$out/failed"
    python3 -m nsa_compile parity --device cuda --model tiny --dtypes fp32,bf16,fp16 >"$out/parity_tiny.log" 2>&1 \
      || echo "FAILED: CLI parity" >>"$out/failed"
    python3 -m nsa_compile explain --device cuda --model seed --seq-len 256 >"$out/explain_seed.log" 2>&1 \
      || echo "FAILED: explain" >>"$out/failed"
  ) &
  # the test parts' selection (the kernel files' GPU tests too), and beside it the kernel files
  # whole, as --kernels runs them; both spread over the same GPUs
  tests=($(ls tests/test_*.py | grep -v test_parity_verdict.py))
  NSA_TEST_GPUS=$workers OMP_NUM_THREADS=4 python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -p no:logging \
    --durations=25 -n $((2 * last)) -m "(gpu or inductor) and not sweep" "${tests[@]}" \
    >"$out/pytest.log" 2>&1 || echo "FAILED: the test parts" >>"$out/failed" &
  NSA_TEST_GPUS=$workers OMP_NUM_THREADS=4 python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -p no:logging \
    --durations=10 -n $last -m "not sweep" "${kernel_files[@]}" >"$out/triton.log" 2>&1 \
    || echo "FAILED: the kernel files" >>"$out/failed" &
  wait
  for log in pytest triton; do echo "== $log"; tail -8 "$out/$log.log"; done
  for log in parity_verdict oracle_memory parity_tiny explain_seed; do echo "== $log"; tail -4 "$out/$log.log"; done
  [ -f "$out/failed" ] && { cat "$out/failed"; status=1; }
  exit $status
fi
if [ "$mode" != "--kernels" ] && [ "$mode" != "--parity" ]; then
  # the seed parity verdict runs on its own below (its own log)
  selection=(-m "(gpu or inductor) and not sweep" --ignore=tests/test_parity_verdict.py)
  first=(tests/test_b*.py tests/test_c*.py tests/test_d*.py tests/test_e*.py)
  second=(tests/test_f*.py tests/test_ga*.py tests/test_gq*.py tests/test_gpu.py)
  # an explicit file beats --ignore, so the parity verdict is left out of the glob by name
  third=($(ls tests/test_[h-z]*.py | grep -v test_parity_verdict.py))
  files=("${first[@]}" "${second[@]}" "${third[@]}")
  [ "$mode" = "--tests" ] && files=("${first[@]}")
  [ "$mode" = "--tests2" ] && files=("${second[@]}")
  [ "$mode" = "--tests3" ] && files=("${third[@]}")
  [ "$mode" = "--sweep" ] && selection=(-m sweep) && files=(tests)
  [ "$mode" = "--all" ] && selection=() && files=(tests)
  python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -p no:logging --durations=25 "${selection[@]}" "${files[@]}" 2>&1 \
    | tee "$out/pytest.log" | tail -15 || status=1
fi
if [ -z "$mode" ] || [ "$mode" = "--parity" ]; then
  python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -p no:logging --durations=8 -m gpu tests/test_parity_verdict.py 2>&1 \
    | tee "$out/parity_verdict.log" | tail -12 || status=1
  python3 tools/parity_breakdown.py --oracle-memory --model seed --seq-len 2048 --batch 1 2>&1 \
    | tee "$out/oracle_memory.log" | tail -5 || status=1
fi
if [ -z "$mode" ] || [ "$mode" = "--kernels" ]; then
  # the Triton kernels on CUDA (on the CPU the same files run them interpreted)
  # 6 xdist workers where the image has pytest-xdist, else one process (said in the log)
  workers=(-n 6)
  python3 -c "import xdist" 2>/dev/null || { workers=(); echo "no pytest-xdist here: the kernel files run in one process"; }
  OMP_NUM_THREADS=2 python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -p no:logging --durations=10 "${workers[@]}" \
    -m "not sweep" "${kernel_files[@]}" 2>&1 | tee "$out/triton.log" | tail -14 || status=1
fi
if [ -z "$mode" ] || [ "$mode" = "--kernels" ] || [ "$mode" = "--all" ]; then
  python3 -m nsa_compile parity --device cuda --model tiny --dtypes fp32,bf16,fp16 >"$out/parity_tiny.log" 2>&1 || status=1
  tail -4 "$out/parity_tiny.log"
  python3 -m nsa_compile explain --device cuda --model seed --seq-len 256 >"$out/explain_seed.log" 2>&1 || status=1
  head -8 "$out/explain_seed.log"
fi
exit $status
