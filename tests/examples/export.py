#!/usr/bin/env python3
"""dtrain-export: every example model, trained for a few steps, exported from its checkpoint.

For mlp, cnn, seq2seq and gpt (and a GPT trained with --tp 2 on two ranks):
  * the TorchScript archive, loaded by torch.jit.load in a fresh Python process that imports
    no dtrain code, reproduces dtrain's own forward on the example inputs dtrain-export wrote
    (within 1e-5, float32), and on a batch one row larger; dtrain-export itself checked the
    same through C++ torch::jit::load;
  * the safetensors file, read by safetensors.torch.load_file, equals the checkpoint's weights
    (torch.load of its main file) exactly, name by name, and the archive's parameters;
  * bad input exits non-zero with a message naming the problem and leaves no file behind: shape
    flags that disagree with the checkpoint, an output directory that does not exist or is a
    file, an unknown format, a directory without checkpoints.

usage: export.py --bin BUILD/bin --mpirun "mpirun ..." (run with the Python that has torch and safetensors)
"""
import os
import shlex
import sys
import tempfile

from example_util import example_parser, newest_main_file, run

SHAPES = {
    "mlp": ("train_mlp", ["--hidden=32", "--depth=2", "--data=synthetic"]),
    "cnn": ("train_cnn", ["--hidden=32", "--data=synthetic"]),
    "seq2seq": ("train_seq2seq", ["--d_model=32", "--heads=4", "--ff=64", "--layers=1", "--seq_len=8", "--vocab=260"]),
    "gpt": ("train_gpt", ["--d_model=32", "--heads=4", "--ff=64", "--layers=2", "--seq_len=8", "--vocab=50"]),
}

# Runs in a fresh interpreter: only torch and safetensors, no dtrain code on the path.
CHECK = r"""
import sys, torch
from safetensors.torch import load_file
archive, example, weights, ckpt = sys.argv[1:5]
m = torch.jit.load(archive)
ex = load_file(example)
inputs = [ex[f"input.{i}"] for i in range(len(ex) - 1)]
with torch.no_grad():
    out = m(*inputs)
want = ex["output"]
scale = max(1.0, want.abs().max().item())
diff = (out.double() - want.double()).abs().max().item()
assert out.shape == want.shape, (out.shape, want.shape)
assert diff <= 1e-5 * scale, f"archive output differs by {diff}"
w = load_file(weights)
state = ckpt and torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
if state:
    assert list(w) == list(state) or set(w) == set(state), (sorted(w), sorted(state))
    for name, t in state.items():
        assert w[name].dtype == t.dtype and torch.equal(w[name], t), f"{name} differs from the checkpoint"
# Another batch size: the archive is specialized to the example's sequence length, not its batch.
more = [torch.cat([t, t[:1]]) for t in inputs]
with torch.no_grad():
    bigger = m(*more)
assert bigger.shape[0] == want.shape[0] + 1, bigger.shape
assert (bigger[:-1].double() - want.double()).abs().max().item() <= 1e-5 * scale, "batch + 1 changes the rows"
params = dict(m.named_parameters())
params.update(dict(m.named_buffers()))
for name, t in w.items():
    assert name in params and torch.equal(params[name], t), f"{name}: archive and safetensors differ"
print(f"ok: {len(w)} tensors equal" + (" the checkpoint's" if state else "") + f", archive output within {diff:.1e}"
      + f", also for a batch of {bigger.shape[0]}")
"""




def export_and_check(args, work, name, model, shape, ck, ranks_note=""):
    exe = os.path.join(args.bin, "dtrain-export")
    base = [exe, f"--model={model}", *shape, f"--checkpoint={ck}"]
    pt, ex, st = (os.path.join(work, name + s) for s in (".pt", "-example.safetensors", ".safetensors"))
    out = run(base + ["--format=torchscript", f"--output={pt}", f"--write_example={ex}", "--example_rows=3"])
    assert "torch::jit::load reproduces the module" in out, out
    run(base + ["--format=safetensors", f"--output={st}"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = run([args.python, "-I", "-c", CHECK, pt, ex, st, newest_main_file(ck)], env=env)
    print(f"ok: {name}{ranks_note}: {got.strip().splitlines()[-1]}")


def main():
    ap = example_parser()
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for model, (program, shape) in SHAPES.items():
            ck = os.path.join(work, "ck-" + model)
            run([os.path.join(args.bin, program), "--device=cpu", "--steps=3", "--batch_size=8", "--progress=false",
                 f"--save_dir={ck}", *shape])
            export_and_check(args, work, model, model, shape, ck)
        # A GPT trained with --tp 2: its checkpoint is gathered into the unsplit model.
        program, shape = SHAPES["gpt"]
        ck = os.path.join(work, "ck-gpt-tp2")
        run(shlex.split(args.mpirun) + ["-np", "2", os.path.join(args.bin, program), "--device=cpu", "--steps=3",
                                        "--batch_size=8", "--tp=2", "--progress=false", f"--save_dir={ck}", *shape])
        export_and_check(args, work, "gpt-tp2", "gpt", shape, ck, " (trained with --tp 2)")

        # Bad input: a clear message, a non-zero exit, nothing written.
        exe = os.path.join(args.bin, "dtrain-export")
        ck = os.path.join(work, "ck-gpt")
        gpt = [exe, "--model=gpt", *shape, f"--checkpoint={ck}"]
        before = set(os.listdir(work))
        cases = [
            (gpt[:2] + ["--d_model=64", "--heads=4", "--ff=64", "--layers=2", "--seq_len=8", "--vocab=50",
                        f"--checkpoint={ck}", f"--output={work}/wrong.pt"], "cannot resume from"),
            (gpt + [f"--output={work}/missing/gpt.pt"], "does not exist; create it"),
            (gpt + [f"--output={work}/gpt.pt/inside.pt"], "is not a directory"),
            (gpt + [f"--output={work}"], "is a directory"),
            (gpt + ["--format=onnx", f"--output={work}/x.onnx"], "--format=onnx is not one of: torchscript, safetensors, hf"),
            (gpt + ["--quantize=int8", f"--output={work}/q.pt"], "the int8 model is exported as safetensors"),
            (gpt + ["--steps=5", f"--output={work}/s.pt"], "steps"),  # export takes no training flags
            ([exe, "--model=gpt", *shape, f"--checkpoint={work}/empty", f"--output={work}/y.pt"], "holds no good checkpoint; point it at a training run's --save_dir"),
            ([exe, "--model=resnet", f"--checkpoint={ck}", f"--output={work}/z.pt"], "is not one of: seq2seq, gpt, llama, mlp, cnn"),
        ]
        os.makedirs(os.path.join(work, "empty"))
        before.add("empty")
        for cmd, message in cases:
            out = run(cmd, expect=1)
            assert message in out, f"expected '{message}' in the output"
            print(f"ok: refused with '{message}'")
        left = set(os.listdir(work)) - before
        assert not left, f"failed exports left files behind: {sorted(left)}"
        print("ok: no file left behind by the failed exports")


if __name__ == "__main__":
    main()
