#!/usr/bin/env bash
# make deps: what a GPU run carries in DEPS (the device tool's carry: [".deps"]): nlohmann-json
# (header-only, MIT licence; the GPU image has none) copied from this machine's Debian package,
# and Liger-Kernel's wheel (pure Python over Triton), the GPU run's peer in op_bandwidth and the
# frontier, which the device installs with --no-deps (it cannot fetch).
# Environment from the Makefile: PYTHON, DEPS, LIGER.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEPS=${DEPS:-.deps}
LIGER=${LIGER:-0.8.5}
if [ ! -f "$DEPS/nlohmann/include/nlohmann/json.hpp" ]; then
  mkdir -p "$DEPS/nlohmann/include" "$DEPS/nlohmann/share/cmake" &&
    cp -r /usr/include/nlohmann "$DEPS/nlohmann/include/" &&
    cp -r /usr/share/cmake/nlohmann_json "$DEPS/nlohmann/share/cmake/" &&
    cp /usr/share/doc/nlohmann-json3-dev/copyright "$DEPS/nlohmann/" || exit 1
fi
ls "$DEPS"/wheels/liger_kernel-"$LIGER"-*.whl >/dev/null 2>&1 ||
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "liger-kernel==$LIGER" -d "$DEPS/wheels" ||
  echo "deps: the liger-kernel wheel could not be fetched; the GPU run skips Liger's rows"
exit 0
