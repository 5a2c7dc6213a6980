// vocab_parallel_cross_entropy on the CPU (a tensor-parallel group of one rank): ATen's
// composition, never the fused CUDA kernels (parallel/cross_entropy.h). Its loss and gradient
// against PyTorch's cross_entropy in float64 over the real vocabulary (padding columns holding
// garbage, a shard that starts past 0), the dispatch's choice, and the seq2seq model's CPU loss
// still being torch's cross_entropy bit for bit. The CUDA side: tests/gpu/fused_cross_entropy_gpu_test.cc.
#include <gtest/gtest.h>

#include <string>

#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/models/seq2seq.h"
#include "dtrain/engine/parallel/cross_entropy.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "model_cases.h"
#include "test_util.h"

namespace dtrain::engine::cross_entropy_cases {
namespace {

using testing_util::error_of;

std::string node_name(const at::Tensor& loss) {
  return loss.grad_fn() ? loss.grad_fn()->name() : std::string("(none)");
}

// Logits [rows, local] whose first `valid` columns are the real vocabulary (random, a few rows
// confident of their target) and whose padding columns hold 1e4 (must be ignored); targets are
// global ids in [vocab_start, vocab_start + valid).
struct CpuCase {
  at::Tensor logits, targets, local_targets;
};

CpuCase make_cpu_case(int64_t rows, int64_t local, int64_t valid, int64_t vocab_start, at::ScalarType dtype) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(rows * 131 + local);
  CpuCase c;
  c.local_targets = at::randint(valid, {rows}, g, at::kLong);
  at::Tensor x = at::randn({rows, local}, g, at::kDouble) * 3;
  for (int64_t i = 0; i < rows; i += 3) x[i][c.local_targets[i].item<int64_t>()] += 12.0;
  if (valid < local) x.narrow(1, valid, local - valid).fill_(1e4);
  c.logits = x.to(dtype);
  c.targets = c.local_targets + vocab_start;
  return c;
}

// Float64 loss of cross_entropy over the valid columns, and the gradient of loss * scale.
std::pair<double, at::Tensor> float64_reference(const at::Tensor& logits, const at::Tensor& local_targets,
                                                int64_t valid, double scale) {
  at::Tensor x = logits.narrow(1, 0, valid).to(at::kDouble).detach().requires_grad_(true);
  at::Tensor loss = torch::nn::functional::cross_entropy(x, local_targets);
  (loss * scale).backward();
  return {loss.item<double>(), x.grad()};
}

TEST(VocabParallelCrossEntropyCpu, MatchesFloat64CrossEntropyOverTheRealVocabulary) {
  auto tp = testing_util::local_comm();
  struct Shape {
    int64_t rows, local, valid, vocab_start;
  };
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    for (Shape s : {Shape{7, 13, 13, 0}, Shape{9, 16, 11, 0}, Shape{5, 8, 6, 4}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " rows " + std::to_string(s.rows) + " local " +
                   std::to_string(s.local) + " valid " + std::to_string(s.valid) + " start " +
                   std::to_string(s.vocab_start));
      CpuCase c = make_cpu_case(s.rows, s.local, s.valid, s.vocab_start, dtype);
      at::Tensor x = c.logits.clone().requires_grad_(true);
      at::Tensor loss = vocab_parallel_cross_entropy(x, c.targets, s.vocab_start, s.vocab_start + s.valid, *tp);
      EXPECT_EQ(node_name(loss).find("FusedCrossEntropy"), std::string::npos) << node_name(loss);
      EXPECT_NE(node_name(loss).find("VocabParallelCrossEntropy"), std::string::npos) << node_name(loss);
      (loss * 2.5).backward();
      auto [ref_loss, ref_grad] = float64_reference(c.logits, c.local_targets, s.valid, 2.5);
      const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
      EXPECT_NEAR(loss.item<double>(), ref_loss, tol * std::abs(ref_loss));
      ASSERT_EQ(x.grad().scalar_type(), dtype);
      at::Tensor grad = x.grad().to(at::kDouble);
      EXPECT_LT(testing_util::rel_error(grad.narrow(1, 0, s.valid), ref_grad), tol);
      if (s.valid < s.local) {
        EXPECT_EQ(grad.narrow(1, s.valid, s.local - s.valid).abs().max().item<double>(), 0.0);
      }
    }
  }
}

// The dispatch never takes the fused kernels for CPU logits: the result and the gradient are
// those of the composition, bit for bit, in every dtype (bfloat16 included).
TEST(VocabParallelCrossEntropyCpu, CpuLogitsTakeTheCompositionBitForBit) {
  auto tp = testing_util::local_comm();
  for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    CpuCase c = make_cpu_case(11, 24, 21, 0, dtype);
    EXPECT_FALSE(fused_cross_entropy_available(c.logits));
    at::Tensor a = c.logits.clone().requires_grad_(true), b = c.logits.clone().requires_grad_(true);
    at::Tensor la = vocab_parallel_cross_entropy(a, c.targets, 0, 21, *tp);
    at::Tensor lb = composed_vocab_parallel_cross_entropy(b, c.targets, 0, 21, *tp);
    la.backward();
    lb.backward();
    EXPECT_TRUE(at::equal(la, lb));
    EXPECT_TRUE(at::equal(a.grad(), b.grad()));
    EXPECT_EQ(a.grad().scalar_type(), dtype);
  }
}

TEST(VocabParallelCrossEntropyCpu, TheFusedEntryPointsRefuseCpuLogits) {
  auto tp = testing_util::local_comm();
  CpuCase c = make_cpu_case(4, 8, 8, 0, at::kFloat);
  EXPECT_NE(error_of([&] { fused_cross_entropy(c.logits, c.targets); }).find("CUDA logits"), std::string::npos);
  EXPECT_NE(error_of([&] { fused_vocab_parallel_cross_entropy(c.logits, c.targets, 0, 8, *tp); }).find("CUDA"),
            std::string::npos);
  EXPECT_NE(error_of([&] { vocab_parallel_cross_entropy(c.logits, c.targets.narrow(0, 0, 3), 0, 8, *tp); })
                .find("targets [N]"),
            std::string::npos);
}

// The seq2seq model's loss on the CPU is still torch's cross_entropy of its logits, exactly.
TEST(VocabParallelCrossEntropyCpu, Seq2SeqCpuLossIsTorchCrossEntropy) {
  const Seq2SeqOptions o = model_cases::one_layer_seq2seq(37, 16, 8);
  torch::manual_seed(5);
  Seq2Seq model(o);
  at::Tensor src = at::randint(o.vocab, {2, 6}, at::kLong);
  at::Tensor tgt = at::randint(o.vocab, {2, 6}, at::kLong);
  at::Tensor in = tgt.narrow(1, 0, 5), out = tgt.narrow(1, 1, 5);
  at::Tensor loss = model->loss(src, in, out);
  at::Tensor ref = torch::nn::functional::cross_entropy(model->forward(src, in).reshape({-1, o.vocab}),
                                                       out.reshape({-1}));
  EXPECT_TRUE(at::equal(loss, ref)) << loss.item<double>() << " vs " << ref.item<double>();
}

}  // namespace
}  // namespace dtrain::engine::cross_entropy_cases
