// Private: the process's health service over MPI (see health.h for what it answers).
//
// Protocol, on a duplicate of MPI_COMM_WORLD used for nothing else (tag kHealthTag, fixed-size
// messages of HealthMessage as bytes, small enough to be sent eagerly):
//  * ask   "have you reached operation SEQ of communicator KEY?"  (nonce N)
//  * reply "on KEY I have entered REACHED and finished COMPLETED; I wait in DOING" (nonce N)
// One service thread per process makes every MPI call on that communicator: it sends the
// asks of pending queries (MPI_Isend), receives whatever has arrived (MPI_Improbe/MPI_Mrecv,
// never a blocking receive), answers asks at once from the registered OpProgress, and hands
// replies to the query that is waiting for them. Replies to a query that has given up are
// dropped. A stopped or dead peer therefore delays nothing but its own answer.
//
// Needs MPI_THREAD_MULTIPLE (the service thread runs MPI calls beside the executors).
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "health.h"

namespace dtrain::dist {

struct HealthMessage;  // mpi_health.cc

class HealthService : public std::enable_shared_from_this<HealthService> {
 public:
  // Collective over MPI_COMM_WORLD (every rank calls it at the same point): duplicates it,
  // gathers the host names and starts the service thread. MPI must be initialized with
  // MPI_THREAD_MULTIPLE. Throws dtrain::Error when an MPI call fails.
  static std::shared_ptr<HealthService> start();
  ~HealthService();

  // Collective over MPI_COMM_WORLD; call once, before MPI_Finalize, on every rank. Stops the
  // service thread (queries in progress return at once), exchanges how many messages each rank
  // sent to each other one, receives every message still on its way, completes this rank's
  // sends and frees the communicator, so MPI_Finalize finds nothing pending. Returns false,
  // leaving all that undone, when the other ranks have not joined the exchange within
  // `deadline` (this rank is leaving on an error of its own; MPI_Finalize would hang too).
  bool shutdown(std::chrono::milliseconds deadline = std::chrono::milliseconds::max());

  int world_rank() const { return world_rank_; }
  int world_size() const { return static_cast<int>(hosts_.size()); }

  // Registers a communicator whose members (world ranks, by local rank) all register it under
  // the same key. Throws dtrain::Error when the key is already registered in this process.
  std::shared_ptr<HealthTicket> join(const CommKey& key, std::vector<int> members,
                                     std::shared_ptr<OpProgress> progress);

  // Tests: the service thread neither receives nor answers for this long (as if the process
  // were stopped); messages wait in MPI meanwhile.
  void pause_for_testing(std::chrono::milliseconds duration);

 private:
  friend class HealthTicket;
  struct Query;
  struct Pending;

  HealthService() = default;
  std::string arrivals(const CommKey& key, const std::vector<int>& members, uint64_t seq,
                       std::chrono::milliseconds window);
  void leave(const CommKey& key);
  void loop();
  void send_asks();
  void receive_all();
  void handle(int source, const HealthMessage& message);
  void isend(int dest, const HealthMessage& message);
  void test_sends();

  MPI_Comm comm_ = MPI_COMM_NULL;
  int world_rank_ = 0;
  std::vector<std::string> hosts_;  // by world rank; immutable after start()

  std::mutex mutex_;
  std::condition_variable wake_;      // the service thread: a query to send, or stop
  std::condition_variable answered_;  // queries: a reply arrived, or stop
  bool stopping_ = false;             // guarded by mutex_
  std::map<CommKey, std::shared_ptr<OpProgress>> registered_;  // guarded by mutex_
  std::map<int64_t, std::shared_ptr<Query>> queries_;          // by nonce; guarded by mutex_
  int64_t next_nonce_ = 1;                                     // guarded by mutex_
  std::chrono::steady_clock::time_point paused_until_{};       // guarded by mutex_

  // Used by the service thread only, then by shutdown() after joining it.
  std::vector<std::unique_ptr<Pending>> sends_;
  std::vector<int64_t> sent_to_;        // messages sent to each world rank
  std::vector<int64_t> received_from_;  // messages received from each world rank
  bool shut_down_ = false;
  std::thread thread_;
};

}  // namespace dtrain::dist
