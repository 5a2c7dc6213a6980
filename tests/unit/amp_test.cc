// AMP: the autocast guard, and the loss scaler against PyTorch's GradScaler
// (tests/reference/gradscaler_reference.py) on planted gradients.
#include <gtest/gtest.h>

#include <limits>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/amp.h"
#include "gradscaler_cases.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using nlohmann::json;
using gradscaler_cases::from_json;
using gradscaler_cases::planted_grads;

// ---------------------------------------------------------------------------------------
// Parsing

TEST(AmpParse, RoundTripsAndRejectsUnknownModes) {
  for (AmpMode m : {AmpMode::kOff, AmpMode::kBf16, AmpMode::kFp16}) {
    EXPECT_EQ(parse_amp(to_string(m)), m);
  }
  EXPECT_STREQ(to_string(AmpMode::kBf16), "bf16");
  try {
    parse_amp("float16");
    FAIL() << "parse_amp accepted 'float16'";
  } catch (const dtrain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'float16'"), std::string::npos) << what;
    EXPECT_NE(what.find("off, bf16, fp16"), std::string::npos) << what;
  }
}

// ---------------------------------------------------------------------------------------
// AutocastGuard

at::Tensor mm_of_ones() { return at::mm(at::ones({4, 3}), at::ones({3, 2})); }

TEST(AmpAutocast, CpuBf16MatmulIsBf16OnlyInside) {
  ASSERT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(mm_of_ones().scalar_type(), at::kFloat);
  {
    AutocastGuard guard(c10::kCPU, AmpMode::kBf16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    at::Tensor y = mm_of_ones();
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(y.to(at::kFloat), at::full({4, 2}, 3.0f)));
    // Ops autocast keeps in float32 stay float32.
    EXPECT_EQ(at::ones({3}).sum().scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(mm_of_ones().scalar_type(), at::kFloat);
}

TEST(AmpAutocast, CpuFp16MatmulIsHalf) {
  AutocastGuard guard(c10::kCPU, AmpMode::kFp16);
  EXPECT_EQ(mm_of_ones().scalar_type(), at::kHalf);
}

TEST(AmpAutocast, NestedGuardsRestoreTheOuterState) {
  const at::ScalarType original_dtype = at::autocast::get_autocast_dtype(c10::kCPU);
  {
    AutocastGuard outer(c10::kCPU, AmpMode::kBf16);
    {
      AutocastGuard inner(c10::kCPU, AmpMode::kFp16);
      EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kHalf);
      EXPECT_EQ(mm_of_ones().scalar_type(), at::kHalf);
      {
        AutocastGuard off(c10::kCPU, AmpMode::kOff);  // a no-op: autocast stays on
        EXPECT_EQ(mm_of_ones().scalar_type(), at::kHalf);
      }
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);
    EXPECT_EQ(mm_of_ones().scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), original_dtype);
}

TEST(AmpAutocast, OffDoesNothing) {
  AutocastGuard guard(c10::kCPU, AmpMode::kOff);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(mm_of_ones().scalar_type(), at::kFloat);
}

// Autocast caches the low-precision copy of a leaf weight; leaving the outermost guard must
// drop it, or the next step would compute with the weight as it was before the optimizer.
TEST(AmpAutocast, LeavingTheOutermostGuardDropsTheCastCache) {
  at::Tensor w = at::ones({3, 2}).requires_grad_(true);
  at::Tensor x = at::ones({4, 3});
  {
    AutocastGuard guard(c10::kCPU, AmpMode::kBf16);
    EXPECT_TRUE(at::equal(at::mm(x, w).to(at::kFloat), at::full({4, 2}, 3.0f)));
  }
  {
    at::NoGradGuard no_grad;
    w.mul_(2.0);  // the optimizer's in-place update
  }
  AutocastGuard guard(c10::kCPU, AmpMode::kBf16);
  EXPECT_TRUE(at::equal(at::mm(x, w).to(at::kFloat), at::full({4, 2}, 6.0f)));
}

TEST(AmpAutocast, RejectsADeviceWithoutAutocast) {
  EXPECT_THROW(AutocastGuard(c10::kMeta, AmpMode::kBf16), dtrain::Error);
  EXPECT_NO_THROW(AutocastGuard(c10::kMeta, AmpMode::kOff));
}

// ---------------------------------------------------------------------------------------
// LossScaler against GradScaler

struct ScalerRun {
  int steps;
  double init, growth, backoff;
  int interval;
  std::set<int> inf_steps, nan_steps;
};

std::string steps_arg(const std::set<int>& steps) {
  if (steps.empty()) return "-";
  std::string s;
  for (int k : steps) s += (s.empty() ? "" : ",") + std::to_string(k);
  return s;
}

// Doubling scales (with an inf and a NaN in one step) and a scale that is not a power of two.
const std::vector<ScalerRun>& runs() {
  static const std::vector<ScalerRun> kRuns = {
      {30, 65536.0, 2.0, 0.5, 3, {4, 5, 11, 20, 21}, {8, 21, 25}},
      {16, 3.0, 1.5, 0.25, 2, {3, 9}, {10}},
  };
  return kRuns;
}

// GradScaler's results for runs(), computed once per process.
const json& reference() {
  static const json kReference = [] {
    std::vector<std::string> args;
    for (const ScalerRun& r : runs()) {
      for (const std::string& a :
           {std::to_string(r.steps), std::to_string(r.init), std::to_string(r.growth),
            std::to_string(r.backoff), std::to_string(r.interval), steps_arg(r.inf_steps),
            steps_arg(r.nan_steps)}) {
        args.push_back(a);
      }
    }
    std::string out = testing_util::run_python("tests/reference/gradscaler_reference.py", args);
    return out.empty() ? json() : json::parse(out);
  }();
  return kReference;
}

// Runs `run` through a LossScaler and compares every step with GradScaler's record.
void expect_matches_reference(const ScalerRun& run, const json& ref) {
  ASSERT_EQ(ref["steps"].size(), static_cast<size_t>(run.steps));
  LossScalerOptions options;
  options.init_scale = run.init;
  options.growth_factor = run.growth;
  options.backoff_factor = run.backoff;
  options.growth_interval = run.interval;
  LossScaler scaler(options, c10::Device(c10::kCPU));
  int64_t skipped = 0;
  for (int k = 0; k < run.steps; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    const json& r = ref["steps"][k];
    const double scale = scaler.scale(at::ones({}, at::kFloat)).item<double>();
    EXPECT_EQ(scale, r["scale"].get<double>());
    EXPECT_EQ(scaler.scale_value(), scale);
    std::vector<at::Tensor> grads =
        planted_grads(k, scale, run.inf_steps.count(k) > 0, run.nan_steps.count(k) > 0);
    std::vector<at::Tensor> scaled;
    for (const at::Tensor& g : grads) scaled.push_back(g.defined() ? g.clone() : g);
    const bool ok = scaler.unscale(grads, nullptr);
    EXPECT_EQ(!ok, r["skipped"].get<bool>());
    skipped += ok ? 0 : 1;
    if (ok && !r["skipped"].get<bool>()) {
      const json& u = r["unscaled"];
      EXPECT_TRUE(at::equal(grads[0], from_json(u["p0"], at::kFloat))) << grads[0];
      EXPECT_TRUE(at::equal(grads[1].flatten(), from_json(u["p1"], at::kDouble))) << grads[1];
      EXPECT_TRUE(at::equal(grads[3], from_json(u["p3"], at::kBFloat16))) << grads[3];
      EXPECT_FALSE(grads[2].defined());
      // Closed form: unscaled = scaled / scale, to the precision of the gradient's dtype.
      const double tol[] = {1e-6, 1e-6, 0.0, 1e-2};
      for (int i : {0, 1, 3}) {
        EXPECT_LT(testing_util::rel_error(grads[i], scaled[i].to(at::kDouble) / scale), tol[i])
            << "gradient " << i;
      }
    }
    scaler.update();
    EXPECT_EQ(scaler.scale_value(), r["scale_after"].get<double>());
  }
  std::set<int> bad = run.inf_steps;
  bad.insert(run.nan_steps.begin(), run.nan_steps.end());
  EXPECT_EQ(skipped, static_cast<int64_t>(bad.size()));
  EXPECT_EQ(scaler.skipped_steps(), skipped);
}

TEST(AmpLossScaler, DefaultsAreGradScalers) {
  const json& ref = reference();
  ASSERT_FALSE(ref.is_null());
  LossScalerOptions d;
  EXPECT_EQ(d.init_scale, ref["defaults"]["init_scale"].get<double>());
  EXPECT_EQ(d.growth_factor, ref["defaults"]["growth_factor"].get<double>());
  EXPECT_EQ(d.backoff_factor, ref["defaults"]["backoff_factor"].get<double>());
  EXPECT_EQ(d.growth_interval, ref["defaults"]["growth_interval"].get<int64_t>());
}

TEST(AmpLossScaler, ScaleSequenceAndUnscaledGradsMatchGradScaler) {
  const json& ref = reference();
  ASSERT_FALSE(ref.is_null());
  ASSERT_EQ(ref["runs"].size(), runs().size());
  for (size_t i = 0; i < runs().size(); ++i) {
    SCOPED_TRACE("run " + std::to_string(i));
    expect_matches_reference(runs()[i], ref["runs"][i]);
  }
}

TEST(AmpLossScaler, ScaledLossBackpropagatesScaledGradients) {
  LossScaler scaler(LossScalerOptions{}, c10::Device(c10::kCPU));
  at::Tensor w = at::zeros({3}).requires_grad_(true);
  at::Tensor x = at::tensor({1.5, -2.0, 0.25}, at::kFloat);
  at::Tensor scaled = scaler.scale((w * x).sum());
  EXPECT_EQ(scaled.item<double>(), 0.0);
  scaled.backward();
  EXPECT_TRUE(at::equal(w.grad(), x * 65536.0));
  EXPECT_TRUE(scaler.unscale({w.grad()}, nullptr));
  EXPECT_TRUE(at::equal(w.grad(), x));
  scaler.update();
}

TEST(AmpLossScaler, DisabledScalerIsTheIdentityAndNeverSkips) {
  LossScalerOptions options;
  options.enabled = false;
  LossScaler scaler(options, c10::Device(c10::kCPU));
  EXPECT_FALSE(scaler.enabled());
  at::Tensor loss = at::tensor({2.5}, at::kFloat);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  at::Tensor g = at::tensor({1.0f, std::numeric_limits<float>::infinity()});
  at::Tensor before = g.clone();
  for (int step = 0; step < 3; ++step) {
    EXPECT_TRUE(scaler.unscale({g}, nullptr));
    scaler.update();
  }
  EXPECT_TRUE(at::equal(g, before));
  EXPECT_EQ(scaler.scale_value(), 1.0);
  EXPECT_EQ(scaler.skipped_steps(), 0);
  EXPECT_TRUE(scaler.state().empty());
}

TEST(AmpLossScaler, MisuseIsAClearError) {
  LossScaler scaler(LossScalerOptions{}, c10::Device(c10::kCPU));
  at::Tensor g = at::ones({2});
  EXPECT_THROW(scaler.update(), dtrain::Error);  // no unscale in this step
  EXPECT_TRUE(scaler.unscale({g}, nullptr));
  EXPECT_THROW(scaler.unscale({g}, nullptr), dtrain::Error);  // twice in one step
  scaler.update();
  EXPECT_THROW(scaler.unscale({at::ones({2}, at::kLong)}, nullptr), dtrain::Error);
  EXPECT_TRUE(scaler.unscale({}, nullptr));  // no gradients at all: nothing to skip
  scaler.update();

  LossScalerOptions bad;
  bad.backoff_factor = 1.5;
  EXPECT_THROW(LossScaler(bad, c10::Device(c10::kCPU)), dtrain::Error);
  bad = LossScalerOptions{};
  bad.growth_interval = 0;
  EXPECT_THROW(LossScaler(bad, c10::Device(c10::kCPU)), dtrain::Error);
}

// check_finite() decides as unscale() does, without touching a gradient; inverse_scale() is
// the factor unscale() multiplies by.
TEST(AmpLossScaler, CheckFiniteDecidesAsUnscaleAndLeavesTheGradientsAlone) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<at::Tensor>> cases = {
      {at::tensor({1.5f, -2.0f}), at::tensor({3.0f}, at::kDouble)},
      {at::tensor({1.5f, inf}), at::tensor({3.0f})},
      {at::tensor({1.5f, 2.0f}), at::tensor({nan}).to(at::kBFloat16)},
      {at::tensor({-inf}).to(at::kHalf), at::zeros({0})},
      {at::zeros({0}), at::Tensor()},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE("case " + std::to_string(k));
    LossScalerOptions options;
    options.init_scale = 1024.0;
    LossScaler checker(options, c10::Device(c10::kCPU)), unscaler(options, c10::Device(c10::kCPU));
    std::vector<at::Tensor> grads, copies;
    for (const at::Tensor& g : cases[k]) {
      grads.push_back(g.defined() ? g.clone() : g);
      copies.push_back(g.defined() ? g.clone() : g);
    }
    const bool finite = checker.check_finite(grads, nullptr);
    EXPECT_EQ(finite, unscaler.unscale(copies, nullptr));
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) EXPECT_TRUE(at::equal(grads[i].isnan(), cases[k][i].isnan()) &&
                                          at::equal(at::nan_to_num(grads[i]), at::nan_to_num(cases[k][i])));
    }
    EXPECT_EQ(checker.inverse_scale().item<float>(), static_cast<float>(1.0 / 1024.0));
    EXPECT_THROW(checker.check_finite(grads, nullptr), dtrain::Error);  // twice in one step
    checker.update();
    unscaler.update();
    EXPECT_EQ(checker.scale_value(), unscaler.scale_value());
    EXPECT_EQ(checker.skipped_steps(), finite ? 0 : 1);
  }
  LossScalerOptions off;
  off.enabled = false;
  LossScaler disabled(off, c10::Device(c10::kCPU));
  EXPECT_EQ(disabled.inverse_scale().item<float>(), 1.0f);
}

// A scaler restored from state() continues exactly as the original.
TEST(AmpLossScaler, StateRoundTripContinuesTheSequence) {
  const ScalerRun& run = runs()[0];
  LossScalerOptions options;
  options.growth_interval = run.interval;
  LossScaler original(options, c10::Device(c10::kCPU));
  auto step = [&](LossScaler& s, int k) {
    s.unscale(
        planted_grads(k, s.scale_value(), run.inf_steps.count(k) > 0, run.nan_steps.count(k) > 0),
        nullptr);
    s.update();
  };
  for (int k = 0; k < 10; ++k) step(original, k);  // ends mid-way through a growth interval
  LossScaler restored(options, c10::Device(c10::kCPU));
  restored.load_state(original.state());
  EXPECT_EQ(restored.scale_value(), original.scale_value());
  for (int k = 10; k < run.steps; ++k) {
    step(original, k);
    step(restored, k);
    EXPECT_EQ(restored.scale_value(), original.scale_value()) << "step " << k;
  }

  const double before = restored.scale_value();
  EXPECT_THROW(restored.load_state({}), dtrain::Error);
  EXPECT_THROW(restored.load_state({{"scale", at::ones({1})}}), dtrain::Error);
  EXPECT_THROW(restored.load_state({{"scale", at::ones({1})},
                                    {"growth_tracker", at::zeros({1}, at::kInt)},
                                    {"bogus", at::ones({1})}}),
               dtrain::Error);
  EXPECT_THROW(restored.load_state(
                   {{"scale", at::zeros({1})}, {"growth_tracker", at::zeros({1}, at::kInt)}}),
               dtrain::Error);
  EXPECT_EQ(restored.scale_value(), before);  // a rejected state changes nothing
}

}  // namespace
}  // namespace dtrain::engine
