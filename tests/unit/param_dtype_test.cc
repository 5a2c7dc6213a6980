// --param_dtype=bfloat16 (TrainerOptions::param_dtype): bfloat16 weights and gradients with
// float32 master weights, in the partitioned optimizer on the device (--shard=optimizer, the
// whole master at one rank) and in the offloaded one (ZeRO-Offload: master and state on the
// host, the gradients copied there in bfloat16). The reference is the rule written out in
// float64 with PyTorch's ops: the same bfloat16 model's gradients, AdamW on a float64 master,
// the weights rounded to bfloat16 after each step. The learning rate is below half a
// bfloat16 step of the weights, so an update of the bfloat16 weights themselves (no master)
// would leave most of them unchanged and fail the comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

constexpr int64_t kBf16Rows = 192, kBf16Batch = 8, kBf16Steps = 20;
constexpr double kBf16Lr = 3e-4, kBf16WeightDecay = 0.1, kBf16Beta1 = 0.9, kBf16Beta2 = 0.999, kBf16Eps = 1e-8;

torch::nn::Sequential bf16_test_model() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(6, 32), torch::nn::Tanh(), torch::nn::Linear(32, 1));
}

std::vector<at::Tensor> bf16_test_data() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(17);
  return {at::randn({kBf16Rows, 6}, g).to(at::kBFloat16), at::randn({kBf16Rows, 1}, g).to(at::kBFloat16)};
}

struct Bf16Run {
  std::vector<at::Tensor> weights;  // bfloat16, after the last step
  std::vector<double> losses;       // logged per step
};

Bf16Run fit_bf16(TrainerOptions o, double lr = kBf16Lr) {
  std::unique_ptr<dist::Communicator> comm =
      dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  dist::Mesh mesh(*comm, 1, 1);
  LoaderOptions lo;
  lo.batch_size = kBf16Batch;
  lo.shuffle = false;
  lo.workers = 0;
  DataLoader loader(std::make_shared<TensorDataset>(bf16_test_data()), lo);
  auto model = bf16_test_model();
  o.steps = kBf16Steps;
  o.param_dtype = at::kBFloat16;
  o.optimizer.name = "adamw";
  o.optimizer.lr = lr;
  o.optimizer.weight_decay = kBf16WeightDecay;
  o.progress = false;
  o.handle_preemption = false;
  o.log_every = 1;
  Bf16Run run;
  o.on_log = [&](const StepMetrics& m) { run.losses.push_back(m.loss); };
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  trainer.fit(loader);
  for (const at::Tensor& p : model->parameters()) run.weights.push_back(p.detach().clone());
  return run;
}

// The rule in float64: the bfloat16 model's gradients (the same batches in the same order),
// AdamW on a float64 master, the weights its bfloat16 rounding. with_master = false: the
// same update added to the bfloat16 weights themselves (what a replicated optimizer does),
// the control that shows the comparison tells the two apart.
// delay_after >= 0: ZeRO-Offload's one-step-delayed update after that many ordinary steps (each
// later update becomes visible to the model one step late; the last when fit() returns).
Bf16Run reference_bf16(bool with_master = true, int64_t delay_after = -1, double lr = kBf16Lr) {
  auto model = bf16_test_model();
  model->to(at::kBFloat16);
  const std::vector<at::Tensor> data = bf16_test_data();
  std::vector<at::Tensor> params = model->parameters(), master, m, v;
  for (const at::Tensor& p : params) {
    master.push_back(p.detach().to(at::kDouble));
    m.push_back(at::zeros_like(master.back()));
    v.push_back(at::zeros_like(master.back()));
  }
  Bf16Run run;
  for (int64_t t = 1; t <= kBf16Steps; ++t) {
    const int64_t first = ((t - 1) * kBf16Batch) % kBf16Rows;
    for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    at::Tensor loss = torch::mse_loss(model->forward(data[0].narrow(0, first, kBf16Batch)), data[1].narrow(0, first, kBf16Batch));
    loss.backward();
    run.losses.push_back(loss.item<double>());
    const double bc1 = 1 - std::pow(kBf16Beta1, t), bc2 = 1 - std::pow(kBf16Beta2, t);
    const bool delayed = delay_after >= 0 && t > delay_after;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (delayed) params[i].copy_(master[i]);  // the previous step's update becomes visible now
      const at::Tensor g = params[i].grad().to(at::kDouble);
      m[i].mul_(kBf16Beta1).add_(g, 1 - kBf16Beta1);
      v[i].mul_(kBf16Beta2).addcmul_(g, g, 1 - kBf16Beta2);
      const at::Tensor update = lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + kBf16Eps);
      if (!with_master) {
        params[i].mul_(1 - lr * kBf16WeightDecay).sub_(update.to(at::kBFloat16));
        continue;
      }
      master[i].mul_(1 - lr * kBf16WeightDecay).sub_(update);
      if (!delayed) params[i].copy_(master[i]);  // rounded to bfloat16
    }
  }
  if (delay_after >= 0) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(master[i]);
  }
  for (const at::Tensor& p : params) run.weights.push_back(p.detach().clone());
  return run;
}

// The bfloat16 weights of a run against the reference's: a float32 master and a float64 one
// round to the same bfloat16 value except within a float32 rounding of a bfloat16 tie, so all
// but a handful are identical and none is more than one bfloat16 step away.
void expect_same_bf16(const Bf16Run& got, const Bf16Run& want, const std::string& what) {
  ASSERT_EQ(got.weights.size(), want.weights.size()) << what;
  int64_t differ = 0, total = 0;
  for (size_t i = 0; i < got.weights.size(); ++i) {
    ASSERT_EQ(got.weights[i].scalar_type(), at::kBFloat16) << what << ": parameter " << i << " is not bfloat16";
    const at::Tensor a = got.weights[i].to(at::kDouble), b = want.weights[i].to(at::kDouble);
    const at::Tensor ulp = b.abs().clamp_min(1e-30) * std::ldexp(1.0, -7);  // one bfloat16 step, about
    EXPECT_TRUE((a - b).abs().le(ulp * 1.01).all().item<bool>()) << what << ": parameter " << i;
    differ += a.ne(b).sum().item<int64_t>();
    total += a.numel();
  }
  EXPECT_LE(differ, 2) << what << ": " << differ << " of " << total << " bfloat16 weights differ from the reference";
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t t = 0; t < got.losses.size(); ++t) {
    EXPECT_NEAR(got.losses[t], want.losses[t], 1e-2 * std::abs(want.losses[t])) << what << ", step " << t + 1;
  }
}

TEST(ParamDtype, Bf16WeightsWithFloat32MasterOnTheDeviceFollowTheRule) {
  const Bf16Run want = reference_bf16();
  // Without a master the weights would hardly move: the reference's do.
  const std::vector<at::Tensor> initial = [] {
    auto m = bf16_test_model();
    m->to(at::kBFloat16);
    std::vector<at::Tensor> w;
    for (const at::Tensor& p : m->parameters()) w.push_back(p.detach().clone());
    return w;
  }();
  int64_t moved = 0;
  for (size_t i = 0; i < initial.size(); ++i) moved += initial[i].ne(want.weights[i]).sum().item<int64_t>();
  ASSERT_GT(moved, 150) << "the reference's bfloat16 weights should change under the master's updates";
  const Bf16Run no_master = reference_bf16(false);
  int64_t differ = 0;
  for (size_t i = 0; i < initial.size(); ++i) differ += no_master.weights[i].ne(want.weights[i]).sum().item<int64_t>();
  ASSERT_GT(differ, 50) << "updating the bfloat16 weights themselves should end far from the master's rule";
  TrainerOptions o;
  o.shard = "optimizer";
  expect_same_bf16(fit_bf16(o), want, "--shard=optimizer");
}

TEST(ParamDtype, Bf16WeightsWithTheMasterOffloadedFollowTheRule) {
  const Bf16Run want = reference_bf16();
  for (const std::string stream : {"off", "on"}) {
    TrainerOptions o;
    o.offload_optimizer = true;
    o.offload.stream_gradients = stream;  // "on": the bfloat16 gradients copied to host buffers per bucket
    expect_same_bf16(fit_bf16(o), want, "--offload=optimizer, stream_gradients=" + stream);
  }
}

// The delayed update's extra buffer (the next weights of the shard) is in the weights' dtype:
// bfloat16, no float32 copy on the device.
TEST(ParamDtype, Bf16DelayedUpdateEqualsItsDefinition) {
  const int64_t warmup = 4;
  const double lr = 1e-2;  // large enough for the stale gradients to show in the weights
  const Bf16Run want = reference_bf16(true, warmup, lr);
  // The delay changes the curve: the comparison tells a delayed run from an ordinary one.
  const Bf16Run ordinary = reference_bf16(true, -1, lr);
  int64_t differ = 0;
  for (size_t i = 0; i < want.weights.size(); ++i) differ += ordinary.weights[i].ne(want.weights[i]).sum().item<int64_t>();
  ASSERT_GT(differ, 20);
  for (const std::string stream : {"off", "on"}) {
    TrainerOptions o;
    o.offload_optimizer = true;
    o.offload.stream_gradients = stream;
    o.offload.delayed_update_after = warmup;
    expect_same_bf16(fit_bf16(o, lr), want, "--offload_delayed_update_after=4, stream_gradients=" + stream);
  }
}

TEST(ParamDtype, RefusesAnOptimizerWithoutMasterAndUnknownDtypes) {
  TrainerOptions o;
  o.param_dtype = at::kBFloat16;
  // A replicated optimizer over bfloat16 weights: the error names both ways to a master.
  EXPECT_TRUE(testing_util::throws_error_with([&] { validate(o); }, "--offload=optimizer"));
  EXPECT_TRUE(testing_util::throws_error_with([&] { validate(o); }, "--shard=optimizer"));
  o.shard = "optimizer";
  o.amp = AmpMode::kFp16;
  EXPECT_THROW(validate(o), Error);
  EXPECT_EQ(parse_param_dtype("bf16"), at::kBFloat16);
  EXPECT_EQ(parse_param_dtype("float32"), at::kFloat);
  EXPECT_TRUE(testing_util::throws_error_with([] { parse_param_dtype("fp16"); }, "--amp=fp16"));
}

}  // namespace
}  // namespace dtrain::engine
