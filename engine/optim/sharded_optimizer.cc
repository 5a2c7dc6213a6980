#include "dtrain/engine/optim/sharded.h"

#include <algorithm>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "offload_internal.h"

namespace dtrain::engine {

ShardMode parse_shard_mode(const std::string& text) {
  if (text == "none") return ShardMode::kNone;
  if (text == "optimizer") return ShardMode::kOptimizer;
  if (text == "gradients") return ShardMode::kGradients;
  if (text == "parameters") return ShardMode::kParameters;
  throw Error("--shard=" + text + " is not one of: none, optimizer, gradients, parameters");
}

namespace {

// "blocks.0.attn.qkv.weight" -> "blocks.0.attn.qkv" (its module; "" for a top-level parameter).
std::string module_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

}  // namespace

std::vector<size_t> unit_starts_of(const std::vector<std::string>& names, const std::vector<std::string>& prefixes,
                                   const std::vector<bool>& tensor_parallel) {
  DTRAIN_CHECK(!prefixes.empty(), "--shard=parameters needs the model's units (--shard_units, or "
               "TrainerOptions::shard_unit_starts: where each unit's parameters begin); this model gives none. "
               "Name them, or use --shard=gradients");
  DTRAIN_CHECK(!names.empty(), "--shard=parameters: the model has no trainable parameters");
  std::vector<size_t> starts;
  std::vector<bool> used(prefixes.size(), false);
  for (size_t j = 0; j < names.size(); ++j) {
    bool begins = false;
    for (size_t i = 0; i < prefixes.size(); ++i) {
      if (!used[i] && names[j].compare(0, prefixes[i].size(), prefixes[i]) == 0) used[i] = begins = true;
    }
    if (!begins) continue;
    const std::string layer = module_of(names[j]);
    DTRAIN_CHECK(j == 0 || layer.empty() || module_of(names[j - 1]) != layer, "--shard=parameters: unit ",
                 starts.size(), " would begin at '", names[j], "', inside the ",
                 j < tensor_parallel.size() && tensor_parallel[j] ? "tensor-parallel " : "", "layer '", layer,
                 "' (its '", names[j - 1], "' falls in the unit before): a unit must hold whole layers. End the "
                 "prefix at a layer, e.g. '", layer, ".'");
    starts.push_back(j);
  }
  for (size_t i = 0; i < prefixes.size(); ++i) {
    DTRAIN_CHECK(used[i], "--shard=parameters: no parameter's name begins with the unit prefix '", prefixes[i],
                 "' (the first is '", names.front(), "', the last '", names.back(), "')");
  }
  DTRAIN_CHECK(starts.front() == 0, "--shard=parameters: the first parameter, '", names.front(),
               "', begins no unit (the units must name where every unit begins; add a prefix of it)");
  return starts;
}

struct ShardedOptimizer::Impl {
  dist::Communicator* dp = nullptr;
  at::Tensor flat;        // the parameters' storage: padded_numel elements
  at::Tensor own_padded;  // this rank's slice of flat, padding included (the all-gather's input)
  at::Tensor own;         // its real elements [lo, hi)
  at::Tensor master;      // fp32 master of own: own itself for fp32 parameters
  at::Tensor grad_shard;  // gradients of [lo, hi), fp32
  int64_t numel = 0, lo = 0, hi = 0;
  std::vector<int64_t> offsets;  // flat offset of each parameter, and numel at the end
  // The pieces of the parameters inside [lo, hi): parameter j, its elements [from, from + n)
  // into grad_shard at `to`; dst views of grad_shard made once.
  struct Piece {
    size_t param;
    int64_t from, n;
  };
  std::vector<Piece> pieces;
  std::vector<at::Tensor> piece_dst;
  // attach(): the reducer's storage of [lo, hi) in another dtype than grad_shard (bf16/fp16
  // weights, fp32 master), copied into grad_shard at each step instead of the pieces.
  at::Tensor grad_source;
  std::unique_ptr<Optimizer> inner;  // make_optimizer() over {master}; null when offloaded
  // Offloaded (the ZeRO-Offload layout): the CPU optimizer over {own} (master and state in the
  // pool, writing the new weights back into own), and the gradient range's host staging.
  std::unique_ptr<offload::PinnedPool> pool;
  std::unique_ptr<offload::CpuOptimizer> cpu;
  at::Tensor host_grad;
  // A rank whose range holds no real element (a model smaller than the padding) updates a
  // one-element stand-in with a zero gradient, so its step count stays the group's.
  bool empty = false;
  // ZeRO-3: `own` is a buffer of its own (flat and own_padded stay undefined); unit k holds
  // parameters [unit_first[k], unit_first[k + 1]) in unit_buf[k], materialized while gathered.
  bool zero3 = false;
  std::vector<size_t> unit_first;
  std::vector<at::Tensor> unit_buf;
  std::vector<bool> gathered;

  // init()'s parts. The storage: the parameters become views of flat (stages 1 and 2), or
  // (ZeRO-3) this rank's range is copied into own and each unit's parameters become views of a
  // buffer that holds bytes only while the unit is gathered.
  void flat_storage(std::vector<at::Tensor>& params, int rank, int64_t padded);
  void unit_storage(std::vector<at::Tensor>& params, const std::vector<size_t>& unit_starts);
  // The range's fp32 master and state on the host, updated by the CPU optimizer there.
  void offloaded_state(const OptimizerOptions& options, const OffloadOptions& offload, const at::Tensor& first);
};

void ShardedOptimizer::Impl::flat_storage(std::vector<at::Tensor>& params, int rank, int64_t padded) {
  const int64_t per_rank = padded / dp->size();
  flat = at::zeros({padded}, params.front().options().requires_grad(false));
  for (size_t j = 0; j < params.size(); ++j) {
    at::Tensor view = flat.narrow(0, offsets[j], params[j].numel()).view(params[j].sizes());
    view.copy_(params[j].detach());
    params[j].set_data(view);
  }
  own_padded = flat.narrow(0, rank * per_rank, per_rank);
  own = flat.narrow(0, lo, hi - lo);
}

void ShardedOptimizer::Impl::unit_storage(std::vector<at::Tensor>& params, const std::vector<size_t>& unit_starts) {
  zero3 = true;
  unit_first = unit_starts;
  unit_first.push_back(params.size());
  const at::TensorOptions options = params.front().options().requires_grad(false);
  own = at::empty({hi - lo}, options);
  for (size_t j = 0; j < params.size(); ++j) {
    const int64_t a = std::max(offsets[j], lo), b = std::min(offsets[j + 1], hi);
    if (a < b) own.narrow(0, a - lo, b - a).copy_(params[j].detach().reshape({-1}).narrow(0, a - offsets[j], b - a));
  }
  for (size_t k = 0; k + 1 < unit_first.size(); ++k) {
    const int64_t base = offsets[unit_first[k]];
    at::Tensor buf = at::empty({offsets[unit_first[k + 1]] - base}, options);
    for (size_t j = unit_first[k]; j < unit_first[k + 1]; ++j) {
      params[j].set_data(buf.narrow(0, offsets[j] - base, params[j].numel()).view(params[j].sizes()));
    }
    release_unit_storage(buf);
    unit_buf.push_back(buf);
    gathered.push_back(false);
  }
}

void ShardedOptimizer::Impl::offloaded_state(const OptimizerOptions& options, const OffloadOptions& offload,
                                             const at::Tensor& first) {
  offload::PinnedPoolOptions po;
  po.pin = !first.device().is_cpu();  // page-locked only when there is a device to copy to
  po.limit_bytes = offload.host_mem_limit_gb > 0 ? offload::host_limit_bytes_from_gb(offload.host_mem_limit_gb) : 0;
  pool = std::make_unique<offload::PinnedPool>(po);
  offload::CpuOptimizerOptions c = offload_detail::cpu_options(options, 0, 1, offload.threads);
  c.write_back = !empty;  // an empty range updates a stand-in whose result goes nowhere
  const int64_t n = empty ? 1 : hi - lo;
  cpu = std::make_unique<offload::CpuOptimizer>(std::vector<at::Tensor>{empty ? at::zeros({1}, own.options()) : own}, c,
                                                *pool);
  host_grad = pool->allocate(n, at::kFloat);
  host_grad.zero_();
  grad_shard = at::zeros({n}, own.options().dtype(at::kFloat));
}

// Both on the tensor's device, whatever the calling thread's current device is: the CUDA
// caching allocator allocates on the current device (a thread that set none: GPU 0), and a
// free may record events on the streams that used the block.
void release_unit_storage(const at::Tensor& t) {
  c10::OptionalDeviceGuard guard;
  if (!t.device().is_cpu()) guard.reset_device(t.device());
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void materialize_unit_storage(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  DTRAIN_CHECK(impl->allocator() != nullptr, "--shard=parameters: the buffer on ", t.device(), " has no allocator");
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  c10::OptionalDeviceGuard guard;
  if (!t.device().is_cpu()) guard.reset_device(t.device());
  at::DataPtr data = impl->allocator()->allocate(bytes);
  DTRAIN_CHECK(bytes == 0 || data.device() == t.device(), "--shard=parameters: the allocator of the unit buffer on ",
               t.device(), " allocated on ", data.device());
  impl->set_data_ptr_noswap(std::move(data));
  impl->set_nbytes(bytes);
}

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                   dist::Communicator& dp)
    : ShardedOptimizer(std::move(params), options, dp, {}) {}

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                   dist::Communicator& dp, std::vector<size_t> unit_starts)
    : options_(options), params_(std::move(params)), impl_(std::make_unique<Impl>()) {
  impl_->dp = &dp;
  init(std::move(unit_starts), nullptr);
}

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                   dist::Communicator& dp, std::vector<size_t> unit_starts,
                                   const OffloadOptions& offload)
    : options_(options), params_(std::move(params)), impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK(!unit_starts.empty(), "ShardedOptimizer: the offloaded layout is stage 3's (give the units); "
               "stages 1 and 2 offload with OffloadedOptimizer (make_offload_optimizer)");
  impl_->dp = &dp;
  init(std::move(unit_starts), &offload);
}

void ShardedOptimizer::init(std::vector<size_t> unit_starts, const OffloadOptions* offload) {
  dist::Communicator& dp = *impl_->dp;
  validate(options_);
  check_one_flat_space(params_, unit_starts.empty() ? "--shard=optimizer" : "--shard=parameters");
  for (size_t k = 0; k < unit_starts.size(); ++k) {
    DTRAIN_CHECK(unit_starts[k] < params_.size() && (k == 0 ? unit_starts[k] == 0 : unit_starts[k] > unit_starts[k - 1]),
                 "--shard=parameters: the units must start at parameter 0 and ascend below ", params_.size(),
                 "; unit ", k, " starts at ", unit_starts[k]);
  }
  const at::Tensor& first = params_.front();
  DTRAIN_CHECK(at::isFloatingType(first.scalar_type()), "--shard=optimizer: the parameters are ",
               first.scalar_type(), ", not floating point");
  Impl& s = *impl_;
  s.offsets.push_back(0);
  for (const at::Tensor& p : params_) s.offsets.push_back(s.offsets.back() + p.numel());
  s.numel = s.offsets.back();
  const int ranks = dp.size();
  const int64_t padded = offload::padded_numel(s.numel, ranks);
  const FlatRange mine = shard_range(s.numel, ranks, dp.rank());
  s.lo = mine.begin;
  s.hi = mine.end;
  at::NoGradGuard no_grad;
  const int64_t per_rank = padded / ranks;
  if (unit_starts.empty()) {
    s.flat_storage(params_, dp.rank(), padded);
  } else {
    s.unit_storage(params_, unit_starts);
  }
  s.empty = s.hi == s.lo;
  if (offload) {
    // The ZeRO-Offload layout: the range's fp32 master and state on the host, updated there by
    // the CPU optimizer, which writes the new weights back into own.
    s.offloaded_state(options_, *offload, first);
  } else {
    // fp32 master weights for fp16/bf16 parameters; fp32 and fp64 ones are their own master.
    const at::ScalarType dtype = first.scalar_type();
    const at::ScalarType master_dtype = dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
    if (s.empty) {
      s.master = at::zeros({1}, s.own.options().dtype(master_dtype));
    } else {
      s.master = master_dtype == dtype ? s.own : s.own.to(master_dtype);
    }
    s.grad_shard = at::zeros({s.master.numel()}, s.own.options().dtype(master_dtype));
  }
  for (size_t j = 0; j < params_.size(); ++j) {
    const int64_t a = std::max(s.offsets[j], s.lo), b = std::min(s.offsets[j + 1], s.hi);
    if (a >= b) continue;
    s.pieces.push_back({j, a - s.offsets[j], b - a});
    s.piece_dst.push_back(s.grad_shard.narrow(0, a - s.lo, b - a));
  }
  if (s.cpu) {
    LOG_IF(INFO, dp.rank() == 0) << "sharded optimizer: " << s.numel << " parameters in " << ranks
                                 << " shard(s), the weights gathered per unit (" << s.unit_buf.size()
                                 << " units), each rank's master and optimizer state on the host ("
                                 << s.cpu->host_bytes() / (1024.0 * 1024.0) << " MiB, "
                                 << offload::to_string(s.cpu->isa()) << " x " << s.cpu->threads() << " threads)";
    return;
  }
  // The master shard as a leaf the rules update in place; its gradient is grad_shard.
  at::Tensor leaf = s.master.detach().requires_grad_(true);
  s.master = leaf;
  s.master.mutable_grad() = s.grad_shard;
  s.inner = make_optimizer({s.master}, options_);
  LOG_IF(INFO, dp.rank() == 0) << "sharded optimizer: " << s.numel << " parameters in " << ranks
                               << " shard(s) of at most " << per_rank << " on " << first.device()
                               << (s.zero3 ? ", the weights too, gathered per unit (" +
                                                 std::to_string(s.unit_buf.size()) + " units)"
                                           : std::string());
}

int ShardedOptimizer::units() const { return static_cast<int>(impl_->unit_buf.size()); }

std::pair<size_t, size_t> ShardedOptimizer::unit_params(int k) const {
  DTRAIN_CHECK(k >= 0 && k < units(), "unit ", k, " of ", units());
  return {impl_->unit_first[k], impl_->unit_first[k + 1]};
}

FlatRange ShardedOptimizer::unit_range(int k) const {
  const auto [first, last] = unit_params(k);
  return {impl_->offsets[first], impl_->offsets[last]};
}

bool ShardedOptimizer::unit_gathered(int k) const {
  unit_params(k);
  return impl_->gathered[k];
}

std::vector<dist::WorkPtr> ShardedOptimizer::gather_unit(int k) {
  const FlatRange unit = unit_range(k);
  Impl& s = *impl_;
  if (s.gathered[k]) return {};
  at::NoGradGuard no_grad;
  const at::Tensor& buf = s.unit_buf[k];
  materialize_unit_storage(buf);
  s.gathered[k] = true;
  std::vector<dist::WorkPtr> works;
  const int ranks = s.dp->size();
  for (int r = 0; r < ranks; ++r) {
    const FlatRange owned = shard_range(s.numel, ranks, r);
    const int64_t a = std::max(owned.begin, unit.begin), b = std::min(owned.end, unit.end);
    if (a >= b) continue;
    at::Tensor piece = buf.narrow(0, a - unit.begin, b - a);
    if (r == s.dp->rank()) piece.copy_(s.own.narrow(0, a - s.lo, b - a));
    if (ranks > 1) works.push_back(s.dp->broadcast(piece, r));
  }
  return works;
}

void ShardedOptimizer::release_unit(int k) {
  unit_params(k);
  if (!impl_->gathered[k]) return;
  release_unit_storage(impl_->unit_buf[k]);
  impl_->gathered[k] = false;
}

ShardedOptimizer::~ShardedOptimizer() = default;

void ShardedOptimizer::attach(GradReducer& reducer) {
  Impl& s = *impl_;
  if (s.empty) return;
  at::Tensor view = reducer.flat_gradients(s.lo, s.hi);
  if (!view.defined() || view.device() != s.grad_shard.device()) return;
  s.pieces.clear();  // [lo, hi) is one run of the reducer's storage: read from it, not from .grad
  s.piece_dst.clear();
  if (view.scalar_type() != s.grad_shard.scalar_type()) {
    s.grad_source = view;  // converted into grad_shard at each step
    return;
  }
  s.grad_shard = view;  // the reducer's storage of [lo, hi): no copy, no buffer of our own
  if (s.master.defined()) s.master.mutable_grad() = s.grad_shard;  // undefined when offloaded
}

void ShardedOptimizer::step(const at::Tensor& grad_multiplier) {
  at::NoGradGuard no_grad;
  Impl& s = *impl_;
  // This rank's range of the reduced gradients, one multi-tensor copy.
  std::vector<at::Tensor> dst, src;
  for (size_t k = 0; k < s.pieces.size(); ++k) {
    const at::Tensor& g = params_[s.pieces[k].param].grad();
    if (!g.defined()) {
      s.piece_dst[k].zero_();
      continue;
    }
    dst.push_back(s.piece_dst[k]);
    src.push_back(g.detach().reshape({-1}).narrow(0, s.pieces[k].from, s.pieces[k].n));
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  if (s.grad_source.defined()) s.grad_shard.copy_(s.grad_source);
  if (s.cpu) {
    // Offloaded: the gradient range to the host, the CPU update, the new weights back into own
    // (ordered before the work queued after this on the current stream).
    DTRAIN_CHECK(!grad_multiplier.defined() || grad_multiplier.numel() == 1, "--shard=parameters --offload=optimizer: "
                 "the gradient multiplier must be a one-element tensor, got ", grad_multiplier.toString());
    const double multiplier = grad_multiplier.defined() ? grad_multiplier.item<double>() : 1.0;
    const int64_t n = s.host_grad.numel();
    if (!s.empty) s.host_grad.copy_(s.grad_shard.narrow(0, 0, n));
    s.cpu->begin_step(multiplier);  // at set_lr()'s rate
    s.cpu->step_range(0, n, s.host_grad);
    s.cpu->end_step();
    for (int k = 0; k < units(); ++k) release_unit(k);
    return;
  }
  s.master.mutable_grad() = s.grad_shard;  // the fused kernels may rebind it; keep the buffer
  s.inner->step(grad_multiplier);
  if (!s.empty && s.master.data_ptr() != s.own.data_ptr()) s.own.copy_(s.master.detach());
  // ZeRO-3 gathers each unit when it is next used; a unit gathered now holds the old weights.
  if (s.zero3) {
    for (int k = 0; k < units(); ++k) release_unit(k);
    return;
  }
  if (s.dp->size() > 1) s.dp->all_gather(s.own_padded, s.flat)->wait();
}

void ShardedOptimizer::zero_grad() {
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

void ShardedOptimizer::set_lr(double lr) {
  if (impl_->inner) impl_->inner->set_lr(lr);
  if (impl_->cpu) impl_->cpu->set_lr(lr);  // checks it
  options_.lr = lr;
}

double ShardedOptimizer::lr() const { return impl_->inner ? impl_->inner->lr() : options_.lr; }

int64_t ShardedOptimizer::host_bytes() const { return impl_->pool ? impl_->pool->used_bytes() : 0; }

void ShardedOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  DTRAIN_CHECK(state.empty(), "--shard=optimizer: load_state got ", state.size(),
               " replicated entries; its state is partitioned (load_shard_state)");
}

std::vector<FlatRange> ShardedOptimizer::gradient_owners() const {
  const int ranks = impl_->dp->size();
  if (ranks == 1) return {};
  std::vector<FlatRange> owners;
  for (int r = 0; r < ranks; ++r) owners.push_back(shard_range(impl_->numel, ranks, r));
  return owners;
}

std::vector<at::Tensor> ShardedOptimizer::device_state() const {
  if (impl_->cpu) return {impl_->grad_shard, impl_->own};  // the master and state are on the host
  std::vector<at::Tensor> out = impl_->inner->device_state();
  out.push_back(impl_->grad_shard);
  if (impl_->empty || impl_->master.data_ptr() != impl_->own.data_ptr()) out.push_back(impl_->master);
  // ZeRO-3: this rank's range of the weights lives here between steps (the parameters' own
  // storage holds bytes only while their unit is gathered).
  if (impl_->zero3) out.push_back(impl_->own);
  return out;
}

std::optional<ShardLayout> ShardedOptimizer::shard_layout() const {
  return ShardLayout{impl_->numel, {impl_->lo, impl_->hi}};
}

namespace {

// "0.exp_avg" -> "exp_avg": the inner optimizer's names for its one tensor.
std::string slot_of(const std::string& name) { return name.substr(name.find('.') + 1); }

}  // namespace

ShardState ShardedOptimizer::shard_state() const {
  ShardState out;
  out.layout = *shard_layout();
  const auto host = at::TensorOptions().device(at::kCPU);
  const int64_t real = impl_->hi - impl_->lo;
  if (impl_->cpu) {  // the same arrays, from the CPU optimizer's chunks
    out.tensors = offload_detail::cpu_shard_arrays(*impl_->cpu, real);
    return out;
  }
  // 1-D arrays of the range's real elements (none for an empty range); "step" as it is.
  auto array = [&](const at::Tensor& t) { return t.detach().reshape({-1}).narrow(0, 0, real); };
  out.tensors.emplace_back("master", array(impl_->master).to(host, false, /*copy=*/true));
  for (const auto& [name, t] : impl_->inner->state()) {
    const bool scalar = t.dim() == 0;
    out.tensors.emplace_back(slot_of(name), (scalar ? t.detach() : array(t)).to(host, false, /*copy=*/true));
  }
  return out;
}

void ShardedOptimizer::load_shard_state(const ShardState& state) {
  Impl& s = *impl_;
  const ShardLayout mine = *shard_layout();
  DTRAIN_CHECK(state.layout.numel == mine.numel && state.layout.range == mine.range,
               "--shard=optimizer: the partitioned state holds elements [", state.layout.range.begin, ", ",
               state.layout.range.end, ") of ", state.layout.numel, "; this rank holds [", mine.range.begin, ", ",
               mine.range.end, ") of ", mine.numel, " (assemble it with assemble_shard)");
  if (s.cpu) {
    // An empty range keeps its stand-in's zeros: only the step count is loaded.
    std::vector<std::pair<std::string, at::Tensor>> arrays = state.tensors;
    if (s.empty) {
      for (auto& [name, t] : arrays) {
        if (name != "step") t = at::zeros({1}, at::kFloat);
      }
    }
    s.cpu->load_state(offload_detail::cpu_state_of_arrays(*s.cpu, arrays, s.empty ? 1 : s.hi - s.lo));
    at::NoGradGuard no_grad;
    if (!s.empty) s.own.copy_(s.cpu->master_weights());  // the weights between steps
    return;
  }
  std::map<std::string, at::Tensor> given;
  for (const auto& [name, t] : state.tensors) given[name] = t;
  auto master = given.find("master");
  DTRAIN_CHECK(master != given.end(), "the saved optimizer state has no 'master'");
  const int64_t real = s.hi - s.lo;
  DTRAIN_CHECK(master->second.numel() == real, "the saved 'master' has ", master->second.numel(),
               " elements for a range of ", real);
  std::vector<std::pair<std::string, at::Tensor>> inner;
  for (const auto& [name, t] : s.inner->state()) {
    auto it = given.find(slot_of(name));
    DTRAIN_CHECK(it != given.end(), "the saved optimizer state has no '", slot_of(name), "' (another --optimizer?)");
    const bool scalar = t.dim() == 0;
    DTRAIN_CHECK(scalar || it->second.numel() == real, "the saved '", slot_of(name), "' has ", it->second.numel(),
                 " elements for a range of ", real);
    // An empty range keeps its stand-in's zeros; only the step count is loaded.
    inner.emplace_back(name, scalar || !s.empty ? it->second.reshape(t.sizes()) : at::zeros_like(t));
  }
  s.inner->load_state(inner);  // checks every entry before changing anything
  if (s.empty) return;
  at::NoGradGuard no_grad;
  s.master.copy_(master->second.reshape({-1}));
  if (s.master.data_ptr() != s.own.data_ptr()) s.own.copy_(s.master);
}

}  // namespace dtrain::engine
