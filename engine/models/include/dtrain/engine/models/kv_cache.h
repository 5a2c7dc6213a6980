// The keys and values of the positions a decoder's forward_cached() has seen (LlamaImpl, GptImpl),
// per layer: this rank's key/value heads, [B, local_kv_heads, max_len, head_dim] each (a Llama's
// keys after the rotary embedding), positions 0..length-1 filled. Made by the model's
// make_kv_cache(); clear() starts it over for new sequences of the same batch size (nothing is
// freed or zeroed).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::engine {

struct KvCache {
  std::vector<at::Tensor> k, v;  // one per layer
  int64_t length = 0;            // positions filled
  int64_t batch() const { return k.empty() ? 0 : k.front().size(0); }
  int64_t max_len() const { return k.empty() ? 0 : k.front().size(2); }
  void clear() { length = 0; }
};

}  // namespace dtrain::engine
