// Layer offload on a GPU: blocks whose weights live in pinned host memory, streamed one block
// ahead, give the same outputs and gradients as the same blocks resident on the device, and
// their weights do not stay on the device.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/dist/error.h"
#include "dtrain/offload/layer_offload.h"
#include "test_util.h"

namespace dtrain {
namespace {

// n Linear + Tanh blocks of width d on `device`, the same weights at every call.
std::vector<std::shared_ptr<torch::nn::Module>> make_blocks(int n, int64_t d, c10::Device device) {
  torch::manual_seed(3);
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  for (int i = 0; i < n; ++i) {
    blocks.push_back(std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(d, d), torch::nn::Tanh()));
    blocks.back()->to(device);
  }
  return blocks;
}

at::Tensor run(std::vector<std::shared_ptr<torch::nn::Module>>& blocks, offload::LayerStreamer* s, at::Tensor x,
               bool defer_waits = false) {
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
    h.defer_host_gradient_wait = defer_waits;
    x = engine::checkpoint(fn, x, blocks[i]->parameters(), h);
  }
  return x;
}

TEST(LayerOffloadGpu, StreamedBlocksMatchResidentBlocksAndLeaveTheDevice) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  const int64_t d = 512;
  auto resident = make_blocks(6, d, dev);
  auto streamed = make_blocks(6, d, dev);
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

// Counts the post-accumulate-grad hook calls of one parameter (the reducer's readiness signal).
class CountingHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit CountingHook(int* calls) : calls_(calls) {}
  void operator()(const torch::autograd::Variable&) override { ++*calls_; }

 private:
  int* calls_;
};

// Gradient accumulation over micro-batches, as the trainer does it: the first backward adopts
// the gradients copied to pinned memory; later ones (and those after an in-place zeroing, as the
// reducer's buckets are zeroed) accumulate into the same host tensors, the hooks firing once
// per parameter and backward. Each stage equals the resident blocks' gradients after the same
// sequence.
TEST(LayerOffloadGpu, AccumulatedGradientsOfStreamedBlocksMatchResidentOnes) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  const int64_t d = 256;
  auto resident = make_blocks(4, d, dev);
  auto streamed = make_blocks(4, d, dev);
  offload::LayerStreamer streamer(streamed, dev);
  std::vector<at::Tensor> params_a, params_b;
  for (size_t i = 0; i < resident.size(); ++i) {
    for (auto& p : resident[i]->parameters()) params_a.push_back(p);
    for (auto& p : streamed[i]->parameters()) params_b.push_back(p);
  }
  std::vector<int> calls(params_b.size(), 0);
  for (size_t k = 0; k < params_b.size(); ++k) {
    torch::autograd::impl::set_post_acc_grad_hooks(params_b[k], std::make_unique<CountingHook>(&calls[k]));
  }
  auto micro_batch = [&](int64_t seed) {
    torch::manual_seed(seed);
    at::Tensor x = at::randn({8, d}, at::TensorOptions().device(dev));
    at::Tensor probe = at::randn({8, d}, at::TensorOptions().device(dev));
    (run(resident, nullptr, x.clone().requires_grad_(true)) * probe).sum().backward();
    (run(streamed, &streamer, x.clone().requires_grad_(true)) * probe).sum().backward();
  };
  auto expect_same = [&](const std::string& stage) {
    for (size_t k = 0; k < params_b.size(); ++k) {
      ASSERT_TRUE(params_b[k].grad().defined()) << stage;
      EXPECT_TRUE(params_b[k].grad().device().is_cpu()) << stage;
      EXPECT_FALSE(params_b[k].grad().is_sparse()) << stage;
      EXPECT_LT(testing_util::rel_error(params_b[k].grad(), params_a[k].grad()), 1e-5) << stage << ", parameter " << k;
    }
  };
  micro_batch(1);
  expect_same("first backward (gradients adopted)");
  std::vector<const void*> storage;
  for (auto& p : params_b) {
    EXPECT_TRUE(p.grad().is_pinned()) << "the adopted gradient is the pinned copy";
    storage.push_back(p.grad().data_ptr());
  }
  micro_batch(2);
  expect_same("second backward (accumulated)");
  for (auto& p : params_a) p.mutable_grad().zero_();
  for (auto& p : params_b) p.mutable_grad().zero_();
  micro_batch(3);
  expect_same("after zeroing in place");
  for (size_t k = 0; k < params_b.size(); ++k) {
    EXPECT_EQ(params_b[k].grad().data_ptr(), storage[k]) << "parameter " << k << ": not accumulated in place";
    EXPECT_EQ(calls[k], 3) << "parameter " << k << ": the post-accumulate hook must fire once per backward";
  }
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
  auto resident = make_blocks(n, d, dev);
  auto streamed = make_blocks(n, d, dev);
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

// With the host waits left to backward's end, the gradients are complete when backward returns:
// the first backward's adopted copies (waited for by the engine callback) and a second's, added
// into them (which waits per block again, since autograd adds on the CPU at once), equal the
// resident blocks', and so does their norm (noted on the device for the adopted copies). Large
// blocks, so a copy still in flight would show.
TEST(LayerOffloadGpu, GradientWaitsAtBackwardsEndGiveCompleteGradients) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  const int64_t d = 2048;
  auto resident = make_blocks(4, d, dev);
  auto streamed = make_blocks(4, d, dev);
  offload::LayerStreamer streamer(streamed, dev);
  for (int64_t pass = 1; pass <= 2; ++pass) {
    torch::manual_seed(pass);
    at::Tensor x = at::randn({64, d}, at::TensorOptions().device(dev));
    at::Tensor probe = at::randn({64, d}, at::TensorOptions().device(dev));
    (run(resident, nullptr, x.clone().requires_grad_(true)) * probe).sum().backward();
    (run(streamed, &streamer, x.clone().requires_grad_(true), /*defer_waits=*/true) * probe).sum().backward();
    for (size_t i = 0; i < resident.size(); ++i) {
      auto pa = resident[i]->parameters(), pb = streamed[i]->parameters();
      for (size_t k = 0; k < pa.size(); ++k) {
        ASSERT_TRUE(pb[k].grad().defined() && pb[k].grad().is_cpu());
        if (pass == 1) EXPECT_TRUE(pb[k].grad().is_pinned()) << "the copy was not adopted";
        EXPECT_LT(testing_util::rel_error(pb[k].grad(), pa[k].grad()), 1e-5) << "pass " << pass << ", block " << i;
      }
    }
    // The norm: of the first pass from the norms noted on the device before the copies, of the
    // second (added into in place) read on the host again; the resident blocks' either way.
    std::vector<at::Tensor> ga, gb;
    for (size_t i = 0; i < resident.size(); ++i) {
      for (auto& p : resident[i]->parameters()) ga.push_back(p.grad());
      for (auto& p : streamed[i]->parameters()) gb.push_back(p.grad());
    }
    const double want = engine::grad_norm(ga).item<double>(), got = engine::grad_norm(gb).item<double>();
    EXPECT_NEAR(got, want, 1e-5 * want) << "pass " << pass;
  }
}

// A parameter's home may move between its uses (the one-rank delayed update swaps two host
// buffers): the next acquire streams it from where it is now, and a copy prefetched from the
// old place is made again.
TEST(LayerOffloadGpu, AHomeMovedBetweenUsesIsStreamedFromItsNewPlace) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  auto blocks = make_blocks(2, 64, dev);
  offload::LayerStreamer streamer(blocks, dev);
  at::Tensor w = blocks[1]->parameters()[0];
  streamer.prefetch(1);  // from the first home
  at::Tensor moved = at::full(w.sizes(), 0.25, w.options().pinned_memory(true));
  w.set_data(moved);
  streamer.acquire(1, 2);
  EXPECT_TRUE(w.is_cuda());
  EXPECT_EQ(w.detach().cpu().eq(0.25).all().item<bool>(), true) << "streamed the stale prefetched copy";
  streamer.release(1);
  EXPECT_EQ(w.data_ptr(), moved.data_ptr()) << "released to the old home";
}

// A prefetch that fails (here: a parameter of the next layer found on the device between its
// uses; on a real run, out of memory at the two-blocks peak) leaves the layer being acquired as
// it was and no half-made copy behind: the caller's back-off can acquire both again.
TEST(LayerOffloadGpu, AFailedPrefetchLeavesNothingAcquired) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  auto blocks = make_blocks(2, 64, dev);
  offload::LayerStreamer streamer(blocks, dev);
  at::Tensor bias = blocks[1]->parameters()[1];
  const at::Tensor home = bias.detach();
  bias.set_data(home.to(dev));  // prefetch(1) copies the weight, then refuses the bias
  EXPECT_THROW(streamer.acquire(0, 1), dtrain::Error);
  for (auto& p : blocks[0]->parameters()) EXPECT_TRUE(p.is_cpu()) << "block 0 was left acquired";
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  bias.set_data(home);
  streamer.acquire(1, 2);
  for (auto& p : blocks[1]->parameters()) EXPECT_TRUE(p.is_cuda());
  streamer.release(1);
  streamer.acquire(0, 2);
  streamer.release(0);
  for (auto& p : blocks[0]->parameters()) EXPECT_TRUE(p.is_cpu());
}

// Layer offload's delayed update on a GPU (the streamed blocks' update by the CPU kernels one
// step late, the resident head's at once) trains as the same optimizer on the CPU, where the
// blocks are named streamed; the blocks' weights stay page-locked as the update swaps their
// buffers (what their copies to the device read).
// Three streamed blocks (on a GPU: their weights on the host, streamed) and a resident head.
struct StreamedNet {
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  torch::nn::Linear head{nullptr};
  std::unique_ptr<offload::LayerStreamer> streamer;  // on a GPU
  std::vector<at::Tensor> params, streamed;          // all (the blocks' first), the blocks'
  StreamedNet(int64_t d, c10::Device dev) : blocks(make_blocks(3, d, dev)) {
    torch::manual_seed(4);
    head = torch::nn::Linear(d, 1);
    head->to(dev);
    for (auto& b : blocks) {
      for (auto& p : b->parameters()) streamed.push_back(p);
    }
    if (dev.is_cuda()) streamer = std::make_unique<offload::LayerStreamer>(blocks, dev);
    params = streamed;
    for (auto& p : head->parameters()) params.push_back(p);
  }
};

// A run of StreamedNet's: losses of each step, then the weights after flush().
using RunResult = std::pair<std::vector<double>, std::vector<at::Tensor>>;

// Trains StreamedNet(64) for 7 steps with the optimizer `make` gives, attached to a one-rank
// reducer (AdamW's lr 0.01 and weight decay 0.1 in `oo`); `check(net, reducer, step,
// stepped)` runs after each backward (stepped false) and after each update (true).
using MakeOptimizer = std::function<std::unique_ptr<engine::Optimizer>(StreamedNet&, c10::Device)>;
using CheckStep = std::function<void(StreamedNet&, engine::GradReducer&, int64_t, bool)>;
RunResult train_streamed(dist::Communicator& comm, c10::Device dev, const MakeOptimizer& make, bool defer_waits,
                         const CheckStep& check) {
  const int64_t d = 64, steps = 7;
  StreamedNet net(d, dev);
  engine::GradReducer reducer(net.params, comm);
  auto opt = make(net, dev);
  opt->attach(reducer);
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step);
    at::Tensor x = at::randn({16, d}).to(dev), y = at::randn({16, 1}).to(dev);
    at::Tensor out = run(net.blocks, net.streamer.get(), x.requires_grad_(true), defer_waits && dev.is_cuda());
    at::Tensor loss = torch::mse_loss(net.head->forward(out), y);
    loss.backward();
    losses.push_back(loss.item<double>());
    check(net, reducer, step, false);
    opt->step();
    check(net, reducer, step, true);
    reducer.zero_grad();
  }
  opt->flush();
  std::vector<at::Tensor> weights;
  for (auto& p : net.params) weights.push_back(p.detach().cpu().clone());
  return {losses, weights};
}

void expect_same_run(const RunResult& gpu, const RunResult& cpu) {
  for (size_t s = 0; s < cpu.first.size(); ++s) {
    EXPECT_NEAR(gpu.first[s], cpu.first[s], 1e-4 * std::abs(cpu.first[s])) << "step " << s;
  }
  for (size_t i = 0; i < gpu.second.size(); ++i) {
    EXPECT_LT(testing_util::rel_error(gpu.second[i], cpu.second[i]), 1e-4) << "parameter " << i;
  }
}

engine::OptimizerOptions streamed_adamw() {
  engine::OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = 0.01;
  oo.weight_decay = 0.1;
  return oo;
}

engine::OffloadOptions delayed_after(int64_t steps) {
  engine::OffloadOptions off;
  off.delayed_update_after = steps;
  return off;
}

TEST(LayerOffloadDelayedGpu, TrainsAsOnTheCpuAndKeepsTheWeightsPageLocked) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const engine::OffloadOptions off = delayed_after(2);
  auto comm = testing_util::local_comm();
  const MakeOptimizer make = [&](StreamedNet& net, c10::Device dev) {
    return engine::make_layer_offload_optimizer(net.params, dev.is_cuda() ? std::vector<at::Tensor>{} : net.streamed,
                                                streamed_adamw(), *comm, off, dev);
  };
  const CheckStep page_locked = [](StreamedNet& net, engine::GradReducer&, int64_t step, bool stepped) {
    if (!stepped || net.streamer == nullptr) return;
    for (auto& p : net.streamed) EXPECT_TRUE(p.is_cpu() && p.is_pinned()) << "step " << step;
  };
  const RunResult cpu = train_streamed(*comm, c10::Device(c10::kCPU), make, false, page_locked);
  // The host waits per block, and left to backward's end (what the trainer does here).
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "waits at backward's end" : "waits per block");
    expect_same_run(train_streamed(*comm, c10::Device(c10::kCUDA, 0), make, defer, page_locked), cpu);
  }
}

// --offload=all's delayed update on a GPU: the head's optimizer offload streams its
// gradients, while the streamed blocks' gradients (pinned host copies, waited for once at
// backward's end) stay autograd's own beside it and are taken by their update; the run equals
// the CPU's, where one delayed OffloadedOptimizer updates every parameter.
TEST(AllOffloadDelayedGpu, TheBlocksTakeTheirGradientsBesideTheStream) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const engine::OffloadOptions off = delayed_after(2);
  auto comm = testing_util::local_comm();
  const MakeOptimizer make = [&](StreamedNet& net, c10::Device dev) {
    return engine::make_offload_optimizer(net.params, streamed_adamw(), *comm, off, dev);
  };
  const CheckStep taken = [&](StreamedNet& net, engine::GradReducer& reducer, int64_t step, bool stepped) {
    const bool gpu = net.streamer != nullptr;
    if (step == 0 && !stepped) {
      EXPECT_TRUE(reducer.keeps_autograd_gradients(net.streamed));
      EXPECT_EQ(reducer.keeps_autograd_gradients(), !gpu) << "the head's gradients are streamed on a GPU";
    }
    if (!gpu) return;
    for (auto& p : net.streamed) {
      // Before the first zero_grad every gradient is its bucket's view (GradReducer).
      if (!stepped && step >= 1) {
        ASSERT_TRUE(p.grad().defined()) << "step " << step;
        EXPECT_TRUE(p.grad().is_pinned() && !p.grad().is_view()) << "step " << step << ": not the adopted copy";
      } else if (step >= off.delayed_update_after) {
        EXPECT_FALSE(p.grad().defined()) << "step " << step << ": not taken by the delayed update";
      }
    }
  };
  expect_same_run(train_streamed(*comm, c10::Device(c10::kCUDA, 0), make, true, taken),
                  train_streamed(*comm, c10::Device(c10::kCPU), make, true, taken));
}

// The gradient norm of a layer-offload run: host gradients (float32 and float64, one not
// contiguous) beside device ones, against float64 on the CPU; a non-finite host value shows.
// (A chunked float64 host kernel tried here made the gpt124m step 2.4x slower on the H100
// machine than ATen's norm: docs/BENCHMARKS.md.)
TEST(GradNormGpu, HostAndDeviceGradientsMatchFloat64) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  torch::manual_seed(5);
  std::vector<at::Tensor> grads{at::randn({1000, 300}).to(dev), at::randn({300001}), at::randn({77}, at::kDouble),
                                at::randn({40, 30}).t(), at::randn({5}).to(dev)};
  at::Tensor sq = at::zeros({}, at::kDouble);
  for (const at::Tensor& g : grads) sq += g.to(at::kCPU, at::kDouble).pow(2).sum();
  const at::Tensor got = engine::grad_norm(grads);
  EXPECT_EQ(got.device(), dev);
  EXPECT_LT(std::abs(got.item<double>() / sq.sqrt().item<double>() - 1), 1e-6);
  grads[1][17] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(engine::grad_norm(grads).item<double>()));
}

}  // namespace
}  // namespace dtrain
