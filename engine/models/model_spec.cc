#include "dtrain/engine/models/model_spec.h"

#include <algorithm>
#include <map>
#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/parallel/pipeline.h"
#include "dtrain/offload/layer_offload.h"

namespace dtrain::engine {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

bool is_child(torch::nn::Module& module, const std::string& name) {
  for (const auto& item : module.named_children()) {
    if (item.key() == name) return true;
  }
  return false;
}

// Which piece a parameter belongs to: 0 pre, 1 + i block i of the stage, blocks + 1 post, -1 none.
int piece_of(const ModelSpec& spec, const std::string& name) {
  const size_t n = spec.blocks->size();
  if (starts_with(name, spec.blocks_prefix)) {
    const int index = std::stoi(name.substr(spec.blocks_prefix.size()));
    for (size_t i = 0; i < n; ++i) {
      if (spec.blocks->index(i) == index) return 1 + static_cast<int>(i);
    }
    return -1;
  }
  for (const std::string& m : spec.pre_modules) {
    if (starts_with(name, m + ".")) return 0;
  }
  for (const std::string& m : spec.post_modules) {
    if (starts_with(name, m + ".")) return static_cast<int>(n) + 1;
  }
  return -1;
}

std::string describe_piece(const ModelSpec& spec, int piece) {
  const int n = static_cast<int>(spec.blocks->size());
  if (piece == 0) return "the modules before the blocks (pre)";
  if (piece == n + 1) return "the modules after the blocks (post)";
  return "block " + std::to_string(spec.blocks->index(static_cast<size_t>(piece - 1)));
}

}  // namespace

void validate(const ModelSpec& s) {
  DTRAIN_CHECK(s.module != nullptr, "ModelSpec: module is null; give the whole model");
  DTRAIN_CHECK(!s.blocks.is_empty(), "ModelSpec: blocks is null; give the model's BlockStack");
  DTRAIN_CHECK(static_cast<bool>(s.pre) && static_cast<bool>(s.post),
               "ModelSpec: pre and post must both be set (the forward pass before and after the blocks)");
  DTRAIN_CHECK(static_cast<bool>(s.activation_shape),
               "ModelSpec: activation_shape is empty; give the blocks' input shape for a micro-batch of rows");
  DTRAIN_CHECK(!s.blocks_prefix.empty() && s.blocks_prefix.back() == '.',
               "ModelSpec: blocks_prefix '", s.blocks_prefix, "' must be the stack's name and a dot, e.g. \"blocks.\"");
  bool found = false;
  for (const auto& item : s.module->named_modules("", /*include_self=*/false)) {
    if (item.value().get() == s.blocks.ptr().get()) {
      found = true;
      DTRAIN_CHECK(item.key() + "." == s.blocks_prefix, "ModelSpec: the BlockStack is registered as '", item.key(),
                   "' in module, but blocks_prefix is '", s.blocks_prefix, "'");
    }
  }
  DTRAIN_CHECK(found, "ModelSpec: blocks is not registered in module (register_module(\"blocks\", stack))");
  for (const auto* list : {&s.pre_modules, &s.post_modules}) {
    for (const std::string& m : *list) {
      DTRAIN_CHECK(is_child(*s.module, m) || s.blocks->whole_size() != static_cast<int>(s.blocks->size()),
                   "ModelSpec: '", m, "' in ", list == &s.pre_modules ? "pre_modules" : "post_modules",
                   " is not a direct child module of the model (its registered name)");
    }
  }
}

void split_pipeline_stage(ModelSpec& spec, int stage, int stages, const std::string& counts, ModelTechniques& t,
                          int chunks) {
  validate(spec);
  t.stage = stage;
  t.stages = stages;
  t.chunks = chunks;
  const int whole = spec.blocks->whole_size();
  DTRAIN_CHECK(chunks >= 1, "--pp_chunks=", chunks, " must be >= 1");
  DTRAIN_CHECK(chunks == 1 || whole >= stages * chunks, "the interleaved schedule splits the model's ", whole,
               " block(s) into ", stages, " stages x ", chunks, " chunks = ", stages * chunks,
               " virtual stages of at least one block each; use fewer --pp_chunks or more blocks (--layers)");
  const std::vector<int> bounds = pipeline_stage_bounds(whole, stages * chunks, counts);
  std::vector<std::pair<int, int>> ranges;
  t.chunk_bounds = {0};
  for (int c = 0; c < chunks; ++c) {
    const size_t v = static_cast<size_t>(c * stages + stage);
    ranges.emplace_back(bounds[v], bounds[v + 1]);
    t.chunk_bounds.push_back(t.chunk_bounds.back() + bounds[v + 1] - bounds[v]);
  }
  t.first_block = ranges.front().first;
  t.end_block = ranges.back().second;
  if (stages == 1) return;
  if (spec.blocks->size() != static_cast<size_t>(spec.blocks->whole_size())) {
    DTRAIN_CHECK(spec.blocks->index(0) == t.first_block && spec.blocks->index(spec.blocks->size() - 1) + 1 == t.end_block,
                 "split_pipeline_stage: the model was split already, for another stage or another number of "
                 "chunks: split it once, with the chunks its schedule runs (TrainerOptions::pipeline.chunks; "
                 "cli::pipeline_chunks(flags) for --pp_schedule=interleaved), or leave the split to the Trainer");
    return;
  }
  // A tensor registered under the names of two pieces (a head tied to the embedding) would be
  // emptied with the piece a stage drops and trained apart on the stage that keeps the other.
  for (const auto& [second, first] : trained_parameters(*spec.module).tied) {
    DTRAIN_CHECK(second.substr(0, second.find('.')) == first.substr(0, first.find('.')), "tied parameters ('", second,
                 "' is '", first, "') with --pp > 1: the two names may live on different stages, which is not "
                 "supported yet; untie them (e.g. tie_embeddings = false) or train without pipeline stages");
  }
  spec.blocks->keep_ranges(ranges);
  // The parts this stage does not run leave the module, and their memory goes at once (the
  // model may still hold them as members).
  auto drop = [&](const std::vector<std::string>& names) {
    for (const std::string& m : names) {
      for (const auto& item : spec.module->named_children()) {
        if (item.key() != m) continue;
        for (at::Tensor t : item.value()->parameters()) t.set_data(at::empty({0}, t.options()));
        for (at::Tensor t : item.value()->buffers()) t.set_data(at::empty({0}, t.options()));
      }
      spec.module->unregister_module(m);
    }
  };
  if (stage > 0) drop(spec.pre_modules);
  if (stage < stages - 1) drop(spec.post_modules);
}

TrainedParameters trained_parameters(torch::nn::Module& module) {
  TrainedParameters out;
  std::map<const c10::TensorImpl*, std::string> first_name;
  for (auto& item : module.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    auto [it, added] = first_name.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!added) {
      out.tied.emplace_back(item.key(), it->second);
      continue;
    }
    out.params.push_back(item.value());
    out.names.push_back(item.key());
  }
  return out;
}

std::vector<std::string> default_unit_prefixes(const ModelSpec& spec) {
  // In the trainer's order of parameters: the first trained parameter of each piece.
  std::vector<std::string> prefixes;
  int last = -2;
  for (const std::string& name : trained_parameters(*spec.module).names) {
    const int piece = piece_of(spec, name);
    if (piece == last) continue;
    last = piece;
    const int n = static_cast<int>(spec.blocks->size());
    if (piece == 0 || piece == n + 1) {
      prefixes.push_back(name.substr(0, name.find('.') + 1));  // the module's own
    } else if (piece > 0) {
      prefixes.push_back(spec.blocks_prefix + std::to_string(spec.blocks->index(static_cast<size_t>(piece - 1))) + ".");
    } else {
      prefixes.push_back(name);  // outside every piece: use_units refuses it
    }
  }
  return prefixes;
}

// Runs the stack's blocks with the techniques installed: ZeRO-3's gathers around each unit's
// group of blocks, activation checkpointing, layer streaming (gradients equal the plain run's).
class TechniqueRunner : public BlockRunner {
 public:
  explicit TechniqueRunner(AppliedModel& model) : model_(model) {}
  at::Tensor run(BlockStackImpl& stack, const at::Tensor& input, size_t begin, size_t end) override {
    const ModelTechniques& t = model_.t_;
    const bool ckpt_on = t.checkpoint_activations && stack.is_training();
    // The first checkpoint_blocks of the stack's blocks (-1: all).
    const size_t ckpt_end = t.checkpoint_blocks < 0 ? end : static_cast<size_t>(t.checkpoint_blocks);
    const size_t n = end;  // blocks [begin, end): the stack, or an interleaved stage's chunk
    BlockStackImpl* s = &stack;
    at::Tensor x = input;
    for (size_t i = begin; i < n; ++i) {
      if (ParameterUnits* u = model_.units_) {
        // ZeRO-3: the blocks of one unit (block i alone by default), gathered around their
        // forward and (recomputed or not) again before their backward.
        const int k = model_.piece_unit_[1 + i];
        size_t last = i + 1;
        while (last < n && model_.piece_unit_[1 + last] == k) ++last;
        std::vector<at::Tensor> params;
        for (size_t b = i; b < last; ++b) {
          for (const at::Tensor& p : stack.block(b)->parameters()) params.push_back(p);
        }
        auto run_group = [s, i, last](const at::Tensor& in) {
          at::Tensor h = in;
          for (size_t b = i; b < last; ++b) h = s->run_block(b, h);
          return h;
        };
        if (ckpt_on && i < ckpt_end) {
          CheckpointHooks hooks;
          hooks.before_forward = [u, k] { u->before_forward(k); };
          hooks.after_forward = [u, k] { u->after_forward(k); };
          hooks.before_recompute = [u, k] { u->before_backward(k); };
          x = checkpoint(run_group, x, params, hooks);
        } else {
          x = u->run(k, [&] { return run_group(x); });
        }
        i = last - 1;
        continue;
      }
      auto fn = [s, i](const at::Tensor& in) { return s->run_block(i, in); };
      if (offload::LayerStreamer* streamer = model_.streamer_.get()) {
        // Weights come to the device just in time (the next block's already on its way) and go
        // back right after; backward recomputes the block with them fetched again.
        CheckpointHooks hooks;
        hooks.before_forward = [streamer, i, n] { streamer->acquire(i, i + 1 < n ? i + 1 : n); };
        hooks.after_forward = [streamer, i] { streamer->release(i); };
        hooks.before_recompute = [streamer, i, n] { streamer->acquire(i, i > 0 ? i - 1 : n); };
        hooks.after_recompute = [streamer, i] { streamer->release(i); };
        hooks.defer_host_gradient_wait = model_.defer_host_gradient_waits_;
        x = checkpoint(fn, x, stack.block(i)->parameters(), hooks);
      } else {
        x = ckpt_on && i < ckpt_end ? checkpoint(fn, x, stack.block(i)->parameters()) : stack.run_block(i, x);
      }
    }
    return x;
  }

 private:
  AppliedModel& model_;
};

AppliedModel::AppliedModel(ModelSpec spec, ModelTechniques t) : spec_(std::move(spec)), t_(t) {
  validate(spec_);
  check_checkpoint_blocks(t_.checkpoint_blocks);
  runner_ = std::make_shared<TechniqueRunner>(*this);
  spec_.blocks->set_runner(runner_);
}

AppliedModel::~AppliedModel() {
  // Only its own: a later AppliedModel of the same blocks (the trainer's) keeps its runner.
  if (spec_.blocks->runner() == runner_.get()) spec_.blocks->set_runner(nullptr);
}

void AppliedModel::install() { spec_.blocks->set_runner(runner_); }

void AppliedModel::check_checkpoint_blocks(int blocks) const {
  const int n = static_cast<int>(spec_.blocks->size());
  DTRAIN_CHECK(blocks >= -1, "--checkpoint_blocks=", blocks, " must be -1 (every block) or a count >= 0");
  DTRAIN_CHECK(blocks <= n, "--checkpoint_blocks=", blocks, " is more blocks than the ", n,
               t_.stages > 1 ? " of this pipeline stage" : " of the model", "; give at most ", n,
               " (or -1: every block)");
}

void AppliedModel::set_checkpoint_activations(bool on, int blocks) {
  check_checkpoint_blocks(blocks);
  t_.checkpoint_activations = on;
  t_.checkpoint_blocks = blocks;
}

void AppliedModel::stream_blocks() {
  t_.offload_layers = true;
  start_streaming();
  install();
}

void AppliedModel::start_streaming() {
  if (!t_.offload_layers || streamer_) return;
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  for (size_t i = 0; i < spec_.blocks->size(); ++i) layers.push_back(spec_.blocks->block(i));
  streamer_ = std::make_shared<offload::LayerStreamer>(layers, t_.device);
}

void AppliedModel::use_units(ParameterUnits* units, const std::vector<std::string>& prefixes,
                             const std::vector<std::string>& names) {
  units_ = units;
  piece_unit_.clear();
  if (!units_) return;
  DTRAIN_CHECK(!t_.offload_layers, "--shard=parameters with --offload=layers is not supported yet; use "
               "--offload=optimizer with --shard=parameters, or --offload=layers without it");
  const std::vector<size_t> starts = unit_starts_of(names, prefixes);
  const size_t n = spec_.blocks->size();
  piece_unit_.assign(n + 2, -1);
  int unit = -1;
  for (size_t j = 0, next = 0; j < names.size(); ++j) {
    if (next < starts.size() && starts[next] == j) ++unit, ++next;
    const int piece = piece_of(spec_, names[j]);
    DTRAIN_CHECK(piece >= 0, "--shard=parameters: the parameter '", names[j], "' belongs to no piece of the model ",
                 "(its pre_modules, its blocks under '", spec_.blocks_prefix, "', its post_modules): ZeRO-3 would never ",
                 "gather it; list its module in ModelSpec::pre_modules or post_modules");
    int& mine = piece_unit_[static_cast<size_t>(piece)];
    DTRAIN_CHECK(mine < 0 || mine == unit, "--shard_units: a unit begins at '", names[j], "', inside ",
                 describe_piece(spec_, piece), "; units begin at a piece: the modules before the blocks, a block (",
                 spec_.blocks_prefix, "<i>.) or the modules after them");
    mine = unit;
  }
  DTRAIN_CHECK(unit + 1 == units_->units(), "ZeRO-3: ", unit + 1, " units from the prefixes, but the trainer has ",
               units_->units(), " (cut both from the same prefixes)");
  // Units are gathered in order: pieces of one unit must be consecutive pieces.
  int previous = -1;
  for (size_t p = 0; p < piece_unit_.size(); ++p) {
    if (piece_unit_[p] < 0) continue;
    DTRAIN_CHECK(piece_unit_[p] >= previous, "ZeRO-3: the model's parameters are registered out of the order its ",
                 "forward uses them (", describe_piece(spec_, static_cast<int>(p)), " comes in an earlier unit than ",
                 "a piece before it); register the modules in forward order");
    previous = piece_unit_[p];
  }
}

at::Tensor AppliedModel::run_pre(const Batch& batch) {
  if (units_ && piece_unit_[0] >= 0) return units_->run(piece_unit_[0], [&] { return spec_.pre(batch); });
  return spec_.pre(batch);
}

at::Tensor AppliedModel::run_post(const at::Tensor& h, const Batch& batch) {
  if (units_ && piece_unit_.back() >= 0) return units_->run(piece_unit_.back(), [&] { return spec_.post(h, batch); });
  return spec_.post(h, batch);
}

at::Tensor AppliedModel::loss(const Batch& batch) {
  DTRAIN_CHECK(t_.stages == 1, "AppliedModel::loss is the whole model's; a pipeline stage runs stage_forward");
  return run_post(spec_.blocks->forward(run_pre(batch)), batch);
}

int AppliedModel::virtual_stage_of(const std::string& name) const {
  const int piece = piece_of(spec_, name), n = static_cast<int>(spec_.blocks->size());
  if (piece < 0) return -1;
  int chunk = 0;
  if (piece == n + 1) {
    chunk = t_.chunks - 1;
  } else if (piece > 0) {
    while (chunk + 1 < t_.chunks && t_.chunk_bounds[static_cast<size_t>(chunk) + 1] <= piece - 1) ++chunk;
  }
  return chunk * t_.stages + t_.stage;
}

at::Tensor AppliedModel::chunk_forward(const at::Tensor& x, const Batch& micro, int chunk) {
  DTRAIN_CHECK(chunk >= 0 && chunk < t_.chunks, "AppliedModel::chunk_forward: chunk ", chunk, " of ", t_.chunks);
  const bool first = first_stage() && chunk == 0, last = last_stage() && chunk == t_.chunks - 1;
  at::Tensor h = spec_.blocks->forward_range(first ? run_pre(micro) : x, static_cast<size_t>(t_.chunk_bounds[chunk]),
                                             static_cast<size_t>(t_.chunk_bounds[chunk + 1]));
  return last ? run_post(h, micro) : h;
}

at::Tensor AppliedModel::stage_forward(const at::Tensor& x, const Batch& micro) {
  at::Tensor h = spec_.blocks->forward(first_stage() ? run_pre(micro) : x);
  return last_stage() ? run_post(h, micro) : h;
}

}  // namespace dtrain::engine
