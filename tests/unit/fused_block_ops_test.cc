// The fused block operations (parallel/fused_block_ops.h) on the CPU, where they run the
// kernels' per-element formulas on the host: against ATen's composition (x + y, layer_norm;
// Llama's RMSNorm op for op; silu(gate) * up; gelu(y + bias, "tanh")) through autograd in float64, forward and every input's gradient,
// with the sum's other uses sending a gradient of their own; the mixed dtypes autocast makes
// (a float32 residual, a bfloat16 branch and output) against the composition in float32
// rounded once; the dispatch (never the kernels on the CPU; the models' CPU path unchanged);
// and the errors for mismatched shapes. The CUDA kernels: tests/gpu/fused_block_ops_gpu_test.cc.
#include <gtest/gtest.h>

#include <cstdlib>

#include <torch/torch.h>

#include "dtrain/engine/parallel/fused_block_ops.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "test_util.h"

namespace dtrain::engine::fused_block_cases {
namespace {

using testing_util::error_of;

// The largest difference over the largest reference magnitude (at least 1e-6: a row of one
// element normalizes to exactly 0 here and to about 1e-15 in ATen, whose weight gradient is
// then that small, not 0).
double max_rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-6)).item<double>();
}

struct NormCase {
  std::vector<int64_t> shape;
  bool with_y, with_bias, sum_used;
};

// x, y, weight, bias (leaves) of a case in dtype t from one seed; R1, R2 the loss's weights.
struct NormInputs {
  at::Tensor x, y, w, b, r1, r2;
};

NormInputs make_norm_inputs(const NormCase& c, uint64_t seed, at::ScalarType xt, at::ScalarType yt, at::ScalarType wt) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t d = c.shape.back();
  NormInputs in;
  in.x = (at::randn(c.shape, g, at::kDouble) * 2 + 0.5).to(xt);
  in.y = c.with_y ? (at::randn(c.shape, g, at::kDouble)).to(yt) : at::Tensor();
  in.w = (at::randn({d}, g, at::kDouble) * 0.3 + 1).to(wt);
  in.b = c.with_bias ? (at::randn({d}, g, at::kDouble) * 0.1).to(wt) : at::Tensor();
  in.r1 = at::randn(c.shape, g, at::kDouble);
  in.r2 = at::randn(c.shape, g, at::kDouble);
  return in;
}

// Leaves requiring gradients, copies of the inputs.
struct Leaves {
  at::Tensor x, y, w, b;
};

Leaves leaves_of(const NormInputs& in) {
  auto leaf = [](const at::Tensor& t) { return t.defined() ? t.detach().clone().requires_grad_(true) : t; };
  return {leaf(in.x), leaf(in.y), leaf(in.w), leaf(in.b)};
}

// loss = sum(normed * r1) (+ sum(sum * r2) when the sum has another use), in float64.
at::Tensor norm_loss(const AddLayerNorm& r, const NormInputs& in, bool sum_used) {
  at::Tensor loss = (r.normed.to(at::kDouble) * in.r1).sum();
  if (sum_used) loss = loss + (r.sum.to(at::kDouble) * in.r2).sum();
  return loss;
}

AddLayerNorm composed(const Leaves& l, double eps) {
  at::Tensor s = l.y.defined() ? l.x + l.y : l.x;
  return {s, at::layer_norm(s, {s.size(-1)}, l.w, l.b, eps)};
}

TEST(FusedBlockOpsCpu, AddLayerNormMatchesTheCompositionInFloat64) {
  const std::vector<NormCase> cases = {
      {{4, 6, 33}, true, true, true},  {{2, 7}, true, true, false}, {{5, 16}, false, true, false},
      {{3, 5}, false, false, false},   {{9, 1}, true, true, true},  {{2, 3, 768}, true, true, true},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const NormCase& c = cases[i];
    SCOPED_TRACE("case " + std::to_string(i));
    const NormInputs in = make_norm_inputs(c, 100 + i, at::kDouble, at::kDouble, at::kDouble);
    const Leaves f = leaves_of(in), r = leaves_of(in);
    const AddLayerNorm got = fused_add_layer_norm(f.x, f.y, f.w, f.b, 1e-5);
    const AddLayerNorm want = composed(r, 1e-5);
    EXPECT_LE(max_rel(got.normed, want.normed), 1e-13);
    EXPECT_LE(max_rel(got.sum, want.sum), 0.0);  // one float64 add, the same
    norm_loss(got, in, c.sum_used && c.with_y).backward();
    norm_loss(want, in, c.sum_used && c.with_y).backward();
    EXPECT_LE(max_rel(f.x.grad(), r.x.grad()), 1e-12);
    if (c.with_y) EXPECT_LE(max_rel(f.y.grad(), r.y.grad()), 1e-12);
    if (c.shape.back() > 1) {
      EXPECT_LE(max_rel(f.w.grad(), r.w.grad()), 1e-12);
    } else {  // a one-element row normalizes to 0: no weight gradient (ATen's rounds to ~1e-13)
      EXPECT_LE(f.w.grad().abs().max().item<double>(), 1e-9);
      EXPECT_LE(r.w.grad().abs().max().item<double>(), 1e-9);
    }
    if (c.with_bias) EXPECT_LE(max_rel(f.b.grad(), r.b.grad()), 1e-12);
  }
}

// An output nothing uses reaches backward undefined (no tensor of zeros made and read): the
// norm unused, the sum's gradient passes to x and y and the weights get none; the sum unused
// (a post-norm sublayer), the gradients are the norm's alone.
TEST(FusedBlockOpsCpu, AnUnusedOutputPassesNoGradient) {
  const NormCase c{{3, 8}, true, true, true};
  const NormInputs in = make_norm_inputs(c, 7, at::kDouble, at::kDouble, at::kDouble);
  {
    const Leaves f = leaves_of(in);
    const AddLayerNorm got = fused_add_layer_norm(f.x, f.y, f.w, f.b, 1e-5);
    (got.sum * in.r2).sum().backward();
    EXPECT_TRUE(at::equal(f.x.grad(), in.r2));
    EXPECT_TRUE(at::equal(f.y.grad(), in.r2));
    EXPECT_FALSE(f.w.grad().defined());
    EXPECT_FALSE(f.b.grad().defined());
  }
  const Leaves f = leaves_of(in), r = leaves_of(in);
  norm_loss(fused_add_layer_norm(f.x, f.y, f.w, f.b, 1e-5), in, false).backward();
  norm_loss(composed(r, 1e-5), in, false).backward();
  EXPECT_LE(max_rel(f.x.grad(), r.x.grad()), 1e-12);
  EXPECT_LE(max_rel(f.y.grad(), r.y.grad()), 1e-12);
  EXPECT_LE(max_rel(f.w.grad(), r.w.grad()), 1e-12);
}

// Autocast's layout: a float32 residual x, a bfloat16 branch y, float32 weights, the norm
// rounded to bfloat16 for the Linear it feeds. The composition: x + y in float32, layer_norm
// in float32, then the cast; the fused output is the same single rounding of a float32 norm
// computed in another order, so it may differ by one bfloat16 step where the float32 values
// straddle a rounding boundary. Gradients: float32 throughout but for y's (bfloat16).
TEST(FusedBlockOpsCpu, AutocastLayoutMatchesTheFloat32CompositionRoundedOnce) {
  const NormCase c{{4, 8, 96}, true, true, true};
  const NormInputs in = make_norm_inputs(c, 7, at::kFloat, at::kBFloat16, at::kFloat);
  const Leaves f = leaves_of(in), r = leaves_of(in);
  const AddLayerNorm got = fused_add_layer_norm(f.x, f.y, f.w, f.b, 1e-5, at::kBFloat16);
  ASSERT_EQ(got.normed.scalar_type(), at::kBFloat16);
  ASSERT_EQ(got.sum.scalar_type(), at::kFloat);
  const AddLayerNorm want_f32 = composed(r, 1e-5);
  const AddLayerNorm want{want_f32.sum, want_f32.normed.to(at::kBFloat16)};
  EXPECT_TRUE(at::equal(got.sum, want.sum));
  // Within one bfloat16 step (2^-8 relative) of the composition, element by element.
  const at::Tensor diff = (got.normed.to(at::kDouble) - want.normed.to(at::kDouble)).abs();
  EXPECT_TRUE((diff <= want.normed.to(at::kDouble).abs() * (1.0 / 128) + 1e-6).all().item<bool>());
  EXPECT_LE(diff.gt(0).sum().item<int64_t>(), diff.numel() / 50) << "more than 2% of the outputs differ";
  norm_loss(got, in, true).backward();
  norm_loss(want, in, true).backward();
  EXPECT_EQ(f.x.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(f.y.grad().scalar_type(), at::kBFloat16);
  EXPECT_LE(max_rel(f.x.grad(), r.x.grad()), 1e-5);
  EXPECT_LE(max_rel(f.y.grad(), r.y.grad()), 1.0 / 128);
  EXPECT_LE(max_rel(f.w.grad(), r.w.grad()), 1e-5);
  EXPECT_LE(max_rel(f.b.grad(), r.b.grad()), 1e-5);
}

TEST(FusedBlockOpsCpu, BiasGeluMatchesTheCompositionInFloat64) {
  for (const auto& shape : std::vector<std::vector<int64_t>>{{4, 5, 48}, {3, 1}, {7, 129}}) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(shape.back());
    const at::Tensor y0 = at::randn(shape, g, at::kDouble) * 3;  // both tails of the GELU
    const at::Tensor b0 = at::randn({shape.back()}, g, at::kDouble);
    const at::Tensor w = at::randn(shape, g, at::kDouble);
    at::Tensor fy = y0.clone().requires_grad_(true), fb = b0.clone().requires_grad_(true);
    at::Tensor ry = y0.clone().requires_grad_(true), rb = b0.clone().requires_grad_(true);
    const at::Tensor got = fused_bias_gelu(fy, fb);
    const at::Tensor want = at::gelu(ry + rb, "tanh");
    EXPECT_LE(max_rel(got, want), 1e-14);
    (got * w).sum().backward();
    (want * w).sum().backward();
    EXPECT_LE(max_rel(fy.grad(), ry.grad()), 1e-13);
    EXPECT_LE(max_rel(fb.grad(), rb.grad()), 1e-13);
  }
}

// Autocast's layout: a bfloat16 matrix product with its float32 bias. The composition rounds the
// GELU of the float32 sum once (the fused kernel's rounding); the bias gradient sums the rounded
// bfloat16 input gradient in float32.
TEST(FusedBlockOpsCpu, BiasGeluOfBfloat16WithAFloat32Bias) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor y0 = (at::randn({6, 40}, g, at::kDouble) * 2).to(at::kBFloat16);
  const at::Tensor b0 = at::randn({40}, g, at::kDouble).to(at::kFloat);
  const at::Tensor w = at::randn({6, 40}, g, at::kDouble).to(at::kBFloat16);
  at::Tensor fy = y0.clone().requires_grad_(true), fb = b0.clone().requires_grad_(true);
  const at::Tensor got = fused_bias_gelu(fy, fb);
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  at::Tensor ry = y0.to(at::kFloat).requires_grad_(true), rb = b0.clone().requires_grad_(true);
  const at::Tensor want = at::gelu(ry + rb, "tanh");
  EXPECT_TRUE((got.to(at::kFloat) - want).abs().le(want.abs() * (1.0 / 256) + 1e-6).all().item<bool>());
  (got * w).sum().backward();
  (want * w.to(at::kFloat)).sum().backward();
  ASSERT_EQ(fb.grad().scalar_type(), at::kFloat);
  EXPECT_LE(max_rel(fy.grad(), ry.grad()), 1.0 / 128);
  // The bias gradient: the column sums of the rounded input gradient, exactly.
  EXPECT_LE(max_rel(fb.grad(), fy.grad().to(at::kFloat).sum(0)), 1e-6);
}

// transformers' LlamaRMSNorm op for op on the sum: float32 statistics, the normalized value cast
// back to the sum's dtype, then the weight.
AddLayerNorm composed_rms(const Leaves& l, double eps) {
  at::Tensor s = l.y.defined() ? l.x + l.y : l.x;
  at::Tensor h = s.to(s.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return {s, l.w * h.to(s.scalar_type())};
}

TEST(FusedBlockOpsCpu, AddRmsNormMatchesLlamasRmsNormInFloat64) {
  const std::vector<NormCase> cases = {{{3, 5, 40}, true, false, true}, {{4, 9}, false, false, false},
                                       {{2, 3, 256}, true, false, false}};
  for (size_t i = 0; i < cases.size(); ++i) {
    const NormCase& c = cases[i];
    SCOPED_TRACE("case " + std::to_string(i));
    const NormInputs in = make_norm_inputs(c, 300 + i, at::kDouble, at::kDouble, at::kDouble);
    const Leaves f = leaves_of(in), r = leaves_of(in);
    const AddLayerNorm got = fused_add_rms_norm(f.x, f.y, f.w, 1e-6);
    const AddLayerNorm want = composed_rms(r, 1e-6);
    EXPECT_LE(max_rel(got.normed, want.normed), 1e-13);
    norm_loss(got, in, c.sum_used).backward();
    norm_loss(want, in, c.sum_used).backward();
    EXPECT_LE(max_rel(f.x.grad(), r.x.grad()), 1e-12);
    if (c.with_y) EXPECT_LE(max_rel(f.y.grad(), r.y.grad()), 1e-12);
    EXPECT_LE(max_rel(f.w.grad(), r.w.grad()), 1e-12);
  }
}

// bfloat16 weights (--param_dtype=bf16): the normalized value is rounded to bfloat16 before the
// bfloat16 weight multiplies it, as in Llama's op-for-op composition, so the outputs agree but
// where the float32 statistics, summed in another order, move a value across a rounding
// boundary.
TEST(FusedBlockOpsCpu, AddRmsNormOfBfloat16RoundsAsLlamaDoes) {
  const NormCase c{{4, 8, 128}, true, false, true};
  const NormInputs in = make_norm_inputs(c, 11, at::kBFloat16, at::kBFloat16, at::kBFloat16);
  const Leaves f = leaves_of(in), r = leaves_of(in);
  const AddLayerNorm got = fused_add_rms_norm(f.x, f.y, f.w, 1e-6);
  const AddLayerNorm want = composed_rms(r, 1e-6);
  ASSERT_EQ(got.normed.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(got.sum, want.sum));
  const at::Tensor diff = (got.normed.to(at::kDouble) - want.normed.to(at::kDouble)).abs();
  EXPECT_TRUE((diff <= want.normed.to(at::kDouble).abs() * (1.0 / 64) + 1e-6).all().item<bool>());
  EXPECT_LE(diff.gt(0).sum().item<int64_t>(), diff.numel() / 50) << "more than 2% of the outputs differ";
  norm_loss(got, in, true).backward();
  norm_loss(want, in, true).backward();
  EXPECT_LE(max_rel(f.x.grad(), r.x.grad()), 1.0 / 64);
  EXPECT_LE(max_rel(f.w.grad(), r.w.grad()), 1.0 / 64);
}

TEST(FusedBlockOpsCpu, SwigluMatchesTheCompositionInFloat64) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(21);
  const at::Tensor g0 = at::randn({3, 7, 50}, g, at::kDouble) * 4, u0 = at::randn({3, 7, 50}, g, at::kDouble);
  const at::Tensor w = at::randn({3, 7, 50}, g, at::kDouble);
  at::Tensor fg = g0.clone().requires_grad_(true), fu = u0.clone().requires_grad_(true);
  at::Tensor rg = g0.clone().requires_grad_(true), ru = u0.clone().requires_grad_(true);
  const at::Tensor got = fused_swiglu(fg, fu), want = at::silu(rg) * ru;
  EXPECT_LE(max_rel(got, want), 1e-14);
  (got * w).sum().backward();
  (want * w).sum().backward();
  EXPECT_LE(max_rel(fg.grad(), rg.grad()), 1e-13);
  EXPECT_LE(max_rel(fu.grad(), ru.grad()), 1e-13);
  EXPECT_NE(error_of([&] { fused_swiglu(fg, fu.narrow(2, 0, 5)); }).find("one shape, dtype and device"),
            std::string::npos);
}

TEST(FusedBlockOpsCpu, ModelsKeepAtensOpsOnTheCpu) {
  const at::Tensor x = at::randn({2, 3, 8}), y = at::randn({2, 3, 8}), w = at::randn({8}), b = at::randn({8});
  EXPECT_FALSE(fused_block_kernels_serve(x));
  EXPECT_FALSE(fused_add_layer_norm_available(x, y, w, b, at::kFloat));
  EXPECT_FALSE(fused_bias_gelu_available(x, b));
  const AddLayerNorm r = add_layer_norm(x, y, w, b, 1e-5);
  EXPECT_TRUE(at::equal(r.sum, x + y));
  EXPECT_TRUE(at::equal(r.normed, at::layer_norm(x + y, {8}, w, b, 1e-5)));
  EXPECT_TRUE(at::equal(bias_gelu(x, b), at::gelu(x + b, "tanh")));
  EXPECT_FALSE(fused_swiglu_available(x, y));
  EXPECT_TRUE(at::equal(swiglu(x, y), at::silu(x) * y));
  const AddLayerNorm rr = add_rms_norm(x, y, w, 1e-6);
  at::Tensor h = (x + y) * at::rsqrt((x + y).pow(2).mean(-1, true) + 1e-6);
  EXPECT_TRUE(at::equal(rr.normed, w * h));
}

// Off by default until the GPU suite has run the kernels (CI sets no DTRAIN_FUSED_BLOCK_OPS);
// the override turns them on and back; the CPU never takes them, on or off.
TEST(FusedBlockOpsCpu, OffByDefaultAndTheOverrideSwitches) {
  if (std::getenv("DTRAIN_FUSED_BLOCK_OPS") == nullptr) {
    EXPECT_EQ(fused_block_ops_enabled(), kFusedBlockOpsByDefault);
  }
  EXPECT_FALSE(kFusedBlockOpsByDefault) << "turn the default on only after a GPU session passed FusedBlockOpsGpu.*";
  set_fused_block_ops(true);
  EXPECT_TRUE(fused_block_ops_enabled());
  EXPECT_FALSE(fused_block_kernels_serve(at::ones({2, 4})));  // the CPU: ATen's ops
  set_fused_block_ops(false);
  EXPECT_FALSE(fused_block_ops_enabled());
  set_fused_block_ops(std::nullopt);
}

// Empty inputs: empty outputs and gradients, no division by a zero row width.
TEST(FusedBlockOpsCpu, EmptyInputsGiveEmptyResults) {
  const at::Tensor y = at::randn({0, 0}).requires_grad_(true), b = at::randn({0}).requires_grad_(true);
  const at::Tensor out = fused_bias_gelu(y, b);
  EXPECT_EQ(out.numel(), 0);
  const at::Tensor x = at::randn({0, 8}).requires_grad_(true), w = at::randn({8}).requires_grad_(true);
  const AddLayerNorm r = fused_add_layer_norm(x, at::Tensor(), w, at::Tensor(), 1e-5);
  EXPECT_EQ(r.normed.sizes(), x.sizes());
  r.normed.sum().backward();
  EXPECT_EQ(x.grad().sizes(), x.sizes());
  EXPECT_TRUE(at::equal(w.grad(), at::zeros({8})));
  EXPECT_EQ(fused_swiglu(at::randn({0, 4}), at::randn({0, 4})).numel(), 0);
}

TEST(FusedBlockOpsCpu, MismatchedShapesAreRefusedByName) {
  const at::Tensor x = at::randn({2, 8});
  EXPECT_NE(error_of([&] { fused_add_layer_norm(x, at::Tensor(), at::randn({7}), at::Tensor(), 1e-5); })
                .find("weight must be [8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_add_layer_norm(x, at::randn({8, 2}), at::randn({8}), at::Tensor(), 1e-5); })
                .find("adds y of x's shape"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_bias_gelu(x, at::randn({3})); }).find("takes y [..., F] and bias [F]"),
            std::string::npos);
}

// DTRAIN_SDPA_BACKENDS' switch: the named backends on, the others off, restored afterwards; the
// math backend alone gives the same attention on the CPU; unknown names are refused by name.
TEST(SdpaBackends, NamedBackendsAreTheOnlyOnesEnabled) {
  auto& ctx = at::globalContext();
  const bool flash = ctx.userEnabledFlashSDP(), fa3 = ctx.userEnabledFA3SDP(),
             efficient = ctx.userEnabledMemEfficientSDP(), cudnn = ctx.userEnabledCuDNNSDP(),
             math = ctx.userEnabledMathSDP();
  const at::Tensor q = at::randn({2, 3, 16, 8}), k = at::randn({2, 3, 16, 8}), v = at::randn({2, 3, 16, 8});
  const at::Tensor before = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
  apply_sdpa_backends("math");
  EXPECT_TRUE(ctx.userEnabledMathSDP());
  EXPECT_FALSE(ctx.userEnabledFlashSDP() || ctx.userEnabledMemEfficientSDP() || ctx.userEnabledCuDNNSDP() ||
               ctx.userEnabledFA3SDP());
  EXPECT_LE((at::scaled_dot_product_attention(q, k, v, {}, 0.0, true) - before).abs().max().item<double>(), 1e-5);
  apply_sdpa_backends("flash,cudnn");
  EXPECT_TRUE(ctx.userEnabledFlashSDP() && ctx.userEnabledCuDNNSDP());
  EXPECT_FALSE(ctx.userEnabledMathSDP() || ctx.userEnabledMemEfficientSDP());
  EXPECT_NE(error_of([] { apply_sdpa_backends("flash,triton"); }).find("'triton' is unknown"), std::string::npos);
  EXPECT_NE(error_of([] { apply_sdpa_backends(","); }).find("no scaled_dot_product_attention backend"),
            std::string::npos);
  ctx.setSDPUseFlash(flash);
  ctx.setSDPUseFA3(fa3);
  ctx.setSDPUseMemEfficient(efficient);
  ctx.setSDPUseCuDNN(cudnn);
  ctx.setSDPUseMath(math);
}

}  // namespace
}  // namespace dtrain::engine::fused_block_cases
