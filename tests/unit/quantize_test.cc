// Dynamic int8 quantization: the symmetric scales and int8 values in closed form (float64
// arithmetic on the same weights), the int8 Linear against the float one, the tensor-parallel
// linears unsplit, what quantize_dynamic_int8 reports, and what it refuses. The comparison with
// PyTorch's own quantize_dynamic is tests/examples/quantize.py.
#include "dtrain/engine/parallel/quantize.h"

#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;

// round-half-to-even(w / scale) clamped to [-128, 127], scale = max|w| / 127.5, in float64.
void expect_closed_form(const at::Tensor& w, const Int8Linear& q, bool per_channel) {
  at::Tensor wd = w.to(at::kDouble);
  at::Tensor amax = per_channel ? wd.abs().amax(1, /*keepdim=*/true) : wd.abs().max().reshape({1, 1});
  at::Tensor scale = amax.to(at::kFloat).div(127.5).to(at::kDouble);  // the observers divide in float32
  EXPECT_TRUE(at::allclose(q.scales().to(at::kDouble), scale.reshape({-1}), 0, 0));
  // FBGEMM multiplies by the float32 reciprocal of the scale: halfway cases may round the other
  // way than an exact division would, by one step at most.
  at::Tensor want = at::round(wd / scale).clamp(-128, 127);
  at::Tensor diff = (q.int8_values().to(at::kDouble) - want).abs();
  EXPECT_LE(diff.max().item<double>(), 1.0);
  EXPECT_LE(diff.sum().item<double>(), 0.01 * static_cast<double>(w.numel()));
  // The extremes of each channel land on +-127 (symmetric: 127.5 rounds to the even 128, clamped).
  at::Tensor q_extreme = per_channel ? q.int8_values().to(at::kInt).abs().amax(1) : q.int8_values().to(at::kInt).abs().max();
  EXPECT_TRUE(at::all(q_extreme.ge(127)).item<bool>());
}

TEST(Quantize, ScalesAndValuesInClosedForm) {
  torch::manual_seed(3);
  at::Tensor w = at::randn({32, 64});
  w[2].mul_(20);  // channels of very different ranges: per-channel scales differ
  expect_closed_form(w, quantize_linear(w, at::Tensor(), QuantGranularity::kPerChannel), true);
  expect_closed_form(w, quantize_linear(w, at::Tensor(), QuantGranularity::kPerTensor), false);
  // A zero row keeps the smallest scale (float32's epsilon), not a division by zero.
  w[4].zero_();
  Int8Linear q = quantize_linear(w, at::Tensor(), QuantGranularity::kPerChannel);
  EXPECT_FLOAT_EQ(q.scales()[4].item<float>(), std::numeric_limits<float>::epsilon());
  EXPECT_TRUE(at::equal(q.int8_values()[4], at::zeros({64}, at::kChar)));
}

TEST(Quantize, Int8LinearFollowsTheFloatLinear) {
  torch::manual_seed(4);
  Linear layer(64, 32);
  at::Tensor x = at::randn({16, 64});
  at::Tensor want = layer->forward(x).detach();
  layer->quantize(QuantGranularity::kPerChannel, /*release_float=*/false);
  at::Tensor got = layer->forward(x);
  ASSERT_EQ(got.sizes(), want.sizes());
  // int8 weights and uint8 activations (7 bits with reduce_range): a relative error of about 1%.
  const double rel = (got - want).norm().item<double>() / want.norm().item<double>();
  EXPECT_LT(rel, 0.02);
  EXPECT_GT(rel, 0.0);  // the int8 path did run
  // The int8 Linear is a function of the int8 weights: the same as the dequantized weights applied
  // to the activations quantized the same way, checked loosely in float64.
  at::Tensor deq = layer->int8().qweight.dequantize().to(at::kDouble);
  at::Tensor ref = at::linear(x.to(at::kDouble), deq, layer->bias.to(at::kDouble));
  EXPECT_LT((got.to(at::kDouble) - ref).abs().max().item<double>(), 0.05 * ref.abs().max().item<double>());
}

TEST(Quantize, ModelReportAndRelease) {
  torch::manual_seed(5);
  torch::nn::Sequential model(Linear(8, 16), torch::nn::ReLU(), Linear(16, 4),
                              torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
  at::Tensor x = at::randn({3, 8});
  at::Tensor want = model->forward(x).detach();
  QuantizeReport r = quantize_dynamic_int8(*model);
  EXPECT_EQ(r.layers, (std::vector<std::string>{"0", "2"}));
  EXPECT_EQ(r.float_weight_bytes, 4 * (8 * 16 + 16 * 4));
  EXPECT_EQ(r.int8_weight_bytes, (8 * 16 + 4 * 16) + (16 * 4 + 4 * 4));  // values + a float32 scale per row
  EXPECT_EQ(r.bias_bytes, 4 * (16 + 4));
  EXPECT_EQ(r.other_parameter_bytes, 4 * (4 + 4));  // the LayerNorm's weight and bias
  EXPECT_NE(r.summary().find("2 Linear layer(s)"), std::string::npos);
  // The float weights are released and the model still runs, close to its float output.
  EXPECT_EQ(model[0]->as<LinearImpl>()->weight.numel(), 0);
  at::Tensor got = model->forward(x);
  EXPECT_LT((got - want).abs().max().item<double>(), 0.1);
  // The exported state: int8 values and scales in place of the weights, the rest as it was.
  auto state = int8_state(*model);
  std::vector<std::string> names;
  for (auto& [n, t] : state) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.weight_scale", "0.bias", "2.weight", "2.weight_scale",
                                             "2.bias", "3.weight", "3.bias"}));
  EXPECT_EQ(state[0].second.scalar_type(), at::kChar);
  EXPECT_NE(error_of([&] { model[0]->as<LinearImpl>()->quantize(QuantGranularity::kPerTensor, true); })
                .find("already int8"),
            std::string::npos);
}

TEST(Quantize, TensorParallelLinearsUnsplit) {
  auto comm = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  torch::manual_seed(6);
  ParallelLinearOptions co(12, 24);
  ColumnParallelLinear col(co, *comm);
  ParallelLinearOptions ro(24, 12);
  RowParallelLinear row(ro, *comm);
  at::Tensor x = at::randn({5, 12});
  at::Tensor want = row->forward(col->forward(x).relu()).detach();
  torch::nn::Sequential holder;
  holder->push_back("col", col);
  holder->push_back("row", row);
  QuantizeReport r = quantize_dynamic_int8(*holder);
  EXPECT_EQ(r.layers.size(), 2u);
  at::Tensor got = row->forward(col->forward(x).relu());
  EXPECT_LT((got - want).norm().item<double>() / want.norm().item<double>(), 0.03);
}

TEST(Quantize, Refusals) {
  torch::nn::Sequential libtorch_linear(torch::nn::Linear(4, 4));
  EXPECT_NE(error_of([&] { quantize_dynamic_int8(*libtorch_linear); }).find("dtrain::engine::Linear"),
            std::string::npos);
  torch::nn::Sequential convs(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 2, 3)));
  EXPECT_NE(error_of([&] { quantize_dynamic_int8(*convs); }).find("no Linear layers to quantize"), std::string::npos);
  EXPECT_NE(error_of([] { parse_quant_granularity("row"); }).find("use channel"), std::string::npos);
  Linear not_quantized(2, 2);
  EXPECT_NE(error_of([&] { not_quantized->int8(); }).find("not quantized"), std::string::npos);
  Linear half(4, 4);
  half->to(at::kBFloat16);
  half->quantize(QuantGranularity::kPerChannel, false);  // any float weight quantizes
  EXPECT_NE(error_of([&] { half->forward(at::randn({2, 4}).to(at::kBFloat16)); }).find("float32 inputs on the CPU"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
