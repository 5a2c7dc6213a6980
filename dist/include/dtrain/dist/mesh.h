// The data x tensor-parallel process mesh.
//
// With tensor-parallel size T, ranks [k*T, (k+1)*T) form tensor-parallel group k (consecutive
// ranks, so a group stays on one node under the usual block mapping) and ranks with the same
// position in their tensor-parallel group form a data-parallel group.
#pragma once

#include <memory>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist {

class Mesh {
 public:
  // Checks T against the world first (T >= 1, T <= world size, T divides the world size),
  // throwing dtrain::Error that names the numbers before any collective; then splits world
  // twice (collective, synchronous). world must outlive the mesh.
  Mesh(Communicator& world, int tensor_parallel);

  Communicator& world() const { return *world_; }
  Communicator& tp() const { return *tp_; }  // this rank's tensor-parallel group
  Communicator& dp() const { return *dp_; }  // this rank's data-parallel group
  int tp_size() const { return tp_->size(); }
  int tp_rank() const { return tp_->rank(); }
  int dp_size() const { return dp_->size(); }
  int dp_rank() const { return dp_->rank(); }

  // Validation alone (used by programs before anything is created).
  static void check(int world_size, int tensor_parallel);

 private:
  Communicator* world_;
  std::unique_ptr<Communicator> tp_;
  std::unique_ptr<Communicator> dp_;
};

}  // namespace dtrain::dist
