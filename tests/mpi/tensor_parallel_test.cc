// Tensor-parallel layers against the unsplit PyTorch layers in float64, for T = 2 and 4:
// forward outputs and every gradient (inputs and parameters).
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::rel_error;
using testing_util::same_everywhere;
using testing_util::world_comm;

constexpr double kTol = 1e-12;


TEST(TensorParallelLayers, ColumnRowAndMlpMatchTheUnsplitLinears) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    auto& tp = mesh.tp();
    torch::manual_seed(5);
    ColumnParallelLinear fc1(ParallelLinearOptions(6, 8 * T), tp);
    RowParallelLinear fc2(ParallelLinearOptions(8 * T, 5), tp);
    fc1->to(at::kDouble);
    fc2->to(at::kDouble);
    auto full1 = gather_full_state(*fc1, tp);
    auto full2 = gather_full_state(*fc2, tp);
    // Reference: plain linears with the gathered full weights.
    torch::nn::Linear ref1(6, 8 * T), ref2(8 * T, 5);
    ref1->to(at::kDouble);
    ref2->to(at::kDouble);
    {
      torch::NoGradGuard ng;
      ref1->weight.copy_(full1["weight"]);
      ref1->bias.copy_(full1["bias"]);
      ref2->weight.copy_(full2["weight"]);
      ref2->bias.copy_(full2["bias"]);
    }
    at::Tensor x = same_everywhere({3, 4, 6}, 11).requires_grad_(true);
    at::Tensor xr = x.detach().clone().requires_grad_(true);
    at::Tensor probe = same_everywhere({3, 4, 5}, 12);
    at::Tensor y = fc2->forward(at::gelu(fc1->forward(x), "tanh"));
    at::Tensor yr = ref2->forward(at::gelu(ref1->forward(xr), "tanh"));
    EXPECT_LT(rel_error(y, yr), kTol) << "T=" << T;
    (y * probe).sum().backward();
    (yr * probe).sum().backward();
    EXPECT_LT(rel_error(x.grad(), xr.grad()), kTol);
    auto spec1 = fc1->shard_specs();
    EXPECT_LT(rel_error(fc1->weight.grad(), shard_of(ref1->weight.grad(), spec1["weight"], tp.rank(), T)), kTol);
    EXPECT_LT(rel_error(fc1->bias.grad(), shard_of(ref1->bias.grad(), spec1["bias"], tp.rank(), T)), kTol);
    EXPECT_LT(rel_error(fc2->weight.grad(), shard_of(ref2->weight.grad(), fc2->shard_specs()["weight"], tp.rank(), T)), kTol);
    EXPECT_LT(rel_error(fc2->bias.grad(), ref2->bias.grad()), kTol);
    // Gathered output of a column-parallel layer.
    ParallelLinearOptions gathered_options(6, 4 * T);
    gathered_options.bias = false;
    gathered_options.gather_output = true;
    ColumnParallelLinear gathered(gathered_options, tp);
    gathered->to(at::kDouble);
    auto fullg = gather_full_state(*gathered, tp);
    at::Tensor out = gathered->forward(x.detach());
    EXPECT_LT(rel_error(out, at::linear(x.detach(), fullg["weight"])), kTol);
  }
}

// join_shards() puts every rank's shard_of() back together, for any group size, padding and
// fused blocks (q, k, v); a resume under another --tp relies on it (no communication).
TEST(TensorParallelLayers, JoinShardsInvertsShardOfForEveryGroupSize) {
  const at::Tensor x = testing_util::same_everywhere({12, 5}, 31);
  for (int parts : {1, 3}) {
    for (int size : {1, 2, 3, 4}) {
      ShardSpec spec;
      spec.dim = 0;
      spec.parts = parts;
      spec.full = parts == 1 ? 11 : 12;  // 11 rows: padding for 2, 3 and 4 ranks
      const int64_t unit = static_cast<int64_t>(parts) * size;
      spec.padded = (spec.full + unit - 1) / unit * unit;
      const at::Tensor full = x.narrow(0, 0, spec.full);
      std::vector<at::Tensor> shards;
      for (int r = 0; r < size; ++r) shards.push_back(shard_of(full, spec, r, size));
      EXPECT_TRUE(at::equal(join_shards(shards, spec), full)) << "parts " << parts << ", " << size << " ranks";
    }
  }
  ShardSpec replicated;
  EXPECT_TRUE(at::equal(join_shards({x, x}, replicated), x));
  EXPECT_NE(testing_util::error_of([&] { join_shards({x, x.narrow(0, 0, 6)}, replicated); }).find("shards of shapes"),
            std::string::npos);
  EXPECT_EQ(to_text(shard_spec_from_text("1:3:97:98", "test")), "1:3:97:98");
}

TEST(TensorParallelLayers, ScatterAndGatherAreInverse) {
  if (world_comm().size() < 2) GTEST_SKIP();
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    at::Tensor x = same_everywhere({2, 3, 4 * T}, 3).requires_grad_(true);
    at::Tensor y = gather_from_tensor_parallel(scatter_to_tensor_parallel(x, mesh.tp()), mesh.tp());
    EXPECT_TRUE(at::equal(y, x));
    at::Tensor probe = same_everywhere({2, 3, 4 * T}, 4);
    (y * probe).sum().backward();
    EXPECT_LT(rel_error(x.grad(), probe), kTol);
  }
}

TEST(TensorParallelLayers, VocabParallelEmbeddingWithAVocabularyThatDoesNotDivide) {
  if (world_comm().size() < 2) GTEST_SKIP();
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    auto& tp = mesh.tp();
    const int64_t V = 4 * T + 1;  // never divisible by T
    torch::manual_seed(9);
    VocabParallelEmbedding emb(V, 6, tp);
    emb->to(at::kDouble);
    EXPECT_EQ(emb->padded_vocab % T, 0);
    auto full = gather_full_state(*emb, tp)["weight"];
    ASSERT_EQ(full.size(0), V);
    at::Tensor ids = at::remainder(at::arange(3 * V, at::kLong) * 2, V).view({3, V});
    at::Tensor wr = full.clone().requires_grad_(true);
    at::Tensor y = emb->forward(ids);
    at::Tensor yr = at::embedding(wr, ids);
    EXPECT_LT(rel_error(y, yr), kTol);
    at::Tensor probe = same_everywhere(yr.sizes().vec(), 21);
    (y * probe).sum().backward();
    (yr * probe).sum().backward();
    EXPECT_LT(rel_error(emb->weight.grad(), shard_of(wr.grad(), emb->shard_specs()["weight"], tp.rank(), T)), kTol);
  }
}

TEST(TensorParallelLayers, VocabParallelCrossEntropyNeverGathersTheLogits) {
  if (world_comm().size() < 2) GTEST_SKIP();
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    auto& tp = mesh.tp();
    // A vocabulary that does not divide, and one so small that the last shard is all padding
    // (T = 2: vocabulary 1 in shards of 1; T = 4: vocabulary 5 in shards of 2).
    for (int64_t V : {int64_t{5} * T - 1, T == 2 ? int64_t{1} : int64_t{T} + 1}) {
      const int64_t N = 7;
      const int64_t padded = (V + T - 1) / T * T, local = padded / T;
      at::Tensor logits = same_everywhere({N, V}, 31);
      at::Tensor targets = at::remainder(at::arange(N, at::kLong) * 3 + 1, V);
      ShardSpec spec{1, 1, V, padded};
      at::Tensor mine = shard_of(logits, spec, tp.rank(), T).clone().requires_grad_(true);
      // Padding columns hold garbage: they must be ignored.
      {
        torch::NoGradGuard ng;
        for (int64_t c = 0; c < local; ++c) {
          if (local * tp.rank() + c >= V) mine.select(1, c).fill_(50.0);
        }
      }
      at::Tensor loss = vocab_parallel_cross_entropy(mine, targets, local * tp.rank(), V, tp);
      at::Tensor ref_logits = logits.clone().requires_grad_(true);
      at::Tensor ref = torch::nn::functional::cross_entropy(ref_logits, targets);
      ASSERT_TRUE(std::isfinite(loss.item<double>())) << "T=" << T << " V=" << V;
      EXPECT_LT(rel_error(loss, ref), kTol) << "T=" << T << " V=" << V;
      loss.backward();
      ref.backward();
      at::Tensor want = shard_of(ref_logits.grad(), spec, tp.rank(), T);
      EXPECT_LT(rel_error(mine.grad(), want), kTol) << "T=" << T << " V=" << V;
    }
  }
}

TEST(TensorParallelLayers, ParallelSelfAttentionMatchesFullAttention) {
  if (world_comm().size() < 2) GTEST_SKIP();
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    auto& tp = mesh.tp();
    const int64_t d = 8 * T, H = 2 * T;
    torch::manual_seed(13);
    ParallelSelfAttention attn(d, H, /*causal=*/true, tp);
    attn->to(at::kDouble);
    auto full = gather_full_state(*attn, tp);
    at::Tensor x = same_everywhere({2, 5, d}, 41).requires_grad_(true);
    at::Tensor xr = x.detach().clone().requires_grad_(true);
    at::Tensor wqkv = full["qkv.weight"].clone().requires_grad_(true);
    at::Tensor bqkv = full["qkv.bias"].clone().requires_grad_(true);
    at::Tensor wo = full["proj.weight"].clone().requires_grad_(true);
    at::Tensor bo = full["proj.bias"].clone().requires_grad_(true);
    // The unsplit computation, written out.
    auto qkv = at::linear(xr, wqkv, bqkv).chunk(3, -1);
    auto heads = [&](const at::Tensor& t) { return t.view({2, 5, H, d / H}).transpose(1, 2); };
    at::Tensor a = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, 0.0, true);
    at::Tensor yr = at::linear(a.transpose(1, 2).reshape({2, 5, d}), wo, bo);
    at::Tensor y = attn->forward(x);
    EXPECT_LT(rel_error(y, yr), kTol) << "T=" << T;
    at::Tensor probe = same_everywhere({2, 5, d}, 42);
    (y * probe).sum().backward();
    (yr * probe).sum().backward();
    EXPECT_LT(rel_error(x.grad(), xr.grad()), kTol);
    auto specs = collect_shard_specs(*attn);
    EXPECT_LT(rel_error(attn->qkv->weight.grad(), shard_of(wqkv.grad(), specs["qkv.weight"], tp.rank(), T)), kTol);
    EXPECT_LT(rel_error(attn->qkv->bias.grad(), shard_of(bqkv.grad(), specs["qkv.bias"], tp.rank(), T)), kTol);
    EXPECT_LT(rel_error(attn->proj->weight.grad(), shard_of(wo.grad(), specs["proj.weight"], tp.rank(), T)), kTol);
    EXPECT_LT(rel_error(attn->proj->bias.grad(), bo.grad()), kTol);
  }
}

struct TinyModel : torch::nn::Module {
  TinyModel(dist::Communicator& tp) {
    emb = register_module("emb", VocabParallelEmbedding(13, 4 * tp.size(), tp));
    attn = register_module("attn", ParallelSelfAttention(4 * tp.size(), 2 * tp.size(), true, tp));
    mlp = register_module("mlp", ParallelMlp(4 * tp.size(), 8 * tp.size(), tp));
  }
  VocabParallelEmbedding emb{nullptr};
  ParallelSelfAttention attn{nullptr};
  ParallelMlp mlp{nullptr};
};

TEST(TensorParallelLayers, SplitThenGatherReturnsTheOriginalWeightsBitForBit) {
  if (world_comm().size() < 2) GTEST_SKIP();
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    torch::manual_seed(1);
    TinyModel split(mesh.tp());
    // A full state with fresh random values (as from an unsplit checkpoint).
    auto shapes = gather_full_state(split, mesh.tp());
    std::map<std::string, at::Tensor> original;
    uint64_t seed = 100;
    for (auto& [name, t] : shapes) original[name] = same_everywhere(t.sizes().vec(), seed++).to(at::kFloat);
    load_full_state(split, original, mesh.tp());
    auto back = gather_full_state(split, mesh.tp());
    ASSERT_EQ(back.size(), original.size());
    for (auto& [name, t] : original) EXPECT_TRUE(at::equal(back.at(name), t)) << name << " T=" << T;
    // A missing name or a wrong shape is refused.
    auto wrong = original;
    wrong.begin()->second = at::zeros({1});
    EXPECT_THROW(load_full_state(split, wrong, mesh.tp()), Error);
  }
}

TEST(TensorParallelLayers, SizesThatDoNotDivideAreRefusedWithTheNumbers) {
  if (world_comm().size() < 2) GTEST_SKIP();
  dist::Mesh mesh(world_comm(), 2);
  try {
    ParallelSelfAttention a(12, 3, true, mesh.tp());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--heads=3 does not divide over --tp=2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ParallelMlp(8, 7, mesh.tp()), Error);
  EXPECT_THROW(RowParallelLinear(ParallelLinearOptions(7, 4), mesh.tp()), Error);
}

TEST(TensorParallelLayers, GradNormCountsShardsOnceAcrossTheGroup) {
  if (world_comm().size() < 2) GTEST_SKIP();
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    // A sharded parameter whose slice on rank r has gradient r+1 everywhere (3 elements),
    // and a replicated one with gradient 2 (4 elements) on every rank.
    at::Tensor s = at::zeros({3}, at::kDouble).requires_grad_(true);
    at::Tensor r = at::zeros({4}, at::kDouble).requires_grad_(true);
    s.mutable_grad() = at::full({3}, mesh.tp_rank() + 1.0, at::kDouble);
    r.mutable_grad() = at::full({4}, 2.0, at::kDouble);
    GradNormLayout layout;
    layout.sharded = {true, false};
    layout.tp = &mesh.tp();
    at::Tensor n = global_grad_norm({s, r}, layout);
    double sq = 16.0;
    for (int k = 1; k <= T; ++k) sq += 3.0 * k * k;
    EXPECT_NEAR(n.item<double>(), std::sqrt(sq), 1e-5);
  }
}

}  // namespace
}  // namespace dtrain::engine
