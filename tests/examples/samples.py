#!/usr/bin/env python3
"""train_gpt --sample_every: samples of the model while it trains.

  * A SentencePiece model (Python's sentencepiece) and dtrain-prepare's shards of the licence
    texts; train_gpt --model=llama with --sample_every logs a sample at each of those steps, and
    its loss curve is the one of the same run without samples, step for step and bit for bit (the
    samples draw from a generator of their own, under no_grad, in eval mode).
  * The last greedy sample is dtrain-generate's greedy continuation of the same prompt from the
    checkpoint saved at that step (the same weights, the same generate()).
  * dtrain-export --format=hf --tokenizer writes the tokenizer beside the weights: transformers'
    AutoTokenizer reads it as sentencepiece encodes (after the BOS), and transformers' greedy
    generate() of the prompt (float64) prints dtrain-generate's text from the checkpoint: the
    vocabulary (448) is padded past the tokenizer's 400 pieces, which generation_config.json's
    suppress_tokens keep transformers from drawing, as dtrain-generate's tokenizer does; and
    dtrain-generate --init_from_hf on the export (its tokenizer.model) prints the same text.
  * Under mpirun: 2 data-parallel ranks log one sample per step (rank 0), and --tp 2 samples too.
  * Refused by name: no --tokenizer, a period that is not a multiple of --log_every, --pp 2.

usage: samples.py --bin BUILD/bin --mpirun "mpirun ..." --python PYTHON
"""
import glob
import json
import os
import re

from example_util import python_example_args, run, stdout_of

PROMPT, NEW = "The license", 12

# Runs with the .venv's Python: the exported directory through transformers alone (argv: the
# directory, the SentencePiece model, the prompt, the new tokens). Checks AutoTokenizer against
# sentencepiece, then prints {"text": the greedy continuation decoded by the same tokenizer}.
HF_TEXT = r"""
import json, os, sys, torch
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
import sentencepiece as spm
from transformers import AutoModelForCausalLM, AutoTokenizer
hf, model_file, prompt, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sp, tok = spm.SentencePieceProcessor(model_file=model_file), AutoTokenizer.from_pretrained(hf)
texts = [prompt, "Hello  world", "  leading and trailing  ", "tab\there", "\ufb01ne \u2460 \uff21\uff22", "x\n    y", ""]
bad = [(t, tok(t).input_ids) for t in texts if tok(t).input_ids != [sp.bos_id()] + sp.encode(t)]
assert not bad, f"AutoTokenizer differs from sentencepiece: {bad}"
model = AutoModelForCausalLM.from_pretrained(hf).double().eval()
ids = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
print(json.dumps({"text": tok.decode(out[0], skip_special_tokens=True), "ids": out[0].tolist()}))
"""

TOKENIZER = r"""
import glob, sys
import sentencepiece as spm
out = sys.argv[1]
spm.SentencePieceTrainer.train(input=sorted(glob.glob(out + "/corpus/*")), model_prefix=out + "/tok", vocab_size=400,
                               model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                               minloglevel=2)
"""


def losses(path):
    with open(path) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def samples(out):
    """(step, new tokens, text) of each sample line."""
    return [(s, int(n), t) for s, n, t in re.findall(r"sample at step (\d+) \((\d+) tokens[^)]*\): (.*)$", out, re.M)]


def main():
    args, mpirun, tmp = python_example_args("samples")
    corpus, shards = os.path.join(tmp, "corpus"), os.path.join(tmp, "shards")
    os.makedirs(corpus)
    os.makedirs(shards)
    for name in ("GPL-3", "Apache-2.0"):
        with open(f"/usr/share/common-licenses/{name}", "rb") as src, open(os.path.join(corpus, name), "wb") as dst:
            dst.write(src.read())
    run([args.python, "-c", TOKENIZER, tmp])
    tok = os.path.join(tmp, "tok.model")
    run([os.path.join(args.bin, "dtrain-prepare"), f"--tokenizer={tok}", f"--input={corpus}", f"--output_dir={shards}",
         "--documents=file", "--eos", "--threads=1"])  # EOS at the two documents' ends only
    shape = ["--model=llama", "--vocab=448", "--d_model=32", "--heads=4", "--kv_heads=2", "--layers=2", "--ff=64",
             "--seq_len=32"]
    train = [os.path.join(args.bin, "train_gpt")] + shape + [
        "--device=cpu", "--data=tokens", f"--data_path={shards}/data_train_*.bin", "--batch_size=8", "--steps=8",
        "--lr=0.003", "--log_every=2", "--seed=3", "--progress=false"]
    sample = [f"--tokenizer={tok}", f"--sample_prompt={PROMPT}", f"--sample_tokens={NEW}"]

    ck, with_metrics, without_metrics = (os.path.join(tmp, n) for n in ("ck", "with.jsonl", "without.jsonl"))
    out = run(train + sample + ["--sample_every=4", "--sample_temperature=0", f"--save_dir={ck}",
                                f"--metrics={with_metrics}"])
    got = samples(out)
    assert [s for s, _, _ in got] == ["4", "8"], f"samples at steps {got}"
    assert all(text.startswith(PROMPT) for _, _, text in got), got
    assert got[-1][1] == NEW, f"the greedy sample ended early (at the EOS): {got[-1]}"
    run(train + [f"--metrics={without_metrics}"])
    assert losses(with_metrics) == losses(without_metrics), "the samples changed the training's loss curve"
    print(f"loss curve with and without samples: {losses(with_metrics)}")

    assert glob.glob(os.path.join(ck, "step-*8*")), f"no step-8 checkpoint in {os.listdir(ck)}"
    text = stdout_of([os.path.join(args.bin, "dtrain-generate")] + shape + [
        "--device=cpu", f"--checkpoint={ck}", f"--tokenizer={tok}", f"--prompt={PROMPT}", f"--max_new_tokens={NEW}",
        "--temperature=0"])
    assert text == got[-1][2] + "\n", f"dtrain-generate {text!r} != the step-8 sample {got[-1][2]!r}"

    hf = os.path.join(tmp, "hf")
    os.makedirs(hf)
    run([os.path.join(args.bin, "dtrain-export")] + shape + [f"--checkpoint={ck}", "--format=hf", f"--output={hf}",
                                                             f"--tokenizer={tok}"])
    assert sorted(os.listdir(hf)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
                                      "tokenizer_config.json"], os.listdir(hf)
    want = stdout_of([os.path.join(args.bin, "dtrain-generate")] + shape + [
        "--device=cpu", f"--checkpoint={ck}", f"--tokenizer={tok}", f"--prompt={PROMPT}", f"--max_new_tokens={NEW}",
        "--temperature=0", "--dtype=float64"])
    made = [json.loads(line) for line in run([args.python, "-c", HF_TEXT, hf, tok, PROMPT, str(NEW)]).splitlines()
            if line.startswith("{")][-1]
    assert made["text"] + "\n" == want, f"transformers on the export {made} != dtrain-generate {want!r}"
    print(f"transformers' greedy text on the export = dtrain-generate's: {want.strip()!r}")
    # dtrain-generate reads the export back, its tokenizer included (named in the error without it).
    from_hf = [os.path.join(args.bin, "dtrain-generate"), "--device=cpu", f"--init_from_hf={hf}",
               f"--hf_config={hf}/config.json", f"--prompt={PROMPT}", f"--max_new_tokens={NEW}", "--temperature=0",
               "--dtype=float64"]
    out = run(from_hf, expect=2)
    assert f"--init_from_hf's directory has one: --tokenizer={hf}/tokenizer.model" in out
    text = stdout_of(from_hf + [f"--tokenizer={hf}/tokenizer.model"])
    assert text == want, f"dtrain-generate on the export {text!r} != on the checkpoint {want!r}"
    out = run([os.path.join(args.bin, "dtrain-export")] + shape + [f"--checkpoint={ck}", "--format=safetensors",
                                                                   f"--output={tmp}/w.safetensors", f"--tokenizer={tok}"],
              expect=2)
    assert "the tokenizer is written beside a Hugging Face checkpoint (--format=hf)" in out
    out = run([os.path.join(args.bin, "dtrain-export")] + shape[:1] + ["--vocab=300"] + shape[2:] + [
        f"--checkpoint={ck}", "--format=hf", f"--output={hf}", f"--tokenizer={tok}"], expect=2)
    assert "has 400 pieces, more than the model's vocabulary of 300" in out

    for extra in (["-np", "2"], ["-np", "2", "--tp=2"]):
        ranks = extra[:2]
        out = run(mpirun + ranks + train + sample + extra[2:] + ["--sample_every=4"])
        assert [s for s, _, _ in samples(out)] == ["4", "8"], f"{extra}: {samples(out)}"

    bad = [(sample + ["--sample_every=3"], "--sample_every=3 is not a multiple of --log_every=2"),
           (["--sample_every=4"], "--sample_every needs --tokenizer=tokenizer.model"),
           (sample + ["--sample_every=4", "--sample_tokens=40"], "need 43 positions, more than --seq_len=32")]
    for flags, want in bad:
        out = run(train + flags, expect=2)
        assert want in out, f"wanted {want!r}"
    out = run(train + sample + ["--sample_every=4", "--offload=optimizer", "--offload_delayed_update_after=2"],
              expect=2)
    assert "--sample_every with --offload_delayed_update_after" in out
    out = run(mpirun + ["-np", "2"] + train + sample + ["--sample_every=4", "--pp=2"], expect=2)
    assert "--sample_every needs every block's weights on each tensor-parallel rank" in out
    print("OK")


if __name__ == "__main__":
    main()
