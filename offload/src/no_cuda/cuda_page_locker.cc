// Stand-in for cuda/cuda_page_locker.cc in builds without CUDA: there is no device to lock
// host memory for.
#include "dtrain/offload/page_locked.h"

namespace dtrain::offload {

std::shared_ptr<HostPageLocker> cuda_page_locker() { return nullptr; }

}  // namespace dtrain::offload
