// dtrain-bench sparse: averaging an embedding's sparse gradient across ranks, row exchange
// (SparseGradReducer's sparse path) against densify + all-reduce (its dense path), for a
// sweep of touched rows per rank. Prints per point the median time of each path and their
// bus bytes, then the measured crossover: the ratio of gather bytes to all-reduce bytes at
// which the two take equal time, which is what SparseReducerOptions::dense_factor encodes.
//   mpirun -np 2 dtrain-bench sparse --vocab=32000 --dim=512
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/sparse_reducer.h"

DEFINE_int64(vocab, 32000, "sparse: embedding rows (the vocabulary)");
DEFINE_int64(dim, 512, "sparse: embedding width");
DEFINE_int32(sparse_iters, 10, "sparse: timed iterations per point");

namespace dtrain::bench {
int run_sparse(BenchContext& ctx) {
  dist::Communicator& comm = *ctx.comm;
  DTRAIN_CHECK(FLAGS_vocab >= 16 && FLAGS_dim >= 1 && FLAGS_sparse_iters >= 1, "--vocab >= 16, --dim >= 1, --sparse_iters >= 1");
  const auto options = at::TensorOptions().dtype(at::kFloat).device(ctx.device);
  at::Tensor weight = at::zeros({FLAGS_vocab, FLAGS_dim}, options).requires_grad_();
  at::manual_seed(1000 + comm.rank());
  double crossover = std::numeric_limits<double>::quiet_NaN();
  double prev_ratio = 0, prev_bytes_ratio = 0;
  for (int64_t rows = 16; rows <= FLAGS_vocab; rows = rows * 2 > FLAGS_vocab && rows < FLAGS_vocab ? FLAGS_vocab : rows * 2) {
    // A batch's gradient: `rows` token positions drawn at random (duplicates, as real ids have).
    auto make_grad = [&] {
      at::Tensor ids = at::randint(FLAGS_vocab, {rows}, options.dtype(at::kLong));
      at::Tensor values = at::randn({rows, FLAGS_dim}, options);
      return at::sparse_coo_tensor(ids.unsqueeze(0), values, {FLAGS_vocab, FLAGS_dim}, options.layout(at::kSparse));
    };
    std::vector<double> times[2];
    engine::SparseReduceStats stats[2];
    for (int path = 0; path < 2; ++path) {  // 0: always sparse, 1: always dense
      engine::SparseReducerOptions o;
      o.dense_factor = path == 0 ? 1e30 : 1e-30;
      engine::SparseGradReducer reducer({weight}, comm, o);
      for (int i = 0; i < FLAGS_sparse_iters + 2; ++i) {
        weight.mutable_grad() = make_grad();
        comm.barrier()->wait();
        auto t0 = std::chrono::steady_clock::now();
        reducer.reduce();
        if (weight.grad().is_cuda()) (void)engine::gradient_values(weight.grad()).sum().item<float>();  // device sync
        auto t1 = std::chrono::steady_clock::now();
        if (i >= 2) times[path].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
      stats[path] = reducer.last_stats();
    }
    double ms[2];
    for (int path = 0; path < 2; ++path) {
      at::Tensor t = at::full({1}, median(times[path]), at::kDouble);
      comm.all_reduce(t, dist::ReduceOp::kMax)->wait();  // the slowest rank's
      ms[path] = t.item<double>();
    }
    const double bytes_ratio = stats[1].dense_bytes > 0 ? static_cast<double>(stats[0].sparse_bytes) / stats[1].dense_bytes : 0;
    const double time_ratio = ms[0] / ms[1];
    if (std::isnan(crossover) && prev_ratio > 0 && prev_ratio < 1 && time_ratio >= 1) {
      // Linear interpolation of the bytes ratio where sparse time / dense time crosses 1.
      crossover = prev_bytes_ratio + (1 - prev_ratio) * (bytes_ratio - prev_bytes_ratio) / (time_ratio - prev_ratio);
    }
    prev_ratio = time_ratio;
    prev_bytes_ratio = bytes_ratio;
    if (comm.rank() == 0) {
      nlohmann::json j = {{"bench", "sparse"}, {"ranks", comm.size()}, {"vocab", FLAGS_vocab}, {"dim", FLAGS_dim},
                          {"rows_per_rank", rows}, {"density", static_cast<double>(rows) / FLAGS_vocab},
                          {"sparse_ms", ms[0]}, {"dense_ms", ms[1]}, {"sparse_bus_bytes", stats[0].sparse_bytes},
                          {"dense_bus_bytes", stats[1].dense_bytes}, {"bytes_ratio", bytes_ratio},
                          {"time_ratio", time_ratio}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
    if (rows == FLAGS_vocab) break;
  }
  if (comm.rank() == 0) {
    nlohmann::json j = {{"bench", "sparse"}, {"crossover_bytes_ratio", std::isnan(crossover) ? nlohmann::json() : nlohmann::json(crossover)}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace dtrain::bench
