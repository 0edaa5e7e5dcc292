#!/usr/bin/env bash
# make sanitize: AddressSanitizer + UndefinedBehaviorSanitizer on tempo's kernels and ops (the
# core and the op library; LibTorch is not rebuilt): the core's suites, then the op library under
# the Python op suites that reach every op (the argument audit, the fused kernels, determinism,
# dropout), with the sanitizer runtime preloaded into Python. Any report fails. This build is
# also the one without nlohmann-json (every other build here has it): the CLI (its layers
# compiled without the sanitizers, CMakeLists.txt) links, and refuses what needs it by name.
# Before it, the CUDA kernels as the CPU runs them (tests/simt) under UBSan alone, in a small
# build of the core without LibTorch: ASan does not follow the emulator's own stack switching.
# This build is also the portable one (TEMPO_NATIVE=OFF: no -march=native; the AVX2 / AVX-512
# kernels chosen at run time), and its Python suites run with PyTorch, MKL and oneDNN held to
# AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA): a CPU other than the
# one that built `make check`'s library, so that no test passes on one x86-64 CPU alone.
# Environment from the Makefile: PYTHON, JOBS, ASAN_BUILD, SIMT_UBSAN_BUILD.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON_ABS=$(realpath -s "$(command -v "$PYTHON")")
ASAN_BUILD=${ASAN_BUILD:-build-asan}
SIMT_UBSAN_BUILD=${SIMT_UBSAN_BUILD:-build-ubsan-simt}
export CCACHE_BASEDIR=$PWD ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

[ -f "$SIMT_UBSAN_BUILD/build.ninja" ] || cmake -S . -B "$SIMT_UBSAN_BUILD" -G Ninja \
  -DPython_EXECUTABLE="$PYTHON_ABS" -DTEMPO_BUILD_TORCH=OFF -DTEMPO_CUDA_COMPILE_CHECK=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="-fsanitize=undefined -fno-sanitize-recover=undefined" \
  -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=undefined
cmake --build "$SIMT_UBSAN_BUILD" -j "$JOBS" --target tempo_simt_tests
for s in round-robin warp-first warp-last; do
  SIMT_SCHEDULE=$s "$SIMT_UBSAN_BUILD/tempo_simt_tests" --gtest_brief=1
done

# -O1 and line tables (-g1) for the reports' stacks: the build took 8 min on 2 cores at -O2 -g, and
# a LibTorch-heavy file compiles in half the time at -O1 -g1 (46.6 s -> 23.5 s, 2026-12-07).
mkdir -p "$ASAN_BUILD"
cmake -S . -B "$ASAN_BUILD" -G Ninja -DPython_EXECUTABLE="$PYTHON_ABS" \
  -DTEMPO_SANITIZE=ON -DTEMPO_CUDA_COMPILE_CHECK=OFF -DTEMPO_NATIVE=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -fno-omit-frame-pointer -DNDEBUG" \
  -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON > "$ASAN_BUILD/configure.log" || { cat "$ASAN_BUILD/configure.log"; exit 1; }
cmake --build "$ASAN_BUILD" -j "$JOBS" --target tempo_core_tests tempo_torch tempo
"$ASAN_BUILD/tempo" env | grep -E "hf checkpoints +no: built without nlohmann-json"
rc=0
"$ASAN_BUILD/tempo" train --out "$ASAN_BUILD/no-json" > "$ASAN_BUILD/no-json.txt" 2>&1 || rc=$?
if ! grep -q "this build has no nlohmann-json" "$ASAN_BUILD/no-json.txt" || [ $rc != 2 ] || [ -e "$ASAN_BUILD/no-json" ]; then
  cat "$ASAN_BUILD/no-json.txt"
  echo "tempo train without nlohmann-json: exit $rc, expected 2 and its message"
  exit 1
fi
"$ASAN_BUILD/tempo_core_tests"
LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)" \
  ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 TEMPO_LIBRARY="$(realpath -s -m "$ASAN_BUILD")/lib/libtempo_torch.so" PYTHONPATH=python "$PYTHON" -m pytest -q -x \
  -p no:cacheprovider tests/python/suites/test_validation_audit.py tests/python/ops/test_fused_kernels.py tests/python/ops/test_qkv_split.py \
  tests/python/suites/test_determinism.py tests/python/ops/test_dropout.py tests/python/suites/test_properties.py
