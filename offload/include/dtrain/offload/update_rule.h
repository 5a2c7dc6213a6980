// The update rules every dtrain optimizer implements (SGD, Adam, AdamW, Adagrad with
// torch.optim's formulas), and their one set of options: the device optimizers of
// engine/optim.h and the CPU optimizer of optimizer offload both take these fields.
#pragma once

#include <string>

namespace dtrain::offload {

// Defaults are torch.optim's, except: lr is 1e-3 for every rule (torch's Adagrad uses 1e-2)
// and weight_decay is 0 for every rule (torch's AdamW uses 1e-2).
struct UpdateRuleOptions {
  std::string name = "adamw";  // "sgd", "adam", "adamw", "adagrad"
  double lr = 1e-3;
  double weight_decay = 0.0;  // adamw: decoupled; others: L2 added to the gradient
  // sgd
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0
  // adam / adamw
  double beta1 = 0.9;
  double beta2 = 0.999;
  // adam / adamw / adagrad (how an optimizer reads eps for adagrad: engine::effective_eps()).
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

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
