// The Llama model (models/llama.h) split over tensor-parallel groups of 2 and 4 ranks, with and
// without sequence parallelism and tied embeddings, against the same model on one rank in
// float64: the same initial full weights, logits, loss and every gradient (the shards
// gathered). And the model trained through the Trainer from llama_spec() with tensor
// parallelism, pipeline stages, ZeRO-3, activation checkpointing and context parallelism (alone,
// beside dp, with tp and pp), following its one-rank run
// step for step (float64: to 1e-10, as tests/mpi/model_spec_test.cc). Runs at 2 and 4 ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/train/trainer.h"
#include "model_cases.h"
#include "spec_curve_cases.h"
#include "test_util.h"

namespace dtrain::engine::llama_mpi_cases {
namespace {

using spec_curve_cases::expect_same_curve;
using testing_util::rel_error;
using testing_util::world_comm;

constexpr double kTol = 1e-10;

// The split tests' model (model_cases.h) with 8 positions.
LlamaOptions split_options(bool sequence_parallel, bool tied) {
  return model_cases::split_llama_options(8, sequence_parallel, tied);
}

// The full (unsplit) value of a parameter or its gradient on this rank's group.
at::Tensor full_of(const std::string& name, const at::Tensor& local, const std::map<std::string, ShardSpec>& specs,
                   dist::Communicator& tp) {
  auto it = specs.find(name);
  return it == specs.end() ? local.detach().clone() : gather_full_tensor(local.detach(), it->second, tp);
}

void check_split_model(int T, bool sp, bool tied) {
  SCOPED_TRACE("tp " + std::to_string(T) + (sp ? " sequence-parallel" : "") + (tied ? " tied" : ""));
  auto& comm = world_comm();
  std::unique_ptr<dist::Communicator> alone = testing_util::alone_comm();
  dist::Mesh mesh(comm, T);
  auto& tp = mesh.tp();
  torch::manual_seed(21);
  LlamaImpl ref(split_options(false, tied), *alone);
  torch::manual_seed(21);
  LlamaImpl model(split_options(sp, tied), tp);
  ref.to(at::kDouble);
  model.to(at::kDouble);
  // Any group size draws the same initial full weights.
  const auto specs = collect_shard_specs(model);
  for (auto& item : model.named_parameters()) {
    EXPECT_TRUE(at::equal(full_of(item.key(), item.value(), specs, tp), ref.named_parameters()[item.key()]))
        << item.key();
  }
  // Norm weights other than 1, the same on every rank; then the reference's weights everywhere.
  model_cases::draw_norm_weights(ref, 4);
  model_cases::load_reference_weights(ref, model, tp);
  auto g = at::make_generator<at::CPUGeneratorImpl>(8);
  at::Tensor windows = at::randint(51, {3, 9}, g, at::kLong);
  at::Tensor inputs = windows.narrow(1, 0, 8), targets = windows.narrow(1, 1, 8);
  at::Tensor want_logits = ref.forward(inputs);
  at::Tensor logits = model.forward(inputs);
  at::Tensor got_logits = model_cases::gather_logits(logits, 51, tp);
  EXPECT_LT(rel_error(got_logits, want_logits), kTol) << "logits";
  at::Tensor want_loss = ref.loss(inputs, targets), loss = model.loss(inputs, targets);
  EXPECT_NEAR(loss.item<double>(), want_loss.item<double>(), kTol * want_loss.item<double>());
  want_loss.backward();
  loss.backward();
  double worst = 0;
  for (auto& item : model.named_parameters()) {
    const at::Tensor want = ref.named_parameters()[item.key()].grad();
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    const double e = rel_error(full_of(item.key(), item.value().grad(), specs, tp), want);
    EXPECT_LT(e, kTol) << item.key();
    worst = std::max(worst, e);
  }
  if (comm.rank() == 0) {
    std::cout << "[ llama    ] tp " << T << (sp ? " sp" : "") << (tied ? " tied" : "") << ": logits rel "
              << rel_error(got_logits, want_logits) << ", loss |diff| " << std::abs(loss.item<double>() - want_loss.item<double>())
              << ", worst gradient rel " << worst << "\n";
  }
}

TEST(LlamaMpi, TensorParallelEqualsOneRankInFloat64) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int T : testing_util::tp_group_sizes()) {
    for (bool sp : {false, true}) {
      for (bool tied : {false, true}) check_split_model(T, sp, tied);
    }
  }
}

TEST(LlamaMpi, HeadsThatDoNotSplitAreNamed) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  dist::Mesh mesh(world_comm(), 2);
  LlamaOptions o = split_options(false, false);
  o.kv_heads = 1;  // multi-query: one key/value head cannot split over 2 ranks
  const std::string e = testing_util::error_of([&] { LlamaImpl m(o, mesh.tp()); });
  EXPECT_NE(e.find("--heads=8 and --kv_heads=1 must both divide over --tp=2"), std::string::npos) << e;
  EXPECT_NE(e.find("choose a --tp dividing the key/value head count 1"), std::string::npos) << e;
}

// ---- through the Trainer ------------------------------------------------------------------

constexpr int64_t kSeq = 8, kVocab = 23, kRows = 8;

struct Layout {
  int tp = 1, pp = 1;
  std::string shard = "none";
  bool checkpoint = false, sp = false, tied = false;
  int cp = 1;
  std::string name() const {
    return "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + (cp > 1 ? " cp " + std::to_string(cp) : "") +
           " --shard=" + shard + (checkpoint ? " checkpointed" : "") + (sp ? " sequence-parallel" : "") +
           (tied ? " tied" : "");
  }
};

// The loss of each of 4 steps on the same global batches (kRows rows), with `layout`.
std::vector<double> curve(dist::Communicator& comm, const Layout& layout) {
  dist::Mesh mesh(comm, layout.tp, layout.pp, layout.cp);
  LlamaOptions lo;
  lo.vocab = kVocab;
  lo.d_model = 16;
  lo.heads = 4;
  lo.kv_heads = 2;
  lo.ff = 32;
  lo.seq_len = kSeq;
  lo.layers = 4;
  lo.init_std = 0.2;
  lo.sequence_parallel = layout.sp;
  lo.tie_embeddings = layout.tied;
  torch::manual_seed(11);
  auto model = std::make_shared<LlamaImpl>(lo, mesh.tp(), &mesh.cp());
  model->to(at::kDouble);  // before llama_spec: the stage activations are float64
  ModelSpec spec = llama_spec(model);
  EXPECT_EQ(spec.activation_dtype, at::kDouble);
  ModelTechniques split;
  split_pipeline_stage(spec, mesh.pp_rank(), mesh.pp_size(), "", split);
  const TrainerOptions o = spec_curve_cases::curve_options(layout.shard, layout.checkpoint, layout.pp);
  return spec_curve_cases::fit_token_windows(spec, mesh, o, kVocab, kSeq, kRows);
}

TEST(LlamaMpi, TrainsThroughTheTrainerLikeItsOneRankRun) {
  auto& comm = world_comm();
  const std::vector<double> want = spec_curve_cases::one_rank_curve(curve, Layout{});
  ASSERT_EQ(want.size(), 4u);
  EXPECT_LT(want.back(), want.front()) << "the loss does not fall";
  std::vector<Layout> layouts;
  const int W = comm.size();
  if (W % 2 == 0) {
    layouts.push_back({2, 1, "none", false, false});
    layouts.push_back({2, 1, "none", true, true});
    layouts.push_back({1, 2, "none", false, false});
    layouts.push_back({1, 1, "parameters", false, false});  // ZeRO-3 over dp W
    layouts.push_back({1, 1, "parameters", true, false});
  }
  if (W % 4 == 0) {
    layouts.push_back({2, 2, "none", true, false});
    layouts.push_back({2, 1, "parameters", false, true});  // tp 2 x dp 2
    layouts.push_back({1, 2, "parameters", true, false});  // pp 2 x dp 2
  }
  // Context parallelism: the weights' gradients averaged over dp x cp, ZeRO's shards split over
  // them, composed with tp (sequence-parallel), pp, activation checkpointing.
  if (W % 2 == 0) {
    layouts.push_back({1, 1, "none", false, false, false, 2});
    layouts.push_back({1, 1, "parameters", true, false, false, 2});  // ZeRO-3 over the cp replicas
  }
  if (W % 4 == 0) {
    layouts.push_back({1, 1, "none", false, false, false, 4});
    layouts.push_back({1, 1, "optimizer", false, false, false, 2});  // dp 2 x cp 2
    layouts.push_back({2, 1, "none", true, true, false, 2});         // tp 2 x cp 2, sequence-parallel
    layouts.push_back({1, 2, "gradients", false, false, false, 2});  // pp 2 x cp 2
  }
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(layout.name() + " on " + std::to_string(W) + " rank(s)");
    const double worst = expect_same_curve(curve(comm, layout), want);
    if (comm.rank() == 0) std::cout << "[ llama    ] " << layout.name() << ": worst step loss rel " << worst << "\n";
  }
}

// A head tied to the embedding (Llama 3.2 1B and 3B): the tensor-parallel layers split the one
// tensor alike for both uses, so tp and dp train it as one rank does; pipeline stages and
// ZeRO-3's units, which would own the two uses apart, are refused with the reason.
TEST(LlamaMpi, TiedEmbeddingsTrainWithTensorParallelismLikeOneRank) {
  auto& comm = world_comm();
  if (comm.size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  Layout one;
  one.tied = true;
  const std::vector<double> want = spec_curve_cases::one_rank_curve(curve, one);
  ASSERT_EQ(want.size(), 4u);
  std::vector<Layout> layouts(3, one);
  layouts[0].tp = 2;
  layouts[1].tp = 2;
  layouts[1].sp = true;
  layouts[1].checkpoint = true;
  layouts[2].shard = "optimizer";  // ZeRO-1 over dp W
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(layout.name() + " on " + std::to_string(comm.size()) + " rank(s)");
    expect_same_curve(curve(comm, layout), want);
  }
  Layout pp = one, zero3 = one;
  pp.pp = 2;
  zero3.shard = "parameters";
  EXPECT_NE(testing_util::error_of([&] { curve(comm, pp); }).find("tied parameters ('head.weight' is 'embed.weight') "
                                                                "with --pp > 1"),
            std::string::npos);
  EXPECT_NE(testing_util::error_of([&] { curve(comm, zero3); }).find("with --shard=parameters"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine::llama_mpi_cases
