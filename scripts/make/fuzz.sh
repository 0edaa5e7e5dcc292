#!/usr/bin/env bash
# make fuzz: libFuzzer targets (tests/fuzz/): the core's validation and kernels, the safetensors
# and config.json readers and the checkpoint MANIFEST, built with clang under ASan + UBSan, each
# run FUZZ_SECONDS (JOBS of them at once) from the corpus kept in tests/fuzz/corpus (new inputs go to
# $FUZZ_BUILD/corpus, crashes to $FUZZ_BUILD/artifacts). Any crash, sanitizer report or broken
# property fails. Environment from the Makefile: PYTHON, JOBS, FUZZ_BUILD, FUZZ_SECONDS.
set -euo pipefail
cd "$(dirname "$0")/../.."
FUZZ_BUILD=${FUZZ_BUILD:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
export CCACHE_BASEDIR=$PWD
[ -f "$FUZZ_BUILD/build.ninja" ] || cmake -S tests/fuzz -B "$FUZZ_BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DTorch_DIR="$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch"
cmake --build "$FUZZ_BUILD" -j "$JOBS"
mkdir -p "$FUZZ_BUILD/artifacts"
# One fuzzer a core (libFuzzer runs one process): JOBS at a time, each FUZZ_SECONDS.
fuzz_one() {
  local t=$1
  mkdir -p "$FUZZ_BUILD/corpus/$t"
  "$FUZZ_BUILD/$t" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 \
    -artifact_prefix="$FUZZ_BUILD/artifacts/$t-" "$FUZZ_BUILD/corpus/$t" "tests/fuzz/corpus/$t" \
    > "$FUZZ_BUILD/$t.log" 2>&1 || { tail -40 "$FUZZ_BUILD/$t.log"; echo "$t failed (log: $FUZZ_BUILD/$t.log)"; return 1; }
  echo "$t: $(grep -o 'Done [0-9]* runs in [0-9]* second' "$FUZZ_BUILD/$t.log")s, no failure"
}
pids=() rc=0
for t in fuzz_core fuzz_safetensors fuzz_config_json fuzz_manifest; do
  fuzz_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "${JOBS:-1}" ]; then wait "${pids[0]}" || rc=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
