"""Reference for dtrain-prepare's JSON Lines and compressed inputs (tests/unit/prepare_test.cc).

Usage:
  prepare_jsonl_reference.py OUTDIR MODEL

Writes, with Python's json, gzip and zstandard modules (independent of dtrain's C++ code), the
same records as OUTDIR/records.jsonl (CRLF line ends, blank lines, extra fields, JSON escapes,
non-ASCII text, a record whose text is empty), OUTDIR/records.jsonl.gz (two gzip members) and
OUTDIR/records.jsonl.zst (two zstd frames); a text file's lines gzip-compressed
(OUTDIR/lines.txt.gz) and zstd-compressed whole (OUTDIR/whole.txt.zst); and broken inputs:
bad_json.jsonl (line 3 is not JSON), array.jsonl (a JSON array), no_field.jsonl (no "text"),
number.jsonl ("text" is a number), cut.jsonl.gz (a gzip stream cut short), cut.jsonl.zst (a
zstd frame cut short), garbage.jsonl.gz (not gzip at all).

Encodes with SentencePieceProcessor(MODEL) and prints one JSON object:
  {"records": [ids of each record's text, in order, empty ones included],
   "lines": [ids of each non-empty line of lines.txt.gz], "whole": ids of whole.txt.zst's text}
"""
import gzip
import json
import os
import sys

import sentencepiece as spm
import zstandard

RECORDS = [
    {"id": 1, "text": "Everyone is permitted to copy and distribute verbatim copies", "url": "https://a.example"},
    {"text": "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F642", "meta": {"lang": "mixed", "n": [1, 2]}},
    {"id": 3, "text": ""},
    {"id": 4, "text": "a line\nwith a newline, a\ttab, \"quotes\" and a backslash \\ inside"},
    {"id": 5, "text": "   spaces around   ", "score": 0.5, "ok": True, "none": None},
]
LINES = "first line of text\r\n\r\nsecond line, after a blank one\nthird \u00e9 line\n"
WHOLE = "A whole document.\nIt spans lines,\n\nand ends without a newline"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, model = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=(i % 2 == 0)) for i, r in enumerate(RECORDS)]
    data = ("\r\n".join(lines[:2]) + "\r\n\n" + "\n".join(lines[2:]) + "\n").encode("utf-8")

    def write(name, payload):
        with open(os.path.join(out, name), "wb") as f:
            f.write(payload)

    half = len(data) // 2
    write("records.jsonl", data)
    write("records.jsonl.gz", gzip.compress(data[:half]) + gzip.compress(data[half:]))
    z = zstandard.ZstdCompressor()
    write("records.jsonl.zst", z.compress(data[:half]) + z.compress(data[half:]))
    write("lines.txt.gz", gzip.compress(LINES.encode("utf-8")))
    write("whole.txt.zst", z.compress(WHOLE.encode("utf-8")))
    write("bad_json.jsonl", b'{"text": "one"}\n{"text": "two"}\n{"text": "three"\n')
    write("array.jsonl", b'["text", "a list"]\n')
    write("no_field.jsonl", b'{"body": "no text field", "title": "t"}\n')
    write("number.jsonl", b'{"text": 42}\n')
    full = gzip.compress(data * 20)
    write("cut.jsonl.gz", full[: len(full) // 2])
    frame = z.compress(data * 20)
    write("cut.jsonl.zst", frame[: len(frame) // 2])
    write("garbage.jsonl.gz", b"this is plain text, not gzip\n")

    sp = spm.SentencePieceProcessor(model_file=model)
    lines_text = [l[:-1] if l.endswith("\r") else l for l in LINES.split("\n")]
    print(json.dumps({"records": [sp.encode(r["text"]) for r in RECORDS],
                      "lines": [sp.encode(l) for l in lines_text if l],
                      "whole": sp.encode(WHOLE)}))


if __name__ == "__main__":
    main()
