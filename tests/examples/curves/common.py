"""What the scenarios of loss_curves.py share: running a program, its metrics, comparing curves."""
import json
import os
import shlex
import subprocess
import sys
import time


def run(cmd, env=None):
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    start = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    print(p.stdout[-3000:], flush=True)
    # The seconds each command took: what to look at when the suite's time grows.
    print(f"[{time.monotonic() - start:.1f} s]", flush=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: exit status {p.returncode}")
    return p.stdout


def metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(args, program, ranks, flags, name, expect_status=0, env=None, output=False):
    """The metrics of a run that must exit 0, or (output=True, or another expected status) its output."""
    out = os.path.join(args.workdir, name + ".jsonl")
    cmd = [os.path.join(args.bin, program), f"--metrics={out}", "--log_every=1", "--device=cpu",
           "--progress=false"] + flags
    if ranks > 1:
        cmd = shlex.split(args.mpirun) + ["-np", str(ranks)] + cmd
    if expect_status == 0 and not output:
        run(cmd, env=dict(os.environ, **env) if env else None)
        return metrics(out)
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
                       env=dict(os.environ, **env) if env else None)
    print(p.stdout[-3000:], flush=True)
    if p.returncode != expect_status:
        sys.exit(f"FAIL: expected exit status {expect_status}, got {p.returncode}")
    return p.stdout


def compare(ref, other, name, tol, mean_tol=None):
    """Every step within tol (relative); with mean_tol, also the mean difference."""
    assert len(ref) == len(other), f"{name}: {len(other)} steps logged, reference has {len(ref)}"
    worst = 0.0
    total = 0.0
    for a, b in zip(ref, other):
        assert a["step"] == b["step"], (a["step"], b["step"])
        rel = abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
        worst = max(worst, rel)
        total += rel
        if rel > tol:
            sys.exit(f"FAIL: {name}: step {a['step']} loss {b['loss']} vs reference {a['loss']} "
                     f"(relative difference {rel:.3g} > {tol})")
    mean = total / len(ref)
    if mean_tol is not None and mean > mean_tol:
        sys.exit(f"FAIL: {name}: mean relative difference {mean:.3g} > {mean_tol}")
    print(f"ok: {name} follows the reference over {len(ref)} steps (worst relative difference "
          f"{worst:.2e}, mean {mean:.2e})")


def compare_grad_norms(ref, other, name, tol=1e-4):
    """The logged gradient norms of two runs, step by step, within tol (relative)."""
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(ref, other) if "grad_norm" in a and "grad_norm" in b]
    assert norms, f"{name}: no grad_norm logged"
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in norms)
    assert worst < tol, f"{name}: gradient norm differs from the reference by {worst:.3g} (relative)"
    print(f"ok: {name}: gradient norms match over {len(norms)} steps (worst {worst:.2e})")


def steps_after(rows, step):
    return [r for r in rows if r["step"] > step]


def dir_digest(path):
    """The checkpoints' bytes (not the lock file, which names the run holding the directory)."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(path) if n != ".dtrain.lock"):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()
