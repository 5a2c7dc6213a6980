// make_sparse_aware_optimizer(): the sparse rules (SGD, Adagrad, SparseAdam) against a float64
// reference written here from torch.optim's formulas (checked against torch.optim.SGD,
// Adagrad and SparseAdam on sparse gradients when this file was written), laziness, the
// dense part, checkpoint state, the gradient multiplier and the refusals.
#include "dtrain/engine/optim/sparse_optim.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

constexpr int64_t kV = 12;  // rows
constexpr int64_t kD = 3;   // columns

// The rows each step's gradient lists, with duplicates (summed by coalescing) and one empty
// gradient (counted as a step, updates nothing).
const std::vector<std::vector<int64_t>> kRows = {
    {1, 4, 4, 7}, {0, 11, 3}, {4, 1, 1, 9}, {}, {5, 4, 11, 2, 4}, {7, 0}};
const int kSparseSteps = static_cast<int>(kRows.size());

// Gradient values per step, [nnz, kD], float64 holding values exact in `dtype`.
std::vector<at::Tensor> make_values(at::ScalarType dtype = at::kDouble, uint64_t seed = 7) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> out;
  for (const auto& rows : kRows) {
    out.push_back(at::randn({static_cast<int64_t>(rows.size()), kD}, gen, at::kDouble).to(dtype).to(at::kDouble));
  }
  return out;
}

at::Tensor initial_param(at::ScalarType dtype = at::kDouble) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  return at::randn({kV, kD}, gen, at::kDouble).to(dtype).to(at::kDouble);
}

// Adam (SparseAdam for sparse-gradient parameters) at learning rate lr, otherwise the defaults.
OptimizerOptions adam_with_lr(double lr) {
  OptimizerOptions o;
  o.name = "adam";
  o.lr = lr;
  return o;
}

// An uncoalesced sparse COO gradient of a [kV, kD] parameter.
at::Tensor sparse_grad(const std::vector<int64_t>& rows, const at::Tensor& values, at::ScalarType dtype,
                       c10::Device device = at::kCPU) {
  int64_t nnz = static_cast<int64_t>(rows.size());
  at::Tensor indices = at::empty({1, nnz}, at::kLong);
  for (int64_t k = 0; k < nnz; ++k) indices[0][k] = rows[k];
  return at::sparse_coo_tensor(indices, values.to(dtype).reshape({nnz, kD}), {kV, kD}).to(device);
}

// ---- the float64 reference: torch.optim's sparse formulas, element by element --------------

struct Reference {
  std::string rule;
  double lr = 0.1, lr_decay = 0.0, eps = 1e-8, beta1 = 0.9, beta2 = 0.999;
  std::vector<double> p, a, b;  // param; sum or exp_avg; exp_avg_sq
  int64_t step = 0;

  Reference(std::string r, const at::Tensor& p0, double init = 0.0) : rule(std::move(r)) {
    at::Tensor c = p0.to(at::kDouble).contiguous();
    p.assign(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
    a.assign(p.size(), init);
    b.assign(p.size(), 0.0);
  }

  void update(const std::vector<int64_t>& rows, const at::Tensor& values, double multiplier = 1.0) {
    ++step;
    at::Tensor v = values.to(at::kDouble).contiguous();
    std::map<int64_t, std::vector<double>> coalesced;
    for (size_t k = 0; k < rows.size(); ++k) {
      auto& acc = coalesced.try_emplace(rows[k], kD, 0.0).first->second;
      for (int64_t j = 0; j < kD; ++j) acc[j] += v.data_ptr<double>()[k * kD + j];
    }
    double t = static_cast<double>(step);
    for (auto& [r, g] : coalesced) {
      for (int64_t j = 0; j < kD; ++j) {
        size_t e = static_cast<size_t>(r * kD + j);
        double gj = g[j] * multiplier;
        if (rule == "sgd") {
          p[e] -= lr * gj;
        } else if (rule == "adagrad") {
          double clr = lr / (1.0 + (t - 1.0) * lr_decay);
          a[e] += gj * gj;
          p[e] -= clr * gj / (std::sqrt(a[e]) + eps);
        } else {
          a[e] = beta1 * a[e] + (1.0 - beta1) * gj;
          b[e] = beta2 * b[e] + (1.0 - beta2) * gj * gj;
          p[e] -= lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)) * a[e] /
                  (std::sqrt(b[e]) + eps);
        }
      }
    }
  }
};

double max_diff(const at::Tensor& t, const std::vector<double>& ref) {
  at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  double m = 0.0;
  for (int64_t k = 0; k < c.numel(); ++k) m = std::max(m, std::abs(c.data_ptr<double>()[k] - ref[k]));
  return m;
}

at::Tensor state_of(const Optimizer& opt, const std::string& name) {
  for (const auto& [k, t] : opt.state()) {
    if (k == name) return t;
  }
  ADD_FAILURE() << "no state entry " << name;
  return at::Tensor();
}

std::vector<std::string> sparse_state_names(const Optimizer& opt) {
  std::vector<std::string> out;
  for (const auto& [k, t] : opt.state()) out.push_back(k);
  return out;
}

NamedTensors cloned_state(const NamedTensors& state) {
  NamedTensors out;
  for (const auto& [k, t] : state) out.emplace_back(k, t.clone());
  return out;
}

struct RuleCase {
  std::string id;
  OptimizerOptions options;
  double init = 0.0;       // adagrad's initial accumulator
  double ref_eps = 1e-8;   // the eps torch uses
};

std::vector<RuleCase> rule_cases() {
  std::vector<RuleCase> out;
  OptimizerOptions o;
  o.lr = 0.1;
  o.name = "sgd";
  out.push_back({"sgd", o});
  o.name = "adagrad";
  o.lr_decay = 0.05;
  out.push_back({"adagrad_default_eps", o, 0.0, 1e-10});  // the default stands for torch's 1e-10
  o.initial_accumulator_value = 0.1;
  o.eps = 1e-3;
  out.push_back({"adagrad_init_eps", o, 0.1, 1e-3});
  o = OptimizerOptions{};
  o.lr = 0.1;
  o.name = "adam";
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  out.push_back({"adam", o});
  o.name = "adamw";
  o.weight_decay = 0.3;  // applies to dense parameters only: SparseAdam has no weight decay
  o.eps = 1e-2;          // large: shows where eps enters (before the bias correction)
  out.push_back({"adamw_weight_decay", o, 0.0, 1e-2});
  return out;
}

Reference make_reference(const RuleCase& c, const at::Tensor& p0) {
  const OptimizerOptions& o = c.options;
  Reference ref(o.name == "sgd" ? "sgd" : o.name == "adagrad" ? "adagrad" : "adam", p0, c.init);
  ref.lr = o.lr;
  ref.lr_decay = o.lr_decay;
  ref.eps = c.ref_eps;
  ref.beta1 = o.beta1;
  ref.beta2 = o.beta2;
  return ref;
}

// Every rule, float64 and float32, after every step: parameter, state and step count.
TEST(SparseOptimRules, MatchFloat64ReferenceAfterEveryStep) {
  for (const RuleCase& c : rule_cases()) {
    for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      SCOPED_TRACE(c.id + " " + std::string(c10::toString(dtype)));
      double tol = dtype == at::kDouble ? 1e-12 : 2e-5;
      at::Tensor p0 = initial_param(dtype);
      std::vector<at::Tensor> values = make_values(dtype);
      at::Tensor p = p0.clone().to(dtype).requires_grad_(true);
      std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer({p}, {true}, c.options);
      Reference ref = make_reference(c, p0);
      for (int s = 0; s < kSparseSteps; ++s) {
        p.mutable_grad() = sparse_grad(kRows[s], values[s], dtype);
        EXPECT_TRUE(kRows[s].size() < 2 || !p.grad().is_coalesced());
        opt->step();
        ref.update(kRows[s], values[s]);
        EXPECT_LE(max_diff(p, ref.p), tol) << "step " << s;
        EXPECT_EQ(state_of(*opt, "0.step").item<double>(), s + 1.0);
        if (c.options.name == "adagrad") {
          EXPECT_LE(max_diff(state_of(*opt, "0.sum"), ref.a), tol) << "step " << s;
        } else if (c.options.name != "sgd") {
          EXPECT_LE(max_diff(state_of(*opt, "0.exp_avg"), ref.a), tol) << "step " << s;
          EXPECT_LE(max_diff(state_of(*opt, "0.exp_avg_sq"), ref.b), tol) << "step " << s;
        }
      }
      // The test can fail: the reference moved the parameter.
      EXPECT_GT(max_diff(p0, ref.p), 1e-3);
    }
  }
}

// Rows no gradient named keep their values and state bit for bit.
TEST(SparseOptimRules, UntouchedRowsAreUnchanged) {
  for (const RuleCase& c : rule_cases()) {
    SCOPED_TRACE(c.id);
    at::Tensor p = initial_param().requires_grad_(true);
    std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer({p}, {true}, c.options);
    std::vector<at::Tensor> values = make_values();
    for (int s = 0; s < kSparseSteps; ++s) {
      at::Tensor before = p.detach().clone();
      NamedTensors state_before = cloned_state(opt->state());
      p.mutable_grad() = sparse_grad(kRows[s], values[s], at::kDouble);
      opt->step();
      for (int64_t r = 0; r < kV; ++r) {
        bool touched = std::find(kRows[s].begin(), kRows[s].end(), r) != kRows[s].end();
        EXPECT_EQ(at::equal(p[r], before[r]), !touched) << "step " << s << " row " << r;
        for (const auto& [name, t] : state_before) {
          if (name != "0.step") EXPECT_TRUE(touched || at::equal(state_of(*opt, name)[r], t[r])) << name;
        }
      }
    }
  }
}

// The first `steps` steps of kRows' gradients (make_values()): sparse_param, updated by `sparse`,
// gets them as sparse gradients, dense_param, updated by `dense`, the same gradients densified.
void step_sparse_and_densified(at::Tensor& sparse_param, Optimizer& sparse, at::Tensor& dense_param,
                               Optimizer& dense, int steps) {
  std::vector<at::Tensor> values = make_values();
  for (int s = 0; s < steps; ++s) {
    sparse_param.mutable_grad() = sparse_grad(kRows[s], values[s], at::kDouble);
    dense_param.mutable_grad() = sparse_param.grad().to_dense();
    sparse.step();
    dense.step();
  }
}

// SparseAdam is lazy: dense Adam on the densified gradients decays the moments of untouched
// rows and keeps moving those rows, SparseAdam does neither.
TEST(SparseOptimRules, SparseAdamIsLazyUnlikeDenseAdamOnTheDensifiedGradient) {
  const OptimizerOptions o = adam_with_lr(0.1);
  at::Tensor sp = initial_param().requires_grad_(true);
  at::Tensor dp = initial_param().requires_grad_(true);
  std::unique_ptr<Optimizer> sparse = make_sparse_aware_optimizer({sp}, {true}, o);
  std::unique_ptr<Optimizer> dense = make_optimizer({dp}, o);
  step_sparse_and_densified(sp, *sparse, dp, *dense, 3);
  // Row 7 was touched at step 0 only, row 0 at step 1 only.
  for (int64_t r : {0, 7}) {
    EXPECT_GT((state_of(*sparse, "0.exp_avg")[r] - state_of(*dense, "0.exp_avg")[r]).abs().max().item<double>(),
              1e-3)
        << "row " << r;
    EXPECT_GT((sp[r] - dp[r]).abs().max().item<double>(), 1e-4) << "row " << r;
  }
  // Row 6 was never touched: unchanged in both (dense Adam's moments stayed 0 there).
  EXPECT_TRUE(at::equal(sp[6], initial_param()[6]));
  EXPECT_TRUE(at::equal(dp[6], initial_param()[6]));
}

// Adagrad's sparse rule equals the dense rule on the densified gradient (a zero gradient
// leaves a row's sum and value alone there too), with untouched rows exactly unchanged.
TEST(SparseOptimRules, SparseAdagradEqualsDenseAdagradOnTheDensifiedGradient) {
  for (const RuleCase& c : rule_cases()) {
    if (c.options.name != "adagrad") continue;
    SCOPED_TRACE(c.id);
    at::Tensor sp = initial_param().requires_grad_(true);
    at::Tensor dp = initial_param().requires_grad_(true);
    std::unique_ptr<Optimizer> sparse = make_sparse_aware_optimizer({sp}, {true}, c.options);
    std::unique_ptr<Optimizer> dense = make_optimizer({dp}, c.options);
    std::vector<at::Tensor> values = make_values();
    for (int s = 0; s < kSparseSteps; ++s) {
      at::Tensor before = sp.detach().clone();
      sp.mutable_grad() = sparse_grad(kRows[s], values[s], at::kDouble);
      dp.mutable_grad() = sp.grad().to_dense();
      sparse->step();
      dense->step();
      EXPECT_TRUE(at::allclose(sp, dp, 1e-13, 1e-15)) << "step " << s;
      EXPECT_TRUE(at::allclose(state_of(*sparse, "0.sum"), state_of(*dense, "0.sum"), 1e-13, 1e-15));
      EXPECT_TRUE(at::equal(sp[6], before[6]));
      EXPECT_EQ(state_of(*sparse, "0.step").item<double>(), state_of(*dense, "0.step").item<double>());
    }
  }
}

// A sparse-flagged parameter whose gradient arrives dense: the rule applied to every row,
// equal to the sparse gradient listing every row (zero rows included), any strides.
TEST(SparseOptimRules, DenseGradientOfASparseParameterUpdatesEveryRow) {
  for (const RuleCase& c : rule_cases()) {
    SCOPED_TRACE(c.id);
    at::Tensor a = initial_param().requires_grad_(true);
    at::Tensor b = initial_param().requires_grad_(true);
    std::unique_ptr<Optimizer> dense_in = make_sparse_aware_optimizer({a}, {true}, c.options);
    std::unique_ptr<Optimizer> sparse_in = make_sparse_aware_optimizer({b}, {true}, c.options);
    std::vector<int64_t> every(kV);
    for (int64_t r = 0; r < kV; ++r) every[r] = r;
    std::vector<at::Tensor> values = make_values();
    for (int s = 0; s < kSparseSteps; ++s) {
      at::Tensor g = sparse_grad(kRows[s], values[s], at::kDouble).to_dense();
      // A transposed copy: the same values with other strides.
      a.mutable_grad() = g.t().contiguous().t();
      ASSERT_FALSE(a.grad().is_contiguous());
      b.mutable_grad() = sparse_grad(every, g, at::kDouble);
      dense_in->step();
      sparse_in->step();
      EXPECT_TRUE(at::allclose(a, b, 1e-14, 1e-15)) << "step " << s;
    }
    EXPECT_EQ(sparse_state_names(*dense_in), sparse_state_names(*sparse_in));
    for (const auto& [name, t] : dense_in->state()) {
      EXPECT_TRUE(at::allclose(t, state_of(*sparse_in, name), 1e-14, 1e-15)) << name;
    }
  }
}

// With a dense gradient every row is touched: SparseAdam's moments then decay on the rows
// whose gradient is zero, and those rows keep moving (not lazy, by design of the fallback).
TEST(SparseOptimRules, DenseGradientOfASparseAdamParameterDecaysEveryRow) {
  const OptimizerOptions o = adam_with_lr(0.1);
  at::Tensor a = initial_param().requires_grad_(true);
  at::Tensor lazy = initial_param().requires_grad_(true);
  std::unique_ptr<Optimizer> dense_in = make_sparse_aware_optimizer({a}, {true}, o);
  std::unique_ptr<Optimizer> sparse_in = make_sparse_aware_optimizer({lazy}, {true}, o);
  step_sparse_and_densified(lazy, *sparse_in, a, *dense_in, 2);
  // Row 7: touched at step 0 only.
  at::Tensor m_dense = state_of(*dense_in, "0.exp_avg")[7], m_lazy = state_of(*sparse_in, "0.exp_avg")[7];
  EXPECT_TRUE(at::allclose(m_dense, m_lazy * o.beta1, 1e-14, 0));
  EXPECT_GT((m_lazy - m_dense).abs().max().item<double>(), 1e-3);
  EXPECT_GT((a[7] - lazy[7]).abs().max().item<double>(), 1e-3);
  // Row 6: never touched, zero moments, no update either way.
  EXPECT_TRUE(at::equal(a[6], initial_param()[6]));
}

// A real embedding with sparse gradients from autograd (uncoalesced, duplicates).
TEST(SparseOptimRules, EmbeddingBackwardWithSparseGradients) {
  const OptimizerOptions o = adam_with_lr(0.05);
  at::Tensor w = initial_param().requires_grad_(true);
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer({w}, {true}, o);
  Reference ref("adam", initial_param());
  ref.lr = o.lr;
  for (int s = 0; s < kSparseSteps; ++s) {
    if (kRows[s].empty()) continue;
    at::Tensor ids = at::tensor(kRows[s], at::kLong);
    at::Tensor out = at::embedding(w, ids, -1, false, /*sparse=*/true);
    at::Tensor target = at::arange(out.numel(), at::kDouble).reshape(out.sizes()) / 10.0;
    (out - target).pow(2).sum().backward();
    ASSERT_EQ(w.grad().layout(), at::kSparse);
    at::Tensor values = w.grad()._values().clone();
    opt->step();
    ref.update(kRows[s], values);
    EXPECT_LE(max_diff(w, ref.p), 1e-12) << "step " << s;
    opt->zero_grad();
    EXPECT_FALSE(w.grad().defined());
  }
}

// ---- the dense part, state and the contract --------------------------------------------------

struct Mixed {
  std::vector<at::Tensor> params;  // dense [5], sparse [kV, kD], dense [2, 4]
  std::vector<bool> flags = {false, true, false};
};

Mixed make_mixed() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
  Mixed m;
  m.params = {at::randn({5}, gen, at::kDouble).requires_grad_(true), initial_param().requires_grad_(true),
              at::randn({2, 4}, gen, at::kDouble).requires_grad_(true)};
  return m;
}

// The gradients of step s: dense ones for the dense parameters, sparse for the embedding.
void set_mixed_grads(std::vector<at::Tensor>& params, int s, const std::vector<at::Tensor>& values) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + s);
  params[0].mutable_grad() = at::randn({5}, gen, at::kDouble);
  params[1].mutable_grad() = sparse_grad(kRows[s], values[s], at::kDouble);
  params[2].mutable_grad() = at::randn({2, 4}, gen, at::kDouble);
}

TEST(SparseOptimMixed, DenseParametersEqualMakeOptimizerAndSparseTheReference) {
  for (const RuleCase& c : rule_cases()) {
    SCOPED_TRACE(c.id);
    Mixed m = make_mixed();
    Mixed twin = make_mixed();
    std::vector<at::Tensor> dense = {twin.params[0], twin.params[2]};
    std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, c.options);
    std::unique_ptr<Optimizer> plain = make_optimizer(dense, c.options);
    Reference ref = make_reference(c, initial_param());
    std::vector<at::Tensor> values = make_values();
    for (int s = 0; s < kSparseSteps; ++s) {
      set_mixed_grads(m.params, s, values);
      set_mixed_grads(twin.params, s, values);
      opt->step();
      plain->step();
      ref.update(kRows[s], values[s]);
      EXPECT_TRUE(at::equal(m.params[0], dense[0])) << "step " << s;
      EXPECT_TRUE(at::equal(m.params[2], dense[1])) << "step " << s;
      EXPECT_LE(max_diff(m.params[1], ref.p), 1e-12) << "step " << s;
    }
    EXPECT_FALSE(at::equal(m.params[0], make_mixed().params[0]));
    // The dense part's state, renumbered to the whole list.
    for (const auto& [name, t] : plain->state()) {
      std::string global = (name[0] == '0' ? "0" : "2") + name.substr(1);
      EXPECT_TRUE(at::equal(state_of(*opt, global), t)) << global;
    }
  }
}

TEST(SparseOptimMixed, StateNamesOverTheWholeList) {
  Mixed m = make_mixed();
  OptimizerOptions o;
  o.name = "adam";
  EXPECT_EQ(sparse_state_names(*make_sparse_aware_optimizer(m.params, m.flags, o)),
            (std::vector<std::string>{"0.step", "0.exp_avg", "0.exp_avg_sq", "1.step", "1.exp_avg", "1.exp_avg_sq",
                                      "2.step", "2.exp_avg", "2.exp_avg_sq"}));
  o.name = "adagrad";
  o.initial_accumulator_value = 0.25;
  auto opt = make_sparse_aware_optimizer(m.params, m.flags, o);
  EXPECT_EQ(sparse_state_names(*opt), (std::vector<std::string>{"0.step", "0.sum", "1.step", "1.sum", "2.step", "2.sum"}));
  EXPECT_TRUE(at::equal(state_of(*opt, "1.sum"), at::full({kV, kD}, 0.25, at::kDouble)));
  at::Tensor step = state_of(*opt, "1.step");
  EXPECT_EQ(step.dim(), 0);
  EXPECT_EQ(step.scalar_type(), at::kFloat);
  o.name = "sgd";
  EXPECT_EQ(sparse_state_names(*make_sparse_aware_optimizer(m.params, m.flags, o)),
            (std::vector<std::string>{"0.step", "1.step", "2.step"}));
  // The sparse parameter listed first.
  std::vector<at::Tensor> first = {m.params[1], m.params[0]};
  o.name = "adamw";
  EXPECT_EQ(sparse_state_names(*make_sparse_aware_optimizer(first, {true, false}, o)),
            (std::vector<std::string>{"0.step", "0.exp_avg", "0.exp_avg_sq", "1.step", "1.exp_avg", "1.exp_avg_sq"}));
  // The dense part's (3 per parameter, with the step), the sparse moments (not its step counter).
  EXPECT_EQ(make_sparse_aware_optimizer(m.params, m.flags, o)->device_state().size(), 8u);
}

TEST(SparseOptimMixed, SaveLoadAndContinueIsBitForBit) {
  for (const RuleCase& c : rule_cases()) {
    SCOPED_TRACE(c.id);
    std::vector<at::Tensor> values = make_values();
    Mixed straight = make_mixed();
    std::unique_ptr<Optimizer> a = make_sparse_aware_optimizer(straight.params, straight.flags, c.options);
    for (int s = 0; s < kSparseSteps; ++s) {
      set_mixed_grads(straight.params, s, values);
      a->step();
    }
    Mixed first = make_mixed();
    std::unique_ptr<Optimizer> b = make_sparse_aware_optimizer(first.params, first.flags, c.options);
    for (int s = 0; s < 3; ++s) {
      set_mixed_grads(first.params, s, values);
      b->step();
    }
    NamedTensors saved = cloned_state(b->state());
    std::vector<at::Tensor> resumed;
    for (const at::Tensor& p : first.params) resumed.push_back(p.detach().clone().requires_grad_(true));
    std::unique_ptr<Optimizer> r = make_sparse_aware_optimizer(resumed, first.flags, c.options);
    r->load_state(saved);
    EXPECT_EQ(state_of(*r, "1.step").item<double>(), 3.0);
    for (int s = 3; s < kSparseSteps; ++s) {
      set_mixed_grads(resumed, s, values);
      r->step();
    }
    for (size_t i = 0; i < resumed.size(); ++i) EXPECT_TRUE(at::equal(straight.params[i], resumed[i])) << i;
    NamedTensors sa = a->state(), sr = r->state();
    ASSERT_EQ(sa.size(), sr.size());
    for (size_t k = 0; k < sa.size(); ++k) {
      EXPECT_EQ(sa[k].first, sr[k].first);
      EXPECT_TRUE(at::equal(sa[k].second, sr[k].second)) << sa[k].first;
    }
  }
}

TEST(SparseOptimMixed, LoadStateRejectsMismatchesBeforeChangingAnything) {
  Mixed m = make_mixed();
  OptimizerOptions o;
  o.name = "adam";
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, o);
  NamedTensors good = cloned_state(opt->state());
  for (auto& [k, t] : good) {
    if (k != "1.step" && k != "0.step" && k != "2.step") t.fill_(0.5);
  }
  auto without = [&](const std::string& name) {
    NamedTensors out;
    for (auto& [k, t] : good) {
      if (k != name) out.emplace_back(k, t);
    }
    return out;
  };
  auto replaced = [&](const std::string& name, at::Tensor v) {
    NamedTensors out = good;
    for (auto& [k, t] : out) {
      if (k == name) t = v;
    }
    return out;
  };
  NamedTensors before = cloned_state(opt->state());
  EXPECT_NE(error_of([&] { opt->load_state(without("1.exp_avg_sq")); }).find("misses '1.exp_avg_sq'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt->load_state(without("2.exp_avg")); }).find("misses '2.exp_avg'"), std::string::npos);
  EXPECT_NE(error_of([&] { opt->load_state(replaced("1.exp_avg", at::zeros({kV, kD + 1}, at::kDouble))); })
                .find("'1.exp_avg' has sizes"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt->load_state(replaced("2.exp_avg", at::zeros({8}, at::kDouble))); })
                .find("'2.exp_avg' has sizes"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt->load_state(replaced("1.step", at::full({}, 1.5))); }).find("whole number"),
            std::string::npos);
  NamedTensors extra = good;
  extra.emplace_back("1.max_exp_avg_sq", at::zeros({kV, kD}, at::kDouble));
  EXPECT_NE(error_of([&] { opt->load_state(extra); }).find("'1.max_exp_avg_sq', which is not part"),
            std::string::npos);
  extra = good;
  extra.emplace_back("3.step", at::zeros({}));
  EXPECT_NE(error_of([&] { opt->load_state(extra); }).find("'3.step'"), std::string::npos);
  extra = good;
  extra.emplace_back("junk", at::zeros({}));
  EXPECT_NE(error_of([&] { opt->load_state(extra); }).find("'junk'"), std::string::npos);
  extra = good;
  extra.push_back(good.front());
  EXPECT_NE(error_of([&] { opt->load_state(extra); }).find("twice"), std::string::npos);
  NamedTensors after = opt->state();
  ASSERT_EQ(before.size(), after.size());
  for (size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(at::equal(before[k].second, after[k].second)) << k;
  opt->load_state(good);
  EXPECT_TRUE(at::equal(state_of(*opt, "1.exp_avg"), at::full({kV, kD}, 0.5, at::kDouble)));
  EXPECT_TRUE(at::equal(state_of(*opt, "2.exp_avg"), at::full({2, 4}, 0.5, at::kDouble)));
}

// step(grad_multiplier) equals step() on gradients multiplied first, and leaves the sparse
// gradient as it was.
TEST(SparseOptimContract, GradMultiplierScalesEveryGradient) {
  for (const RuleCase& c : rule_cases()) {
    for (double mult : {0.25, 0.3712}) {
      SCOPED_TRACE(c.id + " " + std::to_string(mult));
      std::vector<at::Tensor> values = make_values();
      Mixed a = make_mixed(), b = make_mixed();
      std::unique_ptr<Optimizer> with = make_sparse_aware_optimizer(a.params, a.flags, c.options);
      std::unique_ptr<Optimizer> by_hand = make_sparse_aware_optimizer(b.params, b.flags, c.options);
      Reference ref = make_reference(c, initial_param());
      for (int s = 0; s < kSparseSteps; ++s) {
        set_mixed_grads(a.params, s, values);
        set_mixed_grads(b.params, s, values);
        for (at::Tensor& p : b.params) p.mutable_grad() = p.grad() * mult;
        at::Tensor sparse_before = a.params[1].grad().clone();
        with->step(at::scalar_tensor(mult, at::kFloat));
        by_hand->step();
        ref.update(kRows[s], values[s], static_cast<double>(static_cast<float>(mult)));
        EXPECT_TRUE(at::equal(a.params[1].grad()._values(), sparse_before._values()));
      }
      for (size_t i = 0; i < a.params.size(); ++i) {
        if (mult == 0.25) {
          EXPECT_TRUE(at::equal(a.params[i], b.params[i])) << "parameter " << i;
        } else {
          EXPECT_TRUE(at::allclose(a.params[i], b.params[i], 1e-6, 1e-9)) << "parameter " << i;
        }
      }
      EXPECT_LE(max_diff(a.params[1], ref.p), 1e-12);
    }
  }
  Mixed m = make_mixed();
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, OptimizerOptions{});
  set_mixed_grads(m.params, 0, make_values());
  EXPECT_NE(error_of([&] { opt->step(at::ones({2})); }).find("one-element"), std::string::npos);
  EXPECT_TRUE(at::equal(m.params[1], initial_param()));
}

TEST(SparseOptimContract, SkipStepAndMissingGradientsUpdateNothing) {
  for (const RuleCase& c : rule_cases()) {
    SCOPED_TRACE(c.id);
    Mixed m = make_mixed();
    std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, c.options);
    std::vector<at::Tensor> values = make_values();
    set_mixed_grads(m.params, 0, values);
    opt->step();
    NamedTensors state = cloned_state(opt->state());
    std::vector<at::Tensor> before;
    for (const at::Tensor& p : m.params) before.push_back(p.detach().clone());
    set_mixed_grads(m.params, 1, values);
    opt->skip_step();
    m.params[1].mutable_grad().reset();  // and a step without the sparse gradient
    opt->zero_grad();
    for (size_t i = 0; i < m.params.size(); ++i) EXPECT_TRUE(at::equal(m.params[i], before[i]));
    opt->step();
    EXPECT_TRUE(at::equal(m.params[1], before[1]));
    EXPECT_EQ(state_of(*opt, "1.step").item<double>(), 1.0);
    for (const auto& [k, t] : state) {
      if (k.rfind("1.", 0) == 0) EXPECT_TRUE(at::equal(state_of(*opt, k), t)) << k;
    }
  }
}

TEST(SparseOptimContract, ZeroGradZerosDenseInPlaceAndDropsSparse) {
  Mixed m = make_mixed();
  m.params.push_back(initial_param().requires_grad_(true));
  m.flags.push_back(true);
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, OptimizerOptions{});
  set_mixed_grads(m.params, 0, make_values());
  m.params[3].mutable_grad() = at::ones({kV, kD}, at::kDouble);  // a sparse parameter's dense gradient
  const c10::TensorImpl* dense_impl = m.params[0].grad().unsafeGetTensorImpl();
  const c10::TensorImpl* densified_impl = m.params[3].grad().unsafeGetTensorImpl();
  opt->zero_grad();
  EXPECT_EQ(m.params[0].grad().unsafeGetTensorImpl(), dense_impl);
  EXPECT_EQ(m.params[0].grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(m.params[3].grad().unsafeGetTensorImpl(), densified_impl);
  EXPECT_EQ(m.params[3].grad().abs().sum().item<double>(), 0.0);
  EXPECT_FALSE(m.params[1].grad().defined());
  EXPECT_EQ(opt->params().size(), 4u);
  EXPECT_TRUE(opt->params()[1].is_same(m.params[1]));
}

TEST(SparseOptimContract, SetLrAndReplicatedDefaults) {
  Mixed m = make_mixed();
  OptimizerOptions o;
  o.name = "sgd";
  o.lr = 0.5;
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, o);
  opt->set_lr(0.25);
  EXPECT_EQ(opt->lr(), 0.25);
  EXPECT_EQ(opt->options().lr, 0.25);
  at::Tensor before0 = m.params[0].detach().clone(), before1 = m.params[1].detach().clone();
  m.params[0].mutable_grad() = at::ones({5}, at::kDouble);
  m.params[1].mutable_grad() = sparse_grad({2}, at::ones({1, kD}, at::kDouble), at::kDouble);
  opt->step();
  EXPECT_TRUE(at::allclose(m.params[0], before0 - 0.25, 0, 1e-15));
  EXPECT_TRUE(at::allclose(m.params[1][2], before1[2] - 0.25, 0, 1e-15));
  EXPECT_THROW(opt->set_lr(-1.0), dtrain::Error);
  EXPECT_TRUE(opt->gradient_owners().empty());
  EXPECT_FALSE(opt->shard_layout().has_value());
  EXPECT_EQ(opt->host_bytes(), 0);
  opt->flush();
}

// ---- refusals -----------------------------------------------------------------------------

TEST(SparseOptimValidate, RefusesWhatTheSparseRulesCannotDo) {
  Mixed m = make_mixed();
  auto message = [&](OptimizerOptions o) {
    return error_of([&] { make_sparse_aware_optimizer(m.params, m.flags, o); });
  };
  OptimizerOptions o;
  o.name = "sgd";
  o.momentum = 0.9;
  std::string e = message(o);
  EXPECT_NE(e.find("momentum"), std::string::npos) << e;
  EXPECT_NE(e.find("parameters 1 "), std::string::npos) << e;
  o.momentum = 0.0;
  o.weight_decay = 0.1;
  e = message(o);
  EXPECT_NE(e.find("--weight_decay 0"), std::string::npos) << e;
  o = OptimizerOptions{};
  o.name = "adagrad";
  o.weight_decay = 0.01;
  e = message(o);
  EXPECT_NE(e.find("--weight_decay"), std::string::npos) << e;
  EXPECT_NE(e.find("adagrad"), std::string::npos) << e;
  for (const char* name : {"adam", "adamw"}) {
    o = OptimizerOptions{};
    o.name = name;
    o.amsgrad = true;
    e = message(o);
    EXPECT_NE(e.find("amsgrad"), std::string::npos) << e;
    o.amsgrad = false;
    o.eps = 0.0;
    EXPECT_NE(message(o).find("eps > 0"), std::string::npos);
    o.eps = 1e-8;
    o.weight_decay = 0.1;  // allowed: the dense parameters only
    EXPECT_NO_THROW(make_sparse_aware_optimizer(m.params, m.flags, o));
  }
  // The same options are fine when no parameter is flagged (make_optimizer's own).
  o = OptimizerOptions{};
  o.name = "sgd";
  o.momentum = 0.9;
  EXPECT_NO_THROW(make_sparse_aware_optimizer(m.params, {false, false, false}, o));
  o.name = "nope";
  EXPECT_NE(message(o).find("nope"), std::string::npos);
}

TEST(SparseOptimValidate, RefusesBadParameterLists) {
  Mixed m = make_mixed();
  OptimizerOptions o;
  EXPECT_NE(error_of([&] { make_sparse_aware_optimizer(m.params, {true}, o); }).find("one flag per parameter"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_sparse_aware_optimizer({}, {}, o); }).find("empty"), std::string::npos);
  std::vector<at::Tensor> twice = {m.params[0], m.params[1], m.params[1]};
  EXPECT_NE(error_of([&] { make_sparse_aware_optimizer(twice, {false, true, false}, o); }).find("parameter 2 appears twice"),
            std::string::npos);
  std::vector<at::Tensor> scalar = {at::zeros({}, at::kDouble).requires_grad_(true)};
  EXPECT_NE(error_of([&] { make_sparse_aware_optimizer(scalar, {true}, o); }).find("0-dim"), std::string::npos);
  std::vector<at::Tensor> ints = {m.params[1], at::zeros({3}, at::kLong)};
  EXPECT_NE(error_of([&] { make_sparse_aware_optimizer(ints, {true, false}, o); }).find("parameter 1 must be"),
            std::string::npos);
}

TEST(SparseOptimValidate, BadGradientsThrowBeforeAnythingIsUpdated) {
  Mixed m = make_mixed();
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, m.flags, OptimizerOptions{});
  std::vector<at::Tensor> values = make_values();
  std::vector<at::Tensor> before;
  for (const at::Tensor& p : m.params) before.push_back(p.detach().clone());
  auto unchanged = [&] {
    for (size_t i = 0; i < before.size(); ++i) {
      if (!at::equal(m.params[i], before[i])) return false;
    }
    return state_of(*opt, "1.step").item<double>() == 0.0 && state_of(*opt, "0.step").item<double>() == 0.0;
  };
  // A sparse gradient for a parameter not flagged sparse.
  set_mixed_grads(m.params, 0, values);
  m.params[2].mutable_grad() = m.params[2].grad().to_sparse();
  std::string e = error_of([&] { opt->step(); });
  EXPECT_NE(e.find("parameter 2 received a gradient of layout Sparse but is not flagged sparse"), std::string::npos)
      << e;
  EXPECT_TRUE(unchanged());
  // Wrong dtype, wrong sizes, sparse_dim 2, another layout.
  set_mixed_grads(m.params, 0, values);
  m.params[1].mutable_grad() = sparse_grad(kRows[0], values[0], at::kFloat);
  EXPECT_NE(error_of([&] { opt->step(); }).find("must have its parameter's device, dtype and sizes"),
            std::string::npos);
  m.params[1].mutable_grad() = at::ones({kV, kD + 1}, at::kDouble).to_sparse(1);
  EXPECT_NE(error_of([&] { opt->step(); }).find("sizes"), std::string::npos);
  m.params[1].mutable_grad() = at::ones({kV, kD}, at::kDouble).to_sparse(2);
  EXPECT_NE(error_of([&] { opt->step(); }).find("sparse_dim 2"), std::string::npos);
  m.params[1].mutable_grad() = at::ones({kV, kD}, at::kDouble).to_sparse_csr();
  EXPECT_NE(error_of([&] { opt->step(); }).find("layout"), std::string::npos);
  // A bad dense gradient: the dense part refuses, the sparse parameter is not updated either.
  set_mixed_grads(m.params, 0, values);
  m.params[0].mutable_grad() = at::ones({5}, at::kFloat);
  EXPECT_THROW(opt->step(), dtrain::Error);
  EXPECT_TRUE(unchanged());
  set_mixed_grads(m.params, 0, values);
  opt->step();  // fixed: goes through
  EXPECT_FALSE(unchanged());
}

TEST(SparseOptimFactory, NoFlaggedParameterIsMakeOptimizer) {
  Mixed m = make_mixed();
  OptimizerOptions o;
  o.name = "adam";
  o.amsgrad = true;
  std::unique_ptr<Optimizer> opt = make_sparse_aware_optimizer(m.params, {false, false, false}, o);
  EXPECT_EQ(sparse_state_names(*opt), sparse_state_names(*make_optimizer(m.params, o)));
  // make_optimizer's refusal of sparse gradients.
  m.params[1].mutable_grad() = sparse_grad(kRows[0], make_values()[0], at::kDouble);
  EXPECT_NE(error_of([&] { opt->step(); }).find("sparse gradients are not supported"), std::string::npos);
}

// The same steps on a CUDA device match the CPU's.
TEST(SparseOptimCuda, MatchesTheCpu) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  for (const RuleCase& c : rule_cases()) {
    for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      SCOPED_TRACE(c.id + " " + std::string(c10::toString(dtype)));
      std::vector<at::Tensor> values = make_values(dtype);
      at::Tensor cpu = initial_param(dtype).to(dtype).requires_grad_(true);
      at::Tensor gpu = initial_param(dtype).to(at::kCUDA, dtype).requires_grad_(true);
      at::Tensor dense_gpu = at::ones({4}, at::TensorOptions(at::kCUDA).dtype(dtype)).requires_grad_(true);
      std::unique_ptr<Optimizer> a = make_sparse_aware_optimizer({cpu}, {true}, c.options);
      std::unique_ptr<Optimizer> b = make_sparse_aware_optimizer({gpu, dense_gpu}, {true, false}, c.options);
      Reference ref = make_reference(c, initial_param(dtype));
      for (int s = 0; s < kSparseSteps; ++s) {
        cpu.mutable_grad() = sparse_grad(kRows[s], values[s], dtype);
        gpu.mutable_grad() = sparse_grad(kRows[s], values[s], dtype, at::kCUDA);
        dense_gpu.mutable_grad() = at::full_like(dense_gpu, 0.5);
        a->step(at::scalar_tensor(0.5, at::kFloat));
        b->step(at::scalar_tensor(0.5, at::TensorOptions(at::kCUDA).dtype(at::kFloat)));
        ref.update(kRows[s], values[s], 0.5);
      }
      double tol = dtype == at::kDouble ? 1e-12 : 2e-5;
      EXPECT_TRUE(gpu.device().is_cuda());
      EXPECT_LE(max_diff(gpu, ref.p), tol);
      EXPECT_LE(max_diff(gpu.cpu(), ref.p), tol);
      EXPECT_TRUE(at::allclose(gpu.cpu(), cpu, dtype == at::kDouble ? 1e-13 : 1e-6, 1e-7));
      NamedTensors sa = a->state();
      for (const auto& [name, t] : sa) {
        EXPECT_TRUE(at::allclose(state_of(*b, name).cpu(), t.cpu(), 1e-6, 1e-7)) << name;
      }
    }
  }
}

}  // namespace
}  // namespace dtrain::engine
