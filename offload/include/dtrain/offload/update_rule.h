// The update rules every dtrain optimizer implements (SGD, Adam, AdamW, Adagrad with
// torch.optim's formulas), and their one set of options: the device optimizers of
// engine/optim.h and the CPU optimizer of optimizer offload both take these fields.
#pragma once

#include <string>
#include <vector>

namespace dtrain::offload {

// The update rules, and the one table that maps a rule's name to what differs between rules
// (update_rule.cc). Every optimizer, the planner and the command line look a name up here and
// dispatch on the Rule it returns; no other code compares optimizer names.
enum class Rule { kSgd, kAdam, kAdamW, kAdagrad };

struct RuleTraits {
  Rule rule;
  const char* name;
  // Adam's moments (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad): adam and adamw.
  bool adam_family;
  // Weight decay applied to the parameter (AdamW), not added to the gradient as L2.
  bool decoupled_weight_decay;
  // The eps the rule reads while UpdateRuleOptions::eps keeps its default (1e-8): torch's
  // Adagrad default 1e-10 for adagrad, 1e-8 for the others.
  double default_eps;
  // The momentum the command line sets for the rule (the CLI's choice, not torch's default 0).
  double command_line_momentum;
};

// The rule named `name`; throws dtrain::Error naming `who` and listing the known names.
const RuleTraits& rule_traits(const std::string& name, const std::string& who = "optimizer");
// The known names in the table's order ("sgd, adam, adamw, adagrad"), for messages and --help.
std::string rule_names();

// Defaults are torch.optim's, except: lr is 1e-3 for every rule (torch's Adagrad uses 1e-2)
// and weight_decay is 0 for every rule (torch's AdamW uses 1e-2).
struct UpdateRuleOptions {
  std::string name = "adamw";  // a name of rule_traits(): "sgd", "adam", "adamw", "adagrad"
  double lr = 1e-3;
  double weight_decay = 0.0;  // adamw: decoupled; others: L2 added to the gradient
  // sgd
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0
  // adam / adamw
  double beta1 = 0.9;
  double beta2 = 0.999;
  // adam / adamw / adagrad (how an optimizer reads eps for adagrad: effective_eps()).
  double eps = 1e-8;
  bool amsgrad = false;
  // adagrad
  double lr_decay = 0.0;
  double initial_accumulator_value = 0.0;
};

// Throws dtrain::Error, naming `who` ("optimizer", "CPU optimizer"), for an unknown name (the
// message lists the known ones), a negative or non-finite lr, and, for the fields the named
// rule uses: betas outside [0, 1), negative or non-finite eps / weight decay / momentum /
// dampening / lr_decay / initial_accumulator_value, nesterov without momentum or with
// dampening.
void validate_rule(const UpdateRuleOptions& options, const std::string& who);

// The per-element state arrays the rule keeps beside each parameter, in the order optimizers
// store and checkpoint them (no step counter): sgd "momentum_buffer" when momentum != 0;
// adam/adamw "exp_avg", "exp_avg_sq" and "max_exp_avg_sq" with amsgrad; adagrad "sum".
std::vector<std::string> moment_names(const UpdateRuleOptions& options);

// The eps the rule reads (RuleTraits::default_eps while options.eps keeps its default).
double effective_eps(const UpdateRuleOptions& options);

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
