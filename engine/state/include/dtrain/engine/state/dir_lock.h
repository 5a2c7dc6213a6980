// One run per checkpoint directory: an exclusive lock on DIR/.dtrain.lock (flock), held for the
// lock object's lifetime and released by the kernel when the process dies, so a crashed or
// killed run never blocks its requeue.
#pragma once

#include <string>

namespace dtrain::engine {

class DirectoryLock {
 public:
  // Creates dir if needed and takes the lock without waiting; then writes who holds it (host,
  // pid, start time, Slurm job if any) into the lock file. Throws dtrain::Error naming the
  // directory and the holder when another process holds it, or naming the system's reason
  // when the file cannot be created or locked.
  explicit DirectoryLock(const std::string& dir);
  ~DirectoryLock();  // releases the lock (the file stays)
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
