// Optimizer offload in the engine (ZeRO-Offload style): an engine::Optimizer whose fp32
// master weights and state live in (pinned) host memory, partitioned across the ranks of
// the data-parallel group, updated by offload::CpuOptimizer.
//
// One step (after the reducer averaged the gradients on every rank): rank r copies the
// gradients of its shard of the flat parameter space to the host, updates its shard there,
// copies the new weights back into the parameters, and the ranks all-gather the shards, so
// every rank ends the step with the same full weights. Host memory per rank falls with the
// group size; the GPU keeps parameters and gradients only.
//
// The parameters become views of one flat device buffer (their values and autograd identity
// are kept), so the all-gather writes them in place. Not thread-safe. Collective over dp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/checkpoint.h"
#include "dtrain/engine/optim.h"

namespace dtrain::offload {
class PinnedPool;
}

namespace dtrain::engine {

struct OffloadOptions {
  double host_mem_limit_gb = 0;  // cap of the pinned host pool (0: no cap besides MemAvailable)
  int threads = 0;               // CPU optimizer threads (0: OMP_NUM_THREADS or the cores)
};

// Parses --offload: "none", "optimizer", "layers", "all" (throws naming the accepted values).
struct OffloadChoice {
  bool optimizer = false;
  bool layers = false;
};
OffloadChoice parse_offload(const std::string& text);

class OffloadedOptimizer : public Optimizer {
 public:
  // params: same dtype and device, contiguous. dp: the data-parallel group (the shards).
  OffloadedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                     dist::Communicator& dp, const OffloadOptions& offload);
  ~OffloadedOptimizer() override;
  void step() override;
  void zero_grad() override;
  void set_lr(double lr) override;
  double lr() const override;
  const OptimizerOptions& options() const override { return options_; }
  // This rank's shard only, as 1-D fp32 tensors of its real elements: "master", the rule's
  // arrays ("exp_avg", ...), and "step" (0-dim); see shard_begin()/shard_end().
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override;
  const std::vector<at::Tensor>& params() const override { return params_; }

  int64_t numel() const;        // elements of all parameters
  int64_t shard_begin() const;  // this rank's real elements of the flat space
  int64_t shard_end() const;
  int64_t host_bytes() const;
  // Loads this rank's shard from the shards other ranks saved (any old group size): each
  // entry holds old rank files' state() and their [begin, end) ranges.
  void load_resharded(const std::vector<std::pair<std::pair<int64_t, int64_t>, NamedTensors>>& old);

 private:
  struct Impl;
  OptimizerOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Impl> impl_;
};

// The optimizer of --offload=all on a GPU: device parameters through an OffloadedOptimizer,
// host-resident parameters (layer offload) through the fused CPU optimizer. state() holds the
// host part ("<index in params>.<name>"); offloaded() the partitioned part.
std::unique_ptr<Optimizer> make_offload_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                                  dist::Communicator& dp, const OffloadOptions& offload,
                                                  c10::Device device);
// The partitioned optimizer inside opt (itself or a composite's part), or nullptr.
OffloadedOptimizer* offloaded_part(Optimizer* opt);

}  // namespace dtrain::engine
