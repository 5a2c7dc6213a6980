# shellcheck shell=bash
# What the cluster tests' scripts share (they source it): where the checkout and dtrain-run are,
# starting a test bed, waiting for a job's output. A script that waits defines fail MESSAGE
# (print what it has, exit 1) first.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DTRAIN_RUN="${DTRAIN_RUN:-$ROOT/build/bin/dtrain-run}"  # one given in the environment wins

# start_testbed SCRIPT WHAT: `bash SCRIPT start` (cluster/*/testbed.sh, stopped by the caller's
# EXIT trap). Ends the test with 77 (skipped) where this machine cannot hold a WHAT test bed (the
# script printed why), with 1 where it did not start.
start_testbed() {
  bash "$1" start
  case $? in
    0) ;;
    77) echo "SKIP: no $2 test bed on this machine (reason above)"; exit 77 ;;
    *) echo "FAIL: the $2 test bed did not start"; exit 1 ;;
  esac
}

# wait_for_output REGEX FILE SECONDS [PID]: returns once a line of FILE matches REGEX (grep -E);
# fails after SECONDS, or as soon as PID (the job, when given) has ended without such a line.
wait_for_output() {
  local regex=$1 file=$2 deadline=$((SECONDS + $3)) pid=${4:-}
  until grep -Eq -- "$regex" "$file" 2>/dev/null; do
    ((SECONDS < deadline)) || fail "the output never matched /$regex/"
    [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null || fail "the job ended before its output matched /$regex/"
    sleep 0.1
  done
}
