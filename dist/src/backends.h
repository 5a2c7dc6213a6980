// Private: constructors of the compiled-in backends, called only by registry.cc.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "health.h"

namespace dtrain::dist {

// The backend create_communicator() uses for `requested` ("auto", "nccl", "mpi", "local"):
// auto is nccl for a CUDA device when built with NCCL and no two ranks of a node share a GPU,
// else mpi under a launcher or with several ranks, else local. shared_gpu: "" when no two
// ranks share a GPU, else which do (find_shared_gpu). Throws dtrain::Error for nccl when it is
// not built in or ranks share a GPU. Pure (tests).
std::string choose_backend(const std::string& requested, const World& world, bool cuda_device,
                           const std::string& shared_gpu, bool have_nccl);
// Which ranks use the same physical GPU, from each rank's "<host> <gpu identity>" (index =
// rank; an empty identity is unknown and matches nothing): "" when none do, else the first
// such pair ("ranks 0 and 2 on host n1 use the same GPU (PCI 0000:17:00.0)"). Counting the GPUs
// a rank sees cannot tell: with per-rank CUDA_VISIBLE_DEVICES (Slurm --gpus-per-task) every
// rank sees one GPU, a different one. Pure (tests).
std::string find_shared_gpu(const std::vector<std::string>& host_and_gpu);
// Throws dtrain::Error naming both devices and the fix unless a collective's tensor is on the
// communicator's GPU (NCCL would read another GPU's memory: an illegal-address fault).
void check_on_comm_device(const std::string& what, c10::Device tensor, c10::Device comm);
std::unique_ptr<Communicator> make_local_communicator(const World& world, CommOptions options);
std::unique_ptr<Communicator> make_mpi_communicator(const World& world, c10::Device device,
                                                    CommOptions options);
// Registers another communicator over the same ranks as the MPI communicator `partner` with
// the health service, as backend kind `kind` (1: nccl). nullptr when partner is not an MPI
// communicator or there is no health service.
std::shared_ptr<HealthTicket> sibling_health(const Communicator& partner, int64_t kind);
// Defined only when dtrain is built with NCCL (nccl_backend.cc). partner: the MPI
// communicator over the same ranks to bootstrap with and to carry CPU tensors; created when
// null.
std::unique_ptr<Communicator> make_nccl_communicator(const World& world, c10::Device device,
                                                     CommOptions options,
                                                     std::unique_ptr<Communicator> partner = nullptr);
// The GPU's PCI bus id ("0000:17:00.0"): what NCCL's own duplicate-GPU check compares. Defined
// only when built with NCCL.
std::string gpu_pci_bus_id(c10::Device device);

}  // namespace dtrain::dist
