// Private: the process's MPI runtime (MPI_Init_thread once, MPI_Finalize when the last
// communicator that uses it is gone), datatypes and reduction operators for every dtype.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"

namespace dtrain::dist {

class HealthService;  // mpi_health.h

class MpiRuntime {
 public:
  // Initializes MPI (asking for MPI_THREAD_MULTIPLE) on first use. Throws once MPI was
  // finalized: MPI cannot start twice in one process.
  static std::shared_ptr<MpiRuntime> acquire();
  // The runtime in use, if any (never starts one).
  static std::shared_ptr<MpiRuntime> current();
  ~MpiRuntime();

  MPI_Datatype datatype(c10::ScalarType type) const;
  MPI_Op reduce_op(ReduceOp op, c10::ScalarType type) const;
  const std::string& version() const { return version_; }

  // Held around MPI calls. A no-op when MPI gives MPI_THREAD_MULTIPLE; a process-wide
  // mutex otherwise.
  std::unique_lock<std::mutex> lock();
  // Whether MPI calls are serialized by lock() (no MPI_THREAD_MULTIPLE, or
  // DTRAIN_MPI_SERIALIZE=1 for tests).
  bool serialized() const { return serialize_; }

  // The collective health service (which ranks reached a stalled operation), started with
  // the runtime when the world has more than one rank and MPI gives MPI_THREAD_MULTIPLE;
  // nullptr otherwise, or when DTRAIN_STALL_CHECK=0 (which must then be set on every rank:
  // starting the service is collective). Shut down (collectively) just before MPI_Finalize.
  const std::shared_ptr<HealthService>& health() const { return health_; }
  // Why health() is null, for messages ("" when it is not).
  const std::string& health_unavailable() const { return health_unavailable_; }
  // A new value for each communicator this process joins (for CommKey::counter).
  int64_t next_comm_counter() { return ++comm_counter_; }
  // A communicator's collective timeout: a failing rank waits at most half the shortest for the
  // others to shut down with it (~MpiRuntime), so that it prints its own error before their
  // watchdogs end the job for its silence.
  void note_timeout(std::chrono::milliseconds timeout);

 private:
  MpiRuntime();
  bool owns_init_ = false;
  bool serialize_ = false;
  std::shared_ptr<HealthService> health_;
  std::string health_unavailable_;
  std::atomic<int64_t> comm_counter_{0};
  std::atomic<int64_t> shortest_timeout_ms_{INT64_MAX};
  std::mutex mutex_;
  std::string version_;
  MPI_Op half_ops_[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum, max, min
  MPI_Op bf16_ops_[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

std::string mpi_error_string(int code);
std::string mpi_version();

}  // namespace dtrain::dist

#define MPI_CHECK(call)                                                                   \
  do {                                                                                    \
    int mpi_rc_ = (call);                                                                 \
    if (mpi_rc_ != MPI_SUCCESS) {                                                         \
      DTRAIN_LIBRARY_FAILURE("MPI (" + ::dtrain::dist::mpi_version() + ")", #call,      \
                             " returned ", ::dtrain::dist::mpi_error_string(mpi_rc_));    \
    }                                                                                     \
  } while (0)
