#!/usr/bin/env bash
# Installs what is missing, builds, and trains the default example (an MLP on scikit-learn's
# handwritten digits) on 2 data-parallel ranks through dtrain-run, printing its loss curve.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash cluster/setup.sh
bash cluster/build.sh
echo "[quickstart] training train_mlp on 2 ranks (CPU): dtrain-run -np 2 -- train_mlp"
build/bin/dtrain-run -np 2 --oversubscribe --env OMP_NUM_THREADS=1 -- \
  build/bin/train_mlp --device=cpu --steps=150 --batch_size=32 --lr=0.003 --log_every=25 \
  --eval_every=75 --workers=1 --metrics=build/quickstart_metrics.jsonl
echo "[quickstart] metrics written to build/quickstart_metrics.jsonl"
