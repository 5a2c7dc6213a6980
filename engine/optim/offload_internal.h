// Private to optimizer offload: the three parts OffloadedOptimizer is made of. The host shard
// (this rank's master weights and state, updated by the CPU optimizer), the gradient streamer
// (a thread copying each reduced bucket's part of the shard to the host during backward) and
// the delayed updater (a thread running one CPU update while the next step computes). Not
// installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/optim/cpu_shard.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"

namespace dtrain::engine::offload_detail {

// Gradients of the shard's real elements in pinned host memory, in chunks of the CPU
// optimizer's chunk_elems (pinned blocks are rounded up to a power of two, so one 12 GB
// buffer would take 16 GB): chunk c holds shard elements [c * chunk, ...).
struct HostGrads {
  std::vector<at::Tensor> chunks;
};

// This rank's shard on the host: the pinned pool, the CPU optimizer (fp32 master weights and
// state of the shard) and the flat device buffer that the parameters become views of. Not
// thread-safe: used by one thread at a time (the caller's, or the delayed updater's while its
// update runs); the layout accessors are immutable and safe from any thread.
class HostShard {
 public:
  // params: one dtype and device (checked by the caller); they become views of flat().
  HostShard(std::vector<at::Tensor>& params, const OptimizerOptions& options, dist::Communicator& dp,
            const OffloadOptions& offload);

  int64_t numel() const { return numel_; }
  int64_t lo() const { return lo_; }  // this rank's real elements [lo, hi) of the flat space
  int64_t hi() const { return hi_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }  // flat offset of each parameter
  const std::optional<c10::Device>& device() const { return device_; }  // unset on the CPU
  const at::Tensor& flat() const { return flat_; }
  // Host parameters that were page-locked (layer offload on a GPU): flat() is, and so must be a
  // buffer swapped in (swap_flat()).
  bool pinned() const { return pinned_; }
  offload::CpuOptimizer& cpu() { return *cpu_; }
  const offload::CpuOptimizer& cpu() const { return *cpu_; }
  int64_t host_bytes() const { return pool_->used_bytes(); }

  HostGrads allocate_grads() const;
  // Calls fn(chunk index, offset in chunk, n, offset in the shard) for the pieces of shard
  // elements [a, b) (relative to lo()) split at chunk boundaries.
  template <typename Fn>
  void for_each_piece(int64_t a, int64_t b, Fn&& fn) const {
    while (a < b) {
      const int64_t c = a / chunk_, in = a % chunk_;
      const int64_t n = std::min(b - a, chunk_ - in);
      fn(static_cast<size_t>(c), in, n, a);
      a += n;
    }
  }
  // The shard's part of each parameter's .grad into g (undefined gradients as zeros).
  void copy_grads_from_params(HostGrads& g, const std::vector<at::Tensor>& params) const;
  // One CPU update of the shard, from g, from the parameters' .grad, or from `grads` (one
  // tensor per parameter, in the parameters' order, undefined as zeros), each gradient times
  // multiplier; the new weights go to the output (set_output()).
  void update(const HostGrads& g, double multiplier, double lr);
  void update_from_params(double multiplier, double lr);
  void update_from(const std::vector<at::Tensor>& grads, double multiplier, double lr);
  // Host parameters of one rank (no device, no other shard): the delayed update may hand the
  // parameters' own gradients to the update and publish by swapping buffers instead of
  // copying (see swap_flat()).
  bool host_local() const { return !device_ && dp_->size() == 1; }
  // host_local() only: `other` (a tensor of flat()'s size and dtype holding new weights)
  // becomes flat() and the parameters become views of it; `other` then holds the old flat().
  // Nothing may read or write either buffer meanwhile (no update in flight).
  void swap_flat(at::Tensor& other);
  // Where updates write the new weights: flat() (the default) or a shard-sized device buffer.
  void set_output(const at::Tensor& target);
  // Every rank's shard of `shard` into flat() (all-gather over dp; a copy with one rank).
  void all_gather(const at::Tensor& shard);
  at::Tensor own_part_of_flat() const;  // this rank's slice of the padded flat buffer

 private:
  void point_params_at_flat();

  dist::Communicator* dp_;
  std::vector<at::Tensor> params_;  // the parameters (views of flat_)
  std::unique_ptr<offload::PinnedPool> pool_;
  std::unique_ptr<offload::CpuOptimizer> cpu_;
  at::Tensor flat_;    // the parameters' storage, padded_numel elements
  at::Tensor output_;  // where updates write (flat_ unless set_output said otherwise)
  int64_t numel_ = 0, lo_ = 0, hi_ = 0;
  int64_t chunk_ = 0;  // elements per host chunk (the CPU optimizer's chunk_elems)
  at::ScalarType host_dtype_ = at::kFloat;
  bool pinned_ = false;
  std::optional<c10::Device> device_;
  std::vector<int64_t> offsets_;
};

// Copies each bucket's part of the shard into a host gradient buffer as soon as the reducer
// has launched its average, on a worker thread (and a copy stream of the parameters' device,
// so the host never waits for the GPU), while backward goes on.
class GradientStreamer {
 public:
  // params: the optimizer's parameters (the reducer may hold more; those are ignored).
  // Registers the bucket observer; the reducer must outlive the streamer.
  GradientStreamer(const HostShard& shard, const std::vector<at::Tensor>& params, GradReducer& reducer,
                   HostGrads* target);
  // Removes the observer, stops the worker (queued copies are dropped) and waits for copies
  // still in flight on the copy stream, so the host buffers may be freed afterwards.
  ~GradientStreamer();

  // Copies of buckets taken from now on go to target (the delayed update alternates buffers).
  void set_target(HostGrads* target) { target_.store(target); }
  // A synchronized backward whose copies have not been taken yet.
  bool pending();
  // Waits for that backward's copies (rethrowing a failed one) and marks them taken:
  // host_sync blocks the host until the copies are done; otherwise the calling thread's
  // current stream waits for them (no host sync).
  void take(bool host_sync);

 private:
  void loop();
  void copy(const LaunchedBucket& bucket);

  const HostShard& shard_;
  GradReducer& reducer_;
  std::vector<int64_t> reducer_index_;  // reducer parameter -> ours (-1: not ours)
  std::atomic<HostGrads*> target_;
  std::optional<c10::Stream> copy_stream_;
  std::optional<c10::Event> copied_;  // recorded after each bucket's copies
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<LaunchedBucket> queue_;  // guarded by mu_
  bool stop_ = false;                 // guarded by mu_
  int64_t announced_ = -1;            // newest backward seen (guarded by mu_)
  size_t expected_ = 0;               // its buckets (guarded by mu_)
  size_t processed_ = 0;              // its buckets copied or failed (guarded by mu_)
  std::exception_ptr error_;          // guarded by mu_
  int64_t taken_ = -1;                // the backward whose copies were taken (caller's thread)
  std::thread worker_;
};

// The one-step-delayed update: runs one CPU update at a time on a thread of its own, writing
// the new weights into a shard-sized device buffer that publish() all-gathers into the
// parameters later.
class DelayedUpdater {
 public:
  explicit DelayedUpdater(HostShard& shard);
  ~DelayedUpdater();  // waits for the update in flight (its result is dropped)

  // Starts updating from g (which must stay untouched until the update is published or
  // dropped) in the background. Nothing may be in flight.
  void start(const HostGrads& g, double multiplier, double lr);
  // The same from the parameters' own gradient tensors (HostShard::update_from), which the
  // update keeps until it is done: the caller hands them over (and drops them from .grad).
  void start(std::vector<at::Tensor> grads, double multiplier, double lr);
  bool in_flight() const { return in_flight_; }
  // The host waits for the update in flight and rethrows its failure (nothing is in flight
  // after a failure). The result stays unpublished.
  void wait();
  // wait(), then the update's weights into the parameters (collective over dp; one rank's
  // host parameters: a swap of the two weight buffers, HostShard::swap_flat). No-op when
  // nothing is in flight.
  void publish();
  // wait(), and forget the result (a loaded state replaces it).
  void drop();
  std::optional<UpdateTiming> take_timing();
  const at::Tensor& next() const { return next_; }  // the new weights' buffer (see below)

 private:
  struct Job {
    const HostGrads* grads = nullptr;   // or
    std::vector<at::Tensor> taken;      // one per parameter (grads == nullptr)
    double multiplier = 1.0;
    double lr = 0.0;
  };
  void loop();
  void queue(Job job);

  HostShard& shard_;
  at::Tensor next_;  // the update's new weights: this rank's shard, on the parameters' device
  std::optional<c10::Stream> update_stream_;
  std::optional<c10::Event> published_;    // caller's stream: the all-gather has read next_
  std::optional<c10::Event> update_done_;  // update stream: next_ written
  bool in_flight_ = false;                 // started and not yet published or dropped
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Job> job_;              // guarded by mu_: queued or running
  bool stop_ = false;                   // guarded by mu_
  std::exception_ptr error_;            // guarded by mu_
  std::deque<UpdateTiming> timings_;    // guarded by mu_: finished updates not yet taken, oldest first
  std::thread thread_;
};

}  // namespace dtrain::engine::offload_detail
