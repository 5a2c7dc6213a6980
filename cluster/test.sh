#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (ctest labels unit, mpi,
# gpu, cluster). GPU tests skip visibly on machines without a GPU.
# Pass ctest arguments through, e.g. `bash cluster/test.sh -L unit`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash cluster/setup.sh
bash cluster/build.sh
cd build
start=$(date +%s)
ctest --output-on-failure --timeout 900 -j "${DTRAIN_TEST_JOBS:-2}" "$@"
echo "[test] ctest finished in $(( $(date +%s) - start )) s"
