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

namespace dtrain::engine {

ShardMode parse_shard_mode(const std::string& text) {
  if (text == "none") return ShardMode::kNone;
  if (text == "optimizer") return ShardMode::kOptimizer;
  if (text == "gradients") return ShardMode::kGradients;
  if (text == "parameters") return ShardMode::kParameters;
  throw Error("--shard=" + text + " is not one of: none, optimizer, gradients, parameters");
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
  std::unique_ptr<Optimizer> inner;  // make_optimizer() over {master}
  // A rank whose range holds no real element (a model smaller than the padding) updates a
  // one-element stand-in with a zero gradient, so its step count stays the group's.
  bool empty = false;

  // The parameters become views of flat; own is this rank's range of it.
  void flat_storage(std::vector<at::Tensor>& params, int rank, int64_t padded);
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

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                   dist::Communicator& dp)
    : options_(options), params_(std::move(params)), impl_(std::make_unique<Impl>()) {
  impl_->dp = &dp;
  validate(options_);
  check_one_flat_space(params_, "--shard=optimizer");
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
  s.flat_storage(params_, dp.rank(), padded);
  s.empty = s.hi == s.lo;
  // fp32 master weights for fp16/bf16 parameters; fp32 and fp64 ones are their own master.
  const at::ScalarType dtype = first.scalar_type();
  const at::ScalarType master_dtype = dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
  if (s.empty) {
    s.master = at::zeros({1}, s.own.options().dtype(master_dtype));
  } else {
    s.master = master_dtype == dtype ? s.own : s.own.to(master_dtype);
  }
  s.grad_shard = at::zeros({s.master.numel()}, s.own.options().dtype(master_dtype));
  for (size_t j = 0; j < params_.size(); ++j) {
    const int64_t a = std::max(s.offsets[j], s.lo), b = std::min(s.offsets[j + 1], s.hi);
    if (a >= b) continue;
    s.pieces.push_back({j, a - s.offsets[j], b - a});
    s.piece_dst.push_back(s.grad_shard.narrow(0, a - s.lo, b - a));
  }
  // The master shard as a leaf the rules update in place; its gradient is grad_shard.
  at::Tensor leaf = s.master.detach().requires_grad_(true);
  s.master = leaf;
  s.master.mutable_grad() = s.grad_shard;
  s.inner = make_optimizer({s.master}, options_);
  LOG_IF(INFO, dp.rank() == 0) << "sharded optimizer: " << s.numel << " parameters in " << ranks
                               << " shard(s) of at most " << per_rank << " on " << first.device();
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
  s.master.mutable_grad() = s.grad_shard;
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
  s.master.mutable_grad() = s.grad_shard;  // the fused kernels may rebind it; keep the buffer
  s.inner->step(grad_multiplier);
  if (!s.empty && s.master.data_ptr() != s.own.data_ptr()) s.own.copy_(s.master.detach());
  if (s.dp->size() > 1) s.dp->all_gather(s.own_padded, s.flat)->wait();
}

void ShardedOptimizer::zero_grad() {
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

void ShardedOptimizer::set_lr(double lr) {
  impl_->inner->set_lr(lr);
  options_.lr = lr;
}

double ShardedOptimizer::lr() const { return impl_->inner->lr(); }

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
  std::vector<at::Tensor> out = impl_->inner->device_state();
  out.push_back(impl_->grad_shard);
  if (impl_->empty || impl_->master.data_ptr() != impl_->own.data_ptr()) out.push_back(impl_->master);
  return out;
}

std::optional<ShardLayout> ShardedOptimizer::shard_layout() const {
  // One unit: the range [lo, hi) (none when this rank holds only padding).
  return impl_->lo < impl_->hi ? ShardLayout{impl_->numel, {{impl_->lo, impl_->hi}}} : ShardLayout{impl_->numel, {}};
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
  DTRAIN_CHECK(state.layout.numel == mine.numel && state.layout.ranges == mine.ranges,
               "--shard=optimizer: the partitioned state holds elements ", ranges_text(state.layout.ranges), " of ",
               state.layout.numel, "; this rank holds ", ranges_text(mine.ranges), " of ", mine.numel,
               " (assemble it with assemble_shard)");
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
