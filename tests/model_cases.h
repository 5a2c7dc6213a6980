// Small models the tests share: the Llama (and GPT) the tensor-parallel tests split and the reference
// weights they give it (tests/mpi/llama_mpi_test.cc, tests/mpi/llama_generate_mpi_test.cc,
// tests/unit/llama_generate_test.cc), and a one-layer seq2seq (the cross-entropy tests).
#pragma once

#include <map>
#include <string>

#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/models/seq2seq.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine::model_cases {

// Heads 8 and key/value heads 4 (grouped-query) split over 2 and 4 ranks; a vocabulary of 51
// (padded at both group sizes); llama3 rope scaling with a band of each kind.
inline LlamaOptions split_llama_options(int64_t seq_len, bool sequence_parallel, bool tied) {
  LlamaOptions o;
  o.vocab = 51;
  o.d_model = 64;
  o.heads = 8;
  o.kv_heads = 4;
  o.ff = 96;
  o.seq_len = seq_len;
  o.layers = 2;
  o.rope_factor = 8;
  o.rope_original_positions = 64;
  o.init_std = 0.3;
  o.tie_embeddings = tied;
  o.sequence_parallel = sequence_parallel;
  return o;
}

// The GPT the generation tests split: 8 heads over 2 and 4 ranks, a vocabulary of 51 (padded
// at both group sizes), no dropout.
inline GptOptions split_gpt_options(int64_t seq_len, bool tied) {
  GptOptions o;
  o.vocab = 51;
  o.d_model = 64;
  o.heads = 8;
  o.ff = 96;
  o.seq_len = seq_len;
  o.layers = 2;
  o.tie_embeddings = tied;
  return o;
}

// Norm weights other than 1: normal(1, 0.2) from a generator of `seed`, so the same on every
// rank (the model's initial norms are all 1); the GPT's layer norms (ln1, ln2, ln_f) too, and
// their biases normal(0, 0.2).
inline void draw_norm_weights(torch::nn::Module& model, uint64_t seed) {
  at::NoGradGuard no_grad;
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    const bool layer_norm = name.rfind("ln", 0) == 0 || name.find(".ln") != std::string::npos;
    if (name.find("norm.weight") != std::string::npos || (layer_norm && name.find(".weight") != std::string::npos)) {
      item.value().normal_(1.0, 0.2, g);
    } else if (layer_norm && name.find(".bias") != std::string::npos) {
      item.value().normal_(0.0, 0.2, g);
    }
  }
}

// The whole (unsplit) reference's weights into the split `model`, each rank its shards.
inline void load_reference_weights(torch::nn::Module& ref, torch::nn::Module& model, dist::Communicator& tp) {
  std::map<std::string, at::Tensor> full;
  for (auto& item : ref.named_parameters()) full[item.key()] = item.value().detach();
  load_full_state(model, full, tp);
}

// A seq2seq of one layer, two heads, a feed-forward twice d_model wide and no dropout.
inline Seq2SeqOptions one_layer_seq2seq(int64_t vocab, int64_t d_model, int64_t max_len) {
  Seq2SeqOptions o;
  o.vocab = vocab;
  o.d_model = d_model;
  o.heads = 2;
  o.ff = 2 * d_model;
  o.max_len = max_len;
  o.layers = 1;
  o.dropout = 0.0;
  return o;
}

// This rank's logits [B, T, padded_vocab / tp] gathered over tp: [B, T, vocab].
inline at::Tensor gather_logits(const at::Tensor& local, int64_t vocab, dist::Communicator& tp) {
  return gather_full_tensor(local.detach(), ShardSpec{2, 1, vocab, local.size(-1) * tp.size()}, tp);
}

}  // namespace dtrain::engine::model_cases
