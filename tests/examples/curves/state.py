"""Scenarios of loss_curves.py: what a run writes and reads back (metrics, TensorBoard, the
timeline, checkpoints resumed under other layouts, the export) and the silent traps of a user's run."""
import json
import re
import os
import shlex
import shutil
import subprocess

from .common import compare, dir_digest, metrics, run, steps_after, train


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
    # the reducer launches (enqueues) some all-reduce while the backward of its step still runs
    # (overlap). When the communication thread then starts it depends on the scheduler (ctest
    # runs two of these jobs on two cores), so the starts inside backward are reported, not
    # asserted.
    with open(tl) as f:
        trace = json.load(f)["traceEvents"]
    spans = [e for e in trace if e.get("ph") == "X"]
    ranks = {e["pid"] for e in spans}
    assert ranks == {0, 1}, ranks
    backward = [e for e in spans if e["name"] == "backward"]
    comm = [e for e in spans if e["name"] == "all_reduce"]
    enqueued = [e for e in trace if e.get("ph") == "i" and e.get("name") == "enqueue all_reduce"]
    assert backward and comm and enqueued, "no backward, all_reduce or enqueue all_reduce events"

    def inside(t, pid):
        return any(b["pid"] == pid and b["ts"] <= t < b["ts"] + b["dur"] for b in backward)

    launched = sum(1 for e in enqueued if inside(e["ts"], e["pid"]))
    started = sum(1 for c in comm if inside(c["ts"], c["pid"]))
    assert launched > 0, "no all-reduce was enqueued inside a backward span: the reduction does not overlap backward"
    print(f"ok: timeline has {len(backward)} backward and {len(comm)} all_reduce spans on ranks {sorted(ranks)}; "
          f"{launched} of {len(enqueued)} all-reduces enqueued during backward ({started} started during it)")


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
    assert "is of a model built with other shape flags: --hidden=256 (here 128)" in text, text
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
    # Its numpy reader (the weights are float32): importing torch took 2.5 s of each of 25 checks.
    compare_code = (
        "import sys\n"
        "import numpy as np\n"
        "from safetensors.numpy import load_file\n"
        "a, b = load_file(sys.argv[1]), load_file(sys.argv[2])\n"
        "assert sorted(a) == sorted(b), (sorted(a), sorted(b))\n"
        "assert all(a[k].dtype == np.float32 and a[k].shape == b[k].shape for k in b), 'dtype or shape differs'\n"
        "d = lambda k: a[k].astype(np.float64) - b[k].astype(np.float64)\n"
        "print(max(float(np.abs(d(k)).max() / max(float(np.abs(b[k].astype(np.float64)).max()), 1e-12))"
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
    # 3b. Checkpoints copied without their .crc records, and a directory whose checkpoints are
    #     all corrupt: a fresh run and --resume=auto are both refused and change nothing (a user
    #     audit: the fresh run overwrote them, --resume=auto started at step 1 and pruned them).
    copied = os.path.join(w, "ck-copied")
    os.makedirs(copied)
    for name in before:
        if name.endswith(".pt"):
            shutil.copy(os.path.join(ck, name), copied)
    kept = sorted(os.listdir(copied))
    out = train(args, "train_mlp", 1, common + ["--steps=4", f"--save_dir={copied}"], "fresh-copied", expect_status=2)
    assert "without their checksum records" in out and "copy the .crc files too" in out, out
    out = train(args, "train_mlp", 1, common + ["--steps=4", f"--save_dir={copied}", "--resume=auto"], "auto-copied",
                expect_status=2)
    assert "none of them is good" in out, out
    assert sorted(n for n in os.listdir(copied) if not n.startswith(".")) == kept, \
        "a refused run changed the copied checkpoints (its lock file aside)"
    corrupt = os.path.join(w, "ck-corrupt")
    shutil.copytree(ck, corrupt)
    for name in os.listdir(corrupt):
        if re.fullmatch(r"step-\d+\.pt", name):
            with open(os.path.join(corrupt, name), "r+b") as f:
                f.truncate(100)
    out = train(args, "train_mlp", 1, common + ["--steps=4", f"--save_dir={corrupt}", "--resume=auto"], "auto-corrupt",
                expect_status=2)
    assert "none of them is good" in out and "--resume=no --save_dir_exists=overwrite" in out, out
    print("ok: checkpoints without records, or all corrupt, are neither overwritten nor restarted beside")
    # 3c. A corrupt newest checkpoint is set aside on resume, so --keep_last keeps good ones (a
    #     user audit: it kept the corrupt step 9 and deleted the good older ones).
    kl = os.path.join(w, "ck-keep")
    train(args, "train_mlp", 1, common + ["--steps=9", "--save_every=3", "--keep_last=2", f"--save_dir={kl}"], "kl-first")
    with open(os.path.join(kl, "step-000009.pt"), "r+b") as f:
        f.truncate(100)
    train(args, "train_mlp", 1, common + ["--steps=12", "--save_every=4", "--keep_last=2", f"--save_dir={kl}",
                                          "--resume=auto"], "kl-resumed")
    names = sorted(os.listdir(kl))
    good = [n for n in names if re.fullmatch(r"step-\d+\.pt", n)]
    assert good == ["step-000008.pt", "step-000012.pt"], names
    assert "step-000009.pt.bad" in names, names
    print("ok: a corrupt newest checkpoint is set aside (*.bad) and --keep_last keeps the good ones")
    # 3d. A resume with another schedule or optimizer is said (its learning rate follows the new
    #     curve from the saved step): a user audit saw a cosine rate jump from 5e-5 to 6.4e-4.
    out = train(args, "train_mlp", 1, common + ["--steps=20", "--schedule=cosine", "--save_every=4", "--keep_last=2",
                                                f"--save_dir={kl}", "--resume=auto"], "kl-rescheduled", output=True)
    assert "was trained with schedule constant" in out and "this run has cosine" in out, out
    assert "was trained with optimizer" not in out, out
    print("ok: a resume with another schedule is warned")
    # 3e. The memory report of one rank: its gradients (freed after each update) are counted as
    #     gradients, not activations, and the step's peak is that step's own, not an earlier
    #     step's (a user audit: gradients 0.0; step 2's pruning peak reported after step 5).
    def report(extra):
        out = train(args, "train_mlp", 1, ["--hidden=512", "--steps=5", "--memory_report_step=5"] + extra,
                    "memreport", output=True, env={"GLOG_minloglevel": "0"})
        rows = {}
        for line in out.splitlines():
            m = re.match(r"\s+(gradients|activations \(step peak - step start\)|= allocated at the step's peak)\s+([0-9.]+)",
                         line)
            if m:
                rows[m.group(1)] = float(m.group(2))
        assert len(rows) == 3, out
        return rows, out
    plain, out = report([])
    assert plain["gradients"] > 0 and "freed after its update" in out, out
    pruned, out = report(["--prune_amount=0.5", "--prune_scope=global", "--prune_at_step=2"])
    # The masks stay (other), but step 5's activations are its own: as without pruning (step 2's
    # pruning temporaries made them 0.3 -> 5+ MiB before).
    act = "activations (step peak - step start)"
    assert abs(pruned[act] - plain[act]) <= 0.1 + 0.05 * plain[act], (plain, pruned)
    print(f"ok: one rank's report counts {plain['gradients']:.1f} MiB of gradients; step 5's activations "
          f"{pruned[act]:.1f} MiB with pruning at step 2, {plain[act]:.1f} without")
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
