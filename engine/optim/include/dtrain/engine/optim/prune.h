// Magnitude pruning with masks kept through fine-tuning (torch.nn.utils.prune's L1
// unstructured pruning, one-shot or on Zhu & Gupta's gradual cubic schedule).
//
// Semantics, as torch.nn.utils.prune has them: a pruned weight is `orig * mask`. Here the mask
// is applied to the weight itself, to its gradient before every update (so the gradient norm,
// clipping and the optimizer see what they would see for `orig * mask`), and to the weight
// again after every update, so pruned weights stay exactly zero whatever the optimizer does
// with its state (moments of pruned entries decay on zero gradients; they are not reset).
//
// Masks are chosen from the whole tensor (layer scope) or from every prunable tensor together
// (global scope): the k = round(amount x n) entries of smallest magnitude, k rounded half to even
// as Python's round() does, picked by torch.topk(largest=False) on the unsplit tensor, exactly
// as l1_unstructured and global_unstructured pick them. Under tensor parallelism each rank
// gathers the unsplit tensor, picks, and keeps its shard of the mask, so a tensor-parallel run
// prunes the very entries the unsplit run prunes; data-parallel ranks hold identical weights
// and so identical masks. A gradual schedule recomputes the masks from the current weights at
// its steps; pruned weights are zero, so they stay pruned as the target grows.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace torch::nn {
class Module;
}

namespace dtrain::engine {

struct PruneOptions {
  double amount = 0;            // final fraction of the prunable entries set to zero; 0: off
  std::string scope = "layer";  // "layer": each tensor loses `amount`; "global": all together
  int64_t at_step = 0;          // one-shot: prune before this step's forward (1-based)
  // Gradual (Zhu & Gupta 2017): before the forward of step t in [from_step, to_step], every
  // `every` steps and at to_step, the target is amount x (1 - (1 - (t - from) / (to - from))^3).
  int64_t from_step = 0, to_step = 0, every = 1;
  // Which parameters are pruned, by (full name, the module that owns it, its name there).
  // Empty: default_prunable.
  std::function<bool(const std::string&, const torch::nn::Module&, const std::string&)> prunable;
};

// The weights of Linear, Conv1d/2d/3d and the tensor-parallel linear layers; not biases,
// norms or embeddings (what pruning work usually prunes).
bool default_prunable(const std::string& name, const torch::nn::Module& owner, const std::string& local);

// Throws dtrain::Error naming the bad field: amount outside [0, 1), an unknown scope, both or
// neither of at_step and from_step/to_step with amount > 0, to_step <= from_step, every < 1.
void validate(const PruneOptions& options);

// The target sparsity when masks are (re)computed before step `step`, or -1 when they are not.
double prune_target(const PruneOptions& options, int64_t step);

// The entries to keep (true) of each tensor: the round(amount x n) entries of smallest
// magnitude pruned, per tensor ("layer") or over all of them ("global"). CPU or device tensors;
// masks are bool, on each tensor's device.
std::vector<at::Tensor> l1_masks(const std::vector<at::Tensor>& tensors, double amount, const std::string& scope);

class Pruner {
 public:
  // Finds the prunable parameters of model (options.prunable); specs: the tensor-parallel
  // split of sharded ones (collect_shard_specs), tp their group. Throws dtrain::Error when no
  // parameter is prunable.
  Pruner(torch::nn::Module& model, PruneOptions options, std::map<std::string, ShardSpec> specs,
         dist::Communicator& tp);

  // Before step `step`'s forward: when the schedule says so, recomputes the masks (collective
  // over tp) and zeroes the pruned weights. Returns whether it did.
  bool maybe_prune(int64_t step);
  void mask_gradients();  // each defined gradient *= its mask
  void mask_weights();    // each weight *= its mask
  bool active() const { return !masks_.empty(); }
  // Fraction of the prunable entries pruned now (of the unsplit model).
  double sparsity() const { return sparsity_; }
  const std::vector<std::string>& names() const { return names_; }

  // The unsplit masks by parameter name (collective over tp); empty before the first pruning.
  std::vector<std::pair<std::string, at::Tensor>> full_masks();
  // Masks saved by full_masks() (any tensor-parallel layout); throws dtrain::Error for a name
  // that is not a prunable parameter here or a shape that does not fit.
  void load_masks(const std::vector<std::pair<std::string, at::Tensor>>& full);

 private:
  at::Tensor full_of(size_t i) const;  // collective over tp for a sharded parameter
  void set_masks(const std::vector<at::Tensor>& full);
  PruneOptions options_;
  std::map<std::string, ShardSpec> specs_;
  dist::Communicator* tp_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> masks_;  // this rank's shard of each mask (bool)
  double sparsity_ = 0;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
