// "local": the communicator of a lone process (world size 1). Collectives are copies on the
// caller's current stream; no MPI is initialized.
//
// Ordering on a GPU: the result of an operation on CUDA tensors is ready once the issuing
// stream reaches the point where the operation was issued (the kernels that produced the
// input, and the copy, if any). Work::wait() makes the waiting thread's current stream wait
// for that point (an event), so a consumer on another stream (the offloaded optimizer's copy
// stream) cannot read an unfinished gradient; synchronize() blocks the host on it.
#include "backends.h"

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "dtrain/dist/error.h"

namespace dtrain::dist {
namespace {

// Complete on the host at once; for device tensors, complete on the device once the event
// recorded on the issuing stream fires.
class LocalWork final : public Work {
 public:
  LocalWork(uint64_t seq, const at::Tensor& tensor) : seq_(seq) {
    if (!tensor.defined() || tensor.device().is_cpu()) return;
    device_ = tensor.device();
    c10::impl::VirtualGuardImpl impl(device_.type());
    event_.emplace(device_.type());
    event_->record(impl.getStream(device_));
  }
  void wait() override {
    if (!event_) return;
    c10::impl::VirtualGuardImpl impl(device_.type());
    event_->block(impl.getStream(device_));
  }
  void synchronize() override {
    if (event_) event_->synchronize();
  }
  bool is_completed() override { return !event_ || event_->query(); }
  uint64_t sequence() const override { return seq_; }

 private:
  const uint64_t seq_;
  c10::Device device_{c10::kCPU};
  std::optional<c10::Event> event_;
};

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
    return std::make_shared<LocalWork>(op.seq, op.output.defined() ? op.output : op.input);
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
