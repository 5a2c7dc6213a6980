// Private to the parallel area's autograd functions (tensor_parallel.cc, sequence_parallel.cc,
// context_parallel.cc, distill.cc, fused_cross_entropy.cc): passing the group's communicator
// through an autograd context, checking a dimension, the all-gather along one dimension the
// layers use, and the names all of them use unqualified.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine::detail {

// The communicator as an autograd-function argument (an int64 in saved_data["tp"]). The
// communicator must outlive the graph (see tensor_parallel.h).
inline int64_t comm_handle(dist::Communicator* c) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(c));
}
inline dist::Communicator& comm_from(int64_t handle) {
  return *reinterpret_cast<dist::Communicator*>(static_cast<intptr_t>(handle));
}
inline dist::Communicator& comm_of(torch::autograd::AutogradContext* ctx) {
  return comm_from(ctx->saved_data["tp"].toInt());
}

// dim of x as a non-negative index (negative counts from the end); throws dtrain::Error naming
// `what` for a scalar or a dimension out of range.
inline int64_t checked_dim(const at::Tensor& x, int64_t dim, const char* what) {
  DTRAIN_CHECK(x.dim() >= 1, what, ": a tensor of at least one dimension is needed, got a scalar");
  DTRAIN_CHECK(dim >= -x.dim() && dim < x.dim(), what, ": dimension ", dim,
               " is out of range for a tensor of shape ", x.sizes());
  return dim < 0 ? dim + x.dim() : dim;
}

// Concatenation along dim (0 <= dim < x.dim()) of every rank's x, in rank order (a copy
// also for a group of one). Synchronous.
inline at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, dist::Communicator& tp) {
  if (tp.size() == 1) return x.clone();
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty({tp.size() * in.numel()}, in.options());
  tp.all_gather(in.view(-1), out)->wait();
  std::vector<int64_t> stacked = {tp.size()};
  for (int64_t s : in.sizes()) stacked.push_back(s);
  // [T, ..., d, ...] -> [..., T, d, ...] -> [..., T * d, ...]
  std::vector<int64_t> joined(in.sizes().begin(), in.sizes().end());
  joined[dim] *= tp.size();
  return out.view(stacked).movedim(0, dim).reshape(joined);
}

}  // namespace dtrain::engine::detail

// The names the autograd functions use unqualified, in dtrain::engine of the files that
// include this header (no other file does).
namespace dtrain::engine {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using detail::all_gather_along;
using detail::checked_dim;
using detail::comm_from;
using detail::comm_handle;
using detail::comm_of;
}  // namespace dtrain::engine
