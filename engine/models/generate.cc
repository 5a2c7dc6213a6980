// generate() (generate.h): the prompts' pass, then a token per step, drawn by tensor-parallel
// rank 0 from the gathered logits.
#include "dtrain/engine/models/generate.h"

#include <algorithm>
#include <chrono>

#include <ATen/core/grad_mode.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {
namespace {

// The next token of each row from this rank's logits of the last position [B, local vocab]: the
// real vocabulary gathered, tensor-parallel rank 0's draw broadcast. [B] int64 on the CPU.
at::Tensor next_tokens(const at::Tensor& local, int64_t vocab, const SamplingOptions& s, at::Generator& gen,
                       dist::Communicator& tp, c10::Device device) {
  at::Tensor full = tp.size() > 1 ? gather_from_tensor_parallel(local.contiguous(), tp) : local;
  full = full.narrow(1, 0, vocab);
  if (tp.size() == 1) return sample_next_tokens(full, s, gen);
  at::Tensor t = tp.rank() == 0 ? sample_next_tokens(full, s, gen).to(device)
                                : at::empty({full.size(0)}, at::TensorOptions().dtype(at::kLong).device(device));
  tp.broadcast(t, 0)->wait();
  return t.cpu();
}

}  // namespace

Generated generate(const Decoder& model, const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& o,
                   dist::Communicator& tp, c10::Device device) {
  check_sampling_options(o.sampling);
  DTRAIN_CHECK(o.max_new_tokens >= 1, "generate: max_new_tokens=", o.max_new_tokens, " must be >= 1");
  DTRAIN_CHECK(!prompts.empty(), "generate: no prompts");
  DTRAIN_CHECK(o.pad_id >= 0 && o.pad_id < model.vocab, "generate: pad_id ", o.pad_id, " is not an id below the "
               "vocabulary of ", model.vocab);
  int64_t P = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    DTRAIN_CHECK(!prompts[r].empty(), "generate: prompt ", r + 1, " is empty (a prompt needs at least one token, e.g. "
                 "the tokenizer's BOS)");
    for (int64_t id : prompts[r]) {
      DTRAIN_CHECK(id >= 0 && id < model.vocab, "generate: prompt ", r + 1, " holds the id ", id,
                   ", outside the vocabulary of ", model.vocab);
    }
    P = std::max<int64_t>(P, static_cast<int64_t>(prompts[r].size()));
  }
  const int64_t B = static_cast<int64_t>(prompts.size());
  // Shorter prompts left-padded to the longest: the cache hides a row's pads.
  at::Tensor sequence = at::full({B, P}, o.pad_id, at::kLong);
  std::vector<int64_t> pads(B, 0);
  for (int64_t r = 0; r < B; ++r) {
    pads[r] = P - static_cast<int64_t>(prompts[r].size());
    std::copy(prompts[r].begin(), prompts[r].end(), sequence[r].data_ptr<int64_t>() + pads[r]);
  }
  const bool padded = *std::max_element(pads.begin(), pads.end()) > 0;
  DTRAIN_CHECK(o.use_cache || !padded, "generate: prompts of unequal length are left-padded in the key/value cache; "
               "use_cache = false recomputes without padding: use the cache, or prompts of one length");
  at::NoGradGuard no_grad;
  sequence = sequence.to(device);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  KvCache cache;
  if (o.use_cache) cache = model.make_kv_cache(B, P + o.max_new_tokens);
  if (padded) cache.left_pad = at::tensor(pads, at::kLong);
  Generated g;
  g.rows.resize(B);
  std::vector<bool> ended(B, false);
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  at::Tensor logits = o.use_cache ? model.forward_cached(sequence, cache) : model.forward(sequence);
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const at::Tensor next = next_tokens(logits.select(1, -1), model.vocab, o.sampling, gen, tp, device);
    if (i == 0) g.prefill_s = seconds();
    if (o.on_token) o.on_token(next);
    bool all_ended = true;
    const at::Tensor ids = next.contiguous();  // [B] on the CPU
    const int64_t* drawn = ids.data_ptr<int64_t>();
    for (int64_t r = 0; r < B; ++r) {
      const int64_t t = drawn[r];
      if (!ended[r]) g.rows[r].push_back(t);
      ended[r] = ended[r] || t == o.eos;
      all_ended = all_ended && ended[r];
    }
    if (all_ended || i + 1 == o.max_new_tokens) break;  // every rank sees the same tokens: the same choice
    const at::Tensor column = next.unsqueeze(1).to(device);
    ++g.steps;
    if (o.use_cache) {
      logits = model.forward_cached(column, cache);
    } else {
      sequence = at::cat({sequence, column}, 1);
      logits = model.forward(sequence);
    }
  }
  g.total_s = seconds();
  return g;
}

}  // namespace dtrain::engine
