// dtrain-plan's --simulate and --calibrate (plan_simulate.cc).
#pragma once

#include <string>
#include <vector>

#include "model_factory.h"

namespace dtrain::examples {

// Whether --simulate is on the command line (read before the flags are parsed: the simulator
// needs no device, no ranks and no model).
bool simulate_requested(int argc, char** argv);
// The flags plan_simulate.cc defines (for dtrain-plan's --help).
std::vector<std::string> simulate_flag_names();
// dtrain-plan --simulate: parses the flags itself; returns the exit status (1 when the layout
// does not fit, or no layout does).
int simulate_main(int argc, char** argv, const std::string& model_name);
// dtrain-plan --calibrate=path: measures this machine and the model (built, on run.device) and
// writes the cluster file (rank 0). Collective over the run's ranks.
void calibrate(const Run& run, ExampleModel& model, const engine::TrainerOptions& options, const std::string& path);
// dtrain-plan --measure=path: engine::measure_model of the model's spec at the flags' micro-batch
// (and a quarter of it), written as JSON by rank 0 for --simulate --measured.
void measure(const Run& run, ExampleModel& model, const std::string& path);

}  // namespace dtrain::examples
