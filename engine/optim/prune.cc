#include "dtrain/engine/optim/prune.h"

#include <cmath>

#include <ATen/ATen.h>
#include <glog/logging.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/modules.h"

namespace dtrain::engine {
namespace {

// Python's round(): half to even (torch's _compute_nparams_toprune uses it).
int64_t round_half_even(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

}  // namespace

bool default_prunable(const std::string&, const torch::nn::Module& owner, const std::string& local) {
  if (local != "weight") return false;
  return owner.as<torch::nn::LinearImpl>() || owner.as<torch::nn::Conv1dImpl>() || owner.as<torch::nn::Conv2dImpl>() ||
         owner.as<torch::nn::Conv3dImpl>() || owner.as<ColumnParallelLinearImpl>() || owner.as<RowParallelLinearImpl>();
}

void validate(const PruneOptions& o) {
  DTRAIN_CHECK(o.amount >= 0 && o.amount < 1, "--prune_amount=", o.amount, " must be in [0, 1)");
  DTRAIN_CHECK(o.scope == "layer" || o.scope == "global", "--prune_scope=", o.scope, " is not one of: layer, global");
  if (o.amount == 0) return;
  const bool one_shot = o.at_step > 0, gradual = o.from_step > 0 || o.to_step > 0;
  DTRAIN_CHECK(one_shot != gradual, "--prune_amount needs either --prune_at_step=N (one-shot) or --prune_from_step=A "
               "--prune_to_step=B (gradual), not ", one_shot ? "both" : "neither");
  DTRAIN_CHECK(!gradual || (o.from_step >= 1 && o.to_step > o.from_step), "--prune_from_step=", o.from_step,
               " and --prune_to_step=", o.to_step, " must satisfy 1 <= from < to");
  DTRAIN_CHECK(o.every >= 1, "--prune_every=", o.every, " must be >= 1");
}

double prune_target(const PruneOptions& o, int64_t step) {
  if (o.amount == 0) return -1;
  if (o.at_step > 0) return step == o.at_step ? o.amount : -1;
  if (step < o.from_step || step > o.to_step) return -1;
  if (step != o.to_step && (step - o.from_step) % o.every != 0) return -1;
  const double progress = static_cast<double>(step - o.from_step) / static_cast<double>(o.to_step - o.from_step);
  return o.amount * (1.0 - std::pow(1.0 - progress, 3));
}

std::vector<at::Tensor> l1_masks(const std::vector<at::Tensor>& tensors, double amount, const std::string& scope) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> masks;
  auto prune = [&](const at::Tensor& magnitudes) {  // flat; returns a flat keep-mask
    at::Tensor keep = at::ones({magnitudes.numel()}, magnitudes.options().dtype(at::kBool));
    const int64_t k = round_half_even(amount * static_cast<double>(magnitudes.numel()));
    if (k > 0) keep.index_fill_(0, std::get<1>(at::topk(magnitudes, k, 0, /*largest=*/false)), false);
    return keep;
  };
  if (scope == "layer") {
    for (const at::Tensor& t : tensors) masks.push_back(prune(t.detach().abs().reshape({-1})).view(t.sizes()));
    return masks;
  }
  DTRAIN_CHECK(scope == "global", "unknown pruning scope '", scope, "'");
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : tensors) flat.push_back(t.detach().abs().reshape({-1}).to(tensors.front().device()));
  at::Tensor keep = prune(at::cat(flat));
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    masks.push_back(keep.narrow(0, offset, t.numel()).view(t.sizes()).to(t.device()));
    offset += t.numel();
  }
  return masks;
}

Pruner::Pruner(torch::nn::Module& model, PruneOptions options, std::map<std::string, ShardSpec> specs,
               dist::Communicator& tp)
    : options_(std::move(options)), specs_(std::move(specs)), tp_(&tp) {
  validate(options_);
  auto rule = options_.prunable ? options_.prunable : default_prunable;
  for_each_module(model, [&](const std::string& name, torch::nn::Module& m) {
    const std::string prefix = name.empty() ? "" : name + ".";
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      if (!p.value().requires_grad() || !rule(prefix + p.key(), m, p.key())) continue;
      names_.push_back(prefix + p.key());
      params_.push_back(p.value());
    }
  });
  DTRAIN_CHECK(!params_.empty(), "--prune_amount: the model has no prunable parameter (by default the weights of "
               "Linear, Conv and tensor-parallel linear layers); choose them with PruneOptions::prunable");
}

at::Tensor Pruner::full_of(size_t i) const {
  auto spec = specs_.find(names_[i]);
  if (spec == specs_.end() || tp_->size() == 1) return params_[i].detach();
  return gather_full_tensor(params_[i].detach(), spec->second, *tp_);
}

void Pruner::set_masks(const std::vector<at::Tensor>& full) {
  masks_.clear();
  int64_t pruned = 0, total = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    pruned += full[i].numel() - full[i].sum().item<int64_t>();
    total += full[i].numel();
    at::Tensor mine = full[i];
    auto spec = specs_.find(names_[i]);
    if (spec != specs_.end() && tp_->size() > 1) mine = shard_of(full[i], spec->second, tp_->rank(), tp_->size());
    masks_.push_back(mine.to(params_[i].device()).contiguous());
  }
  sparsity_ = total > 0 ? static_cast<double>(pruned) / static_cast<double>(total) : 0;
}

bool Pruner::maybe_prune(int64_t step) {
  const double target = prune_target(options_, step);
  if (target < 0) return false;
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < params_.size(); ++i) full.push_back(full_of(i));
  set_masks(l1_masks(full, target, options_.scope));
  mask_weights();
  LOG_IF(INFO, tp_->rank() == 0) << "pruned before step " << step << ": " << 100 * sparsity_ << "% of "
                                 << params_.size() << " prunable tensor(s) (" << options_.scope << " scope)";
  return true;
}

void Pruner::mask_gradients() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < masks_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (g.defined()) g.mul_(masks_[i]);
  }
}

void Pruner::mask_weights() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < masks_.size(); ++i) params_[i].mul_(masks_[i]);
}

std::vector<std::pair<std::string, at::Tensor>> Pruner::full_masks() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < masks_.size(); ++i) {
    auto spec = specs_.find(names_[i]);
    at::Tensor full = spec == specs_.end() || tp_->size() == 1
                          ? masks_[i]
                          : gather_full_tensor(masks_[i].to(at::kByte), spec->second, *tp_).to(at::kBool);
    out.emplace_back(names_[i], full.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
  return out;
}

void Pruner::load_masks(const std::vector<std::pair<std::string, at::Tensor>>& full) {
  std::map<std::string, at::Tensor> given(full.begin(), full.end());
  std::vector<at::Tensor> ordered;
  for (size_t i = 0; i < names_.size(); ++i) {
    auto it = given.find(names_[i]);
    DTRAIN_CHECK(it != given.end(), "the checkpoint's pruning masks have none for '", names_[i],
                 "' (pruned with another PruneOptions::prunable?)");
    std::vector<int64_t> whole = params_[i].sizes().vec();  // the unsplit shape
    auto spec = specs_.find(names_[i]);
    if (spec != specs_.end() && spec->second.dim >= 0) whole[spec->second.dim] = spec->second.full;
    DTRAIN_CHECK(it->second.sizes().vec() == whole, "the checkpoint's pruning mask of '", names_[i], "' has shape ",
                 it->second.sizes(), ", the parameter ", at::IntArrayRef(whole));
    ordered.push_back(it->second.to(at::kBool));
    given.erase(it);
  }
  DTRAIN_CHECK(given.empty(), "the checkpoint has a pruning mask for '", given.empty() ? "" : given.begin()->first,
               "', which is not a prunable parameter of this model");
  set_masks(ordered);
  mask_weights();
}

}  // namespace dtrain::engine
