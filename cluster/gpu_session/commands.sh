# shellcheck shell=bash
# Part of cluster/gpu_session.sh, which sources it (the settings and tables are there): the
# configure check, the internal commands that some steps run as `bash gpu_session.sh NAME`, and
# the fakes that stand in for the GPU commands in the tests.

# ---- check-configure ---------------------------------------------------------------------------
# A configure that misses the CUDA toolkit (or finds a CPU-only torch, or no NCCL wheel) still
# succeeds and builds a tree whose GPU tests all skip: a wasted session. CMakeLists.txt prints the
# effective values; anything but ON for both is refused.
check_configure() {
  local log=$1 line cuda nccl
  if [[ ! -r $log ]]; then
    echo "check-configure: cannot read '$log'" >&2
    return 3
  fi
  line=$(grep -E 'dtrain: CUDA code paths [^ ,]+, NCCL backend [^ ,]+' "$log" | tail -1)
  if [[ -z $line ]]; then
    echo "check-configure: '$log' has no 'dtrain: CUDA code paths ..., NCCL backend ...' line: configure" \
      "stopped before the summary (see the errors above it) or this is not a dtrain configure log." \
      "Fix the first CMake error, then configure again with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON." >&2
    return 3
  fi
  cuda=$(sed -E 's/.*CUDA code paths ([^ ,]+),.*/\1/' <<<"$line")
  nccl=$(sed -E 's/.*NCCL backend ([^ ,]+).*/\1/' <<<"$line")
  if [[ $cuda != ON ]]; then
    echo "check-configure: CUDA code paths are $cuda ($line): CMake found no CUDA toolkit, or the torch of" \
      "DTRAIN_PYTHON has no CUDA (no lib/libtorch_cuda.so); the build would compile no GPU code and every" \
      "GPU test would skip. Fix: put nvcc on PATH (export PATH=/usr/local/cuda/bin:\$PATH) or pass" \
      "-DCUDAToolkit_ROOT=/usr/local/cuda, use a CUDA torch (python3 -c 'import torch;print(torch.version.cuda)')," \
      "and configure with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON." >&2
    return 3
  fi
  if [[ $nccl != ON ]]; then
    echo "check-configure: NCCL backend is $nccl ($line): the nvidia-nccl wheel next to torch was not" \
      "found (see the 'DTRAIN_WITH_NCCL=ON but' warning above it) or NCCL was switched off. Fix: make" \
      "python3 -c 'import nvidia.nccl' work for DTRAIN_PYTHON and configure with -DDTRAIN_WITH_NCCL=ON." >&2
    return 3
  fi
  echo "check-configure: $line"
  return 0
}

# ---- internal commands (each a step's bounded command) -----------------------------------------
# gtest-run NP XMLDIR BINDIR: lists the tests (none: exit 5), then runs them at NP processes,
# each writing XMLDIR/np1.xml or XMLDIR/npNP-rankR.xml.
gtest_run() {
  local np=$1 dir=$2 bin=$3 listed
  local -a g=("$bin/dtrain_gpu_tests")
  ((FAKE)) && g=(bash "$SELF" fake-gtest) TEST_MPIRUN=(bash "$SELF" fake-mpirun)
  mkdir -p "$dir" && rm -f "$dir/np$np"*.xml
  listed=$(GPU_SESSION_FAKE_NP=$np "${g[@]}" --gtest_list_tests | grep -c '^  ')
  echo "gtest-run: $listed tests listed, running them at $np process(es)"
  if ((listed == 0)); then
    echo "gtest-run: ERROR: dtrain_gpu_tests lists no tests"
    return 5
  fi
  if ((np == 1)); then
    GTEST_OUTPUT="xml:$dir/np1.xml" "${g[@]}"
  else
    "${TEST_MPIRUN[@]}" -np "$np" bash -c 'GTEST_OUTPUT="xml:$1/np$2-rank${OMPI_COMM_WORLD_RANK:-X}.xml" exec "${@:3}"' \
      _ "$dir" "$np" "${g[@]}"
  fi
}

write_manifest() {  # write_manifest PYTHON: what a prebuilt archive was built from
  echo "sources=$(source_hash)"
  echo "source_dir=$ROOT"
  echo "python=$1"
  echo "torch=$({ ((FAKE)) && echo fake; } || "$1" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')"
  echo "built=$(date -u '+%F %H:%M') on $(hostname)"
  echo "commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
}

# archive_build BUILD_DIR ARCHIVE PYTHON: bin/ (the BUILD_TARGETS), lib/ and a MANIFEST into
# ARCHIVE.tmp (the caller renames it). Prints the archive's size in bytes.
archive_build() {
  local build=$1 archive=$2 py=$3 stage t
  stage="$build/.stage"
  rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/lib" || return 1
  for t in "${BUILD_TARGETS[@]}"; do
    [[ -e $build/bin/$t ]] || { echo "archive: $build/bin/$t is missing" >&2; return 1; }
    cp -a "$build/bin/$t" "$stage/bin/"
  done
  cp -a "$build"/lib/*.so* "$stage/lib/" 2>/dev/null
  write_manifest "$py" >"$stage/MANIFEST"
  tar -C "$stage" -czf "$archive.tmp" . || return 1
  rm -rf "$stage"
  stat -c %s "$archive.tmp"
}

save_build() {  # save-build BUILD_DIR ARCHIVE PYTHON: the device build, for a second command
  local bytes
  bytes=$(archive_build "$1" "$2" "$3") || { rm -f "$2.tmp"; echo "save-build: FAILED to pack $1"; return 1; }
  if ((bytes > OUT_FILE_BYTES_MAX)); then
    rm -f "$2.tmp"
    echo "save-build: not kept: $((bytes >> 20)) MiB is over the 16 MiB a file of \$OUT may have"
    return 0
  fi
  mv -f "$2.tmp" "$2"
  echo "save-build: kept $(basename "$2") ($((bytes >> 10)) KiB): put it into .gpu-build/ for a second command"
}

# prebuilt-check ARCHIVE DEST: unpack; refuse (non-zero, a "prebuilt-check: REFUSED: why" line)
# when its sources are not this tree's, its torch is not this python3's, a program or library
# misses a library (ldd "not found", LD_LIBRARY_PATH as the session sets it), or the GPU test
# binary lists no tests.
prebuilt_check() {
  local archive=$1 dest=$2 want have f missing=() listed srcdir py
  rm -rf "$dest" && mkdir -p "$dest" || return 1
  tar -C "$dest" -xzf "$archive" || { echo "prebuilt-check: REFUSED: cannot unpack $archive"; return 3; }
  [[ -r $dest/MANIFEST ]] || { echo "prebuilt-check: REFUSED: no MANIFEST in $archive"; return 3; }
  sed 's/^/prebuilt-check: manifest: /' "$dest/MANIFEST"
  want=$(sed -n 's/^sources=//p' "$dest/MANIFEST")
  have=$(source_hash)
  if [[ $want != "$have" ]]; then
    echo "prebuilt-check: REFUSED: stale: built from sources $want, this tree is $have (pack again)"
    return 3
  fi
  f=$(sed -n 's/^torch=//p' "$dest/MANIFEST")
  if [[ -n $f && $f != '?' ]]; then
    have=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
    [[ $f == "$have" ]] || { echo "prebuilt-check: REFUSED: built against torch $f, python3 here has $have"; return 3; }
  fi
  # The tests find the sources and python through paths compiled in (tests/CMakeLists.txt:
  # DTRAIN_SOURCE_DIR, DTRAIN_TEST_PYTHON): point them here when they do not exist.
  srcdir=$(sed -n 's/^source_dir=//p' "$dest/MANIFEST")
  if [[ -n $srcdir && $srcdir != "$ROOT" ]]; then
    if [[ -e $srcdir ]]; then
      echo "prebuilt-check: REFUSED: built in $srcdir, which exists here and is not this tree ($ROOT)"
      return 3
    fi
    mkdir -p "$(dirname "$srcdir")" && ln -s "$ROOT" "$srcdir" && echo "prebuilt-check: linked $srcdir -> $ROOT"
  fi
  py=$(sed -n 's/^python=//p' "$dest/MANIFEST")
  if [[ -n $py && ! -e $py ]] && command -v python3 >/dev/null; then
    # A wrapper, not a symbolic link: a virtual environment's python reached through a link
    # elsewhere loses its environment (its packages, torch among them).
    mkdir -p "$(dirname "$py")" && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$py" &&
      chmod +x "$py" && echo "prebuilt-check: $py runs $(command -v python3)"
  fi
  export LD_LIBRARY_PATH="$dest/lib:${LD_LIBRARY_PATH:-}"
  for f in "$dest"/bin/* "$dest"/lib/*.so*; do
    [[ -f $f && ! -L $f ]] || continue
    while read -r line; do missing+=("$(basename "$f"): $line"); done < <(ldd "$f" 2>&1 | grep 'not found')
  done
  if ((${#missing[@]})); then
    printf 'prebuilt-check: ldd: %s\n' "${missing[@]}"
    echo "prebuilt-check: REFUSED: ${#missing[@]} unresolved libraries, first: ${missing[0]}"
    return 4
  fi
  listed=$("$dest/bin/dtrain_gpu_tests" --gtest_list_tests 2>&1 | grep -c '^  ')
  if ((listed == 0)); then
    echo "prebuilt-check: REFUSED: $dest/bin/dtrain_gpu_tests --gtest_list_tests lists no tests"
    return 5
  fi
  echo "prebuilt-check: ok: ldd clean, dtrain_gpu_tests lists $listed tests"
}

# ---- fakes (GPU_SESSION_FAKE=1): short stand-ins for the GPU commands, for the tests ------------
# fake-step STEP: prints a start line, 3 lines a GPU_SESSION_FAKE_SLEEP (0.1 s) apart, then acts
# on GPU_SESSION_FAKE_<STEP>: ok (default), fail (exit 1), hang (sleeps past any limit), stubborn
# (ignores SIGTERM too), sleep:S, off (configure prints CUDA OFF). build creates a fake bin/ and lib/.
fake_step() {
  local step=$1 var="GPU_SESSION_FAKE_$1" mode i pause=${GPU_SESSION_FAKE_SLEEP:-0.1}
  mode=${!var:-ok}
  echo "fake-output $step start ($mode)"
  case $step in
    gpuinfo) echo "FAKE H100 80GB HBM3, 580.159.04, 81559 MiB" ;;
    configure) echo "-- dtrain: CUDA code paths $([[ $mode == off ]] && echo OFF || echo ON), NCCL backend ON" ;;
    build)
      mkdir -p "$BUILD/bin" "$BUILD/lib"
      for i in "${BUILD_TARGETS[@]}"; do echo "fake $i" >"$BUILD/bin/$i"; done
      echo fake >"$BUILD/lib/libdtrain_fake.so"
      ;;
    prebuilt) [[ $mode == ok ]] && echo "prebuilt-check: ok (fake)" || echo "prebuilt-check: REFUSED: fake refusal" ;;
  esac
  for ((i = 1; i <= 3; i++)); do
    sleep "$pause"
    echo "fake-output $step line $i: trained 1 steps, 1.0 ms/step, MFU 1%, \"bench\" 1 GB/s, shard=x, peak 1 MiB"
  done
  echo "| fake $step | 1.0 | 1 |"
  case $mode in
    ok | off) return 0 ;;
    fail) echo "fake-output $step: failing as told"; return 1 ;;
    hang) echo "fake-output $step: hanging"; sleep 1000 ;;
    stubborn) trap '' TERM; echo "fake-output $step: ignoring SIGTERM"; while :; do sleep 0.2; done ;;
    sleep:*) sleep "${mode#sleep:}" ;;
  esac
}

# fake-gtest: stands in for dtrain_gpu_tests. GPU_SESSION_FAKE_GTEST_NP1 / _NP2 (chosen by the
# world size) = LISTED:CASES:SKIPPED:FAILURES (default 25:25:1:0), or noxml (writes none).
fake_gtest() {
  local np=${GPU_SESSION_FAKE_NP:-${OMPI_COMM_WORLD_SIZE:-1}} var spec listed cases skipped failures i xml r
  var="GPU_SESSION_FAKE_GTEST_NP$np"
  spec=${!var:-25:25:1:0}
  [[ $spec == noxml ]] && listed=25 || IFS=: read -r listed cases skipped failures <<<"$spec"
  if [[ ${1:-} == --gtest_list_tests ]]; then
    ((listed > 0)) && echo "FakeSuite."
    for ((i = 0; i < listed; i++)); do echo "  Case$i"; done
    return 0
  fi
  sleep "${GPU_SESSION_FAKE_SLEEP:-0.1}"
  if [[ $spec == noxml ]]; then echo "[  PASSED  ] 25 tests (fake, no XML)"; return 0; fi
  echo "[==========] Running $cases tests from 1 test suite. (fake, rank ${OMPI_COMM_WORLD_RANK:-0})"
  xml=${GTEST_OUTPUT#xml:}
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites tests=\"$cases\" failures=\"$failures\" disabled=\"0\" errors=\"0\" name=\"AllTests\">"
    echo "  <testsuite name=\"FakeSuite\" tests=\"$cases\" failures=\"$failures\" skipped=\"$skipped\">"
    for ((i = 0; i < cases; i++)); do
      r=completed
      ((i < skipped)) && r=skipped
      if ((i >= cases - failures)); then
        echo "    <testcase name=\"Case$i\" status=\"run\" result=\"$r\" classname=\"FakeSuite\"><failure message=\"fake\" type=\"\"/></testcase>"
      elif [[ $r == skipped ]]; then
        echo "    <testcase name=\"Case$i\" status=\"run\" result=\"skipped\" classname=\"FakeSuite\"><skipped message=\"fake\"/></testcase>"
      else
        echo "    <testcase name=\"Case$i\" status=\"run\" result=\"completed\" classname=\"FakeSuite\"/>"
      fi
    done
    echo "  </testsuite>"
    echo "</testsuites>"
  } >"$xml"
  if ((failures > 0)); then echo "[  FAILED  ] $failures tests (fake)"; return 1; fi
  echo "[  PASSED  ] $((cases - skipped)) tests. (fake)"
  ((skipped > 0)) && echo "[  SKIPPED ] $skipped tests (fake)"
  return 0
}

fake_mpirun() {  # fake-mpirun [-np N] [options] CMD...: N copies of CMD with OMPI_COMM_WORLD_* set
  local np=1 r rc=0
  local -a pids=()
  while (($#)); do
    case $1 in
      -np) np=$2; shift 2 ;;
      -x) shift 2 ;;
      --mca) shift 3 ;;
      -*) shift ;;
      *) break ;;
    esac
  done
  for ((r = 0; r < np; r++)); do
    OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=$np "$@" &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=$?; done
  return $rc
}
