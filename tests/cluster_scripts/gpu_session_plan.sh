#!/usr/bin/env bash
# gpu_session.sh plan: the session fits the GPU machine's limits (one prepared command of at most
# 570 s whose build and GPU tests fit its deadline; an optional second command whose setup fits
# its own; with a 90 s machine start per command at most 900 s of device time), and plan refuses
# a table that does not fit, exactly at each boundary (GPU_LIMIT_<step>, GPU_MIN_<step> and the
# deadlines overridden: one second under passes, one second over fails).
# usage: gpu_session_plan.sh PATH/TO/cluster/gpu_session.sh
set -uo pipefail
script=${1:?usage: gpu_session_plan.sh GPU_SESSION_SH}
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
unset GPU_SESSION_DEADLINE_S GPU_SESSION_SECOND_S GPU_SESSION_RESERVE_S GPU_SESSION_GRACE_S
for v in $(compgen -v | grep -E '^GPU_(LIMIT|MIN)_'); do unset "$v"; done

out=$(bash "$script" plan 2>&1)
rc=$?
echo "$out"
((rc == 0)) || fail "plan exited $rc"

# command 1: the one command, its carry list, timeout_s and worst case.
read -r timeout1 worst1 < <(sed -nE 's/^command 1: OUT=\$OUT bash cluster\/gpu_session.sh run \| carry \[".deps", ".gpu-build"\] \| timeout_s ([0-9]+) \| worst ([0-9]+) s$/\1 \2/p' <<<"$out")
if [[ -z ${worst1:-} ]]; then
  fail "no 'command 1: OUT=\$OUT bash cluster/gpu_session.sh run | carry [\".deps\", \".gpu-build\"] | timeout_s T | worst W s' line"
else
  ((worst1 <= 570)) || fail "command 1's worst case is $worst1 s (> 570)"
  ((timeout1 <= 600 && timeout1 >= worst1)) || fail "command 1's timeout_s $timeout1 is not within [$worst1, 600]"
fi
[[ $(grep -c '^command ' <<<"$out") == 2 ]] || fail "expected command 1 and the optional command 2"
# Its build and tests within its deadline: "build and GPU tests, worst case M s of A s (...)".
read -r must avail1 < <(sed -nE 's/^  build and GPU tests, worst case ([0-9]+) s of ([0-9]+) s .*/\1 \2/p' <<<"$out")
[[ -n ${must:-} ]] || fail "no 'build and GPU tests, worst case' line"
((${must:-9999} <= ${avail1:-0})) || fail "build and tests $must s > $avail1 s"
for s in gpuinfo unpack prebuilt configure build test_np1 test_np2; do
  grep -qE "^  build and GPU tests, .*(\\(|\\+ )$s [0-9]+[ ;]" <<<"$out" || fail "the build-and-tests line does not count $s"
done
# Every benchmark step listed once, in priority order.
nb=$(grep -cE '^ +[0-9]+\. [a-z0-9_]+ +(first \([^)]*\): )?(never measured|code changed since|measured) ' <<<"$out")
((nb == $(bash "$script" steps | grep -c ' bench '))) || fail "the plan lists $nb benchmark steps"
# command 2 and the second command's setup.
read -r worst2 < <(sed -nE 's/^command 2, optional: OUT=\$OUT bash cluster\/gpu_session.sh rest STEP\.\.\. \| carry \[".deps", ".gpu-build"\] \| timeout_s [0-9]+ \| worst ([0-9]+) s$/\1/p' <<<"$out")
[[ -n ${worst2:-} ]] || fail "no 'command 2, optional: ... rest STEP... | carry ... | worst W s' line"
read -r setup2 avail2 < <(sed -nE 's/.*its setup, worst case ([0-9]+) s of ([0-9]+) s .*/\1 \2/p' <<<"$out")
[[ -n ${setup2:-} ]] || fail "no 'its setup, worst case' line"
# The session: "session: start 90 + command 1 W = T1 s of 900 s; with command 2: + start 90 + W2 = T2 s of 900 s".
read -r total1 total2 < <(sed -nE 's/^session: start 90 \+ command 1 [0-9]+ = ([0-9]+) s of 900 s; with command 2: \+ start 90 \+ [0-9]+ = ([0-9]+) s of 900 s$/\1 \2/p' <<<"$out")
if [[ -z ${total2:-} ]]; then fail "no 'session: start 90 + command 1 ... of 900 s' line"; else
  ((total1 == 90 + worst1 && total2 == total1 + 90 + worst2 && total2 <= 900)) ||
    fail "session totals $total1 / $total2 s (expected 90 + $worst1 and + 90 + $worst2, at most 900)"
fi

# The checks are real: at each boundary, the last second that fits passes and the next fails.
# expect CODE REGEX ENV...: plan under ENV exits CODE (0 or non-zero) and prints REGEX (if any).
expect() {
  local code=$1 regex=$2 o r
  shift 2
  o=$(env "$@" bash "$script" plan 2>&1)
  r=$?
  if [[ $code == 0 ]] && ((r != 0)); then
    fail "plan with $* refused a plan that fits: $(grep ERROR <<<"$o")"
  elif [[ $code != 0 ]] && ((r == 0)); then
    fail "plan with $* accepted a plan that does not fit"
  elif [[ -n $regex ]] && ! grep -qE -- "$regex" <<<"$o"; then
    fail "plan with $* did not say '$regex': $(grep ERROR <<<"$o")"
  fi
}
if [[ -n ${must:-} && -n ${avail1:-} && -n ${setup2:-} && -n ${total2:-} ]]; then
  build=$(bash "$script" steps | awk '$1 == "build" { print $3 }')
  prebuilt=$(bash "$script" steps | awk '$1 == "prebuilt" { print $3 }')
  second=$((worst2))
  # 1. Build and tests within the deadline (a slow build would leave the tests SKIPPED).
  expect 0 '' "GPU_LIMIT_build=$((build + avail1 - must))"
  expect 1 'build and tests can take' "GPU_LIMIT_build=$((build + avail1 - must + 1))"
  # 2. One command at most 570 s.
  expect 1 'over the 570 s a command may plan for' GPU_SESSION_DEADLINE_S=571
  # 3. The session at most 900 s with both commands and their machine starts.
  expect 0 '' "GPU_SESSION_SECOND_S=$((second + 900 - total2))"
  expect 1 "over the 900 s of device time" "GPU_SESSION_SECOND_S=$((second + 900 - total2 + 1))"
  # 4. The second command's setup must leave it time for a step.
  expect 0 '' "GPU_LIMIT_prebuilt=$((prebuilt + avail2 - setup2 - 1))"
  expect 1 'no step would run' "GPU_LIMIT_prebuilt=$((prebuilt + avail2 - setup2))"
  # 5. A minimum over its limit could never run.
  s2s=$(bash "$script" steps | awk '$1 == "s2s" { print $3 }')
  expect 0 '' "GPU_MIN_s2s=$s2s"
  expect 1 'minimum .* is over its limit' "GPU_MIN_s2s=$((s2s + 1))"
fi

((fails == 0)) || { echo "$fails check(s) failed"; exit 1; }
echo "all checks passed (command 1 worst $worst1 s, build and tests $must of $avail1 s, session $total1 s, $total2 s with command 2)"
