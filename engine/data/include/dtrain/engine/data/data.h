// Data loading: per-rank shards of seeded, shuffled global batches, assembled by worker
// threads into (pinned) host memory and copied to the device ahead of use.
//
// Sharding contract (docs/ARCHITECTURE.md): at each step the loader forms a global batch of
// batch_size * dp_size samples from a permutation of the dataset drawn from (seed, epoch);
// data-parallel rank r receives samples [r * batch_size, (r + 1) * batch_size) of it. So N
// ranks with batch b see, step for step, the same samples as one rank with batch N * b.
// Ranks of one tensor-parallel group pass the same dp_rank and see the same data.
//
// The order of an epoch is a permutation drawn from (seed, epoch) alone by the loader's own
// generator (splitmix64 + Fisher-Yates): identical on every rank, for any dp_size, number of
// workers or thread timing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace dtrain::engine {

// A batch: one tensor per field, first dimension the batch.
struct Batch {
  std::vector<at::Tensor> fields;
  int64_t epoch = 0;
  int64_t index = 0;  // global batch number within the epoch
  int64_t size() const { return fields.empty() ? 0 : fields[0].size(0); }
};

// A map-style dataset. get_batch must be thread-safe (workers call it concurrently).
// With drop_last=false a rank may receive a share of 0 samples of the last global batch
// (fewer samples left than ranks); get_batch is then called with no indices and must return
// tensors with 0 rows.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The samples at `indices`, stacked along a new first dimension, one tensor per field,
  // on the CPU. The loader copies them into pinned memory when it pins.
  virtual std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const = 0;
};

// A dataset over in-memory CPU tensors whose first dimension indexes samples (all equal).
// get_batch gathers with index_select (a copy); it is thread-safe. Throws dtrain::Error for no
// fields, an undefined, 0-dim or non-CPU field, unequal sample counts, or an index out of range.
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
  bool shuffle = true;  // false: dataset order
  uint64_t seed = 0;
  bool drop_last = true;   // false: the last, smaller global batch is split as evenly as possible
  int workers = 2;         // assembling threads; 0: assemble on the caller's thread
  int prefetch = 2;        // batches assembled (and copied to the device) ahead of use
  bool pin_memory = true;  // pin host batches when the device is CUDA
  c10::Device device = c10::Device(c10::kCPU);  // where next() delivers
};

// Throws dtrain::Error for a null or empty dataset, batch_size < 1, dp_size < 1, dp_rank
// outside [0, dp_size), workers < 0, prefetch < 1, a dataset too small for one global batch
// with drop_last, or a device that is neither CPU nor a usable CUDA device.
//
// Threads: `workers` threads call Dataset::get_batch for the coming batches, at most
// `prefetch` of them assembled or ready ahead of next(); next() hands them out strictly in
// order, whichever worker finished first. next(), seek() and position() may be called from any one
// thread at a time (they are internally locked). Pinned host buffers come from PyTorch's caching
// host allocator, which does not reuse a buffer before the non-blocking copy out of it finished;
// the device tensors are allocated on the loader's side stream and recorded on the caller's
// current stream when next() delivers them.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options);
  ~DataLoader();  // stops and joins the workers
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch of this rank, on options.device. With CUDA the copy ran on a side stream
  // and the caller's current stream is made to wait for it, so the tensors are ready to use.
  // Epochs roll over by themselves. Blocks until the batch is ready. A failure while
  // assembling a batch (Dataset::get_batch throwing, a copy failing) is rethrown by the
  // next() call for that batch; that batch counts as consumed (position() moves past it) and
  // later batches are unaffected. With drop_last=false this rank's share of the last global
  // batch may be smaller than batch_size, or empty: a Batch whose fields have 0 rows.
  Batch next();

  // Global batches per epoch: floor(N / G) with drop_last, else ceil(N / G), where
  // G = batch_size * dp_size. Equal on every rank.
  int64_t batches_per_epoch() const;
  // Position for checkpoints: the (epoch, index) of the next batch next() returns.
  std::pair<int64_t, int64_t> position() const;
  // Restarts the stream at a position (discards prefetched batches). Throws dtrain::Error
  // for epoch < 0 or index outside [0, batches_per_epoch()).
  void seek(int64_t epoch, int64_t index);
  // Re-shards the loader for data-parallel rank dp_rank of dp_size (the trainer does this for
  // a loader left at 0 of 1; see shard_loader in trainer.h). Discards prefetched batches and
  // restarts at the current epoch's first batch. Throws dtrain::Error for a layout the dataset
  // cannot serve (as the constructor).
  void shard(int dp_rank, int dp_size);
  const LoaderOptions& options() const { return options_; }

  // Samples in the dataset.
  int64_t dataset_size() const;
  // A held-out set that does not depend on the layout: the first `samples` samples of epoch
  // 0's order (the (seed, 0) permutation with shuffle, else dataset order), all of them for
  // samples == 0 or more than the dataset has. The same for every dp_rank, dp_size,
  // batch_size and worker count. Trainer::evaluate(loader) scores this set.
  std::vector<int64_t> evaluation_order(int64_t samples) const;
  // The samples `indices` assembled on the calling thread into a batch on options().device,
  // ready on the caller's current stream. Does not move position(); thread-safe (the dataset's
  // get_batch is). Throws dtrain::Error for an index out of range or a dataset that returns
  // the wrong number of rows.
  Batch load(const std::vector<int64_t>& indices) const;

 private:
  class Impl;
  LoaderOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
