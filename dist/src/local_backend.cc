// "local": the communicator of a lone process (world size 1). Collectives are copies on the
// caller's current stream; no MPI is initialized.
//
// Ordering on a GPU: the result of an operation on CUDA tensors is ready once the issuing
// stream reaches the point where the operation was issued (the kernels that produced the
// input, and the copy, if any). Work::wait() makes the waiting thread's current stream wait
// for that point (an event), so a consumer on another stream (the offloaded optimizer's copy
// stream) cannot read an unfinished gradient; synchronize() blocks the host on it.
#include "backends.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "async.h"
#include "dtrain/dist/error.h"

namespace dtrain::dist {
namespace {

// Complete on the host at once; for device tensors, complete on the device once the event
// recorded on the issuing stream fires, and until then the Work holds the operation's tensors
// (released by wait(), synchronize(), or is_completed() seeing the event fired).
class LocalWork final : public Work {
 public:
  LocalWork(uint64_t seq, const at::Tensor& input, const at::Tensor& output) : seq_(seq) {
    const at::Tensor& tensor = output.defined() ? output : input;
    if (!tensor.defined() || tensor.device().is_cpu()) return;
    device_ = tensor.device();
    c10::impl::VirtualGuardImpl impl(device_.type());
    event_.emplace(device_.type());
    event_->record(impl.getStream(device_));
    for (const at::Tensor* t : {&input, &output}) {
      if (t->defined()) held_.push_back(*t);
    }
  }
  void wait() override {
    if (!event_) return;
    c10::impl::VirtualGuardImpl impl(device_.type());
    event_->block(impl.getStream(device_));
    release();  // later work on the waiting stream, and reuse on the issuing one, follow it
  }
  void synchronize() override {
    if (!event_) return;
    event_->synchronize();
    release();
  }
  bool is_completed() override {
    if (!event_) return true;
    if (!event_->query()) return false;
    release();
    return true;
  }
  uint64_t sequence() const override { return seq_; }

 private:
  void release() {
    std::vector<at::Tensor> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(held_);
  }
  const uint64_t seq_;
  c10::Device device_{c10::kCPU};
  std::optional<c10::Event> event_;
  std::mutex mutex_;
  std::vector<at::Tensor> held_;  // guarded by mutex_; device tensors until the event fired
};

// A send to oneself or a receive from oneself: done once matched with its partner.
class LocalP2pWork final : public Work {
 public:
  LocalP2pWork(uint64_t seq, at::Tensor tensor) : seq_(seq), tensor_(std::move(tensor)) {}
  void wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  void synchronize() override { wait(); }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  uint64_t sequence() const override { return seq_; }
  const at::Tensor& tensor() const { return tensor_; }
  void finish(std::exception_ptr error = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = error;
    tensor_ = at::Tensor();  // a watchdog entry may keep this Work a while: not the buffer
    cv_.notify_all();
  }

 private:
  const uint64_t seq_;
  at::Tensor tensor_;  // the tensor sent, or the receive's destination, until matched
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(CommOptions options) : Communicator(0, 1, std::move(options)) {}
  ~LocalCommunicator() override { Watchdog::instance().unwatch_owner(this); }
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
    return std::make_shared<LocalWork>(op.seq, op.input, op.output);
  }
  // Sends to oneself are matched with receives from oneself in issue order: the earlier of
  // the two waits (watched for the timeout like any operation) until its partner comes. Each
  // Work holds its tensor until then (the caller may drop it: communicator.h), and the
  // receive copies from the sent tensor itself, on the stream current at the match.
  WorkPtr enqueue_p2p(P2pOp op) override {
    const bool send = op.type == OpType::kSend;
    auto work = std::make_shared<LocalP2pWork>(op.seq, op.tensor);
    std::shared_ptr<LocalP2pWork> partner;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      auto& theirs = send ? recvs_ : sends_;
      if (theirs.empty()) {
        (send ? sends_ : recvs_).push_back(work);
      } else {
        partner = theirs.front();
        theirs.pop_front();
      }
    }
    if (!partner) {
      Watchdog::Entry entry;
      entry.what = describe_op(*this, op.type, op.tensor, ReduceOp::kSum, op.peer, op.seq);
      entry.timeout = options().timeout;
      entry.done = [work] { return work->is_completed(); };
      entry.arrivals = [send] { return std::string("this rank has not issued the matching ") + (send ? "recv" : "send"); };
      entry.owner = this;
      Watchdog::instance().watch(std::move(entry));
      return work;
    }
    const LocalP2pWork& sent = send ? *work : *partner;
    const LocalP2pWork& received = send ? *partner : *work;
    std::exception_ptr error;
    if (sent.tensor().scalar_type() != received.tensor().scalar_type() ||
        sent.tensor().sizes() != received.tensor().sizes()) {
      error = std::make_exception_ptr(Error(
          describe_op(*this, OpType::kRecv, received.tensor(), ReduceOp::kSum, 0, send ? partner->sequence() : op.seq) +
          ": the matching send has " + c10::toString(sent.tensor().scalar_type()) + c10::str(sent.tensor().sizes()) +
          "; sender and receiver must agree on dtype and shape"));
    } else {
      received.tensor().copy_(sent.tensor());
    }
    partner->finish(error);
    work->finish(error);
    return work;
  }

  std::unique_ptr<Communicator> do_split(int color, int, CommOptions child) override {
    if (color < 0) return nullptr;
    return std::make_unique<LocalCommunicator>(std::move(child));
  }
  std::vector<int64_t> exchange(const std::vector<int64_t>& mine) override { return mine; }

 private:
  std::mutex p2p_mutex_;
  std::deque<std::shared_ptr<LocalP2pWork>> sends_, recvs_;  // unmatched, guarded by p2p_mutex_
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(const World& world, CommOptions options) {
  DTRAIN_CHECK(world.size == 1, "the local backend serves a single process, but the world has ",
               world.size, " ranks (", world.describe(), "); use --backend=mpi or nccl");
  return std::make_unique<LocalCommunicator>(std::move(options));
}

}  // namespace dtrain::dist
