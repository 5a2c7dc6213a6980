// The reducer's bucket assignment (private to the parallel area): which parameters share a
// bucket, in launch order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::engine::reducer_detail {

// Owner mode: consecutive parameters (from the last to the first, the order backward
// produces them) closed into a bucket at the byte limit or where dtype or device changes;
// each bucket lists its parameters in increasing order, so its storage is one flat range.
// With owner_spans (per parameter, the first and last rank owning part of it; {-1, -1} for an
// empty one), a bucket also closes where the owner changes, so each bucket is owned by one
// rank unless a single parameter straddles two ranges.
std::vector<std::vector<size_t>> assign_consecutive_buckets(const std::vector<at::Tensor>& params,
                                                            int64_t first_bytes, int64_t bytes,
                                                            const std::vector<std::pair<int, int>>& owner_spans = {});

// Groups parameter indices (taken in `order`) into buckets of one dtype and device, the
// first at most first_bytes, the rest at most bytes (a parameter larger than the limit gets
// a bucket of its own). Buckets are ordered by their first parameter's position in order.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                const std::vector<size_t>& order,
                                                int64_t first_bytes, int64_t bytes);

// The buckets a strategy fixes (BucketComm::bucket_starts), listed from the last: the one of
// starts[k] holds parameters [starts[k], starts[k + 1]), whatever its bytes. Throws
// dtrain::Error for starts that do not begin at 0 and ascend below the parameter count, or a
// bucket of two dtypes or devices.
std::vector<std::vector<size_t>> fixed_buckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& starts,
                                               const std::string& strategy);

}  // namespace dtrain::engine::reducer_detail

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
