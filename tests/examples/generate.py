#!/usr/bin/env python3
"""dtrain-generate against Hugging Face transformers' generate.

  * A tiny LlamaForCausalLM (grouped-query attention, Llama 3.1 rope scaling) made by transformers
    and saved with save_pretrained: dtrain-generate --init_from_hf --temperature=0 prints exactly
    the tokens of transformers' greedy generate (float32; the model's seed is chosen so that no
    step's two most likely tokens are within 1e-3 of each other), for two prompts, at 1 rank and
    at --tp 2 under mpirun, with the key/value cache and recomputing the sequence.
  * Sampling: the same --seed gives the same tokens, another seed others; --top_k=1 is greedy.
  * A train_gpt --model=llama checkpoint (--checkpoint): greedy tokens at 1 rank and --tp 2 equal
    transformers' on the same weights (exported with dtrain-export --format=hf; float64).
  * --model=gpt: a transformers-made GPT2LMHeadModel (--init_from_hf) and a train_gpt --model=gpt
    checkpoint give transformers' greedy tokens, at 1 rank and --tp 2, cached and recomputing.
  * Text (--tokenizer, a SentencePiece model Python's sentencepiece trained): --prompt's ids are
    Python's encoding after the BOS, the new ids transformers' greedy generate of them (ending
    at the tokenizer's EOS), and the printed text Python's decoding of both (--output=text and
    jsonl; a --prompt_file of text lines; at --tp 2 under mpirun too).
  * Bad input exits non-zero naming the problem: shape flags other than the checkpoint's record
    (a larger --vocab, --tie_embeddings, --rope_theta), no weights, both sources, a prompt token beyond
    the vocabulary, --max_new_tokens beyond the positions, --model=gpt, ranks other than --tp,
    a text prompt or --output=text without a tokenizer, a tokenizer larger than the vocabulary.

usage: generate.py --bin BUILD/bin --mpirun "mpirun ..." --python PYTHON
"""
import json
import os

from example_util import json_lines, python_example_args, run, stdout_of

VOCAB, NEW = 96, 8
PROMPTS = [[5, 17, 33, 2, 90, 41], [60, 3, 3, 71, 12, 8]]

# Runs with the .venv's Python (torch, transformers); no dtrain code. argv: the directory to save
# into, the prompts (JSON), the new tokens. The model of the first seed whose greedy steps all have
# a clear winner is saved. Prints {"seed", "tokens": new tokens per prompt, "margin": the smallest
# gap between a step's two largest logits}. MAKE_MODEL (below) defines make_model().
MAKE_LOOP = r"""
import json, os, sys, torch
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
hf_dir, prompts, new = sys.argv[1], torch.tensor(json.loads(sys.argv[2])), int(sys.argv[3])
for seed in range(20):
    torch.manual_seed(seed)
    model = make_model().float().eval()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    margin = min((s.topk(2, dim=-1).values[:, 0] - s.topk(2, dim=-1).values[:, 1]).min().item() for s in out.scores)
    if margin > 1e-3:
        break
model.save_pretrained(hf_dir, safe_serialization=True)
print(json.dumps({"seed": seed, "margin": margin, "tokens": out.sequences[:, prompts.shape[1]:].tolist()}))
"""

# A LlamaForCausalLM with grouped-query attention and Llama 3.1 rope scaling.
MAKE = r"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def make_model():
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg)
""" + MAKE_LOOP

# A GPT2LMHeadModel (learned positions, GELU tanh, layer norms with weights and biases drawn).
MAKE_GPT2 = r"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel
def make_model():
    cfg = GPT2Config(vocab_size=96, n_embd=32, n_head=4, n_layer=2, n_positions=64, n_inner=64,
                     initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for ln in [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]:
            ln.weight.normal_(1.0, 0.2)
            ln.bias.normal_(0.0, 0.2)
    return model
""" + MAKE_LOOP

# Transformers' greedy tokens of a from_pretrained directory (a Llama's or a GPT-2's), in float64.
GREEDY = r"""
import json, os, sys, torch
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float64).eval()
prompts, new = torch.tensor(json.loads(sys.argv[2])), int(sys.argv[3])
with torch.no_grad():
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, eos_token_id=None, pad_token_id=0)
print(json.dumps({"tokens": out[:, prompts.shape[1]:].tolist()}))
"""


# A SentencePiece BPE model trained on licence text, a tiny Llama of its vocabulary (the seed
# chosen for a clear greedy margin, as MAKE), and transformers' greedy continuation of each text
# prompt (Python's encoding after the BOS), cut after the tokenizer's EOS as generate stops there,
# alone and in one left-padded batch. argv: the directory, the prompts (JSON), the new tokens.
# Prints {"tokenizer", "hf", "prompt_ids", "tokens", "batched", "texts": Python's decoding of
# prompt and new ids together, "margin"}.
MAKE_TEXT = r"""
import glob, json, os, sys, torch
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
import sentencepiece as spm
from transformers import LlamaConfig, LlamaForCausalLM
out, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
lines = [l.strip() for n in ("GPL-3", "Apache-2.0") for l in open("/usr/share/common-licenses/" + n) if l.strip()]
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=out + "/tok", vocab_size=400,
                               model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                               shuffle_input_sentence=False, input_sentence_size=0, minloglevel=2,
                               byte_fallback=True)  # byte pieces: characters that take several tokens
sp = spm.SentencePieceProcessor(model_file=out + "/tok.model")
ids = [[sp.bos_id()] + sp.encode(p) for p in prompts]
for seed in range(40):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=sp.get_piece_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).float().eval()
    tokens, margin = [], 1.0
    with torch.no_grad():
        for p in ids:
            t = torch.tensor([p])
            g = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=new,
                               eos_token_id=sp.eos_id(), pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            margin = min([margin] + [(s.topk(2, dim=-1).values[:, 0] - s.topk(2, dim=-1).values[:, 1]).min().item()
                                     for s in g.scores])
            tokens.append(g.sequences[0, len(p):].tolist())
    if margin > 1e-3:
        break
model.save_pretrained(out + "/hf", safe_serialization=True)
# The same model with its vocabulary padded 24 ids past the tokenizer's pieces, the head's extra
# rows large, so that an unrestricted draw picks them.
wide_cfg = LlamaConfig(**dict(cfg.to_dict(), vocab_size=cfg.vocab_size + 24))
wide = LlamaForCausalLM(wide_cfg).float().eval()
with torch.no_grad():
    for (name, w), (_, src) in zip(wide.named_parameters(), model.named_parameters()):
        w.zero_()
        w[tuple(slice(0, n) for n in src.shape)] = src
    wide.lm_head.weight[cfg.vocab_size:] = 5 * torch.randn(24, cfg.hidden_size)
wide.save_pretrained(out + "/hf_wide", safe_serialization=True)
# The prompts in one left-padded batch, as transformers batches prompts of unequal length.
L = max(len(p) for p in ids)
padded = torch.tensor([[0] * (L - len(p)) + p for p in ids])
mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ids])
with torch.no_grad():
    g = model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=sp.eos_id(),
                       pad_token_id=0)
batched = [row[L:].tolist() for row in g]
batched = [r[:r.index(sp.eos_id()) + 1] if sp.eos_id() in r else r for r in batched]
print(json.dumps({"tokenizer": out + "/tok.model", "hf": out + "/hf", "prompt_ids": ids, "tokens": tokens,
                  "batched": batched, "margin": margin, "texts": [sp.decode(p + t) for p, t in zip(ids, tokens)]}))
"""
TEXT_PROMPTS = ["Everyone is permitted to copy", "The GNU General Public License is a free"]


def last_json(out):
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def token_lines(out):
    """The token-id lines of dtrain-generate's output."""
    return [[int(t) for t in line.split(",")] for line in out.splitlines()
            if line and all(c.isdigit() or c == "," for c in line)]


def generate(mpirun, ranks, binary, args, expect=0):
    cmd = mpirun + ["-np", str(ranks), binary] if ranks > 1 else [binary]
    return run(cmd + ["--device=cpu"] + args, expect=expect)


def make_hf(args, script, hf, what):
    """Runs a MAKE script into the directory hf; its JSON (seed, margin, greedy tokens)."""
    made = last_json(run([args.python, "-c", script, hf, json.dumps(PROMPTS), str(NEW)]))
    print(f"transformers' {what} greedy tokens (model seed {made['seed']}, smallest top-2 gap "
          f"{made['margin']:.2e}): {made['tokens']}")
    return made


def check_hf(args, mpirun, tmp, gen):
    hf = os.path.join(tmp, "hf")
    made = make_hf(args, MAKE, hf, "Llama")
    prompt_file = os.path.join(tmp, "prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n".join(",".join(map(str, p)) for p in PROMPTS) + "\n")
    source = [f"--init_from_hf={hf}", f"--hf_config={hf}/config.json", f"--max_new_tokens={NEW}", "--temperature=0"]
    for ranks, extra in ((1, []), (2, ["--tp=2"]), (1, ["--use_cache=false"]), (2, ["--tp=2", "--use_cache=false"])):
        out = generate(mpirun, ranks, gen, source + [f"--prompt_file={prompt_file}"] + extra)
        assert token_lines(out) == made["tokens"], f"np {ranks} {extra}: {token_lines(out)} != {made['tokens']}"
        assert "tokens/s" in out
    out = generate(mpirun, 1, gen, source + ["--prompt_tokens=" + ",".join(map(str, PROMPTS[1]))])
    assert token_lines(out) == [made["tokens"][1]], "--prompt_tokens"
    return hf, source


def check_sampling(mpirun, gen, hf):
    sampled = [f"--init_from_hf={hf}", f"--hf_config={hf}/config.json", "--prompt_tokens=5,17,33", "--batch=3",
               "--max_new_tokens=12", "--temperature=1.5", "--top_p=0.95"]
    a = token_lines(generate(mpirun, 1, gen, sampled + ["--seed=3"]))
    assert len(a) == 3 and all(len(r) == 12 for r in a), a
    assert token_lines(generate(mpirun, 1, gen, sampled + ["--seed=3"])) == a, "the same seed, other tokens"
    assert token_lines(generate(mpirun, 1, gen, sampled + ["--seed=4"])) != a, "another seed, the same tokens"
    assert len({tuple(r) for r in a}) > 1, "the rows of a batch drew alike"
    t2 = token_lines(generate(mpirun, 2, gen, sampled + ["--seed=3", "--tp=2"]))
    assert len(t2) == 3 and t2 == token_lines(generate(mpirun, 2, gen, sampled + ["--seed=3", "--tp=2"]))
    greedy = token_lines(generate(mpirun, 1, gen, sampled[:4] + ["--max_new_tokens=12", "--temperature=0"]))
    top1 = token_lines(generate(mpirun, 1, gen, sampled[:4] + ["--max_new_tokens=12", "--top_k=1", "--seed=9"]))
    assert top1 == greedy, "top_k=1 is not greedy"


def check_checkpoint(args, mpirun, tmp, gen, model="llama"):
    shape = ["--model=llama", f"--vocab={VOCAB}", "--d_model=32", "--heads=4", "--kv_heads=2", "--layers=2",
             "--ff=48", "--seq_len=16"]
    if model == "gpt":
        shape = ["--model=gpt", f"--vocab={VOCAB}", "--d_model=32", "--heads=4", "--layers=2", "--ff=64",
                 "--seq_len=16"]
    ck, out_dir = os.path.join(tmp, "ck_" + model), os.path.join(tmp, "export_" + model)
    os.makedirs(out_dir)
    run([os.path.join(args.bin, "train_gpt")] + shape + ["--device=cpu", "--data=synthetic", "--batch_size=4",
                                                         "--steps=4", "--lr=0.02", f"--save_dir={ck}",
                                                         "--progress=false"])
    run([os.path.join(args.bin, "dtrain-export")] + shape + [f"--checkpoint={ck}", "--format=hf", f"--output={out_dir}"])
    prompts = [p[:4] for p in PROMPTS]
    want = last_json(run([args.python, "-c", GREEDY, out_dir, json.dumps(prompts), str(NEW)]))["tokens"]
    for ranks, extra in ((1, []), (2, ["--tp=2"])):
        got = [token_lines(generate(mpirun, ranks, gen, shape + extra + [
            f"--checkpoint={ck}", "--prompt_tokens=" + ",".join(map(str, p)), f"--max_new_tokens={NEW}",
            "--temperature=0", "--dtype=float64"]))[0] for p in prompts]
        assert got == want, f"{model} from the checkpoint, np {ranks}: {got} != transformers' {want}"
    return shape, ck


def check_gpt(args, mpirun, tmp, gen):
    hf = os.path.join(tmp, "hf_gpt2")
    made = make_hf(args, MAKE_GPT2, hf, "GPT-2")
    prompt_file = os.path.join(tmp, "prompts.txt")
    source = ["--model=gpt", f"--init_from_hf={hf}", f"--hf_config={hf}/config.json", f"--max_new_tokens={NEW}",
              "--temperature=0", f"--prompt_file={prompt_file}"]
    for ranks, extra in ((1, []), (2, ["--tp=2"]), (1, ["--use_cache=false"])):
        out = generate(mpirun, ranks, gen, source + extra)
        assert token_lines(out) == made["tokens"], f"gpt np {ranks} {extra}: {token_lines(out)} != {made['tokens']}"
    check_checkpoint(args, mpirun, tmp, gen, model="gpt")


def check_text(args, mpirun, tmp, gen):
    text_dir = os.path.join(tmp, "text")
    os.makedirs(text_dir)
    made = last_json(run([args.python, "-c", MAKE_TEXT, text_dir, json.dumps(TEXT_PROMPTS), str(NEW + 4)]))
    print(f"transformers' greedy continuations (smallest top-2 gap {made['margin']:.2e}): {made['texts']}")
    hf, tok = made["hf"], made["tokenizer"]
    source = [f"--init_from_hf={hf}", f"--hf_config={hf}/config.json", f"--tokenizer={tok}",
              f"--max_new_tokens={NEW + 4}", "--temperature=0"]
    for i, prompt in enumerate(TEXT_PROMPTS):
        for ranks, extra in ((1, []), (2, ["--tp=2"])):
            got = json_lines(generate(mpirun, ranks, gen, source + extra + [f"--prompt={prompt}", "--output=jsonl"]))
            assert len(got) == 1, got
            assert got[0]["prompt_ids"] == made["prompt_ids"][i], f"prompt {i}: {got[0]['prompt_ids']}"
            assert got[0]["ids"] == made["tokens"][i], f"prompt {i} np {ranks}: {got[0]['ids']} != {made['tokens'][i]}"
            assert got[0]["text"] == made["texts"][i], f"prompt {i}: {got[0]['text']!r} != {made['texts'][i]!r}"
            assert got[0]["prompt"] == prompt and made["texts"][i] == prompt + got[0]["completion"], got[0]
        # Streamed as the tokens come (the default for one sequence) and printed at the end: the same bytes.
        for stream in ("--stream=true", "--stream=false"):
            text = stdout_of([gen, "--device=cpu"] + source + [f"--prompt={prompt}", stream])
            assert text == made["texts"][i] + "\n", f"--output=text {stream}: {text!r} != {made['texts'][i]!r}"
    # A vocabulary padded past the tokenizer's pieces: the draws stay among the pieces (the same
    # tokens as the unpadded model), where an unrestricted run draws the padding's ids.
    wide = [f"--init_from_hf={hf}_wide", f"--hf_config={hf}_wide/config.json", f"--max_new_tokens={NEW + 4}",
            "--temperature=0"]
    prompt_ids = ",".join(map(str, made["prompt_ids"][0]))
    with open(os.path.join(hf, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    free = token_lines(generate(mpirun, 1, gen, wide + [f"--prompt_tokens={prompt_ids}"]))[0]
    assert max(free) >= vocab, f"the padded head's ids were never drawn: {free}"
    got = json_lines(generate(mpirun, 1, gen, wide + [f"--tokenizer={tok}", f"--prompt={TEXT_PROMPTS[0]}",
                                                      "--output=jsonl"]))
    assert got[0]["ids"] == made["tokens"][0], f"padded vocabulary with a tokenizer: {got[0]['ids']}"
    prompt_file = os.path.join(tmp, "text_prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n  \n" + TEXT_PROMPTS[0] + "\r\n\n")
    got = json_lines(generate(mpirun, 1, gen, source + [f"--prompt_file={prompt_file}", "--output=jsonl"]))
    assert [g["ids"] for g in got] == [made["tokens"][0]], f"--prompt_file of text: {got}"
    # Both prompts (of unequal length) in one run: left-padded, each row continues as it does alone.
    lengths = [len(p) for p in made["prompt_ids"]]
    assert lengths[0] != lengths[1], f"the text prompts should differ in length: {lengths}"
    assert made["batched"] == made["tokens"], f"transformers' left-padded batch {made['batched']} != alone"
    with open(prompt_file, "w") as f:
        f.write("\n".join(TEXT_PROMPTS) + "\n")
    for ranks, extra in ((1, []), (2, ["--tp=2"])):
        got = json_lines(generate(mpirun, ranks, gen, source + extra + [f"--prompt_file={prompt_file}",
                                                                        "--output=jsonl"]))
        assert [g["ids"] for g in got] == made["tokens"], f"np {ranks} left-padded batch: {got}"
        assert [g["prompt_ids"] for g in got] == made["prompt_ids"] and [g["text"] for g in got] == made["texts"]
    out = generate(mpirun, 1, gen, source + [f"--prompt_file={prompt_file}", "--use_cache=false"], expect=2)
    assert "--use_cache=false recomputes without padding" in out
    return source


def check_bad_input(mpirun, gen, hf, source, shape, ck, text_source):
    prompt = ["--prompt_tokens=1,2,3,4"]
    cases = [
        (shape + prompt, "no weights: give --checkpoint=DIR"),
        (shape + prompt + [f"--checkpoint={ck}", f"--init_from_hf={hf}"], "--checkpoint and --init_from_hf both given"),
        (source + [f"--prompt_tokens=1,{VOCAB},3"], f"token {VOCAB} is not below the vocabulary size {VOCAB}"),
        (source + ["--prompt_tokens=1,x,3"], "'x' is not a token id"),
        (shape + prompt + [f"--checkpoint={ck}", "--max_new_tokens=13"],
         "--max_new_tokens=13: the (longest) prompt's 4 tokens and 13 new ones need 17 positions, the model has 16"),
        (["--model=cnn", f"--checkpoint={ck}"] + prompt, "generates with --model=llama or --model=gpt"),
        # Shape flags the checkpoint records otherwise: refused, though the tensors would load
        # (a larger vocabulary zero-padded, a head tied to the embedding, another rotary base).
        (shape + prompt + [f"--checkpoint={ck}", "--max_new_tokens=4", "--vocab=128"], "other shape flags: --vocab=96 (here 128)"),
        (shape + prompt + [f"--checkpoint={ck}", "--max_new_tokens=4", "--tie_embeddings"], "--tie_embeddings=false (here true)"),
        (shape + prompt + [f"--checkpoint={ck}", "--max_new_tokens=4", "--rope_theta=500000"], "--rope_theta=10000 (here 500000)"),
        (source + prompt + ["--top_k=5"], "--temperature=0 is greedy"),
        (source + ["--prompt=Hello"], "--prompt is text: give --tokenizer=tokenizer.model"),
        (source + prompt + ["--output=text"], "--output=text decodes the tokens: give --tokenizer"),
        (source + prompt + ["--bos"], "--bos adds the tokenizer's BOS to a text prompt: give --tokenizer too"),
        (source + ["--prompt=Hello", text_source[2]], f"has 400 pieces, more than the model's vocabulary of {VOCAB}"),
        (text_source + ["--prompt=Hello", "--prompt_tokens=1,2"], "more than one of --prompt, --prompt_tokens"),
        (text_source + ["--prompt=Hello", "--output=xml"], "--output=xml is not one of: auto, ids, text, jsonl"),
        (text_source[:2] + ["--tokenizer=" + hf + "/config.json", "--prompt=Hello"],
         "is a JSON file (a Hugging Face tokenizer.json?), not a SentencePiece model"),
    ]
    for flags, want in cases:
        out = generate(mpirun, 1, gen, flags, expect=2)
        assert want in out, f"wanted {want!r} in the output"
    out = generate(mpirun, 2, gen, source + prompt, expect=2)
    assert "start it with as many ranks as --tp (1), not 2" in out


def main():
    args, mpirun, tmp = python_example_args("generate")
    gen = os.path.join(args.bin, "dtrain-generate")
    hf, source = check_hf(args, mpirun, tmp, gen)
    check_sampling(mpirun, gen, hf)
    shape, ck = check_checkpoint(args, mpirun, tmp, gen)
    check_gpt(args, mpirun, tmp, gen)
    text_source = check_text(args, mpirun, tmp, gen)
    check_bad_input(mpirun, gen, hf, source, shape, ck, text_source)
    print("OK")


if __name__ == "__main__":
    main()
