// Stand-in for cuda/fused_block.cu in builds without CUDA: fused_block_kernels_built() is
// false, so the dispatch (fused_block_ops.cc) never calls the launchers; they throw if called.
#include "../fused_block_kernels.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine::detail {
namespace {
const char* not_built() {
  DTRAIN_CHECK(false, "the fused block kernels are not in this build of dtrain (compiled without CUDA); "
               "rebuild with -DDTRAIN_WITH_CUDA=ON");
  return nullptr;
}
}  // namespace

bool fused_block_kernels_built() { return false; }

const char* add_norm_forward(const AddNormShape&, const void*, const void*, const void*, const void*, double, void*,
                             void*, void*, void*, void*) {
  return not_built();
}

const char* add_norm_backward(const AddNormShape&, const void*, const void*, const void*, const void*, const void*,
                              const void*, void*, void*, void*, void*, void*, void*) {
  return not_built();
}

const char* bias_gelu_forward(const BiasGeluShape&, const void*, const void*, void*, void*) { return not_built(); }

const char* bias_gelu_backward(const BiasGeluShape&, const void*, const void*, const void*, void*, void*, void*,
                               void*) {
  return not_built();
}

const char* swiglu_forward(int64_t, FbDtype, const void*, const void*, void*, void*) { return not_built(); }

const char* swiglu_backward(int64_t, FbDtype, const void*, const void*, const void*, void*, void*, void*) {
  return not_built();
}

}  // namespace dtrain::engine::detail
