// Restoring training state: any saved layout into this rank's (training_state.h).
#include <map>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/prune.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/state/training_state.h"
#include "training_state_internal.h"

namespace dtrain::engine {
namespace {

using training_state_detail::flat_numel;
using training_state_detail::param_index_of;
using training_state_detail::shift_param_index;
using training_state_detail::stage_space;
using training_state_detail::state_outside;

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

std::pair<int64_t, int64_t> parse_position(const std::string& text, const std::string& source) {
  std::istringstream in(text);
  int64_t epoch = 0, index = 0;
  char comma = 0;
  DTRAIN_CHECK((in >> epoch >> comma >> index) && comma == ',', source,
               ": malformed data position '", text, "'");
  return {epoch, index};
}

// A loader's saved position (meta `key` = "epoch,index", a global batch of the epoch's seeded
// order) for this run's loader, which may read its samples in global batches of another size
// (another --batch_size or data-parallel size): the position is the epoch's sample offset
// index x saved batch, which the same order continues from. The checkpoint also records the
// global batch, the seed and the dataset's size (`key`.batch, .seed, .samples; older checkpoints
// have none and are sought as saved). Another seed is refused: the epoch's rest would come in
// another order, repeating and skipping samples. Another dataset size is said (LOG(WARNING)).
void seek_saved_position(DataLoader& loader, const std::map<std::string, std::string>& meta, const std::string& key,
                         const std::string& source) {
  auto [epoch, index] = parse_position(meta.at(key), source);
  const LoaderOptions& o = loader.options();
  const int64_t batch = o.batch_size * o.dp_size;
  const int64_t per_epoch = loader.batches_per_epoch();
  const auto recorded = [&](const char* what) -> std::optional<int64_t> {
    auto it = meta.find(key + "." + what);
    if (it == meta.end()) return std::nullopt;
    return std::stoll(it->second);
  };
  const std::optional<int64_t> saved_batch = recorded("batch"), saved_samples = recorded("samples");
  const auto seed = meta.find(key + ".seed");
  DTRAIN_CHECK(seed == meta.end() || !o.shuffle || seed->second == std::to_string(o.seed), "checkpoint ", source,
               ": its data order (", key, ") was drawn with seed ", seed->second,  // only read when recorded
               ", this run's with ", o.seed, ": from the middle of epoch ", epoch, " another order would repeat and "
               "skip samples. Resume with the seed it was trained with (--seed=", seed->second, " in dtrain's programs)");
  if (saved_samples && *saved_samples != loader.dataset_size()) {
    LOG(WARNING) << source << ": the data (" << key << ") has " << loader.dataset_size() << " samples, the checkpoint's had "
                 << *saved_samples << ": epoch " << epoch << "'s order is drawn anew from this data, so its rest may "
                 << "repeat or skip samples trained on before the checkpoint";
  }
  if (!saved_batch || *saved_batch == batch) {
    DTRAIN_CHECK(index < per_epoch, "checkpoint ", source, ": its data position (", key, ": epoch ", epoch,
                 ", global batch ", index, ") is past this run's epoch of ", per_epoch, " global batches of ", batch,
                 " samples; it was saved with another global batch (--batch_size x data-parallel ranks) or other "
                 "data: resume with those");
    loader.seek(epoch, index);
    return;
  }
  const int64_t offset = index * *saved_batch;  // samples of the epoch trained on
  int64_t next = offset / batch;
  if (offset % batch != 0) {
    LOG(WARNING) << source << ": " << key << " stopped after sample " << offset << " of epoch " << epoch
                 << " (global batches of " << *saved_batch << "), not a multiple of this run's global batch of "
                 << batch << ": its last " << offset - next * batch << " samples are trained on again";
  }
  if (next >= per_epoch) {  // the epoch's rest is shorter than one global batch (dropped)
    ++epoch;
    next = 0;
  }
  LOG(INFO) << source << ": " << key << " continues at sample " << next * batch << " of epoch " << epoch
            << ": global batch " << next << " of " << batch << " samples (saved: batch " << index << " of "
            << *saved_batch << ")";
  loader.seek(epoch, next);
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

// A ZeRO-3 checkpoint's flat space (meta "model.partitioned": names and sizes) checked
// against this model's parameters (a pipeline stage: its own, by name).
void check_partitioned_layout(const TrainingState& s, const std::string& layout, const std::string& source,
                              bool other_tp) {
  std::map<std::string, int64_t> saved;
  std::istringstream in(layout);
  for (std::string item; std::getline(in, item, ',');) {
    const auto colon = item.rfind(':');
    DTRAIN_CHECK(colon != std::string::npos, source, ": malformed meta 'model.partitioned' entry '", item, "'");
    saved[item.substr(0, colon)] = std::stoll(item.substr(colon + 1));
  }
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto it = saved.find(s.names[i]);
    DTRAIN_CHECK(it != saved.end(), "checkpoint ", source, " is of a different model: '", s.names[i],
                 "' of this model is not among its weights (", saved.size(), " there, ", s.params.size(), " here)");
    // The saved sizes are tensor-parallel rank 0's of the saved layout (another --tp: checked
    // against the whole tensors when they are put together).
    DTRAIN_CHECK(other_tp || s.mesh.tp_rank() != 0 || it->second == s.params[i].numel(), "checkpoint ", source,
                 " is of a different model: '", s.names[i], "' has ", it->second, " elements there but ",
                 s.params[i].numel(), " here (another shape flag?)");
  }
  DTRAIN_CHECK(s.mesh.pp_size() > 1 || saved.size() == s.params.size(), "checkpoint ", source,
               " is of a different model: it has ", saved.size(), " trainable weights, this model ", s.params.size());
}

// A ZeRO-3 checkpoint's model: `rest` (the main file's tensors) into the buffers and
// untrained weights, and, unless this state shards the weights too, the weights from the
// ranks' partitioned ranges. Returns the whole flat space's partitioned state it read for
// them (none under ZeRO-3), so the optimizer's part is cut from it rather than read again.
std::optional<ShardState> restore_partitioned_weights(const TrainingState& s, const CheckpointStore& store,
                                                      const CheckpointData& data, const std::string& layout,
                                                      NamedTensors& rest, const std::string& source,
                                                      const std::optional<ShardState>& other_tp) {
  check_partitioned_layout(s, layout, source, other_tp.has_value());
  // Everything but the flat space's weights from the main file, checked as a whole model is.
  NamedTensors live = state_outside(s.model, s.names);
  check_same_layout(live, rest, "model", source);
  std::map<std::string, at::Tensor> by_name(rest.begin(), rest.end());
  at::NoGradGuard no_grad;
  for (auto& [name, t] : live) t.copy_(by_name.at(name));
  if (s.units) return other_tp;  // ZeRO-3 again: the optimizer's load sets this rank's range of the weights
  // Any other layout takes the whole flat space (of this stage and tensor-parallel rank) from
  // the ranks' ranges of it.
  const int64_t numel = flat_numel(s.params);
  ShardState whole = other_tp ? *other_tp
                              : load_resharded_optimizer(store, data, s.mesh.tp_rank(), shard_layout_of(numel, 1, 0),
                                                         stage_space(s, numel));
  at::Tensor master;
  for (const auto& [name, t] : whole.tensors) {
    if (name == "master") master = t;
  }
  DTRAIN_CHECK(master.defined() && master.numel() == numel, "checkpoint ", source, ": the ranks' files hold ",
               master.defined() ? master.numel() : 0, " of the ", numel, " weight elements");
  int64_t offset = 0;
  for (const at::Tensor& p : s.params) {
    p.detach().copy_(master.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return whole;
}

// Partitioned state (ZeRO-3's weights, a partitioned optimizer's) saved under another
// tensor-parallel size (saved_tp): every saved tensor-parallel rank's flat space read whole,
// each parameter's tensor put together from them (meta flat.params, tp.splits) and cut for
// this rank; returns this rank's (this stage's) whole flat space, every state entry. Reads
// the whole model's partitioned state on every rank (a layout change, not the common path).
ShardState whole_from_other_tp(const TrainingState& s, const CheckpointStore& store, const CheckpointData& data,
                               int saved_tp, const std::string& source) {
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
    per_rank.push_back(load_resharded_optimizer(store, data, t, shard_layout_of(saved_numel, 1, 0),
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
  const int64_t numel = flat_numel(s.params);
  out.layout = shard_layout_of(numel, 1, 0);
  for (const auto& [slot, first] : per_rank.front().tensors) {
    if (first.dim() == 0) {  // the same on every rank ("step")
      out.tensors.emplace_back(slot, first);
      continue;
    }
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < s.params.size(); ++i) {
      auto at = where.find(s.names[i]);
      DTRAIN_CHECK(at != where.end(), "checkpoint ", source, " is of a different model: '", s.names[i],
                   "' is not among its weights");
      auto spec_here = s.tp_splits.find(s.names[i]);
      auto spec_saved = splits.find(s.names[i]);
      // The whole tensor's shape: this rank's shard's, with the split dimension whole.
      std::vector<int64_t> shape(s.params[i].sizes().begin(), s.params[i].sizes().end());
      if (spec_here != s.tp_splits.end()) shape[static_cast<size_t>(spec_here->second.dim)] = spec_here->second.full;
      at::Tensor whole;
      if (spec_saved == splits.end()) {
        const int64_t n = c10::multiply_integers(shape);
        DTRAIN_CHECK(at->second.second == n, "checkpoint ", source, " is of a different model: '", s.names[i],
                     "' has ", at->second.second, " elements there but ", n, " here (another shape flag?)");
        whole = entry(per_rank.front(), slot).narrow(0, at->second.first, n).view(shape);
      } else {
        const ShardSpec& sp = spec_saved->second;
        DTRAIN_CHECK(sp.dim >= 0 && sp.dim < static_cast<int>(shape.size()) && shape[static_cast<size_t>(sp.dim)] == sp.full,
                     "checkpoint ", source, " is of a different model: '", s.names[i], "' is split there into ", sp.full,
                     " along dimension ", sp.dim, ", but has shape ", c10::IntArrayRef(shape), " here");
        std::vector<int64_t> piece_shape = shape;
        piece_shape[static_cast<size_t>(sp.dim)] = sp.padded / saved_tp;
        std::vector<at::Tensor> pieces;
        for (const ShardState& r : per_rank) {
          pieces.push_back(entry(r, slot).narrow(0, at->second.first, at->second.second).view(piece_shape));
        }
        whole = join_shards(pieces, sp);
      }
      at::Tensor cut = spec_here != s.tp_splits.end()
                           ? shard_of(whole, spec_here->second, s.mesh.tp_rank(), s.mesh.tp_size())
                           : whole;
      mine.push_back(cut.reshape({-1}));
    }
    out.tensors.emplace_back(slot, at::cat(mine));
  }
  if (s.mesh.world().rank() == 0) {
    LOG(INFO) << source << ": partitioned state of --tp=" << saved_tp << " put together for --tp=" << s.mesh.tp_size();
  }
  return out;
}

// Whether the saved flat space holds this rank's parameters as one run in this rank's order (what
// reading a range of it assumes). Not so when the stages' parameters were ordered otherwise: an
// interleaved stage's chunks are not consecutive in the whole model, so a checkpoint saved
// interleaved and resumed under another split (or the other way round) holds them elsewhere.
bool saved_in_this_order(const TrainingState& s, const CheckpointData& data, const std::string& source) {
  if (!data.meta.count("flat.params") || s.names.empty()) return true;
  const std::vector<std::pair<std::string, int64_t>> saved = parse_flat_params(data.meta.at("flat.params"), source);
  size_t k = 0;
  while (k < saved.size() && saved[k].first != s.names[0]) ++k;
  for (size_t i = 0; i < s.names.size(); ++i) {
    if (k + i >= saved.size() || saved[k + i].first != s.names[i]) return false;
  }
  return true;
}

// A pipeline stage's part of the whole model, and its parameters' optimizer state
// renumbered from the whole model's indices to the stage's.
void take_stage_part(const TrainingState& s, CheckpointData& data, NamedTensors& local) {
  std::unordered_set<std::string> mine;
  for (const auto& item : s.model.named_parameters()) mine.insert(item.key());
  for (const auto& item : s.model.named_buffers()) mine.insert(item.key());
  NamedTensors part;
  for (auto& [name, t] : local) {
    if (mine.count(name)) part.emplace_back(name, t);
  }
  local = std::move(part);
  NamedTensors state;
  // The whole model's index of each of this stage's parameters -> its own.
  std::unordered_map<int64_t, int64_t> local_of;
  for (int64_t j = 0; j < static_cast<int64_t>(s.params.size()); ++j) {
    local_of[s.pp_param_index.empty() ? s.pp_param_offset + j : s.pp_param_index.at(j)] = j;
  }
  for (auto& [name, t] : data.optimizer) {
    const int64_t i = param_index_of(name);
    if (i < 0) {
      state.emplace_back(name, t);
    } else if (auto it = local_of.find(i); it != local_of.end()) {
      state.emplace_back(shift_param_index(name, it->second - i), t);
    }
  }
  data.optimizer = std::move(state);
}

// The optimizer's state from any layout: partitioned (any old data-parallel size, or the whole
// flat space already read) or replicated, into a partitioned or replicated optimizer.
void restore_optimizer(const TrainingState& s, const CheckpointStore& store, const CheckpointData& data,
                       const CheckpointInfo& info, bool saved_partitioned, const std::optional<ShardState>& whole) {
  // The replicated optimizer state, sharded over tp the way the parameters are.
  NamedTensors replicated = data.optimizer;
  for (auto& [name, t] : replicated) {
    int64_t i = param_index_of(name);
    if (i >= 0 && i < static_cast<int64_t>(s.params.size()) && s.tp_splits.count(s.names[i]) && t.dim() > 0) {
      t = shard_of(t, s.tp_splits.at(s.names[i]), s.mesh.tp_rank(), s.mesh.tp_size());
    }
    t = t.to(s.params[std::max<int64_t>(0, std::min<int64_t>(i, s.params.size() - 1))].device());
  }
  const int64_t numel = flat_numel(s.params);
  Optimizer& optimizer = *s.optimizer;
  const std::optional<ShardLayout> layout = optimizer.shard_layout();
  try {
    if (layout && saved_partitioned) {
      // This rank's range from the saved shards of this tensor-parallel rank that overlap it
      // (any old data-parallel size; offloaded and device-sharded shards alike).
      optimizer.load_shard_state(whole && whole->layout.numel == layout->numel
                                     ? assemble_shard({*whole}, *layout)
                                     : load_resharded_optimizer(store, data, s.mesh.tp_rank(), *layout,
                                                                stage_space(s, layout->numel)));
    } else if (layout) {
      DTRAIN_CHECK(layout->numel == numel, "the partitioned optimizer covers ", layout->numel, " of the ", numel,
                   " parameter elements (some parameters live on the host); resume with the optimizer the "
                   "checkpoint was saved with");
      optimizer.load_shard_state(shard_of_replicated(s.params, replicated, *layout));
    } else if (saved_partitioned) {
      // An unsharded run from a partitioned checkpoint: the whole flat space, split per parameter.
      replicated = replicated_of_shard(
          s.params, whole ? *whole
                   : load_resharded_optimizer(store, data, s.mesh.tp_rank(), shard_layout_of(numel, 1, 0),
                                              stage_space(s, numel)),
          /*to_param_options=*/true);
    }
    // The replicated part (e.g. the host parameters' state of --offload=all), unless it was
    // just cut into this rank's range.
    optimizer.load_state(layout && !saved_partitioned ? NamedTensors{} : replicated);
  } catch (const Error& e) {
    throw Error(detail::concat(info.path, ": the optimizer state does not fit this run (",
                               e.what(), "); resume with the same --optimizer and model"));
  }
}

// The scaler, masks, random streams, step, accumulation and loader positions.
void restore_progress(TrainingState& s, const CheckpointStore& store, const CheckpointData& data,
                      const CheckpointInfo& info, DataLoader* loader) {
  dist::Communicator& world = s.mesh.world();
  if (!data.scaler.empty() && s.scaler && s.scaler->enabled()) s.scaler->load_state(data.scaler);
  if (s.pruner && !data.masks.empty()) {
    s.pruner->load_masks(data.masks);  // collective over tp
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
  s.step = data.step;
  if (data.meta.count("accum_steps")) s.accum_steps = std::stoi(data.meta.at("accum_steps"));
  if (loader && data.meta.count("loader.train")) seek_saved_position(*loader, data.meta, "loader.train", info.path);
  if (s.eval_loader && data.meta.count("loader.eval")) {
    seek_saved_position(*s.eval_loader, data.meta, "loader.eval", info.path);
  }
  if (world.rank() == 0) {
    LOG(INFO) << "resumed from " << info.path << " at step " << s.step << " (saved by "
              << data.world_size << " rank(s), dp " << data.dp_size << ")";
  }
}

// The model's shape as the programs record it ("shape.<flag>" meta: what builds the model from
// flags) against this run's: a value that differs is another model even where every tensor fits
// (a rope_theta, a tied head, a vocabulary or width the tensors would be padded to).
void check_recorded_shape(const std::map<std::string, std::string>& here,
                          const std::map<std::string, std::string>& saved, const std::string& source) {
  std::string differences;
  for (const auto& [key, value] : here) {
    if (key.rfind("shape.", 0) != 0) continue;
    auto it = saved.find(key);
    if (it == saved.end() || it->second == value) continue;
    differences += (differences.empty() ? " --" : ", --") + key.substr(6) + "=" + it->second + " (here " + value + ")";
  }
  DTRAIN_CHECK(differences.empty(), "checkpoint ", source, " is of a model built with other shape flags:", differences,
               "; give the flags it was trained with");
}

// What the run trains with ("train." meta: the schedule, the optimizer) against the checkpoint's:
// a resume may change it on purpose (more steps, another rate), but never without a word.
void warn_changed_training(const std::map<std::string, std::string>& here,
                           const std::map<std::string, std::string>& saved, const std::string& source) {
  for (const auto& [key, value] : here) {
    if (key.rfind("train.", 0) != 0) continue;
    auto it = saved.find(key);
    if (it == saved.end() || it->second == value) continue;
    LOG(WARNING) << source << " was trained with " << key.substr(6) << " " << it->second << "; this run has " << value
                 << ": from the saved step on it follows this run's (the learning rate may jump); resume with the "
                 << "checkpoint's flags to continue its curve";
  }
}

}  // namespace

void restore_training_state(TrainingState& s, const CheckpointStore& store, const CheckpointInfo& info,
                            DataLoader* loader) {
  CheckpointData data = store.load(info.path);
  check_recorded_shape(s.meta, data.meta, info.path);
  if (s.mesh.world().rank() == 0) warn_changed_training(s.meta, data.meta, info.path);
  // A ZeRO-3 checkpoint keeps the weights in the ranks' partitioned state only.
  const auto partitioned_weights = data.meta.find("model.partitioned");
  const bool weights_partitioned = partitioned_weights != data.meta.end();
  // ZeRO-3 from a checkpoint with whole weights: they are loaded into the whole units, and the
  // optimizer's state (or, from an unsharded checkpoint, the weights themselves) then sets this
  // rank's range.
  GatheredUnits gathered(weights_partitioned ? nullptr : s.units);
  // The model: every tensor-parallel layout resumes from the unsplit tensors.
  NamedTensors local = data.model;
  // A pipeline stage takes its part of the whole model, and its parameters' optimizer state
  // (renumbered from the whole model's indices to the stage's).
  if (s.mesh.pp_size() > 1) take_stage_part(s, data, local);
  for (auto& [name, t] : local) {
    auto spec = s.tp_splits.find(name);
    if (spec == s.tp_splits.end()) continue;
    const ShardSpec& sp = spec->second;
    // Saved unsplit and unpadded: a size other than the layer's is another model's (a larger
    // layer here must not take the saved tensor zero-padded).
    DTRAIN_CHECK(sp.dim < t.dim() && t.size(sp.dim) == sp.full, "checkpoint ", info.path,
                 " is of a different model: '", name, "' has ", sp.dim < t.dim() ? t.size(sp.dim) : 0,
                 " along dimension ", sp.dim, " there (shape ", t.sizes(), ") but ", sp.full,
                 " here (another shape flag: --vocab, --ff, --heads, --kv_heads?)");
    t = shard_of(t, sp, s.mesh.tp_rank(), s.mesh.tp_size());
  }
  const bool saved_offloaded = data.meta.count("optimizer.offloaded") && data.meta.at("optimizer.offloaded") == "1";
  // Checkpoints from before --shard were partitioned exactly when offloaded.
  const bool saved_partitioned = data.meta.count("optimizer.partitioned")
                                     ? data.meta.at("optimizer.partitioned") == "1"
                                     : saved_offloaded;
  // Partitioned state saved under another tensor-parallel size, or with this rank's parameters
  // not one run in its order (an interleaved split resumed under another): this rank's whole
  // flat space, put together by name from every saved tensor-parallel rank's (whole_from_other_tp).
  const int saved_pp = data.meta.count("pp") ? std::stoi(data.meta.at("pp")) : 1;
  const int saved_tp = data.meta.count("tp") ? std::stoi(data.meta.at("tp"))
                                             : data.world_size / std::max(1, data.dp_size * saved_pp);
  std::optional<ShardState> other_tp;
  if ((saved_tp != s.mesh.tp_size() || !saved_in_this_order(s, data, info.path)) &&
      (weights_partitioned || (saved_partitioned && s.optimizer))) {
    other_tp = whole_from_other_tp(s, store, data, saved_tp, info.path);
  }
  std::optional<ShardState> whole = other_tp;  // the whole flat space, when it was read
  if (weights_partitioned) {
    whole = restore_partitioned_weights(s, store, data, partitioned_weights->second, local, info.path, other_tp);
  } else {
    load_model_state(s.model, local, info.path);
  }
  if (!s.optimizer) {  // weights only (an evaluation): the weights are what it came for
    s.step = data.step;
    return;
  }
  restore_optimizer(s, store, data, info, saved_partitioned, whole);
  restore_progress(s, store, data, info, loader);
}

}  // namespace dtrain::engine
