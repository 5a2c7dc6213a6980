// The optimizer of --offload=all on a GPU: the parameters still on the device go through an
// OffloadedOptimizer (partitioned, host-updated), those layer offload keeps on the host
// through the fused CPU kernels of make_optimizer(). The trainer sees one Optimizer: the
// partitioned, streaming and asynchronous parts of the contract are the device part's, the
// replicated state the host part's (under the indices of the whole parameter list).
#include <map>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/offload.h"

namespace dtrain::engine {
namespace {

class CompositeOptimizer final : public Optimizer {
 public:
  CompositeOptimizer(std::vector<at::Tensor> all, std::unique_ptr<OffloadedOptimizer> device_part,
                     std::unique_ptr<Optimizer> host_part, std::vector<size_t> host_index,
                     const OptimizerOptions& options)
      : all_(std::move(all)), device_(std::move(device_part)), host_(std::move(host_part)),
        host_index_(std::move(host_index)), options_(options) {}
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

  // The parameters live on two devices: every rank reads every gradient (no owner ranges).
  void attach(GradReducer& reducer) override { device_->attach(reducer); }
  void flush() override { device_->flush(); }
  int64_t host_bytes() const override { return device_->host_bytes(); }
  std::vector<at::Tensor> device_state() const override { return {}; }
  std::optional<UpdateTiming> take_update_timing() override { return device_->take_update_timing(); }
  // The device part's flat space (the device parameters end to end).
  std::optional<ShardLayout> shard_layout() const override { return device_->shard_layout(); }
  ShardState shard_state() const override { return device_->shard_state(); }
  void load_shard_state(const ShardState& state) override { device_->load_shard_state(state); }

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

}  // namespace dtrain::engine
