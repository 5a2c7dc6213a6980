// A fixed team of worker threads that runs one function on every member at once: the
// fork-join primitive of the CPU optimizer (one call per tile of the flat parameter space).
//
// run(fn) calls fn(0) on the calling thread and fn(1) .. fn(size() - 1) on the workers,
// concurrently, and returns when all have returned (a barrier). Workers spin briefly after
// a run (so back-to-back runs start in about a microsecond) and then sleep on a condition
// variable. Thread-safety: run() may be called by one thread at a time (not reentrant: fn
// must not call run() on the same pool). An exception thrown by fn on any member is
// rethrown by run() after every member has finished (the first one, if several throw).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dtrain::offload {

// Threads to use when the caller says 0: OMP_NUM_THREADS when set to a positive number,
// else the cores this process may run on (sched_getaffinity), else hardware_concurrency().
int default_thread_count();

// A process-wide team of default_thread_count() threads for host work outside the CPU
// optimizer's own team (the gradient norm of host gradients, the offloaded update's gradient
// copies): calls fn(member, members) on each, as ThreadPool::run does; one caller at a time
// (the others wait). Started at its first use.
void run_on_shared_team(const std::function<void(int member, int members)>& fn);

class ThreadPool {
 public:
  // threads >= 1 (the caller counts as one: threads - 1 workers are started). Throws
  // dtrain::Error for threads < 1.
  explicit ThreadPool(int threads);
  ~ThreadPool();  // joins the workers
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }
  void run(const std::function<void(int member)>& fn);

  // [begin, end) split into `members` nearly equal contiguous parts whose inner boundaries
  // are multiples of `align` (absolute indices, so members writing arrays of one base address
  // never share a cache line): the part of `member`. Parts may be empty.
  static std::pair<int64_t, int64_t> part(int64_t begin, int64_t end, int member, int members,
                                          int64_t align);

 private:
  void worker_loop(int member);
  void record_error(std::exception_ptr error);

  const int size_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};            // bumped under mutex_ to start a run
  std::atomic<int> pending_{0};                    // workers still running the current job
  const std::function<void(int)>* job_ = nullptr;  // GUARDED_BY(mutex_) when set; read after
                                                   // a worker observes the new generation
  bool stop_ = false;                              // GUARDED_BY(mutex_)
  std::exception_ptr error_;                       // GUARDED_BY(error_mutex_)
  std::mutex error_mutex_;
};

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
