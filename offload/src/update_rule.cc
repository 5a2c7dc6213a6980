#include "dtrain/offload/update_rule.h"

#include <cmath>
#include <iterator>

#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

const double kDefaultEps = UpdateRuleOptions{}.eps;

// rule, name, adam_family, decoupled_weight_decay, default_eps, command_line_momentum
const RuleTraits kRules[] = {
    {Rule::kSgd, "sgd", false, false, kDefaultEps, 0.9},
    {Rule::kAdam, "adam", true, false, kDefaultEps, 0.0},
    {Rule::kAdamW, "adamw", true, true, kDefaultEps, 0.0},
    {Rule::kAdagrad, "adagrad", false, false, 1e-10, 0.0},
};

void check_non_negative(double value, const char* field, const std::string& who, const std::string& name) {
  DTRAIN_CHECK(std::isfinite(value) && value >= 0.0, who, " ", name, ": ", field, " = ", value,
               " must be a finite number >= 0");
}

void check_beta(double value, const char* field, const std::string& who, const std::string& name) {
  DTRAIN_CHECK(value >= 0.0 && value < 1.0, who, " ", name, ": ", field, " = ", value, " must be in [0, 1)");
}

}  // namespace

const RuleTraits& rule_traits(const std::string& name, const std::string& who) {
  for (const RuleTraits& r : kRules) {
    if (name == r.name) return r;
  }
  throw Error(detail::concat("unknown ", who, " name '", name, "'; known names: ", rule_names()));
}

std::string rule_names() {
  std::string out;
  for (const RuleTraits& r : kRules) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

void validate_rule(const UpdateRuleOptions& o, const std::string& who) {
  const std::string& name = o.name;
  const RuleTraits& traits = rule_traits(name, who);
  check_non_negative(o.lr, "lr", who, name);
  check_non_negative(o.weight_decay, "weight_decay", who, name);
  if (traits.rule == Rule::kSgd) {
    check_non_negative(o.momentum, "momentum", who, name);
    check_non_negative(o.dampening, "dampening", who, name);
    DTRAIN_CHECK(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0), who,
                 " sgd: nesterov needs momentum > 0 and dampening = 0 (momentum = ", o.momentum,
                 ", dampening = ", o.dampening, "); set momentum or turn nesterov off");
  } else if (traits.adam_family) {
    check_beta(o.beta1, "beta1", who, name);
    check_beta(o.beta2, "beta2", who, name);
    check_non_negative(o.eps, "eps", who, name);
  } else {
    check_non_negative(o.eps, "eps", who, name);
    check_non_negative(o.lr_decay, "lr_decay", who, name);
    check_non_negative(o.initial_accumulator_value, "initial_accumulator_value", who, name);
  }
}

std::vector<std::string> moment_names(const UpdateRuleOptions& o) {
  const RuleTraits& traits = rule_traits(o.name);
  if (traits.adam_family) {
    std::vector<std::string> names = {"exp_avg", "exp_avg_sq"};
    if (o.amsgrad) names.push_back("max_exp_avg_sq");
    return names;
  }
  if (traits.rule == Rule::kAdagrad) return {"sum"};
  if (o.momentum != 0.0) return {"momentum_buffer"};
  return {};
}

double effective_eps(const UpdateRuleOptions& o) {
  return o.eps == kDefaultEps ? rule_traits(o.name).default_eps : o.eps;
}

}  // namespace dtrain::offload
