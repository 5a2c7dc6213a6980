// The CPU optimizer kernels against each other (scalar, AVX2, AVX-512 through one interface),
// their dtype conversions against at::Tensor::to, and the thread team. The update formulas
// against torch.optim are in offload_cpu_optim_test.cc.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/offload/cpu_kernels.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/thread_pool.h"
#include "test_util.h"

namespace dtrain::offload {
namespace {

using testing_util::rel_error;

const Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};

at::ScalarType dtype_of(ElemType t) {
  switch (t) {
    case ElemType::kBFloat16:
      return at::kBFloat16;
    case ElemType::kFloat16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

// The arrays of one kernel call as tensors (so each implementation gets its own copy). The
// kernel sees the first n elements; the kGuard elements after them must stay untouched.
constexpr int64_t kGuard = 16;
struct Arrays {
  at::Tensor param, grad, s0, s1, s2, out;
  int64_t n = -1;  // -1: every element
  ElemType grad_type = ElemType::kFloat32;
  ElemType out_type = ElemType::kNone;

  Arrays clone() const {
    Arrays c = *this;
    for (at::Tensor* t : {&c.param, &c.grad, &c.s0, &c.s1, &c.s2, &c.out}) {
      if (t->defined()) *t = t->clone();
    }
    return c;
  }
  void run(UpdateFn kernel, const UpdateConfig& config) {
    UpdateArrays a;
    a.param = param.data_ptr<float>();
    a.grad = grad.data_ptr();
    a.grad_type = grad_type;
    a.state0 = s0.data_ptr<float>();
    a.state1 = s1.data_ptr<float>();
    a.state2 = s2.data_ptr<float>();
    a.out = out.defined() ? out.data_ptr() : nullptr;
    a.out_type = out_type;
    a.n = n >= 0 ? n : param.numel();
    kernel(config, a);
  }
  // The first n elements, or the guard after them.
  static at::Tensor head(const at::Tensor& t, int64_t n) { return t.narrow(0, 0, n); }
  static at::Tensor guard(const at::Tensor& t, int64_t n) { return t.narrow(0, n, kGuard); }
};

Arrays make_arrays(int64_t count, ElemType grad_type, ElemType out_type, at::Generator& gen) {
  Arrays a;
  a.n = count;
  const int64_t n = count + kGuard;
  a.param = at::randn({n}, gen, at::kFloat);
  a.grad = at::randn({n}, gen, at::kFloat).to(dtype_of(grad_type));
  a.grad_type = grad_type;
  a.s0 = at::randn({n}, gen, at::kFloat) * 0.1;
  a.s1 = at::rand({n}, gen, at::kFloat) * 0.01;
  a.s2 = a.s1 + at::rand({n}, gen, at::kFloat) * 0.01 * (at::rand({n}, gen) > 0.5);
  a.out_type = out_type;
  if (out_type != ElemType::kNone) a.out = at::full({n}, 7.0, dtype_of(out_type));
  return a;
}

struct NamedConfig {
  std::string name;
  UpdateConfig config;
};

std::vector<NamedConfig> configs() {
  auto make = [](const std::string& rule, int64_t t, auto&& tweak) {
    CpuOptimizerOptions o;
    o.name = rule;
    o.lr = 0.01;
    tweak(o);
    return make_update_config(o, t, /*grad_multiplier=*/0.5);
  };
  return {
      {"adam_l2", make("adam", 3, [](auto& o) { o.weight_decay = 0.1; })},
      {"adam_amsgrad", make("adam", 2, [](auto& o) { o.amsgrad = true; })},
      {"adamw", make("adamw", 5, [](auto& o) { o.weight_decay = 0.1; })},
      {"adagrad", make("adagrad", 4,
                       [](auto& o) {
                         o.lr_decay = 0.1;
                         o.weight_decay = 0.01;
                         o.eps = 1e-10;
                       })},
      {"sgd", make("sgd", 1, [](auto& o) { o.weight_decay = 0.01; })},
      {"sgd_momentum_first", make("sgd", 1, [](auto& o) { o.momentum = 0.9; })},
      {"sgd_momentum", make("sgd", 3,
                            [](auto& o) {
                              o.momentum = 0.9;
                              o.dampening = 0.2;
                            })},
      {"sgd_nesterov", make("sgd", 2,
                            [](auto& o) {
                              o.momentum = 0.9;
                              o.nesterov = true;
                            })},
  };
}

TEST(OffloadKernels, DetectsIsas) {
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_TRUE(isa_supported(best_isa()));
  for (Isa isa : kAllIsas) {
    if (isa_supported(isa)) {
      EXPECT_NE(update_kernel(isa), nullptr) << to_string(isa);
    } else {
      EXPECT_THROW(update_kernel(isa), Error) << to_string(isa);
      std::printf("[ note ] %s kernel: this CPU lacks it (not tested here)\n", to_string(isa));
    }
  }
}

// Each vector kernel equals the scalar one up to float rounding (FMA contraction), for every
// rule, gradient type, output type and tail length; outputs equal at::Tensor::to bit for bit.
TEST(OffloadKernels, VectorKernelsMatchScalar) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(77);
  const UpdateFn scalar = update_kernel(Isa::kScalar);
  int tested_isas = 0;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) {
      std::printf("[ skip ] %s kernel: not supported by this CPU\n", to_string(isa));
      continue;
    }
    ++tested_isas;
    const UpdateFn vec = update_kernel(isa);
    for (const NamedConfig& nc : configs()) {
      for (ElemType g : {ElemType::kFloat32, ElemType::kBFloat16, ElemType::kFloat16}) {
        for (ElemType o :
             {ElemType::kNone, ElemType::kFloat32, ElemType::kBFloat16, ElemType::kFloat16}) {
          for (int64_t n : {1, 7, 15, 16, 17, 33, 1000}) {
            SCOPED_TRACE(std::string(to_string(isa)) + " " + nc.name + " grad " +
                         std::to_string(int(g)) + " out " + std::to_string(int(o)) + " n " +
                         std::to_string(n));
            Arrays base = make_arrays(n, g, o, gen);
            if (nc.config.kind == OptimKind::kAdagrad) base.s0.abs_();  // sums are >= 0
            Arrays a = base.clone(), b = base.clone();
            a.run(scalar, nc.config);
            b.run(vec, nc.config);
            EXPECT_LT(rel_error(b.param, a.param), 1e-6);
            EXPECT_LT(rel_error(b.s0, a.s0), 1e-6);
            EXPECT_LT(rel_error(b.s1, a.s1), 1e-6);
            EXPECT_LT(rel_error(b.s2, a.s2), 1e-6);
            EXPECT_FALSE(at::equal(Arrays::head(a.param, n), Arrays::head(base.param, n)));
            for (Arrays* r : {&a, &b}) {
              // Nothing is written past n (vector tails work on copies), nor to the gradient.
              for (auto [got, was] : {std::pair{r->param, base.param},
                                      {r->s0, base.s0},
                                      {r->s1, base.s1},
                                      {r->s2, base.s2}}) {
                EXPECT_TRUE(at::equal(Arrays::guard(got, n), Arrays::guard(was, n)));
              }
              EXPECT_TRUE(at::equal(r->grad, base.grad));
              if (o != ElemType::kNone) {
                EXPECT_TRUE(
                    at::equal(Arrays::head(r->out, n), Arrays::head(r->param, n).to(dtype_of(o))));
                EXPECT_TRUE(at::equal(Arrays::guard(r->out, n), Arrays::guard(base.out, n)));
              }
            }
          }
        }
      }
    }
  }
  if (tested_isas == 0) GTEST_SKIP() << "no vector kernel runs on this CPU";
}

// Special values through each kernel's conversions: SGD with lr 1 and a zero parameter makes
// param = -grad exactly (grad loads), and lr 0 writes the parameter unchanged (out stores).
TEST(OffloadKernels, ConversionsMatchTensorTo) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Ties and near-ties for bf16 (1 + 2^-8 is halfway) and fp16, overflow to inf, fp16
  // subnormals and underflow, signed zeros.
  std::vector<float> values = {0.0f,       -0.0f,    1.0f,     -1.5f,    1.00390625f,  1.01171875f,
                               1.0039063f, 65504.0f, 65519.0f, 65520.0f, 70000.0f,     -1e6f,
                               6.0e-8f,    2.9e-8f,  3.0e-8f,  1.0e-5f,  -6.1e-5f,     3.4e38f,
                               1e-40f,     inf,      -inf,     nan,      0.333333343f, 1234.5678f};
  for (int i = 0; i < 40; ++i) values.push_back(std::ldexp(1.0f + i / 64.0f, i - 20));
  const int64_t n = static_cast<int64_t>(values.size());
  const at::Tensor v = at::tensor(values, at::kFloat);
  for (Isa isa : kAllIsas) {
    if (!isa_supported(isa)) {
      std::printf("[ skip ] %s kernel: not supported by this CPU\n", to_string(isa));
      continue;
    }
    const UpdateFn kernel = update_kernel(isa);
    for (ElemType t : {ElemType::kBFloat16, ElemType::kFloat16}) {
      SCOPED_TRACE(std::string(to_string(isa)) + (t == ElemType::kBFloat16 ? " bf16" : " fp16"));
      const at::Tensor expected_out = v.to(dtype_of(t));
      // Stores: lr 0 leaves the parameter as is; out = param converted.
      CpuOptimizerOptions o;
      o.name = "sgd";
      o.lr = 0.0;
      Arrays keep;
      keep.param = v.clone();
      keep.grad = at::zeros({n});
      keep.s0 = at::zeros({n});
      keep.s1 = at::zeros({n});
      keep.s2 = at::zeros({n});
      keep.out = at::zeros({n}, dtype_of(t));
      keep.out_type = t;
      keep.run(kernel, make_update_config(o, 1));
      const at::Tensor nan_mask = at::isnan(expected_out);
      EXPECT_TRUE(at::equal(at::isnan(keep.out), nan_mask));
      const at::Tensor diff =
          keep.out.masked_fill(nan_mask, 0) != expected_out.masked_fill(nan_mask, 0);
      EXPECT_FALSE(diff.any().item<bool>())
          << "differ at inputs " << v.masked_select(diff) << " got "
          << keep.out.masked_select(diff).to(at::kFloat) << " want "
          << expected_out.masked_select(diff).to(at::kFloat);
      // Loads: param 0, lr 1: param = -grad.
      o.lr = 1.0;
      Arrays load;
      load.grad = expected_out.clone();
      load.grad_type = t;
      load.param = at::zeros({n});
      load.s0 = at::zeros({n});
      load.s1 = at::zeros({n});
      load.s2 = at::zeros({n});
      load.run(kernel, make_update_config(o, 1));
      const at::Tensor want = -expected_out.to(at::kFloat);
      const at::Tensor want_nan = at::isnan(want);
      EXPECT_TRUE(at::equal(at::isnan(load.param), want_nan));
      EXPECT_TRUE(at::equal(load.param.masked_fill(want_nan, 0), want.masked_fill(want_nan, 0)));
    }
  }
}

TEST(OffloadKernels, ConfigMatchesTorchFormulas) {
  CpuOptimizerOptions o;
  o.name = "adamw";
  o.lr = 0.01;
  o.weight_decay = 0.1;
  o.beta1 = 0.8;
  o.beta2 = 0.99;
  UpdateConfig c = make_update_config(o, 3, 0.25);
  EXPECT_EQ(c.kind, OptimKind::kAdam);
  EXPECT_FLOAT_EQ(c.grad_multiplier, 0.25f);
  EXPECT_FLOAT_EQ(c.param_decay, static_cast<float>(1.0 - 0.01 * 0.1));
  EXPECT_EQ(c.l2_weight_decay, 0.0f);
  EXPECT_FLOAT_EQ(c.step_size, static_cast<float>(0.01 / (1.0 - 0.8 * 0.8 * 0.8)));
  EXPECT_FLOAT_EQ(c.inv_bias_correction2_sqrt,
                  static_cast<float>(1.0 / std::sqrt(1.0 - 0.99 * 0.99 * 0.99)));
  o.name = "adagrad";
  o.lr_decay = 0.5;
  c = make_update_config(o, 3);
  EXPECT_FLOAT_EQ(c.lr, static_cast<float>(0.01 / (1.0 + 2 * 0.5)));
  EXPECT_FLOAT_EQ(c.l2_weight_decay, 0.1f);
  EXPECT_THROW(make_update_config(o, 0), Error);
}

// ---- the thread team --------------------------------------------------------------------------

TEST(OffloadThreadPool, RunsEveryMemberOnceAndRethrows) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int round = 0; round < 50; ++round) {
      std::vector<std::atomic<int>> hits(threads);
      for (auto& h : hits) h = 0;
      pool.run([&](int m) { hits[m].fetch_add(1); });
      for (int m = 0; m < threads; ++m) EXPECT_EQ(hits[m].load(), 1);
    }
    EXPECT_THROW(pool.run([&](int m) {
      if (m == threads - 1) throw std::runtime_error("member failed");
    }),
                 std::runtime_error);
    // Still usable after a failure.
    std::atomic<int> count{0};
    pool.run([&](int) { count.fetch_add(1); });
    EXPECT_EQ(count.load(), threads);
  }
  EXPECT_THROW(ThreadPool(0), Error);
  EXPECT_GE(default_thread_count(), 1);
}

TEST(OffloadThreadPool, PartsCoverTheRangeAligned) {
  for (int members : {1, 2, 3, 7}) {
    for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 0}, {0, 1}, {5, 6}, {3, 100}, {17, 1000003}, {64, 128}}) {
      int64_t next = begin;
      for (int m = 0; m < members; ++m) {
        auto [lo, hi] = ThreadPool::part(begin, end, m, members, 16);
        EXPECT_EQ(lo, next);
        EXPECT_LE(lo, hi);
        if (m > 0 && lo != begin && lo != end) EXPECT_EQ(lo % 16, 0);
        next = hi;
      }
      EXPECT_EQ(next, end);
    }
  }
  // Large ranges are split evenly (within an alignment unit).
  auto [lo, hi] = ThreadPool::part(0, 1 << 20, 1, 4, 16);
  EXPECT_EQ(lo, 1 << 18);
  EXPECT_EQ(hi, 1 << 19);
}

}  // namespace
}  // namespace dtrain::offload
