// Internal to engine/models: what the decoder language models (gpt.cc, llama.cc) share, the
// pieces after their blocks and their ModelSpec. Not installed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/engine/models/blocks.h"
#include "dtrain/engine/models/kv_cache.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/models/tied_head.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/context_parallel.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine::decoder_lm {

// The context-parallel group a model was given when it has more than one rank, else null (the
// plain model).
inline dist::Communicator* active_cp(dist::Communicator* cp) { return cp != nullptr && cp->size() > 1 ? cp : nullptr; }

// This rank's part of a whole-sequence tensor [B, S, ...] (dimension 1) in context
// parallelism's balanced layout; x itself without a group.
inline at::Tensor cp_local(const at::Tensor& x, dist::Communicator* cp) {
  return cp ? cp_split_sequence(x, 1, cp->rank(), cp->size()) : x;
}

// The model's sequence length against its context-parallel group (before any communication):
// 2C chunks of equal length, each rank's S/C tokens splitting again over tp when
// sequence-parallel.
inline void check_context_parallel(int64_t seq_len, dist::Communicator* cp, bool sequence_parallel,
                                   dist::Communicator& tp) {
  if (!cp) return;
  const int64_t C = cp->size();
  DTRAIN_CHECK(seq_len % (2 * C) == 0, "--seq_len=", seq_len, " does not split into 2 x --cp=", C,
               " equal chunks (context parallelism gives each rank a chunk from the front and its mirror from "
               "the back); use a sequence length that is a multiple of ", 2 * C);
  DTRAIN_CHECK(!sequence_parallel || (seq_len / C) % tp.size() == 0, "--sequence_parallel with --cp=", C,
               ": each rank's ", seq_len / C, " tokens do not divide over --tp=", tp.size(),
               "; use a sequence length that is a multiple of ", 2 * C * tp.size());
}

// The normed residual stream h -> this rank's logits [B, T, padded_vocab / tp]: through the head
// tied to the embedding when the model has one, else through its own head.
inline at::Tensor head_logits(ColumnParallelLinear& head, TiedVocabHead& tied_head, const at::Tensor& h) {
  return tied_head.is_empty() ? head->forward(h) : tied_head->forward(h);
}

// Mean next-token cross-entropy of this rank's vocabulary slice of the logits ([..., local])
// against targets (the same shape but the last dimension); collective over tp.
inline at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                                  dist::Communicator& tp) {
  const int64_t local = logits.size(-1);
  return vocab_parallel_cross_entropy(logits.reshape({-1, local}), targets.reshape({-1}), local * tp.rank(), vocab,
                                      tp);
}

// ---- incremental decoding (forward_cached) ---------------------------------------------------

// The stack's i-th block as the model's Block type (named `kind` in errors); the whole model's
// stack only, not a pipeline stage's.
template <class Block>
Block& decoding_block(BlockStackImpl& stack, size_t i, const char* kind) {
  DTRAIN_CHECK(static_cast<int>(stack.size()) == stack.whole_size(), "incremental decoding needs the whole model; "
               "this one is a pipeline stage (blocks ", stack.index(0), "..", stack.index(stack.size() - 1), " of ",
               stack.whole_size(), "): generate with --pp=1");
  auto block = std::dynamic_pointer_cast<Block>(stack.block(i));
  DTRAIN_CHECK(block != nullptr, "incremental decoding: block ", stack.index(i), " is not a ", kind);
  return *block;
}

// h through every block's forward_cached with its layer of the cache (the blocks as Block).
template <class Block>
at::Tensor cached_blocks(BlockStackImpl& stack, at::Tensor h, KvCache& cache, const CachedStep& step, const char* kind) {
  for (size_t i = 0; i < stack.size(); ++i) {
    h = decoding_block<Block>(stack, i, kind).forward_cached(h, cache.k[i], cache.v[i], step);
  }
  return h;
}

// An empty cache for `layers` layers of `kv_heads` heads (this rank's) of head_dim, `batch`
// rows and max_len positions, in `options`' dtype and device. Not context-parallel.
inline KvCache empty_kv_cache(size_t layers, int64_t batch, int64_t kv_heads, int64_t max_len, int64_t head_dim,
                              const at::TensorOptions& options, dist::Communicator* cp) {
  DTRAIN_CHECK(cp == nullptr, "incremental decoding: the model is context-parallel (over ", cp ? cp->size() : 0,
               " ranks), and decoding feeds a few tokens at a time; build the model without a context-parallel "
               "group to generate (its weights are the same)");
  DTRAIN_CHECK(batch >= 1 && max_len >= 1, "make_kv_cache: batch (", batch, ") and max_len (", max_len,
               ") must be positive");
  KvCache cache;
  for (size_t i = 0; i < layers; ++i) {
    cache.k.push_back(at::empty({batch, kv_heads, max_len, head_dim}, options));
    cache.v.push_back(at::empty({batch, kv_heads, max_len, head_dim}, options));
  }
  return cache;
}

// Every check of a forward_cached(tokens, cache) call before anything runs: not context- or
// sequence-parallel, integer tokens [B, T_new], a cache of this model (layers, this rank's
// kv_heads, head_dim) with B rows and room for T_new more positions.
inline void check_cached_call(const at::Tensor& tokens, const KvCache& cache, size_t layers, int64_t kv_heads,
                              int64_t head_dim, dist::Communicator* cp, bool sequence_parallel) {
  DTRAIN_CHECK(cp == nullptr, "forward_cached: the model is context-parallel; build it without a context-parallel "
               "group to generate (its weights are the same)");
  DTRAIN_CHECK(!sequence_parallel, "forward_cached: the model is sequence-parallel (it splits every sequence over the "
               "tensor-parallel group), and incremental decoding feeds a few tokens at a time; build the model "
               "without sequence_parallel to generate (its weights are the same)");
  DTRAIN_CHECK(tokens.dim() == 2 && tokens.size(1) >= 1 && !at::isFloatingType(tokens.scalar_type()),
               "forward_cached: tokens must be integer ids [B, T_new] with T_new >= 1, got ", tokens.scalar_type(),
               " ", tokens.sizes());
  DTRAIN_CHECK(cache.k.size() == layers && cache.v.size() == layers &&
                   (cache.k.empty() || (cache.k[0].size(1) == kv_heads && cache.k[0].size(3) == head_dim)),
               "forward_cached: the cache was not made for this model (", cache.k.size(), " layers; the model has ",
               layers, " with ", kv_heads, " key/value heads per rank): use its make_kv_cache()");
  DTRAIN_CHECK(tokens.size(0) == cache.batch(), "forward_cached: ", tokens.size(0), " rows of tokens, the cache holds ",
               cache.batch(), " (make_kv_cache's batch)");
  const int64_t T = tokens.size(1);
  DTRAIN_CHECK(cache.length >= 0 && cache.length + T <= cache.max_len(), "forward_cached: ", T, " new tokens after ",
               cache.length, " cached positions need ", cache.length + T, " positions; the cache holds ",
               cache.max_len(), " (make_kv_cache's max_len)");
  if (cache.left_pad.defined()) {
    const at::Tensor& p = cache.left_pad;
    DTRAIN_CHECK(p.dim() == 1 && p.size(0) == cache.batch() && p.scalar_type() == at::kLong, "forward_cached: "
                 "cache.left_pad must be int64 [", cache.batch(), "] (a row's pad positions), got ", p.scalar_type(),
                 " ", p.sizes());
    DTRAIN_CHECK(p.numel() == 0 || p.min().item<int64_t>() >= 0, "forward_cached: cache.left_pad holds a negative count");
  }
}

// The step of a forward_cached(tokens, cache) call: its first slot, and with cache.left_pad each
// row's positions (slot - pad, from 0 at its first real token; pads at 0) and the mask that
// hides a row's pads from every query (a pad position sees itself only), on the tokens' device.
inline CachedStep cached_step(const KvCache& cache, const at::Tensor& tokens) {
  CachedStep step(cache.length);
  if (!cache.left_pad.defined()) return step;
  const int64_t T = tokens.size(1), end = cache.length + T;
  const auto longs = at::TensorOptions().dtype(at::kLong).device(tokens.device());
  const at::Tensor pad = cache.left_pad.to(tokens.device()).unsqueeze(1);  // [B, 1]
  const at::Tensor slots = at::arange(cache.length, end, longs).unsqueeze(0);  // [1, T]
  step.positions = (slots - pad).clamp_min(0);                              // [B, T]
  const at::Tensor keys = at::arange(end, longs).view({1, 1, end});         // [1, 1, end]
  const at::Tensor queries = slots.unsqueeze(2);                            // [1, T, 1]
  step.mask = (((keys >= pad.unsqueeze(2)) & (keys <= queries)) | (keys == queries)).unsqueeze(1);  // [B, 1, T, end]
  return step;
}

// The ModelSpec of a decoder model (GptImpl, LlamaImpl: options.seq_len, .sequence_parallel,
// .d_model, tp, cp, blocks, embed(), head_loss()) for batches whose field 0 holds [B, seq_len + 1]
// token windows (inputs w[:, :S], targets w[:, 1:]): pre = embed, post = head_loss, blocks
// "blocks.", the stage activation [rows, S (or S/tp sequence-parallel; divided by C more under
// context parallelism), d] of activation_dtype.
template <class Model>
ModelSpec token_window_spec(const std::shared_ptr<Model>& model, std::vector<std::string> pre_modules,
                            std::vector<std::string> post_modules, at::ScalarType activation_dtype) {
  ModelSpec s;
  s.module = model;
  s.blocks = model->blocks;
  s.blocks_prefix = "blocks.";
  Model* m = model.get();  // the spec's users hold `module` alive
  const int64_t S = model->options.seq_len;
  s.pre = [m, S](const Batch& b) { return m->embed(b.fields.at(0).narrow(1, 0, S)); };
  s.post = [m, S](const at::Tensor& h, const Batch& b) { return m->head_loss(h, b.fields.at(0).narrow(1, 1, S)); };
  s.pre_modules = std::move(pre_modules);
  s.post_modules = std::move(post_modules);
  const int64_t local = model->cp ? S / model->cp->size() : S;  // context-parallel: this rank's part
  const int64_t rows_per_rank = model->options.sequence_parallel ? local / model->tp->size() : local;
  s.activation_shape = [rows_per_rank, d = model->options.d_model](int64_t rows) {
    return std::vector<int64_t>{rows, rows_per_rank, d};
  };
  s.activation_dtype = activation_dtype;
  s.context_parallel = model->cp;
  return s;
}

}  // namespace dtrain::engine::decoder_lm

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
