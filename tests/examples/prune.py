#!/usr/bin/env python3
"""Magnitude pruning (--prune_amount) against PyTorch's own torch.nn.utils.prune.

1. One-shot, layer scope (train_mlp): trained 2 steps, then resumed with --prune_at_step=3; the
   masks saved at step 5 equal l1_unstructured's masks of the step-2 weights, tensor by tensor,
   exactly; every pruned weight is still exactly zero after the fine-tuning steps and each
   tensor's sparsity is exactly round(amount x n) / n.
2. The same in global scope against global_unstructured.
3. Gradual (--prune_steps=A-B): the logged sparsity follows Zhu & Gupta's cubic schedule
   amount x (1 - (1 - (t - A) / (B - A))^3), rounded per tensor as the masks are.
4. train_gpt with --tp 2 prunes exactly the unsplit run's entries (masks equal) and follows its
   loss curve; a run resumed after pruning continues the uninterrupted curve and keeps its masks.
5. With --shard=gradients and with --offload=optimizer on 2 ranks: the one-rank curve and masks.
6. Bad values exit non-zero naming the flag.

usage: prune.py --bin BUILD/bin --mpirun "mpirun ..." (run with the Python that has torch)
"""
import json
import os
import shlex
import tempfile

import torch
from torch import nn
from torch.nn.utils import prune

from example_util import example_parser, run



def checkpoint(ck, step):
    return torch.load(os.path.join(ck, f"step-{step:06d}.pt"), map_location="cpu", weights_only=True)


def metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def torch_masks(weights, amount, scope):
    """PyTorch's masks for these weights: each as the weight of an nn.Linear, pruned by torch."""
    layers = {name: nn.Linear(w.shape[1], w.shape[0], bias=False) for name, w in weights.items()}
    for name, layer in layers.items():
        with torch.no_grad():
            layer.weight.copy_(weights[name])
    if scope == "layer":
        for layer in layers.values():
            prune.l1_unstructured(layer, "weight", amount=amount)
    else:
        prune.global_unstructured([(layer, "weight") for layer in layers.values()],
                                  pruning_method=prune.L1Unstructured, amount=amount)
    return {name: layer.weight_mask.bool() for name, layer in layers.items()}


def one_shot(args, work, scope):
    ck = os.path.join(work, "mlp-" + scope)
    mlp = [os.path.join(args.bin, "train_mlp"), "--device=cpu", "--data=synthetic", "--progress=false",
           "--hidden=48", "--depth=2", f"--save_dir={ck}"]
    run(mlp + ["--steps=2"])
    run(mlp + ["--steps=5", "--resume=yes", "--prune_amount=0.6", "--prune_at_step=3", f"--prune_scope={scope}"])
    before, after = checkpoint(ck, 2), checkpoint(ck, 5)
    masks = after["masks"]
    assert list(masks) == ["0.weight", "2.weight", "4.weight"], list(masks)
    want = torch_masks({n: before["model"][n] for n in masks}, 0.6, scope)
    total = kept = 0
    for name, mask in masks.items():
        assert mask.dtype == torch.bool and torch.equal(mask, want[name]), f"{scope}: {name}: mask differs from torch's"
        w = after["model"][name]
        assert (w[~mask] == 0).all(), f"{name}: a pruned weight is not zero after fine-tuning"
        assert (w[mask] != 0).all(), f"{name}: a kept weight is zero"
        if scope == "layer":
            assert (~mask).sum().item() == round(0.6 * mask.numel()), f"{name}: sparsity is not round(0.6 n) / n"
        total += mask.numel()
        kept += mask.sum().item()
    if scope == "global":
        assert total - kept == round(0.6 * total), "global sparsity is not round(0.6 N) / N"
    print(f"ok: {scope} scope: the masks equal torch.nn.utils.prune's on the same weights; pruned weights stay 0 "
          f"through 2 fine-tuning steps; sparsity {(total - kept) / total:.6f}")


def gradual(args, work):
    out = os.path.join(work, "gradual.jsonl")
    run([os.path.join(args.bin, "train_mlp"), "--device=cpu", "--data=synthetic", "--progress=false", "--hidden=48",
         "--depth=2", "--steps=9", "--log_every=1", f"--metrics={out}", "--prune_amount=0.8", "--prune_steps=2-7"])
    sizes = [48 * 64, 48 * 48, 10 * 48]
    target = 0.0
    for m in metrics(out):
        t = m["step"]
        if 2 <= t <= 7:
            target = 0.8 * (1 - (1 - (t - 2) / 5) ** 3)
        if t < 2:
            assert "sparsity" not in m, m
            continue
        want = sum(round(target * n) for n in sizes) / sum(sizes)
        assert abs(m["sparsity"] - want) < 1e-12, f"step {t}: sparsity {m['sparsity']}, schedule says {want}"
    print("ok: gradual pruning follows the cubic schedule step by step, ending at 0.8")


def gpt(args, work):
    shape = ["--device=cpu", "--progress=false", "--d_model=64", "--heads=4", "--layers=2", "--ff=128",
             "--seq_len=16", "--vocab=97", "--batch_size=8", "--log_every=1", "--prune_amount=0.5",
             "--prune_at_step=3", "--lr=0.003"]
    exe = os.path.join(args.bin, "train_gpt")

    def train(ranks, flags, name):
        out = os.path.join(work, name + ".jsonl")
        cmd = [exe, *shape, *flags, f"--metrics={out}", f"--save_dir={os.path.join(work, name)}"]
        run(shlex.split(args.mpirun) + ["-np", str(ranks)] + cmd if ranks > 1 else cmd)
        return metrics(out)

    ref = train(1, ["--steps=8"], "gpt-1")
    tp = train(2, ["--steps=8", "--tp=2"], "gpt-tp2")
    for a, b in zip(ref, tp):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), f"step {a['step']}: {a['loss']} vs {b['loss']}"
    m1, m2 = checkpoint(os.path.join(work, "gpt-1"), 8)["masks"], checkpoint(os.path.join(work, "gpt-tp2"), 8)["masks"]
    assert list(m1) == list(m2) and all(torch.equal(m1[n], m2[n]) for n in m1), "tp 2 pruned other entries"
    assert "head.weight" in m1 and "blocks.0.mlp.fc1.weight" in m1 and "wte.weight" not in m1, list(m1)
    print(f"ok: tp 2 prunes the unsplit run's entries ({len(m1)} tensors) and follows its loss curve")
    train(1, ["--steps=5"], "gpt-resume")
    resumed = train(1, ["--steps=8", "--resume=yes"], "gpt-resume")
    tail = {m["step"]: m["loss"] for m in resumed}
    for m in ref[5:]:
        assert abs(tail[m["step"]] - m["loss"]) <= 1e-6 * abs(m["loss"]), f"step {m['step']}: resumed run differs"
    m3 = checkpoint(os.path.join(work, "gpt-resume"), 8)["masks"]
    assert all(torch.equal(m1[n], m3[n]) for n in m1), "the resumed run lost its masks"
    print("ok: a run resumed after pruning continues the uninterrupted curve with the same masks")


def with_sharding(args, work):
    """Pruning composes with ZeRO-2 and optimizer offload: the same curve and masks as one rank."""
    base = [os.path.join(args.bin, "train_mlp"), "--device=cpu", "--data=synthetic", "--progress=false",
            "--hidden=48", "--depth=2", "--steps=6", "--log_every=1", "--prune_amount=0.7", "--prune_at_step=2"]

    def train(ranks, flags, name):
        out, ck = os.path.join(work, name + ".jsonl"), os.path.join(work, name)
        cmd = base + flags + [f"--metrics={out}", f"--save_dir={ck}"]
        run(shlex.split(args.mpirun) + ["-np", str(ranks)] + cmd if ranks > 1 else cmd)
        return metrics(out), checkpoint(ck, 6)

    ref, ref_ck = train(1, ["--batch_size=64"], "mlp-prune-1")
    for flags, tol in ((["--shard=gradients"], 1e-4), (["--offload=optimizer"], 1e-3)):
        got, ck = train(2, ["--batch_size=32"] + flags, "mlp-prune-" + flags[0][2:].replace("=", "-"))
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]), f"{flags}: step {a['step']}: {a['loss']} vs {b['loss']}"
        for name, mask in ref_ck["masks"].items():
            assert torch.equal(mask, ck["masks"][name]), f"{flags}: {name}: other entries pruned"
            assert (ck["model"][name][~mask] == 0).all(), f"{flags}: {name}: a pruned weight is not zero"
        print(f"ok: pruning with {' '.join(flags)} on 2 ranks: the one-rank curve and masks, pruned weights zero")


def bad_input(args):
    exe = [os.path.join(args.bin, "train_mlp"), "--device=cpu", "--data=synthetic", "--steps=1", "--progress=false"]
    for flags, message in [(["--prune_amount=1.5", "--prune_at_step=1"], "--prune_amount=1.5 must be in [0, 1)"),
                           (["--prune_amount=0.5"], "needs either --prune_at_step=N"),
                           (["--prune_amount=0.5", "--prune_steps=5-3"], "--prune_steps='5-3' is not a step or a range"),
                           (["--prune_amount=0.5", "--prune_at_step=2", "--prune_scope=row"],
                            "--prune_scope=row is not one of: layer, global")]:
        out = run(exe + flags, expect=1)
        assert message in out, f"expected '{message}'"
        print(f"ok: refused: {message}")


def main():
    args = example_parser().parse_args()
    with tempfile.TemporaryDirectory() as work:
        one_shot(args, work, "layer")
        one_shot(args, work, "global")
        gradual(args, work)
        gpt(args, work)
        with_sharding(args, work)
        bad_input(args)


if __name__ == "__main__":
    main()
