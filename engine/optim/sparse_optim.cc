// make_sparse_aware_optimizer(): the dense parameters through make_optimizer(), the
// sparse-gradient parameters through torch.optim's sparse rules (SGD, Adagrad, SparseAdam),
// one index_select / index_add_ / index_copy_ per state tensor on the rows a gradient names.
#include "dtrain/engine/optim/sparse_optim.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cctype>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "dtrain/dist/error.h"
#include "optim_internal.h"

namespace dtrain::engine {
namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

std::string index_list(const std::vector<size_t>& indices) {
  std::ostringstream os;
  for (size_t k = 0; k < indices.size(); ++k) os << (k ? ", " : "") << indices[k];
  return os.str();
}

// "<index>.<rest>" -> (index, rest); false when the name has no such form.
bool split_name(const std::string& name, size_t& index, std::string& rest) {
  size_t dot = name.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 18) return false;
  for (size_t k = 0; k < dot; ++k) {
    if (!std::isdigit(static_cast<unsigned char>(name[k]))) return false;
  }
  index = std::stoull(name.substr(0, dot));
  rest = name.substr(dot + 1);
  return true;
}

class SparseAwareOptimizer final : public Optimizer {
 public:
  SparseAwareOptimizer(std::vector<at::Tensor> params, std::vector<bool> sparse, const OptimizerOptions& options)
      : all_(std::move(params)), is_sparse_(std::move(sparse)), options_(options), local_(all_.size(), -1) {
    std::vector<at::Tensor> dense;
    for (size_t i = 0; i < all_.size(); ++i) {
      if (is_sparse_[i]) {
        Row row;
        row.index = i;
        sparse_.push_back(std::move(row));
        sparse_of_[i] = sparse_.size() - 1;
      } else {
        local_[i] = static_cast<int64_t>(dense.size());
        dense.push_back(all_[i]);
      }
    }
    // The rule's moments (make_sparse_aware_optimizer refused momentum and amsgrad here).
    slot_names_ = offload::moment_names(options_);
    if (!dense.empty()) dense_ = make_optimizer(std::move(dense), options_);
    at::NoGradGuard no_grad;
    double init = rule_ == Rule::kAdagrad ? options_.initial_accumulator_value : 0.0;
    for (Row& row : sparse_) {
      const at::Tensor& p = all_[row.index];
      for (size_t s = 0; s < slot_names_.size(); ++s) {
        row.slots.push_back(at::full_like(p.detach(), init, at::TensorOptions(), at::MemoryFormat::Preserve));
      }
    }
  }

  using Optimizer::step;
  void step(const at::Tensor& grad_multiplier) override {
    at::NoGradGuard no_grad;
    DTRAIN_CHECK(!grad_multiplier.defined() ||
                     (grad_multiplier.numel() == 1 && at::isFloatingType(grad_multiplier.scalar_type())),
                 "optimizer ", options_.name, ": the gradient multiplier must be a one-element floating tensor, got ",
                 grad_multiplier.defined() ? grad_multiplier.toString() : std::string());
    // Every gradient the dense part does not check, before anything is updated.
    for (size_t i = 0; i < all_.size(); ++i) {
      const at::Tensor& g = all_[i].grad();
      if (!g.defined()) continue;
      if (is_sparse_[i]) {
        check_sparse_param_grad(all_[i], g, i);
      } else {
        DTRAIN_CHECK(g.layout() == at::kStrided, "optimizer ", options_.name, ": parameter ", i,
                     " received a gradient of layout ", g.layout(),
                     " but is not flagged sparse; flag it in make_sparse_aware_optimizer's `sparse` list (its "
                     "rows are then updated only where the gradient names them)");
      }
    }
    if (dense_) dense_->step(grad_multiplier);
    for (Row& row : sparse_) {
      const at::Tensor& p = all_[row.index];
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      ++row.step;
      at::Tensor rows, values;
      if (g.layout() == at::kSparse) {
        at::Tensor c = g.coalesce();  // the update is non-linear: one value per row
        if (c._nnz() == 0) continue;  // counted as a step, updates nothing (as torch)
        rows = c._indices().select(0, 0);
        values = c._values();
      } else {
        values = g;
      }
      if (grad_multiplier.defined()) {
        values = values * grad_multiplier.reshape({}).to(p.device(), at::kFloat, /*non_blocking=*/!p.is_cpu());
      }
      update(row, p, rows, values);
    }
  }

  void zero_grad() override {
    at::NoGradGuard no_grad;
    if (dense_) dense_->zero_grad();
    for (const Row& row : sparse_) {
      at::Tensor& g = all_[row.index].mutable_grad();
      if (!g.defined()) continue;
      if (g.layout() == at::kStrided) {
        g.zero_();
      } else {
        g.reset();
      }
    }
  }

  void set_lr(double lr) override {
    DTRAIN_CHECK(std::isfinite(lr) && lr >= 0.0, "optimizer ", options_.name, ": set_lr(", lr,
                 ") needs a finite lr >= 0");
    if (dense_) dense_->set_lr(lr);
    options_.lr = lr;
  }
  double lr() const override { return options_.lr; }
  const OptimizerOptions& options() const override { return options_; }
  const std::vector<at::Tensor>& params() const override { return all_; }

  NamedTensors state() const override {
    std::vector<NamedTensors> dense_of_local;
    if (dense_) {
      for (auto& [name, t] : dense_->state()) {
        size_t j = 0;
        std::string rest;
        split_name(name, j, rest);  // make_optimizer's names always have this form
        if (dense_of_local.size() <= j) dense_of_local.resize(j + 1);
        dense_of_local[j].emplace_back(rest, t);
      }
    }
    NamedTensors out;
    for (size_t i = 0; i < all_.size(); ++i) {
      std::string prefix = std::to_string(i) + ".";
      if (!is_sparse_[i]) {
        size_t j = static_cast<size_t>(local_[i]);
        if (j < dense_of_local.size()) {
          for (auto& [rest, t] : dense_of_local[j]) out.emplace_back(prefix + rest, t);
        }
        continue;
      }
      const Row& row = sparse_.at(sparse_of_.at(i));
      out.emplace_back(prefix + "step", at::full(c10::IntArrayRef{}, static_cast<double>(row.step),
                                                 all_[i].options().dtype(at::kFloat)));
      for (size_t s = 0; s < slot_names_.size(); ++s) out.emplace_back(prefix + slot_names_[s], row.slots[s]);
    }
    return out;
  }

  void load_state(const NamedTensors& state) override {
    std::unordered_map<std::string, at::Tensor> given;
    for (const auto& [name, tensor] : state) {
      DTRAIN_CHECK(given.emplace(name, tensor).second, "optimizer ", options_.name, ": load_state got '", name,
                   "' twice");
    }
    // Every entry is checked against state() (names, sizes, steps) before anything changes.
    NamedTensors expected = this->state();
    std::unordered_set<std::string> known;
    for (const auto& [name, want] : expected) {
      known.insert(name);
      auto it = given.find(name);
      DTRAIN_CHECK(it != given.end() && it->second.defined(), "optimizer ", options_.name, ": load_state misses '",
                   name, "'; the state must come from state() of a '", options_.name,
                   "' optimizer over the same parameters with the same parameters flagged sparse");
      const at::Tensor& t = it->second;
      size_t i = 0;
      std::string rest;
      split_name(name, i, rest);
      if (rest == "step") {
        DTRAIN_CHECK(t.numel() == 1, "optimizer ", options_.name, ": '", name, "' has sizes ", t.sizes(),
                     ", expected a single value");
        double value = t.item<double>();
        DTRAIN_CHECK(value >= 0.0 && value == std::floor(value) && value < 9.0e15, "optimizer ", options_.name,
                     ": '", name, "' = ", value, " is not a non-negative whole number");
      } else {
        DTRAIN_CHECK(t.sizes() == want.sizes(), "optimizer ", options_.name, ": '", name, "' has sizes ",
                     t.sizes(), ", parameter ", i, " has ", all_[i].sizes());
      }
    }
    for (const auto& [name, t] : given) {
      DTRAIN_CHECK(known.count(name), "optimizer ", options_.name, ": load_state got '", name,
                   "', which is not part of this optimizer's state (parameters ", index_list(sparse_indices()),
                   " flagged sparse)");
    }
    NamedTensors dense_state;
    for (const auto& [name, t] : state) {
      size_t i = 0;
      std::string rest;
      split_name(name, i, rest);
      if (!is_sparse_[i]) dense_state.emplace_back(std::to_string(local_[i]) + "." + rest, t);
    }
    if (dense_) dense_->load_state(dense_state);
    at::NoGradGuard no_grad;
    for (Row& row : sparse_) {
      std::string prefix = std::to_string(row.index) + ".";
      row.step = static_cast<int64_t>(given.at(prefix + "step").item<double>());
      for (size_t s = 0; s < slot_names_.size(); ++s) row.slots[s].copy_(given.at(prefix + slot_names_[s]));
    }
  }

  std::vector<at::Tensor> device_state() const override {
    std::vector<at::Tensor> out;
    if (dense_) out = dense_->device_state();
    for (const Row& row : sparse_) out.insert(out.end(), row.slots.begin(), row.slots.end());
    return out;
  }

 private:
  struct Row {  // one sparse-gradient parameter
    size_t index = 0;  // in all_
    int64_t step = 0;
    std::vector<at::Tensor> slots;  // slot_names_
  };

  std::vector<size_t> sparse_indices() const {
    std::vector<size_t> out;
    for (const Row& row : sparse_) out.push_back(row.index);
    return out;
  }

  void check_sparse_param_grad(const at::Tensor& p, const at::Tensor& g, size_t i) const {
    DTRAIN_CHECK(g.layout() == at::kSparse || g.layout() == at::kStrided, "optimizer ", options_.name,
                 ": the gradient of parameter ", i, " has layout ", g.layout(),
                 "; a parameter flagged sparse takes a sparse COO (at::kSparse) or a dense gradient");
    DTRAIN_CHECK(g.device() == p.device() && g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes(),
                 "optimizer ", options_.name, ": the gradient of parameter ", i, " (", g.toString(), ", sizes ",
                 g.sizes(), ") must have its parameter's device, dtype and sizes (", p.toString(), ", sizes ",
                 p.sizes(), ")");
    DTRAIN_CHECK(g.layout() != at::kSparse || g.sparse_dim() == 1, "optimizer ", options_.name,
                 ": the sparse gradient of parameter ", i, " has sparse_dim ", g.layout() == at::kSparse ? g.sparse_dim() : 0,
                 "; the sparse rules take gradients whose indices name rows of the parameter (sparse_dim 1, as "
                 "an embedding's sparse gradient)");
  }

  // One update of a sparse parameter on `rows` (undefined: every row) with the gradient
  // values of those rows (already multiplied).
  void update(Row& row, const at::Tensor& p, const at::Tensor& rows, const at::Tensor& values) {
    const OptimizerOptions& o = options_;
    bool all_rows = !rows.defined();
    // The state's values on the rows (a view for every row: read before that state changes).
    auto select = [&](const at::Tensor& t) { return all_rows ? t : t.index_select(0, rows); };
    auto add = [&](const at::Tensor& t, const at::Tensor& v, double alpha) {
      if (all_rows) {
        t.add_(v, alpha);
      } else {
        t.index_add_(0, rows, v, alpha);
      }
    };
    double n = static_cast<double>(row.step);
    if (rule_ == Rule::kSgd) {
      add(p, values, -o.lr);
    } else if (rule_ == Rule::kAdagrad) {
      double clr = o.lr / (1.0 + (n - 1.0) * o.lr_decay);
      at::Tensor& sum = row.slots[0];
      add(sum, values.pow(2), 1.0);
      at::Tensor std_values = select(sum).sqrt().add_(effective_eps(o));
      add(p, values / std_values, -clr);
    } else {
      // SparseAdam (torch/optim/_functional.py sparse_adam), step for step.
      at::Tensor& exp_avg = row.slots[0];
      at::Tensor& exp_avg_sq = row.slots[1];
      at::Tensor old_exp_avg = select(exp_avg);
      at::Tensor exp_avg_update = values.sub(old_exp_avg).mul_(1.0 - o.beta1);
      at::Tensor numer = exp_avg_update.add(old_exp_avg);
      add(exp_avg, exp_avg_update, 1.0);
      at::Tensor old_exp_avg_sq = select(exp_avg_sq);
      at::Tensor exp_avg_sq_update = values.pow(2).sub_(old_exp_avg_sq).mul_(1.0 - o.beta2);
      at::Tensor denom = exp_avg_sq_update.add(old_exp_avg_sq).sqrt_().add_(o.eps);
      add(exp_avg_sq, exp_avg_sq_update, 1.0);
      double bias_correction1 = 1.0 - std::pow(o.beta1, n);
      double bias_correction2 = 1.0 - std::pow(o.beta2, n);
      double step_size = o.lr * std::sqrt(bias_correction2) / bias_correction1;
      add(p, numer.div_(denom).mul_(-step_size), 1.0);
    }
  }

  std::vector<at::Tensor> all_;
  std::vector<bool> is_sparse_;
  OptimizerOptions options_;
  Rule rule_ = rule_traits(options_.name).rule;
  std::vector<int64_t> local_;  // index in the dense part, -1 for a sparse parameter
  std::map<size_t, size_t> sparse_of_;  // index in all_ -> index in sparse_
  std::unique_ptr<Optimizer> dense_;  // null when every parameter is sparse
  std::vector<Row> sparse_;
  std::vector<std::string> slot_names_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sparse_aware_optimizer(std::vector<at::Tensor> params, std::vector<bool> sparse,
                                                       const OptimizerOptions& options) {
  validate(options);
  DTRAIN_CHECK(!params.empty(), "optimizer ", options.name,
               ": the parameter list is empty; pass the model's parameters");
  DTRAIN_CHECK(sparse.size() == params.size(), "optimizer ", options.name, ": the `sparse` flags have ",
               sparse.size(), " entries for ", params.size(), " parameters; pass one flag per parameter");
  std::vector<size_t> flagged;
  for (size_t i = 0; i < sparse.size(); ++i) {
    if (sparse[i]) flagged.push_back(i);
  }
  if (flagged.empty()) return make_optimizer(std::move(params), options);
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) optim_detail::check_param(params[i], i, seen);
  for (size_t i : flagged) {
    DTRAIN_CHECK(params[i].dim() >= 1, "optimizer ", options.name, ": parameter ", i,
                 " is flagged sparse but has no rows (0-dim); flag only parameters with rows, e.g. an "
                 "embedding's weight");
  }
  const std::string who = "optimizer " + options.name + ": parameters " + index_list(flagged) +
                          " receive sparse gradients, ";
  const Rule rule = rule_traits(options.name).rule;
  if (rule == Rule::kSgd) {
    DTRAIN_CHECK(options.momentum == 0.0, who, "which sgd updates only with momentum 0 (a momentum buffer would "
                 "move every row at every step); got momentum ", options.momentum,
                 ": set momentum to 0, use adam/adamw (SparseAdam) or adagrad, or give them dense gradients");
    DTRAIN_CHECK(options.weight_decay == 0.0, who, "which sgd updates only with weight decay 0 (the L2 term "
                 "would move every row at every step); got --weight_decay ", options.weight_decay,
                 ": set --weight_decay 0, or give them dense gradients");
  } else if (rule == Rule::kAdagrad) {
    DTRAIN_CHECK(options.weight_decay == 0.0, who, "and adagrad's weight decay is not compatible with sparse "
                 "gradients (as in torch.optim.Adagrad); got --weight_decay ", options.weight_decay,
                 ": set --weight_decay 0, or give them dense gradients");
  } else {
    DTRAIN_CHECK(!options.amsgrad, who, "which ", options.name,
                 " updates with torch.optim.SparseAdam's rule, which has no amsgrad: turn amsgrad off, or give "
                 "them dense gradients");
    DTRAIN_CHECK(options.eps > 0.0, who, "which ", options.name,
                 " updates with torch.optim.SparseAdam's rule, which needs eps > 0; got eps ", options.eps);
  }
  return std::make_unique<SparseAwareOptimizer>(std::move(params), std::move(sparse), options);
}

}  // namespace dtrain::engine
