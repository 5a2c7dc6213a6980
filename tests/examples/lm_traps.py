#!/usr/bin/env python3
"""The language-model workflow's traps: what a user audit found accepted without a word, now
refused or said (each case failed, or passed silently, before its fix).

  * Token shards: a --data_path directory that holds dtrain-prepare's validation shard, a shard
    in both --data_path and --eval_data_path, a shard named twice: refused, naming the file.
  * --eval_only: without --eval_data_path the scored samples are called training samples, not
    held-out ones; a --save_dir of checkpoints without --resume is refused (it would score the
    initial weights); without any checkpoint the output says the initial weights are scored.
  * train_gpt --model=gpt --tie_embeddings starts near ln(vocab) (the tied head's logits were
    sqrt(d_model) too large: a first loss of 43 at vocab 2000).
  * dtrain-export --format=hf --tokenizer: a tokenizer it refuses (no BOS piece for --bos) leaves
    the directory empty; a directory holding an earlier export's tokenizer is refused for an
    export without one.
  * Messages that misled: an llm.c shard read with --data_format=raw (its header trained on),
    the samples' flags without --sample_every (ignored), --kv_heads with --model=gpt, the default
    --kv_heads against --heads=2, a prompt that fills the positions ("at most -6 new tokens"),
    --prompt="" ("no prompt").

usage: lm_traps.py --bin BUILD/bin --mpirun "mpirun ..." --python PYTHON
"""
import math
import os
import struct

from example_util import python_example_args, run

VOCAB, S = 300, 16

TOKENIZER = r"""
import sys
import sentencepiece as spm
lines = [l.strip() for l in open("/usr/share/common-licenses/GPL-3") if l.strip()]
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=sys.argv[1] + "/nobos", vocab_size=300,
                               model_type="bpe", unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, minloglevel=2)
"""


def write_shard(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack("<3i", 20240520, 1, len(tokens)) + bytes(1012))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def main():
    args, _, tmp = python_example_args("lm_traps")
    shards = os.path.join(tmp, "shards")
    os.makedirs(shards)
    write_shard(os.path.join(shards, "d_val_000000.bin"), [(7 * i) % VOCAB for i in range(40 * S + 1)])
    write_shard(os.path.join(shards, "d_train_000001.bin"), [(13 * i + 5) % VOCAB for i in range(80 * S + 1)])
    train_shard, val_shard = os.path.join(shards, "d_train_000001.bin"), os.path.join(shards, "d_val_000000.bin")
    gpt = [os.path.join(args.bin, "train_gpt"), "--device=cpu", "--progress=false", f"--vocab={VOCAB}",
           "--d_model=32", "--heads=4", "--layers=1", "--ff=64", f"--seq_len={S}", "--batch_size=4", "--data=tokens"]
    llama = gpt[:1] + ["--model=llama", "--kv_heads=2"] + gpt[1:]

    refusals = [
        ([f"--data_path={shards}", f"--eval_data_path={val_shard}", "--steps=1"],
         f"--data_path={shards} holds d_val_000000.bin, a validation shard"),
        ([f"--data_path={train_shard},{val_shard}", f"--eval_data_path={val_shard}", "--steps=1"],
         "is also in --data_path"),
        ([f"--data_path={train_shard},{shards}/d_train_*.bin", "--steps=1"], "is named twice in the paths"),
    ]
    for flags, want in refusals:
        out = run(llama + flags, expect=2)
        assert want in out, f"wanted {want!r}"
    run(llama + [f"--data_path={shards}/d_train_*.bin", f"--eval_data_path={val_shard}", "--steps=1"])
    more = [
        # An llm.c shard read as headerless tokens (its header trained on as tokens before).
        (llama + [f"--data_path={train_shard}", "--data_format=raw", "--steps=1"], "starts with llm.c's shard header"),
        # The samples' flags without --sample_every did nothing.
        (llama + [f"--data_path={train_shard}", "--steps=1", "--tokenizer=missing.model"],
         "--tokenizer is for the samples taken while training, and --sample_every is 0"),
        (gpt + ["--model=gpt", f"--data_path={train_shard}", "--steps=1", "--kv_heads=2"],
         "--kv_heads is a flag of train_gpt's Llama (--model=llama)"),
        (gpt[:1] + ["--model=llama"] + gpt[1:] + [f"--data_path={train_shard}", "--steps=1", "--heads=2",
                                                  "--d_model=16"],
         "--heads=2 is not a multiple of --kv_heads=4"),
    ]
    for flags, want in more:
        out = run(flags, expect=2)
        assert want in out, f"wanted {want!r}"

    ck = os.path.join(tmp, "ck")
    run(llama + [f"--data_path={train_shard}", "--steps=2", f"--save_dir={ck}"])
    out = run(llama + [f"--data_path={train_shard}", "--eval_only", f"--save_dir={ck}", "--resume"])
    assert "training samples (not held out: no --eval_data_path)" in out and "held-out samples" not in out, out
    out = run(llama + [f"--data_path={train_shard}", f"--eval_data_path={val_shard}", "--eval_only",
                       f"--save_dir={ck}", "--resume"])
    assert "evaluating the checkpoint of step 2" in out and "held-out samples" in out
    out = run(llama + [f"--data_path={train_shard}", "--eval_only", f"--save_dir={ck}"], expect=2)
    assert "holds checkpoints, but without --resume the model's initial weights would be evaluated" in out
    out = run(llama + [f"--data_path={train_shard}", f"--eval_data_path={val_shard}", "--eval_only"])
    assert "evaluating the model's initial weights" in out

    for tied in ("false", "true"):
        out = run(gpt + ["--model=gpt", f"--data_path={train_shard}", "--steps=1", f"--tie_embeddings={tied}"])
        first = float(out.split("loss ")[1].split(" ")[0])
        assert abs(first - math.log(VOCAB)) < 1.0, f"--tie_embeddings={tied}: first loss {first}, ln(V) {math.log(VOCAB):.2f}"

    run([args.python, "-c", TOKENIZER, tmp])
    hf = os.path.join(tmp, "hf")
    os.makedirs(hf)
    export = [os.path.join(args.bin, "dtrain-export"), "--model=llama", "--kv_heads=2", f"--vocab={VOCAB}",
              "--d_model=32", "--heads=4", "--layers=1", "--ff=64", f"--seq_len={S}", f"--checkpoint={ck}",
              "--format=hf", f"--output={hf}"]
    out = run(export + [f"--tokenizer={tmp}/nobos.model"], expect=2)
    assert "defines no BOS piece" in out and os.listdir(hf) == [], os.listdir(hf)
    run(export + [f"--tokenizer={tmp}/nobos.model", "--bos=false"])
    assert "tokenizer_config.json" in os.listdir(hf)
    out = run(export, expect=2)
    assert "holds tokenizer.model of an earlier export; this one writes no tokenizer" in out
    generate = [os.path.join(args.bin, "dtrain-generate")] + export[1:10] + ["--device=cpu", f"--checkpoint={ck}"]
    out = run(generate + ["--prompt_tokens=" + ",".join(["5"] * S)], expect=2)
    assert f"the (longest) prompt has {S} tokens, and the model has {S} positions" in out
    out = run(generate + [f"--tokenizer={tmp}/nobos.model", "--prompt="], expect=2)
    assert 'prompt="" (with no BOS' in out and "holds no token ids" in out
    print("OK")


if __name__ == "__main__":
    main()
