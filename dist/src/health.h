// Private: which ranks have reached a stalled collective (no MPI in this header).
//
// Every communicator of a multi-process job registers with its process's health service and
// records how far its operations have got (OpProgress). When the watchdog sees an operation
// stall, the communicator's HealthTicket asks the other members, over a dedicated MPI
// communicator, whether they have reached that operation; the answers become the
// "rank 3 (host node2) has not reached it; ranks 1,2 are waiting in it too" part of the
// stall and timeout messages. A peer that is stopped, dead or unreachable does not answer and
// is reported as such once a bounded window has passed: asking never hangs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace dtrain::dist {

class HealthService;  // mpi_health.h

// Identifies one communicator on every rank of it: the lowest world rank among its members
// (the owner), the owner's per-process creation counter for it (broadcast from the owner when
// the communicator is made), and the backend kind (0: mpi, 1: nccl over that MPI partner).
struct CommKey {
  int64_t owner = -1;
  int64_t counter = -1;
  int64_t kind = 0;
  bool operator<(const CommKey& o) const {
    return std::tie(owner, counter, kind) < std::tie(o.owner, o.counter, o.kind);
  }
  bool operator==(const CommKey& o) const {
    return owner == o.owner && counter == o.counter && kind == o.kind;
  }
};

// How far this rank has got on one communicator. Written by the backend (any thread), read
// by the health service's thread. Sequence numbers as in Work::sequence(); 0: none yet.
struct OpProgress {
  std::atomic<uint64_t> reached{0};    // highest operation this rank has entered
  std::atomic<uint64_t> completed{0};  // highest operation finished on this rank
  // Raises completed to seq (never lowers it).
  void complete(uint64_t seq);
};

// One other member's answer about an operation, for format_arrivals().
struct PeerArrival {
  enum class State {
    kNoReply,      // no answer within the window: stopped, dead or unreachable
    kUnknownComm,  // it has no such communicator (not created yet, or already destroyed)
    kNotReached,   // it has not entered the operation yet
    kWaiting,      // it is in the operation too
    kCompleted,    // it has already finished the operation
  };
  int world_rank = 0;
  std::string host;
  State state = State::kNoReply;
  uint64_t reached = 0;  // its OpProgress (answers only)
  uint64_t completed = 0;
  std::string doing;  // the collective it has waited in longest, if any ("" if none)
};

// Text naming who, of the other members, has not reached an operation ("it"), e.g.
//   "rank 3 (host node2) has not reached it (rank 3: no reply - stopped, dead or
//    unreachable); ranks 1,2 are waiting in it too"
// Ranks are world ranks, in increasing order.
std::string format_arrivals(std::vector<PeerArrival> peers);

// How long a stall check waits for answers: min(5 s, timeout / 4), at least 100 ms.
std::chrono::milliseconds arrival_window(std::chrono::milliseconds timeout);

// Tests: this process's health service neither receives nor answers for `duration`, as if the
// process were stopped. Returns false when there is no service (no MPI runtime alive, one
// rank, or no MPI_THREAD_MULTIPLE).
bool pause_health_service_for_testing(std::chrono::milliseconds duration);

// A communicator's registration with the health service. Thread-safe. Destroying it
// unregisters the communicator (peers asking about it afterwards hear "unknown").
class HealthTicket {
 public:
  HealthTicket(std::weak_ptr<HealthService> service, CommKey key, std::vector<int> members,
               std::shared_ptr<OpProgress> progress);
  ~HealthTicket();
  HealthTicket(const HealthTicket&) = delete;
  HealthTicket& operator=(const HealthTicket&) = delete;

  const CommKey& key() const { return key_; }
  const std::vector<int>& members() const { return members_; }  // world ranks, by local rank
  OpProgress& progress() const { return *progress_; }

  // Asks every other member whether it has reached operation seq and waits for the answers,
  // at most `window` (returns early once all have answered). Synchronous; call it from a
  // thread that may block that long (the watchdog's reporter, never an executor). Returns
  // format_arrivals()'s text, or "" once the service has shut down.
  std::string arrivals(uint64_t seq, std::chrono::milliseconds window) const;

  // Registers another communicator over the same ranks, of backend kind `kind` (nccl over
  // this MPI communicator); nullptr when the service has shut down.
  std::shared_ptr<HealthTicket> sibling(int64_t kind) const;

 private:
  std::weak_ptr<HealthService> service_;
  CommKey key_;
  std::vector<int> members_;
  std::shared_ptr<OpProgress> progress_;
};

}  // namespace dtrain::dist
