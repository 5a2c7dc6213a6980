// CpuOptimizer against torch.optim in float64 (tests/reference/cpu_optim_reference.py, run
// once for the whole file): every rule, gradients of fp32/bf16/fp16, odd sizes (1, 7, 33,
// 1000 and 1000003 elements) so vector tails, thread parts, tiles and chunks all end at odd
// places, with each kernel (scalar, AVX2, AVX-512 where the CPU has it).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"
#include "test_util.h"

namespace dtrain::offload {
namespace {

using json = nlohmann::json;
using testing_util::rel_error;

// ---- inputs shared with the reference ---------------------------------------------------

// One set of start values and per-step gradients (float32 values exactly representable in
// the parameter and gradient dtypes, so both sides start from the same numbers).
struct InputSet {
  std::vector<int64_t> sizes;
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType grad_dtype = at::kFloat;
  at::Tensor params;              // flat float32
  std::vector<at::Tensor> grads;  // per step, flat float32
};

const std::vector<int64_t> kSmall = {1, 7, 33, 1000};
const std::vector<int64_t> kLarge = {1000003};
constexpr double kGradScale[] = {1.0, 2.0, 0.5, 0.1};

InputSet make_input(const std::vector<int64_t>& sizes, at::ScalarType param_dtype,
                    at::ScalarType grad_dtype, int steps, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  InputSet in;
  in.sizes = sizes;
  in.param_dtype = param_dtype;
  in.grad_dtype = grad_dtype;
  const int64_t n = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  in.params = at::randn({n}, gen, at::kFloat).to(param_dtype).to(at::kFloat);
  for (int s = 0; s < steps; ++s) {
    in.grads.push_back(
        (at::randn({n}, gen, at::kFloat) * kGradScale[s]).to(grad_dtype).to(at::kFloat));
  }
  return in;
}

struct RuleCase {
  std::string id;
  std::string optimizer;
  json kwargs;  // CpuOptimizerOptions fields, all given explicitly (torch's defaults differ)
};

const std::vector<RuleCase>& rule_cases() {
  static const std::vector<RuleCase> cases = {
      {"adam", "adam", {{"lr", 0.01}, {"weight_decay", 0.0}, {"eps", 1e-8}}},
      {"adam_l2_amsgrad",
       "adam",
       {{"lr", 0.01}, {"weight_decay", 0.1}, {"eps", 1e-8}, {"amsgrad", true}}},
      {"adamw",
       "adamw",
       {{"lr", 0.01}, {"weight_decay", 0.1}, {"eps", 1e-8}, {"beta1", 0.8}, {"beta2", 0.99}}},
      {"adamw_amsgrad",
       "adamw",
       {{"lr", 0.01}, {"weight_decay", 0.05}, {"eps", 1e-6}, {"amsgrad", true}}},
      {"adagrad",
       "adagrad",
       {{"lr", 0.1},
        {"lr_decay", 0.01},
        {"weight_decay", 0.05},
        {"initial_accumulator_value", 0.1},
        {"eps", 1e-10}}},
      {"sgd", "sgd", {{"lr", 0.1}, {"weight_decay", 0.01}}},
      {"sgd_momentum",
       "sgd",
       {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.1}, {"weight_decay", 0.01}}},
      {"sgd_nesterov",
       "sgd",
       {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.0}}},
  };
  return cases;
}

const RuleCase& rule(const std::string& id) {
  for (const RuleCase& r : rule_cases()) {
    if (r.id == id) return r;
  }
  throw std::runtime_error("no rule " + id);
}

CpuOptimizerOptions options_for(const RuleCase& r) {
  CpuOptimizerOptions o;
  o.name = r.optimizer;
  const json& k = r.kwargs;
  o.lr = k.value("lr", o.lr);
  o.weight_decay = k.value("weight_decay", o.weight_decay);
  o.momentum = k.value("momentum", o.momentum);
  o.dampening = k.value("dampening", o.dampening);
  o.nesterov = k.value("nesterov", o.nesterov);
  o.beta1 = k.value("beta1", o.beta1);
  o.beta2 = k.value("beta2", o.beta2);
  o.eps = k.value("eps", o.eps);
  o.amsgrad = k.value("amsgrad", o.amsgrad);
  o.lr_decay = k.value("lr_decay", o.lr_decay);
  o.initial_accumulator_value = k.value("initial_accumulator_value", o.initial_accumulator_value);
  return o;
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32";
}

// A reference case: a rule on an input set. Its id names both.
struct RefCase {
  std::string id;
  const RuleCase* rule;
  std::string input;
};

// Everything the reference computed, by case id: [params, state arrays...] (float64).
struct Reference {
  std::map<std::string, InputSet> inputs;
  std::map<std::string, RefCase> cases;
  std::map<std::string, std::vector<std::pair<std::string, at::Tensor>>> results;
};

// std::filesystem is avoided: libtorch.so exports an incompatible copy of some of it.
void write_f32(const std::string& path, const at::Tensor& t) {
  at::Tensor c = t.to(at::kFloat).contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(c.data_ptr()), c.numel() * 4);
}

at::Tensor read_f64(const std::string& path, int64_t count) {
  at::Tensor t = at::empty({count}, at::kDouble);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.data_ptr()), count * 8);
  EXPECT_EQ(in.gcount(), count * 8) << path;
  return t;
}

Reference build_reference() {
  Reference ref;
  uint64_t seed = 1000;
  for (at::ScalarType g : {at::kFloat, at::kBFloat16, at::kHalf}) {
    ref.inputs["small_" + std::string(dtype_name(g))] =
        make_input(kSmall, at::kFloat, g, 4, ++seed);
  }
  ref.inputs["large_bf16"] = make_input(kLarge, at::kFloat, at::kBFloat16, 3, ++seed);
  ref.inputs["large_fp16"] = make_input(kLarge, at::kFloat, at::kHalf, 3, ++seed);
  ref.inputs["large_fp32"] = make_input(kLarge, at::kFloat, at::kFloat, 3, ++seed);
  // Parameters held in bf16 / fp16 (the model's copy under AMP), fp32 gradients.
  ref.inputs["model_bf16"] = make_input(kSmall, at::kBFloat16, at::kFloat, 4, ++seed);
  ref.inputs["model_fp16"] = make_input(kSmall, at::kHalf, at::kFloat, 4, ++seed);

  auto add = [&](const std::string& rule_id, const std::string& input) {
    const std::string id = rule_id + "/" + input;
    ref.cases[id] = {id, &rule(rule_id), input};
  };
  for (const RuleCase& r : rule_cases()) {
    for (const char* g : {"fp32", "bf16", "fp16"}) add(r.id, std::string("small_") + g);
  }
  add("adamw_amsgrad", "large_bf16");
  add("adagrad", "large_fp16");
  add("sgd_nesterov", "large_fp32");
  add("adamw", "model_bf16");
  add("sgd_momentum", "model_fp16");

  char dir_template[] = "/tmp/dtrain_cpu_optim_ref_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  std::vector<std::string> files;  // removed at the end
  auto file = [&](const std::string& name) {
    files.push_back(dir + "/" + name);
    return files.back();
  };
  json request = {{"cases", json::array()}};
  for (const auto& [name, in] : ref.inputs) {
    write_f32(file(name + ".params"), in.params);
    for (size_t s = 0; s < in.grads.size(); ++s) {
      write_f32(file(name + ".grad" + std::to_string(s)), in.grads[s]);
    }
  }
  int k = 0;
  std::map<std::string, std::string> out_files;
  for (const auto& [id, c] : ref.cases) {
    const InputSet& in = ref.inputs.at(c.input);
    json grads = json::array();
    for (size_t s = 0; s < in.grads.size(); ++s)
      grads.push_back(c.input + ".grad" + std::to_string(s));
    out_files[id] = "out" + std::to_string(k++);
    file(out_files[id]);
    request["cases"].push_back({{"id", id},
                                {"optimizer", c.rule->optimizer},
                                {"kwargs", c.rule->kwargs},
                                {"sizes", in.sizes},
                                {"params", c.input + ".params"},
                                {"grads", grads},
                                {"out", out_files[id]}});
  }
  std::ofstream(file("request.json")) << request.dump();
  const std::string out = testing_util::run_python("tests/reference/cpu_optim_reference.py", {dir});
  if (!out.empty()) {
    const json names = json::parse(out);
    for (const auto& [id, c] : ref.cases) {
      const int64_t n = ref.inputs.at(c.input).params.numel();
      const auto arrays = names.at(id).get<std::vector<std::string>>();
      at::Tensor all = read_f64(dir + "/" + out_files[id], n * static_cast<int64_t>(arrays.size()));
      for (size_t a = 0; a < arrays.size(); ++a) {
        ref.results[id].emplace_back(arrays[a], all.narrow(0, a * n, n));
      }
    }
  }
  for (const std::string& f : files) std::remove(f.c_str());
  rmdir(dir.c_str());
  return ref;
}

const Reference& reference() {
  static const Reference ref = build_reference();
  return ref;
}

// ---- running dtrain's optimizer ---------------------------------------------------------

// Parameters of the input set (requiring grad, in its parameter dtype) with the values.
std::vector<at::Tensor> make_params(const InputSet& in) {
  std::vector<at::Tensor> params;
  int64_t off = 0;
  for (int64_t n : in.sizes) {
    params.push_back(in.params.narrow(0, off, n).to(in.param_dtype).clone().requires_grad_(true));
    off += n;
  }
  return params;
}

void set_grads(std::vector<at::Tensor>& params, const InputSet& in, const at::Tensor& flat) {
  int64_t off = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = in.sizes[i];
    params[i].mutable_grad() = flat.narrow(0, off, n).to(in.grad_dtype).clone();
    off += n;
  }
}

// The named state array of the optimizer's shard (chunks joined, padding cut).
at::Tensor state_array(const CpuOptimizer& opt, const std::string& name) {
  std::vector<at::Tensor> chunks;
  for (const auto& [key, t] : opt.state()) {
    if (key.rfind(name + ".", 0) == 0) chunks.push_back(t);
  }
  at::Tensor all = at::cat(chunks);
  const ShardRange shard = opt.shard();
  const int64_t real = std::max<int64_t>(0, std::min(shard.end, opt.numel()) - shard.begin);
  return all.narrow(0, 0, real);
}

at::Tensor flat_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& p : params) parts.push_back(p.detach().reshape({-1}).to(at::kDouble));
  return at::cat(parts);
}

// dtrain's results against the reference's: master weights, the parameters written back,
// and every state array, each to float32 accuracy (1e-6 relative, L2), and no element off
// by more than 2e-6 of the array's largest magnitude.
void expect_matches(const CpuOptimizer& opt, const std::vector<at::Tensor>& params,
                    const std::vector<std::pair<std::string, at::Tensor>>& want,
                    at::ScalarType param_dtype) {
  ASSERT_FALSE(want.empty()) << "no reference values (see the Python failure above)";
  auto check = [](const std::string& what, const at::Tensor& got, const at::Tensor& exp) {
    ASSERT_EQ(got.numel(), exp.numel()) << what;
    EXPECT_LT(rel_error(got, exp), 1e-6) << what;
    const double scale = exp.abs().max().item<double>();
    const double worst = (got.to(at::kDouble) - exp).abs().max().item<double>();
    EXPECT_LE(worst, 2e-6 * scale) << what << ": largest element error";
  };
  const at::Tensor master = opt.master_weights();
  check("master weights", master, want[0].second);
  if (param_dtype == at::kFloat) {
    EXPECT_TRUE(at::equal(flat_params(params).to(at::kFloat), master))
        << "parameters are the master weights";
  } else {
    // The model's copy is the master rounded to its dtype, exactly as at::Tensor::to rounds.
    EXPECT_TRUE(at::equal(flat_params(params).to(param_dtype), master.to(param_dtype)));
  }
  for (size_t a = 1; a < want.size(); ++a) {
    check(want[a].first, state_array(opt, want[a].first), want[a].second);
  }
}

class OffloadCpuOptimTorch : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) {
      GTEST_SKIP() << to_string(GetParam()) << " kernel: not supported by this CPU";
    }
  }
  CpuOptimizerOptions options(const RefCase& c, int64_t tile, int64_t chunk) const {
    CpuOptimizerOptions o = options_for(*c.rule);
    o.isa = to_string(GetParam());
    o.threads = 2;
    o.tile_elems = tile;
    o.chunk_elems = chunk;
    return o;
  }
  // step() per step from the parameters' .grad.
  void run_case(const RefCase& c, int64_t tile, int64_t chunk) {
    SCOPED_TRACE(c.id);
    const InputSet& in = reference().inputs.at(c.input);
    PinnedPool pool;
    std::vector<at::Tensor> params = make_params(in);
    CpuOptimizer opt(params, options(c, tile, chunk), pool);
    EXPECT_EQ(opt.isa(), GetParam());
    for (const at::Tensor& g : in.grads) {
      set_grads(params, in, g);
      opt.step();
    }
    EXPECT_EQ(opt.step_count(), static_cast<int64_t>(in.grads.size()));
    expect_matches(opt, params, reference().results.at(c.id), in.param_dtype);
  }
};

TEST_P(OffloadCpuOptimTorch, EveryRuleAndGradDtype) {
  for (const auto& [id, c] : reference().cases) {
    if (c.input.rfind("small_", 0) == 0) run_case(c, /*tile=*/100, /*chunk=*/256);
  }
}

TEST_P(OffloadCpuOptimTorch, LargeOddSize) {
  for (const auto& [id, c] : reference().cases) {
    if (c.input.rfind("large_", 0) == 0) run_case(c, /*tile=*/100003, /*chunk=*/1 << 18);
  }
}

TEST_P(OffloadCpuOptimTorch, WritesTheModelCopyInItsDtype) {
  for (const auto& [id, c] : reference().cases) {
    if (c.input.rfind("model_", 0) == 0) run_case(c, /*tile=*/64, /*chunk=*/128);
  }
}

// step_range() over uneven pieces in a scrambled order, gradients from one flat buffer, with
// the gradients pre-scaled by 1024 and grad_multiplier 1/1024 (exact in binary): the same
// result as step().
TEST_P(OffloadCpuOptimTorch, StepRangeInPiecesWithMultiplier) {
  const RefCase& c = reference().cases.at("adamw_amsgrad/small_bf16");
  const InputSet& in = reference().inputs.at(c.input);
  PinnedPool pool;
  std::vector<at::Tensor> params = make_params(in);
  CpuOptimizer opt(params, options(c, 50, 128), pool);
  const ShardRange shard = opt.shard();
  ASSERT_EQ(shard.begin, 0);
  ASSERT_GE(shard.end, opt.numel());
  ASSERT_EQ(opt.padded_numel() % kShardAlign, 0);
  // Pieces cut inside parameters; the last one runs into the padding.
  const std::vector<int64_t> cuts = {0, 1, 5, 40, 41, 300, 777, 1041, shard.end};
  std::vector<size_t> order(cuts.size() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rng(5);
  for (const at::Tensor& g : in.grads) {
    at::Tensor flat = at::zeros({shard.end}, at::kBFloat16);
    flat.narrow(0, 0, opt.numel()).copy_(g * 1024);
    std::shuffle(order.begin(), order.end(), rng);
    opt.begin_step(1.0 / 1024);
    for (size_t k : order)
      opt.step_range(cuts[k], cuts[k + 1], flat.narrow(0, cuts[k], cuts[k + 1] - cuts[k]));
    opt.end_step();
  }
  expect_matches(opt, params, reference().results.at(c.id), at::kFloat);
}

INSTANTIATE_TEST_SUITE_P(Kernels, OffloadCpuOptimTorch,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(to_string(info.param));
                         });

}  // namespace
}  // namespace dtrain::offload
