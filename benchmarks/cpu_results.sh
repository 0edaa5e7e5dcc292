#!/usr/bin/env bash
# Regenerates docs/results/cpu.md: `tempo bench` on this machine's CPU, in this order (each
# result is rendered as soon as it exists, so a partial run still gives a partial page):
#   1. bert-large, S=512, fp32: activation bytes at batch 1 and the largest batch under
#      11 GiB per policy (eager, tempo, tempo-sdpa);
#   2. step time and tokens/s at equal batch on a reduced bert-base (4 layers), all policies;
#   3. the per-technique ablation of bert-large at S = 128, 256, 512;
#   4. bert-large S=128 under 11 GiB, then both sequence lengths under 16 GiB.
# checkpoint and sdpa are left out of the budget runs: on 2 CPU cores a step at checkpoint's
# largest batch takes many minutes. Usage: benchmarks/cpu_results.sh [BUILD_DIR] (1 h or more
# on 2 cores; the 16 GiB runs need a machine with well over 16 GiB of RAM).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=$BUILD/results/cpu
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
render() { "$PY" benchmarks/cpu_results.py "$OUT" docs/results/cpu.md; }
budget() {  # seq, budget
  # Freed blocks go back to the system at once (glibc's mmap threshold), so the process's
  # resident size stays near the tracked bytes: a 16 GiB budget fits a 24 GiB machine.
  MALLOC_MMAP_THRESHOLD_=131072 "$BUILD/tempo" bench --model bert-large --seq "$1" --batch 1 --steps 1 --policies eager,tempo,tempo-sdpa \
    --budget "$2" --json > "$OUT/bert-large-s$1-$2.json.tmp"
  mv "$OUT/bert-large-s$1-$2.json.tmp" "$OUT/bert-large-s$1-$2.json"
  render
}
budget 512 11GiB
"$BUILD/tempo" bench --model bert-base --layers 4 --seq 128 --batch 8 --steps 5 \
  --policies eager,checkpoint,sdpa,tempo,tempo-sdpa --json > "$OUT/bert-base-l4-s128.json"
render
"$BUILD/tempo" bench --model bert-large --ablation --ablation-seqs 128,256,512 > "$OUT/ablation.txt"
render
budget 128 11GiB
budget 512 16GiB
budget 128 16GiB
