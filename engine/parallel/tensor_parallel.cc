#include "dtrain/engine/parallel/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/context_parallel.h"
#include "dtrain/engine/parallel/cross_entropy.h"
#include "dtrain/engine/parallel/fused_block_ops.h"
#include "parallel_comm_internal.h"

namespace dtrain::engine {
namespace {

at::Tensor all_reduce_copy(const at::Tensor& x, dist::Communicator& tp) {
  at::Tensor y = x.contiguous().clone();
  if (tp.size() > 1) tp.all_reduce(y)->wait();
  return y;
}

// Concatenation along the last dimension of every rank's x.
at::Tensor all_gather_last(const at::Tensor& x, dist::Communicator& tp) {
  return detail::all_gather_along(x, x.dim() - 1, tp);
}

at::Tensor slice_last(const at::Tensor& x, dist::Communicator& tp) {
  if (tp.size() == 1) return x;
  const int64_t last = x.size(-1);
  DTRAIN_CHECK(last % tp.size() == 0, "cannot split a last dimension of ", last, " over ",
               tp.size(), " tensor-parallel ranks");
  return x.chunk(tp.size(), -1)[tp.rank()].contiguous();
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce_copy(g[0], comm_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t tp) {
    return all_reduce_copy(x, comm_from(tp));
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromTp : torch::autograd::Function<GatherFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return all_gather_last(x, comm_of(ctx));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {slice_last(g[0], comm_of(ctx)), at::Tensor()};
  }
};

struct ScatterToTp : torch::autograd::Function<ScatterToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return slice_last(x, comm_of(ctx)).clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_last(g[0], comm_of(ctx)), at::Tensor()};
  }
};

// Mean cross-entropy over vocabulary-split logits (see the header).
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, int64_t real_vocab, int64_t tp_ptr) {
    auto& tp = comm_from(tp_ptr);
    const int64_t local = logits.size(1);
    // Reduced-precision logits are computed in float32; float64 stays float64.
    at::Tensor l = logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
    at::Tensor cols = at::arange(vocab_start, vocab_start + local, targets.options());
    if (vocab_start + local > real_vocab) {
      l = l.masked_fill((cols >= real_vocab).unsqueeze(0), -std::numeric_limits<float>::infinity());
    }
    at::Tensor m = std::get<0>(l.max(1));
    if (tp.size() > 1) tp.all_reduce(m, dist::ReduceOp::kMax)->wait();
    l = l - m.unsqueeze(1);  // padding columns stay -inf and give exp() = 0
    at::Tensor e = l.exp();
    at::Tensor s = e.sum(1);
    at::Tensor in_range = (targets >= vocab_start) & (targets < vocab_start + local);
    at::Tensor t_local = (targets - vocab_start).clamp(0, local - 1);
    // where, not a product with in_range: a shard of padding only holds -inf (and -inf * 0 is NaN).
    at::Tensor t = at::where(in_range, l.gather(1, t_local.unsqueeze(1)).squeeze(1), at::zeros_like(s));
    if (tp.size() > 1) {
      at::Tensor both = at::stack({s, t});  // one all-reduce for the sums and target logits
      tp.all_reduce(both)->wait();
      s = both[0];
      t = both[1];
    }
    at::Tensor loss = (s.log() - t).mean();
    ctx->save_for_backward({e.div_(s.unsqueeze(1)), t_local, in_range});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax over the whole vocabulary, local columns
    const int64_t n = grad.size(0);
    at::Tensor hit = saved[2].to(grad.scalar_type());
    grad.scatter_add_(1, saved[1].unsqueeze(1), -hit.unsqueeze(1));
    grad.mul_(g[0] / static_cast<double>(n));
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_cross_entropy_shapes(const at::Tensor& logits, const at::Tensor& targets) {
  DTRAIN_CHECK(logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0),
               "vocab_parallel_cross_entropy takes logits [N, V/T] and targets [N], got ",
               logits.sizes(), " and ", targets.sizes());
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Draws a full [rows, cols] weight as torch.nn.Linear does (uniform +-1/sqrt(fan_in)) from the
// default generator, so every tensor-parallel size consumes the same random numbers.
at::Tensor full_linear_init(int64_t rows, int64_t cols, int64_t fan_in) {
  double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return at::empty({rows, cols}).uniform_(-bound, bound);
}

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& x, dist::Communicator& tp) {
  return tp.size() == 1 ? x : CopyToTp::apply(x, comm_handle(&tp));
}
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, dist::Communicator& tp) {
  return tp.size() == 1 ? x : ReduceFromTp::apply(x, comm_handle(&tp));
}
at::Tensor gather_from_tensor_parallel(const at::Tensor& x, dist::Communicator& tp) {
  return tp.size() == 1 ? x : GatherFromTp::apply(x, comm_handle(&tp));
}
at::Tensor scatter_to_tensor_parallel(const at::Tensor& x, dist::Communicator& tp) {
  return tp.size() == 1 ? x : ScatterToTp::apply(x, comm_handle(&tp));
}

at::Tensor shard_of(const at::Tensor& full, const ShardSpec& spec, int rank, int size) {
  // The whole tensor, unpadded (spec.full) or padded (spec.padded): a tensor of another size is
  // of another model, and padding a shorter one with zeros would load it without a word.
  DTRAIN_CHECK(spec.dim < 0 || spec.full <= 0 ||
                   (spec.dim < full.dim() && (full.size(spec.dim) == spec.full || full.size(spec.dim) == spec.padded)),
               "a tensor of shape ", full.sizes(), " does not fit a layer of ", spec.full, " along dimension ", spec.dim,
               ": it is of a model of another shape (another --vocab, --ff, --heads or --kv_heads?)");
  if (spec.dim < 0 || size == 1) {
    if (spec.dim >= 0 && spec.padded > full.size(spec.dim)) {
      std::vector<int64_t> pad_shape(full.sizes().begin(), full.sizes().end());
      pad_shape[spec.dim] = spec.padded - full.size(spec.dim);
      return at::cat({full, at::zeros(pad_shape, full.options())}, spec.dim);
    }
    return full;
  }
  at::Tensor t = full;
  if (spec.padded > full.size(spec.dim)) {
    std::vector<int64_t> pad_shape(full.sizes().begin(), full.sizes().end());
    pad_shape[spec.dim] = spec.padded - full.size(spec.dim);
    t = at::cat({full, at::zeros(pad_shape, full.options())}, spec.dim);
  }
  if (spec.parts == 1) return t.chunk(size, spec.dim)[rank].contiguous();
  std::vector<at::Tensor> mine;
  for (const at::Tensor& block : t.chunk(spec.parts, spec.dim)) mine.push_back(block.chunk(size, spec.dim)[rank]);
  return at::cat(mine, spec.dim).contiguous();
}

// ---- layers ----------------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ParallelLinearOptions o, dist::Communicator& c)
    : options(o), tp(&c) {
  const int T = c.size();
  DTRAIN_CHECK(o.in >= 1 && o.out >= 1, "ColumnParallelLinear sizes must be positive");
  DTRAIN_CHECK(!(o.pad_output && o.parts > 1), "pad_output needs parts == 1");
  padded_out = o.pad_output ? round_up(o.out, T) : o.out;
  DTRAIN_CHECK(padded_out % (o.parts * T) == 0, "column-parallel output features ", o.out,
               (o.parts > 1 ? " (" + std::to_string(o.parts) + " blocks)" : std::string()),
               " do not divide over --tp=", T, "; choose sizes divisible by the tensor-parallel size");
  DTRAIN_CHECK(!(o.gather_output && o.parts > 1), "gather_output needs parts == 1");
  weight = register_parameter("weight", at::empty({padded_out / T, o.in}));
  if (o.bias) bias = register_parameter("bias", at::empty({padded_out / T}));
  reset_parameters();
}

void ColumnParallelLinearImpl::reset_parameters() {
  // The full (unpadded) tensors are drawn on every rank, so any group size draws the same.
  at::NoGradGuard no_grad;
  auto specs = shard_specs();
  weight.copy_(shard_of(full_linear_init(options.out, options.in, options.in), specs["weight"], tp->rank(), tp->size()));
  if (options.bias) {
    at::Tensor b = full_linear_init(1, options.out, options.in).view(-1);
    bias.copy_(shard_of(b, specs["bias"], tp->rank(), tp->size()));
  }
}

std::map<std::string, ShardSpec> ColumnParallelLinearImpl::shard_specs() const {
  std::map<std::string, ShardSpec> s;
  s["weight"] = {0, options.parts, options.out, padded_out};
  if (options.bias) s["bias"] = {0, options.parts, options.out, padded_out};
  return s;
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  if (int8_) return int8_linear(x, *int8_);  // unsplit: the collectives are identities
  // Sequence-parallel: the gather's backward reduce-scatters (sums) the input gradient.
  at::Tensor in = options.sequence_parallel ? gather_from_sequence_parallel(x, *tp, 1) : copy_to_tensor_parallel(x, *tp);
  at::Tensor y = at::linear(in, weight, bias);
  return options.gather_output ? gather_from_tensor_parallel(y, *tp) : y;
}

at::Tensor ColumnParallelLinearImpl::forward_without_bias(const at::Tensor& x) {
  DTRAIN_CHECK(!int8_ && !options.gather_output, "ColumnParallelLinear::forward_without_bias serves a float layer "
               "whose output stays split (no int8, no gather_output)");
  at::Tensor in = options.sequence_parallel ? gather_from_sequence_parallel(x, *tp, 1) : copy_to_tensor_parallel(x, *tp);
  return at::linear(in, weight);
}

bool ColumnParallelLinearImpl::serves_without_bias() const { return !int8_ && !options.gather_output && bias.defined(); }

namespace {
void check_unsplit(const dist::Communicator& tp, const char* layer) {
  DTRAIN_CHECK(tp.size() == 1, "int8 quantization of a ", layer, " split over --tp=", tp.size(), " is not supported: "
               "load the checkpoint into one process (tensor-parallel checkpoints are gathered on load) and quantize "
               "it there");
}
}  // namespace

void ColumnParallelLinearImpl::check_quantizable() const { check_unsplit(*tp, "column-parallel Linear"); }
void RowParallelLinearImpl::check_quantizable() const { check_unsplit(*tp, "row-parallel Linear"); }

RowParallelLinearImpl::RowParallelLinearImpl(ParallelLinearOptions o, dist::Communicator& c)
    : options(o), tp(&c) {
  const int T = c.size();
  DTRAIN_CHECK(o.in >= 1 && o.out >= 1, "RowParallelLinear sizes must be positive");
  DTRAIN_CHECK(o.in % T == 0, "row-parallel input features ", o.in, " do not divide over --tp=", T,
               "; choose sizes divisible by the tensor-parallel size");
  weight = register_parameter("weight", at::empty({o.out, o.in / T}));
  if (o.bias) bias = register_parameter("bias", at::empty({o.out}));
  reset_parameters();
}

void RowParallelLinearImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  auto specs = shard_specs();
  weight.copy_(shard_of(full_linear_init(options.out, options.in, options.in), specs["weight"], tp->rank(), tp->size()));
  if (options.bias) bias.copy_(full_linear_init(1, options.out, options.in).view(-1));
}

std::map<std::string, ShardSpec> RowParallelLinearImpl::shard_specs() const {
  std::map<std::string, ShardSpec> s;
  s["weight"] = {1, 1, options.in, options.in};
  if (options.bias) s["bias"] = {-1, 1, options.out, options.out};
  return s;
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x_parallel) {
  if (int8_) return int8_linear(x_parallel, *int8_);  // unsplit: the bias is packed with the weight
  at::Tensor partial = at::linear(x_parallel, weight);
  if (!options.sequence_parallel) {
    at::Tensor y = reduce_from_tensor_parallel(partial, *tp);
    return options.bias ? y + bias : y;
  }
  at::Tensor y = reduce_scatter_to_sequence_parallel(partial, *tp, 1);
  // The bias meets only this rank's part of the sequence: sum its gradient over the group.
  return options.bias ? y + copy_to_tensor_parallel(bias, *tp) : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t v, int64_t d, dist::Communicator& c,
                                                       SequenceParallel sp)
    : vocab(v), dim(d), sequence_parallel(sp == SequenceParallel::kOn), tp(&c) {
  DTRAIN_CHECK(v >= 1 && d >= 1, "embedding sizes must be positive");
  padded_vocab = round_up(v, c.size());
  const int64_t local = padded_vocab / c.size();
  start = local * c.rank();
  end = start + local;
  weight = register_parameter("weight", at::empty({local, d}));
  at::NoGradGuard no_grad;
  at::Tensor full = at::empty({v, d}).normal_(0, 1);  // torch.nn.Embedding's init
  weight.copy_(shard_of(full, shard_specs()["weight"], c.rank(), c.size()));
}

std::map<std::string, ShardSpec> VocabParallelEmbeddingImpl::shard_specs() const {
  return {{"weight", ShardSpec{0, 1, vocab, padded_vocab}}};
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (tp->size() == 1) return at::embedding(weight, ids, -1, false, sparse);
  if (sequence_parallel) {
    DTRAIN_CHECK(ids.dim() >= 2, "a sequence-parallel embedding takes ids [B, S, ...], got ", ids.sizes());
    DTRAIN_CHECK(ids.size(1) % tp->size() == 0, "sequence parallelism: a sequence of ", ids.size(1),
                 " tokens does not split over ", tp->size(),
                 " tensor-parallel ranks; --seq_len must be a multiple of --tp");
  }
  at::Tensor outside = (ids < start) | (ids >= end);
  at::Tensor local = (ids - start).masked_fill(outside, 0);
  at::Tensor out = at::embedding(weight, local, -1, false, sparse).masked_fill(outside.unsqueeze(-1), 0);
  return sequence_parallel ? reduce_scatter_to_sequence_parallel(out, *tp, 1) : reduce_from_tensor_parallel(out, *tp);
}

at::Tensor composed_vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                                 int64_t vocab_start, int64_t real_vocab,
                                                 dist::Communicator& tp) {
  check_cross_entropy_shapes(logits, targets);
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_start, real_vocab, comm_handle(&tp));
}

// CUDA logits of bfloat16, float16 or float32 take the fused kernels (cross_entropy.h); the
// CPU, float64 and other layouts ATen's composition.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab_start, int64_t real_vocab,
                                        dist::Communicator& tp) {
  check_cross_entropy_shapes(logits, targets);
  if (fused_cross_entropy_available(logits)) {
    return fused_vocab_parallel_cross_entropy(logits, targets, vocab_start, real_vocab, tp);
  }
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_start, real_vocab, comm_handle(&tp));
}

ParallelSelfAttentionImpl::ParallelSelfAttentionImpl(int64_t d_model, int64_t h, bool is_causal,
                                                     dist::Communicator& tp, SequenceParallel sp,
                                                     dist::Communicator* context)
    : heads(h), causal(is_causal), cp(context != nullptr && context->size() > 1 ? context : nullptr) {
  DTRAIN_CHECK(h >= 1 && d_model % h == 0, "--d_model=", d_model, " is not divisible by --heads=", h);
  DTRAIN_CHECK(h % tp.size() == 0, "--heads=", h, " does not divide over --tp=", tp.size(),
               "; the number of heads must be a multiple of the tensor-parallel size");
  local_heads = h / tp.size();
  head_dim = d_model / h;
  const bool seq = sp == SequenceParallel::kOn;
  ParallelLinearOptions qkv_options(d_model, 3 * d_model), proj_options(d_model, d_model);
  qkv_options.parts = 3;  // q, k and v blocks, each split by heads
  qkv_options.sequence_parallel = proj_options.sequence_parallel = seq;
  qkv = register_module("qkv", ColumnParallelLinear(qkv_options, tp));
  proj = register_module("proj", RowParallelLinear(proj_options, tp));
}

at::Tensor ParallelSelfAttentionImpl::forward(const at::Tensor& x) {
  at::Tensor fused = qkv->forward(x);  // the whole sequence, also when x is a sequence-parallel part
  const int64_t T = fused.size(1);
  auto parts = fused.chunk(3, -1);  // each [B, T, local_heads * head_dim]
  // The batch dimension as -1: a TorchScript trace of the model (dtrain-export) then accepts
  // any batch size (sizes read as integers are recorded as constants).
  auto heads_first = [&](const at::Tensor& t) { return t.view({-1, T, local_heads, head_dim}).transpose(1, 2); };
  at::Tensor a = cp ? ring_attention(heads_first(parts[0]), heads_first(parts[1]), heads_first(parts[2]), causal, *cp)
                   : at::scaled_dot_product_attention(heads_first(parts[0]), heads_first(parts[1]),
                                                      heads_first(parts[2]), {}, 0.0, causal);
  return proj->forward(a.transpose(1, 2).reshape({-1, T, local_heads * head_dim}));
}

at::Tensor ParallelSelfAttentionImpl::forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache,
                                                     const CachedStep& step) {
  DTRAIN_CHECK(causal && cp == nullptr && !qkv->options.sequence_parallel, "forward_cached: incremental decoding "
               "needs a causal attention that is neither sequence- nor context-parallel");
  const int64_t B = x.size(0), T = x.size(1);
  auto parts = qkv->forward(x).chunk(3, -1);  // each [B, T, local_heads * head_dim]
  auto heads_first = [&](const at::Tensor& t) { return t.view({B, T, local_heads, head_dim}).transpose(1, 2); };
  at::Tensor a = cached_causal_attention(heads_first(parts[0]), heads_first(parts[1]), heads_first(parts[2]), k_cache,
                                         v_cache, step);
  return proj->forward(a.transpose(1, 2).reshape({B, T, local_heads * head_dim}));
}

at::Tensor cached_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                   at::Tensor& v_cache, const CachedStep& step, std::optional<double> scale) {
  const int64_t start = step.start, T = q.size(2), end = start + T;
  k_cache.narrow(2, start, T).copy_(k);
  v_cache.narrow(2, start, T).copy_(v);
  // From position 0 the new tokens attend causally; after cached positions each new query sees
  // every cached position and the new ones up to its own (one new token: all of them).
  std::optional<at::Tensor> mask;
  if (step.mask.defined()) {
    mask = step.mask;  // left padding: [B, 1, T, end]
  } else if (start > 0 && T > 1) {
    const auto positions = at::TensorOptions().dtype(at::kLong).device(q.device());
    mask = at::arange(end, positions).unsqueeze(0) <= at::arange(start, end, positions).unsqueeze(1);  // [T, end]
  }
  return at::scaled_dot_product_attention(q, k_cache.narrow(2, 0, end), v_cache.narrow(2, 0, end), mask, 0.0,
                                          /*is_causal=*/!step.mask.defined() && start == 0 && T > 1, scale,
                                          /*enable_gqa=*/k.size(1) != q.size(1));
}

void apply_sdpa_backends(const std::string& list) {
  bool flash = false, fa3 = false, efficient = false, cudnn = false, math = false;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, end - start);
    start = end + 1;
    if (name.empty()) continue;
    bool* slot = name == "flash" ? &flash : name == "fa3" ? &fa3 : name == "efficient" ? &efficient
               : name == "cudnn" ? &cudnn : name == "math" ? &math : nullptr;
    DTRAIN_CHECK(slot != nullptr, "scaled_dot_product_attention backend '", name, "' is unknown; name some of flash, "
                 "fa3, efficient, cudnn and math, comma-separated (DTRAIN_SDPA_BACKENDS)");
    *slot = true;
  }
  DTRAIN_CHECK(flash || fa3 || efficient || cudnn || math, "no scaled_dot_product_attention backend named in '", list,
               "'; name some of flash, fa3, efficient, cudnn and math (DTRAIN_SDPA_BACKENDS)");
  auto& ctx = at::globalContext();
  ctx.setSDPUseFlash(flash);
  ctx.setSDPUseFA3(fa3);
  ctx.setSDPUseMemEfficient(efficient);
  ctx.setSDPUseCuDNN(cudnn);
  ctx.setSDPUseMath(math);
}

void sdpa_backends_from_env() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("DTRAIN_SDPA_BACKENDS");
    if (v != nullptr && *v != '\0') apply_sdpa_backends(v);
  });
}

ParallelMlpImpl::ParallelMlpImpl(int64_t d_model, int64_t hidden, dist::Communicator& tp, SequenceParallel sp) {
  const bool seq = sp == SequenceParallel::kOn;
  DTRAIN_CHECK(hidden % tp.size() == 0, "--ff=", hidden, " does not divide over --tp=", tp.size(),
               "; the feed-forward width must be a multiple of the tensor-parallel size");
  ParallelLinearOptions fc1_options(d_model, hidden), fc2_options(hidden, d_model);
  fc1_options.sequence_parallel = fc2_options.sequence_parallel = seq;
  fc1 = register_module("fc1", ColumnParallelLinear(fc1_options, tp));
  fc2 = register_module("fc2", RowParallelLinear(fc2_options, tp));
}

at::Tensor ParallelMlpImpl::forward(const at::Tensor& x) {
  // On CUDA the bias joins the GELU in one kernel (fused_block_ops.h); elsewhere ATen's
  // composition, exactly as before.
  if (fused_block_kernels_serve(x) && fc1->serves_without_bias()) {
    return fc2->forward(bias_gelu(fc1->forward_without_bias(x), fc1->bias));
  }
  return fc2->forward(at::gelu(fc1->forward(x), "tanh"));
}

// ---- whole models ----------------------------------------------------------------------

std::map<std::string, ShardSpec> collect_shard_specs(torch::nn::Module& model) {
  std::map<std::string, ShardSpec> out;
  auto add = [&](const std::string& prefix, torch::nn::Module* m) {
    auto* tpm = dynamic_cast<TensorParallelModule*>(m);
    if (!tpm) return;
    for (auto& [local, spec] : tpm->shard_specs()) {
      if (spec.dim >= 0) out[prefix.empty() ? local : prefix + "." + local] = spec;
    }
  };
  add("", &model);  // the model itself need not live in a shared_ptr
  for (auto& item : model.named_modules("", /*include_self=*/false)) add(item.key(), item.value().get());
  return out;
}

void load_full_state(torch::nn::Module& split_model, const std::map<std::string, at::Tensor>& full,
                     dist::Communicator& tp) {
  auto specs = collect_shard_specs(split_model);
  at::NoGradGuard no_grad;
  for (auto& item : split_model.named_parameters()) {
    auto it = full.find(item.key());
    DTRAIN_CHECK(it != full.end(), "the full state has no parameter '", item.key(), "'");
    auto spec = specs.find(item.key());
    at::Tensor src = spec == specs.end() ? it->second : shard_of(it->second, spec->second, tp.rank(), tp.size());
    DTRAIN_CHECK(src.sizes() == item.value().sizes(), "parameter '", item.key(), "': the full tensor ",
                 it->second.sizes(), " does not fit this rank's shard ", item.value().sizes());
    item.value().copy_(src);
  }
}

at::Tensor join_shards(const std::vector<at::Tensor>& pieces, const ShardSpec& s) {
  DTRAIN_CHECK(!pieces.empty(), "join_shards: no shards");
  for (const at::Tensor& p : pieces) {
    DTRAIN_CHECK(p.sizes() == pieces.front().sizes(), "join_shards: shards of shapes ", pieces.front().sizes(), " and ",
                 p.sizes(), "; every rank's shard has the same shape");
  }
  if (s.dim < 0) return pieces.front().clone();
  at::Tensor full;
  if (s.parts == 1) {
    full = at::cat(pieces, s.dim);
  } else {
    std::vector<at::Tensor> blocks;
    for (int j = 0; j < s.parts; ++j) {
      std::vector<at::Tensor> block_parts;
      for (const at::Tensor& p : pieces) block_parts.push_back(p.chunk(s.parts, s.dim)[j]);
      blocks.push_back(at::cat(block_parts, s.dim));
    }
    full = at::cat(blocks, s.dim);
  }
  return full.narrow(s.dim, 0, std::min<int64_t>(s.full, full.size(s.dim))).contiguous();
}

std::string to_text(const ShardSpec& s) {
  return std::to_string(s.dim) + ":" + std::to_string(s.parts) + ":" + std::to_string(s.full) + ":" +
         std::to_string(s.padded);
}

ShardSpec shard_spec_from_text(const std::string& text, const std::string& source) {
  ShardSpec s;
  char c1 = 0, c2 = 0, c3 = 0;
  std::istringstream in(text);
  DTRAIN_CHECK((in >> s.dim >> c1 >> s.parts >> c2 >> s.full >> c3 >> s.padded) && c1 == ':' && c2 == ':' &&
                   c3 == ':' && s.parts >= 1,
               source, ": malformed tensor-parallel split '", text, "' (dim:parts:full:padded)");
  return s;
}

at::Tensor gather_full_tensor(const at::Tensor& local_in, const ShardSpec& s, dist::Communicator& tp) {
  at::Tensor local = local_in.detach().contiguous();
  const int T = tp.size();
  if (s.dim < 0) return local.clone();
  if (T == 1) return local.narrow(s.dim, 0, std::min<int64_t>(s.full, local.size(s.dim))).clone();
  at::Tensor all = at::empty({T * local.numel()}, local.options());
  tp.all_gather(local.view(-1), all)->wait();
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& c : all.chunk(T)) pieces.push_back(c.view(local.sizes()));
  return join_shards(pieces, s);
}

std::map<std::string, at::Tensor> gather_full_state(torch::nn::Module& split_model, dist::Communicator& tp) {
  auto specs = collect_shard_specs(split_model);
  std::map<std::string, at::Tensor> out;
  for (auto& item : split_model.named_parameters()) {
    auto spec = specs.find(item.key());
    out[item.key()] = spec == specs.end() ? item.value().detach().cpu().clone()
                                          : gather_full_tensor(item.value(), spec->second, tp).cpu();
  }
  return out;
}

}  // namespace dtrain::engine
