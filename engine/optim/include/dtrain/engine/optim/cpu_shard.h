// The CPU optimizer (offload::CpuOptimizer) as an engine optimizer's partitioned state: its
// options for an engine rule, and its state as a checkpoint's arrays. Shared by optimizer
// offload (optim/) and ZeRO-3's offloaded layout (zero3/).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "dtrain/engine/optim/optim.h"
#include "dtrain/offload/cpu_optimizer.h"

namespace dtrain::engine::offload_detail {

// The CPU optimizer's options for an engine optimizer's rule (the same rule; eps as
// effective_eps() says), keeping shard `rank` of `count` with `threads` threads.
offload::CpuOptimizerOptions cpu_options(const OptimizerOptions& o, int rank, int count, int threads);

// A partitioned checkpoint's arrays of the CPU optimizer's shard: "step", then "master" and each
// state array with its chunks joined into the first `real` elements (host copies).
std::vector<std::pair<std::string, at::Tensor>> cpu_shard_arrays(const offload::CpuOptimizer& cpu, int64_t real);
// The reverse: "step" and arrays of `real` elements into the CPU optimizer's chunked state
// (CpuOptimizer::load_state's input). Throws dtrain::Error naming a missing or mis-sized array.
std::vector<std::pair<std::string, at::Tensor>> cpu_state_of_arrays(
    const offload::CpuOptimizer& cpu, const std::vector<std::pair<std::string, at::Tensor>>& arrays, int64_t real);

}  // namespace dtrain::engine::offload_detail

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
