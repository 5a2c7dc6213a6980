// The GPT model as transformers' GPT2LMHeadModel (train/hf_gpt2.h): a checkpoint dtrain writes
// loads in transformers with the same logits, and a transformers-made one loads in dtrain with
// the same logits (float64, tests/reference/gpt2_reference.py); the config.json reader refuses
// what the model does not have, by name.
#include "dtrain/engine/train/hf_gpt2.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/state/export.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;
using testing_util::ScratchDir;

at::Tensor logits_in(const std::string& path) {
  for (auto& [name, t] : load_safetensors(path)) {
    if (name == "logits") return t;
  }
  ADD_FAILURE() << path << " has no logits";
  return {};
}

TEST(Gpt2Hf, CheckpointsGoBothWaysWithTransformersLogits) {
  auto tp = testing_util::local_comm();
  ScratchDir dir("gpt2_hf", true);
  // GPT-2's layout at a small size: tied head, n_inner 3 d, a vocabulary that is not a multiple
  // of anything, n_positions above the trained length.
  const std::string config = R"({"model_type": "gpt2", "vocab_size": 97, "n_embd": 32, "n_head": 4, "n_layer": 2,
    "n_inner": 96, "n_positions": 40, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
    "tie_word_embeddings": true, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1})";
  write_text_atomically(dir / "hf_config.json", config);
  GptOptions o = gpt_options_from_hf_config(config);
  EXPECT_EQ(o.seq_len, 40);
  EXPECT_TRUE(o.tie_embeddings);
  EXPECT_EQ(o.ff, 96);
  EXPECT_EQ(o.dropout, 0);
  o.seq_len = 12;
  torch::manual_seed(5);
  auto ours = std::make_shared<GptImpl>(o, *tp);
  ours->to(at::kDouble);
  ours->eval();
  const at::Tensor tokens = at::randint(o.vocab, {2, o.seq_len}, at::kLong);
  save_safetensors(dir / "tokens.safetensors", {{"tokens", tokens}});
  ::mkdir((dir / "dtrain").c_str(), 0755);
  HfSaveOptions save;
  save.config_json = gpt2_hf_config_json(o);
  EXPECT_EQ(save_hf_weights(dir / "dtrain", *ours, *tp, gpt2_hf_names(o), save), 2 + 2 * 12 + 2);
  const nlohmann::json out = nlohmann::json::parse(testing_util::run_python("tests/reference/gpt2_reference.py", {dir.str()}));

  at::NoGradGuard no_grad;
  const at::Tensor want = ours->forward(tokens);
  const at::Tensor got = logits_in(dir / "dtrain_logits.safetensors");
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LT(testing_util::rel_error(got, want), 1e-12) << "transformers' logits of dtrain's export";

  // transformers' own model (n_positions 40) into dtrain at seq_len 12.
  torch::manual_seed(6);
  auto loaded = std::make_shared<GptImpl>(o, *tp);
  loaded->to(at::kDouble);
  loaded->eval();
  EXPECT_EQ(load_hf_weights(dir / "hf", *loaded, *tp, gpt2_hf_names(o)), 2 + 2 * 12 + 2);
  EXPECT_LT(testing_util::rel_error(loaded->forward(tokens), logits_in(dir / "hf_logits.safetensors")), 1e-12)
      << "dtrain's logits of transformers' checkpoint";
  o.seq_len = 40;
  EXPECT_EQ(out["parameters"].get<int64_t>(), GptImpl(o, *tp).parameter_count());

  // A position table shorter than the trained length.
  GptOptions longer = o;
  longer.seq_len = 41;
  GptImpl too_long(longer, *tp);
  const std::string e = error_of([&] { load_hf_weights(dir / "hf", too_long, *tp, gpt2_hf_names(longer)); });
  EXPECT_NE(e.find("has 40 positions, fewer than --seq_len=41"), std::string::npos) << e;
}

TEST(Gpt2Hf, ConfigFieldsTheModelLacksAreNamed) {
  auto bad = [](const std::string& extra) {
    return error_of([&] {
      gpt_options_from_hf_config(R"({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_head": 12,
        "n_layer": 12)" + extra + "}");
    });
  };
  EXPECT_NE(bad(R"(, "activation_function": "relu")").find("'activation_function' is \"relu\""), std::string::npos);
  EXPECT_NE(bad(R"(, "layer_norm_epsilon": 1e-6)").find("'layer_norm_epsilon'"), std::string::npos);
  EXPECT_NE(bad(R"(, "scale_attn_by_inverse_layer_idx": true)").find("'scale_attn_by_inverse_layer_idx' is true"),
            std::string::npos);
  EXPECT_NE(bad(R"(, "add_cross_attention": true)").find("'add_cross_attention' is true"), std::string::npos);
  EXPECT_NE(bad(R"(, "n_head": 7)").find("is not divisible by 'n_head'"), std::string::npos);
  EXPECT_NE(error_of([] { gpt_options_from_hf_config(R"({"model_type": "llama"})"); }).find("'model_type' is \"llama\""),
            std::string::npos);
  EXPECT_NE(error_of([] { gpt_options_from_hf_config(R"({"model_type": "gpt2", "n_embd": 8})"); }).find("'vocab_size' is missing"),
            std::string::npos);
  // GPT-2 small as published: transformers' defaults fill what the file leaves out.
  GptOptions small = gpt_options_from_hf_config(R"({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768,
    "n_head": 12, "n_layer": 12})");
  EXPECT_EQ(small.ff, 3072);
  EXPECT_EQ(small.seq_len, 1024);
  EXPECT_TRUE(small.tie_embeddings);
}

}  // namespace
}  // namespace dtrain::engine
