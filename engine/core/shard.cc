// The one layout of partitioned state and the one assembler of ranges from saved pieces.
#include "dtrain/engine/core/shard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

#include "dtrain/dist/error.h"
#include "dtrain/offload/cpu_optimizer.h"

namespace dtrain::engine {

FlatRange shard_range(int64_t numel, int ranks, int rank) {
  DTRAIN_CHECK(numel >= 0, "flat space of ", numel, " elements: must be >= 0");
  DTRAIN_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "rank ", rank, " is not in [0, ", ranks, ")");
  offload::ShardRange s = offload::shard_range(numel, rank, ranks);
  return {std::min(s.begin, numel), std::min(s.end, numel)};
}

std::vector<int> overlapping_shards(int64_t numel, int old_ranks, FlatRange range) {
  std::vector<int> out;
  for (int r = 0; r < old_ranks; ++r) {
    FlatRange s = shard_range(numel, old_ranks, r);
    if (s.begin < range.end && range.begin < s.end) out.push_back(r);
  }
  return out;
}

namespace {

std::string range_text(FlatRange r) {
  std::ostringstream os;
  os << "[" << r.begin << ", " << r.end << ")";
  return os.str();
}

}  // namespace

ShardState assemble_shard(const std::vector<ShardState>& pieces, const ShardLayout& target) {
  DTRAIN_CHECK(!pieces.empty(), "assembling the partitioned state of ", range_text(target.range),
               " needs at least one saved piece");
  const FlatRange want = target.range;
  const NamedTensors& first = pieces.front().tensors;
  ShardState out;
  out.layout = target;
  std::vector<FlatRange> covered;
  for (const ShardState& piece : pieces) {
    const FlatRange have = piece.layout.range;
    DTRAIN_CHECK(piece.layout.numel == target.numel, "a saved optimizer shard holds partitioned state of ",
                 piece.layout.numel, " elements, but this model needs ", target.numel,
                 "; it is of a different model");
    DTRAIN_CHECK(piece.tensors.size() == first.size(), "the saved optimizer shards hold different entries (",
                 piece.tensors.size(), " in the one of ", range_text(have), ", ", first.size(), " in the first)");
    const FlatRange overlap{std::max(have.begin, want.begin), std::min(have.end, want.end)};
    if (overlap.begin < overlap.end) covered.push_back(overlap);
  }
  std::sort(covered.begin(), covered.end(),
            [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  int64_t next = want.begin;
  for (const FlatRange& c : covered) {
    DTRAIN_CHECK(c.begin <= next, "no saved optimizer shard holds elements ", range_text({next, c.begin}),
                 " of this rank's ", range_text(want), "; the checkpoint is incomplete");
    next = std::max(next, c.end);
  }
  DTRAIN_CHECK(next >= want.end, "no saved optimizer shard holds elements ", range_text({next, want.end}),
               " of this rank's ", range_text(want), "; the checkpoint is incomplete");
  for (size_t k = 0; k < first.size(); ++k) {
    const std::string& name = first[k].first;
    const at::Tensor& sample = first[k].second;
    at::Tensor assembled;
    if (sample.dim() == 0) {
      assembled = sample.to(at::kCPU).clone();
    } else {
      DTRAIN_CHECK(sample.dim() == 1, "optimizer shard entry '", name, "' is ", sample.dim(),
                   "-D; a partitioned state holds 1-D and 0-dim entries only");
      assembled = at::zeros({want.size()}, sample.options().device(at::kCPU));  // the saved dtype
    }
    for (const ShardState& piece : pieces) {
      const FlatRange have = piece.layout.range;
      const NamedTensors& entries = piece.tensors;
      DTRAIN_CHECK(entries[k].first == name, "the saved optimizer shards hold different entries (the one of ",
                   range_text(have), " has '", entries[k].first, "' where the first has '", name, "')");
      const at::Tensor& t = entries[k].second;
      if (sample.dim() == 0) {
        DTRAIN_CHECK(t.dim() == 0 && at::equal(t.to(at::kCPU), assembled.to(t.scalar_type())),
                     "the replicated entry '", name, "' differs between the saved optimizer shards");
        continue;
      }
      DTRAIN_CHECK(t.dim() == 1 && t.numel() == have.size(), "optimizer shard entry '", name, "' of ",
                   range_text(have), " has ", t.numel(), " elements; ", have.size(), " were expected");
      const int64_t lo = std::max(have.begin, want.begin), hi = std::min(have.end, want.end);
      if (lo < hi) {
        assembled.narrow(0, lo - want.begin, hi - lo).copy_(t.narrow(0, lo - have.begin, hi - lo));
      }
    }
    out.tensors.emplace_back(name, assembled);
  }
  return out;
}

}  // namespace dtrain::engine
