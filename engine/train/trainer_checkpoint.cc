// Trainer checkpoints: the trainer's view of its state, saved and restored by the library
// (state/training_state.h), synchronously or in the background.
#include <ATen/ATen.h>
#include <glog/logging.h>

#include <sstream>

#include "dtrain/dist/error.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::engine {

TrainingState Trainer::training_state() {
  TrainingState state(model_, mesh_, params_, names_, specs_);
  state.optimizer = optimizer_.get();
  state.scaler = scaler_.get();
  state.pruner = pruner_.get();
  state.units = units_.get();
  state.eval_loader = eval_;
  state.step = step_;
  state.accum_steps = accum_steps_;
  state.pp_param_offset = pp_param_offset_;
  state.pp_param_index = pp_param_index_;
  state.pp_flat_numels = pp_flat_numels_;
  state.offloaded_optimizer = options_.offload_optimizer;
  state.meta = options_.checkpoint_meta;
  // What the run trains with besides the model ("train." meta): a resume that changes it is said
  // (restore_training_state), since the rate then follows the new curve from the saved step.
  const ScheduleOptions& sc = options_.schedule;
  std::ostringstream schedule, optimizer;
  schedule << sc.name;
  if (sc.warmup_steps > 0) schedule << ", warm-up " << sc.warmup_steps << " steps";
  if (sc.name != "constant") schedule << ", decaying over " << sc.total_steps << " steps to " << sc.min_lr_ratio << " x lr";
  optimizer << options_.optimizer.name << ", lr " << options_.optimizer.lr << ", weight decay "
            << options_.optimizer.weight_decay;
  state.meta["train.schedule"] = schedule.str();
  state.meta["train.optimizer"] = optimizer.str();
  return state;
}

CheckpointStore Trainer::checkpoint_store() const {
  CheckpointStoreOptions so;
  so.keep_last = options_.keep_last;
  so.fs = options_.checkpoint_fs;
  return CheckpointStore(options_.save_dir, so);
}

PreparedCheckpoint Trainer::prepare_save(const DataLoader* loader, bool own_copies) {
  DTRAIN_CHECK(!options_.evaluation_only, "this trainer was built for evaluation only (--eval_only): it saves "
               "no checkpoints");
  settle_nonfinite();  // the deferred watch's policy before a checkpoint of these steps
  flush_updates();     // a delayed update in flight goes into the saved weights
  return prepare_training_state(training_state(), loader, own_copies ? &staging_ : nullptr);
}

std::string Trainer::save_checkpoint(const DataLoader* loader) {
  wait_for_save();
  PreparedCheckpoint save = prepare_save(loader, /*own_copies=*/false);
  CheckpointStore store = checkpoint_store();
  std::string path = write_training_state(save, store, mesh_.world());
  last_saved_step_ = step_;
  return path;
}

void Trainer::save_checkpoint_async(const DataLoader* loader) {
  wait_for_save();
  // Collective on every rank at the same step (the first periodic save), so the split agrees.
  // The save agrees over host tensors only: no NCCL communicator of its own.
  if (!save_comm_) save_comm_ = mesh_.world().split_host(0, mesh_.world().rank(), "checkpoint");
  auto save = std::make_shared<PreparedCheckpoint>(prepare_save(loader, /*own_copies=*/true));
  last_saved_step_ = step_;
  // The writer thread works on this rank's device (a new thread's current CUDA device is GPU
  // 0, where its first CUDA call would make a context on every rank of the node).
  save_in_flight_ = async_on_device(device_, [this, save] {
    staging_.wait();  // the device copies of prepare_save have landed
    CheckpointStore store = checkpoint_store();
    return write_training_state(*save, store, *save_comm_);
  });
}

void Trainer::wait_for_save() {
  if (!save_in_flight_.valid()) return;
  save_in_flight_.get();  // rethrows the background save's failure (every rank's save fails alike)
}

bool Trainer::resume_checkpoint(DataLoader* loader, bool required) {
  CheckpointStoreOptions so;
  so.fs = options_.checkpoint_fs;
  CheckpointStore store(options_.save_dir, so);
  TrainingState state = training_state();
  // Collective: the newest good checkpoint, restored on every rank (or every rank throws).
  std::optional<CheckpointInfo> info = resume_training_state(state, store, loader);
  if (!info && !required) {
    if (mesh_.world().rank() == 0 && !options_.evaluation_only) {
      LOG(INFO) << "--resume=auto: no checkpoint in " << options_.save_dir << " yet; starting at step 1";
    }
    return false;
  }
  DTRAIN_CHECK(info.has_value(), "--resume: no good checkpoint in '", options_.save_dir,
               "'; train without --resume first, use --resume=auto to start fresh when there is "
               "none (or point --save_dir at the run's directory)");
  step_ = state.step;
  if (!options_.evaluation_only && mesh_.world().rank() == 0) {
    // The checkpoints after the one restored are the bad ones latest_good skipped (it logged
    // why): set aside, so that keep_last does not keep them and delete good older ones.
    try {
      const int aside = store.set_aside_newer_than(info->step);
      if (aside > 0) {
        LOG(WARNING) << "set aside " << aside << " bad checkpoint(s) after step " << info->step << " in "
                     << options_.save_dir << " as *.bad (kept for inspection; --keep_last no longer counts them)";
      }
    } catch (const std::exception& e) {
      LOG(WARNING) << "could not set aside the bad checkpoints after step " << info->step << ": " << e.what();
    }
  }
  if (optimizer_) {  // an evaluation-only trainer takes the weights and the step
    // The checkpoint's micro-batching wins (OOM back-off may have raised it); said when the
    // options ask for another, so that a changed --accum_steps is not taken silently.
    if (state.accum_steps != options_.accum_steps && mesh_.world().rank() == 0) {
      LOG(WARNING) << "resuming with the checkpoint's " << state.accum_steps << " micro-batches per step (its "
                   << "--accum_steps, or what OOM back-off raised it to), not the " << options_.accum_steps
                   << " asked for: the same global batch; start a new --save_dir to change it";
    }
    accum_steps_ = state.accum_steps;
    last_saved_step_ = state.step;
  }
  return true;
}

}  // namespace dtrain::engine
