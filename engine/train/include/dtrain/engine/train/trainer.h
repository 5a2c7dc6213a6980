// The training loop a user would otherwise write, done right: data-parallel averaging,
// accumulation, AMP, clipping, schedule, evaluation, OOM back-off and metrics.
//
// One optimizer step on this rank:
//   the rank's batch (batch_size rows) is split into accum_steps micro-batches; for each,
//   forward under autocast, loss / accum_steps (times the loss scale for fp16) backward, with
//   the reducer in no_sync until the last micro-batch; then the gradients are averaged over
//   the data-parallel group (or reduced to their owners for a partitioned optimizer), their
//   global norm is taken, and the optimizer steps with one multiplier, 1 / loss scale x the
//   clipping coefficient, applied inside its update: the trainer never rewrites a gradient
//   (a step whose fp16 gradients overflowed is skipped). Outputs, loss and graph of each
//   micro-batch are released before the next one and before the optimizer step.
// The logged loss is the mean over the global batch (all data-parallel ranks, all
// micro-batches), so 1 x 64, 4 x 16 and 2 ranks x 2 x 16 log the same curve.
//
// Threading: one thread drives a Trainer. Collectives: every rank of the mesh must call
// step() / fit() the same number of times.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <future>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/state/dir_lock.h"
#include "dtrain/engine/state/host_staging.h"
#include "dtrain/engine/state/training_state.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/engine/parallel/pipeline.h"
#include "dtrain/engine/memory/memory_report.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/observe/metrics.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/prune.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/engine/parallel/sparse_reducer.h"
#include "dtrain/engine/observe/tensorboard.h"
#include "dtrain/engine/observe/profiler.h"
#include "dtrain/engine/observe/timeline.h"
#include "dtrain/engine/train/graphed_loss.h"

namespace dtrain::engine {

class ParameterUnits;  // zero3/parameter_units.h

// What fit() does when a step's loss or gradient norm is not finite (fp32 and bf16; with fp16
// the loss scaler skips overflowing steps and lowers the scale).
enum class NonFinitePolicy {
  kStop,  // end before the optimizer step with dtrain::Error naming the step and the newest checkpoint
  kSkip,  // drop the step on every rank, count it, go on (up to max_nonfinite_skips in a row)
};
// "stop", "skip" (--on_nonfinite); throws dtrain::Error naming the accepted values otherwise.
NonFinitePolicy parse_on_nonfinite(const std::string& text);

// Whether fit() starts from a checkpoint in save_dir.
enum class ResumeMode {
  kNo,    // start at step 1 (a checkpoint already in save_dir is overwritten as the run goes)
  kYes,   // continue from the newest good checkpoint; dtrain::Error if there is none
  kAuto,  // continue from the newest good checkpoint if there is one, else start at step 1: the
          // same command line for a first launch and every requeue
};
// "no"/"false"/"0", "yes"/"true"/"1", "auto" (--resume; a bare --resume means yes); throws
// dtrain::Error naming the accepted values otherwise.
ResumeMode parse_resume(const std::string& text);
const char* to_string(ResumeMode mode);

// What a fresh start (ResumeMode::kNo) does when save_dir already holds checkpoints (of an
// earlier run: its steps would sit beside this run's, and a later resume would pick whichever
// is newest, the other run's included, without a word).
enum class SaveDirExists {
  kError,      // dtrain::Error naming the directory, its newest checkpoint and the choices
  kOverwrite,  // remove the earlier checkpoints first (logged), then start at step 1
  kResume,     // continue from them, as ResumeMode::kAuto
};
// "error", "overwrite", "resume" (--save_dir_exists); dtrain::Error naming them otherwise.
SaveDirExists parse_save_dir_exists(const std::string& text);
const char* to_string(SaveDirExists mode);

// Pipeline parallelism (a mesh with pp_size() > 1; engine/parallel/pipeline.h): this rank's
// model is one stage of the whole, and every step runs the rank's accum_steps micro-batches
// through the stages by `schedule`. The trainer's LossFn is not used then: `forward` is.
struct PipelineOptions {
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // The stage's computation on one micro-batch: the first stage gets an undefined x and reads
  // its input from the micro-batch; every other stage gets the activation the stage before
  // sent. The last stage returns the micro-batch's mean loss (a scalar; it reads its targets
  // from the micro-batch), every other stage the activation it sends on. Called under the
  // trainer's autocast; the activation is sent as activation_dtype (cast when it differs).
  std::function<at::Tensor(const at::Tensor& x, const Batch& micro)> forward;
  // The shape of the activation a stage sends for a micro-batch of `rows` rows.
  std::function<std::vector<int64_t>(int64_t rows)> activation_shape;
  at::ScalarType activation_dtype = at::kFloat;
  // The interleaved schedule (kInterleaved): the stage's model chunks (>= 2; virtual stage c P +
  // stage), and chunk_forward(x, micro, c) instead of forward (chunk c of stage 0 reads the
  // micro-batch when c = 0; chunk chunks - 1 of the last stage returns the loss). A spec-built
  // trainer sets both from its split; the schedule needs accum_steps a multiple of the stages.
  int chunks = 1;
  std::function<at::Tensor(const at::Tensor& x, const Batch& micro, int chunk)> chunk_forward;
  // The zero-bubble schedule (kZeroBubble): the forward, input-gradient and weight-gradient
  // costs its lists are ordered at (PipelineStep::costs; unit by default). A stage's B costing
  // more than its F and its W less (the usual case) orders the W's differently and shortens the
  // step; dtrain-plan --simulate prints the costs it priced a zb layout at.
  PipelineCosts zb_costs;
};

struct TrainerOptions {
  int64_t steps = 100;            // optimizer steps fit() runs to
  int accum_steps = 1;            // micro-batches per step (must divide the batch)
  AmpMode amp = AmpMode::kOff;
  // The dtype of the trained weights (--param_dtype, parse_param_dtype()): the trainer casts
  // the model's floating-point parameters to it before anything else reads them (buffers keep
  // theirs). bfloat16 is ZeRO-Offload's layout with offload_optimizer: bfloat16 weights and
  // gradients on the device, the float32 master weights and the state on the host, gradients
  // copied to the host in bfloat16. It needs an optimizer that keeps float32 master weights:
  // offload_optimizer or a partitioned one (shard "optimizer", "gradients", "parameters"; at
  // one rank that is the whole master on the device); the replicated optimizer would update
  // the bfloat16 weights themselves, so the trainer refuses it (and --amp=fp16, pruning).
  at::ScalarType param_dtype = at::kFloat;
  LossScalerOptions loss_scaler;  // used with fp16 (enabled is forced on then, off otherwise)
  OptimizerOptions optimizer;
  ScheduleOptions schedule;
  double clip_grad_norm = 0;      // 0: no clipping (the norm is still reported)
  bool report_grad_norm = true;
  // A non-finite loss or gradient norm, agreed across ranks before the optimizer step: the
  // weights are never updated from it, so no checkpoint holds non-finite weights.
  NonFinitePolicy on_nonfinite = NonFinitePolicy::kStop;
  int max_nonfinite_skips = 10;   // kSkip: stop after this many consecutive skipped steps
  // Watch without a host read per step: each step's non-finite flag is agreed and recorded on
  // the device and its update dropped there (the fused Adam/AdamW kernels' found_inf,
  // Optimizer::skips_on_device()), and on_nonfinite is applied when the host next reads the
  // loss (a log step, the end of fit(), a save, last_loss()): kStop then throws naming the
  // first such step (the weights hold no update of it or of any later non-finite step); kSkip
  // counts them and throws past max_nonfinite_skips in a row. Unset: on CUDA (where a host
  // read stalls the device's queue); false, or an optimizer that cannot drop an update on
  // the device: the step is checked on the host before its update.
  std::optional<bool> defer_nonfinite_check;
  int64_t log_every = 10;         // metrics line at step 1, every this many steps, and the last
  int64_t eval_every = 0;         // 0: never; else evaluate every this many steps
  // The held-out set every evaluation of fit() scores: the first eval_samples samples of the
  // evaluation loader's epoch-0 order (DataLoader::evaluation_order), 0: the whole split. The
  // same samples at every evaluation of a run and for every layout (rank count, batch size,
  // tp, pp, sharding), so eval_loss values are comparable across evaluations and runs.
  int64_t eval_samples = 0;
  // Classifiers: an evaluation batch's mean loss and its number of correct predictions (scalar
  // tensors, from one forward). When set, evaluate() uses it instead of the loss function and
  // fit() logs eval_accuracy = correct / rows over every evaluated batch of every
  // data-parallel rank.
  std::function<std::pair<at::Tensor, at::Tensor>(const Batch& batch)> eval_loss_and_correct;
  bool eval_perplexity = false;  // language models: fit() also logs eval_perplexity = exp(eval_loss)
  std::string metrics_path;       // JSON lines (rank 0); empty: none
  bool progress = true;           // console progress on rank 0
  // On c10::OutOfMemoryError inside forward/backward: drop the step, release cached memory,
  // halve the micro-batch (doubling accum_steps, so the global batch is unchanged), agree
  // across ranks, retry the same batch. Needs tensor-parallel size 1. Under --shard=parameters
  // (ZeRO-3) the failing rank first runs the step again on one row per micro-batch, taking part
  // in the unit gathers and gradient reductions it still owes the others (one pipeline stage
  // only: with --pp the trainer refuses it).
  bool oom_backoff = true;
  // CUDA graphs (train/graphed_loss.h): from step cuda_graph_after_steps + 1 on, the loss
  // function's forward and backward are replayed from two captured graphs instead of launched
  // kernel by kernel. Refused with a logged reason (the step then runs eagerly) where the
  // capture cannot hold: not CUDA, tensor or pipeline parallelism, ZeRO-3's units, layer
  // offload, activation checkpointing, sparse gradients, or a failed capture. The reducer,
  // accumulation and the optimizer run as without graphs (the gradients are reduced after the
  // backward replay, not overlapped with it).
  bool cuda_graph = false;
  int64_t cuda_graph_after_steps = 2;
  // fit() counts the host's synchronizations with the CUDA device in each step (the batch's
  // loading included, the log steps' own reads not) and logs them with each logged step:
  // c10's sync debug mode (torch.cuda.set_sync_debug_mode("warn")). For finding host waits.
  bool count_host_syncs = false;
  int64_t tokens_per_sample = 0;  // > 0: report tokens_per_s
  ReducerOptions reducer;
  PipelineOptions pipeline;  // with a mesh of more than one pipeline stage (above)
  // Parameters with sparse gradients (sparse_gradient_flags(): embeddings built sparse) are
  // kept out of the reducer's buckets and averaged by a SparseGradReducer after the
  // synchronized backward, and updated by make_sparse_aware_optimizer() (only the touched rows).
  SparseReducerOptions sparse_reducer;
  // Optimizer offload (engine/offload.h): fp32 master weights and state in host memory,
  // partitioned over the data-parallel group, gradients streamed to the host during
  // backward on a GPU, optionally the delayed update (offload.delayed_update_after). Layer
  // offload is the model's part (offload::LayerStreamer, e.g. the example GPT's blocks).
  bool offload_optimizer = false;
  OffloadOptions offload;
  // Sharded data parallelism (optim/sharded.h): "none"; "optimizer" (ZeRO-1: the optimizer
  // state and fp32 master weights partitioned across the data-parallel group on the device,
  // gradients reduced to their owners, the updated shards all-gathered); "gradients" (ZeRO-2:
  // that, and each gradient bucket no element of which this rank owns is released once it is
  // reduced, ReducerOptions::release_unowned). With offload_optimizer the optimizer state is
  // partitioned already (in host memory); "gradients" then still releases the device buckets.
  std::string shard = "none";
  // --shard=parameters (ZeRO-3): where the model's units begin, as parameter-name prefixes (a
  // unit begins at the first parameter whose name starts with each of them and runs to the
  // next unit's first; the first parameter must begin one), e.g. {"wte.", "blocks.0.",
  // "blocks.1.", "ln_f."}. The model then runs each unit's forward through
  // Trainer::parameter_units() (ParameterUnits::run, or its parts with activation
  // checkpointing), in unit order.
  std::vector<std::string> shard_unit_starts;
  // A trainer built from a ModelSpec applies these to the model's blocks (models/model_spec.h):
  // each block recomputed in backward, each block's weights streamed from host memory, and
  // under a pipeline (mesh pp > 1) the blocks per stage ("a,b,...": pipeline_stage_bounds; "":
  // the even rule). A trainer built from a module and a LossFn leaves them to the model.
  bool checkpoint_activations = false;
  int checkpoint_blocks = -1;  // with it: the first N blocks of each stage recomputed (-1: all)
  bool offload_layers = false;
  // A trainer built from a module and a LossFn cannot find the module's blocks: it refuses
  // checkpoint_activations and offload_layers (a command line's --checkpoint_activations or
  // --offload=layers would do nothing) unless the module applies them itself and says so here
  // (dtrain's example models do). A ModelSpec's trainer applies them.
  bool model_applies_block_techniques = false;
  std::string pp_blocks;
  // Layer offload with the delayed update (offload_layers, offload.delayed_update_after >= 0):
  // the streamed blocks' parameters, updated on the host one step late
  // (make_layer_offload_optimizer; with offload_optimizer, make_offload_optimizer's host part).
  // On one rank the trainer then waits for their gradients' copies to the host once per
  // backward, not after each block. A trainer built from a ModelSpec sets it; with a module
  // and a LossFn, list the parameters your own offload::LayerStreamer streams (on a GPU those
  // living on the host are found without it).
  std::vector<at::Tensor> offload_streamed;
  // Magnitude pruning (optim/prune.h; --prune_amount, --prune_scope, --prune_at_step,
  // --prune_from_step/--prune_to_step/--prune_every): masks chosen before the scheduled steps'
  // forward, applied to gradients before and weights after every update, saved in checkpoints.
  PruneOptions prune;
  // Evaluation only (--eval_only): no optimizer state, gradient buffers or reducer are
  // allocated, and no lock is taken on save_dir (resume_checkpoint() reads the newest good
  // checkpoint's weights to evaluate, also while a training run writes there). step(), fit()
  // and saving throw dtrain::Error.
  bool evaluation_only = false;
  // Called on every rank with each logged step's metrics (after they are written).
  std::function<void(const StepMetrics&)> on_log;
  // Observability (docs/OBSERVABILITY.md). Paths are checked when the trainer is built.
  std::string tensorboard_dir;     // rank 0 writes TensorBoard event files here
  std::string timeline_path;       // Chrome trace: one file per rank, merged by rank 0 at the end
  // Kineto profile (observe/profiler.h) of the steps "N" or "A-B" inside fit(): operators and,
  // on CUDA, kernels and copies, as a Chrome trace per rank (".rankR" added when world > 1).
  std::string profile_steps;
  std::string profile_path = "profile.json";
  int64_t memory_report_step = 0;  // > 0: log the memory report after this step (and on OOM)
  // Checkpoints (docs/CLUSTER.md): the model unsplit under PyTorch state_dict names, the
  // optimizer (unsplit), loss scaler, RNG states, step, accumulation and data position.
  std::string save_dir;           // empty: no checkpoints
  int64_t save_every = 0;         // also every this many steps (0: only at the end / preemption)
  int keep_last = 3;              // checkpoints kept (0: all)
  // Periodic saves (save_every) inside fit() do not stall training: the saving step copies its
  // state to host memory, and a background thread writes and publishes the files (over a
  // communicator of its own) while the next steps run, as torch.distributed.checkpoint's
  // async_save does. At most one save is in flight; the next save, a preemption's save and the
  // end of fit() wait for it (and rethrow its failure). false: every save is synchronous.
  bool async_save = true;
  ResumeMode resume = ResumeMode::kNo;  // fit() continues from a checkpoint in save_dir (above).
                                       // A run that had reached `steps` trains nothing.
  // With resume == kNo and checkpoints already in save_dir (checked when the trainer is built).
  SaveDirExists save_dir_exists = SaveDirExists::kError;
  FileSystem* checkpoint_fs = nullptr;  // where checkpoints go (tests inject faults); nullptr: POSIX
  // Each step, agree across ranks on SIGTERM/SIGUSR1; then fit() saves, asks Slurm to requeue
  // and returns with preempted() set (exit with kExitRequeue then). The trainer installs the
  // signal handlers itself (install_preemption_handlers, once per process) when this is on.
  bool handle_preemption = true;
  std::map<std::string, std::string> checkpoint_meta;  // saved along (program, flags, ...)
};

// Throws dtrain::Error naming the bad field (steps < 0, accum_steps < 1, log_every < 1, ...).
void validate(const TrainerOptions& options);

// --param_dtype: the module's floating-point parameters in `dtype` (buffers keep theirs, e.g.
// rotary tables); what the Trainer does to its model first. set_data keeps each parameter's
// identity (tied names, references held by layers); one in the dtype already is left alone, so
// a caller that casts before the Trainer (to plan or probe the model as it will train) changes
// nothing the Trainer does.
void cast_parameters(torch::nn::Module& model, at::ScalarType dtype);

// Mean loss over a micro-batch (a 0-dim tensor); the trainer handles scaling and averaging.
using LossFn = std::function<at::Tensor(const Batch& micro_batch)>;

struct StepResult {
  int64_t step = 0;         // 1-based number of the step just taken
  double loss = 0;          // global-batch mean (read on the host only at log steps; else NaN)
  bool skipped = false;     // fp16 overflow or a skipped non-finite step: the optimizer did not step
  int oom_retries = 0;      // how many times this step backed off
};

// Makes `loader` serve this rank's share of the data under mesh's data parallelism: a loader
// left at LoaderOptions' default (dp_rank 0 of dp_size 1) is re-sharded to (mesh.dp_rank(),
// mesh.dp_size()); one sharded for another layout is a dtrain::Error naming both. fit() and
// evaluate() do it for their loaders; a hand-written loop of Trainer::step() calls it once.
// `which` names the loader in messages.
void shard_loader(const dist::Mesh& mesh, DataLoader& loader, const std::string& which = "the loader");

class Trainer {
 public:
  // model's parameters that require grad are trained; mesh.dp() averages gradients and
  // mesh.world() agrees on OOM. Collective (broadcasts rank 0's parameters). model and mesh
  // must outlive the trainer.
  Trainer(torch::nn::Module& model, LossFn loss, dist::Mesh& mesh, c10::Device device,
          TrainerOptions options);
  // A plain model given by its ModelSpec (models/model_spec.h), on `device` already: the
  // trainer applies the pipeline split (mesh pp > 1; split_pipeline_stage() may have been
  // called before moving the model to the device), layer offload, activation checkpointing
  // and ZeRO-3's units (shard_unit_starts, default: default_unit_prefixes()) to its blocks and
  // computes the loss as spec.post(blocks(spec.pre(batch)), batch). options.pipeline is set
  // from the spec. Collective as the constructor above.
  Trainer(ModelSpec spec, dist::Mesh& mesh, c10::Device device, TrainerOptions options);
  ~Trainer();

  // One optimizer step on this rank's batch.
  StepResult step(const Batch& batch);
  // Steps until options.steps, logging and evaluating as configured; returns the last
  // logged metrics.
  StepMetrics fit(DataLoader& train, DataLoader* eval = nullptr);
  // The held-out set's mean loss (options.eval_samples samples of eval's evaluation_order(),
  // whatever the layout; what fit() logs as eval_loss), under no_grad and eval mode. The
  // samples are cut into chunks of eval's batch_size rows dealt to the data-parallel ranks in
  // turn; every rank runs as many forwards (a rank without a chunk in the last round runs one
  // row that does not count), so collectives inside the forward (ZeRO-3's gathers, tensor
  // parallelism, pipeline stages) stay matched. The loss is the row-weighted mean of the
  // chunks' mean losses. Collective over the mesh. Does not move eval's position.
  double evaluate(DataLoader& eval);
  // Mean loss over the next `batches` batches of this rank's share of eval (moving its
  // position), averaged over the data-parallel group: which samples these are depends on the
  // rank count and batch size. For timing a forward pass (--eval_only); evaluate(eval) is the
  // comparable figure.
  double evaluate(DataLoader& eval, int64_t batches);
  // The accuracy of the last evaluate() (with options.eval_loss_and_correct), else empty.
  std::optional<double> last_eval_accuracy() const { return last_eval_accuracy_; }

  int64_t current_step() const { return step_; }
  // The last step's global-batch mean loss: a host read that waits for the step (step()
  // itself reads nothing; fit() reads it at log steps). NaN before the first step and when
  // this step's loss was read already (by fit()'s log or an earlier call).
  double last_loss() { return read_loss(); }
  // Saves a checkpoint of this step to options.save_dir (collective); loader gives the data
  // position. Returns the path of the main file.
  std::string save_checkpoint(const DataLoader* loader);
  // With the offloaded optimizer's delayed update: publishes the update in flight, so the
  // model holds every step's update (save_checkpoint() and the end of fit() do it). After
  // step() the model otherwise holds the weights one update behind. Collective over dp.
  void flush_updates();
  // Restores the newest good checkpoint in options.save_dir (collective); throws
  // dtrain::Error when there is none or it belongs to a different model. Moves loader to the
  // saved position (and, inside fit(), its evaluation loader too). Any tensor-parallel or
  // data-parallel layout may resume any other. A
  // failure to read or apply it on some ranks only (a rank file that cannot be read there)
  // is agreed on: every rank throws, none goes on training.
  // Restores the newest good checkpoint; false when there is none and `required` is false.
  bool resume_checkpoint(DataLoader* loader, bool required);
  // fit() stopped early because the job was preempted (after saving a checkpoint).
  bool preempted() const { return preempted_; }
  // The memory report of the last step (components, allocator figures), for logs.
  MemoryReport memory_report() const;
  // --shard=parameters: the units whose forward the model runs through ParameterUnits::run
  // (TrainerOptions::shard_unit_starts); null otherwise. Valid as long as the trainer.
  ParameterUnits* parameter_units() const { return units_.get(); }
  Timeline& timeline() { return *timeline_; }
  int accum_steps() const { return accum_steps_; }
  Optimizer& optimizer() { return *optimizer_; }
  GradReducer& reducer() { return *reducer_; }
  LossScaler& scaler() { return *scaler_; }
  const TrainerOptions& options() const { return options_; }
  // The metrics of the last step (host-side; loss only valid at log steps).
  const StepMetrics& last_metrics() const { return last_; }
  // The first metrics fit() logged in this process (step 0 before any).
  const StepMetrics& first_logged() const { return first_logged_; }

 private:
  bool run_micro_batches(const Batch& batch, at::Tensor& loss_sum);
  // The micro-batches' forwards and backwards (gradient reduction in the last one's);
  // synced_backward_done turns true once that completed.
  void forward_backward(const std::vector<Batch>& micro, at::Tensor& loss_sum, bool& synced_backward_done);
  // A micro-batch's loss: replayed from the CUDA graphs (--cuda_graph, captured here at the
  // step after cuda_graph_after_steps), else the loss function under autocast.
  at::Tensor micro_batch_loss(const Batch& micro);
  // Why --cuda_graph cannot be used with this trainer ("" when it can).
  std::string cuda_graph_refusal() const;
  // ZeRO-3's OOM back-off: the replay of a failed step on one row per micro-batch that takes
  // part in the rest of its gathers and reductions (dp_issued: dp's count when the step began).
  void finish_step_on_one_row(const std::vector<Batch>& micro, uint64_t dp_issued);
  // Pipeline parallelism: the micro-batches through the stages (loss_sum: last stage's, else 0).
  void run_pipeline(const std::vector<Batch>& micro, at::Tensor& loss_sum);
  // Evaluation: adds the batch's mean loss x weight to sums[0] and (eval_loss_and_correct) its
  // correct predictions to sums[1] (none for weight 0), under autocast; the caller holds no_grad.
  void score_batch(const Batch& batch, double weight, at::Tensor& sums);
  // Pipeline parallelism: evaluation's forwards through the stages; the batch's mean loss on the
  // last stage (a device scalar), zero elsewhere.
  at::Tensor pipeline_eval_loss(const Batch& batch);
  // The PipelineStep of `micro` (input, forward, activation shape) for training or evaluation.
  PipelineStep pipeline_step(const std::vector<Batch>& micro) const;
  bool agree_on_failure(bool failed);
  // Constructor: refuses tied parameters (one tensor under two names) where a mode cannot
  // train them as one (ZeRO-3, tensor or pipeline parallelism), naming them; logs the others.
  void check_tied_parameters(const std::vector<std::pair<std::string, std::string>>& tied) const;
  // Constructor, with save_dir: locks the directory for this run (rank 0; collective), then
  // start_fresh_in_save_dir() unless resuming.
  void take_save_dir();
  // Constructor, with save_dir and ResumeMode::kNo: applies options.save_dir_exists to a
  // directory that already holds checkpoints (collective over the world).
  void start_fresh_in_save_dir();
  // Collective over the world: the ranks where `failed` is true ("1,3"), "" when none.
  std::string failing_ranks(bool failed);
  void back_off(int64_t batch_rows);
  void apply_update(StepMetrics& m, bool& skipped, const at::Tensor& loss_sum);
  // fp32/bf16: whether this step's loss or gradient norm is non-finite on any rank (collective).
  bool nonfinite_on_any_rank(const at::Tensor& loss_sum, const at::Tensor& norm);
  // --on_nonfinite: throws for kStop (and for too many skips in a row), else counts the skip.
  void handle_nonfinite(const at::Tensor& loss_sum, const at::Tensor& norm);
  [[noreturn]] void stop_for_nonfinite(int64_t step, double loss, double norm, int run, const std::string& found);
  // The deferred watch (TrainerOptions::defer_nonfinite_check): whether it applies; a step's
  // agreed flag (1: drop its update), recorded on the device; the policy applied to the
  // steps recorded since the last call (one host read; throws as handle_nonfinite does).
  bool defer_nonfinite() const;
  at::Tensor record_nonfinite(const at::Tensor& loss_sum, const at::Tensor& norm);
  void settle_nonfinite();
  // The last step's global-batch loss (waits for its reduction), NaN if none is pending.
  double read_loss();
  // Builds, writes and shows the metrics of the step just taken.
  StepMetrics log_step(bool eval_now, DataLoader* eval, int64_t global_batch,
                       std::chrono::steady_clock::time_point window_start, int64_t window_steps,
                       Progress& progress);
  // fit(): shards the loaders over the data-parallel ranks and checks every rank's agree.
  void prepare_loaders(DataLoader& train, DataLoader* eval);
  // fit(): the checkpoint of a --save_every step (in the background with async_save).
  void save_periodic(const DataLoader& train);
  // Agrees on preemption; when preempted saves (with save_dir), asks to requeue, returns true.
  bool stop_for_preemption(const DataLoader& train);
  // The view of this trainer's state that checkpoints save and restore (state/training_state.h):
  // references to its model, parameters, optimizer, units, pruner, scaler and evaluation loader,
  // and its step, accumulation and pipeline facts. Valid while the trainer lives.
  TrainingState training_state();
  // A checkpoint's contents, copied to host memory (collective over the world and tp); staged
  // (own_copies) for a background write. Throws for an evaluation-only trainer.
  PreparedCheckpoint prepare_save(const DataLoader* loader, bool own_copies);
  // The store of options.save_dir (keep_last, checkpoint_fs).
  CheckpointStore checkpoint_store() const;
  int64_t pp_param_offset_ = 0;  // the parameters of the stages before this one
  std::vector<int64_t> pp_param_index_;  // interleaved: each parameter's whole-model index
  void number_interleaved_parameters();
  // Pipeline: each stage's partitioned flat optimizer space, stages x tp (stage-major); where
  // this rank's lies in the whole model's (StageSpace) when resuming partitioned state.
  std::vector<int64_t> pp_flat_numels_;
  void check_can_train() const;  // throws for an evaluation-only trainer
  // Starts a background save of this step (after waiting for the one in flight).
  void save_checkpoint_async(const DataLoader* loader);
  // Waits for the background save in flight, if any; rethrows its failure.
  void wait_for_save();

  // The ModelSpec constructor's: the model with the techniques applied, the loss it gives and
  // the options it sets.
  struct Applied {
    std::shared_ptr<AppliedModel> model;
    LossFn loss;
    TrainerOptions options;
  };
  static Applied apply_to_spec(ModelSpec spec, dist::Mesh& mesh, c10::Device device, TrainerOptions options);
  Trainer(Applied applied, dist::Mesh& mesh, c10::Device device);
  std::shared_ptr<AppliedModel> applied_;  // null for a module + LossFn trainer

  torch::nn::Module& model_;
  LossFn loss_;
  dist::Mesh& mesh_;
  c10::Device device_;
  TrainerOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<bool> sharded_;  // split across the tensor-parallel group
  // How this rank's gradients make up the model's (tensor-parallel shards; with a partitioned
  // optimizer, the range of the flat gradient space reduced to this rank).
  GradNormLayout norm_layout_;
  std::vector<std::string> names_;
  std::map<std::string, ShardSpec> specs_;
  bool preempted_ = false;
  int64_t last_saved_step_ = -1;
  std::future<std::string> save_in_flight_;            // the background save, if any
  std::unique_ptr<dist::Communicator> save_comm_;      // its communicator (a split of the world)
  DataLoader* eval_ = nullptr;  // fit()'s evaluation loader while it runs (checkpointed position)
  HostStaging staging_;  // the background save's host copies (pinned buffers reused across saves)
  std::unique_ptr<DirectoryLock> save_dir_lock_;  // rank 0, with a save_dir: one run per directory
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<SparseGradReducer> sparse_reducer_;  // null: no parameter has sparse gradients
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<ParameterUnits> units_;  // --shard=parameters (after optimizer_: it refers to it)
  std::unique_ptr<Pruner> pruner_;  // with prune.amount > 0
  std::unique_ptr<GraphedLoss> graph_;  // --cuda_graph, once captured
  bool graph_given_up_ = false;         // refused or failed: eager from then on
  bool graph_shape_noted_ = false;      // a batch of other shapes ran eagerly (logged once)
  std::unique_ptr<LossScaler> scaler_;
  std::unique_ptr<MetricsWriter> metrics_;
  int64_t step_ = 0;
  int accum_steps_ = 1;
  StepMetrics last_;
  StepMetrics first_logged_;
  at::Tensor last_grad_norm_;
  std::optional<double> last_eval_accuracy_;
  double logged_comm_bus_bytes_ = 0;  // the mesh's communicators' bus bytes at the last log
  double comm_bus_bytes() const;
  int64_t nonfinite_skips_ = 0;     // steps dropped for a non-finite loss or gradient norm
  int consecutive_nonfinite_ = 0;   // of them, in a row up to the last step
  at::Tensor deferred_nonfinite_;   // the deferred watch's record (record_nonfinite)
  bool deferred_pending_ = false;   // steps recorded since the last settle_nonfinite()
  std::unique_ptr<EventWriter> tensorboard_;
  std::unique_ptr<Timeline> timeline_;
  std::unique_ptr<StepProfiler> profiler_;
  double step_start_allocated_mb_ = 0;
  double step_peak_mb_ = 0;
  double step_gradients_mb_ = -1;    // at the end of the last step's backward
  double peak_before_report_mb_ = 0; // the run's peak before the report step reset it
  void record_step_timeline(std::chrono::steady_clock::time_point start);
  void finish_timeline();
  dist::WorkPtr pending_loss_;
  at::Tensor pending_loss_tensor_;
};

// Splits a batch into n micro-batches of equal rows (rows must divide by n).
std::vector<Batch> split_batch(const Batch& batch, int n);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
