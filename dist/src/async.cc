#include "async.h"

#include <iterator>
#include <unistd.h>

#include <cstdio>
#include <sstream>

#include <ATen/core/Tensor.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"

namespace dtrain::dist {

SerialExecutor::SerialExecutor(std::string name)
    : name_(std::move(name)), thread_([this] { loop(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SerialExecutor::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DTRAIN_CHECK(!stopping_, "executor ", name_, " is shutting down");
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SerialExecutor::run_sync(const std::function<void()>& task) {
  auto work = std::make_shared<HostWork>(0);
  post([&task, work] {
    try {
      task();
      work->finish();
    } catch (...) {
      work->finish(std::current_exception());
    }
  });
  work->wait();
}

void SerialExecutor::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void HostWork::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool HostWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void HostWork::mark_started() {
  std::lock_guard<std::mutex> lock(mutex_);
  started_ = std::chrono::steady_clock::now();
}

bool HostWork::timing(std::chrono::steady_clock::time_point* start,
                      std::chrono::steady_clock::time_point* end) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!done_ || started_ == std::chrono::steady_clock::time_point{}) return false;
  *start = started_;
  *end = ended_;
  return true;
}

void HostWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ended_ = std::chrono::steady_clock::now();
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

Watchdog& Watchdog::instance() {
  // Leaked on purpose: it must outlive every communicator, including static ones.
  static Watchdog* dog = new Watchdog();
  return *dog;
}

Watchdog::Watchdog() {
  std::thread([this] { loop(); }).detach();
}

uint64_t Watchdog::watch(Entry entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t token = next_token_++;
  watched_.emplace(token,
                   Watched{std::move(entry), std::chrono::steady_clock::now(), false, false, nullptr});
  return token;
}

void Watchdog::unwatch_owner(const void* owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = watched_.begin(); it != watched_.end();) {
    it = it->second.entry.owner == owner ? watched_.erase(it) : std::next(it);
  }
}

void Watchdog::shutdown() {
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_ = true;
  watched_.clear();
}

void Watchdog::shutdown_at_exit() {
  std::atexit([] { Watchdog::instance().shutdown(); });
}

void Watchdog::unwatch(uint64_t token) {
  std::lock_guard<std::mutex> lock(mutex_);
  watched_.erase(token);
}

WatchedCall::WatchedCall(std::string what, std::chrono::milliseconds timeout) {
  Watchdog::Entry entry;
  entry.what = std::move(what);
  entry.timeout = timeout;
  entry.done = [] { return false; };  // done when the scope ends (unwatch)
  token_ = Watchdog::instance().watch(std::move(entry));
}

WatchedCall::~WatchedCall() { Watchdog::instance().unwatch(token_); }

void Watchdog::set_timeout_handler_for_testing(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_timeout_ = std::move(handler);
}

void Watchdog::set_warning_handler_for_testing(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_warning_ = handler
                    ? std::make_shared<std::function<void(const std::string&)>>(std::move(handler))
                    : nullptr;
}

namespace {

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream os;
  os << ms.count() / 1000.0 << " s";
  return os.str();
}

}  // namespace

std::string Watchdog::oldest_in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Watched* oldest = nullptr;
  for (auto& [token, w] : watched_) {
    if (!oldest || w.start < oldest->start) oldest = &w;
  }
  if (!oldest) return "";
  auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - oldest->start);
  // Tenths of a second are enough here, and keep the text short.
  std::ostringstream os;
  os << oldest->entry.what << " for " << waited.count() / 100 / 10.0 << " s";
  return os.str();
}

// Called with mutex_ held.
void Watchdog::warn(const Watched& w, double waited_s) {
  std::ostringstream head;
  head << "collective stall: " << w.entry.what << " has been waiting " << waited_s
       << " s (timeout " << seconds(w.entry.timeout) << ")";
  auto handler = on_warning_;
  if (!w.report) {
    LOG(WARNING) << head.str();
    if (handler) (*handler)(head.str());
    return;
  }
  // Asking the peers may take a while: do it, and log, off the watchdog thread.
  std::thread([head = head.str(), arrivals = w.entry.arrivals, report = w.report, handler] {
    std::string text;
    try {
      text = arrivals();
    } catch (const std::exception& e) {
      text = std::string("(could not find out which ranks have arrived: ") + e.what() + ")";
    }
    {
      std::lock_guard<std::mutex> lock(report->mutex);
      report->text = text;
      report->done = true;
    }
    std::string message = text.empty() ? head : head + "; " + text;
    LOG(WARNING) << message;
    if (handler) (*handler)(message);
  }).detach();
}

std::string Watchdog::timeout_message(const Watched& w, double not_running_s) {
  std::ostringstream msg;
  msg << "collective timeout: " << w.entry.what << " did not complete within "
      << seconds(w.entry.timeout) << " (" << process_identity() << ")";
  if (not_running_s > 0) {
    msg << "; this process itself did not run for " << not_running_s
        << " s just before (stopped or starved), so the stall may be its own";
  }
  if (w.report) {
    std::lock_guard<std::mutex> lock(w.report->mutex);
    if (!w.report->done) {
      msg << "; the check of which ranks had arrived did not finish";
    } else if (!w.report->text.empty()) {
      msg << "; at " << w.report->waited_s << " s " << w.report->text;
    }
  }
  msg << "; a peer rank is stalled, dead, or issued a different collective. "
      << "Raise --collective_timeout_s if the step is legitimately this slow; set "
      << "DTRAIN_DEBUG_COLLECTIVES=1 to check that ranks issue the same collectives.";
  return msg.str();
}

bool Watchdog::settled(Watched& w, std::chrono::steady_clock::time_point now, double not_running_s,
                       std::vector<Fatal>& fatal) {
  bool done = false;
  try {
    done = w.entry.done && w.entry.done();
  } catch (const std::exception& e) {
    // E.g. a sticky CUDA error from an event query: the operation cannot complete normally;
    // its timeout ends the process with the usual message.
    if (!w.query_failed) {
      LOG(ERROR) << "cannot tell whether " << w.entry.what << " completed: " << e.what() << "; waiting for its timeout";
    }
    w.query_failed = true;
  }
  if (done) return true;
  std::string failed;
  if (w.entry.failure) {
    try {
      failed = w.entry.failure();
    } catch (const std::exception& e) {
      failed = e.what();
    }
  }
  if (!failed.empty()) {
    fatal.push_back({"collective failure: " + w.entry.what + " failed: " + failed + " (" + process_identity() +
                         "); a peer rank or the network failed: see that rank's log",
                     w.entry.abort, kExitFailure});
    return true;
  }
  auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - w.start);
  if (waited >= w.entry.timeout) {
    fatal.push_back({timeout_message(w, not_running_s), w.entry.abort, kExitCollectiveTimeout});
    return true;
  }
  if (!w.warned && waited >= w.entry.timeout / 2) {
    w.warned = true;
    if (w.entry.arrivals) {
      w.report = std::make_shared<StallReport>();
      w.report->waited_s = waited.count() / 1000.0;
    }
    warn(w, waited.count() / 1000.0);
  }
  return false;
}

void Watchdog::end_process(const Fatal& f, const std::function<void(const std::string&)>& handler) {
  if (handler) {
    handler(f.message);
    return;
  }
  LOG(ERROR) << f.message;
  std::fprintf(stderr, "%s\n", f.message.c_str());
  std::fflush(stderr);
  // If aborting the communicator hangs, leave anyway.
  std::thread([code = f.code] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(code);
  }).detach();
  if (f.abort) f.abort();
  std::_Exit(f.code);
}

void Watchdog::loop() {
  // A tick much later than planned means this process was stopped (SIGSTOP) or starved.
  constexpr auto kTick = std::chrono::milliseconds(100);
  constexpr auto kNotRunning = std::chrono::seconds(2);
  auto last_tick = std::chrono::steady_clock::now();
  for (;;) {
    std::this_thread::sleep_for(kTick);
    std::vector<Fatal> fatal;
    std::function<void(const std::string&)> handler;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      auto now = std::chrono::steady_clock::now();
      auto gap = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_tick - kTick);
      double not_running_s = gap >= kNotRunning ? gap.count() / 1000.0 : 0.0;
      last_tick = now;
      for (auto it = watched_.begin(); it != watched_.end();) {
        it = settled(it->second, now, not_running_s, fatal) ? watched_.erase(it) : std::next(it);
      }
      handler = on_timeout_;
    }
    for (const Fatal& f : fatal) end_process(f, handler);
  }
}

std::string describe_op(const Communicator& comm, OpType type, const at::Tensor& tensor,
                        ReduceOp reduce, int root, uint64_t seq) {
  std::ostringstream os;
  os << to_string(type) << " #" << seq;
  if (type == OpType::kSend) os << " to rank " << root;
  if (type == OpType::kRecv) os << " from rank " << root;
  os << " on '" << comm.name() << "' (" << comm.backend()
     << ", rank " << comm.rank() << "/" << comm.size();
  if (tensor.defined()) {
    os << ", " << c10::toString(tensor.scalar_type()) << tensor.sizes();
  }
  if (type == OpType::kAllReduce || type == OpType::kReduceScatter || type == OpType::kReduce) {
    os << ", " << to_string(reduce);
  }
  if (type == OpType::kBroadcast || type == OpType::kReduce) os << ", root " << root;
  os << ")";
  return os.str();
}

}  // namespace dtrain::dist
