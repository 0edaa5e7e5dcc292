# Two commands for a fresh machine:
#   make run    set up (.venv with torch, system packages), build the main job and run it
#   make test   build, then every C++ (ctest) and Python (pytest) test, the CUDA build, sanitizers,
#               fuzzers and the GPU dry run (make check: the C++ and Python tests alone)
# Both are idempotent. On a machine whose own python already has a (CUDA) torch:
#   make run PYTHON=python3      (no .venv; CUDA kernels are built when that torch has CUDA)
# The longer recipes are scripts in scripts/make/, each saying what it does and checks.

VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
BUILD   ?= build
JOBS    ?= $(shell nproc)
TORCH_VERSION ?= 2.13.0
# The CPU kernels for this machine's instruction set (-march=native): make builds for the
# machine it runs on. CMake's own default is portable (OFF), for packages built elsewhere.
NATIVE  ?= ON
PYTHON_ABS = $(if $(findstring /,$(PYTHON)),$(abspath $(PYTHON)),$(shell command -v $(PYTHON)))
# The CUDA build (scripts/make/cuda_build.sh): its own venv with a CUDA torch and build folder.
CUDA_VENV  ?= .venv-cuda
CUDA_BUILD ?= build-cuda
CUDA_TORCH ?= 2.14.1
CUDA_ARCHS ?= 90
# What a GPU run carries (the device tool's carry: [".deps"]): nlohmann-json and Liger's wheel.
DEPS       ?= .deps
LIGER      ?= 0.8.5
ASAN_BUILD ?= build-asan
SIMT_UBSAN_BUILD ?= build-ubsan-simt
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 20
# The CPU build's nvcc compile of the CUDA sources (a check where the CUDA kernels are not built).
CUDA_COMPILE_CHECK ?= ON
# ccache: paths relative to the checkout, and the files compiled with the precompiled LibTorch
# headers (cmake/TempoLayers.cmake) cached too.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_SLOPPINESS ?= pch_defines,time_macros
export VENV PYTHON BUILD JOBS TORCH_VERSION NATIVE CUDA_VENV CUDA_BUILD CUDA_TORCH CUDA_ARCHS DEPS LIGER \
       ASAN_BUILD SIMT_UBSAN_BUILD FUZZ_BUILD FUZZ_SECONDS

.PHONY: run test check build setup sysdeps venv bench accuracy clean cuda-build deps sanitize fuzz format format-check

# The main job: `tempo bench` on a reduced bert-base (memory, largest batch in a budget and
# throughput per policy, the policies' steps interleaved over 9 rounds; about 4 minutes on 2
# cores). It builds only what the job needs (the core, the op library, the layers above it and
# the CLI: 63 of the build's steps); `make test` builds the rest (the tests, the SIMT emulator,
# the op benchmarks). On a fresh clone of an idle 2-core machine without ccache (2026-12-07, its
# system packages present): 499 s, the venv 65, configure 7, build 204, the job 222.
# `make bench` adds the op benchmarks.
run: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target tempo
	$(BUILD)/tempo env
	mkdir -p $(BUILD)/results
	$(BUILD)/tempo bench --model bert-base --layers 2 --vocab 8192 --seq 128 --batch 8 --steps 9 --budget 640MiB \
	  --csv $(BUILD)/results/bench.csv --plot $(BUILD)/results/bench.svg

# The op benchmarks (activation, norms/dropout, attention, one encoder layer per policy, the AdamW step), side by side.
bench: build
	mkdir -p $(BUILD)/results
	$(BUILD)/bench_activation --csv $(BUILD)/results/activation_speed.csv --json $(BUILD)/results/activation_speed.json
	$(BUILD)/bench_norm --csv $(BUILD)/results/norm_speed.csv --json $(BUILD)/results/norm_speed.json
	$(BUILD)/bench_attention --seq 128,512 --csv $(BUILD)/results/attention_speed.csv --json $(BUILD)/results/attention_speed.json
	$(BUILD)/bench_layer --model bert-base --seq 128 --batch 4 --csv $(BUILD)/results/layer_speed.csv --json $(BUILD)/results/layer_speed.json
	$(BUILD)/bench_optimizer --model bert-base --csv $(BUILD)/results/optimizer_speed.csv --json $(BUILD)/results/optimizer_speed.json

# The edit-test loop: every C++ (ctest) and Python (pytest) test of the CPU build, without the
# CUDA wheel, the sanitizers, the fuzzers and the GPU dry run (about 12 min on 2 cores after a
# build, 2026-12-07, fresh clone: ctest 70 s, pytest -n 2 583 s), after the format check. make
# test on that idle clone, 2,320 s: setup 97, build 346, format + ctest 76, pytest 583,
# cuda-build 360, sanitize 546, fuzz 143 (99 s in the next run, the fuzzers two at a time), GPU
# dry run 158.
check: build format-check
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(PYTHON) -m pytest -q -n $(JOBS) tests/python

# The whole suite (what .ci/run runs): check, then the CUDA build, the sanitizers, the fuzzers
# and the GPU check's dry run. A build folder it configures leaves out the nvcc compile of the
# CUDA sources that make check's has (52 s on 2 cores): cuda-build compiles them for the GPU.
test: CUDA_COMPILE_CHECK = OFF
test: check cuda-build sanitize fuzz
	PYTHON=$(PYTHON) BUILD=$(BUILD) JOBS=$(JOBS) scripts/gpu_check.sh --dry-run $(BUILD)/gpu_check_dry

setup: sysdeps venv

sysdeps:
	scripts/make/setup.sh sysdeps

venv:
	scripts/make/setup.sh venv

$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DPython_EXECUTABLE=$(PYTHON_ABS) -DTEMPO_NATIVE=$(NATIVE) \
	  -DTEMPO_CUDA_COMPILE_CHECK=$(CUDA_COMPILE_CHECK)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# ASan + UBSan on tempo's own code and the CUDA kernels' emulation under UBSan.
sanitize: setup
	scripts/make/sanitize.sh

# libFuzzer targets (tests/fuzz/) under ASan + UBSan, FUZZ_SECONDS each.
fuzz: setup
	scripts/make/fuzz.sh

deps: sysdeps
	scripts/make/deps.sh

# Every CUDA path compiled and linked against a CUDA torch, checked without a GPU.
cuda-build: setup deps
	scripts/make/cuda_build.sh

# Formatting: `make format` applies clang-format (.clang-format) and ruff (pyproject.toml) to every
# tracked C++, CUDA and Python file; `make format-check` (in make check) fails on any they would change.
format:
	scripts/make/format.sh apply

format-check: setup
	scripts/make/format.sh check

# The accuracy sweep behind docs/accuracy.md.
accuracy: build
	$(PYTHON) benchmarks/activation_accuracy.py --markdown docs/accuracy.md --csv $(BUILD)/results/activation_accuracy.csv
	$(PYTHON) benchmarks/norm_accuracy.py --markdown docs/accuracy.md --csv $(BUILD)/results/norm_accuracy.csv

clean:
	rm -rf $(BUILD)
