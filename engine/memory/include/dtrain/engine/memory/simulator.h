// The step-time simulator: predicts the time, throughput and memory per rank of one training
// step of a transformer language model for a parallel layout (dp x tp x pp x cp, a ZeRO stage,
// offload, activation checkpointing, micro-batching, a pipeline schedule) on a cluster the user
// may not have (nodes of GPUs of a named kind joined by two classes of link), and searches the
// layouts that fit for the fastest. Pure host arithmetic; nothing here touches a device.
//
// The model of one step, per rank (every stage is priced; the slowest sets the pace):
//   compute   per block and micro-batch of t = rows x seq_len / cp tokens, each operation at
//             the roofline of the device: a matrix multiply of f FLOPs and b bytes takes
//             max(f / (peak x matmul_efficiency), b / (bandwidth x memory_efficiency),
//             kernel_seconds); attention (flash, causal: half the score matrix) at
//             attention_efficiency; the element-wise work (norms, activations, residuals) as
//             memory traffic. Backward: the matrix multiplies twice (input and weight
//             gradients), attention 2.5x, element-wise 2x. Checkpointing adds one forward.
//             The head's logits and the loss on the last stage, the embedding on the first.
//   tensor    Megatron's four all-reduces of a block's activation per micro-batch (forward 2,
//             backward 2; sequence parallelism moves the same bytes as reduce-scatter and
//             all-gather), on the critical path.
//   context   the ring of key/value blocks, cp - 1 steps per block, each overlapped with one
//             step's share of attention (only what exceeds it is exposed); backward twice the
//             bytes (keys, values and their gradients).
//   pipeline  the schedule simulated exactly (pipeline.h: simulate_pipeline) with the stage's
//             forward, input-gradient and weight-gradient times, and each boundary's
//             activation (and its gradient) sent point to point; zb's lists ordered at those
//             costs (the runtime's --pp_zb_costs, which Prediction::flags() carries).
//   data      the gradients' all-reduce over the replicas (dp x cp), overlapped with the last
//             micro-batch's backward except its last bucket; ZeRO 1 and 2 the same bytes
//             (reduce-scatter, then the updated weights all-gathered); ZeRO-3 two all-gathers
//             and a reduce-scatter per micro-batch, prefetched behind compute.
//   optimizer the update at device bandwidth (28 bytes per parameter of the rank's share), or
//             with optimizer offload on the host (the node's bandwidth shared by its ranks) plus
//             gradients down over PCIe behind the last micro-batch's backward (streamed by
//             bucket; ZeRO-3's after it) and weights up behind the chunked host update, in the
//             weights' dtype, then all-gathered over the replicas; the host update (and upload)
//             hidden behind the next step's forward and backward with the delayed update
//             (not on a CPU device, whose cores the two share); layer offload
//             streams each block's weights twice and gradients once per micro-batch behind its
//             compute, updates the blocks on the host with an optimizer of their own, and
//             reduces their (host) gradients through host memory or the network.
//   overheads per micro-batch and per step, from the calibration.
// Collectives take the alpha-beta time of a ring over the group's slowest link: inside a node
// when the group's ranks are all on one (mesh order pp, dp, cp, tp: tp innermost; ranks fill
// nodes in order), else between nodes, at the bus bandwidth per GPU.
//
// Memory per rank: model states (16 bytes per parameter of fp32 weights, gradients and Adam
// moments, as dtrain keeps them with and without AMP, split by ZeRO and offload), activations
// by Korthikanti et al.'s count per block (2022; flash attention, so no score matrix) for each
// micro-batch a stage holds (the schedule's peak in flight), the head's logits, and a context
// and workspace allowance. An estimate for choosing layouts; dtrain-plan's probe is the
// measured one for the machine at hand.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/engine/parallel/pipeline.h"

namespace dtrain::engine::sim {

// A decoder-only transformer in dtrain's GPT (learned positions, LayerNorm and GELU MLP with
// biases) or Llama (rotary positions, RMSNorm, SwiGLU MLP, no biases, grouped-query attention)
// layout.
struct ModelShape {
  std::string family = "gpt";  // "gpt" or "llama"
  int64_t layers = 12, d_model = 768, heads = 12, kv_heads = 0 /*0: heads*/, ff = 3072, vocab = 50304;
  int64_t seq_len = 1024;
  bool tie_embeddings = false;
  bool llama() const { return family == "llama"; }
  int64_t kv_width() const;           // kv_heads x head dimension
  int64_t block_parameters() const;   // one block's
  int64_t embedding_parameters() const;  // token (and GPT's position) embedding
  int64_t head_parameters() const;    // final norm and the output projection (0 if tied, but the norm)
  int64_t parameters() const;         // the whole model's, exactly as dtrain builds it
  // Model FLOPs per token, forward and backward (the count train_gpt prints): 6 N + 12 L d S.
  double flops_per_token() const;
  std::string to_string() const;      // "gpt 124.4M: 12 layers, d 768, 12 heads, ff 3072, vocab 50304, seq 1024"
};
// A model whose shape the simulator does not know (a user's own ModelSpec), measured on the
// machine at hand (engine::measure_model, dtrain/engine/train/measure_model.h): its pieces'
// parameters, their forward and backward times as lines over the micro-batch's rows, and the
// activation bytes they keep. Its layouts are priced on clusters of the device it was measured
// on (the times are that device's), without tensor or context parallelism (a block's split is
// the model's own business).
struct Line {
  double intercept = 0, per_row = 0;
  // The line at `rows`, at least 0 (a negative intercept: the time grew faster than the rows
  // between the two sizes measured, as when a larger micro-batch falls out of a cache).
  double at(double rows) const { return std::max(0.0, intercept + per_row * rows); }
  // The line through (r0, y0) and (r1, y1), r1 > r0 (the slope clamped at >= 0).
  static Line through(double r0, double y0, double r1, double y1);
};
struct MeasuredModel {
  std::string name = "measured";
  // What it is and where it was timed, when known: the library model's shape
  // (ModelShape::to_string()) and the device ("cpu", "cuda"; a calibration of that machine names
  // its device "calibrated-<device>"). Empty for a user's own model / an older file.
  std::string shape, device;
  int64_t blocks = 0;
  int64_t block_parameters = 0;   // one block's (the blocks alike)
  int64_t pre_parameters = 0;     // what runs before the blocks (the first stage's)
  int64_t post_parameters = 0;    // after them (the last stage's)
  double tokens_per_row = 1;      // what one row counts for tokens/s (a sequence's tokens)
  double flops_per_row = 0;       // model FLOPs of a row, forward and backward (0: no MFU)
  Line block_forward, block_backward;  // seconds of one block
  Line pre_forward, pre_backward, post_forward, post_backward;
  double activation_bytes_per_row = 0;  // the blocks' input: a stage's message, a checkpoint's
  double block_held_bytes_per_row = 0;  // what a block keeps for backward
  double post_held_bytes_per_row = 0;   // what the loss keeps (logits)
  std::string to_string() const;
  std::string to_json() const;
};
// The MeasuredModel a to_json() text describes; dtrain::Error naming a missing or bad field.
MeasuredModel measured_model_from_json(const std::string& json_text);

// The model of a Hugging Face config.json's text: GPT-2 (model_type "gpt2": n_layer, n_embd,
// n_head, n_inner, n_positions, vocab_size, tie_word_embeddings) or Llama-family (hidden_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
// max_position_embeddings, tie_word_embeddings). seq_len > 0 overrides the config's positions.
// dtrain::Error naming a missing or invalid field.
ModelShape model_from_hf_config(const std::string& json_text, int64_t seq_len = 0);

// A device kind: its roofline and how close to it real kernels come.
struct Device {
  std::string name = "h100";
  double peak_flops = 989e12;        // dense matrix multiply at the step's precision, FLOP/s
  double fp32_flops = 67e12;         // without AMP (float32 matrix multiplies, TF32 off)
  double memory_bytes_per_s = 3.35e12;
  double memory_bytes = 81559.0 * (1 << 20);  // capacity: nvidia-smi's total (an H100 80GB HBM3's)
  double matmul_efficiency = 0.75;   // share of peak_flops a large matrix multiply reaches
  double attention_efficiency = 0.5; // flash attention's share of peak_flops
  double memory_efficiency = 0.8;    // share of memory_bytes_per_s streaming kernels reach
  double kernel_seconds = 5e-6;      // the shortest time of one kernel (launch + tail)
  double context_bytes = 0.5e9;      // CUDA context and library handles outside the allocator
  // A CPU "device" is a rank's threads: the ranks of a node share `cores` cores (0: not shared).
  int cores = 0;
};
// "h100" (SXM, 80 GB), "h200", "a100" (SXM 80 GB), "a100-40gb"; dtrain::Error naming them.
Device named_device(const std::string& name);

// One class of link: the bus bandwidth a ring collective reaches per GPU, and the latency of
// one of its steps.
struct Link {
  double bytes_per_s = 0;
  double latency_s = 0;
};

struct Cluster {
  int nodes = 1;
  int gpus_per_node = 8;
  Device device;
  Link intra{360e9, 3e-6};   // NVLink/NVSwitch (H100: about 360 GB/s of NCCL bus bandwidth)
  Link inter{45e9, 10e-6};   // 400 Gb/s InfiniBand per GPU
  double pcie_bytes_per_s = 55e9;      // host <-> device, per GPU
  double host_bytes_per_s = 150e9;     // the node's CPU memory bandwidth, shared by its ranks
  double host_memory_bytes = 1.5e12;   // per node
  double micro_batch_overhead_s = 0;   // host time per micro-batch beyond the kernels
  double step_overhead_s = 0;          // per optimizer step (loader, logging, clipping)
  // Calibrated multipliers of the predicted compute (measured / predicted on the machine at
  // hand; 1 for a named device): compute_scale, or, when compute_scale_points holds (tokens per
  // micro-batch per rank, scale) points in increasing tokens, the scale interpolated in log tokens
  // between them (clamped at the ends: caches make small micro-batches faster per token on a CPU).
  double compute_scale = 1;
  std::vector<std::pair<double, double>> compute_scale_points;
  // The model --calibrate timed (ModelShape::to_string()): the scale is that model's, and a
  // model of another shape carries it only approximately ("" for a named device).
  std::string calibrated_model;
  double scale_at(double tokens) const;
  int ranks() const { return nodes * gpus_per_node; }
  std::string to_string() const;
  std::string to_json() const;
};
// The cluster a JSON file written by to_json (or --calibrate) describes; fields not given keep
// `defaults`. dtrain::Error naming an invalid field, a key it does not know (a misspelling would
// keep the default) or a file that is not a JSON object.
Cluster cluster_from_json(const std::string& json_text, const Cluster& defaults = {});

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1;
  int zero = 0;                 // 0 none, 1 optimizer state, 2 + gradients, 3 + weights
  bool offload_optimizer = false;
  bool offload_layers = false;
  // --offload_delayed_update_after: ZeRO-Offload's one-step delayed update, the host update of
  // step t beside step t + 1's forward and backward (with optimizer or layer offload).
  bool delayed_update = false;
  bool checkpoint = false;
  // With checkpoint: the first N blocks of each stage recomputed, the others keeping their
  // activations (--checkpoint_blocks; -1: every block). At most the smallest stage's blocks.
  int checkpoint_blocks = -1;
  bool sequence_parallel = false;
  bool bf16 = true;             // AMP bf16 (else float32 matrix multiplies)
  // --param_dtype=bf16: weights and gradients in bf16 on the device (gathered and reduced at 2
  // bytes), the float32 master weights with the optimizer state (ZeRO or offload).
  bool param_bf16 = false;
  int64_t micro_batch_rows = 1; // sequences per micro-batch per data-parallel rank
  int accum_steps = 1;          // micro-batches per step (a pipeline's micro-batches)
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  int chunks = 1;               // interleaved: model chunks per stage
  std::string stage_blocks;     // --pp_blocks: blocks per stage, "a,b,..." ("": dtrain's even split)
  int ranks() const { return dp * tp * pp * cp; }
  int64_t global_batch_rows() const { return micro_batch_rows * accum_steps * dp; }
  std::string to_string() const;  // "dp 8 tp 1 pp 1 cp 1 zero 3 mb 2x4 ckpt"
  std::string flags() const;      // the train_gpt flags: "--tp=2 --pp=2 --accum_steps=4 ..."
};

struct StepParts {  // seconds per optimizer step on the slowest rank
  double compute = 0;        // forward + backward (+ recompute), all micro-batches, no bubble
  double tensor_parallel = 0;
  double context_parallel = 0;  // exposed ring time
  double pipeline_bubble = 0;   // the schedule's idle time (including its point-to-point sends)
  double data_parallel = 0;     // exposed gradient reduction (ZeRO's traffic included)
  double optimizer = 0;
  double offload = 0;           // exposed copies and host update
  double overhead = 0;
};

struct Prediction {
  Layout layout;
  bool fits = true;
  std::string why_not;     // when it does not fit or cannot run
  double step_s = 0;
  double tokens_per_s = 0;          // the whole cluster's
  double tokens_per_s_per_gpu = 0;
  double mfu = 0;                   // flops_per_token x tokens/s / (ranks x peak)
  int64_t device_bytes = 0;         // peak per rank (the largest stage)
  int64_t host_bytes = 0;           // per node (offload)
  int in_flight = 1;                // micro-batches held at once by stage 0
  StepParts parts;
  // zb: the F, B and W costs its lists were ordered at (the runtime's --pp_zb_costs).
  PipelineCosts zb_costs;
  // The flags that run this layout as priced: layout.flags(), and --pp_zb_costs for zb.
  std::string flags() const;
  std::string to_string() const;    // one line
  std::string to_json() const;      // one line
};

// Throws dtrain::Error for a layout that cannot be priced: sizes < 1, a layout needing more or
// fewer ranks than the cluster has, tp not dividing heads/kv heads/ff, pp x chunks more than the
// layers, cp not dividing seq_len in 2 cp chunks, ZeRO without replicas, sequence parallelism
// without tp, an interleaved schedule whose chunks do not divide the layers or whose accum_steps
// is not a multiple of pp, accum_steps below pp for 1F1B and zb.
void validate(const ModelShape& model, const Cluster& cluster, const Layout& layout);
// What dtrain does not run yet of a valid layout ("" when it runs it): layer offload with ZeRO
// or zb, bf16 weights without ZeRO or optimizer offload, the delayed update with pipeline stages
// or ZeRO-3 offload, layer offload's delayed update on more than one replica, and for a model
// with tied embeddings ZeRO-3 or pipeline stages. search() keeps to what dtrain runs;
// simulate() prices any valid layout (other frameworks' layouts too).
std::string dtrain_limitation(const Layout& layout, bool tied_embeddings = false);
// The prediction of one layout (validate()d first). fits is false, with why_not, when the peak
// exceeds the device's memory or offload the host's.
Prediction simulate(const ModelShape& model, const Cluster& cluster, const Layout& layout);
// The same for a measured model: its times as measured (the cluster's compute_scale does not
// apply), tp = cp = 1 (dtrain::Error otherwise), the backward split evenly into its input- and
// weight-gradient halves for the zero-bubble schedule. bf16/param_bf16 change only the bytes.
Prediction simulate(const MeasuredModel& model, const Cluster& cluster, const Layout& layout);

struct SearchOptions {
  int64_t global_batch_rows = 0;   // required: sequences per optimizer step
  int64_t max_micro_batch_rows = 16;  // every micro-batch size up to it that divides a replica's rows
  bool allow_offload = true;      // optimizer and layer offload (none on a CPU device: it frees nothing)
  bool allow_context_parallel = true;
  bool bf16 = true;
  bool param_bf16 = false;  // also price --param_dtype=bf16 layouts
};
// Every layout of all the cluster's ranks that validates, dtrain runs and fits, fastest first
// (ties: fewer techniques). A checkpointed layout recomputes the fewest blocks that fit
// (--checkpoint_blocks; every block only when no fewer fit). Empty when nothing fits.
std::vector<Prediction> search(const ModelShape& model, const Cluster& cluster, const SearchOptions& options);
// The same over dp x pp layouts (tp = cp = 1) of a measured model.
std::vector<Prediction> search(const MeasuredModel& model, const Cluster& cluster, const SearchOptions& options);

// The ring all-reduce of `bytes` over n ranks on `link`: 2 (n-1)/n bytes/bw + 2 (n-1) latency;
// an all-gather or reduce-scatter (of the whole `bytes`) is half of it.
double allreduce_seconds(double bytes, int n, const Link& link);
double allgather_seconds(double bytes, int n, const Link& link);
// The link a group of n ranks `stride` ranks apart uses: inside a node when n x stride <= the
// node's GPUs (and the node holds whole groups), else between nodes.
const Link& group_link(const Cluster& cluster, int n, int stride);

}  // namespace dtrain::engine::sim
