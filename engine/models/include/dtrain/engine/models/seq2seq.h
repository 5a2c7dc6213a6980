// An encoder-decoder transformer (the seed benchmark model of train_seq2seq): post-norm
// encoder and decoder layers (as torch.nn.Transformer with its default norm_first=false), token
// embeddings with sinusoidal positions, output projection over the vocabulary. Attention runs
// through ATen's scaled_dot_product_attention.
//
// The techniques that apply: data parallelism, ZeRO-1/2 (--shard=optimizer/gradients), optimizer
// offload, and activation checkpointing through Seq2SeqOptions::checkpoint_activations (each
// encoder and decoder layer recomputed in backward). Not yet pipeline stages, ZeRO-3 or layer
// offload: they act on a BlockStack (model_spec.h), whose blocks map one tensor to one tensor,
// and a decoder layer also takes the encoder's output (memory).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include "dtrain/engine/parallel/quantize.h"

namespace dtrain::engine {

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t d_model, int64_t heads, double dropout, bool self_attention);
  // x_q [B, Tq, d], x_kv [B, Tk, d] (ignored for self-attention).
  at::Tensor forward(const at::Tensor& x_q, const at::Tensor& x_kv, bool causal);
  int64_t heads;
  double dropout;
  bool self_attention;
  Linear qkv{nullptr}, q{nullptr}, kv{nullptr}, out{nullptr};
};
TORCH_MODULE(Attention);

struct FeedForwardImpl : torch::nn::Module {
  FeedForwardImpl(int64_t d_model, int64_t ff, double dropout, bool inplace);
  at::Tensor forward(const at::Tensor& x);
  Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
  bool inplace;
};
TORCH_MODULE(FeedForward);

struct EncoderLayerImpl : torch::nn::Module {
  EncoderLayerImpl(int64_t d_model, int64_t heads, int64_t ff, double dropout, bool inplace);
  at::Tensor forward(const at::Tensor& x);
  Attention self_attn{nullptr};
  FeedForward ffn{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Dropout drop1{nullptr}, drop2{nullptr};
};
TORCH_MODULE(EncoderLayer);

struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(int64_t d_model, int64_t heads, int64_t ff, double dropout, bool inplace);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& memory);
  Attention self_attn{nullptr}, cross_attn{nullptr};
  FeedForward ffn{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  torch::nn::Dropout drop1{nullptr}, drop2{nullptr}, drop3{nullptr};
};
TORCH_MODULE(DecoderLayer);

struct Seq2SeqOptions {
  int64_t vocab = 32000, d_model = 512, heads = 8, ff = 2048, max_len = 256;
  int layers = 4;  // encoder layers and decoder layers each
  double dropout = 0.1;
  bool inplace = true;
  bool checkpoint_activations = false;  // each layer recomputed in backward (training only)
  // With checkpoint_activations: only the first N of the 2 x layers layers (the encoder's, then
  // the decoder's) recomputed, the others keeping their activations; -1: every layer.
  int checkpoint_layers = -1;
  bool sparse_embedding = false;  // the token embeddings' gradients sparse (the rows a batch touched)
};

struct Seq2SeqImpl : torch::nn::Module {
  explicit Seq2SeqImpl(const Seq2SeqOptions& o);
  // src [B, S], tgt_in [B, T] token ids -> logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& src, const at::Tensor& tgt_in);
  // Mean cross-entropy of predicting tgt_out (ids in [0, vocab)) from (src, tgt_in): ATen's
  // cross_entropy on the CPU, the fused kernels of parallel/cross_entropy.h on CUDA.
  at::Tensor loss(const at::Tensor& src, const at::Tensor& tgt_in, const at::Tensor& tgt_out);
  Seq2SeqOptions options;
  torch::nn::Embedding src_embed{nullptr}, tgt_embed{nullptr};
  torch::nn::ModuleList encoder, decoder;
  Linear head{nullptr};
  torch::nn::Dropout drop{nullptr};
  at::Tensor positions;  // [max_len, d] sinusoidal, a buffer
};
TORCH_MODULE(Seq2Seq);

}  // namespace dtrain::engine
