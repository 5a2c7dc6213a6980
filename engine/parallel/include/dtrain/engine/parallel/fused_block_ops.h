// Fused operations of a transformer block: a LayerNorm (or Llama's RMSNorm) of a residual sum,
// a bias + GELU and a SwiGLU, each one kernel forward and one pass backward where eager ATen
// launches several (the add, the norm, its weight gradients in another kernel, autocast's casts
// and the residual gradients' adds; the GELU and the bias gradient's separate column sum; the
// RMSNorm's six element-wise ops; the SiLU and the product).
//
// On CUDA, dtrain's kernels (engine/parallel/cuda/fused_block.cu) for the dtype combinations
// they serve; on the CPU, the same per-element formulas on the host (slow loops: the reference
// the float64 tests check against ATen's composition, not a training path). The models take
// the fused path through add_layer_norm, add_rms_norm, bias_gelu and swiglu below when the ops
// are enabled (fused_block_ops_enabled: off by default until verified on a GPU), and fall back to
// ATen's composition wherever the kernels do not serve, so CPU training is unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace dtrain::engine {

struct AddLayerNorm {
  at::Tensor sum;     // x + y in their promoted dtype; x itself without y
  at::Tensor normed;  // layer_norm(sum) * weight + bias
};

// sum = x + y (rounded to the promoted dtype; y undefined: x), normed = LayerNorm of sum over
// its last dimension (biased variance, eps) times weight plus bias (bias may be undefined), in
// out_dtype (default: sum's dtype), all in the accumulation type (float, or double when x is
// float64). Differentiable in x, y, weight and bias; backward adds the gradient reaching sum
// from its other uses in the same pass. CUDA (with fused_add_layer_norm_available) or CPU.
AddLayerNorm fused_add_layer_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                  const at::Tensor& bias, double eps,
                                  std::optional<at::ScalarType> out_dtype = std::nullopt);

// The same for an RMSNorm, as transformers' LlamaRMSNorm computes it: sum = x + y, normed =
// weight * round(sum * rsqrt(mean(sum^2) + eps)) where round is to sum's dtype (Llama's cast
// back to the input's dtype), in out_dtype (default: the promoted dtype of sum and weight).
// No bias. Availability: fused_add_layer_norm_available with an undefined bias.
AddLayerNorm fused_add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps,
                                std::optional<at::ScalarType> out_dtype = std::nullopt);

// silu(gate) * up, rounded once, for a SwiGLU MLP; gate and up of one shape and dtype. Backward
// gives both gradients in one pass. CUDA (with fused_swiglu_available) or CPU.
at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up);
bool fused_swiglu_available(const at::Tensor& gate, const at::Tensor& up);

// gelu(y + bias, tanh approximation) in y's dtype, rounded once; y [..., F], bias [F]. The bias
// gradient is the column sum of the (rounded) input gradient. CUDA (with
// fused_bias_gelu_available) or CPU.
at::Tensor fused_bias_gelu(const at::Tensor& y, const at::Tensor& bias);

// Whether dtrain's CUDA kernels serve these tensors: CUDA, this build has them, matching
// shapes, and a dtype combination they serve (float64, float32, bfloat16 or float16 alike; a
// float32 sum with a bfloat16 or float16 branch and output; a bfloat16 or float16 y with a
// float32 bias).
bool fused_add_layer_norm_available(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                    const at::Tensor& bias, at::ScalarType out_dtype);
bool fused_bias_gelu_available(const at::Tensor& y, const at::Tensor& bias);

// ---- what the models call --------------------------------------------------------------

// A block's LayerNorm of a residual sum whose output feeds a Linear: the fused kernels on CUDA
// where they serve, with the output already in autocast's dtype when autocast is on (the cast
// the Linear would make; the same rounding), else ATen's composition exactly as before
// (x + y, at::layer_norm). y undefined: a plain LayerNorm of x (sum is x).
AddLayerNorm add_layer_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                            const at::Tensor& bias, double eps);

// add_layer_norm's RMSNorm (Llama's blocks): the fused kernel where it serves, else
// transformers' LlamaRMSNorm op for op.
AddLayerNorm add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps);

// silu(gate) * up: the fused kernel where it serves and the ops are enabled, else ATen's.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// gelu(y + bias, tanh) for a Linear's output computed without its bias: the fused kernel where
// it serves, else ATen's composition.
at::Tensor bias_gelu(const at::Tensor& y, const at::Tensor& bias);

// Whether the models take the fused path (add_layer_norm's kernels, a Linear without its bias
// then bias_gelu, swiglu): CUDA inputs in a build with the kernels, with the fused block ops
// enabled, and no TorchScript trace recording (a trace records ATen's ops). Elsewhere the models keep at::layer_norm, at::linear with its bias, at::gelu and
// Llama's ops, bit for bit as before.
bool fused_block_kernels_serve(const at::Tensor& x);

// Enabled: set_fused_block_ops' override if set, else the environment's DTRAIN_FUSED_BLOCK_OPS
// (1 on, 0 off; read once per process; another value is an error), else
// kFusedBlockOpsByDefault. The kernels are off by default until the GPU suite
// (tests/gpu/fused_block_ops_gpu_test.cc) has run them on a GPU; that session turns the default
// on.
inline constexpr bool kFusedBlockOpsByDefault = false;
bool fused_block_ops_enabled();
void set_fused_block_ops(std::optional<bool> enabled);  // std::nullopt: back to the environment

}  // namespace dtrain::engine
