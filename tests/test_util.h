// Helpers shared by dtrain's tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"

namespace dtrain::testing_util {

// The job's world communicator, created on first use ("mpi" under a launcher, "local" for a
// lone process) and kept until shutdown() at the end of main (MPI finalizes then).
dist::Communicator& world_comm();
const dist::World& world();
void shutdown();

// Whether a CUDA GPU is usable here.
bool has_cuda();

// ‖a − b‖ / max(‖b‖, tiny), computed in float64 on the CPU.
double rel_error(const at::Tensor& a, const at::Tensor& b);

}  // namespace dtrain::testing_util

#define DTRAIN_SKIP_WITHOUT_CUDA()                                              \
  do {                                                                          \
    if (!::dtrain::testing_util::has_cuda()) GTEST_SKIP() << "no CUDA GPU here"; \
  } while (0)
