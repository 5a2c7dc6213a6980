// A run's training state saved and restored without a Trainer: what a step's checkpoint holds
// (the model unsplit under PyTorch state_dict names, the optimizer's replicated state unsplit
// and its partitioned state in rank files, loss scaler, pruning masks, random streams, step,
// accumulation, loader positions, and the layout a resume under another --tp, --pp, data-parallel
// size, --shard or --offload needs), over the files of checkpoint.h. The Trainer builds a
// TrainingState of its pieces and calls these; so do load_weights() (train/load.h) and a
// program of its own that trains without a Trainer.
//
//   TrainingState state(model, mesh, params, names, collect_shard_specs(model));
//   state.optimizer = optimizer.get();
//   CheckpointStore store("runs/a");
//   std::optional<CheckpointInfo> info = resume_training_state(state, store, &loader);  // collective
//   ... train, state.step = step ...
//   save_training_state(state, store, &loader);                                       // collective
//
// Any layout resumes any other: every tensor-parallel layout from the unsplit tensors, any
// data-parallel size and pipeline split from the ranks' ranges of the flat space
// (load_resharded_optimizer), partitioned state of another tensor-parallel size put together
// from every saved tensor-parallel rank's, ZeRO-3's partitioned weights into whole ones and
// back.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/state/host_staging.h"

namespace torch::nn {
class Module;
}

namespace dtrain::engine {

class DataLoader;
class LossScaler;
class Optimizer;
class ParameterUnits;
class Pruner;

// A view of one rank's training state: references to what a run trains with, owned by the
// caller (which keeps them alive while the view is used). Only model, mesh, params, names and
// tp_splits are required; a null optimizer means weights only (an evaluation: nothing of the
// optimizer, scaler or loaders is saved or restored).
struct TrainingState {
  TrainingState(torch::nn::Module& model, dist::Mesh& mesh, const std::vector<at::Tensor>& params,
                const std::vector<std::string>& names, const std::map<std::string, ShardSpec>& tp_splits)
      : model(model), mesh(mesh), params(params), names(names), tp_splits(tp_splits) {}

  torch::nn::Module& model;  // this rank's model (a pipeline stage's; tensor-parallel shards)
  dist::Mesh& mesh;          // its collectives: world, tp (gathers), pp (layout records)
  // The trained parameters in the flat space's order (trained_parameters(): tied weights
  // once) and their names in the model; the optimizer's state is keyed by their index.
  const std::vector<at::Tensor>& params;
  const std::vector<std::string>& names;
  // The parameters split over the tensor-parallel group (collect_shard_specs()), by name.
  const std::map<std::string, ShardSpec>& tp_splits;
  Optimizer* optimizer = nullptr;    // null: weights only
  LossScaler* scaler = nullptr;      // null: none saved or restored
  Pruner* pruner = nullptr;          // null: masks in a checkpoint are logged and dropped
  ParameterUnits* units = nullptr;   // ZeRO-3 (--shard=parameters): the weights are partitioned
  DataLoader* eval_loader = nullptr;  // its position is saved and restored too
  int64_t step = 0;                  // optimizer steps taken; restore sets it
  int accum_steps = 1;               // restore sets it when the checkpoint has it
  // Pipeline parallelism: the parameters of the stages before this one (the optimizer state's
  // indices run on across the stages), and each stage's partitioned flat optimizer space,
  // stages x tp, stage-major (empty without stages or without an optimizer).
  int64_t pp_param_offset = 0;
  // Interleaved stages (non-consecutive chunks): the whole model's index of each of this
  // stage's parameters, overriding pp_param_offset (empty: offset + i).
  std::vector<int64_t> pp_param_index;
  std::vector<int64_t> pp_flat_numels;
  bool offloaded_optimizer = false;          // recorded as meta "optimizer.offloaded"
  std::map<std::string, std::string> meta;  // saved along (program, flags, ...)
};

// A checkpoint's contents on the host, ready to be written.
struct PreparedCheckpoint {
  CheckpointData data;
  RankState rank;
  std::vector<at::Tensor> nonfinite;  // per device: 1 if a weight is inf/NaN (host, once staged)
};

// Copies this rank's state into a PreparedCheckpoint. Collective over the mesh's tp (the
// unsplit tensors) and, under a pipeline, its world (the layout record). `loader`: the
// training loader whose position is saved (may be null). With `staging` (a background
// save), every copy is staged there (HostStaging: wait() before writing) and the RNG states
// are cloned, so training may go on while the copy is written; without it, the copies are
// plain and must be written before the state changes. Weights an update in flight still
// changes (a delayed update) are the caller's to publish first.
PreparedCheckpoint prepare_training_state(const TrainingState& state, const DataLoader* loader,
                                          HostStaging* staging = nullptr);

// Writes and publishes a prepared checkpoint into `store` over `comm` (collective over it;
// a split of the world for a background write). Throws dtrain::Error on every rank, writing
// nothing, when the weights are not finite on some rank, and when the save fails
// (save_checkpoint()). Returns the main file's path.
std::string write_training_state(const PreparedCheckpoint& save, CheckpointStore& store, dist::Communicator& comm);

// prepare_training_state() and write_training_state() over the mesh's world: a synchronous
// save of this step. Collective over the world.
std::string save_training_state(const TrainingState& state, CheckpointStore& store, const DataLoader* loader);

// Restores checkpoint `info` of `store` into the state on this rank: the weights (any saved
// layout into this one), and with an optimizer its state, the scaler, the pruning masks, the
// random streams, step, accum_steps and the loaders' positions (loader: the training loader;
// may be null). No collectives; throws dtrain::Error naming the checkpoint and the first thing
// that does not fit this model or optimizer (what was restored before it stays restored).
void restore_training_state(TrainingState& state, const CheckpointStore& store, const CheckpointInfo& info,
                            DataLoader* loader);

// Collective over the mesh's world: the newest good checkpoint of `store` (agree_latest_good)
// restored into the state on every rank, and its info; nullopt (nothing changed) when there
// is none. A failure on some ranks only is agreed on: every rank throws the same
// dtrain::Error naming the failing ranks and the first one's reason.
std::optional<CheckpointInfo> resume_training_state(TrainingState& state, const CheckpointStore& store,
                                                    DataLoader* loader);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
