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
// exits with kExitCollectiveTimeout. Halfway to the timeout a warning is logged.
class Watchdog {
 public:
  struct Entry {
    std::string what;                      // "all_reduce #12 on 'world' (mpi, rank 0/2, float32[1024])"
    std::chrono::milliseconds timeout{0};
    std::function<bool()> done;            // polled from the watchdog thread
    std::function<void()> abort;           // best effort; may be empty
  };
  // The process-wide watchdog (started on first use; its thread is a daemon).
  static Watchdog& instance();
  // Starts watching; returns a token for unwatch(). Entries whose done() turns true are
  // dropped automatically as well.
  uint64_t watch(Entry entry);
  void unwatch(uint64_t token);
  // Replaces the exit on timeout (tests): called with the message instead of exiting.
  void set_timeout_handler_for_testing(std::function<void(const std::string&)> handler);

 private:
  Watchdog();
  void loop();
  struct Watched {
    Entry entry;
    std::chrono::steady_clock::time_point start;
    bool warned = false;
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<uint64_t, Watched> watched_;  // guarded by mutex_
  uint64_t next_token_ = 1;              // guarded by mutex_
  std::function<void(const std::string&)> on_timeout_;  // guarded by mutex_
};

// Describes an operation for messages: "all_reduce #3 on 'world' (mpi, rank 0/2, float32[4,4], sum)".
std::string describe_op(const Communicator& comm, OpType type, const at::Tensor& tensor,
                        ReduceOp reduce, int root, uint64_t seq);

}  // namespace dtrain::dist
