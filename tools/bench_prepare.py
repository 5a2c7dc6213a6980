#!/usr/bin/env python3
"""dtrain-prepare's throughput against the Python tokenizers a user would run on the same text.

Usage (from the repository root, after building dtrain-prepare):
  .venv/bin/python tools/bench_prepare.py [--bin=build/bin] [--scratch=/tmp/dtrain_bench_prepare]
      [--threads=N] [--runs=3] [--cap_mb=50] [--no_warmup]

The corpus: the licence texts in /usr/share/common-licenses and the *.py files under
/usr/lib/python3*/ (UTF-8 files without NUL bytes, in that order, sorted, at most --cap_mb MB;
each file is one document), copied into SCRATCH/corpus/ so that every tokenizer reads the same
files. Trained once and cached in SCRATCH:
  * spm_bpe8000.model: SentencePiece BPE, 8000 pieces (Python `sentencepiece`);
  * hf_bpe8000.json: a byte-level BPE, 8000 tokens (Hugging Face `tokenizers`).
Measured, each in its own process (a timed run reads the files and encodes every document):
  * dtrain-prepare with the SentencePiece model, 1 and N threads (N: the machine's cores), no
    BOS/EOS: the wall time of the program, writing and fsyncing its shards included;
  * Python sentencepiece, the same model: encode() per document; encode(list, num_threads=N);
  * Hugging Face tokenizers, the byte-level BPE: encode_batch with RAYON_NUM_THREADS=1 and N;
  * tiktoken (when installed): an Encoding built offline from the byte-level BPE's ranks and
    GPT-2's pre-tokenization pattern: encode_ordinary per document; encode_ordinary_batch(N).
Each row: the median of --runs timed runs after one warm-up. Prints a Markdown table; the
ratio column is the row's time over dtrain-prepare's at the same thread count (the same input
bytes, so also the inverse ratio of MB/s). MB = 10^6 bytes.
"""
import argparse
import glob
import importlib.util
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

LICENCES = "/usr/share/common-licenses"
PYTHON_SOURCES = "/usr/lib/python3*/**/*.py"
VOCAB = 8000
# GPT-2's pre-tokenization (contractions, letters, digits, other symbols, whitespace), as the
# byte-level BPE of `tokenizers` applies it.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# ---- corpus and models ------------------------------------------------------------------------

def source_files():
    """Licence texts, then Python sources: regular files, each once (symlinks resolved)."""
    seen, out = set(), []
    candidates = sorted(glob.glob(os.path.join(LICENCES, "*"))) + sorted(glob.glob(PYTHON_SOURCES, recursive=True))
    for path in candidates:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        out.append(real)
    return out


def usable_text(path):
    """The file's bytes when it is non-empty UTF-8 text without NUL bytes, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return data if data and b"\0" not in data else None


def build_corpus(scratch, cap_bytes):
    """Copies the corpus into SCRATCH/corpus (kept when the same files were chosen before)."""
    corpus = os.path.join(scratch, "corpus")
    chosen, total = [], 0
    for path in source_files():
        data = usable_text(path)
        if data is None or total + len(data) > cap_bytes:
            continue
        chosen.append([path, len(data)])
        total += len(data)
    manifest = os.path.join(scratch, "corpus.json")
    if os.path.exists(manifest) and json.load(open(manifest)) == chosen:
        return corpus
    shutil.rmtree(corpus, ignore_errors=True)
    os.makedirs(corpus)
    for i, (path, _) in enumerate(chosen):
        shutil.copyfile(path, os.path.join(corpus, "%06d_%s" % (i, os.path.basename(path))))
    json.dump(chosen, open(manifest, "w"))
    return corpus


def corpus_files(corpus):
    return [os.path.join(corpus, n) for n in sorted(os.listdir(corpus))]


def train_sentencepiece(scratch, files, threads):
    import sentencepiece as spm
    prefix = os.path.join(scratch, "spm_bpe%d" % VOCAB)
    if not os.path.exists(prefix + ".model"):
        print("training SentencePiece BPE (%d pieces) ..." % VOCAB, file=sys.stderr, flush=True)
        spm.SentencePieceTrainer.train(input=files, model_prefix=prefix, model_type="bpe", vocab_size=VOCAB,
                                       unk_id=0, bos_id=1, eos_id=2, pad_id=-1, input_sentence_size=2000000,
                                       shuffle_input_sentence=True, num_threads=threads, minloglevel=2)
    return prefix + ".model"


def train_byte_level_bpe(scratch, files):
    from tokenizers import ByteLevelBPETokenizer
    path = os.path.join(scratch, "hf_bpe%d.json" % VOCAB)
    if not os.path.exists(path):
        print("training byte-level BPE (%d tokens) ..." % VOCAB, file=sys.stderr, flush=True)
        tok = ByteLevelBPETokenizer()
        tok.train(files, vocab_size=VOCAB, min_frequency=2, show_progress=False, special_tokens=[])
        tok.save(path)
    return path


def byte_level_alphabet():
    """The byte -> character map of byte-level BPE: printable Latin-1 bytes stand for
    themselves, the other bytes for the characters from U+0100 on, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tiktoken_encoding(hf_json):
    """A tiktoken Encoding with the byte-level BPE's tokens as ranks (ids in merge order)."""
    import tiktoken
    vocab = json.load(open(hf_json))["model"]["vocab"]
    to_byte = {c: b for b, c in byte_level_alphabet().items()}
    ranks = {bytes(to_byte[c] for c in token): rank for token, rank in vocab.items()}
    return tiktoken.Encoding(name="hf_bpe%d" % VOCAB, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={})


# ---- one measurement (a worker process) --------------------------------------------------------

def read_documents(files):
    docs = []
    for path in files:
        with open(path, "rb") as f:
            docs.append(f.read().decode("utf-8"))
    return docs


def make_encoder(kind, model, threads):
    """A function from the documents to their token counts."""
    if kind == "sentencepiece":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=model)
        if threads == 1:
            return lambda docs: [len(sp.encode(d)) for d in docs]
        return lambda docs: [len(ids) for ids in sp.encode(docs, num_threads=threads)]
    if kind == "tokenizers":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(model)
        return lambda docs: [len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False)]
    if kind == "tiktoken":
        enc = tiktoken_encoding(model)
        if threads == 1:
            return lambda docs: [len(enc.encode_ordinary(d)) for d in docs]
        return lambda docs: [len(ids) for ids in enc.encode_ordinary_batch(docs, num_threads=threads)]
    raise SystemExit("unknown kind " + kind)


def worker(args):
    files = corpus_files(args.corpus)
    encode = make_encoder(args.worker, args.model, args.threads)
    seconds, counts = [], []
    for run in range(args.runs + (0 if args.no_warmup else 1)):
        start = time.perf_counter()
        counts = encode(read_documents(files))
        if run > 0 or args.no_warmup:
            seconds.append(time.perf_counter() - start)
    nbytes = sum(os.path.getsize(f) for f in files)
    print(json.dumps({"seconds": seconds, "tokens": sum(counts), "documents": sum(1 for c in counts if c > 0),
                      "bytes": nbytes}))


def measure_python(args, kind, model, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), RAYON_RS_NUM_CPUS=str(threads),
               TOKENIZERS_PARALLELISM="true" if threads > 1 else "false", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker=" + kind, "--model=" + model, "--corpus=" + args.corpus,
           "--threads=%d" % threads, "--runs=%d" % args.runs] + (["--no_warmup"] if args.no_warmup else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure_dtrain(args, model, threads):
    program = os.path.join(args.bin, "dtrain-prepare")
    files = corpus_files(args.corpus)
    seconds, line = [], ""
    for run in range(args.runs + (0 if args.no_warmup else 1)):
        out = tempfile.mkdtemp(prefix="shards_", dir=args.scratch)
        cmd = [program, "--tokenizer=" + model, "--input=" + args.corpus, "--output_dir=" + out, "--prefix=bench",
               "--bos=false", "--eos=false", "--threads=%d" % threads, "--progress=false", "--minloglevel=1"]
        start = time.perf_counter()
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
        elapsed = time.perf_counter() - start
        shutil.rmtree(out)
        if run > 0 or args.no_warmup:
            seconds.append(elapsed)
    # "dtrain-prepare: 1852 files, 1850 documents (2 empty skipped), 9876543 tokens (uint16, ..."
    found = re.search(r" (\d+) documents.*? (\d+) tokens ", line)
    if not found:
        sys.exit("bench_prepare.py: unexpected summary from dtrain-prepare: " + line)
    return {"seconds": seconds, "tokens": int(found.group(2)), "documents": int(found.group(1)),
            "bytes": sum(os.path.getsize(f) for f in files)}


# ---- the benchmark -------------------------------------------------------------------------------

def machine_text():
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    versions = []
    for module in ("sentencepiece", "tokenizers", "tiktoken"):
        try:
            versions.append("%s %s" % (module, __import__(module).__version__))
        except ImportError:
            versions.append(module + " not installed")
    lib = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libsentencepiece0"], capture_output=True, text=True)
    versions.append("libsentencepiece %s (dtrain-prepare)" % (lib.stdout.strip() or "?"))
    return "%d cores (%s); uptime: %s\n%s" % (os.cpu_count(), cpu, load, ", ".join(versions))


def plan(args, spm_model, hf_model):
    """(label, threads, measure) for each row, dtrain-prepare's first at each thread count."""
    counts = [1] + ([args.threads] if args.threads > 1 else [])
    rows = []
    for n in counts:
        rows.append(("dtrain-prepare (SentencePiece BPE)", n, lambda n=n: measure_dtrain(args, spm_model, n)))
        if n == 1 or args.spm_batch:
            label = "Python sentencepiece, encode() per document" if n == 1 else \
                "Python sentencepiece, encode(list, num_threads=%d)" % n
            rows.append((label, n, lambda n=n: measure_python(args, "sentencepiece", spm_model, n)))
        rows.append(("HF tokenizers byte-level BPE, encode_batch", n,
                     lambda n=n: measure_python(args, "tokenizers", hf_model, n)))
        if args.tiktoken:
            label = "tiktoken (same BPE), encode_ordinary" + ("" if n == 1 else "_batch(num_threads=%d)" % n)
            rows.append((label, n, lambda n=n: measure_python(args, "tiktoken", hf_model, n)))
    return rows


def table(results):
    lines = ["| tokenizer | threads | input MB | documents | tokens | s (median) | MB/s | tokens/s "
             "| time / dtrain-prepare's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {}
    for label, n, r in results:
        s = statistics.median(r["seconds"])
        base.setdefault(n, s)
        mb = r["bytes"] / 1e6
        lines.append("| %s | %d | %.1f | %d | %d | %.2f | %.2f | %.0f | %.2fx |" % (
            label, n, mb, r["documents"], r["tokens"], s, mb / s, r["tokens"] / s, s / base[n]))
    return "\n".join(lines)


def notes(results):
    out = ["timed runs (s):"]
    for label, n, r in results:
        out.append("  %s, %d thread(s): %s" % (label, n, ", ".join("%.2f" % s for s in r["seconds"])))
    dtrain = [r for label, n, r in results if label.startswith("dtrain-prepare")]
    spm_rows = [r for label, n, r in results if label.startswith("Python sentencepiece")]
    same = all(r["tokens"] == dtrain[0]["tokens"] for r in dtrain + spm_rows)
    out.append("dtrain-prepare and Python sentencepiece (the same model) counted %s tokens" %
               ("the same" if same else "DIFFERENT"))
    hf = [r for label, n, r in results if label.startswith("HF")]
    tk = [r for label, n, r in results if label.startswith("tiktoken")]
    if hf and tk and tk[0]["tokens"] == hf[0]["tokens"]:
        out.append("tiktoken (built from the byte-level BPE) and tokenizers counted the same tokens")
    elif hf and tk:
        out.append("tiktoken built from the byte-level BPE: %d tokens against tokenizers' %d (tiktoken merges by the "
                   "rank of the merged token, tokenizers by the rank of the pair)" % (tk[0]["tokens"], hf[0]["tokens"]))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="build/bin", help="the directory of dtrain-prepare")
    p.add_argument("--scratch", default="/tmp/dtrain_bench_prepare", help="corpus, models and shards (kept)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="the multi-threaded rows' thread count")
    p.add_argument("--runs", type=int, default=3, help="timed runs per row (the median is reported)")
    p.add_argument("--cap_mb", type=float, default=50, help="the corpus's size limit, MB")
    p.add_argument("--no_warmup", action="store_true", help="no untimed first run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not os.access(os.path.join(args.bin, "dtrain-prepare"), os.X_OK):
        sys.exit("bench_prepare.py: %s/dtrain-prepare is not built (cmake --build build --target dtrain-prepare)"
                 % args.bin)
    os.makedirs(args.scratch, exist_ok=True)
    print(machine_text(), flush=True)
    args.corpus = build_corpus(args.scratch, int(args.cap_mb * 1e6))
    files = corpus_files(args.corpus)
    spm_model = train_sentencepiece(args.scratch, files, args.threads)
    hf_model = train_byte_level_bpe(args.scratch, files)
    import sentencepiece as spm
    args.spm_batch = "num_threads" in inspect.signature(spm.SentencePieceProcessor.Encode).parameters
    if not args.spm_batch:
        print("Python sentencepiece %s: encode() has no num_threads: no batched row" % spm.__version__)
    args.tiktoken = importlib.util.find_spec("tiktoken") is not None
    if args.tiktoken:
        print("tiktoken: an Encoding built offline from the byte-level BPE's ranks (its own encodings, "
              "cl100k_base etc., are downloaded at first use, which needs the network)")
    else:
        print("tiktoken: skipped (not installed; `pip install tiktoken` to add its rows)")
    results = []
    for label, n, measure in plan(args, spm_model, hf_model):
        print("measuring: %s, %d thread(s) ..." % (label, n), file=sys.stderr, flush=True)
        results.append((label, n, measure()))
    print("corpus: %s (%d files: %s and %s)" % (args.corpus, len(files), LICENCES, PYTHON_SOURCES))
    print(table(results))
    print(notes(results))
    print("uptime at the end: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
