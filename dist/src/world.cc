#include "dtrain/dist/world.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <sstream>

#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "dtrain/dist/error.h"

extern char** environ;

namespace dtrain::dist {
namespace {

const std::string* find(const Environment& env, const char* key) {
  auto it = env.find(key);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

// Parses a non-negative integer variable; throws naming the variable when malformed.
int parse_int(const Environment& env, const char* key) {
  const std::string* v = find(env, key);
  DTRAIN_CHECK(v != nullptr, "environment variable ", key, " is missing");
  errno = 0;
  char* end = nullptr;
  long x = std::strtol(v->c_str(), &end, 10);
  DTRAIN_CHECK(errno == 0 && end != v->c_str() && *end == '\0' && x >= 0 && x <= INT_MAX,
               "environment variable ", key, "='", *v,
               "' is not a non-negative integer; the launcher set it wrong or it was "
               "overwritten by hand");
  return static_cast<int>(x);
}

int parse_int_or(const Environment& env, const char* key, int fallback) {
  return find(env, key) ? parse_int(env, key) : fallback;
}

// SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE look like "2(x3),1": tasks on node i.
int slurm_tasks_on_node(const std::string& spec, int node) {
  std::stringstream ss(spec);
  std::string item;
  int index = 0;
  while (std::getline(ss, item, ',')) {
    int tasks = std::atoi(item.c_str());
    int repeat = 1;
    auto x = item.find("(x");
    if (x != std::string::npos) repeat = std::atoi(item.c_str() + x + 2);
    if (node < index + repeat) return tasks;
    index += repeat;
  }
  return -1;
}

void validate(const World& w, const char* source) {
  DTRAIN_CHECK(w.size >= 1, source, ": world size ", w.size, " must be at least 1");
  DTRAIN_CHECK(w.rank < w.size, source, ": rank ", w.rank, " is not below world size ", w.size);
  DTRAIN_CHECK(w.local_size >= 1 && w.local_rank < w.local_size, source, ": local rank ",
               w.local_rank, " is not below local size ", w.local_size);
  DTRAIN_CHECK(w.num_nodes >= 1 && w.node < w.num_nodes, source, ": node ", w.node,
               " is not below the number of nodes ", w.num_nodes);
}

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

}  // namespace

bool World::has_mpi_launcher() const {
  return launcher == "openmpi" || launcher == "slurm" || launcher == "pmi" || launcher == "pmix";
}

std::string World::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << size << " (local " << local_rank << "/" << local_size
     << ", node " << node << "/" << num_nodes << ") on " << host << " via " << launcher;
  return os.str();
}

Environment current_environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

World detect_world(const Environment& env) {
  World w;
  w.host = hostname();
  if (find(env, "OMPI_COMM_WORLD_RANK") && find(env, "OMPI_COMM_WORLD_SIZE")) {
    w.launcher = "openmpi";
    w.rank = parse_int(env, "OMPI_COMM_WORLD_RANK");
    w.size = parse_int(env, "OMPI_COMM_WORLD_SIZE");
    w.local_rank = parse_int_or(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    w.local_size = parse_int_or(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    // Open MPI exports no node index; with the usual block mapping of equal node sizes it is
    // the rank's block. (Communicators that need the exact layout split by shared memory.)
    w.num_nodes = (w.size + w.local_size - 1) / w.local_size;
    w.node = std::min(w.rank / w.local_size, w.num_nodes - 1);
  } else if (find(env, "SLURM_PROCID") && find(env, "SLURM_STEP_NUM_TASKS")) {
    // Inside a job step (srun). A batch script itself has SLURM_PROCID but no step tasks.
    w.launcher = "slurm";
    w.rank = parse_int(env, "SLURM_PROCID");
    w.size = parse_int(env, "SLURM_STEP_NUM_TASKS");
    w.local_rank = parse_int_or(env, "SLURM_LOCALID", 0);
    w.node = parse_int_or(env, "SLURM_NODEID", 0);
    w.num_nodes = parse_int_or(env, "SLURM_STEP_NUM_NODES", parse_int_or(env, "SLURM_NNODES", 1));
    const std::string* per_node = find(env, "SLURM_STEP_TASKS_PER_NODE");
    if (!per_node) per_node = find(env, "SLURM_TASKS_PER_NODE");
    int local = per_node ? slurm_tasks_on_node(*per_node, w.node) : -1;
    w.local_size = local > 0 ? local : std::max(1, w.size / w.num_nodes);
  } else if (find(env, "PMI_RANK") && find(env, "PMI_SIZE")) {
    w.launcher = "pmi";
    w.rank = parse_int(env, "PMI_RANK");
    w.size = parse_int(env, "PMI_SIZE");
    w.local_rank = parse_int_or(env, "MPI_LOCALRANKID", parse_int_or(env, "PMI_LOCAL_RANK", 0));
    w.local_size = parse_int_or(env, "MPI_LOCALNRANKS", parse_int_or(env, "PMI_LOCAL_SIZE", 1));
    w.num_nodes = (w.size + w.local_size - 1) / w.local_size;
    w.node = std::min(w.rank / w.local_size, w.num_nodes - 1);
  } else if (find(env, "PMIX_RANK")) {
    w.launcher = "pmix";
    w.rank = parse_int(env, "PMIX_RANK");
    DTRAIN_CHECK(find(env, "PMIX_SIZE") || find(env, "SLURM_NTASKS"),
                 "PMIX_RANK is set but the world size is unknown (no PMIX_SIZE or SLURM_NTASKS); "
                 "launch with mpirun or srun");
    w.size = parse_int_or(env, "PMIX_SIZE", parse_int_or(env, "SLURM_NTASKS", 1));
    w.local_rank = parse_int_or(env, "PMIX_LOCAL_RANK", 0);
    w.local_size = parse_int_or(env, "PMIX_LOCAL_SIZE", 1);
    w.num_nodes = (w.size + w.local_size - 1) / w.local_size;
    w.node = std::min(w.rank / w.local_size, w.num_nodes - 1);
  } else if (find(env, "RANK") && find(env, "WORLD_SIZE") && find(env, "LOCAL_RANK")) {
    w.launcher = "torchrun";
    w.rank = parse_int(env, "RANK");
    w.size = parse_int(env, "WORLD_SIZE");
    w.local_rank = parse_int(env, "LOCAL_RANK");
    w.local_size = parse_int_or(env, "LOCAL_WORLD_SIZE", 1);
    w.num_nodes = (w.size + w.local_size - 1) / w.local_size;
    w.node = parse_int_or(env, "GROUP_RANK", std::min(w.rank / w.local_size, w.num_nodes - 1));
  }
  validate(w, w.launcher.c_str());
  return w;
}

DeviceRequest parse_device_request(const std::string& text) {
  if (text == "auto") return DeviceRequest::kAuto;
  if (text == "cpu") return DeviceRequest::kCpu;
  if (text == "cuda" || text == "gpu") return DeviceRequest::kCuda;
  throw Error("unknown device '" + text + "': use --device=auto, --device=cpu or --device=cuda");
}

c10::Device select_device(const World& world, DeviceRequest request) {
  if (request == DeviceRequest::kCpu) return c10::Device(c10::kCPU);
  int count = at::hasCUDA() ? static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount()) : 0;
  if (count == 0) {
    DTRAIN_CHECK(request != DeviceRequest::kCuda,
                 "--device=cuda was requested but no usable CUDA GPU is visible to ",
                 world.describe(), " (CUDA_VISIBLE_DEVICES='",
                 std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "",
                 "'); run with --device=cpu or on a GPU node");
    return c10::Device(c10::kCPU);
  }
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank % count));
  // The calling thread's current device from now on, so that every "current device" fallback
  // (an unindexed CUDA device, CUDA's default context) means this rank's GPU, not GPU 0.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  return device;
}

}  // namespace dtrain::dist
