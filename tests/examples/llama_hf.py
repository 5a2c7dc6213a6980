#!/usr/bin/env python3
"""train_gpt --model=llama from and to Hugging Face transformers, on llm.c token shards.

  * A LlamaForCausalLM (grouped-query attention, Llama 3.1 rope scaling) made by transformers
    and saved with save_pretrained is loaded by train_gpt --init_from_hf with its config.json as
    --hf_config, at --tp 1 and --tp 2, on 2 pipeline stages, under ZeRO-3 and with layer offload:
    dtrain's held-out loss on an llm.c shard equals the loss transformers computes on the same
    windows (float32).
  * train_gpt trains it for a few steps at tp 2 x dp 2 (4 ranks), resumes at dp 2, and
    dtrain-export --format=hf writes the checkpoint as a Hugging Face directory: from_pretrained
    loads it, its tensors equal the checkpoint's weights, and transformers' loss on the held-out
    windows equals dtrain's evaluation of that checkpoint.
  * The same for --model=gpt and transformers' GPT2LMHeadModel (tied head, Conv1D weights):
    loaded at --tp 2, trained, exported, and transformers' loss on the export equals dtrain's.
  * Bad input exits non-zero naming the problem: a shape flag that disagrees with --hf_config, a
    checkpoint of another shape, a token beyond the vocabulary, a GPT-2 config for --model=llama.

usage: llama_hf.py --bin BUILD/bin --mpirun "mpirun ..." --python PYTHON
"""
import json
import os
import re
import subprocess
import sys

from example_util import newest_main_file, python_example_args, run

S = 16  # --seq_len
VOCAB = 96

# Runs with the .venv's Python (torch, transformers, numpy); no dtrain code.
MAKE = r"""
import sys, json, numpy as np, torch
from transformers import LlamaConfig, LlamaForCausalLM
hf_dir, train_shard, val_shard, S, V = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
model = LlamaForCausalLM(cfg).float()
model.save_pretrained(hf_dir, safe_serialization=True)
def shard(path, tokens):  # llm.c's GPT-2 format: 256 int32 header, uint16 tokens
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())
rng = np.random.default_rng(1)
shard(train_shard, rng.integers(0, V, 40 * S + 1))
shard(val_shard, rng.integers(0, V, 8 * S + 1))
shard(sys.argv[6], [3 if i % S != 2 else V + 4 for i in range(8 * S + 1)])  # a token beyond the vocabulary in each window
"""

# Transformers' mean next-token loss over every window of the held-out shard, with the model in
# argv[1] (a from_pretrained directory); with argv[3], also the exported tensors against the
# checkpoint's (dtrain names mapped).
LOSS = r"""
import sys, numpy as np, torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
S = int(sys.argv[2])
raw = np.fromfile(sys.argv[3], dtype=np.uint16, offset=1024).astype(np.int64)
n = (len(raw) - 1) // S
windows = torch.tensor(np.stack([raw[i * S:i * S + S + 1] for i in range(n)]))
with torch.no_grad():
    logits = model(windows[:, :S]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
print(f"LOSS {loss.item():.6f}")
if len(sys.argv) > 4:
    ckpt = torch.load(sys.argv[4], map_location="cpu", weights_only=True)["model"]
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    inner = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
             "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    state = model.state_dict()
    for name, t in ckpt.items():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            part, leaf = rest.rsplit(".", 1)
            hf = f"model.layers.{i}.{inner[part]}.{leaf}"
        else:
            hf = names[name]
        assert torch.equal(state[hf], t), f"{hf} differs from the checkpoint's {name}"
    assert len(state) == len(ckpt), (sorted(state), sorted(ckpt))
    print("WEIGHTS EQUAL", len(ckpt))
"""


# GPT-2: a GPT2LMHeadModel saved by transformers (argv[1]); with argv[2] "loss", transformers' loss
# of the model in argv[1] on the held-out windows of argv[4] at length argv[3].
GPT2 = r"""
import sys, numpy as np, torch
from transformers import GPT2Config, GPT2LMHeadModel
if sys.argv[2] == "make":
    torch.manual_seed(2)
    cfg = GPT2Config(vocab_size=int(sys.argv[3]), n_embd=32, n_head=4, n_layer=2, n_positions=64)
    GPT2LMHeadModel(cfg).float().save_pretrained(sys.argv[1], safe_serialization=True)
else:
    model = GPT2LMHeadModel.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
    S = int(sys.argv[3])
    raw = np.fromfile(sys.argv[4], dtype=np.uint16, offset=1024).astype(np.int64)
    windows = torch.tensor(np.stack([raw[i * S:i * S + S + 1] for i in range((len(raw) - 1) // S)]))
    with torch.no_grad():
        logits = model(windows[:, :S]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    print(f"LOSS {loss.item():.6f}")
"""


def gpt2_round_trip(args, mpirun, tmp, train, val):
    hf, out_dir, ck = os.path.join(tmp, "gpt2"), os.path.join(tmp, "gpt2_out"), os.path.join(tmp, "gpt2_ck")
    run([args.python, "-c", GPT2, hf, "make", str(VOCAB)])
    os.makedirs(out_dir)
    common = [os.path.join(args.bin, "train_gpt"), "--model=gpt", "--device=cpu", f"--hf_config={hf}/config.json",
              f"--seq_len={S}", "--data=tokens", f"--data_path={train}", f"--eval_data_path={val}", "--batch_size=4",
              "--progress=false", "--eval_samples=0"]
    loss = lambda d: float(re.search(r"LOSS ([0-9.]+)", run([args.python, "-c", GPT2, d, "loss", str(S), val])).group(1))
    want = loss(hf)
    _, got = eval_loss(run(mpirun + ["-np", "2"] + common + [f"--init_from_hf={hf}", "--eval_only", "--tp=2"]))
    assert abs(got - want) <= 2e-4, f"GPT-2 at tp 2: dtrain's loss {got} != transformers' {want}"
    run(mpirun + ["-np", "2"] + common + [f"--init_from_hf={hf}", "--tp=2", "--steps=3", f"--save_dir={ck}",
                                          "--lr=0.01"])
    _, trained = eval_loss(run(common + ["--eval_only", f"--save_dir={ck}", "--resume=yes"]))
    run([os.path.join(args.bin, "dtrain-export"), "--model=gpt", f"--hf_config={hf}/config.json", f"--seq_len={S}",
         f"--checkpoint={ck}", "--format=hf", f"--output={out_dir}"])
    exported = loss(out_dir)
    assert abs(exported - trained) <= 2e-4, f"transformers' loss of the GPT-2 export {exported} != dtrain's {trained}"
    assert abs(trained - want) > 1e-3, "training changed nothing"
    out = run([x.replace("--model=gpt", "--model=llama") for x in common] + ["--eval_only"], expect=2)
    assert "is a GPT-2 config; use --model=gpt" in out


def eval_loss(out):
    m = re.search(r"evaluated (\d+) held-out samples .*: loss ([0-9.]+)", out)
    assert m, "no evaluation line in the output"
    return int(m.group(1)), float(m.group(2))


def hf_loss(python, hf_dir, val, ckpt=None):
    out = run([python, "-c", LOSS, hf_dir, str(S), val] + ([ckpt] if ckpt else []))
    if ckpt:
        assert "WEIGHTS EQUAL" in out
    return float(re.search(r"LOSS ([0-9.]+)", out).group(1))


def main():
    args, mpirun, tmp = python_example_args("llama_hf")
    hf, train, val = os.path.join(tmp, "hf"), os.path.join(tmp, "train.bin"), os.path.join(tmp, "val.bin")
    bad_shard = os.path.join(tmp, "bad.bin")
    run([args.python, "-c", MAKE, hf, train, val, str(S), str(VOCAB), bad_shard])
    config = os.path.join(hf, "config.json")
    gpt = os.path.join(args.bin, "train_gpt")
    common = [gpt, "--model=llama", "--device=cpu", f"--hf_config={config}", f"--seq_len={S}", "--data=tokens",
              f"--data_path={train}", f"--eval_data_path={val}", "--batch_size=4", "--progress=false",
              "--eval_samples=0"]
    want = hf_loss(args.python, hf, val)
    print(f"transformers' held-out loss of the initial model: {want:.6f}")
    # From Hugging Face: the same loss at tp 1, tp 2, on 2 pipeline stages, under ZeRO-3 and with
    # the blocks streamed from host memory.
    for ranks, extra in ((1, []), (2, ["--tp=2"]), (2, ["--pp=2"]), (2, ["--shard=parameters"]),
                         (1, ["--offload=layers", "--checkpoint_activations"])):
        out = run(mpirun + ["-np", str(ranks)] + common + [f"--init_from_hf={hf}", "--eval_only"] + extra)
        n, got = eval_loss(out)
        assert n == 8, f"evaluated {n} windows, the shard has 8"
        assert abs(got - want) <= 2e-4, f"np {ranks} {extra}: dtrain's loss {got} != transformers' {want}"
    # Trained (tp 2 x dp 2 on 4 ranks, then dp 2 resuming it), exported, read back by transformers.
    ck, out_dir = os.path.join(tmp, "ck"), os.path.join(tmp, "out")
    os.makedirs(out_dir)
    run(mpirun + ["-np", "4"] + common + [f"--init_from_hf={hf}", "--tp=2", "--steps=3", f"--save_dir={ck}",
                                          "--lr=0.01"])
    run(mpirun + ["-np", "2"] + common + ["--steps=5", f"--save_dir={ck}", "--resume=yes", "--lr=0.01"])
    out = run(mpirun + ["-np", "1"] + common + ["--eval_only", f"--save_dir={ck}", "--resume=yes"])
    _, trained = eval_loss(out)
    export = os.path.join(args.bin, "dtrain-export")
    run([export, "--model=llama", f"--hf_config={config}", f"--seq_len={S}", f"--checkpoint={ck}", "--format=hf",
         f"--output={out_dir}"])
    with open(os.path.join(out_dir, "config.json")) as f:
        written = json.load(f)
    assert written["num_key_value_heads"] == 2 and written["rope_scaling"]["rope_type"] == "llama3", written
    got = hf_loss(args.python, out_dir, val, newest_main_file(ck))
    assert abs(got - trained) <= 2e-4, f"transformers' loss of the export {got} != dtrain's {trained}"
    assert abs(trained - want) > 1e-3, "training changed nothing"
    # Bad input.
    out = run(common + ["--d_model=64", "--eval_only"], expect=2)
    assert "--d_model=64 disagrees with --hf_config" in out
    bad = os.path.join(tmp, "bad.json")
    with open(config) as f:
        c = json.load(f)
    c["num_hidden_layers"] = 3
    with open(bad, "w") as f:
        json.dump(c, f)
    out = run([x if not x.startswith("--hf_config=") else f"--hf_config={bad}" for x in common]
              + [f"--init_from_hf={hf}", "--eval_only"], expect=1)
    assert "lacks" in out and "model.layers.2." in out, "a checkpoint with fewer layers is refused"
    out = run([x if not x.startswith("--data_path=") else f"--data_path={bad_shard}" for x in common]
              + ["--steps=1"], expect=1)
    assert f"token {VOCAB + 4}" in out and "bad.bin" in out, "a token beyond the vocabulary is refused"
    gpt2_round_trip(args, mpirun, tmp, train, val)
    print("OK")


if __name__ == "__main__":
    main()
