// ZeRO-1 (--shard=optimizer) and ZeRO-2 (--shard=gradients) on 1, 2 and 4 ranks against one
// process trained on the global batch with the replicated optimizer (the same weights), their
// state per rank (1/N of the replicated optimizer's; ZeRO-2 also keeps only its range's
// gradients), their bytes per step (those of an all-reduce), and checkpoints that resume under
// another stage, another data-parallel size, or optimizer offload.
#include <gtest/gtest.h>

#include <ftw.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "sharded_cases.h"
#include "test_util.h"

namespace dtrain::engine::sharded_cases {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

// A directory every rank sees (rank 0 picks the name), removed at the end.
class CommonDir {
 public:
  CommonDir() {
    dist::Communicator& comm = world_comm();
    at::Tensor id = at::zeros({1}, at::kLong);
    if (comm.rank() == 0) id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffff));
    comm.broadcast(id, 0)->wait();
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtrain_zero1_" + std::to_string(id.item<int64_t>());
  }
  ~CommonDir() {
    world_comm().barrier()->wait();
    if (world_comm().rank() == 0) ::nftw(path_.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Width 16: 129 parameters, fewer than the shards' alignment, so on 2 and 4 ranks only rank 0
// holds real elements (the others update a stand-in); width 256: every rank holds a range.
TEST(ShardedOptimizer, TrainsAsOneProcessOnTheGlobalBatchWithTheReplicatedOptimizer) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto one = lone();
  dist::Mesh single(*one, 1);
  for (int64_t width : {16, 256}) {
    for (double clip : {0.0, 0.05}) {
      for (int accum : {1, 2}) {
        Config c;
        c.width = width;
        c.clip = clip;
        c.accum = accum;
        c.optimizer = clip > 0 ? "sgd" : "adamw";  // SGD's update scales with the clipping coefficient
        const std::vector<at::Tensor> want = fit_on(single, 4 * comm.size(), c);
        for (const char* stage : {"optimizer", "gradients"}) {
          c.shard = stage;
          expect_same(fit_on(mesh, 4, c), want, 1e-10,
                      std::string("--shard=") + stage + ", width " + std::to_string(width) + ", clip " +
                          std::to_string(clip) + ", accum " + std::to_string(accum));
        }
      }
    }
  }
}

// fp16: a step whose gradients overflow is skipped on every rank, although under ZeRO-2 the
// overflow is seen only by the rank that owns the overflowing range (the others released
// those gradients): the same skipped steps and loss scales as the replicated run.
TEST(ShardedOptimizer, Fp16OverflowSkipsTheSameStepsOnEveryStage) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto run = [&](const std::string& shard, std::vector<double>& scales) {
    return fit_fp16(mesh, shard, c10::Device(c10::kCPU), scales);
  };
  std::vector<double> want_scales;
  const std::vector<at::Tensor> want = run("none", want_scales);
  ASSERT_EQ(want_scales.size(), 12u);
  ASSERT_LT(want_scales.front(), 1 << 19) << "the initial scale did not overflow: the test checks nothing";
  ASSERT_EQ(want_scales[10], want_scales[11]) << "the scale never came down far enough for a step: "
                                                << ::testing::PrintToString(want_scales);
  for (const char* stage : {"optimizer", "gradients"}) {
    std::vector<double> got_scales;
    expect_same(run(stage, got_scales), want, 1e-5, std::string("--shard=") + stage);
    EXPECT_EQ(got_scales, want_scales) << stage;
  }
}

// ZeRO-2 against ZeRO-1 in the memory report: between steps a rank holds the gradients of the
// parameters that intersect its range (closed form from shard_range), not all of them.
TEST(ShardedOptimizer, StageTwoKeepsOnlyItsRangesGradientsBetweenSteps) {
  auto& comm = world_comm();
  const int n = comm.size();
  dist::Mesh mesh(comm, 1);
  double state_mb = -1;
  auto gradient_mb = [&](const std::string& shard) {
    double mb = -1;
    Config c;
    c.width = 256;
    c.steps = 3;
    c.accum = 2;
    c.shard = shard;
    c.after = [&](Trainer& t) {
      mb = t.memory_report().gradients_mb;
      state_mb = t.memory_report().optimizer_state_mb;
    };
    fit_on(mesh, 4, c);
    return mb;
  };
  const std::vector<int64_t> sizes{6 * 256, 256, 256, 1};  // the two Linear layers' weights and biases
  const int64_t numel = 2049;
  auto kept_by = [&](int rank) {
    const FlatRange range = shard_range(numel, n, rank);
    int64_t kept = 0, begin = 0;
    for (int64_t size : sizes) {
      if (std::max(begin, range.begin) < std::min(begin + size, range.end)) kept += size;
      begin += size;
    }
    return kept;
  };
  const FlatRange mine = shard_range(numel, n, comm.rank());
  const int64_t kept = kept_by(comm.rank());
  int64_t all_ranks = 0;  // a parameter straddling a boundary is kept twice
  for (int r = 0; r < n; ++r) all_ranks += kept_by(r);
  const double to_mb = 8 / (1024.0 * 1024.0);
  EXPECT_NEAR(gradient_mb("optimizer"), numel * to_mb, 1e-9);
  // The two Adam moments of the range; on several ranks the gradient shard is a view of the
  // reducer's storage (counted under gradients), on one a buffer of its own (a few bytes of
  // step counters besides).
  EXPECT_NEAR(state_mb, (n > 1 ? 2 : 3) * mine.size() * to_mb, 1e-4);
  EXPECT_NEAR(gradient_mb("gradients"), kept * to_mb, 1e-9) << "rank " << comm.rank() << " owns [" << mine.begin
                                                             << ", " << mine.end << ")";
  EXPECT_NEAR(state_mb, (n > 1 ? 2 : 3) * mine.size() * to_mb, 1e-4);
  if (n > 1) EXPECT_LT(all_ranks, n * numel);
}

TEST(ShardedOptimizer, HoldsItsRangeOfTheStateAndTheGradients) {
  auto& comm = world_comm();
  auto model = make_model(256);
  std::vector<at::Tensor> params = model->parameters();
  int64_t numel = 0;
  for (const at::Tensor& p : params) numel += p.numel();
  OptimizerOptions oo;
  oo.name = "adamw";
  ShardedOptimizer opt(params, oo, comm);
  const FlatRange mine = shard_range(numel, comm.size(), comm.rank());
  ASSERT_TRUE(opt.shard_layout().has_value());
  EXPECT_EQ(opt.shard_layout()->numel, numel);
  EXPECT_EQ(opt.shard_layout()->ranges, shard_ranges(numel, comm.size(), comm.rank()));
  // exp_avg, exp_avg_sq and the gradient shard: three arrays of the range (fp64 parameters keep
  // no separate master), against 3 x numel for the replicated optimizer's moments and steps.
  int64_t elements = 0;
  for (const at::Tensor& t : opt.device_state()) {
    if (t.dim() > 0) elements += t.numel();
  }
  EXPECT_EQ(elements, 3 * mine.size());
  EXPECT_LE(mine.size(), numel / comm.size() + 64);
  // The parameters became views of one flat buffer: training writes them in place.
  for (size_t i = 1; i < params.size(); ++i) {
    EXPECT_EQ(params[i].data_ptr<double>(), params[i - 1].data_ptr<double>() + params[i - 1].numel());
  }
  ShardState state = opt.shard_state();
  for (const auto& [name, t] : state.tensors) {
    if (name != "step") EXPECT_EQ(t.numel(), mine.size()) << name;
  }
}

// Stage 1 moves about what an all-reduce moves (the ZeRO paper's 2 x parameters per step):
// each gradient reduced to its owner (counted as a reduce: its bytes once, where a ring
// reduce-scatter counts (N - 1) / N of them) and the all-gather of the updated, padded flat
// space ((N - 1) / N). Per step, in bus bytes: numel + (N - 1) / N x padded against the
// all-reduce's 2 (N - 1) / N x numel: 1.5x on 2 ranks, 1.17x on 4, approaching 1x.
TEST(ShardedOptimizer, MovesTheReductionToOwnersAndTheAllGatherPerStep) {
  auto& comm = world_comm();
  const int n = comm.size();
  if (n == 1) GTEST_SKIP() << "nothing moves on one rank";
  dist::Mesh mesh(comm, 1);
  auto per_step = [&](const std::string& shard) {
    std::vector<double> mb;
    Config c;
    c.width = 256;
    c.steps = 4;
    c.shard = shard;
    c.on_log = [&](const StepMetrics& m) {
      if (m.step >= 2) mb.push_back(m.extra.at("comm_mb"));
    };
    fit_on(mesh, 4, c);
    return mb;
  };
  const std::vector<double> replicated = per_step("none"), sharded = per_step("optimizer"),
                            stage2 = per_step("gradients");
  const double numel = 6 * 256 + 256 + 256 + 1, padded = static_cast<double>(offload::padded_numel(2049, n));
  const double mb = 8 / (1024.0 * 1024.0);  // float64
  const double all_reduce = 2.0 * (n - 1) / n * numel * mb, stage1 = (numel + (n - 1.0) / n * padded) * mb;
  ASSERT_EQ(sharded.size(), 3u);
  for (size_t k = 0; k < sharded.size(); ++k) {
    // The same few scalars (loss, flags) travel in both runs besides the gradients.
    EXPECT_NEAR(sharded[k] - replicated[k], stage1 - all_reduce, 0.01 * all_reduce) << "step " << k + 2;
    EXPECT_NEAR(stage2[k], sharded[k], 1e-9) << "ZeRO-2 moves what ZeRO-1 moves; step " << k + 2;
  }
}

TEST(ShardedOptimizer, ResumesUnderAnotherStageDataParallelSizeOrOffload) {
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto one = lone();
  dist::Mesh single(*one, 1);
  const int n = comm.size();
  Config whole;
  whole.width = 256;
  const std::vector<at::Tensor> want = fit_on(single, 4 * n, whole);  // 6 steps, no checkpoint
  // Three steps on N ranks (sharded, or replicated), saved; then three more, resumed otherwise.
  struct Case {
    std::string first_shard;
    bool single_rank_resume;
    std::string then_shard;
    bool then_offload;
    double tolerance;  // the CPU offload optimizer updates fp64 parameters in fp32
  };
  for (const Case& k : {Case{"optimizer", false, "optimizer", false, 1e-10}, Case{"optimizer", true, "none", false, 1e-10},
                        Case{"optimizer", true, "optimizer", false, 1e-10}, Case{"none", false, "optimizer", false, 1e-10},
                        Case{"optimizer", false, "none", true, 1e-5}, Case{"gradients", false, "optimizer", false, 1e-10},
                        Case{"none", false, "gradients", false, 1e-10}, Case{"gradients", true, "none", false, 1e-10},
                        Case{"gradients", false, "gradients", true, 1e-5}}) {
    const std::string what = "saved with --shard=" + k.first_shard + " on " + std::to_string(n) + " rank(s), resumed " +
                             (k.single_rank_resume ? "on 1" : "on " + std::to_string(n)) + " with --shard=" +
                             k.then_shard + (k.then_offload ? " --offload=optimizer" : "");
    SCOPED_TRACE(what);
    CommonDir dir;
    Config first = whole;
    first.steps = 3;
    first.shard = k.first_shard;
    first.save_dir = dir.path();
    fit_on(mesh, 4, first);
    comm.barrier()->wait();
    Config then = whole;
    then.shard = k.then_shard;
    then.offload = k.then_offload;
    then.save_dir = dir.path() + (comm.rank() == 0 ? "" : "");
    then.resume = ResumeMode::kYes;
    std::vector<at::Tensor> got;
    if (k.single_rank_resume) {
      if (comm.rank() == 0) {
        then.save_dir = dir.path();
        got = fit_on(single, 4 * n, then);
        expect_same(got, want, k.tolerance, what);
      }
    } else {
      got = fit_on(mesh, 4, then);
      expect_same(got, want, k.tolerance, what);
    }
    comm.barrier()->wait();
  }
}

TEST(ShardedOptimizer, StageNamesAndUnknownNamesAreRefused) {
  EXPECT_EQ(parse_shard_mode("none"), ShardMode::kNone);
  EXPECT_EQ(parse_shard_mode("optimizer"), ShardMode::kOptimizer);
  EXPECT_EQ(parse_shard_mode("gradients"), ShardMode::kGradients);
  EXPECT_EQ(parse_shard_mode("parameters"), ShardMode::kParameters);
  EXPECT_NE(testing_util::error_of([] { parse_shard_mode("zero1"); })
                .find("is not one of: none, optimizer, gradients, parameters"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine::sharded_cases
