// A backward split into its input-gradient and weight-gradient halves (split_backward.h) against
// one backward() of the same network in float64: the first half leaves every parameter without
// a gradient and gives the input's gradient, the second half gives the parameters' gradients,
// for a network with linear layers, a layer norm, an added position-like parameter, a residual
// path from the input and a block under activation checkpointing; as a middle stage (an
// activation gradient given), a last stage (a scalar loss) and a first stage (no input
// gradient: the second half is the whole backward). A weight read twice on the input's path is
// refused, not counted twice.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/parallel/split_backward.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

struct SplitNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  at::Tensor pos;
  SplitNetImpl() {
    a = register_module("a", torch::nn::Linear(6, 8));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    b = register_module("b", torch::nn::Linear(8, 6));
    c = register_module("c", torch::nn::Linear(6, 6));
    pos = register_parameter("pos", torch::randn({8}));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::gelu(norm->forward(a->forward(x)) + pos);
    at::Tensor y = x + b->forward(h);  // a residual path straight from the input
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : c->parameters()) params.push_back(p);
    return checkpoint([this](const at::Tensor& in) { return torch::tanh(c->forward(in)); }, y, params, {});
  }
};
TORCH_MODULE(SplitNet);

SplitNet split_net() {
  torch::manual_seed(11);
  SplitNet net;
  net->to(torch::kFloat64);
  return net;
}

std::vector<at::Tensor> grads_of(SplitNet& net) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : net->parameters()) out.push_back(p.grad());
  return out;
}

void expect_same_grads(SplitNet& got, SplitNet& want, const std::string& what) {
  const std::vector<at::Tensor> g = grads_of(got), w = grads_of(want);
  ASSERT_EQ(g.size(), w.size());
  for (size_t k = 0; k < g.size(); ++k) {
    ASSERT_TRUE(g[k].defined()) << what << ", parameter " << k;
    EXPECT_LT(testing_util::rel_error(g[k], w[k]), 1e-12) << what << ", parameter " << k;
  }
}

// kind: 0 a middle stage (gradient given), 1 a last stage (scalar loss), 2 a first stage.
void check_split(int kind) {
  const std::string what = kind == 0 ? "middle stage" : kind == 1 ? "last stage" : "first stage";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x0 = at::randn({4, 6}, gen, at::kDouble), g = at::randn({4, 6}, gen, at::kDouble);
  SplitNet want = split_net();
  const at::Tensor xw = x0.clone().requires_grad_(kind != 2);
  at::Tensor yw = want->forward(xw);
  if (kind == 0) {
    yw.backward(g);
  } else {
    yw.pow(2).sum().backward();
  }
  SplitNet got = split_net();
  const at::Tensor x = x0.clone().requires_grad_(kind != 2);
  at::Tensor y = got->forward(x);
  if (kind != 0) y = y.pow(2).sum();
  SplitBackward split(y, kind == 0 ? g : at::Tensor(), kind == 2 ? at::Tensor() : x);
  for (const at::Tensor& p : got->parameters()) {
    EXPECT_FALSE(p.grad().defined()) << what << ": the input half computed a weight gradient";
  }
  if (kind == 2) {
    EXPECT_FALSE(split.input_grad().defined());
    EXPECT_EQ(split.weight_runs(), 1);
  } else {
    EXPECT_LT(testing_util::rel_error(split.input_grad(), xw.grad()), 1e-12) << what;
    EXPECT_FALSE(x.grad().defined()) << what << ": the input's gradient is returned, not accumulated";
    // a's addmm, the norm, the position add, b's addmm, the checkpointed block: one run each.
    EXPECT_EQ(split.weight_runs(), 5) << what;
  }
  split.weight_half();
  expect_same_grads(got, want, what);
  EXPECT_THROW(split.weight_half(), Error);
}

TEST(SplitBackward, MiddleStageHalvesEqualOneBackward) { check_split(0); }
TEST(SplitBackward, LastStageHalvesEqualOneBackward) { check_split(1); }
TEST(SplitBackward, FirstStageSecondHalfIsTheWholeBackward) { check_split(2); }

// Two micro-batches' halves out of order (B0 B1 W1 W0, as zero bubble runs them) accumulate
// what two backward() calls do.
TEST(SplitBackward, HalvesOfSeveralMicroBatchesAccumulate) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const at::Tensor x0 = at::randn({4, 6}, gen, at::kDouble), x1 = at::randn({4, 6}, gen, at::kDouble);
  SplitNet want = split_net(), got = split_net();
  for (const at::Tensor& x : {x0, x1}) want->forward(x.clone().requires_grad_(true)).sum().backward();
  const at::Tensor a = x0.clone().requires_grad_(true), b = x1.clone().requires_grad_(true);
  SplitBackward first(got->forward(a).sum(), at::Tensor(), a);
  SplitBackward second(got->forward(b).sum(), at::Tensor(), b);
  second.weight_half();
  first.weight_half();
  expect_same_grads(got, want, "two micro-batches");
}

// A layer applied twice: its second use's weight gradient cannot be split from the input's path
// (which reads the same weight in its first use).
TEST(SplitBackward, AWeightUsedTwiceOnTheInputsPathIsRefused) {
  torch::manual_seed(2);
  torch::nn::Linear twice(6, 6);
  twice->to(torch::kFloat64);
  const at::Tensor x = at::randn({3, 6}, at::kDouble).requires_grad_(true);
  const at::Tensor y = twice->forward(torch::tanh(twice->forward(x))).sum();
  EXPECT_TRUE(testing_util::throws_error_with([&] { SplitBackward split(y, at::Tensor(), x); },
                                              "used twice in one stage"));
  const at::Tensor detached = at::randn({3, 6}, at::kDouble).requires_grad_(true);
  EXPECT_TRUE(testing_util::throws_error_with(
      [&] { SplitBackward split(twice->forward(x).sum(), at::Tensor(), detached); }, "does not depend on the input"));
}

}  // namespace
}  // namespace dtrain::engine
