// The process world: who this process is among the processes of one job.
//
// A job is N processes, one per GPU (or N CPU processes), started by mpirun, srun, a PMI
// launcher, torchrun, or by hand as a lone process. detect_world() reads the launcher's
// environment variables; it does not initialize MPI and never blocks.
#pragma once

#include <map>
#include <string>

#include <c10/core/Device.h>

namespace dtrain::dist {

struct World {
  int rank = 0;         // 0 .. size-1, unique in the job
  int size = 1;         // number of processes in the job
  int local_rank = 0;   // 0 .. local_size-1 among the processes on this node
  int local_size = 1;   // processes on this node
  int node = 0;         // 0 .. num_nodes-1
  int num_nodes = 1;
  std::string launcher = "none";  // "openmpi", "slurm", "pmi", "pmix", "torchrun" or "none"
  std::string host;               // this machine's host name

  // True when a launcher that provides an MPI runtime started us (mpirun, srun, PMI/PMIx).
  bool has_mpi_launcher() const;
  std::string describe() const;  // "rank 1/4 (local 1/2, node 0/2) on host via openmpi"
};

using Environment = std::map<std::string, std::string>;

// The variables of this process's environment.
Environment current_environment();

// Reads rank, local rank, sizes and node from the launcher's variables, in this order of
// preference: Open MPI (OMPI_COMM_WORLD_*), Slurm job steps (SLURM_PROCID with
// SLURM_STEP_NUM_TASKS; a batch script outside srun counts as a lone process), PMI
// (PMI_RANK/PMI_SIZE), PMIx (PMIX_RANK with a size from Open MPI or Slurm), torchrun
// (RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK). With none of them: a lone
// process, world size 1. Throws dtrain::Error naming the variable when one is malformed or
// inconsistent (rank >= size, ...).
World detect_world(const Environment& env);
inline World detect_world() { return detect_world(current_environment()); }

// What the user asked for with --device.
enum class DeviceRequest { kAuto, kCpu, kCuda };
DeviceRequest parse_device_request(const std::string& text);  // throws on unknown text

// The device this process trains on: with GPUs visible and kAuto or kCuda, the GPU
// local_rank % device_count, which also becomes the calling thread's current CUDA device; CPU
// otherwise. kCuda without a usable GPU throws dtrain::Error saying so (and how to run on CPU
// instead).
c10::Device select_device(const World& world, DeviceRequest request);

}  // namespace dtrain::dist

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
