#!/usr/bin/env python3
"""tools/profile_summary.py on a synthetic GPU trace (the kernel kinds per step, the device's
busy share, copies) whose answers are known, and on a real CPU trace of train_gpt
--profile_steps (the steps found, no device activity, the host operators).

usage: profile_summary_cli.py BIN_DIR
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "profile_summary.py")


def run(args):
    p = subprocess.run([sys.executable, TOOL] + args, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def kernel(name, ts, dur):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": "kernel", "args": {"stream": 7}}


def main():
    fails = []
    tmp = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    # Two profiled steps (each named twice, as the trainer's two ranges are), 2 ms; 1.2 ms of kernels.
    events = [{"ph": "X", "name": f"dtrain step {s}", "ts": t, "dur": 1000, "cat": "user_annotation"}
              for s, t in ((4, 0), (4, 0), (5, 1000), (5, 1000))]
    events += [
        kernel("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", 10, 400),
        kernel("void dtrain::engine::detail::(anonymous namespace)::add_norm_forward_kernel<Fp32>", 500, 100),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", 700, 200),
        kernel("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", 1100, 50),
        kernel("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<Adam>", 1200, 150),
        kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 1400, 100),
        kernel("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float>", 1600, 200),
        {"ph": "X", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 1850, "dur": 100, "cat": "gpu_memcpy",
         "args": {"stream": 16, "bytes": 100 * 2**20}},
    ]
    path = os.path.join(tmp, "gpu.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    rc, out = run([path])
    want = [
        "profiled steps: 4, 4, 5, 5; window 2.00 ms",
        "device busy (any stream) 1.30 ms = 65.0% of the window",
        "kernel time by kind (ms per step over 2 step(s); share of kernel time):",
        "0.20   33.3%  matrix multiplies",
        "0.10   16.7%  attention",
        "0.10   16.7%  norms",
        "0.07   12.5%  optimizer (multi-tensor)",
        "0.05    8.3%  dtrain's own kernels",
        "0.05    8.3%  element-wise",
        "0.03    4.2%  copies and casts",
        "Memcpy DtoH (Device -> Pinned): 0.10 ms, 100.0 MiB, 1048.6 GB/s",
    ]
    if rc != 0:
        fails.append(f"synthetic trace: exit {rc}")
    for w in want:
        if w not in out:
            fails.append(f"synthetic trace: no '{w}'")
    # A real CPU trace from train_gpt.
    bin_dir = sys.argv[1]
    cpu = os.path.join(tmp, "cpu.json")
    p = subprocess.run([os.path.join(bin_dir, "train_gpt"), "--device=cpu", "--data=synthetic", "--d_model=32",
                        "--layers=1", "--heads=2", "--vocab=64", "--seq_len=16", "--batch_size=2", "--steps=5",
                        "--progress=false", "--profile_steps=3-4", f"--profile_out={cpu}"],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        fails.append(f"train_gpt --profile_steps exit {p.returncode}: {p.stderr[-500:]}")
    else:
        rc, out = run([cpu, "--top=3"])
        for w in ["profiled steps: 3, 4", "no device activity in the trace (a CPU run)",
                  "top host operators by inclusive time"]:
            if w not in out:
                fails.append(f"CPU trace: no '{w}' in: {out}")
    rc, out = run([])
    if rc != 2:
        fails.append(f"no argument: exit {rc}, expected 2")
    for f in fails:
        print("FAIL", f)
    if not fails:
        print("ok: kernel kinds per step, busy share and copies of a synthetic trace; a real CPU trace")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
