#!/usr/bin/env bash
# gpu_session.sh run with every GPU command faked (GPU_SESSION_FAKE=1; the scheduling, deadline,
# output, summary, packing and file-count code is the real one):
#  1. killed at random points (SIGKILL to its whole process group, or SIGTERM), $OUT never holds
#     more than 8 files (polled while it runs), the summary exists, and every step it calls
#     finished has its output in $OUT (session.log, files.tgz, prebuilt.tgz);
#  2. a deadline too short for every step SKIPS the later ones with a reason; a step whose minimum
#     exceeds the time left is SKIPPED and the next one runs;
#  3. a step over its limit is a TIMEOUT (also one that ignores SIGTERM) and the next step runs;
#  4. a GPU test run with no tests, 0 cases, every case skipped (1 process or the 2 ranks), no
#     XML or failures FAILS its step; CUDA OFF at configure and no GPU stop the session visibly;
#  5. a refused prebuilt archive falls back to configure+build; an accepted one skips them;
#     prebuilt-check refuses a missing library, stale sources and a binary that lists no tests;
#  6. pack's arguments and its 64 MiB carried-size check; record, the priority order, step hashes.
# usage: gpu_session_kill.sh PATH/TO/cluster/gpu_session.sh   (KEEP_TMP=1 keeps its folder for a look)
set -uo pipefail
script=$(readlink -f "${1:?usage: gpu_session_kill.sh GPU_SESSION_SH}")
tmp=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; pkill -KILL -s "$p" 2>/dev/null; done
  [[ -n ${KEEP_TMP:-} ]] && echo "kept $tmp" || rm -rf "$tmp"
}
trap cleanup EXIT
fails=0
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
pass() { echo "ok   $*"; }
shopt -s nullglob dotglob
# Nothing of a caller's session settings leaks in.
unset OUT GPU_SESSION_DEADLINE_S GPU_SESSION_SECOND_S GPU_SESSION_RESERVE_S GPU_SESSION_PREBUILT \
  GPU_SESSION_RECORD GPU_SESSION_CARRY_LIMIT
for v in $(compgen -v | grep -E '^GPU_(LIMIT|MIN)_|^GPU_SESSION_FAKE_'); do unset "$v"; done
export GPU_SESSION_FAKE=1 GPU_SESSION_FAKE_SLEEP=0.02 GPU_SESSION_GRACE_S=1
# A record in the test's own folder (a copy of the repository's), so nothing here writes the tree's.
export GPU_SESSION_RECORD="$tmp/measured.tsv"
export GPU_SESSION_NEXT="$tmp/next.txt"  # none: the tier order below; section 6 writes one
cp "$(dirname "$script")/../docs/gpu/measured.tsv" "$GPU_SESSION_RECORD" 2>/dev/null || : >"$GPU_SESSION_RECORD"
export GPU_SESSION_PREBUILT="$tmp/no-prebuilt.tgz"

now_ms() { local t=${EPOCHREALTIME/[.,]/}; NOW_MS=$((10#$t / 1000)); }
exec {never}<> <(:)  # a pipe nothing writes to: `read -t` on it sleeps without a fork
nap() { read -rt "$1" -u "$never"; }
count_out() {  # count_out DIR: N = the files under DIR (3 levels), without a fork
  local f
  N=0
  for f in "$1"/* "$1"/*/* "$1"/*/*/*; do [[ -f $f ]] && N=$((N + 1)); done
}

# start NAME ARGS... (env assignments before the args, as for env): a run in a session of its
# own, OUT and build in $tmp/NAME; PID is its process (group and session leader).
start() {
  local name=$1 d="$tmp/$1"
  shift
  mkdir -p "$d"
  local -a envs=()
  while [[ ${1:-} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do envs+=("$1"); shift; done
  env OUT="$d/out" GPU_SESSION_BUILD="$d/build" "${envs[@]}" setsid bash "$script" run "$@" >"$d/stdout" 2>&1 &
  PID=$!
  pids+=("$PID")
}

# watch PID DIR STOP_MS: polls DIR's file count until PID ends or STOP_MS (absolute) passes;
# MAXF = the most files seen. Returns 0 if PID ended.
watch() {
  local pid=$1 dir=$2 stop=$3
  while :; do
    count_out "$dir"
    ((N > MAXF)) && MAXF=$N
    kill -0 "$pid" 2>/dev/null || return 0
    now_ms
    ((NOW_MS >= stop)) && return 1
    nap 0.01
  done
}

# run_to_end NAME ARGS...: start, watch to the end; RC, MAXF, D (the run's folder), DUR_MS.
run_to_end() {
  local t0
  now_ms
  t0=$NOW_MS
  start "$@"
  MAXF=0
  watch "$PID" "$tmp/$1/out" $((t0 + 60000)) || fail "$1: still running after 60 s"
  wait "$PID" 2>/dev/null
  RC=$?
  now_ms
  DUR_MS=$((NOW_MS - t0)) D="$tmp/$1"
}

status_of() {  # status_of DIR STEP: the step's status in DIR/out/summary.md
  sed -nE "s/^\| $2 \| ([^|]+) \|.*/\1/p" "$1/out/summary.md" 2>/dev/null | tr -d ' '
}
note_of() { sed -nE "s/^\| $2 \| [^|]+ \| [^|]+ \| [^|]+ \| (.*) \|$/\1/p" "$1/out/summary.md" 2>/dev/null; }

# check_out LABEL DIR: the invariants of $OUT after a run ended or was killed.
check_out() {
  local label=$1 dir=$2 out="$2/out" s st list bad=0
  count_out "$out"
  ((N > MAXF)) && MAXF=$N
  if ((MAXF > 8)); then fail "$label: \$OUT held $MAXF files (at most 8 come back)"; bad=1; fi
  if [[ ! -s $out/summary.md ]]; then fail "$label: no summary.md"; return; fi
  list=$(tar -tzf "$out/files.tgz" 2>/dev/null)
  while read -r s st; do
    [[ -z $s ]] && continue
    if ! grep -q "^===== $s start" "$out/session.log"; then
      fail "$label: $s is $st in the summary but its start is not in session.log"
      bad=1
      continue
    fi
    [[ $st == KILLED ]] && continue  # cut off: its output so far (maybe none yet) is there
    case $s in
      test_np1 | test_np2)
        grep -q "^gtest-run: " "$out/session.log" || { fail "$label: $s is $st but no gtest-run output"; bad=1; } ;;
      save_build)
        grep -q "^save-build: " "$out/session.log" || { fail "$label: save_build is $st but no output"; bad=1; } ;;
      *)
        grep -q "^fake-output $s start" "$out/session.log" || { fail "$label: $s is $st but none of its output is in session.log"; bad=1; } ;;
    esac
    if ! grep -q "^===== $s: $st" "$out/session.log"; then
      fail "$label: $s is $st in the summary but session.log has not its end"
      bad=1
    fi
    case $s/$st in
      test_np1/ok) grep -q 'gtest/np1.xml' <<<"$list" || { fail "$label: test_np1 ok but files.tgz has no np1.xml"; bad=1; } ;;
      test_np2/ok)
        grep -q 'gtest/np2-rank0.xml' <<<"$list" && grep -q 'gtest/np2-rank1.xml' <<<"$list" ||
          { fail "$label: test_np2 ok but files.tgz lacks the ranks' XMLs"; bad=1; } ;;
      save_build/ok) [[ -s $out/prebuilt.tgz ]] || { fail "$label: save_build ok but no prebuilt.tgz"; bad=1; } ;;
      test_np*/* | save_build/*) ;;
      */ok | */FAIL | */TIMEOUT)
        grep -q "^fake-output $s line 3" "$out/session.log" || { fail "$label: $s is $st but its last lines are not in session.log"; bad=1; } ;;
    esac
  done < <(sed -nE 's/^\| ([a-z0-9_]+) \| (ok|FAIL|TIMEOUT|KILLED) \|.*/\1 \2/p' "$out/summary.md")
  return $bad
}

# ---- 1. the whole run, then killed at random points ---------------------------------------------
# offload6b's minimum (600 s) is more than the 565 s left: SKIPPED, and the steps after it run.
run_to_end full GPU_LIMIT_offload6b=600 GPU_MIN_offload6b=600
full_ms=$DUR_MS
if check_out "whole run" "$D"; then
  ok_steps=$(grep -cE '^\| [a-z0-9_]+ \| ok \|' "$D/out/summary.md")
  ((RC == 0 && ok_steps == 31)) || fail "whole run: exit $RC, $ok_steps steps ok (expected 0 and 31: $(head -4 "$D/out/summary.md"))"
  [[ $(status_of "$D" offload6b) == SKIPPED && $(note_of "$D" offload6b) == "needs at least 600 s, "* ]] ||
    fail "whole run: offload6b is '$(status_of "$D" offload6b)' ($(note_of "$D" offload6b)), not SKIPPED for its minimum"
  after=$(sed -nE 's/^\| ([a-z0-9_]+) \|.*/\1/p' "$D/out/summary.md" | sed -n '/^offload6b$/,$p' | sed -n 2p)
  [[ -n $after && $(status_of "$D" "$after") == ok ]] || fail "whole run: the step after offload6b ($after) did not run"
  grep -q '^`OUT=$OUT bash cluster/gpu_session.sh rest offload6b`' "$D/out/summary.md" ||
    fail "whole run: the summary does not name the second command for offload6b"
  [[ $(grep -c $'\tbench\tok\t' "$D/out/results.tsv") == 24 ]] || fail "whole run: results.tsv has not the 24 benchmark steps ok"
  pass "whole run: 31 steps ok, offload6b SKIPPED for its minimum, $DUR_MS ms, at most $MAXF files"
fi

# The trials run 4 benchmark steps (12 of the 22 steps) to keep the test short.
short_ms=$((full_ms * 14 / 22))
trial=0
for sig in KILL TERM KILL TERM KILL TERM; do
  trial=$((trial + 1))
  now_ms
  t0=$NOW_MS
  at=$((50 + RANDOM % (short_ms > 200 ? short_ms - 100 : 100)))
  start "kill$trial" --only=shard3,pipeline,s2s,copies
  MAXF=0
  if watch "$PID" "$tmp/kill$trial/out" $((t0 + at)); then
    label="trial $trial (finished before the SIG$sig at $at ms)"
  else
    label="trial $trial (SIG$sig to the group at $at ms)"
    kill -"$sig" -- "-$PID" 2>/dev/null
    watch "$PID" "$tmp/kill$trial/out" $((NOW_MS + 8000)) || fail "$label: still running 8 s after the signal"
  fi
  wait "$PID" 2>/dev/null
  rc=$?
  # A SIGKILLed run leaves its step's command (its own process group, same session) behind.
  pkill -KILL -s "$PID" 2>/dev/null
  nap 0.05
  if check_out "$label" "$tmp/kill$trial"; then
    if [[ $label == *"to the group"* && $sig == TERM ]]; then
      summ="$tmp/kill$trial/out/summary.md"
      if ((rc != 143)) || ! grep -q '^- state: killed by SIGTERM' "$summ" || grep -qE '^\| [a-z0-9_]+ \| running \|' "$summ"; then
        fail "$label: exit $rc, state '$(grep '^- state' "$summ")', a step still 'running': $(grep -c '| running |' "$summ")"
      elif compgen -G "$tmp/kill$trial/out/*.tmp" >/dev/null; then
        fail "$label: *.tmp files left in \$OUT after SIGTERM"
      else
        pass "$label: summary says killed, $(grep -cE '^\| [a-z0-9_]+ \| (ok|FAIL|TIMEOUT|KILLED) \|' "$summ") steps finished, all with their output; at most $MAXF files"
      fi
    else
      pass "$label: exit $rc, every finished step's output present; at most $MAXF files"
    fi
  fi
done

# ---- 2-5: scenarios, run side by side ------------------------------------------------------------
mins=()
while read -r s _ _ _; do mins+=("GPU_MIN_$s=1"); done < <(bash "$script" steps)
scenario() { local name=$1; shift; ( run_to_end "$name" "$@"; echo "$RC $DUR_MS $MAXF" >"$tmp/$name.result" ) & }
# 3. s2s hangs past its 2 s limit; gpt124m ignores SIGTERM too (SIGKILL after the grace).
scenario timeout GPU_SESSION_FAKE_s2s=hang GPU_LIMIT_s2s=2 GPU_MIN_s2s=1 GPU_SESSION_FAKE_gpt124m=stubborn \
  GPU_LIMIT_gpt124m=2 GPU_MIN_gpt124m=1 --only=s2s,gpt124m,copies
# 4. The GPU tests' outcomes that must fail the step (fake dtrain_gpu_tests: LISTED:CASES:SKIPPED:FAILURES).
scenario notests GPU_SESSION_FAKE_GTEST_NP1=0:0:0:0 --only=copies
scenario nocases GPU_SESSION_FAKE_GTEST_NP1=25:0:0:0 --only=copies
scenario allskip GPU_SESSION_FAKE_GTEST_NP1=25:25:25:0 --only=copies
scenario np2skip GPU_SESSION_FAKE_GTEST_NP2=25:25:25:0 --only=copies
scenario noxml GPU_SESSION_FAKE_GTEST_NP1=noxml --only=copies
scenario failures GPU_SESSION_FAKE_GTEST_NP1=25:25:1:2 --only=copies
scenario cudaoff GPU_SESSION_FAKE_configure=off --only=copies
scenario nogpu GPU_SESSION_FAKE_gpuinfo=fail --only=copies
# 5. A carried prebuilt archive, refused (fallback) or accepted.
echo fake >"$tmp/prebuilt.tgz"
scenario refused GPU_SESSION_PREBUILT="$tmp/prebuilt.tgz" GPU_SESSION_FAKE_prebuilt=fail --only=copies
scenario accepted GPU_SESSION_PREBUILT="$tmp/prebuilt.tgz" --only=copies
wait
# 2. Alone (its time must not go to the others): a 4 s deadline (1 s reserve), every minimum 1 s,
# each fake step 0.45 s and more.
scenario deadline GPU_SESSION_DEADLINE_S=4 GPU_SESSION_RESERVE_S=1 GPU_SESSION_FAKE_SLEEP=0.15 "${mins[@]}" \
  --only=s2s,gpt124m,copies,pipeline
wait

result() {  # result NAME: RC DUR_MS MAXF of a scenario, and D
  read -r RC DUR_MS MAXF <"$tmp/$1.result" 2>/dev/null || { RC=x DUR_MS=0 MAXF=99; }
  D="$tmp/$1"
}

result deadline
if check_out deadline "$D"; then
  first_skip=$(grep -nE '^\| [a-z0-9_]+ \| SKIPPED \| - \| - \| needs at least 1 s, [0-9.]+ s left \|' "$D/out/summary.md" | head -1 | cut -d: -f1)
  ran_after=$(awk -v n="${first_skip:-0}" 'NR > n && /^\| [a-z0-9_]+ \| (ok|FAIL|TIMEOUT) \|/' "$D/out/summary.md" | head -1)
  n_ok=$(grep -cE '^\| [a-z0-9_]+ \| ok \|' "$D/out/summary.md")
  if [[ -z $first_skip ]]; then
    fail "deadline: no step SKIPPED with 'needs at least 1 s, ... s left': $(grep -E '^\| ' "$D/out/summary.md" | tr '\n' ' ')"
  elif [[ -n $ran_after ]]; then
    fail "deadline: a step ran after the time was up: $ran_after"
  elif ((n_ok < 2)); then
    fail "deadline: only $n_ok steps ran before the deadline"
  elif ((DUR_MS > 5500)); then
    fail "deadline: the run took $DUR_MS ms with a 4 s deadline"
  elif ! grep -q '^`OUT=$OUT bash cluster/gpu_session.sh rest ' "$D/out/summary.md"; then
    fail "deadline: no second command for the skipped steps"
  else
    pass "deadline 4 s: $n_ok steps ok, the rest SKIPPED with the time left, ended after $DUR_MS ms"
  fi
fi

result timeout
if check_out timeout "$D"; then
  if [[ $(status_of "$D" s2s) != TIMEOUT || $(status_of "$D" gpt124m) != TIMEOUT || $(status_of "$D" copies) != ok ]]; then
    fail "timeout: s2s '$(status_of "$D" s2s)', gpt124m '$(status_of "$D" gpt124m)', copies '$(status_of "$D" copies)' (expected TIMEOUT, TIMEOUT, ok)"
  elif [[ $(note_of "$D" gpt124m) != *"exit 137"* ]]; then
    fail "timeout: gpt124m (ignores SIGTERM) was not SIGKILLed: $(note_of "$D" gpt124m)"
  elif grep -qE '^\| (nccl_allreduce|pipeline) \|' "$D/out/summary.md"; then
    fail "timeout: run --only=s2s,gpt124m,copies planned other benchmark steps too"
  else
    pass "timeout: s2s and gpt124m over their 2 s limits are TIMEOUTs (124, 137), copies ran after them"
  fi
fi

expect_test_fail() {  # expect_test_fail NAME STEP NOTE_REGEX [OTHER_STEP OTHER_STATUS]
  result "$1"
  check_out "$1" "$D" || return
  local st note
  st=$(status_of "$D" "$2") note=$(note_of "$D" "$2")
  if [[ $st != FAIL ]] || ! grep -qE -- "$3" <<<"$note"; then
    fail "$1: $2 is '$st' ($note), expected FAIL matching '$3'"
  elif [[ -n ${4:-} && $(status_of "$D" "$4") != "$5" ]]; then
    fail "$1: $4 is '$(status_of "$D" "$4")', expected $5"
  elif [[ $RC == 0 ]] || ! grep -q '^- verdict: FAIL' "$D/out/summary.md"; then
    fail "$1: exit $RC and '$(grep '^- verdict' "$D/out/summary.md")': a failed test step must fail the run"
  elif [[ $(status_of "$D" copies) != ok && $2 == test_np* ]]; then
    fail "$1: the benchmark after the failed tests did not run"
  else
    pass "$1: $2 FAIL ($note)"
  fi
}
expect_test_fail notests test_np1 'lists no tests'
expect_test_fail nocases test_np1 'np1 ran 0 cases'
expect_test_fail allskip test_np1 'every case skipped'
expect_test_fail np2skip test_np2 'rank 0: every case skipped.*rank 1: every case skipped' test_np1 ok
expect_test_fail noxml test_np1 'np1: no XML'
expect_test_fail failures test_np1 'np1: 25 cases, 1 skipped, 2 failures'
expect_test_fail cudaoff configure 'CUDA or NCCL not ON' build SKIPPED
result cudaoff
[[ $(status_of "$D" test_np1) == SKIPPED && $(note_of "$D" test_np1) == "no build"* ]] ||
  fail "cudaoff: test_np1 is '$(status_of "$D" test_np1)' ($(note_of "$D" test_np1)), expected SKIPPED for no build"
expect_test_fail nogpu gpuinfo 'no GPU visible' unpack SKIPPED

result refused
if check_out refused "$D"; then
  if [[ $(status_of "$D" prebuilt) != refused || $(note_of "$D" prebuilt) != "fake refusal; configure and build here instead"* || $(status_of "$D" build) != ok ||
        $(status_of "$D" test_np2) != ok || $RC != 0 ]]; then
    fail "refused: prebuilt '$(status_of "$D" prebuilt)' ($(note_of "$D" prebuilt)), build '$(status_of "$D" build)', exit $RC"
  else
    pass "refused prebuilt: configure and build ran instead, tests ok"
  fi
fi
result accepted
if check_out accepted "$D"; then
  if [[ $(status_of "$D" prebuilt) != ok || $(status_of "$D" configure) != n/a || $(status_of "$D" build) != n/a ||
        $(status_of "$D" save_build) != n/a || $(status_of "$D" test_np1) != ok || $RC != 0 ]]; then
    fail "accepted: prebuilt '$(status_of "$D" prebuilt)', configure '$(status_of "$D" configure)', build '$(status_of "$D" build)', exit $RC"
  else
    pass "accepted prebuilt: no configure, no build, tests ok"
  fi
fi

# prebuilt-check for real: an archive whose program needs a library it carries (ldd clean), the
# same without the library, with stale sources, and with a test binary that lists nothing.
if command -v cc >/dev/null; then
  p="$tmp/pre"
  mkdir -p "$p/src" "$p/stage/bin" "$p/stage/lib"
  echo 'int f(void) { return 1; }' >"$p/src/x.c"
  echo 'int f(void); int main(void) { return f() - 1; }' >"$p/src/m.c"
  cc -shared -fPIC -o "$p/stage/lib/libx.so" "$p/src/x.c" &&
    cc -o "$p/stage/bin/prog" "$p/src/m.c" -L"$p/stage/lib" -lx || fail "prebuilt-check: cannot compile the probe"
  printf '#!/bin/sh\necho Suite.\necho "  A"\necho "  B"\n' >"$p/stage/bin/dtrain_gpu_tests"
  chmod +x "$p/stage/bin/dtrain_gpu_tests"
  manifest() { printf 'sources=%s\nsource_dir=%s\npython=\n' "$1" "$(cd "$(dirname "$script")/.." && pwd)" >"$p/stage/MANIFEST"; }
  check_pre() {  # check_pre NAME CODE REGEX
    local out rc
    tar -C "$p/stage" -czf "$p/$1.tgz" .
    out=$(bash "$script" prebuilt-check "$p/$1.tgz" "$p/dest-$1" 2>&1)
    rc=$?
    if ((rc != $2)) || ! grep -qE -- "$3" <<<"$out"; then fail "prebuilt-check $1: exit $rc (expected $2): $out"; else pass "prebuilt-check $1 (exit $rc)"; fi
  }
  hash=$(bash "$script" source-hash)
  manifest "$hash"
  check_pre clean 0 'ok: ldd clean, dtrain_gpu_tests lists 2 tests'
  mv "$p/stage/lib/libx.so" "$p/libx.so"
  check_pre missing_lib 4 'REFUSED: 1 unresolved libraries, first: prog: .*libx.so => not found'
  mv "$p/libx.so" "$p/stage/lib/libx.so"
  manifest 0123456789abcdef
  check_pre stale 3 "REFUSED: stale: built from sources 0123456789abcdef, this tree is $hash"
  manifest "$hash"
  printf '#!/bin/sh\nexit 0\n' >"$p/stage/bin/dtrain_gpu_tests"
  check_pre lists_none 5 'REFUSED: .*lists no tests'
else
  echo "skip prebuilt-check (no C compiler)"
fi

# ---- 6. pack (fake binaries: the argument handling and the size check are the real code) --------
packenv=(env GPU_SESSION_PACK_BUILD="$tmp/packbuild" GPU_SESSION_PREBUILT="$tmp/gb/prebuilt.tgz" GPU_SESSION_FAKE_PACK_KB=256)
out=$("${packenv[@]}" bash "$script" pack --bogus 2>&1)
[[ $? == 2 && $out == *"unknown argument '--bogus'"* ]] || fail "pack --bogus: $out"
out=$("${packenv[@]}" bash "$script" pack --jobs=0 2>&1)
[[ $? == 2 && $out == *"--jobs must be a positive integer"* ]] || fail "pack --jobs=0: $out"
out=$("${packenv[@]}" bash "$script" pack --jobs=2 2>&1)
rc=$?
total_kib=$(sed -nE 's/.* = ([0-9]+) KiB of [0-9]+ KiB$/\1/p' <<<"$out")
list=$(tar -tzf "$tmp/gb/prebuilt.tgz" 2>/dev/null | sort | tr '\n' ' ')
if ((rc != 0)) || [[ -z $total_kib || $list != *"./MANIFEST ./bin/ ./bin/dtrain-bench ./bin/dtrain-plan ./bin/dtrain-timeline ./bin/dtrain_gpu_tests ./bin/train_gpt ./bin/train_seq2seq ./lib/ ./lib/libdtrain_fake.so"* ]]; then
  fail "pack: exit $rc, archive [$list]: $out"
else
  # 200 KiB under the total (the archive alone is 256 KiB of random bytes) is refused, and
  # nothing is left; 200 KiB over it passes.
  rm -f "$tmp/gb/prebuilt.tgz"
  out=$(GPU_SESSION_CARRY_LIMIT=$(((total_kib - 200) << 10)) "${packenv[@]}" bash "$script" pack 2>&1)
  rc=$?
  if ((rc == 0)) || [[ $out != *"refused: the carried total"* ]] || [[ -n $(compgen -G "$tmp/gb/*") ]]; then
    fail "pack over the limit: exit $rc, left [$(ls "$tmp/gb")]: $out"
  else
    out=$(GPU_SESSION_CARRY_LIMIT=$(((total_kib + 200) << 10)) "${packenv[@]}" bash "$script" pack 2>&1)
    rc=$?
    if ((rc != 0)) || [[ ! -s $tmp/gb/prebuilt.tgz ]]; then fail "pack under the limit: exit $rc: $out"; else
      pass "pack: arguments checked, the archive has bin/ lib/ MANIFEST, refused at $((total_kib - 200)) KiB, written at $((total_kib + 200)) KiB"
    fi
  fi
fi

# ---- 6. record and the priority order ------------------------------------------------------------
rec="$tmp/rec.tsv"
declare -A H=()
while read -r s _ _ h _; do [[ $s == step ]] || H[$s]=$h; done < <(GPU_SESSION_RECORD=/nonexistent bash "$script" order)
printf 'copies\t2026-01-01\taaaaaaa\t%s\t9.0\ngpt124m\t2026-01-02\tbbbbbbb\t%s\t8.0\ns2s\t2026-01-03\tccccccc\told\t7.0\n' \
  "${H[copies]}" "${H[gpt124m]}" >"$rec"
mkdir -p "$tmp/res"
{
  printf '# step\tkind\tstatus\tseconds\thash\tdate\tcommit\n'
  printf 'test_np1\ttest\tok\t20.0\t-\t2026-02-01\t?\n'
  printf 's2s\tbench\tok\t55.5\t%s\t2026-02-01\tddddddd\n' "${H[s2s]}"
  printf 'pipeline\tbench\tok\t30.1\tfeedfeedfeedfeed\t2026-02-01\t?\n'
  printf 'shard3\tbench\tFAIL\t3.0\t%s\t2026-02-01\t?\n' "${H[shard3]}"
  printf 'offload6b\tbench\tSKIPPED\t-\t%s\t2026-02-01\t?\n' "${H[offload6b]}"
} >"$tmp/res/results.tsv"
out=$(GPU_SESSION_RECORD="$rec" bash "$script" record "$tmp/res" 2>&1)
rc=$?
head_commit=$(git -C "$(dirname "$script")" rev-parse --short HEAD 2>/dev/null || echo '?')
if ((rc != 0)) || ! grep -qP "^s2s\t2026-02-01\tddddddd\t${H[s2s]}\t55.5$" "$rec" ||
   ! grep -qP "^pipeline\t2026-02-01\t\Q$head_commit\E\tfeedfeedfeedfeed\t30.1$" "$rec" ||
   grep -qE '^(shard3|offload6b|test_np1)\b' "$rec" || ! grep -qP "^copies\t2026-01-01\taaaaaaa\t" "$rec"; then
  fail "record: exit $rc: $out; record now: $(grep -v '^#' "$rec" | tr '\t\n' ' |')"
else
  # Never measured first (declaration order), then changed (pipeline's hash is not today's),
  # then unchanged, oldest first: copies (01-01), gpt124m (01-02), s2s (02-01).
  got=$(GPU_SESSION_RECORD="$rec" bash "$script" order | awk 'NR > 1 { print $1 }' | tr '\n' ' ')
  want="nccl_allreduce mpi_allreduce cpu_adam host_norm offload_layers async_save shard shard3 offload6b offload6b_bf16 offload_largest offload_opt offload_delayed offload_bf16 gpt_anchor gpt_graph s2s_graph kernels s2s_anchor simulate plan_offload pipeline copies gpt124m s2s "
  if [[ $got != "$want" ]]; then fail "order after record: '$got', expected '$want'"; else
    pass "record: ok benchmark steps recorded (no .git there: this commit), others not; order: never, changed, oldest"
  fi
  # Steps named in next.txt come first, in its order; the rest as before; a name that is no
  # benchmark step is refused.
  printf '# comment\nkernels\n\ncopies  # unchanged, still first\n' >"$tmp/next.txt"
  got=$(GPU_SESSION_RECORD="$rec" bash "$script" order | awk 'NR > 1 { print $1 }' | tr '\n' ' ')
  want_next="kernels copies nccl_allreduce mpi_allreduce cpu_adam host_norm offload_layers async_save shard shard3 offload6b offload6b_bf16 offload_largest offload_opt offload_delayed offload_bf16 gpt_anchor gpt_graph s2s_graph s2s_anchor simulate plan_offload pipeline gpt124m s2s "
  printf 'kernels\nbuild\n' >"$tmp/next.txt"
  bad=$(GPU_SESSION_RECORD="$rec" bash "$script" order 2>&1)
  bad_rc=$?
  rm -f "$tmp/next.txt"
  if [[ $got != "$want_next" ]]; then fail "order with next.txt: '$got', expected '$want_next'"
  elif ((bad_rc == 0)) || ! grep -q "names 'build', which is no benchmark step" <<<"$bad"; then
    fail "next.txt naming 'build' was not refused (exit $bad_rc): $bad"
  else pass "next.txt: its steps first, in its order; a step that is no benchmark refused"; fi
fi

# A step's hash follows its sources and its own command: in a copy of the script (and of its
# libraries, cluster/gpu_session/) with one of s2s's files, a change to that file moves s2s's hash
# alone, a change to step_copies copies' alone.
mkdir -p "$tmp/tree/cluster" "$tmp/tree/tools"
cp "$script" "$tmp/tree/cluster/gpu_session.sh"
cp -r "$(dirname "$script")/gpu_session" "$tmp/tree/cluster/"
cp "$(dirname "$script")/../tools/techniques.sh" "$tmp/tree/tools/"
hashes() { GPU_SESSION_RECORD=/nonexistent bash "$tmp/tree/cluster/gpu_session.sh" order | awk 'NR > 1 { printf "%s=%s ", $1, $4 }'; }
h0=$(hashes)
echo "# changed" >>"$tmp/tree/tools/techniques.sh"
h1=$(hashes)
sed -i 's/for _ in range(reps)/for _ in range(reps + 0)/' "$tmp/tree/cluster/gpu_session/steps.sh"
h2=$(hashes)
changed() { diff <(tr ' ' '\n' <<<"$1") <(tr ' ' '\n' <<<"$2") | sed -nE 's/^> ([a-z0-9_]+)=.*/\1/p' | tr '\n' ' '; }
if [[ $(changed "$h0" "$h1") != "s2s " || $(changed "$h1" "$h2") != "copies " ]]; then
  fail "hashes: a change to tools/techniques.sh moved [$(changed "$h0" "$h1")], one to step_copies [$(changed "$h1" "$h2")]"
else
  pass "hashes: a source file moves its step's hash, a step's command its own"
fi

((fails == 0)) || { echo "$fails check(s) failed"; exit 1; }
echo "all checks passed"
