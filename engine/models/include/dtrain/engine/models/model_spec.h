// The small contract through which a plain model gets every technique of the library: its
// module, its stack of blocks (blocks.h), and its forward pass cut into the part before the
// blocks (pre: the batch -> the blocks' input, e.g. the embeddings) and the part after them
// (post: the blocks' output -> the batch's mean loss, e.g. final norm, head, cross-entropy).
// The Trainer built from a ModelSpec (train/trainer.h) applies what its options ask for to
// that structure, from outside the model:
//   * pipeline stages (--pp): each stage keeps a range of the blocks (whole-model names), the
//     first stage pre's modules, the last post's; a stage runs pre / blocks / post as its part
//     of the schedule, sending activations of activation_shape;
//   * ZeRO-3 (--shard=parameters): units of whole pieces (by default pre's modules, each block,
//     post's modules; TrainerOptions::shard_unit_starts groups consecutive pieces), gathered
//     around pre, each group of blocks and post, again before their backward;
//   * activation checkpointing: each block (or each unit's group of blocks) recomputed in
//     backward;
//   * layer offload: each block's weights kept on the host and streamed in one block ahead;
//   * tensor and sequence parallelism are the model's layers (tensor_parallel.h), built with
//     the mesh's tp communicator.
// loss(batch) = post(blocks->forward(pre(batch)), batch): the model's own forward stays a plain
// call of its BlockStack.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/models/blocks.h"

namespace dtrain::offload {
class LayerStreamer;
}

namespace dtrain::engine {

class ParameterUnits;

// The parameters a trainer trains, in the one order every part of the library numbers them
// (the optimizer, the reducer's buckets, ZeRO-3's units, checkpoints, the planner): the ones
// that require grad, as named_parameters() lists them; a tensor registered under two names
// (tied weights: nanoGPT's head.weight = wte.weight) once, under its first name (autograd
// sums the gradients of its uses into its one .grad).
struct TrainedParameters {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::pair<std::string, std::string>> tied;  // (second name, first name)
};
TrainedParameters trained_parameters(torch::nn::Module& module);

struct ModelSpec {
  // The whole model; what requires grad in it is trained. Shared: the trainer keeps it alive.
  std::shared_ptr<torch::nn::Module> module;
  // Its stack of blocks (registered somewhere in module) and the stack's name prefix in the
  // module's parameter names, e.g. "blocks." for module->register_module("blocks", ...).
  BlockStack blocks{nullptr};
  std::string blocks_prefix;
  // The forward pass before and after the blocks, on one (micro-)batch.
  std::function<at::Tensor(const Batch& batch)> pre;
  std::function<at::Tensor(const at::Tensor& blocks_out, const Batch& batch)> post;
  // The direct children of module that pre and post use (names as registered): a pipeline's
  // first stage keeps pre_modules, its last post_modules, the others drop them; ZeRO-3's
  // default units are pre's modules, each block, post's modules.
  std::vector<std::string> pre_modules, post_modules;
  // The blocks' input (what a pipeline stage sends on) for a micro-batch of `rows` rows, and
  // its dtype.
  std::function<std::vector<int64_t>(int64_t rows)> activation_shape;
  at::ScalarType activation_dtype = at::kFloat;
  // The context-parallel group the model splits its sequences over (null: none). The Trainer
  // refuses a group other than its mesh's cp axis: the weights' gradients are averaged over the
  // mesh's replicas (dp x cp), so a group outside them would leave each rank its own gradient.
  dist::Communicator* context_parallel = nullptr;
};

// dtrain::Error naming the missing or inconsistent field (no module, no blocks, a blocks
// stack not inside module under blocks_prefix, no pre/post, a pre/post module that is not a
// direct child, no activation_shape).
void validate(const ModelSpec& spec);

// What the techniques need of a spec, applied. One per trainer; the trainer owns it.
struct ModelTechniques {
  bool checkpoint_activations = false;
  // With checkpoint_activations: how many blocks are recomputed, the first of this rank's stack
  // (its pipeline stage; an interleaved stage's chunks in order); the others keep their
  // activations (Megatron's --recompute-method=block). -1: every block. Fewer recomputed blocks
  // are a faster step that keeps more memory: the planner's and the simulator's knob between
  // none and all. A ZeRO-3 unit of several blocks is recomputed whole when its first block is.
  int checkpoint_blocks = -1;
  bool offload_layers = false;  // stream the blocks' weights from host memory
  c10::Device device{c10::kCPU};
  // Pipeline stage (stages > 1): this stage keeps blocks [first_block, end_block).
  int stage = 0, stages = 1;
  int first_block = 0, end_block = 0;
  // Interleaved schedule: the stage's model chunks (chunk c is virtual stage c * stages +
  // stage of stages * chunks), chunk c the stack's local blocks [chunk_bounds[c],
  // chunk_bounds[c + 1]); one chunk: [0, the stage's blocks).
  int chunks = 1;
  std::vector<int> chunk_bounds;
};

// Applies the pipeline split of `stages` stages (stage `stage`, blocks per stage from
// pipeline_stage_bounds(blocks, stages, counts)) to the spec's module: keeps the stage's blocks
// and pre's or post's modules on the first and last stage. Call before moving the module to
// its device (the dropped parts then never get there); a second call for the same split is
// a no-op. Returns the stage's block range in t.
// chunks > 1 (the interleaved schedule): the blocks split into stages x chunks virtual stages
// (counts, if given, names that many), and this stage keeps virtual stages stage, stage +
// stages, ... as its chunks (t.chunk_bounds); pre lives with virtual stage 0, post with the last.
void split_pipeline_stage(ModelSpec& spec, int stage, int stages, const std::string& counts, ModelTechniques& t,
                          int chunks = 1);

// The default ZeRO-3 units of a spec (the first parameter name prefix of each piece): pre's
// modules as one unit, each block its own, post's modules as one unit. A pipeline stage's own.
std::vector<std::string> default_unit_prefixes(const ModelSpec& spec);

// Installs what `t` asks for around the spec's blocks (and, with units, around pre and post):
// returns the loss of a whole-model forward, loss(batch), and, for pipeline stages, the
// stage's forward on (x, micro-batch). `units` (null: none) are the trainer's ZeRO-3 units cut
// by `prefixes` (ParameterUnits, unit_starts_of over the trainer's parameter names `names`);
// each unit must begin at a piece (pre's modules, a block, post's modules): dtrain::Error
// naming the parameter where one begins inside a piece. Keeps the streamer (layer offload)
// alive in the returned object.
class AppliedModel {
 public:
  AppliedModel(ModelSpec spec, ModelTechniques t);
  ~AppliedModel();
  AppliedModel(const AppliedModel&) = delete;
  AppliedModel& operator=(const AppliedModel&) = delete;

  // Moves the blocks' weights to host memory (offload_layers); after the module is on its
  // device. stream_blocks() switches offload_layers on first.
  void start_streaming();
  void stream_blocks();
  // Switches activation checkpointing of the blocks (a memory probe measures both); `blocks`
  // as ModelTechniques::checkpoint_blocks (-1: all). dtrain::Error for blocks < -1 or more
  // than the stack's blocks (the constructor checks ModelTechniques's the same way).
  void set_checkpoint_activations(bool on, int blocks = -1);
  // Layer offload: the streamed blocks' host gradients waited for at backward's end instead of
  // after each block (CheckpointHooks::defer_host_gradient_wait: only where nothing reads them
  // during backward; the trainer decides).
  void set_defer_host_gradient_waits(bool on) { defer_host_gradient_waits_ = on; }
  // Installs this object's runner around the blocks again (another AppliedModel of the same
  // blocks replaced it).
  void install();
  // ZeRO-3: the trainer's units and the prefixes they were cut by, over its parameters.
  void use_units(ParameterUnits* units, const std::vector<std::string>& prefixes, const std::vector<std::string>& names);

  // The whole model's mean loss on a batch (one stage only).
  at::Tensor loss(const Batch& batch);
  // A pipeline stage's part: the first stage runs pre on the micro-batch (x undefined), every
  // stage its blocks, the last post, returning the mean loss; the others the activation.
  at::Tensor stage_forward(const at::Tensor& x, const Batch& micro);
  // An interleaved stage's model chunk: pre on virtual stage 0 (x undefined), the chunk's
  // blocks, post on the last virtual stage (the mean loss); otherwise the activation.
  at::Tensor chunk_forward(const at::Tensor& x, const Batch& micro, int chunk);
  // The virtual stage (chunk c P + stage) a parameter of this stage belongs to by its name: pre's
  // with virtual stage 0, post's with the last; -1 for a name in no piece.
  int virtual_stage_of(const std::string& name) const;
  const ModelSpec& spec() const { return spec_; }
  const ModelTechniques& techniques() const { return t_; }
  bool first_stage() const { return t_.stage == 0; }
  bool last_stage() const { return t_.stage == t_.stages - 1; }

 private:
  friend class TechniqueRunner;
  at::Tensor run_pre(const Batch& batch);
  at::Tensor run_post(const at::Tensor& h, const Batch& batch);
  void check_checkpoint_blocks(int blocks) const;
  ModelSpec spec_;
  ModelTechniques t_;
  std::shared_ptr<offload::LayerStreamer> streamer_;
  bool defer_host_gradient_waits_ = false;
  std::shared_ptr<BlockRunner> runner_;
  ParameterUnits* units_ = nullptr;
  // The unit of each piece: [0] pre's modules, [1 + i] this stage's block i, [blocks + 1]
  // post's modules (-1: the piece has no trainable parameters, or the stage lacks it).
  std::vector<int> piece_unit_;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
