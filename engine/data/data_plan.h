// Private to the data loader: which samples a data-parallel rank receives at (epoch, index).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "dtrain/engine/data/data.h"

namespace dtrain::engine::data_detail {

// A permutation of 0..n-1 determined by (seed, epoch) alone (splitmix64 + Fisher-Yates): the
// same on every rank, for every dp_size, thread count and platform.
std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch);

// The sharding of ARCHITECTURE.md. Global batch `index` of an epoch is
// order[index * G, (index + 1) * G) with G = batch_size * dp_size, and rank r takes
// [r * batch_size, (r + 1) * batch_size) of it; a last, shorter global batch of m samples
// (drop_last=false) is split in rank order, the first m % dp_size ranks taking one more.
// Options must be validated by the caller. Thread-safe.
class SamplePlan {
 public:
  SamplePlan(int64_t dataset_size, const LoaderOptions& options);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // This rank's samples of global batch `index` (0 <= index < batches_per_epoch()) of `epoch`,
  // in global-batch order. May be empty (a short last batch with fewer samples than ranks).
  std::vector<int64_t> indices(int64_t epoch, int64_t index) const;

 private:
  // (first position in the epoch's order, count) of this rank's share of batch `index`.
  std::pair<int64_t, int64_t> rank_range(int64_t index) const;
  std::shared_ptr<const std::vector<int64_t>> epoch_order(int64_t epoch) const;

  int64_t n_;
  int64_t batch_size_;
  int64_t dp_rank_;
  int64_t dp_size_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t global_ = 0;
  int64_t batches_per_epoch_ = 0;

  mutable std::mutex cache_mutex_;
  // The permutations of the last two epochs asked for, oldest first. GUARDED_BY(cache_mutex_)
  mutable std::vector<std::pair<int64_t, std::shared_ptr<const std::vector<int64_t>>>> cache_;
};

}  // namespace dtrain::engine::data_detail
