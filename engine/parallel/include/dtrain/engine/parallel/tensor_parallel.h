// Megatron-style tensor parallelism: layers whose weights are split across the ranks of a
// tensor-parallel group, with the communication inside their own autograd functions, so a
// split model computes exactly what the unsplit model computes (up to float rounding).
//
// Every rank of the group runs the same forward on the same input (ranks of one
// tensor-parallel group read the same data). Collectives go over the group's communicator,
// synchronously (the result is needed right away). The communicator must outlive the layer.
//
// Sequence parallelism (Megatron-LM, "Reducing Activation Recomputation in Large Transformer
// Models"), an option of the layers below: between the tensor-parallel regions activations are
// split along the sequence (dimension 1 of batch-first [B, S, ...] tensors), each rank holding
// [B, S/T, ...]. A column-parallel layer all-gathers its input along the sequence (backward:
// reduce-scatter), a row-parallel layer reduce-scatters its output instead of all-reducing it
// (backward: all-gather), and the vocabulary-parallel embedding reduce-scatters its output.
// Parameters replicated over the group that act on sequence-split activations (layer norms,
// the row-parallel bias) see only part of the sequence on each rank: route them through
// copy_to_tensor_parallel (or sequence_parallel_layer_norm) in forward, so autograd sums their
// gradients over the group before they are accumulated. A position table instead gives each
// rank its own rows through scatter_to_sequence_parallel(table, tp, 0), whose backward
// all-gathers the rows' gradients (each position's comes from one rank). This works with
// gradient accumulation, activation checkpointing (the sum is part of the recomputed graph,
// so it happens once) and the data-parallel reducer (which sees the summed gradient). With a
// group of one rank every sequence-parallel primitive is the identity.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/parallel/cached_attention.h"
#include "dtrain/engine/parallel/quantize.h"

namespace dtrain::engine {

// ---- the communication primitives (autograd functions) --------------------------------
// identity forward, all-reduce(sum) of the gradient in backward (Megatron's "f"). Also the
// way to give a replicated parameter used on sequence-split activations its full gradient:
// use copy_to_tensor_parallel(param, tp) in place of param.
at::Tensor copy_to_tensor_parallel(const at::Tensor& x, dist::Communicator& tp);
// all-reduce(sum) forward, identity backward (Megatron's "g")
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, dist::Communicator& tp);
// all-gather of the last dimension forward, this rank's slice of the gradient backward
at::Tensor gather_from_tensor_parallel(const at::Tensor& x, dist::Communicator& tp);
// this rank's slice of the last dimension forward, all-gather of the gradient backward
at::Tensor scatter_to_tensor_parallel(const at::Tensor& x, dist::Communicator& tp);

// Sequence-parallel primitives along dimension `dim` (negative counts from the end). Every
// rank must pass tensors of the same shape and dtype. Results are new contiguous tensors.
// Forward: the concatenation along dim of every rank's x, in rank order ([.., n, ..] ->
// [.., T*n, ..]). Backward: reduce-scatter(sum) of the gradient along dim (the consumer, a
// tensor-parallel region, produces partial gradients on each rank).
at::Tensor gather_from_sequence_parallel(const at::Tensor& x, dist::Communicator& tp, int64_t dim = 1);
// Forward: this rank's chunk along dim of the sum over ranks of x ([.., T*n, ..] -> [.., n,
// ..]). Backward: all-gather of the gradient along dim. Throws dtrain::Error naming the sizes
// when x.size(dim) does not divide by the group size.
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& x, dist::Communicator& tp,
                                               int64_t dim = 1);
// Forward: this rank's chunk along dim of x (x identical on every rank). Backward: all-gather
// of the gradient along dim. Throws dtrain::Error when x.size(dim) does not divide.
at::Tensor scatter_to_sequence_parallel(const at::Tensor& x, dist::Communicator& tp, int64_t dim = 1);

// ln applied to sequence-split x with ln's (replicated) weight and bias routed through one
// copy_to_tensor_parallel, so their gradients are summed over the group (one all-reduce per
// call in backward). The parameters keep their names ("weight", "bias"): checkpoints of the
// plain and the sequence-parallel model are interchangeable.
at::Tensor sequence_parallel_layer_norm(const torch::nn::LayerNorm& ln, const at::Tensor& x,
                                        dist::Communicator& tp);

// Whether the composite layers (attention, MLP, embedding) run sequence-parallel.
enum class SequenceParallel { kOff, kOn };

// How one parameter of a parallel layer is split (for split_state / gather_state and for
// the gradient norm: sharded parameters' squares are summed over the group).
struct ShardSpec {
  int dim = -1;          // split dimension; -1: replicated on every rank
  int parts = 1;         // >1: the dimension holds `parts` stacked blocks (fused q,k,v), each
                         // split evenly, rank r takes its slice of every block
  int64_t full = 0;      // the unsplit size of dim (before padding)
  int64_t padded = 0;    // the size after padding to a multiple of the group (>= full)
};

// Implemented by the parallel layers: the split of each of their own parameters, by the
// parameter's local name ("weight", "bias").
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  virtual std::map<std::string, ShardSpec> shard_specs() const = 0;
};

// Every parameter of model (full dotted name) that is split across the group, with its spec.
std::map<std::string, ShardSpec> collect_shard_specs(torch::nn::Module& model);

// ---- layers -----------------------------------------------------------------------------
// Sizes by constructor, the rest by name (no positional initializers):
//   ParallelLinearOptions o(d_model, 3 * d_model);  o.parts = 3;
struct ParallelLinearOptions {
  ParallelLinearOptions() = default;
  ParallelLinearOptions(int64_t in_features, int64_t out_features) : in(in_features), out(out_features) {}
  int64_t in = 0, out = 0;
  bool bias = true;
  bool gather_output = false;  // column-parallel: all-gather the output features
  int parts = 1;               // column-parallel: out holds `parts` blocks split separately
  bool pad_output = false;     // column-parallel: pad out with zero rows up to a multiple of
                               // the group size (a vocabulary head); else out must divide
  bool sequence_parallel = false;  // column: the input [B, S/T, in] is all-gathered along the
                                   // sequence first; row: the output is reduce-scattered to
                                   // [B, S/T, out] (S must divide by T) and the bias gradient
                                   // summed over the group
};

// y = x W^T + b with W split by output features (rows): this rank computes its slice of y.
// Input gradient all-reduced in backward (sequence_parallel: reduce-scattered).
struct ColumnParallelLinearImpl : torch::nn::Module, TensorParallelModule, QuantizableLinear {
  ColumnParallelLinearImpl(ParallelLinearOptions options, dist::Communicator& tp);
  at::Tensor forward(const at::Tensor& x);
  // x W^T without the bias (for a fused bias + activation: fused_block_ops.h's bias_gelu);
  // only where serves_without_bias(): a float layer with a bias whose output stays split.
  at::Tensor forward_without_bias(const at::Tensor& x);
  bool serves_without_bias() const;
  std::map<std::string, ShardSpec> shard_specs() const override;
  void reset_parameters();
  ParallelLinearOptions options;
  dist::Communicator* tp;
  int64_t padded_out;       // out rounded up to the group size when pad_output
  at::Tensor weight, bias;  // [padded_out/T, in], [padded_out/T]
  void check_quantizable() const override;  // unsplit only (tensor-parallel size 1)

 protected:
  at::Tensor& linear_weight() override { return weight; }
  at::Tensor linear_bias() override { return bias; }
};
TORCH_MODULE(ColumnParallelLinear);

// y = x W^T + b with W split by input features (columns); x is already split (the output of
// a column-parallel layer). The partial products are all-reduced (sequence_parallel:
// reduce-scattered along the sequence); the bias is added once.
struct RowParallelLinearImpl : torch::nn::Module, TensorParallelModule, QuantizableLinear {
  RowParallelLinearImpl(ParallelLinearOptions options, dist::Communicator& tp);
  at::Tensor forward(const at::Tensor& x_parallel);
  std::map<std::string, ShardSpec> shard_specs() const override;
  void reset_parameters();
  ParallelLinearOptions options;
  dist::Communicator* tp;
  at::Tensor weight, bias;  // [out, in/T], [out]
  void check_quantizable() const override;  // unsplit only (tensor-parallel size 1)

 protected:
  at::Tensor& linear_weight() override { return weight; }
  at::Tensor linear_bias() override { return bias; }
};
TORCH_MODULE(RowParallelLinear);

// Embedding whose vocabulary rows are split: rank r owns ids [r*V/T, (r+1)*V/T) of the
// vocabulary padded to a multiple of T; other ids give zeros; the results are all-reduced.
// SequenceParallel::kOn: ids [B, S, ...] give this rank's [B, S/T, ..., dim] (reduce-scatter
// along dimension 1; S must divide by T).
struct VocabParallelEmbeddingImpl : torch::nn::Module, TensorParallelModule {
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, dist::Communicator& tp,
                             SequenceParallel sp = SequenceParallel::kOff);
  at::Tensor forward(const at::Tensor& ids);
  std::map<std::string, ShardSpec> shard_specs() const override;
  int64_t vocab, dim, padded_vocab, start, end;  // this rank's [start, end)
  bool sequence_parallel;
  bool sparse = false;  // sparse (COO) weight gradients: the rows the ids touched (sparse_reducer.h)
  dist::Communicator* tp;
  at::Tensor weight;  // [padded_vocab/T, dim]
};
TORCH_MODULE(VocabParallelEmbedding);

// Mean cross-entropy of logits split by vocabulary ([N, V_padded/T] on each rank, rank r
// holding vocabulary [vocab_start, vocab_start + local)) against targets [N], without ever
// gathering the full logits: the max, the target logit and the sum of exponentials are
// all-reduced. Columns at or beyond real_vocab (padding) are ignored. Gradient: softmax minus
// one-hot on the local slice. CUDA logits of bfloat16, float16 or float32 (2-D, adjacent
// columns) take dtrain's fused kernels, other logits ATen's composition (cross_entropy.h).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab_start, int64_t real_vocab,
                                        dist::Communicator& tp);

// Multi-head self-attention with heads split across the group: fused q,k,v column-parallel
// projection (heads/T heads per rank), scaled_dot_product_attention, row-parallel output.
// SequenceParallel::kOn: x and the result are this rank's [B, S/T, d] of the sequence.
// cp (a context-parallel group of more than one rank, context_parallel.h): x is this rank's
// part of every sequence in the balanced layout, and attention over the whole sequence runs as
// ring_attention over cp (which must outlive the layer); null or one rank: the plain layer.
struct ParallelSelfAttentionImpl : torch::nn::Module {
  ParallelSelfAttentionImpl(int64_t d_model, int64_t heads, bool causal, dist::Communicator& tp,
                            SequenceParallel sp = SequenceParallel::kOff, dist::Communicator* cp = nullptr);
  at::Tensor forward(const at::Tensor& x);  // [B, S, d] -> [B, S, d] (each S/T when sequence-parallel)
  // Incremental decoding of a causal attention (not sequence- or context-parallel): x [B, T, d]
  // at positions start..start+T-1; this rank's keys and values of them go into k_cache and
  // v_cache ([B, local_heads, max_len, head_dim]) and the queries attend to positions
  // 0..start+T-1 (cached_causal_attention). What forward() gives those positions of the whole
  // sequence.
  at::Tensor forward_cached(const at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache, const CachedStep& step);
  int64_t heads, local_heads, head_dim;
  bool causal;
  dist::Communicator* cp;
  ColumnParallelLinear qkv{nullptr};
  RowParallelLinear proj{nullptr};
};
TORCH_MODULE(ParallelSelfAttention);

// The scaled_dot_product_attention backends this process may use, as a comma-separated list of
// flash, fa3, efficient, cudnn and math (torch.backends.cuda.enable_*_sdp): each named one
// enabled, the others disabled; ATen picks among the enabled ones by its priority. An unknown
// name is an error naming the known ones. sdpa_backends_from_env() applies the environment's
// DTRAIN_SDPA_BACKENDS once per process when it is set (the Trainer calls it; unset: ATen's
// defaults). Process-wide, as PyTorch's switches are.
void apply_sdpa_backends(const std::string& list);
void sdpa_backends_from_env();

// Two-layer MLP (GELU) with the hidden features split: column- then row-parallel.
// SequenceParallel::kOn: x and the result are this rank's [B, S/T, d] of the sequence.
struct ParallelMlpImpl : torch::nn::Module {
  ParallelMlpImpl(int64_t d_model, int64_t hidden, dist::Communicator& tp,
                  SequenceParallel sp = SequenceParallel::kOff);
  at::Tensor forward(const at::Tensor& x);
  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMlp);

// ---- splitting and gathering whole models ------------------------------------------------
// This rank's shard of a full (unsplit) tensor under spec.
at::Tensor shard_of(const at::Tensor& full, const ShardSpec& spec, int rank, int size);
// The inverse of shard_of over the whole group: the full tensor (padding dropped) of the
// shards of ranks 0..shards.size()-1, each shaped as a rank's shard under spec (spec.padded
// being the padding of that group size). No communication. Throws dtrain::Error for shards of
// unequal shapes.
at::Tensor join_shards(const std::vector<at::Tensor>& shards, const ShardSpec& spec);
// "dim:parts:full:padded", and back (dtrain::Error naming `source` for malformed text).
std::string to_text(const ShardSpec& spec);
ShardSpec shard_spec_from_text(const std::string& text, const std::string& source);

// Copies an unsplit model's parameters (by full dotted name, e.g. from a checkpoint of the
// plain model) into this rank's split model: sharded ones are sliced, the rest copied.
// Throws dtrain::Error for a missing name or a shape that does not fit.
void load_full_state(torch::nn::Module& split_model, const std::map<std::string, at::Tensor>& full,
                     dist::Communicator& tp);
// The unsplit parameters of a split model (collective over tp): every rank receives them.
// Returns {name: full tensor} on the CPU; padding rows are dropped.
std::map<std::string, at::Tensor> gather_full_state(torch::nn::Module& split_model,
                                                    dist::Communicator& tp);

// The unsplit tensor of which local is this rank's shard under spec (collective over tp;
// every rank receives it, on local's device; padding dropped).
at::Tensor gather_full_tensor(const at::Tensor& local, const ShardSpec& spec, dist::Communicator& tp);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
