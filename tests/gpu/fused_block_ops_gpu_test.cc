// The fused block kernels (parallel/cuda/fused_block.cu through fused_block_ops.h) on CUDA
// against ATen's composition computed in float64 on the CPU from the same rounded inputs:
// every dtype combination the kernels serve, row lengths from 1 to 4099 (not multiples of the
// warp), one row to 8192 rows (70000 for bias + GELU, past the forward grid's 65535 rows), with and without the residual, the bias and a gradient reaching
// the sum from elsewhere; the dispatch (an unserved combination falls back to ATen, still
// right); and a GPT block on CUDA (fused) against the same block on the CPU (ATen), in float32
// and under bfloat16 autocast.
//
// Against the CPU models: float32 within float32's differences of two implementations; under
// bfloat16 autocast within bfloat16's (5% of the output, 10% of the largest gradient, 0.05 of
// the loss): a kernel that dropped a term (the residual gradient, the mean) misses by far more.
//
// Tolerances, as the largest difference over the largest reference magnitude: the kernels
// compute in float (double for float64) and round once to each output's dtype, so u + 2e-5 for
// the unit roundoff u of that dtype (bfloat16 2^-8, float16 2^-11, float32 0), and 1e-11 for
// float64. Column sums over 8192 rows are ordered differently from the CPU's: the same bound
// holds with 2e-5.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/models/seq2seq.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/parallel/fused_block_ops.h"
#include "model_cases.h"
#include "test_util.h"

namespace dtrain::engine::fused_block_gpu_cases {
namespace {

const c10::Device kCuda(c10::kCUDA, 0);

// floor: the smallest reference magnitude divided by. Rows of one column take 1 (an absolute
// bound): their LayerNorm x and weight gradients are 0 (ATen's float64 backward leaves ~1e-14)
// and the RMSNorm x gradient r g eps / (s^2 + eps) ~1e-7 is a cancellation in float, so a
// relative bound there measures the reference's residue, not the kernel (a kernel that drops a
// term still misses by ~0.5).
double max_rel(const at::Tensor& got, const at::Tensor& ref, double floor = 1e-6) {
  const at::Tensor a = got.to(at::kCPU).to(at::kDouble), b = ref.to(at::kCPU).to(at::kDouble);
  return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item<double>();
}

double tol(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return 1e-11;
    case at::kFloat: return 2e-5;
    case at::kBFloat16: return 1.0 / 256 + 2e-5;
    case at::kHalf: return 1.0 / 2048 + 2e-5;
    default: return 0;
  }
}

std::string name(at::ScalarType t) { return c10::toString(t); }

// The models take the kernels only with the fused block ops enabled (off by default until this
// suite has run): on for the scope.
struct FusedOpsOn {
  FusedOpsOn() { set_fused_block_ops(true); }
  ~FusedOpsOn() { set_fused_block_ops(std::nullopt); }
};

struct NormCombo {
  at::ScalarType x, y, w, o;
};

TEST(FusedBlockOpsGpu, AddLayerNormMatchesFloat64Composition) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const auto D = at::kDouble, F = at::kFloat, B = at::kBFloat16, H = at::kHalf;
  const std::vector<NormCombo> combos = {{D, D, D, D}, {F, F, F, F}, {B, B, B, B}, {H, H, H, H}, {F, B, F, B},
                                         {F, H, F, H}, {F, F, F, B}, {F, B, F, F}};
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {7, 33}, {5, 4099}, {8192, 768}};
  int64_t seed = 1;
  for (const NormCombo& c : combos) {
    for (const auto& [rows, cols] : shapes) {
      for (int variant = 0; variant < 3; ++variant) {  // 0: residual, bias, sum used; 1: plain; 2: no bias
        const bool with_y = variant != 1, with_bias = variant != 2, sum_used = variant == 0;
        SCOPED_TRACE(name(c.x) + "/" + name(c.y) + "/" + name(c.w) + "->" + name(c.o) + " [" + std::to_string(rows) +
                     ", " + std::to_string(cols) + "] variant " + std::to_string(variant));
        const double fl = cols == 1 ? 1.0 : 1e-6;
        auto g = at::make_generator<at::CPUGeneratorImpl>(seed++);
        const at::Tensor x = (at::randn({rows, cols}, g, at::kDouble) * 2 + 0.3).to(c.x);
        const at::Tensor y = with_y ? at::randn({rows, cols}, g, at::kDouble).to(c.y) : at::Tensor();
        const at::Tensor w = (at::randn({cols}, g, at::kDouble) * 0.3 + 1).to(c.w);
        const at::Tensor b = with_bias ? (at::randn({cols}, g, at::kDouble) * 0.1).to(c.w) : at::Tensor();
        const at::ScalarType s_type = with_y ? at::promote_types(c.x, c.y) : c.x;
        ASSERT_TRUE(fused_add_layer_norm_available(x.to(kCuda), with_y ? y.to(kCuda) : y, w.to(kCuda),
                                                   with_bias ? b.to(kCuda) : b, c.o));
        const at::Tensor dn = at::randn({rows, cols}, g, at::kDouble).to(c.o);
        const at::Tensor gs = at::randn({rows, cols}, g, at::kDouble).to(s_type);

        auto leaf = [](const at::Tensor& t, c10::Device d, std::optional<at::ScalarType> dt) {
          if (!t.defined()) return t;
          return (dt ? t.to(d, *dt) : t.to(d)).detach().requires_grad_(true);
        };
        // The kernels on CUDA.
        const at::Tensor cx = leaf(x, kCuda, {}), cy = leaf(y, kCuda, {}), cw = leaf(w, kCuda, {}),
                         cb = leaf(b, kCuda, {});
        const AddLayerNorm got = fused_add_layer_norm(cx, cy, cw, cb, 1e-5, c.o);
        // The reference: float64 from the same rounded values; the sum rounded to its dtype.
        const at::Tensor rx = leaf(x, at::kCPU, at::kDouble), ry = leaf(y, at::kCPU, at::kDouble),
                         rw = leaf(w, at::kCPU, at::kDouble), rb = leaf(b, at::kCPU, at::kDouble);
        at::Tensor rs = with_y ? rx + ry : rx;
        if (with_y && s_type != at::kDouble) rs = rs + ((rs.detach().to(s_type).to(at::kDouble)) - rs.detach());
        const at::Tensor rn = at::layer_norm(rs, {cols}, rw, rb, 1e-5);
        EXPECT_LE(max_rel(got.normed, rn, fl), tol(c.o)) << "normed";
        if (with_y) EXPECT_LE(max_rel(got.sum, rs, fl), tol(s_type)) << "sum";

        std::vector<at::Tensor> gi = {cx, cw}, ri = {rx, rw};
        if (with_y) gi.push_back(cy), ri.push_back(ry);
        if (with_bias) gi.push_back(cb), ri.push_back(rb);
        std::vector<at::Tensor> go = {got.normed}, ro = {rn}, gg = {dn.to(kCuda)}, rg = {dn.to(at::kDouble)};
        if (sum_used) {
          go.push_back(got.sum), ro.push_back(rs);
          gg.push_back(gs.to(kCuda)), rg.push_back(gs.to(at::kDouble));
        }
        const auto gk = torch::autograd::grad(go, gi, gg);
        const auto gr = torch::autograd::grad(ro, ri, rg);
        EXPECT_EQ(gk[0].scalar_type(), c.x);
        EXPECT_LE(max_rel(gk[0], gr[0], fl), tol(s_type)) << "grad x";
        EXPECT_LE(max_rel(gk[1], gr[1], fl), tol(c.w)) << "grad weight";
        size_t k = 2;
        if (with_y) {
          EXPECT_EQ(gk[k].scalar_type(), c.y);
          EXPECT_LE(max_rel(gk[k], gr[k], fl), tol(c.y)) << "grad y";
          ++k;
        }
        if (with_bias) EXPECT_LE(max_rel(gk[k], gr[k], fl), tol(c.w)) << "grad bias";
      }
    }
  }
}

// RMSNorm (Llama's): the reference rounds the normalized value to the sum's dtype before the
// weight, as the kernel and transformers' LlamaRMSNorm do.
TEST(FusedBlockOpsGpu, AddRmsNormMatchesFloat64Composition) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const auto D = at::kDouble, F = at::kFloat, B = at::kBFloat16, H = at::kHalf;
  const std::vector<NormCombo> combos = {{D, D, D, D}, {F, F, F, F}, {B, B, B, B}, {H, H, H, H}, {F, B, F, B}};
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {7, 33}, {8192, 1024}};
  int64_t seed = 500;
  for (const NormCombo& c : combos) {
    for (const auto& [rows, cols] : shapes) {
      for (const bool with_y : {true, false}) {
        SCOPED_TRACE(name(c.x) + "/" + name(c.y) + "/" + name(c.w) + "->" + name(c.o) + " [" + std::to_string(rows) +
                     ", " + std::to_string(cols) + "] " + (with_y ? "residual" : "plain"));
        const double fl = cols == 1 ? 1.0 : 1e-6;
        auto g = at::make_generator<at::CPUGeneratorImpl>(seed++);
        const at::Tensor x = (at::randn({rows, cols}, g, at::kDouble) * 2 + 0.3).to(c.x);
        const at::Tensor y = with_y ? at::randn({rows, cols}, g, at::kDouble).to(c.y) : at::Tensor();
        const at::Tensor w = (at::randn({cols}, g, at::kDouble) * 0.3 + 1).to(c.w);
        const at::ScalarType s_type = with_y ? at::promote_types(c.x, c.y) : c.x;
        const at::Tensor dn = at::randn({rows, cols}, g, at::kDouble).to(c.o);
        const at::Tensor cx = x.to(kCuda).requires_grad_(true), cw = w.to(kCuda).requires_grad_(true);
        const at::Tensor cy = with_y ? y.to(kCuda).requires_grad_(true) : at::Tensor();
        ASSERT_TRUE(fused_add_layer_norm_available(cx, cy, cw, at::Tensor(), c.o));
        const AddLayerNorm got = fused_add_rms_norm(cx, cy, cw, 1e-6, c.o);
        const at::Tensor rx = x.to(at::kDouble).requires_grad_(true), rw = w.to(at::kDouble).requires_grad_(true);
        const at::Tensor ry = with_y ? y.to(at::kDouble).requires_grad_(true) : at::Tensor();
        at::Tensor rs = with_y ? rx + ry : rx;
        if (with_y && s_type != at::kDouble) rs = rs + (rs.detach().to(s_type).to(at::kDouble) - rs.detach());
        at::Tensor xhat = rs * at::rsqrt(rs.pow(2).mean(-1, true) + 1e-6);
        xhat = xhat + (xhat.detach().to(s_type).to(at::kDouble) - xhat.detach());
        const at::Tensor rn = rw * xhat;
        EXPECT_LE(max_rel(got.normed, rn, fl), tol(c.o) + tol(s_type)) << "normed";
        std::vector<at::Tensor> gi = {cx, cw}, ri = {rx, rw};
        if (with_y) gi.push_back(cy), ri.push_back(ry);
        const auto gk = torch::autograd::grad({got.normed}, gi, {dn.to(kCuda)});
        const auto gr = torch::autograd::grad({rn}, ri, {dn.to(at::kDouble)});
        EXPECT_LE(max_rel(gk[0], gr[0], fl), tol(s_type) + tol(c.o)) << "grad x";
        EXPECT_LE(max_rel(gk[1], gr[1], fl), tol(c.w) + tol(s_type)) << "grad weight";
        if (with_y) EXPECT_LE(max_rel(gk[2], gr[2], fl), tol(c.y) + tol(c.o)) << "grad y";
      }
    }
  }
}

TEST(FusedBlockOpsGpu, SwigluMatchesFloat64Composition) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  int64_t seed = 700;
  for (const at::ScalarType t : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t n : {int64_t{1}, int64_t{1001}, int64_t{2048} * 2816}) {
      SCOPED_TRACE(name(t) + " n " + std::to_string(n));
      auto g = at::make_generator<at::CPUGeneratorImpl>(seed++);
      const at::Tensor gate = (at::randn({n}, g, at::kDouble) * 4).to(t), up = at::randn({n}, g, at::kDouble).to(t);
      const at::Tensor d = at::randn({n}, g, at::kDouble).to(t);
      const at::Tensor cg = gate.to(kCuda).requires_grad_(true), cu = up.to(kCuda).requires_grad_(true);
      ASSERT_TRUE(fused_swiglu_available(cg, cu));
      const at::Tensor out = fused_swiglu(cg, cu);
      const at::Tensor rg = gate.to(at::kDouble).requires_grad_(true), ru = up.to(at::kDouble).requires_grad_(true);
      const at::Tensor ref = at::silu(rg) * ru;
      EXPECT_LE(max_rel(out, ref), tol(t)) << "forward";
      const auto gk = torch::autograd::grad({out}, {cg, cu}, {d.to(kCuda)});
      const auto gr = torch::autograd::grad({ref}, {rg, ru}, {d.to(at::kDouble)});
      EXPECT_LE(max_rel(gk[0], gr[0]), tol(t)) << "grad gate";
      EXPECT_LE(max_rel(gk[1], gr[1]), tol(t)) << "grad up";
    }
  }
}

TEST(FusedBlockOpsGpu, BiasGeluMatchesFloat64Composition) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const auto D = at::kDouble, F = at::kFloat, B = at::kBFloat16, H = at::kHalf;
  const std::vector<std::pair<at::ScalarType, at::ScalarType>> combos = {{D, D}, {F, F}, {B, B},
                                                                         {H, H}, {B, F}, {H, F}};
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{3, 1}, {5, 1001}, {2048, 3072}, {70000, 3}};
  int64_t seed = 100;
  for (const auto& [yt, bt] : combos) {
    for (const auto& [rows, cols] : shapes) {
      SCOPED_TRACE(name(yt) + "+" + name(bt) + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
      auto g = at::make_generator<at::CPUGeneratorImpl>(seed++);
      const at::Tensor y = (at::randn({rows, cols}, g, at::kDouble) * 3).to(yt);
      const at::Tensor b = at::randn({cols}, g, at::kDouble).to(bt);
      const at::Tensor dout = at::randn({rows, cols}, g, at::kDouble).to(yt);
      ASSERT_TRUE(fused_bias_gelu_available(y.to(kCuda), b.to(kCuda)));
      const at::Tensor cy = y.to(kCuda).requires_grad_(true), cb = b.to(kCuda).requires_grad_(true);
      const at::Tensor out = fused_bias_gelu(cy, cb);
      ASSERT_EQ(out.scalar_type(), yt);
      const at::Tensor ry = y.to(at::kDouble).requires_grad_(true), rb = b.to(at::kDouble).requires_grad_(true);
      const at::Tensor ref = at::gelu(ry + rb, "tanh");
      EXPECT_LE(max_rel(out, ref), tol(yt)) << "forward";
      const auto gk = torch::autograd::grad({out}, {cy, cb}, {dout.to(kCuda)});
      const auto gr = torch::autograd::grad({ref}, {ry, rb}, {dout.to(at::kDouble)});
      EXPECT_LE(max_rel(gk[0], gr[0]), tol(yt)) << "grad y";
      // The bias gradient sums the rounded input gradient: against the float64 sum of the
      // kernel's own grad y it is a float reduction; against the float64 reference it also
      // carries the input gradient's rounding.
      EXPECT_LE(max_rel(gk[1], gk[0].to(at::kCPU).to(at::kDouble).sum(0)), tol(bt)) << "grad bias (own)";
      EXPECT_LE(max_rel(gk[1], gr[1]), tol(yt) + tol(bt)) << "grad bias";
    }
  }
}

TEST(FusedBlockOpsGpu, UnservedCombinationsFallBackToAten) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const FusedOpsOn on;
  ASSERT_TRUE(fused_block_kernels_serve(at::zeros({1}, kCuda)));
  {  // While TorchScript traces (dtrain-export) the models keep ATen's ops, which a trace records.
    const c10::impl::IncludeDispatchKeyGuard tracing(c10::DispatchKey::Tracer);
    EXPECT_FALSE(fused_block_kernels_serve(at::zeros({1}, kCuda)));
  }
  // A float32 y under a float64 x has no kernel (float64 is served only throughout):
  // add_layer_norm takes ATen's ops. (A float32 sum under bfloat16 weights would be unserved
  // too, but ATen's layer_norm refuses that mix itself.)
  const auto d64 = at::TensorOptions(kCuda).dtype(at::kDouble);
  const at::Tensor x = at::randn({4, 64}, d64), y = at::randn({4, 64}, kCuda);
  const at::Tensor w = at::randn({64}, d64), b = at::randn({64}, d64);
  EXPECT_FALSE(fused_add_layer_norm_available(x, y, w, b, at::kDouble));
  const AddLayerNorm r = add_layer_norm(x, y, w, b, 1e-5);
  EXPECT_TRUE(at::equal(r.normed, at::layer_norm(x + y, {64}, w, b, 1e-5)));
  // No rows: empty results, zero weight gradients.
  {
    const at::Tensor e = at::randn({0, 64}, kCuda).requires_grad_(true);
    const at::Tensor we = at::randn({64}, kCuda).requires_grad_(true), be = at::randn({64}, kCuda).requires_grad_(true);
    fused_add_layer_norm(e, at::Tensor(), we, be, 1e-5).normed.sum().backward();
    EXPECT_TRUE(at::equal(we.grad().cpu(), at::zeros({64})));
    EXPECT_TRUE(at::equal(be.grad().cpu(), at::zeros({64})));
  }
  // A float16 y with a bfloat16 bias: the same.
  const at::Tensor bb = at::randn({64}, kCuda).to(at::kBFloat16);
  const at::Tensor yh = at::randn({4, 64}, kCuda).to(at::kHalf);
  EXPECT_FALSE(fused_bias_gelu_available(yh, bb));
  EXPECT_TRUE(at::equal(bias_gelu(yh, bb), at::gelu(yh + bb, "tanh")));
}

// `cuda` made a copy of `cpu`'s parameters and moved to the GPU.
template <class M>
void copy_to_cuda(M& cpu, M& cuda) {
  {
    torch::NoGradGuard ng;
    auto src = cpu->named_parameters();
    for (auto& p : cuda->named_parameters()) p.value().copy_(src[p.key()]);
  }
  cuda->to(kCuda);
}

// Every parameter's gradient of `cuda` within `t` of `cpu`'s.
template <class M>
void expect_grads_near(M& cuda, M& cpu, double t) {
  auto want = cpu->named_parameters();
  for (const auto& p : cuda->named_parameters()) EXPECT_LE(max_rel(p.value().grad(), want[p.key()].grad()), t) << p.key();
}

// `loss(model, device)` on the CPU model in float32 and on its CUDA copy (under bfloat16
// autocast when amp), each followed by backward: the losses and every parameter's gradient
// within the tolerances of the header.
template <class M, class LossOf>
void expect_cuda_loss_matches_cpu(M& cpu, M& cuda, bool amp, LossOf loss) {
  const at::Tensor ref = loss(cpu, c10::Device(c10::kCPU));
  ref.backward();
  at::Tensor got;
  {
    std::optional<AutocastGuard> ac;
    if (amp) ac.emplace(c10::kCUDA, AmpMode::kBf16);
    got = loss(cuda, kCuda);
    got.backward();
  }
  EXPECT_NEAR(got.item<double>(), ref.item<double>(), amp ? 5e-2 : 5e-5);
  expect_grads_near(cuda, cpu, amp ? 1e-1 : 2e-4);
}

// A GPT block on CUDA (the fused LayerNorms and bias + GELU) against the same block on the CPU
// (ATen's ops): output and every parameter's gradient, float32 and under bfloat16 autocast.
TEST(FusedBlockOpsGpu, GptBlockOnCudaMatchesTheCpuBlock) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const FusedOpsOn on;
  auto tp = testing_util::local_comm();
  GptOptions o;
  o.vocab = 64;
  o.d_model = 96;
  o.heads = 4;
  o.layers = 1;
  o.ff = 384;
  o.seq_len = 32;
  o.dropout = 0;
  for (const bool amp : {false, true}) {
    SCOPED_TRACE(amp ? "autocast bf16" : "float32");
    torch::manual_seed(5);
    GptBlock cpu(o, *tp);
    GptBlock cuda(o, *tp);
    copy_to_cuda(cpu, cuda);
    const at::Tensor x0 = torch::randn({2, 32, 96}, at::kDouble).to(at::kFloat);
    const at::Tensor w = torch::randn({2, 32, 96}, at::kDouble).to(at::kFloat);
    at::Tensor xc = x0.clone().requires_grad_(true), xg = x0.to(kCuda).requires_grad_(true);
    (cpu->forward(xc) * w).sum().backward();
    at::Tensor out;
    {
      std::optional<AutocastGuard> ac;
      if (amp) ac.emplace(c10::kCUDA, AmpMode::kBf16);
      out = cuda->forward(xg);
      (out.to(at::kFloat) * w.to(kCuda)).sum().backward();
    }
    const double t = amp ? 5e-2 : 2e-5;
    EXPECT_LE(max_rel(out, cpu->forward(x0)), t) << "output";
    EXPECT_LE(max_rel(xg.grad(), xc.grad()), t) << "input gradient";
    expect_grads_near(cuda, cpu, amp ? 1e-1 : 1e-4);
  }
}

// A one-block Llama on CUDA (fused RMSNorms and SwiGLU) against the same model on the CPU
// (Llama's ops): the loss and every parameter's gradient, float32 and under bfloat16 autocast.
TEST(FusedBlockOpsGpu, LlamaOnCudaMatchesTheCpuModel) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const FusedOpsOn on;
  auto tp = testing_util::local_comm();
  LlamaOptions o;
  o.vocab = 96;
  o.d_model = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.ff = 160;
  o.seq_len = 16;
  o.layers = 1;
  for (const bool amp : {false, true}) {
    SCOPED_TRACE(amp ? "autocast bf16" : "float32");
    torch::manual_seed(9);
    Llama cpu(o, *tp);
    Llama cuda(o, *tp);
    copy_to_cuda(cpu, cuda);
    const at::Tensor tokens = torch::randint(o.vocab, {2, 16}, at::kLong), targets = torch::randint(o.vocab, {2, 16}, at::kLong);
    expect_cuda_loss_matches_cpu(cpu, cuda, amp, [&](Llama& m, c10::Device d) {
      return m->loss(tokens.to(d), targets.to(d));
    });
  }
}

// The seq2seq model (post-norm: each LayerNorm of a residual sum is the next residual stream) on
// CUDA with the fused kernels against the same model on the CPU: loss and gradients.
TEST(FusedBlockOpsGpu, Seq2SeqOnCudaMatchesTheCpuModel) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const FusedOpsOn on;
  const Seq2SeqOptions o = model_cases::one_layer_seq2seq(101, 32, 16);
  for (const bool amp : {false, true}) {
    SCOPED_TRACE(amp ? "autocast bf16" : "float32");
    torch::manual_seed(4);
    Seq2Seq cpu(o);
    Seq2Seq cuda(o);
    copy_to_cuda(cpu, cuda);
    const at::Tensor src = torch::randint(o.vocab, {3, 7}, at::kLong), tgt = torch::randint(o.vocab, {3, 6}, at::kLong);
    const at::Tensor tin = tgt.narrow(1, 0, 5), tout = tgt.narrow(1, 1, 5);
    expect_cuda_loss_matches_cpu(cpu, cuda, amp, [&](Seq2Seq& m, c10::Device d) {
      return m->loss(src.to(d), tin.to(d), tout.to(d));
    });
  }
}

}  // namespace
}  // namespace dtrain::engine::fused_block_gpu_cases
