// The process mesh: the world's ranks laid out along named axes, each axis a group of ranks
// (a communicator) that differ only in their position along it.
//
// Axes are given from the outermost to the innermost; a rank's coordinates are its world rank
// written in that mixed radix, so the innermost axis holds consecutive ranks. The standard mesh
// is {pp, dp, tp}: with tensor-parallel size T, pipeline size P and data-parallel size
// D = world / (T P), world rank r = (p D + d) T + t for pipeline stage p, data-parallel rank d
// and tensor-parallel rank t:
//   - a tensor-parallel group is T consecutive ranks, so under the usual block mapping of ranks
//     to nodes it stays on one node (its collectives run inside every layer, on the fastest link);
//   - a pipeline stage is the D T consecutive ranks of one block, and the stages are the
//     outermost dimension, so with D T >= the GPUs of a node consecutive stages sit on different
//     nodes: the pipeline's point-to-point traffic (one activation per micro-batch) is what
//     crosses nodes, as in Megatron-LM's tp-dp-pp order;
//   - a data-parallel group is the ranks of one stage with the same tensor-parallel position
//     (their gradient reduction happens once per step).
// A new kind of parallelism is a new axis name, not a new constructor. Context parallelism is
// the axis "cp" between dp and tp: Mesh(world, {{"pp", P}, {"dp", -1}, {"cp", C}, {"tp", T}}),
// which the standard constructor builds for C > 1. A context-parallel group is the C ranks that
// hold the same weights and the same samples, each a part of every sequence; its ranks sit
// beside the tensor-parallel group (ring attention's key/value blocks move every layer).
//
// Replicas. The ranks that hold the same weights (the same stage and tensor-parallel position)
// are dp x cp: replicas() is their group, over which gradients are averaged and optimizer state
// and ZeRO shards are split; dp() alone is the data axis (which samples a rank reads). Without
// a cp axis of more than one rank, replicas() is dp().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist {

struct MeshAxis {
  std::string name;  // also the flag named in messages ("--tp=3 does not divide ...")
  int size = 1;      // -1: the ranks the other axes leave (one axis at most)
};

class Mesh {
 public:
  // Checks the axes against the world first (names unique and non-empty, sizes >= 1 or one -1,
  // their product dividing the world), throwing dtrain::Error that names the numbers before any
  // collective; then splits world once per axis of more than one rank, innermost first
  // (collective, synchronous). An axis of one rank shares one communicator of this rank alone
  // with every other such axis. world must outlive the mesh.
  Mesh(Communicator& world, std::vector<MeshAxis> axes);
  // The standard mesh {{"pp", pipeline_parallel}, {"dp", -1}, {"tp", tensor_parallel}}, with
  // {"cp", context_parallel} between dp and tp when context_parallel > 1.
  Mesh(Communicator& world, int tensor_parallel, int pipeline_parallel = 1, int context_parallel = 1);

  Communicator& world() const { return *world_; }
  // The group of `axis` (the ranks that differ from this one only along it); dtrain::Error for
  // a name that is not an axis of this mesh.
  Communicator& group(const std::string& axis) const;
  int size(const std::string& axis) const { return group(axis).size(); }
  int rank(const std::string& axis) const { return group(axis).rank(); }
  bool has(const std::string& axis) const;
  // The axes, outermost first, with the -1 resolved.
  const std::vector<MeshAxis>& axes() const { return axes_; }

  // The standard axes' groups; a mesh without one of them has a group of this rank alone there.
  Communicator& tp() const { return *tp_; }  // this rank's tensor-parallel group
  Communicator& dp() const { return *dp_; }  // this rank's data-parallel group (inside its stage)
  Communicator& pp() const { return *pp_; }  // this rank's pipeline: one rank per stage, in order
  Communicator& cp() const { return *cp_; }  // this rank's context-parallel group (cp_rank: its part)
  // The ranks holding this rank's weights: dp x cp, ordered by (dp rank, cp rank); dp() when the
  // mesh has no cp axis of more than one rank.
  Communicator& replicas() const { return *replicas_; }
  int tp_size() const { return tp_->size(); }
  int tp_rank() const { return tp_->rank(); }
  int dp_size() const { return dp_->size(); }
  int dp_rank() const { return dp_->rank(); }
  int pp_size() const { return pp_->size(); }
  int pp_rank() const { return pp_->rank(); }  // this rank's stage
  int cp_size() const { return cp_->size(); }
  int cp_rank() const { return cp_->rank(); }

  // Validation alone (used by programs before anything is created): the axes resolved for a
  // world of world_size ranks.
  static std::vector<MeshAxis> check(int world_size, std::vector<MeshAxis> axes);
  static void check(int world_size, int tensor_parallel, int pipeline_parallel = 1, int context_parallel = 1);

 private:
  Communicator* world_;
  std::vector<MeshAxis> axes_;
  std::vector<std::unique_ptr<Communicator>> owned_;
  std::vector<Communicator*> groups_;  // per axis (into owned_, or the shared group of one)
  Communicator* tp_ = nullptr;
  Communicator* dp_ = nullptr;
  Communicator* pp_ = nullptr;
  Communicator* cp_ = nullptr;
  Communicator* replicas_ = nullptr;
};

}  // namespace dtrain::dist

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
