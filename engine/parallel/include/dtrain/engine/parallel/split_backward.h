// A backward pass split in two halves, for zero-bubble pipeline schedules (pipeline.h, "zb"):
// first the gradient of a stage's input (what the stage before waits for), later the gradients
// of the stage's weights (work no other stage waits for, which fills the pipeline's bubble).
//
// How: the first half is an autograd run for the input only (autograd then skips every
// weight-gradient computation and every AccumulateGrad), keeping the graph. During it, each
// boundary operation - one whose backward feeds both the path to the input and a path that
// reaches only parameters (a Linear's matmul, a layer norm, an add of a position embedding) -
// hands over the gradient it was given (a pre-hook keeps it). The second half runs autograd
// once per boundary operation from that gradient, for the parameters beyond it only: each
// weight-gradient computation runs exactly once, and the gradient path is not computed again.
// The parameters' .grad then hold what one backward() would have accumulated (summed in
// another order: equal to rounding), and their accumulation hooks fire as in a backward.
//
// A parameter read both beyond a boundary operation and on its path to the input (a weight used
// twice in one stage, e.g. tied or shared) would be counted twice: refused with dtrain::Error.
// A block under activation checkpointing (activation_checkpoint.h) is one boundary operation:
// correct, but its recomputation runs in both halves.
#pragma once

#include <memory>

#include <ATen/core/Tensor.h>

namespace dtrain::engine {

class SplitBackward {
 public:
  // The first half: the gradient of `input` (a leaf that requires grad; undefined for a first
  // stage, whose input is data: then nothing runs now and the second half is the whole
  // backward) from `output` given its gradient `grad` (undefined: output is a scalar, gradient
  // 1), capturing what the second half needs. The second half accumulates into every leaf
  // that requires grad (other than input) the graph reaches, as backward() would. Throws
  // dtrain::Error for an output without a graph, an output that does not depend on a defined
  // input, or a parameter used twice as above.
  SplitBackward(const at::Tensor& output, const at::Tensor& grad, const at::Tensor& input);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  // The gradient of the input (undefined for a first stage).
  const at::Tensor& input_grad() const;
  // The second half: accumulates the parameters' gradients into their .grad and frees the
  // graph. Once; throws dtrain::Error on a second call.
  void weight_half();
  // Autograd runs the second half takes (one per boundary operation; 1 for a first stage).
  int weight_runs() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
