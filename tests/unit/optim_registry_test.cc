// The update-rule table (dtrain/offload/update_rule.h), the one place that maps an optimizer's
// name to what differs between rules: every name known, an unknown one refused with the list,
// and the state arrays it declares per rule equal to what each optimizer family (device,
// CPU/offload, sparse) actually keeps and checkpoints.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/sparse_optim.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"
#include "dtrain/offload/update_rule.h"

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

TEST(OptimizerRegistry, EffectiveEpsComesFromTheTable) {
  OptimizerOptions o;
  for (const char* name : {"sgd", "adam", "adamw"}) {
    o.name = name;
    EXPECT_EQ(effective_eps(o), 1e-8) << name;
  }
  o.name = "adagrad";
  EXPECT_EQ(effective_eps(o), rule_traits("adagrad").default_eps);
  EXPECT_EQ(effective_eps(o), 1e-10);
}

}  // namespace
}  // namespace dtrain::engine
