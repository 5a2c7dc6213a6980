// Saving training state: what a step's state is, written unsplit so any layout can resume it.
#include "dtrain/engine/state/training_state.h"

#include <map>
#include <memory>
#include <unordered_set>

#include <ATen/ATen.h>
#include <glog/logging.h>
#include <torch/nn/module.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/core/gather_texts.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/prune.h"
#include "training_state_internal.h"

namespace dtrain::engine {

namespace training_state_detail {

int64_t param_index_of(const std::string& state_name) {
  auto dot = state_name.find('.');
  return dot == std::string::npos ? -1 : std::stoll(state_name.substr(0, dot));
}

std::string shift_param_index(const std::string& state_name, int64_t delta) {
  const int64_t i = param_index_of(state_name);
  return i < 0 ? state_name : std::to_string(i + delta) + state_name.substr(state_name.find('.'));
}

NamedTensors state_outside(torch::nn::Module& model, const std::vector<std::string>& trained) {
  const std::unordered_set<std::string> flat(trained.begin(), trained.end());
  NamedTensors out;
  for (auto& [name, t] : model_state(model)) {
    if (!flat.count(name)) out.emplace_back(name, t);
  }
  return out;
}

int64_t flat_numel(const std::vector<at::Tensor>& params) {
  int64_t numel = 0;
  for (const at::Tensor& p : params) numel += p.numel();
  return numel;
}

StageSpace stage_space(const TrainingState& s, int64_t numel) {
  StageSpace space;
  space.stage = s.mesh.pp_rank();
  space.stages = s.mesh.pp_size();
  if (s.pp_flat_numels.empty()) return space;
  const int tp_size = s.mesh.tp_size(), tp_rank = s.mesh.tp_rank();
  space.whole_numel = 0;
  for (int st = 0; st < space.stages; ++st) {
    const int64_t n = s.pp_flat_numels[static_cast<size_t>(st * tp_size + tp_rank)];
    if (st < space.stage) space.offset += n;
    space.whole_numel += n;
  }
  DTRAIN_CHECK(s.pp_flat_numels[static_cast<size_t>(space.stage * tp_size + tp_rank)] == numel,
               "pipeline stage ", space.stage, ": its flat space has ", numel, " elements, but ",
               s.pp_flat_numels[static_cast<size_t>(space.stage * tp_size + tp_rank)],
               " were counted when the trainer was built");
  return space;
}

}  // namespace training_state_detail

namespace {

using training_state_detail::param_index_of;
using training_state_detail::shift_param_index;
using training_state_detail::state_outside;

// A host copy of t for a checkpoint: staged (pinned, asynchronous, see HostStaging) for a
// background save, else a plain copy that is written before training goes on.
at::Tensor host_copy(const std::string& key, const at::Tensor& t, HostStaging::Source source, HostStaging* staging) {
  if (staging) return staging->stage(key, t, source);
  // Written before training goes on: a host tensor needs no copy, a device one a plain one.
  return t.device().is_cpu() ? t.detach() : t.detach().cpu();
}

NamedTensors full_model_state(const TrainingState& s, HostStaging* staging) {
  NamedTensors state = model_state(s.model);
  std::map<std::string, at::Tensor> full;
  if (s.mesh.tp_size() > 1) full = gather_full_state(s.model, s.mesh.tp());
  // model_state() detaches (new TensorImpls over the same storage): weights are known by storage.
  std::unordered_set<const void*> weights;
  for (const at::Tensor& p : s.params) weights.insert(p.storage().unsafeGetStorageImpl());
  for (auto& [name, t] : state) {
    auto it = full.find(name);
    if (it != full.end()) {
      t = it->second;  // gathered into new host tensors
      continue;
    }
    // Weights change only in the next update; buffers (running statistics) in the next forward.
    const auto source = weights.count(t.storage().unsafeGetStorageImpl()) ? HostStaging::kUntilNextUpdate : HostStaging::kNow;
    t = host_copy("model." + name, t, source, staging);
  }
  return state;
}

NamedTensors full_optimizer_state(const TrainingState& s, HostStaging* staging) {
  // The replicated part (a partitioned part goes into the rank files). state() may make
  // tensors just now, on the current stream (SGD's step counters): staged, each is copied after
  // the work issued before its stage() call, so after that write (HostStaging).
  NamedTensors state = s.optimizer->state();
  for (auto& [name, t] : state) {
    int64_t i = param_index_of(name);
    const bool sharded = i >= 0 && i < static_cast<int64_t>(s.params.size()) && s.tp_splits.count(s.names[i]) &&
                         t.sizes() == s.params[i].sizes();
    t = sharded ? gather_full_tensor(t, s.tp_splits.at(s.names[i]), s.mesh.tp()).cpu()
                : host_copy("optimizer." + name, t, HostStaging::kUntilNextUpdate, staging);
  }
  return state;
}

// Pipeline: this stage's optimizer state renumbered to the whole model's parameter indices,
// and (data- and tensor-parallel rank 0 of a stage after the first) the stage's part of the
// model and optimizer moved into its rank file (RankState::stage_model, stage_optimizer).
void pipeline_stage_part(const TrainingState& s, CheckpointData& data, RankState& rank) {
  // Optimizer state is keyed by parameter index: this stage's follow the stages' before it.
  NamedTensors shifted;
  for (auto& [name, t] : data.optimizer) {
    const int64_t i = param_index_of(name);
    const int64_t whole = s.pp_param_index.empty() || i < 0 ? i + s.pp_param_offset : s.pp_param_index.at(i);
    shifted.emplace_back(i < 0 ? name : shift_param_index(name, whole - i), t);
  }
  data.optimizer = std::move(shifted);
  // Each stage saves its own layers: stage 0's go into the main file (rank 0), every other
  // stage's into the rank file of its data- and tensor-parallel rank 0 (CheckpointStore::load
  // puts the parts together again).
  if (s.mesh.pp_rank() > 0 && s.mesh.replicas().rank() == 0 && s.mesh.tp_rank() == 0) {
    rank.stage_model = std::move(data.model);
    rank.stage_optimizer = std::move(data.optimizer);
    data.model.clear();
    data.optimizer.clear();
  }
}

// The layout a resume under another --tp, --pp or --shard needs, into a checkpoint's meta:
// the flat space's parameters (flat.params; model.partitioned under ZeRO-3), each
// tensor-parallel split (tp.splits), tp, pp and each stage's flat size (collective over the
// world under --pp).
void record_layout(const TrainingState& s, std::map<std::string, std::string>& meta, bool weights_partitioned) {
  dist::Communicator& world = s.mesh.world();
  const std::optional<ShardLayout> optimizer_layout = s.optimizer->shard_layout();
  if (weights_partitioned || (optimizer_layout && optimizer_layout->numel == training_state_detail::flat_numel(s.params))) {
    // The flat space's parameters (name:elements, in order; a resume checks its model against
    // them) and each tensor-parallel split (name=dim:parts:full:padded), with which a resume
    // under another --tp puts the tensor-parallel ranks' ranges together into whole tensors.
    // Under --pp the stages' lists end to end (each from its data- and tensor-parallel rank 0).
    std::string layout, splits;
    for (size_t i = 0; i < s.params.size(); ++i) {
      layout += (i ? "," : "") + s.names[i] + ":" + std::to_string(s.params[i].numel());
      auto spec = s.tp_splits.find(s.names[i]);
      if (spec != s.tp_splits.end()) splits += (splits.empty() ? "" : ";") + s.names[i] + "=" + to_text(spec->second);
    }
    if (s.mesh.pp_size() > 1) {
      const std::vector<std::string> all = gather_texts(world, layout + "|" + splits);  // collective over the world
      const int per_stage = world.size() / s.mesh.pp_size();
      layout.clear();
      splits.clear();
      for (int st = 0; st < s.mesh.pp_size(); ++st) {
        const std::string& stage = all[static_cast<size_t>(st * per_stage)];
        const size_t bar = stage.find('|');
        layout += (st ? "," : "") + stage.substr(0, bar);
        const std::string stage_splits = stage.substr(bar + 1);
        if (!stage_splits.empty()) splits += (splits.empty() ? "" : ";") + stage_splits;
      }
    }
    if (weights_partitioned) meta["model.partitioned"] = layout;
    meta["flat.params"] = layout;
    meta["tp.splits"] = splits;
  }
  meta["tp"] = std::to_string(s.mesh.tp_size());
  meta["pp"] = std::to_string(s.mesh.pp_size());
  if (!s.pp_flat_numels.empty()) {  // where each stage's partitioned state lies in the whole model's
    std::string counts;
    for (int64_t n : s.pp_flat_numels) counts += (counts.empty() ? "" : ",") + std::to_string(n);
    meta["pp.flat_numel"] = counts;
  }
}

// The model's and the replicated optimizer's state, the masks and the scaler's (collective
// over tp): whole tensors, or under ZeRO-3 the model outside the flat space.
void copy_tensors(const TrainingState& s, CheckpointData& data, bool weights_partitioned, HostStaging* staging) {
  if (weights_partitioned) {
    for (auto& [name, t] : state_outside(s.model, s.names)) {
      DTRAIN_CHECK(!s.tp_splits.count(name), "--shard=parameters: '", name, "' is split over tensor-parallel ranks ",
                   "but is not a trainable parameter; such a model cannot be saved in shards yet");
      data.model.emplace_back(name, host_copy("model." + name, t, HostStaging::kNow, staging));
    }
  } else {
    data.model = full_model_state(s, staging);      // collective over tp
  }
  data.optimizer = full_optimizer_state(s, staging);  // collective over tp
  if (s.pruner) data.masks = s.pruner->full_masks();  // collective over tp
  if (s.scaler) {
    for (auto& [name, t] : s.scaler->state()) {
      data.scaler.emplace_back(name, host_copy("scaler." + name, t, HostStaging::kNow, staging));
    }
  }
}

// A background write must not see the training change what it writes: every tensor that
// may alias live state is copied (the model and replicated optimizer state are staged).
void own_the_rest(PreparedCheckpoint& save, HostStaging& staging) {
  for (auto& [name, t] : save.rank.optimizer_shard.tensors) {
    t = staging.stage("shard." + name, t, HostStaging::kUntilNextUpdate);
  }
  staging.seal();
  auto copy_rng = [](RngState& r) {
    if (r.cpu.defined()) r.cpu = r.cpu.clone();
    for (at::Tensor& t : r.cuda) t = t.clone();
  };
  copy_rng(save.data.rng);
  copy_rng(save.rank.rng);
}

}  // namespace

PreparedCheckpoint prepare_training_state(const TrainingState& s, const DataLoader* loader, HostStaging* staging) {
  DTRAIN_CHECK(s.optimizer != nullptr, "prepare_training_state: the state has no optimizer (weights only); ",
               "only a training state is saved");
  dist::Communicator& world = s.mesh.world();
  // ZeRO-3: no unit is gathered. Each rank's range of the weights goes into its rank file (the
  // partitioned "master"); the main file holds the rest of the model (buffers, frozen weights).
  const bool weights_partitioned = s.units != nullptr;
  PreparedCheckpoint save;
  // Never a checkpoint of non-finite weights (rotation could then push out the last good one).
  // One flag per device, computed where the weights are and read by write_training_state: the
  // training thread does not wait for the device here (ZeRO-3: each rank's range, below).
  std::map<std::string, std::vector<at::Tensor>> by_device;
  if (!weights_partitioned) {
    for (const at::Tensor& p : s.params) by_device[p.device().str()].push_back(p);
  }
  for (auto& [device, weights] : by_device) {
    save.nonfinite.push_back(host_copy("nonfinite." + device, any_nonfinite(weights), HostStaging::kNow, staging));
  }
  CheckpointData& data = save.data;
  data.step = s.step;
  copy_tensors(s, data, weights_partitioned, staging);
  data.rng = capture_rng_state();
  data.meta = s.meta;
  data.meta["accum_steps"] = std::to_string(s.accum_steps);
  record_layout(s, data.meta, weights_partitioned);  // collective over the world under --pp
  // Each loader's position and what it means: the global batch, the order's seed and the
  // dataset's size (a resume with another global batch finds the same sample).
  const auto record_position = [&](const DataLoader& l, const std::string& key) {
    auto [epoch, index] = l.position();
    data.meta[key] = std::to_string(epoch) + "," + std::to_string(index);
    data.meta[key + ".batch"] = std::to_string(l.options().batch_size * l.options().dp_size);
    data.meta[key + ".seed"] = std::to_string(l.options().seed);
    data.meta[key + ".samples"] = std::to_string(l.dataset_size());
  };
  if (loader) record_position(*loader, "loader.train");
  if (s.eval_loader) record_position(*s.eval_loader, "loader.eval");
  data.world_size = world.size();
  // The checkpoint's "data-parallel" ranks are the replicas (dp x cp): the ranks among which
  // the optimizer state is partitioned, world rank (stage * replicas + replica) * tp + tp rank.
  // The loader's position counts global batches, whatever the layout.
  data.dp_size = s.mesh.replicas().size();
  data.rank_files = world.size();
  RankState& rank = save.rank;
  rank.rank = world.rank();
  rank.dp_rank = s.mesh.replicas().rank();
  rank.dp_size = s.mesh.replicas().size();
  rank.tp_rank = s.mesh.tp_rank();
  if (s.mesh.pp_size() > 1) pipeline_stage_part(s, data, rank);
  rank.rng = data.rng;
  data.meta["optimizer.offloaded"] = s.offloaded_optimizer ? "1" : "0";
  data.meta["optimizer.partitioned"] = s.optimizer->shard_layout() ? "1" : "0";
  if (s.optimizer->shard_layout()) rank.optimizer_shard = s.optimizer->shard_state();
  if (weights_partitioned) {  // this rank's range of the weights: the fp32 master
    for (const auto& [name, t] : rank.optimizer_shard.tensors) {
      if (name == "master") save.nonfinite.push_back(any_nonfinite({t}));
    }
  }
  if (staging) own_the_rest(save, *staging);
  return save;
}

std::string write_training_state(const PreparedCheckpoint& save, CheckpointStore& store, dist::Communicator& comm) {
  float nonfinite = 0;
  for (const at::Tensor& flag : save.nonfinite) nonfinite += flag.item<float>();
  at::Tensor bad = at::full({1}, nonfinite > 0 ? 1 : 0, at::kLong);
  comm.all_reduce(bad, dist::ReduceOp::kMax)->wait();
  DTRAIN_CHECK(bad.item<int64_t>() == 0, "step ", save.data.step, ": the weights are not finite on some rank; no ",
               "checkpoint is written (the saved ones in '", store.dir(), "' stay as they are). Resume from ",
               "the newest with a lower --lr");
  std::string path = save_checkpoint(store, comm, save.data, save.rank);
  if (comm.rank() == 0) LOG(INFO) << "saved checkpoint of step " << save.data.step << " to " << path;
  return path;
}

std::string save_training_state(const TrainingState& state, CheckpointStore& store, const DataLoader* loader) {
  return write_training_state(prepare_training_state(state, loader), store, state.mesh.world());
}

std::optional<CheckpointInfo> resume_training_state(TrainingState& state, const CheckpointStore& store,
                                                    DataLoader* loader) {
  dist::Communicator& world = state.mesh.world();
  int64_t skipped = 0;
  std::optional<CheckpointInfo> info = agree_latest_good(store, world, &skipped);
  // Checkpoints, none of them good: a run that went on as if there were none would start over
  // at step 1 beside them (and prune them), the run they hold lost without a word.
  DTRAIN_CHECK(info || skipped == 0, "'", store.dir(), "' holds ", skipped, " checkpoint(s) and none of them is good ",
               "(rank 0's log says why it skipped each: no checksum record, truncated, corrupt): resuming cannot ",
               "continue that run, and starting over would train from step 1 beside them. Restore them (a copy needs ",
               "the .crc files too), or start over with --resume=no --save_dir_exists=overwrite (removes them) or another "
               "--save_dir");
  if (!info) return info;
  std::string error;
  try {
    restore_training_state(state, store, *info, loader);
  } catch (const std::exception& e) {
    error = e.what();
    LOG(ERROR) << "cannot resume from " << info->path << ": " << error;
  }
  // Collective: every rank learns every rank's failure and throws the same message, or none does.
  const std::vector<std::string> errors = gather_texts(world, error);
  std::string ranks, first;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    if (first.empty()) first = "rank " + std::to_string(r) + ": " + errors[r];
  }
  if (!ranks.empty()) {
    throw Error(detail::concat("cannot resume from ", info->path, ": it failed on rank(s) ", ranks, " (", first, ")"));
  }
  return info;
}

}  // namespace dtrain::engine
