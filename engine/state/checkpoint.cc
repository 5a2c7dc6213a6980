// Model state in state_dict form, RNG states, loading partitioned state, and the
// collective save / resume helpers.
#include "dtrain/engine/state/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine {
namespace {

std::string shape_text(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void append_own_state(const torch::nn::Module& module, const std::string& prefix,
                      NamedTensors* out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    out->emplace_back(prefix + item.key(), item.value().detach());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    out->emplace_back(prefix + item.key(), item.value().detach());
  }
}

int cuda_devices() {
  if (!at::globalContext().hasCUDA()) return 0;
  return static_cast<int>(at::detail::getCUDAHooks().deviceCount());
}

at::Tensor generator_state(const at::Generator& generator) {
  at::Generator g = generator;
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

}  // namespace

// ---- model state --------------------------------------------------------------------------------

NamedTensors model_state(const torch::nn::Module& module) {
  NamedTensors out;
  append_own_state(module, "", &out);
  // Pre-order over the descendants, as torch.nn.Module.state_dict() walks them.
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    append_own_state(*item.value(), item.key() + ".", &out);
  }
  return out;
}

void check_same_layout(const NamedTensors& live, const NamedTensors& saved, const std::string& what,
                       const std::string& source) {
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, tensor] : saved) by_name.emplace(name, &tensor);
  std::map<std::string, bool> live_names;
  for (const auto& [name, tensor] : live) {
    live_names.emplace(name, true);
    auto it = by_name.find(name);
    DTRAIN_CHECK(it != by_name.end(), "checkpoint ", source, " is of a different ", what, ": '",
                 name, "' of this ", what, " is missing from it (", saved.size(),
                 " entries there, ", live.size(), " here)");
    DTRAIN_CHECK(it->second->sizes().equals(tensor.sizes()), "checkpoint ", source,
                 " is of a different ", what, ": '", name, "' has shape ", shape_text(*it->second),
                 " there but ", shape_text(tensor), " here");
  }
  for (const auto& [name, tensor] : saved) {
    DTRAIN_CHECK(live_names.count(name), "checkpoint ", source, " is of a different ", what,
                 ": it has '", name, "', which this ", what, " does not (", saved.size(),
                 " entries there, ", live.size(), " here)");
  }
}

void load_model_state(torch::nn::Module& module, const NamedTensors& state,
                      const std::string& source) {
  NamedTensors live = model_state(module);
  check_same_layout(live, state, "model", source);
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  // Tied weights (one tensor under two names, e.g. a head sharing the embedding's): the
  // checkpoint must hold one value for them, else it is of an untied model and one of its two
  // tensors would silently overwrite the other here.
  std::map<std::pair<const void*, std::vector<int64_t>>, std::string> first_name;  // (data, shape)
  for (const auto& [name, tensor] : live) {
    if (!tensor.defined() || tensor.numel() == 0) continue;
    auto [it, fresh] = first_name.emplace(std::make_pair(tensor.data_ptr(), tensor.sizes().vec()), name);
    if (fresh) continue;
    const at::Tensor& a = by_name.at(it->second);
    const at::Tensor& b = by_name.at(name);
    DTRAIN_CHECK(a.sizes() == b.sizes() && at::equal(a, b.to(a.device(), a.scalar_type())), "checkpoint ", source,
                 " holds '", it->second, "' and '", name, "' as two different tensors (a model with untied weights), "
                 "but this model ties them into one (--tie_embeddings?): build it untied, as it was trained");
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : live) tensor.copy_(by_name.at(name));
}

// ---- RNG ----------------------------------------------------------------------------------------

RngState capture_rng_state() {
  RngState state;
  state.cpu = generator_state(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
  const int devices = cuda_devices();
  for (int i = 0; i < devices; ++i) {
    state.cuda.push_back(generator_state(at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)))));
  }
  return state;
}

void restore_rng_state(const RngState& state) {
  auto set = [](const at::Generator& generator, const at::Tensor& value, const char* which) {
    at::Generator g = generator;
    std::lock_guard<std::mutex> lock(g.mutex());
    try {
      g.set_state(value);
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      throw Error(detail::concat("cannot restore the ", which,
                                 " random generator state from the "
                                 "checkpoint: ",
                                 what.substr(0, what.find('\n'))));
    }
  };
  if (state.cpu.defined()) {
    set(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)), state.cpu, "CPU");
  }
  const int devices = std::min<int>(cuda_devices(), static_cast<int>(state.cuda.size()));
  for (int i = 0; i < devices; ++i) {
    set(at::globalContext().defaultGenerator(
            c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))),
        state.cuda[i], "CUDA");
  }
}

// ---- partitioned state ------------------------------------------------------------------------

std::vector<int64_t> CheckpointData::stage_flat_numels(int tp_rank) const {
  const int stages = pipeline_stages();
  if (stages == 1) return {};
  const auto it = meta.find("pp.flat_numel");
  if (it == meta.end()) return {};
  std::vector<int64_t> all;
  std::stringstream in(it->second);
  for (std::string item; std::getline(in, item, ',');) all.push_back(std::stoll(item));
  DTRAIN_CHECK(!all.empty() && all.size() % stages == 0, "checkpoint step ", step, ": meta pp.flat_numel holds ",
               all.size(), " counts for ", stages, " pipeline stages");
  const int tp = static_cast<int>(all.size()) / stages;
  DTRAIN_CHECK(tp_rank >= 0 && tp_rank < tp, "checkpoint step ", step, " was saved with tensor-parallel size ", tp,
               "; tensor-parallel rank ", tp_rank, " has no state there (resume with the same --tp)");
  std::vector<int64_t> out;
  for (int s = 0; s < stages; ++s) out.push_back(all[static_cast<size_t>(s * tp + tp_rank)]);
  return out;
}

namespace {

// Where the old rank files of one tensor-parallel rank are.
struct OldShards {
  const CheckpointStore& store;
  const CheckpointData& main;
  int tp_rank = 0;
  int old_tp = 1;
  bool sizes_unknown = false;  // the stages' sizes were not recorded
};

// Old stage `stage`'s data-parallel rank dp_rank's partitioned state (n elements), checked
// against its position and size.
ShardState load_old_shard(const OldShards& old, int stage, int dp_rank, int64_t n) {
  const int world_rank = (stage * old.main.dp_size + dp_rank) * old.old_tp + old.tp_rank;
  RankState state = old.store.load_rank(old.main.step, world_rank);
  const std::string path = old.store.rank_path_for(old.main.step, world_rank);
  DTRAIN_CHECK(state.dp_rank == dp_rank && state.tp_rank == old.tp_rank, "checkpoint ", path,
               " is of data-parallel rank ", state.dp_rank, " / tensor-parallel rank ", state.tp_rank, ", expected ",
               dp_rank, " / ", old.tp_rank);
  DTRAIN_CHECK(state.optimizer_shard.layout.numel == n, "checkpoint ", path, " holds partitioned optimizer state of ",
               state.optimizer_shard.layout.numel, " elements, but this model needs ", n,
               "; it is of a different model",
               old.sizes_unknown ? " (or of another split into pipeline stages: resume with the same --pp and --pp_blocks)"
                                 : "",
               old.old_tp > 1 ? " (or of another --tp: partitioned optimizer state resumes under the tensor-parallel "
                                "size it was saved with, " + std::to_string(old.old_tp) + ")"
                              : "");
  return std::move(state.optimizer_shard);
}

// Appends to `pieces` the saved pieces of old stage `stage` (n elements at old_offset of the
// whole space of numel elements) that hold any element of `want` (ranges of the whole space),
// their ranges placed in the whole space. `fallback`: when nothing is needed, its
// data-parallel rank 0's piece anyway (for the replicated entries).
void load_stage_pieces(const OldShards& old, int stage, int64_t n, int64_t old_offset, int64_t numel,
                       const std::vector<FlatRange>& want, bool fallback, std::vector<ShardState>* pieces) {
  std::vector<FlatRange> local;  // want's part of this stage, in the stage's space
  for (const FlatRange& w : want) {
    const FlatRange r{std::max(w.begin, old_offset) - old_offset, std::min(w.end, old_offset + n) - old_offset};
    if (r.begin < r.end) local.push_back(r);
  }
  std::map<int, ShardState> loaded;
  std::vector<int> needed;
  if (!local.empty()) {
    // Which files hold `local` depends on the old layout's unit bounds, which every rank file
    // records: the first file the one-unit rule names is read first (rank 0's when that rule
    // names none), and its bounds choose the rest. A one-unit checkpoint (any old file) thus
    // reads exactly the files that hold the target's elements; a per-unit one may read that
    // first file in vain.
    needed = overlapping_shards(n, old.main.dp_size, local);
    const int first = needed.empty() ? 0 : needed.front();
    const ShardState& probe = loaded[first] = load_old_shard(old, stage, first, n);
    if (probe.layout.unit_bounds.size() > 1) {
      needed = overlapping_shards(n, old.main.dp_size, local, probe.layout.unit_bounds);
    }
  }
  if (needed.empty() && fallback) needed.push_back(0);  // an empty range: one piece for the replicated entries
  for (int dp_rank : needed) {
    auto it = loaded.find(dp_rank);
    ShardState piece = it != loaded.end() ? std::move(it->second) : load_old_shard(old, stage, dp_rank, n);
    std::vector<FlatRange> ranges;
    for (const FlatRange& r : piece.layout.ranges) ranges.push_back({r.begin + old_offset, r.end + old_offset});
    piece.layout = ShardLayout{numel, ranges};
    pieces->push_back(std::move(piece));
  }
}

}  // namespace

ShardState load_resharded_optimizer(const CheckpointStore& store, const CheckpointData& main, int tp_rank,
                                    const ShardLayout& target, const StageSpace& space) {
  const int old_pp = main.pipeline_stages();
  DTRAIN_CHECK(main.dp_size >= 1 && old_pp >= 1 && main.world_size % (main.dp_size * old_pp) == 0, "checkpoint step ",
               main.step, " has an invalid mesh (world ", main.world_size, ", dp ", main.dp_size, ", pp ", old_pp, ")");
  const int old_tp = main.world_size / (main.dp_size * old_pp);
  DTRAIN_CHECK(tp_rank >= 0 && tp_rank < old_tp, "checkpoint step ", main.step,
               " was saved with tensor-parallel size ", old_tp, "; tensor-parallel rank ", tp_rank,
               " has no state there (resume with the same --tp)");
  DTRAIN_CHECK(main.rank_files == main.world_size, "checkpoint step ", main.step, " has ",
               main.rank_files, " rank files for ", main.world_size,
               " ranks; it holds no partitioned optimizer state");
  DTRAIN_CHECK(space.stages >= 1 && space.stage >= 0 && space.stage < space.stages && space.offset >= 0,
               "load_resharded_optimizer: stage ", space.stage, " of ", space.stages, " at offset ", space.offset,
               " is not a pipeline position");
  // The whole model's flat space is the stages' spaces end to end, under the old split and the
  // new one; the checkpoint records each old stage's size.
  const int64_t whole = space.whole_numel >= 0 ? space.whole_numel : target.numel;
  std::vector<int64_t> old_numel = old_pp == 1 ? std::vector<int64_t>{whole} : main.stage_flat_numels(tp_rank);
  int64_t new_offset = space.offset, numel = whole;
  std::vector<int> old_stages;
  const bool sizes_unknown = old_numel.empty();
  if (sizes_unknown) {
    // Saved before the sizes were recorded: stage by stage, under the same split only.
    DTRAIN_CHECK(old_pp == space.stages, store.path_for(main.step),
                 " holds partitioned optimizer state (--offload=optimizer or --shard) of ", old_pp,
                 " pipeline stage(s) without their sizes; this run has ", space.stages, ". Resume it with --pp=", old_pp);
    old_numel = {target.numel};
    old_stages = {space.stage};
    new_offset = 0;
    numel = target.numel;
  } else {
    for (int s = 0; s < old_pp; ++s) old_stages.push_back(s);
    int64_t old_whole = 0;
    for (int64_t n : old_numel) old_whole += n;
    DTRAIN_CHECK(old_whole == whole, store.path_for(main.step), " holds partitioned optimizer state of ", old_whole,
                 " elements", old_pp > 1 ? " (" + std::to_string(old_pp) + " pipeline stages)" : std::string(),
                 ", but this model needs ", whole, "; it is of a different model");
  }
  std::vector<FlatRange> want;  // the target's ranges in the whole space
  for (const FlatRange& r : target.ranges) want.push_back({new_offset + r.begin, new_offset + r.end});
  const OldShards old{store, main, tp_rank, old_tp, sizes_unknown};
  std::vector<ShardState> pieces;
  int64_t old_offset = 0;
  for (size_t k = 0; k < old_stages.size(); ++k) {
    const bool last = k + 1 == old_stages.size();
    load_stage_pieces(old, old_stages[k], old_numel[k], old_offset, numel, want, last && pieces.empty(), &pieces);
    old_offset += old_numel[k];
  }
  ShardState out = assemble_shard(pieces, ShardLayout{numel, want});
  out.layout = target;
  return out;
}

// ---- collectives ------------------------------------------------------------------------------

std::string save_checkpoint(CheckpointStore& store, dist::Communicator& world,
                            const CheckpointData& data, const RankState& rank_state) {
  DTRAIN_CHECK(rank_state.rank == world.rank(), "save_checkpoint: rank_state.rank is ",
               rank_state.rank, " on world rank ", world.rank());
  DTRAIN_CHECK(data.world_size == world.size(), "save_checkpoint: data.world_size is ",
               data.world_size, " but the world has ", world.size(), " ranks");
  std::string error;
  try {
    store.save_rank(data.step, rank_state);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Per rank: failed?, step.
  at::Tensor mine = at::tensor({int64_t(error.empty() ? 0 : 1), data.step}, at::kLong);
  at::Tensor all = at::empty({2 * world.size()}, at::kLong);
  world.all_gather(mine, all)->wait();
  std::string failed;
  for (int r = 0; r < world.size(); ++r) {
    DTRAIN_CHECK(all[2 * r + 1].item<int64_t>() == data.step, "save_checkpoint: rank ", r,
                 " saves step ", all[2 * r + 1].item<int64_t>(), " but rank ", world.rank(),
                 " step ", data.step, "; every rank must save the same step");
    if (all[2 * r].item<int64_t>() != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  }
  // A failed save leaves no files of its step behind (every rank removes its own).
  if (!failed.empty()) store.discard_uncommitted_rank_file(data.step, world.rank());
  DTRAIN_CHECK(failed.empty(), "checkpoint step ", data.step, " was not saved: rank(s) ", failed,
               " could not write their rank files",
               error.empty() ? std::string(" (see their logs)") : "; here: " + error);
  at::Tensor committed = at::zeros({1}, at::kLong);
  if (world.rank() == 0) {
    try {
      CheckpointData main = data;
      main.rank_files = world.size();
      store.save(main);
      committed.fill_(1);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  world.broadcast(committed, 0)->wait();
  if (committed.item<int64_t>() != 1) store.discard_uncommitted_rank_file(data.step, world.rank());
  DTRAIN_CHECK(committed.item<int64_t>() == 1, "checkpoint step ", data.step,
               " was not saved: rank 0 could not write the main file",
               error.empty() ? std::string(" (see rank 0's log)") : ": " + error);
  return store.path_for(data.step);
}

std::optional<CheckpointInfo> agree_latest_good(const CheckpointStore& store,
                                                dist::Communicator& world, int64_t* skipped) {
  at::Tensor found = at::tensor({int64_t(-1), int64_t(0), int64_t(0)}, at::kLong);
  if (world.rank() == 0) {
    std::vector<std::string> bad;
    if (std::optional<CheckpointInfo> info = store.latest_good(&bad)) {
      found[0] = info->step;
      found[1] = info->rank_files;
    }
    found[2] = static_cast<int64_t>(bad.size());
  }
  world.broadcast(found, 0)->wait();
  if (skipped) *skipped = found[2].item<int64_t>();
  const int64_t step = found[0].item<int64_t>();
  if (step < 0) return std::nullopt;
  return CheckpointInfo{step, store.path_for(step), static_cast<int>(found[1].item<int64_t>())};
}

}  // namespace dtrain::engine
