// Helpers of the checkpoint tests (checkpoint_test.cc, checkpoint_state_test.cc): a temporary
// directory, the message of a dtrain::Error, and POSIX file checks.
#pragma once

#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/state/host_staging.h"
#include "dtrain/engine/state/dir_lock.h"
#include "dtrain/engine/core/crc32c.h"
#include "dtrain/offload/cpu_optimizer.h"

#include <dirent.h>
#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "../../engine/state/checkpoint_internal.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/train/preemption.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/train/load.h"
#include "dtrain/engine/train/trainer.h"
#include "dtrain/dist/mesh.h"
#include "test_fs.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {


using testing_util::run_python;

// POSIX file helpers: std::filesystem's remove_all, resize_file and permissions must not be
// used in binaries linking libtorch, whose libtorch.so exports its own incompatible copies
// of them (they crash here).
bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

uint64_t file_size(const std::string& path) {
  struct stat info;
  EXPECT_EQ(::stat(path.c_str(), &info), 0) << path;
  return static_cast<uint64_t>(info.st_size);
}

int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

// A fresh directory under $TMPDIR (or /tmp), removed with the object.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtrain_ckpt_XXXXXX";
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { ::nftw(path_.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    DIR* dir = ::opendir(path_.c_str());
    while (const dirent* e = dir ? ::readdir(dir) : nullptr) {
      std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    if (dir) ::closedir(dir);
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::string path_;
};

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no dtrain::Error thrown";
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

NamedTensors named(std::initializer_list<std::pair<std::string, at::Tensor>> items) {
  return NamedTensors(items);
}


}  // namespace
}  // namespace dtrain::engine
