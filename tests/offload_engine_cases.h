// Cases of the engine's optimizer offload with the reducer, on any device, shared by the MPI
// tests (CPU) and the GPU tests (CUDA: copy streams, pinned buffers, events). Gradients
// streamed to the host bucket by bucket during backward give the same update as reading .grad
// after backward; gradients reduced only to their owners update as all-reduced ones; the
// one-step-delayed update trains on exactly the weights a hand-driven reference optimizer
// (ATen's kernels, not the CPU ones) gives when its update is applied one step late.
#pragma once

#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "test_util.h"

namespace dtrain::engine::offload_engine_cases {

// The host device, for the CPU tests of these cases (one definition: the test binaries compile
// their files in unity batches).
inline const c10::Device kCpu(c10::kCPU);

using testing_util::rel_error;

// Odd sizes, so the shards of 2 or 4 ranks cut through parameters (223 elements).
inline torch::nn::Sequential offload_net(int64_t seed, c10::Device device) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(8, 13), torch::nn::Tanh(), torch::nn::Linear(13, 7),
                            torch::nn::Tanh(), torch::nn::Linear(7, 1));
  net->to(device);
  return net;
}

inline std::pair<at::Tensor, at::Tensor> offload_batch(int64_t step, int64_t rows, c10::Device device) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  at::Tensor x = at::randn({rows, 8}, g), y = at::randn({rows, 1}, g);
  return {x.to(device), y.to(device)};
}

inline at::Tensor offload_rows(const at::Tensor& t, int rank, int size) {
  const int64_t b = t.size(0) / size;
  return t.narrow(0, rank * b, b);
}

// Several buckets of a few parameters each.
inline ReducerOptions small_buckets() {
  ReducerOptions o;
  o.first_bucket_bytes = 128;
  o.bucket_bytes = 256;
  return o;
}

// The AdamW the streaming cases update with (on the CPU and on the GPU): lr 0.01, weight decay 0.1.
inline OptimizerOptions streaming_adamw() {
  OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = 0.01;
  oo.weight_decay = 0.1;
  return oo;
}

inline std::vector<at::Tensor> flat_params(torch::nn::Module& m) { return m.parameters(); }

inline double max_rel_error(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, rel_error(a[i], b[i]));
  return worst;
}

// One data-parallel training run of offload_net(0) with optimizer offload.
struct Run {
  c10::Device device;
  torch::nn::Sequential net;
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<OffloadedOptimizer> opt;

  Run(dist::Communicator& comm, c10::Device dev, const OptimizerOptions& oo, OffloadOptions off, ReducerOptions ro)
      : device(dev), net(offload_net(0, dev)) {
    reducer = std::make_unique<GradReducer>(net->parameters(), comm, ro);
    opt = std::make_unique<OffloadedOptimizer>(net->parameters(), oo, comm, off);
    opt->attach(*reducer);
  }
  void backward(int64_t step, int64_t rows, dist::Communicator& comm) {
    auto [x, y] = offload_batch(step, rows, device);
    torch::mse_loss(net->forward(offload_rows(x, comm.rank(), comm.size())),
                    offload_rows(y, comm.rank(), comm.size()))
        .backward();
  }
};

inline void expect_streaming_matches_reading_grad(dist::Communicator& comm, c10::Device device, OptimizerOptions oo,
                                                  ReducerOptions ro, double factor) {
  const int64_t rows = 4 * comm.size();
  OffloadOptions on, off;
  on.stream_gradients = "on";
  off.stream_gradients = "off";
  Run streamed(comm, device, oo, on, ro), read(comm, device, oo, off, ro);
  ASSERT_TRUE(streamed.opt->streams_gradients());
  ASSERT_FALSE(read.opt->streams_gradients());
  for (int64_t step = 0; step < 6; ++step) {
    streamed.backward(step, rows, comm);
    read.backward(step, rows, comm);
    // As the trainer's unscaling / clipping: a multiplier the update applies.
    at::Tensor multiplier = factor != 1.0 ? torch::tensor(factor, torch::kFloat) : at::Tensor();
    streamed.opt->step(multiplier);
    read.opt->step(multiplier);
    streamed.reducer->zero_grad();
    read.reducer->zero_grad();
  }
  // The same values in, the same kernel: equal up to the factor's rounding order.
  EXPECT_LE(max_rel_error(flat_params(*streamed.net), flat_params(*read.net)), factor == 1.0 ? 0.0 : 1e-5);
  EXPECT_GT(rel_error(flat_params(*streamed.net)[0], offload_net(0, device)->parameters()[0]), 1e-3);  // it trained
}

// Gradients reduced only to the rank whose shard holds them (what the trainer does with
// data parallelism) update the weights as all-reduced gradients do.
inline void expect_owner_reduce_matches_all_reduce(dist::Communicator& comm, c10::Device device,
                                                   const std::string& stream) {
  const int64_t rows = 4 * comm.size();
  OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = 0.01;
  OffloadOptions off;
  off.stream_gradients = stream;
  ReducerOptions owners = small_buckets();
  int64_t numel = 0;
  for (auto& p : offload_net(0, device)->parameters()) numel += p.numel();
  for (int r = 0; r < comm.size(); ++r) {
    FlatRange s = shard_range(numel, comm.size(), r);
    owners.owned.emplace_back(s.begin, s.end);
  }
  Run owned(comm, device, oo, off, owners), all(comm, device, oo, off, small_buckets());
  for (int64_t step = 0; step < 6; ++step) {
    owned.backward(step, rows, comm);
    all.backward(step, rows, comm);
    owned.opt->step();
    all.opt->step();
    owned.reducer->zero_grad();
    all.reducer->zero_grad();
  }
  EXPECT_LE(max_rel_error(flat_params(*owned.net), flat_params(*all.net)), 1e-6);
}

// Delayed update against a reference: ATen's optimizer over master copies, fed the gradient
// of the whole global batch at the weights the model had, its result made visible to the
// model one step late (after `warmup` ordinary steps).
inline void expect_delayed_update_matches_reference(dist::Communicator& comm, c10::Device device,
                                                    const std::string& stream,
                                                    const ReducerOptions& ro = small_buckets()) {
  const int64_t rows = 4 * comm.size();
  const int64_t warmup = 2, steps = 8;
  OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = 0.02;
  oo.weight_decay = 0.05;
  OffloadOptions off;
  off.stream_gradients = stream;
  off.delayed_update_after = warmup;
  Run run(comm, device, oo, off, ro);

  torch::nn::Sequential ref = offload_net(0, device);  // the weights the model should see
  std::vector<at::Tensor> master;
  for (auto& p : ref->parameters()) master.push_back(p.detach().clone().requires_grad_(true));
  auto ref_opt = make_optimizer(master, oo);
  auto publish = [&] {
    torch::NoGradGuard no_grad;
    auto ps = ref->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(master[i]);
  };
  for (int64_t step = 1; step <= steps; ++step) {
    auto [x, y] = offload_batch(step, rows, device);
    ref->zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    auto ps = ref->parameters();
    for (size_t i = 0; i < ps.size(); ++i) master[i].mutable_grad() = ps[i].grad().clone();
    if (step <= warmup) {
      ref_opt->step();
      publish();
    } else {
      publish();  // the previous step's update becomes visible now
      ref_opt->step();
    }
    run.backward(step, rows, comm);
    run.opt->step();
    run.reducer->zero_grad();
    EXPECT_EQ(run.opt->update_in_flight(), step > warmup) << "step " << step;
    EXPECT_LE(max_rel_error(flat_params(*run.net), ref->parameters()), 1e-5) << "weights after step " << step;
  }
  // The state already holds the update in flight; the model does after flush().
  at::Tensor saved_master;
  EXPECT_TRUE(run.opt->state().empty());  // nothing replicated
  for (auto& [name, t] : run.opt->shard_state().tensors) {
    if (name == "master") saved_master = t;
  }
  std::vector<at::Tensor> flat_master;
  for (auto& m : master) flat_master.push_back(m.detach().reshape({-1}));
  at::Tensor whole = at::cat(flat_master);
  ASSERT_TRUE(saved_master.defined());
  std::vector<at::Tensor> mine;  // this rank's ranges of the master (one, or none)
  const ShardLayout layout = *run.opt->shard_layout();
  for (const FlatRange& r : layout.ranges) mine.push_back(whole.narrow(0, r.begin, r.size()));
  if (mine.empty()) {
    EXPECT_EQ(saved_master.numel(), 0);
  } else {
    EXPECT_LE(rel_error(saved_master, at::cat(mine)), 1e-5);
  }
  EXPECT_GT(rel_error(flat_params(*run.net)[0], master[0].detach()), 1e-7);  // not published yet
  run.opt->flush();
  EXPECT_FALSE(run.opt->update_in_flight());
  publish();
  EXPECT_LE(max_rel_error(flat_params(*run.net), ref->parameters()), 1e-5) << "after flush";
}

// --offload=all with bfloat16 weights (--param_dtype=bf16): the streamed blocks' optimizer of
// their own (make_offload_optimizer's host part; `streamed` gives the CPU the GPU's split)
// keeps a float32 master, as the device part's does. Each step's bfloat16 weights against the
// rule written out in float64 on the same reduced gradients (AdamW on a float64 master, the
// weights its rounding). The learning rate is below half a bfloat16 step of most weights: an
// update of the bfloat16 weights themselves (make_optimizer()'s, no master) leaves them where
// they were, and the check that they moved fails. On more ranks every rank's copy is the same.
inline void expect_bf16_host_part_keeps_a_master(dist::Communicator& comm) {
  const c10::Device cpu(c10::kCPU);
  const double lr = 3e-4, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  const int64_t rows = 4 * comm.size(), steps = 20;
  torch::nn::Sequential net = offload_net(0, cpu);
  net->to(at::kBFloat16);
  std::vector<at::Tensor> params = net->parameters();
  const std::vector<at::Tensor> streamed = {params[0], params[1], params[2], params[3]};
  OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = lr;
  oo.weight_decay = wd;
  GradReducer reducer(params, comm, small_buckets());
  std::unique_ptr<Optimizer> opt = make_offload_optimizer(params, oo, comm, OffloadOptions{}, cpu, streamed);
  opt->attach(reducer);
  std::vector<at::Tensor> initial, master, m, v;
  for (const at::Tensor& p : params) {
    initial.push_back(p.detach().clone());
    master.push_back(p.detach().to(at::kDouble));
    m.push_back(at::zeros_like(master.back()));
    v.push_back(at::zeros_like(master.back()));
  }
  for (int64_t t = 1; t <= steps; ++t) {
    auto [x, y] = offload_batch(t, rows, cpu);
    torch::mse_loss(net->forward(offload_rows(x, comm.rank(), comm.size()).to(at::kBFloat16)),
                    offload_rows(y, comm.rank(), comm.size()).to(at::kBFloat16))
        .backward();
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < params.size(); ++i) {  // the rule on the gradients the reducer averaged
      const at::Tensor g = params[i].grad().to(at::kDouble);
      m[i].mul_(b1).add_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      master[i].mul_(1 - lr * wd).sub_(lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps));
    }
    opt->step();
    reducer.zero_grad();
  }
  int64_t differ = 0, moved = 0, streamed_numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].scalar_type(), at::kBFloat16) << "parameter " << i;
    const at::Tensor got = params[i].detach().to(at::kDouble), want = master[i].to(at::kBFloat16).to(at::kDouble);
    const at::Tensor ulp = want.abs().clamp_min(1e-30) * std::ldexp(1.0, -7);  // one bfloat16 step, about
    EXPECT_TRUE((got - want).abs().le(ulp * 1.01).all().item<bool>()) << "parameter " << i;
    differ += got.ne(want).sum().item<int64_t>();
    if (i < streamed.size()) {
      moved += params[i].detach().ne(initial[i]).sum().item<int64_t>();
      streamed_numel += params[i].numel();
    }
  }
  EXPECT_LE(differ, 2) << differ << " bfloat16 weights differ from the float64 master's rounding";
  EXPECT_GT(moved, streamed_numel / 2) << "only " << moved << " of the streamed blocks' " << streamed_numel
                                       << " bfloat16 weights moved: updated without a float32 master";
  // Every rank holds the same weights (the host part's update is each rank's whole copy).
  for (const at::Tensor& p : params) {
    at::Tensor mine = p.detach().to(at::kFloat).reshape({-1}).contiguous(), lo = mine.clone(), hi = mine.clone();
    comm.all_reduce(lo, dist::ReduceOp::kMin)->wait();
    comm.all_reduce(hi, dist::ReduceOp::kMax)->wait();
    EXPECT_TRUE(at::equal(lo, hi)) << "the ranks' weights differ";
  }
}

}  // namespace dtrain::engine::offload_engine_cases
