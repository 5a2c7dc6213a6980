// The backend registry: the one file that knows which backends were compiled in.
#include <algorithm>
#include <functional>
#include <map>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <glog/logging.h>

#include "backends.h"
#include "dtrain/dist/error.h"

namespace dtrain::dist {
namespace {

using Factory = std::function<std::unique_ptr<Communicator>(const World&, c10::Device, CommOptions)>;

const std::map<std::string, Factory>& factories() {
  static const std::map<std::string, Factory> f = {
      {"local", [](const World& w, c10::Device, CommOptions o) {
         return make_local_communicator(w, std::move(o));
       }},
      {"mpi", make_mpi_communicator},
#if DTRAIN_WITH_NCCL
      {"nccl", make_nccl_communicator},
#endif
  };
  return f;
}

std::string known_names() {
  std::string s = "auto";
  for (auto& [name, f] : factories()) s += ", " + name;
  return s;
}

}  // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
  for (auto& [name, f] : factories()) names.push_back(name);
  return names;
}

std::string choose_backend(const std::string& requested, const World& world, bool cuda_device,
                           int gpu_count, bool have_nccl) {
  // NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): more ranks on this node than
  // GPUs means ranks share a GPU (select_device maps local ranks round-robin).
  const bool shared_gpu = cuda_device && world.local_size > gpu_count;
  if (requested == "auto") {
    if (cuda_device && have_nccl && !shared_gpu) return "nccl";
    return world.size > 1 || world.has_mpi_launcher() ? "mpi" : "local";
  }
  if (requested == "nccl") {
    DTRAIN_CHECK(have_nccl,
                 "cannot create communicator 'nccl': this dtrain was built without NCCL "
                 "(reconfigure with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON where the CUDA "
                 "toolkit and torch's nvidia-nccl wheel are present), or use --backend=mpi");
    DTRAIN_CHECK(!shared_gpu, "--backend=nccl: ", world.local_size, " ranks on this node share ",
                 gpu_count, " GPU(s), and NCCL needs a GPU per rank; start at most ", gpu_count,
                 " ranks per node, or use --backend=mpi (CUDA tensors staged through host memory)");
  }
  return requested;
}

std::unique_ptr<Communicator> create_communicator(const std::string& backend, const World& world,
                                                  c10::Device device, CommOptions options) {
  const bool cuda = device.is_cuda();
  const int gpus =
      cuda ? static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount()) : 0;
  std::string name = choose_backend(backend, world, cuda, gpus, factories().count("nccl") > 0);
  if (backend == "auto" && cuda && name != "nccl" && world.rank == 0) {
    LOG_FIRST_N(INFO, 1) << "backend auto: mpi, not nccl (" << world.local_size
                         << " ranks per node share " << gpus << " GPU(s)";
  }
  auto it = factories().find(name);
  DTRAIN_CHECK(it != factories().end(), "unknown communicator backend '", backend,
               "'; known backends: ", known_names());
  return it->second(world, device, std::move(options));
}

}  // namespace dtrain::dist
