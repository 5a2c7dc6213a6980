// The memory report: storages counted once, and a real training step of a small MLP whose
// parameters, gradients, AdamW state and batch are known in closed form, measured with the
// counting CPU allocator (exact bytes) and, on a GPU, with the caching allocator.
#include "dtrain/engine/memory/memory_report.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/optim.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

TEST(TensorBytes, CountsEachStorageOnce) {
  const at::Tensor flat = at::zeros({1000}, at::kFloat);
  const at::Tensor a = flat.narrow(0, 0, 300), b = flat.narrow(0, 300, 700);
  const at::Tensor other = at::zeros({10, 10}, at::kDouble);
  const at::Tensor strided = other.t();   // a view of `other`
  EXPECT_EQ(tensor_bytes({a, b}), 4000);  // the whole buffer, once
  EXPECT_EQ(tensor_bytes({a, b, flat, other, strided, at::Tensor()}), 4000 + 800);
  EXPECT_EQ(tensor_bytes({}), 0);
  const at::Tensor meta = at::empty({256}, at::TensorOptions().device(at::kMeta));
  EXPECT_EQ(tensor_bytes({flat, meta}, c10::Device(c10::kCPU)), 4000);
  EXPECT_EQ(tensor_bytes({flat, meta}, c10::Device(c10::kMeta)), 1024);
}

// The model, data and one training step of the measured run.
struct MlpRun {
  torch::nn::Sequential model{torch::nn::Linear(64, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 10)};
  std::unique_ptr<Optimizer> optimizer;
  std::vector<at::Tensor> params;
  static constexpr int64_t kBatch = 32;
  // Closed forms, in floats.
  static constexpr int64_t kParams = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10;
  static constexpr int64_t kBatchFloats = kBatch * 64 + kBatch * 10;
  // Alive at the end of forward: both ReLU outputs (saved by ReLU and the next Linear), the
  // output (saved by the loss) and the loss.
  static constexpr int64_t kSavedFloats = 2 * kBatch * 256 + kBatch * 10 + 1;

  explicit MlpRun(c10::Device device) {
    model->to(device);
    params = model->parameters();
    OptimizerOptions o;
    o.name = "adamw";
    optimizer = make_optimizer(params, o);
  }
  std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad());
    return g;
  }
  std::vector<at::Tensor> state() const {
    std::vector<at::Tensor> s;
    for (const auto& [name, t] : optimizer->state()) s.push_back(t);
    return s;
  }
  at::Tensor forward_loss(const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(model->forward(x), y);
  }
};

TEST(MemoryReport, CpuComponentsAddUpToTheCountingAllocator) {
  track_cpu_memory();
  const c10::Device cpu(c10::kCPU);
  ASSERT_TRUE(cpu_memory_tracked());
  const double baseline = memory_stats(cpu).allocated_mb;  // tensors of other tests
  {
    MlpRun run(cpu);
    const at::Tensor x = torch::randn({MlpRun::kBatch, 64}), y = torch::randn({MlpRun::kBatch, 10});
    // Step 1 allocates the gradients; zero_grad keeps them.
    run.forward_loss(x, y).backward();
    run.optimizer->step();
    run.optimizer->zero_grad();

    ActivationProbe probe(cpu);
    probe.begin();
    at::Tensor loss = run.forward_loss(x, y);
    probe.mark("forward");
    loss.backward();
    loss = at::Tensor();
    probe.mark("backward");
    MemoryReport r = build_memory_report(cpu, run.params, run.grads(), run.state(),
                                         probe.start_allocated_mb() - baseline,
                                         probe.peak_mb() - baseline, {{"parameters", 0.3}});
    r.step = 2;
    const std::string table = r.to_string();
    SCOPED_TRACE(table);

    // Closed forms (float32 = 4 bytes; AdamW: exp_avg and exp_avg_sq per parameter tensor
    // plus a 0-dim float "step").
    EXPECT_DOUBLE_EQ(r.parameters_mb, MlpRun::kParams * 4 / kMiB);
    EXPECT_DOUBLE_EQ(r.gradients_mb, MlpRun::kParams * 4 / kMiB);
    EXPECT_DOUBLE_EQ(r.optimizer_state_mb, (2 * MlpRun::kParams + 6) * 4 / kMiB);
    // What the allocator held at the step's start beyond the model state is the batch
    // (the counting allocator is exact).
    EXPECT_NEAR(r.other_mb * kMiB, MlpRun::kBatchFloats * 4, 64);
    // Activations: at least what forward must keep for backward, and the allocator's peak.
    const double at_forward = probe.marks()[0].allocated_mb - probe.start_allocated_mb();
    EXPECT_GE(at_forward * kMiB, MlpRun::kSavedFloats * 4 - 64);
    EXPECT_LE(at_forward * kMiB, (MlpRun::kSavedFloats + MlpRun::kBatch * 256) * 4);
    EXPECT_GE(r.activations_mb, at_forward);
    EXPECT_DOUBLE_EQ(r.activations_mb, probe.peak_mb() - probe.start_allocated_mb());
    // The components explain the allocator's figure (other: the batch, within a few %).
    EXPECT_NEAR(r.parameters_mb + r.gradients_mb + r.optimizer_state_mb + r.activations_mb,
                r.allocated_peak_mb, 0.03 * r.allocated_peak_mb);
    EXPECT_NEAR(r.total_mb(), r.allocated_peak_mb, 1e-9);
    EXPECT_EQ(r.allocator_cache_mb, 0.0);
    EXPECT_EQ(r.cuda_context_mb, 0.0);
    EXPECT_TRUE(r.notes.empty());

    EXPECT_NE(table.find("memory on cpu at step 2"), std::string::npos);
    EXPECT_NE(table.find("optimizer state"), std::string::npos);
    EXPECT_NE(table.find("predicted"), std::string::npos);
    EXPECT_NE(table.find("0.3"), std::string::npos);
    EXPECT_EQ(table.find("reserved"), std::string::npos);  // CPU: no allocator cache rows
    EXPECT_EQ(table.find("host:"), std::string::npos);  // no offload, no host row
    r.host_offload_mb = 12.5;
    const std::string with_host = r.to_string();
    EXPECT_NE(with_host.find("host: optimizer offload (master, state, buffers)"), std::string::npos) << with_host;
    EXPECT_NE(with_host.find("12.5"), std::string::npos) << with_host;
    EXPECT_NEAR(r.total_mb(), r.allocated_peak_mb, 1e-9);  // not part of the device's total
    r.host_staging_mb = 85.0;
    EXPECT_NE(r.to_string().find("host: checkpoint staging (pinned, --async_save)"), std::string::npos);
    EXPECT_NEAR(r.total_mb(), r.allocated_peak_mb, 1e-9);
  }
}

TEST(MemoryReport, GradientsAllocatedDuringTheStepAreNotActivations) {
  // 10 MiB of model state, 4 at the step's start (gradients came later), peak 16:
  // activations are 16 - 10, other 0, with a note.
  const c10::Device cpu(c10::kCPU);
  const at::Tensor p = at::zeros({1 << 20}), g = at::zeros({1 << 20}), s = at::zeros({1 << 19});
  const MemoryReport r = build_memory_report(cpu, {p}, {g}, {s}, 4.0, 16.0);
  EXPECT_DOUBLE_EQ(r.parameters_mb + r.gradients_mb + r.optimizer_state_mb, 10.0);
  EXPECT_DOUBLE_EQ(r.activations_mb, 6.0);
  EXPECT_DOUBLE_EQ(r.other_mb, 0.0);
  EXPECT_FALSE(r.notes.empty());
  // A storage listed twice (a gradient that is the parameter itself) counts once.
  const MemoryReport twice = build_memory_report(cpu, {p}, {p}, {}, 4.0, 4.0);
  EXPECT_DOUBLE_EQ(twice.parameters_mb, 4.0);
  EXPECT_DOUBLE_EQ(twice.gradients_mb, 0.0);
}

TEST(MemoryReport, GradientsFreedAfterTheUpdateAreCountedAtThePeak) {
  // A lone rank's trainer drops its gradients after the update: at the report they are gone,
  // but at the step's peak they were there. Parameters 4 MiB and state 2 MiB at the start (6,
  // other 1 MiB besides), 4 MiB of gradients made in backward, peak 20: activations 20 - 7 - 4.
  const c10::Device cpu(c10::kCPU);
  const at::Tensor p = at::zeros({1 << 20}), s = at::zeros({1 << 19});
  const MemoryReport r = build_memory_report(cpu, {p}, {}, {s}, 7.0, 20.0, {}, /*step_gradients_mb=*/4.0);
  EXPECT_DOUBLE_EQ(r.gradients_mb, 4.0);
  EXPECT_DOUBLE_EQ(r.other_mb, 1.0);
  EXPECT_DOUBLE_EQ(r.activations_mb, 9.0);
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes[0].find("freed after its update"), std::string::npos) << r.notes[0];
  // Gradients that stay (a data-parallel reducer's buckets) are counted once, with no note.
  const at::Tensor g = at::zeros({1 << 20});
  const MemoryReport kept = build_memory_report(cpu, {p}, {g}, {s}, 11.0, 20.0, {}, 4.0);
  EXPECT_DOUBLE_EQ(kept.gradients_mb, 4.0);
  EXPECT_DOUBLE_EQ(kept.activations_mb, 9.0);
  EXPECT_TRUE(kept.notes.empty());
}

// Layer offload's host side, beside a device that is not the CPU (here the meta device, which
// allocates nothing): the CPU tensors go to rows of their own, each storage once, and the
// device's rows count only the device's.
TEST(MemoryReport, HostResidentTensorsOfAnotherDeviceHaveRowsOfTheirOwn) {
  const c10::Device meta(c10::kMeta);
  const at::Tensor on_device = at::empty({1 << 18}, at::TensorOptions().device(meta));  // 1 MiB
  const at::Tensor host_flat = at::zeros({3 << 18});                                     // 3 MiB
  const at::Tensor w1 = host_flat.narrow(0, 0, 1 << 18), w2 = host_flat.narrow(0, 1 << 18, 2 << 18);
  const at::Tensor g = at::zeros({1 << 18}), moment = at::zeros({1 << 19}), next = at::zeros({3 << 18});
  MemoryReport r = build_memory_report(meta, {on_device, w1, w2}, {g, on_device}, {moment, next, g}, 1.0, 1.0);
  EXPECT_DOUBLE_EQ(r.parameters_mb, 1.0);
  EXPECT_DOUBLE_EQ(r.gradients_mb, 0.0);  // the device tensor was counted as a parameter
  EXPECT_DOUBLE_EQ(r.host_parameters_mb, 3.0);
  EXPECT_DOUBLE_EQ(r.host_gradients_mb, 1.0);
  EXPECT_DOUBLE_EQ(r.host_optimizer_state_mb, 2.0 + 3.0);  // g counted once, as a gradient
  r.host_offload_mb = 10.0;
  EXPECT_DOUBLE_EQ(r.host_total_mb(), 19.0);
  const std::string table = r.to_string();
  EXPECT_NE(table.find("host: parameters (layer offload, pinned)"), std::string::npos) << table;
  EXPECT_NE(table.find("host: optimizer state (beside optimizer offload)"), std::string::npos) << table;
  // On the CPU the same tensors are the device's.
  const MemoryReport cpu = build_memory_report(c10::Device(c10::kCPU), {w1, w2}, {g}, {moment}, 6.0, 6.0);
  EXPECT_DOUBLE_EQ(cpu.parameters_mb, 3.0);
  EXPECT_DOUBLE_EQ(cpu.host_parameters_mb + cpu.host_gradients_mb + cpu.host_optimizer_state_mb, 0.0);
}

TEST(MemoryReport, GpuSummaryLine) {
  EXPECT_EQ(gpu_summary_line(c10::Device(c10::kCPU)), "");
  EXPECT_FALSE(gpu_status(c10::Device(c10::kCPU)).available);
  const GpuStatus s = gpu_status(c10::Device(c10::kCUDA, 0));
  const std::string line = gpu_summary_line(c10::Device(c10::kCUDA, 0));
  if (s.available) {
    EXPECT_EQ(line.rfind("[", 0), 0u) << line;
    EXPECT_GT(s.memory_total_mb, 0);
    EXPECT_LE(s.memory_used_mb, s.memory_total_mb);
  } else {
    EXPECT_FALSE(s.error.empty());
    EXPECT_EQ(line, "NVML not available (" + s.error + ")");
  }
}

TEST(MemoryReport, GpuComponentsAddUpToTheCachingAllocator) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device gpu(c10::kCUDA, 0);
  release_cached_memory(gpu);
  const double baseline = memory_stats(gpu).allocated_mb;
  MlpRun run(gpu);
  const at::Tensor x = torch::randn({MlpRun::kBatch, 64}, at::device(gpu)),
                   y = torch::randn({MlpRun::kBatch, 10}, at::device(gpu));
  run.forward_loss(x, y).backward();
  run.optimizer->step();
  run.optimizer->zero_grad();
  ActivationProbe probe(gpu);
  probe.begin();
  run.forward_loss(x, y).backward();
  probe.mark("backward");
  const MemoryReport r =
      build_memory_report(gpu, run.params, run.grads(), run.state(),
                          probe.start_allocated_mb() - baseline, probe.peak_mb() - baseline);
  SCOPED_TRACE(r.to_string());
  std::cout << r.to_string() << gpu_summary_line(gpu) << "\n";
  EXPECT_DOUBLE_EQ(r.parameters_mb, MlpRun::kParams * 4 / kMiB);
  // The caching allocator rounds blocks up to 512 bytes: model state within a few percent.
  EXPECT_NEAR(r.other_mb, MlpRun::kBatchFloats * 4 / kMiB, 0.05 * r.allocated_peak_mb);
  EXPECT_NEAR(r.parameters_mb + r.gradients_mb + r.optimizer_state_mb + r.activations_mb,
              r.allocated_peak_mb, 0.05 * r.allocated_peak_mb);
  EXPECT_GE(r.reserved_mb, r.allocated_peak_mb);
  EXPECT_NEAR(r.allocated_peak_mb + r.allocator_cache_mb, r.reserved_mb, 1e-9);
}

}  // namespace
}  // namespace dtrain::engine
