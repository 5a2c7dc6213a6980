#!/usr/bin/env python3
"""tools/prepare_hf.py: token shards with a Hugging Face tokenizer, as dtrain-prepare writes them.

  * The same SentencePiece model both ways: dtrain-prepare reads tok.model, prepare_hf.py the
    directory dtrain-export --format=hf --tokenizer wrote from it (transformers' AutoTokenizer):
    the shards are the same files, byte for byte, in each --documents mode (file, lines, jsonl;
    plain, .gz and .zst inputs; CRLF, blank lines, non-ASCII text, a literal "<s>"), with --bos
    --eos, a validation shard and train shards cut mid-document.
  * A byte-level BPE tokenizer.json (Hugging Face `tokenizers`, GPT-2's pre-tokenization) with
    more than 65536 tokens: uint32 shards (magic 20240801, version 7) that hold
    [BOS] + tokenizers' own encoding + [EOS] of each document, a literal "<|end_of_text|>" in the
    text encoded as text; train_gpt --data=tokens trains on them.
  * Refusals (exit 2) that name the problem: shards of the prefix already there (nothing
    written), a missing input, a binary file, text that is not UTF-8, a JSON line without the
    field, --eos with a tokenizer that has no EOS, a path that is no tokenizer; a failure
    part-way leaves no shard behind.

usage: prepare_hf.py --bin BUILD/bin --mpirun "mpirun ..." --python PYTHON
"""
import glob
import gzip
import json
import os
import struct

from example_util import python_example_args, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "prepare_hf.py")

SPM = r"""
import sys
import sentencepiece as spm
out = sys.argv[1]
lines = [l.strip() for n in ("GPL-3", "Apache-2.0") for l in open("/usr/share/common-licenses/" + n) if l.strip()]
lines += ["Caf\u00e9, na\u00efve, r\u00e9sum\u00e9.", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002"]
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=out + "/tok", vocab_size=400,
                               model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                               byte_fallback=True, minloglevel=2)
"""

# A byte-level BPE of more than 65536 tokens (trained, then padded with added tokens), with
# Llama 3's special tokens named in its tokenizer_config.json. argv: the directory, the corpus.
BYTE_BPE = r"""
import json, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out, corpus = sys.argv[1], sys.argv[2:]
tk = Tokenizer(models.BPE())
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tk.decoder = decoders.ByteLevel()
tk.train(corpus, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tk.add_tokens([f"<extra_{i}>" for i in range(65000)])
tk.save(out + "/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": "<|end_of_text|>"}, open(out + "/tokenizer_config.json", "w"))
"""

# The byte-level BPE's own encoding of each document (tokenizers, no transformers), and its size.
BYTE_BPE_IDS = r"""
import json, sys
from tokenizers import Tokenizer
tk = Tokenizer.from_file(sys.argv[1])
tk.encode_special_tokens = True  # a special token's text in a document is text
docs = json.load(open(sys.argv[2]))
print(json.dumps({"vocab": tk.get_vocab_size(), "bos": tk.token_to_id("<|begin_of_text|>"),
                  "eos": tk.token_to_id("<|end_of_text|>"),
                  "ids": [e.ids for e in tk.encode_batch(docs, add_special_tokens=False)]}))
"""


def shards(d, prefix):
    """{name: bytes} of the prefix's shards in d."""
    out = {}
    for p in sorted(glob.glob(os.path.join(d, prefix + "_*.bin"))):
        with open(p, "rb") as f:
            out[os.path.basename(p)] = f.read()
    return out


def read_tokens(blob):
    magic, version, n = struct.unpack("<3i", blob[:12])
    width = {20240520: 2, 20240801: 4}[magic]
    body = blob[1024:]
    assert len(body) == n * width, (len(body), n, width)
    return magic, version, list(struct.unpack(f"<{n}{'H' if width == 2 else 'I'}", body))


def write_corpus(tmp):
    """Inputs for each mode: plain, gzip and zstd files."""
    import zstandard
    text = os.path.join(tmp, "text")
    os.makedirs(text)
    for name in ("GPL-3", "Apache-2.0", "MPL-2.0"):
        with open(f"/usr/share/common-licenses/{name}", "rb") as src:
            data = src.read()
        with open(os.path.join(text, name), "wb") as f:
            f.write(data)
    odd = ("First line\r\n\r\n  indented  twice  \nCaf\u00e9 \u65e5\u672c \U0001F642 <s> literal </s>\n"
           "tab\tseparated\n\n\nlast line without newline").encode("utf-8")
    with open(os.path.join(text, "odd.txt"), "wb") as f:
        f.write(odd)
    with gzip.open(os.path.join(text, "odd2.txt.gz"), "wb") as f:
        f.write(odd.replace(b"First", b"Gzipped"))
    with open(os.path.join(text, "odd3.txt.zst"), "wb") as f:
        c = zstandard.ZstdCompressor()
        f.write(c.compress(odd[:40]) + c.compress(odd[40:].replace(b"Caf", b"Zst")))  # two frames
    jsonl = os.path.join(tmp, "jsonl")
    os.makedirs(jsonl)
    with open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8") as f:
        paragraphs = f.read().split("\n\n")
    rows = [{"text": t, "id": i} for i, t in enumerate(odd.decode("utf-8").split("\n\n") + paragraphs)]
    rows.append({"text": "", "id": 99})
    lines = "\n".join(json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(rows)) + "\n\n"
    with open(os.path.join(jsonl, "a.jsonl"), "w", encoding="utf-8") as f:
        f.write(lines)
    with gzip.open(os.path.join(jsonl, "b.jsonl.gz"), "wt", encoding="utf-8") as f:
        f.write(lines.replace("line", "LINE"))
    return text, jsonl


def check_same_as_dtrain_prepare(args, tmp, text, jsonl):
    run([args.python, "-c", SPM, tmp])
    tok = os.path.join(tmp, "tok.model")
    shape = ["--model=llama", "--vocab=400", "--d_model=16", "--heads=2", "--kv_heads=2", "--layers=1", "--ff=32", "--seq_len=16"]
    ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
    os.makedirs(hf)
    run([os.path.join(args.bin, "train_gpt")] + shape + ["--device=cpu", "--data=synthetic", "--batch_size=2",
                                                         "--steps=1", f"--save_dir={ck}", "--progress=false"])
    run([os.path.join(args.bin, "dtrain-export")] + shape + [f"--checkpoint={ck}", "--format=hf", f"--output={hf}",
                                                             f"--tokenizer={tok}"])
    for mode, inputs, extra in (("file", text, []), ("lines", text, []), ("jsonl", jsonl, []),
                                ("lines", text, ["--bos=false"])):
        flags = [f"--input={inputs}", f"--documents={mode}", "--eos", "--val_tokens=3000", "--shard_tokens=5000"]
        flags += extra
        ours, theirs = (os.path.join(tmp, f"{who}_{mode}{len(extra)}") for who in ("dtrain", "hf"))
        os.makedirs(ours)
        os.makedirs(theirs)
        run([os.path.join(args.bin, "dtrain-prepare"), f"--tokenizer={tok}", f"--output_dir={ours}",
             "--threads=1"] + flags)
        run([args.python, TOOL, f"--tokenizer={hf}", f"--output_dir={theirs}"] + flags)
        a, b = shards(ours, "data"), shards(theirs, "data")
        assert len(a) >= 3, f"{mode}: dtrain-prepare wrote {list(a)}"
        assert list(a) == list(b), f"{mode}: shard names {list(a)} != {list(b)}"
        for name in a:
            assert a[name] == b[name], f"{mode} {extra}: {name} differs"
        print(f"--documents={mode} {extra}: {len(a)} shards, the same bytes as dtrain-prepare's")
    return hf


def check_byte_level(args, tmp, text):
    bpe = os.path.join(tmp, "bpe")
    os.makedirs(bpe)
    corpus = sorted(glob.glob(os.path.join(text, "*")))
    plain = [p for p in corpus if not p.endswith((".gz", ".zst"))]
    run([args.python, "-c", BYTE_BPE, bpe] + plain)
    docs = []
    for p in plain:
        with open(p, encoding="utf-8", newline="") as f:  # the bytes' own line ends (CRLF kept)
            docs.append(f.read())
    docs.append("special tokens in text stay text: <|end_of_text|> <|begin_of_text|>")
    extra = os.path.join(tmp, "special.txt")
    with open(extra, "w", encoding="utf-8") as f:
        f.write(docs[-1])
    docs_json = os.path.join(tmp, "docs.json")
    with open(docs_json, "w") as f:
        json.dump(docs, f)
    ref = json.loads(run([args.python, "-c", BYTE_BPE_IDS, os.path.join(bpe, "tokenizer.json"), docs_json],
                         tail=200).strip().splitlines()[-1])
    assert ref["vocab"] > 65536, ref["vocab"]
    out = os.path.join(tmp, "bpe_shards")
    os.makedirs(out)
    # The tokenizer.json file alone: BOS/EOS from the tokenizer_config.json beside it.
    run([args.python, TOOL, f"--tokenizer={bpe}/tokenizer.json", f"--input={','.join(plain + [extra])}",
         f"--output_dir={out}", "--prefix=bpe", "--eos", "--shard_tokens=4000"])
    got = []
    for name, blob in shards(out, "bpe").items():
        magic, version, tokens = read_tokens(blob)
        assert (magic, version) == (20240801, 7), f"{name}: magic {magic} version {version}"
        got += tokens
    want = [t for ids in ref["ids"] for t in [ref["bos"]] + ids + [ref["eos"]]]
    assert got == want, f"{len(got)} tokens != tokenizers' {len(want)}"
    assert ref["eos"] not in ref["ids"][-1] and ref["bos"] not in ref["ids"][-1], "a special token's text became its id"
    print(f"byte-level BPE, {ref['vocab']} tokens: {len(got)} uint32 tokens = tokenizers' encoding")
    run([os.path.join(args.bin, "train_gpt"), "--model=llama", f"--vocab={ref['vocab']}", "--d_model=16",
         "--heads=2", "--kv_heads=2", "--layers=1", "--ff=32", "--seq_len=32", "--device=cpu", "--data=tokens",
         f"--data_path={out}/bpe_train_*.bin", "--batch_size=2", "--steps=2", "--progress=false"])
    return bpe, plain


def check_refusals(args, tmp, hf, bpe, plain):
    out = os.path.join(tmp, "refused")
    os.makedirs(out)
    base = [args.python, TOOL, f"--tokenizer={hf}", f"--output_dir={out}"]
    binary = os.path.join(tmp, "binary.bin")
    with open(binary, "wb") as f:
        f.write(b"text\0more")
    latin1 = os.path.join(tmp, "latin1.txt")
    with open(latin1, "wb") as f:
        f.write("caf\u00e9".encode("latin-1"))
    nofield = os.path.join(tmp, "nofield.jsonl")
    with open(nofield, "w") as f:
        f.write('{"text": "fine"}\n{"body": "no text", "id": 3}\n')
    bare = os.path.join(tmp, "bare")
    os.makedirs(bare)
    os.link(os.path.join(bpe, "tokenizer.json"), os.path.join(bare, "tokenizer.json"))
    cases = [
        ([f"--input={tmp}/missing.txt"], "missing.txt does not exist"),
        ([f"--input={binary}"], "holds a NUL byte (byte 4): it is binary"),
        ([f"--input={latin1}"], "is not UTF-8 text"),
        ([f"--input={nofield}", "--documents=jsonl"], "nofield.jsonl:2 has no field \"text\" (its fields: body, id)"),
        ([f"--input={plain[0]}", f"--tokenizer={bare}/tokenizer.json"], "--bos: the tokenizer"),
        ([f"--input={plain[0]}", f"--tokenizer={bare}/tokenizer.json", "--bos=false", "--eos"],
         "--eos: the tokenizer"),
        ([f"--input={plain[0]}", f"--tokenizer={binary}"], "is not a Hugging Face tokenizer transformers can load"),
        ([f"--input={plain[0]}", "--documents=xml"], "--documents=xml is not one of: file, lines, jsonl"),
        ([f"--input={plain[0]},{os.path.dirname(plain[0])}"], "twice: its text would be encoded twice"),
    ]
    for flags, want in cases:
        got = run(base + flags, expect=2)
        assert want in got, f"wanted {want!r}"
        assert not os.listdir(out), f"{flags}: left {os.listdir(out)}"
    # A failure part-way (the binary file after a good one, small shards): no shard is left.
    got = run(base + [f"--input={plain[0]},{plain[1]},{binary}", "--documents=lines", "--shard_tokens=500"], expect=2)
    assert "holds a NUL byte" in got and not os.listdir(out), os.listdir(out)
    run(base + [f"--input={plain[0]}"])
    before = shards(out, "data")
    got = run(base + [f"--input={plain[1]}"], expect=2)
    assert "already holds shards of --prefix=data" in got and shards(out, "data") == before


def main():
    args, _, tmp = python_example_args("prepare_hf")
    text, jsonl = write_corpus(tmp)
    hf = check_same_as_dtrain_prepare(args, tmp, text, jsonl)
    bpe, plain = check_byte_level(args, tmp, text)
    check_refusals(args, tmp, hf, bpe, plain)
    print("OK")


if __name__ == "__main__":
    main()
