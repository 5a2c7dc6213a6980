// Option checks, the factory, and the parts of the multi-tensor optimizer shared by every
// update rule: state slots, gradient scanning and grouping, zero_grad, checkpoint state.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "dtrain/dist/error.h"
#include "optim_internal.h"

namespace dtrain::engine {

void validate(const OptimizerOptions& options) { offload::validate_rule(options, "optimizer"); }

namespace {
// Layer offload is how a GPU model gets parameters on two devices (its streamed blocks' weights
// live on the host): the advice that names the layout taking both, or nothing.
std::string two_devices_advice(const at::Tensor& a, const at::Tensor& b, const std::string& who) {
  if (a.device() == b.device() || !(a.is_cpu() || b.is_cpu())) return "";
  return ". Layer offload (--offload=layers) keeps the streamed blocks' weights on the host and the rest on the "
         "device: for a sharded or offloaded optimizer with it use --offload=all (the device part partitioned and "
         "updated on the host, the streamed blocks updated on the host), or drop " + who;
}
}  // namespace

void check_one_flat_space(const std::vector<at::Tensor>& params, const std::string& who) {
  DTRAIN_CHECK(!params.empty(), who, " needs at least one parameter");
  const at::Tensor& first = params.front();
  for (size_t i = 0; i < params.size(); ++i) {
    DTRAIN_CHECK(params[i].scalar_type() == first.scalar_type() && params[i].device() == first.device(), who,
                 " needs all parameters in one dtype and device; parameter ", i, " is ", params[i].scalar_type(),
                 " on ", params[i].device(), ", parameter 0 ", first.scalar_type(), " on ", first.device(),
                 two_devices_advice(params[i], first, who));
  }
}

std::unique_ptr<Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                          const OptimizerOptions& options) {
  validate(options);
  DTRAIN_CHECK(!params.empty(), "optimizer ", options.name,
               ": the parameter list is empty; pass the model's parameters");
  switch (rule_traits(options.name).rule) {
    case Rule::kSgd:
      return optim_detail::make_sgd(std::move(params), options);
    case Rule::kAdagrad:
      return optim_detail::make_adagrad(std::move(params), options);
    case Rule::kAdam:
    case Rule::kAdamW:
      break;
  }
  return optim_detail::make_adam(std::move(params), options);
}

std::vector<at::Tensor> Optimizer::device_state() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : state()) out.push_back(t);
  return out;
}

void Optimizer::load_shard_state(const ShardState& state) {
  DTRAIN_CHECK(state.tensors.empty(), "optimizer ", options().name, ": load_shard_state got ",
               state.tensors.size(), " partitioned entries, but this optimizer is not partitioned; resume "
               "with the --offload setting of the run that saved");
}

void Optimizer::step_unless(const at::Tensor&, const at::Tensor&) {
  DTRAIN_CHECK(false, "optimizer ", options().name, ": this optimizer cannot drop an update on the device "
               "(skips_on_device() is false); read the flag and call step() or skip_step()");
}

namespace optim_detail {

void check_param(const at::Tensor& p, size_t index, std::unordered_set<const void*>& seen) {
  DTRAIN_CHECK(p.defined(), "optimizer: parameter ", index, " is an undefined tensor");
  DTRAIN_CHECK(p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()),
               "optimizer: parameter ", index, " must be a dense floating-point tensor, got ",
               p.toString());
  DTRAIN_CHECK(p.is_non_overlapping_and_dense(), "optimizer: parameter ", index, " (sizes ",
               p.sizes(), ", strides ", p.strides(),
               ") must be non-overlapping and dense; pass a contiguous tensor");
  DTRAIN_CHECK(p.is_leaf(), "optimizer: parameter ", index,
               " is not a leaf tensor (it was computed from others); pass the tensors that "
               "autograd accumulates gradients into, e.g. module.parameters()");
  DTRAIN_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "optimizer: parameter ", index,
               " appears twice in the parameter list; pass each parameter once");
}

namespace {


void check_grad(const at::Tensor& p, const at::Tensor& g, size_t index) {
  DTRAIN_CHECK(g.layout() == at::kStrided, "optimizer: the gradient of parameter ", index,
               " is not dense (", g.layout(), "); sparse gradients are not supported");
  DTRAIN_CHECK(g.device() == p.device() && g.scalar_type() == p.scalar_type() &&
                   g.sizes() == p.sizes() && g.strides() == p.strides(),
               "optimizer: the gradient of parameter ", index, " (", g.toString(), ", sizes ",
               g.sizes(), ", strides ", g.strides(), ") must have its parameter's device, dtype, ",
               "sizes and strides (", p.toString(), ", sizes ", p.sizes(), ", strides ",
               p.strides(), ")");
}

}  // namespace

MultiTensorOptimizer::MultiTensorOptimizer(std::vector<at::Tensor> params,
                                           const OptimizerOptions& options,
                                           std::vector<std::string> slot_names, double slot_init,
                                           bool device_steps, bool split_first_step)
    : options_(options),
      params_(std::move(params)),
      device_steps_(device_steps),
      split_first_step_(split_first_step),
      host_steps_(params_.size(), 0),
      cached_grads_(params_.size(), nullptr) {
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) check_param(params_[i], i, seen);
  at::NoGradGuard no_grad;
  if (device_steps_) {
    slot_names_.push_back("step");
    std::vector<at::Tensor> steps;
    for (const at::Tensor& p : params_) {
      steps.push_back(at::zeros(c10::IntArrayRef{}, p.options().dtype(at::kFloat)));
    }
    slots_.push_back(std::move(steps));
  }
  for (std::string& name : slot_names) {
    std::vector<at::Tensor> slot;
    for (const at::Tensor& p : params_) {
      slot.push_back(
          at::full_like(p.detach(), slot_init, at::TensorOptions(), at::MemoryFormat::Preserve));
    }
    slot_names_.push_back(std::move(name));
    slots_.push_back(std::move(slot));
  }
}

bool MultiTensorOptimizer::grads_changed() {
  bool changed = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    const c10::TensorImpl* impl = g.defined() ? g.unsafeGetTensorImpl() : nullptr;
    if (impl != cached_grads_[i]) {
      cached_grads_[i] = impl;
      changed = true;
    }
  }
  return changed;
}

void MultiTensorOptimizer::rebuild_groups() {
  // Check every gradient before keeping any list, so a bad one changes nothing.
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (g.defined()) check_grad(params_[i], g, i);
  }
  groups_.clear();
  std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, at::ScalarType, bool>, size_t> where;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    bool first = split_first_step_ && host_steps_[i] == 0;
    auto key = std::make_tuple(p.device().type(), p.device().index(), p.scalar_type(), first);
    auto [it, inserted] = where.emplace(key, groups_.size());
    if (inserted) {
      ParamGroup group;
      group.device = p.device();
      group.dtype = p.scalar_type();
      group.first_step = first;
      group.slots.resize(slots_.size());
      groups_.push_back(std::move(group));
    }
    ParamGroup& group = groups_[it->second];
    group.indices.push_back(static_cast<int64_t>(i));
    group.params.push_back(p);
    group.grads.push_back(g);
    for (size_t s = 0; s < slots_.size(); ++s) group.slots[s].push_back(slots_[s][i]);
    group.host_steps.push_back(0);
  }
  groups_stale_ = false;
}

std::vector<at::Tensor> ParamGroup::multiplied_grads() const {
  return multiplier.defined() ? at::_foreach_mul(grads, multiplier) : grads;
}

void MultiTensorOptimizer::step(const at::Tensor& grad_multiplier) {
  at::NoGradGuard no_grad;
  DTRAIN_CHECK(!grad_multiplier.defined() ||
                   (grad_multiplier.numel() == 1 && at::isFloatingType(grad_multiplier.scalar_type())),
               "optimizer ", options_.name, ": the gradient multiplier must be a one-element floating tensor, got ",
               grad_multiplier.defined() ? grad_multiplier.toString() : std::string());
  if (grads_changed() || groups_stale_) {
    try {
      rebuild_groups();
    } catch (...) {
      // Rescan next time: the caller may fix the gradient and call step() again.
      std::fill(cached_grads_.begin(), cached_grads_.end(), nullptr);
      groups_stale_ = true;
      throw;
    }
  }
  for (ParamGroup& group : groups_) {
    // The gradient tensors are taken afresh each step and dropped after it: holding them
    // would keep memory alive that its owner (the reducer's buckets, rebuilt once) freed.
    group.grads.clear();
    for (size_t k = 0; k < group.indices.size(); ++k) {
      group.host_steps[k] = ++host_steps_[group.indices[k]];
      group.grads.push_back(params_[group.indices[k]].grad());
    }
    // Asynchronous unless it lands on the host (the CPU kernels would read pinned memory that a
    // device copy has not filled yet), as the multiplier below.
    if (skip_.defined()) {
      group.skip = skip_.reshape({}).to(group.device, at::kFloat, /*non_blocking=*/!group.device.is_cpu());
    }
    if (device_steps_) {
      // A dropped update does not count: + (1 - skip).
      if (group.skip.defined()) {
        at::_foreach_add_(group.slots[0], at::rsub(group.skip, 1.0));
      } else {
        at::_foreach_add_(group.slots[0], at::Scalar(1.0));
      }
    }
    if (grad_multiplier.defined()) {
      // Asynchronous unless it lands on the host (the CPU kernels after it would race a device
      // copy into pinned memory).
      group.multiplier =
          grad_multiplier.reshape({}).to(group.device, at::kFloat, /*non_blocking=*/!group.device.is_cpu());
      group.grad_scale = at::reciprocal(group.multiplier);
    }
    update(group);
    group.grads.clear();
    group.multiplier.reset();
    group.grad_scale.reset();
    group.skip.reset();
    // Those parameters' next update is not a first one: regroup.
    if (group.first_step) groups_stale_ = true;
  }
}

bool MultiTensorOptimizer::skips_on_device() const {
  return device_steps_ && options_.fused && fused_kernels_skip();
}

void MultiTensorOptimizer::step_unless(const at::Tensor& grad_multiplier, const at::Tensor& skip) {
  DTRAIN_CHECK(skips_on_device(), "optimizer ", options_.name, ": step_unless() needs the fused Adam/AdamW kernels "
               "(skips_on_device())");
  DTRAIN_CHECK(skip.defined() && skip.numel() == 1 && at::isFloatingType(skip.scalar_type()), "optimizer ",
               options_.name, ": step_unless() takes a one-element floating flag");
  struct Reset {
    at::Tensor& t;
    ~Reset() { t.reset(); }
  } reset{skip_};
  skip_ = skip;
  step(grad_multiplier);
}

bool MultiTensorOptimizer::dropped(const ParamGroup& group) {
  if (!group.skip.defined() || group.skip.item<float>() == 0.0f) return false;
  // A dropped update does not count, as the device step counts do not count it: the next
  // update's bias correction takes the number of updates taken (torch's skipped step).
  for (size_t index : group.indices) --host_steps_[index];
  return true;
}

void MultiTensorOptimizer::zero_grad() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (!grads.empty()) at::_foreach_zero_(grads);
}

void MultiTensorOptimizer::set_lr(double lr) {
  DTRAIN_CHECK(std::isfinite(lr) && lr >= 0.0, "optimizer ", options_.name, ": set_lr(", lr,
               ") needs a finite lr >= 0");
  options_.lr = lr;
}

bool MultiTensorOptimizer::try_fused(const ParamGroup& group) const {
  if (!options_.fused) return false;
  auto key = std::make_pair(group.device.type(), group.dtype);
  return std::find(no_fused_.begin(), no_fused_.end(), key) == no_fused_.end();
}

void MultiTensorOptimizer::remember_no_fused(const ParamGroup& group) {
  no_fused_.emplace_back(group.device.type(), group.dtype);
}

std::vector<std::pair<std::string, at::Tensor>> MultiTensorOptimizer::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    std::string prefix = std::to_string(i) + ".";
    if (!device_steps_) {
      out.emplace_back(prefix + "step",
                       at::full(c10::IntArrayRef{}, static_cast<double>(host_steps_[i]),
                                params_[i].options().dtype(at::kFloat)));
    }
    for (size_t s = 0; s < slots_.size(); ++s) {
      out.emplace_back(prefix + slot_names_[s], slots_[s][i]);
    }
  }
  return out;
}

void MultiTensorOptimizer::load_state(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::unordered_map<std::string, at::Tensor> given;
  for (const auto& [name, tensor] : state) {
    DTRAIN_CHECK(given.emplace(name, tensor).second, "optimizer ", options_.name,
                 ": load_state got '", name, "' twice");
  }
  // The expected entries, checked in full before anything is copied.
  std::vector<std::pair<const at::Tensor*, at::Tensor*>> copies;
  std::vector<int64_t> steps(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    std::string prefix = std::to_string(i) + ".";
    auto find = [&](const std::string& slot) -> const at::Tensor& {
      auto it = given.find(prefix + slot);
      DTRAIN_CHECK(it != given.end() && it->second.defined(), "optimizer ", options_.name,
                   ": load_state misses '", prefix, slot,
                   "'; the state must come from state() of a '", options_.name,
                   "' optimizer over the same parameters");
      return it->second;
    };
    const at::Tensor& step = find("step");
    DTRAIN_CHECK(step.numel() == 1, "optimizer ", options_.name, ": '", prefix, "step' has sizes ",
                 step.sizes(), ", expected a single value");
    double value = step.item<double>();
    DTRAIN_CHECK(value >= 0.0 && value == std::floor(value) && value < 9.0e15, "optimizer ",
                 options_.name, ": '", prefix, "step' = ", value,
                 " is not a non-negative whole number");
    steps[i] = static_cast<int64_t>(value);
    for (size_t s = device_steps_ ? 1 : 0; s < slots_.size(); ++s) {
      const at::Tensor& t = find(slot_names_[s]);
      DTRAIN_CHECK(t.sizes() == params_[i].sizes(), "optimizer ", options_.name, ": '", prefix,
                   slot_names_[s], "' has sizes ", t.sizes(), ", parameter ", i, " has ",
                   params_[i].sizes());
      copies.emplace_back(&t, &slots_[s][i]);
    }
  }
  size_t expected = params_.size() * (slots_.size() + (device_steps_ ? 0 : 1));
  if (given.size() != expected) {
    std::set<std::string> known;
    for (const auto& [name, t] : this->state()) known.insert(name);
    for (const auto& [name, t] : given) {
      DTRAIN_CHECK(known.count(name), "optimizer ", options_.name, ": load_state got '", name,
                   "', which is not part of this optimizer's state");
    }
  }
  at::NoGradGuard no_grad;
  for (auto& [src, dst] : copies) dst->copy_(*src);
  host_steps_ = steps;
  if (device_steps_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      slots_[0][i].fill_(static_cast<double>(steps[i]));
    }
  }
  groups_stale_ = true;
}

}  // namespace optim_detail
}  // namespace dtrain::engine
