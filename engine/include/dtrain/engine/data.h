// Data loading: per-rank shards of seeded, shuffled global batches, assembled by worker
// threads into (pinned) host memory and copied to the device ahead of use.
//
// Sharding contract (ARCHITECTURE.md): at each step the loader forms a global batch of
// batch_size * dp_size samples from a permutation of the dataset drawn from (seed, epoch);
// data-parallel rank r receives samples [r * batch_size, (r + 1) * batch_size) of it. So N
// ranks with batch b see, step for step, the same samples as one rank with batch N * b.
// Ranks of one tensor-parallel group pass the same dp_rank and see the same data.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace dtrain::engine {

// A batch: one tensor per field, first dimension the batch.
struct Batch {
  std::vector<at::Tensor> fields;
  int64_t epoch = 0;
  int64_t index = 0;  // global batch number within the epoch
  int64_t size() const { return fields.empty() ? 0 : fields[0].size(0); }
};

// A map-style dataset. get_batch must be thread-safe (workers call it concurrently).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The samples at `indices`, stacked along a new first dimension, one tensor per field,
  // on the CPU. The loader copies them into pinned memory when it pins.
  virtual std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const = 0;
};

// A dataset over in-memory tensors whose first dimension indexes samples (all equal).
class TensorDataset : public Dataset {
 public:
  explicit TensorDataset(std::vector<at::Tensor> fields);
  int64_t size() const override;
  std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const override;

 private:
  std::vector<at::Tensor> fields_;
};

struct LoaderOptions {
  int64_t batch_size = 32;  // per data-parallel rank
  int dp_rank = 0;
  int dp_size = 1;
  bool shuffle = true;      // false: dataset order
  uint64_t seed = 0;
  bool drop_last = true;    // false: the last, smaller global batch is split as evenly as possible
  int workers = 2;          // assembling threads; 0: assemble on the caller's thread
  int prefetch = 2;         // batches assembled (and copied to the device) ahead of use
  bool pin_memory = true;   // pin host batches when the device is CUDA
  c10::Device device = c10::Device(c10::kCPU);  // where next() delivers
};

// Throws dtrain::Error for batch_size < 1, dp_rank outside [0, dp_size), workers < 0,
// prefetch < 1, or a dataset too small for one global batch with drop_last.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options);
  ~DataLoader();  // stops and joins the workers
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch of this rank, on options.device. With CUDA the copy ran on a side stream
  // and the caller's current stream is made to wait for it, so the tensors are ready to use.
  // Epochs roll over by themselves. Blocks until the batch is ready; rethrows a worker's
  // failure.
  Batch next();

  int64_t batches_per_epoch() const;
  // Position for checkpoints: the (epoch, index) of the next batch next() returns.
  std::pair<int64_t, int64_t> position() const;
  // Restarts the stream at a position (discards prefetched batches).
  void seek(int64_t epoch, int64_t index);
  const LoaderOptions& options() const { return options_; }

 private:
  class Impl;
  LoaderOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::engine
