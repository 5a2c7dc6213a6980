// Data-parallel gradient averaging, DDP-style.
//
// The reducer keeps every gradient as a view into a flat bucket (one dtype and device per
// bucket), so backward accumulates straight into the buckets and nothing is copied. A hook on
// each parameter's gradient accumulator marks the parameter ready; when every parameter of a
// bucket is ready the bucket's all-reduce (average over the communicator) is launched
// asynchronously, in bucket order, while backward continues. A callback queued at the end of
// backward launches what is left (parameters that got no gradient count as zero), waits for
// every bucket and writes results back, so when backward() returns the gradients are
// averaged. At the first zero_grad() after the first synchronized backward the buckets are
// rebuilt in the order the gradients really arrived (rank 0's order, broadcast, so every rank
// launches the same sequence); zero_grad() is then collective, once.
//
// Threading: hooks run on autograd's threads; the reducer locks internally. Ownership: the
// caller owns the parameters and the communicator, which must outlive the reducer. The
// reducer owns the bucket memory that the parameters' .grad tensors view. Do not replace
// .grad with another tensor (if it happens, the reducer copies the gradient back into its
// bucket at the next hook, at the cost of a copy).
//
// Every rank must construct the reducer over the same parameters (checked: the first
// differing parameter is named) and run the same number of synchronized backward passes.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/parallel/bucket_comm.h"

namespace dtrain::engine {

struct ReducerOptions {
  // The first bucket is small so communication starts early in backward (as DDP's 1 MB).
  int64_t first_bucket_bytes = int64_t{1} << 20;
  int64_t bucket_bytes = int64_t{25} << 20;
  // Before backward, find the parameters the graph of this step's outputs cannot reach and
  // mark them ready at once (call prepare_for_backward with the outputs). Without it such
  // parameters are found at the end of backward, which still works but starts their
  // buckets late and logs a warning once.
  bool find_unused_parameters = false;
  // Reduce buckets in bfloat16 or float16 (half the bytes), results written back in the
  // gradients' dtype. Empty: reduce in the gradients' dtype.
  std::optional<at::ScalarType> compress;
  // Copy rank 0's parameter values to every rank at construction.
  bool broadcast_parameters = true;
  // Rebuild buckets in the arrival order at the first zero_grad() after the first backward.
  bool rebuild_buckets = true;
  // Parameter names for messages (same length as the parameter list, or empty).
  std::vector<std::string> names;
  // Reduce each gradient element only to the rank that owns it instead of to every rank
  // (ZeRO-2 style, for a partitioned optimizer such as optimizer offload; about half the bytes
  // of an all-reduce): owned[r] = [begin, end) of the flat space (the parameters end to end,
  // in the given order) owned by rank r of the communicator; ascending, disjoint, together
  // covering every element (empty ranges allowed). After a synchronized backward a rank's
  // gradients are averaged inside its own range only; elsewhere they hold unspecified values.
  // Buckets then hold consecutive parameters (one flat range each, launched last-first) and
  // are not rebuilt; a bucket is reduced to each owner of a part of it. Empty: every rank
  // gets every average (all-reduce). Needs one dtype and device per bucket (consecutive
  // parameters of another dtype or device start a new bucket).
  std::vector<std::pair<int64_t, int64_t>> owned;
  // ZeRO-2 (needs `owned`): buckets also close where the owner changes, and a bucket holding
  // no element of this rank's range keeps no storage between steps. Its storage is allocated
  // at its first gradient of a step (the gradient is copied in), reduced to its owner, and
  // released as soon as that reduction completes: launching a bucket first waits for the
  // buckets launched before it (one reduction in flight at a time, overlapped with the rest
  // of backward), so the gradients whole at once are the current bucket's and those still
  // being computed. The released parameters' .grad become undefined.
  // Between steps a rank then holds its own range's gradients (plus a parameter straddling a
  // range boundary) instead of all of them. Gradients accumulated under no_sync stay whole
  // until the synchronized backward reduces them.
  bool release_unowned = false;
  // How each bucket is averaged (bucket_comm.h). Empty: AllReduceBuckets, or
  // ReduceToOwnerBuckets with `owned`, inside CompressedBuckets with `compress`. ZeRO-3 gives
  // its reduce-scatter (zero3/zero3_optimizer.h), which keeps no gradients here.
  std::shared_ptr<BucketComm> bucket_comm;
};

// What happened in the last synchronized backward, for tests, metrics and the timeline.
struct ReducerStepStats {
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> bucket_launch;  // per bucket, in launch order
  std::vector<int> hooks_before_launch;          // gradients ready when each bucket launched
  // When the communicator began and finished each bucket's all-reduce, where the backend
  // measures it (MPI); otherwise launch and the end of the wait.
  std::vector<Clock::time_point> bucket_start, bucket_end;
  std::vector<int64_t> bucket_bytes;
  Clock::time_point first_hook;
  Clock::time_point backward_end;                // when the end-of-backward callback began
  Clock::time_point reduced;                     // when every bucket was written back
  int64_t bytes = 0;                             // bytes all-reduced
  int unused_parameters = 0;
};

// A bucket whose average was just launched in a synchronized backward (see
// GradReducer::set_bucket_observer).
struct LaunchedBucket {
  int64_t backward = 0;          // which synchronized backward: 0, 1, ... (as counted by
                                 // synchronized_backwards() before it ends)
  size_t index = 0;              // launch position in this backward (among the observed buckets)
  size_t count = 0;              // observed buckets launched by every synchronized backward now
  std::vector<size_t> params;    // parameter indices, in bucket order
  std::vector<int64_t> offsets;  // element offset of each parameter in values
  // The averaged gradients once work completes (after work->wait(), ordered as a
  // collective's result): the bucket's flat storage, or its compressed (bf16/fp16) copy.
  // With ReducerOptions::owned only the elements this rank owns are averages. Valid until
  // the next zero_grad() or abandon_step(); never write to it.
  at::Tensor values;
  dist::WorkPtr work;  // completes when this rank's values of the bucket are final
};

class GradReducer {
 public:
  // params: leaf tensors requiring grad, contiguous. Collective (broadcast and checks).
  // Throws dtrain::Error naming the first parameter that differs across ranks.
  GradReducer(std::vector<at::Tensor> params, dist::Communicator& comm, ReducerOptions options = {});
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // While a NoSync is alive, backward passes only accumulate into the gradients: no
  // collective is issued. The next synchronized backward averages the accumulated sums.
  class NoSync {
   public:
    explicit NoSync(GradReducer* reducer);
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;

   private:
    GradReducer* reducer_;
  };
  NoSync no_sync() { return NoSync(this); }

  // A synchronized backward made of several autograd runs (the weight half of a split
  // backward runs autograd once per operation: split_backward.h): between begin_runs() and
  // end_runs() the backward does not end with the first run's end; end_runs() ends it (the
  // parameters no run reached are reduced as zeros, and the buckets waited for), as one
  // backward's end would. begin_runs() inside another or during a backward throws
  // dtrain::Error. Between two runs a NoSync may begin or end: the runs under it only
  // accumulate (their parameters are not marked ready).
  void begin_runs();
  void end_runs();

  // With find_unused_parameters: marks the parameters unreachable from outputs' graph as
  // ready (their buckets may launch now). Call after forward, before backward.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // Zeroes every gradient (the flat buckets) in place. Call once per step, after the
  // optimizer: it also marks the start of the next step for abandon_step(). On a one-rank
  // communicator with plain averaging (nothing to reduce) it drops the gradients instead
  // (undefined, as torch's zero_grad(set_to_none=True)) of every bucket no bucket observer
  // reads: the next backward's gradients are then autograd's own tensors, not added into
  // zeroed buckets, and a parameter that gets none in a synchronized backward gets zeros.
  void zero_grad();
  // Whether the gradients are autograd's own tensors, as above (one rank, plain averaging, no
  // bucket observer), not views of the buckets: a consumer may then take a .grad tensor and
  // leave .grad undefined (the one-rank delayed update of optimizer offload does).
  bool keeps_autograd_gradients() const;
  // The same for some of the parameters (each must be one of params()): true where the
  // buckets holding them are not read by the bucket observer either (one rank, plain
  // averaging). Throws dtrain::Error for a tensor that is not a parameter of the reducer.
  bool keeps_autograd_gradients(const std::vector<at::Tensor>& params) const;
  // Whether `param` is one of params() (the same tensor, not an equal one).
  bool holds(const at::Tensor& param) const;

  // After a failure on this rank (e.g. CUDA out of memory) during a step: unless this step's
  // synchronized backward already completed, issues the bucket all-reduces this rank still
  // owes (every bucket not yet launched, in order), so ranks that did not fail do not wait
  // forever, and waits for them; ends any no_sync and zeroes the gradients (not
  // collectively). Then agree across ranks that the step is dropped, and call zero_grad()
  // on every rank.
  void abandon_step();

  // After a failure on this rank during a step that this rank will run again from its start,
  // skipping what it issued already (the trainer's OOM back-off under ZeRO-3, whose unit
  // gathers are interleaved with the bucket reductions: Zero3Optimizer::replay_step): waits for the bucket reductions this step
  // launched (the other ranks take part in them), then forgets the step as if its
  // synchronized backward had not begun, issuing nothing. The gradients are left as they are.
  void forget_step();

  // Calls observer for every bucket as its average is launched in a synchronized backward
  // (abandoned steps included), on the launching thread (autograd's, or the caller's at the
  // end of backward) under the reducer's lock: the observer must only hand the event on
  // (e.g. queue it for a thread of its own), not block, and not call the reducer. Used by
  // optimizer offload to copy each bucket's gradients to the host while backward runs.
  // An empty function removes the observer. `observed`, by parameter index (empty: all):
  // the parameters the observer reads. Only the buckets holding one of them are reported
  // (LaunchedBucket::index and ::count number those), and on one rank with plain averaging
  // only those are views: the others keep autograd's own gradients, as without an observer.
  // Set it between steps (not during a synchronized backward: dtrain::Error); removing it
  // is allowed at any time.
  void set_bucket_observer(std::function<void(const LaunchedBucket&)> observer, std::vector<char> observed = {});

  const std::vector<at::Tensor>& params() const { return params_; }
  const BucketComm& bucket_comm() const;
  int num_buckets() const;
  // Parameter indices of each bucket, in launch order.
  std::vector<std::vector<size_t>> bucket_params() const;
  ReducerStepStats last_step_stats() const;
  // Bytes of gradient storage the buckets hold now (compressed copies and padding included).
  int64_t gradient_bytes() const;
  // With consecutive buckets (ReducerOptions::owned), the buckets this rank keeps share one
  // allocation in flat order: the gradients of flat elements [begin, end) as one view of it
  // (averaged where this rank owns them, after a synchronized backward). Undefined when the
  // range is not inside the kept buckets, or the buckets are not consecutive or mix dtypes or
  // devices. Valid as long as the reducer.
  at::Tensor flat_gradients(int64_t begin, int64_t end) const;
  int64_t synchronized_backwards() const;

 private:
  struct State;
  void set_sync(bool enabled);
  std::vector<at::Tensor> params_;
  std::shared_ptr<State> state_;
};

// Checks that every rank of comm has the same number of parameters with the same dtypes and
// shapes; otherwise throws dtrain::Error on every rank naming the first parameter that differs
// (by names[i] when given). Collective and synchronous. The reducer runs it at construction.
void check_same_parameters(const std::vector<at::Tensor>& params, dist::Communicator& comm,
                           const std::vector<std::string>& names = {});

// Copies root's values of tensors to every rank of comm (coalesced by dtype and device,
// in chunks). Collective and synchronous.
void broadcast_tensors(dist::Communicator& comm, const std::vector<at::Tensor>& tensors,
                       int root = 0);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
