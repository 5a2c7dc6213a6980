#include "dtrain/engine/offload.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/pinned_pool.h"

namespace dtrain::engine {

OffloadChoice parse_offload(const std::string& text) {
  if (text == "none") return {false, false};
  if (text == "optimizer") return {true, false};
  if (text == "layers") return {false, true};
  if (text == "all") return {true, true};
  throw Error("--offload=" + text + " is not one of: none, optimizer, layers, all");
}

namespace {

// A gradient buffer of the shard's real elements in pinned host memory, in chunks of the CPU
// optimizer's chunk_elems (pinned blocks are rounded up to a power of two, so one 12 GB
// buffer would take 16 GB).
struct HostGrads {
  std::vector<at::Tensor> chunks;  // chunk c: shard elements [c * chunk, ...)
};

}  // namespace

struct OffloadedOptimizer::Impl {
  dist::Communicator* dp = nullptr;
  OffloadOptions offload;
  std::unique_ptr<offload::PinnedPool> pool;
  std::unique_ptr<offload::CpuOptimizer> cpu;
  at::Tensor flat;  // the parameters' storage, padded_numel elements
  std::vector<std::string> arrays;  // the rule's state arrays besides "master"
  int64_t lo = 0, hi = 0;           // this rank's real elements [lo, hi) of the flat space
  int64_t chunk = 0;                // elements per host chunk (the CPU optimizer's chunk_elems)
  at::ScalarType host_dtype = at::kFloat;
  std::optional<c10::Device> device;  // the parameters' device when not the CPU
  double lr = 0.0;
  int64_t steps = 0;  // steps taken (the one in flight included)

  // Host gradients: one buffer, two with the delayed update (one filled while the
  // background update reads the other). `fill` is the one streaming writes into.
  HostGrads host[2];
  std::atomic<int> fill{0};
  std::vector<int64_t> offsets;  // flat offset of each parameter

  // --- gradient streaming (a worker thread fed by the reducer's bucket observer)
  GradReducer* reducer = nullptr;
  bool streaming = false;
  std::unordered_map<const void*, size_t> index_of;  // parameter impl -> our index
  std::vector<int64_t> reducer_index;                // reducer parameter -> ours (-1: not ours)
  std::mutex mu;
  std::condition_variable cv;
  std::deque<LaunchedBucket> queue;  // guarded by mu
  bool stop = false;                 // guarded by mu
  int64_t announced = -1;            // newest backward seen (guarded by mu)
  size_t expected = 0;               // its buckets (guarded by mu)
  size_t processed = 0;              // its buckets copied or failed (guarded by mu)
  std::exception_ptr stream_error;   // guarded by mu
  int64_t consumed = -1;             // the backward whose gradients step() used last
  double factor = 1.0;               // set_streamed_gradient_factor()
  std::optional<c10::Stream> copy_stream;
  std::optional<c10::Event> copied;  // recorded after each bucket's copies
  std::thread worker;

  // --- delayed update (an updater thread running one update at a time)
  struct Job {
    int buffer = 0;
    double multiplier = 1.0;
    double lr = 0.0;
  };
  std::optional<Job> job;            // guarded by mu: queued or running
  bool job_running = false;          // guarded by mu
  std::exception_ptr job_error;      // guarded by mu
  bool in_flight = false;            // an update was started and not yet published
  at::Tensor next;                   // its new weights: this rank's shard, on the device
  bool output_next = false;          // the CPU optimizer writes into `next` (else the parameters)
  std::optional<c10::Stream> update_stream;
  std::optional<c10::Event> published;    // main stream: the all-gather read `next`
  std::optional<c10::Event> update_done;  // update stream: `next` written
  std::thread updater;
  std::optional<UpdateTiming> timing;  // guarded by mu

  ~Impl();
  void allocate_host(HostGrads& g);
  void stream_loop();
  void copy_bucket(const LaunchedBucket& event);
  bool streamed_ready();
  void wait_streamed(bool host_sync);
  void copy_grads_from_params(HostGrads& g, const std::vector<at::Tensor>& params);
  void update_from_host(const HostGrads& g, double multiplier, double rate);
  void all_gather(const at::Tensor& shard);
  void update_loop();
  void start_update(int buffer, double multiplier);
  void wait_update();    // the host waits for the update in flight (rethrows its failure)
  void finish_update();  // wait_update(), then its weights into the parameters (collective)
  void set_output_next(bool next_buffer);
};

OffloadedOptimizer::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  if (worker.joinable()) worker.join();
  if (updater.joinable()) updater.join();
}

void OffloadedOptimizer::Impl::allocate_host(HostGrads& g) {
  g.chunks.clear();
  for (int64_t off = 0; off < hi - lo; off += chunk) {
    g.chunks.push_back(pool->allocate(std::min(chunk, hi - lo - off), host_dtype));
  }
}

// Calls fn(chunk index, offset in chunk, n, offset in [lo, hi)) for the pieces of shard
// elements [a, b) (relative to lo) split at boundaries of `chunk` elements.
template <typename Fn>
void for_each_piece(int64_t chunk, int64_t a, int64_t b, Fn&& fn) {
  while (a < b) {
    const int64_t c = a / chunk, in = a % chunk;
    const int64_t n = std::min(b - a, chunk - in);
    fn(static_cast<size_t>(c), in, n, a);
    a += n;
  }
}

void OffloadedOptimizer::Impl::stream_loop() {
  for (;;) {
    LaunchedBucket event;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop
      event = std::move(queue.front());
      queue.pop_front();
    }
    std::exception_ptr failure;
    try {
      copy_bucket(event);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (event.backward == announced) {
        ++processed;
        if (failure && !stream_error) stream_error = failure;
      }
    }
    cv.notify_all();
  }
}

void OffloadedOptimizer::Impl::copy_bucket(const LaunchedBucket& event) {
  std::optional<c10::StreamGuard> guard;
  if (copy_stream) guard.emplace(*copy_stream);
  event.work->wait();  // the copy stream (or this thread, for host results) waits for the average
  HostGrads& g = host[fill.load()];
  for (size_t k = 0; k < event.params.size(); ++k) {
    const int64_t j = event.params[k] < reducer_index.size() ? reducer_index[event.params[k]] : -1;
    if (j < 0) continue;
    const int64_t p_lo = offsets[j];
    const int64_t a = std::max(p_lo, lo), b = std::min(offsets[j + 1], hi);
    if (a >= b) continue;
    at::Tensor src = event.values.narrow(0, event.offsets[k] + (a - p_lo), b - a);
    for_each_piece(chunk, a - lo, b - lo, [&](size_t c, int64_t in, int64_t n, int64_t at_) {
      g.chunks[c].narrow(0, in, n).copy_(src.narrow(0, at_ - (a - lo), n), /*non_blocking=*/copy_stream.has_value());
    });
  }
  if (copy_stream) copied->record(*copy_stream);
}

bool OffloadedOptimizer::Impl::streamed_ready() {
  if (!streaming) return false;
  std::lock_guard<std::mutex> lock(mu);
  return announced > consumed;
}

void OffloadedOptimizer::Impl::wait_streamed(bool host_sync) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return processed >= expected; });
  if (stream_error) {
    std::exception_ptr e = stream_error;
    stream_error = nullptr;
    std::rethrow_exception(e);
  }
  lock.unlock();
  if (!copied) return;
  if (host_sync) {
    copied->synchronize();
  } else {
    c10::impl::VirtualGuardImpl impl(device->type());
    copied->block(impl.getStream(*device));
  }
}

void OffloadedOptimizer::Impl::copy_grads_from_params(HostGrads& g, const std::vector<at::Tensor>& params) {
  for (size_t j = 0; j < params.size(); ++j) {
    const int64_t p_lo = offsets[j];
    const int64_t a = std::max(p_lo, lo), b = std::min(offsets[j + 1], hi);
    if (a >= b) continue;
    at::Tensor grad = params[j].grad();
    for_each_piece(chunk, a - lo, b - lo, [&](size_t c, int64_t in, int64_t n, int64_t at_) {
      at::Tensor dst = g.chunks[c].narrow(0, in, n);
      if (grad.defined()) {
        dst.copy_(grad.detach().reshape({-1}).narrow(0, at_ + lo - p_lo, n));
      } else {
        dst.zero_();
      }
    });
  }
}

void OffloadedOptimizer::Impl::update_from_host(const HostGrads& g, double multiplier, double rate) {
  cpu->set_lr(rate);
  cpu->begin_step(multiplier);
  for_each_piece(chunk, 0, hi - lo, [&](size_t c, int64_t in, int64_t n, int64_t at_) {
    cpu->step_range(lo + at_, lo + at_ + n, g.chunks[c].narrow(0, in, n));
  });
  cpu->end_step();
}

void OffloadedOptimizer::Impl::all_gather(const at::Tensor& shard) {
  if (dp->size() > 1) {
    dp->all_gather(shard, flat)->wait();
  } else if (shard.data_ptr() != flat.data_ptr()) {
    flat.copy_(shard);
  }
}

void OffloadedOptimizer::Impl::set_output_next(bool next_buffer) {
  if (next_buffer == output_next || !cpu->options().write_back) return;
  cpu->set_output(next_buffer ? next : flat);
  output_next = next_buffer;
}

void OffloadedOptimizer::Impl::update_loop() {
  for (;;) {
    Job j;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || (job && !job_running); });
      if (stop) return;
      j = *job;
      job_running = true;
    }
    std::exception_ptr failure;
    try {
      std::optional<c10::StreamGuard> guard;
      if (update_stream) {
        guard.emplace(*update_stream);
        published->block(*update_stream);  // `next` was read by the last all-gather
      }
      const auto start = std::chrono::steady_clock::now();
      update_from_host(host[j.buffer], j.multiplier, j.lr);
      if (update_stream) update_done->record(*update_stream);
      std::lock_guard<std::mutex> lock(mu);
      timing = UpdateTiming{start, std::chrono::steady_clock::now(), true};
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      job.reset();
      job_running = false;
      job_error = failure;
    }
    cv.notify_all();
  }
}

void OffloadedOptimizer::Impl::start_update(int buffer, double multiplier) {
  if (!updater.joinable()) updater = std::thread([this] { update_loop(); });
  if (published) {
    c10::impl::VirtualGuardImpl impl(device->type());
    published->record(impl.getStream(*device));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    job = Job{buffer, multiplier, lr};
  }
  cv.notify_all();
  in_flight = true;
}

void OffloadedOptimizer::Impl::wait_update() {
  std::exception_ptr failure;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return !job.has_value(); });
    failure = job_error;
    job_error = nullptr;
  }
  if (failure) {
    in_flight = false;
    std::rethrow_exception(failure);
  }
}

void OffloadedOptimizer::Impl::finish_update() {
  if (!in_flight) return;
  wait_update();
  in_flight = false;
  if (update_done) {
    c10::impl::VirtualGuardImpl impl(device->type());
    update_done->block(impl.getStream(*device));
  }
  all_gather(next);
}

namespace {

offload::CpuOptimizerOptions cpu_options(const OptimizerOptions& o, int rank, int count, int threads) {
  offload::CpuOptimizerOptions c;
  c.name = o.name;
  c.lr = o.lr;
  c.weight_decay = o.weight_decay;
  c.momentum = o.momentum;
  c.dampening = o.dampening;
  c.nesterov = o.nesterov;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.eps = effective_eps(o);
  c.amsgrad = o.amsgrad;
  c.lr_decay = o.lr_decay;
  c.initial_accumulator_value = o.initial_accumulator_value;
  c.shard_rank = rank;
  c.shard_count = count;
  c.threads = threads;
  return c;
}

// "<array>.<chunk>" -> array
std::string array_of(const std::string& name) { return name.substr(0, name.rfind('.')); }

}  // namespace

OffloadedOptimizer::OffloadedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                       dist::Communicator& dp, const OffloadOptions& offload_options)
    : options_(options), params_(std::move(params)), impl_(std::make_unique<Impl>()) {
  validate(options_);
  DTRAIN_CHECK(!params_.empty(), "optimizer offload needs at least one parameter");
  const std::string& stream = offload_options.stream_gradients;
  DTRAIN_CHECK(stream == "auto" || stream == "on" || stream == "off", "gradient streaming '", stream,
               "' is not one of: auto, on, off");
  const at::Tensor& first = params_.front();
  for (size_t i = 0; i < params_.size(); ++i) {
    DTRAIN_CHECK(params_[i].scalar_type() == first.scalar_type() && params_[i].device() == first.device(),
                 "optimizer offload needs all parameters in one dtype and device; parameter ", i, " is ",
                 params_[i].scalar_type(), " on ", params_[i].device(), ", parameter 0 ",
                 first.scalar_type(), " on ", first.device());
  }
  Impl& s = *impl_;
  s.dp = &dp;
  s.offload = offload_options;
  s.lr = options_.lr;
  if (!first.device().is_cpu()) s.device = first.device();
  offload::PinnedPoolOptions po;
  po.limit_bytes = offload_options.host_mem_limit_gb > 0
                       ? offload::host_limit_bytes_from_gb(offload_options.host_mem_limit_gb)
                       : 0;
  s.pool = std::make_unique<offload::PinnedPool>(po);
  // The parameters become views of one flat buffer laid out as the CPU optimizer's flat space.
  int64_t numel = 0;
  for (const at::Tensor& p : params_) numel += p.numel();
  const int64_t padded = offload::padded_numel(numel, dp.size());
  s.flat = at::zeros({padded}, first.options().requires_grad(false));
  {
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (at::Tensor& p : params_) {
      at::Tensor view = s.flat.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
      offset += p.numel();
    }
  }
  s.cpu = std::make_unique<offload::CpuOptimizer>(
      params_, cpu_options(options_, dp.rank(), dp.size(), offload_options.threads), *s.pool);
  s.cpu->set_output(s.flat);
  s.chunk = s.cpu->options().chunk_elems;
  s.lo = std::min(s.cpu->shard().begin, numel);
  s.hi = std::min(s.cpu->shard().end, numel);
  s.offsets.push_back(0);
  for (const at::Tensor& p : params_) s.offsets.push_back(s.offsets.back() + p.numel());
  for (auto& [name, t] : s.cpu->state()) {
    std::string a = array_of(name);
    if (name != "step" && name != "layout" && a != "master" &&
        std::find(s.arrays.begin(), s.arrays.end(), a) == s.arrays.end()) {
      s.arrays.push_back(a);
    }
  }
  const at::ScalarType dtype = first.scalar_type();
  s.host_dtype = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ? dtype : at::kFloat;
  if (s.device) {
    c10::impl::VirtualGuardImpl impl(s.device->type());
    s.copy_stream = impl.getStreamFromGlobalPool(*s.device, /*isHighPriority=*/false);
    s.copied.emplace(s.device->type());
  }
  if (offload_options.delayed_update_after >= 0) {
    // Second gradient buffer and the device staging of the update in flight.
    s.next = at::zeros({s.cpu->shard().size()}, s.flat.options());
    s.allocate_host(s.host[0]);
    s.allocate_host(s.host[1]);
    if (s.device) {
      c10::impl::VirtualGuardImpl impl(s.device->type());
      s.update_stream = impl.getStreamFromGlobalPool(*s.device, /*isHighPriority=*/false);
      s.published.emplace(s.device->type());
      s.update_done.emplace(s.device->type());
    }
  }
  LOG_IF(INFO, dp.rank() == 0) << "optimizer offload: " << numel << " parameters, " << dp.size()
                               << " shard(s), " << s.cpu->host_bytes() / (1024.0 * 1024.0)
                               << " MiB of host memory per rank, " << s.cpu->threads()
                               << " CPU thread(s), " << offload::to_string(s.cpu->isa()) << " kernels"
                               << (offload_options.delayed_update_after >= 0
                                       ? ", delayed update after " +
                                             std::to_string(offload_options.delayed_update_after) + " step(s)"
                                       : std::string());
}

OffloadedOptimizer::~OffloadedOptimizer() {
  if (impl_->reducer) {
    try {
      impl_->reducer->set_bucket_observer(nullptr);
    } catch (const std::exception& e) {
      LOG(ERROR) << "optimizer offload teardown: " << e.what();
    }
  }
}

void OffloadedOptimizer::attach(GradReducer* reducer) {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.in_flight, "OffloadedOptimizer::attach while an update is in flight; flush() first");
  if (s.reducer) s.reducer->set_bucket_observer(nullptr);
  s.reducer = reducer;
  const std::string& mode = s.offload.stream_gradients;
  s.streaming = reducer != nullptr && (mode == "on" || (mode == "auto" && s.device.has_value()));
  if (!s.streaming) return;
  std::unordered_map<const void*, size_t> mine;
  for (size_t j = 0; j < params_.size(); ++j) mine[params_[j].unsafeGetTensorImpl()] = j;
  s.reducer_index.assign(reducer->params().size(), -1);
  for (size_t i = 0; i < reducer->params().size(); ++i) {
    auto it = mine.find(reducer->params()[i].unsafeGetTensorImpl());
    if (it != mine.end()) s.reducer_index[i] = static_cast<int64_t>(it->second);
  }
  if (s.host[0].chunks.empty()) s.allocate_host(s.host[0]);
  if (!s.worker.joinable()) s.worker = std::thread([&s] { s.stream_loop(); });
  Impl* self = &s;
  reducer->set_bucket_observer([self](const LaunchedBucket& event) {
    {
      std::lock_guard<std::mutex> lock(self->mu);
      if (event.backward != self->announced) {
        self->announced = event.backward;
        self->processed = 0;
        self->stream_error = nullptr;
      }
      self->expected = event.count;
      self->queue.push_back(event);
    }
    self->cv.notify_all();
  });
}

bool OffloadedOptimizer::streams_gradients() const { return impl_->streaming; }

void OffloadedOptimizer::wait_streamed_gradients() {
  if (impl_->streamed_ready()) impl_->wait_streamed(/*host_sync=*/false);
}

void OffloadedOptimizer::set_streamed_gradient_factor(double factor) {
  DTRAIN_CHECK(std::isfinite(factor), "streamed gradient factor ", factor, " is not finite");
  impl_->factor = factor;
}

void OffloadedOptimizer::step() {
  at::NoGradGuard no_grad;
  Impl& s = *impl_;
  const bool delayed = s.offload.delayed_update_after >= 0 && s.steps >= s.offload.delayed_update_after;
  const double factor = s.factor;
  s.factor = 1.0;
  const bool streamed = s.streamed_ready();
  if (streamed) {
    s.wait_streamed(/*host_sync=*/true);
    std::lock_guard<std::mutex> lock(s.mu);
    s.consumed = s.announced;
  }
  const int fill = s.fill.load();
  if (!delayed) {
    s.set_output_next(false);  // back to the parameters if a checkpoint moved the step count back
    const auto start = std::chrono::steady_clock::now();
    if (streamed) {
      s.update_from_host(s.host[fill], factor, s.lr);
    } else {
      s.cpu->set_lr(s.lr);
      s.cpu->step();  // this rank's shard from .grad, written back into the flat buffer
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.timing = UpdateTiming{start, std::chrono::steady_clock::now(), false};
    }
    const int64_t n = s.flat.numel() / s.dp->size();
    s.all_gather(s.flat.narrow(0, s.dp->rank() * n, n));
    ++s.steps;
    return;
  }
  // Delayed: this step's gradients into a host buffer of their own (streamed already, or
  // copied now), publish the update in flight, then start this step's update and return.
  if (!streamed) s.copy_grads_from_params(s.host[fill], params_);
  s.finish_update();
  s.set_output_next(true);
  s.start_update(fill, streamed ? factor : 1.0);
  s.fill.store(fill ^ 1);
  ++s.steps;
}

void OffloadedOptimizer::flush() {
  at::NoGradGuard no_grad;
  impl_->finish_update();
}

bool OffloadedOptimizer::update_in_flight() const { return impl_->in_flight; }

std::optional<OffloadedOptimizer::UpdateTiming> OffloadedOptimizer::take_update_timing() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::optional<UpdateTiming> t = impl_->timing;
  impl_->timing.reset();
  return t;
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

int64_t OffloadedOptimizer::numel() const { return impl_->cpu->numel(); }
int64_t OffloadedOptimizer::shard_begin() const { return std::min(impl_->cpu->shard().begin, numel()); }
int64_t OffloadedOptimizer::shard_end() const { return std::min(impl_->cpu->shard().end, numel()); }
int64_t OffloadedOptimizer::host_bytes() const { return impl_->pool->used_bytes(); }

std::vector<std::pair<std::string, at::Tensor>> OffloadedOptimizer::state() const {
  // Chunks of each array joined into the shard's real elements.
  if (impl_->in_flight) impl_->wait_update();  // the state of every step taken (weights not published)
  std::map<std::string, std::vector<at::Tensor>> chunks;
  at::Tensor step;
  for (auto& [name, t] : impl_->cpu->state()) {
    if (name == "step") {
      step = t.clone();
    } else if (name != "layout") {
      chunks[array_of(name)].push_back(t);  // chunk order as listed (ascending)
    }
  }
  const int64_t real = shard_end() - shard_begin();
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("step", step);
  for (auto& [array, parts] : chunks) out.emplace_back(array, at::cat(parts).narrow(0, 0, real).clone());
  return out;
}

void OffloadedOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  load_resharded({{{shard_begin(), shard_end()}, state}});
}

void OffloadedOptimizer::load_resharded(
    const std::vector<std::pair<std::pair<int64_t, int64_t>, NamedTensors>>& old) {
  if (impl_->in_flight) {  // its result is replaced by what is loaded
    impl_->wait_update();
    impl_->in_flight = false;
  }
  const int64_t begin = shard_begin(), end = shard_end();
  // Assemble each array of [begin, end) from the old ranges that overlap it.
  std::map<std::string, at::Tensor> arrays;
  at::Tensor step;
  int64_t covered = 0;
  for (auto& [range, named] : old) {
    const int64_t lo = std::max(begin, range.first), hi = std::min(end, range.second);
    for (auto& [name, t] : named) {
      if (name == "step") {
        step = t;
        continue;
      }
      at::Tensor& a = arrays[name];
      if (!a.defined()) a = at::zeros({end - begin}, at::kFloat);
      DTRAIN_CHECK(t.dim() == 1 && t.numel() == range.second - range.first, "offloaded optimizer state '", name,
                   "' has ", t.numel(), " elements for a range of ", range.second - range.first);
      if (hi > lo) a.narrow(0, lo - begin, hi - lo).copy_(t.narrow(0, lo - range.first, hi - lo));
    }
    if (hi > lo) covered += hi - lo;
  }
  DTRAIN_CHECK(covered == end - begin, "the saved optimizer shards cover ", covered, " of this rank's ",
               end - begin, " elements; the checkpoint is incomplete or of another model");
  DTRAIN_CHECK(step.defined(), "the saved optimizer state has no 'step'");
  // Back into the CPU optimizer's chunked layout.
  std::vector<std::pair<std::string, at::Tensor>> target;
  for (auto& [name, t] : impl_->cpu->state()) {
    if (name == "step") {
      target.emplace_back(name, step.to(t.scalar_type()).reshape(t.sizes()));
    } else if (name == "layout") {
      target.emplace_back(name, t.clone());
    }
  }
  // Chunk c of array a holds shard elements [c * chunk, (c + 1) * chunk).
  std::map<std::string, int64_t> next;
  for (auto& [name, t] : impl_->cpu->state()) {
    if (name == "step" || name == "layout") continue;
    const std::string a = array_of(name);
    auto it = arrays.find(a);
    DTRAIN_CHECK(it != arrays.end(), "the saved optimizer state has no '", a, "' (another --optimizer?)");
    const int64_t off = next[a];
    at::Tensor chunk = at::zeros({t.numel()}, at::kFloat);
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(t.numel(), (end - begin) - off));
    if (n > 0) chunk.narrow(0, 0, n).copy_(it->second.narrow(0, off, n));
    next[a] = off + t.numel();
    target.emplace_back(name, chunk);
  }
  impl_->cpu->load_state(target);
  impl_->steps = impl_->cpu->step_count();
}

namespace {

class CompositeOptimizer final : public Optimizer {
 public:
  CompositeOptimizer(std::vector<at::Tensor> all, std::unique_ptr<OffloadedOptimizer> device_part,
                     std::unique_ptr<Optimizer> host_part, std::vector<size_t> host_index,
                     const OptimizerOptions& options)
      : all_(std::move(all)), device_(std::move(device_part)), host_(std::move(host_part)),
        host_index_(std::move(host_index)), options_(options) {}
  void step() override {
    device_->step();
    host_->step();
  }
  void zero_grad() override {
    device_->zero_grad();
    host_->zero_grad();
  }
  void set_lr(double lr) override {
    device_->set_lr(lr);
    host_->set_lr(lr);
    options_.lr = lr;
  }
  double lr() const override { return options_.lr; }
  const OptimizerOptions& options() const override { return options_; }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (auto& [name, t] : host_->state()) {
      auto dot = name.find('.');
      size_t j = std::stoul(name.substr(0, dot));
      out.emplace_back(std::to_string(host_index_.at(j)) + name.substr(dot), t);
    }
    return out;
  }
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override {
    std::map<size_t, size_t> local;
    for (size_t j = 0; j < host_index_.size(); ++j) local[host_index_[j]] = j;
    std::vector<std::pair<std::string, at::Tensor>> mine;
    for (auto& [name, t] : state) {
      auto dot = name.find('.');
      auto it = local.find(std::stoul(name.substr(0, dot)));
      DTRAIN_CHECK(it != local.end(), "optimizer state '", name, "' is not of a host-resident parameter");
      mine.emplace_back(std::to_string(it->second) + name.substr(dot), t);
    }
    host_->load_state(mine);
  }
  const std::vector<at::Tensor>& params() const override { return all_; }
  OffloadedOptimizer* device_part() const { return device_.get(); }

 private:
  std::vector<at::Tensor> all_;
  std::unique_ptr<OffloadedOptimizer> device_;
  std::unique_ptr<Optimizer> host_;
  std::vector<size_t> host_index_;
  OptimizerOptions options_;
};

}  // namespace

std::unique_ptr<Optimizer> make_offload_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                                  dist::Communicator& dp, const OffloadOptions& offload,
                                                  c10::Device device) {
  std::vector<at::Tensor> on_device, on_host;
  std::vector<size_t> host_index;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!device.is_cpu() && params[i].device().is_cpu()) {
      on_host.push_back(params[i]);
      host_index.push_back(i);
    } else {
      on_device.push_back(params[i]);
    }
  }
  if (on_host.empty()) return std::make_unique<OffloadedOptimizer>(std::move(params), options, dp, offload);
  DTRAIN_CHECK(!on_device.empty(), "optimizer offload: every parameter already lives on the host");
  auto device_part = std::make_unique<OffloadedOptimizer>(on_device, options, dp, offload);
  auto host_part = make_optimizer(on_host, options);
  return std::make_unique<CompositeOptimizer>(std::move(params), std::move(device_part), std::move(host_part),
                                              std::move(host_index), options);
}

OffloadedOptimizer* offloaded_part(Optimizer* opt) {
  if (auto* o = dynamic_cast<OffloadedOptimizer*>(opt)) return o;
  if (auto* c = dynamic_cast<CompositeOptimizer*>(opt)) return c->device_part();
  return nullptr;
}

}  // namespace dtrain::engine
