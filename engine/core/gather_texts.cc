#include "dtrain/engine/core/gather_texts.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace dtrain::engine {

std::vector<std::string> gather_texts(dist::Communicator& comm, const std::string& mine) {
  if (comm.size() == 1) return {mine};
  const int n = comm.size();
  at::Tensor lengths = at::empty({n}, at::kLong);
  comm.all_gather(at::tensor({static_cast<int64_t>(mine.size())}, at::kLong), lengths)->wait();
  const int64_t longest = std::max<int64_t>(1, lengths.max().item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<uint8_t>());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  comm.all_gather(bytes, all)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest;
    out.emplace_back(p, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

}  // namespace dtrain::engine
