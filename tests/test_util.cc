#include "test_util.h"

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

void shutdown() { comm.reset(); }

bool has_cuda() { return at::hasCUDA(); }

double rel_error(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().to(at::kCPU, at::kDouble);
  at::Tensor y = b.detach().to(at::kCPU, at::kDouble);
  double denom = std::max(y.norm().item<double>(), 1e-300);
  return (x - y).norm().item<double>() / denom;
}

}  // namespace dtrain::testing_util
