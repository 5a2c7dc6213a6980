// The distillation loss against float64 references built independently from ATen ops:
// at::kl_div (log_target, summed, divided by N: PyTorch's "batchmean") for the soft term and
// an explicit sum of p_t * (log p_t - log p_s) as a second check of it, the cross-entropy from
// log_softmax and the target column, for T = 1, 2, 4 and several alphas. Value and the
// student's gradient (float64 autograd) to 1e-5; the teacher gets no gradient; bad options
// and a teacher with another vocabulary are refused naming the flag or the sizes.
#include "dtrain/engine/parallel/distill.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <tuple>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;
using testing_util::rel_error;

constexpr double kDistillTol = 1e-5;

// Float64 reference of the whole loss, from the float64 copies of the logits.
at::Tensor distill_reference(const at::Tensor& s, const at::Tensor& t, const at::Tensor& targets,
                             double T, double alpha) {
  const int64_t n = s.size(0);
  at::Tensor log_ps = at::log_softmax(s / T, 1);
  at::Tensor log_pt = at::log_softmax(t / T, 1);
  // kl_div(input = log q, target = log p, log_target) = p * (log p - log q) per element.
  at::Tensor kl = at::kl_div(log_ps, log_pt, at::Reduction::Sum, /*log_target=*/true) / n;
  at::Tensor log_probs = at::log_softmax(s, 1);
  at::Tensor ce = -log_probs.gather(1, targets.unsqueeze(1)).mean();
  return alpha * T * T * kl + (1 - alpha) * ce;
}

struct DistillCase {
  at::Tensor student, teacher, targets;
};

DistillCase make_case(int64_t n, int64_t v, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  DistillCase c;
  c.student = at::randn({n, v}, g, at::kFloat) * 2;
  c.teacher = at::randn({n, v}, g, at::kFloat) * 3;
  c.targets = at::randint(v, {n}, g, at::kLong);
  return c;
}

TEST(Distill, ValueAndGradientMatchTheFloat64Reference) {
  const DistillCase c = make_case(9, 13, 11);
  for (double T : {1.0, 2.0, 4.0}) {
    for (double alpha : {0.0, 0.3, 0.5, 1.0}) {
      at::Tensor s = c.student.clone().requires_grad_(true);
      at::Tensor t = c.teacher.clone().requires_grad_(true);  // must not receive a gradient
      at::Tensor loss = distillation_loss(s, t, c.targets, {T, alpha});
      EXPECT_EQ(loss.scalar_type(), at::kFloat);
      at::Tensor sr = c.student.to(at::kDouble).requires_grad_(true);
      at::Tensor ref = distill_reference(sr, c.teacher.to(at::kDouble), c.targets, T, alpha);
      EXPECT_LT(rel_error(loss, ref), kDistillTol) << "T=" << T << " alpha=" << alpha << ": "
                                                   << loss.item<double>() << " vs " << ref.item<double>();
      loss.backward();
      ref.backward();
      ASSERT_TRUE(s.grad().defined());
      EXPECT_LT(rel_error(s.grad(), sr.grad()), kDistillTol) << "T=" << T << " alpha=" << alpha;
      EXPECT_FALSE(t.grad().defined()) << "the teacher is a constant";
    }
  }
}

TEST(Distill, SoftTermIsTheExplicitKlScaledByTSquared) {
  // alpha = 1: T^2 * mean over rows of sum_v p_t (log p_t - log p_s), written out here in
  // float64 without log_softmax; alpha = 0: plain cross-entropy.
  const DistillCase c = make_case(6, 17, 12);
  at::Tensor s64 = c.student.to(at::kDouble), t64 = c.teacher.to(at::kDouble);
  for (double T : {1.0, 2.0, 4.0}) {
    at::Tensor es = (s64 / T).exp(), et = (t64 / T).exp();
    at::Tensor p_s = es / es.sum(1, true), p_t = et / et.sum(1, true);
    double kl = (p_t * (p_t.log() - p_s.log())).sum(1).mean().item<double>();
    double got = distillation_loss(c.student, c.teacher, c.targets, {T, 1.0}).item<double>();
    EXPECT_NEAR(got, T * T * kl, kDistillTol * T * T * kl) << "T=" << T;
    EXPECT_GT(kl, 0.05) << "the case is not trivial";
    double ce = torch::nn::functional::cross_entropy(s64, c.targets).item<double>();
    EXPECT_NEAR(distillation_loss(c.student, c.teacher, c.targets, {T, 0.0}).item<double>(), ce,
                kDistillTol * ce)
        << "alpha = 0 is the cross-entropy, whatever T";
  }
  // The student equal to the teacher: no soft loss at any temperature.
  EXPECT_NEAR(distillation_loss(c.teacher, c.teacher, c.targets, {3.0, 1.0}).item<double>(), 0.0, 1e-6);
}

TEST(Distill, Bf16TeacherIsComputedInFloat32AndFloat64StaysFloat64) {
  const DistillCase c = make_case(5, 11, 13);
  at::Tensor teacher16 = c.teacher.to(at::kBFloat16);
  at::Tensor s = c.student.clone().requires_grad_(true);
  at::Tensor loss = distillation_loss(s, teacher16, c.targets, {2.0, 0.7});
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  // The reference sees the same (rounded) teacher values.
  at::Tensor sr = c.student.to(at::kDouble).requires_grad_(true);
  at::Tensor ref = distill_reference(sr, teacher16.to(at::kDouble), c.targets, 2.0, 0.7);
  EXPECT_LT(rel_error(loss, ref), kDistillTol);
  loss.backward();
  ref.backward();
  EXPECT_EQ(s.grad().scalar_type(), at::kFloat);
  EXPECT_LT(rel_error(s.grad(), sr.grad()), kDistillTol);

  // Float64 logits are not rounded to float32.
  at::Tensor s64 = c.student.to(at::kDouble).requires_grad_(true);
  at::Tensor l64 = distillation_loss(s64, c.teacher.to(at::kDouble), c.targets, {2.0, 0.7});
  EXPECT_EQ(l64.scalar_type(), at::kDouble);
  EXPECT_LT(rel_error(l64, distill_reference(c.student.to(at::kDouble), c.teacher.to(at::kDouble),
                                             c.targets, 2.0, 0.7)),
            1e-12);
}

TEST(Distill, TeacherWithoutMassOnAColumnGivesNoNaN) {
  // A -inf teacher logit (a masked token) has p_t = 0: it contributes 0, not 0 * -inf.
  DistillCase c = make_case(4, 7, 14);
  c.teacher.select(1, 3).fill_(-std::numeric_limits<float>::infinity());
  at::Tensor s = c.student.clone().requires_grad_(true);
  at::Tensor loss = distillation_loss(s, c.teacher, c.targets, {2.0, 0.5});
  ASSERT_TRUE(std::isfinite(loss.item<double>()));
  // Reference: the teacher's distribution over the other 6 columns, the KL summed over them
  // (at::kl_div itself would give 0 * -inf = NaN on the masked column).
  at::Tensor kept = at::tensor({0, 1, 2, 4, 5, 6}, at::kLong);
  at::Tensor sr = c.student.to(at::kDouble).requires_grad_(true);
  at::Tensor log_ps = at::log_softmax(sr / 2.0, 1).index_select(1, kept);
  at::Tensor log_pt = at::log_softmax(c.teacher.to(at::kDouble).index_select(1, kept) / 2.0, 1);
  at::Tensor kl = at::kl_div(log_ps, log_pt, at::Reduction::Sum, /*log_target=*/true) / 4;
  at::Tensor ce = torch::nn::functional::cross_entropy(sr, c.targets);
  at::Tensor ref = 0.5 * 4.0 * kl + 0.5 * ce;
  EXPECT_LT(rel_error(loss, ref), kDistillTol);
  loss.backward();
  ref.backward();
  ASSERT_TRUE(at::isfinite(s.grad()).all().item<bool>());
  EXPECT_LT(rel_error(s.grad(), sr.grad()), kDistillTol);
}

TEST(Distill, BadOptionsAndAnotherVocabularyAreRefused) {
  const DistillCase c = make_case(3, 5, 15);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double T : {0.0, -1.0, nan, inf}) {
    std::string msg = error_of([&] { check_distill_options({T, 0.5}); });
    EXPECT_NE(msg.find("--distill_temperature="), std::string::npos) << msg;
    EXPECT_NE(msg.find("> 0"), std::string::npos) << msg;
    // The losses check their options too.
    msg = error_of([&] { distillation_loss(c.student, c.teacher, c.targets, {T, 0.5}); });
    EXPECT_NE(msg.find("--distill_temperature="), std::string::npos) << msg;
  }
  for (double alpha : {-0.1, 1.5, nan}) {
    std::string msg = error_of([&] { check_distill_options({2.0, alpha}); });
    EXPECT_NE(msg.find("--distill_alpha="), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 1]"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(check_distill_options({0.5, 0.0}));
  EXPECT_NO_THROW(check_distill_options({10.0, 1.0}));

  // A teacher of another vocabulary: both sizes and the rule.
  at::Tensor other = at::randn({3, 8});
  std::string msg = error_of([&] { distillation_loss(c.student, other, c.targets, {}); });
  EXPECT_NE(msg.find("the teacher's logits have V=8, the student's V=5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("must share the student's vocabulary"), std::string::npos) << msg;
  // Other rows, and targets that do not match.
  msg = error_of([&] { distillation_loss(c.student, at::randn({4, 5}), c.targets, {}); });
  EXPECT_NE(msg.find("4 rows, the student's 3"), std::string::npos) << msg;
  msg = error_of([&] { distillation_loss(c.student, c.teacher, at::zeros({4}, at::kLong), {}); });
  EXPECT_NE(msg.find("targets [N]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dtrain::engine
