// LossScaler across ranks: an inf or NaN in one rank's gradients makes every rank skip the
// step and back off, so the ranks' scales never diverge.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/optim/amp.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

// This rank's unscaled gradients at step k: exact in float32 at every power-of-two scale.
std::vector<at::Tensor> base_grads(int k, int rank) {
  at::Tensor a = at::arange(6, at::kFloat) * 0.25 + k * 0.125 + rank;
  at::Tensor b = at::full({2, 2}, 0.5 * (rank + 1), at::kDouble);
  return {a, b};
}

TEST(AmpMpi, NonFiniteGradientOnOneRankMakesEveryRankSkip) {
  dist::Communicator& comm = testing_util::world_comm();
  const int n = comm.size(), rank = comm.rank();
  // step -> the one rank whose gradients hold an inf (or a NaN).
  const std::map<int, int> inf_on = {{2, n - 1}, {5, 0}, {9, 1 % n}};
  const std::map<int, int> nan_on = {{10, n - 1}};
  LossScalerOptions options;
  options.init_scale = 1024.0;
  options.growth_interval = 3;
  LossScaler scaler(options, c10::Device(c10::kCPU));

  double expected_scale = options.init_scale;  // GradScaler's rule, by hand
  int finite_run = 0;
  for (int k = 0; k < 14; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    const bool bad_anywhere = inf_on.count(k) > 0 || nan_on.count(k) > 0;
    const bool bad_here =
        (inf_on.count(k) && inf_on.at(k) == rank) || (nan_on.count(k) && nan_on.at(k) == rank);
    ASSERT_EQ(scaler.scale_value(), expected_scale);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& g : base_grads(k, rank)) grads.push_back(g * expected_scale);
    if (inf_on.count(k) && inf_on.at(k) == rank)
      grads[0][3] = std::numeric_limits<float>::infinity();
    if (nan_on.count(k) && nan_on.at(k) == rank) grads[1][1][0] = std::nan("");

    // Without the communicator a rank only sees its own gradients.
    LossScalerOptions local_options = options;
    local_options.init_scale = expected_scale;
    LossScaler local(local_options, c10::Device(c10::kCPU));
    std::vector<at::Tensor> copies = {grads[0].clone(), grads[1].clone()};
    EXPECT_EQ(local.unscale(copies, nullptr), !bad_here);

    const bool ok = scaler.unscale(grads, &comm);
    EXPECT_EQ(ok, !bad_anywhere);
    if (ok) {
      std::vector<at::Tensor> base = base_grads(k, rank);
      EXPECT_TRUE(at::equal(grads[0], base[0]));
      EXPECT_TRUE(at::equal(grads[1], base[1]));
    }
    scaler.update();
    if (bad_anywhere) {
      expected_scale *= options.backoff_factor;
      finite_run = 0;
    } else if (++finite_run == options.growth_interval) {
      expected_scale *= options.growth_factor;
      finite_run = 0;
    }
  }
  EXPECT_EQ(scaler.skipped_steps(), static_cast<int64_t>(inf_on.size() + nan_on.size()));
  // Every rank ends with the same scale.
  at::Tensor lo = at::full({1}, scaler.scale_value(), at::kDouble), hi = lo.clone();
  comm.all_reduce(lo, dist::ReduceOp::kMin)->wait();
  comm.all_reduce(hi, dist::ReduceOp::kMax)->wait();
  EXPECT_EQ(lo.item<double>(), hi.item<double>());
}

}  // namespace
}  // namespace dtrain::engine
