#!/usr/bin/env bash
# --help of every example: exit 0, at most 114 lines (about a screen and a half; train_gpt's 113 with its samples'
# flags; dtrain-plan, planner and simulator in one, 120), dtrain's flags grouped by topic, no logging
# library internals, and only the flags that apply to the program (no tensor parallelism or
# transformer shape for the MLP; both for the GPT).
# usage: help.sh BIN_DIR
set -uo pipefail
bin=$1
fail() { echo "FAIL: $*"; exit 1; }
for program in train_mlp train_cnn train_gpt train_seq2seq dtrain-plan dtrain-export; do
  for flag in --help -h --helpshort; do
    out=$("$bin/$program" "$flag" 2>&1) || fail "$program $flag exited $?"
    lines=$(wc -l <<<"$out")
    # dtrain-plan is the planner and the simulator (--simulate, --calibrate): its own limit.
    limit=114
    [[ $program == dtrain-plan ]] && limit=120
    ((lines <= limit)) || fail "$program $flag prints $lines lines (limit $limit)"
    if [[ $program == dtrain-export ]]; then  # exports: its own flags and the device's, no training ones
      grep -q "^Export:" <<<"$out" || fail "$program $flag has no Export section"
      ! grep -qE "^Training:|--steps=|--offload=" <<<"$out" || fail "$program $flag lists training flags it does not take"
    else
      grep -q "^Training:" <<<"$out" || fail "$program $flag has no Training section"
      grep -q "^Checkpoints and preemption:" <<<"$out" || fail "$program $flag has no checkpoint section"
    fi
    ! grep -qE "logtostderr|minloglevel|flagfile|tryfromenv" <<<"$out" || fail "$program $flag shows gflags/glog internals"
  done
  echo "ok: $program --help: $lines lines"
done
mlp=$("$bin/train_mlp" --help)
! grep -qE -- "--tp=|--d_model=" <<<"$mlp" || fail "train_mlp --help shows flags it does not have (--tp, --d_model)"
grep -q -- "--hidden=256" <<<"$mlp" || fail "train_mlp --help misses its model flag --hidden"
grep -q -- "--steps=200 " <<<"$mlp" || fail "train_mlp --help does not show its own default --steps=200"
gpt=$("$bin/train_gpt" --help)
grep -q -- "--tp=1" <<<"$gpt" || fail "train_gpt --help misses --tp"
grep -q -- "--d_model=768" <<<"$gpt" || fail "train_gpt --help misses --d_model (default 768)"
grep -q -- "--verify_steps" <<<"$("$bin/dtrain-plan" --help)" || fail "dtrain-plan --help misses its own flags"
grep -q -- "--write_example" <<<"$("$bin/dtrain-export" --help)" || fail "dtrain-export --help misses its own flags"
grep -q -- "--quantize=" <<<"$("$bin/dtrain-export" --help)" || fail "dtrain-export --help misses --quantize"
grep -q -- "--quantize=" <<<"$mlp" || fail "train_mlp --help misses --quantize"
# --helpfull still lists everything (glog's flags included) for whoever needs it.
full=$("$bin/train_mlp" --helpfull 2>&1)  # gflags exits 1 after --helpfull
grep -q "logtostderr" <<<"$full" || fail "--helpfull no longer lists glog's flags"
echo "ok: every --help is short and shows the program's own flags"
