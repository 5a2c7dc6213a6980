#!/usr/bin/env python3
"""Where a profiled step's time went, from the trace that --profile_steps writes (Kineto's
Chrome trace; also reads .json.gz).

usage: profile_summary.py TRACE [--top=12]

Prints, for the profiled window (the first "dtrain step N" range's start to the end of the last
device activity): wall time per step; the union of device activity (busy vs idle, the idle
being launch gaps, host waits and host-side work the device waited for); per stream, kernel,
copy (by direction, with bytes and GB/s) and memset time; the host's time blocked in CUDA
synchronization calls; the kernel time per step by kind (matrix multiplies, attention, norms,
dtrain's fused kernels, copies and casts, element-wise, reductions, the optimizer, NCCL); and the
kernels and host operators that took the most time.
"""
import collections
import gzip
import json
import re
import sys

# Kernel kinds, first match wins (lower-case kernel names): what a step's device time went to.
KINDS = [
    ("NCCL collectives", r"nccl"),
    ("dtrain's own kernels (fused block ops, cross-entropy, norm)", r"dtrain::"),
    ("attention", r"sdpa|flash|fmha|attention|softmax"),
    ("optimizer (multi-tensor)", r"multi_tensor_apply|adam|foreach"),
    ("norms", r"layer_norm|layernorm|gammabeta|rms_?norm"),
    ("copies and casts", r"copy_kernel|direct_copy|_copy|cat_|catarray"),
    ("matrix multiplies", r"nvjet|gemm|cutlass|xmma|sm\d+_.*(nn|nt|tn|tt)|cublas"),
    ("reductions", r"reduce_kernel|reduce"),
    ("element-wise", r"elementwise|unrolled|vectorized"),
]


def kind_of(name):
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def union_length(intervals):
    total, end = 0.0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    top = 12
    for a in sys.argv[1:]:
        if a.startswith("--top="):
            top = int(a.split("=", 1)[1])
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    events = [e for e in load(args[0]).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("dtrain step ")), key=lambda e: e["ts"])
    if not steps:
        print("no 'dtrain step N' range in the trace: was it written by --profile_steps?", file=sys.stderr)
        sys.exit(1)
    device_cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    device = [e for e in events if e.get("cat") in device_cats]
    t0 = steps[0]["ts"]
    t1 = max([s["ts"] + s["dur"] for s in steps] + [e["ts"] + e["dur"] for e in device])
    window = t1 - t0
    print(f"profiled steps: {', '.join(s['name'].split()[-1] for s in steps)}; window {window / 1e3:.2f} ms "
          f"({window / 1e3 / len(steps):.2f} ms per step)")
    for s in steps:
        print(f"  {s['name']}: {s['dur'] / 1e3:.2f} ms on the host")
    if device:
        busy = union_length([(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in device if e["ts"] < t1])
        print(f"device busy (any stream) {busy / 1e3:.2f} ms = {100 * busy / window:.1f}% of the window; "
              f"idle {(window - busy) / 1e3:.2f} ms")
        per_stream = collections.defaultdict(lambda: collections.Counter())
        copies = collections.defaultdict(lambda: [0.0, 0])
        for e in device:
            stream = e.get("args", {}).get("stream", e.get("tid"))
            per_stream[stream][e["cat"]] += e["dur"]
            if e["cat"] == "gpu_memcpy":
                kind = e.get("name", "Memcpy")
                copies[kind][0] += e["dur"]
                copies[kind][1] += int(e.get("args", {}).get("bytes", 0))
        for stream, c in sorted(per_stream.items(), key=lambda kv: -sum(kv[1].values())):
            parts = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in c.most_common())
            print(f"  stream {stream}: {parts}")
        for kind, (dur, nbytes) in sorted(copies.items(), key=lambda kv: -kv[1][0]):
            rate = nbytes / (dur * 1e3) if dur > 0 else 0.0
            print(f"  {kind}: {dur / 1e3:.2f} ms, {nbytes / 2**20:.1f} MiB, {rate:.1f} GB/s")
    else:
        print("no device activity in the trace (a CPU run)")
    sync = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in str(e.get("name", ""))]
    if sync:
        by = collections.Counter()
        for e in sync:
            by[e["name"]] += e["dur"]
        print("host blocked in CUDA synchronization: " +
              ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in by.most_common()))
    kernels = collections.Counter()
    counts = collections.Counter()
    for e in device:
        if e["cat"] == "kernel":
            kernels[e["name"][:90]] += e["dur"]
            counts[e["name"][:90]] += 1
    if kernels:
        n_steps = len({s["name"] for s in steps})
        by_kind = collections.Counter()
        for e in device:
            if e["cat"] == "kernel":
                by_kind[kind_of(e["name"])] += e["dur"]
        total = sum(by_kind.values())
        print(f"kernel time by kind (ms per step over {n_steps} step(s); share of kernel time):")
        for kind, dur in by_kind.most_common():
            print(f"  {dur / 1e3 / n_steps:8.2f}  {100 * dur / total:5.1f}%  {kind}")
        print(f"top kernels (ms, calls):")
        for name, dur in kernels.most_common(top):
            print(f"  {dur / 1e3:8.2f} {counts[name]:5d}  {name}")
    ops = collections.Counter()
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["name"]] += e["dur"]
    if ops:
        print("top host operators by inclusive time (ms; nested operators count again):")
        for name, dur in ops.most_common(top):
            print(f"  {dur / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
