#!/usr/bin/env python3
"""PyTorch's own step for train_seq2seq's seed model on one GPU, eager and torch.compile: the
anchors that `train_seq2seq --device=cuda --amp=bf16` is set beside in the same GPU command.

The model is the seed benchmark model of docs/BENCHMARKS.md in torch.nn's own layers: 4
nn.TransformerEncoderLayer + 4 nn.TransformerDecoderLayer (d_model 512, 8 heads, ff 2048,
dropout 0.1, ReLU, post-norm, batch_first), token embeddings scaled by sqrt(d) plus sinusoidal
positions, a final projection to the 32000-token vocabulary, a causal target mask, mean
cross-entropy; source and target length 256, batch 16, Adagrad lr 0.01 (torch's default
foreach implementation), AMP bf16, random tokens drawn before the timed loop.

Modes (--modes): eager; compile (torch.compile(model), default mode). One JSON line each:
mode, step_ms_median (each step timed with torch.cuda.synchronize() after it, over the steps
after --warmup), peak_mib, first_steps_s (the warm-up: compilation for compile), loss_last.

usage: python3 tools/s2s_torch_bench.py [--modes=eager,compile] [--steps=30] [--warmup=10]
           [--device=cuda|cpu] [--d_model=512 --heads=8 --ff=2048 --layers=4 --vocab=32000
           --seq_len=256 --batch_size=16]
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_torch_bench import run_modes, timed_steps  # noqa: E402


class Seq2Seq(nn.Module):
    def __init__(self, vocab, d, heads, ff, layers, seq_len, dropout=0.1):
        super().__init__()
        self.d = d
        self.src_embed = nn.Embedding(vocab, d)
        self.tgt_embed = nn.Embedding(vocab, d)
        pos = torch.arange(seq_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(seq_len, d)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, ff, dropout, batch_first=True)
                                     for _ in range(layers))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(d, heads, ff, dropout, batch_first=True)
                                     for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def embed(self, table, tokens):
        return self.drop(table(tokens) * math.sqrt(self.d) + self.pe[: tokens.size(1)])

    def forward(self, src, tgt_in, tgt_out):
        t = tgt_in.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=src.device), diagonal=1)
        memory = self.embed(self.src_embed, src)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed(self.tgt_embed, tgt_in)
        for layer in self.decoder:
            x = layer(x, memory, tgt_mask=mask, tgt_is_causal=True)
        logits = self.out(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1))


def run_mode(a, mode):
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    model = Seq2Seq(a.vocab, a.d_model, a.heads, a.ff, a.layers, a.seq_len).to(dev)
    opt = torch.optim.Adagrad(model.parameters(), lr=a.lr)
    fwd = torch.compile(model) if mode == "compile" else model
    g = torch.Generator().manual_seed(a.seed)
    src = torch.randint(a.vocab, (a.steps, a.batch_size, a.seq_len), generator=g).to(dev)
    tgt = torch.randint(a.vocab, (a.steps, a.batch_size, a.seq_len + 1), generator=g).to(dev)
    cuda = dev.type == "cuda"

    def step(i):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = fwd(src[i], tgt[i, :, :-1], tgt[i, :, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first, times, loss = timed_steps(step, a, cuda)
    print(json.dumps({"bench": "s2s_torch", "mode": mode,
                      "step_ms_median": round(1e3 * statistics.median(times), 2),
                      "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
                      "first_steps_s": round(first, 1), "loss_last": round(loss.item(), 4)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check the script")
    for name, default in (("d_model", 512), ("heads", 8), ("ff", 2048), ("layers", 4), ("vocab", 32000),
                          ("seq_len", 256), ("batch_size", 16), ("seed", 42)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=0.01)
    a = p.parse_args()
    run_modes(p, a, run_mode, "s2s_torch_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
