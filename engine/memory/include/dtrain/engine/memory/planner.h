// Memory planning: estimate what a training step needs on the GPU and on the host, component
// by component, for a choice of techniques (activation checkpointing, gradient accumulation,
// AMP, optimizer offload, layer offload), and choose the fastest choice that fits a budget.
//
//   1. probe_activations(): a real forward + backward of the model at two micro-batch sizes
//      per technique measures the activation memory (bytes per row and a fixed part).
//   2. estimate(inputs, technique): closed forms for parameters, gradients and optimizer
//      state, the probe's line for activations, allowances for the rest.
//   3. choose_plan(inputs, profile): every combination allowed, those that fit, the fastest.
//
// How a trainer uses a plan (--plan=auto --gpu_mem_limit_gb=X):
//   * build the model on the device and probe it before the Trainer exists (the reducer's
//     hooks would fire during the probe's backward), with the model in train mode (the
//     examples do both with examples::plan_inputs and examples::probe_example_model);
//   * choose_plan(); on dtrain::Error print it and exit (nothing fits). With several ranks
//     every rank must apply the same plan (their probes can differ by a few bytes): use rank
//     0's (broadcast its technique) or agree on the most conservative;
//   * apply the plan: TrainerOptions::accum_steps = plan.technique.accum_steps, amp =
//     plan.technique.amp, the model's checkpoint_activations = plan.technique.checkpoint,
//     offload as plan.technique says; log plan.reason and plan.flags();
//   * release_cached_memory(device) (the probe's blocks), then apply_memory_limit(device,
//     plan.allocator_limit_bytes) so the caching allocator cannot take more than the budget
//     (an under-estimate then shows up as the trainer's OOM back-off, never as a job that
//     silently uses more than it was given), then build the Trainer;
//   * optionally set MemoryReport::predicted from plan.estimate.predicted_mb() so the memory
//     report shows measured and predicted side by side.
//
// Sizes are bytes (int64). Everything here is pure host arithmetic except
// probe_activations() and apply_memory_limit(). Not thread-safe where it touches a device.
#pragma once

#include "dtrain/dist/communicator.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/parallel/pipeline.h"

namespace dtrain::engine {

// The CUDA context, cuBLAS/cuDNN handles and NCCL outside the caching allocator on an H100
// with PyTorch 2.x (measured ~0.5 GiB); PlanInputs::cuda_context_bytes overrides it.
inline constexpr int64_t kDefaultCudaContextBytes = int64_t{500} << 20;

// One choice of techniques.
struct Technique {
  bool checkpoint = false;  // recompute each block's activations in backward
  int accum_steps = 1;      // micro-batches per step (batch_size / accum_steps rows each)
  AmpMode amp = AmpMode::kOff;
  bool offload_optimizer = false;  // fp32 master weights and state on the host (CpuOptimizer)
  bool offload_layers = false;     // block parameters on the host, streamed in per layer
  // ZeRO stage over the data-parallel group (--shard): 0 none, 1 optimizer (state and fp32
  // master split), 2 gradients (also the gradients between steps; with accum_steps > 1 they
  // stay whole until the last micro-batch, so 2 then saves what 1 does), 3 parameters (also
  // the weights, two units whole during forward and backward).
  int shard = 0;
  // With checkpoint: the first N of the rank's PlanInputs::layers blocks (its pipeline stage's)
  // recomputed, the others keeping their activations (--checkpoint_blocks); -1 (or N >= layers):
  // every block. Estimated
  // from the two probed fits (checkpointing off and on), not probed itself: a block's saving is
  // what the off fit holds after forward beyond the on fit, over the blocks (blocks of equal
  // size), taken off the off fit's peak, never below the on fit's.
  int checkpoint_blocks = -1;
  // The example flags that select this technique, e.g. "--checkpoint_activations
  // --accum_steps=4 --amp=bf16 --offload=optimizer --shard=gradients" ("" for the plain step).
  std::string flags() const;
  std::string to_string() const;  // "checkpoint on, accum 4, amp bf16, offload optimizer, shard none"
};

// ---- the activation probe -------------------------------------------------------------------

// The activation memory of one technique (checkpointing on/off x AMP mode), fitted as a line
// over the micro-batch rows from two probe runs: bytes(rows) = intercept + per_row * rows.
struct ActivationFit {
  bool checkpoint = false;
  AmpMode amp = AmpMode::kOff;
  int64_t rows[2] = {0, 0};
  int64_t peak_bytes[2] = {0, 0};     // peak allocated during forward+backward above the start
  double seconds[2] = {0, 0};         // wall time of forward+backward (device synchronized)
  double bytes_per_row = 0;           // slope, clamped >= 0
  double intercept_bytes = 0;         // clamped >= 0 (weight copies under autocast, transient
                                      // gradients before they are accumulated, ...)
  int64_t bytes(int64_t rows) const;  // the line at `rows`, rounded up
  // What stays allocated between the forward and the backward of a micro-batch (the tensors
  // saved for backward and the output): a pipeline stage holds this for every micro-batch
  // in flight but the one in backward. Measured when the loss function has returned.
  int64_t held_bytes[2] = {0, 0};
  double held_bytes_per_row = 0;
  double held_intercept_bytes = 0;
  int64_t held(int64_t rows) const;  // the held line at `rows`, rounded up
};

struct ActivationProfile {
  std::vector<ActivationFit> fits;
  // Memory the warm-up runs left allocated for good (library workspaces such as cuBLAS's,
  // allocated on first use): counted as "other" in every estimate.
  int64_t persistent_bytes = 0;
  // The fit for (checkpoint, amp), or null when the probe did not run that technique.
  const ActivationFit* find(bool checkpoint, AmpMode amp) const;
  std::string to_string() const;  // one line per fit
};

struct ProbeTechnique {
  bool checkpoint = false;
  AmpMode amp = AmpMode::kOff;
};

struct ProbeOptions {
  // The two micro-batch sizes (rows), smallest first; the smaller is also the warm-up size.
  // Small sizes keep the probe itself within memory: it runs before anything is planned. Not
  // 1 row: there the peak can fall at another moment of backward (the largest weight's
  // gradient meeting what is left of the activations), and the line through 1 and 2 rows
  // understates the slope (measured: -3% at 8 rows for the example seq2seq; 2 and 4: +0.1%).
  int64_t rows_small = 2;
  int64_t rows_large = 4;
  // The techniques to measure; the planner can only choose among these.
  std::vector<ProbeTechnique> techniques = {{false, AmpMode::kOff}, {true, AmpMode::kOff}};
};

// Returns the mean loss of one synthetic micro-batch of `rows` rows created on the device
// inside the call, computed by the model with activation checkpointing on or off as asked.
// The probe calls it under the technique's autocast and runs backward itself.
using ProbeLossFn = std::function<at::Tensor(int64_t rows, bool checkpoint)>;

// For each technique: one warm-up forward+backward at rows_small, then one at each size,
// each measured as memory_stats(device).peak - allocated at its start (after
// reset_peak_memory), and timed with the device synchronized. Synchronous.
// Side effects, all undone before it returns (also when it throws):
//  * the probe itself allocates and frees device memory (activations, gradients of
//    parameters that had none, a host copy of the existing gradients): run it before the
//    real training state is at its largest, or budget for it. What first-use library
//    workspaces keep stays allocated (reported as persistent_bytes); on CUDA the freed blocks
//    stay in the caching allocator until release_cached_memory();
//  * gradients of `params` are set, accumulated and zeroed during the runs, then restored:
//    defined gradients get their values back (in place, so views such as a reducer's bucket
//    views survive), undefined ones become undefined again;
//  * the default CPU generator and, for a CUDA device, that device's generator are restored,
//    so a run that probes draws the same random numbers afterwards as one that does not.
// Not touched: the model's train/eval mode (put it in train mode before probing: dropout
// masks are activations). The checkpointing switch is the loss function's to set per call
// and the caller's to restore afterwards. The CPU needs track_cpu_memory() for exact figures;
// throws dtrain::Error without it, for rows_small < 1 or rows_large <= rows_small, no techniques, a
// loss that is not a scalar, or an empty `params`.
ActivationProfile probe_activations(const ProbeLossFn& loss_fn,
                                    const std::vector<at::Tensor>& params, c10::Device device,
                                    const ProbeOptions& options = {});

// ---- estimate -------------------------------------------------------------------------------

struct PlanInputs {
  // The model. Counts are of the whole (unsplit) model; tensor parallelism keeps
  // sharded_parameters / tp of the sharded ones on each rank and all of the rest.
  int64_t parameters = 0;          // trainable parameters
  int64_t sharded_parameters = 0;  // of which split over the tensor-parallel group
  int tp = 1;
  int dp = 1;  // data-parallel size: offloaded optimizer state is split over it
  // The trained weights' dtype: 4 fp32 (also under AMP), 2 bf16/fp16 (--param_dtype; also
  // their gradients, and an offloaded optimizer's host gradient buffers).
  int64_t bytes_per_parameter = 4;
  // Optimizer offload with the one-step-delayed update (--offload_delayed_update_after): two
  // host gradient buffers (one filling while the other is updated from) and a device buffer of
  // the rank's range of new weights, which the next step publishes.
  bool offload_delayed_update = false;
  // Whether offload copies between a device and the host (a GPU run): the streamed gradients'
  // pinned buffer and the new weights' staging tiles. Training on the CPU, the optimizer reads
  // the gradients in place and writes the weights directly (a buffer only for the delayed update).
  bool offload_to_device = true;
  int64_t buffer_bytes = 0;         // per rank: buffers and frozen tensors on the device
  // Layer offload streams `layers` blocks holding layer_parameters of the parameters (whole
  // model, sharded like the rest); the other parameters (embeddings, head) stay on the GPU.
  // Activation checkpointing recomputes them (this rank's: a pipeline stage's own).
  int layers = 0;
  // The blocks keep equal activations (a stack of one block type, as the library's GPT and
  // Llama): choose_plan then also tries recomputing only the first of them (Technique::
  // checkpoint_blocks; not with the interleaved schedule). Blocks of unequal size would make that
  // estimate low for a smaller first block; estimate() still prices a Technique that asks for it.
  bool uniform_blocks = false;
  // With pp > 1: the fewest blocks any stage holds (pipeline_stage_bounds; the same on every
  // rank). The counts choose_plan tries stay below it, so every stage can take them and every
  // rank tries the same list (0: no counts tried with pipeline stages).
  int fewest_stage_layers = 0;
  int64_t layer_parameters = 0;
  // Input data: bytes of one row of the batch and how many whole batches are on the device
  // at once (the step's plus the loader's prefetched ones).
  int64_t input_bytes_per_row = 0;
  int input_batches = 1;

  // The optimizer: state tensors per parameter in the parameter's dtype (as engine's
  // optimizers keep them): adam/adamw 2 (3 with amsgrad), adagrad 1, sgd 1 with momentum and
  // 0 without. Offloaded: fp32 master weights + the same state in fp32, on the host.
  std::string optimizer = "adamw";
  double momentum = 0;
  bool amsgrad = false;
  // Device memory the optimizer step allocates for itself (0 for the fused kernels the
  // engine uses on CPU and CUDA; the _foreach_ fallback needs about one more copy of the
  // parameters).
  int64_t optimizer_transient_bytes = 0;
  // Whether an extra copy of the gradients is alive at a step's peak (stale_gradients). The
  // reducer rebuilds its buckets once and nothing keeps the old ones (the optimizer takes
  // gradient tensors afresh each step), so false for dtrain's trainer; true models a training
  // loop that holds on to old gradient tensors.
  bool reducer_rebuild = false;

  // The step and the choices the planner may make.
  int64_t batch_size = 1;             // rows per data-parallel rank per optimizer step
  std::vector<int> accum_candidates;  // empty: 1, 2, 4, ... (powers of two dividing batch_size)
  AmpMode amp = AmpMode::kOff;        // as the user asked; kept unless allow_amp_change
  bool allow_amp_change = false;      // may pick another AMP mode the profile measured
  bool can_checkpoint = true;
  bool can_offload_optimizer = false;
  bool can_offload_layers = false;
  // May pick --shard=optimizer, gradients or (with units) parameters (with dp > 1; not with
  // layer offload, whose parameters live on two devices).
  bool can_shard = false;
  // ZeRO-3's units: this rank's elements of the largest one (0: the model names no units, so
  // --shard=parameters is not a candidate).
  int64_t largest_unit_parameters = 0;

  // Pipeline parallelism (--pp): the model here is this rank's stage (its parameters, its
  // buffers, its probe), stage `stage` of `pp`. A stage holds the activations of several
  // micro-batches at once: 1F1B min(pp - stage, accum_steps), GPipe all accum_steps of them,
  // zero bubble what its list holds at most (pipeline.h: simulate_pipeline's peak_in_flight,
  // at most min(pp, accum_steps)). The step takes the schedule's simulated step at unit costs
  // over its 3 accum_steps units of work: (accum_steps + pp - 1) / accum_steps for 1F1B.
  // Interleaved (pp_chunks >= 2 chunks per stage): the stage holds up to peak_in_flight (micro,
  // chunk) pairs, each about 1/pp_chunks of the stage's held activations; only accumulation
  // counts that are multiples of pp are candidates.
  int pp = 1;
  int stage = 0;
  PipelineSchedule pp_schedule = PipelineSchedule::k1F1B;
  int pp_chunks = 1;
  // zb: what a micro-batch keeps between its B and its W besides its activations, per row: the
  // gradient each boundary operation was given (split_backward.h: every Linear's output, every
  // norm's), which W starts from. Each micro-batch in flight on the stage is counted with it.
  int64_t weight_grad_capture_bytes_per_row = 0;

  // Budgets (0: no limit). gpu_budget_bytes is the process's device memory: the allocator's
  // peak plus the workspace allowance plus the CUDA context. host_budget_bytes caps what
  // offload keeps on the host (the pinned pool's --host_mem_limit_gb).
  int64_t gpu_budget_bytes = 0;
  int64_t host_budget_bytes = 0;

  // Allowances. Workspace = workspace_fraction of the allocator's predicted peak (caching
  // allocator rounding and fragmentation) + largest_activation_bytes_per_row * micro-batch
  // rows (room for a fresh block of the largest tensor, e.g. the logits, when cached blocks
  // are fragmented).
  double workspace_fraction = 0.05;
  int64_t largest_activation_bytes_per_row = 0;
  int64_t cuda_context_bytes = kDefaultCudaContextBytes;  // set 0 for a CPU device

  // Cost model (see choose_plan). 0: from the profile's timings, else the defaults there.
  double compute_seconds_per_row = 0;
  double micro_batch_overhead_seconds = 0;
  double host_bytes_per_second = 20e9;  // CPU optimizer's memory bandwidth
  double pcie_bytes_per_second = 55e9;  // host <-> device copies
  // Data-parallel bus bandwidth per rank: prices what sharding moves beyond DDP's all-reduce
  // (its reduction to owners is a reduce, not a reduce-scatter: weights x bytes / dp more).
  double network_bytes_per_second = 25e9;
  // Candidates whose time is within this fraction of the fastest one's are taken as equally
  // fast, and the plan is the simplest of them (fewest techniques, then fewest micro-batches,
  // fewest recomputed blocks, least sharding, then the time): the probe's timings are noisy, so
  // without it two runs of the same command could apply different plans for a 1% difference.
  double time_tolerance = 0.05;
  // Another time model (the step-time simulator, --plan_cluster): seconds per optimizer step of
  // a technique, used instead of the one above when set; a NaN or a throw for a technique it
  // cannot price falls back to the one above.
  std::function<double(const Technique&)> step_time;
};

// Throws dtrain::Error naming the bad field (negative counts, tp/dp < 1, sharded_parameters >
// parameters, layer_parameters > parameters, batch_size < 1, an unknown optimizer, an accum
// candidate that does not divide batch_size, fractions or bandwidths out of range).
void validate(const PlanInputs& inputs);

struct MemoryComponents {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;  // host side: fp32 master weights + state
  int64_t activations = 0;      // the probe's line at the micro-batch size (a pipeline stage:
                                // plus the held line for each other micro-batch in flight)
  int64_t transient = 0;        // outside forward/backward: optimizer temporaries
  int64_t stale_gradients = 0;  // the old gradient buckets of step 2 (PlanInputs::reducer_rebuild)
  int64_t other = 0;            // buffers, input batches, persistent workspaces
  int64_t workspace = 0;        // allowance (see PlanInputs)
  int64_t cuda_context = 0;
  // What the allocator's peak of allocated bytes should be: the static part (with the stale
  // gradients) plus the larger of activations and transient (they do not overlap).
  int64_t allocated_peak() const;
  int64_t total() const;  // allocated_peak() + workspace + cuda_context
};

struct MemoryEstimate {
  Technique technique;
  int64_t micro_batch_rows = 0;
  int in_flight = 1;      // micro-batches whose activations are held at once (pipeline stages)
  MemoryComponents gpu;   // the training device (the CPU itself when training on the CPU)
  MemoryComponents host;  // what offload keeps on the host (0 without offload)
  // For MemoryReport::predicted (MiB): "parameters", "gradients", "optimizer_state",
  // "activations", "other", "allocated", "cuda_context", "total".
  std::map<std::string, double> predicted_mb() const;
  // A table of the components, GPU and host columns, in MiB, with the totals.
  std::string to_string() const;
};

// The estimate of `technique` (pure). Throws dtrain::Error as validate() does, for
// accum_steps not dividing batch_size, and when the profile lacks the technique's
// (checkpoint, amp) fit (naming it and the ProbeOptions::techniques to add).
MemoryEstimate estimate(const PlanInputs& inputs, const ActivationProfile& profile,
                        const Technique& technique);

// ---- the plan -------------------------------------------------------------------------------

struct Plan {
  Technique technique;
  MemoryEstimate estimate;
  double step_seconds = 0;  // the cost model's figure (a ranking, not a promise)
  // Why this one: what was considered, what did not fit, what a faster choice would need.
  std::string reason;
  // For apply_memory_limit: gpu_budget_bytes - cuda context (0 when there is no budget).
  int64_t allocator_limit_bytes = 0;
  std::vector<MemoryEstimate> fitting;  // every candidate that fits, fastest first
  std::string flags() const { return technique.flags(); }
  std::string to_json() const;  // one line for scripts
};

// The host budget of a plan (PlanInputs::host_budget_bytes) for one of local_ranks processes
// on this node: host_mem_limit_gb when given (> 0, as the pinned pool's cap), else this
// process's share of what the node has available now (MemAvailable of meminfo_path less the
// pinned pool's default headroom, offload::PinnedPoolOptions::min_free_bytes, divided by
// local_ranks), so a plan that offloads more than the machine has is refused with both figures
// named instead of failing when the pool allocates. 0 (no limit) when MemAvailable cannot be
// read. Throws dtrain::Error for local_ranks < 1.
int64_t host_budget_bytes(double host_mem_limit_gb, int local_ranks, const std::string& meminfo_path = "/proc/meminfo");

// Enumerates accumulation (accum_candidates), checkpointing (if can_checkpoint), AMP (the
// given mode; with allow_amp_change every mode the profile measured), optimizer and layer
// offload (where allowed), keeps those within both budgets and returns the fastest by
// the cost model, per optimizer step, with C = batch_size * compute seconds per row:
//   compute       C (x 4/3 with checkpointing: one more forward)
//   micro-batches accum_steps * per-micro-batch overhead
//   opt. offload  CPU step: (8 (1 + state tensors) + 4 + bytes_per_parameter) bytes per
//                 parameter / dp at host_bytes_per_second, plus gradients down and weights up
//                 over PCIe
//   layer offload per micro-batch: layer parameters twice (forward, backward) and their
//                 gradients once over PCIe
//   ZeRO-3        (2 accum_steps - 1) (dp - 1) / dp x the weights' bytes over the network
//                 (two all-gathers per micro-batch and the reduce-scatter, against the all-reduce)
//   pipeline      compute and micro-batch overheads x (accum_steps + pp - 1) / accum_steps
// Compute per row and the overhead come from the profile's timings of the non-checkpointed
// fit of the technique's AMP mode (a line over the two sizes) unless PlanInputs gives them;
// without either, 1 ms per row and 1 ms per micro-batch. Ties prefer fewer techniques.
// Throws dtrain::Error when nothing fits: the message gives the smallest estimate (technique
// and GPU/host totals against the budgets) and what to change.
//
// Ranks that must apply one plan (every rank of a run; the stages of a pipeline differ most)
// pass `agree`: called once, on every such rank, with each candidate's figures laid out as
// [step seconds x N, GPU total x N, host total x N] for the N candidates (enumerated in the
// same order on every rank that has the same flags), it must replace each figure with its
// maximum over those ranks (an all-reduce with max). The choice then follows the agreed
// figures (a candidate fits when it fits on every rank; the slowest stage sets the pace), so
// every rank picks the same technique; Plan::estimate stays this rank's own.
using PlanAgreement = std::function<void(std::vector<double>& figures)>;
Plan choose_plan(const PlanInputs& inputs, const ActivationProfile& profile,
                 const PlanAgreement& agree = nullptr);
// The agreement of every rank of `comm` (null for one rank): all-reduces the figures with max,
// after checking that every rank enumerated the same number of candidates (the same flags do;
// dtrain::Error on every rank otherwise). Collective when called.
PlanAgreement agreement_over(dist::Communicator& comm);
// The number of micro-batches whose activations stage `inputs.stage` holds at once under
// `accum_steps` micro-batches: 1 without a pipeline (see PlanInputs::pp).
int pipeline_in_flight(const PlanInputs& inputs, int accum_steps);
// The cost model's seconds per optimizer step of `technique` (as above; pure).
double estimate_step_seconds(const PlanInputs& inputs, const ActivationProfile& profile,
                             const Technique& technique);

// ---- enforcing the GPU budget ---------------------------------------------------------------

// Caps what the CUDA caching allocator may reserve on `device` at `bytes`, through its memory
// fraction (bytes / the device's total memory, at most 1); an allocation beyond it raises
// c10::OutOfMemoryError as a full device would (after the allocator has freed its cached
// blocks), so the trainer's OOM back-off applies. Takes effect for later allocations: memory
// already reserved stays. Call on the thread that trains, before the Trainer is built.
// bytes == 0 removes the cap. On the CPU nothing is enforced (returns false: CPU memory is
// not capped; the pinned pool has its own cap); on CUDA returns true. Synchronous; initializes
// CUDA if needed. Throws dtrain::Error for bytes < 0, for a CUDA device when dtrain was built
// without CUDA, or for a device of another type.
bool apply_memory_limit(c10::Device device, int64_t bytes);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
