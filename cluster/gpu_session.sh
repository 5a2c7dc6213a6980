#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
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
NEXT="${GPU_SESSION_NEXT:-$ROOT/docs/gpu/next.txt}"  # steps to run first, one per line (bench_order)
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
BUILD_TARGETS=(dtrain_gpu_tests train_gpt train_seq2seq dtrain-bench dtrain-timeline dtrain-plan)
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
BENCH_STEPS=(s2s gpt124m nccl_allreduce mpi_allreduce cpu_adam host_norm copies offload_layers async_save shard shard3
             offload6b offload6b_bf16 offload_largest offload_opt offload_delayed offload_bf16 pipeline gpt_anchor gpt_graph s2s_graph
             kernels s2s_anchor simulate plan_offload)
PROFILE_STEPS=(profile_gpt profile_s2s profile_layers profile_offload profile_delayed)
# STEP=LIMIT/MIN in seconds. LIMIT: the most a step may take; MIN: below this it is not worth
# starting (SKIPPED). GPU_LIMIT_<step>=S and GPU_MIN_<step>=S override them (the plan sees the
# overrides too). Measured on 2026-11-24 (16 cores): build 91-114 s, gpu.np1 19 s, gpu.mpi.np2 21 s (the
# fused block kernels' GPU tests, 2026-11-28, add an estimated 15-25 s to each, hence 70 and 80 s),
# bench1 (s2s .. shard) 119-134 s, bench2 252-265 s (offload6b about 200 s of it).
declare -A LIMIT=() MIN=()
for _t in gpuinfo=10/5 unpack=20/10 prebuilt=30/15 configure=60/30 build=240/120 save_build=20/10 \
          test_np1=70/30 test_np2=80/35 \
          s2s=100/60 gpt124m=45/25 nccl_allreduce=30/15 mpi_allreduce=45/25 cpu_adam=60/30 host_norm=30/10 copies=25/15 \
          offload_layers=110/40 async_save=40/25 shard=75/50 shard3=70/45 \
          offload6b=280/220 offload6b_bf16=280/200 offload_largest=280/200 offload_opt=70/40 offload_delayed=70/40 offload_bf16=70/40 \
          pipeline=50/35 gpt_anchor=150/90 \
          gpt_graph=170/60 s2s_graph=90/45 kernels=90/40 s2s_anchor=150/90 simulate=90/45 plan_offload=60/30 \
          profile_gpt=80/40 profile_s2s=45/25 profile_layers=45/30 profile_offload=70/45 profile_delayed=70/45; do
  _s=${_t%%=*} _t=${_t#*=}
  LIMIT[$_s]=${_t%/*} MIN[$_s]=${_t#*/}
  _v="GPU_LIMIT_$_s"; [[ -n ${!_v:-} ]] && LIMIT[$_s]=${!_v}
  _v="GPU_MIN_$_s"; [[ -n ${!_v:-} ]] && MIN[$_s]=${!_v}
done
unset _t _s _v

# What a benchmark's figure depends on, for "code changed since its last figure": the text of
# its step_ function (and of the helpers named in HASH_FUNCS) plus the files of these globs
# (relative to the root). The files whose change most likely moves the figure, not everything it
# links: with the whole engine every row would count as changed after any commit.
_gpt="examples/train_gpt.cc engine/models/gpt.cc engine/models/include/dtrain/engine/models/gpt.h engine/models/model_spec.cc engine/models/blocks.cc"
_cpu_opt="offload/src/cpu_*.cc offload/src/cpu_optimizer_impl.h offload/src/kernel*.cc offload/src/kernel*.h offload/src/update_rule.cc offload/src/thread_pool.cc"
_opt_offload="engine/optim/offload*.cc engine/optim/offload*.h offload/src/pinned_pool.cc $_cpu_opt $_gpt"
declare -A HASH_DEPS=(
  [s2s]="tools/techniques.sh examples/train_seq2seq.cc engine/models/seq2seq.cc engine/models/include/dtrain/engine/models/seq2seq.h engine/optim/amp.cc engine/memory/activation_checkpoint.cc"
  [gpt124m]="$_gpt engine/optim/amp.cc engine/parallel/fused_block_ops.cc engine/parallel/cuda/fused_block.cu"
  [nccl_allreduce]="dist/src/nccl_backend.cc dist/src/async.* tools/bench_allreduce.cc"
  [mpi_allreduce]="dist/src/mpi_backend.cc dist/src/mpi_runtime.* dist/src/async.* tools/bench_allreduce.cc"
  [cpu_adam]="$_cpu_opt tools/bench_cpu_adam.cc"
  [host_norm]="engine/parallel/grad_norm.cc tools/bench_cpu_adam.cc"
  [copies]=""
  [offload_layers]="offload/src/layer_offload.cc offload/src/pinned_pool.cc engine/optim/offload*.cc engine/optim/composite_optimizer.cc engine/parallel/grad_norm.cc engine/memory/activation_checkpoint.cc $_gpt"
  [async_save]="engine/state/*.cc engine/state/*.h tools/async_save_bench.py"
  [shard]="engine/optim/sharded_optimizer.cc engine/core/shard.cc engine/parallel/bucket_comm.cc engine/parallel/reducer.cc engine/memory/memory_report.cc $_gpt"
  [shard3]="engine/optim/parameter_units.cc engine/optim/sharded_optimizer.cc engine/optim/offloaded_optimizer.cc engine/core/shard.cc engine/memory/memory_report.cc $_gpt"
  [offload6b]="$_opt_offload"
  [offload_opt]="$_opt_offload"
  [offload_delayed]="$_opt_offload"
  [offload6b_bf16]="$_opt_offload engine/optim/sharded_optimizer.cc"
  [offload_largest]="$_opt_offload engine/optim/sharded_optimizer.cc"
  [offload_bf16]="$_opt_offload"
  [gpt_anchor]="tools/gpt_torch_bench.py tools/zero_torch_bench.py"
  [s2s_anchor]="tools/s2s_torch_bench.py"
  [gpt_graph]="engine/train/cuda/graphed_loss.cc engine/train/trainer.cc engine/parallel/bucket_comm.cc engine/parallel/cuda/*.cu engine/parallel/fused_cross_entropy.cc engine/parallel/fused_block_ops.cc engine/parallel/tensor_parallel.cc $_gpt"
  [s2s_graph]="engine/train/cuda/graphed_loss.cc engine/train/trainer.cc examples/train_seq2seq.cc engine/models/seq2seq.cc engine/parallel/cuda/*.cu engine/parallel/fused_block_ops.cc"
  [kernels]="engine/parallel/cuda/*.cu engine/parallel/fused_cross_entropy.cc engine/parallel/fused_block_ops.cc tools/bench_*.cc engine/models/llama.cc"
  [pipeline]="engine/parallel/pipeline.cc engine/observe/timeline.cc tools/timeline_main.cc $_gpt"
  [simulate]="engine/memory/simulator.cc examples/plan_simulate.cc engine/train/measure_model.cc $_gpt"
  [plan_offload]="engine/memory/planner.cc engine/memory/memory_report.cc examples/plan_main.cc engine/optim/offload*.cc engine/optim/composite_optimizer.cc offload/src/layer_offload.cc $_gpt"
)
declare -A HASH_FUNCS=([shard]=zero_runs [shard3]=zero_runs [offload_opt]=gpt13b [offload_delayed]=gpt13b
                       [offload_bf16]=gpt13b)
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

# The functions, by what they serve, in cluster/gpu_session/ (the device tool carries the working
# tree, so they travel with this script): record.sh (step hashes, the record, the priority order),
# steps.sh (what each step runs), session.sh (the device's environment, the session engine),
# commands.sh (check-configure, the steps' internal commands, the fakes), here.sh (plan, order,
# record, pack, fetch).
LIB="$ROOT/cluster/gpu_session"
for _f in record steps session commands here; do
  [[ -r $LIB/$_f.sh ]] || die "cannot read $LIB/$_f.sh (the script's libraries: copy the folder with it)"
done
unset _f
# shellcheck source=gpu_session/record.sh
source "$LIB/record.sh"
# shellcheck source=gpu_session/steps.sh
source "$LIB/steps.sh"
# shellcheck source=gpu_session/session.sh
source "$LIB/session.sh"
# shellcheck source=gpu_session/commands.sh
source "$LIB/commands.sh"
# shellcheck source=gpu_session/here.sh
source "$LIB/here.sh"

# ---- the command line ---------------------------------------------------------------------------
usage() {
  echo "usage: gpu_session.sh fetch | pack [--jobs=N] | plan | order | record DIR | steps" >&2
  echo "       OUT=DIR gpu_session.sh run [--only=STEP,...] | rest [STEP...] | profile" >&2
  echo "       gpu_session.sh check-configure CONFIGURE_LOG" >&2
}
check_benches() {  # check_benches STEP...: each a benchmark step
  local s
  for s; do
    [[ ${KIND[$s]:-} == bench || ${KIND[$s]:-} == profile ]] ||
      die "'$s' is no benchmark or profile step (steps: ${BENCH_STEPS[*]} ${PROFILE_STEPS[*]})"
  done
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
