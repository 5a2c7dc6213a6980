# shellcheck shell=bash
# Part of cluster/gpu_session.sh, which sources it (the settings and tables are there): the
# device's environment and the session engine of run, rest and profile (one deadline, bounded
# steps, the summary rewritten around each, signals).

# ---- the environment on the device --------------------------------------------------------------
environment() {
  # libgomp's idle threads spin between parallel regions by default: in a GPU step they take
  # the cores autograd's device thread and the copy threads need (--offload=layers: 187 -> 129
  # ms per step with PASSIVE, docs/BENCHMARKS.md). The same default as cluster/slurm/*.sbatch;
  # OMP_WAIT_POLICY= (set, empty) measures libgomp's own default instead.
  if [[ -z ${OMP_WAIT_POLICY+set} ]]; then
    export OMP_WAIT_POLICY=PASSIVE
  elif [[ -z $OMP_WAIT_POLICY ]]; then
    unset OMP_WAIT_POLICY
  fi
  export PYTHONUNBUFFERED=1  # python's output reaches session.log as it is printed
  # $BUILD/lib first: a restored build's RUNPATH names the build machine's checkout path.
  export LD_LIBRARY_PATH="$BUILD/lib:$DEPS/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  export PATH="$DEPS/usr/bin:$PATH"
  ((FAKE)) && return 0
  # torch's lib directory and the nvidia wheels' (NCCL, the CUDA runtime) for programs whose
  # RUNPATH names another machine's paths (a prebuilt archive).
  local libs
  libs=$(python3 - 2>/dev/null <<'EOF'
import os
import torch
dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
try:
    import nvidia
    for p in nvidia.__path__:
        for n in sorted(os.listdir(p)):
            if os.path.isdir(os.path.join(p, n, "lib")):
                dirs.append(os.path.join(p, n, "lib"))
except ImportError:
    pass
print(":".join(dirs))
EOF
  )
  [[ -n $libs ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$libs"
  # CMake finds the CUDA toolkit through nvcc; a non-login shell may not have it on PATH.
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="$PATH:/usr/local/cuda/bin"
  fi
}

# ---- the session engine ------------------------------------------------------------------------
declare -A STATUS=() SECS=() BUDGET_OF=() NOTE=() TITLE_OF=() SHOWN_OF=()
PLAN_STEPS=()          # every step this command may run, in order (the summary lists them all)
MODE="" LOG="" STATE="" FILES="" STATE_LINE="" START_DATE="" COMMIT="?" SRC_HASH="?"
# CUR_PHASE: starting (from the "running" summary to the launch), running (waiting for the
# command: CUR_PID), finishing (its command ended with CUR_RC); "" between steps.
T0_MS=0 DEADLINE_MS=0 CUR_STEP="" CUR_PHASE="" CUR_PID="" CUR_RC=0 CUR_START_MS=0 CUR_OFF=0 CUR_TERM_MS=0
HAVE_BUILD=0 BUILT_HERE=0 CONFIGURED=0 BUILD_NOTE="" STOP_REASON="" KILLED_BY=""

# clean TEXT: into CLEAN, without a tab, a newline or a '|' (the summary's and results' rows).
clean() { CLEAN=${1//$'\t'/ }; CLEAN=${CLEAN//$'\n'/ }; CLEAN=${CLEAN//|//}; }

skipped_for_time() {  # SKIPPED_FOR_TIME: the benchmark steps SKIPPED for time, or not reached when killed
  local s
  SKIPPED_FOR_TIME=""
  for s in "${PLAN_STEPS[@]}"; do
    [[ ${KIND[$s]:-} == bench ]] || continue
    if [[ ${STATUS[$s]:-} == SKIPPED && ${NOTE[$s]:-} == needs\ at\ least* ]] ||
       [[ -n $KILLED_BY && -z ${STATUS[$s]:-} ]]; then
      SKIPPED_FOR_TIME+="$s "
    fi
  done
}

verdict() {  # VERDICT: PASS, or FAIL (the steps that failed); `run` needs its build and tests
  local s bad=()
  for s in "${PLAN_STEPS[@]}"; do
    case ${STATUS[$s]:-} in
      FAIL | TIMEOUT | KILLED) bad+=("$s ${STATUS[$s]}") ;;
      SKIPPED) [[ ${KIND[$s]:-} == test || $s == build ]] && bad+=("$s SKIPPED") ;;
    esac
  done
  ((HAVE_BUILD)) || bad+=("no build")
  if ((${#bad[@]})); then VERDICT="FAIL (${bad[*]})"; else VERDICT=PASS; fi
}

write_results() {  # results.tsv: one row per step done; `record` reads it
  local s
  {
    printf '# step\tkind\tstatus\tseconds\thash\tdate\tcommit\n'
    for s in "${PLAN_STEPS[@]}"; do
      case ${STATUS[$s]:-} in '' | running) continue ;; esac
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "${KIND[$s]:-}" "${STATUS[$s]}" "${SECS[$s]:--}" \
        "${HASH_OF[$s]:--}" "${START_DATE%% *}" "$COMMIT"
    done
  } >"$OUT/results.tsv.tmp"
  mv -f "$OUT/results.tsv.tmp" "$OUT/results.tsv"
}

write_summary() {  # summary.md (and results.tsv), replaced whole
  local s rest elapsed
  now_ms
  verdict
  fmt_s $((NOW_MS - T0_MS)) elapsed
  {
    echo "# GPU session: $MODE, $START_DATE UTC"
    echo
    echo "- state: $STATE_LINE"
    echo "- verdict: $VERDICT"
    echo "- deadline $DEADLINE_S s; $elapsed s elapsed at this rewrite"
    echo "- GPU: $(head -1 "$BUILD/gpu-info.txt" 2>/dev/null || echo '?')"
    echo "- tree: sources $SRC_HASH, commit $COMMIT; build: ${BUILD_NOTE:-none yet}"
    echo
    echo "| step | status | seconds | budget s | note |"
    echo "| --- | --- | --- | --- | --- |"
    for s in "${PLAN_STEPS[@]}"; do
      clean "${NOTE[$s]:-}"
      echo "| $s | ${STATUS[$s]:-pending} | ${SECS[$s]:--} | ${BUDGET_OF[$s]:--} | $CLEAN |"
    done
    skipped_for_time
    rest=$SKIPPED_FOR_TIME
    if [[ -n $rest && $MODE == run ]]; then
      echo
      echo "Second command, only if the device tool's budget_left_s is at least $((START_S + SECOND_S + 15)) s:"
      echo "\`OUT=\$OUT bash cluster/gpu_session.sh rest ${rest% }\` | carry $CARRY | timeout_s $((SECOND_S + 30))"
      if ((BUILT_HERE)); then
        echo "(put this \$OUT's prebuilt.tgz into .gpu-build/ first: the second machine is bare)"
      fi
    fi
    if [[ -s $STATE/sections.md ]]; then cat "$STATE/sections.md"; fi
  } >"$OUT/summary.md.tmp"
  mv -f "$OUT/summary.md.tmp" "$OUT/summary.md"
  write_results
}

pack_files() {  # files.tgz from $FILES when a file there is newer than it (tmp + rename); FORCE=1: always
  local f newer=${FORCE:-0} any=0
  shopt -s globstar nullglob
  for f in "$FILES"/**; do
    [[ -f $f ]] || continue
    any=1
    [[ ! -e $OUT/files.tgz || $f -nt $OUT/files.tgz ]] && newer=1
  done
  shopt -u globstar nullglob
  ((any && newer)) || return 0
  if ! tar -C "$FILES" -czf "$OUT/files.tgz.tmp" .; then
    rm -f "$OUT/files.tgz.tmp"
    return 1
  fi
  # Over what a file of $OUT may have (profiles' traces): without the traces, said in session.log.
  if (($(stat -c %s "$OUT/files.tgz.tmp") > OUT_FILE_BYTES_MAX)); then
    echo "===== files.tgz: over 16 MiB; packed again without the *.json.gz traces" >>"$LOG"
    tar -C "$FILES" --exclude='*.json.gz' -czf "$OUT/files.tgz.tmp" . || { rm -f "$OUT/files.tgz.tmp"; return 1; }
  fi
  mv -f "$OUT/files.tgz.tmp" "$OUT/files.tgz"
}

# finish_step STEP RC: the step's status from RC (or KILLED_BY), its post_ hook, its matched
# lines; the end marker into session.log, files.tgz, then the summary. Status is final last.
finish_step() {
  local step=$1 rc=$2 dur status note="" secs at
  now_ms
  dur=$((NOW_MS - CUR_START_MS))
  fmt_s "$dur" secs
  fmt_s $((NOW_MS - T0_MS)) at
  tail -c +$((CUR_OFF + 1)) "$LOG" >"$STATE/$step.out" 2>/dev/null
  if [[ -n $KILLED_BY ]]; then
    status=KILLED note="stopped by $KILLED_BY at $at s"
  elif ((rc == 0)); then
    status=ok
  elif ((rc == 124 || (rc == 137 && dur + 200 >= CUR_TERM_MS))); then
    status=TIMEOUT note="over its budget of ${BUDGET_OF[$step]} s (limit ${LIMIT[$step]} s), exit $rc"
  else
    status=FAIL note="exit $rc"
  fi
  if [[ -n $PATTERN ]]; then
    grep -E -- "$PATTERN" "$STATE/$step.out" | head -200 >"$STATE/$step.match"
  else
    : >"$STATE/$step.match"
  fi
  POST_STATUS="" POST_NOTE=""
  if [[ -z $KILLED_BY ]] && declare -F "post_$step" >/dev/null; then
    "post_$step" "$rc"
    [[ -n $POST_STATUS ]] && status=$POST_STATUS
    [[ -n $POST_NOTE ]] && note="$POST_NOTE${note:+; $note}"
  fi
  printf '===== %s: %s, %s s%s\n' "$step" "$status" "$secs" "${note:+ ($note)}" >>"$LOG"
  if [[ -s $STATE/$step.match ]]; then  # the step's section of the summary: its matched lines
    {
      printf '\n## %s: %s (%s)\n\n' "$step" "${TITLE_OF[$step]:-$step}" "$status"
      [[ -n ${SHOWN_OF[$step]:-} ]] && printf '`%s`\n\n' "${SHOWN_OF[$step]}"
      cat "$STATE/$step.match"
    } >>"$STATE/sections.md"
  fi
  pack_files
  STATUS[$step]=$status SECS[$step]=$secs NOTE[$step]=$note
  CUR_STEP="" CUR_PID="" CUR_PHASE=""
  STATE_LINE="between steps (last: $step, $status)"
  write_summary
}

# run_one STEP: prepare, fit into the time left, run the one bounded command, finish.
run_one() {
  local step=$1 prep left_ms left_s lim_ms min_ms budget_ms term_ms kill_ms rc at
  CMD=() TITLE="" PATTERN="" SHOWN="" WHY=""
  if [[ -n $STOP_REASON ]]; then
    STATUS[$step]=SKIPPED NOTE[$step]=$STOP_REASON
    return
  fi
  "step_$step"
  prep=$?
  TITLE_OF[$step]=$TITLE SHOWN_OF[$step]=$SHOWN
  case $prep in
    0) ;;
    1) STATUS[$step]=SKIPPED NOTE[$step]=$WHY; write_summary; return ;;
    2) STATUS[$step]=n/a NOTE[$step]=$WHY; write_summary; return ;;
    *) STATUS[$step]=FAIL NOTE[$step]=$WHY; write_summary; return ;;
  esac
  if ((FAKE)) && [[ $step != test_np* && $step != save_build ]]; then
    CMD=(bash "$SELF" fake-step "$step")
  fi
  now_ms
  left_ms=$((DEADLINE_MS - RESERVE_S * 1000 - (NOW_MS - T0_MS)))
  lim_ms=$((LIMIT[$step] * 1000)) min_ms=$((MIN[$step] * 1000))
  budget_ms=$((lim_ms < left_ms ? lim_ms : left_ms))
  if ((budget_ms < min_ms)); then
    fmt_s "$left_ms" left_s
    STATUS[$step]=SKIPPED NOTE[$step]="needs at least ${MIN[$step]} s, $left_s s left"
    printf '===== %s: SKIPPED (%s)\n' "$step" "${NOTE[$step]}" >>"$LOG"
    write_summary
    return
  fi
  # SIGTERM at the budget less the grace (or half-way for a short budget), SIGKILL at the budget.
  if ((budget_ms > 2 * KILL_GRACE_S * 1000)); then term_ms=$((budget_ms - KILL_GRACE_S * 1000)); else term_ms=$((budget_ms / 2)); fi
  kill_ms=$((budget_ms - term_ms))
  CUR_STEP=$step CUR_PHASE=starting CUR_TERM_MS=$term_ms
  fmt_s "$budget_ms" "BUDGET_OF[$step]"
  fmt_s $((NOW_MS - T0_MS)) at
  STATUS[$step]=running
  STATE_LINE="running $step since $at s (budget ${BUDGET_OF[$step]} s)"
  write_summary
  printf '===== %s start at %s s (budget %s s): %s\n' "$step" "$at" "${BUDGET_OF[$step]}" "${SHOWN:-${CMD[*]}}" >>"$LOG"
  CUR_OFF=$(stat -c %s "$LOG")
  now_ms
  CUR_START_MS=$NOW_MS
  # timeout makes itself a process group leader and signals the whole group; stdbuf makes the
  # command's stdio line-buffered (its children inherit it), so the log is current when cut off.
  timeout -k "$(ms_arg "$kill_ms")" "$(ms_arg "$term_ms")" "${LINEBUF[@]}" "${CMD[@]}" >>"$LOG" 2>&1 </dev/null &
  CUR_PID=$! CUR_PHASE=running
  wait "$CUR_PID"
  rc=$?
  CUR_RC=$rc CUR_PHASE=finishing CUR_PID=""
  finish_step "$step" "$rc"
}

on_signal() {  # SIGTERM/INT/HUP: stop the running step's group, mark it KILLED, last summary
  local sig=$1 i
  trap '' TERM INT HUP
  KILLED_BY="SIG$sig"
  case $CUR_PHASE in
    running)
      kill -TERM -- "-$CUR_PID" 2>/dev/null || kill -TERM "$CUR_PID" 2>/dev/null
      for ((i = 0; i < 20; i++)); do kill -0 "$CUR_PID" 2>/dev/null || break; sleep 0.1; done
      kill -KILL -- "-$CUR_PID" 2>/dev/null
      finish_step "$CUR_STEP" 143
      ;;
    finishing)
      # Its command had ended: finish it as it ended (its bookkeeping was cut short).
      KILLED_BY=""
      finish_step "$CUR_STEP" "$CUR_RC"
      KILLED_BY="SIG$sig"
      ;;
    starting)
      # Not launched, or launched a moment ago (its own timeout still bounds it): not run here.
      unset "STATUS[$CUR_STEP]" "BUDGET_OF[$CUR_STEP]"
      NOTE[$CUR_STEP]="not started: $KILLED_BY"
      ;;
  esac
  STATE_LINE="killed by SIG$sig"
  finalize
  case $sig in TERM) exit 143 ;; INT) exit 130 ;; *) exit 129 ;; esac
}

finalize() {  # the last summary; session.log gzipped if it outgrew what comes back
  local n
  [[ -z $KILLED_BY ]] && { now_ms; STATE_LINE="finished in $(fmt_s $((NOW_MS - T0_MS))) s of the $DEADLINE_S s deadline"; }
  FORCE=1 pack_files
  rm -f "$OUT"/*.tmp  # a replacement cut off by a signal
  if (($(stat -c %s "$LOG") > OUT_FILE_BYTES_MAX - (1 << 20))); then
    gzip -c "$LOG" >"$LOG.gz.tmp" && mv -f "$LOG.gz.tmp" "$LOG.gz" && rm -f "$LOG"
  fi
  write_summary
  n=$(find "$OUT" -type f | wc -l)
  ((n <= OUT_FILES_MAX)) || say "WARNING: $OUT holds $n files; only $OUT_FILES_MAX come back"
  verdict
  say "$MODE: $VERDICT; summary in $OUT/summary.md"
}

# session MODE [BENCH...]: MODE run (setup, tests, benchmarks), rest (setup, benchmarks; the
# second command's deadline), profile (setup, profiles).
session() {
  MODE=$1
  shift
  local deadline_s=$DEADLINE_S s n
  [[ $MODE == rest ]] && deadline_s=$SECOND_S
  DEADLINE_S=$deadline_s
  ((DEADLINE_S <= CALL_LIMIT_S - 10)) || die "a deadline of $DEADLINE_S s leaves the device tool's $CALL_LIMIT_S s no margin"
  cd "$ROOT" || exit 1
  mkdir -p "$OUT" "$BUILD" || exit 1
  n=$(find "$OUT" -type f | wc -l)
  ((n == 0)) || say "WARNING: $OUT already holds $n files (the device tool empties it; they count against the $OUT_FILES_MAX)"
  STATE="$BUILD/state" FILES="$BUILD/files" LOG="$OUT/session.log"
  rm -rf "$STATE" "$FILES" "$BUILD/gpu-info.txt"
  mkdir -p "$STATE" "$FILES/gtest"
  export GPU_SESSION_BUILD="$BUILD" GPU_SESSION_FAKE="$FAKE"
  now_ms
  T0_MS=$NOW_MS DEADLINE_MS=$((DEADLINE_S * 1000))
  START_DATE=$(date -u '+%F %H:%M')
  : >"$LOG"
  echo "# gpu_session.sh $MODE, $START_DATE UTC, deadline $DEADLINE_S s$( ((FAKE)) && echo ', FAKE steps')" >>"$LOG"
  STATE_LINE="starting"
  PLAN_STEPS=(gpuinfo unpack prebuilt configure build)
  write_summary
  trap 'on_signal TERM' TERM
  trap 'on_signal INT' INT
  trap 'on_signal HUP' HUP
  LINEBUF=()
  command -v stdbuf >/dev/null && LINEBUF=(stdbuf -oL -eL)
  ((FAKE)) && MPIRUN=(bash "$SELF" fake-mpirun) TEST_MPIRUN=(bash "$SELF" fake-mpirun)
  environment
  SRC_HASH=$(source_hash)
  COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')
  local -a order=()
  case $MODE in
    run)
      PLAN_STEPS=("${SETUP_STEPS[@]}" "${TEST_STEPS[@]}")
      if ((ONLY_GIVEN)); then order=("${ONLY[@]}"); else bench_order_into order; fi
      ;;
    rest)
      PLAN_STEPS=(gpuinfo unpack prebuilt configure build)
      # The steps named, in the order named; none named: all, by priority.
      if ((${#ONLY[@]})); then order=("${ONLY[@]}"); else bench_order_into order; fi
      ;;
    profile)
      PLAN_STEPS=(gpuinfo unpack prebuilt configure build)
      order=("${PROFILE_STEPS[@]}")
      ;;
  esac
  local -a unhashed=()
  for s in "${order[@]}"; do
    PLAN_STEPS+=("$s")
    [[ ${KIND[$s]:-} == bench && -z ${HASH_OF[$s]:-} ]] && unhashed+=("$s")
  done
  ((${#unhashed[@]})) && step_hashes "${unhashed[@]}"
  echo "# order: ${PLAN_STEPS[*]}" >>"$LOG"
  for s in "${PLAN_STEPS[@]}"; do
    [[ $MODE != run && $s == save_build ]] && continue
    run_one "$s"
  done
  finalize
  [[ $VERDICT == PASS ]]
}
