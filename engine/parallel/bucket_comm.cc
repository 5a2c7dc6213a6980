#include "dtrain/engine/parallel/bucket_comm.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

BucketLaunch AllReduceBuckets::launch(const at::Tensor& wire, int64_t, dist::Communicator& comm) {
  BucketLaunch out;
  if (comm.size() == 1) {
    // No collective (a one-rank NCCL all-reduce still launches a kernel that reads and writes
    // the whole bucket: about 1 ms of a GPT-124M step on the H100).
    out.mine = dist::completed_work(comm.issued());
    out.works.push_back(out.mine);
    return out;
  }
  out.works.push_back(comm.all_reduce(wire, dist::ReduceOp::kAvg));
  out.mine = out.works.back();
  return out;
}

ReduceToOwnerBuckets::ReduceToOwnerBuckets(std::vector<std::pair<int64_t, int64_t>> owned, int comm_size,
                                           int64_t numel)
    : owned_(std::move(owned)) {
  DTRAIN_CHECK(static_cast<int>(owned_.size()) == comm_size, "ReducerOptions.owned has ", owned_.size(),
               " ranges for a communicator of ", comm_size, " ranks");
  std::vector<std::pair<int64_t, int64_t>> sorted;
  for (const auto& range : owned_) {
    DTRAIN_CHECK(range.first >= 0 && range.first <= range.second, "ReducerOptions.owned: [", range.first, ", ",
                 range.second, ") is not a range");
    if (range.first < range.second) sorted.push_back(range);
  }
  std::sort(sorted.begin(), sorted.end());
  int64_t next = 0;
  for (const auto& range : sorted) {
    DTRAIN_CHECK(range.first == next, "ReducerOptions.owned must cover the ", numel,
                 " gradient elements once: element ", next, " is ",
                 range.first > next ? "owned by no rank" : "owned twice");
    next = range.second;
  }
  DTRAIN_CHECK(next == numel, "ReducerOptions.owned covers ", next, " elements; the parameters have ", numel);
}

BucketLaunch ReduceToOwnerBuckets::launch(const at::Tensor& wire, int64_t flat_begin, dist::Communicator& comm) {
  // Each owner of a part of the bucket receives that part's average.
  // One launch for the bucket's reduces (NCCL groups them), not one per owner.
  BucketLaunch out;
  const int64_t end = flat_begin + wire.numel();
  dist::CommGroup group(comm);
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t lo = std::max(flat_begin, owned_[r].first), hi = std::min(end, owned_[r].second);
    if (lo >= hi) continue;
    out.works.push_back(comm.reduce(wire.narrow(0, lo - flat_begin, hi - lo), r, dist::ReduceOp::kAvg));
    if (r == comm.rank()) out.mine = out.works.back();
  }
  group.close();
  if (!out.mine) out.mine = out.works.back();
  return out;
}

CompressedBuckets::CompressedBuckets(std::unique_ptr<BucketComm> inner, at::ScalarType dtype)
    : inner_(std::move(inner)), dtype_(dtype) {
  DTRAIN_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "reducer compression must be bfloat16 or float16");
}

at::Tensor CompressedBuckets::wire(const at::Tensor& flat) const {
  at::Tensor inner = inner_->wire(flat);
  return inner.scalar_type() == dtype_ ? inner : at::empty({inner.numel()}, inner.options().dtype(dtype_));
}

}  // namespace dtrain::engine
