#include "teardown.h"

#include <atomic>
#include <exception>

namespace dtrain::dist {

const char* to_string(Teardown how) { return how == Teardown::kDestroy ? "destroy" : "abort"; }

void TeardownTracker::launched(WorkPtr last) {
  std::lock_guard<std::mutex> lock(mutex_);
  last_ = std::move(last);
}

void TeardownTracker::set_unlaunched(int64_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  unlaunched_ = n;
}

void TeardownTracker::failed(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_.empty()) failure_ = why.empty() ? "a failure" : why;
}

bool TeardownTracker::has_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !failure_.empty();
}

TeardownDecision TeardownTracker::decide() {
  std::lock_guard<std::mutex> lock(mutex_);
  TeardownDecision d;
  d.how = Teardown::kAbort;
  if (!failure_.empty()) {
    d.why = "after a failure: " + failure_;
    return d;
  }
  if (unlaunched_ > 0) {
    d.why = std::to_string(unlaunched_) + " operation(s) issued in a group that was never ended";
    return d;
  }
  if (last_) {
    bool done = false;
    try {
      done = last_->is_completed();
    } catch (const std::exception& e) {
      d.why = std::string("cannot tell whether operation #") + std::to_string(last_->sequence()) +
              " completed: " + e.what();
      return d;
    }
    if (!done) {
      d.why = "operation #" + std::to_string(last_->sequence()) + " (or one before it) has not completed";
      return d;
    }
  }
  d.how = Teardown::kDestroy;
  return d;
}

namespace {
std::atomic<uint64_t> destroyed{0}, aborted{0};
}  // namespace

TeardownCounts teardown_counts() {
  TeardownCounts c;
  c.destroyed = destroyed.load();
  c.aborted = aborted.load();
  return c;
}

void count_teardown(Teardown how) { ++(how == Teardown::kDestroy ? destroyed : aborted); }

}  // namespace dtrain::dist
