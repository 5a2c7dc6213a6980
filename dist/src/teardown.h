// Private: how a communicator whose library can hang in an orderly teardown is closed, decided
// apart from the library so that tests check it on any machine (compiled without NCCL too).
//
// NCCL: ncclCommDestroy waits for what is queued on the communicator, and through it for the
// peers; a rank that failed mid-operation leaves it waiting forever. ncclCommAbort returns
// without waiting. So a communicator is destroyed only when it is idle and healthy, and
// aborted otherwise.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist {

enum class Teardown { kDestroy, kAbort };
const char* to_string(Teardown how);

struct TeardownDecision {
  Teardown how = Teardown::kDestroy;
  std::string why;  // for kAbort: "2 operations never launched (a group still open)", ...
};

// What a communicator's destructor needs to know, kept as its operations are issued.
// Thread-safe.
class TeardownTracker {
 public:
  // Every operation as it is launched, in launch order (operations on one stream complete in
  // that order: the last one complete means all are).
  void launched(WorkPtr last);
  // Operations issued but not launched yet (NCCL: inside a group not yet ended).
  void set_unlaunched(int64_t n);
  // A library call failed, or an asynchronous error was reported; `why` says which.
  void failed(const std::string& why);
  bool has_failed() const;
  // kDestroy when nothing is unlaunched, the last launched operation has completed and no
  // failure was seen; else kAbort, saying why. A completion query that throws (a sticky CUDA
  // error) counts as a failure.
  TeardownDecision decide();

 private:
  mutable std::mutex mutex_;
  WorkPtr last_;            // guarded by mutex_
  int64_t unlaunched_ = 0;  // guarded by mutex_
  std::string failure_;     // guarded by mutex_; "" while healthy
};

// How many communicators this process closed each way (the NCCL backend counts its own), so
// tests can see which path a teardown took.
struct TeardownCounts {
  uint64_t destroyed = 0;
  uint64_t aborted = 0;
};
TeardownCounts teardown_counts();
void count_teardown(Teardown how);

}  // namespace dtrain::dist
