// Private to the tensor- and sequence-parallel autograd functions (tensor_parallel.cc,
// sequence_parallel.cc): passing the group's communicator through an autograd context, and
// the all-gather along one dimension both kinds of layer use.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/communicator.h"

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
