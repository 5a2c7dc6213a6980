// Collective checkpoints across ranks: every rank's file is committed together or not at
// all, every rank agrees on the checkpoint to resume from, partitioned state saved by this
// world re-shards to other data-parallel sizes equal to slicing the unsharded array, each
// rank's RNG comes back, and a signal on one rank stops every rank.
#include <ATen/ATen.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <random>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/train/preemption.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

// (No std::filesystem::remove_all: libtorch.so exports an incompatible copy of it.)
int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

// A directory every rank sees (this host's temp dir; rank 0 picks the name), removed after.
class SharedDir {
 public:
  SharedDir() : comm_(testing_util::world_comm()) {
    at::Tensor id = at::zeros({1}, at::kLong);
    if (comm_.rank() == 0) id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffff));
    comm_.broadcast(id, 0)->wait();
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtrain_ckpt_mpi_" +
            std::to_string(id.item<int64_t>());
  }
  ~SharedDir() {
    comm_.barrier()->wait();
    if (comm_.rank() == 0) ::nftw(path_.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  }
  const std::string& path() const { return path_; }

 private:
  dist::Communicator& comm_;
  std::string path_;
};

// The flat array of entry k: values k*1000 + 0..numel-1.
at::Tensor full_array(int64_t numel, int k) {
  return at::arange(numel, at::kFloat) + 1000.f * static_cast<float>(k);
}

// Rank `rank` of `ranks`'s part of a flat array (the layout of shard.h, cut into units at
// `bounds`), cut directly: its ranges end to end.
at::Tensor shard_of_array(const at::Tensor& full, int ranks, int rank, const std::vector<int64_t>& bounds = {}) {
  std::vector<at::Tensor> parts;
  for (const FlatRange& r : shard_ranges(full.numel(), ranks, rank, bounds)) {
    parts.push_back(full.narrow(0, r.begin, r.size()));
  }
  return parts.empty() ? at::zeros({0}) : at::cat(parts);
}

RankState rank_state(dist::Communicator& comm, int64_t numel, const std::vector<int64_t>& bounds = {}) {
  RankState state;
  state.rank = comm.rank();
  state.dp_rank = comm.rank();
  state.dp_size = comm.size();
  state.optimizer_shard.layout = shard_layout_of(numel, comm.size(), comm.rank(), bounds);
  state.optimizer_shard.tensors = {
      {"step", at::scalar_tensor(3.f)},
      {"exp_avg", shard_of_array(full_array(numel, 1), comm.size(), comm.rank(), bounds)},
      {"exp_avg_sq", shard_of_array(full_array(numel, 2), comm.size(), comm.rank(), bounds)}};
  state.rng = capture_rng_state();
  return state;
}

CheckpointData main_data(dist::Communicator& comm, int64_t step) {
  CheckpointData data;
  data.step = step;
  data.model = {{"w", at::full({2, 2}, static_cast<float>(step))}};
  data.world_size = comm.size();
  data.dp_size = comm.size();
  data.meta = {{"loader.train", "0," + std::to_string(step)}};
  return data;
}

TEST(CheckpointMpiTest, SaveAgreeAndReshardToOtherWorldSizes) {
  dist::Communicator& comm = testing_util::world_comm();
  SharedDir dir;
  CheckpointStore store(dir.path());
  const int64_t numel = 200;  // 64-element shards: 2 and 4 ranks both cut it
  at::manual_seed(100 + comm.rank());  // different RNG state on every rank
  RankState mine = rank_state(comm, numel);
  const std::string path = save_checkpoint(store, comm, main_data(comm, 5), mine);
  EXPECT_EQ(path, store.path_for(5));

  std::optional<CheckpointInfo> info = agree_latest_good(store, comm);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->step, 5);
  EXPECT_EQ(info->rank_files, comm.size());
  CheckpointData main = store.load(info->path);
  EXPECT_EQ(main.rank_files, comm.size());
  EXPECT_EQ(main.meta.at("loader.train"), "0,5");

  // This rank's RNG state comes back from its own file.
  at::Tensor expected = at::randn({4});
  at::manual_seed(7);
  restore_rng_state(store.load_rank(5, comm.rank()).rng);
  EXPECT_TRUE(at::equal(at::randn({4}), expected)) << "rank " << comm.rank();

  // Every new data-parallel size from 1 to world + 1, each new rank computed here.
  for (int new_dp = 1; new_dp <= comm.size() + 1; ++new_dp) {
    for (int new_rank = 0; new_rank < new_dp; ++new_rank) {
      const ShardLayout target = shard_layout_of(numel, new_dp, new_rank);
      NamedTensors got = load_resharded_optimizer(store, main, 0, target).tensors;
      ASSERT_EQ(got.size(), 3u);
      EXPECT_EQ(got[0].first, "step");
      EXPECT_EQ(got[0].second.item<float>(), 3.f);
      for (int k = 1; k <= 2; ++k) {
        EXPECT_TRUE(at::equal(got[k].second, shard_of_array(full_array(numel, k), new_dp, new_rank)))
            << comm.size() << " -> " << new_dp << " ranks, new rank " << new_rank << ", "
            << got[k].first;
      }
    }
  }
}

// Partitioned state in units (each unit split over the ranks: several ranges per rank) saved by
// this world re-shards to one range and to other units at every other data-parallel size.
TEST(CheckpointMpiTest, PerUnitStateReshardsToOtherWorldSizesAndLayouts) {
  dist::Communicator& comm = testing_util::world_comm();
  SharedDir dir;
  CheckpointStore store(dir.path());
  const int64_t numel = 200;
  const std::vector<int64_t> units = {0, 70, 150};
  save_checkpoint(store, comm, main_data(comm, 4), rank_state(comm, numel, units));
  const CheckpointData main = store.load(store.path_for(4));
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{}, units, {0, 120}}) {
    for (int new_dp = 1; new_dp <= comm.size() + 1; ++new_dp) {
      for (int new_rank = 0; new_rank < new_dp; ++new_rank) {
        const ShardLayout target = shard_layout_of(numel, new_dp, new_rank, bounds);
        const ShardState got = load_resharded_optimizer(store, main, 0, target);
        ASSERT_EQ(got.tensors.size(), 3u);
        EXPECT_TRUE(got.layout.ranges == target.ranges);
        EXPECT_EQ(got.tensors[0].second.item<float>(), 3.f);
        for (int k = 1; k <= 2; ++k) {
          EXPECT_TRUE(at::equal(got.tensors[k].second, shard_of_array(full_array(numel, k), new_dp, new_rank, bounds)))
              << comm.size() << " ranks in units -> " << new_dp << " ranks in " << bounds.size() << " unit(s), rank "
              << new_rank << ", " << got.tensors[k].first;
        }
      }
    }
  }
}

TEST(CheckpointMpiTest, ARankThatCannotWriteCommitsNothing) {
  dist::Communicator& comm = testing_util::world_comm();
  SharedDir dir;
  CheckpointStore store(dir.path());
  save_checkpoint(store, comm, main_data(comm, 1), rank_state(comm, 8));
  RankState mine = rank_state(comm, 8);
  const int failing = comm.size() - 1;
  if (comm.rank() == failing) mine.dp_rank = -1;  // save_rank refuses it
  std::string message;
  try {
    save_checkpoint(store, comm, main_data(comm, 2), mine);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("checkpoint step 2 was not saved: rank(s) " + std::to_string(failing) +
                         " could not write their rank files"),
            std::string::npos)
      << message;
  comm.barrier()->wait();
  EXPECT_NE(::access(store.path_for(2).c_str(), F_OK), 0);
  for (int r = 0; r < comm.size(); ++r) {  // the ranks that could write removed their files again
    EXPECT_NE(::access(store.rank_path_for(2, r).c_str(), F_OK), 0) << "rank " << r;
    EXPECT_NE(::access((store.rank_path_for(2, r) + ".crc").c_str(), F_OK), 0) << "rank " << r;
  }
  EXPECT_EQ(::access(store.rank_path_for(1, comm.rank()).c_str(), F_OK), 0);  // step 1's stay
  std::optional<CheckpointInfo> info = agree_latest_good(store, comm);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->step, 1);
}

TEST(CheckpointMpiTest, OneRanksSignalStopsEveryRank) {
  dist::Communicator& comm = testing_util::world_comm();
  install_preemption_handlers();
  clear_preemption_request();
  EXPECT_FALSE(agree_preempt(comm));
  if (comm.rank() == comm.size() - 1) ASSERT_EQ(::raise(SIGUSR1), 0);
  EXPECT_TRUE(agree_preempt(comm)) << "rank " << comm.rank();
  clear_preemption_request();
  EXPECT_FALSE(agree_preempt(comm));
}

}  // namespace
}  // namespace dtrain::engine
