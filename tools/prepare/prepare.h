// dtrain-prepare's library: text files -> llm.c token shards, through a tokenizer.
//
// Plain C++17 (no libtorch, no SentencePiece in this header or in prepare.cc): the tokenizer is
// an Encoder, and the SentencePiece one lives in sentencepiece_encoder.{h,cc}, which only the
// dtrain-prepare program links. Debian's libsentencepiece carries its own copy of protobuf-lite
// (3.14, with exported symbols), and a process that also loads the system's protobuf (3.21:
// libdtrain_engine's TensorBoard writer) crashes at start-up, so the unit tests, which link the
// engine, link this library and run the program for the SentencePiece part.
//
// Documents (PrepareOptions::documents):
//  * kFile: each input file is one document, read whole.
//  * kLines: each line of each file is one document ('\n' ends a line, a '\r' before it is
//    dropped); empty lines are no documents.
//  * kJsonl: JSON Lines, the format most corpora ship in (FineWeb's and The Pile's samples,
//    SlimPajama): each non-empty line is a JSON object, and its string field jsonl_field ("text")
//    is one document (JSON escapes decoded). A line that is not a JSON object, lacks the field
//    (the error lists the fields it has) or holds another type there is an error naming the
//    file and line.
// Compressed inputs (text_stream.h): a file named *.gz is read through gzip, *.zst through zstd,
// in every mode, as a stream (a compressed file is never decompressed to disk or held whole
// unless it is one kFile document); corrupt or cut-short data is an error naming the file.
// A document whose encoding is empty (an empty file, a line of blanks that the tokenizer's
// normalization removes) is skipped: no BOS/EOS for it, not counted.
// Each document's tokens are [bos] + encode(text) + [eos] (bos and eos as the options say),
// and the documents follow each other in input order: the entries of --input in the order given,
// a directory's regular files sorted by name (names starting with '.' skipped), a glob
// pattern's matches sorted.
//
// Output (llm.c's format, as dtrain/engine/data/token_shards.h reads it): each shard is a
// header of 256 little-endian int32 ([0] magic, [1] version, [2] token count, the rest 0) and
// then the tokens, little-endian: magic 20240520, version 1, uint16 tokens when the vocabulary
// has at most 65536 entries; magic 20240801, version 7, uint32 tokens above. The first
// val_tokens tokens of the stream go to PREFIX_val_000000.bin (llm.c: shard 0 is the
// validation shard; none when val_tokens is 0), the rest to PREFIX_train_000001.bin,
// PREFIX_train_000002.bin, ... of shard_tokens tokens each (the last one shorter). Shards cut
// documents where the counts fall, as llm.c's scripts do.
//
// Safety: the output directory must exist and hold no PREFIX_val_*.bin or PREFIX_train_*.bin.
// Each shard is written to a temporary file beside it (.PREFIX_..bin.tmp.PID, a dot name that
// dtrain's shard reader and llm.c's globs skip), fsynced, and renamed into place without
// replacing an existing file (renameat2 RENAME_NOREPLACE), then the directory is fsynced. On an
// error the temporary file and every shard this run had finished are removed: the directory is
// left as it was found (a process killed by a signal may leave a .tmp file; never a shard).
//
// Determinism: threads encode the documents of a batch in parallel and the tokens are written
// in document order, so the shards are the same bytes for any thread count and batch size.
//
// Progress (PrepareOptions::progress_to): while the documents are encoded, one line (see
// format_progress) is drawn on that stream and redrawn in place with '\r' at most five times a
// second; the shards' log lines clear it first. At the end (or on an error) the last state is
// drawn once more and a newline ends it. It changes nothing in the shards or the summary.
//
// Errors (PrepareError, each naming the file or flag and the fix): an input that does not
// exist, a directory or glob without regular files, an unreadable file, a file with a NUL byte
// (binary, not text), an output directory that does not exist or already holds shards of the
// prefix, BOS/EOS asked for when the tokenizer has none (naming --bos/--eos), a token id
// outside [0, vocab), shard_tokens or val_tokens outside int32's range (the header's count),
// and write failures (naming the file and errno's text).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::prepare {

// A user mistake or an I/O failure; what() says which file or flag and what to do.
class PrepareError : public std::runtime_error {
 public:
  explicit PrepareError(const std::string& what) : std::runtime_error(what) {}
};

// A tokenizer. encode() must be safe to call from several threads at once.
class Encoder {
 public:
  virtual ~Encoder() = default;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t bos_id() const = 0;  // < 0: the tokenizer has none
  virtual int64_t eos_id() const = 0;  // < 0: the tokenizer has none
  virtual std::vector<int> encode(std::string_view text) const = 0;
  // For the summary, e.g. "SentencePiece tokenizer.model (bpe, 32000 pieces)".
  virtual std::string describe() const = 0;
};

enum class DocumentMode { kFile, kLines, kJsonl };
// "file", "lines" or "jsonl"; parse_document_mode throws naming --documents for another name.
const char* document_mode_name(DocumentMode mode);
DocumentMode parse_document_mode(const std::string& name);

// The llm.c shard format for a vocabulary size.
struct ShardFormat {
  int32_t magic = 0;
  int32_t version = 0;
  int token_bytes = 0;  // 2 (uint16) or 4 (uint32)
};
inline constexpr int32_t kGpt2Magic = 20240520;    // version 1, uint16 tokens
inline constexpr int32_t kLlama3Magic = 20240801;  // version 7, uint32 tokens
inline constexpr int kHeaderInts = 256;
// uint16 for vocab <= 65536, uint32 above (throws for vocab < 1 or > 2^32).
ShardFormat shard_format_for_vocab(int64_t vocab);

struct PrepareOptions {
  std::vector<std::string> inputs;  // files, directories, glob patterns
  std::string output_dir;
  std::string prefix = "data";
  int64_t shard_tokens = 100000000;  // tokens per train shard, 1 .. 2^31 - 1
  int64_t val_tokens = 0;            // tokens of PREFIX_val_000000.bin; 0: no validation shard
  bool bos = true;                   // the tokenizer's BOS id before each document
  bool eos = false;                  // its EOS id after each document
  DocumentMode documents = DocumentMode::kFile;
  std::string jsonl_field = "text";      // kJsonl: the field of each record that holds its text
  int threads = 1;                       // encoding threads (>= 1)
  int64_t batch_bytes = 16 << 20;        // text per parallel batch (a larger document is one batch)
  std::FILE* progress_to = nullptr;      // where to draw the progress line (stderr); nullptr: none
};

// One state of the progress line.
struct ProgressSnapshot {
  int64_t bytes = 0;        // input bytes of the documents encoded so far
  int64_t total_bytes = 0;  // of all input files
  int64_t documents = 0;    // documents with tokens, encoded so far
  int64_t tokens = 0;       // their tokens, BOS/EOS included
  double seconds = 0;       // since encoding began
  bool done = false;        // the last state of a run that finished
};

// The progress line, e.g.
// "[#####-----] 52% 18.2/35.1 MB 1.23k docs 4.56M tok 1.20M tok/s 0:12 ETA 0:11": a bar and the
// share of the input bytes, bytes (kB, MB, GB: powers of 1000), documents, tokens, tokens per
// second, the elapsed time and the time left at the rate so far ("ETA ?" before the first
// document, "done" at the end; "1h05m" from an hour on). At most 79 columns, for an
// 80-column terminal, while the counts stay under 1000 G and the times under 10 hours.
std::string format_progress(const ProgressSnapshot& p);

struct ShardInfo {
  std::string path;
  int64_t tokens = 0;
};

struct PrepareSummary {
  int64_t files = 0;
  int64_t documents = 0;        // documents with tokens
  int64_t skipped_documents = 0;  // documents that encoded to no tokens
  int64_t text_bytes = 0;
  int64_t tokens = 0;
  int64_t val_tokens = 0;
  int64_t train_tokens = 0;
  ShardFormat format;
  int64_t vocab = 0;
  std::vector<ShardInfo> shards;  // in file-name order: val first
  double seconds = 0;
  // One line: documents, tokens, shards, tokens/s, e.g. "dtrain-prepare: 3 files, 120
  // documents, 51200 tokens (uint16, vocab 32000) in 3 shards under out/ (val 1000 tokens,
  // train 2 shards of <= 50000), 0.52 s, 98462 tokens/s".
  std::string line(const std::string& output_dir) const;
};

// The regular files the inputs name, in order (header comment); throws for an entry that
// names none.
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs);

// Checks the options and the output directory, encodes every document and writes the shards
// (header comment). Logs each shard as it is written (glog INFO).
PrepareSummary prepare_shards(const PrepareOptions& options, const Encoder& encoder);

// The name of a shard: PREFIX_val_000000.bin, PREFIX_train_000001.bin.
std::string shard_name(const std::string& prefix, bool val, int64_t index);

// Writes one shard atomically: open() creates the temporary file, append() adds tokens,
// commit() fills in the header, fsyncs and renames it to `path` (refusing to replace a file).
// Destroying a writer that was not committed removes the temporary file.
class ShardWriter {
 public:
  ShardWriter(std::string path, ShardFormat format, int64_t vocab);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  void append(const int* tokens, size_t count);
  int64_t tokens() const { return tokens_; }
  void commit();
  const std::string& path() const { return path_; }

 private:
  void flush();
  std::string path_;
  std::string tmp_path_;
  ShardFormat format_;
  int64_t vocab_;
  int fd_ = -1;
  int64_t tokens_ = 0;
  std::vector<unsigned char> buffer_;
};

}  // namespace dtrain::prepare
