#!/usr/bin/env bash
# The GPU machine's session (shared/GPU-MACHINE.md: one H100, torch 2.11 cu130 as python3, Open MPI,
# no network, no gflags/glog/GoogleTest/protobuf/nlohmann-json). The machine is lent for 15 minutes
# of machine time in all: its start (about 90 s), every command, idle time and transfers count; one
# command runs at most 600 s; it goes back 30 s after a command, so a second command usually starts
# a bare machine; at most 8 files (16 MiB each) come back from $OUT. So the session is ONE prepared
# command with one deadline, and an optional short second one:
#
# HERE (no device time):
#   bash cluster/gpu_session.sh fetch          # once (Debian with apt): the packages the GPU machine
#                                              # lacks, into .deps/ (git-ignored)
#   bash cluster/gpu_session.sh pack [--jobs=N]  # optional: builds the GPU targets here (CUDA and
#                                              # NCCL ON, .venv's torch) into .gpu-build/prebuilt.tgz,
#                                              # refused if the carried total would pass 64 MiB
#   bash cluster/gpu_session.sh plan           # the command(s), carry list, worst cases against the
#                                              # 570 s per command and 900 s per session; non-zero
#                                              # if they do not fit
#   bash cluster/gpu_session.sh order          # the benchmark steps in the order the next run takes
#   bash cluster/gpu_session.sh record DIR     # after a session, DIR = the fetched $OUT: the steps
#                                              # that succeeded go into docs/gpu/measured.tsv
# THERE (the device tool's run, carry [".deps", ".gpu-build"]):
#   OUT=$OUT bash cluster/gpu_session.sh run [--only=S1,S2]  # the session: gpuinfo, unpack, prebuilt
#                                              # check or configure+build, GPU tests at 1 process and
#                                              # 2 MPI ranks, then benchmark steps by priority
#   OUT=$OUT bash cluster/gpu_session.sh rest [STEP...]      # optional second command: the steps
#                                              # the first one skipped (its summary prints the line)
#   OUT=$OUT bash cluster/gpu_session.sh profile             # optional diagnosis: kernel-level
#                                              # profiles of the offload rows (not in the plan)
# ANYWHERE:
#   bash cluster/gpu_session.sh check-configure LOG   # exit 0 if LOG says CUDA ON and NCCL ON, else 3
#   bash cluster/gpu_session.sh steps                 # the step table (name, kind, limit, minimum)
#
# Contracts of run/rest/profile (tests/cluster_scripts/gpu_session_kill.sh checks them by killing
# a faked run at random points):
#  * One deadline for the command (DEADLINE_S from its start). Each step gets the lesser of its
#    LIMIT and the time left (less RESERVE_S kept for the last summary); a step that cannot get its
#    MIN is SKIPPED, with the reason in the summary, and the next step is tried.
#  * Each step is ONE bounded command (`timeout` signals its whole process group: mpirun's ranks,
#    ninja's compilers) whose stdout and stderr go straight into $OUT/session.log, line-buffered
#    (stdbuf -oL, PYTHONUNBUFFERED): a command cut off at any moment leaves its output there.
#  * $OUT holds at most: summary.md, results.tsv, session.log, files.tgz (gtest XMLs, timelines,
#    profiles), prebuilt.tgz (the build, for a second command), and one *.tmp while one of them is
#    replaced (written beside it, then renamed). At most 6 files, under the tool's 8.
#  * summary.md and results.tsv are rewritten (tmp + rename) before each step (it shows as
#    "running") and after it; a step shows as finished only once its output is in session.log and
#    its files in files.tgz. SIGTERM/INT/HUP stop the running step and write the summary.
#
# GPU_SESSION_FAKE=1 replaces each step's command by a short fake (cluster_scripts tests; see
# fake_step): the scheduling, deadline, output, summary and packing code is the real one.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/cluster/$(basename "${BASH_SOURCE[0]}")"
BUILD="${GPU_SESSION_BUILD:-$ROOT/build-gpu}"   # the device's build and scratch space (git-ignored)
DEPS="$BUILD/deps"
BIN="$BUILD/bin"                                # becomes $BUILD/prebuilt/bin when a prebuilt archive is used
OUT="${OUT:-$ROOT/gpu-out}"
RECORD="${GPU_SESSION_RECORD:-$ROOT/docs/gpu/measured.tsv}"
PREBUILT="${GPU_SESSION_PREBUILT:-$ROOT/.gpu-build/prebuilt.tgz}"
PACK_BUILD="${GPU_SESSION_PACK_BUILD:-$ROOT/build-gpu-pack}"
FAKE="${GPU_SESSION_FAKE:-0}"
PACKAGES=(libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2 libunwind8 libunwind-dev
          libgtest-dev libgmock-dev googletest nlohmann-json3-dev libprotobuf-dev libprotobuf32
          libprotobuf-lite32 libprotoc32 protobuf-compiler zlib1g-dev)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=4)
# The environment and mpirun ctest gives the GPU tests (tests/CMakeLists.txt: DTRAIN_TEST_ENV,
# DTRAIN_MPIRUN).
TEST_ENV=(OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1 GLOG_minloglevel=1)
# shellcheck disable=SC2054  # the commas are mpirun's
TEST_MPIRUN=(mpirun --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader,tcp
             --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS=1)
# Only what the GPU tests and the benchmarks run: the unit and MPI test binaries would cost build
# time the session does not have (they run on the CPU machines). dtrain-timeline: the pipeline step.
BUILD_TARGETS=(dtrain_gpu_tests train_gpt train_seq2seq dtrain-bench dtrain-timeline)
# The sources a build depends on (the prebuilt archive records their hash; a stale one is refused).
SOURCE_DIRS=(CMakeLists.txt cmake dist engine offload examples tools tests launcher)

# ---- the time budget: read by the session (through run_one) and by `plan` --------------------
CALL_LIMIT_S=600                            # the device tool's limit per command
COMMAND_MAX_S=570                           # what the plan allows one command (30 s to spare)
SESSION_S=900                               # the session's device time, all of it
START_S=90                                  # a machine's start, paid by each command on a bare one
DEADLINE_S="${GPU_SESSION_DEADLINE_S:-570}" # run and profile: the whole command
SECOND_S="${GPU_SESSION_SECOND_S:-120}"     # rest: the optional second command
RESERVE_S="${GPU_SESSION_RESERVE_S:-5}"     # kept at the end for the last summary and pack
KILL_GRACE_S="${GPU_SESSION_GRACE_S:-5}"    # SIGTERM this long before a step's budget ends, SIGKILL at it
OUT_FILES_MAX=8                             # files that come back from $OUT
OUT_FILE_BYTES_MAX=$((16 << 20))            # bytes per file that come back
CARRY_BYTES_MAX="${GPU_SESSION_CARRY_LIMIT:-$((64 << 20))}"  # the working tree that travels, carried paths included
CARRY='[".deps", ".gpu-build"]'

SETUP_STEPS=(gpuinfo unpack prebuilt configure build save_build)
TEST_STEPS=(test_np1 test_np2)
# Declaration order = the tie-break of the priority order (bench_order).
BENCH_STEPS=(s2s gpt124m nccl_allreduce mpi_allreduce cpu_adam copies offload_layers async_save shard shard3
             offload6b offload_opt offload_delayed pipeline)
PROFILE_STEPS=(profile_layers profile_offload profile_delayed)
# LIMIT: the most a step may take (s); MIN: below this it is not worth starting (SKIPPED).
# Measured on 2026-11-24 (16 cores): build 91-114 s, gpu.np1 19 s, gpu.mpi.np2 21 s, bench1 (s2s ..
# shard) 119-134 s, bench2 252-265 s (offload6b about 200 s of it).
declare -A LIMIT=(
  [gpuinfo]=10 [unpack]=20 [prebuilt]=30 [configure]=60 [build]=240 [save_build]=20
  [test_np1]=60 [test_np2]=75
  [s2s]=100 [gpt124m]=45 [nccl_allreduce]=30 [mpi_allreduce]=45 [cpu_adam]=60 [copies]=25
  [offload_layers]=45 [async_save]=40 [shard]=75 [shard3]=70
  [offload6b]=280 [offload_opt]=70 [offload_delayed]=70 [pipeline]=50
  [profile_layers]=45 [profile_offload]=70 [profile_delayed]=70
)
declare -A MIN=(
  [gpuinfo]=5 [unpack]=10 [prebuilt]=15 [configure]=30 [build]=120 [save_build]=10
  [test_np1]=30 [test_np2]=35
  [s2s]=60 [gpt124m]=25 [nccl_allreduce]=15 [mpi_allreduce]=25 [cpu_adam]=30 [copies]=15
  [offload_layers]=25 [async_save]=25 [shard]=50 [shard3]=45
  [offload6b]=220 [offload_opt]=40 [offload_delayed]=40 [pipeline]=35
  [profile_layers]=30 [profile_offload]=45 [profile_delayed]=45
)
# GPU_LIMIT_<step>=S and GPU_MIN_<step>=S override them (the plan sees the overrides too).
for _s in "${!LIMIT[@]}"; do
  _v="GPU_LIMIT_$_s"; [[ -n ${!_v:-} ]] && LIMIT[$_s]=${!_v}
  _v="GPU_MIN_$_s"; [[ -n ${!_v:-} ]] && MIN[$_s]=${!_v}
done
unset _s _v

# What a benchmark's figure depends on, for "code changed since its last figure": the text of
# its step_ function (and of the helpers named in HASH_FUNCS) plus the files of these globs
# (relative to the root). The files whose change most likely moves the figure, not everything it
# links: with the whole engine every row would count as changed after any commit.
_gpt="examples/train_gpt.cc examples/gpt_model.*"
_cpu_opt="offload/src/cpu_*.cc offload/src/cpu_optimizer_impl.h offload/src/kernel*.cc offload/src/kernel*.h offload/src/update_rule.cc offload/src/thread_pool.cc"
_opt_offload="engine/optim/offload*.cc engine/optim/offload*.h offload/src/pinned_pool.cc $_cpu_opt $_gpt"
declare -A HASH_DEPS=(
  [s2s]="tools/techniques.sh examples/train_seq2seq.cc examples/seq2seq_model.* engine/optim/amp.cc engine/memory/activation_checkpoint.cc"
  [gpt124m]="$_gpt engine/optim/amp.cc"
  [nccl_allreduce]="dist/src/nccl_backend.cc dist/src/async.* tools/bench_allreduce.cc"
  [mpi_allreduce]="dist/src/mpi_backend.cc dist/src/mpi_runtime.* dist/src/async.* tools/bench_allreduce.cc"
  [cpu_adam]="$_cpu_opt tools/bench_cpu_adam.cc"
  [copies]=""
  [offload_layers]="offload/src/layer_offload.cc offload/src/pinned_pool.cc engine/optim/offload_streamer.cc engine/parallel/grad_norm.cc $_gpt"
  [async_save]="engine/state/*.cc engine/state/*.h tools/async_save_bench.py"
  [shard]="engine/optim/sharded_optimizer.cc engine/core/shard.cc engine/parallel/bucket_comm.cc engine/parallel/reducer.cc engine/memory/memory_report.cc $_gpt"
  [shard3]="engine/optim/parameter_units.cc engine/optim/sharded_optimizer.cc engine/optim/offloaded_optimizer.cc engine/core/shard.cc engine/memory/memory_report.cc $_gpt"
  [offload6b]="$_opt_offload"
  [offload_opt]="$_opt_offload"
  [offload_delayed]="$_opt_offload"
  [pipeline]="engine/parallel/pipeline.cc engine/observe/timeline.cc tools/timeline_main.cc $_gpt"
)
declare -A HASH_FUNCS=([shard]=zero_runs [shard3]=zero_runs [offload_opt]=gpt13b [offload_delayed]=gpt13b)
unset _gpt _cpu_opt _opt_offload

say() { echo "[gpu-session] $*"; }
die() { echo "gpu_session.sh: $*" >&2; exit 2; }

declare -A KIND=()  # step -> setup, test, bench or profile
for _s in "${SETUP_STEPS[@]}"; do KIND[$_s]=setup; done
for _s in "${TEST_STEPS[@]}"; do KIND[$_s]="test"; done
for _s in "${BENCH_STEPS[@]}"; do KIND[$_s]=bench; done
for _s in "${PROFILE_STEPS[@]}"; do KIND[$_s]=profile; done
unset _s

check_limits() {  # every step has a LIMIT and a MIN, whole seconds, 1 <= MIN <= LIMIT
  local s bad=0
  for s in "${SETUP_STEPS[@]}" "${TEST_STEPS[@]}" "${BENCH_STEPS[@]}" "${PROFILE_STEPS[@]}"; do
    if ! [[ ${LIMIT[$s]:-} =~ ^[1-9][0-9]*$ && ${MIN[$s]:-} =~ ^[1-9][0-9]*$ ]]; then
      say "ERROR: step $s: limit '${LIMIT[$s]:-}' and minimum '${MIN[$s]:-}' must be whole seconds >= 1"
      bad=1
    elif ((MIN[$s] > LIMIT[$s])); then
      say "ERROR: step $s: minimum ${MIN[$s]} s is over its limit ${LIMIT[$s]} s (it could never run)"
      bad=1
    fi
  done
  local v
  for v in DEADLINE_S SECOND_S RESERVE_S KILL_GRACE_S; do
    [[ ${!v} =~ ^[0-9]+$ ]] || { say "ERROR: $v is '${!v}': whole seconds"; bad=1; }
  done
  return $bad
}

# ---- time --------------------------------------------------------------------------------------
now_ms() { local t=${EPOCHREALTIME/[.,]/}; NOW_MS=$((10#$t / 1000)); }  # sets NOW_MS, no fork
fmt_s() {  # fmt_s MS [VAR]: seconds with one decimal (negative shows as 0.0), printed or into VAR
  local ms=$1 _fmt
  ((ms < 0)) && ms=0
  printf -v "${2:-_fmt}" '%d.%d' $((ms / 1000)) $(((ms % 1000) / 100))
  [[ -n ${2:-} ]] || echo "$_fmt"
}
ms_arg() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }  # MS as timeout's seconds

# ---- hashes ------------------------------------------------------------------------------------
# step_hashes STEP...: HASH_OF[STEP] = 16 hex digits of sha256 over the step's function text
# and its helpers' (as written in this file), then "path sha256" of each file of its HASH_DEPS
# globs (in the order written, each glob sorted, each file once). Text, not bash's `declare -f`,
# so that the same tree gives the same hash with any bash. One awk, one sha256sum over all files.
declare -A HASH_OF=()
step_hashes() {
  local LC_ALL=C step f g name line text h
  local -A fn=() fh=() seen=()
  local -a files=()
  while IFS=$'\t' read -r name line; do fn[$name]+="$line"$'\n'; done < <(
    awk '/^[a-z_0-9]+\(\) \{/ { name = substr($0, 1, index($0, "(") - 1) } name != "" { print name "\t" $0 } /^}/ { name = "" }' "$SELF")
  shopt -s nullglob
  for step; do
    for g in ${HASH_DEPS[$step]:-}; do
      for f in "$ROOT"/$g; do [[ -f $f && -z ${seen[$f]:-} ]] && { seen[$f]=1; files+=("$f"); }; done
    done
  done
  shopt -u nullglob
  if ((${#files[@]})); then
    while read -r h f; do fh[$f]=$h; done < <(sha256sum "${files[@]}")
  fi
  for step; do
    text=${fn[step_$step]:-}
    for f in ${HASH_FUNCS[$step]:-}; do text+=${fn[$f]:-}; done
    seen=()
    shopt -s nullglob
    for g in ${HASH_DEPS[$step]:-}; do
      for f in "$ROOT"/$g; do
        [[ -f $f && -z ${seen[$f]:-} ]] || continue
        seen[$f]=1
        text+="${f#"$ROOT/"} ${fh[$f]}"$'\n'
      done
    done
    shopt -u nullglob
    h=$(sha256sum <<<"$text")
    HASH_OF[$step]=${h:0:16}
  done
}

source_hash() {  # the sources of the build (SOURCE_DIRS), as the prebuilt archive's MANIFEST records
  (
    cd "$ROOT" || exit 1
    find "${SOURCE_DIRS[@]}" -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
      -o -name '*.cmake' -o -name CMakeLists.txt -o -name '*.in' -o -name '*.proto' \) -print0 2>/dev/null |
      LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
  )
}

# ---- the record of measurements (docs/gpu/measured.tsv) ------------------------------------------
# Lines: step <TAB> UTC date <TAB> commit <TAB> step_hash <TAB> seconds; '#' lines are comments.
declare -A REC_DATE=() REC_COMMIT=() REC_HASH=() REC_SECS=()
load_record() {
  local s d c h sec
  REC_DATE=() REC_COMMIT=() REC_HASH=() REC_SECS=()
  [[ -r $RECORD ]] || return 0
  while IFS=$'\t' read -r s d c h sec; do
    [[ -z $s || $s == \#* ]] && continue
    REC_DATE[$s]=$d REC_COMMIT[$s]=${c:--} REC_HASH[$s]=${h:--} REC_SECS[$s]=${sec:--}
  done <"$RECORD"
}

# bench_order: the benchmark steps by priority, one per line:
# "STEP TIER DATE HASH". TIER 0: never measured; 1: its hash changed since its last figure;
# 2: unchanged. Within a tier the oldest figure first (rotation), then declaration order.
bench_order() {
  local s i=0 h tier date
  load_record
  step_hashes "${BENCH_STEPS[@]}"
  for s in "${BENCH_STEPS[@]}"; do
    i=$((i + 1))
    h=${HASH_OF[$s]}
    if [[ -z ${REC_DATE[$s]:-} ]]; then
      tier=0 date=0000-00-00
    elif [[ ${REC_HASH[$s]} != "$h" ]]; then
      tier=1 date=${REC_DATE[$s]}
    else
      tier=2 date=${REC_DATE[$s]}
    fi
    printf '%s\t%s\t%05d\t%s\t%s\n' "$tier" "$date" "$i" "$s" "$h"
  done | LC_ALL=C sort -t$'\t' -k1,1n -k2,2 -k3,3n | awk -F'\t' '{ print $4, $1, $2, $5 }'
}

bench_order_into() {  # bench_order_into ARRAY: the steps by priority into ARRAY, their hashes into HASH_OF
  local -n into=$1
  local s tier date h
  into=()
  while read -r s tier date h; do
    into+=("$s")
    HASH_OF[$s]=$h
  done < <(bench_order)
}

tier_text() {  # tier_text TIER DATE
  case $1 in
    0) echo "never measured" ;;
    1) echo "code changed since $2" ;;
    *) echo "measured $2" ;;
  esac
}

# ---- the environment on the device --------------------------------------------------------------
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
  export PYTHONUNBUFFERED=1  # python's output reaches session.log as it is printed
  # $BUILD/lib first: a restored build's RUNPATH names the build machine's checkout path.
  export LD_LIBRARY_PATH="$BUILD/lib:$DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  export PATH="$DEPS/usr/bin:$PATH"
  ((FAKE)) && return 0
  # torch's lib directory and the nvidia wheels' (NCCL, the CUDA runtime) for programs whose
  # RUNPATH names another machine's paths (a prebuilt archive).
  local libs
  libs=$(python3 - 2>/dev/null <<'EOF'
import os
import torch
dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
try:
    import nvidia
    for p in nvidia.__path__:
        for n in sorted(os.listdir(p)):
            if os.path.isdir(os.path.join(p, n, "lib")):
                dirs.append(os.path.join(p, n, "lib"))
except ImportError:
    pass
print(":".join(dirs))
EOF
  )
  [[ -n $libs ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$libs"
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

# ---- the steps ---------------------------------------------------------------------------------
# step_NAME (in the session's shell, quick, no side effects) prepares the step: it sets CMD (the
# one bounded command), TITLE, PATTERN (the lines of its output the summary shows) and SHOWN (the
# command the summary shows), and returns 0 to run it; or sets WHY and returns 1 (SKIPPED: it
# cannot run), 2 (n/a: not needed) or 3 (FAIL without running). post_NAME RC, where defined, runs
# after the command: it may set POST_STATUS and POST_NOTE, and the session's state (HAVE_BUILD...).
CMD=() TITLE="" PATTERN="" SHOWN="" WHY="" POST_STATUS="" POST_NOTE=""
bench() {  # bench TITLE PATTERN CMD...: a measuring step's command; SHOW replaces the one shown
  TITLE=$1 PATTERN=$2
  shift 2
  CMD=("$@")
  SHOWN=${SHOW:-${*#"$BIN/"}}
}
need_build() {
  ((HAVE_BUILD)) && return 0
  WHY="no build (${BUILD_NOTE:-the build steps did not succeed})"
  return 1
}

step_gpuinfo() {
  # No GPU visible: stop before spending minutes on a build whose tests would all skip.
  TITLE="GPU" PATTERN='.'
  # shellcheck disable=SC2054  # the commas are nvidia-smi's
  CMD=(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)
}
post_gpuinfo() {
  if (($1 == 0)); then
    grep -m1 -v -E '^(fake-output|\| fake)' "$STATE/gpuinfo.out" >"$BUILD/gpu-info.txt"
  else
    STOP_REASON="no GPU visible (gpuinfo failed)"
    POST_NOTE="nvidia-smi failed: no GPU visible; nothing else runs"
  fi
}

step_unpack() {
  if [[ -d $DEPS/usr ]]; then WHY="unpacked by an earlier command on this machine"; return 2; fi
  if ((!FAKE)) && ! compgen -G ".deps/*.deb" >/dev/null; then
    WHY="no .deps/*.deb: run 'bash cluster/gpu_session.sh fetch' here and carry .deps"
    STOP_REASON="no Debian packages (.deps) carried"
    return 3
  fi
  # Only a complete unpack counts (the rename at its end).
  CMD=(bash -c 'rm -rf "$1.tmp" && mkdir -p "$1.tmp" && for f in .deps/*.deb; do dpkg -x "$f" "$1.tmp" || exit 1; done &&
    mv "$1.tmp" "$1" && echo "unpacked $(ls .deps/*.deb | wc -l) packages into $1"' _ "$DEPS")
}
post_unpack() { (($1 == 0)) || STOP_REASON="the Debian packages did not unpack"; }

step_prebuilt() {
  if [[ ! -r $PREBUILT ]]; then WHY="no ${PREBUILT#"$ROOT/"} carried: configure and build here"; return 2; fi
  CMD=(bash "$SELF" prebuilt-check "$PREBUILT" "$BUILD/prebuilt")
  PATTERN='^prebuilt-check: '
}
post_prebuilt() {
  local why
  if (($1 == 0)); then
    HAVE_BUILD=1
    BIN="$BUILD/prebuilt/bin"
    export LD_LIBRARY_PATH="$BUILD/prebuilt/lib:$LD_LIBRARY_PATH"
    BUILD_NOTE="prebuilt $(grep -E '^(sources|built)=' "$BUILD/prebuilt/MANIFEST" 2>/dev/null | tr '\n' ' ')"
    POST_NOTE="used: ldd and --gtest_list_tests ok"
  else
    why=$(grep '^prebuilt-check: REFUSED' "$STATE/prebuilt.out" | tail -1)
    POST_STATUS=refused  # not a failure of the session: configure and build follow
    POST_NOTE="${why#prebuilt-check: REFUSED: }; configure and build here instead"
  fi
}

step_configure() {
  if ((HAVE_BUILD)); then WHY="prebuilt binaries used"; return 2; fi
  # Always (re)configure: quick on an existing tree, and it prints the summary line to check.
  CMD=(cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON -DDTRAIN_PYTHON="$(command -v python3)"
    -DCMAKE_PREFIX_PATH="$DEPS/usr" -DCMAKE_MODULE_PATH="$DEPS/usr/share/glog/cmake"
    -DProtobuf_PROTOC_EXECUTABLE="$DEPS/usr/bin/protoc")
  PATTERN='dtrain: CUDA code paths|CMake Error'
}
post_configure() {
  (($1 == 0)) || return 0
  if check_configure "$STATE/configure.out" >>"$LOG" 2>&1; then
    CONFIGURED=1
  else
    POST_STATUS=FAIL
    POST_NOTE="CUDA or NCCL not ON: see check-configure in session.log"
  fi
}

step_build() {
  if ((HAVE_BUILD)); then WHY="prebuilt binaries used"; return 2; fi
  if ((!CONFIGURED)); then WHY="configure ${STATUS[configure]:-did not run}"; return 1; fi
  CMD=(cmake --build "$BUILD" -j "$(nproc)" --target "${BUILD_TARGETS[@]}")
  PATTERN='error|FAILED'
}
post_build() {
  if (($1 == 0)); then
    HAVE_BUILD=1 BUILT_HERE=1 BIN="$BUILD/bin"
    BUILD_NOTE="built here"
    tail -1 "$STATE/build.out" >"$STATE/build.match"
  else
    # The tail of a failed build comes back in the summary too (all of it is in session.log).
    tail -200 "$STATE/build.out" >"$STATE/build.match"
    BUILD_NOTE="the build failed"
    POST_NOTE="first error: $(grep -m1 -E 'error|FAILED' "$STATE/build.out" | cut -c1-160)"
  fi
}

step_save_build() {
  if ((!BUILT_HERE)); then WHY="nothing built here (prebuilt used, or no build)"; return 2; fi
  # The build, for a second command on a bare machine: fetched from $OUT into .gpu-build/.
  CMD=(bash "$SELF" save-build "$BUILD" "$OUT/prebuilt.tgz" "$(command -v python3)")
  PATTERN='^save-build: '
}
post_save_build() { POST_NOTE=$(grep '^save-build: ' "$STATE/save_build.out" | tail -1 | cut -d' ' -f2-); }

# The GPU tests, run as ctest registers them (tests/gpu/CMakeLists.txt: gpu.np1 is the binary,
# gpu.mpi.np2 the binary under mpirun -np 2) but without ctest: a prebuilt archive has no build
# tree, and each MPI rank needs its own GTEST_OUTPUT file (one shared setting lets the ranks
# overwrite each other's). gtest-run fails when the binary lists no tests; post_test_np* reads
# the XMLs.
step_test_np1() {
  need_build || return 1
  CMD=(env "${TEST_ENV[@]}" bash "$SELF" gtest-run 1 "$FILES/gtest" "$BIN")
  PATTERN='^gtest-run: |^\[  (PASSED|FAILED|  SKIPPED) |tests? ran|FAILED TEST'
}
step_test_np2() {
  need_build || return 1
  CMD=(env "${TEST_ENV[@]}" bash "$SELF" gtest-run 2 "$FILES/gtest" "$BIN")
  PATTERN='^gtest-run: |^\[  (PASSED|FAILED|  SKIPPED) |tests? ran|FAILED TEST|^\[rank [0-9]+\] FAILED'
}
post_test_np1() { judge_gtest "$1" 1; }
post_test_np2() { judge_gtest "$1" 2; }

# judge_gtest RC NP: no false pass. FAIL unless every expected XML (np1.xml, or np2-rank0/1.xml)
# exists and shows cases > 0, not all of them skipped, no failure, and RC is 0.
judge_gtest() {
  local rc=$1 np=$2 f r cases skipped failures notes=() bad=0
  local -a files=()
  if ((np == 1)); then files=("$FILES/gtest/np1.xml"); else
    for ((r = 0; r < np; r++)); do files+=("$FILES/gtest/np$np-rank$r.xml"); done
  fi
  if ((rc == 5)); then
    POST_STATUS=FAIL POST_NOTE="dtrain_gpu_tests lists no tests"
    return
  fi
  r=0
  for f in "${files[@]}"; do
    local who="np1"
    ((np > 1)) && who="rank $r"
    r=$((r + 1))
    if [[ ! -s $f ]]; then
      notes+=("$who: no XML (crashed, or ran nothing)")
      bad=1
      continue
    fi
    cases=$(grep -c '<testcase ' "$f")
    skipped=$(grep -c 'result="skipped"' "$f")
    failures=$(grep -c '<failure' "$f")
    notes+=("$who: $cases cases, $skipped skipped, $failures failures")
    if ((cases == 0)); then
      notes+=("$who ran 0 cases")
      bad=1
    elif ((skipped == cases)); then
      notes+=("$who: every case skipped (no CUDA device seen?)")
      bad=1
    fi
    ((failures > 0)) && bad=1
  done
  ((rc != 0)) && bad=1  # (finish_step's note names the exit status)
  POST_NOTE=$(IFS=';'; echo "${notes[*]}" | sed 's/;/; /g')
  ((bad)) && POST_STATUS=FAIL
}

step_s2s() {
  need_build || return 1
  bench "s2s seed model, rows s2s fp32 .. eval (tools/techniques.sh --device=cuda)" '^\|' \
    env DTRAIN_BIN="$BIN" bash tools/techniques.sh --device=cuda --steps=20 --log_every=10
}
step_gpt124m() {
  need_build || return 1
  bench "gpt124m AMP bf16" 'trained|MFU' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --steps=30 --log_every=10 --progress=false
}
step_nccl_allreduce() {
  need_build || return 1
  bench "NCCL all-reduce, world size 1 (busbw GB/s, 64 to 256 MiB)" '"bench"' \
    "$BIN/dtrain-bench" allreduce --backend=nccl --device=cuda --min_bytes=67108864
}
step_mpi_allreduce() {
  need_build || return 1
  bench "MPI all-reduce, 2 ranks sharing the GPU through host staging (64 to 256 MiB)" '"bench"' \
    "${MPIRUN[@]}" -np 2 "$BIN/dtrain-bench" allreduce --backend=mpi --device=cuda --min_bytes=67108864
}
step_cpu_adam() {
  need_build || return 1
  bench "CPU Adam, 100M parameters, 16 threads (PyTorch: fused 20 ms, foreach 109 ms)" '"bench"' \
    "$BIN/dtrain-bench" cpu_adam --threads=16 --impls=dtrain,torch_fused,torch_foreach
}
step_copies() {
  # No dtrain program times bare copies; this is the ceiling the offload paths copy against,
  # measured with torch on this machine (1 GiB, pinned host memory, non-blocking copy_).
  SHOW="python3 -c <pinned copy probe of cluster/gpu_session.sh>" \
    bench "pinned copies (torch probe: the ceiling for the offload rows)" 'GB/s' python3 -c '
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
  need_build || return 1
  bench "layer offload, gpt124m (--offload=layers)" 'trained|MFU|offload' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=layers --steps=10 --log_every=5 \
    --progress=false
}
step_async_save() {
  need_build || return 1
  bench "checkpoint save: the step that saves vs an ordinary one, background vs synchronous" '"bench"' \
    python3 tools/async_save_bench.py "$BIN" --device=cuda
}
# ZeRO on the device: gpt124m on 2 ranks sharing the GPU (gradients and ZeRO-3's gathers through
# MPI with host staging, so the step time is the staging's; the memory per rank is the figure):
# the memory report after step 4 of each stage, rank 0. zero_runs TITLE STAGE...: one mpirun per
# stage, in order; a stage may carry more flags ("parameters --offload=optimizer").
zero_runs() {
  local title=$1 stages
  shift
  stages=$(IFS=';'; echo "$*")
  SHOW="mpirun -np 2 train_gpt --device=cuda --data=synthetic --amp=bf16 --memory_report_step=4 --shard=${stages//;/|}" \
    bench "$title" 'shard=|trained|memory on|parameters +|gradients +|optimizer state|peak|other \(' \
    env ZERO_STAGES="$stages" bash -c '
IFS=";" read -ra stages <<<"$ZERO_STAGES"
for s in "${stages[@]}"; do
  echo "shard=$s"
  "${@:2}" "$1" --device=cuda --data=synthetic --amp=bf16 --steps=5 --log_every=1 --progress=false \
    --memory_report_step=4 --shard=$s || exit 1
done' _ "$BIN/train_gpt" "${MPIRUN[@]}" -np 2
}
step_shard() {
  need_build || return 1
  zero_runs "ZeRO-1/2 on the device, gpt124m, 2 ranks on the one GPU (memory per rank)" none optimizer gradients
}
# ZeRO-3 also with the optimizer offloaded (its device figure against stage 3's, its host figure).
step_shard3() {
  need_build || return 1
  zero_runs "ZeRO-3 on the device, gpt124m, 2 ranks on the one GPU (memory per rank; also offloaded)" \
    parameters "parameters --offload=optimizer"
}
# Issue 5's goal: a GPT whose optimizer state does not fit the GPU (6.3B parameters: 100 GB of
# fp32 weights, gradients and Adam moments) trains with the optimizer state in host memory.
step_offload6b() {
  need_build || return 1
  bench "optimizer offload, largest GPT: 6.3B parameters (goal: >= 30% of peak)" \
    'parameters|trained|MFU|step [0-9]+/' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=optimizer --checkpoint_activations \
    --d_model=4096 --heads=32 --layers=30 --ff=16384 --batch_size=2 --steps=4 --log_every=1 --progress=false \
    --memory_report_step=2
}
gpt13b() {  # gpt13b STEPS: the 1.3B-shape optimizer-offload flags
  GPT13B=(--device=cuda --data=synthetic --amp=bf16 --offload=optimizer --d_model=2048 --heads=16 --layers=24
          --ff=8192 --batch_size=4 --steps="$1" --log_every=4 --progress=false)
}
step_offload_opt() {
  need_build || return 1
  gpt13b 8
  bench "optimizer offload, GPT 1.3B shape (the baseline of the delayed update)" 'trained|MFU|offload' \
    "$BIN/train_gpt" "${GPT13B[@]}"
}
step_offload_delayed() {
  need_build || return 1
  gpt13b 8
  bench "optimizer offload, delayed update (CPU step hidden behind the next forward/backward)" \
    'trained|MFU|offload' "$BIN/train_gpt" "${GPT13B[@]}" --offload_delayed_update_after=2
}
# Pipeline stages on the device: gpt124m split into 2 stages on 2 ranks sharing the GPU (the
# activations through MPI with host staging, so the step time is the staging's; the memory per
# stage and the bubble are the figures), 1F1B with 4 micro-batches, and each stage's idle share
# of a step from the timeline (dtrain-timeline) against (P-1)/(m+P-1).
step_pipeline() {
  need_build || return 1
  SHOW="mpirun -np 2 train_gpt --device=cuda --data=synthetic --amp=bf16 --pp=2 --accum_steps=4 --timeline=...; dtrain-timeline summary" \
    bench "pipeline stages on the device, gpt124m, 2 stages on the one GPU (memory per stage, bubble)" \
    'trained|peak|stage [0-9] \(rank' bash -c '
"${@:3}" "$1" --device=cuda --data=synthetic --amp=bf16 --pp=2 --accum_steps=4 --steps=6 --log_every=3 \
  --progress=false --memory_report_step=4 --timeline="$2/pp-timeline.json" || exit 1
"$(dirname "$1")/dtrain-timeline" summary "$2/pp-timeline.json"' _ "$BIN/train_gpt" "$FILES" "${MPIRUN[@]}" -np 2
}

# Profiles (--profile_steps: Kineto traces with every kernel and copy) of the rows that miss their
# goals, each summarized by tools/profile_summary.py; the gzipped traces go into files.tgz.
profile_run() {  # profile_run NAME TITLE TRAIN_GPT_ARGS...: the run, then its trace's summary
  local name=$1 title=$2 trace="$FILES/profiles/$1.json"
  shift 2
  SHOW="train_gpt $* --profile_out=$name.json; tools/profile_summary.py $name.json" \
    bench "$title" '.' bash -c 'mkdir -p "$(dirname "$1")" && "${@:2}" && python3 tools/profile_summary.py "$1" &&
      gzip -f "$1" "${1%.json}-timeline.json"' _ "$trace" \
    "$BIN/train_gpt" "$@" --profile_out="$trace" --timeline="${trace%.json}-timeline.json"
}
step_profile_layers() {
  need_build || return 1
  profile_run layers "layer offload, gpt124m, steps 4-5" --device=cuda --data=synthetic --amp=bf16 \
    --offload=layers --steps=5 --log_every=5 --progress=false --profile_steps=4-5
}
step_profile_offload() {
  need_build || return 1
  gpt13b 5
  profile_run offload "optimizer offload, 1.3B shape, steps 4-5" "${GPT13B[@]}" --profile_steps=4-5
}
step_profile_delayed() {
  need_build || return 1
  gpt13b 5
  profile_run delayed "optimizer offload, delayed update, steps 4-5" "${GPT13B[@]}" \
    --offload_delayed_update_after=2 --profile_steps=4-5
}

# ---- the session engine ------------------------------------------------------------------------
declare -A STATUS=() SECS=() BUDGET_OF=() NOTE=() TITLE_OF=() SHOWN_OF=()
PLAN_STEPS=()          # every step this command may run, in order (the summary lists them all)
MODE="" LOG="" STATE="" FILES="" STATE_LINE="" START_DATE="" COMMIT="?" SRC_HASH="?"
# CUR_PHASE: starting (from the "running" summary to the launch), running (waiting for the
# command: CUR_PID), finishing (its command ended with CUR_RC); "" between steps.
T0_MS=0 DEADLINE_MS=0 CUR_STEP="" CUR_PHASE="" CUR_PID="" CUR_RC=0 CUR_START_MS=0 CUR_OFF=0 CUR_TERM_MS=0
HAVE_BUILD=0 BUILT_HERE=0 CONFIGURED=0 BUILD_NOTE="" STOP_REASON="" KILLED_BY=""

# clean TEXT: into CLEAN, without a tab, a newline or a '|' (the summary's and results' rows).
clean() { CLEAN=${1//$'\t'/ }; CLEAN=${CLEAN//$'\n'/ }; CLEAN=${CLEAN//|//}; }

skipped_for_time() {  # SKIPPED_FOR_TIME: the benchmark steps SKIPPED for time, or not reached when killed
  local s
  SKIPPED_FOR_TIME=""
  for s in "${PLAN_STEPS[@]}"; do
    [[ ${KIND[$s]:-} == bench ]] || continue
    if [[ ${STATUS[$s]:-} == SKIPPED && ${NOTE[$s]:-} == needs\ at\ least* ]] ||
       [[ -n $KILLED_BY && -z ${STATUS[$s]:-} ]]; then
      SKIPPED_FOR_TIME+="$s "
    fi
  done
}

verdict() {  # VERDICT: PASS, or FAIL (the steps that failed); `run` needs its build and tests
  local s bad=()
  for s in "${PLAN_STEPS[@]}"; do
    case ${STATUS[$s]:-} in
      FAIL | TIMEOUT | KILLED) bad+=("$s ${STATUS[$s]}") ;;
      SKIPPED) [[ ${KIND[$s]:-} == test || $s == build ]] && bad+=("$s SKIPPED") ;;
    esac
  done
  ((HAVE_BUILD)) || bad+=("no build")
  if ((${#bad[@]})); then VERDICT="FAIL (${bad[*]})"; else VERDICT=PASS; fi
}

write_results() {  # results.tsv: one row per step done; `record` reads it
  local s
  {
    printf '# step\tkind\tstatus\tseconds\thash\tdate\tcommit\n'
    for s in "${PLAN_STEPS[@]}"; do
      case ${STATUS[$s]:-} in '' | running) continue ;; esac
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "${KIND[$s]:-}" "${STATUS[$s]}" "${SECS[$s]:--}" \
        "${HASH_OF[$s]:--}" "${START_DATE%% *}" "$COMMIT"
    done
  } >"$OUT/results.tsv.tmp"
  mv -f "$OUT/results.tsv.tmp" "$OUT/results.tsv"
}

write_summary() {  # summary.md (and results.tsv), replaced whole
  local s rest elapsed
  now_ms
  verdict
  fmt_s $((NOW_MS - T0_MS)) elapsed
  {
    echo "# GPU session: $MODE, $START_DATE UTC"
    echo
    echo "- state: $STATE_LINE"
    echo "- verdict: $VERDICT"
    echo "- deadline $DEADLINE_S s; $elapsed s elapsed at this rewrite"
    echo "- GPU: $(head -1 "$BUILD/gpu-info.txt" 2>/dev/null || echo '?')"
    echo "- tree: sources $SRC_HASH, commit $COMMIT; build: ${BUILD_NOTE:-none yet}"
    echo
    echo "| step | status | seconds | budget s | note |"
    echo "| --- | --- | --- | --- | --- |"
    for s in "${PLAN_STEPS[@]}"; do
      clean "${NOTE[$s]:-}"
      echo "| $s | ${STATUS[$s]:-pending} | ${SECS[$s]:--} | ${BUDGET_OF[$s]:--} | $CLEAN |"
    done
    skipped_for_time
    rest=$SKIPPED_FOR_TIME
    if [[ -n $rest && $MODE == run ]]; then
      echo
      echo "Second command, only if the device tool's budget_left_s is at least $((START_S + SECOND_S + 15)) s:"
      echo "\`OUT=\$OUT bash cluster/gpu_session.sh rest ${rest% }\` | carry $CARRY | timeout_s $((SECOND_S + 30))"
      if ((BUILT_HERE)); then
        echo "(put this \$OUT's prebuilt.tgz into .gpu-build/ first: the second machine is bare)"
      fi
    fi
    if [[ -s $STATE/sections.md ]]; then cat "$STATE/sections.md"; fi
  } >"$OUT/summary.md.tmp"
  mv -f "$OUT/summary.md.tmp" "$OUT/summary.md"
  write_results
}

pack_files() {  # files.tgz from $FILES when a file there is newer than it (tmp + rename); FORCE=1: always
  local f newer=${FORCE:-0} any=0
  shopt -s globstar nullglob
  for f in "$FILES"/**; do
    [[ -f $f ]] || continue
    any=1
    [[ ! -e $OUT/files.tgz || $f -nt $OUT/files.tgz ]] && newer=1
  done
  shopt -u globstar nullglob
  ((any && newer)) || return 0
  if ! tar -C "$FILES" -czf "$OUT/files.tgz.tmp" .; then
    rm -f "$OUT/files.tgz.tmp"
    return 1
  fi
  # Over what a file of $OUT may have (profiles' traces): without the traces, said in session.log.
  if (($(stat -c %s "$OUT/files.tgz.tmp") > OUT_FILE_BYTES_MAX)); then
    echo "===== files.tgz: over 16 MiB; packed again without the *.json.gz traces" >>"$LOG"
    tar -C "$FILES" --exclude='*.json.gz' -czf "$OUT/files.tgz.tmp" . || { rm -f "$OUT/files.tgz.tmp"; return 1; }
  fi
  mv -f "$OUT/files.tgz.tmp" "$OUT/files.tgz"
}

# finish_step STEP RC: the step's status from RC (or KILLED_BY), its post_ hook, its matched
# lines; the end marker into session.log, files.tgz, then the summary. Status is final last.
finish_step() {
  local step=$1 rc=$2 dur status note="" secs at
  now_ms
  dur=$((NOW_MS - CUR_START_MS))
  fmt_s "$dur" secs
  fmt_s $((NOW_MS - T0_MS)) at
  tail -c +$((CUR_OFF + 1)) "$LOG" >"$STATE/$step.out" 2>/dev/null
  if [[ -n $KILLED_BY ]]; then
    status=KILLED note="stopped by $KILLED_BY at $at s"
  elif ((rc == 0)); then
    status=ok
  elif ((rc == 124 || (rc == 137 && dur + 200 >= CUR_TERM_MS))); then
    status=TIMEOUT note="over its budget of ${BUDGET_OF[$step]} s (limit ${LIMIT[$step]} s), exit $rc"
  else
    status=FAIL note="exit $rc"
  fi
  if [[ -n $PATTERN ]]; then
    grep -E -- "$PATTERN" "$STATE/$step.out" | head -200 >"$STATE/$step.match"
  else
    : >"$STATE/$step.match"
  fi
  POST_STATUS="" POST_NOTE=""
  if [[ -z $KILLED_BY ]] && declare -F "post_$step" >/dev/null; then
    "post_$step" "$rc"
    [[ -n $POST_STATUS ]] && status=$POST_STATUS
    [[ -n $POST_NOTE ]] && note="$POST_NOTE${note:+; $note}"
  fi
  printf '===== %s: %s, %s s%s\n' "$step" "$status" "$secs" "${note:+ ($note)}" >>"$LOG"
  if [[ -s $STATE/$step.match ]]; then  # the step's section of the summary: its matched lines
    {
      printf '\n## %s: %s (%s)\n\n' "$step" "${TITLE_OF[$step]:-$step}" "$status"
      [[ -n ${SHOWN_OF[$step]:-} ]] && printf '`%s`\n\n' "${SHOWN_OF[$step]}"
      cat "$STATE/$step.match"
    } >>"$STATE/sections.md"
  fi
  pack_files
  STATUS[$step]=$status SECS[$step]=$secs NOTE[$step]=$note
  CUR_STEP="" CUR_PID="" CUR_PHASE=""
  STATE_LINE="between steps (last: $step, $status)"
  write_summary
}

# run_one STEP: prepare, fit into the time left, run the one bounded command, finish.
run_one() {
  local step=$1 prep left_ms left_s lim_ms min_ms budget_ms term_ms kill_ms rc at
  CMD=() TITLE="" PATTERN="" SHOWN="" WHY=""
  if [[ -n $STOP_REASON ]]; then
    STATUS[$step]=SKIPPED NOTE[$step]=$STOP_REASON
    return
  fi
  "step_$step"
  prep=$?
  TITLE_OF[$step]=$TITLE SHOWN_OF[$step]=$SHOWN
  case $prep in
    0) ;;
    1) STATUS[$step]=SKIPPED NOTE[$step]=$WHY; write_summary; return ;;
    2) STATUS[$step]=n/a NOTE[$step]=$WHY; write_summary; return ;;
    *) STATUS[$step]=FAIL NOTE[$step]=$WHY; write_summary; return ;;
  esac
  if ((FAKE)) && [[ $step != test_np* && $step != save_build ]]; then
    CMD=(bash "$SELF" fake-step "$step")
  fi
  now_ms
  left_ms=$((DEADLINE_MS - RESERVE_S * 1000 - (NOW_MS - T0_MS)))
  lim_ms=$((LIMIT[$step] * 1000)) min_ms=$((MIN[$step] * 1000))
  budget_ms=$((lim_ms < left_ms ? lim_ms : left_ms))
  if ((budget_ms < min_ms)); then
    fmt_s "$left_ms" left_s
    STATUS[$step]=SKIPPED NOTE[$step]="needs at least ${MIN[$step]} s, $left_s s left"
    printf '===== %s: SKIPPED (%s)\n' "$step" "${NOTE[$step]}" >>"$LOG"
    write_summary
    return
  fi
  # SIGTERM at the budget less the grace (or half-way for a short budget), SIGKILL at the budget.
  if ((budget_ms > 2 * KILL_GRACE_S * 1000)); then term_ms=$((budget_ms - KILL_GRACE_S * 1000)); else term_ms=$((budget_ms / 2)); fi
  kill_ms=$((budget_ms - term_ms))
  CUR_STEP=$step CUR_PHASE=starting CUR_TERM_MS=$term_ms
  fmt_s "$budget_ms" "BUDGET_OF[$step]"
  fmt_s $((NOW_MS - T0_MS)) at
  STATUS[$step]=running
  STATE_LINE="running $step since $at s (budget ${BUDGET_OF[$step]} s)"
  write_summary
  printf '===== %s start at %s s (budget %s s): %s\n' "$step" "$at" "${BUDGET_OF[$step]}" "${SHOWN:-${CMD[*]}}" >>"$LOG"
  CUR_OFF=$(stat -c %s "$LOG")
  now_ms
  CUR_START_MS=$NOW_MS
  # timeout makes itself a process group leader and signals the whole group; stdbuf makes the
  # command's stdio line-buffered (its children inherit it), so the log is current when cut off.
  timeout -k "$(ms_arg "$kill_ms")" "$(ms_arg "$term_ms")" "${LINEBUF[@]}" "${CMD[@]}" >>"$LOG" 2>&1 </dev/null &
  CUR_PID=$! CUR_PHASE=running
  wait "$CUR_PID"
  rc=$?
  CUR_RC=$rc CUR_PHASE=finishing CUR_PID=""
  finish_step "$step" "$rc"
}

on_signal() {  # SIGTERM/INT/HUP: stop the running step's group, mark it KILLED, last summary
  local sig=$1 i
  trap '' TERM INT HUP
  KILLED_BY="SIG$sig"
  case $CUR_PHASE in
    running)
      kill -TERM -- "-$CUR_PID" 2>/dev/null || kill -TERM "$CUR_PID" 2>/dev/null
      for ((i = 0; i < 20; i++)); do kill -0 "$CUR_PID" 2>/dev/null || break; sleep 0.1; done
      kill -KILL -- "-$CUR_PID" 2>/dev/null
      finish_step "$CUR_STEP" 143
      ;;
    finishing)
      # Its command had ended: finish it as it ended (its bookkeeping was cut short).
      KILLED_BY=""
      finish_step "$CUR_STEP" "$CUR_RC"
      KILLED_BY="SIG$sig"
      ;;
    starting)
      # Not launched, or launched a moment ago (its own timeout still bounds it): not run here.
      unset "STATUS[$CUR_STEP]" "BUDGET_OF[$CUR_STEP]"
      NOTE[$CUR_STEP]="not started: $KILLED_BY"
      ;;
  esac
  STATE_LINE="killed by SIG$sig"
  finalize
  case $sig in TERM) exit 143 ;; INT) exit 130 ;; *) exit 129 ;; esac
}

finalize() {  # the last summary; session.log gzipped if it outgrew what comes back
  local n
  [[ -z $KILLED_BY ]] && { now_ms; STATE_LINE="finished in $(fmt_s $((NOW_MS - T0_MS))) s of the $DEADLINE_S s deadline"; }
  FORCE=1 pack_files
  rm -f "$OUT"/*.tmp  # a replacement cut off by a signal
  if (($(stat -c %s "$LOG") > OUT_FILE_BYTES_MAX - (1 << 20))); then
    gzip -c "$LOG" >"$LOG.gz.tmp" && mv -f "$LOG.gz.tmp" "$LOG.gz" && rm -f "$LOG"
  fi
  write_summary
  n=$(find "$OUT" -type f | wc -l)
  ((n <= OUT_FILES_MAX)) || say "WARNING: $OUT holds $n files; only $OUT_FILES_MAX come back"
  verdict
  say "$MODE: $VERDICT; summary in $OUT/summary.md"
}

# session MODE [BENCH...]: MODE run (setup, tests, benchmarks), rest (setup, benchmarks; the
# second command's deadline), profile (setup, profiles).
session() {
  MODE=$1
  shift
  local deadline_s=$DEADLINE_S s n
  [[ $MODE == rest ]] && deadline_s=$SECOND_S
  DEADLINE_S=$deadline_s
  ((DEADLINE_S <= CALL_LIMIT_S - 10)) || die "a deadline of $DEADLINE_S s leaves the device tool's $CALL_LIMIT_S s no margin"
  cd "$ROOT" || exit 1
  mkdir -p "$OUT" "$BUILD" || exit 1
  n=$(find "$OUT" -type f | wc -l)
  ((n == 0)) || say "WARNING: $OUT already holds $n files (the device tool empties it; they count against the $OUT_FILES_MAX)"
  STATE="$BUILD/state" FILES="$BUILD/files" LOG="$OUT/session.log"
  rm -rf "$STATE" "$FILES" "$BUILD/gpu-info.txt"
  mkdir -p "$STATE" "$FILES/gtest"
  export GPU_SESSION_BUILD="$BUILD" GPU_SESSION_FAKE="$FAKE"
  now_ms
  T0_MS=$NOW_MS DEADLINE_MS=$((DEADLINE_S * 1000))
  START_DATE=$(date -u '+%F %H:%M')
  : >"$LOG"
  echo "# gpu_session.sh $MODE, $START_DATE UTC, deadline $DEADLINE_S s$( ((FAKE)) && echo ', FAKE steps')" >>"$LOG"
  STATE_LINE="starting"
  PLAN_STEPS=(gpuinfo unpack prebuilt configure build)
  write_summary
  trap 'on_signal TERM' TERM
  trap 'on_signal INT' INT
  trap 'on_signal HUP' HUP
  LINEBUF=()
  command -v stdbuf >/dev/null && LINEBUF=(stdbuf -oL -eL)
  ((FAKE)) && MPIRUN=(bash "$SELF" fake-mpirun) TEST_MPIRUN=(bash "$SELF" fake-mpirun)
  environment
  SRC_HASH=$(source_hash)
  COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')
  local -a order=()
  case $MODE in
    run)
      PLAN_STEPS=("${SETUP_STEPS[@]}" "${TEST_STEPS[@]}")
      if ((ONLY_GIVEN)); then order=("${ONLY[@]}"); else bench_order_into order; fi
      ;;
    rest)
      PLAN_STEPS=(gpuinfo unpack prebuilt configure build)
      # The steps named, in the order named; none named: all, by priority.
      if ((${#ONLY[@]})); then order=("${ONLY[@]}"); else bench_order_into order; fi
      ;;
    profile)
      PLAN_STEPS=(gpuinfo unpack prebuilt configure build)
      order=("${PROFILE_STEPS[@]}")
      ;;
  esac
  local -a unhashed=()
  for s in "${order[@]}"; do
    PLAN_STEPS+=("$s")
    [[ ${KIND[$s]:-} == bench && -z ${HASH_OF[$s]:-} ]] && unhashed+=("$s")
  done
  ((${#unhashed[@]})) && step_hashes "${unhashed[@]}"
  echo "# order: ${PLAN_STEPS[*]}" >>"$LOG"
  for s in "${PLAN_STEPS[@]}"; do
    [[ $MODE != run && $s == save_build ]] && continue
    run_one "$s"
  done
  finalize
  [[ $VERDICT == PASS ]]
}

# ---- internal commands (each a step's bounded command) -----------------------------------------
# gtest-run NP XMLDIR BINDIR: lists the tests (none: exit 5), then runs them at NP processes,
# each writing XMLDIR/np1.xml or XMLDIR/npNP-rankR.xml.
gtest_run() {
  local np=$1 dir=$2 bin=$3 listed
  local -a g=("$bin/dtrain_gpu_tests")
  ((FAKE)) && g=(bash "$SELF" fake-gtest) TEST_MPIRUN=(bash "$SELF" fake-mpirun)
  mkdir -p "$dir" && rm -f "$dir/np$np"*.xml
  listed=$(GPU_SESSION_FAKE_NP=$np "${g[@]}" --gtest_list_tests | grep -c '^  ')
  echo "gtest-run: $listed tests listed, running them at $np process(es)"
  if ((listed == 0)); then
    echo "gtest-run: ERROR: dtrain_gpu_tests lists no tests"
    return 5
  fi
  if ((np == 1)); then
    GTEST_OUTPUT="xml:$dir/np1.xml" "${g[@]}"
  else
    "${TEST_MPIRUN[@]}" -np "$np" bash -c 'GTEST_OUTPUT="xml:$1/np$2-rank${OMPI_COMM_WORLD_RANK:-X}.xml" exec "${@:3}"' \
      _ "$dir" "$np" "${g[@]}"
  fi
}

write_manifest() {  # write_manifest PYTHON: what a prebuilt archive was built from
  echo "sources=$(source_hash)"
  echo "source_dir=$ROOT"
  echo "python=$1"
  echo "torch=$({ ((FAKE)) && echo fake; } || "$1" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')"
  echo "built=$(date -u '+%F %H:%M') on $(hostname)"
  echo "commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
}

# archive_build BUILD_DIR ARCHIVE PYTHON: bin/ (the BUILD_TARGETS), lib/ and a MANIFEST into
# ARCHIVE.tmp (the caller renames it). Prints the archive's size in bytes.
archive_build() {
  local build=$1 archive=$2 py=$3 stage t
  stage="$build/.stage"
  rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/lib" || return 1
  for t in "${BUILD_TARGETS[@]}"; do
    [[ -e $build/bin/$t ]] || { echo "archive: $build/bin/$t is missing" >&2; return 1; }
    cp -a "$build/bin/$t" "$stage/bin/"
  done
  cp -a "$build"/lib/*.so* "$stage/lib/" 2>/dev/null
  write_manifest "$py" >"$stage/MANIFEST"
  tar -C "$stage" -czf "$archive.tmp" . || return 1
  rm -rf "$stage"
  stat -c %s "$archive.tmp"
}

save_build() {  # save-build BUILD_DIR ARCHIVE PYTHON: the device build, for a second command
  local bytes
  bytes=$(archive_build "$1" "$2" "$3") || { rm -f "$2.tmp"; echo "save-build: FAILED to pack $1"; return 1; }
  if ((bytes > OUT_FILE_BYTES_MAX)); then
    rm -f "$2.tmp"
    echo "save-build: not kept: $((bytes >> 20)) MiB is over the 16 MiB a file of \$OUT may have"
    return 0
  fi
  mv -f "$2.tmp" "$2"
  echo "save-build: kept $(basename "$2") ($((bytes >> 10)) KiB): put it into .gpu-build/ for a second command"
}

# prebuilt-check ARCHIVE DEST: unpack; refuse (non-zero, a "prebuilt-check: REFUSED: why" line)
# when its sources are not this tree's, its torch is not this python3's, a program or library
# misses a library (ldd "not found", LD_LIBRARY_PATH as the session sets it), or the GPU test
# binary lists no tests.
prebuilt_check() {
  local archive=$1 dest=$2 want have f missing=() listed srcdir py
  rm -rf "$dest" && mkdir -p "$dest" || return 1
  tar -C "$dest" -xzf "$archive" || { echo "prebuilt-check: REFUSED: cannot unpack $archive"; return 3; }
  [[ -r $dest/MANIFEST ]] || { echo "prebuilt-check: REFUSED: no MANIFEST in $archive"; return 3; }
  sed 's/^/prebuilt-check: manifest: /' "$dest/MANIFEST"
  want=$(sed -n 's/^sources=//p' "$dest/MANIFEST")
  have=$(source_hash)
  if [[ $want != "$have" ]]; then
    echo "prebuilt-check: REFUSED: stale: built from sources $want, this tree is $have (pack again)"
    return 3
  fi
  f=$(sed -n 's/^torch=//p' "$dest/MANIFEST")
  if [[ -n $f && $f != '?' ]]; then
    have=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
    [[ $f == "$have" ]] || { echo "prebuilt-check: REFUSED: built against torch $f, python3 here has $have"; return 3; }
  fi
  # The tests find the sources and python through paths compiled in (tests/CMakeLists.txt:
  # DTRAIN_SOURCE_DIR, DTRAIN_TEST_PYTHON): point them here when they do not exist.
  srcdir=$(sed -n 's/^source_dir=//p' "$dest/MANIFEST")
  if [[ -n $srcdir && $srcdir != "$ROOT" ]]; then
    if [[ -e $srcdir ]]; then
      echo "prebuilt-check: REFUSED: built in $srcdir, which exists here and is not this tree ($ROOT)"
      return 3
    fi
    mkdir -p "$(dirname "$srcdir")" && ln -s "$ROOT" "$srcdir" && echo "prebuilt-check: linked $srcdir -> $ROOT"
  fi
  py=$(sed -n 's/^python=//p' "$dest/MANIFEST")
  if [[ -n $py && ! -e $py ]] && command -v python3 >/dev/null; then
    mkdir -p "$(dirname "$py")" && ln -s "$(command -v python3)" "$py" && echo "prebuilt-check: linked $py -> python3"
  fi
  export LD_LIBRARY_PATH="$dest/lib:${LD_LIBRARY_PATH:-}"
  for f in "$dest"/bin/* "$dest"/lib/*.so*; do
    [[ -f $f && ! -L $f ]] || continue
    while read -r line; do missing+=("$(basename "$f"): $line"); done < <(ldd "$f" 2>&1 | grep 'not found')
  done
  if ((${#missing[@]})); then
    printf 'prebuilt-check: ldd: %s\n' "${missing[@]}"
    echo "prebuilt-check: REFUSED: ${#missing[@]} unresolved libraries, first: ${missing[0]}"
    return 4
  fi
  listed=$("$dest/bin/dtrain_gpu_tests" --gtest_list_tests 2>&1 | grep -c '^  ')
  if ((listed == 0)); then
    echo "prebuilt-check: REFUSED: $dest/bin/dtrain_gpu_tests --gtest_list_tests lists no tests"
    return 5
  fi
  echo "prebuilt-check: ok: ldd clean, dtrain_gpu_tests lists $listed tests"
}

# ---- fakes (GPU_SESSION_FAKE=1): short stand-ins for the GPU commands, for the tests ------------
# fake-step STEP: prints a start line, 3 lines a GPU_SESSION_FAKE_SLEEP (0.1 s) apart, then acts
# on GPU_SESSION_FAKE_<STEP>: ok (default), fail (exit 1), hang (sleeps past any limit), stubborn
# (ignores SIGTERM too), sleep:S, off (configure prints CUDA OFF). build creates a fake bin/ and lib/.
fake_step() {
  local step=$1 var="GPU_SESSION_FAKE_$1" mode i pause=${GPU_SESSION_FAKE_SLEEP:-0.1}
  mode=${!var:-ok}
  echo "fake-output $step start ($mode)"
  case $step in
    gpuinfo) echo "FAKE H100 80GB HBM3, 580.159.04, 81559 MiB" ;;
    configure) echo "-- dtrain: CUDA code paths $([[ $mode == off ]] && echo OFF || echo ON), NCCL backend ON" ;;
    build)
      mkdir -p "$BUILD/bin" "$BUILD/lib"
      for i in "${BUILD_TARGETS[@]}"; do echo "fake $i" >"$BUILD/bin/$i"; done
      echo fake >"$BUILD/lib/libdtrain_fake.so"
      ;;
    prebuilt) [[ $mode == ok ]] && echo "prebuilt-check: ok (fake)" || echo "prebuilt-check: REFUSED: fake refusal" ;;
  esac
  for ((i = 1; i <= 3; i++)); do
    sleep "$pause"
    echo "fake-output $step line $i: trained 1 steps, 1.0 ms/step, MFU 1%, \"bench\" 1 GB/s, shard=x, peak 1 MiB"
  done
  echo "| fake $step | 1.0 | 1 |"
  case $mode in
    ok | off) return 0 ;;
    fail) echo "fake-output $step: failing as told"; return 1 ;;
    hang) echo "fake-output $step: hanging"; sleep 1000 ;;
    stubborn) trap '' TERM; echo "fake-output $step: ignoring SIGTERM"; while :; do sleep 0.2; done ;;
    sleep:*) sleep "${mode#sleep:}" ;;
  esac
}

# fake-gtest: stands in for dtrain_gpu_tests. GPU_SESSION_FAKE_GTEST_NP1 / _NP2 (chosen by the
# world size) = LISTED:CASES:SKIPPED:FAILURES (default 25:25:1:0), or noxml (writes none).
fake_gtest() {
  local np=${GPU_SESSION_FAKE_NP:-${OMPI_COMM_WORLD_SIZE:-1}} var spec listed cases skipped failures i xml r
  var="GPU_SESSION_FAKE_GTEST_NP$np"
  spec=${!var:-25:25:1:0}
  [[ $spec == noxml ]] && listed=25 || IFS=: read -r listed cases skipped failures <<<"$spec"
  if [[ ${1:-} == --gtest_list_tests ]]; then
    ((listed > 0)) && echo "FakeSuite."
    for ((i = 0; i < listed; i++)); do echo "  Case$i"; done
    return 0
  fi
  sleep "${GPU_SESSION_FAKE_SLEEP:-0.1}"
  if [[ $spec == noxml ]]; then echo "[  PASSED  ] 25 tests (fake, no XML)"; return 0; fi
  echo "[==========] Running $cases tests from 1 test suite. (fake, rank ${OMPI_COMM_WORLD_RANK:-0})"
  xml=${GTEST_OUTPUT#xml:}
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites tests=\"$cases\" failures=\"$failures\" disabled=\"0\" errors=\"0\" name=\"AllTests\">"
    echo "  <testsuite name=\"FakeSuite\" tests=\"$cases\" failures=\"$failures\" skipped=\"$skipped\">"
    for ((i = 0; i < cases; i++)); do
      r=completed
      ((i < skipped)) && r=skipped
      if ((i >= cases - failures)); then
        echo "    <testcase name=\"Case$i\" status=\"run\" result=\"$r\" classname=\"FakeSuite\"><failure message=\"fake\" type=\"\"/></testcase>"
      elif [[ $r == skipped ]]; then
        echo "    <testcase name=\"Case$i\" status=\"run\" result=\"skipped\" classname=\"FakeSuite\"><skipped message=\"fake\"/></testcase>"
      else
        echo "    <testcase name=\"Case$i\" status=\"run\" result=\"completed\" classname=\"FakeSuite\"/>"
      fi
    done
    echo "  </testsuite>"
    echo "</testsuites>"
  } >"$xml"
  if ((failures > 0)); then echo "[  FAILED  ] $failures tests (fake)"; return 1; fi
  echo "[  PASSED  ] $((cases - skipped)) tests. (fake)"
  ((skipped > 0)) && echo "[  SKIPPED ] $skipped tests (fake)"
  return 0
}

fake_mpirun() {  # fake-mpirun [-np N] [options] CMD...: N copies of CMD with OMPI_COMM_WORLD_* set
  local np=1 r rc=0
  local -a pids=()
  while (($#)); do
    case $1 in
      -np) np=$2; shift 2 ;;
      -x) shift 2 ;;
      --mca) shift 3 ;;
      -*) shift ;;
      *) break ;;
    esac
  done
  for ((r = 0; r < np; r++)); do
    OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=$np "$@" &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=$?; done
  return $rc
}

# ---- here: plan, order, record, pack, fetch ---------------------------------------------------
steps_table() {
  local s
  for s in "${SETUP_STEPS[@]}" "${TEST_STEPS[@]}" "${BENCH_STEPS[@]}" "${PROFILE_STEPS[@]}"; do
    printf '%s %s %s %s\n' "$s" "${KIND[$s]:-}" "${LIMIT[$s]}" "${MIN[$s]}"
  done
}

sum_limits() {  # sum_limits STEP...: "TOTAL|a 10 + b 20"
  local s total=0 parts=""
  for s; do total=$((total + LIMIT[$s])); parts+="${parts:+ + }$s ${LIMIT[$s]}"; done
  echo "$total|$parts"
}

plan() {
  local fails=0 must must_parts second second_parts avail1 avail2 total1 total2 s tier date h n=0 bsum
  check_limits || return 1
  IFS='|' read -r must must_parts <<<"$(sum_limits gpuinfo unpack prebuilt configure build test_np1 test_np2)"
  IFS='|' read -r second second_parts <<<"$(sum_limits gpuinfo unpack prebuilt)"
  avail1=$((DEADLINE_S - RESERVE_S)) avail2=$((SECOND_S - RESERVE_S))
  echo "here, once: bash cluster/gpu_session.sh fetch   (.deps/: the Debian packages the GPU machine lacks)"
  echo "here, optional: bash cluster/gpu_session.sh pack   (.gpu-build/prebuilt.tgz: the device then skips configure and build)"
  echo "machine start: $START_S s (each command that finds no warm machine)"
  printf 'command 1: OUT=$OUT bash cluster/gpu_session.sh run | carry %s | timeout_s %d | worst %d s\n' \
    "$CARRY" "$CALL_LIMIT_S" "$DEADLINE_S"
  echo "  one deadline of $DEADLINE_S s: each step gets min(its limit, the time left less $RESERVE_S s);" \
    "a step that cannot get its minimum is SKIPPED"
  echo "  build and GPU tests, worst case $must s of $avail1 s ($must_parts; the prebuilt refused after its whole limit)"
  if ((DEADLINE_S > COMMAND_MAX_S)); then
    echo "  ERROR: the deadline $DEADLINE_S s is over the $COMMAND_MAX_S s a command may plan for (the tool kills at $CALL_LIMIT_S s)"
    fails=1
  fi
  if ((must > avail1)); then
    echo "  ERROR: build and tests can take $must s, over the $avail1 s the deadline leaves: the tests could be skipped"
    fails=1
  fi
  echo "  then the benchmark steps in this order (${RECORD#"$ROOT/"}), each while it can get its minimum:"
  bsum=0
  while read -r s tier date h; do
    n=$((n + 1))
    bsum=$((bsum + LIMIT[$s]))
    printf '    %2d. %-16s %-30s limit %3d s, minimum %3d s\n' "$n" "$s" "$(tier_text "$tier" "$date")" "${LIMIT[$s]}" "${MIN[$s]}"
  done < <(bench_order)
  echo "  (their limits add up to $bsum s: what does not fit is SKIPPED, and the summary names the second command)"
  printf 'command 2, optional: OUT=$OUT bash cluster/gpu_session.sh rest STEP... | carry %s | timeout_s %d | worst %d s\n' \
    "$CARRY" "$((SECOND_S + 30))" "$SECOND_S"
  echo "  only when command 1 skipped steps and budget_left_s >= $((START_S + SECOND_S + 15)) s; needs a build in" \
    ".gpu-build/prebuilt.tgz (pack's, or command 1's \$OUT/prebuilt.tgz): its setup, worst case $second s of $avail2 s ($second_parts)"
  if ((SECOND_S > COMMAND_MAX_S)); then
    echo "  ERROR: the second deadline $SECOND_S s is over $COMMAND_MAX_S s"
    fails=1
  fi
  if ((second >= avail2)); then
    echo "  ERROR: its setup can take $second s of the $avail2 s it has: no step would run"
    fails=1
  fi
  total1=$((START_S + DEADLINE_S))
  total2=$((total1 + START_S + SECOND_S))
  echo "session: start $START_S + command 1 $DEADLINE_S = $total1 s of $SESSION_S s; with command 2: + start $START_S + $SECOND_S = $total2 s of $SESSION_S s"
  if ((total2 > SESSION_S)); then
    echo "ERROR: the session's worst case $total2 s is over the $SESSION_S s of device time"
    fails=1
  fi
  echo "then: give_back at once (a warm machine's idle time counts); here: bash cluster/gpu_session.sh record DIR (DIR: the fetched \$OUT)"
  return $fails
}

order() {
  local s tier date h
  load_record
  printf '%-16s %-30s %-16s %s\n' step priority "hash now" "recorded hash"
  while read -r s tier date h; do
    printf '%-16s %-30s %-16s %s\n' "$s" "$(tier_text "$tier" "$date")" "$h" "${REC_HASH[$s]:--}"
  done < <(bench_order)
}

# record DIR: the benchmark steps that succeeded in DIR/results.tsv (a fetched $OUT) become the
# newest figures of docs/gpu/measured.tsv (their date, commit, hash and seconds).
record() {
  local dir=$1 res s kind status secs hash date commit head updated=() others=()
  res="$dir/results.tsv"
  [[ -r $res ]] || { echo "gpu_session.sh record: no $res (the fetched \$OUT of a run)" >&2; return 2; }
  load_record
  head=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')
  while IFS=$'\t' read -r s kind status secs hash date commit; do
    [[ -z $s || $s == \#* || $kind != bench ]] && continue
    if [[ $status != ok || $hash == - || -z $hash ]]; then
      others+=("$s ($status)")
      continue
    fi
    # No .git on the device: the commit checked out here stands in (the hash is the identity).
    [[ -z $commit || $commit == '?' ]] && commit=$head
    REC_DATE[$s]=$date REC_COMMIT[$s]=$commit REC_HASH[$s]=$hash REC_SECS[$s]=$secs
    updated+=("$s")
  done <"$res"
  mkdir -p "$(dirname "$RECORD")"
  {
    echo "# The benchmark steps of cluster/gpu_session.sh and when each was last measured on the GPU machine."
    echo "# step, UTC date, commit, hash of the step's command and sources (gpu_session.sh order shows today's), seconds."
    echo "# A step without a line was never measured; the next run takes those first, then the changed ones,"
    echo "# then the oldest. Written by: bash cluster/gpu_session.sh record DIR (DIR: a session's fetched \$OUT)."
    for s in "${BENCH_STEPS[@]}"; do
      [[ -n ${REC_DATE[$s]:-} ]] || continue
      printf '%s\t%s\t%s\t%s\t%s\n' "$s" "${REC_DATE[$s]}" "${REC_COMMIT[$s]}" "${REC_HASH[$s]}" "${REC_SECS[$s]}"
    done
  } >"$RECORD.tmp" && mv -f "$RECORD.tmp" "$RECORD"
  say "recorded ${#updated[@]} step(s) in ${RECORD#"$ROOT/"}: ${updated[*]:-none}"
  ((${#others[@]})) && say "not recorded (no figure): ${others[*]}"
  [[ -r $dir/prebuilt.tgz ]] && say "for a second command: cp $dir/prebuilt.tgz .gpu-build/"
  return 0
}

carried_bytes() {  # what would travel: the working tree (tracked + untracked, not ignored) + .deps + .gpu-build
  local tree deps gb
  tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  deps=$(du -sb "$ROOT/.deps" 2>/dev/null | cut -f1)
  gb=$(du -sb "$(dirname "$PREBUILT")" 2>/dev/null | cut -f1)
  echo "${tree:-0} ${deps:-0} ${gb:-0}"
}

# pack [--jobs=N]: the GPU targets built HERE (build-gpu-pack/, CUDA and NCCL ON, .venv's torch:
# the same torch 2.11 cu130 wheel as the device's) into .gpu-build/prebuilt.tgz. Refused (exit 1,
# no archive) when the carried total would pass 64 MiB. GPU_SESSION_FAKE=1: fake binaries of
# GPU_SESSION_FAKE_PACK_KB KiB instead of the build (the tests).
pack() {
  local jobs=${DTRAIN_BUILD_JOBS:-$(nproc)} arg py="$ROOT/.venv/bin/python" bytes tree deps gb total old=0 i
  for arg; do
    case $arg in
      --jobs=*) jobs=${arg#--jobs=} ;;
      *) echo "gpu_session.sh pack: unknown argument '$arg' (usage: pack [--jobs=N])" >&2; return 2 ;;
    esac
  done
  [[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "gpu_session.sh pack: --jobs must be a positive integer, not '$jobs'" >&2; return 2; }
  cd "$ROOT" || return 1
  if ((FAKE)); then
    rm -rf "$PACK_BUILD" && mkdir -p "$PACK_BUILD/bin" "$PACK_BUILD/lib"
    for i in "${BUILD_TARGETS[@]}"; do echo "fake $i" >"$PACK_BUILD/bin/$i"; done
    head -c $((${GPU_SESSION_FAKE_PACK_KB:-64} << 10)) /dev/urandom >"$PACK_BUILD/lib/libdtrain_fake.so"
  else
    if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
      say "ERROR: $py has no CUDA torch: run 'bash cluster/setup.sh' (the torch 2.11 cu130 wheel the device has)"
      return 1
    fi
    mkdir -p "$PACK_BUILD"
    if [[ ! -f $PACK_BUILD/build.ninja ]]; then
      say "configuring $PACK_BUILD (CUDA and NCCL ON)"
      cmake -S . -B "$PACK_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON \
        -DDTRAIN_PYTHON="$py" >"$PACK_BUILD/configure.log" 2>&1 || {
        tail -30 "$PACK_BUILD/configure.log"
        say "ERROR: configure failed (log: $PACK_BUILD/configure.log)"
        return 1
      }
    fi
    check_configure "$PACK_BUILD/configure.log" || return 1
    say "building ${BUILD_TARGETS[*]} with $jobs jobs"
    cmake --build "$PACK_BUILD" -j "$jobs" --target "${BUILD_TARGETS[@]}" || { say "ERROR: the build failed"; return 1; }
  fi
  mkdir -p "$(dirname "$PREBUILT")"
  bytes=$(archive_build "$PACK_BUILD" "$PREBUILT" "$py") || { rm -f "$PREBUILT.tmp"; say "ERROR: packing failed"; return 1; }
  [[ -e $PREBUILT ]] && old=$(stat -c %s "$PREBUILT")
  read -r tree deps gb <<<"$(carried_bytes)"
  # .gpu-build as it will be: the new archive instead of the old one and the .tmp.
  total=$((tree + deps + gb - old - bytes + bytes))
  say "prebuilt.tgz: $((bytes >> 10)) KiB; carried: tree $((tree >> 10)) KiB + .deps $((deps >> 10)) KiB +" \
    ".gpu-build $(((gb - old) >> 10)) KiB = $((total >> 10)) KiB of $((CARRY_BYTES_MAX >> 10)) KiB"
  if ((total > CARRY_BYTES_MAX)); then
    rm -f "$PREBUILT.tmp"
    say "ERROR: refused: the carried total $((total >> 10)) KiB would exceed $((CARRY_BYTES_MAX >> 10)) KiB" \
      "(the device tool refuses a larger tree); nothing written"
    return 1
  fi
  mv -f "$PREBUILT.tmp" "$PREBUILT"
  say "wrote ${PREBUILT#"$ROOT/"} ($((bytes >> 10)) KiB); carry $CARRY"
}

fetch() {
  mkdir -p "$ROOT/.deps"
  (cd "$ROOT/.deps" && apt-get download "${PACKAGES[@]}") || {
    say "ERROR: apt-get download failed (run 'apt-get update' first?)"
    exit 1
  }
  say "downloaded $(ls "$ROOT"/.deps/*.deb | wc -l) packages into .deps/ ($(du -sh "$ROOT/.deps" | cut -f1))"
}

# ---- the command line ---------------------------------------------------------------------------
usage() {
  echo "usage: gpu_session.sh fetch | pack [--jobs=N] | plan | order | record DIR | steps" >&2
  echo "       OUT=DIR gpu_session.sh run [--only=STEP,...] | rest [STEP...] | profile" >&2
  echo "       gpu_session.sh check-configure CONFIGURE_LOG" >&2
}
check_benches() {  # check_benches STEP...: each a benchmark step
  local s
  for s; do [[ ${KIND[$s]:-} == bench ]] || die "'$s' is no benchmark step (steps: ${BENCH_STEPS[*]})"; done
}
ONLY=() ONLY_GIVEN=0
case "${1:-}" in
  fetch) fetch ;;
  pack) shift; pack "$@" ;;
  plan) plan ;;
  order) order ;;
  steps) steps_table ;;
  record)
    [[ $# -eq 2 ]] || { echo "usage: gpu_session.sh record DIR (the fetched \$OUT of a session)" >&2; exit 2; }
    record "$2"
    ;;
  check-configure)
    [[ $# -eq 2 ]] || { echo "usage: gpu_session.sh check-configure CONFIGURE_LOG" >&2; exit 2; }
    check_configure "$2"
    ;;
  run | rest | profile)
    mode=$1
    shift
    for a; do
      case $mode/$a in
        run/--only=*) IFS=, read -ra ONLY <<<"${a#--only=}"; ONLY_GIVEN=1 ;;
        rest/-*) die "rest takes step names, not '$a'" ;;
        rest/*) ONLY+=("$a") ;;
        *) usage; exit 2 ;;
      esac
    done
    ((${#ONLY[@]})) && check_benches "${ONLY[@]}"
    check_limits || exit 1
    session "$mode"
    ;;
  # Internal: the bounded commands of some steps, and the fakes.
  gtest-run) shift; gtest_run "$@" ;;
  save-build) shift; save_build "$@" ;;
  prebuilt-check) shift; prebuilt_check "$@" ;;
  source-hash) source_hash ;;
  fake-step) fake_step "$2" ;;
  fake-gtest) shift; fake_gtest "$@" ;;
  fake-mpirun) shift; fake_mpirun "$@" ;;
  *) usage; exit 2 ;;
esac
