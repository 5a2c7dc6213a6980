#!/usr/bin/env bash
# Failures with real training: a job started by dtrain-run (mpirun); once its output matches
# --after, one rank (the process whose environment has OMPI_COMM_WORLD_RANK=VICTIM, with any
# children of its own) gets SIGSTOP or SIGKILL. The job must then end within --within seconds,
# with a non-zero exit status, and its output must match every --expect regex (grep -E, per
# line); --order A B: some line matching A comes before the first line matching B.
#
# usage: fault_test.sh --signal STOP|KILL --victim RANK --within SECONDS --after REGEX
#                      [--expect REGEX]... [--order REGEX_A REGEX_B]... [--launch-arg ARG]...
#                      -- PROGRAM [ARGS...]
# dtrain-run gets the --launch-arg arguments (e.g. -np 2 --oversubscribe) before '--'.
# Environment: DTRAIN_RUN (dtrain-run's path; default build/bin/dtrain-run).
# Whatever happens, every process of the job is continued and killed on exit.
set -uo pipefail
# shellcheck source=tests/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # DTRAIN_RUN, wait_for_output
START_TIMEOUT_S=90  # for the job to start and match --after

signal="" victim="" within="" after=""
expects=() orders=() launch=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  case "$1" in
    --signal) signal="$2"; shift 2 ;;
    --victim) victim="$2"; shift 2 ;;
    --within) within="$2"; shift 2 ;;
    --after) after="$2"; shift 2 ;;
    --expect) expects+=("$2"); shift 2 ;;
    --order) orders+=("$2" "$3"); shift 3 ;;
    --launch-arg) launch+=("$2"); shift 2 ;;
    *) echo "fault_test.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ ${1:-} == "--" ]] && shift
if [[ $# -eq 0 || ! $signal =~ ^(STOP|KILL)$ || ! $victim =~ ^[0-9]+$ || ! $within =~ ^[0-9]+$ ||
      -z $after ]]; then
  echo "usage: fault_test.sh --signal STOP|KILL --victim RANK --within SECONDS --after REGEX" \
       "[--expect REGEX]... [--order A B]... [--launch-arg ARG]... -- PROGRAM [ARGS...]" >&2
  exit 2
fi

OUT="$(mktemp /tmp/dtrain-fault-XXXXXX.out)"
job_pid=""
rank_pids=()  # every rank process seen (and their children), for the clean-up

descendants() {  # all processes below $1
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}
world_rank_of() {  # OMPI_COMM_WORLD_RANK in the environment of process $1 ("" if none)
  tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p'
}
cleanup() {
  local p
  if [[ -n $job_pid ]]; then
    while read -r p; do rank_pids+=("$p"); done < <(descendants "$job_pid")
  fi
  for p in "${rank_pids[@]}"; do kill -CONT "$p" 2>/dev/null; done
  for p in "${rank_pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  [[ -n $job_pid ]] && kill -KILL "$job_pid" 2>/dev/null
  rm -f "$OUT"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() {
  echo "FAIL: $*"
  echo "--- output"
  cat "$OUT"
  exit 1
}

"$DTRAIN_RUN" "${launch[@]}" -- "$@" > "$OUT" 2>&1 &
job_pid=$!  # dtrain-run execs mpirun; the ranks are below it
wait_for_output "$after" "$OUT" "$START_TIMEOUT_S" "$job_pid"

targets=()
for p in $(descendants "$job_pid"); do
  rank="$(world_rank_of "$p")"
  [[ -n $rank ]] && rank_pids+=("$p")
  [[ $rank == "$victim" ]] && targets+=("$p")
done
[[ ${#targets[@]} -gt 0 ]] || fail "no process of the job has OMPI_COMM_WORLD_RANK=$victim"

t0=$(date +%s%N)
kill "-$signal" "${targets[@]}" || fail "cannot send SIG$signal to rank $victim (${targets[*]})"
echo "[test] SIG$signal sent to rank $victim (pid ${targets[*]})"
limit_ns=$((within * 1000000000))
while kill -0 "$job_pid" 2>/dev/null; do
  (($(date +%s%N) - t0 <= limit_ns)) || fail "the job was still running ${within} s after SIG$signal"
  sleep 0.1
done
wait "$job_pid"
status=$?
job_pid=""
elapsed_ms=$((($(date +%s%N) - t0) / 1000000))
echo "[test] the job ended $((elapsed_ms / 1000)).$(printf '%03d' $((elapsed_ms % 1000))) s after SIG$signal with status $status"

[[ $status -ne 0 ]] || fail "the job exited with status 0 after rank $victim got SIG$signal"
for re in "${expects[@]}"; do
  grep -Eq -- "$re" "$OUT" || fail "no output line matches /$re/"
done
for ((i = 0; i < ${#orders[@]}; i += 2)); do
  first_a=$(grep -Enm1 -- "${orders[i]}" "$OUT" | cut -d: -f1)
  first_b=$(grep -Enm1 -- "${orders[i + 1]}" "$OUT" | cut -d: -f1)
  [[ -n $first_a && -n $first_b && $first_a -lt $first_b ]] ||
    fail "no line matching /${orders[i]}/ comes before the first line matching /${orders[i + 1]}/"
done
echo "--- stall and timeout lines"
grep -E "collective (stall|timeout)|exited on signal|noticed" "$OUT"
echo "[test] passed"
