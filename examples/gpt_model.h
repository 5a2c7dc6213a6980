// A GPT-style decoder language model (GPT-2 layout: pre-norm blocks, causal self-attention
// through scaled_dot_product_attention, GELU MLP, learned positions, untied output head)
// built from dtrain's tensor-parallel layers, so --tp splits heads, MLP and vocabulary.
// With tp = 1 it is the plain model; any tp draws the same initial full weights.
// sequence_parallel additionally splits the residual stream and the layer norms along the
// sequence over the tensor-parallel group (Megatron-LM sequence parallelism): each rank keeps
// [B, S/T, d] between the parallel regions; the result is the same model (float rounding).
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/offload/layer_offload.h"

namespace dtrain::engine {
class ParameterUnits;
}  // namespace dtrain::engine

namespace dtrain::examples {

struct GptOptions {
  int64_t vocab = 32000, d_model = 768, heads = 12, ff = 3072, seq_len = 1024;
  int layers = 12;
  double dropout = 0.0;
  bool checkpoint_activations = false;
  bool sparse_embedding = false;  // the token embedding's gradient sparse (the rows a batch touched)
  // Split activations between the tensor-parallel regions along the sequence (seq_len must
  // divide by the group size). No effect with a group of one rank.
  bool sequence_parallel = false;
};

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptOptions& o, dist::Communicator& tp);
  at::Tensor forward(const at::Tensor& x);  // [B, S, d], or [B, S/T, d] when sequence-parallel
  at::Tensor norm(torch::nn::LayerNorm& ln, const at::Tensor& x);
  bool sequence_parallel;
  dist::Communicator* tp;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  engine::ParallelSelfAttention attn{nullptr};
  engine::ParallelMlp mlp{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(GptBlock);

struct GptImpl : torch::nn::Module {
  GptImpl(const GptOptions& o, dist::Communicator& tp);
  // tokens [B, T] -> this rank's logits [B, T, padded_vocab / tp].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy: inputs [B, T], targets [B, T].
  at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets);
  // Pipeline parallelism: keeps blocks [begin, end) only, and the embeddings when `first`, the
  // final norm and head when `last`. The blocks keep their whole-model names (blocks.<i>), so a
  // stage's parameters are a part of the whole model's state_dict. Call right after
  // construction: every stage builds the whole model from the same seed and drops the rest, so
  // its weights are those one process would train.
  void keep_stage(int begin, int end, bool first, bool last);
  // A stage's computation: the first stage takes tokens [B, T], the others the residual stream
  // [B, T, d] ([B, T/tp, d] sequence-parallel) the stage before returned; returns the residual
  // stream after its blocks, or on the last stage the mean loss against targets [B, T].
  at::Tensor stage_forward(const at::Tensor& x, const at::Tensor& targets);
  bool first_stage = true, last_stage = true;  // the whole model is both
  int block_base = 0;  // the whole-model index of this stage's first block (the names' index)
  int64_t parameter_count() const;  // of the full (unsplit) model
  // Layer offload: keeps every block's parameters in host memory, streamed to `device` one
  // block ahead in forward and backward (blocks are recomputed in backward). Call after
  // moving the model to the device.
  void offload_blocks(c10::Device device);
  GptOptions options;
  dist::Communicator* tp;
  engine::VocabParallelEmbedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList blocks;  // this stage's (all of them without a pipeline)
  torch::nn::LayerNorm ln_f{nullptr};
  engine::ColumnParallelLinear head{nullptr};
  torch::nn::Dropout drop{nullptr};
  std::shared_ptr<offload::LayerStreamer> streamer;
  // --shard=parameters (ZeRO-3; the whole model, no pipeline): the trainer's units, cut by the
  // same prefixes the trainer was given (TrainerOptions::shard_unit_starts). By default
  // (unit_starts()) the embeddings are unit 0, block i unit i + 1, the final norm and head the
  // last; a coarser choice groups consecutive pieces (several blocks run as one unit). Throws
  // dtrain::Error when a unit would begin inside the embeddings, a block or the head.
  void use_units(engine::ParameterUnits* units, const std::vector<std::string>& prefixes);
  engine::ParameterUnits* units = nullptr;  // null: plain modules
  // The unit of each piece: [0] the embeddings, [1 + i] block i, [blocks + 1] final norm + head.
  std::vector<int> piece_unit;
  std::vector<std::string> unit_starts() const;

 private:
  at::Tensor embed(const at::Tensor& tokens);     // [B, T] -> the residual stream (unit 0)
  at::Tensor embed_tokens(const at::Tensor& tokens);
  at::Tensor run_blocks(at::Tensor x);            // through this stage's blocks
  at::Tensor cross_entropy(const at::Tensor& h, const at::Tensor& targets);  // final norm, head, loss (last unit)
  at::Tensor head_loss(const at::Tensor& h, const at::Tensor& targets);
};
TORCH_MODULE(Gpt);

}  // namespace dtrain::examples
