// "local": the communicator of a lone process (world size 1). Collectives are copies on the
// caller's current stream; no MPI is initialized.
#include "backends.h"

#include <ATen/ATen.h>

#include "async.h"
#include "dtrain/dist/error.h"

namespace dtrain::dist {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(CommOptions options) : Communicator(0, 1, std::move(options)) {}
  const char* backend() const override { return "local"; }
  bool supports(c10::DeviceType) const override { return true; }
  void raw_all_reduce_blocking(const at::Tensor& in, const at::Tensor& out) override {
    if (in.data_ptr() != out.data_ptr()) out.copy_(in);
  }

 protected:
  WorkPtr enqueue(Op op) override {
    // With one rank every reduction is the identity and every gather a copy.
    if (op.type != OpType::kBarrier && op.type != OpType::kBroadcast &&
        !op.output.is_same(op.input) && op.output.data_ptr() != op.input.data_ptr()) {
      op.output.view(-1).copy_(op.input.view(-1));
    }
    auto work = std::make_shared<HostWork>(op.seq);
    work->finish();
    return work;
  }
  std::unique_ptr<Communicator> do_split(int color, int, CommOptions child) override {
    if (color < 0) return nullptr;
    return std::make_unique<LocalCommunicator>(std::move(child));
  }
  std::vector<int64_t> exchange(const std::vector<int64_t>& mine) override { return mine; }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(const World& world, CommOptions options) {
  DTRAIN_CHECK(world.size == 1, "the local backend serves a single process, but the world has ",
               world.size, " ranks (", world.describe(), "); use --backend=mpi or nccl");
  return std::make_unique<LocalCommunicator>(std::move(options));
}

}  // namespace dtrain::dist
