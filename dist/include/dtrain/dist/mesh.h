// The data x pipeline x tensor-parallel process mesh.
//
// With tensor-parallel size T, pipeline size P and data-parallel size D = world / (T P), world
// rank r = (p D + d) T + t for pipeline stage p, data-parallel rank d and tensor-parallel rank t:
//   - a tensor-parallel group is T consecutive ranks, so under the usual block mapping of ranks
//     to nodes it stays on one node (its collectives run inside every layer, on the fastest link);
//   - a pipeline stage is the D T consecutive ranks of one block, and the stages are the
//     outermost dimension, so with D T >= the GPUs of a node consecutive stages sit on different
//     nodes: the pipeline's point-to-point traffic (one activation per micro-batch) is what
//     crosses nodes, as in Megatron-LM's tp-dp-pp order;
//   - a data-parallel group is the ranks of one stage with the same tensor-parallel position
//     (their gradient reduction happens once per step).
// With P = 1 this is the data x tensor mesh of before: tensor-parallel group k is ranks
// [k T, (k + 1) T), a data-parallel group the ranks with the same position in theirs.
#pragma once

#include <memory>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist {

class Mesh {
 public:
  // Checks T and P against the world first (>= 1, T P <= world size, T P divides it), throwing
  // dtrain::Error that names the numbers before any collective; then splits world three times
  // (collective, synchronous). world must outlive the mesh.
  Mesh(Communicator& world, int tensor_parallel, int pipeline_parallel = 1);

  Communicator& world() const { return *world_; }
  Communicator& tp() const { return *tp_; }  // this rank's tensor-parallel group
  Communicator& dp() const { return *dp_; }  // this rank's data-parallel group (inside its stage)
  Communicator& pp() const { return *pp_; }  // this rank's pipeline: one rank per stage, in order
  int tp_size() const { return tp_->size(); }
  int tp_rank() const { return tp_->rank(); }
  int dp_size() const { return dp_->size(); }
  int dp_rank() const { return dp_->rank(); }
  int pp_size() const { return pp_->size(); }
  int pp_rank() const { return pp_->rank(); }  // this rank's stage

  // Validation alone (used by programs before anything is created).
  static void check(int world_size, int tensor_parallel, int pipeline_parallel = 1);

 private:
  Communicator* world_;
  std::unique_ptr<Communicator> tp_;
  std::unique_ptr<Communicator> dp_;
  std::unique_ptr<Communicator> pp_owned_;
  Communicator* pp_;  // pp_owned_, or with one stage tp_ or dp_ when that is this rank alone
};

}  // namespace dtrain::dist

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
