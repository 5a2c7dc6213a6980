#include "plan.h"

#include <algorithm>
#include <climits>
#include <set>
#include <sstream>

namespace dtrain {
namespace launcher {
namespace {

// Largest process, slot or GPU count accepted; anything above is a typo.
constexpr long kMaxCount = 1 << 20;
constexpr char kDefaultPath[] = "/usr/bin:/bin";

[[noreturn]] void usage_error(const std::string& message) {
  throw LaunchError(kExitUsage, message);
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// A plain decimal number: digits only (no sign, no spaces), at most kMaxCount.
std::optional<int> parse_count(std::string_view s) {
  if (s.empty() || s.size() > 8) return std::nullopt;
  long value = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  if (value > kMaxCount) return std::nullopt;
  return static_cast<int>(value);
}

bool valid_env_name(std::string_view name) {
  if (name.empty() || (name[0] >= '0' && name[0] <= '9')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

// ---- option parsing -------------------------------------------------------------------

// The names of --backend-launcher's and --bind's choices (the same names launcher_name() and
// bind_name() give), in the order a usage error lists them.
constexpr std::pair<LauncherKind, const char*> kLauncherNames[] = {
    {LauncherKind::kAuto, "auto"}, {LauncherKind::kMpirun, "mpirun"},
    {LauncherKind::kSrun, "srun"}, {LauncherKind::kDirect, "direct"}};
constexpr std::pair<BindPolicy, const char*> kBindNames[] = {
    {BindPolicy::kAuto, "auto"}, {BindPolicy::kNone, "none"},
    {BindPolicy::kCore, "core"}, {BindPolicy::kNuma, "numa"}};

template <typename E, size_t N>
const char* name_in(const std::pair<E, const char*> (&names)[N], E value) {
  for (const auto& [choice, name] : names) {
    if (choice == value) return name;
  }
  return "?";
}

// The choice `value` names; a usage error listing the names otherwise.
template <typename E, size_t N>
E parse_choice(const std::string& option, const std::string& value,
               const std::pair<E, const char*> (&names)[N]) {
  std::string list;
  for (const auto& [choice, name] : names) {
    if (value == name) return choice;
    list += (list.empty() ? "" : ", ") + std::string(name);
  }
  usage_error(option + " " + shell_quote(value) + " is not one of " + list);
}

bool is_value_option(const std::string& name) {
  static const std::set<std::string> kValueOptions = {
      "-np",   "--np",   "-n",       "--hostfile",         "--gpus-per-node",
      "--env", "--bind", "--mpirun", "--backend-launcher", "--mpirun-arg"};
  return kValueOptions.count(name) > 0;
}

// Applies a flag option; false when `name` is not a flag.
bool apply_flag(const std::string& name, Options* options) {
  if (name == "--oversubscribe") {
    options->oversubscribe = true;
  } else if (name == "--dry-run") {
    options->dry_run = true;
  } else if (name == "-h" || name == "--help") {
    options->help = true;
  } else {
    return false;
  }
  return true;
}

EnvOption parse_env_option(const std::string& value) {
  EnvOption env;
  size_t eq = value.find('=');
  env.name = value.substr(0, eq);
  if (eq != std::string::npos) env.value = value.substr(eq + 1);
  if (!valid_env_name(env.name)) {
    usage_error("--env " + shell_quote(value) +
                " is not VAR or VAR=VALUE with a valid variable name (letters, digits, _)");
  }
  return env;
}

void apply_value(const std::string& name, const std::string& value, Options* options) {
  if (name == "-np" || name == "--np" || name == "-n") {
    std::optional<int> n = parse_count(value);
    if (!n || *n == 0) {
      usage_error(name + " " + shell_quote(value) +
                  " is not a positive integer; pass the number of processes, e.g. -np 4");
    }
    options->num_processes = n;
  } else if (name == "--gpus-per-node") {
    std::optional<int> g = parse_count(value);
    if (!g) {
      usage_error("--gpus-per-node " + shell_quote(value) +
                  " is not a GPU count (0 or more); pass e.g. --gpus-per-node 8, or 0 for "
                  "CPU only");
    }
    options->gpus_per_node = g;
  } else if (name == "--hostfile") {
    if (value.empty()) usage_error("--hostfile needs a file name");
    options->hostfile = value;
  } else if (name == "--env") {
    options->env.push_back(parse_env_option(value));
  } else if (name == "--mpirun") {
    if (value.empty()) usage_error("--mpirun needs a program name or path");
    options->mpirun = value;
  } else if (name == "--mpirun-arg") {
    if (value.empty()) usage_error("--mpirun-arg needs a value, e.g. --mpirun-arg --mca");
    options->mpirun_args.push_back(value);
  } else if (name == "--backend-launcher") {
    options->launcher = parse_choice(name, value, kLauncherNames);
  } else if (name == "--bind") {
    options->bind = parse_choice(name, value, kBindNames);
  }
}

// ---- hostfile -----------------------------------------------------------------------------

std::vector<std::string> split_whitespace(std::string_view line) {
  std::vector<std::string> tokens;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
    if (i > start) tokens.emplace_back(line.substr(start, i - start));
  }
  return tokens;
}

HostEntry parse_host_line(const std::vector<std::string>& tokens, const std::string& where,
                          int line) {
  HostEntry host;
  host.name = tokens[0];
  host.line = line;
  if (host.name.find('=') != std::string::npos) {
    usage_error(where + ": " + quoted(host.name) +
                " comes before a host name; a line is 'hostname [slots=N] [max_slots=M]'");
  }
  for (size_t i = 1; i < tokens.size(); ++i) {
    const std::string& token = tokens[i];
    size_t eq = token.find('=');
    if (eq == std::string::npos) {
      usage_error(where + ": unexpected " + quoted(token) + " after host " + quoted(host.name) +
                  "; expected slots=N or max_slots=M");
    }
    std::string key = token.substr(0, eq);
    if (key != "slots" && key != "max_slots" && key != "max-slots") {
      usage_error(where + ": unknown key " + quoted(key) + " in " + quoted(token) +
                  "; expected slots=N or max_slots=M");
    }
    std::optional<int> n = parse_count(std::string_view(token).substr(eq + 1));
    if (!n || *n == 0) usage_error(where + ": " + quoted(token) + " is not a positive integer");
    if (key == "slots") {
      if (host.slots_given) usage_error(where + ": slots= given twice for " + quoted(host.name));
      host.slots = *n;
      host.slots_given = true;
    } else {
      if (host.max_slots) usage_error(where + ": max_slots= given twice for " + quoted(host.name));
      host.max_slots = *n;
    }
  }
  if (host.max_slots && *host.max_slots < host.slots) {
    usage_error(where + ": max_slots=" + std::to_string(*host.max_slots) +
                " is less than slots=" + std::to_string(host.slots));
  }
  return host;
}

// ---- planning -----------------------------------------------------------------------------

// GPUs this node shows: CUDA_VISIBLE_DEVICES when set (entries up to the first one
// CUDA would reject, as CUDA does), else the /dev/nvidiaN device files. A node with no device
// files has no GPU, whatever CUDA_VISIBLE_DEVICES lists (a user audit: CUDA_VISIBLE_DEVICES=0
// on a CPU machine planned a rank per GPU, and mpirun refused the mapping without a word why).
int detect_gpus(const Environment& env, const Probes& probes) {
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  const int devices = probes.gpu_devices();
  if (it == env.end() || devices == 0) return devices;
  int count = 0;
  std::stringstream entries(it->second);
  std::string entry;
  while (std::getline(entries, entry, ',')) {
    bool valid = (!entry.empty() && entry[0] >= '0' && entry[0] <= '9') ||
                 starts_with(entry, "GPU-") || starts_with(entry, "MIG-");
    if (!valid) break;
    ++count;
  }
  return count;
}

std::optional<int> env_count(const Environment& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  std::optional<int> n = parse_count(it->second);
  if (n && *n == 0) return std::nullopt;
  return n;
}

// Slurm's task count for this allocation: SLURM_NTASKS, SLURM_NPROCS, else one task
// per GPU (at least one) on each of SLURM_JOB_NUM_NODES nodes.
std::optional<int> slurm_task_count(const Environment& env, int gpus_per_node) {
  if (auto n = env_count(env, "SLURM_NTASKS")) return n;
  if (auto n = env_count(env, "SLURM_NPROCS")) return n;
  if (auto nodes = env_count(env, "SLURM_JOB_NUM_NODES")) {
    return *nodes * std::max(1, gpus_per_node);
  }
  return std::nullopt;
}

bool in_slurm_allocation(const Environment& env) {
  auto it = env.find("SLURM_JOB_ID");
  return it != env.end() && !it->second.empty();
}

// Picks the launcher and fills plan->launcher and plan->launcher_reason.
void choose_launcher(const Options& options, bool have_hostfile, bool in_slurm, bool have_srun,
                     Plan* plan) {
  const int n = plan->num_processes;
  const bool want_mpirun = have_hostfile || !options.mpirun_args.empty();
  if (!options.mpirun_args.empty() &&
      (options.launcher == LauncherKind::kDirect || options.launcher == LauncherKind::kSrun)) {
    usage_error(std::string("--mpirun-arg needs mpirun, but --backend-launcher is ") +
                launcher_name(options.launcher) + "; drop one of them");
  }
  switch (options.launcher) {
    case LauncherKind::kDirect:
      if (n != 1) {
        usage_error("--backend-launcher direct starts one process, but -np is " +
                    std::to_string(n) + "; use --backend-launcher mpirun or srun");
      }
      if (have_hostfile) {
        usage_error("--hostfile needs mpirun; --backend-launcher direct runs on this host only");
      }
      plan->launcher_reason = "direct (--backend-launcher direct)";
      break;
    case LauncherKind::kSrun:
    case LauncherKind::kMpirun:
      plan->launcher_reason =
          std::string(launcher_name(options.launcher)) + " (--backend-launcher)";
      break;
    case LauncherKind::kAuto:
      if (in_slurm && have_srun && !want_mpirun) {
        plan->launcher = LauncherKind::kSrun;
        plan->launcher_reason = "srun (inside Slurm job: SLURM_JOB_ID is set, srun is on PATH)";
      } else if (n == 1 && !want_mpirun) {
        plan->launcher = LauncherKind::kDirect;
        plan->launcher_reason = "direct (one process, no hostfile)";
      } else {
        plan->launcher = LauncherKind::kMpirun;
        plan->launcher_reason = have_hostfile ? "mpirun (hosts from --hostfile)"
                                : want_mpirun
                                    ? "mpirun (--mpirun-arg given)"
                                    : "mpirun (" + std::to_string(n) + " processes, no Slurm job)";
      }
      return;
  }
  plan->launcher = options.launcher;
  if (plan->launcher == LauncherKind::kSrun && have_hostfile) {
    usage_error("--hostfile is for mpirun; srun takes its hosts from the Slurm allocation");
  }
}

void check_slots(const Hostfile& hostfile, int n, bool oversubscribe) {
  const int slots = hostfile.total_slots();
  if (n > slots && !oversubscribe) {
    bool defaulted = std::any_of(hostfile.hosts.begin(), hostfile.hosts.end(),
                                 [](const HostEntry& h) { return !h.slots_given; });
    usage_error("-np " + std::to_string(n) + " needs " + std::to_string(n) +
                " slots but hostfile " + hostfile.path + " has " + std::to_string(slots) +
                (defaulted ? " (a host without slots= counts as 1)" : "") +
                "; add hosts or pass --oversubscribe");
  }
  std::optional<int> cap = hostfile.total_max_slots();
  if (cap && n > *cap) {
    usage_error("-np " + std::to_string(n) + " exceeds the max_slots total " +
                std::to_string(*cap) + " of hostfile " + hostfile.path +
                "; raise max_slots or add hosts");
  }
}

struct Binding {
  std::vector<std::string> args;
  std::string text;
};

// mpirun's --map-by/--bind-to: one rank per GPU with the node's cores shared out,
// per NUMA node when the GPUs divide evenly among several; one core per rank on CPU.
Binding mpirun_binding(BindPolicy bind, int gpus, bool oversubscribe, int cores, int numa_nodes) {
  if (bind == BindPolicy::kNone) return {{"--bind-to", "none"}, "none (--bind none)"};
  if (oversubscribe && bind == BindPolicy::kAuto) {
    return {{"--bind-to", "none"}, "none (oversubscribed: ranks share cores)"};
  }
  const std::string overload = oversubscribe ? ":overload-allowed" : "";
  const std::string bind_to = "core" + overload;
  if (gpus > 0) {
    const std::string pe = std::to_string(std::max(1, cores / gpus));
    const std::string g = std::to_string(gpus);
    const std::string per_rank = ", " + pe + " core(s) each, bound to cores";
    const bool want_numa = bind == BindPolicy::kNuma || bind == BindPolicy::kAuto;
    if (want_numa && numa_nodes > 1 && gpus % numa_nodes == 0) {
      const std::string per_numa = std::to_string(gpus / numa_nodes);
      return {{"--map-by", "ppr:" + per_numa + ":numa:PE=" + pe, "--bind-to", bind_to},
              per_numa + " rank(s) per NUMA node (" + g + " GPUs over " +
                  std::to_string(numa_nodes) + " NUMA nodes)" + per_rank};
    }
    std::string text = g + " rank(s) per node, one per GPU" + per_rank;
    if (bind == BindPolicy::kNuma || (want_numa && numa_nodes > 1)) {
      text += numa_nodes > 1 ? "; not per NUMA node: " + g + " GPUs do not divide among " +
                                   std::to_string(numa_nodes) + " NUMA nodes"
                             : "; not per NUMA node: this node has one NUMA node";
    }
    return {{"--map-by", "ppr:" + g + ":node:PE=" + pe, "--bind-to", bind_to}, text};
  }
  if (bind == BindPolicy::kNuma && numa_nodes > 1) {
    return {{"--map-by", "numa", "--bind-to", "numa" + overload},
            "ranks spread over " + std::to_string(numa_nodes) +
                " NUMA nodes, each bound to its NUMA node (CPU only)"};
  }
  std::string text = "one core per rank, bound to it (CPU only)";
  if (bind == BindPolicy::kNuma) text += "; not per NUMA node: this node has one NUMA node";
  return {{"--map-by", "core", "--bind-to", bind_to}, text};
}

void require_env_values(const Options& options, const Environment& env) {
  for (const EnvOption& e : options.env) {
    if (!e.value && env.count(e.name) == 0) {
      usage_error("--env " + e.name + ": " + e.name +
                  " is not set in this environment; set it or pass --env " + e.name + "=VALUE");
    }
  }
}

void build_mpirun(const Options& options, const Hostfile* hostfile, const Probes& probes,
                  Plan* plan) {
  std::vector<std::string>& argv = plan->argv;
  argv = {options.mpirun, "-np", std::to_string(plan->num_processes)};
  if (probes.euid() == 0) argv.push_back("--allow-run-as-root");
  if (hostfile) argv.insert(argv.end(), {"--hostfile", options.hostfile});
  if (options.oversubscribe) argv.push_back("--oversubscribe");
  for (const EnvOption& e : options.env) {
    argv.insert(argv.end(), {"-x", e.value ? e.name + "=" + *e.value : e.name});
  }
  Binding binding = mpirun_binding(options.bind, plan->gpus_per_node, options.oversubscribe,
                                   std::max(1, probes.cpu_cores()), probes.numa_nodes());
  argv.insert(argv.end(), binding.args.begin(), binding.args.end());
  argv.insert(argv.end(), options.mpirun_args.begin(), options.mpirun_args.end());
  plan->binding = binding.text;
}

void build_srun(const Options& options, const std::string& srun_path, const Probes& probes,
                Plan* plan) {
  std::vector<std::string>& argv = plan->argv;
  argv = {"srun", "--ntasks=" + std::to_string(plan->num_processes)};
  if (plan->gpus_per_node > 0) {
    argv.push_back("--ntasks-per-node=" + std::to_string(plan->gpus_per_node));
  }
  argv.push_back("--kill-on-bad-exit=1");
  std::optional<std::string> mpi_types = probes.run_capture({srun_path, "--mpi=list"});
  if (mpi_types && mpi_types->find("pmix") != std::string::npos) argv.push_back("--mpi=pmix");
  if (options.oversubscribe) argv.push_back("--overcommit");
  // Each policy's srun --cpu-bind (none: Slurm's default) and the plan's words for it.
  struct SrunBinding {
    BindPolicy policy;
    const char* cpu_bind;
    const char* text;
  };
  static constexpr SrunBinding kSrunBindings[] = {
      {BindPolicy::kAuto, nullptr, "left to Slurm (its default --cpu-bind)"},
      {BindPolicy::kNone, "none", "none (--cpu-bind=none)"},
      {BindPolicy::kCore, "cores", "cores (--cpu-bind=cores)"},
      {BindPolicy::kNuma, "ldoms", "NUMA nodes (--cpu-bind=ldoms)"}};
  for (const SrunBinding& b : kSrunBindings) {
    if (b.policy != options.bind) continue;
    plan->binding = b.text;
    if (b.cpu_bind) argv.push_back(std::string("--cpu-bind=") + b.cpu_bind);
  }
  if (!options.env.empty()) {
    std::string exports = "--export=ALL";
    for (const EnvOption& e : options.env) {
      if (e.value && e.value->find(',') != std::string::npos) {
        usage_error("--env " + e.name +
                    "=...: srun's --export cannot carry a value with ','; "
                    "export " +
                    e.name + " in the shell and pass --env " + e.name);
      }
      exports += "," + (e.value ? e.name + "=" + *e.value : e.name);
    }
    argv.push_back(exports);
  }
}

void check_program(const Options& options, const Plan& plan, Environment env,
                   const Probes& probes) {
  // A direct launch runs under set_env, which may change PATH.
  for (const auto& [name, value] : plan.set_env) env[name] = value;
  const std::string& program = options.program[0];
  if (find_program(program, env, probes)) return;
  if (program.find('/') != std::string::npos) {
    throw LaunchError(kExitNotFound,
                      "program " + quoted(program) + " does not exist or is not executable");
  }
  throw LaunchError(kExitNotFound, "program " + quoted(program) +
                                       " not found on PATH; give its path, e.g. ./" + program);
}

}  // namespace

const char* launcher_name(LauncherKind kind) { return name_in(kLauncherNames, kind); }

const char* bind_name(BindPolicy policy) { return name_in(kBindNames, policy); }

Options parse_options(const std::vector<std::string>& args) {
  Options options;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program starts here
    std::string name = arg;
    std::optional<std::string> value;
    size_t eq = arg.find('=');
    if (starts_with(arg, "--") && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    if (!value && apply_flag(name, &options)) continue;
    if (!is_value_option(name)) {
      usage_error("unknown option " + quoted(arg) +
                  "; launcher options go before '--' and the program after it (see "
                  "dtrain-run --help)");
    }
    if (!value) {
      if (i + 1 >= args.size() || args[i + 1] == "--") {
        usage_error(name + " needs a value (see dtrain-run --help)");
      }
      value = args[++i];
    }
    apply_value(name, *value, &options);
  }
  options.program.assign(args.begin() + std::min(i, args.size()), args.end());
  if (options.program.empty() && !options.help) {
    usage_error("no program to run; usage: dtrain-run [options] -- PROGRAM [ARGS...]");
  }
  return options;
}

std::string usage_text() {
  return R"(usage: dtrain-run [options] [--] PROGRAM [ARGS...]

Starts PROGRAM as N processes, one per GPU: through srun inside a Slurm job,
directly for one process on this host, else through mpirun.

options:
  -np N, --np N, -n N     processes to start (default: the hostfile's slots,
                          Slurm's task count inside a job, else 1)
  --hostfile FILE         Open MPI hostfile: 'host [slots=N] [max_slots=M]' lines
  --gpus-per-node G       ranks per node, one per GPU (default: CUDA_VISIBLE_DEVICES
                          or /dev/nvidiaN count); 0 runs on CPU
  --env VAR[=VALUE]       pass VAR (its value here, or VALUE) to every rank; repeatable
  --backend-launcher L    auto (default), mpirun, srun or direct
  --oversubscribe         allow more processes than slots/cores
  --bind B                auto (default), none, core or numa
  --mpirun PATH           the mpirun to use (default: mpirun on PATH)
  --mpirun-arg ARG        pass ARG to mpirun as it is (before the program); repeatable,
                          e.g. --mpirun-arg --mca --mpirun-arg btl_tcp_if_include
                          --mpirun-arg eth0; implies mpirun
  --dry-run               print the command (stdout) and its launcher and binding
                          (stderr, as '# ' lines); run nothing
  -h, --help              this text

exit status: PROGRAM's (or mpirun's / srun's); 2 for bad options or hostfile;
127 when PROGRAM, mpirun or srun is not found. Install Open MPI with
'bash cluster/setup.sh'.
)";
}

int Hostfile::total_slots() const {
  long long total = 0;
  for (const HostEntry& h : hosts) total += h.slots;
  return static_cast<int>(std::min<long long>(total, INT_MAX));
}

std::optional<int> Hostfile::total_max_slots() const {
  long long total = 0;
  for (const HostEntry& h : hosts) {
    if (!h.max_slots) return std::nullopt;
    total += *h.max_slots;
  }
  return static_cast<int>(std::min<long long>(total, INT_MAX));
}

Hostfile parse_hostfile(std::string_view text, const std::string& path) {
  Hostfile hostfile;
  hostfile.path = path;
  std::map<std::string, int> first_line;  // host name -> line it was listed on
  int line_number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = std::min(text.find('\n', pos), text.size());
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<std::string> tokens = split_whitespace(line);
    if (tokens.empty()) continue;
    const std::string where = "hostfile " + path + ":" + std::to_string(line_number);
    HostEntry host = parse_host_line(tokens, where, line_number);
    auto [it, inserted] = first_line.emplace(host.name, line_number);
    if (!inserted) {
      usage_error(where + ": host " + quoted(host.name) + " already listed on line " +
                  std::to_string(it->second) + "; give it one line with slots=N");
    }
    hostfile.hosts.push_back(std::move(host));
  }
  if (hostfile.hosts.empty()) {
    usage_error("hostfile " + path + " lists no hosts; write one per line, e.g. 'node1 slots=4'");
  }
  return hostfile;
}

std::optional<std::string> find_program(const std::string& name, const Environment& env,
                                        const Probes& probes) {
  if (name.empty()) return std::nullopt;
  if (name.find('/') != std::string::npos) {
    if (probes.is_executable(name)) return name;
    return std::nullopt;
  }
  auto it = env.find("PATH");
  std::string path = it != env.end() ? it->second : kDefaultPath;
  size_t pos = 0;
  while (true) {
    size_t end = std::min(path.find(':', pos), path.size());
    std::string dir = path.substr(pos, end - pos);
    if (dir.empty()) dir = ".";
    std::string candidate = dir + "/" + name;
    if (probes.is_executable(candidate)) return candidate;
    if (end == path.size()) return std::nullopt;
    pos = end + 1;
  }
}

Plan make_plan(const Options& options, const Environment& env, const Probes& probes) {
  if (options.program.empty()) usage_error("no program to run");
  std::optional<Hostfile> hostfile;
  if (!options.hostfile.empty()) {
    std::optional<std::string> text = probes.read_file(options.hostfile);
    if (!text) {
      usage_error("hostfile " + quoted(options.hostfile) +
                  " does not exist or cannot be read; pass a file with one host per line");
    }
    hostfile = parse_hostfile(*text, options.hostfile);
  }

  Plan plan;
  plan.gpus_per_node = options.gpus_per_node ? *options.gpus_per_node : detect_gpus(env, probes);
  const bool in_slurm = in_slurm_allocation(env);
  if (options.num_processes) {
    plan.num_processes = *options.num_processes;
  } else if (hostfile) {
    plan.num_processes = hostfile->total_slots();
  } else if (in_slurm) {
    plan.num_processes = slurm_task_count(env, plan.gpus_per_node).value_or(1);
  }

  std::optional<std::string> srun_path;
  if (options.launcher == LauncherKind::kSrun ||
      (options.launcher == LauncherKind::kAuto && in_slurm)) {
    srun_path = find_program("srun", env, probes);
  }
  choose_launcher(options, hostfile.has_value(), in_slurm, srun_path.has_value(), &plan);
  if (hostfile) check_slots(*hostfile, plan.num_processes, options.oversubscribe);
  require_env_values(options, env);

  switch (plan.launcher) {
    case LauncherKind::kMpirun:
      if (!find_program(options.mpirun, env, probes)) {
        throw LaunchError(
            kExitNotFound,
            std::to_string(plan.num_processes) + " process(es) need mpirun, but " +
                quoted(options.mpirun) +
                " is not found; install Open MPI (bash cluster/setup.sh) or pass --mpirun PATH");
      }
      build_mpirun(options, hostfile ? &*hostfile : nullptr, probes, &plan);
      break;
    case LauncherKind::kSrun:
      if (!srun_path) {
        throw LaunchError(kExitNotFound,
                          "srun is not on PATH; run inside a Slurm installation or pass "
                          "--backend-launcher mpirun");
      }
      build_srun(options, *srun_path, probes, &plan);
      break;
    default:
      for (const EnvOption& e : options.env) {
        if (e.value) plan.set_env.emplace_back(e.name, *e.value);
      }
      plan.binding = "none (one process, run directly)";
      break;
  }
  check_program(options, plan, env, probes);
  plan.argv.insert(plan.argv.end(), options.program.begin(), options.program.end());
  return plan;
}

std::string shell_quote(const std::string& arg) {
  const bool safe = !arg.empty() && std::all_of(arg.begin(), arg.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           std::string_view("_@%+=:,./-").find(c) != std::string_view::npos;
  });
  if (safe) return arg;
  std::string out = "'";
  for (char c : arg) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string format_command(const Plan& plan) {
  std::string line;
  for (const auto& [name, value] : plan.set_env) line += name + "=" + shell_quote(value) + " ";
  for (size_t i = 0; i < plan.argv.size(); ++i) {
    const std::string& arg = plan.argv[i];
    // A first word with '=' would read as an assignment: always quote it.
    bool force = i == 0 && arg.find('=') != std::string::npos;
    std::string q = shell_quote(arg);
    if (force && q == arg) q = "'" + arg + "'";
    line += (i ? " " : "") + q;
  }
  return line;
}

}  // namespace launcher
}  // namespace dtrain
