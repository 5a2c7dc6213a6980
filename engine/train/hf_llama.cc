#include "dtrain/engine/train/hf_llama.h"

#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

HfNames llama_hf_names() {
  HfNames n;
  n.to_hf = [](const std::string& name) { return llama_hf_name(name); };
  n.to_dtrain = [](const std::string& name) { return llama_dtrain_name(name); };
  // Checkpoints of older transformers carry each attention's inverse rotary frequencies.
  n.ignored = [](const std::string& name) {
    const std::string tail = "rotary_emb.inv_freq";
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return n;
}

std::string llama_hf_config_json(const LlamaOptions& o, at::ScalarType dtype) {
  const int64_t kv = o.kv_heads > 0 ? o.kv_heads : o.heads;
  DTRAIN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
               "llama_hf_config_json: torch_dtype must be float32, bfloat16 or float16, not ", dtype);
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
      {"torch_dtype", dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bfloat16" : "float16"}};
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
