# shellcheck shell=bash
# Part of cluster/gpu_session.sh, which sources it (the settings and tables are there): what a
# benchmark step's figure depends on (its hash), the record of measurements and the priority
# order of the benchmark steps they give.

# ---- hashes ------------------------------------------------------------------------------------
# step_hashes STEP...: HASH_OF[STEP] = 16 hex digits of sha256 over the step's function text
# and its helpers' (as written in the script and its libraries, steps.sh for the steps), then
# "path sha256" of each file of its HASH_DEPS globs (in the order written, each glob sorted, each
# file once). Text, not bash's `declare -f`, so that the same tree gives the same hash with any
# bash; only the functions' own lines, so that moving one between files keeps its hash. One awk,
# one sha256sum over all files.
declare -A HASH_OF=()
step_hashes() {
  local LC_ALL=C step f g name line text h
  local -A fn=() fh=() seen=()
  local -a files=()
  while IFS=$'\t' read -r name line; do fn[$name]+="$line"$'\n'; done < <(
    awk '/^[a-z_0-9]+\(\) \{/ { name = substr($0, 1, index($0, "(") - 1) } name != "" { print name "\t" $0 } /^}/ { name = "" }' "$SELF" "$LIB"/*.sh)
  shopt -s nullglob
  for step; do
    for g in ${HASH_DEPS[$step]:-}; do
      for f in "$ROOT"/$g; do [[ -f $f && -z ${seen[$f]:-} ]] && { seen[$f]=1; files+=("$f"); }; done
    done
  done
  shopt -u nullglob
  if ((${#files[@]})); then
    while read -r h f; do fh[$f]=$h; done < <(sha256sum "${files[@]}")
  fi
  for step; do
    text=${fn[step_$step]:-}
    for f in ${HASH_FUNCS[$step]:-}; do text+=${fn[$f]:-}; done
    seen=()
    shopt -s nullglob
    for g in ${HASH_DEPS[$step]:-}; do
      for f in "$ROOT"/$g; do
        [[ -f $f && -z ${seen[$f]:-} ]] || continue
        seen[$f]=1
        text+="${f#"$ROOT/"} ${fh[$f]}"$'\n'
      done
    done
    shopt -u nullglob
    h=$(sha256sum <<<"$text")
    HASH_OF[$step]=${h:0:16}
  done
}

source_hash() {  # the sources of the build (SOURCE_DIRS), as the prebuilt archive's MANIFEST records
  (
    cd "$ROOT" || exit 1
    find "${SOURCE_DIRS[@]}" -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
      -o -name '*.cmake' -o -name CMakeLists.txt -o -name '*.in' -o -name '*.proto' \) -print0 2>/dev/null |
      LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
  )
}

# ---- the record of measurements (docs/gpu/measured.tsv) ------------------------------------------
# Lines: step <TAB> UTC date <TAB> commit <TAB> step_hash <TAB> seconds; '#' lines are comments.
declare -A REC_DATE=() REC_COMMIT=() REC_HASH=() REC_SECS=()
load_record() {
  local s d c h sec
  REC_DATE=() REC_COMMIT=() REC_HASH=() REC_SECS=()
  [[ -r $RECORD ]] || return 0
  while IFS=$'\t' read -r s d c h sec; do
    [[ -z $s || $s == \#* ]] && continue
    REC_DATE[$s]=$d REC_COMMIT[$s]=${c:--} REC_HASH[$s]=${h:--} REC_SECS[$s]=${sec:--}
  done <"$RECORD"
}

# bench_order: the benchmark steps by priority, one per line:
# "STEP TIER DATE HASH". TIER 0: never measured; 1: its hash changed since its last figure;
# 2: unchanged; prefixed with "n" when $NEXT (docs/gpu/next.txt) names the step: those come first,
# in that file's order (the session that prepared a change names the steps that measure it).
# Otherwise within a tier the oldest figure first (rotation), then declaration order.
bench_order() {
  local s i=0 h tier date first pos
  local -A next_pos=()
  load_record
  if [[ -r $NEXT ]]; then
    pos=0
    while read -r s _; do
      [[ -z $s || $s == \#* || -z ${KIND[$s]:-} || ${KIND[$s]} != bench ]] && continue  # check_next refuses those
      pos=$((pos + 1))
      [[ -n ${next_pos[$s]:-} ]] || next_pos[$s]=$pos
    done <"$NEXT"
  fi
  step_hashes "${BENCH_STEPS[@]}"
  for s in "${BENCH_STEPS[@]}"; do
    i=$((i + 1))
    h=${HASH_OF[$s]}
    if [[ -z ${REC_DATE[$s]:-} ]]; then
      tier=0 date=0000-00-00
    elif [[ ${REC_HASH[$s]} != "$h" ]]; then
      tier=1 date=${REC_DATE[$s]}
    else
      tier=2 date=${REC_DATE[$s]}
    fi
    if [[ -n ${next_pos[$s]:-} ]]; then
      first=0 pos=${next_pos[$s]} tier=n$tier
    else
      first=1 pos=0
    fi
    printf '%s\t%05d\t%s\t%s\t%05d\t%s\t%s\n' "$first" "$pos" "${tier#n}" "$date" "$i" "$s" "$h|$tier"
  done | LC_ALL=C sort -t$'\t' -k1,1n -k2,2n -k3,3n -k4,4 -k5,5n |
    awk -F'\t' '{ split($7, a, "|"); print $6, a[2], $4, a[1] }'
}

# check_next: every step $NEXT names is a benchmark step (run in the calling shell: bench_order
# runs in a pipeline, where an error could not stop the script).
check_next() {
  local s
  [[ -r $NEXT ]] || return 0
  while read -r s _; do
    [[ -z $s || $s == \#* ]] && continue
    [[ -n ${KIND[$s]:-} && ${KIND[$s]} == bench ]] ||
      die "${NEXT#"$ROOT/"} names '$s', which is no benchmark step (steps: ${BENCH_STEPS[*]})"
  done <"$NEXT"
}

bench_order_into() {  # bench_order_into ARRAY: the steps by priority into ARRAY, their hashes into HASH_OF
  local -n into=$1
  local s tier date h
  check_next
  into=()
  while read -r s tier date h; do
    into+=("$s")
    HASH_OF[$s]=$h
  done < <(bench_order)
}

tier_text() {  # tier_text TIER DATE
  if [[ $1 == n* ]]; then
    echo "first (${NEXT#"$ROOT/"}): $(tier_text "${1#n}" "$2")"
    return
  fi
  case $1 in
    0) echo "never measured" ;;
    1) echo "code changed since $2" ;;
    *) echo "measured $2" ;;
  esac
}
