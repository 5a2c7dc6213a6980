// Tests for dtrain-run's planning library (launcher/plan.h) against a faked world:
// PATH contents, files, GPUs, NUMA nodes, cores, user id and Slurm variables are all
// injected, so each test states the exact argv it expects.
#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "plan.h"

namespace dtrain {
namespace launcher {
namespace {

using Argv = std::vector<std::string>;

// A machine as make_plan sees it. Defaults: a non-root user on a 16-core, one-NUMA-node
// host without GPUs, with mpirun and the test programs installed but no Slurm.
struct FakeWorld {
  std::set<std::string> executables = {"/usr/bin/mpirun", "/usr/bin/train", "/bin/true",
                                       "/bin/echo", "/opt/ompi/bin/mpirun"};
  std::map<std::string, std::string> files;
  std::optional<std::string> srun_mpi_list;  // output of `srun --mpi=list`
  int gpus = 0;
  int numa = 1;
  int cores = 16;
  unsigned euid = 1000;
  std::vector<Argv> captured;  // commands run through run_capture

  Probes probes() {
    Probes p;
    p.is_executable = [this](const std::string& path) { return executables.count(path) > 0; };
    p.read_file = [this](const std::string& path) -> std::optional<std::string> {
      auto it = files.find(path);
      if (it == files.end()) return std::nullopt;
      return it->second;
    };
    p.run_capture = [this](const Argv& argv) -> std::optional<std::string> {
      captured.push_back(argv);
      return srun_mpi_list;
    };
    p.gpu_devices = [this] { return gpus; };
    p.numa_nodes = [this] { return numa; };
    p.cpu_cores = [this] { return cores; };
    p.euid = [this] { return euid; };
    return p;
  }
};

class LauncherTest : public ::testing::Test {
 protected:
  Plan plan_for(const Argv& args) { return make_plan(parse_options(args), env_, world_.probes()); }

  // The message of the LaunchError that parsing and planning `args` throws; fails the
  // test unless one is thrown with `exit_code`.
  std::string error_for(const Argv& args, int exit_code = kExitUsage) {
    try {
      plan_for(args);
    } catch (const LaunchError& e) {
      EXPECT_EQ(e.exit_code(), exit_code) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "no LaunchError";
    return "";
  }

  // The LaunchError for `args` ends with `exit_code` and its message says `needle`.
  void expect_error(const Argv& args, const std::string& needle, int exit_code = kExitUsage) {
    const std::string message = error_for(args, exit_code);
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  }

  void enter_slurm(int ntasks) {
    env_["SLURM_JOB_ID"] = "4242";
    env_["SLURM_NTASKS"] = std::to_string(ntasks);
    env_["SLURM_JOB_NUM_NODES"] = "2";
    world_.executables.insert("/usr/bin/srun");
  }

  FakeWorld world_;
  Environment env_ = {{"PATH", "/usr/local/bin:/usr/bin:/bin"}, {"HOME", "/home/u"}};
};

// ---- launcher choice and argv -------------------------------------------------------------

TEST_F(LauncherTest, OneProcessRunsDirectly) {
  Plan plan = plan_for({"--", "train", "--steps", "3"});
  EXPECT_EQ(plan.launcher, LauncherKind::kDirect);
  EXPECT_EQ(plan.argv, (Argv{"train", "--steps", "3"}));
  EXPECT_TRUE(plan.set_env.empty());
  EXPECT_EQ(plan.num_processes, 1);
}

TEST_F(LauncherTest, ProgramStartsAtFirstNonOptionWithoutDashDash) {
  Plan plan = plan_for({"-np", "1", "train", "--np", "7", "--"});
  EXPECT_EQ(plan.argv, (Argv{"train", "--np", "7", "--"}));
}

TEST_F(LauncherTest, DirectLaunchSetsEnvValuesItself) {
  env_["KEEP"] = "1";
  Plan plan = plan_for({"--env", "A=b c", "--env", "KEEP", "--", "train"});
  EXPECT_EQ(plan.argv, (Argv{"train"}));
  EXPECT_EQ(plan.set_env, (std::vector<std::pair<std::string, std::string>>{{"A", "b c"}}));
  EXPECT_EQ(format_command(plan), "A='b c' train");
}

TEST_F(LauncherTest, MpirunWithHostfile) {
  world_.files["hosts"] = "node1 slots=2\nnode2 slots=2\n";
  Plan plan = plan_for({"-np", "4", "--hostfile", "hosts", "--", "train", "--lr", "0.1"});
  EXPECT_EQ(plan.launcher, LauncherKind::kMpirun);
  EXPECT_EQ(plan.argv, (Argv{"mpirun", "-np", "4", "--hostfile", "hosts", "--map-by", "core",
                             "--bind-to", "core", "train", "--lr", "0.1"}));
}

TEST_F(LauncherTest, HostfileSlotsAreTheDefaultProcessCount) {
  world_.files["hosts"] = "node1 slots=3\nnode2 slots=5 max_slots=8\n";
  EXPECT_EQ(plan_for({"--hostfile", "hosts", "--", "train"}).num_processes, 8);
}

TEST_F(LauncherTest, HostfileWithOneProcessStillUsesMpirun) {
  world_.files["hosts"] = "node1\n";
  Plan plan = plan_for({"--hostfile", "hosts", "--", "train"});
  EXPECT_EQ(plan.launcher, LauncherKind::kMpirun);
  EXPECT_EQ(plan.argv[2], "1");
}

TEST_F(LauncherTest, SeveralProcessesWithoutHostfileUseMpirun) {
  EXPECT_EQ(plan_for({"--np=2", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "2", "--map-by", "core", "--bind-to", "core", "train"}));
  EXPECT_EQ(plan_for({"-n", "3", "train"}).argv[2], "3");
}

TEST_F(LauncherTest, EnvIsPassedToEveryMpirunRank) {
  env_["FOO"] = "from here";
  Plan plan = plan_for({"--env", "FOO", "--env", "BAR=1 2", "--env=BAZ=a=b", "-np", "2",
                        "--gpus-per-node", "0", "--", "train"});
  EXPECT_EQ(plan.argv, (Argv{"mpirun", "-np", "2", "-x", "FOO", "-x", "BAR=1 2", "-x", "BAZ=a=b",
                             "--map-by", "core", "--bind-to", "core", "train"}));
}

TEST_F(LauncherTest, RootAddsAllowRunAsRoot) {
  world_.euid = 0;
  EXPECT_EQ(plan_for({"-np", "2", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "2", "--allow-run-as-root", "--map-by", "core", "--bind-to",
                  "core", "train"}));
}

TEST_F(LauncherTest, MpirunOverride) {
  Plan plan = plan_for({"--mpirun", "/opt/ompi/bin/mpirun", "-np", "2", "--", "train"});
  EXPECT_EQ(plan.argv[0], "/opt/ompi/bin/mpirun");
}

TEST_F(LauncherTest, NoMpirunSaysToInstallOpenMpi) {
  world_.executables.erase("/usr/bin/mpirun");
  std::string message = error_for({"-np", "2", "--", "train"}, kExitNotFound);
  EXPECT_NE(message.find("Open MPI"), std::string::npos) << message;
  EXPECT_NE(message.find("bash cluster/setup.sh"), std::string::npos) << message;
  // One process needs no mpirun.
  EXPECT_EQ(plan_for({"--", "train"}).launcher, LauncherKind::kDirect);
}

TEST_F(LauncherTest, MissingMpirunOverrideIsNotFound) {
  expect_error({"--mpirun", "/nope/mpirun", "-np", "2", "--", "train"}, "'/nope/mpirun'",
               kExitNotFound);
}

TEST_F(LauncherTest, MpirunArgsGoVerbatimBeforeTheProgram) {
  world_.files["hosts"] = "h1 slots=1\nh2 slots=1\n";
  Plan plan = plan_for({"--hostfile", "hosts", "--mpirun-arg", "--mca", "--mpirun-arg",
                        "plm_rsh_agent", "--mpirun-arg=/opt/agent arg", "--", "train", "--mca"});
  EXPECT_EQ(plan.argv,
            (Argv{"mpirun", "-np", "2", "--hostfile", "hosts", "--map-by", "core", "--bind-to",
                  "core", "--mca", "plm_rsh_agent", "/opt/agent arg", "train", "--mca"}));
  EXPECT_EQ(format_command(plan),
            "mpirun -np 2 --hostfile hosts --map-by core --bind-to core --mca plm_rsh_agent "
            "'/opt/agent arg' train --mca");
}

TEST_F(LauncherTest, MpirunArgsChooseMpirun) {
  // One process would run directly, and inside Slurm srun would start it: --mpirun-arg asks
  // for mpirun.
  Plan plan = plan_for({"--mpirun-arg", "--report-bindings", "--", "train"});
  EXPECT_EQ(plan.launcher, LauncherKind::kMpirun);
  EXPECT_EQ(plan.argv, (Argv{"mpirun", "-np", "1", "--map-by", "core", "--bind-to", "core",
                             "--report-bindings", "train"}));
  enter_slurm(2);
  EXPECT_EQ(plan_for({"--mpirun-arg", "-v", "--", "train"}).launcher, LauncherKind::kMpirun);
  for (const std::string launcher : {"srun", "direct"}) {
    expect_error({"--backend-launcher", launcher, "--mpirun-arg", "-v", "--", "train"},
                 "--mpirun-arg needs mpirun, but --backend-launcher is " + launcher);
  }
}

// ---- Slurm ------------------------------------------------------------------------------

TEST_F(LauncherTest, SrunInsideSlurmWithPmix) {
  enter_slurm(8);
  world_.srun_mpi_list = "MPI plugin types are...\n\tnone\n\tpmi2\n\tpmix\n";
  Plan plan = plan_for({"--gpus-per-node", "4", "--", "train", "--steps", "5"});
  EXPECT_EQ(plan.launcher, LauncherKind::kSrun);
  EXPECT_EQ(plan.argv, (Argv{"srun", "--ntasks=8", "--ntasks-per-node=4", "--kill-on-bad-exit=1",
                             "--mpi=pmix", "train", "--steps", "5"}));
  EXPECT_EQ(world_.captured, (std::vector<Argv>{{"/usr/bin/srun", "--mpi=list"}}));
}

TEST_F(LauncherTest, SrunWithoutPmixOmitsMpi) {
  enter_slurm(2);
  world_.srun_mpi_list = "MPI plugin types are...\n\tnone\n\tpmi2\n";
  EXPECT_EQ(plan_for({"--", "train"}).argv,
            (Argv{"srun", "--ntasks=2", "--kill-on-bad-exit=1", "train"}));
  world_.srun_mpi_list = std::nullopt;  // srun --mpi=list failed to run
  EXPECT_EQ(plan_for({"--", "train"}).argv,
            (Argv{"srun", "--ntasks=2", "--kill-on-bad-exit=1", "train"}));
}

TEST_F(LauncherTest, SrunEnvOversubscribeAndBinding) {
  enter_slurm(4);
  env_["FOO"] = "x";
  Plan plan = plan_for({"-np", "16", "--oversubscribe", "--bind", "core", "--env", "FOO", "--env",
                        "BAR=1", "--", "train"});
  EXPECT_EQ(plan.argv, (Argv{"srun", "--ntasks=16", "--kill-on-bad-exit=1", "--overcommit",
                             "--cpu-bind=cores", "--export=ALL,FOO,BAR=1", "train"}));
  expect_error({"--env", "L=a,b", "--", "train"}, "','");
}

TEST_F(LauncherTest, SlurmTaskCountFallbacks) {
  env_["SLURM_JOB_ID"] = "1";
  world_.executables.insert("/usr/bin/srun");
  env_["SLURM_JOB_NUM_NODES"] = "2";
  EXPECT_EQ(plan_for({"--gpus-per-node", "4", "--", "train"}).num_processes, 8);
  env_["SLURM_NPROCS"] = "6";
  EXPECT_EQ(plan_for({"--", "train"}).num_processes, 6);
  EXPECT_EQ(plan_for({"-np", "3", "--", "train"}).num_processes, 3);
}

TEST_F(LauncherTest, SlurmWithoutSrunFallsBackToMpirun) {
  env_["SLURM_JOB_ID"] = "1";
  env_["SLURM_NTASKS"] = "4";
  Plan plan = plan_for({"--", "train"});
  EXPECT_EQ(plan.launcher, LauncherKind::kMpirun);
  EXPECT_EQ(plan.argv[2], "4");
}

TEST_F(LauncherTest, HostfileInsideSlurmUsesMpirun) {
  enter_slurm(4);
  world_.files["hosts"] = "a slots=2\nb slots=2\n";
  EXPECT_EQ(plan_for({"--hostfile", "hosts", "--", "train"}).launcher, LauncherKind::kMpirun);
  expect_error({"--backend-launcher", "srun", "--hostfile", "hosts", "--", "train"},
               "--hostfile is for mpirun");
}

TEST_F(LauncherTest, ExplicitLaunchers) {
  EXPECT_EQ(plan_for({"--backend-launcher", "mpirun", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "1", "--map-by", "core", "--bind-to", "core", "train"}));
  expect_error({"--backend-launcher", "srun", "--", "train"}, "srun is not on PATH", kExitNotFound);
  expect_error({"--backend-launcher", "direct", "-np", "2", "--", "train"}, "starts one process");
}

// ---- binding ------------------------------------------------------------------------------

TEST_F(LauncherTest, GpuBindingSharesCoresPerGpu) {
  world_.gpus = 4;
  world_.cores = 32;
  Plan plan = plan_for({"-np", "8", "--", "train"});
  EXPECT_EQ(plan.gpus_per_node, 4);
  EXPECT_EQ(plan.argv, (Argv{"mpirun", "-np", "8", "--map-by", "ppr:4:node:PE=8", "--bind-to",
                             "core", "train"}));
  EXPECT_NE(plan.binding.find("one per GPU"), std::string::npos) << plan.binding;
}

TEST_F(LauncherTest, GpuCountFromCudaVisibleDevices) {
  world_.gpus = 8;
  world_.cores = 6;
  env_["CUDA_VISIBLE_DEVICES"] = "0,1";
  Plan plan = plan_for({"-np", "2", "--", "train"});
  EXPECT_EQ(plan.gpus_per_node, 2);
  EXPECT_EQ(plan.argv[4], "ppr:2:node:PE=3");
  env_["CUDA_VISIBLE_DEVICES"] = "";
  EXPECT_EQ(plan_for({"--", "train"}).gpus_per_node, 0);
  env_["CUDA_VISIBLE_DEVICES"] = "GPU-1a2b,3,-1,4";
  EXPECT_EQ(plan_for({"--", "train"}).gpus_per_node, 2);
  // A machine without GPUs has none, whatever the variable lists.
  world_.gpus = 0;
  env_["CUDA_VISIBLE_DEVICES"] = "0";
  EXPECT_EQ(plan_for({"-np", "2", "--", "train"}).gpus_per_node, 0);
}

TEST_F(LauncherTest, MoreGpusThanCoresGetOneCoreEach) {
  EXPECT_EQ(plan_for({"--gpus-per-node", "8", "-np", "8", "--", "train"}).argv[4],
            "ppr:8:node:PE=2");
  world_.cores = 4;
  EXPECT_EQ(plan_for({"--gpus-per-node", "8", "-np", "8", "--", "train"}).argv[4],
            "ppr:8:node:PE=1");
}

TEST_F(LauncherTest, NumaAwareGpuBinding) {
  world_.gpus = 8;
  world_.numa = 2;
  world_.cores = 64;
  EXPECT_EQ(
      plan_for({"-np", "16", "--", "train"}).argv,
      (Argv{"mpirun", "-np", "16", "--map-by", "ppr:4:numa:PE=8", "--bind-to", "core", "train"}));
  // --bind core opts out of NUMA mapping.
  EXPECT_EQ(plan_for({"-np", "16", "--bind", "core", "--", "train"}).argv[4], "ppr:8:node:PE=8");
  // GPUs that do not divide among the NUMA nodes fall back to per-node mapping.
  world_.numa = 3;
  Plan plan = plan_for({"-np", "8", "--bind", "numa", "--", "train"});
  EXPECT_EQ(plan.argv[4], "ppr:8:node:PE=8");
  EXPECT_NE(plan.binding.find("do not divide"), std::string::npos) << plan.binding;
}

TEST_F(LauncherTest, CpuBinding) {
  EXPECT_EQ(plan_for({"-np", "4", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "4", "--map-by", "core", "--bind-to", "core", "train"}));
  world_.numa = 2;
  EXPECT_EQ(plan_for({"-np", "4", "--bind", "numa", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "4", "--map-by", "numa", "--bind-to", "numa", "train"}));
  EXPECT_EQ(plan_for({"-np", "4", "--", "train"}).argv[4], "core");  // auto: NUMA only for GPUs
}

TEST_F(LauncherTest, OversubscribingUnbinds) {
  Plan plan = plan_for({"-np", "64", "--oversubscribe", "--", "train"});
  EXPECT_EQ(plan.argv,
            (Argv{"mpirun", "-np", "64", "--oversubscribe", "--bind-to", "none", "train"}));
  EXPECT_NE(plan.binding.find("oversubscribed"), std::string::npos);
  world_.gpus = 2;
  EXPECT_EQ(plan_for({"-np", "4", "--oversubscribe", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none", "train"}));
  // An explicit --bind core is kept, allowing overload.
  EXPECT_EQ(plan_for({"-np", "4", "--oversubscribe", "--bind", "core", "--", "train"}).argv[7],
            "core:overload-allowed");
}

TEST_F(LauncherTest, BindNone) {
  world_.gpus = 4;
  EXPECT_EQ(plan_for({"-np", "4", "--bind", "none", "--", "train"}).argv,
            (Argv{"mpirun", "-np", "4", "--bind-to", "none", "train"}));
}

TEST_F(LauncherTest, DirectLaunchHasNoBinding) {
  world_.gpus = 1;
  Plan plan = plan_for({"--", "train"});
  EXPECT_EQ(plan.argv, (Argv{"train"}));
  EXPECT_NE(plan.binding.find("none"), std::string::npos);
}

// ---- slots --------------------------------------------------------------------------------

TEST_F(LauncherTest, MoreProcessesThanSlotsFails) {
  world_.files["hosts"] = "node1 slots=2\nnode2 slots=2\n";
  EXPECT_EQ(error_for({"-np", "8", "--hostfile", "hosts", "--", "train"}),
            "-np 8 needs 8 slots but hostfile hosts has 4; add hosts or pass --oversubscribe");
  Plan plan = plan_for({"-np", "8", "--hostfile", "hosts", "--oversubscribe", "--", "train"});
  EXPECT_EQ(plan.argv, (Argv{"mpirun", "-np", "8", "--hostfile", "hosts", "--oversubscribe",
                             "--bind-to", "none", "train"}));
}

TEST_F(LauncherTest, HostsWithoutSlotsCountAsOne) {
  world_.files["hosts"] = "node1\nnode2\n";
  expect_error({"-np", "3", "--hostfile", "hosts", "--", "train"},
               "has 2 (a host without slots= counts as 1)");
}

TEST_F(LauncherTest, MaxSlotsCapsEvenWhenOversubscribing) {
  world_.files["hosts"] = "node1 slots=2 max_slots=3\nnode2 slots=2 max_slots=3\n";
  EXPECT_EQ(
      plan_for({"-np", "6", "--hostfile", "hosts", "--oversubscribe", "--", "train"}).num_processes,
      6);
  expect_error({"-np", "7", "--hostfile", "hosts", "--oversubscribe", "--", "train"},
               "max_slots total 6");
}

// ---- bad input ----------------------------------------------------------------------------

struct BadInput {
  Argv args;
  std::string expected;  // a part of the message
};

TEST_F(LauncherTest, BadInputIsAUsageError) {
  world_.files["bad"] = "node1 slots=2\nnode2 slots=x\n";
  const std::vector<BadInput> cases = {
      {{"-np", "0", "--", "train"}, "-np 0 is not a positive integer"},
      {{"-np", "-3", "--", "train"}, "-np -3 is not a positive integer"},
      {{"-np", "abc", "--", "train"}, "-np abc is not a positive integer"},
      {{"--np", "", "--", "train"}, "--np '' is not a positive integer"},
      {{"-n", "99999999999", "--", "train"}, "is not a positive integer"},
      {{"-np", "--", "train"}, "-np needs a value"},
      {{"-np"}, "-np needs a value"},
      {{"-np", "2", "--"}, "no program to run"},
      {{"-np", "2"}, "no program to run"},
      {{}, "no program to run"},
      {{"--frobnicate", "--", "train"}, "unknown option '--frobnicate'"},
      {{"-x", "FOO", "--", "train"}, "unknown option '-x'"},
      {{"--dry-run=yes", "--", "train"}, "unknown option '--dry-run=yes'"},
      {{"--hostfile", "nowhere", "--", "train"}, "hostfile 'nowhere' does not exist"},
      {{"--hostfile", "bad", "--", "train"}, "hostfile bad:2: 'slots=x' is not a positive"},
      {{"--gpus-per-node", "-1", "--", "train"}, "--gpus-per-node -1 is not a GPU count"},
      {{"--gpus-per-node", "two", "--", "train"}, "--gpus-per-node two is not a GPU count"},
      {{"--bind", "socket", "--", "train"}, "--bind socket is not one of auto, none, core, numa"},
      {{"--backend-launcher", "pbs", "--", "train"}, "--backend-launcher pbs is not one of"},
      {{"--env", "1X=2", "--", "train"}, "--env 1X=2 is not VAR or VAR=VALUE"},
      {{"--env", "=2", "--", "train"}, "is not VAR or VAR=VALUE"},
      {{"--env", "UNSET_HERE", "-np", "2", "--", "train"}, "UNSET_HERE is not set"},
      {{"--mpirun", "", "--", "train"}, "--mpirun needs a program"},
      {{"--mpirun-arg", "", "--", "train"}, "--mpirun-arg needs a value"},
      {{"--mpirun-arg", "--", "train"}, "--mpirun-arg needs a value"},
  };
  for (const BadInput& c : cases) {
    std::string joined;
    for (const std::string& a : c.args) joined += " [" + a + "]";
    SCOPED_TRACE("dtrain-run" + joined);
    std::string message = error_for(c.args, kExitUsage);
    EXPECT_NE(message.find(c.expected), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
  }
}

TEST_F(LauncherTest, MissingProgramIsNotFound) {
  expect_error({"--", "no-such-trainer"}, "'no-such-trainer' not found on PATH", kExitNotFound);
  expect_error({"-np", "2", "--", "./build/bin/nothing"}, "does not exist or is not executable",
               kExitNotFound);
  // Found through PATH in any of its directories.
  EXPECT_EQ(plan_for({"--", "true"}).argv, (Argv{"true"}));
}

TEST_F(LauncherTest, HelpNeedsNoProgram) {
  EXPECT_TRUE(parse_options({"--help"}).help);
  EXPECT_TRUE(parse_options({"-np", "2", "-h"}).help);
  EXPECT_NE(usage_text().find("--gpus-per-node"), std::string::npos);
}

TEST_F(LauncherTest, ParsesEveryOption) {
  Options o = parse_options({"-np",
                             "4",
                             "--hostfile=h",
                             "--gpus-per-node",
                             "2",
                             "--env",
                             "A=1",
                             "--backend-launcher",
                             "mpirun",
                             "--oversubscribe",
                             "--dry-run",
                             "--bind=numa",
                             "--mpirun",
                             "/x/mpirun",
                             "--mpirun-arg",
                             "--mca",
                             "--mpirun-arg",
                             "a",
                             "prog",
                             "-np",
                             "1"});
  EXPECT_EQ(o.num_processes, 4);
  EXPECT_EQ(o.hostfile, "h");
  EXPECT_EQ(o.gpus_per_node, 2);
  ASSERT_EQ(o.env.size(), 1u);
  EXPECT_EQ(o.env[0].name, "A");
  EXPECT_EQ(o.env[0].value, "1");
  EXPECT_EQ(o.launcher, LauncherKind::kMpirun);
  EXPECT_TRUE(o.oversubscribe);
  EXPECT_TRUE(o.dry_run);
  EXPECT_EQ(o.bind, BindPolicy::kNuma);
  EXPECT_EQ(o.mpirun, "/x/mpirun");
  EXPECT_EQ(o.mpirun_args, (Argv{"--mca", "a"}));
  EXPECT_EQ(o.program, (Argv{"prog", "-np", "1"}));
}

// ---- hostfile -----------------------------------------------------------------------------

TEST(HostfileTest, ParsesOpenMpiFormat) {
  Hostfile h = parse_hostfile(
      "# cluster\n\nnode1 slots=4   # the first\n\tnode2\tslots=2 max_slots=6\r\nnode3\n  \n",
      "hosts");
  ASSERT_EQ(h.hosts.size(), 3u);
  EXPECT_EQ(h.hosts[0].name, "node1");
  EXPECT_EQ(h.hosts[0].slots, 4);
  EXPECT_EQ(h.hosts[0].line, 3);
  EXPECT_EQ(h.hosts[1].name, "node2");
  EXPECT_EQ(h.hosts[1].max_slots, 6);
  EXPECT_EQ(h.hosts[1].line, 4);
  EXPECT_EQ(h.hosts[2].slots, 1);
  EXPECT_FALSE(h.hosts[2].slots_given);
  EXPECT_EQ(h.total_slots(), 7);
  EXPECT_EQ(h.total_max_slots(), std::nullopt);
  EXPECT_EQ(parse_hostfile("a slots=1", "f").hosts.size(), 1u);  // no final newline
}

TEST(HostfileTest, ErrorsNameTheLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a slots=abc\n", "hostfile F:1: 'slots=abc' is not a positive integer"},
      {"# hosts\n\na slots=2\nb slots=abc\n",
       "hostfile F:4: 'slots=abc' is not a positive integer"},
      {"a slots=0\n", "hostfile F:1: 'slots=0' is not a positive integer"},
      {"a slots=-2\n", "hostfile F:1: 'slots=-2' is not a positive integer"},
      {"a max_slots=x\n", "hostfile F:1: 'max_slots=x' is not a positive integer"},
      {"a\nb gpus=4\n", "hostfile F:2: unknown key 'gpus' in 'gpus=4'"},
      {"a slots=2 extra\n", "hostfile F:1: unexpected 'extra' after host 'a'"},
      {"a slots=1\nb\n\na slots=2\n", "hostfile F:4: host 'a' already listed on line 1"},
      {"slots=4\n", "hostfile F:1: 'slots=4' comes before a host name"},
      {"a slots=4 max_slots=2\n", "hostfile F:1: max_slots=2 is less than slots=4"},
      {"a slots=1 slots=2\n", "hostfile F:1: slots= given twice"},
      {"# nothing\n\n", "hostfile F lists no hosts"},
      {"", "hostfile F lists no hosts"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    try {
      parse_hostfile(text, "F");
      ADD_FAILURE() << "accepted";
    } catch (const LaunchError& e) {
      EXPECT_EQ(e.exit_code(), kExitUsage);
      EXPECT_EQ(std::string(e.what()).find(expected), 0u) << e.what();
    }
  }
}

// ---- shell quoting ------------------------------------------------------------------------

TEST(ShellQuoteTest, QuotesOnlyWhatNeedsIt) {
  EXPECT_EQ(shell_quote("plain-arg_1.0=x/y:z,@%+"), "plain-arg_1.0=x/y:z,@%+");
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote("$HOME *"), "'$HOME *'");
}

TEST(ShellQuoteTest, DryRunLineQuotesEachArgument) {
  Plan plan;
  plan.argv = {"mpirun", "-np", "2", "/bin/echo", "it's a test", ""};
  EXPECT_EQ(format_command(plan), "mpirun -np 2 /bin/echo 'it'\\''s a test' ''");
  plan.argv = {"A=b", "x"};
  EXPECT_EQ(format_command(plan), "'A=b' x");
}

// The printed line, pasted into /bin/sh, gives back the exact arguments.
TEST(ShellQuoteTest, RoundTripsThroughTheShell) {
  const Argv args = {"it's a test", "", "$HOME", "*", "a\"b\\c", "tab\there", "new\nline", "'"};
  Plan plan;
  plan.argv = {"printf", "<%s>"};
  plan.argv.insert(plan.argv.end(), args.begin(), args.end());
  FILE* shell = ::popen(("/bin/sh -c " + shell_quote(format_command(plan))).c_str(), "r");
  ASSERT_NE(shell, nullptr);
  std::string output;
  char buffer[256];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), shell)) > 0) output.append(buffer, got);
  ASSERT_EQ(::pclose(shell), 0);
  std::string expected;
  for (const std::string& a : args) expected += "<" + a + ">";
  EXPECT_EQ(output, expected);
}

}  // namespace
}  // namespace launcher
}  // namespace dtrain
