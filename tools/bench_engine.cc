// dtrain-bench engine: the cost of dtrain's Trainer step at world size 1 against a
// hand-written libtorch loop on the same model, batch and data.
//   hand_torch_optim : forward, backward, torch::optim::AdamW step, zero_grad
//   hand_fused       : the same loop with dtrain's fused optimizer (engine/optim: optim.h)
//   trainer          : engine::Trainer::step (reducer, fused optimizer, loss scaler, OOM guard)
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "bench.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/train/trainer.h"

DEFINE_int64(engine_width, 1024, "engine: MLP width");
DEFINE_int32(engine_depth, 3, "engine: MLP hidden layers");
DEFINE_int64(engine_batch, 64, "engine: batch rows");
DEFINE_int32(engine_steps, 50, "engine: timed steps per variant");

namespace dtrain::bench {
namespace {

torch::nn::Sequential make_mlp(c10::Device device) {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  int64_t in = FLAGS_engine_width;
  for (int d = 0; d < FLAGS_engine_depth; ++d) {
    m->push_back(torch::nn::Linear(in, FLAGS_engine_width));
    m->push_back(torch::nn::ReLU());
  }
  m->push_back(torch::nn::Linear(FLAGS_engine_width, 10));
  m->to(device);
  return m;
}

void sync(c10::Device device) {
  if (device.is_cuda()) at::zeros({1}, at::TensorOptions().device(device)).cpu();
}

template <typename Step>
double time_steps(c10::Device device, Step&& step) {
  for (int i = 0; i < 5; ++i) step();  // warm-up
  sync(device);
  std::vector<double> ms;
  for (int i = 0; i < FLAGS_engine_steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    sync(device);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(ms);
}

}  // namespace

int run_engine(BenchContext& ctx) {
  const c10::Device dev = ctx.device;
  at::Tensor x = at::randn({FLAGS_engine_batch, FLAGS_engine_width}, at::TensorOptions().device(dev));
  at::Tensor y = at::randint(10, {FLAGS_engine_batch}, at::TensorOptions().dtype(at::kLong).device(dev));
  auto loss_of = [&](torch::nn::Sequential& m) { return torch::nn::functional::cross_entropy(m->forward(x), y); };
  const double lr = 1e-4;

  auto m1 = make_mlp(dev);
  torch::optim::AdamW adamw(m1->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0));
  double hand = time_steps(dev, [&] {
    adamw.zero_grad();
    loss_of(m1).backward();
    adamw.step();
  });

  auto m2 = make_mlp(dev);
  engine::OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = lr;
  auto fused = engine::make_optimizer(m2->parameters(), oo);
  double hand_fused = time_steps(dev, [&] {
    loss_of(m2).backward();
    fused->step();
    fused->zero_grad();
  });

  auto m3 = make_mlp(dev);
  dist::Mesh mesh(*ctx.comm, 1);
  engine::TrainerOptions to;
  to.optimizer = oo;
  to.progress = false;
  to.report_grad_norm = false;
  engine::Trainer trainer(*m3, [&](const engine::Batch& b) {
    return torch::nn::functional::cross_entropy(m3->forward(b.fields[0]), b.fields[1]);
  }, mesh, dev, to);
  engine::Batch batch;
  batch.fields = {x, y};
  double with_trainer = time_steps(dev, [&] { trainer.step(batch); });

  const double params = static_cast<double>(FLAGS_engine_depth) * FLAGS_engine_width * FLAGS_engine_width;
  for (auto [impl, ms] : {std::pair<const char*, double>{"hand_torch_optim", hand},
                          {"hand_fused", hand_fused}, {"trainer", with_trainer}}) {
    nlohmann::json j = {{"bench", "engine"}, {"impl", impl}, {"device", dev.str()},
                        {"world", ctx.comm->size()}, {"width", FLAGS_engine_width},
                        {"depth", FLAGS_engine_depth}, {"batch", FLAGS_engine_batch},
                        {"params_approx", params}, {"ms", ms},
                        {"vs_hand_torch_optim", ms / hand}, {"vs_hand_fused", ms / hand_fused}};
    if (ctx.comm->rank() == 0) std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace dtrain::bench
