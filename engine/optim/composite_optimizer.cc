// Optimizers over two parts of the parameters: those that live on the device, and those layer
// offload keeps on the host (the streamed blocks').
//  * --offload=all on a GPU: the device part is an OffloadedOptimizer (partitioned,
//    host-updated); the host part goes through the fused CPU kernels of make_optimizer(), or
//    through an OffloadedOptimizer of its own: with the delayed update (one rank), so that both
//    parts take the update one step late as they do in one OffloadedOptimizer, and for
//    bfloat16/float16 weights, whose update needs the float32 master make_optimizer() does not
//    keep (--param_dtype=bf16: ZeRO-Offload's layout for the streamed blocks too). On more ranks
//    that one is each rank's whole copy over a one-rank communicator: the gradients are the
//    reduced average already, so every rank's update is the same, as make_optimizer()'s is.
//  * --offload=layers with the delayed update: the device part is make_optimizer()'s (updated
//    as the step ends), the host part an OffloadedOptimizer with the delayed update (dtrain's
//    CPU kernels, overlapped with the next step's forward and backward).
// The trainer sees one Optimizer: the partitioned, streaming and asynchronous parts of the
// contract are the device part's when it is offloaded; the replicated state is both parts'
// under the indices of the whole parameter list. A host part of its own OffloadedOptimizer
// shows its (whole, one-rank) state as replicated entries "<index>.<name>", the names
// make_optimizer() gives (replicated_of_shard / shard_of_replicated, core/shard.h), so
// checkpoints move between the two.
#include <map>
#include <unordered_set>

#include <ATen/ATen.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/offload.h"

namespace dtrain::engine {
namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// "<j>.<rest>" of a part's own state under the whole list's index: index[j].
NamedTensors renumbered(const NamedTensors& state, const std::vector<size_t>& index) {
  NamedTensors out;
  for (auto& [name, t] : state) {
    const auto dot = name.find('.');
    out.emplace_back(std::to_string(index.at(std::stoul(name.substr(0, dot)))) + name.substr(dot), t);
  }
  return out;
}

class CompositeOptimizer final : public Optimizer {
 public:
  CompositeOptimizer(std::vector<at::Tensor> all, std::unique_ptr<Optimizer> device_part, std::vector<size_t> device_index,
                     std::unique_ptr<Optimizer> host_part, std::vector<size_t> host_index, const OptimizerOptions& options,
                     std::unique_ptr<dist::Communicator> host_comm = nullptr)
      : all_(std::move(all)), host_comm_(std::move(host_comm)), device_(std::move(device_part)),
        host_(std::move(host_part)), device_index_(std::move(device_index)), host_index_(std::move(host_index)),
        options_(options) {
    device_offloaded_ = dynamic_cast<OffloadedOptimizer*>(device_.get());
    host_offloaded_ = dynamic_cast<OffloadedOptimizer*>(host_.get());
  }
  using Optimizer::step;
  void step(const at::Tensor& grad_multiplier) override {
    device_->step(grad_multiplier);
    host_->step(grad_multiplier);
  }
  void skip_step() override {
    device_->skip_step();
    host_->skip_step();
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
  NamedTensors state() const override {
    NamedTensors out = device_offloaded_ ? NamedTensors{} : renumbered(device_->state(), device_index_);
    // An offloaded host part (one rank): its whole state as per-parameter entries (core/shard.h).
    const NamedTensors host = host_offloaded_ ? replicated_of_shard(host_->params(), host_->shard_state(),
                                                                    /*to_param_options=*/false)
                                              : host_->state();
    for (auto& entry : renumbered(host, host_index_)) {
      out.push_back(std::move(entry));
    }
    return out;
  }
  void load_state(const NamedTensors& state) override {
    std::map<size_t, std::pair<bool, size_t>> local;  // whole index -> (host part?, its index)
    for (size_t j = 0; j < host_index_.size(); ++j) local[host_index_[j]] = {true, j};
    if (!device_offloaded_) {
      for (size_t j = 0; j < device_index_.size(); ++j) local[device_index_[j]] = {false, j};
    }
    NamedTensors device_state, host_state;
    for (auto& [name, t] : state) {
      auto dot = name.find('.');
      auto it = dot == std::string::npos ? local.end() : local.find(std::stoul(name.substr(0, dot)));
      DTRAIN_CHECK(it != local.end(), "optimizer state '", name, "' is not of a ",
                   device_offloaded_ ? "host-resident " : "", "parameter of this optimizer");
      (it->second.first ? host_state : device_state)
          .emplace_back(std::to_string(it->second.second) + name.substr(dot), t);
    }
    if (!device_offloaded_) device_->load_state(device_state);
    if (host_offloaded_) {  // the master from the weights, loaded first (core/shard.h)
      host_->load_shard_state(shard_of_replicated(host_->params(), host_state, *host_->shard_layout()));
    } else {
      host_->load_state(host_state);
    }
  }
  const std::vector<at::Tensor>& params() const override { return all_; }

  // The parameters live on two devices: every rank reads every gradient (no owner ranges).
  void attach(GradReducer& reducer) override {
    device_->attach(reducer);
    host_->attach(reducer);
  }
  void flush() override {
    device_->flush();
    host_->flush();
  }
  int64_t host_bytes() const override { return device_->host_bytes() + host_->host_bytes(); }
  // Both parts' (the memory report sorts them by device: the host part's are host memory).
  std::vector<at::Tensor> device_state() const override {
    std::vector<at::Tensor> out = device_->device_state();
    for (at::Tensor& t : host_->device_state()) out.push_back(std::move(t));
    return out;
  }
  std::optional<UpdateTiming> take_update_timing() override {
    if (auto t = device_->take_update_timing()) return t;
    return host_->take_update_timing();
  }
  // The device part's flat space (the device parameters end to end) when it is partitioned.
  std::optional<ShardLayout> shard_layout() const override {
    return device_offloaded_ ? device_->shard_layout() : std::nullopt;
  }
  ShardState shard_state() const override { return device_offloaded_ ? device_->shard_state() : ShardState{}; }
  void load_shard_state(const ShardState& state) override {
    if (device_offloaded_) {
      device_->load_shard_state(state);
    } else {
      Optimizer::load_shard_state(state);
    }
  }

 private:
  std::vector<at::Tensor> all_;
  std::unique_ptr<dist::Communicator> host_comm_;  // the host part's one-rank communicator (outlives it)
  std::unique_ptr<Optimizer> device_;
  std::unique_ptr<Optimizer> host_;
  std::vector<size_t> device_index_;
  std::vector<size_t> host_index_;
  OptimizerOptions options_;
  OffloadedOptimizer* device_offloaded_ = nullptr;  // device_, when it is one
  OffloadedOptimizer* host_offloaded_ = nullptr;    // host_, when it is one
};

// The host part's OffloadedOptimizer: its own copies of the gradients are never streamed from
// the reducer (the device part's stream is the reducer's one observer; host parameters hand
// their gradients over as they are).
OffloadOptions host_part_offload(OffloadOptions offload) {
  offload.stream_gradients = "off";
  return offload;
}

bool reduced_precision(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    if (p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf) return true;
  }
  return false;
}

struct Split {
  std::vector<at::Tensor> on_device, on_host;
  std::vector<size_t> device_index, host_index;
};

Split split(const std::vector<at::Tensor>& params, c10::Device device, const std::vector<at::Tensor>& streamed) {
  std::unordered_set<const c10::TensorImpl*> listed;
  for (const at::Tensor& p : streamed) listed.insert(p.unsafeGetTensorImpl());
  Split s;
  for (size_t i = 0; i < params.size(); ++i) {
    if ((!device.is_cpu() && params[i].device().is_cpu()) || listed.count(params[i].unsafeGetTensorImpl())) {
      s.on_host.push_back(params[i]);
      s.host_index.push_back(i);
    } else {
      s.on_device.push_back(params[i]);
      s.device_index.push_back(i);
    }
  }
  return s;
}

// The host part's delayed update is one rank's: the parts of more ranks would each take the
// update at another step, and make_optimizer()'s replicated update is not delayed.
void check_one_rank_for_delayed_host_part(const dist::Communicator& dp, const char* flags) {
  DTRAIN_CHECK(dp.size() == 1, flags, " with the delayed update (--offload_delayed_update_after) on ", dp.size(),
               " data-parallel ranks: the streamed blocks' update on the host is delayed only on one rank; train on "
               "one data-parallel rank, or without --offload_delayed_update_after");
}

}  // namespace

std::unique_ptr<Optimizer> make_offload_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                                  dist::Communicator& dp, const OffloadOptions& offload,
                                                  c10::Device device, const std::vector<at::Tensor>& streamed) {
  Split s = split(params, device, streamed);
  if (s.on_host.empty()) return std::make_unique<OffloadedOptimizer>(std::move(params), options, dp, offload);
  DTRAIN_CHECK(!s.on_device.empty(), "optimizer offload: every parameter already lives on the host");
  const bool delayed = offload.delayed_update_after >= 0;
  if (delayed) check_one_rank_for_delayed_host_part(dp, "--offload=all");
  auto device_part = std::make_unique<OffloadedOptimizer>(s.on_device, options, dp, offload);
  std::unique_ptr<Optimizer> host_part;
  std::unique_ptr<dist::Communicator> host_comm;
  if (delayed || reduced_precision(s.on_host)) {
    if (dp.size() > 1) host_comm = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
    host_part = std::make_unique<OffloadedOptimizer>(s.on_host, options, host_comm ? *host_comm : dp,
                                                     host_part_offload(offload));
  } else {
    host_part = make_optimizer(s.on_host, options);
  }
  return std::make_unique<CompositeOptimizer>(std::move(params), std::move(device_part), std::move(s.device_index),
                                              std::move(host_part), std::move(s.host_index), options,
                                              std::move(host_comm));
}

std::unique_ptr<Optimizer> make_layer_offload_optimizer(std::vector<at::Tensor> params,
                                                        const std::vector<at::Tensor>& streamed,
                                                        const OptimizerOptions& options, dist::Communicator& dp,
                                                        const OffloadOptions& offload, c10::Device device) {
  DTRAIN_CHECK(offload.delayed_update_after >= 0, "make_layer_offload_optimizer is the delayed update's optimizer: "
               "set OffloadOptions::delayed_update_after (--offload_delayed_update_after), or use make_optimizer()");
  check_one_rank_for_delayed_host_part(dp, "--offload=layers");
  Split s = split(params, device, streamed);
  DTRAIN_CHECK(!s.on_host.empty(), "--offload=layers with --offload_delayed_update_after: no parameter is streamed "
               "from the host (the model has no blocks to stream, or they were not given)");
  auto host_part = std::make_unique<OffloadedOptimizer>(s.on_host, options, dp, host_part_offload(offload));
  if (s.on_device.empty()) return host_part;
  auto device_part = make_optimizer(s.on_device, options);
  return std::make_unique<CompositeOptimizer>(std::move(params), std::move(device_part), std::move(s.device_index),
                                              std::move(host_part), std::move(s.host_index), options);
}

}  // namespace dtrain::engine
