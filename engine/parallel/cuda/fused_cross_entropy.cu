// The fused cross-entropy's CUDA kernels (see ../fused_cross_entropy_kernels.h): plain CUDA, no
// torch headers, so nvcc compiles this file in seconds.
//
// Both kernels give one block of kThreads threads to one row. A row is read as a short scalar
// head up to the first 16-byte boundary, a body of 16-byte packets (8 bf16/fp16 or 4 fp32
// elements: one vector load per thread per packet, two packets in flight per iteration), and a
// scalar tail, so any row length, stride and alignment is served and no element outside
// [0, cols) of the row is touched.
//
// Forward: an online softmax in one pass. Each thread keeps a running maximum m and the sum s of
// exp(x - m); a group of elements raises m once (s rescaled by exp(m_old - m_new)) and adds its
// exponentials. Exponentials are exp2(x * log2(e) - m * log2(e)) (one FMA and the hardware's
// exp2). The threads' (m, s) pairs are merged by warp shuffles, then through shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../fused_cross_entropy_kernels.h"

namespace dtrain::engine::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

// Element formats: the stored bits and their conversions to and from float.
struct Bf16 {
  using Raw = uint16_t;
  __device__ static float load(Raw r) { return __uint_as_float(static_cast<uint32_t>(r) << 16); }
  __device__ static Raw store(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
struct Fp16 {
  using Raw = uint16_t;
  __device__ static float load(Raw r) { return __half2float(__ushort_as_half(r)); }
  __device__ static Raw store(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct Fp32 {
  using Raw = float;
  __device__ static float load(Raw r) { return r; }
  __device__ static Raw store(float f) { return f; }
};

// Elements of a 16-byte packet.
template <class F>
constexpr int kVec = 16 / static_cast<int>(sizeof(typename F::Raw));

template <class F>
union Packet {
  uint4 bits;
  typename F::Raw v[kVec<F>];
};

template <class F>
__device__ __forceinline__ void load_packet(const typename F::Raw* p, float* x) {
  Packet<F> pk;
  pk.bits = __ldg(reinterpret_cast<const uint4*>(p));
#pragma unroll
  for (int k = 0; k < kVec<F>; ++k) x[k] = F::load(pk.v[k]);
}

template <class F>
__device__ __forceinline__ void store_packet(typename F::Raw* p, const float* x) {
  Packet<F> pk;
#pragma unroll
  for (int k = 0; k < kVec<F>; ++k) pk.v[k] = F::store(x[k]);
  *reinterpret_cast<uint4*>(p) = pk.bits;
}

// Elements before the first 16-byte boundary at or after p (at most n); n when p is not even
// aligned to its element (then the whole row goes the scalar way).
template <class F>
__device__ __forceinline__ int64_t head_length(const void* p, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  constexpr uintptr_t kSize = sizeof(typename F::Raw);
  if (a % kSize != 0) return n;
  const int64_t head = static_cast<int64_t>(((16 - a % 16) % 16) / kSize);
  return head < n ? head : n;
}

// Adds K elements to the running (m, s). m only grows; s is rescaled when it does. While m is
// -inf every element so far was -inf (or NaN): the offset 0 then keeps exp2(-inf) = 0 and lets
// a NaN through, as the unfused computation does.
template <int K>
__device__ __forceinline__ void absorb(float& m, float& s, const float* x) {
  float cm = x[0];
#pragma unroll
  for (int k = 1; k < K; ++k) cm = fmaxf(cm, x[k]);
  if (cm > m) {
    s *= exp2f((m - cm) * kLog2e);
    m = cm;
  }
  const float mc = m == -INFINITY ? 0.0f : m * kLog2e;
#pragma unroll
  for (int k = 0; k < K; ++k) s += exp2f(fmaf(x[k], kLog2e, -mc));
}

// (m, s) and (m2, s2) of disjoint parts of a row -> the pair of their union.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) {  // both parts empty or -inf (s and s2 are 0 or NaN)
    s += s2;
    return;
  }
  s = s * exp2f((m - mm) * kLog2e) + s2 * exp2f((m2 - mm) * kLog2e);
  m = mm;
}

// Merges the block's pairs; thread 0 ends with the row's (m, s).
__device__ __forceinline__ void block_merge(float& m, float& s) {
  __shared__ float ms[kWarps], ss[kWarps];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    ms[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? ms[lane] : -INFINITY;
    s = lane < kWarps ? ss[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
    }
  }
}

struct StatsOut {
  float* row_max;
  float* row_sum;
  float* target_logit;
};

template <class F>
__global__ void __launch_bounds__(kThreads) stats_kernel(CeRows r, StatsOut out) {
  using Raw = typename F::Raw;
  constexpr int V = kVec<F>;
  const int64_t row = blockIdx.x;
  const Raw* x = static_cast<const Raw*>(r.logits) + row * r.row_stride;
  const int64_t n = r.valid_cols;
  const int64_t head = head_length<F>(x, n);
  const int64_t packets = (n - head) / V;
  const Raw* body = x + head;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < head; j += kThreads) {
    const float v = F::load(x[j]);
    absorb<1>(m, s, &v);
  }
  int64_t p = threadIdx.x;
  for (; p + kThreads < packets; p += 2 * kThreads) {
    float v[2 * V];
    load_packet<F>(body + p * V, v);
    load_packet<F>(body + (p + kThreads) * V, v + V);
    absorb<2 * V>(m, s, v);
  }
  if (p < packets) {
    float v[V];
    load_packet<F>(body + p * V, v);
    absorb<V>(m, s, v);
  }
  for (int64_t j = head + packets * V + threadIdx.x; j < n; j += kThreads) {
    const float v = F::load(x[j]);
    absorb<1>(m, s, &v);
  }
  block_merge(m, s);
  if (threadIdx.x == 0) {
    out.row_max[row] = m;
    out.row_sum[row] = s;
    const int64_t t = r.targets[row] - r.vocab_start;
    float tv = 0.0f;
    if (t >= 0 && t < r.cols) tv = t < n ? F::load(x[t]) : -INFINITY;
    out.target_logit[row] = tv;
  }
}

struct GradArgs {
  const float* lse;
  const float* grad_output;
  void* grad;
  int64_t grad_row_stride;
};

// One gradient element: column j of the row, logit x.
struct GradOf {
  float lse2, scale;  // lse * log2(e); grad_output / rows
  int64_t target, valid;  // the target's column (-1: not in this shard's valid columns)
  __device__ __forceinline__ float operator()(int64_t j, float x) const {
    if (j >= valid) return 0.0f;
    const float p = exp2f(fmaf(x, kLog2e, -lse2));
    return (j == target ? p - 1.0f : p) * scale;
  }
};

template <class F>
__global__ void __launch_bounds__(kThreads) grad_kernel(CeRows r, GradArgs a) {
  using Raw = typename F::Raw;
  constexpr int V = kVec<F>;
  const int64_t row = blockIdx.x, n = r.cols;
  const Raw* x = static_cast<const Raw*>(r.logits) + row * r.row_stride;
  Raw* g = static_cast<Raw*>(a.grad) + row * a.grad_row_stride;
  GradOf f;
  f.lse2 = a.lse[row] * kLog2e;
  f.scale = *a.grad_output / static_cast<float>(r.rows);
  f.valid = r.valid_cols;
  f.target = r.targets[row] - r.vocab_start;
  if (f.target < 0 || f.target >= f.valid) f.target = -1;
  // Packets need the same offset from a 16-byte boundary in the logits and in the gradient.
  const bool same = reinterpret_cast<uintptr_t>(x) % 16 == reinterpret_cast<uintptr_t>(g) % 16;
  const int64_t head = same ? head_length<F>(x, n) : n;
  const int64_t packets = (n - head) / V;
  for (int64_t j = threadIdx.x; j < head; j += kThreads) g[j] = F::store(f(j, F::load(x[j])));
  int64_t p = threadIdx.x;
  for (; p + kThreads < packets; p += 2 * kThreads) {
    float v[2 * V];
    load_packet<F>(x + head + p * V, v);
    load_packet<F>(x + head + (p + kThreads) * V, v + V);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      v[k] = f(head + p * V + k, v[k]);
      v[V + k] = f(head + (p + kThreads) * V + k, v[V + k]);
    }
    store_packet<F>(g + head + p * V, v);
    store_packet<F>(g + head + (p + kThreads) * V, v + V);
  }
  if (p < packets) {
    float v[V];
    load_packet<F>(x + head + p * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = f(head + p * V + k, v[k]);
    store_packet<F>(g + head + p * V, v);
  }
  for (int64_t j = head + packets * V + threadIdx.x; j < n; j += kThreads) {
    g[j] = F::store(f(j, F::load(x[j])));
  }
}

const char* launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

bool ce_kernels_built() { return true; }

const char* ce_forward_stats(const CeRows& r, float* row_max, float* row_sum, float* target_logit,
                             void* stream) {
  if (r.rows == 0) return nullptr;
  const StatsOut out{row_max, row_sum, target_logit};
  const auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(r.rows));
  switch (r.dtype) {
    case CeDtype::kBf16: stats_kernel<Bf16><<<grid, kThreads, 0, s>>>(r, out); break;
    case CeDtype::kFp16: stats_kernel<Fp16><<<grid, kThreads, 0, s>>>(r, out); break;
    case CeDtype::kFp32: stats_kernel<Fp32><<<grid, kThreads, 0, s>>>(r, out); break;
  }
  return launch_error();
}

const char* ce_backward(const CeRows& r, const float* lse, const float* grad_output, void* grad,
                        int64_t grad_row_stride, void* stream) {
  if (r.rows == 0) return nullptr;
  const GradArgs a{lse, grad_output, grad, grad_row_stride};
  const auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(r.rows));
  switch (r.dtype) {
    case CeDtype::kBf16: grad_kernel<Bf16><<<grid, kThreads, 0, s>>>(r, a); break;
    case CeDtype::kFp16: grad_kernel<Fp16><<<grid, kThreads, 0, s>>>(r, a); break;
    case CeDtype::kFp32: grad_kernel<Fp32><<<grid, kThreads, 0, s>>>(r, a); break;
  }
  return launch_error();
}

}  // namespace dtrain::engine::detail
