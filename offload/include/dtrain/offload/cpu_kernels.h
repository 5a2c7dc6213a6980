// Fused CPU optimizer kernels over flat float32 arrays (the building block of CpuOptimizer).
//
// One call updates n contiguous elements in a single pass: reads the fp32 master weights, the
// gradient (fp32, bf16 or fp16, converted in registers) and the optimizer state, writes the
// weights and the state back and, optionally, the new weights once more into `out` as fp32,
// bf16 or fp16 (round to nearest even, NaN kept NaN: as at::Tensor::to). The formulas are
// torch.optim's single-tensor ones (see UpdateConfig), evaluated in float32.
//
// Three implementations of one interface: a portable scalar kernel, AVX2+FMA+F16C and
// AVX-512F. Each is compiled with its own target flags in its own file and chosen at run time
// by CPU feature detection (one binary runs on any x86-64; other architectures get the
// scalar kernel). A kernel call is synchronous, single-threaded and touches only the arrays
// it is given: threads may run calls on disjoint ranges concurrently.
//
// This header is free of libtorch so the ISA-specific files stay free of shared inline code.
#pragma once

#include <cstdint>

namespace dtrain::offload {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
// "scalar", "avx2", "avx512".
const char* to_string(Isa isa);
// Whether this build has the kernel and this CPU (and OS) can run it. kScalar: always.
bool isa_supported(Isa isa);
// The widest supported kernel.
Isa best_isa();

// Element types of the gradient and of the optional output copy.
enum class ElemType : uint8_t { kNone = 0, kFloat32, kBFloat16, kFloat16 };

enum class OptimKind : uint8_t { kSgd, kAdam, kAdagrad };

// Per-step constants (computed on the host in double, rounded to float once; see
// make_update_config in cpu_optimizer.h). For every rule the gradient is first
//   g = grad * grad_multiplier (+ l2_weight_decay * param when l2_weight_decay != 0)
// and the parameter scaled by param_decay (AdamW's decoupled decay 1 - lr * wd; else 1).
//   kAdam:    m += (1 - beta1) (g - m);  v = beta2 v + (1 - beta2) g^2;
//             amsgrad: vmax = max(vmax, v), used for v below;
//             param -= step_size * m / (sqrt(v) * inv_bias_correction2_sqrt + eps)
//             with step_size = lr / (1 - beta1^t), inv_bias_correction2_sqrt = 1/sqrt(1 - beta2^t)
//   kAdagrad: sum += g^2;  param -= lr * g / (sqrt(sum) + eps)      (lr: the decayed clr)
//   kSgd:     with momentum: buf = first_step ? g : momentum * buf + dampening_keep * g;
//                            g = nesterov ? g + momentum * buf : buf
//             param -= lr * g
// Terms that torch skips (weight decay 0) are skipped too, so inf/NaN propagate as in torch.
struct UpdateConfig {
  OptimKind kind = OptimKind::kAdam;
  float grad_multiplier = 1.0f;
  float l2_weight_decay = 0.0f;
  float param_decay = 1.0f;
  float lr = 0.0f;  // sgd: lr; adagrad: lr / (1 + (t - 1) lr_decay); unused by adam
  // adam
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float step_size = 0.0f;
  float inv_bias_correction2_sqrt = 1.0f;
  float eps = 1e-8f;  // adam and adagrad
  bool amsgrad = false;
  // sgd
  bool momentum = false;  // has a momentum buffer (state0)
  float momentum_factor = 0.0f;
  float dampening_keep = 1.0f;  // 1 - dampening
  bool first_step = true;       // the buffer starts as the gradient
  bool nesterov = false;
};

// The arrays of one call: n elements each, no alignment required, no overlap between them.
// State slots: adam: state0 exp_avg, state1 exp_avg_sq, state2 max_exp_avg_sq (amsgrad);
// adagrad: state0 sum; sgd: state0 momentum buffer (when momentum). Unused slots may be null.
struct UpdateArrays {
  float* param = nullptr;
  const void* grad = nullptr;
  ElemType grad_type = ElemType::kFloat32;  // kFloat32, kBFloat16 or kFloat16
  float* state0 = nullptr;
  float* state1 = nullptr;
  float* state2 = nullptr;
  void* out = nullptr;                  // receives the updated parameter; null: no copy
  ElemType out_type = ElemType::kNone;  // kNone exactly when out is null
  int64_t n = 0;
};

using UpdateFn = void (*)(const UpdateConfig& config, const UpdateArrays& arrays);

// The kernel of `isa`. Throws dtrain::Error when !isa_supported(isa) (naming the CPU flags
// it needs).
UpdateFn update_kernel(Isa isa);

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
