#!/usr/bin/env bash
# Regenerates docs/results/cpu.md: `tempo bench` on this machine's CPU.
#   1. bert-large, S=128 and S=512, fp32: activation bytes at batch 1 and the largest batch
#      under 11 GiB and 16 GiB per policy (eager, tempo, tempo-sdpa; checkpoint and sdpa are
#      left out of the budget runs: on 2 CPU cores a step of checkpoint's largest batch takes
#      many minutes);
#   2. step time and tokens/s at equal batch on a reduced bert-base (4 layers), all policies.
# Usage: benchmarks/cpu_results.sh [BUILD_DIR]   (about 30 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=$BUILD/results/cpu
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
for S in 128 512; do
  for B in 11GiB 16GiB; do
    "$BUILD/tempo" bench --model bert-large --seq "$S" --batch 1 --steps 1 --policies eager,tempo,tempo-sdpa \
      --budget "$B" --json > "$OUT/bert-large-s$S-$B.json"
  done
done
"$BUILD/tempo" bench --model bert-base --layers 4 --seq 128 --batch 8 --steps 5 \
  --policies eager,checkpoint,sdpa,tempo,tempo-sdpa --json > "$OUT/bert-base-l4-s128.json"
"$BUILD/tempo" bench --model bert-large --ablation --ablation-seqs 128,256,512 > "$OUT/ablation.txt"
"$PY" benchmarks/cpu_results.py "$OUT" docs/results/cpu.md
