// The Trainer's construction apart from its loop (trainer_setup.h).
#include "trainer_setup.h"

#include <sstream>

#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/optim/sparse_optim.h"

namespace dtrain::engine::trainer_setup {

Settings settings_of(const TrainerOptions& o) {
  const OptimizerOptions& opt = o.optimizer;
  Settings s = {
      {"steps", setting_text(o.steps)}, {"accum_steps", setting_text(o.accum_steps)}, {"amp", to_string(o.amp)},
      {"param_dtype", c10::toString(o.param_dtype)},
      {"optimizer", opt.name}, {"lr", setting_text(opt.lr)}, {"weight_decay", setting_text(opt.weight_decay)},
      {"momentum", setting_text(opt.momentum)}, {"dampening", setting_text(opt.dampening)}, {"nesterov", setting_text(opt.nesterov)},
      {"beta1", setting_text(opt.beta1)}, {"beta2", setting_text(opt.beta2)}, {"eps", setting_text(opt.eps)},
      {"amsgrad", setting_text(opt.amsgrad)}, {"lr_decay", setting_text(opt.lr_decay)},
      {"initial_accumulator_value", setting_text(opt.initial_accumulator_value)},
      {"schedule", o.schedule.name}, {"warmup_steps", setting_text(o.schedule.warmup_steps)},
      {"total_steps", setting_text(o.schedule.total_steps)}, {"min_lr_ratio", setting_text(o.schedule.min_lr_ratio)},
      {"clip_grad_norm", setting_text(o.clip_grad_norm)}, {"report_grad_norm", setting_text(o.report_grad_norm)},
      {"eval_every", setting_text(o.eval_every)}, {"eval_samples", setting_text(o.eval_samples)},
      {"oom_backoff", setting_text(o.oom_backoff)}, {"offload_optimizer", setting_text(o.offload_optimizer)},
      // Under ZeRO-3 a recomputed block gathers its unit again: ranks that recompute different
      // blocks would issue different collectives.
      {"checkpoint_activations", setting_text(o.checkpoint_activations)},
      {"checkpoint_blocks", setting_text(o.checkpoint_blocks)},
      {"offload.stream_gradients", o.offload.stream_gradients},
      {"offload.delayed_update_after", setting_text(o.offload.delayed_update_after)},
      {"offload.reduce_to_owner", setting_text(o.offload.reduce_to_owner)},
      {"reducer.bucket_bytes", setting_text(o.reducer.bucket_bytes)},
      {"reducer.first_bucket_bytes", setting_text(o.reducer.first_bucket_bytes)},
      {"reducer.compress", o.reducer.compress ? c10::toString(*o.reducer.compress) : "off"},
      {"reducer.find_unused_parameters", setting_text(o.reducer.find_unused_parameters)},
      {"save_every", setting_text(o.save_every)}, {"keep_last", setting_text(o.keep_last)}, {"resume", to_string(o.resume)},
      {"save_dir_exists", to_string(o.save_dir_exists)},
      {"saves checkpoints", setting_text(!o.save_dir.empty())}, {"handle_preemption", setting_text(o.handle_preemption)},
      {"on_nonfinite", o.on_nonfinite == NonFinitePolicy::kStop ? "stop" : "skip"},
      {"max_nonfinite_skips", setting_text(o.max_nonfinite_skips)}, {"pipeline.schedule", to_string(o.pipeline.schedule)}};
  if (o.amp == AmpMode::kFp16) {
    s.push_back({"loss_scaler.init_scale", setting_text(o.loss_scaler.init_scale)});
    s.push_back({"loss_scaler.growth_interval", setting_text(o.loss_scaler.growth_interval)});
  }
  return s;
}

namespace {

// What --shard=parameters does not combine with yet.
void check_parameter_sharding(const TrainerOptions& o, bool sparse, int pp_size) {
  const char* other = o.prune.amount > 0               ? "--prune_amount"
                      : sparse                         ? "sparse embedding gradients"
                      : o.oom_backoff && pp_size > 1   ? "--pp and OOM back-off (TrainerOptions::oom_backoff: a "
                                                         "stage that fails would still owe its data-parallel peers "
                                                         "its unit gathers)"
                                                       : nullptr;
  DTRAIN_CHECK(other == nullptr, "--shard=parameters (ZeRO-3) with ", other ? other : "",
               " is not supported yet; use --shard=gradients, or drop ", other ? other : "");
}

// The trained parameters split into those with sparse gradients (embeddings built sparse: they
// bypass the buckets and the flat optimizers) and the dense ones the reducer takes.
struct SparseSplit {
  std::vector<bool> sparse;  // per trained parameter
  std::vector<at::Tensor> dense_params, sparse_params;
  std::vector<std::string> dense_names;
  SparseReducerOptions sparse_options;
};

SparseSplit split_sparse(const UpdateInputs& in) {
  SparseSplit s;
  const std::vector<at::Tensor>& params = in.trained.params;
  s.sparse = sparse_gradient_flags(in.model, params);
  s.sparse_options = in.options.sparse_reducer;
  for (size_t i = 0; i < params.size(); ++i) {
    if (s.sparse[i]) {
      s.sparse_params.push_back(params[i]);
      s.sparse_options.names.push_back(in.trained.names[i]);
    } else {
      s.dense_params.push_back(params[i]);
      s.dense_names.push_back(in.trained.names[i]);
    }
  }
  return s;
}

// Sparse gradients: their reducer (row-wise averages) and an optimizer with a sparse rule.
void build_sparse(const UpdateInputs& in, ShardMode shard, SparseSplit& s, ReducerOptions& reducer_options,
                  UpdateParts& parts) {
  const TrainerOptions& o = in.options;
  const auto& tied = in.trained.tied;
  const std::string& first = s.sparse_options.names.front();
  DTRAIN_CHECK(tied.empty(), "sparse embedding gradients (", first, ") with tied parameters ('",
               tied.empty() ? "" : tied.front().first, "' is '", tied.empty() ? "" : tied.front().second,
               "'): a tied embedding's gradient is dense where the other use touches it; drop --sparse_embedding or "
               "untie the parameters");
  DTRAIN_CHECK(!o.offload_optimizer && shard == ShardMode::kNone, "sparse embedding gradients (", first, ") with ",
               o.offload_optimizer ? "--offload=optimizer" : "--shard",
               ": the partitioned optimizers keep one flat dense gradient space; drop --sparse_embedding, or "
               "train without partitioning the optimizer");
  DTRAIN_CHECK(reducer_options.owned.empty() && !reducer_options.bucket_comm && !reducer_options.compress,
               "sparse embedding gradients with a custom bucket strategy are not supported");
  DTRAIN_CHECK(!s.dense_params.empty(), "every trainable parameter has sparse gradients; the trainer needs at least "
               "one dense parameter");
  reducer_options.names = s.dense_names;
  parts.sparse_reducer = std::make_unique<SparseGradReducer>(s.sparse_params, in.mesh.replicas(), s.sparse_options);
  try {
    parts.optimizer = make_sparse_aware_optimizer(in.trained.params, s.sparse, o.optimizer);
  } catch (const Error& e) {
    throw Error(detail::concat("sparse gradients (", first, ", --sparse_embedding): ", e.what(),
                               ". Optimizers that take sparse gradients: adagrad with --weight_decay=0, "
                               "adam or adamw (SparseAdam's rule on those rows; weight decay only on the others), "
                               "sgd without momentum (the command line's sgd has momentum 0.9)"));
  }
  LOG_IF(INFO, in.mesh.world().rank() == 0)
      << s.sparse_params.size() << " parameter(s) with sparse gradients (" << first
      << (s.sparse_params.size() > 1 ? ", ..." : "") << "): averaged row-wise after backward, updated "
      << "only where touched (" << o.optimizer.name << "'s sparse rule)";
}

// ZeRO-3: the optimizer owns the weights' storage, the units gather them per use, and the
// reducer reduce-scatters each unit's gradients into the optimizer's shard.
void build_parameter_sharding(const UpdateInputs& in, ReducerOptions& reducer_options, UpdateParts& parts) {
  const TrainerOptions& o = in.options;
  check_parameter_sharding(o, false, in.mesh.pp_size());
  DTRAIN_CHECK(!reducer_options.compress && !reducer_options.bucket_comm && reducer_options.owned.empty(),
               "--shard=parameters reduce-scatters each unit's gradients in the weights' dtype: drop the reducer's "
               "compression (--compress_gradients) or custom bucket strategy");
  std::vector<size_t> starts = unit_starts_of(in.trained.names, o.shard_unit_starts, in.tp_sharded);
  if (o.offload_optimizer) {  // the ZeRO-Offload layout of stage 3
    const char* other = o.offload.delayed_update_after >= 0 ? "--offload_delayed_update_after"
                        : parse_stream_gradients(o.offload.stream_gradients) == StreamGradients::kOn
                            ? "--offload_stream_gradients=on"
                            : nullptr;
    DTRAIN_CHECK(other == nullptr, "--shard=parameters --offload=optimizer with ", other ? other : "",
                 " is not supported yet (each rank copies its gradient shard to the host after backward and "
                 "updates it there); drop ", other ? other : "");
  }
  auto zero3 = std::make_unique<Zero3Optimizer>(in.trained.params, o.optimizer, in.mesh.replicas(), std::move(starts),
                                                o.offload_optimizer ? &o.offload : nullptr);
  reducer_options.bucket_comm = zero3->bucket_comm();
  parts.partitioned = true;
  parts.owned = zero3->shard_layout()->ranges;
  parts.owned_values = zero3->gradient_shard();
  parts.owned_at = zero3->shard_positions();
  parts.units = std::make_unique<ParameterUnits>(*zero3);
  parts.optimizer = std::move(zero3);
  LOG_IF(INFO, in.mesh.world().rank() == 0)
      << "--shard=parameters: " << parts.units->units() << " units gathered per use (one all_gather each), their "
      << "gradients reduce-scattered; this rank keeps 1/" << in.mesh.replicas().size()
      << " of the weights, gradients and optimizer state between steps"
      << (o.offload_optimizer ? " (the optimizer state and float32 master on the host)" : "");
}

// A partitioned optimizer reads only its rank's range: each gradient is reduced to its owner.
void reduce_to_owners(const UpdateInputs& in, ShardMode shard, ReducerOptions& reducer_options, UpdateParts& parts) {
  if (!reducer_options.owned.empty()) return;
  for (const FlatRange& r : parts.optimizer->gradient_owners()) reducer_options.owned.emplace_back(r.begin, r.end);
  if (reducer_options.owned.empty()) return;
  const auto& mine = reducer_options.owned[in.mesh.replicas().rank()];
  parts.partitioned = true;
  parts.owned = {FlatRange{mine.first, mine.second}};
  // ZeRO-2: the gradients outside this rank's range are not kept between steps.
  reducer_options.release_unowned = shard == ShardMode::kGradients;
  LOG_IF(INFO, in.mesh.world().rank() == 0)
      << "each gradient is reduced only to the rank whose shard holds it (the optimizer's, "
      << reducer_options.owned.size() << " shards)"
      << (reducer_options.release_unowned ? "; the other ranks' gradient buckets are released once reduced" : "");
}

}  // namespace

void check_param_dtype(const TrainerOptions& o) {
  if (o.param_dtype == at::kFloat) return;
  const std::string name = c10::toString(o.param_dtype);
  DTRAIN_CHECK(o.param_dtype == at::kBFloat16, "--param_dtype=", name, ": the trained weights are float32 or bfloat16");
  DTRAIN_CHECK(o.offload_optimizer || parse_shard_mode(o.shard) != ShardMode::kNone, "--param_dtype=bfloat16 with ",
               "a replicated optimizer would update the bfloat16 weights themselves (no float32 master): add "
               "--offload=optimizer (the master and state on the host, ZeRO-Offload) or --shard=optimizer (the "
               "master on the device, partitioned over the data-parallel ranks; all of it at one rank)");
  DTRAIN_CHECK(o.amp != AmpMode::kFp16, "--param_dtype=bfloat16 with --amp=fp16: float16 autocast over bfloat16 "
               "weights; use --amp=bf16 or --amp=off");
  DTRAIN_CHECK(o.prune.amount <= 0, "--param_dtype=bfloat16 with --prune_amount is not supported yet; drop one");
}

// The interleaved schedule: data and context parallelism beside it (each chunk's gradients
// reduced from its own last backward: run_pipeline), ZeRO 1-3 and offload (they take the stage's
// parameters as a set, whatever chunk each belongs to).
static void check_interleaved_options(const TrainerOptions& o, const dist::Mesh& mesh) {
  const int P = mesh.pp_size();
  DTRAIN_CHECK(o.pipeline.chunks >= 2 && o.pipeline.chunk_forward, "--pp_schedule=interleaved needs at least 2 model "
               "chunks per stage (--pp_chunks, TrainerOptions::pipeline.chunks, got ", o.pipeline.chunks,
               ") and pipeline.chunk_forward (a trainer built from a ModelSpec sets it)");
  DTRAIN_CHECK(o.accum_steps % P == 0, "--pp_schedule=interleaved runs the micro-batches ", P, " at a time (one per "
               "stage), but the step has ", o.accum_steps, " (--accum_steps); use a multiple of ", P);
}

void check_pipeline_options(const TrainerOptions& o, const dist::Mesh& mesh) {
  const int P = mesh.pp_size();
  DTRAIN_CHECK(o.pipeline.forward && o.pipeline.activation_shape, "a mesh of ", P, " pipeline stages needs ",
               "TrainerOptions::pipeline.forward and .activation_shape (this stage's computation and what it sends); ",
               "build the trainer with them, or with one stage");
  const char* unsupported = o.prune.amount > 0                       ? "--prune_amount"
                            : o.eval_loss_and_correct                  ? "an evaluation that counts correct predictions"
                            : o.offload.delayed_update_after >= 0      ? "--offload_delayed_update_after"
                                                                       : nullptr;
  DTRAIN_CHECK(unsupported == nullptr, unsupported ? unsupported : "", " with pipeline parallelism (--pp=", P,
               ") is not supported yet; train with --pp=1, or without ", unsupported ? unsupported : "");
  if (o.pipeline.schedule == PipelineSchedule::kInterleaved) check_interleaved_options(o, mesh);
  // The weight half of a split backward runs after the blocks' streamed weights went back to
  // the host (layer offload keeps one block's weights on the device at a time).
  DTRAIN_CHECK(!(o.pipeline.schedule == PipelineSchedule::kZeroBubble && o.offload_layers), "--pp_schedule=zb "
               "with layer offload (--offload=layers) is not supported: the weight gradients are computed after the "
               "streamed weights left the device; use --pp_schedule=1f1b");
}

UpdateParts build_update(const UpdateInputs& in, ReducerOptions reducer_options) {
  const TrainerOptions& o = in.options;
  const ShardMode shard = parse_shard_mode(o.shard);
  const std::vector<at::Tensor>& params = in.trained.params;
  SparseSplit split = split_sparse(in);
  UpdateParts parts;
  if (!split.sparse_params.empty()) {
    build_sparse(in, shard, split, reducer_options, parts);
  } else if (shard == ShardMode::kParameters) {
    build_parameter_sharding(in, reducer_options, parts);
  } else if (o.offload_optimizer) {
    parts.optimizer = make_offload_optimizer(params, o.optimizer, in.mesh.replicas(), o.offload, in.device);
  } else if (o.offload_layers && o.offload.delayed_update_after >= 0) {
    DTRAIN_CHECK(shard == ShardMode::kNone, "--offload=layers --offload_delayed_update_after with --shard=", o.shard,
                 " is not supported: the streamed blocks' delayed update is one rank's; drop --shard, or use "
                 "--offload=all");
    parts.optimizer = make_layer_offload_optimizer(params, o.offload_streamed, o.optimizer, in.mesh.replicas(),
                                                   o.offload, in.device);
  } else if (shard != ShardMode::kNone) {
    parts.optimizer = std::make_unique<ShardedOptimizer>(params, o.optimizer, in.mesh.replicas());
  } else {
    const at::ScalarType dtype = params.front().scalar_type();
    LOG_IF(WARNING, in.mesh.world().rank() == 0 && (dtype == at::kBFloat16 || dtype == at::kHalf))
        << "the model's weights are " << c10::toString(dtype) << " and the replicated optimizer updates them in "
        << "place with no float32 master (as torch.optim does): an update smaller than half a " << c10::toString(dtype)
        << " step of a weight is lost. For a float32 master build the model in float32 and pass --param_dtype=bf16 "
        << "(TrainerOptions::param_dtype) with --shard=optimizer or --offload=optimizer";
    parts.optimizer = make_optimizer(params, o.optimizer);
  }
  reduce_to_owners(in, shard, reducer_options, parts);
  parts.reducer = std::make_unique<GradReducer>(parts.sparse_reducer ? split.dense_params : params, in.mesh.replicas(),
                                                reducer_options);
  parts.optimizer->attach(*parts.reducer);
  if (o.prune.amount > 0) {
    DTRAIN_CHECK(!(o.offload_optimizer || o.offload_layers) || o.offload.delayed_update_after < 0,
                 "--prune_amount with --offload_delayed_update_after: the delayed update writes the weights after the "
                 "masks are applied; prune without the delayed update");
    parts.pruner = std::make_unique<Pruner>(in.model, o.prune, in.specs, in.mesh.tp());
  }
  return parts;
}

std::vector<int64_t> stage_flat_numels(const dist::Mesh& mesh, const Optimizer& optimizer,
                                       const std::vector<at::Tensor>& params, c10::Device device) {
  const std::optional<ShardLayout> layout = optimizer.shard_layout();
  int64_t flat = 0;
  for (const at::Tensor& p : params) flat += p.numel();
  if (layout) flat = layout->numel;
  const std::vector<int64_t> all = dist::all_gather_counts(mesh.world(), flat, device);
  const int T = mesh.tp_size(), D = mesh.replicas().size();  // a stage: D replicas (dp x cp) of T ranks
  std::vector<int64_t> out;
  for (int s = 0; s < mesh.pp_size(); ++s) {
    for (int t = 0; t < T; ++t) out.push_back(all[static_cast<size_t>((s * D) * T + t)]);
  }
  return out;
}

Observers make_observers(const TrainerOptions& o, const dist::Mesh& mesh, c10::Device device) {
  Observers obs;
  const int rank = mesh.world().rank(), size = mesh.world().size();
  obs.metrics = o.resume != ResumeMode::kNo ? MetricsWriter::open_append(o.metrics_path, rank == 0)
                                            : std::make_unique<MetricsWriter>(o.metrics_path, rank == 0);
  obs.tensorboard = std::make_unique<EventWriter>(o.tensorboard_dir, rank == 0 && !o.tensorboard_dir.empty());
  TimelineOptions timeline;
  timeline.enabled = !o.timeline_path.empty();
  timeline.rank = rank;
  if (timeline.enabled) timeline.path = timeline_path_for_rank(o.timeline_path, rank, size);
  obs.timeline = std::make_unique<Timeline>(timeline);
  obs.profiler = std::make_unique<StepProfiler>(parse_profile_steps(o.profile_steps),
                                                timeline_path_for_rank(o.profile_path, rank, size), device);
  return obs;
}

}  // namespace dtrain::engine::trainer_setup

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
  trainer_setup::check_param_dtype(o);
}

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

void Trainer::check_tied_parameters(const std::vector<std::pair<std::string, std::string>>& tied) const {
  const std::string pair = "'" + tied.front().first + "' is '" + tied.front().second + "'";
  // Under tensor parallelism a tie holds when both names split the tensor alike (a
  // vocabulary-parallel embedding and the padded column-parallel head of the same vocabulary):
  // each rank's slice serves both uses, and its gradient is the sum of both.
  bool split_alike = true;
  if (mesh_.tp_size() > 1) {
    const std::map<std::string, ShardSpec> specs = collect_shard_specs(model_);
    for (const auto& [second, first] : tied) {
      auto a = specs.find(second), b = specs.find(first);
      split_alike = split_alike && (a == specs.end()) == (b == specs.end()) &&
                    (a == specs.end() || to_text(a->second) == to_text(b->second));
    }
  }
  const char* mode = mesh_.pp_size() > 1 ? "--pp > 1 (the two names may live on different stages)"
                     : !split_alike      ? "--tp > 1 (the two names split the tensor differently over the ranks)"
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
      const std::vector<std::string> unrecorded = store.unrecorded();
      if (found.empty() && !unrecorded.empty() && options_.save_dir_exists == SaveDirExists::kError) {
        refused = "--save_dir=" + options_.save_dir + " holds " + std::to_string(unrecorded.size()) +
                  " checkpoint file(s) without their checksum records (newest: " + unrecorded.front() +
                  "): checkpoints copied without their .crc files, or saves that did not finish. This run starts "
                  "fresh (--resume=no) and would overwrite or prune them: copy the .crc files too and continue "
                  "with --resume=auto, start over with --save_dir_exists=overwrite (removes them), or give another "
                  "--save_dir";
      } else if (found.empty() && !unrecorded.empty() && options_.save_dir_exists == SaveDirExists::kOverwrite) {
        LOG(WARNING) << "--save_dir_exists=overwrite: removing " << unrecorded.size()
                     << " checkpoint file(s) without records from " << options_.save_dir;
        store.remove_all();
      } else if (found.empty() && !unrecorded.empty()) {
        resume = true;  // --save_dir_exists=resume: the resume says that none of them is good
      }
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

}  // namespace dtrain::engine
