// state/training_state.h on several ranks: a Trainer's partitioned (ZeRO-1) checkpoint restored
// into a replicated optimizer of the caller's and saved again through the library, with no
// Trainer in between, resumes as the original does.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/core/gather_texts.h"
#include "dtrain/engine/state/training_state.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

torch::nn::Sequential ts_mpi_model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
  m->to(torch::kFloat64);
  return m;
}

std::unique_ptr<DataLoader> ts_mpi_loader() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({64, 6}, g, at::kDouble), at::randn({64, 1}, g, at::kDouble)});
  LoaderOptions lo;
  lo.batch_size = 4;
  lo.workers = 0;
  return std::make_unique<DataLoader>(data, lo);
}

// fit() to `steps` with --shard=optimizer, saving into dir (resuming from it when asked);
// returns the model's weights.
std::vector<at::Tensor> ts_mpi_fit(dist::Mesh& mesh, const std::string& dir, int64_t steps, bool resume,
                                   torch::nn::Sequential* keep = nullptr) {
  torch::nn::Sequential model = ts_mpi_model(resume ? 7 : 0);
  TrainerOptions o;
  o.steps = steps;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.01;
  o.shard = "optimizer";
  o.save_dir = dir;
  o.resume = resume ? ResumeMode::kYes : ResumeMode::kNo;
  o.async_save = false;
  o.progress = false;
  o.handle_preemption = false;
  {
    Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                    mesh, c10::Device(c10::kCPU), o);
    std::unique_ptr<DataLoader> loader = ts_mpi_loader();
    trainer.fit(*loader);
  }
  if (keep) *keep = model;
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(TrainingStateMpi, APartitionedCheckpointThroughTheLibraryResumesAsTheOriginal) {
  auto& comm = testing_util::world_comm();
  dist::Mesh mesh(comm, 1);
  // Two directories every rank sees: rank 0's names.
  std::unique_ptr<testing_util::ScratchDir> by_trainer, by_library;
  if (comm.rank() == 0) {
    by_trainer = std::make_unique<testing_util::ScratchDir>("ts_trainer", true);
    by_library = std::make_unique<testing_util::ScratchDir>("ts_library", true);
  }
  const std::string trainer_dir = gather_texts(comm, comm.rank() == 0 ? by_trainer->str() : "").front();
  const std::string library_dir = gather_texts(comm, comm.rank() == 0 ? by_library->str() : "").front();
  torch::nn::Sequential trained = ts_mpi_model(0);
  ts_mpi_fit(mesh, trainer_dir, 3, /*resume=*/false, &trained);  // saves step 3

  // The caller's own model and replicated Adam, another initialisation: restored, then saved.
  torch::nn::Sequential model = ts_mpi_model(9);
  const TrainedParameters params = trained_parameters(*model);
  OptimizerOptions oo;
  oo.name = "adam";
  oo.lr = 0.01;
  std::unique_ptr<Optimizer> optimizer = make_optimizer(params.params, oo);
  const std::map<std::string, ShardSpec> splits;
  TrainingState state(*model, mesh, params.params, params.names, splits);
  state.optimizer = optimizer.get();
  std::unique_ptr<DataLoader> loader = ts_mpi_loader();
  CheckpointStore trainer_store(trainer_dir);
  ASSERT_TRUE(resume_training_state(state, trainer_store, loader.get()).has_value());
  EXPECT_EQ(state.step, 3);
  const std::vector<at::Tensor> restored = model->parameters(), want = trained->parameters();
  ASSERT_EQ(restored.size(), want.size());
  for (size_t i = 0; i < restored.size(); ++i) EXPECT_TRUE(at::equal(restored[i], want[i])) << "parameter " << i;
  CheckpointStore library_store(library_dir);
  save_training_state(state, library_store, loader.get());
  comm.barrier()->wait();

  // Both resumed with --shard=optimizer to step 5: the same weights, bit for bit.
  const std::vector<at::Tensor> a = ts_mpi_fit(mesh, trainer_dir, 5, /*resume=*/true);
  const std::vector<at::Tensor> b = ts_mpi_fit(mesh, library_dir, 5, /*resume=*/true);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
  comm.barrier()->wait();
}

}  // namespace
}  // namespace dtrain::engine
