#include <gtest/gtest.h>

#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/dist/world.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

// What detect_world should find; kUnchecked where a test does not look.
constexpr int kUnchecked = -1;
struct ExpectedWorld {
  const char* launcher;
  int rank, size, local_rank, local_size, node, num_nodes;
};

void expect_world(const World& w, const ExpectedWorld& want) {
  EXPECT_EQ(w.launcher, want.launcher);
  const struct {
    const char* name;
    int got, want;
  } fields[] = {{"rank", w.rank, want.rank},
                {"size", w.size, want.size},
                {"local_rank", w.local_rank, want.local_rank},
                {"local_size", w.local_size, want.local_size},
                {"node", w.node, want.node},
                {"num_nodes", w.num_nodes, want.num_nodes}};
  for (const auto& f : fields) {
    if (f.want != kUnchecked) EXPECT_EQ(f.got, f.want) << f.name;
  }
}

TEST(World, LoneProcessWithoutLauncherVariables) {
  World w = detect_world(Environment{{"HOME", "/root"}, {"PATH", "/bin"}});
  expect_world(w, {"none", 0, 1, 0, kUnchecked, kUnchecked, kUnchecked});
  EXPECT_FALSE(w.has_mpi_launcher());
  EXPECT_FALSE(w.host.empty());
}

TEST(World, OpenMpiVariables) {
  World w = detect_world(Environment{{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  expect_world(w, {"openmpi", 5, 8, 1, 4, 1, 2});
  EXPECT_TRUE(w.has_mpi_launcher());
}

TEST(World, SlurmStepVariablesWithCompressedTasksPerNode) {
  World w = detect_world(Environment{{"SLURM_PROCID", "6"}, {"SLURM_STEP_NUM_TASKS", "7"},
                                     {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "2"},
                                     {"SLURM_STEP_NUM_NODES", "3"},
                                     {"SLURM_STEP_TASKS_PER_NODE", "3(x2),1"}});
  expect_world(w, {"slurm", 6, 7, kUnchecked, 1, 2, 3});
}

TEST(World, SlurmBatchScriptOutsideSrunIsALoneProcess) {
  World w = detect_world(Environment{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                                     {"SLURM_JOB_ID", "12"}});
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.launcher, "none");
}

TEST(World, PmiPmixAndTorchrunVariables) {
  World pmi = detect_world(Environment{{"PMI_RANK", "2"}, {"PMI_SIZE", "4"},
                                       {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "2"}});
  EXPECT_EQ(pmi.launcher, "pmi");
  EXPECT_EQ(pmi.rank, 2);
  EXPECT_EQ(pmi.node, 1);
  World pmix = detect_world(Environment{{"PMIX_RANK", "1"}, {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(pmix.launcher, "pmix");
  EXPECT_EQ(pmix.size, 2);
  World tr = detect_world(Environment{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                      {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"}});
  EXPECT_EQ(tr.launcher, "torchrun");
  EXPECT_EQ(tr.rank, 3);
  EXPECT_EQ(tr.local_rank, 1);
  EXPECT_EQ(tr.node, 1);
  EXPECT_FALSE(tr.has_mpi_launcher());
}

TEST(World, MalformedVariablesAreNamed) {
  using testing_util::throws_error_with;
  const auto detect = [](const char* rank) {
    return [rank] {
      detect_world(Environment{{"OMPI_COMM_WORLD_RANK", rank}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    };
  };
  EXPECT_TRUE(throws_error_with(detect("x1"), "OMPI_COMM_WORLD_RANK='x1'"));
  EXPECT_TRUE(throws_error_with(detect("2"), "rank 2 is not below world size 2"));
  EXPECT_THROW(detect_world(Environment{{"PMIX_RANK", "0"}}), Error);
}

TEST(World, DeviceRequestsAndSelection) {
  EXPECT_EQ(parse_device_request("auto"), DeviceRequest::kAuto);
  EXPECT_EQ(parse_device_request("cpu"), DeviceRequest::kCpu);
  EXPECT_EQ(parse_device_request("cuda"), DeviceRequest::kCuda);
  EXPECT_THROW(parse_device_request("tpu"), Error);
  World w;
  EXPECT_TRUE(select_device(w, DeviceRequest::kCpu).is_cpu());
  if (!testing_util::has_cuda()) {
    EXPECT_TRUE(select_device(w, DeviceRequest::kAuto).is_cpu());
    EXPECT_TRUE(
        testing_util::throws_error_with([&] { select_device(w, DeviceRequest::kCuda); }, "--device=cpu"));
  } else {
    w.local_rank = 0;
    EXPECT_TRUE(select_device(w, DeviceRequest::kAuto).is_cuda());
  }
}

}  // namespace
}  // namespace dtrain::dist
