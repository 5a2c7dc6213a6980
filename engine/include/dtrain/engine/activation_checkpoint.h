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
// function of inputs, params and the RNG state. With grad mode off this is just fn(inputs).
std::vector<at::Tensor> checkpoint(const TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params);

// Convenience for one tensor in, one out.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const std::vector<at::Tensor>& params);

}  // namespace dtrain::engine
