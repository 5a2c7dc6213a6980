// Layer offload's delayed update (make_layer_offload_optimizer): the streamed parameters (here
// the middle Linear of offload_net, named streamed as the trainer names a model's blocks) are
// updated by the CPU kernels one step late, the others by make_optimizer() as the step ends.
// Checked against a hand-driven reference (ATen's optimizer over master copies, the streamed
// part's result shown one step late, the rest at once), and its checkpoint state against
// make_optimizer()'s names and a resumed run. Also --offload=all's host part
// (make_offload_optimizer with the streamed blocks listed): a float32 master for bfloat16
// weights, and no gradient stream of its own beside the device part's.
#include <gtest/gtest.h>

#include <set>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/train/trainer.h"
#include "dtrain/offload/layer_offload.h"
#include "offload_engine_cases.h"

namespace dtrain::engine::offload_engine_cases {
namespace {


OffloadOptions delayed_after(int64_t warmup) {
  OffloadOptions o;
  o.delayed_update_after = warmup;
  return o;
}

// Parameters 2 and 3 (the second Linear's weight and bias) are the streamed ones.
std::vector<at::Tensor> streamed_of(torch::nn::Sequential& net) {
  std::vector<at::Tensor> p = net->parameters();
  return {p[2], p[3]};
}

struct LayersRun {
  torch::nn::Sequential net = offload_net(0, kCpu);
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<Optimizer> opt;

  LayersRun(dist::Communicator& comm, const OptimizerOptions& oo, int64_t warmup) {
    reducer = std::make_unique<GradReducer>(net->parameters(), comm, small_buckets());
    opt = make_layer_offload_optimizer(net->parameters(), streamed_of(net), oo, comm, delayed_after(warmup), kCpu);
    opt->attach(*reducer);
  }
  void step(int64_t step, dist::Communicator& comm) {
    auto [x, y] = offload_batch(step, 4, kCpu);
    torch::mse_loss(net->forward(x), y).backward();
    opt->step();
    reducer->zero_grad();
  }
};

OptimizerOptions adamw() {
  OptimizerOptions oo;
  oo.name = "adamw";
  oo.lr = 0.02;
  oo.weight_decay = 0.05;
  return oo;
}

TEST(OffloadLayersDelayed, StreamedPartOneStepLateTheRestAtOnce) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  const int64_t warmup = 2, steps = 8;
  LayersRun run(*comm, adamw(), warmup);
  torch::nn::Sequential ref = offload_net(0, kCpu);  // the weights the model should see
  std::vector<at::Tensor> master;
  for (auto& p : ref->parameters()) master.push_back(p.detach().clone().requires_grad_(true));
  auto ref_opt = make_optimizer(master, adamw());
  const std::set<size_t> streamed = {2, 3};
  for (int64_t step = 1; step <= steps; ++step) {
    auto [x, y] = offload_batch(step, 4, kCpu);
    ref->zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    auto ps = ref->parameters();
    for (size_t i = 0; i < ps.size(); ++i) master[i].mutable_grad() = ps[i].grad().clone();
    std::vector<at::Tensor> before;  // the streamed part's weights before this step's update
    for (size_t i = 0; i < ps.size(); ++i) before.push_back(master[i].detach().clone());
    ref_opt->step();
    {
      torch::NoGradGuard no_grad;
      // Warm-up steps show every update at once; later the streamed part's update of step t
      // becomes visible at step t + 1 (what it shows now is the update of the step before).
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(step > warmup && streamed.count(i) ? before[i] : master[i]);
    }
    run.step(step, *comm);
    EXPECT_LE(max_rel_error(run.net->parameters(), ref->parameters()), 1e-5) << "weights after step " << step;
  }
  // The delay is visible: the streamed weights are not the reference master's yet, the others are.
  EXPECT_GT(rel_error(run.net->parameters()[2], master[2].detach()), 1e-7);
  EXPECT_LE(rel_error(run.net->parameters()[0], master[0].detach()), 1e-5);
  run.opt->flush();
  for (size_t i = 0; i < master.size(); ++i) {
    EXPECT_LE(rel_error(run.net->parameters()[i], master[i].detach()), 1e-5) << "parameter " << i << " after flush";
  }
}

// The state holds both parts under make_optimizer()'s names (so checkpoints move between the
// two), and a run resumed from it (weights first, then the state) continues as the saving run.
TEST(OffloadLayersDelayed, StateHasTheReplicatedNamesAndResumes) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  LayersRun saving(*comm, adamw(), 1);
  for (int64_t step = 0; step < 5; ++step) saving.step(step, *comm);
  saving.opt->flush();  // as the trainer does before it saves
  std::vector<std::pair<std::string, at::Tensor>> state = saving.opt->state();
  std::set<std::string> names, want;
  for (auto& [name, t] : state) names.insert(name);
  torch::nn::Sequential plain_net = offload_net(0, kCpu);
  for (auto& [name, t] : make_optimizer(plain_net->parameters(), adamw())->state()) want.insert(name);
  EXPECT_EQ(names, want);

  LayersRun resumed(*comm, adamw(), 1);
  {
    torch::NoGradGuard no_grad;
    auto from = saving.net->parameters(), to = resumed.net->parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  std::vector<std::pair<std::string, at::Tensor>> copied;
  for (auto& [name, t] : state) copied.emplace_back(name, t.clone());
  resumed.opt->load_state(copied);
  for (int64_t step = 5; step < 9; ++step) {
    saving.step(step, *comm);
    resumed.step(step, *comm);
  }
  EXPECT_EQ(max_rel_error(resumed.net->parameters(), saving.net->parameters()), 0.0);
  // A state without the streamed part's moments is refused, naming what is missing.
  std::vector<std::pair<std::string, at::Tensor>> partial;
  for (auto& [name, t] : state) {
    if (name != "2.exp_avg") partial.emplace_back(name, t);
  }
  EXPECT_TRUE(testing_util::throws_error_with([&] { resumed.opt->load_state(partial); }, "exp_avg"));
}

TEST(OffloadLayersDelayed, RefusesWhatItCannotDo) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  torch::nn::Sequential net = offload_net(0, kCpu);
  EXPECT_TRUE(testing_util::throws_error_with(
      [&] { make_layer_offload_optimizer(net->parameters(), streamed_of(net), adamw(), *comm, OffloadOptions{}, kCpu); },
      "delayed_update_after"));
  EXPECT_TRUE(testing_util::throws_error_with(
      [&] { make_layer_offload_optimizer(net->parameters(), {}, adamw(), *comm, delayed_after(1), kCpu); },
      "no parameter is streamed"));
}

// The trainer of a ModelSpec lists every block parameter as streamed, frozen ones too; the
// reducer holds only the trained ones. A frozen weight in a block stays as it was, and the
// others train (the end-of-backward wait for the streamed gradients asks the reducer about the
// parameters it holds only).
TEST(OffloadLayersDelayed, ASpecTrainerWithAFrozenBlockWeightTrainsTheRest) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm(), tp = testing_util::local_comm();
  GptOptions o;
  o.vocab = 97, o.d_model = 32, o.heads = 4, o.ff = 64, o.seq_len = 16, o.layers = 2;
  torch::manual_seed(5);
  auto gpt = std::make_shared<GptImpl>(o, *tp);
  ModelSpec spec = gpt_spec(gpt);
  std::vector<at::Tensor> block = spec.blocks->block(0)->parameters();
  ASSERT_GE(block.size(), 2u);
  block[0].requires_grad_(false);
  const at::Tensor frozen = block[0].detach().clone(), trained = block[1].detach().clone();
  dist::Mesh mesh(*comm, 1);
  TrainerOptions to;
  to.optimizer.name = "adamw";
  to.optimizer.lr = 0.01;
  to.offload_layers = true;
  to.offload.delayed_update_after = 1;
  Trainer trainer(std::move(spec), mesh, kCpu, to);
  for (int64_t step = 0; step < 4; ++step) {
    Batch b;
    b.fields = {at::randint(o.vocab, {4, o.seq_len + 1}, at::kLong)};
    trainer.step(b);
  }
  trainer.flush_updates();
  EXPECT_TRUE(at::equal(block[0].detach(), frozen));
  EXPECT_GT(rel_error(block[1].detach(), trained), 1e-6);
}

TEST(OffloadAll, Bf16StreamedBlocksKeepAFloat32Master) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  expect_bf16_host_part_keeps_a_master(*comm);
}

// --offload_stream_gradients=on streams the device part's gradients; the host part (delayed
// here, an OffloadedOptimizer of its own) reads its parameters' own and must not take the
// reducer's one observer from it: the run trains as with streaming off.
TEST(OffloadAll, TheHostPartLeavesTheGradientStreamToTheDevicePart) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  auto train = [&](const std::string& stream) {
    torch::nn::Sequential net = offload_net(0, kCpu);
    std::vector<at::Tensor> params = net->parameters();
    ReducerOptions one_each;  // a bucket per parameter, as a GPU's buckets never mix the two devices
    one_each.first_bucket_bytes = one_each.bucket_bytes = 1;
    GradReducer reducer(params, *comm, one_each);
    OffloadOptions off = delayed_after(2);
    off.stream_gradients = stream;
    std::unique_ptr<Optimizer> opt = make_offload_optimizer(params, adamw(), *comm, off, kCpu, streamed_of(net));
    opt->attach(reducer);
    if (stream == "on") {  // the reducer's observer reads the device part's buckets, not the host part's
      EXPECT_FALSE(reducer.keeps_autograd_gradients({params[4], params[5]}));
      EXPECT_TRUE(reducer.keeps_autograd_gradients(streamed_of(net)));
    }
    for (int64_t step = 1; step <= 6; ++step) {
      auto [x, y] = offload_batch(step, 4, kCpu);
      torch::mse_loss(net->forward(x), y).backward();
      opt->step();
      reducer.zero_grad();
    }
    opt->flush();
    std::vector<at::Tensor> out;
    for (const at::Tensor& p : params) out.push_back(p.detach().clone());
    return out;
  };
  const std::vector<at::Tensor> off = train("off"), on = train("on");
  EXPECT_LE(max_rel_error(on, off), 1e-6);
  EXPECT_GT(rel_error(off[0], offload_net(0, kCpu)->parameters()[0]), 1e-3);  // it trained
}

// A parameter in two streamed layers (a tied weight) is refused when the streamer is built,
// naming both layers: the second layer's acquire would move it while the first still uses it.
TEST(OffloadLayers, AParameterInTwoStreamedLayersIsRefused) {
  auto a = std::make_shared<torch::nn::LinearImpl>(4, 4);
  auto b = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(4, 4));
  b->register_module("shared", a);
  const std::vector<std::shared_ptr<torch::nn::Module>> layers = {a, b};
  EXPECT_TRUE(testing_util::throws_error_with([&] { offload::LayerStreamer s(layers, c10::Device(c10::kCPU)); },
                                              "belongs to layers 0 and 1"));
  const std::vector<std::shared_ptr<torch::nn::Module>> apart = {a, std::make_shared<torch::nn::LinearImpl>(4, 4)};
  EXPECT_NO_THROW(offload::LayerStreamer(apart, c10::Device(c10::kCPU)));
}

}  // namespace
}  // namespace dtrain::engine::offload_engine_cases
