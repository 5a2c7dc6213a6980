#include "dtrain/engine/train/run.h"

#include <chrono>

#include <ATen/Parallel.h>
#include <glog/logging.h>
#include <torch/utils.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"

namespace dtrain::engine {

Run start_run(const RunOptions& o, const char* argv0, const std::string& program) {
  Run run;
  run.world = dist::detect_world();
  dist::init_logging(argv0, run.world);
  dist::Mesh::check(run.world.size, o.tp, o.pp, o.cp);
  DTRAIN_CHECK(o.plan != "auto" || o.applies_plan, "--plan=auto chooses memory techniques for programs "
               "that apply its plan (dtrain's train_* programs); this one does not, so --gpu_mem_limit_gb would be "
               "ignored. Give the techniques as flags (dtrain-plan suggests them), or plan in your program "
               "(dtrain/engine/memory/planner.h) and set RunOptions::applies_plan");
  if (o.checks) o.checks();
  run.device = dist::select_device(run.world, dist::parse_device_request(o.device));
  dist::CommOptions comm_options;
  DTRAIN_CHECK(o.collective_timeout_s > 0, "--collective_timeout_s=", o.collective_timeout_s, " must be positive");
  comm_options.timeout = std::chrono::seconds(o.collective_timeout_s);
  run.comm = dist::create_communicator(o.backend, run.world, run.device, comm_options);
  // Before the mesh splits the world and before anything depends on the settings.
  if (o.agree) o.agree(*run.comm);
  run.mesh = std::make_unique<dist::Mesh>(*run.comm, o.tp, o.pp, o.cp);
  torch::manual_seed(o.seed);
  if (run.world.rank == 0) {
    LOG(INFO) << program << ": " << run.world.size << " rank(s) (tp " << run.mesh->tp_size() << " x dp "
              << run.mesh->dp_size() << (run.mesh->pp_size() > 1 ? " x pp " + std::to_string(run.mesh->pp_size()) : std::string())
              << (run.mesh->cp_size() > 1 ? " x cp " + std::to_string(run.mesh->cp_size()) : std::string())
              << "), device " << run.device << ", backend " << run.comm->backend() << ", " << at::get_num_threads()
              << " intra-op CPU thread(s)";
  }
  return run;
}

}  // namespace dtrain::engine
