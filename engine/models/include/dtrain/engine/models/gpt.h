// A GPT-style decoder language model (GPT-2 layout: pre-norm blocks, causal self-attention
// through scaled_dot_product_attention, GELU MLP (tanh approximation), learned positions, an
// output head of its own or tied to the token embedding) built
// from dtrain's tensor-parallel layers, so a tensor-parallel group splits heads, MLP and
// vocabulary. With a group of one rank it is the plain model; any group size draws the same
// initial full weights. sequence_parallel additionally splits the residual stream and the layer
// norms along the sequence over the group (Megatron-LM sequence parallelism): each rank keeps
// [B, S/T, d] between the parallel regions; the result is the same model (float rounding).
//
// Context parallelism (cp, a group of more than one rank; context_parallel.h): every rank of
// the group is given the same whole sequences and keeps its part of each in the balanced
// layout (seq_len a multiple of 2C): embed() takes whole [B, S] tokens and returns this rank's
// [B, S/C, d] at their global positions, attention is ring attention over cp, forward()
// returns this rank's logits [B, S/C, ...] (cp_gather_sequence puts them back in order), and
// loss()/head_loss() take whole targets and return the mean over this rank's tokens; the mean
// of the group's losses (and gradients) is the whole sequence's. The weights are replicated
// over cp: average their gradients over dp x cp (Mesh::replicas()). Without cp, or with a group
// of one rank, the plain model.
//
// Incremental decoding (generation): forward_cached() with a KvCache (kv_cache.h), as the Llama's.
//
// A plain model: its forward is embeddings, its BlockStack, final norm and head. Pipeline
// stages, ZeRO-3 units, activation checkpointing and layer offload are applied from outside
// through gpt_spec() (models/model_spec.h).
#pragma once

#include <memory>

#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include "dtrain/engine/models/blocks.h"
#include "dtrain/engine/models/kv_cache.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/models/tied_head.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {

struct GptOptions {
  int64_t vocab = 32000, d_model = 768, heads = 12, ff = 3072, seq_len = 1024;
  int layers = 12;
  double dropout = 0.0;
  bool sparse_embedding = false;  // the token embedding's gradient sparse (the rows a batch touched)
  // Split activations between the tensor-parallel regions along the sequence (seq_len must
  // divide by the group size). No effect with a group of one rank.
  bool sequence_parallel = false;
  // The head is the token embedding's weight (GPT-2's layout; tied_head.h), else a weight of
  // its own (the default).
  bool tie_embeddings = false;
};

// From a Hugging Face GPT-2 config.json's text (model_type "gpt2"): vocab_size, n_embd,
// n_head, n_layer are required; n_inner (default 4 n_embd), n_positions (1024) -> seq_len (the
// caller may set a shorter one), tie_word_embeddings (true) take transformers' defaults.
// dtrain::Error naming the field for a missing or invalid one and for what this model does not
// have: an activation_function other than gelu_new (the tanh approximation of the MLP), a
// layer_norm_epsilon other than 1e-5 (torch's LayerNorm default the model uses),
// scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, add_cross_attention,
// scale_attn_weights false, another model_type. Dropout fields are ignored (dropout is a
// training choice: GptOptions::dropout).
GptOptions gpt_options_from_hf_config(const std::string& json_text);

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptOptions& o, dist::Communicator& tp, dist::Communicator* cp = nullptr);
  at::Tensor forward(const at::Tensor& x);  // [B, S, d], or [B, S/T, d] when sequence-parallel
  // forward() with the attention's forward_cached (ParallelSelfAttentionImpl).
  at::Tensor forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache, const CachedStep& step);
  at::Tensor norm(torch::nn::LayerNorm& ln, const at::Tensor& x);
  bool sequence_parallel;
  dist::Communicator* tp;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ParallelSelfAttention attn{nullptr};
  ParallelMlp mlp{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(GptBlock);

struct GptImpl : torch::nn::Module {
  // dtrain::Error when seq_len does not split into 2C chunks (or, sequence-parallel, S/C over
  // tp). tp and cp must outlive the model.
  GptImpl(const GptOptions& o, dist::Communicator& tp, dist::Communicator* cp = nullptr);
  // tokens [B, T] -> this rank's logits [B, T, padded_vocab / tp].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy: inputs [B, T], targets [B, T].
  at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets);
  // The parts of the forward pass: tokens -> the residual stream the blocks take ([B, T, d],
  // [B, T/tp, d] sequence-parallel); the blocks' output -> logits, or -> the mean loss.
  at::Tensor embed(const at::Tensor& tokens);
  at::Tensor logits(const at::Tensor& h);
  at::Tensor head_loss(const at::Tensor& h, const at::Tensor& targets);
  int64_t parameter_count() const;  // of the full (unsplit) model
  // Incremental decoding, as LlamaImpl's (llama.h): make_kv_cache gives an empty cache of
  // `batch` rows and max_len positions (at most options.seq_len: the positions are learned) in
  // the token embedding's dtype and device; forward_cached takes tokens [B, T_new] at positions
  // cache.length..cache.length+T_new-1 and returns this rank's logits for them [B, T_new,
  // padded_vocab / tp], as forward() on the whole sequence gives them, appending the new keys and
  // values. No autograd; the blocks one by one; collective over tp; dtrain::Error for a
  // sequence- or context-parallel model, a pipeline stage, or a cache of another model, batch or
  // too short.
  KvCache make_kv_cache(int64_t batch, int64_t max_len);
  at::Tensor forward_cached(const at::Tensor& tokens, KvCache& cache);
  GptOptions options;
  dist::Communicator* tp;
  dist::Communicator* cp;  // the context-parallel group; null without one (or of one rank)
  VocabParallelEmbedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  BlockStack blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  ColumnParallelLinear head{nullptr};  // untied
  TiedVocabHead tied_head{nullptr};    // tie_embeddings; registered as "head" as well
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Gpt);

// The GPT's ModelSpec for batches whose field 0 holds [B, seq_len + 1] token windows (inputs
// w[:, :S], targets w[:, 1:]): pre = embed, post = head_loss, pre_modules wte and wpe,
// post_modules ln_f and head, the stage activation [rows, S (or S/tp), d] float32.
ModelSpec gpt_spec(const std::shared_ptr<GptImpl>& model);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
