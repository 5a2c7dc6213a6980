// The fused cross-entropy: on CUDA, the mean cross-entropy of logits [N, V] against targets [N]
// in two kernels of dtrain's own (a one-pass online softmax over each row for the loss, and the
// gradient written straight in the logits' dtype), instead of ATen's float32 copy of the logits,
// its softmax kept for backward and the passes over them. It keeps the logits themselves and
// float [N] row statistics for backward; no host synchronization.
//
// vocab_parallel_cross_entropy (tensor_parallel.h) takes it by itself when
// fused_cross_entropy_available(logits); elsewhere (CPU, float64, other layouts) it runs ATen's
// composition, unchanged.
#pragma once

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"

namespace dtrain::engine {

// Whether the fused kernels serve these logits: a CUDA tensor of bfloat16, float16 or float32,
// 2-D with adjacent columns (stride(1) == 1; any row stride), in a build with CUDA.
bool fused_cross_entropy_available(const at::Tensor& logits);

// Mean cross-entropy of logits [N, V] (the whole vocabulary) against targets [N] (integer ids
// in [0, V), on the logits' device), computed in float32: a float32 loss; backward gives the
// logits' gradient in their dtype. Needs fused_cross_entropy_available(logits) (dtrain::Error
// otherwise). No ignore_index: every row counts (an id outside [0, V) adds its row's
// log-sum-exp only).
at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

// The two ways of vocab_parallel_cross_entropy (same arguments and result, see
// tensor_parallel.h), for comparisons and benchmarks: the fused kernels (needs
// fused_cross_entropy_available(logits)), and ATen's composition (any device and dtype; what
// vocab_parallel_cross_entropy runs on the CPU). With tp of more than one rank both all-reduce
// the row maxima, then the rescaled sums of exponentials with the target logits, in one call.
at::Tensor fused_vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                              int64_t vocab_start, int64_t real_vocab,
                                              dist::Communicator& tp);
at::Tensor composed_vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                                 int64_t vocab_start, int64_t real_vocab,
                                                 dist::Communicator& tp);

}  // namespace dtrain::engine
