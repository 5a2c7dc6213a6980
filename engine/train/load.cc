#include "dtrain/engine/train/load.h"

#include "dtrain/dist/error.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/state/training_state.h"

namespace dtrain::engine {

int64_t load_weights(const std::string& save_dir, torch::nn::Module& model, dist::Mesh& mesh, c10::Device device,
                     const std::map<std::string, std::string>& shape_meta) {
  DTRAIN_CHECK(!save_dir.empty(), "load_weights: the checkpoint directory is empty; pass the run's --save_dir");
  (void)device;  // the model is on its device already; the checkpoint's tensors are copied there
  const TrainedParameters trained = trained_parameters(model);
  DTRAIN_CHECK(!trained.params.empty(), "the model has no trainable parameters");
  const std::map<std::string, ShardSpec> splits = collect_shard_specs(model);
  // Weights only: no optimizer (none of its state is read), no lock on the directory. The
  // restore every layout's resume takes.
  TrainingState state(model, mesh, trained.params, trained.names, splits);
  state.meta = shape_meta;  // checked against the checkpoint's record
  CheckpointStore store(save_dir);
  // The search verifies the files once (a damaged checkpoint is logged and skipped).
  DTRAIN_CHECK(resume_training_state(state, store, nullptr).has_value(), "load_weights: '", save_dir,
               "' holds no good checkpoint; point it at a training run's --save_dir");
  return state.step;
}

}  // namespace dtrain::engine
