// The planner's accuracy check, shared by the CPU unit test and the GPU test: a small
// encoder-decoder transformer is probed once, then trained by the engine's Trainer (forward,
// backward, reducer, optimizer step) under several techniques; each run's allocator peak must
// match the estimate's allocated peak within 10% (the criterion).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/planner.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::engine::planner_testing {

constexpr int64_t kVocab = 512, kD = 64, kHeads = 4, kFf = 256, kSeq = 32, kLayers = 2, kBatch = 8;

// Post-norm encoder-decoder with token embeddings and an output head (torch::nn's layers,
// sequence-first), each layer optionally checkpointed.
struct TinySeq2SeqImpl : torch::nn::Module {
  TinySeq2SeqImpl() {
    src_embed = register_module("src_embed", torch::nn::Embedding(kVocab, kD));
    tgt_embed = register_module("tgt_embed", torch::nn::Embedding(kVocab, kD));
    for (int i = 0; i < kLayers; ++i) {
      encoder.push_back(register_module(
          "enc" + std::to_string(i),
          torch::nn::TransformerEncoderLayer(
              torch::nn::TransformerEncoderLayerOptions(kD, kHeads).dim_feedforward(kFf))));
      decoder.push_back(register_module(
          "dec" + std::to_string(i),
          torch::nn::TransformerDecoderLayer(
              torch::nn::TransformerDecoderLayerOptions(kD, kHeads).dim_feedforward(kFf))));
    }
    head = register_module("head", torch::nn::Linear(kD, kVocab));
    causal = register_buffer("causal",
                             torch::nn::TransformerImpl::generate_square_subsequent_mask(kSeq));
  }
  // w: [B, 2 kSeq + 1] token ids: source, target input and target output windows.
  at::Tensor loss(const at::Tensor& w) {
    at::Tensor src = w.narrow(1, 0, kSeq).t(), tgt_in = w.narrow(1, kSeq, kSeq).t();
    at::Tensor tgt_out = w.narrow(1, kSeq + 1, kSeq).t();
    at::Tensor x = src_embed->forward(src);
    for (auto& layer : encoder) {
      auto* l = layer.get();
      x = checkpointing
              ? checkpoint([l](const at::Tensor& in) { return l->forward(in); }, x, l->parameters())
              : l->forward(x);
    }
    at::Tensor memory = x, y = tgt_embed->forward(tgt_in), mask = causal;
    for (auto& layer : decoder) {
      auto* l = layer.get();
      auto fn = [l, mask](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{l->forward(in[0], in[1], mask)};
      };
      y = checkpointing ? checkpoint(fn, {y, memory}, l->parameters())[0] : fn({y, memory})[0];
    }
    at::Tensor logits = head->forward(y);
    return torch::cross_entropy_loss(logits.reshape({-1, kVocab}), tgt_out.reshape({-1}));
  }
  torch::nn::Embedding src_embed{nullptr}, tgt_embed{nullptr};
  std::vector<torch::nn::TransformerEncoderLayer> encoder;
  std::vector<torch::nn::TransformerDecoderLayer> decoder;
  torch::nn::Linear head{nullptr};
  at::Tensor causal;
  bool checkpointing = false;
};
TORCH_MODULE(TinySeq2Seq);

inline at::Tensor random_rows(int64_t rows, c10::Device device) {
  return at::randint(kVocab, {rows, 2 * kSeq + 1},
                     at::TensorOptions().dtype(at::kLong).device(device));
}

inline int64_t allocated_bytes(c10::Device device) {
  return std::llround(memory_stats(device).allocated_mb * 1024.0 * 1024.0);
}

inline PlanInputs inputs_for(TinySeq2Seq& model, const std::string& optimizer) {
  PlanInputs in;
  for (const at::Tensor& p : model->parameters()) in.parameters += p.numel();
  for (const at::Tensor& b : model->buffers()) in.buffer_bytes += static_cast<int64_t>(b.nbytes());
  in.bytes_per_parameter = 4;
  in.optimizer = optimizer;
  in.batch_size = kBatch;
  in.input_bytes_per_row = (2 * kSeq + 1) * 8;
  in.input_batches = 1;
  return in;
}

struct Variant {
  const char* optimizer;
  bool checkpoint;
  int accum;
  AmpMode amp;
};

// The seed variants: fp32, checkpointing, accumulation (and both), another optimizer, AMP.
inline std::vector<Variant> variants(AmpMode amp) {
  return {{"adamw", false, 1, AmpMode::kOff},
          {"adamw", true, 1, AmpMode::kOff},
          {"adamw", false, 4, AmpMode::kOff},
          {"adamw", true, 2, AmpMode::kOff},
          {"adagrad", false, 2, AmpMode::kOff},
          {"adamw", false, 1, amp},
          {"adamw", true, 2, amp}};
}

// Probes the model on `device`, trains 3 steps of each variant with a fresh Trainer (steps 1
// and 2 cover the reducer's bucket rebuild and the step that still holds the old buckets),
// and checks |estimate - measured peak| < 10% of the measured peak. Measures from the memory
// allocated when called (tensors other tests left alive are not counted).
inline void check_estimates_against_training(c10::Device device, AmpMode amp) {
  auto comm = dist::create_communicator("local", dist::World{}, device);
  dist::Mesh mesh(*comm, 1);
  release_cached_memory(device);
  const int64_t baseline = allocated_bytes(device);
  torch::manual_seed(1);
  TinySeq2Seq model;
  model->to(device);
  model->train();
  ProbeOptions po;
  po.techniques = {{false, AmpMode::kOff}, {true, AmpMode::kOff}, {false, amp}, {true, amp}};
  const ActivationProfile profile = probe_activations(
      [&](int64_t rows, bool ckpt) {
        model->checkpointing = ckpt;
        return model->loss(random_rows(rows, device));
      },
      model->parameters(), device, po);
  std::printf("%s", profile.to_string().c_str());
  for (const ActivationFit& f : profile.fits) {
    EXPECT_GT(f.bytes_per_row, 0) << "checkpoint " << f.checkpoint << " amp " << to_string(f.amp);
  }
  EXPECT_LT(profile.find(true, AmpMode::kOff)->bytes(kBatch),
            profile.find(false, AmpMode::kOff)->bytes(kBatch));
  for (const Variant& v : variants(amp)) {
    const Technique t{v.checkpoint, v.accum, v.amp};
    PlanInputs in = inputs_for(model, v.optimizer);
    in.cuda_context_bytes = device.is_cuda() ? kDefaultCudaContextBytes : 0;
    const int64_t predicted = estimate(in, profile, t).gpu.allocated_peak();
    int64_t measured = 0;
    {
      TrainerOptions o;
      o.accum_steps = v.accum;
      o.amp = v.amp;
      o.optimizer.name = v.optimizer;
      o.progress = false;
      o.oom_backoff = false;
      model->checkpointing = v.checkpoint;
      Trainer trainer(
          *model, [&](const Batch& b) { return model->loss(b.fields[0]); }, mesh, device, o);
      Batch batch;
      batch.fields.push_back(random_rows(kBatch, device));
      reset_peak_memory(device);
      for (int s = 0; s < 3; ++s) trainer.step(batch);
      measured = std::llround(memory_stats(device).peak_mb * 1024.0 * 1024.0) - baseline;
    }
    for (at::Tensor& p : model->parameters()) p.mutable_grad().reset();  // the reducer's buckets go
    const double error = static_cast<double>(predicted - measured) / static_cast<double>(measured);
    std::printf("%-8s %-50s measured %8.3f MiB, estimated %8.3f MiB (%+.1f%%)\n", v.optimizer,
                t.flags().empty() ? "plain" : t.flags().c_str(), measured / 1048576.0,
                predicted / 1048576.0, 100 * error);
    EXPECT_LT(std::abs(error), 0.10) << v.optimizer << " " << t.to_string();
  }
}

}  // namespace dtrain::engine::planner_testing
