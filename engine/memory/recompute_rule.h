// Internal to engine/memory: which blocks a backward pass recomputes, the rule the planner
// (planner.cc, a share of a model's blocks) and the simulator (simulator.cc, blocks of a stage)
// both price. Not installed.
#pragma once

#include <algorithm>

namespace dtrain::engine::recompute {

// Of `layers` blocks: every streamed block with layer offload (engine::checkpoint fetches its
// weights again), else checkpointing's, all (checkpoint_blocks < 0) or the first checkpoint_blocks.
inline double recomputed_blocks(double layers, bool checkpoint, int checkpoint_blocks, bool offload_layers) {
  if (offload_layers || (checkpoint && checkpoint_blocks < 0)) return layers;
  return checkpoint ? std::min<double>(layers, checkpoint_blocks) : 0.0;
}

}  // namespace dtrain::engine::recompute
