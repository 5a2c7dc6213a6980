#include "dtrain/dist/mesh.h"

#include "dtrain/dist/error.h"

namespace dtrain::dist {

void Mesh::check(int world_size, int tp) {
  DTRAIN_CHECK(tp >= 1, "--tp=", tp, " must be at least 1");
  DTRAIN_CHECK(tp <= world_size, "--tp=", tp, " is larger than the world (", world_size,
               " ranks); start at least ", tp, " processes or lower --tp");
  DTRAIN_CHECK(world_size % tp == 0, "--tp=", tp, " does not divide the world size ", world_size,
               "; use a world size that is a multiple of ", tp);
}

Mesh::Mesh(Communicator& world, int tensor_parallel) : world_(&world) {
  check(world.size(), tensor_parallel);
  const int group = world.rank() / tensor_parallel;
  const int position = world.rank() % tensor_parallel;
  tp_ = world.split(group, position, "tp" + std::to_string(group));
  dp_ = world.split(position, group, "dp" + std::to_string(position));
}

}  // namespace dtrain::dist
