#!/usr/bin/env bash
# Installs what is missing, builds, and runs the default example on 2 ranks, printing its
# result.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash cluster/setup.sh
bash cluster/build.sh
echo "[quickstart] 2-rank all-reduce over MPI (dtrain-bench allreduce)"
build/bin/dtrain-run -np 2 --oversubscribe -- build/bin/dtrain-bench allreduce \
  --min_bytes=1048576 --max_bytes=16777216
