// Private to the parallel area: the launchers of the fused block kernels' CUDA code
// (cuda/fused_block.cu; no_cuda/fused_block_kernels.cc in builds without CUDA) and the
// per-element arithmetic they share with the host path (fused_block_ops.cc), so the float64
// CPU tests check the formulas the kernels run. Free of torch and CUDA runtime headers: raw
// pointers, sizes in elements, the stream as void* (a cudaStream_t). Callers:
// fused_block_ops.cc.
#pragma once

#include <math.h>
#include <cstdint>

#if defined(__CUDACC__)
#define DTRAIN_FB_HD __host__ __device__ __forceinline__
#else
#define DTRAIN_FB_HD inline
#endif

namespace dtrain::engine::detail {

enum class FbDtype : int { kBf16 = 0, kFp16 = 1, kFp32 = 2, kFp64 = 3 };

// ---- the shared arithmetic (A: float, or double for float64 tensors) ----------------------

DTRAIN_FB_HD float fb_tanh(float v) { return tanhf(v); }
DTRAIN_FB_HD double fb_tanh(double v) { return ::tanh(v); }

// GELU, tanh approximation: 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))).
template <class A>
DTRAIN_FB_HD A gelu_tanh(A z) {
  const A k0 = A(0.7978845608028654), k1 = A(0.044715);
  return A(0.5) * z * (A(1) + fb_tanh(k0 * (z + k1 * z * z * z)));
}

// Its derivative: 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2).
template <class A>
DTRAIN_FB_HD A gelu_tanh_grad(A z) {
  const A k0 = A(0.7978845608028654), k1 = A(0.044715);
  const A t = fb_tanh(k0 * (z + k1 * z * z * z));
  return A(0.5) * (A(1) + t) + A(0.5) * z * (A(1) - t * t) * k0 * (A(1) + A(3) * k1 * z * z);
}

// SiLU, x * sigmoid(x), and its derivative sigmoid(x) * (1 + x * (1 - sigmoid(x))).
DTRAIN_FB_HD float fb_exp(float v) { return expf(v); }
DTRAIN_FB_HD double fb_exp(double v) { return ::exp(v); }

template <class A>
DTRAIN_FB_HD A silu(A z) {
  return z / (A(1) + fb_exp(-z));
}

template <class A>
DTRAIN_FB_HD A silu_grad(A z) {
  const A sig = A(1) / (A(1) + fb_exp(-z));
  return sig * (A(1) + z * (A(1) - sig));
}

// LayerNorm's input gradient for one element of a row of n, given xhat = (s - mean) * rstd,
// gw = dn * weight, and the row's sums a = sum gw, b = sum gw * xhat:
// ds = rstd * (gw - a / n - xhat * b / n). RMSNorm's is the same with a = 0 (no mean).
template <class A>
DTRAIN_FB_HD A layer_norm_input_grad(A gw, A xhat, A rstd, A a_over_n, A b_over_n) {
  return rstd * (gw - a_over_n - xhat * b_over_n);
}

// ---- LayerNorm of a residual sum ----------------------------------------------------------
// Rows of `cols` adjacent elements, row i at element i * cols (contiguous tensors).
// Dtypes: S for x, the sum s, its gradient and x's gradient; Y for y and y's gradient; W for the
// weight, the bias and their gradients; O for the normalized output and its gradient. The
// kernels serve the combinations add_norm_supported accepts.
// rms: an RMSNorm instead (transformers' LlamaRMSNorm): no mean (stored as 0), the mean square
// in place of the variance, no bias, and the normalized value rounded to S before the weight
// multiplies it (Llama's ".to(input dtype)"; a no-op for float32 and float64).
struct AddNormShape {
  int64_t rows = 0, cols = 0;
  FbDtype s = FbDtype::kFp32, y = FbDtype::kFp32, w = FbDtype::kFp32, o = FbDtype::kFp32;
  bool has_y = false;  // false: s is x itself (a plain LayerNorm)
  bool rms = false;
};

inline FbDtype add_norm_y_key(const AddNormShape& shape) { return shape.has_y ? shape.y : shape.s; }
bool add_norm_supported(const AddNormShape& shape);

// Whether this build holds the kernels (false: the stand-ins, which throw).
bool fused_block_kernels_built();

// s = x + y (rounded to S; not written without y), n = (s - mean) * rstd * weight + bias in O,
// with mean and the biased variance of the rounded s in the accumulation type (float, or
// double for fp64) and rstd = 1 / sqrt(var + eps); mean and rstd [rows] in that type. Returns
// nullptr, or the CUDA error of the launch.
const char* add_norm_forward(const AddNormShape& shape, const void* x, const void* y, const void* weight,
                             const void* bias, double eps, void* sum, void* out, void* mean, void* rstd,
                             void* stream);

// Backward of add_norm_forward given dn (O) and grad_sum (S, the gradient reaching s from its
// other uses; nullptr for none): ds = LayerNorm's input gradient + grad_sum, written to grad_x
// (S) and, with y, grad_y (Y); grad_weight = sum over rows dn * xhat and grad_bias = sum dn
// (W). `s` is the saved sum (x without y). workspace: 2 * add_norm_workspace_chunks(rows) *
// cols elements of the accumulation type.
int64_t add_norm_workspace_chunks(int64_t rows);
const char* add_norm_backward(const AddNormShape& shape, const void* grad_out, const void* grad_sum,
                              const void* s, const void* weight, const void* mean, const void* rstd,
                              void* grad_x, void* grad_y, void* grad_weight, void* grad_bias, void* workspace,
                              void* stream);

// ---- SwiGLU: silu(gate) * up ---------------------------------------------------------------
// gate, up and the output: n adjacent elements of one dtype (float64, float32, bfloat16 or
// float16); the product is formed in the accumulation type and rounded once.
const char* swiglu_forward(int64_t n, FbDtype dtype, const void* gate, const void* up, void* out, void* stream);
// grad_gate = grad_out * up * silu_grad(gate), grad_up = grad_out * silu(gate), each rounded once.
const char* swiglu_backward(int64_t n, FbDtype dtype, const void* grad_out, const void* gate, const void* up,
                            void* grad_gate, void* grad_up, void* stream);

// ---- bias + GELU --------------------------------------------------------------------------
// y [rows, cols] (contiguous) of dtype Y plus bias [cols] of dtype B; the output and its
// gradient are Y. The kernels serve the combinations bias_gelu_supported accepts.
struct BiasGeluShape {
  int64_t rows = 0, cols = 0;
  FbDtype y = FbDtype::kFp32, b = FbDtype::kFp32;
};

bool bias_gelu_supported(const BiasGeluShape& shape);

// out = gelu_tanh(y + bias), in the accumulation type, rounded once to Y.
const char* bias_gelu_forward(const BiasGeluShape& shape, const void* y, const void* bias, void* out, void* stream);

// grad_y = grad_out * gelu_tanh_grad(y + bias) rounded to Y; grad_bias = the column sums of
// that rounded grad_y (B). workspace: bias_gelu_workspace_chunks(rows) * cols elements of the
// accumulation type.
int64_t bias_gelu_workspace_chunks(int64_t rows);
const char* bias_gelu_backward(const BiasGeluShape& shape, const void* grad_out, const void* y, const void* bias,
                               void* grad_y, void* grad_bias, void* workspace, void* stream);

// The dtype combinations the kernels serve (S, Y, W, O and B as above), one table for the
// checks (fused_block_ops.cc) and the dispatch (cuda/fused_block.cu). Without y, the table
// matches y as S (add_norm_y_key).
#define DTRAIN_ADD_NORM_CASES(X)                                        \
  X(kFp64, kFp64, kFp64, kFp64, Fp64, Fp64, Fp64, Fp64)                 \
  X(kFp32, kFp32, kFp32, kFp32, Fp32, Fp32, Fp32, Fp32)                 \
  X(kBf16, kBf16, kBf16, kBf16, Bf16, Bf16, Bf16, Bf16)                 \
  X(kFp16, kFp16, kFp16, kFp16, Fp16, Fp16, Fp16, Fp16)                 \
  X(kFp32, kBf16, kFp32, kBf16, Fp32, Bf16, Fp32, Bf16)                 \
  X(kFp32, kFp16, kFp32, kFp16, Fp32, Fp16, Fp32, Fp16)                 \
  X(kFp32, kFp32, kFp32, kBf16, Fp32, Fp32, Fp32, Bf16)                 \
  X(kFp32, kFp32, kFp32, kFp16, Fp32, Fp32, Fp32, Fp16)                 \
  X(kFp32, kBf16, kFp32, kFp32, Fp32, Bf16, Fp32, Fp32)                 \
  X(kFp32, kFp16, kFp32, kFp32, Fp32, Fp16, Fp32, Fp32)

#define DTRAIN_BIAS_GELU_CASES(X) \
  X(kFp64, kFp64, Fp64, Fp64)     \
  X(kFp32, kFp32, Fp32, Fp32)     \
  X(kBf16, kBf16, Bf16, Bf16)     \
  X(kFp16, kFp16, Fp16, Fp16)     \
  X(kBf16, kFp32, Bf16, Fp32)     \
  X(kFp16, kFp32, Fp16, Fp32)

}  // namespace dtrain::engine::detail
