// Recomputing only some blocks (--checkpoint_blocks, ModelTechniques::checkpoint_blocks): the
// library's GPT gives the plain step's loss and gradients bit for bit for every count; its
// memory, measured by the CPU's counting allocator, falls block by block as the planner
// estimates it from the two probed fits (off and on); the planner chooses the fewest recomputed
// blocks that fit a budget; the simulator prices the recompute and the memory in between, and
// its search recomputes no more blocks than it must.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/planner.h"
#include "dtrain/engine/memory/simulator.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/model_spec.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

constexpr int kBlocks = 4;
constexpr int64_t kVocab = 97, kSeq = 16;

struct TinyGpt {
  std::unique_ptr<dist::Communicator> tp = testing_util::local_comm();
  std::shared_ptr<GptImpl> model;
  std::unique_ptr<AppliedModel> applied;
};

std::unique_ptr<TinyGpt> tiny_gpt(at::ScalarType dtype) {
  auto g = std::make_unique<TinyGpt>();
  GptOptions o;
  o.vocab = kVocab, o.d_model = 32, o.heads = 4, o.ff = 128, o.seq_len = kSeq, o.layers = kBlocks;
  torch::manual_seed(3);
  g->model = std::make_shared<GptImpl>(o, *g->tp);
  g->model->to(dtype);
  g->model->train();
  ModelTechniques t;
  g->applied = std::make_unique<AppliedModel>(gpt_spec(g->model), t);
  return g;
}

Batch token_rows(int64_t rows) {
  Batch b;
  b.fields.push_back(at::randint(kVocab, {rows, kSeq + 1}, at::kLong));
  return b;
}

std::vector<at::Tensor> gradients_of(TinyGpt& g, const Batch& batch) {
  for (at::Tensor& p : g.model->parameters()) p.mutable_grad() = at::Tensor();
  g.applied->loss(batch).backward();
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : g.model->parameters()) out.push_back(p.grad().clone());
  return out;
}

TEST(CheckpointBlocks, EveryCountGivesThePlainStepsGradientsBitForBit) {
  auto g = tiny_gpt(at::kDouble);
  torch::manual_seed(4);
  const Batch batch = token_rows(3);
  g->applied->set_checkpoint_activations(false);
  const std::vector<at::Tensor> plain = gradients_of(*g, batch);
  for (int k : {0, 1, 2, 3, 4, -1}) {
    g->applied->set_checkpoint_activations(true, k);
    const std::vector<at::Tensor> got = gradients_of(*g, batch);
    ASSERT_EQ(got.size(), plain.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i], plain[i])) << "checkpoint_blocks=" << k << ", parameter " << i;
    }
  }
}

TEST(CheckpointBlocks, MoreBlocksThanTheModelHasIsAClearError) {
  auto g = tiny_gpt(at::kFloat);
  try {
    g->applied->set_checkpoint_activations(true, 5);
    ADD_FAILURE() << "5 of 4 blocks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--checkpoint_blocks=5 is more blocks than the 4 of the model; give at most 4"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(g->applied->set_checkpoint_activations(true, -2), Error);
  ModelTechniques t;
  t.checkpoint_activations = true;
  t.checkpoint_blocks = 9;
  EXPECT_THROW(AppliedModel(gpt_spec(g->model), t), Error);
}

PlanInputs tiny_inputs(TinyGpt& g, int64_t batch) {
  PlanInputs in;
  for (const at::Tensor& p : g.model->parameters()) in.parameters += p.numel();
  in.layers = kBlocks;
  in.batch_size = batch;
  in.cuda_context_bytes = 0;
  return in;
}

// The probe's loss function with the first `k` blocks recomputed whatever the probe asks.
ProbeLossFn with_blocks(TinyGpt& g, int k) {
  return [&g, k](int64_t rows, bool checkpoint) {
    g.applied->set_checkpoint_activations(k == 0 ? checkpoint : true, k == 0 ? -1 : k);
    return g.applied->loss(token_rows(rows));
  };
}

TEST(CheckpointBlocks, MemoryFallsBlockByBlockAsThePlannerEstimates) {
  track_cpu_memory();
  const c10::Device cpu(c10::kCPU);
  auto g = tiny_gpt(at::kFloat);
  torch::manual_seed(5);
  // The planner's profile: checkpointing off and on (every block), at 2 and 4 rows.
  ProbeOptions po;
  const ActivationProfile profile = probe_activations(with_blocks(*g, 0), g->model->parameters(), cpu, po);
  constexpr int64_t kRows = 8;
  const PlanInputs in = tiny_inputs(*g, kRows);
  const int64_t off = profile.find(false, AmpMode::kOff)->bytes(kRows);
  const int64_t on = profile.find(true, AmpMode::kOff)->bytes(kRows);
  int64_t previous = off;
  for (int k = 1; k < kBlocks; ++k) {
    // Measured: a probe of the model with k blocks recomputed, at the batch itself.
    ProbeOptions measure;
    measure.rows_small = kRows / 2;
    measure.rows_large = kRows;
    measure.techniques = {{false, AmpMode::kOff}};
    const int64_t measured =
        probe_activations(with_blocks(*g, k), g->model->parameters(), cpu, measure).fits[0].peak_bytes[1];
    Technique t;
    t.checkpoint = true;
    t.checkpoint_blocks = k;
    const int64_t estimated = estimate(in, profile, t).gpu.activations;
    std::printf("checkpoint_blocks=%d: measured %.1f KiB, estimated %.1f KiB (off %.1f, on %.1f)\n", k,
                measured / 1024.0, estimated / 1024.0, off / 1024.0, on / 1024.0);
    EXPECT_LT(measured, previous) << "k=" << k;
    EXPECT_GT(measured, on) << "k=" << k;
    EXPECT_NEAR(static_cast<double>(estimated), static_cast<double>(measured), 0.03 * measured) << "k=" << k;
    previous = measured;
  }
}

// A profile whose lines are given: off holds 80 and peaks at 100 MiB a row, on holds 20 and
// peaks at 40; one second a row with checkpointing off.
ActivationProfile given_profile() {
  constexpr double kMiB = 1 << 20;
  ActivationProfile p;
  for (bool on : {false, true}) {
    ActivationFit f;
    f.checkpoint = on;
    f.rows[0] = 2, f.rows[1] = 4;
    f.bytes_per_row = (on ? 40 : 100) * kMiB;
    f.held_bytes_per_row = (on ? 20 : 80) * kMiB;
    f.seconds[0] = 2 * (on ? 4.0 / 3 : 1), f.seconds[1] = 4 * (on ? 4.0 / 3 : 1);
    p.fits.push_back(f);
  }
  return p;
}

// A model of kBlocks alike blocks, 4 rows a step, beside given_profile().
PlanInputs given_inputs() {
  PlanInputs in;
  in.parameters = 1000;
  in.layers = kBlocks;
  in.uniform_blocks = true;
  in.batch_size = 4;
  in.cuda_context_bytes = 0;
  return in;
}

TEST(CheckpointBlocks, PlannerEstimatesEachCountFromTheTwoFits) {
  const ActivationProfile profile = given_profile();
  PlanInputs in = given_inputs();
  constexpr int64_t kMiB = 1 << 20;
  // Each block saves (80 - 20) / 4 = 15 MiB a row of the off fit's 100; never below on's 40.
  for (int k : {0, 1, 2, 3, 4, -1}) {
    Technique t;
    t.checkpoint = k != 0;
    t.checkpoint_blocks = k;
    const int64_t want = 4 * kMiB * (k == 0 ? 100 : k < 0 || k >= 4 ? 40 : 100 - 15 * k);
    EXPECT_EQ(estimate(in, profile, t).gpu.activations, want) << "k=" << k;
  }
  Technique half;
  half.checkpoint = true;
  half.checkpoint_blocks = 2;
  EXPECT_EQ(half.flags(), "--checkpoint_activations --checkpoint_blocks=2");
  EXPECT_NE(half.to_string().find("checkpoint on (the first 2 blocks)"), std::string::npos) << half.to_string();
  // The recompute is priced by the share of the blocks: a third of forward for each block.
  Technique off, all;
  all.checkpoint = true;
  const double s_off = estimate_step_seconds(in, profile, off), s_all = estimate_step_seconds(in, profile, all);
  EXPECT_NEAR(estimate_step_seconds(in, profile, half), (s_off + s_all) / 2, 1e-12);
}

TEST(CheckpointBlocks, PlannerChoosesTheFewestRecomputedBlocksThatFit) {
  const ActivationProfile profile = given_profile();
  PlanInputs in = given_inputs();
  in.accum_candidates = {1};
  Technique two;
  two.checkpoint = true;
  two.checkpoint_blocks = 2;
  in.gpu_budget_bytes = estimate(in, profile, two).gpu.total();  // 1 block does not fit, 2 do
  const Plan plan = choose_plan(in, profile);
  EXPECT_EQ(plan.flags(), "--checkpoint_activations --checkpoint_blocks=2") << plan.reason;
  EXPECT_NE(plan.to_json().find("\"checkpoint_blocks\":2"), std::string::npos) << plan.to_json();
  // Blocks of unequal size, or no blocks' count: only off and every block.
  in.uniform_blocks = false;
  EXPECT_EQ(choose_plan(in, profile).flags(), "--checkpoint_activations");
  in.uniform_blocks = true;
  in.layers = 0;
  EXPECT_EQ(choose_plan(in, profile).flags(), "--checkpoint_activations");
}

TEST(CheckpointBlocks, PipelineStagesTryCountsBelowTheFewestBlocksAStageHolds) {
  const ActivationProfile profile = given_profile();
  PlanInputs in = given_inputs();  // this stage: 4 blocks
  in.pp = 2;
  in.accum_candidates = {2};
  Technique one;
  one.checkpoint = true;
  one.checkpoint_blocks = 1;
  one.accum_steps = 2;
  // 1F1B on stage 0 of 2 holds both micro-batches: the partial held line counts for the other.
  const MemoryEstimate e = estimate(in, profile, one);
  constexpr int64_t kMiB = 1 << 20;
  EXPECT_EQ(e.in_flight, 2);
  EXPECT_EQ(e.gpu.activations, 2 * kMiB * (100 - 15) + 2 * kMiB * (80 - 15)) << "peak and one more held, 2 rows";
  in.gpu_budget_bytes = e.gpu.total();
  // The other stage holds 2 blocks: counts below 2 are tried, and 1 fits.
  in.fewest_stage_layers = 2;
  EXPECT_EQ(choose_plan(in, profile).flags(), "--checkpoint_activations --checkpoint_blocks=1 --accum_steps=2");
  // Not knowing the stages' blocks, or interleaved: only off and every block.
  in.fewest_stage_layers = 0;
  EXPECT_EQ(choose_plan(in, profile).flags(), "--checkpoint_activations --accum_steps=2");
}

sim::ModelShape gpt_shape() {
  sim::ModelShape m;
  m.family = "gpt";
  m.layers = 8, m.d_model = 1024, m.heads = 16, m.ff = 4096, m.vocab = 32000, m.seq_len = 2048;
  return m;
}

sim::Layout one_gpu(bool checkpoint, int blocks) {
  sim::Layout l;
  l.micro_batch_rows = 8;
  l.checkpoint = checkpoint;
  l.checkpoint_blocks = blocks;
  return l;
}

TEST(CheckpointBlocks, SimulatorPricesTheRecomputedBlocksAndTheMemoryBetween) {
  const sim::ModelShape m = gpt_shape();
  sim::Cluster c;  // one H100
  c.gpus_per_node = 1;
  const sim::Prediction off = sim::simulate(m, c, one_gpu(false, -1));
  const sim::Prediction all = sim::simulate(m, c, one_gpu(true, -1));
  const sim::Prediction none = sim::simulate(m, c, one_gpu(true, 0));
  const sim::Prediction every = sim::simulate(m, c, one_gpu(true, 8));
  EXPECT_DOUBLE_EQ(none.step_s, off.step_s);
  EXPECT_EQ(none.device_bytes, off.device_bytes);
  EXPECT_DOUBLE_EQ(every.step_s, all.step_s);
  EXPECT_EQ(every.device_bytes, all.device_bytes);
  const sim::Prediction half = sim::simulate(m, c, one_gpu(true, 4));
  EXPECT_NEAR(half.parts.compute, (off.parts.compute + all.parts.compute) / 2, 1e-12 * off.parts.compute);
  EXPECT_LT(half.device_bytes, off.device_bytes);
  EXPECT_GT(half.device_bytes, all.device_bytes);
  EXPECT_EQ(half.layout.flags(), "--batch_size=8 --checkpoint_activations --checkpoint_blocks=4 --amp=bf16");
  EXPECT_THROW(sim::simulate(m, c, one_gpu(false, 2)), Error);  // the count without checkpointing
  EXPECT_THROW(sim::simulate(m, c, one_gpu(true, 9)), Error);   // more than the model's blocks

  // A device between the two: the search recomputes some blocks, no more than it must.
  c.device.memory_bytes = static_cast<double>(off.device_bytes + all.device_bytes) / 2;
  sim::SearchOptions so;
  so.global_batch_rows = 8;
  so.max_micro_batch_rows = 8;
  so.allow_offload = false;
  const std::vector<sim::Prediction> found = sim::search(m, c, so);
  const sim::Prediction* partial = nullptr;
  for (const sim::Prediction& p : found) {
    if (p.layout.micro_batch_rows == 8 && p.layout.checkpoint && p.layout.zero == 0) {
      partial = &p;
      break;
    }
  }
  ASSERT_NE(partial, nullptr);
  const int k = partial->layout.checkpoint_blocks;
  EXPECT_GT(k, 0);
  EXPECT_LT(k, 8);
  EXPECT_TRUE(sim::simulate(m, c, one_gpu(true, k)).fits);
  EXPECT_FALSE(sim::simulate(m, c, one_gpu(true, k - 1)).fits);
}

}  // namespace
}  // namespace dtrain::engine
