// Test helpers for the checkpoint file system (test binaries that link dtrain::engine).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/engine/state/checkpoint.h"

namespace dtrain::testing_util {

// A checkpoint FileSystem that forwards every call to the POSIX one: a fault-injecting file
// system of a test overrides only what it changes.
class ForwardingFileSystem : public engine::FileSystem {
 public:
  std::unique_ptr<engine::WritableFile> new_writable_file(const std::string& p) override {
    return fs().new_writable_file(p);
  }
  std::unique_ptr<engine::ReadableFile> new_readable_file(const std::string& p) override {
    return fs().new_readable_file(p);
  }
  bool exists(const std::string& p) override { return fs().exists(p); }
  uint64_t file_size(const std::string& p) override { return fs().file_size(p); }
  std::vector<std::string> list_dir(const std::string& d) override { return fs().list_dir(d); }
  void create_dirs(const std::string& d) override { fs().create_dirs(d); }
  void rename(const std::string& a, const std::string& b) override { fs().rename(a, b); }
  void remove(const std::string& p) override { fs().remove(p); }
  void sync_dir(const std::string& d) override { fs().sync_dir(d); }

 protected:
  static engine::FileSystem& fs() { return *engine::default_file_system(); }
};

}  // namespace dtrain::testing_util
