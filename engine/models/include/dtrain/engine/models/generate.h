// Generation with a decoder language model of the library (LlamaImpl, GptImpl) or any model with
// the same two calls: prompts in, new token ids out, a token at a time with a key/value cache
// (kv_cache.h), greedy or sampled (sampling.h), at any tensor-parallel size.
//
//   auto model = std::make_shared<engine::LlamaImpl>(options, tp);   // weights loaded, eval()
//   engine::GenerateOptions g;  g.max_new_tokens = 64;  g.sampling.temperature = 0;
//   engine::Generated out = engine::generate(engine::decoder_of(model, options.vocab), {{1, 15043, 3186}}, g, tp,
//                                            device);
//   // out.rows[0]: the new ids (up to and with g.eos)
//
// GenerateOptions::on_token sees each step's tokens as they are drawn (dtrain-generate streams its
// text with it). Prompts of unequal length go in one batch, left-padded (KvCache::left_pad): each row continues
// as it would alone. The whole real vocabulary's logits are gathered over tp and tensor-parallel
// rank 0 draws the next tokens and broadcasts them, so the ranks never diverge.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/models/kv_cache.h"
#include "dtrain/engine/models/sampling.h"

namespace dtrain::engine {

// A decoder's calls as generation needs them: the whole-sequence forward and incremental
// decoding, each giving this rank's logits [B, T, padded_vocab / tp]; vocab: the real vocabulary
// (the padding columns are dropped before a draw).
struct Decoder {
  std::function<at::Tensor(const at::Tensor& tokens)> forward;
  std::function<KvCache(int64_t batch, int64_t max_len)> make_kv_cache;
  std::function<at::Tensor(const at::Tensor& tokens, KvCache& cache)> forward_cached;
  int64_t vocab = 0;
};

// The calls of a model with forward, make_kv_cache and forward_cached (the Llama, the GPT); the
// Decoder keeps the model alive.
template <class Model>
Decoder decoder_of(const std::shared_ptr<Model>& model, int64_t vocab) {
  Decoder d;
  d.forward = [model](const at::Tensor& tokens) { return model->forward(tokens); };
  d.make_kv_cache = [model](int64_t batch, int64_t max_len) { return model->make_kv_cache(batch, max_len); };
  d.forward_cached = [model](const at::Tensor& tokens, KvCache& cache) { return model->forward_cached(tokens, cache); };
  d.vocab = vocab;
  return d;
}

struct GenerateOptions {
  int64_t max_new_tokens = 32;  // >= 1
  SamplingOptions sampling;     // temperature 0: greedy
  uint64_t seed = 0;            // the draws' generator: the same seed, prompts and weights, the same tokens
  int64_t eos = -1;             // a token that ends its row (kept as its last token); -1: none
  bool use_cache = true;        // false: the whole sequence again every step (prompts of one length)
  int64_t pad_id = 0;           // what left pads hold (any id below vocab: they are never attended)
  // Called on every rank after each draw with the step's tokens ([B] int64 on the CPU; a row that
  // ended earlier gets tokens it does not keep), e.g. to print text as it comes. Empty: none.
  std::function<void(const at::Tensor& next)> on_token;
};

struct Generated {
  std::vector<std::vector<int64_t>> rows;  // each prompt's new tokens (up to and with eos)
  int64_t steps = 0;                       // forward passes after the prompts'
  double prefill_s = 0, total_s = 0;       // the prompts' pass (with the first draw), and everything
};

// Continues every prompt (each a non-empty list of ids below vocab) on `device`: the prompts'
// pass, then a token per step until every row has drawn eos or max_new_tokens. Synchronous,
// without autograd; collective over tp (every rank of the group calls it with the same prompts
// and options). dtrain::Error for empty prompts, an id outside the vocabulary, bad sampling
// options, max_new_tokens < 1, and use_cache = false with prompts of unequal length; the model's
// own errors (a cache longer than its positions) pass through.
Generated generate(const Decoder& model, const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& o,
                   dist::Communicator& tp, c10::Device device);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
