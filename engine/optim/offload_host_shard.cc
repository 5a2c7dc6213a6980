// Optimizer offload: this rank's shard on the host (see offload_internal.h).
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/grad_mode.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/offload/page_locked.h"
#include "dtrain/offload/thread_pool.h"
#include "offload_internal.h"

namespace dtrain::engine::offload_detail {

offload::CpuOptimizerOptions cpu_options(const OptimizerOptions& o, int rank, int count, int threads) {
  offload::CpuOptimizerOptions c;
  static_cast<offload::UpdateRuleOptions&>(c) = o;  // the same rule
  c.eps = effective_eps(o);
  c.shard_rank = rank;
  c.shard_count = count;
  c.threads = threads;
  return c;
}

namespace {

// "<array>.<chunk>" -> array
std::string array_of(const std::string& name) { return name.substr(0, name.rfind('.')); }

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> cpu_shard_arrays(const offload::CpuOptimizer& cpu, int64_t real) {
  std::map<std::string, std::vector<at::Tensor>> chunks;
  at::Tensor step;
  for (auto& [name, t] : cpu.state()) {
    if (name == "step") {
      step = t.clone();
    } else if (name != "layout") {
      chunks[array_of(name)].push_back(t);  // chunk order as listed (ascending)
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("step", step);
  for (auto& [array, parts] : chunks) out.emplace_back(array, at::cat(parts).narrow(0, 0, real).clone());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> cpu_state_of_arrays(
    const offload::CpuOptimizer& cpu, const std::vector<std::pair<std::string, at::Tensor>>& given, int64_t real) {
  std::map<std::string, at::Tensor> arrays;
  at::Tensor step;
  for (auto& [name, t] : given) {
    if (name == "step") {
      step = t;
      continue;
    }
    DTRAIN_CHECK(t.dim() == 1 && t.numel() == real, "offloaded optimizer state '", name, "' has ", t.numel(),
                 " elements for a range of ", real);
    arrays[name] = t;
  }
  DTRAIN_CHECK(step.defined(), "the saved optimizer state has no 'step'");
  // Chunk c of array a holds shard elements [c * chunk, (c + 1) * chunk).
  std::vector<std::pair<std::string, at::Tensor>> target;
  std::map<std::string, int64_t> next;
  for (auto& [name, t] : cpu.state()) {
    if (name == "step") {
      target.emplace_back(name, step.to(t.scalar_type()).reshape(t.sizes()));
      continue;
    }
    if (name == "layout") {
      target.emplace_back(name, t.clone());
      continue;
    }
    const std::string a = array_of(name);
    auto it = arrays.find(a);
    DTRAIN_CHECK(it != arrays.end(), "the saved optimizer state has no '", a, "' (another --optimizer?)");
    const int64_t off = next[a];
    at::Tensor chunk = at::zeros({t.numel()}, at::kFloat);
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(t.numel(), real - off));
    if (n > 0) chunk.narrow(0, 0, n).copy_(it->second.narrow(0, off, n));
    next[a] = off + t.numel();
    target.emplace_back(name, chunk);
  }
  return target;
}

HostShard::HostShard(std::vector<at::Tensor>& params, const OptimizerOptions& options, dist::Communicator& dp,
                     const OffloadOptions& offload)
    : dp_(&dp) {
  const at::Tensor& first = params.front();
  if (!first.device().is_cpu()) device_ = first.device();
  offload::PinnedPoolOptions po;
  // Page-locked memory only when there is a device to copy to: pinning the state of a run with
  // CPU parameters would create a CUDA context and lock gigabytes for nothing (CUDA builds).
  po.pin = device_.has_value();
  po.limit_bytes = offload.host_mem_limit_gb > 0 ? offload::host_limit_bytes_from_gb(offload.host_mem_limit_gb) : 0;
  pool_ = std::make_unique<offload::PinnedPool>(po);
  // The parameters become views of one flat buffer laid out as the CPU optimizer's flat space.
  for (const at::Tensor& p : params) numel_ += p.numel();
  // Host parameters in page-locked memory (layer offload streams them to a GPU from there) stay
  // page-locked: the copies to the device read the flat buffers.
  pinned_ = !device_ && at::hasCUDA() && first.is_pinned();
  const int64_t padded = offload::padded_numel(numel_, dp.size());
  // Page-locked at its exact size: PyTorch's pinned tensors round up to a power of two (a 40 GiB
  // model's weights would lock 64 GiB).
  flat_ = offload::host_empty({padded}, first.scalar_type(), pinned_);
  {
    at::NoGradGuard no_grad;
    flat_.narrow(0, numel_, padded - numel_).zero_();  // the padding; the parameters fill the rest
    int64_t offset = 0;
    for (at::Tensor& p : params) {
      flat_.narrow(0, offset, p.numel()).view(p.sizes()).copy_(p.detach());
      offset += p.numel();
    }
  }
  params_ = params;
  offsets_.push_back(0);
  for (const at::Tensor& p : params) offsets_.push_back(offsets_.back() + p.numel());
  point_params_at_flat();
  // The parameters' former page-locked homes (the layer streamer's, one per parameter) are free
  // now, but PyTorch's host allocator keeps a freed block page-locked for a later request of
  // the same rounded size, which none makes: returned to the system.
  if (pinned_) at::getHostAllocator(at::kCUDA)->empty_cache();
  cpu_ = std::make_unique<offload::CpuOptimizer>(params, cpu_options(options, dp.rank(), dp.size(), offload.threads),
                                                 *pool_);
  cpu_->set_output(flat_);
  output_ = flat_;
  chunk_ = cpu_->options().chunk_elems;
  lo_ = std::min(cpu_->shard().begin, numel_);
  hi_ = std::min(cpu_->shard().end, numel_);
  const at::ScalarType dtype = first.scalar_type();
  host_dtype_ = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ? dtype : at::kFloat;
}

HostGrads HostShard::allocate_grads() const {
  HostGrads g;
  for (int64_t off = 0; off < hi_ - lo_; off += chunk_) {
    g.chunks.push_back(pool_->allocate(std::min(chunk_, hi_ - lo_ - off), host_dtype_));
  }
  return g;
}

void HostShard::copy_grads_from_params(HostGrads& g, const std::vector<at::Tensor>& params) const {
  // Host gradients are copied in pieces of 1 Mi elements by a thread team (ATen's CPU copy runs
  // on one thread in dtrain's builds: its OpenMP region is inline in ATen's headers); others
  // (device gradients, small copies) by ATen.
  constexpr int64_t kPiece = int64_t{1} << 20;
  struct Piece {
    at::Tensor dst, src;  // src undefined: zeros
  };
  std::vector<Piece> host, other;
  int64_t host_elems = 0;
  for (size_t j = 0; j < params.size(); ++j) {
    const int64_t p_lo = offsets_[j];
    const int64_t a = std::max(p_lo, lo_), b = std::min(offsets_[j + 1], hi_);
    if (a >= b) continue;
    at::Tensor grad = params[j].grad();
    for_each_piece(a - lo_, b - lo_, [&](size_t c, int64_t in, int64_t n, int64_t at_) {
      for (int64_t k = 0; k < n; k += kPiece) {
        const int64_t m = std::min(kPiece, n - k);
        Piece piece{g.chunks[c].narrow(0, in + k, m),
                    grad.defined() ? grad.detach().reshape({-1}).narrow(0, at_ + lo_ - p_lo + k, m) : at::Tensor()};
        const bool on_host = !piece.src.defined() || piece.src.is_cpu();
        if (on_host) host_elems += m;
        (on_host ? host : other).push_back(std::move(piece));
      }
    });
  }
  for (Piece& piece : other) piece.dst.copy_(piece.src);
  auto copy = [](Piece& piece) {
    if (piece.src.defined()) {
      piece.dst.copy_(piece.src);
    } else {
      piece.dst.zero_();
    }
  };
  if (host_elems < 4 * kPiece) {
    for (Piece& piece : host) copy(piece);
    return;
  }
  const int64_t count = static_cast<int64_t>(host.size());
  offload::run_on_shared_team([&](int member, int members) {
    for (int64_t q = member; q < count; q += members) copy(host[q]);
  });
}

void HostShard::update(const HostGrads& g, double multiplier, double lr) {
  cpu_->set_lr(lr);
  cpu_->begin_step(multiplier);
  for_each_piece(0, hi_ - lo_, [&](size_t c, int64_t in, int64_t n, int64_t at_) {
    cpu_->step_range(lo_ + at_, lo_ + at_ + n, g.chunks[c].narrow(0, in, n));
  });
  cpu_->end_step();
}

void HostShard::point_params_at_flat() {
  for (size_t j = 0; j < params_.size(); ++j) {
    at::Tensor& p = params_[j];
    p.set_data(flat_.narrow(0, offsets_[j], p.numel()).view(p.sizes()));
  }
}

void HostShard::swap_flat(at::Tensor& other) {
  DTRAIN_CHECK(host_local(), "optimizer offload: swapping the weight buffers needs host parameters of one rank");
  DTRAIN_CHECK(other.numel() == flat_.numel() && other.scalar_type() == flat_.scalar_type() && other.is_cpu() &&
                   other.is_contiguous(),
               "optimizer offload: the new weights (", other.toString(), ", ", other.numel(),
               " elements) cannot replace the flat buffer (", flat_.toString(), ", ", flat_.numel(), ")");
  std::swap(flat_, other);
  point_params_at_flat();
}

void HostShard::update_from(const std::vector<at::Tensor>& grads, double multiplier, double lr) {
  DTRAIN_CHECK(grads.size() + 1 == offsets_.size(), "optimizer offload: ", grads.size(), " gradients for ",
               offsets_.size() - 1, " parameters");
  cpu_->set_lr(lr);
  cpu_->begin_step(multiplier);
  for (size_t j = 0; j < grads.size(); ++j) {
    const int64_t a = std::max(offsets_[j], lo_), b = std::min(offsets_[j + 1], hi_);
    if (a >= b) continue;
    const at::Tensor& g = grads[j];
    cpu_->step_range(a, b,
                     g.defined() ? g.reshape({-1}).narrow(0, a - offsets_[j], b - a)
                                 : at::zeros({b - a}, at::TensorOptions().dtype(host_dtype_)));
  }
  cpu_->end_step();
}

void HostShard::update_from_params(double multiplier, double lr) {
  cpu_->set_lr(lr);
  cpu_->step(multiplier);  // this rank's shard from .grad
}

void HostShard::set_output(const at::Tensor& target) {
  if (target.is_same(output_) || !cpu_->options().write_back) return;
  cpu_->set_output(target);
  output_ = target;
}

void HostShard::all_gather(const at::Tensor& shard) {
  if (dp_->size() > 1) {
    dp_->all_gather(shard, flat_)->wait();
  } else if (shard.data_ptr() != flat_.data_ptr()) {
    flat_.copy_(shard);
  }
}

at::Tensor HostShard::own_part_of_flat() const {
  const int64_t n = flat_.numel() / dp_->size();
  return flat_.narrow(0, dp_->rank() * n, n);
}

}  // namespace dtrain::engine::offload_detail
