// Optimizer offload: the one-step-delayed update (see offload_internal.h).
#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/offload/page_locked.h"
#include "offload_internal.h"

namespace dtrain::engine::offload_detail {

DelayedUpdater::DelayedUpdater(HostShard& shard) : shard_(shard) {
  const int64_t n = shard.cpu().shard().size();
  next_ = offload::host_empty({n}, shard.flat().scalar_type(), shard.pinned()).zero_();  // exact size
  if (const auto& device = shard.device()) {
    c10::impl::VirtualGuardImpl impl(device->type());
    update_stream_ = impl.getStreamFromGlobalPool(*device, /*isHighPriority=*/false);
    published_.emplace(device->type());
    update_done_.emplace(device->type());
  }
  thread_ = std::thread([this] { loop(); });
}

DelayedUpdater::~DelayedUpdater() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !job_.has_value(); });  // the update in flight, if any
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void DelayedUpdater::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || job_.has_value(); });
      if (stop_) return;
      job = *job_;  // the gradients stay referenced by job_ until it is reset below
    }
    std::exception_ptr failure;
    std::optional<UpdateTiming> timing;
    try {
      std::optional<c10::StreamGuard> guard;
      if (update_stream_) {
        guard.emplace(*update_stream_);
        published_->block(*update_stream_);  // next_ was read by the last all-gather
      }
      const auto start = std::chrono::steady_clock::now();
      if (job.grads) {
        shard_.update(*job.grads, job.multiplier, job.lr);
      } else {
        shard_.update_from(job.taken, job.multiplier, job.lr);
      }
      if (update_stream_) update_done_->record(*update_stream_);
      timing = UpdateTiming{start, std::chrono::steady_clock::now(), true};
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_.reset();
      error_ = failure;
      if (timing) timings_.push_back(*timing);
    }
    cv_.notify_all();
  }
}

void DelayedUpdater::start(const HostGrads& g, double multiplier, double lr) {
  Job job;
  job.grads = &g;
  job.multiplier = multiplier;
  job.lr = lr;
  queue(std::move(job));
}

void DelayedUpdater::start(std::vector<at::Tensor> grads, double multiplier, double lr) {
  Job job;
  job.taken = std::move(grads);
  job.multiplier = multiplier;
  job.lr = lr;
  queue(std::move(job));
}

void DelayedUpdater::queue(Job job) {
  DTRAIN_CHECK(!in_flight_, "delayed update: an update is still in flight; publish() it first");
  shard_.set_output(next_);  // on this thread: no update is running now
  if (published_) {
    c10::impl::VirtualGuardImpl impl(shard_.device()->type());
    published_->record(impl.getStream(*shard_.device()));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
  }
  cv_.notify_all();
  in_flight_ = true;
}

void DelayedUpdater::wait() {
  if (!in_flight_) return;
  std::exception_ptr failure;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !job_.has_value(); });
    failure = error_;
    error_ = nullptr;
  }
  if (failure) {
    in_flight_ = false;
    std::rethrow_exception(failure);
  }
}

void DelayedUpdater::publish() {
  if (!in_flight_) return;
  wait();
  in_flight_ = false;
  if (update_done_) {
    c10::impl::VirtualGuardImpl impl(shard_.device()->type());
    update_done_->block(impl.getStream(*shard_.device()));
  }
  // One rank's host parameters: next_ becomes the weights (the parameters are pointed at it)
  // and the old weights' buffer takes the next update, instead of a copy of every weight.
  if (shard_.host_local()) {
    shard_.swap_flat(next_);
  } else {
    shard_.all_gather(next_);
  }
}

void DelayedUpdater::drop() {
  wait();
  in_flight_ = false;
}

std::optional<UpdateTiming> DelayedUpdater::take_timing() {
  std::lock_guard<std::mutex> lock(mu_);
  if (timings_.empty()) return std::nullopt;
  UpdateTiming t = timings_.front();
  timings_.pop_front();
  return t;
}

}  // namespace dtrain::engine::offload_detail
