#include "dtrain/engine/parallel/grad_norm.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>

#include <ATen/ATen.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/sparse_reducer.h"

namespace dtrain::engine {
namespace {

// Norms accumulate in float64 when any gradient (or parameter) is float64, else in float32.
at::ScalarType accumulation_type(const std::vector<at::Tensor>& grads) {
  for (const at::Tensor& g : grads) {
    if (g.defined() && g.scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

}  // namespace

at::Tensor grad_norm(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  // Per (device, dtype): the per-tensor norms in one multi-tensor launch.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
  c10::optional<c10::Device> first_device;
  for (const at::Tensor& grad : grads) {
    const at::Tensor g = gradient_values(grad);  // a sparse gradient's rows
    if (!g.defined()) continue;
    DTRAIN_CHECK(g.layout() == at::kStrided && at::isFloatingType(g.scalar_type()),
                 "grad_norm: gradients must be dense floating-point tensors, got ", g.toString());
    if (!first_device) first_device = g.device();
    groups[{g.device().str(), g.scalar_type()}].push_back(g);
  }
  if (!first_device) return at::zeros(c10::IntArrayRef{}, at::kFloat);
  const at::ScalarType acc = accumulation_type(grads);
  std::vector<at::Tensor> norms;
  for (auto& [key, list] : groups) {
    for (at::Tensor& n : at::_foreach_norm(list, 2, acc)) {
      // Asynchronous unless the copy lands on the host (the CPU ops after it would race).
      norms.push_back(n.to(*first_device, acc, /*non_blocking=*/!first_device->is_cpu()));
    }
  }
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  return total.to(at::kFloat);
}

at::Tensor global_grad_norm(const std::vector<at::Tensor>& params, const GradNormLayout& layout) {
  const bool split = !layout.sharded.empty() && layout.tp && layout.tp->size() > 1;
  const bool staged = layout.pp && layout.pp->size() > 1;
  const bool owned = layout.partitioned;
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const at::Tensor& p : params) grads.push_back(p.grad());
  if (!split && !owned && !staged) return grad_norm(grads);
  const bool flat = owned && layout.owned_values.defined();
  DTRAIN_CHECK(layout.sharded.empty() || layout.sharded.size() == params.size(), "global_grad_norm: ",
               params.size(), " parameters but ", layout.sharded.size(), " sharded flags");
  DTRAIN_CHECK(!owned || layout.dp, "global_grad_norm: partitioned gradients need the data-parallel communicator");
  DTRAIN_CHECK(!flat || layout.owned_at.size() == layout.owned.size(), "global_grad_norm: ", layout.owned.size(),
               " owned ranges but ", layout.owned_at.size(), " positions of them in the owned values");
  // Accumulated as grad_norm() does, so a sharded or split run clips by the same coefficient.
  // Decided by the parameters (a gradient has its parameter's dtype), so every rank agrees
  // even where a rank holds no gradient (ZeRO-2 releases those outside its range).
  const at::ScalarType acc_type = accumulation_type(params);
  at::Tensor sq_shard, sq_rep;
  std::optional<c10::Device> device;
  int64_t offset = 0;
  size_t first_range = 0;  // the first owned range not wholly before this parameter
  auto add = [&](size_t i, const at::Tensor& part) {
    at::Tensor sq = part.to(acc_type).pow(2).sum();
    at::Tensor& acc = !layout.sharded.empty() && layout.sharded[i] ? sq_shard : sq_rep;
    acc = acc.defined() ? acc + sq : sq;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel(), begin = offset, end = offset + n;
    offset = end;
    const at::Tensor g = gradient_values(params[i].grad());  // a sparse gradient's rows
    if (!device) device = params[i].device();
    if (!owned) {
      if (g.defined()) add(i, g);
      continue;
    }
    if (!g.defined() && !flat) continue;
    while (first_range < layout.owned.size() && layout.owned[first_range].end <= begin) ++first_range;
    for (size_t q = first_range; q < layout.owned.size() && layout.owned[q].begin < end; ++q) {
      const int64_t a = std::max(layout.owned[q].begin, begin), b = std::min(layout.owned[q].end, end);
      if (a >= b) continue;
      add(i, flat                 ? layout.owned_values.narrow(0, layout.owned_at[q] + a - layout.owned[q].begin, b - a)
             : a == begin && b == end ? g
                                      : g.reshape({-1}).narrow(0, a - begin, b - a));
    }
  }
  const at::Tensor& any = sq_shard.defined() ? sq_shard : sq_rep;
  DTRAIN_CHECK(any.defined() || owned, "global_grad_norm: no gradients");
  const auto options = any.defined() ? any.options() : at::TensorOptions().dtype(acc_type).device(*device);
  if (!sq_shard.defined()) sq_shard = at::zeros({}, options);
  if (!sq_rep.defined()) sq_rep = at::zeros({}, options);
  at::Tensor s = sq_shard.reshape({1}).clone();
  if (split) layout.tp->all_reduce(s)->wait();
  at::Tensor total = s + sq_rep.reshape({1});
  if (owned && layout.dp->size() > 1) layout.dp->all_reduce(total)->wait();
  if (staged) layout.pp->all_reduce(total)->wait();
  return total.sqrt().reshape({}).to(at::kFloat);
}

}  // namespace dtrain::engine
