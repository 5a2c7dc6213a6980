// The planner's arithmetic: estimate() against closed forms for every optimizer, dtype,
// offload and tensor-parallel split, and choose_plan()'s choices on synthetic activation
// profiles whose budgets need nothing, accumulation, checkpointing, optimizer offload, or
// cannot be met.
#include "dtrain/engine/memory/planner.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

constexpr int64_t kMB = int64_t{1} << 20;

// A fit with the given line and timings t(rows) = overhead + per_row * rows at rows 1 and 2.
ActivationFit line(bool checkpoint, AmpMode amp, double intercept, double per_row,
                   double overhead_s = 0.005, double per_row_s = 0.010) {
  ActivationFit f;
  f.checkpoint = checkpoint;
  f.amp = amp;
  f.rows[0] = 1;
  f.rows[1] = 2;
  f.peak_bytes[0] = static_cast<int64_t>(intercept + per_row);
  f.peak_bytes[1] = static_cast<int64_t>(intercept + 2 * per_row);
  f.seconds[0] = overhead_s + per_row_s;
  f.seconds[1] = overhead_s + 2 * per_row_s;
  f.intercept_bytes = intercept;
  f.bytes_per_row = per_row;
  return f;
}

// Plain activations 50 MiB per row, checkpointed 10 MiB per row (fp32); bf16 half of each.
ActivationProfile profile() {
  ActivationProfile p;
  p.fits = {line(false, AmpMode::kOff, 0, 50.0 * kMB), line(true, AmpMode::kOff, 0, 10.0 * kMB),
            line(false, AmpMode::kBf16, 0, 25.0 * kMB, 0.005, 0.005),
            line(true, AmpMode::kBf16, 0, 5.0 * kMB, 0.005, 0.005)};
  return p;
}

// 10 Mi fp32 parameters with AdamW: 40 MiB each of parameters and gradients, 80 MiB of state.
PlanInputs inputs() {
  PlanInputs in;
  in.reducer_rebuild = true;  // these closed forms model a loop that keeps old gradients
  in.parameters = 10 * kMB;
  in.bytes_per_parameter = 4;
  in.optimizer = "adamw";
  in.batch_size = 16;
  in.workspace_fraction = 0;
  in.cuda_context_bytes = 0;
  return in;
}

// Sizes in messages: MiB with one decimal below 1 GiB.
std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / kMB);
  return buf;
}

using testing_util::error_of;

TEST(PlannerEstimate, StaticMemoryOfEachOptimizerInClosedForm) {
  struct Case {
    const char* name;
    double momentum;
    bool amsgrad;
    int states;
  };
  const Case cases[] = {{"adam", 0, false, 2},    {"adamw", 0, false, 2}, {"adam", 0, true, 3},
                        {"adagrad", 0, false, 1}, {"sgd", 0.9, false, 1}, {"sgd", 0, false, 0}};
  for (int64_t bpp : {4, 2}) {
    for (const Case& c : cases) {
      PlanInputs in = inputs();
      in.parameters = 1000003;  // odd: no rounding hides an off-by-one
      in.bytes_per_parameter = bpp;
      in.optimizer = c.name;
      in.momentum = c.momentum;
      in.amsgrad = c.amsgrad;
      MemoryEstimate e = estimate(in, profile(), Technique{});
      SCOPED_TRACE(std::string(c.name) + " bytes/param " + std::to_string(bpp));
      EXPECT_EQ(e.gpu.parameters, 1000003 * bpp);
      EXPECT_EQ(e.gpu.gradients, 1000003 * bpp);
      EXPECT_EQ(e.gpu.optimizer_state, 1000003 * bpp * c.states);
      EXPECT_EQ(e.host.total(), 0);
    }
  }
}

// --shard on 4 data-parallel ranks: ZeRO-1 splits the state into ranges of ceil(P / 4) (bf16/fp16
// weights add an fp32 master and an fp32 gradient shard of the range); ZeRO-2
// keeps only its range's gradients between steps, the rest counted as a transient at the end
// of backward, except under accumulation, where they stay whole.
TEST(PlannerEstimate, ShardingStagesInClosedForm) {
  for (int64_t bpp : {4, 2}) {
    SCOPED_TRACE("bytes/param " + std::to_string(bpp));
    PlanInputs in = inputs();
    in.reducer_rebuild = false;
    in.parameters = 1000003;
    in.bytes_per_parameter = bpp;
    in.dp = 4;
    const int64_t range = 250001, master = bpp == 2 ? 4 : bpp;
    Technique t;
    t.shard = 1;
    MemoryEstimate e = estimate(in, profile(), t);
    EXPECT_EQ(e.gpu.parameters, 1000003 * bpp);
    EXPECT_EQ(e.gpu.gradients, 1000003 * bpp);
    EXPECT_EQ(e.gpu.optimizer_state, range * master * 2 + (bpp == 2 ? range * 8 : 0));
    EXPECT_EQ(e.gpu.transient, 0);
    t.shard = 2;
    e = estimate(in, profile(), t);
    EXPECT_EQ(e.gpu.gradients, range * bpp);
    EXPECT_EQ(e.gpu.transient, (1000003 - range) * bpp);
    EXPECT_EQ(e.gpu.optimizer_state, range * master * 2 + (bpp == 2 ? range * 8 : 0));
    t.accum_steps = 2;
    e = estimate(in, profile(), t);
    EXPECT_EQ(e.gpu.gradients, 1000003 * bpp);
    EXPECT_EQ(e.gpu.transient, 0);
    EXPECT_EQ(t.flags(), "--accum_steps=2 --shard=gradients");
  }
  Technique both;
  both.shard = 2;
  both.offload_layers = true;
  PlanInputs in = inputs();
  in.dp = 2;
  in.layers = 2;
  in.layer_parameters = in.parameters / 2;
  EXPECT_NE(error_of([&] { estimate(in, profile(), both); }).find("shard or offload layers"), std::string::npos);
}

TEST(PlannerEstimate, ActivationsFollowTheMicroBatchAndTheTotalsAddUp) {
  PlanInputs in = inputs();
  in.buffer_bytes = 3000;
  in.input_bytes_per_row = 100;
  in.input_batches = 3;
  in.workspace_fraction = 0.05;
  in.largest_activation_bytes_per_row = 1000;
  in.cuda_context_bytes = 500 * kMB;
  ActivationProfile p = profile();
  p.persistent_bytes = 7000;
  p.fits[0].intercept_bytes = 12345;  // the plain line: 12345 + 50 MiB per row
  for (int accum : {1, 2, 4, 16}) {
    MemoryEstimate e = estimate(in, p, Technique{false, accum});
    const int64_t rows = 16 / accum;
    EXPECT_EQ(e.micro_batch_rows, rows);
    EXPECT_EQ(e.gpu.activations, 12345 + rows * 50 * kMB);
    EXPECT_EQ(e.gpu.other,
              3000 + 7000 + 100 * 16 * 3);       // the whole batch, whatever the accumulation
    EXPECT_EQ(e.gpu.transient, 0);               // the fused optimizers need no temporaries
    EXPECT_EQ(e.gpu.stale_gradients, 40 * kMB);  // step 2 still holds the old gradient buckets
    const int64_t fixed = 40 * kMB + 40 * kMB + 80 * kMB + 40 * kMB + e.gpu.other;
    EXPECT_EQ(e.gpu.allocated_peak(), fixed + e.gpu.activations);
    const int64_t workspace =
        static_cast<int64_t>(std::ceil(0.05 * static_cast<double>(e.gpu.allocated_peak()))) +
        1000 * rows;
    EXPECT_EQ(e.gpu.workspace, workspace);
    EXPECT_EQ(e.gpu.total(), e.gpu.allocated_peak() + workspace + 500 * kMB);
  }
  // Checkpointing and AMP read their own lines; AMP keeps fp32 parameters and gradients.
  MemoryEstimate ck = estimate(in, p, Technique{true, 4});
  EXPECT_EQ(ck.gpu.activations, 4 * 10 * kMB);
  MemoryEstimate bf = estimate(in, p, Technique{false, 1, AmpMode::kBf16});
  EXPECT_EQ(bf.gpu.activations, 16 * 25 * kMB);
  EXPECT_EQ(bf.gpu.parameters, 40 * kMB);
  EXPECT_EQ(bf.gpu.gradients, 40 * kMB);
  // A large optimizer transient (the _foreach_ fallback) sets the peak instead of activations.
  in.optimizer_transient_bytes = 2000 * kMB;
  MemoryEstimate tr = estimate(in, p, Technique{true, 16});
  EXPECT_EQ(tr.gpu.transient, 2000 * kMB);
  EXPECT_EQ(tr.gpu.allocated_peak(), 200 * kMB + tr.gpu.other + 2000 * kMB);
  in.optimizer_transient_bytes = 0;
  in.reducer_rebuild = false;
  EXPECT_EQ(estimate(in, p, Technique{}).gpu.stale_gradients, 0);
}

TEST(PlannerEstimate, TensorParallelKeepsItsShareOfTheShardedParameters) {
  PlanInputs in = inputs();
  in.parameters = 1000000;
  in.sharded_parameters = 600000;
  in.tp = 4;
  MemoryEstimate e = estimate(in, profile(), Technique{});
  const int64_t local = 400000 + 150000;
  EXPECT_EQ(e.gpu.parameters, local * 4);
  EXPECT_EQ(e.gpu.gradients, local * 4);
  EXPECT_EQ(e.gpu.optimizer_state, local * 4 * 2);
  in.sharded_parameters = 600001;  // a share rounds up
  EXPECT_EQ(estimate(in, profile(), Technique{}).gpu.parameters, (399999 + 150001) * 4);
}

TEST(PlannerEstimate, OptimizerOffloadMovesMasterWeightsAndStateToTheHost) {
  PlanInputs in = inputs();
  in.parameters = 1000000;
  in.bytes_per_parameter = 2;  // a bf16 model: fp32 master weights live on the host
  for (int dp : {1, 4}) {
    in.dp = dp;
    Technique t;
    t.offload_optimizer = true;
    MemoryEstimate e = estimate(in, profile(), t);
    const int64_t shard = 1000000 / dp;
    EXPECT_EQ(e.gpu.optimizer_state, 0);
    EXPECT_EQ(e.gpu.parameters, 2000000);
    EXPECT_EQ(e.gpu.gradients, 2000000);
    EXPECT_EQ(e.host.optimizer_state, shard * 4 * 3);  // master + exp_avg + exp_avg_sq, fp32
    EXPECT_EQ(e.host.gradients, shard * 2);            // streamed in the weights' bf16 (ZeRO-Offload's layout)
    EXPECT_EQ(e.host.other, 32 << 20);                 // the new weights' pinned staging tiles
  }
}

// The one-step-delayed update (--offload_delayed_update_after): a second host gradient buffer and
// the rank's range of new weights on the device; training on the CPU, no stream buffer or staging,
// and on one rank no gradient buffer at all (the update takes autograd's gradients); on two CPU
// ranks the two buffers again.
// (The 6.3B GPT of docs/BENCHMARKS.md, bf16 and delayed on an H200: this rule gives 96280 MiB on
// the host, the run's memory report 96282.)
TEST(PlannerEstimate, DelayedOffloadUpdateAndTheCpuInClosedForm) {
  PlanInputs in = inputs();
  in.parameters = 1000000;
  Technique t;
  t.offload_optimizer = true;
  for (int64_t bpp : {4, 2}) {
    in.bytes_per_parameter = bpp;
    for (bool delayed : {false, true}) {
      in.offload_delayed_update = delayed;
      for (bool device : {true, false}) {
        in.offload_to_device = device;
        SCOPED_TRACE(testing::Message() << "bytes " << bpp << " delayed " << delayed << " device " << device);
        const MemoryEstimate e = estimate(in, profile(), t);
        const int64_t buffers = delayed ? (device ? 2 : 0) : device ? 1 : 0;
        EXPECT_EQ(e.host.gradients, buffers * 1000000 * bpp);
        if (delayed && !device) {
          PlanInputs two = in;
          two.dp = 2;
          EXPECT_EQ(estimate(two, profile(), t).host.gradients, 2 * 500000 * bpp);
        }
        EXPECT_EQ(e.host.other, device ? 32 << 20 : 0);
        EXPECT_EQ(e.host.optimizer_state, 1000000 * 4 * 3);
        EXPECT_EQ(e.gpu.optimizer_state, delayed ? 1000000 * bpp : 0);  // the published weights' buffer
        EXPECT_EQ(e.gpu.parameters, 1000000 * bpp);
      }
    }
  }
  // ZeRO-3's offloaded optimizer: one float32 host gradient buffer (it has no delayed update).
  t.shard = 3;
  in.largest_unit_parameters = 1000;
  in.bytes_per_parameter = 2;
  const MemoryEstimate z3 = estimate(in, profile(), t);
  EXPECT_EQ(z3.host.gradients, 1000000 * 4);
  EXPECT_EQ(z3.gpu.optimizer_state, 1000000 * 4);
}

// Layer offload's delayed update: a second host weight buffer of the streamed blocks, and their
// gradients twice (held by the update while the next backward makes new ones); with
// --offload=all the optimizer's second host gradient buffer.
TEST(PlannerEstimate, LayerOffloadDelayedUpdateInClosedForm) {
  PlanInputs in = inputs();
  in.parameters = 1000000;
  in.layer_parameters = 800000;
  in.layers = 8;
  Technique t;
  t.offload_layers = true;
  auto without_and_with_delay = [&] {  // the estimate without the delayed update, then with it
    in.offload_delayed_update = false;
    const MemoryEstimate without = estimate(in, profile(), t);
    in.offload_delayed_update = true;
    return std::make_pair(without, estimate(in, profile(), t));
  };
  const auto [now, late] = without_and_with_delay();
  // The blocks' second weight buffer and the gradients the update holds; their optimizer
  // (make_optimizer's AdamW: two moments in the weights' dtype) becomes an OffloadedOptimizer
  // (an fp32 master besides).
  EXPECT_EQ(late.host.parameters - now.host.parameters, 800000 * 4);
  EXPECT_EQ(late.host.gradients - now.host.gradients, 800000 * 4);
  EXPECT_EQ(now.host.optimizer_state, 800000 * 4 * 2);
  EXPECT_EQ(late.host.optimizer_state, 800000 * 4 * 3);
  EXPECT_EQ(late.gpu.allocated_peak(), now.gpu.allocated_peak());
  t.offload_optimizer = true;
  const auto [all_now, all_late] = without_and_with_delay();
  EXPECT_EQ(all_late.host.parameters - all_now.host.parameters, 800000 * 4);
  // --offload=all: optimizer offload of the 200000 parameters on the device (its gradient
  // buffers: one the stream fills, two delayed), the blocks' own optimizer beside it; the blocks'
  // gradients are autograd's (and, delayed, the ones the update took).
  EXPECT_EQ(all_now.host.gradients, (200000 + 800000) * 4);
  EXPECT_EQ(all_late.host.gradients, (2 * 200000 + 2 * 800000) * 4);
  EXPECT_EQ(all_now.host.optimizer_state, 200000 * 4 * 3 + 800000 * 4 * 2);
  EXPECT_EQ(all_late.host.optimizer_state, 1000000 * 4 * 3);
  // The new weights' buffer on the device only for the parameters that stay there.
  EXPECT_EQ(all_late.gpu.optimizer_state - all_now.gpu.optimizer_state, (1000000 - 800000) * 4);
}

TEST(PlannerEstimate, LayerOffloadKeepsTwoLayersOnTheGpu) {
  PlanInputs in = inputs();
  in.parameters = 1000000;
  in.layer_parameters = 800000;
  in.layers = 8;
  in.optimizer = "adagrad";
  Technique t;
  t.offload_layers = true;
  MemoryEstimate e = estimate(in, profile(), t);
  const int64_t on_gpu = 200000 + 2 * 100000;
  EXPECT_EQ(e.gpu.parameters, on_gpu * 4);
  EXPECT_EQ(e.gpu.gradients, on_gpu * 4);
  EXPECT_EQ(e.gpu.optimizer_state,
            200000 * 4);  // the resident parameters' sum; the rest on the host
  EXPECT_EQ(e.host.parameters, 800000 * 4);
  EXPECT_EQ(e.host.gradients, 800000 * 4);
  EXPECT_EQ(e.host.optimizer_state, 800000 * 4);  // make_optimizer's Adagrad sum, no master
  t.offload_optimizer = true;
  MemoryEstimate all = estimate(in, profile(), t);
  EXPECT_EQ(all.gpu.optimizer_state, 0);
  // The device's 200000 offloaded (fp32 master + sum), the blocks' Adagrad beside it (the sum).
  EXPECT_EQ(all.host.optimizer_state, 200000 * 4 * 2 + 800000 * 4);
  EXPECT_EQ(all.host.gradients, (200000 + 800000) * 4);  // the stream's buffer, the blocks' own
  EXPECT_EQ(all.host.parameters, 800000 * 4);
  in.dp = 2;  // the device part partitioned, the blocks' optimizer on every rank
  MemoryEstimate two = estimate(in, profile(), t);
  EXPECT_EQ(two.host.optimizer_state, 100000 * 4 * 2 + 800000 * 4);
  EXPECT_EQ(two.host.gradients, (100000 + 800000) * 4);
}

TEST(PlannerEstimate, BadInputIsAClearError) {
  PlanInputs in = inputs();
  in.optimizer = "lamb";
  EXPECT_NE(
      error_of([&] { estimate(in, profile(), Technique{}); }).find("unknown optimizer name 'lamb'"),
      std::string::npos);
  in = inputs();
  EXPECT_NE(error_of([&] {
              estimate(in, profile(), Technique{false, 3});
            }).find("accum_steps=3"),
            std::string::npos);
  in.sharded_parameters = in.parameters + 1;
  EXPECT_NE(error_of([&] { validate(in); }).find("sharded_parameters"), std::string::npos);
  in = inputs();
  in.accum_candidates = {1, 5};
  EXPECT_NE(error_of([&] { validate(in); }).find("accumulation candidate 5"), std::string::npos);
  in = inputs();
  ActivationProfile only_plain;
  only_plain.fits = {line(false, AmpMode::kOff, 0, kMB)};
  const std::string msg = error_of([&] { estimate(in, only_plain, Technique{true}); });
  EXPECT_NE(msg.find("no measurement for checkpoint on with amp off"), std::string::npos) << msg;
}

// Static memory 200 MiB (with step 2's old gradient buckets); activations 50 MiB/row plain, 10
// MiB/row checkpointed; batch 16; compute 10 ms/row and 5 ms per micro-batch from the profile's
// timings.
TEST(PlannerChoice, FitsPlainlyWithARoomyBudget) {
  PlanInputs in = inputs();
  in.gpu_budget_bytes = 2048 * kMB;
  Plan plan = choose_plan(in, profile());
  EXPECT_EQ(plan.flags(), "");
  EXPECT_NEAR(plan.step_seconds, 16 * 0.010 + 0.005, 1e-9);
  EXPECT_NE(plan.reason.find("plain step needs"), std::string::npos) << plan.reason;
  EXPECT_NE(plan.reason.find("(fits)"), std::string::npos) << plan.reason;
  EXPECT_EQ(plan.allocator_limit_bytes, 2048 * kMB);
  nlohmann::json j = nlohmann::json::parse(plan.to_json());
  EXPECT_EQ(j["accum_steps"], 1);
  EXPECT_EQ(j["gpu_bytes"], plan.estimate.gpu.total());
}

TEST(PlannerChoice, NeedsAccumulation) {
  // Plain: 200 + 800 MiB. Accumulating 2 (200 + 400, 170 ms) beats checkpointing
  // (200 + 160, 218 ms) by the cost model.
  PlanInputs in = inputs();
  in.gpu_budget_bytes = 650 * kMB;
  Plan plan = choose_plan(in, profile());
  EXPECT_EQ(plan.flags(), "--accum_steps=2");
  EXPECT_NEAR(plan.step_seconds, 16 * 0.010 + 2 * 0.005, 1e-9);
  EXPECT_NE(plan.reason.find("(does not fit)"), std::string::npos) << plan.reason;
  for (const MemoryEstimate& e : plan.fitting) EXPECT_LE(e.gpu.total(), in.gpu_budget_bytes);
}

TEST(PlannerChoice, NeedsCheckpointing) {
  PlanInputs in = inputs();
  in.accum_candidates = {1};
  in.gpu_budget_bytes = 400 * kMB;  // plain 1000 MiB; checkpointed 200 + 160
  Plan plan = choose_plan(in, profile());
  EXPECT_EQ(plan.flags(), "--checkpoint_activations");
  EXPECT_NEAR(plan.step_seconds, 16 * 0.010 * 4 / 3 + 0.005, 1e-9);
  // With accumulation allowed too: nothing without checkpointing fits 240 MiB (16 micro-batches
  // of one row: 200 + 50), checkpointing with micro-batches of 4 rows does (200 + 40).
  in.accum_candidates = {};
  in.gpu_budget_bytes = 240 * kMB;
  plan = choose_plan(in, profile());
  EXPECT_EQ(plan.flags(), "--checkpoint_activations --accum_steps=4");
}

TEST(PlannerChoice, NeedsOptimizerOffload) {
  // 100 Mi parameters: 400 + 400 + 800 MiB on the GPU (+ 400 MiB of old gradient buckets in
  // step 2); offloaded, 400 + 400 (+ 400) MiB, plus 1 MiB/row of activations.
  PlanInputs in = inputs();
  in.parameters = 100 * kMB;
  in.can_offload_optimizer = true;
  in.gpu_budget_bytes = 1300 * kMB;
  ActivationProfile p;
  p.fits = {line(false, AmpMode::kOff, 0, 1.0 * kMB), line(true, AmpMode::kOff, 0, 0.5 * kMB)};
  Plan plan = choose_plan(in, p);
  EXPECT_TRUE(plan.technique.offload_optimizer);
  EXPECT_FALSE(plan.technique.checkpoint);
  EXPECT_EQ(plan.technique.accum_steps, 1);
  EXPECT_EQ(plan.flags(), "--offload=optimizer");
  EXPECT_EQ(plan.estimate.host.optimizer_state, 100 * kMB * 4 * 3);
  // A host budget below the master weights and state: nothing fits, and the message says
  // that the host is short.
  in.host_budget_bytes = 512 * kMB;
  const std::string msg = error_of([&] { choose_plan(in, p); });
  EXPECT_NE(msg.find("raise --host_mem_limit_gb to at least"), std::string::npos) << msg;
  EXPECT_NE(msg.find("of host memory and has 512.0 MiB"), std::string::npos) << msg;
}

// Without --host_mem_limit_gb a plan's host budget is this process's share of the node's
// MemAvailable less the pinned pool's 2 GiB headroom; with it, the limit; unknown: no limit.
TEST(PlannerInputs, HostBudgetIsTheLimitOrTheShareOfMemAvailable) {
  testing_util::ScratchDir dir("planner_meminfo", /*create=*/true);
  const std::string meminfo = dir / "meminfo";
  std::FILE* f = std::fopen(meminfo.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("MemTotal:       33554432 kB\nMemFree:         1048576 kB\nMemAvailable:   10485760 kB\n", f);
  std::fclose(f);
  const int64_t gib = int64_t{1} << 30;
  EXPECT_EQ(host_budget_bytes(0, 1, meminfo), 8 * gib);      // 10 GiB available - 2 GiB headroom
  EXPECT_EQ(host_budget_bytes(0, 4, meminfo), 2 * gib);      // shared by 4 processes on the node
  EXPECT_EQ(host_budget_bytes(3, 4, meminfo), 3 * gib);      // the limit, per process, as given
  EXPECT_EQ(host_budget_bytes(0, 1, dir / "none"), 0);  // unreadable: no limit
  EXPECT_TRUE(testing_util::throws_error_with([&] { host_budget_bytes(0, 0, meminfo); }, "processes on this node"));
}

// 100 Mi fp32 parameters with AdamW on 4 data-parallel ranks, 1 MiB of activations per row, 16
// rows, one micro-batch, no checkpointing.
PlanInputs four_ranks() {
  PlanInputs in = inputs();
  in.reducer_rebuild = false;
  in.parameters = 100 * kMB;
  in.dp = 4;
  in.accum_candidates = {1};
  in.can_checkpoint = false;
  return in;
}

ActivationProfile one_mib_per_row() {
  ActivationProfile p;
  p.fits = {line(false, AmpMode::kOff, 0, 1.0 * kMB)};
  return p;
}

TEST(PlannerChoice, PicksTheShardingStageTheBudgetNeeds) {
  // Plain 400 + 400 + 800 + 16 MiB; ZeRO-1 400 + 400 + 200 (a quarter of the state) + 16;
  // ZeRO-2 400 + 100 + 200 + max(16, 300 of other ranks' gradients at the end of backward).
  PlanInputs in = four_ranks();
  const ActivationProfile p = one_mib_per_row();
  in.gpu_budget_bytes = 1200 * kMB;
  EXPECT_NE(error_of([&] { choose_plan(in, p); }).find("allow --shard (ZeRO-1/2 over the 4 data-parallel ranks)"),
            std::string::npos);
  in.can_shard = true;
  Plan plan = choose_plan(in, p);
  EXPECT_EQ(plan.flags(), "--shard=optimizer");
  EXPECT_EQ(plan.estimate.gpu.allocated_peak(), 1016 * kMB);
  EXPECT_NE(plan.to_json().find("\"shard\":\"optimizer\""), std::string::npos) << plan.to_json();
  in.gpu_budget_bytes = 1010 * kMB;
  plan = choose_plan(in, p);
  EXPECT_EQ(plan.flags(), "--shard=gradients");
  EXPECT_EQ(plan.estimate.gpu.allocated_peak(), 1000 * kMB);
  // What sharding moves beyond DDP's all-reduce: a quarter of the weights' bytes.
  EXPECT_NEAR(plan.step_seconds, 16 * 0.010 + 0.005 + 100.0 * kMB * 4 / 4 / 25e9, 1e-12);
  // One data-parallel rank: nothing to shard over.
  in.dp = 1;
  EXPECT_NE(error_of([&] { choose_plan(in, p); }).find("no combination of techniques fits"), std::string::npos);
}

TEST(PlannerChoice, PicksStageThreeWhenOnlyTheWeightsSplitToo) {
  // As above; stage 3 keeps a quarter of the weights (100 MiB) and two units of 10 Mi
  // parameters whole during the step (80 MiB, beside the 16 MiB of activations, under the
  // 300 MiB of other ranks' gradients at the end of backward): 100 + 100 + 200 + 300.
  PlanInputs in = four_ranks();
  in.can_shard = true;
  const ActivationProfile p = one_mib_per_row();
  in.gpu_budget_bytes = 800 * kMB;
  // Without units stage 3 is no candidate, and stage 2's 1000 MiB does not fit.
  EXPECT_NE(error_of([&] { choose_plan(in, p); }).find("no combination of techniques fits"), std::string::npos);
  in.largest_unit_parameters = 10 * kMB;
  const Plan plan = choose_plan(in, p);
  EXPECT_EQ(plan.flags(), "--shard=parameters");
  EXPECT_EQ(plan.estimate.gpu.parameters, 100 * kMB);
  EXPECT_EQ(plan.estimate.gpu.activations, 16 * kMB + 80 * kMB);
  EXPECT_EQ(plan.estimate.gpu.allocated_peak(), 700 * kMB);
  EXPECT_NE(plan.to_json().find("\"shard\":\"parameters\""), std::string::npos) << plan.to_json();
  // Two all-gathers and the reduce-scatter (3 x 3/4 of the weights' bytes) against the
  // all-reduce's 1.5 x: 0.75 x the weights more.
  EXPECT_NEAR(plan.step_seconds, 16 * 0.010 + 0.005 + 0.75 * 100.0 * kMB * 4 / 25e9, 1e-12);
  // A roomy budget keeps the faster stage 0.
  in.gpu_budget_bytes = 0;
  EXPECT_EQ(choose_plan(in, p).flags(), "");
  EXPECT_NE(error_of([&] {
              PlanInputs bad = in;
              bad.largest_unit_parameters = 0;
              estimate(bad, p, Technique{false, 1, AmpMode::kOff, false, false, 3});
            }).find("largest_unit_parameters is 0"),
            std::string::npos);
}

TEST(PlannerChoice, KeepsTheNumericsUnlessAllowed) {
  PlanInputs in = inputs();
  in.accum_candidates = {1};
  in.can_checkpoint = false;
  in.gpu_budget_bytes = 650 * kMB;  // fp32 needs 1000 MiB; bf16 200 + 400
  EXPECT_NE(error_of([&] { choose_plan(in, profile()); }).find("allow mixed precision"),
            std::string::npos);
  in.allow_amp_change = true;
  Plan plan = choose_plan(in, profile());
  EXPECT_EQ(plan.flags(), "--amp=bf16");
}

TEST(PlannerChoice, NothingFitsNamesTheSmallestEstimate) {
  PlanInputs in = inputs();
  in.gpu_budget_bytes = 100 * kMB;
  // Closed form of the smallest: checkpointing with micro-batches of one row: static 200 MiB
  // + 10 MiB of activations.
  const int64_t smallest = 200 * kMB + 10 * kMB;
  const std::string msg = error_of([&] { choose_plan(in, profile()); });
  EXPECT_NE(msg.find("the smallest GPU estimate is " + mib(smallest)), std::string::npos) << msg;
  EXPECT_NE(msg.find("with --checkpoint_activations --accum_steps=16 "), std::string::npos) << msg;
  EXPECT_NE(msg.find("raise --gpu_mem_limit_gb to at least " + mib(smallest)), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("allow --offload=optimizer"), std::string::npos) << msg;
}

// Peak 10 MiB per row, of which forward holds 6 MiB per row until backward.
ActivationProfile held_profile() {
  ActivationProfile p;
  ActivationFit f = line(false, AmpMode::kOff, 0, 10.0 * kMB);
  f.held_bytes_per_row = 6.0 * kMB;
  p.fits = {f};
  return p;
}

TEST(PlannerPipeline, StagesHoldTheirMicroBatchesInFlight) {
  PlanInputs in = inputs();
  in.pp = 4;
  const ActivationProfile p = held_profile();
  for (PipelineSchedule schedule : {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe, PipelineSchedule::kZeroBubble}) {
    const bool gpipe = schedule == PipelineSchedule::kGPipe;
    in.pp_schedule = schedule;
    for (int stage = 0; stage < 4; ++stage) {
      in.stage = stage;
      for (int m : {1, 2, 4, 8, 16}) {
        // 1F1B: stage s holds min(P - s, m) micro-batches, GPipe all m, zero bubble what its
        // list holds (the last stage defers its weight halves: min(P, m)); one of them is in
        // backward (its peak), the others hold what their forward left.
        int k = gpipe ? m : std::min(4 - stage, m);
        if (schedule == PipelineSchedule::kZeroBubble) {
          k = simulate_pipeline(schedule, 4, m).peak_in_flight[stage];
          if (stage == 3) EXPECT_EQ(k, std::min(4, m));
        }
        const int64_t rows = 16 / m;
        const MemoryEstimate e = estimate(in, p, Technique{false, m});
        EXPECT_EQ(e.in_flight, k) << "stage " << stage << " m " << m;
        EXPECT_EQ(pipeline_in_flight(in, m), k);
        EXPECT_EQ(e.gpu.activations, rows * 10 * kMB + (k - 1) * rows * 6 * kMB)
            << to_string(schedule) << " stage " << stage << " m " << m;
      }
    }
  }
  // GPipe at 16 micro-batches holds the whole batch's forward: no saving from accumulation.
  in.pp_schedule = PipelineSchedule::kGPipe;
  in.stage = 0;
  EXPECT_EQ(estimate(in, p, Technique{false, 16}).gpu.activations, (10 + 15 * 6) * kMB);
  in.pp_schedule = PipelineSchedule::k1F1B;
  EXPECT_EQ(estimate(in, p, Technique{false, 16}).gpu.activations, (10 + 3 * 6) * kMB);
  // Without a pipeline nothing else is in flight.
  in.pp = 1;
  EXPECT_EQ(estimate(in, p, Technique{false, 4}).gpu.activations, 40 * kMB);
  EXPECT_NE(estimate(PlanInputs(inputs()), p, Technique{false, 4}).to_string().find("micro-batch 4 rows)"),
            std::string::npos);
  in.pp = 2;
  in.stage = 2;
  EXPECT_NE(error_of([&] { estimate(in, p, Technique{}); }).find("PlanInputs.stage=2 must be in [0, pp=2)"),
            std::string::npos);
}

// Interleaved (v chunks): the schedule's peak (micro-batch, chunk) pairs, each 1/v of the stage's
// held activations, beside one chunk's backward; only multiples of P micro-batches are candidates.
TEST(PlannerPipeline, InterleavedStagesHoldPairsOfMicroBatchAndChunk) {
  PlanInputs in = inputs();
  in.pp = 4;
  in.pp_schedule = PipelineSchedule::kInterleaved;
  in.pp_chunks = 2;
  const ActivationProfile p = held_profile();
  for (int stage = 0; stage < 4; ++stage) {
    in.stage = stage;
    for (int m : {4, 8, 16}) {
      const int pairs = simulate_pipeline(PipelineSchedule::kInterleaved, 4, m, {}, 2).peak_in_flight[stage];
      EXPECT_GT(pairs, std::min(4 - stage, m)) << "interleaving holds more than 1F1B's micro-batches";
      const int64_t rows = 16 / m;
      const MemoryEstimate e = estimate(in, p, Technique{false, m});
      EXPECT_EQ(e.gpu.activations, rows * 10 * kMB - rows * 6 * kMB + (pairs * rows * 6 * kMB + 1) / 2)
          << "stage " << stage << " m " << m;
      EXPECT_EQ(e.in_flight, (pairs + 1) / 2);
    }
  }
  // Candidates: 4, 8, 16 of a 16-row batch (1 and 2 do not go through 4 stages at a time).
  const Plan plan = choose_plan(in, p);
  EXPECT_EQ(plan.technique.accum_steps % 4, 0) << plan.flags();
  // The bubble shrinks with the chunks: the estimated step of 2 chunks is below 1F1B's at m 4.
  PlanInputs one = in;
  one.pp_schedule = PipelineSchedule::k1F1B;
  one.pp_chunks = 1;
  EXPECT_LT(estimate_step_seconds(in, p, Technique{false, 4}), estimate_step_seconds(one, p, Technique{false, 4}));
}

TEST(PlannerPipeline, TheBubbleFavoursMoreMicroBatches) {
  // Rows cost 10 ms, micro-batches 5 ms; a step of m micro-batches through P stages takes
  // (m + P - 1) micro-batch times.
  PlanInputs in = inputs();
  in.pp = 4;
  const ActivationProfile p = held_profile();
  for (int m : {1, 2, 4, 8, 16}) {
    EXPECT_NEAR(estimate_step_seconds(in, p, Technique{false, m}), (m + 3) * (16.0 / m * 0.010 + 0.005), 1e-12);
  }
  // Without a pipeline the plain step is fastest; with 4 stages 8 micro-batches are
  // (11/8 x 0.2 s = 0.275 s against 0.285 s at 16 and 0.315 s at 4).
  in.pp = 1;
  EXPECT_EQ(choose_plan(in, p).flags(), "");
  in.pp = 4;
  const Plan plan = choose_plan(in, p);
  EXPECT_EQ(plan.flags(), "--accum_steps=8");
  EXPECT_NE(plan.reason.find("(8 micro-batches through 4 stages, 4 in flight on stage 0)"), std::string::npos)
      << plan.reason;
  EXPECT_NE(plan.to_json().find("\"in_flight\":4"), std::string::npos) << plan.to_json();
}

TEST(PlannerPipeline, StagesAgreeOnWhatFitsOnEveryOne) {
  // Two stages: stage 0 (embeddings, 2 micro-batches in flight under 1F1B) and stage 1 (the
  // head: more parameters, 1 in flight). Each computes its own figures; the agreement takes
  // the maximum of each, as the all-reduce in the examples does.
  PlanInputs s0 = inputs(), s1 = inputs();
  s0.pp = s1.pp = 2;
  s1.stage = 1;
  s0.parameters = 10 * kMB;  // 160 MiB of weights, gradients and AdamW state
  s1.parameters = 20 * kMB;  // 320 MiB
  s0.reducer_rebuild = s1.reducer_rebuild = false;
  s0.accum_candidates = s1.accum_candidates = {1, 2};
  ActivationProfile p = profile();
  for (ActivationFit& f : p.fits) f.held_bytes_per_row = f.bytes_per_row;  // forward holds it all
  std::vector<double> figures0, figures1;
  auto record = [](std::vector<double>& into) { return [&into](std::vector<double>& f) { into = f; }; };
  const int64_t budget = 900 * kMB;
  s0.gpu_budget_bytes = s1.gpu_budget_bytes = budget;
  const Plan alone0 = choose_plan(s0, p, record(figures0));
  const Plan alone1 = choose_plan(s1, p, record(figures1));
  ASSERT_EQ(figures0.size(), figures1.size());
  // Stage 0 holds both micro-batches: the plain step needs 160 + 800 MiB at m = 1 or 2, so it
  // checkpoints (160 + 80 + 80). Stage 1 holds one: 320 + 400 fits at m = 2, the fastest
  // (1.5 x 0.17 s against checkpointing's 1.5 x 0.223 s).
  EXPECT_EQ(alone0.flags(), "--checkpoint_activations --accum_steps=2");
  EXPECT_EQ(alone1.flags(), "--accum_steps=2");
  EXPECT_EQ(estimate(s1, p, Technique{false, 2}).gpu.total(), 720 * kMB);
  EXPECT_EQ(estimate(s0, p, Technique{false, 2}).gpu.total(), 960 * kMB);
  auto agree_with = [](const std::vector<double>& other) {
    return [&other](std::vector<double>& f) {
      for (size_t i = 0; i < f.size(); ++i) f[i] = std::max(f[i], other[i]);
    };
  };
  const Plan plan0 = choose_plan(s0, p, agree_with(figures1));
  const Plan plan1 = choose_plan(s1, p, agree_with(figures0));
  EXPECT_EQ(plan0.flags(), "--checkpoint_activations --accum_steps=2");
  EXPECT_EQ(plan1.flags(), plan0.flags());
  EXPECT_EQ(plan0.step_seconds, plan1.step_seconds);
  EXPECT_LE(plan0.estimate.gpu.total(), budget);
  EXPECT_LE(plan1.estimate.gpu.total(), budget);
  EXPECT_NE(plan0.reason.find("(the most any rank needs)"), std::string::npos) << plan0.reason;
  // The plan is the fastest that fits both: every faster candidate overflows one stage.
  for (const MemoryEstimate& e : plan0.fitting) {
    EXPECT_LE(std::max(e.gpu.total(), estimate(s1, p, e.technique).gpu.total()), budget) << e.technique.flags();
  }
  // Nothing fits on every rank: the message names the most any rank needs.
  s0.gpu_budget_bytes = s1.gpu_budget_bytes = 350 * kMB;
  std::vector<double> small0;
  EXPECT_NO_THROW(choose_plan(s0, p, record(small0)));  // stage 0 alone fits (320 MiB)
  const std::string msg = error_of([&] { choose_plan(s0, p, agree_with(figures1)); });
  EXPECT_NE(msg.find("candidates on every rank: the smallest GPU estimate is 400.0 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(the most any rank needs)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("more --pp stages"), std::string::npos) << msg;
  // An agreement that changes the number of figures is a bug in the caller.
  EXPECT_NE(error_of([&] { choose_plan(s0, p, [](std::vector<double>& f) { f.pop_back(); }); })
                .find("changed the number of figures"),
            std::string::npos);
}

TEST(PlannerCost, ClosedFormsOfTheCostModel) {
  PlanInputs in = inputs();
  in.layer_parameters = 8 * kMB;
  in.layers = 4;
  in.dp = 2;
  const ActivationProfile p = profile();  // 10 ms/row, 5 ms/micro-batch
  const double plain = 16 * 0.010 + 0.005;
  EXPECT_NEAR(estimate_step_seconds(in, p, Technique{}), plain, 1e-12);
  EXPECT_NEAR(estimate_step_seconds(in, p, Technique{true, 4}), 16 * 0.010 * 4 / 3 + 4 * 0.005,
              1e-12);
  EXPECT_NEAR(estimate_step_seconds(in, p, Technique{false, 1, AmpMode::kBf16}), 16 * 0.005 + 0.005,
              1e-12);
  Technique off;
  off.offload_optimizer = true;
  // AdamW: master + 2 states read and written (8 bytes each), fp32 gradient read, weights
  // written back; this rank's half at 20 GB/s; gradients down and weights up over PCIe.
  const double cpu = (8.0 * 3 + 4 + 4) * 10 * kMB / 2 / 20e9, pcie = 2.0 * 10 * kMB * 4 / 55e9;
  EXPECT_NEAR(estimate_step_seconds(in, p, off), plain + cpu + pcie, 1e-12);
  Technique layers;
  layers.offload_layers = true;
  layers.accum_steps = 2;
  // The blocks recomputed in backward, as checkpointing does; per micro-batch: the streamed
  // parameters in forward and backward, their gradients back.
  EXPECT_NEAR(estimate_step_seconds(in, p, layers),
              16 * 0.010 * 4 / 3 + 2 * 0.005 + 2 * 3.0 * 8 * kMB * 4 / 55e9, 1e-12);
  layers.checkpoint = true;  // the same step
  EXPECT_NEAR(estimate_step_seconds(in, p, layers),
              16 * 0.010 * 4 / 3 + 2 * 0.005 + 2 * 3.0 * 8 * kMB * 4 / 55e9, 1e-12);
  // PlanInputs' own figures override the profile's; without either, 1 ms per row and per
  // micro-batch.
  in.compute_seconds_per_row = 0.1;
  in.micro_batch_overhead_seconds = 0.2;
  EXPECT_NEAR(estimate_step_seconds(in, p, Technique{false, 2}), 1.6 + 0.4, 1e-12);
  ActivationProfile untimed;
  untimed.fits = {line(false, AmpMode::kOff, 0, kMB, 0, 0)};
  untimed.fits[0].seconds[0] = untimed.fits[0].seconds[1] = 0;
  EXPECT_NEAR(estimate_step_seconds(inputs(), untimed, Technique{false, 4}), 16e-3 + 4e-3, 1e-12);
}

TEST(PlannerChoice, OffloadIsChosenOnlyWhenNeeded) {
  PlanInputs in = inputs();
  in.can_offload_optimizer = true;
  in.can_checkpoint = false;
  in.accum_candidates = {1};
  Plan plan = choose_plan(in, profile());  // no budget: everything fits
  EXPECT_EQ(plan.flags(), "");
  ASSERT_EQ(plan.fitting.size(), 2u);
  EXPECT_EQ(plan.fitting[1].technique.flags(), "--offload=optimizer");
  EXPECT_NE(plan.reason.find("next best: --offload=optimizer"), std::string::npos) << plan.reason;
  EXPECT_EQ(plan.allocator_limit_bytes, 0);
}

TEST(PlannerChoice, AnotherTimeModelRanksTheCandidates) {
  // A roomy budget: every candidate fits. The built-in model picks the plain step; a time model
  // that prices accumulation of 4 fastest (as the simulator can, when smaller micro-batches run
  // faster) makes it the plan, with the expected gain over the plain step in the reason.
  PlanInputs in = inputs();
  in.gpu_budget_bytes = 2048 * kMB;
  in.step_time = [](const Technique& t) {
    if (t.checkpoint && t.accum_steps == 16) throw dtrain::Error("not priced");  // falls back
    return t.accum_steps == 4 && !t.checkpoint ? 0.080 : 0.100;
  };
  Plan plan = choose_plan(in, profile());
  EXPECT_EQ(plan.flags(), "--accum_steps=4");
  EXPECT_DOUBLE_EQ(plan.step_seconds, 0.080);
  EXPECT_NE(plan.reason.find("by the step-time model"), std::string::npos) << plan.reason;
  EXPECT_NE(plan.reason.find("expected 20.0% faster than it (~100.0 ms/step)"), std::string::npos) << plan.reason;
  // The candidate it could not price takes the built-in model's figure.
  Technique unpriced{true, 16, AmpMode::kOff, false, false, 0};
  const double with_hook = estimate_step_seconds(in, profile(), unpriced);
  in.step_time = nullptr;
  EXPECT_DOUBLE_EQ(with_hook, estimate_step_seconds(in, profile(), unpriced));
  EXPECT_NE(with_hook, 0.100);
}

TEST(PlannerChoice, NearlyEqualTimesPickTheSimplestAndStayPut) {
  // Timings within time_tolerance of the fastest are noise: the plan is the simplest of them,
  // whichever of them happened to measure fastest. Every candidate fits; accumulation of 4 and
  // checkpointing + accumulation of 2 are priced 1% apart either way, the rest far slower.
  PlanInputs in = inputs();
  in.gpu_budget_bytes = 2048 * kMB;
  for (double ckpt_time : {0.099, 0.101}) {
    in.step_time = [ckpt_time](const Technique& t) {
      if (t.checkpoint && t.accum_steps == 2) return ckpt_time;
      if (!t.checkpoint && t.accum_steps == 4) return 0.100;
      return 1.0;
    };
    Plan plan = choose_plan(in, profile());
    EXPECT_EQ(plan.flags(), "--accum_steps=4") << ckpt_time << ": " << plan.reason;
    if (ckpt_time < 0.100) {
      EXPECT_NE(plan.reason.find("the fastest, --checkpoint_activations"), std::string::npos) << plan.reason;
      EXPECT_NE(plan.reason.find("is within 5%"), std::string::npos) << plan.reason;
    }
  }
  // Outside the band the faster one wins; with no tolerance the strictly fastest.
  in.step_time = [](const Technique& t) { return t.checkpoint && t.accum_steps == 2 ? 0.090 : t.accum_steps == 4 && !t.checkpoint ? 0.100 : 1.0; };
  EXPECT_TRUE(choose_plan(in, profile()).technique.checkpoint);
  in.step_time = [](const Technique& t) { return t.checkpoint && t.accum_steps == 2 ? 0.099 : t.accum_steps == 4 && !t.checkpoint ? 0.100 : 1.0; };
  in.time_tolerance = 0;
  EXPECT_TRUE(choose_plan(in, profile()).technique.checkpoint);
  // Within the band and one technique each: fewer micro-batches first.
  in.time_tolerance = 0.05;
  in.step_time = [](const Technique& t) { return t.checkpoint ? 1.0 : t.accum_steps == 4 ? 0.100 : t.accum_steps == 8 ? 0.098 : 1.0; };
  EXPECT_EQ(choose_plan(in, profile()).flags(), "--accum_steps=4");
  in.time_tolerance = 1.5;
  EXPECT_THROW(choose_plan(in, profile()), dtrain::Error);
}

TEST(PlannerMemoryLimit, CpuEnforcesNothingAndBadBytesAreRefused) {
  EXPECT_FALSE(apply_memory_limit(c10::Device(c10::kCPU), 1 << 30));
  EXPECT_NE(
      error_of([] { apply_memory_limit(c10::Device(c10::kCPU), -1); }).find("--gpu_mem_limit_gb"),
      std::string::npos);
  EXPECT_NE(error_of([] { apply_memory_limit(c10::Device(c10::kMeta), 1); }).find("not supported"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
