// Partitioned optimizer state in units (ZeRO-3's FSDP layout: the flat space cut into units,
// each split over the ranks, so a rank holds one piece of every unit): the layout against
// closed-form ranges, assembly between unit layouts and one-range layouts against the whole
// arrays cut by hand, rank files of several ranges, and resharding a per-unit checkpoint.
#include <torch/csrc/jit/serialization/pickle.h>

#include "checkpoint_test_util.h"

namespace dtrain::engine {
namespace {

// ---- partitioned state in units (one piece of every unit per rank) ------------------------------

// Entry k of the reference flat arrays of numel elements (distinct values per entry).
at::Tensor ms_array(int64_t numel, int k) { return torch::arange(numel, torch::kFloat) * 0.5f + 1000.f * k; }

// `ranges` of a whole array end to end, cut by hand.
at::Tensor ms_cut(const at::Tensor& whole, const std::vector<FlatRange>& ranges) {
  std::vector<at::Tensor> parts;
  for (const FlatRange& r : ranges) parts.push_back(whole.narrow(0, r.begin, r.size()));
  return parts.empty() ? torch::zeros({0}) : torch::cat(parts);
}

// What the rank of `layout` saves: "step" and the reference arrays 1 and 2 of a whole space of
// whole_numel elements in which the layout's space begins at `offset`.
ShardState ms_piece(const ShardLayout& layout, int64_t offset = 0, int64_t whole_numel = -1) {
  std::vector<FlatRange> placed;
  for (const FlatRange& r : layout.ranges) placed.push_back({r.begin + offset, r.end + offset});
  const int64_t n = whole_numel < 0 ? layout.numel : whole_numel;
  ShardState piece;
  piece.layout = layout;
  piece.tensors = named({{"step", torch::tensor(4.f)},
                         {"exp_avg", ms_cut(ms_array(n, 1), placed)},
                         {"exp_avg_sq", ms_cut(ms_array(n, 2), placed)}});
  return piece;
}

std::vector<ShardState> ms_pieces(int64_t numel, int ranks, const std::vector<int64_t>& bounds) {
  std::vector<ShardState> out;
  for (int r = 0; r < ranks; ++r) out.push_back(ms_piece(shard_layout_of(numel, ranks, r, bounds)));
  return out;
}

// `got` is the state of `target` (placed at `offset` of a whole space of whole_numel): the
// reference arrays cut at its ranges.
void ms_expect_state(const ShardState& got, const ShardLayout& target, const std::string& where, int64_t offset = 0,
                     int64_t whole_numel = -1) {
  const ShardState want = ms_piece(target, offset, whole_numel);
  ASSERT_EQ(got.tensors.size(), 3u) << where;
  EXPECT_TRUE(got.layout.numel == target.numel && got.layout.ranges == target.ranges) << where;
  EXPECT_EQ(got.tensors[0].second.item<float>(), 4.f) << where;
  for (size_t k = 1; k < 3; ++k) {
    EXPECT_EQ(got.tensors[k].first, want.tensors[k].first) << where;
    EXPECT_TRUE(at::equal(got.tensors[k].second, want.tensors[k].second)) << where << " " << want.tensors[k].first;
  }
}

using MsRanges = std::vector<FlatRange>;
const std::vector<int64_t> kMsUnits = {0, 100, 130};  // units of 100, 30 and 170 elements of 300

TEST(ShardUnitsTest, EachUnitIsSplitOverTheRanks) {
  // 2 ranks: units padded to 128, 128, 256 (multiples of 2 x 64): pieces of 64, 64, 128.
  EXPECT_EQ(shard_ranges(300, 2, 0, kMsUnits), (MsRanges{{0, 64}, {100, 130}, {130, 258}}));
  EXPECT_EQ(shard_ranges(300, 2, 1, kMsUnits), (MsRanges{{64, 100}, {258, 300}}));  // unit 1: padding only
  // 3 ranks: every unit padded to 192: pieces of 64.
  EXPECT_EQ(shard_ranges(300, 3, 0, kMsUnits), (MsRanges{{0, 64}, {100, 130}, {130, 194}}));
  EXPECT_EQ(shard_ranges(300, 3, 1, kMsUnits), (MsRanges{{64, 100}, {194, 258}}));
  EXPECT_EQ(shard_ranges(300, 3, 2, kMsUnits), (MsRanges{{258, 300}}));
  const ShardLayout layout = shard_layout_of(300, 2, 0, kMsUnits);
  EXPECT_EQ(layout.numel, 300);
  EXPECT_EQ(layout.size(), 64 + 30 + 128);
  EXPECT_EQ(layout.unit_bounds, kMsUnits);
  // No bounds (or {0}): one unit, shard_range's range; none for a rank of padding only.
  EXPECT_EQ(shard_ranges(300, 3, 1), (MsRanges{{128, 256}}));
  EXPECT_EQ(shard_ranges(300, 3, 1, {0}), (MsRanges{{128, 256}}));
  EXPECT_TRUE(shard_ranges(10, 4, 3).empty());
  EXPECT_TRUE(shard_ranges(0, 2, 0).empty());
  EXPECT_EQ(shard_layout_of(10, 4, 3).size(), 0);
  // Every element held by exactly one rank, whatever the bounds.
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{}, kMsUnits, {0, 1, 2, 299}, {0, 50, 200, 250}}) {
    for (int ranks = 1; ranks <= 5; ++ranks) {
      std::vector<int> held(300, 0);
      for (int r = 0; r < ranks; ++r) {
        for (const FlatRange& s : shard_ranges(300, ranks, r, bounds)) {
          EXPECT_LT(s.begin, s.end);
          for (int64_t i = s.begin; i < s.end; ++i) ++held[i];
        }
      }
      EXPECT_EQ(std::count(held.begin(), held.end(), 1), 300) << ranks << " ranks, " << bounds.size() << " units";
    }
  }
  EXPECT_EQ(overlapping_shards(300, 3, {{120, 140}}, kMsUnits), (std::vector<int>{0}));
  EXPECT_EQ(overlapping_shards(300, 3, {{90, 200}}, kMsUnits), (std::vector<int>{0, 1}));
  EXPECT_EQ(overlapping_shards(300, 3, {{0, 10}, {260, 270}}, kMsUnits), (std::vector<int>{0, 2}));
  EXPECT_EQ(overlapping_shards(300, 3, {{0, 10}, {260, 270}}), (std::vector<int>{0, 2}));
  EXPECT_TRUE(contains(message_of([] { shard_ranges(300, 2, 0, {1, 100}); }), "the first must begin at 0"));
  EXPECT_TRUE(contains(message_of([] { shard_ranges(300, 2, 0, {0, 100, 100}); }), "must ascend strictly"));
  EXPECT_TRUE(contains(message_of([] { shard_ranges(300, 2, 0, {0, 130, 100}); }), "must ascend strictly"));
  EXPECT_TRUE(contains(message_of([] { shard_ranges(300, 2, 0, {0, 300}); }), "unit bound 300 is not inside"));
  EXPECT_THROW(shard_layout_of(300, 2, 0, {0, 400}), Error);
  EXPECT_THROW(shard_ranges(300, 2, 2, kMsUnits), Error);
}

TEST(ShardUnitsTest, AssemblingBetweenUnitLayoutsEqualsCuttingTheWholeArrays) {
  const std::vector<std::vector<int64_t>> layouts = {{}, kMsUnits, {0, 50, 200, 250}};
  for (const std::vector<int64_t>& old_bounds : layouts) {
    for (int old_ranks : {1, 2, 3}) {
      const std::vector<ShardState> old = ms_pieces(300, old_ranks, old_bounds);
      for (const std::vector<int64_t>& bounds : layouts) {
        for (int ranks : {1, 2, 3}) {
          for (int r = 0; r < ranks; ++r) {
            const ShardLayout target = shard_layout_of(300, ranks, r, bounds);
            const std::string where = std::to_string(old_bounds.size()) + " units x " + std::to_string(old_ranks) +
                                      " -> " + std::to_string(bounds.size()) + " units x " + std::to_string(ranks) +
                                      ", rank " + std::to_string(r);
            std::vector<ShardState> given;  // only the overlapping pieces, then all of them
            for (int j : overlapping_shards(300, old_ranks, target.ranges, old_bounds)) given.push_back(old[j]);
            ms_expect_state(assemble_shard(given, target), target, where);
            ms_expect_state(assemble_shard(old, target), target, where + " (all pieces)");
          }
        }
      }
    }
  }
}

TEST(ShardUnitsTest, ATargetHoldingNothingGetsTheReplicatedEntries) {
  const ShardLayout nothing = shard_layout_of(300, 8, 7, kMsUnits);  // every unit's piece is padding
  ASSERT_TRUE(nothing.ranges.empty());
  const std::vector<ShardState> old = ms_pieces(300, 2, kMsUnits);
  const ShardState got = assemble_shard({old[1]}, nothing);
  ms_expect_state(got, nothing, "a rank of padding only");
  EXPECT_EQ(got.tensors[1].second.numel(), 0);
  // And the saved piece of a rank that held nothing assembles with the others.
  const std::vector<ShardState> sparse = ms_pieces(300, 8, kMsUnits);
  ms_expect_state(assemble_shard(sparse, shard_layout_of(300, 1, 0)), shard_layout_of(300, 1, 0), "8 -> 1");
}

TEST(ShardUnitsTest, AssemblyNamesWhatIsWrongAcrossRanges) {
  const std::vector<ShardState> old = ms_pieces(300, 3, kMsUnits);  // rank 1: [64, 100), [194, 258)
  const ShardLayout whole{300, {{0, 300}}};
  EXPECT_TRUE(contains(message_of([&] { assemble_shard({old[0], old[2]}, whole); }),
                       "no saved optimizer shard holds elements [64, 100) of this rank's [0, 300)"));
  const ShardLayout two = shard_layout_of(300, 2, 0, kMsUnits);
  EXPECT_TRUE(contains(message_of([&] { assemble_shard({old[0]}, two); }),
                       "no saved optimizer shard holds elements [194, 258) of this rank's [0, 64), [100, 130), "
                       "[130, 258); the checkpoint is incomplete"));
  std::vector<ShardState> bad = old;
  bad[1].tensors[1].second = torch::zeros({7});
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(bad, whole); }),
                       "optimizer shard entry 'exp_avg' of [64, 100), [194, 258) has 7 elements; 100 were expected"));
  bad = old;
  bad[2].tensors[0].second = torch::tensor(5.f);
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(bad, two); }), "the replicated entry 'step' differs"));
  bad = old;
  bad[1].tensors[2].first = "sum";
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(bad, two); }), "hold different entries"));
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(old, shard_layout_of(301, 2, 0, kMsUnits)); }),
                       "holds partitioned state of 300 elements, but this model needs 301"));
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(old, ShardLayout{300, {{100, 130}, {0, 64}}}); }),
                       "ranges [100, 130), [0, 64) are not ascending, disjoint ranges"));
}

// A checkpoint of `numels.size()` pipeline stages x dp data-parallel ranks (tp 1) whose stage s
// is cut into units at bounds[s], the reference arrays over the stages' spaces end to end.
CheckpointData ms_save_units(CheckpointStore& store, const std::vector<int64_t>& numels,
                             const std::vector<std::vector<int64_t>>& bounds, int dp) {
  const int stages = static_cast<int>(numels.size());
  CheckpointData main;
  main.step = 6;
  main.world_size = stages * dp;
  main.dp_size = dp;
  main.rank_files = main.world_size;
  main.meta["pp"] = std::to_string(stages);
  int64_t whole = 0, offset = 0;
  for (int64_t n : numels) whole += n;
  for (int s = 0; s < stages; ++s) {
    main.meta["pp.flat_numel"] += (s ? "," : "") + std::to_string(numels[s]);
    for (int d = 0; d < dp; ++d) {
      RankState state;
      state.rank = s * dp + d;
      state.dp_rank = d;
      state.dp_size = dp;
      state.optimizer_shard = ms_piece(shard_layout_of(numels[s], dp, d, bounds[s]), offset, whole);
      if (s > 0 && d == 0) state.stage_model = named({{"stage" + std::to_string(s) + ".w", torch::zeros({1})}});
      store.save_rank(main.step, state);
    }
    offset += numels[s];
  }
  if (stages == 1) main.meta.clear();
  store.save(main);
  return store.load(store.path_for(main.step));
}

TEST(ShardUnitsTest, RankFilesRecordSeveralRangesAndOneRangeFilesStillRead) {
  TempDir dir;
  CheckpointStore store(dir.path());
  RankState state;
  state.dp_size = 3;
  state.optimizer_shard = ms_piece(shard_layout_of(300, 3, 0, kMsUnits));
  store.save_rank(2, state);
  const RankState back = store.load_rank(2, 0);
  EXPECT_EQ(back.optimizer_shard.layout.numel, 300);
  EXPECT_EQ(back.optimizer_shard.layout.ranges, (MsRanges{{0, 64}, {100, 130}, {130, 194}}));
  EXPECT_EQ(back.optimizer_shard.layout.unit_bounds, kMsUnits);
  ms_expect_state(back.optimizer_shard, shard_layout_of(300, 3, 0, kMsUnits), "read back");
  // The file keeps shard_begin / shard_end (the first begin, the last end) for readers of one
  // range; a file with only those (written before units) reads as that one range.
  std::vector<char> bytes;
  ckpt_detail::write_rank_archive(2, state, [&](const char* p, size_t n) { bytes.insert(bytes.end(), p, p + n); });
  auto key = [](const char* name) { return c10::IValue(std::string(name)); };
  c10::impl::GenericDict dict = torch::jit::pickle_load(bytes).toGenericDict();
  EXPECT_EQ(dict.at(key("shard_begin")).toInt(), 0);
  EXPECT_EQ(dict.at(key("shard_end")).toInt(), 194);
  state.optimizer_shard = ms_piece(shard_layout_of(300, 3, 1));  // [128, 256)
  bytes.clear();
  ckpt_detail::write_rank_archive(2, state, [&](const char* p, size_t n) { bytes.insert(bytes.end(), p, p + n); });
  dict = torch::jit::pickle_load(bytes).toGenericDict();
  ASSERT_EQ(dict.erase(key("shard_ranges")) + dict.erase(key("shard_unit_bounds")), 2u);
  int64_t step = 0;
  const RankState old = ckpt_detail::read_rank_archive(torch::jit::pickle_save(dict), "old.pt", &step);
  EXPECT_EQ(old.optimizer_shard.layout.ranges, (MsRanges{{128, 256}}));
  EXPECT_TRUE(old.optimizer_shard.layout.unit_bounds.empty());
  // Ranges that are not ascending and disjoint, or bounds that are not units, are refused.
  state.optimizer_shard.layout = ShardLayout{300, {{100, 130}, {0, 64}}};
  EXPECT_TRUE(contains(message_of([&] { store.save_rank(3, state); }), "must be ascending and disjoint"));
  state.optimizer_shard.layout = ShardLayout{300, {{0, 64}}, {0, 300}};
  EXPECT_THROW(store.save_rank(3, state), Error);
}

TEST(ShardUnitsTest, PerUnitCheckpointsReshardIntoOneRangeAndPerUnitTargets) {
  {
    TempDir dir;
    CheckpointStore store(dir.path());
    const CheckpointData main = ms_save_units(store, {300}, {kMsUnits}, 3);
    for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{}, kMsUnits, {0, 50, 200, 250}}) {
      for (int r = 0; r < 2; ++r) {
        const ShardLayout target = shard_layout_of(300, 2, r, bounds);
        ms_expect_state(load_resharded_optimizer(store, main, 0, target), target,
                        "per-unit dp 3 -> " + std::to_string(bounds.size()) + " units, rank " + std::to_string(r));
      }
    }
    // One range [0, 192) needs old ranks 0 and 1 only ([0, 64) ... and [64, 100) ...).
    ::unlink(store.rank_path_for(6, 2).c_str());
    ms_expect_state(load_resharded_optimizer(store, main, 0, shard_layout_of(300, 2, 0)), shard_layout_of(300, 2, 0),
                    "without rank 2's file");
  }
  // Two pipeline stages (130 + 170), each cut into its own units, into one stage and into
  // another split's stages, in one range or in units.
  TempDir dir;
  CheckpointStore store(dir.path());
  const CheckpointData main = ms_save_units(store, {130, 170}, {{0, 100}, {0, 70}}, 2);
  for (int dp : {1, 2, 3}) {
    for (int r = 0; r < dp; ++r) {
      for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{}, kMsUnits}) {
        const ShardLayout target = shard_layout_of(300, dp, r, bounds);
        ms_expect_state(load_resharded_optimizer(store, main, 0, target, StageSpace{0, 1, 0, 300}), target,
                        "2 stages -> 1, rank " + std::to_string(r) + " of " + std::to_string(dp));
      }
      const ShardLayout second = shard_layout_of(200, dp, r, {0, 30, 150});  // stage 1 of 100 + 200
      ms_expect_state(load_resharded_optimizer(store, main, 0, second, StageSpace{1, 2, 100, 300}), second,
                      "2 stages -> stage 1 of 100 + 200, rank " + std::to_string(r), 100, 300);
    }
  }
}

}  // namespace
}  // namespace dtrain::engine
