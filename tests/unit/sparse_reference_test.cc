// make_sparse_aware_optimizer against torch.optim itself on the same sparse gradients:
// torch.optim.SparseAdam for adam, Adagrad and SGD with sparse gradients, in float64
// (tests/reference/sparse_optim_reference.py, one Python run for the file). The gradients
// repeat rows (uncoalesced), skip rows for several steps and include an empty step.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/engine/optim/sparse_optim.h"
#include "test_util.h"

namespace dtrain::engine::sparse_reference {  // its own: the unity build may merge it with sparse_optim_test.cc
namespace {

using json = nlohmann::json;

constexpr int64_t kRows = 10, kDim = 3, kSteps = 5;

struct Step {
  std::vector<int64_t> rows;
  at::Tensor values;  // [rows, kDim] float64
};

const std::vector<Step>& steps() {
  static const std::vector<Step> s = [] {
    torch::manual_seed(11);
    std::vector<std::vector<int64_t>> rows = {{1, 4, 4, 7}, {2, 3}, {}, {1, 9, 0, 1}, {5}};
    std::vector<Step> out;
    for (auto& r : rows) out.push_back({r, at::randn({static_cast<int64_t>(r.size()), kDim}, at::kDouble)});
    return out;
  }();
  return s;
}

at::Tensor initial_param() {
  torch::manual_seed(12);
  return at::randn({kRows, kDim}, at::kDouble);
}

struct Case {
  std::string id, dtrain_name, torch_name;
  OptimizerOptions options;
  json kwargs;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  OptimizerOptions adam;
  adam.name = "adam";
  adam.lr = 0.05;
  adam.beta1 = 0.8;
  adam.beta2 = 0.95;
  adam.eps = 1e-6;
  c.push_back({"sparse_adam", "adam", "sparse_adam", adam, {{"lr", 0.05}, {"betas", {0.8, 0.95}}, {"eps", 1e-6}}});
  OptimizerOptions adagrad;
  adagrad.name = "adagrad";
  adagrad.lr = 0.1;
  adagrad.lr_decay = 0.01;
  adagrad.initial_accumulator_value = 0.2;
  c.push_back({"adagrad", "adagrad", "adagrad", adagrad,
               {{"lr", 0.1}, {"lr_decay", 0.01}, {"initial_accumulator_value", 0.2}}});
  OptimizerOptions sgd;
  sgd.name = "sgd";
  sgd.lr = 0.3;
  c.push_back({"sgd", "sgd", "sgd", sgd, {{"lr", 0.3}}});
  return c;
}

const json& reference() {
  static const json results = [] {
    json request = {{"cases", json::array()}};
    at::Tensor p0 = initial_param();
    for (const Case& k : cases()) {
      json st = json::array();
      for (const Step& s : steps()) {
        at::Tensor v = s.values.reshape({-1});
        st.push_back({{"rows", s.rows}, {"values", std::vector<double>(v.data_ptr<double>(), v.data_ptr<double>() + v.numel())}});
      }
      at::Tensor flat = p0.reshape({-1});
      request["cases"].push_back({{"id", k.id}, {"optimizer", k.torch_name}, {"kwargs", k.kwargs},
                                  {"shape", {kRows, kDim}},
                                  {"param", std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel())},
                                  {"steps", st}});
    }
    char path[] = "/tmp/dtrain_sparse_reference_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return json::object();
    close(fd);
    std::ofstream(path) << request.dump();
    std::string out = testing_util::run_python("tests/reference/sparse_optim_reference.py", {path});
    std::remove(path);
    return out.empty() ? json::object() : json::parse(out);
  }();
  return results;
}

class SparseVsTorch : public ::testing::TestWithParam<size_t> {};

TEST_P(SparseVsTorch, ParamAfterEveryStep) {
  const Case k = cases()[GetParam()];
  const json& ref = reference();
  ASSERT_TRUE(ref.contains(k.id)) << "no reference for " << k.id;
  // A dense parameter beside the sparse one, as in a model (its own optimizer, not compared here).
  at::Tensor p = initial_param().requires_grad_();
  at::Tensor other = at::zeros({2}, at::kDouble).requires_grad_();
  OptimizerOptions o = k.options;
  auto opt = make_sparse_aware_optimizer({other, p}, {false, true}, o);
  for (int64_t s = 0; s < kSteps; ++s) {
    const Step& st = steps()[s];
    at::Tensor rows = at::tensor(st.rows, at::kLong).reshape({1, -1});
    p.mutable_grad() = at::sparse_coo_tensor(rows, st.values, {kRows, kDim});
    other.mutable_grad() = at::ones({2}, at::kDouble);
    opt->step();
    std::vector<double> want = ref[k.id][s].get<std::vector<double>>();
    at::Tensor w = at::tensor(want, at::kDouble).reshape({kRows, kDim});
    const double diff = (p.detach() - w).abs().max().item<double>();
    EXPECT_LE(diff, 1e-12) << k.id << " step " << s + 1 << ": differs from torch.optim by " << diff;
  }
}

INSTANTIATE_TEST_SUITE_P(TorchOptim, SparseVsTorch, ::testing::Range<size_t>(0, 3),
                         [](const auto& info) { return cases()[info.param].id; });

}  // namespace
}  // namespace dtrain::engine::sparse_reference
