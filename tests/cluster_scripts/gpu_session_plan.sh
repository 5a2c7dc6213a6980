#!/usr/bin/env bash
# gpu_session.sh plan: the device calls fit the GPU machine's limits (each call <= 600 s, the whole
# sequence with the machine start <= 1500 s), and plan refuses a table that does not fit.
# usage: gpu_session_plan.sh PATH/TO/cluster/gpu_session.sh
set -uo pipefail
script=${1:?usage: gpu_session_plan.sh GPU_SESSION_SH}
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }

out=$(bash "$script" plan 2>&1)
rc=$?
echo "$out"
((rc == 0)) || fail "plan exited $rc"
calls=0
while read -r worst; do
  calls=$((calls + 1))
  ((worst <= 600)) || fail "a device call's worst case is $worst s (> 600)"
done < <(sed -nE 's/^call [0-9]+: .* worst ([0-9]+) s .*/\1/p' <<<"$out")
((calls >= 2)) || fail "expected the test call and at least one bench call, found $calls"
grep -qE '^call 1: .*gpu_session.sh test \| carry \[".deps"\]' <<<"$out" || fail "the first call is not 'test' carrying .deps"
total=$(sed -nE 's/^total: ([0-9]+) s.*/\1/p' <<<"$out")
[[ -n $total ]] || fail "no total line"
((${total:-9999} <= 1500)) || fail "total $total s > 1500"

# The checks are real. Each call's first step and its limit, from "worst W s (STEP L + ...)":
worsts=() steps=() limits=()
while read -r w st l; do
  worsts+=("$w") steps+=("$st") limits+=("$l")
done < <(sed -nE 's/^call [0-9]+: .* worst ([0-9]+) s \(([a-z0-9_]+) ([0-9]+).*/\1 \2 \3/p' <<<"$out")
last=$((${#steps[@]} - 1))
# 1. One call at 601 s with the total unchanged (the seconds taken from the last call's first step):
#    only the per-call check can refuse it.
d=$((601 - worsts[0]))
if ((limits[last] - d > 5)); then
  env "GPU_LIMIT_${steps[0]}=$((limits[0] + d))" "GPU_LIMIT_${steps[last]}=$((limits[last] - d))" \
    bash "$script" plan >/dev/null 2>&1 && fail "plan accepted a call of 601 s"
else
  fail "cannot move $d s out of ${steps[last]} (${limits[last]} s) to test the per-call check"
fi
# 2. Every call stretched to exactly 600 s: each call passes, the sum does not.
overrides=()
for i in "${!steps[@]}"; do overrides+=("GPU_LIMIT_${steps[i]}=$((limits[i] + 600 - worsts[i]))"); done
stretched=$(env "${overrides[@]}" bash "$script" plan 2>&1)
if ! grep -q '^total: ' <<<"$stretched" || grep -q 'over the 600 s' <<<"$stretched"; then
  fail "stretching each call to 600 s did not give a plan with every call within 600 s: $stretched"
fi
env "${overrides[@]}" bash "$script" plan >/dev/null 2>&1 && fail "plan accepted a sequence over 1500 s: $stretched"

((fails == 0)) || { echo "$fails check(s) failed"; exit 1; }
echo "all checks passed ($calls device calls, $total s worst case)"
