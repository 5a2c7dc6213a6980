// Preemption signals and Slurm requeue.
#include "dtrain/engine/train/preemption.h"

#include <ATen/ATen.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"

extern char** environ;

namespace dtrain::engine {
namespace {

static_assert(std::atomic<int>::is_always_lock_free,
              "the preemption flag must be lock-free to be set from a signal handler");

std::atomic<int> g_signal{0};

void on_preemption_signal(int signal_number) {
  g_signal.store(signal_number, std::memory_order_relaxed);
}

double now_s() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// Runs argv without a shell (posix_spawnp: fork and exec, safe in a threaded process);
// returns its exit status, 127 when it could not be started, or -1 when it was killed
// after timeout_s.
int run_and_wait(const std::vector<std::string>& argv, double timeout_s) {
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = 0;
  if (::posix_spawnp(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ) != 0) return 127;
  const double deadline = now_s() + timeout_s;
  int status = 0;
  while (true) {
    pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return 127;
    if (now_s() > deadline) {
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      return -1;
    }
    ::usleep(10000);
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace

void install_preemption_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_handler = on_preemption_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int signal_number : {SIGTERM, SIGUSR1}) {
      DTRAIN_CHECK(::sigaction(signal_number, &action, nullptr) == 0,
                   "cannot install the preemption handler for signal ", signal_number, ": ",
                   std::strerror(errno));
    }
  });
}

bool preemption_requested() { return g_signal.load(std::memory_order_relaxed) != 0; }

int preemption_signal() { return g_signal.load(std::memory_order_relaxed); }

void clear_preemption_request() { g_signal.store(0, std::memory_order_relaxed); }

bool agree_preempt(dist::Communicator& comm) {
  at::Tensor flag = at::full({1}, preemption_requested() ? 1 : 0, at::kInt);
  comm.all_reduce(flag, dist::ReduceOp::kMax)->wait();
  return flag.item<int>() != 0;
}

RequeueResult request_requeue(const RequeueOptions& options) {
  RequeueResult result;
  const char* job = std::getenv("SLURM_JOB_ID");
  if (job == nullptr || *job == '\0') {
    result.message = "not inside a Slurm job (SLURM_JOB_ID is unset); not requeued";
    return result;
  }
  const char* by = std::getenv("DTRAIN_REQUEUE");
  if (by != nullptr && std::string(by) == "script") {
    result.message = "the batch script requeues Slurm job " + std::string(job) +
                     " (DTRAIN_REQUEUE=script); not requeued here";
    return result;
  }
  result.attempted = true;
  const std::string job_id = job;
  result.exit_code = run_and_wait({options.scontrol, "requeue", job_id}, options.timeout_s);
  if (result.exit_code == 0) {
    result.message = "requested requeue of Slurm job " + job_id;
  } else if (result.exit_code == 127) {
    result.message = "cannot run '" + options.scontrol + "' to requeue Slurm job " + job_id;
  } else if (result.exit_code < 0) {
    result.message = "'" + options.scontrol + " requeue " + job_id + "' did not finish in time";
  } else {
    result.message = "'" + options.scontrol + " requeue " + job_id + "' exited with status " +
                     std::to_string(result.exit_code);
  }
  return result;
}

}  // namespace dtrain::engine
