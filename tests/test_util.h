// Helpers shared by dtrain's tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"

namespace dtrain::testing_util {

// The job's world communicator, created on first use ("mpi" under a launcher, "local" for a
// lone process) and kept until shutdown() at the end of main (MPI finalizes then).
dist::Communicator& world_comm();
const dist::World& world();
void shutdown();

// This rank alone: a communicator of one, split from the world's (collective: every rank of the
// world calls it at the same point). The reference of tests that compare a layout with one rank.
std::unique_ptr<dist::Communicator> alone_comm();

// A communicator of this process alone ("local", one rank, CPU), apart from the world's: the
// tensor-parallel group of one of the single-process tests.
std::unique_ptr<dist::Communicator> local_comm();

// Whether a CUDA GPU is usable here.
bool has_cuda();

// Runs `python3 <DTRAIN_SOURCE_DIR>/<script> args...` with the torch of the build (.venv)
// and returns its stdout; a non-zero exit fails the calling test (ADD_FAILURE) and returns "".
// Python's torch is the independent reference for optimizers, the loss scaler and layers.
std::string run_python(const std::string& script, const std::vector<std::string>& args);
// Path of a file in the source tree.
std::string source_path(const std::string& relative);

// Tensor-parallel group sizes to test on this world: 2, 4, ... dividing the world size.
std::vector<int> tp_group_sizes();
// A float64 CPU tensor of normal random numbers drawn from `seed`: the same on every rank.
at::Tensor same_everywhere(std::vector<int64_t> shape, uint64_t seed);

// ‖a − b‖ / max(‖b‖, tiny), computed in float64 on the CPU.
double rel_error(const at::Tensor& a, const at::Tensor& b);

// Removes a file or directory tree (POSIX nftw, not std::filesystem: libtorch.so exports its
// own std::filesystem functions and a test binary binds to them, which crashes with this
// libstdc++). Missing paths are ignored.
void remove_tree(const std::string& path);

// A fresh path under $TMPDIR (default /tmp) unique to this process, created as an empty
// directory when `create`, removed with everything under it at the end.
class ScratchDir {
 public:
  ScratchDir(const std::string& name, bool create);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& str() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The message of the dtrain::Error that fn throws; fails the calling test (ADD_FAILURE) and
// returns "" when it throws none.
std::string error_of(const std::function<void()>& fn);

// Whether fn throws a dtrain::Error whose message contains `needle`, for EXPECT_TRUE (the
// failure says what was thrown).
::testing::AssertionResult throws_error_with(const std::function<void()>& fn,
                                             const std::string& needle);

}  // namespace dtrain::testing_util

#define DTRAIN_SKIP_WITHOUT_CUDA()                                              \
  do {                                                                          \
    if (!::dtrain::testing_util::has_cuda()) GTEST_SKIP() << "no CUDA GPU here"; \
  } while (0)
