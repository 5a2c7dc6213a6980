// AMP and activation checkpointing on CUDA: autocast to fp16/bf16, the loss scaler with its
// state and gradients on the GPU against PyTorch's GradScaler, found-inf agreement across
// ranks, and checkpointed blocks replaying the CUDA random-number state.
#include <gtest/gtest.h>

#include <limits>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/optim.h"
#include "gradscaler_cases.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using nlohmann::json;
using gradscaler_cases::from_json;
using gradscaler_cases::planted_grads;

const c10::Device kCuda(c10::kCUDA, 0);

TEST(AmpGpu, CudaAutocastMatmulDtypes) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  at::Tensor a = at::ones({4, 3}, at::device(kCuda)), b = at::ones({3, 2}, at::device(kCuda));
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  {
    AutocastGuard fp16(c10::kCUDA, AmpMode::kFp16);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));  // only the CUDA state
    {
      AutocastGuard bf16(c10::kCUDA, AmpMode::kBf16);
      EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kHalf);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCUDA));
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

TEST(AmpGpu, ScalerOnCudaMatchesGradScaler) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const int steps = 24, interval = 3;
  const std::set<int> inf_steps = {4, 5, 11, 20}, nan_steps = {8, 20};
  const std::string out = testing_util::run_python(
      "tests/reference/gradscaler_reference.py",
      {std::to_string(steps), "65536", "2", "0.5", std::to_string(interval), "4,5,11,20", "8,20"});
  ASSERT_FALSE(out.empty());
  const json ref = json::parse(out)["runs"][0]["steps"];
  ASSERT_EQ(ref.size(), static_cast<size_t>(steps));

  LossScalerOptions options;
  options.growth_interval = interval;
  LossScaler scaler(options, kCuda);
  for (int k = 0; k < steps; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    at::Tensor scaled_one = scaler.scale(at::ones({}, at::device(kCuda)));
    EXPECT_TRUE(scaled_one.is_cuda());
    const double scale = scaled_one.item<double>();
    EXPECT_EQ(scale, ref[k]["scale"].get<double>());
    std::vector<at::Tensor> grads =
        planted_grads(k, scale, inf_steps.count(k) > 0, nan_steps.count(k) > 0, kCuda);
    const bool ok = scaler.unscale(grads, nullptr);
    ASSERT_EQ(!ok, ref[k]["skipped"].get<bool>());
    if (ok) {
      const json& u = ref[k]["unscaled"];
      EXPECT_TRUE(at::equal(grads[0].cpu(), from_json(u["p0"], at::kFloat)));
      EXPECT_TRUE(at::equal(grads[1].flatten().cpu(), from_json(u["p1"], at::kDouble)));
      EXPECT_TRUE(at::equal(grads[3].cpu(), from_json(u["p3"], at::kBFloat16)));
    }
    scaler.update();
    EXPECT_EQ(scaler.scale_value(), ref[k]["scale_after"].get<double>());
  }
  EXPECT_EQ(scaler.skipped_steps(), 5);
  for (const auto& [name, t] : scaler.state()) EXPECT_TRUE(t.is_cuda()) << name;
}

// Gradients on the CPU and the GPU in one step: an inf in either is found.
TEST(AmpGpu, GradientsOnTwoDevices) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  LossScaler scaler(LossScalerOptions{}, kCuda);
  for (int step = 0; step < 3; ++step) {
    at::Tensor on_cpu = at::full({3}, 65536.0 * 0.5, at::kFloat);
    at::Tensor on_gpu = at::full({2}, 65536.0 * 0.25 * 2, at::device(kCuda));
    if (step == 1) on_cpu[0] = std::numeric_limits<float>::infinity();
    if (step == 2) on_gpu[1] = std::numeric_limits<float>::infinity();
    const double scale = scaler.scale_value();
    on_cpu.mul_(scale / 65536.0);
    on_gpu.mul_(scale / 65536.0);
    const bool ok = scaler.unscale({on_cpu, on_gpu}, nullptr);
    EXPECT_EQ(ok, step == 0) << "step " << step;
    if (ok) {
      EXPECT_TRUE(at::equal(on_cpu, at::full({3}, 0.5, at::kFloat)));
      EXPECT_TRUE(at::equal(on_gpu.cpu(), at::full({2}, 0.5, at::kFloat)));
    }
    scaler.update();
  }
  EXPECT_EQ(scaler.scale_value(), 65536.0 / 4);
}

// Under mpirun: an inf on the last rank only makes every rank skip (scale on the GPU).
TEST(AmpGpu, FoundInfIsAgreedAcrossRanks) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  dist::Communicator& comm = testing_util::world_comm();
  LossScaler scaler(LossScalerOptions{}, kCuda);
  at::Tensor g = at::full({4}, 65536.0, at::device(kCuda));
  if (comm.rank() == comm.size() - 1) g[2] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.unscale({g}, &comm));
  scaler.update();
  EXPECT_EQ(scaler.scale_value(), 32768.0);
  at::Tensor h = at::full({4}, 32768.0, at::device(kCuda));
  EXPECT_TRUE(scaler.unscale({h}, &comm));
  EXPECT_TRUE(at::equal(h.cpu(), at::ones({4})));
  scaler.update();
}

// ---------------------------------------------------------------------------------------
// Activation checkpointing on CUDA

torch::nn::Sequential make_block(uint64_t seed, at::ScalarType dtype) {
  torch::manual_seed(seed);
  torch::nn::Sequential block(torch::nn::Linear(8, 16), torch::nn::GELU(), torch::nn::Dropout(0.3),
                              torch::nn::Linear(16, 8));
  block->to(kCuda, dtype);
  block->train();
  return block;
}

// Two blocks on the GPU, plain or checkpointed; returns output, input grad and param grads.
std::vector<at::Tensor> run_blocks(std::vector<torch::nn::Sequential>& blocks, bool checkpointed,
                                   at::ScalarType dtype, AmpMode amp) {
  for (auto& b : blocks) b->zero_grad();
  torch::manual_seed(99);  // seeds the CPU and every CUDA generator
  at::Tensor x = torch::randn({4, 8}, torch::device(kCuda).dtype(dtype)).requires_grad_(true);
  at::Tensor y = x;
  {
    AutocastGuard autocast(c10::kCUDA, amp);
    for (auto& b : blocks) {
      auto fn = [b](const at::Tensor& in) mutable { return b->forward(in); };
      y = checkpointed ? checkpoint(fn, y, b->parameters()) : fn(y);
    }
  }
  at::Tensor w = torch::randn(y.sizes(), torch::device(kCuda).dtype(y.scalar_type()));
  (y * w).sum().backward();
  std::vector<at::Tensor> r = {y.detach().cpu(), x.grad().cpu()};
  for (auto& b : blocks) {
    for (const at::Tensor& p : b->parameters()) r.push_back(p.grad().cpu());
  }
  r.push_back(torch::randn({4}, torch::device(kCuda)).cpu());  // the CUDA RNG was put back
  return r;
}

void expect_checkpoint_matches_plain(at::ScalarType dtype, AmpMode amp) {
  std::vector<torch::nn::Sequential> blocks = {make_block(1, dtype), make_block(2, dtype)};
  std::vector<at::Tensor> plain = run_blocks(blocks, false, dtype, amp);
  std::vector<at::Tensor> ckpt = run_blocks(blocks, true, dtype, amp);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(ckpt[i], plain[i]))
        << "item " << i << " rel error " << testing_util::rel_error(ckpt[i], plain[i]);
  }
}

// A host parameter group (layer offload's streamed blocks under the ordinary optimizer) with
// the drop flag on the GPU (the non-finite watch keeps it there): the host kernels read the
// flag only after it has landed. The flag is made at the end of long device work, so an
// asynchronous copy into page-locked memory would still be in flight when the CPU update
// reads it: a NaN step would then be taken (NaN weights), or a finite one dropped.
TEST(OptimSkipOnDeviceGpu, AHostGroupReadsTheDeviceFlagAfterItLands) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  OptimizerOptions o;
  o.name = "adamw";
  o.lr = 0.01;
  std::vector<at::Tensor> params = {at::randn({1 << 16}).requires_grad_(true),
                                    at::randn({64}, at::TensorOptions().device(kCuda)).requires_grad_(true)};
  std::unique_ptr<Optimizer> opt = make_optimizer(params, o);
  ASSERT_TRUE(opt->skips_on_device());
  const at::Tensor busy = at::randn({4096, 4096}, at::TensorOptions().device(kCuda));
  for (int trial = 0; trial < 8; ++trial) {
    const bool drop = trial % 2 == 0;
    SCOPED_TRACE("trial " + std::to_string(trial) + (drop ? " (dropped)" : ""));
    params[0].mutable_grad() = drop ? at::full({1 << 16}, std::nan("")) : at::ones({1 << 16});
    params[1].mutable_grad() = at::ones({64}, at::TensorOptions().device(kCuda));
    const at::Tensor before = params[0].detach().clone();
    at::Tensor work = busy;
    for (int k = 0; k < 20; ++k) work = at::matmul(work, busy).mul_(1e-3);
    const at::Tensor flag = (work.sum() * 0 + (drop ? 1.0 : 0.0)).reshape({1}).to(at::kFloat);
    opt->step_unless(at::Tensor(), flag);
    if (drop) {
      EXPECT_TRUE(at::equal(params[0].detach(), before)) << "a flagged update changed the host weights";
    } else {
      EXPECT_FALSE(at::equal(params[0].detach(), before)) << "an update that was not flagged was dropped";
      EXPECT_TRUE(params[0].detach().isfinite().all().item<bool>());
    }
  }
}

TEST(ActivationCheckpointGpu, DropoutBlocksMatchPlainOnCuda) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  expect_checkpoint_matches_plain(at::kDouble, AmpMode::kOff);
}

TEST(ActivationCheckpointGpu, UnderCudaFp16AutocastMatchesPlain) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  expect_checkpoint_matches_plain(at::kFloat, AmpMode::kFp16);
}

}  // namespace
}  // namespace dtrain::engine
