#!/usr/bin/env bash
# Submits a real batch job to a private single-node Slurm (cluster/slurm/testbed.sh) and checks
# its output. The test bed is started here and stopped on exit, whatever happens.
#
# usage: slurm_test.sh [options] -- PROGRAM [ARGS...]
#   --template FILE     batch script (default: cluster/slurm/train.sbatch), given PROGRAM ARGS
#   --sbatch-arg ARG    an sbatch option (repeatable), e.g. --ntasks-per-node=2
#   --expect REGEX      the job's output must match this extended regex (repeatable; '^'/'$'
#                       anchor lines)
#   --preempt-at REGEX  once the output matches, send SIGUSR1 to the batch script as Slurm's
#                       --signal=B:USR1@... does; the job must be requeued once and complete
#   --compare REGEX     also run an uninterrupted job; the parts of lines matching REGEX must be
#                       the same in both (e.g. '^step [0-9]+ loss' for the loss curve)
# In ARGS, @WORK@ stands for a fresh directory of each job (e.g. --save_dir=@WORK@/ckpt).
#
# Environment: DTRAIN_RUN (dtrain-run's path; default build/bin/dtrain-run).
# Exit status: 0 passed, 1 failed, 77 skipped (no Slurm test bed here; the reason is printed).
set -uo pipefail
# shellcheck source=tests/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, DTRAIN_RUN, start_testbed, wait_for_output
TESTBED="$ROOT/cluster/slurm/testbed.sh"
TEMPLATE="$ROOT/cluster/slurm/train.sbatch"
JOB_TIMEOUT_S=90
export DTRAIN_RUN  # train.sbatch launches through it

sbatch_args=()
expects=()
preempt_at=""
compare=""
while [[ $# -gt 0 && $1 != "--" ]]; do
  case "$1" in
    --template) TEMPLATE="$2"; shift 2 ;;
    --sbatch-arg) sbatch_args+=("$2"); shift 2 ;;
    --expect) expects+=("$2"); shift 2 ;;
    --preempt-at) preempt_at="$2"; shift 2 ;;
    --compare) compare="$2"; shift 2 ;;
    *) echo "slurm_test.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ ${1:-} == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "usage: slurm_test.sh [options] -- PROGRAM [ARGS...]" >&2; exit 2; }

# A test bed of our own: its own directory and ports, so a developer's is left alone.
export DTRAIN_SLURM_DIR="/tmp/dtrain-slurm-test-$$"
export DTRAIN_SLURM_CTLD_PORT=$((20000 + ($$ % 10000) * 2))
export DTRAIN_SLURM_SLURMD_PORT=$((DTRAIN_SLURM_CTLD_PORT + 1))
WORK="$(mktemp -d /tmp/dtrain-slurm-job-XXXXXX)"
cleanup() {
  bash "$TESTBED" stop >/dev/null 2>&1
  rm -rf "$WORK"
}
trap cleanup EXIT

started=$SECONDS
start_testbed "$TESTBED" Slurm
eval "$(bash "$TESTBED" env)"
echo "[test] test bed up in $((SECONDS - started)) s"

fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.out; do [[ -f $f ]] && { echo "--- $f"; cat "$f"; }; done
  for log in slurmctld slurmd; do
    echo "--- $log.log (tail)"
    tail -n 25 "$DTRAIN_SLURM_DIR/log/$log.log" 2>/dev/null
  done
  exit 1
}

job_field() { scontrol show job "$1" 2>/dev/null | grep -o "$2=[^ ]*" | head -n 1 | cut -d= -f2; }

# Waits until job $1 has ended. A requeued job is held for two minutes (Reason=BeginTime, the
# life of the revoked job credential); here the hold is lifted 2 s after the node is idle again
# (slurmd refuses a job started within the second its credential was revoked).
wait_job() {
  local id=$1 deadline=$((SECONDS + JOB_TIMEOUT_S)) state idle_since=-1
  while ((SECONDS < deadline)); do
    state="$(job_field "$id" JobState)"
    case "$state" in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE)
        return 0 ;;
      PENDING)
        if [[ $(job_field "$id" Reason) == BeginTime &&
              $(sinfo -h -n localhost -o %t 2>/dev/null) == idle ]]; then
          ((idle_since < 0)) && idle_since=$SECONDS
          if ((SECONDS - idle_since >= 2)); then
            scontrol update JobId="$id" StartTime=now >/dev/null 2>&1
          fi
        fi ;;
      *) idle_since=-1 ;;
    esac
    sleep 0.3
  done
  scancel "$id" 2>/dev/null
  fail "job $id did not end within ${JOB_TIMEOUT_S} s (state ${state:-unknown})"
}

# Submits the template with PROGRAM ARGS (@WORK@ -> a fresh directory); prints the job id.
submit() {
  local name=$1
  shift
  mkdir -p "$WORK/$name"
  local args=()
  for a in "$@"; do args+=("${a//@WORK@/$WORK/$name}"); done
  sbatch --parsable --job-name="dtrain-test-$name" --output="$WORK/$name.out" \
    --chdir="$ROOT" "${sbatch_args[@]}" "$TEMPLATE" "${args[@]}"
}

check_completed() {
  local id=$1 name=$2
  [[ $(job_field "$id" JobState) == COMPLETED && $(job_field "$id" ExitCode) == 0:0 ]] ||
    fail "job $id ($name) ended $(job_field "$id" JobState) with exit code $(job_field "$id" ExitCode)"
}

id="$(submit main "$@")" || fail "sbatch refused the job"
echo "[test] submitted job $id: $TEMPLATE $*"
if [[ -n $preempt_at ]]; then
  wait_for_output "$preempt_at" "$WORK/main.out" "$JOB_TIMEOUT_S"
  # What --signal=B:USR1@120 does at the time limit: SIGUSR1 to the batch shell only.
  scancel --signal=USR1 --batch "$id" || fail "scancel --signal=USR1 --batch $id failed"
  echo "[test] sent SIGUSR1 to the batch script of job $id"
fi
wait_job "$id"
check_completed "$id" main
if [[ -n $preempt_at && $(job_field "$id" Restarts) != 1 ]]; then
  fail "job $id was restarted $(job_field "$id" Restarts) times, expected 1"
fi
output="$(cat "$WORK/main.out")"
echo "--- job $id output"
echo "$output"
for regex in "${expects[@]}"; do
  grep -Eq -- "$regex" <<< "$output" || fail "the output of job $id does not match /$regex/"
done

if [[ -n $compare ]]; then
  ref="$(submit reference "$@")" || fail "sbatch refused the reference job"
  echo "[test] reference job $ref submitted at $((SECONDS - started)) s"
  wait_job "$ref"
  check_completed "$ref" reference
  grep -Eq -- "$compare" "$WORK/reference.out" || fail "no line of the reference job matches /$compare/"
  diff <(grep -oE -- "$compare" "$WORK/reference.out") <(grep -oE -- "$compare" "$WORK/main.out") ||
    fail "lines /$compare/ differ between the uninterrupted job (<) and job $id (>)"
  echo "[test] $(grep -cE -- "$compare" "$WORK/main.out") lines /$compare/ equal an uninterrupted job's"
fi
echo "[test] passed in $((SECONDS - started)) s"
