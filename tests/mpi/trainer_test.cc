// The trainer on several ranks: OOM back-off keeps ranks in step and equals a run that used
// the smaller micro-batches from the start; metrics and evaluation.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"
#include "zero3_oom_cases.h"

namespace dtrain::engine {
namespace {

using testing_util::world_comm;

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
  m->to(torch::kFloat64);
  return m;
}

Batch batch_for(int64_t step, int rank, int64_t rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(step * 100 + rank);
  Batch b;
  b.fields = {at::randn({rows, 6}, g, at::kDouble), at::randn({rows, 1}, g, at::kDouble)};
  return b;
}

TrainerOptions base_options() {
  TrainerOptions o;
  o.steps = 4;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.01;
  o.progress = false;
  return o;
}

std::vector<at::Tensor> run_steps(int accum, int fail_rank, int64_t fail_above_rows, std::vector<int>* accum_seen,
                                  const std::string& shard = "none") {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto model = make_model();
  TrainerOptions o = base_options();
  o.accum_steps = accum;
  o.shard = shard;
  LossFn loss = [&](const Batch& b) {
    if (comm.rank() == fail_rank && b.size() > fail_above_rows) {
      // What the CUDA caching allocator throws when it cannot allocate.
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated for a test)");
    }
    return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]);
  };
  Trainer trainer(*model, loss, mesh, c10::Device(c10::kCPU), o);
  for (int64_t s = 0; s < o.steps; ++s) {
    StepResult r = trainer.step(batch_for(s, comm.rank(), 16));
    if (accum_seen) accum_seen->push_back(trainer.accum_steps());
    if (s == 0 && fail_rank >= 0) EXPECT_GT(r.oom_retries, 0);
  }
  std::vector<at::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  return params;
}

TEST(Trainer, OutOfMemoryOnOneRankBacksOffEveryRankAndMatchesTheSmallerMicroBatches) {
  auto& comm = world_comm();
  // Reference: micro-batches of 4 rows (accumulation 4) from the start, no failure.
  auto want = run_steps(4, -1, 0, nullptr);
  // The last rank cannot fit more than 4 rows: 16 -> 8 -> 4, two back-offs in step 1. Also
  // under ZeRO-1 and ZeRO-2, whose abandoned steps must leave the partitioned state and the
  // released gradient buckets consistent.
  for (const char* shard : {"none", "optimizer", "gradients"}) {
    SCOPED_TRACE(std::string("--shard=") + shard);
    std::vector<int> seen;
    auto got = run_steps(1, comm.size() - 1, 4, &seen, shard);
    ASSERT_EQ(seen.size(), 4u);
    for (int a : seen) EXPECT_EQ(a, 4) << "every rank must agree on the new accumulation";
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LT(testing_util::rel_error(got[i], want[i]), std::string(shard) == "none" ? 1e-12 : 1e-10)
          << "parameter " << i;
    }
    for (auto& p : got) {  // every rank holds the same parameters
      at::Tensor mx = p.clone(), mn = p.clone();
      comm.all_reduce(mx, dist::ReduceOp::kMax)->wait();
      comm.all_reduce(mn, dist::ReduceOp::kMin)->wait();
      EXPECT_TRUE(at::equal(mx, mn));
    }
  }
}

TEST(Trainer, OutOfMemoryThatCannotBackOffFurtherIsAClearError) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto model = make_model();
  TrainerOptions o = base_options();
  Trainer trainer(*model, [&](const Batch&) -> at::Tensor {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated)");
  }, mesh, c10::Device(c10::kCPU), o);
  try {
    trainer.step(batch_for(0, comm.rank(), 4));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory even with micro-batches of 1 rows"), std::string::npos) << e.what();
  }
}

// ZeRO-3 (--shard=parameters): OOM back-off replays the failing rank's step (zero3_oom_cases.h).
TEST(Trainer, OutOfMemoryUnderZero3ReplaysTheStepsCollectivesAndMatchesTheSmallerMicroBatches) {
  zero3_oom_cases::expect_back_off_matches_the_smaller_micro_batches(c10::Device(c10::kCPU));
}

TEST(Trainer, MetricsFileHasTheArchitectureFieldsAndTheGlobalLoss) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto model = make_model();
  TrainerOptions o = base_options();
  o.steps = 3;
  o.log_every = 1;
  o.clip_grad_norm = 0.5;
  char path[] = "/tmp/dtrain_metrics_XXXXXX";
  if (comm.rank() == 0) {
    int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
  }
  // Everyone needs the same (rank 0's) path string, though only rank 0 writes.
  at::Tensor name = at::zeros({static_cast<int64_t>(sizeof(path))}, at::kByte);
  std::memcpy(name.data_ptr(), path, sizeof(path));
  comm.broadcast(name, 0)->wait();
  std::memcpy(path, name.data_ptr(), sizeof(path));
  o.metrics_path = path;

  // A loader over a fixed dataset; the reference loss is computed by hand below.
  auto g = at::make_generator<at::CPUGeneratorImpl>(77);
  at::Tensor x = at::randn({64, 6}, g, at::kDouble), y = at::randn({64, 1}, g, at::kDouble);
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{x, y});
  LoaderOptions lo;
  lo.batch_size = 4;
  lo.dp_rank = comm.rank();
  lo.dp_size = comm.size();
  lo.workers = 0;
  DataLoader loader(data, lo);
  std::vector<double> seen_loss;
  o.on_log = [&](const StepMetrics& m) { seen_loss.push_back(m.loss); };
  // Reference loss of step 1: the model before any update on the whole global batch.
  auto ref = make_model();
  DataLoader ref_loader(data, [&] { LoaderOptions r = lo; r.dp_rank = 0; r.dp_size = 1; r.batch_size = 4 * comm.size(); return r; }());
  Batch global = ref_loader.next();
  double want0 = torch::mse_loss(ref->forward(global.fields[0]), global.fields[1]).item<double>();

  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  trainer.fit(loader);
  ASSERT_EQ(seen_loss.size(), 3u);
  EXPECT_NEAR(seen_loss[0], want0, 1e-9 * std::abs(want0)) << "step 1 logs the global-batch mean";
  comm.barrier()->wait();
  if (comm.rank() == 0) {
    std::ifstream in(path);
    std::string line;
    int lines = 0;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      for (const char* key : {"step", "loss", "step_ms", "samples_per_s", "mem_allocated_mb", "mem_peak_mb", "grad_norm", "lr"}) {
        EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
      }
      EXPECT_EQ(j["step"].get<int>(), lines + 1);
      ++lines;
    }
    EXPECT_EQ(lines, 3);
    std::remove(path);
  }
}

TEST(Trainer, EvaluateAveragesOverTheDataParallelGroupInEvalModeWithoutGrad) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto model = make_model();
  TrainerOptions o = base_options();
  bool saw_grad_mode = false, saw_training = true;
  Trainer trainer(*model, [&](const Batch& b) {
    saw_grad_mode = torch::GradMode::is_enabled();
    saw_training = model->is_training();
    return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]);
  }, mesh, c10::Device(c10::kCPU), o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor x = at::randn({32, 6}, g, at::kDouble), y = at::randn({32, 1}, g, at::kDouble);
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{x, y});
  LoaderOptions lo;
  lo.batch_size = 4;
  lo.dp_rank = comm.rank();
  lo.dp_size = comm.size();
  lo.shuffle = false;
  lo.workers = 0;
  DataLoader loader(data, lo);
  double got = trainer.evaluate(loader, 1);
  EXPECT_FALSE(saw_grad_mode);
  EXPECT_FALSE(saw_training);
  EXPECT_TRUE(model->is_training());
  // Reference: rows [0, 4 * size) are the first global batch; the mean of per-rank means.
  double want = torch::mse_loss(model->forward(x.narrow(0, 0, 4 * comm.size())), y.narrow(0, 0, 4 * comm.size())).item<double>();
  EXPECT_NEAR(got, want, 1e-12 * std::abs(want));
}

// With eval_loss_and_correct, evaluate() also counts correct predictions over every evaluated
// batch of every data-parallel rank: the accuracy equals the one computed on the whole global
// batch directly.
TEST(Trainer, EvaluateCountsAccuracyOverTheDataParallelGroup) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  torch::manual_seed(3);
  torch::nn::Linear model(6, 3);
  model->to(torch::kFloat64);
  TrainerOptions o = base_options();
  o.eval_loss_and_correct = [&](const Batch& b) {
    at::Tensor logits = model->forward(b.fields[0]);
    return std::make_pair(torch::cross_entropy_loss(logits, b.fields[1]), logits.argmax(1).eq(b.fields[1]).sum());
  };
  Trainer trainer(*model, [&](const Batch& b) { return torch::cross_entropy_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor x = at::randn({48, 6}, g, at::kDouble), y = at::randint(3, {48}, g, at::kLong);
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{x, y});
  LoaderOptions lo;
  lo.batch_size = 4;
  lo.shuffle = false;
  lo.workers = 0;
  DataLoader loader(data, lo);  // sharded by evaluate()
  const int64_t batches = 2;
  const double loss = trainer.evaluate(loader, batches);
  ASSERT_TRUE(trainer.last_eval_accuracy().has_value());
  // Reference: the first `batches` global batches of 4 * size rows, in dataset order.
  const int64_t rows = batches * 4 * comm.size();
  torch::NoGradGuard no_grad;
  at::Tensor logits = model->forward(x.narrow(0, 0, rows));
  const double want = logits.argmax(1).eq(y.narrow(0, 0, rows)).sum().item<double>() / rows;
  EXPECT_DOUBLE_EQ(*trainer.last_eval_accuracy(), want);
  EXPECT_GT(want, 0.0);
  EXPECT_LT(want, 1.0);
  EXPECT_NEAR(loss, torch::cross_entropy_loss(logits, y.narrow(0, 0, rows)).item<double>(), 1e-12);
}

// The metrics' comm_mb (bytes this rank sends per step, counted by the communicators as ring
// bus bytes) equals data parallelism's theory: one all-reduce of every gradient,
// 2 (N-1)/N x the gradient bytes, within 5% (the loss and the agreement flags add a few bytes).
TEST(Trainer, CommunicatedBytesPerStepMatchTheAllReduceTheory) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::Tanh(), torch::nn::Linear(256, 64));
  model->to(torch::kFloat64);
  int64_t numel = 0;
  for (auto& p : model->parameters()) numel += p.numel();
  TrainerOptions o = base_options();
  o.steps = 5;
  o.log_every = 1;
  std::vector<double> per_step;
  o.on_log = [&](const StepMetrics& m) {
    if (m.step >= 2) per_step.push_back(m.extra.at("comm_mb"));
  };
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(6);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({256, 64}, g, at::kDouble), at::randn({256, 64}, g, at::kDouble)});
  LoaderOptions lo;
  lo.batch_size = 8;
  lo.workers = 0;
  DataLoader loader(data, lo);
  trainer.fit(loader);
  const int n = comm.size();
  const double theory_mb = 2.0 * (n - 1) / n * numel * 8 / (1024.0 * 1024.0);
  ASSERT_EQ(per_step.size(), 4u);
  for (double mb : per_step) {
    if (n == 1) {
      EXPECT_EQ(mb, 0.0);
    } else {
      EXPECT_NEAR(mb, theory_mb, 0.05 * theory_mb) << numel << " float64 gradients on " << n << " ranks";
    }
  }
}

TEST(Trainer, ALoaderWithoutDropLastIsRefusedOnEveryDataParallelRank) {
  auto& comm = world_comm();
  if (comm.size() < 2) GTEST_SKIP();
  dist::Mesh mesh(comm, 1);
  auto model = make_model();
  TrainerOptions o = base_options();
  LossFn loss = [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); };
  Trainer trainer(*model, loss, mesh, c10::Device(c10::kCPU), o);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({9, 6}, at::kDouble), at::randn({9, 1}, at::kDouble)});
  LoaderOptions lo;
  lo.batch_size = 4;
  lo.dp_rank = comm.rank();
  lo.dp_size = comm.size();
  lo.workers = 0;
  lo.drop_last = false;
  DataLoader loader(data, lo);
  const std::string what = testing_util::error_of([&] { trainer.fit(loader); });
  EXPECT_NE(what.find("drop_last = false"), std::string::npos) << what;
  comm.barrier()->wait();  // every rank refused without a collective: still in step
}

std::vector<at::Tensor> fit_on(dist::Mesh& mesh, int64_t batch_size, int dp_rank, int dp_size) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({96, 6}, g, at::kDouble), at::randn({96, 1}, g, at::kDouble)});
  LoaderOptions lo;
  lo.batch_size = batch_size;
  lo.dp_rank = dp_rank;
  lo.dp_size = dp_size;
  lo.seed = 5;
  lo.workers = 1;
  DataLoader loader(data, lo);
  auto model = make_model();
  TrainerOptions o = base_options();
  o.steps = 6;
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  trainer.fit(loader);
  EXPECT_EQ(loader.options().dp_size, mesh.dp_size());
  std::vector<at::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  return params;
}

// A loader left at LoaderOptions' default (dp_rank 0 of 1) on N ranks: fit() shards it, so the
// run equals one process on the N-times larger global batch, never N ranks on the same batches
// (issue 18: the default used to train every rank on the same data without a word).
TEST(Trainer, AnUnshardedLoaderIsShardedByFitAndMatchesOneProcessOnTheGlobalBatch) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  std::vector<at::Tensor> got = fit_on(mesh, 4, /*dp_rank=*/0, /*dp_size=*/1);
  auto lone = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  dist::Mesh one(*lone, 1);
  std::vector<at::Tensor> want = fit_on(one, 4 * comm.size(), 0, 1);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LT(testing_util::rel_error(got[i], want[i]), 1e-12) << "parameter " << i;
  }
  if (comm.size() > 1) {
    // The duplicate-data run that the default used to give is measurably different.
    std::vector<at::Tensor> duplicate = fit_on(one, 4, 0, 1);
    EXPECT_GT(testing_util::rel_error(duplicate[0], want[0]), 1e-6);
  }
}

// A loader sharded for another layout (dp_rank 0 of N on every rank) stops every rank with a
// message naming both layouts, not only the ranks whose share is wrong.
TEST(Trainer, ALoaderShardedForAnotherLayoutStopsEveryRank) {
  auto& comm = world_comm();
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  dist::Mesh mesh(comm, 1);
  const std::string what = testing_util::error_of([&] { fit_on(mesh, 4, /*dp_rank=*/0, comm.size()); });
  if (comm.rank() == 0) {
    EXPECT_NE(what.find("the training loader is sharded for another data-parallel layout on another rank"),
              std::string::npos) << what;
  } else {
    EXPECT_NE(what.find("the training loader is sharded for data-parallel rank 0 of " + std::to_string(comm.size()) +
                        ", but this rank is data-parallel rank " + std::to_string(comm.rank())),
              std::string::npos) << what;
  }
  comm.barrier()->wait();  // every rank refused: still in step
}

TEST(TrainerOptionsCheck, BadValuesAreNamed) {
  TrainerOptions o;
  o.accum_steps = 0;
  EXPECT_THROW(validate(o), Error);
  o = TrainerOptions();
  o.clip_grad_norm = std::nan("");
  EXPECT_THROW(validate(o), Error);
  o = TrainerOptions();
  o.optimizer.lr = std::nan("");
  EXPECT_THROW(validate(o), Error);
  Batch b;
  b.fields = {at::zeros({6, 2})};
  EXPECT_THROW(split_batch(b, 4), Error);
  EXPECT_EQ(split_batch(b, 3).size(), 3u);
}

}  // namespace
}  // namespace dtrain::engine
