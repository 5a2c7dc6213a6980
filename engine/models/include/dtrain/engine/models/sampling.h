// Choosing the next tokens of a language model from its logits: greedy (temperature 0), or a
// draw from the softmax of logits / temperature restricted to the top_k most likely tokens and
// then to the nucleus of top_p (the smallest set of the most likely tokens whose probability
// reaches top_p; always at least one token), as transformers' generate(do_sample=True) applies
// temperature, top_k and top_p in that order. The draws come from a seeded at::Generator, so a
// run repeats itself.
//
//   at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
//   engine::SamplingOptions s;  s.temperature = 0.8;  s.top_p = 0.95;
//   at::Tensor next = engine::sample_next_tokens(full_logits, s, gen);  // [B] int64 on the CPU
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace dtrain::engine {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (the argmax, the lowest id among equals); else > 0
  int64_t top_k = 0;         // keep the k most likely tokens; 0: all
  double top_p = 1.0;        // keep the nucleus of this probability mass, 0 < top_p <= 1; 1: all
};

// dtrain::Error naming the field for a negative or non-finite temperature, a negative top_k, a
// top_p outside (0, 1].
void check_sampling_options(const SamplingOptions& o);

// The distribution a draw takes its tokens from: logits [B, V] (the whole real vocabulary,
// padding columns removed) -> probabilities [B, V] in float32 (float64 for float64 logits) on the
// logits' device, zero outside the kept tokens, each row summing to 1. Greedy: one-hot rows.
at::Tensor sampling_probabilities(const at::Tensor& logits, const SamplingOptions& o);

// The next token of each row: [B] int64 on the CPU (greedy: the argmax; else a draw from
// sampling_probabilities with `generator`, a CPU generator, which advances).
at::Tensor sample_next_tokens(const at::Tensor& logits, const SamplingOptions& o, at::Generator& generator);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
