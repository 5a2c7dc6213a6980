// Pruning's arithmetic: masks against a brute-force reference (sort every magnitude in
// float64, prune the k smallest), k rounded half to even as Python's round(), the cubic
// schedule in closed form, the default rule of what is prunable, and bad options.
#include "dtrain/engine/optim/prune.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;

// Keep-masks from sorting the magnitudes (distinct values: no ties to break).
std::vector<at::Tensor> brute_force(const std::vector<at::Tensor>& ts, int64_t k_total, bool global) {
  std::vector<at::Tensor> masks;
  auto prune = [](const at::Tensor& flat, int64_t k) {
    std::vector<double> v(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
    std::vector<int64_t> order(v.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return std::abs(v[a]) < std::abs(v[b]); });
    at::Tensor keep = at::ones({flat.numel()}, at::kBool);
    for (int64_t i = 0; i < k; ++i) keep[order[i]] = false;
    return keep;
  };
  if (!global) {
    for (const at::Tensor& t : ts) masks.push_back(prune(t.to(at::kDouble).reshape({-1}), k_total).view(t.sizes()));
    return masks;
  }
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : ts) flat.push_back(t.to(at::kDouble).reshape({-1}));
  at::Tensor keep = prune(at::cat(flat), k_total);
  int64_t off = 0;
  for (const at::Tensor& t : ts) {
    masks.push_back(keep.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
  return masks;
}

TEST(Prune, MasksPruneTheSmallestMagnitudesPerTensorOrOverAll) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  const std::vector<at::Tensor> ts = {at::randn({6, 5}, g), at::randn({4, 3}, g), at::randn({10}, g)};
  // Layer scope, 0.3 of each tensor: round(9.0)=9, round(3.6)=4, round(3.0)=3.
  std::vector<at::Tensor> got = l1_masks(ts, 0.3, "layer");
  const int64_t k_layer[] = {9, 4, 3};
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], brute_force({ts[i]}, k_layer[i], false)[0])) << i;
    EXPECT_EQ(got[i].dtype(), at::kBool);
  }
  // Global scope over 52 entries: round(0.3 x 52) = round(15.6) = 16 pruned in all.
  got = l1_masks(ts, 0.3, "global");
  const std::vector<at::Tensor> want = brute_force(ts, 16, true);
  int64_t pruned = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], want[i])) << i;
    pruned += got[i].numel() - got[i].sum().item<int64_t>();
  }
  EXPECT_EQ(pruned, 16);
}

TEST(Prune, CountRoundsHalfToEvenAsPythonDoes) {
  // 0.5 x 5 = 2.5 -> 2 (not 3); 0.5 x 7 = 3.5 -> 4; 0.1 x 4 = 0.4 -> 0.
  for (auto [n, amount, k] : {std::tuple<int64_t, double, int64_t>{5, 0.5, 2}, {7, 0.5, 4}, {4, 0.1, 0}}) {
    at::Tensor t = at::arange(1, n + 1, at::kFloat);
    at::Tensor keep = l1_masks({t}, amount, "layer")[0];
    EXPECT_EQ(n - keep.sum().item<int64_t>(), k) << "n " << n << ", amount " << amount;
    if (k > 0) EXPECT_FALSE(keep[0].item<bool>()) << "the smallest magnitude goes first";
  }
}

TEST(Prune, CubicScheduleInClosedFormAndOneShot) {
  PruneOptions o;
  o.amount = 0.8;
  o.from_step = 10;
  o.to_step = 20;
  o.every = 3;
  validate(o);
  EXPECT_EQ(prune_target(o, 9), -1);
  EXPECT_DOUBLE_EQ(prune_target(o, 10), 0.0);
  EXPECT_EQ(prune_target(o, 11), -1);  // between the every-3 steps
  EXPECT_DOUBLE_EQ(prune_target(o, 13), 0.8 * (1 - std::pow(1 - 0.3, 3)));
  EXPECT_DOUBLE_EQ(prune_target(o, 19), 0.8 * (1 - std::pow(1 - 0.9, 3)));
  EXPECT_DOUBLE_EQ(prune_target(o, 20), 0.8);  // the last step always
  EXPECT_EQ(prune_target(o, 21), -1);
  PruneOptions once;
  once.amount = 0.5;
  once.at_step = 4;
  EXPECT_EQ(prune_target(once, 3), -1);
  EXPECT_DOUBLE_EQ(prune_target(once, 4), 0.5);
  EXPECT_EQ(prune_target(once, 5), -1);
  EXPECT_EQ(prune_target(PruneOptions{}, 1), -1);
}

TEST(Prune, DefaultRuleTakesLinearAndConvWeightsOnly) {
  torch::nn::Sequential net(torch::nn::Embedding(10, 4), torch::nn::Linear(4, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                            torch::nn::Conv1d(torch::nn::Conv1dOptions(8, 2, 1)));
  auto& comm = testing_util::world_comm();
  PruneOptions o;
  o.amount = 0.5;
  o.at_step = 1;
  Pruner pruner(*net, o, {}, comm);
  EXPECT_EQ(pruner.names(), (std::vector<std::string>{"1.weight", "3.weight"}));
  o.prunable = [](const std::string& name, const torch::nn::Module&, const std::string&) { return name == "0.weight"; };
  EXPECT_EQ(Pruner(*net, o, {}, comm).names(), std::vector<std::string>{"0.weight"});
  o.prunable = [](const std::string&, const torch::nn::Module&, const std::string&) { return false; };
  EXPECT_NE(error_of([&] { Pruner(*net, o, {}, comm); }).find("no prunable parameter"), std::string::npos);
  // Pruning zeroes weights, masks gradients, and keeps them zero through an update.
  EXPECT_FALSE(pruner.active());
  EXPECT_TRUE(pruner.maybe_prune(1));
  auto* linear = (*net)[1]->as<torch::nn::LinearImpl>();
  EXPECT_EQ((linear->weight == 0).sum().item<int64_t>(), 16);
  linear->weight.mutable_grad() = at::ones_like(linear->weight);
  pruner.mask_gradients();
  EXPECT_EQ(linear->weight.grad().sum().item<float>(), 16);
  {
    torch::NoGradGuard no_grad;
    linear->weight.add_(1.0);
  }
  pruner.mask_weights();
  EXPECT_EQ((linear->weight == 0).sum().item<int64_t>(), 16);
  EXPECT_DOUBLE_EQ(pruner.sparsity(), 24.0 / 48.0);  // 16 of the Linear's 32, 8 of the Conv1d's 16
}

TEST(Prune, BadOptionsAreNamed) {
  PruneOptions o;
  o.amount = 1.0;
  EXPECT_NE(error_of([&] { validate(o); }).find("--prune_amount=1 must be in [0, 1)"), std::string::npos);
  o.amount = 0.5;
  EXPECT_NE(error_of([&] { validate(o); }).find("not neither"), std::string::npos);
  o.at_step = 3;
  o.from_step = 1;
  o.to_step = 5;
  EXPECT_NE(error_of([&] { validate(o); }).find("not both"), std::string::npos);
  o.at_step = 0;
  o.to_step = 1;
  EXPECT_NE(error_of([&] { validate(o); }).find("must satisfy 1 <= from < to"), std::string::npos);
  o.to_step = 5;
  o.scope = "row";
  EXPECT_NE(error_of([&] { validate(o); }).find("--prune_scope=row is not one of: layer, global"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
