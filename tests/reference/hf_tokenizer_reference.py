"""Reference for tests/unit/tokenizer_test.cc: does transformers read dtrain's Hugging Face
tokenizer files (engine::save_hf_tokenizer) as the SentencePiece model they were written from?

Usage:
  hf_tokenizer_reference.py HF_DIR MODEL

Loads HF_DIR with transformers' AutoTokenizer.from_pretrained (the files alone: tokenizer.model,
tokenizer_config.json) and MODEL with Python's sentencepiece, and encodes the texts of
tokenizer_reference.TEXTS (repeated and leading spaces, tabs, NFKC-mapped characters, emoji)
plus text holding the special pieces' names with both. Prints one JSON object:
  {"mismatches": [{"text", "transformers", "sentencepiece"}], "texts": N, "unknown": N,
   "bos": tokenizer's bos_token_id, "eos": eos_token_id, "decode_mismatches": [...]}
where "sentencepiece" is [BOS] + sp.encode(text) (the files ask for add_bos_token) and a decode
mismatch is a text whose ids transformers decodes (skip_special_tokens) unlike sp.decode; ids
holding the unknown piece are not decoded (sentencepiece writes " \u2047 ", transformers drops it
as a special token), "unknown" counts those texts.
"""
import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import sentencepiece as spm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tokenizer_reference import TEXTS  # noqa: E402


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    hf_dir, model = sys.argv[1:]
    sp = spm.SentencePieceProcessor(model_file=model)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    texts = TEXTS + ["<s> and </s> are text here", "tab\tand  two spaces", "trailing  "]
    mismatches, decode_mismatches, unknown = [], [], 0
    for text in texts:
        got, want = tok(text).input_ids, [sp.bos_id()] + sp.encode(text)
        if got != want:
            mismatches.append({"text": text, "transformers": got, "sentencepiece": want})
        if sp.unk_id() in want:
            unknown += 1
        elif tok.decode(want, skip_special_tokens=True) != sp.decode(want):
            decode_mismatches.append(text)
    json.dump({"mismatches": mismatches, "decode_mismatches": decode_mismatches, "texts": len(texts), "unknown": unknown,
               "bos": tok.bos_token_id, "eos": tok.eos_token_id}, sys.stdout)


if __name__ == "__main__":
    main()
