#!/usr/bin/env bash
# gpu_session.sh check-configure accepts a configure log only when it says CUDA ON and NCCL ON:
# a GPU session that built without them would skip every GPU test and look green.
# usage: gpu_session_configure_check.sh PATH/TO/cluster/gpu_session.sh
set -uo pipefail
script=${1:?usage: gpu_session_configure_check.sh GPU_SESSION_SH}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0

# expect NAME CODE REGEX LOG: check-configure LOG exits CODE and its output matches REGEX.
expect() {
  local name=$1 code=$2 regex=$3 log=$4 out rc
  out=$(bash "$script" check-configure "$log" 2>&1)
  rc=$?
  if [[ $rc -ne $code ]]; then
    echo "FAIL $name: exit $rc, expected $code; output: $out"
    fails=$((fails + 1))
  elif ! grep -qE -- "$regex" <<<"$out"; then
    echo "FAIL $name: output does not match '$regex': $out"
    fails=$((fails + 1))
  else
    echo "ok   $name (exit $rc)"
  fi
}

log() {  # log NAME LINE...: a fake configure log
  local f="$tmp/$1.log"
  shift
  { echo "-- The CXX compiler identification is GNU 13.3.0"; printf '%s\n' "$@"; echo "-- Configuring done"; } >"$f"
  echo "$f"
}

expect both_off 3 'DDTRAIN_WITH_CUDA=ON' "$(log off '-- dtrain: CUDA code paths OFF, NCCL backend OFF')"
expect nccl_off 3 'DDTRAIN_WITH_NCCL=ON' "$(log nccl_off '-- dtrain: CUDA code paths ON, NCCL backend OFF')"
expect both_on 0 'CUDA code paths ON, NCCL backend ON' "$(log on '-- dtrain: CUDA code paths ON, NCCL backend ON')"
expect no_summary 3 'no .dtrain: CUDA code paths' "$(log none '-- dtrain: torch 2.11.0+cu130 at /opt/torch')"
# A reconfigure appends to the log: the last summary decides.
expect last_line_wins 3 'DDTRAIN_WITH_CUDA=ON' "$(log twice '-- dtrain: CUDA code paths ON, NCCL backend ON' \
  '-- dtrain: CUDA code paths OFF, NCCL backend OFF')"
expect missing_log 3 'cannot read' "$tmp/no-such.log"

# This checkout's own configure log, when there is one: accepted exactly when its summary says ON/ON
# (a CPU-only torch or a machine without the CUDA toolkit prints OFF and must be refused).
real="$(cd "$(dirname "$script")/.." && pwd)/.cmake-configure.log"
if [[ -r $real ]]; then
  if grep -q 'dtrain: CUDA code paths ON, NCCL backend ON' "$real"; then
    expect real_log 0 'NCCL backend ON' "$real"
  else
    expect real_log 3 'DDTRAIN_WITH_(CUDA|NCCL)=ON' "$real"
  fi
fi

((fails == 0)) || { echo "$fails check(s) failed"; exit 1; }
echo "all checks passed"
