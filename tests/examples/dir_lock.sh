#!/usr/bin/env bash
# One run per checkpoint directory: a second run on a --save_dir that a running job holds fails
# at once (exit 2, naming the holder) while the first goes on undisturbed and ends normally.
# usage: dir_lock.sh BIN_DIR
set -u
bin=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--device=cpu --progress=false --workers=0 --save_dir="$work/ckpt" --save_every=50)
"$bin/train_mlp" "${common[@]}" --steps=2000 >"$work/first.log" 2>&1 &
first=$!
for _ in $(seq 100); do  # the lock file names its holder once the first run holds it
  grep -q "pid $first" "$work/ckpt/.dtrain.lock" 2>/dev/null && break
  sleep 0.1
done
# The first run is held still while the second tries (a small MLP trains 2000 steps in a few
# seconds: without this, a loaded machine could see it finish first and free the directory).
kill -STOP "$first"
start=$(date +%s)
"$bin/train_mlp" "${common[@]}" --steps=5 >"$work/second.log" 2>&1
second=$?
kill -CONT "$first"
cat "$work/second.log"
fail=0
[[ $second == 2 ]] || { echo "FAIL: the second run exited $second, expected 2"; fail=1; }
grep -q "is in use by another run (host [^,]*, pid $first, since" "$work/second.log" ||
  { echo "FAIL: the message does not name the first run (pid $first)"; fail=1; }
(( $(date +%s) - start <= 10 )) || { echo "FAIL: the second run took more than 10 s to fail"; fail=1; }
kill -0 "$first" 2>/dev/null || { echo "FAIL: the first run did not survive the second"; fail=1; }
wait "$first"
status=$?
[[ $status == 0 ]] || { echo "FAIL: the first run exited $status"; cat "$work/first.log"; fail=1; }
[[ $fail == 0 ]] && echo "ok: the second run was refused at once; the first ran to its end"
exit $fail
