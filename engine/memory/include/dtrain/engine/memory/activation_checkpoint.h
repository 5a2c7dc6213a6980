// Activation checkpointing: run a block without keeping its activations and recompute them
// in backward. Gradients equal the plain block's exactly: the recomputation restores the
// CPU and CUDA random-number states (so dropout draws the same masks) and the autocast
// state captured at forward.
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::engine {

using TensorFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Returns fn(inputs), computed under no_grad; the autograd graph recomputes fn in backward.
// `params` are the tensors fn reads besides its inputs that need gradients (the block's
// parameters); they receive gradients through the normal accumulation path (their
// AccumulateGrad hooks fire, so the data-parallel reducer sees them). fn must be a pure
// function of inputs, params and the RNG state. With grad mode off, or when no input or
// param requires grad, this is just fn(inputs).
//
// Details of the contract:
//  * A tensor fn reads that needs a gradient but is not in inputs or params gets none.
//  * Every floating-point output requires grad (which ones really depend on a tensor that
//    needs one is only known when recomputing); gradients flowing into an output that turns
//    out not to need one are dropped. Integer outputs never require grad.
//  * Backward saves the current CPU generator state, and that of every CUDA device holding
//    an input or param, sets the states recorded at forward, recomputes, and restores them:
//    the default generators are process-wide, so other threads drawing random numbers
//    during a recomputation disturb (and see) the replay.
//  * The recomputation runs under the autocast state (CPU and CUDA: enabled, dtype, cache)
//    recorded at forward, whatever the state when backward runs.
//  * Inputs are saved for backward with autograd's version check: modifying one in place
//    before backward throws there. Params are not checked (they may be refilled in place,
//    e.g. by layer offload) and must hold the forward's values when backward runs.
//  * Gradients for params are computed with torch::autograd::grad on the recomputed graph
//    and then accumulated through the params' AccumulateGrad nodes in the outer backward:
//    post-hooks on those nodes fire once per backward, but hooks registered with
//    Tensor::register_hook on a leaf param also see the recomputation's (identical) gradient,
//    i.e. they fire twice.
//  * Backward with create_graph=true (double backward) throws dtrain::Error.
//  * fn is copied and kept with the autograd graph until the graph is freed.
std::vector<at::Tensor> checkpoint(const TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params);

// Calls around the block's two runs, e.g. to bring offloaded weights to the device
// (offload::LayerStreamer) and send them back. Any may be empty. after_* run even when the
// block throws. Gradients of params are returned on each param's device as it is after
// after_recompute (so host-resident parameters get host gradients).
struct CheckpointHooks {
  std::function<void()> before_forward, after_forward, before_recompute, after_recompute;
  // Host parameters' gradients (copied from the device to page-locked memory): by default the
  // host waits for each block's copies before its backward returns, since autograd may add
  // them into a gradient on the CPU at once. true: where none of the block's host parameters
  // has a gradient yet (autograd then adopts the copy without reading it), the wait is left to
  // the end of the autograd backward (one engine callback waits for every such copy), so the
  // copies overlap the backward of the blocks before. Only where nothing reads a gradient
  // during backward: a one-rank reducer that keeps autograd's gradients (not one that copies
  // them into buckets), no hook reading them.
  bool defer_host_gradient_wait = false;
};
std::vector<at::Tensor> checkpoint(const TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params, const CheckpointHooks& hooks);
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const std::vector<at::Tensor>& params,
                      const CheckpointHooks& hooks);

// Convenience for one tensor in, one out.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const std::vector<at::Tensor>& params);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
