#include "dtrain/offload/update_rule.h"

#include <cmath>

#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

void check_non_negative(double value, const char* field, const std::string& who, const std::string& name) {
  DTRAIN_CHECK(std::isfinite(value) && value >= 0.0, who, " ", name, ": ", field, " = ", value,
               " must be a finite number >= 0");
}

void check_beta(double value, const char* field, const std::string& who, const std::string& name) {
  DTRAIN_CHECK(value >= 0.0 && value < 1.0, who, " ", name, ": ", field, " = ", value, " must be in [0, 1)");
}

}  // namespace

void validate_rule(const UpdateRuleOptions& o, const std::string& who) {
  const std::string& name = o.name;
  DTRAIN_CHECK(name == "sgd" || name == "adam" || name == "adamw" || name == "adagrad", "unknown ", who,
               " name '", name, "'; known names: sgd, adam, adamw, adagrad");
  check_non_negative(o.lr, "lr", who, name);
  check_non_negative(o.weight_decay, "weight_decay", who, name);
  if (name == "sgd") {
    check_non_negative(o.momentum, "momentum", who, name);
    check_non_negative(o.dampening, "dampening", who, name);
    DTRAIN_CHECK(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0), who,
                 " sgd: nesterov needs momentum > 0 and dampening = 0 (momentum = ", o.momentum,
                 ", dampening = ", o.dampening, "); set momentum or turn nesterov off");
  } else if (name == "adam" || name == "adamw") {
    check_beta(o.beta1, "beta1", who, name);
    check_beta(o.beta2, "beta2", who, name);
    check_non_negative(o.eps, "eps", who, name);
  } else {
    check_non_negative(o.eps, "eps", who, name);
    check_non_negative(o.lr_decay, "lr_decay", who, name);
    check_non_negative(o.initial_accumulator_value, "initial_accumulator_value", who, name);
  }
}

}  // namespace dtrain::offload
