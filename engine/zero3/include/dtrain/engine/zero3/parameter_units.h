// ZeRO-3's units in a training step (the forward and backward hooks libtorch's C++ modules
// lack), and the units of a model from its parameter names. The partitioned storage they
// gather and release is Zero3Optimizer's (zero3_optimizer.h).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/engine/zero3/zero3_optimizer.h"

namespace dtrain::engine {

// ZeRO-3's units in a training step (the forward and backward hooks libtorch's C++ modules
// lack): run(k, forward) gathers unit k (waiting for its prefetch), issues the gather of unit
// k + 1, runs the unit's forward, and releases unit k again. With grad mode on, the output is
// tied to a backward step that gathers unit k again (prefetching unit k - 1) before anything
// of the unit's backward runs, and a hook on each of its parameters' gradients releases the
// unit once every one of them was computed. Runs each unit's forward and backward with only
// it (and the one prefetched) materialized: the peak holds about two units' weights plus the
// activations. Single-threaded (the training thread's forward; autograd's thread for
// backward); collective over dp through the optimizer's gathers (every rank must run the same
// units in the same order). Each of its calls (and its gradient hooks) makes the units' device
// current while it runs, so gathers and releases land there from any thread.
class ParameterUnits {
 public:
  explicit ParameterUnits(Zero3Optimizer& optimizer);
  ~ParameterUnits();
  ParameterUnits(const ParameterUnits&) = delete;
  ParameterUnits& operator=(const ParameterUnits&) = delete;
  at::Tensor run(int k, const std::function<at::Tensor()>& forward);
  // run()'s parts, for a unit whose forward is recomputed in backward (activation
  // checkpointing's hooks: before_forward / after_forward around the forward, before_backward
  // before the recomputation, which the gradient hooks then follow).
  void before_forward(int k);
  void after_forward(int k);
  void before_backward(int k);
  // Gathers every unit and waits (for reading or saving the whole weights), or releases every
  // unit (and drops pending prefetches after waiting for them).
  void gather_all();
  void release_all();
  int units() const;
  // The optimizer whose units these are (its out-of-memory replay: Zero3Optimizer::replay_step).
  Zero3Optimizer& optimizer() const;

  // For the timeline: what happened to each unit since the last take_events() (recording
  // only after record_events(true)). A gather's transfer where the backend measured it (MPI:
  // its executor thread), else from issue to the end of the wait; a computation from the
  // unit's gather being ready to its release (forward: the unit's forward; backward: until
  // its last gradient).
  struct Event {
    std::string name;  // "gather", "forward", "backward"
    int unit = 0;
    std::chrono::steady_clock::time_point start, end;
  };
  void record_events(bool on);
  std::vector<Event> take_events();

  struct State;  // shared with the backward steps

 private:
  std::shared_ptr<State> state_;
};

// ZeRO-3's units from parameter-name prefixes (TrainerOptions::shard_unit_starts, the examples'
// --shard_units): names are the trainer's parameters in order; the first parameter under each
// prefix begins a unit (the index returned). tensor_parallel[j] (optional) says parameter j is a
// tensor-parallel shard, for the message. Throws dtrain::Error naming the prefix and the fix for:
// no prefix, a prefix under which no parameter lies, a first parameter that begins no unit, and
// a unit that would begin inside a layer (between two parameters of one module, e.g. a
// tensor-parallel linear's weight and bias): a unit's forward must find all of its layers'
// weights gathered.
std::vector<size_t> unit_starts_of(const std::vector<std::string>& names, const std::vector<std::string>& prefixes,
                                   const std::vector<bool>& tensor_parallel = {});

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
