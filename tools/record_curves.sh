#!/usr/bin/env bash
# Records the loss curves (and gradient norms, loss scales) of the example programs in the
# layouts a refactoring must not change: 1 rank, 2 ranks, tp 2 x dp 2, optimizer offload with
# streaming and the delayed update, fp16, bf16, clipping. Fixed seeds, CPU. train_gpt clips to
# 1.0 by default; here only the runs named *clip* clip (the later flag wins).
#   tools/record_curves.sh OUT_DIR [BUILD_DIR]      then
#   python3 tools/compare_curves.py BEFORE_DIR AFTER_DIR
set -euo pipefail
OUT="${1:?usage: record_curves.sh OUT_DIR [BUILD_DIR]}"
BIN="${2:-build}/bin"
mkdir -p "$OUT"
MPIRUN=(mpirun --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader,tcp
        --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS=1)
export OMP_NUM_THREADS=1 GLOG_minloglevel=1
GPT=(--device=cpu --progress=false --log_every=1 --workers=1 --seed=5 --steps=12 --d_model=64
     --heads=4 --layers=2 --ff=128 --seq_len=32 --vocab=256 --dropout=0 --lr=3e-3 --clip_grad_norm=0)
MLP=(--device=cpu --progress=false --log_every=1 --workers=1 --seed=3 --steps=20 --lr=0.003)
run() {  # name ranks program flags...
  local name=$1 ranks=$2 prog=$3; shift 3
  local cmd=("$BIN/$prog" "--metrics=$OUT/$name.jsonl" "$@")
  rm -f "$OUT/$name.jsonl"
  if [[ $ranks -gt 1 ]]; then cmd=("${MPIRUN[@]}" -np "$ranks" "${cmd[@]}"); fi
  "${cmd[@]}" >"$OUT/$name.log" 2>&1 || { echo "FAIL: $name (log: $OUT/$name.log)"; tail -20 "$OUT/$name.log"; exit 1; }
  echo "recorded $name"
}
run mlp_1x64 1 train_mlp "${MLP[@]}" --batch_size=64
run mlp_2x32 2 train_mlp "${MLP[@]}" --batch_size=32
run mlp_2x32_clip 2 train_mlp "${MLP[@]}" --batch_size=32 --clip_grad_norm=0.05
run gpt_1x8 1 train_gpt "${GPT[@]}" --batch_size=8
run gpt_2x4 2 train_gpt "${GPT[@]}" --batch_size=4
run gpt_tp2_dp2 4 train_gpt "${GPT[@]}" --batch_size=4 --tp=2
run gpt_fp16 1 train_gpt "${GPT[@]}" --batch_size=8 --amp=fp16
run gpt_fp16_clip 2 train_gpt "${GPT[@]}" --batch_size=4 --amp=fp16 --clip_grad_norm=0.5
run gpt_bf16 2 train_gpt "${GPT[@]}" --batch_size=4 --amp=bf16
run gpt_clip 2 train_gpt "${GPT[@]}" --batch_size=4 --clip_grad_norm=0.5
run gpt_sgd_clip 1 train_gpt "${GPT[@]}" --batch_size=8 --optimizer=sgd --lr=0.05 --clip_grad_norm=0.5
run gpt_offload 2 train_gpt "${GPT[@]}" --batch_size=4 --offload=optimizer --offload_stream_gradients=off
run gpt_offload_stream 2 train_gpt "${GPT[@]}" --batch_size=4 --offload=optimizer --offload_stream_gradients=on
run gpt_offload_stream_clip 2 train_gpt "${GPT[@]}" --batch_size=4 --offload=optimizer --offload_stream_gradients=on --clip_grad_norm=0.5
run gpt_offload_delayed 2 train_gpt "${GPT[@]}" --batch_size=4 --offload=optimizer --offload_stream_gradients=on --offload_delayed_update_after=4
run gpt_offload_allreduce 2 train_gpt "${GPT[@]}" --batch_size=4 --offload=optimizer --offload_reduce_to_owner=false
run gpt_offload_fp16 2 train_gpt "${GPT[@]}" --batch_size=4 --offload=optimizer --offload_stream_gradients=on --amp=fp16
run gpt_offload_tp2 4 train_gpt "${GPT[@]}" --batch_size=4 --tp=2 --offload=optimizer --clip_grad_norm=0.5
# The techniques applied to the model's blocks from outside (issue "Models and parallelism as a
# library"): activation checkpointing, layer streaming, ZeRO-3 units, pipeline stages, sequence
# parallelism, each alone and together.
run gpt_ckpt 2 train_gpt "${GPT[@]}" --batch_size=4 --checkpoint_activations
run gpt_layers 1 train_gpt "${GPT[@]}" --batch_size=8 --offload=layers
run gpt_zero3 2 train_gpt "${GPT[@]}" --batch_size=4 --shard=parameters
run gpt_zero3_ckpt 2 train_gpt "${GPT[@]}" --batch_size=4 --shard=parameters --checkpoint_activations
run gpt_zero3_units 2 train_gpt "${GPT[@]}" --batch_size=4 --shard=parameters --shard_units=wte.,blocks.1.
run gpt_zero3_tp2 4 train_gpt "${GPT[@]}" --batch_size=4 --shard=parameters --tp=2
run gpt_pp2 2 train_gpt "${GPT[@]}" --batch_size=8 --pp=2 --accum_steps=4
run gpt_pp2_gpipe_ckpt 2 train_gpt "${GPT[@]}" --batch_size=8 --pp=2 --accum_steps=4 --pp_schedule=gpipe --checkpoint_activations
run gpt_pp2_tp2_sp 4 train_gpt "${GPT[@]}" --batch_size=8 --pp=2 --tp=2 --accum_steps=2 --sequence_parallel
run gpt_pp2_zero3 4 train_gpt "${GPT[@]}" --batch_size=4 --pp=2 --accum_steps=2 --shard=parameters
run gpt_tp2_sp 2 train_gpt "${GPT[@]}" --batch_size=8 --tp=2 --sequence_parallel
run gpt_pp2_layers 2 train_gpt "${GPT[@]}" --batch_size=8 --pp=2 --accum_steps=2 --offload=layers
run s2s_1x8 1 train_seq2seq --device=cpu --progress=false --log_every=1 --workers=1 --seed=5 --steps=8 --d_model=64 --heads=4 --layers=2 --ff=128 --seq_len=32 --vocab=256 --dropout=0 --batch_size=8
run s2s_ckpt 2 train_seq2seq --device=cpu --progress=false --log_every=1 --workers=1 --seed=5 --steps=8 --d_model=64 --heads=4 --layers=2 --ff=128 --seq_len=32 --vocab=256 --dropout=0 --batch_size=4 --checkpoint_activations
run cnn_2x32 2 train_cnn --device=cpu --progress=false --log_every=1 --workers=1 --seed=3 --steps=12 --batch_size=32
