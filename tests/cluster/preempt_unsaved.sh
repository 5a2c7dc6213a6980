#!/usr/bin/env bash
# Preempted without --save_dir: nothing is saved, so the run must not ask to be requeued (a
# requeued run would start over): exit 143 (kExitPreemptedUnsaved) with a message saying so, and
# no requeue attempted. A user audit saw "checkpoint saved, exiting with 85 to be requeued".
# usage: preempt_unsaved.sh TRAIN_MLP
set -u
exe=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$exe" --device=cpu --steps=1000000 --progress=false --log_every=1 --metrics="$work/m.jsonl" >"$work/out" 2>&1 &
pid=$!
for _ in $(seq 300); do grep -q '"step"' "$work/m.jsonl" 2>/dev/null && break; sleep 0.1; done
kill -TERM $pid
status=0; wait $pid || status=$?
fail() { cat "$work/out"; echo "FAIL: $*"; exit 1; }
[[ $status == 143 ]] || fail "exit status $status, expected 143"
grep -q "no --save_dir, nothing saved: exiting with 143, not to be requeued" "$work/out" || fail "no message saying nothing was saved"
grep -q "checkpoint saved" "$work/out" && fail "it claims a checkpoint was saved"
grep -q "requeue:" "$work/out" && fail "it tried to requeue"
echo "preempt_unsaved.sh: exit 143, nothing saved, no requeue"
