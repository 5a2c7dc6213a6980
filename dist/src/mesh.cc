#include "dtrain/dist/mesh.h"

#include "dtrain/dist/error.h"

namespace dtrain::dist {

void Mesh::check(int world_size, int tp, int pp) {
  DTRAIN_CHECK(tp >= 1, "--tp=", tp, " must be at least 1");
  DTRAIN_CHECK(pp >= 1, "--pp=", pp, " must be at least 1");
  DTRAIN_CHECK(tp <= world_size, "--tp=", tp, " is larger than the world (", world_size,
               " ranks); start at least ", tp, " processes or lower --tp");
  DTRAIN_CHECK(pp <= world_size, "--pp=", pp, " is larger than the world (", world_size,
               " ranks); start at least ", pp, " processes (one per pipeline stage) or lower --pp");
  if (pp == 1) {
    DTRAIN_CHECK(world_size % tp == 0, "--tp=", tp, " does not divide the world size ", world_size,
                 "; use a world size that is a multiple of ", tp);
  } else {
    DTRAIN_CHECK(world_size % (tp * pp) == 0, "--tp=", tp, " x --pp=", pp, " = ", tp * pp,
                 " does not divide the world size ", world_size, "; use a world size that is a multiple of ",
                 tp * pp, " (the rest of the world is data-parallel)");
  }
}

Mesh::Mesh(Communicator& world, int tensor_parallel, int pipeline_parallel) : world_(&world) {
  check(world.size(), tensor_parallel, pipeline_parallel);
  const int T = tensor_parallel;
  const int per_stage = world.size() / pipeline_parallel;  // D T ranks
  const int rank = world.rank();
  const int stage = rank / per_stage;
  const int in_stage = rank % per_stage;  // d T + t
  const int t = rank % T;
  const int d = in_stage / T;
  const std::string suffix = pipeline_parallel > 1 ? "." + std::to_string(stage) : "";
  tp_ = world.split(rank / T, t, "tp" + std::to_string(rank / T));
  dp_ = world.split(stage * T + t, d, "dp" + std::to_string(t) + suffix);
  // Without a pipeline the group is this rank alone: one of the groups above when it is that
  // already (no extra communicator, which on NCCL would cost a communicator's memory).
  if (pipeline_parallel == 1 && tp_->size() == 1) {
    pp_ = tp_.get();
  } else if (pipeline_parallel == 1 && dp_->size() == 1) {
    pp_ = dp_.get();
  } else {
    pp_owned_ = world.split(in_stage, stage, "pp" + std::to_string(in_stage));
    pp_ = pp_owned_.get();
  }
}

}  // namespace dtrain::dist
