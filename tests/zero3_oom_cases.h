// ZeRO-3's OOM back-off through the Trainer, on the CPU (tests/mpi) and on a GPU (tests/gpu).
#pragma once

#include <gtest/gtest.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine::zero3_oom_cases {

// ZeRO-3 (--shard=parameters): a rank that runs out of memory mid-step still owes the other
// ranks the step's unit gathers and gradient reductions, interleaved in the order of the step's
// graph. Four units of one linear layer each, buckets of one parameter. The last rank fails
// (16 -> 8 -> 4 rows, two back-offs) either in unit 2's forward (after unit 0's and 1's gathers
// and unit 2's prefetch went out) or in unit 1's backward (after units 3 and 2 were gathered
// again and their gradients reduced), also with activation checkpointing (each unit gathered a
// third time for its recomputation). Every rank must come out of the step together and end
// where the unsharded run on micro-batches of 4 rows from the start ends.
struct Zero3OomStack : torch::nn::Module {
  Zero3OomStack() {
    torch::manual_seed(0);
    const int64_t in[] = {6, 16, 16, 16}, out[] = {16, 16, 16, 1};
    for (int k = 0; k < 4; ++k) layers.push_back(register_module("l" + std::to_string(k), torch::nn::Linear(in[k], out[k])));
    to(torch::kFloat64);
  }
  std::vector<torch::nn::Linear> layers;
};

// Identity forward; its backward throws what the CUDA caching allocator throws.
struct Zero3OomInBackward : public torch::autograd::Function<Zero3OomInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.view_as(x); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated in backward for a test)");
  }
};

enum class Zero3Fail { kNone, kForward, kBackward, kAlways };

inline std::vector<at::Tensor> zero3_oom_run(c10::Device device, const std::string& shard, int accum, Zero3Fail fail,
                                             std::vector<int>* accum_seen, bool checkpointed = false) {
  auto& comm = testing_util::world_comm();
  dist::Mesh mesh(comm, 1);
  // Not in a shared_ptr (as a user's `Net net;`): the trainer must not need one.
  Zero3OomStack net;
  Zero3OomStack* model = &net;
  model->to(device);
  TrainerOptions o;
  o.steps = 4;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.01;
  o.progress = false;
  o.accum_steps = accum;
  o.shard = shard;
  o.reducer.first_bucket_bytes = o.reducer.bucket_bytes = 64;  // a bucket per parameter
  if (shard == "parameters") o.shard_unit_starts = {"l0.", "l1.", "l2.", "l3."};
  Trainer* trainer = nullptr;
  const bool failing = comm.rank() == comm.size() - 1;
  LossFn loss = [&](const Batch& b) {
    const bool oom = fail == Zero3Fail::kAlways || (failing && fail != Zero3Fail::kNone && b.size() > 4);
    ParameterUnits* units = trainer->parameter_units();
    at::Tensor x = b.fields[0].to(device);
    for (int k = 0; k < 4; ++k) {
      auto layer = [&, k, oom](const at::Tensor& in) {  // recomputed in backward: oom by value
        if (k == 2 && oom && fail != Zero3Fail::kBackward) {
          TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated in forward for a test)");
        }
        at::Tensor y = model->layers[k]->forward(in);
        if (k < 3) y = torch::tanh(y);
        return k == 1 && oom && fail == Zero3Fail::kBackward ? Zero3OomInBackward::apply(y) : y;
      };
      if (!units) {
        x = layer(x);
      } else if (!checkpointed) {
        x = units->run(k, [&] { return layer(x); });
      } else {  // as the example GPT: the recomputation in backward gathers the unit again
        CheckpointHooks hooks;
        hooks.before_forward = [units, k] { units->before_forward(k); };
        hooks.after_forward = [units, k] { units->after_forward(k); };
        hooks.before_recompute = [units, k] { units->before_backward(k); };
        x = checkpoint(layer, x, model->layers[k]->parameters(), hooks);
      }
    }
    return torch::mse_loss(x, b.fields[1].to(device));
  };
  Trainer t(*model, loss, mesh, device, o);
  trainer = &t;
  for (int64_t s = 0; s < o.steps; ++s) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(s * 100 + comm.rank());
    Batch batch;
    batch.fields = {at::randn({16, 6}, g, at::kDouble), at::randn({16, 1}, g, at::kDouble)};
    StepResult r = t.step(batch);
    if (accum_seen) accum_seen->push_back(t.accum_steps());
    if (s == 0 && fail != Zero3Fail::kNone) EXPECT_EQ(r.oom_retries, 2);
  }
  if (t.parameter_units()) t.parameter_units()->gather_all();
  std::vector<at::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().cpu().clone());
  if (t.parameter_units()) t.parameter_units()->release_all();
  return params;
}

inline void expect_back_off_matches_the_smaller_micro_batches(c10::Device device) {
  auto& comm = testing_util::world_comm();
  const std::vector<at::Tensor> want = zero3_oom_run(device, "none", 4, Zero3Fail::kNone, nullptr);
  for (int run = 0; run < 4; ++run) {
    const Zero3Fail where = run % 2 ? Zero3Fail::kBackward : Zero3Fail::kForward;
    const bool checkpointed = run >= 2;
    SCOPED_TRACE(std::string(where == Zero3Fail::kForward ? "out of memory in unit 2's forward" : "in unit 1's backward") +
                 (checkpointed ? ", activation checkpointing (unit 1 is recomputed when it fails)" : ""));
    std::vector<int> seen;
    const std::vector<at::Tensor> got = zero3_oom_run(device, "parameters", 1, where, &seen, checkpointed);
    ASSERT_EQ(seen.size(), 4u);
    for (int a : seen) EXPECT_EQ(a, 4) << "every rank must agree on the new accumulation";
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LT(testing_util::rel_error(got[i], want[i]), 1e-10) << "parameter " << i;
      at::Tensor mx = got[i].clone(), mn = got[i].clone();  // every rank holds the same weights
      comm.all_reduce(mx, dist::ReduceOp::kMax)->wait();
      comm.all_reduce(mn, dist::ReduceOp::kMin)->wait();
      EXPECT_TRUE(at::equal(mx, mn)) << "parameter " << i;
    }
  }
  // Out of memory also on one row: a clear error on every rank, no hang.
  try {
    zero3_oom_run(device, "parameters", 1, Zero3Fail::kAlways, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("even on one row per micro-batch"), std::string::npos) << e.what();
  }
}

}  // namespace dtrain::engine::zero3_oom_cases
