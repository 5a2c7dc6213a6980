#include "dtrain/engine/train/hf_gpt2.h"

#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"

#include "hf_names.h"

namespace dtrain::engine {
namespace {

const HfNameTable& gpt2_names() {
  static const HfNameTable names = {
      {{"wte.weight", "transformer.wte.weight"},   {"wpe.weight", "transformer.wpe.weight"},
       {"ln_f.weight", "transformer.ln_f.weight"}, {"ln_f.bias", "transformer.ln_f.bias"},
       {"head.weight", "lm_head.weight"}},
      "transformer.h.",
      {{"ln1.weight", "ln_1.weight"},           {"ln1.bias", "ln_1.bias"},
       {"attn.qkv.weight", "attn.c_attn.weight"}, {"attn.qkv.bias", "attn.c_attn.bias"},
       {"attn.proj.weight", "attn.c_proj.weight"}, {"attn.proj.bias", "attn.c_proj.bias"},
       {"ln2.weight", "ln_2.weight"},           {"ln2.bias", "ln_2.bias"},
       {"mlp.fc1.weight", "mlp.c_fc.weight"},    {"mlp.fc1.bias", "mlp.c_fc.bias"},
       {"mlp.fc2.weight", "mlp.c_proj.weight"},  {"mlp.fc2.bias", "mlp.c_proj.bias"}},
      "is not a parameter of the GPT model",
      "is not a tensor of a Hugging Face GPT-2 checkpoint this model reads"};
  return names;
}

// Whether transformers stores the block weight `dtrain_name` transposed (its Conv1D layers hold
// [in, out]).
bool transposed(const std::string& dtrain_name) {
  std::string index, rest;
  if (!split_block_name(dtrain_name, "blocks.", index, rest)) return false;
  for (const char* conv1d : {"attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"}) {
    if (rest == conv1d) return true;
  }
  return false;
}

std::string to_hf(const std::string& name) { return map_hf_name(gpt2_names(), name, true); }

std::string to_dtrain(const std::string& hf_name) {
  // The hub's original GPT-2 files name the body's tensors without "transformer.".
  const std::string name = hf_name.compare(0, 12, "transformer.") == 0 || hf_name == "lm_head.weight"
                               ? hf_name
                               : "transformer." + hf_name;
  return map_hf_name(gpt2_names(), name, false, hf_name);
}

}  // namespace

HfNames gpt2_hf_names(const GptOptions& o) {
  HfNames n;
  n.to_hf = to_hf;
  n.to_dtrain = to_dtrain;
  // Older files carry each attention's causal mask as a buffer.
  n.ignored = [](const std::string& name) {
    return name_ends_with(name, ".attn.bias") || name_ends_with(name, ".attn.masked_bias");
  };
  const int64_t seq_len = o.seq_len;
  n.from_hf_tensor = [seq_len](const std::string& name, const at::Tensor& t) {
    if (name == "wpe.weight") {
      DTRAIN_CHECK(t.dim() == 2 && t.size(0) >= seq_len, "the checkpoint's position table 'transformer.wpe.weight' has ",
                   t.dim() == 2 ? t.size(0) : 0, " positions, fewer than --seq_len=", seq_len,
                   "; train with a --seq_len of at most n_positions");
      return t.narrow(0, 0, seq_len);
    }
    return transposed(name) && t.dim() == 2 ? t.t().contiguous() : t;
  };
  n.to_hf_tensor = [](const std::string& name, const at::Tensor& t) {
    return transposed(name) ? t.t().contiguous() : t;
  };
  return n;
}

std::string gpt2_hf_config_json(const GptOptions& o, at::ScalarType dtype) {
  const char* torch_dtype = hf_torch_dtype(dtype, "gpt2_hf_config_json");
  nlohmann::ordered_json c = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", o.vocab},
      {"n_embd", o.d_model},
      {"n_head", o.heads},
      {"n_layer", o.layers},
      {"n_inner", o.ff},
      {"n_positions", o.seq_len},
      {"n_ctx", o.seq_len},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"resid_pdrop", o.dropout},
      {"embd_pdrop", o.dropout},
      {"attn_pdrop", o.dropout},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", o.tie_embeddings},
      {"torch_dtype", torch_dtype}};
  return c.dump(2) + "\n";
}

}  // namespace dtrain::engine
