#!/usr/bin/env bash
# The GPU machine's work in one script (shared/GPU-MACHINE.md: one H100, torch 2.11 in
# /opt/torch/.venv, Open MPI, no network, no gflags/glog/GoogleTest/protobuf/nlohmann-json).
#
#   bash cluster/gpu_session.sh fetch     # HERE, on a Debian machine with apt: downloads the
#                                         # packages the GPU machine lacks into .deps/ (ignored
#                                         # by git; carry it to the GPU machine)
#   bash cluster/gpu_session.sh all       # THERE: build, GPU tests, benchmarks
#   bash cluster/gpu_session.sh build|test|bench   # one stage (build first)
#   bash cluster/gpu_session.sh offload6b          # a 6.3B-parameter GPT with --offload=optimizer
#
# Output: logs and summary.md (the rows for docs/BENCHMARKS.md) in $OUT (default ./gpu-out).
# Build directory: $GPU_BUILD (default /tmp/dtrain-gpu-build). Each stage has a time limit so a
# hang cannot eat the machine's lease; a failing stage is reported and the next one still runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-out}"
BUILD="${GPU_BUILD:-/tmp/dtrain-gpu-build}"
DEPS=/tmp/dtrain-deps
PACKAGES=(libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2 libunwind8 libunwind-dev
          libgtest-dev libgmock-dev googletest nlohmann-json3-dev libprotobuf-dev libprotobuf32
          libprotobuf-lite32 libprotoc32 protobuf-compiler zlib1g-dev)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=4)

say() { echo "[gpu-session] $*"; }

fetch() {
  mkdir -p .deps
  (cd .deps && apt-get download "${PACKAGES[@]}") || {
    say "ERROR: apt-get download failed (run 'apt-get update' first?)"
    exit 1
  }
  say "downloaded $(ls .deps/*.deb | wc -l) packages into .deps/ ($(du -sh .deps | cut -f1))"
}

environment() {
  if [[ ! -d $DEPS/usr ]]; then
    ls .deps/*.deb >/dev/null 2>&1 || { say "ERROR: no .deps/*.deb: run 'gpu_session.sh fetch' on the dev machine and carry .deps"; exit 1; }
    mkdir -p "$DEPS"
    for f in .deps/*.deb; do dpkg -x "$f" "$DEPS"; done
  fi
  export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  export PATH="$DEPS/usr/bin:$PATH"
}

build() {
  environment
  local python
  python="${GPU_PYTHON:-$(command -v python3)}"  # /opt/torch/.venv there
  local t0=$SECONDS
  if [[ ! -f $BUILD/build.ninja ]]; then
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_PYTHON="$python" \
      -DCMAKE_PREFIX_PATH="$DEPS/usr" -DCMAKE_MODULE_PATH="$DEPS/usr/share/glog/cmake" \
      -DProtobuf_PROTOC_EXECUTABLE="$DEPS/usr/bin/protoc" >"$OUT/configure.log" 2>&1 ||
      { say "ERROR: configure failed"; tail -30 "$OUT/configure.log"; return 1; }
  fi
  timeout 540 cmake --build "$BUILD" -j "$(nproc)" >"$OUT/build.log" 2>&1 ||
    { say "ERROR: build failed"; grep -E "error|Error" "$OUT/build.log" | head -30; return 1; }
  say "built in $((SECONDS - t0)) s"
}

run_tests() {
  environment
  # Each gtest binary also writes its XML report there (failures and skips per case).
  (cd "$BUILD" && GTEST_OUTPUT="xml:$OUT/gtest/" timeout 400 ctest -L gpu --output-on-failure >"$OUT/gpu-tests.log" 2>&1)
  local rc=$?
  tail -5 "$OUT/gpu-tests.log"
  say "GPU tests: exit $rc"
  # The CPU suites too, quickly: the same code on a 16-core machine.
  (cd "$BUILD" && timeout 300 ctest -L unit -j4 >"$OUT/unit-tests.log" 2>&1)
  say "unit tests: exit $? ($(tail -1 "$OUT/unit-tests.log"))"
  return $rc
}

bench() {
  environment
  local bin="$BUILD/bin" s="$OUT/summary.md"
  {
    echo "# GPU session $(date -u +%F) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    echo
    echo "## s2s seed model (tools/techniques.sh --device=cuda --steps=30)"
    DTRAIN_BIN="$bin" timeout 300 bash tools/techniques.sh --device=cuda --steps=30 --log_every=10 2>&1
    echo
    echo "## gpt124m AMP bf16 (train_gpt --data=synthetic --amp=bf16 --steps=30)"
    timeout 180 "$bin/train_gpt" --device=cuda --data=synthetic --amp=bf16 --steps=30 --log_every=10 \
      --progress=false 2>&1 | grep -E "trained|MFU"
    echo
    echo "## all-reduce: NCCL at world size 1, MPI with 2 ranks sharing the GPU (busbw GB/s at 64 and 256 MiB)"
    timeout 120 "$bin/dtrain-bench" allreduce --backend=nccl --device=cuda --min_bytes=67108864 2>/dev/null | grep '"bench"'
    timeout 180 "${MPIRUN[@]}" -np 2 "$bin/dtrain-bench" allreduce --backend=mpi --device=cuda \
      --min_bytes=67108864 2>/dev/null | grep '"bench"'
    echo
    echo "## CPU Adam, 100M parameters, 16 threads (PyTorch: fused 20 ms, foreach 109 ms)"
    timeout 240 "$bin/dtrain-bench" cpu_adam --threads=16 --impls=dtrain,torch_fused,torch_foreach 2>/dev/null | grep '"bench"'
    echo
    echo "## offload: optimizer (gpt 1.3B shape) and layers (gpt124m)"
    timeout 240 "$bin/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=optimizer --d_model=2048 \
      --heads=16 --layers=24 --ff=8192 --batch_size=4 --steps=8 --log_every=4 --progress=false 2>&1 | grep -E "trained|MFU|offload"
    echo "## the same with the delayed update (CPU step hidden behind the next forward/backward)"
    timeout 240 "$bin/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=optimizer --d_model=2048 \
      --heads=16 --layers=24 --ff=8192 --batch_size=4 --steps=8 --log_every=4 --progress=false \
      --offload_delayed_update_after=2 2>&1 | grep -E "trained|MFU|offload"
    timeout 180 "$bin/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=layers --steps=10 \
      --log_every=5 --progress=false 2>&1 | grep -E "trained|MFU|offload"
    echo
    echo "## planner: estimate vs measured (dtrain-plan --verify_steps)"
    for flags in "" "--amp=bf16" "--checkpoint_activations" "--accum_steps=4"; do
      echo "### seq2seq $flags"
      timeout 120 "$bin/dtrain-plan" --model=seq2seq --device=cuda --verify_steps=3 $flags 2>&1 | tail -4
    done
  } >"$s" 2>&1
  say "benchmarks written to $s"
}

# Issue 5's goal: a GPT whose optimizer state does not fit the GPU (6.3B parameters: 100 GB
# of fp32 weights, gradients and Adam moments) trains with the optimizer state in host memory.
# Own stage (not in `all`): model set-up alone takes minutes.
offload_big() {
  environment
  timeout 560 "$BUILD/bin/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=optimizer \
    --checkpoint_activations --d_model=4096 --heads=32 --layers=30 --ff=16384 --batch_size=2 \
    --steps=4 --log_every=1 --progress=false --memory_report_step=2 >"$OUT/offload6b.log" 2>&1
  say "6B optimizer offload: exit $?"
  grep -E "parameters|trained|MFU|step [0-9]+/" "$OUT/offload6b.log" | tail -8
}

mkdir -p "$OUT"
case "${1:-}" in
  offload6b) offload_big ;;
  fetch) fetch ;;
  build) build ;;
  test) run_tests ;;
  bench) bench ;;
  all)
    build || exit 1
    run_tests
    bench
    ;;
  *) echo "usage: gpu_session.sh fetch|all|build|test|bench|offload6b" >&2; exit 2 ;;
esac
