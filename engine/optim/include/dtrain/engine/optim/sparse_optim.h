// Optimizers for parameters that receive sparse (COO) gradients, e.g. the weight of an
// embedding looked up with sparse gradients (torch's nn.Embedding(sparse=True)): each step
// updates only the rows present in the gradient, as torch.optim does for sparse gradients,
// behind dtrain's Optimizer contract (optim.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "dtrain/engine/optim/optim.h"

namespace dtrain::engine {

// An optimizer over params where those flagged in `sparse` (same length as params) receive
// sparse COO gradients (layout at::kSparse, sparse_dim 1: indices [1, nnz] name rows of the
// parameter, values [nnz, sizes[1:]...], duplicates allowed: they are summed, as coalesce()
// does) and the others dense ones. The dense parameters go to make_optimizer(their list,
// options), unchanged: the same kernels, results and state. The sparse parameters are updated
// row by row, only the rows present in the coalesced gradient; the other rows, and their
// state, do not change:
//
//   "sgd":     param[rows] -= lr * g. Needs momentum == 0 (a momentum buffer would move every
//              row at every step) and weight_decay == 0 (torch's L2 term on a sparse gradient
//              makes it dense); refused otherwise.
//   "adagrad": torch.optim.Adagrad's sparse rule. State "sum" (the parameter's sizes, starting
//              at initial_accumulator_value) and "step":
//                clr = lr / (1 + (step - 1) * lr_decay)
//                sum[rows] += g^2
//                param[rows] -= clr * g / (sqrt(sum[rows]) + eps)
//              with eps = effective_eps(options) (torch's 1e-10 for the default). Needs
//              weight_decay == 0 (torch refuses it for sparse gradients too).
//   "adam", "adamw": torch.optim.SparseAdam's rule (lazy Adam). State "exp_avg", "exp_avg_sq"
//              (the parameter's sizes, zeros) and "step":
//                exp_avg[rows]    = beta1 * exp_avg[rows] + (1 - beta1) * g
//                exp_avg_sq[rows] = beta2 * exp_avg_sq[rows] + (1 - beta2) * g^2
//                step_size = lr * sqrt(1 - beta2^step) / (1 - beta1^step)
//                param[rows] -= step_size * exp_avg[rows] / (sqrt(exp_avg_sq[rows]) + eps)
//              Note eps is added to sqrt(exp_avg_sq) before the bias correction is applied,
//              as in SparseAdam (torch's dense Adam adds it after). The moments of untouched
//              rows do not decay. SparseAdam has no weight decay: weight_decay (L2 for
//              "adam", decoupled for "adamw") applies to the dense parameters only, and the
//              sparse parameters are not decayed. amsgrad is refused (SparseAdam has none),
//              and so is eps == 0 (torch's SparseAdam needs eps > 0: an untouched column of a
//              touched row would divide 0 by 0).
//
// "step" counts, per parameter (not per row), the step() calls in which that parameter had a
// defined gradient, an empty sparse one (nnz 0) included (which updates nothing, as in
// torch); a row touched for the first time late in training takes the parameter's step count
// in its bias corrections / decayed lr, as in torch.
//
// A sparse-flagged parameter whose gradient arrives dense (strided; e.g. densified by the
// reducer's dense fallback) is updated by the same rule with every row touched: the exact
// result the sparse rule gives for a gradient listing every row (for Adam that is SparseAdam's
// formula, not dense Adam's). Any strides are accepted for such a gradient.
//
// The contract (optim.h), where it differs from make_optimizer's:
//   step(grad_multiplier): the multiplier scales every gradient (the sparse values too)
//     before the update; sparse gradients are read, never written. Every gradient is checked
//     before anything is updated: a sparse gradient must have its parameter's device, dtype
//     and sizes and sparse_dim 1; a sparse gradient of a parameter not flagged sparse, or a
//     gradient of another layout, throws dtrain::Error.
//   zero_grad(): dense gradients (of any parameter) are zeroed in place, as make_optimizer
//     does; sparse gradients are reset to undefined (autograd then stores the next one anew).
//   state() / load_state(): the names "<index in params>.<state>" over the whole list, in the
//     parameter order, as make_optimizer's (the dense part's renumbered): a sparse "adam"
//     parameter has "step", "exp_avg", "exp_avg_sq", like a dense one. The sparse
//     parameters' "step" is a fresh float32 0-dim tensor on the parameter's device; their
//     other state tensors alias the live state. load_state checks every entry (missing,
//     unknown, duplicate, mis-shaped) before changing anything.
//   Replicated: the defaults of the partitioned / asynchronous part of the contract.
//
// Throws dtrain::Error as make_optimizer() does (validate(options), an empty list, a
// parameter listed twice, a non-leaf or non-floating-point parameter), for `sparse` of
// another length than params, a 0-dim sparse-flagged parameter, and the refusals above.
// When no parameter is flagged, returns make_optimizer(params, options).
std::unique_ptr<Optimizer> make_sparse_aware_optimizer(std::vector<at::Tensor> params,
                                                       std::vector<bool> sparse,
                                                       const OptimizerOptions& options);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
