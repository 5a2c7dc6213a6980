#!/usr/bin/env python3
"""PyTorch reference for dtrain's --shard=none|optimizer|gradients: the same small GPT trained
"the PyTorch way" on the CPU with gloo, 2 processes, so that memory and step time can be set
beside dtrain's DDP, ZeRO-1 and ZeRO-2.

Modes (--mode, default: all three, each in a fresh pair of processes):
  ddp    DistributedDataParallel + torch.optim.AdamW                 (dtrain --shard=none)
  zero1  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW) (dtrain --shard=optimizer)
  zero2  FSDP1 FullyShardedDataParallel(ShardingStrategy.SHARD_GRAD_OP) around the whole
         model + AdamW over the local FlatParameter shard            (dtrain --shard=gradients)
  zero3  FSDP1 FULL_SHARD with each Block its own unit (ModuleWrapPolicy) and the embeddings
         and head in the root unit, forward prefetch on               (dtrain --shard=parameters)

The model mirrors examples/gpt_model.{h,cc} at tp = 1 (GPT-2 layout): token embedding
(vocab x d) plus learned positional embedding (seq_len x d); per block a pre-norm LayerNorm,
causal self-attention as one fused qkv Linear (d -> 3d, with bias) and an output projection
(d -> d, with bias) through scaled_dot_product_attention, a second LayerNorm and an MLP
Linear(d -> ff) -> GELU(tanh) -> Linear(ff -> d), both with biases; a final LayerNorm and an
untied output head Linear(d -> vocab) without bias; no dropout (train_gpt's default 0). The
parameter count is therefore GptImpl::parameter_count()'s formula
    vocab*d + seq_len*d + layers*(2*2d + (3d^2 + 3d) + (d^2 + d) + (d*ff + ff) + (ff*d + d))
    + 2d + vocab*d
which at the default shape (d 128, heads 4, layers 2, ff 512, vocab 2048, seq_len 32) is
925,184, the 0.925184M dtrain reports; the script checks that the two agree. Initial weights
follow torch's defaults as dtrain's layers do (Embedding N(0, 1), Linear U(+-1/sqrt(fan_in))),
drawn from the same seed on every rank.

Training follows train_gpt's defaults: AdamW lr 6e-4, betas (0.9, 0.95) (train_gpt sets
beta2 = 0.95), eps 1e-8, weight decay 0.1 on every parameter, gradient clipping to global norm
1.0 (torch.nn.utils.clip_grad_norm_, or FSDP's clip_grad_norm_ for zero2), constant lr, fp32.
Data are random token ids: per rank, a generator seeded with seed + rank draws rows of
seq_len + 1 tokens (inputs are the first seq_len, targets the last seq_len, as train_gpt's
loader does), all drawn before the timed loop.

Printed per mode by rank 0, one JSON line:
  parameters              the full model's parameter count (before any wrapping)
  grad_bytes              bytes of gradient storage held after optimizer.step() and before
                          zero_grad(): the sum of untyped_storage().nbytes() over the .grad of
                          every parameter of the wrapped model that has one, each storage
                          counted once. ddp/zero1: the full-size p.grad tensors (DDP's reducer
                          buckets, a further copy it keeps, are not counted). zero2: the .grad
                          of the local FlatParameter (with use_orig_params=False the wrapped
                          model's parameters are the FlatParameters), i.e. this rank's
                          reduce-scattered shard (padded to divide by the world size).
  grad_bytes_after_zero_grad  the same sum after zero_grad() (torch's default set_to_none=True
                          drops the tensors, so this is what is held across the step boundary)
  optimizer_state_bytes   sum of nbytes() of every tensor in optimizer.state on this rank
                          (exp_avg, exp_avg_sq and the scalar step); for ZeroRedundancyOptimizer
                          the state of its local optimizer (.optim), i.e. this rank's partition
  step_ms_median          median wall time (time.perf_counter) of forward + backward + clip +
                          optimizer.step() + zero_grad() over steps 51..steps (1-based)
  loss_last               the loss of the last step, averaged over the ranks

usage: .venv/bin/python tools/zero_torch_bench.py [--mode=all|ddp|zero1|zero2|zero3] [--steps=200]
           [--world=2] [--d_model=128] [--heads=4] [--layers=2] [--ff=512] [--vocab=2048]
           [--seq_len=32] [--batch_size=8]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

MODES = ("ddp", "zero1", "zero2", "zero3")
WARMUP_STEPS = 50  # steps 1..50 are excluded from the median


# ---- the model (examples/gpt_model.cc at tp = 1) ------------------------------------------

class Block(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)  # q, k and v fused, as ParallelSelfAttention's qkv
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # [B, T, d] -> [B, heads, T, head_dim]
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        h = x + self.attention(self.ln1(x))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, d, heads, ff, seq_len, layers):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)  # learned positions
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)  # untied from wte

    def forward(self, inputs, targets):
        pos = torch.arange(inputs.size(1), device=inputs.device)
        x = self.wte(inputs) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def add_model_flags(p, d_model, heads, layers, ff, vocab, seq_len):
    """The flags Gpt's shape, AdamW and the data are built from (train_gpt's names), for this
    benchmark and tools/pipeline_torch_bench.py; the shape's defaults are each benchmark's own."""
    for name, default in (("d_model", d_model), ("heads", heads), ("layers", layers), ("ff", ff),
                          ("vocab", vocab), ("seq_len", seq_len)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--clip_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)


def dtrain_parameter_count(a):
    """GptImpl::parameter_count() from examples/gpt_model.cc."""
    d, f = a.d_model, a.ff
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return a.vocab * d + a.seq_len * d + a.layers * per_block + 2 * d + a.vocab * d


# ---- measurements -------------------------------------------------------------------------

def grad_bytes(module):
    """Bytes of the storages behind the .grad of module's parameters, each storage once."""
    seen, total = set(), 0
    for p in module.parameters():
        if p.grad is None:
            continue
        s = p.grad.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def state_bytes(optimizer):
    """Bytes of every tensor in optimizer.state (for ZeroRedundancyOptimizer: its local one)."""
    inner = getattr(optimizer, "optim", optimizer)
    return sum(v.nbytes for st in inner.state.values() for v in st.values() if torch.is_tensor(v))


# ---- one mode on one rank -----------------------------------------------------------------

def worker(rank, a, mode, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    run_mode(rank, a, mode)
    dist.destroy_process_group()
    # Leave without the interpreter's shutdown: a gloo worker thread may still be releasing
    # the last collective's work (and so a tensor owned by Python) when the interpreter
    # finalizes, which intermittently aborted a rank with "terminate called without an
    # active exception" (seen with torch 2.11). Everything this rank reports is printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_mode(rank, a, mode):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(a.seed)  # the same initial weights on every rank
    model = Gpt(a.vocab, a.d_model, a.heads, a.ff, a.seq_len, a.layers)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == dtrain_parameter_count(a), (parameters, dtrain_parameter_count(a))

    adamw = dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    if mode == "zero3":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        wrapped = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
                       auto_wrap_policy=ModuleWrapPolicy({Block}), forward_prefetch=True, use_orig_params=False)
        optimizer = torch.optim.AdamW(wrapped.parameters(), **adamw)  # the local shards

        def clip():
            wrapped.clip_grad_norm_(a.clip_grad_norm)
    elif mode == "zero2":
        # One FSDP unit around the whole model, on the CPU. device_id=cpu is required: without
        # a device_id this torch refuses ("FSDP needs a non-CPU accelerator device, but no
        # accelerator device is detected."). SHARD_GRAD_OP keeps the gathered parameters
        # from forward through backward and reduce-scatters the gradients, so each rank holds
        # 1/world of the gradients and of the optimizer state between steps (ZeRO-2).
        wrapped = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                       device_id=torch.device("cpu"), use_orig_params=False)
        optimizer = torch.optim.AdamW(wrapped.parameters(), **adamw)  # the local shard

        def clip():
            wrapped.clip_grad_norm_(a.clip_grad_norm)
    else:
        wrapped = DDP(model)
        if mode == "zero1":
            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW,
                                                **adamw)
        else:
            optimizer = torch.optim.AdamW(wrapped.parameters(), **adamw)

        def clip():
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), a.clip_grad_norm)

    # This rank's data, drawn up front: rows of seq_len + 1 random tokens.
    gen = torch.Generator().manual_seed(a.seed + rank)
    rows = torch.randint(a.vocab, (a.steps, a.batch_size, a.seq_len + 1), generator=gen)

    times_ms = []
    for step in range(a.steps):
        inputs, targets = rows[step, :, :-1], rows[step, :, 1:]
        t0 = time.perf_counter()
        loss = wrapped(inputs, targets)
        loss.backward()
        clip()
        optimizer.step()
        if step == a.steps - 1:  # measured outside the timed span below
            t_pause = time.perf_counter()
            held_grad = grad_bytes(wrapped)
            held_state = state_bytes(optimizer)
            t0 += time.perf_counter() - t_pause
        optimizer.zero_grad()
        times_ms.append((time.perf_counter() - t0) * 1e3)

    last = loss.detach().clone()
    dist.all_reduce(last)
    if rank == 0:
        print(json.dumps({
            "mode": mode,
            "world": a.world,
            "parameters": parameters,
            "grad_bytes": held_grad,
            "grad_bytes_after_zero_grad": grad_bytes(wrapped),
            "optimizer_state_bytes": held_state,
            "step_ms_median": round(statistics.median(times_ms[WARMUP_STEPS:]), 3),
            "loss_last": round(last.item() / a.world, 4),
        }), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="all", choices=("all",) + MODES)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=8, help="rows per rank")
    add_model_flags(p, d_model=128, heads=4, layers=2, ff=512, vocab=2048, seq_len=32)
    a = p.parse_args()
    assert a.steps > WARMUP_STEPS, f"--steps must exceed the {WARMUP_STEPS} warm-up steps"

    print(json.dumps({"torch": torch.__version__, "world": a.world, "threads_per_rank": 1}), flush=True)
    for mode in MODES if a.mode == "all" else (a.mode,):
        # A fresh pair of processes (and process group) per mode.
        mp.spawn(worker, args=(a, mode, free_port()), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
