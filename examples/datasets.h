// Data for the examples: real data that installed packages ship, read by our own loaders,
// and synthetic data of the same shapes for tests and benchmarks.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "dtrain/engine/data/data.h"

namespace dtrain::examples {

// scikit-learn's 8x8 handwritten digits (digits.csv.gz: 1797 rows of 64 pixels 0..16 and a
// label). Returns {pixels float [N, 64] scaled to [0, 1], labels int64 [N]}.
std::pair<at::Tensor, at::Tensor> load_digits(const std::string& path);

// The bytes of a text file, or of every regular file in a directory (sorted by name)
// concatenated, as uint8. dtrain::Error for a path that does not exist, a file that cannot be
// read, or one that is not text (NUL bytes or malformed UTF-8 in its first MiB: a binary
// file, such as a token shard, that a byte model would learn as characters).
at::Tensor load_text_bytes(const std::string& path);

// Language-model windows over a token stream: sample i is tokens[i*stride, i*stride+len+1)
// (int64), split by the example into input and target.
class TokenWindows : public engine::Dataset {
 public:
  TokenWindows(at::Tensor tokens, int64_t len, int64_t stride);
  int64_t size() const override;
  std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const override;

 private:
  at::Tensor tokens_;
  int64_t len_, stride_;
};

// Random tokens in [0, vocab): `count` sequences of len+1, fixed by seed.
std::shared_ptr<engine::Dataset> synthetic_tokens(int64_t count, int64_t len, int64_t vocab, uint64_t seed);

// A synthetic classification set: x ~ N(0, 1) [count, features], labels from a fixed random
// linear teacher (so the task is learnable).
std::pair<at::Tensor, at::Tensor> synthetic_classification(int64_t count, int64_t features,
                                                           int64_t classes, uint64_t seed);

}  // namespace dtrain::examples
