"""Hugging Face transformers' Llama on the cases of tests/unit/llama_test.cc, in float64.

Usage: llama_reference.py DIR CASE [CASE ...]
For each CASE, reads DIR/CASE/config.json (a Hugging Face config.json), DIR/CASE/weights.safetensors
(every tensor of the model's state dict under transformers' names) and DIR/CASE/tokens.safetensors
("tokens": int64 [B, T + 1] windows: inputs w[:, :T], targets w[:, 1:]); builds
transformers.LlamaForCausalLM(LlamaConfig(...)) from the config (nothing is downloaded), in
float64, loads the weights strictly, and for each attention implementation IMPL of "sdpa" and
"eager" writes DIR/CASE/IMPL.safetensors with
  logits       [B, T, vocab]   the model's logits on the inputs,
  loss         [1]             the mean next-token cross-entropy, in float64 (transformers' own
                               loss_function casts the logits to float32, so it is computed
                               here with torch.nn.functional.cross_entropy on the logits),
  grad.<name>  every state-dict tensor's gradient of that loss (tied names: the shared one's),
  rope.cos, rope.sin [T, head_dim]  the rotary tables the model used (float32, as computed),
and prints {"transformers": version, "parameters": {CASE: sum of the model's parameters' numel}}.
Eager attention computes its softmax in float32 even in a float64 model (transformers'
eager_attention_forward), so its results agree with float64 arithmetic to about 1e-7 only;
sdpa keeps float64 throughout.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def run(case_dir, impl):
    with open(os.path.join(case_dir, "config.json")) as f:
        config = LlamaConfig(**json.load(f), attn_implementation=impl)
    model = LlamaForCausalLM(config).to(torch.float64)
    state = load_file(os.path.join(case_dir, "weights.safetensors"))
    model.load_state_dict(state, strict=True)
    windows = load_file(os.path.join(case_dir, "tokens.safetensors"))["tokens"]
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for name in state:
        out["grad." + name] = model.get_parameter(name).grad.detach().clone()
    positions = torch.arange(inputs.size(1)).unsqueeze(0)
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    out["rope.cos"], out["rope.sin"] = cos[0].contiguous(), sin[0].contiguous()
    save_file(out, os.path.join(case_dir, impl + ".safetensors"))
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def main():
    torch.set_num_threads(1)
    directory, cases = sys.argv[1], sys.argv[2:]
    counts = {}
    for case in cases:
        for impl in ("sdpa", "eager"):
            counts[case] = run(os.path.join(directory, case), impl)
    print(json.dumps({"transformers": __import__("transformers").__version__, "parameters": counts}))


if __name__ == "__main__":
    main()
