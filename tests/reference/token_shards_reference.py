"""Reference writer of token shards for tests/unit/token_shards_test.cc.

Usage:
  token_shards_reference.py OUTDIR

Writes token files under OUTDIR the way their tools write them, from the formats' own
descriptions (not from dtrain's reader):
  * llm.c (write_datafile): a header of 256 little-endian int32, [0] magic, [1] version,
    [2] token count, then the tokens: GPT-2 magic 20240520, version 1, uint16 tokens;
    Llama 3 magic 20240801, version 7, uint32 tokens.
  * nanoGPT (prepare.py): a headerless array written with ndarray.tofile, uint16 (or uint32).
  * Megatron-LM (mmap IndexedDatasetBuilder): PREFIX.bin holds each document's tokens in the
    dataset's dtype, back to back; PREFIX.idx holds b"MMIDIDX\\x00\\x00", uint64 version 1,
    uint8 dtype code, uint64 sequence count, uint64 document-index count, int32 sequence
    lengths, int64 byte pointers (running sum of length * itemsize), int64 document indices
    ([0, 1, ..., n]: one sequence per document), and for a multimodal build int8 modes.

Good data (tokens drawn from numpy's default_rng with fixed seeds):
  gpt2/shard_000.bin (301 tokens), shard_001.bin (67), shard_002.bin (9), notes.txt (ignored)
  llama3/train_000.bin (200), train_001.bin (150), val_000.bin (100); ids up to 128255
  nanogpt16/train.bin (500 uint16), val.bin (120), meta.pkl (not tokens)
  nanogpt32/train.bin (250 uint32; ids up to 100276)
  megatron/corpus_a (uint16, docs 20, 33, 7, 50), corpus_b (int32, docs 40, 41; with modes),
           corpus_c (int64, docs 18), corpus_d (uint8, docs 30, 12), corpus_e (int16, docs 25)
Broken files under errors/ (see ERRORS below) and an empty directory errors/empty_dir.

Output: one JSON object on stdout, {"tokens": {relative path: [token, ...]}} for every good
file that holds tokens (Megatron: PREFIX.bin, its documents concatenated).
"""
import json
import os
import struct
import sys

import numpy as np

GPT2_MAGIC, GPT2_VERSION = 20240520, 1
LLAMA3_MAGIC, LLAMA3_VERSION = 20240801, 7
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                  np.float64: 6, np.float32: 7, np.uint16: 8}

OUT = {}


def record(rel, toks):
    OUT[rel] = [int(t) for t in toks]


def llmc_header(magic, version, count):
    header = np.zeros(256, dtype=np.int32)
    header[0] = magic
    header[1] = version
    header[2] = count
    return header.tobytes()


def write_llmc(path, toks, llama3=False, magic=None, version=None, count=None):
    dtype = np.uint32 if llama3 else np.uint16
    magic = magic if magic is not None else (LLAMA3_MAGIC if llama3 else GPT2_MAGIC)
    version = version if version is not None else (LLAMA3_VERSION if llama3 else GPT2_VERSION)
    count = count if count is not None else len(toks)
    with open(path, "wb") as f:
        f.write(llmc_header(magic, version, count))
        f.write(np.array(toks, dtype=dtype).tobytes())


def write_megatron(prefix, docs, dtype, code=None, modes=False, write_bin=True, magic=b"MMIDIDX\x00\x00"):
    lengths = [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    document_indices = list(range(len(docs) + 1))
    if write_bin:
        with open(prefix + ".bin", "wb") as f:
            for d in docs:
                f.write(np.array(d, dtype=dtype).tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code if code is not None else MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))
        if modes:
            f.write(np.zeros(len(lengths), dtype=np.int8).tobytes(order="C"))


def good(root):
    rng = np.random.default_rng(20240520)
    os.makedirs(os.path.join(root, "gpt2"))
    for i, n in enumerate([301, 67, 9]):
        toks = rng.integers(0, 50257, size=n)
        rel = f"gpt2/shard_{i:03d}.bin"
        write_llmc(os.path.join(root, rel), toks)
        record(rel, toks)
    with open(os.path.join(root, "gpt2", "notes.txt"), "w") as f:
        f.write("not a shard\n")

    os.makedirs(os.path.join(root, "llama3"))
    for name, n in [("train_000", 200), ("train_001", 150), ("val_000", 100)]:
        toks = rng.integers(0, 128256, size=n)
        toks[0] = 128255  # above uint16
        rel = f"llama3/{name}.bin"
        write_llmc(os.path.join(root, rel), toks, llama3=True)
        record(rel, toks)

    os.makedirs(os.path.join(root, "nanogpt16"))
    for name, n in [("train", 500), ("val", 120)]:
        arr = rng.integers(0, 65535, size=n).astype(np.uint16)
        rel = f"nanogpt16/{name}.bin"
        arr.tofile(os.path.join(root, rel))
        record(rel, arr)
    with open(os.path.join(root, "nanogpt16", "meta.pkl"), "wb") as f:
        f.write(b"\x80\x04not tokens")

    os.makedirs(os.path.join(root, "nanogpt32"))
    arr = rng.integers(0, 100277, size=250).astype(np.uint32)
    arr[3] = 100276
    arr.tofile(os.path.join(root, "nanogpt32", "train.bin"))
    record("nanogpt32/train.bin", arr)

    os.makedirs(os.path.join(root, "megatron"))
    specs = [("corpus_a", np.uint16, [20, 33, 7, 50], 65535, False),
             ("corpus_b", np.int32, [40, 41], 200000, True),
             ("corpus_c", np.int64, [18], 1 << 40, False),
             ("corpus_d", np.uint8, [30, 12], 255, False),
             ("corpus_e", np.int16, [25], 32767, False)]
    for name, dtype, lengths, high, modes in specs:
        docs = [rng.integers(0, high, size=n) for n in lengths]
        write_megatron(os.path.join(root, "megatron", name), docs, dtype, modes=modes)
        record(f"megatron/{name}.bin", np.concatenate(docs))


# ERRORS: each broken file, by name under errors/.
def errors(root):
    e = os.path.join(root, "errors")
    os.makedirs(os.path.join(e, "empty_dir"))
    toks = list(range(10))
    write_llmc(os.path.join(e, "bad_magic.bin"), toks, magic=12345678)       # magic 12345678
    write_llmc(os.path.join(e, "bad_version.bin"), toks, version=2)          # GPT-2 magic, version 2
    write_llmc(os.path.join(e, "llama_version.bin"), toks, llama3=True, version=1)  # Llama 3, version 1
    write_llmc(os.path.join(e, "truncated.bin"), list(range(60)), count=100)  # says 100, holds 60
    write_llmc(os.path.join(e, "oversized.bin"), list(range(20)), count=10)   # says 10, holds 20
    with open(os.path.join(e, "short.bin"), "wb") as f:                       # 100 bytes of header
        f.write(llmc_header(GPT2_MAGIC, GPT2_VERSION, 5)[:100])
    open(os.path.join(e, "empty.bin"), "wb").close()                          # 0 bytes
    with open(os.path.join(e, "odd_raw.bin"), "wb") as f:                     # 7 bytes
        f.write(bytes(range(7)))
    np.arange(50, dtype=np.uint16).tofile(os.path.join(e, "headerless.bin"))  # raw, 100 bytes
    vocab = np.arange(40) % 1000
    vocab[23] = 50300                                                          # >= vocab 50257
    write_llmc(os.path.join(e, "vocab.bin"), vocab)
    docs = [np.arange(12)]
    write_megatron(os.path.join(e, "float_dtype"), docs, np.float32)          # code 7
    write_megatron(os.path.join(e, "lonely"), docs, np.uint16, write_bin=False)  # no .bin
    write_megatron(os.path.join(e, "bad_idx_magic"), docs, np.uint16, magic=b"MMIDXXX\x00\x00")
    write_megatron(os.path.join(e, "short_bin"), docs, np.uint16)             # .bin cut to 20 bytes
    with open(os.path.join(e, "short_bin.bin"), "r+b") as f:
        f.truncate(20)
    write_megatron(os.path.join(e, "signed"), [np.array([5, 6, -3, 7, 8, 9])], np.int16)  # token -3
    np.arange(30, dtype=np.uint16).tofile(os.path.join(e, "no_index.bin"))   # no .idx beside it


def main():
    root = sys.argv[1]
    good(root)
    errors(root)
    json.dump({"tokens": OUT}, sys.stdout)


if __name__ == "__main__":
    main()
