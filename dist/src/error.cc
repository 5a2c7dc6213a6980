#include "dtrain/dist/error.h"

#include <mutex>

namespace dtrain {
namespace {
std::mutex identity_mutex;
std::string identity = "rank 0 (world not initialized)";  // guarded by identity_mutex
}  // namespace

std::string process_identity() {
  std::lock_guard<std::mutex> lock(identity_mutex);
  return identity;
}

void set_process_identity(int rank, int world_size, const std::string& host) {
  std::lock_guard<std::mutex> lock(identity_mutex);
  identity = detail::concat("rank ", rank, "/", world_size, " on ", host);
}

}  // namespace dtrain
