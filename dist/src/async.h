// Private building blocks of the backends: a serial executor thread, the host-completed Work,
// and the process-wide collective watchdog.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist {

// Runs posted tasks one at a time, in order, on its own thread. The destructor runs what is
// already queued, then joins. Tasks must not throw (they store failures in their Work).
class SerialExecutor {
 public:
  explicit SerialExecutor(std::string name);
  ~SerialExecutor();
  void post(std::function<void()> task);
  // Posts task and waits for it; rethrows what it threw.
  void run_sync(const std::function<void()>& task);

 private:
  void loop();
  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mutex_
  bool stopping_ = false;                    // guarded by mutex_
  std::thread thread_;
};

// A Work completed by a host thread (the executor) calling finish().
class HostWork : public Work {
 public:
  explicit HostWork(uint64_t seq) : seq_(seq) {}
  void wait() override;
  void synchronize() override { wait(); }
  bool is_completed() override;
  uint64_t sequence() const override { return seq_; }
  // Marks the operation done (with its failure, if any) and wakes waiters.
  void finish(std::exception_ptr error = nullptr);
  // Records when the executor began the operation (finish() records the end).
  void mark_started();
  bool timing(std::chrono::steady_clock::time_point* start,
              std::chrono::steady_clock::time_point* end) const override;

 private:
  const uint64_t seq_;
  std::chrono::steady_clock::time_point started_{}, ended_{};  // guarded by mutex_
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;          // guarded by mutex_
  std::exception_ptr error_;   // guarded by mutex_
};

// Watches every collective in flight in this process. One that is not done after its
// timeout is logged (what, sequence, timeout), its communicator is aborted and the process
// exits with kExitCollectiveTimeout. Halfway to the timeout a warning is logged
// ("collective stall: ..."), naming the ranks that have not reached the operation when the
// entry can find them out (Entry::arrivals); the timeout message repeats that finding.
class Watchdog {
 public:
  struct Entry {
    std::string what;                      // "all_reduce #12 on 'world' (mpi, rank 0/2, float32[1024])"
    std::chrono::milliseconds timeout{0};
    std::function<bool()> done;            // polled from the watchdog thread; may throw
    std::function<void()> abort;           // best effort; may be empty
    // Optional: who has and has not reached the operation ("rank 3 (host h) has not reached
    // it; ..."). Called once, at the stall warning, on a thread of its own (the warning is
    // logged when it returns), so it may block, but it must return well within the rest of
    // the timeout (HealthTicket::arrivals waits at most arrival_window(timeout)).
    std::function<std::string()> arrivals;
    // Optional: polled with done(); a non-empty text means the operation has failed for good
    // (NCCL's asynchronous error after a peer or network failure). The process then ends at
    // once with that text (exit kExitFailure) instead of waiting out the timeout.
    std::function<std::string()> failure;
    // Optional: the communicator the entry belongs to, for unwatch_owner().
    const void* owner = nullptr;
  };
  // The process-wide watchdog (started on first use; its thread is a daemon).
  static Watchdog& instance();
  // Starts watching; returns a token for unwatch(). Entries whose done() turns true are
  // dropped automatically as well.
  uint64_t watch(Entry entry);
  void unwatch(uint64_t token);
  // Drops every entry of this owner; no poll of them runs after it returns (a communicator's
  // destructor calls it before freeing what the entries' callbacks use).
  void unwatch_owner(const void* owner);
  // Replaces the exit on timeout (tests): called with the message instead of exiting.
  void set_timeout_handler_for_testing(std::function<void(const std::string&)> handler);
  // Tests: also called with every stall warning (after it is logged), from the thread that
  // logs it. nullptr removes the handler.
  void set_warning_handler_for_testing(std::function<void(const std::string&)> handler);
  // Stops polling for good (no done()/failure() call after it returns); what is watched is
  // neither reported nor aborted any more. Called at process exit, before the CUDA runtime
  // is torn down, so an event query cannot run against a dead runtime and log a spurious
  // "cannot tell whether ... completed". Idempotent.
  void shutdown();
  // Registers shutdown() with std::atexit. Handlers run in reverse order of registration:
  // call it after the runtime whose teardown it must precede has started (the NCCL backend
  // does, once CUDA is initialized).
  static void shutdown_at_exit();
  // The watched operation in flight longest, with how long it has waited
  // ("all_reduce #4 on 'world/tp1' (...) for 2.5 s"), or "" when none is.
  std::string oldest_in_flight();

 private:
  Watchdog();
  void loop();
  // The outcome of an entry's arrivals() call, shared with the thread that makes it.
  struct StallReport {
    std::mutex mutex;
    bool done = false;        // guarded by mutex
    std::string text;         // guarded by mutex
    double waited_s = 0;      // when the check began (immutable)
  };
  struct Watched {
    Entry entry;
    std::chrono::steady_clock::time_point start;
    bool warned = false;
    bool query_failed = false;  // done() threw (logged once)
    std::shared_ptr<StallReport> report;  // set at the warning when entry.arrivals is
  };
  // An operation to end the process for: (message, abort, exit code).
  struct Fatal {
    std::string message;
    std::function<void()> abort;
    int code;
  };
  // One tick's look at a watched operation (mutex_ held): true when it is no longer watched
  // (completed, or failed / timed out: then `fatal` has it); warns at half its timeout.
  bool settled(Watched& w, std::chrono::steady_clock::time_point now, double not_running_s,
               std::vector<Fatal>& fatal);
  // Ends the process for f (the test handler instead, when set).
  static void end_process(const Fatal& f, const std::function<void(const std::string&)>& handler);
  void warn(const Watched& w, double waited_s);
  // not_running_s > 0: this process itself did not run for that long just before the check.
  static std::string timeout_message(const Watched& w, double not_running_s);
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<uint64_t, Watched> watched_;  // guarded by mutex_
  uint64_t next_token_ = 1;              // guarded by mutex_
  bool stopped_ = false;                 // guarded by mutex_
  std::function<void(const std::string&)> on_timeout_;  // guarded by mutex_
  std::shared_ptr<std::function<void(const std::string&)>> on_warning_;  // guarded by mutex_
};

// A blocking call nothing can interrupt from outside (ncclCommInitRank, MPI_Comm_dup of WORLD,
// Communicator::split: each waits for every member to arrive), bounded like a collective: while the
// scope lives the watchdog watches it, and past `timeout` the process ends with the timeout
// message naming `what` (a peer that died before arriving would otherwise hang the rest for
// good). The scope's end marks it done.
class WatchedCall {
 public:
  WatchedCall(std::string what, std::chrono::milliseconds timeout);
  ~WatchedCall();
  WatchedCall(const WatchedCall&) = delete;
  WatchedCall& operator=(const WatchedCall&) = delete;

 private:
  uint64_t token_ = 0;
};

// Describes an operation for messages: "all_reduce #3 on 'world' (mpi, rank 0/2, float32[4,4], sum)";
// for send and recv `root` is the peer: "send #2 to rank 1 on 'world' (mpi, rank 0/2, float32[8])".
std::string describe_op(const Communicator& comm, OpType type, const at::Tensor& tensor,
                        ReduceOp reduce, int root, uint64_t seq);

}  // namespace dtrain::dist
