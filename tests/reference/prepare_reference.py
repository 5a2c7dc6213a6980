"""Reference tokenization for tests/unit/prepare_test.cc (dtrain-prepare).

Usage:
  prepare_reference.py OUTDIR [TEXT ...]

Trains small SentencePiece models with the Python `sentencepiece` package (independent of
dtrain's C++ code) on a few KB of the licence texts in /usr/share/common-licenses, writes test
texts, and encodes every text with SentencePieceProcessor:

  OUTDIR/models/bpe.model        BPE, 300 pieces, unk 0, bos 1, eos 2
  OUTDIR/models/unigram.model    unigram, 300 pieces, unk 0, bos 1, eos 2
  OUTDIR/models/plain.model      BPE, 300 pieces, unk 0, no bos, no eos
  OUTDIR/models/big.model        BPE, 66300 pieces (66000 user-defined symbols w00000q ..
                                 w65999q, then the learned pieces): ids above 65535
  OUTDIR/texts/a_licence.txt, b_unicode.txt (CRLF lines, blank and whitespace-only lines,
      non-ASCII text), c_empty.txt (0 bytes), d_no_newline.txt (no final newline),
      e_symbols.txt (the big model's symbols), .hidden.txt (a dot file: not an input)

Training is single-threaded with a fixed seed and without sampling the input, so the models are
the same on every run. The TEXT arguments (default: the texts above, sorted by name) are
encoded as dtrain-prepare documents, both ways:
  * "file": the whole file (decoded as UTF-8) is one document;
  * "lines": the file's bytes split at b"\\n", one b"\\r" dropped from a line's end, empty
    lines skipped; each remaining line is one document.
A document that encodes to no ids is reported with ids [] (dtrain-prepare skips it).

Output: one JSON object on stdout:
  {"models": {name: {"path", "vocab", "bos", "eos"}},
   "texts": [path, ...],
   "encodings": {name: {path: {"file": {"text", "ids"}, "lines": [{"text", "ids"}, ...]}}}}
"""
import json
import os
import sys

import sentencepiece as spm

LICENCES = "/usr/share/common-licenses"
MODELS = {
    "bpe": dict(model_type="bpe", vocab_size=300, bos_id=1, eos_id=2),
    "unigram": dict(model_type="unigram", vocab_size=300, bos_id=1, eos_id=2),
    "plain": dict(model_type="bpe", vocab_size=300, bos_id=-1, eos_id=-1),
    "big": dict(model_type="bpe", vocab_size=66300, bos_id=1, eos_id=2,
                user_defined_symbols=["w%05dq" % i for i in range(66000)], hard_vocab_limit=False),
}


def training_lines():
    lines = []
    for name in ("GPL-3", "Apache-2.0"):
        path = os.path.join(LICENCES, name)
        if not os.path.exists(path):
            sys.exit(f"prepare_reference.py: {path} is missing (Debian's base-files ships it)")
        with open(path, encoding="utf-8") as f:
            lines += [line.strip() for line in f if line.strip()]
    lines += ["Café, naïve, résumé: déjà vu.", "日本語のテキスト。", "Ünïcödé and emoji 🙂 here."]
    return lines


def train(outdir):
    models = os.path.join(outdir, "models")
    os.makedirs(models, exist_ok=True)
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(1234)
    lines = training_lines()
    info = {}
    for name, options in MODELS.items():
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_prefix=os.path.join(models, name), unk_id=0, pad_id=-1,
            num_threads=1, shuffle_input_sentence=False, input_sentence_size=0, character_coverage=1.0,
            minloglevel=2, **options)
        path = os.path.join(models, name + ".model")
        sp = spm.SentencePieceProcessor(model_file=path)
        info[name] = {"path": path, "vocab": sp.get_piece_size(), "bos": sp.bos_id(), "eos": sp.eos_id()}
    return info


def write_texts(outdir):
    texts = os.path.join(outdir, "texts")
    os.makedirs(texts, exist_ok=True)
    with open(os.path.join(LICENCES, "GPL-3"), encoding="utf-8") as f:
        gpl = f.read()
    files = {
        "a_licence.txt": gpl[:3000],
        "b_unicode.txt": "First line, plain.\r\nCafé naïve 日本語 🙂\r\n\r\n   \n\tTabbed line\nlast line\n",
        "c_empty.txt": "",
        "d_no_newline.txt": "Everyone is permitted to copy and distribute verbatim copies\nof this license",
        "e_symbols.txt": "w00000q w12345q w65999q and some words\nw65535q w65536q\n",
        ".hidden.txt": "not an input",
    }
    for name, text in files.items():
        with open(os.path.join(texts, name), "wb") as f:
            f.write(text.encode("utf-8"))
    return sorted(os.path.join(texts, n) for n in files if not n.startswith("."))


def encode(sp, path):
    with open(path, "rb") as f:
        data = f.read()
    whole = data.decode("utf-8")
    lines = []
    for raw in data.split(b"\n"):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if raw:
            text = raw.decode("utf-8")
            lines.append({"text": text, "ids": sp.encode(text)})
    return {"file": {"text": whole, "ids": sp.encode(whole)}, "lines": lines}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    outdir = sys.argv[1]
    models = train(outdir)
    texts = write_texts(outdir)
    if len(sys.argv) > 2:
        texts = sys.argv[2:]
    encodings = {}
    for name, info in models.items():
        sp = spm.SentencePieceProcessor(model_file=info["path"])
        encodings[name] = {path: encode(sp, path) for path in texts}
    json.dump({"models": models, "texts": texts, "encodings": encodings}, sys.stdout)


if __name__ == "__main__":
    main()
