// The data-parallel reducer against a single-process run on the whole global batch.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

torch::nn::Sequential make_mlp(int64_t seed, int64_t width = 16, int depth = 3,
                               torch::Dtype dtype = torch::kFloat64) {
  torch::manual_seed(seed);
  torch::nn::Sequential net;
  int64_t in = 8;
  for (int d = 0; d < depth; ++d) {
    net->push_back(torch::nn::Linear(in, width));
    net->push_back(torch::nn::Tanh());
    in = width;
  }
  net->push_back(torch::nn::Linear(in, 1));
  net->to(dtype);
  return net;
}

// The global batch of a step: the same on every rank, drawn from the step number.
std::pair<at::Tensor, at::Tensor> global_batch(int64_t step, int64_t rows, torch::Dtype dtype = torch::kFloat64) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({rows, 8}, g, dtype);
  at::Tensor y = at::randn({rows, 1}, g, dtype);
  return {x, y};
}

at::Tensor shard(const at::Tensor& t, int rank, int size) {
  int64_t b = t.size(0) / size;
  return t.narrow(0, rank * b, b);
}

std::vector<at::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<at::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

// Reference: rank 0's initial model (seed 0) on the whole global batch, one process.
std::vector<at::Tensor> reference_grads(int64_t step, int64_t rows) {
  auto ref = make_mlp(0);
  auto [x, y] = global_batch(step, rows);
  torch::mse_loss(ref->forward(x), y).backward();
  return grads_of(*ref);
}

// Small buckets (the first of 256 bytes, then 1024), so the MLP spans several; bfloat16 on the
// wire when `compress`.
ReducerOptions small_reducer_buckets(bool compress) {
  ReducerOptions options;
  options.first_bucket_bytes = 256;
  options.bucket_bytes = 1024;
  if (compress) options.compress = at::kBFloat16;
  return options;
}

int64_t total_numel(const std::vector<at::Tensor>& ps) {
  int64_t total = 0;
  for (auto& p : ps) total += p.numel();
  return total;
}

// The reference `ref` on the whole global batch (its gradients set anew), all its gradients
// flattened into one vector in parameter order: the flat space owner ranges cut.
at::Tensor flat_reference_grads(torch::nn::SequentialImpl& ref, const at::Tensor& x, const at::Tensor& y) {
  for (auto& p : ref.parameters()) p.mutable_grad() = at::Tensor();
  torch::mse_loss(ref.forward(x), y).backward();
  std::vector<at::Tensor> parts;
  for (auto& g : grads_of(ref)) parts.push_back(g.reshape({-1}));
  return at::cat(parts);
}

// This rank's 8 rows as two micro-batches of 4: the first under no_sync (then `between`, when
// given), the second the synchronized backward; each loss halved, so the sum is the mean's.
void backward_two_micro_batches(GradReducer& reducer, torch::nn::Sequential& model, const at::Tensor& xs,
                                const at::Tensor& ys, const std::function<void()>& between = nullptr) {
  {
    auto guard = reducer.no_sync();
    (torch::mse_loss(model->forward(xs.narrow(0, 0, 4)), ys.narrow(0, 0, 4)) / 2).backward();
  }
  if (between) between();
  (torch::mse_loss(model->forward(xs.narrow(0, 4, 4)), ys.narrow(0, 4, 4)) / 2).backward();
}

// The model's gradients equal the reference's on the whole global batch of `step` (float64).
void expect_reference_grads(torch::nn::Module& model, int64_t step, int64_t rows) {
  auto got = grads_of(model);
  auto want = reference_grads(step, rows);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_error(got[i], want[i]), 1e-12) << "param " << i;
}

void sgd_step(torch::nn::Module& m, double lr) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.sub_(p.grad() * lr);
}

// The communicator the tests run on: the world's, N ranks.
struct WorldRanks {
  dist::Communicator& comm = world_comm();
  const int N = comm.size();
};

class Reducer : public ::testing::Test, protected WorldRanks {};

TEST_F(Reducer, GradientsEqualASingleProcessOnTheGlobalBatch) {
  auto model = make_mlp(comm.rank() == 0 ? 0 : 17 + comm.rank());  // rank 0's weights must win
  GradReducer reducer(model->parameters(), comm, small_reducer_buckets(false));
  auto ref = make_mlp(0);
  for (int64_t step = 0; step < 4; ++step) {  // several steps: across the bucket rebuild
    auto [x, y] = global_batch(step, 8 * N);
    reducer.zero_grad();
    torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    torch::mse_loss(ref->forward(x), y).backward();
    auto got = grads_of(*model);
    auto want = grads_of(*ref);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(rel_error(got[i], want[i]), 1e-12) << "step " << step << " param " << i;
    }
    sgd_step(*model, 0.1);
    sgd_step(*ref, 0.1);
  }
  EXPECT_GT(reducer.num_buckets(), 1);
  EXPECT_EQ(reducer.synchronized_backwards(), 4);
}

// A strategy of the user's own (bucket_comm.h) carries every bucket: here each rank divides
// its gradients by the group size and all-reduces the sum, which must give the same averages,
// one launch per bucket per backward.
class DivideThenSumBuckets : public BucketComm {
 public:
  std::string name() const override { return "divide then sum"; }
  BucketLaunch launch(const at::Tensor& wire, int64_t, dist::Communicator& comm) override {
    ++launches;
    wire.div_(comm.size());
    BucketLaunch out;
    out.works.push_back(comm.all_reduce(wire, dist::ReduceOp::kSum));
    out.mine = out.works.back();
    return out;
  }
  int launches = 0;
};

TEST_F(Reducer, ACustomBucketStrategyCarriesEveryBucket) {
  auto model = make_mlp(0);
  auto strategy = std::make_shared<DivideThenSumBuckets>();
  ReducerOptions options;
  options.first_bucket_bytes = 256;
  options.bucket_bytes = 1024;
  options.bucket_comm = strategy;
  GradReducer reducer(model->parameters(), comm, options);
  EXPECT_EQ(reducer.bucket_comm().name(), "divide then sum");
  auto [x, y] = global_batch(0, 8 * N);
  torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
  expect_reference_grads(*model, 0, 8 * N);
  EXPECT_EQ(strategy->launches, reducer.num_buckets());
  // The default strategies' names, as the timeline shows them.
  GradReducer plain(make_mlp(0)->parameters(), comm);
  EXPECT_EQ(plain.bucket_comm().name(), "all_reduce");
}

// The owner-range tests (ZeRO's reduce-scatter through the reducer), each run with float64 and
// with bfloat16 on the wire (the parameter: compress), on rank 0's MLP.
class ReducerOwnerRanges : public ::testing::TestWithParam<bool>, protected WorldRanks {
 protected:
  const bool compress = GetParam();
  torch::nn::Sequential model = make_mlp(0);
  std::vector<at::Tensor> ps = model->parameters();
};

INSTANTIATE_TEST_SUITE_P(Wire, ReducerOwnerRanges, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "bfloat16" : "float64"; });

// Owner mode: rank r's range of the flat space equals the single process on the global
// batch (float64, 1e-12); elsewhere the values are not averages. Odd cuts through parameters,
// an empty range, accumulation, and bf16-compressed buckets.
TEST_P(ReducerOwnerRanges, OwnerModeAveragesEachRanksOwnRangeOnly) {
  const int64_t total = total_numel(ps);
  // Uneven ranges: rank 0 owns nothing, the rest split the space at odd points.
  ReducerOptions options = small_reducer_buckets(compress);
  options.owned.assign(N, {0, 0});
  int64_t begin = 0;
  for (int r = 1; r < N; ++r) {
    int64_t end = r == N - 1 ? total : begin + total / (N - 1) + 7;
    options.owned[r] = {begin, end};
    begin = end;
  }
  if (N == 1) options.owned[0] = {0, total};
  GradReducer reducer(ps, comm, options);
  // Buckets are consecutive parameters, launched from the last.
  auto buckets = reducer.bucket_params();
  ASSERT_GT(buckets.size(), 1u);
  EXPECT_EQ(buckets.front().back(), ps.size() - 1);
  for (auto& b : buckets) {
    for (size_t k = 1; k < b.size(); ++k) EXPECT_EQ(b[k], b[k - 1] + 1);
  }
  auto ref = make_mlp(0);
  for (int64_t step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 8 * N);
    reducer.zero_grad();
    backward_two_micro_batches(reducer, model, shard(x, comm.rank(), N), shard(y, comm.rank(), N));
    std::vector<at::Tensor> got;
    for (auto& g : grads_of(*model)) got.push_back(g.reshape({-1}));
    at::Tensor g = at::cat(got), w = flat_reference_grads(*ref, x, y);
    auto [lo, hi] = options.owned[comm.rank()];
    if (hi > lo) {
      // bf16 on the wire rounds each rank's contribution: within bf16's precision.
      EXPECT_LT(rel_error(g.narrow(0, lo, hi - lo), w.narrow(0, lo, hi - lo)), compress ? 2e-2 : 1e-12)
          << "step " << step;
    }
    if (N > 1 && hi - lo < total) {
      // Not everything is averaged on this rank (its own batch's gradient is not the mean).
      EXPECT_GT(rel_error(g, w), 1e-6) << "step " << step;
    }
  }
  EXPECT_EQ(reducer.synchronized_backwards(), 3);
}

// ZeRO-2: between steps a rank keeps only the buckets holding part of its range. Kept bytes in
// closed form: buckets close where the owner changes, so the kept parameters are exactly those
// that intersect the rank's range (a parameter straddling a boundary is kept by both ranks).
TEST_P(ReducerOwnerRanges, ReleaseUnownedKeepsOnlyTheBucketsOfThisRanksRange) {
  std::vector<int64_t> offset{0};
  for (auto& p : ps) offset.push_back(offset.back() + p.numel());
  const int64_t total = offset.back();
  ReducerOptions options = small_reducer_buckets(compress);
  options.release_unowned = true;
  for (int r = 0; r < N; ++r) options.owned.emplace_back(total * r / N, total * (r + 1) / N);
  const auto [lo, hi] = options.owned[comm.rank()];
  GradReducer reducer(ps, comm, options);
  // Each bucket's parameters share one set of owners.
  auto owners = [&](size_t i) {
    std::vector<int> out;
    for (int r = 0; r < N; ++r) {
      if (std::max(offset[i], options.owned[r].first) < std::min(offset[i + 1], options.owned[r].second)) out.push_back(r);
    }
    return out;
  };
  for (const auto& bucket : reducer.bucket_params()) {
    for (size_t i : bucket) EXPECT_EQ(owners(i), owners(bucket.front())) << "parameter " << i;
  }
  int64_t kept = 0;
  std::vector<bool> mine(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    mine[i] = std::max(offset[i], lo) < std::min(offset[i + 1], hi);
    if (mine[i]) kept += ps[i].numel();
  }
  const int64_t bytes_per_element = 8 + (compress ? 2 : 0);
  EXPECT_EQ(reducer.gradient_bytes(), kept * bytes_per_element) << "before the first backward";
  if (N > 1) EXPECT_LT(kept, total);
  auto ref = make_mlp(0);
  for (int64_t step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 8 * N);
    reducer.zero_grad();
    EXPECT_EQ(reducer.gradient_bytes(), kept * bytes_per_element) << "between steps, step " << step;
    backward_two_micro_batches(reducer, model, shard(x, comm.rank(), N), shard(y, comm.rank(), N), [&] {
      // Accumulation keeps every gradient until the synchronized backward.
      EXPECT_EQ(reducer.gradient_bytes(), total * bytes_per_element) << "step " << step;
    });
    EXPECT_EQ(reducer.gradient_bytes(), kept * bytes_per_element) << "after backward, step " << step;
    const at::Tensor want = flat_reference_grads(*ref, x, y);
    for (size_t i = 0; i < ps.size(); ++i) {
      ASSERT_EQ(ps[i].grad().defined(), static_cast<bool>(mine[i])) << "parameter " << i << ", step " << step;
      const int64_t a = std::max(offset[i], lo), b = std::min(offset[i + 1], hi);
      if (a >= b) continue;
      EXPECT_LT(rel_error(ps[i].grad().reshape({-1}).narrow(0, a - offset[i], b - a), want.narrow(0, a, b - a)),
                compress ? 2e-2 : 1e-12)
          << "parameter " << i << ", step " << step;
    }
  }
  EXPECT_EQ(reducer.synchronized_backwards(), 3);
}

// ZeRO-3's gradient path through the reducer's strategy seam (Zero3Optimizer::bucket_comm()):
// the buckets are the units exactly, padded for the reduce-scatter, released once reduced, so
// the reducer keeps nothing between steps and no .grad is defined after a synchronized
// backward; each rank's shard holds the single process's gradients of its piece of every unit.
// The units cut the MLP so that the pieces split parameters. Asking the reducer to compress a
// strategy it is given is refused (it would silently not compress).
TEST_P(ReducerOwnerRanges, ZeroThreeReduceScattersEachUnitIntoTheShard) {
  OptimizerOptions oo;
  oo.name = "sgd";
  Zero3Optimizer z3(ps, oo, comm, {0, 2, 3, 6});  // units of 2, 1, 3 and 2 parameters
  ParameterUnits units(z3);
  units.gather_all();  // the forward below reads every weight
  ReducerOptions options = small_reducer_buckets(false);
  options.bucket_comm = z3.bucket_comm();
  options.broadcast_parameters = false;
  if (compress) {
    options.compress = at::kBFloat16;
    EXPECT_NE(testing_util::error_of([&] { GradReducer reducer(ps, comm, options); }).find("wrap it in CompressedBuckets"),
              std::string::npos);
    units.release_all();
    return;
  }
  GradReducer reducer(ps, comm, options);
  EXPECT_EQ(reducer.bucket_params(), (std::vector<std::vector<size_t>>{{6, 7}, {3, 4, 5}, {2}, {0, 1}}));
  const ShardLayout layout = *z3.shard_layout();
  const std::vector<int64_t> at = z3.shard_positions();
  ASSERT_EQ(at.size(), layout.ranges.size());
  auto ref = make_mlp(0);
  for (int64_t step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 8 * N);
    reducer.zero_grad();
    z3.zero_grad();
    EXPECT_EQ(reducer.gradient_bytes(), 0) << "between steps, step " << step;
    backward_two_micro_batches(reducer, model, shard(x, comm.rank(), N), shard(y, comm.rank(), N));
    EXPECT_EQ(reducer.gradient_bytes(), 0) << "after backward, step " << step;
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_FALSE(ps[i].grad().defined()) << "parameter " << i;
    const at::Tensor want = flat_reference_grads(*ref, x, y);
    for (size_t q = 0; q < at.size(); ++q) {
      EXPECT_LT(rel_error(z3.gradient_shard().narrow(0, at[q], layout.ranges[q].size()),
                          want.narrow(0, layout.ranges[q].begin, layout.ranges[q].size())), 1e-12)
          << "step " << step << ", range " << q;
    }
  }
  units.release_all();
}

TEST_F(Reducer, ReleaseUnownedWithoutOwnedRangesIsRefused) {
  auto model = make_mlp(0);
  ReducerOptions options;
  options.release_unowned = true;
  EXPECT_NE(testing_util::error_of([&] { GradReducer reducer(model->parameters(), comm, options); })
                .find("release_unowned needs ReducerOptions.owned"),
            std::string::npos);
}

TEST_F(Reducer, OwnerRangesThatDoNotCoverTheParametersAreNamed) {
  auto model = make_mlp(0);
  ReducerOptions options;
  options.owned.assign(comm.size(), {0, 0});
  options.owned[0] = {0, 5};  // the rest owned by no rank
  try {
    GradReducer reducer(model->parameters(), comm, options);
    FAIL() << "accepted owned ranges that cover 5 elements";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ReducerOptions.owned covers 5 elements"), std::string::npos) << e.what();
  }
}

TEST_F(Reducer, NoSyncIssuesNoCollectiveAndAveragesTheAccumulatedSum) {
  auto model = make_mlp(0);
  GradReducer reducer(model->parameters(), comm);
  auto [x, y] = global_batch(7, 16 * N);
  // Two micro-batches per rank: rank r holds rows [r*16, r*16+16), split in halves.
  at::Tensor xs = shard(x, comm.rank(), N), ys = shard(y, comm.rank(), N);
  reducer.zero_grad();
  uint64_t before = comm.issued();
  {
    auto guard = reducer.no_sync();
    (torch::mse_loss(model->forward(xs.narrow(0, 0, 8)), ys.narrow(0, 0, 8)) / 2).backward();
  }
  EXPECT_EQ(comm.issued(), before) << "a collective was issued inside no_sync";
  (torch::mse_loss(model->forward(xs.narrow(0, 8, 8)), ys.narrow(0, 8, 8)) / 2).backward();
  EXPECT_GT(comm.issued(), before);
  expect_reference_grads(*model, 7, 16 * N);
}

TEST_F(Reducer, BucketsStartInReverseOrderAndOverlapBackward) {
  auto model = make_mlp(0, /*width=*/64, /*depth=*/6, torch::kFloat32);
  ReducerOptions options;
  options.first_bucket_bytes = 64 * 64 * 4;  // one hidden weight
  options.bucket_bytes = 2 * 64 * 64 * 4;
  GradReducer reducer(model->parameters(), comm, options);
  const size_t P = model->parameters().size();
  auto buckets = reducer.bucket_params();
  ASSERT_GT(buckets.size(), 2u);
  // Before any backward: the first bucket holds the last-registered parameters.
  EXPECT_EQ(buckets.front().front(), P - 1);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 32, torch::kFloat32);
    reducer.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    ReducerStepStats s = reducer.last_step_stats();
    ASSERT_EQ(s.bucket_launch.size(), static_cast<size_t>(reducer.num_buckets()));
    // Communication began while gradients were still being produced.
    EXPECT_LT(s.hooks_before_launch.front(), static_cast<int>(P)) << "step " << step;
    EXPECT_LT(s.bucket_launch.front(), s.backward_end);
    EXPECT_LE(s.backward_end, s.reduced);
    EXPECT_EQ(s.unused_parameters, 0);
  }
  // After the rebuild, bucket order follows arrival order: the output layer's gradients
  // arrive first, so its parameters are in the first bucket.
  auto rebuilt = reducer.bucket_params();
  bool head_first = false;
  for (size_t i : rebuilt.front()) head_first |= (i >= P - 2);
  EXPECT_TRUE(head_first);
}

struct TwoBranch : torch::nn::Module {
  TwoBranch() {
    torch::manual_seed(0);
    a = register_module("a", torch::nn::Linear(8, 4));
    b = register_module("b", torch::nn::Linear(8, 4));
    to(torch::kFloat64);
  }
  at::Tensor forward(const at::Tensor& x, bool use_b) {
    at::Tensor out = a->forward(x).sum(1, true);
    return use_b ? out + b->forward(x).sum(1, true) : out;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

// mode 0: without find_unused_parameters; 1: with it; 2: with it, and every parameter's data
// moved to another dtype and back after forward (as layer offload moves a streamed block's to
// the GPU and back inside its forward), so the parameters no longer name the AccumulateGrad
// nodes the graph holds: prepare_for_backward still finds them used.
TEST_F(Reducer, UnusedParametersDoNotHangAndCountAsZero) {
  for (int mode = 0; mode < 3; ++mode) {
    const bool find_unused = mode > 0;
    SCOPED_TRACE("mode " + std::to_string(mode));
    TwoBranch model;
    ReducerOptions options;
    options.find_unused_parameters = find_unused;
    options.first_bucket_bytes = 64;
    options.bucket_bytes = 64;
    GradReducer reducer(model.parameters(), comm, options);
    auto [x, y] = global_batch(3, 4 * N);
    // Rank 0 never uses branch b; the others do.
    const bool use_b = comm.rank() != 0;
    reducer.zero_grad();
    at::Tensor out = model.forward(shard(x, comm.rank(), N), use_b);
    if (mode == 2) {
      for (auto& p : model.parameters()) {
        const at::Tensor home = p.detach();
        p.set_data(home.to(at::kFloat));
        p.set_data(home);
      }
      ASSERT_FALSE(torch::autograd::impl::try_get_grad_accumulator(model.a->weight)) << "the node was kept";
    }
    reducer.prepare_for_backward({out});
    torch::mse_loss(out, shard(y, comm.rank(), N)).backward();
    EXPECT_EQ(reducer.last_step_stats().unused_parameters, use_b ? 0 : 2) << find_unused;
    // Reference: sum over ranks of each rank's gradient, divided by N.
    TwoBranch ref;
    std::vector<at::Tensor> want;
    for (auto& p : ref.parameters()) want.push_back(at::zeros_like(p));
    for (int r = 0; r < N; ++r) {
      for (auto& p : ref.parameters()) p.mutable_grad() = at::Tensor();
      torch::mse_loss(ref.forward(shard(x, r, N), r != 0), shard(y, r, N)).backward();
      auto ps = ref.parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        if (ps[i].grad().defined()) want[i] += ps[i].grad() / N;
      }
    }
    auto got = model.parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(rel_error(got[i].grad(), want[i]), 1e-12) << i << " find_unused " << find_unused;
    }
  }
}

// Layer offload moves parameters between host and GPU with set_data() every step, which gives
// each a new AccumulateGrad node; the reducer must still see every gradient as it is
// accumulated (none counted as unused, buckets launched during backward) and reduce it
// correctly. A dtype round trip replaces the node the same way on the CPU.
TEST_F(Reducer, SeesGradientsAfterSetDataReplacedTheAccumulator) {
  auto model = make_mlp(0);
  ReducerOptions options;
  options.first_bucket_bytes = 64;
  options.bucket_bytes = 64;
  GradReducer reducer(model->parameters(), comm, options);
  for (int64_t step = 0; step < 3; ++step) {
    for (auto& p : model->parameters()) {
      p.set_data(p.data().to(at::kFloat));
      p.set_data(p.data().to(at::kDouble));
    }
    reducer.zero_grad();
    auto [x, y] = global_batch(step, 4 * N);
    torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
    const ReducerStepStats stats = reducer.last_step_stats();
    EXPECT_EQ(stats.unused_parameters, 0) << "step " << step;
    ASSERT_FALSE(stats.hooks_before_launch.empty());
    EXPECT_LT(stats.hooks_before_launch.front(), static_cast<int>(model->parameters().size()))
        << "the first bucket launched before every gradient was ready";
    // Reference: the same (rounded) weights on the whole global batch in one process.
    auto ref = make_mlp(0);
    {
      torch::NoGradGuard no_grad;
      auto dst = ref->parameters(), src = model->parameters();
      for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
    }
    torch::mse_loss(ref->forward(x), y).backward();
    auto want = grads_of(*ref), got = grads_of(*model);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_error(got[i], want[i]), 1e-12) << i;
  }
}

TEST_F(Reducer, MismatchedModelsNameTheFirstDifferingParameter) {
  if (comm.size() == 1) GTEST_SKIP();
  auto model = make_mlp(0, comm.rank() == 1 ? 12 : 16);
  ReducerOptions options;
  for (size_t i = 0; i < model->parameters().size(); ++i) options.names.push_back("p" + std::to_string(i));
  try {
    GradReducer reducer(model->parameters(), comm, options);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    // Every rank (rank 0 too) names both shapes.
    EXPECT_NE(m.find("parameter 'p0' (#0) differs across ranks: rank 0 has Double[16, 8], rank 1 has Double[12, 8]"),
              std::string::npos)
        << m;
  }
  auto fewer = make_mlp(0, 16, comm.rank() == 1 ? 2 : 3);
  EXPECT_THROW({ GradReducer r(fewer->parameters(), comm); }, Error);
}

TEST_F(Reducer, Bfloat16CompressionStaysCloseToFullPrecision) {
  auto model = make_mlp(0);
  ReducerOptions options;
  options.compress = at::kBFloat16;
  GradReducer reducer(model->parameters(), comm, options);
  auto [x, y] = global_batch(5, 8 * N);
  reducer.zero_grad();
  torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
  auto got = grads_of(*model);
  auto want = reference_grads(5, 8 * N);
  for (size_t i = 0; i < got.size(); ++i) {
    double e = rel_error(got[i], want[i]);
    EXPECT_LT(e, 2e-2) << i;
    EXPECT_EQ(got[i].scalar_type(), at::kDouble);
  }
}

TEST_F(Reducer, AbandonedStepOnOneRankKeepsRanksInStep) {
  auto model = make_mlp(0);
  GradReducer reducer(model->parameters(), comm);
  // Step 1: the last rank "fails" before its backward; the others run normally.
  auto [x, y] = global_batch(11, 8 * N);
  reducer.zero_grad();
  if (comm.rank() == N - 1) {
    reducer.abandon_step();
  } else {
    torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
  }
  // Step 2 on every rank is exact again.
  reducer.zero_grad();
  torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
  expect_reference_grads(*model, 11, 8 * N);
}

TEST_F(Reducer, ReplacedGradientIsCopiedBackIntoItsBucket) {
  auto model = make_mlp(0);
  GradReducer reducer(model->parameters(), comm);
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();  // like zero_grad(set_to_none)
  auto [x, y] = global_batch(2, 8 * N);
  torch::mse_loss(model->forward(shard(x, comm.rank(), N)), shard(y, comm.rank(), N)).backward();
  expect_reference_grads(*model, 2, 8 * N);
}

TEST_F(Reducer, BroadcastTensorsCopiesRootValues) {
  std::vector<at::Tensor> ts = {at::full({3}, comm.rank() + 1.0), at::full({2, 2}, comm.rank() * 2, at::kLong),
                                at::full({5}, comm.rank() + 7.0)};
  broadcast_tensors(comm, ts, comm.size() - 1);
  EXPECT_EQ(ts[0][0].item<double>(), comm.size());
  EXPECT_EQ(ts[1][1][1].item<int64_t>(), 2 * (comm.size() - 1));
  EXPECT_EQ(ts[2][4].item<double>(), comm.size() + 6.0);
}

}  // namespace
}  // namespace dtrain::engine
