// Knowledge distillation (Hinton, Vinyals and Dean, "Distilling the Knowledge in a Neural
// Network", 2015): the student is trained on a mix of the teacher's softened distribution and
// the hard targets,
//
//   loss = alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) * CE(student, targets)
//
// KL summed over the vocabulary and averaged over the rows (PyTorch's
// F.kl_div(log_softmax(s/T), log_softmax(t/T), log_target=True, reduction="batchmean")), CE the
// mean cross-entropy over the rows. The T^2 keeps the soft term's gradient, which scales as
// 1/T, comparable to the hard term's as T changes.
//
// The teacher is a constant: no gradient flows to it, and it may be of another dtype (bf16
// from a half-precision teacher). Reduced-precision logits are computed in float32 (float64
// stays float64); the student's gradient comes back in the student's dtype. A term whose
// weight is 0 (alpha = 0 or 1) is not computed.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"

namespace dtrain::engine {

struct DistillOptions {
  double temperature = 1.0;  // T > 0: softens both distributions (--distill_temperature)
  double alpha = 0.5;        // weight of the soft (teacher) term, in [0, 1] (--distill_alpha)
};

// Throws dtrain::Error naming --distill_temperature (must be finite and > 0) or
// --distill_alpha (must be in [0, 1]) and the valid range.
void check_distill_options(const DistillOptions& o);

// student, teacher [N, V] logits, targets [N] int64. Throws dtrain::Error for bad options, or
// a teacher whose logits do not have the student's shape (another vocabulary).
at::Tensor distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                             const at::Tensor& targets, const DistillOptions& o);

// The same loss for logits split by vocabulary over a tensor-parallel group, without ever
// gathering them (the convention of vocab_parallel_cross_entropy in tensor_parallel.h):
// student and teacher are [N, V_padded/T] on each rank, this rank holding vocabulary
// [vocab_start, vocab_start + local); columns at or beyond real_vocab are padding, ignored
// (they get a zero gradient). Collective over tp (every rank passes the same options and N):
// the row maxima of student/T and teacher/T in one all-reduce, their sums of exponentials
// together with the partial KL sums in a second, and the CE term through
// vocab_parallel_cross_entropy. Returns the loss (the same on every rank); backward gives this
// rank's slice of the student's gradient, with no communication.
at::Tensor vocab_parallel_distillation_loss(const at::Tensor& student, const at::Tensor& teacher,
                                            const at::Tensor& targets, int64_t vocab_start,
                                            int64_t real_vocab, dist::Communicator& tp,
                                            const DistillOptions& o);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
