#include <gtest/gtest.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/world.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

TEST(World, LoneProcessWithoutLauncherVariables) {
  World w = detect_world(Environment{{"HOME", "/root"}, {"PATH", "/bin"}});
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.local_rank, 0);
  EXPECT_EQ(w.launcher, "none");
  EXPECT_FALSE(w.has_mpi_launcher());
  EXPECT_FALSE(w.host.empty());
}

TEST(World, OpenMpiVariables) {
  World w = detect_world(Environment{{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(w.launcher, "openmpi");
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 4);
  EXPECT_EQ(w.node, 1);
  EXPECT_EQ(w.num_nodes, 2);
  EXPECT_TRUE(w.has_mpi_launcher());
}

TEST(World, SlurmStepVariablesWithCompressedTasksPerNode) {
  World w = detect_world(Environment{{"SLURM_PROCID", "6"}, {"SLURM_STEP_NUM_TASKS", "7"},
                                     {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "2"},
                                     {"SLURM_STEP_NUM_NODES", "3"},
                                     {"SLURM_STEP_TASKS_PER_NODE", "3(x2),1"}});
  EXPECT_EQ(w.launcher, "slurm");
  EXPECT_EQ(w.rank, 6);
  EXPECT_EQ(w.size, 7);
  EXPECT_EQ(w.node, 2);
  EXPECT_EQ(w.num_nodes, 3);
  EXPECT_EQ(w.local_size, 1);
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
  try {
    detect_world(Environment{{"OMPI_COMM_WORLD_RANK", "x1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_RANK='x1'"), std::string::npos) << e.what();
  }
  try {
    detect_world(Environment{{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 is not below world size 2"), std::string::npos) << e.what();
  }
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
    try {
      select_device(w, DeviceRequest::kCuda);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--device=cpu"), std::string::npos) << e.what();
    }
  } else {
    w.local_rank = 0;
    EXPECT_TRUE(select_device(w, DeviceRequest::kAuto).is_cuda());
  }
}

}  // namespace
}  // namespace dtrain::dist
