// The backend registry: the one file that knows which backends were compiled in.
#include <algorithm>
#include <functional>
#include <map>

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

std::unique_ptr<Communicator> create_communicator(const std::string& backend, const World& world,
                                                  c10::Device device, CommOptions options) {
  std::string name = backend;
  if (name == "auto") {
    if (device.is_cuda() && factories().count("nccl")) {
      name = "nccl";
    } else if (world.size > 1 || world.has_mpi_launcher()) {
      name = "mpi";
    } else {
      name = "local";
    }
  }
  if (name == "nccl" && !factories().count("nccl")) {
    throw Error("cannot create communicator 'nccl': this dtrain was built without NCCL "
                "(reconfigure with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON where the CUDA "
                "toolkit and torch's nvidia-nccl wheel are present), or use --backend=mpi");
  }
  auto it = factories().find(name);
  DTRAIN_CHECK(it != factories().end(), "unknown communicator backend '", backend,
               "'; known backends: ", known_names());
  return it->second(world, device, std::move(options));
}

}  // namespace dtrain::dist
