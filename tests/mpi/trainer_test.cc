// The trainer on several ranks: OOM back-off keeps ranks in step and equals a run that used
// the smaller micro-batches from the start; metrics and evaluation.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/state/checkpoint.h"
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

// `batch` rows per rank, in dataset order unless shuffled, assembled on the caller's thread;
// this rank's share of `comm` when given, else one rank's (fit() and evaluate() shard it).
LoaderOptions trainer_loader_options(int64_t batch, bool shuffle = true,
                                     dist::Communicator* comm = nullptr) {
  LoaderOptions lo;
  lo.batch_size = batch;
  lo.shuffle = shuffle;
  lo.workers = 0;
  if (comm) {
    lo.dp_rank = comm->rank();
    lo.dp_size = comm->size();
  }
  return lo;
}

// A loader over `rows` random float64 regression rows (x [rows, in], y [rows, out]) drawn from
// `seed`, `batch` rows per data-parallel rank, in dataset order with no workers.
std::unique_ptr<DataLoader> regression_loader(int64_t rows, int64_t in, int64_t out, uint64_t seed, int64_t batch,
                                              bool shuffle = true) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({rows, in}, g, at::kDouble), at::randn({rows, out}, g, at::kDouble)});
  return std::make_unique<DataLoader>(data, trainer_loader_options(batch, shuffle));
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
  const LoaderOptions lo = trainer_loader_options(4, /*shuffle=*/true, &comm);
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
  DataLoader loader(data, trainer_loader_options(4, /*shuffle=*/false, &comm));
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
  DataLoader loader(data, trainer_loader_options(4, /*shuffle=*/false));  // sharded by evaluate()
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

// evaluate(loader): the held-out set is eval_samples samples of the loader's epoch-0 order,
// whatever the rank count, batch size or data-parallel sharding, the same set at every call,
// and the loss is the row-weighted mean over it: the mean squared error over the set computed
// in one forward here, for 37 samples (partial chunks, ranks without a chunk in the last round)
// in batches of 4 and 5 rows, the whole split and 23 samples, shuffled or not. The loader's
// position does not move. (Before: eval_batches batches per rank, continuing where the last
// evaluation stopped, so successive evaluations and rank counts scored different samples.)
TEST(Trainer, EvaluationScoresTheSameHeldOutSetForEveryLayoutAndEveryCall) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto model = make_model();
  auto g = at::make_generator<at::CPUGeneratorImpl>(21);
  at::Tensor x = at::randn({37, 6}, g, at::kDouble), y = at::randn({37, 1}, g, at::kDouble);
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{x, y});
  for (int64_t samples : {int64_t{0}, int64_t{23}}) {
    for (int64_t rows : {int64_t{4}, int64_t{5}}) {
      for (bool shuffle : {false, true}) {
        SCOPED_TRACE("eval_samples " + std::to_string(samples) + ", batch " + std::to_string(rows) +
                     (shuffle ? ", shuffled" : ""));
        TrainerOptions o = base_options();
        o.eval_samples = samples;
        Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                        mesh, c10::Device(c10::kCPU), o);
        LoaderOptions lo = trainer_loader_options(rows, shuffle);
        lo.seed = 77;
        DataLoader loader(data, lo);
        const std::vector<int64_t> order = loader.evaluation_order(samples);
        ASSERT_EQ(static_cast<int64_t>(order.size()), samples == 0 ? 37 : samples);
        const double first = trainer.evaluate(loader);
        const double second = trainer.evaluate(loader);
        EXPECT_EQ(first, second) << "two evaluations of the same weights scored different samples";
        EXPECT_EQ(loader.position(), (std::pair<int64_t, int64_t>{0, 0}));
        torch::NoGradGuard no_grad;
        at::Tensor index = at::tensor(order, at::kLong);
        const double want =
            torch::mse_loss(model->forward(x.index_select(0, index)), y.index_select(0, index)).item<double>();
        EXPECT_NEAR(first, want, 1e-12 * std::abs(want));
      }
    }
  }
}

// Two modules holding one parameter (tied weights, as nanoGPT ties its head to the token
// embedding): the trainer trains it once with the summed gradient of both uses, as PyTorch's
// parameters() lists it, at every rank count and with ZeRO-1; the reference is a plain
// libtorch AdamW loop in float64 on the global batch. ZeRO-3 refuses it, naming both names.
struct HoldsImpl : torch::nn::Module {
  explicit HoldsImpl(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  at::Tensor weight;
};
TORCH_MODULE(Holds);
struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl() {
    torch::manual_seed(4);
    at::Tensor w = torch::randn({5, 6}, torch::kFloat64) * 0.3;
    embed = register_module("embed", Holds(w));
    mid = register_module("mid", torch::nn::Linear(torch::nn::LinearOptions(5, 5)));
    head = register_module("head", Holds(w));  // the same tensor under a second name
    mid->to(torch::kFloat64);
  }
  at::Tensor forward(const at::Tensor& x) {  // [n, 6] -> [n, 6]
    at::Tensor h = torch::tanh(x.matmul(embed->weight.t()));
    return mid->forward(h).matmul(head->weight);
  }
  Holds embed{nullptr}, head{nullptr};
  torch::nn::Linear mid{nullptr};
};
TORCH_MODULE(TiedNet);

TEST(Trainer, TiedParametersTrainOnceWithTheSummedGradientLikeATorchLoop) {
  auto& comm = world_comm();
  const int64_t rows = 4, steps = 3;
  auto global_batch = [&](int64_t step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
    return std::make_pair(at::randn({rows * comm.size(), 6}, g, at::kDouble),
                          at::randn({rows * comm.size(), 6}, g, at::kDouble));
  };
  // Reference: one process, the whole global batch, torch::optim::AdamW on the distinct tensors.
  TiedNet ref;
  std::vector<at::Tensor> distinct = {ref->embed->weight, ref->mid->weight, ref->mid->bias};
  ASSERT_EQ(ref->parameters().size(), 4u) << "the tie is the premise of this test";
  torch::optim::AdamW adamw(distinct, torch::optim::AdamWOptions(0.01).weight_decay(0));
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s);
    adamw.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    adamw.step();
  }
  for (const char* shard : {"none", "optimizer"}) {
    SCOPED_TRACE(std::string("--shard=") + shard);
    dist::Mesh mesh(comm, 1);
    TiedNet model;
    TrainerOptions o = base_options();
    o.optimizer.name = "adamw";
    o.optimizer.weight_decay = 0;
    o.shard = shard;
    Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                    mesh, c10::Device(c10::kCPU), o);
    for (int64_t s = 0; s < steps; ++s) {
      auto [x, y] = global_batch(s);
      Batch b;
      b.fields = {x.narrow(0, rows * comm.rank(), rows), y.narrow(0, rows * comm.rank(), rows)};
      trainer.step(b);
    }
    EXPECT_EQ(model->embed->weight.data_ptr(), model->head->weight.data_ptr()) << "the tie survived training";
    EXPECT_LT(testing_util::rel_error(model->embed->weight, ref->embed->weight), 1e-12);
    EXPECT_LT(testing_util::rel_error(model->mid->weight, ref->mid->weight), 1e-12);
    EXPECT_LT(testing_util::rel_error(model->mid->bias, ref->mid->bias), 1e-12);
  }
  dist::Mesh mesh(comm, 1);
  TiedNet model;
  TrainerOptions o = base_options();
  o.shard = "parameters";
  o.shard_unit_starts = {"embed.", "mid.", "head."};
  const std::string error = testing_util::error_of([&] {
    Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                    mesh, c10::Device(c10::kCPU), o);
  });
  EXPECT_NE(error.find("tied parameters ('head.weight' is 'embed.weight') with --shard=parameters"), std::string::npos)
      << error;
}

// fit() of make_model() on 64 random rows, 4 per rank and step, saving into `dir`.
struct SavingRun {
  dist::Mesh& mesh;
  std::string dir;
  int64_t save_every = 0;
  StepMetrics fit(int64_t steps, ResumeMode resume, SaveDirExists exists, int64_t* reached = nullptr) {
    auto model = make_model();
    TrainerOptions o = base_options();
    o.steps = steps;
    o.save_dir = dir;
    o.keep_last = 0;
    o.save_every = save_every;
    o.async_save = false;
    o.resume = resume;
    o.save_dir_exists = exists;
    Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                    mesh, c10::Device(c10::kCPU), o);
    StepMetrics last = trainer.fit(*regression_loader(64, 6, 1, 3, 4));
    if (reached) *reached = trainer.current_step();
    return last;
  }
};

// A fresh run (resume kNo) into a save_dir holding an earlier run's checkpoints: refused by
// default, naming the directory and the choices; "overwrite" removes them first; "resume"
// continues from the newest. (Before: the fresh run's checkpoints were written beside the
// others', and a later resume continued whichever run's step was newest.)
TEST(Trainer, AFreshStartIntoADirectoryOfCheckpointsIsRefusedOverwrittenOrResumedAsAsked) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  // One directory for every rank: rank 0's name.
  std::unique_ptr<testing_util::ScratchDir> scratch;
  std::string dir;
  {
    if (comm.rank() == 0) scratch = std::make_unique<testing_util::ScratchDir>("save_dir_exists", true);
    std::string mine = comm.rank() == 0 ? scratch->str() : std::string();
    at::Tensor n = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
    comm.broadcast(n, 0)->wait();
    at::Tensor bytes = at::zeros({n.item<int64_t>()}, at::kByte);
    if (comm.rank() == 0) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
    comm.broadcast(bytes, 0)->wait();
    dir.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  }
  SavingRun saving{mesh, dir, /*save_every=*/2};
  auto run = [&](int64_t steps, ResumeMode resume, SaveDirExists exists) {
    int64_t reached = 0;
    saving.fit(steps, resume, exists, &reached);
    return reached;
  };
  auto steps_saved = [&] {
    std::vector<int64_t> steps;
    for (const CheckpointInfo& c : CheckpointStore(dir).list()) steps.push_back(c.step);
    return steps;
  };
  EXPECT_EQ(run(6, ResumeMode::kNo, SaveDirExists::kError), 6);
  EXPECT_EQ(steps_saved(), (std::vector<int64_t>{6, 4, 2}));
  const std::string error = testing_util::error_of([&] { run(3, ResumeMode::kNo, SaveDirExists::kError); });
  EXPECT_NE(error.find("--save_dir=" + dir + " already holds 3 checkpoint(s) of an earlier run"), std::string::npos)
      << error;
  EXPECT_NE(error.find("--save_dir_exists=overwrite"), std::string::npos) << error;
  EXPECT_EQ(steps_saved(), (std::vector<int64_t>{6, 4, 2})) << "a refused run must leave the directory as it was";
  EXPECT_EQ(run(8, ResumeMode::kNo, SaveDirExists::kResume), 8) << "resume continues from step 6";
  EXPECT_EQ(steps_saved(), (std::vector<int64_t>{8, 6, 4, 2}));
  EXPECT_EQ(run(3, ResumeMode::kNo, SaveDirExists::kOverwrite), 3);
  EXPECT_EQ(steps_saved(), (std::vector<int64_t>{3, 2})) << "overwrite removes the earlier run's checkpoints first";
  comm.barrier()->wait();
}

// A run that had already reached its steps trains nothing: fit() says so and returns a NaN
// loss, never a made-up 0.
TEST(Trainer, FitOfACompleteRunReturnsNoLoss) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  // One directory for every rank (all ranks run on one machine, under one mpirun).
  const std::string dir = "/tmp/dtrain_complete_run_" + std::to_string(getppid());
  if (comm.rank() == 0) testing_util::remove_tree(dir);
  comm.barrier()->wait();
  SavingRun saving{mesh, dir};
  StepMetrics last = saving.fit(2, ResumeMode::kAuto, SaveDirExists::kError);
  EXPECT_TRUE(std::isfinite(last.loss));
  last = saving.fit(2, ResumeMode::kAuto, SaveDirExists::kError);
  EXPECT_EQ(last.step, 2);
  EXPECT_TRUE(std::isnan(last.loss)) << "a complete run reported loss " << last.loss;
  comm.barrier()->wait();
  if (comm.rank() == 0) testing_util::remove_tree(dir);
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
  trainer.fit(*regression_loader(256, 64, 64, 6, 8));
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
  LoaderOptions lo = trainer_loader_options(4, /*shuffle=*/true, &comm);
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
  LoaderOptions lo = trainer_loader_options(batch_size);
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
