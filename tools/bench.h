// dtrain-bench: shared context of the benchmarks (JSON lines on stdout, rank 0 prints).
#pragma once

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"

namespace dtrain::bench {

struct BenchContext {
  dist::World world;
  c10::Device device{c10::kCPU};
  std::unique_ptr<dist::Communicator> comm;
};

// The median of v (the mean of the middle two for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median ms of `step` on a CUDA device over `iters` runs after `warmup`, each timed between
// two synchronizations of the device.
inline double cuda_median_ms(c10::Device device, int warmup, int iters, const std::function<void()>& step) {
  auto sync = [&] { c10::impl::VirtualGuardImpl(c10::kCUDA).synchronizeDevice(device.index()); };
  for (int i = 0; i < warmup; ++i) step();
  sync();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(ms);
}

int run_allreduce(BenchContext& ctx);
int run_engine(BenchContext& ctx);
int run_cpu_adam(BenchContext& ctx);
int run_host_norm(BenchContext& ctx);
int run_sparse(BenchContext& ctx);
int run_pipeline(BenchContext& ctx);
int run_fused_ce(BenchContext& ctx);
int run_fused_block(BenchContext& ctx);
int run_context_parallel(BenchContext& ctx);

}  // namespace dtrain::bench
