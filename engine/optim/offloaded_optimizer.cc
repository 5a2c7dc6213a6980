#include "dtrain/engine/optim/offload.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "offload_internal.h"

namespace dtrain::engine {

namespace {

// Whether the delayed update may take the parameters' gradients as they are: autograd's own
// tensors (which a one-rank reducer leaves in place and drops at zero_grad; not views of its
// buckets, which it zeroes and refills), on the host, dense, in a dtype the CPU kernels read.
// The reducer is asked about these parameters only: --offload=all's host part keeps
// autograd's gradients beside the device part's gradient stream.
bool gradients_can_be_taken(const std::vector<at::Tensor>& params, const GradReducer* reducer) {
  if (reducer == nullptr) return false;
  // Parameters the attached reducer does not hold: copied, as always correct.
  for (const at::Tensor& p : params) {
    if (!reducer->holds(p)) return false;
  }
  if (!reducer->keeps_autograd_gradients(params)) return false;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    const at::ScalarType t = g.scalar_type();
    if (!g.is_cpu() || g.is_sparse() || !g.is_contiguous() || g.numel() != p.numel() ||
        (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf)) {
      return false;
    }
  }
  return true;
}

}  // namespace

OffloadChoice parse_offload(const std::string& text) {
  if (text == "none") return {false, false};
  if (text == "optimizer") return {true, false};
  if (text == "layers") return {false, true};
  if (text == "all") return {true, true};
  throw Error("--offload=" + text + " is not one of: none, optimizer, layers, all");
}

StreamGradients parse_stream_gradients(const std::string& text) {
  if (text == "auto") return StreamGradients::kAuto;
  if (text == "on") return StreamGradients::kOn;
  if (text == "off") return StreamGradients::kOff;
  throw Error("--offload_stream_gradients=" + text +
              " is not one of: auto, on, off (OffloadOptions::stream_gradients)");
}

// The three parts (offload_internal.h). Members are destroyed in reverse order: the streamer
// and the updater stop before the gradient buffers they use are freed, and those before the
// shard's pool.
struct OffloadedOptimizer::Impl {
  Impl(std::vector<at::Tensor>& params, const OptimizerOptions& options, dist::Communicator& dp,
       const OffloadOptions& offload_options)
      : dp(&dp), offload(offload_options), stream_mode(parse_stream_gradients(offload_options.stream_gradients)),
        shard(params, options, dp, offload_options), lr(options.lr) {}

  dist::Communicator* dp;
  OffloadOptions offload;
  StreamGradients stream_mode;  // parsed before the shard allocates anything
  offload_detail::HostShard shard;
  // Host gradients: one buffer, two with the delayed update (one filled while the
  // background update reads the other). grads[fill] receives this step's gradients.
  offload_detail::HostGrads grads[2];
  int fill = 0;
  std::unique_ptr<offload_detail::DelayedUpdater> updater;    // with the delayed update
  std::unique_ptr<offload_detail::GradientStreamer> streamer;  // after attach(), when streaming
  const GradReducer* reducer = nullptr;                         // attach()'s
  double lr;
  int64_t steps = 0;                   // steps taken (the one in flight included)
  std::optional<UpdateTiming> timing;  // of the last synchronous update
};

OffloadedOptimizer::OffloadedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                       dist::Communicator& dp, const OffloadOptions& offload_options)
    : options_(options), params_(std::move(params)) {
  validate(options_);
  check_one_flat_space(params_, "optimizer offload");
  impl_ = std::make_unique<Impl>(params_, options_, dp, offload_options);
  Impl& s = *impl_;
  if (offload_options.delayed_update_after >= 0) {
    // One rank's host parameters hand their own gradients to the update (step()): the
    // buffers are allocated only if a step has to copy instead.
    if (!s.shard.host_local()) {
      s.grads[0] = s.shard.allocate_grads();
      s.grads[1] = s.shard.allocate_grads();
    }
    s.updater = std::make_unique<offload_detail::DelayedUpdater>(s.shard);
  }
  const offload::CpuOptimizer& cpu = s.shard.cpu();
  LOG_IF(INFO, dp.rank() == 0) << "optimizer offload: " << s.shard.numel() << " parameters, " << dp.size()
                               << " shard(s), " << cpu.host_bytes() / (1024.0 * 1024.0)
                               << " MiB of host memory per rank, " << cpu.threads() << " CPU thread(s), "
                               << offload::to_string(cpu.isa()) << " kernels"
                               << (offload_options.delayed_update_after >= 0
                                       ? ", delayed update after " +
                                             std::to_string(offload_options.delayed_update_after) + " step(s)"
                                       : std::string());
}

OffloadedOptimizer::~OffloadedOptimizer() = default;

void OffloadedOptimizer::attach(GradReducer& reducer) {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.updater || !s.updater->in_flight(),
               "OffloadedOptimizer::attach while an update is in flight; flush() first");
  s.streamer.reset();
  s.reducer = &reducer;
  const bool stream = s.stream_mode == StreamGradients::kOn ||
                      (s.stream_mode == StreamGradients::kAuto && s.shard.device().has_value());
  if (!stream) return;
  if (s.grads[0].chunks.empty()) s.grads[0] = s.shard.allocate_grads();
  if (s.updater && s.grads[1].chunks.empty()) s.grads[1] = s.shard.allocate_grads();  // the stream fills both
  s.streamer = std::make_unique<offload_detail::GradientStreamer>(s.shard, params_, reducer, &s.grads[s.fill]);
}

bool OffloadedOptimizer::streams_gradients() const { return impl_->streamer != nullptr; }

void OffloadedOptimizer::skip_step() {
  Impl& s = *impl_;
  if (s.streamer && s.streamer->pending()) s.streamer->take(/*host_sync=*/false);
}

void OffloadedOptimizer::step(const at::Tensor& grad_multiplier) {
  at::NoGradGuard no_grad;
  Impl& s = *impl_;
  DTRAIN_CHECK(!grad_multiplier.defined() || grad_multiplier.numel() == 1,
               "optimizer offload: the gradient multiplier must be a one-element tensor, got ",
               grad_multiplier.toString());
  const double multiplier = grad_multiplier.defined() ? grad_multiplier.item<double>() : 1.0;
  const bool delayed = s.updater && s.steps >= s.offload.delayed_update_after;
  const bool streamed = s.streamer && s.streamer->pending();
  if (streamed) s.streamer->take(/*host_sync=*/true);
  offload_detail::HostGrads& grads = s.grads[s.fill];
  if (!delayed) {
    s.shard.set_output(s.shard.flat());  // back to the parameters if a checkpoint moved the step count back
    const auto start = std::chrono::steady_clock::now();
    if (streamed) {
      s.shard.update(grads, multiplier, s.lr);
    } else {
      s.shard.update_from_params(multiplier, s.lr);  // written back into the flat buffer
    }
    s.timing = UpdateTiming{start, std::chrono::steady_clock::now(), false};
    s.shard.all_gather(s.shard.own_part_of_flat());
    ++s.steps;
    return;
  }
  // Delayed: this step's gradients into a host buffer of their own (streamed already, or
  // copied now, or, for one rank's host parameters whose gradients are autograd's own, those
  // tensors handed to the update), publish the update in flight, then start this step's update
  // and return.
  if (!streamed && s.shard.host_local() && gradients_can_be_taken(params_, s.reducer)) {
    std::vector<at::Tensor> taken;
    taken.reserve(params_.size());
    for (const at::Tensor& p : params_) {
      taken.push_back(p.grad());
      p.mutable_grad().reset();  // the next backward makes new ones; nobody may zero these
    }
    s.updater->publish();
    s.updater->start(std::move(taken), multiplier, s.lr);
    ++s.steps;
    return;
  }
  // The update in flight is published first (it reads the other buffer): the copy then has the
  // host's cores to itself.
  s.updater->publish();
  if (!streamed) {
    if (grads.chunks.empty()) grads = s.shard.allocate_grads();
    s.shard.copy_grads_from_params(grads, params_);
  }
  s.updater->start(grads, multiplier, s.lr);
  s.fill ^= 1;
  if (s.streamer) s.streamer->set_target(&s.grads[s.fill]);
  ++s.steps;
}

void OffloadedOptimizer::flush() {
  at::NoGradGuard no_grad;
  if (impl_->updater) impl_->updater->publish();
}

bool OffloadedOptimizer::update_in_flight() const { return impl_->updater && impl_->updater->in_flight(); }

std::optional<UpdateTiming> OffloadedOptimizer::take_update_timing() {
  if (impl_->updater) {
    if (auto t = impl_->updater->take_timing()) return t;
  }
  return std::exchange(impl_->timing, std::nullopt);
}

void OffloadedOptimizer::zero_grad() {
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

void OffloadedOptimizer::set_lr(double lr) {
  DTRAIN_CHECK(std::isfinite(lr) && lr >= 0, "learning rate ", lr, " must be a finite number >= 0");
  impl_->lr = lr;
  options_.lr = lr;
}

double OffloadedOptimizer::lr() const { return impl_->lr; }

int64_t OffloadedOptimizer::host_bytes() const { return impl_->shard.host_bytes(); }

std::vector<at::Tensor> OffloadedOptimizer::device_state() const {
  if (!impl_->updater || !impl_->updater->next().defined()) return {};
  return {impl_->updater->next()};
}

std::vector<FlatRange> OffloadedOptimizer::gradient_owners() const {
  const int ranks = impl_->dp->size();
  if (!impl_->offload.reduce_to_owner || ranks == 1) return {};
  std::vector<FlatRange> owners;
  for (int r = 0; r < ranks; ++r) owners.push_back(shard_range(impl_->shard.numel(), ranks, r));
  return owners;
}

std::optional<ShardLayout> OffloadedOptimizer::shard_layout() const {
  // One unit: the range [lo, hi) (none when this rank holds only padding).
  const int64_t lo = impl_->shard.lo(), hi = impl_->shard.hi();
  return lo < hi ? ShardLayout{impl_->shard.numel(), {{lo, hi}}} : ShardLayout{impl_->shard.numel(), {}};
}

std::vector<std::pair<std::string, at::Tensor>> OffloadedOptimizer::state() const { return {}; }

void OffloadedOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  DTRAIN_CHECK(state.empty(), "optimizer offload: load_state got ", state.size(),
               " replicated entries; its state is partitioned (load_shard_state)");
}

ShardState OffloadedOptimizer::shard_state() const {
  if (impl_->updater) impl_->updater->wait();  // the state of every step taken (weights not published)
  ShardState out;
  out.layout = *shard_layout();
  out.tensors = offload_detail::cpu_shard_arrays(impl_->shard.cpu(), out.layout.size());
  return out;
}

void OffloadedOptimizer::load_shard_state(const ShardState& state) {
  const ShardLayout mine = *shard_layout();
  DTRAIN_CHECK(state.layout.numel == mine.numel && state.layout.ranges == mine.ranges,
               "optimizer offload: the partitioned state holds elements ", ranges_text(state.layout.ranges), " of ",
               state.layout.numel, "; this rank holds ", ranges_text(mine.ranges), " of ", mine.numel,
               " (assemble it with assemble_shard)");
  // The CPU optimizer's chunked state, checked before anything changes.
  std::vector<std::pair<std::string, at::Tensor>> target =
      offload_detail::cpu_state_of_arrays(impl_->shard.cpu(), state.tensors, mine.size());
  if (impl_->updater) impl_->updater->drop();  // its result is replaced by what is loaded
  impl_->shard.cpu().load_state(target);
  impl_->steps = impl_->shard.cpu().step_count();
}

}  // namespace dtrain::engine
