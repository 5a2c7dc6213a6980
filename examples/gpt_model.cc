#include "gpt_model.h"

#include <ATen/ATen.h>

#include "dtrain/engine/activation_checkpoint.h"

namespace dtrain::examples {

GptBlockImpl::GptBlockImpl(const GptOptions& o, dist::Communicator& tp) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  attn = register_module("attn", engine::ParallelSelfAttention(o.d_model, o.heads, true, tp));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  mlp = register_module("mlp", engine::ParallelMlp(o.d_model, o.ff, tp));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + drop->forward(attn->forward(ln1->forward(x)));
  return h + drop->forward(mlp->forward(ln2->forward(h)));
}

GptImpl::GptImpl(const GptOptions& o, dist::Communicator& comm) : options(o), tp(&comm) {
  wte = register_module("wte", engine::VocabParallelEmbedding(o.vocab, o.d_model, comm));
  wpe = register_module("wpe", torch::nn::Embedding(o.seq_len, o.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int i = 0; i < o.layers; ++i) blocks->push_back(GptBlock(o, comm));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  engine::ParallelLinearOptions head_options;
  head_options.in = o.d_model;
  head_options.out = o.vocab;
  head_options.bias = false;
  head_options.pad_output = true;
  head = register_module("head", engine::ColumnParallelLinear(head_options, comm));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  at::Tensor pos = at::arange(T, tokens.options());
  at::Tensor x = drop->forward(wte->forward(tokens) + wpe->forward(pos));
  const bool ckpt = options.checkpoint_activations && is_training();
  const size_t n = blocks->size();
  for (size_t i = 0; i < n; ++i) {
    auto* block = (*blocks)[i]->as<GptBlockImpl>();
    auto fn = [block](const at::Tensor& in) { return block->forward(in); };
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
  return head->forward(ln_f->forward(x));
}

at::Tensor GptImpl::loss(const at::Tensor& inputs, const at::Tensor& targets) {
  at::Tensor logits = forward(inputs);
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
