// Fault scenarios run under mpirun by ctest through expect_exit.sh:
//   --mode=timeout   rank 1 never joins; rank 0's all-reduce must end the job by the timeout
//   --mode=mismatch  ranks issue different shapes; debug mode must name the mismatch at once
//   --mode=lone_failure  rank 1 throws while rank 0 is in a collective: the job must end
//                    promptly, non-zero, with rank 1's message (not hang, not wait for the timeout)
//   --mode=p2p_stall rank 0 sends a large message that rank 1 never receives: the watchdog must
//                    end the job by the timeout, naming the send and the peer
//   --mode=split_stall  rank 1 never joins a split of the communicator; rank 0's split (a
//                    blocking MPI_Comm_split) must end the job by the timeout, naming the split
//   --mode=startup_stall  rank 1 stalls before MPI starts: rank 0's first communicator (MPI_Init,
//                    waiting for every rank) must end the job by the timeout, naming MPI's start-up
//   --mode=drain     the other ranks' health services do not answer (as if stopped) and they
//                    join rank 0's all-reduce after its stall check; the job must finish
//                    normally, the unanswered question drained before MPI_Finalize
#include <gflags/gflags.h>

#include <cstdio>
#include <thread>

#include <ATen/ATen.h>

#include "../../dist/src/health.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"

DEFINE_string(mode, "timeout", "timeout, mismatch, lone_failure, p2p_stall, split_stall, startup_stall or drain");
DEFINE_double(timeout_s, 2.0, "collective timeout");

namespace {

// An all-reduce of n ones that must not return (a rank is stalled, or failed); says so if it
// does, `because` naming what should have stopped it.
int all_reduce_that_must_not_return(dtrain::dist::Communicator& comm, int64_t n, const char* because) {
  at::Tensor x = at::ones({n});
  comm.all_reduce(x)->wait();
  std::printf("all_reduce returned although %s\n", because);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  using namespace dtrain;
  try {
    dist::World world = dist::detect_world();
    dist::init_logging(argv[0], world);
    dist::CommOptions options;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(FLAGS_timeout_s * 1000));
    options.debug_collectives = FLAGS_mode == "mismatch";
    if (FLAGS_mode == "startup_stall" && world.rank == 1) {
      std::this_thread::sleep_for(options.timeout * 10);  // stopped before MPI_Init (a user audit: SIGSTOP)
      return 0;
    }
    auto comm = dist::create_communicator("mpi", world, c10::Device(c10::kCPU), options);
    if (FLAGS_mode == "timeout") {
      comm->barrier()->wait();
      if (comm->rank() != 0) {
        std::this_thread::sleep_for(std::chrono::seconds(120));  // a stalled rank
        return 0;
      }
      return all_reduce_that_must_not_return(*comm, 1024, "rank 1 never joined");
    }
    if (FLAGS_mode == "lone_failure") {
      // Rank 1 fails on its own (a file only it cannot read, say) while rank 0 waits in a
      // collective: the communicator goes away during the exception's unwinding.
      comm->barrier()->wait();
      if (comm->rank() == 1) throw Error("rank 1 cannot read its shard of the data set");
      return all_reduce_that_must_not_return(*comm, 16, "rank 1 had failed");
    }
    if (FLAGS_mode == "p2p_stall") {
      comm->barrier()->wait();
      if (comm->rank() == 0) {
        comm->send(at::ones({int64_t{1} << 24}), 1)->wait();  // 64 MiB: no eager delivery
        std::printf("send returned although rank 1 never received it\n");
        return 0;
      }
      std::this_thread::sleep_for(options.timeout * 10);
      return 0;
    }
    if (FLAGS_mode == "split_stall") {
      comm->barrier()->wait();
      if (comm->rank() != 0) {
        std::this_thread::sleep_for(options.timeout * 10);  // a rank that died before the split
        return 0;
      }
      auto child = comm->split(0, 0, "tp");
      std::printf("split returned although rank 1 never joined it\n");
      return 0;
    }
    if (FLAGS_mode == "drain") {
      comm->barrier()->wait();
      if (comm->rank() != 0) {
        if (!dist::pause_health_service_for_testing(std::chrono::seconds(60))) {
          std::fprintf(stderr, "fault_main: no health service to pause\n");
          return kExitFailure;
        }
        // Past rank 0's stall check (at half the timeout) and its window (a quarter), and short
        // of the timeout, with a tenth of the timeout to spare on either side for a loaded machine.
        std::this_thread::sleep_for(options.timeout * 17 / 20);
      }
      at::Tensor x = at::ones({16});
      comm->all_reduce(x)->wait();
      std::printf("drain: rank %d all_reduce gave %g\n", comm->rank(), x[0].item<double>());
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
