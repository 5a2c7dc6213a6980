// Optimizers, lr schedules and gradient clipping against PyTorch (float64) and closed forms.
// PyTorch runs once for the whole file (tests/reference/optim_reference.py on one request
// holding every case), so the file stays within a few seconds.
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/sharded.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using json = nlohmann::json;
using testing_util::rel_error;

// ---- inputs shared by C++ and the reference -----------------------------------------------

const std::vector<std::vector<int64_t>> kShapes = {{7}, {3, 5}, {1}, {129}, {2, 3}};
constexpr int kSteps = 5;
constexpr uint64_t kSeed = 20261122;
// Gradients shrink over the steps, so amsgrad's running maximum differs from exp_avg_sq.
constexpr double kGradScale[kSteps] = {1.0, 2.0, 0.5, 0.1, 0.05};

// Which parameters get a gradient at each step: param 4 takes its first update at step 3,
// param 1 skips step 0, param 2 skips step 1 and param 0 skips step 3.
bool has_grad(int step, size_t param) {
  switch (param) {
    case 0:
      return step != 3;
    case 1:
      return step != 0;
    case 2:
      return step != 1;
    case 4:
      return step >= 3;
    default:
      return true;
  }
}

int64_t grad_count(size_t param, int steps) {
  int64_t n = 0;
  for (int s = 0; s < steps; ++s) n += has_grad(s, param) ? 1 : 0;
  return n;
}

// Initial parameters and per-step gradients as float64 tensors holding values exactly
// representable in `dtype` (so the float64 reference starts from the same numbers).
struct Inputs {
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> grads;  // [step][param], undefined: no gradient
};

Inputs make_inputs(at::ScalarType dtype) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(kSeed);
  auto draw = [&](const std::vector<int64_t>& shape, double scale) {
    return (at::randn(shape, gen, at::kDouble) * scale).to(dtype).to(at::kDouble);
  };
  Inputs in;
  for (const auto& shape : kShapes) in.params.push_back(draw(shape, 1.0));
  for (int s = 0; s < kSteps; ++s) {
    std::vector<at::Tensor> step;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      at::Tensor g = draw(kShapes[i], kGradScale[s]);  // drawn always: same stream per dtype
      step.push_back(has_grad(s, i) ? g : at::Tensor());
    }
    in.grads.push_back(std::move(step));
  }
  return in;
}

json flat(const at::Tensor& t) {
  at::Tensor c = t.to(at::kDouble).contiguous().reshape(-1);
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

at::Tensor from_json(const json& values) {
  return at::tensor(values.get<std::vector<double>>(), at::kDouble);
}

// Float64 concatenation of the tensors (flattened).
at::Tensor cat_flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : ts) parts.push_back(t.detach().cpu().to(at::kDouble).reshape(-1));
  return at::cat(parts);
}

// Leaf parameters (requiring grad) of `dtype` on `device` with the given values.
std::vector<at::Tensor> make_params(const std::vector<at::Tensor>& values, at::ScalarType dtype,
                                    c10::Device device = c10::kCPU) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& v : values) {
    out.push_back(v.to(device, dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true));
  }
  return out;
}

// Sets p.grad to g: in place when p has a gradient (the optimizer's cached lists stay
// valid), a new tensor when it has none, undefined when g is.
void set_grad(at::Tensor& p, const at::Tensor& g) {
  if (!g.defined()) {
    p.mutable_grad() = at::Tensor();
  } else if (p.grad().defined()) {
    p.mutable_grad().copy_(g);
  } else {
    p.mutable_grad() = g.to(p.device(), p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }
}

// ---- optimizer cases -----------------------------------------------------------------------

struct OptimCase {
  const char* id;
  const char* optimizer;
  json kwargs;  // OptimizerOptions fields; the same go to torch (defaults: each side's own)
};

const std::vector<OptimCase>& optim_cases() {
  static const std::vector<OptimCase> cases = {
      {"sgd", "sgd", {{"lr", 0.1}, {"weight_decay", 0.0}}},
      {"sgd_wd", "sgd", {{"lr", 0.1}, {"weight_decay", 0.1}}},
      {"sgd_momentum", "sgd", {{"lr", 0.1}, {"weight_decay", 0.0}, {"momentum", 0.9}}},
      {"sgd_dampening",
       "sgd",
       {{"lr", 0.1}, {"weight_decay", 0.0}, {"momentum", 0.9}, {"dampening", 0.3}}},
      {"sgd_nesterov_wd",
       "sgd",
       {{"lr", 0.1}, {"weight_decay", 0.01}, {"momentum", 0.9}, {"nesterov", true}}},
      {"sgd_momentum_wd", "sgd", {{"lr", 0.05}, {"weight_decay", 0.05}, {"momentum", 0.5}}},
      {"adam", "adam", {{"lr", 0.05}, {"weight_decay", 0.0}}},
      {"adam_wd", "adam", {{"lr", 0.05}, {"weight_decay", 0.1}}},
      {"adam_amsgrad",
       "adam",
       {{"lr", 0.05}, {"weight_decay", 0.0}, {"amsgrad", true}, {"beta2", 0.9}}},
      {"adam_amsgrad_wd_betas",
       "adam",
       {{"lr", 0.02},
        {"weight_decay", 0.1},
        {"amsgrad", true},
        {"beta1", 0.8},
        {"beta2", 0.95},
        {"eps", 1e-6}}},
      {"adamw", "adamw", {{"lr", 0.05}, {"weight_decay", 0.01}}},
      {"adamw_amsgrad",
       "adamw",
       {{"lr", 0.05}, {"weight_decay", 0.1}, {"amsgrad", true}, {"beta2", 0.9}}},
      {"adagrad", "adagrad", {{"lr", 0.1}, {"weight_decay", 0.0}}},
      {"adagrad_lr_decay", "adagrad", {{"lr", 0.1}, {"weight_decay", 0.0}, {"lr_decay", 0.5}}},
      {"adagrad_init_acc",
       "adagrad",
       {{"lr", 0.1}, {"weight_decay", 0.0}, {"initial_accumulator_value", 0.5}}},
      {"adagrad_wd_eps", "adagrad", {{"lr", 0.1}, {"weight_decay", 0.1}, {"eps", 1e-3}}},
  };
  return cases;
}

OptimizerOptions to_options(const OptimCase& c, bool fused) {
  OptimizerOptions o;
  o.name = c.optimizer;
  o.fused = fused;
  for (const auto& [key, value] : c.kwargs.items()) {
    if (key == "lr")
      o.lr = value;
    else if (key == "weight_decay")
      o.weight_decay = value;
    else if (key == "momentum")
      o.momentum = value;
    else if (key == "dampening")
      o.dampening = value;
    else if (key == "nesterov")
      o.nesterov = value;
    else if (key == "beta1")
      o.beta1 = value;
    else if (key == "beta2")
      o.beta2 = value;
    else if (key == "eps")
      o.eps = value;
    else if (key == "amsgrad")
      o.amsgrad = value;
    else if (key == "lr_decay")
      o.lr_decay = value;
    else if (key == "initial_accumulator_value")
      o.initial_accumulator_value = value;
    else
      ADD_FAILURE() << "test case " << c.id << " has unknown option " << key;
  }
  return o;
}

const std::vector<at::ScalarType> kDtypes = {at::kDouble, at::kFloat, at::kBFloat16};

std::string case_key(const OptimCase& c, at::ScalarType dtype) {
  return std::string(c.id) + "/" + c10::toString(dtype);
}

// ---- the reference request (every case), run once --------------------------------------------

struct ScheduleCase {
  const char* name;
  int64_t warmup, total;
  double min_lr_ratio;
  int64_t steps;
};
const std::vector<ScheduleCase> kScheduleCases = {
    {"cosine", 3, 13, 0.1, 17}, {"cosine", 4, 10, 0.0, 12}, {"cosine", 2, 40, 0.25, 44},
    {"linear", 2, 9, 0.2, 12},  {"linear", 5, 6, 0.0, 8},
};
std::string schedule_key(const ScheduleCase& c) {
  return std::string("schedule/") + c.name + "/" + std::to_string(c.warmup) + "/" +
         std::to_string(c.total);
}

// Clipping inputs: float64 gradients, one undefined.
std::vector<at::Tensor> clip_grads_input() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(kSeed + 1);
  return {at::randn({11}, gen, at::kDouble), at::Tensor(), at::randn({40}, gen, at::kDouble),
          at::randn({1}, gen, at::kDouble) * 3.0};
}
const std::vector<double> kClipMaxNorms = {1.0, 1000.0};

json build_request() {
  json cases = json::array();
  for (at::ScalarType dtype : kDtypes) {
    Inputs in = make_inputs(dtype);
    json shapes = kShapes, params = json::array(), grads = json::array();
    for (const at::Tensor& p : in.params) params.push_back(flat(p));
    for (const auto& step : in.grads) {
      json row = json::array();
      for (const at::Tensor& g : step) row.push_back(g.defined() ? flat(g) : json(nullptr));
      grads.push_back(row);
    }
    for (const OptimCase& c : optim_cases()) {
      cases.push_back({{"id", case_key(c, dtype)},
                       {"kind", "optim"},
                       {"optimizer", c.optimizer},
                       {"kwargs", c.kwargs},
                       {"shapes", shapes},
                       {"params", params},
                       {"grads", grads}});
    }
  }
  for (const ScheduleCase& c : kScheduleCases) {
    cases.push_back({{"id", schedule_key(c)},
                     {"kind", "schedule"},
                     {"name", c.name},
                     {"warmup", c.warmup},
                     {"total", c.total},
                     {"min_lr_ratio", c.min_lr_ratio},
                     {"steps", c.steps}});
  }
  for (double max_norm : kClipMaxNorms) {
    json grads = json::array();
    for (const at::Tensor& g : clip_grads_input()) {
      grads.push_back(g.defined() ? flat(g) : json(nullptr));
    }
    cases.push_back({{"id", "clip/" + std::to_string(max_norm)},
                     {"kind", "clip"},
                     {"grads", grads},
                     {"max_norm", max_norm}});
  }
  return {{"cases", cases}};
}

const json& reference() {
  static const json results = [] {
    char path[] = "/tmp/dtrain_optim_reference_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
      ADD_FAILURE() << "cannot create a temporary file";
      return json::object();
    }
    close(fd);
    std::ofstream(path) << build_request().dump();
    std::string out = testing_util::run_python("tests/reference/optim_reference.py", {path});
    std::remove(path);
    return out.empty() ? json::object() : json::parse(out);
  }();
  return results;
}

// ---- optimizers vs torch.optim -----------------------------------------------------------------

using OptimParam = std::tuple<size_t, at::ScalarType, bool, bool>;  // case, dtype, fused, cuda

class OptimVsTorch : public ::testing::TestWithParam<OptimParam> {};

// After every step: float64 compares the updates p_t - p_0 (1e-12), float32 the updates
// (1e-5: each stored parameter rounds to float32), bfloat16 the parameters (2e-2).
TEST_P(OptimVsTorch, ParamsAfterEveryStep) {
  auto [index, dtype, fused, cuda] = GetParam();
  if (cuda) DTRAIN_SKIP_WITHOUT_CUDA();
  const OptimCase& c = optim_cases()[index];
  const json& ref = reference();
  std::string key = case_key(c, dtype);
  ASSERT_TRUE(ref.contains(key)) << "no reference for " << key;
  Inputs in = make_inputs(dtype);
  std::vector<at::Tensor> params =
      make_params(in.params, dtype, cuda ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU));
  std::unique_ptr<Optimizer> opt = make_optimizer(params, to_options(c, fused));
  at::Tensor start = cat_flat(in.params);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < params.size(); ++i) set_grad(params[i], in.grads[s][i]);
    opt->step();
    std::vector<at::Tensor> expected_parts;
    for (const json& values : ref[key]["params"][s]) expected_parts.push_back(from_json(values));
    at::Tensor expected = at::cat(expected_parts);
    at::Tensor actual = cat_flat(params);
    if (dtype == at::kBFloat16) {
      EXPECT_LT(rel_error(actual, expected), 2e-2) << key << " step " << s;
    } else {
      double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
      EXPECT_LT(rel_error(actual - start, expected - start), tol) << key << " step " << s;
    }
  }
  // Step counts: torch's where it keeps one (not sgd), else the number of gradients given.
  std::vector<std::pair<std::string, at::Tensor>> state = opt->state();
  for (size_t i = 0; i < params.size(); ++i) {
    std::string name = std::to_string(i) + ".step";
    auto it = std::find_if(state.begin(), state.end(), [&](auto& e) { return e.first == name; });
    ASSERT_NE(it, state.end()) << name;
    const json& torch_step = ref[key]["steps"][i];
    double expected = torch_step.is_null() ? static_cast<double>(grad_count(i, kSteps))
                                           : torch_step.get<double>();
    if (std::string(c.optimizer) != "sgd") {
      EXPECT_EQ(torch_step.get<double>(), static_cast<double>(grad_count(i, kSteps))) << name;
    }
    EXPECT_EQ(it->second.item<double>(), expected) << key << " " << name;
  }
}

std::string optim_param_name(const ::testing::TestParamInfo<OptimParam>& info) {
  auto [index, dtype, fused, cuda] = info.param;
  return std::string(optim_cases()[index].id) + "_" + c10::toString(dtype) +
         (fused ? "_fused" : "_foreach") + (cuda ? "_cuda" : "_cpu");
}

// Every case, dtype and implementation on the CPU; the fused kernels on CUDA too (those
// skip without a GPU).
std::vector<OptimParam> optim_params() {
  std::vector<OptimParam> out;
  for (bool cuda : {false, true}) {
    for (size_t index = 0; index < optim_cases().size(); ++index) {
      for (at::ScalarType dtype : kDtypes) {
        out.emplace_back(index, dtype, true, cuda);
        if (!cuda) out.emplace_back(index, dtype, false, cuda);
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Optim, OptimVsTorch, ::testing::ValuesIn(optim_params()),
                         optim_param_name);

// ---- skipped parameters, zero_grad, set_lr
// -------------------------------------------------------

TEST(OptimSkip, ParamWithoutGradIsUnchangedAndKeepsItsStep) {
  for (const char* name : {"sgd", "adam", "adamw", "adagrad"}) {
    OptimizerOptions o;
    o.name = name;
    o.momentum = std::string(name) == "sgd" ? 0.9 : 0.0;
    o.weight_decay = 0.1;  // would move the parameter even with a zero gradient
    Inputs in = make_inputs(at::kDouble);
    std::vector<at::Tensor> params = make_params(in.params, at::kDouble);
    std::unique_ptr<Optimizer> opt = make_optimizer(params, o);
    for (int s = 0; s < 3; ++s) {
      for (size_t i = 0; i < params.size(); ++i) set_grad(params[i], in.grads[s][i]);
      opt->step();
      EXPECT_TRUE(at::equal(params[4], in.params[4])) << name << " step " << s;
    }
    for (const auto& [key, t] : opt->state()) {
      if (key == "4.step") EXPECT_EQ(t.item<double>(), 0.0) << name;
      if (key == "3.step") EXPECT_EQ(t.item<double>(), 3.0) << name;
      if (key == "1.step") EXPECT_EQ(t.item<double>(), 2.0) << name;
    }
  }
}

TEST(OptimZeroGrad, ZerosInPlaceAndKeepsUndefinedGrads) {
  std::vector<at::Tensor> params = make_params(make_inputs(at::kFloat).params, at::kFloat);
  params[0].mutable_grad() = at::ones_like(params[0]);
  params[3].mutable_grad() = at::full_like(params[3], 2.0);
  const c10::TensorImpl* impl0 = params[0].grad().unsafeGetTensorImpl();
  std::unique_ptr<Optimizer> opt = make_optimizer(params, OptimizerOptions{});
  opt->zero_grad();
  EXPECT_EQ(params[0].grad().unsafeGetTensorImpl(), impl0);
  EXPECT_EQ(params[0].grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(params[3].grad().abs().sum().item<double>(), 0.0);
  EXPECT_FALSE(params[1].grad().defined());
}

TEST(OptimLr, SetLrTakesEffectOnTheNextStep) {
  OptimizerOptions o;
  o.name = "sgd";
  o.lr = 0.5;
  std::vector<at::Tensor> params = {at::zeros({4}, at::kDouble).requires_grad_(true)};
  params[0].mutable_grad() = at::ones({4}, at::kDouble);
  std::unique_ptr<Optimizer> opt = make_optimizer(params, o);
  opt->step();
  EXPECT_TRUE(at::allclose(params[0], at::full({4}, -0.5, at::kDouble), 0, 0));
  opt->set_lr(0.25);
  EXPECT_EQ(opt->lr(), 0.25);
  EXPECT_EQ(opt->options().lr, 0.25);
  opt->step();
  EXPECT_TRUE(at::allclose(params[0], at::full({4}, -0.75, at::kDouble), 0, 0));
  EXPECT_THROW(opt->set_lr(-1.0), dtrain::Error);
  EXPECT_THROW(opt->set_lr(std::nan("")), dtrain::Error);
}

// step(grad_multiplier) equals step() on gradients multiplied by hand (what the trainer did
// before it stopped rewriting gradients), for every rule, fused and _foreach_, and leaves the
// caller's gradient values to the kernels (the _foreach_ path does not touch them).
TEST(OptimMultiplier, EqualsMultiplyingTheGradientsFirst) {
  for (const std::string name : {"sgd", "adam", "adamw", "adagrad"}) {
    for (bool fused : {true, false}) {
      for (double m : {0.25, 0.3712}) {  // a power of two (exact either way) and a clipping-like factor
        SCOPED_TRACE(name + (fused ? " fused" : " foreach") + " multiplier " + std::to_string(m));
        OptimizerOptions o;
        o.name = name;
        o.lr = 0.01;
        o.weight_decay = 0.1;
        o.fused = fused;
        if (name == "sgd") o.momentum = 0.9;
        auto make = [&] {
          auto g = at::make_generator<at::CPUGeneratorImpl>(11);
          std::vector<at::Tensor> p = {at::randn({37}, g).requires_grad_(true),
                                       at::randn({5, 3}, g).requires_grad_(true)};
          return p;
        };
        std::vector<at::Tensor> a = make(), b = make();
        std::unique_ptr<Optimizer> with = make_optimizer(a, o), by_hand = make_optimizer(b, o);
        for (int step = 0; step < 4; ++step) {
          auto g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
          for (size_t i = 0; i < a.size(); ++i) {
            at::Tensor grad = at::randn(a[i].sizes(), g);
            a[i].mutable_grad() = grad.clone();
            b[i].mutable_grad() = grad * m;
          }
          with->step(at::scalar_tensor(m, at::kFloat));
          by_hand->step();
        }
        for (size_t i = 0; i < a.size(); ++i) {
          if (m == 0.25) {
            EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
          } else {
            EXPECT_LE((a[i] - b[i]).abs().max().item<double>(), 1e-6 * b[i].abs().max().item<double>())
                << "parameter " << i;
          }
        }
      }
    }
  }
  std::vector<at::Tensor> p = {at::zeros({2}).requires_grad_(true)};
  p[0].mutable_grad() = at::ones({2});
  std::unique_ptr<Optimizer> opt = make_optimizer(p, OptimizerOptions{});
  EXPECT_THROW(opt->step(at::ones({2})), dtrain::Error);  // not a single value
  EXPECT_TRUE(at::equal(p[0], at::zeros({2})));
}

// A replicated optimizer's defaults of the partitioned / asynchronous part of the contract.
TEST(OptimContract, ReplicatedDefaults) {
  std::vector<at::Tensor> p = {at::zeros({3}).requires_grad_(true)};
  std::unique_ptr<Optimizer> opt = make_optimizer(p, OptimizerOptions{});
  EXPECT_TRUE(opt->gradient_owners().empty());
  EXPECT_FALSE(opt->shard_layout().has_value());
  EXPECT_TRUE(opt->shard_state().tensors.empty());
  EXPECT_EQ(opt->host_bytes(), 0);
  EXPECT_FALSE(opt->take_update_timing().has_value());
  EXPECT_EQ(opt->device_state().size(), opt->state().size());
  opt->flush();
  opt->skip_step();
  opt->load_shard_state(ShardState{});
  ShardState foreign;
  foreign.tensors = {{"master", at::zeros({3})}};
  EXPECT_TRUE(testing_util::error_of([&] { opt->load_shard_state(foreign); }).find("not partitioned") !=
              std::string::npos);
}

// A gradient replaced by a new tensor between steps is picked up (the cached lists rebuilt).
TEST(OptimGrads, ReplacedGradientTensorIsUsed) {
  OptimizerOptions o;
  o.name = "sgd";
  o.lr = 1.0;
  std::vector<at::Tensor> params = {at::zeros({3}, at::kDouble).requires_grad_(true)};
  params[0].mutable_grad() = at::ones({3}, at::kDouble);
  std::unique_ptr<Optimizer> opt = make_optimizer(params, o);
  opt->step();
  params[0].mutable_grad() = at::full({3}, 2.0, at::kDouble);
  opt->step();
  EXPECT_TRUE(at::allclose(params[0], at::full({3}, -3.0, at::kDouble), 0, 0));
}

TEST(OptimGrads, MismatchedGradientThrowsAndChangesNothing) {
  std::vector<at::Tensor> params = {at::zeros({3}, at::kDouble).requires_grad_(true),
                                    at::zeros({2, 2}, at::kDouble).requires_grad_(true)};
  std::unique_ptr<Optimizer> opt = make_optimizer(params, OptimizerOptions{});
  params[0].mutable_grad() = at::ones({3}, at::kDouble);
  params[1].mutable_grad() = at::ones({2, 2}, at::kFloat);  // wrong dtype
  EXPECT_THROW(opt->step(), dtrain::Error);
  params[1].mutable_grad() = at::ones({2, 4}, at::kDouble).narrow(1, 0, 2);  // wrong strides
  EXPECT_THROW(opt->step(), dtrain::Error);
  EXPECT_EQ(params[0].abs().sum().item<double>(), 0.0);
  params[1].mutable_grad() = at::ones({2, 2}, at::kDouble);
  opt->step();  // fixed: goes through
  EXPECT_NE(params[0].abs().sum().item<double>(), 0.0);
}

// ---- checkpoint state
// ----------------------------------------------------------------------------

std::vector<std::pair<std::string, at::Tensor>> cloned(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [k, t] : state) out.emplace_back(k, t.clone());
  return out;
}

void run_steps(Optimizer& opt, std::vector<at::Tensor>& params, const Inputs& in, int from,
               int to) {
  for (int s = from; s < to; ++s) {
    for (size_t i = 0; i < params.size(); ++i) set_grad(params[i], in.grads[s][i]);
    opt.step();
  }
}

TEST(OptimState, SaveAfterThreeStepsLoadAndContinueIsBitForBit) {
  for (const OptimCase& c : optim_cases()) {
    for (bool fused : {true, false}) {
      OptimizerOptions o = to_options(c, fused);
      Inputs in = make_inputs(at::kDouble);
      std::vector<at::Tensor> straight = make_params(in.params, at::kDouble);
      std::unique_ptr<Optimizer> a = make_optimizer(straight, o);
      run_steps(*a, straight, in, 0, kSteps);

      std::vector<at::Tensor> first = make_params(in.params, at::kDouble);
      std::unique_ptr<Optimizer> b = make_optimizer(first, o);
      run_steps(*b, first, in, 0, 3);
      auto saved = cloned(b->state());
      std::vector<at::Tensor> resumed;
      for (const at::Tensor& p : first) resumed.push_back(p.detach().clone().requires_grad_(true));
      std::unique_ptr<Optimizer> r = make_optimizer(resumed, o);
      r->load_state(saved);
      run_steps(*r, resumed, in, 3, kSteps);
      for (size_t i = 0; i < straight.size(); ++i) {
        EXPECT_TRUE(at::equal(straight[i], resumed[i]))
            << c.id << " fused " << fused << " param " << i;
      }
      auto sa = a->state(), sr = r->state();
      ASSERT_EQ(sa.size(), sr.size());
      for (size_t k = 0; k < sa.size(); ++k) {
        EXPECT_EQ(sa[k].first, sr[k].first);
        EXPECT_TRUE(at::equal(sa[k].second, sr[k].second)) << c.id << " " << sa[k].first;
      }
    }
  }
}

std::vector<std::string> names_of(const Optimizer& opt) {
  std::vector<std::string> out;
  for (const auto& [k, t] : opt.state()) out.push_back(k);
  return out;
}

TEST(OptimState, NamesPerOptimizer) {
  std::vector<at::Tensor> params = {at::zeros({2}).requires_grad_(true),
                                    at::zeros({3}).requires_grad_(true)};
  OptimizerOptions o;
  o.name = "sgd";
  EXPECT_EQ(names_of(*make_optimizer(params, o)), (std::vector<std::string>{"0.step", "1.step"}));
  o.momentum = 0.9;
  EXPECT_EQ(
      names_of(*make_optimizer(params, o)),
      (std::vector<std::string>{"0.step", "0.momentum_buffer", "1.step", "1.momentum_buffer"}));
  o.name = "adam";
  o.amsgrad = true;
  EXPECT_EQ(names_of(*make_optimizer(params, o)),
            (std::vector<std::string>{"0.step", "0.exp_avg", "0.exp_avg_sq", "0.max_exp_avg_sq",
                                      "1.step", "1.exp_avg", "1.exp_avg_sq", "1.max_exp_avg_sq"}));
  o.name = "adagrad";
  o.initial_accumulator_value = 0.25;
  auto opt = make_optimizer(params, o);
  EXPECT_EQ(names_of(*opt), (std::vector<std::string>{"0.step", "0.sum", "1.step", "1.sum"}));
  for (const auto& [k, t] : opt->state()) {
    if (k == "1.sum") EXPECT_TRUE(at::equal(t, at::full({3}, 0.25)));
    if (k == "1.step") {
      EXPECT_EQ(t.dim(), 0);
      EXPECT_EQ(t.scalar_type(), at::kFloat);
    }
  }
}

TEST(OptimState, LoadStateRejectsMismatchesBeforeChangingAnything) {
  OptimizerOptions o;
  o.name = "adam";
  Inputs in = make_inputs(at::kDouble);
  std::vector<at::Tensor> params = make_params(in.params, at::kDouble);
  std::unique_ptr<Optimizer> opt = make_optimizer(params, o);
  run_steps(*opt, params, in, 0, 2);
  auto good = cloned(opt->state());
  auto expect_rejected = [&](std::vector<std::pair<std::string, at::Tensor>> bad,
                             const std::string& needle) {
    std::unique_ptr<Optimizer> fresh = make_optimizer(params, o);
    auto before = cloned(fresh->state());
    try {
      fresh->load_state(bad);
      ADD_FAILURE() << "load_state accepted a state with " << needle;
    } catch (const dtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    auto after = fresh->state();
    for (size_t k = 0; k < before.size(); ++k) {
      EXPECT_TRUE(at::equal(before[k].second, after[k].second)) << before[k].first;
    }
  };
  auto missing = good;
  missing.erase(missing.begin() + 5);  // "1.exp_avg_sq"
  expect_rejected(missing, "1.exp_avg_sq");
  auto shape = good;
  shape[4].second = at::zeros({5, 3}, at::kDouble);  // "1.exp_avg" of a {3, 5} parameter
  expect_rejected(shape, "1.exp_avg");
  auto extra = good;
  extra.emplace_back("9.exp_avg", at::zeros({1}));
  expect_rejected(extra, "9.exp_avg");
  auto fractional = good;
  fractional[0].second = at::full({}, 1.5);
  expect_rejected(fractional, "0.step");
  // The good state loads into an SGD optimizer only if the names match: they do not.
  OptimizerOptions sgd;
  sgd.name = "sgd";
  sgd.momentum = 0.9;
  EXPECT_THROW(make_optimizer(params, sgd)->load_state(good), dtrain::Error);
}

// ---- schedules
// -----------------------------------------------------------------------------------

ScheduleOptions schedule(const char* name, int64_t warmup, int64_t total, double floor) {
  ScheduleOptions s;
  s.name = name;
  s.warmup_steps = warmup;
  s.total_steps = total;
  s.min_lr_ratio = floor;
  return s;
}

TEST(Schedule, ClosedFormValues) {
  const double pi = std::acos(-1.0);
  auto constant = schedule("constant", 0, 0, 0.0);
  EXPECT_EQ(schedule_factor(constant, 0), 1.0);
  EXPECT_EQ(schedule_factor(constant, 12345), 1.0);
  auto warm_constant = schedule("constant", 4, 0, 0.0);
  EXPECT_DOUBLE_EQ(schedule_factor(warm_constant, 0), 0.25);
  EXPECT_DOUBLE_EQ(schedule_factor(warm_constant, 2), 0.75);
  EXPECT_DOUBLE_EQ(schedule_factor(warm_constant, 3), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(warm_constant, 99), 1.0);
  // cosine: warm-up 2, decay over steps 2..10 (8 steps) to 0.1.
  auto cosine = schedule("cosine", 2, 10, 0.1);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 0), 0.5);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 1), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 2), 1.0);
  EXPECT_NEAR(schedule_factor(cosine, 4), 0.1 + 0.9 * (0.5 + std::sqrt(2.0) / 4.0), 1e-15);
  EXPECT_NEAR(schedule_factor(cosine, 6), 0.1 + 0.9 * 0.5, 1e-15);
  EXPECT_NEAR(schedule_factor(cosine, 9), 0.1 + 0.9 * 0.5 * (1.0 + std::cos(pi * 7.0 / 8.0)),
              1e-15);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 10), 0.1);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 1000), 0.1);
  // linear without warm-up to 0 over 4 steps.
  auto linear = schedule("linear", 0, 4, 0.0);
  for (int64_t s = 0; s <= 6; ++s) {
    EXPECT_DOUBLE_EQ(schedule_factor(linear, s), s < 4 ? 1.0 - s / 4.0 : 0.0) << s;
  }
  // warm-up as long as the run: the decay has no length, the floor follows.
  auto all_warm = schedule("cosine", 3, 3, 0.2);
  EXPECT_DOUBLE_EQ(schedule_factor(all_warm, 0), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(schedule_factor(all_warm, 2), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(all_warm, 3), 0.2);
  auto one_warm = schedule("linear", 1, 3, 0.0);
  EXPECT_DOUBLE_EQ(schedule_factor(one_warm, 0), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(one_warm, 2), 0.5);
}

TEST(Schedule, MatchesTorchLrScheduler) {
  const json& ref = reference();
  for (const ScheduleCase& c : kScheduleCases) {
    std::string key = schedule_key(c);
    ASSERT_TRUE(ref.contains(key)) << key;
    auto options = schedule(c.name, c.warmup, c.total, c.min_lr_ratio);
    // CosineAnnealingLR rises again after T_max; the schedule holds the floor: compare up to
    // total_steps, and the floor after it.
    for (int64_t s = 0; s < c.steps; ++s) {
      double expected = s <= c.total ? ref[key][s].get<double>() : c.min_lr_ratio;
      EXPECT_NEAR(schedule_factor(options, s), expected, 1e-12) << key << " step " << s;
    }
  }
}

void expect_schedule_invalid(const ScheduleOptions& s, const std::string& needle) {
  EXPECT_TRUE(testing_util::throws_error_with([&] { validate(s); }, needle));
}

TEST(ScheduleValidate, RejectsBadOptions) {
  expect_schedule_invalid(schedule("step", 0, 10, 0.0), "constant, cosine, linear");
  expect_schedule_invalid(schedule("cosine", 11, 10, 0.0), "warmup_steps = 11");
  expect_schedule_invalid(schedule("linear", 0, 0, 0.0), "total_steps");
  expect_schedule_invalid(schedule("cosine", 0, 10, 1.5), "min_lr_ratio");
  expect_schedule_invalid(schedule("constant", -1, 0, 0.0), "warmup_steps");
  EXPECT_NO_THROW(validate(schedule("constant", 5, 0, 0.0)));
  EXPECT_THROW(schedule_factor(schedule("constant", 0, 0, 0.0), -1), dtrain::Error);
}

// ---- gradient norm and clipping
// -------------------------------------------------------------------

TEST(GradClip, ClosedFormNormAndScaling) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    std::vector<at::Tensor> grads = {at::tensor({3.0, 4.0}, at::kDouble).to(dtype), at::Tensor(),
                                     at::tensor({12.0}, at::kDouble).to(dtype)};
    at::Tensor norm = grad_norm(grads);
    EXPECT_EQ(norm.scalar_type(), at::kFloat);
    EXPECT_EQ(norm.dim(), 0);
    EXPECT_EQ(norm.item<double>(), 13.0) << dtype;
    clip_grads(grads, norm, 6.5);
    double coef = 6.5 / (13.0 + 1e-6);
    double tol = dtype == at::kBFloat16 ? 1e-2 : 1e-6;
    EXPECT_LT(rel_error(grads[0], at::tensor({3.0 * coef, 4.0 * coef}, at::kDouble)), tol);
    EXPECT_LT(rel_error(grads[2], at::tensor({12.0 * coef}, at::kDouble)), tol);
  }
  EXPECT_EQ(grad_norm({}).item<double>(), 0.0);
  EXPECT_EQ(grad_norm({at::Tensor()}).item<double>(), 0.0);
  std::vector<at::Tensor> g = {at::ones({2})};
  EXPECT_THROW(clip_grads(g, grad_norm(g), -1.0), dtrain::Error);
  EXPECT_THROW(clip_grads(g, at::ones({2}), 1.0), dtrain::Error);
}

// A host gradient whose norm was taken on a device before its copy (note_device_norm; here a
// value no host read would give, to see which one counts) counts with that norm, also through a
// tensor sharing its storage at the same version (the gradient autograd adopts); changed in
// place, or another storage, it is read on the host again.
TEST(GradClip, NotedDeviceNormsCountUntilTheGradientChanges) {
  at::Tensor copy = at::tensor({3.0f, 4.0f});  // read on the host: norm 5
  at::Tensor other = at::tensor({12.0f});
  note_device_norm(copy, at::tensor(7.0f).reshape({}));
  at::Tensor adopted = copy.detach();  // as AccumulateGrad adopts it
  EXPECT_NEAR(grad_norm({adopted, other}).item<double>(), std::sqrt(49.0 + 144.0), 1e-5);
  EXPECT_NEAR(grad_norm({other}).item<double>(), 12.0, 1e-6);
  EXPECT_NEAR(grad_norm({adopted.narrow(0, 1, 1)}).item<double>(), 4.0, 1e-6) << "a part of the storage";
  adopted.mul_(2);  // accumulation, masking or zeroing in place
  EXPECT_NEAR(grad_norm({adopted, other}).item<double>(), std::sqrt(100.0 + 144.0), 1e-5);
  EXPECT_TRUE(testing_util::throws_error_with([&] { note_device_norm(copy.narrow(0, 1, 1), at::tensor(1.0f)); },
                                              "of its own storage"));
}

// Host gradients of 4 Mi elements or more (layer offload's streamed blocks) take dtrain's
// threaded host norm instead of ATen's one-thread _foreach_norm: the same norm as float64 ATen
// on the concatenation, per dtype, with pieces that split tensors and tensors under a piece.
TEST(GradClip, LargeHostGradientsTakeTheThreadedNorm) {
  at::manual_seed(7);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    std::vector<at::Tensor> grads = {at::randn({1500, 1001}, at::kDouble).to(dtype), at::Tensor(),
                                     at::randn({2100003}, at::kDouble).mul(3).to(dtype),
                                     at::randn({17}, at::kDouble).to(dtype),
                                     at::randn({700, 1000}, at::kDouble).mul(0.01).to(dtype)};
    std::vector<at::Tensor> flat;
    for (const at::Tensor& g : grads) {
      if (g.defined()) flat.push_back(g.to(at::kDouble).reshape({-1}));
    }
    const double want = at::linalg_vector_norm(at::cat(flat), 2).item<double>();
    const double got = grad_norm(grads).item<double>();
    EXPECT_NEAR(got, want, want * (dtype == at::kDouble ? 1e-7 : 1e-6)) << dtype;  // the result is float32
    // Below the threshold the same tensors take ATen's path, with the same result.
    std::vector<at::Tensor> small = {grads[3], grads[2].narrow(0, 0, 1000)};
    std::vector<at::Tensor> small_flat = {small[0].to(at::kDouble), small[1].to(at::kDouble)};
    EXPECT_NEAR(grad_norm(small).item<double>(), at::linalg_vector_norm(at::cat(small_flat), 2).item<double>(),
                1e-5)
        << dtype;
  }
}

TEST(GradClip, MatchesTorchClipGradNorm) {
  const json& ref = reference();
  for (double max_norm : kClipMaxNorms) {
    std::string key = "clip/" + std::to_string(max_norm);
    ASSERT_TRUE(ref.contains(key)) << key;
    std::vector<at::Tensor> grads = clip_grads_input();
    std::vector<at::Tensor> original;
    for (const at::Tensor& g : grads) original.push_back(g.defined() ? g.clone() : g);
    at::Tensor norm = grad_norm(grads);
    double torch_norm = ref[key]["norm"].get<double>();
    EXPECT_NEAR(norm.item<double>() / torch_norm, 1.0, 1e-7) << key;
    clip_grads(grads, norm, max_norm);
    for (size_t i = 0; i < grads.size(); ++i) {
      const json& expected = ref[key]["grads"][i];
      ASSERT_EQ(expected.is_null(), !grads[i].defined()) << key << " grad " << i;
      if (expected.is_null()) continue;
      EXPECT_LT(rel_error(grads[i], from_json(expected)), 1e-6) << key << " grad " << i;
      if (torch_norm < max_norm) EXPECT_TRUE(at::equal(grads[i], original[i])) << key;
    }
  }
}

// Parameters on two devices (a GPU model under layer offload keeps its streamed blocks' weights
// on the host; the meta device stands in for the GPU here): a sharded optimizer refuses them and
// names the layout that takes both.
TEST(ShardedOptimizer, ParametersOnTheHostAndTheDeviceNameOffloadAll) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  std::vector<at::Tensor> params = {at::empty({4}, at::device(at::kMeta)), at::zeros({4})};
  OptimizerOptions o;
  o.name = "adamw";
  EXPECT_TRUE(testing_util::throws_error_with([&] { ShardedOptimizer(params, o, *comm); },
                                              "parameter 1 is Float on cpu, parameter 0 Float on meta"));
  EXPECT_TRUE(testing_util::throws_error_with([&] { ShardedOptimizer(params, o, *comm); },
                                              "use --offload=all"));
  // Another dtype on one device is not layer offload's doing: no such advice.
  std::vector<at::Tensor> mixed = {at::zeros({4}), at::zeros({4}, at::kDouble)};
  EXPECT_TRUE(testing_util::throws_error_with([&] { ShardedOptimizer(mixed, o, *comm); }, "one dtype and device"));
  try {
    ShardedOptimizer(mixed, o, *comm);
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()).find("--offload=all"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain::engine
