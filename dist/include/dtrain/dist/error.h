// dtrain's error policy, written down once (see docs/ERRORS.md):
//
//  * User mistakes (a bad flag, a shape that does not divide, a missing file) throw
//    dtrain::Error from DTRAIN_CHECK with a message that names the bad value and the fix.
//    Programs catch it in main(), print it and exit with kExitUsage.
//  * Library failures (CUDA, NCCL, MPI) throw dtrain::LibraryError (a dtrain::Error) from the
//    backend's check macro, whose message adds file:line, rank, host and the library's
//    version. Programs exit with kExitFailure (exit_code_of()).
//  * A collective that does not finish within its timeout ends the process with
//    kExitCollectiveTimeout after logging what timed out (no exception: the peer is gone).
//  * Expected failures (no checkpoint yet) are returned as values, not thrown.
//  * Destructors log and never throw.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dtrain {

// Exit codes shared by every dtrain program.
inline constexpr int kExitUsage = 2;              // bad input: the message says what to fix
inline constexpr int kExitFailure = 1;            // a library or runtime failure
inline constexpr int kExitCollectiveTimeout = 124;  // a collective did not complete in time
inline constexpr int kExitRequeue = 85;           // preempted after a checkpoint: requeue me
inline constexpr int kExitPreemptedUnsaved = 143; // preempted with nothing saved (no --save_dir): not to requeue

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A failure of a library dtrain calls (CUDA, NCCL, MPI), thrown by DTRAIN_LIBRARY_FAILURE: not
// the user's input, so programs exit with kExitFailure (a scheduler may retry) instead of
// kExitUsage.
class LibraryError : public Error {
 public:
  using Error::Error;
};

// The exit code of a program that stops on `e`: kExitFailure for a library failure,
// kExitUsage for the rest (a user mistake, whose message names the fix).
inline int exit_code_of(const Error& e) {
  return dynamic_cast<const LibraryError*>(&e) != nullptr ? kExitFailure : kExitUsage;
}

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
}  // namespace detail

// Who this process is, for messages: "rank 3 on host node07". Set once by init_process().
std::string process_identity();
void set_process_identity(int rank, int world_size, const std::string& host);

}  // namespace dtrain

// Throws dtrain::Error with the streamed message when cond is false.
#define DTRAIN_CHECK(cond, ...)                                         \
  do {                                                                  \
    if (!(cond)) {                                                      \
      throw ::dtrain::Error(::dtrain::detail::concat(__VA_ARGS__));     \
    }                                                                   \
  } while (0)

// Throws dtrain::LibraryError tagged with where and who, for failures of libraries we call.
#define DTRAIN_LIBRARY_FAILURE(library, ...)                                            \
  throw ::dtrain::LibraryError(::dtrain::detail::concat(library, " failure at ", __FILE__, ":", \
                                                 __LINE__, " (", ::dtrain::process_identity(), \
                                                 "): ", __VA_ARGS__))

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
