// The CPU optimizer of optimizer offload (ZeRO-Offload style): fp32 master weights and
// optimizer state in (pinned) host memory, updated by the fused vectorized kernels of
// cpu_kernels.h on a thread team, with the new weights copied back to the parameters in
// their own device and dtype (bf16/fp16 under AMP), overlapped with updating the next tile.
//
// Flat parameter space. The parameters are laid end to end in the order given: parameter i
// holds flat elements [param_offset(i), param_offset(i) + numel_i). The space is padded with
// zeros to padded_numel(), a multiple of shard_count * kShardAlign elements, and split evenly:
// shard r is [r * S, (r + 1) * S) with S = padded_numel() / shard_count, so every shard
// starts on a 256-byte (fp32) boundary and reduce-scatter / all-gather see equal chunks. A
// rank keeps master weights and state for its own shard only: host memory per rank is
// 1/shard_count of the whole. Padding elements (>= numel()) are never updated or copied.
//
// One step:
//   begin_step(grad_multiplier);                 // t += 1
//   step_range(b, e, grads) ...                  // any number of disjoint ranges in the shard,
//                                                // e.g. one per reducer bucket as it arrives
//   end_step();                                  // every real element of the shard updated?
// or step(grad_multiplier), which does all three from the parameters' .grad.
//
// Synchronization. step_range() is synchronous on the host for the update: when it returns
// the master weights and state of [b, e) are final and `grads` may be reused. Copy-back:
//  * targets in host memory are written during the update itself (fp32/bf16/fp16 targets by
//    the kernel, in the same pass; other dtypes by a copy right after each tile);
//  * targets on a device (CUDA, ...) are written by non-blocking copies from pinned staging
//    tiles on a copy stream of that device taken from the device's stream pool. Those copies
//    are ordered after the work queued on the calling thread's current stream when
//    step_range() was called; while tile k copies, tile k + 1 is updated. end_step() makes the
//    calling thread's current stream wait for every copy of the step (no host sync), so work
//    queued afterwards on that stream sees the new weights.
// Thread-safety: none; calls must not overlap (step_range may run on any one thread at a
// time, e.g. a background thread fed by reducer buckets). The optimizer's own worker threads
// run only inside its calls.
// Ownership: the caller owns the parameters (and an output set by set_output) and the pool,
// which must outlive the optimizer; the optimizer owns its master, state and staging memory,
// allocated from the pool.
// Failures: bad input throws dtrain::Error naming the value and the fix, before anything of
// the call is updated (a host memory cap or MemAvailable error from the pool at construction).
//
// Not here (left to the caller; engine::OffloadedOptimizer does both): a one-step-delayed
// update overlapping the next forward / backward; gathering the shards of a checkpoint.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/offload/cpu_kernels.h"
#include "dtrain/offload/pinned_pool.h"
#include "dtrain/offload/update_rule.h"

namespace dtrain::offload {

// Shards start at multiples of this many elements (256 bytes of fp32).
inline constexpr int64_t kShardAlign = 64;

// The update rule (UpdateRuleOptions: torch.optim semantics, weight_decay decoupled for adamw,
// L2 for the others; eps is used as given for every rule: torch's Adagrad default is 1e-10,
// pass engine::effective_eps()), and how the CPU runs it.
struct CpuOptimizerOptions : UpdateRuleOptions {
  // Data-parallel partitioning: this rank keeps shard shard_rank of shard_count.
  int shard_rank = 0;
  int shard_count = 1;

  // Worker threads (the calling thread included); 0: default_thread_count() (OMP_NUM_THREADS,
  // else the cores this process may use).
  int threads = 0;
  // Kernel: "auto" (widest the CPU supports), "scalar", "avx2", "avx512".
  std::string isa = "auto";
  // Elements per tile: the unit of one fork-join of the threads and of one copy-back.
  // Smaller tiles start copies earlier; larger ones pay fewer barriers (~2 us each).
  int64_t tile_elems = int64_t{1} << 22;
  // Host arrays are allocated in chunks of this many elements (a power of two: pinned blocks
  // are rounded up to one), so a large shard wastes at most part of its last chunk.
  int64_t chunk_elems = int64_t{1} << 26;
  // Copy updated weights back to the parameters (or to set_output()'s tensor). false: only
  // the master weights change (read them with master_weights()).
  bool write_back = true;
};

// Throws dtrain::Error as validate_rule() does for the update-rule fields, and for
// shard_rank outside [0, shard_count), threads < 0, an unknown isa name, a non-positive
// tile_elems, or a chunk_elems that is not a power of two >= kShardAlign.
void validate(const CpuOptimizerOptions& options);

// The flat layout of `numel` elements split over shard_count ranks (see above).
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
int64_t padded_numel(int64_t numel, int shard_count);
ShardRange shard_range(int64_t numel, int shard_rank, int shard_count);

// The kernel constants of step t (1-based) of the rule in options (lr as given), with
// the gradient multiplied by grad_multiplier. Exposed for the kernel tests and benchmarks.
UpdateConfig make_update_config(const CpuOptimizerOptions& options, int64_t t,
                                double grad_multiplier = 1.0);

class CpuOptimizer {
 public:
  // params: dense, contiguous floating-point tensors (any device, any floating dtype), none
  // listed twice. The master weights of the shard are copied from them now. Throws
  // dtrain::Error as validate() does, for an empty list (or only empty tensors), a bad
  // parameter (named by index), parameters on more than one non-CPU device, or when the
  // pool refuses the memory.
  CpuOptimizer(std::vector<at::Tensor> params, CpuOptimizerOptions options, PinnedPool& pool);
  ~CpuOptimizer();  // waits for copies still in flight
  CpuOptimizer(const CpuOptimizer&) = delete;
  CpuOptimizer& operator=(const CpuOptimizer&) = delete;

  const std::vector<at::Tensor>& params() const;
  const CpuOptimizerOptions& options() const;
  int64_t numel() const;         // elements of all parameters
  int64_t padded_numel() const;  // numel() rounded up for the shards
  ShardRange shard() const;      // this rank's range of the flat space
  int64_t param_offset(size_t index) const;
  Isa isa() const;  // the kernel in use
  int threads() const;
  int64_t step_count() const;  // steps begun so far (t of the last begin_step)
  int64_t host_bytes() const;  // master + state memory held (pool charge)
  void set_lr(double lr);      // from the next begin_step; throws for lr < 0 / non-finite
  double lr() const;

  // Opens step t + 1: every gradient of this step is multiplied by grad_multiplier before
  // weight decay (e.g. 1 / loss scale, or a clipping factor). Throws when a step is open or
  // the multiplier is not finite.
  void begin_step(double grad_multiplier = 1.0);
  // Updates flat elements [begin, end) (within shard(); padding elements of the range are
  // ignored) from grads: end - begin elements (any shape) of float32, bfloat16 or float16,
  // preferably in host memory (pinned for a fast device copy before this call); another
  // device or dtype, or non-contiguous, is first copied to a host float32 tensor
  // (synchronously). Throws before updating anything for: no open step, a range outside the
  // shard or overlapping one already updated in this step, a wrong element count or dtype.
  void step_range(int64_t begin, int64_t end, const at::Tensor& grads);
  // Closes the step (see Synchronization). Throws when no step is open or when some real
  // element of the shard was not updated (naming the first missing range); the step stays
  // open then.
  void end_step();
  // begin_step + step_range over the shard from each parameter's .grad (its own device and
  // dtype; host float32/bf16/fp16 gradients are read in place) + end_step. An undefined
  // .grad counts as zero (the parameter's state and weight still advance: with a flat
  // state every parameter takes every step, as with the data-parallel reducer, which gives
  // unused parameters zero gradients).
  void step(double grad_multiplier = 1.0);

  // Copy-back target instead of the parameters: a contiguous 1-D tensor of numel() or
  // padded_numel() elements (any device, floating dtype) in flat order; after each step it
  // holds the new weights of the shard's elements (the rest untouched), e.g. for an in-place
  // all-gather. A tensor of shard().size() elements holds just the shard (element k is flat
  // element shard().begin + k), e.g. a staging buffer for a delayed update. An undefined tensor switches back to the parameters. Waits for copies in
  // flight. Throws when a step is open or for a wrong size, layout or dtype.
  void set_output(const at::Tensor& flat);
  // Reloads the shard's master weights from the parameters (e.g. after loading a model
  // checkpoint). Synchronous. Optimizer state is kept.
  void load_master_from_params();
  // A float32 host copy of the master weights of the shard's real elements.
  at::Tensor master_weights() const;

  // Named state for checkpoints, aliasing the live host memory (clone to keep a snapshot):
  //   "step": int64 0-dim, steps taken;
  //   "layout": int64 [numel, padded_numel, shard_count, shard_rank, chunk_elems];
  //   "<array>.<chunk>": float32 1-D, chunk c of the shard's array, for array "master" and the
  //   rule's state: adam/adamw "exp_avg", "exp_avg_sq" (+ "max_exp_avg_sq" with amsgrad);
  //   adagrad "sum"; sgd with momentum "momentum_buffer".
  // load_state() requires exactly these names with the same layout and sizes (any dtype
  // convertible to them) and throws naming the first missing, unknown or mis-shaped entry
  // before changing anything; it does not touch the parameters (copy-back happens at the
  // next step; call set_output/step as usual).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state);

 private:
  struct Impl;  // cpu_optimizer_impl.h
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
