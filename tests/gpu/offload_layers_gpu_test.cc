// Layer offload on a GPU: blocks whose weights live in pinned host memory, streamed one block
// ahead, give the same outputs and gradients as the same blocks resident on the device, and
// their weights do not stay on the device.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/offload/layer_offload.h"
#include "test_util.h"

namespace dtrain {
namespace {

std::vector<std::shared_ptr<torch::nn::Module>> make_blocks(int n, int64_t d) {
  torch::manual_seed(3);
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  for (int i = 0; i < n; ++i) {
    blocks.push_back(std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(d, d), torch::nn::Tanh()));
  }
  return blocks;
}

at::Tensor run(std::vector<std::shared_ptr<torch::nn::Module>>& blocks, offload::LayerStreamer* s, at::Tensor x) {
  const size_t n = blocks.size();
  for (size_t i = 0; i < n; ++i) {
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(blocks[i].get());
    auto fn = [seq](const at::Tensor& in) { return seq->forward(in); };
    if (!s) {
      x = engine::checkpoint(fn, x, blocks[i]->parameters());
      continue;
    }
    engine::CheckpointHooks h;
    h.before_forward = [s, i, n] { s->acquire(i, i + 1 < n ? i + 1 : n); };
    h.after_forward = [s, i] { s->release(i); };
    h.before_recompute = [s, i, n] { s->acquire(i, i > 0 ? i - 1 : n); };
    h.after_recompute = [s, i] { s->release(i); };
    x = engine::checkpoint(fn, x, blocks[i]->parameters(), h);
  }
  return x;
}

TEST(LayerOffloadGpu, StreamedBlocksMatchResidentBlocksAndLeaveTheDevice) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  const int64_t d = 512;
  auto resident = make_blocks(6, d);
  auto streamed = make_blocks(6, d);
  for (auto& b : resident) b->to(dev);
  for (auto& b : streamed) b->to(dev);
  offload::LayerStreamer streamer(streamed, dev);
  for (auto& b : streamed) {
    for (auto& p : b->parameters()) EXPECT_TRUE(p.device().is_cpu()) << "weights live on the host";
  }
  at::Tensor x = at::randn({8, d}, at::TensorOptions().device(dev));
  at::Tensor probe = at::randn({8, d}, at::TensorOptions().device(dev));
  at::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  (run(resident, nullptr, xa) * probe).sum().backward();
  // The resident blocks' weights and gradients stay allocated: measure the growth over them.
  engine::reset_peak_memory(dev);
  const double start_mb = engine::memory_stats(dev).allocated_mb;
  (run(streamed, &streamer, xb) * probe).sum().backward();
  EXPECT_LT(testing_util::rel_error(xb.grad(), xa.grad()), 1e-5);
  for (size_t i = 0; i < resident.size(); ++i) {
    auto pa = resident[i]->parameters(), pb = streamed[i]->parameters();
    for (size_t k = 0; k < pa.size(); ++k) {
      EXPECT_TRUE(pb[k].device().is_cpu());
      ASSERT_TRUE(pb[k].grad().defined());
      EXPECT_TRUE(pb[k].grad().device().is_cpu()) << "gradients come back to the host";
      EXPECT_LT(testing_util::rel_error(pb[k].grad(), pa[k].grad()), 1e-5);
    }
  }
  // block_mb: one block's weights and gradients. Streaming keeps at most two blocks' weights
  // (the one running and the one prefetched) and a block's gradients (until they go back to
  // the host) on the device, plus small activations: well under the 6 * block_mb that the
  // six blocks would need resident.
  const double block_mb = 2.0 * (d * d + d) * 4 / (1024.0 * 1024.0);
  EXPECT_LT(engine::memory_stats(dev).peak_mb - start_mb, 3.5 * block_mb);
}

// Under AMP, autocast's cache would keep every streamed block's bf16 copy of its weights until
// the autocast region ends (issue 19, item 5): the streamer turns the cache off while a block is
// acquired. With checkpointing, forward keeps only block outputs, so what forward leaves on the
// device is well under one block's bf16 weights; cached casts would leave all six. The gradients
// match the same blocks resident under the same autocast.
TEST(LayerOffloadGpu, StreamedBlocksUnderAmpKeepNoCastWeights) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  const int64_t d = 1024;
  const int n = 6;
  auto resident = make_blocks(n, d);
  auto streamed = make_blocks(n, d);
  for (auto& b : resident) b->to(dev);
  for (auto& b : streamed) b->to(dev);
  offload::LayerStreamer streamer(streamed, dev);
  at::Tensor x = at::randn({8, d}, at::TensorOptions().device(dev));
  at::Tensor probe = at::randn({8, d}, at::TensorOptions().device(dev));
  at::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  {
    engine::AutocastGuard amp(c10::kCUDA, engine::AmpMode::kBf16);
    (run(resident, nullptr, xa).to(at::kFloat) * probe).sum().backward();
  }
  const double cast_block_mb = (d * d + d) * 2 / (1024.0 * 1024.0);  // one block in bf16
  double forward_growth_mb = 0;
  {
    engine::AutocastGuard amp(c10::kCUDA, engine::AmpMode::kBf16);
    const double before_mb = engine::memory_stats(dev).allocated_mb;
    at::Tensor y = run(streamed, &streamer, xb);
    forward_growth_mb = engine::memory_stats(dev).allocated_mb - before_mb;
    (y.to(at::kFloat) * probe).sum().backward();
  }
  EXPECT_LT(forward_growth_mb, 0.5 * cast_block_mb)
      << "forward left " << forward_growth_mb << " MB on the device; cached bf16 weights of " << n
      << " blocks would be " << n * cast_block_mb << " MB";
  EXPECT_LT(testing_util::rel_error(xb.grad(), xa.grad()), 1e-3);
  for (size_t i = 0; i < resident.size(); ++i) {
    auto pa = resident[i]->parameters(), pb = streamed[i]->parameters();
    for (size_t k = 0; k < pa.size(); ++k) {
      ASSERT_TRUE(pb[k].grad().defined());
      EXPECT_TRUE(pb[k].grad().device().is_cpu());
      EXPECT_LT(testing_util::rel_error(pb[k].grad(), pa[k].grad()), 1e-3);
    }
  }
}

}  // namespace
}  // namespace dtrain
