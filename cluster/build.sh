#!/usr/bin/env bash
# Configures (once) and builds dtrain into build/ with Ninja. Used by quickstart.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
JOBS="${DTRAIN_BUILD_JOBS:-$(nproc)}"
if [[ ! -f build/build.ninja ]]; then
  echo "[build] configuring build/ (CMake + Ninja)"
  cmake -S . -B build -G Ninja ${DTRAIN_CMAKE_ARGS:-} >.cmake-configure.log 2>&1 || {
    cat .cmake-configure.log >&2
    echo "[build] ERROR: CMake configure failed (log above)" >&2
    exit 1
  }
fi
echo "[build] building with ${JOBS} jobs"
start=$(date +%s)
cmake --build build -j "${JOBS}"
echo "[build] done in $(( $(date +%s) - start )) s"
