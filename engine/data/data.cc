// TensorDataset and the sampling plan of the DataLoader: which samples rank r receives at
// (epoch, index). The threads and device copies are in data_loader.cc.
#include "dtrain/engine/data/data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data_plan.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine {

// ---- TensorDataset ------------------------------------------------------------------------

TensorDataset::TensorDataset(std::vector<at::Tensor> fields) : fields_(std::move(fields)) {
  DTRAIN_CHECK(!fields_.empty(),
               "TensorDataset needs at least one field tensor; pass e.g. "
               "{inputs, targets}");
  for (size_t k = 0; k < fields_.size(); ++k) {
    const at::Tensor& f = fields_[k];
    DTRAIN_CHECK(f.defined(), "TensorDataset field ", k,
                 " is an undefined tensor; pass a "
                 "tensor whose first dimension indexes the samples");
    DTRAIN_CHECK(f.dim() >= 1, "TensorDataset field ", k,
                 " is a 0-dim tensor; its first "
                 "dimension must index the samples (reshape it to [N, ...])");
    DTRAIN_CHECK(f.device().is_cpu(), "TensorDataset field ", k, " is on ", f.device(),
                 "; pass CPU tensors (the DataLoader copies batches to its device)");
    DTRAIN_CHECK(f.size(0) == fields_[0].size(0), "TensorDataset field ", k, " has ", f.size(0),
                 " samples but field 0 has ", fields_[0].size(0),
                 "; every field's first dimension must be the number of samples");
  }
}

int64_t TensorDataset::size() const { return fields_[0].size(0); }

std::vector<at::Tensor> TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t n = size();
  for (int64_t i : indices) {
    DTRAIN_CHECK(i >= 0 && i < n, "TensorDataset::get_batch: index ", i, " is outside [0, ", n,
                 "); pass sample indices below size()");
  }
  // A copy of the indices: the caller's vector is not borrowed past this call.
  at::Tensor index = at::empty({static_cast<int64_t>(indices.size())}, at::kLong);
  std::copy(indices.begin(), indices.end(), index.data_ptr<int64_t>());
  std::vector<at::Tensor> out;
  out.reserve(fields_.size());
  for (const at::Tensor& f : fields_) out.push_back(at::index_select(f, 0, index));
  return out;
}

// ---- Sampling plan ------------------------------------------------------------------------

namespace data_detail {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): a bijective 64-bit mixer and a simple generator.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return mix64(state_);
  }
  // Uniform in [0, n) without modulo bias (rejects the lowest 2^64 mod n values).
  uint64_t below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    uint64_t x = next();
    while (x < threshold) x = next();
    return x % n;
  }

 private:
  uint64_t state_;
};

}  // namespace

std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
  SplitMix64 gen(mix64(mix64(seed) + static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(gen.below(static_cast<uint64_t>(i) + 1));
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
  }
  return perm;
}

SamplePlan::SamplePlan(int64_t dataset_size, const LoaderOptions& options)
    : n_(dataset_size),
      batch_size_(options.batch_size),
      dp_rank_(options.dp_rank),
      dp_size_(options.dp_size),
      shuffle_(options.shuffle),
      seed_(options.seed),
      drop_last_(options.drop_last) {
  global_ = batch_size_ * dp_size_;
  batches_per_epoch_ = drop_last_ ? n_ / global_ : (n_ + global_ - 1) / global_;
}

std::pair<int64_t, int64_t> SamplePlan::rank_range(int64_t index) const {
  const int64_t begin = index * global_;
  const int64_t m = std::min(global_, n_ - begin);  // samples in this global batch
  if (m == global_) return {begin + dp_rank_ * batch_size_, batch_size_};
  // The last, short global batch (drop_last=false): the first m % dp_size ranks take one more.
  const int64_t base = m / dp_size_, extra = m % dp_size_;
  const int64_t r = dp_rank_;
  return {begin + r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

std::shared_ptr<const std::vector<int64_t>> SamplePlan::epoch_order(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  for (const auto& entry : cache_) {
    if (entry.first == epoch) return entry.second;
  }
  auto perm = std::make_shared<const std::vector<int64_t>>(permutation(n_, seed_, epoch));
  // Workers straddle at most an epoch boundary, so two epochs cover the ones in use.
  if (cache_.size() >= 2) cache_.erase(cache_.begin());
  cache_.emplace_back(epoch, perm);
  return perm;
}

std::vector<int64_t> SamplePlan::indices(int64_t epoch, int64_t index) const {
  const auto [start, count] = rank_range(index);
  std::vector<int64_t> out(static_cast<size_t>(count));
  if (!shuffle_) {
    for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = start + i;
    return out;
  }
  auto perm = epoch_order(epoch);
  std::copy(perm->begin() + start, perm->begin() + start + count, out.begin());
  return out;
}

}  // namespace data_detail
}  // namespace dtrain::engine
