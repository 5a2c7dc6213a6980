// Pre-tokenized corpora on disk, memory-mapped, as next-token windows for language models.
//
// Formats (little-endian, as written by their tools):
//  * llm.c GPT-2 shards: a 1024-byte header of 256 int32 ([0] = 20240520 magic, [1] = 1
//    version, [2] = token count), then the tokens as uint16.
//  * llm.c Llama 3 shards: the same header with magic 20240801 and version 7; uint32 tokens.
//  * nanoGPT raw files: a headerless array of tokens, uint16 (raw_token_bytes = 2, what
//    nanoGPT's prepare.py writes) or uint32 (raw_token_bytes = 4); the file size must be a
//    multiple of the width. Never detected: ask for it with format = kRaw.
//  * Megatron-LM mmap indexed datasets: PREFIX.idx beside PREFIX.bin. The .idx holds the
//    9-byte magic "MMIDIDX\0\0", a uint64 version (1), a uint8 dtype code, a uint64 sequence
//    count n and a uint64 document-index count d, then int32 lengths[n], int64 byte
//    pointers[n] and int64 document indices[d] (and, from a multimodal builder, int8 modes[n]).
//    The .bin holds the tokens of the sequences back to back, in the code's dtype: 1 uint8,
//    3 int16, 4 int32, 5 int64 or 8 uint16 are read; 2 int8 and the float codes 6 and 7 are
//    refused. The token stream is the sequences in .bin order: the pointers must be
//    contiguous (as every Megatron builder writes them).
//
// Which files (TokenShardOptions::paths; each entry is one of):
//  * a file: that shard. For Megatron a PREFIX.bin or PREFIX.idx names the pair.
//  * a directory: its regular files named *.bin (the name all three tools write; *.idx too
//    with format kAuto or kMegatron), sorted by name; other files (meta.pkl, README) and
//    names starting with '.' are ignored.
//  * a glob pattern (glob(3): '*', '?', '[...]'): the regular files it matches, sorted.
//  * a Megatron prefix: PREFIX with PREFIX.idx and PREFIX.bin beside each other.
// Entries are taken in the order given. With format = kAuto a file is Megatron when it is a
// PREFIX.idx or a PREFIX.bin with PREFIX.idx beside it (a pair counts once), llm.c when its
// first int32 is one of llm.c's magics, and an error otherwise (a headerless file needs kRaw).
//
// Samples: shard s of T_s tokens gives W_s = floor((T_s - 1) / seq_len) windows when
// T_s >= seq_len + 1, else 0. Window k of a shard is its tokens [k * seq_len,
// k * seq_len + seq_len + 1): inputs w[:seq_len], targets w[1:]. Consecutive windows share
// one token; no window crosses a shard boundary; the tail of a shard that does not fill a
// window is not used. Samples are numbered shard by shard: size() = sum of W_s.
// Megatron: windows run over the concatenated sequences of the .bin and cross document
// boundaries (no document-aware packing), as llm.c's and Megatron's own GPT datasets do
// with their end-of-document tokens.
//
// Determinism: windows are the dataset's samples, so the DataLoader's contract (data.h)
// applies to them: each epoch visits every window once in the permutation drawn from
// (seed, epoch); dp rank r of N with batch b gets the same windows as one rank with batch
// N * b; a checkpointed position() resumes at the same window. Nothing here is random.
//
// Memory: each shard is mapped read-only (POSIX mmap) for the dataset's lifetime and
// unmapped in its destructor; get_batch copies only the requested windows. A Megatron .idx is
// mapped while it is checked at construction and unmapped then. Shards must not be rewritten
// or truncated while a dataset maps them (reading a truncated mapping raises SIGBUS).
//
// Errors (dtrain::Error, each naming the file, what was expected and what was found): a path
// that does not exist, cannot be opened or mapped, a directory or glob with no shard files, an
// empty file, a file shorter than its header, a bad magic or version, a token count or file
// size that disagrees with the header (or, for Megatron, with the .idx's lengths), a raw file
// whose size is not a multiple of the token width, a Megatron .idx without its .bin (or the
// reverse with format = kMegatron), a float or unknown Megatron dtype, seq_len < 1,
// raw_token_bytes other than 2 or 4, vocab < 0, and shards that together hold no window
// (naming seq_len and the token counts). get_batch throws for an index outside [0, size())
// and, with vocab > 0, for a token >= vocab (naming the file, the token's offset in its
// shard, the token and the vocab; an out-of-range id would index the embedding out of
// bounds on the GPU). Tokens of signed Megatron dtypes below 0 are always refused.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/engine/data/data.h"

namespace dtrain::engine {

enum class TokenFormat {
  kAuto,      // detect: Megatron by its .idx, llm.c by its magic; never raw
  kLlmc,      // llm.c shards (GPT-2 uint16 or Llama 3 uint32, told by the magic)
  kRaw,       // nanoGPT: headerless tokens of raw_token_bytes each
  kMegatron,  // Megatron-LM .idx/.bin pairs
};

// "auto", "llmc", "raw", "megatron".
const char* token_format_name(TokenFormat format);
// The inverse of token_format_name; throws dtrain::Error naming the choices for another name.
TokenFormat parse_token_format(const std::string& name);

struct TokenShardOptions {
  std::vector<std::string> paths;  // files, directories, glob patterns or Megatron prefixes
  TokenFormat format = TokenFormat::kAuto;
  int64_t seq_len = 1024;   // tokens per input row; a window holds seq_len + 1 tokens
  int raw_token_bytes = 2;  // kRaw only: 2 (uint16, nanoGPT's default) or 4 (uint32)
  int64_t vocab = 0;        // > 0: get_batch refuses tokens >= vocab; 0: no check
};

// One shard as found on disk.
struct TokenShardInfo {
  std::string path;                         // the file holding the tokens (Megatron: PREFIX.bin)
  TokenFormat format = TokenFormat::kAuto;  // kLlmc, kRaw or kMegatron, never kAuto
  std::string dtype;  // the tokens' type on disk: "uint16", "uint32", "int32", ...
  int64_t tokens = 0;
  int64_t windows = 0;     // W_s above
  int64_t documents = -1;  // Megatron: documents in the .idx (d - 1); -1 for other formats
};

// Samples are windows of seq_len + 1 tokens (header comment). get_batch(indices) returns
// one field: an int64 CPU tensor [indices.size(), seq_len + 1] (0 rows for no indices),
// the input layout of the GPT model (gpt.h). get_batch is thread-safe: it only reads the
// read-only mappings.
class TokenShardDataset : public Dataset {
 public:
  explicit TokenShardDataset(TokenShardOptions options);
  ~TokenShardDataset() override;  // unmaps the shards
  TokenShardDataset(const TokenShardDataset&) = delete;
  TokenShardDataset& operator=(const TokenShardDataset&) = delete;

  int64_t size() const override;
  std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const override;

  const TokenShardOptions& options() const { return options_; }
  int64_t seq_len() const { return options_.seq_len; }
  // The shards in sample order (shards with 0 windows included).
  const std::vector<TokenShardInfo>& shards() const { return infos_; }
  int64_t total_tokens() const;
  // One line for a start-up log: shard count and names, formats, tokens and windows, e.g.
  // "token shards: 3 files (a.bin, b.bin, c.bin), llmc uint16, 1200 tokens, 9 windows of
  // seq_len 128 (129 tokens each, stride 128)".
  std::string describe() const;

 private:
  class Impl;
  TokenShardOptions options_;
  std::vector<TokenShardInfo> infos_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
