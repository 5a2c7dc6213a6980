// The backend registry: the one file that knows which backends were compiled in.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
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
      {"nccl", [](const World& w, c10::Device d, CommOptions o) {
         return make_nccl_communicator(w, d, std::move(o));
       }},
#endif
  };
  return f;
}

#if DTRAIN_WITH_NCCL
std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// Every rank's text (at most kWidth - 1 bytes), in rank order, over comm.
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& mine) {
  constexpr int64_t kWidth = 256;
  at::Tensor in = at::zeros({kWidth}, at::kByte);
  std::memcpy(in.data_ptr(), mine.data(), std::min<size_t>(mine.size(), kWidth - 1));
  at::Tensor out = at::empty({kWidth * comm.size()}, at::kByte);
  comm.all_gather(in, out)->wait();
  std::vector<std::string> texts;
  for (int r = 0; r < comm.size(); ++r) {
    texts.emplace_back(reinterpret_cast<const char*>(out.data_ptr<uint8_t>() + r * kWidth));
  }
  return texts;
}
#endif

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

std::string find_shared_gpu(const std::vector<std::string>& host_and_gpu) {
  std::map<std::string, size_t> first;  // "<host> <gpu>" -> the first rank with it
  for (size_t r = 0; r < host_and_gpu.size(); ++r) {
    const std::string& key = host_and_gpu[r];
    const size_t space = key.find(' ');
    if (space == std::string::npos || space + 1 == key.size()) continue;  // GPU unknown
    auto [it, inserted] = first.emplace(key, r);
    if (!inserted) {
      std::ostringstream os;
      os << "ranks " << it->second << " and " << r << " on host " << key.substr(0, space)
         << " use the same GPU (PCI " << key.substr(space + 1) << ")";
      return os.str();
    }
  }
  return "";
}

void check_on_comm_device(const std::string& what, c10::Device tensor, c10::Device comm) {
  DTRAIN_CHECK(tensor == comm, what, ": the tensor is on ", tensor, " but this communicator's GPU is ",
               comm, "; collectives take tensors on the rank's own GPU (the device select_device() ",
               "chose): move it there with .to(", comm, ")");
}

std::string choose_backend(const std::string& requested, const World& world, bool cuda_device,
                           const std::string& shared_gpu, bool have_nccl) {
  // NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
  const bool shared = cuda_device && !shared_gpu.empty();
  if (requested == "auto") {
    if (cuda_device && have_nccl && !shared) return "nccl";
    return world.size > 1 || world.has_mpi_launcher() ? "mpi" : "local";
  }
  if (requested == "nccl") {
    DTRAIN_CHECK(have_nccl,
                 "cannot create communicator 'nccl': this dtrain was built without NCCL "
                 "(reconfigure with -DDTRAIN_WITH_CUDA=ON -DDTRAIN_WITH_NCCL=ON where the CUDA "
                 "toolkit and torch's nvidia-nccl wheel are present), or use --backend=mpi");
    DTRAIN_CHECK(!shared, "--backend=nccl: ", shared_gpu,
                 ", and NCCL needs a GPU of its own for every rank; start at most as many ranks "
                 "per node as it has GPUs (or give each rank its own with CUDA_VISIBLE_DEVICES), "
                 "or use --backend=mpi (CUDA tensors staged through host memory)");
  }
  return requested;
}

std::unique_ptr<Communicator> create_communicator(const std::string& backend, const World& world,
                                                  c10::Device device, CommOptions options) {
  const bool cuda = device.is_cuda();
  const bool have_nccl = factories().count("nccl") > 0;
  // Whether ranks share a GPU is exchanged, not inferred from how many GPUs this rank sees
  // (per-rank CUDA_VISIBLE_DEVICES shows every rank one GPU, each a different one). The MPI
  // communicator that carries the exchange is kept: it is the result (mpi) or NCCL's partner.
  std::unique_ptr<Communicator> host;
  std::string shared;
#if DTRAIN_WITH_NCCL
  if (cuda && have_nccl && world.size > 1 && (backend == "auto" || backend == "nccl")) {
    host = make_mpi_communicator(world, device, options);
    shared = find_shared_gpu(all_gather_text(*host, host_name() + " " + gpu_pci_bus_id(device)));
  }
#endif
  std::string name = choose_backend(backend, world, cuda, shared, have_nccl);
  if (backend == "auto" && cuda && name != "nccl" && world.rank == 0) {
    LOG_FIRST_N(INFO, 1) << "backend auto: mpi, not nccl ("
                         << (shared.empty() ? std::string("built without NCCL") : shared) << ")";
  }
#if DTRAIN_WITH_NCCL
  if (host && name == "mpi") return host;
  if (host && name == "nccl") return make_nccl_communicator(world, device, std::move(options), std::move(host));
#endif
  auto it = factories().find(name);
  DTRAIN_CHECK(it != factories().end(), "unknown communicator backend '", backend,
               "'; known backends: ", known_names());
  return it->second(world, device, std::move(options));
}

}  // namespace dtrain::dist
