// The reducer's bucket assignment (reducer_buckets.h).
#include "reducer_buckets.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <string>

#include <ATen/ATen.h>

#include "dtrain/dist/error.h"

namespace dtrain::engine::reducer_detail {

std::vector<std::vector<size_t>> assign_consecutive_buckets(const std::vector<at::Tensor>& params,
                                                            int64_t first_bytes, int64_t bytes,
                                                            const std::vector<std::pair<int, int>>& owner_spans) {
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> open;
  int64_t open_bytes = 0;
  auto close = [&] {
    if (open.empty()) return;
    std::reverse(open.begin(), open.end());
    buckets.push_back(std::move(open));
    open.clear();
    open_bytes = 0;
  };
  for (size_t k = params.size(); k-- > 0;) {
    const at::Tensor& p = params[k];
    if (!open.empty()) {
      const at::Tensor& q = params[open.back()];
      if (q.scalar_type() != p.scalar_type() || q.device() != p.device()) {
        close();
      } else if (!owner_spans.empty() && owner_spans[k].first >= 0 && owner_spans[open.back()].first >= 0 &&
                 owner_spans[k] != owner_spans[open.back()]) {
        close();
      }
    }
    open.push_back(k);
    open_bytes += p.numel() * p.element_size();
    if (open_bytes >= (buckets.empty() ? first_bytes : bytes)) close();
  }
  close();
  return buckets;
}

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                const std::vector<size_t>& order,
                                                int64_t first_bytes, int64_t bytes) {
  std::vector<std::vector<size_t>> closed;
  std::map<std::pair<int, std::string>, std::vector<size_t>> open;
  std::map<std::pair<int, std::string>, int64_t> open_bytes;
  auto limit = [&] { return closed.empty() ? first_bytes : bytes; };
  for (size_t i : order) {
    const at::Tensor& p = params[i];
    auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
    open[key].push_back(i);
    open_bytes[key] += p.numel() * p.element_size();
    if (open_bytes[key] >= limit()) {
      closed.push_back(std::move(open[key]));
      open.erase(key);
      open_bytes.erase(key);
    }
  }
  for (auto& [key, idx] : open) closed.push_back(std::move(idx));
  std::vector<size_t> position(params.size());
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  auto first_pos = [&](const std::vector<size_t>& b) {
    size_t m = SIZE_MAX;
    for (size_t i : b) m = std::min(m, position[i]);
    return m;
  };
  std::sort(closed.begin(), closed.end(),
            [&](const auto& a, const auto& b) { return first_pos(a) < first_pos(b); });
  return closed;
}

std::vector<std::vector<size_t>> fixed_buckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& starts,
                                               const std::string& strategy) {
  std::vector<std::vector<size_t>> buckets;
  for (size_t k = starts.size(); k-- > 0;) {  // launched from the last, as backward produces them
    const size_t end = k + 1 < starts.size() ? starts[k + 1] : params.size();
    DTRAIN_CHECK(starts.front() == 0 && starts[k] < end && end <= params.size(), "the '", strategy,
                 "' bucket strategy's buckets must begin at parameter 0 and ascend below ", params.size(),
                 "; bucket ", k, " begins at ", starts[k]);
    std::vector<size_t> bucket;
    for (size_t i = starts[k]; i < end; ++i) {
      DTRAIN_CHECK(params[i].scalar_type() == params[starts[k]].scalar_type() &&
                   params[i].device() == params[starts[k]].device(), "the '", strategy, "' bucket strategy's bucket ",
                   k, " mixes dtypes or devices (parameter #", i, "); a bucket is one flat tensor");
      bucket.push_back(i);
    }
    buckets.push_back(std::move(bucket));
  }
  return buckets;
}

}  // namespace dtrain::engine::reducer_detail
