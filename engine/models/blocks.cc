#include "dtrain/engine/models/blocks.h"

#include <string>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

void BlockStackImpl::append(torch::nn::AnyModule block) {
  DTRAIN_CHECK(index_.empty(),
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

at::Tensor BlockStackImpl::forward(const at::Tensor& x) { return forward_range(x, 0, blocks_.size()); }

at::Tensor BlockStackImpl::forward_range(const at::Tensor& x, size_t begin, size_t end) {
  DTRAIN_CHECK(begin <= end && end <= blocks_.size(), "BlockStack::forward_range(", begin, ", ", end,
               ") of a stack of ", blocks_.size(), " blocks");
  if (runner_) return runner_->run(*this, x, begin, end);
  at::Tensor h = x;
  for (size_t i = begin; i < end; ++i) h = run_block(i, h);
  return h;
}

void BlockStackImpl::keep_range(int begin, int end) { keep_ranges({{begin, end}}); }

void BlockStackImpl::keep_ranges(const std::vector<std::pair<int, int>>& ranges) {
  DTRAIN_CHECK(index_.empty() && static_cast<int>(blocks_.size()) == whole_ && !runner_,
               "BlockStack::keep_range: once, on the whole stack, before anything is installed around it");
  DTRAIN_CHECK(!ranges.empty(), "BlockStack::keep_ranges: no range; a stage keeps at least one block of the stack");
  std::vector<bool> keep(static_cast<size_t>(whole_), false);
  int previous_end = 0;
  for (const auto& [begin, end] : ranges) {
    DTRAIN_CHECK(previous_end <= begin && begin < end && end <= whole_, "BlockStack::keep_range(", begin, ", ", end,
                 ") of a stack of ", whole_, " blocks: each range keeps at least one block of the stack, in "
                 "ascending order without overlap");
    for (int i = begin; i < end; ++i) keep[static_cast<size_t>(i)] = true;
    previous_end = end;
  }
  std::vector<torch::nn::AnyModule> kept;
  std::vector<int> index;
  for (int i = 0; i < whole_; ++i) {
    if (keep[static_cast<size_t>(i)]) {
      kept.push_back(blocks_[static_cast<size_t>(i)]);
      index.push_back(i);
    } else {
      unregister_module(std::to_string(i));
    }
  }
  blocks_ = std::move(kept);
  index_ = std::move(index);
}

}  // namespace dtrain::engine
