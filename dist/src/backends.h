// Private: constructors of the compiled-in backends, called only by registry.cc.
#pragma once

#include <memory>

#include "dtrain/dist/communicator.h"
#include "health.h"

namespace dtrain::dist {

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
