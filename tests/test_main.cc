// Shared main for dtrain's GoogleTest binaries. Under mpirun every rank runs every test;
// rank 0 prints the usual report and other ranks print only their failures, prefixed.
#include <gtest/gtest.h>

#include <cstdio>

#include "dtrain/dist/logging.h"
#include "dtrain/dist/world.h"
#include "test_util.h"

namespace {

class FailuresOnly : public testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  dtrain::dist::World world = dtrain::dist::detect_world();
  dtrain::dist::init_logging(argv[0], world);
  if (world.rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(world.rank));
  }
  int rc = RUN_ALL_TESTS();
  dtrain::testing_util::shutdown();
  return rc;
}
