// The layouts of partitioned state (one range or one piece of every unit per rank) and the one
// assembler of ranges from saved pieces.
#include "dtrain/engine/core/shard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
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

std::vector<FlatRange> shard_ranges(int64_t numel, int ranks, int rank, const std::vector<int64_t>& unit_bounds) {
  DTRAIN_CHECK(numel >= 0, "flat space of ", numel, " elements: must be >= 0");
  const std::vector<int64_t> bounds = unit_bounds.empty() ? std::vector<int64_t>{0} : unit_bounds;
  DTRAIN_CHECK(bounds.front() == 0, "units of a flat space begin at ", bounds.front(), "; the first must begin at 0");
  for (size_t k = 1; k < bounds.size(); ++k) {
    DTRAIN_CHECK(bounds[k] > bounds[k - 1], "unit bounds must ascend strictly; ", bounds[k], " follows ",
                 bounds[k - 1]);
    DTRAIN_CHECK(bounds[k] < numel, "unit bound ", bounds[k], " is not inside the flat space of ", numel,
                 " elements (every unit holds at least one element)");
  }
  std::vector<FlatRange> out;
  for (size_t k = 0; k < bounds.size(); ++k) {
    const int64_t begin = bounds[k], end = k + 1 < bounds.size() ? bounds[k + 1] : numel;
    const FlatRange piece = shard_range(end - begin, ranks, rank);
    if (piece.begin < piece.end) out.push_back({begin + piece.begin, begin + piece.end});
  }
  return out;
}

int64_t ShardLayout::size() const {
  int64_t n = 0;
  for (const FlatRange& r : ranges) n += r.size();
  return n;
}

ShardLayout shard_layout_of(int64_t numel, int ranks, int rank, const std::vector<int64_t>& unit_bounds) {
  return ShardLayout{numel, shard_ranges(numel, ranks, rank, unit_bounds), unit_bounds};
}

namespace {

// Calls fn(lo, hi, a_offset, b_offset) for every overlap [lo, hi) of a range of `a` with one of
// `b` (both ascending and disjoint), with the overlap's place in each list's ranges end to end.
template <typename Fn>
void for_each_overlap(const std::vector<FlatRange>& a, const std::vector<FlatRange>& b, Fn&& fn) {
  size_t i = 0, j = 0;
  int64_t a_offset = 0, b_offset = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].begin, b[j].begin), hi = std::min(a[i].end, b[j].end);
    if (lo < hi) fn(lo, hi, a_offset + lo - a[i].begin, b_offset + lo - b[j].begin);
    if (a[i].end <= b[j].end) {
      a_offset += a[i++].size();
    } else {
      b_offset += b[j++].size();
    }
  }
}

std::string range_text(FlatRange r) {
  std::ostringstream os;
  os << "[" << r.begin << ", " << r.end << ")";
  return os.str();
}

void check_ranges(const ShardLayout& layout, const char* whose) {
  int64_t end = 0;
  for (const FlatRange& r : layout.ranges) {
    DTRAIN_CHECK(r.begin >= end && r.begin <= r.end && r.end <= layout.numel, whose, " ranges ",
                 ranges_text(layout.ranges), " are not ascending, disjoint ranges of a flat space of ", layout.numel,
                 " elements");
    end = r.end;
  }
}

// Throws unless the pieces together hold every element of target.ranges.
void check_covered(const std::vector<ShardState>& pieces, const ShardLayout& target) {
  std::vector<FlatRange> covered;
  for (const ShardState& piece : pieces) {
    for_each_overlap(piece.layout.ranges, target.ranges,
                     [&](int64_t lo, int64_t hi, int64_t, int64_t) { covered.push_back({lo, hi}); });
  }
  std::sort(covered.begin(), covered.end(),
            [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  size_t c = 0;
  for (const FlatRange& want : target.ranges) {
    int64_t next = want.begin;
    for (; c < covered.size() && covered[c].begin < want.end; ++c) {
      DTRAIN_CHECK(covered[c].begin <= next, "no saved optimizer shard holds elements ",
                   range_text({next, covered[c].begin}), " of this rank's ", ranges_text(target.ranges),
                   "; the checkpoint is incomplete");
      next = std::max(next, covered[c].end);
    }
    DTRAIN_CHECK(next >= want.end, "no saved optimizer shard holds elements ", range_text({next, want.end}),
                 " of this rank's ", ranges_text(target.ranges), "; the checkpoint is incomplete");
  }
}

}  // namespace

std::string ranges_text(const std::vector<FlatRange>& ranges) {
  if (ranges.empty()) return "no elements";
  std::string out;
  for (const FlatRange& r : ranges) out += (out.empty() ? "" : ", ") + range_text(r);
  return out;
}

std::vector<int> overlapping_shards(int64_t numel, int old_ranks, const std::vector<FlatRange>& ranges,
                                    const std::vector<int64_t>& old_unit_bounds) {
  std::vector<int> out;
  for (int r = 0; r < old_ranks; ++r) {
    bool overlaps = false;
    for_each_overlap(shard_ranges(numel, old_ranks, r, old_unit_bounds), ranges,
                     [&](int64_t, int64_t, int64_t, int64_t) { overlaps = true; });
    if (overlaps) out.push_back(r);
  }
  return out;
}

ShardState assemble_shard(const std::vector<ShardState>& pieces, const ShardLayout& target) {
  DTRAIN_CHECK(!pieces.empty(), "assembling the partitioned state of ", ranges_text(target.ranges),
               " needs at least one saved piece");
  check_ranges(target, "this rank's");
  const NamedTensors& first = pieces.front().tensors;
  for (const ShardState& piece : pieces) {
    DTRAIN_CHECK(piece.layout.numel == target.numel, "a saved optimizer shard holds partitioned state of ",
                 piece.layout.numel, " elements, but this model needs ", target.numel,
                 "; it is of a different model");
    check_ranges(piece.layout, "a saved optimizer shard's");
    DTRAIN_CHECK(piece.tensors.size() == first.size(), "the saved optimizer shards hold different entries (",
                 piece.tensors.size(), " in the one of ", ranges_text(piece.layout.ranges), ", ", first.size(),
                 " in the first)");
  }
  check_covered(pieces, target);
  ShardState out;
  out.layout = target;
  for (size_t k = 0; k < first.size(); ++k) {
    const std::string& name = first[k].first;
    const at::Tensor& sample = first[k].second;
    at::Tensor assembled;
    if (sample.dim() == 0) {
      assembled = sample.to(at::kCPU).clone();
    } else {
      DTRAIN_CHECK(sample.dim() == 1, "optimizer shard entry '", name, "' is ", sample.dim(),
                   "-D; a partitioned state holds 1-D and 0-dim entries only");
      assembled = at::zeros({target.size()}, sample.options().device(at::kCPU));  // the saved dtype
    }
    for (const ShardState& piece : pieces) {
      const std::vector<FlatRange>& have = piece.layout.ranges;
      const NamedTensors& entries = piece.tensors;
      DTRAIN_CHECK(entries[k].first == name, "the saved optimizer shards hold different entries (the one of ",
                   ranges_text(have), " has '", entries[k].first, "' where the first has '", name, "')");
      const at::Tensor& t = entries[k].second;
      if (sample.dim() == 0) {
        DTRAIN_CHECK(t.dim() == 0 && at::equal(t.to(at::kCPU), assembled.to(t.scalar_type())),
                     "the replicated entry '", name, "' differs between the saved optimizer shards");
        continue;
      }
      DTRAIN_CHECK(t.dim() == 1 && t.numel() == piece.layout.size(), "optimizer shard entry '", name, "' of ",
                   ranges_text(have), " has ", t.numel(), " elements; ", piece.layout.size(), " were expected");
      for_each_overlap(have, target.ranges, [&](int64_t lo, int64_t hi, int64_t from, int64_t to) {
        assembled.narrow(0, to, hi - lo).copy_(t.narrow(0, from, hi - lo));
      });
    }
    out.tensors.emplace_back(name, assembled);
  }
  return out;
}

ShardState shard_of_replicated(const std::vector<at::Tensor>& params, const NamedTensors& replicated,
                               const ShardLayout& layout) {
  // Each state array is the parameters' tensors end to end (the flat space); the range of it.
  std::map<std::string, std::vector<at::Tensor>> arrays;  // slot -> one tensor per parameter
  at::Tensor step;
  for (const auto& [name, t] : replicated) {
    const size_t dot = name.find('.');
    size_t i = params.size();
    if (dot != std::string::npos && dot > 0 && name.find_first_not_of("0123456789") == dot) {
      i = std::stoul(name.substr(0, dot));
    }
    DTRAIN_CHECK(i < params.size(), "the saved optimizer state has '", name, "', which is of none of the ",
                 params.size(), " parameters");
    const std::string slot = name.substr(dot + 1);
    if (slot == "step") {
      if (!step.defined()) step = t.detach().cpu();
      continue;
    }
    std::vector<at::Tensor>& parts = arrays[slot];
    parts.resize(params.size());
    parts[i] = t.detach().reshape({-1});
  }
  std::vector<at::Tensor> weights;
  for (const at::Tensor& p : params) weights.push_back(p.detach().reshape({-1}));
  arrays["master"] = weights;
  ShardState out;
  out.layout = layout;
  if (step.defined()) out.tensors.emplace_back("step", step);
  for (auto& [slot, parts] : arrays) {
    const size_t have = static_cast<size_t>(std::count_if(parts.begin(), parts.end(), [](const at::Tensor& t) { return t.defined(); }));
    DTRAIN_CHECK(have == params.size(), "the saved optimizer state has '", slot, "' for ", have, " of the ",
                 params.size(), " parameters");
    const at::Tensor flat = at::cat(parts);
    std::vector<at::Tensor> pieces;
    for (const FlatRange& r : layout.ranges) pieces.push_back(flat.narrow(0, r.begin, r.size()));
    const at::Tensor mine = pieces.empty() ? flat.narrow(0, 0, 0) : pieces.size() == 1 ? pieces[0] : at::cat(pieces);
    out.tensors.emplace_back(slot, mine.to(at::TensorOptions().device(at::kCPU), false, true));
  }
  return out;
}

NamedTensors replicated_of_shard(const std::vector<at::Tensor>& params, const ShardState& whole,
                                 bool to_param_options) {
  NamedTensors out;
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    for (const auto& [name, t] : whole.tensors) {
      if (name == "master") continue;
      if (name == "step") {
        out.emplace_back(std::to_string(i) + "." + name, t.reshape({}));
        continue;
      }
      at::Tensor slice = t.narrow(0, offset, p.numel()).view(p.sizes());
      out.emplace_back(std::to_string(i) + "." + name, to_param_options ? slice.to(p.options(), false, true) : slice);
    }
    offset += p.numel();
  }
  return out;
}

}  // namespace dtrain::engine
