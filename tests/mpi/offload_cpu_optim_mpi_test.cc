// CpuOptimizer partitioned across the ranks of the job: each rank owns one shard of the
// optimizer state, gradients are averaged into the shards by reduce-scatter, each rank
// updates its shard and the weights are all-gathered. The result must match one process
// updating everything with the averaged gradients.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"
#include "test_util.h"

namespace dtrain::offload {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

const std::vector<int64_t> kSizes = {1000, 7, 33, 129, 1};  // 1170 elements: odd shards

std::vector<at::Tensor> initial_values() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(42);
  std::vector<at::Tensor> values;
  for (int64_t n : kSizes) values.push_back(at::randn({n}, gen));
  return values;
}

// Rank k's flat gradient at a step (every rank can compute every rank's).
at::Tensor rank_grad(int step, int k, int64_t numel) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + k);
  return at::randn({numel}, gen) * (1.0 + 0.5 * k);
}

CpuOptimizerOptions rule_options(const std::string& rule) {
  CpuOptimizerOptions o;
  o.name = rule;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  o.amsgrad = true;
  o.momentum = 0.9;
  o.threads = 1;
  o.chunk_elems = 128;
  o.tile_elems = 100;
  return o;
}

at::Tensor flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : ts) parts.push_back(t.detach().reshape({-1}));
  return at::cat(parts);
}

// weights_are_params: the parameters are views into one flat buffer that the optimizer
// writes through them (the default target) and the all-gather completes; otherwise the
// optimizer writes into a separate flat output (set_output).
void run_sharded(const std::string& rule, bool weights_are_params) {
  dist::Communicator& comm = world_comm();
  const int n = comm.size();
  const int r = comm.rank();
  const std::vector<at::Tensor> init = initial_values();
  const int64_t numel = flat(init).numel();
  CpuOptimizerOptions o = rule_options(rule);
  o.shard_rank = r;
  o.shard_count = n;
  const int64_t padded = padded_numel(numel, n);

  // This rank's model: parameters viewing a flat weight buffer, or standalone tensors.
  at::Tensor weights = at::zeros({padded});
  weights.narrow(0, 0, numel).copy_(flat(init));
  std::vector<at::Tensor> params;
  int64_t off = 0;
  for (const at::Tensor& v : init) {
    params.push_back(weights_are_params ? weights.narrow(0, off, v.numel()) : v.clone());
    off += v.numel();
  }
  PinnedPool pool;
  CpuOptimizer opt(params, o, pool);
  if (!weights_are_params) opt.set_output(weights);
  const ShardRange shard = opt.shard();
  EXPECT_EQ(shard.begin, r * (padded / n));
  EXPECT_EQ(shard.size(), padded / n);

  // The unpartitioned reference, one process.
  std::vector<at::Tensor> ref_params;
  for (const at::Tensor& v : init) ref_params.push_back(v.clone());
  CpuOptimizerOptions ro = rule_options(rule);
  CpuOptimizer reference(ref_params, ro, pool);
  // Host memory per rank falls with the number of ranks.
  EXPECT_LE(opt.host_bytes(), reference.host_bytes() / n + 4 * 128 * 4 * 2);

  for (int step = 0; step < 3; ++step) {
    at::Tensor grad = at::zeros({padded});
    grad.narrow(0, 0, numel).copy_(rank_grad(step, r, numel));
    at::Tensor shard_grad = at::empty({shard.size()});
    comm.reduce_scatter(grad, shard_grad, dist::ReduceOp::kAvg)->wait();
    opt.begin_step();
    opt.step_range(shard.begin, shard.end, shard_grad);
    opt.end_step();
    comm.all_gather(weights.narrow(0, shard.begin, shard.size()), weights)->wait();

    at::Tensor avg = at::zeros({numel});
    for (int k = 0; k < n; ++k) avg += rank_grad(step, k, numel);
    avg /= n;
    off = 0;
    for (at::Tensor& p : ref_params) {
      p.mutable_grad() = avg.narrow(0, off, p.numel()).clone();
      off += p.numel();
    }
    reference.step();
    SCOPED_TRACE(rule + " step " + std::to_string(step) + " rank " + std::to_string(r));
    EXPECT_LT(rel_error(weights.narrow(0, 0, numel), flat(ref_params)), 1e-6);
    if (weights_are_params) {
      EXPECT_TRUE(at::equal(flat(params), weights.narrow(0, 0, numel)));
    }
    EXPECT_TRUE((weights.narrow(0, numel, padded - numel) == 0).all().item<bool>())
        << "padding stays zero";
  }
}

TEST(OffloadCpuOptimMpi, ShardedAdamWMatchesUnpartitioned) { run_sharded("adamw", true); }

TEST(OffloadCpuOptimMpi, ShardedSgdIntoFlatOutputMatchesUnpartitioned) {
  run_sharded("sgd", false);
}

}  // namespace
}  // namespace dtrain::offload
