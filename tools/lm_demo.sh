#!/usr/bin/env bash
# A small Llama trained from text on this machine, end to end with dtrain's own tools:
#   1. a corpus: the licence texts every Debian machine has plus Python's own standard library
#      sources (each file one document);
#   2. a SentencePiece BPE tokenizer trained on it (Python's sentencepiece, in .venv);
#   3. dtrain-prepare: the text into llm.c token shards (a validation shard and training shards);
#   4. train_gpt --model=llama on the shards for STEPS steps, evaluating on the
#      validation shard and printing a sample every quarter of the run;
#   5. dtrain-generate: a sample from the trained checkpoint, the prompt and the output as text;
#   6. dtrain-export --format=hf --tokenizer: the checkpoint and the tokenizer as a Hugging Face
#      directory, and transformers' own greedy continuation of the prompt from it beside
#      dtrain-generate's.
# usage: tools/lm_demo.sh WORK_DIR [BUILD_DIR] [STEPS]      (prints the losses and the sample)
set -euo pipefail
WORK="${1:?usage: lm_demo.sh WORK_DIR [BUILD_DIR] [STEPS]}"
BIN="$(cd "${2:-build}" && pwd)/bin"
STEPS="${3:-600}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
mkdir -p "$WORK/corpus" "$WORK/shards"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" GLOG_minloglevel=1

# 1. The corpus (a fixed, sorted file list: the same text on every Debian machine of a release).
if [[ ! -s $WORK/corpus.list ]]; then
  { find /usr/share/common-licenses -type f; find /usr/lib/python3*/ -maxdepth 1 -name '*.py' -type f; } \
    | sort >"$WORK/corpus.list"
  while read -r f; do cp "$f" "$WORK/corpus/$(echo "$f" | tr '/' '_')"; done <"$WORK/corpus.list"
fi
echo "corpus: $(wc -l <"$WORK/corpus.list") files, $(du -sh "$WORK/corpus" | cut -f1)"

# 2. The tokenizer.
if [[ ! -s $WORK/tok.model ]]; then
  "$PY" - "$WORK" <<'PY'
import glob, sys
import sentencepiece as spm
w = sys.argv[1]
spm.SentencePieceTrainer.train(input=sorted(glob.glob(w + "/corpus/*")), model_prefix=w + "/tok", vocab_size=8000,
                               model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
                               input_sentence_size=2000000, shuffle_input_sentence=True, minloglevel=2)
PY
fi

# 3. The shards.
if ! ls "$WORK"/shards/lm_train_*.bin >/dev/null 2>&1; then
  "$BIN/dtrain-prepare" --tokenizer="$WORK/tok.model" --input="$WORK/corpus" --output_dir="$WORK/shards" \
    --prefix=lm --val_tokens=65536 --shard_tokens=4000000 --bos --eos
fi

# 4. Training: a 4-layer Llama (d 256, 8 query and 4 key/value heads), sequence 256.
SHAPE=(--model=llama --vocab=8000 --d_model=256 --heads=8 --kv_heads=4 --layers=4 --ff=688 --seq_len=256)
"$BIN/train_gpt" "${SHAPE[@]}" --device=cpu --data=tokens --data_path="$WORK/shards/lm_train_*.bin" \
  --eval_data_path="$WORK/shards/lm_val_000000.bin" --eval_every=$((STEPS / 4)) --eval_samples=64 \
  --batch_size=16 --steps="$STEPS" --lr=1e-3 --schedule=cosine --warmup_steps=$((STEPS / 10)) --log_every=50 \
  --save_dir="$WORK/run" --resume=auto --progress=false --metrics="$WORK/metrics.jsonl" \
  --tokenizer="$WORK/tok.model" --sample_every=$((STEPS / 4 / 50 * 50 > 0 ? STEPS / 4 / 50 * 50 : 50)) \
  --sample_prompt="def main(" --sample_tokens=48 2>&1 | tail -25

# 5. A sample: the prompt encoded and the output decoded by the same tokenizer (the engine's
#    SentencePiece Tokenizer), after the BOS the shards put before each document, up to its EOS.
echo '--- sample (prompt "def main("):'
"$BIN/dtrain-generate" "${SHAPE[@]}" --device=cpu --checkpoint="$WORK/run" --tokenizer="$WORK/tok.model" \
  --prompt="def main(" --max_new_tokens=120 --temperature=0.8 --top_k=40 --seed=1 2>/dev/null

# 6. To Hugging Face: transformers loads the export (weights, config, tokenizer) by itself, and its
#    greedy continuation is dtrain-generate's.
mkdir -p "$WORK/hf"
"$BIN/dtrain-export" "${SHAPE[@]}" --checkpoint="$WORK/run" --format=hf --output="$WORK/hf" \
  --tokenizer="$WORK/tok.model" 2>/dev/null
echo '--- greedy, dtrain-generate:'
"$BIN/dtrain-generate" "${SHAPE[@]}" --device=cpu --checkpoint="$WORK/run" --tokenizer="$WORK/tok.model" \
  --prompt="def main(" --max_new_tokens=40 --temperature=0 2>/dev/null
echo '--- greedy, transformers on the export:'
"$PY" - "$WORK/hf" 2>/dev/null <<'PY'
import os, sys
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = tok("def main(", return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)
print(tok.decode(out[0], skip_special_tokens=True))
PY
