"""Hugging Face transformers' GPT-2 for tests/unit/gpt2_hf_test.cc, in float64.

Usage: gpt2_reference.py DIR
  * DIR/dtrain: a checkpoint dtrain wrote (save_hf_weights: config.json, model.safetensors) ->
    GPT2LMHeadModel.from_pretrained loads it and writes DIR/dtrain_logits.safetensors ("logits" on
    DIR/tokens.safetensors' "tokens");
  * DIR/hf: a GPT2LMHeadModel made here from DIR/hf_config.json with random weights (seed 0),
    saved with save_pretrained, and its logits on the same tokens in DIR/hf_logits.safetensors.
Nothing is downloaded; sdpa attention (float64 throughout).
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def logits_of(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.contiguous()


def main():
    torch.set_num_threads(1)
    d = sys.argv[1]
    tokens = load_file(os.path.join(d, "tokens.safetensors"))["tokens"]
    ours = GPT2LMHeadModel.from_pretrained(os.path.join(d, "dtrain"), torch_dtype=torch.float64,
                                           attn_implementation="sdpa").eval()
    save_file({"logits": logits_of(ours, tokens)}, os.path.join(d, "dtrain_logits.safetensors"))
    with open(os.path.join(d, "hf_config.json")) as f:
        config = GPT2Config(**json.load(f), attn_implementation="sdpa")
    torch.manual_seed(0)
    theirs = GPT2LMHeadModel(config).to(torch.float64).eval()
    theirs.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
    save_file({"logits": logits_of(theirs, tokens)}, os.path.join(d, "hf_logits.safetensors"))
    print(json.dumps({"parameters": sum(p.numel() for p in theirs.parameters())}))


if __name__ == "__main__":
    main()
