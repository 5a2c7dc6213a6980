#!/usr/bin/env bash
# The GPU machine's work (shared/GPU-MACHINE.md: one H100, torch 2.11 cu130 as python3, Open MPI,
# no network, no gflags/glog/GoogleTest/protobuf/nlohmann-json). It is reached through a tool that
# runs one command of at most 600 s, holds the machine about 30 minutes and starts it bare, so the
# work is split into device calls whose worst cases are known in advance:
#
#   bash cluster/gpu_session.sh fetch        # HERE, once (Debian with apt): the packages the GPU
#                                            # machine lacks, downloaded into .deps/ (git-ignored)
#   bash cluster/gpu_session.sh plan         # HERE: the device calls in order, each with its carry
#                                            # list and worst case; non-zero if they do not fit
#   OUT=$OUT bash cluster/gpu_session.sh test     # THERE, first (carry .deps): unpack, configure
#                                                 # (CUDA and NCCL forced ON, checked), build, GPU tests
#   OUT=$OUT bash cluster/gpu_session.sh bench1   # THERE, same machine: speed rows
#   OUT=$OUT bash cluster/gpu_session.sh bench2   # THERE, same machine: optimizer-offload rows
#   OUT=$OUT bash cluster/gpu_session.sh bench1 async_save copies   # only those steps of a stage
#   OUT=$OUT bash cluster/gpu_session.sh profile  # THERE, optional: kernel-level profiles of the
#                                                 # offload rows (not in the plan: a diagnosis)
#   bash cluster/gpu_session.sh check-configure LOG   # exit 0 if LOG says CUDA ON and NCCL ON, else 3
#
# The build lives in build-gpu/ (ignored by git's /build-*/), so a later call on the same warm
# machine finds it; a restarted machine starts bare and needs `test` again (ninja resumes an
# interrupted build there too). Every command a stage runs is bounded by `limit`, which takes its
# seconds from LIMIT below; `plan` adds up the same table, so the plan cannot drift from the run.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build-gpu"
DEPS="$BUILD/deps"
BIN="$BUILD/bin"
OUT="${OUT:-$ROOT/gpu-out}"
PACKAGES=(libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2 libunwind8 libunwind-dev
          libgtest-dev libgmock-dev googletest nlohmann-json3-dev libprotobuf-dev libprotobuf32
          libprotobuf-lite32 libprotoc32 protobuf-compiler zlib1g-dev)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=4)
# Only what the GPU tests and the benchmarks run: the unit and MPI test binaries would cost build
# time the session does not have (they run on the CPU machines anyway).
BUILD_TARGETS=(dtrain_gpu_tests train_gpt train_seq2seq dtrain-bench)

# ---- the time budget: data read by the stages (through `limit`) and by `plan` -------------------
CALL_LIMIT_S=600      # the device tool's limit per command
SESSION_LIMIT_S=1500  # 25 of the session's 30 device minutes; the rest is transfer slack
START_S=90            # machine start, paid once before the first call
KILL_GRACE_S=5        # SIGTERM at LIMIT-5 s, SIGKILL at LIMIT (a program may ignore TERM)
SEQUENCE=(test bench1 bench2)
# Never carry build-gpu (that would replace the built tree). The benches carry .deps and .gpu-build,
# the packed build that `test` leaves in $OUT: if the machine went back between calls, a bench
# unpacks both instead of failing (a few seconds, not a rebuild).
declare -A CARRY=([test]='[".deps"]' [bench1]='[".deps", ".gpu-build"]' [bench2]='[".deps", ".gpu-build"]')
declare -A STEPS=(
  [test]="gpuinfo unpack configure build ctest"
  [bench1]="s2s gpt124m nccl_allreduce mpi_allreduce cpu_adam copies offload_layers async_save shard"
  [bench2]="offload6b offload_opt offload_delayed pipeline"
  [profile]="profile_layers profile_offload profile_delayed"
)
declare -A LIMIT=(
  [gpuinfo]=10 [unpack]=15 [configure]=60 [build]=230 [ctest]=120
  [s2s]=100 [gpt124m]=45 [nccl_allreduce]=30 [mpi_allreduce]=45 [cpu_adam]=60 [copies]=25
  [offload_layers]=45 [async_save]=40 [shard]=115
  [offload6b]=280 [offload_opt]=70 [offload_delayed]=70 [pipeline]=50
  [profile_layers]=45 [profile_offload]=70 [profile_delayed]=70
)
# GPU_LIMIT_<step>=S overrides a limit (the plan sees the override too).
for _s in "${!LIMIT[@]}"; do
  _v="GPU_LIMIT_$_s"
  [[ -n ${!_v:-} ]] && LIMIT[$_s]=${!_v}
done

say() { echo "[gpu-session] $*"; }

stage_worst() {  # stage_worst STAGE: the sum of its steps' limits
  local s total=0
  for s in ${STEPS[$1]}; do total=$((total + LIMIT[$s])); done
  echo "$total"
}

check_limits() {
  local s
  for s in "${!LIMIT[@]}"; do
    if ! [[ ${LIMIT[$s]} =~ ^[0-9]+$ ]] || ((LIMIT[$s] <= KILL_GRACE_S)); then
      say "ERROR: limit of $s is '${LIMIT[$s]}': must be a number of seconds above $KILL_GRACE_S"
      return 1
    fi
  done
}

plan() {
  local bad=0 total=$START_S stage worst i=0 s parts
  check_limits || return 1
  echo "here, once: bash cluster/gpu_session.sh fetch   (downloads .deps/, no device time)"
  echo "machine start: $START_S s"
  for stage in "${SEQUENCE[@]}"; do
    i=$((i + 1))
    worst=$(stage_worst "$stage")
    parts=""
    for s in ${STEPS[$stage]}; do parts+="${parts:+ + }$s ${LIMIT[$s]}"; done
    printf 'call %d: OUT=$OUT bash cluster/gpu_session.sh %s | carry %s | worst %d s (%s)\n' \
      "$i" "$stage" "${CARRY[$stage]}" "$worst" "$parts"
    if ((worst > CALL_LIMIT_S)); then
      echo "  ERROR: worst case $worst s is over the $CALL_LIMIT_S s a device command may run"
      bad=1
    fi
    total=$((total + worst))
  done
  echo "total: $total s worst case, machine start included (limit $SESSION_LIMIT_S s)"
  if ((total > SESSION_LIMIT_S)); then
    echo "ERROR: the sequence's worst case $total s is over $SESSION_LIMIT_S s"
    bad=1
  fi
  return $bad
}

# ---- running a stage's steps -------------------------------------------------------------------
CURRENT_STEP=""
STEP_LIMITED=0
# limit CMD...: runs CMD for at most LIMIT[CURRENT_STEP] s, its whole process group killed after
# (timeout signals the group: mpirun's ranks, ninja's compilers). One bounded command per step, so
# a stage's worst case is exactly the sum that `plan` prints.
limit() {
  local s=${LIMIT[$CURRENT_STEP]:-}
  if [[ -z $s ]]; then say "INTERNAL: step '$CURRENT_STEP' has no limit"; return 70; fi
  if ((STEP_LIMITED)); then say "INTERNAL: step '$CURRENT_STEP' runs a second bounded command"; return 70; fi
  STEP_LIMITED=1
  timeout -k "$KILL_GRACE_S" "$((s - KILL_GRACE_S))" "$@"
}

describe_rc() {  # describe_rc RC: a short reason for the summaries
  case $1 in
    0) echo "ok" ;;
    124) echo "timed out after ${LIMIT[$CURRENT_STEP]} s (exit 124)" ;;
    137) echo "killed (exit 137: SIGKILL at the ${LIMIT[$CURRENT_STEP]} s limit, or out of memory)" ;;
    *) echo "exit $1" ;;
  esac
}

# run_steps STAGE STOP_ON_FAILURE: step_<name> for each step of STAGE in order. Sets FAILED.
FAILED=()
run_steps() {
  local stage=$1 stop=$2 step rc t0
  for step in ${STEPS[$stage]}; do
    CURRENT_STEP=$step
    STEP_LIMITED=0
    t0=$SECONDS
    "step_$step"
    rc=$?
    say "$stage/$step: $(describe_rc $rc), $((SECONDS - t0)) s (limit ${LIMIT[$step]} s)"
    if ((rc != 0)); then
      FAILED+=("$step($(describe_rc $rc))")
      ((stop)) && return "$rc"
    fi
  done
  return 0
}

environment() {
  # libgomp's idle threads spin between parallel regions by default: in a GPU step they take
  # the cores autograd's device thread and the copy threads need (--offload=layers: 187 -> 129
  # ms per step with PASSIVE, docs/BENCHMARKS.md). The same default as cluster/slurm/*.sbatch;
  # OMP_WAIT_POLICY= (set, empty) measures libgomp's own default instead.
  if [[ -z ${OMP_WAIT_POLICY+set} ]]; then
    export OMP_WAIT_POLICY=PASSIVE
  elif [[ -z $OMP_WAIT_POLICY ]]; then
    unset OMP_WAIT_POLICY
  fi
  # $BUILD/lib first: a restored build's RUNPATH names the build machine's checkout path.
  export LD_LIBRARY_PATH="$BUILD/lib:$DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  local torch_lib
  torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
  [[ -n $torch_lib ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$torch_lib"
  export PATH="$DEPS/usr/bin:$PATH"
  # CMake finds the CUDA toolkit through nvcc; a non-login shell may not have it on PATH.
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="$PATH:/usr/local/cuda/bin"
  fi
}

# ---- check-configure ---------------------------------------------------------------------------
# A configure that misses the CUDA toolkit (or finds a CPU-only torch, or no NCCL wheel) still
# succeeds and builds a tree whose GPU tests all skip: a wasted session. CMakeLists.txt prints the
# effective values; anything but ON for both is refused.
check_configure() {
  local log=$1 line cuda nccl
  if [[ ! -r $log ]]; then
    echo "check-configure: cannot read '$log'" >&2
    return 3
  fi
  line=$(grep -E 'dtrain: CUDA code paths [^ ,]+, NCCL backend [^ ,]+' "$log" | tail -1)
  if [[ -z $line ]]; then
    echo "check-configure: '$log' has no 'dtrain: CUDA code paths ..., NCCL backend ...' line: configure" \
      "stopped before the summary (see the errors above it) or this is not a dtrain configure log." \
      "Fix the first CMake error, then configure again with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON." >&2
    return 3
  fi
  cuda=$(sed -E 's/.*CUDA code paths ([^ ,]+),.*/\1/' <<<"$line")
  nccl=$(sed -E 's/.*NCCL backend ([^ ,]+).*/\1/' <<<"$line")
  if [[ $cuda != ON ]]; then
    echo "check-configure: CUDA code paths are $cuda ($line): CMake found no CUDA toolkit, or the torch of" \
      "DTRAIN_PYTHON has no CUDA (no lib/libtorch_cuda.so); the build would compile no GPU code and every" \
      "GPU test would skip. Fix: put nvcc on PATH (export PATH=/usr/local/cuda/bin:\$PATH) or pass" \
      "-DCUDAToolkit_ROOT=/usr/local/cuda, use a CUDA torch (python3 -c 'import torch;print(torch.version.cuda)')," \
      "and configure with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON." >&2
    return 3
  fi
  if [[ $nccl != ON ]]; then
    echo "check-configure: NCCL backend is $nccl ($line): the nvidia-nccl wheel next to torch was not" \
      "found (see the 'DTRAIN_WITH_NCCL=ON but' warning above it) or NCCL was switched off. Fix: make" \
      "python3 -c 'import nvidia.nccl' work for DTRAIN_PYTHON and configure with -DDTRAIN_WITH_NCCL=ON." >&2
    return 3
  fi
  echo "check-configure: $line"
  return 0
}

# ---- test: the first device call ---------------------------------------------------------------
step_gpuinfo() {
  mkdir -p "$BUILD"
  # No GPU visible: stop before spending minutes on a build whose tests would all skip.
  limit nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$BUILD/gpu-info.txt" 2>&1
  local rc=$?
  cat "$BUILD/gpu-info.txt"
  ((rc == 0)) || say "ERROR: nvidia-smi failed: no GPU visible"
  return $rc
}

step_unpack() {
  [[ -d $DEPS/usr ]] && return 0  # unpacked by an earlier call on this machine
  if ! ls .deps/*.deb >/dev/null 2>&1; then
    say "ERROR: no .deps/*.deb: run 'bash cluster/gpu_session.sh fetch' here and carry [\".deps\"]"
    return 1
  fi
  mkdir -p "$DEPS.tmp"
  limit bash -c 'for f in .deps/*.deb; do dpkg -x "$f" "$1" || exit 1; done' _ "$DEPS.tmp" || return 1
  mv "$DEPS.tmp" "$DEPS"  # only a complete unpack counts as done
}

step_configure() {
  # Always (re)configure: quick on an existing tree, and it prints the summary line to check.
  limit cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON -DDTRAIN_PYTHON="$(command -v python3)" \
    -DCMAKE_PREFIX_PATH="$DEPS/usr" -DCMAKE_MODULE_PATH="$DEPS/usr/share/glog/cmake" \
    -DProtobuf_PROTOC_EXECUTABLE="$DEPS/usr/bin/protoc" >"$OUT/configure.log" 2>&1
  local rc=$?
  if ((rc != 0)); then
    say "ERROR: configure failed ($(describe_rc $rc)); the end of $OUT/configure.log:"
    tail -25 "$OUT/configure.log"
    return 1
  fi
  check_configure "$OUT/configure.log"
}

step_build() {
  limit cmake --build "$BUILD" -j "$(nproc)" --target "${BUILD_TARGETS[@]}" >"$BUILD/build.log" 2>&1
  local rc=$?
  tail -200 "$BUILD/build.log" >"$OUT/build-tail.log"
  if ((rc == 0)); then
    # The built programs and libraries, for a bench call that lands on a restarted machine:
    # fetched from $OUT into .gpu-build/ here and carried (see CARRY).
    tar -C "$BUILD" -czf "$OUT/build-gpu.tgz" bin lib gpu-info.txt &&
      say "packed the build: $OUT/build-gpu.tgz ($(du -h "$OUT/build-gpu.tgz" | cut -f1)); keep it in .gpu-build/"
  fi
  if ((rc != 0)); then
    say "ERROR: build $(describe_rc $rc) (a timed-out build resumes when 'test' runs again on this machine):"
    grep -E "error|FAILED" "$BUILD/build.log" | head -20
  fi
  return $rc
}

step_ctest() {
  mkdir -p "$OUT/gtest"
  { cat "$BUILD/gpu-info.txt"; echo; } >"$OUT/ctest.log"
  # Each gtest run writes its XML there (cases, failures, skips): np1, then the two MPI ranks.
  GTEST_OUTPUT="xml:$OUT/gtest/" limit ctest --test-dir "$BUILD" -L gpu --output-on-failure >>"$OUT/ctest.log" 2>&1
  local rc=$?
  cp "$BUILD/Testing/Temporary/LastTest.log" "$OUT/LastTest.log" 2>/dev/null
  tail -6 "$OUT/ctest.log"
  return $rc
}

# gtest_counts: "CASES SKIPPED FAILURES" from the XML of the one-process run (gpu.np1; the MPI
# ranks' files get a _1, _2 suffix).
gtest_counts() {
  local xml="$OUT/gtest/dtrain_gpu_tests.xml"
  [[ -r $xml ]] || { echo "0 0 0"; return; }
  echo "$(grep -c '<testcase ' "$xml") $(grep -c 'result="skipped"' "$xml") $(grep -c '<failure' "$xml")"
}

stage_test() {
  mkdir -p "$OUT"
  environment
  local t0=$SECONDS rc cases skipped failures verdict
  run_steps test 1
  rc=$?
  read -r cases skipped failures < <(gtest_counts)
  if ((rc == 0 && cases > 0 && skipped == cases)); then
    say "ERROR: all $cases GPU test cases skipped: the tests saw no CUDA device"
    rc=4
  fi
  if ((rc == 0)); then verdict=PASS; else verdict="FAIL (${FAILED[*]:-exit $rc})"; fi
  say "test: $verdict; $(head -1 "$BUILD/gpu-info.txt" 2>/dev/null); gtest cases (np1): $cases," \
    "$skipped skipped, $failures failures; $((SECONDS - t0)) s of worst $(stage_worst test) s" | tee -a "$OUT/ctest.log"
  return $rc
}

# ---- benchmarks --------------------------------------------------------------------------------
# measure TITLE PATTERN CMD...: a section of the summary with the lines of CMD's output matching
# PATTERN; the whole output goes to the raw log. SHOW, when set, replaces the command shown.
SUMMARY=""
RAW=""
measure() {
  local title=$1 pattern=$2 tmp rc
  shift 2
  tmp="$BUILD/step.out"
  { echo; echo "## $title"; echo; echo "\`${SHOW:-${*#"$BIN/"}}\`"; echo; } >>"$SUMMARY"
  limit "$@" >"$tmp" 2>&1
  rc=$?
  { echo "===== $CURRENT_STEP: $*"; cat "$tmp"; echo "===== exit $rc"; } >>"$RAW"
  grep -E -- "$pattern" "$tmp" >>"$SUMMARY"
  ((rc == 0)) || echo "**$CURRENT_STEP: $(describe_rc $rc)**" >>"$SUMMARY"
  return $rc
}

step_s2s() {
  measure "s2s seed model, rows s2s fp32 .. eval (tools/techniques.sh --device=cuda)" '^\|' \
    env DTRAIN_BIN="$BIN" bash tools/techniques.sh --device=cuda --steps=20 --log_every=10
}
step_gpt124m() {
  measure "gpt124m AMP bf16" 'trained|MFU' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --steps=30 --log_every=10 --progress=false
}
step_nccl_allreduce() {
  measure "NCCL all-reduce, world size 1 (busbw GB/s, 64 to 256 MiB)" '"bench"' \
    "$BIN/dtrain-bench" allreduce --backend=nccl --device=cuda --min_bytes=67108864
}
step_mpi_allreduce() {
  measure "MPI all-reduce, 2 ranks sharing the GPU through host staging (64 to 256 MiB)" '"bench"' \
    "${MPIRUN[@]}" -np 2 "$BIN/dtrain-bench" allreduce --backend=mpi --device=cuda --min_bytes=67108864
}
step_cpu_adam() {
  measure "CPU Adam, 100M parameters, 16 threads (PyTorch: fused 20 ms, foreach 109 ms)" '"bench"' \
    "$BIN/dtrain-bench" cpu_adam --threads=16 --impls=dtrain,torch_fused,torch_foreach
}
step_copies() {
  # No dtrain program times bare copies; this is the ceiling the offload paths copy against,
  # measured with torch on this machine (1 GiB, pinned host memory, non-blocking copy_).
  SHOW="python3 -c <pinned copy probe of cluster/gpu_session.sh>" \
    measure "pinned copies (torch probe: the ceiling for the offload rows)" 'GB/s' python3 -c '
import time, torch
n = 1 << 30
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
def gbs(dst, src, reps=10):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return reps * n / (time.perf_counter() - t) / 1e9
print(f"pinned H2D {gbs(d, h):.1f} GB/s, D2H {gbs(h, d):.1f} GB/s")'
}
step_offload_layers() {
  measure "layer offload, gpt124m (--offload=layers)" 'trained|MFU|offload' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=layers --steps=10 --log_every=5 \
    --progress=false
}
step_async_save() {
  measure "checkpoint save: the step that saves vs an ordinary one, background vs synchronous" '"bench"' \
    python3 tools/async_save_bench.py "$BIN" --device=cuda
}
# ZeRO-1/2/3 on the device: gpt124m on 2 ranks sharing the GPU (gradients and ZeRO-3's gathers
# through MPI with host staging, so the step time is the staging's; the memory per rank is the
# figure): the memory report after step 4 of each stage, rank 0; ZeRO-3 also with the optimizer
# offloaded (its device figure against stage 3's, its host figure).
step_shard() {
  SHOW="mpirun -np 2 train_gpt --device=cuda --data=synthetic --amp=bf16 --shard=none|optimizer|gradients|parameters (also offloaded)" \
    measure "ZeRO-1/2/3 on the device, gpt124m, 2 ranks on the one GPU (memory per rank)" \
    'shard=|trained|memory on|parameters +|gradients +|optimizer state|peak|other \(' bash -c '
for s in none optimizer gradients parameters "parameters --offload=optimizer"; do
  echo "shard=$s"
  "${@:2}" "$1" --device=cuda --data=synthetic --amp=bf16 --steps=5 --log_every=1 --progress=false \
    --memory_report_step=4 --shard=$s || exit 1
done' _ "$BIN/train_gpt" "${MPIRUN[@]}" -np 2
}
# Issue 5's goal: a GPT whose optimizer state does not fit the GPU (6.3B parameters: 100 GB of
# fp32 weights, gradients and Adam moments) trains with the optimizer state in host memory.
step_offload6b() {
  measure "optimizer offload, largest GPT: 6.3B parameters (goal: >= 30% of peak)" \
    'parameters|trained|MFU|step [0-9]+/' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=optimizer --checkpoint_activations \
    --d_model=4096 --heads=32 --layers=30 --ff=16384 --batch_size=2 --steps=4 --log_every=1 --progress=false \
    --memory_report_step=2
}
GPT13B=(--device=cuda --data=synthetic --amp=bf16 --offload=optimizer --d_model=2048 --heads=16 --layers=24
        --ff=8192 --batch_size=4 --steps=8 --log_every=4 --progress=false)
step_offload_opt() {
  measure "optimizer offload, GPT 1.3B shape (the baseline of the delayed update)" 'trained|MFU|offload' \
    "$BIN/train_gpt" "${GPT13B[@]}"
}
step_offload_delayed() {
  measure "optimizer offload, delayed update (CPU step hidden behind the next forward/backward)" \
    'trained|MFU|offload' "$BIN/train_gpt" "${GPT13B[@]}" --offload_delayed_update_after=2
}
# Pipeline stages on the device: gpt124m split into 2 stages on 2 ranks sharing the GPU (the
# activations through MPI with host staging, so the step time is the staging's; the memory per
# stage and the bubble are the figures), 1F1B with 4 micro-batches, and each stage's idle share
# of a step from the timeline against (P-1)/(m+P-1).
step_pipeline() {
  SHOW="mpirun -np 2 train_gpt --device=cuda --data=synthetic --amp=bf16 --pp=2 --accum_steps=4 --timeline=..." \
    measure "pipeline stages on the device, gpt124m, 2 stages on the one GPU (memory per stage, bubble)" \
    'trained|peak|stage [0-9] \(rank' bash -c '
"${@:3}" "$1" --device=cuda --data=synthetic --amp=bf16 --pp=2 --accum_steps=4 --steps=6 --log_every=3 \
  --progress=false --memory_report_step=4 --timeline="$2/pp-timeline.json" || exit 1
"$(dirname "$1")/dtrain-timeline" summary "$2/pp-timeline.json"' _ "$BIN/train_gpt" "$BUILD" "${MPIRUN[@]}" -np 2
}

# Profiles (--profile_steps: Kineto traces with every kernel and copy) of the rows that miss their
# goals, each summarized by tools/profile_summary.py into $OUT/summary-profile.md; the gzipped
# traces go into $OUT/profiles.tgz.
profile_run() {  # profile_run NAME TITLE TRAIN_GPT_ARGS...: the run, then its trace's summary
  local name=$1 title=$2 trace="$BUILD/profiles/$1.json"
  shift 2
  SHOW="train_gpt $* --profile_out=$name.json; tools/profile_summary.py $name.json" \
    measure "$title" '.' bash -c '"${@:2}" && python3 tools/profile_summary.py "$1"' _ "$trace" \
    "$BIN/train_gpt" "$@" --profile_out="$trace" --timeline="$BUILD/profiles/$name-timeline.json"
}
step_profile_layers() {
  profile_run layers "layer offload, gpt124m, steps 4-5" --device=cuda --data=synthetic --amp=bf16 \
    --offload=layers --steps=5 --log_every=5 --progress=false --profile_steps=4-5
}
step_profile_offload() {
  profile_run offload "optimizer offload, 1.3B shape, steps 4-5" "${GPT13B[@]/--steps=8/--steps=5}" \
    --profile_steps=4-5
}
step_profile_delayed() {
  profile_run delayed "optimizer offload, delayed update, steps 4-5" "${GPT13B[@]/--steps=8/--steps=5}" \
    --offload_delayed_update_after=2 --profile_steps=4-5
}

stage_profile() {
  local t0=$SECONDS
  mkdir -p "$OUT" "$BUILD/profiles"
  if [[ ! -x $BIN/train_gpt ]]; then
    say "ERROR: no build in $BUILD: run 'test' first on this machine"
    return 1
  fi
  environment
  SUMMARY="$OUT/summary-profile.md"
  RAW="$BUILD/profiles/profile.log"
  : >"$RAW"
  run_steps profile 0
  gzip -f "$BUILD"/profiles/*.json
  tar -C "$BUILD/profiles" -czf "$OUT/profiles.tgz" . 2>/dev/null
  say "profile: ${#FAILED[@]} failed${FAILED:+ (${FAILED[*]})}; $((SECONDS - t0)) s; summaries in $SUMMARY"
  ((${#FAILED[@]} == 0))
}

stage_bench() {  # stage_bench N: bench<N>, rows into $OUT/summary-N.md, whole output in bench-N.log
  local n=$1 stage="bench$1" t0=$SECONDS
  mkdir -p "$OUT"
  if [[ ! -x $BIN/train_gpt || ! -d $DEPS/usr ]]; then
    # A restarted machine: unpack the carried build and packages rather than build again.
    if [[ -r .gpu-build/build-gpu.tgz ]] && ls .deps/*.deb >/dev/null 2>&1; then
      say "no build in $BUILD (a restarted machine): unpacking .gpu-build/build-gpu.tgz and .deps"
      mkdir -p "$BUILD" "$DEPS.tmp" && tar -C "$BUILD" -xzf .gpu-build/build-gpu.tgz &&
        for f in .deps/*.deb; do dpkg -x "$f" "$DEPS.tmp" || return 1; done && mv "$DEPS.tmp" "$DEPS" || return 1
    else
      say "ERROR: no build in $BUILD and no .gpu-build/build-gpu.tgz carried: run 'test' first"
      return 1
    fi
  fi
  environment
  SUMMARY="$OUT/summary-$n.md"
  RAW="$OUT/bench-$n.log"
  {
    echo "# GPU session $stage, $(date -u '+%F %H:%M') UTC, commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    cat "$BUILD/gpu-info.txt" 2>/dev/null
  } >>"$SUMMARY"
  : >"$RAW"
  run_steps "$stage" 0
  local steps
  read -ra steps <<<"${STEPS[$stage]}"
  say "$stage: $((${#steps[@]} - ${#FAILED[@]})) of ${#steps[@]} steps ok${FAILED:+, failed: ${FAILED[*]}};" \
    "$((SECONDS - t0)) s of worst $(stage_worst "$stage") s; rows in $SUMMARY"
  ((${#FAILED[@]} == 0))
}

fetch() {
  mkdir -p "$ROOT/.deps"
  (cd "$ROOT/.deps" && apt-get download "${PACKAGES[@]}") || {
    say "ERROR: apt-get download failed (run 'apt-get update' first?)"
    exit 1
  }
  say "downloaded $(ls "$ROOT"/.deps/*.deb | wc -l) packages into .deps/ ($(du -sh "$ROOT/.deps" | cut -f1))"
}

case "${1:-}" in
  fetch) fetch ;;
  plan) plan ;;
  check-configure)
    [[ $# -eq 2 ]] || { echo "usage: gpu_session.sh check-configure CONFIGURE_LOG" >&2; exit 2; }
    check_configure "$2"
    ;;
  test) check_limits && cd "$ROOT" && stage_test ;;
  bench1 | bench2 | profile)
    # Extra arguments: only those steps of the stage, in the stage's order.
    if (($# > 1)); then
      only=" ${*:2} " kept=""
      for s in ${STEPS[$1]}; do [[ $only == *" $s "* ]] && kept+="${kept:+ }$s"; done
      for s in "${@:2}"; do
        [[ " ${STEPS[$1]} " == *" $s "* ]] || { echo "gpu_session.sh: $1 has no step '$s' (steps: ${STEPS[$1]})" >&2; exit 2; }
      done
      STEPS[$1]=$kept
    fi
    check_limits && cd "$ROOT" || exit 1
    case $1 in
      bench1) stage_bench 1 ;;
      bench2) stage_bench 2 ;;
      profile) stage_profile ;;
    esac
    ;;
  *) echo "usage: gpu_session.sh fetch|plan|test|bench1|bench2|profile|check-configure LOG" >&2; exit 2 ;;
esac
