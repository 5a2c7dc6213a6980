// Private to the parallel area: the launchers of the fused cross-entropy's CUDA kernels
// (cuda/fused_cross_entropy.cu; no_cuda/fused_cross_entropy_kernels.cc in builds without CUDA).
// Free of torch and CUDA headers: raw device pointers, sizes in elements, the stream as void*
// (a cudaStream_t). Callers: fused_cross_entropy.cc.
#pragma once

#include <cstdint>

namespace dtrain::engine::detail {

enum class CeDtype : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

// Logits [rows, cols] of one rank's vocabulary shard: row i starts at element i * row_stride
// of `logits` (any stride, any alignment), its columns are adjacent. Columns at or beyond
// valid_cols (0 <= valid_cols <= cols) are padding past the real vocabulary: never read by
// the forward, given gradient 0. targets [rows] (device, int64) are global vocabulary ids;
// this shard holds [vocab_start, vocab_start + cols).
struct CeRows {
  const void* logits = nullptr;
  CeDtype dtype = CeDtype::kFp32;
  int64_t rows = 0, cols = 0, valid_cols = 0, row_stride = 0;
  const int64_t* targets = nullptr;
  int64_t vocab_start = 0;
};

// Whether this build holds the kernels (false: the stand-ins, which throw).
bool ce_kernels_built();

// Per row, in one pass over its valid columns (fp32 arithmetic): row_max = max x,
// row_sum = sum exp(x - row_max), target_logit = x[target - vocab_start] when the target is in
// this shard (-inf when it falls in the padding), else 0. A row of nothing but padding gives
// -inf and 0. All outputs are float [rows] on the device. Returns nullptr, or the CUDA error
// of the launch.
const char* ce_forward_stats(const CeRows& r, float* row_max, float* row_sum, float* target_logit,
                             void* stream);

// grad[i, j] = (exp(x[i, j] - lse[i]) - [j == target_i - vocab_start]) * (*grad_output) / rows
// in the logits' dtype, 0 for padding columns; grad's row i starts at element
// i * grad_row_stride. grad_output is a float on the device (never read on the host).
const char* ce_backward(const CeRows& r, const float* lse, const float* grad_output, void* grad,
                        int64_t grad_row_stride, void* stream);

}  // namespace dtrain::engine::detail
