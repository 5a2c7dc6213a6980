#!/usr/bin/env python3
"""The step-time simulator against measured steps of train_gpt on this machine.

1. dtrain-plan --calibrate under mpirun with --ranks ranks (one thread each) measures the
   machine and the model and writes the cluster file (matrix multiply and attention rates, memory
   bandwidth, the shortest kernel, the all-reduce's latency and bandwidth, the model's forward and
   backward, the trainer's step overhead).
2. Each layout of LAYOUTS trains the same GPT (synthetic tokens) for --steps steps; the measured
   step time is the median of the steps after the first two.
3. dtrain-plan --simulate --cluster=FILE with the same flags predicts it from the calibrated
   roofline of the model's shape, and (layouts without tp and cp) with --measured=FILE from the
   model's own pieces as dtrain-plan --measure timed them (the path of a user's own ModelSpec).
Prints a markdown table (layout, ranks, measured, predicted, error) and writes JSON lines to
--out. One invocation measures every row, so the rows compare like with like; run it on an
otherwise idle machine.

usage: simulate_check.py BUILD/bin [--steps N] [--mpirun "mpirun ..."] [--out FILE]
       simulate_check.py BUILD/bin --nodes 2 --mpirun "cluster/netns/testbed.sh run mpirun --hostfile H ..."
With --nodes 2 (the netns test bed's two hosts, one slot each) the calibration's all-reduce is
the link between the hosts, and the rows are the 2-rank layouts, one rank per host.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

SHAPE = ["--model=gpt", "--d_model=256", "--heads=4", "--layers=4", "--seq_len=256", "--ff=1024", "--vocab=4096"]
TRAIN = ["--data=synthetic", "--workers=0", "--device=cpu", "--progress=false", "--log_every=1", "--dropout=0"]

# (ranks, flags): data, tensor, pipeline and context parallelism, ZeRO 1-3, offload,
# checkpointing and accumulation, 1 to 4 ranks (4 ranks share the machine's 2 cores).
LAYOUTS = [
    (1, ["--batch_size=8"]),
    (1, ["--batch_size=8", "--accum_steps=4"]),
    (1, ["--batch_size=8", "--checkpoint_activations"]),
    (1, ["--batch_size=8", "--offload=optimizer"]),
    (2, ["--batch_size=8"]),
    (2, ["--batch_size=8", "--shard=optimizer"]),
    (2, ["--batch_size=8", "--shard=gradients"]),
    (2, ["--batch_size=8", "--shard=parameters"]),
    (2, ["--batch_size=8", "--tp=2"]),
    (2, ["--batch_size=8", "--accum_steps=4", "--pp=2"]),
    (2, ["--batch_size=8", "--cp=2"]),
    (2, ["--batch_size=8", "--accum_steps=2", "--checkpoint_activations"]),
    (4, ["--batch_size=4"]),
    (4, ["--batch_size=8", "--tp=2"]),
    (4, ["--batch_size=8", "--accum_steps=4", "--pp=2"]),
]
TWO_HOSTS = [layout for layout in LAYOUTS if layout[0] == 2]


def launch(args, ranks, cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ranks > 1:
        cmd = shlex.split(args.mpirun) + ["-np", str(ranks), "-x", "OMP_NUM_THREADS"] + cmd
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"simulate_check.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the calibration run (the links)")
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --allow-run-as-root --bind-to none "
                                        "--mca btl self,vader,tcp --mca mpi_yield_when_idle 1")
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="row numbers to run (0-based, comma-separated)")
    ap.add_argument("--nodes", type=int, default=1, help="hosts the ranks span (2: the netns test bed)")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    plan = os.path.join(args.bin, "dtrain-plan")
    rows = []
    with tempfile.TemporaryDirectory() as w:
        cluster = os.path.join(w, "cluster.json")
        out = launch(args, args.ranks, [plan] + SHAPE + ["--batch_size=8", f"--calibrate={cluster}"])
        print("".join(l + "\n" for l in out.splitlines() if l.startswith("calibrate:")), end="")
        measured_model = os.path.join(w, "measured.json")
        out = launch(args, args.ranks, [plan] + SHAPE + ["--batch_size=8", f"--measure={measured_model}"])
        print("".join(l + "\n" for l in out.splitlines() if l.startswith("measure:")), end="")
        print("| layout | ranks | measured ms | predicted ms (roofline) | error | predicted ms (measured spec) | error |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        only = {int(x) for x in args.only.split(",") if x}
        for i, (ranks, flags) in enumerate(LAYOUTS if args.nodes == 1 else TWO_HOSTS):
            if only and i not in only:
                continue
            metrics = os.path.join(w, f"m{i}.jsonl")
            launch(args, ranks, [os.path.join(args.bin, "train_gpt"), f"--metrics={metrics}",
                                 f"--steps={args.steps}"] + [f for f in SHAPE if f != "--model=gpt"] + TRAIN + flags)
            steps = [json.loads(l) for l in open(metrics) if l.strip()]
            measured = statistics.median(r["step_ms"] for r in steps[2:])
            sim = subprocess.run([plan, "--simulate", f"--cluster={cluster}", f"--nodes={args.nodes}",
                                  f"--gpus_per_node={ranks // args.nodes}"] + SHAPE + flags, check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            pred = json.loads([l for l in sim.splitlines() if l.startswith("{")][-1])
            predicted = 1e3 * pred["step_s"]
            err = (predicted - measured) / measured
            # The model measured through its spec prices the layouts without tp and cp.
            spec_ms, spec_err = None, None
            if not any(f.startswith("--tp=") or f.startswith("--cp=") for f in flags):
                sim = subprocess.run([plan, "--simulate", f"--cluster={cluster}", f"--measured={measured_model}",
                                      f"--nodes={args.nodes}", f"--gpus_per_node={ranks // args.nodes}"] + SHAPE +
                                     flags, check=True, stdout=subprocess.PIPE, text=True).stdout
                spec_ms = 1e3 * json.loads([l for l in sim.splitlines() if l.startswith("{")][-1])["step_s"]
                spec_err = (spec_ms - measured) / measured
            rows.append({"ranks": ranks, "nodes": args.nodes, "flags": " ".join(flags), "layout": pred["layout"],
                         "measured_ms": round(measured, 2), "predicted_ms": round(predicted, 2),
                         "error": round(err, 4), "parts": pred["parts"],
                         "spec_predicted_ms": spec_ms and round(spec_ms, 2), "spec_error": spec_err and round(spec_err, 4)})
            spec = f"{spec_ms:.1f} | {100 * spec_err:+.1f}%" if spec_ms else "- | -"
            print(f"| {' '.join(flags)} | {ranks} | {measured:.1f} | {predicted:.1f} | {100 * err:+.1f}% | {spec} |",
                  flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {100 * worst:.1f}% over {len(rows)} layouts (roofline, calibrated)")
    spec_rows = [r for r in rows if r["spec_error"] is not None]
    if spec_rows:
        print(f"worst error {100 * max(abs(r['spec_error']) for r in spec_rows):.1f}% over {len(spec_rows)} layouts "
              "(measured spec)")
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
