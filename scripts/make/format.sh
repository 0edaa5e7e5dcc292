#!/usr/bin/env bash
# make format / make format-check: clang-format (.clang-format) on the C++ and CUDA sources, and
# ruff's formatter and lint (pyproject.toml [tool.ruff]) on the Python.
#   format.sh apply   rewrites the files (clang-format -i; ruff format; ruff check --fix)
#   format.sh check   fails, naming the files, when either would change or flag anything
# Every tracked source is held to it (the tree was formatted when this check came in).
# Environment from the Makefile: PYTHON (whose environment has ruff; setup installs it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
mode=${1:?usage: format.sh apply|check}
command -v clang-format >/dev/null || { echo "format.sh: no clang-format (make sysdeps installs it)" >&2; exit 2; }
"$PYTHON" -m ruff --version >/dev/null 2>&1 || { echo "format.sh: no ruff for $PYTHON (make venv installs it)" >&2; exit 2; }
mapfile -t cxx < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' '*.inc' | grep -v '^tests/fuzz/corpus/')
mapfile -t py < <(git ls-files '*.py')
if [ "$mode" = apply ]; then
  clang-format -i "${cxx[@]}"
  "$PYTHON" -m ruff format --quiet "${py[@]}"
  "$PYTHON" -m ruff check --fix --quiet "${py[@]}" || true
  exit 0
fi
bad=()
for f in "${cxx[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format.sh: clang-format would change ${#bad[@]} file(s) (make format applies it):"
  printf '  %s\n' "${bad[@]}"
fi
rc=0
"$PYTHON" -m ruff format --check --quiet "${py[@]}" || { echo "format.sh: ruff format would change the files above (make format applies it)"; rc=1; }
"$PYTHON" -m ruff check --quiet "${py[@]}" || rc=1
[ ${#bad[@]} -eq 0 ] && [ $rc = 0 ] || exit 1
