#include "dtrain/engine/parallel/distill.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "parallel_comm_internal.h"

namespace dtrain::engine {
namespace {

// Reduced-precision logits are computed in float32; float64 stays float64.
at::ScalarType compute_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// `what` says which shapes are compared ("" or " per tensor-parallel rank").
void check_shapes(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& targets,
                  const char* fn, const char* what) {
  DTRAIN_CHECK(student.defined() && teacher.defined() && targets.defined(), fn,
               " needs the student's logits, the teacher's logits and the targets");
  DTRAIN_CHECK(student.dim() == 2 && targets.dim() == 1 && student.size(0) == targets.size(0), fn,
               " takes student logits [N, V] and targets [N], got ", student.sizes(), " and ",
               targets.sizes());
  DTRAIN_CHECK(at::isFloatingType(student.scalar_type()) && at::isFloatingType(teacher.scalar_type()),
               fn, " takes floating-point logits, got student ", student.scalar_type(), " and teacher ",
               teacher.scalar_type());
  DTRAIN_CHECK(targets.scalar_type() == at::kLong, fn, " takes int64 targets, got ", targets.scalar_type());
  DTRAIN_CHECK(teacher.dim() == 2, fn, ": the teacher's logits must be [N, V] like the student's ",
               student.sizes(), ", got ", teacher.sizes());
  DTRAIN_CHECK(teacher.size(1) == student.size(1), "the teacher's logits have V=", teacher.size(1),
               ", the student's V=", student.size(1), what,
               "; a teacher must share the student's vocabulary");
  DTRAIN_CHECK(teacher.size(0) == student.size(0), "the teacher's logits have ", teacher.size(0),
               " rows, the student's ", student.size(0),
               "; the teacher must see the same tokens as the student");
}

// Row-mean KL(softmax(teacher/T) || softmax(student/T)) over vocabulary-split logits (see the
// header). Returns the bare KL; the caller scales it by alpha * T^2.
struct VocabParallelKl : torch::autograd::Function<VocabParallelKl> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& student, const at::Tensor& teacher,
                            int64_t vocab_start, int64_t real_vocab, double temperature, int64_t tp_ptr) {
    auto& tp = comm_from(tp_ptr);
    const int64_t n = student.size(0), local = student.size(1);
    const at::ScalarType dtype = compute_dtype(student);
    at::Tensor s = student.detach().to(dtype) / temperature;
    at::Tensor t = teacher.detach().to(s.options()) / temperature;
    if (vocab_start + local > real_vocab) {
      // Padding columns become -inf in both: exp() = 0, so they drop out of every sum below.
      const double inf = std::numeric_limits<double>::infinity();
      at::Tensor pad = (at::arange(vocab_start, vocab_start + local, s.options().dtype(at::kLong)) >=
                        real_vocab).unsqueeze(0);
      s = s.masked_fill(pad, -inf);
      t = t.masked_fill(pad, -inf);
    }
    // Row maxima of both, in one all-reduce. A shard of padding only gives -inf, which the
    // other ranks' real maxima replace.
    at::Tensor m = at::stack({std::get<0>(s.max(1)), std::get<0>(t.max(1))});  // [2, N]
    if (tp.size() > 1) tp.all_reduce(m, dist::ReduceOp::kMax)->wait();
    s = s - m[0].unsqueeze(1);
    t = t - m[1].unsqueeze(1);
    at::Tensor es = s.exp(), et = t.exp();
    // With log p_t - log p_s = (t - log St) - (s - log Ss) (shifted logits, St and Ss the sums
    // of exponentials), the row's KL is sum(et * (t - s)) / St + log Ss - log St: the partial
    // sum needs no global quantity, so it travels in the same all-reduce as the two sums.
    // where, not a product: a column the teacher gives no mass (padding, a -inf logit) would
    // give 0 * (-inf - -inf) = NaN.
    at::Tensor a = at::where(et > 0, et * (t - s), at::zeros_like(et)).sum(1);
    at::Tensor sums = at::stack({es.sum(1), et.sum(1), a});  // [3, N]
    if (tp.size() > 1) tp.all_reduce(sums)->wait();
    at::Tensor ss = sums[0], st = sums[1];
    at::Tensor kl = (sums[2] / st + ss.log() - st.log()).mean();
    // Backward needs softmax(s/T) - softmax(t/T) on this rank's columns (0 on padding).
    ctx->save_for_backward({es.div_(ss.unsqueeze(1)).sub_(et.div_(st.unsqueeze(1)))});
    ctx->saved_data["scale"] = 1.0 / (temperature * static_cast<double>(n));
    ctx->saved_data["dtype"] = static_cast<int64_t>(student.scalar_type());
    return kl;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    // d KL_row / d s_j = (p_s - p_t)_j / T, averaged over the N rows.
    at::Tensor grad = ctx->get_saved_variables()[0] * (g[0] * ctx->saved_data["scale"].toDouble());
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void check_distill_options(const DistillOptions& o) {
  DTRAIN_CHECK(std::isfinite(o.temperature) && o.temperature > 0, "--distill_temperature=", o.temperature,
               " is not valid; the distillation temperature must be a finite number > 0 (1 leaves "
               "the distributions as they are, larger softens them)");
  // Written so that NaN fails too.
  DTRAIN_CHECK(o.alpha >= 0 && o.alpha <= 1, "--distill_alpha=", o.alpha,
               " is not valid; the weight of the teacher's term must be in [0, 1] (0: the targets "
               "only, 1: the teacher only)");
}

at::Tensor distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                             const at::Tensor& targets, const DistillOptions& o) {
  check_distill_options(o);
  check_shapes(student, teacher, targets, "distillation_loss", "");
  const double T = o.temperature;
  // Differentiable cast: the gradient returns to the student in its own dtype.
  at::Tensor s = student.to(compute_dtype(student));
  at::Tensor loss;
  if (o.alpha > 0) {
    at::Tensor t = teacher.detach().to(s.options());  // a constant
    at::Tensor log_ps = at::log_softmax(s / T, 1);
    at::Tensor log_pt = at::log_softmax(t / T, 1);
    at::Tensor p_t = log_pt.exp();
    // Columns where the teacher puts no mass contribute 0 (not 0 * -inf).
    at::Tensor kl = at::where(p_t > 0, p_t * (log_pt - log_ps), at::zeros_like(p_t)).sum(1).mean();
    loss = kl * (o.alpha * T * T);
  }
  if (o.alpha < 1) {
    at::Tensor ce = at::cross_entropy_loss(s, targets) * (1 - o.alpha);
    loss = loss.defined() ? loss + ce : ce;
  }
  return loss;
}

at::Tensor vocab_parallel_distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                                            const at::Tensor& targets, int64_t vocab_start,
                                            int64_t real_vocab, dist::Communicator& tp,
                                            const DistillOptions& o) {
  check_distill_options(o);
  check_shapes(student, teacher, targets, "vocab_parallel_distillation_loss", " on this tensor-parallel rank");
  DTRAIN_CHECK(vocab_start >= 0 && real_vocab > 0, "vocab_parallel_distillation_loss: vocab_start ",
               vocab_start, " and real_vocab ", real_vocab, " must be >= 0 and > 0");
  // Every rank takes the same branches (the options are the same everywhere), so the
  // collectives stay matched.
  at::Tensor loss;
  if (o.alpha > 0) {
    at::Tensor kl = VocabParallelKl::apply(student, teacher.detach(), vocab_start, real_vocab,
                                           o.temperature, comm_handle(&tp));
    loss = kl * (o.alpha * o.temperature * o.temperature);
  }
  if (o.alpha < 1) {
    at::Tensor ce = vocab_parallel_cross_entropy(student, targets, vocab_start, real_vocab, tp) * (1 - o.alpha);
    loss = loss.defined() ? loss + ce : ce;
  }
  return loss;
}

}  // namespace dtrain::engine
