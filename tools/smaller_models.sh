#!/usr/bin/env bash
# Measures int8 quantization and knowledge distillation on the real text data (the license
# texts train_gpt reads by default) and prints the two tables of docs/BENCHMARKS.md:
#   1. a teacher GPT trained by dtrain, evaluated in float32 and with int8 Linear layers
#      (--eval_only --quantize=int8, per-channel and per-tensor scales; the same batches);
#   2. a smaller student GPT trained for the same steps with and without the teacher
#      (--teacher, a few temperatures and weights), its eval loss at the end.
# usage: [STEPS=400] [TEACHER_STEPS=STEPS] [STUDENT="<shape flags>"] tools/smaller_models.sh [BUILD_BIN] [WORK_DIR]
#        (CPU; about 10 minutes on 2 cores with the defaults)
set -euo pipefail
BIN=${1:-build/bin}
WORK=${2:-$(mktemp -d)}
mkdir -p "$WORK"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
TEACHER_SHAPE=(--d_model=256 --heads=8 --layers=4 --ff=1024)
read -r -a STUDENT_SHAPE <<<"${STUDENT:---d_model=96 --heads=4 --layers=2 --ff=384}"
COMMON=(--device=cpu --seq_len=128 --vocab=256 --batch_size=16 --lr=0.001 --warmup_steps=20 --schedule=cosine
        --progress=false --log_every=50 --workers=1)
STEPS=${STEPS:-400}                  # the students'
TEACHER_STEPS=${TEACHER_STEPS:-$STEPS}
EVAL=(--eval_every="$STEPS" --eval_samples=512)

echo "# teacher: ${TEACHER_SHAPE[*]}, $TEACHER_STEPS steps" >&2
if [[ ! -d $WORK/teacher ]]; then
  "$BIN/train_gpt" "${COMMON[@]}" "${TEACHER_SHAPE[@]}" --steps="$TEACHER_STEPS" --eval_every="$TEACHER_STEPS" \
    --eval_samples=512 --save_dir="$WORK/teacher" \
    2>"$WORK/teacher.log" | tee "$WORK/teacher.out" >&2
fi

echo
echo "| model | scales | Linear weights | eval loss float32 | eval loss int8 | change | int8 time / float32 |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for scales in channel tensor; do
  out=$("$BIN/train_gpt" "${COMMON[@]}" "${TEACHER_SHAPE[@]}" --eval_only --resume --save_dir="$WORK/teacher" \
        --quantize=int8 --quantize_scales="$scales" --eval_samples=512 2>>"$WORK/quantize.log")
  echo "$out" >&2
  python3 - "$scales" <<PYEOF
import re, sys
out = """$out"""
losses = re.findall(r"under no_grad[^:]*: loss ([0-9.]+), ([0-9.]+) ms/batch", out)
w = re.search(r"weights ([0-9.]+) MB -> ([0-9.]+) MB \(([0-9.]+)x smaller\)", out)
t = re.search(r"([0-9.]+)x the float32 time", out)
(fl, fms), (ql, qms) = losses
change = 100 * (float(ql) - float(fl)) / float(fl)
print(f"| teacher GPT | {sys.argv[1]} | {w.group(1)} MB -> {w.group(2)} MB ({w.group(3)}x) | {fl} | {ql} | {change:+.2f}% | {t.group(1)}x ({fms} vs {qms} ms/batch) |")
PYEOF
done

eval_loss() { grep -o "eval loss [0-9.]*" "$1" | tail -1 | awk '{print $3}'; }
student() {  # name, extra flags...
  local name=$1
  shift
  "$BIN/train_gpt" "${COMMON[@]}" "${STUDENT_SHAPE[@]}" --steps="$STEPS" "${EVAL[@]}" "$@" \
    2>"$WORK/$name.log" >"$WORK/$name.out"
  cat "$WORK/$name.out" >&2
}
echo
echo "| student ${STUDENT_SHAPE[*]}, $STEPS steps | eval loss | vs no teacher |"
echo "| --- | --- | --- |"
student plain
base=$(eval_loss "$WORK/plain.out")
echo "| no teacher (cross-entropy only) | $base | |"
for cfg in "2 0.5" "2 0.9" "1 0.5" "4 0.5"; do
  read -r T a <<<"$cfg"
  student "kd-T$T-a$a" --teacher="$WORK/teacher" --distill_temperature="$T" --distill_alpha="$a"
  l=$(eval_loss "$WORK/kd-T$T-a$a.out")
  echo "| --teacher, T=$T, alpha=$a | $l | $(python3 -c "print(f'{100 * ($l - $base) / $base:+.2f}%')") |"
done
student kd-bf16 --teacher="$WORK/teacher" --distill_temperature=2 --distill_alpha=0.5 --teacher_bf16
l=$(eval_loss "$WORK/kd-bf16.out")
echo "| --teacher, T=2, alpha=0.5, --teacher_bf16 | $l | $(python3 -c "print(f'{100 * ($l - $base) / $base:+.2f}%')") |"
echo "(teacher: $(eval_loss "$WORK/teacher.out") eval loss; runs in $WORK)" >&2
