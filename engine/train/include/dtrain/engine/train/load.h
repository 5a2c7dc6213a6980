// A trained run's weights in a model, without training it: for evaluation, generation, a
// distillation teacher or an export. Whatever layout saved the checkpoint (any --tp, --pp,
// data-parallel size, --shard including ZeRO-3's partitioned weights, --offload) loads into a
// model built for this process's mesh: a whole model at one rank, or this rank's
// tensor-parallel shards.
//
//   Net model(...);                                   // the shape the run trained
//   int64_t step = dtrain::engine::load_weights("runs/a", *model, mesh, device);
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "dtrain/dist/mesh.h"

namespace dtrain::engine {

// Loads the newest good checkpoint in save_dir into `model` (its trainable weights and buffers;
// no optimizer state is read or allocated, the directory is not locked) and returns its step.
// Collective over the mesh's world. Throws dtrain::Error naming the directory when it holds no
// good checkpoint, and naming the first weight that does not fit (another model or shape).
// Goes through resume_training_state() (state/training_state.h) with a weights-only
// TrainingState; `device` is the model's (the tensors are copied where the model's are).
// `shape_meta`: the "shape.<flag>" entries a training run of this model records (TrainerOptions::
// checkpoint_meta); a checkpoint that recorded another value for one of them is refused, naming
// the flags (e.g. a rope_theta or tie_embeddings the tensors cannot show).
int64_t load_weights(const std::string& save_dir, torch::nn::Module& model, dist::Mesh& mesh, c10::Device device,
                     const std::map<std::string, std::string>& shape_meta = {});

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
