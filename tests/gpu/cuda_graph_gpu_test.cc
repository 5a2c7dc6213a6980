// --cuda_graph (train/graphed_loss.h) on CUDA: the library GPT trained with the loss's forward
// and backward replayed from CUDA graphs against the same run launched eagerly (the same losses
// and weights: the graphs replay the eager kernels on the same inputs), the fallback for a
// batch of other shapes, and the host-synchronization counter (--count_host_syncs).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/parallel/fused_block_ops.h"
#include "dtrain/engine/train/graphed_loss.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine {
namespace cuda_graph_test {

const c10::Device kCuda(c10::kCUDA, 0);

struct GraphRun {
  std::vector<double> losses;
  std::vector<at::Tensor> weights;
};

// A small GPT and its trainer: AdamW with clipping, `steps` steps.
struct SmallGpt {
  std::unique_ptr<dist::Communicator> comm = dist::create_communicator("local", dist::World{}, kCuda);
  dist::Mesh mesh{*comm, 1};
  GptOptions go;
  Gpt model{nullptr};
  std::unique_ptr<Trainer> trainer;
  SmallGpt(bool graph, AmpMode amp, int steps, int accum, const std::string& optimizer = "adamw") {
    torch::manual_seed(7);
    go.vocab = 96, go.d_model = 64, go.heads = 4, go.ff = 128, go.seq_len = 32, go.layers = 2;
    model = Gpt(go, mesh.tp());
    model->to(kCuda);
    TrainerOptions o;
    o.steps = steps;
    o.progress = false;
    o.handle_preemption = false;
    o.optimizer.name = optimizer;
    o.optimizer.lr = 1e-3;
    o.clip_grad_norm = 1.0;
    o.amp = amp;
    o.cuda_graph = graph;
    o.accum_steps = accum;
    Gpt m = model;
    LossFn loss = [m](const Batch& b) mutable { return m->loss(b.fields[0], b.fields[1]); };
    trainer = std::make_unique<Trainer>(*model, loss, mesh, kCuda, o);
  }
};

// `steps` steps on fixed random batches of `rows` rows (`odd_rows` > 0: every third batch has
// that many rows instead).
// `move_at` > 0: before that step every parameter's data moves to new memory (set_data).
GraphRun train_gpt(bool graph, AmpMode amp, int steps, int64_t rows, int64_t odd_rows = 0, int accum = 1,
                   int move_at = 0) {
  SmallGpt small(graph, amp, steps, accum);
  const GptOptions& go = small.go;
  Trainer& trainer = *small.trainer;
  Gpt& model = small.model;
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  GraphRun run;
  for (int s = 0; s < steps; ++s) {
    const int64_t n = odd_rows > 0 && s % 3 == 2 ? odd_rows : rows;
    at::Tensor tokens = at::randint(go.vocab, {n, go.seq_len + 1}, g, at::kLong).to(kCuda);
    Batch b;
    b.fields = {tokens.narrow(1, 0, go.seq_len).contiguous(), tokens.narrow(1, 1, go.seq_len).contiguous()};
    if (s + 1 == move_at) {
      at::NoGradGuard no_grad;
      for (at::Tensor& p : model->parameters()) p.set_data(p.detach().clone());
    }
    trainer.step(b);
    run.losses.push_back(trainer.last_loss());
  }
  for (const at::Tensor& p : model->parameters()) run.weights.push_back(p.detach().cpu());
  return run;
}

void expect_same_training(const GraphRun& eager, const GraphRun& graphed, double tol) {
  ASSERT_EQ(eager.losses.size(), graphed.losses.size());
  bool identical = true;
  for (size_t s = 0; s < eager.losses.size(); ++s) {
    EXPECT_NEAR(graphed.losses[s], eager.losses[s], tol * std::abs(eager.losses[s])) << "step " << s + 1;
    identical = identical && graphed.losses[s] == eager.losses[s];
  }
  for (size_t i = 0; i < eager.weights.size(); ++i) {
    EXPECT_TRUE(at::allclose(graphed.weights[i], eager.weights[i], tol, tol)) << "parameter " << i;
    identical = identical && at::equal(graphed.weights[i], eager.weights[i]);
  }
  std::printf("[ cuda_graph ] losses and weights %s the eager run's\n", identical ? "bit-identical to" : "close to");
}

TEST(CudaGraphGpu, ReplayedStepsTrainAsTheEagerOnes) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  ASSERT_TRUE(cuda_graphs_compiled());
  const GraphRun eager = train_gpt(false, AmpMode::kOff, 8, 4);
  const GraphRun graphed = train_gpt(true, AmpMode::kOff, 8, 4);
  expect_same_training(eager, graphed, 1e-5);
  // Training happened: the loss moved.
  EXPECT_NE(graphed.losses.front(), graphed.losses.back());
}

TEST(CudaGraphGpu, ReplayedBf16StepsTrainAsTheEagerOnes) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const GraphRun eager = train_gpt(false, AmpMode::kBf16, 8, 4);
  const GraphRun graphed = train_gpt(true, AmpMode::kBf16, 8, 4);
  expect_same_training(eager, graphed, 1e-3);
}

// dtrain's fused block kernels (fused_block_ops.h, on for the test) captured and replayed: the
// workspaces come from the graph's private pool, the kernels run on the capturing stream.
TEST(CudaGraphGpu, FusedBlockKernelsReplayAsTheEagerOnes) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  set_fused_block_ops(true);
  struct Restore {
    ~Restore() { set_fused_block_ops(std::nullopt); }
  } restore;
  for (const AmpMode amp : {AmpMode::kOff, AmpMode::kBf16}) {
    const GraphRun eager = train_gpt(false, amp, 8, 4);
    const GraphRun graphed = train_gpt(true, amp, 8, 4);
    expect_same_training(eager, graphed, amp == AmpMode::kOff ? 1e-5 : 1e-3);
    EXPECT_NE(graphed.losses.front(), graphed.losses.back());
  }
}

// Every third batch has 2 rows instead of 4: those run eagerly, the others replay.
TEST(CudaGraphGpu, ABatchOfOtherShapesRunsEagerly) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const GraphRun eager = train_gpt(false, AmpMode::kOff, 9, 4, 2);
  const GraphRun graphed = train_gpt(true, AmpMode::kOff, 9, 4, 2);
  expect_same_training(eager, graphed, 1e-5);
}

// Parameters moved to new memory after the capture (step 3): the graphs, which read the old
// addresses, are captured again at step 6 instead of replaying stale (freed) memory.
TEST(CudaGraphGpu, ParametersMovedAfterTheCaptureAreCapturedAgain) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const GraphRun eager = train_gpt(false, AmpMode::kOff, 9, 4, 0, 1, 6);
  const GraphRun graphed = train_gpt(true, AmpMode::kOff, 9, 4, 0, 1, 6);
  expect_same_training(eager, graphed, 1e-5);
}

// Two micro-batches per step: the second replay must not overwrite the first one's gradients.
TEST(CudaGraphGpu, AccumulatedMicroBatchesReplayAsTheEagerOnes) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const GraphRun eager = train_gpt(false, AmpMode::kOff, 6, 4, 0, 2);
  const GraphRun graphed = train_gpt(true, AmpMode::kOff, 6, 4, 0, 2);
  expect_same_training(eager, graphed, 1e-5);
}

// The host's synchronizations with the device inside steps 4-8 (batches made beforehand), eager
// and replayed: none (the non-finite watch reads nothing on the host with AdamW, whose fused
// kernel drops a flagged update, nor with Adagrad, whose fused kernel does too).
int64_t syncs_in_steps(bool graph, const std::string& optimizer) {
  SmallGpt small(graph, AmpMode::kBf16, 8, 1, optimizer);
  const GptOptions& go = small.go;
  Trainer& trainer = *small.trainer;
  std::vector<Batch> batches(8);
  for (Batch& b : batches) {
    at::Tensor tokens = at::randint(go.vocab, {4, go.seq_len + 1}, at::device(kCuda).dtype(at::kLong));
    b.fields = {tokens.narrow(1, 0, go.seq_len).contiguous(), tokens.narrow(1, 1, go.seq_len).contiguous()};
  }
  for (int s = 0; s < 3; ++s) trainer.step(batches[s]);
  int64_t count = 0;
  {
    SyncCounter counter;
    for (int s = 3; s < 8; ++s) trainer.step(batches[s]);
    count = counter.count();
  }
  EXPECT_TRUE(std::isfinite(trainer.last_loss()));
  return count;
}

TEST(CudaGraphGpu, StepsReadNothingOnTheHost) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  for (const std::string optimizer : {"adamw", "adagrad"}) {
    EXPECT_EQ(syncs_in_steps(false, optimizer), 0) << optimizer;
    EXPECT_EQ(syncs_in_steps(true, optimizer), 0) << optimizer;
  }
}

TEST(CudaGraphGpu, TheSyncCounterCountsHostReads) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  at::Tensor x = at::ones({1024}, at::device(kCuda));
  int64_t none = -1, two = -1;
  {
    SyncCounter counter;
    at::Tensor y = x * 2 + 1;  // device work only
    none = counter.count();
    (void)y.sum().item<float>();
    (void)y.cpu();
    two = counter.count();
  }
  EXPECT_EQ(none, 0);
  EXPECT_GE(two, 2);
  // Outside its life nothing is counted and the mode is restored.
  SyncCounter later;
  EXPECT_EQ(later.count(), 0);
}

}  // namespace cuda_graph_test
}  // namespace dtrain::engine
