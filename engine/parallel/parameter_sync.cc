// Copying one rank's tensors to the others (reducer.h: broadcast_tensors), coalesced.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "dtrain/engine/parallel/reducer.h"

namespace dtrain::engine {
namespace {

// The largest flat buffer one broadcast sends (bounds the extra memory of coalescing).
constexpr int64_t kBroadcastChunkBytes = int64_t{256} << 20;

}  // namespace

void broadcast_tensors(dist::Communicator& comm, const std::vector<at::Tensor>& tensors, int root) {
  if (comm.size() == 1) return;
  // Coalesce by dtype and device into flat chunks of at most kBroadcastChunkBytes.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
    }
  }
  for (auto& [key, group] : groups) {
    size_t start = 0;
    while (start < group.size()) {
      size_t end = start;
      int64_t bytes = 0;
      while (end < group.size() && (end == start || bytes + static_cast<int64_t>(group[end].nbytes()) <= kBroadcastChunkBytes)) {
        bytes += static_cast<int64_t>(group[end].nbytes());
        ++end;
      }
      std::vector<at::Tensor> flat_parts;
      for (size_t k = start; k < end; ++k) flat_parts.push_back(group[k].detach().reshape({-1}));
      at::Tensor flat = at::cat(flat_parts);
      comm.broadcast(flat, root)->wait();
      int64_t off = 0;
      at::NoGradGuard no_grad;
      for (size_t k = start; k < end; ++k) {
        int64_t n = group[k].numel();
        group[k].detach().view({-1}).copy_(flat.narrow(0, off, n));
        off += n;
      }
      start = end;
    }
  }
}

}  // namespace dtrain::engine
