#!/usr/bin/env python3
"""PyTorch reference for dtrain's --pp=2: the same GPT trained "the PyTorch way" with
torch.distributed.pipelining on the CPU, 2 processes over gloo, beside DistributedDataParallel
at the same global batch, so that step times can be set beside train_gpt --pp=2 (see
tools/pipeline_gpt_bench.py, which runs the dtrain side at the same shape).

Layouts (--mode, default: all, each run in a fresh pair of processes):
  ddp   DistributedDataParallel over the 2 ranks; each rank takes its half (batch/2 rows) of
        the global batch as m/2 accumulated micro-batches, no_sync() on all but the last
        (dtrain --batch_size=batch/2 --accum_steps=m/2 on 2 ranks)
  pp    torch.distributed.pipelining: stage 0 (rank 0) = token + position embeddings and the
        first layers//2 blocks, stage 1 (rank 1) = the other blocks, the final LayerNorm and
        the head; PipelineStage + Schedule1F1B, ScheduleGPipe or ScheduleInterleavedZeroBubble
        with one stage per rank (ZB1P: zb), or ScheduleInterleaved1F1B with 2 stages per rank
        (virtual stages rank and rank + 2 of 4, layers/4 blocks each: interleaved) (--schedule) splitting the
        global batch into m = --micro_batches micro-batches, loss_fn = mean cross-entropy
        (dtrain --pp=2 --pp_schedule=1f1b|gpipe|zb|interleaved --batch_size=batch --accum_steps=m)
  all   ddp, pp 1f1b and pp gpipe for m in 2, 4, 8, then a markdown table
        | layout | m | ms/step | vs ddp |

What matches dtrain's train_gpt: the model is tools/zero_torch_bench.py's (imported from it),
which mirrors examples/gpt_model.cc at tp = 1: pre-norm blocks, fused qkv attention through
scaled_dot_product_attention (causal), GELU(tanh) MLP, learned positions, untied head without
bias, no dropout, torch's default initialisation, the whole model built from one seed on every
rank (a pipeline stage keeps its part of it and drops the rest, so both layouts start from the
same weights). The blocks split as engine::pipeline_stage_bounds does for 2 stages (stage 0
layers//2, stage 1 the rest). AdamW lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
every parameter (per stage over that stage's parameters under pp), gradient clipping to a
global norm of 1.0 (under pp: each stage's sum of squared gradients is all-reduced over the two
ranks and both stages scale by min(1, 1/(norm + 1e-6)), torch's clip_grad_norm_ rule), constant
lr, fp32. The loss is the mean cross-entropy of the global batch: the schedule divides the
gradients by m (scale_grads=True), ddp divides each micro-batch's loss by m/2 and DDP averages
over the ranks. Data are random token ids: one generator seeded with --seed draws the whole
global batch of every step (rows of seq_len + 1 tokens; inputs the first seq_len, targets the
last seq_len, as train_gpt's loader) on every rank, before the timed loop; ddp rank r takes rows
[r*batch/2, (r+1)*batch/2). So both layouts see the same batches from the same weights and the
loss of step 1 is the same in all of them (printed with --print_losses).

What differs: torch's schedules send activations and gradients with gloo point-to-point
send/recv (isend/irecv) between the two processes, dtrain with its own communicator; the
schedule infers the shapes of the stage's inputs and outputs on its first step (an extra
exchange, inside the warm-up); the last stage returns no merged outputs (return_outputs=False);
each process runs with torch.set_num_threads(1) (2 processes on 2 cores), while dtrain's
benchmark gives each rank OMP_NUM_THREADS = 2 / ranks, the same 1. The data are not dtrain's
synthetic stream, so losses agree with dtrain's only in magnitude (about ln(vocab) at the start).

Timing: every step is timed with time.perf_counter from just after a barrier to the end of the
optimizer step and zero_grad (pp: schedule.step + clip + step; ddp: the micro-batches' forward
and backward + clip + step); rank 0 prints the median over the steps after the first 5
(warm-up) as one line, e.g.
  torch pipelining 1f1b m=4: 812.3 ms/step (median of 12), loss 6.2631
  torch ddp m=4: 640.1 ms/step (median of 12), loss 6.2629
where loss is the last step's mean cross-entropy of the global batch.

usage: .venv/bin/python tools/pipeline_torch_bench.py [--mode=all|ddp|pp] [--schedule=1f1b|gpipe|zb|interleaved]
           [--micro_batches=4] [--steps=17] [--batch=16] [--d_model=256] [--heads=8] [--layers=8]
           [--seq_len=128] [--ff=1024] [--vocab=512] [--seed=42] [--print_losses]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_torch_bench import Gpt, add_model_flags, dtrain_parameter_count, free_port  # noqa: E402

WORLD = 2
WARMUP_STEPS = 5  # steps 1..5 are excluded from the median
SCHEDULES = ("1f1b", "gpipe", "zb", "interleaved")
CHUNKS = 2  # interleaved: model chunks per rank (virtual stages c * WORLD + rank)


# ---- one pipeline stage of the model --------------------------------------------------------

class GptStage(nn.Module):
    """This stage's part of a whole Gpt: the embeddings on the first stage, the final LayerNorm
    and head on the last, and the blocks [first, last) keyed by their whole-model index (so
    parameter names say which block they are). Stage 0 maps token ids [B, T] to hidden states
    [B, T, d], the last stage hidden states to logits [B, T, vocab]."""

    def __init__(self, gpt, first, last, is_first, is_last):
        super().__init__()
        self.wte = gpt.wte if is_first else None
        self.wpe = gpt.wpe if is_first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(first, last)})
        self.ln_f = gpt.ln_f if is_last else None
        self.head = gpt.head if is_last else None

    def forward(self, x):
        if self.wte is not None:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def mean_cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def stage_bounds(layers, stage):
    """engine::pipeline_stage_bounds for 2 stages: stage 0 gets layers//2, stage 1 the rest."""
    split = layers // WORLD
    return (0, split) if stage == 0 else (split, layers)


# ---- one layout on one rank -----------------------------------------------------------------

def worker(rank, a, layout, port, results):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    run_layout(rank, a, layout, results)
    dist.destroy_process_group()
    # As zero_torch_bench.worker: leave without the interpreter's shutdown (a gloo worker
    # thread may still hold the last collective's tensors). Everything has been printed/sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_layout(rank, a, layout, results):
    mode, schedule_name, m = layout
    assert a.batch % m == 0, f"m (={m}) must divide --batch (={a.batch}): micro-batches of equal rows"
    torch.manual_seed(a.seed)  # the same whole model on every rank
    gpt = Gpt(a.vocab, a.d_model, a.heads, a.ff, a.seq_len, a.layers)
    parameters = sum(p.numel() for p in gpt.parameters())
    assert parameters == dtrain_parameter_count(a), (parameters, dtrain_parameter_count(a))

    # The global batch of every step, the same on every rank.
    gen = torch.Generator().manual_seed(a.seed)
    rows = torch.randint(a.vocab, (a.steps, a.batch, a.seq_len + 1), generator=gen)
    # Contiguous copies: a stage checks each micro-batch's strides against the ones it inferred
    # on the first step (contiguous), and the views rows[..., :-1] have row stride seq_len + 1.
    all_inputs, all_targets = rows[..., :-1].contiguous(), rows[..., 1:].contiguous()
    adamw = dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)

    if mode == "pp":
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
        if schedule_name == "interleaved":
            # Virtual stage c * WORLD + rank of WORLD * CHUNKS, layers / (WORLD * CHUNKS) blocks each, as
            # dtrain's split_pipeline_stage with --pp_chunks=2 cuts them.
            total = WORLD * CHUNKS
            assert a.layers % total == 0, f"--layers must be a multiple of {total} for the interleaved split"
            per = a.layers // total
            modules = [GptStage(gpt, v * per, (v + 1) * per, v == 0, v == total - 1)
                       for v in (c * WORLD + rank for c in range(CHUNKS))]
            stages = [PipelineStage(mod, c * WORLD + rank, total, torch.device("cpu")) for c, mod in enumerate(modules)]
            del gpt
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=mean_cross_entropy)
            params = [p for mod in modules for p in mod.parameters()]
        else:
            first, last = stage_bounds(a.layers, rank)
            module = GptStage(gpt, first, last, rank == 0, rank == WORLD - 1)
            del gpt  # the other stage's parts go with it
            stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
            # loss_fn is applied per micro-batch on the last stage; scale_grads=True (the default)
            # divides the accumulated gradients by m, so they are those of the global batch's mean.
            if schedule_name == "zb":  # ZB1P (ZB-H1) with one stage per rank: the zero-bubble peer of dtrain's zb
                schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=mean_cross_entropy)
            else:
                schedule_cls = Schedule1F1B if schedule_name == "1f1b" else ScheduleGPipe
                schedule = schedule_cls(stage, n_microbatches=m, loss_fn=mean_cross_entropy)
            params = [p for p in module.parameters()]
        optimizer = torch.optim.AdamW(params, **adamw)

        def clip():
            sq = torch.zeros(())
            for p in params:
                if p.grad is not None:
                    sq += p.grad.detach().pow(2).sum()
            dist.all_reduce(sq)  # the sum over both stages' parameters
            coef = torch.clamp(a.clip_grad_norm / (sq.sqrt() + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.detach().mul_(coef)

        def train_step(inputs, targets):
            losses = []
            if rank == 0:
                schedule.step(inputs, return_outputs=False)
            else:
                schedule.step(target=targets, losses=losses, return_outputs=False)
            clip()
            optimizer.step()
            optimizer.zero_grad()
            return torch.stack(losses).mean().detach() if losses else None

        def global_loss(loss):
            # The loss lives on the last stage; bring it to rank 0 (outside the timed span).
            t = loss.clone() if loss is not None else torch.zeros(())
            dist.broadcast(t, src=WORLD - 1)
            return t.item()
        label = f"torch pipelining {schedule_name} m={m}"
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        assert m % WORLD == 0, f"ddp needs an even m (={m}): m/2 micro-batches per rank"
        model = DDP(gpt)
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        accum = m // WORLD
        half = a.batch // WORLD

        def train_step(inputs, targets):
            mine = slice(rank * half, (rank + 1) * half)
            total = torch.zeros(())
            for i, (inputs, targets) in enumerate(zip(inputs[mine].chunk(accum), targets[mine].chunk(accum))):
                if i < accum - 1:
                    with model.no_sync():
                        loss = model(inputs, targets) / accum
                        loss.backward()
                else:
                    loss = model(inputs, targets) / accum
                    loss.backward()  # DDP averages the gradients over the ranks here
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            return total

        def global_loss(loss):
            t = loss.clone()
            dist.all_reduce(t)
            return t.item() / WORLD
        label = f"torch ddp m={m}"

    times_ms, losses = [], []
    for step in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(all_inputs[step], all_targets[step])
        times_ms.append((time.perf_counter() - t0) * 1e3)
        if a.print_losses or step == a.steps - 1:
            losses.append(global_loss(loss))

    if rank == 0:
        timed = times_ms[WARMUP_STEPS:]
        ms = statistics.median(timed)
        print(f"{label}: {ms:.1f} ms/step (median of {len(timed)}), loss {losses[-1]:.4f}", flush=True)
        if a.print_losses:
            print(f"  losses by step: {' '.join(f'{l:.6f}' for l in losses)}", flush=True)
        results.put((mode, schedule_name, m, ms, losses[-1]))


def run(a, layout):
    """One layout in a fresh pair of processes; returns rank 0's (mode, schedule, m, ms, loss)."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(a, layout, free_port(), results), nprocs=WORLD, join=True)
    return results.get()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="all", choices=("all", "ddp", "pp"))
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument("--micro_batches", type=int, default=4, help="m: micro-batches per step")
    p.add_argument("--steps", type=int, default=17)
    p.add_argument("--batch", type=int, default=16, help="rows per step (the global batch)")
    add_model_flags(p, d_model=256, heads=8, layers=8, ff=1024, vocab=512, seq_len=128)
    p.add_argument("--print_losses", action="store_true", help="also print every step's loss")
    a = p.parse_args()
    assert a.steps > WARMUP_STEPS, f"--steps must exceed the {WARMUP_STEPS} warm-up steps"
    assert a.layers >= WORLD, "every pipeline stage needs at least one block"

    print(f"torch {torch.__version__}, {WORLD} processes (gloo), 1 thread each, global batch {a.batch}",
          flush=True)
    if a.mode != "all":
        run(a, (a.mode, a.schedule if a.mode == "pp" else None, a.micro_batches))
        return
    rows = []
    for m in (2, 4, 8):
        ddp_ms = run(a, ("ddp", None, m))[3]
        rows.append(("ddp", m, ddp_ms, ddp_ms))
        for s in SCHEDULES:
            rows.append((f"pp 2 {s}", m, run(a, ("pp", s, m))[3], ddp_ms))
    print("| layout | m | ms/step | vs ddp |")
    print("| --- | --- | --- | --- |")
    for name, m, ms, ddp_ms in rows:
        print(f"| {name} | {m} | {ms:.1f} | {ms / ddp_ms:.2f} |")


if __name__ == "__main__":
    main()
