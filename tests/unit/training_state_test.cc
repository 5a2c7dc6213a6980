// state/training_state.h: a run's training state saved and restored without a Trainer, against
// the checkpoints a Trainer writes and reads.
#include <torch/torch.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/state/training_state.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::ScratchDir;

// One process; an 8 -> 4 double Linear and its data (64 rows), Adam.
struct TsRun {
  std::unique_ptr<dist::Communicator> comm = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  dist::Mesh mesh{*comm, 1};
  std::shared_ptr<TensorDataset> data;
  LoaderOptions loader_options;
  TsRun() {
    auto g = at::make_generator<at::CPUGeneratorImpl>(5);
    data = std::make_shared<TensorDataset>(
        std::vector<at::Tensor>{at::randn({64, 8}, g, at::kDouble), at::randn({64, 4}, g, at::kDouble)});
    loader_options.batch_size = 8;
    loader_options.workers = 0;
  }
};

torch::nn::Linear ts_model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Linear model(8, 4);
  model->to(torch::kFloat64);
  return model;
}

TrainerOptions ts_options(const std::string& dir, int64_t steps, bool resume) {
  TrainerOptions o;
  o.steps = steps;
  o.save_dir = dir;
  o.resume = resume ? ResumeMode::kYes : ResumeMode::kNo;
  o.progress = false;
  o.handle_preemption = false;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.05;
  return o;
}

LossFn ts_loss(torch::nn::Linear& model) {
  return [&model](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); };
}

void ts_expect_same(const NamedTensors& a, const NamedTensors& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first) << what;
    EXPECT_TRUE(at::equal(a[i].second.cpu(), b[i].second.cpu())) << what << " " << a[i].first;
  }
}

// A Trainer's checkpoint restored into a model and optimizer of the caller's (no Trainer) gives
// the trainer's weights, optimizer state, step and data position; saved again through the
// library it is the same checkpoint (every tensor and meta entry), and a Trainer resuming from
// that copy trains on exactly as one resuming from the original.
TEST(TrainingState, RestoresAndSavesATrainersCheckpointWithoutATrainer) {
  TsRun run;
  ScratchDir trainer_dir("ts_trainer", /*create=*/true), library_dir("ts_library", /*create=*/true);
  torch::nn::Linear trained = ts_model(1);
  NamedTensors trainer_optimizer;
  std::pair<int64_t, int64_t> trainer_position;
  {
    Trainer trainer(*trained, ts_loss(trained), run.mesh, c10::Device(c10::kCPU), ts_options(trainer_dir.str(), 3, false));
    DataLoader loader(run.data, run.loader_options);
    trainer.fit(loader);  // saves step 3 at its end
    trainer_optimizer = trainer.optimizer().state();
    trainer_position = loader.position();
  }
  // The caller's own pieces: another initialisation, a plain Adam, a loader at its start.
  torch::nn::Linear model = ts_model(2);
  const TrainedParameters trained_params = trained_parameters(*model);
  OptimizerOptions oo;
  oo.name = "adam";
  oo.lr = 0.05;
  std::unique_ptr<Optimizer> optimizer = make_optimizer(trained_params.params, oo);
  const std::map<std::string, ShardSpec> splits = collect_shard_specs(*model);
  TrainingState state(*model, run.mesh, trained_params.params, trained_params.names, splits);
  state.optimizer = optimizer.get();
  DataLoader loader(run.data, run.loader_options);
  CheckpointStore trainer_store(trainer_dir.str());
  std::optional<CheckpointInfo> info = resume_training_state(state, trainer_store, &loader);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->step, 3);
  EXPECT_EQ(state.step, 3);
  EXPECT_EQ(loader.position(), trainer_position);
  EXPECT_TRUE(at::equal(model->weight, trained->weight));
  EXPECT_TRUE(at::equal(model->bias, trained->bias));
  ts_expect_same(optimizer->state(), trainer_optimizer, "optimizer");

  CheckpointStore library_store(library_dir.str());
  save_training_state(state, library_store, &loader);
  const CheckpointData by_trainer = trainer_store.load(trainer_store.path_for(3));
  const CheckpointData by_library = library_store.load(library_store.path_for(3));
  EXPECT_EQ(by_library.step, by_trainer.step);
  ts_expect_same(by_library.model, by_trainer.model, "model");
  ts_expect_same(by_library.optimizer, by_trainer.optimizer, "optimizer");
  // The same meta, but for what the trainer records of its schedule and optimizer ("train.",
  // which a library caller's state does not know).
  std::map<std::string, std::string> trainer_meta = by_trainer.meta;
  EXPECT_EQ(trainer_meta.erase("train.schedule"), 1u);
  EXPECT_EQ(trainer_meta.erase("train.optimizer"), 1u);
  EXPECT_EQ(by_library.meta, trainer_meta);
  EXPECT_TRUE(at::equal(by_library.rng.cpu, by_trainer.rng.cpu));
  EXPECT_EQ(by_library.rank_files, by_trainer.rank_files);

  // Both checkpoints resumed by a Trainer and trained to step 5: the same weights, bit for bit.
  auto resume_to_5 = [&](const std::string& dir) {
    torch::nn::Linear m = ts_model(3);
    Trainer trainer(*m, ts_loss(m), run.mesh, c10::Device(c10::kCPU), ts_options(dir, 5, true));
    DataLoader l(run.data, run.loader_options);
    trainer.fit(l);
    EXPECT_EQ(trainer.current_step(), 5);
    return m;
  };
  torch::nn::Linear from_trainer = resume_to_5(trainer_dir.str()), from_library = resume_to_5(library_dir.str());
  EXPECT_TRUE(at::equal(from_trainer->weight, from_library->weight));
  EXPECT_TRUE(at::equal(from_trainer->bias, from_library->bias));
}

// Weights only (no optimizer): the weights and the step, nothing else read or moved; a state
// without an optimizer is not saved; a model of another shape is refused naming the weight.
TEST(TrainingState, WeightsOnlyRestoreAndItsRefusals) {
  TsRun run;
  ScratchDir dir("ts_run", /*create=*/true), other_dir("ts_other", /*create=*/true);
  torch::nn::Linear trained = ts_model(1);
  {
    TrainerOptions o = ts_options(dir.str(), 2, false);
    o.checkpoint_meta = {{"shape.width", "4"}, {"shape.act", "relu"}, {"run.seq_len", "8"}};
    Trainer trainer(*trained, ts_loss(trained), run.mesh, c10::Device(c10::kCPU), o);
    DataLoader loader(run.data, run.loader_options);
    trainer.fit(loader);
  }
  torch::nn::Linear model = ts_model(2);
  const TrainedParameters p = trained_parameters(*model);
  const std::map<std::string, ShardSpec> splits;
  TrainingState state(*model, run.mesh, p.params, p.names, splits);
  DataLoader loader(run.data, run.loader_options);
  CheckpointStore store(dir.str());
  // The recorded shape: another value of a shape.* entry is refused, naming each; run.* entries
  // and entries the checkpoint lacks are not compared.
  state.meta = {{"shape.width", "4"}, {"shape.act", "gelu"}, {"shape.new", "1"}, {"run.seq_len", "16"}};
  EXPECT_NE(testing_util::error_of([&] { resume_training_state(state, store, &loader); })
                .find("is of a model built with other shape flags: --act=relu (here gelu)"),
            std::string::npos);
  state.meta = {{"shape.width", "4"}, {"shape.act", "relu"}, {"shape.new", "1"}, {"run.seq_len", "16"}};
  ASSERT_TRUE(resume_training_state(state, store, &loader).has_value());
  EXPECT_EQ(state.step, 2);
  EXPECT_EQ(loader.position(), (std::pair<int64_t, int64_t>{0, 0})) << "weights only: the loader stays";
  EXPECT_TRUE(at::equal(model->weight, trained->weight));
  CheckpointStore other(other_dir.str());
  EXPECT_NE(testing_util::error_of([&] { save_training_state(state, other, nullptr); }).find("no optimizer"),
            std::string::npos);
  EXPECT_FALSE(resume_training_state(state, other, nullptr).has_value()) << "an empty directory";
  torch::nn::Linear wider(8, 6);
  wider->to(torch::kFloat64);
  const TrainedParameters q = trained_parameters(*wider);
  TrainingState wrong(*wider, run.mesh, q.params, q.names, splits);
  EXPECT_NE(testing_util::error_of([&] { resume_training_state(wrong, store, nullptr); }).find("weight"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
