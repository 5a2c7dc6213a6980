#!/usr/bin/env bash
# cmake --install puts libraries, headers and a package config in a prefix and prints that
# prefix; outside CMake projects configured with it find_package(dtrain), link dtrain::engine
# and run. Three consumers:
#   c_cxx      tests/install/consumer, project(consumer C CXX)
#   cxx_only   tests/install/cxx_only, project(app CXX): the README's example, verbatim
#   no_toolkit cxx_only again, on a simulated machine without the CUDA toolkit
# Each consumer is a user's first program (consumer/main.cc): its own model and dataset on
# dtrain's command line and trainer. Each also runs on 2 ranks with half the batch and must log
# the curve of 1 rank on the whole batch; the CXX-only one is also preempted and resumed.
# usage: install_test.sh BUILD_DIR SOURCE_DIR [MPIRUN COMMAND]
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
read -ra mpirun <<<"${3:-mpirun --oversubscribe --allow-run-as-root}"
here=$src/tests/install
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
cmake_bin=$(command -v cmake)
ninja_bin=$(command -v ninja)

# The README shows tests/install/cxx_only/CMakeLists.txt: the first ```cmake block after its name.
readme_block=$(awk '/tests\/install\/cxx_only\/CMakeLists.txt/ {named=1}
  named && /^```cmake$/ {inside=1; next}  inside && /^```$/ {exit}  inside' "$src/README.md")
[[ $readme_block == "$(cat "$here/cxx_only/CMakeLists.txt")" ]] ||
  fail "README.md's example differs from tests/install/cxx_only/CMakeLists.txt"

# A relative --prefix: what the install prints must be the absolute prefix consumers need.
install_log=$(cd "$work" && "$cmake_bin" --install "$build" --prefix prefix)
prefix=$(sed -n 's/^-- dtrain installed: configure consumers with -DCMAKE_PREFIX_PATH=//p' <<<"$install_log")
[[ $prefix == "$work/prefix" ]] || fail "the install printed prefix '$prefix', expected $work/prefix"
with_cuda=$(grep -c '^set(DTRAIN_WITH_CUDA ON)' "$prefix"/lib*/cmake/dtrain/dtrainConfig.cmake || true)
# The engine's Tokenizer loads libdtrain_sentencepiece.so from the directory of libdtrain_engine.so.
if [[ -f $build/lib/libdtrain_sentencepiece.so ]]; then
  for engine_lib in "$prefix"/lib*/libdtrain_engine.so; do
    [[ -f $(dirname "$engine_lib")/libdtrain_sentencepiece.so ]] ||
      fail "the install has no libdtrain_sentencepiece.so beside $engine_lib (the Tokenizer looks there)"
  done
fi

# consumer NAME SOURCE_DIR PROGRAM [cmake args]: configure, build and run under $consumer_env.
consumer_env=()
consumer() {
  local name=$1 dir=$2 program=$3 out
  shift 3
  env "${consumer_env[@]}" "$cmake_bin" -S "$dir" -B "$work/$name" -G Ninja \
    -DCMAKE_MAKE_PROGRAM="$ninja_bin" -DCMAKE_PREFIX_PATH="$prefix" "$@" >"$work/$name.log" 2>&1 ||
    { cat "$work/$name.log"; fail "$name: configure"; }
  env "${consumer_env[@]}" "$cmake_bin" --build "$work/$name" >>"$work/$name.log" 2>&1 ||
    { cat "$work/$name.log"; fail "$name: build"; }
  out=$(env "${consumer_env[@]}" GLOG_minloglevel=0 "$work/$name/$program" 2>"$work/$name.err") ||
    { cat "$work/$name.err"; fail "$name: the program failed"; }
  echo "$name: $out"
  [[ $out =~ ^dtrain\ 0\.1\.0:\ 12\ steps\ on\ 1\ rank\(s\),\ loss\ [0-9.]+$ ]] || fail "$name printed '$out'"
}

consumer c_cxx "$here/consumer" consumer
# Its main.cc includes <glog/logging.h> before libtorch's and dtrain's headers: LOG(INFO) must
# still reach glog (libtorch's own macros would drop it without a word).
grep -q "consumer: an INFO line through glog" "$work/c_cxx.err" ||
  { cat "$work/c_cxx.err"; fail "c_cxx: LOG(INFO) with <glog/logging.h> included first printed nothing"; }
consumer cxx_only "$here/cxx_only" app
if grep -q '^CMAKE_C_COMPILER:' "$work/cxx_only/CMakeCache.txt"; then fail "cxx_only: C got enabled"; fi
# Data parallelism from the package: 2 ranks x 32 samples log the loss curve of 1 rank x 64
# (fit() shards the loader the program left unsharded; fp32 sums in another order: 1e-5).
# data_parallel NAME: for the consumer built in $work/NAME, under $consumer_env.
data_parallel() {
  local name=$1 app=$work/$1/app
  [[ -x $app ]] || app=$work/$1/consumer
  env "${consumer_env[@]}" "$app" --batch_size=64 --metrics="$work/$name-one.jsonl" >/dev/null 2>"$work/one.err" ||
    { cat "$work/one.err"; fail "$name: 1 rank"; }
  env "${consumer_env[@]}" "${mpirun[@]}" -np 2 "$app" --batch_size=32 --metrics="$work/$name-two.jsonl" \
    >"$work/two.out" 2>&1 || { cat "$work/two.out"; fail "$name: 2 ranks"; }
  grep -q "12 steps on 2 rank(s)" "$work/two.out" || { cat "$work/two.out"; fail "$name: 2 ranks: no summary"; }
  python3 - "$name" "$work/$name-one.jsonl" "$work/$name-two.jsonl" <<'PY' || fail "$name: 2 x 32 does not follow 1 x 64"
import json, sys
one, two = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[2:])
assert len(one) == len(two) == 12, (len(one), len(two))
worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
assert worst < 1e-5, f"worst relative difference {worst:.2e}"
assert one[-1] < 0.8 * one[0], f"the loss does not fall: {one[0]} -> {one[-1]}"
print(f"{sys.argv[1]}: 2 ranks x 32 follow 1 rank x 64 over 12 steps (worst relative difference {worst:.1e}), "
      f"loss {one[0]:.4f} -> {one[-1]:.4f}")
PY
}
data_parallel c_cxx
# The consumer's own decoder model (decoder.cc: plain modules and a ModelSpec) trains with each
# technique the trainer applies to its blocks, and logs the loss curve of one rank.
decoder=$work/c_cxx/decoder
env GLOG_minloglevel=1 "$decoder" --metrics="$work/decoder-one.jsonl" >"$work/decoder.out" 2>&1 ||
  { cat "$work/decoder.out"; fail "decoder: 1 rank"; }
layouts=("2|--shard=parameters --batch_size=4" "2|--pp=2 --accum_steps=2" "2|--tp=2" "1|--checkpoint_activations"
         "1|--offload=layers" "2|--pp=2 --accum_steps=2 --checkpoint_activations" "2|--tp=2 --checkpoint_activations")
for layout in "${layouts[@]}"; do
  np=${layout%%|*}
  read -ra flags <<<"${layout#*|}"
  env GLOG_minloglevel=1 "${mpirun[@]}" -np "$np" "$decoder" "${flags[@]}" --metrics="$work/decoder-other.jsonl" \
    >"$work/decoder.out" 2>&1 || { cat "$work/decoder.out"; fail "decoder: ${flags[*]} on $np rank(s)"; }
  python3 - "${flags[*]} on $np rank(s)" "$work/decoder-one.jsonl" "$work/decoder-other.jsonl" <<'PY' ||
import json, sys
one, other = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[2:])
assert len(one) == len(other) == 6, (len(one), len(other))
worst = max(abs(a - b) / abs(a) for a, b in zip(one, other))
assert worst < 1e-5, f"worst relative difference {worst:.2e}: {one} vs {other}"
assert one[-1] < one[0], f"the loss does not fall: {one}"
print(f"decoder {sys.argv[1]}: the curve of 1 rank over 6 steps (worst relative difference {worst:.1e})")
PY
    fail "decoder: ${flags[*]} on $np rank(s) does not follow 1 rank"
done
data_parallel cxx_only
app=$work/cxx_only/app
# Preemption from the package: SIGUSR1 (the program never installs a handler) saves a
# checkpoint and exits 85; --resume=auto continues to the end.
"$app" --steps=1000000 --save_dir="$work/ck" --metrics="$work/pre.jsonl" >"$work/pre.out" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q '"step"' "$work/pre.jsonl" 2>/dev/null && break; sleep 0.1; done
sleep 0.5
kill -USR1 $pid
status=0; wait $pid || status=$?
[[ $status == 85 ]] || { cat "$work/pre.out"; fail "SIGUSR1: exit status $status, expected 85"; }
grep -q "app: preempted at step" "$work/pre.out" || { cat "$work/pre.out"; fail "SIGUSR1: no preemption message"; }
saved=$(ls "$work/ck"/step-*.pt 2>/dev/null | sed -n 's/.*step-0*\([0-9][0-9]*\)\.pt$/\1/p' | tail -1)
[[ -n $saved ]] || fail "SIGUSR1: no checkpoint saved"
end=$((saved + 5))
"$app" --steps=$end --save_dir="$work/ck" --resume=auto >"$work/resumed.out" 2>&1 || { cat "$work/resumed.out"; fail "resume"; }
grep -q "$end steps on 1 rank" "$work/resumed.out" || { cat "$work/resumed.out"; fail "resume: did not reach step $end"; }
echo "cxx_only: SIGUSR1 -> checkpoint and exit 85 without install_preemption_handlers(); --resume=auto finishes"
# Where this machine's toolkit is, as the with-toolkit consumer found it (empty if none).
toolkit=$(sed -n 's/^CUDAToolkit_BIN_DIR:[A-Z]*=\(.*\)\/bin$/\1/p' "$work/cxx_only/CMakeCache.txt")

# No CUDA toolkit: find_package(CUDAToolkit) is disabled (the toolkit's /usr/local/cuda would be
# found even without nvcc on PATH), nvcc is off PATH and the CUDA variables are unset.
nocuda_path=
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do [[ -x $d/nvcc ]] || nocuda_path+=${nocuda_path:+:}$d; done
consumer_env=(-u CUDA_HOME -u CUDA_PATH -u CUDAToolkit_ROOT -u CUDACXX -u LIBRARY_PATH -u CPATH
  PATH="$nocuda_path")
consumer no_toolkit "$here/cxx_only" app -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit:BOOL=ON
data_parallel no_toolkit
nt=$work/no_toolkit
grep -q '^CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit:BOOL=ON' "$nt/CMakeCache.txt" || fail "no_toolkit: not disabled"
if grep '^CUDAToolkit_' "$nt/CMakeCache.txt"; then fail "no_toolkit: find_package(CUDAToolkit) ran"; fi
if ((with_cuda)); then
  grep -q 'dtrain: no CUDA toolkit' "$nt.log" || fail "no_toolkit: the package did not report the missing toolkit"
  # dtrain::torch_cuda still links, the CUDA runtime from the wheel (--as-needed may drop it
  # from the program, libc10_cuda loads it anyway).
  readelf -d "$nt/app" | grep 'NEEDED.*libtorch_cuda.so' >/dev/null || fail "no_toolkit: libtorch_cuda.so not linked"
  grep -q '/nvidia/[^ ]*/lib/libcudart\.so' "$nt/build.ninja" || fail "no_toolkit: not linked with the wheel's libcudart"
fi
if [[ -n $toolkit ]]; then
  grep -qF "$toolkit/" "$work/cxx_only/build.ninja" || fail "cxx_only: expected the toolkit $toolkit in use"
  for t in "$toolkit" "$(realpath "$toolkit")"; do
    if grep -F "$t/" "$nt/build.ninja"; then fail "no_toolkit: the build uses the toolkit at $t"; fi
  done
fi
echo "no_toolkit: no CUDA toolkit${toolkit:+ ($toolkit)} in its configure or build"
