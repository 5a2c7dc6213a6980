// CpuOptimizer: master weights from the parameters, and named state for checkpoints.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <set>

#include "cpu_optimizer_impl.h"
#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

std::string format_layout(const at::Tensor& layout) {
  std::string out = "[";
  for (int64_t i = 0; i < layout.numel(); ++i) {
    out += (i ? ", " : "") + std::to_string(layout[i].item<int64_t>());
  }
  return out + "]";
}

}  // namespace

void CpuOptimizer::load_master_from_params() {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.open, "CPU optimizer: load_master_from_params() while step ", s.step, " is open");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const int64_t lo = std::max(s.offsets[i], s.shard.begin);
    const int64_t hi = std::min(s.offsets[i + 1], s.real_end);
    if (lo >= hi) continue;
    at::Tensor src = s.params[i].detach().reshape({-1}).narrow(0, lo - s.offsets[i], hi - lo);
    src = src.to(at::kCPU, at::kFloat);
    // Chunk by chunk of the master array.
    for (int64_t x = lo; x < hi;) {
      const int64_t rel = x - s.shard.begin;
      const int64_t chunk = rel >> s.chunk_shift;
      const int64_t in_chunk = rel - (chunk << s.chunk_shift);
      const int64_t n = std::min(hi - x, s.chunk_size(chunk) - in_chunk);
      s.arrays[0][chunk].narrow(0, in_chunk, n).copy_(src.narrow(0, x - lo, n));
      x += n;
    }
  }
}

at::Tensor CpuOptimizer::master_weights() const {
  const Impl& s = *impl_;
  const int64_t n = std::max<int64_t>(0, s.real_end - s.shard.begin);
  at::Tensor out = at::empty({n}, at::kFloat);
  for (int64_t x = 0; x < n;) {
    const int64_t chunk = x >> s.chunk_shift;
    const int64_t m = std::min(n - x, s.chunk_size(chunk));
    out.narrow(0, x, m).copy_(s.arrays[0][chunk].narrow(0, 0, m));
    x += m;
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> CpuOptimizer::state() const {
  const Impl& s = *impl_;
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("step", at::scalar_tensor(s.step, at::kLong));
  out.emplace_back("layout", at::tensor({s.numel, s.padded, int64_t{s.options.shard_count},
                                         int64_t{s.options.shard_rank}, s.options.chunk_elems},
                                        at::kLong));
  for (size_t k = 0; k < s.arrays.size(); ++k) {
    for (size_t c = 0; c < s.arrays[k].size(); ++c) {
      out.emplace_back(s.array_names[k] + "." + std::to_string(c), s.arrays[k][c]);
    }
  }
  return out;
}

void CpuOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.open, "CPU optimizer: load_state() while step ", s.step, " is open");
  std::map<std::string, at::Tensor> expected;
  for (auto& [name, t] : this->state()) expected.emplace(name, t);
  std::map<std::string, at::Tensor> given;
  for (const auto& [name, t] : state) {
    DTRAIN_CHECK(expected.count(name), "CPU optimizer load_state: unknown entry '", name,
                 "' (this ", s.options.name, " optimizer with ", s.arrays[0].size(),
                 " chunk(s) per array has: step, layout, ",
                 s.array_names.size() > 1 ? s.array_names[1] + ".*, " : std::string(),
                 "master.*, ...)");
    DTRAIN_CHECK(given.emplace(name, t).second, "CPU optimizer load_state: entry '", name,
                 "' given twice");
    DTRAIN_CHECK(t.defined(), "CPU optimizer load_state: entry '", name, "' is undefined");
  }
  for (const auto& [name, t] : expected) {
    auto it = given.find(name);
    DTRAIN_CHECK(it != given.end(), "CPU optimizer load_state: missing entry '", name, "'");
    DTRAIN_CHECK(it->second.sizes() == t.sizes(), "CPU optimizer load_state: entry '", name,
                 "' has sizes ", it->second.sizes(), ", expected ", t.sizes());
  }
  at::Tensor layout = given.at("layout").to(at::kCPU, at::kLong);
  DTRAIN_CHECK(at::equal(layout, expected.at("layout")),
               "CPU optimizer load_state: the checkpoint's layout [numel, padded_numel, "
               "shard_count, shard_rank, chunk_elems] = ",
               format_layout(layout), " differs from ", "this optimizer's ",
               format_layout(expected.at("layout")),
               "; load it with the same parameters, data-parallel size, rank and chunk_elems");
  const int64_t step = given.at("step").to(at::kCPU, at::kLong).item<int64_t>();
  DTRAIN_CHECK(step >= 0, "CPU optimizer load_state: step = ", step, " must be >= 0");
  at::NoGradGuard no_grad;
  for (auto& [name, t] : expected) {
    if (name != "step" && name != "layout") t.copy_(given.at(name));
  }
  s.step = step;
}

}  // namespace dtrain::offload
