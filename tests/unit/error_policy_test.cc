// The error policy's exit codes (docs/ERRORS.md): a library's failure (CUDA, NCCL, MPI, thrown
// by DTRAIN_LIBRARY_FAILURE) ends a program with kExitFailure, so a scheduler may retry it; a
// user's mistake (DTRAIN_CHECK) with kExitUsage; the message is printed either way.
#include <gtest/gtest.h>

#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/engine/train/cli.h"

namespace dtrain {
namespace {

TEST(ErrorPolicy, ALibraryFailureExitsOneAndAMistakeTwo) {
  try {
    DTRAIN_LIBRARY_FAILURE("NCCL 2.28.9", "ncclAllReduce", " returned unhandled system error");
    FAIL() << "nothing thrown";
  } catch (const Error& e) {  // still a dtrain::Error for callers that catch those
    EXPECT_EQ(exit_code_of(e), kExitFailure);
    EXPECT_NE(std::string(e.what()).find("NCCL 2.28.9 failure at "), std::string::npos) << e.what();
  }
  testing::internal::CaptureStderr();
  const int library = engine::cli::run_main("prog", []() -> int {
    DTRAIN_LIBRARY_FAILURE("MPI (Open MPI v4.1.4)", "MPI_Allreduce", " returned MPI_ERR_TRUNCATE");
  });
  const int mistake = engine::cli::run_main("prog", [] {
    DTRAIN_CHECK(false, "--tp=3 does not divide the world size 4");
    return 0;
  });
  const std::string printed = testing::internal::GetCapturedStderr();
  EXPECT_EQ(library, kExitFailure);
  EXPECT_EQ(mistake, kExitUsage);
  EXPECT_NE(printed.find("prog: MPI (Open MPI v4.1.4) failure at "), std::string::npos) << printed;
  EXPECT_NE(printed.find("prog: --tp=3 does not divide the world size 4"), std::string::npos) << printed;
}

}  // namespace
}  // namespace dtrain
