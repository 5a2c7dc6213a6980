// Activation checkpointing: a checkpointed block gives the plain block's outputs and
// gradients bit for bit (dropout included), in sequence, under autocast, and its parameters'
// gradient-accumulation hooks fire once per backward.
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/optim/amp.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

constexpr int64_t kBatch = 4, kDim = 8, kHidden = 16;

// Linear -> GELU -> Dropout(0.3) -> Linear, in training mode.
torch::nn::Sequential make_block(uint64_t seed, at::ScalarType dtype) {
  torch::manual_seed(seed);
  torch::nn::Sequential block(torch::nn::Linear(kDim, kHidden), torch::nn::GELU(),
                              torch::nn::Dropout(0.3), torch::nn::Linear(kHidden, kDim));
  block->to(dtype);
  block->train();
  return block;
}

// What one forward/backward produced.
struct Result {
  at::Tensor output, input_grad;
  std::vector<at::Tensor> param_grads;
  at::Tensor rng_after;  // a draw after backward: the RNG must be where the plain run left it
};

// Runs blocks in sequence on a seeded input, plain or checkpointed, then backward on a
// random projection of the output drawn after the forward (so the RNG moves on before
// backward, as it does in training).
Result run(std::vector<torch::nn::Sequential>& blocks, bool checkpointed, at::ScalarType dtype,
           AmpMode amp = AmpMode::kOff) {
  for (auto& b : blocks) b->zero_grad();
  torch::manual_seed(1234);
  at::Tensor x = torch::randn({kBatch, kDim}, torch::dtype(dtype)).requires_grad_(true);
  at::Tensor y = x;
  {
    AutocastGuard autocast(c10::kCPU, amp);
    for (auto& b : blocks) {
      auto fn = [b](const at::Tensor& in) mutable { return b->forward(in); };
      y = checkpointed ? checkpoint(fn, y, b->parameters()) : fn(y);
    }
  }
  at::Tensor w = torch::randn(y.sizes(), torch::dtype(y.scalar_type()));
  (y * w).sum().backward();
  Result r{y.detach(), x.grad(), {}, torch::randn({4}, torch::kDouble)};
  for (auto& b : blocks) {
    for (const at::Tensor& p : b->parameters()) r.param_grads.push_back(p.grad().clone());
  }
  return r;
}

void expect_identical(const Result& plain, const Result& ckpt) {
  EXPECT_TRUE(at::equal(ckpt.output, plain.output));
  ASSERT_TRUE(ckpt.input_grad.defined());
  EXPECT_TRUE(at::equal(ckpt.input_grad, plain.input_grad))
      << "rel error " << testing_util::rel_error(ckpt.input_grad, plain.input_grad);
  ASSERT_EQ(ckpt.param_grads.size(), plain.param_grads.size());
  for (size_t i = 0; i < plain.param_grads.size(); ++i) {
    ASSERT_TRUE(ckpt.param_grads[i].defined()) << "param " << i;
    EXPECT_TRUE(at::equal(ckpt.param_grads[i], plain.param_grads[i]))
        << "param " << i << " rel error "
        << testing_util::rel_error(ckpt.param_grads[i], plain.param_grads[i]);
  }
  EXPECT_TRUE(at::equal(ckpt.rng_after, plain.rng_after));
}

TEST(ActivationCheckpoint, OneBlockWithDropoutMatchesPlainBitForBit) {
  std::vector<torch::nn::Sequential> blocks = {make_block(7, at::kDouble)};
  Result plain = run(blocks, false, at::kDouble);
  Result ckpt = run(blocks, true, at::kDouble);
  // Dropout was active (so replaying its random mask is what is being tested): the output
  // differs from the block's output in eval mode.
  blocks[0]->eval();
  torch::manual_seed(1234);
  at::Tensor x = torch::randn({kBatch, kDim}, torch::kDouble);
  EXPECT_FALSE(at::allclose(blocks[0]->forward(x), plain.output));
  blocks[0]->train();
  expect_identical(plain, ckpt);
}

TEST(ActivationCheckpoint, TwoBlocksInSequenceMatchPlain) {
  std::vector<torch::nn::Sequential> blocks = {make_block(7, at::kDouble),
                                               make_block(8, at::kDouble)};
  expect_identical(run(blocks, false, at::kDouble), run(blocks, true, at::kDouble));
}

TEST(ActivationCheckpoint, UnderCpuBf16AutocastMatchesPlainAutocast) {
  std::vector<torch::nn::Sequential> blocks = {make_block(7, at::kFloat),
                                               make_block(8, at::kFloat)};
  Result plain = run(blocks, false, at::kFloat, AmpMode::kBf16);
  EXPECT_EQ(plain.output.scalar_type(), at::kBFloat16);
  Result ckpt = run(blocks, true, at::kFloat, AmpMode::kBf16);
  EXPECT_EQ(ckpt.output.scalar_type(), at::kBFloat16);
  expect_identical(plain, ckpt);
  // Backward ran outside the guard: the recomputation re-entered autocast and left it.
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
}

// A weight used by a checkpointed block and again after it in the same autocast region gets
// both gradient contributions (the no-grad forward must leave no cast of it without
// autograd history in autocast's cache for the second use to pick up).
TEST(ActivationCheckpoint, WeightReusedAfterACheckpointInOneAutocastRegionGetsItsGradient) {
  auto block = make_block(7, at::kFloat);
  at::Tensor w = block->parameters()[0];  // first Linear's weight [kHidden, kDim]
  auto grads = [&](bool checkpointed) {
    block->zero_grad();
    torch::manual_seed(5);
    at::Tensor x = torch::randn({kBatch, kDim});
    at::Tensor z;
    {
      AutocastGuard autocast(c10::kCPU, AmpMode::kBf16);
      auto fn = [&](const at::Tensor& in) { return block->forward(in); };
      at::Tensor y = checkpointed ? checkpoint(fn, x, block->parameters()) : fn(x);
      z = at::linear(y, w);
    }
    z.sum().backward();
    return w.grad().clone();
  };
  at::Tensor plain = grads(false);
  EXPECT_TRUE(at::equal(grads(true), plain));
}

TEST(ActivationCheckpoint, UnderNoGradJustRunsFn) {
  auto block = make_block(7, at::kDouble);
  block->eval();
  at::Tensor x = torch::randn({kBatch, kDim}, torch::kDouble).requires_grad_(true);
  at::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    expected = block->forward(x);
  }
  torch::NoGradGuard no_grad;
  at::Tensor y =
      checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x, block->parameters());
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
  EXPECT_TRUE(at::equal(y, expected));
}

// A post-hook on a parameter's AccumulateGrad node counts how often it fires.
struct CountingHook : torch::autograd::FunctionPostHook {
  explicit CountingHook(int* count) : count_(count) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ++*count_;
    return outputs;
  }
  int* count_;
};

TEST(ActivationCheckpoint, AccumulateGradHooksFireOncePerParamPerBackward) {
  std::vector<torch::nn::Sequential> blocks = {make_block(7, at::kDouble),
                                               make_block(8, at::kDouble)};
  std::vector<at::Tensor> params;
  for (auto& b : blocks) {
    for (const at::Tensor& p : b->parameters()) params.push_back(p);
  }
  std::vector<int> counts(params.size(), 0);
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keep the hooks alive
  for (size_t i = 0; i < params.size(); ++i) {
    accumulators.push_back(torch::autograd::impl::grad_accumulator(params[i]));
    accumulators.back()->add_post_hook(std::make_unique<CountingHook>(&counts[i]));
  }
  for (int backward = 1; backward <= 2; ++backward) {
    run(blocks, true, at::kDouble);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(counts[i], backward) << "param " << i << " after backward " << backward;
    }
  }
}

// Several inputs and outputs: an integer output, an output that depends on no tensor needing
// gradients, one the loss does not use (undefined incoming gradient), an input that needs
// none, and a frozen parameter.
TEST(ActivationCheckpoint, MixedOutputsAndInputsMatchPlain) {
  torch::manual_seed(3);
  at::Tensor w = torch::randn({3, 3}, torch::kDouble).requires_grad_(true);
  at::Tensor frozen = torch::randn({3}, torch::kDouble);
  auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    at::Tensor h = at::dropout(at::mm(in[0], w) + in[1] * frozen, 0.5, /*train=*/true);
    return {h.tanh(), at::argmax(h, 1), h.sin(), in[1] * 2};
  };
  auto loss_and_grads = [&](bool checkpointed) {
    w.mutable_grad() = at::Tensor();
    torch::manual_seed(11);
    at::Tensor a = torch::randn({5, 3}, torch::kDouble).requires_grad_(true);
    at::Tensor b = torch::randn({5, 3}, torch::kDouble);  // needs no gradient
    std::vector<at::Tensor> out = checkpointed ? checkpoint(fn, {a, b}, {w, frozen}) : fn({a, b});
    EXPECT_FALSE(out[1].requires_grad());
    // A checkpointed float output is marked as requiring grad (which ones really do is only
    // known at recomputation); its gradient is then dropped.
    EXPECT_EQ(out[3].requires_grad(), checkpointed);
    ((out[0] * out[0]).sum() + out[3].sum()).backward();  // out[2] unused
    return std::vector<at::Tensor>{out[0].detach(), out[1], a.grad(), w.grad().clone()};
  };
  std::vector<at::Tensor> plain = loss_and_grads(false);
  std::vector<at::Tensor> ckpt = loss_and_grads(true);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(ckpt[i], plain[i])) << "item " << i;
  }
}

TEST(ActivationCheckpoint, InputModifiedInPlaceBeforeBackwardIsAnError) {
  auto block = make_block(7, at::kDouble);
  at::Tensor x = torch::randn({kBatch, kDim}, torch::kDouble).requires_grad_(true);
  at::Tensor h = x * 2;
  at::Tensor y =
      checkpoint([&](const at::Tensor& in) { return block->forward(in); }, h, block->parameters());
  h.add_(1.0);  // the recomputation would see different inputs
  EXPECT_THROW(y.sum().backward(), std::exception);
}

TEST(ActivationCheckpoint, DoubleBackwardIsAClearError) {
  auto block = make_block(7, at::kDouble);
  at::Tensor x = torch::randn({kBatch, kDim}, torch::kDouble).requires_grad_(true);
  at::Tensor y =
      checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x, block->parameters());
  try {
    torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "create_graph through a checkpoint did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("double backward"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain::engine
