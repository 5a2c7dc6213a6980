// Collects the watchdog's stall warnings and timeout messages of one process while it lives
// (tests/unit/health_report_test.cc, tests/mpi/stall_arrivals_test.cc). The state is shared with
// the handlers: a warning thread may still hold one after the test.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../dist/src/async.h"

namespace dtrain::dist::testing_watchdog {

class WatchdogMessages {
 public:
  // fail_on_timeout: a timeout message fails the test (ADD_FAILURE) instead of being kept, so a
  // stall that runs into the timeout does not go unnoticed.
  explicit WatchdogMessages(bool fail_on_timeout = false) : state_(std::make_shared<State>()) {
    Watchdog::instance().set_warning_handler_for_testing([state = state_](const std::string& m) {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->warnings.push_back(m);
      state->cv.notify_all();
    });
    Watchdog::instance().set_timeout_handler_for_testing([state = state_, fail_on_timeout](const std::string& m) {
      if (fail_on_timeout) {
        ADD_FAILURE() << "unexpected timeout: " << m;
        return;
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      state->timeouts.push_back(m);
      state->cv.notify_all();
    });
  }
  ~WatchdogMessages() {
    Watchdog::instance().set_warning_handler_for_testing(nullptr);
    Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  }
  WatchdogMessages(const WatchdogMessages&) = delete;
  WatchdogMessages& operator=(const WatchdogMessages&) = delete;

  // The warnings so far, after waiting up to `patience` for at least `count` of them.
  std::vector<std::string> wait_for(size_t count, std::chrono::milliseconds patience) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->cv.wait_for(lock, patience, [&] { return state_->warnings.size() >= count; });
    return state_->warnings;
  }
  // Waits (at most 10 s) for one warning and one timeout message; "" for one that did not come.
  std::pair<std::string, std::string> wait() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->cv.wait_for(lock, std::chrono::seconds(10),
                        [&] { return !state_->warnings.empty() && !state_->timeouts.empty(); });
    return {state_->warnings.empty() ? "" : state_->warnings[0],
            state_->timeouts.empty() ? "" : state_->timeouts[0]};
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<std::string> warnings, timeouts;  // guarded by mutex
  };
  std::shared_ptr<State> state_;
};

}  // namespace dtrain::dist::testing_watchdog
