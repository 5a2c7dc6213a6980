#!/usr/bin/env python3
"""Layouts of one training run must log the same loss curve (ARCHITECTURE.md).

Runs an example program in several data-parallel / accumulation layouts that share the
global batch, reads each run's metrics file and compares the losses step by step with
the single-rank, single-micro-batch run (the reference). Exits non-zero on a mismatch.

usage: loss_curves.py SCENARIO --bin BUILD/bin --mpirun "mpirun ..." [--workdir DIR]
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile


def run(cmd, env=None):
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    print(p.stdout[-3000:], flush=True)
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


def scenario_data_parallel(args):
    common = ["--steps=30", "--lr=0.003", "--workers=1", "--seed=3"]
    prog = "train_mlp"
    ref = train(args, prog, 1, common + ["--batch_size=64"], "1x64")
    assert ref[-1]["loss"] < 0.8 * ref[0]["loss"], f"loss did not fall: {ref[0]['loss']} -> {ref[-1]['loss']}"
    print(f"ok: loss falls {ref[0]['loss']:.4f} -> {ref[-1]['loss']:.4f}")
    layouts = [
        (2, ["--batch_size=32"], "2x32"),
        (4, ["--batch_size=16"], "4x16"),
        (1, ["--batch_size=64", "--accum_steps=4"], "1x(4x16)"),
        (2, ["--batch_size=32", "--accum_steps=2"], "2x(2x16)"),
    ]
    for ranks, flags, name in layouts:
        compare(ref, train(args, prog, ranks, common + flags, name), name, 1e-4)


def scenario_amp(args):
    common = ["--steps=30", "--lr=0.003", "--workers=1", "--seed=3", "--batch_size=64"]
    ref = train(args, "train_mlp", 1, common, "fp32")
    bf16 = train(args, "train_mlp", 1, common + ["--amp=bf16"], "bf16")
    # bf16 rounds activations to 8 bits of mantissa: a few percent, step by step.
    compare(ref, bf16, "bf16", 0.10, mean_tol=0.03)
    fp16 = train(args, "train_mlp", 2, common + ["--amp=fp16", "--batch_size=32"], "fp16")
    assert all("loss_scale" in m for m in fp16), "fp16 runs must log loss_scale"
    print("ok: fp16 logs loss_scale", [m["loss_scale"] for m in fp16[:3]])
    compare(ref, fp16, "fp16", 0.10, mean_tol=0.03)
    # ZeRO-2 under AMP: the fp16 overflow check over each rank's own range, agreed by every
    # rank, skips the same steps with the same loss scales as the replicated run.
    for amp, base in (("fp16", fp16), ("bf16", None)):
        if base is None:
            base = train(args, "train_mlp", 2, common + [f"--amp={amp}", "--batch_size=32"], f"{amp}-dp2")
        sharded = train(args, "train_mlp", 2, common + [f"--amp={amp}", "--batch_size=32", "--shard=gradients"],
                        f"{amp}-zero2")
        compare(base, sharded, f"{amp} --shard=gradients against {amp} replicated", 1e-4)
        scales = [(a.get("loss_scale"), b.get("loss_scale")) for a, b in zip(base, sharded)]
        assert all(x == y for x, y in scales), f"{amp}: loss scales differ: {scales}"
        print(f"ok: {amp} --shard=gradients: the same loss scales", [y for _, y in scales[:4]])


def scenario_seq2seq(args):
    flags = ["--steps=6", "--batch_size=4", "--d_model=32", "--heads=4", "--ff=64", "--layers=2",
             "--seq_len=16", "--vocab=300", "--workers=1", "--dropout=0"]
    one = train(args, "train_seq2seq", 1, flags + ["--batch_size=8"], "s2s-1x8")
    two = train(args, "train_seq2seq", 2, flags, "s2s-2x4")
    compare(one, two, "seq2seq 2x4", 1e-4)
    ck = train(args, "train_seq2seq", 2, flags + ["--checkpoint_activations"], "s2s-ckpt")
    compare(one, ck, "seq2seq 2x4 checkpointed", 1e-4)


def scenario_tensor_parallel(args):
    shape = ["--d_model=64", "--heads=4", "--layers=2", "--seq_len=32", "--ff=128", "--steps=20",
             "--workers=1", "--lr=0.003", "--warmup_steps=2", "--schedule=cosine"]
    for vocab in (96, 97):  # 97 does not divide by the tensor-parallel size
        flags = shape + [f"--vocab={vocab}"]
        ref = train(args, "train_gpt", 1, flags + ["--batch_size=8"], f"gpt-v{vocab}-1")
        assert ref[-1]["loss"] < ref[0]["loss"], "GPT loss did not fall"
        compare(ref, train(args, "train_gpt", 2, flags + ["--batch_size=8", "--tp=2"], f"gpt-v{vocab}-tp2"),
                f"vocab {vocab}: tp 2 on 2 ranks", 1e-4)
        compare(ref, train(args, "train_gpt", 4, flags + ["--batch_size=4", "--tp=2"], f"gpt-v{vocab}-tp2dp2"),
                f"vocab {vocab}: tp 2 x dp 2 on 4 ranks", 1e-4)
    flags = shape + ["--vocab=96"]
    ref = train(args, "train_gpt", 1, flags + ["--batch_size=8"], "gpt-1b")
    compare(ref, train(args, "train_gpt", 4, flags + ["--batch_size=8", "--tp=4"], "gpt-tp4"),
            "tp 4 on 4 ranks", 1e-4)
    # ZeRO-1 and ZeRO-2 on a 2D mesh: the optimizer state (and the gradients) split over the
    # data-parallel group inside each tensor-parallel rank, with accumulation and clipping (the
    # global norm summed over tensor-parallel shards and data-parallel ranges).
    clip = flags + ["--clip_grad_norm=0.5", "--vocab=97"]
    ref = train(args, "train_gpt", 1, clip + ["--batch_size=8"], "gpt-clip-ref")
    for shard in ("optimizer", "gradients"):
        other = train(args, "train_gpt", 4, clip + ["--batch_size=4", "--tp=2", "--accum_steps=2", f"--shard={shard}"],
                      f"gpt-tp2dp2-{shard}")
        name = f"tp 2 x dp 2 --shard={shard}, 2 micro-batches, clipped"
        compare(ref, other, name, 1e-4)
        compare_grad_norms(ref, other, name)


def scenario_sequence_parallel(args):
    shape = ["--d_model=64", "--heads=4", "--layers=2", "--seq_len=32", "--ff=128", "--steps=20",
             "--workers=1", "--lr=0.003", "--warmup_steps=2", "--schedule=cosine", "--vocab=96"]
    ref = train(args, "train_gpt", 1, shape + ["--batch_size=8"], "gpt-sp-ref")
    assert ref[-1]["loss"] < ref[0]["loss"], "GPT loss did not fall"
    sp = ["--sequence_parallel"]
    layouts = [
        (2, ["--tp=2", "--batch_size=8"], "tp 2 sequence-parallel on 2 ranks"),
        (4, ["--tp=2", "--batch_size=4"], "tp 2 sequence-parallel x dp 2 on 4 ranks"),
        (2, ["--tp=2", "--batch_size=8", "--checkpoint_activations"], "tp 2 sequence-parallel, checkpointed"),
        (4, ["--tp=2", "--batch_size=4", "--accum_steps=2", "--clip_grad_norm=0.5"],
         "tp 2 sequence-parallel x dp 2, 2 micro-batches, clipped"),
        # On the CPU the blocks are not streamed, but they run through the streamer's checkpoint path.
        (2, ["--tp=2", "--batch_size=8", "--offload=layers"], "tp 2 sequence-parallel, --offload=layers"),
        (4, ["--tp=4", "--batch_size=8"], "tp 4 sequence-parallel on 4 ranks"),
    ]
    for i, (ranks, flags, name) in enumerate(layouts):
        other = train(args, "train_gpt", ranks, shape + sp + flags, f"gpt-sp-{i}")
        base = ref
        if "--clip_grad_norm=0.5" in flags:
            base = train(args, "train_gpt", 1, shape + ["--batch_size=8", "--clip_grad_norm=0.5"], "gpt-sp-ref-clip")
        compare(base, other, name, 1e-4)
        # The gradient norm (which the layer norms' group-summed gradients enter) matches too.
        compare_grad_norms(base, other, name)
    # The parameters keep their names: a sequence-parallel checkpoint resumes unsplit.
    const = [f for f in shape if not f.startswith(("--steps", "--warmup_steps", "--schedule"))]
    const += ["--schedule=constant", "--batch_size=8"]
    ref16 = train(args, "train_gpt", 1, const + ["--steps=16"], "gpt-sp-ref16")
    ck = os.path.join(args.workdir, "ck_sp")
    train(args, "train_gpt", 2, const + sp + ["--tp=2", "--steps=8", f"--save_dir={ck}"], "gpt-sp-part")
    whole = train(args, "train_gpt", 1, const + ["--steps=16", f"--save_dir={ck}", "--resume"], "gpt-sp-resumed")
    compare(steps_after(ref16, 8), steps_after(whole, 8), "sequence-parallel checkpoint resumed unsplit", 1e-4)


def scenario_observability(args):
    tb = os.path.join(args.workdir, "tb")
    tl = os.path.join(args.workdir, "trace.json")
    flags = ["--steps=20", "--log_every=5", "--workers=1", "--data=synthetic", "--d_model=32", "--heads=4",
             "--ff=64", "--layers=2", "--seq_len=16", "--vocab=300", "--batch_size=4",
             f"--tensorboard_dir={tb}", f"--timeline={tl}", "--memory_report_step=2"]
    m = train(args, "train_seq2seq", 2, flags, "obs")
    # TensorBoard's own reader sees the logged steps and values.
    out = subprocess.run([args.python, os.path.join(args.source, "tests/reference/read_tensorboard.py"), tb],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    scalars = json.loads(out)["scalars"]
    for tag in ("train/loss", "train/lr", "perf/step_ms", "perf/samples_per_s", "memory/allocated_mb", "train/grad_norm"):
        assert tag in scalars, f"TensorBoard has no {tag}: {sorted(scalars)}"
    tb_loss = {int(s): v for s, v, _ in scalars["train/loss"]}
    want = {row["step"]: row["loss"] for row in m}
    assert sorted(tb_loss) == sorted(want), (sorted(tb_loss), sorted(want))
    for step, loss in want.items():
        assert abs(tb_loss[step] - loss) <= 1e-6 * abs(loss), (step, tb_loss[step], loss)
    print(f"ok: TensorBoard reader sees steps {sorted(tb_loss)} with the metrics file's losses")
    # CPU memory is counted by default (the program never asks for it): tensor bytes, not the
    # process's resident set, and the peak is never below the current figure.
    params_mb = 4 * 80_000 / 2**20  # a bound on the parameters' bytes of this model, generously
    for row in m:
        assert row["mem_counter"] == "cpu tensors", row
        assert row["mem_peak_mb"] >= row["mem_allocated_mb"], row
        assert 0 < row["mem_allocated_mb"] < 20 * params_mb + 50, row  # resident sets are 300+ MB
    print(f"ok: mem_counter 'cpu tensors', allocated {m[-1]['mem_allocated_mb']:.1f} MB <= peak "
          f"{m[-1]['mem_peak_mb']:.1f} MB on every line")
    # The merged timeline is valid Chrome-trace JSON with backward and all-reduce events, and
    # some all-reduce starts before the backward of its step ends (overlap).
    with open(tl) as f:
        trace = json.load(f)["traceEvents"]
    spans = [e for e in trace if e.get("ph") == "X"]
    ranks = {e["pid"] for e in spans}
    assert ranks == {0, 1}, ranks
    backward = [e for e in spans if e["name"] == "backward"]
    comm = [e for e in spans if e["name"] == "all_reduce"]
    assert backward and comm, "no backward or all_reduce events"
    overlapping = sum(1 for c in comm for b in backward
                      if b["pid"] == c["pid"] and c["ts"] < b["ts"] + b["dur"] and c["ts"] >= b["ts"])
    assert overlapping > 0, "no all-reduce started inside a backward span"
    print(f"ok: timeline has {len(backward)} backward and {len(comm)} all_reduce spans on ranks {sorted(ranks)}; "
          f"{overlapping} all-reduces start during backward")


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


def scenario_checkpoint(args):
    w = args.workdir
    common = ["--lr=0.003", "--workers=1", "--seed=5", "--schedule=constant"]
    evals = ["--eval_every=5", "--eval_samples=64"]
    ref = train(args, "train_mlp", 2, common + evals + ["--steps=20", "--batch_size=32"], "ref")
    # 10 steps, then --resume to 20: steps 11-20 equal the uninterrupted run, evaluations too
    # (the evaluation loader continues where it was).
    part = os.path.join(w, "ck")
    train(args, "train_mlp", 2, common + evals + ["--steps=10", "--batch_size=32", f"--save_dir={part}", "--save_every=5"], "part")
    resumed = train(args, "train_mlp", 2, common + evals + ["--steps=20", "--batch_size=32", f"--save_dir={part}", "--resume"], "resumed")
    compare(steps_after(ref, 10), steps_after(resumed, 10), "resumed 2 ranks", 1e-6)
    want = [(r["step"], r["eval_loss"]) for r in steps_after(ref, 10) if "eval_loss" in r]
    got = [(r["step"], r["eval_loss"]) for r in steps_after(resumed, 10) if "eval_loss" in r]
    assert len(want) == 2 and [s for s, _ in want] == [s for s, _ in got], (want, got)
    for (step, a), (_, b) in zip(want, got):
        assert abs(a - b) <= 1e-6 * abs(a), f"FAIL: eval_loss at step {step}: resumed {b} vs {a}"
    print(f"ok: resumed evaluations equal the uninterrupted run's: {want}")
    # The weights load in PyTorch under an equivalent nn.Module's names.
    code = (
        "import sys, torch\n"
        "ck = torch.load(sys.argv[1], weights_only=True)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),\n"
        "    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))\n"
        "m.load_state_dict(ck['model'], strict=True)\n"
        "print('torch.load ok', sorted(ck['model'])[:3], ck['step'] if 'step' in ck else '')\n")
    out = subprocess.run([args.python, "-c", code, os.path.join(part, "step-000020.pt")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(out.stdout)
    assert out.returncode == 0, "PyTorch could not load the checkpoint into an equivalent nn.Module"
    # --resume=auto, the same command for a first launch and every requeue: on an empty directory
    # it trains from step 1, with a checkpoint it resumes, and on a finished run it trains
    # nothing, says so and exits 0.
    auto = os.path.join(w, "ck_auto")
    first = train(args, "train_mlp", 2, common + evals + ["--steps=10", "--batch_size=32", f"--save_dir={auto}",
                                                          "--resume=auto"], "auto_first")
    compare([r for r in ref if r["step"] <= 10], first, "--resume=auto on an empty directory", 1e-6)
    second = train(args, "train_mlp", 2, common + evals + ["--steps=20", "--batch_size=32", f"--save_dir={auto}",
                                                           "--resume=auto"], "auto_second")
    compare(steps_after(ref, 10), steps_after(second, 10), "--resume=auto with a checkpoint", 1e-6)
    text = train(args, "train_mlp", 2, common + ["--steps=20", "--batch_size=32", f"--save_dir={auto}",
                                                 "--resume=auto"], "auto_done", output=True)
    assert "the run is already complete (step 20 of --steps=20" in text, text
    assert "loss 0.0000" not in text, text
    print("ok: --resume=auto starts, resumes, and finds a finished run finished")
    # Resuming with a different number of data-parallel ranks (1 x 64 from 2 x 32).
    other = os.path.join(w, "ck_dp")
    train(args, "train_mlp", 2, common + ["--steps=10", "--batch_size=32", f"--save_dir={other}"], "part_dp")
    one = train(args, "train_mlp", 1, common + ["--steps=20", "--batch_size=64", f"--save_dir={other}", "--resume"], "resumed_dp1")
    compare(steps_after(ref, 10), steps_after(one, 10), "resumed on 1 rank x 64", 1e-4)
    # A corrupted newest checkpoint is refused and the previous one is used.
    bad = os.path.join(w, "ck_bad")
    train(args, "train_mlp", 2, common + ["--steps=10", "--batch_size=32", f"--save_dir={bad}", "--save_every=5"], "part_bad")
    newest = os.path.join(bad, "step-000010.pt")
    with open(newest, "r+b") as f:
        f.seek(os.path.getsize(newest) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = train(args, "train_mlp", 2, common + ["--steps=20", "--batch_size=32", f"--save_dir={bad}", "--resume"],
                "resumed_bad")
    compare(steps_after(ref, 5), steps_after(out, 5), "resumed past a corrupted checkpoint", 1e-6)
    # Bad input: nothing to resume; a checkpoint of another model (nothing overwritten).
    empty = os.path.join(w, "empty")
    os.makedirs(empty)
    text = train(args, "train_mlp", 1, common + ["--steps=2", f"--save_dir={empty}", "--resume"], "noresume",
                 expect_status=2)
    assert "no good checkpoint" in text, text
    before = dir_digest(part)
    text = train(args, "train_mlp", 1, common + ["--steps=30", "--hidden=128", f"--save_dir={part}", "--resume"],
                 "othermodel", expect_status=2)
    assert "0.weight" in text and "[256, 64]" in text.replace(" ", "").replace("[256,64]", "[256, 64]"), text
    assert dir_digest(part) == before, "a refused resume changed the checkpoint directory"
    print("ok: resume without a checkpoint and with another model are refused; nothing overwritten")


def scenario_checkpoint_tp(args):
    w = args.workdir
    shape = ["--d_model=64", "--heads=4", "--layers=2", "--seq_len=32", "--ff=128", "--vocab=97", "--workers=1",
             "--lr=0.003", "--batch_size=8"]
    ref = train(args, "train_gpt", 1, shape + ["--steps=16"], "gpt-ref")
    split = os.path.join(w, "tp2")
    train(args, "train_gpt", 2, shape + ["--steps=8", "--tp=2", f"--save_dir={split}"], "gpt-tp2-part")
    whole = train(args, "train_gpt", 1, shape + ["--steps=16", f"--save_dir={split}", "--resume"], "gpt-tp1-resumed")
    compare(steps_after(ref, 8), steps_after(whole, 8), "split (tp 2) checkpoint resumed unsplit", 1e-4)
    unsplit = os.path.join(w, "tp1")
    train(args, "train_gpt", 1, shape + ["--steps=8", f"--save_dir={unsplit}"], "gpt-tp1-part")
    back = train(args, "train_gpt", 2, shape + ["--steps=16", "--tp=2", f"--save_dir={unsplit}", "--resume"],
                 "gpt-tp2-resumed")
    compare(steps_after(ref, 8), steps_after(back, 8), "unsplit checkpoint resumed split (tp 2)", 1e-4)


def scenario_pipeline(args):
    """--pp: the blocks split into stages on the ranks of the pipeline; every layout, schedule and
    micro-batch count follows the one-rank run of the same global batch."""
    w = args.workdir
    shape = ["--d_model=64", "--heads=4", "--layers=4", "--seq_len=32", "--ff=128", "--vocab=97", "--workers=1",
             "--lr=0.003", "--warmup_steps=2", "--schedule=cosine", "--steps=12", "--clip_grad_norm=0.5"]
    ref = train(args, "train_gpt", 1, shape + ["--batch_size=8"], "pp-ref")
    assert ref[-1]["loss"] < ref[0]["loss"], "GPT loss did not fall"
    layouts = [
        # (ranks, flags, name): the global batch is 8 rows in every layout
        (2, ["--pp=2", "--batch_size=8", "--accum_steps=4"], "pp 2, 1f1b, 4 micro-batches"),
        (2, ["--pp=2", "--batch_size=8", "--accum_steps=4", "--pp_schedule=gpipe"], "pp 2, gpipe, 4 micro-batches"),
        (2, ["--pp=2", "--batch_size=8"], "pp 2, one micro-batch"),
        (4, ["--pp=4", "--batch_size=8", "--accum_steps=8"], "pp 4, 1f1b, 8 micro-batches"),
        (4, ["--pp=4", "--batch_size=8", "--accum_steps=8", "--pp_schedule=gpipe"], "pp 4, gpipe, 8 micro-batches"),
        (4, ["--pp=2", "--batch_size=4", "--accum_steps=2"], "pp 2 x dp 2, 1f1b"),
        (4, ["--pp=2", "--batch_size=4", "--accum_steps=2", "--pp_schedule=gpipe"], "pp 2 x dp 2, gpipe"),
        (4, ["--pp=2", "--tp=2", "--batch_size=8", "--accum_steps=2"], "pp 2 x tp 2, 1f1b"),
        (4, ["--pp=2", "--tp=2", "--batch_size=8", "--accum_steps=2", "--pp_schedule=gpipe", "--sequence_parallel"],
         "pp 2 x tp 2 sequence-parallel, gpipe"),
        (2, ["--pp=2", "--batch_size=8", "--accum_steps=4", "--checkpoint_activations"], "pp 2, checkpointed"),
        (2, ["--pp=2", "--batch_size=8", "--accum_steps=2", "--pp_blocks=1,3"], "pp 2, --pp_blocks=1,3"),
        # Each stage's optimizer partitioned over its data-parallel group, or offloaded to the host.
        (2, ["--pp=2", "--batch_size=8", "--accum_steps=4", "--offload=optimizer"], "pp 2, --offload=optimizer"),
        (4, ["--pp=2", "--batch_size=4", "--accum_steps=2", "--shard=gradients"], "pp 2 x dp 2, --shard=gradients"),
        (4, ["--pp=2", "--batch_size=4", "--accum_steps=2", "--offload=optimizer"], "pp 2 x dp 2, --offload=optimizer"),
        (2, ["--pp=2", "--batch_size=8", "--accum_steps=2", "--offload=layers"], "pp 2, --offload=layers"),
    ]
    for i, (ranks, flags, name) in enumerate(layouts):
        other = train(args, "train_gpt", ranks, shape + flags, f"pp-{i}")
        compare(ref, other, name, 1e-4)
        # The clipped norm is the whole model's: squares summed over the stages.
        compare_grad_norms(ref, other, name)
    # Every logged step carries each stage's peak memory.
    assert all(r[f"mem_peak_mb_stage{s}"] > 0 for r in other for s in (0, 1)), other[-1]
    # Three stages of four blocks: the even rule gives the extra block to stage 1.
    three = train(args, "train_gpt", 3, shape + ["--pp=3", "--batch_size=8", "--accum_steps=2"], "pp-three")
    compare(ref, three, "pp 3 (blocks 1, 2, 1), 2 micro-batches", 1e-4)
    # Mixed precision: bf16 against one bf16 rank, fp16's loss scale agreed over the stages.
    for amp in ("bf16", "fp16"):
        base = train(args, "train_gpt", 1, shape + ["--batch_size=8", f"--amp={amp}"], f"pp-ref-{amp}")
        other = train(args, "train_gpt", 2, shape + ["--pp=2", "--batch_size=8", "--accum_steps=4", f"--amp={amp}"],
                      f"pp-{amp}")
        compare(base, other, f"pp 2 --amp={amp}", 1e-3)
        if amp == "fp16":
            scales = [(a.get("loss_scale"), b.get("loss_scale")) for a, b in zip(base, other)]
            assert all(x == y for x, y in scales), f"fp16: loss scales differ: {scales}"
    # The timeline: one lane per stage, each stage's idle share of a step next to the bubble's theory.
    trace = os.path.join(w, "pp-trace.json")
    train(args, "train_gpt", 2, shape + ["--pp=2", "--batch_size=8", "--accum_steps=4", f"--timeline={trace}"],
          "pp-timeline")
    out = run([os.path.join(args.bin, "dtrain-timeline"), "summary", trace])
    lines = [l for l in out.splitlines() if "): idle " in l]
    assert len(lines) == 2 and "stage 0 (rank 0)" in lines[0] and "stage 1 (rank 1)" in lines[1], out[-2000:]
    assert all("the bubble (P-1)/(m+P-1) is 20% for P 2, m 4" in l for l in lines), lines
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    for rank in (0, 1):
        forwards = [e for e in events if e.get("pid") == rank and e.get("name") == "forward" and e.get("ph") == "X"]
        waits = [e for e in events if e.get("pid") == rank and e.get("name") == f"wait for stage {1 - rank}"]
        assert len(forwards) == 12 * 4 and all(e["args"]["stage"] == rank for e in forwards), (rank, len(forwards))
        assert waits, f"rank {rank}: no wait for its neighbour in the timeline"
    print("ok: the timeline has each stage's forwards and waits;", lines)
    # Evaluation runs the forwards through the stages: the same evaluation loss.
    ev = ["--eval_every=6", "--eval_samples=16"]
    base = train(args, "train_gpt", 1, shape + ev + ["--batch_size=8"], "pp-ref-eval")
    other = train(args, "train_gpt", 2, shape + ev + ["--pp=2", "--batch_size=8", "--accum_steps=2"], "pp-eval")
    pairs = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(base, other) if "eval_loss" in a]
    assert len(pairs) == 2 and all(abs(x - y) <= 1e-4 * abs(x) for x, y in pairs), f"evaluation losses: {pairs}"
    print(f"ok: pp 2 evaluation losses {pairs}")
    # Checkpoints hold the whole model (the stages' parts gathered by rank 0): a pp 2 run resumes
    # unsplit and under pp 4 x 1, an unsplit one under pp 2 x dp 2.
    const = [f for f in shape if not f.startswith(("--steps", "--warmup_steps", "--schedule"))]
    const += ["--schedule=constant", "--batch_size=8"]
    ref16 = train(args, "train_gpt", 1, const + ["--steps=16"], "pp-ref16")
    split = os.path.join(w, "ck_pp2")
    train(args, "train_gpt", 2, const + ["--pp=2", "--accum_steps=2", "--steps=8", f"--save_dir={split}"], "pp2-part")
    for ranks, flags, name in ((1, [], "unsplit"), (4, ["--pp=4", "--accum_steps=2"], "pp 4")):
        resumed_dir = os.path.join(w, f"ck_pp2_{ranks}")
        shutil.copytree(split, resumed_dir)
        resumed = train(args, "train_gpt", ranks, const + flags + ["--steps=16", f"--save_dir={resumed_dir}", "--resume"],
                        f"pp2-resumed-{ranks}")
        compare(steps_after(ref16, 8), steps_after(resumed, 8), f"pp 2 checkpoint resumed {name}", 1e-4)
    unsplit = os.path.join(w, "ck_pp1")
    train(args, "train_gpt", 1, const + ["--steps=8", f"--save_dir={unsplit}"], "pp1-part")
    back = train(args, "train_gpt", 4, const + ["--steps=16", "--pp=2", f"--save_dir={unsplit}", "--resume",
                                               "--batch_size=4"], "pp1-resumed-pp2dp2")
    compare(steps_after(ref16, 8), steps_after(back, 8), "unsplit checkpoint resumed as pp 2 x dp 2", 1e-4)
    # Partitioned optimizer state: each stage saves its range of the stage's flat space, placed in
    # the whole model's (stages end to end), so it resumes under any --pp, data size, or unsplit.
    zero = os.path.join(w, "ck_pp2_zero")
    train(args, "train_gpt", 4, const + ["--pp=2", "--batch_size=4", "--shard=optimizer", "--steps=8",
                                         f"--save_dir={zero}"], "pp2dp2-zero-part")
    layouts = ((2, ["--pp=2", "--accum_steps=2"], "pp 2"),
               (2, ["--pp=2", "--accum_steps=2", "--pp_blocks=1,3"], "pp 2 with blocks 1, 3"),
               (4, ["--pp=4", "--accum_steps=2"], "pp 4"),
               (2, ["--batch_size=4"], "dp 2, unsplit"),
               (1, [], "one rank"))
    for i, (ranks, flags, name) in enumerate(layouts):
        d = os.path.join(w, f"ck_pp2_zero_{i}")
        shutil.copytree(zero, d)
        again = train(args, "train_gpt", ranks, const + flags + ["--shard=optimizer", "--steps=16", f"--save_dir={d}",
                                                                 "--resume"], f"pp2-zero-resumed-{i}")
        compare(steps_after(ref16, 8), steps_after(again, 8),
                f"pp 2 x dp 2 --shard=optimizer checkpoint resumed as {name}", 1e-4)
    # And the other way: an unsplit partitioned checkpoint (dp 2) resumed as pp 4, the state
    # offloaded to the host.
    flat = os.path.join(w, "ck_dp2_zero")
    train(args, "train_gpt", 2, const + ["--batch_size=4", "--shard=optimizer", "--steps=8", f"--save_dir={flat}"],
          "dp2-zero-part")
    again = train(args, "train_gpt", 4, const + ["--pp=4", "--accum_steps=2", "--offload=optimizer", "--steps=16",
                                                 f"--save_dir={flat}", "--resume"], "dp2-zero-resumed-pp4")
    compare(steps_after(ref16, 8), steps_after(again, 8), "dp 2 --shard=optimizer checkpoint resumed as pp 4 offloaded",
            1e-4)
    # Each stage saved its own layers, and torch.load reads every file: the main file holds stage
    # 0's blocks and the embeddings, rank 1's file stage 1's blocks and the head.
    code = ("import sys, torch; d = sys.argv[1]; "
            "main = torch.load(d + '/step-000008.pt', weights_only=True)['model']; "
            "part = torch.load(d + '/step-000008.rank-1.pt', weights_only=True)['model']; "
            "blocks = lambda m: sorted({k.split('.')[1] for k in m if k.startswith('blocks.')}); "
            "assert blocks(main) == ['0', '1'] and 'wte.weight' in main and 'head.weight' not in main, list(main); "
            "assert blocks(part) == ['2', '3'] and 'head.weight' in part and 'wte.weight' not in part, list(part); "
            "print('torch.load:', len(main), '+', len(part), 'tensors')")
    run([args.python, "-c", code, split])


def scenario_zero3(args):
    """--shard=parameters (ZeRO-3): each rank keeps 1/N of the weights, gradients and optimizer state; every
    layout follows the one-rank run of the same global batch, and its checkpoints resume under another stage,
    data size, or unsharded."""
    w = args.workdir
    shape = ["--d_model=64", "--heads=4", "--layers=4", "--seq_len=32", "--ff=128", "--vocab=97", "--workers=1",
             "--lr=0.003", "--warmup_steps=2", "--schedule=cosine", "--steps=12", "--clip_grad_norm=0.5"]
    ref = train(args, "train_gpt", 1, shape + ["--batch_size=8"], "z3-ref")
    for ranks, flags, name in ((2, ["--batch_size=4"], "2 ranks"),
                               (4, ["--batch_size=2"], "4 ranks"),
                               (2, ["--batch_size=4", "--accum_steps=2"], "2 ranks, 2 micro-batches"),
                               (2, ["--batch_size=4", "--checkpoint_activations"], "2 ranks, checkpointed"),
                               (4, ["--batch_size=2", "--accum_steps=2", "--checkpoint_activations"],
                                "4 ranks, 2 micro-batches, checkpointed"),
                               # The 2D mesh: each tensor-parallel rank's shards split over its
                               # data-parallel group (FSDP2 + TP).
                               (4, ["--tp=2", "--batch_size=4"], "tp 2 x dp 2"),
                               (4, ["--tp=2", "--batch_size=4", "--sequence_parallel", "--accum_steps=2"],
                                "tp 2 x dp 2, sequence-parallel, 2 micro-batches"),
                               # Units of the user's choosing: the embeddings with block 0, blocks 1-2,
                               # block 3 with the head (--shard_units).
                               (2, ["--batch_size=4", "--shard_units=wte.,blocks.1.,blocks.3."],
                                "2 ranks, 3 units of --shard_units"),
                               # The ZeRO-Offload layout of stage 3: each rank's master range and state on
                               # the host, updated by the CPU optimizer.
                               (2, ["--batch_size=4", "--offload=optimizer"], "2 ranks, the optimizer offloaded"),
                               (4, ["--batch_size=2", "--accum_steps=2", "--offload=optimizer",
                                    "--checkpoint_activations"],
                                "4 ranks, the optimizer offloaded, 2 micro-batches, checkpointed")):
        other = train(args, "train_gpt", ranks, shape + flags + ["--shard=parameters"], f"z3-{len(name)}-{ranks}")
        compare(ref, other, f"--shard=parameters, {name}", 1e-4)
        compare_grad_norms(ref, other, f"--shard=parameters, {name}")
    out = train(args, "train_gpt", 2, shape + ["--batch_size=4", "--steps=3", "--shard=parameters",
                                             "--shard_units=wte.,blocks.1.,blocks.3."], "z3-units", output=True,
                env={"GLOG_minloglevel": "0"})
    assert "--shard=parameters: 3 units gathered per use" in out, out[-2000:]
    # Pipeline stages (FSDP + PP): each stage's units (its embeddings, blocks, head) gathered over its
    # data-parallel group, every micro-batch's forward and backward running them in order.
    for flags, name in ((["--accum_steps=2"], "1F1B, 2 micro-batches"),
                        (["--accum_steps=4", "--pp_schedule=gpipe", "--checkpoint_activations"],
                         "GPipe, 4 micro-batches, checkpointed")):
        other = train(args, "train_gpt", 4, shape + ["--pp=2", "--batch_size=4", "--shard=parameters"] + flags,
                      f"z3-pp-{len(name)}")
        compare(ref, other, f"--shard=parameters, pp 2 x dp 2, {name}", 1e-4)
        compare_grad_norms(ref, other, f"--shard=parameters, pp 2 x dp 2, {name}")
    base = train(args, "train_gpt", 1, shape + ["--batch_size=8", "--amp=bf16"], "z3-ref-bf16")
    other = train(args, "train_gpt", 2, shape + ["--batch_size=4", "--amp=bf16", "--shard=parameters"], "z3-bf16")
    compare(base, other, "--shard=parameters --amp=bf16", 1e-3)
    # fp16: the loss scale and the overflow check agreed over the ranks.
    base = train(args, "train_gpt", 1, shape + ["--batch_size=8", "--amp=fp16"], "z3-ref-fp16")
    other = train(args, "train_gpt", 2, shape + ["--batch_size=4", "--amp=fp16", "--shard=parameters"], "z3-fp16")
    compare(base, other, "--shard=parameters --amp=fp16", 1e-3)
    assert [a.get("loss_scale") for a in base] == [b.get("loss_scale") for b in other], "fp16 loss scales differ"
    # The timeline: each unit's gathers on the comm lane, its forward and backward on the units lane; the
    # gather of unit k + 1 travels while unit k's forward computes (the prefetch).
    trace = os.path.join(w, "z3-trace.json")
    train(args, "train_gpt", 2, shape + ["--batch_size=4", "--shard=parameters", f"--timeline={trace}"], "z3-timeline")
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0]
    gathers = [e for e in events if e["name"] == "gather unit"]
    forwards = [e for e in events if e["name"] == "unit forward"]
    backwards = [e for e in events if e["name"] == "unit backward"]
    units = 4 + 2  # embeddings, 4 blocks, head
    # Per step: each unit gathered for its forward and again for its backward.
    assert len(forwards) == 12 * units and len(backwards) == 12 * units, (len(forwards), len(backwards))
    assert len(gathers) == 2 * 12 * units, len(gathers)
    overlap = lambda a, b: a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
    prefetched = sum(1 for g in gathers for f in forwards
                     if f["args"]["unit"] + 1 == g["args"]["unit"] and overlap(g, f))
    assert prefetched > 0, "no gather of unit k + 1 overlaps unit k's forward"
    print(f"ok: the timeline has {len(gathers)} unit gathers, {prefetched} of them overlapping the previous unit's forward")
    # Evaluation runs the forwards through the units: 20 held-out samples are 5 chunks of 4 rows on
    # 2 ranks, so rank 1 runs a forward that does not count in the last round (the units' gathers
    # stay matched).
    ev = ["--eval_every=6", "--eval_samples=20"]
    base = train(args, "train_gpt", 1, shape + ev + ["--batch_size=8"], "z3-ref-eval")
    other = train(args, "train_gpt", 2, shape + ev + ["--batch_size=4", "--shard=parameters"], "z3-eval")
    pairs = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(base, other) if "eval_loss" in a]
    assert len(pairs) == 2 and all(abs(x - y) <= 1e-4 * abs(x) for x, y in pairs), f"evaluation losses: {pairs}"
    # Memory (the memory report of rank 0, exact on the CPU): weights, gradients and optimizer state at 4 ranks
    # against the unsharded rank's.
    big = ["--d_model=128", "--heads=4", "--layers=8", "--seq_len=32", "--ff=512", "--vocab=512", "--workers=1",
           "--steps=3", "--batch_size=2", "--memory_report_step=3", "--log_every=1"]
    import re
    rows = {}
    for shard in ("none", "parameters"):
        out = train(args, "train_gpt", 4, big + [f"--shard={shard}"], f"z3-mem-{shard}", output=True,
                    env={"GLOG_minloglevel": "0"})  # the memory report is an INFO line
        found = dict(re.findall(r"^\s+(parameters|gradients|optimizer state|activations|other)\b[^\n]*?([0-9.]+)$",
                                out, re.M))
        assert len(found) == 5, (shard, found, out[-2000:])
        rows[shard] = {k: float(v) for k, v in found.items()}
    none, z3 = rows["none"], rows["parameters"]
    held = lambda r: r["parameters"] + r["gradients"] + r["optimizer state"] + r["other"] - none["other"]
    ratio = held(z3) / held(none)
    assert ratio <= 0.3, f"--shard=parameters at 4 ranks holds {ratio:.2f} of the unsharded rank's state: {rows}"
    # The step's peak above its start: the activations and at most two units' weights (a block: 12 d^2 + 13 d
    # parameters here, 4 bytes each; the prefetch keeps the next one on its way).
    block_mib = (12 * 128 * 128 + 13 * 128) * 4 / 2**20
    assert z3["activations"] <= none["activations"] + 2 * block_mib, rows
    # Bytes per step (the communicator's bus bytes): DDP's all-reduce moves 2 (N - 1) / N x the weights, ZeRO-3
    # gathers every unit twice and reduces the gradients to their owners: 3 x.
    comm = {shard: metrics(os.path.join(w, f"z3-mem-{shard}.jsonl"))[-1]["comm_mb"] for shard in rows}
    weights_mb = comm["none"] * 4 / (2 * 3)
    assert abs(comm["parameters"] - 3 * weights_mb) <= 0.05 * 3 * weights_mb, (comm, weights_mb)
    print(f"ok: --shard=parameters moves {comm['parameters'] / weights_mb:.3f} x the weights per step")
    # The planner picks stage 3 when only splitting the weights too fits the budget (16 MiB here: stage 2
    # needs about 20), and the run follows the unsharded one.
    budget = ["--plan=auto", f"--gpu_mem_limit_gb={16 / 1024}", "--memory_report_step=0"]
    out = train(args, "train_gpt", 4, big + budget, "z3-planned", output=True)
    assert "train_gpt: plan: --shard=parameters\n" in out, out[-2000:]
    compare(metrics(os.path.join(w, "z3-mem-none.jsonl")), metrics(os.path.join(w, "z3-planned.jsonl")),
            "--plan=auto choosing --shard=parameters", 1e-4)
    # dtrain-plan --verify_steps trains stage 3 (the model running the trainer's units) and reports the peak
    # against the estimate.
    # (Offloaded too: on the CPU the host pool is taken out of the measured peak, as a GPU holds it apart.)
    for extra, flags in (([], "--shard=parameters"), (["--offload=optimizer"], "--offload=optimizer --shard=parameters")):
        out = run(shlex.split(args.mpirun) + ["-np", "4", os.path.join(args.bin, "dtrain-plan"), "--model=gpt",
                                              "--device=cpu", "--shard=parameters", "--verify_steps=3"] + extra +
                  [f for f in big if not f.startswith(("--steps", "--memory_report_step", "--log_every", "--workers"))])
        verified = [json.loads(l) for l in out.splitlines() if l.startswith("{") and "verify_steps" in l]
        assert len(verified) == 1 and verified[0]["flags"] == flags, out[-2000:]
        assert abs(verified[0]["relative_error"]) <= 0.15, verified
        print(f"ok: dtrain-plan {flags} --verify_steps=3: estimate {verified[0]['relative_error']:+.1%} "
              f"of the trained peak")
    print(f"ok: --shard=parameters on 4 ranks holds {ratio:.3f} of the unsharded weights, gradients and optimizer "
          f"state between steps; its step peaks {z3['activations'] - none['activations']:.2f} MiB above the "
          f"unsharded one's activations (a block's weights: {block_mib:.2f} MiB)")
    # Checkpoints: stage 3 at 4 ranks -> 2 ranks stage 2 -> one rank unsharded, each continuing the curve.
    const = [f for f in shape if not f.startswith(("--steps", "--warmup_steps", "--schedule"))]
    const += ["--schedule=constant"]
    ref16 = train(args, "train_gpt", 1, const + ["--batch_size=8", "--steps=16"], "z3-ref16")
    d = os.path.join(w, "ck_z3")
    train(args, "train_gpt", 4, const + ["--batch_size=2", "--shard=parameters", "--steps=8", f"--save_dir={d}"],
          "z3-part")
    # Each rank wrote its range of the weights (the partitioned fp32 "master") and nothing gathered them: the
    # main file holds no trainable weight; the ranks' ranges end to end are the flat space that
    # meta['model.partitioned'] lists, and dtrain-export assembles exactly those weights.
    model_flags = [f for f in const if f.startswith(("--d_model", "--heads", "--layers", "--seq_len", "--ff", "--vocab"))]
    st = os.path.join(w, "z3-export.safetensors")
    run([os.path.join(args.bin, "dtrain-export"), "--model=gpt", "--device=cpu", *model_flags, f"--checkpoint={d}",
         "--format=safetensors", f"--output={st}"])
    code = ("import sys, torch; from safetensors.torch import load_file; d, st = sys.argv[1], sys.argv[2]; "
            "main = torch.load(d + '/step-000008.pt', weights_only=True); "
            "layout = [(e.rsplit(':', 1)[0], int(e.rsplit(':', 1)[1])) for e in main['meta']['model.partitioned'].split(',')]; "
            "assert not any(n in main['model'] for n, _ in layout), 'the main file holds trainable weights'; "
            "ranks = sorted((torch.load(f'{d}/step-000008.rank-{r}.pt', weights_only=True) for r in range(4)), "
            "key=lambda f: f['shard_begin']); "
            "flat = torch.cat([f['optimizer_shard']['master'] for f in ranks]); "
            "assert flat.numel() == sum(n for _, n in layout) == ranks[0]['flat_numel'], (flat.numel(), ranks[0]['flat_numel']); "
            "w = load_file(st); offsets = [0]; [offsets.append(offsets[-1] + n) for _, n in layout]; "
            "bad = [name for (name, n), o in zip(layout, offsets) if not torch.equal(w[name].flatten().float(), flat[o:o + n])]; "
            "assert not bad, bad; "
            "print('ok:', len(layout), 'weights in 4 rank files, none in the main file; dtrain-export assembles them')")
    run([args.python, "-c", code, d, st])
    # A model of another shape does not resume from it: a clear error, and the directory as it was.
    wrong = os.path.join(w, "ck_z3_wrong")
    shutil.copytree(d, wrong)
    files = lambda: {f: os.path.getmtime(os.path.join(wrong, f)) for f in os.listdir(wrong) if f.endswith(".pt")}
    before = files()
    shape_ff = [f if not f.startswith("--ff=") else "--ff=256" for f in const]
    out = train(args, "train_gpt", 4, shape_ff + ["--batch_size=2", "--shard=parameters", "--steps=12",
                                                 f"--save_dir={wrong}", "--resume"], "z3-wrong", expect_status=2)
    assert "is of a different model: 'blocks.0.mlp.fc1.weight' has 8192 elements there but 16384 here" in out, \
        out[-2000:]
    assert files() == before, f"the checkpoints changed: {before} -> {files()}"
    two = train(args, "train_gpt", 2, const + ["--batch_size=4", "--shard=gradients", "--steps=12", f"--save_dir={d}",
                                             "--resume"], "z3-resumed-2")
    compare([r for r in steps_after(ref16, 8) if r["step"] <= 12], steps_after(two, 8),
            "--shard=parameters on 4 ranks resumed as 2 ranks stage 2", 1e-4)
    one = train(args, "train_gpt", 1, const + ["--batch_size=8", "--steps=16", f"--save_dir={d}", "--resume"],
                "z3-resumed-1")
    compare(steps_after(ref16, 12), steps_after(one, 12), "... resumed again unsharded on one rank", 1e-4)
    back = os.path.join(w, "ck_z3_back")
    train(args, "train_gpt", 1, const + ["--batch_size=8", "--steps=8", f"--save_dir={back}"], "z3-plain-part")
    again = train(args, "train_gpt", 4, const + ["--batch_size=2", "--shard=parameters", "--steps=16",
                                                 f"--save_dir={back}", "--resume"], "z3-from-plain")
    compare(steps_after(ref16, 8), steps_after(again, 8), "an unsharded checkpoint resumed as --shard=parameters", 1e-4)
    code = ("import sys, glob, torch; d = sys.argv[1]; "
            "[torch.load(f, weights_only=True) for f in sorted(glob.glob(d + '/*.pt'))]; print('torch.load ok')")
    run([args.python, "-c", code, d])
    # The offloaded layout saves the same partitioned arrays: stage 3 offloaded on 2 ranks resumes as
    # stage 3 on the device on 4 ranks, and that as stage 3 offloaded on 4.
    d3 = os.path.join(w, "ck_z3_offload")
    train(args, "train_gpt", 2, const + ["--batch_size=4", "--shard=parameters", "--offload=optimizer", "--steps=8",
                                         f"--save_dir={d3}"], "z3-offload-part")
    four = train(args, "train_gpt", 4, const + ["--batch_size=2", "--shard=parameters", "--steps=12",
                                              f"--save_dir={d3}", "--resume"], "z3-offload-resumed-4")
    compare([r for r in steps_after(ref16, 8) if r["step"] <= 12], steps_after(four, 8),
            "--shard=parameters --offload=optimizer on 2 ranks resumed on the device on 4", 1e-4)
    again = train(args, "train_gpt", 4, const + ["--batch_size=2", "--shard=parameters", "--offload=optimizer",
                                               "--steps=16", f"--save_dir={d3}", "--resume"], "z3-offload-resumed-4o")
    compare(steps_after(ref16, 12), steps_after(again, 12), "... resumed again offloaded on 4 ranks", 1e-4)
    # Pipeline stages: pp 2 x dp 2 stage 3 (each stage's ranks write their ranges of its flat space)
    # resumed as itself, then on one rank unsharded, and as pp 4.
    dpp = os.path.join(w, "ck_z3_pp")
    train(args, "train_gpt", 4, const + ["--pp=2", "--batch_size=4", "--accum_steps=2", "--shard=parameters",
                                         "--steps=8", f"--save_dir={dpp}"], "z3-pp-part")
    four = os.path.join(w, "ck_z3_pp4")
    shutil.copytree(dpp, four)
    again = train(args, "train_gpt", 4, const + ["--pp=2", "--batch_size=4", "--accum_steps=2", "--shard=parameters",
                                                 "--steps=12", f"--save_dir={dpp}", "--resume"], "z3-pp-resumed")
    compare([r for r in steps_after(ref16, 8) if r["step"] <= 12], steps_after(again, 8),
            "pp 2 x dp 2 --shard=parameters resumed as itself", 1e-4)
    one = train(args, "train_gpt", 1, const + ["--batch_size=8", "--steps=16", f"--save_dir={dpp}", "--resume"],
                "z3-pp-resumed-1")
    compare(steps_after(ref16, 12), steps_after(one, 12), "... resumed again unsharded on one rank", 1e-4)
    pp4 = train(args, "train_gpt", 4, const + ["--pp=4", "--batch_size=8", "--accum_steps=2", "--steps=16",
                                               f"--save_dir={four}", "--resume"], "z3-pp-resumed-pp4")
    compare(steps_after(ref16, 8), steps_after(pp4, 8), "pp 2 x dp 2 --shard=parameters resumed as pp 4", 1e-4)
    # On the 2D mesh: tp 2 x dp 2 stage 3 resumed as itself, then as tp 2 unsharded (partitioned state
    # resumes under the same --tp).
    d2 = os.path.join(w, "ck_z3_tp")
    train(args, "train_gpt", 4, const + ["--tp=2", "--batch_size=4", "--shard=parameters", "--steps=8",
                                         f"--save_dir={d2}"], "z3-tp-part")
    again = train(args, "train_gpt", 4, const + ["--tp=2", "--batch_size=4", "--shard=parameters", "--steps=12",
                                                 f"--save_dir={d2}", "--resume"], "z3-tp-resumed")
    compare([r for r in steps_after(ref16, 8) if r["step"] <= 12], steps_after(again, 8),
            "tp 2 x dp 2 --shard=parameters resumed as itself", 1e-4)
    tp2 = train(args, "train_gpt", 2, const + ["--tp=2", "--batch_size=8", "--steps=16", f"--save_dir={d2}",
                                               "--resume"], "z3-tp-resumed-tp2")
    compare(steps_after(ref16, 12), steps_after(tp2, 12), "... resumed again as tp 2 unsharded", 1e-4)


def scenario_offload(args):
    shape = ["--d_model=64", "--heads=4", "--layers=2", "--seq_len=32", "--ff=128", "--vocab=96", "--workers=1",
             "--lr=0.003", "--steps=16"]
    ref = train(args, "train_gpt", 1, shape + ["--batch_size=8"], "gpt-gpu-optimizer")
    one = train(args, "train_gpt", 1, shape + ["--batch_size=8", "--offload=optimizer"], "gpt-offload-1")
    compare(ref, one, "--offload=optimizer on 1 rank", 1e-5)
    two = train(args, "train_gpt", 2, shape + ["--batch_size=4", "--offload=optimizer"], "gpt-offload-2")
    compare(ref, two, "--offload=optimizer on 2 ranks, state partitioned", 1e-5)
    for mode in ("layers", "all"):
        run_ = train(args, "train_gpt", 2, shape + ["--batch_size=4", f"--offload={mode}"], f"gpt-offload-{mode}")
        compare(ref, run_, f"--offload={mode} on 2 ranks", 1e-5)
    # Partitioned state saved by 2 ranks resumes on 1 (re-sharded) and the reverse.
    ck = os.path.join(args.workdir, "ck_off")
    train(args, "train_gpt", 2, shape[:-1] + ["--steps=8", "--batch_size=4", "--offload=optimizer", f"--save_dir={ck}"],
          "gpt-offload-part")
    res = train(args, "train_gpt", 1, shape + ["--batch_size=8", "--offload=optimizer", f"--save_dir={ck}", "--resume"],
                "gpt-offload-resumed")
    compare(steps_after(ref, 8), steps_after(res, 8), "offloaded state of 2 ranks resumed on 1", 1e-5)
    ck1 = os.path.join(args.workdir, "ck_off1")
    train(args, "train_gpt", 1, shape[:-1] + ["--steps=8", "--batch_size=8", "--offload=optimizer", f"--save_dir={ck1}"],
          "gpt-offload-part1")
    res2 = train(args, "train_gpt", 2, shape + ["--batch_size=4", "--offload=optimizer", f"--save_dir={ck1}", "--resume"],
                 "gpt-offload-resumed2")
    compare(steps_after(ref, 8), steps_after(res2, 8), "offloaded state of 1 rank resumed on 2", 1e-5)


def scenario_offload_stream(args):
    """Optimizer offload with gradients streamed per bucket during backward (forced on the CPU)
    and the one-step-delayed update."""
    shape = ["--d_model=64", "--heads=4", "--layers=2", "--seq_len=32", "--ff=128", "--vocab=96", "--workers=1",
             "--lr=0.003", "--steps=16"]
    clip = ["--clip_grad_norm=0.5"]
    ref = train(args, "train_gpt", 1, shape + clip + ["--batch_size=8"], "gpt-clip")
    streamed = train(args, "train_gpt", 2, shape + clip + ["--batch_size=4", "--offload=optimizer",
                                                           "--offload_stream_gradients=on"], "gpt-stream-2")
    compare(ref, streamed, "--offload=optimizer, gradients reduced to their owners and streamed per bucket, "
            "clipped, 2 ranks", 1e-5)
    allreduced = train(args, "train_gpt", 2, shape + clip + ["--batch_size=4", "--offload=optimizer",
                                                             "--offload_reduce_to_owner=false"], "gpt-allreduce-2")
    compare(ref, allreduced, "--offload=optimizer, gradients all-reduced, clipped, 2 ranks", 1e-5)
    # Tensor parallelism 2 x data parallelism 2: shards of the tp-split model reduced to owners.
    tp_dp = train(args, "train_gpt", 4, shape + clip + ["--batch_size=4", "--tp=2", "--offload=optimizer"],
                  "gpt-tp2-owner")
    compare(ref, tp_dp, "--offload=optimizer with --tp=2 on 4 ranks, gradients reduced to owners, clipped", 1e-4)
    worst_tp = max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(ref, tp_dp))
    assert worst_tp < 1e-4, f"tp 2 x dp 2: the gradient norm differs from the whole model's by {worst_tp:.2e}"
    clip_norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(ref, streamed)]
    worst = max(abs(x - y) / x for x, y in clip_norms)
    assert worst < 1e-5, f"the gradient norm over owned shards differs from the whole model's by {worst:.2e}"
    print(f"ok: the gradient norm summed over the owners' shards equals the whole model's (worst {worst:.2e})")
    # Delayed update after 4 steps: the warm-up equals the ordinary run, then the curve departs
    # (the update lands one step late) and still falls; 1 rank and 2 partitioned ranks agree.
    delay = ["--offload=optimizer", "--offload_delayed_update_after=4"]
    d1 = train(args, "train_gpt", 1, shape + clip + delay + ["--batch_size=8"], "gpt-delay-1")
    compare(ref[:4], d1[:4], "delayed update: the 4 warm-up steps", 1e-5)
    departs = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref[5:], d1[5:]))
    assert departs > 1e-4, f"the delayed update did not change the curve after the warm-up ({departs:.2e})"
    assert d1[-1]["loss"] < 0.8 * d1[0]["loss"], f"delayed update: loss did not fall: {d1[0]['loss']} -> {d1[-1]['loss']}"
    print(f"ok: delayed update departs from the ordinary curve after the warm-up (up to {departs:.2e}) and "
          f"falls {d1[0]['loss']:.4f} -> {d1[-1]['loss']:.4f}")
    # The memory report has a host row for the offloaded state (rank 0 alone calls it).
    # (INFO lines, which the test environment may silence with GLOG_minloglevel.)
    out = run(shlex.split(args.mpirun) + ["-np", "2", "-x", "GLOG_minloglevel=0", os.path.join(args.bin, "train_gpt"),
                                          "--device=cpu", "--progress=false", "--batch_size=4",
                                          "--memory_report_step=6"] + shape + delay,
              env=dict(os.environ, GLOG_minloglevel="0"))
    assert "host: optimizer offload (master, state, buffers)" in out, "no host row in the memory report"
    assert "each gradient is reduced only to the rank whose shard holds it" in out, "not reduced to owners"
    print("ok: the memory report shows the offloaded host memory")
    d2 = train(args, "train_gpt", 2, shape + clip + delay + ["--batch_size=4", "--offload_stream_gradients=on"],
               "gpt-delay-2")
    compare(d1, d2, "delayed update on 2 ranks, state partitioned, gradients streamed", 1e-5)
    # The timeline shows the delayed CPU updates running alongside forward/backward (a model
    # whose update, ~4 ms on one thread, takes well longer than the gap between steps: with a
    # 1 ms update the overlap depended on scheduling; one core for the compute and one for the
    # update, which otherwise waits for a core until the main thread blocks).
    tl = os.path.join(args.workdir, "delay_timeline.json")
    train(args, "train_gpt", 1, ["--d_model=128", "--heads=4", "--layers=2", "--seq_len=32", "--ff=256",
                                 "--vocab=16384", "--workers=1", "--steps=8", "--batch_size=4", "--offload_threads=1",
                                 f"--timeline={tl}"] + delay, "gpt-delay-timeline", env={"OMP_NUM_THREADS": "1"})
    with open(tl) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    updates = [e for e in spans if e["name"] == "cpu update (delayed)"]
    compute = [e for e in spans if e["name"] in ("forward", "backward")]
    assert len(updates) >= 3, f"{len(updates)} delayed cpu update spans in the timeline"
    overlapping = sum(1 for u in updates for c in compute
                      if u["ts"] < c["ts"] + c["dur"] and c["ts"] < u["ts"] + u["dur"])
    assert overlapping > 0, "no delayed cpu update overlaps a forward or backward span"
    print(f"ok: timeline has {len(updates)} delayed cpu updates, {overlapping} overlapping forward/backward spans")
    # Saving publishes the update in flight; a run resumed there continues as the saving run.
    ck_full = os.path.join(args.workdir, "ck_delay_full")
    full = train(args, "train_gpt", 2, shape + clip + delay + ["--batch_size=4", "--save_every=8",
                                                               f"--save_dir={ck_full}"], "gpt-delay-full")
    ck = os.path.join(args.workdir, "ck_delay")
    train(args, "train_gpt", 2, shape[:-1] + clip + delay + ["--steps=8", "--batch_size=4", f"--save_dir={ck}"],
          "gpt-delay-part")
    res = train(args, "train_gpt", 2, shape + clip + delay + ["--batch_size=4", f"--save_dir={ck}", "--resume"],
                "gpt-delay-resumed")
    compare(steps_after(full, 8), steps_after(res, 8), "delayed update resumed from a checkpoint", 1e-5)


def scenario_plan(args):
    shape = ["--data=synthetic", "--d_model=128", "--heads=4", "--ff=256", "--layers=2", "--seq_len=64",
             "--vocab=1000", "--batch_size=8", "--steps=4", "--workers=1"]
    budget_mib = 30
    plain = train(args, "train_seq2seq", 1, shape, "plain")
    assert plain[-1]["mem_peak_mb"] > budget_mib, f"the plain run fits {budget_mib} MiB already: {plain[-1]}"
    planned = train(args, "train_seq2seq", 1, shape + ["--plan=auto", f"--gpu_mem_limit_gb={budget_mib / 1024}"], "planned")
    peak = max(m["mem_peak_mb"] for m in planned)
    assert peak <= budget_mib, f"the auto plan peaked at {peak} MiB over the {budget_mib} MiB budget"
    print(f"ok: --plan=auto trains under {budget_mib} MiB (peak {peak:.1f} MiB) where the plain step needs "
          f"{plain[-1]['mem_peak_mb']:.1f} MiB; accumulation {planned[-1].get('accum_steps')}")
    plan_pipeline(args)


def plan_pipeline(args):
    """--plan=auto and dtrain-plan with --pp: each stage probes its own layers, its estimate counts the
    micro-batches it holds in flight (1F1B min(P - s, m), GPipe m), and every rank applies the plan that
    fits every stage."""
    shape = ["--d_model=64", "--heads=4", "--layers=4", "--seq_len=64", "--ff=256", "--vocab=97", "--batch_size=16",
             "--device=cpu", "--pp=2"]
    mpirun = shlex.split(args.mpirun) + ["-np", "2"]

    def plan(*flags):
        out = run(mpirun + [os.path.join(args.bin, "dtrain-plan"), "--model=gpt"] + shape + list(flags))
        return out, [json.loads(l) for l in out.splitlines() if l.startswith("{")]

    # The estimate of every stage against the peak of the pipeline trained with those flags.
    for flags in (["--accum_steps=4"], ["--accum_steps=4", "--pp_schedule=gpipe"],
                  ["--accum_steps=2", "--checkpoint_activations"], ["--accum_steps=8", "--amp=bf16"]):
        out, js = plan("--verify_steps=2", *flags)
        stages = [j for j in js if "verify_steps" in j][0]["stages"]
        assert len(stages) == 2, stages
        for s, v in enumerate(stages):
            assert abs(v["relative_error"]) < 0.10, f"{flags} stage {s}: estimate off by {v['relative_error']:.1%}"
        print(f"ok: {' '.join(flags)}: stage estimates within " +
              ", ".join(f"{v['relative_error']:+.1%}" for v in stages) + " of the measured peaks")
    # GPipe holds every micro-batch, 1F1B at most P - s: at 8 micro-batches GPipe's stage 0 needs more.
    one_f = plan("--accum_steps=8")[1][0]
    gpipe = plan("--accum_steps=8", "--pp_schedule=gpipe")[1][0]
    assert one_f["current_flags_in_flight"] == 2 and gpipe["current_flags_in_flight"] == 8, (one_f, gpipe)
    assert gpipe["current_flags_gpu_bytes"] > one_f["current_flags_gpu_bytes"], (one_f, gpipe)
    # A budget below the plain step: the plan fits every stage, measured.
    plain = plan()[1][0]
    budget = 0.6 * plain["current_flags_gpu_bytes"]
    gb = f"--gpu_mem_limit_gb={budget / (1 << 30):.8f}"
    out, js = plan(gb)
    chosen = js[0]["flags"]
    assert chosen and all(f"plan: stage {s} estimate: allocated peak" in out for s in (0, 1)), out[-2000:]
    out, js = plan(gb, "--verify_steps=2", *chosen.split())
    stages = [j for j in js if "verify_steps" in j][0]["stages"]
    assert all(v["measured_peak_bytes"] <= budget for v in stages), (budget, stages)
    print(f"ok: dtrain-plan --pp=2 under {budget / (1 << 20):.1f} MiB (plain {plain['current_flags_gpu_bytes'] / (1 << 20):.1f}): "
          f"'{chosen}', stages peak " + ", ".join(f"{v['measured_peak_bytes'] / (1 << 20):.2f}" for v in stages) + " MiB")
    # train_gpt applies the same plan on both stages and follows the unsplit run.
    common = ["--d_model=64", "--heads=4", "--layers=4", "--seq_len=64", "--ff=256", "--vocab=97", "--batch_size=16",
              "--steps=4", "--workers=1", "--lr=0.003"]
    ref = train(args, "train_gpt", 1, common, "plan-pp-ref")
    out = train(args, "train_gpt", 2, common + ["--pp=2", "--plan=auto", gb], "plan-pp", output=True)
    lines = [l for l in out.splitlines() if l.startswith("train_gpt: plan: ") and "stage" not in l]
    assert len(lines) == 1 and lines[0] != "train_gpt: plan: (as given)", out[-2000:]
    applied = lines[0][len("train_gpt: plan: "):]
    planned = metrics(os.path.join(args.workdir, "plan-pp.jsonl"))
    compare(ref, planned, f"pp 2 --plan=auto ({applied})", 1e-4)
    accum = [int(f.split("=")[1]) for f in applied.split() if f.startswith("--accum_steps=")]
    assert planned[-1]["accum_steps"] == (accum[0] if accum else 1), planned[-1]
    print(f"ok: train_gpt --pp=2 --plan=auto applied '{applied}' on both stages")
    # Nothing fits on every stage: every rank stops with the same clear error.
    out = train(args, "train_gpt", 2, common + ["--pp=2", "--plan=auto", "--gpu_mem_limit_gb=0.0002"],
                "plan-pp-none", expect_status=2)
    assert "candidates on every rank" in out and "more --pp stages" in out, out[-2000:]


def scenario_sparse(args):
    """--sparse_embedding: the token embedding's gradient travels as rows. Adagrad's sparse rule
    equals its dense rule on the touched rows and leaves the others alone, as the dense rule does
    for a zero gradient: so sparse training follows the dense curve, at 1, 2 and 4 ranks, with
    tp 2, with accumulation, clipping and fp16 loss scaling, and for the seq2seq model; where the
    batch touches most of a small vocabulary the dense fallback is taken, and the curve is the
    same. SparseAdam (--optimizer=adam with sparse rows) is layout-independent too, and unlike
    Adam (its untouched rows' moments do not decay). Bad combinations are refused."""
    gpt = ["--d_model=32", "--heads=4", "--layers=1", "--ff=64", "--seq_len=32", "--steps=12", "--workers=1",
           "--weight_decay=0", "--seed=7"]
    big = gpt + ["--data=synthetic", "--vocab=3000", "--optimizer=adagrad", "--lr=0.05"]
    ref = train(args, "train_gpt", 1, big + ["--batch_size=8"], "dense-1")
    for ranks, batch, extra, name in [(1, 8, [], "1 rank"), (2, 4, [], "2 ranks"), (4, 2, [], "4 ranks"),
                                      (2, 8, ["--tp=2"], "tp 2"),
                                      (2, 4, ["--accum_steps=2", "--amp=fp16", "--clip_grad_norm=0.5"],
                                       "2 ranks, 2 micro-batches, fp16, clipped")]:
        flags = big + [f"--batch_size={batch}", "--sparse_embedding"] + extra
        other = train(args, "train_gpt", ranks, flags, f"sparse-{ranks}-{len(extra)}")
        if "--amp=fp16" in extra:
            base = train(args, "train_gpt", 1, big + ["--batch_size=8", "--accum_steps=2", "--amp=fp16",
                                                       "--clip_grad_norm=0.5"], "dense-fp16")
            compare(base, other, f"sparse Adagrad, {name}", 1e-3)
        else:
            compare(ref, other, f"sparse Adagrad, {name}", 1e-4)
        last = other[-1]
        if ranks // (2 if "--tp=2" in extra else 1) > 1:
            assert last["sparse_grad_densified"] == 0, f"{name}: the sparse batch was densified: {last}"
            assert last["sparse_grad_mb"] < 0.2 * last["sparse_grad_dense_mb"], f"{name}: {last}"
            print(f"ok: {name}: the embedding's gradient moved {last['sparse_grad_mb']:.4f} MB as rows instead of "
                  f"{last['sparse_grad_dense_mb']:.4f} MB dense")
    # A 96-token vocabulary that every batch mostly touches: the dense fallback.
    small = gpt + ["--data=synthetic", "--vocab=96", "--optimizer=adagrad", "--lr=0.05"]
    ref = train(args, "train_gpt", 1, small + ["--batch_size=8"], "small-dense")
    other = train(args, "train_gpt", 2, small + ["--batch_size=4", "--sparse_embedding"], "small-sparse")
    compare(ref, other, "sparse Adagrad with the dense fallback, 2 ranks", 1e-4)
    assert other[-1]["sparse_grad_densified"] == 1, other[-1]
    print("ok: a batch touching most of the vocabulary is reduced densely (cheaper), same curve")
    # seq2seq: both embeddings sparse (its default optimizer is Adagrad).
    s2s = ["--d_model=32", "--heads=4", "--layers=1", "--ff=64", "--seq_len=16", "--steps=8", "--workers=1",
           "--data=synthetic", "--vocab=2000", "--dropout=0", "--weight_decay=0"]
    compare(train(args, "train_seq2seq", 1, s2s + ["--batch_size=8"], "s2s-dense"),
            train(args, "train_seq2seq", 2, s2s + ["--batch_size=4", "--sparse_embedding"], "s2s-sparse"),
            "seq2seq, sparse embeddings, 2 ranks", 1e-4)
    # SparseAdam: the same on any layout, and not Adam.
    adam = big[:-2] + ["--optimizer=adam", "--lr=0.003"]
    one = train(args, "train_gpt", 1, adam + ["--batch_size=8", "--sparse_embedding"], "sadam-1")
    compare(one, train(args, "train_gpt", 2, adam + ["--batch_size=4", "--sparse_embedding"], "sadam-2"),
            "SparseAdam for the embedding, 2 ranks", 1e-4)
    # Resume: the sparse rows' optimizer state (SparseAdam's moments) is in the checkpoint; a run
    # stopped at step 6 and resumed on another number of ranks continues the uninterrupted curve.
    ck = os.path.join(args.workdir, "sparse-ck")
    train(args, "train_gpt", 1, adam + ["--batch_size=8", "--sparse_embedding", "--steps=6", f"--save_dir={ck}"],
          "sadam-first")
    resumed = train(args, "train_gpt", 2, adam + ["--batch_size=4", "--sparse_embedding", "--resume=yes",
                                                  f"--save_dir={ck}"], "sadam-resumed")
    compare(steps_after(one, 6), steps_after(resumed, 6), "SparseAdam resumed at step 6 on 2 ranks", 1e-4)
    dense = train(args, "train_gpt", 1, adam + ["--batch_size=8"], "adam-1")
    assert any(abs(a["loss"] - b["loss"]) > 1e-5 for a, b in zip(one, dense)), "SparseAdam behaved as Adam"
    print("ok: SparseAdam differs from Adam (lazy moments), as torch.optim.SparseAdam does")
    # Refused.
    for extra, message in [(["--shard=optimizer"], "the partitioned optimizers keep one flat dense gradient space"),
                           (["--optimizer=sgd"], "momentum"),
                           (["--weight_decay=0.1"], "Optimizers that take sparse gradients: adagrad with --weight_decay=0")]:
        out = train(args, "train_gpt", 1, big + ["--batch_size=8", "--sparse_embedding"] + extra, "refused",
                    expect_status=2)
        assert message in out, f"expected '{message}'"
        print(f"ok: refused: {message}")


# PyTorch's distillation loss in float64 on two MLP checkpoints and the digits training split
# (run by the Python that has torch: this script may run under one without it).
DISTILL_REFERENCE = r"""
import glob, os, sys
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
teacher, student, T, alpha = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])

def mlp(ck):
    main = sorted(f for f in glob.glob(os.path.join(ck, "step-*.pt")) if ".rank-" not in f)[-1]
    state = torch.load(main, map_location="cpu", weights_only=True)["model"]
    layers = [(state[f"{2 * i}.weight"].double(), state[f"{2 * i}.bias"].double()) for i in range(len(state) // 2)]
    def forward(h):
        for k, (w, b) in enumerate(layers):
            h = F.linear(h, w, b)
            h = h.relu() if k < len(layers) - 1 else h
        return h
    return forward

x, y = load_digits(return_X_y=True)
n_train = len(x) - len(x) // 5
xs = torch.tensor(x[:n_train] / 16.0, dtype=torch.float32).double()  # as dtrain reads them
ys = torch.tensor(y[:n_train], dtype=torch.long)
s, t = mlp(student)(xs), mlp(teacher)(xs)
kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean")
print(repr((alpha * T * T * kl + (1 - alpha) * F.cross_entropy(s, ys)).item()))
"""


def scenario_distill(args):
    """Knowledge distillation (--teacher): the logged loss of the first step equals PyTorch's
    alpha T^2 kl_div(log_softmax) + (1 - alpha) cross_entropy in float64 on the real weights and
    data (MLP on the digits); the GPT student's curve is the same at tp 2, dp 2 and tp 2 x dp 2
    as on one rank (vocabulary-parallel KL, the teacher split like the student); alpha 0 is
    plain training exactly; a bf16 teacher stays close; bad teacher input is refused."""
    work = args.workdir
    # 1. The MLP on the digits: the whole training split as one batch (the checkpoint
    #    holds the weights the first step's loss was computed with: an update of lr 1e-30 changes no float32).
    teacher = os.path.join(work, "mlp-teacher")
    train(args, "train_mlp", 1, ["--hidden=64", "--depth=2", "--steps=60", f"--save_dir={teacher}"], "mlp-teacher")
    T, alpha, n_train = 3.0, 0.6, 1797 - 1797 // 5  # scikit-learn's digits: 1797 rows, 20% held out
    student = os.path.join(work, "mlp-student")
    rows = train(args, "train_mlp", 1, ["--hidden=16", "--depth=1", "--steps=1", "--optimizer=sgd", "--lr=1e-30", "--weight_decay=0",
                                        f"--batch_size={n_train}",
                                        f"--teacher={teacher}", f"--distill_temperature={T}", f"--distill_alpha={alpha}",
                                        f"--save_dir={student}"], "mlp-student")
    ref = subprocess.run([args.python, "-c", DISTILL_REFERENCE, teacher, student, str(T), str(alpha)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout
    want, got = float(ref.stdout.strip().splitlines()[-1]), rows[0]["loss"]
    assert abs(got - want) <= 1e-5 * abs(want), f"distillation loss {got}, PyTorch's {want}"
    print(f"ok: the first step's distillation loss {got:.6f} equals PyTorch's kl_div + cross_entropy ({want:.6f}) "
          f"on the teacher's and student's weights (the teacher's shape read from its checkpoint)")

    # The CNN: a teacher of another width (read from its checkpoint); alpha 0 is plain training.
    cnn_teacher = os.path.join(work, "cnn-teacher")
    train(args, "train_cnn", 1, ["--hidden=64", "--steps=20", f"--save_dir={cnn_teacher}"], "cnn-teacher")
    cnn = ["--hidden=16", "--steps=8", "--batch_size=32"]
    plain_cnn = train(args, "train_cnn", 1, cnn, "cnn-plain")
    compare(plain_cnn, train(args, "train_cnn", 1, cnn + [f"--teacher={cnn_teacher}", "--distill_alpha=0"], "cnn-a0"),
            "cnn student, alpha 0 = plain training", 1e-6)
    kd_cnn = train(args, "train_cnn", 2, ["--hidden=16", "--steps=8", "--batch_size=16", f"--teacher={cnn_teacher}"],
                   "cnn-kd-2")
    compare(train(args, "train_cnn", 1, cnn + [f"--teacher={cnn_teacher}"], "cnn-kd-1"), kd_cnn,
            "cnn student distilled, 2 ranks", 1e-4)

    # 2. The GPT on the text data: layouts, alpha 0, bf16.
    teacher = os.path.join(work, "gpt-teacher")
    common = ["--steps=15", "--workers=1", "--lr=0.003", "--seed=5", "--seq_len=32", "--vocab=97"]
    train(args, "train_gpt", 1, ["--d_model=64", "--heads=4", "--layers=2", "--ff=128", "--batch_size=8",
                                 "--steps=30", "--workers=1", "--seq_len=32", "--vocab=97", f"--save_dir={teacher}"],
          "gpt-teacher")
    student = ["--d_model=32", "--heads=4", "--layers=1", "--ff=64"] + common
    kd = student + [f"--teacher={teacher}", "--distill_temperature=2", "--distill_alpha=0.7"]
    ref = train(args, "train_gpt", 1, kd + ["--batch_size=8"], "kd-1")
    plain = train(args, "train_gpt", 1, student + ["--batch_size=8"], "plain-1")
    assert abs(ref[0]["loss"] - plain[0]["loss"]) > 1e-3 * plain[0]["loss"], "the teacher did not change the loss"
    compare(plain, train(args, "train_gpt", 1, student + ["--batch_size=8", f"--teacher={teacher}", "--distill_alpha=0"],
                         "kd-alpha0"), "alpha 0 (the teacher has no weight) = plain training", 1e-6)
    compare(ref, train(args, "train_gpt", 2, kd + ["--batch_size=8", "--tp=2"], "kd-tp2"),
            "distilled, tp 2 (vocabulary-parallel KL)", 1e-4)
    compare(ref, train(args, "train_gpt", 2, kd + ["--batch_size=4"], "kd-dp2"), "distilled, dp 2", 1e-4)
    compare(ref, train(args, "train_gpt", 4, kd + ["--batch_size=4", "--tp=2"], "kd-tp2dp2"),
            "distilled, tp 2 x dp 2", 1e-4)
    compare(ref, train(args, "train_gpt", 1, kd + ["--batch_size=8", "--teacher_bf16"], "kd-bf16"),
            "distilled from a bf16 teacher", 0.02)
    compare(ref, train(args, "train_gpt", 1, kd + ["--batch_size=8", "--teacher_offload"], "kd-offload"),
            "distilled from a teacher streamed from host memory", 1e-6)

    # 3. Bad input: a clear message, a non-zero exit, nothing written.
    out_dir = os.path.join(work, "refused")
    empty = os.path.join(work, "empty")
    os.makedirs(empty)
    cases = [
        (["--teacher_d_model=48"], "The teacher was built with --d_model=48"),
        (["--teacher_vocab=300"], "a teacher must share the student's vocabulary"),
        (["--distill_alpha=1.5"], "--distill_alpha=1.5 is not valid; the weight of the teacher's term must be in [0, 1]"),
        (["--distill_temperature=0"], "the distillation temperature must be a finite number > 0"),
        (["--eval_only"], "distillation is a way of training"),
        ([f"--teacher={empty}"], "holds no good checkpoint"),
    ]
    for extra, message in cases:
        out = train(args, "train_gpt", 1, kd + ["--batch_size=8", f"--save_dir={out_dir}"] + extra, "refused",
                    expect_status=2)
        assert message in out, f"expected '{message}'"
        print(f"ok: refused: {message}")
    out = train(args, "train_gpt", 1, student + ["--distill_alpha=0.3"], "refused", expect_status=2)
    assert "has no effect without --teacher" in out
    out = train(args, "train_mlp", 1, ["--steps=2", f"--teacher={os.path.join(work, 'mlp-teacher')}", "--teacher_offload"],
                "refused", expect_status=2)
    assert "has no blocks to stream" in out
    assert not os.path.exists(out_dir), "a refused run wrote its --save_dir"
    print("ok: --distill_* without --teacher refused; nothing written by the refused runs")


# (tp, pp, dp) of the reshard scenario: every layout of 2 in each axis up to 8 ranks. CI runs
# RESHARD_CI (each axis alone and with tensor parallelism); --full runs them all.
RESHARD_LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 1), (1, 2, 2), (2, 2, 2)]
RESHARD_CI = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 1)]
RESHARD_MODES = [("none", "none"), ("optimizer", "none"), ("parameters", "none"), ("none", "optimizer"),
                 ("parameters", "optimizer")]


def scenario_reshard(args):
    """Checkpoints of every layout (tp x pp x dp, with ZeRO-1/3 and optimizer offload) resume at
    one rank and export from one process with the weights of the one-rank run."""
    w = args.workdir
    shape = ["--d_model=32", "--heads=2", "--layers=2", "--seq_len=16", "--ff=64", "--vocab=97"]
    # SGD (momentum 0.9): the weights of two layouts differ by the gradients' rounding only (Adam
    # would turn a rounding difference of a near-zero gradient into a full step), so the exported
    # weights are compared to 1e-5; the momentum is the partitioned state that is resharded.
    common = shape + ["--workers=1", "--optimizer=sgd", "--lr=0.05", "--seed=4", "--schedule=constant"]
    ref_dir = os.path.join(w, "ref")
    ref = train(args, "train_gpt", 1, common + ["--steps=4", "--batch_size=8", "--save_every=3", "--keep_last=0",
                                                f"--save_dir={ref_dir}"], "reshard-ref")

    def export(ck, name):
        out = os.path.join(w, name + ".safetensors")
        run([os.path.join(args.bin, "dtrain-export"), "--model=gpt", *shape, f"--checkpoint={ck}",
             "--format=safetensors", f"--output={out}"])
        return out

    # Compared by safetensors' own reader, in the Python that has it: the worst relative difference.
    compare_code = (
        "import sys\n"
        "from safetensors.torch import load_file\n"
        "a, b = load_file(sys.argv[1]), load_file(sys.argv[2])\n"
        "assert sorted(a) == sorted(b), (sorted(a), sorted(b))\n"
        "print(max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))"
        " for k in b))\n")

    # The reference's weights after step 3: its step-3 checkpoint, exported alone.
    ref3 = os.path.join(w, "ref3")
    os.makedirs(ref3)
    for n in os.listdir(ref_dir):
        if n.startswith("step-000003"):
            shutil.copy(os.path.join(ref_dir, n), ref3)
    want = export(ref3, "ref3")
    layouts = RESHARD_LAYOUTS if args.full else RESHARD_CI
    checked = 0
    for tp, pp, dp in layouts:
        for shard, offload in RESHARD_MODES:
            name = f"tp{tp}-pp{pp}-dp{dp}-shard_{shard}-offload_{offload}"
            ck = os.path.join(w, name)
            ranks = tp * pp * dp
            flags = [f"--tp={tp}", f"--pp={pp}", f"--shard={shard}", f"--offload={offload}",
                     f"--batch_size={8 // dp}", f"--accum_steps={2 if pp > 1 else 1}"]
            train(args, "train_gpt", ranks, common + flags + ["--steps=3", f"--save_dir={ck}"], name)
            # Exported from one process: the weights of step 3 (before the resume below saves step 4).
            got = export(ck, name)
            worst = float(run([args.python, "-c", compare_code, got, want]).strip().splitlines()[-1])
            # Resumed at one rank, unsplit: its step 4 is the reference's.
            resumed = train(args, "train_gpt", 1, common + ["--steps=4", "--batch_size=8", f"--save_dir={ck}",
                                                            "--resume=yes"], name + "-resumed")
            compare(steps_after(ref, 3), resumed, name + " resumed at 1 rank", 1e-4)
            assert worst < 1e-5, f"FAIL: {name}: exported weights differ from the one-rank run's by {worst:.2e}"
            print(f"ok: {name}: resumed at 1 rank and exported with the one-rank weights (worst {worst:.1e})")
            checked += 1
    print(f"ok: {checked} layouts saved, resumed at one rank and exported")


def scenario_traps(args):
    """The silent traps of a user's run (issue "No silent wrong work"), through the example programs."""
    import signal
    import time
    w = args.workdir
    common = ["--workers=1", "--seed=5", "--schedule=constant"]
    # 1. Every evaluation scores the same held-out samples: with weights that barely move
    #    (lr 1e-9), successive eval_loss values are equal (they differed by as much as training
    #    improves them when each evaluation took the next slice).
    still = common + ["--lr=1e-9", "--steps=8", "--eval_every=2", "--eval_samples=96", "--batch_size=16"]
    evals = [m["eval_loss"] for m in train(args, "train_mlp", 1, still, "still") if "eval_loss" in m]
    assert len(evals) == 4, evals
    spread = (max(evals) - min(evals)) / abs(evals[0])
    assert spread < 1e-6, f"FAIL: successive evaluations of (nearly) the same weights differ by {spread:.2e}: {evals}"
    print(f"ok: 4 evaluations of the same held-out set: {evals[0]:.6f} (spread {spread:.1e})")
    # 2. The evaluated set does not depend on the layout: 1 rank x 16 and 2 ranks x 16 (a
    #    different global batch), also with accumulation, score the same samples at step 1.
    first = ["--lr=1e-9", "--steps=1", "--eval_every=1", "--eval_samples=100"]
    layouts = [(1, ["--batch_size=16"]), (2, ["--batch_size=16"]), (2, ["--batch_size=8", "--accum_steps=2"]),
               (4, ["--batch_size=4"])]
    got = [train(args, "train_mlp", n, common + first + f, f"layout{i}")[0]["eval_loss"] for i, (n, f) in enumerate(layouts)]
    worst = max(abs(g - got[0]) / abs(got[0]) for g in got)
    assert worst < 1e-6, f"FAIL: eval_loss depends on the layout: {got}"
    print(f"ok: eval_loss {got[0]:.6f} for 1x16, 2x16, 2x(2x8) and 4x4 (worst relative difference {worst:.1e})")
    # 3. A fresh run into a directory of another run's checkpoints is refused, names the
    #    choices, and writes nothing there; --save_dir_exists=resume continues from them.
    ck = os.path.join(w, "ck-shared")
    train(args, "train_mlp", 1, common + ["--steps=6", "--save_every=3", f"--save_dir={ck}"], "first-run")
    before = sorted(os.listdir(ck))
    out = train(args, "train_mlp", 1, common + ["--steps=4", f"--save_dir={ck}"], "fresh-run", expect_status=2)
    assert "already holds 2 checkpoint(s) of an earlier run" in out and "--save_dir_exists=overwrite" in out, out
    assert sorted(os.listdir(ck)) == before, "a refused run changed the checkpoint directory"
    resumed = train(args, "train_mlp", 1, common + ["--steps=8", f"--save_dir={ck}", "--save_dir_exists=resume"],
                    "resume-run")
    assert [m["step"] for m in resumed] == [7, 8], f"--save_dir_exists=resume did not continue from step 6: {resumed}"
    print("ok: a fresh run into another run's checkpoints is refused; --save_dir_exists=resume continues")
    # 4. Killed (SIGKILL, no save) after its last checkpoint, then resumed: the metrics file and
    #    TensorBoard hold one point per step, and the curve equals an uninterrupted run's.
    ck = os.path.join(w, "ck-killed")
    tb = os.path.join(w, "tb-killed")
    killed_metrics = os.path.join(w, "killed.jsonl")
    cmd = [os.path.join(args.bin, "train_mlp"), "--device=cpu", "--progress=false", "--log_every=1",
           f"--metrics={killed_metrics}", f"--tensorboard_dir={tb}", f"--save_dir={ck}", "--save_every=7",
           "--steps=100000", "--async_save=false", "--lr=0.003"] + common
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        steps = [m["step"] for m in metrics(killed_metrics)] if os.path.exists(killed_metrics) else []
        if steps and steps[-1] >= 25 and steps[-1] % 7 != 0:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    logged = [m["step"] for m in metrics(killed_metrics)]
    saved = max(int(n[5:11]) for n in os.listdir(ck) if n.startswith("step-") and n.endswith(".pt") and "rank" not in n)
    assert logged[-1] > saved, f"the kill came before any step past the checkpoint ({logged[-1]} vs {saved})"
    end = saved + 6
    train(args, "train_mlp", 1, common + ["--lr=0.003", f"--steps={end}", f"--save_dir={ck}", "--resume=auto",
                                          f"--tensorboard_dir={tb}", f"--metrics={killed_metrics}"], "resumed-killed",
          output=True)
    lines = metrics(killed_metrics)
    steps = [m["step"] for m in lines]
    assert steps == list(range(1, end + 1)), f"FAIL: the metrics file's steps after the resume: {steps}"
    ref = train(args, "train_mlp", 1, common + ["--lr=0.003", f"--steps={end}", "--save_every=7",
                                                f"--save_dir={os.path.join(w, 'ck-ref')}", "--async_save=false"], "uninterrupted")
    compare(ref, lines, "killed at step %d and resumed from step %d" % (logged[-1], saved), 1e-6)
    code = (
        "import sys\n"
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
        "acc = EventAccumulator(sys.argv[1]); acc.Reload()\n"
        "print(' '.join(f'{e.step}:{e.value!r}' for e in acc.Scalars('train/loss')))\n")
    out = subprocess.run([args.python, "-c", code, tb], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert out.returncode == 0, out.stderr
    points = [(int(a), float(b)) for a, b in (x.split(":") for x in out.stdout.split())]
    assert [st for st, _ in points] == list(range(1, end + 1)), f"FAIL: TensorBoard's train/loss steps: {points}"
    worst = max(abs(v - m["loss"]) / abs(m["loss"]) for (_, v), m in zip(points, lines))
    assert worst < 1e-6, f"FAIL: TensorBoard's train/loss differs from the metrics file by {worst:.2e}"
    print(f"ok: killed after step {logged[-1]}, resumed from {saved}: one metrics line and one TensorBoard point per "
          f"step 1-{end}, equal to the uninterrupted run")
    # 5. Bytes folded into a smaller vocabulary are said out loud.
    out = train(args, "train_gpt", 1, ["--steps=1", "--d_model=32", "--heads=2", "--layers=1", "--ff=64", "--seq_len=16",
                                       "--vocab=96", "--batch_size=2", "--workers=1"], "fold", output=True)
    assert "--vocab=96 is below 256: each byte b of the corpus becomes token b mod 96" in out, out
    print("ok: --vocab below 256 says that it folds bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["data_parallel", "amp", "seq2seq", "tensor_parallel", "observability",
                                         "checkpoint", "checkpoint_tp", "offload", "offload_stream", "plan",
                                         "sequence_parallel", "distill", "sparse", "pipeline", "zero3", "traps",
                                         "reshard"])
    ap.add_argument("--full", action="store_true", help="reshard: every layout, not only CI's")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--source", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("--bin", required=True)
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or tmp
        {"data_parallel": scenario_data_parallel, "amp": scenario_amp, "seq2seq": scenario_seq2seq,
         "tensor_parallel": scenario_tensor_parallel, "observability": scenario_observability,
         "checkpoint": scenario_checkpoint, "checkpoint_tp": scenario_checkpoint_tp,
         "offload": scenario_offload, "offload_stream": scenario_offload_stream, "plan": scenario_plan,
         "sequence_parallel": scenario_sequence_parallel, "distill": scenario_distill,
         "sparse": scenario_sparse, "pipeline": scenario_pipeline,
         "zero3": scenario_zero3, "traps": scenario_traps, "reshard": scenario_reshard}[args.scenario](args)


if __name__ == "__main__":
    main()
