// ZeRO-3's partitioned weights, gradients and optimizer state, unit by unit (zero3_optimizer.h).
#include "dtrain/engine/zero3/zero3_optimizer.h"

#include <algorithm>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/cpu_shard.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"

namespace dtrain::engine {

namespace {

// One unit of the flat space and this rank's piece of it.
struct Unit {
  size_t first = 0, last = 0;    // its parameters [first, last)
  int64_t begin = 0, numel = 0;  // its elements of the flat space
  int64_t chunk = 0;             // each rank's piece, padding included
  int64_t at = 0;                // where this rank's piece sits in the shard
  int64_t real = 0;              // the piece's real elements: its first `real`
  at::Tensor buf;                // ranks x chunk elements, holding bytes only while gathered
  bool gathered = false;
};

// What the optimizer shares with its gradient strategy (which the reducer keeps).
struct Layout {
  std::vector<Unit> units;
  std::map<int64_t, size_t> unit_at;  // a unit's first flat element -> the unit
  at::Tensor grad_shard;              // this rank's pieces of the averaged gradients
  int ranks = 1;
  // The out-of-memory replay (Zero3Optimizer::replay_step): the collectives issued since
  // begin_step(), and how many of the next ones complete without communicating. Gathers are
  // issued by the training thread and autograd's, reduce-scatters by autograd's.
  std::mutex replay_mutex;
  int64_t issued_in_step = 0;
  int64_t to_skip = 0;
  // Whether the next collective is issued (counting it) or skipped (one of the replay's).
  bool issue_next() {
    std::lock_guard<std::mutex> lock(replay_mutex);
    if (to_skip > 0) {
      --to_skip;
      return false;
    }
    ++issued_in_step;
    return true;
  }
};

// The gradient path: one bucket per unit, padded to ranks x chunk, reduce-scattered (averaged)
// into the unit's piece of the gradient shard; the reducer keeps nothing.
class ReduceScatterBuckets : public BucketComm {
 public:
  explicit ReduceScatterBuckets(std::shared_ptr<Layout> layout) : layout_(std::move(layout)) {}
  std::string name() const override { return "reduce_scatter"; }
  bool consecutive_buckets() const override { return true; }
  std::vector<size_t> bucket_starts() const override {
    std::vector<size_t> starts;
    for (const Unit& u : layout_->units) starts.push_back(u.first);
    return starts;
  }
  int64_t storage_numel(int64_t numel) const override { return offload::padded_numel(numel, layout_->ranks); }
  bool keeps_gradients() const override { return false; }

  BucketLaunch launch(const at::Tensor& wire, int64_t flat_begin, dist::Communicator& comm) override {
    const auto it = layout_->unit_at.find(flat_begin);
    DTRAIN_CHECK(it != layout_->unit_at.end(), "ZeRO-3's reduce-scatter got a bucket at flat element ", flat_begin,
                 ", where no unit begins (a reducer over other parameters than the optimizer's?)");
    const Unit& u = layout_->units[it->second];
    at::Tensor out = layout_->grad_shard.narrow(0, u.at, u.chunk);
    DTRAIN_CHECK(comm.size() == layout_->ranks && wire.numel() == u.chunk * comm.size(),
                 "ZeRO-3's reduce-scatter: unit ", it->second, " has a bucket of ", wire.numel(), " elements on ",
                 comm.size(), " ranks; the optimizer laid out ", u.chunk, " per rank on ", layout_->ranks);
    DTRAIN_CHECK(wire.scalar_type() == out.scalar_type(), "--shard=parameters reduces the gradients in the weights' "
                 "dtype (", out.scalar_type(), "), not ", wire.scalar_type(), ": drop the reducer's compression");
    BucketLaunch launched;
    if (comm.size() == 1) {
      out.copy_(wire);
      launched.mine = dist::completed_work(comm.issued());
    } else if (!layout_->issue_next()) {  // the replay: the other ranks had this one already
      launched.mine = dist::completed_work(comm.issued());
    } else {
      launched.mine = comm.reduce_scatter(wire, out, dist::ReduceOp::kAvg);
    }
    launched.works.push_back(launched.mine);
    return launched;
  }

 private:
  std::shared_ptr<Layout> layout_;
};

// "0.exp_avg" -> "exp_avg": the inner optimizer's names for its one tensor.
std::string slot_of(const std::string& name) { return name.substr(name.find('.') + 1); }

}  // namespace

struct Zero3Optimizer::Impl {
  dist::Communicator* dp = nullptr;
  std::shared_ptr<Layout> layout = std::make_shared<Layout>();
  std::vector<int64_t> offsets;  // each parameter's first flat element, and numel at the end
  int64_t numel = 0;             // the flat space
  int64_t shard = 0;             // this rank's pieces together (padding included)
  std::vector<FlatRange> ranges;      // their real elements in the flat space
  std::vector<int64_t> unit_bounds;   // each unit's first flat element
  int64_t real = 0;                   // the real elements of this rank's ranges together
  at::Tensor own;                     // this rank's weights between steps (the weights' dtype)
  at::Tensor master;                  // their master: own itself for float32/float64 weights
  at::Tensor grad_master;             // the gradient shard in the master dtype (or the shard)
  std::unique_ptr<Optimizer> inner;   // make_optimizer() over {master}; null when offloaded
  // Offloaded: the CPU optimizer over {own} (master and state in the pool, writing the new
  // weights back into own) and the gradients' host staging.
  std::unique_ptr<offload::PinnedPool> pool;
  std::unique_ptr<offload::CpuOptimizer> cpu;
  at::Tensor host_grad;

  std::vector<Unit>& units() { return layout->units; }
  void lay_out(const std::vector<at::Tensor>& params, const std::vector<size_t>& starts, int rank);
  void take_weights(std::vector<at::Tensor>& params);
  void offloaded_state(const OptimizerOptions& options, const OffloadOptions& offload, bool pin);
  // A shard-sized tensor's real elements, end to end, as a host array (a checkpoint's), and
  // back into a shard-sized host tensor with zeros in the padding.
  at::Tensor real_of(const at::Tensor& t) const {
    const at::Tensor flat = t.detach().reshape({-1});
    std::vector<at::Tensor> pieces;
    for (const Unit& u : layout->units) {
      if (u.real > 0) pieces.push_back(flat.narrow(0, u.at, u.real));
    }
    return pieces.empty() ? at::empty({0}, flat.options().device(at::kCPU)) : at::cat(pieces).to(at::kCPU);
  }
  at::Tensor shard_of(const at::Tensor& values, const at::TensorOptions& options) const {
    at::Tensor full = at::zeros({shard}, options.device(at::kCPU));
    const at::Tensor flat = values.reshape({-1});
    int64_t from = 0;
    for (const Unit& u : layout->units) {
      if (u.real == 0) continue;
      full.narrow(0, u.at, u.real).copy_(flat.narrow(0, from, u.real));
      from += u.real;
    }
    return full;
  }
};

void Zero3Optimizer::Impl::lay_out(const std::vector<at::Tensor>& params, const std::vector<size_t>& starts,
                                   int rank) {
  const int ranks = layout->ranks;
  for (size_t k = 0; k < starts.size(); ++k) {
    Unit u;
    u.first = starts[k];
    u.last = k + 1 < starts.size() ? starts[k + 1] : params.size();
    u.begin = offsets[u.first];
    u.numel = offsets[u.last] - u.begin;
    u.chunk = offload::padded_numel(u.numel, ranks) / ranks;
    u.at = shard;
    const FlatRange piece = shard_range(u.numel, ranks, rank);
    u.real = piece.size();
    if (u.real > 0) ranges.push_back({u.begin + piece.begin, u.begin + piece.end});
    real += u.real;
    unit_bounds.push_back(u.begin);
    layout->unit_at[u.begin] = k;
    shard += u.chunk;
    units().push_back(std::move(u));
  }
}

// This rank's pieces of the weights into own; each unit's parameters become views of a buffer
// of the unit's that is released at once.
void Zero3Optimizer::Impl::take_weights(std::vector<at::Tensor>& params) {
  const at::TensorOptions options = params.front().options().requires_grad(false);
  own = at::zeros({shard}, options);
  const int rank = dp->rank();
  for (Unit& u : units()) {
    if (u.real > 0) {
      std::vector<at::Tensor> flat;
      for (size_t j = u.first; j < u.last; ++j) flat.push_back(params[j].detach().reshape({-1}));
      own.narrow(0, u.at, u.real).copy_(at::cat(flat).narrow(0, rank * u.chunk, u.real));
    }
    u.buf = at::empty({u.chunk * layout->ranks}, options);
    for (size_t j = u.first; j < u.last; ++j) {
      params[j].set_data(u.buf.narrow(0, offsets[j] - u.begin, params[j].numel()).view(params[j].sizes()));
    }
    release_unit_storage(u.buf);
  }
}

void Zero3Optimizer::Impl::offloaded_state(const OptimizerOptions& options, const OffloadOptions& offload, bool pin) {
  offload::PinnedPoolOptions po;
  po.pin = pin;  // page-locked only when there is a device to copy to
  po.limit_bytes = offload.host_mem_limit_gb > 0 ? offload::host_limit_bytes_from_gb(offload.host_mem_limit_gb) : 0;
  pool = std::make_unique<offload::PinnedPool>(po);
  cpu = std::make_unique<offload::CpuOptimizer>(std::vector<at::Tensor>{own},
                                                offload_detail::cpu_options(options, 0, 1, offload.threads), *pool);
  host_grad = pool->allocate(shard, at::kFloat);
  host_grad.zero_();
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

Zero3Optimizer::Zero3Optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                               dist::Communicator& dp, std::vector<size_t> unit_starts, const OffloadOptions* offload)
    : options_(options), params_(std::move(params)), impl_(std::make_unique<Impl>()) {
  validate(options_);
  check_one_flat_space(params_, "--shard=parameters");
  DTRAIN_CHECK(!unit_starts.empty(), "--shard=parameters needs the units (where each unit's parameters begin)");
  for (size_t k = 0; k < unit_starts.size(); ++k) {
    DTRAIN_CHECK(unit_starts[k] < params_.size() && (k == 0 ? unit_starts[k] == 0 : unit_starts[k] > unit_starts[k - 1]),
                 "--shard=parameters: the units must start at parameter 0 and ascend below ", params_.size(),
                 "; unit ", k, " starts at ", unit_starts[k]);
  }
  const at::Tensor& first = params_.front();
  DTRAIN_CHECK(at::isFloatingType(first.scalar_type()), "--shard=parameters: the parameters are ",
               first.scalar_type(), ", not floating point");
  Impl& s = *impl_;
  s.dp = &dp;
  s.layout->ranks = dp.size();
  s.offsets.push_back(0);
  for (const at::Tensor& p : params_) s.offsets.push_back(s.offsets.back() + p.numel());
  s.numel = s.offsets.back();
  s.lay_out(params_, unit_starts, dp.rank());
  at::NoGradGuard no_grad;
  s.take_weights(params_);
  s.layout->grad_shard = at::zeros({s.shard}, s.own.options());
  if (offload) {
    s.offloaded_state(options_, *offload, !first.device().is_cpu());
    LOG_IF(INFO, dp.rank() == 0) << "ZeRO-3: " << s.numel << " parameters in " << units() << " units over "
                                 << dp.size() << " rank(s); each rank's master and optimizer state on the host ("
                                 << s.cpu->host_bytes() / (1024.0 * 1024.0) << " MiB, "
                                 << offload::to_string(s.cpu->isa()) << " x " << s.cpu->threads() << " threads)";
    return;
  }
  // float32 master weights for float16/bfloat16 parameters; float32 and float64 ones are their own.
  const at::ScalarType dtype = first.scalar_type();
  const at::ScalarType master_dtype = dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
  s.master = (master_dtype == dtype ? s.own : s.own.to(master_dtype)).detach().requires_grad_(true);
  s.grad_master = master_dtype == dtype ? s.layout->grad_shard : at::zeros({s.shard}, s.master.options());
  s.master.mutable_grad() = s.grad_master;
  s.inner = make_optimizer({s.master}, options_);
  LOG_IF(INFO, dp.rank() == 0) << "ZeRO-3: " << s.numel << " parameters in " << units() << " units over " << dp.size()
                               << " rank(s), " << s.shard << " elements of weights, gradients and state per rank on "
                               << first.device();
}

Zero3Optimizer::~Zero3Optimizer() = default;

int Zero3Optimizer::units() const { return static_cast<int>(impl_->layout->units.size()); }

std::pair<size_t, size_t> Zero3Optimizer::unit_params(int k) const {
  DTRAIN_CHECK(k >= 0 && k < units(), "unit ", k, " of ", units());
  const Unit& u = impl_->layout->units[k];
  return {u.first, u.last};
}

bool Zero3Optimizer::unit_gathered(int k) const {
  unit_params(k);
  return impl_->layout->units[k].gathered;
}

std::vector<dist::WorkPtr> Zero3Optimizer::gather_unit(int k) {
  unit_params(k);
  Impl& s = *impl_;
  Unit& u = s.units()[k];
  if (u.gathered) return {};
  at::NoGradGuard no_grad;
  materialize_unit_storage(u.buf);
  u.gathered = true;
  const at::Tensor mine = s.own.narrow(0, u.at, u.chunk);
  if (s.dp->size() == 1) {
    u.buf.copy_(mine);
    return {};
  }
  if (!s.layout->issue_next()) {  // the replay: zeros stand for weights the other ranks had gathered already
    u.buf.zero_();
    return {};
  }
  return {s.dp->all_gather(mine, u.buf)};
}



void Zero3Optimizer::release_unit(int k) {
  unit_params(k);
  Unit& u = impl_->units()[k];
  if (!u.gathered) return;
  release_unit_storage(u.buf);
  u.gathered = false;
}

void Zero3Optimizer::begin_step() {
  Layout& l = *impl_->layout;
  std::lock_guard<std::mutex> lock(l.replay_mutex);
  DTRAIN_CHECK(l.to_skip == 0, "ZeRO-3: a step began with ", l.to_skip, " collective(s) of the last replay still "
               "to skip; the replay issued fewer collectives than the failed attempt");
  l.issued_in_step = 0;
}

int64_t Zero3Optimizer::issued_in_step() const {
  Layout& l = *impl_->layout;
  std::lock_guard<std::mutex> lock(l.replay_mutex);
  return l.issued_in_step;
}

void Zero3Optimizer::replay_step() {
  Layout& l = *impl_->layout;
  std::lock_guard<std::mutex> lock(l.replay_mutex);
  l.to_skip = l.issued_in_step;
  l.issued_in_step = 0;
}

int64_t Zero3Optimizer::replaying() const {
  Layout& l = *impl_->layout;
  std::lock_guard<std::mutex> lock(l.replay_mutex);
  return l.to_skip;
}

std::shared_ptr<BucketComm> Zero3Optimizer::bucket_comm() const {
  return std::make_shared<ReduceScatterBuckets>(impl_->layout);
}

at::Tensor Zero3Optimizer::gradient_shard() const { return impl_->layout->grad_shard; }

std::vector<int64_t> Zero3Optimizer::shard_positions() const {
  std::vector<int64_t> at;
  for (const Unit& u : impl_->layout->units) {
    if (u.real > 0) at.push_back(u.at);
  }
  return at;
}

void Zero3Optimizer::step(const at::Tensor& grad_multiplier) {
  at::NoGradGuard no_grad;
  Impl& s = *impl_;
  const at::Tensor& grads = s.layout->grad_shard;
  if (s.cpu) {
    // The shard's gradients to the host, the CPU update, the new weights back into own (ordered
    // before the work queued after this on the current stream).
    DTRAIN_CHECK(!grad_multiplier.defined() || grad_multiplier.numel() == 1, "--shard=parameters --offload=optimizer: "
                 "the gradient multiplier must be a one-element tensor, got ", grad_multiplier.toString());
    const double multiplier = grad_multiplier.defined() ? grad_multiplier.item<double>() : 1.0;
    s.host_grad.copy_(grads);
    s.cpu->begin_step(multiplier);  // at set_lr()'s rate
    s.cpu->step_range(0, s.shard, s.host_grad);
    s.cpu->end_step();
  } else {
    if (!s.grad_master.is_same(grads)) s.grad_master.copy_(grads);
    s.master.mutable_grad() = s.grad_master;  // the fused kernels may rebind it; keep the buffer
    s.inner->step(grad_multiplier);
    if (s.master.data_ptr() != s.own.data_ptr()) s.own.copy_(s.master.detach());
  }
  // Each unit is gathered when it is next used; one gathered now holds the old weights.
  for (int k = 0; k < units(); ++k) release_unit(k);
}

void Zero3Optimizer::zero_grad() {
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) p.grad().zero_();
  }
  impl_->layout->grad_shard.zero_();
}

void Zero3Optimizer::set_lr(double lr) {
  if (impl_->inner) impl_->inner->set_lr(lr);
  if (impl_->cpu) impl_->cpu->set_lr(lr);  // checks it
  options_.lr = lr;
}

double Zero3Optimizer::lr() const { return impl_->inner ? impl_->inner->lr() : options_.lr; }

int64_t Zero3Optimizer::host_bytes() const { return impl_->pool ? impl_->pool->used_bytes() : 0; }

void Zero3Optimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  DTRAIN_CHECK(state.empty(), "--shard=parameters: load_state got ", state.size(),
               " replicated entries; its state is partitioned (load_shard_state)");
}

std::vector<at::Tensor> Zero3Optimizer::device_state() const {
  const Impl& s = *impl_;
  // This rank's weights live here between steps (the parameters hold bytes only while
  // gathered); the gradient shard counts as gradients (gradient_shard()), not here.
  if (s.cpu) return {s.own};  // the master and state are on the host
  std::vector<at::Tensor> out = s.inner->device_state();
  if (!s.grad_master.is_same(s.layout->grad_shard)) out.push_back(s.grad_master);
  if (s.master.data_ptr() != s.own.data_ptr()) out.push_back(s.master);
  out.push_back(s.own);
  return out;
}

std::optional<ShardLayout> Zero3Optimizer::shard_layout() const {
  ShardLayout layout;
  layout.numel = impl_->numel;
  layout.ranges = impl_->ranges;
  layout.unit_bounds = impl_->unit_bounds;
  return layout;
}

ShardState Zero3Optimizer::shard_state() const {
  const Impl& s = *impl_;
  ShardState out;
  out.layout = *shard_layout();
  if (s.cpu) {  // the same arrays, from the CPU optimizer's chunks: the whole shard, then its real elements
    for (auto& [name, t] : offload_detail::cpu_shard_arrays(*s.cpu, s.shard)) {
      out.tensors.emplace_back(name, t.dim() == 0 ? t : s.real_of(t));
    }
    return out;
  }
  out.tensors.emplace_back("master", s.real_of(s.master));
  for (const auto& [name, t] : s.inner->state()) {
    const bool scalar = t.dim() == 0;
    out.tensors.emplace_back(slot_of(name), scalar ? t.detach().to(at::kCPU, false, /*copy=*/true) : s.real_of(t));
  }
  return out;
}

void Zero3Optimizer::load_shard_state(const ShardState& state) {
  Impl& s = *impl_;
  const int64_t real = s.real;
  DTRAIN_CHECK(state.layout.numel == s.numel && state.layout.ranges == s.ranges, "--shard=parameters: the partitioned "
               "state holds ", state.layout.size(), " elements in ", state.layout.ranges.size(), " range(s) of ",
               state.layout.numel, "; this rank holds ", real, " in ", s.ranges.size(), " range(s) of ", s.numel,
               " (assemble it with assemble_shard)");
  at::NoGradGuard no_grad;
  if (s.cpu) {
    std::vector<std::pair<std::string, at::Tensor>> arrays;
    for (const auto& [name, t] : state.tensors) {
      DTRAIN_CHECK(t.dim() == 0 || t.numel() == real, "the saved '", name, "' has ", t.numel(),
                   " elements for a shard of ", real);
      arrays.emplace_back(name, t.dim() == 0 ? t : s.shard_of(t, at::TensorOptions().dtype(at::kFloat)));
    }
    s.cpu->load_state(offload_detail::cpu_state_of_arrays(*s.cpu, arrays, s.shard));
    s.own.copy_(s.cpu->master_weights());  // the weights between steps
    return;
  }
  std::map<std::string, at::Tensor> given;
  for (const auto& [name, t] : state.tensors) given[name] = t;
  const auto master = given.find("master");
  DTRAIN_CHECK(master != given.end(), "the saved optimizer state has no 'master'");
  DTRAIN_CHECK(master->second.numel() == real, "the saved 'master' has ", master->second.numel(),
               " elements for a shard of ", real);
  std::vector<std::pair<std::string, at::Tensor>> inner;
  for (const auto& [name, t] : s.inner->state()) {
    const auto it = given.find(slot_of(name));
    DTRAIN_CHECK(it != given.end(), "the saved optimizer state has no '", slot_of(name), "' (another --optimizer?)");
    const bool scalar = t.dim() == 0;
    DTRAIN_CHECK(scalar || it->second.numel() == real, "the saved '", slot_of(name), "' has ", it->second.numel(),
                 " elements for a shard of ", real);
    inner.emplace_back(name, scalar ? it->second.reshape(t.sizes()) : s.shard_of(it->second, t.options()));
  }
  s.inner->load_state(inner);  // checks every entry before changing anything
  s.master.detach().copy_(s.shard_of(master->second, s.master.options()));
  if (s.master.data_ptr() != s.own.data_ptr()) s.own.copy_(s.master.detach());
}

}  // namespace dtrain::engine
