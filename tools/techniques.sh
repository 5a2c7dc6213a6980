#!/usr/bin/env bash
# Measures the memory and speed techniques of docs/GUIDE.md on train_seq2seq (one process):
# prints a markdown table of median step time and peak memory per variant.
# usage: tools/techniques.sh [--device=cpu|cuda] [extra train_seq2seq flags...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DTRAIN_BIN:-$ROOT/build/bin}"
shape=(--data=synthetic --steps=8 --log_every=4 --workers=2 --progress=false --eval_samples=64)
if [[ "$*" != *"--device=cuda"* ]]; then
  # A CPU-sized version of the seed model (the seed shape is for the GPU).
  shape+=(--device=cpu --d_model=256 --heads=4 --ff=1024 --layers=2 --seq_len=128 --vocab=8000 --batch_size=8)
fi
variants=("fp32|" "AMP bf16|--amp=bf16" "AMP fp16 + loss scaling|--amp=fp16" "activation checkpointing|--checkpoint_activations"
          "4 micro-batches accumulated|--accum_steps=4" "no in-place activations|--inplace=false"
          "eval under no_grad|--eval_only")
echo "| variant | ms per step (batch) | peak MiB |"
echo "| --- | --- | --- |"
for v in "${variants[@]}"; do
  name=${v%%|*}
  flags=${v#*|}
  out=$("$BIN/train_seq2seq" "${shape[@]}" "$@" $flags 2>&1 | grep -E "trained|evaluated" || true)
  ms=$(echo "$out" | sed -nE 's/.* ([0-9.]+) ms\/(step|batch).*/\1/p')
  peak=$(echo "$out" | sed -nE 's/.*peak memory ([0-9.]+) MiB.*/\1/p')
  echo "| $name | ${ms:-?} | ${peak:-?} |"
done
