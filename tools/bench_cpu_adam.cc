// dtrain-bench cpu_adam: one AdamW step on the CPU over the same N parameters (fp32), by
// dtrain's CpuOptimizer and by PyTorch's fused and foreach AdamW, at each thread count, plus
// the machine's measured memory bandwidth to say how close to the limit each one runs.
//
// Lines (rank 0 prints; every rank runs the same work):
//   {"bench":"cpu_adam","impl":"memory_bandwidth","threads":T,"copy_gbs":..,"triad_gbs":..,
//    "update_gbs":..,"adam_pattern_gbs":..}  copy a=b (8 B/elem), triad a=b+s*c (12),
//    update a+=s*b (12), adam_pattern: p,m,v += s*g (28 B/elem, the streams of an Adam step
//    with trivial arithmetic: the limit for any implementation): bytes the program reads and
//    writes per second (10^9), median of 7 repetitions.
//   {"bench":"cpu_adam","impl":I,"params":N,"threads":T,"ms":median,"state_gbs":..}
//    state_gbs = 28 N / time: params, grads, exp_avg, exp_avg_sq read and params, exp_avg,
//    exp_avg_sq written, fp32 (the minimum traffic of one step; 10^9 bytes per second);
//    "fraction_of_limit" = state_gbs / adam_pattern_gbs.
//   I = "dtrain" (CpuOptimizer, own thread team, copy-back off: the master is the parameter),
//       "torch_fused" (at::_fused_adamw_ on the CPU tensors),
//       "torch_foreach" (the _foreach_ sequence of torch.optim.AdamW(foreach=True)),
//       and two variants for context: "dtrain_bf16_copy" (CpuOptimizer writing a bf16 model
//       copy in the same pass: 2 more bytes per parameter, "total_gbs" counts them) and
//       "dtrain_aten_threads" (the same kernel over flat arrays through at::parallel_for
//       instead of dtrain's team; note that this runs on ONE thread in dtrain's builds:
//       ATen's OpenMP region is inline in its headers and dtrain compiles without -fopenmp).
//   Every impl runs warmup + iters steps from the same start with the same gradients; after
//   timing the dtrain and foreach weights are compared with torch_fused's ("rel_err").
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/offload/cpu_kernels.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"
#include "dtrain/offload/thread_pool.h"

DEFINE_int64(params, 100000000, "cpu_adam: number of fp32 parameters");
DEFINE_string(threads, "", "cpu_adam: comma-separated thread counts (default: 1 and all cores)");
DEFINE_int64(tensor_elems, int64_t{1} << 22, "cpu_adam: the parameters are tensors of this size");
DEFINE_string(impls, "dtrain,torch_fused,torch_foreach,dtrain_bf16_copy,dtrain_aten_threads",
              "cpu_adam: implementations to run, comma-separated");
DEFINE_string(isa, "auto", "cpu_adam: dtrain kernel: auto, scalar, avx2, avx512");
DECLARE_int32(iters);   // bench_allreduce.cc; cpu_adam: timed steps (0: 10)
DECLARE_int32(warmup);  // bench_allreduce.cc; cpu_adam: untimed steps first

namespace dtrain::bench {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWeightDecay = 0.01;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The parameters as tensors of tensor_elems (the last one shorter), start values and grads.
struct Problem {
  std::vector<at::Tensor> init;   // fp32 start values
  std::vector<at::Tensor> grads;  // fp32, views of flat_grad
  at::Tensor flat_grad;
};

Problem make_problem(int64_t n, int64_t tensor_elems) {
  Problem p;
  at::manual_seed(1234);
  p.flat_grad = at::randn({n}) * 1e-2;
  for (int64_t off = 0; off < n; off += tensor_elems) {
    const int64_t m = std::min(tensor_elems, n - off);
    p.init.push_back(at::randn({m}));
    p.grads.push_back(p.flat_grad.narrow(0, off, m));
  }
  return p;
}

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& ts, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(t.to(dtype, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

std::vector<at::Tensor> zeros_like_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(at::zeros_like(t));
  return out;
}

at::Tensor flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : ts) parts.push_back(t.reshape({-1}).to(at::kFloat));
  return at::cat(parts);
}

// Runs `steps` (warm-up then timed) and returns the median ms of the timed ones.
double time_steps(const std::function<void()>& step, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    step();
    ms.push_back(ms_since(t0));
  }
  return median(ms);
}

struct Result {
  double ms = 0.0;
  at::Tensor weights;  // flat fp32 after all steps
};

// torch.optim's AdamW state: fp32 copies of the start values, zero moments and the per-tensor
// step counts (0-dim float tensors).
struct TorchAdam {
  std::vector<at::Tensor> params, m, v, steps;
  explicit TorchAdam(const Problem& p)
      : params(clone_all(p.init, at::kFloat)),
        m(zeros_like_all(params)),
        v(zeros_like_all(params)) {
    for (size_t i = 0; i < params.size(); ++i) steps.push_back(at::zeros({}, at::kFloat));
  }
};

// Times `step` on a fresh TorchAdam (warm-up, then iters steps).
Result run_torch(const Problem& p, int warmup, int iters,
                 const std::function<void(TorchAdam&)>& step) {
  TorchAdam adam(p);
  Result r;
  r.ms = time_steps([&] { step(adam); }, warmup, iters);
  r.weights = flat(adam.params);
  return r;
}

Result run_torch_fused(const Problem& p, int warmup, int iters) {
  return run_torch(p, warmup, iters, [&](TorchAdam& a) {
    at::_foreach_add_(a.steps, 1);  // torch.optim's _fused_adam does this before the kernel
    at::_fused_adamw_(a.params, p.grads, a.m, a.v, {}, a.steps, kLr, kBeta1, kBeta2, kWeightDecay,
                      kEps, /*amsgrad=*/false, /*maximize=*/false);
  });
}

// torch.optim.adam._multi_tensor_adam with decoupled weight decay (AdamW), capturable=False.
Result run_torch_foreach(const Problem& p, int warmup, int iters) {
  return run_torch(p, warmup, iters, [&](TorchAdam& a) {
    at::_foreach_add_(a.steps, 1);
    at::_foreach_mul_(a.params, 1.0 - kLr * kWeightDecay);
    at::_foreach_lerp_(a.m, p.grads, 1.0 - kBeta1);
    at::_foreach_mul_(a.v, kBeta2);
    at::_foreach_addcmul_(a.v, p.grads, p.grads, 1.0 - kBeta2);
    std::vector<at::Scalar> step_size, bc2_sqrt;
    for (const at::Tensor& s : a.steps) {
      const double t = s.item<double>();
      step_size.emplace_back(-kLr / (1.0 - std::pow(kBeta1, t)));
      bc2_sqrt.emplace_back(std::sqrt(1.0 - std::pow(kBeta2, t)));
    }
    std::vector<at::Tensor> denom = at::_foreach_sqrt(a.v);
    at::_foreach_div_(denom, bc2_sqrt);
    at::_foreach_add_(denom, kEps);
    at::_foreach_addcdiv_(a.params, a.m, denom, step_size);
  });
}

offload::CpuOptimizerOptions dtrain_options(int threads) {
  offload::CpuOptimizerOptions o;
  o.name = "adamw";
  o.lr = kLr;
  o.beta1 = kBeta1;
  o.beta2 = kBeta2;
  o.eps = kEps;
  o.weight_decay = kWeightDecay;
  o.threads = threads;
  o.isa = FLAGS_isa;
  return o;
}

Result run_dtrain(const Problem& p, int threads, bool bf16_copy, int warmup, int iters,
                  std::string* isa) {
  offload::PinnedPool pool;
  std::vector<at::Tensor> params = clone_all(p.init, bf16_copy ? at::kBFloat16 : at::kFloat);
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = p.grads[i];
  offload::CpuOptimizerOptions o = dtrain_options(threads);
  o.write_back = bf16_copy;
  offload::CpuOptimizer opt(params, o, pool);
  // The same start values as the torch impls (bf16 parameters rounded them).
  const at::Tensor init = flat(p.init);
  int64_t off = 0;
  for (auto& [name, chunk] : opt.state()) {
    if (name.rfind("master.", 0) != 0) continue;
    const int64_t m = std::min(chunk.numel(), init.numel() - off);  // padding stays 0
    chunk.narrow(0, 0, m).copy_(init.narrow(0, off, m));
    off += chunk.numel();
  }
  *isa = offload::to_string(opt.isa());
  Result r;
  r.ms = time_steps([&] { opt.step(); }, warmup, iters);
  r.weights = opt.master_weights();
  return r;
}

// The kernel over flat arrays through at::parallel_for (serial here: no -fopenmp; see the top).
Result run_dtrain_aten_threads(const Problem& p, int warmup, int iters) {
  at::Tensor w = flat(p.init), m = at::zeros_like(w), v = at::zeros_like(w);
  offload::CpuOptimizerOptions o = dtrain_options(1);
  offload::UpdateFn kernel =
      offload::update_kernel(o.isa == "auto" ? offload::best_isa()
                                             : (o.isa == "avx512" ? offload::Isa::kAvx512
                                                : o.isa == "avx2" ? offload::Isa::kAvx2
                                                                  : offload::Isa::kScalar));
  const int64_t n = w.numel();
  float* wp = w.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* gp = p.flat_grad.data_ptr<float>();
  int64_t t = 0;
  Result r;
  r.ms = time_steps(
      [&] {
        const offload::UpdateConfig c = offload::make_update_config(o, ++t);
        const int64_t grain = std::max<int64_t>(1 << 16, n / at::get_num_threads() / 4);
        at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
          offload::UpdateArrays a;
          a.param = wp + b;
          a.grad = gp + b;
          a.state0 = mp + b;
          a.state1 = vp + b;
          a.n = e - b;
          kernel(c, a);
        });
      },
      warmup, iters);
  r.weights = w;
  return r;
}

// Plain loops the compiler vectorizes (restrict: no aliasing with anything else), cloned for
// the widest vectors the CPU has (GCC target_clones: chosen at load time), as dtrain's kernel.
// -O3 for them: -O2's cost model leaves loops with a remainder scalar.
#pragma GCC push_options
#pragma GCC optimize("O3")
#define DTRAIN_BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
DTRAIN_BENCH_CLONES void copy_kernel(float* __restrict a, const float* __restrict b, int64_t lo,
                                     int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) a[i] = b[i];
}
DTRAIN_BENCH_CLONES void triad_kernel(float* __restrict a, const float* __restrict b,
                                      const float* __restrict c, float s, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}
DTRAIN_BENCH_CLONES void rmw_kernel(float* __restrict a, const float* __restrict b, float s,
                                    int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) a[i] += s * b[i];
}
// The memory traffic of an Adam step with next to no arithmetic: 4 streams read, 3 written.
DTRAIN_BENCH_CLONES void adam_pattern_kernel(float* __restrict p, const float* __restrict g,
                                             float* __restrict m, float* __restrict v, float s,
                                             int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    p[i] += s * g[i];
    m[i] += s * g[i];
    v[i] += s * g[i];
  }
}
#pragma GCC pop_options

// Streams over arrays of max(--params, 8M) floats (beyond the caches), in host memory from
// the same pool as dtrain's state, split over a team like the optimizer's.
json measure_bandwidth(int threads) {
  const int64_t n = std::max<int64_t>(FLAGS_params, int64_t{1} << 23);
  offload::PinnedPool pool;
  std::vector<at::Tensor> arrays;
  for (int k = 0; k < 4; ++k) arrays.push_back(pool.allocate(n, at::kFloat).fill_(1.0f));
  float* a = arrays[0].data_ptr<float>();
  float* b = arrays[1].data_ptr<float>();
  float* c = arrays[2].data_ptr<float>();
  float* d = arrays[3].data_ptr<float>();
  offload::ThreadPool team(threads);
  auto gbs = [&](const std::function<void(int64_t, int64_t)>& body, double bytes_per_elem) {
    std::vector<double> ms;
    for (int r = 0; r < 7; ++r) {
      auto t0 = Clock::now();
      team.run([&](int member) {
        auto [lo, hi] = offload::ThreadPool::part(0, n, member, team.size(), 16);
        body(lo, hi);
      });
      ms.push_back(ms_since(t0));
    }
    return bytes_per_elem * double(n) / (median(ms) * 1e-3) / 1e9;
  };
  const float s = 1e-7f;
  json line = {
      {"bench", "cpu_adam"}, {"impl", "memory_bandwidth"}, {"threads", threads}, {"elems", n}};
  line["copy_gbs"] = gbs([&](int64_t lo, int64_t hi) { copy_kernel(a, b, lo, hi); }, 8);
  line["triad_gbs"] = gbs([&](int64_t lo, int64_t hi) { triad_kernel(a, b, c, s, lo, hi); }, 12);
  line["update_gbs"] = gbs([&](int64_t lo, int64_t hi) { rmw_kernel(a, b, s, lo, hi); }, 12);
  line["adam_pattern_gbs"] =
      gbs([&](int64_t lo, int64_t hi) { adam_pattern_kernel(a, b, c, d, s, lo, hi); }, 28);
  return line;
}

std::vector<int> thread_counts() {
  std::vector<int> out;
  if (FLAGS_threads.empty()) {
    out = {1, offload::default_thread_count()};
  } else {
    for (const std::string& s : split(FLAGS_threads)) {
      char* end = nullptr;
      const long t = std::strtol(s.c_str(), &end, 10);
      DTRAIN_CHECK(end && *end == '\0' && t >= 1, "--threads: '", s,
                   "' is not a positive thread count; use e.g. --threads=1,2");
      out.push_back(static_cast<int>(t));
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// One impl at thread count t: its line (without rel_err) and its final weights.
std::pair<json, at::Tensor> run_impl(const std::string& impl, const Problem& problem, int t,
                                     int iters, const json& bandwidth) {
  Result r;
  std::string isa;
  if (impl == "torch_fused") {
    r = run_torch_fused(problem, FLAGS_warmup, iters);
  } else if (impl == "torch_foreach") {
    r = run_torch_foreach(problem, FLAGS_warmup, iters);
  } else if (impl == "dtrain_aten_threads") {
    r = run_dtrain_aten_threads(problem, FLAGS_warmup, iters);
  } else {
    r = run_dtrain(problem, t, impl == "dtrain_bf16_copy", FLAGS_warmup, iters, &isa);
  }
  const double n = static_cast<double>(FLAGS_params);
  const double state_gbs = 28.0 * n / (r.ms * 1e-3) / 1e9;
  json line = {{"bench", "cpu_adam"},
               {"impl", impl},
               {"params", FLAGS_params},
               {"threads", t},
               {"ms", r.ms},
               {"iters", iters},
               {"state_gbs", state_gbs},
               {"fraction_of_limit", state_gbs / bandwidth["adam_pattern_gbs"].get<double>()}};
  if (!isa.empty()) line["isa"] = isa;
  if (impl == "dtrain_bf16_copy") line["total_gbs"] = 30.0 * n / (r.ms * 1e-3) / 1e9;
  return {std::move(line), std::move(r.weights)};
}

}  // namespace

// dtrain-bench host_norm: the 2-norm of N float32 host gradients in tensors of --tensor_elems
// (layer offload's streamed blocks, whose gradients live on the host), by engine::grad_norm (the
// trainer's clipping norm: threaded pieces above 4 Mi elements) and by ATen's _foreach_norm
// (one tensor after another on one thread), at each thread count. Lines:
//   {"bench":"host_norm","impl":"dtrain"|"aten_foreach","params":N,"threads":T,"ms":median,
//    "gbs":4 N / time (10^9 bytes per second),"rel_err":against float64}
int run_host_norm(BenchContext& ctx) {
  const bool print = ctx.comm->rank() == 0;
  DTRAIN_CHECK(FLAGS_params >= 1 && FLAGS_tensor_elems >= 1, "--params and --tensor_elems must be >= 1");
  const int iters = FLAGS_iters > 0 ? FLAGS_iters : 10;
  std::vector<at::Tensor> grads;
  for (int64_t left = FLAGS_params; left > 0; left -= FLAGS_tensor_elems) {
    grads.push_back(at::randn({std::min(left, FLAGS_tensor_elems)}));
  }
  std::vector<at::Tensor> as_double;
  for (const at::Tensor& g : grads) as_double.push_back(g.to(at::kDouble));
  const double want = at::linalg_vector_norm(at::cat(as_double), 2).item<double>();
  as_double.clear();
  for (int t : thread_counts()) {
    at::set_num_threads(t);
    for (const std::string impl : {"dtrain", "aten_foreach"}) {
      double got = 0;
      const double ms = time_steps(
          [&] {
            got = impl == "dtrain" ? engine::grad_norm(grads).item<double>()
                                   : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2).item<double>();
          },
          FLAGS_warmup, iters);
      json line = {{"bench", "host_norm"}, {"impl", impl}, {"params", FLAGS_params}, {"threads", t}, {"ms", ms},
                   {"gbs", 4.0 * double(FLAGS_params) / (ms * 1e-3) / 1e9}, {"rel_err", std::abs(got - want) / want}};
      if (print) std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

int run_cpu_adam(BenchContext& ctx) {
  const bool print = ctx.comm->rank() == 0;
  DTRAIN_CHECK(FLAGS_params >= 1, "--params = ", FLAGS_params, " must be >= 1");
  DTRAIN_CHECK(FLAGS_tensor_elems >= 1, "--tensor_elems = ", FLAGS_tensor_elems, " must be >= 1");
  DTRAIN_CHECK(FLAGS_warmup >= 0, "--warmup = ", FLAGS_warmup, " must be >= 0");
  const int iters = FLAGS_iters > 0 ? FLAGS_iters : 10;
  std::vector<std::string> impls = split(FLAGS_impls);
  const std::vector<std::string> known = {"dtrain", "torch_fused", "torch_foreach",
                                          "dtrain_bf16_copy", "dtrain_aten_threads"};
  for (const std::string& impl : impls) {
    DTRAIN_CHECK(std::find(known.begin(), known.end(), impl) != known.end(), "--impls: unknown '",
                 impl, "'; known: dtrain, torch_fused, torch_foreach, dtrain_bf16_copy, ",
                 "dtrain_aten_threads");
  }
  // torch_fused first: its weights are the reference the others are checked against.
  std::stable_partition(impls.begin(), impls.end(),
                        [](const std::string& i) { return i == "torch_fused"; });
  const std::vector<int> threads = thread_counts();
  const Problem problem = make_problem(FLAGS_params, FLAGS_tensor_elems);
  for (int t : threads) {
    at::set_num_threads(t);
    const json bandwidth = measure_bandwidth(t);
    if (print) std::printf("%s\n", bandwidth.dump().c_str());
    at::Tensor reference;  // torch_fused's weights (float64)
    for (const std::string& impl : impls) {
      auto [line, weights] = run_impl(impl, problem, t, iters, bandwidth);
      const at::Tensor w = weights.to(at::kDouble);
      if (impl == "torch_fused") {
        reference = w;
      } else if (reference.defined()) {
        line["rel_err"] = (w - reference).norm().item<double>() / reference.norm().item<double>();
      }
      if (print) std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace dtrain::bench
