# shellcheck shell=bash
# Part of cluster/gpu_session.sh, which sources it (the settings and tables are there): what each
# step runs. The text of a step_ function and of its HASH_FUNCS helpers is part of its hash
# (record.sh): a change here moves that step's hash alone.

# ---- the steps ---------------------------------------------------------------------------------
# step_NAME (in the session's shell, quick, no side effects) prepares the step: it sets CMD (the
# one bounded command), TITLE, PATTERN (the lines of its output the summary shows) and SHOWN (the
# command the summary shows), and returns 0 to run it; or sets WHY and returns 1 (SKIPPED: it
# cannot run), 2 (n/a: not needed) or 3 (FAIL without running). post_NAME RC, where defined, runs
# after the command: it may set POST_STATUS and POST_NOTE, and the session's state (HAVE_BUILD...).
CMD=() TITLE="" PATTERN="" SHOWN="" WHY="" POST_STATUS="" POST_NOTE=""
bench() {  # bench TITLE PATTERN CMD...: a measuring step's command; SHOW replaces the one shown
  TITLE=$1 PATTERN=$2
  shift 2
  CMD=("$@")
  SHOWN=${SHOW:-${*#"$BIN/"}}
}
need_build() {
  ((HAVE_BUILD)) && return 0
  WHY="no build (${BUILD_NOTE:-the build steps did not succeed})"
  return 1
}

step_gpuinfo() {
  # No GPU visible: stop before spending minutes on a build whose tests would all skip.
  TITLE="GPU" PATTERN='.'
  # shellcheck disable=SC2054  # the commas are nvidia-smi's
  CMD=(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)
}
post_gpuinfo() {
  if (($1 == 0)); then
    grep -m1 -v -E '^(fake-output|\| fake)' "$STATE/gpuinfo.out" >"$BUILD/gpu-info.txt"
  else
    STOP_REASON="no GPU visible (gpuinfo failed)"
    POST_NOTE="nvidia-smi failed: no GPU visible; nothing else runs"
  fi
}

step_unpack() {
  if [[ -d $DEPS/usr ]]; then WHY="unpacked by an earlier command on this machine"; return 2; fi
  if ((!FAKE)) && ! compgen -G ".deps/*.deb" >/dev/null; then
    WHY="no .deps/*.deb: run 'bash cluster/gpu_session.sh fetch' here and carry .deps"
    STOP_REASON="no Debian packages (.deps) carried"
    return 3
  fi
  # Only a complete unpack counts (the rename at its end).
  CMD=(bash -c 'rm -rf "$1.tmp" && mkdir -p "$1.tmp" && for f in .deps/*.deb; do dpkg -x "$f" "$1.tmp" || exit 1; done &&
    mv "$1.tmp" "$1" && echo "unpacked $(ls .deps/*.deb | wc -l) packages into $1"' _ "$DEPS")
}
post_unpack() { (($1 == 0)) || STOP_REASON="the Debian packages did not unpack"; }

step_prebuilt() {
  if [[ ! -r $PREBUILT ]]; then WHY="no ${PREBUILT#"$ROOT/"} carried: configure and build here"; return 2; fi
  CMD=(bash "$SELF" prebuilt-check "$PREBUILT" "$BUILD/prebuilt")
  PATTERN='^prebuilt-check: '
}
post_prebuilt() {
  local why
  if (($1 == 0)); then
    HAVE_BUILD=1
    BIN="$BUILD/prebuilt/bin"
    export LD_LIBRARY_PATH="$BUILD/prebuilt/lib:$LD_LIBRARY_PATH"
    BUILD_NOTE="prebuilt $(grep -E '^(sources|built)=' "$BUILD/prebuilt/MANIFEST" 2>/dev/null | tr '\n' ' ')"
    POST_NOTE="used: ldd and --gtest_list_tests ok"
  else
    why=$(grep '^prebuilt-check: REFUSED' "$STATE/prebuilt.out" | tail -1)
    POST_STATUS=refused  # not a failure of the session: configure and build follow
    POST_NOTE="${why#prebuilt-check: REFUSED: }; configure and build here instead"
  fi
}

step_configure() {
  if ((HAVE_BUILD)); then WHY="prebuilt binaries used"; return 2; fi
  # Always (re)configure: quick on an existing tree, and it prints the summary line to check.
  CMD=(cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON -DDTRAIN_WITH_SENTENCEPIECE=OFF -DDTRAIN_PYTHON="$(command -v python3)"
    -DCMAKE_PREFIX_PATH="$DEPS/usr" -DCMAKE_MODULE_PATH="$DEPS/usr/share/glog/cmake"
    -DProtobuf_PROTOC_EXECUTABLE="$DEPS/usr/bin/protoc")
  PATTERN='dtrain: CUDA code paths|CMake Error'
}
post_configure() {
  (($1 == 0)) || return 0
  if check_configure "$STATE/configure.out" >>"$LOG" 2>&1; then
    CONFIGURED=1
  else
    POST_STATUS=FAIL
    POST_NOTE="CUDA or NCCL not ON: see check-configure in session.log"
  fi
}

step_build() {
  if ((HAVE_BUILD)); then WHY="prebuilt binaries used"; return 2; fi
  if ((!CONFIGURED)); then WHY="configure ${STATUS[configure]:-did not run}"; return 1; fi
  CMD=(cmake --build "$BUILD" -j "$(nproc)" --target "${BUILD_TARGETS[@]}")
  PATTERN='error|FAILED'
}
post_build() {
  if (($1 == 0)); then
    HAVE_BUILD=1 BUILT_HERE=1 BIN="$BUILD/bin"
    BUILD_NOTE="built here"
    tail -1 "$STATE/build.out" >"$STATE/build.match"
  else
    # The tail of a failed build comes back in the summary too (all of it is in session.log).
    tail -200 "$STATE/build.out" >"$STATE/build.match"
    BUILD_NOTE="the build failed"
    POST_NOTE="first error: $(grep -m1 -E 'error|FAILED' "$STATE/build.out" | cut -c1-160)"
  fi
}

step_save_build() {
  if ((!BUILT_HERE)); then WHY="nothing built here (prebuilt used, or no build)"; return 2; fi
  # The build, for a second command on a bare machine: fetched from $OUT into .gpu-build/.
  CMD=(bash "$SELF" save-build "$BUILD" "$OUT/prebuilt.tgz" "$(command -v python3)")
  PATTERN='^save-build: '
}
post_save_build() { POST_NOTE=$(grep '^save-build: ' "$STATE/save_build.out" | tail -1 | cut -d' ' -f2-); }

# The GPU tests, run as ctest registers them (tests/gpu/CMakeLists.txt: gpu.np1 is the binary,
# gpu.mpi.np2 the binary under mpirun -np 2) but without ctest: a prebuilt archive has no build
# tree, and each MPI rank needs its own GTEST_OUTPUT file (one shared setting lets the ranks
# overwrite each other's). gtest-run fails when the binary lists no tests; post_test_np* reads
# the XMLs.
step_test_np1() {
  need_build || return 1
  CMD=(env "${TEST_ENV[@]}" bash "$SELF" gtest-run 1 "$FILES/gtest" "$BIN")
  PATTERN='^gtest-run: |^\[  (PASSED|FAILED|  SKIPPED) |tests? ran|FAILED TEST'
}
step_test_np2() {
  need_build || return 1
  CMD=(env "${TEST_ENV[@]}" bash "$SELF" gtest-run 2 "$FILES/gtest" "$BIN")
  PATTERN='^gtest-run: |^\[  (PASSED|FAILED|  SKIPPED) |tests? ran|FAILED TEST|^\[rank [0-9]+\] FAILED'
}
post_test_np1() { judge_gtest "$1" 1; }
post_test_np2() { judge_gtest "$1" 2; }

# judge_gtest RC NP: no false pass. FAIL unless every expected XML (np1.xml, or np2-rank0/1.xml)
# exists and shows cases > 0, not all of them skipped, no failure, and RC is 0.
judge_gtest() {
  local rc=$1 np=$2 f r cases skipped failures notes=() bad=0
  local -a files=()
  if ((np == 1)); then files=("$FILES/gtest/np1.xml"); else
    for ((r = 0; r < np; r++)); do files+=("$FILES/gtest/np$np-rank$r.xml"); done
  fi
  if ((rc == 5)); then
    POST_STATUS=FAIL POST_NOTE="dtrain_gpu_tests lists no tests"
    return
  fi
  r=0
  for f in "${files[@]}"; do
    local who="np1"
    ((np > 1)) && who="rank $r"
    r=$((r + 1))
    if [[ ! -s $f ]]; then
      notes+=("$who: no XML (crashed, or ran nothing)")
      bad=1
      continue
    fi
    cases=$(grep -c '<testcase ' "$f")
    skipped=$(grep -c 'result="skipped"' "$f")
    failures=$(grep -c '<failure' "$f")
    notes+=("$who: $cases cases, $skipped skipped, $failures failures")
    if ((cases == 0)); then
      notes+=("$who ran 0 cases")
      bad=1
    elif ((skipped == cases)); then
      notes+=("$who: every case skipped (no CUDA device seen?)")
      bad=1
    fi
    ((failures > 0)) && bad=1
  done
  ((rc != 0)) && bad=1  # (finish_step's note names the exit status)
  POST_NOTE=$(IFS=';'; echo "${notes[*]}" | sed 's/;/; /g')
  ((bad)) && POST_STATUS=FAIL
}

step_s2s() {
  need_build || return 1
  bench "s2s seed model, rows s2s fp32 .. eval (tools/techniques.sh --device=cuda)" '^\|' \
    env DTRAIN_BIN="$BIN" bash tools/techniques.sh --device=cuda --steps=20 --log_every=10
}
step_gpt124m() {
  need_build || return 1
  bench "gpt124m AMP bf16" 'trained|MFU' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --steps=30 --log_every=10 --progress=false
}
# PyTorch's own step for the same GPT, eager and torch.compile, in the same command as gpt124m:
# the anchors of its ratios (tools/gpt_torch_bench.py; compilation is most of the time).
step_gpt_anchor() {
  bench "gpt124m AMP bf16, PyTorch eager and torch.compile (tools/gpt_torch_bench.py)" '"bench"' \
    env PYTHONUNBUFFERED=1 python3 tools/gpt_torch_bench.py --modes=eager,compile --steps=30 --warmup=10
}
# The step without host launches (--cuda_graph) beside the eager one, each counting the host's
# synchronizations with the device (--count_host_syncs).
# Each of eager and --cuda_graph twice: with ATen's block ops (DTRAIN_FUSED_BLOCK_OPS=0), then with
# dtrain's fused LayerNorm and bias + GELU kernels (=1; off by default until verified), so the kernels' effect on the
# whole step is a ratio of one command. Then the graph on bfloat16 weights with a float32
# master (--param_dtype=bf16 --shard=optimizer at one rank): no per-step weight casts. Last, the
# graph with attention by FlashAttention-2 and by FlashAttention-3 alone (DTRAIN_SDPA_BACKENDS):
# torch 2.11 picks cuDNN's attention on the H100, whose layout copies of q, k, v, the output and
# its gradient took about 1 ms of the H200 step (direct_copy_kernel, 103 calls per step).
step_gpt_graph() {
  need_build || return 1
  SHOW="train_gpt --amp=bf16 --count_host_syncs, eager then --cuda_graph, each with DTRAIN_FUSED_BLOCK_OPS=0 then fused; then --cuda_graph --param_dtype=bf16 --shard=optimizer" \
    bench "gpt124m AMP bf16, eager then --cuda_graph, ATen block ops then fused (host syncs counted)" \
    'trained|MFU|host synchron|cuda_graph|block ops' \
    bash -c 'for g in "" --cuda_graph; do for f in 0 1; do
        echo "block ops: $([[ $f == 0 ]] && echo ATen || echo fused) ${g:-eager}"
        DTRAIN_FUSED_BLOCK_OPS=$f "$1" "${@:2}" $g || exit
      done; done
      echo "block ops: fused --cuda_graph --param_dtype=bf16 --shard=optimizer"
      DTRAIN_FUSED_BLOCK_OPS=1 "$1" "${@:2}" --cuda_graph --param_dtype=bf16 --shard=optimizer || exit
      for b in flash fa3; do
        echo "block ops: fused --cuda_graph, attention by $b only (DTRAIN_SDPA_BACKENDS=$b)"
        DTRAIN_SDPA_BACKENDS=$b DTRAIN_FUSED_BLOCK_OPS=1 "$1" "${@:2}" --cuda_graph || echo "block ops: $b failed"
      done' _ "$BIN/train_gpt" --device=cuda --data=synthetic \
    --amp=bf16 --steps=30 --log_every=10 --progress=false --count_host_syncs
}
step_s2s_graph() {
  need_build || return 1
  SHOW="train_seq2seq --amp=bf16 (seed shape) eager with DTRAIN_FUSED_BLOCK_OPS=0, then fused, then fused with --cuda_graph" \
    bench "s2s AMP bf16, eager (ATen block ops, then fused) then --cuda_graph (host syncs counted)" \
    'trained|host synchron|cuda_graph|block ops' \
    bash -c 'echo "block ops: ATen eager"; DTRAIN_FUSED_BLOCK_OPS=0 "$1" "${@:2}" || exit
      echo "block ops: fused eager"; DTRAIN_FUSED_BLOCK_OPS=1 "$1" "${@:2}" || exit
      echo "block ops: fused --cuda_graph"; DTRAIN_FUSED_BLOCK_OPS=1 "$1" "${@:2}" --cuda_graph' _ "$BIN/train_seq2seq" --device=cuda --data=synthetic \
    --amp=bf16 --steps=30 --log_every=10 --workers=2 --progress=false --count_host_syncs --eval_every=0
}
# The fused kernels against the ATen ops they replace, then a 124M-parameter-sized Llama (GQA,
# SwiGLU) eager with Llama's ops (DTRAIN_FUSED_BLOCK_OPS=0) and with the fused RMSNorm and SwiGLU.
step_kernels() {
  need_build || return 1
  SHOW="dtrain-bench fused_ce; dtrain-bench fused_block; DTRAIN_FUSED_BLOCK_OPS=0 then 1 train_gpt --model=llama (124M, GQA) --amp=bf16" \
    bench "fused kernels against the ATen ops they replace (dtrain-bench fused_ce, fused_block); a Llama step without and with them" \
    '"bench"|trained|MFU|block ops' \
    bash -c '"$1/dtrain-bench" fused_ce && "$1/dtrain-bench" fused_block || exit
      for f in 0 1; do
        echo "block ops: $([[ $f == 0 ]] && echo ATen || echo fused) llama eager"
        DTRAIN_FUSED_BLOCK_OPS=$f "$1/train_gpt" --device=cuda --data=synthetic --model=llama --vocab=32000 \
          --d_model=768 --heads=12 --kv_heads=4 --layers=12 --ff=2048 --seq_len=1024 --batch_size=8 --amp=bf16 \
          --steps=30 --log_every=10 --progress=false || exit
      done' _ "$BIN"
}
# The step-time simulator on this GPU (issue 37): gpt124m predicted from the named devices'
# rooflines before it runs, then the machine calibrated and measured through the model's spec,
# the calibrated and measured predictions of batch 8 as 2 micro-batches of 4, and that step run.
step_simulate() {
  need_build || return 1
  SHOW="dtrain-plan --simulate (h100, h200), --calibrate, --measure, --simulate --cluster [--measured], train_gpt --accum_steps=2" \
    bench "simulator: gpt124m predicted, calibrated, measured, then run" 'predicted|calibrate:|measure:|trained|MFU' \
    bash -c 'b=$1; shift; c=/tmp/dtrain-sim-cluster.json; m=/tmp/dtrain-sim-model.json
      for g in h100 h200; do "$b/dtrain-plan" --simulate --gpus_per_node=1 --gpu=$g "$@" || exit; done
      "$b/dtrain-plan" --device=cuda "$@" --calibrate=$c && "$b/dtrain-plan" --device=cuda "$@" --measure=$m || exit
      for a in 1 2; do
        "$b/dtrain-plan" --simulate --gpus_per_node=1 --cluster=$c --accum_steps=$a "$@" &&
          "$b/dtrain-plan" --simulate --gpus_per_node=1 --cluster=$c --measured=$m --accum_steps=$a "$@" || exit
      done
      "$b/train_gpt" --device=cuda --data=synthetic "$@" --accum_steps=2 --steps=30 --log_every=10 --progress=false' \
    _ "$BIN" --model=gpt --amp=bf16 --batch_size=8
}
# The planner against layer offload on the GPU (issue 35: its estimate within 5% of the measured
# peak, device and host): the memory report's host rows hold the streamed blocks' weights,
# gradients and optimizer state there.
step_plan_offload() {
  need_build || return 1
  SHOW="dtrain-plan --device=cuda --model=gpt --amp=bf16 --batch_size=8 --verify_steps=3: --offload=layers, --offload=layers --offload_delayed_update_after=1, --offload=all --offload_delayed_update_after=1" \
    bench "planner against layer offload, gpt124m: device and host estimates against the measurement" \
    '^verify|^layout:' \
    bash -c 'for v in "--offload=layers" "--offload=layers --offload_delayed_update_after=1" \
        "--offload=all --offload_delayed_update_after=1"; do
        echo "layout: $v"
        "$1" --device=cuda --model=gpt --amp=bf16 --batch_size=8 --verify_steps=3 --progress=false $v || exit
      done' _ "$BIN/dtrain-plan"
}
step_s2s_anchor() {
  bench "s2s AMP bf16, PyTorch eager and torch.compile (tools/s2s_torch_bench.py)" '"bench"' \
    env PYTHONUNBUFFERED=1 python3 tools/s2s_torch_bench.py --modes=eager,compile --steps=30 --warmup=10
}
step_nccl_allreduce() {
  need_build || return 1
  bench "NCCL all-reduce, world size 1 (busbw GB/s, 64 to 256 MiB)" '"bench"' \
    "$BIN/dtrain-bench" allreduce --backend=nccl --device=cuda --min_bytes=67108864
}
step_mpi_allreduce() {
  need_build || return 1
  bench "MPI all-reduce, 2 ranks sharing the GPU through host staging (64 to 256 MiB)" '"bench"' \
    "${MPIRUN[@]}" -np 2 "$BIN/dtrain-bench" allreduce --backend=mpi --device=cuda --min_bytes=67108864
}
step_cpu_adam() {
  need_build || return 1
  bench "CPU Adam, 100M parameters, 16 threads (PyTorch: fused 20 ms, foreach 109 ms)" '"bench"' \
    "$BIN/dtrain-bench" cpu_adam --threads=16 --impls=dtrain,torch_fused,torch_foreach
}
# The clipping norm of layer offload's host gradients (gpt124m's streamed blocks: 85M floats).
step_host_norm() {
  need_build || return 1
  bench "host gradient norm, 85M floats (layer offload's clipping norm): dtrain threaded vs ATen _foreach_norm" \
    '"bench"' "$BIN/dtrain-bench" host_norm --params=85000000 --tensor_elems=7080000 --threads=1,16
}
step_copies() {
  # No dtrain program times bare copies; this is the ceiling the offload paths copy against,
  # measured with torch on this machine (1 GiB, pinned host memory, non-blocking copy_).
  SHOW="python3 -c <pinned copy probe of cluster/gpu_session.sh>" \
    bench "pinned copies (torch probe: the ceiling for the offload rows)" 'GB/s' python3 -c '
import time, torch
n = 1 << 30
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
def gbs(dst, src, reps=10):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return reps * n / (time.perf_counter() - t) / 1e9
print(f"pinned H2D {gbs(d, h):.1f} GB/s, D2H {gbs(h, d):.1f} GB/s")'
}
step_offload_layers() {
  need_build || return 1
  # The resident step is the same command's anchor (issue 35: within 1.2x of max(compute,
  # bytes / 55 GB/s)); the delayed update moves the streamed blocks' CPU update beside the next
  # forward and backward; --offload=all's delayed update does it beside the device part's
  # gradient stream (the blocks' gradients taken, not added into the reducer's host buckets).
  # Each run's timeline gives the host work after backward.
  SHOW="train_gpt gpt124m --amp=bf16: resident, then --offload=layers, then --offload=layers --offload_delayed_update_after=2, then --offload=all --offload_delayed_update_after=2, each with dtrain-timeline summary's offload line" \
    bench "layer offload, gpt124m: resident, --offload=layers, with the delayed update, and --offload=all delayed" \
    'trained|MFU|offload|layers:' \
    bash -c 'for v in "" "--offload=layers" "--offload=layers --offload_delayed_update_after=2" \
        "--offload=all --offload_delayed_update_after=2"; do
        echo "layers: ${v:-resident}"
        "$1" "${@:3}" $v --timeline="$2/layers.json" || exit
        "$(dirname "$1")/dtrain-timeline" summary "$2/layers.json" | grep -E "offload" || true
      done' _ "$BIN/train_gpt" "$STATE" --device=cuda --data=synthetic --amp=bf16 --steps=10 --log_every=5 \
    --progress=false
}
step_async_save() {
  need_build || return 1
  bench "checkpoint save: the step that saves vs an ordinary one, background vs synchronous" '"bench"' \
    python3 tools/async_save_bench.py "$BIN" --device=cuda
}
# ZeRO on the device: gpt124m on 2 ranks sharing the GPU (gradients and ZeRO-3's gathers through
# MPI with host staging, so the step time is the staging's; the memory per rank is the figure):
# the memory report after step 4 of each stage, rank 0. zero_runs TITLE STAGE...: one mpirun per
# stage, in order; a stage may carry more flags ("parameters --offload=optimizer").
zero_runs() {
  local title=$1 stages
  shift
  stages=$(IFS=';'; echo "$*")
  SHOW="mpirun -np 2 train_gpt --device=cuda --data=synthetic --amp=bf16 --memory_report_step=4 --shard=${stages//;/|}" \
    bench "$title" 'shard=|trained|memory on|parameters +|gradients +|optimizer state|peak|other \(' \
    env ZERO_STAGES="$stages" bash -c '
IFS=";" read -ra stages <<<"$ZERO_STAGES"
for s in "${stages[@]}"; do
  echo "shard=$s"
  "${@:2}" "$1" --device=cuda --data=synthetic --amp=bf16 --steps=5 --log_every=1 --progress=false \
    --memory_report_step=4 --shard=$s || exit 1
done' _ "$BIN/train_gpt" "${MPIRUN[@]}" -np 2
}
step_shard() {
  need_build || return 1
  zero_runs "ZeRO-1/2 on the device, gpt124m, 2 ranks on the one GPU (memory per rank)" none optimizer gradients
}
# ZeRO-3 also with the optimizer offloaded (its device figure against stage 3's, its host figure).
step_shard3() {
  need_build || return 1
  zero_runs "ZeRO-3 on the device, gpt124m, 2 ranks on the one GPU (memory per rank; also offloaded)" \
    parameters "parameters --offload=optimizer"
}
# Issue 5's goal: a GPT whose optimizer state does not fit the GPU (6.3B parameters: 100 GB of
# fp32 weights, gradients and Adam moments) trains with the optimizer state in host memory.
step_offload6b() {
  need_build || return 1
  bench "optimizer offload, largest GPT: 6.3B parameters (goal: >= 30% of peak)" \
    'parameters|trained|MFU|step [0-9]+/' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --offload=optimizer --checkpoint_activations \
    --d_model=4096 --heads=32 --layers=30 --ff=16384 --batch_size=2 --steps=4 --log_every=1 --progress=false \
    --memory_report_step=2
}
# Issue "Offload at ZeRO-Offload's efficiency": ZeRO-Offload's own layout on the same 6.3B GPT:
# bfloat16 weights and gradients on the device (12.6 + 12.6 GB instead of 25 + 25), the float32
# master and Adam moments on the host, bfloat16 gradients to the host (half the PCIe bytes), the
# CPU update of step t beside the forward and backward of step t + 1, and a batch of 32 x 1024
# that the float32 layout cannot hold (batch 16: 26.5%, batch 32: 34.4% on 2026-11-27). The batch is the lever: the CPU update of 6.3B parameters
# (about 26 bytes each through host memory: 1.2-1.3 s on 16 threads) is hidden only behind a
# forward and backward at least as long, which batch 8 (about 0.7 s of GEMMs) is not.
# GPU_6B_CKPT_BLOCKS=N recomputes only the first N of the 30 blocks (--checkpoint_blocks): batch 32
# measured 48.9 GiB with every block recomputed, so about 24 fit an H100 (the simulator: 74.7 GiB,
# and it overestimated the all-blocks peak by 10%), 4% faster by the simulator.
step_offload6b_bf16() {
  need_build || return 1
  bench "ZeRO-Offload layout, largest GPT: 6.3B parameters, bf16 weights, fp32 master on the host (goal: >= 30% of peak)" \
    'parameters|trained|MFU|step [0-9]+/' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --param_dtype=bf16 --offload=optimizer \
    --offload_delayed_update_after=1 --checkpoint_activations ${GPU_6B_CKPT_BLOCKS:+--checkpoint_blocks=$GPU_6B_CKPT_BLOCKS} \
    --d_model=4096 --heads=32 --layers=30 --ff=16384 \
    --batch_size="${GPU_6B_BATCH:-32}" --steps=6 --log_every=1 --progress=false --memory_report_step=3
}
# Issue 35's "largest GPT on one GPU and its host": the host bounds it, not the device. The
# float32 master and two Adam moments take 12 bytes per parameter on the host, the bf16 gradient
# buffer 2 more (the delayed update would add another 2), so 128 GiB of host memory hold about 8B
# parameters. The device then holds only 2 + 2 bytes per parameter plus activations, so streaming
# the blocks from the host would free device memory that nothing else needs. A 7.5B GPT
# (d 4096, 36 layers) in ZeRO-Offload's layout without the delayed update: about 98 GiB on the
# host by the planner's rule.
step_offload_largest() {
  need_build || return 1
  bench "largest GPT on one GPU + host: 7.5B parameters, bf16 weights, fp32 master and moments on the host (goal: >= 20% of peak)" \
    'parameters|trained|MFU|host' \
    "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 --param_dtype=bf16 --offload=optimizer \
    --checkpoint_activations --d_model=4096 --heads=32 --layers=36 --ff=16384 \
    --batch_size=32 --steps=5 --log_every=1 --progress=false --memory_report_step=3
}
# The 1.3B shape in the same layout, beside offload_opt and offload_delayed (float32 weights).
step_offload_bf16() {
  need_build || return 1
  gpt13b 8
  bench "ZeRO-Offload layout, GPT 1.3B shape: bf16 weights and gradients, delayed update" 'trained|MFU|offload' \
    "$BIN/train_gpt" "${GPT13B[@]}" --param_dtype=bf16 --offload_delayed_update_after=2
}
gpt13b() {  # gpt13b STEPS: the 1.3B-shape optimizer-offload flags
  GPT13B=(--device=cuda --data=synthetic --amp=bf16 --offload=optimizer --d_model=2048 --heads=16 --layers=24
          --ff=8192 --batch_size=4 --steps="$1" --log_every=4 --progress=false)
}
step_offload_opt() {
  need_build || return 1
  gpt13b 8
  bench "optimizer offload, GPT 1.3B shape (the baseline of the delayed update)" 'trained|MFU|offload' \
    "$BIN/train_gpt" "${GPT13B[@]}"
}
step_offload_delayed() {
  need_build || return 1
  gpt13b 8
  bench "optimizer offload, delayed update (CPU step hidden behind the next forward/backward)" \
    'trained|MFU|offload' "$BIN/train_gpt" "${GPT13B[@]}" --offload_delayed_update_after=2
}
# Pipeline stages on the device: gpt124m split into 2 stages on 2 ranks sharing the GPU (the
# activations through MPI with host staging, so the step time is the staging's; the memory per
# stage and the bubble are the figures), 1F1B with 4 micro-batches, and each stage's idle share
# of a step from the timeline (dtrain-timeline) against (P-1)/(m+P-1).
step_pipeline() {
  need_build || return 1
  SHOW="mpirun -np 2 train_gpt --device=cuda --data=synthetic --amp=bf16 --pp=2 --accum_steps=4 --timeline=...; dtrain-timeline summary" \
    bench "pipeline stages on the device, gpt124m, 2 stages on the one GPU (memory per stage, bubble)" \
    'trained|peak|stage [0-9] \(rank' bash -c '
"${@:3}" "$1" --device=cuda --data=synthetic --amp=bf16 --pp=2 --accum_steps=4 --steps=6 --log_every=3 \
  --progress=false --memory_report_step=4 --timeline="$2/pp-timeline.json" || exit 1
"$(dirname "$1")/dtrain-timeline" summary "$2/pp-timeline.json"' _ "$BIN/train_gpt" "$FILES" "${MPIRUN[@]}" -np 2
}

# Profiles (--profile_steps: Kineto traces with every kernel and copy) of the rows that miss their
# goals, each summarized by tools/profile_summary.py; the gzipped traces go into files.tgz.
profile_run() {  # profile_run NAME TITLE TRAIN_GPT_ARGS...: the run, then its trace's summary
  local name=$1 title=$2 trace="$FILES/profiles/$1.json"
  shift 2
  SHOW="train_gpt $* --profile_out=$name.json; tools/profile_summary.py $name.json" \
    bench "$title" '.' bash -c 'mkdir -p "$(dirname "$1")" && "${@:2}" && python3 tools/profile_summary.py "$1" --top=25 &&
      gzip -f "$1" "${1%.json}-timeline.json"' _ "$trace" \
    "$BIN/train_gpt" "$@" --profile_out="$trace" --timeline="${trace%.json}-timeline.json"
}
# gpt124m profiled twice in one command: with ATen's block ops, then with dtrain's fused kernels
# (DTRAIN_FUSED_BLOCK_OPS=0, then 1): the before and after of issue 34's kernels on one machine.
step_profile_gpt() {
  need_build || return 1
  SHOW="train_gpt --amp=bf16 --profile_steps=4-5, DTRAIN_FUSED_BLOCK_OPS=0 then 1; tools/profile_summary.py of each" \
    bench "gpt124m AMP bf16, steps 4-5, ATen's block ops then fused" '.' bash -c 'mkdir -p "$1" || exit
      for f in 0 1; do
        t="$1/gpt-fused$f.json"
        echo "block ops: $([[ $f == 0 ]] && echo ATen || echo fused)"
        DTRAIN_FUSED_BLOCK_OPS=$f "${@:2}" --profile_out="$t" --timeline="${t%.json}-timeline.json" &&
          python3 tools/profile_summary.py "$t" --top=25 && gzip -f "$t" "${t%.json}-timeline.json" || exit
      done' _ "$FILES/profiles" "$BIN/train_gpt" --device=cuda --data=synthetic --amp=bf16 \
    --steps=5 --log_every=5 --progress=false --profile_steps=4-5
}
step_profile_s2s() {
  need_build || return 1
  SHOW="train_seq2seq --amp=bf16 (seed shape) --profile_out=s2s.json; tools/profile_summary.py s2s.json" \
    bench "s2s AMP bf16, steps 4-5" '.' bash -c 'mkdir -p "$(dirname "$1")" && "${@:2}" &&
      python3 tools/profile_summary.py "$1" --top=25 && gzip -f "$1" "${1%.json}-timeline.json"' _ "$FILES/profiles/s2s.json" \
    "$BIN/train_seq2seq" --device=cuda --data=synthetic --amp=bf16 --steps=5 --log_every=5 --workers=2 \
    --progress=false --profile_steps=4-5 --profile_out="$FILES/profiles/s2s.json" \
    --timeline="$FILES/profiles/s2s-timeline.json"
}
step_profile_layers() {
  need_build || return 1
  profile_run layers "layer offload, gpt124m, steps 4-5" --device=cuda --data=synthetic --amp=bf16 \
    --offload=layers --steps=5 --log_every=5 --progress=false --profile_steps=4-5
}
step_profile_offload() {
  need_build || return 1
  gpt13b 5
  profile_run offload "optimizer offload, 1.3B shape, steps 4-5" "${GPT13B[@]}" --profile_steps=4-5
}
step_profile_delayed() {
  need_build || return 1
  gpt13b 5
  profile_run delayed "optimizer offload, delayed update, steps 4-5" "${GPT13B[@]}" \
    --offload_delayed_update_after=2 --profile_steps=4-5
}
