#include "dtrain/engine/state/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/engine/state/checkpoint.h"

namespace dtrain::engine {
namespace {

std::string holder_text() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  char when[64] = "?";
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  if (::gmtime_r(&now, &tm)) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  std::string text = std::string("host ") + host + ", pid " + std::to_string(::getpid()) + ", since " + when;
  if (const char* job = std::getenv("SLURM_JOB_ID")) text += std::string(", Slurm job ") + job;
  return text;
}

std::string read_all(int fd) {
  std::string out;
  char buf[512];
  ssize_t n = 0;
  ::lseek(fd, 0, SEEK_SET);
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
  return out;
}

}  // namespace

DirectoryLock::DirectoryLock(const std::string& dir) : path_(dir + "/.dtrain.lock") {
  default_file_system()->create_dirs(dir);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  DTRAIN_CHECK(fd_ >= 0, "cannot open the lock file ", path_, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = error == EWOULDBLOCK ? read_all(fd_) : std::string();
    ::close(fd_);
    fd_ = -1;
    DTRAIN_CHECK(error != EWOULDBLOCK, "the checkpoint directory '", dir, "' is in use by another run (",
                 holder.empty() ? std::string("holder unknown") : holder,
                 "); one run per --save_dir: wait for it to end, stop it, or choose another --save_dir");
    throw Error(detail::concat("cannot lock ", path_, ": ", std::strerror(error)));
  }
  const std::string text = holder_text() + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    // The lock itself holds; only the description for others is missing.
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace dtrain::engine
