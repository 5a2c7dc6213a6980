// A user's own model for the step-time simulator: its ModelSpec measured on the device at hand
// (the pieces' parameters, the forward and backward time of what runs before the blocks, of one
// block and of what runs after them, and the activation bytes each keeps), as a
// sim::MeasuredModel that simulate() and search() price over dp x pp layouts, ZeRO, offload,
// checkpointing and accumulation (engine/memory/simulator.h).
//
//   engine::ModelSpec spec = my_model_spec();            // on the device, in train mode
//   engine::MeasureOptions o;
//   o.tokens_per_row = 1024;                              // for tokens/s
//   sim::MeasuredModel m = engine::measure_model(spec, device, my_synthetic_batch, o);
//   sim::Cluster c; c.device.name = "this GPU"; c.nodes = 4; c.gpus_per_node = 8; ...
//   for (const sim::Prediction& p : sim::search(m, c, {.global_batch_rows = 512})) ...
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <vector>

#include "dtrain/engine/data/data.h"
#include "dtrain/engine/memory/simulator.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/optim/amp.h"

namespace dtrain::engine {

struct MeasureOptions {
  // The two micro-batch sizes (rows) each time is measured at: a line through them.
  int64_t rows_small = 2, rows_large = 4;
  int repeats = 5;              // timed runs of each piece (the median), after one warm-up
  AmpMode amp = AmpMode::kOff;  // the pieces run under this autocast
  double tokens_per_row = 1;    // MeasuredModel::tokens_per_row
  double flops_per_row = 0;     // MeasuredModel::flops_per_row (0: no MFU)
};

// Measures `spec` (validate()d; its module on `device`, in train mode, no techniques applied:
// call it before building the Trainer) on batches of `batch_of(rows)` rows: the pre forward and
// backward (backward seeded with ones on its output), block 0's forward and backward on that
// output (detached, requiring its gradient), the post forward (the loss) and backward, each
// timed with the device synchronized, then scaled together so that they add up to the whole
// forward and backward timed in one pass (each piece timed alone pays its own synchronization
// and autograd start); the bytes block 0 and post keep between forward and backward
// (memory_stats: on the CPU with tracking on, the default). The blocks are taken to be alike.
// The spec's blocks run as given: build it without checkpointing (the simulator adds the
// recomputation itself). Side effects: the parameters' gradients are left undefined; the default generators
// advance (the batches). dtrain::Error for an invalid spec, rows_small < 1, rows_large <=
// rows_small, repeats < 1, or a post that does not return a scalar.
sim::MeasuredModel measure_model(const ModelSpec& spec, c10::Device device,
                                 const std::function<Batch(int64_t rows)>& batch_of, const MeasureOptions& options = {});

// The timing rules of these measurements, shared with dtrain-plan --calibrate: waits for the
// device's work (nothing on the CPU); the median of samples (the upper middle one for an even
// count; at least one sample); the median seconds of `reps` calls of fn after one untimed call,
// each timed between two synchronizations.
void synchronize_device(c10::Device device);
double median_of(std::vector<double> samples);
double median_seconds(c10::Device device, int reps, const std::function<void()>& fn);

}  // namespace dtrain::engine
