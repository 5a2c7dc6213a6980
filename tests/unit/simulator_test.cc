// The step-time simulator (simulator.h): model sizes against dtrain's own models and Hugging
// Face's published counts, the collectives' closed forms, which link a group uses, the pipeline
// part against the schedule's simulation, memory against the ZeRO closed forms, the errors, the
// search, the cluster file, and published training runs (the inputs written down in
// docs/BENCHMARKS.md) within 25%.
#include "dtrain/engine/memory/simulator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/train/measure_model.h"
#include "test_util.h"

namespace dtrain::engine::sim {
namespace {

// Distinct parameters (a tied head lists the embedding's weight again).
int64_t numel(torch::nn::Module& m) {
  int64_t n = 0;
  std::set<const void*> seen;
  for (const auto& p : m.parameters())
    if (seen.insert(p.data_ptr()).second) n += p.numel();
  return n;
}

ModelShape gpt_shape(int64_t layers, int64_t d, int64_t heads, int64_t ff, int64_t vocab, int64_t seq, bool tied) {
  ModelShape m;
  m.family = "gpt";
  m.layers = layers, m.d_model = d, m.heads = heads, m.ff = ff, m.vocab = vocab, m.seq_len = seq;
  m.tie_embeddings = tied;
  return m;
}

Cluster h100s(int nodes, int gpus) {
  Cluster c;
  c.nodes = nodes;
  c.gpus_per_node = gpus;
  return c;
}

TEST(Simulator, ParameterCountsAreThoseOfDtrainsModels) {
  auto tp = testing_util::local_comm();
  for (bool tied : {false, true}) {
    GptOptions o;
    o.vocab = 97, o.d_model = 32, o.heads = 4, o.ff = 80, o.seq_len = 24, o.layers = 3;
    o.tie_embeddings = tied;
    GptImpl gpt(o, *tp);
    const ModelShape s = gpt_shape(3, 32, 4, 80, 97, 24, tied);
    EXPECT_EQ(s.parameters(), numel(gpt)) << "gpt, tied " << tied;
    EXPECT_EQ(s.block_parameters(), numel(*gpt.blocks->children()[0]));
  }
  for (bool tied : {false, true}) {
    LlamaOptions o;
    o.vocab = 101, o.d_model = 48, o.heads = 6, o.kv_heads = 2, o.ff = 72, o.seq_len = 16, o.layers = 2;
    o.tie_embeddings = tied;
    LlamaImpl llama(o, *tp);
    ModelShape s;
    s.family = "llama";
    s.layers = 2, s.d_model = 48, s.heads = 6, s.kv_heads = 2, s.ff = 72, s.vocab = 101, s.seq_len = 16;
    s.tie_embeddings = tied;
    EXPECT_EQ(s.parameters(), numel(llama)) << "llama, tied " << tied;
    EXPECT_EQ(s.block_parameters(), numel(*llama.blocks->children()[0]));
  }
}

TEST(Simulator, HuggingFaceConfigsGiveThePublishedSizes) {
  // meta-llama/Llama-3.1-8B's config.json (the fields the simulator reads): 8,030,261,248.
  const ModelShape llama = model_from_hf_config(
      R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
          "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
          "num_hidden_layers": 32, "num_key_value_heads": 8, "tie_word_embeddings": false, "vocab_size": 128256})",
      8192);
  EXPECT_EQ(llama.parameters(), 8030261248);
  EXPECT_EQ(llama.seq_len, 8192);
  EXPECT_EQ(llama.kv_width(), 1024);
  // openai-community/gpt2: 124,439,808 (tied head).
  const ModelShape gpt2 = model_from_hf_config(
      R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257})");
  EXPECT_EQ(gpt2.parameters(), 124439808);
  EXPECT_EQ(gpt2.seq_len, 1024);
  // The count train_gpt prints: 6 N + 12 L d S.
  EXPECT_DOUBLE_EQ(gpt2.flops_per_token(), 6.0 * 124439808 + 12.0 * 12 * 768 * 1024);
  EXPECT_THROW(model_from_hf_config(R"({"model_type": "llama", "hidden_size": 64})"), dtrain::Error);
  EXPECT_THROW(model_from_hf_config("not json"), dtrain::Error);
  try {
    model_from_hf_config(R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "vocab_size": 50257})");
    FAIL() << "a config without n_layer";
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_layer"), std::string::npos) << e.what();
  }
}

TEST(Simulator, CollectivesTakeTheRingsClosedForm) {
  const Link link{100e9, 5e-6};
  EXPECT_DOUBLE_EQ(allreduce_seconds(1e9, 8, link), 2.0 * 7 / 8 * 1e9 / 100e9 + 14 * 5e-6);
  EXPECT_DOUBLE_EQ(allgather_seconds(1e9, 8, link), 7.0 / 8 * 1e9 / 100e9 + 7 * 5e-6);
  EXPECT_EQ(allreduce_seconds(1e9, 1, link), 0);
  EXPECT_EQ(allgather_seconds(0, 4, link), 0);
}

TEST(Simulator, GroupsUseTheLinkOfTheNodesTheySpan) {
  const Cluster c = h100s(4, 8);
  EXPECT_EQ(&group_link(c, 8, 1), &c.intra);   // tp 8
  EXPECT_EQ(&group_link(c, 2, 4), &c.intra);   // dp 2 over tp 4: ranks 0 and 4
  EXPECT_EQ(&group_link(c, 2, 8), &c.inter);   // dp 2 over tp 8
  EXPECT_EQ(&group_link(c, 16, 1), &c.inter);  // more ranks than a node
  EXPECT_EQ(&group_link(c, 3, 1), &c.inter);   // groups of 3 straddle 8-GPU nodes
}

TEST(Simulator, PipelinePartIsTheSchedulesSimulatedIdleTime) {
  // A small vocabulary: the head adds little to the last stage, so the stages are about equal.
  const ModelShape m = gpt_shape(16, 2048, 16, 8192, 512, 2048, false);
  const Cluster c = h100s(1, 4);
  Layout l;
  l.pp = 4, l.micro_batch_rows = 1;
  auto bubble = [&](int accum, PipelineSchedule s, int chunks) {
    Layout x = l;
    x.accum_steps = accum, x.schedule = s, x.chunks = chunks;
    return simulate(m, c, x);
  };
  // 1F1B's idle time is (P - 1) (f + b) whatever the micro-batches (plus each micro-batch's
  // point-to-point sends): about the same at m 8 and 16, and the busy time doubles.
  const Prediction a = bubble(8, PipelineSchedule::k1F1B, 1), b = bubble(16, PipelineSchedule::k1F1B, 1);
  EXPECT_NEAR(a.parts.pipeline_bubble, b.parts.pipeline_bubble, 0.03 * a.parts.pipeline_bubble);
  EXPECT_NEAR(b.parts.compute, 2 * a.parts.compute, 1e-9);
  EXPECT_GT(a.parts.pipeline_bubble, 0);
  // Per micro-batch the stage's forward + backward (no tp/cp here) is compute / m; the bubble is
  // three of them plus the point-to-point sends.
  EXPECT_NEAR(a.parts.pipeline_bubble / (3 * a.parts.compute / 8), 1.0, 0.05);
  // Interleaved halves the bubble. (dtrain's zb list is ordered at unit costs F = B = W; at this
  // model's costs, B above F and W below it, it does not beat 1F1B: the simulation says so.)
  const Prediction v = bubble(8, PipelineSchedule::kInterleaved, 2);
  EXPECT_NEAR(v.parts.pipeline_bubble / a.parts.pipeline_bubble, 0.5, 0.05);
  EXPECT_GT(bubble(8, PipelineSchedule::kZeroBubble, 1).parts.pipeline_bubble, 0);
  // GPipe holds every micro-batch, 1F1B at most P on stage 0.
  EXPECT_EQ(a.in_flight, 4);
  EXPECT_EQ(bubble(8, PipelineSchedule::kGPipe, 1).in_flight, 8);
  // A large vocabulary makes the last stage the slowest: the steady state runs at its pace and
  // the ramp at the mean stage's, so the step exceeds the equal-stage schedule's.
  ModelShape big = m;
  big.vocab = 128000;
  Layout x = l;
  x.accum_steps = 8;
  const Prediction slow = simulate(big, c, x);
  EXPECT_GT(slow.step_s, a.step_s);
  EXPECT_LT(slow.parts.pipeline_bubble, 3 * slow.parts.compute / 8);
}

TEST(Simulator, ComputeFollowsTheWork) {
  // Large enough to be compute-bound: twice the rows, twice the time; tp 2 halves the matrix
  // multiplies and adds its all-reduces.
  const ModelShape m = gpt_shape(8, 4096, 32, 16384, 32000, 2048, false);
  Layout l;
  l.micro_batch_rows = 2;
  const Prediction one = simulate(m, h100s(1, 1), l);
  l.micro_batch_rows = 4;
  const Prediction two = simulate(m, h100s(1, 1), l);
  EXPECT_NEAR(two.parts.compute / one.parts.compute, 2.0, 0.02);
  Layout t;
  t.tp = 2, t.micro_batch_rows = 2;
  const Prediction split = simulate(m, h100s(1, 2), t);
  EXPECT_LT(split.parts.compute, 0.62 * one.parts.compute);
  EXPECT_GT(split.parts.tensor_parallel, 0);
  // Checkpointing adds one forward: about a third more compute.
  l.micro_batch_rows = 2;
  l.checkpoint = true;
  const double ratio = simulate(m, h100s(1, 1), l).parts.compute / one.parts.compute;
  EXPECT_GT(ratio, 1.25);
  EXPECT_LT(ratio, 1.40);
}

TEST(Simulator, ZeroStagesShardWhatTheyName) {
  const ModelShape m = gpt_shape(24, 2048, 16, 8192, 50304, 1024, false);
  const Cluster c = h100s(1, 8);
  Layout l;
  l.dp = 8, l.micro_batch_rows = 4;
  auto bytes = [&](int zero) {
    Layout x = l;
    x.zero = zero;
    return static_cast<double>(simulate(m, c, x).device_bytes);
  };
  const double N = static_cast<double>(m.parameters());
  // Stage 1 shards the two fp32 moments (8 bytes), stage 2 the gradients too (4), both times
  // the 5% allowance; stage 3 the weights, less two blocks kept whole.
  EXPECT_NEAR(bytes(0) - bytes(1), 1.05 * 8 * N * 7 / 8, 1e3);
  EXPECT_NEAR(bytes(1) - bytes(2), 1.05 * 4 * N * 7 / 8, 1e3);
  EXPECT_NEAR(bytes(2) - bytes(3), 1.05 * (4 * N * 7 / 8 - 2 * 4.0 * static_cast<double>(m.block_parameters())), 1e3);
  // ZeRO-3 moves 3 x (n-1)/n of the weights per micro-batch instead of the all-reduce's 2.
  l.zero = 3;
  l.accum_steps = 1;
  EXPECT_GE(simulate(m, c, l).parts.data_parallel, 0);
}

TEST(Simulator, AModelTooLargeDoesNotFitAndSaysWhy) {
  ModelShape m;
  m.family = "llama";
  m.layers = 80, m.d_model = 8192, m.heads = 64, m.kv_heads = 8, m.ff = 28672, m.vocab = 128256, m.seq_len = 4096;
  Layout l;
  const Prediction p = simulate(m, h100s(1, 1), l);
  EXPECT_FALSE(p.fits);
  EXPECT_NE(p.why_not.find("GiB per rank"), std::string::npos) << p.why_not;
  EXPECT_NE(p.to_string().find("does not fit"), std::string::npos);
  EXPECT_TRUE(nlohmann::json::parse(p.to_json())["fits"] == false);
}

TEST(Simulator, BadLayoutsAreRefusedNamingTheProblem) {
  const ModelShape m = gpt_shape(4, 256, 4, 1024, 4096, 256, false);
  const Cluster c = h100s(1, 4);
  auto message = [&](Layout l) -> std::string {
    try {
      validate(m, c, l);
    } catch (const dtrain::Error& e) {
      return e.what();
    }
    return "";
  };
  Layout l;
  l.dp = 4;
  EXPECT_EQ(message(l), "");
  Layout ranks = l;
  ranks.dp = 2;
  EXPECT_NE(message(ranks).find("uses 2 ranks"), std::string::npos) << message(ranks);
  Layout tp = l;
  tp.dp = 1, tp.tp = 4, tp.tp = 4;
  EXPECT_EQ(message(tp), "");
  ModelShape three = m;
  three.heads = 2;
  tp.tp = 4;
  EXPECT_THROW(validate(three, c, tp), dtrain::Error);
  Layout cp = l;
  cp.dp = 1, cp.cp = 4;
  ModelShape odd = m;
  odd.seq_len = 100;
  EXPECT_THROW(validate(odd, c, cp), dtrain::Error);
  Layout pp = l;
  pp.dp = 1, pp.pp = 4, pp.accum_steps = 2;
  EXPECT_NE(message(pp).find("fewer micro-batches"), std::string::npos) << message(pp);
  pp.schedule = PipelineSchedule::kInterleaved, pp.chunks = 2, pp.accum_steps = 6;
  EXPECT_NE(message(pp).find("chunks"), std::string::npos) << message(pp);  // 8 chunks of 4 layers
  Layout zero = l;
  zero.dp = 1, zero.tp = 4, zero.zero = 1;
  EXPECT_NE(message(zero).find("replicas"), std::string::npos) << message(zero);
  // What dtrain does not run yet is priced but named.
  Layout v;
  v.pp = 2, v.cp = 2, v.accum_steps = 4, v.schedule = PipelineSchedule::kInterleaved, v.chunks = 2, v.zero = 1;
  EXPECT_EQ(message(v), "");
  EXPECT_EQ(dtrain_limitation(v), "");  // interleaved stages with cp and ZeRO run
  Layout lz;
  lz.dp = 4, lz.zero = 1, lz.offload_layers = true;
  EXPECT_NE(dtrain_limitation(lz).find("layer offload with ZeRO"), std::string::npos);
  Layout bf;
  bf.dp = 4, bf.param_bf16 = true;
  EXPECT_NE(dtrain_limitation(bf).find("bf16 weights"), std::string::npos);
  bf.zero = 1;
  EXPECT_EQ(dtrain_limitation(bf), "");
}

// Layer offload runs every streamed block through engine::checkpoint: its compute and the
// activations it keeps are the checkpointed step's.
TEST(Simulator, LayerOffloadRecomputesTheBlocksAsCheckpointingDoes) {
  const ModelShape m = gpt_shape(12, 768, 12, 3072, 50304, 1024, true);
  const Cluster c = h100s(1, 1);
  Layout plain, ckpt, streamed;
  ckpt.checkpoint = true;
  streamed.offload_layers = true;
  const Prediction p = simulate(m, c, plain), k = simulate(m, c, ckpt), s = simulate(m, c, streamed);
  EXPECT_DOUBLE_EQ(s.parts.compute, k.parts.compute);
  EXPECT_GT(s.parts.compute, p.parts.compute * 1.2);
  EXPECT_LT(s.device_bytes, p.device_bytes);
  // The blocks' fp32 weights, gradients and AdamW moments on the host (4 + 4 + 8 bytes), and
  // their update there, slower than the device's.
  EXPECT_EQ(s.host_bytes, 12 * m.block_parameters() * 16);
  EXPECT_GT(s.parts.optimizer, p.parts.optimizer);
}

// --offload=all: the offloaded optimizer holds the fp32 master, moments and gradient copy of the
// parameters on the device; the streamed blocks' weights, gradients and their own optimizer's
// state (fp32 moments, and with bf16 weights an fp32 master) are on the host. Their weights come
// in twice and their gradients go out once per micro-batch, in the weights' dtype.
TEST(Simulator, AllOffloadSplitsTheHostStateAsDtrainKeepsIt) {
  const ModelShape m = gpt_shape(12, 768, 12, 3072, 50304, 1024, false);
  const Cluster c = h100s(1, 1);
  const double streamed = 12.0 * m.block_parameters(), rest = m.parameters() - streamed;
  for (bool bf16 : {false, true}) {
    Layout all;
    all.offload_optimizer = all.offload_layers = true;
    all.param_bf16 = bf16;
    const double w = bf16 ? 2 : 4;
    const Prediction p = simulate(m, c, all);
    EXPECT_NEAR(static_cast<double>(p.host_bytes), rest * (12 + w) + streamed * (2 * w + (bf16 ? 12 : 8)), 1.0)
        << "bf16 " << bf16;
  }
  // Copies longer than the compute (a slow link): the exposed time is the blocks' weights twice
  // and gradients once, in the weights' dtype, less the compute they run behind.
  Cluster slow = c;
  slow.pcie_bytes_per_s = 1e9;
  for (bool bf16 : {false, true}) {
    Layout layers;
    layers.offload_layers = true;
    layers.param_bf16 = bf16;
    const Prediction p = simulate(m, slow, layers);
    const double copy = streamed * 3 * (bf16 ? 2 : 4) / slow.pcie_bytes_per_s;
    EXPECT_NEAR(p.parts.offload, copy - p.parts.compute, 1e-9 * copy) << "bf16 " << bf16;
  }
}

// Data parallelism with layer offload: the streamed blocks' gradients are host tensors, reduced
// by the CPU communicator at no more than the rank's share of the node's memory bandwidth.
TEST(Simulator, LayerOffloadWithZeroKeepsAPositivePeak) {
  // Not a layout dtrain runs (its limitation names it), but other frameworks' figures are priced:
  // the device holds the resident part as ZeRO splits it plus two streamed blocks, never less.
  const ModelShape m = gpt_shape(32, 4096, 32, 14336, 128256, 4096, false);
  const Cluster c = h100s(1, 8);
  for (int zero : {0, 1, 2, 3}) {
    Layout l;
    l.dp = 8, l.zero = zero, l.offload_layers = true;
    Layout resident = l;
    resident.offload_layers = false;
    const Prediction p = simulate(m, c, l), r = simulate(m, c, resident);
    EXPECT_GT(p.device_bytes, 0) << "zero " << zero;
    EXPECT_LT(p.device_bytes, r.device_bytes) << "zero " << zero;
  }
}

TEST(Simulator, StreamedGradientsAreReducedThroughHostMemory) {
  const ModelShape m = gpt_shape(12, 768, 12, 3072, 50304, 1024, false);
  Cluster c = h100s(1, 8);
  Layout plain, streamed;
  plain.dp = streamed.dp = 8;
  streamed.offload_layers = true;
  const Prediction p = simulate(m, c, plain);
  c.host_bytes_per_s = 8 * 2e9;  // 2 GB/s per rank: the host's reduction of 12 blocks is exposed
  const Prediction s = simulate(m, c, streamed);
  const double host_part = allreduce_seconds(12.0 * m.block_parameters() * 4, 8, Link{2e9, c.intra.latency_s});
  EXPECT_GT(s.parts.data_parallel, p.parts.data_parallel + 0.5 * host_part);
  EXPECT_GT(s.parts.data_parallel, host_part - s.parts.compute);
}

// ZeRO-Offload's delayed update: step t's host update runs beside step t + 1's forward and
// backward, so only what exceeds them is on the step; it costs the device a buffer of the new
// weights and the host a second gradient buffer (optimizer offload), or the blocks a master,
// a second weight buffer and held gradients (layer offload). A CPU device hides nothing.
TEST(Simulator, DelayedUpdateHidesTheHostUpdateBehindTheNextStep) {
  const ModelShape m = gpt_shape(32, 4096, 32, 16384, 50304, 1024, false);  // about 6.9B
  const Cluster c = h100s(1, 1);
  Layout ordinary;
  ordinary.offload_optimizer = true, ordinary.param_bf16 = true;
  ordinary.micro_batch_rows = 4;
  Layout delayed = ordinary;
  delayed.delayed_update = true;
  const Prediction o = simulate(m, c, ordinary), d = simulate(m, c, delayed);
  ASSERT_TRUE(o.fits && d.fits) << o.to_string() << " / " << d.to_string();
  EXPECT_GT(o.parts.optimizer, 0.5 * o.parts.compute) << "a host update of 7B parameters is long";
  EXPECT_NEAR(d.parts.optimizer, std::max(0.0, o.parts.optimizer - o.parts.compute), 1e-9 * o.step_s);
  EXPECT_LT(d.step_s, o.step_s);
  const double p = static_cast<double>(m.parameters());
  EXPECT_NEAR(static_cast<double>(d.device_bytes - o.device_bytes), p * 2 * 1.05, 1e-6 * p);
  EXPECT_NEAR(static_cast<double>(d.host_bytes - o.host_bytes), p * 2, 1e-6 * p);
  EXPECT_NE(d.flags().find("--offload_delayed_update_after="), std::string::npos) << d.flags();
  // Layer offload's: the blocks' update hidden; their master and moments (12 bytes), second
  // weight buffer and held gradients (4 + 4) on the host instead of make_optimizer's moments.
  const ModelShape small = gpt_shape(12, 768, 12, 3072, 50304, 1024, false);
  Layout layers;
  layers.offload_layers = true;
  Layout layers_delayed = layers;
  layers_delayed.delayed_update = true;
  const Prediction lo = simulate(small, c, layers), ld = simulate(small, c, layers_delayed);
  const double streamed = 12.0 * small.block_parameters();
  EXPECT_NEAR(static_cast<double>(ld.host_bytes - lo.host_bytes), streamed * (12 + 8 - 8), 1.0);
  EXPECT_LT(ld.parts.optimizer, lo.parts.optimizer);
  // A CPU "device": the update and the compute share the cores.
  Cluster cpu = c;
  cpu.device.cores = 2;
  EXPECT_DOUBLE_EQ(simulate(m, cpu, delayed).parts.optimizer, simulate(m, cpu, ordinary).parts.optimizer);
  // What dtrain refuses, named; no offload: not a layout.
  Layout pp = delayed;
  pp.pp = 2, pp.dp = 1, pp.accum_steps = 2;
  EXPECT_NE(dtrain_limitation(pp).find("pipeline"), std::string::npos);
  Layout two = layers_delayed;
  two.dp = 2;
  EXPECT_NE(dtrain_limitation(two).find("more than one replica"), std::string::npos);
  Layout z3 = delayed;
  z3.dp = 2, z3.zero = 3;
  EXPECT_NE(dtrain_limitation(z3).find("ZeRO-3"), std::string::npos);
  Layout none;
  none.delayed_update = true;
  EXPECT_THROW(simulate(small, c, none), dtrain::Error);
}

// Optimizer offload's copies: the gradients stream to the host during the last backward and
// the new weights go up while the CPU updates the next chunk, so at a batch whose backward
// outlasts the gradients' copy neither is on the step; ZeRO-3's shard is copied after backward.
TEST(Simulator, OffloadCopiesRunBehindBackwardAndTheUpdate) {
  const ModelShape m = gpt_shape(24, 2048, 16, 8192, 50304, 1024, false);  // about 1.3B
  Layout l;
  l.offload_optimizer = true;
  l.micro_batch_rows = 16;
  const Prediction p = simulate(m, h100s(1, 1), l);
  EXPECT_DOUBLE_EQ(p.parts.offload, 0.0) << p.to_string();
  EXPECT_GT(p.parts.optimizer, 0.0);
  Cluster slow = h100s(1, 1);
  slow.pcie_bytes_per_s = 1e9;  // the gradients' copy (5 s) outlasts backward, the weights' the update
  const Prediction q = simulate(m, slow, l);
  const double copy = static_cast<double>(m.parameters()) * 4 / slow.pcie_bytes_per_s;
  EXPECT_GT(q.parts.offload, copy - q.parts.compute + copy - q.parts.optimizer);
  EXPECT_LT(q.parts.offload, 2 * copy);
  Layout z3 = l;
  z3.dp = 2, z3.zero = 3, z3.micro_batch_rows = 8;
  const Prediction r = simulate(m, h100s(1, 2), z3);
  EXPECT_GE(r.parts.offload, static_cast<double>(m.parameters()) / 2 * 4 / 55e9 * 0.999) << r.to_string();
}

// The loss's memory: on a GPU the fused cross-entropy keeps the bf16 logits and writes their
// gradient in bf16 (2 + 2 bytes a logit); ATen's composition on a CPU adds a float32 copy and
// the softmax (2 + 4 + 4).
TEST(Simulator, TheFusedLossKeepsTheLogitsInTheirDtype) {
  const ModelShape m = gpt_shape(12, 768, 12, 3072, 32000, 1024, false);
  Layout l;
  l.micro_batch_rows = 8;
  Cluster gpu = h100s(1, 1), cpu = gpu;
  cpu.device.cores = 1;
  const double logits = 8.0 * 1024 * 32000;
  EXPECT_NEAR(static_cast<double>(simulate(m, cpu, l).device_bytes - simulate(m, gpu, l).device_bytes),
              logits * (2 + 4 + 4 - 2 - 2) * 1.05, 2.0);
}

// A model whose bf16 weights and gradients alone exceed the device: only layer offload (weights
// on the host, a few blocks on the device) fits, and the search finds it and names its flags.
TEST(Simulator, SearchFindsLayerOffloadWhenNothingElseFits) {
  const ModelShape m = gpt_shape(48, 6144, 48, 24576, 50304, 2048, false);  // about 22B
  ASSERT_GT(m.parameters() * 4.0, 80.0 * (1 << 30));
  SearchOptions o;
  o.global_batch_rows = 8;
  o.param_bf16 = true;
  const std::vector<Prediction> ranked = search(m, h100s(1, 1), o);
  ASSERT_FALSE(ranked.empty());
  for (const Prediction& p : ranked) {
    EXPECT_TRUE(p.layout.offload_layers) << p.to_string();
    EXPECT_FALSE(p.layout.checkpoint) << "layer offload recomputes already: " << p.to_string();
    EXPECT_EQ(p.layout.zero, 0) << p.to_string();
    EXPECT_LE(static_cast<double>(p.device_bytes), 80.0 * (1 << 30));
  }
  EXPECT_NE(ranked[0].flags().find("--offload="), std::string::npos) << ranked[0].flags();
  o.allow_offload = false;
  EXPECT_TRUE(search(m, h100s(1, 1), o).empty());
}

TEST(Simulator, SearchRanksWhatFitsAndDtrainRuns) {
  const ModelShape m = gpt_shape(24, 2048, 16, 8192, 50304, 2048, false);
  const Cluster c = h100s(2, 8);
  SearchOptions o;
  o.global_batch_rows = 64;
  o.param_bf16 = true;
  const std::vector<Prediction> ranked = search(m, c, o);
  ASSERT_FALSE(ranked.empty());
  for (size_t i = 0; i < ranked.size(); ++i) {
    EXPECT_TRUE(ranked[i].fits);
    EXPECT_EQ(dtrain_limitation(ranked[i].layout), "");
    EXPECT_EQ(ranked[i].layout.global_batch_rows(), 64);
    EXPECT_EQ(ranked[i].layout.ranks(), 16);
    if (i > 0) EXPECT_LE(ranked[i - 1].step_s, ranked[i].step_s * (1 + 1e-9));
  }
  // Any layout it ranks, priced alone, gives the same figure.
  const Prediction again = simulate(m, c, ranked[ranked.size() / 2].layout);
  EXPECT_DOUBLE_EQ(again.step_s, ranked[ranked.size() / 2].step_s);
  // A model no layout of one GPU holds: nothing.
  ModelShape huge = gpt_shape(96, 12288, 96, 49152, 50304, 2048, false);
  o.allow_offload = false;
  EXPECT_TRUE(search(huge, h100s(1, 1), o).empty());
}

TEST(Simulator, ClusterFileRoundTripsAndRejectsBadValues) {
  Cluster c = h100s(3, 4);
  c.device = named_device("a100");
  c.inter = {12.5e9, 20e-6};
  c.step_overhead_s = 0.004;
  c.compute_scale = 1.3;
  const Cluster back = cluster_from_json(c.to_json());
  EXPECT_EQ(back.nodes, 3);
  EXPECT_EQ(back.gpus_per_node, 4);
  EXPECT_EQ(back.device.name, "a100");
  EXPECT_DOUBLE_EQ(back.device.peak_flops, 312e12);
  EXPECT_DOUBLE_EQ(back.inter.bytes_per_s, 12.5e9);
  EXPECT_DOUBLE_EQ(back.inter.latency_s, 20e-6);
  EXPECT_DOUBLE_EQ(back.step_overhead_s, 0.004);
  EXPECT_DOUBLE_EQ(back.compute_scale, 1.3);
  EXPECT_DOUBLE_EQ(back.scale_at(1e6), 1.3);
  // Calibrated points: log-linear between them, clamped outside.
  c.compute_scale_points = {{512, 0.8}, {2048, 1.0}};
  const Cluster pts = cluster_from_json(c.to_json());
  ASSERT_EQ(pts.compute_scale_points.size(), 2u);
  EXPECT_DOUBLE_EQ(pts.scale_at(100), 0.8);
  EXPECT_DOUBLE_EQ(pts.scale_at(1024), 0.9);
  EXPECT_DOUBLE_EQ(pts.scale_at(4096), 1.0);
  EXPECT_THROW(cluster_from_json(R"({"compute_scale_points": [[2048, 1], [512, 1]]})"), dtrain::Error);
  EXPECT_THROW(cluster_from_json(R"({"device": {"peak_flops": -1}})"), dtrain::Error);
  EXPECT_THROW(cluster_from_json(R"({"nodes": 1.5})"), dtrain::Error);
  EXPECT_THROW(cluster_from_json("{"), dtrain::Error);
  EXPECT_THROW(named_device("tpu"), dtrain::Error);
  // A file whose keys or types the simulator would not read, or efficiencies past the peak: each
  // would leave defaults in place (a default H100) without a word.
  for (const char* bad : {"[]", "42", R"({"device": "h100"})", R"({"devcie": {"peak_flops": 1e12}})",
                          R"({"device": {"peak_flop": 1e12}})", R"({"intra": {"bandwidth": 1e9}})",
                          R"({"device": {"name": 7}})", R"({"device": {"matmul_efficiency": 50}})",
                          R"({"calibrated_model": 3})"}) {
    EXPECT_THROW(cluster_from_json(bad), dtrain::Error) << bad;
  }
  c.calibrated_model = gpt_shape(2, 64, 4, 256, 96, 32, false).to_string();
  EXPECT_EQ(cluster_from_json(c.to_json()).calibrated_model, c.calibrated_model);
  // The named devices hold what nvidia-smi reports (docs/gpu/2026-11-27).
  EXPECT_DOUBLE_EQ(named_device("h100").memory_bytes, 81559.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(named_device("h200").memory_bytes, 143771.0 * (1 << 20));
}

TEST(Simulator, LayoutsOfTiedEmbeddingsAreThoseDtrainRuns) {
  // train_gpt refuses tied embeddings with ZeRO-3 and with pipeline stages: the search never
  // ranks them, a single prediction names them.
  const ModelShape tied = gpt_shape(12, 768, 12, 3072, 50304, 1024, true);
  SearchOptions o;
  o.global_batch_rows = 64;
  const std::vector<Prediction> ranked = search(tied, h100s(1, 8), o);
  ASSERT_FALSE(ranked.empty());
  for (const Prediction& p : ranked) {
    EXPECT_NE(p.layout.zero, 3) << p.to_string();
    EXPECT_EQ(p.layout.pp, 1) << p.to_string();
  }
  Layout z3;
  z3.dp = 8, z3.zero = 3;
  EXPECT_NE(dtrain_limitation(z3, true).find("tied embeddings with ZeRO-3"), std::string::npos);
  EXPECT_EQ(dtrain_limitation(z3, false), "");
  Layout pp;
  pp.pp = 2, pp.accum_steps = 2;
  EXPECT_NE(dtrain_limitation(pp, true).find("pipeline stages"), std::string::npos);
  // Untied, both are ranked.
  bool z3_ranked = false, pp_ranked = false;
  for (const Prediction& p : search(gpt_shape(12, 768, 12, 3072, 50304, 1024, false), h100s(1, 8), o)) {
    z3_ranked = z3_ranked || p.layout.zero == 3;
    pp_ranked = pp_ranked || p.layout.pp > 1;
  }
  EXPECT_TRUE(z3_ranked && pp_ranked);
}

TEST(Simulator, SearchTriesEveryMicroBatchThatDividesTheRows) {
  // 500 sequences over 4 replicas: 125 rows each, micro-batches of 1 and 5 (not only powers of 2).
  const ModelShape m = gpt_shape(12, 768, 12, 3072, 50304, 1024, false);
  SearchOptions o;
  o.global_batch_rows = 500;
  bool five = false;
  for (const Prediction& p : search(m, h100s(1, 4), o)) {
    EXPECT_EQ(p.layout.global_batch_rows(), 500);
    five = five || p.layout.micro_batch_rows == 5;
  }
  EXPECT_TRUE(five);
}

TEST(Simulator, StageBlocksSplitThePipelineAsGiven) {
  const ModelShape m = gpt_shape(32, 2048, 16, 8192, 50304, 1024, false);
  const Cluster c = h100s(1, 4);
  Layout even;
  even.pp = 4, even.accum_steps = 8;
  Layout uneven = even;
  uneven.stage_blocks = "2,2,2,26";  // the last stage holds 26 blocks: it sets the pace and the memory
  const Prediction e = simulate(m, c, even), u = simulate(m, c, uneven);
  EXPECT_GT(u.step_s, 2 * e.step_s);
  EXPECT_GT(u.device_bytes, e.device_bytes);
  EXPECT_NE(u.flags().find("--pp_blocks=2,2,2,26"), std::string::npos) << u.flags();
  uneven.stage_blocks = "8,8,8,9";  // 33 blocks
  EXPECT_THROW(simulate(m, c, uneven), dtrain::Error);
  uneven.stage_blocks = "8,8,8,8";
  EXPECT_NEAR(simulate(m, c, uneven).step_s, e.step_s, 1e-12);  // the even split, named
  Layout one;
  one.stage_blocks = "32";
  EXPECT_THROW(simulate(m, c, one), dtrain::Error);  // needs pp > 1
}

TEST(Simulator, AMeasuredSpecIsPricedByItsOwnTimes) {
  // The library's GPT through its ModelSpec, measured on the CPU: the pieces' parameters are
  // the shape's, the message is the blocks' input, the lines are positive, and the layouts
  // that need the blocks' shape (tp, cp) are refused.
  auto tp = testing_util::local_comm();
  GptOptions o;
  o.vocab = 97, o.d_model = 32, o.heads = 4, o.ff = 64, o.seq_len = 16, o.layers = 4;
  torch::manual_seed(3);
  auto gpt = std::make_shared<GptImpl>(o, *tp);
  gpt->train();
  const ModelSpec spec = gpt_spec(gpt);
  MeasureOptions mo;
  mo.tokens_per_row = static_cast<double>(o.seq_len);
  const MeasuredModel m = measure_model(spec, c10::Device(c10::kCPU), [&](int64_t rows) {
    Batch b;
    b.fields = {at::randint(o.vocab, {rows, o.seq_len + 1}, at::kLong)};  // a window: inputs and targets
    return b;
  }, mo);
  const ModelShape shape = gpt_shape(4, 32, 4, 64, 97, 16, false);
  EXPECT_EQ(m.blocks, 4);
  EXPECT_EQ(m.block_parameters, shape.block_parameters());
  EXPECT_EQ(m.pre_parameters, shape.embedding_parameters());
  EXPECT_EQ(m.pre_parameters + 4 * m.block_parameters + m.post_parameters, shape.parameters());
  EXPECT_DOUBLE_EQ(m.activation_bytes_per_row, 16.0 * 32 * 4);  // [rows, S, d] float32
  EXPECT_GT(m.block_held_bytes_per_row, m.activation_bytes_per_row);
  EXPECT_GT(m.post_held_bytes_per_row, 16.0 * 97 * 4);  // at least the logits
  EXPECT_GT(m.block_forward.at(2) + m.block_backward.at(2), 0);
  for (const auto& p : gpt->parameters()) EXPECT_FALSE(p.grad().defined());
  // The file round trip.
  const MeasuredModel back = measured_model_from_json(m.to_json());
  EXPECT_EQ(back.block_parameters, m.block_parameters);
  EXPECT_DOUBLE_EQ(back.block_backward.per_row, m.block_backward.per_row);
  EXPECT_THROW(measured_model_from_json(R"({"blocks": 2})"), dtrain::Error);
  // Priced: dp 2 moves the gradients' all-reduce; pp 2 over 4 micro-batches has a bubble.
  Cluster c = h100s(1, 2);
  Layout l;
  l.dp = 2, l.micro_batch_rows = 2;
  const Prediction dp = simulate(m, c, l);
  EXPECT_TRUE(dp.fits);
  EXPECT_NEAR(dp.tokens_per_s, 2 * 2 * 16 / dp.step_s, 1e-6 * dp.tokens_per_s);
  Layout pp;
  pp.pp = 2, pp.accum_steps = 4, pp.micro_batch_rows = 1;
  EXPECT_GT(simulate(m, c, pp).parts.pipeline_bubble, 0);
  Layout split;
  split.tp = 2, split.micro_batch_rows = 2;
  EXPECT_THROW(simulate(m, c, split), dtrain::Error);
  SearchOptions so;
  so.global_batch_rows = 8;
  const std::vector<Prediction> ranked = search(m, c, so);
  ASSERT_FALSE(ranked.empty());
  for (const Prediction& p : ranked) EXPECT_TRUE(p.layout.tp == 1 && p.layout.cp == 1);
}

// Published runs (docs/BENCHMARKS.md, "Step-time simulator", gives each one's source and inputs):
// the prediction within 25% of the published step time.
TEST(Simulator, PredictsPublishedRunsWithin25Percent) {
  struct Case {
    const char* name;
    ModelShape model;
    Cluster cluster;
    Layout layout;
    double published_s;
  };
  std::vector<Case> cases;
  {  // llm.c GPT-2 124M: 8 x A100 80GB SXM, 64 x 1024 per GPU, ZeRO-1, ~300 ms per step.
    Case k{"llm.c gpt2 124M on 8 A100", gpt_shape(12, 768, 12, 3072, 50304, 1024, true), h100s(1, 8), {}, 0.300};
    k.cluster.device = named_device("a100");
    k.cluster.intra = {240e9, 3e-6};
    k.layout.dp = 8, k.layout.zero = 1, k.layout.micro_batch_rows = 64;
    cases.push_back(k);
    k.name = "llm.c gpt2 124M on 8 H100";  // the same recipe on H100s: 140 ms (modded-nanogpt's record)
    k.cluster = h100s(1, 8);
    k.published_s = 0.140;
    cases.push_back(k);
  }
  for (auto [gpus, published] : {std::pair<int, double>{96, 118.3}, {4608, 2.74}}) {
    // Megatron-Core's GPT-3 175B strong scaling: tp 8, pp 6, batch 1152 x 4096.
    Case k{"megatron 175B", gpt_shape(96, 12288, 96, 49152, 131072, 4096, false), h100s(gpus / 8, 8), {}, published};
    const int dp = gpus / 48;
    k.layout.tp = 8, k.layout.pp = 6, k.layout.dp = dp, k.layout.zero = 1, k.layout.sequence_parallel = true;
    k.layout.param_bf16 = true;
    k.layout.accum_steps = 1152 / dp;
    k.layout.schedule = PipelineSchedule::kInterleaved, k.layout.chunks = 2;
    cases.push_back(k);
  }
  for (const Case& k : cases) {
    const Prediction p = simulate(k.model, k.cluster, k.layout);
    const double error = (p.step_s - k.published_s) / k.published_s;
    std::cout << "[ simulate ] " << k.name << " (" << k.cluster.ranks() << " GPUs): predicted " << p.step_s
              << " s, published " << k.published_s << " s (" << 100 * error << "%)\n";
    EXPECT_LT(std::abs(error), 0.25) << k.name;
  }
}

}  // namespace
}  // namespace dtrain::engine::sim
