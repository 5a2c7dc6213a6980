// dtrain-bench fused_block: a GPT block's LayerNorms and MLP activation (and a Llama block's
// RMSNorm and SwiGLU) on CUDA, forward +
// backward, dtrain's fused kernels (fused_block_ops.h) against the ATen ops they replace, on the
// same tensors at the GPT-124M AMP bf16 step's shapes (default 8192 rows: batch 8 x 1024):
//   add_norm   x float32 [rows, --fb_dmodel] (the residual) + y bfloat16 (the branch), the
//              LayerNorm's output in bfloat16 for the Linear it feeds, a gradient reaching the
//              sum from its other use:
//                fused  fused_add_layer_norm(x, y, w, b, eps, bf16)
//                aten   s = x + y; layer_norm(s) in float32; .to(bf16) (eager under autocast)
//   add_rms_norm  the same layout through Llama's RMSNorm (no bias): fused_add_rms_norm against
//              s = x + y; w * (s * rsqrt(mean(s^2) + eps)); .to(bf16)
//   swiglu     gate and up bfloat16 [rows, --fb_ff]: fused_swiglu against silu(gate) * up
//   bias_gelu  y bfloat16 [rows, --fb_ff] (a Linear's product) and its float32 bias:
//                fused  fused_bias_gelu(y, b): the bias, the GELU, the bias gradient
//                aten   gelu(y + b) and the bias gradient's column sum as separate ops
//                eager  what eager adds beyond a Linear whose GEMM takes the bias: gelu(y), its
//                       backward and the bias gradient's column sum (no add)
// One line per (op, implementation) (rank 0 prints):
//   {"bench":"fused_block","op":O,"impl":I,"rows":N,"cols":C,"ms_median":..,"fwd_ms_median":..,
//    "gb_per_s":..,"max_abs_diff_vs_fused":..}
//   ms_median: forward + backward, median of --fb_iters after --fb_warmup, each between two
//   device synchronizations; gb_per_s: the fused implementation's minimal traffic (each input
//   read once, each output written once, forward and backward) over ms_median, for every
//   implementation alike (so the ratio of two lines is the ratio of their times).
// Without a CUDA device: one {"bench":"fused_block","skipped":...} line, exit status 0.
#include <ATen/ATen.h>
#include <gflags/gflags.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/fused_block_ops.h"

DEFINE_int64(fb_rows, 8192, "fused_block: rows (tokens of the batch)");
DEFINE_int64(fb_dmodel, 768, "fused_block: the LayerNorm's width (d_model)");
DEFINE_int64(fb_ff, 3072, "fused_block: the MLP's hidden width");
DEFINE_int32(fb_iters, 50, "fused_block: timed repetitions");
DEFINE_int32(fb_warmup, 5, "fused_block: untimed repetitions first");

namespace dtrain::bench {
namespace {

using json = nlohmann::json;

double fb_time(c10::Device device, const std::function<void()>& step) {
  return cuda_median_ms(device, FLAGS_fb_warmup, FLAGS_fb_iters, step);
}

// One implementation: forward returns the outputs, whose gradients are `grads`; the inputs'
// gradients (the first of them compared across implementations) come from autograd::grad.
struct Impl {
  std::string name;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  // Extra work after autograd (eager's separate bias-gradient sum), given the inputs' gradients.
  std::function<void(std::vector<at::Tensor>&)> after;
};

json fb_run(const std::string& op, const Impl& impl, const std::vector<at::Tensor>& inputs,
            const std::vector<at::Tensor>& grads, double bytes, at::Tensor* first_grad) {
  const c10::Device device = inputs[0].device();
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& t : inputs) leaves.push_back(t.detach().requires_grad_(true));
  auto step = [&] {
    std::vector<at::Tensor> outs = impl.forward(leaves);
    std::vector<at::Tensor> g(grads.begin(), grads.begin() + static_cast<std::ptrdiff_t>(outs.size()));
    std::vector<at::Tensor> in_grads = torch::autograd::grad(outs, leaves, g, false, false, true);
    if (impl.after) impl.after(in_grads);
    if (first_grad) *first_grad = in_grads[0];
  };
  const double ms = fb_time(device, step);
  const double fwd_ms = fb_time(device, [&] {
    torch::NoGradGuard ng;
    impl.forward(leaves);
  });
  return {{"bench", "fused_block"},
          {"op", op},
          {"impl", impl.name},
          {"rows", inputs[0].size(0)},
          {"cols", inputs[0].size(1)},
          {"ms_median", ms},
          {"fwd_ms_median", fwd_ms},
          {"iters", FLAGS_fb_iters},
          {"gb_per_s", bytes / (ms * 1e-3) / 1e9}};
}

// Every implementation of one op, one line each, the first input's gradient against the first
// implementation's (fused).
void fb_op(const std::string& op, const std::vector<Impl>& impls, const std::vector<at::Tensor>& inputs,
           const std::vector<at::Tensor>& grads, double bytes, bool print) {
  std::vector<json> lines;
  std::vector<at::Tensor> first;
  for (const Impl& impl : impls) {
    at::Tensor g;
    lines.push_back(fb_run(op, impl, inputs, grads, bytes, &g));
    first.push_back(g);
  }
  for (size_t i = 0; i < lines.size(); ++i) {
    lines[i]["max_abs_diff_vs_fused"] = (first[i].to(at::kFloat) - first[0].to(at::kFloat)).abs().max().item<double>();
    if (print) std::printf("%s\n", lines[i].dump().c_str());
  }
}

}  // namespace

int run_fused_block(BenchContext& ctx) {
  const bool print = ctx.comm->rank() == 0;
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "dtrain-bench fused_block: no CUDA device here; the fused block kernels run on CUDA only\n");
    if (print) std::printf("%s\n", json({{"bench", "fused_block"}, {"skipped", "no CUDA device"}}).dump().c_str());
    return 0;
  }
  DTRAIN_CHECK(FLAGS_fb_rows >= 1 && FLAGS_fb_dmodel >= 1 && FLAGS_fb_ff >= 1,
               "--fb_rows, --fb_dmodel and --fb_ff must be >= 1");
  DTRAIN_CHECK(FLAGS_fb_iters >= 1 && FLAGS_fb_warmup >= 0, "--fb_iters must be >= 1, --fb_warmup >= 0");
  const c10::Device device = ctx.device.is_cuda() ? ctx.device : c10::Device(c10::kCUDA, 0);
  at::manual_seed(1234);
  const auto on = at::TensorOptions().device(device);
  const int64_t n = FLAGS_fb_rows, d = FLAGS_fb_dmodel, ff = FLAGS_fb_ff;

  {  // LayerNorm of the residual sum
    const std::vector<at::Tensor> in = {at::randn({n, d}, on), at::randn({n, d}, on).to(at::kBFloat16),
                                        at::randn({d}, on) * 0.2 + 1, at::randn({d}, on) * 0.1};
    const std::vector<at::Tensor> grads = {at::randn({n, d}, on).to(at::kBFloat16), at::randn({n, d}, on)};
    // fused: read x (4), y (2); write sum (4), normed (2); backward: read dn (2), gs (4), sum (4)
    // twice (rows, columns), dn again; write grad x (4), grad y (2).
    const double bytes = static_cast<double>(n * d) * (4 + 2 + 4 + 2 + 2 + 4 + 8 + 2 + 4 + 2);
    const std::vector<Impl> impls = {
        {"fused",
         [](const std::vector<at::Tensor>& t) {
           auto r = engine::fused_add_layer_norm(t[0], t[1], t[2], t[3], 1e-5, at::kBFloat16);
           return std::vector<at::Tensor>{r.normed, r.sum};
         },
         {}},
        {"aten",
         [d](const std::vector<at::Tensor>& t) {
           at::Tensor s = t[0] + t[1];
           return std::vector<at::Tensor>{at::layer_norm(s, {d}, t[2], t[3], 1e-5).to(at::kBFloat16), s};
         },
         {}},
    };
    fb_op("add_norm", impls, in, grads, bytes, print);
  }
  {  // Llama's RMSNorm of the residual sum (the same layout as add_norm, no bias)
    const std::vector<at::Tensor> in = {at::randn({n, d}, on), at::randn({n, d}, on).to(at::kBFloat16),
                                        at::randn({d}, on) * 0.2 + 1};
    const std::vector<at::Tensor> grads = {at::randn({n, d}, on).to(at::kBFloat16), at::randn({n, d}, on)};
    const double bytes = static_cast<double>(n * d) * (4 + 2 + 4 + 2 + 2 + 4 + 8 + 2 + 4 + 2);
    const std::vector<Impl> impls = {
        {"fused",
         [](const std::vector<at::Tensor>& t) {
           auto r = engine::fused_add_rms_norm(t[0], t[1], t[2], 1e-5, at::kBFloat16);
           return std::vector<at::Tensor>{r.normed, r.sum};
         },
         {}},
        {"aten",
         [](const std::vector<at::Tensor>& t) {
           at::Tensor s = t[0] + t[1];
           at::Tensor h = s * at::rsqrt(s.pow(2).mean(-1, true) + 1e-5);
           return std::vector<at::Tensor>{(t[2] * h).to(at::kBFloat16), s};
         },
         {}},
    };
    fb_op("add_rms_norm", impls, in, grads, bytes, print);
  }
  {  // SwiGLU: silu(gate) * up, bfloat16 (the Linears' outputs under autocast)
    const std::vector<at::Tensor> in = {(at::randn({n, ff}, on) * 2).to(at::kBFloat16),
                                        at::randn({n, ff}, on).to(at::kBFloat16)};
    const std::vector<at::Tensor> grads = {at::randn({n, ff}, on).to(at::kBFloat16)};
    // fused: read gate, up; write out; backward: read grad, gate, up; write both gradients.
    const double bytes = static_cast<double>(n * ff) * 2 * 8;
    const std::vector<Impl> impls = {
        {"fused",
         [](const std::vector<at::Tensor>& t) { return std::vector<at::Tensor>{engine::fused_swiglu(t[0], t[1])}; },
         {}},
        {"aten",
         [](const std::vector<at::Tensor>& t) { return std::vector<at::Tensor>{at::silu(t[0]) * t[1]}; },
         {}},
    };
    fb_op("swiglu", impls, in, grads, bytes, print);
  }
  {  // bias + GELU
    const std::vector<at::Tensor> in = {(at::randn({n, ff}, on) * 2).to(at::kBFloat16), at::randn({ff}, on)};
    const std::vector<at::Tensor> grads = {at::randn({n, ff}, on).to(at::kBFloat16)};
    // fused: read y, write out; backward: read grad, y; write grad y (2 bytes each).
    const double bytes = static_cast<double>(n * ff) * 2 * 5;
    const std::vector<Impl> impls = {
        {"fused",
         [](const std::vector<at::Tensor>& t) {
           return std::vector<at::Tensor>{engine::fused_bias_gelu(t[0], t[1])};
         },
         {}},
        {"aten",
         [](const std::vector<at::Tensor>& t) {
           return std::vector<at::Tensor>{at::gelu(t[0] + t[1].to(at::kBFloat16), "tanh")};
         },
         {}},
        {"eager",
         [](const std::vector<at::Tensor>& t) {
           // The bias enters through the GEMM's epilogue in eager: here only the GELU (the bias
           // unused, its gradient left undefined by autograd) and the column sum below.
           return std::vector<at::Tensor>{at::gelu(t[0], "tanh")};
         },
         [](std::vector<at::Tensor>& g) { g[1] = g[0].sum(0, false, at::kFloat); }},
    };
    fb_op("bias_gelu", impls, in, grads, bytes, print);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace dtrain::bench
