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
# 2: unchanged. Within a tier the oldest figure first (rotation), then declaration order.
bench_order() {
  local s i=0 h tier date
  load_record
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
    printf '%s\t%s\t%05d\t%s\t%s\n' "$tier" "$date" "$i" "$s" "$h"
  done | LC_ALL=C sort -t$'\t' -k1,1n -k2,2 -k3,3n | awk -F'\t' '{ print $4, $1, $2, $5 }'
}

bench_order_into() {  # bench_order_into ARRAY: the steps by priority into ARRAY, their hashes into HASH_OF
  local -n into=$1
  local s tier date h
  into=()
  while read -r s tier date h; do
    into+=("$s")
    HASH_OF[$s]=$h
  done < <(bench_order)
}

tier_text() {  # tier_text TIER DATE
  case $1 in
    0) echo "never measured" ;;
    1) echo "code changed since $2" ;;
    *) echo "measured $2" ;;
  esac
}
