#include "gpt_model.h"

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/sharded.h"

#include <ATen/ATen.h>

#include "dtrain/engine/memory/activation_checkpoint.h"

namespace dtrain::examples {

namespace {
engine::SequenceParallel sp_of(const GptOptions& o) {
  return o.sequence_parallel ? engine::SequenceParallel::kOn : engine::SequenceParallel::kOff;
}
}  // namespace

GptBlockImpl::GptBlockImpl(const GptOptions& o, dist::Communicator& comm)
    : sequence_parallel(o.sequence_parallel), tp(&comm) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  attn = register_module("attn", engine::ParallelSelfAttention(o.d_model, o.heads, true, comm, sp_of(o)));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  mlp = register_module("mlp", engine::ParallelMlp(o.d_model, o.ff, comm, sp_of(o)));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptBlockImpl::norm(torch::nn::LayerNorm& ln, const at::Tensor& x) {
  return sequence_parallel ? engine::sequence_parallel_layer_norm(ln, x, *tp) : ln->forward(x);
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + drop->forward(attn->forward(norm(ln1, x)));
  return h + drop->forward(mlp->forward(norm(ln2, h)));
}

GptImpl::GptImpl(const GptOptions& o, dist::Communicator& comm) : options(o), tp(&comm) {
  wte = register_module("wte", engine::VocabParallelEmbedding(o.vocab, o.d_model, comm, sp_of(o)));
  wte->sparse = o.sparse_embedding;
  wpe = register_module("wpe", torch::nn::Embedding(o.seq_len, o.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int i = 0; i < o.layers; ++i) blocks->push_back(GptBlock(o, comm));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  engine::ParallelLinearOptions head_options;
  head_options.in = o.d_model;
  head_options.out = o.vocab;
  head_options.bias = false;
  head_options.pad_output = true;
  head_options.sequence_parallel = o.sequence_parallel;  // gathers the sequence first
  head = register_module("head", engine::ColumnParallelLinear(head_options, comm));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

std::vector<std::string> GptImpl::unit_starts() const {
  std::vector<std::string> out;  // a pipeline stage's: the pieces it holds
  if (first_stage) out.push_back("wte.");
  for (size_t i = 0; i < blocks->size(); ++i) out.push_back("blocks." + std::to_string(block_base + i) + ".");
  if (last_stage) out.push_back("ln_f.");
  return out;
}

void GptImpl::use_units(engine::ParameterUnits* u, const std::vector<std::string>& prefixes) {
  units = u;
  piece_unit.clear();
  if (!units) return;
  // The trainer's order: this module's trainable parameters as named_parameters() lists them.
  std::vector<std::string> names;
  for (const auto& item : named_parameters()) {
    if (item.value().requires_grad()) names.push_back(item.key());
  }
  const std::vector<size_t> starts = engine::unit_starts_of(names, prefixes);
  const size_t L = blocks->size(), base = static_cast<size_t>(block_base);
  auto piece_of = [L, base](const std::string& name) -> size_t {
    if (name.rfind("blocks.", 0) == 0) return 1 + std::stoul(name.substr(7)) - base;
    return name.rfind("wte.", 0) == 0 || name.rfind("wpe.", 0) == 0 ? 0 : L + 1;
  };
  piece_unit.assign(L + 2, -1);
  int unit = -1;
  for (size_t j = 0, next = 0; j < names.size(); ++j) {
    const bool begins = next < starts.size() && starts[next] == j;
    if (begins) ++unit, ++next;
    const size_t piece = piece_of(names[j]);
    int& mine = piece_unit[piece];
    DTRAIN_CHECK(mine < 0 || mine == unit, "train_gpt --shard_units: a unit begins at '", names[j], "', inside ",
                 piece == 0       ? std::string("the embeddings")
                 : piece == L + 1 ? std::string("the final norm and head")
                                  : "block " + std::to_string(piece - 1),
                 "; train_gpt's units begin at the embeddings (wte.), a block (blocks.<i>.) or the final norm (ln_f.)");
    mine = unit;
  }
  DTRAIN_CHECK(static_cast<int>(unit + 1) == units->units(), "train_gpt: ", unit + 1, " units from the prefixes, but ",
               "the trainer has ", units->units(), " (build both from the same --shard_units)");
}

at::Tensor GptImpl::embed(const at::Tensor& tokens) {
  return units ? units->run(piece_unit[0], [&] { return embed_tokens(tokens); }) : embed_tokens(tokens);
}

at::Tensor GptImpl::embed_tokens(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  at::Tensor x;
  if (options.sequence_parallel) {
    // This rank's part of the sequence: its rows of the position table, whose gradient the
    // scatter's backward all-gathers (each position's gradient comes from one rank).
    at::Tensor positions = engine::scatter_to_sequence_parallel(wpe->weight.narrow(0, 0, T), *tp, 0);
    x = drop->forward(wte->forward(tokens) + positions);  // [B, T/tp, d]
  } else {
    at::Tensor pos = at::arange(T, tokens.options());
    x = drop->forward(wte->forward(tokens) + wpe->forward(pos));
  }
  return x;
}

at::Tensor GptImpl::run_blocks(at::Tensor x) {
  const bool ckpt = options.checkpoint_activations && is_training();
  const size_t n = blocks->size();
  for (size_t i = 0; i < n; ++i) {
    auto* block = (*blocks)[i]->as<GptBlockImpl>();
    auto fn = [block](const at::Tensor& in) { return block->forward(in); };
    if (units) {
      // ZeRO-3: the blocks of one unit (block i alone by default), gathered around their
      // forward and (recomputed or not) again before their backward.
      engine::ParameterUnits* u = units;
      const int k = piece_unit[1 + i];
      size_t last = i + 1;
      while (last < n && piece_unit[1 + last] == k) ++last;
      std::vector<GptBlockImpl*> group;
      std::vector<at::Tensor> params;
      for (size_t b = i; b < last; ++b) {
        group.push_back((*blocks)[b]->as<GptBlockImpl>());
        for (const at::Tensor& p : group.back()->parameters()) params.push_back(p);
      }
      auto run_group = [group](const at::Tensor& in) {
        at::Tensor h = in;
        for (GptBlockImpl* b : group) h = b->forward(h);
        return h;
      };
      if (ckpt) {
        engine::CheckpointHooks hooks;
        hooks.before_forward = [u, k] { u->before_forward(k); };
        hooks.after_forward = [u, k] { u->after_forward(k); };
        hooks.before_recompute = [u, k] { u->before_backward(k); };
        x = engine::checkpoint(run_group, x, params, hooks);
      } else {
        x = u->run(k, [&] { return run_group(x); });
      }
      i = last - 1;
      continue;
    }
    if (streamer) {
      // Weights come to the device just in time (the next block's already on its way) and go
      // back right after; backward recomputes the block with them fetched again.
      offload::LayerStreamer* s = streamer.get();
      engine::CheckpointHooks hooks;
      hooks.before_forward = [s, i, n] { s->acquire(i, i + 1 < n ? i + 1 : n); };
      hooks.after_forward = [s, i] { s->release(i); };
      hooks.before_recompute = [s, i, n] { s->acquire(i, i > 0 ? i - 1 : n); };
      hooks.after_recompute = [s, i] { s->release(i); };
      x = engine::checkpoint(fn, x, block->parameters(), hooks);
    } else {
      x = ckpt ? engine::checkpoint(fn, x, block->parameters()) : block->forward(x);
    }
  }
  return x;
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(first_stage && last_stage, "GptImpl::forward is the whole model's; a pipeline stage runs stage_forward");
  at::Tensor x = run_blocks(embed(tokens));
  auto logits = [&] {
    at::Tensor h = options.sequence_parallel ? engine::sequence_parallel_layer_norm(ln_f, x, *tp) : ln_f->forward(x);
    return head->forward(h);
  };
  return units ? units->run(piece_unit.back(), logits) : logits();
}

at::Tensor GptImpl::loss(const at::Tensor& inputs, const at::Tensor& targets) {
  TORCH_CHECK(first_stage && last_stage, "GptImpl::loss is the whole model's; a pipeline stage runs stage_forward");
  return cross_entropy(run_blocks(embed(inputs)), targets);
}

void GptImpl::keep_stage(int begin, int end, bool first, bool last) {
  TORCH_CHECK(0 <= begin && begin < end && end <= static_cast<int>(blocks->size()) && first_stage && last_stage,
              "keep_stage(", begin, ", ", end, ") of a model of ", blocks->size(), " blocks, once");
  auto kept = std::make_shared<torch::nn::Module>();  // children named by their whole-model index
  torch::nn::ModuleList stage_blocks;
  for (int i = begin; i < end; ++i) {
    kept->register_module(std::to_string(i), (*blocks)[i]);
    stage_blocks->push_back((*blocks)[i]);
  }
  replace_module("blocks", kept);
  blocks = stage_blocks;
  if (!first) {
    unregister_module("wte");
    unregister_module("wpe");
    wte = nullptr;
    wpe = nullptr;
  }
  if (!last) {
    unregister_module("ln_f");
    unregister_module("head");
    ln_f = nullptr;
    head = nullptr;
  }
  first_stage = first;
  last_stage = last;
  block_base = begin;
}

at::Tensor GptImpl::stage_forward(const at::Tensor& x, const at::Tensor& targets) {
  at::Tensor h = run_blocks(first_stage ? embed(x) : x);
  if (!last_stage) return h;
  return cross_entropy(h, targets);
}

at::Tensor GptImpl::cross_entropy(const at::Tensor& x, const at::Tensor& targets) {
  if (!units) return head_loss(x, targets);
  return units->run(piece_unit.back(), [&] { return head_loss(x, targets); });
}

at::Tensor GptImpl::head_loss(const at::Tensor& x, const at::Tensor& targets) {
  at::Tensor h = options.sequence_parallel ? engine::sequence_parallel_layer_norm(ln_f, x, *tp) : ln_f->forward(x);
  at::Tensor logits = head->forward(h);
  const int64_t local = logits.size(-1);
  return engine::vocab_parallel_cross_entropy(logits.reshape({-1, local}), targets.reshape({-1}),
                                              local * tp->rank(), options.vocab, *tp);
}

void GptImpl::offload_blocks(c10::Device device) {
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  for (auto& m : *blocks) layers.push_back(m);
  streamer = std::make_shared<offload::LayerStreamer>(layers, device);
}

int64_t GptImpl::parameter_count() const {
  const int64_t d = options.d_model, f = options.ff;
  const int64_t per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
  return options.vocab * d + options.seq_len * d + options.layers * per_block + 2 * d + options.vocab * d;
}

}  // namespace dtrain::examples
