// A model given by its ModelSpec, trained through the Trainer on token windows for a few steps,
// and the check that a layout's loss curve follows the one-rank run's: what the tests of a
// model of their own (tests/mpi/model_spec_test.cc) and of the library's Llama
// (tests/mpi/llama_mpi_test.cc) share.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine::spec_curve_cases {

// The curves' options: 4 Adam steps at lr 0.02, the loss logged every step, no progress line
// and no OOM back-off; `shard` and activation checkpointing as given; with pipeline stages
// (pp > 1) 2 micro-batches a step.
inline TrainerOptions curve_options(const std::string& shard, bool checkpoint, int pp) {
  TrainerOptions o;
  o.steps = 4;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.02;
  o.progress = false;
  o.log_every = 1;
  o.oom_backoff = false;
  o.shard = shard;
  o.checkpoint_activations = checkpoint;
  o.accum_steps = pp > 1 ? 2 : 1;
  return o;
}

// The logged loss of every step of `spec` trained with `o` on `mesh` on the CPU: 64 windows of
// seq + 1 tokens below `vocab` (drawn from generator 5, the same on every rank), `rows` global
// rows a step in order (each data-parallel rank its slice).
inline std::vector<double> fit_token_windows(const ModelSpec& spec, dist::Mesh& mesh, TrainerOptions o, int64_t vocab,
                                             int64_t seq, int64_t rows) {
  std::vector<double> losses;
  o.on_log = [&](const StepMetrics& m) { losses.push_back(m.loss); };
  Trainer trainer(spec, mesh, c10::Device(c10::kCPU), o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{at::randint(vocab, {64, seq + 1}, g, at::kLong)});
  LoaderOptions loader_options;
  loader_options.batch_size = rows / mesh.dp_size();
  loader_options.shuffle = false;
  loader_options.workers = 0;
  DataLoader loader(data, loader_options);
  trainer.fit(loader);
  return losses;
}

// The one-rank reference of a layout's curve: curve(communicator, layout) on this rank alone (a
// communicator of one split from the world: every rank calls it at the same point).
template <class Curve, class Layout>
std::vector<double> one_rank_curve(Curve curve, const Layout& layout) {
  std::unique_ptr<dist::Communicator> alone = testing_util::alone_comm();
  return curve(*alone, layout);
}

// `got` follows `want` step for step, to 1e-10 relative (float64); returns the worst relative
// difference.
inline double expect_same_curve(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t s = 0; s < std::min(got.size(), want.size()); ++s) {
    EXPECT_NEAR(got[s], want[s], 1e-10 * std::abs(want[s])) << "step " << s + 1;
    worst = std::max(worst, std::abs(got[s] - want[s]) / std::abs(want[s]));
  }
  return worst;
}

}  // namespace dtrain::engine::spec_curve_cases
