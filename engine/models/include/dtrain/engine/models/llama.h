// A Llama-family decoder language model (Llama 2/3/3.1, Mistral without a sliding window):
// pre-norm blocks with RMSNorm, rotary position embeddings (transformers' rotate_half layout,
// so Hugging Face weights load without any permutation; Llama 3.1's frequency scaling as an
// option), grouped-query attention through scaled_dot_product_attention (causal), a SwiGLU MLP,
// no biases, a token embedding and an output head, optionally tied. It computes what
// transformers' LlamaForCausalLM computes (tests/unit/llama_test.cc holds it to float64
// rounding), including transformers' precision choices: the RMSNorm in float32 cast back to the
// input's dtype, the rotary cos/sin tables in float32 cast to the residual stream's dtype.
//
// Built from dtrain's tensor-parallel layers: a tensor-parallel group splits the query and the
// key/value heads (heads and kv_heads must both divide by its size), the MLP and the
// vocabulary. With a group of one rank it is the plain model; any group size draws the same
// initial full weights (normal(0, init_std), as transformers' initializer_range; norms 1).
// sequence_parallel additionally splits the residual stream and the RMSNorms along the sequence
// (Megatron-LM sequence parallelism, as the GPT does); attention still sees the whole sequence,
// and its rotary positions are the whole sequence's.
//
// A plain model: its forward is the embedding, its BlockStack, the final norm and the head.
// Pipeline stages, ZeRO-3 units, activation checkpointing and layer offload are applied from
// outside through llama_spec() (models/model_spec.h).
//
// Incremental decoding (generation): LlamaImpl::forward_cached() takes the new tokens of each
// row and a LlamaKvCache holding the keys and values of the positions before them, and returns
// the new positions' logits: a prompt's prefill in one call, then one token per call. It runs
// without autograd, at any tensor-parallel size (each rank caches its own key/value heads), not
// sequence-parallel. models/sampling.h draws the next tokens from the logits.
//
// Parameter names: embed.weight, blocks.<i>.attn_norm.weight, blocks.<i>.attn.{q,k,v,o}.weight,
// blocks.<i>.mlp_norm.weight, blocks.<i>.mlp.{gate,up,down}.weight, norm.weight, head.weight
// (with tie_embeddings, head.weight is embed.weight: one tensor under two names, which
// trained_parameters() trains once). llama_hf_name() / llama_dtrain_name() (train/hf_llama.h)
// translate them to and from transformers' names.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "dtrain/engine/models/blocks.h"
#include "dtrain/engine/models/kv_cache.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/models/tied_head.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {

struct LlamaOptions {
  int64_t vocab = 32000, d_model = 4096, heads = 32, kv_heads = 0 /*0: = heads*/, ff = 11008, seq_len = 2048;
  int layers = 32;
  double norm_eps = 1e-5, rope_theta = 10000.0;
  // Llama 3.1 rope scaling (rope_type "llama3"): off unless rope_factor > 0
  double rope_factor = 0, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  int64_t rope_original_positions = 8192;
  bool tie_embeddings = false;
  // Split activations between the tensor-parallel regions along the sequence (seq_len must
  // divide by the group size). No effect with a group of one rank.
  bool sequence_parallel = false;
  // The initial weights' standard deviation (transformers' initializer_range); <= 0 keeps the
  // tensor-parallel layers' own initialization (torch.nn.Linear's uniform, Embedding's normal).
  double init_std = 0.02;
};

// From a Hugging Face config.json's text (model_type "llama" or "mistral", or none): vocab_size,
// hidden_size, num_attention_heads, intermediate_size and num_hidden_layers are required;
// num_key_value_heads (default: the heads), rms_norm_eps (1e-6), rope_theta (10000; or
// transformers 5's rope_parameters), rope_scaling (rope_type/type "llama3": factor,
// low_freq_factor, high_freq_factor, original_max_position_embeddings; "default" or null: none),
// tie_word_embeddings (false), max_position_embeddings (2048) -> seq_len (the caller may
// override it), initializer_range (0.02) take transformers' defaults. dtrain::Error naming the
// field for a missing or invalid one and for what this model does not have: attention_bias or
// mlp_bias true, a hidden_act other than silu, a rope_scaling type other than llama3, a
// head_dim other than hidden_size / num_attention_heads, a sliding_window shorter than the
// positions, another model_type.
LlamaOptions llama_options_from_hf_config(const std::string& json_text);

// The rotary tables of `positions` positions: cos and sin, float32 [positions, head_dim] on the
// CPU, computed exactly as transformers computes them (its float32 inverse frequencies, with
// Llama 3.1's scaling when rope_factor > 0).
std::pair<at::Tensor, at::Tensor> llama_rope_tables(const LlamaOptions& o, int64_t positions);

// The rotary tables, computed once per (length, device, dtype) and shared by the blocks.
class LlamaRope {
 public:
  explicit LlamaRope(const LlamaOptions& o);
  // cos, sin [S, head_dim] in dtype on device.
  std::pair<at::Tensor, at::Tensor> tables(int64_t S, c10::Device device, at::ScalarType dtype);

 private:
  LlamaOptions options_;
  std::mutex mu_;
  struct Entry {
    int64_t S;
    c10::Device device;
    at::ScalarType dtype;
    at::Tensor cos, sin;
  };
  std::vector<Entry> cache_;
};

// RMSNorm with a weight only, computed in float32 and cast back to the input's dtype before the
// weight multiplies (transformers' LlamaRMSNorm). sequence_parallel: the weight's gradient is
// summed over the group (the input is this rank's part of the sequence).
struct LlamaRmsNormImpl : torch::nn::Module {
  LlamaRmsNormImpl(int64_t dim, double eps, dist::Communicator& tp, bool sequence_parallel);
  at::Tensor forward(const at::Tensor& x);
  double eps;
  bool sequence_parallel;
  dist::Communicator* tp;
  at::Tensor weight;  // [dim]
};
TORCH_MODULE(LlamaRmsNorm);

// Grouped-query self-attention: q, k and v column-parallel (heads/T query heads and kv_heads/T
// key/value heads per rank), rotary embeddings, causal scaled_dot_product_attention, o
// row-parallel. Sequence-parallel: x and the result are this rank's [B, S/T, d].
struct LlamaAttentionImpl : torch::nn::Module {
  // cp: a context-parallel group (null: none): x is this rank's part of each sequence in the
  // balanced layout, rotated at its global positions, and attention is ring attention over cp
  // (the key/value heads repeated to the query heads).
  LlamaAttentionImpl(const LlamaOptions& o, dist::Communicator& tp, std::shared_ptr<LlamaRope> rope,
                     dist::Communicator* cp = nullptr);
  at::Tensor forward(const at::Tensor& x);
  // Incremental decoding: x [B, T_new, d] at positions start..start+T_new-1; their rotated keys
  // and values are written into k_cache, v_cache [B, local_kv_heads, max_len, head_dim] at those
  // positions, and the queries attend to positions 0..start+T_new-1 (causal among the new ones).
  // With left padding (step.positions) each row is rotated at its own positions.
  at::Tensor forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache, const CachedStep& step);
  int64_t local_heads, local_kv_heads, head_dim;
  dist::Communicator* cp;  // null: none, or a group of one rank
  std::shared_ptr<LlamaRope> rope;
  ColumnParallelLinear q{nullptr}, k{nullptr}, v{nullptr};
  RowParallelLinear o{nullptr};
};
TORCH_MODULE(LlamaAttention);

// down(silu(gate(x)) * up(x)): gate and up column-parallel, down row-parallel.
struct LlamaMlpImpl : torch::nn::Module {
  LlamaMlpImpl(const LlamaOptions& o, dist::Communicator& tp);
  at::Tensor forward(const at::Tensor& x);
  ColumnParallelLinear gate{nullptr}, up{nullptr};
  RowParallelLinear down{nullptr};
};
TORCH_MODULE(LlamaMlp);

struct LlamaBlockImpl : torch::nn::Module {
  LlamaBlockImpl(const LlamaOptions& o, dist::Communicator& tp, std::shared_ptr<LlamaRope> rope,
                 dist::Communicator* cp = nullptr);
  at::Tensor forward(const at::Tensor& x);  // [B, S, d], or [B, S/T, d] when sequence-parallel
  // forward() with the attention's forward_cached (LlamaAttentionImpl).
  at::Tensor forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache, const CachedStep& step);
  LlamaRmsNorm attn_norm{nullptr}, mlp_norm{nullptr};
  LlamaAttention attn{nullptr};
  LlamaMlp mlp{nullptr};
};
TORCH_MODULE(LlamaBlock);

// The Llama's key/value cache: kv_cache.h's, keys after the rotary embedding.
using LlamaKvCache = KvCache;

struct LlamaImpl : torch::nn::Module {
  // cp: a context-parallel group, as GptImpl takes it (gpt.h): embed() and the losses take whole
  // sequences, each rank keeps its part in the balanced layout. tp and cp must outlive the model.
  LlamaImpl(const LlamaOptions& o, dist::Communicator& tp, dist::Communicator* cp = nullptr);
  // tokens [B, T] -> this rank's logits [B, T, padded_vocab / tp].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy: inputs [B, T], targets [B, T].
  at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets);
  // The parts of the forward pass: tokens -> the residual stream the blocks take ([B, T, d],
  // [B, T/tp, d] sequence-parallel); the blocks' output -> logits, or -> the mean loss.
  at::Tensor embed(const at::Tensor& tokens);
  at::Tensor logits(const at::Tensor& h);
  at::Tensor head_loss(const at::Tensor& h, const at::Tensor& targets);
  int64_t parameter_count() const;  // of the full (unsplit) model, a tied weight once
  // Incremental decoding. make_kv_cache: an empty cache for `batch` rows and up to max_len
  // positions (any length: the rotary tables are computed for it; the model's seq_len is not a
  // limit here), allocated in the embedding weight's dtype on its device, so convert and move
  // the model first. forward_cached: tokens [B, T_new] (int64, ids below options.vocab) at
  // positions cache.length..cache.length+T_new-1 -> this rank's logits for them [B, T_new,
  // padded_vocab / tp], as forward() on the whole sequence gives them at those positions; the
  // new keys and values are appended (cache.length += T_new). Runs under NoGradGuard, the blocks
  // one by one (an installed BlockRunner's checkpointing or streaming is not used: the weights
  // must be on the device). Collective over tp (every rank of the group calls it with the same
  // tokens). dtrain::Error for a sequence-parallel model (build one without sequence_parallel:
  // the weights are the same), a pipeline stage, a batch other than the cache's, a cache of
  // another model or one too short.
  LlamaKvCache make_kv_cache(int64_t batch, int64_t max_len);
  at::Tensor forward_cached(const at::Tensor& tokens, LlamaKvCache& cache);
  // Draws the initial weights (normal(0, init_std) full tensors, each rank keeping its shard;
  // norms 1); the constructor calls it.
  void reset_parameters();
  LlamaOptions options;  // kv_heads resolved (never 0)
  dist::Communicator* tp;
  dist::Communicator* cp;  // the context-parallel group; null without one (or of one rank)
  std::shared_ptr<LlamaRope> rope;
  VocabParallelEmbedding embed_tokens{nullptr};  // registered as "embed"
  BlockStack blocks{nullptr};
  LlamaRmsNorm norm{nullptr};
  ColumnParallelLinear head{nullptr};  // untied; registered as "head"
  TiedVocabHead tied_head{nullptr};    // tie_embeddings (tied_head.h); registered as "head"
};
TORCH_MODULE(Llama);

// The Llama's ModelSpec for batches whose field 0 holds [B, seq_len + 1] token windows (inputs
// w[:, :S], targets w[:, 1:]): pre = embed, post = head_loss, pre_modules embed, post_modules
// norm and head, the stage activation [rows, S (or S/tp), d] of the embedding weight's dtype
// when llama_spec is called (float32 unless the model was converted first; set
// activation_dtype otherwise).
ModelSpec llama_spec(const std::shared_ptr<LlamaImpl>& model);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
