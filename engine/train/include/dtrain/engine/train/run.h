// A run's set-up, from explicit options: what every program does before it builds its model.
// The examples' mains and a program of yours call start_run() with the options their command
// line gives (cli::run_options()) or that they fill themselves; nothing here reads flags.
//
//   dtrain::engine::RunOptions o;
//   o.tp = 2;                       // a tensor-parallel pair; the rest of the world data-parallel
//   dtrain::engine::Run run = dtrain::engine::start_run(o, argv[0], "my_train");
//   ... build the model on run.device with run.mesh->tp(), then Trainer(..., *run.mesh, run.device, ...)
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <c10/core/Device.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/dist/world.h"

namespace dtrain::engine {

struct RunOptions {
  std::string device = "auto";       // auto, cpu or cuda: dist::parse_device_request()
  std::string backend = "auto";      // auto, nccl, mpi or local: dist::create_communicator()
  int collective_timeout_s = 300;    // a collective stuck this long ends the job
  int tp = 1;                        // tensor-parallel, pipeline and context-parallel sizes:
  int pp = 1;                        // Mesh(world, tp, pp, cp)
  int cp = 1;
  std::string pp_blocks;             // blocks per pipeline stage (TrainerOptions::pp_blocks)
  bool sequence_parallel = false;    // the model's tensor-parallel layers split the sequence too
  int64_t batch_size = 64;           // per data-parallel rank (the loader's batch)
  uint64_t seed = 0;                 // torch's generators, seeded before the model is built
  bool checkpoint_activations = false;  // TrainerOptions::checkpoint_activations
  int checkpoint_blocks = -1;           // TrainerOptions::checkpoint_blocks
  bool offload_layers = false;       // TrainerOptions::offload_layers
  std::string plan = "none";         // none or auto: the memory planner, within gpu_mem_limit_gb
  // Whether the program plans (dtrain's example programs: examples/model_factory.cc's
  // plan_and_apply, over engine/memory/planner.h). start_run refuses plan = "auto" otherwise:
  // the flag would be accepted and do nothing.
  bool applies_plan = false;
  double gpu_mem_limit_gb = 0;
  // --plan=auto: rank the candidates by the step-time simulator (engine/memory/simulator.h) with
  // this cluster file (dtrain-plan --calibrate); empty: by the activation probe's timings.
  std::string plan_cluster;
  // Called once the communicator exists and before the mesh splits it: every rank must have
  // been started with the same settings (cli::agree_on_flags; agree_on_settings()). Collective.
  std::function<void(dist::Communicator& world)> agree;
  // Called after the mesh's sizes were checked against the world and before any communicator
  // exists: the program's checks of its model against tp and pp (dtrain::Error for a shape that
  // does not divide, say).
  std::function<void()> checks;
};

// What start_run() creates, in this order.
struct Run {
  dist::World world;
  c10::Device device{c10::kCPU};
  std::unique_ptr<dist::Communicator> comm;
  std::unique_ptr<dist::Mesh> mesh;
};

// Detects the world (mpirun, srun or torchrun variables, or a lone process), starts logging
// with the rank prefix (dist::init_logging(argv0)), checks tp and pp against the world and runs
// options.checks before any collective, picks the device (a GPU: local rank modulo the GPUs),
// creates the communicator (options.backend, timeout), runs options.agree, builds the mesh and
// seeds torch's generators with options.seed. Logs one line on rank 0 naming `program`, the
// layout, device and backend. Collective from the communicator on; dtrain::Error (on every
// rank) for a bad value or a layout that does not fit.
Run start_run(const RunOptions& options, const char* argv0, const std::string& program);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
