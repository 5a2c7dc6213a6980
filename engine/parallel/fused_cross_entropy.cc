// The fused cross-entropy's autograd function and entry points (cross_entropy.h): the row
// statistics and the gradient come from dtrain's CUDA kernels (fused_cross_entropy_kernels.h),
// the tensor-parallel reductions and the mean are small ATen operations on [N] tensors.
// No CUDA header here: the stream is the current one of the logits' device, through c10.
#include "dtrain/engine/parallel/cross_entropy.h"

#include <algorithm>
#include <climits>
#include <limits>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/error.h"
#include "fused_cross_entropy_kernels.h"
#include "parallel_comm_internal.h"

namespace dtrain::engine {
namespace {

using detail::CeDtype;
using detail::CeRows;

CeDtype ce_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CeDtype::kBf16;
    case at::kHalf: return CeDtype::kFp16;
    case at::kFloat: return CeDtype::kFp32;
    default: break;
  }
  DTRAIN_CHECK(false, "the fused cross-entropy takes bfloat16, float16 or float32 logits, not ", t);
  return CeDtype::kFp32;
}

// The current CUDA stream of `device` (a cudaStream_t).
void* current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(device).native_handle();
}

void check_launch(const char* error, const char* what) {
  DTRAIN_CHECK(error == nullptr, "the fused cross-entropy's ", what, " kernel failed to launch: ", error);
}

// Columns of this shard below the real vocabulary: [vocab_start, vocab_start + valid).
int64_t valid_columns(int64_t vocab_start, int64_t real_vocab, int64_t local) {
  return std::clamp<int64_t>(real_vocab - vocab_start, 0, local);
}

CeRows rows_of(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid) {
  CeRows r;
  r.logits = logits.const_data_ptr();
  r.dtype = ce_dtype(logits.scalar_type());
  r.rows = logits.size(0);
  r.cols = logits.size(1);
  r.valid_cols = valid;
  r.row_stride = logits.stride(0);
  r.targets = targets.const_data_ptr<int64_t>();
  r.vocab_start = vocab_start;
  return r;
}

struct FusedCrossEntropy : torch::autograd::Function<FusedCrossEntropy> {
  // tp_handle: detail::comm_handle of the tensor-parallel group, or 0 for none.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, int64_t real_vocab, int64_t tp_handle) {
    const c10::DeviceGuard guard(logits.device());
    const int64_t valid = valid_columns(vocab_start, real_vocab, logits.size(1));
    at::Tensor stats = at::empty({3, logits.size(0)}, logits.options().dtype(at::kFloat));
    check_launch(detail::ce_forward_stats(rows_of(logits, targets, vocab_start, valid),
                                          stats[0].data_ptr<float>(), stats[1].data_ptr<float>(),
                                          stats[2].data_ptr<float>(), current_stream(logits.device())),
                 "forward");
    at::Tensor m = stats[0], s = stats[1], t = stats[2];
    if (tp_handle != 0 && detail::comm_from(tp_handle).size() > 1) {
      auto& tp = detail::comm_from(tp_handle);
      at::Tensor global = m.clone();
      tp.all_reduce(global, dist::ReduceOp::kMax)->wait();
      at::Tensor both = at::stack({s * (m - global).exp(), t});  // one all-reduce for both
      tp.all_reduce(both)->wait();
      m = global;
      s = both[0];
      t = both[1];
    }
    at::Tensor lse = m + s.log();
    ctx->save_for_backward({logits, lse, targets});
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["valid"] = valid;
    return (lse - t).mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const c10::DeviceGuard guard(logits.device());
    // The scale stays on the device: read by the kernel, never here.
    at::Tensor scale = g[0].to(logits.device(), at::kFloat).contiguous();
    at::Tensor grad = at::empty(logits.sizes(), logits.options());
    const CeRows r = rows_of(logits, saved[2], ctx->saved_data["vocab_start"].toInt(),
                             ctx->saved_data["valid"].toInt());
    check_launch(detail::ce_backward(r, saved[1].const_data_ptr<float>(), scale.const_data_ptr<float>(),
                                     grad.data_ptr(), grad.stride(0), current_stream(logits.device())),
                 "backward");
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                 int64_t real_vocab, int64_t tp_handle) {
  DTRAIN_CHECK(logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0),
               "the fused cross-entropy takes logits [N, V] and targets [N], got ", logits.sizes(),
               " and ", targets.sizes());
  DTRAIN_CHECK(fused_cross_entropy_available(logits),
               "the fused cross-entropy needs CUDA logits of bfloat16, float16 or float32 with "
               "adjacent columns in a build with CUDA; got ", logits.scalar_type(), " on ",
               logits.device(), " with strides ", logits.strides());
  DTRAIN_CHECK(targets.device() == logits.device() && !at::isFloatingType(targets.scalar_type()),
               "the fused cross-entropy takes integer targets on the logits' device (", logits.device(),
               "), got ", targets.scalar_type(), " on ", targets.device());
  DTRAIN_CHECK(logits.size(0) <= INT_MAX, "the fused cross-entropy takes at most ", INT_MAX,
               " rows, got ", logits.size(0));
  return FusedCrossEntropy::apply(logits, targets.to(at::kLong).contiguous(), vocab_start, real_vocab,
                                  tp_handle);
}

}  // namespace

bool fused_cross_entropy_available(const at::Tensor& logits) {
  if (!logits.defined()) return false;
  const at::ScalarType t = logits.scalar_type();
  return logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1 &&
         (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat) && detail::ce_kernels_built();
}

at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  return fused(logits, targets, 0, logits.dim() == 2 ? logits.size(1) : 0, 0);
}

at::Tensor fused_vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                              int64_t vocab_start, int64_t real_vocab,
                                              dist::Communicator& tp) {
  return fused(logits, targets, vocab_start, real_vocab, detail::comm_handle(&tp));
}

}  // namespace dtrain::engine
