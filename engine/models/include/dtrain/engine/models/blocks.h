// A model's stack of blocks: the modules that each map the residual stream to a tensor of the
// same shape, run one after another. A model holds one BlockStack and calls its forward() as a
// plain loop; what runs around each block (activation checkpointing, layer streaming, ZeRO-3's
// gathers of a unit's weights, a pipeline stage's range) is installed from outside by the
// library (models/model_spec.h: apply through the Trainer built from a ModelSpec), so the
// model itself never calls into a sharding runtime, a layer streamer or a schedule
// (torchtitan's parallelize over a plain model; FSDP's fully_shard(block)).
//
//   struct MyModelImpl : torch::nn::Module {
//     MyModelImpl() {
//       blocks = register_module("blocks", dtrain::engine::BlockStack());
//       for (int i = 0; i < 4; ++i) blocks->push_back(MyBlock(...));  // any module with forward(Tensor)
//     }
//     at::Tensor forward(at::Tensor x) { return blocks->forward(x); }
//     dtrain::engine::BlockStack blocks{nullptr};
//   };
//
// Names: block i is registered as "<i>" (its whole-model index), so its parameters are
// "<stack name>.<i>.<...>" whatever part of the stack a pipeline stage keeps.
// Threading: one thread runs forward (autograd's threads run the recomputations).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

namespace dtrain::engine {

class BlockStackImpl;

// What runs the stack's blocks when something is installed around them (the library's
// techniques; see model_spec.h). run() must compute the same function as running blocks
// [begin, end) of the stack in order (BlockStackImpl::run_block), and is called from forward()
// and forward_range() only.
class BlockRunner {
 public:
  virtual ~BlockRunner() = default;
  virtual at::Tensor run(BlockStackImpl& stack, const at::Tensor& x, size_t begin, size_t end) = 0;
};

class BlockStackImpl : public torch::nn::Module {
 public:
  BlockStackImpl() = default;

  // Appends a block: a module (ModuleHolder or shared_ptr) with at::Tensor forward(const
  // at::Tensor&) (or forward(at::Tensor)), registered as the next whole-model index.
  template <typename M>
  void push_back(M block) {
    append(torch::nn::AnyModule(std::move(block)));
  }

  // The blocks of this stack in order, each through run_block(), or through the installed
  // runner.
  at::Tensor forward(const at::Tensor& x);
  // Blocks [begin, end) of this stack (local indices) in order, as forward() runs them: an
  // interleaved pipeline stage's model chunk.
  at::Tensor forward_range(const at::Tensor& x, size_t begin, size_t end);

  // This stack's blocks (a pipeline stage's, after keep_range()).
  size_t size() const { return blocks_.size(); }
  // The whole-model index of this stack's i-th block (the index in its name).
  int index(size_t i) const { return index_.empty() ? static_cast<int>(i) : index_.at(i); }
  // The whole model's number of blocks (before keep_range()).
  int whole_size() const { return whole_; }
  // This stack's i-th block as a module, and its forward on x.
  std::shared_ptr<torch::nn::Module> block(size_t i) const;
  at::Tensor run_block(size_t i, const at::Tensor& x);

  // A pipeline stage's part: keeps blocks [begin, end) of the whole model (whole-model indices)
  // under their names and drops the others. Once, before any runner is installed; throws
  // dtrain::Error for a range outside the stack.
  void keep_range(int begin, int end);
  // The same for several ranges, ascending and disjoint (an interleaved pipeline stage's
  // model chunks): the kept blocks in whole-model order.
  void keep_ranges(const std::vector<std::pair<int, int>>& ranges);

  // The runner the library installs (null: none, each block in order). Not owned here: shared
  // so that it outlives the stack's users.
  void set_runner(std::shared_ptr<BlockRunner> runner) { runner_ = std::move(runner); }
  BlockRunner* runner() const { return runner_.get(); }

 private:
  void append(torch::nn::AnyModule block);
  std::vector<torch::nn::AnyModule> blocks_;
  std::vector<int> index_;  // whole-model index of each kept block (empty: the whole stack)
  int whole_ = 0;  // blocks the whole model has
  std::shared_ptr<BlockRunner> runner_;
};
TORCH_MODULE(BlockStack);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
