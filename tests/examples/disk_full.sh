#!/usr/bin/env bash
# A save that fails part-way (the disk fills up: a 64 KiB tmpfs) ends the run with a clear
# message and leaves no file of the failed step in the checkpoint directory.
# usage: disk_full.sh BIN_DIR   (needs root to mount a tmpfs; exits 77, skipped, otherwise)
set -u
bin=$1
mnt=$(mktemp -d)
if ! mount -t tmpfs -o size=64k tmpfs "$mnt" 2>/dev/null; then
  echo "skipped: cannot mount a tmpfs here (needs root)"
  rmdir "$mnt"
  exit 77
fi
trap 'umount "$mnt"; rmdir "$mnt"' EXIT
"$bin/train_mlp" --device=cpu --progress=false --workers=0 --steps=2 --save_dir="$mnt/ckpt" >"$mnt/../dtrain_disk_full.log" 2>&1
status=$?
log=$(cat "$mnt/../dtrain_disk_full.log"; rm -f "$mnt/../dtrain_disk_full.log")
echo "$log"
fail=0
[[ $status != 0 ]] || { echo "FAIL: the run exited 0 although its checkpoint could not be written"; fail=1; }
grep -q "No space left on device" <<<"$log" || { echo "FAIL: the message does not say the disk is full"; fail=1; }
left=$(ls -A "$mnt/ckpt" | grep -v '^\.dtrain\.lock$')
[[ -z $left ]] || { echo "FAIL: the failed save left files behind: $left"; fail=1; }
[[ $fail == 0 ]] && echo "ok: exit $status, the directory holds no file of the failed save"
exit $fail
