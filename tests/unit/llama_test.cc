// The Llama model (models/llama.h) against Hugging Face transformers' LlamaForCausalLM in
// float64 (tests/reference/llama_reference.py): the same weights under their transformers
// names give the same logits, the same mean next-token loss and the same gradient of every
// parameter, for grouped-query, multi-query and multi-head attention, with and without Llama
// 3.1's rope scaling, with and without tied embeddings. Also the reading of config.json (a
// Llama 3.1 8B config as published, and what the model refuses), the parameter count, and the
// parameter names both ways.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <iostream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/state/export.h"
#include "dtrain/engine/train/hf_llama.h"
#include "test_util.h"

namespace dtrain::engine::llama_cases {
namespace {

using testing_util::error_of;
using testing_util::ScratchDir;

// Llama 3.1 8B's config.json as published.
const char* kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";

struct Case {
  std::string name;
  int64_t kv_heads;
  bool llama3, tied;
};

// A small model's config.json: vocab 96, d 32, 4 heads, ff 80, 2 layers, 12 positions.
std::string config_of(const Case& c) {
  nlohmann::json j = {{"model_type", "llama"},       {"vocab_size", 96},         {"hidden_size", 32},
                      {"num_attention_heads", 4},    {"num_key_value_heads", c.kv_heads},
                      {"intermediate_size", 80},     {"num_hidden_layers", 2},   {"max_position_embeddings", 12},
                      {"rms_norm_eps", 1e-5},        {"hidden_act", "silu"},     {"initializer_range", 0.3},
                      {"tie_word_embeddings", c.tied}, {"rope_theta", c.llama3 ? 500000.0 : 10000.0}};
  if (c.llama3) {
    // Head size 8: wavelengths 6.3, 63, 628, 6283 against 64/4 and 64/1: one of each band.
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  }
  return j.dump();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

std::map<std::string, at::Tensor> read_tensors(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : load_safetensors(path)) out[name] = t;
  return out;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.detach().to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Builds the case's float64 model (norm weights randomized too), writes its files.
std::shared_ptr<LlamaImpl> prepare(const Case& c, dist::Communicator& tp, const std::string& dir) {
  testing_util::remove_tree(dir);
  EXPECT_EQ(mkdir(dir.c_str(), 0755), 0) << dir;
  const std::string config = config_of(c);
  write_file(dir + "/config.json", config);
  torch::manual_seed(static_cast<uint64_t>(7 + c.kv_heads));
  auto model = std::make_shared<LlamaImpl>(llama_options_from_hf_config(config), tp);
  model->to(at::kDouble);
  NamedTensorList weights;
  {
    at::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("norm.weight") != std::string::npos) item.value().normal_(1.0, 0.2);
    }
  }
  for (auto& item : model->named_parameters()) weights.emplace_back(llama_hf_name(item.key()), item.value().detach());
  save_safetensors(dir + "/weights.safetensors", weights);
  auto g = at::make_generator<at::CPUGeneratorImpl>(31);
  save_safetensors(dir + "/tokens.safetensors", {{"tokens", at::randint(96, {3, 13}, g, at::kLong)}});
  return model;
}

// The model's logits, loss and gradients against transformers' (impl "sdpa": float64 all
// through, to `tol`; "eager": its float32 softmax, to `tol` as well but a looser one).
void compare(LlamaImpl& model, const std::string& dir, const std::string& impl, double tol, const std::string& label) {
  SCOPED_TRACE(label + " against transformers' " + impl + " attention");
  auto ref = read_tensors(dir + "/" + impl + ".safetensors");
  at::Tensor windows = read_tensors(dir + "/tokens.safetensors").at("tokens");
  at::Tensor inputs = windows.narrow(1, 0, 12), targets = windows.narrow(1, 1, 12);
  model.zero_grad();
  at::Tensor logits = model.forward(inputs);
  at::Tensor loss = model.loss(inputs, targets);
  loss.backward();
  const double logit_error = testing_util::rel_error(logits, ref.at("logits"));
  EXPECT_LT(logit_error, tol) << "logits, max |diff| " << max_abs(logits, ref.at("logits"));
  const double want = ref.at("loss").item<double>();
  EXPECT_NEAR(loss.item<double>(), want, tol * std::abs(want));
  double worst = 0;
  std::string worst_name;
  for (auto& item : model.named_parameters()) {
    const std::string hf = llama_hf_name(item.key());
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    const double e = testing_util::rel_error(item.value().grad(), ref.at("grad." + hf));
    EXPECT_LT(e, tol) << item.key() << " (" << hf << ")";
    if (e >= worst) worst = e, worst_name = item.key();
  }
  std::cout << "[ llama    ] " << label << " vs " << impl << ": logits rel " << logit_error << " (max |diff| "
            << max_abs(logits, ref.at("logits")) << "), loss |diff| " << std::abs(loss.item<double>() - want)
            << ", worst gradient rel " << worst << " (" << worst_name << ")\n";
}

TEST(Llama, MatchesTransformersLlamaForCausalLMInFloat64) {
  auto tp = testing_util::local_comm();
  ScratchDir scratch("llama_reference", true);
  const std::vector<Case> cases = {{"gqa", 2, false, false},
                                   {"mqa_llama3", 1, true, false},
                                   {"mha_tied", 4, false, true},
                                   {"gqa_llama3_tied", 2, true, true}};
  std::map<std::string, std::shared_ptr<LlamaImpl>> models;
  std::vector<std::string> args = {scratch.str()};
  for (const Case& c : cases) {
    models[c.name] = prepare(c, *tp, scratch / c.name);
    args.push_back(c.name);
  }
  const std::string out = testing_util::run_python("tests/reference/llama_reference.py", args);
  ASSERT_FALSE(out.empty());
  const nlohmann::json reply = nlohmann::json::parse(out);
  for (const Case& c : cases) {
    LlamaImpl& model = *models[c.name];
    const std::string dir = scratch / c.name;
    EXPECT_EQ(model.parameter_count(), reply.at("parameters").at(c.name).get<int64_t>()) << c.name;
    // The rotary tables: transformers' float32 values bit for bit.
    auto ref = read_tensors(dir + "/sdpa.safetensors");
    auto [cos, sin] = llama_rope_tables(model.options, 12);
    EXPECT_TRUE(at::equal(cos, ref.at("rope.cos"))) << c.name << ": cos max |diff| " << max_abs(cos, ref.at("rope.cos"));
    EXPECT_TRUE(at::equal(sin, ref.at("rope.sin"))) << c.name << ": sin max |diff| " << max_abs(sin, ref.at("rope.sin"));
    compare(model, dir, "sdpa", 1e-10, c.name);
    compare(model, dir, "eager", 1e-5, c.name);
  }
}

TEST(Llama, ReadsALlama31ConfigAndCountsItsParameters) {
  const LlamaOptions o = llama_options_from_hf_config(kLlama31_8B);
  EXPECT_EQ(o.vocab, 128256);
  EXPECT_EQ(o.d_model, 4096);
  EXPECT_EQ(o.heads, 32);
  EXPECT_EQ(o.kv_heads, 8);
  EXPECT_EQ(o.ff, 14336);
  EXPECT_EQ(o.layers, 32);
  EXPECT_EQ(o.seq_len, 131072);
  EXPECT_DOUBLE_EQ(o.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(o.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(o.rope_factor, 8.0);
  EXPECT_DOUBLE_EQ(o.rope_low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(o.rope_high_freq_factor, 4.0);
  EXPECT_EQ(o.rope_original_positions, 8192);
  EXPECT_FALSE(o.tie_embeddings);
  EXPECT_FALSE(o.sequence_parallel);
  // transformers' sum(p.numel()) for this config, by its modules: embed_tokens and lm_head
  // V*d each; per layer q, o d*d, k, v d*(kv*head_dim), gate, up, down d*ff, two norms d; norm d.
  const int64_t V = 128256, d = 4096, kv = 8 * 128, f = 14336;
  const int64_t per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d;
  EXPECT_EQ(V * d * 2 + 32 * per_layer + d, 8030261248LL);
  // The count without building 8 billion parameters: a model of one layer and the formula.
  LlamaOptions small = o;
  small.layers = 1;
  small.vocab = 64;
  small.d_model = 256;
  small.heads = 8;
  small.kv_heads = 2;
  small.ff = 512;
  auto tp = testing_util::local_comm();
  LlamaImpl one(small, *tp);
  int64_t numel = 0;
  for (const at::Tensor& p : one.parameters()) numel += p.numel();
  EXPECT_EQ(one.parameter_count(), numel);
}

TEST(Llama, ReadsTransformers5RopeParametersAndDefaults) {
  const LlamaOptions o = llama_options_from_hf_config(
      R"({"vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
          "num_hidden_layers": 2, "tie_word_embeddings": true, "head_dim": 16,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 250000.0, "factor": 32,
                              "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}})");
  EXPECT_EQ(o.kv_heads, 4);
  EXPECT_EQ(o.seq_len, 2048);
  EXPECT_DOUBLE_EQ(o.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(o.rope_theta, 250000.0);
  EXPECT_DOUBLE_EQ(o.rope_factor, 32.0);
  EXPECT_TRUE(o.tie_embeddings);
  const LlamaOptions plain = llama_options_from_hf_config(
      R"({"vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
          "num_hidden_layers": 2, "rope_scaling": null, "model_type": "mistral", "sliding_window": null,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})");
  EXPECT_EQ(plain.rope_factor, 0);
  EXPECT_DOUBLE_EQ(plain.rope_theta, 1000000.0);
}

// config_json with `key` set to `value` (a JSON text; "null" deletes it).
std::string with(const std::string& key, const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(kLlama31_8B);
  if (value == "null") {
    j.erase(key);
  } else {
    j[key] = nlohmann::json::parse(value);
  }
  return j.dump();
}

TEST(Llama, ConfigErrorsNameTheField) {
  auto error = [](const std::string& text) { return error_of([&] { llama_options_from_hf_config(text); }); };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with("hidden_size", "null"), "'hidden_size' is missing"},
      {with("hidden_size", "\"4096\""), "'hidden_size' must be an integer, got \"4096\""},
      {with("num_hidden_layers", "0"), "'num_hidden_layers' must be positive"},
      {with("num_key_value_heads", "5"), "'num_key_value_heads' (5) must divide 'num_attention_heads' (32)"},
      {with("attention_bias", "true"), "'attention_bias' is true"},
      {with("mlp_bias", "true"), "'mlp_bias' is true"},
      {with("hidden_act", "\"gelu\""), "'hidden_act' is \"gelu\""},
      {with("head_dim", "64"), "'head_dim' (64) is not hidden_size / num_attention_heads (128)"},
      {with("model_type", "\"qwen2\""), "'model_type' is \"qwen2\""},
      {with("sliding_window", "4096"), "'sliding_window' (4096) is shorter than 'max_position_embeddings'"},
      {with("rms_norm_eps", "\"tiny\""), "'rms_norm_eps' must be a number"},
      {with("tie_word_embeddings", "1"), "'tie_word_embeddings' must be true or false"},
      {with("rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})"), "'rope_scaling.rope_type' is \"yarn\""},
      {with("rope_scaling", R"({"type": "linear", "factor": 4.0})"), "'rope_scaling.rope_type' is \"linear\""},
      {with("rope_scaling", R"({"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4,
                                "original_max_position_embeddings": 8192})"),
       "'rope_scaling.factor' is missing"},
      {with("rope_scaling", R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
                                "original_max_position_embeddings": 8192})"),
       "'rope_scaling.low_freq_factor' (4) must be positive and below 'rope_scaling.high_freq_factor' (1)"},
      {"[1, 2]", "config.json must hold a JSON object"},
      {"{\"vocab_size\": ", "config.json is not valid JSON"}};
  for (const auto& [text, want] : cases) {
    const std::string e = error(text);
    EXPECT_NE(e.find(want), std::string::npos) << "want: " << want << "\ngot: " << e;
  }
}

TEST(Llama, NamesMapToTransformersAndBack) {
  auto tp = testing_util::local_comm();
  LlamaOptions o{50, 16, 4, 2, 24, 8, 3};
  for (bool tied : {false, true}) {
    o.tie_embeddings = tied;
    LlamaImpl model(o, *tp);
    std::vector<std::string> names;
    for (auto& item : model.named_parameters()) names.push_back(item.key());
    ASSERT_EQ(names.size(), 3u + 3 * 9) << "a tied head keeps its name";
    for (const std::string& n : names) EXPECT_EQ(llama_dtrain_name(llama_hf_name(n)), n);
  }
  EXPECT_EQ(llama_hf_name("blocks.3.attn.q.weight"), "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(llama_hf_name("blocks.12.mlp_norm.weight"), "model.layers.12.post_attention_layernorm.weight");
  EXPECT_EQ(llama_hf_name("embed.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(llama_hf_name("head.weight"), "lm_head.weight");
  EXPECT_EQ(llama_dtrain_name("model.layers.0.mlp.down_proj.weight"), "blocks.0.mlp.down.weight");
  EXPECT_EQ(llama_dtrain_name("model.norm.weight"), "norm.weight");
  for (const char* bad : {"blocks.03.attn.q.weight", "blocks.x.attn.q.weight", "blocks.1.attn.qkv.weight", "wte.weight"}) {
    EXPECT_NE(error_of([&] { llama_hf_name(bad); }).find(std::string("'") + bad + "' is not a parameter of the Llama"),
              std::string::npos);
  }
  EXPECT_NE(error_of([&] { llama_dtrain_name("model.layers.0.self_attn.rotary_emb.inv_freq"); })
                .find("is not a tensor of a Hugging Face Llama checkpoint"),
            std::string::npos);
}

TEST(Llama, TiedHeadIsTheEmbeddingsTensor) {
  auto tp = testing_util::local_comm();
  LlamaOptions o{30, 16, 4, 1, 24, 6, 1};
  o.tie_embeddings = true;
  torch::manual_seed(3);
  LlamaImpl model(o, *tp);
  EXPECT_EQ(model.tied_head->weight.unsafeGetTensorImpl(), model.embed_tokens->weight.unsafeGetTensorImpl());
  EXPECT_EQ(trained_parameters(model).tied.size(), 1u);
  EXPECT_EQ(model.parameter_count(), 30 * 16 + (2 * 16 + 16 * 16 * 2 + 16 * 4 * 2 + 3 * 16 * 24) + 16);
  // The initial weights: normal(0, 0.02), norms 1.
  EXPECT_NEAR(model.embed_tokens->weight.std().item<double>(), 0.02, 0.004);
  EXPECT_TRUE(at::equal(model.norm->weight, at::ones({16})));
  at::Tensor tokens = at::randint(30, {2, 6}, at::kLong);
  EXPECT_EQ(model.forward(tokens).sizes(), (std::vector<int64_t>{2, 6, 30}));
}

// Mixed precision: under bfloat16 autocast (float32 weights) and with bfloat16 weights, the loss
// and its gradients are finite and near the float32 ones (the rotary tables follow the residual
// stream's dtype, as in transformers).
TEST(Llama, RunsUnderAutocastAndInBfloat16) {
  auto tp = testing_util::local_comm();
  LlamaOptions o{64, 32, 4, 2, 48, 16, 2};
  o.init_std = 0.2;
  torch::manual_seed(5);
  auto model = std::make_shared<LlamaImpl>(o, *tp);
  auto g = at::make_generator<at::CPUGeneratorImpl>(6);
  at::Tensor windows = at::randint(64, {2, 17}, g, at::kLong);
  at::Tensor inputs = windows.narrow(1, 0, 16), targets = windows.narrow(1, 1, 16);
  const double want = model->loss(inputs, targets).item<double>();
  {
    AutocastGuard autocast(c10::kCPU, AmpMode::kBf16);
    at::Tensor loss = model->loss(inputs, targets);
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), want, 0.03 * want);
  }
  for (const at::Tensor& p : model->parameters()) EXPECT_TRUE(p.grad().isfinite().all().item<bool>());
  model->to(at::kBFloat16);
  at::Tensor loss = model->loss(inputs, targets);
  EXPECT_EQ(model->forward(inputs).scalar_type(), at::kBFloat16);
  EXPECT_NEAR(loss.item<double>(), want, 0.05 * want);
}

}  // namespace
}  // namespace dtrain::engine::llama_cases
