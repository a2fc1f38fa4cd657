#!/usr/bin/env bash
# Each Triton kernel of this checkout against the same kernel in another checkout (the code before
# a change), in one device call: every op's benchmark tool on the old checkout, then on this one,
# so the two numbers of a row come from the same card minutes apart. Every tool checks
# parity in its own run; a variant that fails prints FAIL instead of a time.
#
#   bash tools/compare_kernels.sh OLD_CHECKOUT [SEQ_LEN]      # on the device machine
#
# OLD_CHECKOUT: a directory holding the older tree (e.g. `git archive <rev> | tar -x -C .old`,
# carried to the device). SEQ_LEN: the paper-shape length of the attention kernels (default 16384);
# the fusions run at the seed shape. Each side is installed with pip --no-deps in turn (this one
# last, so it stays installed), so the tools of each side import their own package. Output: per tool, the last lines of each side's
# table (about 6 minutes on an H200 at the default length).
set -uo pipefail
old=${1:?usage: compare_kernels.sh OLD_CHECKOUT [SEQ_LEN]}
S=${2:-16384}
new=$(cd "$(dirname "$0")/.." && pwd)
old=$(cd "$old" && pwd)
runs=(
  "bench_selection.py --shape paper --seq-len $S --variants triton --parity-len 2048"
  "bench_compressed.py --shape paper --seq-len $S --variants triton --parity-len 2048"
  "bench_block_select.py --shape paper --seq-len $S --variants triton --parity-len 2048"
  "bench_window.py --shape paper --seq-len $S --variants op-triton"
  "bench_combine.py --shape seed --seq-len 2048 --variants op"
  "bench_projections.py --seq-len 8192 --batch 8 --variants op --reps 20"
)
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || { echo "pip install of $1 failed"; exit 1; }; }
status=0
for side in old new; do
  dir=$([ "$side" = old ] && echo "$old" || echo "$new")
  install "$dir"
  for run in "${runs[@]}"; do
    echo "== $side: tools/$run"
    (cd "$dir" && timeout 300 python3 tools/$run 2>&1 | grep -v -i "warn" | tail -6) || status=1
  done
done
install "$new"
exit $status
