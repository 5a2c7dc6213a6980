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
#include "dtrain/engine/checkpoint.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace dtrain::engine {
namespace {

[[noreturn]] void io_failure(const std::string& what, const std::string& path, int error) {
  throw Error(
      detail::concat("checkpoint I/O: cannot ", what, " '", path, "': ", std::strerror(error)));
}

// ---- CRC-32C ------------------------------------------------------------------------------------

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;

// Tables for slicing-by-8: table[0] is the byte-wise table, table[k][b] the CRC of byte b
// followed by k zero bytes.
struct Crc32cTables {
  std::array<std::array<uint32_t, 256>, 8> table;
  Crc32cTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kCastagnoliReflected : 0u);
      table[0][b] = crc;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFFu];
      }
    }
  }
};

const Crc32cTables& tables() {
  static const Crc32cTables instance;
  return instance;
}

uint64_t load_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Works on the inverted register (the caller inverts before and after).
uint32_t crc32c_sliced(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = tables().table;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFFu];
    --n;
  }
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t w = load_le64(p) ^ crc;
    crc = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
          t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^
          t[0][(w >> 56) & 0xFF];
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFFu];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p,
                                                        size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  crc = static_cast<uint32_t>(c);
  while (n-- > 0) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

bool have_sse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

// ---- POSIX files --------------------------------------------------------------------------------

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

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (have_sse42()) return ~crc32c_sse42(crc, p, n);
#endif
  return ~crc32c_sliced(crc, p, n);
}

namespace ckpt_detail {
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  return ~crc32c_sliced(~crc, static_cast<const unsigned char*>(data), n);
}
}  // namespace ckpt_detail

FileSystem* default_file_system() {
  static PosixFileSystem* fs = new PosixFileSystem();  // never destroyed: used at exit
  return fs;
}

}  // namespace dtrain::engine
