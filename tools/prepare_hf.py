#!/usr/bin/env python3
"""Token shards from text with a Hugging Face tokenizer: dtrain-prepare for the tokenizers it
cannot read (Llama 3's and GPT-2's byte-level BPE: tokenizer.json or a tiktoken tokenizer.model).

Usage (from the repository root; .venv has transformers, tokenizers and zstandard):
  .venv/bin/python tools/prepare_hf.py --tokenizer=Llama-3.2-1B --input='fineweb/*.jsonl.zst' \
      --documents=jsonl --output_dir=shards --prefix=fineweb --val_tokens=1000000 --eos

The flags and what is written are dtrain-prepare's (docs/GUIDE.md, "Preparing token shards";
tools/prepare/prepare.h), so that train_gpt --data=tokens reads the shards alike:
  --tokenizer   a Hugging Face tokenizer directory (tokenizer.json or tokenizer.model, with its
                tokenizer_config.json: what AutoTokenizer.from_pretrained reads; a dtrain-export
                --format=hf --tokenizer directory too) or a tokenizer.json file (BOS and EOS then
                from --bos_token/--eos_token or a tokenizer_config.json beside it)
  --input       text files, directories (their regular files sorted by name, dot files skipped)
                and glob patterns, comma-separated, in the order given; *.gz and *.zst are
                decompressed as they are read
  --documents   file (each file one document), lines (each non-empty line, a trailing \\r
                dropped) or jsonl (each non-empty line a JSON object; its string field
                --jsonl_field, default "text", is one document)
  --output_dir  an existing directory without PREFIX_val_*.bin / PREFIX_train_*.bin
  --prefix, --val_tokens, --shard_tokens, --bos (default on), --eos (default off)
Each document is [BOS] + the tokenizer's ids of its text (no special tokens of its own: a
"<|end_of_text|>" written in the text is text, as tiktoken's encode_ordinary and SentencePiece
read it) + [EOS]; a document that encodes to nothing is skipped. The first --val_tokens tokens
go to PREFIX_val_000000.bin, the rest to PREFIX_train_000001.bin, ... of --shard_tokens each,
cut where the counts fall. A shard is llm.c's format: 256 little-endian int32 (magic, version,
token count), then the tokens: magic 20240520 version 1 uint16 for a vocabulary (len(tokenizer),
added tokens included) of at most 65536 entries, else 20240801 version 7 uint32.
Safety as dtrain-prepare's: each shard is written under a dot name beside it, fsynced, and
linked into place without replacing a file; on any error the shards of this run are removed.
Errors (exit 2) name the file, line or flag: a missing input, a file that is not UTF-8 text (or
holds a NUL byte), a JSON line without the field, shards of the prefix already there, --bos or
--eos when the tokenizer has no such token. The tokenizer runs in Rust, batch by batch, on every
core (RAYON_NUM_THREADS limits it); the shards are the same for any thread count.
One summary line on stdout, as dtrain-prepare's.
"""
import argparse
import glob
import gzip
import io
import json
import os
import sys
import time

HEADER_INTS = 256
BATCH_BYTES = 8 << 20  # text handed to the tokenizer at once


class PrepareError(Exception):
    """A user mistake or an I/O failure; the message names the file or flag and the fix."""


# ---- the tokenizer ------------------------------------------------------------------------------

class HfEncoder:
    def __init__(self, path, bos_token, eos_token):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        if not os.path.exists(path):
            raise PrepareError(f"--tokenizer={path} does not exist")
        try:
            if os.path.isdir(path):
                tok = AutoTokenizer.from_pretrained(path)
            else:
                config = os.path.join(os.path.dirname(path) or ".", "tokenizer_config.json")
                named = {}
                if os.path.isfile(config):
                    with open(config, encoding="utf-8") as f:
                        c = json.load(f)
                    named = {k: c[k] for k in ("bos_token", "eos_token") if isinstance(c.get(k), str)}
                tok = PreTrainedTokenizerFast(tokenizer_file=path, **named)
        except Exception as e:  # transformers and tokenizers raise several kinds (tokenizers: plain Exception)
            raise PrepareError(f"--tokenizer={path} is not a Hugging Face tokenizer transformers can load "
                               f"({type(e).__name__}: {e}); give a directory with tokenizer.json (or tokenizer.model) "
                               "and tokenizer_config.json, or a tokenizer.json file") from e
        for flag, name in (("--bos_token", bos_token), ("--eos_token", eos_token)):
            if name:
                if tok.convert_tokens_to_ids(name) in (None, tok.unk_token_id) and name not in tok.get_vocab():
                    raise PrepareError(f"{flag}={name} is not a token of {path}")
                setattr(tok, flag[2:], name)
        self.tok, self.path = tok, path
        self.vocab = len(tok)
        self.bos, self.eos = tok.bos_token_id, tok.eos_token_id

    def encode(self, texts):
        return self.tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def describe(self):
        return f"Hugging Face {type(self.tok).__name__} {self.path}, {self.vocab} tokens"


# ---- the documents ------------------------------------------------------------------------------

def input_files(spec):
    files = []
    for entry in [e for e in spec.split(",") if e]:
        if os.path.isdir(entry):
            found = sorted(os.path.join(entry, n) for n in os.listdir(entry)
                           if not n.startswith(".") and os.path.isfile(os.path.join(entry, n)))
            if not found:
                raise PrepareError(f"--input: the directory {entry} holds no regular files")
        elif os.path.isfile(entry):
            found = [entry]
        elif any(c in entry for c in "*?["):
            found = sorted(p for p in glob.glob(entry) if os.path.isfile(p))
            if not found:
                raise PrepareError(f"--input: the pattern {entry} matches no regular file")
        else:
            raise PrepareError(f"--input: {entry} does not exist")
        files += found
    if not files:
        raise PrepareError("--input is required: text files, directories or glob patterns, comma-separated")
    seen = {}
    for f in files:
        first = seen.setdefault(os.path.realpath(f), f)
        if first is not f:
            also = "" if first == f else f" (also as {first})"
            raise PrepareError(f"--input names {f} twice{also}: its text would be encoded twice; name each file once")
    return files


def open_binary(path):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True,
                                                         closefd=True)
    return open(path, "rb")


def checked_text(raw, where):
    nul = raw.find(b"\0")
    if nul >= 0:
        raise PrepareError(f"{where} holds a NUL byte (byte {nul}): it is binary, not text; give text files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8 "
                           "(e.g. iconv -f latin1 -t utf-8)") from e


def documents(files, mode, field):
    """The documents' texts in input order."""
    for path in files:
        try:
            with open_binary(path) as f:
                if mode == "file":
                    yield checked_text(f.read(), path)
                    continue
                for number, raw in enumerate(io.BufferedReader(f) if path.endswith(".zst") else f, 1):
                    if raw.endswith(b"\n"):
                        raw = raw[:-1]
                    if raw.endswith(b"\r"):
                        raw = raw[:-1]
                    where = f"{path}:{number}"
                    text = checked_text(raw, where)
                    if mode == "lines":
                        if text:
                            yield text
                        continue
                    if not text.strip():
                        continue
                    try:
                        obj = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise PrepareError(f"{where} is not a JSON object ({e.msg}); --documents=jsonl reads one "
                                           "object per line") from e
                    if not isinstance(obj, dict):
                        raise PrepareError(f"{where} is a JSON {type(obj).__name__}, not an object")
                    if field not in obj:
                        raise PrepareError(f"{where} has no field \"{field}\" (its fields: {', '.join(obj)}); "
                                           "name the text's field with --jsonl_field")
                    if not isinstance(obj[field], str):
                        raise PrepareError(f"{where}: the field \"{field}\" holds a {type(obj[field]).__name__}, "
                                           "not a string")
                    yield obj[field]
        except (OSError, EOFError) as e:
            if isinstance(e, FileNotFoundError):
                raise PrepareError(f"--input: {path} does not exist") from e
            raise PrepareError(f"{path} could not be read ({e}): a corrupt or cut-short file?") from e


def batches(docs):
    batch, size = [], 0
    for text in docs:
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ---- the shards ---------------------------------------------------------------------------------

class Shards:
    def __init__(self, a, vocab):
        import numpy as np
        self.np, self.a, self.vocab = np, a, vocab
        self.dtype = np.uint16 if vocab <= 65536 else np.uint32
        self.magic, self.version = (20240520, 1) if vocab <= 65536 else (20240801, 7)
        self.index = 0 if a.val_tokens > 0 else 1
        self.pending, self.pending_count = [], 0
        self.written, self.tmp = [], None
        self.tokens = 0

    def capacity(self):
        return self.a.val_tokens if self.index == 0 else self.a.shard_tokens

    def add(self, ids):
        ids = self.np.asarray(ids, dtype=self.np.int64)
        while len(ids):
            room = self.capacity() - self.pending_count
            self.pending.append(ids[:room])
            self.pending_count += len(ids[:room])
            ids = ids[room:]
            if self.pending_count == self.capacity():
                self.flush()

    def name(self, index):
        return f"{self.a.prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"

    def flush(self):
        if not self.pending_count:
            return
        np = self.np
        tokens = np.concatenate(self.pending)
        final = os.path.join(self.a.output_dir, self.name(self.index))
        self.tmp = os.path.join(self.a.output_dir, f".{self.name(self.index)}.tmp.{os.getpid()}")
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = (self.magic, self.version, len(tokens))
        with open(self.tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype(np.dtype(self.dtype).newbyteorder("<")).tobytes())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(self.tmp, final)  # never replaces a file (an existing one fails)
        except FileExistsError as e:
            raise PrepareError(f"{final} appeared while this run wrote it: another run into --output_dir with "
                               f"--prefix={self.a.prefix}?") from e
        os.unlink(self.tmp)
        self.tmp = None
        self.written.append(final)
        self.tokens += len(tokens)
        self.index += 1
        self.pending, self.pending_count = [], 0

    def finish(self):
        self.flush()
        fd = os.open(self.a.output_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self):
        for path in self.written + ([self.tmp] if self.tmp else []):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def prepare(a):
    if not a.tokenizer:
        raise PrepareError("--tokenizer is required: a Hugging Face tokenizer directory or tokenizer.json")
    if a.documents not in ("file", "lines", "jsonl"):
        raise PrepareError(f"--documents={a.documents} is not one of: file, lines, jsonl")
    for flag in ("val_tokens", "shard_tokens"):
        value = getattr(a, flag)
        if value < (0 if flag == "val_tokens" else 1) or value > 2**31 - 1:
            raise PrepareError(f"--{flag}={value} is outside [{0 if flag == 'val_tokens' else 1}, 2147483647] "
                               "(a shard header counts its tokens in an int32)")
    if not os.path.isdir(a.output_dir or ""):
        raise PrepareError(f"--output_dir={a.output_dir} does not exist; create it first (mkdir -p {a.output_dir})")
    taken = sorted(glob.glob(os.path.join(glob.escape(a.output_dir), glob.escape(a.prefix) + "_val_*.bin")) +
                   glob.glob(os.path.join(glob.escape(a.output_dir), glob.escape(a.prefix) + "_train_*.bin")))
    if taken:
        raise PrepareError(f"--output_dir={a.output_dir} already holds shards of --prefix={a.prefix} ({taken[0]}, "
                           f"{len(taken)} in all); remove them or choose another --prefix: nothing is overwritten")
    files = input_files(a.input)
    enc = HfEncoder(a.tokenizer, a.bos_token, a.eos_token)
    for flag, want, tid in (("--bos", a.bos, enc.bos), ("--eos", a.eos, enc.eos)):
        if want and tid is None:
            raise PrepareError(f"{flag}: the tokenizer {a.tokenizer} defines no {flag[2:].upper()} token; name one "
                               f"with {flag}_token=TOKEN, or pass {flag}=false")
    start = time.time()
    shards = Shards(a, enc.vocab)
    docs = 0
    try:
        for batch in batches(documents(files, a.documents, a.jsonl_field)):
            for ids in enc.encode(batch):
                if not ids:
                    continue
                if max(ids) >= enc.vocab or min(ids) < 0:
                    raise PrepareError(f"the tokenizer returned an id outside its vocabulary [0, {enc.vocab})")
                docs += 1
                shards.add(([enc.bos] if a.bos else []) + ids + ([enc.eos] if a.eos else []))
        shards.finish()
    except BaseException:
        shards.remove()
        raise
    seconds = time.time() - start
    train = [w for w in shards.written if "_train_" in w]
    print(f"prepare_hf.py: {len(files)} files, {docs} documents, {shards.tokens} tokens "
          f"({'uint16' if shards.dtype.__name__ == 'uint16' else 'uint32'}, vocab {enc.vocab}) in "
          f"{len(shards.written)} shards under {a.output_dir} ({enc.describe()}; train {len(train)} shards), "
          f"{seconds:.2f} s, {shards.tokens / max(seconds, 1e-9):.0f} tokens/s", flush=True)


def parse_bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"'{text}' is not true or false")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--input", default="")
    ap.add_argument("--output_dir", default="")
    ap.add_argument("--prefix", default="data")
    ap.add_argument("--val_tokens", type=int, default=0)
    ap.add_argument("--shard_tokens", type=int, default=100_000_000)
    ap.add_argument("--bos", type=parse_bool, nargs="?", const=True, default=True)
    ap.add_argument("--eos", type=parse_bool, nargs="?", const=True, default=False)
    ap.add_argument("--bos_token", default="", help="the BOS token's text, where the tokenizer names none")
    ap.add_argument("--eos_token", default="", help="the EOS token's text, where the tokenizer names none")
    ap.add_argument("--documents", default="file")
    ap.add_argument("--jsonl_field", default="text")
    a = ap.parse_args(argv)
    try:
        prepare(a)
    except PrepareError as e:
        print(f"prepare_hf.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
