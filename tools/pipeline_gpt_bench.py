#!/usr/bin/env python3
"""train_gpt under --pp=2 against data parallelism on 2 ranks at the same global batch (CPU).

Each layout trains the same GPT (synthetic tokens) for --steps steps; the step time is the
median of the logged windows after the first. Pipeline runs also write a timeline, whose
per-stage idle share of a step (dtrain-timeline summary) is printed beside the bubble's
(P-1)/(m+P-1). One run of each layout, in one invocation, so the ratios compare like with like.

The interleaved rows use --pp_chunks=2 (the default): virtual stages of 2 blocks each.

usage: pipeline_gpt_bench.py BUILD/bin [--steps N] [--mpirun "mpirun ..."]
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import tempfile

SHAPE = ["--d_model=256", "--heads=8", "--layers=8", "--seq_len=128", "--ff=1024", "--vocab=512", "--data=synthetic",
         "--workers=1", "--device=cpu", "--progress=false", "--log_every=4", "--clip_grad_norm=1.0"]
GLOBAL_BATCH = 16


def train(args, ranks, flags, name, workdir):
    metrics = os.path.join(workdir, name + ".jsonl")
    cmd = [os.path.join(args.bin, "train_gpt"), f"--metrics={metrics}", f"--steps={args.steps}"] + SHAPE + flags
    env = dict(os.environ, OMP_NUM_THREADS=str(2 // ranks))
    if ranks > 1:
        cmd = shlex.split(args.mpirun) + ["-np", str(ranks), "-x", "OMP_NUM_THREADS"] + cmd
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=900)
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    return statistics.median(r["step_ms"] for r in rows[1:]), rows[-1]["loss"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as w:
        one, loss1 = train(args, 1, [f"--batch_size={GLOBAL_BATCH}"], "one", w)
        print(f"1 rank, 2 threads, batch {GLOBAL_BATCH}: {one:.1f} ms/step (loss {loss1:.4f})")
        print("| layout | m | ms/step | vs dp 2 | idle (stage 0, 1) | bubble (P-1)/(m+P-1) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for m in (2, 4, 8):
            dp, _ = train(args, 2, [f"--batch_size={GLOBAL_BATCH // 2}", f"--accum_steps={m // 2}"], f"dp{m}", w)
            print(f"| dp 2 | {m} (each rank {m // 2}) | {dp:.1f} | 1.00 | | |")
            for schedule in ("1f1b", "gpipe", "zb", "interleaved"):
                trace = os.path.join(w, f"pp{m}{schedule}.json")
                pp, _ = train(args, 2, ["--pp=2", f"--pp_schedule={schedule}", f"--batch_size={GLOBAL_BATCH}",
                                        f"--accum_steps={m}", f"--timeline={trace}"], f"pp{m}{schedule}", w)
                out = subprocess.run([os.path.join(args.bin, "dtrain-timeline"), "summary", trace], check=True,
                                     stdout=subprocess.PIPE, text=True).stdout
                idle = [l.split("idle ")[1].split("%")[0] + "%" for l in out.splitlines() if "): idle " in l]
                # zb: its ideal (P-1)/(3m+P-1); interleaved with 2 chunks (P-1)/(2m+P-1)
                bubble = 1 / (3 * m + 1) if schedule == "zb" else 1 / (2 * m + 1) if schedule == "interleaved" else 1 / (m + 1)
                print(f"| pp 2 {schedule} | {m} | {pp:.1f} | {pp / dp:.2f} | {', '.join(idle)} | {100 * bubble:.0f}% |")


if __name__ == "__main__":
    main()
