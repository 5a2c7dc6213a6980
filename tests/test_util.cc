#include "test_util.h"

#include "dtrain/dist/error.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

namespace dtrain::testing_util {
namespace {
std::unique_ptr<dist::Communicator> comm;
std::unique_ptr<dist::World> the_world;
}  // namespace

const dist::World& world() {
  if (!the_world) the_world = std::make_unique<dist::World>(dist::detect_world());
  return *the_world;
}

dist::Communicator& world_comm() {
  if (!comm) {
    dist::CommOptions options;
    options.timeout = std::chrono::seconds(120);
    comm = dist::create_communicator(world().has_mpi_launcher() ? "mpi" : "local", world(),
                                     c10::Device(c10::kCPU), options);
  }
  return *comm;
}

std::unique_ptr<dist::Communicator> local_comm() {
  return dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
}

std::unique_ptr<dist::Communicator> alone_comm() {
  dist::Communicator& world = world_comm();
  return world.split(world.rank(), 0, "alone");
}

void shutdown() { comm.reset(); }

bool has_cuda() { return at::hasCUDA(); }

std::string source_path(const std::string& relative) {
  return std::string(DTRAIN_SOURCE_DIR) + "/" + relative;
}

std::string run_python(const std::string& script, const std::vector<std::string>& args) {
  // Arguments are single-quoted for the shell popen uses; they come from the tests only.
  std::string cmd = std::string("'") + DTRAIN_TEST_PYTHON + "' '" + source_path(script) + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    ADD_FAILURE() << "cannot run " << cmd;
    return "";
  }
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  int rc = pclose(pipe);
  if (rc != 0) {
    ADD_FAILURE() << cmd << " failed with status " << rc << "; output:\n" << out;
    return "";
  }
  return out;
}

double rel_error(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().to(at::kCPU, at::kDouble);
  at::Tensor y = b.detach().to(at::kCPU, at::kDouble);
  double denom = std::max(y.norm().item<double>(), 1e-300);
  return (x - y).norm().item<double>() / denom;
}

void remove_tree(const std::string& path) {
  nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) { return std::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

ScratchDir::ScratchDir(const std::string& name, bool create) {
  static int counter = 0;
  const char* tmp = std::getenv("TMPDIR");
  path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtrain_" + name + "_" +
          std::to_string(getpid()) + "_" + std::to_string(counter++);
  remove_tree(path_);
  if (create) mkdir(path_.c_str(), 0700);
}

ScratchDir::~ScratchDir() { remove_tree(path_); }

namespace {

// The message of the dtrain::Error that fn throws, none when it throws none.
std::optional<std::string> thrown_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const dtrain::Error& e) {
    return e.what();
  }
  return std::nullopt;
}

}  // namespace

std::string error_of(const std::function<void()>& fn) {
  const std::optional<std::string> message = thrown_error(fn);
  if (!message) ADD_FAILURE() << "no dtrain::Error thrown";
  return message.value_or("");
}

::testing::AssertionResult throws_error_with(const std::function<void()>& fn,
                                             const std::string& needle) {
  const std::optional<std::string> message = thrown_error(fn);
  if (!message) {
    return ::testing::AssertionFailure() << "no dtrain::Error thrown (expected one saying '" << needle
                                         << "')";
  }
  if (message->find(needle) == std::string::npos) {
    return ::testing::AssertionFailure() << "the dtrain::Error '" << *message << "' does not say '"
                                         << needle << "'";
  }
  return ::testing::AssertionSuccess();
}

std::vector<int> tp_group_sizes() {
  std::vector<int> t;
  for (int T = 2; T <= world_comm().size(); T *= 2) {
    if (world_comm().size() % T == 0) t.push_back(T);
  }
  return t;
}

at::Tensor same_everywhere(std::vector<int64_t> shape, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble);
}

}  // namespace dtrain::testing_util
