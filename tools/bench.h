// dtrain-bench: shared context of the benchmarks (JSON lines on stdout, rank 0 prints).
#pragma once

#include <memory>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"

namespace dtrain::bench {

struct BenchContext {
  dist::World world;
  c10::Device device{c10::kCPU};
  std::unique_ptr<dist::Communicator> comm;
};

int run_allreduce(BenchContext& ctx);
int run_engine(BenchContext& ctx);
int run_cpu_adam(BenchContext& ctx);
int run_sparse(BenchContext& ctx);
int run_pipeline(BenchContext& ctx);

}  // namespace dtrain::bench
