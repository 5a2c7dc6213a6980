// Run-level safety: settings every rank must share (one small collective; on a difference every
// rank fails with the same message naming each setting and the ranks' values), non-finite
// steps (stop or skip, agreed across ranks), and a resume that fails on one rank only.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <limits>
#include <optional>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/trainer.h"
#include "test_fs.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::world_comm;

std::string failure_of(dist::Communicator& comm, const Settings& settings) {
  try {
    agree_on_settings(comm, settings, "test settings");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Agreement, EqualSettingsPassInAnyOrder) {
  auto& comm = world_comm();
  Settings s = {{"steps", "10"}, {"lr", "0.001"}};
  if (comm.rank() % 2) std::swap(s[0], s[1]);
  EXPECT_EQ(failure_of(comm, s), "");
}

TEST(Agreement, EveryRankNamesEachDifferingSettingWithTheRanksValues) {
  auto& comm = world_comm();
  if (comm.size() == 1) GTEST_SKIP();
  const int r = comm.rank(), n = comm.size();
  Settings s = {{"lr", "0.001"}, {"batch_size", r == n - 1 ? "16" : "8"}, {"amp", r == 0 ? "bf16" : "off"}};
  if (r == 1) s.push_back({"tp", "2"});
  const std::string m = failure_of(comm, s);
  std::string ranks_below_last = n == 2 ? "rank 0 has 8" : "ranks 0";
  for (int k = 1; k < n - 1; ++k) ranks_below_last += "," + std::to_string(k);
  if (n > 2) ranks_below_last += " have 8";
  EXPECT_NE(m.find("the ranks were started with different settings (test settings)"), std::string::npos) << m;
  EXPECT_NE(m.find("batch_size: " + ranks_below_last + ", rank " + std::to_string(n - 1) + " has 16"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("amp: rank 0 has bf16, rank" + std::string(n > 2 ? "s " : " ")), std::string::npos) << m;
  EXPECT_NE(m.find(n == 2 ? "tp: rank 0 has (not set), rank 1 has 2" : "tp: ranks 0,2"), std::string::npos) << m;
  EXPECT_NE(m.find(n == 2 ? "rank 1 has 2" : " have (not set), rank 1 has 2"), std::string::npos) << m;
  EXPECT_EQ(m.find("lr:"), std::string::npos) << m;  // the same everywhere: not named
  // Every rank got the same message.
  at::Tensor length = at::tensor({static_cast<int64_t>(m.size()), -static_cast<int64_t>(m.size())}, at::kLong);
  comm.all_reduce(length, dist::ReduceOp::kMax)->wait();
  EXPECT_EQ(length[0].item<int64_t>(), -length[1].item<int64_t>());
}

TEST(Agreement, TrainersWithDifferentStepsRefuseBeforeAnyParameterMoves) {
  auto& comm = world_comm();
  if (comm.size() == 1) GTEST_SKIP();
  dist::Mesh mesh(comm, 1);
  torch::manual_seed(comm.rank());
  torch::nn::Linear model(4, 2);
  const at::Tensor before = model->weight.detach().clone();
  TrainerOptions o;
  o.steps = comm.rank() == 0 ? 10 : 12;
  o.progress = false;
  LossFn loss = [&](const Batch& b) { return model->forward(b.fields[0]).sum(); };
  try {
    Trainer trainer(*model, loss, mesh, c10::Device(c10::kCPU), o);
    ADD_FAILURE() << "different --steps accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps: rank 0 has 10, rank"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(model->weight, before));  // rank 0's weights were not broadcast
}

// Under ZeRO-3 a recomputed block gathers its unit again: ranks that recompute different blocks
// would issue different collectives, so the trainers refuse first, naming the setting.
TEST(Agreement, TrainersRecomputingDifferentBlocksRefuse) {
  auto& comm = world_comm();
  if (comm.size() == 1) GTEST_SKIP();
  dist::Mesh mesh(comm, 1);
  torch::nn::Linear model(4, 2);
  TrainerOptions o;
  o.progress = false;
  o.checkpoint_activations = true;
  o.checkpoint_blocks = comm.rank() == 0 ? 1 : 2;
  LossFn loss = [&](const Batch& b) { return model->forward(b.fields[0]).sum(); };
  try {
    Trainer trainer(*model, loss, mesh, c10::Device(c10::kCPU), o);
    ADD_FAILURE() << "different checkpoint_blocks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint_blocks: rank 0 has 1, rank"), std::string::npos) << e.what();
  }
}

// A data set with one poisoned sample (NaN): the global batch of step 3 holds it on one rank only.
struct PoisonedRun {
  torch::nn::Linear model{4, 1};
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<Trainer> trainer;
  // defer: TrainerOptions::defer_nonfinite_check (with `optimizer`, which drops an update on
  // the device: AdamW's fused kernels, Adagrad's fused or _foreach_ path); unset: the default
  // (the host check on the CPU, with SGD).
  explicit PoisonedRun(dist::Mesh& mesh, NonFinitePolicy policy, int max_skips = 10,
                       std::optional<bool> defer = std::nullopt, const std::string& optimizer = "adamw",
                       bool fused = true) {
    torch::manual_seed(0);
    model = torch::nn::Linear(4, 1);
    auto g = at::make_generator<at::CPUGeneratorImpl>(9);
    const int64_t rows = 8 * 2 * mesh.dp_size();  // 8 steps of 2 rows per rank
    at::Tensor x = at::randn({rows, 4}, g), y = at::randn({rows, 1}, g);
    x[2 * 2 * mesh.dp_size() + 1][0] = std::numeric_limits<float>::quiet_NaN();  // step 3, rank 0's 2nd row
    LoaderOptions lo;
    lo.batch_size = 2;
    lo.dp_rank = mesh.dp_rank();
    lo.dp_size = mesh.dp_size();
    lo.shuffle = false;
    lo.workers = 0;
    loader = std::make_unique<DataLoader>(std::make_shared<TensorDataset>(std::vector<at::Tensor>{x, y}), lo);
    TrainerOptions o;
    o.steps = 6;
    o.progress = false;
    o.on_nonfinite = policy;
    o.max_nonfinite_skips = max_skips;
    o.optimizer.lr = 0.01;
    o.log_every = 4;
    if (defer) {
      o.optimizer.name = optimizer;
      o.optimizer.fused = fused;
      o.defer_nonfinite_check = *defer;
    }
    LossFn loss = [this](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); };
    trainer = std::make_unique<Trainer>(*model, loss, mesh, c10::Device(c10::kCPU), o);
  }
};

TEST(NonFinite, StopEndsBeforeTheUpdateOnEveryRankNamingTheStep) {
  dist::Mesh mesh(world_comm(), 1);
  PoisonedRun run(mesh, NonFinitePolicy::kStop);
  // The NaN sample stops the run (error_of fails the test where it trains on).
  const std::string m = testing_util::error_of([&] { run.trainer->fit(*run.loader); });
  EXPECT_NE(m.find("step 3: the loss is "), std::string::npos) << m;
  EXPECT_NE(m.find("--on_nonfinite=stop"), std::string::npos) << m;
  EXPECT_EQ(run.trainer->current_step(), 2);
  EXPECT_TRUE(at::isfinite(run.model->weight).all().item<bool>());
}

TEST(NonFinite, SkipDropsThePoisonedStepOnEveryRankAndGoesOn) {
  dist::Mesh mesh(world_comm(), 1);
  PoisonedRun run(mesh, NonFinitePolicy::kSkip);
  StepMetrics last = run.trainer->fit(*run.loader);
  EXPECT_EQ(run.trainer->current_step(), 6);
  EXPECT_TRUE(at::isfinite(run.model->weight).all().item<bool>());
  EXPECT_EQ(last.extra.at("nonfinite_skips"), 1.0);
  at::Tensor w = run.model->weight.detach().clone();
  at::Tensor spread = at::stack({w.abs().max(), -w.abs().max()});
  world_comm().all_reduce(spread, dist::ReduceOp::kMax)->wait();
  EXPECT_EQ(spread[0].item<float>(), -spread[1].item<float>());  // every rank holds the same weights
}

TEST(NonFinite, TooManySkipsInARowStop) {
  dist::Mesh mesh(world_comm(), 1);
  PoisonedRun run(mesh, NonFinitePolicy::kSkip, /*max_skips=*/1);
  // One poisoned step is allowed; poison the model itself so every later step is non-finite.
  run.trainer->step(run.loader->next());
  {
    torch::NoGradGuard no_grad;
    run.model->bias.fill_(std::numeric_limits<float>::infinity());
  }
  EXPECT_NO_THROW(run.trainer->step(run.loader->next()));  // skipped (1 in a row)
  try {
    run.trainer->step(run.loader->next());
    ADD_FAILURE() << "a second non-finite step in a row was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 steps in a row were not finite (--on_nonfinite=skip allows 1)"),
              std::string::npos)
        << e.what();
  }
}

// The deferred watch (no host read per step): the poisoned step's update is dropped on the
// device by the fused AdamW kernel, and the policy applies at the next read of the loss.
TEST(NonFinite, DeferredStopDropsTheUpdateAndStopsAtTheNextLogNamingTheStep) {
  dist::Mesh mesh(world_comm(), 1);
  PoisonedRun deferred(mesh, NonFinitePolicy::kStop, 10, true);
  const std::string m = testing_util::error_of([&] { deferred.trainer->fit(*deferred.loader); });
  EXPECT_NE(m.find("step 3: the loss is "), std::string::npos) << m;
  EXPECT_NE(m.find("found at the log of step 4"), std::string::npos) << m;
  EXPECT_NE(m.find("--on_nonfinite=stop"), std::string::npos) << m;
  EXPECT_EQ(deferred.trainer->current_step(), 4);
  // Steps 1, 2 and 4 updated the weights, step 3 did not: as the host-checked skip does.
  PoisonedRun checked(mesh, NonFinitePolicy::kSkip, 10, false);
  for (int s = 0; s < 4; ++s) checked.trainer->step(checked.loader->next());
  EXPECT_TRUE(at::isfinite(deferred.model->weight).all().item<bool>());
  EXPECT_TRUE(at::equal(deferred.model->weight, checked.model->weight));
  EXPECT_TRUE(at::equal(deferred.model->bias, checked.model->bias));
  EXPECT_FALSE(at::equal(deferred.model->weight, PoisonedRun(mesh, NonFinitePolicy::kSkip).model->weight));
}

TEST(NonFinite, DeferredSkipTrainsAsTheHostCheckedSkip) {
  dist::Mesh mesh(world_comm(), 1);
  for (const auto& [optimizer, fused] : std::vector<std::pair<std::string, bool>>{
           {"adamw", true}, {"adagrad", true}, {"adagrad", false}}) {
    SCOPED_TRACE(optimizer + (fused ? " fused" : " foreach"));
    PoisonedRun deferred(mesh, NonFinitePolicy::kSkip, 10, true, optimizer, fused);
    PoisonedRun checked(mesh, NonFinitePolicy::kSkip, 10, false, optimizer, fused);  // checked on the host
    StepMetrics a = deferred.trainer->fit(*deferred.loader);
    StepMetrics b = checked.trainer->fit(*checked.loader);
    EXPECT_EQ(a.extra.at("nonfinite_skips"), 1.0);
    EXPECT_EQ(b.extra.at("nonfinite_skips"), 1.0);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_TRUE(at::isfinite(deferred.model->weight).all().item<bool>());
    EXPECT_TRUE(at::equal(deferred.model->weight, checked.model->weight));
    // The optimizer's step counts leave the dropped update out, as skip_step() does.
    for (const auto& [name, t] : deferred.trainer->optimizer().state()) {
      if (name.size() > 5 && name.substr(name.size() - 5) == ".step") EXPECT_EQ(t.item<double>(), 5.0) << name;
    }
  }
}

TEST(NonFinite, DeferredTooManySkipsInARowStopAtTheNextRead) {
  dist::Mesh mesh(world_comm(), 1);
  PoisonedRun run(mesh, NonFinitePolicy::kSkip, /*max_skips=*/1, true);
  run.trainer->step(run.loader->next());
  {
    torch::NoGradGuard no_grad;
    run.model->bias.fill_(std::numeric_limits<float>::infinity());
  }
  EXPECT_NO_THROW(run.trainer->step(run.loader->next()));
  EXPECT_NO_THROW(run.trainer->step(run.loader->next()));  // no host read: nothing is known yet
  try {
    (void)run.trainer->last_loss();
    ADD_FAILURE() << "two non-finite steps in a row were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 steps in a row were not finite (--on_nonfinite=skip allows 1)"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("step 2: the loss is "), std::string::npos) << e.what();
  }
}

// The POSIX file system, except that this rank's own rank files cannot be read (a node whose
// copy of the checkpoint is damaged or unreachable).
class UnreadableRankFiles final : public testing_util::ForwardingFileSystem {
 public:
  explicit UnreadableRankFiles(int rank) : suffix_(".rank-" + std::to_string(rank) + ".pt") {}
  std::unique_ptr<ReadableFile> new_readable_file(const std::string& p) override {
    if (p.size() >= suffix_.size() && p.compare(p.size() - suffix_.size(), suffix_.size(), suffix_) == 0) {
      throw Error("injected: cannot read " + p);
    }
    return fs().new_readable_file(p);
  }

 private:
  std::string suffix_;
};

TEST(ResumeFailure, OnOneRankOnlyEveryRankFailsWithTheSameMessage) {
  auto& comm = world_comm();
  if (comm.size() == 1) GTEST_SKIP();
  dist::Mesh mesh(comm, 1);
  // A shared directory: rank 0 picks the name, everyone uses it.
  at::Tensor id = at::zeros({1}, at::kLong);
  if (comm.rank() == 0) id.fill_(static_cast<int64_t>(::getpid()));
  comm.broadcast(id, 0)->wait();
  const std::string dir = "/tmp/dtrain_resume_fail_" + std::to_string(id.item<int64_t>());
  torch::nn::Linear model(4, 1);
  LossFn loss = [&](const Batch& b) { return model->forward(b.fields[0]).sum(); };
  TrainerOptions o;
  o.progress = false;
  o.save_dir = dir;
  {
    Trainer saver(*model, loss, mesh, c10::Device(c10::kCPU), o);
    Batch batch;
    batch.fields = {at::ones({2, 4})};
    saver.step(batch);
    saver.save_checkpoint(nullptr);
  }
  UnreadableRankFiles broken(comm.size() - 1);
  o.resume = ResumeMode::kYes;
  if (comm.rank() == comm.size() - 1) o.checkpoint_fs = &broken;
  std::string message;
  try {
    Trainer resumed(*model, loss, mesh, c10::Device(c10::kCPU), o);
    resumed.resume_checkpoint(nullptr, /*required=*/true);
  } catch (const Error& e) {
    message = e.what();
  }
  const std::string last = std::to_string(comm.size() - 1);
  EXPECT_NE(message.find("it failed on rank(s) " + last + " (rank " + last + ": cannot load checkpoint rank file "),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("injected: cannot read "), std::string::npos) << message;
  std::vector<std::string> all = gather_texts(comm, message);
  for (const std::string& m : all) EXPECT_EQ(m, all[0]);  // word for word on every rank
  comm.barrier()->wait();
  if (comm.rank() == 0) (void)!std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace dtrain::engine
