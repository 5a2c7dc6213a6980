"""Hugging Face transformers' greedy generation with small Llama models, for
tests/unit/llama_generate_test.cc.

Usage: llama_generate_reference.py DIR CASE [CASE ...]   (CASE: gqa_llama3, mha_tied)
For each CASE, makes a LlamaForCausalLM of the case's LlamaConfig (nothing is downloaded) with
seeded random weights (initializer_range 0.3, norm weights drawn around 1) in float64, saves it
with save_pretrained into DIR/CASE (config.json, model.safetensors), draws prompts of 2 rows,
runs model.generate(do_sample=False, max_new_tokens=N) (no end-of-sequence token: every row
gets N new tokens) and writes DIR/CASE/generate.json {"prompt": [[ids]], "new_tokens": [[ids]]}.
Prints {"transformers": version, "cases": [CASE, ...]} as JSON.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

NEW_TOKENS = 10
PROMPT = 6


def config_of(case):
    common = dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, rms_norm_eps=1e-5, initializer_range=0.3, hidden_act="silu",
                  attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if case == "gqa_llama3":
        return LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if case == "mha_tied":
        return LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0)
    raise SystemExit(f"unknown case {case}")


def run(directory, case, seed):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config_of(case)).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    out_dir = os.path.join(directory, case)
    model.save_pretrained(out_dir, safe_serialization=True)
    prompt = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                                pad_token_id=0)
    assert tokens.shape == (2, PROMPT + NEW_TOKENS), tokens.shape
    with open(os.path.join(out_dir, "generate.json"), "w") as f:
        json.dump({"prompt": prompt.tolist(), "new_tokens": tokens[:, PROMPT:].tolist()}, f)


def main():
    torch.set_num_threads(1)
    directory, cases = sys.argv[1], sys.argv[2:]
    for i, case in enumerate(cases):
        run(directory, case, 11 + i)
    print(json.dumps({"transformers": __import__("transformers").__version__, "cases": cases}))


if __name__ == "__main__":
    main()
