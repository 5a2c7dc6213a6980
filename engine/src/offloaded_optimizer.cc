#include "dtrain/engine/offload.h"

#include <algorithm>
#include <map>

#include <ATen/ATen.h>
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

struct OffloadedOptimizer::Impl {
  dist::Communicator* dp = nullptr;
  std::unique_ptr<offload::PinnedPool> pool;
  std::unique_ptr<offload::CpuOptimizer> cpu;
  at::Tensor flat;  // the parameters' storage, padded_numel elements
  std::vector<std::string> arrays;  // the rule's state arrays besides "master"
};

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
  const at::Tensor& first = params_.front();
  for (size_t i = 0; i < params_.size(); ++i) {
    DTRAIN_CHECK(params_[i].scalar_type() == first.scalar_type() && params_[i].device() == first.device(),
                 "optimizer offload needs all parameters in one dtype and device; parameter ", i, " is ",
                 params_[i].scalar_type(), " on ", params_[i].device(), ", parameter 0 ",
                 first.scalar_type(), " on ", first.device());
  }
  impl_->dp = &dp;
  offload::PinnedPoolOptions po;
  po.limit_bytes = offload_options.host_mem_limit_gb > 0
                       ? offload::host_limit_bytes_from_gb(offload_options.host_mem_limit_gb)
                       : 0;
  impl_->pool = std::make_unique<offload::PinnedPool>(po);
  // The parameters become views of one flat buffer laid out as the CPU optimizer's flat space.
  int64_t numel = 0;
  for (const at::Tensor& p : params_) numel += p.numel();
  const int64_t padded = offload::padded_numel(numel, dp.size());
  impl_->flat = at::zeros({padded}, first.options().requires_grad(false));
  {
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (at::Tensor& p : params_) {
      at::Tensor view = impl_->flat.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
      offset += p.numel();
    }
  }
  impl_->cpu = std::make_unique<offload::CpuOptimizer>(
      params_, cpu_options(options_, dp.rank(), dp.size(), offload_options.threads), *impl_->pool);
  impl_->cpu->set_output(impl_->flat);
  for (auto& [name, t] : impl_->cpu->state()) {
    std::string a = array_of(name);
    if (name != "step" && name != "layout" && a != "master" &&
        std::find(impl_->arrays.begin(), impl_->arrays.end(), a) == impl_->arrays.end()) {
      impl_->arrays.push_back(a);
    }
  }
  LOG_IF(INFO, dp.rank() == 0) << "optimizer offload: " << numel << " parameters, " << dp.size()
                               << " shard(s), " << impl_->cpu->host_bytes() / (1024.0 * 1024.0)
                               << " MiB of host memory per rank, " << impl_->cpu->threads()
                               << " CPU thread(s), " << offload::to_string(impl_->cpu->isa()) << " kernels";
}

OffloadedOptimizer::~OffloadedOptimizer() = default;

void OffloadedOptimizer::step() {
  at::NoGradGuard no_grad;
  impl_->cpu->step();  // this rank's shard, written back into the flat buffer
  dist::Communicator& dp = *impl_->dp;
  if (dp.size() > 1) {
    const int64_t s = impl_->flat.numel() / dp.size();
    dp.all_gather(impl_->flat.narrow(0, dp.rank() * s, s), impl_->flat)->wait();
  }
}

void OffloadedOptimizer::zero_grad() {
  for (const at::Tensor& p : params_) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

void OffloadedOptimizer::set_lr(double lr) {
  impl_->cpu->set_lr(lr);
  options_.lr = lr;
}

double OffloadedOptimizer::lr() const { return impl_->cpu->lr(); }

int64_t OffloadedOptimizer::numel() const { return impl_->cpu->numel(); }
int64_t OffloadedOptimizer::shard_begin() const { return std::min(impl_->cpu->shard().begin, numel()); }
int64_t OffloadedOptimizer::shard_end() const { return std::min(impl_->cpu->shard().end, numel()); }
int64_t OffloadedOptimizer::host_bytes() const { return impl_->cpu->host_bytes(); }

std::vector<std::pair<std::string, at::Tensor>> OffloadedOptimizer::state() const {
  // Chunks of each array joined into the shard's real elements.
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
