#!/usr/bin/env bash
# Preemption without Slurm: a job started by dtrain-run (mpirun) gets SIGUSR1, as a scheduler
# would send it; every rank finishes its step, the checkpoint is saved and the job exits 85;
# the same command with RESUME_FLAG resumes and finishes. The lines matching COMPARE must
# equal those of an uninterrupted run.
#
# usage: preempt_test.sh --preempt-at REGEX --compare REGEX [--resume-flag FLAG]
#                        [--launch-arg ARG]... -- PROGRAM [ARGS...]
# dtrain-run gets the --launch-arg arguments (e.g. -np 2) before '--'. In ARGS, @WORK@ is
# a fresh directory per run (the interrupted and resumed runs share one).
# Environment: DTRAIN_RUN (dtrain-run's path; default build/bin/dtrain-run).
set -uo pipefail
# shellcheck source=tests/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # DTRAIN_RUN, wait_for_output
RUN_TIMEOUT_S=60

preempt_at=""
compare=""
resume_flag="--resume=yes"
launch=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  case "$1" in
    --preempt-at) preempt_at="$2"; shift 2 ;;
    --compare) compare="$2"; shift 2 ;;
    --resume-flag) resume_flag="$2"; shift 2 ;;
    --launch-arg) launch+=("$2"); shift 2 ;;
    *) echo "preempt_test.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ ${1:-} == "--" ]] && shift
[[ $# -gt 0 && -n $preempt_at && -n $compare ]] ||
  { echo "usage: preempt_test.sh --preempt-at REGEX --compare REGEX -- PROGRAM [ARGS...]" >&2; exit 2; }

WORK="$(mktemp -d /tmp/dtrain-preempt-XXXXXX)"
job_pid=""
cleanup() {
  [[ -n $job_pid ]] && kill -KILL "$job_pid" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.out; do [[ -f $f ]] && { echo "--- $f"; cat "$f"; }; done
  exit 1
}
command_for() {  # the job's argv with @WORK@ replaced, into the array `cmd`
  cmd=("$DTRAIN_RUN" "${launch[@]}" --)
  for a in "${@:2}"; do cmd+=("${a//@WORK@/$WORK/$1}"); done
}

command_for reference "$@"
timeout "$RUN_TIMEOUT_S" "${cmd[@]}" > "$WORK/reference.out" 2>&1 ||
  fail "the uninterrupted run exited with status $?"

command_for job "$@"
timeout "$RUN_TIMEOUT_S" "${cmd[@]}" > "$WORK/preempted.out" 2>&1 &
job_pid=$!  # dtrain-run execs mpirun, which forwards SIGUSR1 to every rank
wait_for_output "$preempt_at" "$WORK/preempted.out" "$RUN_TIMEOUT_S" "$job_pid"
# timeout(1) runs the job as its child: signal the job itself.
kill -USR1 "$(pgrep -P "$job_pid" | head -n 1)" || fail "cannot signal the job"
wait "$job_pid"
status=$?
job_pid=""
[[ $status -eq 85 ]] || fail "the preempted run exited with status $status, expected 85"
echo "[test] preempted run exited 85"

command_for job "$@" "$resume_flag"
timeout "$RUN_TIMEOUT_S" "${cmd[@]}" > "$WORK/resumed.out" 2>&1 || fail "the resumed run exited with status $?"
cat "$WORK/preempted.out" "$WORK/resumed.out" > "$WORK/both.out"
grep -Eq -- "$compare" "$WORK/reference.out" || fail "no line of the uninterrupted run matches /$compare/"
diff <(grep -oE -- "$compare" "$WORK/reference.out") <(grep -oE -- "$compare" "$WORK/both.out") ||
  fail "lines /$compare/ differ between the uninterrupted run (<) and the preempted + resumed one (>)"
cat "$WORK/both.out"
echo "[test] $(grep -cE -- "$compare" "$WORK/both.out") lines /$compare/ equal an uninterrupted run's"
