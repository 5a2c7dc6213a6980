// A model of the test's own (not one of the library's), declared only as a plain module and its
// ModelSpec, gets every technique from the Trainer: ZeRO-3 units, pipeline stages, tensor
// parallelism, activation checkpointing and layer offload, alone and combined, and follows its
// one-rank run step for step (float64: to 1e-10). Runs at 1, 2 and 4 ranks with the layouts
// each world size has.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/train/trainer.h"
#include "spec_curve_cases.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::world_comm;

constexpr int64_t kVocab = 23, kModel = 8, kSeq = 6, kLayers = 4, kRows = 8;

// A residual MLP block: x + mlp(norm(x)), its MLP split over the tensor-parallel group.
struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl(dist::Communicator& tp) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    mlp = register_module("mlp", ParallelMlp(kModel, 4 * kModel, tp));
  }
  at::Tensor forward(const at::Tensor& x) {
    ++calls;  // the test checks that checkpointing recomputes
    return x + mlp->forward(norm->forward(x));
  }
  int64_t calls = 0;
  torch::nn::LayerNorm norm{nullptr};
  ParallelMlp mlp{nullptr};
};
TORCH_MODULE(TinyBlock);

// A small decoder: token embedding (vocabulary-parallel) and positions, the blocks, a final
// norm and a vocabulary-parallel head with its cross-entropy. Nothing in it knows about units,
// stages, streaming or checkpointing.
struct TinyDecoderImpl : torch::nn::Module {
  explicit TinyDecoderImpl(dist::Communicator& comm) : tp(&comm) {
    embed = register_module("embed", VocabParallelEmbedding(kVocab, kModel, comm));
    positions = register_module("positions", torch::nn::Embedding(kSeq, kModel));
    blocks = register_module("blocks", BlockStack());
    for (int i = 0; i < kLayers; ++i) blocks->push_back(TinyBlock(comm));
    final_norm = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    ParallelLinearOptions o(kModel, kVocab);
    o.bias = false;
    o.pad_output = true;
    head = register_module("head", ColumnParallelLinear(o, comm));
  }
  // The batch's field 0 holds [rows, kSeq + 1] tokens: inputs and, shifted by one, targets.
  at::Tensor pre(const Batch& b) {
    at::Tensor tokens = b.fields[0].narrow(1, 0, kSeq);
    return embed->forward(tokens) + positions->forward(at::arange(kSeq, tokens.options()));
  }
  at::Tensor post(const at::Tensor& h, const Batch& b) {
    at::Tensor logits = head->forward(final_norm->forward(h));
    const int64_t local = logits.size(-1);
    return vocab_parallel_cross_entropy(logits.reshape({-1, local}), b.fields[0].narrow(1, 1, kSeq).reshape({-1}),
                                        local * tp->rank(), kVocab, *tp);
  }
  at::Tensor forward(const at::Tensor& tokens) { return post(blocks->forward(pre({{tokens}})), {{tokens}}); }
  dist::Communicator* tp;
  VocabParallelEmbedding embed{nullptr};
  torch::nn::Embedding positions{nullptr};
  BlockStack blocks{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
  ColumnParallelLinear head{nullptr};
};

ModelSpec spec_of(const std::shared_ptr<TinyDecoderImpl>& m) {
  ModelSpec s;
  s.module = m;
  s.blocks = m->blocks;
  s.blocks_prefix = "blocks.";
  s.pre = [m](const Batch& b) { return m->pre(b); };
  s.post = [m](const at::Tensor& h, const Batch& b) { return m->post(h, b); };
  s.pre_modules = {"embed", "positions"};
  s.post_modules = {"final_norm", "head"};
  s.activation_shape = [](int64_t rows) { return std::vector<int64_t>{rows, kSeq, kModel}; };
  s.activation_dtype = at::kDouble;
  return s;
}

struct Layout {
  int tp = 1, pp = 1;
  std::string shard = "none";
  bool checkpoint = false, layers = false;
  int chunks = 1;  // > 1: the interleaved schedule, each stage's blocks in that many chunks
  int checkpoint_blocks = -1;  // with checkpoint: the first N of each stage's blocks (-1: all)
  std::string name() const {
    return "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " --shard=" + shard +
           (checkpoint ? " checkpointed" : "") +
           (checkpoint_blocks >= 0 ? " --checkpoint_blocks=" + std::to_string(checkpoint_blocks) : "") +
           (layers ? " --offload=layers" : "") +
           (chunks > 1 ? " interleaved x " + std::to_string(chunks) : "");
  }
};

// The loss of every step of 4 steps on the same global batches (kRows rows), with `layout`.
std::vector<double> curve(dist::Communicator& comm, const Layout& layout) {
  dist::Mesh mesh(comm, layout.tp, layout.pp);
  torch::manual_seed(11);
  auto model = std::make_shared<TinyDecoderImpl>(mesh.tp());
  ModelSpec spec = spec_of(model);
  ModelTechniques split;
  split_pipeline_stage(spec, mesh.pp_rank(), mesh.pp_size(), "", split, layout.chunks);  // before the weights move
  model->to(at::kDouble);
  TrainerOptions o = spec_curve_cases::curve_options(layout.shard, layout.checkpoint, layout.pp);
  o.offload_layers = layout.layers;
  o.checkpoint_blocks = layout.checkpoint_blocks;
  if (layout.chunks > 1) {
    // Stage s keeps virtual stages s and s + P of the 2P: blocks {s} and {s + 2} at P 2.
    EXPECT_EQ(spec.blocks->size(), 2u);
    EXPECT_EQ(spec.blocks->index(0), mesh.pp_rank());
    EXPECT_EQ(spec.blocks->index(1), mesh.pp_rank() + 2);
    o.pipeline.schedule = PipelineSchedule::kInterleaved;
    o.pipeline.chunks = layout.chunks;
  }
  const std::vector<double> losses = spec_curve_cases::fit_token_windows(spec, mesh, o, kVocab, kSeq, kRows);
  // The techniques ran: checkpointing recomputes each block in backward (one more forward per
  // micro-batch; layer offload recomputes too), or only the first checkpoint_blocks of the
  // stage's; ZeRO-3 keeps no unit's weights between steps.
  const size_t n = spec.blocks->size();
  for (size_t b : {size_t{0}, n - 1}) {
    const bool recomputed =
        layout.layers || (layout.checkpoint && (layout.checkpoint_blocks < 0 || b < static_cast<size_t>(layout.checkpoint_blocks)));
    EXPECT_EQ(spec.blocks->block(b)->as<TinyBlockImpl>()->calls, o.steps * o.accum_steps * (recomputed ? 2 : 1))
        << "forwards of the stage's block " << b;
  }
  auto* first = spec.blocks->block(0)->as<TinyBlockImpl>();
  if (layout.shard == "parameters" && mesh.dp_size() > 1) {
    EXPECT_EQ(first->mlp->fc1->weight.storage().nbytes(), 0u) << "a unit's weights stayed gathered after the step";
  }
  return losses;
}

TEST(ModelSpec, APlainModelGetsEveryTechniqueAndFollowsItsOneRankRun) {
  auto& comm = world_comm();
  // The reference: one rank alone (this rank's own communicator of one).
  const std::vector<double> want = spec_curve_cases::one_rank_curve(curve, Layout{});
  ASSERT_EQ(want.size(), 4u);
  EXPECT_LT(want.back(), want.front()) << "the loss does not fall";
  std::vector<Layout> layouts = {
      {1, 1, "none", true, false}, {1, 1, "none", false, true}, {1, 1, "parameters", false, false},
      {1, 1, "parameters", true, false}, {1, 1, "optimizer", false, false},
      {1, 1, "none", true, false, 1, 2}, {1, 1, "parameters", true, false, 1, 1}};
  const int W = comm.size();
  if (W % 2 == 0) {
    layouts.push_back({2, 1, "none", false, false});
    layouts.push_back({2, 1, "none", true, false});
    layouts.push_back({1, 2, "none", false, false});
    layouts.push_back({1, 2, "none", true, false});
    layouts.push_back({1, 2, "none", false, true});
    layouts.push_back({1, 2, "none", false, false, 2});  // interleaved (x dp W / 2)
    layouts.push_back({1, 1, "parameters", true, false});  // dp W
    layouts.push_back({1, 2, "none", true, false, 1, 1});  // each stage's first block recomputed
  }
  if (W % 4 == 0) {
    layouts.push_back({2, 2, "none", false, false});
    layouts.push_back({2, 1, "parameters", false, false});  // tp 2 x dp 2
    layouts.push_back({1, 2, "parameters", false, false});  // pp 2 x dp 2
    layouts.push_back({2, 2, "none", true, false});
    layouts.push_back({2, 1, "none", true, true});
    layouts.push_back({2, 2, "none", true, false, 2});  // interleaved x tp 2, checkpointed
  }
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(layout.name() + " on " + std::to_string(W) + " rank(s)");
    spec_curve_cases::expect_same_curve(curve(comm, layout), want);
  }
}

TEST(ModelSpec, AnInconsistentSpecIsNamed) {
  std::unique_ptr<dist::Communicator> alone = testing_util::alone_comm();
  dist::Mesh mesh(*alone, 1);
  auto model = std::make_shared<TinyDecoderImpl>(mesh.tp());
  ModelSpec s = spec_of(model);
  s.blocks_prefix = "layers.";
  EXPECT_NE(testing_util::error_of([&] { validate(s); }).find("registered as 'blocks' in module, but blocks_prefix is"),
            std::string::npos);
  s = spec_of(model);
  s.post_modules = {"lm_head"};
  EXPECT_NE(testing_util::error_of([&] { validate(s); }).find("'lm_head' in post_modules is not a direct child"),
            std::string::npos);
  s = spec_of(model);
  s.post_modules = {"head"};  // final_norm left out: ZeRO-3 would never gather it
  TrainerOptions o;
  o.shard = "parameters";
  o.progress = false;
  o.oom_backoff = false;
  EXPECT_NE(testing_util::error_of([&] { Trainer t(s, mesh, c10::Device(c10::kCPU), o); })
                .find("'final_norm.weight' belongs to no piece of the model"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
