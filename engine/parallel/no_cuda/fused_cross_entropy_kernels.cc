// Stand-in for cuda/fused_cross_entropy.cu in builds without CUDA: ce_kernels_built() is false,
// so the dispatch (fused_cross_entropy.cc) never calls the launchers; they throw if called.
#include "../fused_cross_entropy_kernels.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine::detail {

bool ce_kernels_built() { return false; }

const char* ce_forward_stats(const CeRows&, float*, float*, float*, void*) {
  DTRAIN_CHECK(false, "the fused cross-entropy's CUDA kernels are not in this build of dtrain "
               "(compiled without CUDA); rebuild with -DDTRAIN_WITH_CUDA=ON");
  return nullptr;
}

const char* ce_backward(const CeRows&, const float*, const float*, void*, int64_t, void*) {
  DTRAIN_CHECK(false, "the fused cross-entropy's CUDA kernels are not in this build of dtrain "
               "(compiled without CUDA); rebuild with -DDTRAIN_WITH_CUDA=ON");
  return nullptr;
}

}  // namespace dtrain::engine::detail
