// The fused cross-entropy (parallel/cross_entropy.h) on CUDA against PyTorch's cross_entropy
// computed in float64 on the CPU from the same (rounded) logits: bfloat16, float16 and float32
// logits; row lengths that are and are not multiples of the 16-byte packets; odd row counts;
// a backward of loss * scale with scale != 1; padding columns past the real vocabulary and a
// shard that starts past id 0; rows of a strided, misaligned view whose neighbourhood and
// padding hold NaN (a read outside a row's valid columns would show as a NaN loss); 32000
// columns; two tensor-parallel ranks; the dispatch's choice; the seq2seq model's CUDA loss.
//
// Tolerances: the loss is computed in float32 from exact inputs, so 1e-5 relative for every
// dtype. The gradient is computed in float32 and rounded once to the logits' dtype: per element
// |g - ref| <= |ref| * (u + 1e-5) + |scale| / N * 4e-6 (+ 2^-25 for float16's subnormals), u the
// dtype's unit roundoff (bfloat16 2^-8, float16 2^-11, float32 0); the second term covers
// the target column's p - 1 when p is close to 1.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/models/seq2seq.h"
#include "dtrain/engine/parallel/cross_entropy.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "model_cases.h"
#include "test_util.h"

namespace dtrain::engine::fused_ce_cases {
namespace {

const c10::Device kCuda(c10::kCUDA, 0);
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct CeCase {
  at::ScalarType dtype = at::kFloat;
  int64_t rows = 1, local = 1, valid = 1;  // local columns; the first `valid` are real vocabulary
  int64_t vocab_start = 0;                 // this shard's first global id
  double scale = 1.0;                      // backward of loss * scale
  int64_t col_offset = 0, row_pad = 0;     // the view starts col_offset elements into rows of
                                           // col_offset + local + row_pad elements
  std::string name() const {
    return std::string(c10::toString(dtype)) + " [" + std::to_string(rows) + ", " + std::to_string(local) +
           "] valid " + std::to_string(valid) + " start " + std::to_string(vocab_start) + " scale " +
           std::to_string(scale) + " offset " + std::to_string(col_offset) + " pad " + std::to_string(row_pad);
  }
};

// The case's input: a CUDA view [rows, local] (requires grad) inside NaN-filled rows, with NaN
// in the padding columns; the valid logits' values in float64 on the CPU; targets.
struct CeInput {
  at::Tensor storage, view;
  at::Tensor valid64;        // [rows, valid] float64 CPU: exactly the values the kernel reads
  at::Tensor local_targets;  // CPU, in [0, valid)
  at::Tensor targets;        // CUDA, global ids
};

CeInput make_input(const CeCase& c, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  CeInput in;
  in.local_targets = at::randint(c.valid, {c.rows}, g, at::kLong);
  at::Tensor x = at::randn({c.rows, c.valid}, g, at::kDouble) * 3;
  // Every third row confident of its target (p close to 1: the gradient's p - 1 cancels).
  for (int64_t i = 0; i < c.rows; i += 3) x[i][in.local_targets[i].item<int64_t>()] += 12.0;
  x = x.to(c.dtype);
  in.valid64 = x.to(at::kDouble);
  const int64_t stride = c.col_offset + c.local + c.row_pad;
  at::Tensor full = at::full({c.rows, stride}, kNaN, at::TensorOptions().dtype(c.dtype));
  full.narrow(1, c.col_offset, c.valid).copy_(x);
  in.storage = full.to(kCuda);
  in.view = in.storage.narrow(1, c.col_offset, c.local).detach().requires_grad_(true);
  in.targets = (in.local_targets + c.vocab_start).to(kCuda);
  return in;
}

// PyTorch's cross_entropy in float64 over the valid columns; the gradient of loss * scale.
std::pair<double, at::Tensor> float64_reference(const CeInput& in, double scale) {
  at::Tensor x = in.valid64.clone().requires_grad_(true);
  at::Tensor loss = torch::nn::functional::cross_entropy(x, in.local_targets);
  (loss * scale).backward();
  return {loss.item<double>(), x.grad()};
}

double unit_roundoff(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -8) : t == at::kHalf ? std::ldexp(1.0, -11) : 0.0;
}

// Checks a loss and the gradient of loss * c.scale (grad [rows, local] of c.dtype, any
// device) against the float64 reference (ref_grad: the reference's columns of this shard's
// valid columns). The loss also gets 1e-6 absolute: a row of one column has loss 0 exactly,
// float32's log(sum) about 1e-7.
void expect_matches(const CeCase& c, const at::Tensor& loss, const at::Tensor& grad, double ref_loss,
                    const at::Tensor& ref_grad) {
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_NEAR(loss.item<double>(), ref_loss, 1e-5 * std::abs(ref_loss) + 1e-6);
  ASSERT_TRUE(grad.defined());
  ASSERT_EQ(grad.scalar_type(), c.dtype);
  ASSERT_EQ(grad.dim(), 2);
  ASSERT_EQ(grad.size(0), c.rows);
  ASSERT_EQ(grad.size(1), c.local);
  at::Tensor g = grad.cpu().to(at::kDouble);
  if (c.valid < c.local) {
    EXPECT_TRUE(g.narrow(1, c.valid, c.local - c.valid).eq(0).all().item<bool>()) << "padding columns";
  }
  const double atol = std::abs(c.scale) / static_cast<double>(c.rows) * 4e-6 +
                      (c.dtype == at::kHalf ? std::ldexp(1.0, -25) : 0.0);
  at::Tensor err = (g.narrow(1, 0, c.valid) - ref_grad).abs();
  at::Tensor excess = err - (ref_grad.abs() * (unit_roundoff(c.dtype) + 1e-5) + atol);
  const double worst = excess.max().item<double>();
  EXPECT_LE(worst, 0.0) << "largest error " << err.max().item<double>() << " at flat index "
                        << err.argmax().item<int64_t>() << " (reference "
                        << ref_grad.reshape({-1})[err.argmax().item<int64_t>()].item<double>() << ")";
  EXPECT_FALSE(std::isnan(worst));
}

// vocab_parallel_cross_entropy over a group of one: the fused path, checked against the reference.
void check_case(const CeCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name());
  auto tp = dist::create_communicator("local", dist::World{}, kCuda);
  CeInput in = make_input(c, seed);
  ASSERT_TRUE(fused_cross_entropy_available(in.view));
  at::Tensor loss = vocab_parallel_cross_entropy(in.view, in.targets, c.vocab_start, c.vocab_start + c.valid, *tp);
  ASSERT_TRUE(loss.grad_fn());
  EXPECT_NE(loss.grad_fn()->name().find("FusedCrossEntropy"), std::string::npos) << loss.grad_fn()->name();
  (loss * c.scale).backward();
  auto [ref_loss, ref_grad] = float64_reference(in, c.scale);
  expect_matches(c, loss, in.view.grad(), ref_loss, ref_grad);
  // The logits and their NaN surroundings are untouched.
  EXPECT_EQ(in.storage.isnan().sum().item<int64_t>(), c.rows * (c.col_offset + c.local + c.row_pad - c.valid));
}

CeCase make(at::ScalarType dtype, int64_t rows, int64_t local, int64_t valid, double scale = 1.0) {
  CeCase c;
  c.dtype = dtype;
  c.rows = rows;
  c.local = local;
  c.valid = valid;
  c.scale = scale;
  return c;
}

const at::ScalarType kDtypes[] = {at::kBFloat16, at::kHalf, at::kFloat};

TEST(FusedCrossEntropyGpu, MatchesFloat64CrossEntropy) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  uint64_t seed = 1;
  for (at::ScalarType t : kDtypes) {
    check_case(make(t, 37, 1000, 1000), seed++);        // a multiple of 8 columns
    check_case(make(t, 53, 1003, 1003, 3.0), seed++);   // not a multiple of 8 or 4; loss * 3
    check_case(make(t, 29, 515, 515, -0.5), seed++);    // a negative scale
    check_case(make(t, 1, 1, 1), seed++);               // one column: loss 0, gradient 0
    check_case(make(t, 13, 3, 3, 2.0), seed++);         // shorter than a packet
    check_case(make(t, 300, 24, 24), seed++);           // many short rows
  }
}

TEST(FusedCrossEntropyGpu, PaddingColumnsAreIgnoredAndGetNoGradient) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  uint64_t seed = 100;
  for (at::ScalarType t : kDtypes) {
    check_case(make(t, 31, 1024, 1000, 3.0), seed++);  // the last shard of a padded vocabulary
    CeCase c = make(t, 17, 257, 250);
    c.vocab_start = 7;  // this shard holds ids [7, 264), of which [7, 257) are real
    check_case(c, seed++);
    check_case(make(t, 9, 16, 1), seed++);  // one real column
  }
}

TEST(FusedCrossEntropyGpu, StridedMisalignedRowsAreReadWithinTheirColumns) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  uint64_t seed = 200;
  for (at::ScalarType t : kDtypes) {
    CeCase a = make(t, 19, 777, 777, 3.0);
    a.col_offset = 3;  // every row starts 3 elements past a 16-byte boundary
    a.row_pad = 20;
    check_case(a, seed++);
    CeCase b = make(t, 23, 999, 990);
    b.col_offset = 1;  // an odd row stride: each row has its own alignment
    b.row_pad = 1;
    check_case(b, seed++);
    CeCase d = make(t, 11, 64, 64, 1.5);
    d.col_offset = 8;  // aligned rows of a wider tensor
    d.row_pad = 8;
    check_case(d, seed++);
  }
}

TEST(FusedCrossEntropyGpu, VocabularyOf32000Columns) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  check_case(make(at::kBFloat16, 67, 32000, 32000, 3.0), 300);
  check_case(make(at::kFloat, 33, 32000, 32000), 301);
  check_case(make(at::kHalf, 16, 32000, 31999), 302);
}

TEST(FusedCrossEntropyGpu, NonFiniteLogitsGiveANonFiniteLoss) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto tp = dist::create_communicator("local", dist::World{}, kCuda);
  for (double bad : {kNaN, std::numeric_limits<double>::infinity()}) {
    for (at::ScalarType t : kDtypes) {
      at::Tensor x = at::randn({4, 40}, at::TensorOptions().device(kCuda)).to(t);
      x[2][17] = bad;
      at::Tensor targets = at::arange(4, at::TensorOptions().device(kCuda).dtype(at::kLong));
      const double loss = vocab_parallel_cross_entropy(x, targets, 0, 40, *tp).item<double>();
      EXPECT_FALSE(std::isfinite(loss)) << c10::toString(t) << " with " << bad << ": " << loss;
    }
  }
}

// fused_cross_entropy_available() picks the layouts the kernels serve; the others (float64 on
// CUDA here) still take the composition and agree with the reference.
TEST(FusedCrossEntropyGpu, DispatchTakesTheKernelsOnlyWhereTheyApply) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto on = at::TensorOptions().device(kCuda);
  EXPECT_TRUE(fused_cross_entropy_available(at::zeros({4, 8}, on.dtype(at::kBFloat16))));
  EXPECT_TRUE(fused_cross_entropy_available(at::zeros({4, 8}, on.dtype(at::kHalf))));
  EXPECT_TRUE(fused_cross_entropy_available(at::zeros({4, 8}, on.dtype(at::kFloat))));
  EXPECT_FALSE(fused_cross_entropy_available(at::zeros({4, 8}, on.dtype(at::kDouble))));
  EXPECT_FALSE(fused_cross_entropy_available(at::zeros({4, 8}, on).t()));
  EXPECT_FALSE(fused_cross_entropy_available(at::zeros({2, 4, 8}, on)));
  EXPECT_FALSE(fused_cross_entropy_available(at::zeros({4, 8})));
  CeCase c = make(at::kFloat, 9, 40, 36, 2.0);
  CeInput in = make_input(c, 400);
  at::Tensor x64 = in.view.detach().to(at::kDouble).requires_grad_(true);
  auto tp = dist::create_communicator("local", dist::World{}, kCuda);
  at::Tensor loss = vocab_parallel_cross_entropy(x64, in.targets, 0, c.valid, *tp);
  EXPECT_NE(loss.grad_fn()->name().find("VocabParallelCrossEntropy"), std::string::npos) << loss.grad_fn()->name();
  (loss * c.scale).backward();
  auto [ref_loss, ref_grad] = float64_reference(in, c.scale);
  EXPECT_NEAR(loss.item<double>(), ref_loss, 1e-12 * std::abs(ref_loss));
  EXPECT_LT(testing_util::rel_error(x64.grad().narrow(1, 0, c.valid), ref_grad), 1e-12);
}

// fused_cross_entropy (no tensor-parallel group) and the seq2seq model's CUDA loss.
TEST(FusedCrossEntropyGpu, Seq2SeqCudaLossIsTheFusedMeanCrossEntropy) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  CeCase c = make(at::kBFloat16, 21, 301, 301, 1.0);
  CeInput in = make_input(c, 500);
  at::Tensor loss = fused_cross_entropy(in.view, in.targets);
  loss.backward();
  auto [ref_loss, ref_grad] = float64_reference(in, 1.0);
  expect_matches(c, loss, in.view.grad(), ref_loss, ref_grad);

  const Seq2SeqOptions o = model_cases::one_layer_seq2seq(101, 32, 16);
  torch::manual_seed(3);
  Seq2Seq model(o);
  model->to(kCuda);
  at::Tensor src = at::randint(o.vocab, {3, 7}, at::TensorOptions().dtype(at::kLong)).to(kCuda);
  at::Tensor tgt = at::randint(o.vocab, {3, 6}, at::TensorOptions().dtype(at::kLong)).to(kCuda);
  at::Tensor tin = tgt.narrow(1, 0, 5), tout = tgt.narrow(1, 1, 5);
  at::Tensor s2s = model->loss(src, tin, tout);
  EXPECT_NE(s2s.grad_fn()->name().find("FusedCrossEntropy"), std::string::npos) << s2s.grad_fn()->name();
  at::Tensor logits = model->forward(src, tin).detach().reshape({-1, o.vocab}).cpu().to(at::kDouble);
  const double ref = torch::nn::functional::cross_entropy(logits, tout.reshape({-1}).cpu()).item<double>();
  EXPECT_NEAR(s2s.item<double>(), ref, 1e-5 * std::abs(ref));
}

// Two tensor-parallel ranks (mpirun -np 2, sharing one GPU through the MPI backend): each holds
// half of a padded vocabulary; the row maxima and the rescaled sums travel in the all-reduces.
TEST(FusedCrossEntropyGpu, TwoTensorParallelRanksMatchTheWholeVocabulary) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const dist::World& w = testing_util::world();
  if (w.size != 2) GTEST_SKIP() << "needs 2 ranks (run under mpirun -np 2), this job has " << w.size;
  auto tp = dist::create_communicator("mpi", w, kCuda);
  for (at::ScalarType t : kDtypes) {
    const int64_t V = 1001, local = 501;  // padded to 1002: rank 1 holds 500 real columns
    CeCase whole = make(t, 45, V, V, 3.0);
    CeInput in = make_input(whole, 600);  // the same on both ranks (same seed)
    CeCase mine = make(t, 45, local, std::min<int64_t>(local, V - local * w.rank), 3.0);
    mine.vocab_start = local * w.rank;
    SCOPED_TRACE(mine.name());
    at::Tensor shard = at::full({whole.rows, local}, kNaN, at::TensorOptions().dtype(t).device(kCuda));
    shard.narrow(1, 0, mine.valid).copy_(in.view.detach().narrow(1, mine.vocab_start, mine.valid));
    shard.requires_grad_(true);
    at::Tensor loss = vocab_parallel_cross_entropy(shard, in.targets, mine.vocab_start, V, *tp);
    EXPECT_NE(loss.grad_fn()->name().find("FusedCrossEntropy"), std::string::npos);
    (loss * whole.scale).backward();
    auto [ref_loss, ref_grad] = float64_reference(in, whole.scale);
    expect_matches(mine, loss, shard.grad(), ref_loss, ref_grad.narrow(1, mine.vocab_start, mine.valid));
  }
}

}  // namespace
}  // namespace dtrain::engine::fused_ce_cases
