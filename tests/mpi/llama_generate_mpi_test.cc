// Incremental decoding of the Llama and GPT models (forward_cached) split over tensor-parallel
// groups of 2 and 4 ranks: each rank caches its own key/value heads, and the vocabulary slices
// of its logits, gathered, equal the one-rank model's cached logits and its plain forward on
// the whole sequence (float64), for the Llama's grouped-query attention and the GPT's, with and
// without tied embeddings. A sequence-parallel model is refused by name. Runs at 2 and 4 ranks.
#include <gtest/gtest.h>

#include <iostream>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "model_cases.h"
#include "test_util.h"

namespace dtrain::engine::llama_generate_mpi_cases {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

constexpr int64_t kVocab = 51, kLen = 10;

// The split tests' model (model_cases.h: vocabulary kVocab, grouped-query) with kLen positions.
LlamaOptions options(bool tied) { return model_cases::split_llama_options(kLen, false, tied); }
GptOptions gpt_options(bool tied) { return model_cases::split_gpt_options(kLen, tied); }

// Prefill of 4, four single tokens, a chunk of 2: [B, kLen, local vocabulary].
template <class Model>
at::Tensor cached(Model& model, const at::Tensor& tokens) {
  KvCache cache = model.make_kv_cache(tokens.size(0), kLen);
  std::vector<at::Tensor> parts;
  int64_t at = 0;
  for (int64_t n : {4, 1, 1, 1, 1, 2}) {
    parts.push_back(model.forward_cached(tokens.narrow(1, at, n), cache));
    at += n;
  }
  return at::cat(parts, 1);
}

template <class Model, class Options>
void check_split(const std::string& name, const Options& o, int T, int64_t kv_heads) {
  const bool tied = o.tie_embeddings;
  SCOPED_TRACE(name + " tp " + std::to_string(T) + (tied ? " tied" : ""));
  auto& comm = world_comm();
  std::unique_ptr<dist::Communicator> alone = testing_util::alone_comm();
  dist::Mesh mesh(comm, T);
  auto& tp = mesh.tp();
  torch::manual_seed(5);
  Model ref(o, *alone);
  Model model(o, tp);
  ref.to(at::kDouble);
  model.to(at::kDouble);
  // Norm weights other than 1, the same on every rank; then the reference's weights in the split model.
  model_cases::draw_norm_weights(ref, 6);
  model_cases::load_reference_weights(ref, model, tp);
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor tokens = at::randint(kVocab, {2, kLen}, g, at::kLong);
  at::Tensor whole;
  {
    at::NoGradGuard no_grad;
    whole = ref.forward(tokens);
  }
  at::Tensor want = cached(ref, tokens);
  at::Tensor local = cached(model, tokens);
  EXPECT_EQ(model.make_kv_cache(2, kLen).k[0].size(1), kv_heads / T) << "each rank caches its own key/value heads";
  at::Tensor got = model_cases::gather_logits(local, kVocab, tp);
  EXPECT_LT(rel_error(got, want), 1e-12) << "against the one-rank model's cached logits";
  EXPECT_LT(rel_error(got, whole), 1e-12) << "against the one-rank model's whole-sequence forward";
  if (comm.rank() == 0) {
    std::cout << "[ generate ] " << name << " tp " << T << (tied ? " tied" : "") << ": cached logits rel " << rel_error(got, want)
              << " vs one rank's cached, " << rel_error(got, whole) << " vs its whole-sequence forward\n";
  }
}

TEST(LlamaGenerateMpi, TensorParallelCachedLogitsEqualOneRank) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int T : testing_util::tp_group_sizes()) {
    for (bool tied : {false, true}) {
      check_split<LlamaImpl>("llama", options(tied), T, 4);
      check_split<GptImpl>("gpt", gpt_options(tied), T, 8);
    }
  }
}

TEST(LlamaGenerateMpi, SequenceParallelIsRefused) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  dist::Mesh mesh(world_comm(), 2);
  LlamaOptions o = options(false);
  o.sequence_parallel = true;
  LlamaImpl model(o, mesh.tp());
  LlamaKvCache cache = model.make_kv_cache(1, kLen);
  const std::string e = testing_util::error_of([&] { model.forward_cached(at::zeros({1, 2}, at::kLong), cache); });
  EXPECT_NE(e.find("the model is sequence-parallel"), std::string::npos) << e;
  EXPECT_NE(e.find("build the model without sequence_parallel"), std::string::npos) << e;
  GptOptions g = gpt_options(false);
  g.sequence_parallel = true;
  GptImpl gpt(g, mesh.tp());
  KvCache gpt_cache = gpt.make_kv_cache(1, kLen);
  EXPECT_NE(testing_util::error_of([&] { gpt.forward_cached(at::zeros({1, 2}, at::kLong), gpt_cache); })
                .find("build the model without sequence_parallel"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine::llama_generate_mpi_cases
