#include "dtrain/engine/parallel/quantize.h"

#include <cstdio>
#include <limits>
#include <map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {
namespace {

// qint8's range as PyTorch's observers use it for weights (no reduced range).
constexpr double kHalfRange = (127.0 - (-128.0)) / 2;

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

}  // namespace

at::Tensor Int8Linear::int8_values() const { return qweight.int_repr(); }

at::Tensor Int8Linear::scales() const {
  if (granularity == QuantGranularity::kPerChannel) return qweight.q_per_channel_scales().to(at::kFloat);
  return at::full({1}, qweight.q_scale(), at::kFloat);
}

int64_t Int8Linear::weight_bytes() const { return qweight.numel() + scales().numel() * 4; }

int64_t Int8Linear::bias_bytes() const { return bias.defined() ? bias.numel() * 4 : 0; }

Int8Linear quantize_linear(const at::Tensor& weight, const at::Tensor& bias, QuantGranularity granularity) {
  DTRAIN_CHECK(weight.dim() == 2 && weight.numel() > 0, "int8 quantization needs a Linear weight [out, in] with "
               "elements; got shape ", weight.sizes());
  at::NoGradGuard no_grad;
  Int8Linear q;
  q.granularity = granularity;
  const at::Tensor w = weight.detach().to(at::kCPU, at::kFloat).contiguous();
  const double eps = std::numeric_limits<float>::epsilon();
  // The observers' symmetric scale, computed in float32 as they compute it.
  if (granularity == QuantGranularity::kPerChannel) {
    at::Tensor amax = at::maximum(w.amin(1).neg().clamp_min(0), w.amax(1).clamp_min(0));
    at::Tensor scale = amax.div(kHalfRange).clamp_min(eps);
    q.qweight = at::quantize_per_channel(w, scale.to(at::kDouble), at::zeros({w.size(0)}, at::kLong), 0, at::kQInt8);
  } else {
    at::Tensor amax = at::maximum(w.min().neg().clamp_min(0), w.max().clamp_min(0));
    const double scale = amax.div(kHalfRange).clamp_min(eps).item<float>();
    q.qweight = at::quantize_per_tensor(w, scale, 0, at::kQInt8);
  }
  if (bias.defined()) q.bias = bias.detach().to(at::kCPU, at::kFloat).contiguous();
  std::vector<c10::IValue> stack{q.qweight, q.bias.defined() ? c10::IValue(q.bias) : c10::IValue()};
  op("quantized::linear_prepack").callBoxed(&stack);
  DTRAIN_CHECK(stack.size() == 1, "quantized::linear_prepack returned ", stack.size(), " values");
  q.packed = std::move(stack[0]);
  return q;
}

at::Tensor int8_linear(const at::Tensor& x, const Int8Linear& w) {
  DTRAIN_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "the int8 Linear runs on float32 inputs on the "
               "CPU (libtorch's quantized::linear_dynamic has no kernel for ", x.device(), " ", x.scalar_type(),
               "); evaluate the quantized model with --device=cpu and without --amp");
  std::vector<c10::IValue> stack{x.contiguous(), w.packed, /*reduce_range=*/true};
  op("quantized::linear_dynamic").callBoxed(&stack);
  return stack.at(0).toTensor();
}

void QuantizableLinear::quantize(QuantGranularity granularity, bool release_float) {
  check_quantizable();
  at::Tensor& weight = linear_weight();
  DTRAIN_CHECK(!int8_ || weight.numel() > 0, "this Linear layer is already int8 and its float weights were released");
  int8_ = quantize_linear(weight, linear_bias(), granularity);
  if (release_float) {
    at::NoGradGuard no_grad;
    weight.set_data(at::empty({0}, weight.options()));
  }
}

const Int8Linear& QuantizableLinear::int8() const {
  DTRAIN_CHECK(int8_.has_value(), "this Linear layer is not quantized; call quantize_dynamic_int8 first");
  return *int8_;
}

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  if (int8_) return int8_linear(input, *int8_);
  return torch::nn::LinearImpl::forward(input);
}

std::string QuantizeReport::summary() const {
  char text[320];
  std::snprintf(text, sizeof text,
                "quantized %zu Linear layer(s) to int8: weights %.3f MB -> %.3f MB (%.2fx smaller); biases %.3f MB "
                "and other parameters %.3f MB stay float32",
                layers.size(), float_weight_bytes / 1e6, int8_weight_bytes / 1e6,
                int8_weight_bytes ? static_cast<double>(float_weight_bytes) / int8_weight_bytes : 0.0, bias_bytes / 1e6,
                other_parameter_bytes / 1e6);
  return text;
}

QuantizeReport quantize_dynamic_int8(torch::nn::Module& model, const QuantizeOptions& options) {
  QuantizeReport report;
  std::vector<std::string> stuck;
  std::vector<std::pair<std::string, QuantizableLinear*>> targets;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    torch::nn::Module* m = item.value().get();
    if (auto* q = dynamic_cast<QuantizableLinear*>(m)) {
      targets.emplace_back(item.key().empty() ? "(the model)" : item.key(), q);
    } else if (m->as<torch::nn::LinearImpl>()) {
      stuck.push_back(item.key());
    }
  }
  DTRAIN_CHECK(stuck.empty(), "cannot quantize ", stuck.size(), " torch::nn::Linear layer(s) (", stuck.front(),
               stuck.size() > 1 ? ", ..." : "", "): libtorch's Linear cannot be switched to int8 in place; build the "
               "model with dtrain::engine::Linear, a drop-in with the same options, parameters and checkpoints");
  DTRAIN_CHECK(!targets.empty(), "--quantize=int8: the model has no Linear layers to quantize (dynamic int8 "
               "quantization replaces Linear layers only, as torch's quantize_dynamic does with {nn.Linear})");
  for (const at::Tensor& p : model.parameters()) {
    DTRAIN_CHECK(p.device().is_cpu(), "int8 quantization runs on the CPU (libtorch's dynamic int8 Linear has no ",
                 p.device().type(), " kernel); evaluate or export the quantized model with --device=cpu");
  }
  std::unordered_set<const void*> replaced;  // the quantized layers' weights and biases
  for (auto& [name, layer] : targets) {
    layer->quantize(options.granularity, options.release_float);
    const Int8Linear& w = layer->int8();
    report.layers.push_back(name);
    report.float_weight_bytes += w.qweight.numel() * 4;
    report.int8_weight_bytes += w.weight_bytes();
    report.bias_bytes += w.bias_bytes();
  }
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (!dynamic_cast<QuantizableLinear*>(item.value().get())) continue;
    for (const at::Tensor& p : item.value()->parameters(/*recurse=*/false)) replaced.insert(p.unsafeGetTensorImpl());
  }
  for (const at::Tensor& p : model.parameters()) {
    if (!replaced.count(p.unsafeGetTensorImpl())) report.other_parameter_bytes += p.numel() * p.element_size();
  }
  return report;
}

std::vector<std::pair<std::string, at::Tensor>> int8_state(const torch::nn::Module& model) {
  std::map<std::string, const Int8Linear*> int8;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    auto* q = dynamic_cast<const QuantizableLinear*>(item.value().get());
    if (q && q->quantized()) int8[item.key().empty() ? "weight" : item.key() + ".weight"] = &q->int8();
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.named_parameters()) {
    auto it = int8.find(p.key());
    if (it == int8.end()) {
      out.emplace_back(p.key(), p.value());
    } else {
      out.emplace_back(p.key(), it->second->int8_values());
      out.emplace_back(p.key() + "_scale", it->second->scales());
    }
  }
  for (const auto& b : model.named_buffers()) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

QuantGranularity parse_quant_granularity(const std::string& name) {
  if (name == "channel") return QuantGranularity::kPerChannel;
  if (name == "tensor") return QuantGranularity::kPerTensor;
  DTRAIN_CHECK(false, "--quantize_scales=", name, " is not a granularity; use channel (one scale per output "
               "feature) or tensor (one scale per weight, quantize_dynamic's default)");
  return QuantGranularity::kPerChannel;
}

}  // namespace dtrain::engine
