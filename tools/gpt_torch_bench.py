#!/usr/bin/env python3
"""PyTorch's own step for train_gpt's GPT on one GPU, eager and torch.compile, the anchors that
dtrain's `train_gpt --device=cuda --amp=bf16` is set beside in the same GPU command.

The model is tools/zero_torch_bench.py's Gpt (examples' GPT layout at tp = 1) at train_gpt's
default shape (GPT-2 small: d 768, 12 heads, 12 layers, ff 3072, sequence 1024, vocabulary
32000, untied head, no dropout), batch 8. The step is train_gpt's: autocast bf16 forward and
loss, backward, clip_grad_norm_(1.0), fused AdamW (lr 6e-4, betas (0.9, 0.95), weight decay
0.1), zero_grad(set_to_none=True). Data are random token ids drawn before the timed loop.

Modes (--modes, comma-separated): eager; compile (torch.compile(model), default mode: Inductor's
fused kernels for the forward and backward, the optimizer eager as a PyTorch user runs it).
Each prints one JSON line:
  mode, step_ms_median (wall time of each step, torch.cuda.synchronize() after it, over the
  steps after --warmup), mfu_percent (train_gpt's count: 6 N + 12 L d T FLOPs per token against
  989 TFLOP/s dense bf16), peak_mib (torch.cuda.max_memory_allocated), first_steps_s (the
  warm-up's wall time: compilation for the compiled modes), loss_last.

usage: python3 tools/gpt_torch_bench.py [--modes=eager,compile] [--steps=30] [--warmup=10]
           [--batch_size=8] [shape flags of zero_torch_bench.add_model_flags]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_torch_bench import Gpt, add_model_flags, dtrain_parameter_count  # noqa: E402


def timed_steps(step, a, cuda):
    """Runs step(i) for i < a.steps: the warm-up's wall time, then each later step's (the device
    synchronized after it), and the last loss."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.warmup):
        step(i)
    sync()
    first = time.perf_counter() - t0
    times, loss = [], None
    for i in range(a.warmup, a.steps):
        t = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - t)
    return first, times, loss


def run_modes(p, a, run_mode, who):
    """Checks the flags both benchmarks share, then runs each of --modes."""
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"{who}: no CUDA device; this benchmark runs on the GPU machine", file=sys.stderr)
        sys.exit(1)
    for mode in a.modes.split(","):
        if mode not in ("eager", "compile"):
            p.error(f"--modes: '{mode}' is not one of eager, compile")
        run_mode(a, mode)
        if a.device == "cuda":
            torch.cuda.empty_cache()


def run_mode(a, mode):
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    model = Gpt(a.vocab, a.d_model, a.heads, a.ff, a.seq_len, a.layers).to(dev)
    n = sum(p.numel() for p in model.parameters())
    assert n == dtrain_parameter_count(a), (n, dtrain_parameter_count(a))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=a.weight_decay, fused=dev.type == "cuda")
    fwd = torch.compile(model) if mode == "compile" else model
    g = torch.Generator().manual_seed(a.seed)
    rows = torch.randint(a.vocab, (a.steps, a.batch_size, a.seq_len + 1), generator=g)
    rows = rows.to(dev)

    def step(i):
        x, y = rows[i, :, :-1], rows[i, :, 1:]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cuda = dev.type == "cuda"
    first, times, loss = timed_steps(step, a, cuda)
    ms = 1e3 * statistics.median(times)
    flops_per_token = 6.0 * n + 12.0 * a.layers * a.d_model * a.seq_len
    tokens_per_s = a.batch_size * a.seq_len / (ms / 1e3)
    print(json.dumps({"bench": "gpt_torch", "mode": mode, "parameters": n,
                      "step_ms_median": round(ms, 2),
                      "mfu_percent": round(100 * flops_per_token * tokens_per_s / 989e12, 1),
                      "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
                      "first_steps_s": round(first, 1), "loss_last": round(loss.item(), 4)}),
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check the script")
    add_model_flags(p, d_model=768, heads=12, layers=12, ff=3072, vocab=32000, seq_len=1024)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    run_modes(p, a, run_mode, "gpt_torch_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
