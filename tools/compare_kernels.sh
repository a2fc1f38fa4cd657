#!/usr/bin/env bash
# Each Triton kernel of this checkout against the same kernel in another checkout (the code before
# a change), in one device call: every op's benchmark tool on the old checkout, then on this one,
# so the two numbers of a row come from the same card minutes apart. Every tool checks
# parity in its own run; a variant that fails prints FAIL instead of a time.
#
#   bash tools/compare_kernels.sh OLD_CHECKOUT [SEQ_LEN] [TOOLS]     # on the device machine
#
# OLD_CHECKOUT: a directory holding the older tree (e.g. `git archive <rev> | tar -x -C .old`,
# carried to the device). SEQ_LEN: the paper-shape length of the attention kernels (default 16384);
# the fusions run at the seed shape. TOOLS: a comma-separated subset of the run names below
# (selection, selection-seed, compressed, compressed-seed, block_select, window, combine,
# projections; default: all but the -seed runs). Each side is installed (pip --no-deps, not
# editable) into its own folder under /tmp and run with PYTHONPATH pointing there, so the
# environment's own install is never touched and other jobs may run beside this one. Output: per
# tool, the last lines of each side's table (about 6 minutes on an H200 at the default length).
set -uo pipefail
old=${1:?usage: compare_kernels.sh OLD_CHECKOUT [SEQ_LEN]}
S=${2:-16384}
new=$(cd "$(dirname "$0")/.." && pwd)
old=$(cd "$old" && pwd)
declare -A runs=(
  [selection]="bench_selection.py --shape paper --seq-len $S --variants triton --parity-len 2048"
  [selection-seed]="bench_selection.py --shape seed --seq-len 2048 --variants triton --parity-len 2048"
  [compressed]="bench_compressed.py --shape paper --seq-len $S --variants triton --parity-len 2048"
  [compressed-seed]="bench_compressed.py --shape seed --seq-len 2048 --variants triton --parity-len 2048"
  [block_select]="bench_block_select.py --shape paper --seq-len $S --variants triton --parity-len 2048"
  [window]="bench_window.py --shape paper --seq-len $S --variants op-triton"
  [combine]="bench_combine.py --shape seed --seq-len 2048 --variants op"
  [projections]="bench_projections.py --seq-len 8192 --batch 8 --variants op --reps 20"
)
IFS=, read -ra names <<<"${3:-selection,compressed,block_select,window,combine,projections}"
for name in "${names[@]}"; do
  [ -n "${runs[$name]:-}" ] || { echo "compare_kernels.sh: unknown tool $name (valid: ${!runs[*]})"; exit 2; }
done
site() { echo "/tmp/compare_kernels_$1"; }
install() {  # $1 side, $2 checkout
  rm -rf "$(site "$1")"
  (cd "$2" && python3 -m pip install -q --no-deps --no-build-isolation --target "$(site "$1")" . >/dev/null 2>&1) \
    || { echo "pip install of $2 failed"; exit 1; }
}
install old "$old"
install new "$new"
status=0
for side in old new; do
  dir=$([ "$side" = old ] && echo "$old" || echo "$new")
  for name in "${names[@]}"; do
    echo "== $side: tools/${runs[$name]}"
    (cd "$dir" && PYTHONPATH="$(site "$side")" timeout 300 python3 tools/${runs[$name]} 2>&1 | grep -v -i "warn" | tail -6) \
      || status=1
  done
done
exit $status
