// A model split into consecutive stages over the ranks (pp = the world size: 1, 2 or 4) trains
// to the gradients and loss of one process running the whole model on the same micro-batches
// (float64, so the two differ by rounding only), for GPipe, 1F1B and zero bubble, with fewer, as many and
// more micro-batches than stages; each stage holds the schedule's bound of micro-batches.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/parallel/pipeline.h"
#include "pipeline_cases.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

constexpr int kBlocks = 8;
constexpr int64_t kWidth = 6, kPipeRows = 4;

struct Model {
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear head{nullptr};
  std::vector<at::Tensor> params(int begin, int end, bool with_head) const {
    std::vector<at::Tensor> out;
    for (int b = begin; b < end; ++b) {
      for (auto& p : blocks[b]->parameters()) out.push_back(p);
    }
    if (with_head) {
      for (auto& p : head->parameters()) out.push_back(p);
    }
    return out;
  }
};

Model make_model() {
  torch::manual_seed(7);
  Model m;
  for (int b = 0; b < kBlocks; ++b) {
    m.blocks.push_back(torch::nn::Linear(kWidth, kWidth));
    m.blocks.back()->to(torch::kFloat64);
  }
  m.head = torch::nn::Linear(kWidth, 1);
  m.head->to(torch::kFloat64);
  return m;
}

std::pair<at::Tensor, at::Tensor> micro_batch(int i) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(100 + i);
  return {at::randn({kPipeRows, kWidth}, g, at::kDouble), at::randn({kPipeRows, 1}, g, at::kDouble)};
}

at::Tensor run_blocks(Model& m, int begin, int end, at::Tensor x) {
  for (int b = begin; b < end; ++b) x = torch::tanh(m.blocks[b]->forward(x));
  return x;
}

// The reference: the whole model in this process, the mean of m micro-batches' losses, backward
// run (the gradients in the returned model); the mean loss.
std::pair<Model, double> whole_model_step(int m) {
  Model whole = make_model();
  at::Tensor total = at::zeros({}, at::kDouble);
  for (int i = 0; i < m; ++i) {
    auto [x, y] = micro_batch(i);
    total = total + torch::mse_loss(whole.head->forward(run_blocks(whole, 0, kBlocks, x)), y);
  }
  (total / m).backward();
  return {std::move(whole), (total / m).item<double>()};
}

// The world ranks of a group's members, in its rank order (collective over the group).
std::vector<int64_t> members(dist::Communicator& c, int world_rank) {
  at::Tensor all = at::empty({c.size()}, at::kLong);
  c.all_gather(at::full({1}, world_rank, at::kLong), all)->wait();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + c.size());
}

// The mesh's groups against the closed form r = (p D + d) T + t, for every T x P dividing the
// world: each group's members (all-gathered world ranks) in rank order.
TEST(PipelineMesh, GroupsFollowTheRankFormula) {
  auto& world = world_comm();
  const int W = world.size(), r = world.rank();
  for (int T = 1; T <= W; ++T) {
    for (int P = 1; P <= W; ++P) {
      if (W % (T * P) != 0) continue;
      const int D = W / (T * P);
      dist::Mesh mesh(world, T, P);
      const int t = r % T, d = (r / T) % D, p = r / (T * D);
      const std::string where = "T " + std::to_string(T) + ", P " + std::to_string(P);
      ASSERT_EQ(mesh.tp_rank(), t) << where;
      ASSERT_EQ(mesh.dp_rank(), d) << where;
      ASSERT_EQ(mesh.pp_rank(), p) << where;
      ASSERT_EQ(mesh.pp_size(), P) << where;
      std::vector<int64_t> tp, dp, pp;
      for (int i = 0; i < T; ++i) tp.push_back((p * D + d) * T + i);
      for (int i = 0; i < D; ++i) dp.push_back((p * D + i) * T + t);
      for (int i = 0; i < P; ++i) pp.push_back((i * D + d) * T + t);
      EXPECT_EQ(members(mesh.tp(), r), tp) << where;
      EXPECT_EQ(members(mesh.dp(), r), dp) << where;
      EXPECT_EQ(members(mesh.pp(), r), pp) << where;
    }
  }
  EXPECT_THROW(dist::Mesh::check(W, 1, W + 1), Error);
  EXPECT_THROW(dist::Mesh::check(4, 2, 3), Error);
}

// A mesh with an axis of its own ("cp" between dp and tp): each axis's group is the ranks that
// differ from this one only along it, by the mixed-radix closed form, for every split of the
// world; the standard accessors follow, and an unknown axis or bad sizes are named.
TEST(PipelineMesh, NamedAxesFollowTheMixedRadixFormula) {
  auto& world = world_comm();
  const int W = world.size(), r = world.rank();
  for (int C = 1; C <= W; ++C) {
    for (int T = 1; T * C <= W; ++T) {
      if (W % (T * C) != 0) continue;
      const int D = W / (T * C);
      dist::Mesh mesh(world, {{"pp", 1}, {"dp", -1}, {"cp", C}, {"tp", T}});
      const std::string where = "C " + std::to_string(C) + ", T " + std::to_string(T);
      const int t = r % T, c = r / T % C, d = r / (T * C);
      ASSERT_EQ(mesh.rank("cp"), c) << where;
      ASSERT_EQ(mesh.size("dp"), D) << where;
      std::vector<int64_t> cp, dp;
      for (int i = 0; i < C; ++i) cp.push_back((d * C + i) * T + t);
      for (int i = 0; i < D; ++i) dp.push_back((i * C + c) * T + t);
      EXPECT_EQ(members(mesh.group("cp"), r), cp) << where;
      EXPECT_EQ(members(mesh.dp(), r), dp) << where;
      EXPECT_EQ(mesh.tp_rank(), t) << where;
      EXPECT_EQ(mesh.pp_size(), 1) << where;
      EXPECT_EQ(mesh.axes()[1].size, D) << where;
    }
  }
  dist::Mesh plain(world, {{"dp", -1}});
  EXPECT_EQ(plain.tp_size(), 1);
  EXPECT_EQ(plain.pp_size(), 1);
  EXPECT_EQ(plain.dp_size(), W);
  EXPECT_NE(testing_util::error_of([&] { plain.group("ep"); }).find("the mesh has no axis 'ep' (its axes: dp)"),
            std::string::npos);
  EXPECT_NE(testing_util::error_of([&] { dist::Mesh::check(4, {{"dp", -1}, {"tp", -1}}); })
                .find("both take the rest of the world"),
            std::string::npos);
  EXPECT_NE(testing_util::error_of([&] { dist::Mesh::check(6, {{"dp", -1}, {"cp", 4}}); })
                .find("--cp=4 does not divide the world size 6"),
            std::string::npos);
}

TEST(Pipeline, StagesTrainAsOneProcessForEverySchedule) {
  auto& pp = world_comm();
  const int stages = pp.size(), s = pp.rank();
  ASSERT_EQ(kBlocks % stages, 0);
  const int per = kBlocks / stages, begin = s * per, end = begin + per;
  const bool last = s == stages - 1;
  for (int m : {1, 3, 8}) {
    auto [whole, mean_loss] = whole_model_step(m);
    const std::vector<at::Tensor> want = whole.params(begin, end, last);
    // One step of this stage's part of a fresh model under `schedule` (zb: ordered at `costs`).
    auto step_of = [&](Model& model, PipelineSchedule schedule, const PipelineCosts& costs) {
      PipelineStep step;
      step.micro_batches = m;
      step.schedule = schedule;
      step.costs = costs;
      step.activation_shape = {kPipeRows, kWidth};
      step.activation_options = at::TensorOptions().dtype(at::kDouble);
      step.input = [](int i) { return micro_batch(i).first; };
      step.forward = [&](const at::Tensor& x, int i) {
        at::Tensor h = run_blocks(model, begin, end, x);
        return last ? torch::mse_loss(model.head->forward(h), micro_batch(i).second) : h;
      };
      return run_pipeline_step(pp, step);
    };
    for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubble}) {
      const std::string what = std::string(to_string(schedule)) + ", " + std::to_string(m) + " micro-batches, stage " +
                               std::to_string(s) + "/" + std::to_string(stages);
      Model model = make_model();
      const PipelineStepResult result = step_of(model, schedule, PipelineCosts{});
      const std::vector<at::Tensor> got = model.params(begin, end, last);
      ASSERT_EQ(got.size(), want.size()) << what;
      for (size_t k = 0; k < got.size(); ++k) {
        ASSERT_TRUE(got[k].grad().defined()) << what << ", parameter " << k;
        EXPECT_LT(rel_error(got[k].grad(), want[k].grad()), 1e-12) << what << ", parameter " << k;
      }
      if (last) {
        EXPECT_NEAR(result.loss, mean_loss, 1e-12) << what;
      } else {
        EXPECT_EQ(result.loss, 0) << what;
      }
      // zb holds a micro-batch until its weight half: what the model of its lists says, at most
      // 1F1B's first stage's bound.
      const int bound = schedule == PipelineSchedule::kGPipe ? m
                        : schedule == PipelineSchedule::k1F1B
                            ? std::min(stages - s, m)
                            : simulate_pipeline(schedule, stages, m).peak_in_flight[s];
      EXPECT_EQ(result.peak_in_flight, bound) << what;
      if (schedule == PipelineSchedule::kZeroBubble) EXPECT_LE(result.peak_in_flight, std::min(stages, m)) << what;
      EXPECT_EQ(result.ran, pipeline_actions(schedule, stages, s, m)) << what;
    }
    // zb ordered at other costs (--pp_zb_costs): another order of the same actions, the same
    // gradients.
    for (const PipelineCosts& costs : {PipelineCosts{1, 2, 0.5}, PipelineCosts{1, 1.3, 0.7}}) {
      const std::string what = "zb at costs " + pipeline_costs_text(costs) + ", " + std::to_string(m) +
                               " micro-batches, stage " + std::to_string(s);
      Model model = make_model();
      const PipelineStepResult result = step_of(model, PipelineSchedule::kZeroBubble, costs);
      const std::vector<at::Tensor> got = model.params(begin, end, last);
      ASSERT_EQ(got.size(), want.size()) << what;
      for (size_t k = 0; k < got.size(); ++k)
        EXPECT_LT(rel_error(got[k].grad(), want[k].grad()), 1e-12) << what << ", parameter " << k;
      EXPECT_EQ(result.ran, pipeline_actions(PipelineSchedule::kZeroBubble, stages, s, m, 1, costs)) << what;
      EXPECT_LE(result.peak_in_flight, std::min(stages, m)) << what;
    }
  }
}

// Interleaved 1F1B: each rank holds chunks of the 8 blocks that are not consecutive (virtual
// stage c P + s holds blocks [(c P + s) b, (c P + s + 1) b) of b = 8 / (v P) each), the ring
// wrapping from the last rank to the first; the gradients and the loss equal one process's, and
// the forward-only pass gives the loss too. At P = 1 a group of one cannot interleave (refused).
TEST(Pipeline, InterleavedChunksTrainAsOneProcess) {
  auto& pp = world_comm();
  const int P = pp.size(), s = pp.rank();
  if (P == 1) {
    EXPECT_TRUE(testing_util::throws_error_with(
        [] { pipeline_actions(PipelineSchedule::kInterleaved, 1, 0, 2, 2); }, "at least 2 stages"));
    return;
  }
  for (int v : {2, 4}) {
    if (kBlocks % (v * P) != 0) continue;
    const int per = kBlocks / (v * P);
    for (int m : {P, 2 * P, 3 * P}) {
      auto [whole, mean_loss] = whole_model_step(m);
      const std::string what = "P " + std::to_string(P) + ", v " + std::to_string(v) + ", " + std::to_string(m) +
                               " micro-batches, stage " + std::to_string(s);
      Model model = make_model();
      PipelineStep step;
      step.micro_batches = m;
      step.schedule = PipelineSchedule::kInterleaved;
      step.chunks = v;
      step.activation_shape = {kPipeRows, kWidth};
      step.activation_options = at::TensorOptions().dtype(at::kDouble);
      step.input = [](int i) { return micro_batch(i).first; };
      const int V = v * P;
      step.chunk_forward = [&](const at::Tensor& x, int i, int c) {
        const int vs = c * P + s;
        at::Tensor h = run_blocks(model, vs * per, (vs + 1) * per, x);
        return vs == V - 1 ? torch::mse_loss(model.head->forward(h), micro_batch(i).second) : h;
      };
      const PipelineStepResult result = run_pipeline_step(pp, step);
      EXPECT_EQ(result.ran, pipeline_actions(PipelineSchedule::kInterleaved, P, s, m, v)) << what;
      for (int c = 0; c < v; ++c) {
        const int vs = c * P + s;
        const std::vector<at::Tensor> got = model.params(vs * per, (vs + 1) * per, vs == V - 1);
        const std::vector<at::Tensor> want = whole.params(vs * per, (vs + 1) * per, vs == V - 1);
        for (size_t k = 0; k < got.size(); ++k) {
          ASSERT_TRUE(got[k].grad().defined()) << what << ", chunk " << c << ", parameter " << k;
          EXPECT_LT(rel_error(got[k].grad(), want[k].grad()), 1e-12) << what << ", chunk " << c << ", parameter " << k;
        }
      }
      if (s == P - 1) EXPECT_NEAR(result.loss, mean_loss, 1e-12) << what;
      EXPECT_EQ(result.peak_in_flight,
                simulate_pipeline(PipelineSchedule::kInterleaved, P, m, {}, v).peak_in_flight[s]) << what;
      // Forward only (evaluation): micro-batch after micro-batch, around the ring v times.
      {
        at::NoGradGuard no_grad;
        const PipelineStepResult eval = run_pipeline_forward(pp, step);
        if (s == P - 1) EXPECT_NEAR(eval.loss, mean_loss, 1e-12) << what << ", forward only";
      }
    }
  }
  // Micro-batches that are not a multiple of the stages are refused before any message.
  EXPECT_TRUE(testing_util::throws_error_with(
      [&] { pipeline_actions(PipelineSchedule::kInterleaved, P, s, P + 1, 2); }, "use a multiple of"));
}

// Activation memory, counted exactly on the CPU: with m = 8 micro-batches a 1F1B stage holds
// min(P - s, m) micro-batches' activations where GPipe holds all 8, so its peak above the
// step's start is that fraction of GPipe's (a tolerance for the sends' buffers in flight).
TEST(Pipeline, OneFOneBHoldsTheBoundOfActivationsGPipeHoldsAll) {
  auto& pp = world_comm();
  if (!cpu_memory_tracked()) GTEST_SKIP() << "CPU tensors are not counted (DTRAIN_TRACK_CPU_MEMORY=0)";
  const int stages = pp.size(), s = pp.rank(), m = 8;
  const int64_t rows = 256, width = 64;
  torch::manual_seed(3 + s);
  std::vector<torch::nn::Linear> layers;
  for (int k = 0; k < 4; ++k) layers.push_back(torch::nn::Linear(width, width));
  PipelineStep step;
  step.micro_batches = m;
  step.activation_shape = {rows, width};
  step.activation_options = at::TensorOptions().dtype(at::kFloat);
  step.input = [&](int i) { return at::full({rows, width}, 0.01 * (i + 1)); };
  step.forward = [&](const at::Tensor& x, int) {
    at::Tensor h = x;
    for (auto& l : layers) h = torch::tanh(l->forward(h));
    return s == stages - 1 ? h.pow(2).mean() : h;
  };
  std::vector<double> samples;
  step.allocated_mb = [&] {
    samples.push_back(memory_stats(c10::Device(c10::kCPU)).allocated_mb);
    return samples.back();
  };
  step.schedule = PipelineSchedule::kGPipe;
  run_pipeline_step(pp, step);  // allocates the gradients, so neither measured step counts them
  const double gpipe = run_pipeline_step(pp, step).peak_activation_mb;
  step.schedule = PipelineSchedule::k1F1B;
  std::string gpipe_samples;
  for (double v : samples) gpipe_samples += std::to_string(v - samples.front()).substr(0, 5) + " ";
  samples.clear();
  const double one_f_one_b = run_pipeline_step(pp, step).peak_activation_mb;
  std::string f_samples;
  for (double v : samples) f_samples += std::to_string(v - samples.front()).substr(0, 5) + " ";
  const double fraction = static_cast<double>(std::min(stages - s, m)) / m;
  // Beyond the activations held: at most two transport buffers (a send in flight, a receive).
  const double buffers_mb = 2.0 * rows * width * sizeof(float) / (1024.0 * 1024.0);
  EXPECT_GT(gpipe, 0);
  EXPECT_GE(one_f_one_b, 0.95 * fraction * gpipe) << "stage " << s << "/" << stages << ": 1F1B " << one_f_one_b
                                                   << " MiB, GPipe " << gpipe << " MiB; samples " << gpipe_samples
                                                   << " | " << f_samples;
  EXPECT_LE(one_f_one_b, 1.05 * fraction * gpipe + buffers_mb)
      << "stage " << s << "/" << stages << ": 1F1B " << one_f_one_b << " MiB, GPipe " << gpipe << " MiB; samples "
      << gpipe_samples << " | " << f_samples;
}

TEST(Pipeline, ActivationOfAnotherShapeIsRefusedNamingIt) {
  auto& pp = world_comm();
  if (pp.size() < 2) GTEST_SKIP() << "one stage sends nothing";
  PipelineStep step;
  step.activation_shape = {kPipeRows, kWidth};
  step.activation_options = at::TensorOptions().dtype(at::kDouble);
  step.input = [](int) { return at::zeros({kPipeRows, kWidth + 1}, at::kDouble); };
  step.forward = [](const at::Tensor& x, int) { return x * 2; };
  if (pp.rank() == 0) {
    try {
      run_pipeline_step(pp, step);
      FAIL() << "the first stage sent an activation of the wrong shape";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("stage 0 produced Double[4, 7] but the pipeline sends Double[4, 6]"),
                std::string::npos)
          << e.what();
    }
  }
  pp.barrier()->wait();  // the other stages issued nothing: their receives were never posted
}

// Out of memory in the first or the last stage: the failing stage finishes the step's
// exchanges (zeros), every rank drops the step and halves the micro-batches (16 -> 8 -> 4 rows),
// and the weights equal a pipeline that used micro-batches of 4 rows from the start.
// Zero bubble likewise, and its weights equal 1F1B's (the trainer's gradient reducer ends the
// step's synchronized backward after the last micro-batch's weight half, several autograd runs:
// at 4 ranks the stages are data-parallel pairs, whose reductions these weights pass through).
TEST(PipelineTrainer, OutOfMemoryInOneStageBacksOffEveryRank) {
  auto& comm = world_comm();
  const c10::Device cpu(c10::kCPU);
  const std::vector<at::Tensor> want = pipeline_cases::two_stage_run(cpu, 4, -1, nullptr);
  for (PipelineSchedule schedule : {PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubble}) {
    if (schedule == PipelineSchedule::kZeroBubble) {
      const std::vector<at::Tensor> zb = pipeline_cases::two_stage_run(cpu, 4, -1, nullptr, schedule);
      ASSERT_EQ(zb.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_error(zb[i], want[i]), 1e-12) << "zb, parameter " << i;
    }
    for (int fail_rank : {0, comm.size() - 1}) {
      SCOPED_TRACE(std::string(to_string(schedule)) + ", out of memory on rank " + std::to_string(fail_rank));
      std::vector<int> seen;
      const std::vector<at::Tensor> got = pipeline_cases::two_stage_run(cpu, 1, fail_rank, &seen, schedule);
      EXPECT_EQ(seen, (std::vector<int>{4, 4, 4})) << "every rank must agree on the new accumulation";
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(rel_error(got[i], want[i]), 1e-12) << "parameter " << i;
    }
  }
}

}  // namespace
}  // namespace dtrain::engine
