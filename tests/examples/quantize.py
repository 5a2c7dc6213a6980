#!/usr/bin/env python3
"""Dynamic int8 quantization (--quantize=int8) against PyTorch's quantize_dynamic.

  * The same weights: an MLP trained by dtrain is exported with dtrain-export --quantize=int8
    (safetensors: int8 weights and scales) and rebuilt in Python from the checkpoint
    (torch.load), then quantized by torch.ao.quantization.quantize_dynamic with the matching
    qconfig (per-channel: per_channel_dynamic_qconfig; per-tensor: default_dynamic_qconfig).
    The int8 values must be identical, the scales equal, and dtrain's int8 output on the example
    inputs equal to the Python quantized module's within 1e-5 (they run the same FBGEMM kernel).
  * A GPT trained with --tp 2 on two ranks: every Linear weight of the gathered model is
    quantized exactly as PyTorch's weight observer quantizes the checkpoint's weight, and the
    embeddings and norms stay float32.
  * Held-out data: --eval_only --resume --quantize=int8 on mlp, cnn and gpt reports the float32
    and int8 eval losses of the same batches; they agree within TOLERANCE (relative), and the
    quantized weights are about 4x smaller.
  * Bad input: a clear message, a non-zero exit, nothing written.

usage: quantize.py --bin BUILD/bin --mpirun "mpirun ..." (run with the Python that has torch and safetensors)
"""
import os
import re
import shlex
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

from example_util import example_parser, newest_main_file, run

# Relative change of the eval loss allowed for int8 (measured: docs/BENCHMARKS.md).
TOLERANCE = 0.03




def python_mlp(state, depth):
    layers = []
    for d in range(depth + 1):
        w = state[f"{2 * d}.weight"]
        layers.append(nn.Linear(w.shape[1], w.shape[0]))
        if d < depth:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    model.load_state_dict(state)
    return model.eval()


def check_mlp_against_torch(args, work, ck, depth):
    exe = os.path.join(args.bin, "dtrain-export")
    state = torch.load(newest_main_file(ck), map_location="cpu", weights_only=True)["model"]
    for scales, qconfig in (("channel", per_channel_dynamic_qconfig), ("tensor", default_dynamic_qconfig)):
        out_file, ex_file = os.path.join(work, f"mlp-{scales}.safetensors"), os.path.join(work, f"mlp-{scales}-ex.safetensors")
        run([exe, "--model=mlp", f"--depth={depth}", "--hidden=64", f"--checkpoint={ck}", "--format=safetensors",
             "--quantize=int8", f"--quantize_scales={scales}", f"--output={out_file}", f"--write_example={ex_file}",
             "--example_rows=32"])
        got, ex = load_file(out_file), load_file(ex_file)
        meta = safe_open(out_file, "pt").metadata()
        assert meta["dtrain_quantize"].startswith("int8"), meta
        ref = quantize_dynamic(python_mlp(state, depth), {nn.Linear: qconfig}, dtype=torch.qint8)
        for i, layer in enumerate(ref):
            if not hasattr(layer, "weight") or not callable(layer.weight):
                continue
            qw = layer.weight()
            name = f"{i}.weight"
            assert got[name].dtype == torch.int8, got[name].dtype
            assert torch.equal(got[name], qw.int_repr()), f"{scales}: {name}: int8 values differ from quantize_dynamic's"
            want_scale = qw.q_per_channel_scales() if scales == "channel" else torch.tensor([qw.q_scale()])
            assert torch.equal(got[name + "_scale"], want_scale.float()), f"{scales}: {name}: scales differ"
            assert torch.equal(got[f"{i}.bias"], state[f"{i}.bias"]), f"{i}.bias changed"
        with torch.no_grad():
            want = ref(ex["input.0"])
        diff = (want - ex["output"]).abs().max().item()
        bound = 1e-5 * max(1.0, want.abs().max().item())
        assert diff <= bound, f"{scales}: dtrain's int8 output differs from quantize_dynamic's by {diff}"
        print(f"ok: mlp {scales} scales: int8 weights identical to quantize_dynamic's, output within {diff:.1e}")


def check_gpt_weights(args, work, ck, shape):
    exe = os.path.join(args.bin, "dtrain-export")
    state = torch.load(newest_main_file(ck), map_location="cpu", weights_only=True)["model"]
    for scales in ("channel", "tensor"):
        out_file = os.path.join(work, f"gpt-{scales}.safetensors")
        run([exe, "--model=gpt", *shape, f"--checkpoint={ck}", "--format=safetensors", "--quantize=int8",
             f"--quantize_scales={scales}", f"--output={out_file}"])
        got = load_file(out_file)
        layers = safe_open(out_file, "pt").metadata()["dtrain_quantized_layers"].split(",")
        linear = {n[: -len(".weight")] for n, t in state.items()
                  if n.endswith(".weight") and t.dim() == 2 and "wte" not in n and "wpe" not in n}
        assert set(layers) == linear, f"quantized {sorted(layers)}, the Linear layers are {sorted(linear)}"
        for name, t in state.items():
            if name[: -len(".weight")] in linear and name.endswith(".weight"):
                if scales == "channel":
                    obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
                else:
                    obs = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
                obs(t)
                s, z = obs.calculate_qparams()
                q = (torch.quantize_per_channel(t, s.double(), z.long(), 0, torch.qint8) if scales == "channel"
                     else torch.quantize_per_tensor(t, float(s), int(z), torch.qint8))
                assert torch.equal(got[name], q.int_repr()), f"{name}: int8 values differ from the observer's"
                assert torch.equal(got[name + "_scale"], s.float().reshape(-1)), f"{name}: scales differ"
            else:
                assert torch.equal(got[name], t), f"{name} is not a Linear weight and must stay as it was"
        print(f"ok: gpt (trained with --tp 2) {scales} scales: {len(linear)} Linear weights quantized as PyTorch's "
              f"observer quantizes them; {len(state) - len(linear)} other tensors unchanged")


def check_eval(args, program, flags, ck):
    out = run([os.path.join(args.bin, program), "--device=cpu", "--eval_only", "--resume", f"--save_dir={ck}",
               "--quantize=int8", "--eval_samples=64", "--progress=false", *flags])
    losses = [float(x) for x in re.findall(r"evaluated 64 held-out samples \([0-9]+ batches per rank\) under no_grad[^:]*: loss ([0-9.]+)", out)]
    assert len(losses) == 2, out
    m = re.search(r"weights ([0-9.]+) MB -> ([0-9.]+) MB \(([0-9.]+)x smaller\)", out)
    assert m, out
    ratio = float(m.group(3))
    assert 3.5 < ratio <= 4.0, f"int8 weights are {ratio}x smaller, expected about 4x"
    rel = abs(losses[1] - losses[0]) / losses[0]
    assert rel <= TOLERANCE, f"{program}: int8 eval loss {losses[1]} vs float32 {losses[0]} ({100 * rel:.2f}%)"
    print(f"ok: {program}: eval loss float32 {losses[0]:.4f}, int8 {losses[1]:.4f} ({100 * rel:.2f}%), "
          f"weights {ratio}x smaller")


def main():
    args = example_parser().parse_args()
    with tempfile.TemporaryDirectory() as work:
        common = ["--device=cpu", "--progress=false"]
        mlp_ck, cnn_ck, gpt_ck = (os.path.join(work, n) for n in ("ck-mlp", "ck-cnn", "ck-gpt"))
        run([os.path.join(args.bin, "train_mlp"), *common, "--steps=120", "--depth=2", "--hidden=64",
             f"--save_dir={mlp_ck}"])
        check_mlp_against_torch(args, work, mlp_ck, depth=2)
        check_eval(args, "train_mlp", ["--depth=2", "--hidden=64"], mlp_ck)

        run([os.path.join(args.bin, "train_cnn"), *common, "--steps=60", "--hidden=64", f"--save_dir={cnn_ck}"])
        check_eval(args, "train_cnn", ["--hidden=64"], cnn_ck)

        shape = ["--d_model=64", "--heads=4", "--ff=128", "--layers=2", "--seq_len=32", "--vocab=256"]
        run(shlex.split(args.mpirun) + ["-np", "2", os.path.join(args.bin, "train_gpt"), *common, "--steps=40",
                                        "--batch_size=8", "--tp=2", "--dropout=0", f"--save_dir={gpt_ck}", *shape])
        check_gpt_weights(args, work, gpt_ck, shape)
        check_eval(args, "train_gpt", shape, gpt_ck)

        # Bad input: a clear message, a non-zero exit, nothing written to the run's directory.
        mlp = [os.path.join(args.bin, "train_mlp"), *common, "--depth=2", "--hidden=64", f"--save_dir={mlp_ck}"]
        before = sorted(os.listdir(mlp_ck))
        cases = [
            (mlp + ["--quantize=int8", "--steps=130", "--resume"], "is for evaluation and export, not training"),
            (mlp + ["--eval_only", "--resume", "--quantize=int4"], "--quantize=int4 is not supported"),
            (mlp + ["--eval_only", "--resume", "--quantize=int8", "--quantize_scales=row"], "--quantize_scales=row is not"),
            (mlp + ["--eval_only", "--resume", "--quantize=int8", "--amp=bf16"], "drop --amp"),
            (mlp + ["--eval_only", "--resume", "--quantize=int8", "--offload=optimizer"], "drop --offload"),
            (mlp + ["--eval_only", "--resume", "--quantize=int8", "--device=cuda"], "use --device=cpu"),
        ]
        for cmd, message in cases:
            out = run(cmd, expect=1)
            assert message in out, f"expected '{message}' in the output"
            print(f"ok: refused with '{message}'")
        assert sorted(os.listdir(mlp_ck)) == before, "a refused run wrote to its --save_dir"
        print("ok: nothing written by the refused runs")


if __name__ == "__main__":
    main()
