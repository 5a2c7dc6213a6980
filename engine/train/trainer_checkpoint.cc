// Trainer checkpoints: what a step's state is, written unsplit so any layout can resume it.
#include <map>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::engine {
namespace {

// ZeRO-3 (--shard=parameters): every unit gathered while this lives, released after.
class GatheredUnits {
 public:
  explicit GatheredUnits(ParameterUnits* units) : units_(units) {
    if (units_) units_->gather_all();
  }
  ~GatheredUnits() {
    if (units_) units_->release_all();
  }
  GatheredUnits(const GatheredUnits&) = delete;
  GatheredUnits& operator=(const GatheredUnits&) = delete;

 private:
  ParameterUnits* units_;
};

// "<param index>.<state name>" -> the parameter index.
int64_t param_index_of(const std::string& state_name) {
  auto dot = state_name.find('.');
  return dot == std::string::npos ? -1 : std::stoll(state_name.substr(0, dot));
}

// "<param index>.<state name>" with the index moved by delta (pipeline stages number their
// parameters from 0; the whole model's numbering runs on across the stages).
std::string shift_param_index(const std::string& state_name, int64_t delta) {
  const int64_t i = param_index_of(state_name);
  return i < 0 ? state_name : std::to_string(i + delta) + state_name.substr(state_name.find('.'));
}

// The model's state outside the flat space of `trained` (ZeRO-3 keeps those weights in the
// ranks' partitioned state): its buffers and frozen weights, aliasing the module's.
NamedTensors state_outside(torch::nn::Module& model, const std::vector<std::string>& trained) {
  const std::unordered_set<std::string> flat(trained.begin(), trained.end());
  NamedTensors out;
  for (auto& [name, t] : model_state(model)) {
    if (!flat.count(name)) out.emplace_back(name, t);
  }
  return out;
}

std::pair<int64_t, int64_t> parse_position(const std::string& text, const std::string& source) {
  std::istringstream in(text);
  int64_t epoch = 0, index = 0;
  char comma = 0;
  DTRAIN_CHECK((in >> epoch >> comma >> index) && comma == ',', source,
               ": malformed data position '", text, "'");
  return {epoch, index};
}

// Meta "flat.params": name:elements, comma-separated, in the flat space's order.
std::vector<std::pair<std::string, int64_t>> parse_flat_params(const std::string& text, const std::string& source) {
  std::vector<std::pair<std::string, int64_t>> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const auto colon = item.rfind(':');
    DTRAIN_CHECK(colon != std::string::npos, source, ": malformed meta 'flat.params' entry '", item, "'");
    out.emplace_back(item.substr(0, colon), std::stoll(item.substr(colon + 1)));
  }
  return out;
}

// Meta "tp.splits": name=dim:parts:full:padded, semicolon-separated.
std::map<std::string, ShardSpec> parse_tp_splits(const std::string& text, const std::string& source) {
  std::map<std::string, ShardSpec> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ';');) {
    const auto eq = item.find('=');
    DTRAIN_CHECK(eq != std::string::npos, source, ": malformed meta 'tp.splits' entry '", item, "'");
    out[item.substr(0, eq)] = shard_spec_from_text(item.substr(eq + 1), source);
  }
  return out;
}

// A tensor-parallel rank's partitioned state entry `slot`.
at::Tensor slot_of(const ShardState& state, const std::string& slot, const std::string& source) {
  for (const auto& [name, t] : state.tensors) {
    if (name == slot) return t;
  }
  throw Error(detail::concat("checkpoint ", source, ": a tensor-parallel rank's partitioned state has no '", slot,
                             "' (the ranks' files disagree)"));
}

}  // namespace

at::Tensor Trainer::host_copy(const std::string& key, const at::Tensor& t, HostStaging::Source source,
                              bool staged) {
  if (staged) return staging_.stage(key, t, source);
  // Written before training goes on: a host tensor needs no copy, a device one a plain one.
  return t.device().is_cpu() ? t.detach() : t.detach().cpu();
}

NamedTensors Trainer::full_model_state(bool staged) {
  NamedTensors state = model_state(model_);
  std::map<std::string, at::Tensor> full;
  if (mesh_.tp_size() > 1) full = gather_full_state(model_, mesh_.tp());
  // model_state() detaches (new TensorImpls over the same storage): weights are known by storage.
  std::unordered_set<const void*> weights;
  for (const at::Tensor& p : params_) weights.insert(p.storage().unsafeGetStorageImpl());
  for (auto& [name, t] : state) {
    auto it = full.find(name);
    if (it != full.end()) {
      t = it->second;  // gathered into new host tensors
      continue;
    }
    // Weights change only in the next update; buffers (running statistics) in the next forward.
    const auto source = weights.count(t.storage().unsafeGetStorageImpl()) ? HostStaging::kUntilNextUpdate : HostStaging::kNow;
    t = host_copy("model." + name, t, source, staged);
  }
  return state;
}

NamedTensors Trainer::full_optimizer_state(bool staged) {
  // The replicated part (a partitioned part goes into the rank files). state() may make
  // tensors just now, on the current stream (SGD's step counters): staged, each is copied after
  // the work issued before its stage() call, so after that write (HostStaging).
  NamedTensors state = optimizer_->state();
  for (auto& [name, t] : state) {
    int64_t i = param_index_of(name);
    const bool sharded = i >= 0 && i < static_cast<int64_t>(params_.size()) && sharded_[i] &&
                         t.sizes() == params_[i].sizes();
    t = sharded ? gather_full_tensor(t, specs_.at(names_[i]), mesh_.tp()).cpu()
                : host_copy("optimizer." + name, t, HostStaging::kUntilNextUpdate, staged);
  }
  return state;
}

ShardState Trainer::shard_of_replicated(const NamedTensors& replicated, const ShardLayout& layout) const {
  // Each state array is the parameters' tensors end to end (the flat space); the range of it.
  std::map<std::string, std::vector<at::Tensor>> arrays;
  at::Tensor step;
  for (const auto& [name, t] : replicated) {
    const std::string slot = name.substr(name.find('.') + 1);
    if (slot == "step") {
      if (!step.defined()) step = t.detach().cpu();
      continue;
    }
    arrays[slot].push_back(t.detach().reshape({-1}));
  }
  std::vector<at::Tensor> weights;
  for (const at::Tensor& p : params_) weights.push_back(p.detach().reshape({-1}));
  arrays["master"] = weights;
  ShardState out;
  out.layout = layout;
  if (step.defined()) out.tensors.emplace_back("step", step);
  for (auto& [slot, parts] : arrays) {
    DTRAIN_CHECK(parts.size() == params_.size(), "the saved optimizer state has '", slot, "' for ", parts.size(),
                 " of the ", params_.size(), " parameters");
    out.tensors.emplace_back(slot, at::cat(parts)
                                       .narrow(0, layout.range.begin, layout.range.size())
                                       .to(at::TensorOptions().device(at::kCPU), false, true));
  }
  return out;
}

NamedTensors Trainer::replicated_of_shard(const ShardState& whole) const {
  // Every parameter's "step" is the shard's; each array's slice of it, shaped as the parameter.
  NamedTensors out;
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    for (const auto& [name, t] : whole.tensors) {
      if (name == "master") continue;
      out.emplace_back(std::to_string(i) + "." + name,
                       name == "step" ? t.reshape({})
                                      : t.narrow(0, offset, p.numel()).view(p.sizes()).to(p.options(), false, true));
    }
    offset += p.numel();
  }
  return out;
}

StageSpace Trainer::stage_space(int64_t numel) const {
  StageSpace space;
  space.stage = mesh_.pp_rank();
  space.stages = mesh_.pp_size();
  if (pp_flat_numels_.empty()) return space;
  space.whole_numel = 0;
  for (int s = 0; s < space.stages; ++s) {
    const int64_t n = pp_flat_numels_[static_cast<size_t>(s * mesh_.tp_size() + mesh_.tp_rank())];
    if (s < space.stage) space.offset += n;
    space.whole_numel += n;
  }
  DTRAIN_CHECK(pp_flat_numels_[static_cast<size_t>(space.stage * mesh_.tp_size() + mesh_.tp_rank())] == numel,
               "pipeline stage ", space.stage, ": its flat space has ", numel, " elements, but ",
               pp_flat_numels_[static_cast<size_t>(space.stage * mesh_.tp_size() + mesh_.tp_rank())],
               " were counted when the trainer was built");
  return space;
}

void Trainer::pipeline_stage_part(CheckpointData& data, RankState& rank) const {
  // Optimizer state is keyed by parameter index: this stage's follow the stages' before it.
  NamedTensors shifted;
  for (auto& [name, t] : data.optimizer) shifted.emplace_back(shift_param_index(name, pp_param_offset_), t);
  data.optimizer = std::move(shifted);
  // Each stage saves its own layers: stage 0's go into the main file (rank 0), every other
  // stage's into the rank file of its data- and tensor-parallel rank 0 (CheckpointStore::load
  // puts the parts together again).
  if (mesh_.pp_rank() > 0 && mesh_.dp_rank() == 0 && mesh_.tp_rank() == 0) {
    rank.stage_model = std::move(data.model);
    rank.stage_optimizer = std::move(data.optimizer);
    data.model.clear();
    data.optimizer.clear();
  }
}

void Trainer::record_layout(std::map<std::string, std::string>& meta, bool weights_partitioned) const {
  dist::Communicator& world = mesh_.world();
  int64_t flat_numel = 0;
  for (const at::Tensor& p : params_) flat_numel += p.numel();
  const std::optional<ShardLayout> optimizer_layout = optimizer_->shard_layout();
  if (weights_partitioned || (optimizer_layout && optimizer_layout->numel == flat_numel)) {
    // The flat space's parameters (name:elements, in order; a resume checks its model against
    // them) and each tensor-parallel split (name=dim:parts:full:padded), with which a resume
    // under another --tp puts the tensor-parallel ranks' ranges together into whole tensors.
    // Under --pp the stages' lists end to end (each from its data- and tensor-parallel rank 0).
    std::string layout, splits;
    for (size_t i = 0; i < params_.size(); ++i) {
      layout += (i ? "," : "") + names_[i] + ":" + std::to_string(params_[i].numel());
      auto spec = specs_.find(names_[i]);
      if (spec != specs_.end()) splits += (splits.empty() ? "" : ";") + names_[i] + "=" + to_text(spec->second);
    }
    if (mesh_.pp_size() > 1) {
      const std::vector<std::string> all = gather_texts(world, layout + "|" + splits);  // collective over the world
      const int per_stage = world.size() / mesh_.pp_size();
      layout.clear();
      splits.clear();
      for (int s = 0; s < mesh_.pp_size(); ++s) {
        const std::string& stage = all[static_cast<size_t>(s * per_stage)];
        const size_t bar = stage.find('|');
        layout += (s ? "," : "") + stage.substr(0, bar);
        const std::string stage_splits = stage.substr(bar + 1);
        if (!stage_splits.empty()) splits += (splits.empty() ? "" : ";") + stage_splits;
      }
    }
    if (weights_partitioned) meta["model.partitioned"] = layout;
    meta["flat.params"] = layout;
    meta["tp.splits"] = splits;
  }
  meta["tp"] = std::to_string(mesh_.tp_size());
  meta["pp"] = std::to_string(mesh_.pp_size());
  if (!pp_flat_numels_.empty()) {  // where each stage's partitioned state lies in the whole model's
    std::string counts;
    for (int64_t n : pp_flat_numels_) counts += (counts.empty() ? "" : ",") + std::to_string(n);
    meta["pp.flat_numel"] = counts;
  }
}

Trainer::PreparedSave Trainer::prepare_save(const DataLoader* loader, bool own_copies) {
  DTRAIN_CHECK(!options_.evaluation_only, "this trainer was built for evaluation only (--eval_only): it saves "
               "no checkpoints");
  settle_nonfinite();  // the deferred watch's policy before a checkpoint of these steps
  flush_updates();     // a delayed update in flight goes into the saved weights
  dist::Communicator& world = mesh_.world();
  // ZeRO-3: no unit is gathered. Each rank's range of the weights goes into its rank file (the
  // partitioned "master"); the main file holds the rest of the model (buffers, frozen weights).
  const bool weights_partitioned = units_ != nullptr;
  PreparedSave save;
  // Never a checkpoint of non-finite weights (rotation could then push out the last good one).
  // One flag per device, computed where the weights are and read by write_save: the training
  // thread does not wait for the device here (ZeRO-3: each rank's range, below).
  std::map<std::string, std::vector<at::Tensor>> by_device;
  if (!weights_partitioned) {
    for (const at::Tensor& p : params_) by_device[p.device().str()].push_back(p);
  }
  for (auto& [device, weights] : by_device) {
    save.nonfinite.push_back(host_copy("nonfinite." + device, any_nonfinite(weights), HostStaging::kNow, own_copies));
  }
  CheckpointData& data = save.data;
  data.step = step_;
  if (weights_partitioned) {
    for (auto& [name, t] : state_outside(model_, names_)) {
      DTRAIN_CHECK(!specs_.count(name), "--shard=parameters: '", name, "' is split over tensor-parallel ranks but ",
                   "is not a trainable parameter; such a model cannot be saved in shards yet");
      data.model.emplace_back(name, host_copy("model." + name, t, HostStaging::kNow, own_copies));
    }
  } else {
    data.model = full_model_state(own_copies);      // collective over tp
  }
  data.optimizer = full_optimizer_state(own_copies);  // collective over tp
  if (pruner_) data.masks = pruner_->full_masks();     // collective over tp
  for (auto& [name, t] : scaler_->state()) {
    data.scaler.emplace_back(name, host_copy("scaler." + name, t, HostStaging::kNow, own_copies));
  }
  data.rng = capture_rng_state();
  data.meta = options_.checkpoint_meta;
  data.meta["accum_steps"] = std::to_string(accum_steps_);
  record_layout(data.meta, weights_partitioned);  // collective over the world under --pp
  if (loader) {
    auto [epoch, index] = loader->position();
    data.meta["loader.train"] = std::to_string(epoch) + "," + std::to_string(index);
  }
  if (eval_) {
    auto [epoch, index] = eval_->position();
    data.meta["loader.eval"] = std::to_string(epoch) + "," + std::to_string(index);
  }
  data.world_size = world.size();
  data.dp_size = mesh_.dp_size();
  data.rank_files = world.size();
  RankState& rank = save.rank;
  rank.rank = world.rank();
  rank.dp_rank = mesh_.dp_rank();
  rank.dp_size = mesh_.dp_size();
  rank.tp_rank = mesh_.tp_rank();
  if (mesh_.pp_size() > 1) pipeline_stage_part(data, rank);
  rank.rng = data.rng;
  data.meta["optimizer.offloaded"] = options_.offload_optimizer ? "1" : "0";
  data.meta["optimizer.partitioned"] = optimizer_->shard_layout() ? "1" : "0";
  if (optimizer_->shard_layout()) rank.optimizer_shard = optimizer_->shard_state();
  if (weights_partitioned) {  // this rank's range of the weights: the fp32 master
    for (const auto& [name, t] : rank.optimizer_shard.tensors) {
      if (name == "master") save.nonfinite.push_back(any_nonfinite({t}));
    }
  }
  if (own_copies) own_the_rest(save);
  return save;
}

void Trainer::own_the_rest(PreparedSave& save) {
  // A background write must not see the training change what it writes: every tensor that
  // may alias live state is copied (the model and replicated optimizer state are staged).
  for (auto& [name, t] : save.rank.optimizer_shard.tensors) {
    t = staging_.stage("shard." + name, t, HostStaging::kUntilNextUpdate);
  }
  staging_.seal();
  auto copy_rng = [](RngState& r) {
    if (r.cpu.defined()) r.cpu = r.cpu.clone();
    for (at::Tensor& t : r.cuda) t = t.clone();
  };
  copy_rng(save.data.rng);
  copy_rng(save.rank.rng);
}

std::string Trainer::write_save(const PreparedSave& save, dist::Communicator& comm) {
  CheckpointStoreOptions so;
  so.keep_last = options_.keep_last;
  so.fs = options_.checkpoint_fs;
  CheckpointStore store(options_.save_dir, so);
  float nonfinite = 0;
  for (const at::Tensor& flag : save.nonfinite) nonfinite += flag.item<float>();
  at::Tensor bad = at::full({1}, nonfinite > 0 ? 1 : 0, at::kLong);
  comm.all_reduce(bad, dist::ReduceOp::kMax)->wait();
  DTRAIN_CHECK(bad.item<int64_t>() == 0, "step ", save.data.step, ": the weights are not finite on some rank; no ",
               "checkpoint is written (the saved ones in '", options_.save_dir, "' stay as they are). Resume from ",
               "the newest with a lower --lr");
  std::string path = engine::save_checkpoint(store, comm, save.data, save.rank);
  if (comm.rank() == 0) LOG(INFO) << "saved checkpoint of step " << save.data.step << " to " << path;
  return path;
}

std::string Trainer::save_checkpoint(const DataLoader* loader) {
  wait_for_save();
  PreparedSave save = prepare_save(loader, /*own_copies=*/false);
  std::string path = write_save(save, mesh_.world());
  last_saved_step_ = step_;
  return path;
}

void Trainer::save_checkpoint_async(const DataLoader* loader) {
  wait_for_save();
  // Collective on every rank at the same step (the first periodic save), so the split agrees.
  if (!save_comm_) save_comm_ = mesh_.world().split(0, mesh_.world().rank(), "checkpoint");
  auto save = std::make_shared<PreparedSave>(prepare_save(loader, /*own_copies=*/true));
  last_saved_step_ = step_;
  // The writer thread works on this rank's device (a new thread's current CUDA device is GPU
  // 0, where its first CUDA call would make a context on every rank of the node).
  save_in_flight_ = async_on_device(device_, [this, save] {
    staging_.wait();  // the device copies of prepare_save have landed
    return write_save(*save, *save_comm_);
  });
}

void Trainer::wait_for_save() {
  if (!save_in_flight_.valid()) return;
  save_in_flight_.get();  // rethrows the background save's failure (every rank's save fails alike)
}

bool Trainer::resume_checkpoint(DataLoader* loader, bool required) {
  CheckpointStoreOptions so;
  so.fs = options_.checkpoint_fs;
  CheckpointStore store(options_.save_dir, so);
  dist::Communicator& world = mesh_.world();
  std::optional<CheckpointInfo> info = agree_latest_good(store, world);
  if (!info && !required) {
    if (world.rank() == 0 && !options_.evaluation_only) {
      LOG(INFO) << "--resume=auto: no checkpoint in " << options_.save_dir << " yet; starting at step 1";
    }
    return false;
  }
  DTRAIN_CHECK(info.has_value(), "--resume: no good checkpoint in '", options_.save_dir,
               "'; train without --resume first, use --resume=auto to start fresh when there is "
               "none (or point --save_dir at the run's directory)");
  std::string error;
  try {
    restore_from(store, *info, loader);
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
  return true;
}

std::optional<ShardState> Trainer::restore_partitioned_weights(const CheckpointStore& store, const CheckpointData& data,
                                                               const std::string& layout, NamedTensors& rest,
                                                               const std::string& source,
                                                               const std::optional<ShardState>& other_tp) {
  // The saved flat space's parameters against this model's (a pipeline stage: its own, by name).
  std::map<std::string, int64_t> saved;
  std::istringstream in(layout);
  for (std::string item; std::getline(in, item, ',');) {
    const auto colon = item.rfind(':');
    DTRAIN_CHECK(colon != std::string::npos, source, ": malformed meta 'model.partitioned' entry '", item, "'");
    saved[item.substr(0, colon)] = std::stoll(item.substr(colon + 1));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = saved.find(names_[i]);
    DTRAIN_CHECK(it != saved.end(), "checkpoint ", source, " is of a different model: '", names_[i],
                 "' of this model is not among its weights (", saved.size(), " there, ", params_.size(), " here)");
    // The saved sizes are tensor-parallel rank 0's of the saved layout (another --tp: checked
    // against the whole tensors when they are put together).
    DTRAIN_CHECK(other_tp || mesh_.tp_rank() != 0 || it->second == params_[i].numel(), "checkpoint ", source,
                 " is of a different model: '", names_[i], "' has ", it->second, " elements there but ",
                 params_[i].numel(), " here (another shape flag?)");
  }
  DTRAIN_CHECK(mesh_.pp_size() > 1 || saved.size() == params_.size(), "checkpoint ", source,
               " is of a different model: it has ", saved.size(), " trainable weights, this model ", params_.size());
  // Everything but the flat space's weights from the main file, checked as a whole model is.
  NamedTensors live = state_outside(model_, names_);
  check_same_layout(live, rest, "model", source);
  std::map<std::string, at::Tensor> by_name(rest.begin(), rest.end());
  at::NoGradGuard no_grad;
  for (auto& [name, t] : live) t.copy_(by_name.at(name));
  if (units_) return other_tp;  // ZeRO-3 again: the optimizer's load sets this rank's range of the weights
  // Any other layout takes the whole flat space (of this stage and tensor-parallel rank) from
  // the ranks' ranges of it.
  int64_t numel = 0;
  for (const at::Tensor& p : params_) numel += p.numel();
  ShardState whole = other_tp ? *other_tp
                              : load_resharded_optimizer(store, data, mesh_.tp_rank(), {numel, {0, numel}},
                                                         stage_space(numel));
  at::Tensor master;
  for (const auto& [name, t] : whole.tensors) {
    if (name == "master") master = t;
  }
  DTRAIN_CHECK(master.defined() && master.numel() == numel, "checkpoint ", source, ": the ranks' files hold ",
               master.defined() ? master.numel() : 0, " of the ", numel, " weight elements");
  int64_t offset = 0;
  for (const at::Tensor& p : params_) {
    p.detach().copy_(master.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return whole;
}

ShardState Trainer::whole_from_other_tp(const CheckpointStore& store, const CheckpointData& data, int saved_tp,
                                        const std::string& source) const {
  DTRAIN_CHECK(data.meta.count("flat.params") && data.meta.count("tp.splits"), source, " holds partitioned state ",
               "(--shard, --offload=optimizer) of --tp=", saved_tp, " saved before checkpoints recorded the ",
               "tensor-parallel splits; resume it with --tp=", saved_tp);
  // The saved flat space: every parameter (whole model, stage after stage) with its elements
  // on each tensor-parallel rank, and the splits of those that are split.
  const std::vector<std::pair<std::string, int64_t>> saved = parse_flat_params(data.meta.at("flat.params"), source);
  int64_t saved_numel = 0;
  for (const auto& [name, n] : saved) saved_numel += n;
  const std::map<std::string, ShardSpec> splits = parse_tp_splits(data.meta.at("tp.splits"), source);
  // Each saved tensor-parallel rank's whole flat space (every stage, every data-parallel range).
  std::vector<ShardState> per_rank;
  for (int t = 0; t < saved_tp; ++t) {
    per_rank.push_back(load_resharded_optimizer(store, data, t, {saved_numel, {0, saved_numel}},
                                                StageSpace{0, 1, 0, saved_numel}));
  }
  std::map<std::string, std::pair<int64_t, int64_t>> where;  // name -> (offset, elements) in a saved space
  int64_t offset = 0;
  for (const auto& [name, n] : saved) {
    where[name] = {offset, n};
    offset += n;
  }
  auto entry = [&](const ShardState& state, const std::string& slot) { return slot_of(state, slot, source); };
  // This rank's flat space: its parameters' whole tensors, cut for this --tp, end to end.
  ShardState out;
  int64_t numel = 0;
  for (const at::Tensor& p : params_) numel += p.numel();
  out.layout = {numel, {0, numel}};
  for (const auto& [slot, first] : per_rank.front().tensors) {
    if (first.dim() == 0) {  // the same on every rank ("step")
      out.tensors.emplace_back(slot, first);
      continue;
    }
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto at = where.find(names_[i]);
      DTRAIN_CHECK(at != where.end(), "checkpoint ", source, " is of a different model: '", names_[i],
                   "' is not among its weights");
      auto spec_here = specs_.find(names_[i]);
      auto spec_saved = splits.find(names_[i]);
      // The whole tensor's shape: this rank's shard's, with the split dimension whole.
      std::vector<int64_t> shape(params_[i].sizes().begin(), params_[i].sizes().end());
      if (spec_here != specs_.end()) shape[static_cast<size_t>(spec_here->second.dim)] = spec_here->second.full;
      at::Tensor whole;
      if (spec_saved == splits.end()) {
        const int64_t n = c10::multiply_integers(shape);
        DTRAIN_CHECK(at->second.second == n, "checkpoint ", source, " is of a different model: '", names_[i],
                     "' has ", at->second.second, " elements there but ", n, " here (another shape flag?)");
        whole = entry(per_rank.front(), slot).narrow(0, at->second.first, n).view(shape);
      } else {
        const ShardSpec& s = spec_saved->second;
        DTRAIN_CHECK(s.dim >= 0 && s.dim < static_cast<int>(shape.size()) && shape[static_cast<size_t>(s.dim)] == s.full,
                     "checkpoint ", source, " is of a different model: '", names_[i], "' is split there into ", s.full,
                     " along dimension ", s.dim, ", but has shape ", c10::IntArrayRef(shape), " here");
        std::vector<int64_t> piece_shape = shape;
        piece_shape[static_cast<size_t>(s.dim)] = s.padded / saved_tp;
        std::vector<at::Tensor> pieces;
        for (const ShardState& r : per_rank) {
          pieces.push_back(entry(r, slot).narrow(0, at->second.first, at->second.second).view(piece_shape));
        }
        whole = join_shards(pieces, s);
      }
      at::Tensor cut = spec_here != specs_.end()
                           ? shard_of(whole, spec_here->second, mesh_.tp_rank(), mesh_.tp_size())
                           : whole;
      mine.push_back(cut.reshape({-1}));
    }
    out.tensors.emplace_back(slot, at::cat(mine));
  }
  if (mesh_.world().rank() == 0) {
    LOG(INFO) << source << ": partitioned state of --tp=" << saved_tp << " put together for --tp=" << mesh_.tp_size();
  }
  return out;
}

void Trainer::take_stage_part(CheckpointData& data, NamedTensors& local) const {
  std::unordered_set<std::string> mine;
  for (const auto& item : model_.named_parameters()) mine.insert(item.key());
  for (const auto& item : model_.named_buffers()) mine.insert(item.key());
  NamedTensors part;
  for (auto& [name, t] : local) {
    if (mine.count(name)) part.emplace_back(name, t);
  }
  local = std::move(part);
  NamedTensors state;
  const int64_t begin = pp_param_offset_, end = begin + static_cast<int64_t>(params_.size());
  for (auto& [name, t] : data.optimizer) {
    const int64_t i = param_index_of(name);
    if (i < 0) {
      state.emplace_back(name, t);
    } else if (i >= begin && i < end) {
      state.emplace_back(shift_param_index(name, -begin), t);
    }
  }
  data.optimizer = std::move(state);
}

void Trainer::restore_from(const CheckpointStore& store, const CheckpointInfo& info,
                           DataLoader* loader) {
  CheckpointData data = store.load(info.path);
  // A ZeRO-3 checkpoint keeps the weights in the ranks' partitioned state only.
  const auto partitioned_weights = data.meta.find("model.partitioned");
  const bool weights_partitioned = partitioned_weights != data.meta.end();
  // ZeRO-3 from a checkpoint with whole weights: they are loaded into the whole units, and the
  // optimizer's state (or, from an unsharded checkpoint, the weights themselves) then sets this
  // rank's range.
  GatheredUnits gathered(weights_partitioned ? nullptr : units_.get());
  // The model: every tensor-parallel layout resumes from the unsplit tensors.
  NamedTensors local = data.model;
  // A pipeline stage takes its part of the whole model, and its parameters' optimizer state
  // (renumbered from the whole model's indices to the stage's).
  if (mesh_.pp_size() > 1) take_stage_part(data, local);
  for (auto& [name, t] : local) {
    auto spec = specs_.find(name);
    if (spec != specs_.end()) t = shard_of(t, spec->second, mesh_.tp_rank(), mesh_.tp_size());
  }
  const bool saved_offloaded = data.meta.count("optimizer.offloaded") && data.meta.at("optimizer.offloaded") == "1";
  // Checkpoints from before --shard were partitioned exactly when offloaded.
  const bool saved_partitioned = data.meta.count("optimizer.partitioned")
                                     ? data.meta.at("optimizer.partitioned") == "1"
                                     : saved_offloaded;
  // Partitioned state saved under another tensor-parallel size: this rank's whole flat space,
  // put together from every saved tensor-parallel rank's (whole_from_other_tp).
  const int saved_pp = data.meta.count("pp") ? std::stoi(data.meta.at("pp")) : 1;
  const int saved_tp = data.meta.count("tp") ? std::stoi(data.meta.at("tp"))
                                             : data.world_size / std::max(1, data.dp_size * saved_pp);
  std::optional<ShardState> other_tp;
  if (saved_tp != mesh_.tp_size() && (weights_partitioned || (saved_partitioned && optimizer_))) {
    other_tp = whole_from_other_tp(store, data, saved_tp, info.path);
  }
  std::optional<ShardState> whole = other_tp;  // the whole flat space, when it was read
  if (weights_partitioned) {
    whole = restore_partitioned_weights(store, data, partitioned_weights->second, local, info.path, other_tp);
  } else {
    load_model_state(model_, local, info.path);
  }
  if (!optimizer_) {  // evaluation only: the weights are what it came for
    step_ = data.step;
    return;
  }
  restore_optimizer(store, data, info, saved_partitioned, whole);
  restore_progress(store, data, info, loader);
}

void Trainer::restore_optimizer(const CheckpointStore& store, const CheckpointData& data, const CheckpointInfo& info,
                                bool saved_partitioned, const std::optional<ShardState>& whole) {
  // The replicated optimizer state, sharded over tp the way the parameters are.
  NamedTensors replicated = data.optimizer;
  for (auto& [name, t] : replicated) {
    int64_t i = param_index_of(name);
    if (i >= 0 && i < static_cast<int64_t>(params_.size()) && sharded_[i] && t.dim() > 0) {
      t = shard_of(t, specs_.at(names_[i]), mesh_.tp_rank(), mesh_.tp_size());
    }
    t = t.to(params_[std::max<int64_t>(0, std::min<int64_t>(i, params_.size() - 1))].device());
  }
  int64_t numel = 0;
  for (const at::Tensor& p : params_) numel += p.numel();
  const std::optional<ShardLayout> layout = optimizer_->shard_layout();
  try {
    if (layout && saved_partitioned) {
      // This rank's range from the saved shards of this tensor-parallel rank that overlap it
      // (any old data-parallel size; offloaded and device-sharded shards alike).
      optimizer_->load_shard_state(whole && whole->layout.numel == layout->numel
                                       ? assemble_shard({*whole}, *layout)
                                       : load_resharded_optimizer(store, data, mesh_.tp_rank(), *layout,
                                                                  stage_space(layout->numel)));
    } else if (layout) {
      DTRAIN_CHECK(layout->numel == numel, "the partitioned optimizer covers ", layout->numel, " of the ", numel,
                   " parameter elements (some parameters live on the host); resume with the optimizer the "
                   "checkpoint was saved with");
      optimizer_->load_shard_state(shard_of_replicated(replicated, *layout));
    } else if (saved_partitioned) {
      // An unsharded run from a partitioned checkpoint: the whole flat space, split per parameter.
      replicated = replicated_of_shard(
          whole ? *whole
                : load_resharded_optimizer(store, data, mesh_.tp_rank(), {numel, {0, numel}}, stage_space(numel)));
    }
    // The replicated part (e.g. the host parameters' state of --offload=all), unless it was
    // just cut into this rank's range.
    optimizer_->load_state(layout && !saved_partitioned ? NamedTensors{} : replicated);
  } catch (const Error& e) {
    throw Error(detail::concat(info.path, ": the optimizer state does not fit this run (",
                               e.what(), "); resume with the same --optimizer and model"));
  }
}

void Trainer::restore_progress(const CheckpointStore& store, const CheckpointData& data, const CheckpointInfo& info,
                               DataLoader* loader) {
  dist::Communicator& world = mesh_.world();
  if (!data.scaler.empty() && scaler_->enabled()) scaler_->load_state(data.scaler);
  if (pruner_ && !data.masks.empty()) {
    pruner_->load_masks(data.masks);  // collective over tp
  } else if (!data.masks.empty() && world.rank() == 0) {
    LOG(WARNING) << info.path << " holds pruning masks; this run has no --prune_amount, so pruned weights "
                 << "start at zero but are trained again";
  }
  // Random streams: this rank's own when the layout is the same, else rank 0's.
  RngState rng = data.rng;
  if (data.world_size == world.size() && data.rank_files == world.size()) {
    rng = store.load_rank(info.step, world.rank()).rng;
  }
  restore_rng_state(rng);
  step_ = data.step;
  last_saved_step_ = data.step;
  if (data.meta.count("accum_steps")) accum_steps_ = std::stoi(data.meta.at("accum_steps"));
  if (loader && data.meta.count("loader.train")) {
    auto [epoch, index] = parse_position(data.meta.at("loader.train"), info.path);
    loader->seek(epoch, index);
  }
  if (eval_ && data.meta.count("loader.eval")) {
    auto [epoch, index] = parse_position(data.meta.at("loader.eval"), info.path);
    eval_->seek(epoch, index);
  }
  if (world.rank() == 0) {
    LOG(INFO) << "resumed from " << info.path << " at step " << step_ << " (saved by "
              << data.world_size << " rank(s), dp " << data.dp_size << ")";
  }
}

}  // namespace dtrain::engine
