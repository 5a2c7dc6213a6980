// dtrain-bench fused_ce: the loss of a language model's step on CUDA, forward + backward of the
// mean cross-entropy over logits [--ce_rows, --ce_vocab] (default 8192 x 32000, bfloat16: the
// GPT-124M step at batch 8 x 1024), by each implementation on the same tensors:
//   fused        dtrain's fused kernels (fused_vocab_parallel_cross_entropy, a group of one)
//   aten         vocab_parallel_cross_entropy's ATen composition forced on the CUDA tensors
//                (composed_vocab_parallel_cross_entropy): what ran before the kernels
//   torch_fp32   at::cross_entropy_loss(logits.float(), targets): PyTorch eager under autocast
// One line per implementation (rank 0 prints):
//   {"bench":"fused_ce","impl":I,"rows":N,"vocab":V,"dtype":"bf16","ms_median":..,
//    "fwd_ms_median":..,"peak_mib":..,"extra_peak_mib":..,"loss":..,"grad_max_abs_diff":..}
//   ms_median: forward + backward (the logits' gradient allocated and written), median of
//   --ce_iters after --ce_warmup, each timed between two device synchronizations;
//   fwd_ms_median: the forward alone; peak_mib: the CUDA caching allocator's peak of allocated
//   memory over one forward + backward (its peak reset just before), the logits and targets
//   included; extra_peak_mib: that peak less what was allocated before the step (what the loss
//   adds); grad_max_abs_diff: the largest difference of its gradient from fused's.
// Without a CUDA device: one {"bench":"fused_ce","skipped":...} line, exit status 0.
#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/parallel/cross_entropy.h"

DEFINE_int64(ce_rows, 8192, "fused_ce: logits rows (tokens of the batch)");
DEFINE_int64(ce_vocab, 32000, "fused_ce: logits columns (the vocabulary)");
DEFINE_string(ce_dtype, "bf16", "fused_ce: logits dtype: bf16, fp16 or fp32");
DEFINE_string(ce_impls, "fused,aten,torch_fp32", "fused_ce: implementations to run, comma-separated");
DEFINE_int32(ce_iters, 20, "fused_ce: timed repetitions");
DEFINE_int32(ce_warmup, 3, "fused_ce: untimed repetitions first");

namespace dtrain::bench {
namespace {

using json = nlohmann::json;
using CeFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

void ce_sync(c10::Device device) {
  c10::impl::VirtualGuardImpl(c10::kCUDA).synchronizeDevice(device.index());
}

double ce_time(c10::Device device, const std::function<void()>& step) {
  return cuda_median_ms(device, FLAGS_ce_warmup, FLAGS_ce_iters, step);
}

at::ScalarType ce_dtype_flag() {
  if (FLAGS_ce_dtype == "bf16") return at::kBFloat16;
  if (FLAGS_ce_dtype == "fp16") return at::kHalf;
  DTRAIN_CHECK(FLAGS_ce_dtype == "fp32", "--ce_dtype=", FLAGS_ce_dtype, ": use bf16, fp16 or fp32");
  return at::kFloat;
}

std::vector<std::string> ce_split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

CeFn ce_impl(const std::string& name, dist::Communicator& tp) {
  if (name == "fused") {
    return [&tp](const at::Tensor& x, const at::Tensor& t) {
      return engine::fused_vocab_parallel_cross_entropy(x, t, 0, x.size(1), tp);
    };
  }
  if (name == "aten") {
    return [&tp](const at::Tensor& x, const at::Tensor& t) {
      return engine::composed_vocab_parallel_cross_entropy(x, t, 0, x.size(1), tp);
    };
  }
  DTRAIN_CHECK(name == "torch_fp32", "--ce_impls: unknown '", name, "'; known: fused, aten, torch_fp32");
  return [](const at::Tensor& x, const at::Tensor& t) { return at::cross_entropy_loss(x.to(at::kFloat), t); };
}

// One implementation's line: its timings, its peak memory (nothing else of the benchmark alive
// but the logits and the targets) and its loss.
json ce_run(const std::string& name, const CeFn& fn, const at::Tensor& logits, const at::Tensor& targets) {
  const c10::Device device = logits.device();
  at::Tensor x = logits.detach().requires_grad_(true);
  at::Tensor loss;
  auto step = [&] {
    x.mutable_grad() = at::Tensor();
    loss = fn(x, targets);
    loss.backward();
  };
  const double ms = ce_time(device, step);
  const double fwd_ms = ce_time(device, [&] { loss = fn(x, targets).detach(); });
  x.mutable_grad() = at::Tensor();
  loss = at::Tensor();
  ce_sync(device);
  const double before = engine::memory_stats(device).allocated_mb;
  engine::reset_peak_memory(device);
  step();
  ce_sync(device);
  const double peak = engine::memory_stats(device).peak_mb;
  return {{"bench", "fused_ce"},
          {"impl", name},
          {"rows", logits.size(0)},
          {"vocab", logits.size(1)},
          {"dtype", FLAGS_ce_dtype},
          {"ms_median", ms},
          {"fwd_ms_median", fwd_ms},
          {"iters", FLAGS_ce_iters},
          {"peak_mib", peak},
          {"extra_peak_mib", peak - before},
          {"loss", loss.item<double>()}};
}

at::Tensor ce_grad(const CeFn& fn, const at::Tensor& logits, const at::Tensor& targets) {
  at::Tensor x = logits.detach().requires_grad_(true);
  fn(x, targets).backward();
  return x.grad();
}

}  // namespace

int run_fused_ce(BenchContext& ctx) {
  const bool print = ctx.comm->rank() == 0;
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "dtrain-bench fused_ce: no CUDA device here; the fused cross-entropy runs on CUDA only\n");
    if (print) std::printf("%s\n", json({{"bench", "fused_ce"}, {"skipped", "no CUDA device"}}).dump().c_str());
    return 0;
  }
  DTRAIN_CHECK(FLAGS_ce_rows >= 1 && FLAGS_ce_vocab >= 1, "--ce_rows and --ce_vocab must be >= 1");
  DTRAIN_CHECK(FLAGS_ce_iters >= 1 && FLAGS_ce_warmup >= 0, "--ce_iters must be >= 1, --ce_warmup >= 0");
  const c10::Device device = ctx.device.is_cuda() ? ctx.device : c10::Device(c10::kCUDA, 0);
  auto tp = dist::create_communicator("local", dist::World{}, device);
  at::manual_seed(1234);
  const auto on = at::TensorOptions().device(device);
  const at::Tensor logits = (at::randn({FLAGS_ce_rows, FLAGS_ce_vocab}, on) * 2).to(ce_dtype_flag());
  const at::Tensor targets = at::randint(FLAGS_ce_vocab, {FLAGS_ce_rows}, on.dtype(at::kLong));
  const std::vector<std::string> names = ce_split(FLAGS_ce_impls);
  std::vector<json> lines;
  for (const std::string& name : names) lines.push_back(ce_run(name, ce_impl(name, *tp), logits, targets));
  // The gradients against fused's, after the measurements (one other gradient alive at a time).
  if (std::find(names.begin(), names.end(), "fused") != names.end()) {
    const at::Tensor reference = ce_grad(ce_impl("fused", *tp), logits, targets).to(at::kFloat);
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "fused") continue;
      at::Tensor grad = ce_grad(ce_impl(names[i], *tp), logits, targets);
      lines[i]["grad_max_abs_diff"] = (grad.to(at::kFloat) - reference).abs().max().item<double>();
    }
  }
  for (const json& line : lines) {
    if (print) std::printf("%s\n", line.dump().c_str());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace dtrain::bench
