// DataLoader: worker threads assemble this rank's batches ahead of use, pin them and copy
// them to the device on a side stream; next() hands them out strictly in order.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "data_plan.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/data/data.h"

namespace dtrain::engine {
namespace {

using Position = std::pair<int64_t, int64_t>;  // (epoch, index)

void validate(const Dataset* dataset, const LoaderOptions& o) {
  DTRAIN_CHECK(dataset != nullptr,
               "DataLoader: the dataset is null; pass a "
               "std::shared_ptr to a Dataset");
  DTRAIN_CHECK(o.batch_size >= 1, "DataLoader: batch_size = ", o.batch_size,
               "; it is the per-rank batch and must be at least 1");
  DTRAIN_CHECK(o.dp_size >= 1, "DataLoader: dp_size = ", o.dp_size,
               "; pass the number of data-parallel ranks (at least 1)");
  DTRAIN_CHECK(o.dp_rank >= 0 && o.dp_rank < o.dp_size, "DataLoader: dp_rank = ", o.dp_rank,
               " is outside [0, dp_size = ", o.dp_size,
               "); pass this process's rank within its data-parallel group");
  DTRAIN_CHECK(o.workers >= 0, "DataLoader: workers = ", o.workers,
               "; pass 0 (assemble in next()) or a positive number of threads");
  DTRAIN_CHECK(o.prefetch >= 1, "DataLoader: prefetch = ", o.prefetch,
               "; pass at least 1 (batches prepared ahead of use)");
  const int64_t n = dataset->size();
  DTRAIN_CHECK(n >= 1, "DataLoader: the dataset is empty (size() = ", n,
               "); pass a dataset with at least one sample");
  const int64_t global = o.batch_size * o.dp_size;
  DTRAIN_CHECK(!o.drop_last || n >= global, "DataLoader: the dataset has ", n,
               " samples, fewer than one global batch of batch_size ", o.batch_size, " x dp_size ",
               o.dp_size, " = ", global,
               " with drop_last; lower batch_size or set drop_last = false");
  const auto type = o.device.type();
  DTRAIN_CHECK(type == c10::kCPU || type == c10::kCUDA, "DataLoader: device ", o.device,
               " is not supported; pass a CPU or CUDA device");
  if (type == c10::kCUDA) {
    const bool linked = c10::impl::hasDeviceGuardImpl(c10::kCUDA);
    const int count = linked ? c10::impl::VirtualGuardImpl(c10::kCUDA).deviceCount() : 0;
    DTRAIN_CHECK(count > 0, "DataLoader: device ", o.device,
                 " asked for, but no CUDA GPU is usable in this process; pass device = cpu");
    DTRAIN_CHECK(o.device.index() < count, "DataLoader: device ", o.device,
                 " does not exist: this process sees ", count,
                 " CUDA device(s); pass an index below ", count);
  }
}

// The device with its index filled in (the current device when none was given).
c10::Device resolve(c10::Device device) {
  if (device.is_cpu() || device.has_index()) return device;
  return c10::impl::VirtualGuardImpl(device.type()).getDevice();
}

// Checks a dataset's answer against the contract, naming the offending field.
void check_fields(const std::vector<at::Tensor>& fields, size_t rows) {
  DTRAIN_CHECK(!fields.empty(),
               "Dataset::get_batch returned no fields; return one tensor per "
               "field (e.g. {inputs, targets})");
  for (size_t k = 0; k < fields.size(); ++k) {
    const at::Tensor& f = fields[k];
    DTRAIN_CHECK(f.defined() && f.dim() >= 1 && f.size(0) == static_cast<int64_t>(rows),
                 "Dataset::get_batch returned field ", k, " with shape ",
                 f.defined() ? f.sizes() : c10::IntArrayRef{}, " for ", rows,
                 " indices; return tensors whose first dimension is the number of indices");
    DTRAIN_CHECK(f.device().is_cpu(), "Dataset::get_batch returned field ", k, " on ", f.device(),
                 "; return CPU tensors (the DataLoader copies to the device)");
  }
}

}  // namespace

class DataLoader::Impl {
 public:
  Impl(std::shared_ptr<const Dataset> dataset, const LoaderOptions& options);
  ~Impl();

  Batch next();
  int64_t batches_per_epoch() const { return plan_.batches_per_epoch(); }
  Position position() const;
  void seek(int64_t epoch, int64_t index);
  const std::shared_ptr<const Dataset>& dataset() const { return dataset_; }

 private:
  // One batch in preparation. The worker writes batch/ready/error, then sets done under
  // mutex_; next() reads them only after seeing done, so no further locking is needed.
  struct Slot {
    Position at;
    bool done = false;  // GUARDED_BY(mutex_)
    Batch batch;
    std::optional<c10::Event> ready;  // recorded on copy_stream_ after the device copies
    std::exception_ptr error;
  };

  void worker_loop();
  // Fetches, pins and copies the slot's samples; stores a failure in slot.error.
  void assemble(Slot& slot) const;
  // Makes the caller's current stream wait for the slot's copies, or rethrows its failure.
  Batch deliver(Slot& slot) const;
  void advance(Position& p) const;

  std::shared_ptr<const Dataset> dataset_;
  data_detail::SamplePlan plan_;
  c10::Device device_;
  bool pin_;
  size_t prefetch_;
  std::optional<c10::Stream> copy_stream_;  // set for a CUDA device

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;          // a slot became free, or stop_/seek
  std::condition_variable ready_cv_;         // a slot became done
  Position position_{0, 0};                  // next batch next() returns. GUARDED_BY(mutex_)
  Position dispatch_{0, 0};                  // next batch a worker starts. GUARDED_BY(mutex_)
  std::deque<std::shared_ptr<Slot>> slots_;  // from position_ on, in order. GUARDED_BY(mutex_)
  bool stop_ = false;                        // GUARDED_BY(mutex_)
  std::vector<std::thread> workers_;
};

DataLoader::Impl::Impl(std::shared_ptr<const Dataset> dataset, const LoaderOptions& options)
    : dataset_(std::move(dataset)),
      plan_(dataset_->size(), options),
      device_(resolve(options.device)),
      pin_(options.pin_memory && options.device.is_cuda()),
      prefetch_(static_cast<size_t>(options.prefetch)) {
  if (device_.is_cuda()) {
    copy_stream_ = c10::impl::VirtualGuardImpl(c10::kCUDA).getStreamFromGlobalPool(device_);
  }
  workers_.reserve(static_cast<size_t>(options.workers));
  for (int i = 0; i < options.workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

DataLoader::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  // A worker inside Dataset::get_batch finishes that call first: the wait is bounded by one
  // get_batch (plus its copies), not by the prefetched backlog.
  for (std::thread& t : workers_) {
    try {
      t.join();
    } catch (const std::exception& e) {
      LOG(ERROR) << "DataLoader: joining a worker failed: " << e.what();
    }
  }
}

void DataLoader::Impl::advance(Position& p) const {
  if (++p.second == plan_.batches_per_epoch()) {
    ++p.first;
    p.second = 0;
  }
}

void DataLoader::Impl::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || slots_.size() < prefetch_; });
    if (stop_) return;
    auto slot = std::make_shared<Slot>();
    slot->at = dispatch_;
    advance(dispatch_);
    slots_.push_back(slot);
    lock.unlock();
    assemble(*slot);  // after a seek() the slot is orphaned and simply dropped
    lock.lock();
    slot->done = true;
    ready_cv_.notify_all();
  }
}

void DataLoader::Impl::assemble(Slot& slot) const {
  try {
    slot.batch.epoch = slot.at.first;
    slot.batch.index = slot.at.second;
    const std::vector<int64_t> indices = plan_.indices(slot.at.first, slot.at.second);
    std::vector<at::Tensor> host = dataset_->get_batch(indices);
    check_fields(host, indices.size());
    if (!copy_stream_) {
      slot.batch.fields = std::move(host);
      return;
    }
    // Pinned buffers come from the caching host allocator, which records the copy on
    // copy_stream_ and does not reuse a buffer before that copy finished; so they may be
    // dropped here. The device tensors are allocated on copy_stream_; deliver() records
    // their use on the caller's stream.
    c10::StreamGuard guard(*copy_stream_);
    for (const at::Tensor& f : host) {
      at::Tensor src = f;
      if (pin_ && !f.is_pinned()) {
        src = at::empty(f.sizes(), f.options().pinned_memory(true));
        src.copy_(f);
      }
      slot.batch.fields.push_back(src.to(device_, src.scalar_type(), /*non_blocking=*/true));
    }
    slot.ready.emplace(device_.type());
    slot.ready->record(*copy_stream_);
  } catch (...) {
    slot.batch.fields.clear();
    slot.error = std::current_exception();
  }
}

Batch DataLoader::Impl::deliver(Slot& slot) const {
  if (slot.error) std::rethrow_exception(slot.error);
  if (slot.ready) {
    const c10::Stream current = c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
    slot.ready->block(current);
    for (const at::Tensor& f : slot.batch.fields) f.record_stream(current);
  }
  return std::move(slot.batch);
}

Batch DataLoader::Impl::next() {
  std::shared_ptr<Slot> slot;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (workers_.empty()) {
      slot = std::make_shared<Slot>();
      slot->at = position_;
      advance(position_);
      dispatch_ = position_;
    } else {
      ready_cv_.wait(lock, [&] { return !slots_.empty() && slots_.front()->done; });
      slot = std::move(slots_.front());
      slots_.pop_front();
      advance(position_);
    }
  }
  if (workers_.empty()) {
    assemble(*slot);
  } else {
    work_cv_.notify_one();
  }
  return deliver(*slot);
}

Position DataLoader::Impl::position() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return position_;
}

void DataLoader::Impl::seek(int64_t epoch, int64_t index) {
  DTRAIN_CHECK(epoch >= 0, "DataLoader::seek: epoch = ", epoch,
               "; pass a position() saved earlier (epoch >= 0)");
  DTRAIN_CHECK(index >= 0 && index < batches_per_epoch(), "DataLoader::seek: index = ", index,
               " is outside [0, batches_per_epoch = ", batches_per_epoch(),
               "); pass a position() saved with the same dataset and options");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slots_.clear();  // workers still assembling these finish into orphaned slots
    position_ = dispatch_ = Position{epoch, index};
  }
  work_cv_.notify_all();
}

// ---- DataLoader ---------------------------------------------------------------------------

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options)
    : options_(options) {
  validate(dataset.get(), options_);
  impl_ = std::make_unique<Impl>(std::move(dataset), options_);
}

DataLoader::~DataLoader() = default;

Batch DataLoader::next() { return impl_->next(); }
int64_t DataLoader::batches_per_epoch() const { return impl_->batches_per_epoch(); }
std::pair<int64_t, int64_t> DataLoader::position() const { return impl_->position(); }
void DataLoader::seek(int64_t epoch, int64_t index) { impl_->seek(epoch, index); }

int64_t DataLoader::dataset_size() const { return impl_->dataset()->size(); }

std::vector<int64_t> DataLoader::evaluation_order(int64_t samples) const {
  const int64_t n = dataset_size();
  DTRAIN_CHECK(samples >= 0, "DataLoader::evaluation_order: samples = ", samples, " must be >= 0 (0: all)");
  const int64_t count = samples == 0 ? n : std::min(samples, n);
  std::vector<int64_t> order;
  if (options_.shuffle) {
    order = data_detail::permutation(n, options_.seed, /*epoch=*/0);
    order.resize(static_cast<size_t>(count));
  } else {
    order.resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) order[static_cast<size_t>(i)] = i;
  }
  return order;
}

Batch DataLoader::load(const std::vector<int64_t>& indices) const {
  std::shared_ptr<const Dataset> dataset = impl_->dataset();
  for (int64_t i : indices) {
    DTRAIN_CHECK(i >= 0 && i < dataset->size(), "DataLoader::load: sample ", i, " is outside the dataset's ",
                 dataset->size(), " samples");
  }
  Batch batch;
  std::vector<at::Tensor> host = dataset->get_batch(indices);
  check_fields(host, indices.size());
  const c10::Device device = resolve(options_.device);
  for (const at::Tensor& f : host) batch.fields.push_back(f.to(device));
  return batch;
}

void DataLoader::shard(int dp_rank, int dp_size) {
  if (dp_rank == options_.dp_rank && dp_size == options_.dp_size) return;
  LoaderOptions sharded = options_;
  sharded.dp_rank = dp_rank;
  sharded.dp_size = dp_size;
  std::shared_ptr<const Dataset> dataset = impl_->dataset();
  validate(dataset.get(), sharded);
  const int64_t epoch = impl_->position().first;
  impl_.reset();  // joins the workers before the options change under them
  options_ = sharded;
  impl_ = std::make_unique<Impl>(std::move(dataset), options_);
  if (epoch > 0) impl_->seek(epoch, 0);
}

}  // namespace dtrain::engine
