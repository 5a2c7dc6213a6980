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

ShardState load_resharded_optimizer(const CheckpointStore& store, const CheckpointData& main, int tp_rank,
                                    const ShardLayout& target, int pp_rank, int pp_size) {
  const int old_pp = main.pipeline_stages();
  DTRAIN_CHECK(main.dp_size >= 1 && old_pp >= 1 && main.world_size % (main.dp_size * old_pp) == 0, "checkpoint step ",
               main.step, " has an invalid mesh (world ", main.world_size, ", dp ", main.dp_size, ", pp ", old_pp, ")");
  DTRAIN_CHECK(old_pp == pp_size && pp_rank >= 0 && pp_rank < pp_size, store.path_for(main.step),
               " holds partitioned optimizer state (--offload=optimizer or --shard) of ", old_pp,
               " pipeline stage(s), kept per stage; this run has ", pp_size, ". Resume it with --pp=", old_pp);
  const int old_tp = main.world_size / (main.dp_size * old_pp);
  DTRAIN_CHECK(tp_rank >= 0 && tp_rank < old_tp, "checkpoint step ", main.step,
               " was saved with tensor-parallel size ", old_tp, "; tensor-parallel rank ", tp_rank,
               " has no state there (resume with the same --tp)");
  DTRAIN_CHECK(main.rank_files == main.world_size, "checkpoint step ", main.step, " has ",
               main.rank_files, " rank files for ", main.world_size,
               " ranks; it holds no partitioned optimizer state");
  std::vector<int> needed = overlapping_shards(target.numel, main.dp_size, target.range);
  if (needed.empty()) needed.push_back(0);  // for the replicated entries
  std::vector<ShardState> pieces;
  for (int dp_rank : needed) {
    const int world_rank = (pp_rank * main.dp_size + dp_rank) * old_tp + tp_rank;
    RankState state = store.load_rank(main.step, world_rank);
    const std::string path = store.rank_path_for(main.step, world_rank);
    DTRAIN_CHECK(state.dp_rank == dp_rank && state.tp_rank == tp_rank, "checkpoint ", path,
                 " is of data-parallel rank ", state.dp_rank, " / tensor-parallel rank ", state.tp_rank,
                 ", expected ", dp_rank, " / ", tp_rank);
    DTRAIN_CHECK(state.optimizer_shard.layout.numel == target.numel, "checkpoint ", path,
                 " holds partitioned optimizer state of ", state.optimizer_shard.layout.numel,
                 " elements, but this model needs ", target.numel, "; it is of a different model",
                 old_pp > 1 ? " (or of another split into pipeline stages: resume with the same --pp and --pp_blocks)" : "");
    pieces.push_back(std::move(state.optimizer_shard));
  }
  return assemble_shard(pieces, target);
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
                                                dist::Communicator& world) {
  at::Tensor found = at::tensor({int64_t(-1), int64_t(0)}, at::kLong);
  if (world.rank() == 0) {
    if (std::optional<CheckpointInfo> info = store.latest_good()) {
      found[0] = info->step;
      found[1] = info->rank_files;
    }
  }
  world.broadcast(found, 0)->wait();
  const int64_t step = found[0].item<int64_t>();
  if (step < 0) return std::nullopt;
  return CheckpointInfo{step, store.path_for(step), static_cast<int>(found[1].item<int64_t>())};
}

}  // namespace dtrain::engine
