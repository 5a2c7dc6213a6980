// Hugging Face checkpoints in and out (train/hf_checkpoint.h): what save_hf_weights writes is
// read by the safetensors package as transformers reads a checkpoint directory (one file, or
// shards with their index), loads back into a model of other initial weights exactly, and bad
// checkpoints are refused naming the file, the tensor and the fix.
#include "dtrain/engine/train/hf_checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/state/export.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;
using testing_util::ScratchDir;

// A head whose weight is another module's tensor (a language-model head tied to the embedding).
struct TiedHead : torch::nn::Module {
  explicit TiedHead(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor weight;
};

// An embedding, a column-parallel projection and a head tied to the embedding.
struct Toy : torch::nn::Module {
  explicit Toy(dist::Communicator& tp) {
    emb = register_module("emb", VocabParallelEmbedding(11, 6, tp));
    proj = register_module("proj", ColumnParallelLinear(ParallelLinearOptions(6, 4), tp));
    head = register_module("head", std::make_shared<TiedHead>(emb->weight));
  }
  VocabParallelEmbedding emb{nullptr};
  ColumnParallelLinear proj{nullptr};
  std::shared_ptr<TiedHead> head;
};

HfNames toy_names() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"emb.weight", "model.embed_tokens.weight"},
      {"proj.weight", "model.proj.weight"},
      {"proj.bias", "model.proj.bias"},
      {"head.weight", "lm_head.weight"}};
  HfNames n;
  n.to_hf = [](const std::string& name) {
    for (const auto& [d, h] : table) {
      if (d == name) return h;
    }
    throw Error("no Hugging Face name for '" + name + "'");
  };
  n.to_dtrain = [](const std::string& name) {
    for (const auto& [d, h] : table) {
      if (h == name) return d;
    }
    throw Error("no dtrain name for '" + name + "'");
  };
  n.ignored = [](const std::string& name) { return name == "model.rotary_emb.inv_freq"; };
  return n;
}

std::shared_ptr<Toy> toy(dist::Communicator& tp, uint64_t seed) {
  torch::manual_seed(seed);
  auto t = std::make_shared<Toy>(tp);
  for (auto& p : t->parameters()) p.data().normal_();
  return t;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

nlohmann::json read_back(const std::string& dir) {
  return nlohmann::json::parse(testing_util::run_python("tests/reference/hf_checkpoint_reference.py", {dir}));
}

void expect_tensor(const nlohmann::json& got, const at::Tensor& want, const std::string& dtype) {
  EXPECT_EQ(got["dtype"], dtype);
  EXPECT_EQ(got["shape"].get<std::vector<int64_t>>(), want.sizes().vec());
  const std::vector<double> values = got["values"].get<std::vector<double>>();
  const at::Tensor w = want.to(at::kDouble).flatten().contiguous();
  ASSERT_EQ(static_cast<int64_t>(values.size()), w.numel());
  for (int64_t i = 0; i < w.numel(); ++i) EXPECT_EQ(values[i], w[i].item<double>()) << i;
}

TEST(HfCheckpoint, OneFileReadByTheSafetensorsPackageAndLoadedBackExactly) {
  auto tp = testing_util::local_comm();
  auto a = toy(*tp, 1);
  ScratchDir dir("hf_one", true);
  HfSaveOptions o;
  o.config_json = "{\"model_type\": \"toy\"}";
  EXPECT_EQ(save_hf_weights(dir.str(), *a, *tp, toy_names(), o), 3);  // the tied head once
  const nlohmann::json got = read_back(dir.str());
  EXPECT_EQ(got["files"], nlohmann::json::array({"model.safetensors"}));
  EXPECT_EQ(got["config"]["model_type"], "toy");
  ASSERT_EQ(got["tensors"].size(), 3u);  // transformers drops a tied head too
  expect_tensor(got["tensors"]["model.embed_tokens.weight"], a->emb->weight, "float32");
  expect_tensor(got["tensors"]["model.proj.weight"], a->proj->weight, "float32");
  expect_tensor(got["tensors"]["model.proj.bias"], a->proj->bias, "float32");

  auto b = toy(*tp, 2);
  ASSERT_FALSE(at::equal(a->proj->weight, b->proj->weight));
  EXPECT_EQ(load_hf_weights(dir.str(), *b, *tp, toy_names()), 3);
  EXPECT_TRUE(at::equal(a->emb->weight, b->emb->weight));
  EXPECT_TRUE(at::equal(a->proj->weight, b->proj->weight));
  EXPECT_TRUE(at::equal(a->proj->bias, b->proj->bias));
  EXPECT_TRUE(b->head->weight.is_same(b->emb->weight));  // still tied
}

TEST(HfCheckpoint, ShardsWithAnIndexInBfloat16ReplaceAnOlderSingleFile) {
  auto tp = testing_util::local_comm();
  auto a = toy(*tp, 3);
  ScratchDir dir("hf_shards", true);
  save_hf_weights(dir.str(), *a, *tp, toy_names());
  ASSERT_TRUE(exists(dir / "model.safetensors"));
  HfSaveOptions o;
  o.dtype = at::kBFloat16;
  o.max_shard_bytes = 100;  // the embedding (132 B in bf16) alone, then the projection
  save_hf_weights(dir.str(), *a, *tp, toy_names(), o);
  EXPECT_FALSE(exists(dir / "model.safetensors"));  // from_pretrained would read it first
  const nlohmann::json got = read_back(dir.str());
  EXPECT_EQ(got["files"], nlohmann::json::array({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}));
  expect_tensor(got["tensors"]["model.embed_tokens.weight"], a->emb->weight.to(at::kBFloat16), "bfloat16");
  expect_tensor(got["tensors"]["model.proj.weight"], a->proj->weight.to(at::kBFloat16), "bfloat16");

  auto b = toy(*tp, 4);
  EXPECT_EQ(hf_weight_files(dir.str()).size(), 2u);
  EXPECT_EQ(load_hf_weights(dir.str(), *b, *tp, toy_names()), 3);
  EXPECT_TRUE(at::equal(b->proj->weight, a->proj->weight.to(at::kBFloat16).to(at::kFloat)));
  // Back to one file: the index goes, so no reader finds the shards' names.
  save_hf_weights(dir.str(), *a, *tp, toy_names());
  EXPECT_FALSE(exists(dir / "model.safetensors.index.json"));
  EXPECT_EQ(hf_weight_files(dir.str()), std::vector<std::string>{dir / "model.safetensors"});
}

NamedTensorList toy_file(const Toy& t) {
  return {{"model.embed_tokens.weight", t.emb->weight}, {"model.proj.weight", t.proj->weight},
          {"model.proj.bias", t.proj->bias}, {"model.rotary_emb.inv_freq", at::ones({3})}};
}

TEST(HfCheckpoint, BadCheckpointsAreRefusedNamingTheFileTheTensorAndTheFix) {
  auto tp = testing_util::local_comm();
  auto a = toy(*tp, 5);
  ScratchDir dir("hf_bad", true);
  const std::string file = dir / "w.safetensors";
  NamedTensorList tensors = toy_file(*a);
  save_safetensors(file, tensors);
  EXPECT_EQ(load_hf_weights(file, *toy(*tp, 6), *tp, toy_names()), 3);  // a file, the ignored table skipped

  NamedTensorList extra = tensors;
  extra.emplace_back("model.layers.0.mlp.weight", at::zeros({2}));
  save_safetensors(file, extra);
  std::string e = error_of([&] { load_hf_weights(file, *toy(*tp, 6), *tp, toy_names()); });
  EXPECT_NE(e.find("tensor 'model.layers.0.mlp.weight' is not a weight of this model"), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;

  NamedTensorList wrong = tensors;
  wrong[1].second = at::zeros({5, 6});
  save_safetensors(file, wrong);
  e = error_of([&] { load_hf_weights(file, *toy(*tp, 6), *tp, toy_names()); });
  EXPECT_NE(e.find("tensor 'model.proj.weight' has shape [5, 6] but the model's 'proj.weight' has [4, 6]"),
            std::string::npos) << e;
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;

  save_safetensors(file, {tensors[0], tensors[2]});
  e = error_of([&] { load_hf_weights(file, *toy(*tp, 6), *tp, toy_names()); });
  EXPECT_NE(e.find("lacks 1 of the model's 3 weights ('model.proj.weight')"), std::string::npos) << e;

  // An index naming a shard that is not there.
  const std::string sharded = dir / "sharded";
  ::mkdir(sharded.c_str(), 0755);
  write_text_atomically(sharded + "/model.safetensors.index.json",
                        R"({"metadata": {}, "weight_map": {"model.proj.weight": "model-00001-of-00002.safetensors"}})");
  e = error_of([&] { hf_weight_files(sharded); });
  EXPECT_NE(e.find("names the file 'model-00001-of-00002.safetensors' (tensor 'model.proj.weight')"),
            std::string::npos) << e;
  // A pickle checkpoint, an empty directory, a missing path.
  const std::string pickle = dir / "pickle";
  ::mkdir(pickle.c_str(), 0755);
  std::ofstream(pickle + "/pytorch_model.bin") << "x";
  EXPECT_NE(error_of([&] { hf_weight_files(pickle); }).find("PyTorch pickle checkpoint"), std::string::npos);
  const std::string empty = dir / "empty";
  ::mkdir(empty.c_str(), 0755);
  EXPECT_NE(error_of([&] { hf_weight_files(empty); }).find("holds neither model.safetensors nor"),
            std::string::npos);
  EXPECT_NE(error_of([&] { hf_weight_files(dir / "nothing"); }).find("does not exist"), std::string::npos);
  // Saving into a directory that is not there fails before writing anything.
  EXPECT_NE(error_of([&] { save_hf_weights(dir / "nothing", *a, *tp, toy_names()); }).find("mkdir -p"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
