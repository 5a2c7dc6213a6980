// --cuda_graph in a build without CUDA (DTRAIN_WITH_CUDA off): nothing can be captured.
#include "dtrain/engine/train/graphed_loss.h"

#include "dtrain/dist/error.h"

namespace dtrain::engine {

bool cuda_graphs_compiled() { return false; }

struct SyncCounter::Impl {};
SyncCounter::SyncCounter() : impl_(std::make_unique<Impl>()) {}
SyncCounter::~SyncCounter() = default;
int64_t SyncCounter::count() const { return 0; }

std::unique_ptr<GraphedLoss> GraphedLoss::capture(const Fn&, const Batch&, const std::vector<at::Tensor>&, AmpMode,
                                                  int) {
  throw Error("--cuda_graph: this build of dtrain has no CUDA code paths (configure with -DDTRAIN_WITH_CUDA=ON)");
}

}  // namespace dtrain::engine
