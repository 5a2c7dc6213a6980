// Sequence-parallel communication primitives (see tensor_parallel.h).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "parallel_comm_internal.h"

namespace dtrain::engine {
namespace {

void check_divides(const at::Tensor& x, int64_t dim, dist::Communicator& tp, const char* what) {
  DTRAIN_CHECK(x.size(dim) % tp.size() == 0, what, ": cannot split a sequence of ", x.size(dim),
               " (dimension ", dim, " of ", x.sizes(), ") over ", tp.size(),
               " tensor-parallel ranks; the sequence length must be a multiple of --tp");
}

// This rank's chunk along dim of the sum over ranks of x.
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, dist::Communicator& tp) {
  check_divides(x, dim, tp, "reduce_scatter_to_sequence_parallel");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] /= tp.size();
  at::Tensor out = at::empty(shape, in.options());
  tp.reduce_scatter(in.view(-1), out.view(-1))->wait();
  return out.movedim(0, dim).contiguous();
}

at::Tensor chunk_along(const at::Tensor& x, int64_t dim, dist::Communicator& tp) {
  check_divides(x, dim, tp, "scatter_to_sequence_parallel");
  return x.chunk(tp.size(), dim)[tp.rank()].contiguous();
}

struct GatherFromSp : torch::autograd::Function<GatherFromSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp, int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return all_gather_along(x, dim, comm_of(ctx));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {reduce_scatter_along(g[0], ctx->saved_data["dim"].toInt(), comm_of(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatterToSp : torch::autograd::Function<ReduceScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp, int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return reduce_scatter_along(x, dim, comm_of(ctx));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_along(g[0], ctx->saved_data["dim"].toInt(), comm_of(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

struct ScatterToSp : torch::autograd::Function<ScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp, int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return chunk_along(x, dim, comm_of(ctx));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_along(g[0], ctx->saved_data["dim"].toInt(), comm_of(ctx)), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_from_sequence_parallel(const at::Tensor& x, dist::Communicator& tp, int64_t dim) {
  dim = checked_dim(x, dim, "gather_from_sequence_parallel");
  return tp.size() == 1 ? x : GatherFromSp::apply(x, comm_handle(&tp), dim);
}

at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& x, dist::Communicator& tp,
                                               int64_t dim) {
  dim = checked_dim(x, dim, "reduce_scatter_to_sequence_parallel");
  if (tp.size() == 1) return x;
  check_divides(x, dim, tp, "reduce_scatter_to_sequence_parallel");  // before any collective
  return ReduceScatterToSp::apply(x, comm_handle(&tp), dim);
}

at::Tensor scatter_to_sequence_parallel(const at::Tensor& x, dist::Communicator& tp, int64_t dim) {
  dim = checked_dim(x, dim, "scatter_to_sequence_parallel");
  if (tp.size() == 1) return x;
  check_divides(x, dim, tp, "scatter_to_sequence_parallel");
  return ScatterToSp::apply(x, comm_handle(&tp), dim);
}

at::Tensor sequence_parallel_layer_norm(const torch::nn::LayerNorm& ln, const at::Tensor& x,
                                        dist::Communicator& tp) {
  const auto& o = ln->options;
  if (tp.size() == 1 || !o.elementwise_affine()) {
    return at::layer_norm(x, o.normalized_shape(), ln->weight, ln->bias, o.eps());
  }
  // One all-reduce for weight and bias together in backward.
  at::Tensor wb = copy_to_tensor_parallel(at::stack({ln->weight, ln->bias}), tp);
  return at::layer_norm(x, o.normalized_shape(), wb[0], wb[1], o.eps());
}

}  // namespace dtrain::engine
