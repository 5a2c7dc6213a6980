// "nccl": collectives on CUDA tensors through NCCL, on the communicator's own CUDA stream,
// ordered after the caller's current stream by an event and back by Work::wait(). The
// NCCL unique id is broadcast over the partner CPU communicator (MPI, or local for a lone
// process), which also carries collectives on CPU tensors.
// Stall reports: an NCCL communicator registers with the health service over its MPI
// partner's ranks (as kind 1), so its stall warnings name the ranks that have not reached an
// operation too. For NCCL, "reached" means the rank has issued the operation (its GPU may
// still be busy with earlier work) and "completed" that the operation's event has fired
// (seen by the watchdog's poll). A lone process has no health service and no peers.
#include <nccl.h>

#include <mutex>

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

namespace dtrain::dist {
namespace {

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

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

class NcclWork final : public Work {
 public:
  NcclWork(uint64_t seq, c10::Device device, ncclComm_t comm, bool host_blocking)
      : seq_(seq), device_(device), comm_(comm), host_blocking_(host_blocking) {}
  at::cuda::CUDAEvent& end() { return end_; }
  void wait() override {
    c10::cuda::CUDAGuard guard(device_);
    end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    if (host_blocking_) end_.synchronize();
    check_async();
  }
  void synchronize() override {
    end_.synchronize();
    check_async();
  }
  bool is_completed() override { return end_.query(); }
  uint64_t sequence() const override { return seq_; }

 private:
  void check_async() {
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      DTRAIN_LIBRARY_FAILURE(nccl_version(), "collective #", seq_, " failed asynchronously: ",
                             ncclGetErrorString(async));
    }
  }
  const uint64_t seq_;
  const c10::Device device_;
  ncclComm_t comm_;
  const bool host_blocking_;
  at::cuda::CUDAEvent end_{cudaEventDisableTiming};
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, std::unique_ptr<Communicator> cpu, c10::Device device,
                   CommOptions options)
      : Communicator(cpu->rank(), cpu->size(), std::move(options)), comm_(comm),
        cpu_(std::move(cpu)), device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())),
        health_(sibling_health(*cpu_, /*kind=*/1)) {}

  ~NcclCommunicator() override {
    // No watchdog poll may touch comm_ once it is destroyed.
    Watchdog::instance().unwatch_owner(this);
    health_.reset();
    c10::cuda::CUDAGuard guard(device_);
    ncclResult_t rc = ncclCommDestroy(comm_);
    if (rc != ncclSuccess) LOG(ERROR) << "ncclCommDestroy failed: " << ncclGetErrorString(rc);
  }

  const char* backend() const override { return "nccl"; }
  bool supports(c10::DeviceType type) const override {
    return type == c10::kCUDA || cpu_->supports(type);
  }

  void raw_all_reduce_blocking(const at::Tensor& in, const at::Tensor& out) override {
    DTRAIN_CHECK(in.is_cuda() && out.is_cuda(), "raw NCCL all-reduce takes CUDA tensors");
    c10::cuda::CUDAGuard guard(device_);
    auto stream = c10::cuda::getCurrentCUDAStream(device_.index());
    NCCL_CHECK(ncclAllReduce(in.data_ptr(), out.data_ptr(), out.numel(),
                             nccl_type(out.scalar_type()), ncclSum, comm_, stream.stream()));
    stream.synchronize();
  }

 protected:
  void begin_group() override {
    DTRAIN_CHECK(!grouping_, name(), ": begin_group() inside a group; groups do not nest");
    grouping_ = true;
  }

  void end_group() override {
    DTRAIN_CHECK(grouping_, name(), ": end_group() without begin_group()");
    grouping_ = false;
    if (!group_open_) return;
    group_open_ = false;
    std::vector<Pending> pending = std::move(pending_);
    pending_.clear();
    c10::cuda::CUDAGuard guard(device_);
    NCCL_CHECK(ncclGroupEnd());
    // The grouped operations are launched only now: their end events go after them.
    for (Pending& p : pending) finish(std::move(p.work), p.what, p.seq, p.collective);
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
    c10::cuda::CUDAGuard guard(device_);
    if (!group_open_) {
      // Order after the caller's queued work (once per group: the caller issues a group's
      // operations back to back).
      at::cuda::CUDAEvent ready(cudaEventDisableTiming);
      ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
      ready.block(stream_);
      if (grouping_) {
        NCCL_CHECK(ncclGroupStart());
        group_open_ = true;
      }
    }
    auto work = std::make_shared<NcclWork>(op.seq, device_, comm_, op.type == OpType::kBarrier);
    issue(op);
    for (const at::Tensor* t : {&op.input, &op.output}) {
      if (t->defined() && t->numel() > 0) {
        c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream_);
      }
    }
    std::string what = describe_op(*this, op.type, op.input, op.reduce, op.root, op.seq);
    if (group_open_) {
      pending_.push_back({work, std::move(what), op.seq, collective});
    } else {
      finish(work, what, op.seq, collective);
    }
    return work;
  }

  std::unique_ptr<Communicator> do_split(int color, int key, CommOptions child) override {
    auto cpu_child = cpu_->split(color, key, child.name.substr(child.name.rfind('/') + 1));
    c10::cuda::CUDAGuard guard(device_);
    ncclComm_t sub = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    if (color < 0 || sub == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(sub, std::move(cpu_child), device_, std::move(child));
  }

  std::vector<int64_t> exchange(const std::vector<int64_t>& mine) override {
    at::Tensor in = at::tensor(mine, at::kLong);
    at::Tensor out = at::empty({static_cast<int64_t>(mine.size()) * size()}, at::kLong);
    cpu_->all_gather(in, out)->wait();
    return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  }

 private:
  // Launches op on stream_ (deferred to ncclGroupEnd inside a group).
  void issue(const Op& op) {
    cudaStream_t s = stream_.stream();
    switch (op.type) {
      case OpType::kBarrier: {
        if (!barrier_buf_.defined()) {
          barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
        }
        NCCL_CHECK(ncclAllReduce(barrier_buf_.data_ptr(), barrier_buf_.data_ptr(), 1, ncclFloat32,
                                 ncclSum, comm_, s));
        break;
      }
      case OpType::kAllReduce:
        NCCL_CHECK(ncclAllReduce(op.input.data_ptr(), op.output.data_ptr(), op.output.numel(),
                                 nccl_type(op.output.scalar_type()), nccl_reduce(op), comm_, s));
        break;
      case OpType::kBroadcast:
        NCCL_CHECK(ncclBroadcast(op.output.data_ptr(), op.output.data_ptr(), op.output.numel(),
                                 nccl_type(op.output.scalar_type()), op.root, comm_, s));
        break;
      case OpType::kReduce:
        NCCL_CHECK(ncclReduce(op.input.data_ptr(), op.output.data_ptr(), op.output.numel(),
                              nccl_type(op.output.scalar_type()), nccl_reduce(op), op.root, comm_, s));
        break;
      case OpType::kAllGather:
        NCCL_CHECK(ncclAllGather(op.input.data_ptr(), op.output.data_ptr(), op.input.numel(),
                                 nccl_type(op.input.scalar_type()), comm_, s));
        break;
      case OpType::kReduceScatter:
        NCCL_CHECK(ncclReduceScatter(op.input.data_ptr(), op.output.data_ptr(), op.output.numel(),
                                     nccl_type(op.input.scalar_type()), nccl_reduce(op), comm_, s));
        break;
      case OpType::kSend:  // root: the peer
        NCCL_CHECK(ncclSend(op.input.data_ptr(), op.input.numel(), nccl_type(op.input.scalar_type()), op.root,
                            comm_, s));
        break;
      case OpType::kRecv:
        NCCL_CHECK(ncclRecv(op.output.data_ptr(), op.output.numel(), nccl_type(op.output.scalar_type()), op.root,
                            comm_, s));
        break;
    }
  }

  // Records the operation's end event on stream_ (after its launch) and hands it to the
  // watchdog, which also polls NCCL's asynchronous error: a failed peer or network ends the
  // job at once with NCCL's error, not after the collective timeout.
  void finish(std::shared_ptr<NcclWork> work, const std::string& what, uint64_t seq, bool collective) {
    work->end().record(stream_);
    auto* done_event = &work->end();
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
    entry.what = what;
    entry.timeout = options().timeout;
    entry.done = [work, done_event, progress, seq, device = device_] {
      // The watchdog thread has no current device: without the guard the query would create
      // a CUDA context on GPU 0 in every process.
      c10::cuda::CUDAGuard guard(device);
      bool done = done_event->query();
      if (done && progress) progress->complete(seq);
      return done;
    };
    entry.abort = [comm = comm_] { ncclCommAbort(comm); };
    entry.arrivals = std::move(arrivals);
    entry.failure = [comm = comm_]() -> std::string {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) return "";
      if (async == ncclSuccess || async == ncclInProgress) return "";
      const char* last = ncclGetLastError(comm);
      return nccl_version() + " reported " + ncclGetErrorString(async) +
             (last && *last ? std::string(" (") + last + ")" : std::string());
    };
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

  ncclComm_t comm_;
  std::unique_ptr<Communicator> cpu_;
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  at::Tensor barrier_buf_;
  // begin_group() .. end_group(): operations are launched together at ncclGroupEnd; their
  // end events are recorded and watched then.
  struct Pending {
    std::shared_ptr<NcclWork> work;
    std::string what;
    uint64_t seq;
    bool collective;  // a send or receive takes no part in the health service's progress
  };
  bool grouping_ = false;    // inside begin_group() .. end_group()
  bool group_open_ = false;  // ncclGroupStart called for the current group
  std::vector<Pending> pending_;
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
  NCCL_CHECK(ncclCommInitRank(&comm, cpu->size(), id, cpu->rank()));
  // The watchdog stops polling at exit before the CUDA runtime (initialized by now, so its
  // teardown handler was registered earlier and runs later) is torn down.
  static std::once_flag stop_watchdog_at_exit;
  std::call_once(stop_watchdog_at_exit, [] { Watchdog::shutdown_at_exit(); });
  return std::make_unique<NcclCommunicator>(comm, std::move(cpu), device, std::move(options));
}

}  // namespace dtrain::dist
