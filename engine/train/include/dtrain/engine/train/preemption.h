// Preemption: SIGTERM or SIGUSR1 asks the job to stop at the next step boundary, save a
// checkpoint and exit with kExitRequeue (dtrain/dist/error.h), so that Slurm runs it again
// and it resumes from that checkpoint.
//
// The flow, on every rank (docs/CLUSTER.md shows the Slurm side):
//   install_preemption_handlers();                  // once, at start-up
//   for each step:
//     trainer.step(batch);                          // the current step always finishes
//     if (agree_preempt(mesh.world())) {            // collective: true on every rank or none
//       save_checkpoint(...);                       // collective
//       if (world.rank() == 0) request_requeue();   // scontrol requeue, unless the batch
//                                                   // script does it (DTRAIN_REQUEUE=script)
//       return kExitRequeue;                        // from main(), after cleanup
//     }
//
// The signal handler only stores the signal number in a lock-free std::atomic<int> (async-
// signal-safe); everything else happens on the training thread. Signals that arrive while
// a step runs are seen at the next agree_preempt(). A second signal does not kill the process:
// Slurm's SIGKILL after its grace period does.
#pragma once

#include <string>

namespace dtrain::dist {
class Communicator;
}

namespace dtrain::engine {

// Installs the handlers for SIGTERM and SIGUSR1 (sigaction with SA_RESTART, so blocking system
// calls resume). Idempotent and thread-safe. Replaces any previous handlers of these signals.
void install_preemption_handlers();
// Whether this process received SIGTERM or SIGUSR1 since the handlers were installed (or the
// last clear). Lock-free; callable from any thread.
bool preemption_requested();
// The signal received (SIGTERM or SIGUSR1; the latest if several), 0 if none.
int preemption_signal();
// Forgets a received signal (tests; or after a preemption was handled and the run goes on).
void clear_preemption_request();

// Collective over comm (synchronous, one all-reduce of one integer): true on every rank when
// any rank was asked to stop. Call it at the same point on every rank, e.g. after each step.
bool agree_preempt(dist::Communicator& comm);

// What request_requeue() did.
struct RequeueResult {
  bool attempted = false;  // false: not inside a Slurm job (SLURM_JOB_ID unset); nothing done
  int exit_code = -1;      // scontrol's exit status (127: could not be run)
  std::string message;     // one line for the log
  bool ok() const { return attempted && exit_code == 0; }
};

struct RequeueOptions {
  std::string scontrol = "scontrol";  // a name looked up on PATH, or a path
  double timeout_s = 30;              // scontrol is killed after this long
};

// Inside a Slurm job (SLURM_JOB_ID set): runs `scontrol requeue <SLURM_JOB_ID>` (fork and exec,
// no shell) and waits for it. Does nothing outside a Slurm job, and when DTRAIN_REQUEUE=script
// (set by cluster/slurm/*.sbatch, whose batch script requeues when the program exits with
// kExitRequeue). Never throws; call it on one rank only, after the checkpoint is committed:
// Slurm then ends this job's processes (SIGTERM) and queues the job again.
RequeueResult request_requeue(const RequeueOptions& options = {});

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
