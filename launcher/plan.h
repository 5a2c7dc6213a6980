// dtrain-run's planning library: from "N processes, these hosts, this program" to the
// exact argv that runs it (mpirun, srun, or the program itself).
//
// Everything here is a pure function of its inputs. The outside world (the
// environment, files, PATH, devices, the user id) comes in through `Environment` and
// `Probes`, so tests can fake a Slurm allocation, a root user or a 4-NUMA-node host.
// Nothing here runs a program; launcher/main.cc does that with execvp.
//
// Error policy: a problem the user can fix (a bad option, a malformed hostfile, more
// processes than slots, a program that is not there) throws `LaunchError` whose
// message names the problem and the fix, and whose `exit_code()` is what dtrain-run
// exits with: kExitUsage (2) for bad input, kExitNotFound (127) for a missing program.
#ifndef DTRAIN_LAUNCHER_PLAN_H_
#define DTRAIN_LAUNCHER_PLAN_H_

#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {
namespace launcher {

// Exit codes of dtrain-run for problems found before anything runs.
constexpr int kExitUsage = 2;       // bad option, hostfile, or process count
constexpr int kExitNotFound = 127;  // program, mpirun or srun not found / not executable

// A user-fixable problem. what() is one line without the "dtrain-run: " prefix.
class LaunchError : public std::runtime_error {
 public:
  LaunchError(int exit_code, const std::string& message)
      : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// Which program starts the processes.
enum class LauncherKind { kAuto, kMpirun, kSrun, kDirect };
// How mpirun places and pins ranks (srun: mapped to --cpu-bind, auto leaves Slurm's).
enum class BindPolicy { kAuto, kNone, kCore, kNuma };

const char* launcher_name(LauncherKind kind);
const char* bind_name(BindPolicy policy);

// One `--env` option: `--env VAR` passes VAR's current value, `--env VAR=VALUE` sets it.
struct EnvOption {
  std::string name;
  std::optional<std::string> value;  // nullopt: pass the launcher's own value
};

// The parsed command line. Unset optionals mean "work it out" (see make_plan).
struct Options {
  std::optional<int> num_processes;             // -np / --np / -n; default 1, Slurm's task count,
                                                // or the hostfile's slot total
  std::string hostfile;                         // --hostfile; empty: none
  std::optional<int> gpus_per_node;             // --gpus-per-node; default: detected; 0 = CPU only
  std::vector<EnvOption> env;                   // --env, in command-line order
  LauncherKind launcher = LauncherKind::kAuto;  // --backend-launcher
  bool oversubscribe = false;                   // --oversubscribe
  bool dry_run = false;                         // --dry-run
  BindPolicy bind = BindPolicy::kAuto;          // --bind
  std::string mpirun = "mpirun";                // --mpirun; a name (PATH) or a path
  std::vector<std::string> mpirun_args;         // --mpirun-arg, in order: given to mpirun
                                                // verbatim after its own options; the auto
                                                // launcher then picks mpirun
  bool help = false;                            // -h / --help
  std::vector<std::string> program;             // the program and its arguments
};

// Parses dtrain-run's arguments (argv without argv[0]):
//   [launcher options] [--] PROGRAM ARGS...
// Everything after `--`, or from the first argument that is not an option, belongs
// to the program untouched. Long options also take `--name=value`.
// Throws LaunchError(kExitUsage) for an unknown option, a missing or malformed value,
// or no program (unless --help was given).
Options parse_options(const std::vector<std::string>& args);

// The usage text printed by --help.
std::string usage_text();

// One host line of an Open MPI hostfile: `name [slots=N] [max_slots=M]`.
struct HostEntry {
  std::string name;
  int slots = 1;                 // 1 when the line gives no slots=
  bool slots_given = false;      // whether the line had slots=
  std::optional<int> max_slots;  // max_slots= (>= slots), nullopt: unlimited
  int line = 0;                  // 1-based line number in the file
};

struct Hostfile {
  std::string path;  // as given on the command line, used in messages
  std::vector<HostEntry> hosts;
  int total_slots() const;
  // Sum of max_slots when every host sets it, else nullopt (no hard cap).
  std::optional<int> total_max_slots() const;
};

// Parses hostfile text (`#` comments, blank lines, one host per line). Throws
// LaunchError(kExitUsage) naming `path:line` for a bad slot count, an unknown key, a
// duplicate host, or a file with no hosts.
Hostfile parse_hostfile(std::string_view text, const std::string& path);

// The process environment, name -> value.
using Environment = std::map<std::string, std::string>;

// The outside world as make_plan sees it. All members must be set; system probes
// live in main.cc, tests pass fakes.
struct Probes {
  // Whether `path` is a regular file this user may execute.
  std::function<bool(const std::string& path)> is_executable;
  // The whole file, or nullopt when it does not exist or cannot be read.
  std::function<std::optional<std::string>(const std::string& path)> read_file;
  // Runs argv (argv[0] a full path) and returns its stdout and stderr, or nullopt
  // when it could not run. Used only for `srun --mpi=list`.
  std::function<std::optional<std::string>(const std::vector<std::string>& argv)> run_capture;
  std::function<int()> gpu_devices;  // count of /dev/nvidia[0-9]*
  std::function<int()> numa_nodes;   // count of /sys/devices/system/node/node[0-9]*
  std::function<int()> cpu_cores;    // physical cores usable here (what PE= counts)
  std::function<unsigned()> euid;    // effective user id (0: root)
};

// Looks `name` up like execvp: a name with a '/' is checked as is; otherwise each
// directory of env["PATH"] (default "/usr/bin:/bin") in turn. Returns the path found.
std::optional<std::string> find_program(const std::string& name, const Environment& env,
                                        const Probes& probes);

// What dtrain-run will execvp.
struct Plan {
  LauncherKind launcher = LauncherKind::kDirect;  // never kAuto
  std::vector<std::string> argv;                  // argv[0] is looked up on PATH
  // Variables to set in dtrain-run's own environment before execvp (direct launch
  // with --env VAR=VALUE); mpirun and srun get theirs as arguments instead.
  std::vector<std::pair<std::string, std::string>> set_env;
  int num_processes = 1;
  int gpus_per_node = 0;
  std::string launcher_reason;  // why this launcher, for "# launcher: ..."
  std::string binding;          // the placement chosen, for "# binding: ..."
};

// Decides the launcher, process count, binding and argv. Reads the hostfile through
// probes.read_file. Throws LaunchError: kExitUsage for bad input (hostfile errors,
// more processes than slots, options that contradict the launcher), kExitNotFound
// when the program, mpirun or srun cannot be found.
Plan make_plan(const Options& options, const Environment& env, const Probes& probes);

// Quotes one argument for a POSIX shell: unchanged when it holds only
// [A-Za-z0-9_@%+=:,./-] (and is not empty), otherwise in single quotes with each
// embedded ' written as '\''.
std::string shell_quote(const std::string& arg);

// The plan as one pasteable shell command line (no trailing newline): set_env as
// VAR=VALUE prefixes, then the quoted argv.
std::string format_command(const Plan& plan);

}  // namespace launcher
}  // namespace dtrain

#endif  // DTRAIN_LAUNCHER_PLAN_H_
