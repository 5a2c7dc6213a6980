// The fused block kernels' CUDA code (see ../fused_block_kernels.h): plain CUDA, no torch
// headers. The per-element arithmetic (GELU and its derivative, LayerNorm's input gradient)
// is the header's, shared with the host path that the float64 CPU tests check.
//
// LayerNorm of a residual sum: one warp per row, four rows per block; the loops over a row are
// unrolled four times so each lane has several loads in flight. Forward: the sum is
// formed, rounded to its dtype and written once, then read back by the same thread for the
// variance about the mean (two passes over the row, the second from cache) and the output.
// Backward: the rows' input gradient in one kernel (the row's two sums by warp shuffles, the
// residual's gradient added in the same pass, both inputs' gradients written); the weight and
// bias gradients by a column kernel over chunks of rows into partial sums and a second kernel
// adding the chunks in order, so every result is deterministic (no atomics).
//
// RMSNorm (Llama's) is the same kernels with the mean left out, no bias, and the normalized value
// rounded to the input's dtype before the weight, as transformers' LlamaRMSNorm does.
//
// SwiGLU: element-wise, forward and backward (both inputs' gradients in one pass).
//
// Bias + GELU: the forward is element-wise over a (column, row) grid; the backward writes the
// input gradient and sums it per column over chunks of rows in the same pass, then adds the
// chunks as above.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../fused_block_kernels.h"

namespace dtrain::engine::detail {
namespace {

constexpr int kRowsPerBlock = 4;  // warps per block in the row kernels
constexpr int kColTile = 32;      // columns per block in the column kernels
constexpr int kColRows = 8;       // rows in flight per block in the column kernels

// Element formats: the stored bits, the accumulation type and the conversions.
struct Bf16 {
  using Raw = uint16_t;
  using Acc = float;
  __device__ static float load(Raw r) { return __uint_as_float(static_cast<uint32_t>(r) << 16); }
  __device__ static Raw store(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
struct Fp16 {
  using Raw = uint16_t;
  using Acc = float;
  __device__ static float load(Raw r) { return __half2float(__ushort_as_half(r)); }
  __device__ static Raw store(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct Fp32 {
  using Raw = float;
  using Acc = float;
  __device__ static float load(Raw r) { return r; }
  __device__ static Raw store(float f) { return f; }
};
struct Fp64 {
  using Raw = double;
  using Acc = double;
  __device__ static double load(Raw r) { return r; }
  __device__ static Raw store(double f) { return f; }
};

template <class A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float inv_sqrt(float v) { return 1.0f / sqrtf(v); }
__device__ __forceinline__ double inv_sqrt(double v) { return 1.0 / sqrt(v); }

const char* launch_status() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// ---- LayerNorm of a residual sum ----------------------------------------------------------

template <class S, class Y, class W, class O>
__global__ void add_norm_forward_kernel(int64_t rows, int64_t cols, const typename S::Raw* x,
                                        const typename Y::Raw* y, const typename W::Raw* w,
                                        const typename W::Raw* b, typename S::Acc eps, bool rms,
                                        typename S::Raw* sum, typename O::Raw* out, typename S::Acc* mean_out,
                                        typename S::Acc* rstd_out) {
  using A = typename S::Acc;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t base = row * cols;
  const typename S::Raw* src = x + base;
  A total = 0;
  if (y != nullptr) {
#pragma unroll 4
    for (int64_t c = lane; c < cols; c += 32) {
      const typename S::Raw r = S::store(S::load(x[base + c]) + static_cast<A>(Y::load(y[base + c])));
      sum[base + c] = r;
      total += S::load(r);
    }
    src = sum + base;  // read back below by the thread that wrote each element
  } else if (!rms) {
#pragma unroll 4
    for (int64_t c = lane; c < cols; c += 32) total += S::load(src[c]);
  }
  const A mean = rms ? A(0) : warp_sum(total) / static_cast<A>(cols);  // RMSNorm: no mean
  A sq = 0;
#pragma unroll 4
  for (int64_t c = lane; c < cols; c += 32) {
    const A d = S::load(src[c]) - mean;
    sq += d * d;
  }
  const A rstd = inv_sqrt(warp_sum(sq) / static_cast<A>(cols) + eps);
#pragma unroll 4
  for (int64_t c = lane; c < cols; c += 32) {
    A xhat = (S::load(src[c]) - mean) * rstd;
    if (rms) xhat = S::load(S::store(xhat));  // Llama's cast back to the input's dtype
    A v = xhat * static_cast<A>(W::load(w[c]));
    if (b != nullptr) v += static_cast<A>(W::load(b[c]));
    out[base + c] = O::store(static_cast<typename O::Acc>(v));
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <class S, class Y, class W, class O>
__global__ void add_norm_backward_rows_kernel(int64_t rows, int64_t cols, const typename O::Raw* dn,
                                              const typename S::Raw* gs, const typename S::Raw* s,
                                              const typename W::Raw* w, const typename S::Acc* mean,
                                              const typename S::Acc* rstd, bool rms, typename S::Raw* gx,
                                              typename Y::Raw* gy) {
  using A = typename S::Acc;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t base = row * cols;
  const A mu = mean[row], r = rstd[row];
  A a = 0, bsum = 0;
#pragma unroll 4
  for (int64_t c = lane; c < cols; c += 32) {
    const A xhat = (S::load(s[base + c]) - mu) * r;
    const A gw = static_cast<A>(O::load(dn[base + c])) * static_cast<A>(W::load(w[c]));
    a += gw;
    bsum += gw * xhat;
  }
  const A a_n = rms ? A(0) : warp_sum(a) / static_cast<A>(cols);
  const A b_n = warp_sum(bsum) / static_cast<A>(cols);
#pragma unroll 4
  for (int64_t c = lane; c < cols; c += 32) {
    const A xhat = (S::load(s[base + c]) - mu) * r;
    const A gw = static_cast<A>(O::load(dn[base + c])) * static_cast<A>(W::load(w[c]));
    A ds = layer_norm_input_grad<A>(gw, xhat, r, a_n, b_n);
    if (gs != nullptr) ds += S::load(gs[base + c]);
    const typename S::Raw dr = S::store(ds);
    gx[base + c] = dr;
    if (gy != nullptr) gy[base + c] = Y::store(static_cast<typename Y::Acc>(S::load(dr)));
  }
}

// Partial sums over the rows [chunk * rows_per_chunk, ...) of dn * xhat and dn per column.
template <class S, class O>
__global__ void add_norm_backward_cols_kernel(int64_t rows, int64_t cols, int64_t rows_per_chunk,
                                              const typename O::Raw* dn, const typename S::Raw* s,
                                              const typename S::Acc* mean, const typename S::Acc* rstd, bool rms,
                                              typename S::Acc* part_w, typename S::Acc* part_b) {
  using A = typename S::Acc;
  __shared__ A sw[kColRows][kColTile + 1];
  __shared__ A sb[kColRows][kColTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  A dw = 0, db = 0;
  if (c < cols) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const A g = static_cast<A>(O::load(dn[r * cols + c]));
      A xhat = (S::load(s[r * cols + c]) - mean[r]) * rstd[r];
      if (rms) xhat = S::load(S::store(xhat));  // the rounded value the weight multiplied
      dw += g * xhat;
      db += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = dw;
  sb[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int k = 1; k < kColRows; ++k) {
      dw += sw[k][threadIdx.x];
      db += sb[k][threadIdx.x];
    }
    part_w[blockIdx.y * cols + c] = dw;
    if (part_b != nullptr) part_b[blockIdx.y * cols + c] = db;
  }
}

// out[c] = sum over chunks of part[k * cols + c], in chunk order; either output may be null.
template <class A, class W>
__global__ void sum_chunks_kernel(int64_t chunks, int64_t cols, const A* part_a, const A* part_b,
                                  typename W::Raw* out_a, typename W::Raw* out_b) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  A sa = 0, sb = 0;
  for (int64_t k = 0; k < chunks; ++k) {
    if (out_a != nullptr) sa += part_a[k * cols + c];
    if (out_b != nullptr) sb += part_b[k * cols + c];
  }
  if (out_a != nullptr) out_a[c] = W::store(static_cast<typename W::Acc>(sa));
  if (out_b != nullptr) out_b[c] = W::store(static_cast<typename W::Acc>(sb));
}

int64_t rows_per_chunk(int64_t rows, int64_t chunks) { return (rows + chunks - 1) / chunks; }

template <class S, class Y, class W, class O>
const char* add_norm_forward_t(const AddNormShape& sh, const void* x, const void* y, const void* w, const void* b,
                               double eps, void* sum, void* out, void* mean, void* rstd, cudaStream_t stream) {
  using A = typename S::Acc;
  const unsigned blocks = static_cast<unsigned>((sh.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  add_norm_forward_kernel<S, Y, W, O><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(
      sh.rows, sh.cols, static_cast<const typename S::Raw*>(x), static_cast<const typename Y::Raw*>(y),
      static_cast<const typename W::Raw*>(w), static_cast<const typename W::Raw*>(b), static_cast<A>(eps), sh.rms,
      static_cast<typename S::Raw*>(sum), static_cast<typename O::Raw*>(out), static_cast<A*>(mean),
      static_cast<A*>(rstd));
  return launch_status();
}

template <class S, class Y, class W, class O>
const char* add_norm_backward_t(const AddNormShape& sh, const void* dn, const void* gs, const void* s, const void* w,
                                const void* mean, const void* rstd, void* gx, void* gy, void* gw, void* gb,
                                void* workspace, cudaStream_t stream) {
  using A = typename S::Acc;
  const unsigned blocks = static_cast<unsigned>((sh.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  add_norm_backward_rows_kernel<S, Y, W, O><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(
      sh.rows, sh.cols, static_cast<const typename O::Raw*>(dn), static_cast<const typename S::Raw*>(gs),
      static_cast<const typename S::Raw*>(s), static_cast<const typename W::Raw*>(w), static_cast<const A*>(mean),
      static_cast<const A*>(rstd), sh.rms, static_cast<typename S::Raw*>(gx), static_cast<typename Y::Raw*>(gy));
  if (const char* e = launch_status()) return e;
  if (gw == nullptr && gb == nullptr) return nullptr;
  const int64_t chunks = add_norm_workspace_chunks(sh.rows);
  A* part_w = static_cast<A*>(workspace);
  A* part_b = part_w + chunks * sh.cols;
  const dim3 grid(static_cast<unsigned>((sh.cols + kColTile - 1) / kColTile), static_cast<unsigned>(chunks));
  add_norm_backward_cols_kernel<S, O><<<grid, dim3(kColTile, kColRows), 0, stream>>>(
      sh.rows, sh.cols, rows_per_chunk(sh.rows, chunks), static_cast<const typename O::Raw*>(dn),
      static_cast<const typename S::Raw*>(s), static_cast<const A*>(mean), static_cast<const A*>(rstd), sh.rms,
      part_w, part_b);
  if (const char* e = launch_status()) return e;
  sum_chunks_kernel<A, W><<<static_cast<unsigned>((sh.cols + 255) / 256), 256, 0, stream>>>(
      chunks, sh.cols, part_w, part_b, static_cast<typename W::Raw*>(gw), static_cast<typename W::Raw*>(gb));
  return launch_status();
}

// ---- SwiGLU -------------------------------------------------------------------------------

constexpr int kEltThreads = 256;

unsigned elt_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kEltThreads - 1) / kEltThreads, int64_t{1} << 20));
}

template <class T>
__global__ void swiglu_forward_kernel(int64_t n, const typename T::Raw* g, const typename T::Raw* u,
                                      typename T::Raw* out) {
  using A = typename T::Acc;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kEltThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kEltThreads) {
    out[i] = T::store(silu<A>(T::load(g[i])) * T::load(u[i]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(int64_t n, const typename T::Raw* d, const typename T::Raw* g,
                                       const typename T::Raw* u, typename T::Raw* dg, typename T::Raw* du) {
  using A = typename T::Acc;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kEltThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kEltThreads) {
    const A z = T::load(g[i]), dd = T::load(d[i]);
    dg[i] = T::store(dd * static_cast<A>(T::load(u[i])) * silu_grad<A>(z));
    du[i] = T::store(dd * silu<A>(z));
  }
}

template <class T>
const char* swiglu_forward_t(int64_t n, const void* g, const void* u, void* out, cudaStream_t stream) {
  swiglu_forward_kernel<T><<<elt_blocks(n), kEltThreads, 0, stream>>>(
      n, static_cast<const typename T::Raw*>(g), static_cast<const typename T::Raw*>(u),
      static_cast<typename T::Raw*>(out));
  return launch_status();
}

template <class T>
const char* swiglu_backward_t(int64_t n, const void* d, const void* g, const void* u, void* dg, void* du,
                              cudaStream_t stream) {
  swiglu_backward_kernel<T><<<elt_blocks(n), kEltThreads, 0, stream>>>(
      n, static_cast<const typename T::Raw*>(d), static_cast<const typename T::Raw*>(g),
      static_cast<const typename T::Raw*>(u), static_cast<typename T::Raw*>(dg), static_cast<typename T::Raw*>(du));
  return launch_status();
}

// ---- bias + GELU --------------------------------------------------------------------------

constexpr int kGeluThreads = 256;

template <class Y, class B>
__global__ void bias_gelu_forward_kernel(int64_t rows, int64_t cols, const typename Y::Raw* y,
                                         const typename B::Raw* b, typename Y::Raw* out) {
  using A = typename Y::Acc;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kGeluThreads + threadIdx.x;
  if (c >= cols) return;
  const A bias = static_cast<A>(B::load(b[c]));
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    out[r * cols + c] = Y::store(gelu_tanh<A>(Y::load(y[r * cols + c]) + bias));
  }
}

template <class Y, class B>
__global__ void bias_gelu_backward_kernel(int64_t rows, int64_t cols, int64_t rows_per_chunk,
                                          const typename Y::Raw* g, const typename Y::Raw* y,
                                          const typename B::Raw* b, typename Y::Raw* gy, typename Y::Acc* part) {
  using A = typename Y::Acc;
  __shared__ A sp[kColRows][kColTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  A db = 0;
  if (c < cols) {
    const A bias = static_cast<A>(B::load(b[c]));
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const int64_t i = r * cols + c;
      const typename Y::Raw d = Y::store(Y::load(g[i]) * gelu_tanh_grad<A>(Y::load(y[i]) + bias));
      gy[i] = d;
      db += Y::load(d);
    }
  }
  sp[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int k = 1; k < kColRows; ++k) db += sp[k][threadIdx.x];
    part[blockIdx.y * cols + c] = db;
  }
}

template <class Y, class B>
const char* bias_gelu_forward_t(const BiasGeluShape& sh, const void* y, const void* b, void* out,
                                cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((sh.cols + kGeluThreads - 1) / kGeluThreads),
                  static_cast<unsigned>(std::min<int64_t>(sh.rows, 65535)));
  bias_gelu_forward_kernel<Y, B><<<grid, kGeluThreads, 0, stream>>>(
      sh.rows, sh.cols, static_cast<const typename Y::Raw*>(y), static_cast<const typename B::Raw*>(b),
      static_cast<typename Y::Raw*>(out));
  return launch_status();
}

template <class Y, class B>
const char* bias_gelu_backward_t(const BiasGeluShape& sh, const void* g, const void* y, const void* b, void* gy,
                                 void* gb, void* workspace, cudaStream_t stream) {
  using A = typename Y::Acc;
  const int64_t chunks = bias_gelu_workspace_chunks(sh.rows);
  A* part = static_cast<A*>(workspace);
  const dim3 grid(static_cast<unsigned>((sh.cols + kColTile - 1) / kColTile), static_cast<unsigned>(chunks));
  bias_gelu_backward_kernel<Y, B><<<grid, dim3(kColTile, kColRows), 0, stream>>>(
      sh.rows, sh.cols, rows_per_chunk(sh.rows, chunks), static_cast<const typename Y::Raw*>(g),
      static_cast<const typename Y::Raw*>(y), static_cast<const typename B::Raw*>(b),
      static_cast<typename Y::Raw*>(gy), part);
  if (const char* e = launch_status()) return e;
  if (gb == nullptr) return nullptr;
  sum_chunks_kernel<A, B><<<static_cast<unsigned>((sh.cols + 255) / 256), 256, 0, stream>>>(
      chunks, sh.cols, part, nullptr, static_cast<typename B::Raw*>(gb), nullptr);
  return launch_status();
}

const char* unsupported() { return "this combination of dtypes has no fused kernel (add_norm/bias_gelu_supported)"; }

}  // namespace

bool fused_block_kernels_built() { return true; }

const char* add_norm_forward(const AddNormShape& sh, const void* x, const void* y, const void* weight,
                             const void* bias, double eps, void* sum, void* out, void* mean, void* rstd,
                             void* stream) {
  if (sh.rows == 0) return nullptr;
  const auto st = static_cast<cudaStream_t>(stream);
  const void* yy = sh.has_y ? y : nullptr;
#define X(ks, ky, kw, ko, TS, TY, TW, TO)                                                         \
  if (sh.s == FbDtype::ks && add_norm_y_key(sh) == FbDtype::ky && sh.w == FbDtype::kw && sh.o == FbDtype::ko) \
    return add_norm_forward_t<TS, TY, TW, TO>(sh, x, yy, weight, bias, eps, sum, out, mean, rstd, st);
  DTRAIN_ADD_NORM_CASES(X)
#undef X
  return unsupported();
}

const char* add_norm_backward(const AddNormShape& sh, const void* grad_out, const void* grad_sum, const void* s,
                              const void* weight, const void* mean, const void* rstd, void* grad_x, void* grad_y,
                              void* grad_weight, void* grad_bias, void* workspace, void* stream) {
  if (sh.rows == 0) return nullptr;
  const auto st = static_cast<cudaStream_t>(stream);
  void* gy = sh.has_y ? grad_y : nullptr;
#define X(ks, ky, kw, ko, TS, TY, TW, TO)                                                         \
  if (sh.s == FbDtype::ks && add_norm_y_key(sh) == FbDtype::ky && sh.w == FbDtype::kw && sh.o == FbDtype::ko) \
    return add_norm_backward_t<TS, TY, TW, TO>(sh, grad_out, grad_sum, s, weight, mean, rstd, grad_x, gy, grad_weight, \
                                           grad_bias, workspace, st);
  DTRAIN_ADD_NORM_CASES(X)
#undef X
  return unsupported();
}

const char* bias_gelu_forward(const BiasGeluShape& sh, const void* y, const void* bias, void* out, void* stream) {
  if (sh.rows == 0) return nullptr;
  const auto st = static_cast<cudaStream_t>(stream);
#define X(ky, kb, TY, TB) \
  if (sh.y == FbDtype::ky && sh.b == FbDtype::kb) return bias_gelu_forward_t<TY, TB>(sh, y, bias, out, st);
  DTRAIN_BIAS_GELU_CASES(X)
#undef X
  return unsupported();
}

const char* bias_gelu_backward(const BiasGeluShape& sh, const void* grad_out, const void* y, const void* bias,
                               void* grad_y, void* grad_bias, void* workspace, void* stream) {
  if (sh.rows == 0) return nullptr;
  const auto st = static_cast<cudaStream_t>(stream);
#define X(ky, kb, TY, TB)                          \
  if (sh.y == FbDtype::ky && sh.b == FbDtype::kb) \
    return bias_gelu_backward_t<TY, TB>(sh, grad_out, y, bias, grad_y, grad_bias, workspace, st);
  DTRAIN_BIAS_GELU_CASES(X)
#undef X
  return unsupported();
}

const char* swiglu_forward(int64_t n, FbDtype dtype, const void* gate, const void* up, void* out, void* stream) {
  if (n == 0) return nullptr;
  const auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case FbDtype::kFp64: return swiglu_forward_t<Fp64>(n, gate, up, out, st);
    case FbDtype::kFp32: return swiglu_forward_t<Fp32>(n, gate, up, out, st);
    case FbDtype::kBf16: return swiglu_forward_t<Bf16>(n, gate, up, out, st);
    case FbDtype::kFp16: return swiglu_forward_t<Fp16>(n, gate, up, out, st);
  }
  return unsupported();
}

const char* swiglu_backward(int64_t n, FbDtype dtype, const void* grad_out, const void* gate, const void* up,
                            void* grad_gate, void* grad_up, void* stream) {
  if (n == 0) return nullptr;
  const auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case FbDtype::kFp64: return swiglu_backward_t<Fp64>(n, grad_out, gate, up, grad_gate, grad_up, st);
    case FbDtype::kFp32: return swiglu_backward_t<Fp32>(n, grad_out, gate, up, grad_gate, grad_up, st);
    case FbDtype::kBf16: return swiglu_backward_t<Bf16>(n, grad_out, gate, up, grad_gate, grad_up, st);
    case FbDtype::kFp16: return swiglu_backward_t<Fp16>(n, grad_out, gate, up, grad_gate, grad_up, st);
  }
  return unsupported();
}

}  // namespace dtrain::engine::detail
