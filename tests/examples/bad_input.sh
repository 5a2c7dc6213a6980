#!/usr/bin/env bash
# Bad input to the examples: each case must exit 2 with a message naming the problem.
# usage: bad_input.sh BIN_DIR EXPECT_EXIT_SH
set -u
bin=$1
expect=$2
failed=0
check() {
  local code=$1 regex=$2
  shift 2
  bash "$expect" "$code" "$regex" -- "$@" >/tmp/dtrain_bad_input.$$ 2>&1 || { cat /tmp/dtrain_bad_input.$$; failed=1; }
}
check 2 'batch_size=0 must be >= 1' "$bin/train_mlp" --batch_size=0
check 2 'batch_size=-4 must be >= 1' "$bin/train_mlp" --batch_size=-4
check 2 "unknown AMP mode 'fp8'" "$bin/train_mlp" --amp=fp8
check 2 "unknown optimizer name 'lamb'" "$bin/train_mlp" --optimizer=lamb
check 2 'lr=nan must be a positive finite number' "$bin/train_mlp" --lr=nan
check 2 'no usable CUDA GPU' env CUDA_VISIBLE_DEVICES= "$bin/train_mlp" --device=cuda
check 2 'DTRAIN_FUSED_BLOCK_OPS=yes: use 1' env DTRAIN_FUSED_BLOCK_OPS=yes "$bin/train_mlp" --steps=1
check 2 "backend 'triton' is unknown" env DTRAIN_SDPA_BACKENDS=flash,triton "$bin/train_mlp" --steps=1
check 2 'offload=disk is not one of' "$bin/train_mlp" --offload=disk
check 2 'host_mem_limit_gb=-1 must be >= 0' "$bin/train_mlp" --offload=optimizer --host_mem_limit_gb=-1
check 2 'offload_stream_gradients=sometimes is not one of: auto, on, off' "$bin/train_mlp" --offload=optimizer --offload_stream_gradients=sometimes
check 2 'offload_delayed_update_after=-2 must be >= 0' "$bin/train_mlp" --offload=optimizer --offload_delayed_update_after=-2
check 2 'offload_delayed_update_after needs --offload=optimizer' "$bin/train_mlp" --offload_delayed_update_after=3
check 2 'offload=layers --offload_delayed_update_after with --shard=optimizer is not supported' "$bin/train_gpt" --device=cpu --d_model=64 --heads=4 --layers=1 --seq_len=16 --vocab=96 --steps=1 --offload=layers --offload_delayed_update_after=1 --shard=optimizer
check 2 'cap' "$bin/train_gpt" --device=cpu --d_model=64 --heads=4 --layers=1 --seq_len=16 --vocab=96 --offload=optimizer --host_mem_limit_gb=0.0001
check 2 'param_dtype=float16 is not one of: float32 .fp32., bfloat16 .bf16.; float16 weights need loss scaling' "$bin/train_mlp" --param_dtype=float16
check 2 'param_dtype=bfloat16 with a replicated optimizer would update the bfloat16 weights themselves' "$bin/train_mlp" --device=cpu --param_dtype=bf16
check 2 'has no tensor-parallel layers' "$bin/train_mlp" --tp=2
check 2 'sequence_parallel: train_mlp has no tensor-parallel layers' "$bin/train_mlp" --sequence_parallel
check 2 'pp: train_mlp has no tensor-parallel layers and cannot be split into pipeline stages' "$bin/train_mlp" --pp=2
check 2 "pipeline schedule 'looped' does not exist; use gpipe" "$bin/train_gpt" --pp_schedule=looped
check 2 'pp_schedule=interleaved needs --pp_chunks >= 2 .got 1.' "$bin/train_gpt" --pp_schedule=interleaved --pp_chunks=1
check 2 'orders the zero-bubble schedule.s lists; add --pp_schedule=zb' "$bin/train_gpt" --pp_zb_costs=1,2,1
check 2 'needs three costs F,B,W' "$bin/train_gpt" --pp=2 --pp_schedule=zb --pp_zb_costs=1,2
check 2 '"0" is not a positive number' "$bin/train_gpt" --pp=2 --pp_schedule=zb --pp_zb_costs=1,0,1
check 2 'pp_blocks=2 needs --pp > 1' "$bin/train_gpt" --pp_blocks=2
check 2 "shard=parameters needs the model's units" "$bin/train_mlp" --shard=parameters
check 2 'shard=parameters with --offload=layers is not supported yet' "$bin/train_gpt" --device=cpu --shard=parameters --offload=layers
check 2 "no parameter's name begins with the unit prefix 'blocks.9.'" "$bin/train_gpt" --device=cpu --layers=1 --shard=parameters --shard_units=wte.,blocks.9.
check 2 "a unit begins at 'blocks.0.mlp.fc1.weight', inside block 0" "$bin/train_gpt" --device=cpu --layers=1 --shard=parameters --shard_units=wte.,blocks.0.mlp.
check 2 'shard_units=wte. names ZeRO-3' "$bin/train_gpt" --shard_units=wte.
check 2 'not a multiple of --accum_steps=3' "$bin/train_mlp" --batch_size=64 --accum_steps=3
check 2 "directory '/nonexistent' does not exist" "$bin/train_mlp" --metrics=/nonexistent/m.jsonl
check 2 'd_model=50 is not divisible by --heads=8' "$bin/train_seq2seq" --d_model=50
check 2 "unexpected argument 'extra'" "$bin/train_cnn" extra
check 2 "unknown communicator backend 'gloo'" "$bin/train_mlp" --backend=gloo
check 2 "cannot create the TensorBoard directory '/proc/forbidden'" "$bin/train_mlp" --tensorboard_dir=/proc/forbidden
check 2 "timeline=/nonexistent/t.json: directory '/nonexistent' does not exist" "$bin/train_mlp" --timeline=/nonexistent/t.json
# A binary file (uint16 tokens, as llm.c's and nanoGPT's shards hold) is not text: refused, naming it.
bin_tokens=$(mktemp)
printf '\x34\x12\x00\x00\xff\xfe\x01\x00' >"$bin_tokens"
check 2 "'$bin_tokens' is not text \\(byte 2 is 0x00\\)" "$bin/train_gpt" --device=cpu --data_path="$bin_tokens" --steps=1
check 2 "the text corpus '/nonexistent/corpus.txt' does not exist" "$bin/train_gpt" --device=cpu --data_path=/nonexistent/corpus.txt
# Flags a program would accept and ignore (a user audit): --plan=auto in a program that does not
# plan (the docs' command-line example), block techniques with a module+loss Trainer, saving
# without a directory, a technique --plan=auto chooses itself.
check 2 'plan=auto chooses memory techniques for programs that apply its plan' "$bin/dtrain_api_snippets" --run=10 --device=cpu --plan=auto --gpu_mem_limit_gb=1
check 2 'checkpoint_activations.*with a Trainer built from a module and a loss' "$bin/dtrain_api_snippets" --run=10 --device=cpu --steps=1 --checkpoint_activations
check 2 'save_every / --keep_last without --save_dir: nothing would be saved' "$bin/train_mlp" --save_every=2
check 2 'accum_steps with --plan=auto: the plan chooses' "$bin/train_mlp" --plan=auto --gpu_mem_limit_gb=1 --accum_steps=2
# Idle combinations run, with one warning naming each of them (and no warning without them).
warned() {
  local out
  out=$("$@" 2>&1) || { echo "$out"; failed=1; return; }
  echo "$out" | grep -q 'flags that have no effect in this run' || { echo "no idle-flag warning: $*"; echo "$out"; failed=1; }
  echo "$out"
}
out=$(warned "$bin/train_mlp" --device=cpu --steps=1 --prune_scope=global --eval_samples=16 --quantize_scales=tensor)
for idle in 'prune_scope without --prune_amount' 'eval_samples without --eval_every or --eval_only' 'quantize_scales without --quantize'; do
  echo "$out" | grep -q -- "--$idle" || { echo "the warning does not name --$idle: $out"; failed=1; }
done
out=$("$bin/train_mlp" --device=cpu --steps=1 --eval_samples=16 --eval_every=1 2>&1)
echo "$out" | grep -q 'no effect' && { echo "warned without an idle flag: $out"; failed=1; }
rm -f "$bin_tokens"
rm -f /tmp/dtrain_bad_input.$$
[[ $failed == 0 ]] && echo "all bad-input cases exit 2 with a message"
exit $failed
