// Partitioned (sharded) state: ranges of the flat parameter space and one rank's part of an
// optimizer state that is split across the data-parallel group.
//
// The flat parameter space of an optimizer is its parameters laid end to end, in the order
// of Optimizer::params(). There is one layout for every partitioned state in dtrain, the one
// of offload::shard_range(): numel elements padded to a multiple of ranks x
// offload::kShardAlign and split evenly, so rank r's range is [r * S, (r + 1) * S) with
// S = padded / ranks, of which the elements below numel are real. Ranges are carried with the
// state (ShardState::range), so a checkpoint says which elements each rank file holds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::engine {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Elements [begin, end) of a flat space.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const FlatRange& other) const { return begin == other.begin && end == other.end; }
  bool operator!=(const FlatRange& other) const { return !(*this == other); }
};

// Rank `rank` of `ranks` in the layout above, clipped to the real elements [0, numel) (an
// empty range at numel when the rank holds only padding). Throws dtrain::Error for numel < 0
// or a rank outside [0, ranks).
FlatRange shard_range(int64_t numel, int ranks, int rank);

// The partitioned part of an optimizer's state on one rank.
struct ShardLayout {
  int64_t numel = 0;  // elements of the whole flat space
  FlatRange range;    // the real elements this rank holds
};
struct ShardState {
  ShardLayout layout;
  // 1-D tensors of layout.range.size() elements ("master", "exp_avg", ...), and 0-dim
  // tensors whose value is the same on every rank ("step").
  NamedTensors tensors;
};

// The old ranks whose ranges (layout above, numel elements over old_ranks) overlap `range`,
// ascending.
std::vector<int> overlapping_shards(int64_t numel, int old_ranks, FlatRange range);

// The state of `range` assembled from states saved by any number of ranks in any layout
// (each saved state's own range says where its 1-D entries belong): every 1-D entry is cut
// from the saved pieces that overlap the range, in float32; every 0-dim entry is taken from
// the first piece after checking that all pieces agree. Throws dtrain::Error naming the
// problem: an element of the range no piece covers, a piece of another numel, an entry of the
// wrong length, pieces with different entries, 0-dim entries that differ.
ShardState assemble_shard(const std::vector<ShardState>& pieces, const ShardLayout& target);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
