// The optimizer's worker team: fork-join over a generation counter.
#include "dtrain/offload/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

// How long an idle worker polls for the next run before it sleeps.
constexpr std::chrono::microseconds kSpin{200};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

int default_thread_count() {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

ThreadPool::ThreadPool(int threads) : size_(threads) {
  DTRAIN_CHECK(threads >= 1, "thread pool: threads = ", threads, " must be at least 1");
  workers_.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::record_error(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (!error_) error_ = error;
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (size_ > 1) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      pending_.store(size_ - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
  }
  try {
    fn(0);
  } catch (...) {
    record_error(std::current_exception());
  }
  // Spin, then yield: on an oversubscribed machine a descheduled worker needs the core.
  for (int polls = 0; pending_.load(std::memory_order_acquire) != 0; ++polls) {
    if (polls < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::worker_loop(int member) {
  uint64_t seen = 0;
  for (;;) {
    // Poll for a new generation for a little while, then sleep until one is published.
    auto spin_until = std::chrono::steady_clock::now() + kSpin;
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      cpu_relax();
      if (++polls % 64 == 0 && std::chrono::steady_clock::now() > spin_until) break;
    }
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      job = job_;
    }
    try {
      (*job)(member);
    } catch (...) {
      record_error(std::current_exception());
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

std::pair<int64_t, int64_t> ThreadPool::part(int64_t begin, int64_t end, int member, int members,
                                             int64_t align) {
  const int64_t n = end - begin;
  auto boundary = [&](int k) {
    if (k <= 0) return begin;
    if (k >= members) return end;
    const int64_t raw = begin + n / members * k + n % members * k / members;
    const int64_t aligned = (raw + align / 2) / align * align;
    return std::clamp(aligned, begin, end);
  };
  return {boundary(member), boundary(member + 1)};
}

void run_on_shared_team(const std::function<void(int member, int members)>& fn) {
  static std::mutex mutex;
  static ThreadPool* team = new ThreadPool(default_thread_count());  // never joined: used until exit
  std::lock_guard<std::mutex> lock(mutex);
  const int members = team->size();
  team->run([&](int member) { fn(member, members); });
}

}  // namespace dtrain::offload
