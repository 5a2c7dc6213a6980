// Partitioned (sharded) state: ranges of the flat parameter space and one rank's part of an
// optimizer state that is split across the data-parallel group.
//
// The flat parameter space of an optimizer is its parameters laid end to end, in the order
// of Optimizer::params(). Every partitioned state in dtrain splits it as offload::shard_range()
// does: numel elements padded to a multiple of ranks x offload::kShardAlign and split evenly,
// so rank r's range is [r * S, (r + 1) * S) with S = padded / ranks, of which the elements
// below numel are real. Either the whole space is split so (one unit: one range per rank), or
// the space is first cut into units (consecutive runs of parameters, ZeRO-3's) and each unit
// is split so (FSDP's layout: rank r holds one piece of every unit, several ranges). The
// ranges are carried with the state (ShardState::layout), so a checkpoint says which elements
// each rank file holds, and any layout is assembled from any other (assemble_shard).
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

// Rank `rank` of `ranks` when [0, numel) is cut into units at unit_bounds and each unit
// [u_k, u_{k+1}) is split as shard_range(u_{k+1} - u_k, ranks, rank) says, shifted by u_k
// (the last unit ends at numel); empty pieces dropped, so a rank that holds only padding has
// no ranges. Throws dtrain::Error for bounds that do not start at 0, do not ascend strictly,
// or reach numel or beyond, and for what shard_range() refuses. unit_bounds empty == {0}: one
// unit, the ranges are shard_range()'s (none when it is empty).
std::vector<FlatRange> shard_ranges(int64_t numel, int ranks, int rank, const std::vector<int64_t>& unit_bounds = {});

// The partitioned part of an optimizer's state on one rank.
struct ShardLayout {
  int64_t numel = 0;                      // elements of the whole flat space
  std::vector<FlatRange> ranges = {};     // the real elements this rank holds: ascending, disjoint, none
                                          // empty (no ranges: it holds nothing)
  std::vector<int64_t> unit_bounds = {};  // where each unit begins in the flat space: ascending, first 0
                                          // (empty: one unit, the whole space)
  int64_t size() const;                   // the elements of `ranges` together
};

// "[b0, e0), [b1, e1)" ("no elements" for none), for messages.
std::string ranges_text(const std::vector<FlatRange>& ranges);

// {numel, shard_ranges(numel, ranks, rank, unit_bounds), unit_bounds}.
ShardLayout shard_layout_of(int64_t numel, int ranks, int rank, const std::vector<int64_t>& unit_bounds = {});

struct ShardState {
  ShardLayout layout;
  // 1-D tensors of layout.size() elements, the elements of layout.ranges end to end
  // ("master", "exp_avg", ...), and 0-dim tensors whose value is the same on every rank ("step").
  NamedTensors tensors;
};

// The old ranks whose ranges (numel elements over old_ranks, cut into units at
// old_unit_bounds as shard_ranges() does) overlap any of `ranges`, ascending.
std::vector<int> overlapping_shards(int64_t numel, int old_ranks, const std::vector<FlatRange>& ranges,
                                    const std::vector<int64_t>& old_unit_bounds = {});

// The state of target.ranges assembled from states saved by any number of ranks in any layout
// (each saved state's own ranges say where its 1-D entries belong): every 1-D entry is the
// target's ranges end to end, cut from the saved pieces that hold them, in the saved dtype;
// every 0-dim entry is taken from the first piece after checking that all pieces agree (a
// target that holds nothing gets them too). Throws dtrain::Error naming the problem: an
// element of the target no piece covers, a piece of another numel, ranges that are not
// ascending disjoint ranges of the space, an entry of the wrong length, pieces with different
// entries, 0-dim entries that differ.
ShardState assemble_shard(const std::vector<ShardState>& pieces, const ShardLayout& target);

// Optimizer state between a partitioned and a replicated layout, over `params` (their flat space:
// the parameters end to end). shard_of_replicated: the replicated entries "<i>.<array>" (i an
// index into params; "step" from the first) laid end to end per array, the weights as "master",
// cut to layout's ranges, on the host in their dtypes; throws dtrain::Error naming an array that
// not every parameter has, or an entry of no parameter. replicated_of_shard: the state of the
// whole flat space back into "<i>.<array>" per parameter (slices shaped as the parameters; with
// to_param_options copied to the parameter's device and dtype), "step" for each, "master" left
// out (the weights are the master).
ShardState shard_of_replicated(const std::vector<at::Tensor>& params, const NamedTensors& replicated,
                               const ShardLayout& layout);
NamedTensors replicated_of_shard(const std::vector<at::Tensor>& params, const ShardState& whole,
                                 bool to_param_options);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
