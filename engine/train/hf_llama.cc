#include "dtrain/engine/train/hf_llama.h"

#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"

#include "hf_names.h"

namespace dtrain::engine {
namespace {

const HfNameTable& llama_names() {
  static const HfNameTable names = {
      {{"embed.weight", "model.embed_tokens.weight"}, {"norm.weight", "model.norm.weight"}, {"head.weight", "lm_head.weight"}},
      "model.layers.",
      {{"attn_norm.weight", "input_layernorm.weight"},    {"attn.q.weight", "self_attn.q_proj.weight"},
       {"attn.k.weight", "self_attn.k_proj.weight"},      {"attn.v.weight", "self_attn.v_proj.weight"},
       {"attn.o.weight", "self_attn.o_proj.weight"},      {"mlp_norm.weight", "post_attention_layernorm.weight"},
       {"mlp.gate.weight", "mlp.gate_proj.weight"},       {"mlp.up.weight", "mlp.up_proj.weight"},
       {"mlp.down.weight", "mlp.down_proj.weight"}},
      "is not a parameter of the Llama model (its names are embed.weight, "
      "blocks.<i>.{attn_norm,attn.q,attn.k,attn.v,attn.o,mlp_norm,mlp.gate,mlp.up,mlp.down}.weight, "
      "norm.weight, head.weight)",
      "is not a tensor of a Hugging Face Llama checkpoint this model reads "
      "(model.embed_tokens.weight, model.layers.<i>.{input_layernorm,self_attn.{q,k,v,o}_proj,"
      "post_attention_layernorm,mlp.{gate,up,down}_proj}.weight, model.norm.weight, lm_head.weight)"};
  return names;
}

}  // namespace

std::string llama_hf_name(const std::string& dtrain_name) { return map_hf_name(llama_names(), dtrain_name, true); }

std::string llama_dtrain_name(const std::string& hf_name) { return map_hf_name(llama_names(), hf_name, false); }

HfNames llama_hf_names() {
  HfNames n;
  n.to_hf = [](const std::string& name) { return llama_hf_name(name); };
  n.to_dtrain = [](const std::string& name) { return llama_dtrain_name(name); };
  // Checkpoints of older transformers carry each attention's inverse rotary frequencies.
  n.ignored = [](const std::string& name) { return name_ends_with(name, "rotary_emb.inv_freq"); };
  return n;
}

std::string llama_hf_config_json(const LlamaOptions& o, at::ScalarType dtype) {
  const int64_t kv = o.kv_heads > 0 ? o.kv_heads : o.heads;
  const char* torch_dtype = hf_torch_dtype(dtype, "llama_hf_config_json");
  nlohmann::ordered_json c = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", o.vocab},
      {"hidden_size", o.d_model},
      {"intermediate_size", o.ff},
      {"num_hidden_layers", o.layers},
      {"num_attention_heads", o.heads},
      {"num_key_value_heads", kv},
      {"head_dim", o.d_model / o.heads},
      {"hidden_act", "silu"},
      {"max_position_embeddings", o.seq_len},
      {"rms_norm_eps", o.norm_eps},
      {"rope_theta", o.rope_theta},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"tie_word_embeddings", o.tie_embeddings},
      {"torch_dtype", torch_dtype}};
  if (o.rope_factor > 0) {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", o.rope_factor},
                         {"low_freq_factor", o.rope_low_freq_factor},
                         {"high_freq_factor", o.rope_high_freq_factor},
                         {"original_max_position_embeddings", o.rope_original_positions}};
  } else {
    c["rope_scaling"] = nullptr;
  }
  return c.dump(2) + "\n";
}

}  // namespace dtrain::engine
