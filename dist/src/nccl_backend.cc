// "nccl": collectives on CUDA tensors through NCCL, on the communicator's own CUDA stream,
// ordered after the caller's current stream by an event and back by Work::wait(). The
// NCCL unique id is broadcast over the partner CPU communicator (MPI, or local for a lone
// process), which also carries collectives on CPU tensors.
// Stall reports: an NCCL communicator registers with the health service over its MPI
// partner's ranks (as kind 1), so its stall warnings name the ranks that have not reached an
// operation too. For NCCL, "reached" means the rank has issued the operation (its GPU may
// still be busy with earlier work) and "completed" that the operation's event has fired
// (seen by the watchdog's poll). A lone process has no health service and no peers.
//
// Memory: a Work holds its operation's tensors from the call until the operation completes
// (its wait() or synchronize() returning, or the watchdog seeing its end event fire); inside a
// group, where NCCL launches at ncclGroupEnd, that spans the launch, so a tensor the caller
// dropped cannot be handed by the caching allocator to another operation of the same group.
// Teardown and failures: a failed NCCL call on a communicator aborts it (ncclCommAbort) before
// the error is thrown, and the destructor destroys it (ncclCommDestroy, which waits for what is
// queued) only when it is idle and healthy, else aborts it (teardown.h), so a rank whose peer
// failed mid-operation does not block forever in its destructor.
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include "async.h"
#include "backends.h"
#include "dtrain/dist/error.h"
#include "teardown.h"

namespace dtrain::dist {
namespace {

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

// For the calls before there is a communicator (its id, its creation); a call on a
// communicator goes through NcclCommunicator::checked(), which aborts it before throwing.
#define NCCL_CHECK(call)                                                                  \
  do {                                                                                    \
    ncclResult_t nccl_rc_ = (call);                                                       \
    if (nccl_rc_ != ncclSuccess) {                                                        \
      DTRAIN_LIBRARY_FAILURE(nccl_version(), #call, " returned ", ncclGetErrorString(nccl_rc_), \
                             " (", ncclGetLastError(nullptr), ")");                      \
    }                                                                                     \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: case at::kBool: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: break;
  }
  throw Error(std::string("NCCL has no type for ") + c10::toString(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// One NCCL communicator, shared by its NcclCommunicator, its Works and its watchdog entries,
// which may outlive it. Once aborted or destroyed nothing calls into it again. Launches
// (ncclAllReduce, ncclGroupEnd, ...) use comm() on the issuing thread without the lock, so
// abort() from another thread (the watchdog's) can end a launch blocked on a dead peer.
class NcclHandle {
 public:
  explicit NcclHandle(ncclComm_t comm) : comm_(comm) {}
  ncclComm_t comm() const { return comm_; }
  // NCCL's asynchronous error as text, "" while there is none. Once the communicator was
  // aborted: why when `report_abort` (a Work's wait: its result cannot be trusted), else ""
  // (the watchdog: the abort's cause was reported where it happened); once destroyed: "".
  std::string async_error(bool report_abort) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == kAborted) return report_abort ? "the communicator was aborted (" + why_ + ")" : "";
    if (state_ == kDestroyed) return "";
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) return "ncclCommGetAsyncError failed";
    if (async == ncclSuccess || async == ncclInProgress) return "";
    const char* last = ncclGetLastError(comm_);
    return nccl_version() + " reported " + ncclGetErrorString(async) +
           (last && *last ? std::string(" (") + last + ")" : std::string());
  }
  // ncclCommAbort, once: queued operations end without waiting for the peers.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != kLive) return;
    state_ = kAborted;
    why_ = why;
    ncclResult_t rc = ncclCommAbort(comm_);
    if (rc != ncclSuccess) LOG(ERROR) << "ncclCommAbort failed: " << ncclGetErrorString(rc);
  }
  // ncclCommDestroy, which waits for what is queued: only for an idle communicator.
  void destroy() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != kLive) return;
    state_ = kDestroyed;
    ncclResult_t rc = ncclCommDestroy(comm_);
    if (rc != ncclSuccess) LOG(ERROR) << "ncclCommDestroy failed: " << ncclGetErrorString(rc);
  }
  bool aborted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return state_ == kAborted;
  }

 private:
  const ncclComm_t comm_;
  std::mutex mutex_;
  enum { kLive, kAborted, kDestroyed } state_ = kLive;  // guarded by mutex_
  std::string why_;                                      // guarded by mutex_
};

class NcclWork final : public Work {
 public:
  // tensors: the operation's, held until it completes.
  NcclWork(uint64_t seq, std::string what, c10::Device device, std::shared_ptr<NcclHandle> handle,
           bool host_blocking, std::vector<at::Tensor> tensors)
      : seq_(seq), what_(std::move(what)), device_(device), handle_(std::move(handle)),
        host_blocking_(host_blocking), tensors_(std::move(tensors)) {}
  ~NcclWork() override {
    try {
      release();
    } catch (const std::exception& e) {
      LOG(ERROR) << what_ << ": releasing its tensors failed: " << e.what();
    }
  }
  const std::string& what() const { return what_; }
  at::cuda::CUDAEvent& end() { return end_; }
  // Called once the end event was recorded after the operation's launch.
  void mark_launched() {
    std::lock_guard<std::mutex> lock(mutex_);
    launched_ = true;
  }
  // The operation will never be launched (its group's launch failed): wait() rethrows error.
  void fail(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::move(error);
    }
    release();
  }
  void wait() override {
    check_launched("wait");
    c10::cuda::CUDAGuard guard(device_);
    end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    if (host_blocking_) end_.synchronize();
    check_async();
    // The caller's stream is ordered after the operation now, and the allocator keeps the
    // memory from reuse until the NCCL stream passes the point where it is freed (recordStream
    // at the issue, the free after the launch).
    release();
  }
  void synchronize() override {
    check_launched("synchronize");
    {
      c10::cuda::CUDAGuard guard(device_);
      end_.synchronize();
    }
    check_async();
    release();
  }
  bool is_completed() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error_) return true;
      if (!launched_) return false;
    }
    c10::cuda::CUDAGuard guard(device_);
    if (!end_.query()) return false;
    release();
    return true;
  }
  uint64_t sequence() const override { return seq_; }

 private:
  void check_launched(const char* call) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
    DTRAIN_CHECK(launched_, what_, ": ", call, "() on an operation of a group that is still open; NCCL launches a ",
                 "group's operations at end_group(): call end_group() (CommGroup::close()) first, on the thread ",
                 "that began the group");
  }
  void check_async() {
    const std::string error = handle_->async_error(/*report_abort=*/true);
    if (error.empty()) return;
    handle_->abort(what_ + " failed asynchronously: " + error);  // once; no-op when aborted already
    DTRAIN_LIBRARY_FAILURE(nccl_version(), what_, " failed: ", error);
  }
  // Drops the tensors, on the device's context (freeing records events on the streams that
  // used them).
  void release() {
    std::vector<at::Tensor> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(tensors_);
    }
    if (dropped.empty()) return;
    c10::cuda::CUDAGuard guard(device_);
    dropped.clear();
  }
  const uint64_t seq_;
  const std::string what_;
  const c10::Device device_;
  const std::shared_ptr<NcclHandle> handle_;
  const bool host_blocking_;
  at::cuda::CUDAEvent end_{cudaEventDisableTiming};  // recorded before mark_launched()
  std::mutex mutex_;
  std::vector<at::Tensor> tensors_;  // guarded by mutex_; until the operation completed
  bool launched_ = false;            // guarded by mutex_
  std::exception_ptr error_;         // guarded by mutex_
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, std::unique_ptr<Communicator> cpu, c10::Device device,
                   CommOptions options)
      : Communicator(cpu->rank(), cpu->size(), std::move(options)), handle_(std::make_shared<NcclHandle>(comm)),
        cpu_(std::move(cpu)), device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())),
        health_(sibling_health(*cpu_, /*kind=*/1)) {}

  // Destroys the NCCL communicator when it is idle and healthy; aborts it when an operation is
  // still queued or was never launched, or a failure was seen (ncclCommDestroy would wait for
  // them, and a dead peer would make it wait forever). Logs the abort; never throws.
  ~NcclCommunicator() override {
    // No watchdog poll of this communicator's operations runs after this.
    Watchdog::instance().unwatch_owner(this);
    health_.reset();
    TeardownDecision decision;
    decision.how = Teardown::kAbort;
    try {
      c10::cuda::CUDAGuard guard(device_);
      const std::string async = handle_->async_error(/*report_abort=*/false);
      if (!async.empty()) teardown_.failed(async);
      if (handle_->aborted()) teardown_.failed("it was aborted already");
      decision = teardown_.decide();
    } catch (const std::exception& e) {
      decision.why = std::string("cannot tell whether it is idle: ") + e.what();
    }
    try {
      c10::cuda::CUDAGuard guard(device_);
      if (decision.how == Teardown::kAbort) {
        LOG(WARNING) << "'" << name() << "' (nccl, rank " << rank() << "/" << size()
                     << "): aborting the NCCL communicator instead of destroying it: " << decision.why;
        handle_->abort("destroyed " + decision.why);
      } else {
        handle_->destroy();
      }
    } catch (const std::exception& e) {
      LOG(ERROR) << "'" << name() << "': NCCL teardown failed: " << e.what();
    }
    count_teardown(decision.how);
  }

  const char* backend() const override { return "nccl"; }
  bool supports(c10::DeviceType type) const override {
    return type == c10::kCUDA || cpu_->supports(type);
  }

  void raw_all_reduce_blocking(const at::Tensor& in, const at::Tensor& out) override {
    DTRAIN_CHECK(in.is_cuda() && out.is_cuda(), "raw NCCL all-reduce takes CUDA tensors");
    c10::cuda::CUDAGuard guard(device_);
    auto stream = c10::cuda::getCurrentCUDAStream(device_.index());
    std::lock_guard<std::mutex> lock(issue_mutex_);
    checked(ncclAllReduce(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(out.scalar_type()), ncclSum,
                          handle_->comm(), stream.stream()),
            "ncclAllReduce");
    stream.synchronize();
  }

 protected:
  // On the group's thread (the base class makes other threads wait while a group is open).
  void do_begin_group() override {
    std::lock_guard<std::mutex> lock(issue_mutex_);
    DTRAIN_CHECK(!grouping_, name(), ": begin_group() inside a group; groups do not nest");
    grouping_ = true;
  }

  void do_end_group() override {
    std::lock_guard<std::mutex> lock(issue_mutex_);
    DTRAIN_CHECK(grouping_, name(), ": end_group() without begin_group()");
    grouping_ = false;
    if (!group_open_) return;
    c10::cuda::CUDAGuard guard(device_);
    group_open_ = false;
    std::vector<Pending> pending = std::move(pending_);
    pending_.clear();
    teardown_.set_unlaunched(0);
    try {
      checked(ncclGroupEnd(), "ncclGroupEnd");
    } catch (...) {
      for (Pending& p : pending) p.work->fail(std::current_exception());
      throw;
    }
    // The grouped operations are launched only now: their end events go after them. Each
    // Work still holds its tensors (since the call), so nothing of the group was freed before
    // the launch.
    for (Pending& p : pending) finish(std::move(p.work), p.seq, p.collective);
  }

 protected:
  // Point to point on the GPU: ncclSend / ncclRecv on the communicator's stream, in issue
  // order. A send and a receive that must proceed together (a stage sending to its neighbour
  // while receiving from it) go inside one CommGroup, as NCCL requires; host tensors go
  // through the MPI communicator beside this one.
  WorkPtr enqueue_p2p(P2pOp p2p) override {
    Op op{p2p.type, p2p.tensor, p2p.tensor, ReduceOp::kSum, p2p.peer, p2p.seq};
    if (!p2p.tensor.is_cuda()) return forward_to_cpu(op);
    return enqueue_device(op);
  }

  WorkPtr enqueue(Op op) override {
    const at::Tensor& any = op.input.defined() ? op.input : op.output;
    if (any.defined() && !any.is_cuda()) return forward_to_cpu(op);
    return enqueue_device(op);
  }

  WorkPtr enqueue_device(const Op& op) {
    const bool collective = op.type != OpType::kSend && op.type != OpType::kRecv;
    for (const at::Tensor* t : {&op.input, &op.output}) {
      if (t->defined()) check_on_comm_device(name() + "." + to_string(op.type), t->device(), device_);
    }
    DTRAIN_CHECK(!handle_->aborted(), describe_op(*this, op.type, op.input, op.reduce, op.root, op.seq),
                 ": the NCCL communicator was aborted after an earlier failure (logged, and thrown where it "
                 "happened); it runs nothing more");
    c10::cuda::CUDAGuard guard(device_);
    // Collectives come here under the base class's submit lock, point to point without it:
    // one issue at a time (NCCL's calls on one communicator are not thread-safe).
    std::lock_guard<std::mutex> lock(issue_mutex_);
    // Order after the caller's queued work, for every operation: inside a group too, the
    // caller may have queued work between two of its operations (a receive buffer's fill).
    at::cuda::CUDAEvent ready(cudaEventDisableTiming);
    ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    ready.block(stream_);
    if (!group_open_ && grouping_) {
      checked(ncclGroupStart(), "ncclGroupStart");
      group_open_ = true;
    }
    std::vector<at::Tensor> held;
    for (const at::Tensor* t : {&op.input, &op.output}) {
      if (t->defined() && (held.empty() || !t->is_same(held.back()))) held.push_back(*t);
    }
    auto work = std::make_shared<NcclWork>(op.seq, describe_op(*this, op.type, op.input, op.reduce, op.root, op.seq),
                                           device_, handle_, op.type == OpType::kBarrier, std::move(held));
    const bool in_group = group_open_;
    try {
      issue(op);
    } catch (...) {
      work->fail(std::current_exception());
      if (in_group) fail_group(std::current_exception());
      throw;
    }
    for (const at::Tensor* t : {&op.input, &op.output}) {
      if (t->defined() && t->numel() > 0) {
        c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream_);
      }
    }
    if (group_open_) {
      pending_.push_back({work, op.seq, collective});
      teardown_.set_unlaunched(static_cast<int64_t>(pending_.size()));
    } else {
      finish(work, op.seq, collective);
    }
    return work;
  }

  std::unique_ptr<Communicator> do_split(int color, int key, CommOptions child) override {
    auto cpu_child = cpu_->split(color, key, child.name.substr(child.name.rfind('/') + 1));
    c10::cuda::CUDAGuard guard(device_);
    ncclComm_t sub = nullptr;
    {
      std::lock_guard<std::mutex> lock(issue_mutex_);  // bounded by Communicator::split's watch
      checked(ncclCommSplit(handle_->comm(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr),
              "ncclCommSplit");
    }
    if (color < 0 || sub == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(sub, std::move(cpu_child), device_, std::move(child));
  }

  // Host tensors only: the MPI partner's split, no NCCL communicator.
  std::unique_ptr<Communicator> do_split_host(int color, int key, CommOptions child) override {
    return cpu_->split(color, key, child.name.substr(child.name.rfind('/') + 1));
  }

  std::vector<int64_t> exchange(const std::vector<int64_t>& mine) override {
    at::Tensor in = at::tensor(mine, at::kLong);
    at::Tensor out = at::empty({static_cast<int64_t>(mine.size()) * size()}, at::kLong);
    cpu_->all_gather(in, out)->wait();
    return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  }

 private:
  // An NCCL call on this communicator: a failure is recorded for the teardown, ends the open
  // group (NCCL's group state is the thread's: it must not stay open), aborts the communicator
  // and throws, naming the call.
  void checked(ncclResult_t rc, const char* call) {
    if (rc == ncclSuccess) return;
    const std::string why =
        detail::concat(call, " returned ", ncclGetErrorString(rc), " (", ncclGetLastError(nullptr), ")");
    teardown_.failed(why);
    if (group_open_) {
      group_open_ = false;
      ncclGroupEnd();  // its result is this failure's
    }
    handle_->abort(why);
    DTRAIN_LIBRARY_FAILURE(nccl_version(), why, " on '", name(), "'; the communicator was aborted");
  }

  // Under issue_mutex_: a launch inside the open group failed (and ended the group): its
  // operations will never run.
  void fail_group(std::exception_ptr error) {
    group_open_ = false;
    for (Pending& p : pending_) p.work->fail(error);
    pending_.clear();
    teardown_.set_unlaunched(0);
  }

  // Launches op on stream_ (deferred to ncclGroupEnd inside a group). Under issue_mutex_.
  void issue(const Op& op) {
    cudaStream_t s = stream_.stream();
    ncclComm_t comm = handle_->comm();
    switch (op.type) {
      case OpType::kBarrier: {
        if (!barrier_buf_.defined()) {
          barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
        }
        checked(ncclAllReduce(barrier_buf_.data_ptr(), barrier_buf_.data_ptr(), 1, ncclFloat32, ncclSum, comm, s),
                "ncclAllReduce");
        break;
      }
      case OpType::kAllReduce:
        checked(ncclAllReduce(op.input.data_ptr(), op.output.data_ptr(), op.output.numel(),
                              nccl_type(op.output.scalar_type()), nccl_reduce(op), comm, s),
                "ncclAllReduce");
        break;
      case OpType::kBroadcast:
        checked(ncclBroadcast(op.output.data_ptr(), op.output.data_ptr(), op.output.numel(),
                              nccl_type(op.output.scalar_type()), op.root, comm, s),
                "ncclBroadcast");
        break;
      case OpType::kReduce:
        checked(ncclReduce(op.input.data_ptr(), op.output.data_ptr(), op.output.numel(),
                           nccl_type(op.output.scalar_type()), nccl_reduce(op), op.root, comm, s),
                "ncclReduce");
        break;
      case OpType::kAllGather:
        checked(ncclAllGather(op.input.data_ptr(), op.output.data_ptr(), op.input.numel(),
                              nccl_type(op.input.scalar_type()), comm, s),
                "ncclAllGather");
        break;
      case OpType::kReduceScatter:
        checked(ncclReduceScatter(op.input.data_ptr(), op.output.data_ptr(), op.output.numel(),
                                  nccl_type(op.input.scalar_type()), nccl_reduce(op), comm, s),
                "ncclReduceScatter");
        break;
      case OpType::kSend:  // root: the peer
        checked(ncclSend(op.input.data_ptr(), op.input.numel(), nccl_type(op.input.scalar_type()), op.root, comm, s),
                "ncclSend");
        break;
      case OpType::kRecv:
        checked(ncclRecv(op.output.data_ptr(), op.output.numel(), nccl_type(op.output.scalar_type()), op.root, comm, s),
                "ncclRecv");
        break;
    }
  }

  // Under issue_mutex_, after the operation's launch: records its end event on stream_ and
  // hands it to the watchdog, which also polls NCCL's asynchronous error (a failed peer or
  // network ends the job at once with NCCL's error, not after the collective timeout) and,
  // once the event fired, releases the operation's tensors.
  void finish(std::shared_ptr<NcclWork> work, uint64_t seq, bool collective) {
    work->end().record(stream_);
    work->mark_launched();
    teardown_.launched(work);
    // Health: an NCCL operation is "reached" once its rank has issued it (its GPU may still
    // be busy with earlier work), completed once its event has fired.
    std::function<std::string()> arrivals;
    std::shared_ptr<OpProgress> progress;
    if (health_ && collective) {
      health_->progress().reached = seq;
      progress = std::shared_ptr<OpProgress>(health_, &health_->progress());
      arrivals = [ticket = health_, seq, window = arrival_window(options().timeout)] {
        return ticket->arrivals(seq, window);
      };
    }
    Watchdog::Entry entry;
    entry.what = work->what();
    entry.timeout = options().timeout;
    entry.done = [work, progress, seq, device = device_] {
      // The watchdog thread has no current device: without the guard the query would create
      // a CUDA context on GPU 0 in every process.
      c10::cuda::CUDAGuard guard(device);
      bool done = work->is_completed();  // releases the tensors once done
      if (done && progress) progress->complete(seq);
      return done;
    };
    entry.abort = [handle = handle_, what = work->what()] { handle->abort("watchdog: " + what); };
    entry.arrivals = std::move(arrivals);
    entry.failure = [handle = handle_] { return handle->async_error(/*report_abort=*/false); };
    entry.owner = this;
    Watchdog::instance().watch(std::move(entry));
  }

  ncclRedOp_t nccl_reduce(const Op& op) const {
    DTRAIN_CHECK(op.reduce != ReduceOp::kAvg || at::isFloatingType(op.input.scalar_type()),
                 "avg needs a floating-point tensor");
    return nccl_op(op.reduce);
  }

  WorkPtr forward_to_cpu(const Op& op) {
    switch (op.type) {
      case OpType::kAllReduce: return cpu_->all_reduce(op.input, op.output, op.reduce);
      case OpType::kBroadcast: return cpu_->broadcast(op.output, op.root);
      case OpType::kAllGather: return cpu_->all_gather(op.input, op.output);
      case OpType::kReduceScatter: return cpu_->reduce_scatter(op.input, op.output, op.reduce);
      case OpType::kBarrier: return cpu_->barrier();
      case OpType::kReduce: return cpu_->reduce(op.output, op.root, op.reduce);
      case OpType::kSend: return cpu_->send(op.input, op.root);
      case OpType::kRecv: return cpu_->recv(op.output, op.root);
    }
    return nullptr;
  }

  const std::shared_ptr<NcclHandle> handle_;
  std::unique_ptr<Communicator> cpu_;
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  // One issue at a time: collectives, point to point, group ends and splits (NCCL's calls on
  // one communicator are not thread-safe).
  std::mutex issue_mutex_;
  at::Tensor barrier_buf_;  // guarded by issue_mutex_
  // begin_group() .. end_group(): operations are launched together at ncclGroupEnd; their
  // end events are recorded and watched then, and their Works hold their tensors meanwhile.
  struct Pending {
    std::shared_ptr<NcclWork> work;
    uint64_t seq;
    bool collective;  // a send or receive takes no part in the health service's progress
  };
  bool grouping_ = false;        // inside begin_group() .. end_group(); guarded by issue_mutex_
  bool group_open_ = false;      // ncclGroupStart called for the current group; guarded by issue_mutex_
  std::vector<Pending> pending_;  // guarded by issue_mutex_
  TeardownTracker teardown_;     // what the destructor decides from
  // Registered over cpu_'s ranks; null for a lone process or without a health service.
  std::shared_ptr<HealthTicket> health_;
};

}  // namespace

std::string gpu_pci_bus_id(c10::Device device) {
  char id[64] = {0};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), device.index()) != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it
    return "";
  }
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const World& world, c10::Device device,
                                                     CommOptions options,
                                                     std::unique_ptr<Communicator> partner) {
  // dtrain drives blocking communicators: each NCCL call has completed or failed when it
  // returns (ncclInProgress is not polled). NCCL_COMM_BLOCKING=0 overrides the configuration
  // and makes calls return ncclInProgress, which would read as a failure after start-up.
  const char* blocking = std::getenv("NCCL_COMM_BLOCKING");
  DTRAIN_CHECK(blocking == nullptr || std::string(blocking) != "0", "--backend=nccl drives blocking NCCL "
               "communicators, but the environment sets NCCL_COMM_BLOCKING=0; unset it (dtrain's watchdog "
               "already bounds every collective by --collective_timeout_s)");
  DTRAIN_CHECK(device.is_cuda(), "the nccl backend needs a CUDA device, but this rank uses ",
               device, "; use --backend=mpi for CPU training");
  CommOptions cpu_options = options;
  std::unique_ptr<Communicator> cpu =
      partner ? std::move(partner)
      : world.size == 1 && !world.has_mpi_launcher()
          ? make_local_communicator(world, cpu_options)
          : make_mpi_communicator(world, c10::Device(c10::kCPU), cpu_options);
  ncclUniqueId id;
  if (cpu->rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  at::Tensor id_bytes = at::from_blob(&id, {static_cast<int64_t>(sizeof(id))}, at::kByte);
  cpu->broadcast(id_bytes, 0)->wait();
  c10::cuda::CUDAGuard guard(device);
  ncclComm_t comm = nullptr;
  {
    WatchedCall bounded(detail::concat("ncclCommInitRank of '", options.name, "' (nccl, rank ", cpu->rank(), "/",
                                       cpu->size(), ")"),
                        options.timeout);
    NCCL_CHECK(ncclCommInitRank(&comm, cpu->size(), id, cpu->rank()));
  }
  // The watchdog stops polling at exit before the CUDA runtime (initialized by now, so its
  // teardown handler was registered earlier and runs later) is torn down.
  static std::once_flag stop_watchdog_at_exit;
  std::call_once(stop_watchdog_at_exit, [] { Watchdog::shutdown_at_exit(); });
  return std::make_unique<NcclCommunicator>(comm, std::move(cpu), device, std::move(options));
}

}  // namespace dtrain::dist
