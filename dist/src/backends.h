// Private: constructors of the compiled-in backends, called only by registry.cc.
#pragma once

#include <memory>

#include "dtrain/dist/communicator.h"
#include "health.h"

namespace dtrain::dist {

// The backend create_communicator() uses for `requested` ("auto", "nccl", "mpi", "local"):
// auto is nccl for a CUDA device when built with NCCL and no two ranks of a node share a GPU,
// else mpi under a launcher or with several ranks, else local. Throws dtrain::Error for nccl
// when it is not built in or ranks would share a GPU. Pure (tests).
std::string choose_backend(const std::string& requested, const World& world, bool cuda_device,
                           int gpu_count, bool have_nccl);
std::unique_ptr<Communicator> make_local_communicator(const World& world, CommOptions options);
std::unique_ptr<Communicator> make_mpi_communicator(const World& world, c10::Device device,
                                                    CommOptions options);
// Registers another communicator over the same ranks as the MPI communicator `partner` with
// the health service, as backend kind `kind` (1: nccl). nullptr when partner is not an MPI
// communicator or there is no health service.
std::shared_ptr<HealthTicket> sibling_health(const Communicator& partner, int64_t kind);
// Defined only when dtrain is built with NCCL (nccl_backend.cc).
std::unique_ptr<Communicator> make_nccl_communicator(const World& world, c10::Device device,
                                                     CommOptions options);

}  // namespace dtrain::dist
