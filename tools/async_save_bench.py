#!/usr/bin/env python3
"""What a checkpoint save costs the training loop, with and without --async_save.

Runs train_gpt (CPU by default; pass --device=cuda on a GPU machine) with --save_every=N and a
timeline, once with the background save and once synchronous, and prints one JSON line per mode
from the timeline's spans: the median ordinary step, the time the loop is blocked by each save
(the "checkpoint" span: the copy to host memory, plus the whole write when synchronous), the
step that saves including that block relative to an ordinary step (the issue's bar: <= 1.2),
and the step after it (which shares the machine with a background write).

usage: async_save_bench.py BIN_DIR [--steps=31] [--save_every=5] [--ranks=N] [extra train_gpt flags...]
       (with --device=cuda the defaults are --steps=201 --save_every=50; --ranks=N starts N ranks with
       $DTRAIN_MPIRUN, default "mpiexec", and times rank 0, e.g. with --shard=parameters)
"""
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile


def run(bin_dir, mode_async, steps, save_every, extra, work, ranks=1):
    timeline = os.path.join(work, f"timeline-{int(mode_async)}.json")
    save_dir = os.path.join(work, f"ckpt-{int(mode_async)}")
    cmd = [os.path.join(bin_dir, "train_gpt"), "--device=cpu", "--data=synthetic", "--progress=false",
           "--log_every=1000", f"--steps={steps}", f"--save_every={save_every}", f"--save_dir={save_dir}",
           f"--timeline={timeline}", f"--async_save={'true' if mode_async else 'false'}",
           "--d_model=256", "--heads=4", "--layers=4", "--ff=1024", "--seq_len=128", "--vocab=8192",
           f"--batch_size={max(1, 8 // ranks)}", "--workers=1"] + extra
    if ranks > 1:  # the same global batch over the ranks
        cmd = shlex.split(os.environ.get("DTRAIN_MPIRUN", "mpiexec")) + ["-np", str(ranks)] + cmd
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(timeline) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("pid", 0) == 0]
    steps_ms = [e["dur"] / 1000 for e in spans if e["name"] == "step"]
    saves_ms = [e["dur"] / 1000 for e in spans
                if e["name"].startswith("checkpoint") and not e["name"].startswith("checkpoint (wait")]
    waits_ms = [e["dur"] / 1000 for e in spans if e["name"].startswith("checkpoint (wait")] or [0.0]
    # Step k (1-based) saves when k % save_every == 0; the first step is warm-up.
    saving = [steps_ms[k - 1] for k in range(save_every, len(steps_ms) + 1, save_every)]
    after = [steps_ms[k] for k in range(save_every, len(steps_ms), save_every)]
    ordinary = [steps_ms[k - 1] for k in range(2, len(steps_ms) + 1) if k % save_every not in (0, 1)]
    ckpt = sorted(f for f in os.listdir(save_dir) if f.endswith(".pt") and ".rank-" not in f)
    step_files = [f for f in os.listdir(save_dir) if f.startswith(ckpt[-1][:-3]) and f.endswith(".pt")]
    med = statistics.median
    return {"bench": "async_save", "async_save": mode_async,
            "checkpoint_mb": round(sum(os.path.getsize(os.path.join(save_dir, f)) for f in step_files) / 2**20, 1),
            "ordinary_step_ms": round(med(ordinary), 1), "save_blocks_ms": round(med(saves_ms), 1),
            "waited_for_previous_write_ms": round(med(waits_ms), 1),
            "saving_step_over_ordinary": round((med(saving) + med(saves_ms) + med(waits_ms)) / med(ordinary), 2),
            "next_step_over_ordinary": round(med(after) / med(ordinary), 2)}


def main():
    bin_dir = sys.argv[1]
    # A save every 5 steps on the CPU (steps of ~100 ms); on a GPU, where a small model's step
    # takes milliseconds, every 50, so that a write (~0.1 s) ends before the next save as in any
    # real run (which saves every few minutes); the wait for it is reported on its own.
    on_gpu = any(a == "--device=cuda" for a in sys.argv[2:])
    steps, save_every, extra = (201, 50, []) if on_gpu else (31, 5, [])
    ranks = 1
    for a in sys.argv[2:]:
        if a.startswith("--ranks="):
            ranks = int(a.split("=", 1)[1])
        elif a.startswith("--steps="):
            steps = int(a.split("=", 1)[1])
        elif a.startswith("--save_every="):
            save_every = int(a.split("=", 1)[1])
        else:
            extra.append(a)
    with tempfile.TemporaryDirectory() as work:
        for mode in (False, True):
            result = run(bin_dir, mode, steps, save_every, extra, work, ranks)
            result["ranks"] = ranks
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
