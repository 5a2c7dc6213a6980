#include "dtrain/engine/models/gpt.h"

#include <cmath>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/fused_block_ops.h"

#include "decoder_lm.h"

namespace dtrain::engine {
namespace {
SequenceParallel sp_of(const GptOptions& o) {
  return o.sequence_parallel ? SequenceParallel::kOn : SequenceParallel::kOff;
}
// config.json's integer `name` (> 0), or `fallback` when absent or null (none: required).
int64_t positive_field(const nlohmann::json& j, const char* name, int64_t fallback = 0) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) {
    DTRAIN_CHECK(fallback > 0, "config.json: '", name, "' is missing");
    return fallback;
  }
  DTRAIN_CHECK(it->is_number_integer() && it->get<int64_t>() > 0, "config.json: '", name,
               "' must be a positive integer, got ", it->dump());
  return it->get<int64_t>();
}

// config.json's `name` when present and not null, else `fallback`; a value of another JSON
// type than fallback's is an error naming the field.
template <class T>
T value_or(const nlohmann::json& j, const char* name, T fallback) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw Error(detail::concat("config.json: '", name, "' has the wrong type: ", it->dump()));
  }
}

}  // namespace

GptOptions gpt_options_from_hf_config(const std::string& json_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("config.json is not valid JSON: ", e.what()));
  }
  DTRAIN_CHECK(j.is_object(), "config.json must hold a JSON object");
  const std::string type = value_or<std::string>(j, "model_type", "gpt2");
  DTRAIN_CHECK(type == "gpt2", "config.json: 'model_type' is \"", type, "\"; the GPT model reads gpt2 configs");
  const std::string act = value_or<std::string>(j, "activation_function", "gelu_new");
  DTRAIN_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", "config.json: 'activation_function' is \"", act,
               "\"; the GPT model's MLP uses GELU's tanh approximation (gelu_new)");
  const double eps = value_or<double>(j, "layer_norm_epsilon", 1e-5);
  DTRAIN_CHECK(std::abs(eps - 1e-5) <= 1e-12, "config.json: 'layer_norm_epsilon' is ", eps,
               "; the GPT model's layer norms use 1e-5");
  for (const char* flag : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"}) {
    DTRAIN_CHECK(!value_or<bool>(j, flag, false), "config.json: '", flag, "' is true; the GPT model does not have it");
  }
  DTRAIN_CHECK(value_or<bool>(j, "scale_attn_weights", true), "config.json: 'scale_attn_weights' is false; the GPT "
               "model scales attention scores by 1/sqrt(head size)");
  GptOptions o;
  o.vocab = positive_field(j, "vocab_size");
  o.d_model = positive_field(j, "n_embd");
  o.heads = positive_field(j, "n_head");
  o.layers = static_cast<int>(positive_field(j, "n_layer"));
  o.ff = positive_field(j, "n_inner", 4 * o.d_model);
  o.seq_len = positive_field(j, "n_positions", 1024);
  o.tie_embeddings = value_or<bool>(j, "tie_word_embeddings", true);
  o.dropout = 0;
  DTRAIN_CHECK(o.d_model % o.heads == 0, "config.json: 'n_embd' (", o.d_model, ") is not divisible by 'n_head' (",
               o.heads, ")");
  return o;
}

GptBlockImpl::GptBlockImpl(const GptOptions& o, dist::Communicator& comm, dist::Communicator* cp)
    : sequence_parallel(o.sequence_parallel), tp(&comm) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  attn = register_module("attn", ParallelSelfAttention(o.d_model, o.heads, true, comm, sp_of(o), cp));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  mlp = register_module("mlp", ParallelMlp(o.d_model, o.ff, comm, sp_of(o)));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptBlockImpl::norm(torch::nn::LayerNorm& ln, const at::Tensor& x) {
  return sequence_parallel ? sequence_parallel_layer_norm(ln, x, *tp) : ln->forward(x);
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  if (!sequence_parallel && fused_block_kernels_serve(x)) {
    // CUDA: each LayerNorm in one kernel, the second with the residual add (and in backward the
    // residual gradient's add and the weight gradients), its output already in autocast's dtype
    // for the Linear it feeds (fused_block_ops.h); elsewhere ATen's ops as below.
    const double eps1 = ln1->options.eps(), eps2 = ln2->options.eps();
    const at::Tensor n1 = add_layer_norm(x, at::Tensor(), ln1->weight, ln1->bias, eps1).normed;
    const AddLayerNorm r = add_layer_norm(x, drop->forward(attn->forward(n1)), ln2->weight, ln2->bias, eps2);
    return r.sum + drop->forward(mlp->forward(r.normed));
  }
  at::Tensor h = x + drop->forward(attn->forward(norm(ln1, x)));
  return h + drop->forward(mlp->forward(norm(ln2, h)));
}

at::Tensor GptBlockImpl::forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache,
                                        const CachedStep& step) {
  at::Tensor h = x + drop->forward(attn->forward_cached(ln1->forward(x), k_cache, v_cache, step));
  return h + drop->forward(mlp->forward(ln2->forward(h)));
}

GptImpl::GptImpl(const GptOptions& o, dist::Communicator& comm, dist::Communicator* context)
    : options(o), tp(&comm), cp(decoder_lm::active_cp(context)) {
  decoder_lm::check_context_parallel(o.seq_len, cp, o.sequence_parallel && comm.size() > 1, comm);
  wte = register_module("wte", VocabParallelEmbedding(o.vocab, o.d_model, comm, sp_of(o)));
  wte->sparse = o.sparse_embedding;
  wpe = register_module("wpe", torch::nn::Embedding(o.seq_len, o.d_model));
  blocks = register_module("blocks", BlockStack());
  for (int i = 0; i < o.layers; ++i) blocks->push_back(GptBlock(o, comm, cp));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  if (o.tie_embeddings) {
    // The head reads the embedding: at the embedding's N(0, 1) its logits start with a standard
    // deviation of about sqrt(d_model) (a first loss of 43 where ln(vocab) is 7.6). GPT-2's
    // 0.02, as a scale of the same draw (the same model at every --tp).
    torch::NoGradGuard no_grad;
    wte->weight.mul_(0.02);
    tied_head = register_module("head", TiedVocabHead(wte, comm, o.sequence_parallel));
  } else {
    ParallelLinearOptions head_options;
    head_options.in = o.d_model;
    head_options.out = o.vocab;
    head_options.bias = false;
    head_options.pad_output = true;
    head_options.sequence_parallel = o.sequence_parallel;  // gathers the sequence first
    head = register_module("head", ColumnParallelLinear(head_options, comm));
  }
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
}

at::Tensor GptImpl::embed(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  // Context-parallel: this rank's tokens and the rows of their global positions.
  at::Tensor rows = cp ? wpe->weight.index_select(0, cp_positions(T, cp->rank(), cp->size(), tokens.options()))
                       : at::Tensor();
  const at::Tensor local = decoder_lm::cp_local(tokens, cp);
  if (options.sequence_parallel) {
    // This rank's part of the sequence: its rows of the position table, whose gradient the
    // scatter's backward all-gathers (each position's gradient comes from one rank).
    at::Tensor positions = scatter_to_sequence_parallel(cp ? rows : wpe->weight.narrow(0, 0, T), *tp, 0);
    return drop->forward(wte->forward(local) + positions);  // [B, T/tp, d]
  }
  if (cp) return drop->forward(wte->forward(local) + rows);
  at::Tensor pos = at::arange(T, tokens.options());
  return drop->forward(wte->forward(tokens) + wpe->forward(pos));
}

at::Tensor GptImpl::logits(const at::Tensor& x) {
  // The final norm feeds the head's Linear: on CUDA the fused kernel (see GptBlockImpl::forward).
  at::Tensor h = options.sequence_parallel ? sequence_parallel_layer_norm(ln_f, x, *tp)
                 : fused_block_kernels_serve(x)
                     ? add_layer_norm(x, at::Tensor(), ln_f->weight, ln_f->bias, ln_f->options.eps()).normed
                     : ln_f->forward(x);
  return decoder_lm::head_logits(head, tied_head, h);
}

at::Tensor GptImpl::head_loss(const at::Tensor& x, const at::Tensor& targets) {
  return decoder_lm::next_token_loss(logits(x), decoder_lm::cp_local(targets, cp), options.vocab, *tp);
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) { return logits(blocks->forward(embed(tokens))); }

at::Tensor GptImpl::loss(const at::Tensor& inputs, const at::Tensor& targets) {
  return head_loss(blocks->forward(embed(inputs)), targets);
}

int64_t GptImpl::parameter_count() const {
  const int64_t d = options.d_model, f = options.ff;
  const int64_t per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
  return options.vocab * d + options.seq_len * d + options.layers * per_block + 2 * d +
         (options.tie_embeddings ? 0 : options.vocab * d);
}

KvCache GptImpl::make_kv_cache(int64_t batch, int64_t max_len) {
  for (size_t i = 0; i < blocks->size(); ++i) decoder_lm::decoding_block<GptBlockImpl>(*blocks, i, "GptBlock");
  DTRAIN_CHECK(max_len <= options.seq_len, "make_kv_cache: max_len ", max_len, " is more positions than the GPT's ",
               options.seq_len, " learned ones (--seq_len, or config.json's n_positions)");
  return decoder_lm::empty_kv_cache(blocks->size(), batch, options.heads / tp->size(), max_len,
                                    options.d_model / options.heads, wte->weight.options(), cp);
}

at::Tensor GptImpl::forward_cached(const at::Tensor& tokens, KvCache& cache) {
  at::NoGradGuard no_grad;
  decoder_lm::check_cached_call(tokens, cache, blocks->size(), options.heads / tp->size(),
                                options.d_model / options.heads, cp, options.sequence_parallel);
  const int64_t T = tokens.size(1);
  const CachedStep step = decoder_lm::cached_step(cache, tokens);
  const at::Tensor positions = step.positions.defined()
                                   ? step.positions
                                   : at::arange(cache.length, cache.length + T, tokens.options().dtype(at::kLong));
  const at::Tensor h = decoder_lm::cached_blocks<GptBlockImpl>(
      *blocks, drop->forward(wte->forward(tokens) + wpe->forward(positions)), cache, step, "GptBlock");
  cache.length += T;
  return logits(h);
}

ModelSpec gpt_spec(const std::shared_ptr<GptImpl>& model) {
  return decoder_lm::token_window_spec(model, {"wte", "wpe"}, {"ln_f", "head"}, at::kFloat);
}

}  // namespace dtrain::engine
