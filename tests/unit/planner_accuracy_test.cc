// The planner against real training on the CPU (planner_accuracy.h: a small encoder-decoder
// trained by the engine's Trainer under several techniques, its peak measured by the counting
// CPU allocator, the estimate within 10%), and the probe leaving the model as it found it:
// gradients and random-number state restored, nothing allocated left behind.
#include "planner_accuracy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/planner.h"

namespace dtrain::engine {
namespace {

using namespace planner_testing;

TEST(PlannerAccuracy, EstimateWithinTenPercentOfTheMeasuredPeakOnTheCpu) {
  track_cpu_memory();
  check_estimates_against_training(c10::Device(c10::kCPU), AmpMode::kBf16);
}

TEST(PlannerAccuracy, ProbeRestoresGradientsAndRandomState) {
  track_cpu_memory();
  const c10::Device cpu(c10::kCPU);
  torch::manual_seed(2);
  TinySeq2Seq model;
  std::vector<at::Tensor> params = model->parameters();
  // Half the parameters have a gradient (a view into one flat buffer, as the reducer keeps
  // them), the others none.
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); i += 2) total += params[i].numel();
  at::Tensor flat = at::randn({total});
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); i += 2) {
    params[i].mutable_grad() = flat.narrow(0, offset, params[i].numel()).view(params[i].sizes());
    offset += params[i].numel();
  }
  const at::Tensor flat_before = flat.clone();
  const at::Tensor expected_draw = [] {
    torch::manual_seed(3);
    return at::rand({5});
  }();
  torch::manual_seed(3);
  const int64_t before = allocated_bytes(cpu);
  probe_activations([&](int64_t rows, bool) { return model->loss(random_rows(rows, cpu)); }, params,
                    cpu, ProbeOptions{1, 2, {{false, AmpMode::kOff}}});
  EXPECT_EQ(allocated_bytes(cpu), before);  // nothing left behind
  EXPECT_TRUE(at::equal(at::rand({5}), expected_draw));
  EXPECT_TRUE(at::equal(flat, flat_before));
  for (size_t i = 0; i < params.size(); ++i) {
    if (i % 2 == 0) {
      ASSERT_TRUE(params[i].grad().defined());
      EXPECT_EQ(
          params[i].grad().data_ptr(), flat.data_ptr<float>() +
                                           [&] {
                                             int64_t o = 0;
                                             for (size_t k = 0; k < i; k += 2)
                                               o += params[k].numel();
                                             return o;
                                           }())
          << "gradient " << i << " is no longer a view of the flat buffer";
    } else {
      EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i << " got a gradient";
    }
  }
}

TEST(PlannerAccuracy, ProbeMeasuresWhatForwardHoldsForBackward) {
  // y = tanh(x * w) summed: the product saves x (w's gradient needs it), tanh saves its result,
  // the product itself is freed when forward returns: 2 x 1024 floats held per row.
  track_cpu_memory();
  const c10::Device cpu(c10::kCPU);
  at::Tensor w = at::randn({1024}).requires_grad_();
  auto fn = [&](int64_t rows, bool) { return (at::randn({rows, 1024}) * w).tanh().sum(); };
  const ActivationProfile p = probe_activations(fn, {w}, cpu, ProbeOptions{2, 4, {{false, AmpMode::kOff}}});
  ASSERT_EQ(p.fits.size(), 1u);
  const ActivationFit& f = p.fits[0];
  EXPECT_DOUBLE_EQ(f.held_bytes_per_row, 2 * 1024 * 4.0);
  EXPECT_LE(f.held_intercept_bytes, 1024.0);  // the loss scalar
  EXPECT_EQ(f.held(8), f.held_bytes[1] + 4 * 2 * 1024 * 4);
  // Backward adds to what is held (gradients of the saved tensors' shape), never less.
  EXPECT_GE(f.peak_bytes[0], f.held_bytes[0]);
  EXPECT_GE(f.peak_bytes[1], f.held_bytes[1]);
}

TEST(PlannerAccuracy, ProbeRefusesBadInput) {
  const c10::Device cpu(c10::kCPU);
  at::Tensor w = at::zeros({3}, at::TensorOptions().requires_grad(true));
  auto fn = [&](int64_t rows, bool) { return (w * rows).sum(); };
  auto message = [&](const ProbeOptions& o, std::vector<at::Tensor> params) {
    try {
      probe_activations(fn, params, cpu, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(ProbeOptions{2, 2, {{false, AmpMode::kOff}}}, {w}).find("rows_large=2"),
            std::string::npos);
  EXPECT_NE(message(ProbeOptions{1, 2, {}}, {w}).find("no techniques"), std::string::npos);
  EXPECT_NE(message(ProbeOptions{}, {}).find("no parameters"), std::string::npos);
  track_cpu_memory();
  auto vector_loss = [&](int64_t, bool) { return w * 2; };
  try {
    probe_activations(vector_loss, {w}, cpu, ProbeOptions{});
    ADD_FAILURE() << "a non-scalar loss was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must return a scalar"), std::string::npos);
  }
  EXPECT_FALSE(w.grad().defined());  // restored after the failure too
}

}  // namespace
}  // namespace dtrain::engine
