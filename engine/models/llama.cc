#include "dtrain/engine/models/llama.h"

#include <cmath>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/fused_block_ops.h"

#include "decoder_lm.h"

namespace dtrain::engine {
namespace {

using nlohmann::json;

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// ---- config.json -------------------------------------------------------------------------

// The field's value, or null when it is absent or JSON null.
const json* field(const json& j, const std::string& name) {
  auto it = j.find(name);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::string shown(const json& v) { return v.dump(); }

int64_t integer_field(const json& j, const std::string& name, const std::string& path,
                      std::optional<int64_t> fallback) {
  const json* v = field(j, name);
  DTRAIN_CHECK(v || fallback, "config.json: '", path, "' is missing");
  if (!v) return *fallback;
  double value = 0;
  if (v->is_number_integer() || v->is_number_unsigned()) {
    value = static_cast<double>(v->get<int64_t>());
  } else {
    DTRAIN_CHECK(v->is_number_float() && std::floor(v->get<double>()) == v->get<double>(), "config.json: '", path,
                 "' must be an integer, got ", shown(*v));
    value = v->get<double>();
  }
  DTRAIN_CHECK(value >= 1, "config.json: '", path, "' must be positive, got ", shown(*v));
  return static_cast<int64_t>(value);
}

double number_field(const json& j, const std::string& name, const std::string& path, std::optional<double> fallback) {
  const json* v = field(j, name);
  DTRAIN_CHECK(v || fallback, "config.json: '", path, "' is missing");
  if (!v) return *fallback;
  DTRAIN_CHECK(v->is_number(), "config.json: '", path, "' must be a number, got ", shown(*v));
  const double value = v->get<double>();
  DTRAIN_CHECK(std::isfinite(value), "config.json: '", path, "' must be finite, got ", shown(*v));
  return value;
}

bool bool_field(const json& j, const std::string& name, bool fallback) {
  const json* v = field(j, name);
  if (!v) return fallback;
  DTRAIN_CHECK(v->is_boolean(), "config.json: '", name, "' must be true or false, got ", shown(*v));
  return v->get<bool>();
}

std::string string_field(const json& j, const std::string& name, const std::string& path) {
  const json* v = field(j, name);
  if (!v) return "";
  DTRAIN_CHECK(v->is_string(), "config.json: '", path, "' must be a string, got ", shown(*v));
  return v->get<std::string>();
}

// The features this model does not have, refused by name.
void check_supported(const json& j) {
  const std::string type = string_field(j, "model_type", "model_type");
  DTRAIN_CHECK(type.empty() || type == "llama" || type == "mistral", "config.json: 'model_type' is \"", type,
               "\"; the Llama model reads llama and mistral configs only");
  DTRAIN_CHECK(!bool_field(j, "attention_bias", false),
               "config.json: 'attention_bias' is true; the Llama model has no attention biases");
  DTRAIN_CHECK(!bool_field(j, "mlp_bias", false), "config.json: 'mlp_bias' is true; the Llama model has no MLP biases");
  const std::string act = string_field(j, "hidden_act", "hidden_act");
  DTRAIN_CHECK(act.empty() || act == "silu" || act == "swish", "config.json: 'hidden_act' is \"", act,
               "\"; the Llama model's MLP is SwiGLU (silu)");
}

// rope_theta and the rope scaling: transformers 4's rope_theta and rope_scaling, or 5's
// rope_parameters (which hold both).
void read_rope(const json& j, LlamaOptions& o) {
  const json* params = field(j, "rope_parameters");
  DTRAIN_CHECK(!params || params->is_object(), "config.json: 'rope_parameters' must be an object, got ", shown(*params));
  o.rope_theta = number_field(j, "rope_theta", "rope_theta", 10000.0);
  if (!field(j, "rope_theta") && params) o.rope_theta = number_field(*params, "rope_theta", "rope_parameters.rope_theta", 10000.0);
  DTRAIN_CHECK(o.rope_theta > 0, "config.json: 'rope_theta' must be positive, got ", o.rope_theta);
  std::string name = "rope_scaling";
  const json* scaling = field(j, name);
  if (!scaling && params) {
    scaling = params;
    name = "rope_parameters";
  }
  if (!scaling) return;
  DTRAIN_CHECK(scaling->is_object(), "config.json: '", name, "' must be an object, got ", shown(*scaling));
  std::string type = string_field(*scaling, "rope_type", name + ".rope_type");
  if (type.empty()) type = string_field(*scaling, "type", name + ".type");
  if (type.empty() || type == "default") return;
  DTRAIN_CHECK(type == "llama3", "config.json: '", name, ".rope_type' is \"", type,
               "\"; the Llama model supports llama3 rope scaling (or none) only");
  o.rope_factor = number_field(*scaling, "factor", name + ".factor", std::nullopt);
  o.rope_low_freq_factor = number_field(*scaling, "low_freq_factor", name + ".low_freq_factor", std::nullopt);
  o.rope_high_freq_factor = number_field(*scaling, "high_freq_factor", name + ".high_freq_factor", std::nullopt);
  o.rope_original_positions = integer_field(*scaling, "original_max_position_embeddings",
                                            name + ".original_max_position_embeddings", std::nullopt);
  DTRAIN_CHECK(o.rope_factor > 0, "config.json: '", name, ".factor' must be positive, got ", o.rope_factor);
  DTRAIN_CHECK(o.rope_low_freq_factor > 0 && o.rope_high_freq_factor > o.rope_low_freq_factor, "config.json: '", name,
               ".low_freq_factor' (", o.rope_low_freq_factor, ") must be positive and below '", name,
               ".high_freq_factor' (", o.rope_high_freq_factor, ")");
}

// ---- checks and pieces --------------------------------------------------------------------

LlamaOptions resolved(LlamaOptions o) {
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  return o;
}

void check_options(const LlamaOptions& o, const dist::Communicator& tp) {
  DTRAIN_CHECK(o.vocab >= 1 && o.d_model >= 1 && o.ff >= 1 && o.seq_len >= 1 && o.layers >= 0,
               "Llama sizes must be positive (vocab ", o.vocab, ", d_model ", o.d_model, ", ff ", o.ff, ", seq_len ",
               o.seq_len, ", layers ", o.layers, ")");
  DTRAIN_CHECK(o.heads >= 1 && o.d_model % o.heads == 0, "--d_model=", o.d_model, " is not divisible by --heads=",
               o.heads);
  DTRAIN_CHECK((o.d_model / o.heads) % 2 == 0, "the head size d_model/heads = ", o.d_model / o.heads,
               " must be even for rotary position embeddings");
  DTRAIN_CHECK(o.kv_heads >= 1 && o.heads % o.kv_heads == 0, "--heads=", o.heads, " is not a multiple of --kv_heads=",
               o.kv_heads, " (each key/value head serves heads/kv_heads query heads; train_gpt --model=llama's default "
               "--kv_heads is 4): give a --kv_heads that divides --heads (--kv_heads=--heads: plain multi-head "
               "attention)");
  const int T = tp.size();
  DTRAIN_CHECK(o.heads % T == 0 && o.kv_heads % T == 0, "--heads=", o.heads, " and --kv_heads=", o.kv_heads,
               " must both divide over --tp=", T, ": tensor parallelism splits the query and the key/value heads; "
               "choose a --tp dividing the key/value head count ", o.kv_heads);
  DTRAIN_CHECK(o.ff % T == 0, "--ff=", o.ff, " does not divide over --tp=", T,
               "; the feed-forward width must be a multiple of the tensor-parallel size");
  DTRAIN_CHECK(!o.sequence_parallel || o.seq_len % T == 0, "sequence parallelism: --seq_len=", o.seq_len,
               " is not a multiple of --tp=", T);
  DTRAIN_CHECK(o.rope_theta > 0, "rope_theta must be positive, got ", o.rope_theta);
  DTRAIN_CHECK(o.rope_factor <= 0 || (o.rope_low_freq_factor > 0 && o.rope_high_freq_factor > o.rope_low_freq_factor &&
                                      o.rope_original_positions >= 1),
               "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and original positions >= 1");
}

ParallelLinearOptions linear_options(int64_t in, int64_t out, const LlamaOptions& o) {
  ParallelLinearOptions l(in, out);
  l.bias = false;
  l.sequence_parallel = o.sequence_parallel;
  return l;
}

// transformers' inverse frequencies, op for op in float32 (so the tables agree bit for bit):
// 1 / theta^(2i/dim), then Llama 3.1's smoothing between the scaled low and the kept high
// frequencies (_compute_llama3_parameters; Python's `a / t` is t.reciprocal() * a).
at::Tensor llama_inv_freq(const LlamaOptions& o) {
  const int64_t dim = o.d_model / o.heads;
  at::Tensor exponent = at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
  at::Tensor inv = at::reciprocal(at::pow(at::Scalar(o.rope_theta), exponent)) * 1.0;
  if (o.rope_factor <= 0) return inv;
  const double factor = o.rope_factor, low = o.rope_low_freq_factor, high = o.rope_high_freq_factor;
  const int64_t old = o.rope_original_positions;
  const double low_wavelen = static_cast<double>(old) / low, high_wavelen = static_cast<double>(old) / high;
  at::Tensor wavelen = at::reciprocal(inv) * (2 * M_PI);
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / factor, inv);
  at::Tensor smooth = (at::reciprocal(wavelen) * old - low) / (high - low);
  at::Tensor smoothed = at::rsub(smooth, 1) * scaled / factor + smooth * scaled;
  at::Tensor medium = at::logical_not(wavelen < high_wavelen) * at::logical_not(wavelen > low_wavelen);
  return at::where(medium, smoothed, scaled);
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

SequenceParallel sp_of(const LlamaOptions& o) {
  return o.sequence_parallel ? SequenceParallel::kOn : SequenceParallel::kOff;
}

}  // namespace

LlamaOptions llama_options_from_hf_config(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    DTRAIN_CHECK(false, "config.json is not valid JSON: ", e.what());
  }
  DTRAIN_CHECK(j.is_object(), "config.json must hold a JSON object");
  check_supported(j);
  LlamaOptions o;
  o.vocab = integer_field(j, "vocab_size", "vocab_size", std::nullopt);
  o.d_model = integer_field(j, "hidden_size", "hidden_size", std::nullopt);
  o.heads = integer_field(j, "num_attention_heads", "num_attention_heads", std::nullopt);
  o.kv_heads = integer_field(j, "num_key_value_heads", "num_key_value_heads", o.heads);
  o.ff = integer_field(j, "intermediate_size", "intermediate_size", std::nullopt);
  o.layers = static_cast<int>(integer_field(j, "num_hidden_layers", "num_hidden_layers", std::nullopt));
  o.seq_len = integer_field(j, "max_position_embeddings", "max_position_embeddings", 2048);
  o.norm_eps = number_field(j, "rms_norm_eps", "rms_norm_eps", 1e-6);
  DTRAIN_CHECK(o.norm_eps > 0, "config.json: 'rms_norm_eps' must be positive, got ", o.norm_eps);
  o.init_std = number_field(j, "initializer_range", "initializer_range", 0.02);
  o.tie_embeddings = bool_field(j, "tie_word_embeddings", false);
  DTRAIN_CHECK(o.d_model % o.heads == 0, "config.json: 'hidden_size' (", o.d_model,
               ") is not divisible by 'num_attention_heads' (", o.heads, ")");
  DTRAIN_CHECK(o.heads % o.kv_heads == 0, "config.json: 'num_key_value_heads' (", o.kv_heads,
               ") must divide 'num_attention_heads' (", o.heads, ")");
  if (field(j, "head_dim")) {
    const int64_t head_dim = integer_field(j, "head_dim", "head_dim", std::nullopt);
    DTRAIN_CHECK(head_dim == o.d_model / o.heads, "config.json: 'head_dim' (", head_dim,
                 ") is not hidden_size / num_attention_heads (", o.d_model / o.heads,
                 "); the Llama model's heads split the hidden size");
  }
  if (field(j, "sliding_window")) {
    const int64_t window = integer_field(j, "sliding_window", "sliding_window", std::nullopt);
    DTRAIN_CHECK(window >= o.seq_len, "config.json: 'sliding_window' (", window,
                 ") is shorter than 'max_position_embeddings' (", o.seq_len,
                 "); the Llama model's attention is fully causal");
  }
  read_rope(j, o);
  return o;
}

std::pair<at::Tensor, at::Tensor> llama_rope_tables(const LlamaOptions& o, int64_t positions) {
  // transformers: position_ids[..., None].float() * inv_freq, cat((freqs, freqs)), cos, sin.
  at::Tensor pos = at::arange(positions, at::TensorOptions().dtype(at::kLong)).to(at::kFloat);
  at::Tensor freqs = pos.unsqueeze(1) * llama_inv_freq(resolved(o));
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

LlamaRope::LlamaRope(const LlamaOptions& o) : options_(resolved(o)) {}

std::pair<at::Tensor, at::Tensor> LlamaRope::tables(int64_t S, c10::Device device, at::ScalarType dtype) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Entry& e : cache_) {
    if (e.S == S && e.device == device && e.dtype == dtype) return {e.cos, e.sin};
  }
  auto [cos, sin] = llama_rope_tables(options_, S);
  if (cache_.size() >= 8) cache_.erase(cache_.begin());
  cache_.push_back(Entry{S, device, dtype, cos.to(device, dtype), sin.to(device, dtype)});
  return {cache_.back().cos, cache_.back().sin};
}

// ---- layers ------------------------------------------------------------------------------

LlamaRmsNormImpl::LlamaRmsNormImpl(int64_t dim, double e, dist::Communicator& comm, bool sp)
    : eps(e), sequence_parallel(sp), tp(&comm) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor LlamaRmsNormImpl::forward(const at::Tensor& x) {
  // transformers' LlamaRMSNorm, op for op: float32, then the input's dtype, then the weight.
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  // Sequence-parallel: this rank saw part of the sequence; sum the weight's gradient.
  at::Tensor w = sequence_parallel ? copy_to_tensor_parallel(weight, *tp) : weight;
  return w * h.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaOptions& opts, dist::Communicator& comm,
                                       std::shared_ptr<LlamaRope> tables, dist::Communicator* context)
    : cp(decoder_lm::active_cp(context)), rope(std::move(tables)) {
  const LlamaOptions r = resolved(opts);
  check_options(r, comm);
  head_dim = r.d_model / r.heads;
  local_heads = r.heads / comm.size();
  local_kv_heads = r.kv_heads / comm.size();
  q = register_module("q", ColumnParallelLinear(linear_options(r.d_model, r.heads * head_dim, r), comm));
  k = register_module("k", ColumnParallelLinear(linear_options(r.d_model, r.kv_heads * head_dim, r), comm));
  v = register_module("v", ColumnParallelLinear(linear_options(r.d_model, r.kv_heads * head_dim, r), comm));
  o = register_module("o", RowParallelLinear(linear_options(r.heads * head_dim, r.d_model, r), comm));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x) {
  // Each projection sees the whole sequence (sequence-parallel: gathered), so the rotary
  // positions are 0..S-1 of the whole sequence on every rank.
  at::Tensor qs = q->forward(x);
  const int64_t S = qs.size(1);
  // The batch dimension as -1: a trace of the model accepts any batch size.
  auto heads_first = [&](const at::Tensor& t, int64_t n) { return t.view({-1, S, n, head_dim}).transpose(1, 2); };
  at::Tensor qh = heads_first(qs, local_heads);
  at::Tensor kh = heads_first(k->forward(x), local_kv_heads);
  at::Tensor vh = heads_first(v->forward(x), local_kv_heads);
  // Context-parallel: S is this rank's part; its rows of the whole sequence's tables.
  auto [cos, sin] = rope->tables(cp ? S * cp->size() : S, x.device(), x.scalar_type());  // the residual stream's dtype, as transformers
  if (cp) {
    const at::Tensor rows = cp_positions(S * cp->size(), cp->rank(), cp->size(),
                                         at::TensorOptions().dtype(at::kLong).device(x.device()));
    cos = cos.index_select(0, rows);
    sin = sin.index_select(0, rows);
  }
  qh = qh * cos + rotate_half(qh) * sin;
  kh = kh * cos + rotate_half(kh) * sin;
  const double scale = std::pow(static_cast<double>(head_dim), -0.5);
  at::Tensor a;
  if (cp) {
    // Ring attention takes as many key/value heads as query heads: query head h reads key/value
    // head h / (local_heads / local_kv_heads), as enable_gqa does.
    const int64_t group = local_heads / local_kv_heads;
    if (group > 1) {
      kh = kh.repeat_interleave(group, 1);
      vh = vh.repeat_interleave(group, 1);
    }
    a = ring_attention(qh, kh, vh, /*causal=*/true, *cp, scale);
  } else {
    a = at::scaled_dot_product_attention(qh, kh, vh, {}, 0.0, /*is_causal=*/true, scale,
                                         /*enable_gqa=*/local_heads != local_kv_heads);
  }
  return o->forward(a.transpose(1, 2).reshape({-1, S, local_heads * head_dim}));
}

at::Tensor LlamaAttentionImpl::forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache,
                                              const CachedStep& step) {
  const int64_t B = x.size(0), T = x.size(1);
  auto heads_first = [&](const at::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
  at::Tensor qh = heads_first(q->forward(x), local_heads);
  at::Tensor kh = heads_first(k->forward(x), local_kv_heads);
  at::Tensor vh = heads_first(v->forward(x), local_kv_heads);
  // The tables of the cache's length, the new positions' rows: a sequence as long as the cache
  // gets the rows forward() uses for it, bit for bit.
  auto [cos_all, sin_all] = rope->tables(k_cache.size(2), x.device(), x.scalar_type());
  at::Tensor cos, sin;
  if (step.positions.defined()) {  // left padding: each row's own positions, [B, 1, T, head_dim]
    cos = cos_all.index_select(0, step.positions.reshape({-1})).view({B, 1, T, head_dim});
    sin = sin_all.index_select(0, step.positions.reshape({-1})).view({B, 1, T, head_dim});
  } else {
    cos = cos_all.narrow(0, step.start, T);
    sin = sin_all.narrow(0, step.start, T);
  }
  qh = qh * cos + rotate_half(qh) * sin;
  kh = kh * cos + rotate_half(kh) * sin;
  const double scale = std::pow(static_cast<double>(head_dim), -0.5);
  at::Tensor a = cached_causal_attention(qh, kh, vh, k_cache, v_cache, step, scale);
  return o->forward(a.transpose(1, 2).reshape({B, T, local_heads * head_dim}));
}

LlamaMlpImpl::LlamaMlpImpl(const LlamaOptions& o, dist::Communicator& comm) {
  gate = register_module("gate", ColumnParallelLinear(linear_options(o.d_model, o.ff, o), comm));
  up = register_module("up", ColumnParallelLinear(linear_options(o.d_model, o.ff, o), comm));
  down = register_module("down", RowParallelLinear(linear_options(o.ff, o.d_model, o), comm));
}

at::Tensor LlamaMlpImpl::forward(const at::Tensor& x) {
  // On CUDA silu(gate) * up is one kernel (fused_block_ops.h); elsewhere ATen's two ops.
  if (fused_block_kernels_serve(x)) return down->forward(swiglu(gate->forward(x), up->forward(x)));
  return down->forward(at::silu(gate->forward(x)) * up->forward(x));
}

LlamaBlockImpl::LlamaBlockImpl(const LlamaOptions& o, dist::Communicator& comm, std::shared_ptr<LlamaRope> rope,
                               dist::Communicator* cp) {
  attn_norm = register_module("attn_norm", LlamaRmsNorm(o.d_model, o.norm_eps, comm, o.sequence_parallel));
  attn = register_module("attn", LlamaAttention(o, comm, std::move(rope), cp));
  mlp_norm = register_module("mlp_norm", LlamaRmsNorm(o.d_model, o.norm_eps, comm, o.sequence_parallel));
  mlp = register_module("mlp", LlamaMlp(o, comm));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x) {
  if (!attn_norm->sequence_parallel && fused_block_kernels_serve(x)) {
    // CUDA: each RMSNorm in one kernel, the second with the residual add (fused_block_ops.h),
    // the norms' outputs in autocast's dtype for the Linears they feed; elsewhere as below.
    const at::Tensor n1 = add_rms_norm(x, at::Tensor(), attn_norm->weight, attn_norm->eps).normed;
    const AddLayerNorm r = add_rms_norm(x, attn->forward(n1), mlp_norm->weight, mlp_norm->eps);
    return r.sum + mlp->forward(r.normed);
  }
  at::Tensor h = x + attn->forward(attn_norm->forward(x));
  return h + mlp->forward(mlp_norm->forward(h));
}

at::Tensor LlamaBlockImpl::forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache,
                                          const CachedStep& step) {
  at::Tensor h = x + attn->forward_cached(attn_norm->forward(x), k_cache, v_cache, step);
  return h + mlp->forward(mlp_norm->forward(h));
}

// ---- the model ---------------------------------------------------------------------------

LlamaImpl::LlamaImpl(const LlamaOptions& o, dist::Communicator& comm, dist::Communicator* context)
    : options(resolved(o)), tp(&comm), cp(decoder_lm::active_cp(context)) {
  const LlamaOptions& r = options;
  check_options(r, comm);
  decoder_lm::check_context_parallel(r.seq_len, cp, r.sequence_parallel && comm.size() > 1, comm);
  rope = std::make_shared<LlamaRope>(r);
  embed_tokens = register_module("embed", VocabParallelEmbedding(r.vocab, r.d_model, comm, sp_of(r)));
  blocks = register_module("blocks", BlockStack());
  for (int i = 0; i < r.layers; ++i) blocks->push_back(LlamaBlock(r, comm, rope, cp));
  norm = register_module("norm", LlamaRmsNorm(r.d_model, r.norm_eps, comm, r.sequence_parallel));
  if (r.tie_embeddings) {
    tied_head = register_module("head", TiedVocabHead(embed_tokens, comm, r.sequence_parallel));
  } else {
    ParallelLinearOptions h = linear_options(r.d_model, r.vocab, r);
    h.pad_output = true;  // sequence-parallel: gathers the sequence first
    head = register_module("head", ColumnParallelLinear(h, comm));
  }
  reset_parameters();
}

void LlamaImpl::reset_parameters() {
  if (options.init_std <= 0) return;
  at::NoGradGuard no_grad;
  const auto specs = collect_shard_specs(*this);
  std::set<const c10::TensorImpl*> seen;  // a tied weight once
  for (auto& item : named_parameters()) {
    at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (ends_with(item.key(), "norm.weight")) {
      p.fill_(1);
      continue;
    }
    // The full tensor is drawn on every rank, in the same order: any group size draws the same.
    auto spec = specs.find(item.key());
    std::vector<int64_t> shape = p.sizes().vec();
    if (spec != specs.end()) shape[spec->second.dim] = spec->second.full;
    at::Tensor full = at::empty(shape, p.options().device(at::kCPU)).normal_(0, options.init_std);
    p.copy_(spec == specs.end() ? full : shard_of(full, spec->second, tp->rank(), tp->size()));
  }
}

at::Tensor LlamaImpl::embed(const at::Tensor& tokens) { return embed_tokens->forward(decoder_lm::cp_local(tokens, cp)); }

at::Tensor LlamaImpl::logits(const at::Tensor& x) {
  // The final norm feeds the head's Linear: on CUDA the fused kernel (see LlamaBlockImpl::forward).
  const at::Tensor h = !norm->sequence_parallel && fused_block_kernels_serve(x)
                           ? add_rms_norm(x, at::Tensor(), norm->weight, norm->eps).normed
                           : norm->forward(x);
  return decoder_lm::head_logits(head, tied_head, h);
}

at::Tensor LlamaImpl::head_loss(const at::Tensor& x, const at::Tensor& targets) {
  return decoder_lm::next_token_loss(logits(x), decoder_lm::cp_local(targets, cp), options.vocab, *tp);
}

at::Tensor LlamaImpl::forward(const at::Tensor& tokens) { return logits(blocks->forward(embed(tokens))); }

at::Tensor LlamaImpl::loss(const at::Tensor& inputs, const at::Tensor& targets) {
  return head_loss(blocks->forward(embed(inputs)), targets);
}

// ---- incremental decoding ----------------------------------------------------------------

LlamaKvCache LlamaImpl::make_kv_cache(int64_t batch, int64_t max_len) {
  for (size_t i = 0; i < blocks->size(); ++i) decoder_lm::decoding_block<LlamaBlockImpl>(*blocks, i, "LlamaBlock");
  return decoder_lm::empty_kv_cache(blocks->size(), batch, options.kv_heads / tp->size(), max_len,
                                    options.d_model / options.heads, embed_tokens->weight.options(), cp);
}

at::Tensor LlamaImpl::forward_cached(const at::Tensor& tokens, LlamaKvCache& cache) {
  at::NoGradGuard no_grad;
  decoder_lm::check_cached_call(tokens, cache, blocks->size(), options.kv_heads / tp->size(),
                                options.d_model / options.heads, cp, options.sequence_parallel);
  const CachedStep step = decoder_lm::cached_step(cache, tokens);
  const at::Tensor h = decoder_lm::cached_blocks<LlamaBlockImpl>(*blocks, embed(tokens), cache, step, "LlamaBlock");
  cache.length += tokens.size(1);
  return logits(h);
}

int64_t LlamaImpl::parameter_count() const {
  const int64_t d = options.d_model, hd = options.d_model / options.heads;
  const int64_t attention = d * options.heads * hd * 2 + d * options.kv_heads * hd * 2;  // q, o; k, v
  const int64_t per_block = 2 * d + attention + 3 * d * options.ff;
  const int64_t embedding = options.vocab * d;
  return embedding + options.layers * per_block + d + (options.tie_embeddings ? 0 : embedding);
}

ModelSpec llama_spec(const std::shared_ptr<LlamaImpl>& model) {
  return decoder_lm::token_window_spec(model, {"embed"}, {"norm", "head"}, model->embed_tokens->weight.scalar_type());
}

}  // namespace dtrain::engine
