// "mpi": collectives through MPI, one executor thread per communicator, so MPI calls on a
// communicator happen on one thread in issue order. CPU tensors are passed to MPI directly;
// CUDA tensors are staged through a reusable pinned host buffer on a copy stream of the
// communicator's own (device-generic c10 APIs: no CUDA headers here). Each communicator is
// registered with the runtime's health service, which answers peers' stall checks from the
// operation its executor has entered and the last it finished (see health.h).
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <glog/logging.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>

#include "async.h"
#include "backends.h"
#include "dtrain/dist/error.h"
#include "health.h"
#include "mpi_health.h"
#include "mpi_runtime.h"

namespace dtrain::dist {
namespace {

// MPI counts are ints; large all-reduces and broadcasts go in chunks of this many elements.
constexpr int64_t kMaxCount = int64_t{1} << 30;

// Registers a new communicator with the health service: its members' world ranks and a key
// every member agrees on (the lowest member's creation counter, broadcast from it). Collective
// over comm, on the thread that made it. nullptr when the runtime has no health service.
std::shared_ptr<HealthTicket> join_health(MpiRuntime& runtime, MPI_Comm comm) {
  if (!runtime.health()) return nullptr;
  int size = 0;
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_CHECK(MPI_Comm_group(comm, &group));
  MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> local(size), members(size);
  for (int i = 0; i < size; ++i) local[i] = i;
  int rc = MPI_Group_translate_ranks(group, size, local.data(), world_group, members.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  MPI_CHECK(rc);
  int owner_local =
      static_cast<int>(std::min_element(members.begin(), members.end()) - members.begin());
  int64_t counter = runtime.next_comm_counter();
  MPI_CHECK(MPI_Bcast(&counter, 1, MPI_INT64_T, owner_local, comm));
  CommKey key{members[owner_local], counter, 0};
  return runtime.health()->join(key, std::move(members), std::make_shared<OpProgress>());
}

// Tags of point-to-point messages on a communicator: the data, and (debug mode) a header
// with its dtype and shape that the receiver checks first.
constexpr int kDataTag = 0;
constexpr int kHeaderTag = 1;
constexpr int kHeaderLen = 2 + 8;  // dtype, dims, up to 8 sizes
constexpr int64_t kMaxP2pBytes = int64_t{1} << 30;  // one MPI message's bytes (MPI counts are ints)

std::vector<int64_t> p2p_header(const at::Tensor& t) {
  std::vector<int64_t> h(kHeaderLen, -1);
  h[0] = static_cast<int64_t>(t.scalar_type());
  h[1] = t.dim();
  for (int64_t i = 0; i < std::min<int64_t>(t.dim(), kHeaderLen - 2); ++i) h[2 + i] = t.size(i);
  return h;
}

std::string describe_header(const std::vector<int64_t>& h) {
  std::ostringstream os;
  os << c10::toString(static_cast<at::ScalarType>(h[0])) << "[";
  for (int64_t i = 0; i < std::min<int64_t>(h[1], kHeaderLen - 2); ++i) os << (i ? "," : "") << h[2 + i];
  os << "]";
  return os.str();
}

// One send or receive: its MPI requests (a message per kMaxP2pBytes, and the debug header),
// completed by MPI_Test from whoever asks (the waiting thread, the watchdog), one at a time.
// CUDA tensors go through host memory: a send copies the tensor out when it is issued
// (ordered after the caller's current stream), a receive lands in a host buffer and wait()
// copies it into the tensor on the caller's current stream.
class MpiP2pWork final : public Work {
 public:
  MpiP2pWork(std::shared_ptr<MpiRuntime> runtime, uint64_t seq, std::string what, int peer)
      : runtime_(std::move(runtime)), seq_(seq), what_(std::move(what)), peer_(peer) {}

  void start(OpType type, const at::Tensor& tensor, MPI_Comm comm, bool debug) {
    recv_ = type == OpType::kRecv;
    tensor_ = tensor;
    if (tensor.is_cuda()) cuda_device_ = tensor.device();
    host_ = tensor.is_cuda() ? (recv_ ? at::empty(tensor.sizes(), tensor.options().device(c10::kCPU))
                                      : tensor.to(c10::kCPU))
                             : tensor;
    auto lock = runtime_->lock();
    if (debug) {
      header_ = recv_ ? at::zeros({kHeaderLen}, at::kLong) : at::tensor(p2p_header(tensor), at::kLong);
      post(header_.data_ptr(), static_cast<int64_t>(header_.nbytes()), kHeaderTag, comm);
    }
    char* data = static_cast<char*>(host_.data_ptr());
    const int64_t bytes = static_cast<int64_t>(host_.nbytes());
    for (int64_t off = 0; off < bytes || off == 0; off += kMaxP2pBytes) {
      post(data + off, std::min(kMaxP2pBytes, bytes - off), kDataTag, comm);
      if (bytes == 0) break;
    }
  }

  void wait() override {
    while (!is_completed()) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
    if (recv_ && tensor_.defined() && tensor_.is_cuda() && !copied_) {
      tensor_.copy_(host_);  // on the caller's current stream
      copied_ = true;
      release_buffers();  // a pageable host source is consumed when copy_ returns
    }
  }
  void synchronize() override {
    wait();
    if (cuda_device_) {
      c10::impl::VirtualGuardImpl impl(c10::kCUDA);
      impl.getStream(*cuda_device_).synchronize();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    release_buffers();
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return true;
    std::vector<MPI_Status>& statuses = statuses_;
    int all = 0;
    int rc = MPI_SUCCESS;
    {
      auto mpi_lock = runtime_->lock();
      rc = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &all, statuses.data());
    }
    if (rc != MPI_SUCCESS) {
      // MPI_ERR_IN_STATUS: one message failed, typically a receive smaller than what was sent.
      finish_with(rc == MPI_ERR_IN_STATUS ? truncated_message(statuses) : mpi_error_string(rc));
      // A message still pending (another chunk, the debug header) may yet be written: its
      // buffer must outlive it, so it stays allocated for the process's life.
      const bool pending = std::any_of(requests_.begin(), requests_.end(),
                                       [](MPI_Request r) { return r != MPI_REQUEST_NULL; });
      if (pending) {
        static std::mutex kept_mutex;
        static auto* kept = new std::vector<at::Tensor>();
        std::lock_guard<std::mutex> keep(kept_mutex);
        kept->insert(kept->end(), {host_, tensor_, header_});
      }
      release_buffers();
      return true;
    }
    if (!all) return false;
    done_ = true;
    if (recv_) check_received(statuses);
    // The watchdog keeps this Work until its next poll: let the buffers go now (a CUDA
    // receive keeps them for wait()'s copy).
    if (!(recv_ && tensor_.is_cuda())) release_buffers();
    return true;
  }
  uint64_t sequence() const override { return seq_; }

 private:
  void post(void* buffer, int64_t bytes, int tag, MPI_Comm comm) {
    MPI_Request request = MPI_REQUEST_NULL;
    const int n = static_cast<int>(bytes);
    MPI_CHECK(recv_ ? MPI_Irecv(buffer, n, MPI_BYTE, peer_, tag, comm, &request)
                    : MPI_Isend(buffer, n, MPI_BYTE, peer_, tag, comm, &request));
    requests_.push_back(request);
    statuses_.emplace_back();
    expected_.push_back(bytes);
  }

  // Under mutex_, after every request completed.
  void check_received(const std::vector<MPI_Status>& statuses) {
    size_t first_data = 0;
    if (header_.defined()) {
      first_data = 1;
      const std::vector<int64_t> mine = p2p_header(tensor_);
      const std::vector<int64_t> theirs(header_.data_ptr<int64_t>(), header_.data_ptr<int64_t>() + kHeaderLen);
      if (theirs != mine) {
        finish_with("rank " + std::to_string(peer_) + " sent " + describe_header(theirs) +
                    " but this rank expected " + describe_header(mine) +
                    " (DTRAIN_DEBUG_COLLECTIVES); sender and receiver must agree on dtype and shape");
        return;
      }
    }
    for (size_t i = first_data; i < statuses.size(); ++i) {
      int got = 0;
      MPI_Get_count(&statuses[i], MPI_BYTE, &got);
      if (got != expected_[i]) {
        finish_with("rank " + std::to_string(peer_) + " sent a message of " + std::to_string(got) + " bytes where " +
                    std::to_string(expected_[i]) + " were expected; sender and receiver must agree on dtype and "
                    "shape (DTRAIN_DEBUG_COLLECTIVES=1 names both)");
        return;
      }
    }
  }

  std::string truncated_message(const std::vector<MPI_Status>& statuses) const {
    for (const MPI_Status& st : statuses) {
      if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) {
        return "rank " + std::to_string(peer_) + " sent more than the " + std::to_string(host_.nbytes()) +
               " bytes this " + (recv_ ? "receive" : "send") + " holds (" + mpi_error_string(st.MPI_ERROR) +
               "); sender and receiver must agree on dtype and shape";
      }
    }
    return "MPI_Testall failed";
  }

  void release_buffers() {
    tensor_ = at::Tensor();
    host_ = at::Tensor();
    header_ = at::Tensor();
  }

  void finish_with(const std::string& why) {
    done_ = true;
    error_ = std::make_exception_ptr(Error(what_ + ": " + why));
  }

  std::shared_ptr<MpiRuntime> runtime_;
  const uint64_t seq_;
  const std::string what_;
  const int peer_;
  bool recv_ = false;
  at::Tensor tensor_, host_;
  at::Tensor header_;  // debug mode: the message's dtype and shape (kLong[kHeaderLen])
  std::mutex mutex_;
  std::vector<MPI_Request> requests_;  // guarded by mutex_ after start()
  std::vector<MPI_Status> statuses_;   // one per request, filled by MPI_Testall (polled while waiting)
  std::vector<int64_t> expected_;
  bool done_ = false;        // guarded by mutex_
  bool copied_ = false;      // guarded by mutex_
  std::optional<c10::Device> cuda_device_;
  std::exception_ptr error_;  // guarded by mutex_
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<MpiRuntime> runtime, MPI_Comm comm, int rank, int size,
                  c10::Device device, CommOptions options, std::shared_ptr<HealthTicket> health)
      : Communicator(rank, size, std::move(options)),
        runtime_(std::move(runtime)),
        comm_(comm),
        device_(device),
        health_(std::move(health)),
        executor_(std::make_unique<SerialExecutor>("mpi:" + name())) {}

  ~MpiCommunicator() override {
    executor_.reset();  // finishes queued operations first
    // A point-to-point operation still in flight when its communicator goes is a caller's bug
    // (MPI may still write its buffer): say so, and keep its buffers for the process's life.
    Watchdog::instance().unwatch_owner(this);
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      static std::vector<std::shared_ptr<MpiP2pWork>>* leaked = new std::vector<std::shared_ptr<MpiP2pWork>>();
      for (auto& weak : p2p_) {
        std::shared_ptr<MpiP2pWork> work = weak.lock();
        if (work && !work->is_completed()) {
          LOG(ERROR) << "'" << name() << "' destroyed with a point-to-point operation in flight (#"
                     << work->sequence() << "); wait for sends and receives before destroying it";
          leaked->push_back(std::move(work));
        }
      }
    }
    health_.reset();
    if (comm_ != MPI_COMM_NULL) {
      auto lock = runtime_->lock();
      int rc = MPI_Comm_free(&comm_);
      if (rc != MPI_SUCCESS) LOG(ERROR) << "MPI_Comm_free failed on '" << name() << "'";
    }
  }

  const char* backend() const override { return "mpi"; }
  bool supports(c10::DeviceType type) const override {
    return type == c10::kCPU || type == c10::kCUDA;
  }

  void raw_all_reduce_blocking(const at::Tensor& in, const at::Tensor& out) override {
    DTRAIN_CHECK(
        in.device().is_cpu() && out.device().is_cpu() && in.is_contiguous() && out.is_contiguous(),
        "raw MPI all-reduce takes contiguous CPU tensors");
    const bool in_place = in.data_ptr() == out.data_ptr();
    auto lock = runtime_->lock();
    for (int64_t off = 0; off < out.numel(); off += kMaxCount) {
      int n = static_cast<int>(std::min(kMaxCount, out.numel() - off));
      MPI_CHECK(MPI_Allreduce(in_place ? MPI_IN_PLACE : byte_ptr(in, off), byte_ptr(out, off), n,
                              runtime_->datatype(out.scalar_type()),
                              runtime_->reduce_op(ReduceOp::kSum, out.scalar_type()), comm_));
    }
  }

 protected:
  WorkPtr enqueue(Op op) override {
    auto work = std::make_shared<HostWork>(op.seq);
    std::shared_ptr<c10::Event> ready;
    const at::Tensor& any = op.input.defined() ? op.input : op.output;
    if (any.defined() && any.is_cuda()) {
      // Order after the work already queued on the caller's current stream.
      c10::impl::VirtualGuardImpl impl(c10::kCUDA);
      ready = std::make_shared<c10::Event>(c10::kCUDA);
      ready->record(impl.getStream(any.device()));
    }
    std::string what = describe_op(*this, op.type, op.input, op.reduce, op.root, op.seq);
    executor_->post([this, op = std::move(op), work, ready, what = std::move(what)]() {
      Watchdog::Entry entry;
      entry.what = what;
      entry.timeout = options().timeout;
      entry.done = [work] { return work->is_completed(); };
      entry.abort = [comm = comm_] { MPI_Abort(comm, kExitCollectiveTimeout); };
      entry.arrivals = arrivals_reporter(health_, op.seq);
      uint64_t token = Watchdog::instance().watch(std::move(entry));
      work->mark_started();
      if (health_) health_->progress().reached = op.seq;
      try {
        if (ready) {
          run_staged(op, *ready);
        } else {
          run_host(op, op.input, op.output);
        }
        if (health_) health_->progress().complete(op.seq);
        work->finish();
      } catch (...) {
        if (health_) health_->progress().complete(op.seq);
        work->finish(std::current_exception());
      }
      Watchdog::instance().unwatch(token);
    });
    return work;
  }

  // Posted at once from the calling thread (MPI matches a pair's messages in posting order,
  // apart from the collectives); completed by MPI_Test from wait() and the watchdog.
  WorkPtr enqueue_p2p(P2pOp op) override {
    const std::string what = describe_op(*this, op.type, op.tensor, ReduceOp::kSum, op.peer, op.seq);
    auto work = std::make_shared<MpiP2pWork>(runtime_, op.seq, what, op.peer);
    work->start(op.type, op.tensor, comm_, options().debug_collectives && op.peer != rank());
    Watchdog::Entry entry;
    entry.what = what;
    entry.timeout = options().timeout;
    entry.done = [work] { return work->is_completed(); };  // keeps the buffers alive until done
    entry.abort = [comm = comm_] { MPI_Abort(comm, kExitCollectiveTimeout); };
    entry.arrivals = [peer = op.peer, send = op.type == OpType::kSend] {
      return "rank " + std::to_string(peer) + ", the peer, has not completed the matching " +
             (send ? "recv" : "send");
    };
    entry.owner = this;
    Watchdog::instance().watch(std::move(entry));
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    p2p_.erase(std::remove_if(p2p_.begin(), p2p_.end(), [](const auto& w) { return w.expired(); }), p2p_.end());
    p2p_.push_back(work);
    return work;
  }

  std::unique_ptr<Communicator> do_split(int color, int key, CommOptions child) override {
    std::unique_ptr<Communicator> result;
    executor_->run_sync([&] {
      // The split and the health service's registration wait for every member (bounded by
      // Communicator::split's watch).
      MPI_Comm sub = MPI_COMM_NULL;
      {
        auto lock = runtime_->lock();
        MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
      }
      if (sub == MPI_COMM_NULL) return;
      int r = 0, s = 0;
      std::shared_ptr<HealthTicket> health;
      {
        auto lock = runtime_->lock();
        MPI_CHECK(MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN));
        MPI_CHECK(MPI_Comm_rank(sub, &r));
        MPI_CHECK(MPI_Comm_size(sub, &s));
        health = join_health(*runtime_, sub);
      }
      result = std::make_unique<MpiCommunicator>(runtime_, sub, r, s, device_, std::move(child),
                                                 std::move(health));
    });
    return result;
  }

 public:
  // The arrivals callback of a watchdog entry for operation seq (see Watchdog::Entry).
  std::function<std::string()> arrivals_reporter(std::shared_ptr<HealthTicket> ticket,
                                                 uint64_t seq) const {
    if (!ticket) {
      if (runtime_->health_unavailable().empty()) return nullptr;
      return [why = runtime_->health_unavailable()] {
        return "(which ranks have not arrived is unknown: " + why + ")";
      };
    }
    auto window = arrival_window(options().timeout);
    return [ticket = std::move(ticket), seq, window] { return ticket->arrivals(seq, window); };
  }
  const std::shared_ptr<HealthTicket>& health() const { return health_; }

 protected:
  std::vector<int64_t> exchange(const std::vector<int64_t>& mine) override {
    std::vector<int64_t> all(mine.size() * size());
    executor_->run_sync([&] {
      const int n = static_cast<int>(mine.size());
      collective(
          "MPI_Allgather",
          [&] {
            return MPI_Allgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm_);
          },
          [&](MPI_Request* r) {
            return MPI_Iallgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm_,
                                  r);
          });
    });
    return all;
  }

 private:
  // Runs one MPI collective: `blocking` (the blocking call) with MPI_THREAD_MULTIPLE. When
  // MPI calls are serialized, `start` (its non-blocking variant) under the lock, then
  // MPI_Test under the lock, released between tests: holding the process-wide lock through a
  // blocking collective deadlocks when two ranks enter two communicators' operations in
  // different orders (each waits in MPI for a peer whose thread waits for the lock).
  // `what` names the call in errors ("MPI_Allreduce").
  template <class Blocking, class Start>
  void collective(const char* what, Blocking blocking, Start start) {
    auto check = [what](int rc) {
      if (rc != MPI_SUCCESS) {
        DTRAIN_LIBRARY_FAILURE("MPI (" + mpi_version() + ")", what, " returned ",
                               mpi_error_string(rc));
      }
    };
    if (!runtime_->serialized()) {
      check(blocking());
      return;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    {
      auto lock = runtime_->lock();
      check(start(&request));
    }
    for (int done = 0;;) {
      {
        auto lock = runtime_->lock();
        check(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      }
      if (done) return;
      std::this_thread::yield();
    }
  }

  // Runs op on host tensors (in and out may be the same tensor).
  void run_host(const Op& op, const at::Tensor& in, const at::Tensor& out) {
    switch (op.type) {
      case OpType::kSend:
      case OpType::kRecv:
        throw Error("internal: point-to-point operations do not go through the executor");
      case OpType::kBarrier:
        collective(
            "MPI_Barrier", [&] { return MPI_Barrier(comm_); },
            [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
        return;
      case OpType::kBroadcast: {
        MPI_Datatype type = runtime_->datatype(out.scalar_type());
        for (int64_t off = 0; off < out.numel(); off += kMaxCount) {
          int n = static_cast<int>(std::min(kMaxCount, out.numel() - off));
          void* buf = byte_ptr(out, off);
          collective(
              "MPI_Bcast", [&] { return MPI_Bcast(buf, n, type, op.root, comm_); },
              [&](MPI_Request* r) { return MPI_Ibcast(buf, n, type, op.root, comm_, r); });
        }
        return;
      }
      case OpType::kAllReduce: {
        MPI_Datatype type = runtime_->datatype(out.scalar_type());
        MPI_Op mop = runtime_->reduce_op(op.reduce, out.scalar_type());
        bool in_place = in.data_ptr() == out.data_ptr();
        for (int64_t off = 0; off < out.numel(); off += kMaxCount) {
          int n = static_cast<int>(std::min(kMaxCount, out.numel() - off));
          const void* src = in_place ? MPI_IN_PLACE : byte_ptr(in, off);
          void* dst = byte_ptr(out, off);
          collective(
              "MPI_Allreduce", [&] { return MPI_Allreduce(src, dst, n, type, mop, comm_); },
              [&](MPI_Request* r) { return MPI_Iallreduce(src, dst, n, type, mop, comm_, r); });
        }
        break;
      }
      case OpType::kReduce: {
        MPI_Datatype type = runtime_->datatype(out.scalar_type());
        MPI_Op mop = runtime_->reduce_op(op.reduce, out.scalar_type());
        const bool root = rank() == op.root;
        for (int64_t off = 0; off < out.numel(); off += kMaxCount) {
          int n = static_cast<int>(std::min(kMaxCount, out.numel() - off));
          void* buf = byte_ptr(out, off);
          const void* src = root ? MPI_IN_PLACE : buf;
          void* dst = root ? buf : nullptr;
          collective(
              "MPI_Reduce", [&] { return MPI_Reduce(src, dst, n, type, mop, op.root, comm_); },
              [&](MPI_Request* r) { return MPI_Ireduce(src, dst, n, type, mop, op.root, comm_, r); });
        }
        if (root && op.reduce == ReduceOp::kAvg) out.div_(size());
        return;
      }
      case OpType::kAllGather: {
        int n = per_rank_count(in.numel(), "all_gather");
        MPI_Datatype type = runtime_->datatype(in.scalar_type());
        const bool in_place = byte_ptr(out, int64_t{rank()} * n) == in.data_ptr();
        const void* src = in_place ? MPI_IN_PLACE : in.data_ptr();
        const int send_n = in_place ? 0 : n;
        const MPI_Datatype send_type = in_place ? MPI_DATATYPE_NULL : type;
        void* dst = out.data_ptr();
        collective(
            "MPI_Allgather",
            [&] { return MPI_Allgather(src, send_n, send_type, dst, n, type, comm_); },
            [&](MPI_Request* r) {
              return MPI_Iallgather(src, send_n, send_type, dst, n, type, comm_, r);
            });
        return;
      }
      case OpType::kReduceScatter: {
        int n = per_rank_count(out.numel(), "reduce_scatter");
        MPI_Datatype type = runtime_->datatype(in.scalar_type());
        MPI_Op mop = runtime_->reduce_op(op.reduce, in.scalar_type());
        if (byte_ptr(in, int64_t{rank()} * n) == out.data_ptr() && n > 0) {
          // In place: reduce into a scratch chunk, leaving the other chunks of input intact.
          at::Tensor tmp = at::empty_like(out);
          reduce_scatter(in.data_ptr(), tmp.data_ptr(), n, type, mop);
          out.copy_(tmp);
        } else {
          reduce_scatter(in.data_ptr(), out.data_ptr(), n, type, mop);
        }
        break;
      }
    }
    if (op.reduce == ReduceOp::kAvg) out.div_(size());
  }

  void reduce_scatter(const void* src, void* dst, int n, MPI_Datatype type, MPI_Op mop) {
    collective(
        "MPI_Reduce_scatter_block",
        [&] { return MPI_Reduce_scatter_block(src, dst, n, type, mop, comm_); },
        [&](MPI_Request* r) {
          return MPI_Ireduce_scatter_block(src, dst, n, type, mop, comm_, r);
        });
  }

  // CUDA tensors: copy into pinned host memory, run on host, copy back, on our copy stream.
  void run_staged(const Op& op, const c10::Event& ready) {
    const at::Tensor& in = op.input.defined() ? op.input : op.output;
    c10::DeviceGuard device_guard(in.device());
    if (!copy_stream_) {
      c10::impl::VirtualGuardImpl impl(c10::kCUDA);
      copy_stream_ = impl.getStreamFromGlobalPool(in.device(), /*isHighPriority=*/true);
    }
    ready.block(*copy_stream_);
    c10::StreamGuard stream_guard(*copy_stream_);
    const int64_t in_bytes = op.input.defined() ? op.input.nbytes() : 0;
    const int64_t out_bytes = op.output.defined() ? op.output.nbytes() : 0;
    at::Tensor host_in, host_out;
    switch (op.type) {
      case OpType::kSend:
      case OpType::kRecv:
      case OpType::kBarrier:
        run_host(op, at::Tensor(), at::Tensor());
        return;
      case OpType::kAllReduce:
      case OpType::kBroadcast:
      case OpType::kReduce:
        host_out = stage(out_bytes, op.output);
        // host_out is flat: copy from flat views of the (contiguous) device tensors.
        if (op.type != OpType::kAllReduce || op.input.data_ptr() == op.output.data_ptr()) {
          host_out.copy_(op.output.view(-1), /*non_blocking=*/true);
        } else {
          host_out.copy_(op.input.view(-1),
                         /*non_blocking=*/true);  // reduce in place on the host copy
        }
        host_in = host_out;
        break;
      case OpType::kAllGather:
        host_out = stage(out_bytes, op.output);
        host_in = host_out.narrow(0, int64_t{rank()} * op.input.numel(), op.input.numel());
        host_in.copy_(op.input.view(-1), /*non_blocking=*/true);
        break;
      case OpType::kReduceScatter: {
        at::Tensor buf = stage(in_bytes + out_bytes, op.input);
        host_in = buf.narrow(0, 0, op.input.numel());
        host_out = buf.narrow(0, op.input.numel(), op.output.numel());
        host_in.copy_(op.input.view(-1), /*non_blocking=*/true);
        break;
      }
    }
    copy_stream_->synchronize();
    run_host(op, host_in, host_out);
    op.output.view(-1).copy_(host_out.view(-1), /*non_blocking=*/true);
    copy_stream_->synchronize();
  }

  // A flat pinned host tensor of at least `bytes` bytes, viewed with like's dtype.
  at::Tensor stage(int64_t bytes, const at::Tensor& like) {
    if (!staging_.defined() || staging_.nbytes() < static_cast<size_t>(bytes)) {
      int64_t cap = std::max<int64_t>(bytes, staging_.defined() ? 2 * staging_.nbytes() : 0);
      staging_ = at::empty({std::max<int64_t>(cap, 1)},
                           at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    int64_t elems = bytes / like.element_size();
    return staging_.narrow(0, 0, elems * like.element_size()).view(like.scalar_type());
  }

  static void* byte_ptr(const at::Tensor& t, int64_t element_offset) {
    return static_cast<char*>(t.data_ptr()) + element_offset * t.element_size();
  }

  int per_rank_count(int64_t n, const char* op) const {
    DTRAIN_CHECK(n <= INT_MAX, name(), ".", op, ": ", n,
                 " elements per rank exceed MPI's count limit (2^31-1); split the tensor");
    return static_cast<int>(n);
  }

  std::shared_ptr<MpiRuntime> runtime_;
  MPI_Comm comm_;
  c10::Device device_;
  std::shared_ptr<HealthTicket> health_;    // null without a health service
  std::optional<c10::Stream> copy_stream_;  // used on the executor thread only
  at::Tensor staging_;                      // used on the executor thread only
  std::unique_ptr<SerialExecutor> executor_;
  std::mutex p2p_mutex_;
  std::vector<std::weak_ptr<MpiP2pWork>> p2p_;  // guarded by p2p_mutex_
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const World& world, c10::Device device,
                                                    CommOptions options) {
  std::shared_ptr<MpiRuntime> runtime;
  {
    // MPI's start-up (the first communicator's: MPI_Init_thread, the health service's
    // registration) waits for every rank of the job: a rank stopped or lost before it would
    // hang the others in MPI_Init for good.
    WatchedCall start(detail::concat("MPI start-up (MPI_Init_thread: every rank of the job must start) for '",
                                     options.name, "' (mpi, rank ", world.rank, "/", world.size, ")"),
                      options.timeout);
    runtime = MpiRuntime::acquire();
  }
  runtime->note_timeout(options.timeout);
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  std::shared_ptr<HealthTicket> health;
  // MPI_Comm_dup and the health service's registration wait for every rank.
  WatchedCall bounded(detail::concat("MPI_Comm_dup of MPI_COMM_WORLD for '", options.name, "' (mpi, rank ",
                                     world.rank, "/", world.size, ")"),
                      options.timeout);
  {
    auto lock = runtime->lock();
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(comm, &rank));
    MPI_CHECK(MPI_Comm_size(comm, &size));
  }
  DTRAIN_CHECK(rank == world.rank && size == world.size, "MPI reports rank ", rank, " of ", size,
               " but the launcher's environment says ", world.describe(),
               "; start every rank with the same mpirun/srun command");
  {
    auto lock = runtime->lock();
    health = join_health(*runtime, comm);
  }
  return std::make_unique<MpiCommunicator>(std::move(runtime), comm, rank, size, device,
                                           std::move(options), std::move(health));
}

std::shared_ptr<HealthTicket> sibling_health(const Communicator& partner, int64_t kind) {
  auto* mpi = dynamic_cast<const MpiCommunicator*>(&partner);
  if (!mpi || !mpi->health()) return nullptr;
  return mpi->health()->sibling(kind);
}

}  // namespace dtrain::dist
