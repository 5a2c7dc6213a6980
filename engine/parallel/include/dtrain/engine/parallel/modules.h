// Walking a model's modules without needing it held by a shared_ptr.
#pragma once

#include <torch/nn/module.h>

#include <string>

namespace dtrain::engine {

// Calls fn(name, module) for the model itself (name "") and then every submodule (its dotted
// name), as model.named_modules() does. named_modules(include_self=true) throws for a model
// that no shared_ptr holds (a user's `Net net;`); this does not.
template <typename Fn>
void for_each_module(torch::nn::Module& model, Fn&& fn) {
  fn(std::string(), model);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) fn(item.key(), *item.value());
}

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
