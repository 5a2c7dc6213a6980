// The global gradient norm of a model whose gradients are spread over ranks: split across a
// tensor-parallel group, and/or reduced only to their owners across the data-parallel group.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/core/shard.h"

namespace dtrain::engine {

// Global L2 norm of the given gradients (undefined ones skipped), accumulated in float32
// (float64 for float64 gradients) and returned as a 0-dim float32 tensor on the first
// defined gradient's device (CPU and 0 when none is defined). Enqueues work, no host sync.
// A host gradient whose norm was noted with note_device_norm() (and not changed since) counts
// with that norm instead of being read on the host.
at::Tensor grad_norm(const std::vector<at::Tensor>& grads);

// Layer offload: `host_copy` (a host tensor of its own storage, e.g. the page-locked copy of a
// streamed block's gradient) has the 2-norm `norm` (0-dim, float32 or float64, on the device the
// copy came from, computed there before the copy). grad_norm() then takes it instead of reading
// the host memory, for as long as the copy is alive and unchanged: any tensor sharing its
// storage (the gradient autograd adopted from it) counts while its version counter is the one
// noted here, so an in-place change (accumulation, masking, zeroing) makes it read again.
void note_device_norm(const at::Tensor& host_copy, at::Tensor norm);

// Where this rank's gradients sit in the whole model's.
struct GradNormLayout {
  // Per parameter: split across the tensor-parallel group (its squares are summed over tp,
  // replicated parameters' counted once). Empty: none is.
  std::vector<bool> sharded;
  dist::Communicator* tp = nullptr;  // needed when a parameter is sharded and tp has > 1 rank
  // Gradients reduced to their owners (a partitioned optimizer): only the `owned` ranges of the
  // flat gradient space (the parameters end to end; ascending, disjoint; possibly none: a rank
  // that holds only padding) count here, and the squares are summed over dp as well (every
  // element is owned by one rank of dp). ZeRO-1/2: this rank's one range
  // (ReducerOptions::owned); ZeRO-3: its piece of each unit. false: every gradient counts, not
  // summed over dp.
  bool partitioned = false;
  std::vector<FlatRange> owned;
  dist::Communicator* dp = nullptr;  // needed when partitioned
  // Partitioned: the owned ranges' gradients in one flat tensor, range k from element owned_at[k]
  // (ZeRO-3's gradient shard, whose parameters' .grad are undefined), read instead of the
  // parameters' .grad. Undefined: .grad.
  at::Tensor owned_values;
  std::vector<int64_t> owned_at;
  // Pipeline stages: each parameter lives on one stage, so the squares are summed over pp too
  // (nullptr or one rank: no pipeline).
  dist::Communicator* pp = nullptr;
};

// The L2 norm of every gradient of the model, the same on every rank: a 0-dim float32 tensor
// on the first parameter's device (squares accumulated in float32). Undefined gradients count
// as zero. Without sharded parameters (or a tp of one rank) and without owned, it is
// grad_norm() of the gradients. Collective over tp, dp and/or pp where they apply; enqueues work,
// no host sync. Throws dtrain::Error for a sharded list of another length, owned without dp,
// or no gradient at all.
at::Tensor global_grad_norm(const std::vector<at::Tensor>& params, const GradNormLayout& layout);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
