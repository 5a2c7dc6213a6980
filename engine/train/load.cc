#include "dtrain/engine/train/load.h"

#include "dtrain/dist/error.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::engine {

int64_t load_weights(const std::string& save_dir, torch::nn::Module& model, dist::Mesh& mesh, c10::Device device) {
  DTRAIN_CHECK(!save_dir.empty(), "load_weights: the checkpoint directory is empty; pass the run's --save_dir");
  TrainerOptions o;
  o.evaluation_only = true;  // weights only: no optimizer state, no lock on the directory
  o.save_dir = save_dir;
  o.resume = ResumeMode::kYes;
  o.handle_preemption = false;
  o.progress = false;
  // The restore path every layout's resume takes; the loss is never called.
  LossFn no_loss = [](const Batch&) -> at::Tensor { throw Error("load_weights: the model is not trained here"); };
  Trainer loader(model, no_loss, mesh, device, o);
  // The resume's own search verifies the files once (a damaged checkpoint is logged and skipped).
  DTRAIN_CHECK(loader.resume_checkpoint(nullptr, /*required=*/false), "load_weights: '", save_dir,
               "' holds no good checkpoint; point it at a training run's --save_dir");
  return loader.current_step();
}

}  // namespace dtrain::engine
