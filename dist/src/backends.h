// Private: constructors of the compiled-in backends, called only by registry.cc.
#pragma once

#include <memory>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist {

std::unique_ptr<Communicator> make_local_communicator(const World& world, CommOptions options);
std::unique_ptr<Communicator> make_mpi_communicator(const World& world, c10::Device device,
                                                    CommOptions options);
// Defined only when dtrain is built with NCCL (nccl_backend.cc).
std::unique_ptr<Communicator> make_nccl_communicator(const World& world, c10::Device device,
                                                     CommOptions options);

}  // namespace dtrain::dist
