// Collectives over the processes of a job (or of a sub-group of it).
//
// A Communicator is created by name from a registry ("mpi", "nccl", "local", "auto").
// Every collective is asynchronous: it validates its arguments on the calling thread,
// enqueues the operation and returns a Work handle. Operations on one communicator run in
// the order they were issued; every rank must issue the same collectives on a communicator
// in the same order (with DTRAIN_DEBUG_COLLECTIVES=1 this is checked before each one).
//
// Memory: the caller keeps ownership of the tensors; every backend holds references to them
// until the operation has completed (on a GPU: until its Work's wait() or synchronize()
// returns, or the backend sees it complete, and never before the operation was launched, which
// inside a group is at end_group()), so dropping them early is safe, also inside a group. Do
// not write to a tensor, or read an output, before wait() returns.
//
// Streams (CUDA tensors): the operation is ordered after the work already queued on the
// caller's current CUDA stream when the collective is issued. After Work::wait() returns the
// result may be used on the caller's current stream (for NCCL wait() makes that stream wait;
// it does not block the host: call Work::synchronize() to block the host as well).
//
// Failures: argument errors throw dtrain::Error at the call. A backend failure is stored in
// the Work and rethrown by wait(). An operation that does not complete within the
// communicator's timeout is reported (operation, sequence number, timeout) by a watchdog
// that then aborts the communicator and exits the process with kExitCollectiveTimeout. An
// operation the backend knows has failed for good (NCCL's asynchronous error: a peer or the
// network failed) ends the process at once with that error and kExitFailure.
//
// Thread-safety: a Communicator may be used from several threads (the autograd engine's
// hooks and the main thread), but operations issued concurrently from different threads
// are ordered by whoever enqueues first, so only do that when the order cannot differ
// across ranks. A group (begin_group() .. end_group()) belongs to the thread that began it:
// while it is open, operations from other threads wait for its end (see begin_group()).
//
// One queue per communicator on NCCL: its collectives and its point-to-point operations run on
// the communicator's one stream, in the order this process issued them, each starting only
// once the one before it has finished. A send or receive therefore waits behind every
// operation issued before it on that communicator (and a collective behind an unmatched
// receive), so every rank must issue them in an order that cannot deadlock: the same
// collectives in the same order, and point-to-point operations that pair up (a send and the
// receive it must proceed with inside one group). Pipelines use a communicator of their own
// (the mesh's pp) for their sends and receives.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/world.h"

namespace dtrain::dist {

enum class ReduceOp { kSum, kAvg, kMax, kMin };
const char* to_string(ReduceOp op);

enum class OpType { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier, kReduce, kSend, kRecv };
const char* to_string(OpType type);

// Completion handle of one collective.
class Work {
 public:
  virtual ~Work() = default;
  // Waits until the result may be used on the caller's current stream (host memory: until it
  // is written). Rethrows the operation's failure, if any. Safe to call more than once.
  virtual void wait() = 0;
  // Blocks the calling host thread until the operation has finished on the device too.
  virtual void synchronize() = 0;
  // Non-blocking: has the operation finished (device work included)?
  virtual bool is_completed() = 0;
  // Sequence number of the operation on its communicator (1, 2, ...).
  virtual uint64_t sequence() const = 0;
  // When the backend began and finished the operation, if it measures that (the MPI
  // backend does, on its executor thread); valid once is_completed(). For timelines.
  virtual bool timing(std::chrono::steady_clock::time_point* start,
                      std::chrono::steady_clock::time_point* end) const {
    return false;
  }
};
using WorkPtr = std::shared_ptr<Work>;

// A Work complete from the start, numbered seq: what an operation that moves nothing returns
// (a skipped collective, the average over one rank).
WorkPtr completed_work(uint64_t seq);

// What a communicator's collectives moved (this rank, since it was created). payload: the bytes
// of the tensors the operations were issued on (all_gather: the gathered output); bus: what
// each rank sends on a ring, the NCCL-tests convention that the ZeRO paper's counts use:
// all_reduce 2 (N-1)/N S, all_gather and reduce_scatter (N-1)/N S, broadcast and reduce S.
// Operations of a one-rank communicator move nothing and are not counted.
struct CommTraffic {
  uint64_t ops = 0;
  double payload_bytes = 0;
  double bus_bytes = 0;
};

struct CommOptions {
  // A collective that has not finished after this long ends the process (see above).
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // Compare operation, dtype, shape and root across ranks before each collective
  // (one small all-gather each). Also switched on by DTRAIN_DEBUG_COLLECTIVES=1.
  bool debug_collectives = false;
  // Name shown in messages ("world", "world/tp0").
  std::string name = "world";
  // For CUDA tensors: the GPU this process uses (nccl needs it; mpi stages through it).
  int cuda_device = -1;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  const CommOptions& options() const { return options_; }
  virtual const char* backend() const = 0;
  // Whether this backend runs collectives on tensors of this device type.
  virtual bool supports(c10::DeviceType device) const = 0;

  // tensor := op over ranks of tensor. kAvg needs a floating-point dtype.
  WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // output := op over ranks of input; input is left unchanged. Same shape and dtype.
  WorkPtr all_reduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op);
  // tensor := root's tensor.
  WorkPtr broadcast(const at::Tensor& tensor, int root);
  // root's tensor := op over ranks of tensor. On the other ranks the tensor's contents are
  // unspecified afterwards (a backend may use it as scratch). kAvg needs a floating-point
  // dtype.
  WorkPtr reduce(const at::Tensor& tensor, int root, ReduceOp op = ReduceOp::kSum);
  // output (size() * input.numel() elements) := inputs of ranks 0..size()-1, concatenated.
  // In place when input is output's slice for this rank.
  WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output);
  // output (n elements) := op over ranks of input's chunk rank(), where input has
  // size() * n elements. In place when output is input's chunk for this rank.
  WorkPtr reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                         ReduceOp op = ReduceOp::kSum);
  // Completes once every rank has called it.
  WorkPtr barrier();

  // Point to point (pipeline stages), not collective: only this rank and `peer` take part.
  // send: `tensor` goes to rank `peer` of this communicator. recv: `tensor`, whose shape and
  // dtype the receiver fixes, is filled from `peer`; over MPI and local a message of another
  // size is an error at wait(), while NCCL cannot tell (the pair never completes, and the
  // timeout below names it). A rank's sends to one peer match that peer's receives from it one
  // to one, in issue order, whatever else either issues in between; a rank may send to itself
  // (over NCCL inside a group with the matching receive). Both are
  // asynchronous: the Work's sequence() counts the operations of that direction with that
  // peer (send #3 to rank 1). The MPI and local backends do not order them with this
  // communicator's collectives; NCCL runs both on one stream in issue order (see the top of
  // this file: issue them so that no rank can wait for a peer that waits for it).
  // The timeout, the stall warning and the watchdog's exit apply as to collectives, naming
  // the peer ("send #3 to rank 1 on 'world' (mpi, rank 0/2, float32[8,1024])"). With
  // DTRAIN_DEBUG_COLLECTIVES=1 each MPI or local message carries its dtype and shape, and a
  // receive that expected another is reported naming both sides. Backends without point to point (none
  // of the built-in ones) throw dtrain::Error.
  WorkPtr send(const at::Tensor& tensor, int peer);
  WorkPtr recv(const at::Tensor& tensor, int peer);

  // Operations issued between begin_group() and end_group(), back to back from one thread,
  // may be launched as one: NCCL groups them (ncclGroupStart/ncclGroupEnd), so a bucket
  // reduced to several owners is one launch instead of one per owner. Wait on their Works
  // only after end_group(): on NCCL nothing of the group is launched before it, and wait() or
  // synchronize() on one of its Works throws dtrain::Error. The other backends run them one
  // by one, as without a group. Groups do not nest (begin_group() inside one throws
  // dtrain::Error). CommGroup (below) pairs the two calls.
  // A group belongs to the thread that began it (NCCL's group state is per thread): until
  // that thread calls end_group(), any operation, begin_group() or split() on this
  // communicator from another thread blocks, and then runs after the group, in none. So the
  // thread holding a group open must not wait for another thread that issues on this
  // communicator. end_group() on a thread that holds no group here throws dtrain::Error.
  void begin_group();
  void end_group();

  // Collective and synchronous: ranks passing the same color form a new communicator,
  // ranked by (key, rank). Returns nullptr for color < 0 (the rank joins no group). The
  // child inherits options (timeout, debug) and is named "<name>/<suffix>". Bounded by the
  // timeout like a collective: a member that never arrives ends the process (exit 124).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& suffix);
  // split() for a communicator that will carry host (CPU) tensors only, such as a background
  // checkpoint's agreement: the NCCL backend splits only the MPI communicator beside it, so no
  // NCCL communicator is made (no GPU buffers, no NCCL set-up); the others split as split().
  // Give the child host tensors only: over NCCL it is the MPI (or lone local) partner's.
  std::unique_ptr<Communicator> split_host(int color, int key, const std::string& suffix);

  // For benchmarks only: the backend's own blocking all-reduce (sum) of input into output
  // (in place when they are the same tensor) from the calling thread, bypassing the queue,
  // checks and watchdog. The communicator must be idle.
  virtual void raw_all_reduce_blocking(const at::Tensor& input, const at::Tensor& output) = 0;

  uint64_t issued() const { return seq_; }
  CommTraffic traffic() const;


 protected:
  Communicator(int rank, int size, CommOptions options);

  struct Op {
    OpType type;
    at::Tensor input;
    at::Tensor output;  // == input for in-place ops
    ReduceOp reduce = ReduceOp::kSum;
    int root = 0;
    uint64_t seq = 0;
  };
  virtual WorkPtr enqueue(Op op) = 0;
  struct P2pOp {
    OpType type;  // kSend or kRecv
    at::Tensor tensor;
    int peer = 0;
    uint64_t seq = 0;  // this direction's count with this peer (1, 2, ...)
  };
  virtual WorkPtr enqueue_p2p(P2pOp op);
  virtual std::unique_ptr<Communicator> do_split(int color, int key, CommOptions child) = 0;
  // split_host()'s: split() unless the backend has a host partner to split instead.
  virtual std::unique_ptr<Communicator> do_split_host(int color, int key, CommOptions child) {
    return do_split(color, key, std::move(child));
  }
  // A group's begin and end as the backend sees them, on the group's thread (the base class
  // keeps the thread ownership). Defaults: nothing (operations run one by one).
  virtual void do_begin_group() {}
  virtual void do_end_group() {}
  // Synchronous all-gather of one fixed-length int64 vector per rank (host memory), ordered
  // with the queued operations. Used by the debug checks.
  virtual std::vector<int64_t> exchange(const std::vector<int64_t>& mine) = 0;

 private:
  WorkPtr submit(Op op);
  WorkPtr submit_p2p(OpType type, const at::Tensor& tensor, int peer);
  std::unique_ptr<Communicator> split_as(int color, int key, const std::string& suffix, bool host_only);
  void check_matching(const Op& op);

  int rank_;
  int size_;
  CommOptions options_;
  uint64_t seq_ = 0;  // guarded by submit_mutex_
  std::vector<uint64_t> sends_, recvs_;  // per peer: point-to-point counts, guarded by submit_mutex_
  CommTraffic traffic_;  // guarded by submit_mutex_
  std::unique_ptr<std::mutex> submit_mutex_;
  // The open group's owner thread, and the mutex it holds from begin_group() to end_group()
  // (taken before submit_mutex_ by every other thread's operation).
  struct GroupGate;
  std::unique_ptr<GroupGate> group_;
};

// begin_group() on construction, end_group() at close() or destruction (where a failure is
// logged, not thrown: call close() to see it).
class CommGroup {
 public:
  explicit CommGroup(Communicator& comm) : comm_(&comm) { comm_->begin_group(); }
  CommGroup(const CommGroup&) = delete;
  CommGroup& operator=(const CommGroup&) = delete;
  ~CommGroup();
  void close();

 private:
  Communicator* comm_;
};

// Names of the backends compiled into this build ("local", "mpi", and "nccl" when built
// with NCCL).
std::vector<std::string> available_backends();

// Variable-sized gather (MPI's allgatherv, which NCCL lacks), built on all_gather so every
// backend has it: rank r contributes rows [n_r, ...] (the trailing sizes and dtype equal on
// every rank); the result is every rank's rows concatenated in rank order, [sum n_r, ...], and
// counts (when given) receives n_0..n_{size-1}. Two collectives: the counts, then the rows
// padded to the largest count (so size() x max n_r rows travel). Collective and synchronous.
at::Tensor all_gather_rows(Communicator& comm, const at::Tensor& rows, std::vector<int64_t>* counts = nullptr);
// The second half alone, for a caller that already has every rank's count (counts[r] = rank r's
// rows; this rank's must equal rows.size(0)): one collective.
at::Tensor all_gather_rows(Communicator& comm, const at::Tensor& rows, const std::vector<int64_t>& counts);
// Every rank's `mine`, in rank order (one all-gather of an int64 on `device`).
std::vector<int64_t> all_gather_counts(Communicator& comm, int64_t mine, c10::Device device);

// Creates the communicator of the whole job.
//  "local": world size 1 only, no MPI needed; collectives are local copies.
//  "mpi":   CPU tensors; CUDA tensors are staged through a reusable pinned host buffer.
//  "nccl":  CUDA tensors on its own stream; bootstrapped over MPI, whose communicator also
//           carries CPU tensors.
//  "auto":  "nccl" for a CUDA device when built with NCCL, else "mpi" when an MPI launcher
//           started the job, else "local".
// Throws dtrain::Error for an unknown name (listing the known ones), a backend not compiled
// in (saying how to build it), or a world the backend cannot serve.
std::unique_ptr<Communicator> create_communicator(const std::string& backend,
                                                  const World& world, c10::Device device,
                                                  CommOptions options = {});

}  // namespace dtrain::dist

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
