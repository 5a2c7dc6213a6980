// What the Trainer's constructor builds, apart from the loop that uses it (trainer.cc): the
// options' checks and the settings every rank must agree on, the update's pieces (optimizer
// chosen for the options, gradient reducer, ZeRO-3 units, sparse reducer, pruner) over the
// trained parameters, and the observers (metrics, TensorBoard, timeline, profiler). Private to
// the train area.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::engine::trainer_setup {

// What must be the same on every rank for the ranks to train one model in step.
Settings settings_of(const TrainerOptions& o);

// What --param_dtype (TrainerOptions::param_dtype) needs: an optimizer with float32 master
// weights, and the techniques that keep bfloat16 weights as they are.
void check_param_dtype(const TrainerOptions& o);

// What a pipeline-parallel trainer needs and what it does not (yet) combine with; the same on
// every rank (options and mesh are), so every rank refuses together.
void check_pipeline_options(const TrainerOptions& o, const dist::Mesh& mesh);

// The update's inputs: the trained parameters (trained_parameters()), which of them are split
// across the tensor-parallel group (specs), and the options.
struct UpdateInputs {
  torch::nn::Module& model;
  const TrainedParameters& trained;
  const std::map<std::string, ShardSpec>& specs;
  const std::vector<bool>& tp_sharded;  // per trained parameter: in specs
  dist::Mesh& mesh;
  c10::Device device;
  const TrainerOptions& options;
};

// The update's pieces, in the order the Trainer keeps them (units refer to the optimizer).
struct UpdateParts {
  std::unique_ptr<SparseGradReducer> sparse_reducer;  // null: no parameter has sparse gradients
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<ParameterUnits> units;  // --shard=parameters
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<Pruner> pruner;  // prune.amount > 0
  // A partitioned optimizer: this rank's ranges of the flat gradient space (possibly none), and
  // (ZeRO-3) the flat tensor holding them, range k from owned_at[k] (GradNormLayout's fields).
  bool partitioned = false;
  std::vector<FlatRange> owned;
  at::Tensor owned_values;
  std::vector<int64_t> owned_at;
};

// Chooses and builds the optimizer for the options (sparse-aware, ZeRO-3 with or without
// offload, offloaded, partitioned, replicated), the reducer that feeds it (each gradient reduced
// to its owner for a partitioned one) and the pruner. reducer_options: the options' with the
// parameters' names, after the initial broadcast. Collective where the pieces' constructors are.
UpdateParts build_update(const UpdateInputs& in, ReducerOptions reducer_options);

// Pipeline: each stage's partitioned flat optimizer space per tensor-parallel rank (stages x
// tp, stage-major), recorded in checkpoints so that partitioned state resumes under another
// split into stages. Collective over the world.
std::vector<int64_t> stage_flat_numels(const dist::Mesh& mesh, const Optimizer& optimizer,
                                       const std::vector<at::Tensor>& params, c10::Device device);

struct Observers {
  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<EventWriter> tensorboard;
  std::unique_ptr<Timeline> timeline;
  std::unique_ptr<StepProfiler> profiler;
};
// Rank 0 writes the metrics and TensorBoard files (a resumed run appends to its metrics file);
// every rank its timeline and profile.
Observers make_observers(const TrainerOptions& o, const dist::Mesh& mesh, c10::Device device);

}  // namespace dtrain::engine::trainer_setup
