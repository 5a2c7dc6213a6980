// The POSIX FileSystem behind checkpoints, and CRC-32C.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <string>

#include "checkpoint_internal.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/core/crc32c.h"


namespace dtrain::engine {
namespace {

[[noreturn]] void io_failure(const std::string& what, const std::string& path, int error) {
  throw Error(
      detail::concat("checkpoint I/O: cannot ", what, " '", path, "': ", std::strerror(error)));
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void append(const char* data, size_t n) override {
    while (n > 0) {
      ssize_t done = ::write(fd_, data, n);
      if (done < 0) {
        if (errno == EINTR) continue;
        io_failure("write to", path_, errno);
      }
      data += done;
      n -= static_cast<size_t>(done);
    }
  }
  void sync() override {
    if (::fsync(fd_) != 0) io_failure("fsync", path_, errno);
  }
  void close() override {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) io_failure("close", path_, errno);
  }

 private:
  std::string path_;
  int fd_;
};

class PosixReadableFile : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixReadableFile() override { ::close(fd_); }
  size_t read(char* buffer, size_t n) override {
    while (true) {
      ssize_t got = ::read(fd_, buffer, n);
      if (got >= 0) return static_cast<size_t>(got);
      if (errno != EINTR) io_failure("read", path_, errno);
    }
  }

 private:
  std::string path_;
  int fd_;
};

class PosixFileSystem : public FileSystem {
 public:
  std::unique_ptr<WritableFile> new_writable_file(const std::string& path) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) io_failure("create", path, errno);
    return std::make_unique<PosixWritableFile>(path, fd);
  }
  std::unique_ptr<ReadableFile> new_readable_file(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) io_failure("open", path, errno);
    return std::make_unique<PosixReadableFile>(path, fd);
  }
  bool exists(const std::string& path) override {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0;
  }
  uint64_t file_size(const std::string& path) override {
    struct stat info;
    if (::stat(path.c_str(), &info) != 0) io_failure("stat", path, errno);
    return static_cast<uint64_t>(info.st_size);
  }
  std::vector<std::string> list_dir(const std::string& dir) override {
    DIR* handle = ::opendir(dir.c_str());
    if (!handle) io_failure("list", dir, errno);
    std::vector<std::string> names;
    while (const dirent* entry = ::readdir(handle)) {
      std::string name = entry->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
    }
    ::closedir(handle);
    return names;
  }
  void create_dirs(const std::string& dir) override {
    std::string partial;
    size_t pos = 0;
    while (pos != std::string::npos) {
      pos = dir.find('/', pos + 1);
      partial = dir.substr(0, pos);
      if (partial.empty()) continue;
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        io_failure("create directory", partial, errno);
      }
    }
    struct stat info;
    if (::stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
      throw Error(detail::concat("checkpoint I/O: '", dir, "' is not a directory"));
    }
  }
  void rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) io_failure("rename to '" + to + "'", from, errno);
  }
  void remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) io_failure("remove", path, errno);
  }
  void sync_dir(const std::string& dir) override {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) io_failure("open directory", dir, errno);
    int rc = ::fsync(fd);
    int error = errno;
    ::close(fd);
    // Some file systems (e.g. certain network mounts) cannot fsync a directory.
    if (rc != 0 && error != EINVAL && error != ENOTSUP) io_failure("fsync directory", dir, error);
  }
};

}  // namespace

FileSystem* default_file_system() {
  static PosixFileSystem* fs = new PosixFileSystem();  // never destroyed: used at exit
  return fs;
}

}  // namespace dtrain::engine
