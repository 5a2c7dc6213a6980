// Dynamic int8 quantization of Linear layers for evaluation, inference and export: what
// torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8) does in Python.
//
// Each quantized layer keeps its weight as int8 with symmetric scales (zero point 0), one per
// output channel or one per tensor, computed as PyTorch's weight observers compute them
// (PerChannelMinMaxObserver / MinMaxObserver with qint8 and a symmetric qscheme:
// scale = max(|min|, |max|) / 127.5, at least float32's epsilon), packed by libtorch's
// quantized::linear_prepack. Its forward runs libtorch's quantized::linear_dynamic: the
// activations are quantized to uint8 on the fly per batch (reduce_range, as the Python module
// calls it), multiplied in int8 by FBGEMM and returned in float32. The same weights and inputs
// therefore give the same outputs as the Python quantized module.
//
// The kernels are CPU-only in libtorch 2.11 (FBGEMM on x86, QNNPACK on ARM): quantize a model
// that lives on the CPU. A tensor-parallel layer is quantized only unsplit (tensor-parallel
// size 1): load a tensor-parallel checkpoint into one process, which gathers it.
//
// libtorch's torch::nn::Linear cannot be switched in place (its forward is not virtual and
// the module tree holds it by type), so the layers that can be quantized are those that
// implement QuantizableLinear: dtrain::engine::Linear (a drop-in for torch::nn::Linear: same
// options, parameter names and checkpoints) and the tensor-parallel linears.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace dtrain::engine {

enum class QuantGranularity { kPerChannel, kPerTensor };

// One Linear layer's int8 weights.
struct Int8Linear {
  c10::IValue packed;   // quantized::linear_prepack(qweight, bias): what the kernel reads
  at::Tensor qweight;   // the quantized weight (torch.qint8 per-channel or per-tensor affine)
  at::Tensor bias;      // float32, or undefined
  QuantGranularity granularity = QuantGranularity::kPerChannel;
  // The int8 values [out, in] (qweight.int_repr()) and the float32 scales [out] or [1].
  at::Tensor int8_values() const;
  at::Tensor scales() const;
  // Bytes of the int8 weight and its float32 scales (what replaces the float32 weight's
  // 4 x out x in bytes), and of the bias.
  int64_t weight_bytes() const;
  int64_t bias_bytes() const;
};

// Quantizes a float weight [out, in] (any float dtype; a copy is made on the CPU in float32).
Int8Linear quantize_linear(const at::Tensor& weight, const at::Tensor& bias, QuantGranularity granularity);
// y = x W^T + b through quantized::linear_dynamic; x is float32 [..., in] on the CPU.
at::Tensor int8_linear(const at::Tensor& x, const Int8Linear& w);

// A linear layer that can switch to int8 weights. After quantize(), forward uses the int8
// weights; with release_float the float weight is replaced by an empty tensor (its memory is
// freed: the layer can no longer be trained, saved or return to float).
class QuantizableLinear {
 public:
  virtual ~QuantizableLinear() = default;
  void quantize(QuantGranularity granularity, bool release_float);
  bool quantized() const { return int8_.has_value(); }
  const Int8Linear& int8() const;  // dtrain::Error unless quantized()
  // Refuses (dtrain::Error naming the reason) when the layer cannot be quantized as it is.
  virtual void check_quantizable() const {}

 protected:
  virtual at::Tensor& linear_weight() = 0;  // [out, in]
  virtual at::Tensor linear_bias() = 0;     // [out] or undefined
  std::optional<Int8Linear> int8_;
};

// torch::nn::Linear with int8 inference: the same options, parameters ("weight", "bias"),
// initialization and checkpoints.
struct LinearImpl : torch::nn::LinearImpl, QuantizableLinear {
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input);

 protected:
  at::Tensor& linear_weight() override { return weight; }
  at::Tensor linear_bias() override { return bias; }
};
TORCH_MODULE(Linear);

struct QuantizeOptions {
  QuantGranularity granularity = QuantGranularity::kPerChannel;
  bool release_float = true;  // free the float weights (the memory quantization saves)
};

struct QuantizeReport {
  std::vector<std::string> layers;    // the quantized layers' module names
  int64_t float_weight_bytes = 0;     // their weights before (4 bytes an element in float32)
  int64_t int8_weight_bytes = 0;      // after: int8 values plus float32 scales
  int64_t bias_bytes = 0;             // their biases (float32 either way)
  int64_t other_parameter_bytes = 0;  // parameters left in float (convolutions, embeddings, norms)
  std::string summary() const;        // "quantized 3 Linear layers: weights 1.23 MB -> 0.31 MB (3.97x smaller) ..."
};

// Quantizes every QuantizableLinear of model (on the CPU, float32). Refuses, naming the
// layers and the fix, a model with torch::nn::Linear layers it cannot switch, one with no
// Linear layer at all, and a model on another device.
QuantizeReport quantize_dynamic_int8(torch::nn::Module& model, const QuantizeOptions& options = {});

// The model's parameters and buffers by name, with each quantized layer's weight as its int8
// values ("<layer>.weight", int8 [out, in]) followed by its float32 scales
// ("<layer>.weight_scale", [out] or [1]): the float weight is int8 x scale (zero points are 0).
// What dtrain-export --quantize=int8 writes.
std::vector<std::pair<std::string, at::Tensor>> int8_state(const torch::nn::Module& model);

// "channel" or "tensor" -> QuantGranularity; dtrain::Error naming the choices otherwise.
QuantGranularity parse_quant_granularity(const std::string& name);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
