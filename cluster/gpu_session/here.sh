# shellcheck shell=bash
# Part of cluster/gpu_session.sh, which sources it (the settings and tables are there): the
# commands run here, without the device: steps, plan, order, record, pack, fetch.

# ---- here: plan, order, record, pack, fetch ---------------------------------------------------
steps_table() {
  local s
  for s in "${SETUP_STEPS[@]}" "${TEST_STEPS[@]}" "${BENCH_STEPS[@]}" "${PROFILE_STEPS[@]}"; do
    printf '%s %s %s %s\n' "$s" "${KIND[$s]:-}" "${LIMIT[$s]}" "${MIN[$s]}"
  done
}

sum_limits() {  # sum_limits STEP...: "TOTAL|a 10 + b 20"
  local s total=0 parts=""
  for s; do total=$((total + LIMIT[$s])); parts+="${parts:+ + }$s ${LIMIT[$s]}"; done
  echo "$total|$parts"
}

plan() {
  local fails=0 must must_parts second second_parts avail1 avail2 total1 total2 s tier date h n=0 bsum
  check_limits || return 1
  check_next
  IFS='|' read -r must must_parts <<<"$(sum_limits gpuinfo unpack prebuilt configure build test_np1 test_np2)"
  IFS='|' read -r second second_parts <<<"$(sum_limits gpuinfo unpack prebuilt)"
  avail1=$((DEADLINE_S - RESERVE_S)) avail2=$((SECOND_S - RESERVE_S))
  echo "here, once: bash cluster/gpu_session.sh fetch   (.deps/: the Debian packages the GPU machine lacks)"
  echo "here, optional: bash cluster/gpu_session.sh pack   (.gpu-build/prebuilt.tgz: the device then skips configure and build)"
  echo "machine start: $START_S s (each command that finds no warm machine)"
  printf 'command 1: OUT=$OUT bash cluster/gpu_session.sh run | carry %s | timeout_s %d | worst %d s\n' \
    "$CARRY" "$CALL_LIMIT_S" "$DEADLINE_S"
  echo "  one deadline of $DEADLINE_S s: each step gets min(its limit, the time left less $RESERVE_S s);" \
    "a step that cannot get its minimum is SKIPPED"
  echo "  build and GPU tests, worst case $must s of $avail1 s ($must_parts; the prebuilt refused after its whole limit)"
  if ((DEADLINE_S > COMMAND_MAX_S)); then
    echo "  ERROR: the deadline $DEADLINE_S s is over the $COMMAND_MAX_S s a command may plan for (the tool kills at $CALL_LIMIT_S s)"
    fails=1
  fi
  if ((must > avail1)); then
    echo "  ERROR: build and tests can take $must s, over the $avail1 s the deadline leaves: the tests could be skipped"
    fails=1
  fi
  echo "  then the benchmark steps in this order (${RECORD#"$ROOT/"}), each while it can get its minimum:"
  bsum=0
  while read -r s tier date h; do
    n=$((n + 1))
    bsum=$((bsum + LIMIT[$s]))
    printf '    %2d. %-16s %-30s limit %3d s, minimum %3d s\n' "$n" "$s" "$(tier_text "$tier" "$date")" "${LIMIT[$s]}" "${MIN[$s]}"
  done < <(bench_order)
  echo "  (their limits add up to $bsum s: what does not fit is SKIPPED, and the summary names the second command)"
  printf 'command 2, optional: OUT=$OUT bash cluster/gpu_session.sh rest STEP... | carry %s | timeout_s %d | worst %d s\n' \
    "$CARRY" "$((SECOND_S + 30))" "$SECOND_S"
  echo "  only when command 1 skipped steps and budget_left_s >= $((START_S + SECOND_S + 15)) s; needs a build in" \
    ".gpu-build/prebuilt.tgz (pack's, or command 1's \$OUT/prebuilt.tgz): its setup, worst case $second s of $avail2 s ($second_parts)"
  if ((SECOND_S > COMMAND_MAX_S)); then
    echo "  ERROR: the second deadline $SECOND_S s is over $COMMAND_MAX_S s"
    fails=1
  fi
  if ((second >= avail2)); then
    echo "  ERROR: its setup can take $second s of the $avail2 s it has: no step would run"
    fails=1
  fi
  total1=$((START_S + DEADLINE_S))
  total2=$((total1 + START_S + SECOND_S))
  echo "session: start $START_S + command 1 $DEADLINE_S = $total1 s of $SESSION_S s; with command 2: + start $START_S + $SECOND_S = $total2 s of $SESSION_S s"
  if ((total2 > SESSION_S)); then
    echo "ERROR: the session's worst case $total2 s is over the $SESSION_S s of device time"
    fails=1
  fi
  echo "then: give_back at once (a warm machine's idle time counts); here: bash cluster/gpu_session.sh record DIR (DIR: the fetched \$OUT)"
  return $fails
}

order() {
  local s tier date h
  check_next
  load_record
  printf '%-16s %-30s %-16s %s\n' step priority "hash now" "recorded hash"
  while read -r s tier date h; do
    printf '%-16s %-30s %-16s %s\n' "$s" "$(tier_text "$tier" "$date")" "$h" "${REC_HASH[$s]:--}"
  done < <(bench_order)
}

# record DIR: the benchmark steps that succeeded in DIR/results.tsv (a fetched $OUT) become the
# newest figures of docs/gpu/measured.tsv (their date, commit, hash and seconds).
record() {
  local dir=$1 res s kind status secs hash date commit head updated=() others=()
  res="$dir/results.tsv"
  [[ -r $res ]] || { echo "gpu_session.sh record: no $res (the fetched \$OUT of a run)" >&2; return 2; }
  load_record
  head=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')
  while IFS=$'\t' read -r s kind status secs hash date commit; do
    [[ -z $s || $s == \#* || $kind != bench ]] && continue
    if [[ $status != ok || $hash == - || -z $hash ]]; then
      others+=("$s ($status)")
      continue
    fi
    # No .git on the device: the commit checked out here stands in (the hash is the identity).
    [[ -z $commit || $commit == '?' ]] && commit=$head
    REC_DATE[$s]=$date REC_COMMIT[$s]=$commit REC_HASH[$s]=$hash REC_SECS[$s]=$secs
    updated+=("$s")
  done <"$res"
  mkdir -p "$(dirname "$RECORD")"
  {
    echo "# The benchmark steps of cluster/gpu_session.sh and when each was last measured on the GPU machine."
    echo "# step, UTC date, commit, hash of the step's command and sources (gpu_session.sh order shows today's), seconds."
    echo "# A step without a line was never measured; the next run takes those first, then the changed ones,"
    echo "# then the oldest. Written by: bash cluster/gpu_session.sh record DIR (DIR: a session's fetched \$OUT)."
    for s in "${BENCH_STEPS[@]}"; do
      [[ -n ${REC_DATE[$s]:-} ]] || continue
      printf '%s\t%s\t%s\t%s\t%s\n' "$s" "${REC_DATE[$s]}" "${REC_COMMIT[$s]}" "${REC_HASH[$s]}" "${REC_SECS[$s]}"
    done
  } >"$RECORD.tmp" && mv -f "$RECORD.tmp" "$RECORD"
  say "recorded ${#updated[@]} step(s) in ${RECORD#"$ROOT/"}: ${updated[*]:-none}"
  ((${#others[@]})) && say "not recorded (no figure): ${others[*]}"
  [[ -r $dir/prebuilt.tgz ]] && say "for a second command: cp $dir/prebuilt.tgz .gpu-build/"
  return 0
}

carried_bytes() {  # what would travel: the working tree (tracked + untracked, not ignored) + .deps + .gpu-build
  local tree deps gb
  tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  deps=$(du -sb "$ROOT/.deps" 2>/dev/null | cut -f1)
  gb=$(du -sb "$(dirname "$PREBUILT")" 2>/dev/null | cut -f1)
  echo "${tree:-0} ${deps:-0} ${gb:-0}"
}

# pack [--jobs=N]: the GPU targets built HERE (build-gpu-pack/, CUDA and NCCL ON, .venv's torch:
# the same torch 2.11 cu130 wheel as the device's) into .gpu-build/prebuilt.tgz. Refused (exit 1,
# no archive) when the carried total would pass 64 MiB. GPU_SESSION_FAKE=1: fake binaries of
# GPU_SESSION_FAKE_PACK_KB KiB instead of the build (the tests).
pack() {
  local jobs=${DTRAIN_BUILD_JOBS:-$(nproc)} arg py="$ROOT/.venv/bin/python" bytes tree deps gb total old=0 i
  for arg; do
    case $arg in
      --jobs=*) jobs=${arg#--jobs=} ;;
      *) echo "gpu_session.sh pack: unknown argument '$arg' (usage: pack [--jobs=N])" >&2; return 2 ;;
    esac
  done
  [[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "gpu_session.sh pack: --jobs must be a positive integer, not '$jobs'" >&2; return 2; }
  cd "$ROOT" || return 1
  if ((FAKE)); then
    rm -rf "$PACK_BUILD" && mkdir -p "$PACK_BUILD/bin" "$PACK_BUILD/lib"
    for i in "${BUILD_TARGETS[@]}"; do echo "fake $i" >"$PACK_BUILD/bin/$i"; done
    head -c $((${GPU_SESSION_FAKE_PACK_KB:-64} << 10)) /dev/urandom >"$PACK_BUILD/lib/libdtrain_fake.so"
  else
    if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
      say "ERROR: $py has no CUDA torch: run 'bash cluster/setup.sh' (the torch 2.11 cu130 wheel the device has)"
      return 1
    fi
    mkdir -p "$PACK_BUILD"
    if [[ ! -f $PACK_BUILD/build.ninja ]]; then
      say "configuring $PACK_BUILD (CUDA and NCCL ON)"
      cmake -S . -B "$PACK_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON \
        -DDTRAIN_PYTHON="$py" >"$PACK_BUILD/configure.log" 2>&1 || {
        tail -30 "$PACK_BUILD/configure.log"
        say "ERROR: configure failed (log: $PACK_BUILD/configure.log)"
        return 1
      }
    fi
    check_configure "$PACK_BUILD/configure.log" || return 1
    say "building ${BUILD_TARGETS[*]} with $jobs jobs"
    cmake --build "$PACK_BUILD" -j "$jobs" --target "${BUILD_TARGETS[@]}" || { say "ERROR: the build failed"; return 1; }
  fi
  mkdir -p "$(dirname "$PREBUILT")"
  bytes=$(archive_build "$PACK_BUILD" "$PREBUILT" "$py") || { rm -f "$PREBUILT.tmp"; say "ERROR: packing failed"; return 1; }
  [[ -e $PREBUILT ]] && old=$(stat -c %s "$PREBUILT")
  read -r tree deps gb <<<"$(carried_bytes)"
  # .gpu-build as it will be: the new archive instead of the old one and the .tmp.
  total=$((tree + deps + gb - old - bytes + bytes))
  say "prebuilt.tgz: $((bytes >> 10)) KiB; carried: tree $((tree >> 10)) KiB + .deps $((deps >> 10)) KiB +" \
    ".gpu-build $(((gb - old) >> 10)) KiB = $((total >> 10)) KiB of $((CARRY_BYTES_MAX >> 10)) KiB"
  if ((total > CARRY_BYTES_MAX)); then
    rm -f "$PREBUILT.tmp"
    say "ERROR: refused: the carried total $((total >> 10)) KiB would exceed $((CARRY_BYTES_MAX >> 10)) KiB" \
      "(the device tool refuses a larger tree); nothing written"
    return 1
  fi
  mv -f "$PREBUILT.tmp" "$PREBUILT"
  say "wrote ${PREBUILT#"$ROOT/"} ($((bytes >> 10)) KiB); carry $CARRY"
}

fetch() {
  mkdir -p "$ROOT/.deps"
  (cd "$ROOT/.deps" && apt-get download "${PACKAGES[@]}") || {
    say "ERROR: apt-get download failed (run 'apt-get update' first?)"
    exit 1
  }
  say "downloaded $(ls "$ROOT"/.deps/*.deb | wc -l) packages into .deps/ ($(du -sh "$ROOT/.deps" | cut -f1))"
}
