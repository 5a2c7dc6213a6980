// CpuOptimizer: options, flat layout, construction and the step protocol.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "cpu_optimizer_impl.h"
#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == to_string(isa)) return isa;
  }
  throw Error("CPU optimizer: unknown isa '" + name + "'; use auto, scalar, avx2 or avx512");
}

}  // namespace

ElemType elem_type_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return ElemType::kFloat32;
    case at::kBFloat16:
      return ElemType::kBFloat16;
    case at::kHalf:
      return ElemType::kFloat16;
    default:
      return ElemType::kNone;
  }
}

int elem_size(ElemType type) {
  return type == ElemType::kNone ? 0 : (type == ElemType::kFloat32 ? 4 : 2);
}

void validate(const CpuOptimizerOptions& o) {
  validate_rule(o, "CPU optimizer");
  DTRAIN_CHECK(o.shard_count >= 1, "CPU optimizer: shard_count = ", o.shard_count,
               " must be >= 1 (the data-parallel world size)");
  DTRAIN_CHECK(o.shard_rank >= 0 && o.shard_rank < o.shard_count,
               "CPU optimizer: shard_rank = ", o.shard_rank,
               " must be in [0, shard_count = ", o.shard_count, ")");
  DTRAIN_CHECK(o.threads >= 0, "CPU optimizer: threads = ", o.threads,
               " must be >= 0 (0: OMP_NUM_THREADS or all cores)");
  parse_isa(o.isa);
  DTRAIN_CHECK(o.tile_elems >= 1, "CPU optimizer: tile_elems = ", o.tile_elems, " must be >= 1");
  DTRAIN_CHECK(o.chunk_elems >= kShardAlign && (o.chunk_elems & (o.chunk_elems - 1)) == 0,
               "CPU optimizer: chunk_elems = ", o.chunk_elems,
               " must be a power of two >= ", kShardAlign);
}

int64_t padded_numel(int64_t numel, int shard_count) {
  DTRAIN_CHECK(numel >= 0 && shard_count >= 1, "padded_numel: numel = ", numel,
               ", shard_count = ", shard_count, " (need numel >= 0, shard_count >= 1)");
  const int64_t unit = kShardAlign * shard_count;
  return std::max<int64_t>(1, (numel + unit - 1) / unit) * unit;
}

ShardRange shard_range(int64_t numel, int shard_rank, int shard_count) {
  DTRAIN_CHECK(shard_rank >= 0 && shard_rank < shard_count,
               "shard_range: shard_rank = ", shard_rank, " must be in [0, ", shard_count, ")");
  const int64_t size = padded_numel(numel, shard_count) / shard_count;
  return {shard_rank * size, (shard_rank + 1) * size};
}

UpdateConfig make_update_config(const CpuOptimizerOptions& o, int64_t t, double grad_multiplier) {
  DTRAIN_CHECK(t >= 1, "make_update_config: step t = ", t, " must be >= 1");
  UpdateConfig c;
  c.grad_multiplier = static_cast<float>(grad_multiplier);
  const double wd = o.weight_decay;
  const RuleTraits& traits = rule_traits(o.name, "CPU optimizer");
  if (traits.adam_family) {
    const bool decoupled = traits.decoupled_weight_decay;
    c.kind = OptimKind::kAdam;
    c.l2_weight_decay = decoupled ? 0.0f : static_cast<float>(wd);
    c.param_decay = decoupled ? static_cast<float>(1.0 - o.lr * wd) : 1.0f;
    c.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
    c.beta2 = static_cast<float>(o.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
    c.step_size = static_cast<float>(o.lr / bc1);
    c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
    c.eps = static_cast<float>(o.eps);
    c.amsgrad = o.amsgrad;
  } else if (traits.rule == Rule::kAdagrad) {
    c.kind = OptimKind::kAdagrad;
    c.l2_weight_decay = static_cast<float>(wd);
    c.lr = static_cast<float>(o.lr / (1.0 + static_cast<double>(t - 1) * o.lr_decay));
    c.eps = static_cast<float>(o.eps);
  } else {
    c.kind = OptimKind::kSgd;
    c.l2_weight_decay = static_cast<float>(wd);
    c.lr = static_cast<float>(o.lr);
    c.momentum = o.momentum != 0.0;
    c.momentum_factor = static_cast<float>(o.momentum);
    c.dampening_keep = static_cast<float>(1.0 - o.dampening);
    c.first_step = t == 1;
    c.nesterov = o.nesterov;
  }
  return c;
}

// ---- construction ---------------------------------------------------------------------------

CpuOptimizer::Impl::Impl(std::vector<at::Tensor> params_in, CpuOptimizerOptions options_in,
                         PinnedPool& pool_in)
    : params(std::move(params_in)),
      options(std::move(options_in)),
      pool(pool_in),
      copy_back(pool_in, options.tile_elems) {
  validate(options);
  const std::string& name = options.name;
  DTRAIN_CHECK(!params.empty(), "CPU optimizer ", name,
               ": the parameter list is empty; pass the model's parameters");
  std::unordered_set<const void*> seen;
  std::optional<c10::Device> device;
  offsets.push_back(0);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    DTRAIN_CHECK(p.defined(), "CPU optimizer: parameter ", i, " is an undefined tensor");
    DTRAIN_CHECK(p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()),
                 "CPU optimizer: parameter ", i, " must be a dense floating-point tensor, got ",
                 p.toString());
    DTRAIN_CHECK(p.is_contiguous(), "CPU optimizer: parameter ", i, " (sizes ", p.sizes(),
                 ") is not contiguous; make it contiguous before building the optimizer");
    DTRAIN_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "CPU optimizer: parameter ", i,
                 " is listed twice; pass each parameter once");
    if (!p.is_cpu()) {
      DTRAIN_CHECK(!device || *device == p.device(), "CPU optimizer: parameters on ", device->str(),
                   " and ", p.device().str(), " (parameter ", i,
                   "); one optimizer copies back to one device");
      device = p.device();
    }
    offsets.push_back(offsets.back() + p.numel());
  }
  numel = offsets.back();
  DTRAIN_CHECK(numel > 0, "CPU optimizer ", name,
               ": the parameters have no elements; pass the model's parameters");
  padded = offload::padded_numel(numel, options.shard_count);
  shard = shard_range(numel, options.shard_rank, options.shard_count);
  real_end = std::min(shard.end, numel);
  isa = parse_isa(options.isa);
  kernel = update_kernel(isa);
  team =
      std::make_unique<ThreadPool>(options.threads > 0 ? options.threads : default_thread_count());
  while ((int64_t{1} << chunk_shift) < options.chunk_elems) ++chunk_shift;
  lr = options.lr;
  allocate_arrays();
  set_default_targets();
}

int64_t CpuOptimizer::Impl::chunk_count() const {
  return (shard.size() + options.chunk_elems - 1) >> chunk_shift;
}

int64_t CpuOptimizer::Impl::chunk_size(int64_t chunk) const {
  return std::min(options.chunk_elems, shard.size() - (chunk << chunk_shift));
}

void CpuOptimizer::Impl::allocate_arrays() {
  array_names = {"master"};
  for (std::string& moment : moment_names(options)) array_names.push_back(std::move(moment));
  for (const std::string& array : array_names) {
    std::vector<at::Tensor> chunks;
    std::vector<float*> ptrs;
    const double init = array == "sum" ? options.initial_accumulator_value : 0.0;
    for (int64_t c = 0; c < chunk_count(); ++c) {
      // Never a device copy's source or target (the new weights go out through copy_back's
      // pinned tiles), so ordinary memory: no page-locking of the largest host arrays.
      at::Tensor t = pool.allocate_pageable(chunk_size(c), at::kFloat);
      host_bytes += t.nbytes();
      t.fill_(init);
      ptrs.push_back(t.data_ptr<float>());
      chunks.push_back(std::move(t));
    }
    arrays.push_back(std::move(chunks));
    array_ptrs.push_back(std::move(ptrs));
  }
}

void CpuOptimizer::Impl::set_default_targets() {
  std::vector<at::Tensor> flats;
  std::vector<int64_t> starts;
  if (output.defined()) {
    flats.push_back(output);
    starts.push_back(output_start);
  } else {
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].numel() == 0) continue;
      flats.push_back(params[i].detach().view({-1}));
      starts.push_back(offsets[i]);
    }
  }
  if (!options.write_back) flats.clear(), starts.clear();
  copy_back.set_targets(flats, starts, shard.begin, real_end);
}

CpuOptimizer::CpuOptimizer(std::vector<at::Tensor> params, CpuOptimizerOptions options,
                           PinnedPool& pool)
    : impl_(std::make_unique<Impl>(std::move(params), std::move(options), pool)) {
  load_master_from_params();
}

CpuOptimizer::~CpuOptimizer() = default;

const std::vector<at::Tensor>& CpuOptimizer::params() const { return impl_->params; }
const CpuOptimizerOptions& CpuOptimizer::options() const { return impl_->options; }
int64_t CpuOptimizer::numel() const { return impl_->numel; }
int64_t CpuOptimizer::padded_numel() const { return impl_->padded; }
ShardRange CpuOptimizer::shard() const { return impl_->shard; }
Isa CpuOptimizer::isa() const { return impl_->isa; }
int CpuOptimizer::threads() const { return impl_->team->size(); }
int64_t CpuOptimizer::step_count() const { return impl_->step; }
int64_t CpuOptimizer::host_bytes() const {
  return impl_->host_bytes + impl_->copy_back.staging_bytes();
}
double CpuOptimizer::lr() const { return impl_->lr; }

int64_t CpuOptimizer::param_offset(size_t index) const {
  DTRAIN_CHECK(index < impl_->params.size(), "CPU optimizer: parameter index ", index,
               " out of range (", impl_->params.size(), " parameters)");
  return impl_->offsets[index];
}

void CpuOptimizer::set_lr(double lr) {
  DTRAIN_CHECK(std::isfinite(lr) && lr >= 0.0, "CPU optimizer: lr = ", lr,
               " must be a finite number >= 0");
  impl_->lr = lr;
}

// ---- the step protocol ----------------------------------------------------------------------

void CpuOptimizer::begin_step(double grad_multiplier) {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.open, "CPU optimizer: begin_step() while step ", s.step,
               " is open; call end_step() first");
  DTRAIN_CHECK(std::isfinite(grad_multiplier), "CPU optimizer: grad_multiplier = ", grad_multiplier,
               " must be finite (skip the step on inf/NaN gradients instead)");
  CpuOptimizerOptions rule = s.options;
  rule.lr = s.lr;
  s.config = make_update_config(rule, s.step + 1, grad_multiplier);
  s.step += 1;
  s.open = true;
  s.covered.clear();
}

void CpuOptimizer::step_range(int64_t begin, int64_t end, const at::Tensor& grads) {
  Impl& s = *impl_;
  DTRAIN_CHECK(s.open, "CPU optimizer: step_range() without an open step; call begin_step()");
  DTRAIN_CHECK(s.shard.begin <= begin && begin < end && end <= s.shard.end,
               "CPU optimizer: step_range [", begin, ", ", end,
               ") is not a non-empty range inside ", "this rank's shard [", s.shard.begin, ", ",
               s.shard.end, ")");
  DTRAIN_CHECK(grads.defined() && grads.numel() == end - begin, "CPU optimizer: step_range [",
               begin, ", ", end, ") needs ", end - begin, " gradient elements, got ",
               grads.defined() ? grads.numel() : 0);
  DTRAIN_CHECK(at::isFloatingType(grads.scalar_type()), "CPU optimizer: gradients of dtype ",
               grads.scalar_type(), " are not floating point");
  const int64_t hi = std::min(end, s.real_end);
  if (begin < hi) s.check_not_covered(begin, hi);
  at::Tensor g = grads;
  if (!g.is_cpu() || elem_type_of(g.scalar_type()) == ElemType::kNone || !g.is_contiguous()) {
    const auto dtype =
        elem_type_of(g.scalar_type()) == ElemType::kNone ? at::kFloat : g.scalar_type();
    g = g.to(at::kCPU, dtype).contiguous();
  }
  if (begin >= hi) return;  // padding only
  GradSeg seg{begin, end, static_cast<const char*>(g.const_data_ptr()),
              elem_type_of(g.scalar_type())};
  s.update(begin, hi, {seg});
  s.mark_covered(begin, hi);
}

void CpuOptimizer::end_step() {
  Impl& s = *impl_;
  DTRAIN_CHECK(s.open, "CPU optimizer: end_step() without an open step");
  int64_t next = s.shard.begin;
  for (const auto& [b, e] : s.covered) {
    DTRAIN_CHECK(b == next, "CPU optimizer: step ", s.step, " left elements [", next, ", ", b,
                 ") of the shard [", s.shard.begin, ", ", s.real_end,
                 ") without gradients; call step_range() for them before end_step()");
    next = e;
  }
  DTRAIN_CHECK(next >= s.real_end, "CPU optimizer: step ", s.step, " left elements [", next, ", ",
               s.real_end, ") of the shard without gradients; call step_range() for ",
               "them before end_step()");
  s.copy_back.end_step();
  s.open = false;
}

void CpuOptimizer::step(double grad_multiplier) {
  Impl& s = *impl_;
  std::vector<at::Tensor> keep_alive;
  std::vector<GradSeg> segs = s.grad_segments_from_params(keep_alive);
  begin_step(grad_multiplier);
  if (s.shard.begin < s.real_end) {
    s.update(s.shard.begin, s.real_end, segs);
    s.mark_covered(s.shard.begin, s.real_end);
  }
  end_step();
}

std::vector<GradSeg> CpuOptimizer::Impl::grad_segments_from_params(
    std::vector<at::Tensor>& keep_alive) const {
  std::vector<GradSeg> segs;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t lo = std::max(offsets[i], shard.begin);
    const int64_t hi = std::min(offsets[i + 1], real_end);
    if (lo >= hi) continue;
    at::Tensor g = params[i].grad();
    if (!g.defined()) {
      g = at::zeros({hi - lo}, at::kFloat);
    } else {
      DTRAIN_CHECK(g.numel() == params[i].numel() && at::isFloatingType(g.scalar_type()),
                   "CPU optimizer: the gradient of parameter ", i, " (", g.toString(), ", ",
                   g.numel(), " elements) does not match the parameter (", params[i].numel(),
                   " elements, floating point)");
      g = g.detach().reshape({-1}).narrow(0, lo - offsets[i], hi - lo);
      if (!g.is_cpu() || elem_type_of(g.scalar_type()) == ElemType::kNone || !g.is_contiguous()) {
        const auto dtype =
            elem_type_of(g.scalar_type()) == ElemType::kNone ? at::kFloat : g.scalar_type();
        g = g.to(at::kCPU, dtype).contiguous();
      }
    }
    segs.push_back(
        {lo, hi, static_cast<const char*>(g.const_data_ptr()), elem_type_of(g.scalar_type())});
    keep_alive.push_back(std::move(g));
  }
  return segs;
}

void CpuOptimizer::Impl::check_not_covered(int64_t lo, int64_t hi) const {
  auto it = covered.lower_bound(lo);  // first range starting at or after lo
  if (it != covered.end() && it->first < hi) {
    throw Error("CPU optimizer: step_range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                ") overlaps [" + std::to_string(it->first) + ", " + std::to_string(it->second) +
                "), already updated in step " + std::to_string(step));
  }
  if (it != covered.begin()) {
    --it;
    DTRAIN_CHECK(it->second <= lo, "CPU optimizer: step_range [", lo, ", ", hi, ") overlaps [",
                 it->first, ", ", it->second, "), already updated in step ", step);
  }
}

void CpuOptimizer::Impl::mark_covered(int64_t lo, int64_t hi) {
  // Merge with neighbours so end_step() walks few entries.
  auto next = covered.lower_bound(lo);
  if (next != covered.end() && next->first == hi) {
    hi = next->second;
    next = covered.erase(next);
  }
  if (next != covered.begin()) {
    auto prev = std::prev(next);
    if (prev->second == lo) {
      prev->second = hi;
      return;
    }
  }
  covered.emplace(lo, hi);
}

void CpuOptimizer::set_output(const at::Tensor& flat) {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.open, "CPU optimizer: set_output() while step ", s.step, " is open");
  if (flat.defined()) {
    DTRAIN_CHECK(flat.dim() == 1 && flat.is_contiguous() && at::isFloatingType(flat.scalar_type()) &&
                     (flat.numel() == s.numel || flat.numel() == s.padded || flat.numel() == s.shard.size()),
                 "CPU optimizer: set_output needs a contiguous 1-D floating-point tensor of ", s.numel, " or ",
                 s.padded, " elements (the flat space) or ", s.shard.size(), " (this rank's shard), got ",
                 flat.toString(), " with sizes ", flat.sizes());
  }
  s.output = flat.defined() ? flat.detach() : at::Tensor();
  s.output_start = flat.defined() && flat.numel() != s.numel && flat.numel() != s.padded ? s.shard.begin : 0;
  s.set_default_targets();
}

}  // namespace dtrain::offload
