// Fault scenarios run under mpirun by ctest through expect_exit.sh:
//   --mode=timeout   rank 1 never joins; rank 0's all-reduce must end the job by the timeout
//   --mode=mismatch  ranks issue different shapes; debug mode must name the mismatch at once
#include <gflags/gflags.h>

#include <cstdio>
#include <thread>

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"

DEFINE_string(mode, "timeout", "timeout or mismatch");
DEFINE_double(timeout_s, 2.0, "collective timeout");

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  using namespace dtrain;
  try {
    dist::World world = dist::detect_world();
    dist::init_logging(argv[0], world);
    dist::CommOptions options;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(FLAGS_timeout_s * 1000));
    options.debug_collectives = FLAGS_mode == "mismatch";
    auto comm = dist::create_communicator("mpi", world, c10::Device(c10::kCPU), options);
    if (FLAGS_mode == "timeout") {
      comm->barrier()->wait();
      if (comm->rank() != 0) {
        std::this_thread::sleep_for(std::chrono::seconds(120));  // a stalled rank
        return 0;
      }
      at::Tensor x = at::ones({1024});
      comm->all_reduce(x)->wait();
      std::printf("all_reduce returned although rank 1 never joined\n");
      return 0;
    }
    at::Tensor x = comm->rank() == 0 ? at::ones({4, 4}) : at::ones({8});
    comm->all_reduce(x)->wait();
    std::printf("mismatch went unnoticed\n");
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "fault_main: %s\n", e.what());
    return kExitFailure;
  }
}
