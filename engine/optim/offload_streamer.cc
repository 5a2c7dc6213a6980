// Optimizer offload: gradient streaming (see offload_internal.h).
#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>

#include <unordered_map>

#include "dtrain/dist/error.h"
#include "offload_internal.h"

namespace dtrain::engine::offload_detail {

GradientStreamer::GradientStreamer(const HostShard& shard, const std::vector<at::Tensor>& params,
                                   GradReducer& reducer, HostGrads* target)
    : shard_(shard), reducer_(reducer), target_(target) {
  std::unordered_map<const void*, size_t> mine;
  for (size_t j = 0; j < params.size(); ++j) mine[params[j].unsafeGetTensorImpl()] = j;
  reducer_index_.assign(reducer.params().size(), -1);
  for (size_t i = 0; i < reducer.params().size(); ++i) {
    auto it = mine.find(reducer.params()[i].unsafeGetTensorImpl());
    if (it != mine.end()) reducer_index_[i] = static_cast<int64_t>(it->second);
  }
  if (const auto& device = shard.device()) {
    c10::impl::VirtualGuardImpl impl(device->type());
    copy_stream_ = impl.getStreamFromGlobalPool(*device, /*isHighPriority=*/false);
    copied_.emplace(device->type());
  }
  // Only the buckets of this shard's parameters: on one rank the others (layer offload's
  // host-resident blocks beside it) keep autograd's gradients.
  std::vector<char> observed(reducer_index_.size());
  for (size_t i = 0; i < observed.size(); ++i) observed[i] = reducer_index_[i] >= 0;
  // Runs under the reducer's lock on autograd's thread: only hand the bucket on.
  reducer.set_bucket_observer([this](const LaunchedBucket& bucket) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bucket.backward != announced_) {
        announced_ = bucket.backward;
        processed_ = 0;
        error_ = nullptr;
      }
      expected_ = bucket.count;
      queue_.push_back(bucket);
    }
    cv_.notify_all();
  }, std::move(observed));
  worker_ = std::thread([this] { loop(); });  // after the observer: a refused one leaves no thread
}

GradientStreamer::~GradientStreamer() {
  try {
    reducer_.set_bucket_observer(nullptr);
  } catch (const std::exception& e) {
    LOG(ERROR) << "optimizer offload teardown: " << e.what();
  }
  std::deque<LaunchedBucket> dropped;  // queued copies nobody will take
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_all();
  worker_.join();
  try {
    if (copied_) copied_->synchronize();  // no copy into the host buffers is left in flight
  } catch (const std::exception& e) {
    LOG(ERROR) << "optimizer offload teardown: " << e.what();
  }
}

void GradientStreamer::loop() {
  for (;;) {
    LaunchedBucket bucket;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      bucket = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr failure;
    try {
      copy(bucket);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bucket.backward == announced_) {
        ++processed_;
        if (failure && !error_) error_ = failure;
      }
    }
    cv_.notify_all();
  }
}

void GradientStreamer::copy(const LaunchedBucket& bucket) {
  std::optional<c10::StreamGuard> guard;
  if (copy_stream_) guard.emplace(*copy_stream_);
  bucket.work->wait();  // the copy stream (or this thread, for host results) waits for the average
  HostGrads& g = *target_.load();
  const int64_t lo = shard_.lo(), hi = shard_.hi();
  const std::vector<int64_t>& offsets = shard_.offsets();
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const int64_t j = bucket.params[k] < reducer_index_.size() ? reducer_index_[bucket.params[k]] : -1;
    if (j < 0) continue;
    const int64_t p_lo = offsets[j];
    const int64_t a = std::max(p_lo, lo), b = std::min(offsets[j + 1], hi);
    if (a >= b) continue;
    at::Tensor src = bucket.values.narrow(0, bucket.offsets[k] + (a - p_lo), b - a);
    shard_.for_each_piece(a - lo, b - lo, [&](size_t c, int64_t in, int64_t n, int64_t at_) {
      g.chunks[c].narrow(0, in, n).copy_(src.narrow(0, at_ - (a - lo), n), /*non_blocking=*/copy_stream_.has_value());
    });
  }
  if (copy_stream_) copied_->record(*copy_stream_);
}

bool GradientStreamer::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return announced_ > taken_;
}

void GradientStreamer::take(bool host_sync) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return processed_ >= expected_; });
  taken_ = announced_;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  lock.unlock();
  if (!copied_) return;
  if (host_sync) {
    copied_->synchronize();
  } else {
    c10::impl::VirtualGuardImpl impl(shard_.device()->type());
    copied_->block(impl.getStream(*shard_.device()));
  }
}

}  // namespace dtrain::engine::offload_detail
