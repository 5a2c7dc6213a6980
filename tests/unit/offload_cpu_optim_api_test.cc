// CpuOptimizer beyond the formulas (those are in offload_cpu_optim_test.cc): partitioning
// into shards (simulated ranks in one process equal the unpartitioned optimizer bit for bit),
// the flat layout, checkpoints, set_output, bad input, and copy-back to a GPU (skipped here
// without one).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"
#include "test_util.h"

namespace dtrain::offload {
namespace {

using testing_util::rel_error;

const std::vector<int64_t> kSizes = {300, 7, 1, 129, 33, 64};  // 534 elements

using testing_util::error_of;

std::vector<at::Tensor> make_params(uint64_t seed, at::ScalarType dtype = at::kFloat) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (int64_t n : kSizes) params.push_back(at::randn({n}, gen).to(dtype).requires_grad_(true));
  return params;
}

// Gradient of step s for every parameter (the same on every call).
std::vector<at::Tensor> make_grads(int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  std::vector<at::Tensor> grads;
  for (int64_t n : kSizes) grads.push_back(at::randn({n}, gen) * (1.0 + step));
  return grads;
}

void set_grads(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = grads[i].to(params[i].scalar_type()).clone();
  }
}

at::Tensor flat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : ts) parts.push_back(t.detach().reshape({-1}).to(at::kFloat));
  return at::cat(parts);
}

CpuOptimizerOptions adamw_options() {
  CpuOptimizerOptions o;
  o.name = "adamw";
  o.lr = 0.01;
  o.weight_decay = 0.1;
  o.amsgrad = true;
  o.threads = 2;
  o.chunk_elems = 64;  // several chunks per shard
  o.tile_elems = 40;
  return o;
}

// Joined chunks of one state array of an optimizer, padding included.
at::Tensor joined(const CpuOptimizer& opt, const std::string& array) {
  std::vector<at::Tensor> chunks;
  for (const auto& [name, t] : opt.state()) {
    if (name.rfind(array + ".", 0) == 0) chunks.push_back(t);
  }
  return at::cat(chunks);
}

TEST(OffloadCpuOptimApi, LayoutAndShards) {
  EXPECT_EQ(padded_numel(534, 1), 576);
  EXPECT_EQ(padded_numel(534, 4), 768);
  EXPECT_EQ(padded_numel(1, 3), 192);
  for (int count : {1, 2, 3, 4, 7}) {
    int64_t next = 0;
    for (int r = 0; r < count; ++r) {
      const ShardRange s = shard_range(534, r, count);
      EXPECT_EQ(s.begin, next);
      EXPECT_EQ(s.begin % kShardAlign, 0);
      EXPECT_EQ(s.size(), padded_numel(534, count) / count);
      next = s.end;
    }
    EXPECT_EQ(next, padded_numel(534, count));
  }
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(1);
  CpuOptimizer opt(params, adamw_options(), pool);
  EXPECT_EQ(opt.numel(), 534);
  EXPECT_EQ(opt.padded_numel(), 576);
  EXPECT_EQ(opt.param_offset(0), 0);
  EXPECT_EQ(opt.param_offset(1), 300);
  EXPECT_EQ(opt.param_offset(5), 470);
  EXPECT_THROW(opt.param_offset(6), Error);
  EXPECT_EQ(opt.threads(), 2);
  EXPECT_TRUE(at::equal(opt.master_weights(), flat(params)));
}

// N ranks simulated in one process, each with its own shard over the same parameters:
// every rank writes only its own elements, and together they give exactly the
// unpartitioned result (weights and state), with 1/N of the host memory each.
TEST(OffloadCpuOptimApi, ShardsTogetherEqualUnpartitioned) {
  for (const char* rule : {"adamw", "adagrad", "sgd"}) {
    SCOPED_TRACE(rule);
    CpuOptimizerOptions o = adamw_options();
    o.name = rule;
    o.momentum = 0.9;
    o.dampening = 0.1;
    PinnedPool pool;
    std::vector<at::Tensor> whole_params = make_params(2);
    CpuOptimizer whole(whole_params, o, pool);
    for (int count : {2, 3, 4}) {
      SCOPED_TRACE("shards " + std::to_string(count));
      std::vector<at::Tensor> params = make_params(2);
      std::vector<std::unique_ptr<CpuOptimizer>> ranks;
      for (int r = 0; r < count; ++r) {
        CpuOptimizerOptions ro = o;
        ro.shard_rank = r;
        ro.shard_count = count;
        ranks.push_back(std::make_unique<CpuOptimizer>(params, ro, pool));
        EXPECT_LE(ranks.back()->host_bytes(), whole.host_bytes() / count + 4 * 64 * 4 * 4);
      }
      std::vector<at::Tensor> reference_params = make_params(2);
      CpuOptimizer reference(reference_params, o, pool);
      for (int step = 0; step < 3; ++step) {
        const std::vector<at::Tensor> grads = make_grads(step);
        set_grads(params, grads);
        set_grads(reference_params, grads);
        for (auto& rank : ranks) rank->step();
        reference.step();
      }
      EXPECT_TRUE(at::equal(flat(params), flat(reference_params)));
      int compared = 0;
      for (const auto& [name, unused] : reference.state()) {
        const std::string array = name.substr(0, name.find('.'));
        if (name.size() < 2 || name.compare(name.size() - 2, 2, ".0") != 0)
          continue;  // once per array
        std::vector<at::Tensor> parts;
        for (auto& rank : ranks) parts.push_back(joined(*rank, array));
        at::Tensor together = at::cat(parts).narrow(0, 0, reference.numel());
        EXPECT_TRUE(at::equal(together, joined(reference, array).narrow(0, 0, reference.numel())))
            << array;
        ++compared;
      }
      EXPECT_EQ(compared, std::string(rule) == "adamw" ? 4 : 2) << "master and the state arrays";
    }
  }
}

TEST(OffloadCpuOptimApi, CheckpointRoundTrip) {
  PinnedPool pool;
  const CpuOptimizerOptions o = adamw_options();
  // Three steps straight.
  std::vector<at::Tensor> a_params = make_params(3);
  CpuOptimizer a(a_params, o, pool);
  for (int s = 0; s < 3; ++s) {
    set_grads(a_params, make_grads(s));
    a.step();
  }
  // Two steps, save, then a fresh optimizer over fresh parameters loads and takes the third.
  std::vector<at::Tensor> b_params = make_params(3);
  CpuOptimizer b(b_params, o, pool);
  for (int s = 0; s < 2; ++s) {
    set_grads(b_params, make_grads(s));
    b.step();
  }
  std::vector<std::pair<std::string, at::Tensor>> saved;
  for (const auto& [name, t] : b.state()) saved.emplace_back(name, t.clone());
  EXPECT_EQ(saved.front().first, "step");
  EXPECT_EQ(saved.front().second.item<int64_t>(), 2);
  std::vector<at::Tensor> c_params = make_params(99);  // other values: the master is loaded
  CpuOptimizer c(c_params, o, pool);
  c.load_state(saved);
  EXPECT_EQ(c.step_count(), 2);
  set_grads(c_params, make_grads(2));
  c.step();
  EXPECT_TRUE(at::equal(c.master_weights(), a.master_weights()));
  EXPECT_TRUE(at::equal(flat(c_params), flat(a_params)));
  for (const char* array : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
    EXPECT_TRUE(at::equal(joined(c, array), joined(a, array))) << array;
  }
}

TEST(OffloadCpuOptimApi, LoadStateRejectsMismatches) {
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(4);
  CpuOptimizer opt(params, adamw_options(), pool);
  auto good = [&] {
    std::vector<std::pair<std::string, at::Tensor>> s;
    for (const auto& [name, t] : opt.state()) s.emplace_back(name, t.clone());
    return s;
  };
  auto missing = good();
  missing.pop_back();
  EXPECT_NE(error_of([&] { opt.load_state(missing); }).find("missing entry"), std::string::npos);
  auto unknown = good();
  unknown.emplace_back("momentum_buffer.0", at::zeros({64}));
  EXPECT_NE(error_of([&] { opt.load_state(unknown); }).find("unknown entry 'momentum_buffer.0'"),
            std::string::npos);
  auto shape = good();
  shape[3].second = at::zeros({5});
  EXPECT_NE(error_of([&] { opt.load_state(shape); }).find("has sizes [5]"), std::string::npos);
  // A checkpoint of another partitioning (the same arrays, another layout).
  CpuOptimizerOptions two = adamw_options();
  two.shard_count = 2;
  std::vector<at::Tensor> other_params = make_params(4);
  CpuOptimizer other(other_params, two, pool);
  auto layout = good();
  for (auto& [name, t] : layout) {
    if (name == "layout") t = other.state()[1].second.clone();
  }
  EXPECT_NE(error_of([&] { opt.load_state(layout); }).find("layout"), std::string::npos);
  // Nothing was changed by the refused loads.
  EXPECT_TRUE(at::equal(opt.master_weights(), flat(params)));
}

TEST(OffloadCpuOptimApi, SetOutputWritesAFlatBuffer) {
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(5);
  const at::Tensor start = flat(params);
  CpuOptimizerOptions o = adamw_options();
  o.shard_count = 2;
  o.shard_rank = 1;  // elements [320, 640) hold the real [320, 534)
  CpuOptimizer opt(params, o, pool);
  at::Tensor out = at::full({opt.padded_numel()}, -7.0, at::kBFloat16);
  opt.set_output(out);
  set_grads(params, make_grads(0));
  opt.step();
  const ShardRange s = opt.shard();
  EXPECT_EQ(s.begin, 320);
  EXPECT_TRUE(at::equal(out.narrow(0, s.begin, opt.numel() - s.begin),
                        opt.master_weights().to(at::kBFloat16)));
  EXPECT_TRUE((out.narrow(0, 0, s.begin) == -7.0).all().item<bool>()) << "other shards untouched";
  EXPECT_TRUE(
      (out.narrow(0, opt.numel(), opt.padded_numel() - opt.numel()) == -7.0).all().item<bool>())
      << "padding untouched";
  EXPECT_TRUE(at::equal(flat(params), start)) << "the parameters are no longer the target";
  // Back to the parameters: the next step writes this shard's part of them.
  opt.set_output(at::Tensor());
  opt.step();
  EXPECT_TRUE(
      at::equal(flat(params).narrow(0, s.begin, opt.numel() - s.begin), opt.master_weights()));
  EXPECT_TRUE(at::equal(flat(params).narrow(0, 0, s.begin), start.narrow(0, 0, s.begin)));
  EXPECT_THROW(opt.set_output(at::zeros({100})), Error);
  EXPECT_THROW(opt.set_output(at::zeros({opt.numel()}, at::kInt)), Error);
}

TEST(OffloadCpuOptimApi, WriteBackOffLeavesParameters) {
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(6);
  const at::Tensor start = flat(params);
  CpuOptimizerOptions o = adamw_options();
  o.write_back = false;
  CpuOptimizer opt(params, o, pool);
  set_grads(params, make_grads(0));
  opt.step();
  EXPECT_TRUE(at::equal(flat(params), start));
  EXPECT_FALSE(at::equal(opt.master_weights(), start));
}

// Parameters of several float dtypes in one optimizer, float64 included (copied back
// through staging), and an undefined gradient counting as zero.
TEST(OffloadCpuOptimApi, MixedDtypesAndMissingGradient) {
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(7);
  params[1] = params[1].detach().to(at::kDouble).requires_grad_(true);
  params[2] = params[2].detach().to(at::kHalf).requires_grad_(true);
  params[3] = params[3].detach().to(at::kBFloat16).requires_grad_(true);
  CpuOptimizerOptions o = adamw_options();
  o.name = "sgd";
  o.momentum = 0.0;
  o.lr = 0.5;
  o.weight_decay = 0.0;
  CpuOptimizer opt(params, o, pool);
  const at::Tensor before = opt.master_weights();
  std::vector<at::Tensor> grads = make_grads(0);
  set_grads(params, grads);
  params[4].mutable_grad() = at::Tensor();
  grads[4] = at::zeros_like(grads[4]);
  opt.step();
  // SGD: master = before - lr * grad, each gradient as its dtype rounded it.
  std::vector<at::Tensor> used;
  for (size_t i = 0; i < params.size(); ++i) used.push_back(grads[i].to(params[i].scalar_type()));
  const at::Tensor expected = before - 0.5 * flat(used);
  EXPECT_LT(rel_error(opt.master_weights(), expected), 1e-7);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor m = opt.master_weights().narrow(0, opt.param_offset(i), params[i].numel());
    EXPECT_TRUE(at::equal(params[i].detach(), m.to(params[i].scalar_type()))) << "parameter " << i;
  }
}

TEST(OffloadCpuOptimApi, StepProtocolErrors) {
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(8);
  CpuOptimizer opt(params, adamw_options(), pool);
  const at::Tensor g = at::zeros({100});
  EXPECT_NE(error_of([&] { opt.step_range(0, 100, g); }).find("call begin_step()"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt.end_step(); }).find("without an open step"), std::string::npos);
  opt.begin_step();
  EXPECT_NE(error_of([&] { opt.begin_step(); }).find("is open"), std::string::npos);
  EXPECT_NE(error_of([&] { opt.step_range(500, 600, g); }).find("shard [0, 576)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt.step_range(0, 99, g); }).find("needs 99 gradient elements, got 100"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt.step_range(0, 100, at::zeros({100}, at::kInt)); }).find("Int"),
            std::string::npos);
  opt.step_range(0, 100, g);
  EXPECT_NE(error_of([&] { opt.step_range(50, 150, g); }).find("overlaps [0, 100)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { opt.end_step(); }).find("left elements [100, 534)"), std::string::npos);
  opt.step_range(200, 576, at::zeros({376}, at::kHalf));
  EXPECT_NE(error_of([&] { opt.end_step(); }).find("left elements [100, 200)"), std::string::npos);
  opt.step_range(100, 200, g);
  EXPECT_NO_THROW(opt.end_step());
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_THROW(opt.begin_step(std::nan("")), Error);
  EXPECT_THROW(opt.set_lr(-1.0), Error);
  opt.set_lr(0.5);
  EXPECT_EQ(opt.lr(), 0.5);
  // A gradient that does not match its parameter.
  params[0].mutable_grad() = at::zeros({3});
  EXPECT_NE(error_of([&] { opt.step(); }).find("gradient of parameter 0"), std::string::npos);
  EXPECT_EQ(opt.step_count(), 1) << "a refused step() does not open a step";
}

TEST(OffloadCpuOptimApi, ConstructionErrors) {
  PinnedPool pool;
  auto build = [&](std::vector<at::Tensor> params, CpuOptimizerOptions o) {
    return error_of([&] { CpuOptimizer opt(std::move(params), o, pool); });
  };
  const CpuOptimizerOptions good = adamw_options();
  EXPECT_NE(build({}, good).find("parameter list is empty"), std::string::npos);
  EXPECT_NE(build({at::zeros({0})}, good).find("no elements"), std::string::npos);
  EXPECT_NE(build({at::zeros({3}, at::kLong)}, good).find("floating-point"), std::string::npos);
  EXPECT_NE(build({at::zeros({4, 4}).t()}, good).find("not contiguous"), std::string::npos);
  at::Tensor p = at::zeros({3});
  EXPECT_NE(build({p, p}, good).find("listed twice"), std::string::npos);
  auto with = [&](auto&& tweak) {
    CpuOptimizerOptions o = good;
    tweak(o);
    return build({at::zeros({3})}, o);
  };
  EXPECT_NE(with([](auto& o) { o.name = "lamb"; }).find("unknown CPU optimizer name 'lamb'"),
            std::string::npos);
  EXPECT_NE(with([](auto& o) { o.beta1 = 1.0; }).find("beta1"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.lr = -1; }).find("lr"), std::string::npos);
  EXPECT_NE(with([](auto& o) {
              o.name = "sgd";
              o.nesterov = true;
            }).find("nesterov needs momentum"),
            std::string::npos);
  EXPECT_NE(with([](auto& o) {
              o.shard_rank = 2;
              o.shard_count = 2;
            }).find("shard_rank = 2"),
            std::string::npos);
  EXPECT_NE(with([](auto& o) { o.isa = "neon"; }).find("unknown isa 'neon'"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.chunk_elems = 100; }).find("power of two"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.threads = -1; }).find("threads"), std::string::npos);
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) {
      EXPECT_NE(with([&](auto& o) { o.isa = to_string(isa); }).find("cannot run here"),
                std::string::npos);
    }
  }
  // The host memory cap is enforced at construction.
  PinnedPoolOptions small;
  small.limit_bytes = 4096;
  PinnedPool capped(small);
  const std::string msg = error_of([&] { CpuOptimizer opt({at::zeros({10000})}, good, capped); });
  EXPECT_NE(msg.find("--host_mem_limit_gb"), std::string::npos) << msg;
  EXPECT_EQ(capped.used_bytes(), 0) << "what was allocated before the refusal is released";
}

// Parameters on the GPU (bf16, as under AMP): updated weights are copied back from pinned
// staging on a copy stream; after end_step the current stream sees them.
TEST(OffloadCpuOptimApi, CopiesBackToTheGpu) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  PinnedPool pool;
  EXPECT_TRUE(pool.pinned());
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : make_params(9)) {
    params.push_back(p.detach().to(at::kCUDA, at::kBFloat16).requires_grad_(true));
  }
  CpuOptimizerOptions o = adamw_options();
  o.tile_elems = 100;
  CpuOptimizer opt(params, o, pool);
  for (int s = 0; s < 3; ++s) {
    std::vector<at::Tensor> grads = make_grads(s);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = grads[i].to(at::kCUDA, at::kBFloat16);
    }
    opt.step();
    const at::Tensor on_gpu = flat(params);  // ordered after end_step on the current stream
    EXPECT_TRUE(at::equal(on_gpu.cpu().to(at::kBFloat16), opt.master_weights().to(at::kBFloat16)));
  }
  // A flat device output for an all-gather.
  at::Tensor out = at::zeros({opt.padded_numel()}, at::TensorOptions(at::kCUDA).dtype(at::kHalf));
  opt.set_output(out);
  opt.step();
  EXPECT_TRUE(at::equal(out.narrow(0, 0, opt.numel()).cpu(), opt.master_weights().to(at::kHalf)));
}

}  // namespace
}  // namespace dtrain::offload
