#include "dtrain/engine/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/context_parallel.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/optim/sparse_optim.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/preemption.h"
#include "dtrain/engine/parallel/fused_block_ops.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "trainer_setup.h"

namespace dtrain::engine {

namespace {

// The gradients to check or count: each parameter's (a sparse one's values), and under ZeRO-3
// the optimizer's gradient shard (the parameters' .grad are undefined then).
std::vector<at::Tensor> gradient_tensors(const std::vector<at::Tensor>& params, const GradNormLayout& layout) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size() + 1);
  for (const at::Tensor& p : params) grads.push_back(gradient_values(p.grad()));
  if (layout.owned_values.defined()) grads.push_back(layout.owned_values);
  return grads;
}

}  // namespace

void cast_parameters(torch::nn::Module& model, at::ScalarType dtype) {
  if (dtype == at::kFloat) return;
  at::NoGradGuard no_grad;
  for (at::Tensor& p : model.parameters()) {
    if (at::isFloatingType(p.scalar_type()) && p.scalar_type() != dtype) p.set_data(p.detach().to(dtype));
  }
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
  DTRAIN_CHECK(spec.context_parallel == nullptr || spec.context_parallel == &mesh.cp(), "the model splits its "
               "sequences over a context-parallel group of ", spec.context_parallel ? spec.context_parallel->size() : 0,
               " rank(s) that is not the mesh's cp axis (", mesh.cp_size(), " rank(s)): its weights' gradients would "
               "not be averaged over it; build the mesh with that context-parallel size (Mesh(world, tp, pp, cp)) and "
               "the model with &mesh.cp()");
  options.model_applies_block_techniques = true;  // the AppliedModel below
  ModelTechniques t;
  t.checkpoint_activations = options.checkpoint_activations;
  t.checkpoint_blocks = options.checkpoint_blocks;
  t.offload_layers = options.offload_layers;
  t.device = device;
  const bool interleaved = options.pipeline.schedule == PipelineSchedule::kInterleaved;
  split_pipeline_stage(spec, mesh.pp_rank(), mesh.pp_size(), options.pp_blocks, t,
                       interleaved ? options.pipeline.chunks : 1);
  cast_parameters(*spec.module, options.param_dtype);  // before streaming takes the blocks' host copies
  if (options.param_dtype != at::kFloat && spec.activation_dtype == at::kFloat) {
    spec.activation_dtype = options.param_dtype;  // what a stage computes and sends
  }
  if (options.shard == "parameters" && options.shard_unit_starts.empty()) {
    options.shard_unit_starts = default_unit_prefixes(spec);
  }
  Applied a;
  a.model = std::make_shared<AppliedModel>(spec, t);
  a.model->start_streaming();  // before the trainer takes the parameters: the blocks' live on the host
  if (options.offload_layers) {
    options.offload_streamed.clear();
    for (size_t i = 0; i < spec.blocks->size(); ++i) {
      for (const at::Tensor& p : spec.blocks->block(i)->parameters()) options.offload_streamed.push_back(p);
    }
  }
  std::shared_ptr<AppliedModel> model = a.model;
  a.loss = [model](const Batch& b) { return model->loss(b); };
  if (mesh.pp_size() > 1) {
    options.pipeline.forward = [model](const at::Tensor& x, const Batch& micro) { return model->stage_forward(x, micro); };
    if (interleaved) {
      options.pipeline.chunk_forward = [model](const at::Tensor& x, const Batch& micro, int chunk) {
        return model->chunk_forward(x, micro, chunk);
      };
    }
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
  // Layer offload's delayed update on one rank (--offload=layers or =all): nothing reads a
  // streamed block's gradient during backward (the reducer keeps autograd's, beside optimizer
  // offload's stream of the device part's; the update takes them after it), so the host waits
  // for their copies once, at backward's end, not after each block.
  if (options_.offload_layers && options_.offload.delayed_update_after >= 0 && reducer_) {
    // The streamed parameters the reducer holds (frozen ones have no gradient to wait for).
    std::vector<at::Tensor> streamed;
    for (const at::Tensor& p : options_.offload_streamed) {
      if (reducer_->holds(p)) streamed.push_back(p);
    }
    if (!streamed.empty() && reducer_->keeps_autograd_gradients(streamed)) applied_->set_defer_host_gradient_waits(true);
  }
  if (applied_->techniques().chunks > 1 && mesh_.pp_size() > 1) number_interleaved_parameters();
}

// Interleaved stages: the whole model numbers its parameters virtual stage after virtual stage
// (pre with the first, post with the last: a one-process model's order); a stage's chunks are
// not consecutive there, so each parameter gets its own whole-model index (checkpoints key the
// optimizer state by it).
void Trainer::number_interleaved_parameters() {
  const int P = mesh_.pp_size(), v = applied_->techniques().chunks;
  std::vector<int> stage_of(names_.size());
  std::vector<int64_t> mine(static_cast<size_t>(v), 0);  // this stage's parameters per chunk
  for (size_t i = 0; i < names_.size(); ++i) {
    stage_of[i] = applied_->virtual_stage_of(names_[i]);
    DTRAIN_CHECK(stage_of[i] >= 0 && stage_of[i] % P == mesh_.pp_rank(), "parameter '", names_[i],
                 "' belongs to no piece of this pipeline stage's model chunks");
    ++mine[static_cast<size_t>(stage_of[i] / P)];
    DTRAIN_CHECK(i == 0 || stage_of[i] >= stage_of[i - 1], "parameter '", names_[i], "' comes after a parameter of a "
                 "later model chunk: a stage's parameters must run chunk by chunk (register the blocks in order)");
  }
  // Every stage's counts, stage-major: counts[s v + c] is virtual stage c P + s.
  std::vector<int64_t> counts(static_cast<size_t>(P * v));
  for (int c = 0; c < v; ++c) {
    const std::vector<int64_t> all = dist::all_gather_counts(mesh_.pp(), mine[static_cast<size_t>(c)], device_);
    for (int s = 0; s < P; ++s) counts[static_cast<size_t>(c * P + s)] = all[static_cast<size_t>(s)];
  }
  std::vector<int64_t> start(counts.size() + 1, 0);
  for (size_t k = 0; k < counts.size(); ++k) start[k + 1] = start[k] + counts[k];
  pp_param_index_.assign(names_.size(), 0);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (size_t i = 0; i < names_.size(); ++i) pp_param_index_[i] = next[static_cast<size_t>(stage_of[i])]++;
}

Trainer::Trainer(torch::nn::Module& model, LossFn loss, dist::Mesh& mesh, c10::Device device,
                 TrainerOptions options)
    : model_(model), loss_(std::move(loss)), mesh_(mesh), device_(device),
      options_(std::move(options)), accum_steps_(options_.accum_steps) {
  validate(options_);
  sdpa_backends_from_env();  // DTRAIN_SDPA_BACKENDS, once per process
  (void)fused_block_ops_enabled();  // a bad DTRAIN_FUSED_BLOCK_OPS fails here, on any device
  // Before the first collective that depends on them (the parameter broadcast, the reducer).
  agree_on_settings(mesh_.world(), trainer_setup::settings_of(options_), "TrainerOptions");
  DTRAIN_CHECK(options_.model_applies_block_techniques || !(options_.checkpoint_activations || options_.offload_layers),
               "TrainerOptions::", options_.checkpoint_activations ? "checkpoint_activations" : "offload_layers",
               " (--", options_.checkpoint_activations ? "checkpoint_activations" : "offload=layers",
               ") with a Trainer built from a module and a loss: the trainer cannot find the module's blocks, so it "
               "would do nothing. Build the Trainer from a ModelSpec (dtrain/engine/models/model_spec.h), which "
               "applies it to the blocks, or apply it in your module and set "
               "TrainerOptions::model_applies_block_techniques");
  // Whoever promises preemption handling installs it: without the handlers SIGUSR1/SIGTERM
  // would kill the ranks before any checkpoint.
  if (options_.handle_preemption) install_preemption_handlers();
  if (!options_.save_dir.empty() && !options_.evaluation_only) take_save_dir();
  if (mesh_.pp_size() > 1) trainer_setup::check_pipeline_options(options_, mesh_);
  cast_parameters(model_, options_.param_dtype);
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
  // Interleaved stages: a chunk's parameters get no gradient in the other chunks' backwards,
  // which is no sign of unused parameters.
  if (options_.pipeline.schedule == PipelineSchedule::kInterleaved && mesh_.pp_size() > 1) {
    reducer_options.find_unused_parameters = true;
  }
  if (reducer_options.broadcast_parameters) {
    check_same_parameters(params_, mesh_.replicas(), reducer_options.names);
    at::NoGradGuard no_grad;
    broadcast_tensors(mesh_.replicas(), params_, 0);
    reducer_options.broadcast_parameters = false;
  }
  if (!options_.evaluation_only) {
    trainer_setup::UpdateParts parts =
        trainer_setup::build_update({model_, trained, specs_, sharded_, mesh_, device_, options_}, std::move(reducer_options));
    sparse_reducer_ = std::move(parts.sparse_reducer);
    optimizer_ = std::move(parts.optimizer);
    units_ = std::move(parts.units);
    reducer_ = std::move(parts.reducer);
    pruner_ = std::move(parts.pruner);
    if (parts.partitioned) {
      norm_layout_.partitioned = true;
      norm_layout_.owned = std::move(parts.owned);
      norm_layout_.owned_values = parts.owned_values;
      norm_layout_.owned_at = std::move(parts.owned_at);
      norm_layout_.dp = &mesh_.replicas();
    }
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
  // Context parallelism: ring attention's steps and exchanges on the timeline.
  if (mesh_.cp_size() > 1 && !options_.timeline_path.empty()) set_ring_tracing(true);
}

Trainer::~Trainer() {
  if (mesh_.cp_size() > 1 && !options_.timeline_path.empty()) set_ring_tracing(false);
  // Left by an exception (a failed run): this rank's timeline as far as it got, unmerged (the
  // merge is collective, and the other ranks may be gone) - a failure is when a trace is wanted.
  if (std::uncaught_exceptions() > 0 && timeline_ && timeline_->enabled()) {
    try {
      timeline_->write();
      LOG(WARNING) << "the run failed: this rank's timeline up to the failure is written (not merged with the "
                   << "other ranks')";
    } catch (const std::exception& e) {
      LOG(WARNING) << "the run failed, and its timeline could not be written: " << e.what();
    }
  }
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
  // ZeRO-3: where this step's collectives begin, for a replay after an out-of-memory error
  // (finish_step_on_one_row).
  const uint64_t dp_issued = mesh_.replicas().issued();
  if (units_) units_->optimizer().begin_step();
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
    if (!options_.oom_backoff || mesh_.tp_size() > 1 || mesh_.cp_size() > 1) throw;
    LOG(WARNING) << "out of memory in step " << step_ + 1 << " with micro-batch of "
                 << batch.size() / n << " rows: " << std::string(e.what_without_backtrace()).substr(0, 200);
    loss_sum.reset();
    // The report's step peak is the failed attempt's (set after a step otherwise: 0 in step 1).
    step_peak_mb_ = memory_stats(device_).peak_mb;
    if (device_.is_cuda()) LOG(WARNING) << "memory at the failure:\n" << memory_report().to_string();
    if (units_) {
      if (!synced_backward_done) finish_step_on_one_row(micro, dp_issued);
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
      loss = micro_batch_loss(micro[i]);
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

std::string Trainer::cuda_graph_refusal() const {
  if (!cuda_graphs_compiled()) return "this build has no CUDA code paths";
  if (!device_.is_cuda()) return "the device is not CUDA";
  if (mesh_.tp_size() > 1) return "tensor parallelism (the forward's collectives)";
  if (mesh_.pp_size() > 1) return "pipeline stages (the stages' exchanges)";
  if (mesh_.cp_size() > 1) return "context parallelism (ring attention's exchanges)";
  if (units_) return "ZeRO-3's parameter units (the gathers in forward)";
  if (options_.offload_layers) return "layer offload (the host copies in forward)";
  if (options_.checkpoint_activations && options_.checkpoint_blocks != 0) return "activation checkpointing (the recomputation's random state)";
  if (sparse_reducer_) return "sparse gradients";
  return "";
}

at::Tensor Trainer::micro_batch_loss(const Batch& micro) {
  if (graph_) {
    const std::string stale = graph_->stale();
    if (!stale.empty()) {
      LOG(WARNING) << "--cuda_graph: " << stale << " since the capture; the step is captured again";
      graph_.reset();
      graph_shape_noted_ = false;
    }
  }
  if (options_.cuda_graph && !graph_ && !graph_given_up_ && step_ >= options_.cuda_graph_after_steps) {
    const std::string refusal = cuda_graph_refusal();
    if (!refusal.empty()) {
      LOG_IF(WARNING, mesh_.world().rank() == 0) << "--cuda_graph is not used: " << refusal << "; the steps run eagerly";
      graph_given_up_ = true;
    } else {
      try {
        graph_ = GraphedLoss::capture(loss_, micro, params_, options_.amp, /*warmup=*/3);
        LOG_IF(INFO, mesh_.world().rank() == 0) << "--cuda_graph: the loss function's forward and backward captured "
                                                   "in step " << step_ + 1 << "; replayed from now on";
      } catch (const std::exception& e) {
        LOG(WARNING) << "--cuda_graph: the capture failed on rank " << mesh_.world().rank() << " (" << e.what()
                     << "); the steps run eagerly";
        graph_given_up_ = true;
        graph_.reset();
      }
    }
  }
  if (graph_) {
    if (graph_->matches(micro)) return graph_->run(micro);
    LOG_IF(INFO, !graph_shape_noted_) << "--cuda_graph: a micro-batch of other shapes than the captured one runs "
                                         "eagerly (logged once)";
    graph_shape_noted_ = true;
  }
  AutocastGuard autocast(device_.type(), options_.amp);
  return loss_(micro);
}

void Trainer::finish_step_on_one_row(const std::vector<Batch>& micro, uint64_t dp_issued) {
  // The other ranks go on through the step's unit gathers and gradient reductions, in an order
  // that only the step's graph fixes, and none of which depends on the rows of a micro-batch.
  // So this rank runs the whole step again on one row of each micro-batch, skipping the
  // collectives it took part in before it failed and taking part in the rest; every rank then
  // reaches the agreement on the failure in step with the others. What it computes is dropped
  // (every rank zeroes the gradients before the retry).
  units_->release_all();     // waits for the gathers in flight
  reducer_->forget_step();   // waits for the bucket reductions launched
  Zero3Optimizer& zero3 = units_->optimizer();
  const uint64_t others = mesh_.replicas().issued() - dp_issued - static_cast<uint64_t>(zero3.issued_in_step());
  DTRAIN_CHECK(others == 0, "out of memory in step ", step_ + 1, " on rank ", mesh_.world().rank(), " after ", others,
               " collective(s) on '", mesh_.replicas().name(), "' besides ZeRO-3's unit gathers and gradient reductions; "
               "the step cannot be replayed in step with the other ranks: run without OOM back-off, or give the "
               "run the memory it needs (--accum_steps, --checkpoint_blocks, --offload)");
  zero3.replay_step();  // the gathers and reductions it took part in complete at once
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
  DTRAIN_CHECK(zero3.replaying() == 0, "the replay of step ", step_ + 1, " after an out-of-memory error issued ",
               zero3.replaying(), " ZeRO-3 collective(s) fewer than the failed attempt; the ranks are out of step "
               "(does the model's forward depend on the batch's rows?)");
}

PipelineStep Trainer::pipeline_step(const std::vector<Batch>& micro) const {
  const PipelineOptions& po = options_.pipeline;
  PipelineStep ps;
  ps.micro_batches = static_cast<int>(micro.size());
  ps.schedule = po.schedule;
  ps.costs = po.zb_costs;
  ps.activation_shape = po.activation_shape(micro.front().size());
  ps.activation_options = at::TensorOptions().dtype(po.activation_dtype).device(device_);
  ps.read_loss = false;
  ps.input = [](int) { return at::Tensor(); };  // the first stage's forward reads its micro-batch
  const bool last = mesh_.pp_rank() == mesh_.pp_size() - 1;
  const bool chunked = po.schedule == PipelineSchedule::kInterleaved;
  // The stage's (or chunk's) computation under autocast; what it sends goes as activation_dtype.
  ps.chunk_forward = [&micro, &po, last, chunked, type = device_.type(), amp = options_.amp](const at::Tensor& x, int i,
                                                                                             int chunk) {
    at::Tensor y;
    {
      AutocastGuard autocast(type, amp);
      y = chunked ? po.chunk_forward(x, micro.at(i), chunk) : po.forward(x, micro.at(i));
    }
    const bool loss = last && chunk == (chunked ? po.chunks : 1) - 1;
    return !loss && y.scalar_type() != po.activation_dtype ? y.to(po.activation_dtype) : y;
  };
  ps.forward = [f = ps.chunk_forward](const at::Tensor& x, int i) { return f(x, i, 0); };
  if (chunked) ps.chunks = po.chunks;
  return ps;
}

void Trainer::run_pipeline(const std::vector<Batch>& micro, at::Tensor& loss_sum) {
  PipelineStep ps = pipeline_step(micro);
  const int n = ps.micro_batches;
  // Gradients accumulate without a reduction until the step's last backward (micro-batch n - 1
  // in every schedule; zb: its weight half, several autograd runs), whose buckets are reduced
  // over this stage's data-parallel group as they complete, overlapped with the rest of that
  // backward. Interleaved: each chunk's parameters are final at its own backward of micro-batch
  // n - 1, and backwards of the other chunks' earlier micro-batches come between; one backward
  // of many runs from the first such backward to the step's last, synchronized for those
  // backwards and accumulating only for the others.
  std::optional<GradReducer::NoSync> no_sync;
  const bool runs = ps.schedule == PipelineSchedule::kZeroBubble, chunked = ps.chunks > 1;
  int backwards_left = n * ps.chunks;
  bool in_runs = false;
  ps.before_backward = [&](int i, int) {
    if (i + 1 < n && !no_sync) no_sync.emplace(reducer_.get());
    if (i + 1 == n) {
      no_sync.reset();
      if ((runs || chunked) && !in_runs) {
        reducer_->begin_runs();
        in_runs = true;
      }
    }
  };
  ps.after_backward = [&](int i, int) {
    if (runs && i + 1 == n) {
      reducer_->end_runs();
      in_runs = false;
    }
    if (chunked && --backwards_left == 0 && in_runs) {
      no_sync.reset();
      reducer_->end_runs();
      in_runs = false;
    }
  };
  if (scaler_->enabled()) ps.scale_loss = [this](const at::Tensor& loss) { return scaler_->scale(loss); };
  if (timeline_->enabled()) {
    // On a GPU the spans are the device's (CUDA events around each forward and backward, read
    // at the end of the step: run_pipeline_step then waits for the stage's device work).
    // Interleaved: each virtual stage's forwards and backwards on a lane of their own within the
    // stage's (waits on the stage's main lane).
    const int chunks = ps.chunks, P = mesh_.pp_size(), s = mesh_.pp_rank();
    ps.on_span = [this, chunks, P, s](const std::string& what, int i, int chunk, PipelineStep::Clock::time_point a,
                                      PipelineStep::Clock::time_point b) {
      const bool wait = what.rfind("wait", 0) == 0;
      TraceArgs args{{"micro_batch", static_cast<double>(i)}, {"stage", static_cast<double>(s)}};
      std::string on = lane::kMain;
      if (chunks > 1 && chunk >= 0) {
        args["virtual_stage"] = static_cast<double>(chunk * P + s);
        on = "virtual stage " + std::to_string(chunk * P + s);
      }
      timeline_->add_complete(what, wait ? "wait" : category::kCompute, on, a, b, std::move(args));
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
  // A captured step (--cuda_graph) holds its memory pool, sized for the old micro-batch, and no
  // longer matches: dropped, so the smaller retry does not have to fit beside it; the new shape
  // is captured again.
  if (graph_) {
    graph_.reset();
    graph_shape_noted_ = false;
  }
}

void Trainer::apply_update(StepMetrics& m, bool& skipped, const at::Tensor& loss_sum) {
  // A background save's copies of the weights and optimizer state (overlapped with this step's
  // forward and backward) land before the update writes them.
  staging_.fence();
  // Pruned entries get no gradient (as `orig * mask` would), before anything reads them.
  if (pruner_) pruner_->mask_gradients();
  // The gradients are read only: unscaling and clipping become one multiplier that the
  // optimizer applies inside its update.
  const std::vector<at::Tensor> grads = gradient_tensors(params_, norm_layout_);
  bool finite = scaler_->check_finite(grads, &mesh_.world());
  at::Tensor multiplier;  // undefined: 1
  at::Tensor drop;        // deferred watch: nonzero on the device drops this step's update
  if (scaler_->enabled()) multiplier = scaler_->inverse_scale();
  // Without a loss scaler the trainer itself watches for a non-finite loss or gradient norm.
  const bool watch = !scaler_->enabled();
  if (finite && (options_.clip_grad_norm > 0 || options_.report_grad_norm || watch)) {
    at::Tensor norm = global_grad_norm(params_, norm_layout_);  // of the scaled gradients
    if (watch && defer_nonfinite()) {
      drop = record_nonfinite(loss_sum, norm);  // read at the next log step (settle_nonfinite)
    } else if (watch && nonfinite_on_any_rank(loss_sum, norm)) {
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
    if (drop.defined()) {
      optimizer_->step_unless(multiplier, drop);
    } else {
      optimizer_->step(multiplier);
    }
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

bool Trainer::defer_nonfinite() const {
  return options_.defer_nonfinite_check.value_or(device_.is_cuda()) && optimizer_->skips_on_device();
}

at::Tensor Trainer::record_nonfinite(const at::Tensor& loss_sum, const at::Tensor& norm) {
  at::Tensor bad = at::logical_or(at::isfinite(loss_sum).logical_not(), at::isfinite(norm).logical_not())
                       .to(at::kFloat)
                       .reshape({1});
  // On the device with NCCL: wait() only orders this stream after the reduction.
  if (mesh_.world().size() > 1) mesh_.world().all_reduce(bad, dist::ReduceOp::kMax)->wait();
  const auto dev = at::TensorOptions().dtype(at::kDouble).device(loss_sum.device());
  if (!deferred_nonfinite_.defined()) deferred_nonfinite_ = at::zeros({6}, dev);
  // [0] dropped steps, [1] the first one, [2] its loss, [3] its gradient norm (this rank's),
  // [4] the longest run of dropped steps in a row, [5] the current run.
  at::Tensor& d = deferred_nonfinite_;
  const at::Tensor b = bad.to(at::kDouble).reshape({});
  const at::Tensor first = (d[0] == 0).to(at::kDouble) * b;
  d[5].mul_(b).add_(b);
  d[4].copy_(at::maximum(d[4], d[5]));
  d[1].add_(first * static_cast<double>(step_ + 1));
  d[2].copy_(at::where(first > 0, loss_sum.reshape({}).to(at::kDouble) / accum_steps_, d[2]));
  d[3].copy_(at::where(first > 0, norm.reshape({}).to(dev), d[3]));
  d[0].add_(b);
  deferred_pending_ = true;
  return bad;
}

void Trainer::settle_nonfinite() {
  if (!deferred_pending_) return;
  deferred_pending_ = false;
  const at::Tensor host = deferred_nonfinite_.cpu();  // the one host read of the window
  const auto a = host.accessor<double, 1>();
  const auto dropped = static_cast<int64_t>(a[0]), first = static_cast<int64_t>(a[1]);
  const auto longest = static_cast<int>(a[4]);
  consecutive_nonfinite_ = static_cast<int>(a[5]);
  deferred_nonfinite_.narrow(0, 0, 4).zero_();  // a new window; the current run goes on
  deferred_nonfinite_[4].copy_(deferred_nonfinite_[5]);
  if (dropped == 0) return;
  const bool skip = options_.on_nonfinite == NonFinitePolicy::kSkip;
  if (skip && longest <= options_.max_nonfinite_skips) {
    nonfinite_skips_ += dropped;
    LOG_IF(WARNING, mesh_.world().rank() == 0)
        << dropped << " step(s) up to step " << step_ << " had a non-finite loss or gradient norm (the first: step "
        << first << "); their updates were dropped on the device on every rank (" << nonfinite_skips_
        << " skipped so far, at most " << longest << " in a row, --on_nonfinite=skip)";
    return;
  }
  stop_for_nonfinite(first, a[2], a[3], longest,
                     " (found at the log of step " + std::to_string(step_) +
                         "; that step's and every later non-finite step's update was dropped on the device)");
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
  stop_for_nonfinite(step, loss_sum.item<double>() / accum_steps_, norm.item<double>(), consecutive_nonfinite_, "");
}

void Trainer::stop_for_nonfinite(int64_t step, double loss, double norm, int run, const std::string& found) {
  const bool skip = options_.on_nonfinite == NonFinitePolicy::kSkip;
  std::string newest = "no checkpoint was saved";
  if (!options_.save_dir.empty()) {
    wait_for_save();  // a background save in flight is the newest checkpoint once published
    CheckpointStoreOptions so;
    so.fs = options_.checkpoint_fs;
    std::vector<CheckpointInfo> saved = CheckpointStore(options_.save_dir, so).list();
    if (!saved.empty()) newest = "the newest checkpoint is " + saved.front().path + " (resume from it, e.g. with a lower --lr)";
  }
  std::ostringstream os;
  os << "step " << step << ": the loss is " << loss << " and the gradient norm " << norm << " on rank "
     << mesh_.world().rank() << " (a non-finite value on some rank)" << found;
  if (skip) {
    os << "; " << run << " steps in a row were not finite (--on_nonfinite=skip allows "
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
  if (options_.memory_report_step == step_ + 1) {
    // The report is of this step's peak: the run's so far is kept for the metrics' mem_peak_mb.
    peak_before_report_mb_ = std::max(peak_before_report_mb_, memory_stats(device_).peak_mb);
    reset_peak_memory(device_);
  }
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
  // The gradients at the end of backward (a lone rank's are freed after the update).
  step_gradients_mb_ = static_cast<double>(tensor_bytes(gradient_tensors(params_, norm_layout_), device_)) /
                       (1024.0 * 1024.0);
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
  // Context-parallel ranks each hold the mean over their tokens (as many on each): the replicas'
  // average is the global batch's mean.
  pending_loss_ = mesh_.replicas().size() > 1 ? mesh_.replicas().all_reduce(loss, dist::ReduceOp::kAvg)
                                              : dist::completed_work(mesh_.replicas().issued());
  pending_loss_tensor_ = loss;
  result.step = step_;
  result.skipped = skipped;
  result.loss = std::numeric_limits<double>::quiet_NaN();
  m.step = step_;
  m.accum_steps = accum_steps_;
  last_ = m;
  return result;
}

void Trainer::flush_updates() {
  staging_.fence();  // the delayed update writes the weights a background save may still copy
  if (optimizer_) optimizer_->flush();
}

MemoryReport Trainer::memory_report() const {
  MemoryReport r = build_memory_report(device_, params_, gradient_tensors(params_, norm_layout_),
                                       optimizer_ ? optimizer_->device_state() : std::vector<at::Tensor>{},
                                       step_start_allocated_mb_, step_peak_mb_, {}, step_gradients_mb_);
  if (const int64_t host = optimizer_ ? optimizer_->host_bytes() : 0) {
    r.host_offload_mb = static_cast<double>(host) / (1024.0 * 1024.0);
  }
  r.host_staging_mb = static_cast<double>(staging_.pinned_bytes()) / (1024.0 * 1024.0);
  if (device_.is_cpu() && r.host_offload_mb + r.host_staging_mb > 0) {
    r.notes.push_back("training on the CPU, the host rows are this device's memory too: they are inside 'other' and "
                      "the peak above, not beside them (on a GPU they are outside the device's total)");
  }
  return r;
}

}  // namespace dtrain::engine
