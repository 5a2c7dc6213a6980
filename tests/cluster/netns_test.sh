#!/usr/bin/env bash
# Launches a 2-host job with dtrain-run --hostfile across the network-namespace test bed
# (cluster/netns/testbed.sh), made here and removed on exit whatever happens.
#
# usage: netns_test.sh [--expect REGEX]... -- PROGRAM [ARGS...]
# First checks that the two ranks run on the two hosts (`hostname` through the same launch),
# then runs PROGRAM as 2 ranks, one per host, over TCP on the hosts' link only, and checks
# that it exits 0 and its output matches every REGEX (extended; '^'/'$' anchor lines).
#
# Environment: DTRAIN_RUN (dtrain-run's path; default build/bin/dtrain-run).
# Exit status: 0 passed, 1 failed, 77 skipped (namespaces cannot be made here; reason printed).
set -uo pipefail
# shellcheck source=tests/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, DTRAIN_RUN, start_testbed
TESTBED="$ROOT/cluster/netns/testbed.sh"
RUN_TIMEOUT_S=60

expects=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  case "$1" in
    --expect) expects+=("$2"); shift 2 ;;
    *) echo "netns_test.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ ${1:-} == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "usage: netns_test.sh [--expect REGEX]... -- PROGRAM [ARGS...]" >&2; exit 2; }

export DTRAIN_NETNS_ID="t$$"
DIR="/tmp/dtrain-netns-$DTRAIN_NETNS_ID"
trap 'bash "$TESTBED" stop >/dev/null 2>&1' EXIT
started=$SECONDS
start_testbed "$TESTBED" network-namespace

mpirun_args=()
while read -r arg; do mpirun_args+=(--mpirun-arg "$arg"); done < "$DIR/mpirun-args"
# One rank per host; both "hosts" share this machine's cores, so no core binding.
launch=("$DTRAIN_RUN" --hostfile "$DIR/hostfile" -np 2 --gpus-per-node 0 --bind none
        "${mpirun_args[@]}" --)
echo "[test] launch: ${launch[*]}"

hosts="$(timeout "$RUN_TIMEOUT_S" bash "$TESTBED" run "${launch[@]}" hostname 2>&1)"
status=$?
echo "--- hostname on 2 ranks"
echo "$hosts"
[[ $status -eq 0 ]] || { echo "FAIL: the launch of 'hostname' exited with status $status"; exit 1; }
[[ $(sort <<< "$hosts") == $'dtrain-h1\ndtrain-h2' ]] ||
  { echo "FAIL: the 2 ranks did not run on dtrain-h1 and dtrain-h2"; exit 1; }

output="$(timeout "$RUN_TIMEOUT_S" bash "$TESTBED" run "${launch[@]}" "$@" 2>&1)"
status=$?
echo "--- $*"
echo "$output"
[[ $status -eq 0 ]] || { echo "FAIL: exited with status $status"; exit 1; }
for regex in "${expects[@]}"; do
  grep -Eq -- "$regex" <<< "$output" || { echo "FAIL: the output does not match /$regex/"; exit 1; }
done
echo "[test] passed in $((SECONDS - started)) s"
