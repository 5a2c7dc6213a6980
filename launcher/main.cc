// dtrain-run: starts a program as N processes through mpirun, srun or directly.
// See `dtrain-run --help` and launcher/plan.h. This file holds the I/O: the real
// probes, the --dry-run printout, and execvp (so the process becomes mpirun, srun or
// the program, and signals and the exit status pass straight through).
#include <dirent.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "plan.h"

extern char** environ;

namespace dtrain {
namespace launcher {
namespace {

// How long `srun --mpi=list` may take before it is killed and ignored.
constexpr int kCaptureTimeoutMs = 10000;

Environment current_environment() {
  Environment env;
  for (char** entry = environ; entry && *entry; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq) env.emplace(std::string(*entry, eq - *entry), std::string(eq + 1));
  }
  return env;
}

bool is_executable(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
         ::access(path.c_str(), X_OK) == 0;
}

std::optional<std::string> read_file(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Counts entries of `dir` named `prefix` followed by one or more digits.
int count_numbered_entries(const char* dir, const std::string& prefix) {
  DIR* handle = ::opendir(dir);
  if (!handle) return 0;
  int count = 0;
  while (const dirent* entry = ::readdir(handle)) {
    std::string name = entry->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (name.find_first_not_of("0123456789", prefix.size()) == std::string::npos) ++count;
  }
  ::closedir(handle);
  return count;
}

// Physical cores among the CPUs this process may run on (its affinity mask, which a
// cpuset or Slurm may narrow): what Open MPI's `PE=n` counts, hyperthreads excluded.
// Falls back to the mask's CPU count, then to std::thread::hardware_concurrency().
int physical_cores() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof(mask), &mask) != 0) {
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  std::set<std::pair<std::string, std::string>> cores;  // (package id, core id)
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &mask)) continue;
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::optional<std::string> package = read_file(dir + "physical_package_id");
    std::optional<std::string> core = read_file(dir + "core_id");
    if (!package || !core) return std::max(1, CPU_COUNT(&mask));
    cores.emplace(*package, *core);
  }
  return std::max<int>(1, static_cast<int>(cores.size()));
}

long long now_ms() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

// Runs argv (no shell) with stdout and stderr captured; nullopt when it cannot be
// started, exits 127, or outlives kCaptureTimeoutMs (it is then killed).
std::optional<std::string> run_capture(const std::vector<std::string>& argv) {
  int fds[2];
  if (argv.empty() || ::pipe(fds) != 0) return std::nullopt;
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return std::nullopt;
  }
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execv(cargv[0], cargv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string output;
  bool timed_out = false;
  const long long deadline = now_ms() + kCaptureTimeoutMs;
  while (true) {
    long long left = deadline - now_ms();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    int ready = ::poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;  // the deadline check above ends the loop
    char buffer[4096];
    ssize_t got = ::read(fds[0], buffer, sizeof(buffer));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    output.append(buffer, static_cast<size_t>(got));
  }
  ::close(fds[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out || (WIFEXITED(status) && WEXITSTATUS(status) == 127)) return std::nullopt;
  return output;
}

Probes system_probes() {
  Probes probes;
  probes.is_executable = is_executable;
  probes.read_file = read_file;
  probes.run_capture = run_capture;
  probes.gpu_devices = [] { return count_numbered_entries("/dev", "nvidia"); };
  probes.numa_nodes = [] { return count_numbered_entries("/sys/devices/system/node", "node"); };
  probes.cpu_cores = physical_cores;
  probes.euid = [] { return static_cast<unsigned>(::geteuid()); };
  return probes;
}

// Replaces this process with plan.argv; returns only on failure (exit 127).
int exec_plan(const Plan& plan) {
  for (const auto& [name, value] : plan.set_env) ::setenv(name.c_str(), value.c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& a : plan.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::cout.flush();
  std::cerr.flush();
  ::execvp(argv[0], argv.data());
  const int error = errno;
  std::cerr << "dtrain-run: cannot run '" << plan.argv[0] << "': " << std::strerror(error)
            << "; check that it exists and is executable\n";
  return kExitNotFound;
}

int run(const std::vector<std::string>& args) {
  Options options = parse_options(args);
  if (options.help) {
    std::cout << usage_text();
    return 0;
  }
  Plan plan = make_plan(options, current_environment(), system_probes());
  if (options.dry_run) {
    std::cerr << "# launcher: " << plan.launcher_reason << "\n"
              << "# processes: " << plan.num_processes << ", GPUs per node: " << plan.gpus_per_node
              << "\n"
              << "# binding: " << plan.binding << std::endl;
    std::cout << format_command(plan) << std::endl;
    return 0;
  }
  return exec_plan(plan);
}

}  // namespace
}  // namespace launcher
}  // namespace dtrain

int main(int argc, char** argv) {
  try {
    return dtrain::launcher::run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const dtrain::launcher::LaunchError& e) {
    std::cerr << "dtrain-run: " << e.what() << std::endl;
    return e.exit_code();
  }
}
