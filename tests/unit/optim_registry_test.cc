// The update-rule table (dtrain/offload/update_rule.h), the one place that maps an optimizer's
// name to what differs between rules: every name known, an unknown one refused with the list,
// and the state arrays it declares per rule equal to what each optimizer family (device,
// CPU/offload, sparse) actually keeps and checkpoints. The options' checks, and ZeRO-3's units
// from name prefixes. Dropping an update on the device (step_unless).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/optim/sparse_optim.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"
#include "dtrain/offload/update_rule.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

struct RuleCase {
  std::string name;
  bool amsgrad = false;
  double momentum = 0.0;
};

std::vector<RuleCase> rule_cases() {
  return {{"sgd"}, {"sgd", false, 0.9}, {"adam"}, {"adam", true}, {"adamw"}, {"adamw", true}, {"adagrad"}};
}

OptimizerOptions options_of(const RuleCase& c) {
  OptimizerOptions o;
  o.name = c.name;
  o.amsgrad = c.amsgrad;
  o.momentum = c.momentum;
  return o;
}

// The names after "<prefix>." of `state`, without the ones in `skip`, in first-seen order.
std::vector<std::string> array_names(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                     const std::set<std::string>& skip) {
  std::vector<std::string> out;
  for (const auto& [key, tensor] : state) {
    std::string name = key.substr(key.find('.') + 1);
    if (key.find('.') == std::string::npos) name = key;
    if (!skip.count(name) && std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

TEST(OptimizerRegistry, KnowsEachNameAndRefusesOthersWithTheList) {
  EXPECT_EQ(offload::rule_names(), "sgd, adam, adamw, adagrad");
  for (const char* name : {"sgd", "adam", "adamw", "adagrad"}) EXPECT_EQ(std::string(rule_traits(name).name), name);
  EXPECT_EQ(rule_traits("adam").rule, Rule::kAdam);
  EXPECT_TRUE(rule_traits("adamw").decoupled_weight_decay);
  EXPECT_FALSE(rule_traits("adam").decoupled_weight_decay);
  try {
    rule_traits("lamb", "CPU optimizer");
    ADD_FAILURE() << "an unknown name was accepted";
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown CPU optimizer name 'lamb'; known names: sgd, adam"),
              std::string::npos)
        << e.what();
  }
}

TEST(OptimizerRegistry, MomentNamesAreWhatTheDeviceOptimizerKeeps) {
  for (const RuleCase& c : rule_cases()) {
    at::Tensor p = at::randn({3, 4}).requires_grad_(true);
    auto opt = make_optimizer({p}, options_of(c));
    p.mutable_grad() = at::ones_like(p);
    opt->step();
    EXPECT_EQ(array_names(opt->state(), {"step"}), offload::moment_names(options_of(c)))
        << c.name << " amsgrad " << c.amsgrad << " momentum " << c.momentum;
  }
}

TEST(OptimizerRegistry, MomentNamesAreWhatTheCpuOptimizerKeeps) {
  for (const RuleCase& c : rule_cases()) {
    offload::PinnedPool pool;
    offload::CpuOptimizerOptions o;
    static_cast<offload::UpdateRuleOptions&>(o) = options_of(c);
    std::vector<at::Tensor> params = {at::randn({40})};
    offload::CpuOptimizer opt(params, o, pool);
    // "<array>.<chunk>" besides "step", "layout" and the master weights.
    std::vector<std::string> arrays;
    for (const auto& [key, tensor] : opt.state()) {
      std::string array = key.substr(0, key.find('.'));
      if (array == "step" || array == "layout" || array == "master") continue;
      if (std::find(arrays.begin(), arrays.end(), array) == arrays.end()) arrays.push_back(array);
    }
    EXPECT_EQ(arrays, offload::moment_names(options_of(c))) << c.name;
  }
}

TEST(OptimizerRegistry, MomentNamesAreWhatTheSparseRuleKeeps) {
  for (const char* name : {"sgd", "adam", "adamw", "adagrad"}) {
    OptimizerOptions o;
    o.name = name;
    at::Tensor table = at::randn({6, 3}).requires_grad_(true);
    at::Tensor dense = at::randn({2}).requires_grad_(true);
    auto opt = make_sparse_aware_optimizer({table, dense}, {true, false}, o);
    table.mutable_grad() = at::ones_like(table);
    dense.mutable_grad() = at::ones_like(dense);
    opt->step();
    std::vector<std::pair<std::string, at::Tensor>> table_state;
    for (const auto& entry : opt->state()) {
      if (entry.first.rfind("0.", 0) == 0) table_state.push_back(entry);
    }
    EXPECT_EQ(array_names(table_state, {"step"}), offload::moment_names(o)) << name;
  }
}

// ---- options -----------------------------------------------------------------------------------

void expect_invalid(const OptimizerOptions& o, const std::string& needle) {
  EXPECT_TRUE(testing_util::throws_error_with([&] { validate(o); }, needle));
}

TEST(OptimValidate, RejectsBadOptions) {
  OptimizerOptions o;
  o.name = "lamb";
  expect_invalid(o, "sgd, adam, adamw, adagrad");
  o = {};
  o.lr = std::nan("");
  expect_invalid(o, "lr");
  o.lr = -0.1;
  expect_invalid(o, "lr = -0.1");
  o = {};
  o.name = "adam";
  o.beta1 = 1.0;
  expect_invalid(o, "beta1");
  o.beta1 = 0.9;
  o.beta2 = -0.5;
  expect_invalid(o, "beta2");
  o = {};
  o.name = "sgd";
  o.nesterov = true;
  expect_invalid(o, "nesterov");
  o.momentum = 0.9;
  o.dampening = 0.1;
  expect_invalid(o, "nesterov");
  o = {};
  o.name = "adagrad";
  o.lr_decay = -1.0;
  expect_invalid(o, "lr_decay");
  o = {};
  o.weight_decay = std::numeric_limits<double>::infinity();
  expect_invalid(o, "weight_decay");
  EXPECT_NO_THROW(validate(OptimizerOptions{}));
}

TEST(OptimValidate, MakeOptimizerRejectsBadParameterLists) {
  EXPECT_THROW(make_optimizer({}, OptimizerOptions{}), dtrain::Error);
  at::Tensor p = at::zeros({2}).requires_grad_(true);
  EXPECT_THROW(make_optimizer({p, p}, OptimizerOptions{}), dtrain::Error);
  EXPECT_THROW(make_optimizer({at::zeros({2}, at::kLong)}, OptimizerOptions{}), dtrain::Error);
  EXPECT_THROW(make_optimizer({p * 2.0}, OptimizerOptions{}), dtrain::Error);  // not a leaf
  OptimizerOptions o;
  o.name = "rmsprop";
  EXPECT_THROW(make_optimizer({p}, o), dtrain::Error);
}

TEST(OptimOptions, EffectiveEpsFollowsTorchDefaults) {
  OptimizerOptions o;
  o.name = "adam";
  EXPECT_EQ(effective_eps(o), 1e-8);
  o.name = "adagrad";
  EXPECT_EQ(effective_eps(o), 1e-10);
  EXPECT_EQ(effective_eps(o), rule_traits("adagrad").default_eps);  // the table's
  o.eps = 1e-6;
  EXPECT_EQ(effective_eps(o), 1e-6);
}

}  // namespace

// ZeRO-3's units from name prefixes (the trainer's and the planner's one rule): the first
// parameter under each prefix begins a unit; a unit never begins inside a layer.
TEST(UnitStarts, PrefixesCutWholeLayers) {
  const std::vector<std::string> names = {"wte.weight", "wpe.weight", "blocks.0.attn.qkv.weight",
                                          "blocks.0.attn.qkv.bias", "blocks.0.mlp.fc1.weight",
                                          "blocks.1.attn.qkv.weight", "ln_f.weight", "head.weight"};
  EXPECT_EQ(unit_starts_of(names, {"wte.", "blocks.0.", "blocks.1.", "ln_f."}), (std::vector<size_t>{0, 2, 5, 6}));
  // Coarser: several blocks in one unit; a prefix inside another's range starts its own.
  EXPECT_EQ(unit_starts_of(names, {"w", "blocks.0.mlp.", "head."}), (std::vector<size_t>{0, 4, 7}));
  using testing_util::error_of;
  std::vector<bool> tp(names.size(), false);
  tp[2] = tp[3] = true;
  EXPECT_NE(error_of([&] { unit_starts_of(names, {"wte.", "blocks.0.attn.qkv.bias"}, tp); })
                .find("unit 1 would begin at 'blocks.0.attn.qkv.bias', inside the tensor-parallel layer "
                      "'blocks.0.attn.qkv' (its 'blocks.0.attn.qkv.weight' falls in the unit before)"),
            std::string::npos);
  // wte and wpe are layers of their own: a unit may begin at either.
  EXPECT_EQ(unit_starts_of(names, {"wte.", "wpe.weight"}), (std::vector<size_t>{0, 1}));
  EXPECT_NE(error_of([&] { unit_starts_of(names, {"wte.", "blocks.9."}); })
                .find("no parameter's name begins with the unit prefix 'blocks.9.'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { unit_starts_of(names, {"blocks.0."}); })
                .find("the first parameter, 'wte.weight', begins no unit"),
            std::string::npos);
  EXPECT_NE(error_of([&] { unit_starts_of(names, {}); }).find("needs the model's units"), std::string::npos);
}

// step_unless(): a set flag leaves parameters and state (step counts included) as they were,
// an unset one is step(); the sequence equals step() on the kept steps and skip_step() on the
// dropped ones. The fused Adam/AdamW kernels and Adagrad (fused, or its _foreach_ path with a
// where(); only without lr_decay) drop an update without a host read. Dropped steps'
// gradients hold NaN and Inf, as the non-finite steps that get dropped do.
TEST(OptimSkipOnDevice, AFlaggedUpdateIsDroppedAndTheOthersAreStep) {
  for (const std::string name : {"adam", "adamw", "adagrad", "adagrad_foreach"}) {
    SCOPED_TRACE(name);
    OptimizerOptions o;
    o.name = name == "adagrad_foreach" ? "adagrad" : name;
    o.fused = name != "adagrad_foreach";
    o.lr = 0.01;
    o.weight_decay = 0.1;
    auto make = [] {
      auto g = at::make_generator<at::CPUGeneratorImpl>(5);
      return std::vector<at::Tensor>{at::randn({33}, g).requires_grad_(true), at::randn({4, 6}, g).requires_grad_(true)};
    };
    std::vector<at::Tensor> a = make(), b = make();
    std::unique_ptr<Optimizer> flagged = make_optimizer(a, o), reference = make_optimizer(b, o);
    ASSERT_TRUE(flagged->skips_on_device());
    const std::vector<bool> drop = {false, true, false, true, true, false};
    for (size_t step = 0; step < drop.size(); ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(200 + step);
      for (size_t i = 0; i < a.size(); ++i) {
        at::Tensor grad = at::randn(a[i].sizes(), g);
        if (drop[step]) grad.view({-1})[i] = i == 0 ? std::nan("") : INFINITY;
        a[i].mutable_grad() = grad.clone();
        b[i].mutable_grad() = grad.clone();
      }
      const at::Tensor multiplier = at::scalar_tensor(0.5, at::kFloat);
      flagged->step_unless(multiplier, at::full({1}, drop[step] ? 1.0 : 0.0));
      if (drop[step]) {
        reference->skip_step();
      } else {
        reference->step(multiplier);
      }
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "step " << step << " param " << i;
    }
    const auto sa = flagged->state(), sb = reference->state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t k = 0; k < sa.size(); ++k) {
      EXPECT_TRUE(at::equal(sa[k].second, sb[k].second)) << sa[k].first;
      if (sa[k].first == "0.step") EXPECT_EQ(sa[k].second.item<double>(), 3.0);
    }
  }
  OptimizerOptions sgd;
  sgd.name = "sgd";
  std::vector<at::Tensor> p = {at::zeros({3}).requires_grad_(true)};
  p[0].mutable_grad() = at::ones({3});
  std::unique_ptr<Optimizer> opt = make_optimizer(p, sgd);
  EXPECT_FALSE(opt->skips_on_device());
  EXPECT_THROW(opt->step_unless(at::Tensor(), at::ones({1})), dtrain::Error);
  OptimizerOptions unfused;
  unfused.name = "adamw";
  unfused.fused = false;
  EXPECT_FALSE(make_optimizer(p, unfused)->skips_on_device());
  OptimizerOptions decaying;
  decaying.name = "adagrad";
  decaying.lr_decay = 0.01;  // its learning rate counts host steps: the flag is read on the host
  EXPECT_FALSE(make_optimizer(p, decaying)->skips_on_device());
}

}  // namespace dtrain::engine
