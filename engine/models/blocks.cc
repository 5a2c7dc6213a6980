#include "dtrain/engine/models/blocks.h"

#include <string>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

void BlockStackImpl::append(torch::nn::AnyModule block) {
  DTRAIN_CHECK(first_ == 0 && static_cast<int>(blocks_.size()) == whole_,
               "BlockStack::push_back after keep_range(): build the whole stack first, then keep a stage's part");
  register_module(std::to_string(whole_), block.ptr());
  blocks_.push_back(std::move(block));
  ++whole_;
}

std::shared_ptr<torch::nn::Module> BlockStackImpl::block(size_t i) const {
  DTRAIN_CHECK(i < blocks_.size(), "BlockStack::block(", i, ") of a stack of ", blocks_.size(), " blocks");
  return blocks_[i].ptr();
}

at::Tensor BlockStackImpl::run_block(size_t i, const at::Tensor& x) {
  DTRAIN_CHECK(i < blocks_.size(), "BlockStack::run_block(", i, ") of a stack of ", blocks_.size(), " blocks");
  return blocks_[i].forward(x);
}

at::Tensor BlockStackImpl::forward(const at::Tensor& x) {
  if (runner_) return runner_->run(*this, x);
  at::Tensor h = x;
  for (size_t i = 0; i < blocks_.size(); ++i) h = run_block(i, h);
  return h;
}

void BlockStackImpl::keep_range(int begin, int end) {
  DTRAIN_CHECK(first_ == 0 && static_cast<int>(blocks_.size()) == whole_ && !runner_,
               "BlockStack::keep_range: once, on the whole stack, before anything is installed around it");
  DTRAIN_CHECK(0 <= begin && begin < end && end <= whole_, "BlockStack::keep_range(", begin, ", ", end,
               ") of a stack of ", whole_, " blocks: a stage keeps at least one block of the stack");
  std::vector<torch::nn::AnyModule> kept(blocks_.begin() + begin, blocks_.begin() + end);
  for (int i = 0; i < whole_; ++i) {
    if (i < begin || i >= end) unregister_module(std::to_string(i));
  }
  blocks_ = std::move(kept);
  first_ = begin;
}

}  // namespace dtrain::engine
