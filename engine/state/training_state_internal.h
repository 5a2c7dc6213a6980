// Private to training_state.cc and training_state_restore.cc: what saving and restoring share.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/engine/state/training_state.h"

namespace dtrain::engine::training_state_detail {

// "<param index>.<state name>" -> the parameter index (-1 without one).
int64_t param_index_of(const std::string& state_name);
// "<param index>.<state name>" with the index moved by delta (pipeline stages number their
// parameters from 0; the whole model's numbering runs on across the stages).
std::string shift_param_index(const std::string& state_name, int64_t delta);
// The model's state outside the flat space of `trained` (ZeRO-3 keeps those weights in the
// ranks' partitioned state): its buffers and frozen weights, aliasing the module's.
NamedTensors state_outside(torch::nn::Module& model, const std::vector<std::string>& trained);
// The elements of the trained parameters end to end (this rank's flat space).
int64_t flat_numel(const std::vector<at::Tensor>& params);
// Where this rank's flat space of `numel` elements lies in the whole model's (pipeline
// stages); throws dtrain::Error when numel is not the stage's recorded size.
StageSpace stage_space(const TrainingState& state, int64_t numel);

}  // namespace dtrain::engine::training_state_detail
