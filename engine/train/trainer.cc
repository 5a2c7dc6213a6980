#include "dtrain/engine/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/optim/sparse_optim.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/preemption.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "trainer_setup.h"

namespace dtrain::engine {

void validate(const TrainerOptions& o) {
  DTRAIN_CHECK(o.steps >= 0, "steps must be >= 0, got ", o.steps);
  DTRAIN_CHECK(o.accum_steps >= 1, "--accum_steps must be >= 1, got ", o.accum_steps);
  DTRAIN_CHECK(o.log_every >= 1, "--log_every must be >= 1, got ", o.log_every);
  DTRAIN_CHECK(o.eval_every >= 0, "--eval_every must be >= 0 (0 = never), got ", o.eval_every);
  DTRAIN_CHECK(o.resume == ResumeMode::kNo || !o.save_dir.empty(), "--resume=", to_string(o.resume),
               " needs the checkpoint directory to resume from: pass --save_dir=DIR");
  DTRAIN_CHECK(o.eval_samples >= 0, "eval_samples must be >= 0 (0: the whole held-out split), got ", o.eval_samples);
  DTRAIN_CHECK(std::isfinite(o.clip_grad_norm) && o.clip_grad_norm >= 0,
               "clip_grad_norm must be a finite number >= 0 (0 = off), got ", o.clip_grad_norm);
  DTRAIN_CHECK(o.tokens_per_sample >= 0, "tokens_per_sample must be >= 0");
  DTRAIN_CHECK(o.max_nonfinite_skips >= 1, "max_nonfinite_skips must be >= 1, got ", o.max_nonfinite_skips);
  validate(o.optimizer);
  validate(o.schedule);
}

namespace {



// The gradients to check or count: each parameter's (a sparse one's values), and under ZeRO-3
// the reducer's buffer of this rank's range (the parameters' .grad are undefined then).
std::vector<at::Tensor> gradient_tensors(const std::vector<at::Tensor>& params, const GradReducer* reducer) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size() + 1);
  for (const at::Tensor& p : params) grads.push_back(gradient_values(p.grad()));
  if (reducer && reducer->owned_gradients().defined()) grads.push_back(reducer->owned_gradients());
  return grads;
}


}  // namespace

NonFinitePolicy parse_on_nonfinite(const std::string& text) {
  if (text == "stop") return NonFinitePolicy::kStop;
  if (text == "skip") return NonFinitePolicy::kSkip;
  throw Error("--on_nonfinite=" + text + " is not one of: stop, skip");
}

ResumeMode parse_resume(const std::string& text) {
  if (text == "no" || text == "false" || text == "0") return ResumeMode::kNo;
  if (text == "yes" || text == "true" || text == "1") return ResumeMode::kYes;
  if (text == "auto") return ResumeMode::kAuto;
  throw Error("--resume=" + text + " is not one of: no, yes, auto (resume if a checkpoint exists, else start)");
}

const char* to_string(ResumeMode mode) {
  switch (mode) {
    case ResumeMode::kNo: return "no";
    case ResumeMode::kYes: return "yes";
    case ResumeMode::kAuto: return "auto";
  }
  return "?";
}

SaveDirExists parse_save_dir_exists(const std::string& text) {
  if (text == "error") return SaveDirExists::kError;
  if (text == "overwrite") return SaveDirExists::kOverwrite;
  if (text == "resume") return SaveDirExists::kResume;
  throw Error("--save_dir_exists=" + text + " is not one of: error, overwrite (remove the earlier checkpoints), "
              "resume (continue from them)");
}

const char* to_string(SaveDirExists mode) {
  switch (mode) {
    case SaveDirExists::kError: return "error";
    case SaveDirExists::kOverwrite: return "overwrite";
    case SaveDirExists::kResume: return "resume";
  }
  return "?";
}

std::vector<Batch> split_batch(const Batch& batch, int n) {
  const int64_t rows = batch.size();
  DTRAIN_CHECK(n >= 1 && rows % n == 0, "a batch of ", rows, " rows does not split into ", n,
               " micro-batches; make --batch_size a multiple of --accum_steps");
  std::vector<Batch> out(n);
  const int64_t m = rows / n;
  for (int i = 0; i < n; ++i) {
    out[i].epoch = batch.epoch;
    out[i].index = batch.index;
    for (const at::Tensor& f : batch.fields) out[i].fields.push_back(f.narrow(0, i * m, m));
  }
  return out;
}

Trainer::Applied Trainer::apply_to_spec(ModelSpec spec, dist::Mesh& mesh, c10::Device device,
                                        TrainerOptions options) {
  validate(spec);
  ModelTechniques t;
  t.checkpoint_activations = options.checkpoint_activations;
  t.offload_layers = options.offload_layers;
  t.device = device;
  split_pipeline_stage(spec, mesh.pp_rank(), mesh.pp_size(), options.pp_blocks, t);
  if (options.shard == "parameters" && options.shard_unit_starts.empty()) {
    options.shard_unit_starts = default_unit_prefixes(spec);
  }
  Applied a;
  a.model = std::make_shared<AppliedModel>(spec, t);
  a.model->start_streaming();  // before the trainer takes the parameters: the blocks' live on the host
  std::shared_ptr<AppliedModel> model = a.model;
  a.loss = [model](const Batch& b) { return model->loss(b); };
  if (mesh.pp_size() > 1) {
    options.pipeline.forward = [model](const at::Tensor& x, const Batch& micro) { return model->stage_forward(x, micro); };
    options.pipeline.activation_shape = spec.activation_shape;
    options.pipeline.activation_dtype = spec.activation_dtype;
  }
  a.options = std::move(options);
  return a;
}

Trainer::Trainer(ModelSpec spec, dist::Mesh& mesh, c10::Device device, TrainerOptions options)
    : Trainer(apply_to_spec(std::move(spec), mesh, device, std::move(options)), mesh, device) {}

Trainer::Trainer(Applied applied, dist::Mesh& mesh, c10::Device device)
    : Trainer(*applied.model->spec().module, applied.loss, mesh, device, applied.options) {
  applied_ = std::move(applied.model);
  // ZeRO-3: the units the trainer cut run around the model's pieces.
  if (units_) applied_->use_units(units_.get(), options_.shard_unit_starts, names_);
}

Trainer::Trainer(torch::nn::Module& model, LossFn loss, dist::Mesh& mesh, c10::Device device,
                 TrainerOptions options)
    : model_(model), loss_(std::move(loss)), mesh_(mesh), device_(device),
      options_(std::move(options)), accum_steps_(options_.accum_steps) {
  validate(options_);
  // Before the first collective that depends on them (the parameter broadcast, the reducer).
  agree_on_settings(mesh_.world(), trainer_setup::settings_of(options_), "TrainerOptions");
  // Whoever promises preemption handling installs it: without the handlers SIGUSR1/SIGTERM
  // would kill the ranks before any checkpoint.
  if (options_.handle_preemption) install_preemption_handlers();
  if (!options_.save_dir.empty() && !options_.evaluation_only) take_save_dir();
  if (mesh_.pp_size() > 1) trainer_setup::check_pipeline_options(options_, mesh_);
  TrainedParameters trained = trained_parameters(model_);
  DTRAIN_CHECK(!trained.params.empty(), "the model has no trainable parameters");
  if (!trained.tied.empty()) check_tied_parameters(trained.tied);
  params_ = trained.params;
  names_ = trained.names;
  if (mesh_.pp_size() > 1) {  // the whole model numbers its parameters stage after stage
    const std::vector<int64_t> counts = dist::all_gather_counts(mesh_.pp(), static_cast<int64_t>(params_.size()), device_);
    for (int s = 0; s < mesh_.pp_rank(); ++s) pp_param_offset_ += counts[s];
  }
  specs_ = collect_shard_specs(model_);
  for (const std::string& name : names_) sharded_.push_back(specs_.count(name) > 0);
  norm_layout_.sharded = sharded_;
  norm_layout_.tp = &mesh_.tp();
  norm_layout_.pp = &mesh_.pp();  // each stage's squares summed over the stages (a no-op for one)
  // Rank 0's parameters everywhere first: a partitioned optimizer copies them into its
  // master weights when it is built, before the reducer exists.
  ReducerOptions reducer_options = options_.reducer;
  if (reducer_options.names.empty()) reducer_options.names = names_;
  if (reducer_options.broadcast_parameters) {
    check_same_parameters(params_, mesh_.dp(), reducer_options.names);
    at::NoGradGuard no_grad;
    broadcast_tensors(mesh_.dp(), params_, 0);
    reducer_options.broadcast_parameters = false;
  }
  if (!options_.evaluation_only) {
    trainer_setup::UpdateParts parts =
        trainer_setup::build_update({model_, trained, specs_, mesh_, device_, options_}, std::move(reducer_options));
    sparse_reducer_ = std::move(parts.sparse_reducer);
    optimizer_ = std::move(parts.optimizer);
    units_ = std::move(parts.units);
    reducer_ = std::move(parts.reducer);
    pruner_ = std::move(parts.pruner);
    if (parts.owned) {
      norm_layout_.owned = *parts.owned;
      norm_layout_.dp = &mesh_.dp();
    }
    norm_layout_.owned_values = reducer_->owned_gradients();
  }
  if (mesh_.pp_size() > 1 && optimizer_) {
    pp_flat_numels_ = trainer_setup::stage_flat_numels(mesh_, *optimizer_, params_, device_);
  }
  LossScalerOptions scaler_options = options_.loss_scaler;
  scaler_options.enabled = options_.amp == AmpMode::kFp16;
  scaler_ = std::make_unique<LossScaler>(scaler_options, device_);
  DTRAIN_CHECK(options_.resume == ResumeMode::kNo || !options_.save_dir.empty(),
               "--resume needs --save_dir (where the checkpoints are)");
  DTRAIN_CHECK(options_.save_every >= 0, "--save_every must be >= 0");
  trainer_setup::Observers observers = trainer_setup::make_observers(options_, mesh_, device_);
  metrics_ = std::move(observers.metrics);
  tensorboard_ = std::move(observers.tensorboard);
  timeline_ = std::move(observers.timeline);
  profiler_ = std::move(observers.profiler);
  if (units_) units_->record_events(!options_.timeline_path.empty());  // ZeRO-3's gathers and units on the timeline
}

void Trainer::take_save_dir() {
  // One run per checkpoint directory, for this trainer's lifetime (rank 0 holds the lock).
  std::string refused;
  if (mesh_.world().rank() == 0) {
    try {
      save_dir_lock_ = std::make_unique<DirectoryLock>(options_.save_dir);
    } catch (const Error& e) {
      refused = e.what();
    }
  }
  if (!failing_ranks(!refused.empty()).empty()) {
    throw Error(refused.empty() ? "the checkpoint directory '" + options_.save_dir +
                                      "' is in use by another run (rank 0 says which)"
                                : refused);
  }
  if (options_.resume == ResumeMode::kNo) start_fresh_in_save_dir();
}

Trainer::~Trainer() {
  // A background save still in flight (fit() left by an exception) finishes first.
  if (!save_in_flight_.valid()) return;
  try {
    save_in_flight_.get();
  } catch (const std::exception& e) {
    LOG(ERROR) << "the background checkpoint save failed: " << e.what();
  }
}

bool Trainer::run_micro_batches(const Batch& batch, at::Tensor& loss_sum) {
  const int n = accum_steps_;
  bool synced_backward_done = false;
  const std::vector<Batch> micro = split_batch(batch, n);
  // ZeRO-3: where this step's collectives begin on each communicator, for a replay after an
  // out-of-memory error (finish_step_on_one_row).
  const std::vector<std::pair<dist::Communicator*, uint64_t>> issued = units_ ? issued_so_far() : decltype(issued)();
  try {
    loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
    if (mesh_.pp_size() > 1) {
      run_pipeline(micro, loss_sum);
      return false;
    }
    forward_backward(micro, loss_sum, synced_backward_done);
    return false;
  } catch (const c10::OutOfMemoryError& e) {
    // (A pipeline stage gets here after finishing its step's exchanges: run_pipeline.)
    if (!options_.oom_backoff || mesh_.tp_size() > 1) throw;
    LOG(WARNING) << "out of memory in step " << step_ + 1 << " with micro-batch of "
                 << batch.size() / n << " rows: " << std::string(e.what_without_backtrace()).substr(0, 200);
    loss_sum.reset();
    // The report's step peak is the failed attempt's (set after a step otherwise: 0 in step 1).
    step_peak_mb_ = memory_stats(device_).peak_mb;
    if (device_.is_cuda()) LOG(WARNING) << "memory at the failure:\n" << memory_report().to_string();
    if (units_) {
      if (!synced_backward_done) finish_step_on_one_row(micro, issued);
      units_->release_all();
    } else if (!synced_backward_done) {
      reducer_->abandon_step();
      if (sparse_reducer_) sparse_reducer_->abandon();
    }
    release_cached_memory(device_);
    return true;
  }
}

void Trainer::forward_backward(const std::vector<Batch>& micro, at::Tensor& loss_sum, bool& synced_backward_done) {
  const int n = static_cast<int>(micro.size());
  for (int i = 0; i < n; ++i) {
    std::optional<GradReducer::NoSync> no_sync;
    if (i + 1 < n) no_sync.emplace(reducer_.get());
    at::Tensor loss;
    {
      Timeline::Span span(*timeline_, "forward", category::kCompute, lane::kMain);
      AutocastGuard autocast(device_.type(), options_.amp);
      loss = loss_(micro[i]);
    }
    DTRAIN_CHECK(loss.defined() && loss.numel() == 1, "the loss function must return a scalar, got ",
                 loss.defined() ? loss.sizes() : at::IntArrayRef{});
    loss_sum.add_(loss.detach().to(at::kDouble).reshape({}));
    at::Tensor scaled = scaler_->scale(loss.reshape({}) / n);
    loss.reset();
    const auto backward_start = std::chrono::steady_clock::now();
    scaled.backward();
    if (i + 1 == n && sparse_reducer_) sparse_reducer_->reduce();  // after the dense buckets
    if (timeline_->enabled()) {
      if (i + 1 < n) {
        timeline_->add_complete("backward", category::kCompute, lane::kMain, backward_start,
                                std::chrono::steady_clock::now());
      } else {
        // The synchronized backward: computation until the end-of-backward callback, then
        // the wait for the buckets still in flight (the communication not hidden).
        ReducerStepStats st = reducer_->last_step_stats();
        timeline_->add_complete("backward", category::kCompute, lane::kMain, backward_start, st.backward_end);
        timeline_->add_complete("wait for gradients", "wait", lane::kMain, st.backward_end, st.reduced);
      }
    }
    if (i + 1 == n) synced_backward_done = true;
  }
}

std::vector<std::pair<dist::Communicator*, uint64_t>> Trainer::issued_so_far() const {
  std::vector<std::pair<dist::Communicator*, uint64_t>> out{{&mesh_.dp(), mesh_.dp().issued()}};
  if (&mesh_.world() != &mesh_.dp()) out.emplace_back(&mesh_.world(), mesh_.world().issued());
  return out;
}

void Trainer::finish_step_on_one_row(const std::vector<Batch>& micro,
                                     const std::vector<std::pair<dist::Communicator*, uint64_t>>& issued) {
  // The other ranks go on through the step's unit gathers and gradient reductions, in an order
  // that only the step's graph fixes, and none of which depends on the rows of a micro-batch.
  // So this rank runs the whole step again on one row of each micro-batch, skipping the
  // collectives it took part in before it failed and taking part in the rest; every rank then
  // reaches the agreement on the failure in step with the others. What it computes is dropped
  // (every rank zeroes the gradients before the retry).
  units_->release_all();     // waits for the gathers in flight
  reducer_->forget_step();   // waits for the bucket reductions launched
  for (const auto& [comm, before] : issued) comm->skip_collectives(comm->issued() - before);
  std::vector<Batch> rows(micro.size());
  for (size_t i = 0; i < micro.size(); ++i) {
    rows[i] = micro[i];
    for (at::Tensor& f : rows[i].fields) f = f.narrow(0, 0, std::min<int64_t>(1, f.size(0)));
  }
  at::Tensor dropped = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  bool done = false;
  try {
    forward_backward(rows, dropped, done);
  } catch (const c10::OutOfMemoryError& e) {
    throw Error(detail::concat(
        "out of memory on rank ", mesh_.world().rank(), " in step ", step_ + 1, " even on one row per micro-batch, "
        "while finishing the failed attempt's unit gathers and gradient reductions with the other ranks "
        "(--shard=parameters): the units' gathered weights alone do not fit; cut the model into smaller "
        "units (--shard_units), use more data-parallel ranks, or add --offload=optimizer or --amp (",
        std::string(e.what_without_backtrace()).substr(0, 200), ")"));
  }
  for (const auto& [comm, before] : issued) {
    DTRAIN_CHECK(comm->skipping() == 0, "the replay of step ", step_ + 1, " after an out-of-memory error issued ",
                 comm->skipping(), " collective(s) fewer on '", comm->name(), "' than the failed attempt; the "
                 "ranks are out of step (does the model's forward depend on the batch's rows?)");
  }
}

PipelineStep Trainer::pipeline_step(const std::vector<Batch>& micro) const {
  const PipelineOptions& po = options_.pipeline;
  PipelineStep ps;
  ps.micro_batches = static_cast<int>(micro.size());
  ps.schedule = po.schedule;
  ps.activation_shape = po.activation_shape(micro.front().size());
  ps.activation_options = at::TensorOptions().dtype(po.activation_dtype).device(device_);
  ps.read_loss = false;
  ps.input = [](int) { return at::Tensor(); };  // the first stage's forward reads its micro-batch
  const bool last = mesh_.pp_rank() == mesh_.pp_size() - 1;
  ps.forward = [&micro, &po, last, type = device_.type(), amp = options_.amp](const at::Tensor& x, int i) {
    at::Tensor y;
    {
      AutocastGuard autocast(type, amp);
      y = po.forward(x, micro.at(i));
    }
    return !last && y.scalar_type() != po.activation_dtype ? y.to(po.activation_dtype) : y;
  };
  return ps;
}

void Trainer::run_pipeline(const std::vector<Batch>& micro, at::Tensor& loss_sum) {
  PipelineStep ps = pipeline_step(micro);
  const int n = ps.micro_batches;
  // Gradients accumulate without a reduction until the step's last backward (micro-batch n - 1
  // in both schedules), whose buckets are reduced over this stage's data-parallel group as
  // they complete, overlapped with the rest of that backward.
  std::optional<GradReducer::NoSync> no_sync;
  ps.before_backward = [&](int i) {
    if (i + 1 < n && !no_sync) no_sync.emplace(reducer_.get());
    if (i + 1 == n) no_sync.reset();
  };
  if (scaler_->enabled()) ps.scale_loss = [this](const at::Tensor& loss) { return scaler_->scale(loss); };
  if (timeline_->enabled()) {
    // On a GPU the spans are the device's (CUDA events around each forward and backward, read
    // at the end of the step: run_pipeline_step then waits for the stage's device work).
    ps.on_span = [this](const std::string& what, int i, PipelineStep::Clock::time_point a,
                        PipelineStep::Clock::time_point b) {
      const bool wait = what.rfind("wait", 0) == 0;
      timeline_->add_complete(what, wait ? "wait" : category::kCompute, lane::kMain, a, b,
                              {{"micro_batch", static_cast<double>(i)}, {"stage", static_cast<double>(mesh_.pp_rank())}});
    };
  }
  // Out of memory on this stage: the stage still finishes the step's exchanges, so that its
  // neighbours are not left waiting, and the error goes to run_micro_batches' back-off.
  ps.finish_after_oom = options_.oom_backoff;
  PipelineStepResult r = run_pipeline_step(mesh_.pp(), ps);
  no_sync.reset();
  if (r.out_of_memory) std::rethrow_exception(r.out_of_memory);
  if (sparse_reducer_) sparse_reducer_->reduce();  // after the dense buckets
  if (r.loss_sum.defined()) loss_sum.add_(r.loss_sum);
}

at::Tensor Trainer::pipeline_eval_loss(const Batch& batch) {
  // The step's micro-batches where the batch splits as the training batch does: the stages
  // overlap their forwards.
  const int m = batch.size() % accum_steps_ == 0 ? accum_steps_ : 1;
  const std::vector<Batch> micro = split_batch(batch, m);
  PipelineStepResult r = run_pipeline_forward(mesh_.pp(), pipeline_step(micro));
  return r.loss_sum.defined() ? r.loss_sum / m
                              : at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
}

std::string Trainer::failing_ranks(bool failed) {
  dist::Communicator& world = mesh_.world();
  at::Tensor mine = at::full({1}, failed ? 1 : 0, at::kLong);
  at::Tensor all = at::empty({world.size()}, at::kLong);
  world.all_gather(mine, all)->wait();
  std::ostringstream ranks;
  for (int r = 0; r < world.size(); ++r) {
    if (all[r].item<int64_t>()) ranks << (ranks.tellp() ? "," : "") << r;
  }
  return ranks.str();
}

bool Trainer::agree_on_failure(bool failed) {
  const std::string ranks = failing_ranks(failed);
  if (ranks.empty()) return false;
  if (mesh_.world().rank() == 0) {
    LOG(WARNING) << "step " << step_ + 1 << ": out of memory on rank(s) " << ranks
                 << "; every rank drops the step and retries it with smaller micro-batches";
  }
  return true;
}

void Trainer::back_off(int64_t batch_rows) {
  const int next = accum_steps_ * 2;
  DTRAIN_CHECK(batch_rows % next == 0, "out of memory even with micro-batches of ",
               batch_rows / accum_steps_, " rows (batch ", batch_rows,
               " cannot be split further evenly); lower --batch_size, enable "
               "--checkpoint_activations or --amp, or offload");
  if (mesh_.world().rank() == 0) {
    LOG(WARNING) << "OOM back-off: micro-batch " << batch_rows / accum_steps_ << " -> "
                 << batch_rows / next << " rows, accumulation " << accum_steps_ << " -> " << next
                 << " (the global batch is unchanged)";
  }
  accum_steps_ = next;
}

void Trainer::apply_update(StepMetrics& m, bool& skipped, const at::Tensor& loss_sum) {
  // A background save's copies of the weights and optimizer state (overlapped with this step's
  // forward and backward) land before the update writes them.
  staging_.fence();
  // Pruned entries get no gradient (as `orig * mask` would), before anything reads them.
  if (pruner_) pruner_->mask_gradients();
  // The gradients are read only: unscaling and clipping become one multiplier that the
  // optimizer applies inside its update.
  const std::vector<at::Tensor> grads = gradient_tensors(params_, reducer_.get());
  bool finite = scaler_->check_finite(grads, &mesh_.world());
  at::Tensor multiplier;  // undefined: 1
  if (scaler_->enabled()) multiplier = scaler_->inverse_scale();
  // Without a loss scaler the trainer itself watches for a non-finite loss or gradient norm.
  const bool watch = !scaler_->enabled();
  if (finite && (options_.clip_grad_norm > 0 || options_.report_grad_norm || watch)) {
    at::Tensor norm = global_grad_norm(params_, norm_layout_);  // of the scaled gradients
    if (watch && nonfinite_on_any_rank(loss_sum, norm)) {
      handle_nonfinite(loss_sum, norm);  // throws, or counts the skip
      finite = false;
    } else if (watch) {
      consecutive_nonfinite_ = 0;
    }
    if (multiplier.defined()) norm = norm * multiplier.to(norm.device());
    if (finite && options_.clip_grad_norm > 0) {
      at::Tensor coef = clip_coefficient(norm, options_.clip_grad_norm);
      multiplier = multiplier.defined() ? multiplier.to(coef.device()) * coef : coef;
    }
    last_grad_norm_ = norm;  // read on the host only at log steps
  }
  const double lr = options_.optimizer.lr * schedule_factor(options_.schedule, step_);
  optimizer_->set_lr(lr);
  m.lr = lr;
  skipped = !finite;
  if (finite) {
    Timeline::Span span(*timeline_, "optimizer", category::kOptimizer, lane::kOptimizer);
    optimizer_->step(multiplier);
    if (pruner_) pruner_->mask_weights();  // pruned weights stay exactly zero
  } else {
    optimizer_->skip_step();
  }
  scaler_->update();
  reducer_->zero_grad();
  if (sparse_reducer_) sparse_reducer_->zero_grad();
}

bool Trainer::nonfinite_on_any_rank(const at::Tensor& loss_sum, const at::Tensor& norm) {
  at::Tensor flag = at::logical_or(at::isfinite(loss_sum).logical_not(), at::isfinite(norm).logical_not())
                        .to(at::kLong)
                        .reshape({1})
                        .cpu();
  mesh_.world().all_reduce(flag, dist::ReduceOp::kMax)->wait();
  return flag.item<int64_t>() != 0;
}

void Trainer::handle_nonfinite(const at::Tensor& loss_sum, const at::Tensor& norm) {
  const int64_t step = step_ + 1;
  const bool skip = options_.on_nonfinite == NonFinitePolicy::kSkip;
  ++consecutive_nonfinite_;
  if (skip && consecutive_nonfinite_ <= options_.max_nonfinite_skips) {
    ++nonfinite_skips_;
    LOG_IF(WARNING, mesh_.world().rank() == 0)
        << "step " << step << ": non-finite loss or gradient norm; the step is skipped on every rank ("
        << nonfinite_skips_ << " skipped so far, " << consecutive_nonfinite_ << " in a row, --on_nonfinite=skip)";
    return;
  }
  std::string newest = "no checkpoint was saved";
  if (!options_.save_dir.empty()) {
    wait_for_save();  // a background save in flight is the newest checkpoint once published
    CheckpointStoreOptions so;
    so.fs = options_.checkpoint_fs;
    std::vector<CheckpointInfo> saved = CheckpointStore(options_.save_dir, so).list();
    if (!saved.empty()) newest = "the newest checkpoint is " + saved.front().path + " (resume from it, e.g. with a lower --lr)";
  }
  std::ostringstream os;
  os << "step " << step << ": the loss is " << loss_sum.item<double>() / accum_steps_ << " and the gradient norm "
     << norm.item<double>() << " on rank " << mesh_.world().rank() << " (a non-finite value on some rank)";
  if (skip) {
    os << "; " << consecutive_nonfinite_ << " steps in a row were not finite (--on_nonfinite=skip allows "
       << options_.max_nonfinite_skips << "), so training stops";
  } else {
    os << "; training stops before the optimizer step (--on_nonfinite=stop), so the weights stay finite";
  }
  os << "; " << newest << ". --on_nonfinite=skip drops such steps instead.";
  throw Error(os.str());
}

void Trainer::check_can_train() const {
  DTRAIN_CHECK(!options_.evaluation_only, "this trainer was built for evaluation only (TrainerOptions::"
               "evaluation_only, --eval_only): it has no optimizer and cannot train; build it without that option");
}

StepResult Trainer::step(const Batch& batch) {
  check_can_train();
  const auto started = std::chrono::steady_clock::now();
  step_start_allocated_mb_ = memory_stats(device_).allocated_mb;
  if (pruner_ && prune_target(options_.prune, step_ + 1) >= 0) {
    flush_updates();  // the weights the masks are chosen from are final
    pruner_->maybe_prune(step_ + 1);
  }
  StepResult result;
  at::Tensor loss_sum;
  for (;;) {
    bool failed = run_micro_batches(batch, loss_sum);
    if (!options_.oom_backoff || !agree_on_failure(failed)) break;
    reducer_->zero_grad();  // every rank drops what the failed attempt accumulated
    if (sparse_reducer_) sparse_reducer_->zero_grad();
    back_off(batch.size());
    ++result.oom_retries;
  }
  step_peak_mb_ = memory_stats(device_).peak_mb;
  StepMetrics m;
  bool skipped = false;
  apply_update(m, skipped, loss_sum);
  ++step_;
  record_step_timeline(started);
  if (options_.memory_report_step == step_ && mesh_.world().rank() == 0) {
    LOG(INFO) << "memory report after step " << step_ << ":\n" << memory_report().to_string();
  }
  // The global-batch mean: average over micro-batches here, over data-parallel ranks there.
  at::Tensor loss = loss_sum.div(accum_steps_).reshape({1});
  // Pipeline: the loss is the last stage's (the others hold 0), to every stage.
  if (mesh_.pp_size() > 1) mesh_.pp().all_reduce(loss, dist::ReduceOp::kSum)->wait();
  pending_loss_ = mesh_.dp().all_reduce(loss, dist::ReduceOp::kAvg);
  pending_loss_tensor_ = loss;
  result.step = step_;
  result.skipped = skipped;
  result.loss = std::numeric_limits<double>::quiet_NaN();
  m.step = step_;
  m.accum_steps = accum_steps_;
  last_ = m;
  return result;
}

void Trainer::record_step_timeline(std::chrono::steady_clock::time_point start) {
  if (!timeline_->enabled()) return;
  auto end = std::chrono::steady_clock::now();
  ReducerStepStats s = reducer_->last_step_stats();
  const std::string collective = reducer_->bucket_comm().name();
  for (size_t k = 0; k < s.bucket_start.size(); ++k) {
    TraceArgs args = {{"bucket", static_cast<double>(k)},
                      {"bytes", k < s.bucket_bytes.size() ? static_cast<double>(s.bucket_bytes[k]) : 0.0}};
    if (k < s.bucket_launch.size()) {
      timeline_->add_instant("enqueue " + collective, category::kComm, lane::kComm, s.bucket_launch[k], args);
    }
    timeline_->add_complete(collective, category::kComm, lane::kComm, s.bucket_start[k], s.bucket_end[k], args);
  }
  // ZeRO-3: each unit's gathers (on the comm lane: hidden where a computation overlaps them) and
  // its computations, forward and backward, on a lane of their own.
  if (units_) {
    for (const ParameterUnits::Event& e : units_->take_events()) {
      const TraceArgs args = {{"unit", static_cast<double>(e.unit)}};
      if (e.name == "gather") {
        timeline_->add_complete("gather unit", category::kComm, lane::kComm, e.start, e.end, args);
      } else {
        timeline_->add_complete("unit " + e.name, category::kCompute, lane::kUnits, e.start, e.end, args);
      }
    }
  }
  // A host update (optimizer offload); a delayed one ran during this step's forward and backward.
  if (auto t = optimizer_->take_update_timing()) {
    timeline_->add_complete(t->background ? "cpu update (delayed)" : "cpu update", category::kOptimizer,
                            lane::kOptimizer, t->start, t->end);
  }
  timeline_->add_complete("step", category::kCompute, lane::kMain, start, end,
                          {{"step", static_cast<double>(step_)}, {"accum_steps", static_cast<double>(accum_steps_)}});
}

void Trainer::finish_timeline() {
  if (!timeline_->enabled()) return;
  timeline_->write();
  dist::Communicator& world = mesh_.world();
  world.barrier()->wait();
  if (world.rank() != 0) return;
  std::vector<std::string> files;
  for (int r = 0; r < world.size(); ++r) {
    files.push_back(timeline_path_for_rank(options_.timeline_path, r, world.size()));
  }
  if (world.size() > 1) merge_timelines(files, options_.timeline_path);
  const std::vector<TraceEvent> events = read_timeline(options_.timeline_path);
  LOG(INFO) << "timeline written to " << options_.timeline_path << ": " << summarize_overlap(events).to_string();
  if (mesh_.pp_size() > 1) LOG(INFO) << "pipeline stages:\n" << to_string(summarize_pipeline(events));
}

MemoryReport Trainer::memory_report() const {
  MemoryReport r = build_memory_report(device_, params_, gradient_tensors(params_, reducer_.get()),
                                       optimizer_ ? optimizer_->device_state() : std::vector<at::Tensor>{},
                                       step_start_allocated_mb_, step_peak_mb_);
  if (const int64_t host = optimizer_ ? optimizer_->host_bytes() : 0) {
    r.host_offload_mb = static_cast<double>(host) / (1024.0 * 1024.0);
  }
  r.host_staging_mb = static_cast<double>(staging_.pinned_bytes()) / (1024.0 * 1024.0);
  return r;
}

void Trainer::flush_updates() {
  staging_.fence();  // the delayed update writes the weights a background save may still copy
  if (optimizer_) optimizer_->flush();
}

double Trainer::read_loss() {
  if (!pending_loss_) return std::numeric_limits<double>::quiet_NaN();
  pending_loss_->wait();
  pending_loss_.reset();
  return pending_loss_tensor_.item<double>();
}

void shard_loader(const dist::Mesh& mesh, DataLoader& loader, const std::string& which) {
  const LoaderOptions lo = loader.options();
  const int rank = mesh.dp_rank(), size = mesh.dp_size();
  const bool matches = lo.dp_rank == rank && lo.dp_size == size;
  const bool unsharded = lo.dp_rank == 0 && lo.dp_size == 1;
  std::string problem;
  if (!matches && !unsharded) {
    std::ostringstream os;
    os << which << " is sharded for data-parallel rank " << lo.dp_rank << " of " << lo.dp_size
       << ", but this rank is data-parallel rank " << rank << " of " << size
       << " (the trainer's mesh); leave LoaderOptions::dp_rank/dp_size at 0/1 and the trainer shards it, "
          "or set them to mesh.dp_rank()/mesh.dp_size()";
    problem = os.str();
  }
  // Collective, so that a layout wrong on some ranks only (dp_rank 0 everywhere) stops every
  // rank, not just those, while the others wait in their next collective.
  const std::vector<std::string> problems = gather_texts(mesh.world(), problem);
  if (!problem.empty()) throw Error(problem);
  for (size_t r = 0; r < problems.size(); ++r) {
    if (!problems[r].empty()) {
      throw Error(which + " is sharded for another data-parallel layout on another rank (rank " +
                  std::to_string(r) + ": " + problems[r] + ")");
    }
  }
  if (matches) return;
  loader.shard(rank, size);
  if (mesh.world().rank() == 0) {
    LOG(INFO) << which << ": sharded over the " << size << " data-parallel ranks (each rank its own "
              << lo.batch_size << " samples of a " << lo.batch_size * size << "-sample global batch)";
  }
}

void Trainer::score_batch(const Batch& batch, double weight, at::Tensor& sums) {
  AutocastGuard autocast(device_.type(), options_.amp);
  if (options_.eval_loss_and_correct) {
    auto [loss, correct] = options_.eval_loss_and_correct(batch);
    sums[0].add_(loss.detach().to(at::kDouble).reshape({}) * weight);
    sums[1].add_(correct.detach().to(at::kDouble).reshape({}) * (weight > 0 ? 1.0 : 0.0));
  } else if (mesh_.pp_size() > 1) {
    sums[0].add_(pipeline_eval_loss(batch) * weight);  // zero except on the last stage
  } else {
    sums[0].add_(loss_(batch).detach().to(at::kDouble).reshape({}) * weight);
  }
}

double Trainer::evaluate(DataLoader& eval, int64_t batches) {
  shard_loader(mesh_, eval, "the evaluation loader");
  const bool was_training = model_.is_training();
  model_.eval();
  // [loss sum, correct predictions, rows], summed on the device: one host read at the end.
  at::Tensor sums = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device_));
  const bool counting = static_cast<bool>(options_.eval_loss_and_correct);
  {
    torch::NoGradGuard no_grad;
    for (int64_t b = 0; b < batches; ++b) {
      Batch batch = eval.next();
      score_batch(batch, /*weight=*/1.0, sums);
      if (counting) sums[2].add_(static_cast<double>(batch.size()));
    }
  }
  model_.train(was_training);
  sums[0].div_(static_cast<double>(batches));
  // Every rank evaluates as many batches: the mean of the ranks' means is the mean loss; the
  // counts add up.
  at::Tensor loss = sums.narrow(0, 0, 1);
  if (mesh_.pp_size() > 1) mesh_.pp().all_reduce(loss, dist::ReduceOp::kSum)->wait();  // the last stage's
  mesh_.dp().all_reduce(loss, dist::ReduceOp::kAvg)->wait();
  if (counting) {
    at::Tensor counts = sums.narrow(0, 1, 2);
    mesh_.dp().all_reduce(counts, dist::ReduceOp::kSum)->wait();
  }
  at::Tensor host = sums.cpu();
  const double* v = host.data_ptr<double>();
  last_eval_accuracy_ = counting && v[2] > 0 ? std::optional<double>(v[1] / v[2]) : std::nullopt;
  return v[0];
}

void Trainer::check_tied_parameters(const std::vector<std::pair<std::string, std::string>>& tied) const {
  const std::string pair = "'" + tied.front().first + "' is '" + tied.front().second + "'";
  const char* mode = mesh_.pp_size() > 1                       ? "--pp > 1 (the two names may live on different stages)"
                     : mesh_.tp_size() > 1                     ? "--tp > 1 (each rank holds its own slice of each layer)"
                     : parse_shard_mode(options_.shard) == ShardMode::kParameters ? "--shard=parameters (ZeRO-3's units "
                                                                                   "own each weight once)"
                                                                                 : nullptr;
  DTRAIN_CHECK(mode == nullptr, "tied parameters (", pair, (tied.size() > 1 ? ", and more" : ""), ") with ", mode,
               " are not supported yet; untie them (give each its own parameter) or train without that option");
  if (mesh_.world().rank() == 0) {
    for (const auto& [second, first] : tied) {
      LOG(INFO) << "tied parameters: '" << second << "' is '" << first << "'; trained once, its gradient the sum "
                << "over both uses (checkpoints keep both names)";
    }
  }
}

void Trainer::start_fresh_in_save_dir() {
  // Rank 0 holds the directory's lock and decides; every rank learns the outcome (collective).
  std::string refused;
  bool resume = false;
  if (mesh_.world().rank() == 0) {
    try {
      CheckpointStore store(options_.save_dir, CheckpointStoreOptions{0, options_.checkpoint_fs});
      const std::vector<CheckpointInfo> found = store.list();
      if (!found.empty()) {
        const std::string what = std::to_string(found.size()) + " checkpoint(s) of an earlier run (newest: " +
                                 found.front().path + ")";
        switch (options_.save_dir_exists) {
          case SaveDirExists::kError:
            refused = "--save_dir=" + options_.save_dir + " already holds " + what +
                      ", and this run starts fresh (--resume=no): its checkpoints would sit beside them, and a "
                      "later --resume would continue whichever is newest. Continue that run with --resume=auto, "
                      "start over with --save_dir_exists=overwrite (removes them), or give another --save_dir";
            break;
          case SaveDirExists::kOverwrite:
            LOG(WARNING) << "--save_dir_exists=overwrite: removing " << what << " from " << options_.save_dir;
            store.remove_all();
            break;
          case SaveDirExists::kResume:
            LOG(INFO) << "--save_dir_exists=resume: " << options_.save_dir << " holds " << what
                      << "; continuing from the newest good one";
            resume = true;
            break;
        }
      }
    } catch (const std::exception& e) {
      refused = e.what();
    }
  }
  // Every rank throws rank 0's message, or none does.
  const std::string rank0_refused = gather_texts(mesh_.world(), refused).front();
  if (!rank0_refused.empty()) throw Error(rank0_refused);
  // Every rank resumes or none: rank 0's finding, broadcast.
  at::Tensor flag = at::full({1}, resume ? 1 : 0, at::kLong);
  mesh_.world().broadcast(flag, 0)->wait();
  if (flag.item<int64_t>() != 0) options_.resume = ResumeMode::kAuto;
}

double Trainer::evaluate(DataLoader& eval) {
  shard_loader(mesh_, eval, "the evaluation loader");
  const std::vector<int64_t> order = eval.evaluation_order(options_.eval_samples);
  DTRAIN_CHECK(!order.empty(), "evaluation: the held-out dataset has no samples");
  const int64_t rows_per_chunk = eval.options().batch_size;
  const int64_t chunks = (static_cast<int64_t>(order.size()) + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t dp = mesh_.dp_size(), rank = mesh_.dp_rank();
  const int64_t rounds = (chunks + dp - 1) / dp;
  const bool was_training = model_.is_training();
  model_.eval();
  // [row-weighted loss sum, correct predictions, rows], summed on the device: one host read.
  at::Tensor sums = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device_));
  const bool counting = static_cast<bool>(options_.eval_loss_and_correct);
  {
    torch::NoGradGuard no_grad;
    for (int64_t round = 0; round < rounds; ++round) {
      const int64_t chunk = round * dp + rank;
      const bool counts = chunk < chunks;
      // A rank past the last chunk runs the set's first sample so that every rank runs the same
      // forwards; it does not count.
      const int64_t first = counts ? chunk * rows_per_chunk : 0;
      const int64_t rows = counts ? std::min<int64_t>(rows_per_chunk, static_cast<int64_t>(order.size()) - first) : 1;
      Batch batch = eval.load(std::vector<int64_t>(order.begin() + first, order.begin() + first + rows));
      batch.index = chunk;
      const double weight = counts ? static_cast<double>(rows) : 0.0;
      score_batch(batch, weight, sums);
      sums[2].add_(weight);
    }
  }
  model_.train(was_training);
  // The last stage holds the loss (the others add zero); every stage counts the rows.
  if (mesh_.pp_size() > 1) {
    at::Tensor loss = sums.narrow(0, 0, 1);
    mesh_.pp().all_reduce(loss, dist::ReduceOp::kSum)->wait();
  }
  mesh_.dp().all_reduce(sums, dist::ReduceOp::kSum)->wait();
  at::Tensor host = sums.cpu();
  const double* v = host.data_ptr<double>();
  DTRAIN_CHECK(static_cast<int64_t>(v[2]) == static_cast<int64_t>(order.size()), "evaluation: the ranks scored ",
               v[2], " rows of a ", order.size(), "-sample held-out set (internal error)");
  last_eval_accuracy_ = counting ? std::optional<double>(v[1] / v[2]) : std::nullopt;
  return v[0] / v[2];
}

double Trainer::comm_bus_bytes() const {
  std::vector<const dist::Communicator*> comms = {&mesh_.world()};
  for (const dist::Communicator* c : {&mesh_.dp(), &mesh_.tp(), &mesh_.pp()}) {
    if (std::find(comms.begin(), comms.end(), c) == comms.end()) comms.push_back(c);
  }
  double bytes = 0;
  for (const dist::Communicator* c : comms) bytes += c->traffic().bus_bytes;
  return bytes;
}

StepMetrics Trainer::log_step(bool eval_now, DataLoader* eval, int64_t global_batch,
                              std::chrono::steady_clock::time_point window_start,
                              int64_t window_steps, Progress& progress) {
  StepMetrics m = last_;
  m.loss = read_loss();  // waits for the step's work: the window's time is complete now
  m.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - window_start).count() /
              window_steps;
  m.samples_per_s = m.step_ms > 0 ? global_batch / (m.step_ms / 1000.0) : 0;
  if (options_.tokens_per_sample > 0) m.tokens_per_s = m.samples_per_s * options_.tokens_per_sample;
  // What this rank sent per step over the window, on the mesh's communicators (ring bus bytes).
  const double bus = comm_bus_bytes();
  m.extra["comm_mb"] = (bus - logged_comm_bus_bytes_) / window_steps / (1024.0 * 1024.0);
  logged_comm_bus_bytes_ = bus;
  MemoryStats mem = memory_stats(device_);
  m.mem_allocated_mb = mem.allocated_mb;
  m.mem_peak_mb = mem.peak_mb;
  if (mesh_.pp_size() > 1) {
    // Rank 0's figures are stage 0's: every stage's peak too (from this rank's pipeline).
    const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
    at::Tensor peaks = at::empty({mesh_.pp_size()}, f64);
    mesh_.pp().all_gather(at::full({1}, mem.peak_mb, f64), peaks)->wait();
    const at::Tensor host = peaks.cpu();
    for (int s = 0; s < mesh_.pp_size(); ++s) {
      m.extra["mem_peak_mb_stage" + std::to_string(s)] = host.data_ptr<double>()[s];
    }
  }
  m.mem_counter = mem.counter;
  if (scaler_->enabled()) m.loss_scale = scaler_->scale_value();
  if (options_.report_grad_norm && last_grad_norm_.defined()) m.grad_norm = last_grad_norm_.item<double>();
  if (pruner_ && pruner_->active()) m.extra["sparsity"] = pruner_->sparsity();
  if (sparse_reducer_) {  // the logged step's sparse gradients: what moved, what dense would have moved
    const SparseReduceStats& st = sparse_reducer_->last_stats();
    m.extra["sparse_grad_mb"] = static_cast<double>(st.sparse_bytes + st.dense_bytes) / (1024.0 * 1024.0);
    m.extra["sparse_grad_dense_mb"] = static_cast<double>(st.dense_equivalent_bytes) / (1024.0 * 1024.0);
    m.extra["sparse_grad_densified"] = st.densified;
  }
  if (nonfinite_skips_ > 0 || options_.on_nonfinite == NonFinitePolicy::kSkip) {
    m.extra["nonfinite_skips"] = static_cast<double>(nonfinite_skips_);
  }
  if (eval_now) {
    m.eval_loss = evaluate(*eval);
    if (last_eval_accuracy_) m.extra["eval_accuracy"] = *last_eval_accuracy_;
    if (options_.eval_perplexity) m.extra["eval_perplexity"] = std::exp(*m.eval_loss);
  }
  metrics_->write(m);
  tensorboard_->add_metrics(m);
  progress.update(m);
  if (device_.is_cuda() && mesh_.world().rank() == 0 && !options_.progress) {
    LOG(INFO) << gpu_summary_line(device_);
  }
  if (options_.on_log) options_.on_log(m);
  return m;
}

bool Trainer::stop_for_preemption(const DataLoader& train) {
  if (!options_.handle_preemption || !agree_preempt(mesh_.world())) return false;
  if (mesh_.world().rank() == 0) {
    LOG(WARNING) << "preempted (signal " << preemption_signal() << ") after step " << step_
                 << (options_.save_dir.empty() ? "; no --save_dir, nothing saved" : "; saving a checkpoint");
  }
  if (!options_.save_dir.empty()) {
    if (last_saved_step_ == step_) {
      wait_for_save();  // this step's periodic save (possibly in the background) is the checkpoint
    } else {
      save_checkpoint(&train);
    }
  }
  if (mesh_.world().rank() == 0) {
    RequeueResult rq = request_requeue();
    if (rq.attempted) LOG(WARNING) << "requeue: " << rq.message;
  }
  preempted_ = true;
  return true;
}

void Trainer::prepare_loaders(DataLoader& train, DataLoader* eval) {
  // Never two ranks on the same batches: an unsharded loader is sharded here.
  shard_loader(mesh_, train, "the training loader");
  if (eval) shard_loader(mesh_, *eval, "the evaluation loader");
  // The same on every rank (options and dataset are), so every rank refuses together.
  DTRAIN_CHECK(train.options().drop_last || mesh_.dp_size() == 1,
               "Trainer::fit: the training loader has drop_last = false, which gives ranks "
               "unequal (possibly empty) shares of an epoch's last global batch; with ",
               mesh_.dp_size(), " data-parallel ranks set drop_last = true");
  const LoaderOptions& lo = train.options();
  agree_on_settings(mesh_.world(),
                    {{"batch_size", setting_text(lo.batch_size)}, {"drop_last", setting_text(lo.drop_last)},
                     {"shuffle", setting_text(lo.shuffle)}, {"seed", setting_text(lo.seed)},
                     {"batches per epoch", setting_text(train.batches_per_epoch())},
                     {"evaluation", setting_text(eval != nullptr)}},
                    "the training loader of Trainer::fit");
}

void Trainer::save_periodic(const DataLoader& train) {
  if (options_.async_save) {
    {  // Saves more frequent than a write lasts wait here: the timeline shows it apart.
      Timeline::Span span(*timeline_, "checkpoint (wait for the previous write)", category::kCopy, lane::kMain);
      wait_for_save();
    }
    Timeline::Span span(*timeline_, "checkpoint (copy to host)", category::kCopy, lane::kMain);
    save_checkpoint_async(&train);
  } else {
    Timeline::Span span(*timeline_, "checkpoint (write)", category::kCopy, lane::kMain);
    save_checkpoint(&train);
  }
}

StepMetrics Trainer::fit(DataLoader& train, DataLoader* eval) {
  check_can_train();
  prepare_loaders(train, eval);
  Progress progress(options_.steps, options_.progress && mesh_.world().rank() == 0);
  const int64_t global_batch = train.options().batch_size * mesh_.dp_size();
  StepMetrics logged;
  // The evaluation loader's position is saved and restored with the training loader's.
  struct EvalScope {
    DataLoader*& slot;
    ~EvalScope() { slot = nullptr; }
  } eval_scope{eval_};
  eval_ = eval;
  if (options_.resume != ResumeMode::kNo) {
    resume_checkpoint(&train, options_.resume == ResumeMode::kYes);
    // The lines an earlier process logged after the checkpoint it left are logged again now:
    // one line per step in the metrics file.
    metrics_->keep_through_step(step_);
  }
  // TensorBoard: points of steps from here on that earlier processes wrote are superseded.
  tensorboard_->add_resume(step_ + 1);
  if (step_ >= options_.steps) {
    if (mesh_.world().rank() == 0) {
      LOG(WARNING) << "the run is complete: step " << step_ << " of " << options_.steps
                   << " steps was reached (checkpoint in " << options_.save_dir << "); nothing to train";
    }
    // Nothing was trained: no loss to report (NaN, never a made-up 0).
    StepMetrics done;
    done.step = step_;
    done.loss = std::numeric_limits<double>::quiet_NaN();
    finish_timeline();
    return done;
  }
  const int64_t first_step = step_ + 1;  // logged too, so a resumed run shows where it starts
  reset_peak_memory(device_);
  auto window_start = std::chrono::steady_clock::now();
  int64_t window_steps = 0;
  while (step_ < options_.steps) {
    profiler_->begin_step(step_ + 1);
    Batch batch;
    {
      Timeline::Span span(*timeline_, "data", category::kData, lane::kLoader);
      batch = train.next();
    }
    StepResult r = step(batch);
    ++window_steps;
    const bool eval_now = eval && options_.eval_every > 0 && r.step % options_.eval_every == 0;
    if (r.step == first_step || r.step % options_.log_every == 0 || r.step == options_.steps || eval_now) {
      // No host sync between log steps: the loss is read here only.
      logged = log_step(eval_now, eval, global_batch, window_start, window_steps, progress);
      if (first_logged_.step == 0) first_logged_ = logged;
      window_start = std::chrono::steady_clock::now();
      window_steps = 0;
    }
    if (!options_.save_dir.empty() && options_.save_every > 0 && r.step % options_.save_every == 0) {
      save_periodic(train);
    }
    profiler_->end_step(r.step);
    if (stop_for_preemption(train)) break;
  }
  progress.finish();
  flush_updates();  // the model holds every step's update when fit() returns
  if (!preempted_ && !options_.save_dir.empty() && last_saved_step_ != step_) save_checkpoint(&train);
  wait_for_save();  // every checkpoint of fit() is published when it returns
  finish_timeline();
  return logged;
}

}  // namespace dtrain::engine
