#include "dtrain/engine/train/hf_gpt2.h"

#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"

namespace dtrain::engine {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Within a block: dtrain's name, transformers' name, and whether transformers stores the weight
// transposed (its Conv1D layers hold [in, out]).
struct BlockName {
  const char* dtrain;
  const char* hf;
  bool transposed;
};
const std::vector<BlockName>& block_names() {
  static const std::vector<BlockName> names = {
      {"ln1.weight", "ln_1.weight", false},         {"ln1.bias", "ln_1.bias", false},
      {"attn.qkv.weight", "attn.c_attn.weight", true}, {"attn.qkv.bias", "attn.c_attn.bias", false},
      {"attn.proj.weight", "attn.c_proj.weight", true}, {"attn.proj.bias", "attn.c_proj.bias", false},
      {"ln2.weight", "ln_2.weight", false},         {"ln2.bias", "ln_2.bias", false},
      {"mlp.fc1.weight", "mlp.c_fc.weight", true},  {"mlp.fc1.bias", "mlp.c_fc.bias", false},
      {"mlp.fc2.weight", "mlp.c_proj.weight", true}, {"mlp.fc2.bias", "mlp.c_proj.bias", false}};
  return names;
}

const std::vector<std::pair<std::string, std::string>>& model_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"wte.weight", "transformer.wte.weight"},   {"wpe.weight", "transformer.wpe.weight"},
      {"ln_f.weight", "transformer.ln_f.weight"}, {"ln_f.bias", "transformer.ln_f.bias"},
      {"head.weight", "lm_head.weight"}};
  return names;
}

// "<prefix><digits>.<rest>" -> (digits, rest); false otherwise.
bool split_block(const std::string& name, const std::string& prefix, std::string& index, std::string& rest) {
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return false;
  index = name.substr(prefix.size(), dot - prefix.size());
  if (index.find_first_not_of("0123456789") != std::string::npos) return false;
  rest = name.substr(dot + 1);
  return true;
}

const BlockName* block_entry(const std::string& dtrain_name) {
  std::string index, rest;
  if (!split_block(dtrain_name, "blocks.", index, rest)) return nullptr;
  for (const BlockName& b : block_names()) {
    if (rest == b.dtrain) return &b;
  }
  return nullptr;
}

std::string to_hf(const std::string& name) {
  for (const auto& [d, h] : model_names()) {
    if (name == d) return h;
  }
  std::string index, rest;
  if (split_block(name, "blocks.", index, rest)) {
    for (const BlockName& b : block_names()) {
      if (rest == b.dtrain) return "transformer.h." + index + "." + b.hf;
    }
  }
  throw Error("'" + name + "' is not a parameter of the GPT model");
}

std::string to_dtrain(const std::string& hf_name) {
  // The hub's original GPT-2 files name the body's tensors without "transformer.".
  const std::string name = hf_name.compare(0, 12, "transformer.") == 0 || hf_name == "lm_head.weight"
                               ? hf_name
                               : "transformer." + hf_name;
  for (const auto& [d, h] : model_names()) {
    if (name == h) return d;
  }
  std::string index, rest;
  if (split_block(name, "transformer.h.", index, rest)) {
    for (const BlockName& b : block_names()) {
      if (rest == b.hf) return "blocks." + index + "." + b.dtrain;
    }
  }
  throw Error("'" + hf_name + "' is not a tensor of a Hugging Face GPT-2 checkpoint this model reads");
}

}  // namespace

HfNames gpt2_hf_names(const GptOptions& o) {
  HfNames n;
  n.to_hf = to_hf;
  n.to_dtrain = to_dtrain;
  // Older files carry each attention's causal mask as a buffer.
  n.ignored = [](const std::string& name) { return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias"); };
  const int64_t seq_len = o.seq_len;
  n.from_hf_tensor = [seq_len](const std::string& name, const at::Tensor& t) {
    if (name == "wpe.weight") {
      DTRAIN_CHECK(t.dim() == 2 && t.size(0) >= seq_len, "the checkpoint's position table 'transformer.wpe.weight' has ",
                   t.dim() == 2 ? t.size(0) : 0, " positions, fewer than --seq_len=", seq_len,
                   "; train with a --seq_len of at most n_positions");
      return t.narrow(0, 0, seq_len);
    }
    const BlockName* b = block_entry(name);
    return b != nullptr && b->transposed && t.dim() == 2 ? t.t().contiguous() : t;
  };
  n.to_hf_tensor = [](const std::string& name, const at::Tensor& t) {
    const BlockName* b = block_entry(name);
    return b != nullptr && b->transposed ? t.t().contiguous() : t;
  };
  return n;
}

std::string gpt2_hf_config_json(const GptOptions& o, at::ScalarType dtype) {
  DTRAIN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
               "gpt2_hf_config_json: torch_dtype must be float32, bfloat16 or float16, not ", dtype);
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
      {"torch_dtype", dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bfloat16" : "float16"}};
  return c.dump(2) + "\n";
}

}  // namespace dtrain::engine
