// A stand-in training program for the cluster tests: the checkpoint, preemption and requeue
// flow of dtrain with a tiny deterministic "model", so the Slurm and launcher tests can
// check a preempted, requeued and resumed run against an uninterrupted one.
//
// Each step k (1-based): g = mean over ranks of (rank + 1) * k * [1, 2, 3, 4];
// m = 0.9 m + g; w = w - 0.01 m; rank 0 prints "step k loss <sum(w)>" (%.9g).
// After each step every rank calls agree_preempt(); on a signal (SIGUSR1/SIGTERM) they save a
// checkpoint collectively, rank 0 calls request_requeue(), and all exit with kExitRequeue (85).
// With --resume=yes it continues from the newest good checkpoint in --save_dir (an error when
// there is none), with --resume=auto from it if there is one, as the examples do.
//
// usage: dtrain_preempt_probe --save_dir=DIR [--steps=N] [--step_ms=MS] [--resume=yes|auto]
#include <ATen/ATen.h>
#include <gflags/gflags.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"
#include "dtrain/engine/train/trainer.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/train/preemption.h"

DEFINE_string(save_dir, "", "checkpoint directory (required)");
DEFINE_int64(steps, 20, "steps to run to");
DEFINE_int32(step_ms, 100, "milliseconds each step takes");
DEFINE_string(resume, "no", "resume from the newest good checkpoint in --save_dir: yes (required), auto, no");

namespace dtrain {
namespace {

int run(dist::Communicator& comm) {
  engine::install_preemption_handlers();
  engine::CheckpointStore store(FLAGS_save_dir);
  at::Tensor w = at::zeros({4}, at::kDouble);
  at::Tensor m = at::zeros({4}, at::kDouble);
  int64_t start = 0;
  const engine::ResumeMode resume = engine::parse_resume(FLAGS_resume);
  std::optional<engine::CheckpointInfo> info;
  if (resume != engine::ResumeMode::kNo) info = engine::agree_latest_good(store, comm);
  DTRAIN_CHECK(info.has_value() || resume != engine::ResumeMode::kYes, "--resume: no good checkpoint in --save_dir=",
               FLAGS_save_dir);
  if (info) {
    engine::CheckpointData data = store.load(info->path);
    engine::check_same_layout({{"w", w}}, data.model, "model", info->path);
    engine::check_same_layout({{"m", m}}, data.optimizer, "optimizer", info->path);
    w.copy_(data.model[0].second);
    m.copy_(data.optimizer[0].second);
    start = data.step;
    if (comm.rank() == 0) std::printf("resumed from step %lld\n", static_cast<long long>(start));
  }
  const at::Tensor base = at::arange(1, 5, at::kDouble);
  for (int64_t k = start + 1; k <= FLAGS_steps; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(FLAGS_step_ms));
    at::Tensor g = base * static_cast<double>((comm.rank() + 1) * k);
    comm.all_reduce(g)->wait();
    g /= comm.size();
    m = 0.9 * m + g;
    w = w - 0.01 * m;
    if (comm.rank() == 0) {
      std::printf("step %lld loss %.9g\n", static_cast<long long>(k), w.sum().item<double>());
      std::fflush(stdout);
    }
    if (engine::agree_preempt(comm)) {
      engine::CheckpointData data;
      data.step = k;
      data.model = {{"w", w}};
      data.optimizer = {{"m", m}};
      data.rng = engine::capture_rng_state();
      data.world_size = comm.size();
      data.dp_size = comm.size();
      engine::RankState mine;
      mine.rank = comm.rank();
      mine.dp_rank = comm.rank();
      mine.dp_size = comm.size();
      mine.rng = engine::capture_rng_state();
      const std::string path = engine::save_checkpoint(store, comm, data, mine);
      if (comm.rank() == 0) {
        engine::RequeueResult requeue = engine::request_requeue();
        std::printf("preempted (signal %d) after step %lld: saved %s; %s\n",
                    engine::preemption_signal(), static_cast<long long>(k), path.c_str(),
                    requeue.message.c_str());
        std::fflush(stdout);
      }
      return kExitRequeue;
    }
  }
  if (comm.rank() == 0) {
    const char* restarts = std::getenv("SLURM_RESTART_COUNT");
    std::printf("done: world %d, steps %lld, resumed from %lld, restarts %s\n", comm.size(),
                static_cast<long long>(FLAGS_steps), static_cast<long long>(start),
                restarts ? restarts : "0");
  }
  return 0;
}

}  // namespace
}  // namespace dtrain

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  using namespace dtrain;
  try {
    DTRAIN_CHECK(!FLAGS_save_dir.empty(), "--save_dir is required");
    dist::World world = dist::detect_world();
    dist::init_logging(argv[0], world);
    auto comm = dist::create_communicator("auto", world, c10::Device(c10::kCPU));
    return run(*comm);
  } catch (const Error& e) {
    std::fprintf(stderr, "dtrain_preempt_probe: %s\n", e.what());
    return kExitUsage;
  }
}
