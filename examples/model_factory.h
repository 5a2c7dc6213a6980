// The example models built from the shared flags, for programs that handle any of them
// (dtrain-plan): the model on the run's device, its loss over the example's batches, and
// synthetic batches of the same shape. Shapes and defaults are those of train_seq2seq,
// train_gpt and train_mlp (keep them in step when those change).
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/memory/planner.h"
#include "dtrain/engine/memory/simulator.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::examples {

struct ExampleModel {
  std::string name;                           // "seq2seq", "gpt", "mlp"
  std::shared_ptr<torch::nn::Module> module;  // on the run's device, in train mode
  engine::LossFn loss;  // mean loss of a batch as the example's loader yields it
  // Classifiers: the loss and the number of correct predictions of a batch, for
  // TrainerOptions::eval_loss_and_correct (the accuracy at evaluation); null otherwise.
  std::function<std::pair<at::Tensor, at::Tensor>(const engine::Batch&)> eval_loss_and_correct;
  // A batch of `rows` random rows on the device, shaped as the example's batches. Draws from
  // the default generators.
  std::function<engine::Batch(int64_t rows)> synthetic_batch;
  // Switches activation checkpointing of the blocks (on, and how many: the first N of the rank's
  // blocks, -1 all, as --checkpoint_blocks); null for a model without blocks.
  std::function<void(bool on, int blocks)> set_checkpointing;
  // Parameter-name prefixes of the blocks (what layer offload would stream) and their number.
  std::vector<std::string> block_prefixes;
  int blocks = 0;
  int64_t input_bytes_per_row = 0;               // one row of a batch on the device
  int64_t largest_activation_bytes_per_row = 0;  // the largest single tensor per row (logits)
  std::string default_optimizer;                 // the example's --optimizer default
  // Keeps the blocks' weights in host memory, streamed per block (--offload=layers); null
  // for a model without blocks that can be streamed.
  std::function<void()> offload_layers;
  // The model's inputs in a batch (the fields, or parts of them, that forward takes) and its
  // forward on them: the logits (the whole vocabulary's with --tp 1). What dtrain-export traces.
  std::function<std::vector<at::Tensor>(const engine::Batch&)> inputs;
  std::function<at::Tensor(const std::vector<at::Tensor>&)> forward;
  // The logits of a batch as rows [N, classes] (with --tp > 1 and vocab_parallel: this rank's
  // slice of the vocabulary, padded to the group) and their targets [N]: what the loss compares,
  // for distillation (--teacher).
  std::function<std::pair<at::Tensor, at::Tensor>(const engine::Batch&)> logits_and_targets;
  int64_t classes = 0;          // the real number of classes (the vocabulary)
  bool vocab_parallel = false;  // logits split by vocabulary over the tensor-parallel group
  // With --pp > 1 (gpt): `module` is this rank's pipeline stage, whose computation on a
  // micro-batch and sent activation these are (TrainerOptions::pipeline); `loss`, `forward` and
  // the other whole-model functions do not apply then.
  std::function<at::Tensor(const at::Tensor& x, const engine::Batch& micro)> stage_forward;
  std::function<std::vector<int64_t>(int64_t rows)> stage_activation_shape;
  // ZeRO-3's units as parameter-name prefixes (TrainerOptions::shard_unit_starts; --shard_units
  // chooses others); empty for a model that names none (gpt without a pipeline names its
  // embeddings, blocks and head).
  std::vector<std::string> unit_starts;
  // A model given to the trainer by its ModelSpec (gpt): the trainer applies the pipeline
  // split, ZeRO-3's units, checkpointing and layer offload to it (make_trainer); `applied`
  // is the same spec with the flags' checkpointing for what runs outside the trainer (probes,
  // a teacher's forward).
  std::optional<engine::ModelSpec> spec;
  std::shared_ptr<engine::AppliedModel> applied;
  int64_t parameter_count = 0;  // of the full (unsplit) model, where known
  bool first_stage = true;  // the stage owns the embeddings (takes the batch, receives nothing)
  bool last_stage = true;   // the stage owns the head and returns the loss
};

// The value of --name on the command line (before the flags are parsed, e.g. --model: it
// selects the defaults), or fallback when it is not given.
std::string flag_from_argv(int argc, char** argv, const std::string& name, const std::string& fallback = "");
// The text of the file at `path`; dtrain::Error naming `flag` (e.g. "--hf_config") and the path
// when it cannot be opened.
std::string read_text_file(const std::string& path, const char* flag);

// The flag defaults the example program sets for `model` (as given to init_run), e.g.
// {"lr", "0.01"}, {"batch_size", "16"} for seq2seq. Throws dtrain::Error for an unknown model,
// naming the known ones.
// The model-shape flags each example model reads (for --help and the cross-rank check).
std::vector<std::string> model_flag_names(const std::string& model);
std::map<std::string, std::string> model_flag_defaults(const std::string& model);
// The shape checks against --tp that init_run runs before any communicator (gpt), or null
// for a model without tensor-parallel layers.
std::function<void()> model_checks(const std::string& model);
// The trainer of `model`: from its ModelSpec when it has one (the techniques applied by the
// trainer), else from its module and loss.
std::unique_ptr<engine::Trainer> make_trainer(const Run& run, const ExampleModel& model,
                                              const engine::TrainerOptions& options);
// The Llama's options as the shape flags (and --hf_config) give them.
engine::LlamaOptions llama_flag_options();
// Sets the shape flags from --hf_config (so every part of the program, the checks, the planner
// and the MFU line, sees the config's shape); a shape flag given on the command line with
// another value is an error naming both. Nothing without --hf_config. Called by init_run
// before the flags' checks.
void apply_hf_config();
// The positions a written config.json declares: --hf_config's max_position_embeddings when
// given (and not below --seq_len), else --seq_len.
int64_t llama_max_positions();
// Builds `model` from the flags (seeded with --seed as the example is) on run.device.
ExampleModel build_example_model(const std::string& model, const Run& run);

// The planner's description of `model` as the flags and `options` train it: parameter counts
// (whole model; tensor-parallel shards found with collect_shard_specs), dtype, buffers,
// blocks, input rows (with --prefetch batches ahead), optimizer, --batch_size, AMP, whether
// checkpointing is possible, the CUDA context allowance for the device. Budgets, offload and
// allow_amp_change are left at their defaults (none, off, false) for the caller to set.
// The model's parameters are cast to options.param_dtype first (engine::cast_parameters, as the
// Trainer will): the counts, and the activation probe that follows, see the weights as trained.
engine::PlanInputs plan_inputs(const Run& run, ExampleModel& model, const engine::TrainerOptions& options);

// The step-time simulator's model of the language model the shape flags describe (--model=gpt
// or llama); dtrain::Error naming the models it prices for another.
engine::sim::ModelShape simulator_shape(const std::string& model);
// The step-time simulator's layout of the flags (--batch_size and --accum_steps, --shard,
// --offload, --checkpoint_activations, --sequence_parallel, --amp, --param_dtype, --pp_schedule,
// --pp_chunks) on a mesh of tp x pp x cp x dp ranks. dtrain::Error for --batch_size not a
// multiple of --accum_steps.
engine::sim::Layout simulator_layout(int tp, int pp, int cp, int dp);
// What the device holds besides the model's parameters and buffers (on the CPU the data set, for
// one): there during every step too, so the planner counts it (PlanInputs::buffer_bytes).
int64_t held_besides_model(const Run& run, ExampleModel& model);
// --plan_cluster: PlanInputs::step_time from the step-time simulator with that cluster file, this
// run's ranks (nodes of world.local_size) and mesh, --batch_size, --amp and --param_dtype; null
// without --plan_cluster. dtrain::Error for a model other than gpt or llama, or an unreadable file.
std::function<double(const engine::Technique&)> simulator_step_time(const Run& run, const std::string& model);

// Switches the model's checkpointing to what --checkpoint_activations and --checkpoint_blocks
// say (after a probe or a measurement switched it); nothing for a model without blocks.
void checkpoint_as_flags(ExampleModel& model);

// probe_activations() of `model` on synthetic batches of probe_rows and 2 * probe_rows rows,
// checkpointing off and (for a model with blocks) on, under each AMP mode of `amps`. Call
// before the Trainer exists; collective when the model is tensor-parallel (every rank of the
// group probes). Leaves the model's checkpointing as the flags say (checkpoint_as_flags).
engine::ActivationProfile probe_example_model(const Run& run, ExampleModel& model,
                                              const std::vector<engine::AmpMode>& amps,
                                              int64_t probe_rows);

// --plan=auto: probes `model` (with --pp: this rank's stage), chooses the fastest technique
// whose estimate fits --gpu_mem_limit_gb (and --host_mem_limit_gb) on every rank, and applies
// it to the model and `options`. With --gpu_mem_limit_gb the caching allocator is capped
// (CUDA) whether or not a plan is made. Then applies --offload=layers. Collective.
void plan_and_apply(const Run& run, ExampleModel& model, engine::TrainerOptions& options);


// Each pipeline stage's `mine` (the same length on every rank), as its first data-parallel and
// tensor-parallel rank gives it, stage after stage (one entry without a pipeline). Collective.
std::vector<std::vector<double>> per_stage(const Run& run, const std::vector<double>& mine);

// With --pp > 1: one line per stage, "<program>: plan: stage s estimate: allocated peak X MiB,
// k micro-batches in flight", from each stage's estimate `mine` (the first data-parallel and
// tensor-parallel rank of each stage gives it); "" without a pipeline. Collective.
std::string stage_estimates(const Run& run, const engine::MemoryEstimate& mine);

}  // namespace dtrain::examples
