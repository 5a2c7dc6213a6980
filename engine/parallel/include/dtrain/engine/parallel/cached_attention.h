// Attention against a key/value cache, for incremental decoding (the models' forward_cached,
// models/kv_cache.h): what the attention layers of the Llama and the GPT share.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace dtrain::engine {

// What the layers of one forward_cached call share: the first new position and, with left
// padding, each row's positions of the new tokens and the attention mask. Made by the model from
// its cache; an int converts to a step without padding.
struct CachedStep {
  CachedStep(int64_t first = 0) : start(first) {}  // NOLINT(google-explicit-constructor)
  int64_t start = 0;
  at::Tensor positions;  // [B, T] int64: each row's position of each new token; undefined: start..start+T-1
  at::Tensor mask;       // [B, 1, T, start+T] bool, true where a new query may attend; undefined: causal
};

// Causal attention of new positions against a key/value cache (incremental decoding): q
// [B, H, T, hd] at cache slots step.start..step.start+T-1, their keys and values k, v
// [B, Hkv, T, hd] written into k_cache, v_cache [B, Hkv, max_len, hd] there; each new query sees
// every cached slot and the new ones up to its own (from slot 0: plain causal attention), or
// what step.mask allows (left padding, kv_cache.h). -> [B, H, T, hd]. Grouped-query when
// Hkv < H (H a multiple of Hkv); scale defaults to 1/sqrt(hd).
at::Tensor cached_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                   at::Tensor& v_cache, const CachedStep& step,
                                   std::optional<double> scale = std::nullopt);

}  // namespace dtrain::engine
