#include "dtrain/engine/models/gpt.h"

#include <ATen/ATen.h>

#include "dtrain/dist/error.h"

namespace dtrain::engine {
namespace {
SequenceParallel sp_of(const GptOptions& o) {
  return o.sequence_parallel ? SequenceParallel::kOn : SequenceParallel::kOff;
}
}  // namespace

GptBlockImpl::GptBlockImpl(const GptOptions& o, dist::Communicator& comm)
    : sequence_parallel(o.sequence_parallel), tp(&comm) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  attn = register_module("attn", ParallelSelfAttention(o.d_model, o.heads, true, comm, sp_of(o)));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  mlp = register_module("mlp", ParallelMlp(o.d_model, o.ff, comm, sp_of(o)));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptBlockImpl::norm(torch::nn::LayerNorm& ln, const at::Tensor& x) {
  return sequence_parallel ? sequence_parallel_layer_norm(ln, x, *tp) : ln->forward(x);
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + drop->forward(attn->forward(norm(ln1, x)));
  return h + drop->forward(mlp->forward(norm(ln2, h)));
}

GptImpl::GptImpl(const GptOptions& o, dist::Communicator& comm) : options(o), tp(&comm) {
  wte = register_module("wte", VocabParallelEmbedding(o.vocab, o.d_model, comm, sp_of(o)));
  wte->sparse = o.sparse_embedding;
  wpe = register_module("wpe", torch::nn::Embedding(o.seq_len, o.d_model));
  blocks = register_module("blocks", BlockStack());
  for (int i = 0; i < o.layers; ++i) blocks->push_back(GptBlock(o, comm));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  ParallelLinearOptions head_options;
  head_options.in = o.d_model;
  head_options.out = o.vocab;
  head_options.bias = false;
  head_options.pad_output = true;
  head_options.sequence_parallel = o.sequence_parallel;  // gathers the sequence first
  head = register_module("head", ColumnParallelLinear(head_options, comm));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptImpl::embed(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  if (options.sequence_parallel) {
    // This rank's part of the sequence: its rows of the position table, whose gradient the
    // scatter's backward all-gathers (each position's gradient comes from one rank).
    at::Tensor positions = scatter_to_sequence_parallel(wpe->weight.narrow(0, 0, T), *tp, 0);
    return drop->forward(wte->forward(tokens) + positions);  // [B, T/tp, d]
  }
  at::Tensor pos = at::arange(T, tokens.options());
  return drop->forward(wte->forward(tokens) + wpe->forward(pos));
}

at::Tensor GptImpl::logits(const at::Tensor& x) {
  at::Tensor h = options.sequence_parallel ? sequence_parallel_layer_norm(ln_f, x, *tp) : ln_f->forward(x);
  return head->forward(h);
}

at::Tensor GptImpl::head_loss(const at::Tensor& x, const at::Tensor& targets) {
  at::Tensor out = logits(x);
  const int64_t local = out.size(-1);
  return vocab_parallel_cross_entropy(out.reshape({-1, local}), targets.reshape({-1}), local * tp->rank(),
                                      options.vocab, *tp);
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) { return logits(blocks->forward(embed(tokens))); }

at::Tensor GptImpl::loss(const at::Tensor& inputs, const at::Tensor& targets) {
  return head_loss(blocks->forward(embed(inputs)), targets);
}

int64_t GptImpl::parameter_count() const {
  const int64_t d = options.d_model, f = options.ff;
  const int64_t per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
  return options.vocab * d + options.seq_len * d + options.layers * per_block + 2 * d + options.vocab * d;
}

ModelSpec gpt_spec(const std::shared_ptr<GptImpl>& model) {
  ModelSpec s;
  s.module = model;
  s.blocks = model->blocks;
  s.blocks_prefix = "blocks.";
  GptImpl* m = model.get();  // the spec's users hold `module` alive
  const int64_t S = model->options.seq_len;
  s.pre = [m, S](const Batch& b) { return m->embed(b.fields.at(0).narrow(1, 0, S)); };
  s.post = [m, S](const at::Tensor& h, const Batch& b) { return m->head_loss(h, b.fields.at(0).narrow(1, 1, S)); };
  s.pre_modules = {"wte", "wpe"};
  s.post_modules = {"ln_f", "head"};
  const int64_t rows_per_rank = model->options.sequence_parallel ? S / model->tp->size() : S;
  s.activation_shape = [rows_per_rank, d = model->options.d_model](int64_t rows) {
    return std::vector<int64_t>{rows, rows_per_rank, d};
  };
  s.activation_dtype = at::kFloat;
  return s;
}

}  // namespace dtrain::engine
