#!/usr/bin/env bash
# Regenerates docs/results/cpu.md: `tempo bench` on this machine's CPU, in this order (each
# result is rendered as soon as it exists, so a partial run still gives a partial page):
#   1. bert-large, S=512, fp32: activation bytes at batch 1 and the largest batch under
#      11 GiB per policy (eager, tempo, tempo-sdpa);
#   2. step time and tokens/s at equal batch on a reduced bert-base (4 layers), all policies;
#   3. the per-technique ablation of bert-large at S = 128, 256, 512;
#   4. bert-large S=128 under 11 GiB, then both sequence lengths under 16 GiB.
# checkpoint and sdpa are left out of the budget runs: on 2 CPU cores a step at checkpoint's
# largest batch takes many minutes. Usage: benchmarks/cpu_results.sh [BUILD_DIR [STEP...]]
# (1 h or more on 2 cores; the 16 GiB runs need a machine with well over 16 GiB of RAM). STEPs,
# all by default: s512-11GiB equal ablation s128-11GiB s512-16GiB s128-16GiB; a step left out
# keeps the result an earlier run left in BUILD_DIR. Each result is stamped with the commit it
# was made at (NAME.commit), and the page names the commits its tables come from.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
ALL=" s512-11GiB equal ablation s128-11GiB s512-16GiB s128-16GiB "
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || read -ra STEPS <<< "$ALL"
OUT=$BUILD/results/cpu
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
COMMIT=$(git rev-parse --short HEAD)
if ! git diff --quiet HEAD -- csrc CMakeLists.txt cmake; then COMMIT="$COMMIT with uncommitted changes"; fi
finish() {  # the result file just written as NAME.tmp: moved into place, stamped, rendered
  mv "$OUT/$1.tmp" "$OUT/$1"
  echo "$COMMIT" > "$OUT/$1.commit"
  "$PY" benchmarks/cpu_results.py "$OUT" docs/results/cpu.md
}
budget() {  # seq, budget
  # Freed blocks go back to the system at once (glibc's mmap threshold), so the process's
  # resident size stays near the tracked bytes: a 16 GiB budget fits a 24 GiB machine.
  MALLOC_MMAP_THRESHOLD_=131072 "$BUILD/tempo" bench --model bert-large --seq "$1" --batch 1 --steps 1 --methods eager,tempo,tempo-sdpa \
    --budget "$2" --json > "$OUT/bert-large-s$1-$2.json.tmp"
  finish "bert-large-s$1-$2.json"
}
for step in "${STEPS[@]}"; do  # all checked before the first (long) one runs
  [[ $ALL == *" $step "* ]] || { echo "cpu_results.sh: unknown step '$step' (steps:${ALL% })" >&2; exit 2; }
done
for step in "${STEPS[@]}"; do
  case $step in
    s512-11GiB | s128-11GiB | s512-16GiB | s128-16GiB) seq=${step%%-*}; budget "${seq#s}" "${step#*-}" ;;
    equal)
      "$BUILD/tempo" bench --model bert-base --layers 4 --seq 128 --batch 8 --steps 5 \
        --methods eager,eager+ckpt,sdpa,tempo,tempo-sdpa --json > "$OUT/bert-base-l4-s128.json.tmp"
      finish bert-base-l4-s128.json ;;
    ablation)
      "$BUILD/tempo" bench --model bert-large --ablation --ablation-seqs 128,256,512 > "$OUT/ablation.txt.tmp"
      finish ablation.txt ;;
  esac
done
