// The keys and values of the positions a decoder's forward_cached() has seen (LlamaImpl, GptImpl),
// per layer: this rank's key/value heads, [B, local_kv_heads, max_len, head_dim] each (a Llama's
// keys after the rotary embedding), positions 0..length-1 filled. Made by the model's
// make_kv_cache(); clear() starts it over for new sequences of the same batch size (nothing is
// freed or zeroed).
//
// Prompts of unequal length go in one batch left-padded: left_pad [B] (int64) holds each row's
// leading pad positions. No position attends to a row's pads (a pad position attends to itself
// only, so nothing is NaN), and each row counts its positions from its first real token, so each
// row's logits are those of its prompt alone (what transformers' generate does with a left-padded
// attention_mask). Set it before the first forward_cached; undefined (the default): no padding.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/engine/parallel/cached_attention.h"  // CachedStep

namespace dtrain::engine {

struct KvCache {
  std::vector<at::Tensor> k, v;  // one per layer
  int64_t length = 0;            // positions filled
  at::Tensor left_pad;           // [B] int64 pad positions before each row's tokens; undefined: none
  int64_t batch() const { return k.empty() ? 0 : k.front().size(0); }
  int64_t max_len() const { return k.empty() ? 0 : k.front().size(2); }
  void clear() {
    length = 0;
    left_pad = at::Tensor();
  }
};

}  // namespace dtrain::engine
