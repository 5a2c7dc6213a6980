"""Reference tokenization for tests/unit/tokenizer_test.cc (dtrain::engine::Tokenizer).

Usage:
  tokenizer_reference.py OUTDIR

Trains two small SentencePiece models with the Python `sentencepiece` package (independent of
dtrain's C++ code) on the licence texts in /usr/share/common-licenses and a few non-ASCII lines:

  OUTDIR/bpe.model      BPE, 400 pieces, byte fallback (unknown characters become <0xNN> pieces),
                        unk 0, bos 1, eos 2, pad 3
  OUTDIR/unigram.model  unigram, 300 pieces, unk 0, bos 1, eos 2, no pad, no byte fallback

Training is single-threaded with a fixed seed and without sampling the input, so the models are
the same on every run. For each model it prints, with SentencePieceProcessor:
  * "encode": the ids of each text of TEXTS (below);
  * "decode": the text of each id list of the encodings, and of fixed pseudo-random id lists
    (control ids, byte pieces that form no whole UTF-8 character, unknown ids among them);
  * "pieces": id_to_piece of every id; "vocab", "bos", "eos", "pad", "unk".

Output: one JSON object on stdout: {name: {"path", "vocab", "bos", "eos", "pad", "unk",
"pieces": [...], "encode": [{"text", "ids"}], "decode": [{"ids", "text"}]}}.
"""
import json
import os
import random
import sys

import sentencepiece as spm

from prepare_reference import training_lines  # the licence lines dtrain-prepare's models learn from

TEXTS = [
    "",
    "Hello world",
    "  leading and   repeated   spaces  ",
    "Everyone is permitted to copy and distribute verbatim copies of this license document.",
    "Café naïve résumé: déjà vu. 日本語のテキスト。Ünïcödé 🙂 and ☃ (a snowman) ✓",
    "line one\nline two\r\n\ttabbed\n",
    "def main(argv):\n    return 0  # code, with symbols: {}[]<>|\\^~`@$%&*",
    "\u00e9\u0301 NFKC: \uff21\uff22\uff23 \u2460 \ufb01",
]
MODELS = {
    "bpe": dict(model_type="bpe", vocab_size=400, bos_id=1, eos_id=2, pad_id=3, byte_fallback=True),
    "unigram": dict(model_type="unigram", vocab_size=300, bos_id=1, eos_id=2, pad_id=-1),
}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(1234)
    out = {}
    for name, options in MODELS.items():
        prefix = os.path.join(outdir, name)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(training_lines()), model_prefix=prefix, unk_id=0, num_threads=1,
            shuffle_input_sentence=False, input_sentence_size=0, character_coverage=0.9995, minloglevel=2, **options)
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        n = sp.get_piece_size()
        encode = [{"text": t, "ids": sp.encode(t)} for t in TEXTS]
        rng = random.Random(7)
        lists = [e["ids"] for e in encode]
        lists += [[rng.randrange(n) for _ in range(rng.randrange(1, 40))] for _ in range(40)]
        lists += [[1, 2, 0], [sp.bos_id()] + encode[1]["ids"] + [sp.eos_id()]]
        if name == "bpe":  # byte pieces: the three bytes of one character, then a lone first byte
            euro = [sp.piece_to_id("<0x%02X>" % b) for b in "€".encode("utf-8")]
            lists += [euro, euro[:1], euro[:2] + encode[1]["ids"]]
        # Python's decode replaces invalid UTF-8 with U+FFFD, as the C++ library does.
        decode = [{"ids": ids, "text": sp.decode(ids)} for ids in lists]
        out[name] = {"path": prefix + ".model", "vocab": n, "bos": sp.bos_id(), "eos": sp.eos_id(),
                     "pad": sp.pad_id(), "unk": sp.unk_id(), "pieces": [sp.id_to_piece(i) for i in range(n)],
                     "encode": encode, "decode": decode}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
